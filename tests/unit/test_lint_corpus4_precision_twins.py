"""Bad and good twins of corpus 4's WB102 and WB301 false alarms (issue 33; the tuning
half of benchmarks/lint_corpus4.toml, judged in round 4), written for these tests: each
twin is a small tree of files, linted as a folder; a line ending in `# expect: WBnnn`
must be flagged with that code, and nothing else may be. The lint of 46bfca3 flags the
good twin of every kind:

- `nested-module-call` (WB102): an own-slice AllGather whose only use gathers both
  sides; the loss reads `torch.einsum("acd,a->cd", torch.einsum("ac,ad->acd", za, zb),
  w)`, all gathered. The operand of the outer product is a call of the module `torch`,
  which was read as the variable `torch` (never gathered): a local use. The bad twin's
  inner product pairs the gathered keys with the local queries.
- `imported-alias` (WB102): the layer and `allgather = AllGather.apply` in one file,
  its only use in another (`from models.utils import allgather`) gathering both sides,
  each with the same config argument. The imported name was never counted as a use,
  so no use settled the layer. The bad twin's loss pairs local queries with the
  gathered keys.
- `optional-mask` (WB301): a wrapper's forward writes its `ignore_index` (-100) into
  the labels only under `if exists(lens)`; the loop divides the wrapper's loss by the
  micro-batch count. The good twin's loop never passes `lens` (fixed-size windows,
  `drop_last=True`): nothing is masked, so the mean is over a fixed count. The bad twin
  passes `lens`.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_corpus4_precision_twins.py -q
"""

from __future__ import annotations

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_LAYER = """
import torch
import torch.distributed as dist


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, args):
        output = [torch.empty_like(tensor) for _ in range(args.world_size)]
        dist.all_gather(output, tensor)
        ctx.rank = args.rank
        ctx.batch_size = tensor.shape[0]
        return torch.cat(output, dim=0)

    @staticmethod
    def backward(ctx, grad_output):{mark}
        return grad_output[ctx.batch_size * ctx.rank : ctx.batch_size * (ctx.rank + 1)], None


allgather = AllGather.apply
"""

_NESTED_LOSS = """

def redundancy_loss(za, zb, w, args):
    za = allgather(za, args)
    zb = allgather(zb, args)
    w = allgather(w, args)
    za = (za - za.mean(0)) / za.std(0)
    zb = (zb - zb.mean(0)) / zb.std(0)
    c = torch.einsum("acd,a->cd", {inner}, w) / za.shape[0]
    return torch.diagonal(c).add_(-1).pow_(2).sum()
"""

_ALIAS_LOSS = """
import torch.nn.functional as F

from models.utils import allgather


def contrastive_loss(vision, text, temp, args):
    all_text = allgather(text, args)
    {gather_vision}
    sim = vision @ all_text.T / temp
    labels = torch.arange(sim.shape[0], device=sim.device)
    return F.cross_entropy(sim, labels)
"""

_WRAPPER = """
import torch
import torch.nn.functional as F
from torch import nn


def exists(v):
    return v is not None


class Wrapper(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, lens=None):
        if exists(lens):
            mask = torch.arange(x.shape[1], device=x.device) < lens[:, None]
            x = torch.where(mask, x, -100)
        inp, target = x[:, :-1], x[:, 1:]
        inp = torch.where(inp == -100, 0, inp)
        logits = self.net(inp)
        loss = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100)
        return loss
"""

_TRAIN = """
import torch
from torch.utils.data import DataLoader

from wrapper import Wrapper

ACCUM = 4


def cycle(loader):
    while True:
        yield from loader


model = Wrapper(torch.nn.Linear(8, 256))
loader = cycle(DataLoader(torch.load("windows.pt"), batch_size=4, drop_last=True))
optim = torch.optim.Adam(model.parameters(), lr=1e-4)
for _ in range(1000):
    for __ in range(ACCUM):
        {call}
        (loss / ACCUM).backward(){mark}
    optim.step()
    optim.zero_grad()
"""


def _layer(mark: str) -> str:
    return _LAYER.format(mark=mark)


TWINS: dict[str, tuple[Twin, Twin]] = {
    "nested-module-call": (
        {
            "loss.py": _layer("  # expect: WB102")
            + _NESTED_LOSS.replace("za = allgather(za, args)", "za = za")
            .replace("\n    za = (za - za.mean(0)) / za.std(0)", "")
            .format(inner='torch.einsum("ac,ad->acd", za, zb)')
        },
        {"loss.py": _layer("") + _NESTED_LOSS.format(inner='torch.einsum("ac,ad->acd", za, zb)')},
    ),
    "imported-alias": (
        {
            "models/__init__.py": "",
            "models/utils.py": _layer("  # expect: WB102"),
            "models/loss.py": "import torch\n"
            + _ALIAS_LOSS.format(gather_vision="vision = vision.float()"),
        },
        {
            "models/__init__.py": "",
            "models/utils.py": _layer(""),
            "models/loss.py": "import torch\n"
            + _ALIAS_LOSS.format(gather_vision="vision = allgather(vision, args)"),
        },
    ),
    "optional-mask": (
        {
            "wrapper.py": _WRAPPER,
            "train.py": _TRAIN.format(
                call="x, lens = next(loader)\n        loss = model(x, lens=lens)",
                mark="  # expect: WB301",
            ),
        },
        {
            "wrapper.py": _WRAPPER,
            "train.py": _TRAIN.format(call="loss = model(next(loader))", mark=""),
        },
    ),
}

test_twin_is_judged_as_marked, test_each_kind_has_both = twin_tests(TWINS)
