"""wholebatch: the gradient of the whole batch, however the batch is split."""

from __future__ import annotations

from wholebatch import checkpoint
from wholebatch.accumulate import Accumulator, AccumulatorConfig
from wholebatch.cache import CachedStep
from wholebatch.comm import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    reduce_scatter,
    ring_shift,
)
from wholebatch.compression import CommStats, GradCompression
from wholebatch.debug import debug_enabled, set_debug
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.groups import (
    all_ranks_agree,
    any_rank,
    checks_enabled,
    get_rank,
    get_world_size,
    init_process_group,
    set_checks,
)
from wholebatch.losses import clip_loss, nt_xent_loss, siglip_loss
from wholebatch.stepping import (
    NonFiniteStepError,
    StepConfig,
    StepFinisher,
    StepStats,
    sync_context,
)

__version__ = "0.1.0"

__all__ = [
    "Accumulator",
    "AccumulatorConfig",
    "CachedStep",
    "CommStats",
    "GradCompression",
    "NonFiniteStepError",
    "StepConfig",
    "StepFinisher",
    "StepStats",
    "WholebatchError",
    "WholebatchTypeError",
    "__version__",
    "all_gather",
    "all_ranks_agree",
    "all_reduce",
    "all_to_all",
    "any_rank",
    "broadcast",
    "checkpoint",
    "checks_enabled",
    "clip_loss",
    "debug_enabled",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "nt_xent_loss",
    "reduce_scatter",
    "ring_shift",
    "set_checks",
    "set_debug",
    "siglip_loss",
    "sync_context",
]
