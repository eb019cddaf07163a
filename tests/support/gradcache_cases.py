"""Shared pieces of the GradCache tests: a dropout encoder, an InfoNCE on all_gather, per-rank data.

The loss is hand-written on `wholebatch.all_gather` (not a `wholebatch.losses`
function) so these tests judge the cache alone: each query of rank r against
the positives AND the hard negatives of every rank; the positive of local query
i is row (rows of p on ranks < r) + i of the gathered positives. Sum of
cross-entropies over this rank's queries / global query count, times W to
compensate DDP's mean (DESIGN.md, "Data parallelism averages").

Three known-wrong variants (mutations) the tests must reject:
- "no_replay": pass 2 draws fresh dropout masks (`GradCache._replay_rng = False`);
- "no_times_w": the loss forgets the factor W: every gradient 1/W too small;
- "local_negatives": no gather, each rank's queries see only its own documents.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wholebatch.comm.collectives import all_gather, all_reduce
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.train.gradcache import GradCache

__all__ = [
    "D_IN",
    "F64",
    "MUTATIONS",
    "Encoder",
    "MicroBatch",
    "NoReplayCache",
    "cache_class",
    "embed3",
    "info_nce",
    "make_batches",
]

# float64, tiny model: round-off ~1e-15 relative; every mutation is off by O(1e-2) or more.
F64: dict[str, float] = dict(rtol=1e-10, atol=1e-12)
D_IN, D_OUT = 4, 3
MUTATIONS = ("no_replay", "no_times_w", "local_negatives")
MicroBatch = tuple[Tensor, Tensor, Tensor]  # (queries_BD, positives_BD, negatives_MD)


class Encoder(nn.Module):
    """One shared tower with dropout; `inner_scale` adds a `logit_scale` its forward never uses."""

    def __init__(self, *, inner_scale: float | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(D_IN, 6), nn.Tanh(), nn.Dropout(0.3), nn.Linear(6, D_OUT)
        )
        if inner_scale is not None:
            self.logit_scale = nn.Parameter(torch.tensor(inner_scale))
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.net(x)
        return out


def embed3(model: nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Three outputs per micro-batch, the negatives with their own row count."""
    q, p, n = mb
    return model(q), model(p), model(n)


class NoReplayCache(GradCache):
    """MUTATION: pass 2 draws fresh dropout masks."""

    _replay_rng = False


def cache_class(mutation: str | None) -> type[GradCache]:
    return NoReplayCache if mutation == "no_replay" else GradCache


def info_nce(
    q_BD: Tensor, p_BD: Tensor, n_MD: Tensor, scale: Tensor, mutation: str | None = None
) -> Tensor:
    """Queries against every rank's positives and negatives (see the module docstring)."""
    w = get_world_size()
    gather = mutation != "local_negatives"
    rows = torch.tensor([[float(p_BD.shape[0])]], dtype=torch.float64)
    rows_W = all_gather(rows).flatten() if w > 1 else rows.flatten()
    offset = int(rows_W[: get_rank()].sum()) if gather else 0
    docs = torch.cat([all_gather(p_BD), all_gather(n_MD)]) if gather else torch.cat([p_BD, n_MD])
    logits = scale * (q_BD @ docs.T)
    labels = torch.arange(q_BD.shape[0]) + offset
    ce = F.cross_entropy(logits, labels, reduction="sum")
    count = all_reduce(torch.tensor(float(q_BD.shape[0]), dtype=torch.float64))
    factor = 1.0 if mutation == "no_times_w" else float(w)
    return ce * factor / count


def make_batches(rows: Sequence[Sequence[int]], seed: int = 0) -> list[list[MicroBatch]]:
    """Per rank, micro-batches of (q, p, n) with `rows[r][i]` queries and 2x+1 negatives (0 -> 0)."""
    out = []
    for r, sizes in enumerate(rows):
        gen = torch.Generator().manual_seed(1000 * seed + 7 + r)
        mbs = []
        for b in sizes:
            m = 2 * b + 1 if b else 0
            mbs.append(
                (
                    torch.randn(b, D_IN, generator=gen, dtype=torch.float64) + r,
                    torch.randn(b, D_IN, generator=gen, dtype=torch.float64) - r,
                    torch.randn(m, D_IN, generator=gen, dtype=torch.float64),
                )
            )
        out.append(mbs)
    return out
