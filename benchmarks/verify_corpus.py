"""Judge `wholebatch verify` on the corpus of tests/support/verify_corpus.py, one half at a time.

    PYTHONPATH=src:. python -m benchmarks.verify_corpus --half tuning
    PYTHONPATH=src:. python -m benchmarks.verify_corpus --half evaluation --truth /tmp/truth.json
    PYTHONPATH=src:. python -m benchmarks.verify_corpus --only attn_f64_global bnpo --tree /tmp/verify-old/src

For every entry of the half: the independent check's measurement
(tests/support/verify_corpus_check.py; cached in `--truth`, it does not depend on
verify), then `wholebatch verify --json` on the entry (one CLI call per mesh and K,
W = 2; `--tree` runs another checkout's verify), then the judgement:

- verdict right: verify passes (or names only `round-off`) exactly when the measured
  step is right (its error within the precision's tolerance, one optimizer step,
  ranks alike, no parameter left without its gradient);
- cause right (a wrong step): one of verify's codes is among the entry's causes, and
  the number the entry names is the one measured: the ratio of the gradient
  (verify's, read from its table) or the micro-batches' common weight (verify's fit).

Prints one markdown table per half (benchmarks/RESULTS.md, "verify round 4").

Legend: W ranks, K micro-batches per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.verify_corpus import CORPUS, TOLERANCE, Entry
from tests.support.verify_corpus_check import Truth, measure

ROOT = Path(__file__).resolve().parents[1]


def truths(entries: list[Entry], cache: Path) -> dict[str, Truth]:
    """Each entry's measurement, from `cache` or measured now (and added to it)."""
    known: dict[str, Any] = json.loads(cache.read_text()) if cache.exists() else {}
    out = {}
    for e in entries:
        if e.name not in known or known[e.name].get("error"):
            t = measure(
                e.target, micro_batches=e.micro_batches, mesh=e.mesh, hypothesis=e.hypothesis
            )
            known[e.name] = dataclasses.asdict(t)
            cache.write_text(json.dumps(known, indent=1))
            print(
                f"measured {e.name}: rel_err {t.rel_err:.2e} ratio {t.ratio:.4g} ({t.seconds:.0f} s)",
                file=sys.stderr,
            )
        out[e.name] = Truth(**known[e.name])
    return out


def run_verify(
    entries: list[Entry], tree: str
) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """verify's report of each entry (grouped by mesh and K into one CLI call each), and each call's seconds."""
    groups: dict[tuple[str, int], list[Entry]] = {}
    for e in entries:
        groups.setdefault((e.mesh, e.micro_batches), []).append(e)
    reports: dict[str, dict[str, Any]] = {}
    seconds: dict[str, float] = {}
    env = {**os.environ, "PYTHONPATH": f"{tree}:{ROOT}", "OMP_NUM_THREADS": "1"}
    for (mesh, k), group in groups.items():
        cmd = [sys.executable, "-m", "wholebatch", "verify", *(e.target for e in group)]
        cmd += ["--nproc", "2", "--micro-batches", str(k), "--json", "--timeout", "300"]
        cmd += ["--mesh", mesh] if mesh else []
        start = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=7200)
        seconds[f"{mesh or 'flat'} K={k}"] = time.monotonic() - start
        try:
            results = json.loads(done.stdout)["results"]
        except (json.JSONDecodeError, KeyError):
            for e in group:
                reports[e.name] = {
                    "error": (done.stderr or done.stdout)[-2000:],
                    "diagnoses": [],
                    "passed": False,
                }
            continue
        for e, r in zip(group, results, strict=True):
            reports[e.name] = r
    return reports, seconds


def measured_right(e: Entry, t: Truth) -> tuple[bool, str]:
    """Whether the independent measurement says the step is right, and the measurement in words."""
    if t.error:
        return False, "check failed: " + t.error.strip().splitlines()[-1]
    parts = [f"err {t.rel_err:.1e}", f"ratio {t.ratio:.4g}"]
    ok = t.rel_err <= TOLERANCE[e.precision]
    if max(t.steps, default=0) > 1:
        parts.append(f"steps {t.steps}")
        ok = False
    if t.rank_spread > TOLERANCE[e.precision]:
        parts.append(f"ranks differ {t.rank_spread:.1e}")
        ok = False
    if t.missing:
        parts.append(f"no gradient: {', '.join(t.missing)}")
        ok = False
    if t.weights:
        spread = (max(t.weights) - min(t.weights)) / max(abs(statistics.mean(t.weights)), 1e-300)
        parts.append(
            f"mb weights {statistics.mean(t.weights):.4g}"
            + (" (all equal)" if spread < 1e-3 else f" (spread {spread:.1e})")
        )
    return ok, "; ".join(parts)


def _verify_ratio(report: dict[str, Any]) -> float | None:
    variants = report.get("variants") or []
    if not variants:
        return None
    ratios = [
        p["ratio"] for p in variants[0]["parameters"] if not p["passed"] and p["ratio"] is not None
    ]
    return statistics.median(ratios) if ratios else None


def judge(e: Entry, t: Truth, report: dict[str, Any]) -> dict[str, Any]:
    right, measured = measured_right(e, t)
    codes = [d["code"] for d in report.get("diagnoses", [])]
    passed = bool(report.get("passed")) or codes == ["round-off"]
    verdict_ok = passed == right
    why: list[str] = []
    if right != e.right:
        why.append(
            f"MEASUREMENT CONTRADICTS THE ENTRY (entry says {'right' if e.right else 'wrong'})"
        )
    cause_ok: bool | None = None
    if not right and not passed:
        cause_ok = any(c in e.causes for c in codes)
        if not cause_ok:
            why.append(f"expected one of {list(e.causes)}")
        if e.factor == "ratio":
            got = _verify_ratio(report)
            if got is None or not math.isclose(got, t.ratio, rel_tol=1e-3):
                cause_ok = False
                why.append(f"verify's ratio {got} vs measured {t.ratio:.4g}")
            else:
                why.append(f"ratio {got:.4g} = measured")
        if e.factor == "weights" and t.weights:
            fit = report.get("fit") or {}
            split = [x for x in fit.get("split_weights") or [] if x is not None]
            want = statistics.mean(t.weights)
            if not split or any(not math.isclose(x, want, rel_tol=1e-3) for x in split):
                cause_ok = False
                why.append(
                    f"verify's weights {[round(x, 4) for x in split]} vs measured {want:.4g} each"
                )
            else:
                why.append(f"every micro-batch weighted {want:.4g} = measured")
        if "no-gradient" in e.causes and t.missing:
            text = " ".join(d["message"] for d in report.get("diagnoses", []))
            if not all(m in text for m in t.missing):
                cause_ok = False
                why.append(f"does not name {t.missing}")
    if report.get("error") and not report.get("variants"):
        why.append("verify error: " + str(report["error"]).strip().splitlines()[0][:160])
    floor = report.get("floor") or {}
    shown = "PASS" if report.get("passed") else "FAIL " + ", ".join(codes)
    if floor:
        variants = report.get("variants") or [{}]
        shown += f" (err {variants[0].get('max_rel_err') or 0:.1e}, rtol {floor.get('rtol'):g})"
    return {
        "name": e.name, "family": e.family, "measured": measured, "right": right, "verify": shown,
        "verdict_ok": verdict_ok, "cause_ok": cause_ok, "why": "; ".join(why),
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| target | family | measured (independent) | verify | verdict | cause | why |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cause = "-" if r["cause_ok"] is None else ("right" if r["cause_ok"] else "**WRONG**")
        verdict = "right" if r["verdict_ok"] else "**WRONG**"
        lines.append(
            f"| {r['name']} | {r['family']} | {'right' if r['right'] else 'wrong'}: {r['measured']} "
            f"| {r['verify']} | {verdict} | {cause} | {r['why']} |"
        )
    n = len(rows)
    fp = sum(1 for r in rows if not r["right"] and not r["verdict_ok"])
    ff = sum(1 for r in rows if r["right"] and not r["verdict_ok"])
    causes = [r for r in rows if r["cause_ok"] is not None]
    lines.append("")
    lines.append(
        f"{n} targets: {sum(r['verdict_ok'] for r in rows)} verdicts right ({fp} false PASS, {ff} false FAIL); "
        f"{sum(bool(r['cause_ok']) for r in causes)} of {len(causes)} FAILs name the measured cause."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--half", choices=("tuning", "evaluation", "both"), default="tuning")
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--truth", default="/tmp/wholebatch-verify-corpus-truth.json")
    parser.add_argument("--tree", default=str(ROOT / "src"), help="the src/ whose verify runs")
    parser.add_argument("--json", default="", help="also write the judged rows here")
    args = parser.parse_args()
    entries = [e for e in CORPUS if args.half == "both" or e.half == args.half]
    if args.only:
        entries = [e for e in CORPUS if e.name in args.only]
    measured = truths(entries, Path(args.truth))
    reports, seconds = run_verify(entries, args.tree)
    rows = [judge(e, measured[e.name], reports[e.name]) for e in entries]
    print(table(rows))
    print(
        "\nverify wall time per CLI call: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "reports": reports}, indent=1))


if __name__ == "__main__":
    main()
