"""`wholebatch.testing`: verify as one call inside a user's own pytest suite.

The targets are this module's own functions, passed as objects (the way a user
writes them next to their test), run in fresh processes that import this
module by name. One call checks both: the right step passes, the wrong one
fails with the diagnosis in the assertion message.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wholebatch.testing import WholeBatchMismatch, assert_whole_batch
from wholebatch.train.accumulate import Accumulator
from wholebatch.verify.spec import VerifySpec, target_of

ROWS, D = 10, 3  # 10 rows over 2 x 3 micro-batches: 2, 2, 2, 2, 1, 1 rows


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, 1))
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)


def _batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, D, generator=g, dtype=torch.float64), torch.rand(
        ROWS, generator=g, dtype=torch.float64
    )


def _per_sample(model: nn.Module, mb: tuple[Tensor, Tensor]) -> Tensor:
    return F.binary_cross_entropy_with_logits(model(mb[0]), mb[1], reduction="none")


def _mean(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return _per_sample(model, batch).mean()


def summed_accumulation() -> VerifySpec:
    """Accumulator over per-sample losses: one mean over every sample of the step."""

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list) -> None:  # type: ignore[type-arg]
        Accumulator(model, optimizer, loss_reduction="none").step(mbs, _per_sample)

    return VerifySpec(build_model=Scorer, batch=_batch(), step=step, reference_loss=_mean)


def averaged_per_micro_batch() -> VerifySpec:
    """MISTAKE: each micro-batch's mean / K (micro-batches of 2 and 1 rows weigh the same)."""

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list) -> None:  # type: ignore[type-arg]
        for i, mb in enumerate(mbs):
            with model.no_sync() if i < len(mbs) - 1 else contextlib.nullcontext():
                (_mean(model, mb) / len(mbs)).backward()
        optimizer.step()

    return VerifySpec(build_model=Scorer, batch=_batch(), step=step, reference_loss=_mean)


def test_one_call_passes_the_right_step_and_explains_the_wrong_one() -> None:
    with pytest.raises(WholeBatchMismatch) as info:
        assert_whole_batch(summed_accumulation, averaged_per_micro_batch)
    message = str(info.value)
    assert message.startswith("1 of 2 steps do not give the whole-batch gradient")
    assert f"{__name__}:averaged_per_micro_batch" in message
    assert f"{__name__}:summed_accumulation" not in message  # it passed
    assert "where: breaks" in message and "Likely cause [mean-of-means]" in message
    assert "Fix:" in message
    right, wrong = info.value.reports
    assert right.passed and not wrong.passed


def test_targets_must_be_importable_functions() -> None:
    assert target_of(summed_accumulation) == f"{__name__}:summed_accumulation"
    assert target_of("pkg.mod:fn") == "pkg.mod:fn"

    def local() -> VerifySpec:
        raise AssertionError("never called")

    with pytest.raises(TypeError, match="module-level function"):
        target_of(local)
    with pytest.raises(TypeError, match="module-level function"):
        target_of(lambda: summed_accumulation())
    with pytest.raises(ValueError, match="must be 'module:function'"):
        target_of("no_colon")
    with pytest.raises(TypeError, match="at least one target"):
        assert_whole_batch()
