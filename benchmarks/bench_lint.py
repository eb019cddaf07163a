"""Benchmark `wholebatch lint`: throughput on the installed torch package, and the start-up
cost of one small file (issue 10).

    .venv/bin/python -m benchmarks.bench_lint              # whole torch package
    .venv/bin/python -m benchmarks.bench_lint --quick      # torch/distributed + torch/optim
    .venv/bin/python -m benchmarks.bench_lint --startup    # `wholebatch lint FILE`, imports
    .venv/bin/python -m benchmarks.bench_lint --peers      # open_clip, lightly, sentence-transformers
    .venv/bin/python -m benchmarks.bench_lint --baseline 75b74af --target 1.2   # issue 33

Throughput: the lint of this checkout, `ast.parse` alone over the same files (a floor
no AST linter can beat), and the lint of an earlier revision (`--baseline`, default
`BASELINE_REV`: the linter before it followed calls across functions), each in its own
process, taking turns for `--rounds` rounds, so that the ratios compare runs of one
machine at one load; wall time and the lint process's CPU time (which a shared,
loaded machine inflates least) are both printed. The earlier revision is read from git (`git archive`) into a
temporary folder; nothing is checked out here.

Start-up (`--startup`, issue 10): wall time of `wholebatch lint FILE` on a 100-line file
(tests/support/lint_cases/right_train_100.py) against the same command as it was before the
layout change, when the CLI imported torch first (the pre-layout revision `LAYOUT_REV`,
run from `git archive`), and against `python -c "import torch; from wholebatch.cli import
main; main(['lint', FILE])"`; and `import wholebatch` against `import torch`. Each
command runs `--repeat` times, taking turns; medians are printed.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from importlib import metadata
from pathlib import Path

from wholebatch.lint import iter_python_files, lint_paths

__all__ = ["BASELINE_REV", "LAYOUT_REV", "main", "peer_dirs", "torch_dir"]

ROOT = Path(__file__).resolve().parents[1]
# The linter before summaries across functions (issue 16) and before the layout (issue 10).
BASELINE_REV = "290ef4b"
LAYOUT_REV = "606270a"
SMALL_FILE = ROOT / "tests" / "support" / "lint_cases" / "right_train_100.py"
# Peer libraries the test extra installs (`make .venv/.peers`): distribution -> packages.
PEERS: dict[str, tuple[str, ...]] = {
    "open_clip_torch": ("open_clip", "open_clip_train"),
    "lightly": ("lightly",),
    "sentence-transformers": ("sentence_transformers",),
}

_WORKER = """
import json, sys, time
from wholebatch.lint import lint_paths
t0, c0 = time.perf_counter(), time.process_time()
findings, n = lint_paths(sys.argv[1:])
dt, cpu = time.perf_counter() - t0, time.process_time() - c0
import wholebatch.lint as L
print(json.dumps({"files": n, "findings": len(findings), "seconds": dt, "cpu": cpu,
                  "src": L.__file__}))
"""


def torch_dir() -> Path:
    """The installed torch package's folder, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench_lint: torch is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations)))


def peer_dirs() -> dict[str, Path | None]:
    """package -> its installed folder (None if not installed), from the distributions'
    metadata: nothing is imported (open_clip and lightly cannot be, without torchvision)."""
    out: dict[str, Path | None] = {}
    for dist_name, packages in PEERS.items():
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            out.update(dict.fromkeys(packages))
            continue
        for pkg in packages:
            folder = Path(str(dist.locate_file(pkg)))
            out[pkg] = folder if (folder / "__init__.py").is_file() else None
    return out


def _parse_only(files: list[Path]) -> float:
    t0 = time.perf_counter()
    for f in files:
        with contextlib.suppress(SyntaxError):  # the same file lint reports as WB000
            ast.parse(f.read_bytes())
    return time.perf_counter() - t0


def _export(rev: str, dest: Path) -> Path | None:
    """`src/` of revision `rev` of this repository, unpacked under `dest` (None: no git)."""
    archive = dest / f"{rev}.tar"
    try:
        subprocess.run(
            ["git", "-C", str(ROOT), "archive", "-o", str(archive), rev, "src"],
            check=True,
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as err:
        print(f"(revision {rev} unavailable: {err})")
        return None
    out = dest / rev
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return out / "src"


def _env(pythonpath: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def _lint_in_process(paths: list[Path], src: Path | None) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, *map(str, paths)],
        env=_env(src),
        capture_output=True,
        text=True,
        check=True,
    )
    row: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return row


def throughput(paths: list[Path], rounds: int, baseline: str | None, target: float = 2.0) -> None:
    """Print files/s of this lint, of `baseline`'s lint and of parse alone, taking turns
    (`target`: the bound on this lint's time over the baseline's, printed beside it)."""
    files = list(iter_python_files(paths))
    with tempfile.TemporaryDirectory() as tmp:
        base_src = _export(baseline, Path(tmp)) if baseline else None
        now: list[float] = []
        then: list[float] = []
        cpu_now: list[float] = []
        cpu_then: list[float] = []
        parse: list[float] = []
        n_now = n_then = 0
        for _ in range(rounds):
            row = _lint_in_process(paths, None)
            now.append(row["seconds"])
            cpu_now.append(row["cpu"])
            n_now = int(row["findings"])
            if base_src is not None:
                row = _lint_in_process(paths, base_src)
                assert str(base_src) in str(row["src"]), row  # the old linter really ran
                then.append(row["seconds"])
                cpu_then.append(row["cpu"])
                n_then = int(row["findings"])
            parse.append(_parse_only(files))
    n = len(files)
    t_now, t_parse = statistics.median(now), statistics.median(parse)
    print(f"files          {n}  (rounds: {rounds}, medians)")
    print(f"lint (now)     {t_now:.2f} s  ({n / t_now:.0f} files/s)  findings {n_now}")
    if then:
        t_then = statistics.median(then)
        print(f"lint ({baseline})  {t_then:.2f} s  ({n / t_then:.0f} files/s)  findings {n_then}")
        print(f"now/{baseline}    {t_now / t_then:.2f}x the time (target: <= {target:g}x)")
        paired = ", ".join(f"{a / b:.2f}" for a, b in zip(now, then, strict=True))
        print(f"  per round    {paired}  (each: this lint / {baseline}'s, run back to back)")
        # CPU time of the lint process: what a loaded machine inflates least.
        c_now, c_then = statistics.median(cpu_now), statistics.median(cpu_then)
        print(f"cpu time       {c_now:.2f} s against {c_then:.2f} s: {c_now / c_then:.2f}x")
    print(f"parse only     {t_parse:.2f} s  ({n / t_parse:.0f} files/s)")
    print(f"lint/parse     {t_now / t_parse:.2f}x")


def _time(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, capture_output=True, check=False)
    return time.perf_counter() - t0


def startup(repeat: int) -> None:
    """Print medians of the start-up commands of issue 10, taking turns."""
    py = sys.executable
    script = Path(py).with_name("wholebatch")
    f = str(SMALL_FILE)
    with tempfile.TemporaryDirectory() as tmp:
        layout_src = _export(LAYOUT_REV, Path(tmp))
        cmds: dict[str, tuple[list[str], dict[str, str]]] = {
            "wholebatch lint FILE": ([str(script), "lint", f], _env()),
            "python -m wholebatch lint FILE": ([py, "-m", "wholebatch", "lint", f], _env()),
            "import torch; cli.main(['lint', FILE])": (
                [py, "-c", f"import torch; from wholebatch.cli import main; main(['lint', {f!r}])"],
                _env(),
            ),
            "import wholebatch": ([py, "-c", "import wholebatch"], _env()),
            "import torch": ([py, "-c", "import torch"], _env()),
            "import wholebatch; wholebatch.clip_loss": (
                [py, "-c", "import wholebatch; wholebatch.clip_loss"],
                _env(),
            ),
            "python -c pass": ([py, "-c", "pass"], _env()),
        }
        if layout_src is not None:
            cmds[f"{LAYOUT_REV}: python -m wholebatch lint FILE"] = (
                [py, "-m", "wholebatch", "lint", f],
                _env(layout_src),
            )
        times: dict[str, list[float]] = {k: [] for k in cmds}
        for _ in range(repeat):
            for name, (cmd, env) in cmds.items():
                times[name].append(_time(cmd, env))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"file: {SMALL_FILE.relative_to(ROOT)} ({len(SMALL_FILE.read_text().splitlines())} lines)"
    )
    print(f"medians of {repeat} runs each, taking turns")
    for name, t in med.items():
        print(f"  {t:7.3f} s  {name}")
    lint = med["wholebatch lint FILE"]
    print(f"wholebatch lint FILE: {lint:.3f} s (target <= 0.3 s)")
    old = f"{LAYOUT_REV}: python -m wholebatch lint FILE"
    if old in med:
        print(f"  {med[old] / lint:.1f}x faster than {old} (target >= 10x)")
    emul = med["import torch; cli.main(['lint', FILE])"]
    print(f"  {emul / lint:.1f}x faster than importing torch first")
    extra = med["import wholebatch"] - med["import torch"]
    print(f"import wholebatch - import torch: {extra:+.3f} s (target <= +0.15 s)")
    extra = med["import wholebatch; wholebatch.clip_loss"] - med["import torch"]
    print(f"import wholebatch; wholebatch.clip_loss - import torch: {extra:+.3f} s")


def peers() -> None:
    """Lint the installed peer libraries; print what is found."""
    dirs = peer_dirs()
    for pkg, folder in dirs.items():
        if folder is None:
            print(f"{pkg}: not installed")
    found = [d for d in dirs.values() if d is not None]
    t0 = time.perf_counter()
    findings, n = lint_paths(found)
    dt = time.perf_counter() - t0
    print(f"peers: {n} files, {len(findings)} findings, {dt:.2f} s")
    for f in findings:
        print(f"  {f.path}:{f.line}:{f.col}: {f.code} {f.message}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_lint")
    parser.add_argument("--quick", action="store_true", help="lint torch/distributed + torch/optim")
    parser.add_argument("--startup", action="store_true", help="time one small file and imports")
    parser.add_argument("--peers", action="store_true", help="lint the installed peer libraries")
    parser.add_argument(
        "--rounds", type=int, default=None, help="throughput rounds (default 2; 1 with --quick)"
    )
    parser.add_argument("--repeat", type=int, default=7, help="start-up runs per command")
    parser.add_argument(
        "--target",
        type=float,
        default=2.0,
        help="bound on the time over the baseline's, printed beside the ratio (issue 16: 2; "
        "issue 33, against 75b74af: 1.2)",
    )
    parser.add_argument(
        "--baseline",
        default=BASELINE_REV,
        help=f"git revision to compare throughput with ('' for none; default {BASELINE_REV})",
    )
    args = parser.parse_args(argv)
    if args.startup:
        startup(args.repeat)
        return 0
    if args.peers:
        peers()
        return 0
    root = torch_dir()
    paths = [root / "distributed", root / "optim"] if args.quick else [root]
    print(f"target         {'subset' if args.quick else 'whole package'}: {root}")
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 2)
    throughput(paths, rounds, args.baseline or None, args.target)
    findings, _ = lint_paths(paths)
    print(
        f"findings       {len(findings)}  {dict(sorted(Counter(f.code for f in findings).items()))}"
    )
    for f in findings:
        print(f"  {Path(f.path).relative_to(root.parent)}:{f.line}:{f.col}: {f.code}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
