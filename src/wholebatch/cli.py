"""The `wholebatch` command.

wholebatch demo            # the gradient through all_gather, on 2 local processes
wholebatch lint PATH...    # static checks for the classic gradient mistakes
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wholebatch",
        description="The gradient of the whole batch, however the batch is split.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    demo = sub.add_parser("demo", help="show the whole-batch gradient through all_gather")
    demo.add_argument("--nproc", type=int, default=2, help="local processes (default 2)")
    sub.add_parser("lint", help="find classic gradient mistakes in training code", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 findings/failure, 2 usage error)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "lint":
        from wholebatch.lint import main as lint_main

        return lint_main(args_list[1:])
    parser = _build_parser()
    args = parser.parse_args(args_list)
    if args.command == "demo":
        from wholebatch.demo_gather import run_demo

        return run_demo(nproc=args.nproc)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
