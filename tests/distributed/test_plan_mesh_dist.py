"""The planner on a device mesh against counting on real gloo ranks: dp2 x tp2, 4 processes.

Distributed tier, the shared 4-rank world (tests.support.harness), a hard timeout
per call. Every rank builds the dp x tp mesh and runs the REAL public loss over its
batch group (`MeshSplit.batch_group()`: the dp ranks at its tp coordinate; the tp
replicas hold the same rows) under `count_collectives` (tests/support/plan_counting.py),
uneven rows per data shard and an empty shard. The bytes `wholebatch.plan` gives a
loss on `mesh="dp=2,tp=2"` (per phase and primitive) must EQUAL the counted ones:
every rank equals the planner's walk for its data shard, and the plan's busiest
shard is one of the counted. Mutation: the plan of a flat world of 4 (the tp
replicas taken for more data shards) does not match.

The `Accumulator`'s agreement rows on the mesh (two float64 all-gathers over every
rank per step) are counted on a real step too (FSDP2 on dp, tensor parallel on tp).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from tests.distributed.test_mesh_dist import TIMEOUT, TP, W
from tests.support.harness import run_ranks
from tests.support.plan_cases import Case, by_primitive, call, inputs, planned
from tests.support.plan_counting import Counter, count_collectives
from wholebatch.planner import PlanConfig, plan

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
MESH = "dp=2,tp=2"
CASES = [  # sizes: rows per data shard (dp 0, dp 1)
    Case(loss="clip", sizes=(37, 21)),
    Case(loss="clip", sizes=(16, 16), dtype="bf16"),
    Case(loss="clip", sizes=(0, 21), known_sizes=True),
    Case(loss="clip", sizes=(37, 21), strategy="ring"),
    Case(loss="siglip", sizes=(5, 13)),
    Case(loss="nt_xent", sizes=(11, 6)),
    Case(loss="info_nce", sizes=(9, 4), k=1, directions=ALL),
]

PerPhase = dict[str, tuple[dict[str, int], dict[str, int]]]


def _count_mesh(cases: list[Case]) -> list[PerPhase]:
    """This rank's counted bytes per (phase, primitive) for each case, over its batch group."""
    from tests.support.mesh_cases import get_mesh
    from wholebatch.comm.mesh import MeshSplit

    split = MeshSplit(mesh=get_mesh((("dp", 2), ("tp", 2))), batch_dims=("dp",))
    group = split.batch_group()
    shard = split.batch_index()
    out = []
    for case in cases:
        call(case, inputs(case, shard), group=group).backward()  # a warm-up call
        args = inputs(case, shard)  # the tp replicas of a shard: the same rows
        fwd, bwd = Counter(), Counter()
        dist.barrier()
        with count_collectives(fwd, group):
            loss = call(case, args, group=group)
        with count_collectives(bwd, group):
            loss.backward()
        out.append(
            {
                "forward": (_nonzero(fwd.sent), _nonzero(fwd.received)),
                "backward": (_nonzero(bwd.sent), _nonzero(bwd.received)),
            }
        )
    return out


def _nonzero(d: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in d.items() if v}


def _config(case: Case, **kw: Any) -> PlanConfig:
    return PlanConfig(
        loss=case.loss, batch=sum(case.sizes), dim=case.dim, dtype=case.dtype,
        negatives=case.k, directions=",".join(case.directions), known_sizes=case.known_sizes,
        strategy="ring" if case.strategy == "ring" else "", params=0, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def counted() -> list[list[PerPhase]]:
    """[rank][case] counts, in one call on the shared world."""
    return run_ranks(W, _count_mesh, CASES, timeout=TIMEOUT)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c.label() for c in CASES])
def test_planned_mesh_bytes_equal_counted_bytes_on_every_rank(
    i: int, counted: list[list[PerPhase]]
) -> None:
    case = CASES[i]
    p = plan(_config(case, mesh=MESH), sizes=case.sizes)
    assert {c.dims for c in p.collectives} == {"dp"}  # the loss runs over the batch group
    for rank in range(W):
        shard = rank // 2  # mesh [[0, 1], [2, 3]] over (dp, tp)
        assert counted[rank][i] == planned(case, shard), (rank, counted[rank][i])
    busiest = by_primitive(p.collectives)
    assert any(busiest == counted[2 * s][i] for s in p.ranks_counted), busiest
    # The mutation: the tp replicas taken for data shards (a flat world of 4).
    flat = plan(_config(case, world=4), sizes=(*case.sizes, 0, 0))
    assert all(by_primitive(flat.collectives) != got[i] for got in counted)


def _count_accumulator_rows() -> dict[str, int]:
    """One `Accumulator` step on dp x tp: the bytes of its agreement all-gathers."""
    import torch

    from tests.support.mesh_cases import _fsdp_model, _my_batch, get_mesh
    from tests.support.models import lm_loss_sum
    from wholebatch import Accumulator

    mesh = get_mesh(TP.shape)
    model = _fsdp_model(TP, mesh)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), mesh=mesh,
                      batch_dims=("dp",))  # fmt: skip
    counter = Counter()
    with count_collectives(counter):  # FSDP2's and tensor parallel's own calls are not counted
        acc.step(_my_batch(TP, mesh, 0), lm_loss_sum)
    return {"sent": counter.sent["all_gather"], "received": counter.received["all_gather"]}


def test_planned_accumulator_rows_equal_counted_on_every_rank() -> None:
    p = plan(PlanConfig(loss="tokens", batch=64, mesh=MESH, params=0))
    rows = [c for c in p.collectives if c.name.startswith("agree")]
    assert [c.dims for c in rows] == ["dp x tp", "dp x tp"]  # over every rank of the mesh
    want = {"sent": sum(c.sent for c in rows), "received": sum(c.received for c in rows)}
    got = run_ranks(W, _count_accumulator_rows, timeout=TIMEOUT)
    assert all(g == want for g in got), (want, got)
