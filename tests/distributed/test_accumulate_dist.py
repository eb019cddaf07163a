"""The Accumulator on real gloo ranks: one all-reduce per step, FSDP2, agreed failures, compression."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from tests.distributed.test_accumulate import (
    F64,
    Result,
    Run,
    assert_matches,
    ragged_run,
    run_split,
    train_reference,
)
from tests.support.harness import RankError, run_ranks, run_ranks_outcomes
from tests.support.models import TinyLM, lm_loss_sum, make_sequences, split_for_ranks
from wholebatch.train.accumulate import Accumulator
from wholebatch.train.compression import CommStats
from wholebatch.train.stepping import StepStats

# ---------------------------------------------------------------------------
# Communication: exactly one gradient all-reduce per step
# ---------------------------------------------------------------------------


def _grad(p: Tensor) -> Tensor:
    assert p.grad is not None
    return p.grad.detach().clone()


def test_one_allreduce_per_step_with_ddp() -> None:
    # A counting DDP comm hook (one bucket) sees every gradient all-reduce.
    run = ragged_run(2, 4, count_allreduces=True)
    for got in run_split(2, run):
        assert got.allreduces == [1, 1, 1]


def test_compiled_ddp_reduces_once_per_step_and_matches_whole_batch() -> None:
    # torch.compile(ddp) hides DDP behind `_orig_mod`: no_sync must still be found.
    run = dataclasses.replace(ragged_run(2, 4, count_allreduces=True), wrap="ddp_compiled")
    ref = train_reference(run)
    for got in run_split(2, run):
        assert got.allreduces == [1, 1, 1]
        assert_matches(got, ref)


@pytest.mark.parametrize("loop", ["no_no_sync", "forward_outside_no_sync"])
def test_loops_without_proper_no_sync_reduce_k_times(loop: str) -> None:
    # Without no_sync every backward all-reduces; with no_sync around the backward
    # only, DDP (which decides in the forward) still does: K = 4 all-reduces a step.
    run = dataclasses.replace(ragged_run(2, 4, count_allreduces=True), loop=loop)
    for got in run_split(2, run):
        assert got.allreduces == [4, 4, 4]


# ---------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fsdp2_matches_whole_batch(optimizer: str) -> None:
    # fully_shard over 2 gloo ranks: sync off for micro-batches 0..K-2, DTensor grads
    # (compared via full_tensor()); clipping sums the shards' squares over ranks.
    run = ragged_run(2, 3, wrap="fsdp2", optimizer=optimizer, max_grad_norm=0.2)
    ref = train_reference(run)
    for r, got in enumerate(run_split(2, run)):
        assert_matches(got, ref, where=f"rank {r}")
        assert all(isinstance(st, StepStats) and st.clip_coef < 1 for st in got.stats)


# ---------------------------------------------------------------------------
# Rank-local conditions, agreed
# ---------------------------------------------------------------------------


def test_nonfinite_loss_on_one_rank_skips_everywhere() -> None:
    # Rank 1's second micro-batch at step 1 is inf: every rank skips step 1 only.
    run = ragged_run(2, 2, poison=(1, 1, 1))
    ref = train_reference(run)
    results = run_split(2, run)
    for r, got in enumerate(results):
        assert_matches_except_loss(got, ref, skipped_step=1, where=f"rank {r}")
        st = got.stats[1]
        assert isinstance(st, StepStats) and st.skipped
        assert st.skip_reason == "non-finite loss on ranks [1]"
    assert repr(results[0].stats) == repr(results[1].stats)  # repr: grad_norm is NaN (NaN != NaN)


def assert_matches_except_loss(got: Result, ref: Result, *, skipped_step: int, where: str) -> None:
    ref_losses = list(ref.stats)
    ref_losses[skipped_step] = float("inf")
    got_losses = list(got.stats)
    st = got_losses[skipped_step]
    assert isinstance(st, StepStats) and st.loss == float("inf")
    assert_matches(got, dataclasses.replace(ref, stats=ref_losses), where=where)


def test_nonfinite_loss_raise_is_the_same_on_every_rank() -> None:
    run = ragged_run(2, 2, steps=1, poison=(0, 0, 0), on_nonfinite="raise")
    outcomes = run_ranks_outcomes(2, _train_and_report_params, run)
    assert all(isinstance(o, RankError) for o in outcomes), outcomes
    assert {o.type_name for o in outcomes} == {"NonFiniteStepError"}
    assert len({o.message for o in outcomes}) == 1
    assert "non-finite loss on ranks [0]" in outcomes[0].message


def _train_and_report_params(run: Run) -> Result:
    from tests.distributed.test_accumulate import train_split

    return train_split(run)


def _mismatched_k() -> list[StepStats]:
    rank = dist.get_rank()
    model = TinyLM().double()
    acc = Accumulator(
        torch.nn.parallel.DistributedDataParallel(model),
        torch.optim.SGD(model.parameters(), lr=0.1),
    )
    seqs = make_sequences([4, 5, 6, 3, 7, 2])
    sizes = ((1, 2), (1, 1, 1))  # rank 0: K=2, rank 1: K=3
    return [acc.step(split_for_ranks(seqs, sizes)[rank], lm_loss_sum)]


def test_mismatched_micro_batch_counts_raise_on_every_rank() -> None:
    outcomes = run_ranks_outcomes(2, _mismatched_k, timeout=30)
    assert all(isinstance(o, RankError) for o in outcomes), outcomes
    assert len({o.message for o in outcomes}) == 1
    assert "micro_batches differ in number across ranks {0: 2, 1: 3}" in outcomes[0].message


def _zero_items_on_one_rank() -> tuple[StepStats, list[torch.Tensor]]:
    # Rank 1 holds only length-1 sequences (zero targets); rank 0 has real tokens.
    rank = dist.get_rank()
    model = TinyLM().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[torch.Tensor] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.extend(_grad(p) for p in model.parameters()))  # type: ignore[union-attr]
    acc = Accumulator(torch.nn.parallel.DistributedDataParallel(model), opt)
    seqs = make_sequences([5, 7, 1, 1])
    st = acc.step(split_for_ranks(seqs, ((1, 1), (1, 1)))[rank], lm_loss_sum)
    return st, seen


def test_zero_items_on_one_rank() -> None:
    results = run_ranks(2, _zero_items_on_one_rank)
    model = TinyLM().double()
    loss, n = lm_loss_sum(model, split_for_ranks(make_sequences([5, 7]), ((2,),))[0][0])
    torch.autograd.backward(loss / n)
    for st, grads in results:
        assert st.items_per_rank == (10.0, 0.0) and not st.skipped
        torch.testing.assert_close(st.loss, float(loss.detach() / n), **F64)
        for g, p in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, **F64)


# ---------------------------------------------------------------------------
# grad_compression: PyTorch's DDP hooks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "max_rel"),
    [
        # fp16: 11-bit mantissa -> ~5e-4 relative per element; bf16: 8 bits -> ~4e-3.
        ("fp16", 2e-3),
        ("bf16", 2e-2),
    ],
)
def test_half_precision_compression(kind: str, max_rel: float) -> None:
    run = ragged_run(2, 2, dtype=torch.float32, grad_compression=kind)
    exact = run_split(2, dataclasses.replace(run, grad_compression=None))
    for got, ref in zip(run_split(2, run), exact, strict=True):
        comm, _state = got.extra
        assert isinstance(comm, CommStats)
        assert comm.calls == 3  # one bucket, one sync per step
        assert comm.ratio == 2.0  # half the bytes of float32
        for g, rg in zip(got.grads[0] or [], ref.grads[0] or [], strict=True):
            rel = float((g - rg).norm() / rg.norm().clamp(min=1e-12))
            assert 0 < rel < max_rel, (kind, rel)


def test_powersgd_compression() -> None:
    # Rank 1 compression of the 11x6 and 6x6 weights; plain all-reduce on steps 0-1
    # (torch's start_powerSGD_iter=2), compressed from step 2 on.
    lengths = ragged_run(2, 2, steps=4).lengths
    run = dataclasses.replace(
        ragged_run(2, 2, dtype=torch.float32, grad_compression="powersgd"),
        lengths=lengths,
        sizes=(ragged_run(2, 2).sizes[0],) * 4,
    )
    exact = run_split(2, dataclasses.replace(run, grad_compression=None))
    for got, ref in zip(run_split(2, run), exact, strict=True):
        comm, _ = got.extra
        assert comm.calls == 4 and comm.ratio > 1.0
        g0 = got.grads[0] or []
        torch.testing.assert_close(g0, ref.grads[0], rtol=1e-5, atol=1e-6)  # plain phase: exact
        # After the first compressed step the trajectories differ; the gradient is an approximation.
        assert (
            max(float((a - b).abs().max()) for a, b in zip(got.params, ref.params, strict=True))
            > 1e-4
        )


def _compression_bytes(kind: str) -> dict[str, Any]:
    model = TinyLM()
    acc = Accumulator(
        torch.nn.parallel.DistributedDataParallel(model),
        torch.optim.SGD(model.parameters(), lr=0.1),
        grad_compression=kind,
    )
    assert acc.comm_stats is not None
    return dataclasses.asdict(acc.comm_stats)


def test_compression_registers_once_and_counts_nothing_before_a_step() -> None:
    for out in run_ranks(2, _compression_bytes, "bf16"):
        assert out == {"calls": 0, "wire_bytes": 0, "uncompressed_bytes": 0}
