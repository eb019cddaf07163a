"""Benchmark `wholebatch lint` on the installed torch package: files per second, on one core.

    .venv/bin/python -m benchmarks.bench_lint            # the whole torch package
    .venv/bin/python -m benchmarks.bench_lint --quick    # torch/distributed and torch/optim only

Prints the files, findings, seconds and files/s of the lint, and beside it the time of
`ast.parse` alone over the same files (a floor no AST linter can beat), measured in
the same run, so the ratio means something on a noisy shared machine. The target
(issue): the whole package in under 60 s on one core.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import time
from collections import Counter
from pathlib import Path

from wholebatch.lint import iter_python_files, lint_paths

__all__ = ["main", "torch_dir"]


def torch_dir() -> Path:
    """The installed torch package's folder, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench_lint: torch is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations)))


def _parse_only(files: list[Path]) -> float:
    t0 = time.perf_counter()
    for f in files:
        with contextlib.suppress(SyntaxError):  # the same file lint reports as WB000
            ast.parse(f.read_bytes())
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_lint")
    parser.add_argument("--quick", action="store_true", help="lint torch/distributed + torch/optim")
    args = parser.parse_args(argv)
    root = torch_dir()
    paths = [root / "distributed", root / "optim"] if args.quick else [root]
    files = list(iter_python_files(paths))
    t0 = time.perf_counter()
    findings, n = lint_paths(paths)
    lint_s = time.perf_counter() - t0
    parse_s = _parse_only(files)
    by_code = Counter(f.code for f in findings)
    print(f"target      {'subset' if args.quick else 'whole package'}: {root}")
    print(f"files       {n}")
    print(f"findings    {len(findings)}  {dict(sorted(by_code.items()))}")
    print(f"lint        {lint_s:.2f} s  ({n / lint_s:.0f} files/s)")
    print(f"parse only  {parse_s:.2f} s  ({n / parse_s:.0f} files/s)")
    print(f"lint/parse  {lint_s / parse_s:.2f}x")
    for f in findings:
        print(f"  {Path(f.path).relative_to(root.parent)}:{f.line}:{f.col}: {f.code}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
