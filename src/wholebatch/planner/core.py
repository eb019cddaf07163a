"""`wholebatch.plan`: memory, bytes and time of one whole-batch step per rank, before the run.

    plan(PlanConfig(loss="clip", batch=1_048_576, dim=768, world=64, act_mib=40, params=4.3e8))

Bytes come from the collectives' own size bookkeeping (`wholebatch.planner.traffic`),
loss memory from the kernels' measured buffer counts (`wholebatch.planner.memory`),
times from bandwidths and FLOP rates the caller gives. Everything is per rank
and per optimizer step; a rank is one GPU. See docs/plan.md.

Legend: W ranks, N global rows, B a rank's rows (the largest, with an uneven
split), D dim, K micro-batches per rank, T tile.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

from wholebatch.errors import WholebatchError
from wholebatch.planner.config import PlanConfig
from wholebatch.planner.memory import LOSS_STRATEGY, loss_memory
from wholebatch.planner.traffic import (
    Collective,
    ddp_grad_traffic,
    loss_traffic,
    representative_ranks,
)

__all__ = ["MemoryPlan", "Plan", "Strategy", "Times", "plan", "split_rows"]

MIB = 2**20
_TILES = (512, 1024, 2048, 4096, 8192, 16384)
# Reads + writes of one logits element per forward + backward, counted from the
# kernels' tile loops (losses/tiles.py): the elementwise passes a GPU pays in
# memory bandwidth, since the kernels are not fused.
_PASSES = {"clip": 27, "info_nce": 14, "nt_xent": 27, "siglip": 22}


def split_rows(n: int, w: int) -> list[int]:
    """N rows over W ranks as evenly as possible (the first N mod W ranks get one more)."""
    return [n // w + (1 if r < n % w else 0) for r in range(w)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Bytes on the busiest rank at the step's peak, and what makes them up."""

    static: int
    """Parameters x state_bytes (weights, gradients, optimizer state)."""
    activations: int
    """The model's activations of one micro-batch (act_mib x its rows)."""
    cache: int
    """Gradient caching's extra: the cached embeddings' gradients kept through pass 2 (0 at K = 1)."""
    loss: int
    """The whole-batch loss's forward + backward (0 for tokens)."""
    peak: int
    """The larger of the loss phase and the micro-batch phase."""
    budget: int
    """Bytes tensors may use (memory_gib - reserve_gib)."""
    peak_phase: str
    """"loss" or "micro-batch": which phase sets the peak."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Times:
    """Seconds per step on one rank (estimates: bandwidth and FLOP rates as given, no overlap)."""

    model: float
    """The model's forward + backward over the rank's rows (+ one forward more with caching)."""
    loss: float
    """The tiled loss: matmul FLOPs or its elementwise passes through device memory, the larger."""
    loss_comm: float
    """The loss's collectives: bytes / bandwidth + message rounds x latency."""
    ddp_comm: float
    """DDP's gradient all-reduce (DDP overlaps it with the backward; counted in full here)."""

    @property
    def step(self) -> float:
        return self.model + self.loss + self.loss_comm + self.ddp_comm


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """One way to compute a contrastive loss over the whole batch, sized for this run."""

    name: str
    in_wholebatch: bool
    loss_memory: int
    sent: int
    received: int
    comm_seconds: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What one step costs per rank. `format()` for tables, `to_json()` for machines."""

    config: PlanConfig
    rows_per_rank: tuple[int, int]
    """(smallest, largest) B."""
    ranks_counted: tuple[int, ...]
    """The ranks whose collectives were walked (all others are bounded by them)."""
    micro_batches: int
    micro_batch_rows: int
    tile: int
    fits: bool
    memory: MemoryPlan
    collectives: tuple[Collective, ...]
    """The busiest rank's collectives, forward and backward."""
    times: Times
    max_batch: int | None
    """The largest global batch whose step fits at some K (None: unbounded, tokens)."""
    max_batch_at_k: int | None
    """The largest global batch at the chosen K."""
    strategies: tuple[Strategy, ...]
    assumptions: tuple[str, ...]
    seconds: float
    """Wall time the planner took."""

    def bytes(self, phase: str | None = None) -> tuple[int, int]:
        """(sent, received) bytes per rank per step, over `phase` ("forward"/"backward") or both."""
        rows = [c for c in self.collectives if phase is None or c.phase == phase]
        return sum(c.sent for c in rows), sum(c.received for c in rows)

    def to_json(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["config"] = dataclasses.asdict(self.config)
        out["times"] = {**dataclasses.asdict(self.times), "step": self.times.step}
        fs, fr = self.bytes("forward")
        bs, br = self.bytes("backward")
        out["bytes_per_rank"] = {
            "forward_sent": fs, "forward_received": fr, "backward_sent": bs, "backward_received": br,
        }  # fmt: skip
        return out

    def format(self) -> str:
        from wholebatch.planner.report import format_plan

        return format_plan(self)


# ---------------------------------------------------------------------------
# Memory per phase
# ---------------------------------------------------------------------------


def _static(c: PlanConfig) -> int:
    return int(c.params * c.state_bytes)


def _act(c: PlanConfig, rows: int) -> int:
    return int(c.act_mib * MIB * rows)


def _memory(c: PlanConfig, n: int, b: int, k: int, tile: int) -> MemoryPlan:
    static = _static(c)
    rows = math.ceil(b / k) if b else 0
    act = _act(c, rows)
    if c.loss == "tokens":
        peak = static + act
        return MemoryPlan(
            static=static, activations=act, cache=0, loss=0, peak=peak, budget=c.budget,
            peak_phase="micro-batch",
        )  # fmt: skip
    lmem = loss_memory(
        c.loss, strategy=LOSS_STRATEGY[c.loss], n=n, b=b, dim=c.dim, elem=c.elem, acc=c.acc,
        tile=tile, w=c.world,
    )  # fmt: skip
    emb = 2 * b * c.dim * c.elem  # two embeddings per row (two towers, or nt_xent's two views)
    if k == 1:  # no caching: the loss runs while the batch's activations are alive
        peak = static + act + lmem
        return MemoryPlan(
            static=static, activations=act, cache=0, loss=lmem, peak=peak, budget=c.budget,
            peak_phase="loss",
        )  # fmt: skip
    loss_phase = static + emb + lmem
    mb_phase = static + emb + act  # pass 2 keeps the embeddings' gradients (emb bytes)
    return MemoryPlan(
        static=static, activations=act, cache=emb, loss=lmem, peak=max(loss_phase, mb_phase),
        budget=c.budget, peak_phase="loss" if loss_phase >= mb_phase else "micro-batch",
    )  # fmt: skip


def _choose_k(c: PlanConfig, n: int, b: int, tile: int) -> int:
    """The smallest K whose step fits (K = B if none does: the least memory there is)."""
    if c.micro_batches:
        return c.micro_batches
    if b == 0 or _memory(c, n, b, 1, tile).peak <= c.budget:
        return 1
    per_row = _act(c, 1)
    fixed = _memory(c, n, b, b, tile).peak - per_row  # everything but one row's activations
    if per_row == 0 or fixed + per_row > c.budget:
        return b
    rows = max(1, (c.budget - fixed) // per_row)
    k = max(2, math.ceil(b / rows))
    # ceil(B / K) rows per micro-batch: settle the estimate on the exact smallest K
    while k > 2 and _memory(c, n, b, k - 1, tile).peak <= c.budget:
        k -= 1
    while k < b and _memory(c, n, b, k, tile).peak > c.budget:
        k += 1
    return k


def _choose_tile(c: PlanConfig, n: int, b: int) -> int:
    """The smallest tile (>= 512) giving at most 1,024 tiles per sweep, within 1/16 of the budget.

    One Python-level iteration per tile: on a GPU, a sweep of a few hundred
    large tiles keeps the device busy where 512-row tiles at N = 1M would
    launch millions of small kernels. Unmeasured on a GPU here: a heuristic.
    """
    if c.tile:
        return c.tile
    rows = 2 * b if c.loss == "nt_xent" else b
    cols = 2 * n if c.loss == "nt_xent" else (b if c.loss == "siglip" else n)
    best = _TILES[0]
    for t in _TILES:
        if 2 * t * t * c.acc > c.budget // 16:
            break
        best = t
        if math.ceil(rows / t) * math.ceil(cols / t) <= 1024:
            break
    return best


def _fits_any_k(c: PlanConfig, n: int) -> bool:
    b = math.ceil(n / c.world)
    tile = _choose_tile(c, n, b)  # the tile a plan at this batch would choose
    k = c.micro_batches or max(1, b)
    return _memory(c, n, b, min(k, max(b, 1)), tile).peak <= c.budget


def _largest_batch(c: PlanConfig, fixed_k: bool) -> int | None:
    if c.loss == "tokens" and not fixed_k:
        return None  # more micro-batches always fit: activations are one micro-batch's
    probe = c if fixed_k else dataclasses.replace(c, micro_batches=0)
    lo, hi = 0, c.world
    while _fits_any_k(probe, hi):
        lo, hi = hi, hi * 2
        if hi > 2**50:
            return None
    while hi - lo > max(1, lo // 1000):  # to 0.1%: no false precision
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits_any_k(probe, mid) else (lo, mid)
    return lo


# ---------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------


def _bandwidth(c: PlanConfig) -> float:
    return (c.inter_gbs if c.world > c.gpus_per_node else c.intra_gbs) * 1e9


def _comm_seconds(c: PlanConfig, rows: Sequence[Collective]) -> float:
    bw = _bandwidth(c)
    return sum(r.sent / bw + r.steps * c.latency_us * 1e-6 for r in rows)


def _times(c: PlanConfig, n: int, b: int, k: int, loss_rows: list[Collective]) -> Times:
    flops = c.flops_per_sample or 6.0 * c.params * c.tokens
    cached = c.loss != "tokens" and k > 1
    model = flops * b * (4 / 3 if cached else 1.0) / (c.tflops * 1e12)
    loss_s = 0.0
    if c.loss != "tokens":
        if c.loss == "nt_xent":
            elements = (2 * n) ** 2 / 2 / c.world  # the upper triangle, dealt over the ranks
            mm = 16.0 * n * n * c.dim / c.world
        else:
            elements = float(b) * n
            mm = 8.0 * b * n * c.dim
        loss_s = max(mm / (c.tflops * 1e12), elements * _PASSES[c.loss] * c.acc / (c.hbm_gbs * 1e9))
    ddp = ddp_grad_traffic(int(c.params), c.grad_bytes, c.world)
    return Times(
        model=model,
        loss=loss_s,
        loss_comm=_comm_seconds(c, loss_rows),
        ddp_comm=_comm_seconds(c, ddp),
    )


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------


class _Traffic:
    """`loss_traffic` for one run, memoised per (loss, rank): a ring at W = 65,536 is walked once."""

    def __init__(self, c: PlanConfig, sizes: Sequence[int]) -> None:
        self.c, self.sizes = c, sizes
        self._memo: dict[tuple[str, int], list[Collective]] = {}

    def __call__(self, loss: str, rank: int) -> list[Collective]:
        key = (loss, rank)
        if key not in self._memo:
            c = self.c
            self._memo[key] = loss_traffic(loss, self.sizes, rank, c.dim, c.elem, c.acc)
        return self._memo[key]


def _strategy_traffic(name: str, loss: str, rank: int, traffic: _Traffic) -> list[Collective]:
    if name == "ring + tiled":
        return traffic("siglip", rank)
    if loss == "nt_xent":  # every strategy gathers [z1 | z2]
        return traffic("nt_xent", rank)
    gather = traffic("info_nce", rank)
    if name == "gather + tiled":
        return traffic(loss if loss != "siglip" else "info_nce", rank)
    # naive and local (open_clip, DisCo-CLIP) gather the images too, and return their gradients
    images = [
        dataclasses.replace(x, name=x.name.replace("text", "image"))
        for x in gather
        if "text" in x.name
    ]
    return gather + images


def _strategies(
    c: PlanConfig, n: int, sizes: Sequence[int], rank: int, tile: int, traffic: _Traffic
) -> list[Strategy]:
    if c.loss == "tokens":
        return []
    b = sizes[rank]
    names = ["gather + tiled", "ring + tiled", "local", "naive"]
    out = []
    for name in names:
        mem = loss_memory(
            c.loss, strategy=name, n=n, b=b, dim=c.dim, elem=c.elem, acc=c.acc, tile=tile, w=c.world
        )
        rows = _strategy_traffic(name, c.loss, rank, traffic)
        out.append(
            Strategy(
                name=name,
                in_wholebatch=name == LOSS_STRATEGY[c.loss],
                loss_memory=mem,
                sent=sum(r.sent for r in rows),
                received=sum(r.received for r in rows),
                comm_seconds=_comm_seconds(c, rows),
            )
        )
    return out


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------


def plan(config: PlanConfig | None = None, *, sizes: Sequence[int] | None = None) -> Plan:
    """Size one optimizer step of `config` on each rank: memory, bytes, time, K, tile, limits.

    Args:
        config: the run (default: `PlanConfig()`).
        sizes: rows per rank, if not an even split of `config.batch` over
            `config.world` (they must sum to `batch` and have `world` entries).

    Returns:
        A `Plan`; `plan.format()` renders tables, `plan.to_json()` a dict.
    """
    t0 = time.perf_counter()
    c = config or PlanConfig()
    if sizes is None:
        rows = split_rows(c.batch, c.world)
    else:
        rows = [int(s) for s in sizes]
        if len(rows) != c.world or sum(rows) != c.batch or min(rows) < 0:
            raise WholebatchError(
                f"plan: sizes must have world={c.world} entries >= 0 summing to batch={c.batch}; "
                f"got {len(rows)} entries summing to {sum(rows)}"
            )
    n, b = c.batch, max(rows)
    tile = _choose_tile(c, n, b)
    k = _choose_k(c, n, b, tile)
    mem = _memory(c, n, b, k, tile)
    ranks = representative_ranks(rows)
    traffic = _Traffic(c, rows)
    per_rank = {}
    for r in ranks:
        coll = [] if c.loss == "tokens" else traffic(c.loss, r)
        per_rank[r] = coll + ddp_grad_traffic(int(c.params), c.grad_bytes, c.world)
    busiest = max(ranks, key=lambda r: (sum(x.sent + x.received for x in per_rank[r]), rows[r]))
    collectives = per_rank[busiest]
    loss_rows = [x for x in collectives if not x.name.startswith("DDP")]
    times = _times(c, n, b, k, loss_rows)
    return Plan(
        config=c, rows_per_rank=(min(rows), b), ranks_counted=tuple(ranks), micro_batches=k,
        micro_batch_rows=math.ceil(b / k) if b else 0, tile=tile, fits=mem.peak <= c.budget,
        memory=mem, collectives=tuple(collectives), times=times,
        max_batch=_largest_batch(c, fixed_k=False),
        max_batch_at_k=_largest_batch(dataclasses.replace(c, micro_batches=k), fixed_k=True),
        strategies=tuple(_strategies(c, n, rows, busiest, tile, traffic)),
        assumptions=tuple(_assumptions(c)), seconds=time.perf_counter() - t0,
    )  # fmt: skip


def _assumptions(c: PlanConfig) -> list[str]:
    link = "inter-node" if c.world > c.gpus_per_node else "intra-node"
    out = [
        "per rank, per optimizer step; memory in GiB = 2^30 bytes, bytes exact for the library's collectives",
        f"rings cross the {link} link: {c.inter_gbs if link == 'inter-node' else c.intra_gbs:g} GB/s "
        f"per GPU per direction, {c.latency_us:g} us per message round; no overlap of communication and compute",
        "all-reduce: ring model 2(W-1)/W of the tensor (NCCL trees/NVLS move less at scale)",
        "DDP replicas (no FSDP sharding); the model's activations scale with micro-batch rows",
        f"loss memory: measured buffer counts of the CPU kernels ({c.dtype} in, float32 compute for 16-bit)",
    ]
    if c.loss != "tokens":
        out.append("K > 1 uses gradient caching (CachedStep): one extra forward per micro-batch")
    if c.act_mib == 0:
        out.append(
            "act_mib = 0: model activations not counted (measure them: wholebatch.planner.measure_model)"
        )
    if c.loss == "info_nce":
        out.append(
            "info_nce: modelled as the one-directional TiledLSE over all-gathered keys (issue 12)"
        )
    return out
