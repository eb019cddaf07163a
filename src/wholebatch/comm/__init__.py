"""Communication: process groups and the differentiable collectives.

The lowest layer of wholebatch (DESIGN.md, "Layers"): it knows no loss, no
engine and no CLI. `collectives` holds the autograd collectives, `groups` the
process-group helpers ("not initialised" is a world of one), `checks` the
cross-rank fingerprint exchange, `direct` the raw all-gather by direct sends on gloo, `debug` the store check-in, `mesh` the batch split over a device mesh (`shape` its text form, torch-free), `launch` local
launch through torchrun's launcher API, and `_c10d` the shim over c10d names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wholebatch._lazy import lazy_package

if TYPE_CHECKING:  # the public names, written once: mypy and IDEs read these imports,
    # and `lazy_package` builds `_LAZY`, `__all__` and the PEP 562 hooks from them
    from wholebatch.comm.agree import (
        Field as Field,
        PendingRows as PendingRows,
        Rows as Rows,
        agree_rows as agree_rows,
        start_rows as start_rows,
    )
    from wholebatch.comm.collectives import (
        all_gather as all_gather,
        all_reduce as all_reduce,
        all_to_all as all_to_all,
        broadcast as broadcast,
        reduce_scatter as reduce_scatter,
        ring_shift as ring_shift,
    )
    from wholebatch.comm.debug import (
        debug_enabled as debug_enabled,
        set_debug as set_debug,
    )
    from wholebatch.comm.groups import (
        all_ranks_agree as all_ranks_agree,
        any_rank as any_rank,
        checks_enabled as checks_enabled,
        comm_device as comm_device,
        get_rank as get_rank,
        get_world_size as get_world_size,
        init_process_group as init_process_group,
        is_distributed as is_distributed,
        set_checks as set_checks,
    )
    from wholebatch.comm.mesh import MeshSplit as MeshSplit

_LAZY, __all__, __getattr__, __dir__ = lazy_package(globals())
