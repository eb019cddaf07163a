"""The batch split over a device mesh: which dims split the batch, which replicate it.

A training step on a `torch.distributed.device_mesh.DeviceMesh` splits its batch
over some dims and replicates it over the others (DESIGN.md, "The split and the
whole batch's loss"):

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    split = MeshSplit(mesh=mesh, batch_dims=("dp",))      # tp ranks see the same rows
    split.batch_size, split.replica_dims                  # 2, ("tp",)
    counts = split.agree_counts("step", items=n, loss=s)  # over dp only; tp replicas checked

- **batch dims** (data-parallel replicate and shard dims, context parallel): their
  ranks hold different items (rows, or different tokens of the same sequences),
  so items are counted over them. `batch_size` is the product of their sizes.
- **replica dims** (tensor parallel, and any other dim not named): their ranks see
  the same items and compute the same loss. They must report the same item count
  and loss; a mismatch means they were fed different data and is the same clear
  error on every rank.
- **the pipeline dim** (optional): stages see every micro-batch in a schedule and
  only the last computes the loss; only ranks that computed a loss report counts
  (`counted=True`), the others take the agreed total.

A flat group is the one-dim special case: `batch_dims` is its only dim.

Every check here depends on the arguments only (the same on every rank), or is
agreed through one all-gather (`agree_counts`), so errors are identical on every
rank. The mesh must span every process of the default group: the agreement runs
on it.

Legend: W processes of the mesh, B = batch_size (distinct data shards), R
ranks per shard (replicas x pipeline stages), N global item count.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from collections.abc import Iterable, Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm._c10d import flat_group
from wholebatch.comm.agree import Field, Rows, agree_rows, exchange_text, per_rank, ranks_text
from wholebatch.comm.groups import get_world_size, is_distributed
from wholebatch.comm.shape import parse_mesh_shape
from wholebatch.errors import WholebatchError, WholebatchTypeError

__all__ = ["MeshCounts", "MeshSplit", "parse_mesh_shape"]

# Two replicas' losses are the same computation on the same rows; tensor-parallel
# all-reduces may add in a different order on different ranks, so allow round-off
# (relative, far below any difference real data makes).
_LOSS_RTOL = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshCounts:
    """The step's agreed counts over a mesh; identical on every rank."""

    items: float
    """Global item count N: the sum over the B data shards (each counted once)."""

    loss_sum: float
    """Sum of item losses over the B data shards (each counted once)."""

    items_per_shard: tuple[float, ...]
    """Each data shard's item count, in batch-index order (row-major over `batch_dims`)."""

    items_per_rank: tuple[float, ...]
    """Each rank's reported item count, in rank order (0 where a rank computed no loss)."""

    rows: Rows
    """The agreed table (every field the caller added too), to read further flags from."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSplit:
    """How a step's batch is split over a `DeviceMesh`: batch dims, replica dims, pipeline dim.

    Every rank builds it with the same arguments (the mesh's dim names and sizes
    are the same everywhere); `agree_counts` also checks that they did.
    """

    mesh: DeviceMesh
    """The device mesh the model runs on, with named dims; it spans every process."""

    batch_dims: Sequence[str]
    """The dims whose ranks hold different items: data parallel (replicate and
    shard) and context parallel. Items are counted over these only. A flattened dim
    of the mesh (`mesh["dp", "tp"]._flatten("dp_enc")`) names the dims it flattens."""

    pipeline_dim: str | None = None
    """The pipeline-parallel dim, if any: its ranks are stages of one schedule;
    only the stage that computes the loss reports counts."""

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, DeviceMesh):
            raise WholebatchTypeError(
                f"MeshSplit: mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                f"{type(self.mesh).__name__}; build one with init_device_mesh(device, shape, "
                "mesh_dim_names=(...)), or pass group= for a flat world"
            )
        names = self.mesh.mesh_dim_names
        if not names:
            raise WholebatchError(
                "MeshSplit: the mesh has no dim names; build it with "
                "init_device_mesh(..., mesh_dim_names=('dp', 'tp')) so batch_dims can name them"
            )
        dims = tuple(self.batch_dims) if not isinstance(self.batch_dims, str) else None
        if dims is None:
            raise WholebatchTypeError(
                f"MeshSplit: batch_dims={self.batch_dims!r} is a string; pass a tuple of dim "
                f"names, e.g. batch_dims=({self.batch_dims!r},)"
            )
        dims = _resolve_flattened(self.mesh, dims)
        object.__setattr__(self, "batch_dims", dims)
        if not dims:
            raise WholebatchError(
                f"MeshSplit: batch_dims is empty; name the dims of {names} that split the "
                "batch (data parallel and context parallel), e.g. batch_dims=('dp',)"
            )
        unknown = [d for d in dims if d not in names]
        if unknown:
            raise WholebatchError(
                f"MeshSplit: batch_dims {unknown} are not dims of the mesh; its dims are "
                f"{names} (sizes {tuple(self.mesh.shape)})"
            )
        if len(set(dims)) != len(dims):
            raise WholebatchError(f"MeshSplit: batch_dims={dims} names a dim twice")
        if self.pipeline_dim is not None:
            if self.pipeline_dim not in names:
                raise WholebatchError(
                    f"MeshSplit: pipeline_dim={self.pipeline_dim!r} is not a dim of the mesh; "
                    f"its dims are {names}"
                )
            if self.pipeline_dim in dims:
                raise WholebatchError(
                    f"MeshSplit: {self.pipeline_dim!r} is both a batch dim and the pipeline "
                    "dim; pipeline stages see the same micro-batches, so it is not a batch dim"
                )
        ranks = sorted(int(r) for r in self.mesh.mesh.flatten().tolist())
        world = get_world_size(None)
        if ranks != list(range(world)):
            raise WholebatchError(
                f"MeshSplit: the mesh holds ranks {ranks} but the world has {world}; build "
                "the mesh over every process (init_device_mesh with the world's size)"
            )

    @classmethod
    def from_args(
        cls,
        op: str,
        mesh: DeviceMesh | None,
        batch_dims: Sequence[str] | None,
        *,
        group: object = None,
        pipeline_dim: str | None = None,
    ) -> MeshSplit | None:
        """An engine's `mesh=`/`batch_dims=` arguments as a split (None for a flat world)."""
        if mesh is None:
            if batch_dims is not None:
                raise WholebatchError(
                    f"{op}: batch_dims={tuple(batch_dims)!r} without mesh=; pass the "
                    "DeviceMesh the model runs on too"
                )
            return None
        if group is not None:
            raise WholebatchError(
                f"{op}: pass group= (a flat world) or mesh= with batch_dims= (a device mesh), "
                "not both"
            )
        if batch_dims is None:
            raise WholebatchError(
                f"{op}: mesh= needs batch_dims=, the dims of {mesh.mesh_dim_names} that split "
                "the batch (data and context parallel); the others replicate it"
            )
        return cls(mesh=mesh, batch_dims=batch_dims, pipeline_dim=pipeline_dim)  # type: ignore[arg-type]

    # -- shape -----------------------------------------------------------------

    @property
    def dims(self) -> tuple[str, ...]:
        """Every dim of the mesh, in mesh order."""
        names = self.mesh.mesh_dim_names
        assert names is not None  # checked in __post_init__
        return tuple(names)

    @property
    def sizes(self) -> dict[str, int]:
        """Each dim's size."""
        return dict(zip(self.dims, (int(s) for s in self.mesh.shape), strict=True))

    @property
    def replica_dims(self) -> tuple[str, ...]:
        """The dims whose ranks see the same items (every dim neither batch nor pipeline)."""
        return tuple(d for d in self.dims if d not in self.batch_dims and d != self.pipeline_dim)

    @property
    def batch_size(self) -> int:
        """B: the number of distinct data shards (the product of the batch dims' sizes)."""
        return math.prod(self.sizes[d] for d in self.batch_dims)

    @property
    def replicas(self) -> int:
        """How many ranks see the same items on each pipeline stage (product of replica dims)."""
        return math.prod(self.sizes[d] for d in self.replica_dims)

    def size_of(self, dims: Iterable[str]) -> int:
        """The product of the sizes of `dims`."""
        return math.prod(self.sizes[d] for d in dims)

    def coordinate(self, rank: int | None = None) -> dict[str, int]:
        """`rank`'s coordinate on every dim (this process's rank when None)."""
        r = dist.get_rank() if rank is None and is_distributed(None) else (rank or 0)
        where = (self.mesh.mesh == r).nonzero()
        if where.numel() == 0:
            raise WholebatchError(
                f"MeshSplit: rank {r} is not in the mesh {self.mesh.mesh.tolist()}"
            )
        return dict(zip(self.dims, (int(c) for c in where[0].tolist()), strict=True))

    def batch_index(self, rank: int | None = None) -> int:
        """Which data shard `rank` holds: row-major over `batch_dims`, in 0..B-1."""
        coord = self.coordinate(rank)
        index = 0
        for d in self.batch_dims:
            index = index * self.sizes[d] + coord[d]
        return index

    def batch_indices(self) -> dict[int, int]:
        """Every rank's `batch_index`, in one pass over the mesh (O(W), not O(W²))."""
        out: dict[int, int] = {}
        for flat, rank in enumerate(self.mesh.mesh.flatten().tolist()):
            coord: dict[str, int] = {}
            for d in reversed(self.dims):  # row-major, as the mesh tensor is laid out
                coord[d] = flat % self.sizes[d]
                flat //= self.sizes[d]
            index = 0
            for d in self.batch_dims:
                index = index * self.sizes[d] + coord[d]
            out[int(rank)] = index
        return out

    def ranks_along(self, dims: Iterable[str], rank: int | None = None) -> frozenset[int]:
        """The ranks that share `rank`'s coordinate on every dim except `dims`."""
        free = set(dims)
        coord = self.coordinate(rank)
        index = tuple(slice(None) if d in free else coord[d] for d in self.dims)
        return frozenset(int(r) for r in self.mesh.mesh[index].flatten().tolist())

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """The sets of ranks that must be fed alike: the same coordinate on every batch dim
        and on the pipeline dim (they differ only on replica dims), each in rank order,
        groups ordered by their first rank; only groups of more than one rank."""
        keep = [i for i, d in enumerate(self.dims) if d not in self.replica_dims]
        groups: dict[tuple[int, ...], list[int]] = {}
        for flat, rank in enumerate(self.mesh.mesh.flatten().tolist()):
            coord = []
            for d in reversed(self.dims):  # row-major, as the mesh tensor is laid out
                coord.append(flat % self.sizes[d])
                flat //= self.sizes[d]
            coord.reverse()
            groups.setdefault(tuple(coord[i] for i in keep), []).append(int(rank))
        found = [tuple(sorted(g)) for g in groups.values() if len(g) > 1]
        return tuple(sorted(found))

    def dims_of(self, ranks: Iterable[int], rank: int | None = None) -> tuple[str, ...] | None:
        """The dims whose sub-grid through `rank` is exactly `ranks`; None when no set of dims is.

        How a wrapper's process group (DDP's group, an FSDP2 mesh, a DTensor's
        mesh, a flattened `dp_cp` dim) is read as dims of this mesh.
        """
        want = frozenset(int(r) for r in ranks)
        for n in range(len(self.dims) + 1):
            for subset in itertools.combinations(self.dims, n):
                if self.ranks_along(subset, rank) == want:
                    # Dims of size 1 add no ranks: drop them from the answer.
                    return tuple(d for d in subset if self.sizes[d] > 1) if n else ()
        return None

    def batch_group(self) -> ProcessGroup:
        """The process group of this rank's batch dims (flattened): the ranks holding the
        other data shards at this rank's replica (and pipeline) coordinates.

        What a loss that gathers over the whole batch (`clip_loss(..., group=...)`,
        `GradCache(group=...)`) takes on a mesh. Every rank must call it the first time
        (flattening several dims creates process groups).
        """
        return flat_group(self.mesh, self.batch_dims)

    def describe(self) -> str:
        """`dp=2 (batch), tp=2 (replica)`: the mesh as errors and reports show it."""

        def role(d: str) -> str:
            if d in self.batch_dims:
                return "batch"
            return "pipeline" if d == self.pipeline_dim else "replica"

        return ", ".join(f"{d}={s} ({role(d)})" for d, s in self.sizes.items())

    def layout_code(self) -> int:
        """A checksum of the split's layout (dims, sizes, roles): ranks must agree on it."""
        return zlib.crc32(self.describe().encode())

    # -- agreement ---------------------------------------------------------------

    def count_fields(self, *, items: Field, loss: Field, counted: bool = True) -> dict[str, Field]:
        """This rank's fields for the counts' all-gather (merge them into a larger row).

        Args:
            items: this rank's item count for the step.
            loss: this rank's sum of item losses for the step.
            counted: whether this rank computed the loss (False on pipeline stages
                that hold no labels: they report nothing and take the agreed total).
        """
        return {
            "mesh_layout": float(self.layout_code()),
            "mesh_shard": float(self.batch_index()),
            "mesh_counted": bool(counted),
            "mesh_items": items if counted else 0.0,
            "mesh_loss": loss if counted else 0.0,
        }

    def read_counts(self, op: str, rows: Rows) -> MeshCounts:
        """Agreed counts from `rows` (gathered over the default group with `count_fields`).

        Raises the same `WholebatchError` on every rank when ranks built different
        splits, when a data shard has no rank that computed its loss, or when
        replicas (same batch coordinates) report different item counts or losses.
        """
        if not rows.same("mesh_layout"):  # every rank sees it: all name the splits together
            raise WholebatchError(
                f"{op}: ranks describe the mesh split differently "
                f"{per_rank(exchange_text(self.describe(), rows.group))}; build MeshSplit "
                "with the same mesh, batch_dims and pipeline_dim on every rank"
            )
        shards = rows.ints("mesh_shard")
        counted = rows["mesh_counted"]
        items = rows["mesh_items"]
        losses = rows["mesh_loss"]
        per_shard_items: list[float] = []
        per_shard_loss: list[float] = []
        for b in range(self.batch_size):
            members = [r for r, s in enumerate(shards) if s == b and counted[r]]
            if not members:
                holders = [r for r, s in enumerate(shards) if s == b]
                raise WholebatchError(
                    f"{op}: data shard {b} (ranks {holders}) has no rank that computed the "
                    "loss; on a pipeline, the last stage must report counted=True"
                )
            first = members[0]
            bad = [
                r
                for r in members[1:]
                if items[r] != items[first] or not _close(losses[r], losses[first])
            ]
            if bad:
                shown = [first, *bad]
                differ = tuple(d for d in self.replica_dims if self.sizes[d] > 1)
                raise WholebatchError(
                    f"{op}: ranks {shown} replicate the same rows (the same coordinates on "
                    f"batch dims {self.batch_dims}; they differ only on {differ}) but saw "
                    f"different data: item counts {ranks_text(items, shown)}, losses "
                    f"{ranks_text(losses, shown)}. Feed every rank of a {'/'.join(differ)} group "
                    "the same rows: shard the data by the batch dims only (e.g. "
                    "DistributedSampler(num_replicas=<product of the batch dims' sizes>, "
                    "rank=<this rank's batch index>)), or name the dim in batch_dims if its "
                    "ranks are meant to hold different items (context parallel)"
                )
            per_shard_items.append(items[first])
            per_shard_loss.append(losses[first])
        return MeshCounts(
            items=math.fsum(per_shard_items),
            loss_sum=_fsum(per_shard_loss),
            items_per_shard=tuple(per_shard_items),
            items_per_rank=tuple(items),
            rows=rows,
        )

    def shard_totals(
        self, op: str, rows: Rows, names: Sequence[str], what: str
    ) -> dict[str, tuple[float, ...]]:
        """Per field of `names` (scalars or vectors, gathered over the whole mesh): the sum
        over the B data shards of one rank's value each, the replicas checked to agree
        (the same on every rank; `what` names the fields in the error).

        Raises the same `WholebatchError` on every rank when ranks of one data shard
        report different values (beyond float round-off): they were fed different data.
        """
        shards = self.batch_indices()
        firsts: dict[int, int] = {}
        for r in range(rows.world_size):
            firsts.setdefault(shards[r], r)
        out: dict[str, tuple[float, ...]] = {}
        for name in names:
            per_rank = rows.vectors(name)
            for r in range(rows.world_size):
                first = firsts[shards[r]]
                if r != first and not all(
                    _close(a, b) for a, b in zip(per_rank[r], per_rank[first], strict=True)
                ):
                    differ = tuple(d for d in self.replica_dims if self.sizes[d] > 1)
                    shown = [first, r]
                    values = {q: list(per_rank[q]) for q in shown}
                    raise WholebatchError(
                        f"{op}: ranks {shown} replicate the same rows (the same coordinates "
                        f"on batch dims {self.batch_dims}; they differ only on {differ}) but "
                        f"report different {what}: {name} {values}. Feed every rank of a "
                        f"{'/'.join(differ)} group the same micro-batches, and keep the model "
                        "deterministic on them"
                    )
            cols = zip(*(per_rank[first] for _, first in sorted(firsts.items())), strict=True)
            out[name] = tuple(_fsum(list(col)) for col in cols)
        return out

    def agree_counts(
        self,
        op: str,
        *,
        items: Field,
        loss: Field,
        counted: bool = True,
        extra: dict[str, Field] | None = None,
    ) -> MeshCounts:
        """One all-gather over the mesh, then `read_counts`: the step's N, checked.

        Every rank of the mesh must call it. `extra` fields travel in the same row
        (read them from `MeshCounts.rows`).
        """
        row = self.count_fields(items=items, loss=loss, counted=counted)
        row.update(extra or {})
        return self.read_counts(op, agree_rows(row, group=None))


def _resolve_flattened(mesh: DeviceMesh, dims: tuple[str, ...]) -> tuple[str, ...]:
    """`dims` with each flattened dim (a name `mesh[name]` resolves but that is no dim of
    the mesh) replaced by the mesh dims it flattens, in mesh order. Unknown names are
    kept, for `__post_init__`'s error. The same on every rank (a flatten is of whole dims)."""
    names = tuple(mesh.mesh_dim_names or ())
    out: list[str] = []
    for d in dims:
        if d in names or not names:
            out.append(d)
            continue
        try:
            sub = mesh[d]
        except (KeyError, RuntimeError, ValueError):
            out.append(d)
            continue
        want = frozenset(int(r) for r in sub.mesh.flatten().tolist())
        spanned = _dims_through(mesh, want)
        out.extend([d] if spanned is None else [x for x in spanned if x not in out])
    return tuple(out)


def _dims_through(mesh: DeviceMesh, ranks: frozenset[int]) -> tuple[str, ...] | None:
    """The dims of `mesh` whose sub-grid through the first of `ranks` is exactly `ranks`."""
    names = tuple(mesh.mesh_dim_names or ())
    grid = mesh.mesh
    where = (grid == min(ranks)).nonzero()
    if where.numel() == 0:
        return None
    coord = [int(c) for c in where[0].tolist()]
    for n in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), n):
            index = tuple(slice(None) if i in subset else coord[i] for i in range(len(names)))
            if frozenset(int(r) for r in grid[index].flatten().tolist()) == ranks:
                return tuple(names[i] for i in subset)
    return None


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= _LOSS_RTOL * max(abs(a), abs(b))


def _fsum(values: Sequence[float]) -> float:
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):  # inf + -inf: NaN, as a plain sum gives
        return sum(values, 0.0)
