"""The whole-batch losses and GradCache on a dp2 x tp2 mesh: what each rank runs.

`run_all` runs on every rank of a 4-rank gloo world (tests.support.harness) and
returns this rank's results for every case at once (one call: the suite's wall
time). Mesh [[0, 1], [2, 3]] over (dp, tp): rank r has dp = r // 2, tp = r % 2;
the two tp ranks of a dp coordinate are replicas and hold the same rows.

Cases (`LossCase`): a loss, the rows of each of the two dp shards (uneven, or
one shard empty), and how the loss is called: "mesh" (`mesh=`, `batch_dims=`),
"module" (the `nn.Module` form on the mesh), "world" (the mutation: `group=`
the whole world, so tp replicas' rows count twice), or "misfed" (rank 1, tp 1
of dp 0, holds other rows of the same shapes). Errors are caught and returned
as text, so one call holds every case.

Legend: B data shards (dp = 2), n_b rows of shard b, D = 3, k = 1 hard negative.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tests.support.mesh_cases import get_mesh

DP_TP = (("dp", 2), ("tp", 2))
DP_CP = (("dp", 2), ("cp", 2))
D = 3
K_NEG = 1
SCALARS: dict[str, tuple[float, ...]] = {
    "clip": (2.5,),
    "siglip": (1.7, -0.8),
    "nt_xent": (0.6,),
    "info_nce": (2.5,),
}
# The input each loss takes, in order (info_nce: query, document, hard negatives).
INPUTS: dict[str, tuple[str, ...]] = {
    "clip": ("image_BD", "text_BD"),
    "siglip": ("image_BD", "text_BD"),
    "nt_xent": ("z1_BD", "z2_BD"),
    "info_nce": ("query_BD", "document_BD", "negatives_BKD"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossCase:
    """One loss call on the mesh."""

    loss: str
    rows: tuple[int, int]  # rows of dp shard 0 and dp shard 1
    how: str = "mesh"  # "mesh" | "module" | "world" | "misfed" | "permuted"
    misfed_input: int = 0  # which input rank 1 gets wrong ("misfed", "permuted")
    grad_reduction: str = "mean"


def shard_inputs(loss: str, rows: int, shard: int) -> list[Tensor]:
    """Data shard `shard`'s inputs (seeded by the shard: its replicas draw the same)."""
    gen = torch.Generator().manual_seed(500 + 10 * shard + len(loss))
    out = []
    for name in INPUTS[loss]:
        shape = (rows, K_NEG, D) if name.endswith("_BKD") else (rows, D)
        out.append(torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.7)
    return out


def _call(case: LossCase, xs: list[Tensor], sc: list[Tensor]) -> Tensor:
    from wholebatch.losses import (
        ClipLoss,
        InfoNCELoss,
        NTXentLoss,
        SigLipLoss,
        clip_loss,
        info_nce_loss,
        nt_xent_loss,
        siglip_loss,
    )

    mesh = get_mesh(DP_TP)
    where: dict[str, Any] = {"mesh": mesh, "batch_dims": ("dp",)}
    if case.how == "world":
        where = {"group": None}  # the mutation: every rank's rows, replicas twice
    common: dict[str, Any] = {**where, "grad_reduction": case.grad_reduction, "tile_size": 2}
    if case.how == "module":
        mods: dict[str, Callable[..., Any]] = {
            "clip": ClipLoss,
            "siglip": SigLipLoss,
            "nt_xent": NTXentLoss,
            "info_nce": InfoNCELoss,
        }
        module = mods[case.loss](normalize=False, **common, **_scalar_kw(case.loss))
        if case.loss == "info_nce":
            return module(xs[0], xs[1], xs[2], *sc)  # type: ignore[no-any-return]
        return module(*xs, *sc)  # type: ignore[no-any-return]
    if case.loss == "info_nce":
        return info_nce_loss(xs[0], xs[1], *sc, negatives_BKD=xs[2], **common)
    fn = {"clip": clip_loss, "siglip": siglip_loss, "nt_xent": nt_xent_loss}[case.loss]
    return fn(*xs, *sc, **common)  # type: ignore[operator,no-any-return]


def _scalar_kw(loss: str) -> dict[str, Any]:
    """Module forms: scalars passed per call (the constructor owns none)."""
    if loss == "nt_xent":
        return {"temperature": None}
    if loss == "siglip":
        return {"logit_scale": None, "logit_bias": None}
    return {"logit_scale": None}


def run_loss(case: LossCase) -> dict[str, Any]:
    """This rank's loss, input gradients and scalar gradients (or the error text)."""
    from wholebatch.errors import WholebatchError

    rank = dist.get_rank()
    dp = rank // 2
    xs = shard_inputs(case.loss, case.rows[dp], dp)
    if case.how in ("misfed", "permuted") and rank == 1:
        x = xs[case.misfed_input]
        xs[case.misfed_input] = x.flip(0) if case.how == "permuted" else x + 0.25
    xs = [x.clone().requires_grad_() for x in xs]
    sc = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in SCALARS[case.loss]]
    try:
        loss = _call(case, xs, sc)
    except WholebatchError as e:
        return {"error": str(e)}
    loss.backward()
    zero = torch.zeros_like
    return {
        "loss": loss.detach(),
        "grads": [x.grad if x.grad is not None else zero(x) for x in xs],
        "scalar_grads": [s.grad if s.grad is not None else zero(s) for s in sc],
    }


def argument_errors() -> dict[str, str]:
    """The errors of bad mesh arguments (raised before any collective)."""
    from torch import nn

    from wholebatch.errors import WholebatchError
    from wholebatch.losses import ClipLoss, clip_loss
    from wholebatch.train.gradcache import GradCache

    mesh = get_mesh(DP_TP)
    x = torch.zeros(2, D, dtype=torch.float64)
    bad: dict[str, Callable[[], object]] = {
        "both": lambda: clip_loss(x, x, 1.0, group=dist.group.WORLD, mesh=mesh, batch_dims=("dp",)),
        "no_mesh": lambda: clip_loss(x, x, 1.0, batch_dims=("dp",)),
        "no_dims": lambda: clip_loss(x, x, 1.0, mesh=mesh),
        "unknown": lambda: clip_loss(x, x, 1.0, mesh=mesh, batch_dims=("data",)),
        "module_unknown": lambda: ClipLoss(normalize=False, mesh=mesh, batch_dims=("cp",)),
        "cache_both": lambda: GradCache(
            nn.Linear(2, 2), group=dist.group.WORLD, mesh=mesh, batch_dims=("dp",)
        ),
        "cache_string": lambda: GradCache(nn.Linear(2, 2), mesh=mesh, batch_dims="dp"),
    }
    out = {}
    for name, fn in bad.items():
        try:
            fn()
        except WholebatchError as e:
            out[name] = str(e)
    return out


def group_is_cached() -> bool:
    """Two resolutions of the same mesh and dims return the very same group (none created)."""
    from wholebatch.comm.meshgroup import resolve_group

    mesh = get_mesh(DP_TP)
    a, _ = resolve_group(None, mesh, ("dp",), "clip_loss")
    b, _ = resolve_group(None, mesh, ["dp"], "clip_loss")
    return a is b and a is not None


def replica_agreements(shape: tuple[tuple[str, int], ...], batch_dims: tuple[str, ...]) -> int:
    """How many replica agreements (all-gathers over the mesh) one clip_loss call starts."""
    import wholebatch.comm.meshgroup as meshgroup
    from wholebatch.losses import clip_loss

    mesh = get_mesh(shape)
    calls = 0
    real = meshgroup.start_rows

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)  # the real all-gather runs

    meshgroup.start_rows = counted  # type: ignore[assignment]
    try:
        x = torch.randn(2, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        clip_loss(x, x + 0.1 * (dist.get_rank() // 2), 2.0, mesh=mesh, batch_dims=batch_dims)
    finally:
        meshgroup.start_rows = real  # type: ignore[assignment]
    return calls


# ---------------------------------------------------------------------------
# GradCache on dp2 x tp2: DDP on dp, the model replicated over tp
# ---------------------------------------------------------------------------


def _sum_hook(state: object, bucket: Any) -> Any:
    """A DDP comm hook that sums rank gradients (grad_reduction="sum")."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


# DDP accepts only runtime annotations on a hook (ours are strings under __future__).
_sum_hook.__annotations__ = {}


def run_gradcache(k: int, how: str) -> dict[str, Any]:
    """`GradCache(mesh=, batch_dims=)` with `clip_loss(mesh=, batch_dims=)`; one SGD step
    (lr 1). how: "mesh" (DDP on dp), "world" (the loss gathers over every rank: the
    mutation), "misfed" (rank 1's rows reversed: other pairs, the same shapes), "sum"
    (DDP over every rank, summing: tp replicas' equal gradients added, which the cache's
    rescale by 1/tp undoes), "sum_unscaled" (the mutation: that rescale off)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.distributed.test_cache import _batches, _build
    from tests.support.contrastive_models import embed
    from wholebatch.errors import WholebatchError
    from wholebatch.losses import clip_loss
    from wholebatch.train.gradcache import GradCache

    mesh = get_mesh(DP_TP)
    dp = dist.get_rank() // 2
    model, scale = _build("inside")
    summed = how.startswith("sum")
    reduction = "sum" if summed else "mean"
    wrapped = DDP(model, process_group=None if summed else mesh["dp"].get_group())
    if summed:
        wrapped.register_comm_hook(None, _sum_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    where: dict[str, Any] = (
        {"group": None} if how == "world" else {"mesh": mesh, "batch_dims": ("dp",)}
    )

    def loss_fn(i: Tensor, t: Tensor) -> Tensor:
        return clip_loss(i, t, scale, tile_size=2, grad_reduction=reduction, **where)

    # "misfed" checks the embeddings' fingerprint: the inputs' (which would refuse it first,
    # before any forward) is off; tests/distributed/test_mesh_dist.py tests that one.
    cache = GradCache(
        wrapped, embed, mesh=mesh, batch_dims=("dp",), grad_reduction=reduction,
        check_inputs=how != "misfed",
    )  # fmt: skip
    cache._mesh_rescale = how != "sum_unscaled"
    mine = _batches(2, k)[dp]
    if how == "misfed" and dist.get_rank() == 1:
        mine = [(a.flip(0), b) for a, b in mine]
    torch.manual_seed(100 + dp)  # the tp replicas draw the same dropout
    try:
        loss = cache(mine, loss_fn)
        loss.backward()
        opt.step()
        out: dict[str, Any] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["loss"] = loss.detach()
        return out
    except WholebatchError as e:
        return {"error": str(e)}
    finally:
        del cache, wrapped, opt  # leave no DDP reducer behind in the reused worker
        gc.collect()


def run_all(cases: list[LossCase], gradcache: list[tuple[int, str]]) -> dict[str, Any]:
    """Every case on this rank, in order; the same order on every rank."""
    return {
        "losses": [run_loss(c) for c in cases],
        "arguments": argument_errors(),
        "cached_group": group_is_cached(),
        "agreements_tp": replica_agreements(DP_TP, ("dp",)),
        "agreements_cp": replica_agreements(DP_CP, ("dp", "cp")),
        "gradcache": [run_gradcache(k, how) for k, how in gradcache],
    }
