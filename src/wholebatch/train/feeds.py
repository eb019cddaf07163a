"""Replicas proven fed alike: a fingerprint of every micro-batch's inputs, agreed before the first forward.

On a device mesh, the ranks that replicate the batch (tensor parallel: the same
coordinate on every batch dim and on the pipeline dim) must be fed the same
micro-batches. A sampler or an augmentation seeded by the global rank breaks
that silently: tensor parallel's Rowwise all-reduce hands every replica the
same loss and the same count, so a check of counts and losses cannot see it,
and the replicas' shards of one layer are trained on different data while
their copies of the replicated parameters drift apart. Replica rows of
different shapes are worse: tensor parallel's own collectives abort the
process (gloo: "Received data size doesn't match").

So every engine (`Accumulator`, `CachedStep`, `GradCache` on a mesh,
`PipelineAccumulator`) adds this rank's fingerprint of its step's inputs to the
agreement it already makes before the first forward (`StepFinisher.begin`, or
`GradCache`'s own): no extra collective.

    row.update(feed_fields(split, micro_batches))      # before the first forward
    rows = agree_rows(row)                             # the engine's own all-gather
    check_feeds("Accumulator.step", split, rows, micro_batches)   # same error on every rank

The fingerprint of a step is, over the tensor leaves of every micro-batch (dicts,
lists, tuples, named tuples and dataclasses are walked; other objects are not
looked into), the number of leaves, a checksum of their paths, dtypes and shapes,
and four float64 sums: Σx, Σ|x|, Σx² and a position-weighted Σ u_i x_i (a shift
or a reordering of tokens moves it), each leaf weighted by its index (a swap of
micro-batches moves them too). O(input elements) on the device in about eight
kernels a step (the leaves concatenated), no host sync until the agreement is read. Integer inputs (token ids) are summed exactly up to
2**53.

When replicas differ (the rows are identical on every rank, so every rank
sees it), every rank takes the error path together: one text all-gather of each
rank's leaf paths, dtypes and shapes, and, when the replicas' structures agree,
one more all-gather of the per-leaf sums, so the error names the leaf and its
per-rank values. Those two collectives run only on the way to the error.

Legend: W processes of the mesh, K micro-batches, L tensor leaves of the step.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.agree import Field, Rows, agree_rows, exchange_text, ranks_text
from wholebatch.comm.groups import is_distributed
from wholebatch.comm.mesh import MeshSplit
from wholebatch.errors import WholebatchError

__all__ = ["check_fed_alike", "check_feeds", "feed_fields", "input_leaves", "needs_check"]

_PREFIX = "feed"
_STATS = ("sum", "abs", "sq", "pos")
# Position weights 1 + (i mod P): a prime period, so a shift or a permutation of rows
# of any length short of P moves the weighted sum.
_POS_PERIOD = 8191
# Replicas hold the same tensors, so their sums are computed with the same arithmetic
# and agree to the bit on one device type; allow 64 float64 epsilons of the magnitude
# (a different reduction order on another device), far below what other data moves.
_RTOL = 64 * torch.finfo(torch.float64).eps
_TEXT_BYTES = 16384  # per rank, on the error path only
_WORDS = {
    "sum": "sums",
    "abs": "sums of |x|",
    "sq": "sums of squares",
    "pos": "position-weighted sums",
}


def needs_check(split: MeshSplit | None) -> bool:
    """Whether `split` has replicas to compare (a replica dim of size > 1, on a distributed world)."""
    return (
        split is not None
        and any(split.sizes[d] > 1 for d in split.replica_dims)
        and is_distributed(None)
    )


def input_leaves(obj: object, path: str = "") -> Iterator[tuple[str, Tensor]]:
    """(path, tensor) for every tensor leaf of `obj`, in a fixed order.

    Mappings in their own order, sequences by index, dataclass instances by field;
    strings, numbers and other objects hold no leaves.
    """
    if isinstance(obj, Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from input_leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from input_leaves(value, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from input_leaves(getattr(obj, field.name), f"{path}.{field.name}")


def _local(x: Tensor) -> Tensor:
    to_local = getattr(x, "to_local", None)  # a DTensor input: this rank's piece
    return to_local() if callable(to_local) else x


def _leaf_stats(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(Σx, Σ|x|, Σx², Σ w_i x_i) of one leaf in float64, 0-d tensors on its device."""
    with torch.no_grad():
        t = _local(x).detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        flat = t.reshape(-1).to(torch.float64)
        w = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64)
        w = w.remainder_(_POS_PERIOD).add_(1)
        return flat.sum(), flat.abs().sum(), flat.square().sum(), (flat * w).sum()


def _describe(path: str, x: Tensor) -> str:
    dtype = str(x.dtype).removeprefix("torch.")
    return f"{path}|{dtype}|{tuple(int(s) for s in x.shape)}"


def _structure(leaves: Sequence[tuple[str, Tensor]]) -> list[str]:
    return [_describe(path, x) for path, x in leaves]


def _step_leaves(inputs: Mapping[str, object]) -> list[tuple[str, Tensor]]:
    return [leaf for name, obj in inputs.items() for leaf in input_leaves(obj, name)]


def feed_fields(split: MeshSplit | None, inputs: Mapping[str, object]) -> dict[str, Field]:
    """This rank's fingerprint of its step's inputs, for the engine's agreement before
    the first forward; {} when `split` has no replicas to compare (the same on every rank).

    `inputs` names what the step was fed (`{"micro_batches": mbs}`; a pipeline:
    `{"inputs": ..., "target": ...}`): errors name a tensor by its path under those names.
    Every rank of the mesh must add it to the same all-gather (over the whole mesh).
    """
    if not needs_check(split):
        return {}
    leaves = _step_leaves(inputs)
    layout = zlib.crc32(";".join(_structure(leaves)).encode())
    row: dict[str, Field] = {f"{_PREFIX} leaves": float(len(leaves)), f"{_PREFIX} layout": layout}
    totals: list[Tensor | float] = [0.0] * len(_STATS)
    by_device: dict[torch.device, list[tuple[int, Tensor]]] = {}
    for j, (_, x) in enumerate(leaves):
        t = _local(x)
        by_device.setdefault(t.device, []).append((j, t))
    for group in by_device.values():  # one pass over every leaf of a device: ~8 kernels a step
        for s, value in enumerate(_step_stats(group)):
            totals[s] = totals[s] + value
    for s, name in enumerate(_STATS):
        row[f"{_PREFIX} {name}"] = totals[s]
    return row


def _step_stats(leaves: list[tuple[int, Tensor]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The step's (Σ w_j x, Σ w_j |x|, Σ w_j x², Σ w_j u_i x) over `leaves` (index j, tensor)
    of one device, concatenated: w_j = j + 1 weighs leaf j, u_i = 1 + (i mod P) an element's
    position in the concatenation. float64, 0-d tensors on the device."""
    with torch.no_grad():
        parts = []
        for _, t in leaves:
            t = t.detach()
            parts.append((torch.view_as_real(t) if t.is_complex() else t).reshape(-1).double())
        flat = torch.cat(parts)
        sizes = torch.tensor([p.numel() for p in parts], device=flat.device)
        w = torch.tensor([float(j + 1) for j, _ in leaves], dtype=torch.float64, device=flat.device)
        w = w.repeat_interleave(sizes)
        u = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64)
        u = u.remainder_(_POS_PERIOD).add_(1)
        wx = flat * w
        return wx.sum(), wx.abs().sum(), (wx * flat).sum(), (wx * u).sum()


def _close(a: float, b: float, scale: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= _RTOL * scale


def _same(rows: Rows, a: int, b: int) -> bool:
    key = f"{_PREFIX} "
    if rows[key + "leaves"][a] != rows[key + "leaves"][b]:
        return False
    if rows[key + "layout"][a] != rows[key + "layout"][b]:
        return False
    scale = {
        "sum": max(rows[key + "abs"][a], rows[key + "abs"][b]),
        "abs": max(rows[key + "abs"][a], rows[key + "abs"][b]),
        "sq": max(rows[key + "sq"][a], rows[key + "sq"][b]),
    }
    scale["pos"] = scale["sum"] * _POS_PERIOD
    return all(_close(rows[key + s][a], rows[key + s][b], scale[s]) for s in _STATS)


def _first_mismatch(split: MeshSplit, rows: Rows) -> list[int] | None:
    """The first replica group (in rank order) whose members were fed differently, or None."""
    for group in split.replica_groups():
        if any(not _same(rows, group[0], other) for other in group[1:]):
            return list(group)
    return None


def check_feeds(op: str, split: MeshSplit | None, rows: Rows, inputs: Mapping[str, object]) -> None:
    """Raise the same `WholebatchError` on every rank when replicas were fed different inputs.

    `rows` is the engine's agreement (over the whole mesh) holding every rank's
    `feed_fields`; every rank must call it (the verdict is the same on every rank,
    and the error path's two exchanges are taken by every rank together).
    """
    if not needs_check(split):
        return
    assert split is not None
    group = _first_mismatch(split, rows)
    if group is None:
        return
    leaves = _step_leaves(inputs)
    raise WholebatchError(f"{op}: {_mismatch_text(split, rows, group, leaves)}")


def check_fed_alike(
    inputs: object,
    *,
    mesh: DeviceMesh,
    batch_dims: Sequence[str],
    pipeline_dim: str | None = None,
    op: str = "check_fed_alike",
) -> None:
    """Prove, in the user's own loop, that the replicas of `mesh` were fed the same `inputs`.

    A loss on a mesh sees only its embeddings, and tensor parallel's Rowwise
    all-reduce makes the replicas' embeddings equal whatever they were fed; so a loop
    that calls `clip_loss(..., mesh=mesh)` (or any loss) itself calls this on the
    step's inputs before the first forward. The engines do it for you.

    Every rank of `mesh` must call it: one all-gather of a small row (the same
    fingerprint the engines agree), and on a mismatch the same `WholebatchError` on
    every rank naming the ranks, the tensor and its per-rank shapes or sums. A world of
    one, or a mesh without replicas, returns at once.

    Args:
        inputs: what the step is fed (a tensor, or dicts / lists / tuples /
            dataclasses of them); errors name a tensor by its path under `inputs`.
        mesh: the device mesh, with named dims.
        batch_dims: the dims whose ranks hold different items (as for the losses).
        pipeline_dim: the pipeline-parallel dim, if any.
        op: the name errors begin with.
    """
    split = MeshSplit(mesh=mesh, batch_dims=tuple(batch_dims), pipeline_dim=pipeline_dim)
    if not needs_check(split):
        return
    named = {"inputs": inputs}
    rows = agree_rows(feed_fields(split, named))
    check_feeds(op, split, rows, named)


def _mismatch_text(
    split: MeshSplit, rows: Rows, group: list[int], leaves: list[tuple[str, Tensor]]
) -> str:
    """What differs between the replicas of `group` (every rank runs this, collectives included)."""
    mine = _structure(leaves)
    texts = exchange_text("\n".join(mine), max_bytes=_TEXT_BYTES)
    structures = {r: texts[r].split("\n") if texts[r] else [] for r in group}
    what = _structure_difference(structures, group)
    if what is None:
        what = _value_difference(rows, group, structures, leaves)
    differ = tuple(d for d in split.replica_dims if split.sizes[d] > 1)
    coords = tuple(split.batch_dims) + (
        (split.pipeline_dim,) if split.pipeline_dim is not None else ()
    )
    batch = "x".join(f"{d}" for d in split.batch_dims)
    return (
        f"ranks {group} replicate the same rows (the same coordinates on {coords}; they differ "
        f"only on {differ}) but were fed different inputs: {what}. Every rank of a "
        f"{'/'.join(differ)} group must get the same micro-batches: shard the data by the "
        f"mesh's {batch} coordinate, not by the global rank (e.g. DistributedSampler("
        f"num_replicas={split.batch_size}, rank=<this rank's batch index, "
        "MeshSplit(mesh=mesh, batch_dims=...).batch_index()>), and seed augmentations by it); "
        "or name the dim in batch_dims if its ranks are meant to hold different items "
        "(context parallel), or pass check_inputs=False if the inputs differ by design "
        "(a module that slices its own part of the shard)"
    )


def _shown(values: Mapping[int, str]) -> str:
    """`{0: (1, 8), 1: (1, 9)}`: per-rank texts as errors show them (no quotes)."""
    return "{" + ", ".join(f"{r}: {v}" for r, v in values.items()) + "}"


def _parse(line: str) -> tuple[str, str, str]:
    path, _, rest = line.partition("|")
    dtype, _, shape = rest.partition("|")
    return path, dtype, shape


def _structure_difference(structures: dict[int, list[str]], group: list[int]) -> str | None:
    """The first leaf whose path, dtype or shape differs among `group`, worded; None if none does."""
    first = group[0]
    for other in group[1:]:
        a, b = structures[first], structures[other]
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b):
                counts = {r: len(structures[r]) for r in group}
                extra = (b if len(b) > len(a) else a)[i]
                return f"input tensors per step {counts} (first unmatched: {_parse(extra)[0]})"
            if a[i] == b[i]:
                continue
            pa, da, _ = _parse(a[i])
            pb, db, _ = _parse(b[i])
            if pa != pb:
                paths = {r: _parse(structures[r][i])[0] for r in group if i < len(structures[r])}
                return f"input tensor {i} is at different places {_shown(paths)}"
            part = 1 if da != db else 2
            values = {r: _parse(structures[r][i])[part] for r in group if i < len(structures[r])}
            return f"{pa} has {'dtypes' if part == 1 else 'shapes'} {_shown(values)}"
    return None


def _value_difference(
    rows: Rows,
    group: list[int],
    structures: dict[int, list[str]],
    leaves: list[tuple[str, Tensor]],
) -> str:
    """The first leaf whose sums differ among `group` (one all-gather of per-leaf sums)."""
    width = max(1, max(int(n) for n in rows[f"{_PREFIX} leaves"]))
    per_leaf: list[list[Tensor | float]] = [[0.0] * width for _ in _STATS]
    for j, (_, x) in enumerate(leaves):
        for s, value in enumerate(_leaf_stats(x)):
            per_leaf[s][j] = value
    row: dict[str, Field] = {
        name: torch.stack([torch.as_tensor(v, dtype=torch.float64).cpu() for v in per_leaf[s]])
        for s, name in enumerate(_STATS)
    }
    table = agree_rows(row)
    stats = {name: table.vectors(name) for name in _STATS}
    first = group[0]
    for j in range(width):
        for other in group[1:]:
            a, b = first, other
            scale = {
                "sum": max(abs(stats["abs"][a][j]), abs(stats["abs"][b][j])),
                "abs": max(abs(stats["abs"][a][j]), abs(stats["abs"][b][j])),
                "sq": max(stats["sq"][a][j], stats["sq"][b][j]),
            }
            scale["pos"] = scale["sum"] * _POS_PERIOD
            for stat in _STATS:
                if not _close(stats[stat][a][j], stats[stat][b][j], scale[stat]):
                    path, dtype, shape = _parse(structures[first][j])
                    values = [per_rank[j] for per_rank in stats[stat]]
                    shown = ranks_text(values, group)
                    return f"{path} ({dtype}, shape {shape}) has {_WORDS[stat]} {shown}"
    return "the fingerprints differ (no single tensor's sums do: a reordering of tensors)"
