"""The Accelerate recipe (docs/integrations/huggingface.md): the `Accumulator` on an
accelerate 1.15-prepared model with `gradient_accumulation_steps=1`, on gloo ranks.

Each rank builds a real `Accelerator(cpu=True)` on the harness's gloo group,
prepares a tiny float64 LM and an SGD optimizer (accelerate wraps them in DDP
and `AcceleratedOptimizer`), and takes one step over K ragged micro-batches
(W = 3 with an empty micro-batch, and an uneven split). A pre-step hook on the
inner optimizer copies the gradients the optimizer sees. REFERENCE: the token
mean over the whole batch in one process. Everything is float64: <= 1e-10.

MUTATION: accelerate's documented loop (`with accelerator.accumulate(model):`
around `accelerator.backward(mean loss)`) averages per-micro-batch means and
must fail the same assertion on the same ragged data.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from tests.support.harness import run_ranks
from tests.support.models import (
    TinyLM,
    lm_loss_mean,
    lm_loss_sum,
    make_sequences,
    split_for_ranks,
    whole_batch_loss as reference_loss,
)
from tests.support.peers import SKIP_REASON, accelerate_on_harness_group
from wholebatch.comm import get_rank
from wholebatch.train import Accumulator

pytest.importorskip("accelerate", reason=SKIP_REASON.format("accelerate"))

F64 = 1e-10  # float64 throughout; a few hundred terms: round-off ~1e-15
LENGTHS = [5, 9, 3, 12, 7, 4, 10, 2, 6, 1, 11, 8]  # a length-1 sequence has no target
# sequences per micro-batch, per rank: uneven, and rank 2's second micro-batch holds
# only the length-1 sequence (no items)
SPLIT = [[2, 1, 1], [1, 2, 1], [1, 1, 2]]


def _rank_step(recipe: str) -> dict[str, Tensor]:
    """One optimizer step with accelerate on this rank; the gradients the optimizer saw."""
    from accelerate import Accelerator

    with accelerate_on_harness_group():
        k = len(SPLIT[0])
        accelerator = Accelerator(
            cpu=True, gradient_accumulation_steps=1 if recipe == "ours" else k
        )
        model = TinyLM().double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = accelerator.prepare(model, opt)
        seen: dict[str, Tensor] = {}
        inner = model.module if hasattr(model, "module") else model

        def grab(*_: Any) -> None:
            seen.update({n: p.grad.detach().clone() for n, p in inner.named_parameters()})

        opt.optimizer.register_step_pre_hook(grab)
        micro_batches = split_for_ranks(make_sequences(LENGTHS, seed=1), SPLIT)[get_rank()]
        if recipe == "ours":
            Accumulator(model, opt).step(micro_batches, lm_loss_sum)
        else:  # accelerate's documented gradient accumulation loop
            for mb in micro_batches:
                with accelerator.accumulate(model):
                    accelerator.backward(lm_loss_mean(model, mb))
                    opt.step()
                    opt.zero_grad()
    return seen


def _check(got: list[dict[str, Tensor]]) -> None:
    model = TinyLM().double()
    reference_loss(model, make_sequences(LENGTHS, seed=1)).backward()
    for r, grads in enumerate(got):
        for n, p in model.named_parameters():
            torch.testing.assert_close(
                grads[n], p.grad, rtol=F64, atol=F64, msg=lambda m, r=r, n=n: f"rank {r} {n}: {m}"
            )


def test_accumulator_on_an_accelerate_prepared_model_is_exact() -> None:
    _check(run_ranks(3, _rank_step, "ours", timeout=120))


def test_accelerate_documented_accumulate_loop_fails_the_same_assertion() -> None:
    # The empty micro-batch makes its mean NaN; the ragged ones make it a mean of means.
    got = run_ranks(3, _rank_step, "accumulate", timeout=120)
    with pytest.raises(AssertionError, match=r"rank 0 emb\.weight: Tensor-likes are not close"):
        _check(got)
