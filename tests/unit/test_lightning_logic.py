"""WholeBatchAccumulation's arithmetic without Lightning (one process): the window's count,
its scale and its checks, and no host sync per micro-batch for the non-finite flag."""

from __future__ import annotations

import math

import pytest
import torch

from wholebatch.errors import WholebatchError
from wholebatch.integrations.lightning import _AccumulationLogic


def _param_with_grad(value: float) -> torch.Tensor:
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.full((3,), value)
    return p


def test_window_scales_every_gradient_by_the_window_count() -> None:
    logic = _AccumulationLogic()
    for s, n in ((6.0, 3), (4.0, 1)):
        out = logic.record({"loss": torch.tensor(s, requires_grad=True), "items": n})
        assert out["loss"].requires_grad
    p = _param_with_grad(2.0)
    stats = logic.finish_window(2, [p])
    # c = 1 / items_estimate (1.0 before the first window), divisor 2: factor 2 / 4
    assert stats.items == 4 and stats.loss == pytest.approx(10.0 / 4)
    torch.testing.assert_close(p.grad, torch.full((3,), 2.0 * 2 / 4))


def test_non_finite_window_without_items_is_not_an_empty_window() -> None:
    logic = _AccumulationLogic()
    logic.record({"loss": torch.tensor(float("nan"), requires_grad=True), "items": 0})
    assert isinstance(logic._window_bad, torch.Tensor)  # a device flag, not a host bool
    stats = logic.finish_window(1, [_param_with_grad(1.0)])
    assert math.isnan(stats.loss)


def test_empty_window_names_the_fix() -> None:
    logic = _AccumulationLogic()
    logic.record({"loss": torch.tensor(0.0, requires_grad=True), "items": 0})
    with pytest.raises(WholebatchError, match=r"held .* items per rank"):
        logic.finish_window(1, [_param_with_grad(1.0)])
