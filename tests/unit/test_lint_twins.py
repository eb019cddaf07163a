"""The bad and good twins of issue 33 (tests/support/lint_twins.py): each is linted as a
folder, as `wholebatch lint REPO` would, and must give exactly its `# expect:` lines.
`python -m benchmarks.lint_twins --baseline 75b74af` shows that the lint before the
change misjudged at least one twin of every kind.

Plus the framework facts (`wholebatch.lint.frameworks`): each is documented, each is
decided by a twin or a test here, and the run-wide evidence they read.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

from benchmarks.lint_twins import check_twin, write
from tests.support.lint_twins import TWINS
from tests.unit.test_lint_corpus2_twins import TWINS as CORPUS2_TWINS
from tests.unit.test_lint_corpus5_twins import TWINS as CORPUS5_TWINS
from tests.unit.test_lint_corpus6_twins import TWINS as CORPUS6_TWINS
from tests.unit.test_lint_corpus7_twins import TWINS as CORPUS7_TWINS
from tests.unit.test_lint_false_alarm_twins import TWINS as FALSE_ALARM_TWINS
from tests.unit.test_lint_framework_divides_twins import TWINS as DIVIDES_TWINS
from tests.unit.test_lint_local_exit_twins import TWINS as LOCAL_EXIT_TWINS
from tests.unit.test_lint_pinned_trainer_twins import TWINS as PINNED_TWINS
from wholebatch.lint import lint_paths, lint_source
from wholebatch.lint.frameworks import (
    FACTS,
    Evidence,
    hf_compute_loss,
    hf_counting_off,
    masks_labels,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "lint.md"
_CASES = [(kind, side) for kind in TWINS for side in ("bad", "good")]


@pytest.mark.parametrize(("kind", "side"), _CASES, ids=[f"{k}-{s}" for k, s in _CASES])
def test_twin_is_judged_as_marked(tmp_path: Path, kind: str, side: str) -> None:
    bad, good = TWINS[kind]
    check_twin(tmp_path, bad if side == "bad" else good, bad=side == "bad")


def test_each_kind_has_a_bad_twin_that_is_flagged_and_a_good_one_that_is_not() -> None:
    for kind, (bad, good) in TWINS.items():
        marks_bad = sum(text.count("# expect:") for text in bad.values())
        marks_good = sum(text.count("# expect:") for text in good.values())
        assert marks_bad and not marks_good, kind


# Which twin (or test below) decides each framework fact.
_DECIDED_BY = {
    "accelerate-backward": "accelerate-accumulate",
    "deepspeed-backward": "deepspeed-backward",  # tests/unit/test_lint_corpus2_twins.py
    "deepspeed-pipeline-loss": "deepspeed-pipeline-loss",  # the same
    "megatron-schedules-loss": "megatron-schedules-loss",  # the same
    "fairseq-criterion": "fairseq-criterion",  # the same
    "lightning-accumulation": "lightning-accumulation",
    "lightning-after-backward": "lightning-16-mixed-hook",
    "distributed-autograd": "distributed-autograd-context",
    "ddp-no-sync": "test_ddp_decides_at_forward_time",
    "fsdp-no-sync": "fsdp-no-sync",  # tests/unit/test_lint_false_alarm_twins.py
    # tests/unit/test_lint_local_exit_twins.py (and its test_ddp_backward_all_reduces)
    "ddp-backward": "ddp-backward-exit",
    "hf-trainer-compute-loss": "test_hf_trainer_divides_what_compute_loss_returns",
    # tests/unit/test_lint_pinned_trainer_twins.py
    "hf-trainer-before-4-46": "hf-trainer-pinned-before-4-46",
    # tests/unit/test_lint_framework_divides_twins.py
    "mmengine-optim-wrapper": "mmengine-accumulative-counts",
    # tests/unit/test_lint_corpus5_twins.py (and its collator test)
    "trl-sft-trainer": "trl-sft-default-collator",
    # tests/unit/test_lint_corpus6_twins.py (and its test of deepspeed's source)
    "deepspeed-save-checkpoint": "deepspeed-save-checkpoint",
    # tests/unit/test_lint_corpus7_twins.py
    "mmengine-dist-all-gather": "mmengine-gather",
}


def test_every_fact_is_documented_and_decided() -> None:
    text = DOC.read_text()
    section = text.split("## Framework facts", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([a-z0-9-]+)` \|", section, re.MULTILINE))
    assert rows == set(FACTS)
    assert set(_DECIDED_BY) == set(FACTS)
    for name, by in _DECIDED_BY.items():
        twins = (
            TWINS,
            CORPUS2_TWINS,
            FALSE_ALARM_TWINS,
            PINNED_TWINS,
            DIVIDES_TWINS,
            LOCAL_EXIT_TWINS,
            CORPUS5_TWINS,
            CORPUS6_TWINS,
            CORPUS7_TWINS,
        )
        assert any(by in t for t in twins) or by in globals(), name


def test_ddp_decides_at_forward_time() -> None:
    # DDP's fact: the forward inside no_sync() is what skips the all-reduce; a backward
    # after the `with` is fine, a forward before it is not (WB302).
    forward_inside = """
    def micro_step(model, micro, k):
        with model.no_sync():
            loss = model(micro).mean() / k
        loss.backward()
    """
    forward_outside = """
    def micro_step(model, micro, k):
        loss = model(micro).mean() / k
        with model.no_sync():
            loss.backward()
    """
    assert lint_source(textwrap.dedent(forward_inside)) == []
    assert [f.code for f in lint_source(textwrap.dedent(forward_outside))] == ["WB302"]


def test_hf_trainer_divides_what_compute_loss_returns(tmp_path: Path) -> None:
    # HF's fact (transformers 5.23, Trainer.training_step): what an override of
    # `compute_loss` returns is backpropagated once per micro-batch, divided by the steps
    # unless the model was given `num_items_in_batch`; with `model_accepts_loss_kwargs =
    # False` the Trainer's own `compute_loss` gives it none. The twins of
    # tests/unit/test_lint_hf_trainer_twins.py decide it on whole files; here, what the
    # predicates read: the override by its signature, the flag only when set to False.
    src = textwrap.dedent(
        """
        class T(Trainer):
            def __init__(self):
                self.model_accepts_loss_kwargs = False
                self.model_accepts_loss_kwargs = True
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return model(**inputs).loss
            def compute_loss_terms(self, model, inputs):
                return 0
        """
    )
    cls = ast.parse(src).body[0]
    assert isinstance(cls, ast.ClassDef)
    flags = hf_counting_off(cls)
    assert [ast.unparse(f.value) for f in flags] == ["False"]
    methods = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
    assert [hf_compute_loss(f) for f in methods] == [False, True, False]
    # A trainer that is not Hugging Face's (no transformers base) is not this fact.
    plain = src.replace("class T(Trainer):", "class T:").replace(
        "return model(**inputs).loss",
        "mask = inputs['labels'] != -100\n        return (model(**inputs).logits.sum(-1) * mask).sum() / mask.sum()",
    )
    write(tmp_path / "plain", {"t.py": plain})
    assert lint_paths([tmp_path / "plain"])[0] == []
    own = "from transformers import Trainer\n" + plain.replace("class T:", "class T(Trainer):")
    write(tmp_path / "own", {"t.py": own})
    assert [f.code for f in lint_paths([tmp_path / "own"])[0]] == ["WB301"]


def test_evidence_of_the_run() -> None:
    ev = Evidence.of(["trainer = L.Trainer(precision='16-mixed', accumulate_grad_batches=4)"])
    assert ev.fp16 and ev.lightning_accumulates
    ev = Evidence.of(["Trainer(precision='bf16-mixed', accumulate_grad_batches=1)"])
    assert not ev.fp16 and not ev.lightning_accumulates
    assert Evidence.of(['parser.add_argument("--precision", default="16-mixed")']).fp16


def test_masked_labels() -> None:
    assert masks_labels("labels[pad] = -100")
    assert masks_labels("F.cross_entropy(x, y, ignore_index=pad)")
    assert masks_labels("collate = DataCollatorForSeq2Seq(tokenizer)")
    assert not masks_labels("batch['input_ids']")  # tokens, but every one counted
    assert not masks_labels("x = y - 100\nattn.masked_fill(m, float(-100.0))")


def test_a_16_mixed_trainer_elsewhere_in_the_run_decides_the_hook(tmp_path: Path) -> None:
    # The hook alone (no Trainer in the run): the precision is unknown, nothing reported.
    bad, _ = TWINS["lightning-16-mixed-hook"]
    write(tmp_path, {"module.py": bad["module.py"].replace("  # expect: WB303", "")})
    assert lint_paths([tmp_path])[0] == []


@pytest.mark.parametrize("divisor", ["period(cfg)", "cfg.temperature"], ids=["steps", "other"])
def test_mean_and_step_count_from_another_file(tmp_path: Path, divisor: str) -> None:
    # The token mean and the step count both come from functions of another file of
    # the run: `lm_loss` returns a mean over non-ignored tokens, `period` returns the
    # number of accumulation steps (a division by anything else is no WB301).
    write(
        tmp_path,
        {
            "losses.py": """
            import torch.nn.functional as F


            def lm_loss(logits, labels):
                return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


            def period(cfg):
                return cfg.accum_steps
            """,
            "train.py": f"""
            from losses import lm_loss, period


            def train(model, loader, optimizer, cfg):
                for step, (input_ids, labels) in enumerate(loader):
                    loss = lm_loss(model(input_ids), labels)
                    (loss / {divisor}).backward()
                    if (step + 1) % 4 == 0:
                        optimizer.step()
                        optimizer.zero_grad()
            """,
        },
    )
    got = [(Path(f.path).name, f.line, f.code) for f in lint_paths([tmp_path])[0]]
    assert got == ([("train.py", 7, "WB301")] if divisor.startswith("period") else [])
