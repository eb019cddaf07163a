"""Communication: process groups and the differentiable collectives.

The lowest layer of wholebatch (DESIGN.md, "Layers"): it knows no loss, no
engine and no CLI. `collectives` holds the autograd collectives, `groups` the
process-group helpers ("not initialised" is a world of one), `checks` the
cross-rank fingerprint exchange, `debug` the store check-in, `launch` local
launch through torchrun's launcher API, and `_c10d` the shim over c10d names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wholebatch._lazy import lazy_attributes

# Loaded on first use (PEP 562), like the top level: `comm.sizes` is pure Python
# and the planner reads it without loading torch.
_LAZY: dict[str, str] = {
    "all_gather": "wholebatch.comm.collectives",
    "all_reduce": "wholebatch.comm.collectives",
    "all_to_all": "wholebatch.comm.collectives",
    "broadcast": "wholebatch.comm.collectives",
    "reduce_scatter": "wholebatch.comm.collectives",
    "ring_shift": "wholebatch.comm.collectives",
    "debug_enabled": "wholebatch.comm.debug",
    "set_debug": "wholebatch.comm.debug",
    "all_ranks_agree": "wholebatch.comm.groups",
    "any_rank": "wholebatch.comm.groups",
    "checks_enabled": "wholebatch.comm.groups",
    "comm_device": "wholebatch.comm.groups",
    "get_rank": "wholebatch.comm.groups",
    "get_world_size": "wholebatch.comm.groups",
    "init_process_group": "wholebatch.comm.groups",
    "is_distributed": "wholebatch.comm.groups",
    "set_checks": "wholebatch.comm.groups",
}

if TYPE_CHECKING:
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


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
