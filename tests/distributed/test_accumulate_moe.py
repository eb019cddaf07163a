"""Whole-batch auxiliary losses (MoE load balancing, router z-loss) against one process.

A tiny MoE language model (tests/support/moe_cases.py) under activation checkpointing,
K = 3 ragged micro-batches per rank (an empty one), float64, two SGD steps: the
`Accumulator` (it finds the model's `LoadBalancingLoss` and `RouterZLoss`) equals one
process computing the token mean plus α·E·Σₑ fₑ·Pₑ and β·mean lse² over the whole
batch, top-1 and top-2, on W = 2 ranks (DDP) and on dp2 x tp2 (FSDP2 on dp, tensor
parallel on the head). The aux loss most frameworks compute (each micro-batch's own,
averaged) and Megatron's global aux loss before its fix (1/dp of the gradient) fail
the same comparison.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.harness import run_ranks
from tests.support.mesh_cases import params_close
from tests.support.moe_cases import MESH, MoECase, reference, run_flat, run_mesh

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

TIMEOUT = 90.0
# float64; the losses are sums of ~100 terms of size <= ~5 and two SGD steps keep
# round-off near 1e-14; the mistakes move parameters by >= 1e-4.
TOL = 1e-10


def _exact(results: list, ref: object, *, stats: bool = True) -> None:
    for r, got in enumerate(results):
        assert params_close(got.params, ref.params, TOL) == [], r  # type: ignore[attr-defined]
        if stats:
            for a, b in zip(got.losses + got.aux, ref.losses + ref.aux, strict=True):  # type: ignore[attr-defined]
                assert abs(a - b) <= TOL * max(1.0, abs(b)), (r, a, b)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_aux_losses_over_the_whole_batch_on_two_ranks(top_k: int) -> None:
    mc = MoECase(top_k=top_k, blocks=top_k)  # top-2: two MoE blocks, four terms
    ref = reference(mc)
    _exact(run_ranks(2, run_flat, mc, timeout=TIMEOUT), ref)
    # The counting pass by hand (the benchmark's baseline) is exact too.
    _exact(
        run_ranks(2, run_flat, dataclasses.replace(mc, engine="hand"), timeout=TIMEOUT),
        ref,
        stats=False,
    )
    if top_k == 1:  # reentrant checkpointing recomputes the terms inside the backward
        _exact(
            run_ranks(2, run_flat, dataclasses.replace(mc, reentrant=True), timeout=TIMEOUT), ref
        )


def test_per_micro_batch_and_one_over_dp_aux_losses_are_not_the_whole_batch() -> None:
    mc = MoECase(top_k=2)
    ref = reference(mc)
    for engine in ("per_micro_batch", "one_over_dp"):
        results = run_ranks(2, run_flat, dataclasses.replace(mc, engine=engine), timeout=TIMEOUT)
        assert params_close(results[0].params, ref.params, TOL), engine


def test_the_aux_losses_over_the_whole_batch_on_a_dp_tp_mesh() -> None:
    mc = MoECase(case=MESH, top_k=2, blocks=2)
    ref = reference(mc)
    _exact(run_ranks(4, run_mesh, mc, timeout=TIMEOUT), ref)
    wrong = run_ranks(4, run_mesh, dataclasses.replace(mc, engine="one_over_dp"), timeout=TIMEOUT)
    assert params_close(wrong[0].params, ref.params, TOL)
