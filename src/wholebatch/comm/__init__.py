"""Communication: process groups and the differentiable collectives.

The lowest layer of wholebatch (DESIGN.md, "Layers"): it knows no loss, no
engine and no CLI. `collectives` holds the autograd collectives, `groups` the
process-group helpers ("not initialised" is a world of one), `checks` the
cross-rank fingerprint exchange, `debug` the store check-in, `launch` local
launch through torchrun's launcher API, and `_c10d` the shim over c10d names.
"""

from __future__ import annotations

from wholebatch.comm.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    reduce_scatter,
    ring_shift,
)
from wholebatch.comm.debug import debug_enabled, set_debug
from wholebatch.comm.groups import (
    all_ranks_agree,
    any_rank,
    checks_enabled,
    comm_device,
    get_rank,
    get_world_size,
    init_process_group,
    is_distributed,
    set_checks,
)

__all__ = [
    "all_gather",
    "all_ranks_agree",
    "all_reduce",
    "all_to_all",
    "any_rank",
    "broadcast",
    "checks_enabled",
    "comm_device",
    "debug_enabled",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_distributed",
    "reduce_scatter",
    "ring_shift",
    "set_checks",
    "set_debug",
]
