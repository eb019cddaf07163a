"""A DeepSpeed engine's step over K micro-batches with the whole-batch gradient: `DeepSpeedAccumulator`.

Change two lines of a DeepSpeed loop (docs/integrations/deepspeed.md):

    acc = DeepSpeedAccumulator(engine)                         # 1: once, after deepspeed.initialize
    for micro_batches in loader:                               # this rank's K micro-batches
        stats = acc.step(micro_batches, loss_fn, count_fn)     # 2: replaces K x (forward, backward, step)
    # loss_fn(engine, mb) -> sum of the micro-batch's item losses (a scalar Tensor)
    # count_fn(mb)        -> how many items that sum holds (e.g. (mb["labels"][:, 1:] != -100).sum())

What a plain DeepSpeed 0.19 loop does: `engine.backward(loss)` divides every
micro-batch's loss by `gradient_accumulation_steps` and ZeRO averages over the
W data-parallel ranks, so a token mean per micro-batch becomes a mean of K·W
means (micro-batches holding fewer tokens weigh as much as full ones;
accelerate #3877, DeepSpeed #1488). Accumulating by hand without DeepSpeed's
boundary flag under ZeRO-2 keeps only the last micro-batch's gradient
(open-instruct PR #1498).

What `step` does instead (the DESIGN's counting pass: index tensors only, no forward):

1. `count_fn` on every micro-batch, then ONE small all-gather of every rank's
   [items, K]: N, the step's global item count, agreed before any backward
   (and K, which must be the same on every rank: ZeRO reduces on the boundary).
   It runs while micro-batch 0's forward does (asynchronous), so the step does not
   start by waiting for the slowest rank;
2. each micro-batch: `engine.set_gradient_accumulation_boundary(last)`,
   `loss_fn`, `engine.backward(loss_sum · W / N, scale_wrt_gas=False)`: no
   division by the accumulation steps, W for ZeRO's mean over ranks;
3. ONE `engine.step()` after the last (DeepSpeed's clipping, loss scaling and
   optimizer as configured), while the reported loss's all-reduce (one float64)
   runs. The engine's boundary flag stays set by `step`: drive every step of the
   engine through it.

After it, every rank's parameters have taken one step on d(sum of item losses / N)/dθ.
This needs nothing of DeepSpeed's internals: only its public engine methods.
Tested on CPU (DS_ACCELERATOR=cpu, gloo) with ZeRO stages 1 and 2 (stage 0 was too, by hand).

Legend: W data-parallel ranks, K micro-batches per step, N items in the step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm import PendingRows, comm_device, get_world_size, is_distributed, start_rows
from wholebatch.errors import WholebatchError, WholebatchTypeError

__all__ = ["DeepSpeedAccumulator", "DeepSpeedStepStats"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSpeedStepStats:
    """What one `DeepSpeedAccumulator.step` did; identical on every rank."""

    loss: float
    """Whole-batch mean loss: (sum of item losses over micro-batches and ranks) / `items`."""

    items: float
    """N: the step's items over all ranks, as `count_fn` counted them."""

    items_per_rank: tuple[float, ...]
    """Each rank's items for the step, in rank order."""

    micro_batches: int
    """K, the same on every rank."""


def _count(op: str, value: object, index: int) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise WholebatchTypeError(
                f"{op}: count_fn(micro_batches[{index}]) returned a tensor of shape "
                f"{tuple(value.shape)}; it must return one number (the items the loss sums)"
            )
        return float(value.detach().reshape(()).cpu())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WholebatchTypeError(
            f"{op}: count_fn(micro_batches[{index}]) returned {type(value).__name__}; it must "
            "return an int, float or one-element Tensor"
        )
    return float(value)


class DeepSpeedAccumulator:
    """K micro-batches of a DeepSpeed engine, one step, the whole batch's gradient.

    Gradient contract: every rank of `group` calls `step` with its own K
    micro-batches (the same K everywhere); the engine's optimizer then steps on
    d(Σ item losses over all K·W micro-batches / N)/dθ, N = Σ count_fn. The
    engine's ZeRO stage 0, 1 or 2 averages over the W data-parallel ranks
    (what the W in the backward scale compensates); stage 3 and pipeline
    engines are not tested and refused.

    Args:
        engine: what `deepspeed.initialize` returned first (a `DeepSpeedEngine`).
        group: the data-parallel process group; None: the world. Its size must be
            the engine's `dp_world_size`.
    """

    def __init__(self, engine: Any, *, group: ProcessGroup | None = None) -> None:
        op = "DeepSpeedAccumulator"
        for name in ("backward", "step", "set_gradient_accumulation_boundary"):
            if not callable(getattr(engine, name, None)):
                raise WholebatchTypeError(
                    f"{op}: engine has no {name}(); pass the engine deepspeed.initialize "
                    f"returned (got {type(engine).__name__})"
                )
        stage = int(getattr(engine, "zero_optimization_stage", lambda: 0)())
        if stage > 2 or type(engine).__name__ == "PipelineEngine":
            raise WholebatchError(
                f"{op}: ZeRO stage {stage} / {type(engine).__name__} is not supported; stages "
                "0, 1 and 2 of a DeepSpeedEngine are"
            )
        w = get_world_size(group) if is_distributed(group) else 1
        dp = int(getattr(engine, "dp_world_size", w))
        if dp != w:
            raise WholebatchError(
                f"{op}: the engine averages over {dp} data-parallel ranks but the group has {w}; "
                "pass the engine's data-parallel group as group="
            )
        self.engine = engine
        self.group = group
        self.world_size = w
        self.steps = 0

    def step(
        self,
        micro_batches: Iterable[Any],
        loss_fn: Callable[[Any, Any], Tensor],
        count_fn: Callable[[Any], int | float | Tensor],
    ) -> DeepSpeedStepStats:
        """Count, then forward and backward every micro-batch, then one `engine.step()`.

        Args:
            micro_batches: this rank's K micro-batches (materialised into a list).
            loss_fn: `loss_fn(engine, micro_batch)` -> the SUM of its item losses.
            count_fn: `count_fn(micro_batch)` -> the number of items that sum holds,
                read from the data (labels, masks) before any forward.

        Returns:
            `DeepSpeedStepStats`, the same on every rank.

        Raises:
            WholebatchError: on every rank, when K differs across ranks or is 0, or
                the step holds no items on any rank.
        """
        op = "DeepSpeedAccumulator.step"
        mbs = list(micro_batches)
        k = len(mbs)
        counts = [_count(op, count_fn(mb), i) for i, mb in enumerate(mbs)]
        # The count's all-gather runs while micro-batch 0's forward does (its backward
        # needs N, its forward does not): the step's start is not a wait for the slowest rank.
        pending = start_rows({"items": sum(counts), "k": k}, group=self.group)
        engine = self.engine
        loss_sum = torch.zeros((), dtype=torch.float64)
        factor, n = math.nan, 0.0
        per_rank: tuple[float, ...] = ()
        for i, mb in enumerate(mbs):
            engine.set_gradient_accumulation_boundary(i == k - 1)  # before its forward
            loss = loss_fn(engine, mb)
            if i == 0:
                per_rank, n = self._agree(op, pending)
                factor = self.world_size / n
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise WholebatchTypeError(
                    f"{op}: loss_fn(engine, micro_batches[{i}]) must return the sum of its "
                    f"item losses as a one-element Tensor, got {type(loss).__name__}"
                )
            engine.backward(loss.reshape(()) * factor, scale_wrt_gas=False)
            loss_sum += loss.detach().to(torch.float64).cpu()
        if k == 0:  # every rank raises the same error, agreed
            self._agree(op, pending)
        reported, work = self._start_sum(loss_sum)  # overlaps engine.step()
        engine.step()  # the boundary: ZeRO's reduction (stage 1), clipping, the optimizer
        self.steps += 1
        if work is not None:
            work.wait()
        total = float(reported)
        return DeepSpeedStepStats(
            loss=total / n if n > 0 else math.nan,
            items=n,
            items_per_rank=per_rank,
            micro_batches=k,
        )

    def _agree(self, op: str, pending: PendingRows) -> tuple[tuple[float, ...], float]:
        """Every rank's items and K from the count's agreement; the same error on every rank."""
        rows = pending.wait()
        ks = rows.per_rank("k")
        if not rows.same("k") or ks[0] == 0:
            raise WholebatchError(
                f"{op}: micro_batches per rank { {r: int(v) for r, v in ks.items()} }; every rank "
                "must run the same K >= 1 (ZeRO reduces on the last one). Pad a short rank with "
                "micro-batches of zero items"
            )
        per_rank = rows["items"]
        n = rows.total("items")
        if n <= 0:
            raise WholebatchError(
                f"{op}: the step holds {dict(enumerate(per_rank))} items per rank (none in all); "
                "its mean is undefined. Skip such steps in the data"
            )
        return per_rank, n

    def _start_sum(self, loss_sum: Tensor) -> tuple[Tensor, Any]:
        """Start the all-reduce (sum) of every rank's loss sum: (the tensor, its work or None)."""
        mine = loss_sum.to(device=comm_device(self.group), dtype=torch.float64).reshape(1)
        if self.world_size == 1:
            return mine, None
        return mine, torch.distributed.all_reduce(mine, group=self.group, async_op=True)
