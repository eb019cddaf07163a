"""The exchange's move on gloo: c10d's all-gather against direct sends, after a barrier.

    .venv/bin/python -m benchmarks.exchange_direct            # W = 2, 1 KiB .. 264 KiB per rank
    .venv/bin/python -m benchmarks.exchange_direct --world 3

Every loss call's exchange (`comm.agree.start_rows`) moves one row plus the room
for rows: 33 KiB per rank at 8 rows of two 512-dim float32 towers, 264 KiB at 64.
Per size, in turn after a barrier each round (the slowest rank's time counts, the
median is shown, the ratio is to c10d's all-gather in the same rounds):

- c10d all-gather: `all_gather_single`, as the exchange ran before (async, waited);
- direct: `comm.direct.gather_flat` (receives, then sends, to every peer at once);
- c10d all-gather after 120 us of work: the work a loss call does before its row
  exists (its checks, the row, the buffer), then the all-gather;
- direct, receives posted before the work: `expect_flat`, the 120 us, `send`
  (how `common.prepare` runs the exchange: a peer's bytes move the moment it
  sends them);
- two in a row: two moves back to back (two loss calls' exchanges, or the checked
  `all_gather`'s size exchange then its rows), by c10d's all-gather, by
  `gather_flat` (sends, then receives), and with each receive posted just before
  its send (the order `gather_flat` does not use: ~2 ms at 264 KiB).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._common import spawn_ranks
from wholebatch.comm import direct
from wholebatch.comm._c10d import all_gather_single

WORK_S = 120e-6


def _work() -> None:
    end = time.perf_counter() + WORK_S
    while time.perf_counter() < end:
        pass


def _methods(nbytes: int, w: int) -> dict[str, Callable[[], None]]:
    send = torch.zeros(nbytes, dtype=torch.uint8)
    sizes = [nbytes] * w

    def c10d(work: bool) -> Callable[[], None]:
        def run() -> None:
            if work:
                _work()
            out = torch.empty(w * nbytes, dtype=torch.uint8)
            all_gather_single(out, send, async_op=True).wait()

        return run

    def flat(early: bool) -> Callable[[], None]:
        def run() -> None:
            out = torch.empty(w * nbytes, dtype=torch.uint8)
            if early:
                posted = direct.expect_flat(out, sizes, None, send.device)
                _work()
                work = posted.send(send, async_op=True)
            else:
                work = direct.gather_flat(out, send, sizes, None, async_op=True)
            work.wait()

        return run

    def pair(method: str) -> Callable[[], None]:
        def move() -> None:
            out = torch.empty(w * nbytes, dtype=torch.uint8)
            if method == "c10d":
                all_gather_single(out, send)
            elif method == "direct":
                direct.gather_flat(out, send, sizes, None)
            else:  # receives posted first, then the sends
                posted = direct.expect_flat(out, sizes, None, send.device)
                posted.send(send)

        def run() -> None:
            move()
            move()

        return run

    return {
        "two in a row, c10d all-gather": pair("c10d"),
        "two in a row, direct": pair("direct"),
        "two in a row, receives first": pair("receives first"),
        "c10d all-gather": c10d(False),
        "direct": flat(False),
        "c10d all-gather after 120 us of work": c10d(True),
        "direct, receives posted before the work": flat(True),
    }


def _rank(rank: int, w: int, cfg: dict[str, Any]) -> Any:
    got: dict[tuple[int, str], float] = {}
    for nbytes in cfg["sizes"]:
        methods = _methods(nbytes, w)
        times: dict[str, list[float]] = {name: [] for name in methods}
        names = list(methods)
        for c in range(cfg["rounds"]):
            for name in names[c % len(names) :] + names[: c % len(names)]:
                dist.barrier()
                t0 = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            got[(nbytes, name)] = statistics.median(ts[5:])
    return got


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--sizes", default="1024,33880,262232", help="bytes per rank")
    a = p.parse_args(argv)
    cfg = dict(sizes=[int(x) for x in a.sizes.split(",")], rounds=a.rounds)
    got = spawn_ranks(_rank, a.world, cfg, timeout=1200)
    load = os.getloadavg()
    print(f"W = {a.world} gloo ranks, median of {a.rounds - 5} rounds (ms; the slower rank)")
    print(f"load average after the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("| bytes per rank | method | ms | vs c10d's all-gather in the same pattern |")
    print("|---|---|---|---|")
    for key in got[0]:
        nbytes, name = key
        ms = max(got[r][key] for r in got) * 1e3
        if name.startswith("two in a row"):
            base = "two in a row, c10d all-gather"
        elif "work" in name:
            base = "c10d all-gather after 120 us of work"
        else:
            base = "c10d all-gather"
        ref = max(got[r][(nbytes, base)] for r in got) * 1e3
        print(f"| {nbytes:,} | {name} | {ms:.3f} | {ms / ref:.2f}x |")


if __name__ == "__main__":
    main()
