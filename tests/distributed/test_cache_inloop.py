"""GradCache in a user's own loop, on real gloo ranks, against ONE process on the whole batch.

Each scenario trains nothing: it runs the user's loop up to the optimizer step
and compares every parameter's gradient (after DDP's mean / FSDP2's
reduce-scatter, gathered to full) with a single process that embeds every
rank's micro-batches with graph, in rank order, replaying each rank's dropout
stream (seed 100 + r, micro-batches in order, as pass 1 draws them), and
back-propagates the same InfoNCE on the concatenation (tests/support/gradcache_cases.py).

Rows per rank are uneven, W = 3 has an empty rank (micro-batches of 0 rows), inputs differ per rank, float64. Every scenario must
also reject the three mutations (no RNG replay, a dropped xW, local negatives).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from tests.support.gradcache_cases import (
    F64,
    MUTATIONS,
    Encoder,
    MicroBatch,
    cache_class,
    embed3,
    info_nce,
    make_batches,
)
from tests.support.harness import RankFailure, run_ranks
from wholebatch.comm.groups import get_rank
from wholebatch.train.gradcache import GradCache

SCALE0 = 1.3
# Rows per micro-batch on each rank: uneven within and across ranks; rank 1 of W = 3
# is empty (its micro-batches have 0 rows: every rank runs the same K forwards).
ROWS = {
    1: [[2, 3]],
    2: [[2, 3], [1, 4]],
    3: [[2, 3], [0, 0], [1, 4]],
}
SCENARIOS = ("ddp_outside", "ddp_inside", "scaler", "accumulate", "fsdp2")


def _build(scenario: str) -> tuple[Encoder, nn.Parameter]:
    torch.manual_seed(0)
    if scenario == "ddp_inside":
        model = Encoder(inner_scale=SCALE0)
        return model, model.logit_scale
    return Encoder(), nn.Parameter(torch.tensor(SCALE0, dtype=torch.float64))


def _grads(model: nn.Module, scale: Tensor) -> dict[str, Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        assert g is not None, name
        out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g.detach().clone()
    if "logit_scale" not in out:
        assert scale.grad is not None
        out["logit_scale"] = scale.grad.detach().clone()
    return out


def _count_allreduces(state: list[int], bucket: Any) -> Any:
    state[0] += 1
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


# DDP accepts only runtime annotations on a hook (ours are strings under __future__).
_count_allreduces.__annotations__ = {}


def _rank_loop(
    scenario: str, batches: list[list[list[MicroBatch]]], mutation: str | None
) -> tuple[dict[str, Tensor], int]:
    """The user's loop on this rank; the gradients it leaves and DDP's all-reduce count."""
    r = get_rank()
    model, scale = _build(scenario)
    counter = [0]
    wrapped: nn.Module
    if scenario == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model)
    else:
        wrapped = DistributedDataParallel(model, bucket_cap_mb=100)
        wrapped.register_comm_hook(counter, _count_allreduces)
    extra = [] if scenario == "ddp_inside" else [scale]
    opt = torch.optim.SGD([*model.parameters(), *extra], lr=0.1)
    cache = cache_class(mutation)(wrapped, embed3)

    def loss_fn(q: Tensor, p: Tensor, n: Tensor) -> Tensor:
        return info_nce(q, p, n, scale, mutation)

    torch.manual_seed(100 + r)
    if scenario == "scaler":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        loss = cache(batches[0][r], loss_fn)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # gradients now unscaled, as the step would see them
    elif scenario == "accumulate":
        # An outer accumulation of 2 as a trainer runs it: its own no_sync on the first.
        for j, step_batches in enumerate(batches):
            ctx = wrapped.no_sync() if j == 0 else contextlib.nullcontext()  # type: ignore[operator]
            with ctx:
                loss = cache(step_batches[r], loss_fn)
                (loss / len(batches)).backward()
    else:
        cache(batches[0][r], loss_fn).backward()
    out = _grads(model, scale)
    del cache, wrapped, opt  # no DDP reducer may outlive the call (workers are reused)
    gc.collect()
    return out, counter[0]


def _reference(scenario: str, batches: list[list[list[MicroBatch]]]) -> dict[str, Tensor]:
    model, scale = _build(scenario)
    world = len(batches[0])
    embs: list[list[list[Tensor]]] = [[] for _ in batches]  # [step][rank] -> (q, p, n)
    for r in range(world):
        torch.manual_seed(100 + r)  # rank r's dropout stream, through all its steps in order
        for s, step_batches in enumerate(batches):
            outs = [embed3(model, mb) for mb in step_batches[r]]
            embs[s].append([torch.cat([o[j] for o in outs]) for j in range(3)])
    total = torch.zeros((), dtype=torch.float64)
    for per_rank in embs:
        q, p, n = (torch.cat([e[j] for e in per_rank]) for j in range(3))
        # One process: the positives of rank r's queries sit after ranks < r's rows,
        # exactly where the gathered tensors put them; the docs are all positives
        # first, then all negatives, as all_gather(p), all_gather(n) give.
        total = total + info_nce(q, p, n, scale)
    (total / len(batches)).backward()
    return _grads(model, scale)


def check(world: int, scenario: str, mutation: str | None = None, rows: Any = None) -> list[int]:
    steps = 2 if scenario == "accumulate" else 1
    batches = [make_batches(rows or ROWS[world], seed=s) for s in range(steps)]
    ref = _reference(scenario, batches)
    got = run_ranks(world, _rank_loop, scenario, batches, mutation)
    for r, (grads, _) in enumerate(got):
        assert grads.keys() == ref.keys()
        for name, value in grads.items():
            torch.testing.assert_close(
                value, ref[name], **F64, msg=lambda m, name=name, r=r: f"rank {r} {name}: {m}"
            )
    return [count for _, count in got]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_user_loop_equals_whole_batch(world: int, scenario: str) -> None:
    counts = check(world, scenario)
    if scenario != "fsdp2":
        # DDP reduced exactly once per optimizer step: on the last micro-batch of the
        # last cache call (the first call ran under the caller's own no_sync).
        assert counts == [1] * world


@pytest.mark.parametrize("scenario", ["ddp_inside", "accumulate", "fsdp2"])
def test_one_micro_batch_per_rank(scenario: str) -> None:
    # K = 1: under DDP the only micro-batch is the one DDP synchronises on, so its
    # graph is not kept (its forward must follow the outer backward); elsewhere it is.
    counts = check(2, scenario, rows=[[3], [2]])
    if scenario != "fsdp2":
        assert counts == [1, 1]


@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_mutations_are_caught(scenario: str, mutation: str) -> None:
    with pytest.raises(AssertionError, match="rank 0"):
        check(3 if scenario == "ddp_outside" else 2, scenario, mutation)


# -- single process -------------------------------------------------------------------


def test_one_process_without_distributed_equals_whole_batch() -> None:
    # torch.distributed not initialised: the cache and the loss run as a world of one.
    batches = [make_batches([[1, 3, 2]])]
    ref = _reference("plain", batches)
    model, scale = _build("plain")
    torch.manual_seed(100)
    GradCache(model, embed3)(batches[0][0], lambda q, p, n: info_nce(q, p, n, scale)).backward()
    for name, value in _grads(model, scale).items():
        torch.testing.assert_close(value, ref[name], **F64, msg=name)


def test_keep_last_changes_nothing_but_the_forward_count() -> None:
    # keep_last=False runs every micro-batch twice; the default runs the last once. Same gradient.
    batches = make_batches([[2, 1, 3]])[0]
    counts: dict[bool, int] = {}
    grads: dict[bool, dict[str, Tensor]] = {}
    for reuse in (True, False):
        model, scale = _build("plain")
        calls = [0]

        def counting(m: nn.Module, mb: MicroBatch, calls: list[int] = calls) -> Any:
            calls[0] += 1
            return embed3(m, mb)

        cache = GradCache(model, counting, keep_last=reuse)
        torch.manual_seed(3)
        cache(batches, lambda q, p, n, s=scale: info_nce(q, p, n, s)).backward()
        counts[reuse], grads[reuse] = calls[0], _grads(model, scale)
    assert counts == {True: 5, False: 6}
    for name in grads[True]:
        torch.testing.assert_close(grads[True][name], grads[False][name], **F64)


class _AutocastProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        out: Tensor = self.lin(x)
        return out


def test_second_pass_runs_under_the_autocast_of_the_first() -> None:
    # Trainers run the forward inside autocast and call backward outside it: the
    # re-run forwards (inside backward) must compute the same bf16 network.
    model = _AutocastProbe()
    xs = [torch.randn(3, 4) for _ in range(3)]
    cache = GradCache(model, lambda m, x: m(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cache(xs, lambda e: e.float().square().sum())
    loss.backward()
    # pass 1: two without graph, the kept one with; pass 2: micro-batches 0 and 1 again.
    assert model.seen == [(False, True), (False, True), (True, True), (True, True), (True, True)]


def test_under_no_grad_only_the_loss_runs() -> None:
    model, scale = _build("plain")
    batches = make_batches([[2, 2]])[0]
    with torch.no_grad():
        loss = GradCache(model, embed3)(batches, lambda q, p, n: info_nce(q, p, n, scale))
    assert not loss.requires_grad and torch.isfinite(loss)
    assert all(p.grad is None for p in model.parameters())


def test_a_second_backward_through_the_same_call_is_refused() -> None:
    model, scale = _build("plain")
    loss = GradCache(model, embed3)(
        make_batches([[2, 2]])[0], lambda q, p, n: info_nce(q, p, n, scale)
    )
    loss.backward(retain_graph=True)
    with pytest.raises(Exception, match="second backward through the same cached"):
        loss.backward()


def test_bad_embed_output_and_loss_are_clear_errors() -> None:
    model, _ = _build("plain")
    xs = [torch.randn(2, 4, dtype=torch.float64)]
    with pytest.raises(ValueError, match="GradCache: embed_fn returned something other"):
        GradCache(model, lambda m, x: {"emb": m(x)})(xs, lambda e: e.sum())
    with pytest.raises(ValueError, match="GradCache: loss_fn must return a scalar"):
        GradCache(model, lambda m, x: m.net(x))(xs, lambda e: e)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        GradCache(model, lambda m, x: m.net(x))([], lambda e: e.sum())


def _empty_k_on_rank1() -> None:
    model = DistributedDataParallel(Encoder())
    mbs = [] if get_rank() == 1 else [torch.randn(2, 4, dtype=torch.float64)]
    GradCache(model, lambda m, x: m(x))(mbs, lambda e: e.sum()).backward()


def test_a_rank_without_micro_batches_is_the_same_error_everywhere() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _empty_k_on_rank1)
    text = str(info.value)
    assert text.count("micro_batches is empty on this rank") == 2 and "(on ranks [1])" in text


def _cuda_grads(mutation: str | None) -> dict[str, Tensor]:
    dev = torch.device("cuda")
    model, scale = _build("plain")
    model.to(dev)
    scale = nn.Parameter(scale.detach().to(dev))
    batches = [tuple(t.to(dev) for t in mb) for mb in make_batches([[2, 3, 1]])[0]]
    torch.manual_seed(100)  # seeds the CUDA generator too: dropout on CUDA draws from it
    cache_class(mutation)(model, embed3)(
        batches, lambda q, p, n: info_nce(q, p, n, scale)
    ).backward()
    return {k: v.cpu() for k, v in _grads(model, scale).items()}


def _cuda_reference() -> dict[str, Tensor]:
    dev = torch.device("cuda")
    model, scale = _build("plain")
    model.to(dev)
    scale = nn.Parameter(scale.detach().to(dev))
    batches = [tuple(t.to(dev) for t in mb) for mb in make_batches([[2, 3, 1]])[0]]
    torch.manual_seed(100)
    outs = [embed3(model, mb) for mb in batches]
    q, p, n = (torch.cat([o[j] for o in outs]) for j in range(3))
    info_nce(q, p, n, scale).backward()
    return {k: v.cpu() for k, v in _grads(model, scale).items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_replay_equals_whole_batch() -> None:
    # Dropout on a CUDA tensor draws from the CUDA generator: pass 2 must restore it.
    ref = _cuda_reference()
    for name, value in _cuda_grads(None).items():
        torch.testing.assert_close(value, ref[name], **F64, msg=name)
    wrong = _cuda_grads("no_replay")
    with pytest.raises(AssertionError):
        for name, value in wrong.items():
            torch.testing.assert_close(value, ref[name], **F64, msg=name)
