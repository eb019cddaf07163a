"""Gradient compression for DDP: PyTorch's own communication hooks, registered and counted.

    acc = Accumulator(ddp_model, opt, grad_compression="fp16")      # or "bf16", "powersgd"
    acc.comm_stats.wire_bytes / acc.comm_stats.uncompressed_bytes   # bytes saved

Nothing here re-implements a hook: "fp16" is `default_hooks.fp16_compress_hook`,
"powersgd" is `powerSGD_hook.powerSGD_hook` with its `PowerSGDState`, "bf16" is
`default_hooks.bf16_compress_hook` on NCCL. PyTorch's bf16 hook refuses every
other backend ("BF16 all reduce communication hook required CUDA 11+ and NCCL
2.10+"), although gloo all-reduces bfloat16 fine; there we register PyTorch's
own helper behind both fp16 and bf16 hooks, `default_hooks._compress_hook`, with
`torch.bfloat16` (cast, divide by W, all-reduce sum, cast back: the same
arithmetic as on NCCL). If a future torch drops that private helper,
construction raises a `WholebatchError` naming the fix instead of guessing.

Scaling: every hook here averages (divides by W), exactly like DDP's default
all-reduce, so they require `grad_reduction="mean"`; the Accumulator's single
rescale after the step then makes the gradient exact up to the wire's rounding.
The hook sees gradients pre-scaled to about the size of a mean loss's gradient
(see `Accumulator`), which keeps fp16 away from overflow.

Each registered hook is wrapped by a counter (`CommStats`): calls (one per DDP
bucket per synchronised backward) and bytes each rank sends into the all-reduce,
compressed and uncompressed. The wrapper only counts; it passes the hook's
arguments and future through untouched.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from wholebatch.errors import WholebatchError

__all__ = ["CommStats", "CompressionKind", "GradCompression", "register_compression"]

CompressionKind = Literal["fp16", "bf16", "powersgd"]
_KINDS: tuple[str, ...] = ("fp16", "bf16", "powersgd")

# The bucket is a torch._C._distributed_c10d.GradBucket (no public type to annotate with).
HookFn = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradCompression:
    """Which DDP communication hook compresses the step's gradient all-reduce."""

    kind: CompressionKind
    """"fp16" or "bf16" (cast to half precision on the wire: half the bytes of float32),
    or "powersgd" (low-rank P/Q factors with error feedback)."""

    powersgd_rank: int = 1
    """PowerSGD's `matrix_approximation_rank`: higher is more exact and sends more."""

    powersgd_start_iter: int = 2
    """PowerSGD's `start_powerSGD_iter`: plain all-reduce before this many synchronised
    steps (2 is the smallest torch allows with error feedback); count steps, not micro-batches."""

    powersgd_min_compression_rate: float = 2.0
    """PowerSGD compresses a matrix only if that saves at least this factor; others are
    all-reduced uncompressed (biases always are)."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise WholebatchError(
                f"GradCompression: kind={self.kind!r}; expected one of {list(_KINDS)}"
            )
        if not (isinstance(self.powersgd_rank, int) and self.powersgd_rank >= 1):
            raise WholebatchError(
                f"GradCompression: powersgd_rank={self.powersgd_rank!r} must be an int >= 1"
            )
        if not (isinstance(self.powersgd_start_iter, int) and self.powersgd_start_iter >= 2):
            raise WholebatchError(
                f"GradCompression: powersgd_start_iter={self.powersgd_start_iter!r} must be an "
                "int >= 2 (torch's PowerSGD needs two plain steps for error feedback)"
            )

    @classmethod
    def parse(cls, spec: str | GradCompression | None) -> GradCompression | None:
        """`spec` as a `GradCompression` ("fp16", "bf16", "powersgd" take the defaults)."""
        if spec is None or isinstance(spec, GradCompression):
            return spec
        if isinstance(spec, str) and spec.lower() in _KINDS:
            return cls(kind=spec.lower())  # type: ignore[arg-type]
        raise WholebatchError(
            f"grad_compression={spec!r}; expected None, one of {list(_KINDS)}, or a "
            "wholebatch.GradCompression"
        )


@dataclasses.dataclass
class CommStats:
    """Counters of the gradient all-reduces a registered hook carried (this rank's view)."""

    calls: int = 0
    """Hook calls: one per DDP bucket per synchronised backward."""

    wire_bytes: int = 0
    """Bytes this rank put into the all-reduces (compressed payload, or the full bucket
    while PowerSGD is still in its plain all-reduce phase)."""

    uncompressed_bytes: int = 0
    """Bytes the same buckets hold uncompressed (what the default all-reduce would send)."""

    @property
    def ratio(self) -> float:
        """uncompressed_bytes / wire_bytes (2.0 for fp16 on float32 gradients); 1.0 before any call."""
        return self.uncompressed_bytes / self.wire_bytes if self.wire_bytes else 1.0


def _bf16_hook(group: ProcessGroup | None) -> HookFn:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return default_hooks.bf16_compress_hook  # type: ignore[no-any-return]
    helper = getattr(default_hooks, "_compress_hook", None)
    if helper is None:  # pragma: no cover - depends on the torch version
        raise WholebatchError(
            f"grad_compression='bf16': PyTorch's bf16 hook needs NCCL and this torch has no "
            f"'_compress_hook' to run it on backend {backend!r}; use grad_compression='fp16'"
        )
    return functools.partial(helper, torch.bfloat16)


def register_compression(
    model: DistributedDataParallel, spec: GradCompression, group: ProcessGroup | None = None
) -> CommStats:
    """Register `spec`'s PyTorch hook on `model` (once per model) and return its live counters.

    Args:
        model: the DDP module; DDP takes one hook per model.
        spec: which hook and its PowerSGD settings.
        group: the process group the hook reduces over (None: DDP's own).

    Returns:
        The `CommStats` the hook updates on every call.
    """
    if not isinstance(model, DistributedDataParallel):
        raise WholebatchError(
            f"grad_compression={spec.kind!r} registers a DDP communication hook, but the model "
            f"is a {type(model).__name__}; wrap it in DistributedDataParallel or pass "
            "grad_compression=None"
        )
    group = model.process_group if group is None else group
    stats = CommStats()
    state: Any
    if spec.kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=spec.powersgd_rank,
            start_powerSGD_iter=spec.powersgd_start_iter,
            min_compression_rate=spec.powersgd_min_compression_rate,
        )
        inner: HookFn = powerSGD_hook.powerSGD_hook
    else:
        state = group
        inner = default_hooks.fp16_compress_hook if spec.kind == "fp16" else _bf16_hook(group)

    def counting_hook(hook_state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        full = buffer.numel() * buffer.element_size()
        before = getattr(hook_state, "total_numel_after_compression", 0)
        fut = inner(hook_state, bucket)
        stats.calls += 1
        stats.uncompressed_bytes += full
        if spec.kind == "powersgd":
            # PowerSGD counts the elements it sends (P, Q, uncompressed tensors) itself;
            # in its plain all-reduce phase the counter does not move: the full bucket goes.
            sent = getattr(hook_state, "total_numel_after_compression", 0) - before
            stats.wire_bytes += sent * buffer.element_size() if sent else full
        else:
            stats.wire_bytes += buffer.numel() * 2  # fp16 and bf16 are 2 bytes an element
        return fut

    # DDP inspects the hook's annotations and accepts only the runtime objects;
    # `from __future__ import annotations` made ours strings, so restore the real ones.
    counting_hook.__annotations__ = {
        "hook_state": Any,
        "bucket": dist.GradBucket,  # type: ignore[attr-defined]
        "return": torch.futures.Future[torch.Tensor],
    }
    model.register_comm_hook(state, counting_hook)
    return stats
