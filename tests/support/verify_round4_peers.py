"""Verify targets for issue 32 on trainers written elsewhere: transformers 5.23, trl 1.16, sentence-transformers 6.2.

Each with its mutation on the same model (tests/e2e/test_verify_round4_peers.py):

1. Zero-gradient parameters through the project's own fixes: a float64 BERT
   (masked LM) under `WholeBatchTrainer` and BART and T5 under
   `WholeBatchTrainerMixin` + `Seq2SeqTrainer` (right: PASS with rtol unset; their
   attention key biases have an exact gradient of zero); the stock `Trainer` on
   the same BERT (each micro-batch's mean, x J); the
   sentence-transformers drop-in on a float64 BERT encoder (right), the peer's
   loss under DDP (local negatives).
2. trl's defaults (`bf16=True`): `SFTTrainer` on a float64 Llama, `DPOTrainer`
   on a float64 GPT-2 (right, at bfloat16's precision: PASS or `round-off`).
3. `Seq2SeqTrainer` on BART and T5, GA = 3, W = 2: plain (each micro-batch's
   own mean at weight 1.0: a mean of means times J = 6) and with
   `WholeBatchTrainerMixin` (right).

The batches differ from the corpus's (tests/support/verify_corpus_hf.py,
verify_corpus_trl.py, verify_corpus_st.py, whose models these reuse).

Legend: W ranks, K micro-batches, J = W·K.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tests.support import verify_corpus_hf as hf, verify_corpus_st as st, verify_corpus_trl as trl
from wholebatch.verify import TrainerSpec

Batch = dict[str, Tensor]


def _reseeded(batch: Batch, seed: int) -> Batch:
    """The same columns, rows shuffled and token ids redrawn where they are not padding."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(next(iter(batch.values()))), generator=g)
    out = {k: v[order] for k, v in batch.items()}
    for k, v in out.items():
        if k in ("input_ids", "labels"):
            fresh = torch.randint(3, hf.V, v.shape, generator=g)
            out[k] = torch.where(v > 0, fresh, v)
    if "labels" in out and "input_ids" in out and out["labels"].shape == out["input_ids"].shape:
        out["labels"] = torch.where(out["labels"] >= 0, out["input_ids"], out["labels"])
    return out


def _hf(build: Any, batch: Batch, reference: Any, kind: str, fixed: bool) -> TrainerSpec:
    return TrainerSpec(
        build_model=build, batch=batch, train=hf._train(kind, fixed), reference_loss=reference
    )


def bert_wholebatch_trainer() -> TrainerSpec:
    """Right: WholeBatchTrainerMixin + Trainer on a float64 BertForMaskedLM."""
    return _hf(hf.bert, _reseeded(hf.mlm_batch(), 1), hf.mlm_reference, "trainer", True)


def bert_stock_trainer() -> TrainerSpec:
    """MUTATION: the stock Trainer on the same BERT."""
    return _hf(hf.bert, _reseeded(hf.mlm_batch(), 1), hf.mlm_reference, "trainer", False)


def bart_seq2seq() -> TrainerSpec:
    """MISTAKE: the stock Seq2SeqTrainer on BART (each micro-batch's mean at weight 1.0)."""
    return _hf(hf.bart, _reseeded(hf.seq2seq_batch(), 3), hf.seq2seq_reference, "seq2seq", False)


def bart_seq2seq_mixin() -> TrainerSpec:
    """Right: WholeBatchTrainerMixin + Seq2SeqTrainer on BART."""
    return _hf(hf.bart, _reseeded(hf.seq2seq_batch(), 3), hf.seq2seq_reference, "seq2seq", True)


def t5_seq2seq() -> TrainerSpec:
    """MISTAKE: the stock Seq2SeqTrainer on T5."""
    return _hf(hf.t5, _reseeded(hf.seq2seq_batch(), 4), hf.seq2seq_reference, "seq2seq", False)


def t5_seq2seq_mixin() -> TrainerSpec:
    """Right: WholeBatchTrainerMixin + Seq2SeqTrainer on T5."""
    return _hf(hf.t5, _reseeded(hf.seq2seq_batch(), 4), hf.seq2seq_reference, "seq2seq", True)


def _pairs(seed: int) -> Batch:
    b = st.pairs()
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(b["anchor_ids"]), generator=g)
    return {k: v[order] for k, v in b.items()}


def st_dropin() -> TrainerSpec:
    """Right: wholebatch's MultipleNegativesRankingLoss on a float64 BERT (one micro-step per rank)."""
    return TrainerSpec(
        build_model=st.encoder, batch=_pairs(5), train=st._train("ours"),
        reference_loss=st.ranking_loss,
    )  # fmt: skip


def st_peer() -> TrainerSpec:
    """MUTATION: the peer's MultipleNegativesRankingLoss under DDP (local negatives only)."""
    return TrainerSpec(
        build_model=st.encoder, batch=_pairs(5), train=st._train("peer"),
        reference_loss=st.ranking_loss,
    )  # fmt: skip


def sft_defaults() -> TrainerSpec:
    """SFTConfig's defaults (bf16) on a float64 Llama."""
    batch = trl.sft_batch()
    order = torch.randperm(len(batch["input_ids"]), generator=torch.Generator().manual_seed(6))
    batch = {k: v[order] for k, v in batch.items()}
    return TrainerSpec(
        build_model=trl.llama, batch=batch, train=trl._sft(False), reference_loss=trl.causal_mean
    )


def sft_defaults_local_average() -> TrainerSpec:
    """MUTATION: the same, average_tokens_across_devices=False (each rank's own token mean)."""
    spec = sft_defaults()
    return TrainerSpec(
        build_model=trl.llama, batch=spec.batch,
        train=trl._sft(False, average_tokens_across_devices=False),
        reference_loss=trl.causal_mean,
    )  # fmt: skip


def dpo_defaults() -> TrainerSpec:
    """DPOConfig's defaults (bf16, sigmoid) on a float64 GPT-2."""
    return TrainerSpec(
        build_model=trl.gpt2, batch=trl.dpo_batch(), train=trl._dpo(False),
        reference_loss=trl.dpo_mean,
    )  # fmt: skip
