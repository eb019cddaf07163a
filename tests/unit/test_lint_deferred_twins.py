"""Bad and good twins of WB301 evidence that waits for a later caller (issue 33; corpus
3's LLaMA-Adapter and LLaMA2-Accessory `engine_finetune.py`), written for these tests:
each twin is a small tree of files, linted as a folder; a line ending in
`# expect: WBnnn` must be flagged with that code, and nothing else may be. Files are
linted in import order, so the training loop's module, which divides what `model(x, y)`
returns by the steps, is read before the script that builds the model and passes it in;
the loop's summary keeps the division (`facts.Deferred`) and the script's call completes
it. The lint of 46bfca3 misses the bad twin of every kind:

- `engine-and-script` (WB301): `train_one_epoch(model, ...)` in `engine.py` unpacks
  `c_loss, aux = model(tokens, labels)` and divides their sum by `accum_iter`; the
  script builds `DDP(Net(...))`, whose forward returns `CrossEntropyLoss(ignore_index=0)`
  first, with the 0s written into the labels by the dataset module (`labels[i, :n] = 0`).
  The good twin's loss counts every token (no `ignore_index`).
- `undivided-through-a-caller` (WB301, corpus 4's SimCTG trainers): the loop divides
  nothing and steps every `accum_iter`, so the gradient sums the micro-batches' means;
  the model is the script's, as in `engine-and-script`. The good twin's loss counts
  every token.
- `tuple-element` (WB301): the same loop divides only element 1 of the forward's tuple;
  the bad twin's token mean is element 1, the good twin's is element 0 (only logged).
- `class-through-a-cycle` (WB301): a trainer backpropagates `self.model(...)`'s first
  element inside `accelerator.accumulate()` (accelerate divides by the steps), its
  class imported through the package's `__init__` that imports the trainer back, so
  the class's summary comes after the trainer's; the forward returns `err[span_mask]
  .mean()` (a boolean-mask selection: a data-dependent count). The good twin's forward
  averages every element. Completed once every file is read (`deferred.pending_findings`).
- `two-files` (WB301): one engine file and one script holding the model class, linted as
  two files given in either order (`test_two_files_in_either_order`).

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_deferred_twins.py -q
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_ENGINE = """
def train_one_epoch(model, loader, optimizer, accum_iter):
    for step, (tokens, labels) in enumerate(loader):
        c_loss, aux = model(tokens, labels)
        loss = c_loss + 0.1 * aux
        loss /= accum_iter{mark}
        loss.backward()
        if (step + 1) % accum_iter == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

_ELEMENT_ENGINE = """
def train_one_epoch(model, loader, optimizer, accum_iter):
    for step, (tokens, labels) in enumerate(loader):
        first, second = model(tokens, labels)
        print(first.item())
        loss = second / accum_iter{mark}
        loss.backward()
        if (step + 1) % accum_iter == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

_UNDIVIDED_ENGINE = """
def train_one_epoch(model, loader, optimizer, accum_iter):
    for step, (tokens, labels) in enumerate(loader):
        c_loss, aux = model(tokens, labels)
        loss = c_loss + 0.1 * aux
        loss.backward(){mark}
        if (step + 1) % accum_iter == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

_MODEL = """
from torch import nn


class Net(nn.Module):
    def __init__(self, dim, vocab):
        super().__init__()
        self.head = nn.Linear(dim, vocab)
        self.criterion = nn.CrossEntropyLoss({ignore})

    def forward(self, tokens, labels):
        logits = self.head(tokens)
        token_loss = self.criterion(logits.flatten(0, 1), labels.flatten())
        return {returned}
"""

_DATA = """
import torch


def collate(samples, prompt_lens):
    labels = torch.stack(samples)
    for i, n in enumerate(prompt_lens):
        labels[i, :n] = 0  # the prompt's tokens are not predicted
    return labels
"""

_MAIN = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from data import collate
from engine import train_one_epoch
from model import Net


def main(args, loader):
    model = Net(args.dim, args.vocab)
    model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters())
    for epoch in range(args.epochs):
        train_one_epoch(model, loader, optimizer, args.accum_iter)
"""

_MARK = "  # expect: WB301"
_TOKEN_FIRST = "token_loss, logits.pow(2).mean()"
_TOKEN_SECOND = "logits.pow(2).mean(), token_loss"


def _tree(engine: str, ignore: str, returned: str) -> Twin:
    return {
        "engine.py": engine,
        "model.py": _MODEL.format(ignore=ignore, returned=returned),
        "data.py": _DATA,
        "main.py": _MAIN,
    }


TWINS: dict[str, tuple[Twin, Twin]] = {
    "engine-and-script": (
        _tree(_ENGINE.format(mark=_MARK), "ignore_index=0", _TOKEN_FIRST),
        _tree(_ENGINE.format(mark=""), "", _TOKEN_FIRST),
    ),
    "undivided-through-a-caller": (
        _tree(_UNDIVIDED_ENGINE.format(mark=_MARK), "ignore_index=0", _TOKEN_FIRST),
        _tree(_UNDIVIDED_ENGINE.format(mark=""), "", _TOKEN_FIRST),
    ),
    "tuple-element": (
        _tree(_ELEMENT_ENGINE.format(mark=_MARK), "ignore_index=0", _TOKEN_SECOND),
        _tree(_ELEMENT_ENGINE.format(mark=""), "ignore_index=0", _TOKEN_FIRST),
    ),
}
_FLOW = """
import torch.nn.functional as F
from torch import nn


class FlowModel(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def forward(self, mel, frames, span_mask):
        pred = self.backbone(mel, frames)
        err = F.mse_loss(pred, mel, reduction="none")
        {select}
        return err.mean(), pred
"""

_FLOW_TRAINER = """
from accelerate import Accelerator

from pkg import FlowModel


class Trainer:
    def __init__(self, model: FlowModel, optimizer, accumulation):
        self.accelerator = Accelerator(gradient_accumulation_steps=accumulation)
        self.model = model
        self.optimizer = optimizer

    def fit(self, loader):
        for mel, frames, span_mask in loader:
            with self.accelerator.accumulate(self.model):
                loss, _ = self.model(mel, frames, span_mask)
                self.accelerator.backward(loss){mark}
                self.optimizer.step()
                self.optimizer.zero_grad()
"""

# `pkg/__init__.py` re-exports both modules, and the trainer imports the model's class
# through it: the import cycle puts the trainer before the `__init__`.
_INIT = "from pkg.flow import FlowModel\nfrom pkg.trainer import Trainer\n"

TWINS["class-through-a-cycle"] = (
    {
        "pkg/__init__.py": _INIT,
        "pkg/flow.py": _FLOW.format(select="err = err[span_mask]"),
        "pkg/trainer.py": _FLOW_TRAINER.format(mark=_MARK),
    },
    {
        "pkg/__init__.py": _INIT,
        "pkg/flow.py": _FLOW.format(select="err = err * 1.0"),
        "pkg/trainer.py": _FLOW_TRAINER.format(mark=""),
    },
)
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)

# Two files: the loop (named to sort after the script, so only the import order puts it
# first) and a script holding the model class, whose labels it masks with -100 itself.
_SCRIPT = """
import torch
from torch import nn

from zz_engine import train_one_epoch


class Net(nn.Module):
    def __init__(self, dim, vocab):
        super().__init__()
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, labels):
        logits = self.head(tokens)
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), {ignore}
        )
        return loss, logits.pow(2).mean()


def main(args, loader):
    model = Net(args.dim, args.vocab)
    optimizer = torch.optim.AdamW(model.parameters())
    for tokens, labels in loader:
        labels[labels == args.pad] = -100
    train_one_epoch(model, loader, optimizer, args.accum_iter)
"""


def _two_files(root: Path, ignore: str, mark: str) -> list[Path]:
    engine = root / "zz_engine.py"
    script = root / "aa_main.py"
    engine.write_text(textwrap.dedent(_ENGINE.format(mark=mark)).lstrip("\n"))
    script.write_text(textwrap.dedent(_SCRIPT.format(ignore=ignore)).lstrip("\n"))
    return [engine, script]


def test_two_files_in_either_order(tmp_path: Path) -> None:
    from wholebatch.lint import lint_paths

    files = _two_files(tmp_path, "ignore_index=-100", _MARK)
    got = []
    for order in (files, list(reversed(files))):
        found, _ = lint_paths(order)
        got.append(sorted((Path(f.path).name, f.line, f.code, f.message) for f in found))
    assert got[0] == got[1]
    assert [(name, line, code) for name, line, code, _ in got[0]] == [("zz_engine.py", 5, "WB301")]
    assert "`model` is a `Net`" in got[0][0][3] and "aa_main.py:" in got[0][0][3]


def test_two_files_good_twin_in_either_order(tmp_path: Path) -> None:
    from wholebatch.lint import lint_paths

    # a sum over the tokens: PyTorch's default ignore_index=-100 drops the masked labels,
    # but no count divides it, so the micro-batches add up to the whole batch's sum
    files = _two_files(tmp_path, "reduction='sum'", "")
    for order in (files, list(reversed(files))):
        found, _ = lint_paths(order)
        assert [(Path(f.path).name, f.code) for f in found] == []


def test_the_script_alone_reports_nothing_in_the_engine(tmp_path: Path) -> None:
    """The engine read only for its summaries (the script given alone) reports nothing."""
    from wholebatch.lint import lint_paths

    _, script = _two_files(tmp_path, "ignore_index=-100", _MARK)
    found, _ = lint_paths([script])
    assert [f.code for f in found if f.code == "WB301"] == []
