"""`wholebatch demo` end to end: a small configuration, and its summary's numbers are real."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e.test_cli import run_cli

for _module in ("sklearn", "matplotlib", "tqdm"):  # the `demo` extra
    pytest.importorskip(_module)


def test_demo_small_run_trains_and_checks_its_gradient(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = run_cli(
        "demo",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--batch-size",
        "128",
        "--out",
        str(out),
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "training.png").stat().st_size > 10_000
    assert str(out / "summary.json") in result.stdout

    losses = [h["loss"] for h in summary["history"]]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    # 3 epochs of 10 steps: far above chance (5/397 = 1.3% for top-5), far below the default run
    after, chance = summary["retrieval_after"], summary["chance"]
    assert after["top5"] > 5 * chance["top5"] and after["top1"] > 5 * chance["top1"]
    assert summary["retrieval_before"]["top5"] < after["top5"]

    check = summary["gradient_check"]
    assert set(check["per_param_rel_err"]) >= {"logit_scale", "left.0.weight", "right.4.bias"}
    assert 0 <= check["max_rel_err"] < 1e-5  # float32 split step vs float64 whole batch
    # one process on the whole batch holds every row's activations and the N x N logits; a rank of
    # the cached step one micro-batch's activations and, at 128 rows (the small path: every rank
    # the loss's formula on the whole batch), the formula's N x N intermediates: 0.74 vs 0.38 MiB
    # (the 1024-row default runs the tiles, which hold no N x N: 0.18 MiB at 128 rows)
    assert check["whole_batch_saved_bytes"] > 1.5 * check["cached_step_saved_bytes"] > 0
    assert "max relative error" in result.stdout and "retrieval after 3 epochs" in result.stdout


def test_demo_gather_still_shows_the_two_gradients() -> None:
    result = run_cli("demo", "--gather", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 processes, torch.distributed.all_gather" in result.stdout
    assert "2 processes, wholebatch.all_gather" in result.stdout
