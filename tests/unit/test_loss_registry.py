"""The loss registry (`wholebatch.losses.specs.SPECS`) is complete: every spec has what the rest asks of it.

A spec names its function, home module, reference formula, inputs and module
form; the exchange's row is built from its field list; the docs' table is
generated from the specs. Each check here fails for a spec that lacks its part:

- its function is defined in its home module and exported as
  `wholebatch.losses.<function>` (in `__all__`), with the keywords every loss
  shares and `strategy=` defaulting to the spec's default;
- its reference formula exists and, on the example inputs, equals the loss in
  one process (float64);
- the row `losses.call` sends has exactly `specs.exchange_fields(spec)`;
- strategies it does not offer are refused by name;
- docs/contrastive.md's loss table is `specs.docs_table()`, one row per spec;
- no field of `LossSpec` is left unread outside specs.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

import wholebatch.losses
from wholebatch.errors import WholebatchError
from wholebatch.losses import call as call_path, examples
from wholebatch.losses.specs import SPECS, LossSpec, docs_table, exchange_fields

ROOT = Path(__file__).resolve().parents[2]
COMMON = ("group", "mesh", "batch_dims", "grad_reduction", "tile_size", "sizes", "check")


@pytest.mark.parametrize("name", list(SPECS))
def test_function_exported_with_the_shared_keywords(name: str) -> None:
    spec = SPECS[name]
    home = importlib.import_module(spec.home)
    fn = getattr(home, spec.function)
    assert getattr(wholebatch.losses, spec.function) is fn
    assert spec.function in wholebatch.losses.__all__
    params = inspect.signature(fn).parameters
    for keyword in (*COMMON, "strategy"):
        assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY, keyword
    assert params["strategy"].default == spec.default_strategy
    assert [p for p in params][: len(spec.inputs)] == list(spec.inputs)
    for extra in spec.extras:
        assert params[extra].kind is inspect.Parameter.KEYWORD_ONLY, extra
    assert "{common}" not in (fn.__doc__ or "")  # the shared keywords' docs filled in
    if spec.module:
        assert hasattr(importlib.import_module("wholebatch.losses.modules"), spec.module)


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_formula_is_the_loss_on_one_process(name: str) -> None:
    spec = SPECS[name]
    tensors = examples.inputs(spec, [5], 0, extras=spec.extras)
    values = {k: torch.tensor(v, dtype=torch.float64) for k, v in examples.scalars(spec).items()}
    want = examples.reference(spec)(examples.whole(spec, [tensors]), values)
    got = examples.call(spec, tensors, values, tile_size=2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(SPECS))
def test_the_exchange_row_is_the_specs_field_list(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = SPECS[name]
    tensors = examples.inputs(spec, [3], 0)
    first = next(x for x in tensors.values() if x.is_floating_point())
    args = (
        spec, first, examples.scalars(spec), "mean", None, spec.default_strategy,
        [0.0] * len(spec.options), [2] * len(spec.per_rank), None,
    )  # fmt: skip
    assert tuple(call_path._row(*args)) == exchange_fields(spec)
    # a row that drifts from the spec's list (a field added to one only) is refused
    # before anything moves, on the rank that builds it
    monkeypatch.setattr(call_path, "exchange_fields", lambda s: exchange_fields(s)[:-1])
    with pytest.raises(AssertionError, match="the row's fields"):
        call_path._row(*args)


@pytest.mark.parametrize("name", list(SPECS))
def test_strategies_it_does_not_offer_are_refused_by_name(name: str) -> None:
    spec = SPECS[name]
    tensors = examples.inputs(spec, [3], 0)
    values = examples.scalars(spec)
    for strategy in ("gather", "ring", "auto", "bogus"):
        if strategy in spec.offered():
            examples.call(spec, tensors, values, strategy=strategy)
            continue
        want = re.escape(
            f"{spec.function}: strategy={strategy!r} must be one of {list(spec.offered())}"
        )
        with pytest.raises(WholebatchError, match=want):
            examples.call(spec, tensors, values, strategy=strategy)


def test_docs_table_is_generated_from_the_specs() -> None:
    page = (ROOT / "docs" / "contrastive.md").read_text()
    begin, end = "<!-- loss-table:begin -->\n", "\n<!-- loss-table:end -->"
    assert begin in page and end in page, "docs/contrastive.md: the loss table's markers"
    table = page[page.index(begin) + len(begin) : page.index(end)]
    assert table == docs_table(), (
        "regenerate: python -c 'from wholebatch.losses.specs import docs_table; print(docs_table())'"
    )
    rows = [line for line in table.splitlines()[2:]]
    assert [r.split("|")[1].strip() for r in rows] == list(SPECS)


def test_every_spec_field_is_read() -> None:
    # read outside specs.py, or by one of LossSpec's own methods (`self.<field>`)
    sources = [p.read_text() for p in (ROOT / "src" / "wholebatch").rglob("*.py")]
    outside = [s for p, s in zip((ROOT / "src" / "wholebatch").rglob("*.py"), sources,
                                 strict=True) if p.name != "specs.py"]  # fmt: skip
    specs_py = (ROOT / "src" / "wholebatch" / "losses" / "specs.py").read_text()
    fields = [f.name for f in dataclasses.fields(LossSpec)]
    unread = [
        f for f in fields
        if not any(re.search(rf"\.{f}\b", s) for s in outside)
        and not re.search(rf"self\.{f}\b", specs_py)
    ]  # fmt: skip
    assert not unread, f"LossSpec fields nothing reads: {unread}"
