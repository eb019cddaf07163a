"""Verify corpus, round 4: loops written here, on models whose gradients verify misjudged.

- An attention block with key biases (`k.bias`): softmax is shift-invariant, so
  the exact gradient of a key bias is zero and both sides hold round-off only.
  Float64 and float32; the right step, the classic mistakes on it (a mean of
  means, DDP's 1/W left in, a step per micro-batch) and one that leaves a
  parameter that should move without its gradient (`o.bias` detached).
- A float64 token model whose head is a custom `autograd.Function` computing
  `h.float() @ w.float().T`: under CPU bfloat16 autocast that matmul runs in
  bfloat16 inside the Function, which no output dtype shows; the reference is
  plain float64 math (autocast leaves float64 alone). Right, and a mean of means.

Every batch is ragged (1..T valid tokens per row), so a per-micro-batch mean differs.

Legend: N rows, T tokens per row, D width, H heads, V vocabulary, W ranks, K micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from wholebatch.verify import VerifySpec

N, T, D, H, V = 18, 6, 8, 2, 13
Batch = dict[str, Tensor]
Step = Callable[[nn.Module, torch.optim.Optimizer, list[Batch]], None]


class KeyBiasAttention(nn.Module):
    """Embedding, one self-attention block (q, k, v, o with biases), LayerNorm, vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, tokens_NT: Tensor, mask_NT: Tensor, detach_o_bias: bool = False) -> Tensor:
        h_NTD = self.emb(tokens_NT)
        n, t, _ = h_NTD.shape

        def heads(x: Tensor) -> Tensor:  # [N, T, D] -> [N, H, T, D/H]
            return x.view(n, t, H, D // H).transpose(1, 2)

        q, k, v = heads(self.q(h_NTD)), heads(self.k(h_NTD)), heads(self.v(h_NTD))
        scores_NHTT = q @ k.transpose(-1, -2) / math.sqrt(D // H)
        scores_NHTT = scores_NHTT.masked_fill(~mask_NT.bool()[:, None, None, :], -1e4)
        mixed_NTD = (scores_NHTT.softmax(-1) @ v).transpose(1, 2).reshape(n, t, D)
        bias = self.o.bias.detach() if detach_o_bias else self.o.bias
        out_NTD = F.linear(mixed_NTD, self.o.weight, bias)
        return self.head(self.norm(h_NTD + out_NTD))


def token_batch(seed: int = 3) -> Batch:
    """N rows of 1..T valid tokens (mask), the targets the tokens shifted by one."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (N, T), generator=g)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return {"tokens": tokens, "targets": torch.roll(tokens, -1, 1) * mask, "mask": mask}


def token_sum(model: nn.Module, mb: Batch, **kw: Any) -> tuple[Tensor, Tensor]:
    """(sum of the valid tokens' cross-entropy, their number)."""
    logits_NTV = model(mb["tokens"], mb["mask"], **kw)
    ce = F.cross_entropy(
        logits_NTV.flatten(0, 1).double(), mb["targets"].flatten(), reduction="none"
    )
    mask = mb["mask"].flatten().to(ce.dtype)
    return (ce * mask).sum(), mask.sum()


def token_mean(model: nn.Module, batch: Batch) -> Tensor:
    total, count = token_sum(model, batch)
    return total / count


def _global_count(mbs: list[Batch]) -> Tensor:
    count = torch.stack([mb["mask"].sum() for mb in mbs]).sum().double()
    dist.all_reduce(count)
    return count


def _global_step(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch], **kw: Any) -> None:
    """Right: every micro-batch's token sum over the step's global count, x W for DDP's mean."""
    count = _global_count(mbs)
    for mb in mbs:
        total, _ = token_sum(model, mb, **kw)
        (total / count * dist.get_world_size()).backward()
    opt.step()
    opt.zero_grad()


def _mean_of_means_step(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    for mb in mbs:
        total, count = token_sum(model, mb)
        (total / count / len(mbs)).backward()
    opt.step()
    opt.zero_grad()


def _uncompensated_step(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    count = _global_count(mbs)
    for mb in mbs:
        total, _ = token_sum(model, mb)
        (total / count).backward()  # DDP's mean divides by W once more
    opt.step()
    opt.zero_grad()


def _step_per_micro_batch(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    count = _global_count(mbs)
    for mb in mbs:
        total, _ = token_sum(model, mb)
        (total / count * dist.get_world_size()).backward()
        opt.step()
        opt.zero_grad()


def _detached_step(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    """A hand-reduced loop (no DDP: it would refuse the unused parameter) with o.bias detached."""
    count = _global_count(mbs)
    for mb in mbs:
        total, _ = token_sum(model, mb, detach_o_bias=True)
        total.div(count).backward()
    for p in model.parameters():
        if p.grad is not None:  # the sum over ranks: each rank's share of the global mean
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()


def _attention(dtype: torch.dtype) -> Callable[[], nn.Module]:
    return lambda: KeyBiasAttention().to(dtype)


def _spec(step: Step, dtype: torch.dtype = torch.float64, wrap: str = "ddp") -> VerifySpec:
    return VerifySpec(
        build_model=_attention(dtype), batch=token_batch(), step=step, reference_loss=token_mean,
        count_items=lambda b: int(b["mask"].sum()), wrap=wrap,  # type: ignore[arg-type]
    )  # fmt: skip


def attn_f64_global() -> VerifySpec:
    """Right, float64: the key biases' exact gradient is zero."""
    return _spec(_global_step)


def attn_f32_global() -> VerifySpec:
    """Right, float32."""
    return _spec(_global_step, torch.float32)


def attn_f64_mean_of_means() -> VerifySpec:
    """MISTAKE: each micro-batch's token mean, averaged."""
    return _spec(_mean_of_means_step)


def attn_f32_mean_of_means() -> VerifySpec:
    """MISTAKE, float32: each micro-batch's token mean, averaged."""
    return _spec(_mean_of_means_step, torch.float32)


def attn_f64_uncompensated() -> VerifySpec:
    """MISTAKE: the global count, but DDP's mean over W not undone (1/W)."""
    return _spec(_uncompensated_step)


def attn_f64_step_per_micro_batch() -> VerifySpec:
    """MISTAKE: optimizer.step() after every micro-batch."""
    return _spec(_step_per_micro_batch)


def attn_f64_detached_bias() -> VerifySpec:
    """MISTAKE: the output projection's bias detached in the step (it should move, gets nothing)."""
    return _spec(_detached_step, wrap="none")


# ---------------------------------------------------------------------------
# A float64 model with a float32 head inside a custom autograd.Function
# ---------------------------------------------------------------------------


class Float32Head(torch.autograd.Function):
    """logits = h.float() @ w.float().T: a float32 head on a float64 model (a fused-kernel stand-in).

    Backward: the two float32 matmuls of the product's gradient, cast back to the inputs' dtypes.
    Under CPU autocast the forward's matmul runs in bfloat16 (a float32 matmul is autocast-eligible).
    """

    @staticmethod
    def forward(ctx: Any, h_ND: Tensor, w_VD: Tensor) -> Tensor:
        ctx.save_for_backward(h_ND, w_VD)
        return h_ND.float() @ w_VD.float().T

    @staticmethod
    def backward(ctx: Any, grad_NV: Tensor) -> tuple[Tensor, Tensor]:
        h_ND, w_VD = ctx.saved_tensors
        g = grad_NV.float()
        return (g @ w_VD.float()).to(h_ND.dtype), (g.T @ h_ND.float()).to(w_VD.dtype)


class HeadFunctionModel(nn.Module):
    """Embedding and a tanh layer in float64, the vocabulary head through `Float32Head`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Parameter(torch.randn(V, D) / math.sqrt(D))
        self.double()

    def body(self, tokens_NT: Tensor) -> Tensor:
        return torch.tanh(self.mix(self.emb(tokens_NT)))

    def forward(self, tokens_NT: Tensor, mask_NT: Tensor) -> Tensor:
        h_NTD = self.body(tokens_NT)
        return Float32Head.apply(h_NTD.flatten(0, 1), self.head).view(*tokens_NT.shape, V)


def plain_head_mean(model: nn.Module, batch: Batch) -> Tensor:
    """The reference: the same model, its head as plain float64 math."""
    logits_NTV = model.body(batch["tokens"]) @ model.head.T
    ce = F.cross_entropy(logits_NTV.flatten(0, 1), batch["targets"].flatten(), reduction="none")
    mask = batch["mask"].flatten().double()
    return (ce * mask).sum() / mask.sum()


def _autocast(step: Step) -> Step:
    def under(model: nn.Module, opt: torch.optim.Optimizer, mbs: list[Batch]) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step(model, opt, mbs)

    return under


def _head_spec(step: Step) -> VerifySpec:
    return VerifySpec(
        build_model=HeadFunctionModel, batch=token_batch(seed=5), step=_autocast(step),
        reference_loss=plain_head_mean, count_items=lambda b: int(b["mask"].sum()),
    )  # fmt: skip


def bf16_head_global() -> VerifySpec:
    """Right: the global-count step, its Function head in bfloat16 under autocast."""
    return _head_spec(_global_step)


def bf16_head_mean_of_means() -> VerifySpec:
    """MISTAKE under the same autocast: a mean of per-micro-batch token means."""
    return _head_spec(_mean_of_means_step)
