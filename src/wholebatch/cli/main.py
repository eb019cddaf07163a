"""The `wholebatch` command (docs/cli.md).

    wholebatch demo                    # CLIP on digits, 4 local processes: the whole-batch gradient at work
    wholebatch demo --gather           # the gradient through all_gather, on 2 processes
    wholebatch verify FILE.py:FN ...   # your step split over W ranks x K micro-batches vs one process
    wholebatch selftest                # every collective and loss on the real group (under torchrun too)
    wholebatch bench                   # the benchmarks, quick mode (from a source checkout)
    wholebatch lint PATH...            # static checks for the classic gradient mistakes
    wholebatch plan --loss clip ...    # memory, bytes and time per rank of a step, before the run

Exit codes: 0 ok; 1 a check failed (verify mismatch, selftest failure, lint
findings); 2 bad usage (a bad flag value, a TARGET that does not exist).
The flags of demo, verify and selftest are built from their config
dataclasses (`DemoConfig`, `VerifyConfig`, `SelftestConfig`): one flag per
field, its help the field's docstring, its validation the dataclass's.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import subprocess
import sys
import textwrap
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wholebatch.errors import WholebatchError

__all__ = ["main"]

# benchmarks/ modules `wholebatch bench` knows, in the order it runs them.
BENCHMARKS = (
    "bench_comm",
    "bench_accumulate",
    "bench_losses",
    "bench_cache",
    "bench_integrations",
    "bench_st",
    "bench_plan",
    "bench_lint",
    "bench_mesh",
    "bench_mesh_losses",
    "bench_mesh_normalize",
    "bench_trainers",
    "bench_open_clip_cli",
    "bench_verify_norm",
    "bench_split",
)


def _field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal under it), read from the source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # pragma: no cover - no source available
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--flag` per field of the dataclass `cls`: type, default and help from the field."""
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        default = f.default
        text = docs.get(f.name, "").replace("%", "%%")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action="store_true", help=text)
            continue
        convert: Any = {int: int, float: float, str: str, Path: Path}.get(kind, str)
        parser.add_argument(
            flag,
            dest=f.name,
            type=convert,
            default=default,
            metavar=f.name.upper(),
            help=f"{text} (default: {default})",
        )


def _config(cls: type, args: argparse.Namespace) -> Any:
    """Build the config from the parsed flags; its validation errors name the flag."""
    fields = dataclasses.fields(cls)
    try:
        return cls(**{f.name: getattr(args, f.name) for f in fields})
    except WholebatchError as exc:
        text = str(exc)
        for f in fields:
            if text.startswith(f.name):
                text = "--" + f.name.replace("_", "-") + text[len(f.name) :]
                break
        raise WholebatchError(text) from None


def _build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that subcommand gets its flags.

    Each subcommand's config lives beside code that imports torch; building only
    the one asked for keeps `wholebatch plan` (pure Python) from loading torch.
    """

    def wants(name: str) -> bool:
        return command is None or command == name

    parser = argparse.ArgumentParser(
        prog="wholebatch",
        description="The gradient of the whole batch, however the batch is split.",
        epilog="Exit codes: 0 ok, 1 a check failed, 2 bad usage. See docs/cli.md.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser(
        "demo",
        help="CLIP on scikit-learn's digits over N local processes (CachedStep + clip_loss)",
        description="Train left-half/right-half CLIP on the digits with a whole batch split over "
        "ranks and micro-batches; check the first step's gradient against one process; report "
        "held-out retrieval, memory, a plot and a JSON summary.",
    )
    if wants("demo"):
        from wholebatch.cli.demo import DemoConfig

        _add_config_flags(demo, DemoConfig)
        demo.add_argument(
            "--gather",
            action="store_true",
            help="instead: the 2-process demonstration of the gradient through all_gather "
            "(torch.distributed.all_gather vs wholebatch.all_gather)",
        )

    verify = sub.add_parser(
        "verify",
        help="check a training step: split over W ranks x K micro-batches vs one process",
        description="Run each TARGET's split step on W processes with K micro-batches each, "
        "the whole-batch reference in one process, compare every parameter's gradient, and name "
        "the likely mistake. TARGET: 'module:function' or 'path/to/file.py:function' (its folder "
        "first on sys.path) returning a wholebatch.verify.VerifySpec (or a TrainerSpec for a "
        "trainer that owns the split, a ReplaySpec for one that builds its batch in train()).",
    )
    if wants("verify"):
        from wholebatch.verify.runner import VerifyConfig

        verify.add_argument(
            "targets", nargs="+", metavar="TARGET", help="module:function or file.py:function"
        )
        _add_config_flags(verify, VerifyConfig)

    selftest = sub.add_parser(
        "selftest",
        help="every collective and loss against its reference on the real process group",
        description="Under torchrun: checks the group torchrun built (any backend, any number "
        "of nodes). Otherwise: starts --nproc local processes.",
    )
    if wants("selftest"):
        from wholebatch.cli.selftest import SelftestConfig

        _add_config_flags(selftest, SelftestConfig)

    bench = sub.add_parser("bench", help="run the benchmarks (quick mode) and print their tables")
    bench.add_argument("--full", action="store_true", help="the full configurations, not --quick")
    bench.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        default=None,
        help=f"run only these, of: {', '.join(BENCHMARKS)} (the 'bench_' may be left out)",
    )
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.add_argument("--timeout", type=float, default=1800.0, help="seconds per benchmark")

    sub.add_parser("lint", help="find classic gradient mistakes in training code", add_help=False)

    plan = sub.add_parser(
        "plan",
        help="memory, bytes and time per rank of one whole-batch step, at any W (docs/plan.md)",
        description="Size one optimizer step per rank before the run: memory (loss, activations at "
        "K, gradient caching), bytes each collective sends and receives, comm vs compute time, the "
        "K and tile to use, the largest batch that fits, and the contrastive strategies compared.",
    )
    if wants("plan"):
        from wholebatch.planner.config import PlanConfig

        _add_config_flags(plan, PlanConfig)
    return parser


def _usage_error(command: str, message: str) -> int:
    message = message.removeprefix(f"{command}: ")
    print(f"wholebatch {command}: error: {message}", file=sys.stderr)
    print(f"(run 'wholebatch {command} --help' for the flags)", file=sys.stderr)
    return 2


def _run_demo(args: argparse.Namespace) -> int:
    from wholebatch.cli.demo import DemoConfig, run_demo

    if args.gather:
        from wholebatch.cli.demo_gather import run_demo as run_gather

        return run_gather(nproc=2 if args.nproc == DemoConfig.nproc else args.nproc)
    try:
        config = _config(DemoConfig, args)
    except WholebatchError as exc:
        return _usage_error("demo", str(exc))
    return run_demo(config)


def _run_verify(args: argparse.Namespace) -> int:
    import json

    from wholebatch.comm.launch import LaunchError
    from wholebatch.verify.runner import TargetError, VerifyConfig, run_verify

    try:
        config = _config(VerifyConfig, args)
    except WholebatchError as exc:
        return _usage_error("verify", str(exc))
    try:
        reports = run_verify(args.targets, config)
    except TargetError as exc:
        return _usage_error("verify", str(exc))
    except LaunchError as exc:
        print(f"wholebatch verify: {exc}", file=sys.stderr)
        return 1
    passed = all(r.passed for r in reports)
    if config.json:
        doc = {"passed": passed, "results": [r.to_json() for r in reports]}
        print(json.dumps(doc, indent=2))
    else:
        print("\n\n".join(r.format() for r in reports))
        if len(reports) > 1:
            print(f"\n{sum(r.passed for r in reports)} of {len(reports)} targets passed.")
    return 0 if passed else 1


def _run_selftest(args: argparse.Namespace) -> int:
    from wholebatch.cli.selftest import SelftestConfig, run_selftest
    from wholebatch.comm.launch import LaunchError

    try:
        config = _config(SelftestConfig, args)
    except WholebatchError as exc:
        return _usage_error("selftest", str(exc))
    try:
        return run_selftest(config)
    except LaunchError as exc:
        print(f"wholebatch selftest: {exc}", file=sys.stderr)
        return 1


def _benchmarks_root() -> Path | None:
    """The checkout holding benchmarks/: the current directory, or the one above src/."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "benchmarks" / "__init__.py").is_file():
            return root
    return None


def _run_bench(args: argparse.Namespace) -> int:
    if args.list:
        print("\n".join(BENCHMARKS))
        return 0
    chosen = list(BENCHMARKS)
    if args.only:
        chosen = []
        for name in args.only:
            full = name if name.startswith("bench_") else f"bench_{name}"
            if full not in BENCHMARKS:
                return _usage_error(
                    "bench",
                    f"--only {name!r}: no such benchmark; choose from {', '.join(BENCHMARKS)}",
                )
            chosen.append(full)
    if not args.timeout > 0:
        return _usage_error("bench", f"--timeout must be > 0 seconds, got {args.timeout}")
    root = _benchmarks_root()
    if root is None:
        return _usage_error(
            "bench",
            "the benchmarks live in the source checkout (benchmarks/); run this from its root",
        )
    failed = []
    for name in chosen:
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *([] if args.full else ["--quick"])]
        print(f"== {name}{'' if args.full else ' --quick'}", flush=True)
        try:
            code = subprocess.run(cmd, cwd=root, timeout=args.timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            print(f"== {name}: timed out after {args.timeout:.0f} s", flush=True)
            code = 1
        print(f"== {name}: exit {code}\n", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


def _run_plan(args: argparse.Namespace) -> int:
    import json

    from wholebatch.planner import PlanConfig, plan

    try:
        config = _config(PlanConfig, args)
    except WholebatchError as exc:
        return _usage_error("plan", str(exc))
    result = plan(config)
    if config.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        print(result.format())
    if config.plots:
        from wholebatch.planner.plots import write_plots

        for path in write_plots(config, config.plots):
            print(f"wrote {path}", file=sys.stderr if config.json else sys.stdout)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 findings/failure, 2 usage error)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "lint":
        from wholebatch.lint import main as lint_main

        return lint_main(args_list[1:])
    known = ("demo", "verify", "selftest", "bench", "plan")
    parser = _build_parser(args_list[0] if args_list and args_list[0] in known else None)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return int(exc.code) if isinstance(exc.code, int) else 2
    runners = {
        "demo": _run_demo,
        "verify": _run_verify,
        "selftest": _run_selftest,
        "bench": _run_bench,
        "plan": _run_plan,
    }
    result: int = runners[args.command](args)
    return result


if __name__ == "__main__":
    sys.exit(main())
