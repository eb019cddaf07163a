"""Whole-batch losses: CLIP, SigLIP, NT-Xent and InfoNCE over the global batch.

`contrastive` and `info_nce` hold the loss functions, `modules` their
`nn.Module` forms, `common` the validation agreed across ranks and the
gradient convention of DESIGN.md, `tiles` the tiled autograd kernels that keep
memory linear in the batch. Losses use `wholebatch.comm` and nothing above it.
"""

from __future__ import annotations

from wholebatch.losses.common import GradReduction
from wholebatch.losses.contrastive import clip_loss, nt_xent_loss, siglip_loss
from wholebatch.losses.info_nce import Direction, PartitionMode, info_nce_loss
from wholebatch.losses.modules import ClipLoss, InfoNCELoss, NTXentLoss, SigLipLoss
from wholebatch.losses.tiles import tile_size_for

__all__ = [
    "ClipLoss",
    "Direction",
    "GradReduction",
    "InfoNCELoss",
    "NTXentLoss",
    "PartitionMode",
    "SigLipLoss",
    "clip_loss",
    "info_nce_loss",
    "nt_xent_loss",
    "siglip_loss",
    "tile_size_for",
]
