"""Bad and good twins for each kind of miss and false alarm of issue 33 (the 18 held-out
repositories and the tuning half of benchmarks/lint_corpus.toml), written for these
tests: a twin is a small tree of files; a line ending in `# expect: WBnnn` must be
flagged with that code, and nothing else may be.

Each kind's twins differ in the one thing that decides the verdict. The lint of the
revision before issue 33 misjudges at least one twin of every kind
(`python -m benchmarks.lint_twins --baseline 75b74af` prints which).
"""

from __future__ import annotations

__all__ = ["TWINS", "Twin"]

Twin = dict[str, str]  # relative path -> source

_ACCUM_HELPER = """
import torch.nn.functional as F


def lm_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def train(model, loader, optimizer, accum_steps):
    for step, (input_ids, labels) in enumerate(loader):
        loss = lm_loss(model(input_ids), labels)
        (loss / accum_steps).backward(){mark}
        if (step + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""
_SUMMED_HELPER = _ACCUM_HELPER.replace(
    "ignore_index=-100)", "ignore_index=-100, reduction='sum')"
).replace("(loss / accum_steps).backward(){mark}", "(loss / num_items_in_window).backward()")

_STEP_METHOD = """
import torch.nn.functional as F


class Schedule:
    def __init__(self, micro_batches):
        self.micro_batches = micro_batches

    def accumulation_iters(self, step):
        return self.micro_batches


def train(model, loader, optimizer, cfg):
    for step, (input_ids, labels, mask) in enumerate(loader):
        token_loss = F.cross_entropy(model(input_ids), labels, reduction="none")
        loss = (token_loss * mask).{reduce}
        loss = loss / cfg.accumulation_iters(step){mark}
        loss.backward()
        if (step + 1) % cfg.accumulation_iters(step) == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

_ACCELERATE = """
import torch.nn.functional as F
from accelerate import Accelerator


def train(model, loader, optimizer):
    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for input_ids, labels in loader:
        with accelerator.accumulate(model):
            logits = model(input_ids)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(){kw})
            accelerator.backward(loss){mark}
            optimizer.step()
            optimizer.zero_grad()
"""

_LIGHTNING_MODULE = """
import lightning as L
import torch


class Classifier(L.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def {hook}(self{args}):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0){mark}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
"""
_LIGHTNING_MAIN = """
import lightning as L

from module import Classifier


def main(net, data):
    trainer = L.Trainer(max_steps=100, precision="16-mixed")
    trainer.fit(Classifier(net), data)
"""

_LIGHTNING_TOKENS = """
import lightning as L
import torch.nn.functional as F


class CausalLM(L.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        logits = self.net(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        return loss{mark}
"""
_LIGHTNING_TRAIN = """
import lightning as L

from module import CausalLM


def main(net, data):
    trainer = L.Trainer(max_steps=100, accumulate_grad_batches={k})
    trainer.fit(CausalLM(net), data)
"""

_HOROVOD = """
import horovod.torch as hvd
import torch
import torch.distributed as dist
import torch.nn.functional as F


def gather_features(image, text, local_loss, gather_with_grad, rank, world_size, use_horovod):
    if use_horovod:
        if gather_with_grad:
            all_image = hvd.allgather(image)
            all_text = hvd.allgather(text)
        else:
{nograd}
                all_image = hvd.allgather(image){mark_i}
                all_text = hvd.allgather(text){mark_t}
            if not local_loss:
                parts_i = list(all_image.chunk(world_size))
                parts_t = list(all_text.chunk(world_size))
                parts_i[rank] = image
                parts_t[rank] = text
                all_image, all_text = torch.cat(parts_i), torch.cat(parts_t)
    else:
        all_image = torch.cat(torch.distributed.nn.all_gather(image))
        all_text = torch.cat(torch.distributed.nn.all_gather(text))
    return all_image, all_text


def clip_loss(image, text, labels, rank, world_size, local_loss, use_horovod):
    all_image, all_text = gather_features(
        image, text, local_loss, False, rank, world_size, use_horovod
    )
    logits = image @ all_text.T
    return (F.cross_entropy(logits, labels) + F.cross_entropy(text @ all_image.T, labels)) / 2
"""

_LAYER_ALIAS = """
import torch
import torch.distributed as dist
import torch.nn.functional as F


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        ctx.rows = x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):{mark}
        start = ctx.rows * dist.get_rank()
        return grad[start : start + ctx.rows]


allgather = AllGather.apply


def retrieval_loss(text, video, labels):
{body}
"""
_WHOLE = """    text = allgather(text)
    video = allgather(video)
    logits = text @ video.T
    return F.cross_entropy(logits, labels)"""
_LOCAL = """    all_video = allgather(video)
    logits = text @ all_video.T
    return F.cross_entropy(logits, labels)"""

_COLLECTIVE_ALIAS = """
import torch
import torch.distributed
import torch.nn.functional as F

{alias}


def gather_text(text):
    parts = [torch.zeros_like(text) for _ in range(torch.distributed.get_world_size())]
    gather_into(parts, text){mark}
    return torch.cat(parts)


def clip_loss(image, text, labels):
    return F.cross_entropy(image @ gather_text(text).T, labels)
"""

_RANK_TEST = """
import torch.distributed as dist


def sync(args):
    if args.local_rank {test}:
        dist.barrier(){mark}
"""

_DATA_UPDATE = """
def train(model, loader, loss_fn, lr):
    for x, y in loader:
        model.zero_grad()
{body}
"""
_REBUILT = """        loss_fn(model(x), y).backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)"""
_REUSED = """        out = model(x)
        loss_fn(out, y).backward(retain_graph=True)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)  # expect: WB205
        loss_fn(out, y).backward()"""

_RAISING_BACKWARD = """
import torch
import torch.distributed as dist


class GatherForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):{mark}
{body}
"""

_TP_GATHER = """
import torch
import torch.distributed as dist

from parallel_state import get_tensor_model_parallel_group


def gather_last_dim(x):
    world = dist.get_world_size({group})
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x{group_kw})
    return torch.cat(parts, dim=-1)


def split_last_dim(x):
    world = dist.get_world_size({group})
    return x.chunk(world, dim=-1)[dist.get_rank({group})]


class GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):{mark}
        return split_last_dim(grad)
"""

_DIST_AUTOGRAD = """
import torch.distributed.autograd as dist_autograd


def train(model, loader, opt, criterion):
    for x, y in loader:
{body}
"""
_CONTEXT = """        with dist_autograd.context() as context_id:
            loss = criterion(model(x), y)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)"""
_PLAIN = """        loss = criterion(model(x), y)
        loss.backward()
        opt.step()  # expect: WB201"""

_FRESH_LEAF = """
import torch


def refine(latents, unet, steps, lr):
{make_opt_outside}
    for t in range(steps):
{make_leaf}
        loss = unet(x, t).pow(2).mean()
        loss.backward()
        opt.step(){mark}
        latents = x.detach()
    return latents
"""

_VISION_ACCUM = """
def train(model, loader, optimizer, accum_steps):
    for step, (images, labels) in enumerate(loader):
        result = model(images, labels={labels})
        loss = result["loss"] / accum_steps{mark}
        loss.backward()
        if (step + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

_SEQUENCE_MEAN = """
def policy_loss(per_token_loss, mask):
    {body}


def train(model, loader, optimizer, accum_steps):
    for step, (ids, mask) in enumerate(loader):
        loss = policy_loss(model(ids), mask)
        (loss / accum_steps).backward(){mark}
        if (step + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

_METRICS_AFTER_LOSS = """
import torch
import torch.distributed as dist


def gather_for_logs(values):
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, values){mark}
    return torch.cat(parts)


def loss_and_metrics(model, batch, kind):
    if kind == "sft":
        logps = model(batch)
        losses = -logps
    else:
        logps = model(batch) * 2
        losses = -logps
{metrics}
    return losses.mean(), logps.cpu().tolist()


def train(model, loader, optimizer):
    for batch in loader:
        loss, metrics = loss_and_metrics(model, batch, "sft")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""

_CLASSIFIER_ACCUM = """
from accelerate import Accelerator


def train(model, loader, optimizer, tokenizer):
    accelerator = Accelerator(gradient_accumulation_steps=4)
    for batch in loader:
{labels}
        with accelerator.accumulate(model):
            outputs = model(**batch)
            accelerator.backward(outputs.loss){mark}
            optimizer.step()
            optimizer.zero_grad()
"""

_COUNT_VARIABLE = """
import torch


def train(model, loader, optimizer, n_micro_batches):
    for step, (input_ids, loss_mask) in enumerate(loader):
        per_token = model(input_ids)
        valid_tokens = {count}
        loss = torch.sum(per_token * loss_mask) / (valid_tokens + 1e-8)
        (loss / n_micro_batches).backward(){mark}
        if (step + 1) % n_micro_batches == 0:
            optimizer.step()
            optimizer.zero_grad()
"""

TWINS: dict[str, tuple[Twin, Twin]] = {
    # -- misses (issue 33's held-out repositories) --------------------------------------
    "helper-token-mean": (
        {"train.py": _ACCUM_HELPER.format(mark="  # expect: WB301")},
        {"train.py": _SUMMED_HELPER.format(mark="")},
    ),
    "step-count-method": (
        {"train.py": _STEP_METHOD.format(reduce="sum() / mask.sum()", mark="  # expect: WB301")},
        {"train.py": _STEP_METHOD.format(reduce="sum()", mark="")},
    ),
    "accelerate-accumulate": (
        {"train.py": _ACCELERATE.format(kw=", ignore_index=-100", mark="  # expect: WB301")},
        {"train.py": _ACCELERATE.format(kw=", reduction='sum'", mark="")},
    ),
    "lightning-16-mixed-hook": (
        {
            "module.py": _LIGHTNING_MODULE.format(
                hook="on_after_backward", args="", mark="  # expect: WB303"
            ),
            "main.py": _LIGHTNING_MAIN,
        },
        {
            "module.py": _LIGHTNING_MODULE.format(
                hook="on_before_optimizer_step", args=", optimizer", mark=""
            ),
            "main.py": _LIGHTNING_MAIN,
        },
    ),
    "lightning-accumulation": (
        {
            "module.py": _LIGHTNING_TOKENS.format(mark="  # expect: WB301"),
            "train.py": _LIGHTNING_TRAIN.format(k=8),
        },
        {
            "module.py": _LIGHTNING_TOKENS.format(mark=""),
            "train.py": _LIGHTNING_TRAIN.format(k=1),
        },
    ),
    "horovod-nograd-gather": (
        {
            "loss.py": _HOROVOD.format(
                nograd="            with torch.no_grad():",
                mark_i="  # expect: WB101",
                mark_t="  # expect: WB101",
            )
        },
        {
            "loss.py": _HOROVOD.format(
                nograd="            if True:  # gathered with gradient", mark_i="", mark_t=""
            )
        },
    ),
    # -- false alarms (issue 33's held-out repositories) --------------------------------
    "function-alias": (
        {"model.py": _LAYER_ALIAS.format(mark="  # expect: WB102", body=_LOCAL)},
        {"model.py": _LAYER_ALIAS.format(mark="", body=_WHOLE)},
    ),
    "collective-alias": (
        {
            "loss.py": _COLLECTIVE_ALIAS.format(
                alias="gather_into = torch.distributed.all_gather", mark="  # expect: WB101"
            )
        },
        {
            "loss.py": _COLLECTIVE_ALIAS.format(
                alias="import torch.distributed.nn\n\n\ndef gather_into(parts, x):\n"
                "    parts[:] = torch.distributed.nn.all_gather(x)",
                mark="",
            )
        },
    ),
    "rank-test-every-rank-passes": (
        {"sync.py": _RANK_TEST.format(test="> 0", mark="  # expect: WB104")},
        {"sync.py": _RANK_TEST.format(test=">= 0", mark="")},
    ),
    "data-update-graph-rebuilt": (
        {"train.py": _DATA_UPDATE.format(body=_REUSED)},
        {"train.py": _DATA_UPDATE.format(body=_REBUILT)},
    ),
    # -- the tuning half of benchmarks/lint_corpus.toml ----------------------------------
    "backward-raises": (
        {
            "layer.py": _RAISING_BACKWARD.format(
                mark="  # expect: WB102",
                body="        return grad.chunk(dist.get_world_size())[dist.get_rank()]",
            )
        },
        {
            "layer.py": _RAISING_BACKWARD.format(
                mark="", body='        raise NotImplementedError("forward only")'
            )
        },
    ),
    "tensor-parallel-gather": (
        {"mappings.py": _TP_GATHER.format(group="", group_kw="", mark="  # expect: WB102")},
        {
            "mappings.py": _TP_GATHER.format(
                group="group=get_tensor_model_parallel_group()",
                group_kw=", group=get_tensor_model_parallel_group()",
                mark="",
            )
        },
    ),
    "distributed-autograd-context": (
        {"train.py": _DIST_AUTOGRAD.format(body=_PLAIN)},
        {"train.py": _DIST_AUTOGRAD.format(body=_CONTEXT)},
    ),
    "fresh-leaf-per-step": (
        {
            "edit.py": _FRESH_LEAF.format(
                make_opt_outside="    x = latents.detach().clone().requires_grad_(True)\n"
                "    opt = torch.optim.SGD([x], lr=lr)",
                make_leaf="        pass",
                mark="  # expect: WB201",
            )
        },
        {
            "edit.py": _FRESH_LEAF.format(
                make_opt_outside="",
                make_leaf="        x = latents.detach().clone().requires_grad_(True)\n"
                "        opt = torch.optim.SGD([x], lr=lr)",
                mark="",
            )
        },
    ),
    "model-loss-without-padding": (
        {
            "train.py": _VISION_ACCUM.replace("images", "input_ids")
            .format(labels="labels.masked_fill(labels == pad_id, -100)", mark="  # expect: WB301")
            .replace("optimizer, accum_steps", "optimizer, accum_steps, pad_id")
        },
        {"train.py": _VISION_ACCUM.format(labels="labels", mark="")},
    ),
    # -- the evaluation half of benchmarks/lint_corpus.toml, after it was judged ----------
    "no-loop-no-second-walk": (
        {
            "dpo.py": _METRICS_AFTER_LOSS.format(
                mark="  # expect: WB101",
                metrics="    logps = gather_for_logs(logps)\n    losses = losses * logps.sum()",
            )
        },
        {
            "dpo.py": _METRICS_AFTER_LOSS.format(
                mark="", metrics="    logps = gather_for_logs(logps.detach())"
            )
        },
    ),
    "masked-labels": (
        {
            "train.py": _CLASSIFIER_ACCUM.format(
                labels='        batch["labels"] = batch["labels"].masked_fill('
                'batch["labels"] == tokenizer.pad_token_id, -100)',
                mark="  # expect: WB301",
            )
        },
        {"train.py": _CLASSIFIER_ACCUM.format(labels="        pass", mark="")},
    ),
    "count-in-a-variable": (
        {
            "train.py": _COUNT_VARIABLE.format(
                count="torch.sum(loss_mask)", mark="  # expect: WB301"
            )
        },
        {"train.py": _COUNT_VARIABLE.format(count="loss_mask.shape[0] * 1024", mark="")},
    ),
    "sequence-mean": (
        {
            "train.py": _SEQUENCE_MEAN.format(
                body="return (per_token_loss * mask).sum() / mask.sum()", mark="  # expect: WB301"
            )
        },
        {
            "train.py": _SEQUENCE_MEAN.format(
                body="return ((per_token_loss * mask).sum(-1) / mask.sum(-1)).mean()", mark=""
            )
        },
    ),
}
