"""Measure a model for the planner on CPU: activation memory per sample and parameter count.

    from wholebatch.planner.measure import measure_model
    act_mib, params = measure_model(model, lambda m: m(*example_batch), rows=8)
    plan(PlanConfig(act_mib=act_mib, params=params, ...))

One forward of `rows` samples runs under `SavedTensorMeter` (the bytes autograd
keeps for backward, deterministic on CPU), then its backward frees them. The
count is per sample of the example batch: activations scale with rows, and on
a GPU with the same dtypes the saved tensors are the same sizes. Kernels that
keep extra workspaces on GPU (cuDNN, flash attention) can differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wholebatch.errors import WholebatchError

__all__ = ["measure_model"]


def measure_model(model: Any, forward: Callable[[Any], Any], *, rows: int) -> tuple[float, int]:
    """(activation MiB per sample, parameter count) of `model` on one forward of `rows` samples.

    Args:
        model: an `nn.Module` (on CPU).
        forward: runs the model on an example micro-batch of `rows` samples and
            returns a tensor or a tuple of tensors (e.g. both towers' embeddings).
        rows: samples in that micro-batch (the count is divided by it).
    """
    import torch

    from wholebatch.meter import SavedTensorMeter

    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise WholebatchError(f"measure_model: rows={rows!r} must be a positive int")
    params = list(model.parameters())
    meter = SavedTensorMeter(exclude=params)
    with meter.track():
        out = forward(model)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    tensors = [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise WholebatchError("measure_model: the forward returned no tensor that requires grad")
    torch.autograd.backward([torch.stack([t.float().sum() for t in tensors]).sum()])  # frees it
    model.zero_grad(set_to_none=True)
    return meter.peak / rows / 2**20, sum(p.numel() for p in params)
