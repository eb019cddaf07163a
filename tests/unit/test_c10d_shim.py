"""The shim over version-dependent torch APIs (wholebatch.comm._c10d): each entry's branches.

The branch the installed torch takes is checked against torch itself; the others
are forced (an object without the API, a version string) so that every branch
runs on any torch. The mesh and DTensor entries need real ranks:
tests/distributed/test_c10d_shim.py. `make test-compat` runs both on the oldest
accepted torch, a middle release and the newest tested.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from wholebatch.comm import _c10d
from wholebatch.errors import WholebatchError


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("2.6.0+cu124", (2, 6)),
        ("2.13.0", (2, 13)),
        ("2.11.0a0+git1234", (2, 11)),
        ("3.0.0.dev20270101", (3, 0)),
        ("local", (99, 0)),
    ],
)
def test_torch_version_parses_release_and_build_tags(text: str, want: tuple[int, int]) -> None:
    assert _c10d.torch_version(text) == want


def test_installed_torch_is_in_the_declared_range() -> None:
    assert _c10d.torch_version() >= _c10d.MIN_TORCH
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    low = ".".join(str(v) for v in _c10d.MIN_TORCH)
    assert f'"torch>={low}' in pyproject.read_text(), "pyproject's torch range and MIN_TORCH differ"


def test_an_older_torch_is_refused_at_import_naming_both_versions() -> None:
    """The guard's branch on an old torch: a child process whose torch reports 2.7.1."""
    code = (
        "import torch; torch.__version__ = '2.7.1+cu126'\n"
        "try:\n"
        "    import wholebatch.comm._c10d\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "wholebatch needs torch >= 2.8, found torch 2.7.1+cu126" in out
    assert "pip install 'torch>=2.8'" in out


def test_collective_names_resolve_to_what_this_torch_has() -> None:
    new = getattr(dist, "all_gather_single", None)
    assert _c10d.all_gather_single is (new or dist.all_gather_into_tensor)
    new = getattr(dist, "reduce_scatter_single", None)
    assert _c10d.reduce_scatter_single is (new or dist.reduce_scatter_tensor)


def test_collective_names_fall_back_to_the_old_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.8-2.12's branch, forced on a newer torch: without the new names, the old ones."""
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.delattr(dist, name, raising=False)
    try:
        shim = importlib.reload(_c10d)
        assert shim.all_gather_single is dist.all_gather_into_tensor
        assert shim.reduce_scatter_single is dist.reduce_scatter_tensor
    finally:
        monkeypatch.undo()
        importlib.reload(_c10d)


def test_store_classes_are_torch_distributed_s() -> None:
    assert _c10d.Store is dist.Store
    assert _c10d.TCPStore is dist.TCPStore
    assert _c10d.PrefixStore is dist.PrefixStore


class _OldMesh:
    """A mesh slice of a torch without `DeviceMesh._flatten`."""

    mesh_dim_names = ("dp", "cp")


def test_flatten_mesh_refuses_a_torch_without_flatten_by_name() -> None:
    with pytest.raises(
        WholebatchError, match=r"flatten_mesh: torch .* has no DeviceMesh\._flatten"
    ):
        _c10d.flatten_mesh(_OldMesh(), "dp_cp")  # type: ignore[arg-type]  # a stand-in mesh


def test_this_torch_has_flatten() -> None:
    """Every accepted torch has it (2.5+); a torch that drops it takes the public fallback."""
    from torch.distributed.device_mesh import DeviceMesh

    assert callable(getattr(DeviceMesh, "_flatten", None))


def test_shard_offset_names_a_missing_private_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_c10d, "_private_offset", lambda: None)
    with pytest.raises(WholebatchError, match="compute_local_shape_and_global_offset"):
        _c10d.shard_offset(torch.zeros(1), use_private=True)


def test_partition_enumerates_the_other_dims_first() -> None:
    """The fallback's rank lists, one per coordinate of the dims not flattened."""

    class _Mesh:
        mesh_dim_names = ("a", "b", "c")
        mesh = torch.arange(8).reshape(2, 2, 2)

    assert _c10d._partition(_Mesh(), ("b", "c")) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # type: ignore[arg-type]
    assert _c10d._partition(_Mesh(), ("a", "c")) == [[0, 1, 4, 5], [2, 3, 6, 7]]  # type: ignore[arg-type]
    assert _c10d._partition(_Mesh(), ("a", "b")) == [[0, 2, 4, 6], [1, 3, 5, 7]]  # type: ignore[arg-type]


class _Shard:
    def __init__(self, dim: int) -> None:
        self.dim = dim

    def is_shard(self) -> bool:
        return True


class _StridedShard(_Shard):
    """Named as torch's private FSDP2 x TP placement, which is what the shim looks for."""

    split_factor = 2  # FSDP2 over tp 2: the tp shards cut dim 0 first


class _Mesh2x2:
    mesh = torch.arange(4).reshape(2, 2)

    def size(self, mesh_dim: int) -> int:
        return 2

    def get_coordinate(self) -> list[int]:
        return [0, 1]


class _FsdpTpParam:
    """A stand-in DTensor: FSDP2 (strided) over TP on dim 0 of `rows` rows, on a 2 x 2 mesh."""

    def __init__(self, rows: int) -> None:
        self.shape = (rows, 3)
        self.placements = (_StridedShard(0), _Shard(0))
        self.device_mesh = _Mesh2x2()

    def dim(self) -> int:
        return 2

    def full_tensor(self) -> torch.Tensor:
        return torch.ones(self.shape)


@pytest.mark.parametrize(
    ("version", "rows", "refused"), [((2, 8), 6, True), ((2, 8), 8, False), ((2, 10), 6, False)]
)
def test_full_tensor_refuses_what_older_torch_reads_back_wrong(
    monkeypatch: pytest.MonkeyPatch, version: tuple[int, int], rows: int, refused: bool
) -> None:
    monkeypatch.setattr(_c10d, "torch_version", lambda text=None: version)
    dt = _FsdpTpParam(rows)
    if refused:
        with pytest.raises(WholebatchError, match=r"verify: torch .* FSDP2 x tensor-parallel"):
            _c10d.full_tensor(dt, op="verify")
    else:
        assert _c10d.full_tensor(dt).shape == (rows, 3)


@pytest.mark.parametrize(("split_factor", "offset"), [(2, (3, 0)), (3, None)])
def test_shard_offset_public_branch_reads_only_fsdp2s_strided_shard(
    split_factor: int, offset: tuple[int, ...] | None
) -> None:
    # rank (dp 0, tp 1) of 6 rows: tp's second half (rows 3-5), then dp's first piece of it
    dt = _FsdpTpParam(6)
    dt.placements[0].split_factor = split_factor
    if offset is not None:
        assert _c10d.shard_offset(dt, use_private=False) == offset
    else:  # not the split FSDP2 over tp makes: refused, never a guessed offset
        with pytest.raises(WholebatchError, match="not FSDP2 over tensor parallel"):
            _c10d.shard_offset(dt, use_private=False)


def _probe(x: torch.Tensor) -> torch.Tensor:
    # 1 where traced by TorchDynamo, 0 where run eagerly
    return x + float(torch.compiler.is_compiling())


def test_eager_runs_its_function_outside_the_compiled_graph() -> None:
    # Mutation: the plain function is traced (is_compiling() is True inside the graph).
    # The collectives and every loss Function go through `eager` (test_comm.py's
    # test_inside_torch_compile gave zero gradients on torch 2.11 before it).
    wrapped = _c10d.eager(_probe)
    assert wrapped.__name__ == "_probe"
    for fn, want in ((wrapped, 0.0), (_probe, 1.0)):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, fn=fn: fn(x) * 2, backend="eager")
        assert float(compiled(torch.zeros(()))) == 2 * want
    assert float(wrapped(torch.zeros(()))) == 0.0  # outside compile: the function itself


def test_eager_does_not_import_dynamo_outside_compile() -> None:
    code = (
        "import sys, torch; from wholebatch.comm._c10d import eager; "
        "f = eager(lambda x: x + 1); f(torch.zeros(1)); "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False"
