"""Every private CPython interface the hit path uses, proven against the public one it stands
for, on each Python the torch-free core runs on (3.10–3.13). Each saves an import a hit would
otherwise pay (``json``, ``hashlib``'s OpenSSL, ``threading``) or a per-call cost; if a release
changes one, the test here fails instead of the cache quietly computing another key.

- ``_json``'s C encoder and scanner (``stubcache.edge._json``; differential tests of every value in
  ``test_hitpath_imports.py``): here, that the C path is the one taken on CPython.
- ``_sha256``/``_sha2``'s built-in SHA-256 (``stubcache.edge._digest``).
- ``os.environ._data`` with ``encodekey``/``decodevalue`` (``stubcache.key.fingerprint``).
- ``_thread.allocate_lock``, ``_thread.RLock`` and ``_thread._local`` (``_log``, ``patch``,
  ``progress``): the very objects ``threading`` hands out.
"""

from __future__ import annotations

import _thread
import hashlib
import json
import os
import platform
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stubcache.edge import _digest, _json
from stubcache.key import fingerprint

from .conftest import run_py

CPYTHON = platform.python_implementation() == "CPython"
pytestmark = pytest.mark.skipif(not CPYTHON, reason="the private interfaces are CPython's")


# --- _sha256 / _sha2 -------------------------------------------------------------------------


def test_the_builtin_sha256_is_found_not_hashlibs():
    # The constructor itself (``_digest._small`` is only set in a process without hashlib).
    builtin = _digest._builtin_sha256()
    assert builtin is not hashlib.sha256
    assert builtin.__module__ in ("_sha256", "_sha2"), builtin.__module__


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=5000), max_size=5))
def test_the_builtin_sha256_is_sha256(chunks):
    ours, theirs = _digest._builtin_sha256()(), hashlib.sha256()
    for c in chunks:
        ours.update(c)
        theirs.update(c)
        assert ours.copy().hexdigest() == theirs.copy().hexdigest()
    assert ours.digest() == theirs.digest() and ours.hexdigest() == theirs.hexdigest()
    assert (ours.name, ours.digest_size, ours.block_size) == (theirs.name, theirs.digest_size, theirs.block_size)


def test_a_fresh_process_hashes_small_inputs_without_openssl():
    proc = run_py("""
        import sys
        from stubcache.edge import _digest
        print(_digest.sha256(b"abc").hexdigest(), "hashlib" in sys.modules)
        """)
    assert proc.stdout.split() == [hashlib.sha256(b"abc").hexdigest(), "False"]


# --- _json -----------------------------------------------------------------------------------


def test_the_json_c_functions_are_found():
    assert _json._c_make_encoder is not None and _json._c_make_scanner is not None


def test_a_fresh_process_encodes_and_decodes_without_json():
    """The C path is the one taken (else the fallback imports ``json``) and gives json's text."""
    doc = {"key": "ab" * 16, "n": [1, 2.5, -0.0, 1e300, None, True], "s": "é\u2028\x00\"\\", "d": {"z": 1, "a": []}}
    proc = run_py(f"""
        import sys
        from stubcache.edge import _json
        doc = {doc!r}
        out = [_json.dumps(doc, sort_keys=True, separators=(",", ":")), _json.dumps(doc, ensure_ascii=False)]
        assert _json.loads(out[0]) == doc and _json.loads(out[1].encode()) == doc
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


# --- _thread ---------------------------------------------------------------------------------


def test_the_thread_primitives_are_threadings_own():
    assert type(_thread.allocate_lock()) is type(threading.Lock())
    assert type(_thread.RLock()) is type(threading.RLock())
    assert threading.local is _thread._local
