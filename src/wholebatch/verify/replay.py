"""Record and replay: verify a trainer that builds its batch inside `train()` (`ReplaySpec`).

    def grpo_bnpo() -> ReplaySpec:                    # tests/support/trl_grpo_verify.py
        def train(run: TrainerRun) -> None:
            class Recorded(GRPOTrainer):
                def _compute_loss(self, model, inputs):
                    run.record({k: inputs[k] for k in ("prompt_ids", "prompt_mask",
                                "completion_ids", "completion_mask", "advantages")})
                    return super()._compute_loss(model, inputs)
            Recorded(model=run.model, args=GRPOConfig(...), optimizers=(run.optimizer, None), ...).train()
        return ReplaySpec(build_model=policy, data=prompts(), train=train,
                          reference_loss=token_mean, left_padded=("prompt_ids", "prompt_mask"))

An RL trainer samples completions, scores them and computes advantages inside
its loop: the batch its loss sees exists only once it has run, and differs
with the split (a re-run at W = 1 generates its own). So each split run
records, on every rank, what the loss read for every micro-batch
(`run.record`), and its reference is `reference_loss` on that run's recorded
whole batch (`wholebatch.verify.batches.collate`: every rank's micro-batches in
rank order, padded to one width, plus a `row` column numbering the rows). The
rest is a `TrainerSpec`'s: `GradRecorder` as the optimizer, dropout off, the
comparison, the re-runs and the fit (each recorded micro-batch is one of its
parts, with the rows it holds known exactly).

On-policy, what the loss reads fixes its gradient: the reference needs no
generation, only the model's log-probabilities of the recorded tokens.

Legend: W ranks, K micro-batches per rank, J = W·K recorded micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.train.normalize import Normalize
from wholebatch.verify.batches import Batch
from wholebatch.verify.spec import TrainerRun, _check_common

__all__ = ["ReplaySpec"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplaySpec:
    """A TARGET for a trainer whose batch is built inside `train()` (generation, rewards).

    Run one optimizer step on W ranks x K micro-batches like a `TrainerSpec`;
    the whole batch is what its loss read, recorded on every rank.
    """

    build_model: Callable[[], nn.Module]
    """As `VerifySpec.build_model` (the policy; generation uses it too)."""

    train: Callable[[TrainerRun], object]
    """Builds the trainer around `run` (`run.model`, `run.optimizer`, the rows
    `run.dataset`, `run.micro_batches` accumulation steps, `run.world_size`) and trains
    exactly one optimizer step without clipping, calling `run.record(micro_batch)` for
    every micro-batch its loss reads: a dict of the tensors the loss reads (rows first;
    the same columns every time)."""

    reference_loss: Callable[[nn.Module, Batch], Tensor]
    """The whole batch's loss on one process: `reference_loss(model, batch)`, `batch` the
    recorded micro-batches of every rank concatenated (a dict of the recorded columns,
    each padded with zeros to its widest micro-batch, plus `row`: each row's index).
    Verify also calls it on parts of that batch (the rows of one micro-batch), so it
    should work on any subset of rows."""

    data: Sequence[Any] = ()
    """The rows the trainer reads (prompts), handed over as `run.dataset` (a list)."""

    left_padded: tuple[str, ...] = ()
    """Recorded columns the trainer pads on the left (trl's prompts): padded on the left
    to the widest micro-batch, so their tokens stay next to what follows them."""

    count_items: Callable[[Batch], int | Tensor] | None = None
    """As `VerifySpec.count_items`, on the recorded batch."""

    seed: int = 0
    """As `VerifySpec.seed`; the trainer's own seed is yours to set (`run.seed`)."""

    rtol: float | None = None
    """As `VerifySpec.rtol`."""

    normalize: Normalize | None = None
    """As `VerifySpec.normalize`, read on the recorded batch (ids from its columns, e.g.
    `row` as the sequence id)."""

    item_losses: Callable[[nn.Module, Batch], Tensor] | None = None
    """As `VerifySpec.item_losses`, on the recorded batch."""

    aux_loss: Callable[[nn.Module, Batch], Tensor] | None = None
    """As `VerifySpec.aux_loss`, on the recorded batch."""

    # What the shared checks and the runner read of every spec kind.
    equal_batch: None = None
    mesh: None = None
    batch_dims: None = None
    parallelize: None = None

    def __post_init__(self) -> None:
        if not callable(self.train):
            raise WholebatchTypeError(
                f"ReplaySpec: train must be callable, got {type(self.train).__name__}"
            )
        if isinstance(self.left_padded, str) or not all(
            isinstance(k, str) for k in self.left_padded
        ):
            raise WholebatchTypeError(
                f"ReplaySpec: left_padded={self.left_padded!r} must be a tuple of column names"
            )
        if isinstance(self.data, str | bytes) or not isinstance(self.data, Sequence):
            raise WholebatchTypeError(
                f"ReplaySpec: data must be a sequence of rows (prompts), got {type(self.data).__name__}"
            )
        _check_common(self, "ReplaySpec", has_batch=False)


class Recorder:
    """`run.record` of one rank: detached CPU copies of every recorded micro-batch, in order."""

    def __init__(self) -> None:
        self.micro_batches: list[dict[str, Tensor]] = []

    def __call__(self, micro_batch: Any) -> None:
        if not isinstance(micro_batch, dict) or not all(isinstance(k, str) for k in micro_batch):
            raise WholebatchTypeError(
                "run.record: give a dict of column name -> Tensor (what the loss reads, rows "
                f"first), got {type(micro_batch).__name__}"
            )
        bad = [k for k, v in micro_batch.items() if not isinstance(v, Tensor)]
        if bad:
            raise WholebatchError(
                f"run.record: the columns {bad} are not tensors; record tensors only"
            )
        self.micro_batches.append(
            {k: v.detach().to("cpu", copy=True) for k, v in micro_batch.items()}
        )


def batch_key(recorded: Sequence[Sequence[dict[str, Tensor]]]) -> float:
    """A number that changes with what was recorded (a reference is cached per recorded batch)."""
    total = 0.0
    for per_rank in recorded:
        for mb in per_rank:
            for v in mb.values():
                total += float(v.double().sum()) + 0.5 * float(v.numel())
    return total


def empty_run_error(target: str, counts: Sequence[int]) -> WholebatchError:
    """The error of a split run in which some rank recorded nothing."""
    return WholebatchError(
        f"verify: {target}: the trainer recorded {list(counts)} micro-batches on ranks "
        f"{list(range(len(counts)))}; a ReplaySpec's train must call run.record(micro_batch) for "
        "every micro-batch its loss reads (e.g. from the trainer's compute_loss)"
    )
