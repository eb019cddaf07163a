"""Verify targets for issue 25 (verify round 3), on models written here, unlike the examples.

Each point's target, with the verdict verify must give (tests/e2e/test_verify_round3.py):

1. autocast: a float32 MLP (a LayerNorm inside) under a reentrant activation
   checkpoint (its forward runs without gradient) inside
   `torch.autocast("cpu", bfloat16)` (and float16), the reference plain float32.
   Right: PASS at the tolerance bfloat16 implies. MUTATION: the same autocast step
   with a per-micro-batch mean on ragged rows fails.
2. several causes at once: two towers trained as open_clip_train's accum_freq loop
   does (features cached without gradient, each micro-batch re-encoded, the loss
   taken once per micro-batch) through a gather without gradient: the towers get
   1/W, `logit_scale` K times; with dropout the re-encoding draws new masks too.
3. GatherLayer: a custom autograd Function whose forward calls dist.all_gather
   and whose backward returns only the local slice (1/W). Right: the same
   Function whose backward all-reduces first (PASS).
4. checkpoint(preserve_rng_state=False) around dropout, with a ragged token mean
   and an equal_batch: only the dropout differs.
5. a loop that owns the split (a TrainerSpec) and pads each micro-batch to its own
   longest row, normalising per micro-batch: rows are matched by content; a loop
   that feeds the model rows verify cannot recognise says so.

Legend: W ranks, K micro-batches per rank, B rows, D dim, T tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from wholebatch.verify.spec import TrainerRun, TrainerSpec, VerifySpec

ROWS, D_IN, DIM = 18, 6, 8
Pairs = dict[str, Tensor]


# ---------------------------------------------------------------------------
# 1. autocast
# ---------------------------------------------------------------------------


class Mlp(nn.Module):
    """x * scale, then an MLP under a reentrant checkpoint (its forward runs without grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D_IN))
        self.net = nn.Sequential(
            nn.Linear(D_IN, 16),
            nn.LayerNorm(16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.Tanh(),
            nn.Linear(16, 1),
        )

    def forward(self, x_BD: Tensor) -> Tensor:
        return checkpoint(self.net, x_BD * self.scale, use_reentrant=True).squeeze(-1)


def _regression() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, D_IN, generator=g)
    y = torch.randn(ROWS, generator=g)
    weight = torch.randint(1, 6, (ROWS,), generator=g).float()  # items per row: ragged
    return x, y, weight


def _weighted_sum(model: nn.Module, mb: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    x, y, w = mb
    err = (model(x).float() - y) ** 2
    return (w * err).sum(), w.sum()


def _weighted_mean(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    total, count = _weighted_sum(model, batch)
    return total / count


def _autocast_step(dtype: torch.dtype, per_micro_batch: bool) -> Callable[..., None]:
    def step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list) -> None:  # type: ignore[type-arg]
        count = torch.stack([mb[2].sum() for mb in mbs]).sum()
        dist.all_reduce(count)
        w = dist.get_world_size()
        for mb in mbs:
            with torch.autocast("cpu", dtype=dtype):
                total, n = _weighted_sum(model, mb)
            loss = total / n / len(mbs) if per_micro_batch else total / count * w
            loss.backward()
        for p in model.parameters():  # DDP's mean by hand (DDP and reentrant checkpoints clash)
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= w
        optimizer.step()
        optimizer.zero_grad()

    return step


def _autocast_spec(dtype: torch.dtype, per_micro_batch: bool = False) -> VerifySpec:
    return VerifySpec(
        build_model=Mlp, batch=_regression(), step=_autocast_step(dtype, per_micro_batch),
        reference_loss=_weighted_mean, wrap="none", count_items=lambda b: b[2].sum(),
    )  # fmt: skip


def autocast_bf16() -> VerifySpec:
    """Right, under CPU bfloat16 autocast (float32 model, float32 reference)."""
    return _autocast_spec(torch.bfloat16)


def autocast_fp16() -> VerifySpec:
    """Right, under CPU float16 autocast."""
    return _autocast_spec(torch.float16)


def autocast_bf16_mean_of_means() -> VerifySpec:
    """MISTAKE under bfloat16 autocast: each micro-batch divides by its own weight sum."""
    return _autocast_spec(torch.bfloat16, per_micro_batch=True)


# ---------------------------------------------------------------------------
# 2 and 3: two towers, CLIP loss over the global batch
# ---------------------------------------------------------------------------


class Towers(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()

        def tower() -> nn.Sequential:
            layers: list[nn.Module] = [nn.Linear(D_IN, DIM), nn.GELU()]
            layers += [nn.Dropout(dropout)] if dropout else []
            return nn.Sequential(*layers, nn.Linear(DIM, DIM))

        self.image, self.text = tower(), tower()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(5.0)))
        self.double()

    def forward(self, image: Tensor, text: Tensor) -> tuple[Tensor, Tensor]:
        return F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1)


def _pairs() -> Pairs:
    g = torch.Generator().manual_seed(23)
    return {
        "image": torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64),
        "text": torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64),
    }


def _clip(img_ND: Tensor, txt_ND: Tensor, logit_scale: Tensor) -> Tensor:
    logits_NN = logit_scale.exp() * img_ND @ txt_ND.T
    labels = torch.arange(len(img_ND))
    return (F.cross_entropy(logits_NN, labels) + F.cross_entropy(logits_NN.T, labels)) / 2


def clip_reference(model: nn.Module, batch: Pairs) -> Tensor:
    img, txt = model(batch["image"], batch["text"])
    return _clip(img, txt, model.logit_scale)


def _inner(model: nn.Module) -> Towers:
    inner = model.module if hasattr(model, "module") else model
    assert isinstance(inner, Towers)
    return inner


def _gather_no_grad(x_BD: Tensor) -> Tensor:
    """dist.all_gather (no gradient), this rank's slice put back (open_clip's default)."""
    parts = [torch.empty_like(x_BD) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x_BD)
    parts[dist.get_rank()] = x_BD
    return torch.cat(parts)


def _accum_freq_step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Pairs]) -> None:
    """open_clip_train's accum_freq > 1 loop, with open_clip's default gather (no gradient)."""
    with torch.no_grad():
        cached = [model(mb["image"], mb["text"]) for mb in mbs]
    for j, mb in enumerate(mbs):
        img, txt = model(mb["image"], mb["text"])
        imgs = torch.cat([c[0] for c in cached[:j]] + [img] + [c[0] for c in cached[j + 1 :]])
        txts = torch.cat([c[1] for c in cached[:j]] + [txt] + [c[1] for c in cached[j + 1 :]])
        loss = _clip(_gather_no_grad(imgs), _gather_no_grad(txts), _inner(model).logit_scale)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def accum_freq_gather() -> VerifySpec:
    """MISTAKES: towers at 1/W (gather without gradient), logit_scale at K (loss per micro-batch)."""
    return VerifySpec(
        build_model=Towers, batch=_pairs(), step=_accum_freq_step, reference_loss=clip_reference
    )


def accum_freq_gather_dropout() -> VerifySpec:
    """MISTAKES: the same with dropout in the towers, so the re-encoding draws new masks too."""
    return VerifySpec(
        build_model=lambda: Towers(dropout=0.2), batch=_pairs(), step=_accum_freq_step,
        reference_loss=clip_reference,
    )  # fmt: skip


class LocalSliceGather(torch.autograd.Function):
    """The classic GatherLayer: all_gather in forward, backward keeps only this rank's slice."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x_BD: Tensor) -> Tensor:
        parts = [torch.empty_like(x_BD) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x_BD.contiguous())
        ctx.rows = x_BD.shape[0]  # type: ignore[attr-defined]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_ND: Tensor) -> Tensor:
        rows = ctx.rows  # type: ignore[attr-defined]
        start = dist.get_rank() * rows
        return grad_ND[start : start + rows]


class SummedGather(torch.autograd.Function):
    """A right GatherLayer: backward all-reduces (sum) the gradient, then takes this rank's slice."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x_BD: Tensor) -> Tensor:
        parts = [torch.empty_like(x_BD) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x_BD.contiguous())
        ctx.rows = x_BD.shape[0]  # type: ignore[attr-defined]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_ND: Tensor) -> Tensor:
        grad_ND = grad_ND.contiguous()
        dist.all_reduce(grad_ND)
        rows = ctx.rows  # type: ignore[attr-defined]
        start = dist.get_rank() * rows
        return grad_ND[start : start + rows]


def _gather_layer_step(layer: type[torch.autograd.Function]) -> Callable[..., None]:
    def step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Pairs]) -> None:
        # one micro-batch per rank of equal rows (the gather needs equal sizes): K = 1
        img, txt = model(torch.cat([m["image"] for m in mbs]), torch.cat([m["text"] for m in mbs]))
        loss = _clip(layer.apply(img), layer.apply(txt), _inner(model).logit_scale)
        # every rank computes the whole loss; DDP averages the W copies
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def gather_layer_local_slice() -> VerifySpec:
    """MISTAKE: a GatherLayer whose backward keeps only the local slice."""
    return VerifySpec(
        build_model=Towers, batch=_pairs(), step=_gather_layer_step(LocalSliceGather),
        reference_loss=clip_reference,
    )  # fmt: skip


def gather_layer_summed() -> VerifySpec:
    """Right: the GatherLayer all-reduces its gradient before slicing."""
    return VerifySpec(
        build_model=Towers, batch=_pairs(), step=_gather_layer_step(SummedGather),
        reference_loss=clip_reference,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# 4. checkpointed dropout without RNG replay
# ---------------------------------------------------------------------------

SEQ, VOCAB = 6, 11


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Dropout(0.3))
        self.out = nn.Linear(2 * DIM, VOCAB)
        self.double()

    def forward(self, tokens_BT: Tensor) -> Tensor:
        h = checkpoint(self.mix, self.emb(tokens_BT), use_reentrant=False, preserve_rng_state=False)
        return self.out(h)


def _tokens(ragged: bool) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(31)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (ROWS,), generator=g) if ragged else torch.full((ROWS,), 4)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).double()
    return {"tokens": tokens, "targets": targets, "mask": mask}


def _token_sum(model: nn.Module, mb: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    logits = model(mb["tokens"])
    ce = F.cross_entropy(logits.flatten(0, 1), mb["targets"].flatten(), reduction="none")
    return (ce * mb["mask"].flatten()).sum(), mb["mask"].sum()


def token_mean(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    total, count = _token_sum(model, batch)
    return total / count


def _global_token_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[dict[str, Tensor]]
) -> None:
    count = torch.stack([mb["mask"].sum() for mb in mbs]).sum()
    dist.all_reduce(count)
    for mb in mbs:
        total, _ = _token_sum(model, mb)
        (total / count * dist.get_world_size()).backward()
    optimizer.step()
    optimizer.zero_grad()


def checkpoint_no_rng_tokens() -> VerifySpec:
    """MISTAKE: right normalisation, but checkpoint(preserve_rng_state=False) around dropout."""
    return VerifySpec(
        build_model=Tagger, batch=_tokens(ragged=True), equal_batch=_tokens(ragged=False),
        step=_global_token_step, reference_loss=token_mean,
        count_items=lambda b: b["mask"].sum(),
    )  # fmt: skip


# ---------------------------------------------------------------------------
# 5. a loop that pads each micro-batch to its own longest row
# ---------------------------------------------------------------------------

PAD = 0


class Lm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.out = nn.Linear(DIM, VOCAB)
        self.double()

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.emb(input_ids) * attention_mask[..., None]
        return self.out(torch.tanh(h.cumsum(1)))


def _lm_batch() -> dict[str, Tensor]:
    """Rows of 1..SEQ real tokens (ids >= 1), right-padded with PAD to SEQ."""
    g = torch.Generator().manual_seed(41)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (ROWS,), generator=g)
    lengths[0] = SEQ  # the whole batch's longest row; most micro-batches are shorter
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def _lm_sum(model: nn.Module, mb: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    ids, mask = mb["input_ids"], mb["attention_mask"]
    logits = model(ids, mask)
    ce = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
    return (ce * mask.flatten()).sum(), mask.sum()


def lm_mean(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    total, count = _lm_sum(model, batch)
    return total / count


def _pad(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The collator: strip each row's padding and pad the micro-batch to its own longest row."""
    lengths = [int(r["attention_mask"].sum()) for r in rows]
    longest = max(lengths)
    ids = torch.full((len(rows), longest), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
        ids[i, :n], mask[i, :n] = r["input_ids"][:n], 1
    return {"input_ids": ids, "attention_mask": mask}


def _padding_loop(transform: Callable[[Tensor], Tensor]) -> Callable[[TrainerRun], None]:
    def train(run: TrainerRun) -> None:
        per_rank = run.per_device_rows * run.micro_batches
        mine = run.dataset[run.rank * per_rank : (run.rank + 1) * per_rank]
        model = DistributedDataParallel(run.model)
        for j in range(run.micro_batches):
            mb = _pad(mine[j * run.per_device_rows : (j + 1) * run.per_device_rows])
            mb["input_ids"] = transform(mb["input_ids"])
            total, count = _lm_sum(model, mb)
            (total / count / run.micro_batches).backward()  # a mean of means
        run.optimizer.step()

    return train


def padded_mean_of_means() -> TrainerSpec:
    """MISTAKE: per-micro-batch token means; each micro-batch padded to its own longest row."""
    return TrainerSpec(
        build_model=Lm, batch=_lm_batch(), train=_padding_loop(lambda ids: ids),
        reference_loss=lm_mean, count_items=lambda b: b["attention_mask"].sum(),
    )  # fmt: skip


def unrecognisable_rows() -> TrainerSpec:
    """MISTAKE (the same), through a loop that remaps token ids before the model: no row matches."""
    return TrainerSpec(
        build_model=Lm, batch=_lm_batch(), train=_padding_loop(lambda ids: (ids * 7) % VOCAB),
        reference_loss=lambda model, batch: lm_mean(
            model, {**batch, "input_ids": (batch["input_ids"] * 7) % VOCAB}
        ),
    )  # fmt: skip
