"""Bad and good twins of three false alarms and one miss of corpus 3 (issue 33, round 4),
written for these tests: each twin is a small tree of files, linted as a folder; a line
ending in `# expect: WBnnn` must be flagged with that code, and nothing else may be. The
lint of 46bfca3 misjudges one twin of every kind:

- `frozen-encoder-gather` (WB101; LLaMA2-Accessory's Large-DiT-T2I/train.py:504): a
  frozen text encoder's features, computed under `torch.no_grad()`, all-gathered over
  the model-parallel group and fed to the trained model as conditioning: no gradient
  path, nothing lost (`data.DATA_TAGS`, tag ``Z``). The bad twin computes them with
  gradients on (under `autocast`), so the other ranks' terms lose theirs.
- `detached-gather` (WB101): the same gather of `feats.detach()`.
- `leader-callback` (WB104; LLaMA2-Accessory's accessory/demos/single_turn.py:164): rank
  0 serves requests whose handler (`on_request(fn=generate)`) makes the barrier and the
  broadcast that the other ranks' worker loop waits for, in the same order. The bad
  twin's handler leaves out the barrier.
- `exit-between-halves` (WB105; Semi-supervised-learning's algorithmbase.py:120): a
  `return` under a condition the same on every rank, between the halves of a main-
  process-first barrier pair; the good twin makes rank 0's half before leaving.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_quiet_twins.py -q
"""

from __future__ import annotations

import torch

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

# W world size of the model-parallel group, B local rows, L tokens, D dim, N = W * B.
_CONDITIONING = """
import torch
import torch.distributed as dist


def train_step(model, text_encoder, x, caps, opt, group):
    {context}
        cap_BLD = text_encoder(caps)
    W = dist.get_world_size(group)
    local_BLD = {local}
    cap_WBLD = torch.zeros([W, *local_BLD.size()], dtype=local_BLD.dtype)
    dist.all_gather_into_tensor(cap_WBLD, local_BLD, group=group){mark}
    cap_NLD = cap_WBLD.flatten(0, 1)
    loss = model(x, cap_NLD).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

_SERVER = """
import torch.distributed as dist

from engine import make_app, run_model


def generate(prompt, max_len):
{leader}    dist.broadcast_object_list([prompt, max_len])
    return run_model(prompt, max_len)


def serve():
    app = make_app()
    app.on_request(fn=generate)
    app.launch()


def worker():
    while True:
        dist.barrier()
        args = [None, None]
        dist.broadcast_object_list(args)
        run_model(*args)


if dist.get_rank() == 0:
    serve()
else:
    worker(){mark}
"""

_MAIN_FIRST = """
import torch.distributed as dist

from data import build_dataset


class Trainer:
    def set_dataset(self):
        if self.rank != 0 and self.distributed:
            dist.barrier()
        data = build_dataset(self.args)
        if data is None:
{leave}            return None{mark}
        self.size = len(data)
        if self.rank == 0 and self.distributed:
            dist.barrier()
        return data
"""

TWINS: dict[str, tuple[Twin, Twin]] = {
    "frozen-encoder-gather": (
        {
            "train.py": _CONDITIONING.format(
                context="with torch.autocast('cpu'):", local="cap_BLD", mark="  # expect: WB101"
            )
        },
        {
            "train.py": _CONDITIONING.format(
                context="with torch.no_grad():", local="cap_BLD", mark=""
            )
        },
    ),
    "detached-gather": (
        {
            "train.py": _CONDITIONING.format(
                context="with torch.autocast('cpu'):", local="cap_BLD", mark="  # expect: WB101"
            )
        },
        {
            "train.py": _CONDITIONING.format(
                context="with torch.autocast('cpu'):", local="cap_BLD.detach()", mark=""
            )
        },
    ),
    "leader-callback": (
        {"demo.py": _SERVER.format(leader="", mark="  # expect: WB104")},
        {"demo.py": _SERVER.format(leader="    dist.barrier()\n", mark="")},
    ),
    "exit-between-halves": (
        {"trainer.py": _MAIN_FIRST.format(leave="", mark="  # expect: WB105")},
        {
            "trainer.py": _MAIN_FIRST.format(
                leave="            if self.rank == 0 and self.distributed:\n"
                "                dist.barrier()\n",
                mark="",
            )
        },
    ),
}

test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)


def test_no_grad_and_detach_leave_no_gradient_path() -> None:
    # What tag ``Z`` rests on (torch 2.13): a value computed under no_grad, or detached,
    # has no autograd history, so nothing downstream of it (a gather included) can carry
    # a gradient back to the parameters that made it.
    encoder = torch.nn.Linear(4, 4)
    with torch.no_grad():
        frozen = encoder(torch.ones(2, 4))
    detached = encoder(torch.ones(2, 4)).detach()
    for value in (frozen, detached):
        assert not value.requires_grad and value.grad_fn is None
    assert encoder(torch.ones(2, 4)).requires_grad
