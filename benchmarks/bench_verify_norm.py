"""Cost of verify's normalisation reading: one failing target with and without the spec's `normalize`.

    PYTHONPATH=src .venv/bin/python -m benchmarks.bench_verify_norm --rounds 3

tests/support/verify_norm_targets.py's GRPO step (per-micro-batch sequence means), W = 2 x K = 3,
as `grpo_per_micro_batch` (normalize and item_losses given: verify also fits the
item weights, 14 cells) and `grpo_per_micro_batch_no_ids` (the same step without
them), taking turns each round; each run is a whole `run_verify` (its processes
included). Medians and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from wholebatch.verify import VerifyConfig, run_verify

TARGETS = {
    "with normalize": "tests/support/verify_norm_targets.py:grpo_per_micro_batch",
    "without": "tests/support/verify_norm_targets.py:grpo_per_micro_batch_no_ids",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = VerifyConfig(nproc=2, micro_batches=3)
    times: dict[str, list[float]] = {k: [] for k in TARGETS}
    for _ in range(args.rounds):
        for label, target in TARGETS.items():
            start = time.perf_counter()
            (report,) = run_verify([target], config)
            times[label].append(time.perf_counter() - start)
            assert not report.passed, target
            print(label, [d.code for d in report.diagnoses], flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    for label, values in times.items():
        print(f"{label:<15} {med[label]:6.2f} s (median of {len(values)}: "
              f"{', '.join(f'{v:.2f}' for v in values)})")  # fmt: skip
    print(f"with/without   {med['with normalize'] / med['without']:.3f}x")


if __name__ == "__main__":
    main()
