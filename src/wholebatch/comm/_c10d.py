"""The torch APIs wholebatch uses that were renamed, moved or exist only privately, resolved once.

wholebatch supports torch >= 2.8 (pyproject.toml; docs/compatibility.md says why
2.8 and what each older release lacks). Every torch call that depends on the
version, or that has no public name, goes through this module, one entry each,
with a fallback per version; tests/unit/test_c10d_shim.py and
tests/distributed/test_c10d_shim.py run every branch on the installed torch
(the fallbacks forced), and `make test-compat` runs them on the oldest accepted
torch, a middle release and the newest tested:

| entry | torch 2.8 - 2.12 | torch 2.13 + | fallback |
|---|---|---|---|
| `all_gather_single` | `all_gather_into_tensor` | `all_gather_single` (the old name warns) | - |
| `reduce_scatter_single` | `reduce_scatter_tensor` | `reduce_scatter_single` | - |
| `Store`, `PrefixStore`, `TCPStore` | `torch.distributed.*` (typed from `torch._C` only for mypy) | same | - |
| `flat_group` | `DeviceMesh._flatten` (private in every release) | same | one `new_subgroups_by_enumeration` group per mesh (public) |
| `flatten_mesh` | `DeviceMesh._flatten` | same | none: a `WholebatchError` naming the torch it needs |
| `shard_offset` | `torch.distributed.tensor._utils.compute_local_shape_and_global_offset` (private) | same | the offset computed from the DTensor's placements (FSDP2's strided shard included) |
| `eager` | TorchDynamo traces a collective (its checks and its autograd Function) into the graph; on 2.11 the traced backward lost the gradient (`test_inside_torch_compile`: zeros) | the same | - |
| `full_tensor` | `DTensor.full_tensor()`, refused for FSDP2 x TP uneven shards below 2.10 | `DTensor.full_tensor()` | - |

Importing this module on a torch below `MIN_TORCH` raises `ImportError` naming
the version found and the one needed: the comm layer (which every torch-using
layer imports) starts here, so nothing runs half-supported.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor

from wholebatch.errors import WholebatchError

if TYPE_CHECKING:
    # torch.distributed re-exports c10d's store classes (documented as
    # torch.distributed.TCPStore ...) without declaring them, so mypy's
    # no-implicit-reexport rejects the public name; type them from where they live.
    from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
    from torch.distributed.device_mesh import DeviceMesh
else:
    from torch.distributed import PrefixStore, Store, TCPStore

__all__ = [
    "MIN_TORCH",
    "PrefixStore",
    "Store",
    "TCPStore",
    "all_gather_single",
    "eager",
    "flat_group",
    "flatten_mesh",
    "full_tensor",
    "global_rank",
    "reduce_scatter_single",
    "shard_offset",
    "torch_version",
]

MIN_TORCH = (2, 8)
"""The oldest torch every promise was measured on (benchmarks/RESULTS.md, "Compatibility")."""


def torch_version(text: str | None = None) -> tuple[int, int]:
    """(major, minor) of `text` (default: the installed torch): "2.6.0+cu124" -> (2, 6)."""
    raw = torch.__version__ if text is None else text
    found = re.match(r"(\d+)\.(\d+)", str(raw))
    if found is None:  # a source build with an odd tag: trust it to be new
        return (99, 0)
    return int(found.group(1)), int(found.group(2))


if torch_version() < MIN_TORCH:
    raise ImportError(
        f"wholebatch needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found torch "
        f"{torch.__version__}: older releases lack a public FSDP2 (2.5 and before), or their "
        "FSDP2 cannot run on the CPU (2.6, 2.7), where every promise is tested "
        f"(docs/compatibility.md). pip install 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}'"
    )

# torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to
# `all_gather_single` / `reduce_scatter_single` and warns on the old names; older
# torch has only the old ones. Resolved once: users see none of our deprecation warnings.
all_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single: Any = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


_F = TypeVar("_F", bound=Callable[..., Any])


def eager(fn: _F) -> _F:
    """`fn`, run eagerly when called inside `torch.compile`: TorchDynamo breaks the graph
    around it, and the autograd Functions it applies run their forward and backward in
    eager mode (c10d calls, host syncs, cross-rank checks), as outside compile.

    Outside compile it is `fn` plus one `is_compiling()` test: torch._dynamo is imported
    only by a compile, which has imported it already (importing it costs ~2 s).
    """
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disable: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compiler.disable
            disabled.append(disable(fn))
        return disabled[0](*args, **kwargs)

    return cast(_F, inner)


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (c10d's `src`/`dst`/peer arguments are global)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


# -- flattening mesh dims --------------------------------------------------------------


def _has_flatten(mesh: DeviceMesh) -> bool:
    return callable(getattr(mesh, "_flatten", None))


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """`mesh` (a slice of several named dims) as one dim `name`, registered on its root mesh.

    What FSDP2 or DTensor needs when one wrapper spans several batch dims
    (`fully_shard(model, mesh=root[name])`). torch has no public name for it:
    `DeviceMesh._flatten` (torch >= 2.5). Every rank must call it (it creates
    process groups).

    Raises:
        WholebatchError: the installed torch has no `DeviceMesh._flatten`.
    """
    if not _has_flatten(mesh):
        raise WholebatchError(
            f"flatten_mesh: torch {torch.__version__} has no DeviceMesh._flatten (torch 2.5 "
            f"to 2.13 have it) to make mesh dims {mesh.mesh_dim_names} one dim {name!r}; "
            "shard over one dim, or use a torch that has it"
        )
    flat: DeviceMesh = mesh._flatten(name)
    return flat


# The fallback's groups die with their mesh (a group per mesh slice and dims, made once:
# every rank creates every group, as c10d requires, so make it once per mesh).
_FLAT_GROUPS: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)


def _partition(mesh: DeviceMesh, dims: Sequence[str]) -> list[list[int]]:
    """The rank lists of the flattened `dims`: one list per coordinate of the other dims."""
    names = list(mesh.mesh_dim_names or ())
    keep = [names.index(d) for d in dims]
    rest = [i for i in range(len(names)) if i not in keep]
    grid = mesh.mesh.permute(*rest, *keep)  # the other dims first, `dims` last, in order
    n = 1
    for i in keep:
        n *= mesh.mesh.shape[i]
    return [[int(r) for r in row] for row in grid.reshape(-1, n).tolist()]


def flat_group(
    mesh: DeviceMesh, dims: Sequence[str], *, use_flatten: bool | None = None
) -> dist.ProcessGroup:
    """The process group of this rank over the mesh dims `dims` taken together (row-major).

    `mesh` is the root mesh. `DeviceMesh._flatten` where torch has it (its group is
    shared with FSDP2 / DTensor on `mesh[dims]`); else, public c10d only, one
    `new_subgroups_by_enumeration` over every coordinate of the other dims, made once
    per (mesh, dims) and kept as long as the mesh lives. Every rank must call it the
    first time. `use_flatten` forces a branch (the tests run both); None: `_flatten`
    when present.
    """
    dims = tuple(dims)
    if len(dims) == 1:
        return mesh[dims[0]].get_group()
    sliced = mesh[dims]
    if use_flatten is None:
        use_flatten = _has_flatten(sliced)
    if use_flatten:
        return flatten_mesh(sliced, "_".join(dims)).get_group()
    groups = _FLAT_GROUPS.setdefault(mesh, {})
    group = groups.get(dims)
    if group is None:
        enumerate_groups: Any = dist.new_subgroups_by_enumeration  # untyped in torch
        group, _ = enumerate_groups(_partition(mesh, dims))
        groups[dims] = group
    return group


# -- DTensor shards --------------------------------------------------------------------


def _private_offset() -> Any:
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # moved or removed: the public computation below
        return None
    return compute_local_shape_and_global_offset


def shard_offset(dt: Any, *, use_private: bool | None = None) -> tuple[int, ...]:
    """Where this rank's local shard of DTensor `dt` starts in the full tensor, per tensor dim.

    Placements Shard, Replicate and FSDP2's `_StridedShard` over tensor parallel.
    torch's own `compute_local_shape_and_global_offset` (private) where it imports;
    else the same layout from the public placements: DTensor shards a dim like
    `torch.chunk` (pieces of ceil(n / k), the last ones short or empty), mesh dims in
    order, each cutting the piece the earlier ones left; a `_StridedShard` cuts after
    the later shards of its dim (FSDP2 shards the piece tensor parallel left). `use_private`
    forces a branch (the tests compare both); None: torch's when present.

    Raises:
        WholebatchError: on the public branch, for a strided shard whose split factor is
            not the later shards of its dim (a layout FSDP2 does not make).
    """
    fn = _private_offset() if use_private in (None, True) else None
    if use_private and fn is None:
        raise WholebatchError(
            f"shard_offset: torch {torch.__version__} has no "
            "torch.distributed.tensor._utils.compute_local_shape_and_global_offset"
        )
    if fn is not None:
        _, offset = fn(dt.shape, dt.device_mesh, dt.placements)
        return tuple(int(o) for o in offset)
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank holds no piece of it
        return tuple(0 for _ in dt.shape)
    length = list(dt.shape)
    offset = [0] * len(length)
    for mesh_dim, d in _cut_order(dt):
        k = mesh.size(mesh_dim)
        chunk = -(-length[d] // k)
        start = min(coord[mesh_dim] * chunk, length[d])
        length[d] = max(0, min(length[d], start + chunk) - start)
        offset[d] += start
    return tuple(offset)


def _is_strided(p: Any) -> bool:
    # by name: `_StridedShard` is private, and a `Shard` subclass only in some releases
    return type(p).__name__ == "_StridedShard"


def _cut_order(dt: Any) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) of each shard of `dt`, in the order they cut the tensor."""
    placements = tuple(dt.placements)
    plain = [
        (i, p.dim % dt.dim())
        for i, p in enumerate(placements)
        if not _is_strided(p) and p.is_shard()
    ]
    strided: list[tuple[int, int]] = []
    for i, p in enumerate(placements):
        if not _is_strided(p):
            continue
        d = p.dim % dt.dim()
        later = [j for j, e in plain if e == d and j > i]
        ways = 1
        for j in later:
            ways *= dt.device_mesh.size(j)
        if int(p.split_factor) != ways or any(e == d for _, e in strided):
            raise WholebatchError(
                f"shard_offset: placements {placements} on mesh {dt.device_mesh.mesh.tolist()} "
                f"are not FSDP2 over tensor parallel (the strided shard of dim {d} splits "
                f"{p.split_factor} ways, the later shards of that dim {ways}); torch's "
                "compute_local_shape_and_global_offset reads other layouts"
            )
        strided.append((i, d))
    return plain + strided


# torch 2.8's `full_tensor()` of an FSDP2 x tensor-parallel parameter (placements
# _StridedShard on the FSDP dim, then Shard on tp) is wrong when its dim does not divide
# evenly over both: measured off by 1.3 at init, before any step; 2.10 reads it right (2.9
# not measured: refused too). Training on that layout is exact on 2.8 (each rank's local
# shards of parameters and gradients, and the forward, equal one process's: measured, and
# judged so by the distributed tests); only reading the full tensor back is refused.
# tests/support/features.py, "fsdp_tp_uneven".
FULL_TENSOR_UNEVEN_STRIDED = (2, 10)


def _strided_uneven(dt: Any) -> bool:
    """Whether `dt` has a strided shard (FSDP2 over TP) on a dim its mesh dims do not divide."""
    placements = tuple(getattr(dt, "placements", ()))
    if not any(_is_strided(p) for p in placements):
        return False
    ways: dict[int, int] = {}
    for mesh_dim, p in enumerate(placements):
        if p.is_shard() or _is_strided(p):
            d = p.dim % dt.dim()
            ways[d] = ways.get(d, 1) * dt.device_mesh.size(mesh_dim)
    return any(dt.shape[d] % k for d, k in ways.items())


def full_tensor(dt: Any, *, op: str = "full_tensor") -> Tensor:
    """The whole tensor of DTensor `dt` on every rank (`dt.full_tensor()`; a collective).

    Raises:
        WholebatchError: on torch < 2.10, for an FSDP2 x tensor-parallel parameter whose
            sharded dim does not divide evenly: torch reads that layout back wrong there.
    """
    if torch_version() < FULL_TENSOR_UNEVEN_STRIDED and _strided_uneven(dt):
        raise WholebatchError(
            f"{op}: torch {torch.__version__} reads an FSDP2 x tensor-parallel DTensor back "
            f"wrong when its sharded dim does not divide evenly (shape {tuple(dt.shape)}, "
            f"placements {tuple(dt.placements)}, mesh {dt.device_mesh.mesh.tolist()}); "
            "use dims that divide over the mesh, or torch >= 2.10"
        )
    whole: Tensor = dt.full_tensor()
    return whole
