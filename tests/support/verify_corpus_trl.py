"""Verify corpus, round 4: trl 1.16's `SFTTrainer` and `DPOTrainer` as their users run them.

Tiny GPT-2 and Llama from configs (float64 unless named 32), the word-level
tokenizer of tests/support/verify_words.py (pad 0, eos 2, words "t4".."t39"),
W·K·B = 2·3·4 rows. `SFTConfig` / `DPOConfig` defaults (`bf16=True`: CPU bf16
autocast, trl's fused log-prob head) where the name says so, else `bf16=False`.

- SFT: the defaults on a float32 and a float64 Llama (right, at bf16's
  precision); GPT-2 plain (trl counts its labels before the shift: too small)
  and with `WholeBatchSFTTrainer` (right); `average_tokens_across_devices=False`
  (each rank's own token mean, DDP-averaged).
- DPO (pre-tokenized text prompt/chosen/rejected; trl stacks chosen rows over
  rejected ones and pads each micro-batch): the sigmoid loss with the defaults,
  with `WholeBatchDPOTrainer` (right), and `loss_type="sft"` (each micro-batch's
  token mean of the chosen completions: a mean of means).

Legend: N rows (pairs), P prompt tokens, C completion tokens, W ranks, K micro-batches.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.support.verify_words import WORDS, tokenizer
from wholebatch.verify import TrainerRun, TrainerSpec

N, SEQ, P, C, VOCAB = 24, 10, 4, 4, 40
Batch = dict[str, Tensor]


def llama(dtype: torch.dtype = torch.float64) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return GPT2LMHeadModel(config).double()


def _rows(g: torch.Generator, width: int, low: int) -> tuple[Tensor, Tensor]:
    ids = torch.randint(4, VOCAB, (N, width), generator=g)
    lengths = torch.randint(low, width + 1, (N,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def sft_batch() -> Batch:
    """Right-padded rows of 2..SEQ tokens, labels -100 on padding."""
    ids, mask = _rows(torch.Generator().manual_seed(5), SEQ, 2)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def causal_mean(model: nn.Module, batch: Batch) -> Tensor:
    """Mean next-token cross-entropy over every predicted token of the batch (float64)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    ce = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).double(), targets.flatten(), ignore_index=-100,
        reduction="sum",
    )  # fmt: skip
    return ce / (targets != -100).sum()


def _texts(ids: Tensor, mask: Tensor, lead: str = "") -> list[str]:
    """Rows as text ("t5 t9"); `lead` before each (a completion follows its prompt after a space)."""
    return [
        lead + " ".join(WORDS[int(i)] for i in row[m.bool()])
        for row, m in zip(ids, mask, strict=True)
    ]


def _sft(fixed: bool, **config: Any) -> Any:
    def train(run: TrainerRun) -> None:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from wholebatch.integrations.trl import WholeBatchSFTTrainer

        batch = run.batch
        rows = [
            ids[m.bool()].tolist()
            for ids, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)
        ]
        args = SFTConfig(
            output_dir=run.output_dir, per_device_train_batch_size=run.per_device_rows,
            gradient_accumulation_steps=run.micro_batches, max_steps=1, max_grad_norm=0.0,
            use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
            disable_tqdm=True, seed=run.seed, dataloader_drop_last=False, **config,
        )  # fmt: skip
        cls = WholeBatchSFTTrainer if fixed else SFTTrainer
        cls(
            model=run.model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows}),
            processing_class=tokenizer(), optimizers=(run.optimizer, None),
        ).train()  # fmt: skip

    return train


def _sft_spec(build: Any, fixed: bool = False, **config: Any) -> TrainerSpec:
    return TrainerSpec(
        build_model=build,
        batch=sft_batch(),
        train=_sft(fixed, **config),
        reference_loss=causal_mean,
    )


def sft_llama32_defaults() -> TrainerSpec:
    """SFTConfig's defaults (bf16 autocast, gradient checkpointing) on a float32 Llama."""
    return _sft_spec(lambda: llama(torch.float32))


def sft_llama64_defaults() -> TrainerSpec:
    """SFTConfig's defaults on a float64 Llama: trl's fused head runs its float32 matmuls in bf16."""
    return _sft_spec(llama)


def sft_gpt2() -> TrainerSpec:
    """The plain SFTTrainer on GPT-2 (bf16 off): its labels counted before the causal shift."""
    return _sft_spec(gpt2, bf16=False)


def sft_gpt2_fixed() -> TrainerSpec:
    """WholeBatchSFTTrainer on GPT-2 (bf16 off)."""
    return _sft_spec(gpt2, fixed=True, bf16=False)


def sft_llama64_local_average() -> TrainerSpec:
    """MISTAKE: average_tokens_across_devices=False (each rank's own token mean), bf16 off."""
    return _sft_spec(llama, bf16=False, average_tokens_across_devices=False)


# ---------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------


def dpo_batch() -> Batch:
    """Prompts of 1..P tokens, chosen and rejected completions of 1..C tokens each ending in EOS (t2)."""
    g = torch.Generator().manual_seed(7)
    prompt, prompt_mask = _rows(g, P, 1)
    out: Batch = {"prompt_ids": prompt, "prompt_mask": prompt_mask}
    for name in ("chosen", "rejected"):
        ids, mask = _rows(g, C, 1)
        ends = mask.sum(1)
        ids = torch.cat([ids, torch.zeros(N, 1, dtype=ids.dtype)], 1)
        mask = torch.cat([mask, torch.zeros(N, 1, dtype=mask.dtype)], 1)
        ids[torch.arange(N), ends], mask[torch.arange(N), ends] = 2, 1  # trl's EOS
        out |= {f"{name}_ids": ids, f"{name}_mask": mask}
    return out


def _completion_logps(model: nn.Module, batch: Batch, name: str) -> tuple[Tensor, Tensor]:
    """Per pair: the log-probs of its `name` completion's tokens given its prompt [N, C+1], and their mask."""
    rows, masks, starts = [], [], []
    for i in range(len(batch["prompt_ids"])):
        p = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        c = batch[f"{name}_ids"][i][batch[f"{name}_mask"][i].bool()]
        rows.append(torch.cat([p, c]))
        starts.append(len(p))
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)] = r, 1
    logp = model(input_ids=ids, attention_mask=attn).logits[:, :-1].double().log_softmax(-1)
    tok = logp.gather(-1, ids[:, 1:, None])[..., 0]
    pos = torch.arange(1, width)[None, :]
    start = torch.tensor(starts)[:, None]
    masks = ((pos >= start) & attn[:, 1:].bool()).double()
    return tok, masks


def _dpo_terms(model: nn.Module, batch: Batch, beta: float = 0.1) -> Tensor:
    """The sigmoid DPO loss of every pair; the reference model is the policy at the start (a copy)."""
    ref = copy.deepcopy(model)
    out = {}
    for name in ("chosen", "rejected"):
        tok, m = _completion_logps(model, batch, name)
        with torch.no_grad():
            ref_tok, _ = _completion_logps(ref, batch, name)
        out[name] = ((tok - ref_tok) * m).sum(1)
    return -F.logsigmoid(beta * (out["chosen"] - out["rejected"]))


def dpo_mean(model: nn.Module, batch: Batch) -> Tensor:
    """The sigmoid DPO loss averaged over every pair of the batch."""
    return _dpo_terms(model, batch).mean()


def chosen_nll_mean(model: nn.Module, batch: Batch) -> Tensor:
    """trl's DPO "sft" loss over the whole batch: the token mean of -log p over chosen tokens."""
    tok, m = _completion_logps(model, batch, "chosen")
    return -(tok * m).sum() / m.sum()


def _dpo(fixed: bool, **config: Any) -> Any:
    def train(run: TrainerRun) -> None:
        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer

        from wholebatch.integrations.trl import WholeBatchDPOTrainer

        b = run.batch
        rows = {
            "prompt": _texts(b["prompt_ids"], b["prompt_mask"]),
            "chosen": _texts(b["chosen_ids"], b["chosen_mask"], " "),
            "rejected": _texts(b["rejected_ids"], b["rejected_mask"], " "),
        }
        args = DPOConfig(
            output_dir=run.output_dir, per_device_train_batch_size=run.per_device_rows,
            gradient_accumulation_steps=run.micro_batches, max_steps=1, max_grad_norm=0.0,
            use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
            seed=run.seed, dataset_num_proc=None, **config,
        )  # fmt: skip
        cls = WholeBatchDPOTrainer if fixed else DPOTrainer
        cls(
            model=run.model, ref_model=copy.deepcopy(run.model),  # the policy at the start
            args=args, train_dataset=Dataset.from_dict(rows), processing_class=tokenizer(),
            optimizers=(run.optimizer, None),
        ).train()  # fmt: skip

    return train


def dpo_gpt2_defaults() -> TrainerSpec:
    """DPOConfig's defaults (bf16 autocast): the sigmoid loss over pairs."""
    return TrainerSpec(
        build_model=gpt2, batch=dpo_batch(), train=_dpo(False), reference_loss=dpo_mean
    )


def dpo_gpt2_fixed() -> TrainerSpec:
    """WholeBatchDPOTrainer, bf16 off."""
    return TrainerSpec(
        build_model=gpt2, batch=dpo_batch(), train=_dpo(True, bf16=False), reference_loss=dpo_mean
    )


def dpo_gpt2_sft_loss() -> TrainerSpec:
    """MISTAKE: loss_type="sft": each micro-batch's token mean over its chosen completions."""
    return TrainerSpec(
        build_model=gpt2, batch=dpo_batch(), train=_dpo(False, bf16=False, loss_type=["sft"]),
        reference_loss=chosen_nll_mean,
    )  # fmt: skip
