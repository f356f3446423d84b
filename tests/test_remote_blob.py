"""The remote blob format and its checks, as an attacker who can write any bytes to Redis would
probe them (pure functions: no server needed)."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stubcache.remote.blob import BlobError, encode, open_blob, split
from stubcache.remote.config import RemoteConfig
from stubcache.remote.tier import RemoteTier, canonical_json

KEY = "ab" * 16
SECRET = b"s" * 32
LIB = b"\x7fELF" + bytes(range(256)) * 4
PREIMAGE = {"spec": {"name": "x", "sources": ["int f();"]}, "fingerprint": {"torch": {"version": "2.13.0"}}}


def manifest(**over) -> bytes:
    m = {"key": KEY, "base_key": KEY, "name": "x", "module_name": "x", "library": "x.so",
         "sha256": hashlib.sha256(LIB).hexdigest(), "size": len(LIB), "preimage": PREIMAGE, "headers": {},
         "build_method": "direct", "build_seconds": 0.1, "build_log": "", "created": 1.0,
         "stubcache_version": "0.1.0"}
    m.update(over)
    return json.dumps(m).encode()


def tier(secret: bytes | None = SECRET) -> RemoteTier:
    cfg = RemoteConfig("redis://127.0.0.1:1/0", "read-write" if secret else "read", secret, 1.0, 15.0,
                       secret is None)
    return RemoteTier(cfg, lambda *a, **k: None, backend=object())  # verify() never touches it


def test_a_good_blob_round_trips():
    blob = encode(KEY, manifest(), LIB, SECRET)
    m, lib = tier().verify(KEY, blob, canonical_json(PREIMAGE))
    assert lib == LIB and m.key == KEY
    assert split(blob)[2] == LIB


@pytest.mark.parametrize("mutate, reason", [
    (lambda: encode(KEY, manifest(), LIB, None), "not signed"),
    (lambda: encode(KEY, manifest(), LIB, b"x" * 32), "HMAC mismatch"),
    (lambda: encode("cd" * 16, manifest(), LIB, SECRET), "HMAC mismatch"),       # replayed under KEY
    (lambda: encode(KEY, manifest(library="manifest.json"), LIB, SECRET), "bad library"),
    (lambda: encode(KEY, manifest(library="../x.so"), LIB, SECRET), "unreadable manifest"),
    (lambda: encode(KEY, manifest(key="cd" * 16), LIB, SECRET), "another key"),
    (lambda: encode(KEY, manifest(headers={"/x.h": "0"}), LIB, SECRET), "another key"),
    (lambda: encode(KEY, manifest(preimage={"spec": {}, "fingerprint": {}}), LIB, SECRET), "pre-image"),
    (lambda: encode(KEY, manifest(size=1), LIB, SECRET), "size and sha256"),
    (lambda: encode(KEY, manifest(), LIB + b"!", SECRET), "size and sha256"),
    (lambda: b"\x80\x04pickle", "bad magic"),
])
def test_every_bad_blob_is_refused_with_a_reason(mutate, reason):
    with pytest.raises(BlobError, match=reason):
        tier().verify(KEY, mutate(), canonical_json(PREIMAGE))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.integers(min_value=0, max_value=2000), st.booleans())
def test_hostile_bytes_only_ever_raise_blob_error(noise, cut, keep_prefix):
    good = encode(KEY, manifest(), LIB, SECRET)
    blob = (good[:cut] + noise) if keep_prefix else noise
    for t in (tier(), tier(None)):
        try:
            m, lib = t.verify(KEY, blob, canonical_json(PREIMAGE))
        except BlobError:
            continue
        assert lib == LIB and m.sha256 == hashlib.sha256(LIB).hexdigest()  # only the genuine one passes


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=12))
def test_hostile_manifest_values_only_ever_raise_blob_error(value):
    for field in ("library", "key", "size", "sha256", "headers", "preimage", "name"):
        blob = encode(KEY, manifest(**{field: value}), LIB, None)
        try:
            tier(None).verify(KEY, blob, canonical_json(PREIMAGE))
        except BlobError:
            pass
    with pytest.raises(BlobError):
        open_blob(KEY, b"stubcache-blob/1\n" + b"\xff" * 5, None)
