"""wholebatch: the gradient of the whole batch, however the batch is split."""

from __future__ import annotations

from wholebatch.comm import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    reduce_scatter,
    ring_shift,
)
from wholebatch.debug import debug_enabled, set_debug
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.groups import (
    all_ranks_agree,
    any_rank,
    checks_enabled,
    get_rank,
    get_world_size,
    init_process_group,
    set_checks,
)

__version__ = "0.1.0"

__all__ = [
    "WholebatchError",
    "WholebatchTypeError",
    "__version__",
    "all_gather",
    "all_ranks_agree",
    "all_reduce",
    "all_to_all",
    "any_rank",
    "broadcast",
    "checks_enabled",
    "debug_enabled",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "reduce_scatter",
    "ring_shift",
    "set_checks",
    "set_debug",
]
