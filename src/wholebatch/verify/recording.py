"""Instruments for checking a training step from outside: what it stepped, what dropout drew, what it saved.

- `GradRecorder`: an optimizer that records the gradients it is asked to step
  with and leaves the parameters alone, so a step that calls `optimizer.step()`
  and `zero_grad()` itself (an `Accumulator`, a `CachedStep`) can still be
  compared gradient by gradient.
- `TapeDropout` / `install_tape_dropout`: `nn.Dropout` that records the masks it
  draws (from torch's global RNG, as `nn.Dropout` does, so RNG replay matters
  exactly as it does for the real module) and can replay them in a reference
  model, or be switched off.
- `SavedTensorMeter`: the peak bytes of activations held for backward (tensors
  saved by autograd, parameters excluded): a deterministic measure of
  activation memory that works on CPU.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn

from wholebatch.errors import WholebatchError

__all__ = [
    "DropoutMode",
    "GradRecorder",
    "SavedTensorMeter",
    "TapeDropout",
    "install_tape_dropout",
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

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Record the current gradients (a `closure` is called first, as optimizers do)."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        self.calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.detach().to(torch.float64).clone()
                self.grads[id(p)] = g if id(p) not in self.grads else self.grads[id(p)] + g

    def gradient(self, p: Tensor) -> Tensor | None:
        """The gradient `p` was stepped with, or, if `step()` was never called, its `.grad`."""
        if self.calls:
            return self.grads.get(id(p))
        return None if p.grad is None else p.grad.detach().to(torch.float64).clone()


class TapeDropout(nn.Module):
    """`nn.Dropout(p)` whose masks can be recorded, replayed or switched off.

    "record": in training mode draw a mask from torch's global RNG (so a step that
    restores the RNG state redraws the same mask) and append it to `tape`;
    "replay": take the mask rows from `tape` in order (rows = dim 0), for a
    reference that sees the same rows in the same order; "off": identity.
    """

    def __init__(self, p: float, mode: DropoutMode = "record", name: str = "") -> None:
        super().__init__()
        self.p = p
        self.mode: DropoutMode = mode
        self.name = name
        self.tape: list[Tensor] = []
        self._replay_row = 0

    def forward(self, x: Tensor) -> Tensor:
        if self.mode == "off" or not self.training or self.p == 0.0:
            return x
        if self.mode == "record":
            keep = torch.rand(x.shape, device=x.device) >= self.p
            self.tape.append(keep.cpu())
        else:
            keep = self._next_rows(x).to(x.device)
        return x * keep.to(x.dtype) / (1.0 - self.p)

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

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode}"


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


class SavedTensorMeter:
    """Peak bytes of tensors autograd saves for backward, while `track()` is active.

    A saved tensor counts from when it is saved until it is freed (its graph is
    released after backward and nothing else holds it); storages are counted
    once however often they are saved; parameters (always resident) are not
    counted. CPU-only friendly and deterministic, unlike resident memory.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self.peak = 0
        self.live = 0
        self._storages: dict[int, int] = {}
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}

    def _free(self, key: int) -> None:
        self.live -= self._storages.pop(key, 0)

    def _pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self._exclude and key not in self._storages:
            self._storages[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, key)
        return t

    @contextlib.contextmanager
    def track(self) -> Iterator[SavedTensorMeter]:
        """Count saved tensors inside this context."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
