"""Plain-text tables of a `Plan`: honest units, no false precision.

Memory in GiB/MiB (2^30, 2^20 bytes), bytes per rank per step exact in the
JSON and rounded to three significant figures here, times with two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wholebatch.planner.core import Plan

__all__ = ["format_plan", "human_bytes", "human_seconds"]


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; three significant figures, binary units."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _sig2(v: float) -> str:
    return f"{float(f'{v:.2g}'):g}"


def human_seconds(s: float) -> str:
    """Two significant figures, in s, ms or us: 0.2734 -> '~270 ms'."""
    if s >= 1:
        return f"~{_sig2(s)} s"
    if s >= 1e-3:
        return f"~{_sig2(s * 1e3)} ms"
    return f"~{_sig2(s * 1e6)} us"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(r, widths, strict=True))
        )

    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_plan(p: Plan) -> str:
    """The plan as plain-text tables: memory, bytes, time, limits, strategies, assumptions."""
    out = _header(p) + _memory_lines(p) + [""] + _bytes_lines(p) + [""] + _time_lines(p)
    out += _strategy_lines(p)
    out += ["", "assumptions:"] + [f"  - {a}" for a in p.assumptions]
    out.append(f"(planned in {p.seconds * 1e3:.0f} ms)")
    return "\n".join(out)


def _header(p: Plan) -> list[str]:
    c = p.config
    lo, hi = p.rows_per_rank
    split = f"{hi:,} rows per rank" if lo == hi else f"{lo:,}-{hi:,} rows per rank"
    what = (
        "tokens (per-item loss, accumulated)"
        if c.loss == "tokens"
        else f"{c.loss}, D = {c.dim}, {c.dtype}"
    )
    nodes = f"({max(1, -(-c.world // c.gpus_per_node)):,} node(s) of {c.gpus_per_node})"
    m = c.mesh_shape
    if m is None:
        return [
            f"wholebatch plan: {what}; global batch {c.batch:,} over W = {c.world:,} "
            f"{nodes}; {split}",
            "",
        ]
    per = split.replace("per rank", f"per item shard ({m.batch_label}; tp replicas see the same)")
    out = [
        f"wholebatch plan: {what}; global batch {c.batch:,} over the mesh {m.describe()}: "
        f"W = {c.world:,} {nodes}, B = {m.batch:,} item shards; {per}",
    ]
    if m.size("pp") > 1:
        out.append(
            "the ranks planned are the last pipeline stage's (they hold the loss); "
            f"other stages' peak: {human_bytes(p.other_stages_peak or 0)}"
        )
    return [*out, ""]


def _memory_lines(p: Plan) -> list[str]:
    m = p.memory
    verdict = "fits" if p.fits else "DOES NOT FIT"
    tile = "" if p.config.loss == "tokens" else f", tile {p.tile}"  # a per-item loss has no tiles
    out = [
        f"memory per rank (busiest), K = {p.micro_batches} micro-batch(es) of {p.micro_batch_rows:,} rows"
        f"{tile}: {verdict} in {human_bytes(m.budget)} usable"
    ]
    if p.bubble is not None:
        pp = p.config.mesh_shape.size("pp") if p.config.mesh_shape else 1
        out.append(
            f"pipeline bubble at pp = {pp}: (pp - 1) / (K + pp - 1) = {p.bubble:.0%} of the schedule "
            f"idle at K = {p.micro_batches} (GPipe / 1F1B); K >= {4 * pp} keeps it under 20%, "
            "at the memory of more micro-batches in flight (--micro-batches)"
        )
    rows = [
        ["weights, gradients, optimizer state", human_bytes(m.static)],
        [
            f"activations of one micro-batch ({p.micro_batch_rows:,} rows)",
            human_bytes(m.activations),
        ],
    ]
    if p.config.loss != "tokens":
        rows.append(
            [
                "gradient caching's extra (cached embeddings, then their gradients)",
                human_bytes(m.cache),
            ]
        )
        rows.append(["whole-batch loss, forward + backward", human_bytes(m.loss)])
    rows.append([f"peak (set by the {m.peak_phase} phase)", human_bytes(m.peak)])
    return out + ["  " + r for r in _table(["part", "bytes"], rows)]


def _bytes_lines(p: Plan) -> list[str]:
    if not p.collectives:
        return ["bytes per rank per step: none (one rank)"]
    counted = (
        p.ranks_counted[0]
        if len(p.ranks_counted) == 1
        else "busiest of " + str(list(p.ranks_counted))
    )
    mesh = bool(p.config.mesh)
    rows = [
        [
            x.phase,
            x.name,
            *([x.dims] if mesh else []),
            x.primitive,
            f"{x.calls:,}",
            human_bytes(x.sent),
            human_bytes(x.received),
        ]
        for x in p.collectives
    ]
    fs, fr = p.bytes("forward")
    bs, br = p.bytes("backward")
    pad = [""] * (3 if mesh else 2)
    rows.append(["", "total forward", *pad, human_bytes(fs), human_bytes(fr)])
    rows.append(["", "total backward", *pad, human_bytes(bs), human_bytes(br)])
    header = ["phase", "collective", *(["over"] if mesh else []), "primitive", "calls"]
    header += ["sent", "received"]
    what = "rank " + str(counted) if not mesh else "a rank of item shard " + str(counted)
    out = [f"bytes per rank per step ({what}):"] + ["  " + r for r in _table(header, rows)]
    if mesh:
        dims = [[d, human_bytes(s), human_bytes(r)] for d, (s, r) in p.bytes_by_dims().items()]
        out += ["", "bytes per rank per step by mesh dims:"]
        out += ["  " + r for r in _table(["over", "sent", "received"], dims)]
    return out


def _time_lines(p: Plan) -> list[str]:
    t = p.times
    out = [
        f"time per step (estimate): model {human_seconds(t.model)}, loss {human_seconds(t.loss)}, "
        f"loss communication {human_seconds(t.loss_comm)}, "
        f"{'gradient collectives' if p.config.mesh else 'DDP all-reduce'} {human_seconds(t.ddp_comm)}; "
        f"total {human_seconds(t.step)} "
        f"(communication {100 * (t.loss_comm + t.ddp_comm) / t.step:.0f}% of it)"
        if t.step > 0
        else "time per step: nothing to estimate (give params or flops_per_sample)"
    ]
    if p.max_batch is None:
        out.append(
            "largest global batch that fits: unbounded (raise K: activations are one micro-batch's)"
        )
    else:
        out.append(
            f"largest global batch that fits (memory only): {p.max_batch:,} at some K "
            f"(1-row micro-batches at the limit); "
            f"{p.max_batch_at_k:,} at K = {p.micro_batches}"
        )
    return out


def _strategy_lines(p: Plan) -> list[str]:
    if not p.strategies:
        return []
    rows = [
        [
            s.name + (" (wholebatch)" if s.in_wholebatch else ""),
            human_bytes(s.loss_memory),
            human_bytes(s.sent),
            human_seconds(s.comm_seconds),
        ]
        for s in p.strategies
    ]
    header = ["strategy", "loss memory", "bytes sent", "comm time"]
    return ["", "strategies for this loss (per rank per step):"] + [
        "  " + r for r in _table(header, rows)
    ]
