"""SHA-256 without loading OpenSSL for small inputs.

``hashlib`` loads OpenSSL's libcrypto on import (about 2.5 ms of a fresh process here). A hit
hashes a few KiB (the key's pre-image) and one small library (its checksum), for which CPython's
built-in SHA-256 does: 100 µs for 32 KiB against OpenSSL's 19 µs, paid once per process. Large
inputs (a compiler binary, a big library), every input once ``hashlib`` is imported anyway (a
torch process) and every input after the first MiB go to OpenSSL. The digests are the same
function's: only the implementation differs.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Callable, Protocol

    class Hash(Protocol):
        """What both implementations' hash objects offer."""

        def update(self, data: bytes, /) -> None: ...
        def digest(self) -> bytes: ...
        def hexdigest(self) -> str: ...


def _builtin_sha256() -> Callable[[bytes], Hash]:
    """CPython's built-in SHA-256 constructor, imported on the first small hash of a process
    without hashlib (a torch process never needs it)."""
    try:
        from _sha256 import sha256  # type: ignore[import-not-found]  # CPython ≤ 3.11
    except ImportError:
        try:
            from _sha2 import sha256  # type: ignore[import-not-found]  # CPython ≥ 3.12 (python_version 3.10)
        except ImportError:
            from hashlib import sha256
    return sha256  # type: ignore[no-any-return]  # the C modules are untyped at python_version 3.10


_small: Callable[[bytes], Hash] | None = None
LARGE = 1 << 20  # bytes: from here on, OpenSSL's speed outweighs its import
_small_bytes = 0  # hashed by the built-in so far in this process


def sha256(data: bytes = b"", *, large: bool = False) -> Hash:
    """A SHA-256 hash object (``hexdigest``, ``update``) fed ``data``; ``large=True`` when more
    than :data:`LARGE` bytes will follow. OpenSSL's when ``hashlib`` is imported already (torch
    imports it), for a large input, or once the built-in has hashed :data:`LARGE` bytes in this
    process (a loop making new specs: from then on the import has paid for itself); else the
    built-in one."""
    global _small_bytes, _small
    _small_bytes += len(data)
    if large or _small_bytes >= LARGE or "hashlib" in sys.modules:
        # The import statement, not sys.modules: while another thread is still importing
        # hashlib, its module is there half-initialized; the statement waits for it.
        import hashlib

        return hashlib.sha256(data)
    if _small is None:
        _small = _builtin_sha256()
    return _small(data)
