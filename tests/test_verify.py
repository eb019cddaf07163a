"""`wholebatch verify`: the shipped correct steps pass and each classic mistake is named.

One end-to-end run (a subprocess, one launch of 2 gloo ranks for all targets)
checks every example in examples/ plus a step that raises; unit tests below
feed `diagnose` synthetic gradients for each pattern, including near misses
that must NOT be diagnosed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.test_cli import ROOT, run_cli
from wholebatch.verify.diagnose import compare, diagnose
from wholebatch.verify.runner import VerifySpec, split_batch

EXPECTED = {
    "examples/verify_clip.py:correct": None,
    "examples/verify_tokens.py:correct": None,
    "examples/verify_clip.py:gather_no_grad": "scaled-1/W",
    "examples/verify_clip.py:per_micro_batch_loss": "replicated-K",
    "examples/verify_clip.py:no_rng_replay": "no-rng-replay",
    "examples/verify_tokens.py:mean_of_means": "mean-of-means",
    "tests/test_verify.py:raising_step": "step-raised",
}


def raising_step() -> VerifySpec:
    """A verify target whose step raises on every rank (reported, not a crash)."""

    def step(
        model: torch.nn.Module, optimizer: torch.optim.Optimizer, mbs: list[torch.Tensor]
    ) -> None:
        raise RuntimeError("my step is broken")

    return VerifySpec(
        build_model=lambda: torch.nn.Linear(2, 1),
        batch=torch.ones(8, 2),
        step=step,
        reference_loss=lambda model, batch: model(batch).sum(),
    )


def test_verify_diagnoses_every_shipped_mistake() -> None:
    result = run_cli(
        "verify", *EXPECTED, "--nproc", "2", "--micro-batches", "3", "--json", timeout=240
    )
    assert result.returncode == 1, result.stderr
    doc = json.loads(result.stdout)
    assert doc["passed"] is False
    got = {r["target"]: r for r in doc["results"]}
    assert list(got) == list(EXPECTED)
    for target, code in EXPECTED.items():
        report = got[target]
        codes = [d["code"] for d in report["diagnoses"]]
        if code is None:
            assert report["passed"], (target, report)
            worst = max(p["max_rel_err"] for p in report["variants"][0]["parameters"])
            assert worst < 1e-12  # float64 models: round-off only
        else:
            assert not report["passed"]
            assert codes[0] == code, (target, codes)
    assert "my step is broken" in got["tests/test_verify.py:raising_step"]["error"]
    # the dropout example ran its variant, and it is what told the mistake apart
    variants = {
        v["variant"]: v["passed"] for v in got["examples/verify_clip.py:no_rng_replay"]["variants"]
    }
    assert variants == {"as given": False, "dropout off": True}


def test_verify_table_on_a_passing_target_exits_0() -> None:
    result = run_cli(
        "verify",
        "examples/verify_tokens.py:correct",
        "--nproc",
        "3",
        "--micro-batches",
        "2",
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    assert "emb.weight" in result.stdout and "max rel err" in result.stdout


# -- diagnose on synthetic gradients (no processes) ------------------------------------

REF = {
    "enc.weight": torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64),
    "enc.bias": torch.tensor([0.25, -1.0], dtype=torch.float64),
    "logit_scale": torch.tensor(0.7, dtype=torch.float64),
}


def _report(grads: dict[str, torch.Tensor], *, w: int = 2, k: int = 3, extra: dict | None = None):  # type: ignore[no-untyped-def,type-arg]
    comps = [compare("as given", REF, [grads, grads], rtol=1e-6, step_calls=[1, 1])]
    for name, g in (extra or {}).items():
        comps.append(compare(name, REF, [g, g], rtol=1e-6, step_calls=[1, 1]))
    return diagnose(
        target="t", world_size=w, micro_batches=k, rows=8, wrap="ddp", comparisons=comps
    )


def _codes(report) -> list[str]:  # type: ignore[no-untyped-def]
    return [d.code for d in report.diagnoses]


def test_exact_gradients_pass() -> None:
    report = _report({n: g.clone() for n, g in REF.items()})
    assert report.passed and _codes(report) == []
    assert "PASS" in report.format()


def test_encoders_at_one_over_w() -> None:
    grads = {n: g / 2 if n != "logit_scale" else g.clone() for n, g in REF.items()}
    report = _report(grads)
    assert _codes(report) == ["scaled-1/W"]
    assert "1/W = 1/2" in report.format()


def test_scalar_at_k_times() -> None:
    grads = {n: g * 3 if n == "logit_scale" else g.clone() for n, g in REF.items()}
    assert _codes(_report(grads, k=3)) == ["replicated-K"]


def test_near_misses_are_not_named() -> None:
    # MUTATION of the pattern: encoders at 1/W but one entry off -> not "exactly 1/W".
    grads = {n: g / 2 for n, g in REF.items()}
    grads["enc.weight"] = grads["enc.weight"].clone()
    grads["enc.weight"][0, 0] += 0.3
    assert "scaled-1/W" not in _codes(_report(grads))
    # a scalar at K times AND a wrong encoder is not "only the replicated scalar"
    grads = {n: g * 3 for n, g in REF.items()}
    assert _codes(_report(grads, w=4, k=3)) != ["replicated-K"]


def test_variants_name_rng_replay_and_mean_of_means() -> None:
    wrong = {n: g * 1.1 + 0.01 for n, g in REF.items()}
    exact = {n: g.clone() for n, g in REF.items()}
    assert _codes(_report(wrong, extra={"dropout off": exact})) == ["no-rng-replay"]
    assert _codes(_report(wrong, extra={"equal items, dropout off": exact})) == ["mean-of-means"]
    assert _codes(_report(wrong, extra={"equal items, dropout off": wrong})) == ["unknown"]


def test_missing_gradient_and_json() -> None:
    grads: dict[str, torch.Tensor | None] = {n: g.clone() for n, g in REF.items()}
    grads["enc.bias"] = None
    report = _report(grads)  # type: ignore[arg-type]
    assert not report.passed
    doc = report.to_json()
    bias = next(p for p in doc["variants"][0]["parameters"] if p["name"] == "enc.bias")
    assert bias["missing"] and not bias["passed"]
    json.dumps(doc)  # NaN-free, serialisable


def test_split_batch_keeps_rows_in_order_and_uneven() -> None:
    batch = {"x": torch.arange(7), "y": (torch.arange(7) * 10, torch.zeros(7))}
    parts = split_batch(batch, 3)
    assert [len(p["x"]) for p in parts] == [3, 2, 2]
    assert torch.cat([p["x"] for p in parts]).tolist() == list(range(7))
    assert torch.cat([p["y"][0] for p in parts]).tolist() == [10 * i for i in range(7)]


def test_spec_rejects_bad_fields() -> None:
    with pytest.raises(TypeError, match="build_model must be callable"):
        VerifySpec(build_model=3, batch=torch.ones(2), step=print, reference_loss=print)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="different row counts"):
        VerifySpec(
            build_model=print,
            batch=(torch.ones(2), torch.ones(3)),
            step=print,
            reference_loss=print,
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wrap='fsdp'"):
        VerifySpec(
            build_model=print, batch=torch.ones(2), step=print, reference_loss=print, wrap="fsdp"
        )  # type: ignore[arg-type]
    assert math.isfinite(1.0) and ROOT.is_dir()
