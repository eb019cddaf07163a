"""Lint the bad and good twins of tests/support/lint_twins.py (issue 33) with this tree's
linter and, with `--baseline REV`, with the linter of an earlier revision (its `src/`
read from git into a temporary folder), and print which twin each judges right.

    .venv/bin/python -m benchmarks.lint_twins --baseline 75b74af
    .venv/bin/python -m benchmarks.lint_twins --twins tests.unit.test_lint_corpus7_twins \
        --baseline 05417c5                       # another file's TWINS

A twin is judged right when the findings are exactly its `# expect:` lines. The test
tier (tests/unit/test_lint_twins.py) requires every twin right on this tree; this
command shows that the linter before the change misjudged at least one twin of each kind.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from benchmarks.bench_lint import _export
from tests.support.lint_twins import TWINS, Twin

__all__ = ["check_twin", "expected", "judge_tree", "main", "write"]

ROOT = Path(__file__).resolve().parents[1]
_EXPECT = re.compile(r"#\s*expect:\s*(WB\d{3})")
_WORKER = """
import json, sys
from pathlib import Path
from wholebatch.lint import lint_paths
root = Path(sys.argv[1])
out = {}
for case in sorted(p for p in root.iterdir() if p.is_dir()):
    found, _ = lint_paths([case])
    out[case.name] = sorted(
        [Path(f.path).relative_to(case).as_posix(), f.line, f.code] for f in found
    )
print(json.dumps(out))
"""


def write(root: Path, files: Twin) -> None:
    """Write one twin's files under `root`."""
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip("\n"))


def expected(root: Path) -> list[list[object]]:
    """The (file, line, code) marked `# expect:` in the files under `root`, sorted."""
    out: list[list[object]] = []
    for p in sorted(root.rglob("*.py")):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            out += [[p.relative_to(root).as_posix(), i, m.group(1)] for m in _EXPECT.finditer(line)]
    return sorted(out, key=str)


def check_twin(root: Path, files: Twin, bad: bool) -> None:
    """Lint one twin written under `root` (this process's lint) and assert it is judged as
    its `# expect:` marks say; a bad twin must be flagged somewhere."""
    from wholebatch.lint import lint_paths

    write(root, files)
    findings, _ = lint_paths([root])
    got = sorted(
        ([Path(f.path).relative_to(root).as_posix(), f.line, f.code] for f in findings), key=str
    )
    assert got == expected(root), [f.message for f in findings]
    assert got or not bad, "a bad twin must be flagged somewhere"


def twin_tests(twins: dict[str, tuple[Twin, Twin]]) -> tuple[Any, Any]:
    """The two tests a file of twins runs: each twin judged as its marks say, and each
    kind with a marked bad twin and an unmarked good one. Assign them to `test_*` names:
    `test_twin_is_judged_as_marked, test_each_kind_has_both = twin_tests(TWINS)`."""
    import pytest

    cases = [(kind, side) for kind in twins for side in ("bad", "good")]

    @pytest.mark.parametrize(("kind", "side"), cases, ids=[f"{k}-{s}" for k, s in cases])
    def judged_as_marked(tmp_path: Path, kind: str, side: str) -> None:
        bad, good = twins[kind]
        check_twin(tmp_path, bad if side == "bad" else good, bad=side == "bad")

    def both_sides() -> None:
        for kind, (bad, good) in twins.items():
            assert sum(t.count("# expect:") for t in bad.values()), kind
            assert not sum(t.count("# expect:") for t in good.values()), kind

    return judged_as_marked, both_sides


def judge_tree(root: Path, src: Path | None) -> dict[str, list[list[object]]]:
    """Lint every case folder under `root` in one process, with `src` on the path."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{ROOT}"
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, str(root)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    got: dict[str, list[list[object]]] = json.loads(proc.stdout)
    return {k: sorted(v, key=str) for k, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    """Print each twin's verdict now (and at `--baseline`); returns 1 if one is wrong now."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lint_twins")
    parser.add_argument("--baseline", default="", help="also lint with src/ at this revision")
    parser.add_argument("--twins", default="", help="the module whose TWINS to lint")
    args = parser.parse_args(argv)
    twins = importlib.import_module(args.twins).TWINS if args.twins else TWINS
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp, "cases")
        for kind, (bad, good) in twins.items():
            write(root / f"{kind}.bad", bad)
            write(root / f"{kind}.good", good)
        want = {case.name: expected(case) for case in root.iterdir()}
        now = judge_tree(root, None)
        then = judge_tree(root, _export(args.baseline, Path(tmp))) if args.baseline else {}
    wrong_now = 0
    header = f"{'twin':38} {'now':6} {args.baseline or ''}"
    print(header)
    for kind in twins:
        row = []
        for side in ("bad", "good"):
            case = f"{kind}.{side}"
            ok_now = now[case] == want[case]
            wrong_now += not ok_now
            cell = f"{case:38} {'right' if ok_now else 'WRONG':6}"
            if then:
                ok_then = then[case] == want[case]
                cell += f" {'right' if ok_then else 'wrong'}"
                if not ok_then:
                    cell += f" (found {then[case] or 'nothing'})"
            row.append(cell)
        print("\n".join(row))
    if then:
        misjudged = sum(
            any(then[f"{k}.{s}"] != want[f"{k}.{s}"] for s in ("bad", "good")) for k in twins
        )
        print(f"kinds with a twin misjudged at {args.baseline}: {misjudged} of {len(twins)}")
    return 1 if wrong_now else 0


if __name__ == "__main__":
    raise SystemExit(main())
