"""`wholebatch.comm.launch`: torchrun's launcher returns each rank's value; a rank's exception becomes one LaunchError."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from wholebatch.comm.launch import LaunchError, LaunchSpec, launch
from wholebatch.errors import WholebatchError


def _who_am_i(tag: str) -> tuple[str, int, int, str | None]:
    return tag, dist.get_rank(), dist.get_world_size(), os.environ.get("OMP_NUM_THREADS")


def _fails_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    return 0


def test_launch_returns_each_ranks_value_in_rank_order() -> None:
    values = launch(_who_am_i, ("x",), spec=LaunchSpec(nproc=3, timeout_s=30))
    assert values == [("x", 0, 3, "1"), ("x", 1, 3, "1"), ("x", 2, 3, "1")]


def test_a_failing_rank_is_one_clear_error() -> None:
    with pytest.raises(
        LaunchError, match=r"rank 1 of 2 failed: ValueError: rank 1 refuses"
    ) as info:
        launch(_fails_on_rank_1, spec=LaunchSpec(nproc=2, timeout_s=30), name="t")
    assert info.value.rank == 1
    assert "_fails_on_rank_1" in info.value.traceback


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"nproc": 0}, "nproc=0"),
        ({"backend": "mpi"}, "backend='mpi'"),
        ({"threads": 0}, "threads=0"),
    ],
)
def test_launch_spec_validates(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(WholebatchError, match=needle):
        LaunchSpec(**kwargs)  # type: ignore[arg-type]
