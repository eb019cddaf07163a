"""What one `wholebatch verify` run costs, this tree against another, taking turns on the same targets.

    PYTHONPATH=src:. python -m benchmarks.verify_cost --other /tmp/verify-old/src --rounds 5

Each round runs `python -m wholebatch verify TARGETS --json` (W = 2 x K = 3) once
with this tree's `src` and once with `--other`'s, in alternating order (odd
rounds this tree first), and records the wall time and the CPU time of the whole
process tree (the children's user + system time). Prints the medians, the
ratio this/other, and whether both gave every target the same verdict (a target
that fails runs its re-runs, so a changed verdict changes the cost by design).

Legend: W ranks, K micro-batches per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = (
    "examples/verify_clip.py:correct",
    "examples/verify_steps.py:correct",
    "examples/verify_tokens.py:correct",
    "examples/verify_clip.py:gather_no_grad",
    "examples/verify_steps.py:mean_of_means",
    "examples/verify_hf.py:gpt2_trainer",
    "examples/verify_hf.py:gpt2_wholebatch_trainer",
)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(
    src: str, targets: tuple[str, ...]
) -> tuple[float, float, list[tuple[str, list[str]]]]:
    """(wall s, CPU s of the process tree, each target's verdict) of one verify command."""
    env = {**os.environ, "PYTHONPATH": f"{src}:{ROOT}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "wholebatch", "verify", *targets, "--json"]
    cmd += ["--nproc", "2", "--micro-batches", "3"]
    cpu, start = _children_cpu(), time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    wall, cpu = time.monotonic() - start, _children_cpu() - cpu
    results = json.loads(done.stdout)["results"]
    verdicts = [(r["target"], [d["code"] for d in r["diagnoses"]]) for r in results]
    return wall, cpu, verdicts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--other", required=True, help="the other tree's src/ (e.g. a worktree at 75b74af)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--targets", nargs="*", default=list(TARGETS))
    args = parser.parse_args()
    here = str(ROOT / "src")
    trees = {"this": here, "other": args.other}
    times: dict[str, list[tuple[float, float]]] = {"this": [], "other": []}
    verdicts: dict[str, list[tuple[str, list[str]]]] = {}
    for r in range(args.rounds):
        order = ("this", "other") if r % 2 == 0 else ("other", "this")
        for name in order:
            wall, cpu, seen = run_once(trees[name], tuple(args.targets))
            times[name].append((wall, cpu))
            verdicts[name] = seen
            print(f"round {r + 1} {name:<5} wall {wall:6.1f} s  cpu {cpu:6.1f} s", flush=True)
    for name in ("this", "other"):
        walls = [w for w, _ in times[name]]
        cpus = [c for _, c in times[name]]
        print(
            f"{name:<5} ({trees[name]}): wall {statistics.median(walls):.1f} s, "
            f"cpu {statistics.median(cpus):.1f} s (medians of {args.rounds})"
        )
    ratio_wall = statistics.median(w for w, _ in times["this"]) / statistics.median(
        w for w, _ in times["other"]
    )
    ratio_cpu = statistics.median(c for _, c in times["this"]) / statistics.median(
        c for _, c in times["other"]
    )
    print(f"this/other: wall {ratio_wall:.3f}x, cpu {ratio_cpu:.3f}x")
    same = verdicts["this"] == verdicts["other"]
    print("the same verdicts:" if same else "verdicts differ:")
    for (target, a), (_, b) in zip(verdicts["this"], verdicts["other"], strict=True):
        print(f"  {target}: this {a or 'PASS'}, other {b or 'PASS'}")


if __name__ == "__main__":
    main()
