"""The remote payload: one blob per entry holding the manifest (JSON) and the library (bytes).

Layout (all in one value, written by a single ``SET``, so a partial upload is never visible)::

    b"stubcache-blob/1\\n"       magic, 17 bytes
    u32 big-endian              length of the manifest JSON (M)
    u8                          length of the MAC (0 or 32)
    MAC                         HMAC-SHA256, see :func:`mac`
    M bytes                     manifest.json, UTF-8
    the rest                    the library

No pickle anywhere: a blob is parsed by offsets and ``json``. Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

MAGIC = b"stubcache-blob/1\n"
_HEAD = struct.Struct(">IB")
MAC_LEN = 32
MAX_MANIFEST = 1 << 24
MAX_BLOB = 256 << 20  # larger values are refused without being parsed
_DOMAIN = b"stubcache-remote-v1\x00"


class BlobError(ValueError):
    """A blob that is malformed or fails authentication; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def mac(secret: bytes, key: str, manifest: bytes, library: bytes) -> bytes:
    """HMAC-SHA256 over the entry key, the manifest and the library.

    The key is inside the MAC so a valid blob cannot be replayed under another key.
    """
    h = hmac.new(secret, _DOMAIN, hashlib.sha256)
    h.update(key.encode("ascii") + b"\x00")
    h.update(struct.pack(">Q", len(manifest)))
    h.update(manifest)
    h.update(library)
    return h.digest()


def encode(key: str, manifest: bytes, library: bytes, secret: bytes | None) -> bytes:
    """The blob for one entry (signed when ``secret`` is given)."""
    tag = mac(secret, key, manifest, library) if secret else b""
    return b"".join([MAGIC, _HEAD.pack(len(manifest), len(tag)), tag, manifest, library])


def split(blob: bytes) -> tuple[bytes, bytes, bytes]:
    """``(mac, manifest, library)`` of a blob; raises :class:`BlobError` if malformed."""
    if len(blob) > MAX_BLOB:
        raise BlobError(f"blob is larger than {MAX_BLOB} bytes")
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + _HEAD.size:
        raise BlobError("not a stubcache blob (bad magic)")
    mlen, tlen = _HEAD.unpack_from(blob, len(MAGIC))
    if tlen not in (0, MAC_LEN) or mlen > MAX_MANIFEST:
        raise BlobError("malformed blob header")
    start = len(MAGIC) + _HEAD.size
    if len(blob) < start + tlen + mlen:
        raise BlobError("truncated blob")
    tag = blob[start:start + tlen]
    manifest = blob[start + tlen:start + tlen + mlen]
    return tag, manifest, blob[start + tlen + mlen:]


def header_length(blob_prefix: bytes) -> int | None:
    """Bytes needed to read the manifest of a blob from its first bytes (for listing), or None
    if they do not start a blob or announce more than a manifest may hold (a header is
    untrusted: it must not make a lister fetch a whole planted value)."""
    if not blob_prefix.startswith(MAGIC) or len(blob_prefix) < len(MAGIC) + _HEAD.size:
        return None
    mlen, tlen = _HEAD.unpack_from(blob_prefix, len(MAGIC))
    if tlen not in (0, MAC_LEN) or mlen > MAX_MANIFEST:
        return None
    return len(MAGIC) + _HEAD.size + tlen + mlen  # type: ignore[no-any-return]  # struct's fields: ints


def open_blob(key: str, blob: bytes, secret: bytes | None) -> tuple[bytes, bytes, bool]:
    """Check a blob's authentication: ``(manifest, library, signed)``.

    With ``secret`` set, a blob without a valid MAC for ``key`` raises :class:`BlobError`.
    Without a secret (read mode with ``STUBCACHE_REMOTE_INSECURE=1``) the MAC is not checked.
    The manifest's own checks (key, pre-image, sha256) are the caller's.
    """
    tag, manifest, library = split(blob)
    if secret is not None:
        if not tag:
            raise BlobError("blob is not signed (no HMAC) and STUBCACHE_REMOTE_SECRET is set")
        if not hmac.compare_digest(tag, mac(secret, key, manifest, library)):
            raise BlobError("HMAC mismatch: the blob was not written with this STUBCACHE_REMOTE_SECRET "
                            "(tampered, or another fleet's secret)")
    return manifest, library, bool(tag)
