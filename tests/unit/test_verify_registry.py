"""verify's causes as a table (issue 20, item 4): one `Cause` per code, each documented, ordered.

Unit tier: no processes. The registry is what `diagnose` runs; these checks keep
it a table a contributor can extend in two files (wholebatch/verify/causes.py and
docs/cli.md); tests/unit/test_layers.py keeps every function under 100 lines.
"""

from __future__ import annotations

from tests.e2e.test_cli import ROOT
from wholebatch.verify.causes import CAUSES, REGISTRY

VERIFY = ROOT / "src" / "wholebatch" / "verify"


def test_one_descriptor_per_code_in_precedence_order() -> None:
    codes = [c.code for c in REGISTRY]
    assert len(codes) == len(set(codes)), codes
    assert [c.precedence for c in REGISTRY] == sorted(c.precedence for c in REGISTRY)
    assert len({c.precedence for c in REGISTRY}) == len(REGISTRY)
    assert set(CAUSES) == set(codes)
    by_code = {c.code: c for c in REGISTRY}
    for cause in REGISTRY:
        assert cause.summary, cause.code
        for other in cause.excluded_by:
            # an exclusion can only name a cause tried earlier in the same stage
            assert other in by_code and by_code[other].precedence < cause.precedence
            assert by_code[other].stage == cause.stage


def test_every_cause_has_a_row_in_the_cli_docs() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    rows = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| `")}
    missing = [c.code for c in REGISTRY if f"`{c.code}`" not in rows]
    assert not missing, f"docs/cli.md's cause table has no row for {missing}"
