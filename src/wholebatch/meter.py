"""Measuring what autograd keeps: the peak bytes of tensors saved for backward.

Below every layer that measures (the planner's `measure_model`, `wholebatch
verify` and the demo), so that neither imports the other for it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

__all__ = ["SavedTensorMeter"]


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
