"""The planner against measurement on real gloo ranks: bytes exactly, memory within 15%.

Bytes: every rank runs the REAL public loss forward + backward under
`count_collectives` (pass-through counters on the c10d calls,
tests/support/plan_counting.py) and its socket bytes (`wchar`) are read too; the
planner's per-rank, per-phase, per-primitive bytes must EQUAL the counted ones,
for every rank, with uneven sizes and an empty rank, at W = 2, 3 and 4, for
each loss (InfoNCE with hard negatives and every direction; the exchange
skipped with `sizes=` and `check=False`); the socket bytes must be the counted
ones plus gloo's small per-message headers. Every case of one W runs in ONE
call on the shared world (tests/support/harness.py), once per session.

Memory: each rank's peak-RSS growth over the loss (glibc's mmap threshold
fixed, so RSS follows live memory) within 15% of the planner's `loss_memory`,
at W = 3 (no coefficient was read at W = 3). The N = 4,096 ... 32,768 sweep
lives in benchmarks/bench_plan.py (results in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.support.harness import run_ranks
from tests.support.plan_cases import DTYPES, Case, call, inputs, planned
from tests.support.plan_counting import Counter, count_collectives, wchar
from tests.support.plan_memprobe import case_of
from wholebatch.planner.memory import LOSS_STRATEGY, STRATEGY_NAMES, loss_memory

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
CASES = [
    Case(loss="clip", sizes=(37, 0, 21)),
    Case(loss="clip", sizes=(16, 16), dtype="bf16"),
    Case(loss="clip", sizes=(37, 0, 21), known_sizes=True),
    Case(loss="siglip", sizes=(5, 9, 0, 13)),
    Case(loss="siglip", sizes=(24, 24, 24), dtype="bf16"),
    Case(loss="nt_xent", sizes=(11, 0, 6)),
    Case(loss="nt_xent", sizes=(8, 8, 8, 8), known_sizes=True),
    Case(loss="info_nce", sizes=(3, 17), dtype="bf16", k=2),
    Case(loss="info_nce", sizes=(9, 1, 0, 4), k=1, directions=ALL),
    Case(loss="info_nce", sizes=(7, 0, 5), directions=("query_to_doc", "doc_to_query")),
    # the ring forms (strategy="ring")
    Case(loss="clip", sizes=(37, 0, 21), strategy="ring"),
    Case(loss="clip", sizes=(16, 16), dtype="bf16", strategy="ring"),
    Case(loss="info_nce", sizes=(9, 1, 0, 4), k=1, directions=ALL, strategy="ring"),
    Case(loss="info_nce", sizes=(3, 17), dtype="bf16", k=2, strategy="ring", known_sizes=True),
    # the tiled forms at small batches (the small path off: sizing.set_small_rows(0))
    Case(loss="clip", sizes=(37, 0, 21), small=0),
    Case(loss="clip", sizes=(37, 0, 21), known_sizes=True, small=0),
    Case(loss="siglip", sizes=(5, 9, 0, 13), small=0),
    Case(loss="nt_xent", sizes=(8, 8, 8, 8), known_sizes=True, small=0),
    Case(loss="info_nce", sizes=(9, 1, 0, 4), k=1, directions=ALL, small=0),
    # the small path's row limit: N = 58 > 40 runs the tiled form
    Case(loss="clip", sizes=(37, 0, 21), small=40),
    # the small path with rows of 256 dims (rows past what the exchange once carried)
    Case(loss="clip", sizes=(300, 200, 0), dim=256),
    # the losses of round 4: every path of each
    Case(loss="dcl", sizes=(7, 0, 5)),
    Case(loss="dcl", sizes=(7, 0, 5), small=0),
    Case(loss="dcl", sizes=(7, 0, 5), strategy="ring"),
    Case(loss="supcon", sizes=(9, 1, 0, 4)),
    Case(loss="supcon", sizes=(9, 1, 0, 4), small=0),
    Case(loss="supcon", sizes=(9, 1, 0, 4), strategy="ring", known_sizes=True),
    Case(loss="maxsim", sizes=(6, 0, 3)),
    Case(loss="maxsim", sizes=(6, 0, 3), small=0, dtype="bf16"),
    Case(loss="maxsim", sizes=(6, 0, 3), strategy="ring"),
    # statistics past sizing.STATS_GATHER_BYTES: combined by two all-reduces, not one all-gather
    Case(loss="clip", sizes=(2500, 0, 2600), dim=8),
    Case(loss="nt_xent", sizes=(1500, 0, 1200), dim=8),
]
# Large enough that payload dominates the socket bytes (the header check).
SOCKET = [Case(loss="clip", sizes=(300, 200, 0), dim=256, small=0),
          Case(loss="siglip", sizes=(256,) * 3, dim=256),
          Case(loss="clip", sizes=(300, 200, 0), dim=256, strategy="ring"),
          Case(loss="clip", sizes=(60, 40, 20), dim=256)]  # fmt: skip


def _count(case: Case) -> dict[str, Any]:
    """This rank's counted bytes per (phase, primitive), and its socket bytes, for one step."""
    args = inputs(case, dist.get_rank())
    call(case, args).backward()  # a warm-up call: nothing of it may change the counted one
    args = inputs(case, dist.get_rank())
    fwd, bwd = Counter(), Counter()
    dist.barrier()
    w0 = wchar()
    with count_collectives(fwd):
        out = call(case, args)
    with count_collectives(bwd):
        out.backward()
    socket = wchar() - w0
    return {
        "forward": (_nonzero(fwd.sent), _nonzero(fwd.received)),
        "backward": (_nonzero(bwd.sent), _nonzero(bwd.received)),
        "calls": fwd.calls + bwd.calls,
        "wchar": socket,
    }


def _count_all(cases: list[Case]) -> list[dict[str, Any]]:
    return [_count(c) for c in cases]


def _nonzero(d: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in d.items() if v}


@pytest.fixture(scope="module")
def counted() -> dict[Case, list[dict[str, Any]]]:
    """Every case's per-rank counts: one call per world size."""
    out: dict[Case, list[dict[str, Any]]] = {}
    for w in sorted({c.world for c in CASES + SOCKET}):
        cases = [c for c in CASES + SOCKET if c.world == w]
        per_rank = run_ranks(w, _count_all, cases, timeout=120)
        for i, c in enumerate(cases):
            out[c] = [per_rank[r][i] for r in range(w)]
    return out


@pytest.mark.parametrize("case", CASES, ids=Case.label)
def test_planned_bytes_equal_counted_bytes_on_every_rank(
    case: Case, counted: dict[Case, list[dict[str, Any]]]
) -> None:
    for rank, got in enumerate(counted[case]):
        want = planned(case, rank)
        for phase in ("forward", "backward"):
            assert want[phase] == got[phase], (rank, phase, want[phase], got[phase])


def test_socket_bytes_are_the_counted_bytes_plus_headers(
    counted: dict[Case, list[dict[str, Any]]],
) -> None:
    """gloo writes each message's payload and a header (measured on torch 2.13: 144 bytes per message)."""
    for case in SOCKET:
        for rank, got in enumerate(counted[case]):
            payload = sum(sum(got[p][0].values()) for p in ("forward", "backward"))
            assert payload == sum(
                sum(planned(case, rank)[p][0].values()) for p in ("forward", "backward")
            )
            extra = got["wchar"] - payload
            # all-reduces of a few floats may move a few more bytes than the ring
            # model (gloo rounds to W chunks), and each call writes a header per
            # message: at most 2 (W - 1) messages (a ring all-reduce), 144 bytes each.
            messages = 2 * (case.world - 1) * got["calls"]
            assert -64 <= extra <= 160 * messages, (case.label(), rank, payload, got)
            assert payload >= 0.95 * got["wchar"] or payload == 0, (case.label(), rank, got)


def test_mutations_are_rejected(counted: dict[Case, list[dict[str, Any]]]) -> None:
    """Known-wrong models must not match: a forgotten backward ring, the old exchange row, k
    ignored, the small path's backward counted."""
    siglip = next(c for c in CASES if c.loss == "siglip" and c.small == 0)
    wrong = planned(siglip, 1)
    wrong["backward"] = ({"all_reduce": wrong["backward"][0]["all_reduce"]}, wrong["backward"][1])
    assert wrong["backward"] != counted[siglip][1]["backward"]
    # the exchange forgotten (as if every caller passed sizes= with check=False)
    clip = CASES[0]
    old = planned(dataclasses.replace(clip, known_sizes=True), 0)
    assert old["forward"] != counted[clip][0]["forward"]
    # the small path (N = 58) modelled as the tiled form: backward collectives that never run
    # (its backward is one all-reduce of one number, the upstream gradient)
    assert set(counted[clip][0]["backward"][0]) == {"all_reduce"}
    tiled_model = planned(dataclasses.replace(clip, small=0), 0)["backward"]
    assert tiled_model != counted[clip][0]["backward"]
    # InfoNCE's hard negatives forgotten (the gather of documents only)
    nce = next(c for c in CASES if c.loss == "info_nce" and c.k and c.small == 0)  # tiled
    assert planned(dataclasses.replace(nce, k=0), 1) != planned(nce, 1)
    assert planned(dataclasses.replace(nce, k=0), 1)["forward"] != counted[nce][1]["forward"]


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------

# W = 3 (a check: coefficients were read at W = 1, 2, 4), tile 256 (read at 512
# and 2,048), InfoNCE with k = 1 and doc_to_query (read at k = 0 and 3).
MEMORY = [
    "clip:4608:256:256:fp32",
    "siglip:4608:256:256:fp32",
    "nt_xent:4608:256:256:bf16",
    "info_nce:4608:256:256:bf16:1:q2d+d2q",
    # the ring forms (coefficients read at W = 2 and 4, k = 0 and 2)
    "clip/ring:4608:256:256:fp32",
    "info_nce/ring:4608:256:256:bf16:1:q2d+d2q",
    "info_nce/ring:4608:256:256:fp32:1:q2d+q2q+d2d",
    # round 4's losses (coefficients read at W = 3 and 2: docs/plan.md)
    "dcl/ring:4608:256:256:fp32",
    "supcon/ring:4608:256:256:fp32",
    "maxsim:1536:128:256:fp32",
    "maxsim/ring:1536:128:256:fp32",
]


def _planned_memory(spec: str, world: int) -> int:
    c = case_of(spec, world)
    elem = DTYPES[c.dtype].itemsize
    strategy = STRATEGY_NAMES[c.strategy] if c.loss != "siglip" else LOSS_STRATEGY[c.loss]
    return loss_memory(
        c.loss, strategy=strategy, n=sum(c.sizes),
        b=c.sizes[0], dim=c.dim, elem=elem, acc=max(4, elem), tile=c.tile or 512, w=world,
        negatives=c.k, directions=c.directions, tokens=c.tokens, device="cpu",
    )  # fmt: skip


def _measure_fresh(world: int, specs: list[str]) -> list[list[int]]:
    """Per-rank peaks in FRESH processes (a reused process measured up to 25% high after
    other tests had run in it); the probe exits 1 at once if a rank fails, or after its deadline."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.plan_memprobe", str(world), *specs], capture_output=True,
        text=True, env=env, timeout=240, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    # the probe's ranks share its stdout, and gloo in torch 2.6-2.9 writes "[Gloo] Rank r is
    # connected ..." there (lines of several ranks run together): read the probe's rows only
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith('{"spec"')]
    rows = {r["spec"]: r["peaks"] for r in map(json.loads, lines)}
    return [[rows[s][r] for s in specs] for r in range(world)]


def test_planned_loss_memory_within_15_percent_of_peak_rss() -> None:
    """W = 3 fresh gloo ranks, one forward + backward per loss; every rank within 15%."""
    world = 3
    # Three fresh worlds, each rank's median: a peak moves from world to world both ways.
    # High: now and then one rank's peak came out ~2.4 MB (~17%) above the others' in one
    # world and not the next (clip, about one world in six). Low: the rings' peak depends on
    # how far the arriving chunks lag behind the computed ones (docs/plan.md; the planner
    # models the middle), and clip/ring:4608 read 15-17% below its usual peak in about one
    # run in four (torch 2.8 and 2.10, RESULTS.md "Compatibility"; 2.13 and 2.8 both read
    # 6.3-6.6 MB otherwise). The smaller of two worlds, as this test took before, keeps
    # every low outlier; the median of three drops one outlier either way.
    worlds = [_measure_fresh(world, MEMORY) for _ in range(3)]
    measured = [
        [sorted(w[r][i] for w in worlds)[1] for i in range(len(MEMORY))] for r in range(world)
    ]
    for i, spec in enumerate(MEMORY):
        planned_bytes = _planned_memory(spec, world)
        for rank in range(world):
            peak = measured[rank][i]
            assert abs(planned_bytes - peak) <= 0.15 * peak, (spec, rank, planned_bytes, peak)
    # Mutations, rejected by the same bound on every rank: CLIP modelled without
    # the gathered N x D texts and their gradient (only its B x D buffers), and
    # with the model of the kernels before issue 14 (5 float32 B x D buffers, 2 tiles).
    clip = case_of(MEMORY[0], world)
    n, b, d, t = sum(clip.sizes), clip.sizes[0], clip.dim, clip.tile or 512
    for wrong in (3 * 4 * b * d + 3.5 * t * t * 4, 2 * 4 * n * d + 5 * 4 * b * d + 2 * t * t * 4):
        assert all(abs(wrong - m[0]) > 0.15 * m[0] for m in measured), (wrong, measured)
    # The ring CLIP modelled as the whole-block ring it replaced (the block, the next one and
    # both their gradients, 4.8 float32 B x D buffers from W = 3): its chunks are measured.
    ring = MEMORY.index("clip/ring:4608:256:256:fp32")
    whole_block = 4.8 * 4 * b * d + 2.8 * t * t * 4
    assert all(abs(whole_block - m[ring]) > 0.15 * m[ring] for m in measured), measured
