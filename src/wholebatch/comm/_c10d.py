"""The c10d calls wholebatch makes, under the names the installed torch prefers.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to
`all_gather_single` / `reduce_scatter_single` and warns on the old names;
torch 2.4 has only the old ones. Resolving once here keeps users free of our
deprecation warnings on every version.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["all_gather_single", "global_rank", "reduce_scatter_single"]

all_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single: Any = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (c10d's `src`/`dst`/peer arguments are global)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)
