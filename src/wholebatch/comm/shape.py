"""A device mesh's shape written as text, `"dp=2,tp=2"`: read without torch.

`parse_mesh_shape` is shared by `wholebatch verify --mesh` (which builds the mesh)
and `wholebatch plan --mesh` (which only sizes it, and never loads torch).
"""

from __future__ import annotations

from wholebatch.errors import WholebatchError

__all__ = ["parse_mesh_shape"]


def parse_mesh_shape(text: str) -> dict[str, int]:
    """`"dp=2,tp=2"` -> `{"dp": 2, "tp": 2}`, the order kept; a clear error otherwise."""
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.strip().partition("=")
        name = name.strip()
        if not sep or not name.isidentifier() or not size.strip().isdigit():
            raise WholebatchError(
                f"mesh: {part.strip()!r} in {text!r} is not NAME=SIZE; write the mesh as "
                "dims and sizes, e.g. 'dp=2,tp=2'"
            )
        if name in out:
            raise WholebatchError(f"mesh: dim {name!r} appears twice in {text!r}")
        if int(size) < 1:
            raise WholebatchError(f"mesh: dim {name!r} has size {size}; sizes must be >= 1")
        out[name] = int(size)
    return out
