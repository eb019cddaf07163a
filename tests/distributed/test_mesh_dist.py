"""The batch split over a 2 x 2 device mesh, on 4 real gloo ranks, against one process.

Distributed tier (the heaviest tests of the suite): every test shares one 4-rank
world (tests.support.harness), each call has a hard timeout. float64 throughout; data
ragged per rank and micro-batch, with an empty micro-batch (step 0, shard 0).

- dp2 x tp2: FSDP2 on dp, tensor parallel (Colwise/Rowwise) on tp.
- dp2 x cp2: FSDP2 on the flattened dp_cp dim; each cp rank holds half of every
  sequence's tokens (user-level sequence sharding; torch's context_parallel is CUDA-only).
- pp2 x dp2: torch.distributed.pipelining GPipe and 1F1B, FSDP2 on dp per stage.

Each shape has its mutations, which the same assertions (or a clear error on
every rank) must reject: counting over tp, dropping cp's counts, one pipeline
stage not rescaled, the pipeline's own mean-of-means scaling, replicas fed
different rows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.harness import RankError, run_ranks, run_ranks_outcomes
from tests.support.mesh_cases import (
    MeshCase,
    MeshResult,
    local,
    params_close,
    ragged_steps,
    reference,
    run_fsdp,
    run_misfed,
    run_pipeline,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

W = 4
TIMEOUT = 90.0  # seconds per 4-rank call; the first also starts the world (~10 s on 2 cores)

# float64: a loss is a sum of <= ~60 token terms of size <= ~5 and each gradient entry a
# sum of as many products; two SGD steps keep round-off near 1e-14. 1e-10 leaves room and
# still rejects every mutation by orders of magnitude (theirs are >= 1e-3).
TOL = 1e-10

TP = MeshCase(shape=(("dp", 2), ("tp", 2)), batch_dims=("dp",), steps=ragged_steps(2, 3, 2, seed=1))
CP = MeshCase(
    shape=(("dp", 2), ("cp", 2)), batch_dims=("dp", "cp"), steps=ragged_steps(2, 3, 2, seed=2)
)
PP = MeshCase(
    shape=(("pp", 2), ("dp", 2)),
    batch_dims=("dp",),
    steps=ragged_steps(2, 3, 2, seed=3, per_mb=2),
)


def assert_whole_batch(results: list[MeshResult], ref: MeshResult, *, engine_stats: bool) -> None:
    """Every rank's parameters, losses and counts equal the one-process reference."""
    for r, got in enumerate(results):
        assert got.params, f"rank {r} reported no parameters"
        assert params_close(got.params, ref.params, TOL) == [], f"rank {r}"
        assert got.items == ref.items, f"rank {r}"
        for a, b in zip(got.losses, ref.losses, strict=True):
            assert abs(a - b) <= TOL * max(1.0, abs(b)), f"rank {r}: loss {a} vs {b}"
        if engine_stats:
            for a, b in zip(got.grad_norms, ref.grad_norms, strict=True):
                assert abs(a - b) <= TOL * max(1.0, abs(b)), f"rank {r}: grad norm {a} vs {b}"


def assert_rejected(results: list[MeshResult], ref: MeshResult) -> None:
    """A mutation: some rank's parameters differ from the reference."""
    assert any(params_close(got.params, ref.params, TOL) for got in results)


def same_error_everywhere(outcomes: list[object], *needles: str) -> str:
    """Every rank raised the same WholebatchError; it contains every needle."""
    assert all(isinstance(o, RankError) for o in outcomes), outcomes
    errors = [o for o in outcomes if isinstance(o, RankError)]
    assert {e.type_name for e in errors} == {"WholebatchError"}, errors
    assert len({e.message for e in errors}) == 1, [e.message for e in errors]
    for needle in needles:
        assert needle in errors[0].message, errors[0].message
    return errors[0].message


# ---------------------------------------------------------------------------
# dp2 x tp2
# ---------------------------------------------------------------------------


def test_dp_tp_accumulator_matches_whole_batch() -> None:
    case = dataclasses.replace(TP, max_grad_norm=0.5)  # clipping active: the norm matters
    ref = reference(case)
    results = run_ranks(W, run_fsdp, case, timeout=TIMEOUT)
    assert_whole_batch(results, ref, engine_stats=True)
    # One gradient reduction (FSDP2's reduce-scatter over dp) per step, on every rank.
    assert all(got.reductions == [1, 1] for got in results)


def test_dp_tp_hand_loop_matches_and_counting_over_tp_does_not() -> None:
    ref = reference(TP)
    assert_whole_batch(run_ranks(W, run_fsdp, TP, timeout=TIMEOUT), ref, engine_stats=False)
    wrong = dataclasses.replace(TP, engine="hand_count_world")  # items x tp
    results = run_ranks(W, run_fsdp, wrong, timeout=TIMEOUT)
    assert_rejected(results, ref)
    assert results[0].items == [2 * n for n in ref.items]


def test_dp_tp_naming_tp_a_batch_dim_is_an_error_on_every_rank() -> None:
    wrong = dataclasses.replace(TP, batch_dims=("dp", "tp"))
    outcomes = run_ranks_outcomes(W, run_fsdp, wrong, timeout=TIMEOUT)
    same_error_everywhere(outcomes, "batch dims ['tp']", "leave them out of batch_dims")


def test_dp_tp_replicas_fed_different_rows_is_an_error_on_every_rank() -> None:
    wrong = dataclasses.replace(TP, replica_differs=True)  # rank 1 (tp 1 of dp 0) misfed
    outcomes = run_ranks_outcomes(W, run_fsdp, wrong, timeout=TIMEOUT)
    same_error_everywhere(outcomes, "replicate the same rows", "('tp',)", "ranks [0, 1]")


def test_dp_tp_replicas_fed_other_ids_with_the_same_labels_are_refused_before_any_forward() -> None:
    # tp rank 1 of each data shard reads (ids + 1) % V with the same labels: the Rowwise
    # all-reduce hands both replicas the same loss and count, so only the inputs can tell.
    misfed = dataclasses.replace(TP, feed="shifted_ids")
    got = run_ranks(W, run_misfed, misfed, timeout=TIMEOUT)
    errors = {g["error"] for g in got}
    assert len(errors) == 1 and None not in errors, errors  # the same error on every rank
    message = got[0]["error"]
    for needle in (
        "Accumulator.step: ranks [0, 1] replicate the same rows",
        "were fed different inputs: micro_batches[0][0] (int64, shape (",
        "has sums {0: ",
        "shard the data by the mesh's dp coordinate",
    ):
        assert needle in message, message
    assert all(g["forwards"] == 0 and g["unchanged"] for g in got)  # refused before any forward
    # The mutation: the fingerprint off, the step runs with the same loss and count on every
    # rank, is not the whole batch's, and the replicas' copies of the embedding drift apart.
    blind = dataclasses.replace(misfed, check_inputs=False)
    results = run_ranks(W, run_fsdp, blind, timeout=TIMEOUT)
    assert len({(tuple(r.losses), tuple(r.items)) for r in results}) == 1
    assert_rejected(results, reference(TP))
    assert not torch.equal(
        local(results[0].params["emb.weight"]), local(results[1].params["emb.weight"])
    )


def test_dp_tp_replica_rows_of_another_shape_are_refused_without_an_abort() -> None:
    # Without the fingerprint tensor parallel's own all-reduce aborts the process (gloo:
    # "Received data size doesn't match"); now every rank raises before any forward.
    got = run_ranks(W, run_misfed, dataclasses.replace(TP, feed="wider"), timeout=TIMEOUT)
    assert len({g["error"] for g in got}) == 1
    message = got[0]["error"]
    assert "ranks [0, 1] replicate the same rows" in message, message
    assert "micro_batches[0][0] has shapes {0: (1, 8), 1: (1, 9)}" in message, message
    assert all(g["forwards"] == 0 and g["unchanged"] for g in got)


def test_hsdp_two_batch_dims_matches_whole_batch() -> None:
    # fully_shard on a 2-D (replicate, shard) mesh: both dims split the batch and
    # FSDP2 averages over both (factor 4); 4 data shards.
    case = MeshCase(
        shape=(("rep", 2), ("shard", 2)),
        batch_dims=("rep", "shard"),
        steps=ragged_steps(4, 3, 2, seed=4),
        max_grad_norm=0.5,
    )
    results = run_ranks(W, run_fsdp, case, timeout=TIMEOUT)
    assert_whole_batch(results, reference(case), engine_stats=True)


# ---------------------------------------------------------------------------
# dp2 x cp2 (sequence sharding)
# ---------------------------------------------------------------------------


def test_dp_cp_accumulator_matches_whole_batch() -> None:
    ref = reference(CP)
    results = run_ranks(W, run_fsdp, CP, timeout=TIMEOUT)
    assert_whole_batch(results, ref, engine_stats=True)
    assert all(got.reductions == [1, 1] for got in results)  # one reduce-scatter over dp_cp


def test_dp_cp_hand_loop_matches_and_dropping_cp_counts_does_not() -> None:
    ref = reference(CP)
    hand = dataclasses.replace(CP, engine="hand")
    assert_whole_batch(run_ranks(W, run_fsdp, hand, timeout=TIMEOUT), ref, engine_stats=False)
    wrong = dataclasses.replace(CP, engine="hand_count_dp")
    assert_rejected(run_ranks(W, run_fsdp, wrong, timeout=TIMEOUT), ref)


def test_dp_cp_leaving_cp_out_of_batch_dims_is_an_error_on_every_rank() -> None:
    # cp is then a replica dim: its ranks hold different tokens, so they disagree.
    wrong = dataclasses.replace(CP, batch_dims=("dp",))
    outcomes = run_ranks_outcomes(W, run_fsdp, wrong, timeout=TIMEOUT)
    same_error_everywhere(outcomes, "replicate the same rows", "('cp',)", "context parallel")


# ---------------------------------------------------------------------------
# pp2 x dp2 (torch.distributed.pipelining)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp_dp_accumulator_matches_whole_batch(schedule: str) -> None:
    case = dataclasses.replace(PP, schedule=schedule, max_grad_norm=0.5)
    ref = reference(case)
    results = run_ranks(W, run_pipeline, case, timeout=TIMEOUT)
    assert_whole_batch(results, ref, engine_stats=True)
    # Stage 0 (ranks 0, 1) owns the embedding and hidden layer, stage 1 the output.
    assert set(results[0].params) == {"emb.weight", "hidden.weight", "hidden.bias"}
    assert set(results[2].params) == {"out.weight", "out.bias"}
    assert all(got.reductions == [1, 1] for got in results)  # per stage, over dp


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp_dp_hand_loop_matches_and_its_mutations_do_not(schedule: str) -> None:
    ref = reference(PP)
    hand = dataclasses.replace(PP, schedule=schedule, engine="hand")
    assert_whole_batch(run_ranks(W, run_pipeline, hand, timeout=TIMEOUT), ref, engine_stats=False)
    for engine in ("hand_stage0_unscaled", "torch_mean"):
        wrong = dataclasses.replace(PP, schedule=schedule, engine=engine)
        results = run_ranks(W, run_pipeline, wrong, timeout=TIMEOUT)
        assert_rejected(results, ref)
        if engine == "hand_stage0_unscaled":  # the unscaled stage is off (stage 1 follows)
            assert params_close(results[0].params, ref.params, TOL) != []


# ---------------------------------------------------------------------------
# The split itself: shape, the rescale factor, validation (the same on every rank)
# ---------------------------------------------------------------------------


def test_split_shape_factors_and_errors() -> None:
    from tests.support.mesh_cases import split_facts

    facts = run_ranks(W, split_facts, timeout=TIMEOUT)
    # mesh [[0, 1], [2, 3]] over (dp, tp): rank r = 2 dp + tp.
    for r, f in enumerate(facts):
        assert f["coordinate"] == {"dp": r // 2, "tp": r % 2}
        assert f["batch_index"] == r // 2
        assert f["replica_dims"] == ("tp",) and f["batch_size"] == 2
        assert f["dims_of_tp_group"] == ("tp",) and f["dims_of_world"] == ("dp", "tp")
        assert f["describe"] == "dp=2 (batch), tp=2 (replica)"
        assert f["batch_group"] == [r % 2, 2 + r % 2]  # the dp ranks at this tp coordinate
        assert f["cp_batch_group"] == [0, 1, 2, 3]  # dp x cp flattened
        assert f["factors"] == {
            "dp-mean-None": 2.0,
            "dpxtp-mean-None": 2.0,
            "dp-sum-None": 1.0,
            "dpxtp-sum-None": 0.5,
            "dp-mean-8.0": 8.0,
        }
    errors = facts[0]["errors"]
    assert all(f["errors"] == errors for f in facts)  # the same text on every rank
    assert (
        "batch_dims ['cp'] are not dims of the mesh; its dims are ('dp', 'tp')" in errors["unknown"]
    )
    assert "batch_dims is empty" in errors["empty"]
    assert "batch_dims=('dp',)" in errors["string"]
    assert "names a dim twice" in errors["twice"]
    assert "both a batch dim and the pipeline dim" in errors["pipeline_is_batch"]
    assert "pipeline_dim='pp' is not a dim" in errors["pipeline_unknown"]
    assert "reduced not at all (a plain module)" in errors["plain"]
    assert "batch dims ['dp']" in errors["plain"]


# ---------------------------------------------------------------------------
# CachedStep on a mesh: a CLIP loss over dp, the model replicated over tp
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_cached_step_on_a_mesh_matches_whole_batch(k: int) -> None:
    from tests.distributed.test_cache import F64, _batches, _reference
    from tests.support.mesh_cases import run_cached

    ref = _reference(_batches(2, k), "inside")  # the 2 dp shards' rows, one process
    ref.pop("scale")
    for r, got in enumerate(run_ranks(W, run_cached, k, ("dp",), False, timeout=TIMEOUT)):
        assert got.keys() == ref.keys()
        for name, value in got.items():
            torch.testing.assert_close(value, ref[name], **F64, msg=f"rank {r} {name}")
    # The mutation: the loss gathers over every rank, so tp replicas' rows count twice.
    wrong = run_ranks(W, run_cached, k, ("dp",), False, True, timeout=TIMEOUT)
    assert not all(torch.allclose(wrong[0][n], ref[n], rtol=1e-6, atol=1e-8) for n in ref)


def test_cached_step_on_a_mesh_rejects_misfed_replicas_and_tp_as_a_batch_dim() -> None:
    from tests.support.mesh_cases import run_cached

    outcomes = run_ranks_outcomes(W, run_cached, 3, ("dp",), True, timeout=TIMEOUT)
    same_error_everywhere(
        outcomes, "CachedStep.step: ranks [0, 1] replicate the same rows", "('tp',)",
        "were fed different inputs: micro_batches[0][0] (float64",
    )  # fmt: skip
    outcomes = run_ranks_outcomes(W, run_cached, 3, ("dp", "tp"), False, timeout=TIMEOUT)
    same_error_everywhere(outcomes, "batch dims ['tp']")


def test_grad_cache_on_a_mesh_refuses_misfed_replicas_before_any_forward() -> None:
    from tests.support.mesh_cases import run_gradcache_misfed

    got = run_ranks(W, run_gradcache_misfed, timeout=TIMEOUT)
    assert len({g["error"] for g in got}) == 1
    message = got[0]["error"]
    assert "GradCache: ranks [0, 1] replicate the same rows" in message, message
    assert "were fed different inputs: micro_batches[0][0] (float64" in message, message
    assert all(g["forwards"] == 0 for g in got)


def test_a_loss_in_the_users_loop_is_proven_fed_alike_by_check_fed_alike() -> None:
    """A bare loss sees only its embeddings: with tensor-parallel towers the Rowwise
    all-reduce makes the replicas' embeddings equal whatever they were fed, so the loss
    alone accepts misfed replicas (documented in docs/mesh.md; the engines fingerprint
    the inputs). `check_fed_alike` on the loop's inputs refuses them on every rank."""
    from tests.support.mesh_cases import run_tp_loss_misfed

    assert run_ranks(W, run_tp_loss_misfed, False, timeout=TIMEOUT) == [None] * W
    errors = run_ranks(W, run_tp_loss_misfed, True, timeout=TIMEOUT)
    assert len(set(errors)) == 1, errors
    message = errors[0]
    assert message is not None and message.startswith("check_fed_alike: ranks [0, 1] replicate")
    assert "were fed different inputs: inputs['image'] (float64, shape (3, 4)) has sums" in message


# ---------------------------------------------------------------------------
# Modules on their own data-parallel dims: encoder dp = 4 beside an LM on dp2 x tp2
# ---------------------------------------------------------------------------


def test_modules_on_their_own_dims_match_whole_batch_and_one_set_of_dims_does_not() -> None:
    from tests.support import mesh_modules as mm

    ref = mm.reference()
    for engine in ("accumulator", "hand"):
        results = run_ranks(W, mm.run_accumulator, engine, timeout=TIMEOUT)
        for r, got in enumerate(results):
            assert params_close(got.params, ref.params, TOL) == [], (engine, r)
            assert got.items == ref.items, (engine, r)
            for a, b in zip(got.losses + got.grad_norms, ref.losses + ref.grad_norms, strict=True):
                assert abs(a - b) <= TOL * max(1.0, abs(b)), (engine, r, a, b)
    # The mutation: the encoder scaled as if its data were split over dp only (its gradient
    # half the whole batch's; through clipping and the second step every parameter moves).
    wrong = run_ranks(W, mm.run_accumulator, "accumulator", ("dp",), timeout=TIMEOUT)
    assert "encoder.proj.weight" in params_close(wrong[0].params, ref.params, TOL)
    assert wrong[0].grad_norms[0] != pytest.approx(ref.grad_norms[0], rel=1e-6)


def test_cached_step_with_modules_on_their_own_dims_matches_whole_batch() -> None:
    from tests.support import mesh_modules as mm

    ref = mm.cached_reference()
    for r, got in enumerate(run_ranks(W, mm.run_cached, timeout=TIMEOUT)):
        assert params_close(got, ref, TOL) == [], r
    wrong = run_ranks(W, mm.run_cached, ("dp",), timeout=TIMEOUT)
    assert params_close(wrong[0], ref, TOL), "one set of dims for both must fail"


def test_bad_module_batch_dims_are_the_same_error_on_every_rank() -> None:
    from tests.support.mesh_modules import module_dims_errors

    got = run_ranks(W, module_dims_errors, timeout=TIMEOUT)
    assert all(g == got[0] for g in got)  # the same text on every rank
    errors = got[0]
    assert "is not a submodule of the model" in errors["not a submodule"]
    assert "names 'vision', which is no submodule" in errors["unknown name"]
    assert "module_batch_dims['encoder']='dp_enc' is a string" in errors["a string"]
    assert "is in both 'encoder' and 'encoder.proj'" in errors["twice"]
    assert "module 'lm'" in errors["not reduced"] and "batch dims ['tp']" in errors["not reduced"]
    assert "module_batch_dims['encoder']: batch_dims ['cp'] are not dims" in errors["unknown dim"]
    assert "module_batch_dims needs mesh=" in errors["no mesh"]
