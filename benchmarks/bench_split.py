"""The split, round 2, side by side: the replicas' input fingerprint, modules on their own
data-parallel dims, whole-batch auxiliary losses; each against the loop it replaces.

    python -m benchmarks.bench_split                 # every part, 20 timed steps per method
    python -m benchmarks.bench_split --quick         # 6 timed steps per method
    python -m benchmarks.bench_split --only moe      # one part: fingerprint | modules | moe

Every method trains its own copy of the same model on the same batches; each step runs
every method in turn after a barrier, the order rotated step by step; a step's time is
the slowest rank's. Tables: each method's median, the ratio of medians, and "paired":
the median over steps of (method / baseline) on the same step. One thread per rank.

- fingerprint (dp2 x tp2, 4 gloo ranks; FSDP2 on dp, Colwise/Rowwise on tp, an
  embedding-MLP LM of vocabulary 2000 and width 256, K = 4 micro-batches of 8 x 64
  tokens): `Accumulator(check_inputs=True)` against `check_inputs=False` (the step
  before the fingerprint), and a second `check_inputs=False` copy (the A/A pair: the
  noise floor of the ratios); the agreements (all-gathers of `agree_rows`) per step, and
  the fingerprint's own time (200 calls on one step's micro-batches).
- modules (the same mesh; a patch encoder FSDP2 on all 4 ranks, 256 -> 256, beside a
  prefix LM on dp2 x tp2, vocabulary 2000, width 256; K = 4, 8 x 64 tokens, two
  patches a sequence; clipping at 1.0): `Accumulator(module_batch_dims=...)` against
  the hand-written exact loop (`tests/support/mesh_modules.hand_step`: grads x 4/N
  and x 2/N, the norm of both, clip).
- moe (W = 2, DDP; the MoE LM of `tests/support/moe_cases.py` at width 128, 4 MoE
  blocks of 8 experts, top-2, vocabulary 2000, float32, under activation checkpointing; K = 4 micro-batches
  of 8 x 64 tokens): the `Accumulator` (counting pass) against the same counting pass
  written by hand; the deferred correction (exact: every micro-batch forward and
  backward on the main loss, the counts agreed, then each micro-batch's forward up to
  its router again and the backward of the aux loss with the whole batch's f, the
  gradients x W/N at the end); and the per-micro-batch aux loss (not exact: what the
  exactness costs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

K = 4
VOCAB, DIM = 2000, 256
S, T = 8, 64
IGNORE = -100


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _tokens(step: int, shard: int, vocab: int = VOCAB) -> list[tuple[Tensor, Tensor]]:
    """This data shard's K micro-batches at `step`: S x T tokens, ragged targets."""
    gen = torch.Generator().manual_seed(1000 * step + shard)
    out = []
    for _ in range(K):
        tokens = torch.randint(1, vocab, (S, T), generator=gen)
        lengths = torch.randint(1, T + 1, (S, 1), generator=gen)
        targets = tokens.roll(-1, 1).masked_fill(torch.arange(T) >= lengths, IGNORE)
        out.append((tokens, targets))
    return out


def _time_methods(
    methods: dict[str, Callable[[int], Any]], steps: int, warmup: int
) -> dict[str, list[float]]:
    """Every method once per step, the order rotated, each after a barrier: slowest rank's s."""
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    for s in range(warmup + steps):
        order = names[s % len(names) :] + names[: s % len(names)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            methods[name](s)
            elapsed = _slowest(time.perf_counter() - t0)
            if s >= warmup:
                times[name].append(elapsed)
    return times


def _table(title: str, times: dict[str, list[float]], base: str, extra: dict[str, str]) -> None:
    print(title)
    print(f"{'method':<28}{'median ms':>11}{'ratio':>8}{'paired':>8}  {'':<0}")
    b = times[base]
    for name, ts in times.items():
        ratio = statistics.median(ts) / statistics.median(b)
        paired = statistics.median(x / y for x, y in zip(ts, b, strict=True))
        print(
            f"{name:<28}{1e3 * statistics.median(ts):>11.1f}{ratio:>8.3f}{paired:>8.3f}  {extra.get(name, '')}"
        )
    print()


# ---------------------------------------------------------------------------
# fingerprint
# ---------------------------------------------------------------------------


def _lm(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from tests.support.models import TinyLM

    model = TinyLM(vocab=VOCAB, dim=DIM)
    parallelize_module(model, mesh["tp"], {"hidden": ColwiseParallel(), "out": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def _lm_loss(model: nn.Module, mb: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    tokens, targets = mb
    logits = model(tokens)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
        reduction="sum",
    )  # fmt: skip
    return loss, (targets != IGNORE).sum()


def fingerprint_rank(steps: int, warmup: int) -> dict[str, Any]:
    from tests.support.mesh_cases import get_mesh
    from wholebatch.comm import agree
    from wholebatch.comm.mesh import MeshSplit
    from wholebatch.train.accumulate import Accumulator

    torch.set_num_threads(1)
    mesh = get_mesh((("dp", 2), ("tp", 2)))
    dp = MeshSplit(mesh=mesh, batch_dims=("dp",)).coordinate()["dp"]
    engines = {}
    # An A/A pair beside A/B: the second copy without the fingerprint shows the noise floor.
    for name, check in (
        ("check_inputs=False", False),
        ("check_inputs=True", True),
        ("check_inputs=False, again", False),
    ):
        model = _lm(mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engines[name] = Accumulator(model, opt, mesh=mesh, batch_dims=("dp",), check_inputs=check)
    calls = {"n": 0}
    start = agree.start_rows

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return start(*args, **kwargs)

    agreements: dict[str, int] = {}
    agree.start_rows = counted  # type: ignore[assignment]
    try:
        for name, acc in engines.items():
            before = calls["n"]
            acc.step(_tokens(0, dp), _lm_loss)
            agreements[name] = calls["n"] - before
        times = _time_methods(
            {n: (lambda s, a=a: a.step(_tokens(s, dp), _lm_loss)) for n, a in engines.items()},
            steps,
            warmup,
        )
    finally:
        agree.start_rows = start  # type: ignore[assignment]
    from wholebatch.train.feeds import feed_fields

    split = MeshSplit(mesh=mesh, batch_dims=("dp",))
    mbs = {"micro_batches": _tokens(0, dp)}
    row = feed_fields(split, mbs)
    calls = []
    for _ in range(200):  # the fingerprint alone: its cost per step, without the noise of a step
        t0 = time.perf_counter()
        feed_fields(split, mbs)
        calls.append(time.perf_counter() - t0)
    return {
        "times": times,
        "agreements": agreements,
        "fingerprint_us": 1e6 * statistics.median(calls),
        "row_bytes": 8 * len(row),
    }


# ---------------------------------------------------------------------------
# modules on their own dims
# ---------------------------------------------------------------------------

P = 256


def modules_rank(steps: int, warmup: int) -> dict[str, Any]:
    from tests.support import mesh_modules as mm
    from wholebatch.train.accumulate import Accumulator

    torch.set_num_threads(1)
    models = {}
    for name in ("hand-written", "Accumulator"):
        vlm = mm.VisionLM(P, DIM, VOCAB).float()
        models[name], mesh = mm._build(vlm)
    dp, _ = mm._coords(mesh)
    loss_fn = mm.make_loss_fn(mesh)
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}
    acc = Accumulator(
        models["Accumulator"],
        opts["Accumulator"],
        mesh=mesh,
        batch_dims=("dp",),
        module_batch_dims={models["Accumulator"].encoder: ("dp_enc",)},
        max_grad_norm=1.0,
    )

    def batch(s: int) -> list[Any]:
        gen = torch.Generator().manual_seed(77 + s)
        return [(t, y, torch.randn(S, 2, P, generator=gen)) for t, y in _tokens(s, dp)]

    times = _time_methods(
        {
            "hand-written": lambda s: mm.hand_step(
                models["hand-written"], opts["hand-written"], mesh, batch(s), loss_fn, clip=1.0
            ),
            "Accumulator": lambda s: acc.step(batch(s), loss_fn),
        },
        steps,
        warmup,
    )
    return {"times": times}


# ---------------------------------------------------------------------------
# MoE auxiliary losses
# ---------------------------------------------------------------------------

MOE = {"experts": 8, "dim": 128, "vocab": VOCAB, "blocks": 4, "dtype": torch.float32}


def _moe_deferred(wrapped: nn.Module, model: Any, opt: Any, mbs: list[Any], top_k: int) -> None:
    """Exact by a deferred correction: main loss first, then each router's share again."""
    from tests.support import moe_cases as mc
    from tests.support.models import PAD

    w = dist.get_world_size()
    totals: Tensor | None = None  # every block's (counts_E, T), then N
    for mb in mbs:  # every backward local: one all-reduce at the end carries both parts
        with wrapped.no_sync():  # type: ignore[operator]
            main, n = mc.ce_sum(wrapped, mb)
            st = mc.router_sums(model, (mb[0] != PAD).reshape(-1))
            main.backward()
        row = torch.cat([mc._pack(st), n.reshape(1).double()])
        totals = row if totals is None else totals + row
    assert totals is not None
    dist.all_reduce(totals)
    n_items = float(totals[-1])
    for p in model.parameters():  # the main part: x W / N (the all-reduce below averages)
        if p.grad is not None:
            p.grad.mul_(w / n_items)
    for mb in mbs:  # the correction: up to the last router only, and its backward
        model.trunk(mb[0])  # fills each block's block_out (the graph to its router)
        st = mc.router_sums(model, (mb[0] != PAD).reshape(-1))
        (w * mc.aux_value(st, top_k, totals[:-1])).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce (mean), as DDP's bucket
    dist.all_reduce(flat)
    flat /= w
    for g, new in zip(grads, torch.split(flat, [g.numel() for g in grads]), strict=True):
        g.copy_(new.view_as(g))
    opt.step()
    opt.zero_grad(set_to_none=True)


def moe_rank(steps: int, warmup: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.support import moe_cases as mc
    from wholebatch.train.accumulate import Accumulator

    torch.set_num_threads(1)
    rank = dist.get_rank()
    case = mc.MoECase(top_k=2)
    methods: dict[str, Callable[[int], Any]] = {}
    keep: list[Any] = []
    for name in (
        "hand-written counting pass",
        "Accumulator",
        "deferred correction",
        "per-micro-batch (inexact)",
    ):
        model = mc.TinyMoE(2, **MOE)  # type: ignore[arg-type]
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        keep.append((model, ddp, opt))
        if name == "Accumulator":
            acc = Accumulator(ddp, opt)
            methods[name] = lambda s, acc=acc: acc.step(_tokens(s, rank), mc.ce_sum)
        elif name == "deferred correction":
            methods[name] = lambda s, m=model, d=ddp, o=opt: _moe_deferred(
                d, m, o, _tokens(s, rank), 2
            )
        else:
            fn = mc._HAND["hand" if name.startswith("hand") else "per_micro_batch"]
            methods[name] = lambda s, m=model, d=ddp, o=opt, fn=fn: fn(
                case, d, m, o, _tokens(s, rank), None
            )
    return {"times": _time_methods(methods, steps, warmup)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 timed steps instead of 20")
    parser.add_argument("--only", choices=("fingerprint", "modules", "moe"))
    args = parser.parse_args()
    steps = 6 if args.quick else 20
    from benchmarks import bench_split as me  # pickled by module name, not __main__
    from tests.support.harness import run_ranks, shutdown_worlds

    parts = [args.only] if args.only else ["fingerprint", "modules", "moe"]
    try:
        if "fingerprint" in parts:
            out = run_ranks(4, me.fingerprint_rank, steps, 2, timeout=1800)[0]
            extra = {n: f"agreements/step {a}" for n, a in out["agreements"].items()}
            extra["check_inputs=True"] += (
                f"; the fingerprint alone {out['fingerprint_us']:.0f} us/step, "
                f"+{out['row_bytes']} bytes in the row"
            )
            _table(
                f"fingerprint: dp2 x tp2, K={K}, {S}x{T} tokens per micro-batch, {steps} steps",
                out["times"], "check_inputs=False", extra,
            )  # fmt: skip
        if "modules" in parts:
            out = run_ranks(4, me.modules_rank, steps, 2, timeout=1800)[0]
            _table(
                f"modules: encoder on dp_enc=4 beside an LM on dp2 x tp2, K={K}, {steps} steps",
                out["times"], "hand-written", {},
            )  # fmt: skip
        if "moe" in parts:
            out = run_ranks(2, me.moe_rank, steps, 2, timeout=1800)[0]
            _table(
                f"moe: W=2 DDP, top-2 of 8 experts, checkpointing, K={K}, {steps} steps",
                out["times"], "hand-written counting pass", {},
            )  # fmt: skip
    finally:
        shutdown_worlds()


if __name__ == "__main__":
    main()
