"""Build a stub through the cache, then hit it from a second process; print both timings.

    python examples/quickstart.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time
t0 = time.perf_counter()
import stubcache
spec = stubcache.StubSpec("quickstart_add", 'extern "C" int add(int a, int b) { return a + b; }')
cache = stubcache.StubCache()
entry = cache.get_or_build(spec)
lib = cache.load_entry(entry)
dt = time.perf_counter() - t0
assert lib.add(2, 3) == 5
print(f"{sys.argv[1]:>5}: {dt * 1000:7.1f} ms  (import + get_or_build + dlopen; torch imported: "
      f"{'torch' in sys.modules}) key={entry.key[:12]} method={entry.manifest.build_method}")
"""


def main() -> None:
    given = os.environ.get("STUBCACHE_DIR")
    # A scratch root unless one was given; it is removed at the end, so runs leave nothing behind.
    with tempfile.TemporaryDirectory(prefix="stubcache-quickstart-") as scratch:
        root = given or os.path.join(scratch, "cache")
        env = dict(os.environ, STUBCACHE_DIR=root)
        print(f"cache root: {root}" + ("" if given else " (removed at exit)"))
        for label in ("cold", "warm"):
            subprocess.run([sys.executable, "-c", CHILD, label], env=env, check=True)


if __name__ == "__main__":
    main()
