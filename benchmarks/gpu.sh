#!/usr/bin/env bash
# The GPU check, one command, on the machine that is lent as it is: no network, no .venv,
# nothing installed. Its python3 holds a CUDA build of torch (and triton); src/ goes on
# the path; every optional package it lacks (pytest, triton, inf_cl) is reported as
# "not measured" and the run goes on.
#
#   bash benchmarks/gpu.sh OUT_DIR                 # on a CUDA machine, under 8 minutes
#                                                  #   (OUT_DIR defaults to ./gpu-results)
#   PY=/path/to/python bash benchmarks/gpu.sh OUT  # another interpreter
#   bash benchmarks/gpu.sh OUT --cpu-check         # the same steps on the CPU, tiny sizes
#                                                  #   (how the tests check this script)
# Steps, each under its own timeout (120 + 110 + 210 s: the whole under 8 minutes), each logged
# to OUT/<step>.log:
#   1. tests that need CUDA           (pytest -k cuda; "not measured" without pytest)
#   2. the selftest on every GPU       (torchrun -m wholebatch selftest, NCCL; gloo with --cpu-check)
#   3. the GPU loss benchmark          (python -m benchmarks.gpu_bench: CLIP, SigLIP's fused
#                                       tiles, Inf-CL at its Table 1 sizes) -> OUT/RESULTS.md
# OUT/summary.md holds the interpreter, torch, the optional packages and each step's status.
# Exit 0 when every step that ran passed; 1 when one failed; 2 without CUDA (or usage).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=gpu-results
CPU_CHECK=0
for arg in "$@"; do
    case $arg in
        --cpu-check) CPU_CHECK=1 ;;
        -*) echo "usage: bash benchmarks/gpu.sh [OUT_DIR] [--cpu-check]" >&2; exit 2 ;;
        *) OUT=$arg ;;
    esac
done
t0=$(date +%s)

# The interpreter: $PY, else the first of python3, python, .venv/bin/python that imports torch.
if [ -z "${PY:-}" ]; then
    for cand in python3 python "$ROOT/.venv/bin/python"; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import torch' >/dev/null 2>&1; then
            PY=$cand
            break
        fi
    done
fi
if [ -z "${PY:-}" ] || ! "$PY" -c 'import torch' >/dev/null 2>&1; then
    echo "benchmarks/gpu.sh: no interpreter with torch (tried \$PY, python3, python, .venv); set PY=" >&2
    exit 2
fi
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Nothing is installed here, and nothing is fetched: pip would find no index.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1
cd "$ROOT"

if [ "$CPU_CHECK" = 0 ]; then
    if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        echo "benchmarks/gpu.sh: no CUDA device: torch.cuda.is_available() is False for $PY" >&2
        echo "  (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')); run it on a GPU machine, or pass --cpu-check" >&2
        exit 2
    fi
    ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
else
    ngpu=2
fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)

summary="$OUT/summary.md"
{
    echo "# benchmarks/gpu.sh"
    echo
    echo "- interpreter: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
    echo "- torch: $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
    echo "- mode: $([ "$CPU_CHECK" = 1 ] && echo 'CPU check (tiny sizes, gloo)' || echo "$ngpu CUDA device(s)")"
} >"$summary"
missing=()
for pkg in pytest triton inf_cl; do
    if "$PY" -c "import $pkg" >/dev/null 2>&1; then
        echo "- $pkg: $("$PY" -c "import importlib.metadata as m, sys; n = {'inf_cl': 'inf-cl'}.get('$pkg', '$pkg'); print(m.version(n))" 2>/dev/null || echo present)" >>"$summary"
    else
        echo "- $pkg: not installed: what needs it is not measured" >>"$summary"
        missing+=("$pkg")
    fi
done
echo >>"$summary"
echo "| step | status | seconds | log |" >>"$summary"
echo "|---|---|---|---|" >>"$summary"

failed=0
step() {  # step NAME SECONDS CMD...: run CMD under a timeout, log it, record its status
    local name=$1 limit=$2
    shift 2
    local s0 rc status
    s0=$(date +%s)
    echo "==> $name"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=passed ;;
        124) status="timed out after $limit s"; failed=1 ;;
        *) status="failed (exit $rc)"; failed=1 ;;
    esac
    echo "| $name | $status | $(( $(date +%s) - s0 )) | $name.log |" >>"$summary"
    echo "    $status"
}
skip() {  # skip NAME WHY
    echo "| $1 | not measured: $2 | 0 | - |" >>"$summary"
    echo "==> $1: not measured: $2"
}

hide=()
for pkg in ${GPU_HIDE:-}; do hide+=("$pkg"); done  # treat as missing (the tests' check)
for pkg in "${missing[@]}"; do hide+=("$pkg"); done

# The files that hold CUDA tests (each needs torch alone: no peer library to collect them).
cuda_tests=(tests/unit/test_loss_infcl.py tests/unit/test_loss_fused.py
            tests/distributed/test_losses_agree.py tests/distributed/test_cache_inloop.py)
if [[ " ${missing[*]} " == *" pytest "* ]]; then
    skip "1-cuda-tests" "pytest is not installed"
else
    step "1-cuda-tests" 120 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider \
        -k cuda "${cuda_tests[@]}"
fi

if [ "$CPU_CHECK" = 1 ]; then
    step "2-selftest" 110 "$PY" -m wholebatch selftest --nproc "$ngpu" --backend gloo
else
    step "2-selftest" 110 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" \
        -m wholebatch selftest --backend nccl
fi

bench=("$PY" -m benchmarks.gpu_bench --results "$OUT/RESULTS.md" --hide "${hide[@]}")
if [ "$CPU_CHECK" = 1 ]; then
    bench+=(--device cpu --sizes 256 --dim 16 --repeats 1 --siglip-sizes 300 --siglip-dim 16
            --infcl-sizes 300 --infcl-dim 16)
fi
step "3-gpu-bench" 210 "${bench[@]}"

echo >>"$summary"
echo "total $(( $(date +%s) - t0 )) s; the benchmark's table: RESULTS.md" >>"$summary"
echo "==> done in $(( $(date +%s) - t0 )) s: $summary"
exit "$failed"
