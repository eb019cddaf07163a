"""Bad and good twins of a framework's division where the code asserts one accumulation
step (issue 33, round 5; found by this round's regression run on the first corpus's
gritlm, whose GradCache loop accumulates by itself and asserts
`self.accelerator.gradient_accumulation_steps == 1`), written for these tests: each twin
is a small tree of files, linted as a folder; a line ending in `# expect: WBnnn` must be
flagged with that code, and nothing else may be. The lint before the change flags the
good twin:

- `asserted-one-step` (WB301): a helper backpropagates the model's token mean (labels
  padded with -100 by the dataset module) through `accelerator.backward`, called inside
  `accelerator.accumulate()`; accelerate divides it by the steps. The good twin's caller
  asserts one accumulation step, so the division is by 1: nothing to report there, in
  the caller or in its helper.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_one_step_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_DATA = """
import torch

IGNORE_INDEX = -100


def collate(rows):
    labels = torch.full((len(rows), 16), IGNORE_INDEX)
    for i, r in enumerate(rows):
        labels[i, : len(r)] = torch.tensor(r)
    return {"input_ids": labels.clamp(min=0), "labels": labels}
"""

_TRAINER = """
from data import collate


class Trainer:
    def step_loss(self, model, batch):
        loss = model(**batch).loss
        self.accelerator.backward(loss){mark}
        return loss.detach()

    def train(self, model, loader):
{check}
        for rows in loader:
            with self.accelerator.accumulate(model):
                self.step_loss(model, collate(rows))
                self.optimizer.step()
                self.optimizer.zero_grad()
"""

TWINS: dict[str, tuple[Twin, Twin]] = {
    "asserted-one-step": (
        {
            "data.py": _DATA,
            "trainer.py": _TRAINER.format(mark="  # expect: WB301", check="        pass"),
        },
        {
            "data.py": _DATA,
            "trainer.py": _TRAINER.format(
                mark="",
                check='        assert self.accelerator.gradient_accumulation_steps == 1, "by hand"',
            ),
        },
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)
