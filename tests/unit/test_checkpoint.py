"""Checkpoints: atomic, complete-or-absent, exact RNG round trip, clear errors on torn files."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from wholebatch import checkpoint
from wholebatch.train.checkpoint import CheckpointError


def _model_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def test_round_trip_restores_everything(tmp_path: Path) -> None:
    model, opt = _model_opt()
    random.seed(5)
    torch.manual_seed(7)
    checkpoint.save(
        tmp_path, 3, model=model, optimizer=opt, data_position={"epoch": 1, "index": 17}
    )
    expected = (torch.rand(4), random.random())
    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = checkpoint.load_latest(tmp_path, model=fresh, optimizer=fresh_opt)
    assert (
        state is not None and state.step == 3 and state.data_position == {"epoch": 1, "index": 17}
    )
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_rng_streams_continue_exactly(tmp_path: Path) -> None:
    model, opt = _model_opt()
    torch.manual_seed(11)
    random.seed(11)
    checkpoint.save(tmp_path, 1, model=model, optimizer=opt)
    after_save = (torch.rand(5), [random.random() for _ in range(3)])
    torch.manual_seed(999)  # anything in between is forgotten by the resume
    random.seed(999)
    checkpoint.load_latest(tmp_path, model=model, optimizer=opt)
    resumed = (torch.rand(5), [random.random() for _ in range(3)])
    assert torch.equal(after_save[0], resumed[0]) and after_save[1] == resumed[1]


def test_truncated_file_is_a_clear_error_and_the_previous_one_loads(tmp_path: Path) -> None:
    model, opt = _model_opt()
    checkpoint.save(tmp_path, 1, model=model, optimizer=opt, data_position=10)
    checkpoint.save(tmp_path, 2, model=model, optimizer=opt, data_position=20)
    torn = tmp_path / "step-00000002" / "rank-0.pt"
    torn.write_bytes(torn.read_bytes()[:100])
    with pytest.raises(
        CheckpointError, match=r"rank-0\.pt is not a readable checkpoint .* truncated or foreign"
    ):
        checkpoint.load(tmp_path / "step-00000002", model=model, optimizer=opt)
    state = checkpoint.load_latest(tmp_path, model=model, optimizer=opt)
    assert state is not None and state.step == 1 and state.data_position == 10


def test_foreign_file_is_a_clear_error(tmp_path: Path) -> None:
    model, _ = _model_opt()
    folder = tmp_path / "step-00000001"
    folder.mkdir()
    torch.save({"weights": torch.zeros(2)}, folder / "rank-0.pt")
    with pytest.raises(CheckpointError, match="is not a wholebatch-checkpoint/1 file"):
        checkpoint.load(folder, model=model)


def test_a_failed_save_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model_opt()
    checkpoint.save(tmp_path, 1, model=model, optimizer=opt)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(
        CheckpointError, match=r"step 2 was not written on every rank.*No space left"
    ):
        checkpoint.save(tmp_path, 2, model=model, optimizer=opt)
    monkeypatch.undo()
    assert not (tmp_path / "step-00000002" / "COMPLETE").exists()
    assert not list((tmp_path / "step-00000002").glob("*.tmp"))
    state = checkpoint.load_latest(tmp_path, model=model, optimizer=opt)
    assert state is not None and state.step == 1


def test_keeps_the_newest(tmp_path: Path) -> None:
    model, opt = _model_opt()
    for step in range(1, 5):
        checkpoint.save(tmp_path, step, model=model, optimizer=opt, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]
    assert checkpoint.load_latest(tmp_path / "nothing-here", model=model) is None


def test_loading_runs_no_pickle_code(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("pickle code ran",))

    folder = tmp_path / "step-00000001"
    folder.mkdir()
    torch.save({"format": "wholebatch-checkpoint/1", "evil": Evil()}, folder / "rank-0.pt")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        checkpoint.load(folder, model=nn.Linear(1, 1))
