"""`wholebatch verify` on a device mesh: one rank of the split step, and the mesh it runs on.

    wholebatch verify examples/my_step.py:check --mesh dp=2,tp=2

On a mesh of dims and sizes ("dp=2,tp=2") verify forks the product of the sizes
as processes, builds the `DeviceMesh` on each (gloo, named dims), deals the
whole batch's rows over the spec's batch dims only (every rank of the other
dims, the replicas, gets the same rows and the same seed), applies the spec's
`parallelize(model, mesh)` and runs the step, which reads the mesh from
`current_mesh()`. Afterwards every rank gathers each parameter's full gradient
(a DTensor's shards through `full_tensor()`, in parameter order on every rank),
so every rank's gradients are compared with one process on the whole batch, as
for a flat world. On a pipeline ("pp=2,dp=2") a rank holds its stage's parameters
only: each parameter's gradient comes from the first rank whose stage computed one
(one all-gather), and each rank reports which parameters its stage owns. Each rank also records a fingerprint of what the model's
forward received: ranks that replicate a data shard must have seen the same.

Legend: W processes (the mesh's size), B row shards (the product of the batch
dims' sizes), R = W / B ranks per row shard (the replicas), K micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from wholebatch.comm.mesh import parse_mesh_shape
from wholebatch.errors import WholebatchError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from wholebatch.verify.spec import VerifySpec
    from wholebatch.verify.worker import Condition, RankResult

__all__ = [
    "REPLICAS_ONE",
    "coordinate",
    "current_mesh",
    "mesh_world",
    "replica_dims",
    "replica_groups",
    "replica_shape",
    "row_dims",
    "split_rank_mesh",
]

# Dims that do not split the rows by default: tensor parallel replicates them, context
# parallel cuts each row's tokens (the step does), pipeline stages see every row.
_NOT_ROW_DIMS = ("tp", "cp", "pp")

_CURRENT: list[DeviceMesh] = []

REPLICAS_ONE = "replicas 1"
"""The label of the re-run with every replica dim of size 1 (its variant starts with it)."""


def current_mesh() -> DeviceMesh:
    """The `DeviceMesh` verify built for this run (call it inside the step or `parallelize`).

    Raises:
        WholebatchError: outside a `wholebatch verify --mesh` (or spec `mesh=`) run.
    """
    if not _CURRENT:
        raise WholebatchError(
            "current_mesh(): no mesh: it is set only while wholebatch verify runs a step on a "
            "mesh (--mesh dp=2,tp=2, or VerifySpec(mesh=...))"
        )
    return _CURRENT[-1]


def row_dims(shape: Mapping[str, int], batch_dims: Sequence[str] | None) -> tuple[str, ...]:
    """The dims that get different rows: `batch_dims`, or every dim but tp, cp and pp."""
    if batch_dims is None:
        return tuple(d for d in shape if d not in _NOT_ROW_DIMS)
    unknown = [d for d in batch_dims if d not in shape]
    if unknown:
        raise WholebatchError(
            f"verify: batch_dims {unknown} are not dims of the mesh {dict(shape)}; name dims of "
            "--mesh (or the spec's mesh)"
        )
    return tuple(batch_dims)


def mesh_world(text: str) -> int:
    """W: the processes a mesh "dp=2,tp=2" needs."""
    return math.prod(parse_mesh_shape(text).values())


def replica_shape(text: str, batch_dims: Sequence[str] | None) -> str:
    """The mesh with its tensor- and context-parallel dims (every dim but the row dims and
    pp) of size 1: "dp=2,tp=2" -> "dp=2,tp=1"; "" when they are of size 1 already."""
    shape = parse_mesh_shape(text)
    keep = (*row_dims(shape, batch_dims), "pp")
    if all(s == 1 for d, s in shape.items() if d not in keep):
        return ""
    return ",".join(f"{d}={s if d in keep else 1}" for d, s in shape.items())


def replica_dims(shape: Mapping[str, int], rows: Sequence[str]) -> tuple[str, ...]:
    """The dims whose ranks must see the same inputs: not row dims, not cp (its ranks hold
    other tokens of the same rows), not pp (stages take other inputs)."""
    return tuple(d for d in shape if d not in rows and d not in ("cp", "pp"))


def replica_groups(shape: Mapping[str, int], rows: Sequence[str]) -> list[list[int]]:
    """Ranks that differ only on the replica dims (they must be fed the same inputs)."""
    free = set(replica_dims(shape, rows))
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(math.prod(shape.values())):
        coord = coordinate(shape, r)
        groups.setdefault(tuple(c for d, c in coord.items() if d not in free), []).append(r)
    return [g for g in groups.values() if len(g) > 1]


def coordinate(shape: Mapping[str, int], rank: int) -> dict[str, int]:
    """Row-major coordinate of `rank` (init_device_mesh lays ranks out row-major)."""
    out: dict[str, int] = {}
    rest = rank
    for d in reversed(list(shape)):
        out[d] = rest % shape[d]
        rest //= shape[d]
    return {d: out[d] for d in shape}


def shard_of(shape: Mapping[str, int], rows: Sequence[str], rank: int) -> int:
    """Which row shard (0..B-1) `rank` holds: row-major over the row dims."""
    coord = coordinate(shape, rank)
    index = 0
    for d in rows:
        index = index * shape[d] + coord[d]
    return index


def _fingerprint(args: Any) -> float:
    """A number that changes with the tensors in a forward's arguments."""
    if isinstance(args, Tensor):
        if not args.is_complex():
            x = _local(args)
            pos = torch.arange(1, x.numel() + 1, dtype=torch.float64)
            return float((x.reshape(-1).to(torch.float64) * pos).sum()) + float(x.numel())
        return 0.0
    if isinstance(args, Mapping):
        return sum(_fingerprint(v) for v in args.values())
    if isinstance(args, tuple | list):
        return sum(_fingerprint(v) for v in args)
    return 0.0


def _full(g: Tensor | None, p: Tensor) -> Tensor | None:
    """The full gradient of `p` on this rank (a DTensor's shards gathered: a collective)."""
    if not hasattr(p, "full_tensor"):
        return g
    # Every rank gathers every DTensor parameter in the same order; a rank without a
    # gradient takes part with zeros so no rank waits alone (and reports None).
    local = g if g is not None else torch.zeros_like(p, dtype=torch.float64)
    full = local.full_tensor() if hasattr(local, "full_tensor") else local
    return None if g is None else full.detach().to(torch.float64).cpu()


def split_rank_mesh(
    spec: VerifySpec, condition: Condition, micro_batches: int, rank: int, world_size: int
) -> RankResult:
    """One rank of a split run on `condition.mesh` (called in a forked process in the W-rank group)."""
    from torch.distributed.device_mesh import init_device_mesh

    from wholebatch.verify import worker
    from wholebatch.verify.recording import (
        DtypeMeter,
        GradRecorder,
        collectives_in_functions,
        collectives_seen,
    )
    from wholebatch.verify.spec import fingerprint, rows, split_batch

    shape = parse_mesh_shape(condition.mesh)
    if math.prod(shape.values()) != world_size:
        raise WholebatchError(
            f"verify: mesh {condition.mesh!r} needs {math.prod(shape.values())} processes, "
            f"the run has {world_size}"
        )
    dims = row_dims(shape, spec.batch_dims)
    b = math.prod(shape[d] for d in dims)
    shard = shard_of(shape, dims, rank)
    coord = coordinate(shape, rank)
    primary = all(coord[d] == 0 for d in shape if d not in dims)
    batch = worker._batch(spec, condition)
    k, n = micro_batches, rows(batch)
    model, tapes = worker._build(spec, "record" if condition.dropout else "off")
    params_fp = worker._params_fp(model)
    seen: list[float] = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(_fingerprint((args, kwargs))), with_kwargs=True
    )
    mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
    _CURRENT.append(mesh)
    try:
        module: nn.Module = model
        if spec.parallelize is not None:
            module = spec.parallelize(model, mesh) or model
        elif spec.wrap == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            group = (
                mesh[dims[0]].get_group()
                if len(dims) == 1
                else mesh[dims]._flatten("_".join(dims)).get_group()
            )
            module = DistributedDataParallel(model, process_group=group)
        named = list(model.named_parameters())
        before = [p.detach().clone() for _, p in named]
        optimizer = GradRecorder([p for _, p in named])
        chunks = torch.tensor_split(torch.arange(n), b * k)[shard * k : (shard + 1) * k]
        mine = split_batch(batch, b * k)[shard * k : (shard + 1) * k]
        collectives_seen(reset=True)
        collectives_in_functions(reset=True)
        meter = DtypeMeter()
        # Replicas draw the same random numbers (dropout masks): seeded by the row shard.
        torch.manual_seed(spec.seed + 1 + shard)
        with meter:
            spec.step(module, optimizer, mine)
        collectives = collectives_seen(reset=True)
        in_functions = collectives_in_functions(reset=True)
        changed = tuple(
            name
            for (name, p), was in zip(named, before, strict=True)
            if not torch.equal(_local(p), _local(was))
        )
        local = {name: _local_piece(optimizer.gradient(p), p) for name, p in named}
        grads = {name: _full(optimizer.gradient(p), p) for name, p in named}
        owned = tuple(n for n, g in grads.items() if g is not None)
        if shape.get("pp", 1) > 1:
            grads = _from_owners(grads)
    finally:
        _CURRENT.pop()
        hook.remove()
    pieces = [c.tolist() for c in chunks]
    my_rows = sum(len(c) for c in pieces)
    return worker.RankResult(
        grads=grads,
        calls=optimizer.calls,
        changed=changed,
        masks={name: t.first_rows(my_rows) for name, t in tapes.items()} if primary else {},
        collectives=collectives,
        pieces=pieces if primary else [],
        dtypes=worker._dtype_names(meter.dtypes),
        params_fp=params_fp,
        batch_fp=fingerprint(batch),
        autocast=tuple(sorted(meter.autocast)),
        in_functions=in_functions,
        redrawn=tuple(name for name, t in tapes.items() if t.redrawn(my_rows)) if primary else (),
        shard=shard,
        primary=primary,
        owned=owned,
        local={n: v for n, v in local.items() if v is not None},
        inputs=tuple(seen),
    )


def _local_piece(g: Tensor | None, p: Tensor) -> tuple[Tensor, tuple[int, ...]] | None:
    """This rank's piece of a DTensor gradient and its offset in the full tensor; None for a
    plain tensor, or placements other than Shard/Replicate (a strided shard under TP)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if g is None or not isinstance(p, DTensor) or not isinstance(g, DTensor):
        return None
    if any(type(pl) not in (Shard, Replicate) for pl in p.placements):
        return None
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return g.to_local().detach().to(torch.float64).cpu(), tuple(int(o) for o in offset)


def rank_factors(
    local: Sequence[Mapping[str, tuple[Tensor, tuple[int, ...]]]],
    reference: Mapping[str, Tensor | None],
) -> tuple[float | None, ...]:
    """Per rank, the one factor its gradient pieces are of the reference's (None: no one factor).

    A rank's FSDP shard scaled by its own wrong count shows here, where the full
    gradient (shards of different ranks at different factors) has no single ratio.
    """
    out: list[float | None] = []
    for pieces in local:
        factors: list[float] = []
        fits = True
        for name, (piece, offset) in pieces.items():
            full = reference.get(name)
            if full is None or piece.numel() == 0:
                continue
            ref = full[tuple(slice(o, o + n) for o, n in zip(offset, piece.shape, strict=True))]
            norm = float((ref * ref).sum())
            if norm == 0.0:
                continue
            f = float((piece * ref).sum()) / norm
            if float((piece - f * ref).norm()) > 1e-6 * float(piece.norm()):
                fits = False
                break
            factors.append(f)
        same = (
            fits and factors and all(abs(f - factors[0]) <= 1e-6 * abs(factors[0]) for f in factors)
        )
        out.append(factors[0] if same else None)
    return tuple(out)


def _from_owners(grads: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """On a pipeline: every parameter's gradient from the first rank whose stage holds it.

    Every rank of the world calls it, with the same parameter names: one agreed row
    says who holds which gradient and its shape, then one broadcast per parameter from
    its owner (tensors only: no pickled objects cross ranks). A parameter no stage
    computed a gradient for stays None.
    """
    import torch
    import torch.distributed as dist

    from wholebatch.comm.agree import agree_rows

    dims = 8
    names = sorted(grads)
    row: dict[str, list[int]] = {}
    for name in names:
        g = grads[name]
        shape = list(g.shape) if g is not None else []
        if len(shape) > dims:
            raise ValueError(f"verify: parameter {name} has more than {dims} dims")
        row[name] = [int(g is not None), len(shape), *shape, *([0] * (dims - len(shape)))]
    rows = agree_rows(row, dtype=torch.int64)
    out: dict[str, Tensor | None] = {}
    for name in names:
        table = rows.vectors(name)
        owner = next((r for r, v in enumerate(table) if v[0]), None)
        if owner is None:
            out[name] = None
            continue
        shape = [int(x) for x in table[owner][2 : 2 + int(table[owner][1])]]
        g = grads[name]
        buf = (
            g.detach().to(torch.float64).contiguous()
            if dist.get_rank() == owner and g is not None
            else torch.empty(shape, dtype=torch.float64)
        )
        dist.broadcast(buf, src=owner)
        out[name] = buf
    return out


def _local(t: Tensor) -> Tensor:
    """This rank's piece of `t` (a DTensor's local shard; a plain tensor as it is), detached."""
    from torch.distributed.tensor import DTensor

    x = t.detach()
    return x.to_local() if isinstance(x, DTensor) else x
