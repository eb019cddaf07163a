"""verify names a step's normalisation mode (issue 22): W = 2 gloo ranks x K = 3, ragged, float64.

One `wholebatch.testing.assert_whole_batch` call runs every target of
tests/support/verify_norm_targets.py (one verify session: each target's split run on 2
forked gloo ranks, its reference, and for the failing ones the re-runs and the
fits); every test reads its reports and the assertion message:

- GRPO's per-micro-batch sequence means (the mutation) are named
  `normalization-mode`, with `mismatch_text`'s words, and the reading (found
  (sequence, micro_batch), expected (sequence, step)) is in the report; with
  one row per sequence too, where the micro-batch weights alone read as a mean
  of means (that cause is not named: the reference weights sequences);
- the same step without `normalize` is diagnosed as before (no reading);
- a per-micro-batch token mean is `mean-of-means` (its reading says (token,
  micro_batch), and the new cause is not named beside it);
- `Accumulator.step(normalize=Normalize("sequence", ...))` passes to round-off.
"""

from __future__ import annotations

import pytest

from tests.support import verify_norm_targets as targets
from wholebatch.testing import WholeBatchMismatch, assert_whole_batch
from wholebatch.train.normalize import mismatch_text
from wholebatch.verify.case import read_fit
from wholebatch.verify.report import VerifyReport

pytestmark = pytest.mark.timeout(240)

TARGETS = (
    targets.grpo_per_micro_batch,
    targets.grpo_rows_per_micro_batch,
    targets.grpo_per_micro_batch_no_ids,
    targets.token_per_micro_batch,
    targets.accumulator_sequence,
)


@pytest.fixture(scope="module")
def run() -> tuple[dict[str, VerifyReport], str]:
    with pytest.raises(WholeBatchMismatch) as info:
        assert_whole_batch(*TARGETS, nproc=2, micro_batches=3, timeout=60.0)
    reports = {r.target.rpartition(":")[2]: r for r in info.value.reports}
    return reports, str(info.value)


def _codes(report: VerifyReport) -> list[str]:
    return [d.code for d in report.diagnoses]


def test_grpo_per_micro_batch_sequence_means_are_named(
    run: tuple[dict[str, VerifyReport], str],
) -> None:
    reports, message = run
    report = reports["grpo_per_micro_batch"]
    assert _codes(report) == ["normalization-mode"], report.format()
    text = mismatch_text(("sequence", "micro_batch"), ("sequence", "step"))
    assert text.startswith("the step takes the mean of sequence means per micro-batch")
    assert text in report.diagnoses[0].message.lower()  # its sentence starts capitalised
    assert "Normalize('sequence'" in report.diagnoses[0].message  # the fix names the mode
    assert "Likely cause [normalization-mode]: Where: " in message
    assert report.fit is not None and report.fit.norm is not None
    norm = report.fit.norm
    assert (norm.found, norm.expected, norm.declared) == (
        ("sequence", "micro_batch"),
        ("sequence", "step"),
        "sequence",
    )
    # 13 sequences, one of them over two micro-batches: 14 cells, each side exact to round-off
    assert norm.cells == 14 and max(norm.split_residual, norm.reference_residual) < 1e-12
    assert report.to_json()["fit"]["normalization"]["found"] == ["sequence", "micro_batch"]


def test_one_row_per_sequence_is_not_called_a_mean_of_means(
    run: tuple[dict[str, VerifyReport], str],
) -> None:
    report = run[0]["grpo_rows_per_micro_batch"]
    assert _codes(report) == ["normalization-mode"], report.format()
    assert report.fit is not None and report.fit.norm is not None
    assert (report.fit.norm.found, report.fit.norm.expected) == (
        ("sequence", "micro_batch"),
        ("sequence", "step"),
    )
    assert report.fit.norm.cells == 14  # 14 rows, one sequence each
    # without the reading, the micro-batch weights alone say "a mean of means" (6 equal weights)
    kind, c = read_fit(report.fit, 2) or ("", 0.0)
    assert kind == "equal" and abs(c - 1 / 6) < 1e-9


def test_without_ids_verify_behaves_as_before(run: tuple[dict[str, VerifyReport], str]) -> None:
    report = run[0]["grpo_per_micro_batch_no_ids"]
    assert not report.passed and "normalization-mode" not in _codes(report)
    assert report.fit is not None and report.fit.norm is None
    assert report.to_json()["fit"]["normalization"] is None


def test_per_micro_batch_token_mean_is_a_mean_of_means(
    run: tuple[dict[str, VerifyReport], str],
) -> None:
    report = run[0]["token_per_micro_batch"]
    assert _codes(report) == ["mean-of-means"], report.format()
    assert report.fit is not None and report.fit.norm is not None
    assert (report.fit.norm.found, report.fit.norm.expected) == (
        ("token", "micro_batch"),
        ("token", "step"),
    )


def test_accumulator_with_sequence_normalize_passes(
    run: tuple[dict[str, VerifyReport], str],
) -> None:
    reports, message = run
    report = reports["accumulator_sequence"]
    assert report.passed, report.format()
    assert max(p.rel_err for p in report.comparisons[0].params) < 1e-12  # float64 round-off
    assert "accumulator_sequence" not in message
    assert message.startswith("4 of 5 steps do not give the whole-batch gradient")
