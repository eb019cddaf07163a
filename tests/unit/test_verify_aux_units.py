"""verify's aux-loss fit (issue 35), one process: the readings of `read_aux`, the fit's models, the spec.

- `read_aux`: a right step reads nothing; the whole batch's aux at x != 1 is
  "scaled"; every micro-batch's own aux at one weight is "per-micro-batch";
  other weights are "weights"; a reference that does not add aux_loss once, or a
  fit too ill-conditioned for its round-off, reads nothing (never a guess);
- `lstsq` gives a zero column (a micro-batch without items) weight 0 and reads the rest;
- `fit_weights` with `aux_loss` on a tiny model whose aux term is a batch statistic:
  the three models (whole, per micro-batch, free) each recover the weights they
  were built with, the first two with two micro-batches whose aux gradients coincide;
- `aux_loss` must be callable.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn

from wholebatch.errors import WholebatchTypeError
from wholebatch.verify import VerifySpec
from wholebatch.verify.case import read_aux, read_fit
from wholebatch.verify.fit import fit_weights, lstsq
from wholebatch.verify.report import AuxFit, Fit


def _fit(x: float, y: tuple[float, ...], *, ref_x: float = 1.0, condition: float = 10.0) -> Fit:
    j = len(y)
    return Fit(
        ranks=tuple(range(j)),
        split=(0.5,) * j,
        reference=(0.5,) * j,
        split_residual=1e-15,
        reference_residual=1e-15,
        counts={},
        aux=AuxFit(
            split_whole=x,
            split_parts=y,
            reference_whole=ref_x,
            reference_parts=(0.0,) * j,
            condition=condition,
        ),
    )


def test_read_aux_names_each_reading() -> None:
    assert read_aux(_fit(1.0, (0.0, 0.0))) is None  # right
    scaled = read_aux(_fit(0.5, (0.0, 0.0)))
    assert scaled is not None and (scaled.kind, scaled.whole) == ("scaled", 0.5)
    per = read_aux(_fit(0.0, (0.25, 0.25)))
    assert per is not None and (per.kind, per.part, per.whole) == ("per-micro-batch", 0.25, 0.0)
    mixed = read_aux(_fit(0.0, (0.25, 0.5)))
    assert mixed is not None and mixed.kind == "weights"
    # The main term right: read_fit reads nothing where aux_loss is fitted (it would say
    # "uniform" at 1, a wrong count of factor 1, without it).
    assert read_fit(_fit(0.5, (0.0, 0.0)), 1) is None
    plain = dataclasses.replace(_fit(0.5, (0.0, 0.0)), aux=None)
    assert read_fit(plain, 1) == ("uniform", 1.0)


def test_read_aux_reads_nothing_it_cannot_trust() -> None:
    assert read_aux(_fit(0.5, (0.0, 0.0), ref_x=0.7)) is None  # the reference is not x = 1
    # tolerance 1e-5 x condition 1e5 = 1: the weights are not known to 5%
    assert read_aux(_fit(0.5, (0.0, 0.0), condition=1e5)) is None
    unusable = dataclasses.replace(_fit(0.5, (0.0, 0.0)), split_residual=1e-2)
    assert read_aux(unusable) is None


def test_lstsq_gives_a_zero_column_weight_zero() -> None:
    torch.manual_seed(0)
    m = torch.randn(20, 3, dtype=torch.float64)
    m[:, 1] = 0
    w, r, why = lstsq(m, m @ torch.tensor([2.0, 7.0, -1.0], dtype=torch.float64))
    assert not why and r < 1e-12
    assert w == pytest.approx([2.0, 0.0, -1.0])


class _Tiny(nn.Module):
    """A main term over rows (of z) and a batch statistic (of x): the square of the rows' mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(6, 4, dtype=torch.float64)
        self.b = nn.Linear(5, 3, dtype=torch.float64)


def _main(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return model.a(batch[1]).tanh().sum() / 8  # rows' share of the 8 rows


def _aux(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return model.b(batch[0]).mean(0).square().sum()


def _grads(model: nn.Module, loss: Tensor) -> dict[str, Tensor | None]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["whole", "per-micro-batch", "free"])
def test_fit_recovers_the_weights_of_each_model(kind: str) -> None:
    torch.manual_seed(2)
    x = torch.randn(8, 5, dtype=torch.float64)
    if kind != "free":  # the free model cannot tell two equal columns apart (it says so)
        x[5] = x[4]  # micro-batches 4 and 5 (one row each): the same aux gradient
    batch = (x, torch.randn(8, 6, dtype=torch.float64))
    pieces = [[0, 1], [2, 3], [4], [5], [6, 7]]
    model = _Tiny()
    y = {"whole": [0.0] * 5, "per-micro-batch": [0.2] * 5, "free": [0.1, -0.3, 0.2, 0.2, 0.05]}[
        kind
    ]
    xw = {"whole": 0.5, "per-micro-batch": 0.0, "free": 0.3}[kind]
    split = _main(model, batch) + xw * _aux(model, batch)
    for j, idx in enumerate(pieces):
        split = split + y[j] * _aux(model, (x[idx], batch[1][idx]))
    spec = VerifySpec(
        build_model=_Tiny,
        batch=batch,
        step=lambda *a: None,
        reference_loss=lambda m, b: _main(m, b) + _aux(m, b),
        aux_loss=_aux,
    )
    whole = _grads(model, spec.reference_loss(model, batch))
    fit = fit_weights(spec, batch, pieces, [0] * 5, _grads(model, split), whole, _Tiny, 0)
    assert fit.aux is not None, fit.note
    assert fit.split == pytest.approx(fit.reference, rel=1e-9)  # the main term right
    assert fit.aux.reference_whole == pytest.approx(1.0, rel=1e-9)
    assert fit.aux.split_whole == pytest.approx(xw, abs=1e-9)
    assert list(fit.aux.split_parts) == pytest.approx(y, abs=1e-9)
    reading = read_aux(dataclasses.replace(fit, tolerance=1e-5))
    want = {"whole": "scaled", "per-micro-batch": "per-micro-batch", "free": "weights"}[kind]
    assert reading is not None and reading.kind == want


def test_aux_loss_must_be_callable() -> None:
    with pytest.raises(WholebatchTypeError, match="aux_loss must be callable"):
        VerifySpec(
            build_model=_Tiny,
            batch=torch.zeros(4, 5),
            step=lambda *a: None,
            reference_loss=lambda m, b: b.sum(),
            aux_loss=1.0,  # type: ignore[arg-type]
        )
