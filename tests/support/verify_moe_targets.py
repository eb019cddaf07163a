"""`wholebatch verify` targets for whole-batch auxiliary losses: a tiny MoE language model.

    PYTHONPATH=src python -m wholebatch verify tests/support/verify_moe_targets.py:moe_exact \\
        --nproc 2 --micro-batches 3

The model is `tests/support/moe_cases.TinyMoE` (embedding, two MoE blocks of 4
experts, top-2, each under activation checkpointing, each passing its output through
`LoadBalancingLoss` and `RouterZLoss`), float64, on a ragged batch of 12 sequences
(token counts differ per micro-batch; one sequence holds no target). The reference is
the whole batch's objective written out: the token mean of the cross-entropy plus,
per block, α·E·Σₑ fₑ·Pₑ and β·mean lse² over the batch's real tokens.

- `moe_exact`: `Accumulator(model, optimizer).step(micro_batches, ce_sum)` (passes).
- `moe_hand_exact`: the counting pass written by hand (passes).
- `moe_per_micro_batch`: the main loss exact (N all-reduced first), every micro-batch's
  aux loss from its own tokens, averaged over the micro-batches (and, by DDP, the ranks):
  the loss most frameworks compute.
- `moe_one_over_dp`: the whole batch's fₑ and T (counted, all-reduced) but the aux
  gradient not compensated for DDP's mean: 1/W of it (Megatron-LM's global aux loss
  before PR #3769).
- `moe_per_micro_batch_summed`: `moe_per_micro_batch` without the 1/K (K x the mean).
- `moe_per_micro_batch_unnamed`: `moe_per_micro_batch`, the spec without `aux_loss`.
- `moe_main_mean_of_means`: the aux terms exact, the main term each micro-batch's mean.

Every spec but `moe_per_micro_batch_unnamed` names the aux terms (`aux_loss`), so
verify reads their weights in a failing step (`aux-per-micro-batch`, `aux-scaled`).

Legend: N sequences, T padded width, W ranks, K micro-batches per rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.support.models import IGNORE, PAD, make_sequences, micro_batch
from tests.support.moe_cases import TinyMoE, _pack, aux_value, ce_sum, router_sums
from wholebatch.verify import VerifySpec

TOP_K = 2
BLOCKS = 2
_LENGTHS = (3, 8, 1, 5, 2, 7, 4, 6, 8, 2, 5, 3)  # 12 rows: W·K = 2·3 or 4·3 divide it
WIDTH = 8


def _batch() -> tuple[Tensor, Tensor]:
    return micro_batch(make_sequences(_LENGTHS, seed=5), width=WIDTH)


def _model() -> nn.Module:
    return TinyMoE(TOP_K, blocks=BLOCKS)


def reference_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The whole batch's objective in one forward, the aux terms written out."""
    tokens, targets = batch
    main, n = ce_sum(model, (tokens, targets))
    return main / n + aux_value(router_sums(model, (tokens != PAD).reshape(-1)), TOP_K)  # type: ignore[arg-type]


def aux_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The aux terms of `reference_loss` alone: the batch's own router statistics."""
    tokens, _ = batch
    model(tokens)
    return aux_value(router_sums(_inner(model), (tokens != PAD).reshape(-1)), TOP_K)


def _inner(model: nn.Module) -> TinyMoE:
    inner = getattr(model, "module", model)
    assert isinstance(inner, TinyMoE)
    return inner


def _mesh() -> object | None:
    """verify's mesh in a `--mesh` run (its "dp" dim holds the data shards), else None."""
    from wholebatch.errors import WholebatchError
    from wholebatch.verify import current_mesh

    try:
        return current_mesh()
    except WholebatchError:
        return None


def _world() -> int:
    """The data-parallel ranks: the mesh's dp, else the world."""
    mesh = _mesh()
    if mesh is not None:
        return int(mesh["dp"].size())  # type: ignore[index]
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_reduce(t: Tensor) -> Tensor:
    """Summed over the data-parallel ranks (the tp ranks of a shard hold the same rows)."""
    mesh = _mesh()
    if mesh is not None:
        dist.all_reduce(t, group=mesh["dp"].get_group())  # type: ignore[index]
    elif dist.is_initialized():
        dist.all_reduce(t)
    return t


def _exact_step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list) -> None:
    from wholebatch.train.accumulate import Accumulator

    mesh = _mesh()
    where = {} if mesh is None else {"mesh": mesh, "batch_dims": ("dp",)}
    Accumulator(model, optimizer, **where).step(mbs, ce_sum)  # type: ignore[arg-type]


def _counted(model: nn.Module, mbs: list) -> tuple[Tensor, float]:
    """Every block's (counts_E, T) over the whole batch, and N, by a pass without graph."""
    inner = _inner(model)
    totals = None
    with torch.no_grad():
        for mb in mbs:
            _, n = ce_sum(model, mb)
            row = torch.cat(
                [_pack(router_sums(inner, (mb[0] != PAD).reshape(-1))), n.reshape(1).double()]
            )
            totals = row if totals is None else totals + row
    assert totals is not None
    totals = _all_reduce(totals)
    return totals[:-1], float(totals[-1])


def _global_step(*, one_over_dp: bool) -> object:
    def step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list) -> None:
        w = _world()
        aux_weight = 1.0 / w if one_over_dp else 1.0
        counts, n = _counted(model, mbs)
        inner = _inner(model)
        for i, mb in enumerate(mbs):
            sync = model.no_sync() if hasattr(model, "no_sync") and i < len(mbs) - 1 else _null()
            with sync:
                main, _ = ce_sum(model, mb)
                aux = aux_value(router_sums(inner, (mb[0] != PAD).reshape(-1)), TOP_K, counts)
                (w * main / n + aux_weight * w * aux).backward()
        optimizer.step()

    return step


def _per_micro_batch(*, divide_by_k: bool) -> object:
    def step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list) -> None:
        _per_micro_batch_step(model, optimizer, mbs, divide_by_k=divide_by_k)

    return step


def _main_mean_of_means_step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list) -> None:
    """The aux terms exact (the whole batch's statistics, x W), each micro-batch's token mean."""
    w, k = _world(), len(mbs)
    counts, _ = _counted(model, mbs)
    inner = _inner(model)
    for i, mb in enumerate(mbs):
        sync = model.no_sync() if hasattr(model, "no_sync") and i < k - 1 else _null()
        with sync:
            main, n = ce_sum(model, mb)
            aux = aux_value(router_sums(inner, (mb[0] != PAD).reshape(-1)), TOP_K, counts)
            (main / n.clamp(min=1) / k + w * aux).backward()
    optimizer.step()


def _per_micro_batch_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list, *, divide_by_k: bool = True
) -> None:
    w, k = _world(), len(mbs)
    items = torch.tensor(float(sum(int((y != IGNORE).sum()) for _, y in mbs)), dtype=torch.float64)
    n = float(_all_reduce(items))
    inner = _inner(model)
    for i, mb in enumerate(mbs):
        sync = model.no_sync() if hasattr(model, "no_sync") and i < k - 1 else _null()
        with sync:
            main, _ = ce_sum(model, mb)
            aux = aux_value(router_sums(inner, (mb[0] != PAD).reshape(-1)), TOP_K)  # its own f, T
            share = aux / k if divide_by_k else aux
            (w * main / n + share).backward()  # DDP's mean then averages the ranks' aux
    optimizer.step()


def _null() -> object:
    import contextlib

    return contextlib.nullcontext()


def _spec(step: object, *, aux: bool = True) -> VerifySpec:
    return VerifySpec(
        build_model=_model,
        batch=_batch(),
        step=step,  # type: ignore[arg-type]
        reference_loss=reference_loss,  # type: ignore[arg-type]
        aux_loss=aux_loss if aux else None,  # type: ignore[arg-type]
    )


def moe_exact() -> VerifySpec:
    """The Accumulator with the model's LoadBalancingLoss and RouterZLoss (passes)."""
    return _spec(_exact_step)


def moe_hand_exact() -> VerifySpec:
    """The counting pass by hand: the whole batch's fₑ and T, the aux share x W (passes)."""
    return _spec(_global_step(one_over_dp=False))


def moe_per_micro_batch() -> VerifySpec:
    """MISTAKE: every micro-batch's aux loss from its own tokens, averaged."""
    return _spec(_per_micro_batch(divide_by_k=True))


def moe_per_micro_batch_summed() -> VerifySpec:
    """MISTAKE: every micro-batch's own aux loss, summed over the K (no 1/K): K x the mean."""
    return _spec(_per_micro_batch(divide_by_k=False))


def moe_per_micro_batch_unnamed() -> VerifySpec:
    """`moe_per_micro_batch` with the spec not naming its aux_loss: verify cannot read it."""
    return _spec(_per_micro_batch(divide_by_k=True), aux=False)


def moe_main_mean_of_means() -> VerifySpec:
    """MISTAKE in the main term only: each micro-batch's token mean; the aux terms exact."""
    return _spec(_main_mean_of_means_step)


def moe_one_over_dp() -> VerifySpec:
    """MISTAKE: the whole batch's statistics, the aux gradient 1/W (Megatron before #3769)."""
    return _spec(_global_step(one_over_dp=True))


def _tp_fsdp(model: nn.Module, mesh: object) -> nn.Module:
    """dp2 x tp2: the MoE blocks replicated over tp (FSDP2 on dp), the head tensor parallel."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"hidden": ColwiseParallel(), "out": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)  # type: ignore[index]
    fully_shard(model, mesh=mesh["dp"])  # type: ignore[index]
    return model


def _on_mesh(step: object) -> VerifySpec:
    return dataclasses.replace(
        _spec(step), mesh="dp=2,tp=2", batch_dims=("dp",), parallelize=_tp_fsdp
    )


def moe_mesh_exact() -> VerifySpec:
    """`moe_exact` on dp2 x tp2 (FSDP2 on dp, the head tensor parallel; passes)."""
    return _on_mesh(_exact_step)


def moe_mesh_per_micro_batch() -> VerifySpec:
    """MISTAKE: `moe_per_micro_batch` on dp2 x tp2."""
    return _on_mesh(_per_micro_batch(divide_by_k=True))


def moe_mesh_one_over_dp() -> VerifySpec:
    """MISTAKE: `moe_one_over_dp` on dp2 x tp2: the aux gradient 1/dp."""
    return _on_mesh(_global_step(one_over_dp=True))
