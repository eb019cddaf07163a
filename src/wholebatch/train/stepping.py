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
`zero_grad(set_to_none=True)`; or skip (or raise) together.

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

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from wholebatch.comm.groups import comm_device, get_world_size, is_distributed
from wholebatch.conventions import GradReduction, check_grad_reduction
from wholebatch.errors import WholebatchError, WholebatchTypeError

try:  # FSDP2 (torch >= 2.6 exports it here)
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - older torch: no FSDP2 support
    FSDPModule = None  # type: ignore[assignment,misc]

try:  # FSDP1 reduces gradients too (a plain module is refused on W > 1 ranks, FSDP1 not)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
except ImportError:  # pragma: no cover - torch without distributed
    FSDP1 = None  # type: ignore[assignment,misc]

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    DTensor = None  # type: ignore[assignment,misc]

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
SyncMode = Literal["ddp", "fsdp2", "none"]

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing; we do the same
# so that clipping here equals clipping with torch's own function on the same gradient.
_CLIP_EPS = 1e-6

# Columns of the one all-gathered float64 row each rank contributes in `finish`.
_LOSS, _ITEMS, _BAD_LOSS, _BAD_GRAD, _SQ_SHARDED, _NEG_ITEMS = range(6)


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


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    if FSDPModule is None:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def compiled_inner(model: nn.Module) -> nn.Module:
    """The module `torch.compile` wrapped (its `_orig_mod`), else `model`: where DDP's `no_sync` lives."""
    inner: nn.Module = getattr(model, "_orig_mod", model)
    return inner


def is_data_parallel(model: nn.Module) -> bool:
    """Whether `model` reduces gradients over ranks: DDP, FSDP2/FSDP1 anywhere in it, or compiled DDP."""
    inner = compiled_inner(model)
    if grad_sync_mode(inner) != "none":
        return True
    return FSDP1 is not None and any(isinstance(m, FSDP1) for m in inner.modules())


def unwrapped_error(model: nn.Module, world_size: int, op: str) -> str | None:
    """The error for a plain module on `world_size` > 1 ranks (nothing reduces it), else None."""
    if world_size <= 1 or is_data_parallel(model):
        return None
    return (
        "the model is a plain module, not wrapped for data parallelism (DDP or "
        f"FSDP2), but the group has {world_size} ranks: nothing would reduce its gradients, "
        "so every rank would step on its own gradient and the replicas drift apart. Pass "
        "the DistributedDataParallel (or fully_shard) module itself (not ddp.module; with "
        f"accelerate, the model accelerator.prepare returned), or {op}(..., rank_local=True) "
        "if each rank is meant to train on its own gradient (or you reduce it yourself)"
    )


def grad_sync_mode(model: nn.Module) -> SyncMode:
    """How `model` synchronises gradients: "ddp", "fsdp2" (it or a submodule is `fully_shard`ed) or "none"."""
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if _fsdp_modules(model):
        return "fsdp2"
    return "none"


@contextlib.contextmanager
def _fsdp_sync(modules: list[nn.Module], sync: bool) -> Iterator[None]:
    for m in modules:
        m.set_requires_gradient_sync(sync, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        # Leave the model as we found it (syncing), also when the loss_fn raised.
        for m in modules:
            m.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]


def sync_context(
    model: nn.Module, index: int, count: int
) -> contextlib.AbstractContextManager[Any]:
    """The context to run micro-batch `index` of `count` in, forward AND backward.

    All micro-batches but the last skip the data-parallel gradient reduction, so a
    step costs exactly one: DDP `no_sync()`; FSDP2 `set_requires_gradient_sync(False)`
    (restored to True on exit); a plain module: nothing. The forward must be inside
    too: DDP decides in its forward whether the coming backward reduces.
    Every rank must use the same `count` (see `StepFinisher.begin`). A
    `torch.compile`'d DDP module is looked through (its `_orig_mod`).
    """
    last = index == count - 1
    inner = compiled_inner(model)
    mode = grad_sync_mode(inner)
    if mode == "ddp" and not last:
        assert isinstance(inner, DistributedDataParallel)
        return inner.no_sync()
    if mode == "fsdp2":
        return _fsdp_sync(_fsdp_modules(inner), last)
    return contextlib.nullcontext()


def _is_dtensor(x: Tensor) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


def _is_sharded(x: Tensor) -> bool:
    return _is_dtensor(x) and any(p.is_shard() for p in x.placements)  # type: ignore[attr-defined]


def _local(x: Tensor) -> Tensor:
    """The tensor this rank holds: a DTensor's local shard, or `x` itself."""
    return x.to_local() if _is_dtensor(x) else x  # type: ignore[attr-defined, no-any-return]


def _gather_rows(row: Tensor, group: ProcessGroup | None) -> Tensor:
    """Every rank's `row` stacked in rank order: [W, len(row)] (one small all-gather)."""
    if not is_distributed(group):
        return row.unsqueeze(0)
    row = row.to(comm_device(group))
    rows = [torch.empty_like(row) for _ in range(get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return torch.stack(rows).cpu()


def _ranks(flags: Tensor) -> list[int]:
    return [int(r) for r in torch.nonzero(flags).flatten().tolist()]


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
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: torch.amp.GradScaler | None = None,
        config: StepConfig | None = None,
        group: ProcessGroup | None = None,
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
        self._check_fsdp_mesh()

    # -- parameters ----------------------------------------------------------

    def params(self) -> list[Tensor]:
        """The optimizer's parameters, in param-group order."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _check_fsdp_mesh(self) -> None:
        # The grad norm sums the squares of sharded gradients over `group`; that is the
        # whole gradient only when the shards are spread over exactly `group` (a 1-D mesh).
        for p in self.params():
            if _is_dtensor(p):
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

    def begin(self, num_micro_batches: int, *, op: str = "step") -> None:
        """Agree the step's micro-batch count K on every rank before any forward.

        One small all-gather. Raises the same `WholebatchError` on every rank when K
        differs across ranks (DDP's last-micro-batch reduction would pair with a
        different collective on a peer: a hang or wrong data), when every rank has
        K = 0, when a rank's parameters already hold gradients (they would be
        added to the step's and break its normalisation), or when the model is a plain
        module on W > 1 ranks without `config.rank_local` (nothing reduces its gradients).
        """
        stale = any(p.grad is not None for p in self.params())
        plain = not self.config.rank_local and unwrapped_error(self.model, self.world_size, op)
        row = torch.tensor([int(num_micro_batches), int(stale), int(bool(plain))])
        rows = _gather_rows(row, self.group)
        if plain_ranks := _ranks(rows[:, 2]):
            text = unwrapped_error(nn.Identity(), self.world_size, op.split(".")[0])
            raise WholebatchError(f"{op}: on ranks {plain_ranks}, {text}")
        ks = {r: int(k) for r, k in enumerate(rows[:, 0].tolist())}
        if len(set(ks.values())) > 1:
            raise WholebatchError(
                f"{op}: micro_batches differ in number across ranks {ks}; every rank must run "
                "the same number per step (DDP/FSDP reduce on the last one). Use a sampler "
                "that gives every rank the same count (DistributedSampler(drop_last=True)), "
                "or pad a short rank with micro-batches of zero items (they add nothing)"
            )
        if ks[0] == 0:
            raise WholebatchError(
                f"{op}: micro_batches is empty on every rank; a step needs at least one "
                "micro-batch (stop iterating when the data is exhausted)"
            )
        stale_ranks = _ranks(rows[:, 1])
        if stale_ranks:
            raise WholebatchError(
                f"{op}: parameters already hold gradients on ranks {stale_ranks} before the "
                "step's first backward; they would be added to the step's gradient. Call "
                "optimizer.zero_grad(set_to_none=True) once before the first step (each step "
                "zeroes them after itself)"
            )

    def finish(
        self,
        *,
        loss_sum: Tensor | float,
        items: Tensor | float,
        micro_batches: int,
        backward_scale: float = 1.0,
        normalize_by_items: bool = True,
        nonfinite_loss: Tensor | bool | None = None,
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

        Returns:
            The step's `StepStats` (identical on every rank).

        Raises:
            NonFiniteStepError: on every rank, with `on_nonfinite="raise"`, when a loss
                or gradient was non-finite on any rank or the step held no items.
        """
        cfg = self.config
        loss_t = torch.as_tensor(loss_sum).detach().to(torch.float64).reshape(())
        items_t = torch.as_tensor(items).detach().to(torch.float64).reshape(())
        bad_loss = (
            ~torch.isfinite(loss_t)
            if nonfinite_loss is None
            else torch.as_tensor(nonfinite_loss).to(loss_t.device).reshape(()).bool()
        )
        loss_scale = self.loss_scale
        params = self.params()
        if self.scaler is not None:
            # Unscale once, before the norm: the norm, clipping and the inf check all see
            # true gradients. Purely local (no collective); its own found_inf is only
            # this rank's and is superseded by the agreed flag below.
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        sq_sharded, sq_local = self._squared_norms(grads)
        row = torch.stack(
            [
                loss_t.cpu(),
                items_t.cpu(),
                bad_loss.to(torch.float64).cpu(),
                (~torch.isfinite(sq_sharded + sq_local)).to(torch.float64),
                sq_sharded,
                (items_t.cpu() < 0).to(torch.float64),
            ]
        )  # [6]
        rows_W6 = _gather_rows(row, self.group)  # the step's only extra collective
        total = rows_W6.sum(0)  # same rows, same order on every rank: bitwise equal results
        n_items = float(total[_ITEMS])
        items_per_rank = tuple(float(x) for x in rows_W6[:, _ITEMS].tolist())
        neg = _ranks(rows_W6[:, _NEG_ITEMS])
        if neg:
            self._drop_grads()
            raise WholebatchError(
                f"step: item counts must be >= 0; got {dict(enumerate(items_per_rank))} "
                f"(negative on ranks {neg}); loss_fn must return the number of items it summed"
            )
        divisor = n_items if normalize_by_items else 1.0
        loss = float(total[_LOSS]) / divisor if divisor != 0 else math.nan
        bad_loss_ranks = _ranks(rows_W6[:, _BAD_LOSS])
        bad_grad_ranks = _ranks(rows_W6[:, _BAD_GRAD])
        reduce_factor = float(self.world_size) if cfg.grad_reduction == "mean" else 1.0
        rescale = reduce_factor / (backward_scale * divisor) if divisor != 0 else math.nan
        grad_norm = math.sqrt(float(total[_SQ_SHARDED]) + float(sq_local)) * abs(rescale)

        reason: str | None = None
        amp_overflow = False
        if bad_loss_ranks:
            reason = f"non-finite loss on ranks {bad_loss_ranks}"
        elif normalize_by_items and n_items == 0:
            reason = "the step held 0 items on every rank"
        elif bad_grad_ranks:
            reason = f"non-finite gradient on ranks {bad_grad_ranks}"
            amp_overflow = self.scaler is not None
        if reason is not None:
            self._drop_grads()
            self._skip_scaler(backoff=bool(bad_grad_ranks) or bool(bad_loss_ranks))
            self.skipped_steps += 1
            if cfg.on_nonfinite == "raise" and not amp_overflow:
                raise NonFiniteStepError(
                    f"step: {reason}; the step was dropped on every rank and parameters are "
                    "untouched. Pass on_nonfinite='skip' to skip such steps, or find the "
                    "micro-batch that produced it"
                )
            return StepStats(
                loss=loss,
                items=n_items,
                items_per_rank=items_per_rank,
                grad_norm=grad_norm,
                clip_coef=1.0,
                skipped=True,
                skip_reason=reason
                + (" (AMP overflow; loss scale backed off)" if amp_overflow else ""),
                micro_batches=micro_batches,
                loss_scale=loss_scale,
                step=self.steps,
            )

        clip_coef = 1.0
        if cfg.max_grad_norm is not None:
            clip_coef = min(1.0, cfg.max_grad_norm / (grad_norm + _CLIP_EPS))
        self._mul_grads(grads, rescale * clip_coef)
        if self.scaler is not None:
            # Every rank's local found_inf is 0 here (the agreed flag says all gradients
            # are finite), so the scaler steps and grows on every rank alike.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self._drop_grads()
        self.steps += 1
        return StepStats(
            loss=loss,
            items=n_items,
            items_per_rank=items_per_rank,
            grad_norm=grad_norm,
            clip_coef=clip_coef,
            skipped=False,
            skip_reason=None,
            micro_batches=micro_batches,
            loss_scale=loss_scale,
            step=self.steps,
        )

    # -- helpers ---------------------------------------------------------------

    @staticmethod
    def _squared_norms(grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Sum of squares of sharded (to be summed over ranks) and other gradients, float64 CPU."""
        sharded = [_local(g) for g in grads if _is_sharded(g)]
        local = [_local(g) for g in grads if not _is_sharded(g)]

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
            t = _local(g)
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
