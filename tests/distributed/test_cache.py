"""CachedStep against ONE process computing the loss on the whole batch, on real gloo ranks.

Rank r's K micro-batches differ in size and content. The reference builds one
model, replays every rank's dropout stream (seed 100 + r, micro-batches in
order, exactly as pass 1 draws it), concatenates all embeddings (ranks in
order, micro-batches in order), evaluates the plain CLIP formula and takes one
SGD step with lr = 1. Every rank's parameters after `CachedStep.step` (DDP on
W = 2) must equal the reference's: parameters = old - whole-batch gradient.

Three known-wrong implementations fail the same assertions: no RNG replay in
pass 2, a gather without gradient in the loss, and the loss (with its
`logit_scale`) re-evaluated per micro-batch (open_clip's `accum_freq`).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from tests.distributed.test_losses import _clip_gather_without_grad, ref_clip
from tests.support.contrastive_models import TwoTower, embed
from tests.support.harness import run_ranks
from wholebatch.comm.groups import get_rank, get_world_size, is_distributed
from wholebatch.losses.contrastive import clip_loss
from wholebatch.train.cache import CachedStep
from wholebatch.train.gradcache import GradCache
from wholebatch.train.stepping import sync_context

# float64, tiny model: round-off ~1e-14; mutations are off by O(1) factors.
F64: dict[str, float] = dict(rtol=1e-9, atol=1e-10)
SCALE0 = 1.7
D_IN = 4
# Rows of each micro-batch, per rank: uneven within and across ranks.
ROWS = {1: [3], 3: [2, 1, 3]}
ROWS_RANK1 = {1: [2], 3: [1, 3, 2]}


class NoReplay(CachedStep):
    """MUTATION: pass 2 draws fresh dropout masks."""

    _replay_rng = False


class PerMicroBatchLoss(CachedStep):
    """MUTATION: re-evaluate the loss per micro-batch with that micro-batch live.

    The embeddings' gradients are right, but `logit_scale` receives a gradient
    from each of the K evaluations: K times its true gradient.
    """

    def _forward_backward(self, micro_batches: Sequence[Any]) -> tuple[Tensor, int]:
        k = len(micro_batches)
        rngs = []
        with torch.no_grad():
            cached = []
            for mb in micro_batches:
                rngs.append(torch.get_rng_state())
                cached.append(self.embed_fn(self.model, mb))
        after = torch.get_rng_state()
        total = torch.zeros((), dtype=torch.float64)
        for i, mb in enumerate(micro_batches):
            with sync_context(self.model, i, k):
                torch.set_rng_state(rngs[i])
                out = self.embed_fn(self.model, mb)
                whole = [
                    torch.cat(
                        [*(c[j] for c in cached[:i]), out[j], *(c[j] for c in cached[i + 1 :])]
                    )
                    for j in range(len(out))
                ]
                loss = self.loss_fn(*whole)
                loss.backward()
                total = loss.detach()
        torch.set_rng_state(after)
        return total, sum(int(c[0].shape[0]) for c in cached)


STEPS: dict[str, type[CachedStep]] = {
    "cached": CachedStep,
    "no_replay": NoReplay,
    "per_micro_batch_loss": PerMicroBatchLoss,
}


def _batches(world: int, k: int) -> list[list[tuple[Tensor, Tensor]]]:
    out = []
    for r in range(world):
        rows = (ROWS if r == 0 else ROWS_RANK1)[k]
        gen = torch.Generator().manual_seed(7 + r)
        out.append(
            [
                (
                    torch.randn(n, D_IN, generator=gen, dtype=torch.float64),
                    torch.randn(n, D_IN, generator=gen, dtype=torch.float64),
                )
                for n in rows
            ]
        )
    return out


def _build(placement: str) -> tuple[TwoTower, nn.Parameter]:
    torch.manual_seed(0)
    if placement.startswith("inside"):
        model = TwoTower(D_IN, inner_scale=SCALE0)
        return model, model.logit_scale
    return TwoTower(D_IN), nn.Parameter(torch.tensor(SCALE0, dtype=torch.float64))


def _rank_step(
    batches: list[list[tuple[Tensor, Tensor]]], placement: str, impl: str, loss: str
) -> dict[str, Tensor]:
    r = get_rank()
    model, scale = _build(placement)
    find_unused = placement == "inside_find_unused"
    wrapped: nn.Module = (
        DistributedDataParallel(model, find_unused_parameters=find_unused)
        if is_distributed()
        else model
    )
    params = list(model.parameters()) + ([scale] if placement == "outside" else [])
    opt = torch.optim.SGD(params, lr=1.0)

    def loss_fn(i: Tensor, t: Tensor) -> Tensor:
        if loss == "gather_without_grad":
            return _clip_gather_without_grad(i, t, scale)
        return clip_loss(i, t, scale, tile_size=2)

    step = STEPS[impl](wrapped, opt, embed, loss_fn)
    torch.manual_seed(100 + r)
    stats = step.step(batches[r])
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["scale"] = scale.detach().clone()
    out["loss"] = torch.tensor(stats.loss, dtype=torch.float64)
    del step, wrapped, opt  # leave no DDP reducer behind in the reused worker
    gc.collect()
    return out


def _reference(batches: list[list[tuple[Tensor, Tensor]]], placement: str) -> dict[str, Tensor]:
    model, scale = _build(placement)
    imgs, txts = [], []
    for r, mbs in enumerate(batches):
        torch.manual_seed(100 + r)  # each rank's dropout stream, drawn in micro-batch order
        for mb in mbs:
            i, t = model(*mb)
            imgs.append(i)
            txts.append(t)
    loss = ref_clip(torch.cat(imgs), torch.cat(txts), scale)
    loss.backward()
    out = {n: (p - p.grad).detach() for n, p in model.named_parameters()}  # type: ignore[operator]
    out["scale"] = (scale - scale.grad).detach()  # type: ignore[operator]
    out["loss"] = loss.detach()
    return out


def check_step(
    world: int, k: int, placement: str, impl: str = "cached", loss: str = "clip"
) -> None:
    batches = _batches(world, k)
    ref = _reference(batches, placement)
    got = run_ranks(world, _rank_step, batches, placement, impl, loss)
    for r, params in enumerate(got):
        assert params.keys() == ref.keys()
        for name, value in params.items():
            torch.testing.assert_close(
                value, ref[name], **F64, msg=lambda m, name=name, r=r: f"rank {r} {name}: {m}"
            )


@pytest.mark.parametrize("placement", ["outside", "inside"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_cached_step_equals_whole_batch(world: int, k: int, placement: str) -> None:
    check_step(world, k, placement)


def test_cached_step_inside_ddp_with_find_unused_parameters() -> None:
    # DDP marks logit_scale unused by the forward: CachedStep averages it itself.
    check_step(2, 3, "inside_find_unused")


@pytest.mark.parametrize("placement", ["outside", "inside"])
def test_mutation_no_rng_replay_is_caught(placement: str) -> None:
    with pytest.raises(AssertionError, match="rank 0"):
        check_step(2, 3, placement, impl="no_replay")


def test_mutation_gather_without_grad_is_caught() -> None:
    with pytest.raises(AssertionError, match="rank 0"):
        check_step(2, 3, "outside", loss="gather_without_grad")


@pytest.mark.parametrize("placement", ["outside", "inside"])
def test_mutation_loss_per_micro_batch_is_caught(placement: str) -> None:
    # Only logit_scale is wrong (K times its gradient): the assertion names it.
    with pytest.raises(AssertionError, match="scale"):
        check_step(2, 3, placement, impl="per_micro_batch_loss")


def test_rng_after_step_is_where_pass_one_left_it() -> None:
    # The step draws dropout masks once per micro-batch, as plain training would.
    batches = _batches(1, 3)[0]
    model, scale = _build("outside")
    opt = torch.optim.SGD([*model.parameters(), scale], lr=0.0)
    step = CachedStep(model, opt, embed, lambda i, t: clip_loss(i, t, scale))
    torch.manual_seed(5)
    with torch.no_grad():
        for mb in batches:
            model(*mb)
    expected = torch.rand(3)
    torch.manual_seed(5)
    step.step(batches)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)
    assert get_world_size() == 1


def test_clipping_and_stats_follow_the_whole_batch_gradient() -> None:
    # max_grad_norm clips the whole-batch gradient (shared StepFinisher code) and
    # stats.loss is the whole-batch loss.
    batches = _batches(1, 3)
    ref = _reference(batches, "outside")  # params - g
    model, scale = _build("outside")
    old = {n: p.detach().clone() for n, p in model.named_parameters()} | {
        "scale": scale.detach().clone()
    }
    g = {n: old[n] - ref[n] for n in old}
    norm = torch.sqrt(sum((v**2).sum() for v in g.values()))  # type: ignore[arg-type]
    opt = torch.optim.SGD([*model.parameters(), scale], lr=1.0)
    step = CachedStep(model, opt, embed, lambda i, t: clip_loss(i, t, scale), max_grad_norm=0.01)
    torch.manual_seed(100)
    stats = step.step(batches[0])
    coef = 0.01 / (float(norm) + 1e-6)
    assert stats.clip_coef == pytest.approx(coef, rel=1e-9)
    assert stats.grad_norm == pytest.approx(float(norm), rel=1e-9)
    assert stats.loss == pytest.approx(float(ref["loss"]), rel=1e-12)
    assert stats.items == sum(len(mb[0]) for mb in batches[0])
    for n, p in [*model.named_parameters(), ("scale", scale)]:
        torch.testing.assert_close(p.detach(), old[n] - coef * g[n], **F64)


class _WatchCache(GradCache):
    """Records weak references to every pass-1 embedding (and the concatenation the loss saw)."""

    refs: list[Any]

    def _first_pass(self, *args: Any) -> Any:
        parts, rngs, autocasts, kept, error = super()._first_pass(*args)
        self.refs = [weakref.ref(t) for c in parts for t in c]  # pass 1's own tensors
        self.refs += [weakref.ref(t) for t in kept or ()]  # the kept graph's outputs
        return parts, rngs, autocasts, kept, error


def test_cached_embeddings_are_freed_before_pass_two() -> None:
    # Pass 2 needs the embeddings' gradient, not the embeddings: holding them
    # (N_rank x D per output) while a micro-batch's activations live costs memory
    # for nothing (the benchmark's MLP: 8 MiB of a 60 MiB step). Every tensor that
    # held them (pass 1's, the kept graph's outputs, the concatenation the loss saw)
    # must be gone by the first re-run forward of pass 2.
    batches = _batches(1, 3)[0]
    model, scale = _build("outside")
    opt = torch.optim.SGD([*model.parameters(), scale], lr=0.1)
    alive: list[int] = []
    whole: list[Any] = []

    def watching_embed(m: nn.Module, mb: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        if torch.is_grad_enabled() and hasattr(step.cache, "refs") and whole:  # pass 2
            alive.append(sum(r() is not None for r in [*step.cache.refs, *whole]))
        return embed(m, mb)

    def loss_fn(i: Tensor, t: Tensor) -> Tensor:
        whole.extend([weakref.ref(i), weakref.ref(t)])
        return clip_loss(i, t, scale)

    step = CachedStep(model, opt, watching_embed, loss_fn)
    step.cache = _WatchCache(model, watching_embed)
    torch.manual_seed(100)
    step.step(batches)
    assert len(step.cache.refs) == 3 * 2 + 2  # 3 micro-batches x 2 outputs + the kept graph's 2
    assert alive == [0, 0], alive  # micro-batches 0 and 1 re-run; 2 reused its graph
