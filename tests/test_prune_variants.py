"""Evicting an entry removes what points at it: its ``variants/<base>/<key>`` marker and its
``state/inputs-<key>.json`` signature memo (nearly every entry is a variant: any header the
fingerprint does not pin makes one)."""

from __future__ import annotations

import os
from pathlib import Path

from .conftest import run_py
from .test_cli_support import cli_json

LOAD_VARIANT = """
import sys, stubcache
c = stubcache.StubCache()
spec = stubcache.StubSpec(sys.argv[1] if len(sys.argv) > 1 else "variant",
                          '#include "my.h"\\nextern "C" int value(void) {{ return V; }}\\n',
                          extra_include_paths=[{inc!r}])
e = c.get_or_build(spec)
print(c.load_entry(e).value(), e.key, e.manifest.base_key)
"""


def _files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")} if d.exists() else set()


def test_prune_and_clear_remove_variant_markers_and_input_memos(cache_root, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    header = inc / "my.h"
    header.write_text("#define V 7\n")
    code = LOAD_VARIANT.format(inc=str(inc))
    out = run_py(code).stdout.split()
    assert out[0] == "7"
    key, base = out[1], out[2]
    assert key != base  # a variant
    v1 = cache_root / "v1"
    assert (v1 / "variants" / base / key).is_file()
    # a header touched but unchanged: the next hit re-hashes it and remembers its signature
    st = header.stat()
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns - 10**10))  # a new mtime, the same bytes
    assert run_py(code).stdout.split()[:2] == ["7", key]
    memo = v1 / "state" / f"inputs-{key}.json"
    assert memo.is_file()

    res = cli_json(cache_root, "prune", "--max-size", "0", "--yes")
    assert res["summary"]["removed"] == 1
    assert not (v1 / "entries" / key).exists()
    assert _files(v1 / "variants") == set(), "eviction left the variant marker behind"
    assert not memo.exists(), "eviction left the entry's input memo behind"

    # the same through clear, and the variant still builds and hits afterwards
    assert run_py(code).stdout.split()[:2] == ["7", key]
    assert (v1 / "variants" / base / key).is_file()
    cli_json(cache_root, "clear", "--yes")
    assert _files(v1 / "variants") == set()
    assert run_py(code).stdout.split()[:2] == ["7", key]
    assert run_py(code).stdout.split()[:2] == ["7", key]
