"""Whole-batch losses: CLIP, SigLIP, NT-Xent, InfoNCE, DCL, SupCon and MaxSim over the global batch.

A loss is its descriptor in `specs` (torch-free: what the call path, the planner,
the selftest and the docs read), and a module of its own (`contrastive`,
`info_nce`, `dcl`, `supcon`, `maxsim`) holding its function, its one reference
formula and its row terms. Every call runs one path (`call`): *validate* (local
checks, one exchange of a named row, the same error on every rank), *choose*
(`sizing.choose`: the small path, gather or ring, from agreed numbers), *run*:
`small` (every rank the whole loss from the reference formula, one all-gather)
or a kernel family (`lse` softmax rows over gathered keys, `ring` the same around
a ring, `symmetric` NT-Xent's self-similarity, `sigmoid` SigLIP's pairs, `late`
MaxSim's token pairs; `tiles` their shared pieces, `fused` the Triton tiles).
`modules` holds the `nn.Module` forms. Losses use `wholebatch.comm` and nothing
above it.

Every spec's function is exported here from its module (`LossSpec.home`), so a
new loss needs no line in this file; the typed imports below are for mypy and IDEs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wholebatch._lazy import lazy_attributes, lazy_package
from wholebatch.losses.specs import SPECS

if TYPE_CHECKING:  # the public names, written once: mypy and IDEs read these imports,
    # and `lazy_package` builds `_LAZY`, `__all__` and the PEP 562 hooks from them
    from wholebatch.conventions import (
        GradReduction as GradReduction,
    )
    from wholebatch.losses.contrastive import (
        clip_loss as clip_loss,
        nt_xent_loss as nt_xent_loss,
        siglip_loss as siglip_loss,
    )
    from wholebatch.losses.dcl import dcl_loss as dcl_loss
    from wholebatch.losses.info_nce import (
        Direction as Direction,
        PartitionMode as PartitionMode,
        info_nce_loss as info_nce_loss,
    )
    from wholebatch.losses.maxsim import maxsim_loss as maxsim_loss
    from wholebatch.losses.modules import (
        ClipLoss as ClipLoss,
        InfoNCELoss as InfoNCELoss,
        NTXentLoss as NTXentLoss,
        SigLipLoss as SigLipLoss,
    )
    from wholebatch.losses.sizing import (
        set_small_rows as set_small_rows,
        tile_size_for as tile_size_for,
    )
    from wholebatch.losses.specs import (
        Strategy as Strategy,
    )
    from wholebatch.losses.supcon import supcon_loss as supcon_loss

_LAZY, _names = lazy_package(globals())[:2]
_LAZY.update({s.function: s.home for s in SPECS.values()})  # every loss, from its own spec
__all__ = sorted({*_names, *_LAZY})
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
