"""Injected faults under torchrun: nothing hangs, errors name the rank, resume is bitwise exact.

Each test launches `tests/support/fault_scripts/train.py` on 2 local ranks with
torchrun (`python -m torch.distributed.run --standalone`), a 10 s process-group
timeout, and a hard wall-clock limit on the whole launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from wholebatch import checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "fault_scripts" / "train.py"
PG_TIMEOUT = 10


def _torchrun(
    out: Path, *args: str, restarts: int = 0, debug: bool = False, limit: float = 90
) -> tuple[int, str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WHOLEBATCH_DEBUG="1" if debug else "0")
    # The script initialises with wholebatch.init_process_group: with plain
    # init_process_group a torch 2.13 gloo restart reads the previous attempt's
    # peer addresses and fails (docs/reliability.md).
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", str(restarts), "--monitor-interval", "0.2",
        str(SCRIPT), "--out", str(out), "--timeout", str(PG_TIMEOUT), *args,
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _final(out: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(out / "final.pt", weights_only=True)
    return state


def _no_strays(out: Path) -> None:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out) not in ps, "a rank outlived its launcher"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("clean")
    code, log, _ = _torchrun(out, "--mode", "clean")
    assert code == 0, log
    return _final(out)


def test_crash_restart_resume_is_bitwise_exact(
    tmp_path: Path, clean_run: dict[str, torch.Tensor]
) -> None:
    code, log, _ = _torchrun(tmp_path, "--mode", "crash", "--fault-step", "4", restarts=1)
    assert code == 0, log
    resumed = _final(tmp_path)
    for name, value in clean_run.items():
        assert torch.equal(resumed[name], value), f"{name} differs after resume"


@pytest.mark.parametrize("forget", ["rng", "data"])
def test_resume_that_forgets_state_is_caught(
    tmp_path: Path, clean_run: dict[str, torch.Tensor], forget: str
) -> None:
    # Mutation: the same crash and resume, dropping the RNG or the data position.
    code, log, _ = _torchrun(
        tmp_path, "--mode", "crash", "--fault-step", "4", "--forget", forget, restarts=1
    )
    assert code == 0, log
    resumed = _final(tmp_path)
    assert any(not torch.equal(resumed[k], v) for k, v in clean_run.items())


def test_a_crashing_rank_is_reported_and_the_last_checkpoint_survives(tmp_path: Path) -> None:
    code, log, elapsed = _torchrun(tmp_path, "--mode", "crash", "--fault-step", "4")
    assert code != 0
    assert "exitcode  : 13" in log and "rank      : 1" in log, log[-3000:]
    assert elapsed < PG_TIMEOUT + 30
    _no_strays(tmp_path)
    folder = tmp_path / "step-00000004"
    assert (folder / "COMPLETE").exists()
    for rank in (0, 1):
        assert checkpoint._read(folder / f"rank-{rank}.pt", rank, 2)["step"] == 4


def test_a_skipped_collective_ends_every_rank(tmp_path: Path) -> None:
    code, log, elapsed = _torchrun(tmp_path, "--mode", "skip-collective", "--fault-step", "1")
    assert code != 0, log
    assert elapsed < PG_TIMEOUT + 30
    _no_strays(tmp_path)


def test_debug_mode_names_the_rank_that_skipped(tmp_path: Path) -> None:
    code, log, elapsed = _torchrun(
        tmp_path, "--mode", "skip-collective", "--fault-step", "1", debug=True
    )
    assert code != 0
    assert "all_gather #1 at train.py:" in log and "rank(s) [1] did not arrive within 5 s" in log, (
        log[-3000:]
    )
    assert elapsed < PG_TIMEOUT + 30
    _no_strays(tmp_path)


def test_debug_mode_names_a_skipped_backward(tmp_path: Path) -> None:
    code, log, _ = _torchrun(tmp_path, "--mode", "skip-backward", "--fault-step", "1", debug=True)
    assert code != 0
    assert "all_gather backward #2" in log and "rank(s) [1] did not arrive" in log, log[-3000:]
    _no_strays(tmp_path)


def test_nan_on_one_rank_skips_the_step_everywhere(tmp_path: Path) -> None:
    code, log, _ = _torchrun(tmp_path, "--mode", "nan", "--fault-step", "4", "--steps", "5")
    assert code == 0, log
    assert "step 5 loss nan skipped True" in log
    assert "step 4 loss" in log and "step 4 loss nan" not in log
    before = checkpoint._read(tmp_path / "step-00000004" / "rank-1.pt", 1, 2)["model"]
    after = checkpoint._read(tmp_path / "step-00000005" / "rank-1.pt", 1, 2)["model"]
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed on a skipped step"


def test_one_fewer_micro_batch_is_the_same_error_everywhere(tmp_path: Path) -> None:
    code, log, elapsed = _torchrun(tmp_path, "--mode", "fewer-micro-batches", "--fault-step", "2")
    assert code != 0
    assert elapsed < PG_TIMEOUT + 30
    errors = [
        line for line in log.splitlines() if "WholebatchError" in line and "micro-batch" in line
    ]
    assert errors, log[-3000:]
    _no_strays(tmp_path)
