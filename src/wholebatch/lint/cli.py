"""`wholebatch lint PATH...`: the command line, and how findings are printed
(ruff-style `path:line:col: CODE message` lines, JSON, or the rule table).

    wholebatch lint train.py src/             # ruff-style lines; exit 1 if anything found
    wholebatch lint --select WB1 --ignore WB105 .
    wholebatch lint --format json train.py
    wholebatch lint --tests .                 # test files' findings too (tier "test")
    wholebatch lint --list-rules

Exit codes: 0 clean, 1 findings, 2 usage error (bad option, unknown rule, missing path).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import TextIO

from wholebatch.lint.engine import UsageError, lint_run, selected_codes
from wholebatch.lint.rules import RULES, Finding

__all__ = ["build_parser", "format_json", "format_rules", "format_text", "main"]


def format_text(
    findings: Sequence[Finding], *, show_fixes: bool = False, files: int = 0, hidden: int = 0
) -> str:
    """One line per finding, then a summary line, as ruff prints them.

    Args:
        findings: what to print, in order.
        show_fixes: add a `  fix: ...` line under each finding.
        files: how many files were checked (for the summary; 0 leaves it out).
        hidden: findings in test files not reported (named in the summary).
    """
    lines: list[str] = []
    for f in findings:
        tier = " (test file)" if f.tier != "code" else ""
        lines.append(f"{f.path}:{f.line}:{f.col}: {f.code} {f.message}{tier}")
        if show_fixes:
            lines.append(f"  fix: {f.fix}")
    plural = "s" if files != 1 else ""
    n = len(findings)
    if n:
        where = f" in {files} file{plural}" if files else ""
        lines.append(f"Found {n} error{'s' if n != 1 else ''}{where}.")
    else:
        lines.append(
            f"All checks passed! ({files} file{plural})" if files else "All checks passed!"
        )
    if hidden:
        lines.append(
            f"({hidden} finding{'s' if hidden != 1 else ''} in test files not shown: --tests "
            "shows them)"
        )
    return "\n".join(lines)


def format_json(findings: Sequence[Finding]) -> str:
    """A JSON list of findings, each with its rule's name and a docs anchor."""
    rows = []
    for f in findings:
        row = asdict(f)
        rule = RULES.get(f.code)
        row["name"] = rule.name if rule else ""
        row["docs"] = f"docs/lint.md#{f.code.lower()}-{rule.name}" if rule else ""
        rows.append(row)
    return json.dumps(rows, indent=2)


def format_rules() -> str:
    """The rule table: code, name, summary."""
    width = max(len(r.name) for r in RULES.values())
    return "\n".join(f"{r.code}  {r.name:<{width}}  {r.summary}" for r in RULES.values())


def _codes(value: str) -> list[str]:
    return [v for v in value.replace(" ", ",").split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    """The `wholebatch lint` argument parser."""
    parser = argparse.ArgumentParser(
        prog="wholebatch lint",
        description="Static checks for the classic gradient mistakes in PyTorch training code "
        "(never imports or runs the code it reads). Rules: docs/lint.md.",
    )
    parser.add_argument("paths", nargs="*", metavar="PATH", help="files and folders to check")
    parser.add_argument(
        "--select",
        type=_codes,
        action="extend",
        metavar="CODES",
        help="comma-separated rule code prefixes to enable, e.g. WB1,WB301 (default: all)",
    )
    parser.add_argument(
        "--ignore",
        type=_codes,
        action="extend",
        metavar="CODES",
        help="comma-separated rule code prefixes to disable",
    )
    parser.add_argument(
        "--format", choices=("text", "json"), default="text", help="output format (default text)"
    )
    parser.add_argument(
        "--show-fixes", action="store_true", help="print the fix under each finding (text)"
    )
    parser.add_argument(
        "--tests",
        action="store_true",
        help="also report findings in test files found in the folders given (tests/, "
        "test_*.py, *_test.py, conftest.py); a test file or folder named on the command "
        "line is always reported",
    )
    parser.add_argument("--exit-zero", action="store_true", help="exit 0 even with findings")
    parser.add_argument("--list-rules", action="store_true", help="print the rule table and exit")
    return parser


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run `wholebatch lint`; returns 0 (clean), 1 (findings) or 2 (usage error).

    Args:
        argv: the arguments after `lint` (default: `sys.argv[2:]`).
        out: where to print (default: stdout); errors go to stderr.
    """
    stream = out if out is not None else sys.stdout
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[2:] if argv is None else argv))
    except SystemExit as exc:  # argparse: usage error (2) or --help (0)
        return exc.code if isinstance(exc.code, int) else 2
    if args.list_rules:
        print(format_rules(), file=stream)
        return 0
    if not args.paths:
        print(f"{parser.prog}: error: give at least one PATH (file or folder)", file=sys.stderr)
        return 2
    try:
        selected_codes(args.select, args.ignore)
        report = lint_run(args.paths, select=args.select, ignore=args.ignore, tests=args.tests)
    except UsageError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    findings = report.findings
    if args.format == "json":
        print(format_json(findings), file=stream)
    else:
        text = format_text(
            findings, show_fixes=args.show_fixes, files=report.files, hidden=report.hidden
        )
        print(text, file=stream)
    return 1 if findings and not args.exit_zero else 0
