"""verify's normalisation reading (issue 22), one process: the spec fields, `normfit`, the cause.

- `VerifySpec(normalize=..., item_losses=...)`: both or neither, a `Normalize`;
- `normfit.read_weights` names each (mode, scope) from its own weights on a ragged
  W = 2 x K = 3 batch whose sequences and groups straddle micro-batches and ranks,
  names nothing for weights that are no mode (scaled by 1/2: the mutation), and
  names the declared mode where two modes coincide;
- `cells_of` + `item_weights`: every item of a cell gets the cell's weight;
- `diagnose` names `normalization-mode` from a reading, with `mismatch_text`'s
  words and the declared mode where the reference measures otherwise; a
  (token, micro_batch) reading is left to `mean-of-means`;
- the reference process's reading (`worker.reference`, in this process): a
  token-mean gradient reads as (token, step) against the sequence reference, and
  a model with fewer parameter entries than cells reads nothing, saying why.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from tests.support import verify_norm_targets as targets
from wholebatch.errors import WholebatchError
from wholebatch.train.normalize import MODES, Normalize, mismatch_text, mode_weights
from wholebatch.verify.diagnose import diagnose
from wholebatch.verify.normfit import cells_of, item_weights, read_weights
from wholebatch.verify.report import Evidence, Fit, NormFit, compare
from wholebatch.verify.spec import TrainerSpec, VerifySpec, load_spec
from wholebatch.verify.worker import Condition, RefRequest, _ref_grads, reference

LENGTHS = [[4, 0, 3], [5, 2, 6]]  # items per micro-batch [rank][micro-batch]: one empty


def _items() -> list[list[dict[str, Tensor]]]:
    """Sequence s = position // 3 over the whole step (straddling micro-batches and ranks)."""
    out, start = [], 0
    for rank in LENGTHS:
        row = []
        for n in rank:
            seq = torch.arange(start, start + n) // 3
            row.append(
                {"mask": torch.ones(n, dtype=torch.bool), "sequence": seq, "group": seq // 2}
            )
            start += n
        out.append(row)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scope", ["step", "micro_batch"])
def test_read_weights_names_each_mode_and_scope(mode: str, scope: str) -> None:
    items = _items()
    constant = 40.0 if mode == "constant" else None
    w = mode_weights(mode, items, constant=constant, scope=scope)  # type: ignore[arg-type]
    assert read_weights(items, w, first=mode, constant=constant) == (mode, scope)  # type: ignore[arg-type]
    halved = [[t / 2 for t in r] for r in w]  # mutation: no mode gives these weights
    assert read_weights(items, halved, first=mode, constant=constant) is None  # type: ignore[arg-type]


def test_read_weights_prefers_the_declared_mode_where_modes_coincide() -> None:
    # every sequence has 3 items and every micro-batch whole sequences: token = sequence
    items = [
        [{"mask": torch.ones(3, dtype=torch.bool), "sequence": torch.full((3,), s)}] for s in (0, 1)
    ]
    w = mode_weights("token", items)
    assert read_weights(items, w, first="sequence", constant=None) == ("sequence", "step")
    assert read_weights(items, w, first="token", constant=None) == ("token", "step")


def test_cells_give_every_item_its_cell_weight() -> None:
    norm = Normalize("sequence", items=targets.items)
    mb = targets.make_batch()
    _, cell_I, n = cells_of(norm, mb, 0)
    assert n == 13  # 13 sequences (rows 5 and 6 are one)
    assert int((cell_I >= 0).sum()) == int(mb["mask"].sum())  # masked items only
    (w_I,) = item_weights([cell_I], [0], [float(c + 1) for c in range(n)])
    seq = mb["seq"].reshape(-1)
    for s in range(13):
        live = mb["mask"].reshape(-1) & (seq == s)
        assert w_I[live].unique().numel() == 1  # one weight per cell
    assert float(w_I[~mb["mask"].reshape(-1)].abs().sum()) == 0.0
    with pytest.raises(WholebatchError, match="no 'sequence' ids"):
        cells_of(Normalize("sequence", items=lambda b: {"mask": b["mask"]}), mb, 2)


def test_spec_takes_normalize_and_item_losses_together() -> None:
    good = targets.grpo_per_micro_batch()
    assert isinstance(good.normalize, Normalize) and good.item_losses is targets.per_token
    common = dict(build_model=targets.TokenScorer, batch=targets.make_batch(), step=lambda *a: None,
                  reference_loss=targets.sequence_mean)  # fmt: skip
    with pytest.raises(WholebatchError, match="normalize is given without item_losses"):
        VerifySpec(**common, normalize=Normalize("token", items=targets.items))  # type: ignore[arg-type]
    with pytest.raises(WholebatchError, match="item_losses is given without normalize"):
        VerifySpec(**common, item_losses=targets.per_token)  # type: ignore[arg-type]
    trainer = TrainerSpec(build_model=targets.TokenScorer, batch=targets.make_batch(),
                          train=lambda run: None, reference_loss=targets.sequence_mean,
                          normalize=Normalize("sequence", items=targets.items),
                          item_losses=targets.per_token)  # fmt: skip
    assert trainer.normalize is not None
    with pytest.raises(WholebatchError, match="TrainerSpec: normalize is given without"):
        TrainerSpec(build_model=targets.TokenScorer, batch=targets.make_batch(),
                    train=lambda run: None, reference_loss=targets.sequence_mean,
                    normalize=Normalize("sequence", items=targets.items))  # fmt: skip
    with pytest.raises(TypeError, match=r"normalize must be a wholebatch\.Normalize"):
        VerifySpec(**common, normalize="sequence", item_losses=targets.per_token)  # type: ignore[arg-type]


def _report(
    found: tuple[str, str] | None, expected: tuple[str, str] | None, declared: str
) -> list[str]:
    net = nn.Linear(2, 1).double()
    ref = {n: torch.ones_like(p) for n, p in net.named_parameters()}
    split = {
        n: torch.linspace(0.5, 1.5, p.numel()).reshape(p.shape) for n, p in net.named_parameters()
    }
    cmp = compare("as given", ref, [split, split], rtol=1e-10, step_calls=[1, 1], world_size=2,
                  micro_batches=3, dropout=False)  # fmt: skip
    norm = NormFit(declared=declared, found=found, expected=expected, cells=5,  # type: ignore[arg-type]
                   split_residual=0.0, reference_residual=0.0)  # fmt: skip
    fit = Fit(ranks=(0, 0, 0, 1, 1, 1), split=(1 / 6,) * 6, reference=(0.1, 0.2, 0.1, 0.2, 0.2, 0.2),
              split_residual=0.0, reference_residual=0.0, counts={}, norm=norm)  # fmt: skip
    ev = Evidence(kind="step", step_calls=(1, 1), changed=((), ()), collectives=({}, {}),
                  reference_zero=False, reference_spread=0.0)  # fmt: skip
    report = diagnose(target="t:f", world_size=2, micro_batches=3, rows=6, wrap="ddp",
                      comparisons=[cmp], evidence=ev, fit=fit)  # fmt: skip
    return [f"{d.code}: {d.message}" for d in report.diagnoses]


def test_the_cause_says_what_was_measured() -> None:
    (grpo,) = _report(("sequence", "micro_batch"), ("sequence", "step"), "sequence")
    text = mismatch_text(("sequence", "micro_batch"), ("sequence", "step"))
    assert grpo.startswith("normalization-mode: ") and text in grpo.lower()
    assert "declares" not in grpo  # the reference measures as declared
    # the reference measures otherwise than declared: the message says both, names the measured
    (other,) = _report(("token", "step"), ("group", "step"), "sequence")
    assert mismatch_text(("token", "step"), ("group", "step")) in other.lower()
    assert "declares normalize mode 'sequence'" in other and "Normalize('group'" in other
    # a per-micro-batch token mean is today's mean-of-means, not the new cause
    codes = [
        d.partition(":")[0] for d in _report(("token", "micro_batch"), ("token", "step"), "token")
    ]
    assert codes == ["mean-of-means"]
    # a reference measured to average sequences is no mean over items: not mean-of-means
    codes = [d.partition(":")[0] for d in _report(None, ("sequence", "step"), "sequence")]
    assert "mean-of-means" not in codes and "normalization-mode" not in codes
    # nothing read (no ids): as without the reading
    codes = [d.partition(":")[0] for d in _report(None, None, "sequence")]
    assert codes == ["mean-of-means"]


def _reference_reading(target: str, split_of: str | None) -> NormFit:
    """The reference process's reading, in this process, fitting `split_of`'s whole-batch gradient."""
    spec = load_spec(f"tests/support/verify_norm_targets.py:{target}")
    pieces = tuple(tuple(c.tolist()) for c in torch.tensor_split(torch.arange(targets.ROWS), 6))
    other = (
        spec if split_of is None else load_spec(f"tests/support/verify_norm_targets.py:{split_of}")
    )
    grads, _ = _ref_grads(other, other.batch, None, 0)
    req = RefRequest(
        target=f"tests/support/verify_norm_targets.py:{target}", condition=Condition(dropout=False),
        probe=False, pieces=pieces, piece_ranks=(0, 0, 0, 1, 1, 1), fit_to=grads,
    )  # fmt: skip
    result = reference(req)
    assert result.fit is not None and result.fit.norm is not None
    return result.fit.norm


def test_reference_reads_each_side_and_says_why_not() -> None:
    # fitted to a token-mean reference's gradient, the step reads as (token, step)
    norm = _reference_reading("grpo_per_micro_batch", "token_per_micro_batch")
    assert (norm.found, norm.expected) == (("token", "step"), ("sequence", "step"))
    assert norm.cells == 14 and not norm.note
    # 4 parameter entries cannot tell 14 cells apart: nothing is named, and the note says why
    tiny = _reference_reading("grpo_tiny_model", None)
    assert tiny.found is None and tiny.expected is None
    assert "too few to tell 14 (micro-batch, sequence, group) cells apart" in tiny.note


def test_item_losses_of_the_wrong_shape_are_said_and_nothing_named() -> None:
    bad = _reference_reading("grpo_flat_item_losses", None)
    assert bad.found is None and bad.expected is None and bad.cells == 0
    assert "item_losses returned (18,) where normalize.items gives a mask of shape (3, 6)" in (
        bad.note
    )
