#!/usr/bin/env bash
# Run kvarena's GPU tests (tests/gpu) and the CUDA demo on a machine with a CUDA GPU.
#
#   bash scripts/run_gpu_tests.sh            # a few minutes at most; exit 0 only if all passed
#
# Needs: a CUDA-enabled torch, cuda-bindings (pip install '.[cuda]'), pytest, a C++ compiler.
# Uses a fresh private stub cache (mktemp -d), so the first arena compiles the stub and the
# demo's second run shows a cache hit. Exits 3 if torch sees no GPU (the tests would only skip);
# set KVARENA_ALLOW_SKIP=1 to run anyway.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STUBCACHE_DIR="$(mktemp -d)"
export STUBCACHE_DIR
trap 'rm -rf "$STUBCACHE_DIR"' EXIT
PY="${PYTHON:-python3}"

echo "== environment"
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$PY" - <<'PYEOF'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.machine())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count() if torch.cuda.is_available() else 0)
for mod in ("cuda.bindings", "pytest", "filelock", "platformdirs", "stubcache", "kvarena"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "ok"))
    except Exception as exc:  # report, the tests say what it costs
        print(mod, "MISSING:", exc)
PYEOF

if [ "${KVARENA_ALLOW_SKIP:-0}" != 1 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "torch sees no CUDA GPU here: the GPU tests would all skip (set KVARENA_ALLOW_SKIP=1 to run anyway)"
    exit 3
fi

rc=0
echo "== tests/gpu"
timeout 300 "$PY" -m pytest tests/gpu -v -rs -p no:cacheprovider || rc=$?
echo "== demo (cold cache for the demo's own root, then a hit)"
export STUBCACHE_DIR="$STUBCACHE_DIR/demo"
timeout 120 "$PY" -m kvarena.demo --device cuda || rc=$?
timeout 120 "$PY" -m kvarena.demo --device cuda || rc=$?
echo "== exit $rc"
exit "$rc"
