"""The torch side of a CUDA arena: its ``MemPool``, and what torch's own view of it must show.

torch binds a ``MemPool`` to the device that is *current when the pool is created*, and
``use_mem_pool(pool, device=N)`` on another device silently makes a second pool there with no
allocator (plain ``cudaMalloc``). So the pool is made with the arena's device current, and
:func:`foreign_segments` checks torch's snapshot of the pool: every segment must be one the
arena's stub handed out. torch also keeps freed blocks cached in the pool and hands them out
again without calling the stub; :func:`cached_blocks` finds those that a release would unmap.

The pure functions take the snapshot (a list of segment dicts, as ``torch.cuda.memory_snapshot``
returns them) so they are tested without a GPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

if TYPE_CHECKING:
    import torch
    from torch.cuda.memory import CUDAPluggableAllocator

log = logging.getLogger("kvarena")

#: Block states in torch's snapshot that are not (or soon not) a live tensor: torch may hand
#: them out again without asking the allocator.
CACHED_STATES = ("inactive", "active_pending_free", "active_awaiting_free")


class Span(NamedTuple):
    """One segment or block of the pool, as torch reports it."""

    device: int
    address: int
    size: int
    state: str = ""


def make_pool(library_path: str, alloc_name: str, free_name: str,
              device_index: int) -> "tuple[torch.cuda.MemPool, CUDAPluggableAllocator]":
    """``(MemPool, CUDAPluggableAllocator)`` for one slot, bound to ``cuda:device_index``.

    The pool is created inside ``torch.cuda.device(device_index)``: torch records the current
    device in the pool, whatever ``use_mem_pool(device=...)`` is told later.
    """
    import inspect

    import torch
    from torch.cuda.memory import CUDAPluggableAllocator

    allocator = CUDAPluggableAllocator(library_path, alloc_name, free_name)
    kwargs = {}
    if "no_split" in inspect.signature(torch.cuda.MemPool.__init__).parameters:
        kwargs["no_split"] = True
    else:
        log.warning("kvarena: torch %s has no MemPool(no_split=); torch may split arena segments "
                    "between tensors (needs torch>=2.10)", torch.__version__)
    with torch.cuda.device(device_index):
        pool = torch.cuda.MemPool(allocator.allocator(), **kwargs)  # type: ignore[no-untyped-call]  # torch's
    return pool, allocator


def snapshot(pool: "torch.cuda.MemPool") -> list[dict[str, Any]]:
    """torch's segments of ``pool`` on every device (no stack traces)."""
    import inspect

    import torch

    fn = torch.cuda.memory_snapshot
    if "include_traces" in inspect.signature(fn).parameters:
        return fn(pool.id, include_traces=False)  # type: ignore[no-untyped-call, no-any-return]  # torch's
    return fn(pool.id)  # type: ignore[no-untyped-call, no-any-return]


def segments(snap: Iterable[dict[str, Any]]) -> list[Span]:
    """The segments of a snapshot."""
    return [Span(int(s.get("device", -1)), int(s["address"]), int(s["total_size"])) for s in snap]


def blocks(snap: Iterable[dict[str, Any]]) -> list[Span]:
    """Every block of every segment of a snapshot, with its state."""
    out = []
    for seg in snap:
        dev = int(seg.get("device", -1))
        addr = int(seg["address"])
        for blk in seg.get("blocks", ()):
            size = int(blk["size"])
            out.append(Span(dev, int(blk.get("address", addr)), size, str(blk.get("state", ""))))
            addr += size
    return out


def foreign_segments(snap: Iterable[dict[str, Any]], device_index: int, base: int, reserved: int) -> list[Span]:
    """Segments of the pool that the arena did not hand out: on another device, or outside
    ``[base, base + reserved)``. Empty when every allocation really came from the arena."""
    return [s for s in segments(snap)
            if s.device not in (device_index, -1)  # -1: a torch whose snapshot does not say
            or not (base <= s.address and s.address + s.size <= base + reserved)]


def cached_blocks(snap: Iterable[dict[str, Any]], lo: int, hi: int) -> list[Span]:
    """Cached (not live) blocks of the pool that overlap ``[lo, hi)``."""
    return [b for b in blocks(snap) if b.state in CACHED_STATES and b.address < hi and lo < b.address + b.size]


def reused_blocks(before: Iterable[dict[str, Any]], after: Iterable[dict[str, Any]], lo: int, hi: int) -> list[Span]:
    """Blocks live in ``after`` that torch carved from blocks cached in ``before`` (so without
    calling the allocator), overlapping ``[lo, hi)``."""
    cached = [b for b in blocks(before) if b.state in CACHED_STATES]
    return [b for b in blocks(after) if b.state == "active_allocated" and b.address < hi and lo < b.address + b.size
            and any(c.device == b.device and c.address < b.address + b.size and b.address < c.address + c.size
                    for c in cached)]


def describe(spans: list[Span], base: int, limit: int = 4) -> str:
    """``"2: 0x7f.. (+0x200000, 2097152 B, cuda:0, inactive), ..."`` for error messages."""
    parts = [f"{s.address:#x} (+{s.address - base:#x}, {s.size} B, cuda:{s.device}{', ' + s.state if s.state else ''})"
             for s in spans[:limit]]
    more = f", and {len(spans) - limit} more" if len(spans) > limit else ""
    return f"{len(spans)}: " + ", ".join(parts) + more
