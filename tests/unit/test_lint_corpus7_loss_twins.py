"""Bad and good twins of corpus 7's WB301 misses (issue 33; benchmarks/lint_corpus7.toml's
evaluation half, judged at 05417c5, then tuned on), written for these tests: each twin is
a small tree of files linted as a folder; `# expect: WB301` marks the lines a bad twin
must be flagged at, and nothing else may be. 05417c5 misjudges one twin of each kind
(`python -m benchmarks.lint_twins --twins tests.unit.test_lint_corpus7_loss_twins
--baseline 05417c5`).

- `masked-select-loss` (soundstorm's and phenaki's masked-token losses): a PyTorch loss
  with its default mean over the items a boolean mask of the data selects
  (`F.cross_entropy(logits[mask], ids[mask])`) is a mean over as many items as the mask
  keeps, as `losses[mask].mean()` is.
- `record-in-returned-tuple`: a record returned beside the loss (`return total,
  Parts(token_loss, aux_loss)`, a namedtuple or a tuple) is followed field by field, so
  a logged part of it is not read as the loss.
- `log-record-division`: the values of a string-keyed dict handed to a call whose result
  is dropped (`accum_log(logs, {"loss": loss / k})`) are a record for the log.
- `saved-dataset-labels` (minimal-llama's `finetune_peft_acc.py`): a script that loads a
  dataset from disk (`load_from_disk`) reads the labels a script of its folder masked and
  saved (`save_to_disk`); `[-100] * n` writes -100 too.
- `namespace-package-pinned` (InternLM-XComposer's DualFocus): a folder beneath a
  masking script's folder, imported beside it (a package without `__init__.py`), counts
  as the script's own code for the evidence that labels are masked.
- `accepts-loss-kwargs-false` (InternVL's gpt-oss chat model): a model class that sets
  `accepts_loss_kwargs = False` is given no `num_items_in_batch` by the Trainer whatever
  its forward's signature (transformers reads the attribute first); of two sub-projects
  holding a package of one name, an import resolves to the importer's own.
- `imported-subclass-run-model` (InternVL's `internvl_chat_llava`): a Trainer subclass of
  another file of the run, built in a script with a model that gets no item count
  (`from llava.model import *`), is reported at its `class` line.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_corpus7_loss_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests

_MASKED_MODEL = """
import torch
import torch.nn as nn
import torch.nn.functional as F
from collections import namedtuple

Parts = namedtuple("Parts", ["token_loss", "aux_loss"])


class Masker(nn.Module):
    def __init__(self, dim, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)
        self.aux = nn.Linear(dim, 1)

    def forward(self, ids):
        probs = torch.rand(ids.shape[0], 1, device=ids.device)
        mask = torch.rand(ids.shape, device=ids.device) < probs
        h = self.embed(ids)
        logits = self.head(h)
        token_loss = F.cross_entropy({selected})
        aux_loss = F.binary_cross_entropy_with_logits(self.aux(h).squeeze(-1), mask.float())
        return token_loss + aux_loss, Parts(token_loss, aux_loss)
"""

_TRAIN_LOOP = """
from model import Masker


class Trainer:
    def __init__(self, accelerator, loader, optim, grad_accum_every):
        self.model = Masker(64, 100)
        self.accelerator = accelerator
        self.dl_iter = iter(loader)
        self.optim = optim
        self.grad_accum_every = grad_accum_every

    def step(self):
        for _ in range(self.grad_accum_every):
            ids = next(self.dl_iter)
            {unpack} = self.model(ids)
            self.accelerator.backward({backprop} / self.grad_accum_every){mark}
        self.optim.step()
        self.optim.zero_grad()
"""
_MASKED_TRAIN = _TRAIN_LOOP.replace("{unpack}", "loss, parts")
_RECORD_TRAIN = _TRAIN_LOOP.replace("{unpack}", "_, (token_loss, aux_loss)").replace(
    "{backprop}", "{which}"
)

_LOG_TRAIN = """
from model import Masker


def accum_log(logs, new):
    for k, v in new.items():
        logs[k] = logs.get(k, 0.0) + v
    return logs


class Trainer:
    def __init__(self, accelerator, loader, optim, grad_accum_every):
        self.model = Masker(64, 100)
        self.accelerator = accelerator
        self.dl_iter = iter(loader)
        self.optim = optim
        self.grad_accum_every = grad_accum_every

    def step(self):
        logs = {{}}
        ids = next(self.dl_iter)
        loss, _ = self.model(ids)
{backward}
        accum_log(logs, {{"loss": loss / self.grad_accum_every}})
        self.optim.step()
        self.optim.zero_grad()
        return logs
"""

_TOKENIZE = """
import datasets


def main(rows, tok, save_path, max_len=256):
    data = {{"input_ids": [], "labels": []}}
    for row in rows:
        prompt = tok(row["prompt"]).input_ids
        answer = tok(row["answer"]).input_ids
        ids = (prompt + answer)[:max_len]
        labels = {labels}
        data["input_ids"].append(ids + [0] * (max_len - len(ids)))
        data["labels"].append(labels)
    datasets.Dataset.from_dict(data).save_to_disk(save_path)
"""

_DISK_TRAIN = """
import torch
import torch.nn.functional as F
import datasets
import accelerate


def main(args, model, optimizer):
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=args.accum)
    ds = datasets.load_from_disk(args.dataset_path)
    loader = torch.utils.data.DataLoader(ds.with_format("torch"), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            logits = model(batch["input_ids"][:, :-1])
            loss = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1)
            )
            accelerator.backward(loss){mark}
            optimizer.step()
            optimizer.zero_grad()
"""

_NS_CONSTANTS = """
IGNORE_INDEX = -100
"""

_NS_TRAINER = """
from typing import Optional

import torch
from transformers import Trainer


class GroupedTrainer(Trainer):{mark}
    def _get_train_sampler(self) -> Optional[torch.utils.data.Sampler]:
        return torch.utils.data.SequentialSampler(self.train_dataset)
"""

_NS_TRAIN = """
import transformers
from pkg.constants import IGNORE_INDEX
from pkg.train.grouped_trainer import GroupedTrainer


def preprocess(tokenizer, prompt, answer):
    ids = tokenizer(prompt + answer).input_ids
    labels = list(ids)
    n = len(tokenizer(prompt).input_ids)
    labels[:n] = [IGNORE_INDEX] * n
    return dict(input_ids=ids, labels=labels)


def train():
    parser = transformers.HfArgumentParser((transformers.TrainingArguments,))
    (training_args,) = parser.parse_args_into_dataclasses()
    model = transformers.AutoModelForCausalLM.from_pretrained("base")
    trainer = GroupedTrainer(model=model, args=training_args, train_dataset=None)
    trainer.train()
"""

_ATTR_MODEL = """
import torch.nn as nn
from torch.nn import CrossEntropyLoss
from transformers import PreTrainedModel


class ChatModel(PreTrainedModel):
    accepts_loss_kwargs = {flag}

    def __init__(self, config, lm):
        super().__init__(config)
        self.lm = lm

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm(input_ids).logits
        loss = None
        if labels is not None:
            loss_fct = CrossEntropyLoss()
            loss = loss_fct(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return {{"loss": loss, "logits": logits}}
"""

_ATTR_TRAIN = """
import transformers
from transformers import Trainer
from pkg.model.chat import ChatModel


def collate(rows):
    labels = [r["labels"] + [-100] * (64 - len(r["labels"])) for r in rows]
    return {"labels": labels}


def main():
    parser = transformers.HfArgumentParser((transformers.TrainingArguments,))
    (training_args,) = parser.parse_args_into_dataclasses()
    model = ChatModel.from_pretrained("path")
    trainer = Trainer(  # expect: WB301
        model=model,
        args=training_args,
        data_collator=collate,
    )
    trainer.train()
"""

_IMPORTED_TRAINER = """
from transformers import Trainer


class LengthTrainer(Trainer):{mark}
    def log(self, logs, *args, **kwargs):
        super().log(logs, *args, **kwargs)
"""

_RUN_MODEL = """
import torch.nn as nn
from torch.nn import CrossEntropyLoss


class ToyForCausalLM(nn.Module):
    def __init__(self, vocab=100, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels=None{kwargs}):
        logits = self.head(self.embed(input_ids))
        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.view(-1, logits.size(-1)), labels.view(-1))
        return (loss, logits)
"""

_RUN_TRAIN = """
import transformers
from lib.constants import IGNORE_INDEX
from lib.trainer import LengthTrainer
from lib.models import *


def mask_prompt(labels, n):
    labels[:n] = [IGNORE_INDEX] * n
    return labels


def main():
    parser = transformers.HfArgumentParser((transformers.TrainingArguments,))
    (training_args,) = parser.parse_args_into_dataclasses()
    model = ToyForCausalLM()
    trainer = LengthTrainer(model=model, args=training_args)
    trainer.train()
"""

TWINS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    # A, B: a PyTorch loss over the items a random mask selects is a mean over their count
    "masked-select-loss": (
        {
            "model.py": _MASKED_MODEL.format(selected="logits[mask], ids[mask]"),
            "train.py": _MASKED_TRAIN.format(backprop="loss", mark="  # expect: WB301"),
        },
        {
            "model.py": _MASKED_MODEL.format(selected="logits.transpose(1, 2), ids"),
            "train.py": _MASKED_TRAIN.format(backprop="loss", mark=""),
        },
    ),
    # a record (namedtuple) returned inside the tuple: each field followed on its own
    "record-in-returned-tuple": (
        {
            "model.py": _MASKED_MODEL.format(selected="logits[mask], ids[mask]"),
            "train.py": _RECORD_TRAIN.format(which="token_loss", mark="  # expect: WB301"),
        },
        {
            "model.py": _MASKED_MODEL.format(selected="logits[mask], ids[mask]"),
            "train.py": _RECORD_TRAIN.format(which="aux_loss", mark=""),
        },
    ),
    # a dict of log entries handed to a call is no backpropagated division
    "log-record-division": (
        {
            "model.py": _MASKED_MODEL.format(selected="logits[mask], ids[mask]"),
            "train.py": _LOG_TRAIN.format(
                backward="        for _ in range(self.grad_accum_every):\n"
                "            loss, _ = self.model(next(self.dl_iter))\n"
                "            self.accelerator.backward(loss / self.grad_accum_every)"
                "  # expect: WB301"
            ),
        },
        {
            "model.py": _MASKED_MODEL.format(selected="logits[mask], ids[mask]"),
            "train.py": _LOG_TRAIN.format(backward="        self.accelerator.backward(loss)"),
        },
    ),
    # C: labels a script of the folder wrote (`[-100] * n`) and saved, loaded from disk
    "saved-dataset-labels": (
        {
            "scripts/tokenize.py": _TOKENIZE.format(
                labels="([-100] * len(prompt) + answer)[:max_len] + [-100] * (max_len - len(ids))"
            ),
            "scripts/train.py": _DISK_TRAIN.format(mark="  # expect: WB301"),
        },
        {
            "scripts/tokenize.py": _TOKENIZE.format(labels="ids + [0] * (max_len - len(ids))"),
            "scripts/train.py": _DISK_TRAIN.format(mark=""),
        },
    ),
    # D: a namespace package (no __init__.py) pinned below 4.46: the -100 of
    # pkg/constants.py counts for pkg/train/'s Trainer subclass
    "namespace-package-pinned": (
        {
            "proj/pyproject.toml": '[project]\nname = "p"\ndependencies = ["transformers==4.31.0"]\n',
            "proj/pkg/constants.py": _NS_CONSTANTS,
            "proj/pkg/train/grouped_trainer.py": _NS_TRAINER.format(mark="  # expect: WB301"),
            "proj/pkg/train/train.py": _NS_TRAIN,
        },
        {
            "proj/pyproject.toml": '[project]\nname = "p"\ndependencies = ["transformers==4.46.0"]\n',
            "proj/pkg/constants.py": _NS_CONSTANTS,
            "proj/pkg/train/grouped_trainer.py": _NS_TRAINER.format(mark=""),
            "proj/pkg/train/train.py": _NS_TRAIN,
        },
    ),
    # E (gpt-oss): `accepts_loss_kwargs = False` on the model class, **kwargs aside;
    # a second sub-project of the tree has a package of the same name
    "accepts-loss-kwargs-false": (
        {
            "a/requirements.txt": "transformers==4.55.0\n",
            "a/pkg/model/chat/__init__.py": "from .modeling import ChatModel\n",
            "a/pkg/model/chat/modeling.py": _ATTR_MODEL.format(flag="False"),
            "a/pkg/train/finetune.py": _ATTR_TRAIN,
            "b/pkg/model/chat/__init__.py": "from .modeling import ChatModel\n",
            "b/pkg/model/chat/modeling.py": _ATTR_MODEL.format(flag="True"),
        },
        {
            "a/requirements.txt": "transformers==4.55.0\n",
            "a/pkg/model/chat/__init__.py": "from .modeling import ChatModel\n",
            "a/pkg/model/chat/modeling.py": _ATTR_MODEL.format(flag="True"),
            "a/pkg/train/finetune.py": _ATTR_TRAIN.replace("  # expect: WB301", ""),
            "b/pkg/model/chat/__init__.py": "from .modeling import ChatModel\n",
            "b/pkg/model/chat/modeling.py": _ATTR_MODEL.format(flag="False"),
        },
    ),
    # E (llava): a Trainer subclass of another file, built by the script with a model
    # of the run (star-imported) whose forward takes no **kwargs
    "imported-subclass-run-model": (
        {
            "lib/__init__.py": "",
            "lib/constants.py": _NS_CONSTANTS,
            "lib/trainer.py": _IMPORTED_TRAINER.format(mark="  # expect: WB301"),
            "lib/models/__init__.py": "from .toy import ToyForCausalLM\n",
            "lib/models/toy.py": _RUN_MODEL.format(kwargs=""),
            "lib/train/train.py": _RUN_TRAIN,
        },
        {
            "lib/__init__.py": "",
            "lib/constants.py": _NS_CONSTANTS,
            "lib/trainer.py": _IMPORTED_TRAINER.format(mark=""),
            "lib/models/__init__.py": "from .toy import ToyForCausalLM\n",
            "lib/models/toy.py": _RUN_MODEL.format(kwargs=", **kwargs"),
            "lib/train/train.py": _RUN_TRAIN,
        },
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)
