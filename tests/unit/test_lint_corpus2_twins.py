"""Bad and good twins of what the tuning half of benchmarks/lint_corpus2.toml showed
(issue 33, judged at 3a8ab04), written for these tests: each twin is a small tree of
files, linted as a folder; a line ending in `# expect: WBnnn` must be flagged with that
code, and nothing else may be. The twins of a kind differ in the one thing that decides
the verdict; the lint of 7b8dc92 misjudges one twin of every kind (the bad twin of a
miss, the good twin of a false alarm):

- `amp-branch-clip` (WB303, a false alarm): `if amp: scaler.scale(loss).backward();
  scaler.unscale_(opt) else: loss.backward()`, then a clip: the `else` path never scaled.
- `deepspeed-backward` (WB301, a miss): DeepSpeed's engine divides by the steps itself.
- `deepspeed-pipeline-loss` (WB301, a miss): so does its PipelineEngine, with what the
  `loss_fn=` of a PipelineModule returns (Megatron-DeepSpeed's GPTModelPipe).
- `megatron-schedules-loss` (WB301, a miss; issue 33, misjudged by the lint of 0ab77b5):
  Megatron's pipeline schedules divide what the loss function returns by the number of
  micro-batches, the function a forward step hands over as `partial(loss_func, mask)`
  (Megatron-DeepSpeed's pretrain_t5.py, TinyZero's Megatron actor).
- `count-and-steps` (WB301, a miss): this micro-batch's token count and the number of
  micro-batches in one denominator.
- `fixed-weight-table` (WB301, a false alarm): a weight table built by `torch.arange`
  and normalised by its own sum is no mean over a data-dependent count.

Three more kinds (issue 33, METER and nanotron), each misjudged by the lint of 1c57c5d:

- `lightning-own-forward` (WB301, a miss): `output = self(batch)` in `training_step`
  runs the class's own `forward`, which collects the objectives' dicts
  (`ret.update(compute_mlm(self, batch))`), while the Trainer accumulates
  (`accumulate_grad_batches=grad_steps`, computed from the config).
- `lightning-accumulates-one` (WB301, a false alarm): `grad_steps = 1`, the only
  assignment of the name given as `accumulate_grad_batches`: no accumulation.
- `label-mask-by-position` (WB301, a miss): a pipeline engine divides each micro-batch's
  model `loss` by the number of micro-batches, and the package's data module sets the
  label mask on each sample's completion tokens only (`label_mask[i, p:n] = True`).

One more (issue 33, microsoft/ANCE), misjudged by the lint of 68aea82:

- `no-sync-forward-block` (WB302, a false alarm): the forward runs in its own
  `with model.no_sync():` under `if step % k == 0: ... else:`, the backward in a second
  one under the same test: on the backward's path the forward skipped the all-reduce too.
  The bad twin swaps the forward's branches (no_sync on the boundary step).

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_corpus2_twins.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

from benchmarks.lint_twins import expected, twin_tests, write
from wholebatch.lint import lint_paths
from wholebatch.lint.frameworks import (
    FACTS,
    deepspeed_divides,
    deepspeed_engines,
    megatron_losses,
)
from wholebatch.lint.names import Imports

Twin = dict[str, str]

_AMP = """
import torch


def train(model, loader, optimizer, scaler, amp, clip):
    for x in loader:
        loss = model(x).mean()
        if amp:
            scaler.scale(loss).backward()
            {unscale}
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip){mark}
        if amp:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
"""

_DEEPSPEED = """
import deepspeed
import torch.nn.functional as F


def train(model, loader, args):
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=args.ds_config)
    for batch in loader:
        logits = engine(batch["input_ids"])
        loss = F.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100{reduction}
        )
        engine.backward(loss){mark}
        engine.step()
"""

_PIPE = """
import torch
from deepspeed.pipe import PipelineModule


def get_cross_entropy(seq_len):
    def CrossEntropy(output, labels):
        labels, loss_mask = labels[0], labels[1]
        losses = torch.nn.functional.cross_entropy(
            output.flatten(0, 1), labels.flatten(), reduction="none"
        )
        {count}
        loss = torch.sum(losses * loss_mask.view(-1)) / count{mark}
        return loss

    return CrossEntropy


class GPTPipe(PipelineModule):
    def __init__(self, specs, seq_len):
        super().__init__(layers=specs, loss_fn=get_cross_entropy(seq_len))
"""

_MEGATRON = """
from functools import partial

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    {count}
    loss = torch.sum(losses * loss_mask.view(-1)) / count
    return loss, {{"lm loss": loss.detach()}}{mark}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask = next(data_iterator)
    output_tensor = model(tokens, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def train_step(model, data_iterator, num_microbatches, seq_length, micro_batch_size):
    forward_backward_func = get_forward_backward_func()
    return forward_backward_func(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
    )
"""

_CRITERION = """
import torch.nn.functional as F
from fairseq.criterions import FairseqCriterion, register_criterion


@register_criterion("masked_tokens")
class MaskedTokensCriterion(FairseqCriterion):
    def forward(self, model, sample, reduce=True):
        logits = model(**sample["net_input"])[0]
        target = sample["target"].view(-1)
        loss = F.nll_loss(
            logits.view(-1, logits.size(-1)), target, ignore_index=self.padding_idx, {reduction}
        )
        {size}
        return loss, sample_size, {{"loss": loss.data, "sample_size": sample_size}}
"""

_PASSES = """
def train(model, batches, optimizer, examples_per_rank, num_steps):
    for step in range(num_steps):
        {total}
        for example_step in range(examples_per_rank):
            inputs_all, targets_all, advantages_all = next(batches)
            num_passes = inputs_all.size(0) // 8
            for pass_idx in range(num_passes):
                inputs = inputs_all[pass_idx * 8 : (pass_idx + 1) * 8]
                targets = targets_all[pass_idx * 8 : (pass_idx + 1) * 8]
                logp = -model(inputs, targets, loss_reduction="none")
                pg_obj = (logp * advantages_all[pass_idx].unsqueeze(-1)).sum()
                {count}
                loss = -pg_obj
                loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
"""
_PER_PASS = (
    "num_valid = (targets >= 0).sum().clamp(min=1)\n"
    "                pg_obj = pg_obj / (num_valid * num_passes * examples_per_rank)"
    "  # expect: WB301"
)
# The good twin: the valid tokens of the whole step, counted before its micro-batches.
_PER_STEP = "pg_obj = pg_obj / total_valid"
_TOTAL = "total_valid = batches.count_valid_tokens(step)"

_WEIGHTS = """
import torch
import torch.nn.functional as F


def loss_weights(num_steps, mask):
    {table}
    return w * (num_steps / w.sum())


def train(model, loader, optimizer, accum_steps, num_steps):
    for i, (x, t, target, mask) in enumerate(loader):
        w = loss_weights(num_steps, mask)
        per = F.mse_loss(model(x, t), target, reduction="none")
        loss = (per * w[t].view(-1, 1)).mean()
        (loss / accum_steps).backward(){mark}
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""
# A bell over the timesteps: the same table every call (unsloth's diffusion trainer).
_BELL = (
    "t = torch.arange(num_steps, dtype=torch.float32)\n"
    "    w = torch.exp(-2.0 * ((t - num_steps / 2) / num_steps) ** 2)\n"
    "    w = w - w.min()"
)
# The tokens of this micro-batch that a length mask keeps: a count that varies.
_LENGTHS = "w = (torch.arange(num_steps)[None, :] < mask.sum(-1)[:, None]).float()"

_LIGHTNING = """
import pytorch_lightning as pl
import torch.nn.functional as F


def compute_mlm(module, batch):
    logits = module.head(batch["text"])
    mlm_loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    return {{"mlm_loss": mlm_loss, "mlm_logits": logits}}


class Pretrain(pl.LightningModule):
    def forward(self, batch):
        ret = dict()
        ret.update(compute_mlm(self, batch))
        return ret

    def training_step(self, batch, batch_idx):
        {output}
        total_loss = sum([v for k, v in output.items() if "loss" in k])
        return total_loss{mark}


def main(config):
    {steps}
    trainer = pl.Trainer(accumulate_grad_batches=grad_steps, max_steps=config["max_steps"])
    trainer.fit(Pretrain())
"""
_GRAD_STEPS = 'grad_steps = max(config["batch_size"] // config["per_gpu_batchsize"], 1)'

# A pipeline engine that divides each micro-batch's `loss` by the number of micro-batches;
# the data module of the same package builds the label mask the model's mean counts.
_ENGINE = """
class PipelineEngine:
    def __init__(self, nb_microbatches):
        self.nb_microbatches = nb_microbatches

    def forward(self, micro_batch, model):
        output = model(**micro_batch)
        output["loss"] = output["loss"] / self.nb_microbatches{mark}
        output["loss"].backward()
        return output
"""
_DATA = """
import torch


def collate(samples, seq_length):
    input_ids = torch.tensor([s["ids"] for s in samples])
    {mask}
    return {{"input_ids": input_ids, "label_mask": label_mask}}
"""
# The completion tokens of each sample only: as many as that sample has.
_COMPLETIONS = (
    "label_mask = torch.zeros((len(samples), seq_length), dtype=torch.bool)\n"
    "    for i, s in enumerate(samples):\n"
    '        label_mask[i, s["prompt_length"]:s["length"]] = True'
)
_TRAIN = """
from pkg.data import collate
from pkg.engine import PipelineEngine


def train(model, loader, optimizer, k):
    engine = PipelineEngine(k)
    for micro_batches in loader:
        for mb in micro_batches:
            engine.forward(collate(mb, 2048), model)
        optimizer.step()
        optimizer.zero_grad()
"""


def _pipeline(mask: str, mark: str) -> Twin:
    return {
        "pkg/__init__.py": "",
        "pkg/engine.py": _ENGINE.format(mark=mark),
        "pkg/data.py": _DATA.format(mask=mask),
        "pkg/train.py": _TRAIN,
    }


_NO_SYNC = """
def train(model, loader, optimizer, k):
    for step, x in enumerate(loader):
        if step % k {test} 0:
            out = model(x)
        else:
            with model.no_sync():
                out = model(x)
        loss = out.sum() / k
        if step % k == 0:
            loss.backward()
        else:
            with model.no_sync():{mark}
                loss.backward()
        if step % k == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

TWINS: dict[str, tuple[Twin, Twin]] = {
    "no-sync-forward-block": (
        {"train.py": _NO_SYNC.format(test="!=", mark="  # expect: WB302")},
        {"train.py": _NO_SYNC.format(test="==", mark="")},
    ),
    "amp-branch-clip": (
        {"train.py": _AMP.format(unscale="pass", mark="  # expect: WB303")},
        {"train.py": _AMP.format(unscale="scaler.unscale_(optimizer)", mark="")},
    ),
    "deepspeed-backward": (
        {"train.py": _DEEPSPEED.format(reduction="", mark="  # expect: WB301")},
        # A sum over tokens: DeepSpeed's 1/k scales every token alike.
        {"train.py": _DEEPSPEED.format(reduction=', reduction="sum"', mark="")},
    ),
    "deepspeed-pipeline-loss": (
        {"train.py": _PIPE.format(count="count = loss_mask.sum()", mark="  # expect: WB301")},
        # The tokens a micro-batch holds, padding included: the same count every time.
        {"train.py": _PIPE.format(count="count = loss_mask.size(0) * seq_len", mark="")},
    ),
    "megatron-schedules-loss": (
        {"train.py": _MEGATRON.format(count="count = loss_mask.sum()", mark="  # expect: WB301")},
        # The tokens a micro-batch holds, padding included: the same count every time.
        {"train.py": _MEGATRON.format(count="count = loss_mask.numel()", mark="")},
    ),
    "fairseq-criterion": (
        # A token mean with sample_size 1: the trainer divides the summed micro-batch
        # means by the number of micro-batches.
        {
            "criterion.py": _CRITERION.format(
                reduction='reduction="mean"', size="sample_size = 1  # expect: WB301"
            )
        },
        # A sum with its token count: the trainer's division by the summed counts is exact.
        {
            "criterion.py": _CRITERION.format(
                reduction='reduction="sum" if reduce else "none"',
                size='sample_size = sample["ntokens"]',
            )
        },
    ),
    "count-and-steps": (
        {"train.py": _PASSES.format(total="", count=_PER_PASS)},
        {"train.py": _PASSES.format(total=_TOTAL, count=_PER_STEP)},
    ),
    "lightning-own-forward": (
        {
            "train.py": _LIGHTNING.format(
                output="output = self(batch)", mark="  # expect: WB301", steps=_GRAD_STEPS
            )
        },
        # The objectives' sum over the tokens: Lightning's 1/k scales every token alike.
        {
            "train.py": _LIGHTNING.format(
                output="output = self(batch)", mark="", steps=_GRAD_STEPS
            ).replace("ignore_index=-100)", 'ignore_index=-100, reduction="sum")')
        },
    ),
    "lightning-accumulates-one": (
        {
            "train.py": _LIGHTNING.format(
                output="output = compute_mlm(self, batch)",
                mark="  # expect: WB301",
                steps=_GRAD_STEPS,
            )
        },
        # Every assignment of the name is a literal 1: the Trainer does not accumulate.
        {
            "train.py": _LIGHTNING.format(
                output="output = compute_mlm(self, batch)", mark="", steps="grad_steps = 1"
            )
        },
    ),
    "label-mask-by-position": (
        _pipeline(_COMPLETIONS, "  # expect: WB301"),
        # Pre-training: every token counts, the same number in every micro-batch.
        _pipeline("label_mask = torch.ones_like(input_ids, dtype=torch.bool)", ""),
    ),
    "fixed-weight-table": (
        {"train.py": _WEIGHTS.format(table=_LENGTHS, mark="  # expect: WB301")},
        {"train.py": _WEIGHTS.format(table=_BELL, mark="")},
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)


def test_deepspeed_engine_is_the_one_initialize_returned() -> None:
    # `deepspeed-backward`: only the engine `deepspeed.initialize` returned divides by the
    # steps; a `backward(loss)` of anything else (a custom wrapper) is not that fact.
    src = (
        "import deepspeed as ds\n"
        "self.engine, opt, _, _ = ds.initialize(model=m)\n"
        "wrapper.backward(loss)\n"
        "self.engine.backward(loss)\n"
    )
    tree = ast.parse(src)
    imports = Imports()
    first = tree.body[0]
    assert isinstance(first, ast.Import)
    imports.add(first)
    engines = deepspeed_engines(tree, imports.qualname)
    assert engines == {"self.engine"}
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("backward")
    ]
    assert [deepspeed_divides(c, engines) for c in calls] == [None, FACTS["deepspeed-backward"]]


def test_megatron_loss_is_the_one_a_forward_step_returns() -> None:
    # `megatron-schedules-loss`: the function a forward step (named so, or given as
    # `forward_step_func=`) returns beside its output, through functools.partial or by
    # name; not a partial of another function, nor one returned by any other function.
    src = (
        "import functools\n"
        "def step(it, model):\n"
        "    return model(next(it)), functools.partial(lm_loss, mask)\n"
        "def forward_step(it, model):\n"
        "    return model(next(it)), plain_loss\n"
        "def helper(x):\n"
        "    return x, functools.partial(other_loss, x)\n"
        "run(forward_step_func=step)\n"
    )
    tree = ast.parse(src)
    imports = Imports()
    first = tree.body[0]
    assert isinstance(first, ast.Import)
    imports.add(first)
    assert megatron_losses(tree, imports.qualname) == {"lm_loss", "plain_loss"}


def test_criterion_helpers_are_read_by_their_own_bodies(tmp_path: Path) -> None:
    # A criterion's loss is what its helpers return: a helper of the run given
    # `ignore_index=` that sums (fairseq's label_smoothed_nll_loss), or one whose mean
    # default the call overrides with reduction="sum", is no mean; the same helper left
    # at its default "mean" is.
    helpers = """
import torch.nn.functional as F


def smoothed_nll(lprobs, target, ignore_index=None, reduce=True):
    nll = -lprobs.gather(dim=-1, index=target.unsqueeze(-1))
    if ignore_index is not None:
        nll.masked_fill_(target.eq(ignore_index).unsqueeze(-1), 0.0)
    return nll.sum() if reduce else nll


def token_ce(logits, target, ignore_index=-100, reduction="mean"):
    return F.nll_loss(logits, target, ignore_index=ignore_index, reduction=reduction)
"""
    criterion = """
from fairseq.criterions import FairseqCriterion

from pkg.helpers import smoothed_nll, token_ce


class Smoothed(FairseqCriterion):
    def forward(self, model, sample, reduce=True):
        lprobs = model(**sample["net_input"])[0]
        loss = smoothed_nll(lprobs, sample["target"], ignore_index=self.padding_idx)
        sample_size = sample["ntokens"]
        return loss, sample_size, {{}}


class Tokens(FairseqCriterion):
    def forward(self, model, sample, reduce=True):
        logits = model(**sample["net_input"])[0]
        loss = token_ce(logits, sample["target"], ignore_index=self.padding_idx{red})
        sample_size = sample["ntokens"]{mark}
        return loss, sample_size, {{}}
"""
    for red, mark in ((', reduction="sum"', ""), ("", "  # expect: WB301")):
        root = tmp_path / str(len(mark))
        write(
            root,
            {
                "pkg/__init__.py": "",
                "pkg/helpers.py": helpers,
                "pkg/criterion.py": criterion.format(red=red, mark=mark),
            },
        )
        findings, _ = lint_paths([root])
        got = sorted([Path(f.path).relative_to(root).as_posix(), f.line, f.code] for f in findings)
        assert got == expected(root), [f.message for f in findings]


def test_no_sync_branches_stop_agreeing_once_the_tested_name_is_reassigned() -> None:
    """Mutation of the good `no-sync-forward-block` twin: `step` changes between the two
    tests, so the backward's branch no longer says which branch the forward took."""
    from wholebatch.lint import lint_source

    good = _NO_SYNC.format(test="==", mark="")
    moved = good.replace(
        "        loss = out.sum() / k\n", "        loss = out.sum() / k\n        step += 1\n"
    )
    assert moved != good
    assert [f.code for f in lint_source(good)] == []
    assert [f.code for f in lint_source(moved)] == ["WB302"]


def test_a_forward_under_a_conditional_no_sync_is_not_taken_as_unsynchronised() -> None:
    """Mutation of the good `no-sync-forward-block` twin: the forward's context is
    `model.no_sync() if c else nullcontext()`, which may synchronise after all."""
    from wholebatch.lint import lint_source

    good = _NO_SYNC.format(test="==", mark="")
    block = "            with model.no_sync():\n                out = model(x)\n"
    maybe = good.replace(
        block,
        "            with model.no_sync() if c else nullcontext():\n                out = model(x)\n",
    )
    assert maybe != good
    assert [f.code for f in lint_source(maybe)] == ["WB302"]
