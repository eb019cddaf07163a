"""wholebatch: the gradient of the whole batch, however the batch is split.

The names below load on first use (PEP 562): `import wholebatch` costs no more
than the standard library, and `import wholebatch.lint` (or `wholebatch lint`,
or the flake8 plugin) never imports torch. Each name lives in the layer that
owns it (DESIGN.md, "Layers"):

    wholebatch.comm          collectives and process groups
    wholebatch.losses        whole-batch contrastive losses
    wholebatch.train         Accumulator, GradCache, CachedStep, step finishing, checkpoints
    wholebatch.verify        split-vs-whole gradient verification
    wholebatch.planner       `wholebatch.plan`: a step's memory, bytes and time per rank
    wholebatch.integrations  drop-ins for peer libraries
    wholebatch.lint          static rules (no torch)
    wholebatch.cli           the `wholebatch` command
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wholebatch._lazy import lazy_attributes

__version__ = "0.1.0"

# Public name -> the module that defines it. A name equal to its module's last
# component (`checkpoint`) is the module itself.
_LAZY: dict[str, str] = {
    "WholebatchError": "wholebatch.errors",
    "WholebatchTypeError": "wholebatch.errors",
    "all_gather": "wholebatch.comm.collectives",
    "all_reduce": "wholebatch.comm.collectives",
    "all_to_all": "wholebatch.comm.collectives",
    "broadcast": "wholebatch.comm.collectives",
    "reduce_scatter": "wholebatch.comm.collectives",
    "ring_shift": "wholebatch.comm.collectives",
    "debug_enabled": "wholebatch.comm.debug",
    "set_debug": "wholebatch.comm.debug",
    "all_ranks_agree": "wholebatch.comm.groups",
    "any_rank": "wholebatch.comm.groups",
    "checks_enabled": "wholebatch.comm.groups",
    "get_rank": "wholebatch.comm.groups",
    "get_world_size": "wholebatch.comm.groups",
    "init_process_group": "wholebatch.comm.groups",
    "set_checks": "wholebatch.comm.groups",
    "clip_loss": "wholebatch.losses.contrastive",
    "nt_xent_loss": "wholebatch.losses.contrastive",
    "siglip_loss": "wholebatch.losses.contrastive",
    "info_nce_loss": "wholebatch.losses.info_nce",
    "ClipLoss": "wholebatch.losses.modules",
    "InfoNCELoss": "wholebatch.losses.modules",
    "NTXentLoss": "wholebatch.losses.modules",
    "SigLipLoss": "wholebatch.losses.modules",
    "Accumulator": "wholebatch.train.accumulate",
    "AccumulatorConfig": "wholebatch.train.accumulate",
    "CachedStep": "wholebatch.train.cache",
    "checkpoint": "wholebatch.train.checkpoint",
    "CommStats": "wholebatch.train.compression",
    "GradCompression": "wholebatch.train.compression",
    "GradCache": "wholebatch.train.gradcache",
    "Normalize": "wholebatch.train.normalize",
    "NonFiniteStepError": "wholebatch.train.stepping",
    "StepConfig": "wholebatch.train.stepping",
    "StepFinisher": "wholebatch.train.stepping",
    "StepStats": "wholebatch.train.stepping",
    "sync_context": "wholebatch.train.stepping",
    "plan": "wholebatch.planner.core",
    "Plan": "wholebatch.planner.core",
    "PlanConfig": "wholebatch.planner.config",
}

# Written out (not computed) so mypy and IDEs read it; a test keeps it equal to _LAZY.
__all__ = [
    "Accumulator",
    "AccumulatorConfig",
    "CachedStep",
    "ClipLoss",
    "CommStats",
    "GradCache",
    "GradCompression",
    "InfoNCELoss",
    "NTXentLoss",
    "NonFiniteStepError",
    "Normalize",
    "Plan",
    "PlanConfig",
    "SigLipLoss",
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
    "info_nce_loss",
    "init_process_group",
    "nt_xent_loss",
    "plan",
    "reduce_scatter",
    "ring_shift",
    "set_checks",
    "set_debug",
    "siglip_loss",
    "sync_context",
]

if TYPE_CHECKING:  # what mypy and IDEs see; at run time `__getattr__` below loads these
    from wholebatch.comm.collectives import (
        all_gather,
        all_reduce,
        all_to_all,
        broadcast,
        reduce_scatter,
        ring_shift,
    )
    from wholebatch.comm.debug import debug_enabled, set_debug
    from wholebatch.comm.groups import (
        all_ranks_agree,
        any_rank,
        checks_enabled,
        get_rank,
        get_world_size,
        init_process_group,
        set_checks,
    )
    from wholebatch.errors import WholebatchError, WholebatchTypeError
    from wholebatch.losses.contrastive import clip_loss, nt_xent_loss, siglip_loss
    from wholebatch.losses.info_nce import info_nce_loss
    from wholebatch.losses.modules import ClipLoss, InfoNCELoss, NTXentLoss, SigLipLoss
    from wholebatch.planner.config import PlanConfig
    from wholebatch.planner.core import Plan, plan
    from wholebatch.train import checkpoint
    from wholebatch.train.accumulate import Accumulator, AccumulatorConfig
    from wholebatch.train.cache import CachedStep
    from wholebatch.train.compression import CommStats, GradCompression
    from wholebatch.train.gradcache import GradCache
    from wholebatch.train.normalize import Normalize
    from wholebatch.train.stepping import (
        NonFiniteStepError,
        StepConfig,
        StepFinisher,
        StepStats,
        sync_context,
    )


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
