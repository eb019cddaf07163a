"""`wholebatch verify` targets: a GRU tagger on dict batches, accumulated right and wrong.

    wholebatch verify examples/verify_steps.py:correct --nproc 3 --micro-batches 2           # PASS
    wholebatch verify examples/verify_steps.py:checkpointed --nproc 3 --micro-batches 2      # PASS
    wholebatch verify examples/verify_steps.py:step_per_micro_batch ...    # FAIL: optimizer-steps
    wholebatch verify examples/verify_steps.py:checkpoint_without_rng ...  # FAIL: no-rng-replay
    wholebatch verify examples/verify_steps.py:global_count_without_w ...  # FAIL: uncompensated-mean
    wholebatch verify examples/verify_steps.py:mean_of_means ...           # FAIL: mean-of-means
    wholebatch verify examples/verify_steps.py:accumulator_on_inner_module ...  # FAIL

A token tagger (embedding, GRU, and residual MLP blocks with dropout that
`checkpointed` runs under activation checkpointing) on sequences of ragged
length, as a dict batch {"tokens", "targets", "mask"} of 20 rows: split over
W = 3 ranks x K = 2 micro-batches the chunks hold 4, 4, 3, 3, 3, 3 rows. The
whole-batch loss is the mean cross-entropy over every real token. No
`equal_batch` is given: verify finds a normalisation mistake from the gradient.
float64 throughout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from wholebatch.train.accumulate import Accumulator
from wholebatch.verify.spec import VerifySpec

ROWS, SEQ, VOCAB, DIM = 20, 7, 13, 8
Batch = dict[str, Tensor]


class Block(nn.Module):
    """x + Linear(Dropout(GELU(Linear(x)))): the part checkpointing recomputes."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.drop = nn.Dropout(0.25)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(self.drop(F.gelu(self.up(x))))


class GruTagger(nn.Module):
    def __init__(self, recompute: bool = False, preserve_rng_state: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.gru = nn.GRU(DIM, DIM, batch_first=True)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(DIM, VOCAB)
        self.recompute = recompute
        self.preserve_rng_state = preserve_rng_state
        self.double()

    def forward(self, tokens: Tensor) -> Tensor:
        h_NTD, _ = self.gru(self.emb(tokens))
        for block in self.blocks:
            if self.recompute:
                h_NTD = checkpoint(
                    block, h_NTD, use_reentrant=False, preserve_rng_state=self.preserve_rng_state
                )
            else:
                h_NTD = block(h_NTD)
        return self.out(h_NTD)  # N x T x VOCAB


def _batch() -> Batch:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (ROWS,), generator=g)
    mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    return {"tokens": tokens, "targets": targets, "mask": mask}


def _token_loss_sum(model: nn.Module, mb: Batch) -> tuple[Tensor, Tensor]:
    logits = model(mb["tokens"])
    ce = F.cross_entropy(logits.flatten(0, 1), mb["targets"].flatten(), reduction="none")
    m = mb["mask"].flatten().to(ce.dtype)
    return (ce * m).sum(), m.sum()


def reference_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Mean over every real token of the whole batch."""
    total, count = _token_loss_sum(model, batch)
    return total / count


def _spec(step, **model_kw) -> VerifySpec:  # type: ignore[no-untyped-def]
    return VerifySpec(
        build_model=lambda: GruTagger(**model_kw),
        batch=_batch(),
        step=step,
        reference_loss=reference_loss,
        count_items=lambda b: int(b["mask"].sum()),
    )


def _accumulate(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    Accumulator(model, optimizer).step(mbs, _token_loss_sum)


# -- right ---------------------------------------------------------------------


def correct() -> VerifySpec:
    """Accumulator: token-loss sums, divided once by the global token count."""
    return _spec(_accumulate)


def checkpointed() -> VerifySpec:
    """Accumulator with the MLP blocks under torch.utils.checkpoint(preserve_rng_state=True).

    Backward recomputes each block's forward, dropout included, with the RNG state
    of the first forward: the same masks, the same gradient as without checkpointing.
    """
    return _spec(_accumulate, recompute=True)


# -- wrong ---------------------------------------------------------------------


def _global_count(mbs: list[Batch]) -> Tensor:
    count = sum((mb["mask"].sum() for mb in mbs), torch.tensor(0)).double()
    dist.all_reduce(count)
    return count


def step_per_micro_batch() -> VerifySpec:
    """MISTAKE: optimizer.step() after every micro-batch (each loss normalised globally, x W).

    The gradients of the K steps add up to the whole-batch gradient, but they are
    K separate updates, each taken from part of the batch.
    """

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Batch]) -> None:
        count = _global_count(mbs)
        for mb in mbs:
            total, _ = _token_loss_sum(model, mb)
            (total / count * dist.get_world_size()).backward()
            optimizer.step()
            optimizer.zero_grad()

    return _spec(step)


def checkpoint_without_rng() -> VerifySpec:
    """MISTAKE: the same Accumulator step, but checkpoint(preserve_rng_state=False).

    The recomputed forward draws new dropout masks: the gradient is that of a
    network the forward never ran.
    """
    return _spec(_accumulate, recompute=True, preserve_rng_state=False)


def global_count_without_w() -> VerifySpec:
    """MISTAKE: every rank divides by the GLOBAL token count, but DDP then averages the ranks.

    No gather anywhere: the gradient is exactly 1/W of the whole-batch one (the HF
    Trainer's num_items_in_batch without its x W).
    """

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Batch]) -> None:
        count = _global_count(mbs)
        for i, mb in enumerate(mbs):
            sync = model.no_sync() if i < len(mbs) - 1 else contextlib.nullcontext()
            with sync:
                total, _ = _token_loss_sum(model, mb)
                (total / count).backward()
        optimizer.step()
        optimizer.zero_grad()

    return _spec(step)


def mean_of_means() -> VerifySpec:
    """MISTAKE: each micro-batch's token mean, divided by K; DDP averages the ranks."""

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Batch]) -> None:
        for i, mb in enumerate(mbs):
            sync = model.no_sync() if i < len(mbs) - 1 else contextlib.nullcontext()
            with sync:
                total, count = _token_loss_sum(model, mb)
                (total / count / len(mbs)).backward()
        optimizer.step()
        optimizer.zero_grad()

    return _spec(step)


def accumulator_on_inner_module() -> VerifySpec:
    """MISTAKE: the Accumulator given ddp.module: no gradient is reduced across ranks.

    Each rank would step on its own gradient; the ranks' weights drift apart.
    """

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Batch]) -> None:
        inner = model.module if hasattr(model, "module") else model
        Accumulator(inner, optimizer).step(mbs, _token_loss_sum)

    return _spec(step)
