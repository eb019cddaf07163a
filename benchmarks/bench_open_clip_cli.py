"""open_clip_train's real CLI, its own loop against wholebatch's launcher, on 2 CPU gloo ranks.

    .venv/bin/python -m benchmarks.bench_open_clip_cli --rounds 5

Runs in `.venv-oct` (`make venv-oct`), as tests/e2e/test_open_clip_train_cli.py does:
the tiny ViT CLIP and CSV data of tests/support/open_clip_train_cli.py (N random
32 x 32 images), `--accum-freq 2`, `--batch-size 8` (`--batch-size B`), one epoch, float32, SGD.
Each round runs both CLIs once, as fresh torchrun jobs, the order reversed every
other round. Reported: the median of the seconds per optimizer step that each
CLI logs itself (its last `Train Epoch` line, `Batch (t)`: the mean over the
epoch's steps after the first, which the first line logs alone), the median of
the per-round ratios (wholebatch / open_clip_train's loop), and the median wall
seconds of a whole run (start-up included).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / ".venv-oct" / "bin" / "python"
HELPER = ROOT / "tests" / "support" / "open_clip_train_cli.py"
MODES = ("open_clip_train", "wholebatch")


def _run(folder: Path, mode: str, name: str, samples: int, batch: int) -> tuple[float, float]:
    """(seconds per step as the CLI logs them, wall seconds of the whole run)."""
    launch = {
        "open_clip_train": [str(HELPER), "unfixed", "--"],
        "wholebatch": ["-m", "wholebatch.integrations.open_clip", "--"],
    }[mode]
    args = [
        "--model", f"local-dir:{folder / 'model'}", "--train-data", str(folder / "train.csv"),
        "--dataset-type", "csv", "--batch-size", str(batch), "--accum-freq", "2", "--epochs", "1",
        "--workers", "0", "--device", "cpu", "--precision", "fp32", "--opt", "timm/momentum",
        "--momentum", "0", "--wd", "0", "--lr", "0.01", "--skip-scheduler",
        "--logs", str(folder / "logs"), "--name", name, "--log-every-n-steps", str(samples),
        "--report-to", "none",
    ]  # fmt: skip
    cmd = [str(SIDE), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    start = time.perf_counter()
    out = subprocess.run(
        [*cmd, *launch, *args], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    wall = time.perf_counter() - start
    steps = re.findall(r"Batch \(t\): ([0-9.]+)", out.stdout + out.stderr)
    return float(steps[-1]), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=512, help="rows in the data set")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per rank and micro-batch")
    opts = parser.parse_args()
    if not SIDE.is_file():
        raise SystemExit(f"{SIDE} is missing: build it with `make venv-oct`")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        init = [str(SIDE), str(HELPER), "init", str(folder), str(opts.samples), "clip"]
        subprocess.run(init, check=True, capture_output=True, timeout=600)
        step: dict[str, list[float]] = {m: [] for m in MODES}
        wall: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(opts.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                s, w = _run(folder, mode, f"{mode}-{r}", opts.samples, opts.batch_size)
                step[mode].append(s)
                wall[mode].append(w)
    ratios = [f / u for f, u in zip(step["wholebatch"], step["open_clip_train"], strict=True)]
    b = opts.batch_size
    steps = opts.samples // (2 * 2 * b)
    print(f"{opts.rounds} rounds, {steps} steps of 2 ranks x 2 x {b} rows, load {os.getloadavg()}")
    for mode in MODES:
        print(
            f"{mode}: {statistics.median(step[mode]):.4f} s/step, "
            f"{statistics.median(wall[mode]):.1f} s per run"
        )
    print(f"s/step ratio (wholebatch / open_clip_train): median {statistics.median(ratios):.3f}x")
    print("per round: " + " ".join(f"{x:.3f}" for x in ratios))


if __name__ == "__main__":
    main()
