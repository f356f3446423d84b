"""The distribution as users install it: a wheel built from a copy of the checkout carries the
one version literal, the ``py.typed`` markers of both packages, and no test-only modules."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import stubcache

from .conftest import REPO


def test_one_version_literal():
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", stubcache.__version__)
    literals = [p.relative_to(REPO) for p in (REPO / "stubcache").rglob("*.py")
                if re.search(r"^__version__\s*=", p.read_text(), re.M)]
    assert [str(p) for p in literals] == ["stubcache/storage/manifest.py"]
    assert not re.search(r"^version\s*=\s*\"", (REPO / "pyproject.toml").read_text(), re.M)


def test_wheel_has_the_version_py_typed_and_no_test_helpers(tmp_path):
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("needs pip to build a wheel")
    src = tmp_path / "src"  # a copy, so the build's scratch files never land in the checkout
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                              "results", ".pytest_cache"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    [wheel] = (tmp_path / "dist").glob("stubcache-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"stubcache/py.typed", "kvarena/py.typed"} <= names
    assert not any("synthetic" in n for n in names)
    metadata = zipfile.ZipFile(wheel).read(f"stubcache-{stubcache.__version__}.dist-info/METADATA").decode()
    assert f"\nVersion: {stubcache.__version__}\n" in metadata
