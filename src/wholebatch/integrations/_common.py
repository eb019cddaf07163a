"""What the integration modules share: agreeing a peer's rank arguments, importing a peer.

Uses only wholebatch's public layers (`wholebatch.comm`, `wholebatch.errors`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from torch import Tensor
from torch.distributed import ProcessGroup

from wholebatch.comm import agree_rows, get_rank, get_world_size, is_distributed
from wholebatch.errors import WholebatchError, WholebatchTypeError

__all__ = ["check_rank_args", "require_peer", "scalar_numel_one"]


def require_peer(module: str, package: str, what: str) -> ModuleType:
    """Import `module` of a peer library, or raise an ImportError naming the package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs the `{package}` package (import of {module!r} failed: {exc}); "
            f"install it with `pip install {package}`"
        ) from exc


def check_rank_args(op: str, rank: int, world_size: int, group: ProcessGroup | None) -> None:
    """Check a peer's `rank`/`world_size` constructor arguments against the process group.

    Peers take them as plain numbers; wholebatch reads them from `group`. The
    peer's defaults (rank 0 of 1) mean "not given" and always pass; anything else
    must equal the group's rank and size, on every rank. One small all-gather of
    every rank's pair, so that a wrong value on one rank raises the same error
    on every rank (every rank must call it).
    """
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise WholebatchTypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    w = get_world_size(group)
    if not is_distributed(group):
        if (rank, world_size) not in ((0, 1), (get_rank(group), w)):
            raise WholebatchError(
                f"{op}: rank={rank}, world_size={world_size}, but this process runs alone "
                "(torch.distributed is not initialised, or the group has one rank); launch "
                f"with torchrun --nproc-per-node {world_size}, or leave rank and world_size out"
            )
        return
    rows = agree_rows({"rank": rank, "world_size": world_size}, group=group)
    bad = {
        r: (a, b)
        for r, (a, b) in enumerate(zip(rows.ints("rank"), rows.ints("world_size"), strict=True))
        if (a, b) not in ((0, 1), (r, w))
    }
    if bad:
        shown = ", ".join(f"rank {r}: rank={a}, world_size={b}" for r, (a, b) in bad.items())
        raise WholebatchError(
            f"{op}: rank/world_size disagree with the process group of {w} ranks ({shown}); "
            "wholebatch reads them from the group: pass the group's values or leave them out"
        )


def scalar_numel_one(op: str, name: str, value: object) -> Tensor | float:
    """`value` if it is a number or a one-element float tensor; a clear error otherwise."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise WholebatchTypeError(
                f"{op}: {name} must be a float scalar (a one-element tensor or a number), got "
                f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            )
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WholebatchTypeError(
            f"{op}: {name} must be a float scalar tensor or a number, got {type(value).__name__}"
        )
    return float(value)
