"""Every private CPython interface the hit path uses, proven against the public one it stands
for, on each Python the torch-free core runs on (3.10–3.13). Each saves an import a torch-free
hit would otherwise pay (``json``) or a per-call cost; if a release changes one, the test here
fails instead of the cache quietly computing another key. (The others were measured and dropped:
docs/design.md, "Stand-ins for standard modules".)

- ``_json``'s C encoder and scanner (``stubcache.edge.cjson``; differential tests of every value in
  ``test_hitpath_imports.py``): here, that the C path is the one taken on CPython.
- ``os.environ._data`` with ``encodekey``/``decodevalue`` (``stubcache.key.fingerprint``).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stubcache.edge import cjson
from stubcache.key import fingerprint

from .conftest import run_py

CPYTHON = platform.python_implementation() == "CPython"
pytestmark = pytest.mark.skipif(not CPYTHON, reason="the private interfaces are CPython's")


# --- _json -----------------------------------------------------------------------------------


def test_the_json_c_functions_are_found():
    assert cjson._c_make_encoder is not None and cjson._c_make_scanner is not None


def test_a_fresh_process_encodes_and_decodes_without_json():
    """The C path is the one taken (else the fallback imports ``json``) and gives json's text."""
    doc = {"key": "ab" * 16, "n": [1, 2.5, -0.0, 1e300, None, True], "s": "é\u2028\x00\"\\", "d": {"z": 1, "a": []}}
    proc = run_py(f"""
        import sys
        from stubcache.edge import cjson
        doc = {doc!r}
        out = [cjson.dumps(doc, sort_keys=True, separators=(",", ":")), cjson.dumps(doc, ensure_ascii=False)]
        assert cjson.loads(out[0]) == doc and cjson.loads(out[1].encode()) == doc
        print(repr(out), "json" in sys.modules)
        """)
    text, imported = proc.stdout.rsplit(" ", 1)
    assert imported.strip() == "False"
    assert eval(text) == [json.dumps(doc, sort_keys=True, separators=(",", ":")), json.dumps(doc, ensure_ascii=False)]


# --- os.environ._data ------------------------------------------------------------------------

_names = st.sampled_from(fingerprint.KEY_ENV_VARS)
_values = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20) | \
    st.binary(min_size=1, max_size=8).filter(lambda b: b"\0" not in b).map(os.fsdecode)  # surrogateescape


def _public_env() -> dict[str, str]:
    out = {}
    for name in fingerprint.KEY_ENV_VARS:
        value = os.environ.get(name)
        if value is None or (name in fingerprint._LOCALE_VARS and fingerprint._neutral_locale(value)):
            continue
        if name == "TORCH_CUDA_ARCH_LIST" and not value.strip():
            continue  # "" is torch's "detect", keyed as unset (docs/engines.md)
        out[name] = value
    return out


def test_the_raw_environment_mapping_is_found():
    assert fingerprint._ENV_DATA is not None and fingerprint._ENV_DATA is os.environ._data


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_names, st.none() | _values), max_size=8))
def test_the_raw_environment_reads_what_os_environ_holds(changes):
    saved = {n: os.environ.get(n) for n in fingerprint.KEY_ENV_VARS}
    try:
        for name, value in changes:
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
            assert fingerprint.env_from_snapshot(fingerprint.env_snapshot()) == _public_env()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --- _ctypes.dlopen --------------------------------------------------------------------------


def test_a_hit_dlopens_as_ctypes_cdll_does(tmp_path):
    """The compact hit path loads a library with ``_ctypes.dlopen(path, ctypes.DEFAULT_MODE)``
    (``stubcache.hit._load_checked``), the call ``ctypes.CDLL(path)`` makes: in a fresh process
    the two give the same handle, and the library's symbols stay out of the global scope, as
    ``CDLL``'s ``RTLD_LOCAL`` keeps them."""
    src = tmp_path / "probe.c"
    src.write_text('int stubcache_probe_dlopen(void) { return 41; }\n')
    lib = tmp_path / "libprobe.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=120)
    proc = run_py(f"""
        import ctypes, os
        from stubcache import hit
        st = os.stat({str(lib)!r})
        fd = os.open({str(lib)!r}, os.O_RDONLY)
        handle = hit._load_checked({str(lib)!r}, st, fd)
        cdll = ctypes.CDLL({str(lib)!r})
        assert handle == cdll._handle, (handle, cdll._handle)
        assert cdll.stubcache_probe_dlopen() == 41
        assert not hasattr(ctypes.CDLL(None), "stubcache_probe_dlopen")  # RTLD_LOCAL
        print("ok")
        """)
    assert proc.stdout.strip() == "ok"
