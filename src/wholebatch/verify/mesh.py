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

A `TrainerSpec` on a mesh runs the same way, its trainer handed a `TrainerRun`
with the mesh, the batch dims and this rank's row shard (`run.shard`, the same
on its replicas); the optimizer verify gives it (`ModelGradRecorder`) follows
the parameters the trainer registers, as a trainer that shards the model in
its own setup (Lightning's `configure_model`) replaces them.

Legend: W processes (the mesh's size), B row shards (the product of the batch
dims' sizes), R = W / B ranks per row shard (the replicas), K micro-batches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from wholebatch.comm._c10d import full_tensor, shard_offset
from wholebatch.comm.mesh import parse_mesh_shape
from wholebatch.errors import WholebatchError
from wholebatch.verify.recording import GradRecorder
from wholebatch.verify.spec import rows

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from wholebatch.verify.spec import Spec, TrainerSpec
    from wholebatch.verify.worker import Condition, RankResult

__all__ = [
    "REPLICAS_ONE",
    "ModelGradRecorder",
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

# A gradient piece whose reference stays below this fraction of its parameter's scale
# (`report.param_scales`) holds round-off only: no factor is read from it.
_ROUND_OFF = 1e-8

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
    full = full_tensor(local, op="verify") if hasattr(local, "full_tensor") else local
    return None if g is None else full.detach().to(torch.float64).cpu()


def split_rank_mesh(
    spec: Spec,
    condition: Condition,
    micro_batches: int,
    measure: bool,
    rank: int,
    world_size: int,
) -> RankResult:
    """One rank of a split run on `condition.mesh` (called in a forked process in the W-rank group)."""
    from torch.distributed.device_mesh import init_device_mesh

    from wholebatch.verify import worker
    from wholebatch.verify.precision import PrecisionMeter, dtype_names
    from wholebatch.verify.recording import collectives_in_functions, collectives_seen
    from wholebatch.verify.spec import TrainerSpec, VerifySpec, fingerprint

    shape = parse_mesh_shape(condition.mesh)
    if math.prod(shape.values()) != world_size:
        raise WholebatchError(
            f"verify: mesh {condition.mesh!r} needs {math.prod(shape.values())} processes, "
            f"the run has {world_size}"
        )
    at = _MeshRank(shape=shape, dims=row_dims(shape, spec.batch_dims), rank=rank, k=micro_batches)
    trainer = isinstance(spec, TrainerSpec)
    batch = worker._batch(spec, condition)
    model, tapes = worker._build(spec, "record" if condition.dropout and not trainer else "off")
    params_fp = worker._params_fp(model)
    seen: list[float] = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(_fingerprint((args, kwargs))), with_kwargs=True
    )
    mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
    _CURRENT.append(mesh)
    try:
        module = _parallelized(spec, model, mesh, at.dims)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer = ModelGradRecorder(model)
        collectives_seen(reset=True)
        collectives_in_functions(reset=True)
        meter = PrecisionMeter(active=measure)
        # Replicas draw the same random numbers (dropout masks): seeded by the row shard.
        torch.manual_seed(spec.seed + 1 + at.shard)
        with meter:
            if isinstance(spec, TrainerSpec):
                pieces, rows_note = _run_trainer(spec, module, model, optimizer, batch, mesh, at)
            else:
                assert isinstance(spec, VerifySpec), "a ReplaySpec is refused on a mesh (describe)"
                spec.step(module, optimizer, at.micro_batches(batch))
                pieces, rows_note = at.pieces(rows(batch)), ""
        collectives = collectives_seen(reset=True)
        in_functions = collectives_in_functions(reset=True)
        named = list(model.named_parameters())  # a trainer may have replaced them (sharded)
        changed = _changed(named, before, full=trainer)
        local = {name: _local_piece(optimizer.gradient(p), p) for name, p in named}
        grads = {name: _full(optimizer.gradient(p), p) for name, p in named}
        owned = tuple(n for n, g in grads.items() if g is not None)
        if shape.get("pp", 1) > 1:
            grads = _from_owners(grads)
    finally:
        _CURRENT.pop()
        hook.remove()
    my_rows = sum(len(c) for c in pieces)
    keep = at.primary and not trainer  # a trainer runs with dropout off: no masks
    return worker.RankResult(
        grads=grads,
        calls=optimizer.calls,
        changed=changed,
        masks={name: t.first_rows(my_rows) for name, t in tapes.items()} if keep else {},
        collectives=collectives,
        pieces=pieces if at.primary else [],
        dtypes=dtype_names(meter.dtypes),
        params_fp=params_fp,
        batch_fp=fingerprint(batch),
        autocast=tuple(sorted(meter.autocast)),
        in_functions=in_functions,
        redrawn=tuple(name for name, t in tapes.items() if t.redrawn(my_rows)) if keep else (),
        rows_note=rows_note if at.primary else "",
        shard=at.shard,
        primary=at.primary,
        owned=owned,
        local={n: v for n, v in local.items() if v is not None},
        inputs=tuple(seen),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _MeshRank:
    """Where a rank sits on the mesh: its row shard, and whether it is its shard's first replica."""

    shape: Mapping[str, int]
    dims: tuple[str, ...]
    """The row dims (the batch dims)."""
    rank: int
    k: int
    """K micro-batches per row shard."""

    @property
    def shards(self) -> int:
        """B: the row shards (the product of the row dims' sizes)."""
        return math.prod(self.shape[d] for d in self.dims)

    @property
    def shard(self) -> int:
        return shard_of(self.shape, self.dims, self.rank)

    @property
    def primary(self) -> bool:
        coord = coordinate(self.shape, self.rank)
        return all(coord[d] == 0 for d in self.shape if d not in self.dims)

    def pieces(self, n: int) -> list[list[int]]:
        """The whole batch's row indices of this shard's K micro-batches (of B·K contiguous chunks)."""
        b, k, s = self.shards, self.k, self.shard
        return [c.tolist() for c in torch.tensor_split(torch.arange(n), b * k)[s * k : (s + 1) * k]]

    def micro_batches(self, batch: Any) -> list[Any]:
        from wholebatch.verify.spec import split_batch

        b, k, s = self.shards, self.k, self.shard
        return split_batch(batch, b * k)[s * k : (s + 1) * k]


def _parallelized(
    spec: Spec, model: nn.Module, mesh: DeviceMesh, dims: tuple[str, ...]
) -> nn.Module:
    """The module the step (or trainer) gets: the spec's `parallelize`, DDP over the row dims
    (a VerifySpec with wrap="ddp"), or the plain model."""
    if spec.parallelize is not None:
        return spec.parallelize(model, mesh) or model
    if getattr(spec, "wrap", "none") != "ddp":
        return model
    from torch.nn.parallel import DistributedDataParallel

    from wholebatch.comm.mesh import MeshSplit

    group = MeshSplit(mesh=mesh, batch_dims=dims).batch_group()
    return DistributedDataParallel(model, process_group=group)


def _run_trainer(
    spec: TrainerSpec,
    module: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    mesh: DeviceMesh,
    at: _MeshRank,
) -> tuple[list[list[int]], str]:
    """Hand the trainer its `TrainerRun` on the mesh; the rows each forward held, and a note
    on the rows it could not match."""
    import tempfile

    import torch.distributed as dist

    from wholebatch.verify import worker
    from wholebatch.verify.rows import RowRecorder
    from wholebatch.verify.spec import TrainerRun, dataset_rows, split_batch

    n = rows(batch)
    recorder = RowRecorder(model, batch, spec.row_key)
    try:
        with tempfile.TemporaryDirectory(prefix="wholebatch-trainer-") as out:
            run = TrainerRun(
                model=module,
                optimizer=optimizer,
                batch=batch,
                dataset=dataset_rows(batch),
                world_size=dist.get_world_size(),
                rank=at.rank,
                micro_batches=at.k,
                per_device_rows=n // (at.shards * at.k),
                output_dir=out,
                seed=spec.seed,
                mesh=mesh,
                batch_dims=at.dims,
                data_shards=at.shards,
                data_rank=at.shard,
                shard=dataset_rows(split_batch(batch, at.shards)[at.shard]),
            )
            spec.train(run)
    finally:
        recorder.remove()
    return recorder.calls, worker._rows_note(recorder, n // at.shards)


def _changed(
    named: Sequence[tuple[str, Tensor]], before: Mapping[str, Tensor], *, full: bool
) -> tuple[str, ...]:
    """The parameters whose values the step changed. `full`: compare full values (a trainer
    that shards the model itself holds DTensors where `before` holds the plain tensors; every
    rank gathers in the same order)."""
    out = []
    for name, p in named:
        now, was = p.detach(), before[name]
        if full:
            now = full_tensor(now, op="verify") if hasattr(now, "full_tensor") else now
            was = full_tensor(was, op="verify") if hasattr(was, "full_tensor") else was
        else:
            now, was = _local(now), _local(was)
        if now.shape != was.shape or not torch.equal(now, was.to(now.dtype)):
            out.append(name)
    return tuple(out)


class _LiveParams(list[Tensor]):
    """`model`'s parameters as they are registered now: read again on every use."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._model = model

    def _now(self) -> list[Tensor]:
        return list(self._model.parameters())

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self._now())

    def __len__(self) -> int:
        return len(self._now())

    def __getitem__(self, i: Any) -> Any:
        return self._now()[i]


class ModelGradRecorder(GradRecorder):
    """A `GradRecorder` over `model`'s parameters as they are registered whenever it is used.

    A trainer that parallelises the model in its own setup (Lightning's
    `configure_model`: `fully_shard`, `parallelize_module`) replaces the parameters
    with DTensors after verify built the optimizer, and FSDP2 registers its unsharded
    and sharded parameters in turn around every forward and backward; a callback that
    rescales `optimizer.param_groups` inside the trainer's closure (Lightning's
    `on_before_optimizer_step`) must see the ones registered then. So the one
    param group's "params" is read from the model on every use.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model.parameters())
        self.param_groups[0]["params"] = _LiveParams(model)


def _local_piece(g: Tensor | None, p: Tensor) -> tuple[Tensor, tuple[int, ...]] | None:
    """This rank's piece of a DTensor gradient and its offset in the full tensor; None for a
    plain tensor, or placements other than Shard/Replicate (a strided shard under TP)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if g is None or not isinstance(p, DTensor) or not isinstance(g, DTensor):
        return None
    if any(type(pl) not in (Shard, Replicate) for pl in p.placements):
        return None
    return g.to_local().detach().to(torch.float64).cpu(), shard_offset(p)


def rank_factors(
    local: Sequence[Mapping[str, tuple[Tensor, tuple[int, ...]]]],
    reference: Mapping[str, Tensor | None],
) -> tuple[float | None, ...]:
    """Per rank, the one factor its gradient pieces are of the reference's (None: no one factor).

    A rank's FSDP shard scaled by its own wrong count shows here, where the full
    gradient (shards of different ranks at different factors) has no single ratio.
    """
    from wholebatch.verify.report import param_scales

    scales = param_scales(reference)
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
            # a piece whose reference is round-off of its module's scale (an attention key
            # bias: zero in exact arithmetic) has no factor to read
            if norm == 0.0 or float(ref.abs().max()) <= _ROUND_OFF * scales[name]:
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
