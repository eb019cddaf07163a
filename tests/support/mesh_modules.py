"""Two modules on different data-parallel dims of one 4-rank mesh, against one process.

The layout users run for vision-language models: a vision encoder data-parallel over
every rank (encoder dp = 4: `mesh["dp", "tp"]._flatten("dp_enc")`) beside a language
model on dp 2 x tp 2 (FSDP2 on dp, Colwise/Rowwise on tp). Each sequence carries two
image patches; the data is sharded by the dp coordinate, so both tp ranks of a data
shard are fed the same micro-batch, and tp rank t encodes patch t of every sequence
(the encoder's own data shard: 4 different ones). The patches' encodings reach the
language model through `gather_patches`: an all-gather over tp whose backward hands
each rank the gradient of its own patch only, the convention of tensor parallel's
replicated consumer (DTensor's Shard -> Replicate): the tp replicas back-propagate
the same loss, counted once.

So after FSDP2's means the encoder's gradient is (1/4) of the shards' sum and the
language model's (1/2): the scale is 4/N for one and 2/N for the other. One set of
dims for both (the mutation `module_dims={encoder: ("dp",)}`) scales the encoder by
2/N: its gradient encoder_dp / llm_dp = 2 times too small (Megatron-Bridge PR #4066).

Runs (each on every rank of the 4-rank world of tests.support.harness, float64, ragged
sequences with an empty micro-batch, two SGD steps):
- `run_accumulator(engine, encoder_dims)`: engine "accumulator" or "hand" (the
  hand-written exact loop: grads x 4/N and x 2/N by hand, the benchmark's baseline);
- `run_cached(encoder_dims)`: `CachedStep` with a CLIP loss over dp, the image tower
  on dp_enc and the text tower on dp x tp.
`reference()` / `cached_reference()`: one process on the whole batch.

Legend: S sequences, T padded width, P patch features, D width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tests.support.mesh_cases import (
    WIDTH,
    MeshCase,
    Piece,
    _sequences,
    get_mesh,
    ragged_steps,
    read_params,
)
from tests.support.models import IGNORE, VOCAB, micro_batch

SHAPE = (("dp", 2), ("tp", 2))
CASE = MeshCase(shape=SHAPE, batch_dims=("dp",), steps=ragged_steps(2, 3, 2, seed=5))
P = 5  # patch features
D = 6
PATCHES = 2  # per sequence: one per tp rank
LR = 0.5
CLIP = 0.5  # max_grad_norm: active, so each group's share of the norm matters

MicroBatch = tuple[Tensor, Tensor, Tensor]  # tokens [S, T], targets [S, T], patches [S, 2, P]


def _init(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    return module


class PatchEncoder(nn.Module):
    """One image patch [S, P] -> its encoding [S, D]."""

    def __init__(self, p: int = P, d: int = D) -> None:
        super().__init__()
        self.proj = nn.Linear(p, d).double()
        _init(self, 11)

    def forward(self, patch_SP: Tensor) -> Tensor:
        return torch.tanh(self.proj(patch_SP))


class PrefixLM(nn.Module):
    """`TinyLM` with an image prefix added to every position's embedding."""

    def __init__(self, vocab: int = VOCAB, d: int = D) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d).double()
        self.hidden = nn.Linear(d, d).double()
        self.out = nn.Linear(d, vocab).double()
        _init(self, 12)

    def forward(self, tokens_ST: Tensor, prefix_SD: Tensor) -> Tensor:
        h_STD = torch.tanh(self.hidden(self.emb(tokens_ST) + prefix_SD[:, None, :]))
        logits_STV: Tensor = self.out(h_STD)
        return logits_STV


class VisionLM(nn.Module):
    def __init__(self, p: int = P, d: int = D, vocab: int = VOCAB) -> None:
        super().__init__()
        self.encoder = PatchEncoder(p, d)
        self.lm = PrefixLM(vocab, d)


def gather_patches(mine_SD: Tensor, group: Any) -> Tensor:
    """Every tp rank's patch encodings [S, tp, D]; backward: this rank's slot only.

    The consumer (the language model) is replicated over tp: both replicas hold the
    same gradient of the same loss, so each keeps its own patch's (no sum over tp).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = [torch.empty_like(mine_SD) for _ in range(world)]
    dist.all_gather(parts, mine_SD.detach().contiguous(), group=group)
    parts[rank] = mine_SD
    return torch.stack(parts, 1)


def _loss_sum(logits_STV: Tensor, targets_ST: Tensor) -> tuple[Tensor, Tensor]:
    loss = F.cross_entropy(
        logits_STV.reshape(-1, logits_STV.shape[-1]).double(),
        targets_ST.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return loss, (targets_ST != IGNORE).sum()


def _patches(case: MeshCase, s: int) -> list[list[Tensor]]:
    """Step s's patches as [shard][micro-batch] -> [S, 2, P]."""
    gen = torch.Generator().manual_seed(500 + s)
    return [
        [torch.randn(len(mb), PATCHES, P, generator=gen, dtype=torch.float64) for mb in shard]
        for shard in case.steps[s]
    ]


def _micro_batches(case: MeshCase, s: int, shard: int) -> list[MicroBatch]:
    seqs, patches = _sequences(case, s)[shard], _patches(case, s)[shard]
    return [(*micro_batch(mb, width=WIDTH), x) for mb, x in zip(seqs, patches, strict=True)]


@dataclasses.dataclass
class Result:
    params: dict[str, Tensor | Piece]  # `mesh_cases.read_params`
    losses: list[float]
    items: list[float]
    grad_norms: list[float]
    seconds: list[float]


def reference(case: MeshCase = CASE) -> Result:
    """Every step's whole batch in one process: every patch encoded, loss sum / all tokens."""
    model = VisionLM()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, items, norms = [], [], []
    for s in range(len(case.steps)):
        mbs = [mb for b in range(len(case.steps[s])) for mb in _micro_batches(case, s, b)]
        tokens = torch.cat([t for t, _, _ in mbs])
        targets = torch.cat([y for _, y, _ in mbs])
        patches = torch.cat([x for _, _, x in mbs])
        enc = torch.stack([model.encoder(patches[:, j]) for j in range(PATCHES)], 1)
        loss_sum, n = _loss_sum(model.lm(tokens, enc.mean(1)), targets)
        (loss_sum / n).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss_sum.detach() / n))
        items.append(float(n))
        norms.append(float(norm))
    return Result(
        {k: v.detach().clone() for k, v in model.named_parameters()}, losses, items, norms, []
    )


_FLAT: dict[str, Any] = {}


def _build(model: VisionLM | None = None) -> tuple[VisionLM, Any]:
    """The model on the mesh: the encoder FSDP2 on dp_enc (all 4 ranks), the language
    model tensor parallel on tp and FSDP2 on dp."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = get_mesh(SHAPE)
    if "dp_enc" not in _FLAT:
        _FLAT["dp_enc"] = mesh["dp", "tp"]._flatten("dp_enc")
    model = VisionLM() if model is None else model
    fully_shard(model.encoder, mesh=_FLAT["dp_enc"])
    parallelize_module(
        model.lm, mesh["tp"], {"hidden": ColwiseParallel(), "out": RowwiseParallel()}
    )
    fully_shard(model.lm, mesh=mesh["dp"])
    return model, mesh


def _full(model: nn.Module) -> dict[str, Tensor | Piece]:
    # local pieces, not full_tensor(): torch 2.8 reads the lm's 6 hidden rows over dp 2 x
    # tp 2 back wrong (`mesh_cases.read_params`)
    return read_params(model)


def _coords(mesh: Any) -> tuple[int, int]:
    from wholebatch.comm.mesh import MeshSplit

    c = MeshSplit(mesh=mesh, batch_dims=("dp",)).coordinate()
    return c["dp"], c["tp"]


def make_loss_fn(mesh: Any) -> Any:
    """`loss_fn(model, mb)` on this rank: its patch encoded, the shard's gathered over tp."""
    tp_group = mesh["tp"].get_group()
    _, tp = _coords(mesh)

    def loss_fn(model: VisionLM, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        tokens, targets, patches = mb
        enc_S2D = gather_patches(model.encoder(patches[:, tp]), tp_group)
        return _loss_sum(model.lm(tokens, enc_S2D.mean(1)), targets)

    return loss_fn


def run_accumulator(
    engine: str = "accumulator",
    encoder_dims: tuple[str, ...] = ("dp_enc",),
    steps: int | None = None,
) -> Result:
    """Two SGD steps of `CASE` on this rank: the `Accumulator` with
    `module_batch_dims={model.encoder: encoder_dims}`, or the hand-written exact loop."""
    from wholebatch.train.accumulate import Accumulator

    model, mesh = _build()
    dp, _ = _coords(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = make_loss_fn(mesh)
    acc = None
    if engine == "accumulator":
        acc = Accumulator(
            model,
            opt,
            mesh=mesh,
            batch_dims=("dp",),
            module_batch_dims={model.encoder: encoder_dims},
            max_grad_norm=CLIP,
        )
    losses, items, norms, seconds = [], [], [], []
    n_steps = len(CASE.steps) if steps is None else steps
    for s in range(n_steps):
        mbs = _micro_batches(CASE, s % len(CASE.steps), dp)
        t0 = time.perf_counter()
        if acc is not None:
            st = acc.step(mbs, loss_fn)
            losses.append(st.loss)
            items.append(st.items)
            norms.append(st.grad_norm)
        else:
            loss, n, norm = hand_step(model, opt, mesh, mbs, loss_fn)
            losses.append(loss)
            items.append(n)
            norms.append(norm)
        seconds.append(time.perf_counter() - t0)
    return Result(_full(model), losses, items, norms, seconds)


def hand_step(
    model: VisionLM,
    opt: torch.optim.Optimizer,
    mesh: Any,
    mbs: list[MicroBatch],
    loss_fn: Any,
    clip: float | None = CLIP,
) -> tuple[float, float, float]:
    """The exact loop written by hand: sync on the last micro-batch, N over dp, the encoder
    x 4 / N (FSDP2 averaged over 4 ranks), the language model x 2 / N (over dp), clipping
    by the norm of both (each piece counted once over the ranks holding it)."""
    from wholebatch.comm.mesh import MeshSplit
    from wholebatch.train.meshstep import sq_norm_share

    k = len(mbs)
    loss_sum = torch.zeros((), dtype=torch.float64)
    items = torch.zeros((), dtype=torch.float64)
    for i, mb in enumerate(mbs):
        for m in (model.encoder, model.lm):
            m.set_requires_gradient_sync(i == k - 1)  # type: ignore[operator]
        loss, n = loss_fn(model, mb)
        loss.backward()
        loss_sum += loss.detach()
        items += n
    row = torch.stack([loss_sum, items])
    dist.all_reduce(row, group=mesh["dp"].get_group())
    n_items = float(row[1])
    split = MeshSplit(mesh=mesh, batch_dims=("dp",))
    scales = ((model.encoder, 4.0 / n_items), (model.lm, 2.0 / n_items))
    sq = torch.stack([sq_norm_share(split, list(m.parameters())) * f * f for m, f in scales])
    dist.all_reduce(sq)
    norm = float(sq.sum().sqrt())
    coef = 1.0 if clip is None else min(1.0, clip / (norm + 1e-6))
    with torch.no_grad():
        for m, f in scales:
            grads = [p.grad.to_local() for p in m.parameters() if p.grad is not None]  # type: ignore[union-attr]
            torch._foreach_mul_(grads, f * coef)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(row[0]) / n_items, n_items, norm


# ---------------------------------------------------------------------------
# CachedStep: a CLIP loss over dp, the image tower on dp_enc, the text tower on dp x tp
# ---------------------------------------------------------------------------

CACHED = MeshCase(shape=SHAPE, batch_dims=("dp",), steps=ragged_steps(2, 2, 1, seed=6))
SCALE = 3.0


class TextTower(nn.Module):
    """Token ids [S, T] -> a text embedding [S, D]: mean of tanh(hidden(emb)) over positions."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D).double()
        # 6 hidden rows: uneven over dp 2 x tp 2 (FSDP2's strided shard), the layout torch
        # 2.8 reads back wrong through full_tensor() and trains on exactly
        self.hidden = nn.Linear(D, 6).double()
        self.out = nn.Linear(6, D).double()
        _init(self, 13)

    def forward(self, tokens_ST: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(self.emb(tokens_ST)))).mean(1)


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = PatchEncoder()
        self.text = TextTower()


def _pairs(s: int, shard: int) -> list[tuple[Tensor, Tensor]]:
    """(tokens, patches) per micro-batch of `shard` at step s (a pair per sequence)."""
    return [(t, x) for t, _, x in _micro_batches(CACHED, s, shard)]


def _clip(img_SD: Tensor, txt_SD: Tensor, **where: Any) -> Tensor:
    from wholebatch.losses.contrastive import clip_loss

    return clip_loss(F.normalize(img_SD, dim=-1), F.normalize(txt_SD, dim=-1), SCALE, **where)


def cached_reference() -> dict[str, Tensor]:
    """One process: both shards' pairs, every patch encoded, the CLIP loss, one SGD step."""
    model = Towers()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    pairs = [p for b in range(2) for p in _pairs(0, b)]
    tokens = torch.cat([t for t, _ in pairs])
    patches = torch.cat([x for _, x in pairs])
    img = torch.stack([model.image(patches[:, j]) for j in range(PATCHES)], 1).mean(1)
    _clip(img, model.text(tokens)).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def run_cached(encoder_dims: tuple[str, ...] = ("dp_enc",)) -> dict[str, Tensor | Piece]:
    """One `CachedStep` of `CACHED` on this rank, `module_batch_dims={model.image: encoder_dims}`."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from wholebatch.train.cache import CachedStep

    mesh = get_mesh(SHAPE)
    if "dp_enc" not in _FLAT:
        _FLAT["dp_enc"] = mesh["dp", "tp"]._flatten("dp_enc")
    model = Towers()
    fully_shard(model.image, mesh=_FLAT["dp_enc"])
    parallelize_module(
        model.text, mesh["tp"], {"hidden": ColwiseParallel(), "out": RowwiseParallel()}
    )
    fully_shard(model.text, mesh=mesh["dp"])
    dp, tp = _coords(mesh)
    tp_group = mesh["tp"].get_group()

    def embed(m: Towers, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        tokens, patches = pair
        img = gather_patches(m.image(patches[:, tp]), tp_group).mean(1)
        return img, m.text(tokens)

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = CachedStep(
        model,
        opt,
        embed,
        lambda i, t: _clip(i, t, mesh=mesh, batch_dims=("dp",)),
        mesh=mesh,
        batch_dims=("dp",),
        module_batch_dims={model.image: encoder_dims},
    )
    step.step(_pairs(0, dp))
    return _full(model)


def module_dims_errors() -> dict[str, str]:
    """The errors of bad `module_batch_dims` (built once, no step taken), by case."""
    from wholebatch.errors import WholebatchError
    from wholebatch.train.accumulate import Accumulator

    model, mesh = _build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cases: dict[str, dict[str, Any]] = {
        "not a submodule": {"module_batch_dims": {nn.Linear(2, 2): ("dp",)}},
        "unknown name": {"module_batch_dims": {"vision": ("dp",)}},
        "a string": {"module_batch_dims": {model.encoder: "dp_enc"}},
        "twice": {"module_batch_dims": {model.encoder: ("dp_enc",), model.encoder.proj: ("dp",)}},
        "not reduced": {"module_batch_dims": {model.lm: ("dp_enc",)}},
        "unknown dim": {"module_batch_dims": {model.encoder: ("cp",)}},
    }
    out = {}
    for name, kw in cases.items():
        try:
            Accumulator(model, opt, mesh=mesh, batch_dims=("dp",), **kw)
        except WholebatchError as e:
            out[name] = str(e)
    try:
        Accumulator(model, opt, module_batch_dims={model.encoder: ("dp",)})
    except WholebatchError as e:
        out["no mesh"] = str(e)
    return out
