"""verify on a device mesh, the single-process parts: the `--mesh` config, the spec's
mesh fields, and the layout verify deals rows by (which ranks replicate which shard).

The runs themselves: tests/distributed/test_verify_mesh.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from wholebatch.errors import WholebatchError
from wholebatch.verify import TrainerSpec, VerifyConfig, VerifySpec
from wholebatch.verify.mesh import replica_groups, replica_shape, row_dims, shard_of

TARGETS = "tests/support/verify_mesh_targets.py"


def test_config_mesh_is_parsed() -> None:
    assert VerifyConfig(mesh="dp=2,tp=2").mesh == "dp=2,tp=2"
    with pytest.raises(WholebatchError, match="NAME=SIZE"):
        VerifyConfig(mesh="dp2,tp=2")


def test_cli_bad_mesh_is_a_usage_error() -> None:
    from wholebatch.cli.main import main

    assert main(["verify", f"{TARGETS}:exact", "--mesh", "dp=two"]) == 2


def _tiny_spec(**kw: Any) -> VerifySpec:
    import torch

    return VerifySpec(
        build_model=lambda: torch.nn.Linear(2, 1),
        batch=torch.zeros(4, 2),
        step=lambda m, o, mbs: None,
        reference_loss=lambda m, b: m(b).sum(),
        **kw,
    )


def test_spec_mesh_fields_are_checked() -> None:
    with pytest.raises(WholebatchError, match=r"batch_dims \['data'\] are not dims"):
        _tiny_spec(mesh="dp=2,tp=2", batch_dims=("data",))
    with pytest.raises(WholebatchError, match="is a string"):
        _tiny_spec(mesh="dp=2,tp=2", batch_dims="dp")
    with pytest.raises(WholebatchError, match="NAME=SIZE"):
        _tiny_spec(mesh="dp")


def _tiny_trainer(**kw: Any) -> TrainerSpec:
    import torch

    return TrainerSpec(
        build_model=lambda: torch.nn.Linear(2, 1),
        batch=torch.zeros(4, 2),
        train=lambda run: None,
        reference_loss=lambda m, b: m(b).sum(),
        **kw,
    )


def test_trainer_mesh_fields_are_checked() -> None:
    spec = _tiny_trainer(mesh="dp=2,tp=2", batch_dims=("dp",), parallelize=lambda m, mesh: m)
    assert spec.mesh == "dp=2,tp=2" and spec.batch_dims == ("dp",)
    with pytest.raises(WholebatchError, match=r"TrainerSpec: batch_dims \['data'\] are not dims"):
        _tiny_trainer(mesh="dp=2,tp=2", batch_dims=("data",))
    with pytest.raises(WholebatchError, match="TrainerSpec: parallelize must be callable"):
        _tiny_trainer(mesh="dp=2", parallelize=3)


def test_trainer_rows_must_divide_by_the_row_shards() -> None:
    # 12 rows on dp=2 x K=4 (B·K = 8): a trainer's fixed per-device batch cannot cover them;
    # checked in the parent before any process starts (a step only needs B·K rows).
    from wholebatch.verify import TargetError
    from wholebatch.verify.runner import _check_mesh_split
    from wholebatch.verify.worker import Description

    def desc(kind: str) -> Description:
        return Description(
            kind=kind, wrap="trainer", rows=12, equal_rows=0, has_dropout=False,
            has_equal=False, rtol=None, mesh="dp=2,tp=2", batch_dims=("dp",),
        )  # fmt: skip

    with pytest.raises(TargetError, match="must divide by B·K = 2·4 = 8"):
        _check_mesh_split("t.py:f", "dp=2,tp=2", desc("trainer"), 4)
    _check_mesh_split("t.py:f", "dp=2,tp=2", desc("step"), 4)  # 12 >= 8 rows: fine
    _check_mesh_split("t.py:f", "dp=2,tp=2", desc("trainer"), 3)  # 12 = 2·3·2


def test_layout() -> None:
    shape = {"dp": 2, "tp": 2}
    assert row_dims(shape, None) == ("dp",)
    assert row_dims({"dp": 2, "cp": 2, "pp": 2}, None) == ("dp",)
    assert [shard_of(shape, ("dp",), r) for r in range(4)] == [0, 0, 1, 1]
    assert replica_groups(shape, ("dp",)) == [[0, 1], [2, 3]]
    assert replica_groups({"dp": 2, "cp": 2}, ("dp",)) == []  # cp ranks hold other tokens
    assert replica_shape("dp=2,tp=2", None) == "dp=2,tp=1"
    assert replica_shape("pp=2,dp=2", None) == ""
    assert replica_shape("dp=2,cp=2", ("dp",)) == "dp=2,cp=1"


def test_current_mesh_outside_a_run() -> None:
    from wholebatch.verify.mesh import current_mesh

    with pytest.raises(WholebatchError, match="only while wholebatch verify runs"):
        current_mesh()
