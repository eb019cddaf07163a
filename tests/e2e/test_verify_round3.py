"""`wholebatch verify`, round 3 (issue 25): autocast seen, every cause at once, custom gathers judged.

One command (a subprocess, --json, W = 2 x K = 3) runs the targets of
tests/support/verify_round3.py (models written here) and, where the peers are installed,
tests/support/verify_round3_peers.py (trl 1.16's SFTTrainer, open_clip_train 3.3.0's
train_one_epoch, Lightning 2.6's Trainer). Each assertion names the issue's
point; each target was misjudged by the verify before this change (run with
PYTHONPATH at the tree before it):

1. trl's defaults (bf16 autocast) FAILED at 1.2e-2 as "round-off" (rtol 1e-2);
   a bf16 mean of means (54% error) was named "round-off", its weights unread;
2. open_clip_train's accum_freq loop and its like: only gather-no-grad, worded
   "not a fixed multiple (local_loss=True ...)" for towers at exactly 1/W;
   logit_scale's exact K missed; with dropout, "breaks-unsplit";
3. a GatherLayer keeping the local slice: "uncompensated-mean ... gathered nothing";
4. checkpoint(preserve_rng_state=False) around dropout: no-rng-replay *and*
   mean-of-means;
5. per-micro-batch padding (trl, a loop of our own): no rows matched, no weights,
   a generic cause; rows nobody can match: nothing said.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

from tests.e2e.test_cli import run_cli

OWN = "tests/support/verify_round3.py"
PEERS = "tests/support/verify_round3_peers.py"
HAVE = {m: importlib.util.find_spec(m) is not None for m in ("trl", "lightning", "open_clip")}

EXPECTED: dict[str, list[str] | None] = {
    f"{OWN}:autocast_bf16": None,
    f"{OWN}:autocast_fp16": None,
    f"{OWN}:autocast_bf16_mean_of_means": ["mean-of-means"],
    f"{OWN}:accum_freq_gather": ["replicated-K", "gather-no-grad"],
    f"{OWN}:accum_freq_gather_dropout": ["no-rng-replay", "replicated-K", "gather-no-grad"],
    f"{OWN}:gather_layer_local_slice": ["local-slice-backward"],
    f"{OWN}:gather_layer_summed": None,
    f"{OWN}:checkpoint_no_rng_tokens": ["no-rng-replay"],
    f"{OWN}:padded_mean_of_means": ["mean-of-means"],
    f"{OWN}:unrecognisable_rows": ["breaks-each-way"],
}
if HAVE["trl"]:
    EXPECTED |= {
        f"{PEERS}:sft_defaults": None,
        f"{PEERS}:sft_local_token_average": ["mean-of-means"],
    }
if HAVE["open_clip"]:
    EXPECTED |= {
        f"{PEERS}:open_clip_accum_freq": ["replicated-K", "gather-no-grad"],
        f"{PEERS}:open_clip_accum_freq_dropout": [
            "no-rng-replay", "replicated-K", "gather-no-grad",
        ],
    }  # fmt: skip
if HAVE["lightning"]:
    EXPECTED |= {
        f"{PEERS}:lightning_ragged_mean": ["mean-of-means"],
        f"{PEERS}:lightning_global_count": None,
    }


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    result = run_cli(
        "verify", *EXPECTED, "--nproc", "2", "--micro-batches", "3", "--json", timeout=600
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    return {r["target"]: r for r in json.loads(result.stdout)["results"]}


def _codes(report: dict[str, Any]) -> list[str]:
    return [d["code"] for d in report["diagnoses"]]


@pytest.mark.parametrize("target", list(EXPECTED))
def test_each_target_gets_its_verdict(reports: dict[str, dict[str, Any]], target: str) -> None:
    report, codes = reports[target], EXPECTED[target]
    if codes is None:
        assert report["passed"], (target, report["diagnoses"], report["error"])
    else:
        assert not report["passed"] and _codes(report) == codes, (target, report["diagnoses"])


def _by_code(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["code"]: d for d in report["diagnoses"]}


def test_1_autocast_sets_the_floor_and_a_mistake_under_it_still_fails(
    reports: dict[str, dict[str, Any]],
) -> None:
    for target, dtype in (("autocast_bf16", "bfloat16"), ("autocast_fp16", "float16")):
        floor = reports[f"{OWN}:{target}"]["floor"]
        assert floor["autocast"] == [f"cpu:{dtype}"] and dtype in floor["dtypes"], floor
        assert floor["rtol"] >= 1e-2  # not float32's 1e-5
    bf16 = reports[f"{OWN}:autocast_bf16"]["floor"]
    # the tolerance follows the measured bf16 difference of the reference itself
    assert bf16["rtol"] == pytest.approx(4 * bf16["autocast_measured"], rel=0.05)
    # MUTATION: a mean of means under the same autocast fails, is not called round-off, and
    # its weights are read at the tolerance bf16 allows (1/6 each, the items' shares whole)
    wrong = reports[f"{OWN}:autocast_bf16_mean_of_means"]
    assert wrong["variants"][0]["max_rel_err"] > 10 * wrong["floor"]["rtol"]
    assert "round-off" not in _codes(wrong)
    assert all(abs(a - 1 / 6) < 1e-2 for a in wrong["fit"]["split_weights"])


@pytest.mark.skipif(not HAVE["trl"], reason="needs trl==1.16.0 (the peers extra)")
def test_1_trl_defaults_pass_under_their_own_bf16_autocast(
    reports: dict[str, dict[str, Any]],
) -> None:
    report = reports[f"{PEERS}:sft_defaults"]
    assert report["floor"]["autocast"] == ["cpu:bfloat16"]
    err = report["variants"][0]["max_rel_err"]
    assert 1e-5 < err < report["floor"]["rtol"]  # bf16 round-off, above float32's rule


@pytest.mark.parametrize("target", [f"{OWN}:accum_freq_gather", f"{PEERS}:open_clip_accum_freq"])
def test_2_every_cause_per_group_with_messages_that_match_the_ratios(
    reports: dict[str, dict[str, Any]], target: str
) -> None:
    if target not in reports:
        pytest.skip("needs open_clip (the peers extra)")
    report = reports[target]
    by_code = _by_code(report)
    ratios = {p["name"]: p["ratio"] for p in report["variants"][0]["parameters"]}
    assert by_code["replicated-K"]["parameters"] == ["logit_scale"]
    assert ratios["logit_scale"] == pytest.approx(3.0, rel=1e-9)
    towers = by_code["gather-no-grad"]["parameters"]
    assert len(towers) == 8 and all(ratios[n] == pytest.approx(0.5, rel=1e-9) for n in towers)
    message = by_code["gather-no-grad"]["message"]
    assert "exactly 1/W = 1/2" in message
    assert "not a fixed multiple" not in message and "local_loss=True" not in message


@pytest.mark.parametrize(
    "target", [f"{OWN}:accum_freq_gather_dropout", f"{PEERS}:open_clip_accum_freq_dropout"]
)
def test_2_with_dropout_the_rng_redraw_is_named_beside_both_groups(
    reports: dict[str, dict[str, Any]], target: str
) -> None:
    if target not in reports:
        pytest.skip("needs open_clip (the peers extra)")
    report = reports[target]
    off = next(v for v in report["variants"] if v["variant"] == "dropout off")
    ratios = {p["name"]: p["ratio"] for p in off["parameters"]}
    assert ratios["logit_scale"] == pytest.approx(3.0, rel=1e-9)  # replicated-K exactly
    assert all(report["evidence"]["redrawn_dropout"])  # every rank redrew its masks
    assert "still differs" in report["diagnoses"][0]["message"]


def test_3_a_gather_layer_is_seen_inside_its_function(reports: dict[str, dict[str, Any]]) -> None:
    bad = reports[f"{OWN}:gather_layer_local_slice"]
    assert bad["evidence"]["collectives_without_gradient"] == [{}, {}]
    assert bad["evidence"]["collectives_in_functions"][0] == {
        "LocalSliceGather.forward: torch.distributed.all_gather": 2
    }
    assert "gathered nothing" not in bad["diagnoses"][0]["message"]
    # MUTATION: the same Function with a backward that all-reduces passes
    good = reports[f"{OWN}:gather_layer_summed"]
    assert good["evidence"]["collectives_in_functions"][0] == {
        "SummedGather.forward: torch.distributed.all_gather": 2,
        "SummedGather.backward: torch.distributed.all_reduce": 2,
    }


def test_4_checkpointed_dropout_without_rng_is_not_a_mean_of_means(
    reports: dict[str, dict[str, Any]],
) -> None:
    report = reports[f"{OWN}:checkpoint_no_rng_tokens"]
    by_variant = {v["variant"]: v["passed"] for v in report["variants"]}
    # the dropout-off and equal-items runs both pass: only the dropout differs
    assert by_variant == {
        "as given": False, "dropout off": True, "equal items": True,
        "re-run W=2, K=1": False, "re-run W=1, K=3": False, "re-run W=1, K=1": False,
    }  # fmt: skip
    assert report["evidence"]["redrawn_dropout"] == [["mix.2"], ["mix.2"]]


def test_5_rows_padded_per_micro_batch_are_matched_and_read(
    reports: dict[str, dict[str, Any]],
) -> None:
    targets = [f"{OWN}:padded_mean_of_means"]
    targets += [f"{PEERS}:sft_local_token_average"] if HAVE["trl"] else []
    for target in targets:
        report = reports[target]
        fit = report["fit"]
        assert fit["ranks"] == [0, 0, 0, 1, 1, 1] and fit["split_residual"] < 1e-5
        assert report["evidence"]["rows_note"] == ""
    # the rows matched are the rows each micro-batch held: their token counts are the weights
    own = reports[f"{OWN}:padded_mean_of_means"]
    assert "items per micro-batch by count_items" in own["diagnoses"][0]["message"]
    assert own["notes"] == []  # ragged tokens per micro-batch: normalisation was tested


def test_5_rows_nobody_can_match_are_said_to_be_missing(
    reports: dict[str, dict[str, Any]],
) -> None:
    report = reports[f"{OWN}:unrecognisable_rows"]
    note = report["evidence"]["rows_note"]
    assert "recognised 0 of this rank's 9 rows" in note and "row_key" in note
    assert report["fit"]["note"] == note and note in report["notes"]
    assert "row_key" in report["diagnoses"][0]["message"]


@pytest.mark.skipif(not HAVE["lightning"], reason="needs lightning==2.6.6 (the peers extra)")
def test_lightning_trainer_is_judged_through_a_trainer_spec(
    reports: dict[str, dict[str, Any]],
) -> None:
    good = reports[f"{PEERS}:lightning_global_count"]
    assert good["wrap"] == "trainer" and good["evidence"]["step_calls"] == [1, 1]
    assert good["variants"][0]["max_rel_err"] < 1e-12  # float64: round-off only
    bad = reports[f"{PEERS}:lightning_ragged_mean"]
    assert all(abs(a - 1 / 6) < 1e-9 for a in bad["fit"]["split_weights"])
    assert "items per micro-batch by count_items" in bad["diagnoses"][0]["message"]
