"""`wholebatch verify` on a device mesh (dp2 x tp2, dp2 x cp2): exact steps pass, mistakes are named.

Four gloo processes per run (verify's own forks), TinyLM in float64 with FSDP2 on
dp and Colwise/Rowwise tensor parallel on tp (tests/support/verify_mesh_targets.py),
ragged token counts per micro-batch, each against one process on the whole batch.
Mutations that must be named: the count all-reduced over the world (x tp
replicas: 1/tp), tp rank 1 fed another shard's rows, and on dp2 x cp2 (FSDP2 on
dp_cp, each cp rank holding half of every row's positions) the whole rows' items
counted on every cp rank (1/cp) and cp's counts dropped (each rank's shard at
N / N_c); on pp2 x dp2 (1F1B, FSDP2 on dp per stage) the
first stage left unscaled.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.features import has, skip_unless
from wholebatch.testing import WholeBatchMismatch, assert_whole_batch, verify
from wholebatch.verify import VerifyConfig

TARGETS = "tests/support/verify_mesh_targets.py"
EXPECTED: dict[str, str | None] = {
    f"{TARGETS}:exact": None,
    f"{TARGETS}:hand_exact": None,
    f"{TARGETS}:ddp_exact": None,  # no parallelize: verify's DDP over dp, replicated over tp
    f"{TARGETS}:count_world": "counted-over-tp",
    f"{TARGETS}:replica_rows": "replicas-fed-different-data",
}


@pytest.fixture(scope="module")
def mismatch() -> WholeBatchMismatch:
    # the targets' TinyLM (6 rows over dp 2 x tp 2, FSDP2 x TP): verify refuses to read it
    # back where torch reads it wrong
    skip_unless("fsdp_tp_uneven")
    with pytest.raises(WholeBatchMismatch) as caught:
        assert_whole_batch(*EXPECTED, mesh="dp=2,tp=2", micro_batches=2, timeout=60.0)
    return caught.value


@pytest.fixture(scope="module")
def reports(mismatch: WholeBatchMismatch) -> dict[str, Any]:
    return {r.target: r for r in mismatch.reports}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("target", list(EXPECTED))
def test_mesh_verdicts(reports: dict[str, Any], target: str) -> None:
    report, code = reports[target], EXPECTED[target]
    codes = [d.code for d in report.diagnoses]
    assert report.world_size == 4 and report.wrap == "mesh dp=2,tp=2"
    if code is None:
        assert report.passed, report.format()
        main = report.comparisons[0]
        assert main.max_rel_err < 1e-12  # float64: the floor is a few eps
        return
    assert not report.passed
    assert codes[0] == code, report.format()
    # Named first, and not also as a generic factor. (Replicas fed different rows also
    # hold different gradients, so `ranks-differ` may follow the replica cause.)
    assert not {"scaled", "wrong-count", "uncompensated-mean"} & set(codes), codes
    if code == "counted-over-tp":
        assert codes == [code], codes


@pytest.mark.timeout(240)
def test_count_over_tp_is_exact_without_replicas(reports: dict[str, Any]) -> None:
    report = reports[f"{TARGETS}:count_world"]
    again = [c for c in report.comparisons if c.variant.startswith("replicas 1")]
    assert again and again[0].ok and "dp=2,tp=1" in again[0].variant
    text = report.diagnoses[0].message
    assert "exactly 1/2" in text and "dp=2,tp=1" in text and "batch_dims=('dp',)" in text


@pytest.mark.timeout(240)
def test_replica_message_names_the_ranks(
    reports: dict[str, Any], mismatch: WholeBatchMismatch
) -> None:
    text = reports[f"{TARGETS}:replica_rows"].diagnoses[0].message
    assert "ranks 0 and 1" in text and "DistributedSampler" in text
    assert "mesh dp=2,tp=2 x 2 micro-batches" in str(mismatch)
    doc = reports[f"{TARGETS}:replica_rows"].to_json()
    assert doc["evidence"]["mesh"] == {"dp": 2, "tp": 2} and doc["evidence"]["shards"] == [
        0,
        0,
        1,
        1,
    ]


@pytest.mark.timeout(240)
@pytest.mark.skipif(
    has("fsdp_tp_uneven"),
    reason="this torch reads FSDP2 x tensor-parallel uneven shards back right: verify judges "
    "them (the tests above)",
)
def test_verify_refuses_the_layout_where_torch_reads_it_back_wrong() -> None:
    # torch 2.8 - 2.9: training on it is exact (tests/distributed/test_mesh_dist.py reads the
    # local pieces), but verify compares full tensors, which torch assembles wrong there:
    # the same error from every rank, no verdict on the gradient.
    with pytest.raises(WholeBatchMismatch) as caught:
        assert_whole_batch(f"{TARGETS}:exact", mesh="dp=2,tp=2", micro_batches=2, timeout=60.0)
    (report,) = caught.value.reports
    assert not report.passed and not report.comparisons, report.format()
    text = str(caught.value)
    assert "the split step failed on ranks [0, 1, 2, 3]: WholebatchError: verify: torch" in text
    assert "_StridedShard" in text and "or torch >= 2.10" in text, text


CP_EXPECTED: dict[str, str | None] = {
    f"{TARGETS}:cp_exact": None,
    f"{TARGETS}:cp_twice": "cp-counted-twice",
    f"{TARGETS}:cp_dp_only": "cp-items-missing",
}


@pytest.mark.timeout(240)
def test_context_parallel_from_the_spec_mesh() -> None:
    # No mesh= here: the specs' own mesh ("dp=2,cp=2") is used.
    reports = {r.target: r for r in verify(*CP_EXPECTED, micro_batches=2, timeout=60.0)}
    exact, twice = reports[f"{TARGETS}:cp_exact"], reports[f"{TARGETS}:cp_twice"]
    assert exact.passed and exact.wrap == "mesh dp=2,cp=2", exact.format()
    assert exact.comparisons[0].max_rel_err < 1e-12
    codes = [d.code for d in twice.diagnoses]
    assert codes == ["cp-counted-twice"], twice.format()
    assert "exactly 1/cp = 1/2" in twice.diagnoses[0].message
    assert any(c.variant.startswith("replicas 1 (dp=2,cp=1)") and c.ok for c in twice.comparisons)
    # cp's counts dropped: each cp rank's shard at its own N / N_c (ragged: no one ratio).
    dropped = reports[f"{TARGETS}:cp_dp_only"]
    assert [d.code for d in dropped.diagnoses] == ["cp-items-missing"], dropped.format()
    assert dropped.evidence is not None
    factors = dropped.evidence.rank_factors
    assert all(f is not None for f in factors) and factors[0] == pytest.approx(factors[2])
    assert 1 / factors[0] + 1 / factors[1] == pytest.approx(1.0, rel=1e-9)  # type: ignore[operator]


PP_EXPECTED: dict[str, str | None] = {
    f"{TARGETS}:pp_exact": None,
    f"{TARGETS}:pp_stage0_unscaled": "stage-not-rescaled",
}


@pytest.mark.timeout(240)
def test_pipeline_stages_gathered_by_owner() -> None:
    # pp2 x dp2, 1F1B: each rank holds its stage's parameters only; the full gradient of
    # every parameter comes from its stage's ranks.
    reports = {r.target: r for r in verify(*PP_EXPECTED, micro_batches=2, timeout=60.0)}
    exact, bad = reports[f"{TARGETS}:pp_exact"], reports[f"{TARGETS}:pp_stage0_unscaled"]
    assert exact.passed and exact.wrap == "mesh pp=2,dp=2", exact.format()
    assert exact.comparisons[0].max_rel_err < 1e-12
    assert [d.code for d in bad.diagnoses] == ["stage-not-rescaled"], bad.format()
    diagnosis = bad.diagnoses[0]
    assert set(diagnosis.params) == {"emb.weight", "hidden.weight", "hidden.bias"}
    assert "pipeline stage 0" in diagnosis.message
    assert exact.evidence is not None
    assert [set(o) for o in exact.evidence.owned] == [
        {"emb.weight", "hidden.weight", "hidden.bias"}
    ] * 2 + [{"out.weight", "out.bias"}] * 2


def test_bad_mesh_for_the_spec_is_a_usage_error() -> None:
    # Checked before any process starts: batch dims not on the mesh, too few rows.
    from wholebatch.verify import TargetError, run_verify

    with pytest.raises(TargetError, match=r"batch_dims \['dp'\] are not dims"):
        run_verify([f"{TARGETS}:exact"], VerifyConfig(mesh="data=2,tp=2"))
    with pytest.raises(TargetError, match="fewer than B·K = 8·2 = 16"):
        run_verify([f"{TARGETS}:exact"], VerifyConfig(mesh="dp=8", micro_batches=2))
