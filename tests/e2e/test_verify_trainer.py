"""Verifying trainers that own the split: the HF Trainer (transformers 5.23) and Accelerate loops (issue 11, 7-8).

One command (W = 2 x K = 3, --json) runs examples/verify_hf.py's targets (named
through this module) and the fixed Trainer below, on models built from tiny
configs in float64:

- the stock Trainer on GPT2LMHeadModel (loss_type None) counts labels before the
  causal shift: every gradient is (predicted tokens)/(labels) = 107/131 of the
  whole-batch gradient on this ragged batch of 24 rows; verify names the counts;
- the same Trainer fixed by wholebatch's integration (`WholeBatchTrainer`, the
  model's own loss) passes at the floor of the model's float32 loss, and a
  float64 `compute_loss_func` through it passes at float64 round-off: the
  mechanism accepts a right trainer, it does not just reject trainers;
- an Accelerate loop done right passes, the usual one (`model(**batch).loss` per
  micro-batch) is a mean of means, found from the rows the trainer fed the model;
- an Accumulator on a float64 Llama (RMSNorm in float32) passes at the
  tolerance its dtypes imply, and held to 1e-10 fails worded as round-off.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
import torch.nn.functional as F
from transformers import Trainer

from tests.e2e.test_cli import ROOT, run_cli
from wholebatch.verify.spec import TrainerRun, TrainerSpec


def _load_examples() -> Any:
    path = ROOT / "examples" / "verify_hf.py"
    spec = importlib.util.spec_from_file_location("_verify_hf_examples", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hf = _load_examples()


def fixed_trainer_class() -> type[Trainer]:
    """The HF Trainer fixed by wholebatch's integration (`wholebatch.integrations.huggingface`)."""
    from wholebatch.integrations.huggingface import WholeBatchTrainer

    return WholeBatchTrainer


def _shifted_loss(
    outputs: Any, labels: torch.Tensor, num_items_in_batch: torch.Tensor
) -> torch.Tensor:
    logits = outputs.logits
    ce = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )
    return ce / num_items_in_batch


def fixed_gpt2_trainer() -> TrainerSpec:
    """The GPT-2 Trainer target of examples/verify_hf.py with the fixed Trainer."""

    def train(run: TrainerRun) -> None:
        trainer = fixed_trainer_class()(
            model=run.model, args=hf.trainer_args(run), train_dataset=run.dataset,
            optimizers=(run.optimizer, None), compute_loss_func=_shifted_loss,
        )  # fmt: skip
        trainer.train()

    return TrainerSpec(
        build_model=hf.gpt2, batch=hf.lm_batch(), train=train, reference_loss=hf.lm_reference
    )


# The examples' targets, named through this module so that one process imports
# transformers once for all of them (each TARGET module is imported in its own process).
gpt2_trainer = hf.gpt2_trainer
gpt2_wholebatch_trainer = hf.gpt2_wholebatch_trainer
gpt2_accelerate = hf.gpt2_accelerate
gpt2_accelerate_mean = hf.gpt2_accelerate_mean
llama_accumulator = hf.llama_accumulator
llama_accumulator_strict = hf.llama_accumulator_strict

EX = str(Path(__file__).relative_to(ROOT))
HERE = f"{EX}:fixed_gpt2_trainer"
EXPECTED: dict[str, str | None] = {
    f"{EX}:gpt2_trainer": "wrong-count",
    f"{EX}:gpt2_wholebatch_trainer": None,
    HERE: None,
    f"{EX}:gpt2_accelerate": None,
    f"{EX}:gpt2_accelerate_mean": "mean-of-means",
    f"{EX}:llama_accumulator": None,
    f"{EX}:llama_accumulator_strict": "round-off",
}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    result = run_cli(
        "verify", *EXPECTED, "--nproc", "2", "--micro-batches", "3", "--json", timeout=400
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    return {r["target"]: r for r in json.loads(result.stdout)["results"]}


@pytest.mark.parametrize("target", list(EXPECTED))
def test_each_trainer_gets_its_verdict(reports: dict[str, dict[str, Any]], target: str) -> None:
    report, code = reports[target], EXPECTED[target]
    if code is None:
        assert report["passed"], (target, report["diagnoses"], report["error"])
    else:
        assert not report["passed"]
        assert next(d["code"] for d in report["diagnoses"]) == code, (target, report["diagnoses"])


def test_8_the_hf_trainer_miscount_is_caught_with_its_numbers(
    reports: dict[str, dict[str, Any]],
) -> None:
    report = reports[f"{EX}:gpt2_trainer"]
    assert report["wrap"] == "trainer" and report["evidence"]["step_calls"] == [1, 1]
    counts = report["evidence"]["item_counts"]
    labels, predicted = counts["labels != -100"], counts["labels[..., 1:] != -100"]
    assert labels - predicted == 24  # one label per row is never predicted
    for p in report["variants"][0]["parameters"]:
        assert p["ratio"] == pytest.approx(predicted / labels, rel=1e-6), p
    message = report["diagnoses"][0]["message"]
    assert f"divides by {labels} items (labels != -100)" in message
    assert f"averages over {predicted} (labels[..., 1:] != -100)" in message
    assert report["where"].startswith("differs even unsplit")  # the count is wrong at W=K=1 too


def test_8_the_fixed_trainer_passes_at_float64_round_off(
    reports: dict[str, dict[str, Any]],
) -> None:
    report = reports[HERE]
    assert report["evidence"]["step_calls"] == [1, 1]
    assert report["variants"][0]["max_rel_err"] < 1e-12


def test_8_accelerate_mean_of_means_is_found_from_the_rows_it_fed(
    reports: dict[str, dict[str, Any]],
) -> None:
    report = reports[f"{EX}:gpt2_accelerate_mean"]
    fit = report["fit"]
    assert fit["ranks"] == [0, 0, 0, 1, 1, 1]  # K micro-batches per rank, recorded
    assert all(abs(a - 1 / 6) < 1e-5 for a in fit["split_weights"])
    # the model's own loss runs in float32: the tolerance follows (and W=K=1 passes)
    assert report["floor"]["rtol"] == 1e-5 and "float32" in report["floor"]["dtypes"]
    by_split = {(v["world_size"], v["micro_batches"]): v["passed"] for v in report["variants"]}
    assert by_split[(1, 1)] and not by_split[(2, 1)] and not by_split[(1, 3)]


def test_7_float32_norms_in_a_float64_llama_are_round_off_not_a_mistake(
    reports: dict[str, dict[str, Any]],
) -> None:
    auto = reports[f"{EX}:llama_accumulator"]
    assert auto["floor"]["rtol"] == 1e-5 and auto["floor"]["dtypes"] == ["float32", "float64"]
    strict = reports[f"{EX}:llama_accumulator_strict"]
    assert strict["floor"]["rtol"] == 1e-10 and strict["floor"]["rtol_from"] == "from the spec"
    err = strict["variants"][0]["max_rel_err"]
    assert 1e-10 < err < 100 * strict["floor"]["unit_roundoff"]
    assert [d["code"] for d in strict["diagnoses"]] == ["round-off"]
    assert "not a split mistake" in strict["diagnoses"][0]["message"]
