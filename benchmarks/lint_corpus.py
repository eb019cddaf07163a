"""Judge `wholebatch lint` on the corpus of benchmarks/lint_corpus.toml (issue 33): lint
each repository as a whole folder, match every finding against the judged ones of the
manifest (repo, file, line, code -> verdict, why), and print precision and recall per
half (tuning, evaluation), per finding and on code the repository reaches.

    .venv/bin/python -m benchmarks.lint_corpus --root /tmp/corpus --half tuning
    .venv/bin/python -m benchmarks.lint_corpus --root /tmp/corpus --half evaluation
    .venv/bin/python -m benchmarks.lint_corpus --root /tmp/corpus --baseline 75b74af
    .venv/bin/python -m benchmarks.lint_corpus --root . --markdown    # docs/lint.md's tables
    .venv/bin/python -m benchmarks.lint_corpus --manifest benchmarks/lint_heldout.toml \
        --root /tmp/heldout                                          # the held-out set
    .venv/bin/python -m benchmarks.lint_corpus --manifest benchmarks/lint_corpus3.toml \
        --root /tmp/c3 --half tuning --record abc1234        # add abc1234 to `found_by`

`--root DIR` holds one folder per repository, `DIR/<owner>+<name>/`, with the files of
its snapshot at the manifest's commit (e.g. `git --git-dir=<mirror> archive <commit> |
tar -x -C DIR/<owner>+<name>`); none of their code is in this repository. `--mirror
DIR` extracts the `.py` files from git mirrors laid out as `DIR/<owner>+<name>/repo`
first. `--baseline REV` lints with this repository's `src/` at revision REV instead
(read from git into a temporary folder), to judge the linter before a change on the
same verdicts. `--manifest PATH` reads another manifest of the same form (the held-out
set of benchmarks/lint_heldout.toml: every repository in the half "heldout", judged once,
never tuned on); its `[revisions]` table names the linters its `found_by` lists.
`--record REV` (REV named in that table) adds REV to the `found_by` of every judged entry
this run reports, in the manifest's text; unjudged findings are printed, never added.

Counts: a finding judged "true" is a true positive, "false" a false positive, one not
in the manifest is "unjudged" (printed, so it gets a verdict before any number is
trusted); a "true" entry of the manifest that is not reported is a false negative.
Precision = TP / (TP + FP), recall = TP / (TP + FN); WB000 ("expected") is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from benchmarks.bench_lint import _export

__all__ = ["REVISIONS", "Tally", "judge", "load", "main", "markdown", "score"]

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "benchmarks" / "lint_corpus.toml"
_Key = tuple[str, str, int, str]  # (repo, file, line, code)

_WORKER = """
import json, sys
from wholebatch.lint import lint_paths
root = sys.argv[1]
findings, n = lint_paths([root])
print(json.dumps({"files": n, "findings": [
    {"file": f.path[len(root) + 1:], "line": f.line, "code": f.code, "message": f.message}
    for f in findings]}))
"""


@dataclass
class Tally:
    """The counts of one half (or one repository)."""

    tp: int = 0
    fp: int = 0
    fn: int = 0
    tp_reached: int = 0
    fp_reached: int = 0
    fn_reached: int = 0
    unjudged: list[tuple[_Key, str]] = field(default_factory=list)
    missed: list[tuple[_Key, str]] = field(default_factory=list)
    wrong: list[tuple[_Key, str]] = field(default_factory=list)
    crashes: int = 0
    files: int = 0
    expected: int = 0

    def add(self, other: Tally) -> None:
        for name in ("tp", "fp", "fn", "tp_reached", "fp_reached", "fn_reached"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.unjudged += other.unjudged
        self.missed += other.missed
        self.wrong += other.wrong
        self.crashes += other.crashes
        self.files += other.files
        self.expected += other.expected


def _ratio(a: int, b: int) -> str:
    return f"{100 * a / b:.0f}%" if b else "n/a"


def load(path: Path = MANIFEST) -> dict[str, Any]:
    """The manifest, as TOML."""
    with path.open("rb") as fh:
        return tomllib.load(fh)


def _lint(folder: Path, src: Path | None) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{ROOT}"
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        return {"files": 0, "findings": [], "crash": proc.stderr.strip().splitlines()[-1:]}
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return row


def judge(repo: str, found: dict[str, Any], manifest: dict[str, Any]) -> Tally:
    """The tally of one repository's lint output against the manifest's verdicts.

    A reported finding judged "true" is a true positive, one judged "false" a false
    positive, one not in the manifest is unjudged; a "true" entry that is not reported
    is a false negative (a miss). Entries in a tier the default does not report
    (`tier = "test"`) count only when reported.
    """
    entries = [f for f in manifest.get("finding", []) if f["repo"] == repo]
    verdicts = {(repo, f["file"], int(f["line"]), f["code"]): f for f in entries}
    t = Tally(files=int(found["files"]), crashes=int(bool(found.get("crash"))))
    got: set[_Key] = set()
    for f in found["findings"]:
        key = (repo, f["file"], int(f["line"]), f["code"])
        got.add(key)
        if f["code"] == "WB001":
            t.crashes += 1
        v = verdicts.get(key)
        if v is None:
            t.unjudged.append((key, f["message"]))
        elif v["verdict"] == "expected":
            t.expected += 1
        elif v["verdict"] == "true":
            t.tp += 1
            t.tp_reached += bool(v.get("reached", True))
        else:
            t.fp += 1
            t.fp_reached += bool(v.get("reached", True))
            t.wrong.append((key, v["why"]))
    for key, v in verdicts.items():
        if v["verdict"] == "true" and key not in got and v.get("tier", "code") == "code":
            t.fn += 1
            t.fn_reached += bool(v.get("reached", True))
            t.missed.append((key, v["why"]))
    return t


# The linters the manifest's `found_by` names, in order, and what each stands for.
REVISIONS = {
    "75b74af": "before issue 33",
    "76c1c51": "judged",
    "ee79e62": "after the judgment",
}


def score(manifest: dict[str, Any], rev: str, half: str) -> dict[str, int]:
    """TP/FP/FN of linter `rev` on one half, from the manifest's `found_by` (a test-file
    finding counts where the linter reports it: 75b74af had no tiers)."""
    halves = {r["repo"]: r["half"] for r in manifest["repo"]}
    out = dict.fromkeys(("tp", "fp", "fn", "tp_r", "fp_r", "fn_r"), 0)
    tiers = rev != "75b74af"
    for f in manifest.get("finding", []):
        if halves.get(f["repo"]) != half or f["verdict"] == "expected":
            continue
        got = rev in f.get("found_by", [])
        reached = bool(f.get("reached", True))
        if got:
            kind = "tp" if f["verdict"] == "true" else "fp"
        elif f["verdict"] == "true" and not (tiers and f.get("tier", "code") == "test"):
            kind = "fn"
        else:
            continue
        out[kind] += 1
        out[kind + "_r"] += reached
    return out


def _halves(manifest: dict[str, Any]) -> list[str]:
    """The manifest's halves, in the order of its repositories."""
    return list(dict.fromkeys(r["half"] for r in manifest["repo"]))


def markdown(manifest: dict[str, Any]) -> str:
    """The tables of docs/lint.md's corpus section: scores per half and linter, then
    every judged entry with its verdict and why."""
    revisions: dict[str, str] = manifest.get("revisions", REVISIONS)
    order = sorted(_halves(manifest), key=lambda h: h != "tuning")
    lines = [
        "| half | linter | TP | FP | FN | precision | recall | on code it reaches: "
        "precision | recall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for half in order:
        for rev, label in revisions.items():
            c = score(manifest, rev, half)
            lines.append(
                f"| {half} | `{rev}` ({label}) | {c['tp']} | {c['fp']} | {c['fn']} | "
                f"{_ratio(c['tp'], c['tp'] + c['fp'])} | {_ratio(c['tp'], c['tp'] + c['fn'])} | "
                f"{_ratio(c['tp_r'], c['tp_r'] + c['fp_r'])} | "
                f"{_ratio(c['tp_r'], c['tp_r'] + c['fn_r'])} |"
            )
    lines += [
        "",
        "| half | repository | file:line | code | found by | verdict | why |",
        "|---|---|---|---|---|---|---|",
    ]
    halves = {r["repo"]: r["half"] for r in manifest["repo"]}
    for f in sorted(
        manifest.get("finding", []),
        key=lambda f: (order.index(halves[f["repo"]]), f["repo"], f["file"], f["line"]),
    ):
        by = ", ".join(f"`{r}`" for r in f.get("found_by", [])) or "(read)"
        verdict = f["verdict"] + ("" if f.get("reached", True) else ", not reached")
        verdict += ", test file" if f.get("tier") == "test" else ""
        why = f["why"].replace("|", "\\|")
        lines.append(
            f"| {halves[f['repo']]} | {f['repo']} | `{f['file']}:{f['line']}` | {f['code']} | "
            f"{by} | {verdict} | {why} |"
        )
    return "\n".join(lines)


def record(path: Path, rev: str, reported: set[_Key]) -> int:
    """Add `rev` to the `found_by` of the manifest's entries whose (repo, file, line,
    code) is in `reported`, editing the text in place; returns how many were added."""
    text = path.read_text()
    if rev not in tomllib.loads(text).get("revisions", {}):
        raise SystemExit(f"--record {rev}: name it in {path}'s [revisions] table first")
    blocks = text.split("\n[[finding]]\n")
    added = 0
    for i, block in enumerate(blocks[1:], 1):
        f = tomllib.loads(block.split("\n\n[[", 1)[0])
        key = (f["repo"], f["file"], int(f["line"]), f["code"])
        if key not in reported or rev in f.get("found_by", []):
            continue
        old = "found_by = " + json.dumps(f.get("found_by", []), separators=(", ", ":"))
        new = "found_by = " + json.dumps([*f.get("found_by", []), rev], separators=(", ", ":"))
        if old not in block:
            raise SystemExit(f"--record: cannot find {old!r} in the entry {key}")
        blocks[i] = block.replace(old, new, 1)
        added += 1
    path.write_text("\n[[finding]]\n".join(blocks))
    return added


# What the linter reads besides the code: pins (requirements, pyproject.toml, setup.py,
# setup.cfg, a README's install line) and YAML configs (Hydra's accumulate_grad_batches).
_READ = (".py", ".txt", ".in", ".toml", ".cfg", ".yaml", ".yml", ".md", ".rst")


def _extract(mirror: Path, root: Path, repos: list[dict[str, Any]]) -> None:
    for r in repos:
        name = r["repo"].replace("/", "+")
        dest = root / name
        if dest.exists() or not r.get("commit"):  # no snapshot: said in the table
            continue
        git = mirror / name / "repo"
        if (git / ".git").is_dir():  # a snapshot that came as a work tree
            git = git / ".git"
        listing = subprocess.run(
            ["git", "--git-dir", str(git), "ls-tree", "-r", "-z", r["commit"]],
            capture_output=True,
            check=True,
        ).stdout.decode()
        for entry in filter(None, listing.split("\0")):
            mode, path = entry.split(" ", 1)[0], entry.split("\t", 1)[1]
            if not path.endswith(_READ):
                continue
            blob = subprocess.run(
                ["git", "--git-dir", str(git), "show", f"{r['commit']}:{path}"],
                capture_output=True,
                check=False,
            )
            if blob.returncode == 0:
                out = dest / path
                out.parent.mkdir(parents=True, exist_ok=True)
                if mode == "120000":  # a symbolic link stays one, as in a checkout
                    out.symlink_to(blob.stdout.decode())
                else:
                    out.write_bytes(blob.stdout)


def main(argv: list[str] | None = None) -> int:
    """Lint the corpus and print the judgment; returns 1 if anything crashed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lint_corpus")
    parser.add_argument("--root", type=Path, required=True, help="one folder per repository")
    parser.add_argument("--mirror", type=Path, help="extract the snapshots from these mirrors")
    parser.add_argument("--manifest", type=Path, default=MANIFEST, help="the judged corpus")
    parser.add_argument(
        "--half",
        choices=("tuning", "evaluation", "heldout", "all"),
        help="default: tuning for lint_corpus.toml, all for another manifest",
    )
    parser.add_argument("--repo", action="append", help="only these repositories")
    parser.add_argument("--baseline", default="", help="lint with src/ at this git revision")
    parser.add_argument("--json", type=Path, help="write every finding here")
    parser.add_argument("--record", default="", help="add this revision to `found_by`")
    parser.add_argument(
        "--markdown", action="store_true", help="print docs/lint.md's tables from the manifest"
    )
    args = parser.parse_args(argv)
    manifest = load(args.manifest)
    half = args.half or ("tuning" if args.manifest == MANIFEST else "all")
    if args.markdown:
        print(markdown(manifest))
        return 0
    repos = [r for r in manifest["repo"] if half in ("all", r["half"])]
    if args.repo:
        repos = [r for r in repos if r["repo"] in args.repo]
    if args.mirror is not None:
        _extract(args.mirror, args.root, repos)
    with tempfile.TemporaryDirectory() as tmp:
        src = _export(args.baseline, Path(tmp)) if args.baseline else None
        halves: dict[str, Tally] = {}
        dump: dict[str, Any] = {}
        t0 = time.perf_counter()
        print(f"{'repository':45} {'files':>5} {'TP':>3} {'FP':>3} {'FN':>3} {'new':>3}  crash")
        for r in repos:
            folder = args.root / r["repo"].replace("/", "+")
            if not folder.is_dir():
                print(f"{r['repo']:45} (no snapshot under {args.root})")
                continue
            found = _lint(folder, src)
            dump[r["repo"]] = found
            t = judge(r["repo"], found, manifest)
            halves.setdefault(r["half"], Tally()).add(t)
            print(
                f"{r['repo']:45} {t.files:5} {t.tp:3} {t.fp:3} {t.fn:3} {len(t.unjudged):3}  "
                f"{t.crashes or ''}"
            )
        dt = time.perf_counter() - t0
    if args.json is not None:
        args.json.write_text(json.dumps(dump, indent=1))
    if args.record:
        reported = {
            (repo, f["file"], int(f["line"]), f["code"])
            for repo, found in dump.items()
            for f in found["findings"]
        }
        print(f"recorded {args.record} on {record(args.manifest, args.record, reported)} entries")
    for half, t in halves.items():
        print(f"\n{half}: {t.files} files, {t.crashes} crashes, {dt:.0f} s")
        print(
            f"  per finding      TP {t.tp}  FP {t.fp}  FN {t.fn}  precision "
            f"{_ratio(t.tp, t.tp + t.fp)}  recall {_ratio(t.tp, t.tp + t.fn)}"
        )
        tp, fp, fn = t.tp_reached, t.fp_reached, t.fn_reached
        print(
            f"  code it reaches  TP {tp}  FP {fp}  FN {fn}  precision "
            f"{_ratio(tp, tp + fp)}  recall {_ratio(tp, tp + fn)}"
        )
        by_code = Counter(k[3] for k, _ in t.unjudged)
        if t.unjudged:
            print(f"  unjudged ({len(t.unjudged)}: {dict(by_code)}):")
            for (repo, file, line, code), msg in t.unjudged:
                print(f"    {repo} {file}:{line} {code} {msg}")
        for label, rows in (("false positives", t.wrong), ("missed", t.missed)):
            if rows:
                print(f"  {label}:")
                for (repo, file, line, code), why in rows:
                    print(f"    {repo} {file}:{line} {code}: {why[:120]}")
    return 1 if any(t.crashes for t in halves.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
