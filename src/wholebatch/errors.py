"""The one exception family wholebatch raises for bad input.

Every public entry point validates in the forward and raises the same
`WholebatchError` on every rank (DESIGN.md, "Bad input"), naming the op, the
argument, the per-rank values and the fix.
"""

from __future__ import annotations

__all__ = ["WholebatchError", "WholebatchTypeError"]


class WholebatchError(ValueError):
    """Bad input to a wholebatch op: a value, shape or size that cannot work."""


class WholebatchTypeError(WholebatchError, TypeError):
    """Bad input of the wrong kind: a dtype, device or Python type that cannot work."""
