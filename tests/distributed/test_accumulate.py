"""The Accumulator against a single-process whole-batch reference, on ragged token data.

Each rank gets different micro-batches (different numbers of sequences, different
lengths, some sequences with no target at all), so per-micro-batch token counts
differ everywhere. The reference runs the whole concatenated batch in one process:
loss = (sum of token losses) / (all tokens). The gradients the optimizer sees, the
reported loss, and the parameters after several SGD / AdamW steps must match it.
The mutation (a mean-of-means loop) must fail the same assertions on this data
and pass them on equal-length data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tests.support.harness import run_ranks
from tests.support.models import (
    MicroBatch,
    TinyLM,
    lm_loss_mean,
    lm_loss_sum,
    make_sequences,
    split_for_ranks,
    whole_batch_loss,
)
from wholebatch.errors import WholebatchError
from wholebatch.train.accumulate import Accumulator
from wholebatch.train.stepping import StepStats, sync_context

# float64 throughout: a loss is a sum of <= ~100 token terms of size <= ~10 and a
# gradient entry a sum of as many products, so round-off is below
# 100 * 10 * 2.2e-16 ~ 2e-13 (a few steps of SGD/AdamW keep it there). 1e-10 leaves
# room and still rejects the mean-of-means loop by orders of magnitude (its errors
# here are ~1e-2 relative).
F64: dict[str, Any] = dict(rtol=1e-10, atol=1e-10)

Sizes = tuple[tuple[int, ...], ...]  # sizes[r][k]: sequences in rank r's k-th micro-batch


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One training run: per step, the global batch (sequence lengths) and how it is split."""

    sizes: tuple[Sizes, ...]
    """sizes[s][r][k]: sequences in rank r's k-th micro-batch at step s."""

    lengths: tuple[tuple[int, ...], ...]
    """lengths[s]: the lengths of step s's sequences (1 = no target token)."""

    wrap: str = "ddp"  # "ddp" | "ddp_compiled" (torch.compile'd DDP) | "fsdp2" | "plain"
    optimizer: str = "sgd"  # "sgd" (with momentum) | "adamw"
    loop: str = "accumulator"  # or "mean_of_means", "no_no_sync", "forward_outside_no_sync"
    max_grad_norm: float | None = None
    init_scale: float | None = None  # GradScaler("cpu", init_scale=...) when set
    loss_reduction: str = "sum"
    grad_reduction: str = "mean"
    poison: tuple[int, int, int] | None = None  # (rank, step, micro-batch) whose loss is inf
    on_nonfinite: str = "skip"
    grad_compression: str | None = None
    dtype: torch.dtype = torch.float64
    count_allreduces: bool = False


@dataclasses.dataclass
class Result:
    stats: list[StepStats | float]  # StepStats (accumulator) or the loop's reported loss
    grads: list[list[Tensor] | None]  # what the optimizer saw per step; None: no step
    params: list[Tensor]
    allreduces: list[int]  # DDP gradient all-reduce hook calls per step
    extra: Any = None


def uneven_sizes(world: int, k: int) -> Sizes:
    """1-3 sequences per micro-batch, different for every (rank, micro-batch)."""
    return tuple(tuple(1 + (r + 2 * j + r * j) % 3 for j in range(k)) for r in range(world))


def ragged_run(world: int, k: int, steps: int = 3, **kw: Any) -> Run:
    """`steps` steps of ragged data (lengths 1..9) split unevenly over `world` x `k`."""
    sizes = uneven_sizes(world, k)
    total = sum(map(sum, sizes))
    gen = torch.Generator().manual_seed(100 * world + k)
    lengths = tuple(
        tuple(int(x) for x in torch.randint(1, 10, (total,), generator=gen)) for _ in range(steps)
    )
    return Run(sizes=(sizes,) * steps, lengths=lengths, **kw)


def _full(t: Tensor) -> Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _counting_allreduce(state: list[int], bucket: Any) -> torch.futures.Future[Tensor]:
    state[0] += 1
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


# DDP accepts only runtime annotations on a hook (ours are strings under __future__).
_counting_allreduce.__annotations__ = {}


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _wrap(run: Run, model: nn.Module) -> nn.Module:
    if run.wrap == "ddp" and dist.is_initialized():
        return DDP(model, bucket_cap_mb=100)  # one bucket: hook calls = all-reduces
    if run.wrap == "ddp_compiled" and dist.is_initialized():
        return torch.compile(DDP(model, bucket_cap_mb=100), backend="eager", dynamic=True)  # type: ignore[return-value]
    if run.wrap == "fsdp2" and dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        assert isinstance(model, TinyLM)
        fully_shard(model.hidden)
        fully_shard(model)
    return model


def train_split(run: Run) -> Result:
    """Train with `run.loop` on this rank's share (rank 0 of 1 without torch.distributed)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = TinyLM().to(run.dtype)
    net = _wrap(run, model)
    opt = _optimizer(run.optimizer, model.parameters())
    seen: list[list[Tensor]] = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append([_full(p.grad) for p in model.parameters()])  # type: ignore[arg-type]
    )
    counter = [0]
    ddp = getattr(net, "_orig_mod", net)  # a torch.compile'd DDP
    if run.count_allreduces and isinstance(ddp, DDP):
        ddp.register_comm_hook(counter, _counting_allreduce)
    scaler = (
        None if run.init_scale is None else torch.amp.GradScaler("cpu", init_scale=run.init_scale)
    )
    acc = None
    if run.loop == "accumulator":
        acc = Accumulator(
            net,
            opt,
            scaler=scaler,
            max_grad_norm=run.max_grad_norm,
            grad_compression=run.grad_compression,
            grad_reduction=run.grad_reduction,  # type: ignore[arg-type]
            loss_reduction=run.loss_reduction,  # type: ignore[arg-type]
            on_nonfinite=run.on_nonfinite,  # type: ignore[arg-type]
            rank_local=run.wrap == "plain",  # the plain-module tests reduce (or not) themselves
        )
    stats: list[StepStats | float] = []
    grads: list[list[Tensor] | None] = []
    allreduces: list[int] = []
    for s, lengths in enumerate(run.lengths):
        mbs = split_for_ranks(make_sequences(lengths, seed=s), run.sizes[s])[rank]
        before, counter[0] = len(seen), 0
        if acc is not None:
            stats.append(acc.step(mbs, _loss_fn(run, rank, s)))
        else:
            stats.append(_naive_step(run, net, opt, mbs))
        grads.append(seen[-1] if len(seen) > before else None)
        allreduces.append(counter[0])
    params = [_full(p) for p in model.parameters()]
    extra = None if acc is None else (acc.comm_stats, acc.state_dict())
    del acc, net  # no DDP/FSDP wrapper outlives the call (workers are reused)
    return Result(stats=stats, grads=grads, params=params, allreduces=allreduces, extra=extra)


def _loss_fn(run: Run, rank: int, step: int) -> Any:
    calls = [0]

    def loss_fn(model: nn.Module, mb: MicroBatch) -> Any:
        k = calls[0]
        calls[0] += 1
        loss, n = lm_loss_sum(model, mb)
        if run.poison == (rank, step, k):
            loss = loss * float("inf")
        if run.loss_reduction == "mean":
            return loss / n.clamp(min=1), n
        if run.loss_reduction == "none":
            return loss.reshape(1)  # one "item" per micro-batch: a per-sample mode check
        return loss, n

    return loss_fn


def _naive_step(
    run: Run, net: nn.Module, opt: torch.optim.Optimizer, mbs: list[MicroBatch]
) -> float:
    """The classic loops that the Accumulator replaces; each is wrong in one way."""
    k = len(mbs)
    total = 0.0
    for i, mb in enumerate(mbs):
        if run.loop == "mean_of_means":  # correct sync, wrong normalisation
            with sync_context(net, i, k):
                loss = lm_loss_mean(net, mb) / k
                torch.autograd.backward(loss)
        elif run.loop == "no_no_sync":  # every backward all-reduces
            loss = lm_loss_mean(net, mb) / k
            torch.autograd.backward(loss)
        elif run.loop == "forward_outside_no_sync":  # DDP decides in the forward
            loss = lm_loss_mean(net, mb) / k
            with sync_context(net, i, k):
                torch.autograd.backward(loss)
        else:
            raise ValueError(run.loop)
        total += float(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    if dist.is_initialized():  # the usual logging: the mean over ranks of the local loss
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t)
        total = float(t) / dist.get_world_size()
    return total


def train_reference(run: Run) -> Result:
    """The whole concatenated batch in one process: loss = sum of token losses / all tokens."""
    model = TinyLM().to(run.dtype)
    opt = _optimizer(run.optimizer, model.parameters())
    losses: list[StepStats | float] = []
    grads: list[list[Tensor] | None] = []
    for s, lengths in enumerate(run.lengths):
        loss = whole_batch_loss(model, make_sequences(lengths, seed=s))
        losses.append(float(loss.detach()))
        if run.poison is not None and run.poison[1] == s:
            grads.append(None)  # the step is skipped on every rank
            continue
        torch.autograd.backward(loss)
        if run.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
        grads.append([p.grad.detach().clone() for p in model.parameters()])  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = [p.detach().clone() for p in model.parameters()]
    return Result(stats=losses, grads=grads, params=params, allreduces=[])


def run_split(world: int, run: Run) -> list[Result]:
    """`train_split` on `world` real gloo ranks (in this process when world is 1)."""
    if world == 1:
        return [train_split(run)]
    return run_ranks(world, train_split, run)


def _msg(where: str) -> Callable[[str], str]:
    """Prefix torch.testing's own mismatch report (it holds the numbers) with `where`."""
    return lambda m: f"{where}: {m}"


def assert_matches(got: Result, ref: Result, tol: dict[str, Any] = F64, where: str = "") -> None:
    """Loss per step, gradients per step and final parameters equal the reference."""
    for s, (st, ref_loss) in enumerate(zip(got.stats, ref.stats, strict=True)):
        loss = st.loss if isinstance(st, StepStats) else st
        assert isinstance(ref_loss, float)
        torch.testing.assert_close(loss, ref_loss, **tol, msg=_msg(f"{where} step {s} loss"))
    for s, (g, rg) in enumerate(zip(got.grads, ref.grads, strict=True)):
        assert (g is None) == (rg is None), f"{where} step {s}: stepped {g is not None}"
        for i, (a, b) in enumerate(zip(g or [], rg or [], strict=True)):
            torch.testing.assert_close(a, b, **tol, msg=_msg(f"{where} step {s} grad {i}"))
    for i, (a, b) in enumerate(zip(got.params, ref.params, strict=True)):
        torch.testing.assert_close(a, b, **tol, msg=_msg(f"{where} param {i}"))


# ---------------------------------------------------------------------------
# Whole-batch equivalence
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_matches_whole_batch_sgd(world: int, k: int) -> None:
    run = ragged_run(world, k)
    ref = train_reference(run)
    for r, got in enumerate(run_split(world, run)):
        assert_matches(got, ref, where=f"W={world} K={k} rank {r}")
        assert all(isinstance(st, StepStats) and st.micro_batches == k for st in got.stats)


@pytest.mark.parametrize(("world", "k"), [(2, 4), (3, 2)])
def test_matches_whole_batch_adamw_with_clipping(world: int, k: int) -> None:
    # max_grad_norm=0.2 is below every step's norm here (0.3-0.4), so clipping acts each step.
    run = ragged_run(world, k, optimizer="adamw", max_grad_norm=0.2)
    ref = train_reference(run)
    results = run_split(world, run)
    for r, got in enumerate(results):
        assert_matches(got, ref, where=f"rank {r}")
        assert all(isinstance(st, StepStats) and st.clip_coef < 1 for st in got.stats)
    # The reported loss, count and norm are identical (bitwise) on every rank.
    first = [st for st in results[0].stats if isinstance(st, StepStats)]
    for got in results[1:]:
        assert got.stats == first


def test_plain_module_grad_reduction_sum_and_mean() -> None:
    # A plain module is not reduced by us: each rank's gradient is factor * d(own losses / N).
    # The caller's own all-reduce (sum or mean, in an optimizer pre-hook) then yields
    # the whole-batch gradient; grad_reduction tells the Accumulator which factor to use.
    ref = train_reference(ragged_run(2, 2))
    for reduction in ("sum", "mean"):
        got = run_ranks(
            2, _plain_with_manual_reduce, ragged_run(2, 2, wrap="plain", grad_reduction=reduction)
        )
        for r, res in enumerate(got):
            assert_matches(res, ref, where=f"{reduction} rank {r}")


def _plain_with_manual_reduce(run: Run) -> Result:
    world = dist.get_world_size()

    def reduce_grads(o: torch.optim.Optimizer, a: Any, k: Any) -> None:
        for g in o.param_groups:
            for p in g["params"]:
                dist.all_reduce(p.grad)  # sum (gloo has no AVG)
                if run.grad_reduction == "mean":
                    p.grad /= world

    # A global hook (it runs before train_split's own capturing hook); removed below.
    handle = register_optimizer_step_pre_hook(reduce_grads)
    try:
        return train_split(run)
    finally:
        handle.remove()


def test_loss_reduction_modes_match() -> None:
    # "mean" (mean, count) is the same math as "sum"; "none" with one loss per
    # micro-batch makes micro-batches the items (a per-sample mean): its own reference.
    run = ragged_run(2, 2, loss_reduction="mean")
    ref = train_reference(run)
    for got in run_split(2, run):
        assert_matches(got, ref)
    per_mb = run_split(2, ragged_run(2, 2, loss_reduction="none", steps=1))
    sizes = uneven_sizes(2, 2)
    seqs = make_sequences(ragged_run(2, 2, steps=1).lengths[0], seed=0)
    model = TinyLM().double()
    mbs = [mb for rank in split_for_ranks(seqs, sizes) for mb in rank]
    expected = torch.stack([lm_loss_sum(model, mb)[0] for mb in mbs]).sum() / len(mbs)
    for got in per_mb:
        st = got.stats[0]
        assert isinstance(st, StepStats) and st.items == len(mbs)
        torch.testing.assert_close(st.loss, float(expected.detach()), **F64)


# ---------------------------------------------------------------------------
# The mutation: a mean-of-means loop
# ---------------------------------------------------------------------------


def test_mean_of_means_fails_on_ragged_data() -> None:
    # One step whose micro-batches all hold tokens (later steps of this data have an
    # all-padding micro-batch, where a mean of means is 0/0 = NaN: a second bug), so
    # the failure here is the weighting alone.
    run = dataclasses.replace(ragged_run(2, 2, steps=1), loop="mean_of_means")
    ref = train_reference(run)
    got = run_split(2, run)[0]
    assert all(torch.isfinite(g).all() for g in got.grads[0] or [])
    with pytest.raises(AssertionError):
        assert_matches(got, ref)
    # How wrong (reported in docs/accumulation.md): the whole gradient vector's error.
    g, rg = got.grads[0], ref.grads[0]
    assert g is not None and rg is not None
    flat, ref_flat = torch.cat([a.flatten() for a in g]), torch.cat([b.flatten() for b in rg])
    rel = float((flat - ref_flat).norm() / ref_flat.norm())
    assert rel > 1e-2, rel


def test_mean_of_means_passes_on_equal_length_data() -> None:
    # Every micro-batch the same number of sequences of the same length (no length-1
    # ones): every count is equal, so the mean of means is the global mean. This is
    # why the data above must be ragged: equal data cannot tell the loops apart.
    sizes = ((2, 2), (2, 2))
    run = Run(sizes=(sizes,) * 3, lengths=((6,) * 8,) * 3, loop="mean_of_means")
    ref = train_reference(run)
    for got in run_split(2, run):
        assert_matches(got, ref)
    for got in run_split(2, dataclasses.replace(run, loop="accumulator")):
        assert_matches(got, ref)


# ---------------------------------------------------------------------------
# Edge cases (one process; the multi-rank ones live in test_accumulate_dist.py)
# ---------------------------------------------------------------------------


def _one_process(lengths: Sequence[int], sizes: Sequence[int], **kw: Any) -> tuple[Result, Result]:
    run = Run(sizes=((tuple(sizes),),), lengths=(tuple(lengths),), wrap="plain", **kw)
    return train_split(run), train_reference(run)


def test_zero_item_micro_batch_adds_nothing() -> None:
    # The middle micro-batch holds two length-1 sequences: no targets at all.
    got, ref = _one_process([5, 3, 1, 1, 7], [2, 2, 1])
    assert_matches(got, ref)
    assert all(torch.isfinite(g).all() for g in got.grads[0] or [])


def test_short_last_window_uses_its_real_count() -> None:
    # Step 0 has K=4, step 1 a short window of K=2 with fewer tokens.
    sizes = (((2, 1, 2, 1),), ((1, 2),))
    run = Run(sizes=sizes, lengths=((4, 6, 2, 9, 3, 5), (8, 2, 5)), wrap="plain")
    got, ref = train_split(run), train_reference(run)
    assert_matches(got, ref)
    assert [st.micro_batches for st in got.stats if isinstance(st, StepStats)] == [4, 2]


def test_empty_step_raises() -> None:
    model = TinyLM().double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(WholebatchError, match="empty on every rank"):
        acc.step([], lm_loss_sum)


def test_step_with_no_items_is_skipped_without_nan() -> None:
    got, _ = _one_process([1, 1, 1], [2, 1])
    st = got.stats[0]
    assert isinstance(st, StepStats)
    assert st.skipped and st.items == 0 and "0 items" in (st.skip_reason or "")
    torch.testing.assert_close(got.params, [p.detach() for p in TinyLM().double().parameters()])


def test_stale_gradients_are_refused() -> None:
    model = TinyLM().double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mb = split_for_ranks(make_sequences([4, 5]), ((2,),))[0]
    torch.autograd.backward(lm_loss_sum(model, mb[0])[0])
    with pytest.raises(WholebatchError, match="already hold gradients"):
        acc.step(mb, lm_loss_sum)


def test_bad_loss_fn_output_is_named() -> None:
    model = TinyLM().double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mbs = split_for_ranks(make_sequences([4, 5]), ((2,),))[0]
    with pytest.raises(
        WholebatchError, match=r"loss_fn\(model, micro_batches\[0\]\) returned Tensor"
    ):
        acc.step(mbs, lambda m, mb: lm_loss_sum(m, mb)[0])
    with pytest.raises(WholebatchError, match="does not require grad"):
        acc.step(mbs, lambda m, mb: (torch.tensor(1.0), 3))


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        (dict(max_grad_norm=-1.0), "max_grad_norm=-1.0"),
        (dict(grad_reduction="avg"), "grad_reduction='avg'"),
        (dict(loss_reduction="token"), "loss_reduction='token'"),
        (dict(on_nonfinite="ignore"), "on_nonfinite='ignore'"),
        (dict(grad_compression="int8"), "grad_compression='int8'"),
        (dict(grad_compression="fp16"), "registers a DDP communication hook"),
        (dict(grad_compression="fp16", grad_reduction="sum"), "average over ranks"),
    ],
)
def test_bad_config_is_named(kwargs: dict[str, Any], text: str) -> None:
    model = TinyLM()
    with pytest.raises(WholebatchError, match=text.replace("(", r"\(")):
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_state_dict_round_trip() -> None:
    run = ragged_run(1, 2, wrap="plain", init_scale=2.0**8)
    got = train_split(run)
    _comm, state = got.extra
    model = TinyLM().double()
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=torch.amp.GradScaler("cpu")
    )
    acc.load_state_dict(state)
    assert acc.state_dict() == state
    assert acc.steps == 3 and acc.items_estimate == got.stats[-1].items  # type: ignore[union-attr]
    plain = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(WholebatchError, match="with a GradScaler"):
        plain.load_state_dict(state)
