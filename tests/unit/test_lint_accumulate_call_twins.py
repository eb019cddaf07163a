"""Bad and good twins of corpus 3's accelerate misses (issue 33; the tuning half of
benchmarks/lint_corpus3.toml), written for these tests: each twin is a small tree of
files, linted as a folder; a line ending in `# expect: WBnnn` must be flagged with that
code, and nothing else may be. `accelerator.backward` inside `accelerator.accumulate()`
divides the loss by gradient_accumulation_steps (`frameworks.FACTS["accelerate-backward"]`),
so a mean over a varying count of this micro-batch's items becomes a mean of means. The
lint of fbad846 misses the bad twin of every kind:

- `accumulate-in-caller` (WB301): the backward runs in a helper (`run`, nested in the
  training function) that a caller calls inside `with accelerator.accumulate(model):`;
  the helper's loss is `(loss * mask).sum() / mask.sum()`. The good twin's helper takes
  a mean over every element (the same count in every micro-batch).
- `forward-tuple` (WB301): the model's `forward`, in another file, returns a tuple whose
  first item is `loss[mask].mean()` (a boolean-mask selection: a data-dependent count);
  the trainer unpacks it (`loss, cond, pred = self.model(...)`, `self.model` an
  attribute set from a parameter annotated with the model's class) and backpropagates
  it inside `accumulate`. The good twin's forward returns `loss.mean()` of every element.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_accumulate_call_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_IN_CALLER = """
import torch.nn.functional as F
from accelerate import Accelerator


def main(model, optimizer, loader, args):
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def run(x, target, mask):
        pred = model(x)
        loss = F.mse_loss(pred, target, reduction="none").reshape(x.shape[0], -1)
        loss = {mean}
        accelerator.backward(loss){mark}
        optimizer.step()
        optimizer.zero_grad()

    for x, target, mask in loader:
        with accelerator.accumulate(model):
            run(x, target, mask.reshape(x.shape[0], -1).float())
"""

_CFM = """
import torch.nn.functional as F
from torch import nn


class CFM(nn.Module):
    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, mel, lens, span_mask):
        pred = self.transformer(mel, lens)
        loss = F.mse_loss(pred, mel, reduction="none")
        {select}
        return loss.mean(), mel, pred
"""

_TRAINER = """
from accelerate import Accelerator

from pkg.cfm import CFM


class Trainer:
    def __init__(self, model: CFM, optimizer, grad_accumulation_steps):
        self.accelerator = Accelerator(gradient_accumulation_steps=grad_accumulation_steps)
        self.model = model
        self.optimizer = optimizer

    def train(self, loader):
        for batch in loader:
            with self.accelerator.accumulate(self.model):
                loss, cond, pred = self.model(batch["mel"], batch["lens"], batch["mask"])
                self.accelerator.backward(loss){mark}
                self.optimizer.step()
                self.optimizer.zero_grad()
"""

_MARK = "  # expect: WB301"

TWINS: dict[str, tuple[Twin, Twin]] = {
    "accumulate-in-caller": (
        {"train.py": _IN_CALLER.format(mean="(loss * mask).sum() / mask.sum()", mark=_MARK)},
        {"train.py": _IN_CALLER.format(mean="loss.mean()", mark="")},
    ),
    "forward-tuple": (
        {
            "pkg/__init__.py": "",
            "pkg/cfm.py": _CFM.format(select="loss = loss[span_mask]"),
            "pkg/trainer.py": _TRAINER.format(mark=_MARK),
        },
        {
            "pkg/__init__.py": "",
            "pkg/cfm.py": _CFM.format(select="loss = loss * 1.0"),
            "pkg/trainer.py": _TRAINER.format(mark=""),
        },
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)
