"""`benchmarks/gpu.sh` and its driver, as far as a machine without a GPU can check them.

The script must stop at once, clearly, without CUDA; its Python driver must run
end to end (here on CPU at tiny sizes) and write its table into a results file,
replacing its own earlier section on a rerun and leaving the rest alone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_sh_fails_fast_without_cuda() -> None:
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh")],
        capture_output=True, text=True, timeout=60, env={"PY": sys.executable, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 2, out
    assert "no CUDA device" in out.stderr
    assert "pytest" not in out.stdout  # nothing else ran


def test_gpu_bench_driver_runs_on_cpu(tmp_path: Path) -> None:
    from benchmarks.gpu_bench import main

    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## comm\n\nkept as it is\n")
    args = ["--device", "cpu", "--sizes", "256", "700", "--dim", "16", "--repeats", "1"]
    args += ["--siglip-sizes", "300", "--siglip-dim", "16"]
    for _ in range(2):  # the second run replaces the first run's section
        main([*args, "--results", str(results)])
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\n## comm\n\nkept as it is\n")
    assert text.count("<!-- gpu-bench:begin -->") == 1 and text.count("<!-- gpu-bench:end -->") == 1
    rows = [line for line in text.splitlines() if line.startswith(("| 256 ", "| 700 "))]
    assert len(rows) == 4, text  # 2 sizes x (bf16, fp32)
    # tile 512 on CPU: 256 rows is one tile, 700 rows 2 x 2
    assert "| 256 | 16 | bf16 | 512 | 1 |" in text and "| 700 | 16 | fp32 | 512 | 4 |" in text
    # SigLIP: the PyTorch tiles timed, the fused ones not on a machine without a GPU
    siglip = [line for line in text.splitlines() if line.startswith("| siglip | 300 | 16 |")]
    assert len(siglip) == 2 and all("not measured (no GPU)" in line for line in siglip), text
