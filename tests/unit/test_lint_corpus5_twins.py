"""Bad and good twins of corpus 5's tuning-half false alarms (issue 33; the tuning half of
benchmarks/lint_corpus5.toml), written for these tests: each twin is a small tree of
files, linted as a folder; a line ending in `# expect: WBnnn` must be flagged with that
code, and nothing else may be.

- `trainer-base-only` (WB301, fact `hf-trainer-before-4-46`; axolotl's `SchedulerMixin`,
  RLAIF-V's `ZephyrTrainer`): under a transformers pinned below 4.46, with -100 labels,
  a subclass of the Trainer that the file names only as a base of its other classes (a
  mixin, never built or handed on) is not a trainer the run trains; its subclasses are.
  The good twin's subclasses compute their own loss (one overrides `compute_loss`, one
  puts TRL's `DPOTrainer` before the mixin's `Trainer` in the method order); the lint
  of f42b872 reports the base (a false alarm). The bad twin's subclass inherits the
  Trainer's loss through the base and is reported at its own `class` line; the lint of
  f42b872 reports the base instead.

- `override-calls-model` (WB301, fact `hf-trainer-compute-loss`; corpus 5's evaluation
  half, tuned on after its judgment: ChatGLM-Tuning's `ModifiedTrainer`, orpo's
  `ORPOTrainer`): a `compute_loss` override that calls the model itself with labels a
  collator of the file pads with -100, reading no `num_items_in_batch` and handing on no
  `**kwargs`, returns the model's mean over this micro-batch's labels in any version of
  transformers; the Trainer backpropagates it once per micro-batch (divided by the steps
  or, from 4.46 where the model takes loss kwargs, not even that). The bad twin is
  reported at its return; the lint of 58c23da reports nothing. The good twin hands its
  `**kwargs` (the step's count, from 4.46) on to the model, unpinned.
- `override-kwargs-pinned` (the same fact under a pin below 4.46): there `**kwargs`
  hold no count, so handing them on changes nothing and the bad twin is reported (the
  lint of 58c23da does not); the good twin sums its token losses itself (a sum is
  exact up to one constant).

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_corpus5_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_PIN = "transformers==4.37.2\ntrl==0.8.6\ntorch\n"

_DATA = """
IGNORE_INDEX = -100


def supervised_labels(input_ids, prompt_len):
    labels = input_ids.clone()
    labels[:prompt_len] = IGNORE_INDEX
    return labels
"""

_TRAINERS = """
from transformers import Trainer
from trl import DPOTrainer


class SchedulerMixin(Trainer):
    def create_scheduler(self, num_training_steps, optimizer=None):
        return super().create_scheduler(num_training_steps, optimizer)


class PairTrainer(SchedulerMixin, DPOTrainer):
    pass


{heir}
"""

_OWN_LOSS = """class RankTrainer(SchedulerMixin):
    def compute_loss(self, model, inputs, return_outputs=False):
        scores = model(**inputs).logits
        return -scores.log_softmax(-1)[:, 0].sum()
"""

_INHERITS = """class LoggedTrainer(SchedulerMixin):  # expect: WB301
    def log(self, logs, *args, **kwargs):
        return super().log(logs, *args, **kwargs)
"""

_TRAIN = """
from transformers import TrainingArguments

from app.data import supervised_labels
from app.trainers import {name}


def train(model, dataset):
    args = TrainingArguments(output_dir="out", gradient_accumulation_steps=4)
    {name}(model=model, args=args, train_dataset=dataset).train()
"""


def _tree(heir: str, name: str) -> Twin:
    return {
        "requirements.txt": _PIN,
        "app/__init__.py": "",
        "app/data.py": _DATA,
        "app/trainers.py": _TRAINERS.format(heir=heir),
        "app/train.py": _TRAIN.format(name=name),
    }


_COLLATE = """
import torch
from transformers import Trainer


def collate(rows, pad_id):
    longest = max(len(r["input_ids"]) for r in rows)
    ids, labels = [], []
    for r in rows:
        gap = longest - len(r["input_ids"])
        ids.append(r["input_ids"] + [pad_id] * gap)
        labels.append([-100] * r["prompt_len"] + r["input_ids"][r["prompt_len"] :] + [-100] * gap)
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}


class LossTrainer(Trainer):
{override}
"""

_CALLS_MODEL = """    def compute_loss(self, model, inputs, return_outputs=False):
        return model(  # expect: WB301
            input_ids=inputs["input_ids"],
            labels=inputs["labels"],
        ).loss
"""

_HANDS_ON = """    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = model(**inputs, **kwargs)
        return (out.loss, out) if return_outputs else out.loss
"""

_HANDS_ON_PINNED = _HANDS_ON.replace("out.loss\n", "out.loss  # expect: WB301\n", 1)

_SUMS = """    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        logits = model(input_ids=inputs["input_ids"]).logits[:, :-1]
        labels = inputs["labels"][:, 1:]
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), reduction="sum"
        )
"""


def _override(body: str, pin: str = "") -> Twin:
    files = {"app/__init__.py": "", "app/trainer.py": _COLLATE.replace("{override}", body)}
    return {**files, "requirements.txt": pin} if pin else files


TWINS: dict[str, tuple[Twin, Twin]] = {
    "trainer-base-only": (_tree(_INHERITS, "LoggedTrainer"), _tree(_OWN_LOSS, "RankTrainer")),
    "override-calls-model": (_override(_CALLS_MODEL), _override(_HANDS_ON)),
    "override-kwargs-pinned": (_override(_HANDS_ON_PINNED, _PIN), _override(_SUMS, _PIN)),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)
