"""Bytes each rank sends and receives per step, collective by collective, from the library's own size bookkeeping.

Every count here walks the sequence of collectives a loss issues (read off
`wholebatch.losses.call`, the loss modules and their kernels; the tests
count the real calls on gloo and compare, every rank, every primitive) and
takes each call's split sizes from `wholebatch.comm.sizes` and the exchange's
row from `wholebatch.losses.sizing`, the functions the collectives and the
losses themselves call. So a count at W = 65,536 runs the same bookkeeping as
a real run, for one virtual rank, without a process.

Every loss call on W > 1 ranks (losses/call.py `validate`, `Call.choose` and `Call.whole`):

- the exchange (unless the caller passes `sizes=` with `check=False`): an
  all-gather of one float64 row per rank, `specs.exchange_fields(spec)` long
  (header, per-rank numbers, options, the sizes= fingerprint, scalars): the same
  length at any W, and nothing else; a call's bytes depend on its own sizes only;
- the agreement: after the exchange none in the forward (it checked the
  scalars equal), backward one all-reduce of the scalars' gradients; without
  it an all-reduce (max) of the scalars and the reduction code, backward one
  all-reduce of twice that (the gradient and the tie count);
- the whole-batch sum: an all-reduce of one element; backward the same.

A small batch (`wholebatch.losses.sizing.choose`, losses/small.py) makes instead
the exchange (if it runs) and ONE all-gather of every rank's rows of all its
embeddings (B·R·e bytes per rank, R = (2 + k)·D, plus the agreement's float64
row of the scalars and the reduction code without the exchange); and backward
one all-reduce of one element (the upstream gradient of L, its mean).

Legend: W ranks, N global rows, B a rank's rows, D embedding dim, k hard
negatives per query; e the embeddings' element size, a the kernels' compute
element size (float32 for 16-bit inputs), `sizes` every rank's B.
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
from wholebatch.losses.sizing import replicates, small_rows, stats_gathered
from wholebatch.losses.specs import SPECS, LossSpec, exchange_fields

__all__ = [
    "SCALARS",
    "Collective",
    "ddp_grad_traffic",
    "engine_row_traffic",
    "gather_traffic",
    "loss_traffic",
    "mesh_grad_traffic",
    "positive_ring_traffic",
    "representative_ranks",
    "ring_traffic",
]

# Replicated scalars each loss agrees on (its descriptor's; clip without a logit_bias).
SCALARS = {name: len(s.scalars) for name, s in SPECS.items()}


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
    dims: str = ""
    """On a mesh, the dims whose ranks it runs over (e.g. "dp x cp"); "": the flat world."""

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _gather(name: str, phase: str, sizes: Sequence[int], rank: int, row_bytes: int) -> Collective:
    splits = gather_splits(sizes, sizes[rank])
    sent, recv = wire_rows(splits, rank)
    uneven = len(set(sizes)) > 1
    return Collective(
        name=name,
        phase=phase,
        primitive="all_to_all" if uneven else "all_gather",
        calls=1,
        sent=sent * row_bytes,
        received=recv * row_bytes,
        steps=len(sizes) - 1,
    )


def _reduce_scatter(
    name: str, phase: str, sizes: Sequence[int], rank: int, row_bytes: int
) -> Collective:
    sent, recv = wire_rows(reduce_scatter_splits(sizes, rank), rank)
    return Collective(
        name=name,
        phase=phase,
        primitive="all_to_all",
        calls=1,
        sent=sent * row_bytes,
        received=recv * row_bytes,
        steps=len(sizes) - 1,
    )


def _all_reduce(name: str, phase: str, numel: int, elem: int, w: int, calls: int) -> Collective:
    moved = round(ring_all_reduce_elements(numel, w) * elem) * calls
    return Collective(
        name=name,
        phase=phase,
        primitive="all_reduce",
        calls=calls,
        sent=moved,
        received=moved,
        steps=2 * (w - 1) * calls,
    )


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
        name=name,
        phase=phase,
        primitive="p2p",
        calls=calls,
        sent=sent * row_bytes,
        received=recv * row_bytes,
        steps=calls,
    )


def gather_traffic(what: str, sizes: Sequence[int], rank: int, row_bytes: int) -> list[Collective]:
    """`what` all-gathered in the forward and its gradient reduce-scattered in the backward."""
    return [
        _gather(f"all_gather {what}", "forward", sizes, rank, row_bytes),
        _reduce_scatter(f"reduce-scatter {what} gradient", "backward", sizes, rank, row_bytes),
    ]


def ring_traffic(
    what: str, sizes: Sequence[int], rank: int, width: int, elem: int, acc: int
) -> list[Collective]:
    """`SigmoidRing`'s schedule for blocks of `width` elements per row.

    Forward: W - 1 shifts of the blocks (the embeddings' dtype). Backward: W - 1
    shifts of each block (its dtype) with its gradient (the compute dtype), then
    one more that returns each gradient to its owner.
    """
    w = len(sizes)
    return [
        _ring(f"ring_shift {what}", "forward", sizes, rank, range(w - 1), width * elem),
        _ring(
            "ring_shift block and gradient",
            "backward",
            sizes,
            rank,
            range(w - 1),
            width * (elem + acc),
        ),
        _ring("ring_shift gradient home", "backward", sizes, rank, range(w - 1, w), width * acc),
    ]


def loss_traffic(
    loss: str,
    sizes: Sequence[int],
    rank: int,
    dim: int,
    elem: int,
    acc: int,
    *,
    negatives: int = 0,
    directions: Sequence[str] = ("query_to_doc",),
    exchange: bool = True,
    strategy: str = "gather",
    small: int | None = None,
    classes: int = 0,
    tokens: tuple[int, int] = (0, 0),
) -> list[Collective]:
    """The collectives of one forward + backward of `loss` on rank `rank` (none in a world of one).

    Args:
        loss: a key of `SPECS`.
        sizes: every rank's rows B (queries, for info_nce).
        rank: the rank to count for.
        dim: D.
        elem: bytes per element of the embeddings.
        acc: bytes per element of the kernels' compute dtype.
        negatives: info_nce's k hard negatives per query.
        directions: info_nce's directions (holding "query_to_doc").
        exchange: the losses' metadata exchange runs (False: `sizes=` with `check=False`).
        strategy: "gather" or "ring" (resolved: what the loss runs; siglip always rings).
        small: the small-batch row limit (`sizing.small_rows`; None: this process's).
        classes: supcon's labels that have a positive (0: N // 2, the most there can be).
        tokens: maxsim's (query, document) tokens per row.
    """
    w = len(sizes)
    if w <= 1:
        return []
    spec = SPECS[loss]
    fwd, bwd = "forward", "backward"
    scalars = len(spec.scalars)
    decides, row_bytes = small_rows_of(spec, sum(sizes), dim, elem, negatives, tokens)
    limit = small_rows() if small is None else small
    if spec.replicable(strategy) and replicates(sum(sizes), decides, elem, limit):
        return _replicated_traffic(spec, sizes, rank, row_bytes, exchange, acc)
    stats: list[Collective] = []
    if spec.kernel == "tokens":
        moves = _token_moves(spec, sizes, rank, dim, elem, acc, strategy, tokens)
    elif strategy == "ring" and spec.kernel in ("positive", "symmetric"):
        moves = _positive_rings(spec, sizes, rank, dim, elem, acc, negatives, directions)
    else:
        moves, stats = _moves(spec, sizes, rank, dim, elem, acc, negatives, directions)
    if spec.name == "supcon":  # the labels, agreed rows; the label sums, chunk by chunk
        moves += _label_sums(sizes, rank, dim, acc, classes or sum(sizes) // 2)
    out = []
    if exchange:  # the exchange checks the scalars equal: no forward agreement
        out.append(_exchange(spec, w, rank))
    else:
        out.append(_all_reduce("agree scalars, reduction (max)", fwd, scalars + 1, acc, w, 1))
    out += [x for x in moves + stats if x.phase == fwd]
    out.append(_all_reduce("whole-batch loss (sum of shares)", fwd, 1, acc, w, 1))
    out.append(_all_reduce("its gradient", bwd, 1, acc, w, 1))
    out += [x for x in stats + moves if x.phase == bwd]
    if exchange:  # the replicated scalars' gradients, averaged over ranks
        out.append(_all_reduce("scalars' gradients (mean)", bwd, scalars, acc, w, 1))
    else:  # the agreement's backward: the scalars' gradients and their tie counts, summed
        out.append(_all_reduce("scalars' gradients (and ties)", bwd, 2 * (scalars + 1), acc, w, 1))
    return out


def small_rows_of(
    spec: LossSpec, n: int, dim: int, elem: int, negatives: int, tokens: tuple[int, int]
) -> tuple[int, int]:
    """(elements per row that decide the small path, bytes per row it gathers), as the losses
    count them: every embedding's row; maxsim's dense N x N x Q x T similarities too (and its
    masks, a byte per token); supcon's labels, 8 bytes per row."""
    if spec.kernel == "tokens":
        q, t = tokens
        return max((q + t) * dim, n * q * t), (q + t) * dim * elem + q + t
    elements = spec.embeddings_per_row(negatives) * dim
    return elements, elements * elem + (8 if spec.name == "supcon" else 0)


def _label_sums(
    sizes: Sequence[int], rank: int, dim: int, acc: int, classes: int
) -> list[Collective]:
    """supcon: its labels all-gathered (int64), then the sums of the `classes` labels that have
    a positive, all-reduced max(B) labels at a time (backward: the same all-reduces)."""
    w, chunk = len(sizes), max(max(sizes), 1)
    out = [_gather("all_gather labels", "forward", sizes, rank, 8)]
    for phase in ("forward", "backward"):
        for c0 in range(0, classes, chunk):
            rows = min(chunk, classes - c0)
            out.append(_all_reduce(f"label sums ({phase})", phase, rows * dim, acc, w, 1))
    return out


def _token_moves(
    spec: LossSpec,
    sizes: Sequence[int],
    rank: int,
    dim: int,
    elem: int,
    acc: int,
    strategy: str,
    tokens: tuple[int, int],
) -> list[Collective]:
    """maxsim's document blocks (T x D and their masks, a byte per token): all-gathered
    (their gradient reduce-scattered), or around the ring (`late.MaxSimRing`)."""
    t = tokens[1]
    if strategy == "ring":
        w = len(sizes)
        steps = range(w - 1)
        return [
            _ring(f"ring_shift {spec.keys}", "forward", sizes, rank, steps, t * dim * elem + t),
            _ring(
                "ring_shift block and gradient",
                "backward",
                sizes,
                rank,
                steps,
                t * dim * (elem + acc) + t,
            ),
            _ring(
                "ring_shift gradient home", "backward", sizes, rank, range(w - 1, w), t * dim * acc
            ),
        ]
    return [
        *gather_traffic(spec.keys, sizes, rank, t * dim * elem),
        _gather("all_gather document masks", "forward", sizes, rank, t),
    ]


def _exchange(spec: LossSpec, w: int, rank: int) -> Collective:
    """The exchange: every rank's float64 row (`specs.exchange_fields`), nothing else."""
    name = "agree shapes, dtypes, options (float64 row)"
    return _gather(name, "forward", [1] * w, rank, 8 * len(exchange_fields(spec)))


def _replicated_traffic(
    spec: LossSpec,
    sizes: Sequence[int],
    rank: int,
    row_bytes: int,
    exchange: bool,
    acc: int,
) -> list[Collective]:
    """The small path's collectives: the exchange (if it runs), one all-gather of raw bytes;
    backward, the upstream gradient's mean."""
    w = len(sizes)
    out = []
    head = 0
    if exchange:
        out.append(_exchange(spec, w, rank))
    else:  # the agreement's float64 row rides with the rows: the scalars and the reduction code
        head = 8 * (len(spec.scalars) + 1)
    payload = [b * row_bytes + head for b in sizes]
    out.append(_gather("all_gather whole batch (every embedding)", "forward", payload, rank, 1))
    out.append(_all_reduce("upstream gradient of L (mean)", "backward", 1, acc, w, 1))
    return out


def _moves(
    spec: LossSpec,
    sizes: Sequence[int],
    rank: int,
    dim: int,
    elem: int,
    acc: int,
    negatives: int,
    directions: Sequence[str],
) -> tuple[list[Collective], list[Collective]]:
    """(the embeddings' own traffic, the kernels' log-sum-exp statistics and their gradients)."""
    w, n = len(sizes), sum(sizes)
    bwd = "backward"
    width = spec.key_rows(negatives) * dim
    if spec.kernel == "sigmoid":
        return ring_traffic(spec.keys, sizes, rank, width, elem, acc), []
    moves = gather_traffic(spec.keys, sizes, rank, width * elem)
    stats: list[Collective] = []
    if spec.kernel == "symmetric":
        m = spec.views * n
        stats = [
            _combine_stats("combine row log-sum-exps (max, sum)", m, rank, acc, w),
            _all_reduce("row log-sum-exp gradient", bwd, m, acc, w, 1),
        ]
    if "query_to_query" in directions:
        moves += gather_traffic("queries", sizes, rank, dim * elem)
    if spec.has_columns(directions):
        # column statistics combined over ranks; their gradients all-gathered (B floats each)
        stats = [
            _combine_stats("combine column log-sum-exps (max, sum)", n, rank, acc, w),
            _gather("all_gather column gradients", bwd, sizes, rank, acc),
        ]
    return moves, stats


def _combine_stats(name: str, rows: int, rank: int, acc: int, w: int) -> Collective:
    """`tiles._combine`: one all-gather of the (max, sum) pairs while small, else 2 all-reduces."""
    if stats_gathered(rows, w, acc):
        return _gather(name, "forward", [rows] * w, rank, 2 * acc)
    return _all_reduce(name, "forward", rows, acc, w, 2)


def positive_ring_traffic(
    what: str, sizes: Sequence[int], rank: int, width: int, elem: int, acc: int, columns: bool
) -> list[Collective]:
    """`PositiveRing`'s schedule (losses/ring.py) for key blocks of `width` elements per row.

    Forward: W - 1 shifts of the blocks (the embeddings' dtype); with `columns`,
    each followed by a shift of the block's column statistics (2 compute
    elements per row), and one more that takes them home. Backward: W - 1
    shifts of each block with its column coefficients, each followed by one of
    its accumulated gradient (the compute dtype), and one more that returns each
    gradient to its owner. The ring sends each block in chunks, each with its
    statistics, coefficients or gradient: the same bytes per shift.
    """
    w = len(sizes)
    steps, home = range(w - 1), range(w - 1, w)
    stat = 2 * acc if columns else 0
    out = [_ring(f"ring_shift {what}", "forward", sizes, rank, steps, width * elem)]
    if columns:
        out += [
            _ring("ring_shift column statistics", "forward", sizes, rank, steps, stat),
            _ring("ring_shift column statistics home", "forward", sizes, rank, home, stat),
        ]
    return [
        *out,
        _ring(
            f"ring_shift {what} (and column coefficients)",
            "backward",
            sizes,
            rank,
            steps,
            width * elem + stat,
        ),
        _ring("ring_shift accumulated key gradient", "backward", sizes, rank, steps, width * acc),
        _ring("ring_shift key gradient home", "backward", sizes, rank, home, width * acc),
    ]


def _positive_rings(
    spec: LossSpec,
    sizes: Sequence[int],
    rank: int,
    dim: int,
    elem: int,
    acc: int,
    negatives: int,
    directions: Sequence[str],
) -> list[Collective]:
    """The rings of a softmax loss with `strategy="ring"`: one per sweep (losses/info_nce.py);
    two views (dcl): each view's rows sweep the [a | b] blocks, two rings."""
    width = spec.key_rows(negatives) * dim
    cols = spec.has_columns(directions)
    out = positive_ring_traffic(spec.keys, sizes, rank, width, elem, acc, cols)
    if spec.views > 1:
        out += positive_ring_traffic(
            f"{spec.keys} (second views)", sizes, rank, width, elem, acc, cols
        )
    if "query_to_query" in directions:
        out += positive_ring_traffic("queries", sizes, rank, dim, elem, acc, False)
    if "doc_to_doc" in directions:
        out += positive_ring_traffic(
            f"{spec.keys} for doc_to_doc", sizes, rank, width, elem, acc, False
        )
    return out


def ddp_grad_traffic(params: int, grad_elem: int, w: int) -> list[Collective]:
    """DDP's one gradient all-reduce per step (bucketed; a ring all-reduce of every parameter)."""
    if w <= 1 or params <= 0:
        return []
    return [
        _all_reduce("DDP gradient all-reduce (ring model)", "backward", params, grad_elem, w, 1)
    ]


def mesh_grad_traffic(
    params: float,
    grad_elem: int,
    param_elem: int,
    shard: int,
    replicate: int,
    *,
    shard_dims: str,
    replicate_dims: str,
) -> list[Collective]:
    """The data-parallel collectives of one step on a mesh, for a rank holding `params` (its
    tp/pp part): FSDP2 over the `shard` ranks (dp x cp), then DDP / HSDP over `replicate`.

    FSDP2 (shard > 1): the parameters all-gathered in the forward and again in the
    backward (reshard_after_forward=True, its default), the gradients reduce-scattered
    once (ring model: each moves (S - 1)/S of the tensor per rank). The replicate dim
    (replicate > 1): one ring all-reduce of the rank's gradient shard (params / S).
    tp adds none (a DTensor's gradient is whole on its shard) and pp none (stages own
    their parameters).
    """
    out: list[Collective] = []
    if params <= 0:
        return out
    if shard > 1:
        part = (shard - 1) / shard * params
        gathered, reduced = round(part * param_elem), round(part * grad_elem)
        for phase, what in (("forward", "forward"), ("backward", "backward re-gather")):
            out.append(
                Collective(
                    name=f"FSDP2 parameter all-gather ({what})",
                    phase=phase,
                    primitive="all_gather",
                    calls=1,
                    sent=gathered,
                    received=gathered,
                    steps=shard - 1,
                    dims=shard_dims,
                )
            )
        out.append(
            Collective(
                name="FSDP2 gradient reduce-scatter",
                phase="backward",
                primitive="reduce_scatter",
                calls=1,
                sent=reduced,
                received=reduced,
                steps=shard - 1,
                dims=shard_dims,
            )
        )
    if replicate > 1:
        what = "HSDP gradient all-reduce of the shard" if shard > 1 else "DDP gradient all-reduce"
        row = _all_reduce(
            f"{what} (ring model)", "backward", round(params / shard), grad_elem, replicate, 1
        )
        out.append(dataclasses.replace(row, dims=replicate_dims))
    return out


def engine_row_traffic(fields: dict[str, int], w: int, dims: str) -> list[Collective]:
    """An engine's agreement rows: one all-gather of a float64 row per rank, per row, over `w`
    ranks (`fields`: {"begin": its length, "finish": its length}; see `planner.mesh`)."""
    if w <= 1:
        return []
    names = {
        "begin": ("agree K and the normalisation table (float64 row)", "forward"),
        "finish": ("agree N, loss, flags; replicas checked (float64 row)", "backward"),
    }
    out = []
    for key, n in fields.items():
        name, phase = names[key]
        row = _gather(name, phase, [n] * w, 0, 8)
        out.append(dataclasses.replace(row, dims=dims))
    return out


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
