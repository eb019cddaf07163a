"""`wholebatch verify` targets for Hugging Face models, the HF `Trainer` and Accelerate loops.

    wholebatch verify examples/verify_hf.py:gpt2_trainer            # FAIL: wrong-count (transformers 5.23)
    wholebatch verify examples/verify_hf.py:gpt2_wholebatch_trainer # PASS: the same with WholeBatchTrainer
    wholebatch verify examples/verify_hf.py:gpt2_accelerate         # PASS
    wholebatch verify examples/verify_hf.py:gpt2_accelerate_mean    # FAIL: mean-of-means
    wholebatch verify examples/verify_hf.py:llama_accumulator       # PASS (float64 Llama, float32 norms)

Needs transformers and accelerate (`pip install -e ".[peers]"`); the models are
built from tiny configs (no weights are downloaded), in float64.

The trainer targets are `TrainerSpec`s: the trainer owns the sampler, the
sharding, the DDP wrap and the accumulation, so verify hands it the plain
model, an optimizer that records the gradient at `step()`, and the whole batch
as a dataset of 24 rows, with `per_device_rows` x `micro_batches` x W = 24: one
epoch is one optimizer step. The reference is the mean cross-entropy over every
predicted token of the whole batch: labels[..., 1:] != -100, the causal shift.

`gpt2_trainer` is the stock `Trainer` (transformers 5.23) on `GPT2LMHeadModel`:
its `num_items_in_batch` counts labels before the shift for a model whose
`loss_type` it does not know to be causal, so on a ragged batch every gradient
is (predicted tokens) / (labels) of the right one: 0.87x here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

from wholebatch.train.accumulate import Accumulator
from wholebatch.verify.spec import TrainerRun, TrainerSpec, VerifySpec

ROWS, SEQ, VOCAB = 24, 10, 64
Batch = dict[str, Tensor]


def gpt2() -> GPT2LMHeadModel:
    """A one-layer GPT-2 from a config (dropout off: the trainer decides which rows meet)."""
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config).double()


def llama() -> LlamaForCausalLM:
    """A one-layer Llama from a config, in float64 (its RMSNorm and rotary work in float32)."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).double()


def lm_batch(rows: int = ROWS) -> Batch:
    """Right-padded sequences of 2..SEQ tokens: input_ids, attention_mask, labels (-100 on padding)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    lengths = torch.randint(2, SEQ + 1, (rows,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def shifted_loss_sum(model: nn.Module, mb: Batch) -> tuple[Tensor, Tensor]:
    """(sum of next-token cross-entropies, number of predicted tokens): labels[..., 1:] != -100."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    targets = mb["labels"][:, 1:]
    ce = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return ce, (targets != -100).sum()


def lm_reference(model: nn.Module, batch: Batch) -> Tensor:
    """Mean next-token cross-entropy over every predicted token of the whole batch."""
    total, count = shifted_loss_sum(model, batch)
    return total / count


def trainer_args(run: TrainerRun) -> TrainingArguments:
    """One optimizer step over the whole batch: B rows per device x K accumulation steps x W."""
    return TrainingArguments(
        output_dir=run.output_dir, per_device_train_batch_size=run.per_device_rows,
        gradient_accumulation_steps=run.micro_batches, max_steps=1, max_grad_norm=0.0,
        learning_rate=1.0, lr_scheduler_type="constant", use_cpu=True, report_to="none",
        save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=run.seed,
    )  # fmt: skip


def gpt2_trainer() -> TrainerSpec:
    """The stock HF Trainer on GPT2LMHeadModel (loss_type None), ragged batch."""

    def train(run: TrainerRun) -> None:
        trainer = Trainer(
            model=run.model, args=trainer_args(run), train_dataset=run.dataset,
            optimizers=(run.optimizer, None),
        )  # fmt: skip
        trainer.train()

    return TrainerSpec(build_model=gpt2, batch=lm_batch(), train=train, reference_loss=lm_reference)


def gpt2_wholebatch_trainer() -> TrainerSpec:
    """`gpt2_trainer` with one line changed: wholebatch's `WholeBatchTrainer` for `Trainer`."""
    from wholebatch.integrations.huggingface import WholeBatchTrainer

    def train(run: TrainerRun) -> None:
        trainer = WholeBatchTrainer(
            model=run.model, args=trainer_args(run), train_dataset=run.dataset,
            optimizers=(run.optimizer, None),
        )  # fmt: skip
        trainer.train()

    return TrainerSpec(build_model=gpt2, batch=lm_batch(), train=train, reference_loss=lm_reference)


def _accelerate(
    run: TrainerRun,
) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer, list[Batch]]:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=run.micro_batches)
    loader = DataLoader(run.dataset, batch_size=run.per_device_rows)
    model, optimizer, loader = accelerator.prepare(run.model, run.optimizer, loader)
    return accelerator, model, optimizer, list(loader)


def gpt2_accelerate() -> TrainerSpec:
    """An Accelerate loop done right: token sums over the global token count (x W x K).

    `accelerator.backward` divides by the accumulation steps and DDP averages the
    ranks, so the loss is multiplied back by K and W.
    """

    def train(run: TrainerRun) -> None:
        accelerator, model, optimizer, mbs = _accelerate(run)
        local = sum(((mb["labels"][:, 1:] != -100).sum() for mb in mbs), torch.tensor(0))
        count = accelerator.reduce(local, reduction="sum")
        scale = accelerator.num_processes * run.micro_batches
        for mb in mbs:
            with accelerator.accumulate(model):
                total, _ = shifted_loss_sum(model, mb)
                accelerator.backward(total / count * scale)
                optimizer.step()
                optimizer.zero_grad()

    return TrainerSpec(build_model=gpt2, batch=lm_batch(), train=train, reference_loss=lm_reference)


def gpt2_accelerate_mean() -> TrainerSpec:
    """MISTAKE: the usual Accelerate loop: `model(**batch).loss` per micro-batch (a mean of means)."""

    def train(run: TrainerRun) -> None:
        accelerator, model, optimizer, mbs = _accelerate(run)
        for mb in mbs:
            with accelerator.accumulate(model):
                accelerator.backward(model(**mb).loss)
                optimizer.step()
                optimizer.zero_grad()

    return TrainerSpec(build_model=gpt2, batch=lm_batch(), train=train, reference_loss=lm_reference)


def _llama_step(model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[Batch]) -> None:
    Accumulator(model, optimizer).step(mbs, shifted_loss_sum)


def llama_accumulator() -> VerifySpec:
    """Accumulator on a float64 Llama: passes at the tolerance its float32 norms allow."""
    return VerifySpec(
        build_model=llama, batch=lm_batch(), step=_llama_step, reference_loss=lm_reference
    )


def llama_accumulator_strict() -> VerifySpec:
    """The same step held to rtol=1e-10: fails, worded as round-off of the float32 norms."""
    return VerifySpec(
        build_model=llama, batch=lm_batch(), step=_llama_step, reference_loss=lm_reference,
        rtol=1e-10,
    )  # fmt: skip
