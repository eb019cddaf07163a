"""`wholebatch lint` over every `.py` file of the installed torch package (2285 files, all
of them linted in one run, so calls are followed across torch's own modules): no crash,
and exactly the findings whose verdicts docs/lint.md lists (section "Run over the
installed torch package"). A new finding (or a lost one) fails here until its verdict
is written down there. The speed is benchmarks/bench_lint.py's business.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from benchmarks.bench_lint import torch_dir
from wholebatch.lint import lint_paths

DOC = Path(__file__).resolve().parents[1] / "docs" / "lint.md"
# | `torch/x.py:164, 169` | WB201 | verdict |
_ROW = re.compile(r"^\| `(?P<path>torch/[^:`]+):(?P<lines>[\d, ]+)` \| (?P<code>WB\d{3}) \|")


def _documented() -> set[tuple[str, int, str]]:
    text = DOC.read_text()
    section = text.split("## Run over the installed torch package", 1)[1].split("\n## ", 1)[0]
    out: set[tuple[str, int, str]] = set()
    for line in section.splitlines():
        m = _ROW.match(line)
        if m:
            for n in m["lines"].split(","):
                out.add((m["path"], int(n), m["code"]))
    return out


def test_lint_whole_torch_package_matches_the_documented_verdicts(
    record_property: Callable[[str, object], None],
) -> None:
    root = torch_dir()
    t0 = time.perf_counter()
    findings, files = lint_paths([root])
    seconds = time.perf_counter() - t0
    by_code = Counter(f.code for f in findings)
    record_property("files", files)
    record_property("findings", len(findings))
    record_property("seconds", round(seconds, 2))
    print(f"\nlint torch: {files} files, {len(findings)} findings {dict(by_code)}, {seconds:.1f} s")
    got = {(Path(f.path).relative_to(root.parent).as_posix(), f.line, f.code) for f in findings}
    documented = _documented()
    assert files > 2000
    assert len(documented) >= 10  # the table was read
    assert got == documented, (
        f"not in docs/lint.md: {sorted(got - documented)}; "
        f"documented but not found: {sorted(documented - got)}"
    )
    # Generous bound so a loaded CI machine does not fail it; the benchmark tracks speed.
    assert seconds < 180
