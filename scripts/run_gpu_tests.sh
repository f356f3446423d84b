#!/usr/bin/env bash
# Run kvarena's GPU tests (tests/gpu) and the CUDA demo on a machine with a CUDA GPU.
#
#   bash scripts/run_gpu_tests.sh [-k EXPR]       # a few minutes; exit 0 only if nothing failed
#
# Works from a plain copy of the source tree: nothing is installed, the tree is put on
# PYTHONPATH. Needs python3 with a CUDA-enabled torch, cuda-bindings, pytest and a
# C++ compiler; platformdirs is not needed (the stub cache is a private temporary directory).
# Prints the environment and what is missing, then one line per test (PASS / FAIL / SKIP /
# TIMEOUT), each test in its own process (an illegal address poisons a process's CUDA context),
# then runs the CUDA demo on a cold cache and again warm. Temporary directories are removed.
#
# Exit: 0 nothing failed; 1 a test or the demo failed; 2 bad arguments; 3 cannot run here
# (something missing, or torch sees no GPU: set KVARENA_ALLOW_SKIP=1 to run anyway).
# Environment: PYTHON (default python3), KVARENA_GPU_TEST_TIMEOUT (seconds per test, 300).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
ROOT=$PWD
PY="${PYTHON:-python3}"
K_EXPR=""
while [ $# -gt 0 ]; do
    case "$1" in
        -k) [ $# -ge 2 ] || { echo "-k needs an expression" >&2; exit 2; }; K_EXPR=$2; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvarena-gpu.XXXXXX") || { echo "cannot create a temporary directory" >&2; exit 3; }
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM  # the EXIT trap still cleans up
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1  # leave the copied tree as it was
export STUBCACHE_DIR="$WORK/cache"  # private and fresh: the first arena compiles the stub
export KVARENA_GPU_ISOLATED=1  # this script starts one process per test itself
TIMEOUT_S="${KVARENA_GPU_TEST_TIMEOUT:-300}"
# a test still running this long prints every thread's stack into its log: a hang says where
DUMP_S=$(awk -v t="$TIMEOUT_S" 'BEGIN { d = t - 10; if (d < 1) d = t / 2; printf "%d", (d < 1 ? 1 : d) }')

echo "== environment"
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "MISSING  $PY (set PYTHON=/path/to/python3)"
    exit 3
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>&1 | sed 's/^/gpu      /'
"$PY" - <<'PYEOF'
import importlib, os, platform, shutil, subprocess, sys

missing = []
allow_skip = os.environ.get("KVARENA_ALLOW_SKIP") == "1"

def ok(what, detail=""):
    print(f"ok       {what}{'  ' + detail if detail else ''}")

def miss(what, why, gpu_only=False):
    if gpu_only and allow_skip:
        print(f"MISSING  {what}: {why} (KVARENA_ALLOW_SKIP=1: going on, the GPU tests will skip)")
        return
    print(f"MISSING  {what}: {why}")
    missing.append(what)

print(f"python   {sys.version.split()[0]} {platform.machine()} ({sys.executable})")
if sys.version_info < (3, 10):
    miss("python>=3.10", f"this is {sys.version.split()[0]}")
try:
    import torch
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(ngpu))
    ok(f"torch {torch.__version__}", f"built for CUDA {torch.version.cuda}; {ngpu} GPU(s) visible{': ' + names if names else ''}")
    if torch.version.cuda is None:
        miss("a CUDA build of torch", "this torch is CPU-only", gpu_only=True)
except Exception as exc:
    miss("torch", f"{type(exc).__name__}: {exc}")
for mod, pkg, why in (("cuda.bindings.driver", "cuda.bindings", "the CUDA arena's driver calls (pip package cuda-bindings)"),
                      ("pytest", "pytest", "runs the tests")):
    try:
        importlib.import_module(mod)
        ok(mod, getattr(importlib.import_module(pkg), "__version__", ""))
    except Exception as exc:
        miss(mod, f"{why} ({type(exc).__name__}: {exc})", gpu_only=mod.startswith("cuda"))
cxx = os.environ.get("CXX") or "c++"
path = shutil.which(cxx)
if path:
    ver = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    ok(f"C++ compiler {path}", ver[0] if ver else "")
else:
    miss(f"C++ compiler {cxx!r}", "stubcache compiles the allocator stub with it (set CXX)")
try:
    import stubcache, kvarena
    ok("import stubcache, kvarena", f"from {os.path.dirname(os.path.dirname(stubcache.__file__))}")
    try:  # the whole chain the GPU tests rely on, on the host: compiler, cache, dlopen, a slot
        with kvarena.KvArena(1 << 20) as arena:
            arena.commit(4096)
            t = arena.stub_timing
        ok("allocator stub", f"{'built' if t.built else 'cache hit'} via {t.method} in {t.seconds * 1e3:.0f} ms "
           f"(a host arena works; platformdirs imported: {'platformdirs' in sys.modules})")
    except Exception as exc:
        miss("a working allocator stub build", f"{type(exc).__name__}: {exc}")
except Exception as exc:
    miss("import stubcache, kvarena", f"{type(exc).__name__}: {exc}")
try:
    import platformdirs  # noqa: F401
    ok("platformdirs", "(not needed here: STUBCACHE_DIR is set)")
except ImportError:
    print("absent   platformdirs (not needed: STUBCACHE_DIR is set, so stubcache never imports it)")
if missing:
    print(f"cannot run the GPU tests here: missing {', '.join(missing)}")
    sys.exit(3)
PYEOF
pre=$?
[ "$pre" -eq 0 ] || exit 3

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [ "${KVARENA_ALLOW_SKIP:-0}" != 1 ]; then
        echo "torch sees no CUDA GPU here: every GPU test would only skip (set KVARENA_ALLOW_SKIP=1 to run anyway)"
        exit 3
    fi
    echo "torch sees no CUDA GPU: running anyway (KVARENA_ALLOW_SKIP=1); expect SKIP lines"
    HAVE_GPU=0
else
    HAVE_GPU=1
fi

echo "== tests/gpu, one process per test (timeout ${TIMEOUT_S}s each)"
collect=("$PY" -m pytest --collect-only -q -p no:cacheprovider tests/gpu)
[ -n "$K_EXPR" ] && collect+=(-k "$K_EXPR")
"${collect[@]}" >"$WORK/collect.log" 2>&1
rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then  # 5: nothing collected, said below
    echo "FAIL     collecting tests/gpu:"
    sed 's/^/    /' "$WORK/collect.log"
    exit 1
fi
# node ids only: a warning printed during collection can contain "::" too (torch names C++ scopes)
mapfile -t TESTS < <(grep -E '^tests/gpu/[^[:space:]]+\.py::[^[:space:]]+$' "$WORK/collect.log")
if [ "${#TESTS[@]}" -eq 0 ]; then
    echo "FAIL     no GPU test collected${K_EXPR:+ for -k \"$K_EXPR\"}"
    exit 1
fi

npass=0 nfail=0 nskip=0 failed=()
line() { printf '%-8s %-96s %7s  %s\n' "$1" "$2" "$3" "$4"; }
for i in "${!TESTS[@]}"; do
    id=${TESTS[$i]}
    log="$WORK/test$i.log"
    t0=$(date +%s.%N)
    timeout -k 10 "$TIMEOUT_S" "$PY" -m pytest -q -rs -p no:cacheprovider -o faulthandler_timeout="$DUMP_S" \
        --basetemp="$WORK/tmp$i" "$id" >"$log" 2>&1
    rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1fs", b - a }')
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        line TIMEOUT "$id" "$secs" "no result after ${TIMEOUT_S}s"; nfail=$((nfail + 1)); failed+=("$i")
    elif [ "$rc" -eq 0 ] && grep -qE '\b1 passed\b' "$log"; then
        line PASS "$id" "$secs" ""; npass=$((npass + 1))
    elif [ "$rc" -eq 0 ] && grep -qE '\b1 skipped\b' "$log"; then
        why=$(grep -m1 -oE 'SKIPPED \[[0-9]+\] [^:]+:[0-9]+: .*' "$log" | sed -E 's/^SKIPPED \[[0-9]+\] [^:]+:[0-9]+: //')
        line SKIP "$id" "$secs" "$why"; nskip=$((nskip + 1))
    else
        if [ "$rc" -gt 128 ]; then why="killed by signal $((rc - 128))"; else
            why=$(grep -m1 -E '^E  |Error|error' "$log" | sed -E 's/^E +//' | cut -c1-160); fi
        line FAIL "$id" "$secs" "${why:-exit $rc}"; nfail=$((nfail + 1)); failed+=("$i")
    fi
done

demo_rc=0
if [ "$HAVE_GPU" = 1 ] && [ -z "$K_EXPR" ]; then
    echo "== demo: python -m kvarena.demo --device cuda (cold stub cache, then warm)"
    export STUBCACHE_DIR="$WORK/demo-cache"
    for run in cold warm; do
        timeout -k 10 120 "$PY" -m kvarena.demo --device cuda >"$WORK/demo-$run.log" 2>&1
        rc=$?
        sed 's/^/    /' "$WORK/demo-$run.log"
        if [ "$rc" -eq 0 ]; then line PASS "demo ($run)" "" ""; else line FAIL "demo ($run)" "" "exit $rc"; demo_rc=1; fi
    done
fi

if [ "${#failed[@]}" -gt 0 ]; then
    echo "== output of the failed tests"
    for i in "${failed[@]}"; do
        echo "--- ${TESTS[$i]}"
        tail -n 80 "$WORK/test$i.log" | sed 's/^/    /'
    done
fi
echo "== ${#TESTS[@]} GPU tests: $npass passed, $nfail failed, $nskip skipped"
[ "$nfail" -eq 0 ] && [ "$demo_rc" -eq 0 ] || exit 1
exit 0
