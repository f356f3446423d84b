"""Key soundness, the long tail (issue 19): each test closes one class of hole, with the
protocol of tests/test_key_soundness.py (build -> change -> a fresh process loads the new
behaviour -> revert -> the old entry hits again without a compile)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from stubcache import StubCache, StubSpec

from .conftest import run_py
from .test_key_soundness import child, cycle, value_src


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --- class 1: paths as the compiler resolves them -------------------------------------------


def test_paths_through_a_symlink_and_dotdot_are_tracked_as_the_kernel_resolves_them(cache_root, cxx, tmp_path):
    """``-I p/link`` (link -> A/inc) and ``inc/h.h`` doing ``#include "../x.h"``: gcc opens
    ``p/link/../x.h``, which is ``A/x.h``, not ``p/x.h`` (a decoy here). Likewise an include path
    ``p/current/../shared`` with ``current`` a symlink. Collapsing ``..`` on paper hashed the
    decoy (a stale hit) or a missing file (never published: a private build forever)."""
    p = tmp_path / "p"
    _write(p / "A" / "inc" / "h.h", '#include "../x.h"\n')
    real = p / "A" / "x.h"
    _write(real, "#define VAL 1\n")
    _write(p / "x.h", "#define VAL 9\n")  # what normpath("p/link/../x.h") names
    (p / "link").symlink_to("A/inc")
    spec = {"name": "kpath_link", "cpp_sources": value_src('#include "h.h"'), "extra_cflags": [f"-I{p}/link"]}
    cycle(cxx, spec, lambda: real.write_text("#define VAL 2\n"), lambda: real.write_text("#define VAL 1\n"))

    # Re-pointing the link is a change too: B/x.h is what the compiler reads now.
    _write(p / "B" / "inc" / "h.h", '#include "../x.h"\n')
    _write(p / "B" / "x.h", "#define VAL 3\n")

    def point(target: str):
        def go():
            (p / "link").unlink()
            (p / "link").symlink_to(target)
        return go

    cycle(cxx, spec, point("B/inc"), point("A/inc"), new_value=3)

    shared = p / "A" / "shared" / "s.h"
    _write(shared, "#define VAL 1\n")
    _write(p / "shared" / "s.h", "#define VAL 9\n")  # what abspath("p/current/../shared") names
    (p / "A" / "v1").mkdir()
    (p / "current").symlink_to("A/v1")
    spec = {"name": "kpath_inc", "cpp_sources": value_src('#include "s.h"'),
            "extra_include_paths": [f"{p}/current/../shared"]}
    assert StubSpec(**spec).extra_include_paths == (f"{p}/current/../shared",)
    cycle(cxx, spec, lambda: shared.write_text("#define VAL 2\n"), lambda: shared.write_text("#define VAL 1\n"))
    entry = StubCache().lookup(StubSpec(**spec))
    assert entry is not None and f"{p}/current/../shared/s.h" in entry.manifest.headers
    assert f"{p}/current/../shared" in entry.manifest.inputs["search"], "the search order is recorded"
