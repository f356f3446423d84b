"""Synthetic cache entries for the benchmarks and the CLI tests (tests import it from here, as
the cache itself never uses it).

Entries are published through :meth:`Store.publish` with a valid :class:`Manifest`, so they look
exactly like built ones to ``ls``/``prune``/``verify``; the "library" is filler bytes.
"""

from __future__ import annotations

import copy
import hashlib
import os
import time
from typing import Any

from stubcache.storage.manifest import Manifest
from stubcache.storage.store import Store

FAKE_FINGERPRINT: dict[str, Any] = {
    "format": 1,
    "torch": {"version": "0.0.0+synthetic", "cuda": None, "hip": None, "cxx11_abi": 1},
    "cxx": {"command": "c++", "path": "/usr/bin/c++", "version": "c++ (synthetic) 0.0.0"},
    "python": {"version": "3.0.0", "implementation": "cpython-30", "abiflags": "", "ext_suffix": ".so"},
    "platform": {"system": "linux", "machine": "x86_64", "libc": "glibc 0.0"},
    "env": {},
}


def fake_entry(store: Store, name: str, size: int = 16 * 1024, *, created: float | None = None,
               last_used: float | None = None, fingerprint: dict[str, Any] | None = None,
               salt: str = "") -> str:
    """Publish one synthetic entry and return its key. ``last_used`` sets the pin's mtime."""
    now = time.time()
    created = now if created is None else created
    fp = copy.deepcopy(fingerprint if fingerprint is not None else FAKE_FINGERPRINT)
    spec = {"name": name, "cpp_sources": [f"// synthetic {name} {salt}"], "build_method": "direct"}
    preimage = {"spec": spec, "fingerprint": fp}
    key = hashlib.sha256(repr((preimage, size, salt)).encode()).hexdigest()[:32]
    seed = hashlib.sha256(key.encode()).digest()
    data = (seed * (size // len(seed) + 1))[:size]
    staging = store.new_staging(key)
    entry = os.path.join(staging, "entry")
    os.mkdir(entry, 0o700)
    lib = f"{name}.so"
    with open(os.path.join(entry, lib), "wb") as fh:
        fh.write(data)
    manifest = Manifest(
        key=key, base_key=key, name=name, module_name=name, library=lib,
        sha256=hashlib.sha256(data).hexdigest(), size=size, preimage=preimage, headers={},
        build_method="direct", build_seconds=0.05, build_log="(synthetic)", created=created,
        stubcache_version="synthetic",
    )
    store.publish(entry, manifest)
    Store.rmtree(staging)
    stamp = last_used if last_used is not None else created
    os.utime(store.pin_path(key), (stamp, stamp))
    return key


def fake_store(root: str, n: int, size: int = 16 * 1024, spread: float = 30 * 86400.0) -> Store:
    """A store of ``n`` synthetic entries with creation/last-use times spread over ``spread`` s."""
    store = Store(root)
    store.ensure()
    now = time.time()
    for i in range(n):
        t = now - spread * (i / max(n - 1, 1))
        fake_entry(store, f"stub{i % 97}", size, created=t - 60, last_used=t, salt=str(i))
    return store
