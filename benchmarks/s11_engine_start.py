"""Scenario 11: an engine's start, warm and cold, measured where engines run it.

Every child is an engine process: it imports ``torch`` and ``torch.utils.cpp_extension`` first
(untimed), then times only what comes after, in-process, with ``perf_counter``. stubcache runs as
users install it: this checkout's wheel in a venv that also sees this Python's site-packages
(``_wheel.py``, ``torch=True``). torch's own loader runs in the same venv, interleaved with the
stubcache children (A B A B), so both see the same machine.

Warm: torch's ``load_inline(no_implicit_headers=True, build_directory=D)`` on a built ``D``
against ``import stubcache`` + the first hit, for the drop-in (``stubcache.load_inline`` with
``is_python_module=False`` and a ``build_directory``) and for ``StubCache().load(spec)``. A
breakdown child times the pieces of a first hit: the imports, the key (spec, fingerprint memo,
hash), the checks (record, validators, tracked inputs, trust, pin, checksum, hit event) and the
dlopen (with the mapped-file identity check) on the compact hit path.

Cold: the first stub in a fresh root on a fresh host (no probe memo of the user's: the toolchain
probe included), and in a new root on a host this user has built on (the probes' answers read
from the user's memo), against torch's cold
``load_inline(no_implicit_headers=True)`` into a fresh build directory, and a new stub in an
existing root against the bare compiler (``c++ -shared -fPIC``, spawned from this benchmark).
"""

from __future__ import annotations

import json
import statistics

from _common import STUB_NAME, Ctx, fmt_time, ratio, row, run_json, target, variant_source
from _wheel import child_env_for
from s1_cold_build import bare_compile

ENGINE = "import torch, torch.utils.cpp_extension\nimport json, sys, time\npc = time.perf_counter\n" + r"""
# The cyclic GC's pauses inside the timed window, from gc.callbacks (installed just before the
# clock starts): where a window happens to start a collection of torch's young objects (a
# generation-1 pass costs several ms after `import torch`), that lands in whichever side's window
# allocates past the threshold, so the report shows them.
import gc
gc_seen = {"s": 0.0, "gen": -1, "at": None}
def gc_cb(phase, info):
    if phase == "start":
        gc_seen["at"] = pc()
    elif gc_seen["at"] is not None:
        gc_seen["s"] += pc() - gc_seen["at"]
        gc_seen["gen"] = max(gc_seen["gen"], info["generation"])
gc.callbacks.append(gc_cb)
"""

TORCH_LOAD = ENGINE + r"""
src = open(sys.argv[1]).read()
t0 = pc()
torch.utils.cpp_extension.load_inline(sys.argv[2], src, build_directory=sys.argv[3], is_python_module=False,
                                      no_implicit_headers=True)
t1 = pc()
print(json.dumps({"total": t1 - t0, "gc": gc_seen["s"], "gc_gen": gc_seen["gen"]}))
"""

DROPIN = ENGINE + r"""
src = open(sys.argv[1]).read()
t0 = pc()
import stubcache
t1 = pc()
stubcache.load_inline(sys.argv[2], src, build_directory=sys.argv[3], is_python_module=False, no_implicit_headers=True)
t2 = pc()
print(json.dumps({"total": t2 - t0, "import": t1 - t0, "gc": gc_seen["s"], "gc_gen": gc_seen["gen"]}))
"""

SC_LOAD = ENGINE + r"""
src = open(sys.argv[1]).read()
t0 = pc()
import stubcache
t1 = pc()
stubcache.StubCache().load(stubcache.StubSpec(sys.argv[2], src, is_python_module=False, no_implicit_headers=True))
t2 = pc()
print(json.dumps({"total": t2 - t0, "import": t1 - t0, "gc": gc_seen["s"], "gc_gen": gc_seen["gen"]}))
"""

# The pieces of a first hit through the compact hit path (what StubCache().load runs on a warm
# host: stubcache.hit, which `import stubcache` imports), timed step by step with its own functions.
BREAKDOWN = ENGINE + r"""
before = set(sys.modules)
src = open(sys.argv[1]).read()
t0 = pc()
import stubcache
t1 = pc()
from stubcache import hit
from stubcache import key  # the spec's module: what StubCache().load's caller imports
t2 = pc()
spec = stubcache.StubSpec(sys.argv[2], src, is_python_module=False, no_implicit_headers=True)
digest = hit.request_digest("spec", (spec.canonical(),))
t3 = pc()
found = hit.find(hit.default_root(), digest)
assert found is not None, "no hit record: the compact path did not answer"
t4 = pc()
assert hit.load(found) is not None
t5 = pc()
mods = sorted(m for m in set(sys.modules) - before if m.startswith("stubcache"))
# What unmarshalling those modules' bytecode alone costs (a part of "import"), timed again here.
import marshal
codes = [open(sys.modules[m].__cached__, "rb").read()[16:] for m in mods if getattr(sys.modules[m], "__cached__", None)]
best = None
for _ in range(3):
    t = pc()
    for c in codes:
        marshal.loads(c)
    best = min(best or 1e9, pc() - t)
print(json.dumps({"(part of the imports) unmarshalling their bytecode again, best of 3": best,
                  "pyc_bytes": sum(map(len, codes)), "import stubcache (with the compact hit path, stubcache.hit)": t1 - t0,
                  "import the spec's module (stubcache.key)": t2 - t1,
                  "spec + request digest": t3 - t2,
                  "checks (record, its validators and tracked inputs, trust, entry, pin, checksum, hit event)": t4 - t3,
                  "dlopen + mapped-file identity": t5 - t4, "modules": mods}))
"""


# A cold call's phases, from stubcache's own DEBUG lines (stubcache.edge.log.debug: the logger
# "stubcache"), each stamped when it is logged: what ended how long after the call began.
PHASES = (("compiling early, while the toolchain is probed", "compiler started during the probe (a fresh host's new root)"),
          ("probed the compiler ", "toolchain probed (a fresh host)"), (": not in the cache ", "key computed, looked up (imports, fingerprint)"),
          (": compiling (", "compiler about to start, or the early compile taken over (lookup, build lock, staging)"),
          (" inputs tracked while the compiler runs", "headers tracked while the compiler runs (search probe)"),
          (": compiled in ", "compiler finished"), (": inputs tracked ", "inputs tracked, load checked"),
          (": published as ", "published"))
COLD_TIMELINE = ENGINE + r"""
import logging
marks = {}
class Mark(logging.Handler):
    def emit(self, record):
        marks.setdefault(record.getMessage(), pc() - t0)
log = logging.getLogger("stubcache")
log.addHandler(Mark())
log.setLevel(logging.DEBUG)
log.propagate = False
src = open(sys.argv[1]).read()
t0 = pc()
import stubcache
stubcache.load_inline(sys.argv[2], src, build_directory=sys.argv[3], is_python_module=False, no_implicit_headers=True)
t1 = pc()
phases = json.loads(sys.argv[4])
out = {label: next((t for m, t in marks.items() if pat in m), None) for pat, label in phases}
out["returned"] = t1 - t0
print(json.dumps(out))
"""


def _capless_prefix() -> list[str] | None:
    """``setpriv`` dropping CAP_CHECKPOINT_RESTORE and CAP_SYS_ADMIN, where that makes
    ``/proc/self/map_files`` refuse a process as it refuses an ordinary user's (root only)."""
    import os
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return None
    prefix = ["setpriv", "--bounding-set=-sys_admin,-checkpoint_restore"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "import os; d = '/proc/self/map_files/'; "
                            "os.stat(d + os.listdir(d)[0])"], capture_output=True, text=True)
    return prefix if "PermissionError" in probe.stderr and "map_files" in probe.stderr else None


def run(ctx: Ctx) -> dict:
    reps = ctx.reps(5, 15)
    cold_reps = ctx.reps(2, 11)
    inst = ctx.installed_engine()
    root = ctx.fresh_dir("s11-root")
    env = child_env_for(inst, STUBCACHE_DIR=str(root))
    hit_env = child_env_for(inst, STUBCACHE_DIR=str(root), STUBCACHE_REQUIRE_HIT="1")
    src = str(ctx.source_file)
    tdir, sdir = ctx.fresh_dir("s11-torch"), ctx.fresh_dir("s11-dropin")

    def child(code: str, args: list, e: dict, prefix: list[str] | None = None) -> dict:
        return run_json(code, [str(a) for a in args], env=e, python=inst.python, cwd=inst.cwd, prefix=prefix or ())

    capless = _capless_prefix()

    child(TORCH_LOAD, [src, STUB_NAME, tdir], env)  # builds torch's directory
    child(DROPIN, [src, STUB_NAME, sdir], env)  # builds the entry (the drop-in's and load()'s key are one)
    warm: dict[str, list[float]] = {"torch": [], "dropin": [], "load": [], "new_dir": [], "capless": []}
    imports: dict[str, list[float]] = {"dropin": [], "load": []}
    gcs: dict[str, list[float]] = {"torch": [], "dropin": [], "load": []}
    older: dict[str, int] = {"torch": 0, "dropin": 0, "load": 0}  # windows with a generation-1+ pass
    pieces: dict[str, list[float]] = {}
    modules: list[str] = []
    pyc_bytes = 0
    for i in range(reps + 1):
        t = child(TORCH_LOAD, [src, STUB_NAME, tdir], hit_env)
        d = child(DROPIN, [src, STUB_NAME, sdir], hit_env)
        t2 = child(TORCH_LOAD, [src, STUB_NAME, tdir], hit_env)
        ld = child(SC_LOAD, [src, STUB_NAME], hit_env)
        b = child(BREAKDOWN, [src, STUB_NAME], hit_env)
        # A warm host's first call into a build directory that does not hold the library yet
        # (a container's fresh /tmp): the copy is placed there as part of the hit.
        nd = child(DROPIN, [src, STUB_NAME, ctx.fresh_dir("s11-new-bd")], hit_env)
        # The same warm call where /proc/self/map_files is refused (an ordinary user's process,
        # root's in a container): the mapping is checked through /proc/self/maps.
        cl = child(DROPIN, [src, STUB_NAME, sdir], hit_env, capless) if capless else None
        if not i:  # the first round warms the page cache
            continue
        warm["torch"] += [t["total"], t2["total"]]
        warm["dropin"].append(d["total"])
        warm["load"].append(ld["total"])
        warm["new_dir"].append(nd["total"])
        if cl is not None:
            warm["capless"].append(cl["total"])
        imports["dropin"].append(d["import"])
        imports["load"].append(ld["import"])
        for kind, out in (("torch", t), ("torch", t2), ("dropin", d), ("load", ld)):
            gcs[kind].append(out["gc"])
            older[kind] += out["gc_gen"] >= 1
        modules = b.pop("modules")
        pyc_bytes = b.pop("pyc_bytes")
        for k, v in b.items():
            pieces.setdefault(k, []).append(v)

    # Cold: a fresh root per repetition (the toolchain probed), torch into a fresh directory, a
    # new stub in an existing root, the bare compiler; interleaved.
    cold: dict[str, list[float]] = {"fresh": [], "torch": [], "existing": [], "bare": [], "new_root": []}
    timeline: dict[str, dict[str, list[float]]] = {"existing": {}, "fresh": {}}
    used_root = ctx.fresh_dir("s11-used-root")
    state_dir = ctx.fresh_dir("s11-state")  # this user's state on a host that has built before
    used_env = child_env_for(inst, STUBCACHE_DIR=str(used_root), XDG_STATE_HOME=str(state_dir))
    child(DROPIN, [src, "bench_other_stub", ctx.fresh_dir("s11-x")], used_env)
    for i in range(cold_reps):
        # A fresh host: a new root and no probe memo of this user's (stubcache.key.probememo).
        fresh_env = child_env_for(inst, STUBCACHE_DIR=str(ctx.fresh_dir("s11-fresh-root")),
                                  XDG_STATE_HOME=str(ctx.fresh_dir("s11-fresh-state")))
        cold["fresh"].append(child(DROPIN, [src, STUB_NAME, ctx.fresh_dir("s11-bd")], fresh_env)["total"])
        new_root_env = child_env_for(inst, STUBCACHE_DIR=str(ctx.fresh_dir("s11-new-root")),
                                     XDG_STATE_HOME=str(state_dir))
        cold["new_root"].append(child(DROPIN, [src, STUB_NAME, ctx.fresh_dir("s11-bd")], new_root_env)["total"])
        cold["torch"].append(child(TORCH_LOAD, [src, STUB_NAME, ctx.fresh_dir("s11-tc")], env)["total"])
        vsrc = ctx.work / f"s11-variant-{i}.cpp"
        vsrc.write_text(variant_source(1000 + i))  # a new key in the existing root
        cold["existing"].append(child(DROPIN, [vsrc, STUB_NAME, ctx.fresh_dir("s11-bd")], used_env)["total"])
        cold["bare"].append(bare_compile(ctx)[0])
        # Where the time goes: the same two cold starts again, with stubcache's DEBUG lines stamped.
        for where, e in (("existing", used_env), ("fresh", child_env_for(
                inst, STUBCACHE_DIR=str(ctx.fresh_dir("s11-fresh-root")),
                XDG_STATE_HOME=str(ctx.fresh_dir("s11-fresh-state"))))):
            tsrc = ctx.work / f"s11-timeline-{where}-{i}.cpp"
            tsrc.write_text(variant_source(2000 + i))
            marks = child(COLD_TIMELINE, [tsrc, STUB_NAME, ctx.fresh_dir("s11-bd"), json.dumps(PHASES)], e)
            for label, t in marks.items():
                if t is not None:
                    timeline[where].setdefault(label, []).append(t)

    med = {k: statistics.median(v) for k, v in warm.items() if v}
    cmed = {k: statistics.median(v) for k, v in cold.items()}
    rows = [
        row("warm, engine process", "torch load_inline(no_implicit_headers, build_directory) on a built dir",
            warm["torch"]),
        row("warm, engine process", "stubcache.load_inline drop-in (import + first hit)", warm["dropin"]),
        row("warm, engine process", "StubCache().load(spec) (import + first hit)", warm["load"]),
        row("warm, engine process", "stubcache.load_inline drop-in into a new build_directory (import + first hit "
            "+ placing the copy: a fresh /tmp)", warm["new_dir"]),
        row("warm, engine process (part)", "import stubcache (drop-in child)", imports["dropin"]),
        row("warm, engine process (part)", "import stubcache (load child)", imports["load"]),
        row("warm, engine process (part)", "cyclic GC pauses in the window (torch's load_inline)", gcs["torch"]),
        row("warm, engine process (part)", "cyclic GC pauses in the window (drop-in)", gcs["dropin"]),
        row("warm, engine process (part)", "cyclic GC pauses in the window (StubCache().load)", gcs["load"]),
    ]
    if warm["capless"]:
        rows.insert(4, row("warm, engine process", "stubcache.load_inline drop-in without CAP_CHECKPOINT_RESTORE "
                           "and CAP_SYS_ADMIN (an ordinary user, a container's root: no /proc/self/map_files)",
                           warm["capless"]))
    rows += [row("warm first hit, where the time goes", k, v) for k, v in pieces.items()]
    rows += [
        row("cold, engine process", "stubcache drop-in, fresh root (toolchain probe included)", cold["fresh"]),
        row("cold, engine process", "torch load_inline(no_implicit_headers), fresh build dir", cold["torch"]),
        row("cold, engine process", "stubcache drop-in, new root on a host this user built on (probe memo)",
            cold["new_root"]),
        row("cold, engine process", "stubcache drop-in, new stub in an existing root", cold["existing"]),
        row("cold", "bare c++ -shared -fPIC (spawned from the benchmark)", cold["bare"]),
    ]
    for where, case in (("existing", "cold, new stub in an existing root: phase ended after"),
                        ("fresh", "cold, fresh root on a fresh host: phase ended after")):
        rows += [row(case, label, times) for label, times in timeline[where].items()]
    r_drop = ratio(med["torch"], med["dropin"])
    r_load = ratio(med["torch"], med["load"])
    r_fresh = ratio(cmed["fresh"], cmed["torch"])
    r_exist = ratio(cmed["existing"], cmed["bare"])
    r_fresh_bare = ratio(cmed["fresh"], cmed["bare"])
    r_new_root = ratio(cmed["new_root"], cmed["torch"])
    targets = [
        target("warm engine start, drop-in: ≥ 5× faster than torch's warm load_inline",
               f"{r_drop:.2f}× ({fmt_time(med['dropin'])} vs {fmt_time(med['torch'])})", "≥ 5× (aim 10×)",
               r_drop >= 5, headline="1a"),
        target("warm engine start, StubCache.load: ≥ 5× faster than torch's warm load_inline",
               f"{r_load:.2f}× ({fmt_time(med['load'])} vs {fmt_time(med['torch'])})", "≥ 5× (aim 10×)",
               r_load >= 5, headline="1b"),
        target("cold engine start, fresh root: faster than torch's cold load_inline(no_implicit_headers)",
               f"{r_fresh:.2f}× of torch ({fmt_time(cmed['fresh'])} vs {fmt_time(cmed['torch'])}); "
               f"{r_fresh_bare:.2f}× the bare compiler; a new root on a host this user built on: "
               f"{r_new_root:.2f}× of torch ({fmt_time(cmed['new_root'])})", "< 1×", r_fresh < 1, headline="2a"),
        target("cold engine start, existing root: ≤ 1.15× the bare compiler",
               f"{r_exist:.2f}× ({fmt_time(cmed['existing'])} vs {fmt_time(cmed['bare'])})", "≤ 1.15×",
               r_exist <= 1.15, headline="2b"),
    ]
    notes = [
        f"Children: {inst.note}; each imported torch and torch.utils.cpp_extension before its clock started.",
        (f"A warm drop-in call without CAP_CHECKPOINT_RESTORE and CAP_SYS_ADMIN (run through `{' '.join(capless)}`): "
         f"{ratio(med['torch'], med['capless']):.2f}× faster than torch's warm load_inline "
         f"({fmt_time(med['capless'])}); the run's target rows are root's." if capless else
         "No run without CAP_CHECKPOINT_RESTORE and CAP_SYS_ADMIN (needs root and setpriv, and a kernel that "
         "refuses /proc/self/map_files without them)."),
        f"A warm drop-in call into a new build_directory (the library copied there): "
        f"{ratio(med['torch'], med['new_dir']):.2f}× faster than torch's warm load_inline "
        f"({fmt_time(med['new_dir'])} vs {fmt_time(med['torch'])}; torch itself would build again there).",
        "Cyclic GC (gc.callbacks in each warm child): windows that ran a generation-1 or older collection "
        f"(torch's young objects, several ms): torch {older['torch']} of {len(gcs['torch'])}, drop-in "
        f"{older['dropin']} of {len(gcs['dropin'])}, StubCache().load {older['load']} of {len(gcs['load'])}; "
        "such a pass starts in whichever window allocates past the threshold, and the engine pays it "
        "at its next allocations otherwise.",
        "Warm children ran interleaved (torch, drop-in, torch, load, breakdown) with STUBCACHE_REQUIRE_HIT=1; "
        f"{reps} rounds after one warm-up round.",
        "Modules a first hit imports (breakdown child): " + ", ".join(modules) +
        f" ({len(modules)}, {pyc_bytes / 1024:.0f} KiB of bytecode).",
        "The bare compiler is spawned from the benchmark process (no torch loaded): the floor a build can reach.",
        "Cold phases: one more cold start of each kind per repetition, with the logger 'stubcache' at DEBUG "
        "(its build-phase lines, stamped as logged, in ms after the call began; not part of the timed rows).",
    ]
    return {"id": 11, "title": "Engine start, warm and cold (torch imported first)", "rows": rows,
            "targets": targets, "notes": notes}
