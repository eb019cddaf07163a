"""Whole-batch losses: CLIP, SigLIP and NT-Xent over the global batch.

`contrastive` holds the loss functions (validation agreed across ranks, the
gradient convention of DESIGN.md), `tiles` the tiled autograd kernels that keep
memory linear in the batch. Losses use `wholebatch.comm` and nothing above it.
"""

from __future__ import annotations

from wholebatch.losses.contrastive import GradReduction, clip_loss, nt_xent_loss, siglip_loss

__all__ = ["GradReduction", "clip_loss", "nt_xent_loss", "siglip_loss"]
