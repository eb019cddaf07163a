"""Verification: run a user's step split and whole, compare every gradient, name the mistake.

`runner` runs a `VerifySpec` over W ranks x K micro-batches against one process
on the whole batch, `diagnose` compares and names the likely cause, `recording`
holds the gradient recorder and the dropout tape. `wholebatch verify` (the CLI)
drives it.
"""

from __future__ import annotations

from wholebatch.verify.runner import (
    TargetError,
    VerifyConfig,
    VerifySpec,
    load_spec,
    run_verify,
    split_batch,
)

__all__ = ["TargetError", "VerifyConfig", "VerifySpec", "load_spec", "run_verify", "split_batch"]
