"""Verify targets for issue 32 (verify round 4) on models written here, each with its mutation.

Each point's target, with the verdict verify must give (tests/e2e/test_verify_round4.py):

1. Parameters whose exact gradient is zero: a two-head encoder block whose keys
   have a bias and whose scores get a per-query bias (both shift the softmax's
   input by a constant along the keys: their exact gradient is zero, both sides
   hold round-off). Right in float64 and float32: PASS with rtol unset.
   MUTATIONS on the same model: a mean of per-micro-batch means; the value
   projection's bias left without gradient (it should move).
2. Precision verify could not see: a float64 model whose head is a custom
   `autograd.Function` doing `h.float() @ w.float().T`, the step under CPU
   bfloat16 autocast, the reference plain float64. Right: PASS (or round-off).
   MUTATION: a mean of means under the same autocast.
3. On a device mesh (dp2 x tp2, FSDP2 on dp, tensor parallel on tp), a loop that
   compensates FSDP's mean by dp x tp (tp times too large: `compensated-over-tp`);
   right: by dp. On "dp=2" (FSDP2 alone), each rank dividing by its own count
   (`mean-of-means`, read from the ranks' factors); right: the count agreed.

Legend: N rows, T tokens, D width, H heads, V vocabulary, W ranks, K micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tests.support.verify_corpus_own import HeadFunctionModel, plain_head_mean
from wholebatch.verify import VerifySpec, current_mesh

N, T, D, H, V = 20, 7, 12, 2, 17
Batch = dict[str, Tensor]
Step = Callable[[nn.Module, torch.optim.Optimizer, list[Batch]], None]


class ShiftBlock(nn.Module):
    """Embedding, self-attention whose keys carry a bias and whose scores a per-query bias, an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.qkv = nn.ModuleDict({n: nn.Linear(D, D) for n in ("query", "key", "value")})
        self.query_shift = nn.Linear(D, H)  # [N, T, H]: a constant per query along the keys
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, tokens_NT: Tensor, mask_NT: Tensor, frozen: str = "") -> Tensor:
        h_NTD = self.emb(tokens_NT)
        n, t, _ = h_NTD.shape

        def proj(name: str) -> Tensor:
            lin = self.qkv[name]
            bias = lin.bias.detach() if frozen == name else lin.bias
            return F.linear(h_NTD, lin.weight, bias).view(n, t, H, D // H).transpose(1, 2)

        q, k, v = proj("query"), proj("key"), proj("value")
        scores_NHTT = q @ k.transpose(-1, -2) / math.sqrt(D // H)
        scores_NHTT = scores_NHTT + self.query_shift(h_NTD).transpose(1, 2)[..., None]
        scores_NHTT = scores_NHTT.masked_fill(~mask_NT.bool()[:, None, None, :], -1e4)
        mixed = (scores_NHTT.softmax(-1) @ v).transpose(1, 2).reshape(n, t, D)
        h_NTD = self.norm(h_NTD + mixed)
        return self.head(h_NTD + self.mlp(h_NTD))


def tokens(seed: int = 41) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (N, T), generator=g)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return {"tokens": ids, "targets": torch.roll(ids, 1, 1) * mask, "mask": mask}


def token_sum(model: nn.Module, mb: Batch, frozen: str = "") -> tuple[Tensor, Tensor]:
    logits = model(mb["tokens"], mb["mask"], frozen) if frozen else model(mb["tokens"], mb["mask"])
    ce = F.cross_entropy(logits.flatten(0, 1).double(), mb["targets"].flatten(), reduction="none")
    mask = mb["mask"].flatten().to(ce.dtype)
    return (ce * mask).sum(), mask.sum()


def token_mean(model: nn.Module, batch: Batch) -> Tensor:
    total, count = token_sum(model, batch)
    return total / count


def _count(mbs: list[Batch]) -> Tensor:
    count = torch.stack([mb["mask"].sum() for mb in mbs]).sum().double()
    dist.all_reduce(count)
    return count


def _exact(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    count = _count(mbs)
    for mb in mbs:
        total, _ = token_sum(model, mb)
        (total / count * dist.get_world_size()).backward()
    opt.step()


def _mean_of_means(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    for mb in mbs:
        total, count = token_sum(model, mb)
        (total / count / len(mbs)).backward()
    opt.step()


def _frozen_value_bias(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    """The exact count, reduced by hand (DDP refuses a parameter without gradient), value bias detached."""
    count = _count(mbs)
    for mb in mbs:
        total, _ = token_sum(model, mb, frozen="value")
        (total / count).backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
    opt.step()


def _spec(step: Step, dtype: torch.dtype, wrap: Any = "ddp") -> VerifySpec:
    return VerifySpec(
        build_model=lambda: ShiftBlock().to(dtype), batch=tokens(), step=step,
        reference_loss=token_mean, count_items=lambda b: int(b["mask"].sum()), wrap=wrap,
    )  # fmt: skip


def shift_f64() -> VerifySpec:
    """Right, float64: key bias and query shift have an exact gradient of zero."""
    return _spec(_exact, torch.float64)


def shift_f32() -> VerifySpec:
    """Right, float32."""
    return _spec(_exact, torch.float32)


def shift_f64_mean_of_means() -> VerifySpec:
    """MUTATION: a mean of per-micro-batch token means on the same model."""
    return _spec(_mean_of_means, torch.float64)


def shift_f32_frozen_value_bias() -> VerifySpec:
    """MUTATION: the value projection's bias detached (it should move, it gets nothing)."""
    return _spec(_frozen_value_bias, torch.float32, wrap="none")


# ---------------------------------------------------------------------------
# 2. a float32 head Function on a float64 model, under CPU bfloat16 autocast
# ---------------------------------------------------------------------------


class Float32HeadBack(torch.autograd.Function):
    """logits = (h.float() @ w.float().T) in the input's dtype, as fused kernels return them.

    Nothing the step's outputs carry says the product ran in float32, let alone in
    bfloat16 under autocast. Backward: the product's gradient in float32, cast back.
    """

    @staticmethod
    def forward(ctx: Any, h_ND: Tensor, w_VD: Tensor) -> Tensor:
        ctx.save_for_backward(h_ND, w_VD)
        return (h_ND.float() @ w_VD.float().T).to(h_ND.dtype)

    @staticmethod
    def backward(ctx: Any, grad_NV: Tensor) -> tuple[Tensor, Tensor]:
        h_ND, w_VD = ctx.saved_tensors
        g = grad_NV.float()
        return (g @ w_VD.float()).to(h_ND.dtype), (g.T @ h_ND.float()).to(w_VD.dtype)


class CastBackHead(HeadFunctionModel):
    """`HeadFunctionModel` whose head Function returns float64 logits."""

    def forward(self, tokens_NT: Tensor, mask_NT: Tensor) -> Tensor:
        h_NTD = self.body(tokens_NT)
        logits = Float32HeadBack.apply(h_NTD.flatten(0, 1), self.head)
        return logits.view(*tokens_NT.shape, self.head.shape[0])


def _under_bf16(step: Step) -> Step:
    def under(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step(model, opt, mbs)

    return under


def _head_sum(model: nn.Module, mb: Batch) -> tuple[Tensor, Tensor]:
    logits = model(mb["tokens"], mb["mask"])
    ce = F.cross_entropy(logits.flatten(0, 1).float(), mb["targets"].flatten(), reduction="none")
    mask = mb["mask"].flatten().float()
    return (ce * mask).sum(), mask.sum()


def _head_exact(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    count = _count(mbs)
    for mb in mbs:
        total, _ = _head_sum(model, mb)
        (total / count * dist.get_world_size()).backward()
    opt.step()


def _head_mean_of_means(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    for mb in mbs:
        total, count = _head_sum(model, mb)
        (total / count / len(mbs)).backward()
    opt.step()


def _head_batch() -> Batch:
    from tests.support.verify_corpus_own import V as HEAD_V

    b = tokens(seed=43)
    return {k: v % HEAD_V if k != "mask" else v for k, v in b.items()}


def _head_spec(step: Step) -> VerifySpec:
    return VerifySpec(
        build_model=CastBackHead, batch=_head_batch(), step=_under_bf16(step),
        reference_loss=plain_head_mean, count_items=lambda b: int(b["mask"].sum()),
    )  # fmt: skip


def bf16_function() -> VerifySpec:
    """Right: the Function's float32 matmul runs in bfloat16 under the step's autocast."""
    return _head_spec(_head_exact)


def bf16_function_mean_of_means() -> VerifySpec:
    """MUTATION: a mean of means under the same autocast."""
    return _head_spec(_head_mean_of_means)


# ---------------------------------------------------------------------------
# 3. on a mesh: the mean compensated by dp x tp; each rank's own count
# ---------------------------------------------------------------------------


def _mesh_loop(count_over: str, by: Callable[[Any], float]) -> Step:
    """Token sums backward, then the gradients scaled by `by(mesh)` / the count (over dp, or own)."""

    def step(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
        mesh = current_mesh()
        items = torch.zeros((), dtype=torch.float64)
        for i, mb in enumerate(mbs):
            model.set_requires_gradient_sync(i == len(mbs) - 1)  # type: ignore[operator]
            total, n = token_sum(model, mb)
            total.backward()
            items += n
        if count_over == "dp":
            dist.all_reduce(items, group=mesh["dp"].get_group())
        scale = by(mesh) / float(items)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        opt.step()

    return step


def _tp_fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(model.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def _fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["dp"])
    return model


def _mesh_spec(step: Step, mesh: str, parallelize: Any) -> VerifySpec:
    return VerifySpec(
        build_model=lambda: ShiftBlock().double(), batch=tokens(seed=47), step=step,
        reference_loss=token_mean, count_items=lambda b: int(b["mask"].sum()), mesh=mesh,
        batch_dims=("dp",), parallelize=parallelize,
    )  # fmt: skip


def tp_by_dp() -> VerifySpec:
    """Right: dp2 x tp2, the count over dp, FSDP's mean undone by dp."""
    return _mesh_spec(_mesh_loop("dp", lambda m: float(m["dp"].size())), "dp=2,tp=2", _tp_fsdp)


def tp_by_world() -> VerifySpec:
    """MISTAKE: FSDP's mean over dp undone by dp x tp (the world): tp times too large."""
    return _mesh_spec(
        _mesh_loop("dp", lambda m: float(m["dp"].size() * m["tp"].size())), "dp=2,tp=2", _tp_fsdp
    )


def fsdp_counted() -> VerifySpec:
    """Right: FSDP2 on dp=2, the count agreed over dp."""
    return _mesh_spec(_mesh_loop("dp", lambda m: float(m["dp"].size())), "dp=2", _fsdp)


def fsdp_own_count() -> VerifySpec:
    """MISTAKE: FSDP2 on dp=2, each rank dividing by its own count."""
    return _mesh_spec(_mesh_loop("own", lambda m: float(m["dp"].size())), "dp=2", _fsdp)
