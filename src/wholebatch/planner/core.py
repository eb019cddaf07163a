"""`wholebatch.plan`: memory, bytes and time of one whole-batch step per rank, before the run.

    plan(PlanConfig(loss="clip", batch=1_048_576, dim=768, world=64, act_mib=40, params=4.3e8))

Bytes come from the collectives' own size bookkeeping (`wholebatch.planner.traffic`),
loss memory from the kernels' measured buffer counts (`wholebatch.planner.memory`),
times from bandwidths and FLOP rates the caller gives. Everything is per rank
and per optimizer step; a rank is one GPU. See docs/plan.md.

On a device mesh (`PlanConfig.mesh`, `wholebatch.planner.mesh`) the items are split
over the batch group (dp_replicate x dp x cp ranks), the loss's collectives run
over it, state is divided over tp x pp and FSDP2's dp x cp, and each collective
names the dims it runs over.

Legend: W ranks, N global rows, B a rank's rows (the largest, with an uneven
split), D dim, K micro-batches per rank, T tile.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

from wholebatch.errors import WholebatchError
from wholebatch.losses.sizing import auto_strategy, tile_size_for
from wholebatch.losses.specs import COLUMN_PASSES, SPECS
from wholebatch.planner.config import PlanConfig
from wholebatch.planner.memory import STRATEGY_NAMES, loss_memory
from wholebatch.planner.mesh import ENGINE_ROW_FIELDS
from wholebatch.planner.traffic import (
    Collective,
    ddp_grad_traffic,
    engine_row_traffic,
    gather_traffic,
    loss_traffic,
    mesh_grad_traffic,
    representative_ranks,
    ring_traffic,
)

__all__ = ["MemoryPlan", "Plan", "Strategy", "Times", "plan", "split_rows"]

MIB = 2**20


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
    """Gradient caching's extra: the cached embeddings during the loss, their gradients through
    pass 2 (0 at K = 1)."""
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
    """The model's forward + backward over the rank's rows (+ K - 1 micro-batches' forwards with caching)."""
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
    other_stages_peak: int | None = None
    """On a mesh with pp > 1: the peak of a rank of any stage but the last (which holds the
    loss, and is the busiest one `memory` describes): its parameters and activations."""

    @property
    def bubble(self) -> float | None:
        """On a mesh with pp > 1: the share of a GPipe / 1F1B schedule a stage idles at this K,
        (pp - 1) / (K + pp - 1); None without a pipeline."""
        m = self.config.mesh_shape
        pp = m.size("pp") if m is not None else 1
        if pp <= 1:
            return None
        return (pp - 1) / (self.micro_batches + pp - 1)

    def bytes(self, phase: str | None = None) -> tuple[int, int]:
        """(sent, received) bytes per rank per step, over `phase` ("forward"/"backward") or both."""
        rows = [c for c in self.collectives if phase is None or c.phase == phase]
        return sum(c.sent for c in rows), sum(c.received for c in rows)

    def bytes_by_dims(self) -> dict[str, tuple[int, int]]:
        """(sent, received) bytes per rank per step by the mesh dims each collective runs
        over ("dp x cp": the batch group; "": a flat world), in the order they first occur."""
        out: dict[str, tuple[int, int]] = {}
        for c in self.collectives:
            sent, received = out.get(c.dims, (0, 0))
            out[c.dims] = (sent + c.sent, received + c.received)
        return out

    def to_json(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["config"] = dataclasses.asdict(self.config)
        out["times"] = {**dataclasses.asdict(self.times), "step": self.times.step}
        out["pipeline_bubble"] = self.bubble
        fs, fr = self.bytes("forward")
        bs, br = self.bytes("backward")
        out["bytes_per_rank"] = {
            "forward_sent": fs,
            "forward_received": fr,
            "backward_sent": bs,
            "backward_received": br,
        }
        if self.config.mesh:
            out["bytes_per_dims"] = {
                d or "world": {"sent": s, "received": r}
                for d, (s, r) in self.bytes_by_dims().items()
            }
        return out

    def format(self) -> str:
        from wholebatch.planner.report import format_plan

        return format_plan(self)


# ---------------------------------------------------------------------------
# Memory per phase
# ---------------------------------------------------------------------------


def _static(c: PlanConfig) -> int:
    """Parameters x state_bytes on one rank: all of them in a flat world (DDP); on a mesh
    the rank's 1/(tp x pp) part, of which FSDP2 keeps 1/(dp x cp)."""
    m = c.mesh_shape
    if m is None:
        return int(c.params * c.state_bytes)
    return int(c.params * c.state_bytes / (m.model_split * m.shard))


def grad_traffic(c: PlanConfig) -> list[Collective]:
    """The step's data-parallel gradient collectives on one rank: DDP's all-reduce over W,
    or on a mesh FSDP2's over dp x cp and DDP's / HSDP's over dp_replicate (traffic.py)."""
    m = c.mesh_shape
    if m is None:
        return ddp_grad_traffic(int(c.params), c.grad_bytes, c.world)
    return mesh_grad_traffic(
        c.params / m.model_split,
        c.grad_bytes,
        c.param_bytes,
        m.shard,
        m.size("dp_replicate"),
        shard_dims=m.label(("dp", "cp")),
        replicate_dims=m.label(("dp_replicate",)),
    )


def _engine_rows(c: PlanConfig) -> list[Collective]:
    """On a mesh, the engine's agreement rows (loss "tokens": `Accumulator`, or
    `PipelineAccumulator` with pp > 1), over every rank of the mesh."""
    m = c.mesh_shape
    if m is None or c.loss != "tokens":
        return []
    engine = "pipeline" if m.size("pp") > 1 else "accumulator"
    fields = dict(ENGINE_ROW_FIELDS[engine])
    if m.size("tp") > 1:  # replicas to compare: the inputs' fingerprint rides on `begin`
        fields["begin"] += 6  # train/feeds.py `feed_fields`: leaves, layout, 4 sums
    return engine_row_traffic(fields, m.world, m.world_label)


def _act(c: PlanConfig, rows: int) -> int:
    return int(c.act_mib * MIB * rows)


def _embeddings(c: PlanConfig, b: int) -> int:
    """Bytes of the embeddings the loss receives on a rank of `b` rows (two per row, + k
    negatives; maxsim's token sets)."""
    spec = SPECS[c.loss]
    if spec.kernel == "tokens":
        return (c.query_tokens + c.doc_tokens) * b * c.dim * c.elem
    return spec.embeddings_per_row(c.negatives) * b * c.dim * c.elem


def resolved_strategy(c: PlanConfig, n: int) -> str:
    """ "gather" or "ring": what the loss runs at a global batch of `n` (the losses' own rule)."""
    spec = SPECS[c.loss]
    want = c.strategy or spec.default_strategy
    if want == "auto":
        return auto_strategy(n * spec.key_rows(c.negatives) * c.dim * c.elem)
    return want


def _own(c: PlanConfig, n: int) -> str:
    """The planner's name of the strategy the loss runs."""
    return STRATEGY_NAMES[resolved_strategy(c, n)]


def _loss_memory(c: PlanConfig, n: int, b: int, tile: int, strategy: str | None = None) -> int:
    return loss_memory(
        c.loss,
        strategy=strategy or _own(c, n),
        n=n,
        b=b,
        dim=c.dim,
        elem=c.elem,
        acc=c.acc,
        tile=tile,
        w=c.shards,
        negatives=c.negatives,
        directions=c.direction_list,
        tokens=(c.query_tokens, c.doc_tokens),
    )


def _memory(c: PlanConfig, n: int, b: int, k: int, tile: int) -> MemoryPlan:
    static = _static(c)
    rows = math.ceil(b / k) if b else 0
    act = _act(c, rows)
    if c.loss == "tokens":
        peak = static + act
        return MemoryPlan(
            static=static,
            activations=act,
            cache=0,
            loss=0,
            peak=peak,
            budget=c.budget,
            peak_phase="micro-batch",
        )
    lmem = _loss_memory(c, n, b, tile)
    if k == 1:  # no caching: the loss runs while the batch's activations are alive
        peak = static + act + lmem
        return MemoryPlan(
            static=static,
            activations=act,
            cache=0,
            loss=lmem,
            peak=peak,
            budget=c.budget,
            peak_phase="loss",
        )
    # Gradient caching (wholebatch.GradCache, CachedStep): the loss runs on the cached
    # embeddings of all K micro-batches while the LAST micro-batch's graph is kept
    # (its second forward is never run); pass 2 then holds the embeddings'
    # gradients and one micro-batch's activations at a time.
    emb = _embeddings(c, b)
    loss_phase = static + act + emb + lmem
    mb_phase = static + emb + act
    return MemoryPlan(
        static=static,
        activations=act,
        cache=emb,
        loss=lmem,
        peak=max(loss_phase, mb_phase),
        budget=c.budget,
        peak_phase="loss" if loss_phase >= mb_phase else "micro-batch",
    )


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


def _sweep(c: PlanConfig, n: int, b: int, sizes: Sequence[int] | None = None) -> tuple[int, int]:
    """(rows, cols) of the logits sweep the loss hands `tile_size_for` on a rank of `b` rows."""
    spec = SPECS.get(c.loss)
    if spec is None:  # tokens: no sweep
        return b, n
    ring = resolved_strategy(c, n) == "ring"
    if spec.kernel == "symmetric" and not ring:
        return spec.views * n, spec.views * n
    if spec.kernel == "sigmoid" or (spec.kernel == "tokens" and ring):
        return b, max(sizes) if sizes else b
    if ring:  # one block at a time: the largest
        return b, (max(sizes) if sizes else b) * spec.key_rows(c.negatives)
    return b, n * spec.key_rows(c.negatives)


def _choose_tile(c: PlanConfig, n: int, b: int, sizes: Sequence[int] | None = None) -> int:
    """`c.tile`, or the tile the losses choose on an accelerator (`tile_size_for`, the same function)."""
    if c.tile:
        return c.tile
    return tile_size_for("cuda", *_sweep(c, n, b, sizes))


def _fits_any_k(c: PlanConfig, n: int) -> bool:
    b = math.ceil(n / c.shards)
    tile = _choose_tile(c, n, b)  # the tile a plan at this batch would choose
    k = c.micro_batches or max(1, b)
    return _memory(c, n, b, min(k, max(b, 1)), tile).peak <= c.budget


def _largest_batch(c: PlanConfig, fixed_k: bool) -> int | None:
    if c.loss == "tokens" and not fixed_k:
        return None  # more micro-batches always fit: activations are one micro-batch's
    probe = c if fixed_k else dataclasses.replace(c, micro_batches=0)
    lo, hi = 0, c.shards
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
    # Gradient caching re-runs the forward of K - 1 micro-batches (GradCache keeps
    # the last one's graph from pass 1): (K - 1)/K of the rows, a forward being a
    # third of forward + backward.
    extra = (k - 1) / (3 * k) if c.loss != "tokens" and k > 1 else 0.0
    m = c.mesh_shape
    split = 1 if m is None else m.model_split  # a rank computes its tp x pp part of the model
    model = flops * b * (1 + extra) / (c.tflops * 1e12 * split)
    loss_s = 0.0 if c.loss == "tokens" else _loss_seconds(c, n, b)
    ddp = grad_traffic(c)
    return Times(
        model=model,
        loss=loss_s,
        loss_comm=_comm_seconds(c, loss_rows),
        ddp_comm=_comm_seconds(c, ddp),
    )


def _loss_seconds(c: PlanConfig, n: int, b: int) -> float:
    """The tiled loss: matmul FLOPs or its elementwise passes through device memory, the larger."""
    spec = SPECS[c.loss]
    passes: float = spec.passes
    if spec.kernel == "symmetric":
        m = spec.views * n
        elements = m**2 / 2 / c.shards  # the upper triangle, dealt over the batch group
        mm = 4.0 * m * m * c.dim / c.shards
    else:
        dirs = c.direction_list
        cands = n * spec.key_rows(c.negatives)
        cols = cands * (1 + ("doc_to_doc" in dirs)) + n * ("query_to_query" in dirs)
        if spec.kernel == "tokens":  # every (query token, document token) pair is a product
            cols = n * c.query_tokens * c.doc_tokens
        elements = float(b) * cols
        mm = 8.0 * b * cols * c.dim
        passes += COLUMN_PASSES * n / cols if spec.has_columns(dirs) else 0
    return max(mm / (c.tflops * 1e12), elements * passes * c.acc / (c.hbm_gbs * 1e9))


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------


# Elements per row of the blocks each loss moves: the keys (texts; InfoNCE's
# [document | negatives]; NT-Xent's [z1 | z2]).
def _key_width(c: PlanConfig) -> int:
    spec = SPECS[c.loss]
    if spec.kernel == "tokens":
        return c.doc_tokens * c.dim
    return spec.key_rows(c.negatives) * c.dim


class _Traffic:
    """A strategy's collectives on one rank, memoised: a ring at W = 65,536 is walked once per rank."""

    def __init__(self, c: PlanConfig, sizes: Sequence[int]) -> None:
        self.c, self.sizes = c, sizes
        self._memo: dict[tuple[str, int], list[Collective]] = {}

    def __call__(self, strategy: str, rank: int) -> list[Collective]:
        key = (strategy, rank)
        if key not in self._memo:
            self._memo[key] = self._walk(strategy, rank)
        return self._memo[key]

    def _walk(self, strategy: str, rank: int) -> list[Collective]:
        c, sizes = self.c, self.sizes
        spec = SPECS[c.loss]
        own = {v: k for k, v in STRATEGY_NAMES.items()}.get(strategy)
        if own is not None and own in spec.strategies:  # the library's own loss, every call counted
            return loss_traffic(
                c.loss,
                sizes,
                rank,
                c.dim,
                c.elem,
                c.acc,
                negatives=c.negatives,
                directions=c.direction_list,
                exchange=not c.known_sizes,
                strategy=own,
                classes=c.classes,
                tokens=(c.query_tokens, c.doc_tokens),
            )
        width = _key_width(c)
        if strategy == "ring + tiled":
            return ring_traffic("key blocks", sizes, rank, width, c.elem, c.acc)
        keys = gather_traffic("keys", sizes, rank, width * c.elem)
        if strategy == "gather + tiled" or SPECS[c.loss].views > 1:  # both views gathered at once
            return keys
        # naive and local (open_clip, DisCo-CLIP) gather the queries (images) too
        return keys + gather_traffic("queries", sizes, rank, c.dim * c.elem)


def _strategies(
    c: PlanConfig, n: int, sizes: Sequence[int], rank: int, tile: int, traffic: _Traffic
) -> list[Strategy]:
    if c.loss == "tokens":
        return []
    out = []
    for name in ("gather + tiled", "ring + tiled", "local", "naive"):
        rows = traffic(name, rank)
        out.append(
            Strategy(
                name=name,
                in_wholebatch=name == _own(c, n),
                loss_memory=_loss_memory(c, n, sizes[rank], tile, name),
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
            `config.world` (they must sum to `batch` and have `world` entries); on a
            mesh, rows per item shard (`config.shards` entries: dp_replicate x dp x cp).

    Returns:
        A `Plan`; `plan.format()` renders tables, `plan.to_json()` a dict.
    """
    t0 = time.perf_counter()
    c = config or PlanConfig()
    if sizes is None:
        rows = split_rows(c.batch, c.shards)
    else:
        rows = [int(s) for s in sizes]
        if len(rows) != c.shards or sum(rows) != c.batch or min(rows) < 0:
            what = f"world={c.world}" if c.mesh_shape is None else f"{c.shards} (item shards)"
            raise WholebatchError(
                f"plan: sizes must have {what} entries >= 0 summing to batch={c.batch}; "
                f"got {len(rows)} entries summing to {sum(rows)}"
            )
    n, b = c.batch, max(rows)
    m = c.mesh_shape
    batch_dims = "" if m is None else m.batch_label
    tile = _choose_tile(c, n, b, rows)
    k = _choose_k(c, n, b, tile)
    mem = _memory(c, n, b, k, tile)
    ranks = representative_ranks(rows)
    traffic = _Traffic(c, rows)
    per_rank = {}
    grads = grad_traffic(c)
    for r in ranks:
        coll = [] if c.loss == "tokens" else traffic(_own(c, n), r)
        per_rank[r] = [dataclasses.replace(x, dims=batch_dims) for x in coll]
    busiest = max(ranks, key=lambda r: (sum(x.sent + x.received for x in per_rank[r]), rows[r]))
    loss_rows = per_rank[busiest]
    collectives = loss_rows + _engine_rows(c) + grads
    times = _times(c, n, b, k, loss_rows + _engine_rows(c))
    return Plan(
        config=c,
        rows_per_rank=(min(rows), b),
        ranks_counted=tuple(ranks),
        micro_batches=k,
        micro_batch_rows=math.ceil(b / k) if b else 0,
        tile=tile,
        fits=mem.peak <= c.budget,
        memory=mem,
        collectives=tuple(collectives),
        times=times,
        max_batch=_largest_batch(c, fixed_k=False),
        max_batch_at_k=_largest_batch(dataclasses.replace(c, micro_batches=k), fixed_k=True),
        strategies=tuple(_strategies(c, n, rows, busiest, tile, traffic)),
        assumptions=tuple(_assumptions(c)),
        seconds=time.perf_counter() - t0,
        other_stages_peak=_other_stages_peak(c, b, k),
    )


def _other_stages_peak(c: PlanConfig, b: int, k: int) -> int | None:
    """pp > 1: a stage without the loss holds its parameters and one micro-batch's activations."""
    m = c.mesh_shape
    if m is None or m.size("pp") == 1:
        return None
    return _static(c) + _act(c, math.ceil(b / k) if b else 0)


def _parallel_assumption(c: PlanConfig) -> str:
    m = c.mesh_shape
    if m is None:
        return (
            "DDP replicas (no FSDP sharding); the model's activations scale with micro-batch rows"
        )
    over = "the loss gathers over them" if c.loss != "tokens" else "the items are counted over them"
    out = (
        f"mesh {m.describe()}: the items are split over the {m.batch} ranks of {m.batch_label} "
        f"({over}); tp ranks replicate them; parameters, gradients and "
        f"optimizer state are 1/(tp x pp) per rank, FSDP2 keeping 1/{m.shard} of that "
        "(dp x cp); act_mib is one rank's activations per item as measured on its part "
        "of the model; tensor-parallel collectives and pipeline sends are not counted"
    )
    if m.size("pp") > 1:
        out += (
            "; pp: the loss on the last stage (the ranks planned), every stage the same "
            "share of parameters, in-flight micro-batches of the schedule not counted"
        )
    return out


def _assumptions(c: PlanConfig) -> list[str]:
    link = "inter-node" if c.world > c.gpus_per_node else "intra-node"
    out = [
        "per rank, per optimizer step; memory in GiB = 2^30 bytes, bytes exact for the library's collectives",
        f"rings cross the {link} link: {c.inter_gbs if link == 'inter-node' else c.intra_gbs:g} GB/s "
        f"per GPU per direction, {c.latency_us:g} us per message round; no overlap of communication and compute",
        "all-reduce: ring model 2(W-1)/W of the tensor (NCCL trees/NVLS move less at scale)",
        _parallel_assumption(c),
    ]
    if c.loss != "tokens":  # a per-item loss: no loss kernels, tiles or replicated scalars
        out += [
            f"loss memory: measured buffer counts of the CPU kernels ({c.dtype} in, float32 compute "
            "for 16-bit; CUDA's 16-bit path skips some float32 copies), an even split",
            "tile: wholebatch.losses.tile_size_for on an accelerator (3 float32 T x T buffers within 1 GiB)",
            "replicated scalars (logit_scale, ...) are learnable: their gradients are agreed in the backward",
            "K > 1 uses gradient caching (wholebatch.GradCache / CachedStep): K - 1 extra forwards, "
            "the last micro-batch's graph kept through the loss",
        ]
    if c.loss != "tokens" and not c.known_sizes and c.shards > 1:
        row = 8 * (c.shards - 1) * 15
        if row > 2**20:
            out.append(
                f"the losses' metadata exchange all-gathers ~{row / 2**20:.0f} MiB per rank per call "
                "(a row of 11..14 float64 per rank): pass sizes= with check=False (--known-sizes) to skip it"
            )
    if c.act_mib == 0:
        out.append(
            "act_mib = 0: model activations not counted (measure them: wholebatch.planner.measure_model)"
        )
    return out
