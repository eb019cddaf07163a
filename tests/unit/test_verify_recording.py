"""verify's instruments, one process: the dropout tape under checkpointing, the precision meter,
the collective watch, the row recorder, and the weights fit of a mean of means."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from wholebatch.verify.fit import lstsq as _lstsq
from wholebatch.verify.precision import PrecisionMeter
from wholebatch.verify.recording import (
    collectives_seen,
    install_tape_dropout,
    is_watched,
    unwatch_collectives,
    watch_collectives,
)
from wholebatch.verify.rows import RowRecorder


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("preserve", [True, False])
def test_checkpoint_recomputation_is_kept_off_the_tape(preserve: bool) -> None:
    torch.manual_seed(0)
    model = Block()
    tapes = install_tape_dropout(model, "record")
    for rows in (3, 2):  # two micro-batches, forward and backward each
        x = torch.randn(rows, 4)
        out = checkpoint(model, x, use_reentrant=False, preserve_rng_state=preserve)
        out.sum().backward()
    tape = tapes["drop"]
    assert [m.shape[0] for m in tape.tape] == [3, 2]  # the first pass: one mask per micro-batch
    assert [m.shape[0] for m in tape.recomputed] == [3, 2]  # the recomputations, apart
    same = all(torch.equal(a, b) for a, b in zip(tape.tape, tape.recomputed, strict=True))
    assert same is preserve  # preserve_rng_state=True redraws the very same masks
    first = tape.first_rows(5)
    assert first is not None and torch.equal(first, torch.cat(tape.tape))


def test_replay_gives_a_recomputation_its_forward_mask() -> None:
    torch.manual_seed(1)
    mask = torch.rand(5, 4) > 0.5
    grads = []
    for recompute in (False, True):
        torch.manual_seed(2)
        model = Block()
        (tape,) = install_tape_dropout(model, "record").values()
        tape.tape, tape.mode = [mask], "replay"
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
        out = checkpoint(model, x, use_reentrant=False) if recompute else model(x)
        out.pow(2).sum().backward()
        grads.append(model.lin.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_off_dropout_reads_p_zero_for_code_that_applies_it_itself() -> None:
    model = Block()
    (tape,) = install_tape_dropout(model, "off").values()
    assert tape.p == 0.0 and tape.rate == 0.5
    x = torch.randn(3, 4)
    assert torch.equal(model(x), torch.tanh(model.lin(x)))


def test_precision_meter_sees_only_differentiable_arithmetic() -> None:
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with PrecisionMeter() as meter:
        counts = torch.ones(3).sum()  # float32 bookkeeping: not counted
        y = (w * 2).sum()
        y.backward()
    assert meter.dtypes == {torch.float64}
    with PrecisionMeter() as meter:
        y = (w.float() * 2).sum() + counts  # a float32 sum inside the model: counted
    assert torch.float32 in meter.dtypes
    with torch.no_grad(), PrecisionMeter() as meter:
        (w.float() @ w.float()).sum()  # no gradient can come of it: not counted
    assert meter.dtypes == set()
    del y


def test_collective_watch_counts_tensors_that_need_gradient_once() -> None:
    watch_collectives()
    watch_collectives()  # idempotent
    if not dist.is_initialized():
        with tempfile.NamedTemporaryFile() as f:
            dist.init_process_group("gloo", store=dist.FileStore(f.name, 1), rank=0, world_size=1)
    try:
        collectives_seen(reset=True)
        x = torch.ones(2, requires_grad=True) * 1
        dist.all_gather([torch.zeros(2)], x)
        with PrecisionMeter():  # a dispatch mode below: still one
            dist.all_gather([torch.zeros(2)], x)
        dist.all_gather([torch.zeros(2)], x.detach())  # no gradient to lose: not counted
        with torch.no_grad():
            dist.all_gather([torch.zeros(2)], x)
        assert collectives_seen(reset=True) == {"torch.distributed.all_gather": 2}
        assert collectives_seen() == {}
    finally:
        dist.destroy_process_group()
        unwatch_collectives()
    assert not is_watched(dist.all_gather)


def test_row_recorder_finds_the_rows_a_forward_saw() -> None:
    batch = {"input_ids": torch.tensor([[1, 2], [3, 4], [1, 2], [5, 6]]), "labels": torch.zeros(4)}
    model = nn.Embedding(8, 2)
    recorder = RowRecorder(model, batch)
    model(torch.tensor([[5, 6], [1, 2]]))
    model(torch.tensor([[1, 2], [3, 4]]))  # a duplicate row maps to its other index
    model(torch.tensor([[7, 7]]))  # not from the batch: not recorded
    model(torch.tensor([[3, 4]]))  # a second pass over a row: not recorded
    recorder.remove()
    model(batch["input_ids"])
    assert recorder.calls == [[3, 0], [2, 1]]


def test_fit_reads_equal_weights_of_a_mean_of_means() -> None:
    # g_j: gradients of each micro-batch's own mean; the whole batch weighs them by items
    g = torch.Generator().manual_seed(0)
    m_PJ = torch.randn(50, 4, generator=g, dtype=torch.float64)
    items = torch.tensor([5.0, 1.0, 3.0, 7.0], dtype=torch.float64)
    whole = m_PJ @ (items / items.sum())
    mean_of_means = m_PJ @ torch.full((4,), 0.25, dtype=torch.float64)
    b, rb, _ = _lstsq(m_PJ, whole)
    a, ra, _ = _lstsq(m_PJ, mean_of_means)
    assert rb < 1e-12 and ra < 1e-12
    assert b == pytest.approx((items / items.sum()).tolist(), rel=1e-10)
    assert a == pytest.approx([0.25] * 4, rel=1e-10)
    _, r, why = _lstsq(m_PJ[:3], whole[:3])  # fewer entries than micro-batches: cannot tell
    assert r == float("inf") and "too few" in why
