"""open_clip's `ClipLoss` and `SigLipLoss`, exact over the whole batch and memory-linear.

Change two lines of an open_clip training script (docs/integrations/open_clip.md):

    # from open_clip.loss import ClipLoss, SigLipLoss
    from wholebatch.integrations.open_clip import ClipLoss, SigLipLoss

The constructors and calls are open_clip 3.3.0's:

    loss = ClipLoss(local_loss, gather_with_grad, cache_labels, rank, world_size, use_horovod)
    loss(image_features, text_features, logit_scale[, logit_bias], output_dict=False)
    loss = SigLipLoss(cache_labels, rank, world_size, dist_impl)
    loss(image_features, text_features, logit_scale, logit_bias, output_dict=False)

Behind them are `wholebatch.clip_loss` / `wholebatch.siglip_loss`: whatever the
flags, after DDP's mean every gradient (both encoders, `logit_scale`,
`logit_bias`) equals one process's on the whole batch; memory is
O(N·D + tile²) instead of open_clip's N x N (or B x N) logits; ranks may hold
different numbers of rows, 0 included. This module does not import open_clip.

What the flags mean here:

- `local_loss`, `gather_with_grad`: open_clip's trade between memory and
  exactness (its defaults give each encoder 1/W of the whole-batch gradient;
  `local_loss=True` alone is inexact too). No longer needed: accepted, and
  every combination gives the exact whole-batch gradient with linear memory.
- `cache_labels`, `dist_impl` ("bidir", "shift", "reduce", "gather"): ways
  of building labels or moving text blocks; accepted (dist_impl is validated as
  open_clip does), no effect on the result.
- `rank`, `world_size`: read from the process group; a value other than the
  defaults (0, 1) must match the group, else the same error on every rank.
- `use_horovod=True`: an error; wholebatch runs on torch.distributed.

The returned value is the loss of the WHOLE batch, the same on every rank.
open_clip returns that with `local_loss=False` (CLIP); with `local_loss=True`
(CLIP) and for SigLIP it returns this rank's share, whose mean over ranks is
the whole-batch loss when ranks hold equal rows.

Legend: W ranks, B this rank's rows, N global rows, D embedding dim.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from wholebatch.conventions import GradReduction
from wholebatch.errors import WholebatchError
from wholebatch.integrations._common import check_rank_args, scalar_numel_one
from wholebatch.losses import clip_loss, siglip_loss

__all__ = ["ClipLoss", "SigLipLoss"]

_DIST_IMPLS = ("bidir", "shift", "reduce", "gather")


def _no_horovod(op: str, use_horovod: object) -> None:
    if use_horovod:
        raise WholebatchError(
            f"{op}: use_horovod=True is not supported: wholebatch runs on torch.distributed; "
            "launch with torchrun and pass use_horovod=False"
        )


class _RankArgs(nn.Module):
    """The rank arguments both losses take, checked against the group on the first call."""

    def __init__(self, op: str, rank: int, world_size: int, group: ProcessGroup | None) -> None:
        super().__init__()
        self._op = op
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self._checked = False

    def _check_once(self) -> None:
        # Every rank calls the loss together, so every rank checks on the same call.
        if not self._checked:
            check_rank_args(self._op, self.rank, self.world_size, self.group)
            self._checked = True


class ClipLoss(_RankArgs):
    """open_clip's `ClipLoss`: symmetric InfoNCE over the whole batch, for any flags.

    Gradient contract: every rank calls it on its own rows; with DDP averaging
    parameter gradients (``grad_reduction="mean"``, the default), the encoders'
    and `logit_scale`'s gradients equal one process's on the concatenated batch;
    with ``"sum"``, after a sum over ranks. A scalar `logit_bias` adds the same
    constant to every logit, which cross-entropy ignores: the loss is unchanged
    and the bias gets an exactly zero gradient (open_clip computes the same
    zero to round-off).

    Args:
        local_loss: accepted, no effect (see the module docstring).
        gather_with_grad: accepted, no effect.
        cache_labels: accepted, no effect.
        rank: this process's rank, or the default 0; checked against `group`.
        world_size: the number of ranks, or the default 1; checked against `group`.
        use_horovod: must be False.
        group: the process group the batch is split over (default: the world).
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP), "sum" if summed.
        tile_size: rows and columns of one logits tile (memory tile² per buffer); None:
            chosen for the device (`wholebatch.losses.tile_size_for`).
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
        *,
        group: ProcessGroup | None = None,
        grad_reduction: GradReduction = "mean",
        tile_size: int | None = None,
    ) -> None:
        _no_horovod("ClipLoss", use_horovod)
        super().__init__("ClipLoss", rank, world_size, group)
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.cache_labels = cache_labels
        self.use_horovod = use_horovod
        self.grad_reduction: GradReduction = grad_reduction
        self.tile_size = tile_size

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float | None = None,
        output_dict: bool = False,
    ) -> Tensor | dict[str, Tensor]:
        """The whole batch's CLIP loss (the same on every rank), or {"contrastive_loss": it}.

        Args:
            image_features: this rank's image embeddings (B x D), normalised as open_clip's models do.
            text_features: this rank's text embeddings (B x D); row i pairs with image row i.
            logit_scale: the logit multiplier (already exponentiated), the same on every rank.
            logit_bias: an optional scalar added to every logit (no effect on the loss).
            output_dict: return {"contrastive_loss": loss} instead of the loss.
        """
        self._check_once()
        loss = clip_loss(
            image_features, text_features, logit_scale, group=self.group,
            grad_reduction=self.grad_reduction, tile_size=self.tile_size,
        )  # fmt: skip
        if logit_bias is not None:
            bias = scalar_numel_one("ClipLoss", "logit_bias", logit_bias)
            if isinstance(bias, Tensor) and bias.requires_grad:
                # In the graph with an exactly zero gradient, as DDP expects of a used parameter.
                loss = loss + 0.0 * bias.reshape(()).to(loss.dtype)
        return {"contrastive_loss": loss} if output_dict else loss


class SigLipLoss(_RankArgs):
    """open_clip's `SigLipLoss`: the sigmoid loss over the whole batch, every `dist_impl`.

    The loss is −Σᵢⱼ log σ(yᵢⱼ·(s·IᵢTⱼ + b)) / N over all N x N pairs of the
    whole batch (yᵢᵢ = 1, else −1). Remote text blocks travel around the ring
    one at a time, so memory does not grow with W.

    Gradient contract: as `ClipLoss`; `logit_scale` and `logit_bias` are
    replicated parameters and get the whole-batch gradient after DDP's mean.

    Args:
        cache_labels: accepted, no effect.
        rank: this process's rank, or the default 0; checked against `group`.
        world_size: the number of ranks, or the default 1; checked against `group`.
        dist_impl: None, "bidir", "shift", "reduce" or "gather" (validated like
            open_clip; every choice gives the same exact result).
        group: the process group the batch is split over (default: the world).
        grad_reduction: "mean" if parameter gradients are averaged over ranks (DDP), "sum" if summed.
        tile_size: rows and columns of one logits tile; None: chosen for the device.
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: str | None = None,
        *,
        group: ProcessGroup | None = None,
        grad_reduction: GradReduction = "mean",
        tile_size: int | None = None,
    ) -> None:
        impl = dist_impl or "bidir"
        if impl not in _DIST_IMPLS:
            raise WholebatchError(
                f"SigLipLoss: dist_impl={dist_impl!r}; expected None or one of {_DIST_IMPLS} "
                "(all give the same exact loss here)"
            )
        super().__init__("SigLipLoss", rank, world_size, group)
        self.cache_labels = cache_labels
        self.dist_impl = impl
        self.grad_reduction: GradReduction = grad_reduction
        self.tile_size = tile_size

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float,
        output_dict: bool = False,
    ) -> Tensor | dict[str, Tensor]:
        """The whole batch's SigLIP loss (the same on every rank), or {"contrastive_loss": it}.

        Args:
            image_features: this rank's image embeddings (B x D).
            text_features: this rank's text embeddings (B x D); row i pairs with image row i.
            logit_scale: the logit multiplier (already exponentiated), the same on every rank.
            logit_bias: the logit bias, the same on every rank.
            output_dict: return {"contrastive_loss": loss} instead of the loss.
        """
        self._check_once()
        loss = siglip_loss(
            image_features, text_features, logit_scale, logit_bias, group=self.group,
            grad_reduction=self.grad_reduction, tile_size=self.tile_size,
        )  # fmt: skip
        return {"contrastive_loss": loss} if output_dict else loss

    def extra_repr(self) -> str:
        return f"dist_impl={self.dist_impl!r}"
