"""What the hit path's stand-ins for standard modules save, in an engine process and in a bare one.

    python benchmarks/standins.py [--quick] [--reps N] [--no-groups] [--only A,B,...] [--fresh-engine N]
                                  [--work DIR] [--json FILE]

The hit path avoids importing two standard modules by using stand-ins: ``stubcache/edge/cjson.py``
(``_json``'s C functions instead of ``import json``) and ``TYPE_CHECKING = False`` instead of
``from typing import TYPE_CHECKING``. (It measured four more — ``_digest``, ``_thread``,
``_operator``, ``_collections_abc`` — which were then replaced by ``hashlib``, ``threading``,
``operator`` and ``collections.abc``: docs/design.md has those numbers.) This benchmark builds variants of the package in a
scratch directory — A, the tree as is; B, every stand-in replaced by the public module; and, unless
``--no-groups``, one variant per stand-in with only it replaced (and the three of the threads group
together) and B with some kept ("B but json and typing kept") — by a small text
transformation of a *copy* of the tree (:func:`transform`; the checkout is never written), builds
each variant's wheel and installs it (``pip install --target``) into a directory of its own.

Children run as fresh processes; each puts its variant's directory first on ``sys.path`` (before
anything is timed) and checks that ``stubcache`` came from there. Two interpreters (``_wheel.py``):
a venv without torch (``make_wheel_env``: the set-up of scenario 2 and of target 5, a torch-free
``python -c``) and a venv that sees this Python's site-packages, torch included, through one path
line (:func:`torch_venv`: no ``.pth`` file of theirs runs at start-up). Each variant has its own warm
roots, built and then hit once by that variant before timing; every timed child runs with
``STUBCACHE_REQUIRE_HIT=1`` and checks that the compact hit path answered (``stubcache.cache.core``,
which the full path imports, is not loaded), so nothing is built and no full-path lookup is timed.
What is timed, all variants interleaved in each round (the order rotated every round):

* bare: ``python -c`` in the torch-free venv, ``import stubcache`` + the first
  ``StubCache().load(StubSpec(...))`` timed in-process with ``perf_counter``, and the whole
  process's wall time; the floor ``python -c 'import ctypes; ctypes.CDLL(path)'`` beside it.
* bare, drop-in: the same with ``stubcache.load_inline(...)`` (``is_python_module=False,
  no_implicit_headers=True, build_directory=D``), in the torch venv (torch installed, not imported:
  the drop-in's entries carry torch's fingerprint), with its own floor.
* engine: ``import torch, torch.utils.cpp_extension`` first (untimed), then ``import stubcache`` +
  the first hit, both kinds. A process importing torch takes ~2 s here, so the many repetitions
  are forks of one server process that imported torch (a process where torch was imported first,
  as in an engine, minus the interpreter start); ``--fresh-engine N`` also runs N fully fresh
  engine processes per variant and kind for A and B, to check the forks against.

Reports medians, B/A (and group/A) ratios and the difference in ms. Nothing is asserted. Not part
of ``run.py``'s scenarios: it is a decision benchmark (docs/design.md, "Stand-ins for standard
modules"), like ``compare_fresh_hit.py``.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from _common import PY, REPO  # noqa: E402
from _wheel import WheelEnv, _run, clean_env, make_wheel_env  # noqa: E402

NAME = "standins_probe"
SOURCE = 'extern "C" int standins_probe(void) { return 1; }\n'
# The stand-ins, one transformation each.
GROUPS = ("json", "typing")

# --- the transformation (of a copy of the tree) ---------------------------------------------------

JSON_PUBLIC = '''"""json's dumps and loads (benchmarks/standins.py: the stand-in replaced by the public module)."""

from json import dumps, loads  # noqa: F401
'''

TYPING_RE = re.compile(r"^TYPE_CHECKING = False\b.*$", re.M)


def transform(pkg: Path, groups: set[str]) -> dict[str, int]:
    """Replace the stand-ins of ``groups`` in the copied package ``pkg`` (never the checkout);
    returns how many places each group changed, so a stand-in that moved is noticed."""
    assert REPO not in pkg.resolve().parents, pkg
    changed = dict.fromkeys(groups, 0)
    if "json" in groups:
        (pkg / "edge" / "cjson.py").write_text(JSON_PUBLIC)
        changed["json"] += 1
    for path in sorted(pkg.rglob("*.py")):
        text = new = path.read_text()
        if "typing" in groups:
            new, n = TYPING_RE.subn("from typing import TYPE_CHECKING", new)
            changed["typing"] += n
        if new != text:
            path.write_text(new)
    left = {g: [str(p.relative_to(pkg)) for p in pkg.rglob("*.py") if pat.search(p.read_text())]
            for g, pat in (("typing", TYPING_RE),) if g in groups}
    if any(left.values()) or not all(changed.values()):
        raise SystemExit(f"standins: transformation incomplete: changed {changed}, left {left}")
    return changed


def slug(tag: str) -> str:
    return re.sub(r"\W+", "-", tag).strip("-")


def torch_venv(work: Path) -> WheelEnv:
    """A venv that sees this Python's site-packages (torch, filelock, ...) through one path line,
    so that none of the ``.pth`` files there run at start-up (``--system-site-packages`` would run
    them: here an editable install's finder and this sandbox's certifi hook, which import typing,
    re, collections, ... in every process, the floor's included)."""
    _run([PY, "-m", "venv", "--without-pip", str(work)])
    vpy = str(work / "bin" / "python")
    site = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "_standins_torch.pth").write_text("".join(f"{p}\n" for p in paths))
    ver = subprocess.run([vpy, "-c", "import torch; print(torch.__version__)"], stdout=subprocess.PIPE, text=True,
                         env=clean_env({}), cwd=str(work), check=True).stdout.strip()
    return WheelEnv(vpy, False, f"a venv with this Python's site-packages as one path line (torch {ver}; their "
                                ".pth files not run)", str(work))


def build_variant(work: Path, tag: str, groups: set[str]) -> tuple[Path, dict]:
    """Copy the tree, transform it, build its wheel and install it into ``work/tag/site``."""
    src = work / tag / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    for pkg in ("stubcache", "kvarena"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    changed = transform(src / "stubcache", groups)
    dist = work / tag / "dist"
    _run([PY, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(src)])
    site = work / tag / "site"
    # pip compiles the bytecode on install, as for users.
    _run([PY, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
          glob.glob(str(dist / "stubcache-*.whl"))[0]], env=clean_env({}))
    return site, changed


# --- the children ---------------------------------------------------------------------------------

# Timed part, shared by every child: `import stubcache` + the first hit; then (untimed) checks.
# Before it: sys.path[0] = the variant's directory; SITE, KIND, SRC, NAME, BD set.
TIMED = r"""
pc = time.perf_counter
src = open(SRC).read()
t0 = pc()
import stubcache
t1 = pc()
if KIND == "dropin":
    r = stubcache.load_inline(NAME, src, build_directory=BD, is_python_module=False, no_implicit_headers=True)
else:
    r = stubcache.StubCache().load(stubcache.StubSpec(NAME, src, is_python_module=False, no_implicit_headers=True))
t2 = pc()
present = [m for m in ("json", "hashlib", "typing", "threading", "operator", "collections.abc", "re")
           if m in sys.modules]
RESULT = {"import": t1 - t0, "total": t2 - t0, "compact": "stubcache.cache.core" not in sys.modules,
          "ours": stubcache.__file__.startswith(SITE), "torch": "torch" in sys.modules, "modules": present,
          "lib": str(getattr(r, "_name", r))}
"""

# The result printed by repr, not json: importing json after the hit would add to the process's
# wall time in A only (B's hit imported it already).
FRESH = ("import sys, time\nSITE, KIND, SRC, NAME, BD = sys.argv[1:6]\nsys.path.insert(0, SITE)\n" + "{pre}"
         + TIMED + "print(repr(RESULT))\n")
BARE = FRESH.replace("{pre}", "")
ENGINE_FRESH = FRESH.replace("{pre}", "import torch, torch.utils.cpp_extension\n")

# The fork server: imports torch once, then forks one child per request line (a JSON object with
# the child's site, kind, source, name, build directory and environment) and answers one line.
SERVER = r"""
import importlib.machinery, json, os, sys, time, traceback
import torch, torch.utils.cpp_extension
for site in sys.argv[1:]:  # as a fresh engine child would have: the directory listed during torch's imports
    importlib.machinery.PathFinder.find_spec("standins_no_such_module", [site])
TIMED = json.loads(sys.stdin.readline())
while True:
    line = sys.stdin.readline()
    if not line:
        break
    req = json.loads(line)
    r, w = os.pipe()
    pid = os.fork()
    if not pid:
        os.close(r)
        try:
            os.environ.update(req["env"])
            SITE, KIND, SRC, NAME, BD = req["args"]
            sys.path.insert(0, SITE)
            g = {"sys": sys, "time": time, "SITE": SITE, "KIND": KIND, "SRC": SRC, "NAME": NAME, "BD": BD}
            exec(TIMED, g)
            out, code = json.dumps(g["RESULT"]), 0
        except BaseException:
            out, code = json.dumps({"error": traceback.format_exc()}), 1
        os.write(w, out.encode())
        os._exit(code)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    os.waitpid(pid, 0)
    sys.stdout.write(b"".join(chunks).decode() + "\n")
    sys.stdout.flush()
"""

FLOOR = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"


class Server:
    def __init__(self, python: str, cwd: str, sites: list[str]) -> None:
        self.proc = subprocess.Popen([python, "-c", SERVER, *sites], cwd=cwd, env=clean_env({}), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.proc.stdin.write(json.dumps(TIMED) + "\n")

    def ask(self, args: list[str], env: dict) -> dict:
        self.proc.stdin.write(json.dumps({"args": args, "env": env}) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def child(python: str, code: str, args: list[str], env: dict, cwd: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([python, "-c", code, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=300)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1]), wall


def wall(python: str, args: list[str], env: dict, cwd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([python, *args], env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL, timeout=120)
    return time.perf_counter() - t0


def check(d: dict, where: str) -> dict:
    if not (d["compact"] and d["ours"]):
        raise SystemExit(f"standins: {where}: not a compact hit of this variant's package: {d}")
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="A and B only, 5 rounds, no fresh engine processes")
    ap.add_argument("--reps", type=int, default=None, help="interleaved rounds (default 40; quick 5)")
    ap.add_argument("--no-groups", action="store_true", help="A and B only")
    ap.add_argument("--fresh-engine", type=int, default=None,
                    help="fully fresh engine processes per kind for A and B (default 5; quick 0)")
    ap.add_argument("--only", default=None, help="comma-separated variants to run (A among them), e.g. 'A,B'")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write every sample here")
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 40)
    fresh_n = args.fresh_engine if args.fresh_engine is not None else (0 if args.quick else 5)
    started = time.perf_counter()
    uptime = [subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True).stdout.strip()]
    work = args.work or Path(tempfile.mkdtemp(prefix="stubcache-standins-"))
    work.mkdir(parents=True, exist_ok=True)
    variants = {"A": set(), "B": set(GROUPS)}
    if not (args.quick or args.no_groups):
        variants.update({f"{g} only": {g} for g in GROUPS})
    if args.only:
        want = [v.strip() for v in args.only.split(",")]
        if not set(want) <= set(variants) or "A" not in want:
            raise SystemExit(f"--only: A and some of {list(variants)}")
        variants = {t: variants[t] for t in want}

    def log(msg: str) -> None:
        print(f"[standins {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    log(f"work {work}; making the two interpreters (torch-free venv, torch venv)")
    bare_py = make_wheel_env(work / "py-bare", REPO)
    eng_py = torch_venv(work / "py-torch")
    src_file = work / "probe.cpp"
    src_file.write_text(SOURCE)
    sites, changes = {}, {}
    for tag, groups in variants.items():
        sites[tag], changes[tag] = build_variant(work, slug(tag), groups)
        log(f"variant {tag}: replaced {changes[tag] or 'nothing'}")

    # Per variant: its own roots (and XDG/HOME dirs, as tests/conftest.py isolates them), built
    # and hit once by that variant, so the timed first hit is that variant's compact hit.
    envs, libs, bds = {}, {}, {}
    server = Server(eng_py.python, eng_py.cwd, [str(s) for s in sites.values()])
    for tag, site in sites.items():
        d = work / slug(tag)
        for kind in ("bare", "engine"):
            (d / f"root-{kind}").mkdir(mode=0o700)
            (d / f"home-{kind}").mkdir(mode=0o700)
            (d / f"bd-{kind}").mkdir(mode=0o700)
            h = d / f"home-{kind}"
            envs[tag, kind] = {"STUBCACHE_DIR": str(d / f"root-{kind}"), "HOME": str(h),
                               "XDG_STATE_HOME": str(h / "state"), "XDG_CACHE_HOME": str(h / "cache"),
                               "XDG_CONFIG_HOME": str(h / "config"), "XDG_DATA_HOME": str(h / "data")}
            bds[tag, kind] = str(d / f"bd-{kind}")
        a = lambda kind, k: [str(site), k, str(src_file), NAME, bds[tag, kind]]  # noqa: E731
        for _ in range(2):  # build (full path, leaves the hit record), then the compact hit
            r1, _w = child(bare_py.python, BARE, a("bare", "load"), clean_env(envs[tag, "bare"]), bare_py.cwd)
            r2 = server.ask(a("engine", "dropin"), envs[tag, "engine"])
            r3 = server.ask(a("engine", "load"), envs[tag, "engine"])
            # A drop-in call's record names the process's sys.path too: this one leaves its own.
            r4, _w = child(eng_py.python, BARE, a("engine", "dropin"), clean_env(envs[tag, "engine"]), eng_py.cwd)
        for r, where in ((r1, "bare load"), (r2, "engine drop-in"), (r3, "engine load"), (r4, "bare drop-in")):
            check(r, f"{tag} warm-up, {where}")
        libs[tag, "bare"] = glob.glob(str(work / slug(tag) / "root-bare" / "**" / f"{NAME}.so"),
                                      recursive=True)[0]
        libs[tag, "engine"] = glob.glob(str(work / slug(tag) / "root-engine" / "**" / f"{NAME}.so"),
                                        recursive=True)[0]
        for kind in ("bare", "engine"):
            envs[tag, kind]["STUBCACHE_REQUIRE_HIT"] = "1"
    keys = {k: Path(v).parent.name for k, v in libs.items()}
    log("entries: " + ", ".join(f"{t}/{k} {key[:12]}" for (t, k), key in keys.items()))
    cases = ("bare load: in-process", "bare load: import stubcache", "bare load: process wall", "bare floor (torch-free venv)",
             "bare drop-in: in-process", "bare drop-in: process wall", "floor (torch venv)",
             "engine drop-in", "engine load", "engine drop-in (fresh process)", "engine load (fresh process)",
             "engine drop-in: import stubcache", "engine load: import stubcache")
    samples = {(t, c): [] for t in variants for c in cases}
    modules: dict = {}
    tags = list(variants)
    log(f"{reps} interleaved rounds (+1 warm-up) of {len(tags)} variants")
    for i in range(reps + 1):
        order = tags[i % len(tags):] + tags[:i % len(tags)]
        for tag in order:
            site = str(sites[tag])
            be, ee = clean_env(envs[tag, "bare"]), clean_env(envs[tag, "engine"])
            argv = lambda kind, k: [site, k, str(src_file), NAME, bds[tag, kind]]  # noqa: E731
            got = {}
            r, w = child(bare_py.python, BARE, argv("bare", "load"), be, bare_py.cwd)
            got["bare load: in-process"], got["bare load: process wall"] = check(r, tag)["total"], w
            got["bare load: import stubcache"] = r["import"]
            modules[tag, "bare load"] = r["modules"]
            got["bare floor (torch-free venv)"] = wall(bare_py.python, ["-c", FLOOR, libs[tag, "bare"]], be,
                                                       bare_py.cwd)
            r, w = child(eng_py.python, BARE, argv("engine", "dropin"), ee, eng_py.cwd)
            got["bare drop-in: in-process"], got["bare drop-in: process wall"] = check(r, tag)["total"], w
            modules[tag, "bare drop-in"] = r["modules"]
            got["floor (torch venv)"] = wall(eng_py.python, ["-c", FLOOR, libs[tag, "engine"]], ee, eng_py.cwd)
            for kind, label in (("dropin", "engine drop-in"), ("load", "engine load")):
                r = check(server.ask(argv("engine", kind), envs[tag, "engine"]), tag)
                assert r["torch"], r
                got[label], got[f"{label}: import stubcache"] = r["total"], r["import"]
            if i:  # the first round warms the page cache
                for c, v in got.items():
                    samples[tag, c].append(v)
    server.close()
    for i in range(fresh_n):
        for tag in ("A", "B"):
            for kind, label in (("dropin", "engine drop-in (fresh process)"), ("load", "engine load (fresh process)")):
                r, _w = child(eng_py.python, ENGINE_FRESH, [str(sites[tag]), kind, str(src_file), NAME,
                                                            bds[tag, "engine"]],
                              clean_env(envs[tag, "engine"]), eng_py.cwd)
                samples[tag, label].append(check(r, tag)["total"])
    uptime.append(subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True).stdout.strip())

    med = {k: statistics.median(v) if v else None for k, v in samples.items()}
    print(f"\nload: start `{uptime[0]}`; end `{uptime[1]}`; {time.perf_counter() - started:.0f} s")
    print(f"interpreters: torch-free: {bare_py.note}; torch: {eng_py.note}")
    print(f"variants installed with pip install --target from their own wheels; {reps} interleaved rounds "
          f"(medians), fresh engine processes: {fresh_n} per kind (A, B)\n")
    print("| case | " + " | ".join(tags) + " | " + " | ".join(f"{t} − A" for t in tags[1:]) + " | "
          + " | ".join(f"{t} / A" for t in tags[1:]) + " |")
    print("|---" * (1 + 3 * len(tags) - 2) + "|")
    for c in cases:
        a = med["A", c]
        if a is None:
            continue
        vals = [med[t, c] for t in tags]
        print(f"| {c} | " + " | ".join("-" if v is None else f"{v * 1e3:.2f} ms" for v in vals) + " | "
              + " | ".join("-" if v is None else f"{(v - a) * 1e3:+.2f} ms" for v in vals[1:]) + " | "
              + " | ".join("-" if v is None else f"{v / a:.3f}" for v in vals[1:]) + " |")
    # Every variant's floor runs the same command: their pooled median is the floor of the ratios.
    fl = statistics.median([x for t in tags for x in samples[t, "bare floor (torch-free venv)"]])
    fl2 = statistics.median([x for t in tags for x in samples[t, "floor (torch venv)"]])
    print(f"\nfloors, pooled over the variants: torch-free venv {fl * 1e3:.2f} ms, torch venv {fl2 * 1e3:.2f} ms")
    for t in tags:
        print(f"{t}: bare load hit / floor (process wall, torch-free venv): "
              f"{med[t, 'bare load: process wall'] / fl:.2f}× ({med[t, 'bare load: process wall'] * 1e3:.1f} vs "
              f"{fl * 1e3:.1f} ms); bare drop-in / floor (torch venv): "
              f"{med[t, 'bare drop-in: process wall'] / fl2:.2f}×; standard modules after a bare load hit: "
              f"{', '.join(modules[t, 'bare load']) or 'none'}; after a bare drop-in hit: "
              f"{', '.join(modules[t, 'bare drop-in']) or 'none'}")
    if args.json:
        args.json.write_text(json.dumps({"uptime": uptime, "reps": reps, "variants": {t: sorted(g) for t, g in
                                                                                    variants.items()},
                                         "samples": {f"{t} | {c}": v for (t, c), v in samples.items()}}, indent=1))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
