"""Runs only when Python mistakes this repository's directory for the ``stubcache`` package.

Started from the directory that *contains* a stubcache clone, ``import stubcache`` finds the
clone's directory (it has no ``__init__.py``) before the installed package and makes it an empty
namespace package: ``stubcache.load_inline`` is then an ``AttributeError`` and
``python -m stubcache`` lands here.
"""

import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.stderr.write(
    f"stubcache: Python imported the directory {here} (a stubcache clone) as the package 'stubcache',\n"
    "because it sits in the current directory and shadows the installed package.\n"
    f"Run from another directory (for example: cd {here}) or rename the clone.\n")
sys.exit(2)
