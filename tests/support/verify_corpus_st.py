"""Verify corpus, round 4: sentence-transformers 6.2's `SentenceTransformerTrainer`.

A float64 SentenceTransformer (a one-layer BERT, its key biases included, and
mean pooling; saved once per machine to a temporary folder with a word-level
tokenizer, nothing downloaded), (anchor, positive) pairs, the in-batch
negatives ranking loss (scale 20) over the whole batch as the reference:

- the peer's `MultipleNegativesRankingLoss` as its users run it under DDP
  (each rank scores its anchors against its own positives only);
- wholebatch's `MultipleNegativesRankingLoss` and `CachedMultipleNegativesRankingLoss`
  drop-ins (right), each rank's rows in one micro-step (`gradient_accumulation_steps=1`,
  K·B rows per device: a contrastive loss is not a sum over micro-steps);
- the drop-in with `gradient_accumulation_steps=K`: each micro-step's loss over its own
  rows of every rank, averaged, which is not the loss over the whole batch.

The spec's batch holds the columns tokenized (ids without [CLS]/[SEP], padded
with 0, and masks); `train` turns them back into text, which the trainer
tokenizes again, adding [CLS] and [SEP] and padding each micro-batch to its own
longest row.

Legend: N rows, T tokens, W ranks, K micro-batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wholebatch.verify import TrainerRun, TrainerSpec

N, T, SCALE = 24, 6, 20.0
WORDS = [f"w{i}" for i in range(24)]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
Batch = dict[str, Tensor]


def model_dir() -> str:
    """A one-layer BERT and its tokenizer saved under the temporary folder (once per machine)."""
    import transformers
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    tag = hashlib.sha256(b"verify-corpus-st-1").hexdigest()[:8]
    path = os.path.join(tempfile.gettempdir(), f"wholebatch-st-{tag}")
    if all(
        os.path.exists(os.path.join(path, f)) for f in ("done", "config.json", "tokenizer.json")
    ):
        return path  # whole: "done" is written last, inside the folder, before it is renamed in
    transformers.logging.set_verbosity_error()
    tmp = tempfile.mkdtemp(prefix="wholebatch-st-", dir=tempfile.gettempdir())
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=16,
    ).save_pretrained(tmp)  # fmt: skip
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16,
    )  # fmt: skip
    BertModel(config, add_pooling_layer=False).save_pretrained(tmp)
    open(os.path.join(tmp, "done"), "w").close()
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race (the same folder), or a stale one is there
        if not os.path.exists(os.path.join(path, "config.json")):
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rename(tmp, path)
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def encoder() -> nn.Module:
    """The SentenceTransformer in float64 (its dropout is switched off by verify for a trainer)."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformers.logging.set_verbosity_error()
    module = Transformer(model_dir(), model_kwargs={"add_pooling_layer": False})
    return SentenceTransformer(modules=[module, Pooling(8, "mean")], device="cpu").double()


def pairs() -> Batch:
    """Anchors and positives of 1..T words, as word ids (offset past the specials), padded with 0."""
    g = torch.Generator().manual_seed(19)
    out: Batch = {}
    for name in ("anchor", "positive"):
        ids = torch.randint(len(SPECIALS), len(SPECIALS) + len(WORDS), (N, T), generator=g)
        lengths = torch.randint(1, T + 1, (N,), generator=g)
        mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
        out |= {f"{name}_ids": ids * mask, f"{name}_mask": mask}
    return out


def _texts(batch: Batch, name: str) -> list[str]:
    ids, mask = batch[f"{name}_ids"], batch[f"{name}_mask"]
    vocab = SPECIALS + WORDS
    return [
        " ".join(vocab[int(i)] for i in row[m.bool()]) for row, m in zip(ids, mask, strict=True)
    ]


def _embed(model: nn.Module, texts: list[str]) -> Tensor:
    features = model.tokenize(texts)  # type: ignore[operator]
    out: Tensor = model(features)["sentence_embedding"]
    return out


def ranking_loss(model: nn.Module, batch: Batch) -> Tensor:
    """In-batch negatives over the whole batch: scale x cos(anchor_i, positive_j), CE on the diagonal."""
    a = F.normalize(_embed(model, _texts(batch, "anchor")), dim=-1)
    p = F.normalize(_embed(model, _texts(batch, "positive")), dim=-1)
    return F.cross_entropy(SCALE * a @ p.T, torch.arange(len(a)))


def _train(loss_kind: str, accumulate: bool = False) -> Any:
    def train(run: TrainerRun) -> None:
        from datasets import Dataset
        from sentence_transformers import (
            SentenceTransformerTrainer,
            SentenceTransformerTrainingArguments,
            losses,
        )

        from wholebatch.integrations import sentence_transformers as ours

        model: Any = run.model
        k = run.micro_batches
        if loss_kind == "peer":
            loss = losses.MultipleNegativesRankingLoss(model, scale=SCALE)
        elif loss_kind == "ours":
            loss = ours.MultipleNegativesRankingLoss(model, scale=SCALE)
        else:
            loss = ours.CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=2)
        args = SentenceTransformerTrainingArguments(
            output_dir=run.output_dir, use_cpu=True,
            per_device_train_batch_size=run.per_device_rows * (1 if accumulate else k),
            gradient_accumulation_steps=k if accumulate else 1, max_steps=1, max_grad_norm=0.0,
            learning_rate=1.0, report_to="none", save_strategy="no", logging_strategy="no",
            disable_tqdm=True, seed=run.seed, dataloader_drop_last=False,
        )  # fmt: skip
        data = Dataset.from_dict(
            {"anchor": _texts(run.batch, "anchor"), "positive": _texts(run.batch, "positive")}
        )
        SentenceTransformerTrainer(
            model=model, args=args, train_dataset=data, loss=loss, optimizers=(run.optimizer, None)
        ).train()

    return train


def _spec(loss_kind: str, accumulate: bool = False) -> TrainerSpec:
    return TrainerSpec(
        build_model=encoder, batch=pairs(), train=_train(loss_kind, accumulate),
        reference_loss=ranking_loss,
    )  # fmt: skip


def st_peer_mnrl() -> TrainerSpec:
    """MISTAKE: the peer's MultipleNegativesRankingLoss under DDP: local negatives only."""
    return _spec("peer")


def st_wholebatch_mnrl() -> TrainerSpec:
    """Right: wholebatch's MultipleNegativesRankingLoss."""
    return _spec("ours")


def st_wholebatch_cached() -> TrainerSpec:
    """Right: wholebatch's CachedMultipleNegativesRankingLoss (mini-batches of 2)."""
    return _spec("cached")


def st_wholebatch_accumulated() -> TrainerSpec:
    """MISTAKE: wholebatch's loss with gradient_accumulation_steps=K: a mean of micro-step losses."""
    return _spec("ours", accumulate=True)
