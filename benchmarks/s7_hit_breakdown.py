"""Scenario 7: where the time of a hit goes.

In one fresh process with a warm root, each piece of what ``StubCache.get_or_build`` +
``load_entry`` do on a hit is timed on its own (looped, per call): spec construction,
fingerprint, canonical form + key hash, manifest read, pin (flock), trust/shape checks, checksum,
the hit event, and dlopen (first load of a fresh copy, and a repeated load). ``python -X
importtime -c 'import stubcache'`` gives the import part of a fresh-process hit, and the pieces a
*cold* process pays once (lazy imports, root creation, compiler probe) are timed too.
"""

from __future__ import annotations

import json
import re
import subprocess

from _common import STUB_NAME, Ctx, fmt_time, row, run_json, spec_kwargs
from _wheel import WheelEnv, child_env_for
from s1_cold_build import STUBCACHE_CHILD

CHILD = r"""
import sys, time
pc = time.perf_counter
t0 = pc(); import stubcache; t_import = pc() - t0
import json, os, shutil, ctypes
from stubcache.key import derive as keymod
from stubcache.storage import store as storemod, trust, events
from stubcache.key.fingerprint import Fingerprint
src_file, name, kw, root, scratch, reps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
src = open(src_file).read()
out = {"import stubcache (in-process)": [t_import]}

def loop(label, fn, n=reps, setup=None):
    xs = []
    for _ in range(n):
        if setup: setup()
        t = pc(); fn(); xs.append(pc() - t)
    out[label] = xs

# the very first call of this process, then the pieces
cache = stubcache.StubCache(root)
spec = stubcache.StubSpec(name, src, **kw)
t = pc(); entry = cache.get_or_build(spec); t_gob = pc() - t
t = pc(); cache.load_entry(entry); t_load = pc() - t
out["first get_or_build (whole)"] = [t_gob]
out["first load_entry (whole: open, fstat, checksum, dlopen)"] = [t_load]
state = cache.store.path("state")
loop("StubSpec(...) construction + validation", lambda: stubcache.StubSpec(name, src, **kw))
loop("fingerprint, first of a cache (whole-fingerprint memo read + validated)",
     lambda: Fingerprint(state).base(), n=max(reps // 10, 5))
fp = cache.fingerprint.base()
def canon():
    spec._canonical = None; spec.canonical()
loop("spec.canonical() (incl. the torch-mention rule)", canon)
c = spec.canonical()
loop("key hash (json.dumps + sha256 of pre-image)", lambda: keymod.base_key(c, fp))
k = entry.key
store = cache.store
loop("manifest read + parse", lambda: store.read_manifest(k))
def pin():
    os.close(store.pin(k))
loop("pin: open + shared flock + fstat", pin)
edir = os.path.dirname(entry.path)
loop("trust check of entry dir + listdir", lambda: (trust.check_dir(edir, "cache entry"), os.listdir(edir)))
def open_stat():
    fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC); st = os.fstat(fd)
    trust.check_stat(st, entry.path, "library"); os.close(fd)
loop("open + fstat + trust check of library", open_stat)
fd = os.open(entry.path, os.O_RDONLY)
loop(f"sha256 of the library ({os.path.getsize(entry.path) // 1024} KiB)", lambda: storemod.file_sha256(fd))
os.close(fd)
ev = store.path("events")
loop("hit event append (events/*.jsonl)", lambda: events.record(ev, "hit", k, name=name, file_mode=0o600))
copies = []
for i in range(max(reps // 10, 5)):
    p = os.path.join(scratch, f"copy{i}.so"); shutil.copy(entry.path, p); copies.append(p)
it = iter(copies)
loop("dlopen, first load of a library (fresh copy)", lambda: ctypes.CDLL(next(it)), n=len(copies))
loop("dlopen, already loaded (ctypes.CDLL again)", lambda: ctypes.CDLL(entry.path))
cache2 = stubcache.StubCache(root)
loop("whole hit, new StubCache, same spec (no dlopen)",
     lambda: cache2.get_or_build(spec), n=max(reps // 10, 5), setup=lambda: cache2._memo.clear() or cache2._verified.clear())
loop("memoised get_or_build (repeat)", lambda: cache.get_or_build(spec))
print(json.dumps(out))
"""

COLD_CHILD = r"""
import json, os, sys, time
pc = time.perf_counter
import stubcache
from stubcache.storage import store as storemod
from stubcache.key.fingerprint import Fingerprint
out = {}
t = pc(); import filelock; out["import filelock (not imported by stubcache; for comparison)"] = pc() - t
t = pc(); import stubcache.build.builder; out["import stubcache.build.builder (lazy, first build)"] = pc() - t
s = storemod.Store(sys.argv[1])
t = pc(); s.ensure(); out["create a fresh root (makedirs + sub-directories)"] = pc() - t
t = pc(); Fingerprint(s.path("state")).base()
out["fingerprint with no memo (c++ --version, libc10 ABI scan)"] = pc() - t
print(json.dumps(out))
"""

IMPORT_RE = re.compile(r"import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)")


def importtime(inst: WheelEnv) -> dict:
    proc = subprocess.run([inst.python, "-X", "importtime", "-c", "import stubcache"], env=child_env_for(inst),
                          cwd=inst.cwd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, check=True)
    mods = []
    for ln in proc.stderr.splitlines():
        m = IMPORT_RE.match(ln)
        if m:
            mods.append((m.group(4), int(m.group(1)), int(m.group(2)), len(m.group(3))))
    total = next((cum for name, _self, cum, _d in mods if name == "stubcache"), None)
    top = sorted(((name, self_) for name, self_, _c, _d in mods), key=lambda x: -x[1])[:8]
    return {"stubcache_cumulative_us": total, "top_self_us": top, "modules": len(mods)}


def run(ctx: Ctx) -> dict:
    reps = ctx.reps(50, 300)
    kw = json.dumps(spec_kwargs())
    inst = ctx.installed()  # the hit's pieces and the import, as users install stubcache
    root = ctx.fresh_dir("s7-root")
    run_json(STUBCACHE_CHILD, [ctx.source_file, root, STUB_NAME, kw], env=child_env_for(inst), python=inst.python,
             cwd=inst.cwd)
    procs = ctx.reps(2, 5)
    merged: dict[str, list] = {}
    for _ in range(procs):
        d = run_json(CHILD, [ctx.source_file, STUB_NAME, kw, root, ctx.fresh_dir("s7-scratch"), reps],
                     env=child_env_for(inst, STUBCACHE_DIR=str(root), STUBCACHE_REQUIRE_HIT="1"),
                     python=inst.python, cwd=inst.cwd)
        for k, v in d.items():
            merged.setdefault(k, []).extend(v)
    cold: dict[str, list] = {}
    for _ in range(procs):
        d = run_json(COLD_CHILD, [ctx.fresh_dir("s7-cold") / "root"])
        for k, v in d.items():
            cold.setdefault(k, []).append(v)
    imps = [importtime(inst) for _ in range(procs + 1)][1:]  # the first one may write bytecode
    rows = [row("once per process" if k.startswith(("import", "first")) else "hit piece (per call)", k, v)
            for k, v in merged.items()]
    rows += [row("cold-process piece (once)", k, v) for k, v in cold.items()]
    rows.append(row("import", "python -X importtime: stubcache cumulative",
                    [i["stubcache_cumulative_us"] / 1e6 for i in imps if i["stubcache_cumulative_us"]]))
    top = imps[-1]["top_self_us"]
    notes = [f"Hit pieces and import: {inst.note}. Cold-process pieces: this Python, checkout on PYTHONPATH.",
             "Heaviest modules (self time) in `python -X importtime -c 'import stubcache'`: "
             + ", ".join(f"{n} {us / 1000:.1f} ms" for n, us in top) + f" ({imps[-1]['modules']} modules)."]
    pieces = [r for r in rows if r["case"] == "hit piece (per call)" and not r["approach"].startswith(
        ("first ", "whole", "memoised", "import", "dlopen, already", "fingerprint"))]
    pieces.sort(key=lambda r: -r["median"])
    notes.append("Largest per-call pieces of a hit: " + ", ".join(
        f"{r['approach']} {fmt_time(r['median'])}" for r in pieces[:4]) + ".")
    return {"id": 7, "title": "Hit-path overhead breakdown", "rows": rows, "targets": [], "notes": notes}
