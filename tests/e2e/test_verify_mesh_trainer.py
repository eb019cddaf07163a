"""`wholebatch verify --mesh dp=2,tp=2` on trainers that own the split: Lightning 2.6.6 and a plain loop.

One command (4 gloo processes per run, --json) runs the `TrainerSpec` targets of
tests/support/verify_mesh_trainers.py: TinyLM in float64 under Lightning's real
`ModelParallelStrategy` (FSDP2 on its data-parallel dim, Colwise/Rowwise tensor
parallel on its tensor-parallel dim, `accumulate_grad_batches=2`), a ragged
batch (token counts differ per micro-batch, one row holds no target), each
compared with one process on the whole batch:

- `WholeBatchAccumulation(group=<dp group>)` passes; so does the callback on the
  world (its W and N both count the tp replicas, and cancel);
- the mutation counting the window's items over the world while FSDP2 averages
  over dp only is named `counted-over-tp`;
- the mutation sharding the loader by the global rank (the tp replicas of one
  data shard read different rows) is named `replicas-fed-different-data`;
- a plain loop over `run.shard` with `Accumulator(mesh=run.mesh)` passes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.test_cli import run_cli
from tests.support.peers import SKIP_REASON, peer_root

pytestmark = pytest.mark.skipif(
    peer_root("lightning") is None, reason=SKIP_REASON.format("lightning")
)

TARGETS = "tests/support/verify_mesh_trainers.py"
EXPECTED: dict[str, str | None] = {
    f"{TARGETS}:lightning_exact": None,
    f"{TARGETS}:lightning_world_callback": None,
    f"{TARGETS}:lightning_count_world": "counted-over-tp",
    f"{TARGETS}:lightning_rank_sampler": "replicas-fed-different-data",
    f"{TARGETS}:loop_exact": None,
}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    result = run_cli(
        "verify", *EXPECTED, "--mesh", "dp=2,tp=2", "--micro-batches", "2", "--json",
        timeout=280,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    return {r["target"]: r for r in json.loads(result.stdout)["results"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", list(EXPECTED))
def test_mesh_trainer_verdicts(reports: dict[str, dict[str, Any]], target: str) -> None:
    report, code = reports[target], EXPECTED[target]
    assert report["world_size"] == 4 and report["wrap"] == "mesh dp=2,tp=2", report
    codes = [d["code"] for d in report["diagnoses"]]
    main = report["variants"][0]
    if code is None:
        assert report["passed"], (codes, report["error"])
        # float64: the floor is a few eps; one step on every rank
        assert main["max_rel_err"] < 1e-12 and report["evidence"]["step_calls"] == [1] * 4
        return
    assert not report["passed"]
    assert codes[0] == code, report["diagnoses"]
    assert not {"scaled", "wrong-count", "uncompensated-mean"} & set(codes), codes
    again = [c for c in report["variants"] if c["variant"].startswith("replicas 1")]
    assert again and again[0]["passed"], report["variants"]  # exact at dp=2,tp=1


@pytest.mark.timeout(300)
def test_mesh_trainer_messages(reports: dict[str, dict[str, Any]]) -> None:
    counted = reports[f"{TARGETS}:lightning_count_world"]["diagnoses"][0]["message"]
    assert "exactly 1/2" in counted and "dp=2,tp=1" in counted
    fed = reports[f"{TARGETS}:lightning_rank_sampler"]
    text = fed["diagnoses"][0]["message"]
    assert "ranks 0 and 1" in text and "DistributedSampler" in text
    assert fed["evidence"]["shards"] == [0, 0, 1, 1]
    # Each rank's forwards held 3 recognised rows of its shard's 6: said, not guessed.
    assert "dealt the rows over more ranks than the data shards" in fed["evidence"]["rows_note"]
