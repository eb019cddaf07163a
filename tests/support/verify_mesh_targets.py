"""`wholebatch verify --mesh` targets: TinyLM on dp x tp (FSDP2 on dp, Colwise/Rowwise on tp).

    PYTHONPATH=src python -m wholebatch verify tests/support/verify_mesh_targets.py:exact --mesh dp=2,tp=2

Each function returns a `VerifySpec` with `mesh="dp=2,tp=2"`: the model of
`tests/support/mesh_cases.py` (`parallelize` applies tensor parallel on tp and FSDP2 on
dp), a ragged batch (sequence lengths 1..8: token counts differ per micro-batch,
one row holds no target), float64.

- `exact`: `Accumulator(mesh=current_mesh(), batch_dims=("dp",))` (passes).
- `hand_exact`: the hand-written exact loop (count over dp; grads x dp / N) (passes).
- `ddp_exact`: no `parallelize`: verify wraps the model in DDP over dp (replicated
  over tp); the `Accumulator` (passes).
- `count_world`: the hand loop with the count all-reduced over the world: N counts
  the tp replicas' tokens too (1/tp).
- `replica_rows`: the hand loop where rank 1 (tp rank 1 of dp 0) takes the next
  shard's rows, as a sampler sharded by the global rank does.

On dp x cp ("dp=2,cp=2", FSDP2 on the flattened dp_cp dim, each cp rank keeping
its half of every row's token positions):

- `cp_exact`: `Accumulator(mesh=..., batch_dims=("dp", "cp"))` on the rank's slice (passes).
- `cp_dp_only`: each cp rank counts its own tokens over dp only (cp's counts dropped).
- `cp_twice`: every cp rank counts the items of the whole rows it shares and the
  counts are summed over dp x cp (prime-rl PR #2562): 1/cp.

Legend: N rows, T padded width, B row shards (dp), K micro-batches per shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.support.models import TinyLM, lm_loss_sum, make_sequences, micro_batch
from wholebatch.verify import VerifySpec, current_mesh
from wholebatch.verify.spec import split_batch

MESH = "dp=2,tp=2"
K = 2
_LENGTHS = (3, 8, 1, 5, 2, 7, 4, 6, 8, 2, 5, 3)  # N = 12 rows, a multiple of B*K = 4
WIDTH = 8


def _batch() -> tuple[Tensor, Tensor]:
    tokens_NT, targets_NT = micro_batch(make_sequences(_LENGTHS, seed=3), width=WIDTH)
    return tokens_NT, targets_NT


def _model() -> nn.Module:
    return TinyLM().double()


def parallelize(model: nn.Module, mesh: object) -> nn.Module:
    """Tensor parallel on tp (hidden colwise, out rowwise), then FSDP2 on dp."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        mesh["tp"],  # type: ignore[index]
        {"hidden": ColwiseParallel(), "out": RowwiseParallel()},
    )
    fully_shard(model, mesh=mesh["dp"])  # type: ignore[index]
    return model


def reference_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    loss_sum, n = lm_loss_sum(model, batch)
    return loss_sum / n


def _spec(step: object, mesh: str = MESH, parallelize_fn: object = None) -> VerifySpec:
    """A target on `mesh` (dp the batch dim), its model parallelised by `parallelize_fn`."""
    return VerifySpec(
        build_model=_model,
        batch=_batch(),
        step=step,  # type: ignore[arg-type]
        reference_loss=reference_loss,
        count_items=lambda b: int((b[1] != -100).sum()),
        mesh=mesh,
        batch_dims=("dp",),
        parallelize=parallelize if parallelize_fn is None else parallelize_fn,  # type: ignore[arg-type]
    )


def _accumulator_step(
    model: nn.Module, opt: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]
) -> None:
    from wholebatch.train.accumulate import Accumulator

    acc = Accumulator(model, opt, mesh=current_mesh(), batch_dims=("dp",))
    acc.step(mbs, lm_loss_sum)


def _hand(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    mbs: list[tuple[Tensor, Tensor]],
    *,
    world_count: bool = False,
) -> None:
    """The exact loop a careful user writes on dp x tp (`world_count`: the x tp mutation)."""
    mesh = current_mesh()
    k = len(mbs)
    items = torch.zeros((), dtype=torch.float64)
    for i, mb in enumerate(mbs):
        model.set_requires_gradient_sync(i == k - 1)  # type: ignore[operator]
        loss, n = lm_loss_sum(model, mb)
        loss.backward()
        items += n
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    dist.all_reduce(items, group=None if world_count else mesh["dp"].get_group())
    factor = mesh["dp"].size() / float(items)  # FSDP2 averaged over dp
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    opt.step()


def _hand_exact_step(
    model: nn.Module, opt: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]
) -> None:
    _hand(model, opt, mbs)


def _count_world_step(
    model: nn.Module, opt: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]
) -> None:
    _hand(model, opt, mbs, world_count=True)


def _replica_rows_step(
    model: nn.Module, opt: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]
) -> None:
    if dist.get_rank() == 1:  # a sampler by the global rank: rank 1 reads shard 1's rows
        b = current_mesh()["dp"].size()
        mbs = split_batch(_batch(), b * len(mbs))[len(mbs) : 2 * len(mbs)]
    _hand(model, opt, mbs)


def exact() -> VerifySpec:
    return _spec(_accumulator_step)


def hand_exact() -> VerifySpec:
    return _spec(_hand_exact_step)


def count_world() -> VerifySpec:
    return _spec(_count_world_step)


def replica_rows() -> VerifySpec:
    return _spec(_replica_rows_step)


# ---------------------------------------------------------------------------
# dp x cp: sequence sharding (each cp rank holds half of every row's positions)
# ---------------------------------------------------------------------------

CP_MESH = "dp=2,cp=2"


def parallelize_cp(model: nn.Module, mesh: object) -> nn.Module:
    """FSDP2 over dp x cp flattened: gradients reduced over both."""
    from torch.distributed.fsdp import fully_shard

    from wholebatch.comm._c10d import flatten_mesh

    fully_shard(model, mesh=flatten_mesh(mesh["dp", "cp"], "dp_cp"))  # type: ignore[index]
    return model


def _cp_slice(mbs: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """This cp rank's positions of every row (the mesh's cp coordinate picks the half)."""
    mesh = current_mesh()
    cp, c = mesh["cp"].size(), mesh["cp"].get_local_rank()
    part = WIDTH // cp
    return [(t[:, c * part : (c + 1) * part], y[:, c * part : (c + 1) * part]) for t, y in mbs]


def _cp_exact_step(
    model: nn.Module, opt: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]
) -> None:
    from wholebatch.train.accumulate import Accumulator

    acc = Accumulator(model, opt, mesh=current_mesh(), batch_dims=("dp", "cp"))
    acc.step(_cp_slice(mbs), lm_loss_sum)


def _cp_twice_step(
    model: nn.Module, opt: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]
) -> None:
    mesh = current_mesh()
    k = len(mbs)
    items = torch.zeros((), dtype=torch.float64)
    for i, (mb, whole) in enumerate(zip(_cp_slice(mbs), mbs, strict=True)):
        model.set_requires_gradient_sync(i == k - 1)  # type: ignore[operator]
        loss, _n = lm_loss_sum(model, mb)
        loss.backward()
        items += (whole[1] != -100).sum()  # the mutation: the whole rows' items, not the slice's
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    data = mesh["dp_cp"]
    dist.all_reduce(items, group=data.get_group())
    factor = data.size() / float(items)  # FSDP2 averaged over dp x cp
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    opt.step()


def _cp_dp_only_step(
    model: nn.Module, opt: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]
) -> None:
    """The mutation: each cp rank counts its own tokens, all-reduced over dp only."""
    mesh = current_mesh()
    k = len(mbs)
    items = torch.zeros((), dtype=torch.float64)
    for i, mb in enumerate(_cp_slice(mbs)):
        model.set_requires_gradient_sync(i == k - 1)  # type: ignore[operator]
        loss, n = lm_loss_sum(model, mb)
        loss.backward()
        items += n
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    dist.all_reduce(items, group=mesh["dp"].get_group())  # cp's counts dropped
    factor = mesh["dp_cp"].size() / float(items)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    opt.step()


def cp_dp_only() -> VerifySpec:
    return _cp_spec(_cp_dp_only_step)


def _cp_spec(step: object) -> VerifySpec:
    return _spec(step, CP_MESH, parallelize_cp)


def cp_exact() -> VerifySpec:
    return _cp_spec(_cp_exact_step)


def cp_twice() -> VerifySpec:
    return _cp_spec(_cp_twice_step)


# ---------------------------------------------------------------------------
# pp x dp: two stages of TinyLM (tests/support/mesh_cases.py), FSDP2 on dp per stage
# ---------------------------------------------------------------------------

PP_MESH = "pp=2,dp=2"


def parallelize_pp(model: nn.Module, mesh: object) -> nn.Module:
    """This rank's stage of `model` (its pp coordinate), FSDP2 on dp; the step builds the
    PipelineStage around it."""
    from torch.distributed.fsdp import fully_shard

    from tests.support.mesh_cases import Stage0, Stage1

    lm = model
    pp = mesh["pp"].get_local_rank()  # type: ignore[index]
    stage_mod: nn.Module = Stage0(lm) if pp == 0 else Stage1(lm)  # type: ignore[arg-type]
    fully_shard(stage_mod, mesh=mesh["dp"])  # type: ignore[index]
    return stage_mod


def _pipeline_stage(module: nn.Module) -> object:
    from torch.distributed.pipelining import PipelineStage

    mesh = current_mesh()
    pp = mesh["pp"].get_local_rank()
    return PipelineStage(module, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())


def _pp_exact_step(
    model: nn.Module, opt: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]
) -> None:
    from tests.support.mesh_cases import token_loss_sum
    from wholebatch.train.pipeline import PipelineAccumulator

    acc = PipelineAccumulator(
        _pipeline_stage(model), opt, mesh=current_mesh(), batch_dims=("dp",),
        pipeline_dim="pp", schedule="1f1b", n_microbatches=len(mbs), loss_fn=token_loss_sum,
    )  # fmt: skip
    tokens = torch.cat([t for t, _ in mbs])  # [K*S, T]: the schedule cuts K chunks
    targets = torch.cat([y for _, y in mbs])
    acc.step(tokens, target=targets)


def _pp_stage0_unscaled_step(
    model: nn.Module, opt: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]
) -> None:
    """A hand-written pipeline step whose first stage keeps its unscaled gradient sum."""
    from torch.distributed.pipelining import Schedule1F1B

    from tests.support.mesh_cases import token_loss_sum

    stage: Any = _pipeline_stage(model)
    parts: list[Tensor] = []

    def loss_fn(out: Tensor, tgt: Tensor) -> Tensor:
        loss, n = token_loss_sum(out, tgt)
        parts.append(torch.stack([loss.detach(), n.to(loss.dtype)]))
        return loss

    schedule = Schedule1F1B(stage, n_microbatches=len(mbs), loss_fn=loss_fn, scale_grads=False)
    if stage.is_first:
        schedule.step(torch.cat([t for t, _ in mbs]))
    else:
        schedule.step(target=torch.cat([y for _, y in mbs]))
    mine = torch.stack(parts[-len(mbs) :]).sum(0) if parts else torch.zeros(2, dtype=torch.float64)
    dist.all_reduce(mine)  # only the last stages hold counts: the world sum is N
    factor = current_mesh()["dp"].size() / float(mine[1])  # FSDP2 averaged over dp
    if stage.is_first:
        factor = 1.0  # the mutation: this stage is not rescaled
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    opt.step()


def _pp_spec(step: object) -> VerifySpec:
    return _spec(step, PP_MESH, parallelize_pp)


def pp_exact() -> VerifySpec:
    return _pp_spec(_pp_exact_step)


def pp_stage0_unscaled() -> VerifySpec:
    return _pp_spec(_pp_stage0_unscaled_step)


def ddp_exact() -> VerifySpec:
    """No parallelize: verify wraps the plain model in DDP over the batch dims (dp), the
    model replicated over tp; the Accumulator counts over dp."""
    return dataclasses.replace(_spec(_accumulator_step), parallelize=None, wrap="ddp")
