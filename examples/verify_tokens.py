"""`wholebatch verify` targets: token-level loss accumulated over W ranks x K micro-batches.

    wholebatch verify examples/verify_tokens.py:correct         # PASS
    wholebatch verify examples/verify_tokens.py:mean_of_means   # FAIL: mean-of-means

A tiny per-token classifier on sequences of ragged length (padding masked
out). The whole-batch loss is the mean over every real token of the whole
batch. `equal_batch` holds the same kind of data with every sequence full
length, which lets verify tell a normalisation mistake from other ones.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wholebatch.train.accumulate import Accumulator
from wholebatch.verify import VerifySpec

ROWS, SEQ, VOCAB, DIM = 24, 6, 11, 8
Batch = tuple[Tensor, Tensor, Tensor]  # tokens, targets (ROWS x SEQ), mask of real tokens


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.out = nn.Linear(DIM, VOCAB)
        self.double()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(torch.tanh(self.emb(tokens)))  # ROWS x SEQ x VOCAB


def _batch(ragged: bool) -> Batch:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    lengths = (
        torch.randint(1, SEQ + 1, (ROWS,), generator=g) if ragged else torch.full((ROWS,), SEQ)
    )
    mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    return tokens, targets, mask


def _token_losses(model: nn.Module, mb: Batch) -> tuple[Tensor, Tensor]:
    tokens, targets, mask = mb
    logits = model(tokens)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return ce, mask.flatten().to(ce.dtype)


def reference_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Mean over every real token of the whole batch."""
    ce, m = _token_losses(model, batch)
    return (ce * m).sum() / m.sum()


def _spec(step) -> VerifySpec:  # type: ignore[no-untyped-def]
    return VerifySpec(
        build_model=Tagger,
        batch=_batch(ragged=True),
        equal_batch=_batch(ragged=False),
        step=step,
        reference_loss=reference_loss,
    )


def correct() -> VerifySpec:
    """Accumulator: sums of token losses, divided once by the global token count."""

    def loss_fn(model: nn.Module, mb: Batch) -> tuple[Tensor, Tensor]:
        ce, m = _token_losses(model, mb)
        return (ce * m).sum(), m.sum()

    def step(
        model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch]
    ) -> None:
        Accumulator(model, optimizer).step(micro_batches, loss_fn)

    return _spec(step)


def mean_of_means() -> VerifySpec:
    """MISTAKE: each micro-batch's token mean, divided by K (the Hugging Face Trainer before late 2024).

    DDP then averages the ranks' results: a mean of means, which over-weights
    micro-batches with few tokens. Exact only when all hold the same count.
    """

    def step(
        model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch]
    ) -> None:
        k = len(micro_batches)
        for i, mb in enumerate(micro_batches):
            sync = model.no_sync() if i < k - 1 else contextlib.nullcontext()
            with sync:
                ce, m = _token_losses(model, mb)
                ((ce * m).sum() / m.sum() / k).backward()
        optimizer.step()
        optimizer.zero_grad()

    return _spec(step)
