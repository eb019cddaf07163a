"""The planner against measurement on real gloo ranks: bytes exactly, memory within 15%.

Bytes: every rank runs a loss forward + backward under `count_collectives`
(pass-through counters on the c10d calls, tests/plan_counting.py) and its
socket bytes (`wchar`) are read too; the planner's per-rank, per-phase,
per-primitive bytes must EQUAL the counted ones, for every rank, with uneven
sizes and an empty rank, at W = 2, 3 and 4; the socket bytes must be the
counted ones plus gloo's small per-message headers.

Memory: each rank's peak-RSS growth over the loss (glibc's mmap threshold
fixed, so RSS follows live memory) within 15% of the planner's `loss_memory`.
The N = 4,096 ... 32,768 sweep lives in benchmarks/bench_plan.py (results in
benchmarks/RESULTS.md); here one point per loss keeps the suite fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.harness import run_ranks
from tests.plan_counting import Counter, count_collectives, wchar
from wholebatch.losses.contrastive import clip_loss, nt_xent_loss, siglip_loss
from wholebatch.planner.memory import LOSS_STRATEGY, loss_memory
from wholebatch.planner.traffic import loss_traffic

SCALARS = {"clip": (10.0,), "siglip": (10.0, -10.0), "nt_xent": (0.1,), "info_nce": (10.0,)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _info_nce(
    q: torch.Tensor, k: torch.Tensor, s: torch.Tensor, tile_size: int = 512
) -> torch.Tensor:
    """One-directional InfoNCE as the planner models it: gathered keys, row log-sum-exps only."""
    from wholebatch.comm.collectives import all_gather, all_reduce
    from wholebatch.comm.groups import get_world_size
    from wholebatch.losses.contrastive import _prepare
    from wholebatch.losses.tiles import TiledLSE

    sizes = _prepare("info_nce", {"q": q, "k": k}, {"s": s}, "mean", tile_size, None)
    keys = all_gather(k, sizes=sizes, check=False)
    row, _ = TiledLSE.apply(q, keys, s, False, tile_size, None)  # type: ignore[no-untyped-call]
    local = (row.sum() - s * (q.float() * k.float()).sum()) / sum(sizes)
    return all_reduce(local, check=False) if get_world_size() > 1 else local


LOSSES: dict[str, Any] = {
    "clip": clip_loss, "siglip": siglip_loss, "nt_xent": nt_xent_loss, "info_nce": _info_nce,
}  # fmt: skip


def _inputs(loss: str, rows: int, dim: int, dtype: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    a = F.normalize(torch.randn(rows, dim, generator=g), dim=1).to(DTYPES[dtype]).requires_grad_()
    b = F.normalize(torch.randn(rows, dim, generator=g), dim=1).to(DTYPES[dtype]).requires_grad_()
    return a, b, *(torch.tensor(v, requires_grad=True) for v in SCALARS[loss])


def _rank_count(loss: str, sizes: list[int], dim: int, dtype: str) -> dict[str, Any]:
    """This rank's counted bytes per (phase, primitive), and its socket bytes, for one step."""
    torch.manual_seed(0)
    args = _inputs(loss, sizes[dist.get_rank()], dim, dtype)
    fwd, bwd = Counter(), Counter()
    dist.barrier()
    w0 = wchar()
    with count_collectives(fwd):
        out = LOSSES[loss](*args)
    with count_collectives(bwd):
        out.backward()
    socket = wchar() - w0
    return {
        "forward": (dict(fwd.sent), dict(fwd.received)),
        "backward": (dict(bwd.sent), dict(bwd.received)),
        "calls": fwd.calls + bwd.calls,
        "wchar": socket,
    }


def _planned(loss: str, sizes: list[int], rank: int, dim: int, dtype: str) -> dict[str, Any]:
    elem = DTYPES[dtype].itemsize
    out: dict[str, Any] = {}
    for phase in ("forward", "backward"):
        sent: dict[str, int] = defaultdict(int)
        recv: dict[str, int] = defaultdict(int)
        for c in loss_traffic(loss, sizes, rank, dim, elem, max(4, elem)):
            if c.phase == phase:
                prim = "all_to_all" if c.name.startswith("reduce-scatter") else c.primitive
                sent[prim] += c.sent
                recv[prim] += c.received
        out[phase] = ({k: v for k, v in sent.items() if v}, {k: v for k, v in recv.items() if v})
    return out


def _nonzero(d: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in d.items() if v}


CASES = [
    ("clip", [37, 0, 21], "fp32"),
    ("clip", [16, 16], "bf16"),
    ("siglip", [5, 9, 0, 13], "fp32"),
    ("siglip", [24, 24, 24], "bf16"),
    ("nt_xent", [11, 0, 6], "fp32"),
    ("nt_xent", [8, 8, 8, 8], "fp32"),
    ("info_nce", [3, 17], "bf16"),
    ("info_nce", [9, 1, 0, 4], "fp32"),
]


@pytest.mark.parametrize(("loss", "sizes", "dtype"), CASES, ids=lambda v: str(v))
def test_planned_bytes_equal_counted_bytes_on_every_rank(
    loss: str, sizes: list[int], dtype: str
) -> None:
    dim = 24
    got = run_ranks(len(sizes), _rank_count, loss, sizes, dim, dtype)
    for rank, counted in enumerate(got):
        planned = _planned(loss, sizes, rank, dim, dtype)
        for phase in ("forward", "backward"):
            c_sent, c_recv = (_nonzero(d) for d in counted[phase])
            assert planned[phase] == (c_sent, c_recv), (
                rank,
                phase,
                planned[phase],
                (c_sent, c_recv),
            )


def test_socket_bytes_are_the_counted_bytes_plus_headers() -> None:
    """gloo writes each message's payload and a header (measured on torch 2.13: 144 bytes per message)."""
    dim = 256
    for loss, sizes in (("clip", [300, 200, 0]), ("siglip", [256, 256, 256])):
        got = run_ranks(len(sizes), _rank_count, loss, sizes, dim, "fp32")
        for rank, counted in enumerate(got):
            payload = sum(sum(counted[p][0].values()) for p in ("forward", "backward"))
            extra = counted["wchar"] - payload
            # all-reduces of a few floats may move a few more bytes than the ring
            # model (gloo rounds to W chunks), and each call writes a header per
            # message: at most 2 (W - 1) messages (a ring all-reduce), 144 bytes each.
            messages = 2 * (len(sizes) - 1) * counted["calls"]
            assert -64 <= extra <= 160 * messages, (loss, rank, payload, counted)
            assert payload >= 0.95 * counted["wchar"] or payload == 0, (loss, rank, counted)


def test_mutation_a_wrong_schedule_is_rejected() -> None:
    """Counting a forward-only ring (the backward's [block | gradient] shifts forgotten) must not match."""
    sizes, dim = [5, 9, 0, 13], 24
    got = run_ranks(4, _rank_count, "siglip", sizes, dim, "fp32")
    wrong = _planned("siglip", sizes, 1, dim, "fp32")
    wrong["backward"] = ({"all_reduce": wrong["backward"][0]["all_reduce"]}, wrong["backward"][1])
    c_sent, c_recv = (_nonzero(d) for d in got[1]["backward"])
    assert wrong["backward"] != (c_sent, c_recv)


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def _measure(world: int, specs: list[str]) -> dict[str, list[int]]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.plan_memprobe", str(world), *specs],
        capture_output=True, text=True, env=env, timeout=600, check=True,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["spec"]: r["peaks"] for r in rows}


MEMORY_CASES = ["clip:4608:256:256:fp32", "siglip:4608:256:256:fp32", "nt_xent:4608:256:256:bf16",
                "info_nce:4608:256:256:bf16"]  # fmt: skip


def test_planned_loss_memory_within_15_percent_of_peak_rss() -> None:
    """W = 3 fresh gloo ranks, one forward + backward per loss; every rank within 15%."""
    world = 3
    measured = _measure(world, MEMORY_CASES)
    for spec in MEMORY_CASES:
        loss, n, dim, tile, dtype = spec.split(":")
        elem = DTYPES[dtype].itemsize
        planned = loss_memory(
            loss, strategy=LOSS_STRATEGY[loss], n=int(n), b=int(n) // world, dim=int(dim),
            elem=elem, acc=max(4, elem), tile=int(tile), w=world,
        )  # fmt: skip
        for rank, peak in enumerate(measured[spec]):
            assert abs(planned - peak) <= 0.15 * peak, (spec, rank, planned, peak)
    # Mutation: CLIP's memory modelled as if it held only B x D blocks (forgetting
    # the gathered N x D texts and their gradient) is rejected by the same bound.
    loss, n, dim, tile, _ = MEMORY_CASES[0].split(":")
    wrong = loss_memory(
        loss, strategy="ring + tiled", n=int(n), b=int(n) // world, dim=int(dim), elem=4,
        acc=4, tile=int(tile), w=world,
    )  # fmt: skip
    assert all(abs(wrong - peak) > 0.15 * peak for peak in measured[MEMORY_CASES[0]])
