"""`wholebatch verify` on trl 1.16's `GRPOTrainer`, every `loss_type`: a `ReplaySpec` (issue 32, point 4).

One command (W = 2 x GA 3, --json) runs tests/support/trl_grpo_verify.py's spec for
each loss type: a real `trainer.train()` of one step (tiny float64 Llama, CPU
generation, a toy reward), every micro-batch its loss read recorded, the
reference on that recorded whole batch with the normalisation the loss type
means. Before this change no such step could be specified at all. Measured
independently (tests/support/verify_corpus_check.py): bnpo is 13% off (a mean of
per-micro-batch token means), dapo with steps_per_generation = 2 x GA 1.6% (the
generation batch's count rescaled), every other type exact to float32's
round-off (Llama's norms and rotary run in float32).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.test_cli import run_cli
from tests.support.peers import SKIP_REASON, peer_root

pytestmark = [
    pytest.mark.skipif(peer_root("trl") is None, reason=SKIP_REASON.format("trl")),
    # one CLI call for the module: ~110 s at load 5 (trl's import, 9 trainers, 2 failing
    # targets' re-runs); the default 300 s is too short on a loaded 2-core machine
    pytest.mark.timeout(900),
]

SPECS = "tests/support/trl_grpo_verify.py"
EXPECTED: dict[str, list[str] | None] = {
    "grpo": None, "sapo": None, "bnpo": ["mean-of-means"], "dr_grpo": None, "dapo": None,
    "cispo": None, "vespo": None, "luspo": None, "dapo_spg2": ["wrong-count"],
}  # fmt: skip


# The default tier runs the plain loss type and the two wrong ones (one CLI call); the other
# six, exact like grpo, run in the heavy tier (`make test-heavy`, tests/conftest.py).
DEFAULT = ("grpo", "bnpo", "dapo_spg2")


def _run(names: list[str], wrong: bool) -> dict[str, dict[str, Any]]:
    targets = [f"{SPECS}:{name}" for name in names]
    result = run_cli(
        "verify", *targets, "--nproc", "2", "--micro-batches", "3", "--json", timeout=900
    )
    assert result.returncode == int(wrong), result.stdout[-3000:] + result.stderr[-3000:]
    return {r["target"].rpartition(":")[2]: r for r in json.loads(result.stdout)["results"]}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    return _run(list(DEFAULT), wrong=True)


@pytest.fixture(scope="module")
def other_reports() -> dict[str, dict[str, Any]]:
    return _run([name for name in EXPECTED if name not in DEFAULT], wrong=False)


@pytest.mark.parametrize(
    "loss_type",
    [name if name in DEFAULT else pytest.param(name, marks=pytest.mark.heavy) for name in EXPECTED],
)
def test_every_loss_type_is_verifiable(request: pytest.FixtureRequest, loss_type: str) -> None:
    fixture = "reports" if loss_type in DEFAULT else "other_reports"
    report, codes = request.getfixturevalue(fixture)[loss_type], EXPECTED[loss_type]
    assert report["wrap"] == "replay" and report["evidence"]["step_calls"] == [1, 1]
    assert report["rows"] == 12  # W x GA x 2 completions, recorded
    if codes is None:
        assert report["passed"], (loss_type, report["diagnoses"], report["error"])
        assert report["variants"][0]["max_rel_err"] < 1e-5  # float32's round-off
    else:
        assert not report["passed"] and [d["code"] for d in report["diagnoses"]] == codes


def test_bnpo_weighs_each_micro_batch_alike(reports: dict[str, dict[str, Any]]) -> None:
    report = reports["bnpo"]
    fit = report["fit"]
    # the recorded micro-batches are the fit's parts: 3 per rank, the rows known exactly
    assert fit["ranks"] == [0, 0, 0, 1, 1, 1] and fit["split_residual"] < 1e-5
    assert all(abs(a - 1 / 6) < 1e-4 for a in fit["split_weights"])
    assert fit["normalization"]["found"] == ["token", "micro_batch"]
    assert fit["normalization"]["expected"] == ["token", "step"]


def test_dapo_with_two_windows_per_generation_divides_by_a_rescaled_count(
    reports: dict[str, dict[str, Any]],
) -> None:
    report = reports["dapo_spg2"]
    ratios = [p["ratio"] for p in report["variants"][0]["parameters"] if not p["passed"]]
    assert ratios and max(ratios) - min(ratios) < 1e-4 and abs(ratios[0] - 1) > 1e-3
    assert "labels[..., 1:]" not in report["diagnoses"][0]["message"]  # not a causal-LM count
