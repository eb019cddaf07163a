"""`Accumulator.step(..., normalize=)` on a device mesh: 4 gloo ranks against one process.

Distributed tier, the shared 4-rank world of tests/distributed/test_mesh_dist.py
(tests.support.harness), a hard timeout per call. dp2 x tp2 (FSDP2 on dp, tensor
parallel on tp) and dp2 x cp2 (FSDP2 on dp_cp; every sequence's positions cut
in two over cp, so its tokens straddle the cp ranks), every mode ("token",
"sequence", "constant", "group"), float64, ragged sequences per rank and
micro-batch, an empty micro-batch (step 0, shard 0), two SGD steps: parameters,
the reported loss and N equal one process on the whole batch.

Mutations the same assertion rejects: the normalisation table agreed per rank,
over every dim (tp replicas counted twice) and over dp only (the cp halves of
each sequence dropped). Replicas reporting different tables, and cp left out of
the batch dims, are the same clear error on every rank.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.distributed.test_mesh_dist import CP, TIMEOUT, TP, W, same_error_everywhere
from tests.support.harness import run_ranks, run_ranks_outcomes
from tests.support.mesh_cases import params_close
from tests.support.mesh_normalize import MODES, NormResult, reference, run_modes

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

# float64: each step's loss is a sum of <= ~60 token terms of size <= ~5 with weights
# 1/(S n_s) or 1/(G n_g); two SGD steps keep round-off near 1e-15. Every mutation is
# off by >= 1e-3.
TOL = 1e-12

MESHES = {"dp2xtp2": TP, "dp2xcp2": CP}
# The wrong dims for each mesh: per rank, and the dims that miss or double a shard.
WRONG = {"dp2xtp2": [(), ("dp", "tp")], "dp2xcp2": [(), ("dp",)]}


def _close(got: NormResult, want: NormResult) -> list[str]:
    bad = params_close(got.params, want.params, TOL)
    for s, (a, b) in enumerate(zip(got.losses, want.losses, strict=True)):
        if abs(a - b) > TOL * max(1.0, abs(b)):
            bad.append(f"loss of step {s}: {a} vs {b}")
    if got.items != want.items:
        bad.append(f"items {got.items} vs {want.items}")
    return bad


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_every_mode_on_the_mesh_equals_one_process(mesh: str) -> None:
    case = MESHES[mesh]
    refs = {mode: reference(case, mode) for mode in MODES}
    results = run_ranks(W, run_modes, case, MODES, timeout=TIMEOUT)
    for r, got in enumerate(results):
        for mode in MODES:
            assert got[mode].params, f"rank {r} {mode}: no parameters"
            assert _close(got[mode], refs[mode]) == [], f"rank {r} {mode}"
    # The modes differ from one another here (the comparison can tell them apart).
    assert params_close(refs["sequence"].params, refs["token"].params, 1e-6)
    assert params_close(refs["group"].params, refs["sequence"].params, 1e-6)


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_a_table_past_the_inline_rows_takes_its_own_all_gather(mesh: str) -> None:
    # 2 inline rows: every rank holds more, so the rows travel in one more all-gather.
    case = MESHES[mesh]
    modes = ("sequence", "group")
    results = run_ranks(W, run_modes, case, modes, None, 2, timeout=TIMEOUT)
    for r, got in enumerate(results):
        for mode in modes:
            assert _close(got[mode], reference(case, mode)) == [], f"rank {r} {mode}"


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_a_table_agreed_over_the_wrong_dims_is_caught(mesh: str) -> None:
    # "sequence": the table's mode that a partial table cannot turn into an error ("group"
    # raises on the rank whose own rows leave a group empty; "token" and "constant" have
    # no table). The same `mesh_table` builds both modes' tables.
    case = MESHES[mesh]
    ref = reference(case, "sequence")
    for dims in WRONG[mesh]:
        results = run_ranks(W, run_modes, case, ("sequence",), dims, timeout=TIMEOUT)
        assert any(_close(got["sequence"], ref) for got in results), dims


def test_tp_replicas_with_different_tables_are_an_error_on_every_rank() -> None:
    wrong = dataclasses.replace(TP, replica_differs=True)  # rank 1 reads other sequence ids
    # The inputs' fingerprint sees it first (before the counting pass); without it the
    # tables' own check still refuses, in the counting pass before any forward.
    outcomes = run_ranks_outcomes(W, run_modes, wrong, ("sequence",), timeout=TIMEOUT)
    same_error_everywhere(outcomes, "were fed different inputs: micro_batches[0]")
    blind = dataclasses.replace(wrong, check_inputs=False)
    outcomes = run_ranks_outcomes(W, run_modes, blind, ("sequence",), timeout=TIMEOUT)
    same_error_everywhere(
        outcomes, "normalize: ranks [0, 1] replicate the same rows", "('tp',)", "tables"
    )


def test_cp_left_out_of_the_batch_dims_is_an_error_on_every_rank() -> None:
    # cp is then a replica dim: its ranks hold the other halves of the sequences.
    wrong = dataclasses.replace(CP, batch_dims=("dp",))
    outcomes = run_ranks_outcomes(W, run_modes, wrong, ("group",), timeout=TIMEOUT)
    same_error_everywhere(outcomes, "ranks [0, 1] replicate the same rows", "('cp',)")


def _shards_agree() -> bool:
    from tests.support.mesh_cases import get_mesh
    from wholebatch.comm.mesh import MeshSplit

    ok = True
    for shape, dims in [(TP.shape, ("dp",)), (CP.shape, ("dp", "cp")), (CP.shape, ("cp", "dp"))]:
        split = MeshSplit(mesh=get_mesh(shape), batch_dims=dims)
        ok &= split.batch_indices() == {r: split.batch_index(r) for r in range(W)}
    return ok


def test_every_ranks_data_shard_read_in_one_pass_is_meshsplits() -> None:
    assert run_ranks(W, _shards_agree, timeout=TIMEOUT) == [True] * W
