"""``python -m stubcache``: the same as the ``stubcache`` console script."""

import sys

from .cli import main

sys.exit(main())
