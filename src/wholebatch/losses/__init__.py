"""Whole-batch losses: CLIP, SigLIP, NT-Xent and InfoNCE over the global batch.

`contrastive` and `info_nce` hold the loss functions, `modules` their
`nn.Module` forms, `specs` one descriptor per loss (torch-free: what the
exchange, the planner and the docs ask of it), `common` the validation agreed
across ranks and the gradient convention of DESIGN.md, `tiles` the tiled
autograd kernels that keep memory linear in the batch, `ring` the ring forms
of the softmax losses (memory independent of N), `sizing` their pure
bookkeeping (tile size, the exchange's row, what "auto" picks). Losses use `wholebatch.comm` and nothing above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wholebatch._lazy import lazy_attributes

# Loaded on first use (PEP 562), like the top level and `comm`: `losses.sizing`
# is pure Python and the planner reads it without loading torch.
_LAZY: dict[str, str] = {
    "ClipLoss": "wholebatch.losses.modules",
    "Direction": "wholebatch.losses.info_nce",
    "GradReduction": "wholebatch.conventions",
    "InfoNCELoss": "wholebatch.losses.modules",
    "NTXentLoss": "wholebatch.losses.modules",
    "PartitionMode": "wholebatch.losses.info_nce",
    "SigLipLoss": "wholebatch.losses.modules",
    "Strategy": "wholebatch.losses.specs",
    "clip_loss": "wholebatch.losses.contrastive",
    "info_nce_loss": "wholebatch.losses.info_nce",
    "nt_xent_loss": "wholebatch.losses.contrastive",
    "siglip_loss": "wholebatch.losses.contrastive",
    "tile_size_for": "wholebatch.losses.sizing",
}

if TYPE_CHECKING:
    from wholebatch.conventions import GradReduction
    from wholebatch.losses.contrastive import clip_loss, nt_xent_loss, siglip_loss
    from wholebatch.losses.info_nce import Direction, PartitionMode, info_nce_loss
    from wholebatch.losses.modules import ClipLoss, InfoNCELoss, NTXentLoss, SigLipLoss
    from wholebatch.losses.sizing import tile_size_for
    from wholebatch.losses.specs import Strategy

__all__ = [
    "ClipLoss",
    "Direction",
    "GradReduction",
    "InfoNCELoss",
    "NTXentLoss",
    "PartitionMode",
    "SigLipLoss",
    "Strategy",
    "clip_loss",
    "info_nce_loss",
    "nt_xent_loss",
    "siglip_loss",
    "tile_size_for",
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
