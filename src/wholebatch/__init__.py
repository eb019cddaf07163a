"""wholebatch: the gradient of the whole batch, however the batch is split."""

from __future__ import annotations

from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.groups import (
    all_ranks_agree,
    any_rank,
    checks_enabled,
    get_rank,
    get_world_size,
    set_checks,
)

__version__ = "0.1.0"

__all__ = [
    "WholebatchError",
    "WholebatchTypeError",
    "__version__",
    "all_ranks_agree",
    "any_rank",
    "checks_enabled",
    "get_rank",
    "get_world_size",
    "set_checks",
]
