"""Bytes each rank sends and receives per step, collective by collective, from the library's own size bookkeeping.

Every count here walks the sequence of collectives a loss issues (read off
`wholebatch.losses.contrastive` and `wholebatch.losses.tiles`; the tests count
the real calls on gloo and compare) and takes each call's split sizes from
`wholebatch.comm.sizes`, the functions the collectives themselves call. So a
count at W = 65,536 runs the same bookkeeping as a real run, for one virtual
rank, without a process.

Legend: W ranks, N global rows, B a rank's rows, D embedding dim; e the
embeddings' element size, a the kernels' compute element size (float32 for
16-bit inputs), `sizes` every rank's B.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from wholebatch.comm.sizes import (
    gather_splits,
    reduce_scatter_splits,
    ring_all_reduce_elements,
    ring_sizes,
    shift_splits,
    wire_rows,
)

__all__ = ["Collective", "ddp_grad_traffic", "loss_traffic", "representative_ranks"]

# Elements of the float64 row `_prepare` (losses/contrastive.py) all-gathers to
# agree on shapes, dtypes and options: 6 fixed columns + one per replicated scalar.
_PREPARE_COLUMNS = 6
_SCALARS = {"clip": 1, "siglip": 2, "nt_xent": 1, "info_nce": 1}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective (or a run of identical ones) of one step, as one rank sees it."""

    name: str
    """What it carries, e.g. "all_gather text embeddings"."""
    phase: str
    """"forward" or "backward"."""
    primitive: str
    """The c10d primitive: all_gather, all_to_all, all_reduce, p2p (ring shift)."""
    calls: int
    """How many calls this row sums (W - 1 for a ring's shifts)."""
    sent: int
    """Bytes this rank sends to other ranks (all calls)."""
    received: int
    """Bytes this rank receives from other ranks (all calls)."""
    steps: int
    """Sequential message rounds (for the latency term): W - 1 per ring collective, 1 per shift."""

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _gather(name: str, phase: str, sizes: Sequence[int], rank: int, row_bytes: int) -> Collective:
    splits = gather_splits(sizes, sizes[rank])
    sent, recv = wire_rows(splits, rank)
    uneven = len(set(sizes)) > 1
    return Collective(
        name=name, phase=phase, primitive="all_to_all" if uneven else "all_gather", calls=1,
        sent=sent * row_bytes, received=recv * row_bytes, steps=len(sizes) - 1,
    )  # fmt: skip


def _reduce_scatter(
    name: str, phase: str, sizes: Sequence[int], rank: int, row_bytes: int
) -> Collective:
    sent, recv = wire_rows(reduce_scatter_splits(sizes, rank), rank)
    return Collective(
        name=name, phase=phase, primitive="all_to_all", calls=1,
        sent=sent * row_bytes, received=recv * row_bytes, steps=len(sizes) - 1,
    )  # fmt: skip


def _all_reduce(name: str, phase: str, numel: int, elem: int, w: int, calls: int) -> Collective:
    moved = round(ring_all_reduce_elements(numel, w) * elem) * calls
    return Collective(
        name=name, phase=phase, primitive="all_reduce", calls=calls,
        sent=moved, received=moved, steps=2 * (w - 1) * calls,
    )  # fmt: skip


def _ring(
    name: str, phase: str, sizes: Sequence[int], rank: int, steps: range, row_bytes: int
) -> Collective:
    """Shifts by +1 at each ring step in `steps`, the block sizes of `ring_sizes` (SigmoidRing)."""
    sent = recv = calls = 0
    for step in steps:
        out_rows, in_rows = shift_splits(ring_sizes(sizes, step, lazy=True), rank, 1)
        sent += out_rows
        recv += in_rows
        calls += 1
    return Collective(
        name=name, phase=phase, primitive="p2p", calls=calls,
        sent=sent * row_bytes, received=recv * row_bytes, steps=calls,
    )  # fmt: skip


def loss_traffic(
    loss: str, sizes: Sequence[int], rank: int, dim: int, elem: int, acc: int
) -> list[Collective]:
    """The collectives of one forward + backward of `loss` on rank `rank` (none in a world of one).

    Args:
        loss: "clip", "siglip", "nt_xent" or "info_nce" (the one-directional
            form: a gather of the keys and row log-sum-exps only).
        sizes: every rank's rows B.
        rank: the rank to count for.
        dim: D.
        elem: bytes per element of the embeddings.
        acc: bytes per element of the kernels' compute dtype.
    """
    w = len(sizes)
    if w <= 1:
        return []
    n = sum(sizes)
    fwd, bwd = "forward", "backward"
    out = [
        _gather(
            "agree shapes, dtypes, options (float64 row)", fwd, [_PREPARE_COLUMNS + _SCALARS[loss]] * w,
            rank, 8,
        )
    ]  # fmt: skip
    if loss in ("clip", "info_nce"):
        out.append(_gather("all_gather text embeddings", fwd, sizes, rank, dim * elem))
        if loss == "clip":
            out.append(_all_reduce("combine column log-sum-exps (max, sum)", fwd, n, acc, w, 2))
    elif loss == "nt_xent":
        out.append(_gather("all_gather [z1 | z2]", fwd, sizes, rank, 2 * dim * elem))
        out.append(_all_reduce("combine row log-sum-exps (max, sum)", fwd, 2 * n, acc, w, 2))
    elif loss == "siglip":
        out.append(_ring("ring_shift text blocks", fwd, sizes, rank, range(w - 1), dim * elem))
    out.append(_all_reduce("whole-batch loss (sum of shares)", fwd, 1, acc, w, 1))
    out.append(_all_reduce("its gradient", bwd, 1, acc, w, 1))
    if loss == "clip":
        out.append(_all_reduce("column log-sum-exp gradient", bwd, n, acc, w, 1))
        out.append(_reduce_scatter("reduce-scatter text gradient", bwd, sizes, rank, dim * elem))
    elif loss == "info_nce":
        out.append(_reduce_scatter("reduce-scatter text gradient", bwd, sizes, rank, dim * elem))
    elif loss == "nt_xent":
        out.append(_all_reduce("row log-sum-exp gradient", bwd, 2 * n, acc, w, 1))
        out.append(_reduce_scatter("reduce-scatter [z1 | z2] gradient", bwd, sizes, rank, 2 * dim * elem))  # fmt: skip
    elif loss == "siglip":
        # The backward re-sends each block with its gradient ([block | grad], the
        # compute dtype) W - 1 times, then one last shift returns each gradient home.
        out.append(_ring("ring_shift [block | gradient]", bwd, sizes, rank, range(w - 1), 2 * dim * acc))  # fmt: skip
        out.append(_ring("ring_shift gradient home", bwd, sizes, rank, range(w - 1, w), dim * acc))  # fmt: skip
    return out


def ddp_grad_traffic(params: int, grad_elem: int, w: int) -> list[Collective]:
    """DDP's one gradient all-reduce per step (bucketed; a ring all-reduce of every parameter)."""
    if w <= 1 or params <= 0:
        return []
    return [
        _all_reduce("DDP gradient all-reduce (ring model)", "backward", params, grad_elem, w, 1)
    ]


def representative_ranks(sizes: Sequence[int]) -> list[int]:
    """The ranks whose counts bound every rank's: one rank for an even split; else the extremes.

    Bytes and memory depend on a rank's own rows (gather, reduce-scatter: the
    largest B sends most) and, around the ring, on its neighbours' (a rank sends
    every block but that of the rank after it: the rank before the smallest
    block sends most). Counting these few keeps the planner O(W).
    """
    w = len(sizes)
    if len(set(sizes)) <= 1:
        return [0]
    big = max(range(w), key=lambda r: sizes[r])
    small = min(range(w), key=lambda r: sizes[r])
    return sorted({big, (small - 1) % w})
