"""A lint run as a whole (issue 33): the same findings and messages whatever the hash
seed and the order the files are given in, and test files reported with their tier,
off by default where they sit in a folder of training code.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from wholebatch.lint import lint_paths, lint_run, main

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "support" / "lint_cases"

# One plain gather reached through two call sites of one loss: two findings at one place
# (the gather) with different paths. Before issue 33 the one kept followed the hash
# order of the dataflow's tags: seeds 1 and 2 printed different paths.
_TWO_PATHS = """
import torch
import torch.distributed as dist
import torch.nn.functional as F


def gather(x):
    parts = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def clip_loss(img, txt, labels):
    first = gather(txt)
    second = gather(txt)
    return F.cross_entropy(img @ (first + second).T, labels)
"""


def _json(files: list[str], seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    cmd = [sys.executable, "-m", "wholebatch", "lint", "--format", "json", "--exit-zero", *files]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout


def test_output_is_the_same_whatever_the_hash_seed_and_file_order(tmp_path: Path) -> None:
    (tmp_path / "paths.py").write_text(textwrap.dedent(_TWO_PATHS))
    files = [str(p) for p in sorted(CASES.rglob("*.py"))] + [str(tmp_path / "paths.py")]
    first = _json(files, "1")
    second = _json(list(reversed(files)), "2")
    assert first == second
    found = json.loads(first)
    assert len(found) > 20  # the cases really were linted
    assert {f["path"] for f in found} >= {str(tmp_path / "paths.py")}


def _tree(root: Path) -> None:
    bad = "def train(model, loader, opt):\n    for x in loader:\n"
    bad += "        model(x).sum().backward()\n        opt.step()\n"
    for rel in ("src/train.py", "tests/test_train.py", "conftest.py", "pkg/train_test.py"):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(bad)


def test_test_files_are_off_by_default_and_counted(tmp_path: Path) -> None:
    _tree(tmp_path)
    report = lint_run([tmp_path])
    assert [Path(f.path).relative_to(tmp_path).as_posix() for f in report.findings] == [
        "src/train.py"
    ]
    assert report.files == 4 and report.hidden == 3
    assert all(f.tier == "code" for f in report.findings)


def test_test_files_with_their_tier_when_asked(tmp_path: Path) -> None:
    _tree(tmp_path)
    findings, _ = lint_paths([tmp_path], tests=True)
    tiers = {Path(f.path).relative_to(tmp_path).as_posix(): f.tier for f in findings}
    assert tiers == {
        "conftest.py": "test",
        "pkg/train_test.py": "test",
        "src/train.py": "code",
        "tests/test_train.py": "test",
    }


def test_a_test_file_or_folder_named_explicitly_is_reported(tmp_path: Path) -> None:
    _tree(tmp_path)
    findings, _ = lint_paths([tmp_path / "tests" / "test_train.py"])
    assert [f.tier for f in findings] == ["test"]
    findings, _ = lint_paths([tmp_path / "tests"])
    assert [f.tier for f in findings] == ["test"]


def test_the_command_line_names_the_hidden_and_the_tier(tmp_path: Path) -> None:
    _tree(tmp_path)
    out = io.StringIO()
    assert main([str(tmp_path)], out=out) == 1
    text = out.getvalue()
    assert "(3 findings in test files not shown: --tests shows them)" in text
    out = io.StringIO()
    main(["--tests", str(tmp_path)], out=out)
    assert text.count("(test file)") == 0 and out.getvalue().count("(test file)") == 3
    out = io.StringIO()
    main(["--tests", "--format", "json", str(tmp_path)], out=out)
    assert sorted(f["tier"] for f in json.loads(out.getvalue())) == ["code"] + ["test"] * 3


def test_the_corpus_manifest_and_its_tables_in_the_docs() -> None:
    # benchmarks/lint_corpus.toml: the split is the rule written in it, every entry has
    # a verdict and a why, and docs/lint.md shows the tables made from it, as they are.
    import hashlib

    from benchmarks.lint_corpus import load, markdown

    manifest = load()
    repos = manifest["repo"]
    assert len(repos) >= 40
    for r in repos:
        parity = hashlib.sha256(r["repo"].encode()).digest()[-1] & 1
        assert r["half"] == ("tuning" if parity == 0 else "evaluation"), r["repo"]
        assert len(r["commit"]) == 40
    names = {r["repo"] for r in repos}
    assert not names & _KEPT_ASIDE, "issue 26's corpus and issue 33's held-out repositories"
    for f in manifest["finding"]:
        assert f["repo"] in names and f["verdict"] in ("true", "false", "expected") and f["why"]
    doc = (ROOT / "docs" / "lint.md").read_text()
    assert markdown(manifest) in doc, "run `python -m benchmarks.lint_corpus --root . --markdown`"


def test_the_held_out_manifest_and_its_judgment_in_the_docs() -> None:
    # benchmarks/lint_heldout.toml: disjoint from the corpus and from every set kept
    # aside, every entry judged with a why, and docs/lint.md shows each verdict and the
    # score computed from the manifest (it was judged once, at ab6ca31).
    from benchmarks.lint_corpus import MANIFEST, load, score

    manifest = load(ROOT / "benchmarks" / "lint_heldout.toml")
    repos = manifest["repo"]
    assert len(repos) >= 20 and all(len(r["commit"]) == 40 for r in repos)
    names = {r["repo"] for r in repos}
    assert not names & _KEPT_ASIDE and not names & {r["repo"] for r in load(MANIFEST)["repo"]}
    assert {r["half"] for r in repos} == {"heldout"} and list(manifest["revisions"]) == ["ab6ca31"]
    doc = (ROOT / "docs" / "lint.md").read_text()
    section = doc[doc.index("## A held-out judgment") : doc.index("## Never aborts")]
    for f in manifest["finding"]:
        assert f["repo"] in names and f["verdict"] in ("true", "false", "expected") and f["why"]
        if f["code"] != "WB000":
            assert f"`{f['file']}:{f['line']}` | {f['code']} |" in section, f
    c = score(manifest, "ab6ca31", "heldout")
    assert f"| {c['tp']} | {c['fp']} | {c['fn']} |" in section


@pytest.mark.parametrize(
    "name",
    [
        "lint_corpus2.toml",
        "lint_corpus3.toml",
        "lint_corpus4.toml",
        "lint_corpus5.toml",
        "lint_corpus6.toml",
        "lint_corpus7.toml",
    ],
)
def test_the_later_corpora_split_by_their_rule_and_judged_in_the_docs(name: str) -> None:
    # The second and third corpora: disjoint from every earlier set, split by the rule
    # written in them, every entry judged with a why, and docs/lint.md's section shows
    # its tables as `--markdown` prints them.
    import hashlib

    from benchmarks.lint_corpus import MANIFEST, load, markdown

    manifest = load(ROOT / "benchmarks" / name)
    repos = manifest["repo"]
    assert len(repos) >= 40 and manifest["split"]["rule"].startswith("last byte of sha256")
    earlier = {
        "lint_corpus.toml",
        "lint_heldout.toml",
        "lint_corpus2.toml",
        "lint_corpus3.toml",
        "lint_corpus4.toml",
        "lint_corpus5.toml",
        "lint_corpus6.toml",
        "lint_corpus7.toml",
    }
    others = set().union(
        *({r["repo"] for r in load(ROOT / "benchmarks" / e)["repo"]} for e in earlier - {name})
    )
    names = {r["repo"] for r in repos}
    assert not names & _KEPT_ASIDE and not names & others and MANIFEST.name in earlier
    for r in repos:
        parity = hashlib.sha256(r["repo"].encode()).digest()[-1] & 1
        assert r["half"] == ("tuning" if parity == 0 else "evaluation"), r["repo"]
        assert len(r["commit"]) == 40 or r.get("fetched") is False, r["repo"]
    revisions = set(manifest["revisions"])
    for f in manifest["finding"]:
        assert f["repo"] in names and f["verdict"] in ("true", "false", "expected") and f["why"]
        assert set(f["found_by"]) <= revisions, f
    doc = (ROOT / "docs" / "lint.md").read_text()
    command = f"python -m benchmarks.lint_corpus --manifest benchmarks/{name} --root . --markdown"
    assert markdown(manifest) in doc, f"run `{command}`"


def test_record_adds_the_revision_to_what_a_run_reported(tmp_path: Path) -> None:
    from benchmarks.lint_corpus import record

    entry = 'repo = "a/b"\nfile = "t.py"\nline = {}\ncode = "WB301"\nverdict = "true"\n'
    text = '[revisions]\nr1 = "x"\nr2 = "y"\n\n[[repo]]\nrepo = "a/b"\n'
    text += f'\n[[finding]]\n{entry.format(3)}found_by = ["r1"]\nwhy = "w"\n'
    text += f'\n[[finding]]\n{entry.format(9)}found_by = []\nwhy = "w"\n'
    path = tmp_path / "m.toml"
    path.write_text(text)
    assert record(path, "r2", {("a/b", "t.py", 3, "WB301"), ("a/b", "t.py", 5, "WB301")}) == 1
    assert [f["found_by"] for f in tomllib.loads(path.read_text())["finding"]] == [["r1", "r2"], []]
    assert record(path, "r2", {("a/b", "t.py", 3, "WB301")}) == 0
    with pytest.raises(SystemExit, match="revisions"):
        record(path, "r3", set())


# Issue 26's 17 repositories (tuned on) and issue 33's 18 (kept for an independent judgment).
_KEPT_ASIDE = frozenset(
    [
        "facebookresearch/moco",
        "facebookresearch/moco-v3",
        "facebookresearch/SLIP",
        "facebookresearch/swav",
        "facebookresearch/barlowtwins",
        "facebookresearch/contriever",
        "sthalles/SimCLR",
        "Spijkervet/SimCLR",
        "mlfoundations/open_clip",
        "lightly-ai/lightly",
        "salesforce/ALBEF",
        "salesforce/BLIP",
        "salesforce/LAVIS",
        "princeton-nlp/SimCSE",
        "texttron/tevatron",
        "luyug/GradCache",
        "KevinMusgrave/pytorch-metric-learning",
        "facebookresearch/dino",
        "facebookresearch/vicreg",
        "facebookresearch/simsiam",
        "facebookresearch/mae",
        "karpathy/nanoGPT",
        "facebookresearch/DPR",
        "stanford-futuredata/ColBERT",
        "OFA-Sys/Chinese-CLIP",
        "baaivision/EVA",
        "facebookresearch/MetaCLIP",
        "LAION-AI/CLAP",
        "lucidrains/x-clip",
        "UCSC-VLAA/CLIPA",
        "vturrisi/solo-learn",
        "Lightning-AI/litgpt",
        "allenai/open-instruct",
        "OpenRLHF/OpenRLHF",
        "openai/improved-diffusion",
    ]
)


def test_a_file_that_cannot_be_read_is_a_wb000(tmp_path: Path) -> None:
    (tmp_path / "latin.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8, no coding line
    findings, files = lint_paths([tmp_path])
    assert files == 1
    assert [(f.code, f.message.split(":")[0]) for f in findings] == [("WB000", "cannot read")]


def test_extract_skips_a_repository_with_no_snapshot_and_keeps_the_pins(tmp_path: Path) -> None:
    # `--mirror`: an entry with no commit (`fetched = false`) is skipped, not a git error
    # that ends the run; the files the linter reads beside the code (pins, configs) come
    # out with the code.
    import subprocess

    from benchmarks.lint_corpus import _extract

    work = tmp_path / "mirror" / "a+b" / "repo"
    work.mkdir(parents=True)
    (work / "train.py").write_text("x = 1\n")
    (work / "requirements.txt").write_text("transformers==4.30.2\n")
    (work / "logo.png").write_bytes(b"\x89PNG")
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    commit = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    repos = [{"repo": "c/d", "commit": "", "fetched": False}, {"repo": "a/b", "commit": commit}]
    _extract(tmp_path / "mirror", tmp_path / "root", repos)
    got = sorted(p.name for p in (tmp_path / "root" / "a+b").iterdir())
    assert got == ["requirements.txt", "train.py"] and not (tmp_path / "root" / "c+d").exists()
