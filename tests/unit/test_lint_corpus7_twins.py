"""Bad and good twins of what corpus 7 showed after its judgment (issue 33; both halves of
benchmarks/lint_corpus7.toml, tuned on after the evaluation half was judged at
05417c5), written for these tests: each twin is a small tree of files, linted as a
folder; a line ending in `# expect: WBnnn` must be flagged with that code, and nothing
else may be. Each kind has one twin that the lint of 05417c5 misjudges
(`python -m benchmarks.lint_twins --twins tests.unit.test_lint_corpus7_twins
--baseline 05417c5`).

- `method-server-dispatch` (WB104; NeMo-Aligner's critic and reward servers): rank 0
  binds request handlers that are methods (`bind(infer_func=self.server_train)`), each
  broadcasting a command and then making what the command asks; the other ranks call a
  method, `self.run_subscriber_loop()`, looping on `broadcast(command)` and dispatching
  on it. Every path of the worker's loop is a sequence a handler makes, so no rank
  skips a collective: the good twin is not reported (05417c5 reports the worker call).
  The bad twin's worker has an arm that all-reduces, which no handler does.
- `nested-handler-server` (WB104; minimal-llama's tinypar demos): the handler rank 0
  registers and the function that broadcasts are both nested in the function that
  serves (`def respond(...)` handed to `submit`, calling a nested `generate(prompt)`
  that broadcasts the prompt); the other ranks loop on `generate(None)`. The good twin
  is not reported (05417c5 reports the worker loop); the bad twin's handler answers
  from a cache and never broadcasts.
- `mean-branch-line` (WB301; X-R1's GRPO trainer): a `compute_loss` override assigns
  its loss in branches on a `loss_type`, the token mean (`sum / mask.sum()`) first and a
  sum over a constant after it; the finding names the branch that is the mean. The bad
  twin is reported at that line (05417c5 names the later, exact branch); the good twin
  normalises every branch by constants.
- `zeroed-then-one-step` (WB201; GLM's `train_step`): a function zeroes the gradients,
  then loops over micro-batches until the one step that sets its `complete` flag, which
  the loop tests to leave: each call steps once on fresh gradients. The good twin is
  not reported (05417c5 reports the step); the bad twin never zeroes.
- `labels-not-scored` (WB301; InternVL's stage-2 retrieval model): a model of the run
  whose `forward` takes `labels` and no `**kwargs` is a mean over its micro-batch's
  labels only where a cross-entropy scores something computed from them; one that
  builds its own targets over a fixed number of pairs (image-text matching) is a mean
  over a fixed count. The good twin's model does so and is not reported (05417c5 reports
  the Trainer); the bad twin's cross-entropy scores the shifted labels.
- `detached-log-division` (WB301; InternLM-XComposer's reward trainer): `loss.detach() /
  k`, the number a step returns for the log, carries no gradient. The good twin
  backpropagates a token sum and logs the mean so divided (05417c5 reports the log
  line); the bad twin backpropagates the mean divided by the steps.
- `megatron-step-maker` (WB301, fact `megatron-schedules-loss`; NeMo-Aligner's models):
  the forward step handed to Megatron's schedules is the function a call returns
  (`forward_step_func=self.get_forward_output_and_loss_func()`), and its loss function is
  nested in it. The bad twin's loss function returns a masked token mean (reported at
  its return; 05417c5 never reads the made step). The good twin divides the token sum
  by the step's token count, a constant of the model.
- `mmengine-gather` (WB101, fact `mmengine-dist-all-gather`; mmpretrain's BLIP-2
  retriever): `mmengine.dist.all_gather(x)` returns the list torch.distributed's gather
  fills, with no gradient: the bad twin's contrastive loss against the gathered
  features is reported at the gather (05417c5 reports nothing). The good twin gathers
  with torch.distributed.nn's differentiable all_gather.
- WB105's rank-local exits nested under another test (MiniCPM-V's VLMEvalKit `run.py`,
  yolov3's `train.py`; the open_clip_train peer's two error returns too):
  `nested-continue-in-rank-block` (`if rank == 0:` holding `if task_is_test:
  continue`, as `if rank == 0 and task_is_test: continue` is judged),
  `nested-return-membership-upper-rank` (`if RANK in {-1, 0}: ... if stop: return`),
  `literal-rank-list` (the rank tested against a literal list of ranks names those
  ranks; `in (-1,)`, "not distributed", is the same on every rank),
  `upper-case-rank-constant` (`LOCAL_RANK = int(os.getenv(...))` is a rank),
  `exit-knows-guard` (what the leaving rank knows between the rank test and the exit:
  `if not distributed: return` skips only a barrier behind `if distributed:`) and
  `rank-test-around-loop` (a rank test around the loop holds the collectives after the
  exit too). 05417c5 misses every bad twin.
- `wordless-helper-module` (WB301; NeMo-Aligner's `utils.masked_mean`): a helper module
  that holds none of the rules' words (`(values * mask).sum() / mask.sum()` and no
  `loss`) is summarised where a training file imports it, so the mean it returns is
  seen at the call. The good twin's helper sums; 05417c5 misses the bad twin.
- `cast-mask-selection` (WB301; the same helper's `values[mask.bool()].mean()`): a mask
  cast where it indexes is still a mask of the data. The good twin indexes by a fixed
  slice.
- `megatron-step-assigned` (WB301, fact `megatron-schedules-loss`; NeMo-Aligner's
  distillation model): the step handed to Megatron is a name assigned the maker's call
  (`fwd_loss_fn = self.get_forward_output_and_loss_func()`).
- `predict-only-trainer` (WB301; BELLE's `zero_inference.py`, corpus 4): a Trainer built
  with `train_dataset=None` to `predict()` trains nothing; the good twin is not reported
  (05417c5 reports its call), the bad twin trains.
- `trl-ppo-base` (WB301; LIMO's vendored LLaMA-Factory `CustomPPOTrainer(PPOTrainer,
  Trainer)`): a class that also derives from TRL's PPO trainer trains through that
  trainer's own loop (`step()` before TRL 0.12, its own `train()` after, read in a copy
  of 0.12's), never through the transformers Trainer's `training_step`. The good twin is
  not reported under a pin below 4.46 (05417c5 reports its `class` line); the bad twin
  derives from the Trainer alone.
- `trl-ppo-base-built-elsewhere` (the same fact, unpinned): a Trainer subclass of one
  file built in another with a model that gets no item count is reported at its
  `class` line, unless it also derives from TRL's PPO trainer (the bad twin is reported;
  6b23c63 reported the good twin too).
- `script-in-package-folder` (WB301; MiniCPM-V's `finetune/`): a script (an `if __name__
  == "__main__":` guard) in a folder with an `__init__.py`, run as a script, imports
  its neighbours by their bare names (`from dataset import ...`); such an import that no
  other file of the run answers is the neighbour, so the labels the dataset masks reach
  the trainer's override. The bad twin is reported (05417c5 misses it); the good twin's
  dataset copies its labels unmasked.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_corpus7_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests
from tests.unit.test_lint_loss_kwargs_twins import _PROMPTS, _SFT, _TOY_MODEL

Twin = dict[str, str]

_SERVER = """
import torch
import torch.distributed as dist

TRAIN, SAVE = 1, 2


class Server:
    def __init__(self, model, serve):
        self.model, self.serve = model, serve

    def handle_train(self, batch):
        dist.broadcast(torch.tensor(TRAIN), 0)
        return self.train_step(batch)

    def handle_save(self):
        dist.broadcast(torch.tensor(SAVE), 0)
        self.save()

    def train_step(self, batch=None):
        loss = self.model(batch).mean()
        loss.backward()
        dist.barrier()
        return loss.item()

    def save(self):
        dist.barrier()

    def run(self):
        if dist.get_rank() == 0:
            self.serve(train=self.handle_train, save=self.handle_save)
        else:
            self.worker_loop(){mark}

    def worker_loop(self):
        while True:
            command = torch.tensor(0)
            dist.broadcast(command, 0)
            if command.item() == TRAIN:
                self.train_step()
            elif command.item() == SAVE:
                {save}
            else:
                raise RuntimeError(f"unknown command {command.item()}")
"""

_NESTED = """
import torch
import torch.distributed as dist


def serve(model, ui, length):
    rank = dist.get_rank()

    def generate(prompt):
        tokens = torch.zeros(length, dtype=torch.long)
        if prompt is not None:
            tokens[: len(prompt)] = torch.tensor(prompt)
        dist.broadcast(tokens, 0)
        return model(tokens)

    if rank == 0:

        def respond(prompt):
            {answer}

        ui.submit(respond)
    else:
        while True:
            generate(None){mark}
"""

_BRANCHES = """
from transformers import Trainer


class PolicyTrainer(Trainer):
    model_accepts_loss_kwargs = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        per_token = model(inputs["input_ids"]).logits.logsumexp(-1)
        mask = inputs["completion_mask"]
        if self.args.loss_type == "token":
            {first}
        else:
            loss = (per_token * mask).sum() / (mask.size(0) * self.args.max_length)
        return loss
"""

_TOKEN_MEAN = "loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)  # expect: WB301"
_ROW_CONSTANT = "loss = (per_token * mask).sum() / mask.size(0)"

_ONE_STEP = """
def train_step(model, optimizer, batches, accumulation_steps):
    {zero}
    count = 0
    while True:
        complete = False
        loss = model(next(batches)).sum()
        loss.backward()
        count += 1
        if count == accumulation_steps:
            optimizer.step(){mark}
            complete = True
        if complete:
            break
    return count


def train(model, optimizer, batches, steps):
    for _ in range(steps):
        train_step(model, optimizer, batches, 4)
"""

_PAIR_MODEL = """
import torch
import torch.nn.functional as F
from torch.nn import Linear
from transformers import PreTrainedModel


class ToyForCausalLM(PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.head = Linear(config.hidden_size, config.vocab_size)
        self.match = Linear(config.hidden_size, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        hidden = self.embed(input_ids)
        logits = self.head(hidden)
        {loss}
        return (loss, logits)
"""

_SCORES_LABELS = "loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())"
_OWN_PAIRS = (
    "pairs = self.match(hidden[:, 0])\n"
    "        targets = torch.zeros(len(pairs), dtype=torch.long)\n"
    "        loss = F.cross_entropy(pairs, targets)"
)


def _pair_run(loss: str, mark: str) -> Twin:
    return {
        "requirements.txt": "transformers\ntorch\n",
        "models/__init__.py": "",
        "models/toy.py": _PAIR_MODEL.replace("{loss}", loss),
        "data.py": _PROMPTS.format(),
        "train.py": _SFT.format(
            mark=mark,
            build="    model = ToyForCausalLM.from_pretrained(path)",
            args="    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()",
        ),
    }


_LOGGED = """
import torch.nn.functional as F


def train(model, loader, optimizer, accumulation_steps, log):
    for i, batch in enumerate(loader):
        logits = model(batch["input_ids"]).flatten(0, 1)
        labels = batch["labels"].flatten()
        loss = F.cross_entropy(logits, labels, ignore_index=-100)
        {backward}
        log(loss.detach() / accumulation_steps)
        if (i + 1) % accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

_SUMMED = 'F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").backward()'

_MEGATRON = """
import torch
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func


class PolicyModel:
    def __init__(self, model, tokens_per_step):
        self.model, self.tokens_per_step = model, tokens_per_step

    def get_forward_output_and_loss_func(self):
        def fwd_output_and_loss_func(data_iterator, model):
            batch = next(data_iterator)
            output = model(batch["tokens"])
            mask = batch["mask"]

            def loss_func(logprobs):
                summed = (logprobs * mask).sum()
                loss = {loss}
                return loss, {"loss": loss.detach()}{mark}

            return output, loss_func

        return fwd_output_and_loss_func

    def train_step(self, batches, num_microbatches):
        fwd_bwd = get_forward_backward_func()
        return fwd_bwd(
            forward_step_func=self.get_forward_output_and_loss_func(),
            data_iterator=iter(batches),
            model=self.model,
            num_microbatches=num_microbatches,
            forward_only=False,
        )
"""


def _megatron(loss: str, mark: str) -> Twin:
    return {"policy.py": _MEGATRON.replace("{loss}", loss).replace("{mark}", mark)}


_MM_GATHER = """
import torch
import torch.nn.functional as F
{imports}


def contrastive_loss(image_encoder, text_encoder, images, texts, rank, temperature=0.07):
    image_feat = image_encoder(images)
    text_feat = text_encoder(texts)
    all_text = torch.cat({gather}(text_feat)){mark}
    logits = image_feat @ all_text.t() / temperature
    targets = torch.arange(len(image_feat)) + rank * len(image_feat)
    return F.cross_entropy(logits, targets)
"""

# -- WB105: rank-local exits nested under another test ---------------------------------


# 1. `continue` under an ordinary condition inside `if rank == 0:` in a per-task loop
#    (wrapped in try/except, the closing barrier behind `if world > 1:`).
_TASKS = """
import torch.distributed as dist


def run_tasks(tasks, rank, world, opts):
    for task in tasks:
        try:
            if world > 1:
                dist.barrier()
            preds = task.predict()
            if rank == 0:
                {body}
        except RuntimeError:
            print("task failed")
        if world > 1:
            dist.barrier()
"""
_TASKS_BAD = """if task.name.endswith("_test"):
                    print("no labels")
                    continue  # expect: WB105
                if opts.predict_only:
                    continue  # expect: WB105
                task.score(preds)"""
_TASKS_GOOD = """if task.name.endswith("_test") or opts.predict_only:
                    print("nothing to score")
                else:
                    task.score(preds)"""

# 2. `return` under an ordinary condition inside `if RANK in {-1, 0}:` in the batch loop,
#    with RANK an upper-case module constant; the other ranks go on to the next
#    backward through the DDP model and to the epoch's broadcast.
_EPOCHS = """
import os

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

RANK = int(os.getenv("RANK", "-1"))


def fit(model, loader, opt, hooks, epochs):
    model = DDP(model)
    stop = False
    for epoch in range(epochs):
        for x, y in loader:
            loss = model(x, y).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if RANK in {{-1, 0}}:
                hooks.after_batch(loss.item())
{check}
        if RANK != -1:
            flag = [stop if RANK == 0 else None]
            dist.broadcast_object_list(flag, 0)
            stop = flag[0]
        if stop:
            break
"""
_EPOCHS_BAD = """                if hooks.should_stop:
                    return  # expect: WB105"""
_EPOCHS_GOOD = """                if hooks.should_stop:
                    stop = True"""

# 3. a literal list of rank numbers, tested directly: the same as `rank == 0`; the
#    "not distributed" sentinel list `(-1,)` is the same on every rank.
_PICK = """
import torch.distributed as dist


def save_and_sync(state, local_rank, path):
    if local_rank {test}:
        return{mark}
    state.save(path)
    dist.barrier()
"""

# 4. the rank as an upper-case module constant, tested with `==`; `RANK == -1` (not
#    distributed) is the same on every rank.
_UPPER = """
import os

import torch.distributed as dist

LOCAL_RANK = int(os.getenv("LOCAL_RANK", -1))


def gather_metrics(metrics):
    out = [None] * dist.get_world_size()
    for name, value in metrics.items():
        if LOCAL_RANK {test}:
            continue{mark}
        dist.all_gather_object(out, (name, value))
    return out
"""

# 5. what the exiting rank knows on its way out: `if rank == 0: if not distributed:
#    return` skips only the barrier behind `if distributed:` (which no rank then calls);
#    the bad twin leaves on a test that says nothing about the barrier's guard.
_KNOWN = """
import torch.distributed as dist


def export(model, rank, distributed, path):
    if rank == 0:
        {test}
            return{mark}
        model.export(path)
    if distributed:
        dist.barrier()
"""

# 6. a `continue` inside a loop that a
#    rank test holds: the collectives after it in the loop run on that rank only, so
#    the exit skips nothing the others make; the bad twin puts the rank test inside
#    the loop, around the `continue`.
_AROUND_BAD = """
import torch.distributed as dist


def report(rows, rank):
    for row in rows:
        if rank == 0:
            if row.empty:
                continue  # expect: WB105
            print(row)
        dist.barrier()
"""
_AROUND_GOOD = """
import torch.distributed as dist


def report(rows, rank):
    if rank == 0:
        for row in rows:
            if row.empty:
                continue
            print(row)
    dist.barrier()
"""

_EXITS: dict[str, tuple[str, str]] = {
    "nested-continue-in-rank-block": (
        _TASKS.format(body=_TASKS_BAD),
        _TASKS.format(body=_TASKS_GOOD),
    ),
    "nested-return-membership-upper-rank": (
        _EPOCHS.format(check=_EPOCHS_BAD),
        _EPOCHS.format(check=_EPOCHS_GOOD),
    ),
    "literal-rank-list": (
        _PICK.format(test="in [0]", mark="  # expect: WB105"),
        _PICK.format(test="in (-1,)", mark=""),
    ),
    "upper-case-rank-constant": (
        _UPPER.format(test="== 0", mark="  # expect: WB105"),
        _UPPER.format(test="== -1", mark=""),
    ),
    "exit-knows-guard": (
        _KNOWN.format(test="if not model.ready:", mark="  # expect: WB105"),
        _KNOWN.format(test="if not distributed:", mark=""),
    ),
    "rank-test-around-loop": (_AROUND_BAD, _AROUND_GOOD),
}

_HELPER = """
def masked_mean(values, mask):
    return {body}
"""

_HELPER_TRAIN = """
from helpers import masked_mean


def train(model, loader, optimizer, accumulation_steps):
    for i, batch in enumerate(loader):
        loss = masked_mean(model(batch["x"]), batch["mask"]) / accumulation_steps{mark}
        loss.backward()
        if (i + 1) % accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


def _helper(body: str, mark: str) -> Twin:
    return {
        "helpers.py": _HELPER.replace("{body}", body),
        "train.py": _HELPER_TRAIN.replace("{mark}", mark),
    }


def _assigned_step(loss: str, mark: str) -> Twin:
    """`_megatron`'s step handed over as a name assigned the maker's call."""
    text = _megatron(loss, mark)["policy.py"]
    text = text.replace(
        "forward_step_func=self.get_forward_output_and_loss_func(),",
        "forward_step_func=fwd_loss_fn,",
    ).replace(
        "fwd_bwd = get_forward_backward_func()",
        "fwd_bwd = get_forward_backward_func()\n"
        "        fwd_loss_fn = self.get_forward_output_and_loss_func()",
    )
    return {"policy.py": text}


def _predicting(data: str, mark: str) -> Twin:
    return {
        "requirements.txt": "transformers\ntorch\n",
        "models/__init__.py": "",
        "models/toy.py": _TOY_MODEL.format(kwargs=""),
        "data.py": _PROMPTS.format(),
        "train.py": _SFT.format(
            mark=mark,
            build="    model = ToyForCausalLM.from_pretrained(path)",
            args="    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()",
        ).replace("train_dataset=train", f"train_dataset={data}"),
    }


_PPO_BASE = """
from transformers import Trainer
{imports}


class CustomTrainer({bases}):{mark}
    def log_stats(self, stats):
        self.log(stats)
"""

_PPO_DATA = """
IGNORE_INDEX = -100


def build(prompt_ids, answer_ids):
    return {"input_ids": prompt_ids + answer_ids, "labels": [IGNORE_INDEX] * len(prompt_ids) + answer_ids}
"""


def _ppo_base(bases: str, imports: str, mark: str) -> Twin:
    return {
        "requirements.txt": "transformers==4.37.2\ntrl==0.9.6\n",
        "data.py": _PPO_DATA,
        "trainer.py": _PPO_BASE.format(bases=bases, imports=imports, mark=mark),
        "train.py": "from data import build\nfrom trainer import CustomTrainer\n",
    }


_PKG_TRAINER = """
import torch.nn as nn
from transformers import Trainer


class ChatTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss_fct = nn.CrossEntropyLoss()
        logits = outputs.logits.view(-1, outputs.logits.size(-1))
        loss = loss_fct(logits, labels.view(-1)){mark}
        return (loss, outputs) if return_outputs else loss
"""

_PKG_DATA = """
import torch


def example(ids, prompt_len):
    {labels}
    return {{"input_ids": ids, "labels": target}}
"""


_PKG_SCRIPT = """
from dataset import example
from trainer import ChatTrainer


def main(model, args, rows):
    ChatTrainer(model=model, args=args, train_dataset=[example(r, 4) for r in rows]).train()


if __name__ == "__main__":
    main(None, None, [])
"""


def _script_package(labels: str, mark: str) -> Twin:
    return {
        "finetune/__init__.py": "",
        "finetune/dataset.py": _PKG_DATA.format(labels=labels),
        "finetune/trainer.py": _PKG_TRAINER.replace("{mark}", mark),
        "finetune/finetune.py": _PKG_SCRIPT,
    }


_PPO_ELSEWHERE = """
from transformers import HfArgumentParser, TrainingArguments

from data import build_example
from models.toy import ToyForCausalLM
from trainers import CustomTrainer


def main(tokenizer, raw, path, output_dir):
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    model = ToyForCausalLM.from_pretrained(path)
    train = raw.map(lambda r: build_example(tokenizer, r["prompt"], r["answer"]))
    CustomTrainer(model=model, args=args, train_dataset=train).train()
"""


def _ppo_elsewhere(bases: str, imports: str, mark: str) -> Twin:
    return {
        "requirements.txt": "transformers\ntorch\n",
        "models/__init__.py": "",
        "models/toy.py": _TOY_MODEL.format(kwargs=""),
        "data.py": _PROMPTS.format(),
        "trainers.py": _PPO_BASE.format(bases=bases, imports=imports, mark=mark),
        "train.py": _PPO_ELSEWHERE,
    }


TWINS: dict[str, tuple[Twin, Twin]] = {
    "method-server-dispatch": (
        {
            "server.py": _SERVER.replace("{mark}", "  # expect: WB104").replace(
                "{save}", "dist.all_reduce(torch.zeros(1))"
            )
        },
        {"server.py": _SERVER.replace("{mark}", "").replace("{save}", "self.save()")},
    ),
    "nested-handler-server": (
        {
            "serve.py": _NESTED.replace("{mark}", "  # expect: WB104").replace(
                "{answer}", "return ui.cache[tuple(prompt)]"
            )
        },
        {"serve.py": _NESTED.replace("{mark}", "").replace("{answer}", "return generate(prompt)")},
    ),
    "mean-branch-line": (
        {"trainer.py": _BRANCHES.replace("{first}", _TOKEN_MEAN)},
        {"trainer.py": _BRANCHES.replace("{first}", _ROW_CONSTANT)},
    ),
    "zeroed-then-one-step": (
        {
            "train.py": _ONE_STEP.replace("{zero}", "model.train()").replace(
                "{mark}", "  # expect: WB201"
            )
        },
        {"train.py": _ONE_STEP.replace("{zero}", "optimizer.zero_grad()").replace("{mark}", "")},
    ),
    "labels-not-scored": (
        _pair_run(_SCORES_LABELS, "  # expect: WB301"),
        _pair_run(_OWN_PAIRS, ""),
    ),
    "detached-log-division": (
        {
            "train.py": _LOGGED.replace(
                "{backward}", "(loss / accumulation_steps).backward()  # expect: WB301"
            )
        },
        {"train.py": _LOGGED.replace("{backward}", _SUMMED)},
    ),
    "megatron-step-maker": (
        _megatron("summed / mask.sum()", "  # expect: WB301"),
        _megatron("summed / self.tokens_per_step", ""),
    ),
    "mmengine-gather": (
        {
            "loss.py": _MM_GATHER.format(
                imports="import mmengine.dist as dist",
                gather="dist.all_gather",
                mark="  # expect: WB101",
            )
        },
        {
            "loss.py": _MM_GATHER.format(
                imports="import torch.distributed.nn as dist_nn",
                gather="dist_nn.all_gather",
                mark="",
            )
        },
    ),
    "wordless-helper-module": (
        _helper("(values * mask).sum() / mask.sum()", "  # expect: WB301"),
        _helper("(values * mask).sum()", ""),
    ),
    "cast-mask-selection": (
        _helper("values[mask.bool()].mean()", "  # expect: WB301"),
        _helper("values[:, :16].mean()", ""),
    ),
    "megatron-step-assigned": (
        _assigned_step("summed / mask.sum()", "  # expect: WB301"),
        _assigned_step("summed / self.tokens_per_step", ""),
    ),
    "predict-only-trainer": (
        _predicting("train", "  # expect: WB301"),
        _predicting("None", ""),
    ),
    "trl-ppo-base": (
        _ppo_base("Trainer", "", "  # expect: WB301"),
        _ppo_base("PPOTrainer, Trainer", "from trl import PPOTrainer", ""),
    ),
    "trl-ppo-base-built-elsewhere": (
        _ppo_elsewhere("Trainer", "", "  # expect: WB301"),
        _ppo_elsewhere("PPOTrainer, Trainer", "from trl import PPOTrainer", ""),
    ),
    "script-in-package-folder": (
        _script_package(
            "target = torch.full_like(ids, -100)\n    target[prompt_len:] = ids[prompt_len:]",
            "  # expect: WB301",
        ),
        _script_package("target = ids.clone()", ""),
    ),
    **{kind: ({"train.py": bad}, {"train.py": good}) for kind, (bad, good) in _EXITS.items()},
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)
