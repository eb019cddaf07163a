"""`wholebatch verify`: the shipped correct steps pass and each classic mistake is named.

One end-to-end run (a subprocess, W = 2 x K = 3, all targets in one command)
checks the first examples in examples/ plus a step that raises; unit tests below
feed `diagnose` synthetic gradients for each pattern, including near misses
that must NOT be diagnosed. tests/e2e/test_verify_causes.py, test_verify_trainer.py
and test_verify_testing.py cover the rest (issue 11).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from tests.e2e.test_cli import ROOT, run_cli
from wholebatch.verify.diagnose import CAUSES, diagnose
from wholebatch.verify.report import Evidence, compare
from wholebatch.verify.spec import VerifySpec, split_batch

EXPECTED = {
    "examples/verify_clip.py:correct": None,
    "examples/verify_tokens.py:correct": None,
    "examples/verify_clip.py:gather_no_grad": "gather-no-grad",
    "examples/verify_clip.py:per_micro_batch_loss": "replicated-K",
    "examples/verify_clip.py:no_rng_replay": "no-rng-replay",
    "examples/verify_tokens.py:mean_of_means": "mean-of-means",
    "tests/e2e/test_verify.py:raising_step": "step-raised",
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
        "verify", *EXPECTED, "--nproc", "2", "--micro-batches", "3", "--json", timeout=300
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
    assert "my step is broken" in got["tests/e2e/test_verify.py:raising_step"]["error"]
    # the dropout example ran its variant, and it is what told the mistake apart
    variants = {
        v["variant"]: v["passed"] for v in got["examples/verify_clip.py:no_rng_replay"]["variants"]
    }
    assert variants["as given"] is False and variants["dropout off"] is True
    # the gather without gradient: localised to the ranks, the collective named
    gather = got["examples/verify_clip.py:gather_no_grad"]
    assert gather["where"].startswith("breaks only across ranks"), gather["where"]
    assert "torch.distributed.all_gather" in gather["diagnoses"][0]["message"]
    assert gather["evidence"]["collectives_without_gradient"][0] == {
        "torch.distributed.all_gather": 2
    }
    # a pass says what its batch could not test: 24 rows cut into 6 chunks of 4
    assert "every micro-batch holds 4 rows" in got["examples/verify_clip.py:correct"]["notes"][0]
    # the logit_scale counted K times: only across micro-batches
    per_mb = got["examples/verify_clip.py:per_micro_batch_loss"]
    assert per_mb["where"].startswith("breaks only across micro-batches"), per_mb["where"]


# -- diagnose on synthetic gradients (no processes) ------------------------------------

REF = {
    "enc.weight": torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64),
    "enc.bias": torch.tensor([0.25, -1.0], dtype=torch.float64),
    "logit_scale": torch.tensor(0.7, dtype=torch.float64),
}


def _report(  # type: ignore[no-untyped-def]
    grads: dict[str, torch.Tensor | None],
    *,
    w: int = 2,
    k: int = 3,
    extra: dict | None = None,  # type: ignore[type-arg]
    calls: tuple[int, int] = (1, 1),
    collectives: dict[str, int] | None = None,
):
    comps = [compare("as given", REF, [grads, grads], rtol=1e-6, step_calls=calls, micro_batches=k)]
    for name, g in (extra or {}).items():
        comps.append(
            compare(name, REF, [g, g], rtol=1e-6, step_calls=[1, 1], micro_batches=k,
                    dropout=False, equal=name.startswith("equal"))
        )  # fmt: skip
    evidence = Evidence(
        kind="step",
        step_calls=calls,
        changed=((), ()),
        collectives=(collectives or {}, collectives or {}),
        reference_zero=False,
        reference_spread=0.0,
    )
    return diagnose(
        target="t", world_size=w, micro_batches=k, rows=8, wrap="ddp", comparisons=comps,
        evidence=evidence,
    )  # fmt: skip


def _codes(report) -> list[str]:  # type: ignore[no-untyped-def]
    return [d.code for d in report.diagnoses]


def test_exact_gradients_pass() -> None:
    report = _report({n: g.clone() for n, g in REF.items()})
    assert report.passed and _codes(report) == []
    assert "PASS" in report.format()


def test_one_over_w_names_its_origin() -> None:
    grads = {n: g / 2 if n != "logit_scale" else g.clone() for n, g in REF.items()}
    gathered = _report(grads, collectives={"torch.distributed.all_gather": 2})
    assert _codes(gathered) == ["gather-no-grad"]
    assert "1/W = 1/2" in gathered.format()
    # no gather seen: DDP's mean not compensated (a loss over the global count without x W)
    assert _codes(_report(grads)) == ["uncompensated-mean"]


def test_a_step_per_micro_batch_fails_even_with_exact_gradients() -> None:
    report = _report({n: g.clone() for n, g in REF.items()}, calls=(3, 3))
    assert not report.passed and _codes(report) == ["optimizer-steps"]
    assert "the gradients match, but the step is not one whole-batch step" in report.format()
    # MUTATION: one call per rank is one step
    assert _report({n: g.clone() for n, g in REF.items()}, calls=(1, 1)).passed
    assert not _report({n: g.clone() for n, g in REF.items()}, calls=(1, 0)).passed


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
    # without re-runs or a fit, the message asks for the equal_batch it lacks
    assert "give the spec an equal_batch" in _report(wrong).diagnoses[0].message


def test_every_code_diagnose_can_name_is_documented() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    source = (ROOT / "src" / "wholebatch" / "verify" / "diagnose.py").read_text()
    named = set(re.findall(r'code="([a-z/1-9-]+)"', source)) | {"step-raised", "step-hung"}
    assert named <= set(CAUSES), named - set(CAUSES)
    missing = [code for code in CAUSES if f"`{code}`" not in text]
    assert not missing, f"docs/cli.md does not list {missing}"


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
