"""Verify targets for normalisation modes (issue 22): GRPO-like per-token losses, float64.

The batch: 14 completions (rows) of up to 6 tokens, ragged (1..6 tokens in the
mask), in groups of two completions per prompt; completion 5 runs over two rows
(5 and 6), so at W = 2 x K = 3 (rows cut 3, 3, 2, 2, 2, 2) one sequence spans
two micro-batches and group 1 (rows 2, 3) two micro-batches too. Ids are
columns of the batch, global to the step.

- `grpo_per_micro_batch` (MISTAKE): trl's GRPO loss per micro-batch, each
  sequence's token mean averaged over the micro-batch's sequences, / K; the
  reference averages whole sequences. Named `normalization-mode`.
- `grpo_rows_per_micro_batch`: the same with one row per sequence: the
  reference is then a weighted sum of its micro-batch losses, and the
  micro-batch weights alone would read as a mean of means (by items, where the
  reference weights sequences); with the ids it is `normalization-mode`.
- `grpo_per_micro_batch_no_ids`: the same step without `normalize`: verify
  behaves as without this feature (no `normalization-mode`).
- `token_per_micro_batch` (MISTAKE): each micro-batch's token mean / K against
  one token mean: the classic mean of means, named `mean-of-means` (the
  normalisation reading says (token, micro_batch) too).
- `accumulator_sequence`: `Accumulator.step(..., normalize=Normalize("sequence",
  ...))`: passes.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from wholebatch import Accumulator, Normalize
from wholebatch.verify.spec import VerifySpec

ROWS, T, D, K = 14, 6, 3, 3
LENGTHS = [4, 1, 6, 2, 5, 3, 2, 6, 1, 4, 3, 5, 2, 6]
SEQ_OF_ROW = [0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 11, 12]  # rows 5 and 6: one sequence
Batch = dict[str, Tensor]


class TokenScorer(nn.Module):
    """A per-token MLP: [B, T, D] -> [B, T]."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)


def make_batch(rows_are_sequences: bool = False) -> Batch:
    g = torch.Generator().manual_seed(22)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]  # [N, T]
    of_row = list(range(ROWS)) if rows_are_sequences else SEQ_OF_ROW
    seq = torch.tensor(of_row)[:, None].expand(ROWS, T).clone()  # [N, T]
    return {
        "x": torch.randn(ROWS, T, D, generator=g, dtype=torch.float64),
        "y": torch.randn(ROWS, T, generator=g, dtype=torch.float64),
        "mask": mask,
        "seq": seq,
        "grp": seq // 2,
    }


def items(mb: Batch) -> dict[str, Tensor]:
    return {"mask": mb["mask"], "sequence": mb["seq"], "group": mb["grp"]}


def per_token(model: nn.Module, mb: Batch) -> Tensor:
    """Per-token losses [B, T] (padding positions too; the mask drops them)."""
    out: Tensor = (model(mb["x"]) - mb["y"]) ** 2
    return out


def sequence_mean(model: nn.Module, batch: Batch) -> Tensor:
    """Whole-batch "sequence": the mean over sequences of each sequence's token mean."""
    mask = batch["mask"]
    ids, losses = batch["seq"][mask], per_token(model, batch)[mask]
    uniq, inverse = torch.unique(ids, return_inverse=True)
    sums = torch.zeros(uniq.numel(), dtype=losses.dtype).index_add(0, inverse, losses)
    n = torch.bincount(inverse, minlength=uniq.numel()).to(losses.dtype)
    return (sums / n).mean()


def token_mean(model: nn.Module, batch: Batch) -> Tensor:
    mask = batch["mask"]
    return per_token(model, batch)[mask].sum() / mask.sum()


def _grpo_step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    for mb in mbs:  # GRPO as trl writes it, per micro-batch: its sequences' token means, averaged
        (sequence_mean(model, mb) / len(mbs)).backward()
    optimizer.step()


def _spec(step: object, reference: object, mode: str | None) -> VerifySpec:
    return VerifySpec(
        build_model=TokenScorer,
        batch=make_batch(),
        step=step,  # type: ignore[arg-type]
        reference_loss=reference,  # type: ignore[arg-type]
        normalize=None if mode is None else Normalize(mode, items=items),  # type: ignore[arg-type]
        item_losses=None if mode is None else per_token,
    )


def grpo_per_micro_batch() -> VerifySpec:
    """MISTAKE: GRPO's sequence means averaged per micro-batch."""
    return _spec(_grpo_step, sequence_mean, "sequence")


def grpo_rows_per_micro_batch() -> VerifySpec:
    """MISTAKE, as above, with every completion one row (no sequence spans micro-batches)."""
    return dataclasses.replace(grpo_per_micro_batch(), batch=make_batch(rows_are_sequences=True))


def grpo_per_micro_batch_no_ids() -> VerifySpec:
    """MISTAKE, as above, without the ids: verify reads micro-batch weights only."""
    return _spec(_grpo_step, sequence_mean, None)


def _token_step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    for mb in mbs:
        mask = mb["mask"]
        (per_token(model, mb)[mask].sum() / mask.sum() / len(mbs)).backward()
    optimizer.step()


def token_per_micro_batch() -> VerifySpec:
    """MISTAKE: each micro-batch's token mean, / K."""
    return _spec(_token_step, token_mean, "token")


def _accumulator_step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    Accumulator(model, optimizer).step(mbs, per_token, normalize=Normalize("sequence", items=items))


def accumulator_sequence() -> VerifySpec:
    """Right: the Accumulator gives every token its whole-batch sequence weight."""
    return _spec(_accumulator_step, sequence_mean, "sequence")


class TinyScorer(nn.Module):
    """A per-token linear map: 4 parameter entries, fewer than the batch's 14 cells."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(D, 1).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)


def grpo_tiny_model() -> VerifySpec:
    """MISTAKE as `grpo_per_micro_batch`, on a model too small to tell the cells apart."""
    return dataclasses.replace(grpo_per_micro_batch(), build_model=TinyScorer)


def _flat_losses(model: nn.Module, mb: Batch) -> Tensor:
    return per_token(model, mb).reshape(-1)


def grpo_flat_item_losses() -> VerifySpec:
    """MISTAKE as `grpo_per_micro_batch`, with item_losses not shaped like the mask."""
    return dataclasses.replace(grpo_per_micro_batch(), item_losses=_flat_losses)
