"""`wholebatch lint` on real training code nobody here wrote: the installed open_clip
3.3.0 (`open_clip`, `open_clip_train`), lightly 1.6.0 and sentence-transformers 6.2.0
(`make .venv/.peers`). Their folders are found from the distributions' metadata, never
by importing them (open_clip and lightly cannot be imported here: no torchvision).

open_clip's `loss.py` gathers the other ranks' features with plain
`torch.distributed.all_gather` in `gather_features` and puts the local slice back only
when `not local_loss`; `ClipLoss.get_logits` builds the logits from them and
`ClipLoss.forward` returns the loss: with `local_loss=True, gather_with_grad=False` the
gradient misses every cross-rank term (issue 16); its Horovod branch gathers under
`torch.no_grad()` with the same put-back, the same mistake (issue 33). lightly and sentence-transformers
gather with a gradient (or under `no_grad` on purpose): nothing to report there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_lint import peer_dirs
from wholebatch.lint import lint_paths

DIRS = peer_dirs()


def _need(*packages: str) -> list[Path]:
    missing = [p for p in packages if DIRS.get(p) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (run `make .venv/.peers`)")
    return [d for p in packages if (d := DIRS[p]) is not None]


def _line_of(path: Path, text: str, after: int = 0) -> int:
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and i > after)


def test_open_clip_gather_without_gradient_reaching_clip_loss() -> None:
    folders = _need("open_clip", "open_clip_train")
    findings, files = lint_paths(folders)
    assert files >= 30
    loss_py = folders[0] / "loss.py"
    img_line = _line_of(loss_py, "dist.all_gather(gathered_image_features, image_features)")
    txt_line = _line_of(loss_py, "dist.all_gather(gathered_text_features, text_features)")
    # The Horovod branch holds the same mistake: `hvd.allgather` under torch.no_grad(),
    # the local slice put back only when `not local_loss` (issue 33).
    no_grad = _line_of(loss_py, "with torch.no_grad():")
    hvd_img = _line_of(loss_py, "all_image_features = hvd.allgather(image_features)", no_grad)
    hvd_txt = _line_of(loss_py, "all_text_features = hvd.allgather(text_features)", no_grad)
    # The training script's master leaves `main` on two error paths (an existing log,
    # a failed remote sync) while the other ranks go on to train: WB105, nested in
    # `if is_master(args, ...):` (issue 33, corpus 7).
    main_py = folders[1] / "main.py"
    exists = _line_of(main_py, "return -1", _line_of(main_py, "Experiment already exists"))
    synced = _line_of(main_py, "return -1", _line_of(main_py, "remote sync failed"))
    got = {
        (Path(f.path).relative_to(folders[0].parent).as_posix(), f.line, f.code) for f in findings
    }
    assert got == {
        ("open_clip/loss.py", hvd_img, "WB101"),
        ("open_clip/loss.py", hvd_txt, "WB101"),
        ("open_clip/loss.py", img_line, "WB101"),
        ("open_clip/loss.py", txt_line, "WB101"),
        ("open_clip_train/main.py", exists, "WB105"),
        ("open_clip_train/main.py", synced, "WB105"),
    }
    for f in (f for f in findings if f.code == "WB101"):
        assert [h.function for h in f.trace] == [
            "gather_features",
            "ClipLoss.get_logits",
            "ClipLoss.forward",
            "ClipLoss.forward",
        ]
        assert f.trace[-1].note == "returned as the loss"
        assert "only when `not local_loss`" in f.message
        assert "path: `gather_features` line" in f.message


def test_lightly_and_sentence_transformers_lint_clean_without_crash() -> None:
    folders = _need("lightly", "sentence_transformers")
    findings, files = lint_paths(folders)
    assert files >= 300
    # A crash would raise; an unparseable file would be a WB000 finding.
    assert findings == [], [f"{f.path}:{f.line}: {f.code} {f.message}" for f in findings]
