"""`wholebatch lint` on the shapes real training repositories take (issue 26): each
pattern that was missed or misread on public contrastive, self-supervised and retrieval
code, as a bad twin (flagged where `# expect: WBxxx` marks it) and a good twin (clean,
or flagged where marked) that differs from it in the one thing that matters.

The trees are written to a temporary folder and linted as a folder, as
`wholebatch lint REPO` would; nothing is imported or run.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from wholebatch.lint import lint_paths, lint_source

_EXPECT = re.compile(r"#\s*expect:\s*(WB\d{3})")
_Tree = dict[str, str]


def _write(root: Path, files: _Tree) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip("\n"))


def _marked(root: Path) -> set[tuple[str, int, str]]:
    out: set[tuple[str, int, str]] = set()
    for p in sorted(root.rglob("*.py")):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            for m in _EXPECT.finditer(line):
                out.add((p.relative_to(root).as_posix(), i, m.group(1)))
    return out


def _check(tmp_path: Path, files: _Tree) -> list[str]:
    """Lint the tree; assert the findings are exactly the marked lines; the messages."""
    _write(tmp_path, files)
    findings, _ = lint_paths([tmp_path])
    got = {(Path(f.path).relative_to(tmp_path).as_posix(), f.line, f.code) for f in findings}
    expected = _marked(tmp_path)
    assert got == expected, f"missing {sorted(expected - got)}, unexpected {sorted(got - expected)}"
    return [f.message for f in findings]


def _snippet(text: str) -> tuple[set[tuple[int, str]], set[tuple[int, str]]]:
    source = textwrap.dedent(text).lstrip("\n")
    got = {(f.line, f.code) for f in lint_source(source)}
    expected = {
        (i, m.group(1))
        for i, line in enumerate(source.splitlines(), 1)
        for m in _EXPECT.finditer(line)
    }
    return got, expected


# -- module resolution: the sibling module before a sub-folder's, namespace packages ------

_PLAIN_GATHER = """
import torch
import torch.distributed as dist


def gather_batch(x):
    parts = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x){mark}
    return torch.cat(parts)
"""
_HARMLESS = """
def gather_batch(x):
    return x
"""
_LOSS_SCRIPT = """
import torch.nn.functional as F

import {mod}


def clip_loss(image, text, labels):
    text_all = {mod}.gather_batch(text)
    return F.cross_entropy(image @ text_all.T, labels)
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_a_script_imports_its_sibling_module_not_a_sub_folders(tmp_path: Path, bad: bool) -> None:
    # `import utils` in main.py means ./utils.py (the script's folder comes first on
    # sys.path), even though tools/utils.py (no __init__.py) has the same module name.
    # The good twin: the sibling is harmless and the plain gather sits in tools/utils.py.
    mark = "  # expect: WB101"
    files = {
        "main.py": _LOSS_SCRIPT.format(mod="utils"),
        "utils.py": _PLAIN_GATHER.format(mark=mark) if bad else _HARMLESS,
        "tools/utils.py": _HARMLESS if bad else _PLAIN_GATHER.format(mark=""),
    }
    messages = _check(tmp_path, files)
    assert not bad or "clip_loss" in messages[0]


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_a_namespace_package_is_followed(tmp_path: Path, bad: bool) -> None:
    # `from common import dist_utils` where common/ has no __init__.py.
    files = {
        "train.py": _LOSS_SCRIPT.format(mod="dist_utils").replace(
            "import dist_utils", "from common import dist_utils"
        ),
        "common/dist_utils.py": _PLAIN_GATHER.format(mark="  # expect: WB101" if bad else "")
        if bad
        else _HARMLESS,
    }
    _check(tmp_path, files)


# -- the no-grad exemption: a `@torch.no_grad()` gather helper on trainable features ------

_NOGRAD_HELPER = """
import torch
import torch.distributed as dist
import torch.nn.functional as F


@torch.no_grad()
def concat_all_gather(t):
    parts = [torch.ones_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t){mark}
    return torch.cat(parts)


def info_nce_loss(q, k, labels):
    k = F.normalize(k, dim=1)
    k_all = concat_all_gather(k)
    return F.cross_entropy(q @ k_all.T, labels)


def train_step(model, momentum_model, x1, x2, labels, opt):
    q = model(x1)
{keys}
    loss = info_nce_loss(q, k, labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
_MOMENTUM_KEYS = "    with torch.no_grad():\n        k = momentum_model(x2)"
_TRAINABLE_KEYS = "    k = model(x2)"


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_no_grad_gather_of_trainable_features_is_the_bug(tmp_path: Path, bad: bool) -> None:
    # Bad: the keys come from the trainable encoder, so the no-grad gather drops every
    # gradient they get as keys. Good: momentum keys, computed under no_grad (MoCo).
    text = _NOGRAD_HELPER.format(
        mark="  # expect: WB101" if bad else "",
        keys=_TRAINABLE_KEYS if bad else _MOMENTUM_KEYS,
    )
    messages = _check(tmp_path, {"moco.py": text})
    assert not bad or "info_nce_loss" in messages[0]


def test_no_grad_gather_of_detached_features_is_fine(tmp_path: Path) -> None:
    text = _NOGRAD_HELPER.format(mark="", keys="    k = model(x2).detach()")
    _check(tmp_path, {"moco.py": text})


# -- where the loss is: a model's forward returning an output object or dict ---------------

_MODEL = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def gather_text(x):
    parts = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x){mark}
    return torch.cat(parts)


class Output:
    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


class Model(nn.Module):
    def forward(self, image, text, labels):
        img = self.visual(image)
        txt = self.text(text)
        txt_all = gather_text(txt)
        local = F.cross_entropy(img @ txt.T, labels)
        glob = F.cross_entropy(img @ txt_all.T, labels)
        return {ret}
"""


@pytest.mark.parametrize(
    ("ret", "bad"),
    [
        ('{"loss": glob, "logits": img @ txt.T}', True),
        ("Output(loss=glob, logits=img)", True),
        ('{"loss": local, "global_logits": glob}', False),
        ("Output(loss=local, logits=glob)", False),
        ("Output(loss=float(glob), logits=img)", False),  # a number for logging
    ],
    ids=["dict-bad", "object-bad", "dict-good", "object-good", "number-good"],
)
def test_a_forward_returning_a_loss_field_is_a_loss(tmp_path: Path, ret: str, bad: bool) -> None:
    # Bad: the `loss` field holds the loss of local rows against plain-gathered ones.
    # Good: the same gathered logits only in a field that is not the loss (monitoring).
    text = _MODEL.format(mark="  # expect: WB101" if bad else "", ret=ret)
    _check(tmp_path, {"model.py": text})


# -- accumulation through a method, and fixed-size batches (WB301) --------------------------

_TASK = """
import torch


class Task:
    def train_step(self, model, samples):
        output = model(**samples)
        return output["loss"], {{k: v for k, v in output.items() if "loss" in k}}

    def train_epoch(self, model, loader, optimizer, accum_grad_iters=1):
        for i, samples in enumerate(loader):
            loss, loss_dict = self.train_step(model=model, samples=samples)
            loss /= accum_grad_iters{mark}
            loss.backward()
            if (i + 1) % accum_grad_iters == 0:
                optimizer.step()
                optimizer.zero_grad()
"""
_SUMMED_STEP = """
    def train_step(self, model, samples):
        output = model(samples)
        return output["loss_sum"] / samples["global_tokens"], {}
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_a_mean_loss_returned_by_a_method_and_divided_by_the_steps(
    tmp_path: Path, bad: bool
) -> None:
    # Bad: `self.train_step()` returns the `loss` field of a model given a whole batch
    # (`model(**samples)`: token inputs; LAVIS-style runner, `accum_grad_iters: 2` in its
    # config), divided by the step count. Good: the step returns a summed loss over the
    # global token count. (LAVIS itself calls `model(samples)`, whose inputs the linter
    # cannot read: not reported since issue 33, docs/lint.md "What is not detected".)
    text = _TASK.format(mark="  # expect: WB301" if bad else "")
    if not bad:
        start = text.index("    def train_step")
        end = text.index("    def train_epoch")
        text = text[:start] + _SUMMED_STEP.lstrip("\n") + "\n" + text[end:]
    # The runner masks padded labels (-100): the `loss` field is a mean over a token
    # count that varies (frameworks.masks_labels, read from the runner's own file).
    text += "\n\ndef lm_labels(ids, pad):\n    return ids.masked_fill(ids == pad, -100)\n"
    messages = _check(tmp_path, {"runner.py": text})
    assert not bad or "exact only if every micro-batch has the same item count" in messages[0]


_FIXED_BATCHES = """
import torch
from torch.utils.data import DataLoader


def train(model, criterion, dataset, optimizer, update_freq):
    loader = DataLoader(dataset, batch_size=64, drop_last={drop_last})
    for i, (images, texts) in enumerate(loader):
        loss_dict = criterion(model(images, texts))
        loss = loss_dict["loss"]
        loss /= update_freq{mark}
        loss.backward()
        if (i + 1) % update_freq == 0:
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    ("drop_last", "tokens", "bad"),
    [("False", True, True), ("True", True, True), ("False", False, False), ("True", False, False)],
    ids=["tokens-bad", "fixed-rows-masked-tokens-bad", "rows-good", "fixed-rows-good"],
)
def test_fixed_size_batches_fix_rows_not_masked_tokens(
    tmp_path: Path, drop_last: str, tokens: bool, bad: bool
) -> None:
    # SLIP-style: a `loss` field divided by the steps. A mean over rows (images, issue
    # 33's timm) is exact: every micro-batch has the same rows, with drop_last=True or
    # without it. Token inputs with padded labels masked out (-100) are reported, with
    # the condition under which it would be exact, whatever `drop_last` says: it fixes
    # the rows of a micro-batch, not its unmasked tokens (until corpus 5, the linter
    # took drop_last=True for a fixed token count, a miss: flan-alpaca's Lightning step).
    text = _FIXED_BATCHES.format(drop_last=drop_last, mark="  # expect: WB301" if bad else "")
    if tokens:  # token inputs, with padded labels masked out of the loss
        text = text.replace("(images, texts)", "(images, input_ids)").replace(
            "model(images, texts)", "model(images, input_ids)"
        )
        text += "\n\ndef collate_labels(ids, pad):\n    return ids.masked_fill(ids == pad, -100)\n"
    messages = _check(tmp_path, {"main.py": text})
    assert not bad or "fixed-size batches" in messages[0]


def test_a_data_dependent_count_is_reported_even_with_fixed_size_batches() -> None:
    # ignore_index: the token count varies whatever the batch size.
    got, expected = _snippet(
        """
        import torch
        from torch.utils.data import DataLoader

        def train(model, dataset, optimizer, accum_steps):
            crit = torch.nn.CrossEntropyLoss(ignore_index=-100)
            loader = DataLoader(dataset, batch_size=8, drop_last=True)
            for i, (x, y) in enumerate(loader):
                loss = crit(model(x), y) / accum_steps  # expect: WB301
                loss.backward()
                if (i + 1) % accum_steps == 0:
                    optimizer.step()
                    optimizer.zero_grad()
        """
    )
    assert got == expected


# -- WB105: an early return and a later collective under opposite conditions ----------------

_EVALUATE = """
import torch.distributed as dist


def evaluate(model, data, args):
    use_fsdp = args.fsdp and args.distributed
    is_rank0 = dist.get_rank() == 0
    if not use_fsdp and not is_rank0:
        return {{}}{mark}
    metrics = {{}}
    if {guard}:
        signal = model.signal()
        dist.broadcast(signal, src=0)
    return metrics
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_exit_and_collective_under_opposite_conditions(bad: bool) -> None:
    # Good (open_clip's evaluate): the ranks that return have use_fsdp off, and only
    # use_fsdp on reaches the broadcast: no rank waits. Bad: the broadcast runs when
    # use_fsdp is off too (`args.verbose`), and the returning ranks never join it.
    got, expected = _snippet(
        _EVALUATE.format(
            mark="  # expect: WB105" if bad else "", guard="args.verbose" if bad else "use_fsdp"
        )
    )
    assert got == expected


# -- WB203: the backward runs inside a call of an object (`self.gc(...)`) -------------------

_CACHE = """
class Cache:
    def __init__(self, model, loss_fn):
        self.model, self.loss_fn = model, loss_fn

    def __call__(self, inputs, labels):
        return self.step(inputs, labels)

    def step(self, inputs, labels):
        loss = self.loss_fn(self.model(inputs), labels)
{backward}
        return loss.detach()
"""
_MODULE = """
{imports}

class Module:
    def setup(self, model, loss_fn, optimizer):
        self.cache = Cache(model, loss_fn)
        self.optimizer = optimizer

    def training_step(self, inputs, labels):
        self.optimizer.zero_grad()
        loss = self.cache(inputs, labels)
        self.optimizer.step(){mark}
        return loss
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
@pytest.mark.parametrize("cross", [False, True], ids=["one-file", "two-files"])
def test_a_backward_inside_a_callable_object(tmp_path: Path, bad: bool, cross: bool) -> None:
    # Good (GradCache under Lightning): `self.cache(...)` runs Cache.__call__, which
    # backpropagates. Bad: the same object only computes the loss; nothing backpropagates.
    cache = _CACHE.format(backward="" if bad else "        loss.backward()")
    module = _MODULE.format(
        imports="from cache import Cache" if cross else "", mark="  # expect: WB203" if bad else ""
    )
    files = {"cache.py": cache, "module.py": module} if cross else {"module.py": cache + module}
    _check(tmp_path, files)


# -- WB102: an own-slice GatherLayer under a loss of the whole batch is a uniform 1/W -------

_LAYER = """
import torch
import torch.distributed as dist


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):{mark}
        return grads[dist.get_rank()]
"""
_WHOLE_BATCH_USE = """
def nt_xent(z_i, z_j, temperature):
    z_i = torch.cat(GatherLayer.apply(z_i), dim=0)
    z_j = torch.cat(GatherLayer.apply(z_j), dim=0)
    z = torch.cat((z_i, z_j))
    sim = z @ z.T / temperature
    return sim.logsumexp(dim=1).mean()
"""
_LOCAL_USE = """
def local_info_nce(z, labels):
    all_z = torch.cat(GatherLayer.apply(z), dim=0)
    logits = z @ all_z.T
    return torch.nn.functional.cross_entropy(logits, labels)
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
@pytest.mark.parametrize("cross", [False, True], ids=["one-file", "two-files"])
def test_own_slice_layer_is_judged_by_its_uses(tmp_path: Path, bad: bool, cross: bool) -> None:
    # Good (SimCLR-style NT-Xent): every rank computes the same loss of the whole batch,
    # so its own slice of that loss's gradient is exactly 1/W of the whole, a uniform
    # learning-rate scale (docs/lint.md, WB102). Bad: a loss of this rank's rows against
    # everyone's: the other ranks' terms for this rank's rows are lost.
    layer = _LAYER.format(mark="  # expect: WB102" if bad else "")
    use = _LOCAL_USE if bad else _WHOLE_BATCH_USE
    if cross:
        files = {
            "simclr/__init__.py": "",
            "simclr/gather.py": layer,
            "simclr/loss.py": "import torch\n\nfrom .gather import GatherLayer\n\n" + use,
        }
    else:
        files = {"simclr.py": layer + "\n" + use}
    messages = _check(tmp_path, files)
    assert not (bad and not cross) or "own rows" in messages[0]


def test_own_slice_layer_with_no_visible_use_is_still_reported() -> None:
    got, expected = _snippet(_LAYER.format(mark="  # expect: WB102"))
    assert got == expected


# -- WB202: some parameters' gradients dropped between backward and step --------------------

_CANCEL = """
def train(model, loader, optimizer, loss_fn, freeze_iters):
    for it, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        if it < freeze_iters:
            for name, p in model.named_parameters():
{drop}
        optimizer.step()
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_gradients_cancelled_for_some_parameters_are_not_zeroing(bad: bool) -> None:
    # Good (SwAV): the prototypes are held still for the first iterations, every other
    # parameter steps. Bad: every parameter's gradient is dropped before the step.
    drop = (
        "                p.grad = None  # expect: WB202"
        if bad
        else '                if "prototypes" in name:\n                    p.grad = None'
    )
    got, expected = _snippet(_CANCEL.format(drop=drop))
    assert got == expected


# -- the own slice taken out and put back first: `parts.pop(rank)`, `cat([local, *parts])` --

_POP = """
import torch
import torch.distributed as dist


def gather_others(x):
    rank = dist.get_rank()
    parts = [torch.ones_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x){mark}
{pop}
    return torch.cat(parts)


def pair_loss(emb, labels, loss_fn):
    others = gather_others(emb)
    all_emb = torch.cat([emb, others]) if {pop_flag} else others
    return loss_fn(emb, all_emb) * dist.get_world_size()
"""


@pytest.mark.parametrize("bad", [True, False], ids=["bad", "good"])
def test_own_slice_popped_and_put_back_first(tmp_path: Path, bad: bool) -> None:
    # Good (pytorch-metric-learning's DistributedLossWrapper): the gathered list loses
    # this rank's slice, and the local rows (with their gradient) go in front. Bad: the
    # local rows are compared with a plain gather of everyone's, own slice included.
    text = _POP.format(
        mark="  # expect: WB101" if bad else "",
        pop="" if bad else "    parts.pop(rank)",
        pop_flag="False" if bad else "True",
    )
    _check(tmp_path, {"dist_loss.py": text})


def test_no_grad_gather_used_without_a_similarity_product_is_fine(tmp_path: Path) -> None:
    # BLIP's hard-negative mining: gathered (trainable) outputs only pick indices; no
    # loss pairs this rank's rows with them, so their missing gradient loses nothing.
    text = _NOGRAD_HELPER.format(mark="", keys=_TRAINABLE_KEYS).replace(
        "    k_all = concat_all_gather(k)\n    return F.cross_entropy(q @ k_all.T, labels)",
        "    picked = concat_all_gather(k).argmax(dim=1)\n    return F.cross_entropy(q, picked)",
    )
    assert "argmax" in text
    _check(tmp_path, {"moco.py": text})
