"""Verify corpus, round 4: the transformers `Trainer`, `Seq2SeqTrainer` and Accelerate loops.

Tiny models from configs (nothing downloaded), dropout 0, on ragged batches of
24 rows (W·K·B = 2·3·4): BERT (masked LM), BART and T5 (conditional generation),
GPT-2 and Llama (causal LM). Each trainer as shipped by transformers 5.23, and
with wholebatch's `WholeBatchTrainerMixin` in front where it fixes it; Accelerate
1.15's `accumulate()` done right, the usual way (each micro-batch's own mean),
and without `cpu=True`.

Legend: N rows, S source tokens, L label tokens, W ranks, K micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wholebatch.verify import TrainerRun, TrainerSpec

N, S, L, V = 24, 8, 6, 40
Batch = dict[str, Tensor]


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def bert(dtype: torch.dtype = torch.float64) -> nn.Module:
    """A one-layer masked-LM BERT (key biases in its attention)."""
    from transformers import BertConfig, BertForMaskedLM

    _quiet()
    config = BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=S, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    return BertForMaskedLM(config).to(dtype)


def bart(dtype: torch.dtype = torch.float64) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    _quiet()
    config = BartConfig(
        vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
        forced_eos_token_id=None,
    )  # fmt: skip
    return BartForConditionalGeneration(config).to(dtype)


def t5(dtype: torch.dtype = torch.float64) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    _quiet()
    config = T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    return T5ForConditionalGeneration(config).to(dtype)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet()
    config = GPT2Config(
        vocab_size=V, n_positions=S, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return GPT2LMHeadModel(config).double()


def llama32() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    _quiet()
    config = LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=S,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _ragged(g: torch.Generator, width: int, low: int = 2) -> tuple[Tensor, Tensor]:
    ids = torch.randint(3, V, (N, width), generator=g)
    lengths = torch.randint(low, width + 1, (N,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def mlm_batch() -> Batch:
    """Ragged rows; about a third of each row's tokens carry a label (-100 elsewhere)."""
    g = torch.Generator().manual_seed(11)
    ids, mask = _ragged(g, S)
    picked = (torch.rand(N, S, generator=g) < 0.35) & mask.bool()
    picked[:, 0] = True
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(~picked, -100)}


def seq2seq_batch() -> Batch:
    g = torch.Generator().manual_seed(13)
    ids, mask = _ragged(g, S)
    labels, lab_mask = _ragged(g, L, low=1)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels.masked_fill(lab_mask == 0, -100),
    }


def lm_batch() -> Batch:
    g = torch.Generator().manual_seed(17)
    ids, mask = _ragged(g, S)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _token_mean(logits: Tensor, labels: Tensor) -> Tensor:
    ce = F.cross_entropy(
        logits.flatten(0, 1).double(), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    return ce / (labels != -100).sum()


def mlm_reference(model: nn.Module, batch: Batch) -> Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return _token_mean(logits, batch["labels"])


def seq2seq_reference(model: nn.Module, batch: Batch) -> Tensor:
    out = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    )
    return _token_mean(out.logits, batch["labels"])


def causal_reference(model: nn.Module, batch: Batch) -> Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return _token_mean(logits[:, :-1], batch["labels"][:, 1:])


def own_mean_loss(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    """The hypothesis of the independent check: one micro-batch's loss as the model computes it
    from the inputs the trainer gave its forward (without the trainer's item count)."""
    inputs = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
    out: Tensor = model(*args, **inputs).loss
    return out


def _args(run: TrainerRun, seq2seq: bool = False) -> Any:
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    cls = Seq2SeqTrainingArguments if seq2seq else TrainingArguments
    return cls(
        output_dir=run.output_dir, per_device_train_batch_size=run.per_device_rows,
        gradient_accumulation_steps=run.micro_batches, max_steps=1, max_grad_norm=0.0,
        learning_rate=1.0, lr_scheduler_type="constant", use_cpu=True, report_to="none",
        save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=run.seed,
    )  # fmt: skip


def _trainer(kind: str, fixed: bool) -> type:
    from transformers import Seq2SeqTrainer, Trainer

    from wholebatch.integrations.huggingface import WholeBatchTrainerMixin

    base = Seq2SeqTrainer if kind == "seq2seq" else Trainer
    return type(f"WholeBatch{base.__name__}", (WholeBatchTrainerMixin, base), {}) if fixed else base


def _train(kind: str, fixed: bool) -> Any:
    def train(run: TrainerRun) -> None:
        cls = _trainer(kind, fixed)
        trainer = cls(
            model=run.model, args=_args(run, seq2seq=kind == "seq2seq"),
            train_dataset=run.dataset, optimizers=(run.optimizer, None),
        )  # fmt: skip
        trainer.train()

    return train


def _spec(build: Any, batch: Batch, reference: Any, kind: str, fixed: bool) -> TrainerSpec:
    return TrainerSpec(
        build_model=build, batch=batch, train=_train(kind, fixed), reference_loss=reference,
    )  # fmt: skip


def bert_trainer() -> TrainerSpec:
    """The stock Trainer on a float64 BertForMaskedLM."""
    return _spec(bert, mlm_batch(), mlm_reference, "trainer", False)


def bert_trainer_fixed() -> TrainerSpec:
    """WholeBatchTrainerMixin on a float64 BertForMaskedLM (key biases)."""
    return _spec(bert, mlm_batch(), mlm_reference, "trainer", True)


def bert32_trainer_fixed() -> TrainerSpec:
    """WholeBatchTrainerMixin on a float32 BertForMaskedLM."""
    return _spec(lambda: bert(torch.float32), mlm_batch(), mlm_reference, "trainer", True)


def gpt2_trainer() -> TrainerSpec:
    """The stock Trainer on GPT-2 (labels counted before the causal shift)."""
    return _spec(gpt2, lm_batch(), causal_reference, "trainer", False)


def llama32_trainer() -> TrainerSpec:
    """The stock Trainer on a float32 Llama (counted after the shift)."""
    return _spec(llama32, lm_batch(), causal_reference, "trainer", False)


def bart_seq2seq() -> TrainerSpec:
    """The stock Seq2SeqTrainer on a float64 BART."""
    return _spec(bart, seq2seq_batch(), seq2seq_reference, "seq2seq", False)


def bart_seq2seq_fixed() -> TrainerSpec:
    """WholeBatchTrainerMixin + Seq2SeqTrainer on a float64 BART."""
    return _spec(bart, seq2seq_batch(), seq2seq_reference, "seq2seq", True)


def t5_seq2seq() -> TrainerSpec:
    """The stock Seq2SeqTrainer on a float64 T5."""
    return _spec(t5, seq2seq_batch(), seq2seq_reference, "seq2seq", False)


def t5_seq2seq_fixed() -> TrainerSpec:
    """WholeBatchTrainerMixin + Seq2SeqTrainer on a float64 T5."""
    return _spec(t5, seq2seq_batch(), seq2seq_reference, "seq2seq", True)


def t5_32_seq2seq_fixed() -> TrainerSpec:
    """WholeBatchTrainerMixin + Seq2SeqTrainer on a float32 T5."""
    return _spec(lambda: t5(torch.float32), seq2seq_batch(), seq2seq_reference, "seq2seq", True)


# ---------------------------------------------------------------------------
# Accelerate's accumulate() on BART
# ---------------------------------------------------------------------------


def _accelerate(exact: bool, cpu: bool = True) -> Any:
    def train(run: TrainerRun) -> None:
        from accelerate import Accelerator
        from torch.utils.data import DataLoader

        accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=run.micro_batches)
        loader = DataLoader(run.dataset, batch_size=run.per_device_rows)
        model, optimizer, loader = accelerator.prepare(run.model, run.optimizer, loader)
        mbs = list(loader)
        local = sum(int((mb["labels"] != -100).sum()) for mb in mbs)
        count = float(accelerator.reduce(torch.tensor(local, dtype=torch.float64), "sum"))
        for mb in mbs:
            with accelerator.accumulate(model):
                out = model(
                    input_ids=mb["input_ids"],
                    attention_mask=mb["attention_mask"],
                    labels=mb["labels"],
                )
                if exact:  # token sum over the global count; accelerate divides by K, DDP by W
                    total = F.cross_entropy(
                        out.logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100,
                        reduction="sum",
                    )  # fmt: skip
                    loss = total / count * accelerator.num_processes * run.micro_batches
                else:
                    loss = out.loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()

    return train


def bart_accelerate() -> TrainerSpec:
    """Right: token sums over the global count, accelerate's 1/K and DDP's 1/W undone."""
    return TrainerSpec(
        build_model=bart,
        batch=seq2seq_batch(),
        train=_accelerate(True),
        reference_loss=seq2seq_reference,
    )


def bart_accelerate_mean() -> TrainerSpec:
    """MISTAKE: the model's own loss (each micro-batch's token mean) under accumulate()."""
    return TrainerSpec(
        build_model=bart,
        batch=seq2seq_batch(),
        train=_accelerate(False),
        reference_loss=seq2seq_reference,
    )


def bart_accelerate_no_cpu() -> TrainerSpec:
    """MISTAKE: the right loop, Accelerator() without cpu=True on a CPU (its DDP wrap skipped)."""
    return TrainerSpec(
        build_model=bart, batch=seq2seq_batch(), train=_accelerate(True, cpu=False),
        reference_loss=seq2seq_reference,
    )  # fmt: skip
