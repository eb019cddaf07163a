"""Instruments for checking a training step from outside: what it stepped, what dropout drew, what it saved.

- `GradRecorder`: an optimizer that records the gradients it is asked to step
  with and leaves the parameters alone, so a step that calls `optimizer.step()`
  and `zero_grad()` itself (an `Accumulator`, a `CachedStep`) can still be
  compared gradient by gradient.
- `TapeDropout` / `install_tape_dropout`: `nn.Dropout` that records the masks it
  draws (from torch's global RNG, as `nn.Dropout` does, so RNG replay matters
  exactly as it does for the real module) and can replay them in a reference
  model, or be switched off.
- `SavedTensorMeter` (from `wholebatch.meter`, below verify and the planner):
  the peak bytes of activations held for backward (tensors saved by autograd,
  parameters excluded): a deterministic measure of activation memory that works
  on CPU.
- `watch_collectives` / `collectives_seen`: counts the `torch.distributed`
  collectives a step calls on tensors that need gradient (they carry none), and
  (`collectives_in_functions`) those called inside a custom autograd Function's
  forward or backward (a hand-written GatherLayer).

The precision a step computes in is `wholebatch.verify.precision`'s, the rows a
trainer's forwards saw `wholebatch.verify.rows`'.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, overload

import torch
from torch import Tensor, nn

from wholebatch.errors import WholebatchError
from wholebatch.meter import SavedTensorMeter as SavedTensorMeter

__all__ = [
    "DropoutMode",
    "GradRecorder",
    "SavedTensorMeter",
    "TapeDropout",
    "collectives_in_functions",
    "collectives_seen",
    "in_backward",
    "in_function",
    "install_tape_dropout",
    "is_watched",
    "patch",
    "unwatch_collectives",
    "watch_collectives",
]

DropoutMode = Literal["record", "replay", "off"]


class GradRecorder(torch.optim.Optimizer):
    """An optimizer whose `step()` records every parameter's gradient and changes nothing.

    `param_groups` hold an `lr` (1.0) so code that reads or schedules it works.
    `calls` counts `step()` calls; `grads` holds, per parameter, the sum of the
    gradients seen at those calls (one whole-batch step calls it once).
    """

    def __init__(self, params: Iterable[Tensor]) -> None:
        super().__init__(list(params), {"lr": 1.0})
        self.calls = 0
        self.grads: dict[int, Tensor] = {}

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Record the current gradients (a `closure` is called first, as optimizers do, and its
        loss returned)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.calls += 1
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    g = p.grad.detach().to(torch.float64).clone()
                    self.grads[id(p)] = g if id(p) not in self.grads else self.grads[id(p)] + g
        return loss

    def gradient(self, p: Tensor) -> Tensor | None:
        """The gradient `p` was stepped with, or, if `step()` was never called, its `.grad`."""
        if self.calls:
            return self.grads.get(id(p))
        return None if p.grad is None else p.grad.detach().to(torch.float64).clone()


def in_backward() -> bool:
    """True while autograd runs a backward pass (where checkpointing recomputes its forward)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and int(current()) != -1


class TapeDropout(nn.Module):
    """`nn.Dropout(p)` whose masks can be recorded, replayed or switched off.

    "record": in training mode draw a mask from torch's global RNG (so a step that
    restores the RNG state redraws the same mask) and append it to `tape`; a mask
    drawn during a backward pass (activation checkpointing recomputing its
    forward) is kept apart in `recomputed`, since it covers rows already seen.
    "replay": take the mask rows from `tape` in order (rows = dim 0), for a
    reference that sees the same rows in the same order (a recomputation during
    backward gets the mask its forward got). "off": identity, and `p`
    reads 0 so code that applies the module's `p` itself (attention kernels'
    `dropout_p`) draws nothing either.
    """

    def __init__(self, p: float, mode: DropoutMode = "record", name: str = "") -> None:
        super().__init__()
        self.rate = p
        self.mode: DropoutMode = mode
        self.name = name
        self.tape: list[Tensor] = []
        self.recomputed: list[Tensor] = []
        self._replayed: list[Tensor] = []
        self._replay_row = 0

    @property
    def p(self) -> float:
        """The drop probability (0 when off)."""
        return 0.0 if self.mode == "off" else self.rate

    def forward(self, x: Tensor) -> Tensor:
        if self.mode == "off" or not self.training or self.rate == 0.0:
            return x
        if self.mode == "record":
            keep = torch.rand(x.shape, device=x.device) >= self.rate
            (self.recomputed if in_backward() else self.tape).append(keep.cpu())
        elif in_backward():
            # A checkpoint recomputing this module in the reference's backward: the mask of
            # the latest forward call of that shape (what preserve_rng_state=True redraws).
            seen = next((m for m in reversed(self._replayed) if m.shape == x.shape), None)
            keep = (seen if seen is not None else self._next_rows(x)).to(x.device)
        else:
            keep = self._next_rows(x)
            self._replayed.append(keep)
            keep = keep.to(x.device)
        return x * keep.to(x.dtype) / (1.0 - self.rate)

    def _next_rows(self, x: Tensor) -> Tensor:
        whole = torch.cat(self.tape) if len(self.tape) != 1 else self.tape[0]
        start, stop = self._replay_row, self._replay_row + x.shape[0]
        if stop > whole.shape[0] or whole.shape[1:] != x.shape[1:]:
            raise WholebatchError(
                f"dropout {self.name!r}: the reference asked for rows {start}..{stop - 1} of shape "
                f"{tuple(x.shape[1:])}, but the split step's first pass drew masks for "
                f"{whole.shape[0]} rows of shape {tuple(whole.shape[1:])}; the reference must "
                "pass the whole batch's rows through each dropout module once, in batch order"
            )
        self._replay_row = stop
        return whole[start:stop]

    def first_rows(self, rows: int) -> Tensor | None:
        """The masks of the first calls that together cover `rows` rows (the first pass), or None."""
        taken, total = [], 0
        for mask in self.tape:
            if total >= rows:
                break
            taken.append(mask)
            total += mask.shape[0]
        if total != rows or not taken:
            return None
        return torch.cat(taken)

    def redrawn(self, rows: int) -> int:
        """Masks drawn again after the first pass over `rows` rows (a second forward, or a
        recomputation in backward) that equal no first-pass mask: RNG not replayed."""
        first, total = [], 0
        for mask in self.tape:
            if total >= rows:
                break
            first.append(mask)
            total += mask.shape[0]
        again = self.tape[len(first) :] + self.recomputed
        return sum(not any(m.shape == f.shape and torch.equal(m, f) for f in first) for m in again)

    def extra_repr(self) -> str:
        return f"p={self.rate}, mode={self.mode}"


def install_tape_dropout(model: nn.Module, mode: DropoutMode) -> dict[str, TapeDropout]:
    """Replace every `nn.Dropout` (exactly that class) in `model` by a `TapeDropout`; name -> module."""
    found: dict[str, TapeDropout] = {}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Dropout and child.p > 0:
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                tape = TapeDropout(child.p, mode, name)
                tape.train(child.training)
                setattr(parent, child_name, tape)
                found[name] = tape
    return found


# ---------------------------------------------------------------------------
# Collectives without gradient
# ---------------------------------------------------------------------------

# The torch.distributed collectives whose result carries no gradient. A step that
# passes them a tensor which needs gradient (in grad mode) cuts the graph there:
# what verify reports as "a gather without gradient".
_WATCHED = (
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "scatter",
)
_SEEN: collections.Counter[str] = collections.Counter()
_IN_FUNCTIONS: collections.Counter[str] = collections.Counter()
_DEPTH = [0]
# The custom autograd Functions running now, innermost last ("GatherLayer.forward").
_FUNCTIONS: list[str] = []


def _needs_grad(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.requires_grad
    if isinstance(value, list | tuple):
        return any(_needs_grad(v) for v in value)
    return False


def _watched(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        # A collective may re-enter itself (a TorchFunctionMode hands it back): count once.
        if not _DEPTH[0] and _FUNCTIONS:
            _IN_FUNCTIONS[f"{_FUNCTIONS[-1]}: torch.distributed.{name}"] += 1
        elif (
            not _DEPTH[0]
            and torch.is_grad_enabled()
            and (any(_needs_grad(a) for a in args) or any(_needs_grad(v) for v in kwargs.values()))
        ):
            _SEEN[f"torch.distributed.{name}"] += 1
        _DEPTH[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1

    _WRAPPED[call] = fn
    return call


# The wrappers verify installed in torch, each to the function it wraps (keyed by the wrapper
# itself, not marked by an attribute on it).
_WRAPPED: weakref.WeakKeyDictionary[Callable[..., Any], Callable[..., Any]] = (
    weakref.WeakKeyDictionary()
)


def is_watched(fn: object) -> bool:
    """Whether `fn` is one of the wrappers `watch_collectives` installed."""
    try:
        return fn in _WRAPPED
    except TypeError:  # not weak-referenceable: not ours
        return False


def patch(owner: Any, name: str, value: Any) -> None:
    """Set `owner.name` (a torch function or method verify wraps, or restores): the one place
    verify assigns into torch's namespaces and classes."""
    setattr(owner, name, value)


def in_function() -> bool:
    """True while a custom autograd Function's forward or backward runs (once `watch_collectives`
    wrapped `Function.apply`, as verify's processes do)."""
    return bool(_FUNCTIONS)


@contextlib.contextmanager
def _inside(name: str) -> Iterator[None]:
    _FUNCTIONS.append(name)
    try:
        yield
    finally:
        _FUNCTIONS.pop()


def _watch_functions() -> None:
    """Name the custom autograd Function whose forward or backward is running (`_FUNCTIONS`)."""
    from torch.autograd.function import BackwardCFunction, Function

    apply = Function.__dict__["apply"]
    if is_watched(apply.__func__):
        return
    forward_apply: Callable[..., Any] = apply.__func__
    backward_apply: Callable[..., Any] = BackwardCFunction.apply

    def watched_forward(cls: type[Function], *args: Any, **kwargs: Any) -> Any:
        with _inside(f"{cls.__qualname__}.forward"):
            return forward_apply(cls, *args, **kwargs)

    def watched_backward(self: Any, *args: Any) -> Any:
        with _inside(f"{self._forward_cls.__qualname__}.backward"):
            return backward_apply(self, *args)

    _WRAPPED[watched_forward] = forward_apply
    _WRAPPED[watched_backward] = backward_apply
    patch(Function, "apply", classmethod(watched_forward))
    patch(BackwardCFunction, "apply", watched_backward)


def _unwatch_functions() -> None:
    from torch.autograd.function import BackwardCFunction, Function

    apply = Function.__dict__["apply"]
    if is_watched(apply.__func__):
        patch(Function, "apply", classmethod(_WRAPPED[apply.__func__]))
    backward: Any = BackwardCFunction.apply
    if is_watched(backward):
        patch(BackwardCFunction, "apply", _WRAPPED[backward])


def watch_collectives() -> None:
    """Count calls of torch.distributed's collectives on tensors that need gradient (idempotent).

    Patches `torch.distributed` and `torch.distributed.distributed_c10d` in this
    process; call it before the code under test imports its names. Calls made
    inside a custom autograd Function's forward or backward (differentiable
    collectives such as `wholebatch.all_gather` or `torch.distributed.nn`, and
    hand-written GatherLayers) are counted apart, per Function
    (`collectives_in_functions`): `torch.autograd.Function.apply` and its backward
    node's `apply` are wrapped to name the Function running.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _watch_functions()
    for name in _WATCHED:
        fn = getattr(c10d, name, None)
        if fn is None or is_watched(fn):
            continue
        wrapped = _watched(name, fn)
        patch(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            patch(dist, name, wrapped)


def unwatch_collectives() -> None:
    """Undo `watch_collectives` (restore torch.distributed's and autograd's own functions)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _unwatch_functions()
    for name in _WATCHED:
        fn = getattr(c10d, name, None)
        if fn is None or not is_watched(fn):
            continue
        original = _WRAPPED[fn]
        patch(c10d, name, original)
        if getattr(dist, name, None) is fn:
            patch(dist, name, original)


def collectives_seen(reset: bool = False) -> dict[str, int]:
    """Collectives without gradient called on tensors needing gradient since the last reset."""
    seen = dict(_SEEN)
    if reset:
        _SEEN.clear()
    return seen


def collectives_in_functions(reset: bool = False) -> dict[str, int]:
    """'Function.forward: torch.distributed.op' -> calls, inside custom autograd Functions."""
    seen = dict(_IN_FUNCTIONS)
    if reset:
        _IN_FUNCTIONS.clear()
    return seen
