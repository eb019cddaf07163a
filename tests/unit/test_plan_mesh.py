"""`wholebatch plan` on a device mesh: the arithmetic, one process, no torch needed.

Each dim's rule (planner/mesh.py): dp, dp_replicate and cp split the items (the loss
runs over their B ranks), tp replicates them, pp puts the loss on the last stage;
parameters, gradients and optimizer state are 1/(tp x pp) per rank, FSDP2 keeping
1/(dp x cp) of that; the gradient collectives per data-parallel dim in closed form.
The flat world is the mesh `dp_replicate=W`.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from wholebatch.errors import WholebatchError
from wholebatch.planner import PlanConfig, plan
from wholebatch.planner.mesh import ENGINE_ROW_FIELDS, PlanMesh

P = 7e9  # parameters
BASE = {"loss": "clip", "batch": 4096, "dim": 512, "act_mib": 1.0, "params": P}


def _loss_rows(p: object) -> list[tuple[str, str, int, int]]:
    """The loss's collectives as (name, phase, sent, received), without their dims."""
    return [
        (c.name, c.phase, c.sent, c.received)
        for c in p.collectives  # type: ignore[attr-defined]
        if not c.name.startswith(("DDP", "FSDP2", "HSDP", "agree K", "agree N"))
    ]


def _row(p: object, start: str) -> object:
    (found,) = [c for c in p.collectives if c.name.startswith(start)]  # type: ignore[attr-defined]
    return found


def test_the_flat_world_is_the_mesh_dp_replicate_w() -> None:
    flat = plan(PlanConfig(**BASE, world=8))
    mesh = plan(PlanConfig(**BASE, mesh="dp_replicate=8"))
    assert mesh.config.world == 8 and mesh.config.shards == 8
    assert [dataclasses.replace(c, dims="") for c in mesh.collectives] == list(flat.collectives)
    assert mesh.memory == flat.memory and mesh.micro_batches == flat.micro_batches
    assert {c.dims for c in mesh.collectives} == {"dp_replicate"}


def test_tp_replicates_the_items_and_cp_splits_them() -> None:
    # tp: the loss runs over dp only, every tp rank on the same rows: the bytes of dp alone.
    dp = plan(PlanConfig(**BASE, world=2))
    tp = plan(PlanConfig(**BASE, mesh="dp=2,tp=4"))
    assert tp.config.world == 8 and tp.config.shards == 2
    assert tp.rows_per_rank == dp.rows_per_rank == (2048, 2048)
    assert _loss_rows(tp) == _loss_rows(dp)
    assert {c.dims for c in tp.collectives} == {"dp"}
    # cp: dp x cp ranks hold different items, the loss gathers over all four.
    cp = plan(PlanConfig(**BASE, mesh="dp=2,cp=2,tp=2"))
    assert cp.config.shards == 4 and cp.rows_per_rank == (1024, 1024)
    assert _loss_rows(cp) == _loss_rows(plan(PlanConfig(**BASE, world=4)))
    assert {c.dims for c in cp.collectives} == {"dp x cp"}
    # Mutation: counting tp as a batch dim would plan 8 shards, other bytes.
    assert _loss_rows(tp) != _loss_rows(plan(PlanConfig(**BASE, world=8)))


def test_state_is_split_over_tp_pp_and_fsdp2s_dp_x_cp() -> None:
    def static(mesh: str) -> int:
        return plan(PlanConfig(**BASE, mesh=mesh)).memory.static

    full = int(P * 16)
    assert static("dp_replicate=4") == full  # DDP: every rank holds all of it
    assert static("dp_replicate=2,tp=2") == int(P * 16 / 2)
    assert static("dp=4") == int(P * 16 / 4)  # FSDP2 on dp
    assert static("dp=2,cp=2,tp=2,pp=2") == int(P * 16 / (2 * 2 * 2 * 2))
    assert static("dp_replicate=2,dp=2,tp=2") == int(P * 16 / (2 * 2))  # HSDP: shard on dp only


def test_gradient_collectives_per_data_parallel_dim_in_closed_form() -> None:
    c = PlanConfig(**BASE, mesh="dp_replicate=2,dp=2,cp=2,tp=2", grad_bytes=2, param_bytes=2)
    p = plan(c)
    mine = P / 2  # tp = 2: a rank's part of the parameters
    s = 4  # FSDP2 over dp x cp
    for start in ("FSDP2 parameter all-gather (forward)", "FSDP2 parameter all-gather (backward"):
        row = _row(p, start)
        assert row.sent == row.received == round((s - 1) / s * mine * 2)  # type: ignore[attr-defined]
        assert row.dims == "dp x cp"  # type: ignore[attr-defined]
    rs = _row(p, "FSDP2 gradient reduce-scatter")
    assert rs.sent == round((s - 1) / s * mine * 2) and rs.phase == "backward"  # type: ignore[attr-defined]
    ar = _row(p, "HSDP gradient all-reduce")  # the shard, all-reduced over dp_replicate (R = 2)
    assert ar.sent == round(2 * (2 - 1) / 2 * round(mine / s) * 2)  # type: ignore[attr-defined]
    assert ar.dims == "dp_replicate"  # type: ignore[attr-defined]
    # DDP alone (no dp, no cp): one all-reduce of the rank's tp part; tp and pp add none.
    ddp = plan(PlanConfig(**BASE, mesh="dp_replicate=4,tp=2,pp=2"))
    grads = [x.name for x in ddp.collectives if x.name.startswith(("DDP", "FSDP2", "HSDP"))]
    assert grads == ["DDP gradient all-reduce (ring model)"]
    assert _row(ddp, "DDP").sent == round(2 * 3 / 4 * P / 4 * 4)  # type: ignore[attr-defined]
    # Mutation: the flat plan's all-reduce of every parameter is 4x the tp x pp part's.
    assert plan(PlanConfig(**BASE, world=4)).collectives[-1].sent == 4 * _row(ddp, "DDP").sent  # type: ignore[attr-defined]


def test_pipeline_stages_the_loss_on_the_last() -> None:
    p = plan(PlanConfig(**BASE, mesh="dp=2,pp=4"))
    assert p.other_stages_peak == p.memory.static + p.memory.activations
    assert p.memory.peak > p.other_stages_peak  # the last stage also holds the loss
    assert "last pipeline stage" in p.format()
    assert plan(PlanConfig(**BASE, mesh="dp=2")).other_stages_peak is None


def test_engine_rows_on_a_mesh_run_over_every_rank() -> None:
    p = plan(PlanConfig(loss="tokens", batch=64, mesh="dp=2,cp=2,tp=2", params=0))
    begin, finish = _row(p, "agree K"), _row(p, "agree N")
    w = 8
    fingerprint = 6  # tp > 1: the replicas' input fingerprint rides on begin (train/feeds.py)
    assert begin.sent == (w - 1) * (ENGINE_ROW_FIELDS["accumulator"]["begin"] + fingerprint) * 8  # type: ignore[attr-defined]
    assert finish.sent == (w - 1) * ENGINE_ROW_FIELDS["accumulator"]["finish"] * 8  # type: ignore[attr-defined]
    assert begin.dims == finish.dims == "dp x cp x tp"  # type: ignore[attr-defined]
    pipe = plan(PlanConfig(loss="tokens", batch=64, mesh="pp=2,dp=2", params=0))
    assert _row(pipe, "agree K").sent == 3 * ENGINE_ROW_FIELDS["pipeline"]["begin"] * 8  # type: ignore[attr-defined]
    # A flat world keeps its plan: no engine rows (as before meshes).
    assert plan(PlanConfig(loss="tokens", batch=64, world=8, params=0)).collectives == ()


def test_bytes_by_dims_add_up_and_reach_json_and_the_table() -> None:
    p = plan(PlanConfig(**BASE, mesh="dp_replicate=2,dp=2,tp=2"))
    by = p.bytes_by_dims()
    assert list(by) == ["dp_replicate x dp", "dp", "dp_replicate"]
    total = p.bytes()
    assert (sum(s for s, _ in by.values()), sum(r for _, r in by.values())) == total
    out = json.loads(json.dumps(p.to_json()))
    assert out["bytes_per_dims"]["dp"] == {"sent": by["dp"][0], "received": by["dp"][1]}
    text = p.format()
    assert "bytes per rank per step by mesh dims:" in text and "dp_replicate x dp" in text
    assert "B = 4 item shards" in text


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"mesh": "dp=2,ep=2"}, "dims ['ep'] are not planned"),
        ({"mesh": "dp=2;tp=2"}, "is not NAME=SIZE"),
        ({"mesh": "dp=2,tp=2", "world": 16}, "world=16 differs from the 4 ranks"),
        ({"mesh": "dp=2,tp=2", "world": 8}, "world=8 differs from the 4 ranks"),
        ({"mesh": "dp=2,tp=2", "plots": "out"}, "plot without mesh"),
        ({"mesh": "dp=2,tp=2", "batch": 1}, "smaller than the 2 item shards"),
        ({"mesh": "dp=2", "param_bytes": 0}, "param_bytes=0 must be a positive int"),
    ],
)
def test_bad_mesh_config_names_the_field(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(WholebatchError, match=None) as err:
        PlanConfig(**{**BASE, **kw})  # type: ignore[arg-type]
    assert needle in str(err.value)


def test_sizes_on_a_mesh_are_per_item_shard() -> None:
    c = PlanConfig(**BASE, mesh="dp=2,tp=2")
    assert plan(c, sizes=[3000, 1096]).rows_per_rank == (1096, 3000)
    with pytest.raises(WholebatchError, match=r"sizes must have 2 \(item shards\) entries"):
        plan(c, sizes=[1024] * 4)


def test_cli_mesh_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from wholebatch.cli import main

    assert main(["plan", "--mesh", "dp=2,tp=2,cp=1,pp=1", "--params", "1e9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["world"] == 4 and out["rows_per_rank"] == [16384, 16384]
    assert main(["plan", "--mesh", "dp=2,xp=2"]) == 2
    assert "--mesh='dp=2,xp=2': dims ['xp'] are not planned" in capsys.readouterr().err


def test_plan_mesh_parses_like_verify() -> None:
    m = PlanMesh.parse(" pp=2, dp=3 ,tp=1")
    assert m.dims == (("pp", 2), ("dp", 3), ("tp", 1))
    assert (m.world, m.batch, m.shard, m.model_split) == (6, 3, 3, 2)
    assert (
        m.label(("dp", "tp")) == "dp"
        and m.describe() == "pp=2 (stages), dp=3 (batch), tp=1 (replica)"
    )
