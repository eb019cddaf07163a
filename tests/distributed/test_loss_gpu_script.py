"""`benchmarks/gpu.sh` on a machine like the one that is lent: its python3, no .venv, no network.

The lent GPU machine has a `python3` holding torch, no `.venv`, no network. Here
the script runs its CPU-checkable part (`--cpu-check`: the same steps, tiny sizes,
gloo) in a copy of the repository without `.venv`, with a PATH that holds only
`python3` (this interpreter, as the lent machine's) and the shell tools the script
needs, and `pip`, `pip3`, `uv`, `conda`, `curl` and `wget` stand-ins that record
any call and fail. What must hold:

- the interpreter is found on PATH (no `PY=`), `src/` is put on the path (no
  editable install), nothing is installed or fetched (no stand-in was called, no
  `.venv` appears), and the run ends 0 with every step passed;
- the table and the logs land in the folder given on the command line;
- an optional package that is missing (inf-cl, hidden here) is reported as "not
  measured" in the summary and in the table, and the run still passes;
- without CUDA and without `--cpu-check` the script stops at once (exit 2) and says why.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("bash", "env", "date", "mkdir", "timeout", "dirname", "cat", "sh", "uname", "ldconfig")
STANDINS = ("pip", "pip3", "uv", "conda", "curl", "wget")


def _machine(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the repository without .venv and a PATH like the lent machine's."""
    repo = tmp / "repo"
    shutil.copytree(ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(
        ROOT / "benchmarks", repo / "benchmarks", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(ROOT / "tests", repo / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "Makefile"):
        shutil.copy(ROOT / name, repo / name)
    bin_ = tmp / "bin"
    bin_.mkdir()
    python3 = bin_ / "python3"  # a python3 that holds torch, as the lent machine's does
    python3.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python3.chmod(0o755)
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            (bin_ / tool).symlink_to(found)
    calls = tmp / "calls.log"
    for name in STANDINS:
        standin = bin_ / name
        standin.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit 1\n')
        standin.chmod(0o755)
    env = {"PATH": str(bin_), "HOME": str(tmp), "OMP_NUM_THREADS": "1", "GPU_HIDE": "inf_cl"}
    return repo, env


def test_the_gpu_check_runs_as_the_lent_machine_would(tmp_path: Path) -> None:
    repo, env = _machine(tmp_path)
    out = tmp_path / "results"
    done = subprocess.run(
        ["bash", str(repo / "benchmarks" / "gpu.sh"), str(out), "--cpu-check"],
        capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path,
    )  # fmt: skip
    summary = (out / "summary.md").read_text()
    assert done.returncode == 0, done.stdout + done.stderr + summary
    assert f"- interpreter: python3 ({sys.version.split()[0]})" in summary, summary
    for name in ("1-cuda-tests", "2-selftest", "3-gpu-bench"):
        assert f"| {name} | passed |" in summary, summary
        assert (out / f"{name}.log").exists()
    assert not (tmp_path / "calls.log").exists(), (tmp_path / "calls.log").read_text()
    assert not (repo / ".venv").exists()
    table = (out / "RESULTS.md").read_text()
    assert "<!-- gpu-bench:begin -->" in table and "| siglip | 300 | 16 |" in table
    assert "| 300 | - |" in table and "not measured (inf-cl not installed)" in table, table
    selftest = (out / "2-selftest.log").read_text()
    assert "maxsim_loss (ring)" in selftest and "PASS" in selftest


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_it_stops_at_once(tmp_path: Path) -> None:
    repo, env = _machine(tmp_path)
    done = subprocess.run(
        ["bash", str(repo / "benchmarks" / "gpu.sh"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert "no CUDA device" in done.stderr and "--cpu-check" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written
