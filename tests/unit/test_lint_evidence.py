"""WB301's evidence across calls (issue 33, the held-out judgment's misses): a
per-micro-batch mean whose evidence lies in another function or file than the division
by the step count. Each kind has a bad twin (reported where `# expect: WB301` marks it)
and a good twin that differs from it in the one thing that matters (clean).

The kinds: a loss taken by index (`model(..., labels=y)[0]`); a mean passed by argument
to a callee that divides it; dynamic dispatch (`self.get_metrics()` in a base-class loop,
the mean in a subclass's override); a model called through a parameter or a DDP wrapper,
whose forward is a class of the run; label masking in a dataset module imported
alongside the loop; Lightning's accumulation set through a dict of arguments; a mean
built in another module and returned in a tuple (followed element by element); a
forward returning its loss in a tuple, given labels under another name.

The trees are written to a temporary folder and linted as a folder; nothing is run.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.unit.test_lint_real import _check

_Tree = dict[str, str]


def _mark(bad: bool) -> str:
    return "  # expect: WB301" if bad else ""


# -- 1. a loss taken by index -----------------------------------------------------------

_BY_INDEX = """
def train(model, loader, optimizer, args, pad_id):
    for step, (ids, mask) in enumerate(loader):
        labels = ids.clone()
        labels[labels == pad_id] = -100
        out = model(input_ids=ids, attention_mask=mask, {call})
        loss = out[0]
        (loss / args.gradient_accumulation_steps).backward(){mark}
        if (step + 1) % args.gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_a_loss_taken_by_index_is_a_models_loss_field(tmp_path: Path, bad: bool) -> None:
    # Bad: a model given labels returns its loss first (`out[0]`, as `.loss`): a mean
    # over the tokens left after the -100 masking, divided by the steps. Good: the same
    # model given the global token count (`num_items_in_batch=`), which it divides by.
    # Today's lint misses the bad twin (only `.loss` / `["loss"]` counted).
    call = "labels=labels" if bad else "labels=labels, num_items_in_batch=args.tokens"
    messages = _check(tmp_path, {"train.py": _BY_INDEX.format(call=call, mark=_mark(bad))})
    assert not bad or "exact only if every micro-batch has the same item count" in messages[0]


def test_an_element_other_than_the_first_is_not_the_loss(tmp_path: Path) -> None:
    # `out[1]` of a model given labels is its logits: a loss built from it with a sum
    # reduction, divided by the steps, is a uniform scale (not reported).
    text = _BY_INDEX.format(call="labels=labels", mark="").replace(
        "loss = out[0]", "loss = out[1].float().pow(2).sum()"
    )
    _check(tmp_path, {"train.py": text})


# -- 2. a mean passed by argument ---------------------------------------------------------

_BY_ARGUMENT = """
import torch.nn as nn


class Student:
    def __init__(self, model, optimizer, accumulation_steps):
        self.model = model
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.n_iter = 0
        self.lm_loss_fct = nn.CrossEntropyLoss({criterion})

    def step(self, input_ids, lm_labels):
        logits = self.model(input_ids=input_ids)
        loss = self.lm_loss_fct(logits.view(-1, logits.size(-1)), lm_labels.view(-1))
        self.optimize(loss)

    def optimize(self, loss):
        loss = loss / self.accumulation_steps{mark}
        loss.backward()
        self.n_iter += 1
        if self.n_iter % self.accumulation_steps == 0:
            self.optimizer.step()
            self.optimizer.zero_grad()
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_a_mean_built_in_the_caller_and_divided_in_the_callee(tmp_path: Path, bad: bool) -> None:
    # Bad: `step` takes a token mean (a criterion built with ignore_index in __init__) and
    # passes it to `optimize`, which divides by the steps. Good: the criterion sums
    # (reduction="sum"): a uniform scale. Today's lint misses the bad twin (the evidence
    # travels by argument, and the criterion is an attribute built in another method).
    criterion = "ignore_index=-100" if bad else 'ignore_index=-100, reduction="sum"'
    messages = _check(
        tmp_path, {"distill.py": _BY_ARGUMENT.format(criterion=criterion, mark=_mark(bad))}
    )
    assert not bad or "passed in at line" in messages[0]


# -- 3. dynamic dispatch -------------------------------------------------------------------

_DISPATCH = """
class BaseTrainer:
    def __init__(self, policy, optimizer, accumulation_steps):
        self.policy = policy
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps

    def get_batch_metrics(self, batch):
        raise NotImplementedError

    def train(self, batches):
        self.optimizer.zero_grad()
        for batch in batches:
            loss, metrics = self.get_batch_metrics(batch)
            loss = loss / self.accumulation_steps{mark}
            loss.backward()
        self.optimizer.step()


class SFTTrainer(BaseTrainer):
    def get_batch_metrics(self, batch):
        logps = self.policy(batch["input_ids"]).log_softmax(-1)
        token_mask = batch["mask"]
        {sft}
        return loss, {{"loss": loss.detach()}}


class PreferenceTrainer(BaseTrainer):
    def get_batch_metrics(self, batch):
        losses = -self.policy(batch["chosen"]).logsigmoid()
        return losses.mean(), {{}}
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_a_base_class_loop_runs_the_overrides_of_its_subclasses(tmp_path: Path, bad: bool) -> None:
    # Bad: the base loop divides `self.get_batch_metrics()`'s loss by the steps; SFT's
    # override returns a mean over this micro-batch's tokens (`/ token_mask.sum()`).
    # Good: SFT's override returns a mean over sequences (per-row token means, then
    # `.mean()`), like the preference one: every micro-batch has as many sequences.
    # Today's lint misses the bad twin (the call resolves to the base's `raise`).
    sft = (
        "loss = -(logps * token_mask).sum() / token_mask.sum()"
        if bad
        else "loss = (-(logps * token_mask).sum(-1) / token_mask.sum(-1)).mean()"
    )
    _check(tmp_path, {"trainers.py": _DISPATCH.format(sft=sft, mark=_mark(bad))})


# -- 4. the model called through a parameter, or a DDP wrapper -----------------------------

_MODEL = """
import torch.nn as nn
import torch.nn.functional as F


class TokenLM(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, lm_labels, lm_mask):
        logits = self.head(self.emb(ids))
        loss = F.cross_entropy(logits.flatten(0, 1), lm_labels.flatten(), reduction="none")
        loss = loss * lm_mask.flatten()
        return logits, {ret}
"""
_TRAIN = """
from torch.nn.parallel import DistributedDataParallel

from model import TokenLM


def train_epoch(model, optimizer, loader, args):
    for step, (ids, labels, mask) in enumerate(loader):
        _, loss = model(ids, lm_labels=labels, lm_mask=mask)
        (loss / args.grad_acc).backward(){mark}
        if (step + 1) % args.grad_acc == 0:
            optimizer.step()
            optimizer.zero_grad()


def main(args, optimizer, loader):
    net = DistributedDataParallel(TokenLM(args.vocab, args.dim), device_ids=[args.rank])
    train_epoch(net, optimizer, loader, args)
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_a_model_called_through_a_parameter_runs_its_forward(tmp_path: Path, bad: bool) -> None:
    # Bad: `main` passes a DDP-wrapped TokenLM (model.py) to `train_epoch`, whose
    # `model(...)` runs TokenLM.forward: `loss.sum() / lm_mask.sum()`, a mean over the
    # masked-in tokens, then `/ args.grad_acc`. Good: the forward returns the sum.
    # Today's lint misses the bad twin (`model` is a parameter; the forward is not read).
    ret = "loss.sum() / (lm_mask.sum() + 1e-4)" if bad else "loss.sum()"
    _check(
        tmp_path,
        {"model.py": _MODEL.format(ret=ret), "train.py": _TRAIN.format(mark=_mark(bad))},
    )


def test_a_loss_module_given_bare_targets_keeps_a_fixed_count(tmp_path: Path) -> None:
    # A loss module of the run that divides by its non-ignored targets, called on
    # packed pre-training blocks (`loss_fn(logits, targets)`, no labels, no mask): no
    # sign that any target is ignored, so not reported (TinyLlama's fused cross entropy).
    files = {
        "losses.py": """
            import torch.nn as nn


            class TokenCE(nn.Module):
                def forward(self, logits, target):
                    loss = nn.functional.cross_entropy(logits, target, reduction="none")
                    return loss.sum() / (target != -100).sum()
            """,
        "pretrain.py": """
            from losses import TokenCE


            def train(model, loader, optimizer, gradient_accumulation_steps):
                loss_fn = TokenCE()
                for step, (x, targets) in enumerate(loader):
                    loss = loss_fn(model(x), targets)
                    (loss / gradient_accumulation_steps).backward()
                    if (step + 1) % gradient_accumulation_steps == 0:
                        optimizer.step()
                        optimizer.zero_grad()
            """,
    }
    _check(tmp_path, {k: textwrap.dedent(v) for k, v in files.items()})


def test_a_model_given_positions_it_ignores_out_of_range_keeps_a_fixed_count(
    tmp_path: Path,
) -> None:
    # A span model of the run whose forward ignores positions clamped to the sequence
    # length (`ignore_index=seq_len`), called with positional inputs and an attention
    # mask: no labels or loss mask by name, so its count is not shown to vary (one span
    # per row; DeepSpeedExamples' BERT SQuAD). Not reported.
    files = {
        "model.py": """
            import torch.nn as nn


            class SpanQA(nn.Module):
                def __init__(self, encoder, dim):
                    super().__init__()
                    self.encoder, self.qa = encoder, nn.Linear(dim, 2)

                def forward(self, input_ids, attention_mask, start, end):
                    start_logits, end_logits = self.qa(self.encoder(input_ids)).unbind(-1)
                    n = start_logits.size(1)
                    loss_fct = nn.CrossEntropyLoss(ignore_index=n)
                    return (loss_fct(start_logits, start.clamp(0, n)) + loss_fct(end_logits, end)) / 2
            """,
        "run_squad.py": """
            from model import SpanQA


            def train(encoder, loader, optimizer, args):
                model = SpanQA(encoder, args.dim)
                for step, (input_ids, input_mask, start, end) in enumerate(loader):
                    loss = model(input_ids, input_mask, start, end)
                    loss = loss / args.gradient_accumulation_steps
                    loss.backward()
                    if (step + 1) % args.gradient_accumulation_steps == 0:
                        optimizer.step()
                        optimizer.zero_grad()
            """,
    }
    _check(tmp_path, {k: textwrap.dedent(v) for k, v in files.items()})


# -- 5. label masking in another file of the run -------------------------------------------

_LOOP = """
def train(model, loader, optimizer, gradient_accumulation_steps):
    for step, batch in enumerate(loader):
        loss = model(**batch).loss
        loss = loss / gradient_accumulation_steps{mark}
        loss.backward()
        if (step + 1) % gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""
_DATASET = """
import torch


class InstructionDataset(torch.utils.data.Dataset):
    def __init__(self, rows, tokenizer):
        self.rows, self.tokenizer = rows, tokenizer

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        prompt = self.tokenizer.encode(self.rows[i]["prompt"])
        answer = self.tokenizer.encode(self.rows[i]["answer"])
        ids = torch.tensor(prompt + answer)
        labels = ids.clone()
        {mask}
        return {{"input_ids": ids, "labels": labels}}
"""
_MAIN = """
from recipes.data.instructions import InstructionDataset
from recipes.utils.train_utils import train


def main(model, rows, tokenizer, optimizer, loader_of):
    loader = loader_of(InstructionDataset(rows, tokenizer))
    train(model, loader, optimizer, gradient_accumulation_steps=4)
"""


def _package(bad: bool) -> _Tree:
    mask = "labels[: len(prompt)] = -100" if bad else "labels[: len(prompt)] = ids[0]"
    return {
        "recipes/__init__.py": "",
        "recipes/utils/__init__.py": "",
        "recipes/data/__init__.py": "",
        "recipes/utils/train_utils.py": _LOOP.format(mark=_mark(bad)),
        "recipes/data/instructions.py": _DATASET.format(mask=mask),
        "recipes/finetune.py": _MAIN,
    }


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_label_masking_in_a_dataset_module_imported_alongside(tmp_path: Path, bad: bool) -> None:
    # Bad: the loop's `model(**batch).loss` is a mean over the answer tokens, since the
    # dataset module that finetune.py imports beside the loop masks the prompt with -100.
    # Good: the dataset keeps every label (no masking anywhere). Today's lint misses the
    # bad twin (it asked for the -100 in the file of the division).
    _check(tmp_path, _package(bad))


def test_masking_in_another_package_is_no_evidence(tmp_path: Path) -> None:
    # The -100 is in a library imported by the same script (a vendored collator): not
    # evidence about the loop of the script's own package (LoRA's GLUE scripts).
    files = _package(False)
    files["vendored/__init__.py"] = "from vendored.collate import pad_labels\n"
    files["vendored/collate.py"] = (
        "def pad_labels(rows, n):\n    return [r + [-100] * (n - len(r)) for r in rows]\n"
    )
    files["recipes/finetune.py"] = "import vendored\n" + _MAIN
    _check(tmp_path, files)


# -- 6. Lightning's accumulation through a dict of arguments -------------------------------

_MODULE = """
import pytorch_lightning as pl
import torch
import torch.nn.functional as F


class BaseModule(pl.LightningModule):
    def __init__(self, model, pad_id, lr):
        super().__init__()
        self.model, self.pad_id, self.lr = model, pad_id, lr

    def validation_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"])
        self.log("val_loss", F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)
"""
_TASK = """
import torch.nn.functional as F

from base import BaseModule


class Seq2Seq(BaseModule):
    def training_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"])
        loss = F.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=self.pad_id
        )
        return {{"loss": loss}}{mark}
"""
_SCRIPT = """
import argparse

import pytorch_lightning as pl


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--accumulate_grad_batches", type=int, default=1)
    args = parser.parse_args()
    train_params = {{}}
    train_params["{key}"] = args.accumulate_grad_batches
    return pl.Trainer(max_epochs=1, **train_params)
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_lightning_accumulation_through_a_dict_of_arguments(tmp_path: Path, bad: bool) -> None:
    # Bad: the Trainer gets accumulate_grad_batches through `**train_params`, filled from
    # argparse; the module (a LightningModule through a base in another file) returns a
    # token mean (ignore_index). Good: the dict sets another key (no accumulation).
    # Today's lint misses the bad twin (the accumulation is not a literal keyword, and
    # the LightningModule base is in another file).
    key = "accumulate_grad_batches" if bad else "gradient_clip_val"
    _check(
        tmp_path,
        {
            "base.py": _MODULE,
            "seq2seq.py": _TASK.format(mark=_mark(bad)),
            "train.py": _SCRIPT.format(key=key),
        },
    )


# -- 7. a mean built in another module, returned in a tuple ---------------------------------

_FUNCTIONAL = """
\"\"\"Masked reductions for the policy loss.\"\"\"


def masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
"""
_ALGOS = """
import torch

from rl import functional


def policy_loss(logp, old_logp, adv, mask, clip):
    ratio = torch.exp(logp - old_logp)
    losses = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip))
    loss = {loss}
    clipfrac = functional.masked_mean(torch.gt(ratio, 1.0 + clip).float(), mask)
    return loss, clipfrac
"""
_ACTOR = """
from rl import algos


class Actor:
    def __init__(self, grad_accum_steps):
        self.grad_accum_steps = grad_accum_steps

    def update(self, micro_batches, optimizer):
        for i, b in enumerate(micro_batches):
            pg_loss, clipfrac = algos.policy_loss(b.logp, b.old_logp, b.adv, b.mask, 0.2)
            loss = pg_loss / self.grad_accum_steps{mark}
            loss.backward()
            if (i + 1) % self.grad_accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_a_mean_from_another_module_in_a_tuple(tmp_path: Path, bad: bool) -> None:
    # Bad: `algos.policy_loss` returns `masked_mean(losses, mask)` first, a mean over
    # this micro-batch's response tokens (`masked_mean`'s `axis` left at None: the whole
    # mask's count), built in a third module; the actor divides it by the steps (verl's
    # PPO actor). Good: the first element is a mean of per-row means (`axis=-1`, then
    # `.mean()`: every micro-batch has as many rows); the second, `clipfrac`, is still a
    # token mean, and only its own element carries it (tuple returns followed element by
    # element). 74495cc's lint misses the bad twin (`mask.sum(axis=axis)` counted as a
    # per-row count, and the mean of a callee's callee not followed).
    loss = (
        "functional.masked_mean(losses, mask)"
        if bad
        else "functional.masked_mean(losses, mask, axis=-1).mean()"
    )
    _check(
        tmp_path,
        {
            "rl/__init__.py": "",
            "rl/functional.py": _FUNCTIONAL,
            "rl/algos.py": _ALGOS.format(loss=loss),
            "rl/actor.py": _ACTOR.format(mark=_mark(bad)),
        },
    )


# -- 8. a forward that returns its loss in a tuple, given labels under another name ---------

_VLM = """
import torch.nn as nn
import torch.nn.functional as F


class CaptionModel(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, images, attention_mask=None, targets=None):
        logits = self.head(self.emb(input_ids) + images)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
            )
        return logits, loss
"""
_COLLATE = """
import torch


def collate(rows, pad_id):
    width = max(len(r["ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), {fill})
    for i, r in enumerate(rows):
        ids[i, : len(r["ids"])] = torch.tensor(r["ids"])
        labels[i, : len(r["ids"])] = torch.tensor(r["labels"])
    return ids, labels
"""
_VLM_TRAIN = """
import torch
from torch.nn.parallel import DistributedDataParallel

from data.collate import collate
from models.caption import CaptionModel


def train(cfg, loader, rank):
    model = CaptionModel(cfg.vocab, cfg.dim)
    model = DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters())
    for step, (ids, images, mask, labels) in enumerate(loader):
        _, loss = model(ids, images, attention_mask=mask, targets=labels)
        loss = loss / cfg.gradient_accumulation_steps{mark}
        loss.backward()
        if (step + 1) % cfg.gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_a_forward_given_labels_under_another_name_returns_them_in_a_tuple(
    tmp_path: Path, bad: bool
) -> None:
    # Bad: `_, loss = model(..., targets=labels)`, a DDP-wrapped CaptionModel of the run
    # whose forward returns `(logits, cross_entropy(..., targets, ignore_index=-100))`:
    # the parameter the call binds is that loss's target, and the collator beside the
    # script pads labels with -100, so the loss is a mean over a varying token count
    # (nanoVLM). Good: the collator pads labels with the pad id (no label is ever -100:
    # packed, fixed-count rows), and the forward's own `ignore_index=-100` is no
    # evidence. 74495cc's lint misses the bad twin (`targets=` is not a labels name, and
    # the collator is in a package beside the script, not the script's own package).
    _check(
        tmp_path,
        {
            "data/__init__.py": "",
            "data/collate.py": _COLLATE.format(fill="-100" if bad else "pad_id"),
            "models/__init__.py": "",
            "models/caption.py": _VLM,
            "train.py": _VLM_TRAIN.format(mark=_mark(bad)),
        },
    )
