"""Exact gradient caching: one optimizer step over K micro-batches of a loss that needs the whole batch.

Contrastive losses do not split over micro-batches: K small losses are a
different objective (fewer negatives). Gradient caching (Gao et al., "Scaling
Deep Contrastive Learning Batch Size under Memory Limited Setup",
arXiv:2101.06983) computes the whole-batch loss on cached embeddings instead:

1. pass 1, under `no_grad`: embed every micro-batch, recording the RNG state
   before each (CPU, and CUDA where initialised);
2. the loss on all cached embeddings (the loss itself may gather across ranks),
   and its gradient with respect to the embeddings and to the loss's own
   parameters, taken ONCE (re-evaluating it per micro-batch gives a replicated
   `logit_scale` K times its gradient);
3. pass 2: re-run each micro-batch with its RNG state restored (else dropout
   draws new masks and the cached gradient belongs to a different network) and
   back-propagate its slice of the cached gradient; DDP's reduction is skipped
   (`no_sync`) on all but the last;
4. finish like the `Accumulator`: `wholebatch.train.stepping.StepFinisher` agrees
   non-finite flags, unscales, clips, steps and zeroes.

Activation memory is that of one micro-batch; the cost is one extra forward per
micro-batch. Rows of the whole batch are each rank's rows in rank order, and on
each rank its micro-batches in order.

Legend: W ranks, K micro-batches per rank, B rows of one micro-batch, N global rows.

    stats = CachedStep(model, opt, embed_fn, loss_fn).step(micro_batches)
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from wholebatch.comm.collectives import all_reduce
from wholebatch.comm.groups import any_rank, get_world_size
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.train.stepping import (
    GradReduction,
    OnNonFinite,
    StepConfig,
    StepFinisher,
    StepStats,
    grad_sync_mode,
    sync_context,
)

__all__ = ["CachedStep"]

Embeddings = tuple[Tensor, ...]
EmbedFn = Callable[[nn.Module, Any], "Tensor | tuple[Tensor, ...]"]
LossFn = Callable[..., Tensor]
RngState = tuple[Tensor, list[Tensor]]


def _as_tuple(out: object) -> Embeddings | None:
    if isinstance(out, Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and out and all(isinstance(t, Tensor) for t in out):
        return tuple(out)
    return None


def _cuda_devices() -> list[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return list(range(torch.cuda.device_count()))
    return []


def _get_rng() -> RngState:
    devices = _cuda_devices()
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng(state: RngState) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in enumerate(cuda):
        torch.cuda.set_rng_state(s, d)


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
      (DDP's default): their gradient is fed into the last micro-batch's backward,
      so DDP's own reduction averages it; with `find_unused_parameters=True`, as
      outside (below), before pass 2;
    - outside the DDP (or FSDP2) module: `step` averages it over ranks itself,
      as the wrapper averages the rest (one all-reduce of their gradients);
    - a plain module on W > 1 ranks: left to the caller, as for the model's
      own gradients (see `wholebatch.train.stepping`).

    Memory: activations of one micro-batch (with the model's gradients, as in
    any accumulation), plus the gradient of the cached embeddings (N_rank x D
    per output) in pass 2; while the loss runs, the cached embeddings (one
    copy), their gradient and whatever `loss_fn` needs.

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
        group: the data-parallel group; None: DDP's own, else the world.
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
        group: Any = None,
    ) -> None:
        for name, fn in (("embed_fn", embed_fn), ("loss_fn", loss_fn)):
            if not callable(fn):
                raise WholebatchTypeError(
                    f"CachedStep: {name} must be callable, got {type(fn).__name__}"
                )
        config = StepConfig(
            max_grad_norm=max_grad_norm, grad_reduction=grad_reduction, on_nonfinite=on_nonfinite
        )
        self.finisher = StepFinisher(model, optimizer, scaler=scaler, config=config, group=group)
        self.model = model
        self.optimizer = optimizer
        self.embed_fn = embed_fn
        self.loss_fn = loss_fn
        self.group = self.finisher.group
        self.world_size = get_world_size(self.group)

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
        self.finisher.begin(k, op="CachedStep.step")
        cached, rngs = self._first_pass(micro_batches)
        rows = float(sum(c[0].shape[0] for c in cached))
        loss, emb_grads, param_grads = self._loss_grads(cached)
        self._second_pass(micro_batches, rngs, cached, emb_grads, param_grads)
        del cached, emb_grads, param_grads  # before the optimizer step allocates its state
        w = self.world_size
        mean = self.finisher.config.grad_reduction == "mean"
        # The loss already carries the whole-batch normalisation, and (with "mean")
        # the factor W that compensates DDP's average: the finisher must not rescale.
        return self.finisher.finish(
            loss_sum=loss.detach() / w,
            items=rows,
            micro_batches=k,
            backward_scale=float(w) if mean else 1.0,
            normalize_by_items=False,
        )

    # -- the parts (separate so that tests can replace one with a known-wrong one) --

    def _first_pass(self, micro_batches: Sequence[Any]) -> tuple[list[Embeddings], list[RngState]]:
        """Embed every micro-batch without graph; the RNG state before each."""
        cached: list[Embeddings] = []
        rngs: list[RngState] = []
        error: str | None = None
        with torch.no_grad():
            for i, mb in enumerate(micro_batches):
                rngs.append(_get_rng())
                out = _as_tuple(self.embed_fn(self.model, mb))
                if out is None:
                    error = error or (
                        f"embed_fn returned something other than a Tensor or a tuple of Tensors "
                        f"for micro-batch {i}"
                    )
                    continue
                if cached and len(out) != len(cached[0]):
                    error = error or (
                        f"embed_fn returned {len(out)} tensors for micro-batch {i} but "
                        f"{len(cached[0])} for micro-batch 0"
                    )
                if any(t.dim() == 0 for t in out):
                    error = error or (
                        f"embed_fn returned a 0-d tensor for micro-batch {i}; embeddings are "
                        "rows (use them in loss_fn through a closure if they are parameters)"
                    )
                cached.append(out)
        self._agree_ok(error)
        return cached, rngs

    def _agree_ok(self, error: str | None) -> None:
        # Agree before raising: a rank that raised alone would leave its peers
        # waiting in the loss's collectives.
        if any_rank(error is not None, group=self.group):
            raise WholebatchError(
                "CachedStep.step: " + (error or "embed_fn's output was unusable on another rank")
            )

    def _loss_candidates(self) -> list[Tensor]:
        return [p for p in self.finisher.params() if p.requires_grad]

    def _loss_grads(
        self, cached: list[Embeddings]
    ) -> tuple[Tensor, list[Tensor], dict[int, Tensor]]:
        """The whole-batch loss, its gradient per embedding output, and per loss parameter."""
        whole = [
            torch.cat([c[j] for c in cached]).detach().requires_grad_()
            for j in range(len(cached[0]))
        ]
        # Memory: one copy of the embeddings, not two. Each micro-batch's entry
        # becomes a view of the concatenation, and the per-micro-batch tensors go.
        start = 0
        for i, c in enumerate(cached):
            rows = c[0].shape[0]
            cached[i] = tuple(w.detach()[start : start + rows] for w in whole)
            start += rows
        candidates = self._loss_candidates()
        loss = self.loss_fn(*whole)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise WholebatchError(
                f"CachedStep.step: loss_fn must return a scalar Tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else "")
            )
        grads = torch.autograd.grad(
            self.finisher.scale_loss(loss.reshape(())), whole + candidates, allow_unused=True
        )
        emb_grads = [
            g if g is not None else torch.zeros_like(e)
            for g, e in zip(grads[: len(whole)], whole, strict=True)
        ]
        param_grads = {
            i: g for i, g in enumerate(grads[len(whole) :]) if g is not None
        }  # index into candidates
        return loss.detach(), emb_grads, param_grads

    def _ddp_managed(self) -> set[int]:
        """ids of the parameters DDP reduces (those of its module, less any it was told to ignore)."""
        model = self.model
        # With find_unused_parameters=True DDP marks a parameter its forward did not
        # use as ready (and leaves its gradient alone): a later gradient would be
        # "marked ready twice". Such parameters are reduced by `_reduce_outside`
        # instead; if the forward does use one, DDP then averages a gradient that is
        # already identical on every rank, which leaves it unchanged.
        if not isinstance(model, DistributedDataParallel) or model.find_unused_parameters:
            return set()
        ignored = set(getattr(model, "parameters_to_ignore", ()))
        return {
            id(p)
            for name, p in model.module.named_parameters()
            if name not in ignored and p.requires_grad
        }

    def _second_pass(
        self,
        micro_batches: Sequence[Any],
        rngs: list[RngState],
        cached: list[Embeddings],
        emb_grads: list[Tensor],
        param_grads: dict[int, Tensor],
    ) -> None:
        """Re-run each micro-batch with its RNG state and back-propagate its slice of the gradient.

        Empties `cached`: pass 2 needs only the embeddings' shapes, and their
        memory (N_rank x D per output) is better spent on the micro-batch's activations.
        """
        k = len(micro_batches)
        shapes = [[t.shape for t in c] for c in cached]
        offsets = [0, *itertools.accumulate(s[0][0] for s in shapes)]
        cached.clear()  # no name may keep an entry (a loop variable would): the storage must go
        candidates = self._loss_candidates()
        managed = self._ddp_managed()
        in_ddp = [
            (candidates[i], g) for i, g in param_grads.items() if id(candidates[i]) in managed
        ]
        outside = [
            (candidates[i], g) for i, g in param_grads.items() if id(candidates[i]) not in managed
        ]
        self._reduce_outside(outside)
        error: str | None = None
        for i, mb in enumerate(micro_batches):
            with sync_context(self.model, i, k), self._rng(rngs[i]):
                out = _as_tuple(self.embed_fn(self.model, mb))
                if out is None or [t.shape for t in out] != shapes[i]:
                    error = error or (
                        f"embed_fn returned different shapes for micro-batch {i} in the second "
                        "pass; it must be deterministic given the RNG state"
                    )
                    out = ()
                tensors: list[Tensor] = []
                grads: list[Tensor] = []
                for j, t in enumerate(out):
                    if t.requires_grad:
                        tensors.append(t)
                        grads.append(emb_grads[j][offsets[i] : offsets[i + 1]])
                if i == k - 1:
                    # DDP-managed loss parameters join the synced backward: DDP averages them.
                    tensors += [p for p, _ in in_ddp]
                    grads += [g for _, g in in_ddp]
                if tensors:
                    torch.autograd.backward(tensors, grads)
        self._agree_ok(error)

    @contextlib.contextmanager
    def _rng(self, state: RngState) -> Iterator[None]:
        """Run with `state`, then restore the RNG to where pass 1 left it."""
        if not self._replay_rng:
            yield
            return
        with torch.random.fork_rng(devices=_cuda_devices()):
            _set_rng(state)
            yield

    @torch.no_grad()
    def _reduce_outside(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        """Accumulate loss-parameter gradients that no wrapper reduces, averaged like DDP."""
        if not pairs:
            return
        grads = [g for _, g in pairs]
        if grad_sync_mode(self.model) != "none" and self.world_size > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            mean = self.finisher.config.grad_reduction == "mean"
            flat = all_reduce(flat, "mean" if mean else "sum", group=self.group, check=False)
            grads = list(torch.split(flat, [g.numel() for g in grads]))
        for (p, _), g in zip(pairs, grads, strict=True):
            g = g.view_as(p).to(p.dtype)
            p.grad = g.clone() if p.grad is None else p.grad + g
