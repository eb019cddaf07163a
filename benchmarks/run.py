"""`make bench`: every benchmark, in its quick mode unless --full is given.

    python -m benchmarks.run            # quick: a few minutes on 2 cores
    python -m benchmarks.run --full     # the configurations in benchmarks/RESULTS.md
"""

from __future__ import annotations

import importlib
import sys
import time

BENCHMARKS = ["bench_comm", "bench_accumulate", "bench_losses", "bench_lint"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    full = "--full" in args
    failed = []
    for name in BENCHMARKS:
        try:
            module = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as exc:
            print(f"== {name}: skipped ({exc})")
            continue
        print(f"== {name}{'' if full else ' --quick'}", flush=True)
        start = time.perf_counter()
        code = module.main([] if full else ["--quick"])
        print(f"== {name}: exit {code}, {time.perf_counter() - start:.0f} s\n", flush=True)
        if code:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
