"""`wholebatch selftest`: every collective and every loss against its reference, on the real process group.

    wholebatch selftest                                   # 2 local gloo processes
    torchrun --nproc-per-node 8 -m wholebatch selftest    # this machine's GPUs (NCCL)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 --rdzv-id check1 -m wholebatch selftest --json   # on each node

The way to check a cluster's install: run under torchrun with the backend and
the nodes you train on. Every rank builds every rank's inputs (float64,
different per rank, uneven sizes with an empty rank where W > 2), computes the
expected outputs and gradients in one process by plain torch (`torch.cat`,
sums, the N x N loss formulas), runs the real collective or loss on its own
input, and compares forward values and input gradients. Each rank's output of a
collective is weighted by (1 + rank) so a backward that drops other ranks' terms
cannot pass. The losses are every spec of `wholebatch.losses.specs.SPECS`, on
every path it has (the small path, gather, ring), against its reference formula
on the whole batch (`wholebatch.losses.examples` builds the inputs).
The worst error over ranks is agreed, and rank 0 prints a pass/fail table (or
JSON); every rank exits 0 only if every check passed on every rank.

Legend: W ranks, B this rank's rows, N global rows, D dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import socket
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import wholebatch
from wholebatch.comm.agree import agree_rows
from wholebatch.comm.checks import exchange_text
from wholebatch.comm.groups import comm_device
from wholebatch.errors import WholebatchError
from wholebatch.losses import examples
from wholebatch.losses.sizing import using_small_rows
from wholebatch.losses.specs import SPECS, LossSpec

__all__ = ["SelftestConfig", "run_checks", "run_selftest"]

# float64 everywhere: exact collectives agree to 0, tiled losses to ~1e-15 relative.
RTOL = 1e-9
D = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelftestConfig:
    """How `wholebatch selftest` runs. (The CLI's flags.)"""

    nproc: int = 2
    """Local processes to start when not already under torchrun (ignored under torchrun)."""

    backend: str = "auto"
    """"gloo", "nccl", or "auto" (NCCL with GPUs, else gloo); under torchrun the group it builds."""

    timeout: float = 60.0
    """Seconds a collective may wait for a peer before the check fails."""

    json: bool = False
    """Rank 0 prints a JSON document (for CI) instead of the table."""

    def __post_init__(self) -> None:
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1:
            raise WholebatchError(f"nproc must be an integer >= 1, got {self.nproc!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise WholebatchError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        if not self.timeout > 0:
            raise WholebatchError(f"timeout must be > 0 seconds, got {self.timeout!r}")


# ---------------------------------------------------------------------------
# Inputs every rank can build for every rank
# ---------------------------------------------------------------------------


def _rows(w: int) -> list[int]:
    """Uneven rows per rank: 1, 3, 0, 2, 4, 1, ... (an empty rank from W = 3 on)."""
    return [(2 * r + 1) % 5 for r in range(w)]


def _data(r: int, rows: int, cols: int = D) -> Tensor:
    """Rank r's input: arange + 100·r, scaled, so every rank's numbers differ."""
    return (torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) + 100 * r) / 50


def _weight(r: int, like: Tensor) -> Tensor:
    """Rank r's loss weights: (1 + r) times a pattern, so ranks' losses differ."""
    pattern = 1 + torch.arange(like.numel(), dtype=torch.float64).reshape(like.shape) % 7
    return (1 + r) * pattern.to(like.device)


# Each collective: (name, inputs for W ranks, one-process simulation, the real call).
Simulate = Callable[[list[Tensor]], list[Tensor]]
Run = Callable[[Tensor], Tensor]


def _a2a_sizes(w: int) -> list[list[int]]:
    return [[(r + j) % 3 for j in range(w)] for r in range(w)]


def _collectives(w: int, rank: int) -> list[tuple[str, list[Tensor], Simulate, Run]]:
    rows = _rows(w)
    uneven = [_data(r, rows[r]) for r in range(w)]
    equal = [_data(r, 2) for r in range(w)]
    full = [_data(r, sum(rows)) for r in range(w)]
    send = _a2a_sizes(w)
    a2a = [_data(r, sum(send[r])) for r in range(w)]
    src = w - 1

    def sim_a2a(xs: list[Tensor]) -> list[Tensor]:
        chunks = [torch.split(x, send[r]) for r, x in enumerate(xs)]
        return [torch.cat([chunks[r][j] for r in range(w)]) for j in range(w)]

    # fmt: skip below: a table, one collective a row (name, inputs, reference, call)
    return [
        ("all_gather (uneven rows)", uneven, lambda xs: [torch.cat(xs)] * w, wholebatch.all_gather),
        ("all_reduce sum", equal, lambda xs: [torch.stack(xs).sum(0)] * w, wholebatch.all_reduce),
        ("all_reduce mean", equal, lambda xs: [torch.stack(xs).mean(0)] * w,
         lambda x: wholebatch.all_reduce(x, "mean")),
        ("all_reduce max", equal, lambda xs: [torch.stack(xs).amax(0)] * w,
         lambda x: wholebatch.all_reduce(x, "max")),
        ("reduce_scatter (uneven)", full,
         lambda xs: list(torch.split(torch.stack(xs).sum(0), rows)),
         lambda x: wholebatch.reduce_scatter(x, sizes=rows)),
        ("all_to_all (uneven)", a2a, sim_a2a,
         lambda x: wholebatch.all_to_all(x, send[rank], [send[r][rank] for r in range(w)])),
        (f"broadcast (src {src})", equal, lambda xs: [xs[src]] * w,
         lambda x: wholebatch.broadcast(x, src)),
        ("ring_shift 1 (uneven)", uneven, lambda xs: [xs[(r - 1) % w] for r in range(w)],
         lambda x: wholebatch.ring_shift(x, 1)),
        ("ring_shift -1 (uneven)", uneven, lambda xs: [xs[(r + 1) % w] for r in range(w)],
         lambda x: wholebatch.ring_shift(x, -1)),
    ]  # fmt: skip


def _max_rel(got: Tensor, want: Tensor) -> float:
    if want.numel() == 0:
        return 0.0 if got.shape == want.shape else float("inf")
    if got.shape != want.shape:
        return float("inf")
    return float((got.cpu() - want).abs().max() / want.abs().max().clamp_min(1e-300))


def _grad(x: Tensor) -> Tensor:
    """`x.grad`, or zeros where no gradient arrived."""
    return x.grad if x.grad is not None else torch.zeros_like(x)


def _check_collective(
    rank: int, device: torch.device, xs: list[Tensor], simulate: Simulate, run: Run
) -> tuple[float, float]:
    ref_xs = [x.clone().requires_grad_() for x in xs]
    ref_outs = simulate(ref_xs)
    total = sum((o * _weight(r, o)).sum() for r, o in enumerate(ref_outs))
    assert isinstance(total, Tensor)
    torch.autograd.backward(total)
    x = xs[rank].clone().to(device).requires_grad_()
    out = run(x)
    torch.autograd.backward((out * _weight(rank, out)).sum())
    ref_grad = _grad(ref_xs[rank])
    got_grad = _grad(x)
    return _max_rel(out.detach(), ref_outs[rank].detach()), _max_rel(got_grad, ref_grad)


# ---------------------------------------------------------------------------
# Every loss of `wholebatch.losses.specs.SPECS` against its reference formula
# ---------------------------------------------------------------------------


def _loss_rows(w: int) -> list[int]:
    rows = _rows(w)
    rows[0] += 2  # rank 0 gets two more rows, so every W has N >= 3
    return rows


def _loss_paths(spec: LossSpec) -> list[tuple[str, str, int | None]]:
    """(label, strategy, small-batch row limit) of every path the loss has."""
    out = [(path, path, 0) for path in spec.strategies]
    return [("small path", spec.default_strategy, None), *out]


def _check_loss(
    rank: int, w: int, device: torch.device, spec: LossSpec, strategy: str, small: int | None
) -> tuple[float, float]:
    """Forward error, and the worst gradient error (this rank's rows; the scalars after a mean),
    of the loss on this rank against its reference formula on the whole batch in one process."""
    sizes = _loss_rows(w)
    per_rank = [examples.inputs(spec, sizes, q, extras=spec.extras) for q in range(w)]
    rows = examples.whole(spec, per_rank)
    floats = [k for k, x in rows.items() if x.is_floating_point()]
    ref_rows = {k: x.clone().requires_grad_(k in floats) for k, x in rows.items()}
    ref_s = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
             for k, v in examples.scalars(spec).items()}  # fmt: skip
    ref_loss = examples.reference(spec)(ref_rows, ref_s)
    torch.autograd.backward(ref_loss)
    mine = {k: x.to(device).requires_grad_(k in floats) for k, x in per_rank[rank].items()}
    xs_s = {k: v.detach().to(device).requires_grad_() for k, v in ref_s.items()}
    with using_small_rows(small):  # grad_reduction="mean": as DDP will average
        out = examples.call(spec, mine, xs_s, strategy=strategy)
    torch.autograd.backward(out)
    # Contract ("mean"): each rank's gradients are W x its share, so that DDP's mean of the
    # parameter gradients is dL/dθ. Rows belong to one rank: W·dL/drows. Scalars: mean over ranks.
    lo = sum(sizes[:rank])
    errs = []
    for k in floats:
        want = _grad(ref_rows[k])[lo : lo + sizes[rank]]
        got = _grad(mine[k]) / w
        errs.append(_max_rel(got, want[:, : got.shape[1]] if got.dim() == 3 else want))
    for k, v in xs_s.items():
        mean = wholebatch.all_reduce(_grad(v).reshape(1), "mean").reshape(())
        errs.append(_max_rel(mean, _grad(ref_s[k])))
    return _max_rel(out.detach().reshape(()), ref_loss.detach()), max(errs)


# ---------------------------------------------------------------------------
# Running and reporting
# ---------------------------------------------------------------------------


def run_checks() -> list[dict[str, Any]]:
    """Run every check on this rank (every rank must call it); each check's worst result over ranks."""
    rank, w = dist.get_rank(), dist.get_world_size()
    device = comm_device()
    names: list[str] = []
    local: list[list[float]] = []
    messages: list[str] = []

    def record(name: str, fn: Callable[[], tuple[float, float]]) -> None:
        names.append(name)
        try:
            fwd, bwd = fn()
            local.append([fwd, bwd, 0.0])
            messages.append("")
        except Exception as exc:
            local.append([float("inf"), float("inf"), 1.0])
            messages.append(f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
            if os.environ.get("WHOLEBATCH_SELFTEST_TRACEBACK"):
                traceback.print_exc()

    for name, xs, sim, run in _collectives(w, rank):
        record(name, functools.partial(_check_collective, rank, device, xs, sim, run))
    for spec in SPECS.values():
        for label, strategy, small in _loss_paths(spec):
            check = functools.partial(_check_loss, rank, w, device, spec, strategy, small)
            record(f"{spec.function} ({label})", check)
    # One named row per rank (agree_rows), each check's worst over ranks read back;
    # NaN (a check that produced none) counts as a failure.
    table = torch.nan_to_num(torch.tensor(local, dtype=torch.float64), nan=float("inf"))
    rows = agree_rows({"fwd": table[:, 0], "bwd": table[:, 1], "raised": table[:, 2]})
    worst = {
        k: [max(col) for col in zip(*rows.vectors(k), strict=True)]
        for k in ("fwd", "bwd", "raised")
    }
    # Text as uint8 tensors (checks.exchange_text), never pickle: one string per
    # rank, its messages joined by a separator no exception text contains.
    joined = exchange_text("\x1f".join(messages), max_bytes=320 * max(1, len(messages)))
    all_messages = [(j.split("\x1f") + [""] * len(messages))[: len(messages)] for j in joined]
    out = []
    for i, name in enumerate(names):
        fwd, bwd, raised = worst["fwd"][i], worst["bwd"][i], worst["raised"][i]
        errors = {r: m[i] for r, m in enumerate(all_messages) if m[i]}
        out.append(
            {
                "check": name,
                "forward_rel_err": fwd,
                "backward_rel_err": bwd,
                "passed": not raised and fwd <= RTOL and bwd <= RTOL,
                "errors": {str(r): m for r, m in errors.items()},
            }
        )
    return out


def _topology() -> dict[str, Any]:
    w = dist.get_world_size()
    mine = "\x1f".join(
        (socket.gethostname(), os.environ.get("GROUP_RANK", "0"), os.environ.get("LOCAL_RANK", "0"))
    )
    info = [tuple(t.split("\x1f")) for t in exchange_text(mine, max_bytes=320)]
    return {
        "world_size": w,
        "nodes": len({group for _, group, _ in info}),
        "hosts": sorted({host for host, _, _ in info}),
        "backend": str(dist.get_backend()),
        "device": str(comm_device()),
        "torch": torch.__version__,
        "wholebatch": wholebatch.__version__,
        "python": platform.python_version(),
    }


def _format(topo: dict[str, Any], checks: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"wholebatch selftest: {topo['world_size']} ranks on {topo['nodes']} node(s) "
        f"({', '.join(topo['hosts'])}), backend {topo['backend']}, device {topo['device']}, "
        f"torch {topo['torch']}",
        "",
        f"  {'check':<34} {'forward err':>12} {'backward err':>13}  result",
    ]
    for c in checks:
        lines.append(
            f"  {c['check']:<34} {c['forward_rel_err']:12.1e} {c['backward_rel_err']:13.1e}  "
            f"{'pass' if c['passed'] else 'FAIL'}"
        )
        for r, m in c["errors"].items():
            lines.append(f"      rank {r}: {m}")
    bad = sum(not c["passed"] for c in checks)
    lines.append("")
    lines.append(
        f"PASS: all {len(checks)} checks on every rank (relative errors <= {RTOL:g}, float64)."
        if not bad
        else f"FAIL: {bad} of {len(checks)} checks failed."
    )
    return "\n".join(lines)


def selftest_rank(as_json: bool) -> tuple[int, str | None]:
    """Run the checks on this rank of an initialised group: (the agreed exit code, the
    report: rank 0's, None elsewhere)."""
    topo = _topology()
    checks = run_checks()
    passed = all(c["passed"] for c in checks)
    report = None
    if dist.get_rank() == 0:
        if as_json:
            report = json.dumps(
                {"passed": passed, **topo, "rtol": RTOL, "checks": checks}, indent=2
            )
        else:
            report = _format(topo, checks)
    return (0 if passed else 1), report


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr within the block, this process and the ranks it starts.

    gloo in torch 2.6 to 2.9 writes "[Gloo] Rank r is connected to ..." straight to the
    process's stdout as each group connects; stdout is the report's (a `--json` reader
    parses all of it), so the ranks run with theirs on stderr and the report is printed after.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_selftest(config: SelftestConfig) -> int:
    """Run under torchrun's group if started by torchrun, else on `config.nproc` local processes."""
    from wholebatch.comm.groups import init_process_group
    from wholebatch.comm.launch import LaunchSpec, in_torchrun, launch

    backend = None if config.backend == "auto" else config.backend
    if in_torchrun():
        with _stdout_to_stderr():
            init_process_group(backend, timeout_s=config.timeout)
            try:
                code, report = selftest_rank(config.json)
            finally:
                dist.destroy_process_group()
        results = [(code, report)]
    else:
        with _stdout_to_stderr():
            results = launch(
                selftest_rank,
                (config.json,),
                spec=LaunchSpec(nproc=config.nproc, backend=backend, timeout_s=config.timeout),
                name="wholebatch-selftest",
            )
    for _, report in results:
        if report is not None:
            print(report, flush=True)
    return int(max(code for code, _ in results))
