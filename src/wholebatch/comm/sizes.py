"""Size bookkeeping of the collectives, as pure functions: what each rank sends and receives.

The differentiable collectives (`wholebatch.comm.collectives`) and the ring
kernels (`wholebatch.losses.tiles`) take their split sizes from these
functions, and `wholebatch plan` counts bytes with the same functions for a
virtual world of any size, without starting a process: the planner's byte
counts come from the code paths the library runs, not from a second formula.

Nothing here imports torch. A `Splits` is one rank's view of one data-moving
call: rows it sends to each rank and rows it receives from each rank (index =
the peer's rank, this rank's own entry is a local copy that never reaches the
wire).

Wire bytes per rank (`wire_rows`): an all-to-all or a point-to-point shift
moves exactly the rows sent to other ranks. The ring algorithms of c10d's
native collectives (gloo, and NCCL's ring) move, per rank, (W-1)·B rows for an
all-gather or reduce-scatter of B rows per rank and 2·(W-1)/W of the tensor for
an all-reduce; `ring_all_reduce_elements` states that last one.

Legend: W ranks, B a rank's rows, N = sum of B over ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "Splits",
    "gather_splits",
    "reduce_scatter_splits",
    "ring_all_reduce_elements",
    "ring_block",
    "ring_sizes",
    "shift_splits",
    "wire_rows",
]


class Splits(NamedTuple):
    """One rank's rows per peer for one call: `send[j]` rows to rank j, `recv[j]` rows from rank j."""

    send: Sequence[int]
    recv: Sequence[int]


def gather_splits(sizes: Sequence[int], rows: int) -> Splits:
    """All-gather of `rows` rows by a rank, every rank's rows being `sizes`.

    The rank sends its `rows` rows to every rank (itself included, a local copy)
    and receives rank j's `sizes[j]` rows: W - 1 copies sent, N - B received,
    the ring minimum, whether c10d's all-gather (equal sizes) or an all-to-all
    (uneven sizes) carries it.
    """
    return Splits(send=[rows] * len(sizes), recv=list(sizes))


def reduce_scatter_splits(sizes: Sequence[int], rank: int) -> Splits:
    """Reduce-scatter of an N-row tensor into `sizes`: rank `rank` sends rank j its rows `sizes[j]`.

    It receives `sizes[rank]` rows from every rank and sums them locally (the
    all-to-all form wholebatch uses for uneven sizes, narrow wire dtypes and
    gloo); c10d's ring reduce-scatter moves the same rows per rank.
    """
    return Splits(send=list(sizes), recv=[sizes[rank]] * len(sizes))


def shift_splits(sizes: Sequence[int], rank: int, shift: int) -> tuple[int, int]:
    """(rows sent to rank + shift, rows received from rank - shift) in a ring shift by `shift`.

    `sizes` may be any sequence indexable in O(1) (a list, or a `ring_sizes` view).
    """
    return sizes[rank], sizes[(rank - shift) % len(sizes)]


def ring_block(sizes: Sequence[int], rank: int, step: int) -> int:
    """Rows of the block rank `rank` holds after `step` shifts by +1: rank `rank - step`'s."""
    return sizes[(rank - step) % len(sizes)]


class _RingView(Sequence[int]):
    """`ring_sizes(sizes, step)` without building the list: O(1) per element."""

    def __init__(self, sizes: Sequence[int], step: int) -> None:
        self._sizes, self._step = sizes, step

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, q: int) -> int:  # type: ignore[override]  # a view by index only (Sequence also takes slices)
        if not -len(self._sizes) <= q < len(self._sizes):
            raise IndexError(q)  # ends iteration, as a list's index does
        return ring_block(self._sizes, q, self._step)


def ring_sizes(sizes: Sequence[int], step: int, *, lazy: bool = False) -> Sequence[int]:
    """Rows each rank holds at ring step `step` (rank q holds rank q - step's block).

    With `lazy`, an O(1)-per-element view rather than a list of W entries, for
    a planner walking W - 1 steps of a virtual ring of 65,536 ranks.
    """
    view = _RingView(sizes, step)
    return view if lazy else [view[q] for q in range(len(sizes))]


def wire_rows(splits: Splits, rank: int) -> tuple[int, int]:
    """(rows sent to other ranks, rows received from other ranks): the rank's own entry stays local."""
    return sum(splits.send) - splits.send[rank], sum(splits.recv) - splits.recv[rank]


def ring_all_reduce_elements(numel: int, world_size: int) -> float:
    """Elements each rank sends (and receives) in a ring all-reduce of `numel` elements: 2·(W-1)/W·numel.

    A reduce-scatter then an all-gather, each moving (W-1)/W of the tensor. The
    exact count differs by the rounding of W chunks (gloo) and by tree or
    in-switch algorithms (NCCL at scale); this is the ring's bandwidth term.
    """
    if world_size <= 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * numel
