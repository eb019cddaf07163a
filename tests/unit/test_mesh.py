"""The mesh split's single-process parts: parsing a mesh shape (unit tier)."""

from __future__ import annotations

import pytest

from wholebatch.comm.mesh import parse_mesh_shape
from wholebatch.errors import WholebatchError


def test_parse_mesh_shape_keeps_the_order() -> None:
    assert parse_mesh_shape("dp=2,tp=2") == {"dp": 2, "tp": 2}
    assert list(parse_mesh_shape(" pp=2 , dp=3 ,cp=1")) == ["pp", "dp", "cp"]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("dp2", "'dp2' in 'dp2' is not NAME=SIZE"),
        ("dp=two", "is not NAME=SIZE"),
        ("dp=2,dp=2", "dim 'dp' appears twice"),
        ("dp=0", "dim 'dp' has size 0"),
        ("=2", "is not NAME=SIZE"),
    ],
)
def test_parse_mesh_shape_errors_name_the_part(text: str, needle: str) -> None:
    with pytest.raises(WholebatchError, match="mesh: ") as info:
        parse_mesh_shape(text)
    assert needle in str(info.value)
