"""The device mesh a plan sizes: which dims split the items, which replicate them, which hold stages.

    PlanMesh.parse("dp=2,tp=2,cp=1,pp=1")     # the syntax of `wholebatch verify --mesh`

The dims the planner knows (torchtitan's names; docs/mesh.md, "Your mesh"):

| dim | items | parameters, gradients, optimizer state |
|---|---|---|
| `dp` | split (a batch dim) | sharded over dp x cp (FSDP2, torchtitan's dp_shard_cp) |
| `dp_replicate` | split (a batch dim) | replicated (DDP, HSDP's replicate dim): all-reduced |
| `cp` | split: each rank holds other tokens of the same sequences | sharded with dp (FSDP2 on dp x cp) |
| `tp` | replicated: every tp rank sees the same items | 1/tp on each rank (DTensor shards) |
| `pp` | every stage sees every micro-batch; only the last computes the loss | 1/pp on each stage |

So a rank's items are N / B with B = dp_replicate x dp x cp (the batch group, the
ranks a whole-batch loss gathers over), and its parameters P / (tp x pp), of which
FSDP2 keeps 1/(dp x cp). A flat world of W ranks is `dp_replicate=W` (DDP replicas).

Legend: W ranks of the mesh, B item shards (the batch group's size), S = dp x cp
(FSDP2's shard group), R = dp_replicate, P parameters.
"""

from __future__ import annotations

import dataclasses
import math

from wholebatch.comm.shape import parse_mesh_shape
from wholebatch.errors import WholebatchError

__all__ = ["BATCH_DIMS", "DIMS", "ENGINE_ROW_FIELDS", "PlanMesh"]

DIMS = ("dp_replicate", "dp", "cp", "tp", "pp")
"""The dims a plan's mesh may name."""

BATCH_DIMS = ("dp_replicate", "dp", "cp")
"""The dims that split the items (the loss gathers over them, counts are agreed over them)."""

ENGINE_ROW_FIELDS = {
    "accumulator": {"begin": 3 + 4 + 3 * 64, "finish": 7 + 5},
    "pipeline": {"begin": 3, "finish": 7 + 5},
}
"""float64 fields of the engines' two all-gathered rows per step on a mesh
(train/stepping.py `StepFinisher`): `begin` agrees K (the `Accumulator` adds the
normalisation fields: a 64-row inline table of sequence, group and count,
train/normalize.py `INLINE_ROWS`; `PipelineAccumulator` none); `finish` agrees the
loss, N, the flags and the norm share with `MeshSplit.count_fields` (the replica
check). Both run over every rank of the mesh. The Accumulator's are counted against
the real step in tests/distributed/test_plan_mesh_dist.py."""


@dataclasses.dataclass(frozen=True)
class PlanMesh:
    """A mesh's dims and sizes, in the order given (unknown dims refused)."""

    dims: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, text: str) -> PlanMesh:
        """`"dp=2,tp=2"` as a `PlanMesh`; a clear error naming the dim otherwise."""
        shape = parse_mesh_shape(text)
        unknown = [d for d in shape if d not in DIMS]
        if unknown:
            raise WholebatchError(
                f"mesh={text!r}: dims {unknown} are not planned; name dims of {', '.join(DIMS)} "
                "(dp: FSDP2's shard dim; dp_replicate: DDP or HSDP's replicate dim)"
            )
        return cls(tuple(shape.items()))

    def size(self, dim: str) -> int:
        """The dim's size (1 when the mesh does not name it)."""
        return dict(self.dims).get(dim, 1)

    @property
    def world(self) -> int:
        """W: ranks of the mesh."""
        return math.prod(s for _, s in self.dims)

    @property
    def batch(self) -> int:
        """B: item shards, dp_replicate x dp x cp (the batch group's size)."""
        return math.prod(self.size(d) for d in BATCH_DIMS)

    @property
    def shard(self) -> int:
        """S: FSDP2's shard group, dp x cp (1: no FSDP2)."""
        return self.size("dp") * self.size("cp")

    @property
    def model_split(self) -> int:
        """tp x pp: the parts the model's parameters are cut into before data parallelism."""
        return self.size("tp") * self.size("pp")

    def label(self, dims: tuple[str, ...]) -> str:
        """`dp x cp` for the dims of size > 1 among `dims` (in mesh order); `-` for none."""
        named = [d for d, s in self.dims if d in dims and s > 1]
        return " x ".join(named) if named else "-"

    @property
    def batch_label(self) -> str:
        """The batch group as dims, e.g. `dp x cp`."""
        return self.label(BATCH_DIMS)

    @property
    def world_label(self) -> str:
        """Every dim of size > 1: the whole mesh."""
        return self.label(DIMS)

    def describe(self) -> str:
        """`dp=2 (batch), tp=2 (replica)`: the mesh as the report shows it."""

        def role(d: str) -> str:
            if d in BATCH_DIMS:
                return "batch"
            return "stages" if d == "pp" else "replica"

        return ", ".join(f"{d}={s} ({role(d)})" for d, s in self.dims)
