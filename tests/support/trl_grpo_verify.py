"""`wholebatch verify` specs for trl 1.16's `GRPOTrainer`, one per `loss_type` (a `ReplaySpec`).

    wholebatch verify tests/support/trl_grpo_verify.py:bnpo tests/support/trl_grpo_verify.py:dapo

GRPO builds its batch inside `train()`: it samples completions, scores them and
computes advantages, so no fixed batch can be handed to it. A `ReplaySpec`
runs the real trainer (a tiny float64 Llama from a config whose LM head starts
at zero, so sampling is uniform and EOS ends completions at different lengths;
a toy reward, the completion's length; CPU generation; GA = K micro-batches,
`steps_per_generation` = GA unless named `_spg2`), and every micro-batch its
loss reads is recorded (`run.record`, called from `_compute_loss`): prompts,
completions, their masks and advantages. verify then computes the reference on
the recorded whole batch of every rank: the loss type's own normalisation,
taken over the whole step, as a `wholebatch.Normalize` (`REFERENCE_MODE`).

On-policy (num_iterations = 1, beta = 0) every loss type's per-token gradient
is -A_s d log p_t; they differ only in how they weight tokens, so each
reference is -sum_t w_t A_s log p_t with the mode's weights w_t:

| loss_type | trl's own normaliser (per micro-batch)    | the whole-batch mode it means |
|-----------|-------------------------------------------|-------------------------------|
| grpo, sapo| mean over sequences of token means, / GA  | "sequence"                    |
| bnpo      | the micro-batch's token mean, / GA        | "token"                       |
| dr_grpo   | token sum / (B x max_completion_length)   | "constant", C = S x T_max     |
| dapo, cispo, vespo | token sum / (generation batch's tokens x GA / spg) | "token"    |
| luspo     | mean over sequences of token sums, / GA   | "constant", C = S             |

(S: every completion of the step, W x GA x B.)

Legend: W ranks, K = GA micro-batches per rank, B completions per micro-batch
(per device), G generations per prompt, T_max the longest completion.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tests.support.verify_words import tokenizer
from wholebatch.train.normalize import Normalize
from wholebatch.verify import ReplaySpec, TrainerRun

B, G, T_MAX, PROMPTS = 2, 2, 8, 24
LOSS_TYPES = ("grpo", "sapo", "bnpo", "dr_grpo", "dapo", "cispo", "vespo", "luspo")
# The mode each loss type's whole-batch loss is, and its constant (None: none).
REFERENCE_MODE: dict[str, str] = {
    "grpo": "sequence", "sapo": "sequence", "bnpo": "token", "dr_grpo": "constant",
    "dapo": "token", "cispo": "token", "vespo": "token", "luspo": "constant",
}  # fmt: skip
RECORDED = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
Batch = dict[str, Tensor]


def policy() -> nn.Module:
    """A one-layer float64 Llama whose LM head is zero: uniform sampling, ragged completions."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model


def prompts() -> list[str]:
    return [" ".join(f"t{4 + (3 * i + j) % 30}" for j in range(1 + i % 3)) for i in range(PROMPTS)]


def _reward(completions: list[Any], **_: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def completion_logps(model: nn.Module, batch: Batch) -> Tensor:
    """log p of every completion token [S, T], the prompt (left-padded) before it, as trl feeds it."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    t = batch["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -t - 1 : -1]
    logp: Tensor = logits.log_softmax(-1).gather(-1, batch["completion_ids"][..., None])[..., 0]
    return logp


def token_losses(model: nn.Module, batch: Batch) -> Tensor:
    """Each completion token's policy-gradient loss -A_s log p_t [S, T] (on-policy, beta = 0)."""
    return -batch["advantages"][:, None] * completion_logps(model, batch)


def _items(batch: Batch) -> dict[str, Tensor]:
    mask = batch["completion_mask"].bool()
    return {"mask": mask, "sequence": batch["row"][:, None].expand_as(mask)}


def _reference(loss_type: str) -> Any:
    mode = REFERENCE_MODE[loss_type]

    def reference_loss(model: nn.Module, batch: Batch) -> Tensor:
        """The loss type's normalisation over the recorded whole batch (`REFERENCE_MODE`)."""
        losses = token_losses(model, batch)
        mask = batch["completion_mask"].to(losses.dtype)
        if mode == "token":
            return (losses * mask).sum() / mask.sum()
        if mode == "sequence":
            return ((losses * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
        s = len(batch["advantages"])  # S completions (of the part, when verify asks for a part)
        return (losses * mask).sum() / (s * (T_MAX if loss_type == "dr_grpo" else 1))

    return reference_loss


def _train(loss_type: str, spg: int, fixed: bool) -> Any:
    def train(run: TrainerRun) -> None:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from wholebatch.integrations.trl import WholeBatchGRPOTrainer

        base = WholeBatchGRPOTrainer if fixed else GRPOTrainer

        class Recorded(base):  # type: ignore[misc, valid-type]
            def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Tensor:
                run.record({k: inputs[k] for k in RECORDED})
                out: Tensor = super()._compute_loss(model, inputs)
                return out

        args = GRPOConfig(
            output_dir=run.output_dir, per_device_train_batch_size=B, num_generations=G,
            gradient_accumulation_steps=run.micro_batches,
            steps_per_generation=spg * run.micro_batches, max_completion_length=T_MAX,
            max_steps=1, max_grad_norm=0.0, use_cpu=True, bf16=False, report_to=[],
            loss_type=loss_type, save_strategy="no", logging_strategy="no",
            disable_tqdm=True, seed=run.seed, beta=0.0,
            epsilon_high=5.0 if loss_type == "cispo" else None,
        )  # fmt: skip
        Recorded(
            model=run.model, reward_funcs=_reward, args=args,
            train_dataset=Dataset.from_dict({"prompt": list(run.dataset)}),
            processing_class=tokenizer(), optimizers=(run.optimizer, None),
        ).train()  # fmt: skip

    return train


def spec(loss_type: str, *, spg: int = 1, fixed: bool = False) -> ReplaySpec:
    """trl's GRPOTrainer with `loss_type`, its reference the mode that loss type means.

    The token and sequence modes also give verify `normalize` and `item_losses`, so a
    step that weights the recorded tokens otherwise is named by the mode it applies.
    """
    mode = REFERENCE_MODE[loss_type]
    named = mode in ("token", "sequence")
    return ReplaySpec(
        build_model=policy, data=prompts(), train=_train(loss_type, spg, fixed),
        reference_loss=_reference(loss_type), left_padded=("prompt_ids", "prompt_mask"),
        count_items=lambda b: int(b["completion_mask"].sum()),
        normalize=Normalize(mode, items=_items) if named else None,  # type: ignore[arg-type]
        item_losses=token_losses if named else None,
    )  # fmt: skip


def grpo() -> ReplaySpec:
    return spec("grpo")


def sapo() -> ReplaySpec:
    return spec("sapo")


def bnpo() -> ReplaySpec:
    return spec("bnpo")


def dr_grpo() -> ReplaySpec:
    return spec("dr_grpo")


def dapo() -> ReplaySpec:
    return spec("dapo")


def cispo() -> ReplaySpec:
    return spec("cispo")


def vespo() -> ReplaySpec:
    return spec("vespo")


def luspo() -> ReplaySpec:
    return spec("luspo")


def dapo_spg2() -> ReplaySpec:
    """dapo with steps_per_generation = 2 x GA: trl rescales the generation batch's token count."""
    return spec("dapo", spg=2)


def bnpo_fixed() -> ReplaySpec:
    """bnpo through `WholeBatchGRPOTrainer`: each window's global token count."""
    return spec("bnpo", fixed=True)
