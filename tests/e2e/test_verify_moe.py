"""`wholebatch verify` names the whole-batch auxiliary-loss mistakes of an MoE step, with their factor.

The targets (tests/support/verify_moe_targets.py) train a tiny float64 MoE language
model (two blocks of 4 experts, top-2, each with a load-balancing and a router
z-loss) on a ragged batch, against the whole batch's objective. Before the spec's
`aux_loss`, verify failed both usual mistakes with where they break only
("breaks-each-way", "breaks-across-ranks"); now the fit reads the aux term's weights:

- each micro-batch's own aux loss, averaged: `aux-per-micro-batch`, "the mean of the
  micro-batches' aux losses"; without the 1/K: "3 x" that mean, K named;
- the whole batch's statistics, the gradient 1/W (Megatron-LM before #3769):
  `aux-scaled`, 1/W named, at W = 2 (and W = 4 in the heavy tier);
- both again on a dp2 x tp2 mesh (FSDP2 on dp, the head tensor parallel), 1/dp named;
- the main term's mean of means beside exact aux terms: `mean-of-means` alone, its
  weights read through the aux columns;
- mutation: the same per-micro-batch mistake with the spec not naming `aux_loss`
  keeps the generic verdict, whose note says to give it (the named cause comes
  from the aux fit, not from the target's name or its where).

The default tier runs one call (a right step, the two usual mistakes, the mutation); the
heavy tier the rest (K named, the main term's mistake, the mesh, W = 4).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.test_cli import run_cli

MOE = "tests/support/verify_moe_targets.py"

# The default tier: one call over the two usual mistakes, a right step and the mutation.
EXPECTED: dict[str, list[str] | None] = {
    f"{MOE}:moe_exact": None,
    f"{MOE}:moe_per_micro_batch": ["aux-per-micro-batch"],
    f"{MOE}:moe_one_over_dp": ["aux-scaled"],
    f"{MOE}:moe_per_micro_batch_unnamed": ["breaks-each-way"],
}
# The heavy tier (the suite's 15-minute budget): the other factors, the main term's
# mistake, and the mesh.
MORE: dict[str, list[str] | None] = {
    f"{MOE}:moe_hand_exact": None,
    f"{MOE}:moe_per_micro_batch_summed": ["aux-per-micro-batch"],
    f"{MOE}:moe_main_mean_of_means": ["mean-of-means"],
    f"{MOE}:moe_mesh_exact": None,
    f"{MOE}:moe_mesh_per_micro_batch": ["aux-per-micro-batch"],
    f"{MOE}:moe_mesh_one_over_dp": ["aux-scaled"],
}


def _verify(targets: list[str], nproc: int) -> dict[str, dict[str, Any]]:
    result = run_cli(
        "verify", *targets, "--nproc", str(nproc), "--micro-batches", "3", "--json", timeout=900
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    return {r["target"]: r for r in json.loads(result.stdout)["results"]}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    return _verify(list(EXPECTED), 2)


@pytest.fixture(scope="module")
def more() -> dict[str, dict[str, Any]]:
    return _verify(list(MORE), 2)


def _codes(report: dict[str, Any]) -> list[str]:
    return [d["code"] for d in report["diagnoses"]]


def _message(report: dict[str, Any]) -> str:
    return " ".join(d["message"] for d in report["diagnoses"])


def _verdict(report: dict[str, Any], codes: list[str] | None, target: str) -> None:
    if codes is None:
        assert report["passed"], (target, report["diagnoses"])
    else:
        assert not report["passed"] and _codes(report) == codes, (target, report["diagnoses"])


@pytest.mark.parametrize("target", list(EXPECTED))
def test_each_target_gets_its_verdict(reports: dict[str, dict[str, Any]], target: str) -> None:
    _verdict(reports[target], EXPECTED[target], target)


@pytest.mark.heavy
@pytest.mark.parametrize("target", list(MORE))
def test_each_other_target_gets_its_verdict(more: dict[str, dict[str, Any]], target: str) -> None:
    _verdict(more[target], MORE[target], target)


def test_per_micro_batch_aux_is_read_with_its_factor(reports: dict[str, dict[str, Any]]) -> None:
    mean = reports[f"{MOE}:moe_per_micro_batch"]
    aux = mean["fit"]["aux"]
    # J = W x K = 6 micro-batches, each its own aux loss at 1/6; none of the whole batch's.
    assert aux["split_parts"] == pytest.approx([1 / 6] * 6, rel=1e-9)
    assert aux["split_whole"] == pytest.approx(0.0, abs=1e-9)
    assert aux["reference_whole"] == pytest.approx(1.0, rel=1e-9)
    assert aux["reference_parts"] == pytest.approx([0.0] * 6, abs=1e-9)
    assert "the step is the mean of the micro-batches' aux losses" in _message(mean)
    # The main term's weights are right (each micro-batch's share of the tokens).
    fit = mean["fit"]
    assert fit["split_weights"] == pytest.approx(fit["reference_weights"], rel=1e-9)


@pytest.mark.heavy
def test_per_micro_batch_aux_without_one_over_k_names_k(more: dict[str, dict[str, Any]]) -> None:
    summed = more[f"{MOE}:moe_per_micro_batch_summed"]
    assert summed["fit"]["aux"]["split_parts"] == pytest.approx([0.5] * 6, rel=1e-9)
    assert "3 x the mean of the micro-batches' aux losses" in _message(summed)
    assert "3 = K = 3" in _message(summed)


def test_uncompensated_dp_mean_is_named_one_over_w(reports: dict[str, dict[str, Any]]) -> None:
    report = reports[f"{MOE}:moe_one_over_dp"]
    assert report["fit"]["aux"]["split_whole"] == pytest.approx(0.5, rel=1e-9)
    assert "0.5 = 1/2, one over the 2 data-parallel ranks" in _message(report)


@pytest.mark.heavy
def test_on_a_mesh_the_data_parallel_ranks_are_counted(more: dict[str, dict[str, Any]]) -> None:
    # dp2 x tp2 (FSDP2 on dp, the head tensor parallel): J = dp x K = 6, 1/dp = 1/2.
    per = more[f"{MOE}:moe_mesh_per_micro_batch"]["fit"]["aux"]
    assert per["split_parts"] == pytest.approx([1 / 6] * 6, rel=1e-9)
    report = more[f"{MOE}:moe_mesh_one_over_dp"]
    assert report["fit"]["aux"]["split_whole"] == pytest.approx(0.5, rel=1e-9)
    assert "0.5 = 1/2, one over the 2 data-parallel ranks" in _message(report)


@pytest.mark.heavy
def test_main_term_mistake_is_read_beside_the_aux_terms(more: dict[str, dict[str, Any]]) -> None:
    report = more[f"{MOE}:moe_main_mean_of_means"]
    fit = report["fit"]
    assert fit["split_weights"] == pytest.approx([1 / 6] * 6, rel=1e-9)
    assert fit["aux"]["split_whole"] == pytest.approx(1.0, rel=1e-9)  # the aux terms exact
    assert "aux" not in " ".join(_codes(report))


def test_without_aux_loss_the_cause_is_not_named(reports: dict[str, dict[str, Any]]) -> None:
    report = reports[f"{MOE}:moe_per_micro_batch_unnamed"]
    assert report["fit"]["aux"] is None
    assert "give the spec that term as aux_loss" in _message(report)


@pytest.mark.heavy
def test_four_ranks_name_one_over_four() -> None:
    report = _verify([f"{MOE}:moe_one_over_dp"], 4)[f"{MOE}:moe_one_over_dp"]
    assert _codes(report) == ["aux-scaled"]
    assert report["fit"]["aux"]["split_whole"] == pytest.approx(0.25, rel=1e-9)
    assert "0.25 = 1/4, one over the 4 data-parallel ranks" in _message(report)
