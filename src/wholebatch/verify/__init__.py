"""Verification: run a user's step (or trainer) split and whole, compare every gradient, name the mistake.

`spec` holds what a TARGET returns (`VerifySpec`, `TrainerSpec`; `replay`'s
`ReplaySpec` for a trainer that builds its batch inside `train()`), `runner` runs
it over W ranks x K micro-batches against one process on the whole batch, in
clean processes (`procs`, `worker`), `report` compares, `diagnose` names the
likely causes: each one an entry of `causes.REGISTRY` (its test on the `case`,
message, fix and precedence), `recording` holds the instruments (gradient recorder, dropout
tape, collective watch), `normfit` reads which normalisation mode a step's item weights
are (when the spec gives `normalize` and `item_losses`). `wholebatch verify` (the CLI) and `wholebatch.testing`
drive it.
"""

from __future__ import annotations

from wholebatch.verify.mesh import current_mesh
from wholebatch.verify.replay import ReplaySpec
from wholebatch.verify.report import VerifyReport
from wholebatch.verify.runner import run_verify
from wholebatch.verify.spec import (
    TargetError,
    TrainerRun,
    TrainerSpec,
    VerifyConfig,
    VerifySpec,
    load_spec,
    split_batch,
)

__all__ = [
    "ReplaySpec",
    "TargetError",
    "TrainerRun",
    "TrainerSpec",
    "VerifyConfig",
    "VerifyReport",
    "VerifySpec",
    "current_mesh",
    "load_spec",
    "run_verify",
    "split_batch",
]
