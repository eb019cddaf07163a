"""Bad and good twins of corpus 2's remaining misses, part 1 (issue 33; the misses of
benchmarks/lint_corpus2.toml's former evaluation half), written for these tests: each
twin is a small tree of files, linted as a folder; a line ending in `# expect: WBnnn`
must be flagged with that code, and nothing else may be. The lint of 7431978 misses the
bad twin of every kind:

- `hf-trainer-flag-off` (WB301): a Hugging Face Trainer subclass turns the Trainer's token
  counting off (`self.model_accepts_loss_kwargs = False`) and returns the Trainer's own
  `compute_loss` (the model's `loss`, a mean over this micro-batch's unmasked labels);
  `Trainer.training_step` then divides it by the accumulation steps
  (`frameworks.FACTS["hf-trainer-compute-loss"]`). The good twin leaves the flag alone:
  the model divides by the step's `num_items_in_batch`.
- `hf-trainer-own-mean` (WB301): `compute_loss` returns its own mean over this
  micro-batch's masked tokens; whatever the flag, the Trainer weighs every micro-batch's
  mean alike. The good twin divides the token sum by `num_items_in_batch`.
- `steps-in-a-name` (WB301): a token mean divided by a name assigned the step count
  (`normalizer = self.current_gradient_accumulation_steps if training else 1.0`) on one
  branch; the good twin's other branch (sequence means) is exact.
- `count-off-zero` (WB301): a token count kept off zero and chosen on one branch
  (`mask.sum().clamp_min(1) if mask is not None else n`) is a count (TRL's
  `_reduce_divergence_loss`; found by 7431978 only through `num_items_in_batch` on
  another branch, read as this micro-batch's count before this round).
- `eval-block-zero` (WB304): `zero_grad` at the end of an evaluation block whose test
  (`global_step % eval_steps == 0`) reads a count that grows only at a step, so it stays
  true for every micro-batch after such a step. The good twin tests it in the step's block.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_hf_trainer_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_COLLATE = """
import torch


def collate(samples, prompt_lengths):
    labels = torch.stack([s["input_ids"] for s in samples])
    for i, n in enumerate(prompt_lengths):
        labels[i, :n] = -100
    return {"input_ids": torch.stack([s["input_ids"] for s in samples]), "labels": labels}
"""

_FLAG = """
from transformers import Trainer


class SftTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        {flag}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
"""

_OWN_MEAN = """
import torch.nn.functional as F
from transformers import Trainer


class TokenTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        mask = labels != -100
        token_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        loss = (token_loss * mask.flatten()).sum() / {count}{mark}
        return loss
"""

_NAMED_STEPS = """
from transformers import Trainer


class PolicyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        per_token_loss = model(**inputs).logits.sum(-1)
        mask = inputs["completion_mask"]
        normalizer = self.current_gradient_accumulation_steps if model.training else 1.0
        if self.loss_type == "sequence":
            loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / normalizer
        else:
            loss = {token}
        return loss
"""
_TOKEN_MEAN = "(per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / normalizer"
_FIXED = "(per_token_loss * mask).sum() / (mask.size(0) * self.max_len) / normalizer"

_EVAL = """
def fit(model, loader, optimizer, evaluate, accum, eval_steps):
    global_step = 0
    micro_steps = 0
    for features, labels in loader:
        loss = model(features, labels)
        loss.backward()
        micro_steps += 1
        if micro_steps % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
            global_step += 1
        if eval_steps > 0 and global_step % eval_steps == 0:
            evaluate(model)
            model.zero_grad(){mark}
            model.train()
"""

_EVAL_AT_STEP = """
def fit(model, loader, optimizer, evaluate, accum, eval_steps):
    global_step = 0
    micro_steps = 0
    for features, labels in loader:
        loss = model(features, labels)
        loss.backward()
        micro_steps += 1
        if micro_steps % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
            global_step += 1
            if eval_steps > 0 and global_step % eval_steps == 0:
                evaluate(model)
                model.zero_grad()
                model.train()
"""

_OFF_ZERO = """
def train(model, loader, optimizer, accum_steps):
    for i, (x, mask) in enumerate(loader):
        per_token = model(x)
        denom = {denom}
        loss = (per_token * mask).sum() / denom
        (loss / accum_steps).backward(){mark}
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

TWINS: dict[str, tuple[Twin, Twin]] = {
    "count-off-zero": (
        {
            "train.py": _OFF_ZERO.format(
                denom="mask.sum().clamp_min(1) if mask is not None else max(x.size(0), 1)",
                mark="  # expect: WB301",
            )
        },
        # The rows of the micro-batch, the same number every time.
        {"train.py": _OFF_ZERO.format(denom="max(x.size(0), 1)", mark="")},
    ),
    "hf-trainer-flag-off": (
        {
            "pkg/__init__.py": "",
            "pkg/collate.py": _COLLATE,
            "pkg/trainer.py": "from pkg.collate import collate\n"
            + _FLAG.format(flag="self.model_accepts_loss_kwargs = False  # expect: WB301"),
        },
        {
            "pkg/__init__.py": "",
            "pkg/collate.py": _COLLATE,
            "pkg/trainer.py": "from pkg.collate import collate\n"
            + _FLAG.format(flag="self.tokens_seen = 0"),
        },
    ),
    "hf-trainer-own-mean": (
        {"trainer.py": _OWN_MEAN.format(count="mask.sum()", mark="  # expect: WB301")},
        {"trainer.py": _OWN_MEAN.format(count="num_items_in_batch", mark="")},
    ),
    "steps-in-a-name": (
        {
            "trainer.py": _NAMED_STEPS.format(token=_TOKEN_MEAN).replace(
                "/ normalizer\n        return", "/ normalizer  # expect: WB301\n        return"
            )
        },
        {"trainer.py": _NAMED_STEPS.format(token=_FIXED)},
    ),
    "eval-block-zero": (
        {"train.py": _EVAL.format(mark="  # expect: WB304")},
        # Tested only where the count grows, inside the step's block: right after a step.
        {"train.py": _EVAL_AT_STEP},
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)
