"""The precision a step really computes in: the dtypes of its matmuls and reductions, and its autocast.

A gradient is as precise as the least precise arithmetic on its path, and the
dtypes a step's outputs carry do not show it: a float64 model whose head is a
custom `autograd.Function` computing `h.float() @ w.float().T` runs that matmul
in bfloat16 under CPU autocast (a float32 matmul is autocast-eligible), returns
a tensor nobody reads the dtype of, and its backward runs in float32; trl's
fused log-prob head does exactly this. So `PrecisionMeter` is a
`TorchDispatchMode`: it sees every aten op the forward AND the backward run,
below autocast (the dtypes after its casts), inside custom Functions too, and
records the dtypes of the inputs of the ops that round a sum: matmuls
(mm, addmm, bmm, convolutions, attention kernels) and reductions (sums, means,
softmax, norms, losses). The floor and the default rtol follow the least
precise of them (`auto_rtol`).

Only arithmetic that can reach a gradient counts: an op in backward, inside a
custom autograd Function, or in grad mode on an input that requires gradient
(a float32 count of tokens, `mask.float().sum()`, does not; a no-grad
generation pass does not).

Autocast itself is invisible below its dispatch key, so `torch.autocast`'s
`__enter__` is wrapped (once, in this process) to name the autocasts a metered
step enters ("cpu:bfloat16"): verify recomputes the reference under them to
measure their round-off.

Legend: W ranks, K micro-batches per rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from wholebatch.verify import recording

__all__ = ["PrecisionMeter", "auto_rtol", "dtype_names", "eps_of", "watch_autocast"]

_aten = torch.ops.aten
# The ops whose result rounds a sum of products or of terms: their input dtype is the
# precision of the arithmetic. Elementwise ops round one value each and views, copies
# and casts none; a model whose elementwise ops run in a low precision runs its matmuls
# in it too.
_ROUNDING = frozenset(
    getattr(_aten, name)
    for name in (
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "addr",
        "convolution", "convolution_backward", "_convolution",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_attention_math",
        "sum", "mean", "prod", "cumsum", "cumprod", "logsumexp", "norm", "linalg_vector_norm",
        "var", "var_mean", "std", "std_mean", "_softmax", "_log_softmax",
        "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm",
        "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
        "native_batch_norm", "native_batch_norm_backward", "_fused_rms_norm",
        "_fused_rms_norm_backward", "nll_loss_forward", "nll_loss_backward",
        "nll_loss2d_forward", "nll_loss2d_backward", "embedding_dense_backward",
        "index_add", "scatter_add", "index_put", "_index_put_impl_", "mse_loss",
        "mse_loss_backward", "binary_cross_entropy_with_logits", "cross_entropy_loss",
    )
    if hasattr(_aten, name)
)  # fmt: skip

# The meters active in this thread (innermost last): what the autocast hook reports to.
_ACTIVE: list[PrecisionMeter] = []


def _floats(values: Iterable[Any]) -> Iterable[Tensor]:
    for v in values:
        if isinstance(v, Tensor):
            if v.is_floating_point():
                yield v
        elif isinstance(v, list | tuple):
            yield from _floats(v)


class PrecisionMeter:
    """While active, the dtypes the step's matmuls and reductions ran in (forward and backward)
    and the autocasts it entered.

    `dtypes`: the floating dtypes of the inputs of every counted op (module docstring);
    `ops`: per dtype, a few of the ops that ran in it, for the report; `autocast`:
    "device:dtype" for every `torch.autocast` entered with autocast enabled.
    """

    def __init__(self, active: bool = True) -> None:
        self.active = active
        """False: record nothing (a re-run whose precision is not read costs no dispatch mode)."""
        self.dtypes: set[torch.dtype] = set()
        self.ops: dict[torch.dtype, set[str]] = {}
        self.autocast: set[str] = set()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> PrecisionMeter:
        if not self.active:
            return self
        watch_autocast()
        _ACTIVE.append(self)
        self._stack.enter_context(_Dispatch(self))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            self._stack.close()
            _ACTIVE.remove(self)

    def saw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Record one aten op's input dtypes if it rounds a sum and can reach a gradient."""
        if func.overloadpacket not in _ROUNDING:
            return
        inputs = list(_floats((*args, *kwargs.values())))
        if not inputs or not (
            recording.in_backward()
            or recording.in_function()
            or (torch.is_grad_enabled() and any(t.requires_grad for t in inputs))
        ):
            return
        for dtype in {t.dtype for t in inputs}:
            self.dtypes.add(dtype)
            names = self.ops.setdefault(dtype, set())
            if len(names) < 4:
                names.add(func.overloadpacket.__name__)


# torch's TorchDispatchMode is untyped (torch.utils._python_dispatch has no annotations):
# subclassing it and calling its __init__ are the two untyped calls mypy cannot check.
class _Dispatch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The dispatch mode behind a `PrecisionMeter`: every aten op runs, then is reported to it."""

    def __init__(self, meter: PrecisionMeter) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.meter = meter

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self.meter.saw(func, args, kwargs or {})
        return out


# The wrapper `watch_autocast` installed (so a second call installs none).
_WRAPPER: list[Callable[..., Any]] = []


def _entered(enter: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(enter)
    def __enter__(self: Any) -> Any:
        out = enter(self)
        if _ACTIVE and getattr(self, "_enabled", False):
            dtype = str(getattr(self, "fast_dtype", "")).removeprefix("torch.")
            _ACTIVE[-1].autocast.add(f"{self.device}:{dtype}")
        return out

    return __enter__


def watch_autocast() -> None:
    """Wrap `torch.autocast.__enter__` to name the autocasts an active meter's step enters (idempotent).

    The wrapper stays for the life of the process (verify's own processes); it only
    reads the autocast's device and dtype, and reports only while a meter is active.
    """
    cls = torch.amp.autocast_mode.autocast
    if _WRAPPER and cls.__enter__ is _WRAPPER[0]:
        return
    wrapper = _entered(cls.__enter__)
    recording.patch(cls, "__enter__", wrapper)
    _WRAPPER[:] = [wrapper]


def dtype_names(dtypes: Iterable[torch.dtype]) -> tuple[str, ...]:
    """("bfloat16", "float64"): sorted names without the "torch." prefix."""
    return tuple(sorted(str(d).removeprefix("torch.") for d in dtypes))


def eps_of(dtypes: Sequence[str]) -> float:
    """Machine epsilon of the least precise floating dtype named (float64's if none)."""
    eps = [torch.finfo(getattr(torch, d)).eps for d in dtypes if hasattr(torch, d)]
    return max(eps, default=torch.finfo(torch.float64).eps)


def auto_rtol(dtypes: Sequence[str]) -> tuple[float, str]:
    """The default tolerance from the dtypes the step computes in, and why."""
    eps = eps_of(dtypes)
    if eps <= torch.finfo(torch.float64).eps:
        return 1e-10, "from the dtypes: all float64"
    if eps <= torch.finfo(torch.float32).eps:
        return 1e-5, "from the dtypes: float32 is the least precise"
    return 1e-2, "from the dtypes: a half-precision dtype"
