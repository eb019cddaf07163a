"""A plain module on W > 1 ranks: refused by every engine, the same error on every rank (issue 11, point 9).

Nothing reduces a plain module's gradients, so each rank would step on its own
gradient and the replicas drift apart without a word. It happens when
accelerate skips its DDP wrap, or when a user passes `ddp.module`. The
Accumulator, CachedStep and GradCache raise before any forward unless told
`rank_local=True` (each rank training on its own gradient on purpose, or
reducing it itself).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from tests.support.gradcache_cases import Encoder, embed3, info_nce, make_batches
from tests.support.harness import RankError, run_ranks, run_ranks_outcomes
from wholebatch.comm.groups import get_rank
from wholebatch.train.accumulate import Accumulator
from wholebatch.train.cache import CachedStep
from wholebatch.train.gradcache import GradCache


def _lm_loss(model: nn.Module, mb: Tensor) -> tuple[Tensor, int]:
    return model(mb).square().sum(), mb.shape[0]


def _engine_step(engine: str, how: str, rank_local: bool) -> list[float]:
    """One step of `engine` on this rank's own data; the parameters after it."""
    torch.manual_seed(0)
    model = Encoder()
    ddp = DistributedDataParallel(model)
    passed = ddp.module if how == "ddp.module" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scale = torch.tensor(1.0, dtype=torch.float64)
    mbs = make_batches([[2, 1], [3, 2]])[get_rank()]

    def loss_fn(q: Tensor, p: Tensor, n: Tensor) -> Tensor:
        return info_nce(q, p, n, scale)

    if engine == "Accumulator":
        xs = [mb[0] for mb in mbs]
        Accumulator(passed, opt, rank_local=rank_local).step(xs, _lm_loss)
    elif engine == "CachedStep":
        CachedStep(passed, opt, embed3, loss_fn, rank_local=rank_local).step(mbs)
    else:
        GradCache(passed, embed3, rank_local=rank_local)(mbs, loss_fn).backward()
        opt.step()
    out = [float(p.detach().sum()) for p in model.parameters()]
    del ddp
    return out


@pytest.mark.parametrize("how", ["plain", "ddp.module"])
@pytest.mark.parametrize("engine", ["Accumulator", "CachedStep", "GradCache"])
def test_plain_module_on_two_ranks_is_one_error_on_every_rank(engine: str, how: str) -> None:
    outcomes = run_ranks_outcomes(2, _engine_step, engine, how, False, timeout=30)
    assert all(isinstance(o, RankError) for o in outcomes), outcomes
    messages = {o.message for o in outcomes}
    assert len(messages) == 1, messages  # the same text on every rank
    text = messages.pop()
    assert "not wrapped for data parallelism" in text, text
    assert "2 ranks" in text and f"{engine}(..., rank_local=True)" in text, text
    assert "not ddp.module" in text, text


@pytest.mark.parametrize("engine", ["Accumulator", "CachedStep", "GradCache"])
def test_rank_local_opts_in_to_training_each_rank_alone(engine: str) -> None:
    # With the opt-in each rank steps on its own gradient: the replicas differ,
    # which is what the user asked for.
    params = run_ranks(2, _engine_step, engine, "plain", True)
    assert params[0] != params[1]
