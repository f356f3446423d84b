"""``python -m kvarena.demo``: an arena (CUDA if available, else host), a commit, a KV tensor.

Prints how the allocator stub was obtained (built or cache hit, and how long it took), then
allocates a ``[layers, 2, tokens, heads, head_dim]`` KV-cache tensor inside the arena.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import stubcache

from . import ArenaError, KvArena, load_stub

MiB = 1 << 20


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a zero-sized tensor or reservation has
    nothing to show), so bad sizes end in argparse's one-line usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvarena.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    ap.add_argument("--reserve-mib", type=_positive, default=1024, help="address space to reserve")
    ap.add_argument("--tokens", type=_positive, default=4096)
    ap.add_argument("--layers", type=_positive, default=4)
    ap.add_argument("--heads", type=_positive, default=8)
    ap.add_argument("--head-dim", type=_positive, default=128)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    stub = load_stub()
    t_stub = time.perf_counter() - t0
    t = stub.timing
    print(f"stub cache     {stubcache.default_cache().root}")
    print(f"stub library   {stub.path}")
    if t.built:
        print(f"stub           cache miss, built now: compile {t.build_seconds * 1e3:.1f} ms "
              f"({t.method}), get+load {t_stub * 1e3:.1f} ms")
    else:
        print(f"stub           cache hit: get+load {t_stub * 1e3:.1f} ms "
              f"(it was compiled once in {t.build_seconds * 1e3:.1f} ms via {t.method})")
    t1 = time.perf_counter()
    load_stub()
    print(f"stub again     {(time.perf_counter() - t1) * 1e6:.0f} us (in-process hit)")

    import warnings

    with warnings.catch_warnings():
        # torch without numpy installed warns "Failed to initialize NumPy" on import; the demo
        # never converts to numpy, so the warning is noise here.
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = (args.layers, 2, args.tokens, args.heads, args.head_dim)
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    print(f"torch          {torch.__version__} (cuda available: {torch.cuda.is_available()})")
    try:
        return _run_arena(args, device, shape, dtype, nbytes)
    except ArenaError as exc:  # e.g. the tensor does not fit the reservation: say so, no traceback
        print(f"error          {exc}")
        return 2


def _run_arena(args: argparse.Namespace, device: str, shape: tuple[int, ...], dtype: Any, nbytes: int) -> int:
    t2 = time.perf_counter()
    arena = KvArena(args.reserve_mib * MiB, device=device)
    with arena:
        print(f"arena          {arena.device}: reserved {arena.reserved / MiB:.0f} MiB at {arena.base:#x}, "
              f"granularity {arena.granularity} B, slot {arena.slot} ({arena.alloc_fn_name}/{arena.free_fn_name}) "
              f"in {(time.perf_counter() - t2) * 1e3:.1f} ms")
        t3 = time.perf_counter()
        committed = arena.commit(nbytes)
        print(f"commit         {committed / MiB:.1f} MiB in {(time.perf_counter() - t3) * 1e3:.1f} ms")
        kv = arena.tensor(shape, dtype)
        kv.zero_()
        kv[0, 0, 0] = 1.0
        off = kv.data_ptr() - arena.base
        print(f"kv tensor      {tuple(kv.shape)} {dtype} on {kv.device}: offset {off}, "
              f"{kv.numel() * kv.element_size() / MiB:.1f} MiB, sum={float(kv.sum()):.1f}")
        print(f"cursor         {arena.cursor} B of {arena.reserved} B handed out")
        end = kv.data_ptr() + nbytes
        inside = arena.base <= kv.data_ptr() and end <= arena.base + arena.reserved
        if arena.pool is not None:
            arena.check_pool()  # raises if torch's pool holds memory the arena did not hand out
        st = arena.stats()
        print(f"check          in arena: {inside}, committed: {end - arena.base <= arena.committed}, "
              f"stub allocations: {st['nalloc']} (live {st['live']})")
        released = arena.uncommit_beyond(0) if device == "cpu" else 0
        del kv
        if device == "cpu":
            print(f"uncommit       released {released / MiB:.1f} MiB")
    print("closed         ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
