"""Training engines: exact accumulation, gradient caching, step finishing, checkpoints.

`accumulate` holds the `Accumulator`, `gradcache` gradient caching inside the
loss's backward (`GradCache`, for any loop or trainer), `cache` its engine (`CachedStep`),
`stepping` the end of a step that both share (agreed non-finite handling,
clipping), `meshstep` its side of a device mesh, `pipeline` the
`PipelineAccumulator` for pipeline schedules, `wrappers` what wraps the model (DDP,
FSDP2, compile: `no_sync` and friends), `normalize` the token / sequence / constant /
group modes of `Accumulator.step`, `auxloss` auxiliary losses whose statistics are the
whole batch's (MoE load balancing, router z-loss), `feeds` the proof that replicas were
fed alike, `compression` the DDP comm hooks, `checkpoint` exact resume. Engines use `wholebatch.comm` and `wholebatch.losses`, never the CLI.
"""

from __future__ import annotations

from wholebatch.train import checkpoint
from wholebatch.train.accumulate import Accumulator, AccumulatorConfig
from wholebatch.train.auxloss import LoadBalancingLoss, RouterZLoss, WholeBatchTerm
from wholebatch.train.cache import CachedStep
from wholebatch.train.compression import CommStats, GradCompression
from wholebatch.train.feeds import check_fed_alike
from wholebatch.train.gradcache import GradCache
from wholebatch.train.meshstep import MeshReduction
from wholebatch.train.normalize import Normalize
from wholebatch.train.pipeline import PipelineAccumulator
from wholebatch.train.stepping import (
    NonFiniteStepError,
    StepConfig,
    StepFinisher,
    StepStats,
    sync_context,
)

__all__ = [
    "Accumulator",
    "AccumulatorConfig",
    "CachedStep",
    "CommStats",
    "GradCache",
    "GradCompression",
    "LoadBalancingLoss",
    "MeshReduction",
    "NonFiniteStepError",
    "Normalize",
    "PipelineAccumulator",
    "RouterZLoss",
    "StepConfig",
    "StepFinisher",
    "StepStats",
    "WholeBatchTerm",
    "check_fed_alike",
    "checkpoint",
    "sync_context",
]
