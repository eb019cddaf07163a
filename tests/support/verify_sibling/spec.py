"""A verify target that imports its sibling module by its bare name (issue 32, point 5).

    cd /tmp && wholebatch verify /path/to/tests/support/verify_sibling/spec.py:check

verify puts this file's folder first on sys.path, as `python spec.py` does, so
`import sibling_parts` works from any current directory.
"""

from __future__ import annotations

import sibling_parts

from wholebatch.verify import VerifySpec


def check() -> VerifySpec:
    """Right: a row-mean regression step over the whole batch's global row count."""
    return VerifySpec(
        build_model=sibling_parts.model, batch=sibling_parts.batch(), step=sibling_parts.step,
        reference_loss=sibling_parts.mean_squared,
    )  # fmt: skip
