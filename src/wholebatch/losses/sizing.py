"""Pure bookkeeping of the losses (no torch): the tile size, the ring's chunks, which path a call takes.

The losses (`wholebatch.losses.call`, the kernels) take these from here, and
`wholebatch plan` reads them without loading torch, so the planner's tile, its
chunks and its choice of path come from the code the losses run, not from a
second copy.

Legend: W ranks, T the tile size (rows and columns of one logits tile).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wholebatch.losses.specs import LossSpec

__all__ = [
    "ACCEL_TILE_BUDGET",
    "AUTO_RING_BYTES",
    "CPU_TILE",
    "SMALL_GATHER_BYTES",
    "SMALL_ROWS",
    "STATS_GATHER_BYTES",
    "TILE_BUFFERS",
    "auto_strategy",
    "choose",
    "replicates",
    "ring_chunk_rows",
    "set_small_rows",
    "sizes_fingerprint",
    "small_rows",
    "stats_gathered",
    "tile_size_for",
    "using_small_rows",
]

CPU_TILE = 512
# Accelerators: the tile buffers of one step (the logits tile, its exponentials,
# the gradient tile) live at once; float32 each.
TILE_BUFFERS = 3
ACCEL_TILE_BUDGET = 2**30  # bytes for those buffers: 1 GiB (T = 9,216)
_TILE_QUANTUM = 256  # accelerator tiles are multiples of this (matrix-unit friendly)

# strategy="auto" rings when the keys a gather would hold on every rank (N·J·D
# elements of the embeddings' dtype) pass this many bytes; below it, it gathers
# (the gather's time was measured no worse on CPU; docs/contrastive.md).
AUTO_RING_BYTES = 2**30


def auto_strategy(gathered_bytes: int) -> str:
    """What strategy="auto" runs when a gather would hold `gathered_bytes` of keys per rank."""
    return "ring" if gathered_bytes > AUTO_RING_BYTES else "gather"


# Per-row (max, sum) statistics of every rank are combined with one all-gather of the
# pairs while each rank would receive at most this many bytes, else with two
# all-reduces (max, then the rescaled sums): at small batches a collective's latency,
# not its bytes, sets the cost (benchmarks/RESULTS.md, small batches).
STATS_GATHER_BYTES = 2**16


def stats_gathered(rows: int, world: int, elem: int) -> bool:
    """Whether `rows` (max, sum) pairs of `elem`-byte floats are combined by one all-gather."""
    return (world - 1) * 2 * rows * elem <= STATS_GATHER_BYTES


# Small batches (losses/small.py): while the whole batch has at most this many
# rows (and its gathered rows fit `SMALL_GATHER_BYTES`), every rank gathers every
# rank's rows in one all-gather and computes the whole loss itself, with no other
# collective forward or backward. At 8-64 rows per rank a call is latency: each
# collective costs ~0.3-1 ms on 2 CPU ranks, the whole N x N logits far less
# (benchmarks/RESULTS.md, "small batches"). 512 rows: the logits are one CPU tile.
SMALL_ROWS = 512
SMALL_GATHER_BYTES = 2**24  # 16 MiB of gathered rows per rank
_SMALL_ENV = "WHOLEBATCH_SMALL_ROWS"
_small_override: int | None = None


def set_small_rows(rows: int | None) -> None:
    """Set this process's small-batch row limit (0: never; None: back to the default).

    The default is ``WHOLEBATCH_SMALL_ROWS`` from the environment, else `SMALL_ROWS`
    (512). With the cross-rank checks on, the limit rides in the losses' exchange
    and the smallest over ranks applies, so ranks always take the same path; with
    `sizes=` and `check=False` set it the same on every rank.
    """
    global _small_override
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
        raise ValueError(f"set_small_rows: rows={rows!r} must be a non-negative int or None")
    _small_override = rows


@contextlib.contextmanager
def using_small_rows(rows: int | None) -> Iterator[None]:
    """`set_small_rows(rows)` inside the block, the previous setting after it."""
    global _small_override
    before = _small_override
    set_small_rows(rows)
    try:
        yield
    finally:
        _small_override = before


def small_rows() -> int:
    """This process's small-batch row limit (`set_small_rows`, ``WHOLEBATCH_SMALL_ROWS``, 512)."""
    if _small_override is not None:
        return _small_override
    raw = os.environ.get(_SMALL_ENV, "").strip()
    return int(raw) if raw.isdigit() else SMALL_ROWS


def replicates(n: int, row_elements: int, elem: int, limit: int) -> bool:
    """Whether a call over `n` rows of `row_elements` elements (`elem` bytes each) takes the small path.

    `limit` is the agreed row limit (`small_rows`, the smallest over ranks). Pure:
    the losses and `wholebatch plan` decide with the same function.
    """
    return 0 < n <= limit and n * row_elements * elem <= SMALL_GATHER_BYTES


def choose(
    loss: LossSpec,
    strategy: str,
    n: int,
    row_elements: int,
    key_elements: int,
    elem: int,
    limit: int,
) -> str:
    """The path a call takes: "small", "gather" or "ring" (the call path's *choose* stage).

    From agreed numbers only, so every rank chooses alike: the spec, the agreed
    `strategy`, N, a row's elements over every embedding (`row_elements`, the small
    path gathers them) and over the keys a gather would hold (`key_elements`), the
    element size and the agreed small-batch row limit (the smallest over ranks).
    """
    if loss.replicable(strategy) and replicates(n, row_elements, elem, limit):
        return "small"
    if strategy == "auto":
        return auto_strategy(n * key_elements * elem)
    return strategy


def ring_chunk_rows(device_type: str, rows: int, keys_per_row: int) -> int:
    """Rows of a key block per message of the softmax rings (`ring.PositiveRing`).

    About one tile of candidates, the tile the device would choose for the
    largest block (`rows`: the largest rank's rows, agreed): the same on every
    rank whatever tile size each rank passes, so sender and receiver always cut a
    block alike (a rank's own `tile_size` only tiles its own arithmetic).
    """
    cols = max(rows, 1) * keys_per_row
    return max(1, tile_size_for(device_type, cols, cols) // keys_per_row)


def tile_size_for(
    device_type: str, rows: int, cols: int, *, budget_bytes: int | None = None
) -> int:
    """The tile side T for a `rows` x `cols` logits sweep on `device_type` (a pure function).

    CPU: `CPU_TILE` (512): on CPU a tile's elementwise passes cost as much as
    its product, larger tiles measured no faster (benchmarks/RESULTS.md), and
    512 keeps the tile buffers at 1 MiB each. With `budget_bytes`, no larger
    than the budget allows.

    Accelerators (cuda, xpu, ...): as large as the memory budget allows
    (`TILE_BUFFERS` float32 T x T buffers within `budget_bytes`, default
    `ACCEL_TILE_BUDGET` = 1 GiB: T = 9,216), a multiple of 256, and no larger
    than the sweep itself: each tile is a handful of kernel launches, so
    fewer, larger tiles keep the launches negligible next to the work (at
    N = 65,536 a sweep is 64 tiles; at 262,144, 841).

    Args:
        device_type: "cpu", "cuda", ... (`tensor.device.type`).
        rows: rows of the logits swept (this rank's queries).
        cols: columns swept (the candidates).
        budget_bytes: bytes the tile buffers may use.
    """
    if device_type == "cpu":
        if budget_bytes is None:
            return CPU_TILE
        return max(1, min(CPU_TILE, math.isqrt(budget_bytes // (4 * TILE_BUFFERS))))
    budget = ACCEL_TILE_BUDGET if budget_bytes is None else budget_bytes
    t = math.isqrt(max(budget, 0) // (4 * TILE_BUFFERS))
    t = max(_TILE_QUANTUM, t // _TILE_QUANTUM * _TILE_QUANTUM)
    longest = max(rows, cols, 1)
    return min(t, -(-longest // _TILE_QUANTUM) * _TILE_QUANTUM)


# A prime below 2^52: every fingerprint is an integer a float64 holds exactly.
_FINGERPRINT_PRIME = 4503599627370449
_FINGERPRINT_BASE = 1_000_003


def sizes_fingerprint(sizes: list[int] | tuple[int, ...]) -> float:
    """A per-rank row-count list folded into one exact float64 (a polynomial hash mod a prime).

    The exchange carries this instead of the list, so its row stays the same
    length at any W; every rank compares each rank's fingerprint with that of
    the row counts the ranks actually pass. Two different lists of the same
    length collide with probability about W / 2^52.
    """
    h = len(sizes) % _FINGERPRINT_PRIME
    for v in sizes:
        h = (h * _FINGERPRINT_BASE + int(v) + 1) % _FINGERPRINT_PRIME
    return float(h)
