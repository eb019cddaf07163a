"""A tiny mixture-of-experts language model with whole-batch auxiliary losses, and its runs.

The model: embedding -> one MoE block (a router over E experts, top-1 or top-2, dense
expert compute, residual) under `torch.utils.checkpoint` -> tanh(hidden) -> vocabulary
logits. The block passes its output through `LoadBalancingLoss` and `RouterZLoss`
(`wholebatch.train.auxloss`) and keeps its router's outputs on `block_out`, so the
hand-written loops and the reference can compute the auxiliary losses themselves.

The whole batch's objective (one process, `reference`): the token mean of the
cross-entropy over the N target tokens, plus α·E·Σₑ fₑ·Pₑ and β·mean_t lse_t² over
the T real (non-padding) input tokens, written out here (not the library's formula).

Steps (`run_flat` on W = 2 ranks with DDP, `run_mesh` on dp2 x tp2 with FSDP2 on dp and
tensor parallel on the head), each two SGD steps of K = 3 ragged micro-batches per
rank (an empty one), float64:
- "accumulator": `Accumulator.step` (exact);
- "hand": the same counting pass written by hand (the benchmark's baseline; exact);
- "per_micro_batch": every micro-batch's own aux loss, averaged over K x W (the loss
  most frameworks compute), the main loss exact;
- "one_over_dp": the whole batch's statistics but the gradient 1/W too small
  (Megatron-LM's global aux loss before PR #3769), through the Accumulator.

Legend: S sequences, T tokens (flattened S x width), E experts, k experts per token.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tests.support.mesh_cases import WIDTH, MeshCase, Piece, _sequences, ragged_steps, read_params
from tests.support.models import IGNORE, PAD, VOCAB, micro_batch
from wholebatch.train.auxloss import LoadBalancingLoss, RouterZLoss

E = 4
D = 6
ALPHA = 0.5  # large, so the auxiliary terms move the gradient visibly
BETA = 0.05
LR = 0.5

FLAT = MeshCase(shape=(("dp", 2),), batch_dims=("dp",), steps=ragged_steps(2, 3, 2, seed=7))
MESH = MeshCase(
    shape=(("dp", 2), ("tp", 2)), batch_dims=("dp",), steps=ragged_steps(2, 3, 2, seed=8)
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoECase:
    case: MeshCase = FLAT
    top_k: int = 1
    reentrant: bool = False  # torch.utils.checkpoint's use_reentrant
    engine: str = "accumulator"
    steps: int | None = None  # None: every step of the case (the bench runs more)
    blocks: int = 1  # MoE blocks, each with its own router and terms


class OneOverDp(LoadBalancingLoss):
    """MUTATION: the whole batch's fₑ and T, the gradient 1/W too small (Megatron #3769)."""

    def coefficients(self, counts: Tensor) -> Tensor:
        return super().coefficients(counts) / (dist.get_world_size() // _tp())


class ZOneOverDp(RouterZLoss):
    def coefficients(self, counts: Tensor) -> Tensor:
        return super().coefficients(counts) / (dist.get_world_size() // _tp())


_TP = {"tp": 1}


def _tp() -> int:
    return _TP["tp"]


class MoEBlock(nn.Module):
    """A router over E experts (top-k), dense expert compute, residual; its aux terms."""

    def __init__(self, dim: int, experts: int, top_k: int, one_over_dp: bool) -> None:
        super().__init__()
        self.dim, self.top_k = dim, top_k
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.balance = (OneOverDp if one_over_dp else LoadBalancingLoss)(
            experts, top_k=top_k, alpha=ALPHA
        )
        self.z = (ZOneOverDp if one_over_dp else RouterZLoss)(beta=BETA)
        self.block_out: dict[str, Tensor] = {}

    def forward(self, h_TD: Tensor, mask_T: Tensor) -> Tensor:
        logits_TE = self.router(h_TD)
        probs_TE = logits_TE.softmax(-1)
        top_TK = probs_TE.topk(self.top_k, dim=-1)
        weights_TK = top_TK.values / top_TK.values.sum(-1, keepdim=True)
        every_TED = torch.stack([torch.tanh(x(h_TD)) for x in self.experts], 1)
        picked_TKD = every_TED.gather(1, top_TK.indices[..., None].expand(-1, -1, self.dim))
        out_TD = (weights_TK[..., None] * picked_TKD).sum(1)
        self.block_out = {"logits": logits_TE, "probs": probs_TE, "top": top_TK.indices}
        out_TD = self.balance(out_TD, probs_TE, top_TK.indices, mask_T)
        out_TD = self.z(out_TD, logits_TE, mask_T)
        return h_TD + out_TD


class TinyMoE(nn.Module):
    """Embedding -> `blocks` MoE blocks (each under checkpointing) -> tanh(hidden) -> logits."""

    def __init__(
        self,
        top_k: int = 1,
        *,
        reentrant: bool = False,
        one_over_dp: bool = False,
        checkpointed: bool = True,
        experts: int = E,
        dim: int = D,
        vocab: int = VOCAB,
        blocks: int = 1,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.top_k, self.reentrant, self.checkpointed = top_k, reentrant, checkpointed
        self.dim = dim
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            MoEBlock(dim, experts, top_k, one_over_dp) for _ in range(blocks)
        )
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * min(0.5, dim**-0.5))
        self.to(dtype)

    def trunk(self, tokens_ST: Tensor) -> Tensor:
        """Up to the last router's block: [S*T, D]."""
        s, t = tokens_ST.shape
        h_TD = self.emb(tokens_ST).reshape(s * t, self.dim)
        mask_T = (tokens_ST != PAD).reshape(-1)
        for block in self.layers:
            if self.checkpointed:
                h_TD = checkpoint(block, h_TD, mask_T, use_reentrant=self.reentrant)
            else:
                h_TD = block(h_TD, mask_T)
        return h_TD

    def forward(self, tokens_ST: Tensor) -> Tensor:
        s, t = tokens_ST.shape
        h_TD = self.trunk(tokens_ST)
        logits_STV: Tensor = self.out(torch.tanh(self.hidden(h_TD))).reshape(s, t, -1)
        return logits_STV


def ce_sum(model: nn.Module, mb: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    tokens, targets = mb
    logits = model(tokens)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).double(),
        targets.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return loss, (targets != IGNORE).sum()


def router_sums(model: TinyMoE, mask_T: Tensor) -> list[dict[str, Tensor]]:
    """Each block's router statistics of one forward: counts_E, T (no gradient), S_E, Z."""
    m = mask_T.to(torch.float64)
    out = []
    for block in model.layers:
        got = block.block_out
        hits = F.one_hot(got["top"], got["probs"].shape[-1]).to(torch.float64).sum(1)  # [T, E]
        out.append({
            "counts": (hits * m[:, None]).sum(0).detach(),
            "tokens": m.sum().detach(),
            "S": (got["probs"] * m[:, None]).sum(0),
            "Z": (torch.logsumexp(got["logits"], -1).square() * m).sum(),
        })  # fmt: skip
    return out


def _pack(stats: list[dict[str, Tensor]]) -> Tensor:
    """Every block's (counts_E, T), concatenated: the numbers a step agrees."""
    return torch.cat([torch.cat([st["counts"], st["tokens"].reshape(1)]) for st in stats])


def aux_value(stats: list[dict[str, Tensor]], top_k: int, totals: Tensor | None = None) -> Tensor:
    """Σ over blocks of α·E·Σₑ fₑ·Pₑ + β·mean lse², fₑ and T from `totals` (`_pack`ed; None:
    these stats' own), S and Z from `stats`."""
    packed = _pack(stats) if totals is None else totals
    total = torch.zeros((), dtype=torch.float64)
    at = 0
    for st in stats:
        e = st["counts"].numel()
        counts, tokens = packed[at : at + e], packed[at + e].clamp(min=1)  # empty: S = Z = 0
        at += e + 1
        f = counts / (top_k * tokens)
        total = total + ALPHA * e * (f * st["S"]).sum() / tokens + BETA * st["Z"] / tokens
    return total


@dataclasses.dataclass
class Result:
    params: dict[str, Tensor | Piece]  # `mesh_cases.read_params`
    losses: list[float]
    aux: list[float]
    seconds: list[float]


def _batches(case: MeshCase, s: int, shard: int) -> list[tuple[Tensor, Tensor]]:
    return [micro_batch(mb, width=WIDTH) for mb in _sequences(case, s)[shard]]


def reference(mc: MoECase) -> Result:
    """One process, each step's whole batch in one forward."""
    model = TinyMoE(mc.top_k, blocks=mc.blocks)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, auxes = [], []
    for s in range(len(mc.case.steps)):
        mbs = [mb for b in range(len(mc.case.steps[s])) for mb in _batches(mc.case, s, b)]
        tokens = torch.cat([t for t, _ in mbs])
        targets = torch.cat([y for _, y in mbs])
        main, n = ce_sum(model, (tokens, targets))
        aux = aux_value(router_sums(model, (tokens != PAD).reshape(-1)), mc.top_k)
        loss = main / n + aux
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        auxes.append(float(aux.detach()))
    return Result({k: v.detach().clone() for k, v in model.named_parameters()}, losses, auxes, [])


def _full(model: nn.Module) -> dict[str, Tensor | Piece]:
    # local pieces, not full_tensor(): torch 2.8 reads the head's 6 hidden rows over dp 2 x
    # tp 2 back wrong (`mesh_cases.read_params`)
    return read_params(model)


def _steps(mc: MoECase) -> int:
    return len(mc.case.steps) if mc.steps is None else mc.steps


def run_flat(mc: MoECase) -> Result:
    """W = 2 ranks, DDP over the world, this rank's K micro-batches per step."""
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    _TP["tp"] = 1
    model = TinyMoE(
        mc.top_k,
        reentrant=mc.reentrant,
        one_over_dp=mc.engine == "one_over_dp",
        blocks=mc.blocks,
    )
    ddp = DDP(model)
    try:
        return _train(mc, ddp, model, dist.get_rank(), None)
    finally:
        del ddp
        gc.collect()


def run_mesh(mc: MoECase) -> Result:
    """dp2 x tp2: the MoE block replicated over tp (FSDP2 on dp), the head tensor parallel."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from tests.support.mesh_cases import get_mesh
    from wholebatch.comm.mesh import MeshSplit

    mesh = get_mesh(mc.case.shape)
    _TP["tp"] = 2
    model = TinyMoE(
        mc.top_k,
        reentrant=mc.reentrant,
        one_over_dp=mc.engine == "one_over_dp",
        blocks=mc.blocks,
    )
    parallelize_module(model, mesh["tp"], {"hidden": ColwiseParallel(), "out": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    dp = MeshSplit(mesh=mesh, batch_dims=("dp",)).coordinate()["dp"]
    return _train(mc, model, model, dp, mesh)


def _train(mc: MoECase, wrapped: nn.Module, model: TinyMoE, shard: int, mesh: Any) -> Result:
    from wholebatch.train.accumulate import Accumulator

    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    acc = None
    if mc.engine in ("accumulator", "one_over_dp"):
        where = {} if mesh is None else {"mesh": mesh, "batch_dims": ("dp",)}
        acc = Accumulator(wrapped, opt, **where)
    losses, auxes, seconds = [], [], []
    for s in range(_steps(mc)):
        mbs = _batches(mc.case, s % len(mc.case.steps), shard)
        t0 = time.perf_counter()
        if acc is not None:
            st = acc.step(mbs, ce_sum)
            losses.append(st.loss)
            auxes.append(sum(st.aux.values()))
        else:
            loss, aux = _HAND[mc.engine](mc, wrapped, model, opt, mbs, mesh)
            losses.append(loss)
            auxes.append(aux)
        seconds.append(time.perf_counter() - t0)
    return Result(_full(wrapped), losses, auxes, seconds)


def _groups(mesh: Any) -> tuple[Any, int, int]:
    """(the data-parallel group, its size, the wrapper's mean divisor's batch factor)."""
    if mesh is None:
        return None, dist.get_world_size(), dist.get_world_size()
    return mesh["dp"].get_group(), 2, 2


def _reduce(values: Tensor, mesh: Any) -> Tensor:
    group, _, _ = _groups(mesh)
    dist.all_reduce(values, group=group)
    return values


def _n_items(mbs: list[tuple[Tensor, Tensor]], mesh: Any) -> float:
    """N from the targets themselves (they need no forward), summed over the data shards."""
    n = torch.tensor(float(sum(int((y != IGNORE).sum()) for _, y in mbs)), dtype=torch.float64)
    return float(_reduce(n, mesh))


def _hand_per_micro_batch(
    mc: MoECase, wrapped: nn.Module, model: TinyMoE, opt: Any, mbs: list[Any], mesh: Any
) -> tuple[float, float]:
    """The main loss exact; every micro-batch's aux loss from its own tokens, / (K x W)."""
    _, w, factor = _groups(mesh)
    n = _n_items(mbs, mesh)
    k = len(mbs)
    total_aux = 0.0
    for i, mb in enumerate(mbs):
        ctx = wrapped.no_sync() if hasattr(wrapped, "no_sync") and i < k - 1 else _null()
        _sync(wrapped, i == k - 1)
        with ctx:
            main, _ = ce_sum(wrapped, mb)
            aux = aux_value(router_sums(model, (mb[0] != PAD).reshape(-1)), mc.top_k)
            (factor * main / n + factor * aux / (k * w)).backward()
        total_aux += float(aux.detach()) / k
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float("nan"), float(_reduce(torch.tensor(total_aux, dtype=torch.float64), mesh)) / w


def _hand_exact(
    mc: MoECase, wrapped: nn.Module, model: TinyMoE, opt: Any, mbs: list[Any], mesh: Any
) -> tuple[float, float]:
    """The counting pass written by hand: the routers' counts of every micro-batch (no
    graph; the last one's graph kept), all-reduced with the items, then every micro-batch
    back-propagates factor x (its loss sum / N + its aux share with the whole batch's f, T).
    No RNG to replay: the model draws none."""
    _, _, factor = _groups(mesh)
    k = len(mbs)
    totals: Tensor | None = None  # every block's (counts_E, T), then N
    kept = None
    for i, mb in enumerate(mbs):
        last = i == k - 1
        ctx = wrapped.no_sync() if hasattr(wrapped, "no_sync") and last and k > 1 else _null()
        with ctx, torch.set_grad_enabled(last):
            main, n_i = ce_sum(wrapped, mb)
            st = router_sums(model, (mb[0] != PAD).reshape(-1))
        row = torch.cat([_pack(st), n_i.reshape(1).double()])
        totals = row if totals is None else totals + row
        if last:
            kept = (main, st)
    assert totals is not None
    totals = _reduce(totals, mesh)
    n = float(totals[-1])

    def objective(main: Tensor, st: list[dict[str, Tensor]]) -> Tensor:
        return factor * (main / n + aux_value(st, mc.top_k, totals[:-1]))

    assert kept is not None
    _sync(wrapped, k == 1)
    objective(*kept).backward()
    for i in range(k - 1):
        last = i == k - 2
        _sync(wrapped, last)
        ctx = wrapped.no_sync() if hasattr(wrapped, "no_sync") and not last else _null()
        with ctx:
            main, _ = ce_sum(wrapped, mbs[i])
            objective(main, router_sums(model, (mbs[i][0] != PAD).reshape(-1))).backward()
    _sync(wrapped, True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float("nan"), float("nan")


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _sync(wrapped: nn.Module, on: bool) -> None:
    setter = getattr(wrapped, "set_requires_gradient_sync", None)  # FSDP2
    if setter is not None:
        setter(on)


_HAND = {"per_micro_batch": _hand_per_micro_batch, "hand": _hand_exact}
