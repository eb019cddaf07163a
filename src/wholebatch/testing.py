"""The whole-batch check as one line in your own test suite.

    # tests/test_training.py
    from wholebatch.testing import assert_whole_batch
    from wholebatch.verify import VerifySpec

    def my_step_check() -> VerifySpec:          # module level: verify calls it in fresh processes
        return VerifySpec(build_model=..., batch=..., step=my_step, reference_loss=...)

    def test_gradients_accumulate_correctly():
        assert_whole_batch(my_step_check, nproc=2, micro_batches=3)

"Test with small batches that gradients accumulate correctly", the last item of
every gradient-accumulation checklist, made one call: it runs `wholebatch
verify` on the targets (a module-level function returning a `VerifySpec`,
`TrainerSpec` or `ReplaySpec`, or a 'module:function' / 'file.py:function'
string), split over
`nproc` ranks x `micro_batches` micro-batches against one process on the whole
batch, and fails with the report as the message: the per-parameter table, where
the step breaks and the likely cause with its fix.

Every run starts in fresh processes (nothing your test process imported or set
leaks into them); it takes a few seconds (starting torch) plus the step's time.
"""

from __future__ import annotations

from collections.abc import Callable

from wholebatch.verify.replay import ReplaySpec
from wholebatch.verify.report import VerifyReport
from wholebatch.verify.runner import run_verify
from wholebatch.verify.spec import TrainerSpec, VerifyConfig, VerifySpec

__all__ = ["WholeBatchMismatch", "assert_whole_batch", "verify"]

Target = str | Callable[[], VerifySpec | TrainerSpec | ReplaySpec]


class WholeBatchMismatch(AssertionError):
    """A step that is not one whole-batch step; `reports` holds every target's report."""

    def __init__(self, message: str, reports: list[VerifyReport]) -> None:
        super().__init__(message)
        self.reports = reports


def verify(
    *targets: Target,
    nproc: int = 2,
    micro_batches: int = 3,
    timeout: float = 120.0,
    mesh: str = "",
) -> list[VerifyReport]:
    """Run `wholebatch verify` on each target; the reports (`report.passed`, `report.format()`).

    `mesh` ("dp=2,tp=2") splits the step over that device mesh instead of `nproc` ranks
    (as `--mesh`; it overrides the spec's `mesh`).

    Raises:
        wholebatch.verify.TargetError: a target cannot be loaded, returns no spec, or its
            batch has fewer rows than nproc x micro_batches.
    """
    config = VerifyConfig(nproc=nproc, micro_batches=micro_batches, timeout=timeout, mesh=mesh)
    return run_verify(list(targets), config)


def assert_whole_batch(
    *targets: Target,
    nproc: int = 2,
    micro_batches: int = 3,
    timeout: float = 120.0,
    mesh: str = "",
) -> list[VerifyReport]:
    """Fail (`WholeBatchMismatch`, an AssertionError) unless every target's step is one whole-batch step.

    The message holds each failing target's report: the gradients next to the
    whole-batch reference, where the step breaks, and the likely cause with its fix.
    Returns the reports when all pass. `mesh` ("dp=2,tp=2"): split over that device
    mesh (`wholebatch verify --mesh`; docs/mesh.md, "verify on a mesh").
    """
    __tracebackhide__ = True
    if not targets:
        raise TypeError("assert_whole_batch: give at least one target")
    reports = verify(*targets, nproc=nproc, micro_batches=micro_batches, timeout=timeout, mesh=mesh)
    failed = [r for r in reports if not r.passed]
    if failed:
        split = f"mesh {mesh}" if mesh else f"{nproc} ranks"
        head = (
            f"{len(failed)} of {len(reports)} steps do not give the whole-batch gradient "
            f"({split} x {micro_batches} micro-batches vs one process):"
        )
        body = "\n\n".join(r.format() for r in failed)
        raise WholeBatchMismatch(f"{head}\n\n{body}", reports)
    return reports
