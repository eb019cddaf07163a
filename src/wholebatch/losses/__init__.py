"""Whole-batch losses: CLIP, SigLIP, NT-Xent and InfoNCE over the global batch.

`contrastive` and `info_nce` hold the loss functions, `modules` their
`nn.Module` forms, `specs` one descriptor per loss (torch-free: what the
exchange, the planner and the docs ask of it), `common` the validation agreed
across ranks and the gradient convention of DESIGN.md, `tiles` the tiled
autograd kernels that keep memory linear in the batch, `ring` the ring forms
of the softmax losses (memory independent of N), `replicated` the small-batch
path (one all-gather, the whole loss on every rank, no backward collective),
`sizing` their pure bookkeeping (tile size, the exchange's row, what "auto"
picks, the small-batch row limit), `meshgroup` the `mesh=`/`batch_dims=`
arguments (the batch dims' group, replicas checked). Losses use
`wholebatch.comm` and nothing above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wholebatch._lazy import lazy_package

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
    from wholebatch.losses.info_nce import (
        Direction as Direction,
        PartitionMode as PartitionMode,
        info_nce_loss as info_nce_loss,
    )
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

_LAZY, __all__, __getattr__, __dir__ = lazy_package(globals())
