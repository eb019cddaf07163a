"""The engines' side of a mesh split: which dims the wrapper reduces, the scale, the norm.

`wholebatch.comm.mesh.MeshSplit` says which mesh dims split the batch. An
engine (`Accumulator`, `CachedStep`, `PipelineAccumulator`) also needs to know
what its data-parallel wrapper does to the gradient, read here from the model:

    reduction = MeshReduction.of(model, split, grad_reduction="mean")
    reduction.dims       # ("dp",): FSDP2 on mesh["dp"]; ("dp", "cp"): on mesh["dp", "cp"]._flatten()
    reduction.factor     # 2.0: what the accumulated gradient is multiplied by, over N

**The rule for the scale after backward.** Let each rank back-propagate its own
loss sum l_r (items of its data shard), B data shards over the batch dims, N
items in all. The whole-batch gradient is d(sum over shards of l_b)/dθ / N.
The wrapper reduces each gradient over a set of dims A (DDP's group, FSDP2's
mesh; a flattened dim is the dims it flattens):

- every batch dim of size > 1 must be in A, or its shards' gradients are never
  combined (an error naming the dim);
- the pipeline dim must not be in A (stages hold different parameters);
- "mean" divides by |A| = (product of A's batch dims) x (product of A's replica
  dims); replicas hold the same gradient, so their share of the mean is 1 and
  the factor is the product of the batch dims in A. "sum" adds replicas' equal
  gradients, so the factor is 1 / (product of the replica dims in A).
- tensor-parallel parameters are DTensors whose gradients DTensor's own
  autograd makes whole (a Replicate input's gradient is summed over tp): no
  factor for tp.

So after the wrapper: grad = factor / N x (what was back-propagated); an engine
multiplies by factor / (c N) once, c its constant backward pre-scale.

**The gradient norm.** Each rank holds pieces of gradients; a piece is held by
`holders` ranks (its DTensor's Replicate dims, times the mesh dims its tensor
does not span, pipeline stages excepted: they hold different parameters). The
squared norm is the sum over ranks of (squared local piece / holders): one
number per rank in the step's all-gather, exact for any mix of FSDP2 shards,
TP shards, replicated and per-stage parameters.

Legend: W processes of the mesh, B data shards, N global item count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from wholebatch.comm.mesh import MeshSplit
from wholebatch.conventions import GradReduction, check_grad_reduction
from wholebatch.errors import WholebatchError, WholebatchTypeError
from wholebatch.train.wrappers import fsdp2_class, is_dtensor, local_tensor

__all__ = [
    "GradGroup",
    "MeshReduction",
    "ModuleDims",
    "grad_groups",
    "reduced_ranks",
    "sq_norm_share",
]

ModuleDims = Mapping["nn.Module | str", Sequence[str]]
"""Submodules (or their names in the model) -> the batch dims their data is split over."""


def _fsdp_reduction(module: Any) -> tuple[frozenset[int], float | None] | None:
    """The ranks an FSDP2 module reduces gradients over (its mesh: shard x replicate), and
    its `set_gradient_divide_factor` (None: the mean's own)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    group = getattr(state, "_fsdp_param_group", None)
    if group is None:  # a module with no parameters of its own
        return None
    mesh = group.mesh_info.mesh
    divisor = getattr(group, "gradient_divide_factor", None)
    ranks = frozenset(int(r) for r in mesh.mesh.flatten().tolist())
    return ranks, None if divisor is None else float(divisor)


def _modules_outside(root: nn.Module, skip: frozenset[int]) -> list[tuple[str, nn.Module]]:
    """(name, module) of `root`'s modules, itself included, outside the modules in `skip` (ids)."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        name, m = stack.pop()
        if id(m) in skip or id(m) in seen:
            continue
        seen.add(id(m))
        out.append((name, m))
        for child, sub in reversed(list(m.named_children())):
            stack.append((f"{name}.{child}" if name else child, sub))
    return out


def reduced_ranks(
    model: nn.Module, *, exclude: Sequence[nn.Module] = ()
) -> tuple[frozenset[int], float | None]:
    """The ranks `model`'s wrapper reduces gradients over (empty for a plain module), and
    the divisor it was given instead of the mean's (None: the mean's, or DDP).

    DDP: its process group. FSDP2 (`fully_shard`, anywhere in the model, HSDP
    included): its mesh. Every FSDP2 module of the model must reduce alike, except
    inside `exclude` (submodules whose own reduction is read on its own: a module
    data-parallel over other dims, `grad_groups`).
    """
    inner: nn.Module = getattr(model, "_orig_mod", model)  # torch.compile
    if isinstance(inner, DistributedDataParallel):
        ranks = frozenset(int(r) for r in dist.get_process_group_ranks(inner.process_group))
        return ranks, None
    found: dict[tuple[frozenset[int], float | None], str] = {}
    fsdp2 = fsdp2_class()
    if fsdp2 is not None:
        for name, m in _modules_outside(inner, frozenset(id(e) for e in exclude)):
            if isinstance(m, fsdp2):
                how = _fsdp_reduction(m)
                if how is not None:
                    found.setdefault(how, name or "<root>")
    if len(found) > 1:
        shown = {where: (sorted(r), d) for (r, d), where in found.items()}
        raise WholebatchError(
            f"mesh: FSDP2 modules of the model reduce differently {shown} (ranks, divide "
            "factor); fully_shard every module on the same mesh with the same divide factor"
        )
    return next(iter(found), (frozenset(), None))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshReduction:
    """What the model's wrapper does to gradients, as dims of a `MeshSplit`."""

    split: MeshSplit
    """The batch split."""

    dims: tuple[str, ...]
    """The dims (of size > 1) the wrapper reduces gradients over."""

    grad_reduction: GradReduction
    """"mean" (DDP, FSDP2) or "sum"."""

    divisor: float | None = None
    """What the wrapper divides the summed gradient by when it is not the mean's |A|
    (FSDP2's `set_gradient_divide_factor`); None: |A| for "mean", 1 for "sum"."""

    @property
    def factor(self) -> float:
        """The module docstring's factor: grad after the wrapper = factor / N x back-propagated.

        The wrapper sums over A (replicas' equal gradients: x their count) and divides
        by its divisor, so the factor is divisor / (product of A's replica dims).
        """
        replicas = self.split.size_of(d for d in self.dims if d not in self.split.batch_dims)
        divisor = self.divisor
        if divisor is None:
            divisor = float(self.split.size_of(self.dims)) if self.grad_reduction == "mean" else 1.0
        return divisor / replicas

    @classmethod
    def of(
        cls,
        model: nn.Module,
        split: MeshSplit,
        *,
        grad_reduction: GradReduction = "mean",
        allow_unreduced: bool = False,
        op: str = "step",
        exclude: Sequence[nn.Module] = (),
    ) -> MeshReduction:
        """Read `model`'s wrapper and check it reduces over every batch dim (same error on every rank).

        Args:
            model: the module as trained (DDP, FSDP2 anywhere in it, or plain).
            split: the batch split.
            grad_reduction: "mean" or "sum", what the wrapper does over its dims.
            allow_unreduced: allow batch dims the wrapper does not reduce (`rank_local`:
                the caller reduces, or each rank steps on its own gradient).
            op: the name errors start with.
            exclude: submodules whose gradients are another group's (`grad_groups`):
                their wrappers are not read here.

        Raises:
            WholebatchError: when the wrapper's ranks are no set of mesh dims, when a
                batch dim is not reduced, or when the pipeline dim is.
        """
        check_grad_reduction(op, grad_reduction)
        ranks, divisor = reduced_ranks(model, exclude=exclude)
        me = dist.get_rank() if dist.is_initialized() else 0
        dims = split.dims_of(ranks or {me})
        if dims is None:
            raise WholebatchError(
                f"{op}: the model's wrapper reduces gradients over ranks {sorted(ranks)}, which "
                f"are no set of dims of the mesh [{split.describe()}]; wrap the model on a "
                "mesh sliced from the same DeviceMesh (e.g. fully_shard(model, mesh=mesh['dp']))"
            )
        missing = [d for d in split.batch_dims if split.sizes[d] > 1 and d not in dims]
        if missing and not allow_unreduced:
            wrapped = f"over {dims}" if dims else "not at all (a plain module)"
            flat = "_".join(d for d in split.batch_dims if split.sizes[d] > 1)
            raise WholebatchError(
                f"{op}: the batch is split over {split.batch_dims} but the model's gradients "
                f"are reduced {wrapped}: the shards of batch dims {missing} would never be "
                "combined. Reduce over every batch dim: fully_shard (or DDP) on the flattened "
                f"batch dims, e.g. mesh[{split.batch_dims!r}]._flatten({flat!r}); or, if "
                f"{missing} replicate the batch (tensor parallel), leave them out of batch_dims"
            )
        if split.pipeline_dim is not None and split.pipeline_dim in dims:
            raise WholebatchError(
                f"{op}: the model's gradients are reduced over the pipeline dim "
                f"{split.pipeline_dim!r}; its ranks are stages holding different parameters. "
                "Wrap each stage on the data-parallel dims only"
            )
        return cls(split=split, dims=dims, grad_reduction=grad_reduction, divisor=divisor)


def _holders(split: MeshSplit, p: Tensor) -> int:
    """How many ranks hold the same data as this rank's piece of `p` (see the module docstring)."""
    spanned = tuple(d for d in split.dims if d != split.pipeline_dim)
    if not is_dtensor(p):
        return split.size_of(spanned)
    mesh = p.device_mesh  # type: ignore[attr-defined]
    covered = split.dims_of(int(r) for r in mesh.mesh.flatten().tolist())
    if covered is None:
        raise WholebatchError(
            f"mesh: a parameter of shape {tuple(p.shape)} is a DTensor on ranks "
            f"{sorted(int(r) for r in mesh.mesh.flatten().tolist())}, which are no set of dims "
            f"of the step's mesh [{split.describe()}]; shard it on a mesh sliced from that mesh"
        )
    replicated = 1
    for i, placement in enumerate(p.placements):  # type: ignore[attr-defined]
        if placement.is_replicate():
            replicated *= int(mesh.size(i))
    outside = split.size_of(d for d in spanned if d not in covered)
    return replicated * outside


def sq_norm_share(split: MeshSplit, params: Sequence[Tensor]) -> Tensor:
    """This rank's share of the squared gradient norm: sum of squared local grads / holders.

    Summed over every rank of the mesh it is the whole gradient's squared norm
    (float64, on the CPU).
    """
    by_holders: dict[int, list[Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        local = local_tensor(g)
        by_holders.setdefault(_holders(split, p), []).append(local)
    total = torch.zeros((), dtype=torch.float64)
    for holders, ts in sorted(by_holders.items()):
        norms = torch._foreach_norm(ts, 2, dtype=torch.float64)
        total = total + torch.stack([n.cpu() for n in norms]).square().sum() / holders
    return total


# ---------------------------------------------------------------------------
# Modules on their own data-parallel dims
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradGroup:
    """Parameters whose gradients one wrapper reduces over the dims their data is split over."""

    name: str
    """The submodule's name in the model ("" for every parameter of no other group)."""

    reduction: MeshReduction
    """Its wrapper's dims and the factor of the scale rule, for its own batch dims."""

    params: frozenset[int] | None
    """ids of its parameters; None: the rest (every parameter of no other group)."""


def _submodule(model: nn.Module, key: object, op: str) -> tuple[str, nn.Module]:
    inner: nn.Module = getattr(model, "_orig_mod", model)
    if isinstance(inner, DistributedDataParallel):
        inner = inner.module
    if isinstance(key, str):
        try:
            return key, inner.get_submodule(key)
        except AttributeError:
            names = [n for n, _ in inner.named_modules() if n][:12]
            raise WholebatchError(
                f"{op}: module_batch_dims names {key!r}, which is no submodule of the model; "
                f"its submodules include {names}"
            ) from None
    if isinstance(key, nn.Module):
        for name, m in inner.named_modules():
            if m is key:
                return name, m
        raise WholebatchError(
            f"{op}: module_batch_dims holds a {type(key).__name__} that is not a submodule "
            "of the model; pass the submodules themselves (e.g. model.encoder) or their names"
        )
    raise WholebatchTypeError(
        f"{op}: module_batch_dims keys must be submodules or their names, got {type(key).__name__}"
    )


def grad_groups(
    model: nn.Module,
    split: MeshSplit,
    module_dims: ModuleDims | None,
    *,
    grad_reduction: GradReduction = "mean",
    allow_unreduced: bool = False,
    op: str = "step",
) -> tuple[GradGroup, ...]:
    """The model's parameter groups: the rest on `split`'s batch dims, then one per module
    of `module_dims` on its own (the same on every rank: it reads the arguments and the
    wrappers only).

    Each module's `MeshReduction` is read from its own wrapper (FSDP2 inside it, or the
    model's DDP) against the batch dims its data is split over, so its factor is its
    own: a vision encoder data-parallel over every rank (`("dp_enc",)`, dp x tp
    flattened) is scaled by 4 where the language model beside it (dp 2, tp 2) is scaled
    by 2 (module docstring of `wholebatch.train.meshstep`).

    Raises:
        WholebatchError: a key that is no submodule, a parameter in two groups, batch
            dims the mesh does not have, a module's wrapper that does not reduce its dims.
    """
    groups: list[tuple[str, nn.Module, MeshSplit]] = []
    for key, dims in (module_dims or {}).items():
        name, module = _submodule(model, key, op)
        if isinstance(dims, str):
            raise WholebatchTypeError(
                f"{op}: module_batch_dims[{name!r}]={dims!r} is a string; pass a tuple of "
                f"dim names, e.g. ({dims!r},)"
            )
        try:
            own = MeshSplit(
                mesh=split.mesh, batch_dims=tuple(dims), pipeline_dim=split.pipeline_dim
            )
        except (WholebatchError, WholebatchTypeError) as err:
            text = str(err).removeprefix("MeshSplit: ")
            raise type(err)(f"{op}: module_batch_dims[{name!r}]: {text}") from None
        groups.append((name or "<root>", module, own))
    owner: dict[int, str] = {}
    for name, module, _ in groups:
        for p in module.parameters():
            if id(p) in owner and owner[id(p)] != name:
                raise WholebatchError(
                    f"{op}: module_batch_dims: a parameter of shape {tuple(p.shape)} is in "
                    f"both {owner[id(p)]!r} and {name!r}; give each parameter one module"
                )
            owner[id(p)] = name
    modules = [m for _, m, _ in groups]
    rest = GradGroup(
        name="",
        reduction=MeshReduction.of(
            model,
            split,
            grad_reduction=grad_reduction,
            allow_unreduced=allow_unreduced,
            op=op,
            exclude=modules,
        ),
        params=None,
    )
    out = [rest]
    ddp = isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel)
    for name, module, own in groups:
        how = MeshReduction.of(
            model if ddp else module,  # DDP reduces every parameter over its one group
            own,
            grad_reduction=grad_reduction,
            allow_unreduced=allow_unreduced,
            op=f"{op}: module {name!r}",
        )
        ids = frozenset(id(p) for p in module.parameters())
        out.append(GradGroup(name=name, reduction=how, params=ids))
    return tuple(out)
