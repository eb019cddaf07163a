"""Bad and good twins of WB301 through DeepSpeed's engine known only across files (issue
33, round 5: corpus 4's evaluation half, tuning data since its judgment), written for
these tests: each twin is a small tree of files, linted as a folder; a line ending in
`# expect: WBnnn` must be flagged with that code, and nothing else may be. The engine's
`backward(loss)` divides the loss by gradient_accumulation_steps
(`frameworks.FACTS["deepspeed-backward"]`), so a per-micro-batch token mean through it is
a mean of micro-batch means. The lint of f46c99f misses the bad twin of every kind:

- `engine-attribute-of-a-base` (align-anything's SFT trainers): the base class, in
  another file, binds `self.model, *_ = deepspeed.initialize(...)`; the subclass's step
  backpropagates `self.model(**batch).loss` through `self.model.backward`, with labels
  padded with -100 by the dataset module. The good twin's loss is the model's summed
  token loss divided by the whole step's token count.
- `engine-from-a-helper` (align-anything's GRPO/PPO trainers): a base method returns the
  engine it built (`engine, *_ = deepspeed.initialize(...); return engine`), the
  subclass binds `self.actor = self._init_engine(...)` and backpropagates a masked token
  mean through it. The good twin sums the tokens and divides by the step's count.
- `labels-masked-beneath-the-script` (BELLE's dschat_train_v1): the engine is the
  script's own, but the -100 labels are written in `utils/data/data_utils.py`, a folder
  beneath the script without `__init__.py` (imported as `utils.data.data_utils`), which
  was evidence only for the pinned Hugging Face Trainer. The good twin's data module
  packs fixed-length blocks whose labels are the inputs (no masking: every micro-batch
  counts the same tokens).

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_deepspeed_engine_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_BASE = """
import deepspeed


class TrainerBase:
    def init_engines(self, model, optimizer, config):
        self.model, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
"""

_DATA = """
import torch

IGNORE_INDEX = -100


def collate(rows, length):
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX)
    for i, (prompt, answer) in enumerate(rows):
        n = len(prompt) + len(answer)
        input_ids[i, :n] = torch.tensor(prompt + answer)
        labels[i, len(prompt) : n] = torch.tensor(answer)
    return {"input_ids": input_ids, "labels": labels}
"""

_SFT = """
import deepspeed

from project.base import TrainerBase
from project.data import collate


class SupervisedTrainer(TrainerBase):
    def train_step(self, batch):
        outputs = self.model(**batch)
{loss}
        self.model.backward(loss){mark}
        self.model.step()
"""

_MEAN = "        loss = outputs.loss"
_SUM = """        logits = outputs.logits[:, :-1]  # (B, T-1, V)
        labels = batch["labels"][:, 1:]  # (B, T-1)
        summed = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum"
        )
        loss = summed / batch["step_tokens"]"""

_RL_BASE = """
import deepspeed


class RLTrainerBase:
    def _init_engine(self, model, config):
        engine, *_ = deepspeed.initialize(model=model, config=config)
        return engine
"""

_GRPO = """
import deepspeed
import torch

from project.rl_base import RLTrainerBase


class GRPOTrainer(RLTrainerBase):
    def init_engines(self, model, config):
        self.actor = self._init_engine(model, config)

    def train_step(self, batch, advantages):
        logits = self.actor(batch["input_ids"]).logits  # (B, T, V)
        logp = torch.log_softmax(logits, -1).gather(-1, batch["targets"][..., None])[..., 0]
        per_token = -advantages[:, None] * logp  # (B, T)
        mask = batch["completion_mask"]  # (B, T), cut at the first EOS
        loss = (per_token * mask).sum() / {count}
        self.actor.backward(loss){mark}
        self.actor.step()
"""

_SCRIPT = """
import deepspeed
from transformers import AutoModelForCausalLM

from utils.data.data_utils import make_loader


def main(args):
    model = AutoModelForCausalLM.from_pretrained(args.model)
    model, optimizer, _, scheduler = deepspeed.initialize(model=model, args=args)
    for batch in make_loader(args):
        outputs = model(**batch, use_cache=False)
        loss = outputs.loss
        model.backward(loss){mark}
        model.step()
"""

_MASKED_DATA = """
import torch

IGNORE_INDEX = -100


def make_loader(args):
    for prompt, answer in args.pairs:
        labels = [IGNORE_INDEX] * len(prompt) + answer
        yield {"input_ids": torch.tensor([prompt + answer]), "labels": torch.tensor([labels])}
"""

_PACKED_DATA = """
import torch


def make_loader(args):
    for start in range(0, len(args.tokens) - args.block, args.block):
        block = torch.tensor([args.tokens[start : start + args.block]])
        yield {"input_ids": block, "labels": block.clone()}
"""

_MARK = "  # expect: WB301"

TWINS: dict[str, tuple[Twin, Twin]] = {
    "engine-attribute-of-a-base": (
        {
            "project/__init__.py": "",
            "project/base.py": _BASE,
            "project/data.py": _DATA,
            "project/sft.py": _SFT.format(loss=_MEAN, mark=_MARK),
        },
        {
            "project/__init__.py": "",
            "project/base.py": _BASE,
            "project/data.py": _DATA,
            "project/sft.py": "import torch\n" + _SFT.format(loss=_SUM, mark=""),
        },
    ),
    "engine-from-a-helper": (
        {
            "project/__init__.py": "",
            "project/rl_base.py": _RL_BASE,
            "project/grpo.py": _GRPO.format(count="mask.sum()", mark=_MARK),
        },
        {
            "project/__init__.py": "",
            "project/rl_base.py": _RL_BASE,
            "project/grpo.py": _GRPO.format(count='batch["step_tokens"]', mark=""),
        },
    ),
    "labels-masked-beneath-the-script": (
        {
            "train/main.py": _SCRIPT.format(mark=_MARK),
            "train/utils/data/data_utils.py": _MASKED_DATA,
        },
        {"train/main.py": _SCRIPT.format(mark=""), "train/utils/data/data_utils.py": _PACKED_DATA},
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)
