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

from wholebatch._lazy import lazy_package

__version__ = "0.1.0"

if TYPE_CHECKING:  # the public names, written once: mypy and IDEs read these imports,
    # and `lazy_package` builds `_LAZY`, `__all__` and the PEP 562 hooks from them
    from wholebatch import (
        cli as cli,
        comm as comm,
        conventions as conventions,
        errors as errors,
        integrations as integrations,
        lint as lint,
        losses as losses,
        planner as planner,
        testing as testing,
        train as train,
        verify as verify,
    )
    from wholebatch.comm.collectives import (
        all_gather as all_gather,
        all_reduce as all_reduce,
        all_to_all as all_to_all,
        broadcast as broadcast,
        reduce_scatter as reduce_scatter,
        ring_shift as ring_shift,
    )
    from wholebatch.comm.debug import (
        debug_enabled as debug_enabled,
        set_debug as set_debug,
    )
    from wholebatch.comm.groups import (
        all_ranks_agree as all_ranks_agree,
        any_rank as any_rank,
        checks_enabled as checks_enabled,
        get_rank as get_rank,
        get_world_size as get_world_size,
        init_process_group as init_process_group,
        set_checks as set_checks,
    )
    from wholebatch.comm.mesh import (
        MeshSplit as MeshSplit,
    )
    from wholebatch.errors import (
        WholebatchError as WholebatchError,
        WholebatchTypeError as WholebatchTypeError,
    )
    from wholebatch.losses.contrastive import (
        clip_loss as clip_loss,
        nt_xent_loss as nt_xent_loss,
        siglip_loss as siglip_loss,
    )
    from wholebatch.losses.info_nce import (
        info_nce_loss as info_nce_loss,
    )
    from wholebatch.losses.modules import (
        ClipLoss as ClipLoss,
        InfoNCELoss as InfoNCELoss,
        NTXentLoss as NTXentLoss,
        SigLipLoss as SigLipLoss,
    )
    from wholebatch.planner.config import (
        PlanConfig as PlanConfig,
    )
    from wholebatch.planner.core import (
        Plan as Plan,
        plan as plan,
    )
    from wholebatch.train import checkpoint as checkpoint
    from wholebatch.train.accumulate import (
        Accumulator as Accumulator,
        AccumulatorConfig as AccumulatorConfig,
    )
    from wholebatch.train.cache import (
        CachedStep as CachedStep,
    )
    from wholebatch.train.compression import (
        CommStats as CommStats,
        GradCompression as GradCompression,
    )
    from wholebatch.train.feeds import (
        check_fed_alike as check_fed_alike,
    )
    from wholebatch.train.gradcache import (
        GradCache as GradCache,
    )
    from wholebatch.train.normalize import (
        Normalize as Normalize,
    )
    from wholebatch.train.pipeline import (
        PipelineAccumulator as PipelineAccumulator,
    )
    from wholebatch.train.stepping import (
        NonFiniteStepError as NonFiniteStepError,
        StepConfig as StepConfig,
        StepFinisher as StepFinisher,
        StepStats as StepStats,
        sync_context as sync_context,
    )

_LAZY, __all__, __getattr__, __dir__ = lazy_package(globals())
