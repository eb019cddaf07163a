"""Small shared test models and ragged data: a tiny language model on padded sequences.

Items are target tokens: a sequence of length L has L - 1 next-token targets, and
padding positions carry `IGNORE` targets, so micro-batches differ in token count
whenever their sequences differ in length. That raggedness is what exposes a
mean-of-means accumulation loop (equal-length data hides it).

Legend: S sequences in a batch, T padded length, V vocabulary, D width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "IGNORE",
    "PAD",
    "VOCAB",
    "MicroBatch",
    "TinyLM",
    "lm_loss_mean",
    "lm_loss_sum",
    "make_sequences",
    "micro_batch",
    "split_for_ranks",
    "whole_batch_loss",
]

VOCAB = 11
PAD = 0
IGNORE = -100

MicroBatch = tuple[Tensor, Tensor]  # (tokens_ST, targets_ST)


class TinyLM(nn.Module):
    """Embedding -> tanh MLP -> vocabulary logits, per position (no attention: tiny and exact)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 6, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def forward(self, tokens_ST: Tensor) -> Tensor:
        h_STD = torch.tanh(self.hidden(self.emb(tokens_ST)))
        logits_STV: Tensor = self.out(h_STD)
        return logits_STV


def make_sequences(lengths: Sequence[int], seed: int = 0, vocab: int = VOCAB) -> list[Tensor]:
    """One random token sequence (ids 1..vocab-1, so never PAD) per requested length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]


def micro_batch(seqs: Sequence[Tensor], width: int | None = None) -> MicroBatch:
    """Pad `seqs` to a common length: inputs tokens[:-1], targets tokens[1:], IGNORE on padding.

    A sequence of length <= 1 contributes no target; a micro-batch of such sequences
    (or none) holds zero items.
    """
    t = max([len(s) for s in seqs] + [2]) - 1 if width is None else width
    tokens_ST = torch.full((len(seqs), t), PAD, dtype=torch.long)
    targets_ST = torch.full((len(seqs), t), IGNORE, dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s) - 1
        if n > 0:
            tokens_ST[i, :n] = s[:-1]
            targets_ST[i, :n] = s[1:]
    return tokens_ST, targets_ST


def lm_loss_sum(model: nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor]:
    """(sum of token cross-entropies, number of target tokens): the Accumulator's default contract."""
    tokens_ST, targets_ST = mb
    logits_STV = model(tokens_ST)
    loss = F.cross_entropy(
        logits_STV.reshape(-1, logits_STV.shape[-1]).double(),
        targets_ST.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return loss, (targets_ST != IGNORE).sum()


def lm_loss_mean(model: nn.Module, mb: MicroBatch) -> Tensor:
    """The mean token cross-entropy of one micro-batch (what a naive loop divides by K)."""
    loss, n = lm_loss_sum(model, mb)
    return loss / n


def split_for_ranks(
    seqs: Sequence[Tensor], sizes: Sequence[Sequence[int]]
) -> list[list[MicroBatch]]:
    """Cut `seqs` in order into micro-batches: sizes[r][k] sequences for rank r's k-th."""
    out: list[list[MicroBatch]] = []
    i = 0
    for rank_sizes in sizes:
        mbs = []
        for n in rank_sizes:
            mbs.append(micro_batch(seqs[i : i + n]))
            i += n
        out.append(mbs)
    if i != len(seqs):
        raise ValueError(f"split_for_ranks: sizes cover {i} sequences, got {len(seqs)}")
    return out


def whole_batch_loss(model: nn.Module, seqs: Sequence[Tensor]) -> Tensor:
    """The reference: mean token cross-entropy over every sequence at once, in one process."""
    loss, n = lm_loss_sum(model, micro_batch(seqs))
    return loss / n
