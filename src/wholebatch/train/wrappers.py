"""What wraps the model: data-parallel wrapper detection, gradient-sync control and DTensor views.

The engines (`Accumulator`, `GradCache`, `CachedStep`, `StepFinisher`) ask the
same questions of the module they are given, answered here once:

    inner = compiled_inner(model)          # look through torch.compile (its _orig_mod)
    grad_sync_mode(inner)                  # "ddp", "fsdp2" or "none"
    is_data_parallel(model)                # DDP, FSDP2, FSDP1 anywhere in it
    unwrapped_error(model, W, "step")      # the error for a plain module on W > 1 ranks
    with sync_context(model, i, K): ...    # reduce gradients on micro-batch K-1 only

and, for gradients that are DTensors (FSDP2), `is_dtensor`, `is_sharded` and
`local_tensor` (the shard this rank holds).

Legend: W world size, K micro-batches per step.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, Literal

from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


def loaded_class(module: str, name: str) -> type | None:
    """`module.name` if `module` was imported already (by anyone), else None, importing nothing.

    An object of a class exists only once the class's module was imported, so an
    `isinstance` test against a class whose module nobody imported is False: FSDP and
    DTensor cost ~1.2 s to import (`torch.distributed.tensor` pulls in sympy), which
    `import wholebatch.train` and every verify process paid without a mesh in sight.
    """
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return cls if isinstance(cls, type) else None


def fsdp2_class() -> type | None:
    """FSDP2's `FSDPModule` (torch >= 2.6 exports it from `torch.distributed.fsdp`), if loaded."""
    return loaded_class("torch.distributed.fsdp", "FSDPModule")


def dtensor_class() -> type | None:
    """`DTensor`, if `torch.distributed.tensor` is loaded."""
    return loaded_class("torch.distributed.tensor", "DTensor")


__all__ = [
    "SyncMode",
    "compiled_inner",
    "ddp_of",
    "fsdp_modules",
    "fsdp_sync",
    "fsdp_sync_state",
    "grad_sync_mode",
    "is_data_parallel",
    "is_dtensor",
    "is_sharded",
    "local_tensor",
    "set_fsdp_sync",
    "sync_context",
    "unwrapped_error",
]

SyncMode = Literal["ddp", "fsdp2", "none"]


def compiled_inner(model: nn.Module) -> nn.Module:
    """The module `torch.compile` wrapped (its `_orig_mod`), else `model`: where DDP's `no_sync` lives."""
    inner: nn.Module = getattr(model, "_orig_mod", model)
    return inner


def ddp_of(model: nn.Module) -> DistributedDataParallel | None:
    """`model` (or the module `torch.compile` wrapped) if it is DDP, else None."""
    inner = compiled_inner(model)
    return inner if isinstance(inner, DistributedDataParallel) else None


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """Every FSDP2 (`fully_shard`) module in `model`, itself included, in `modules()` order."""
    fsdp2 = fsdp2_class()
    if fsdp2 is None:
        return []
    return [m for m in model.modules() if isinstance(m, fsdp2)]


def grad_sync_mode(model: nn.Module) -> SyncMode:
    """How `model` synchronises gradients: "ddp", "fsdp2" (it or a submodule is `fully_shard`ed) or "none"."""
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if fsdp_modules(model):
        return "fsdp2"
    return "none"


def is_data_parallel(model: nn.Module) -> bool:
    """Whether `model` reduces gradients over ranks: DDP, FSDP2/FSDP1 anywhere in it, or compiled DDP."""
    inner = compiled_inner(model)
    if grad_sync_mode(inner) != "none":
        return True
    fsdp1 = loaded_class("torch.distributed.fsdp", "FullyShardedDataParallel")
    return fsdp1 is not None and any(isinstance(m, fsdp1) for m in inner.modules())


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


def set_fsdp_sync(modules: list[nn.Module], sync: bool | list[bool]) -> None:
    """Set each FSDP2 module's `requires_gradient_sync` (one flag for all, or one per module)."""
    flags = sync if isinstance(sync, list) else [sync] * len(modules)
    for m, flag in zip(modules, flags, strict=True):
        m.set_requires_gradient_sync(flag, recurse=False)  # type: ignore[operator]


def fsdp_sync_state(modules: list[nn.Module]) -> list[bool]:
    """Each FSDP2 module's requires_gradient_sync (True where torch does not expose it)."""
    out = []
    for m in modules:
        groups = getattr(m._get_fsdp_state(), "_fsdp_param_groups", [])  # type: ignore[operator]
        out.append(all(getattr(g, "reduce_grads", True) for g in groups))
    return out


@contextlib.contextmanager
def fsdp_sync(modules: list[nn.Module], sync: bool) -> Iterator[None]:
    """Run with the FSDP2 `modules` syncing gradients or not; restored to syncing on exit."""
    set_fsdp_sync(modules, sync)
    try:
        yield
    finally:
        # Leave the model as we found it (syncing), also when the loss_fn raised.
        set_fsdp_sync(modules, True)


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
        return fsdp_sync(fsdp_modules(inner), last)
    return contextlib.nullcontext()


def is_dtensor(x: Tensor) -> bool:
    """Whether `x` is a DTensor (an FSDP2 parameter or its gradient)."""
    dtensor = dtensor_class()
    return dtensor is not None and isinstance(x, dtensor)


def is_sharded(x: Tensor) -> bool:
    """Whether `x` is a DTensor sharded on some mesh dimension (its squares sum over ranks)."""
    return is_dtensor(x) and any(p.is_shard() for p in x.placements)  # type: ignore[attr-defined]


def local_tensor(x: Tensor) -> Tensor:
    """The tensor this rank holds: a DTensor's local shard, or `x` itself."""
    return x.to_local() if is_dtensor(x) else x  # type: ignore[attr-defined, no-any-return]
