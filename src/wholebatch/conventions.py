"""The vocabulary every layer shares: how a data-parallel wrapper reduces rank gradients.

One definition, one validation, one wording (DESIGN.md, gradient convention 2,
"Data parallelism averages"). Torch-free, like `errors`, so any layer may import it.
"""

from __future__ import annotations

from typing import Literal

from wholebatch.errors import WholebatchError

__all__ = ["GRAD_REDUCTIONS", "GradReduction", "check_grad_reduction", "grad_reduction_error"]

GradReduction = Literal["mean", "sum"]
"""How the data-parallel wrapper combines rank gradients: "mean" (DDP, FSDP2 defaults) or "sum"."""

GRAD_REDUCTIONS: tuple[GradReduction, ...] = ("mean", "sum")


def grad_reduction_error(value: object) -> str | None:
    """The error text (without the op's name) for a bad `grad_reduction`, or None when it is valid."""
    if isinstance(value, str) and value in GRAD_REDUCTIONS:
        return None
    return (
        f"grad_reduction={value!r} must be 'mean' (the wrapper averages rank gradients: "
        "DDP, FSDP2) or 'sum' (a reduction that sums them)"
    )


def check_grad_reduction(op: str, value: object) -> GradReduction:
    """`value` if it is a valid `grad_reduction`, else the `WholebatchError` naming `op`."""
    err = grad_reduction_error(value)
    if err is not None:
        raise WholebatchError(f"{op}: {err}")
    return value  # type: ignore[return-value]
