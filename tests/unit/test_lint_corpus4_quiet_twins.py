"""Bad and good twins of three false alarms of corpus 4's tuning half (issue 33, round 4),
written for these tests: each twin is a small tree of files, linted as a folder; a line
ending in `# expect: WBnnn` must be flagged with that code, and nothing else may be. The
lint of 46bfca3 flags the good twin of every kind and reports the bad one as it must:

- `last-micro-batch-step` (WB201; simplescaling/s1's gpt-accelera finetune.py:372):
  `model.zero_grad()` opens each pass of the batch loop, and the inner loop over that
  batch's micro-batches backpropagates each and steps in the `else` of `if j + m < n`,
  taken on the last micro-batch only: one step per batch, on gradients zeroed at its
  start. The bad twin steps on every micro-batch: the second step sees the first
  micro-batch's gradients again.
- `loader-field-gather` (WB101; the same folder's `prepare_batch`, finetune.py:449): a
  helper all-gathers its parameters plainly, and the caller gives it fields of a batch
  that a DataLoader yields (token ids, labels, loss weights): data, which needs no
  gradient. The bad twin gives the same helper the model's features.
- `amp-sibling-clip` (WB303; princeton-nlp/MeZO's medium_models/src/trainer.py:761,
  :763): the GradScaler's `unscale_`, its `scale` and its `step` all sit under `if fp16
  and native_amp`; the clips of the `elif fp16` (apex, whose `amp.scale_loss` unscales
  the master gradients as it exits) and of the `else` (no loss scale) never meet the
  scaler's step. The bad twin scales and steps through the scaler on every path while
  the `else` clip skips `unscale_`.

    PYTHONPATH=src .venv/bin/python -m pytest tests/unit/test_lint_corpus4_quiet_twins.py -q
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.lint_twins import twin_tests

Twin = dict[str, str]

_MICRO = """
import torch
import torch.nn.functional as F


def train(model, optimizer, loader, m):
    for batch in loader:
        model.zero_grad()
        x, y = batch["x"], batch["y"]
        n = x.size(0)
        for j in range(0, n, m):
{inner}
"""
_EVERY = """\
            loss = F.mse_loss(model(x[j : j + m]), y[j : j + m])
            loss.backward()
            optimizer.step()  # expect: WB201"""
_LAST = """\
            loss = F.mse_loss(model(x[j : j + m]), y[j : j + m])
            if j + m < n:
                loss.backward()
            else:
                loss.backward()
                optimizer.step()"""

_GATHER = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader


def concat_group(x, group):
    out = torch.empty_like(x).repeat(dist.get_world_size(group), 1)
    dist.all_gather_into_tensor(out, x, group=group){mark}
    return out


def train(model, dataset, optimizer, group):
    loader = DataLoader(dataset, batch_size=8, shuffle=True)
    for it, batch in enumerate(loader):
        optimizer.zero_grad()
        ids = batch["input_ids"].cuda()
        weights = batch["weights"].cuda()
{body}
        loss.backward()
        optimizer.step()
"""
_GATHER_DATA = """\
        ids = concat_group(ids, group)
        weights = concat_group(weights, group)
        logits = model(ids)
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        loss = (nll * weights[:, 1:].flatten()).sum() / weights.sum()"""
_GATHER_FEATS = """\
        feats = model(ids)
        all_feats = concat_group(feats, group)
        loss = -(feats @ all_feats.T).log_softmax(-1).diagonal().mean()"""

_AMP = """
import torch
from apex import amp
from torch.nn.utils import clip_grad_norm_


def train(model, loader, optimizer, args, native_amp):
    scaler = torch.cuda.amp.GradScaler()
    for batch in loader:
        loss = model(batch).mean()
{body}
        optimizer.zero_grad()
"""
_AMP_BRANCHES = """\
        if args.fp16 and native_amp:
            scaler.scale(loss).backward()
        elif args.fp16:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        if args.fp16 and native_amp:
            scaler.unscale_(optimizer)
            clip_grad_norm_(model.parameters(), 1.0)
        elif args.fp16:
            clip_grad_norm_(amp.master_params(optimizer), 1.0)
        else:
            clip_grad_norm_(model.parameters(), 1.0)
        if args.fp16 and native_amp:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()"""
_AMP_ALWAYS = """\
        scaler.scale(loss).backward()
        if args.fp16 and native_amp:
            scaler.unscale_(optimizer)
            clip_grad_norm_(model.parameters(), 1.0)
        else:
            clip_grad_norm_(model.parameters(), 1.0)  # expect: WB303
        scaler.step(optimizer)
        scaler.update()"""

TWINS: dict[str, tuple[Twin, Twin]] = {
    "last-micro-batch-step": (
        {"train.py": _MICRO.format(inner=_EVERY)},
        {"train.py": _MICRO.format(inner=_LAST)},
    ),
    "loader-field-gather": (
        {"train.py": _GATHER.format(mark="  # expect: WB101", body=_GATHER_FEATS)},
        {"train.py": _GATHER.format(mark="", body=_GATHER_DATA)},
    ),
    "amp-sibling-clip": (
        {"train.py": _AMP.format(body=_AMP_ALWAYS)},
        {"train.py": _AMP.format(body=_AMP_BRANCHES)},
    ),
}
test_twin_is_judged_as_marked, test_each_kind_has_a_bad_and_a_good_twin = twin_tests(TWINS)


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of 6 rows (float64: exact sums of a few products), targets differing
    per row."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(6, 3, dtype=torch.float64, generator=gen), torch.arange(6.0).double()


def _grads_at_steps(step_every_micro_batch: bool) -> list[torch.Tensor]:
    """The gradient each `optimizer.step()` sees in `last-micro-batch-step`'s loops over
    two batches of `_rows()` in micro-batches of 2 (the step itself left out: the weights
    stay put, so every batch's gradient is the same)."""
    x, y = _rows()
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    seen: list[torch.Tensor] = []
    for _ in range(2):
        w.grad = None  # model.zero_grad() at the top of the batch loop
        for j in range(0, 6, 2):
            ((x[j : j + 2] @ w - y[j : j + 2]) ** 2).sum().backward()
            if step_every_micro_batch or j + 2 >= 6:
                assert w.grad is not None
                seen.append(w.grad.clone())
    return seen


def test_zeroing_the_outer_pass_clears_every_last_micro_batch_step() -> None:
    """The fact behind `last-micro-batch-step`: a step on the last micro-batch sees the
    whole batch's gradient, every batch alike; stepping on every micro-batch (the bad
    twin, the mutation) gives later steps the earlier micro-batches' gradients again."""
    x, y = _rows()
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    ((x @ w - y) ** 2).sum().backward()
    assert w.grad is not None
    once = _grads_at_steps(step_every_micro_batch=False)
    assert len(once) == 2
    for g in once:
        torch.testing.assert_close(g, w.grad, rtol=0, atol=1e-12)  # round-off of 6 terms
    every = _grads_at_steps(step_every_micro_batch=True)
    assert len(every) == 6
    v = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    ((x[2:4] @ v - y[2:4]) ** 2).sum().backward()
    assert v.grad is not None
    # the second step sees the first micro-batch's gradient again beside its own
    assert not torch.allclose(every[1], v.grad)
    torch.testing.assert_close(every[1], every[0] + v.grad, rtol=0, atol=1e-12)


def test_loader_batches_hold_no_autograd_history() -> None:
    """The fact behind `loader-field-gather`: what a DataLoader yields from a dataset of
    data (token ids, loss weights) is leaves with no gradient, integer or float; a
    plain all_gather of it loses nothing. The mutation: a model's output does carry one."""
    ids = torch.arange(12).view(6, 2)
    weights = torch.rand(6, 2)
    batch_ids, batch_weights = next(iter(DataLoader(TensorDataset(ids, weights), batch_size=3)))
    for t in (batch_ids, batch_weights):
        assert t.grad_fn is None and not t.requires_grad
    model = torch.nn.Linear(2, 2)
    assert model(batch_weights).requires_grad
