"""Finish an optimizer step on the whole-batch gradient, the same way on every rank.

Shared by `wholebatch.Accumulator` and any other engine that runs
K micro-batches per optimizer step. An engine does three things:

    finisher = StepFinisher(model, optimizer, scaler=scaler, config=StepConfig(max_grad_norm=1.0))
    finisher.begin(K)                                  # agree K across ranks; no stale grads
    for i, mb in enumerate(micro_batches):
        with sync_context(model, i, K):                # no gradient sync but on the last
            loss_sum, items = ...                      # forward
            finisher.scale_loss(loss_sum * c).backward()   # c: one constant, the same on every rank
    stats = finisher.finish(loss_sum=..., items=..., micro_batches=K, backward_scale=c)

`finish` agrees everything rank-local (item count, loss, non-finite loss or
gradient, the sharded part of the gradient norm) in ONE small all-gather, then
every rank takes the same branch: rescale the gradient once (gradients are
linear in the loss, so multiplying the accumulated gradient by one constant is
exact), unscale the AMP scale, clip, `optimizer.step()`, `scaler.update()`,
`zero_grad(set_to_none=True)`; or skip (or raise) together. The row is named
(`wholebatch.comm.agree.agree_rows`); what wraps the model (DDP, FSDP2, compile)
is read by `wholebatch.train.wrappers`.

Gradient convention (DESIGN.md, "Data parallelism averages"): after the wrapper's
reduction the gradient must be d(sum of item losses / N)/dθ, N the global item
count. DDP and FSDP2 divide the summed gradient by W (`grad_reduction="mean"`),
so the rescale multiplies by W; a caller whose reduction sums says
`grad_reduction="sum"`. A plain module on W > 1 ranks is refused unless
`rank_local=True`: then each rank's gradient is W (mean) or 1 (sum) times
d(its own item losses / N)/dθ, for the caller's own all-reduce.

Legend: W world size, K micro-batches per step, N global item count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from wholebatch.comm.agree import Field, Rows, agree_rows
from wholebatch.comm.groups import get_world_size
from wholebatch.comm.mesh import MeshSplit
from wholebatch.conventions import GradReduction, check_grad_reduction
from wholebatch.errors import WholebatchError, WholebatchTypeError

# compiled_inner, grad_sync_mode, is_data_parallel, sync_context and unwrapped_error stay
from wholebatch.train.meshstep import (
    GradGroup,
    MeshReduction,
    ModuleDims,
    grad_groups,
    sq_norm_share,
)

# importable from here (re-exported): they lived here before `wholebatch.train.wrappers`.
from wholebatch.train.wrappers import (
    compiled_inner,
    grad_sync_mode,
    is_data_parallel,
    is_dtensor,
    is_sharded,
    local_tensor,
    sync_context,
    unwrapped_error,
)

__all__ = [
    "NonFiniteStepError",
    "OnNonFinite",
    "StepConfig",
    "StepFinisher",
    "StepStats",
    "compiled_inner",
    "grad_sync_mode",
    "is_data_parallel",
    "sync_context",
    "unwrapped_error",
]

OnNonFinite = Literal["skip", "raise"]

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing; we do the same
# so that clipping here equals clipping with torch's own function on the same gradient.
_CLIP_EPS = 1e-6


class NonFiniteStepError(WholebatchError):
    """A step met a non-finite loss or gradient (or held no items) with `on_nonfinite="raise"`.

    Raised on every rank together, after the gradients were dropped; parameters,
    optimizer state and the step counter are untouched.
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepStats:
    """What one optimizer step did; every field is identical on every rank except where noted."""

    loss: float
    """Whole-batch mean loss: (sum of item losses over micro-batches and ranks) / `items`.
    Independent of W and K. NaN when the step held no items; non-finite when a loss was."""

    items: float
    """Global item count N (tokens, samples, or summed weights) agreed across ranks."""

    items_per_rank: tuple[float, ...]
    """Each rank's item count for the step, in rank order."""

    grad_norm: float
    """L2 norm of the whole-batch gradient before clipping (after unscaling). For a plain
    module on W > 1 ranks (`rank_local=True`: not reduced) it is this rank's own norm."""

    clip_coef: float
    """Factor clipping applied to the gradient (1.0 when no clipping happened)."""

    skipped: bool
    """True when the optimizer did not step (non-finite loss/gradient or no items)."""

    skip_reason: str | None
    """Why the step was skipped, naming the ranks involved; None when it was taken."""

    micro_batches: int
    """K, the number of micro-batches of the step (the same on every rank)."""

    loss_scale: float | None
    """The AMP GradScaler's scale used for this step's backward; None without a scaler."""

    step: int
    """Optimizer steps taken so far by this engine, this one included (skipped ones not)."""

    aux: dict[str, float] = dataclasses.field(default_factory=dict)
    """The whole batch's value of each auxiliary term in the model (its name: its loss;
    `wholebatch.train.auxloss`), included in `loss`; empty without terms."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How `StepFinisher` finishes a step."""

    max_grad_norm: float | None = None
    """Clip the whole-batch gradient to this L2 norm (after unscaling); None: no clipping."""

    grad_reduction: GradReduction = "mean"
    """How the data-parallel wrapper combines rank gradients: "mean" (DDP, FSDP2 defaults)
    or "sum". The rescale compensates DDP's 1/W for "mean"."""

    on_nonfinite: OnNonFinite = "skip"
    """A non-finite loss or gradient, or a step with no items: "skip" the step on every
    rank (reported in `StepStats`) or "raise" `NonFiniteStepError` on every rank. With a
    GradScaler an overflowing gradient under a finite loss is always skipped, as AMP does."""

    rank_local: bool = False
    """Allow a plain module on W > 1 ranks (each rank steps on its own gradient);
    without it `begin` raises on every rank (`unwrapped_error`)."""

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and not (
            isinstance(self.max_grad_norm, (int, float))
            and math.isfinite(self.max_grad_norm)
            and self.max_grad_norm > 0
        ):
            raise WholebatchError(
                f"StepConfig: max_grad_norm={self.max_grad_norm!r} must be a positive finite "
                "number, or None for no clipping"
            )
        check_grad_reduction("StepConfig", self.grad_reduction)
        if self.on_nonfinite not in ("skip", "raise"):
            raise WholebatchError(
                f"StepConfig: on_nonfinite={self.on_nonfinite!r}; expected 'skip' or 'raise'"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Agreed:
    """What `finish` decided from the agreed rows; identical on every rank."""

    loss: float
    items: float
    items_per_rank: tuple[float, ...]
    grad_norm: float
    rescale: float  # the one factor the accumulated gradient is multiplied by
    rescales: tuple[float, ...]  # per gradient group (modules on their own dims): its factor
    skip_reason: str | None  # None: the step is taken
    backoff: bool  # a non-finite loss or gradient: the AMP scale backs off
    amp_overflow: bool  # skipped for an overflowing gradient under a GradScaler (never raised)

    def stats(
        self,
        *,
        clip_coef: float,
        skip_reason: str | None,
        micro_batches: int,
        loss_scale: float | None,
        step: int,
    ) -> StepStats:
        """The step's `StepStats`."""
        return StepStats(
            loss=self.loss,
            items=self.items,
            items_per_rank=self.items_per_rank,
            grad_norm=self.grad_norm,
            clip_coef=clip_coef,
            skipped=self.skip_reason is not None,
            skip_reason=skip_reason,
            micro_batches=micro_batches,
            loss_scale=loss_scale,
            step=step,
        )


def _rank_sum(values: tuple[float, ...]) -> float:
    """The sum of per-rank values in rank order, the same on every rank (inf and NaN propagate)."""
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):  # inf + -inf, or an overflowing partial sum
        return sum(values, 0.0)


def _finish_row(
    loss_sum: Tensor | float,
    items: Tensor | float,
    nonfinite_loss: Tensor | bool | None,
    sq_sharded: Tensor,
    sq_local: Tensor,
) -> dict[str, Field]:
    """This rank's row for `finish`'s one all-gather (tensors stay on their device)."""
    loss_t = torch.as_tensor(loss_sum).detach().to(torch.float64).reshape(())
    items_t = torch.as_tensor(items).detach().to(torch.float64).reshape(())
    bad_loss = (
        ~torch.isfinite(loss_t)
        if nonfinite_loss is None
        else torch.as_tensor(nonfinite_loss).to(loss_t.device).reshape(()).bool()
    )
    return {
        "loss": loss_t,
        "items": items_t,
        "bad_loss": bad_loss,
        "bad_grad": ~torch.isfinite(sq_sharded + sq_local),
        "sq_sharded": sq_sharded,
        "negative_items": items_t < 0,
    }


def _begin_error(rows: Rows, op: str, world_size: int) -> str | None:
    """What is wrong with the step `begin` agreed (the same on every rank), or None."""
    if plain_ranks := rows.ranks_where("plain"):
        text = unwrapped_error(nn.Identity(), world_size, op.split(".")[0])
        return f"on ranks {plain_ranks}, {text}"
    ks = dict(enumerate(rows.ints("micro_batches")))
    if len(set(ks.values())) > 1:
        return (
            f"micro_batches differ in number across ranks {ks}; every rank must run "
            "the same number per step (DDP/FSDP reduce on the last one). Use a sampler "
            "that gives every rank the same count (DistributedSampler(drop_last=True)), "
            "or pad a short rank with micro-batches of zero items (they add nothing)"
        )
    if ks[0] == 0:
        return (
            "micro_batches is empty on every rank; a step needs at least one "
            "micro-batch (stop iterating when the data is exhausted)"
        )
    if stale_ranks := rows.ranks_where("stale"):
        return (
            f"parameters already hold gradients on ranks {stale_ranks} before the "
            "step's first backward; they would be added to the step's gradient. Call "
            "optimizer.zero_grad(set_to_none=True) once before the first step (each step "
            "zeroes them after itself)"
        )
    return None


class StepFinisher:
    """Agree, rescale, unscale, clip, step, update and zero: the end of a whole-batch step.

    Every rank of `group` must call `begin` and `finish` for every step. Gradients
    must be those of the optimizer's parameters, accumulated over the step's K
    micro-batches with one constant loss multiplier `backward_scale` (and the
    GradScaler's scale via `scale_loss`), then reduced by the wrapper once.

    Args:
        model: the module as trained (a DDP or FSDP2 module, or a plain one). Used to
            find the process group (DDP's own when `group` is None) and to check that
            FSDP2 shards over `group`; gradients of its parameters are dropped after the step.
        optimizer: steps the parameters; its parameters are the ones clipped and counted.
        scaler: an AMP `torch.amp.GradScaler` (a disabled one counts as None).
        config: clipping, gradient reduction and the non-finite policy.
        group: the data-parallel group; None: DDP's process group, else the world.
        split: a `wholebatch.comm.mesh.MeshSplit` instead of `group`: items are counted
            over its batch dims only, replicas checked, and the rescale and the norm
            follow `wholebatch.train.meshstep` (the wrapper's reduced dims).
        module_dims: with `split`, submodules (or their names) -> the batch dims their
            data is split over, when it is not `split`'s (a vision encoder data-parallel
            over more ranks than the language model): each module's gradient is
            rescaled by its own wrapper's factor (`meshstep.grad_groups`); the item
            count N stays the loss's, over `split`'s batch dims.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: torch.amp.GradScaler | None = None,
        config: StepConfig | None = None,
        group: ProcessGroup | None = None,
        split: MeshSplit | None = None,
        module_dims: ModuleDims | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise WholebatchTypeError(
                f"StepFinisher: model must be a torch.nn.Module, got {type(model).__name__}"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise WholebatchTypeError(
                "StepFinisher: optimizer must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise WholebatchTypeError(
                f"StepFinisher: scaler must be a torch.amp.GradScaler or None, got "
                f"{type(scaler).__name__}"
            )
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.config = config if config is not None else StepConfig()
        if group is None and isinstance(model, DistributedDataParallel):
            group = model.process_group
        self.group = group
        self.world_size = get_world_size(group)
        self.steps = 0
        self.skipped_steps = 0
        self.split = split
        self.mesh_reduction: MeshReduction | None = None
        self.grad_groups: tuple[GradGroup, ...] = ()
        if module_dims and split is None:
            raise WholebatchError(
                "StepFinisher: module_batch_dims needs mesh= (the dims it names are a "
                "device mesh's); a flat world has one set of batch dims"
            )
        if split is not None:
            if group is not None and not isinstance(model, DistributedDataParallel):
                raise WholebatchError(
                    "StepFinisher: pass group= (a flat world) or split= (a mesh), not both"
                )
            self.grad_groups = grad_groups(
                model,
                split,
                module_dims,
                grad_reduction=self.config.grad_reduction,
                allow_unreduced=self.config.rank_local,
            )
            self.mesh_reduction = self.grad_groups[0].reduction
            self.group = None  # counts and flags are agreed over the whole mesh
            self.world_size = get_world_size(None)
        else:
            self._check_fsdp_mesh()

    @property
    def reduce_factor(self) -> float:
        """What the wrapper's reduction leaves to compensate: W for "mean", 1 for "sum";
        on a mesh, `MeshReduction.factor` (the batch dims it averages over)."""
        if self.mesh_reduction is not None:
            return self.mesh_reduction.factor
        return float(self.world_size) if self.config.grad_reduction == "mean" else 1.0

    # -- parameters ----------------------------------------------------------

    def params(self) -> list[Tensor]:
        """The optimizer's parameters, in param-group order."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _params_by_group(self) -> list[list[Tensor]]:
        """The optimizer's parameters per gradient group (one group without `module_dims`)."""
        params = self.params()
        if len(self.grad_groups) <= 1:
            return [params]
        out: list[list[Tensor]] = [[] for _ in self.grad_groups]
        for p in params:
            index = next(
                (i for i, g in enumerate(self.grad_groups) if g.params and id(p) in g.params), 0
            )
            out[index].append(p)
        return out

    def _check_fsdp_mesh(self) -> None:
        # The grad norm sums the squares of sharded gradients over `group`; that is the
        # whole gradient only when the shards are spread over exactly `group` (a 1-D mesh).
        for p in self.params():
            if is_dtensor(p):
                mesh = p.device_mesh  # type: ignore[attr-defined]
                if mesh.ndim != 1 or mesh.size() != self.world_size:
                    raise WholebatchError(
                        f"StepFinisher: a parameter of shape {tuple(p.shape)} is a DTensor on a "
                        f"{mesh.ndim}-D device mesh of {mesh.size()} ranks, but the step's group "
                        f"has {self.world_size}; only FSDP2 over a 1-D mesh equal to `group` is "
                        "supported (pass that mesh's group as group=)"
                    )

    # -- per step --------------------------------------------------------------

    @property
    def loss_scale(self) -> float | None:
        """The GradScaler's current scale, or None without a scaler."""
        return None if self.scaler is None else float(self.scaler.get_scale())

    def scale_loss(self, loss: Tensor) -> Tensor:
        """`loss` times the AMP scale (identity without a scaler): call `.backward()` on this."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def begin(
        self, num_micro_batches: int, *, op: str = "step", extra: Mapping[str, Field] | None = None
    ) -> Rows:
        """Agree the step's micro-batch count K on every rank before any forward.

        One small all-gather. Raises the same `WholebatchError` on every rank when K
        differs across ranks (DDP's last-micro-batch reduction would pair with a
        different collective on a peer: a hang or wrong data), when every rank has
        K = 0, when a rank's parameters already hold gradients (they would be
        added to the step's and break its normalisation), or when the model is a plain
        module on W > 1 ranks without `config.rank_local` (nothing reduces its gradients).

        `extra`: more named fields for the same all-gather (an engine's own facts to
        agree before any forward; the same names on every rank). Returns the agreed rows.
        """
        stale = any(p.grad is not None for p in self.params())
        # On a mesh, MeshReduction.of checked that the wrapper reduces every batch dim.
        plain = (
            not self.config.rank_local
            and self.split is None
            and unwrapped_error(self.model, self.world_size, op)
        )
        row: dict[str, Field] = {
            "micro_batches": int(num_micro_batches),
            "stale": stale,
            "plain": bool(plain),
        }
        rows = agree_rows({**row, **(extra or {})}, group=self.group)
        error = _begin_error(rows, op, self.world_size)
        if error is not None:
            raise WholebatchError(f"{op}: {error}")
        return rows

    def finish(
        self,
        *,
        loss_sum: Tensor | float,
        items: Tensor | float,
        micro_batches: int,
        backward_scale: float = 1.0,
        normalize_by_items: bool = True,
        nonfinite_loss: Tensor | bool | None = None,
        skip_if_empty: bool | None = None,
        local_error: str | None = None,
        op: str = "step",
        counted: bool = True,
    ) -> StepStats:
        """Agree, then rescale/unscale/clip/step/update/zero (or skip or raise) on every rank.

        Args:
            loss_sum: this rank's sum of item losses over the step's micro-batches (a
                detached tensor keeps the device from syncing per micro-batch).
            items: this rank's item count for the step (>= 0).
            micro_batches: K, as passed to `begin`.
            backward_scale: the constant every micro-batch's loss was multiplied by
                before `scale_loss(...).backward()`; the same on every rank. Choosing
                it near (W if "mean" else 1) / N keeps the pre-rescale gradient at the
                scale of a mean loss (good for fp16 wires and GradScaler).
            normalize_by_items: divide the gradient (and the loss) by the global item
                count N. False when the losses already carry their normalisation
                (their sum over ranks is the whole-batch loss).
            nonfinite_loss: this rank saw a non-finite loss; None: derive from `loss_sum`.
            skip_if_empty: skip the step when it held 0 items on every rank; None: when
                `normalize_by_items` (losses that carry their own normalisation may say True).
            local_error: what went wrong on this rank during the step (e.g. a loss of the
                wrong shape, back-propagated as zero to keep the ranks in step): the step
                is dropped and the same `WholebatchError` raised on every rank, naming `op`.
            op: the engine's name in errors.
            counted: on a mesh, whether this rank computed the loss (False on a pipeline
                stage without labels: its `items` and `loss_sum` are ignored).

        Returns:
            The step's `StepStats` (identical on every rank).

        Raises:
            NonFiniteStepError: on every rank, with `on_nonfinite="raise"`, when a loss
                or gradient was non-finite on any rank or the step held no items.
        """
        loss_scale = self.loss_scale
        if self.scaler is not None:
            # Unscale once, before the norm: the norm, clipping and the inf check all see
            # true gradients. Purely local (no collective); its own found_inf is only
            # this rank's and is superseded by the agreed flag below.
            self.scaler.unscale_(self.optimizer)
        by_group = self._params_by_group()
        grads = [[p.grad for p in ps if p.grad is not None] for ps in by_group]
        shares: list[Tensor] = []
        if self.split is None:
            sq_sharded, sq_local = self._squared_norms(grads[0])
        else:  # every rank's share, summed over the mesh: the whole norm (meshstep)
            shares = [sq_norm_share(self.split, ps) for ps in by_group]
            sq_sharded, sq_local = torch.stack(shares).sum(), torch.zeros(())
        row = _finish_row(loss_sum, items, nonfinite_loss, sq_sharded, sq_local)
        if len(shares) > 1:  # modules on their own dims: each group's norm has its own scale
            row["sq_groups"] = torch.stack(shares)
        row["error"] = local_error is not None
        if self.split is not None:
            row.update(
                self.split.count_fields(items=row["items"], loss=row["loss"], counted=counted)
            )
        rows = agree_rows(row, group=self.group)  # the step's only extra collective
        if rows.ranks_where("error"):
            self._drop_grads()
            rows.error(op, local_error)  # raises on every rank; nothing stepped
        empty = normalize_by_items if skip_if_empty is None else skip_if_empty
        agreed = self._read(rows, float(sq_local), backward_scale, normalize_by_items, empty)
        if agreed.skip_reason is not None:
            return self._skip(agreed, micro_batches, loss_scale)
        clip_coef = self._clip_coef(agreed.grad_norm)
        for gs, rescale in zip(grads, agreed.rescales, strict=True):
            self._mul_grads(gs, rescale * clip_coef)
        self._optimizer_step()
        self._drop_grads()
        self.steps += 1
        return agreed.stats(
            clip_coef=clip_coef,
            skip_reason=None,
            micro_batches=micro_batches,
            loss_scale=loss_scale,
            step=self.steps,
        )

    # -- the steps of `finish` -----------------------------------------------------

    def _read(
        self,
        rows: Rows,
        sq_local: float,
        backward_scale: float,
        normalize_by_items: bool,
        skip_if_empty: bool,
    ) -> _Agreed:
        """What every rank decides from the agreed rows (the same on every rank)."""
        n_items = _rank_sum(rows["items"])
        items_per_rank = rows["items"]
        loss_total = _rank_sum(rows["loss"])
        if self.split is not None:  # each data shard counted once, replicas checked
            try:
                counts = self.split.read_counts("step", rows)
            except WholebatchError:
                self._drop_grads()  # raised on every rank alike; nothing stepped
                raise
            n_items, loss_total = counts.items, counts.loss_sum
        if negative := rows.ranks_where("negative_items"):
            self._drop_grads()
            raise WholebatchError(
                f"step: item counts must be >= 0; got {dict(enumerate(items_per_rank))} "
                f"(negative on ranks {negative}); loss_fn must return the number of items it summed"
            )
        divisor = n_items if normalize_by_items else 1.0
        factors = [g.reduction.factor for g in self.grad_groups] or [self.reduce_factor]
        rescales = tuple(
            f / (backward_scale * divisor) if divisor != 0 else math.nan for f in factors
        )
        rescale = rescales[0]
        grad_norm = math.sqrt(_rank_sum(rows["sq_sharded"]) + sq_local) * abs(rescale)
        if len(rescales) > 1:  # Σ over groups of (its scale)² x (its squared norm over ranks)
            per_group = [_rank_sum(col) for col in zip(*rows.vectors("sq_groups"), strict=True)]
            grad_norm = math.sqrt(
                _rank_sum(tuple(q * r * r for q, r in zip(per_group, rescales, strict=True)))
            )
        bad_loss = rows.ranks_where("bad_loss")
        bad_grad = rows.ranks_where("bad_grad")
        reason: str | None = None
        amp_overflow = False
        if bad_loss:
            reason = f"non-finite loss on ranks {bad_loss}"
        elif skip_if_empty and n_items == 0:
            reason = "the step held 0 items on every rank"
        elif bad_grad:
            reason = f"non-finite gradient on ranks {bad_grad}"
            amp_overflow = self.scaler is not None
        return _Agreed(
            loss=loss_total / divisor if divisor != 0 else math.nan,
            items=n_items,
            items_per_rank=items_per_rank,
            grad_norm=grad_norm,
            rescale=rescale,
            rescales=rescales,
            skip_reason=reason,
            backoff=bool(bad_grad) or bool(bad_loss),
            amp_overflow=amp_overflow,
        )

    def _skip(self, agreed: _Agreed, micro_batches: int, loss_scale: float | None) -> StepStats:
        """Drop the step on every rank: no update, the AMP scale ended alike; or raise."""
        self._drop_grads()
        self._skip_scaler(backoff=agreed.backoff)
        self.skipped_steps += 1
        reason = agreed.skip_reason
        assert reason is not None
        if self.config.on_nonfinite == "raise" and not agreed.amp_overflow:
            raise NonFiniteStepError(
                f"step: {reason}; the step was dropped on every rank and parameters are "
                "untouched. Pass on_nonfinite='skip' to skip such steps, or find the "
                "micro-batch that produced it"
            )
        overflow = " (AMP overflow; loss scale backed off)" if agreed.amp_overflow else ""
        return agreed.stats(
            clip_coef=1.0,
            skip_reason=reason + overflow,
            micro_batches=micro_batches,
            loss_scale=loss_scale,
            step=self.steps,
        )

    def _clip_coef(self, grad_norm: float) -> float:
        """The factor clipping to `max_grad_norm` applies (1.0 without clipping)."""
        max_norm = self.config.max_grad_norm
        if max_norm is None:
            return 1.0
        return min(1.0, max_norm / (grad_norm + _CLIP_EPS))

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            # Every rank's local found_inf is 0 here (the agreed flag says all gradients
            # are finite), so the scaler steps and grows on every rank alike.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    # -- helpers ---------------------------------------------------------------

    @staticmethod
    def _squared_norms(grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Sum of squares of sharded (to be summed over ranks) and other gradients, float64 CPU."""
        sharded = [local_tensor(g) for g in grads if is_sharded(g)]
        local = [local_tensor(g) for g in grads if not is_sharded(g)]

        def sq(ts: list[Tensor]) -> Tensor:
            if not ts:
                return torch.zeros((), dtype=torch.float64)
            norms = torch._foreach_norm(ts, 2, dtype=torch.float64)
            return torch.stack([n.cpu() for n in norms]).square().sum()

        return sq(sharded), sq(local)

    @staticmethod
    @torch.no_grad()
    def _mul_grads(grads: list[Tensor], factor: float) -> None:
        if factor == 1.0:
            return
        by_device_dtype: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for g in grads:
            t = local_tensor(g)
            by_device_dtype.setdefault((t.device, t.dtype), []).append(t)
        for ts in by_device_dtype.values():
            torch._foreach_mul_(ts, factor)

    def _drop_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def _skip_scaler(self, *, backoff: bool) -> None:
        """End a skipped step's AMP bookkeeping the same way on every rank.

        `unscale_` recorded only this rank's found_inf (with FSDP2 a rank sees only its
        shard), so `update()` could back off on one rank and not another. We set the
        scale explicitly instead: backed off (and the growth streak reset, as torch
        does on an inf) when a gradient or loss was non-finite, unchanged otherwise.
        """
        scaler = self.scaler
        if scaler is None:
            return
        scale = scaler.get_scale()
        new_scale = scale * scaler.get_backoff_factor() if backoff else scale
        scaler.update(new_scale=float(new_scale))
        if backoff:
            state = scaler.state_dict()
            state["_growth_tracker"] = 0
            scaler.load_state_dict(state)

    # -- checkpointing -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step counters and the GradScaler's state (the model and optimizer save themselves)."""
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])
        if (state.get("scaler") is None) != (self.scaler is None):
            raise WholebatchError(
                "load_state_dict: the checkpoint was saved "
                f"{'without' if state.get('scaler') is None else 'with'} a GradScaler but this "
                f"engine has {'none' if self.scaler is None else 'one'}; build it the same way"
            )
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
