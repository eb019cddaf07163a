#!/usr/bin/env bash
# One GPU command (issue 10): on a machine with CUDA, in about 8 minutes at most,
#   1. the tests that need CUDA         (pytest -k cuda),
#   2. the NCCL selftest on every GPU   (torchrun --nproc-per-node <GPUs> -m wholebatch selftest),
#   3. the GPU loss benchmark           (python -m benchmarks.gpu_bench: N = 65,536 and 262,144,
#      D = 512, bf16 and fp32), whose table goes into benchmarks/RESULTS.md.
# Usage: bash benchmarks/gpu.sh   (or: make gpu).  PY=path/to/python to use another interpreter.
# Without a CUDA device it stops at once with exit code 2 and says why.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
t0=$(date +%s)

if ! command -v nvidia-smi >/dev/null 2>&1 && [ ! -e /dev/nvidiactl ]; then
    echo "benchmarks/gpu.sh: no CUDA device: neither nvidia-smi nor /dev/nvidiactl on this machine;" >&2
    echo "  run it on a GPU machine with a CUDA build of torch" >&2
    exit 2
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "benchmarks/gpu.sh: no CUDA device: torch.cuda.is_available() is False for $PY" >&2
    echo "  (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')); run it on a GPU machine with a CUDA build of torch" >&2
    exit 2
fi
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
echo "==> $ngpu CUDA device(s): $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"

echo "==> 1/3 tests that need CUDA: pytest -k cuda"
TRITON_INTERPRET=0 timeout 180 "$PY" -m pytest -q -k cuda tests

echo "==> 2/3 NCCL selftest on $ngpu GPU(s)"
timeout 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" \
    -m wholebatch selftest --backend nccl

echo "==> 3/3 GPU loss benchmark -> benchmarks/RESULTS.md"
timeout 300 "$PY" -m benchmarks.gpu_bench --results benchmarks/RESULTS.md

echo "==> done in $(( $(date +%s) - t0 )) s"
