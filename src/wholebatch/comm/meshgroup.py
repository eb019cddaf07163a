"""A loss's `mesh=`/`batch_dims=`: the batch dims' group, cached, and the replicas' rows checked.

The whole-batch losses and `GradCache` gather over the ranks that hold
*different* rows. On a device mesh those are the batch dims' ranks
(`wholebatch.comm.mesh.MeshSplit.batch_group`); the ranks that replicate the
batch (tensor parallel: the same coordinate on every batch dim) each run the
same loss on the same rows with their own batch group:

    group, split = resolve_group(None, mesh, ("dp",), "clip_loss")   # mesh["dp"]'s group
    with replicas_agree("clip_loss", split, {"image_BD": x, "text_BD": y}):
        ...                                                          # the loss's own exchange

`resolve_group` validates the arguments (from the arguments alone: the same
error on every rank) and builds the batch dims' group once per mesh and batch
dims: flattening several dims creates process groups, which a call in the
training loop must not do every step. The cache holds neither the mesh nor the
group: an entry goes when its mesh is freed, and a group that
`destroy_process_group` freed is built again (`_BatchGroups`).

`replicas_agree` checks that replicas really hold the same rows. Each rank
contributes a fingerprint of its embeddings (rows, and per tensor the sum, the
sum of absolute values, the sum of squares and a row-position-weighted sum: a
permutation of the rows changes it), O(B·D) on the device, no host sync until
the agreement is read. Only a mesh with a replica dim of size > 1 has anything
to check: then one all-gather over the mesh (every process: the error is the
same on every rank) starts before the body and is read after it, overlapping
the loss's own exchange, which runs over the batch group and so never sees the
replicas. Without a replica dim nothing is communicated.

Legend: W processes of the mesh, B this rank's rows, D embedding dim.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.agree import Field, PendingRows, Rows, ranks_text, start_rows
from wholebatch.comm.groups import is_distributed
from wholebatch.comm.mesh import MeshSplit
from wholebatch.errors import WholebatchError, WholebatchTypeError

__all__ = [
    "FINGERPRINT_STATS",
    "check_replicas",
    "fingerprint_fields",
    "has_replicas",
    "replicas_agree",
    "resolve_group",
    "resolve_split",
]

FINGERPRINT_STATS: tuple[str, ...] = ("sum", "abs", "sq", "pos")
"""Per tensor: Σx, Σ|x|, Σx², Σ_i w_i Σ_j x_ij with w_i = 1 + i mod 7 (row order)."""

# Replicas compute their embeddings with the same arithmetic, and the all-reduces
# of tensor parallelism hand every rank the same bits; a non-deterministic kernel may
# still differ by round-off. Allow that much, relative to the magnitude (Σ|x|, Σx²):
# 64 epsilons of the dtype, at most 1e-4 (bfloat16's epsilon would hide real data).
# Rows that really differ move a statistic by O(1) of it (Σx² of n random values by
# about sqrt(2 / n): 5e-3 at n = 1e5).
_ROUNDOFF_EPS = 64.0
_ROUNDOFF_MAX = 1e-4
_POS_WEIGHTS = 7


class _BatchGroups:
    """Per mesh (by identity, held weakly) and batch dims, a weak reference to the batch group.

    A `DeviceMesh` compares equal to another of the same layout (a mesh built again
    after `destroy_process_group` and a new `init_process_group`), so the key is the
    object itself: its id, checked against a weak reference to it, and the entry
    removed when the mesh is freed (before its id can be reused). The group is held
    weakly too: once destroyed and freed, the next call builds the new world's.
    """

    def __init__(self) -> None:
        self._by_mesh: dict[int, tuple[weakref.ref[DeviceMesh], dict[Any, weakref.ref[Any]]]] = {}

    def get(self, mesh: DeviceMesh, dims: tuple[str, ...]) -> ProcessGroup | None:
        entry = self._by_mesh.get(id(mesh))
        if entry is None or entry[0]() is not mesh:
            return None
        ref = entry[1].get(dims)
        return None if ref is None else ref()

    def put(self, mesh: DeviceMesh, dims: tuple[str, ...], group: ProcessGroup) -> None:
        key = id(mesh)
        entry = self._by_mesh.get(key)
        if entry is None or entry[0]() is not mesh:
            entry = (weakref.ref(mesh, lambda _: self._by_mesh.pop(key, None)), {})
            self._by_mesh[key] = entry
        entry[1][dims] = weakref.ref(group)

    def __len__(self) -> int:
        return len(self._by_mesh)


_GROUPS = _BatchGroups()


def _renamed(op: str, err: WholebatchError) -> WholebatchError:
    text = str(err)
    if text.startswith("MeshSplit: "):
        text = f"{op}: {text[len('MeshSplit: ') :]}"
    return type(err)(text)


def resolve_split(
    op: str, group: object, mesh: DeviceMesh | None, batch_dims: Sequence[str] | None
) -> tuple[MeshSplit, ProcessGroup] | None:
    """(the split, its batch group) for `mesh` and `batch_dims`; None without a mesh.

    Raises the same `WholebatchError` on every rank (it depends on the arguments
    only) when both `group` and `mesh` are given, `batch_dims` comes without
    `mesh` (or `mesh` without it), or names dims the mesh does not have.
    Every rank must call it the first time for a mesh (the group may be created).
    """
    try:
        split = MeshSplit.from_args(op, mesh, batch_dims, group=group)
    except (WholebatchError, WholebatchTypeError) as err:
        raise _renamed(op, err) from None
    if split is None:
        return None
    dims = tuple(split.batch_dims)
    pg = _GROUPS.get(split.mesh, dims)
    if pg is None:
        pg = split.batch_group()
        _GROUPS.put(split.mesh, dims, pg)
    return split, pg


def resolve_group(
    group: ProcessGroup | None,
    mesh: DeviceMesh | None,
    batch_dims: Sequence[str] | None,
    op: str,
) -> tuple[ProcessGroup | None, MeshSplit | None]:
    """(the group to gather over, the split or None): `group` itself for a flat world,
    the batch dims' group on a mesh (`resolve_split`)."""
    found = resolve_split(op, group, mesh, batch_dims)
    if found is None:
        return group, None
    split, pg = found
    return pg, split


def has_replicas(split: MeshSplit | None) -> bool:
    """Whether the split has a replica dim of size > 1 (ranks whose rows must match)."""
    return split is not None and any(split.sizes[d] > 1 for d in split.replica_dims)


# ---------------------------------------------------------------------------
# The fingerprint
# ---------------------------------------------------------------------------


def _total(values: Sequence[Tensor | float]) -> Tensor | float:
    """The sum of tensors and numbers (tensors stay on their device)."""
    out = values[0]
    for v in values[1:]:
        out = out + v
    return out


def _stats(x: object, offset: int = 0) -> tuple[Tensor | float, ...]:
    """(rows, eps, sum, abs, sq, pos) of one tensor, on its device (zeros for a non-tensor).

    A list of tensors (one output over several micro-batches, or several outputs)
    is summed, the i-th with its position weights shifted by i.
    """
    if isinstance(x, (list, tuple)):
        parts = [_stats(part, offset + i) for i, part in enumerate(x)]
        if not parts:
            return (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        sums = [_total([p[c] for p in parts]) for c in (2, 3, 4, 5)]
        rows = sum(float(p[0]) for p in parts)
        return (rows, max(float(p[1]) for p in parts), *sums)
    if not isinstance(x, Tensor) or x.dim() == 0 or not x.is_floating_point():
        return (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    rows = x.shape[0]
    with torch.no_grad():
        flat = x.detach().flatten(1) if x.dim() > 1 else x.detach().reshape(rows, 1)
        x_BX = flat.to(torch.float64)  # [B, X]; B may be 0
        w_B = torch.arange(rows, device=x.device, dtype=torch.float64) % _POS_WEIGHTS + 1 + offset
        pos = (x_BX.sum(1) * w_B).sum()
        return (
            float(rows),
            float(torch.finfo(x.dtype).eps),
            x_BX.sum(),
            x_BX.abs().sum(),
            x_BX.square().sum(),
            pos,
        )


def fingerprint_fields(
    split: MeshSplit, tensors: Mapping[str, object], *, prefix: str = "replica"
) -> dict[str, Field]:
    """This rank's row for `check_replicas`: its data shard, the split's layout, and per
    tensor its rows and `FINGERPRINT_STATS` (0-d tensors, no host sync). A missing or
    unusable tensor contributes zeros, so every rank's row has the same layout."""
    row: dict[str, Field] = {
        f"{prefix} layout": float(split.layout_code()),
        f"{prefix} shard": float(split.batch_index()),
    }
    for name, x in tensors.items():
        for stat, value in zip(("rows", "eps", *FINGERPRINT_STATS), _stats(x), strict=True):
            row[f"{prefix} {name} {stat}"] = value
    return row


def _differs(rows: Rows, prefix: str, name: str, a: int, b: int) -> str | None:
    """Which statistic of tensor `name` differs between ranks a and b beyond round-off."""
    key = f"{prefix} {name} "
    if rows[key + "rows"][a] != rows[key + "rows"][b]:
        return "rows"
    eps = min(_ROUNDOFF_EPS * max(rows[key + "eps"][a], rows[key + "eps"][b]), _ROUNDOFF_MAX)
    scale = {
        "sum": max(rows[key + "abs"][a], rows[key + "abs"][b]),
        "abs": max(rows[key + "abs"][a], rows[key + "abs"][b]),
        "sq": max(rows[key + "sq"][a], rows[key + "sq"][b]),
    }
    scale["pos"] = scale["sum"] * _POS_WEIGHTS
    for stat in FINGERPRINT_STATS:
        x, y = rows[key + stat][a], rows[key + stat][b]
        if math.isnan(x) or math.isnan(y):
            if math.isnan(x) != math.isnan(y):
                return stat
            continue
        if x != y and not abs(x - y) <= eps * scale[stat]:
            return stat
    return None


def check_replicas(
    op: str, split: MeshSplit, rows: Rows, names: Sequence[str], *, prefix: str = "replica"
) -> None:
    """Raise the same `WholebatchError` on every rank when replicas' fingerprints differ.

    `rows` is the all-gather over the mesh of every rank's `fingerprint_fields`
    (identical on every rank, so is the verdict).
    """
    layouts = rows[f"{prefix} layout"]
    if len(set(layouts)) > 1:
        raise WholebatchError(
            f"{op}: ranks describe the mesh split differently (layout checksums "
            f"{dict(enumerate(int(v) for v in layouts))}); pass the same mesh and batch_dims "
            "on every rank"
        )
    shards = rows.ints(f"{prefix} shard")
    for b in range(split.batch_size):
        members = [r for r, s in enumerate(shards) if s == b]
        for other in members[1:]:
            for name in names:
                stat = _differs(rows, prefix, name, members[0], other)
                if stat is not None:
                    raise WholebatchError(
                        _replica_text(op, split, rows, prefix, name, stat, members)
                    )


def _replica_text(
    op: str,
    split: MeshSplit,
    rows: Rows,
    prefix: str,
    name: str,
    stat: str,
    members: list[int],
) -> str:
    differ = tuple(d for d in split.replica_dims if split.sizes[d] > 1)
    what = {
        "rows": "row counts",
        "sum": "sums",
        "abs": "sums of |x|",
        "sq": "sums of squares",
        "pos": "row-weighted sums",
    }[stat]
    values = rows[f"{prefix} {name} {stat}"]
    shown = ranks_text(values, members)
    return (
        f"{op}: ranks {members} replicate the same rows (the same coordinates on batch dims "
        f"{tuple(split.batch_dims)}; they differ only on {differ}) but hold different {name}: "
        f"{what} {shown}. Feed every rank of a {'/'.join(differ)} group the same rows: shard "
        "the data by the batch dims only (e.g. DistributedSampler(num_replicas=<product of the "
        "batch dims' sizes>, rank=<this rank's batch index>)), or name the dim in batch_dims "
        "if its ranks are meant to hold different rows (context parallel)"
    )


@contextlib.contextmanager
def replicas_agree(
    op: str, split: MeshSplit | None, tensors: Mapping[str, object], *, enabled: bool = True
) -> Iterator[None]:
    """Check, around the body, that replicas hold the same `tensors` (module docstring).

    Every rank of the mesh must enter it with the same tensor names. No-op for a
    flat world, a mesh without a replica dim of size > 1, or `enabled=False`.
    The replicas' error wins over one the body raised (the body's may be raised
    on one batch group only; this one is raised on every rank).
    """
    if not enabled or split is None or not has_replicas(split) or not is_distributed(None):
        yield
        return
    assert split is not None
    pending: PendingRows = start_rows(fingerprint_fields(split, tensors), group=None)
    try:
        yield
    finally:
        check_replicas(op, split, pending.wait(), list(tensors))
