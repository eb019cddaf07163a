"""Exact gradient caching as an engine: one optimizer step over K micro-batches of a whole-batch loss.

`CachedStep` is `wholebatch.GradCache` (gradient caching inside the loss's
backward, `wholebatch.train.gradcache`) plus the end of a step it shares with the
`Accumulator` (`wholebatch.train.stepping.StepFinisher`): K agreed across ranks,
then pass 1 and the loss (the cache's call), `backward` (pass 2: RNG replayed,
each micro-batch's slice of the embeddings' gradient, DDP's reduction on the
last), then the agreed non-finite check, unscale, clipping, `optimizer.step()`
and `zero_grad`. Use `GradCache` directly to keep your own loop or trainer.

Activation memory is that of one micro-batch; the cost is one extra forward per
micro-batch but the last (whose pass-1 graph is kept). Rows of the whole batch
are each rank's rows in rank order, and on each rank its micro-batches in order.

Legend: W ranks, K micro-batches per rank, B rows of one micro-batch, N global rows.

    stats = CachedStep(model, opt, embed_fn, loss_fn).step(micro_batches)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from wholebatch.comm.mesh import MeshSplit
from wholebatch.conventions import GradReduction
from wholebatch.errors import WholebatchTypeError
from wholebatch.train.auxloss import refuse_terms
from wholebatch.train.feeds import check_feeds, feed_fields
from wholebatch.train.gradcache import EmbedFn, GradCache, LossFn
from wholebatch.train.meshstep import ModuleDims
from wholebatch.train.stepping import (
    OnNonFinite,
    StepConfig,
    StepFinisher,
    StepStats,
)

if TYPE_CHECKING:  # annotations only: the engines import without a mesh in use
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CachedStep"]


class CachedStep:
    """One exact optimizer step over K micro-batches per rank with a whole-batch loss.

    `embed_fn(model, micro_batch)` returns the micro-batch's embeddings (a tensor
    or a tuple of tensors, rows first); `loss_fn(*embeddings)` receives each
    output concatenated over this rank's micro-batches (rows in micro-batch order)
    and returns the whole-batch loss following wholebatch's convention (a
    `wholebatch.losses` function, with the same `grad_reduction` as here).

    Every rank of the group must call `step` with the same K.

    Gradient contract: after `step`'s backward passes and the data-parallel
    reduction, every parameter's gradient equals one process's gradient of the
    loss on the whole concatenated batch (every rank, every micro-batch), with
    dropout masks as drawn in pass 1. This includes the loss's own parameters
    (tensors that `loss_fn` uses and the optimizer holds, e.g. `logit_scale`):
    - inside the DDP module (unused by its forward), `find_unused_parameters=False`
      (DDP's default): joined to the synchronised micro-batch's backward, so DDP's
      own reduction averages it; with `find_unused_parameters=True`, as outside;
    - outside the DDP (or FSDP2) module: averaged over ranks after pass 2, as
      the wrapper averages the rest (one all-reduce of their gradients);
    - a plain module on W > 1 ranks is refused (nothing would reduce any
      gradient) unless `rank_local=True`: then nothing is reduced.

    Memory: activations of one micro-batch (with the model's gradients, as in
    any accumulation); while the loss runs, the cached embeddings (one copy)
    and the last micro-batch's kept graph; in pass 2 the embeddings' gradient
    (N_rank x D per output).

    Args:
        model: the module being trained (DDP, FSDP2 or plain); `embed_fn` calls it.
        optimizer: steps every trained parameter, the loss's own included.
        embed_fn: `(model, micro_batch) -> Tensor | tuple[Tensor, ...]`.
        loss_fn: `(*whole_batch_embeddings) -> scalar Tensor`.
        scaler: an AMP `torch.amp.GradScaler`, or None.
        max_grad_norm: clip the whole-batch gradient to this L2 norm; None: no clipping.
        grad_reduction: how the wrapper combines rank gradients: "mean" (DDP) or "sum";
            pass the same to the loss.
        on_nonfinite: "skip" or "raise" on a non-finite loss or gradient (on every rank).
        rank_local: allow a plain module on W > 1 ranks (each rank on its own gradient).
        group: the data-parallel group; None: DDP's own, else the world.
        mesh: a `DeviceMesh` instead of `group` (docs/mesh.md); the loss must gather over
            the batch dims only (`clip_loss(..., mesh=mesh, batch_dims=...)`, or
            `group=MeshSplit(...).batch_group()`), and ranks that replicate the batch must
            report the same rows and loss (else the same error on every rank).
        batch_dims: with `mesh`, the dims that split the batch; the others replicate it.
        module_batch_dims: with `mesh`, submodules (or their names) whose data is split
            over other dims than `batch_dims`, e.g. `{model.encoder: ("dp_enc",)}` for a
            vision encoder data-parallel over every rank (a flattened dp x tp dim) beside
            a language model on dp x tp. Each module's gradient is rescaled by its own
            wrapper's reduction over its own dims (docs/mesh.md, "Modules on their own
            data-parallel dims"); N stays the loss's, counted over `batch_dims`.
        check_inputs: on a mesh with replica dims, prove before the first forward that
            replicas were fed the same micro-batches (`wholebatch.train.feeds`: a
            fingerprint in the agreement of K, no extra collective). False: trust it.
    """

    # Tests turn this off to show that replaying the RNG is what makes pass 2 exact.
    _replay_rng: bool = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        embed_fn: EmbedFn,
        loss_fn: LossFn,
        scaler: torch.amp.GradScaler | None = None,
        max_grad_norm: float | None = None,
        *,
        grad_reduction: GradReduction = "mean",
        on_nonfinite: OnNonFinite = "skip",
        rank_local: bool = False,
        group: Any = None,
        mesh: DeviceMesh | None = None,
        batch_dims: Sequence[str] | None = None,
        module_batch_dims: ModuleDims | None = None,
        check_inputs: bool = True,
    ) -> None:
        for name, fn in (("embed_fn", embed_fn), ("loss_fn", loss_fn)):
            if not callable(fn):
                raise WholebatchTypeError(
                    f"CachedStep: {name} must be callable, got {type(fn).__name__}"
                )
        refuse_terms(model, "CachedStep")
        config = StepConfig(
            max_grad_norm=max_grad_norm,
            grad_reduction=grad_reduction,
            on_nonfinite=on_nonfinite,
            rank_local=rank_local,
        )
        split = MeshSplit.from_args("CachedStep", mesh, batch_dims, group=group)
        self.split = split
        self.fed = split if check_inputs else None  # whose inputs are fingerprinted
        self.finisher = StepFinisher(
            model,
            optimizer,
            scaler=scaler,
            config=config,
            group=group,
            split=split,
            module_dims=module_batch_dims,
        )
        self.model = model
        self.optimizer = optimizer
        self.embed_fn = embed_fn
        self.loss_fn = loss_fn
        # On a mesh the loss gathers over the batch dims' group; its size B plays W's part.
        self.group = self.finisher.group if split is None else split.batch_group()
        self.world_size = self.finisher.world_size if split is None else split.batch_size
        self.cache = GradCache(
            model,
            embed_fn,
            grad_reduction=grad_reduction,
            rank_local=rank_local,
            group=self.group,
        )

    # -- the step --------------------------------------------------------------

    def step(self, micro_batches: Sequence[Any]) -> StepStats:
        """Run one optimizer step over this rank's `micro_batches` (K of them, the same K on every rank).

        Returns:
            The step's `StepStats` (identical on every rank); `loss` is the
            whole-batch loss, `items` the global row count.
        """
        if not isinstance(micro_batches, Sequence):
            micro_batches = list(micro_batches)
        k = len(micro_batches)
        op = "CachedStep.step"
        fed_with = {"micro_batches": micro_batches}
        agreed = self.finisher.begin(k, op=op, extra=feed_fields(self.fed, fed_with))
        check_feeds(op, self.fed, agreed, fed_with)
        loss, rows = self._forward_backward(micro_batches)
        w = self.world_size
        mean = self.finisher.config.grad_reduction == "mean"
        # The loss already carries the whole-batch normalisation, and (with "mean")
        # the factor W that compensates DDP's average: the finisher must not rescale.
        return self.finisher.finish(
            loss_sum=loss / w,
            items=float(rows),
            micro_batches=k,
            backward_scale=float(w) if mean else 1.0,
            normalize_by_items=False,
        )

    def _forward_backward(self, micro_batches: Sequence[Any]) -> tuple[Tensor, int]:
        """Pass 1, the loss, and its backward (pass 2); the detached loss and this rank's rows."""
        self.cache._replay_rng = self._replay_rng
        loss, rows = self.cache.run(micro_batches, self.loss_fn, op="CachedStep.step")
        torch.autograd.backward(self.finisher.scale_loss(loss.reshape(())))
        return loss.detach(), rows
