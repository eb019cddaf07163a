"""AMP with the Accumulator: GradScaler unscale-once, clipping order, agreed overflow, bf16 autocast."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.distributed.test_accumulate import (
    assert_matches,
    ragged_run,
    run_split,
    train_reference,
    uneven_sizes,
)
from tests.support.harness import run_ranks
from tests.support.models import MicroBatch, TinyLM, lm_loss_sum, make_sequences, split_for_ranks
from wholebatch.train.accumulate import Accumulator
from wholebatch.train.stepping import StepStats


def _grad(p: Tensor) -> Tensor:
    assert p.grad is not None
    return p.grad.detach().clone()


def test_grad_scaler_unscales_once_then_clips() -> None:
    # float64 model, scale 2**10 (a power of two: scaling and unscaling are exact), so
    # the result must equal the unscaled reference to round-off; clipping acts every step.
    run = ragged_run(2, 2, init_scale=2.0**10, max_grad_norm=0.2)
    ref = train_reference(run)
    for got in run_split(2, run):
        assert_matches(got, ref)
        for st in got.stats:
            assert isinstance(st, StepStats) and st.loss_scale is not None
            assert 0.3 < st.grad_norm < 0.5, st.grad_norm  # the true norm, not 2**10 times it


def _clip_before_unscale(run: Any) -> list[Tensor]:
    """The classic AMP mistake, one process: clip the still-scaled gradient, then step."""
    model = TinyLM().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    seen: list[Tensor] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.extend(_grad(p) for p in model.parameters()))  # type: ignore[union-attr]
    mbs = split_for_ranks(make_sequences(run.lengths[0], seed=0), (tuple(run.sizes[0][0]),))[0]
    n = sum(int(lm_loss_sum(model, mb)[1]) for mb in mbs)
    for mb in mbs:
        torch.autograd.backward(scaler.scale(lm_loss_sum(model, mb)[0] / n))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)  # wrong: before unscale_
    scaler.step(opt)
    scaler.update()
    return seen


def test_clipping_before_unscale_is_caught() -> None:
    # The same assertion the Accumulator passes rejects the wrong order: the scaled
    # norm is 2**10 times too large, so the clipped-then-unscaled gradient is ~2**10 too small.
    run = ragged_run(1, 3, steps=1, wrap="plain", init_scale=2.0**10, max_grad_norm=0.2)
    ref = train_reference(run)
    wrong = _clip_before_unscale(run)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong, ref.grads[0], rtol=1e-10, atol=1e-10)
    for got in run_split(1, run):
        assert_matches(got, ref)


def _overflow_on_one_rank() -> tuple[list[StepStats], list[float], list[Tensor], list[Tensor]]:
    # A plain (unsynchronised) float32 module: only rank 1's gradient overflows, so
    # without agreement rank 0 would step and rank 1 skip (diverged replicas).
    rank = dist.get_rank()
    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=1)
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler, rank_local=True
    )
    mbs = split_for_ranks(make_sequences([5, 6, 7, 4]), ((1, 1), (1, 1)))[rank]

    def huge_on_rank1(m: nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        loss, n = lm_loss_sum(m, mb)  # float64 loss: stays finite; float32 gradient: inf
        return loss * (1e33 if rank == 1 else 1.0), n

    stats = [acc.step(mbs, huge_on_rank1)]
    scales = [scaler.get_scale()]
    after_skip = [p.detach().clone() for p in model.parameters()]
    stats.append(acc.step(mbs, lm_loss_sum))
    scales.append(scaler.get_scale())
    torch.testing.assert_close(after_skip, before, rtol=0, atol=0)
    return stats, scales, after_skip, [p.detach().clone() for p in model.parameters()]


def test_amp_overflow_on_one_rank_is_skipped_on_every_rank() -> None:
    results = run_ranks(2, _overflow_on_one_rank)
    for stats, scales, _, _ in results:
        assert stats[0].skipped and not stats[1].skipped
        assert stats[0].skip_reason == (
            "non-finite gradient on ranks [1] (AMP overflow; loss scale backed off)"
        )
        # Backed off on both ranks (2**20 -> 2**19), then grown (growth_interval=1).
        assert scales == [2.0**19, 2.0**20]
        assert stats[1].step == 1
    # Identical on both ranks except grad_norm: a plain module's gradient is not
    # reduced, so its norm is each rank's own (documented in StepStats.grad_norm).
    same = [[dataclasses.replace(st, grad_norm=0.0) for st in r[0]] for r in results]
    assert same[0] == same[1]


def _autocast_loss(model: nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return lm_loss_sum(model, mb)


def _train_autocast(world_sizes: Any, lengths: tuple[int, ...]) -> list[Tensor]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = TinyLM()  # float32 parameters, bf16 compute inside autocast
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[Tensor] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.extend(_grad(p) for p in model.parameters()))  # type: ignore[union-attr]
    net: nn.Module = (
        torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    )
    acc = Accumulator(net, opt)
    acc.step(split_for_ranks(make_sequences(lengths), world_sizes)[rank], _autocast_loss)
    del acc, net
    return seen


def test_bf16_autocast_matches_whole_batch_to_bf16_precision() -> None:
    run = ragged_run(2, 2, steps=1)
    sizes, lengths = uneven_sizes(2, 2), run.lengths[0]
    whole = _train_autocast(((sum(map(sum, sizes)),),), lengths)  # one process, one micro-batch
    for grads in run_ranks(2, _train_autocast, sizes, lengths):
        for g, rg in zip(grads, whole, strict=True):
            # bf16 keeps 8 mantissa bits (relative step 2**-8 ~ 4e-3 per rounding); the split
            # run rounds different partial sums, so allow a few roundings: 2e-2 of the norm.
            assert float((g - rg).norm()) <= 2e-2 * float(rg.norm()), (g, rg)


def test_disabled_scaler_counts_as_none() -> None:
    run = dataclasses.replace(ragged_run(1, 2, wrap="plain"), init_scale=None)
    model = TinyLM().double()
    acc = Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
    )
    assert acc.scaler is None
    st = acc.step(split_for_ranks(make_sequences(run.lengths[0]), run.sizes[0])[0], lm_loss_sum)
    assert st.loss_scale is None and not st.skipped
