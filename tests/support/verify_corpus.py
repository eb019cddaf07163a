"""The corpus `wholebatch verify` is judged on (issue 32): 59 targets over 13 trainers and loop kinds.

    PYTHONPATH=src:. python -m benchmarks.verify_corpus --half tuning
    PYTHONPATH=src:. python -m benchmarks.verify_corpus --half evaluation   # once, at the end

THE SPLIT (fixed before any verdict was looked at): a target belongs to the
tuning half when the sha256 of its name (the `Entry.name` below, UTF-8) is an
even number, to the evaluation half when it is odd (`half_of`). verify was
tuned on the tuning half only; the evaluation half is judged once.

Each entry names a target (a module-level function returning a spec) and what
is true of it, measured by the independent check (tests/support/verify_corpus_check.py:
the real step or trainer on W gloo ranks of its own, the gradient read at
`optimizer.step()`, against one process's float64 gradient of the reference;
no code of verify's runner). What the entry says beyond the measurement is the
mistake planted, hence the cause verify must name (`causes`: any of these codes
among verify's is right) and the number the cause must carry (`factor`):

- "ratio": the step's gradient is one multiple of the reference's, measured;
- "weights": every micro-batch's weight in the step, fitted by the check on
  each micro-batch's own mean loss (`hypothesis`), is one constant, measured;
- "" : no number (the step is not a multiple: a gather, an optimizer per micro-batch).

Precision: the largest relative error of a right step in the arithmetic the
step runs in ("f64" 1e-9, "f32" 1e-5, "bf16" 5e-2); above it the step is wrong.

Legend: W ranks (2), K micro-batches (3; 2 on a mesh).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Literal

__all__ = ["CORPUS", "Entry", "half_of"]

Half = Literal["tuning", "evaluation"]
TOLERANCE = {"f64": 1e-9, "f32": 1e-5, "bf16": 5e-2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """One target of the corpus and what the independent check must find."""

    name: str
    target: str
    family: str
    precision: Literal["f64", "f32", "bf16"] = "f64"
    causes: tuple[str, ...] = ()
    """Empty: the step is right (PASS; `round-off` also right). Else: the mistake's causes."""
    factor: Literal["ratio", "weights", ""] = ""
    hypothesis: str = ""
    """'module:function' (model, forward args, forward kwargs) -> one micro-batch's own mean loss."""
    mesh: str = ""
    micro_batches: int = 3

    @property
    def right(self) -> bool:
        return not self.causes

    @property
    def half(self) -> Half:
        return half_of(self.name)


def half_of(name: str) -> Half:
    """The split rule: the parity of sha256(name)."""
    return "tuning" if int(hashlib.sha256(name.encode()).hexdigest(), 16) % 2 == 0 else "evaluation"


OWN = "tests/support/verify_corpus_own.py"
HF = "tests/support/verify_corpus_hf.py"
TRL = "tests/support/verify_corpus_trl.py"
GRPO = "tests/support/trl_grpo_verify.py"
LIT = "tests/support/verify_corpus_lightning.py"
ST = "tests/support/verify_corpus_st.py"
MESH = "tests/support/verify_corpus_mesh.py"
MEAN = f"{HF}:own_mean_loss"


def _e(name: str, where: str, family: str, **kw: object) -> Entry:
    return Entry(name=name, target=f"{where}:{name}", family=family, **kw)  # type: ignore[arg-type]


CORPUS: tuple[Entry, ...] = (
    # own loops: key-bias attention (float64, float32), a float32 head Function under bf16
    _e("attn_f64_global", OWN, "own"),
    _e("attn_f32_global", OWN, "own", precision="f32"),
    _e("attn_f64_mean_of_means", OWN, "own", causes=("mean-of-means",)),
    _e("attn_f32_mean_of_means", OWN, "own", precision="f32", causes=("mean-of-means",)),
    _e("attn_f64_uncompensated", OWN, "own", causes=("uncompensated-mean",), factor="ratio"),
    _e("attn_f64_step_per_micro_batch", OWN, "own", causes=("optimizer-steps",)),
    _e("attn_f64_detached_bias", OWN, "own", causes=("no-gradient",)),
    _e("bf16_head_global", OWN, "own", precision="bf16"),
    _e("bf16_head_mean_of_means", OWN, "own", precision="bf16", causes=("mean-of-means",)),
    # transformers Trainer
    _e(
        "bert_trainer",
        HF,
        "hf-trainer",
        causes=("mean-of-means",),
        factor="weights",
        hypothesis=MEAN,
    ),
    _e("bert_trainer_fixed", HF, "hf-trainer"),
    _e("bert32_trainer_fixed", HF, "hf-trainer", precision="f32"),
    _e("gpt2_trainer", HF, "hf-trainer", causes=("wrong-count",), factor="ratio"),
    _e("llama32_trainer", HF, "hf-trainer", precision="f32"),
    # transformers Seq2SeqTrainer
    _e(
        "bart_seq2seq",
        HF,
        "hf-seq2seq",
        causes=("mean-of-means",),
        factor="weights",
        hypothesis=MEAN,
    ),
    _e("bart_seq2seq_fixed", HF, "hf-seq2seq"),
    _e(
        "t5_seq2seq", HF, "hf-seq2seq", causes=("mean-of-means",), factor="weights", hypothesis=MEAN
    ),
    _e("t5_seq2seq_fixed", HF, "hf-seq2seq"),
    _e("t5_32_seq2seq_fixed", HF, "hf-seq2seq", precision="f32"),
    # accelerate accumulate()
    _e("bart_accelerate", HF, "accelerate"),
    _e(
        "bart_accelerate_mean",
        HF,
        "accelerate",
        causes=("mean-of-means",),
        factor="weights",
        hypothesis=MEAN,
    ),
    _e("bart_accelerate_no_cpu", HF, "accelerate", causes=("optimizer-steps",)),
    # trl SFT
    _e("sft_llama32_defaults", TRL, "trl-sft", precision="bf16"),
    _e("sft_llama64_defaults", TRL, "trl-sft", precision="bf16"),
    _e("sft_gpt2", TRL, "trl-sft", precision="f32", causes=("wrong-count",), factor="ratio"),
    _e("sft_gpt2_fixed", TRL, "trl-sft", precision="f32"),
    _e("sft_llama64_local_average", TRL, "trl-sft", precision="f32", causes=("mean-of-means",)),
    # trl DPO
    _e("dpo_gpt2_defaults", TRL, "trl-dpo", precision="bf16"),
    _e("dpo_gpt2_fixed", TRL, "trl-dpo", precision="f32"),
    _e("dpo_gpt2_sft_loss", TRL, "trl-dpo", precision="f32", causes=("mean-of-means",)),
    # trl GRPO (record and replay)
    _e("grpo", GRPO, "trl-grpo", precision="f32"),
    _e("sapo", GRPO, "trl-grpo", precision="f32"),
    _e("bnpo", GRPO, "trl-grpo", precision="f32", causes=("mean-of-means", "normalization-mode")),
    _e("dr_grpo", GRPO, "trl-grpo", precision="f32"),
    _e("dapo", GRPO, "trl-grpo", precision="f32"),
    _e("cispo", GRPO, "trl-grpo", precision="f32"),
    _e("vespo", GRPO, "trl-grpo", precision="f32"),
    _e("luspo", GRPO, "trl-grpo", precision="f32"),
    _e(
        "dapo_spg2",
        GRPO,
        "trl-grpo",
        precision="f32",
        causes=("wrong-count", "scaled", "mean-of-means"),
    ),
    _e("bnpo_fixed", GRPO, "trl-grpo", precision="f32"),
    # Lightning, automatic and manual optimisation
    _e("lit_mean", LIT, "lightning-auto", causes=("mean-of-means",)),
    _e("lit_global", LIT, "lightning-auto"),
    _e("lit_callback", LIT, "lightning-auto"),
    _e("lit_callback_mean", LIT, "lightning-auto", causes=("mean-of-means", "scaled")),
    _e("lit_manual", LIT, "lightning-manual"),
    _e("lit_manual_mean", LIT, "lightning-manual", causes=("mean-of-means",)),
    _e("lit_manual_step_each", LIT, "lightning-manual", causes=("optimizer-steps",)),
    # sentence-transformers
    _e("st_peer_mnrl", ST, "sentence-transformers", causes=("breaks-across-ranks",)),
    _e("st_wholebatch_mnrl", ST, "sentence-transformers"),
    _e("st_wholebatch_cached", ST, "sentence-transformers"),
    _e(
        "st_wholebatch_accumulated",
        ST,
        "sentence-transformers",
        causes=("breaks-across-micro-batches",),
    ),
    # FSDP2 and dp x tp on gloo
    _e("fsdp_global", MESH, "fsdp2", mesh="dp=2", micro_batches=2),
    _e("fsdp_rank_count", MESH, "fsdp2", mesh="dp=2", micro_batches=2, causes=("mean-of-means",)),
    _e(
        "fsdp_uncompensated",
        MESH,
        "fsdp2",
        mesh="dp=2",
        micro_batches=2,
        causes=("uncompensated-mean",),
        factor="ratio",
    ),
    _e("dptp_exact", MESH, "dp-tp", mesh="dp=2,tp=2", micro_batches=2),
    _e(
        "dptp_overcompensated",
        MESH,
        "dp-tp",
        mesh="dp=2,tp=2",
        micro_batches=2,
        causes=("compensated-over-tp",),
        factor="ratio",
    ),
    _e(
        "dptp_count_world",
        MESH,
        "dp-tp",
        mesh="dp=2,tp=2",
        micro_batches=2,
        causes=("counted-over-tp",),
        factor="ratio",
    ),
    # open_clip_train
    _e("oc_gather_with_grad", MESH, "open_clip_train", causes=("replicated-K",)),
    _e("oc_local_loss_with_grad", MESH, "open_clip_train", causes=("replicated-K",)),
)
