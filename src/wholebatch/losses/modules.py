"""`nn.Module` forms of the whole-batch losses: construct once, call in the loop.

Each module calls its function (`clip_loss`, `siglip_loss`, `nt_xent_loss`,
`info_nce_loss`) with the same gradient contract, and adds two things users of
open_clip, lightly and sentence-transformers expect from a loss module:

- **normalisation stated in the constructor**: `normalize` is a required
  keyword. ``normalize=True`` L2-normalises every embedding row (cos
  similarity, as open_clip's models and sentence-transformers' `cos_sim` do)
  before the function; ``False`` passes them as they are, exactly like the
  function (which never normalises). No silent difference between the forms.
- **scalars owned by the module or passed per call**: a scale (or
  temperature, or bias) given to the constructor is fixed, or learnable with
  ``learn_scale=True`` (stored as its log, as CLIP does, so it stays
  positive; a bias is stored as is). Left None, it must be passed to each call
  (open_clip's models own `logit_scale` and pass it in). Passing one to a call
  whose module already owns it is an error, never a silent choice.

A learnable scalar is a replicated parameter: keep the module inside the DDP
module, or give it to the optimizer beside it; every rank's copy receives the
same whole-batch gradient (see `wholebatch.losses.call`).

    loss_fn = wholebatch.ClipLoss(normalize=True, logit_scale=1 / 0.07, learn_scale=True)
    loss = loss_fn(image_features, text_features)   # every rank: the whole batch's loss
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from wholebatch.comm.meshgroup import resolve_group
from wholebatch.conventions import GradReduction
from wholebatch.errors import WholebatchError
from wholebatch.losses.contrastive import clip_loss, nt_xent_loss, siglip_loss
from wholebatch.losses.info_nce import Direction, PartitionMode, info_nce_loss
from wholebatch.losses.specs import Strategy

__all__ = ["ClipLoss", "InfoNCELoss", "NTXentLoss", "SigLipLoss"]


class _Scalar(nn.Module):
    """One scalar of a loss: fixed, learnable (log-parameterised or raw), or passed per call."""

    def __init__(self, name: str, owner: str, init: float | None, learn: bool, log: bool) -> None:
        super().__init__()
        self.name, self.owner, self.log = name, owner, log
        if learn and init is None:
            raise WholebatchError(f"{owner}: learning {name} needs its initial value: pass {name}=")
        if init is not None and log and not init > 0:
            raise WholebatchError(f"{owner}: {name}={init!r} must be positive")
        self.fixed = None if learn or init is None else float(init)
        self.param = (
            nn.Parameter(torch.tensor(math.log(init) if log else init))
            if learn and init is not None
            else None
        )

    def resolve(self, given: Tensor | float | None) -> Tensor | float:
        owned = self.param is not None or self.fixed is not None
        if given is not None and owned:
            raise WholebatchError(
                f"{self.owner}: {self.name} was passed to the call, but the module owns one "
                f"({'learnable' if self.param is not None else self.fixed}); construct it with "
                f"{self.name}=None to pass it per call"
            )
        if given is not None:
            return given
        if self.param is not None:
            return self.param.exp() if self.log else self.param
        if self.fixed is not None:
            return self.fixed
        raise WholebatchError(
            f"{self.owner}: no {self.name}: pass one to the constructor or to each call"
        )

    def extra_repr(self) -> str:
        how = "learnable" if self.param is not None else self.fixed
        return f"{self.name}={how if how is not None else 'per call'}"


class _LossModule(nn.Module):
    def __init__(
        self,
        normalize: bool,
        group: ProcessGroup | None,
        grad_reduction: GradReduction,
        tile_size: int | None,
        mesh: DeviceMesh | None = None,
        batch_dims: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        # Validated (and the batch dims' group built, once per mesh) here, on every rank.
        resolve_group(group, mesh, batch_dims, type(self).__name__)
        self.mesh = mesh
        self.batch_dims = None if batch_dims is None else tuple(batch_dims)
        if not isinstance(normalize, bool):
            raise WholebatchError(
                f"{type(self).__name__}: normalize={normalize!r} must be True (L2-normalise "
                "each row: cos similarity) or False (use the embeddings as given)"
            )
        self.normalize = normalize
        self.group, self.grad_reduction, self.tile_size = group, grad_reduction, tile_size

    def _prep(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=-1) if self.normalize else x

    def _keywords(self) -> dict[str, Any]:
        """The function's keywords this module fixes (its strategy too, where it has one)."""
        names = ("group", "mesh", "batch_dims", "grad_reduction", "tile_size", "strategy")
        out = {name: getattr(self, name) for name in names if hasattr(self, name)}
        return out

    def extra_repr(self) -> str:
        return f"normalize={self.normalize}, grad_reduction={self.grad_reduction!r}"


class ClipLoss(_LossModule):
    """`clip_loss` as a module (symmetric InfoNCE over the whole batch).

    Args:
        normalize: L2-normalise image and text rows first (True) or not (False).
        logit_scale: the logit multiplier (not its log); None: pass it to each call.
        learn_scale: learn it (stored as log(logit_scale); CLIP starts at 1 / 0.07).
        group, mesh, batch_dims, grad_reduction, tile_size, strategy: as for `clip_loss`
            ("ring": memory independent of N).
    """

    def __init__(
        self,
        *,
        normalize: bool,
        logit_scale: float | None = None,
        learn_scale: bool = False,
        group: ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        batch_dims: Sequence[str] | None = None,
        grad_reduction: GradReduction = "mean",
        tile_size: int | None = None,
        strategy: Strategy = "gather",
    ) -> None:
        super().__init__(normalize, group, grad_reduction, tile_size, mesh, batch_dims)
        self.scale = _Scalar("logit_scale", "ClipLoss", logit_scale, learn_scale, log=True)
        self.strategy: Strategy = strategy

    def forward(
        self,
        image_BD: Tensor,
        text_BD: Tensor,
        logit_scale: Tensor | float | None = None,
        logit_bias: Tensor | float | None = None,
    ) -> Tensor:
        """The whole batch's CLIP loss (same on every rank); `logit_bias` has no effect (gradient 0)."""
        return clip_loss(
            self._prep(image_BD),
            self._prep(text_BD),
            self.scale.resolve(logit_scale),
            logit_bias=logit_bias,
            **self._keywords(),
        )


class SigLipLoss(_LossModule):
    """`siglip_loss` as a module (sigmoid loss over the whole batch).

    Args:
        normalize: L2-normalise image and text rows first (True) or not (False).
        logit_scale: the logit multiplier (not its log); None: pass it to each call.
        logit_bias: the logit bias; None: pass it to each call.
        learn_scale: learn the scale (stored as its log; SigLIP starts at 10).
        learn_bias: learn the bias (SigLIP starts at -10).
        group, mesh, batch_dims, grad_reduction, tile_size: as for `siglip_loss`.
    """

    def __init__(
        self,
        *,
        normalize: bool,
        logit_scale: float | None = None,
        logit_bias: float | None = None,
        learn_scale: bool = False,
        learn_bias: bool = False,
        group: ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        batch_dims: Sequence[str] | None = None,
        grad_reduction: GradReduction = "mean",
        tile_size: int | None = None,
    ) -> None:
        super().__init__(normalize, group, grad_reduction, tile_size, mesh, batch_dims)
        self.scale = _Scalar("logit_scale", "SigLipLoss", logit_scale, learn_scale, log=True)
        self.bias = _Scalar("logit_bias", "SigLipLoss", logit_bias, learn_bias, log=False)

    def forward(
        self,
        image_BD: Tensor,
        text_BD: Tensor,
        logit_scale: Tensor | float | None = None,
        logit_bias: Tensor | float | None = None,
    ) -> Tensor:
        """The whole batch's SigLIP loss (same on every rank)."""
        return siglip_loss(
            self._prep(image_BD),
            self._prep(text_BD),
            self.scale.resolve(logit_scale),
            self.bias.resolve(logit_bias),
            **self._keywords(),
        )


class NTXentLoss(_LossModule):
    """`nt_xent_loss` as a module (SimCLR's NT-Xent over the whole batch).

    Args:
        normalize: L2-normalise both views' rows first (True; SimCLR and lightly do) or not.
        temperature: τ (logits are z·z / τ); None: pass it to each call.
        learn_temperature: learn τ (stored as log τ).
        group, mesh, batch_dims, grad_reduction, tile_size: as for `nt_xent_loss`.
    """

    def __init__(
        self,
        *,
        normalize: bool,
        temperature: float | None = None,
        learn_temperature: bool = False,
        group: ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        batch_dims: Sequence[str] | None = None,
        grad_reduction: GradReduction = "mean",
        tile_size: int | None = None,
    ) -> None:
        super().__init__(normalize, group, grad_reduction, tile_size, mesh, batch_dims)
        self.temperature = _Scalar(
            "temperature", "NTXentLoss", temperature, learn_temperature, log=True
        )

    def forward(
        self, z1_BD: Tensor, z2_BD: Tensor, temperature: Tensor | float | None = None
    ) -> Tensor:
        """The whole batch's NT-Xent loss over its 2N views (same on every rank)."""
        return nt_xent_loss(
            self._prep(z1_BD),
            self._prep(z2_BD),
            self.temperature.resolve(temperature),
            **self._keywords(),
        )


class InfoNCELoss(_LossModule):
    """`info_nce_loss` as a module: MultipleNegativesRankingLoss over the whole batch.

    ``InfoNCELoss(normalize=True)`` is sentence-transformers' default
    `MultipleNegativesRankingLoss` (cos similarity, scale 20, query → every
    document and every hard negative), computed over every rank's rows.

    Args:
        normalize: L2-normalise every row first (True: cos similarity) or not (dot product).
        logit_scale: the multiplier (sentence-transformers' `scale`); None: pass it per call.
        learn_scale: learn it (stored as its log).
        directions, partition_mode: as for `info_nce_loss`.
        group, mesh, batch_dims, grad_reduction, tile_size, strategy: as for `info_nce_loss`.
    """

    def __init__(
        self,
        *,
        normalize: bool,
        logit_scale: float | None = 20.0,
        learn_scale: bool = False,
        directions: Sequence[Direction] = ("query_to_doc",),
        partition_mode: PartitionMode = "joint",
        group: ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        batch_dims: Sequence[str] | None = None,
        grad_reduction: GradReduction = "mean",
        tile_size: int | None = None,
        strategy: Strategy = "gather",
    ) -> None:
        super().__init__(normalize, group, grad_reduction, tile_size, mesh, batch_dims)
        self.scale = _Scalar("logit_scale", "InfoNCELoss", logit_scale, learn_scale, log=True)
        self.directions = tuple(directions)
        self.partition_mode: PartitionMode = partition_mode
        self.strategy: Strategy = strategy

    def forward(
        self,
        query_BD: Tensor,
        document_BD: Tensor,
        negatives: Tensor | Sequence[Tensor] | None = None,
        logit_scale: Tensor | float | None = None,
    ) -> Tensor:
        """The whole batch's InfoNCE loss (same on every rank).

        Args:
            query_BD: this rank's queries (B x D).
            document_BD: their positive documents (B x D).
            negatives: hard negatives, a B x k x D tensor or a sequence of k B x D
                tensors (sentence-transformers' columns negative_1..k); None or k = 0: none.
            logit_scale: the multiplier, if the module does not own one.
        """
        negs: Tensor | None
        if negatives is None or isinstance(negatives, Tensor):
            negs = negatives
        else:
            cols = list(negatives)
            negs = torch.stack(cols, 1) if cols else None
        return info_nce_loss(
            self._prep(query_BD),
            self._prep(document_BD),
            self.scale.resolve(logit_scale),
            negatives_BKD=None if negs is None else self._prep(negs),
            directions=self.directions,
            partition_mode=self.partition_mode,
            **self._keywords(),
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, directions={self.directions}, "
            f"partition_mode={self.partition_mode!r}"
        )
