"""PyTorch Lightning's `accumulate_grad_batches`, exact over the whole batch: `WholeBatchAccumulation`.

Change two lines (docs/integrations/lightning.md):

    trainer = L.Trainer(accumulate_grad_batches=3, strategy="ddp",
                        callbacks=[WholeBatchAccumulation()])      # 1: the callback
    def training_step(self, batch, batch_idx):
        ...
        return {"loss": token_losses.sum(), "items": n_tokens}    # 2: a sum and its count

With it, every optimizer step's gradient (after DDP's or FSDP's mean; FSDP2 through
Lightning's ModelParallelStrategy is tested too) is that of
(sum of every item loss) / N, N the number of items in the whole window: the
step's micro-batches on every rank, the epoch's short last window included.
The logged `train_loss` is that window's whole-batch mean, the same on every rank.

What Lightning 2.6.6 does (loops/optimization/automatic.py): each micro-batch's
loss is divided by `accumulate_grad_batches` (K) and back-propagated; DDP
averages over the W ranks on the last micro-batch of the window. A token mean in
`training_step` thus becomes a mean of K·W means: micro-batches holding fewer
tokens weigh as much as full ones (Lightning-AI/pytorch-lightning #20350). The
window that ends the epoch early (fewer than K batches left) is divided by K
too, so its step is too small (#19987).

What the callback does (the training loop stays Lightning's):

- `training_step` returns {"loss": sum of the micro-batch's item losses,
  "items": how many items that sum holds} (keys relied on; other keys pass
  through to `outputs`). The callback wraps the LightningModule's
  `training_step` for the fit (restored in `teardown`), records the loss
  (detached) and the count, and hands Lightning `loss · c` to back-propagate,
  c = W / N' with N' the previous step's agreed count (1 on the first): the
  gradient then has a mean loss's size, for AMP's scaler (the Accumulator's
  rule, `wholebatch.train.accumulate`).
- `on_before_optimizer_step` (after the window's last backward, before
  Lightning clips and steps): ONE small all-gather of every rank's
  [loss sum, items, micro-batches]; every gradient of the optimizer's
  parameters is multiplied by K·W / (c·N) (K: `accumulate_grad_batches`, the
  divisor Lightning applied to every micro-batch, short window included; W for
  the wrapper's mean). Gradients are linear in the loss, so that equals
  back-propagating sum / N, to round-off. Lightning's `gradient_clip_val` then
  clips the true whole-batch gradient.

Refused, the same on every rank: manual optimisation (use `wholebatch.GradCache`
or an `Accumulator`-style loop there, docs/integrations/lightning.md), a
strategy that accumulates itself (DeepSpeed: docs/integrations/deepspeed.md),
a `training_step` whose output lacks "loss" or "items", ranks whose windows
differ in length, a window with no items on any rank.

`lightning` is never imported by this module's import; the callback class is
built on first use (`WholeBatchAccumulation()`), so the base class is the real
`lightning.pytorch.Callback` (or `pytorch_lightning.Callback`, whichever the
Trainer comes from: pass `package="pytorch_lightning"`).

Legend: W data-parallel ranks, K `accumulate_grad_batches`, N items in the window.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from wholebatch.comm import agree_rows, get_world_size, is_distributed
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.integrations._common import require_peer

__all__ = ["LightningStepStats", "WholeBatchAccumulation", "lightning_callback_class"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LightningStepStats:
    """What one optimizer step of a Lightning fit saw; identical on every rank."""

    loss: float
    """The window's whole-batch mean loss: (sum of item losses over its micro-batches and
    ranks) / `items`. This is what the callback logs."""

    items: float
    """N: the items of the window over all ranks."""

    items_per_rank: tuple[float, ...]
    """Each rank's item count for the window, in rank order."""

    micro_batches: int
    """The window's micro-batches (K, or fewer in an epoch's short last window)."""

    grad_factor: float
    """What every gradient was multiplied by before Lightning's clipping and step."""


def _as_count(op: str, value: object, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise WholebatchTypeError(
                f"{op}: training_step's 'items' must be one number, got a tensor of shape "
                f"{tuple(value.shape)}"
            )
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WholebatchTypeError(
            f"{op}: training_step's 'items' must be an int, float or one-element Tensor (the "
            f"number of items its 'loss' sums), got {type(value).__name__}"
        )
    return torch.tensor(float(value), dtype=torch.float64, device=device)


class _AccumulationLogic:
    """The callback's state and arithmetic, free of Lightning (the class below adds the hooks)."""

    def __init__(
        self,
        *,
        log_name: str | None = "train_loss",
        prog_bar: bool = True,
        grad_reduction: str = "mean",
        group: Any = None,
    ) -> None:
        if grad_reduction not in ("mean", "sum"):
            raise WholebatchError(
                f"WholeBatchAccumulation: grad_reduction={grad_reduction!r}; expected 'mean' "
                "(DDP, FSDP: the strategy averages rank gradients) or 'sum'"
            )
        if log_name is not None and not isinstance(log_name, str):
            raise WholebatchTypeError(
                f"WholeBatchAccumulation: log_name must be a str or None, got "
                f"{type(log_name).__name__}"
            )
        self.log_name = log_name
        self.prog_bar = bool(prog_bar)
        self.grad_reduction = grad_reduction
        self.group = group
        self.items_estimate = 1.0
        self.last_step: LightningStepStats | None = None
        self.history: list[LightningStepStats] = []
        self._c = 1.0
        self._window_loss: Tensor | None = None  # float64, detached
        self._window_items: Tensor | None = None
        self._window_micro = 0
        self._window_bad: Tensor | None = None
        self._wrapped: Any = None

    # -- per micro-batch ---------------------------------------------------------

    def _world(self) -> int:
        return get_world_size(self.group) if is_distributed(self.group) else 1

    def backward_scale(self) -> float:
        """c: the constant each micro-batch's loss sum is multiplied by before Lightning's backward."""
        factor = self._world() if self.grad_reduction == "mean" else 1
        return factor / self.items_estimate

    def record(self, out: object) -> dict[str, Any]:
        """Check one training_step output, record its sum and count, return what Lightning gets."""
        op = "WholeBatchAccumulation"
        if not isinstance(out, Mapping) or "loss" not in out or "items" not in out:
            got = (
                f"a dict with keys {sorted(map(str, out))}"
                if isinstance(out, Mapping)
                else type(out).__name__
            )
            raise WholebatchTypeError(
                f"{op}: training_step returned {got}; it must return "
                '{"loss": the SUM of the micro-batch\'s item losses, "items": their number}, '
                'e.g. F.cross_entropy(logits, y, reduction="sum", ignore_index=-100) and '
                "(y != -100).sum()"
            )
        loss = out["loss"]
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else ""
            raise WholebatchTypeError(
                f"{op}: training_step's 'loss' must be a one-element Tensor, got "
                f"{type(loss).__name__}{shape}"
            )
        if not loss.requires_grad:
            raise WholebatchError(
                f"{op}: training_step's 'loss' does not require grad; a micro-batch with no "
                "items must still return a loss computed from the model output, e.g. "
                '{"loss": logits.sum() * 0, "items": 0}'
            )
        if self._window_micro == 0:
            self._c = self.backward_scale()
        count = _as_count(op, out["items"], loss.device)
        part = loss.detach().reshape(()).to(torch.float64)
        with torch.no_grad():
            self._window_loss = part if self._window_loss is None else self._window_loss + part
            self._window_items = count if self._window_items is None else self._window_items + count
        # a 0-dim flag on the loss's device: no host sync per micro-batch (agree_rows reads it)
        bad = ~torch.isfinite(part)
        self._window_bad = bad if self._window_bad is None else self._window_bad | bad
        self._window_micro += 1
        return {**out, "loss": loss.reshape(()) * self._c}

    # -- per optimizer step --------------------------------------------------------

    def finish_window(self, divisor: int, params: list[Tensor]) -> LightningStepStats:
        """Agree the window's count over ranks and rescale every gradient once (every rank calls it)."""
        op = "WholeBatchAccumulation"
        w = self._world()
        loss = self._window_loss if self._window_loss is not None else torch.zeros(())
        items = self._window_items if self._window_items is not None else torch.zeros(())
        rows = agree_rows(
            {
                "loss": loss.detach(),
                "items": items.detach(),
                "micro_batches": self._window_micro,
                "bad": False if self._window_bad is None else self._window_bad,
            },
            group=self.group,
        )
        c = self._c
        self._window_loss = self._window_items = None
        micro = {r: int(m) for r, m in rows.per_rank("micro_batches").items()}
        self._window_micro, self._window_bad = 0, None
        if len(set(micro.values())) > 1 or micro[0] == 0:
            raise WholebatchError(
                f"{op}: the optimizer step's window holds {micro} micro-batches per rank; every "
                "rank must run the same number through training_step (this callback's wrapper) "
                "before each step. Give every rank the same number of batches "
                "(Lightning's DistributedSampler does), and do not call training_step yourself"
            )
        n = rows.total("items")
        per_rank = rows["items"]
        if n <= 0 and not rows.ranks_where("bad"):
            raise WholebatchError(
                f"{op}: the optimizer step's window held {per_rank} items per rank (none in "
                "all); its whole-batch mean is undefined. Drop batches without items from "
                "the data, or return their true count in 'items'"
            )
        reduce = float(w) if self.grad_reduction == "mean" else 1.0
        factor = divisor * reduce / (c * n) if n > 0 else math.nan
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            with torch.no_grad():
                by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
                for g in grads:
                    t = g.to_local() if hasattr(g, "to_local") else g
                    by_kind.setdefault((t.device, t.dtype), []).append(t)
                for ts in by_kind.values():
                    torch._foreach_mul_(ts, factor)
        stats = LightningStepStats(
            loss=rows.total("loss") / n if n > 0 else math.nan,
            items=n,
            items_per_rank=per_rank,
            micro_batches=micro[0],
            grad_factor=factor,
        )
        if n > 0:
            self.items_estimate = n
        self.last_step = stats
        self.history.append(stats)
        return stats

    # -- the wrap ------------------------------------------------------------------

    def wrap(self, pl_module: Any) -> None:
        """Route `pl_module.training_step` through `record` (an instance attribute; `unwrap` removes it)."""
        if self._wrapped is not None:
            return
        original: Callable[..., Any] = pl_module.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> dict[str, Any]:
            return self.record(original(*args, **kwargs))

        pl_module.training_step = training_step
        self._wrapped = pl_module

    def unwrap(self) -> None:
        module, self._wrapped = self._wrapped, None
        if module is not None and "training_step" in vars(module):
            del module.training_step


def _check_trainer(trainer: Any, pl_module: Any) -> None:
    op = "WholeBatchAccumulation"
    if not getattr(pl_module, "automatic_optimization", True):
        raise WholebatchError(
            f"{op}: {type(pl_module).__name__} uses manual optimisation "
            "(automatic_optimization=False), where Lightning does not accumulate; the callback "
            "has nothing to fix. Use wholebatch.GradCache or your own exact loop there "
            "(docs/integrations/lightning.md)"
        )
    strategy = getattr(trainer, "strategy", None)
    if getattr(strategy, "handles_gradient_accumulation", False):
        raise WholebatchError(
            f"{op}: the strategy {type(strategy).__name__} accumulates gradients itself "
            "(DeepSpeed); drive the engine with wholebatch's DeepSpeed recipe instead "
            "(docs/integrations/deepspeed.md)"
        )


@functools.cache
def lightning_callback_class(package: str = "lightning.pytorch") -> type:
    """The callback class on the real `Callback` of `package` ("lightning.pytorch" or "pytorch_lightning")."""
    pl = require_peer(package, package.split(".")[0], "WholeBatchAccumulation")

    class _WholeBatchAccumulation(pl.Callback, _AccumulationLogic):  # type: ignore[misc, name-defined]  # pl: the peer module, Any
        __doc__ = WholeBatchAccumulation.__doc__

        def __init__(self, **kwargs: Any) -> None:
            pl.Callback.__init__(self)
            _AccumulationLogic.__init__(self, **kwargs)

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage == "fit":
                _check_trainer(trainer, pl_module)
                self.wrap(pl_module)

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage == "fit":
                self.unwrap()

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            stats = self.finish_window(int(trainer.accumulate_grad_batches), params)
            if self.log_name is not None:
                pl_module.log(
                    self.log_name,
                    torch.tensor(stats.loss, dtype=torch.float64),
                    on_step=True,
                    on_epoch=False,
                    prog_bar=self.prog_bar,
                    batch_size=1,
                    sync_dist=False,
                )

        def __repr__(self) -> str:
            return f"WholeBatchAccumulation(log_name={self.log_name!r})"

    _WholeBatchAccumulation.__name__ = "WholeBatchAccumulation"
    _WholeBatchAccumulation.__qualname__ = "WholeBatchAccumulation"
    return _WholeBatchAccumulation


class WholeBatchAccumulation:
    """A Lightning `Callback`: `accumulate_grad_batches=K` gives the whole batch's gradient.

    `WholeBatchAccumulation(...)` returns an instance of a subclass of the real
    `lightning.pytorch.Callback` (built on first use), so it goes in
    `Trainer(callbacks=[...])` like any callback. See the module docstring for
    what it changes.

    Gradient contract: with the LightningModule's `training_step` returning
    {"loss": sum of item losses, "items": count}, the gradient Lightning clips and
    steps on is d(sum of item losses over the window's micro-batches and ranks / N)/dθ,
    N the window's global count, for any K, any window length, any per-rank counts.

    Args:
        log_name: the name the window's whole-batch mean loss is logged under
            (`self.log` on every step, identical on every rank); None: not logged.
        prog_bar: show it in the progress bar.
        grad_reduction: "mean" (DDP and FSDP average rank gradients) or "sum".
        group: the data-parallel process group; None: the world.
        package: "lightning.pytorch" (default) or "pytorch_lightning", whichever
            package your `Trainer` comes from.

    Attributes (of the instance): `last_step` and `history`, `LightningStepStats`
    of each optimizer step.
    """

    def __new__(  # type: ignore[misc]  # returns the peer's Callback subclass, not cls
        cls,
        *,
        log_name: str | None = "train_loss",
        prog_bar: bool = True,
        grad_reduction: str = "mean",
        group: Any = None,
        package: str = "lightning.pytorch",
    ) -> Any:
        real = lightning_callback_class(package)
        return real(
            log_name=log_name, prog_bar=prog_bar, grad_reduction=grad_reduction, group=group
        )
