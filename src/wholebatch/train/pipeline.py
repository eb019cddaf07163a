"""Exact accumulation through a `torch.distributed.pipelining` schedule (GPipe, 1F1B).

    stage = PipelineStage(ddp_stage, pp_rank, num_stages, device, group=mesh["pp"].get_group())
    acc = PipelineAccumulator(stage, optimizer, mesh=mesh, batch_dims=("dp",), pipeline_dim="pp",
                              schedule="1f1b", n_microbatches=K, loss_fn=token_loss_sum)
    stats = acc.step(tokens, target=targets)   # first stage: inputs; last: target; others: nothing
    # loss_fn(output, target) -> (sum of item losses, number of items), on the last stage

Why not the schedule's own scaling: torch's schedules take a per-micro-batch
loss and, with `scale_grads=True`, divide every stage's gradient by K, a mean
of micro-batch means, wrong whenever micro-batches hold different numbers of
tokens (torchtitan #2206 prefetches micro-batches to count them first). Here
the schedule runs with `scale_grads=False`; the last stage back-propagates each
micro-batch's loss SUM times one constant c (the same on every rank: the
`Accumulator`'s pre-scale, factor / N'), records its count, and after the
schedule one all-gather over the whole mesh agrees N: only last-stage ranks
report counts (`counted=True`); each data shard counted once, replicas checked
(`wholebatch.comm.mesh`). Every stage then multiplies its gradient by the same
factor / (c N), so no stage is left unscaled.

Communication: the schedule's stage runs DDP's `no_sync` / FSDP2's
`set_requires_gradient_sync(False)` for all but the last backward, so the
wrapper reduces once per step over the data-parallel dims; the count adds one
small all-gather (K and stale gradients are agreed by another before the step).

Legend: K micro-batches per step, N global item count, pp stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from wholebatch.comm.mesh import MeshSplit
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.train.auxloss import refuse_terms
from wholebatch.train.feeds import check_feeds, feed_fields
from wholebatch.train.stepping import OnNonFinite, StepConfig, StepFinisher, StepStats

if TYPE_CHECKING:  # annotations only: the engines import without a mesh in use
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PipelineAccumulator", "PipelineLossFn"]

PipelineLossFn = Callable[[Tensor, Tensor], tuple[Tensor, int | float | Tensor]]
ScheduleName = Literal["gpipe", "1f1b"]


def _schedule_class(schedule: str | type) -> type:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    if isinstance(schedule, type):
        return schedule
    table = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule not in table:
        raise WholebatchError(
            f"PipelineAccumulator: schedule={schedule!r}; expected 'gpipe', '1f1b' or a "
            "single-stage schedule class from torch.distributed.pipelining"
        )
    return table[schedule]


class PipelineAccumulator:
    """One optimizer step over a pipeline schedule's K micro-batches with the whole-batch gradient.

    Every rank of the mesh calls `step` once per step. After it, every stage's
    parameters have taken one optimizer step on d(sum of item losses / N)/dθ (N:
    the items of every data shard's K micro-batches) and their grads are None.

    Args:
        stage: this rank's `torch.distributed.pipelining.PipelineStage`; its module is
            the stage as trained (DDP on the data-parallel group, `fully_shard`, or plain
            when the batch is not split).
        optimizer: steps this stage's parameters.
        mesh: the device mesh (pipeline, data and other dims).
        batch_dims: the dims that split the batch (data parallel, context parallel).
        pipeline_dim: the pipeline dim of `mesh`.
        n_microbatches: K; the schedule cuts each step's inputs into K chunks along dim 0.
        loss_fn: `loss_fn(output, target) -> (sum of item losses, item count)` for one
            micro-batch, on the last stage. Return a loss built from `output` also for
            a micro-batch with no items (e.g. cross_entropy(..., reduction="sum")).
        schedule: "1f1b" (default), "gpipe", or a single-stage schedule class.
        max_grad_norm: clip the whole-batch gradient (all stages together) to this norm.
        on_nonfinite: "skip" (default) or "raise", as for `Accumulator`.
    """

    def __init__(
        self,
        stage: Any,
        optimizer: torch.optim.Optimizer,
        *,
        mesh: DeviceMesh,
        batch_dims: Sequence[str],
        pipeline_dim: str,
        n_microbatches: int,
        loss_fn: PipelineLossFn,
        schedule: ScheduleName | type = "1f1b",
        max_grad_norm: float | None = None,
        on_nonfinite: OnNonFinite = "skip",
    ) -> None:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        if not isinstance(stage, _PipelineStageBase):
            raise WholebatchTypeError(
                f"PipelineAccumulator: stage must be a torch.distributed.pipelining "
                f"PipelineStage, got {type(stage).__name__}"
            )
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise WholebatchError(
                f"PipelineAccumulator: n_microbatches={n_microbatches!r} must be an int >= 1"
            )
        refuse_terms(stage.submod, "PipelineAccumulator")
        split = MeshSplit.from_args(
            "PipelineAccumulator", mesh, batch_dims, pipeline_dim=pipeline_dim
        )
        assert split is not None
        self.split = split
        self.stage = stage
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.n_microbatches = n_microbatches
        self.finisher = StepFinisher(
            stage.submod,
            optimizer,
            config=StepConfig(max_grad_norm=max_grad_norm, on_nonfinite=on_nonfinite),
            split=split,
        )
        # N' (see Accumulator): the last agreed item count, the same on every rank.
        self.items_estimate = 1.0
        self._scale = 1.0
        self._parts: list[tuple[Tensor, Tensor]] = []
        cls = _schedule_class(schedule)
        self.schedule = cls(
            stage, n_microbatches=n_microbatches, loss_fn=self._loss, scale_grads=False
        )

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped steps not counted)."""
        return self.finisher.steps

    def backward_scale(self) -> float:
        """The constant c each micro-batch's loss sum is multiplied by before backward."""
        return self.finisher.reduce_factor / self.items_estimate

    def _loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The schedule's loss: this micro-batch's sum x c; the sum and count recorded."""
        out = self.loss_fn(output, target)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise WholebatchTypeError(
                f"PipelineAccumulator: loss_fn returned {type(out).__name__}; it must return "
                "(sum of item losses: Tensor, number of items: int | Tensor)"
            )
        loss, n = out
        if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise WholebatchError(
                "PipelineAccumulator: loss_fn's loss must be a one-element Tensor computed "
                "from the stage output (requiring grad), also for a micro-batch with no items"
            )
        count = torch.as_tensor(n).detach().to(torch.float64).reshape(())
        self._parts.append((loss.detach().to(torch.float64).reshape(()), count))
        return loss.reshape(()) * self._scale

    def step(self, *inputs: Tensor, target: Tensor | None = None) -> StepStats:
        """Run the schedule over one step's batch, then take one optimizer step on every stage.

        Args:
            inputs: the step's inputs on the first stage (K micro-batches along dim 0);
                nothing on other stages.
            target: the step's targets on the last stage (cut the same way); None elsewhere.

        Returns:
            `StepStats` (identical on every rank): whole-batch loss, N, grad norm.
        """
        k = self.n_microbatches
        op = "PipelineAccumulator.step"
        fed = {"inputs": list(inputs), "target": target}  # first stage's inputs, last's targets
        rows = self.finisher.begin(k, op=op, extra=feed_fields(self.split, fed))
        check_feeds(op, self.split, rows, fed)
        self._scale = self.backward_scale()
        self._parts = []
        kwargs: dict[str, Any] = {}
        if self.stage.is_last:
            if target is None:
                raise WholebatchError(
                    "PipelineAccumulator.step: the last stage needs target= (the labels)"
                )
            kwargs["target"] = target
        self.schedule.step(*(inputs if self.stage.is_first else ()), **kwargs)
        last = bool(self.stage.is_last)
        if last:
            # On its first step a stage infers its shapes by running loss_fn once more
            # (torch's DYNAMIC metadata inference, before the K real micro-batches): the
            # step's micro-batches are the last K calls.
            parts = self._parts[-k:]
            if len(parts) != k:
                raise WholebatchError(
                    f"PipelineAccumulator.step: the schedule computed {len(parts)} losses on "
                    f"the last stage, expected n_microbatches={k}"
                )
            loss_sum = torch.stack([p[0] for p in parts]).sum()
            items = torch.stack([p[1] for p in parts]).sum()
        else:
            loss_sum = items = torch.zeros((), dtype=torch.float64)
        stats = self.finisher.finish(
            loss_sum=loss_sum,
            items=items,
            micro_batches=k,
            backward_scale=self._scale,
            counted=last,
        )
        if stats.items > 0:
            self.items_estimate = stats.items
        return stats
