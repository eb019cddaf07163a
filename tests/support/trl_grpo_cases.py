"""trl's GRPO loss types measured against the whole-batch normalisation modes (trl==1.16.0).

trl's own `GRPOTrainer._compute_loss` runs on fixed rollouts (a tiny Llama from a
config, float64, ragged completions) for W = 2 ranks x gradient accumulation 3,
simulated in one process: under DDP's mean the step's gradient is
(1/W) sum over ranks and micro-batches of each loss's gradient. The trainer is
built without `__init__` (no generation, no reward model): only the attributes
`_compute_loss` reads are set, so the loss code measured is trl's, unchanged.

On-policy (old log-probs = log-probs, ratio 1, no clipping active) every loss
type's per-token gradient is -A_b * d log p_t, so the loss types differ only in
how they weight tokens: exactly what the modes define. Each is compared with
each mode's whole-batch definition (and its per-micro-batch version).

Legend: W ranks, K micro-batches per rank (trl's accumulation steps), B
completions per micro-batch, T completion tokens (padded), S = W K B sequences.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

W, K, B, PROMPT, T_MAX, VOCAB = 2, 3, 2, 3, 8, 32
LOSS_TYPES = ("grpo", "sapo", "bnpo", "dr_grpo", "dapo", "cispo", "vespo", "luspo")
# What each loss type means by the batch's loss (trl's docs), as a whole-batch mode.
INTENDED = {
    "grpo": "sequence",
    "sapo": "sequence",
    "bnpo": "token",
    "dr_grpo": "constant",
    "dapo": "token",
    "cispo": "token",
    "vespo": "token",
    "luspo": "sequence_sum",
}


class _Accelerator:
    """What `_compute_loss` asks of accelerate on one simulated rank (metrics only)."""

    num_processes = W
    sync_gradients = True
    is_main_process = True

    def gather(self, x: Tensor) -> Tensor:
        return x

    gather_for_metrics = gather

    def reduce(self, x: Tensor, reduction: str = "sum") -> Tensor:
        return x

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        yield


def rollouts(seed: int = 0, windows: int = 1) -> list[list[dict[str, Tensor]]]:
    """[rank][micro-batch] of fixed GRPO inputs with ragged completions (1..T_MAX tokens)."""
    out: list[list[dict[str, Tensor]]] = [[] for _ in range(W)]
    for r in range(W):
        gen = torch.Generator().manual_seed(1000 * seed + r)  # a rank's first window: any `windows`
        for _ in range(K * windows):
            lengths = torch.randint(1, T_MAX + 1, (B,), generator=gen)
            t = int(lengths.max())
            mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
            out[r].append(
                {
                    "prompt_ids": torch.randint(1, VOCAB, (B, PROMPT), generator=gen),
                    "prompt_mask": torch.ones(B, PROMPT, dtype=torch.long),
                    "completion_ids": torch.randint(1, VOCAB, (B, t), generator=gen) * mask,
                    "completion_mask": mask,
                    "advantages": torch.randn(B, generator=gen, dtype=torch.float64),
                }
            )
    return out


def tiny_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).double()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def trainer(
    loss_type: str, model: Any, *, steps_per_generation: int = K, cls: type | None = None
) -> Any:
    """A `GRPOTrainer` (or subclass `cls`) with only what `_compute_loss` reads (GRPOConfig defaults)."""
    from trl import GRPOConfig, GRPOTrainer

    cfg = GRPOConfig(
        output_dir="/tmp/unused", loss_type=loss_type, report_to=[], use_cpu=True, bf16=False
    )
    cls = GRPOTrainer if cls is None else cls
    t = cls.__new__(cls)
    t.model = model
    t.accelerator = _Accelerator()
    cfg.steps_per_generation = steps_per_generation
    t.args = cfg
    t.loss_type = loss_type
    t.epsilon_low, t.epsilon_high = cfg.epsilon, cfg.epsilon_high or cfg.epsilon
    if loss_type == "cispo":
        t.epsilon_high = 5.0  # trl's recommended cispo bound; ratio 1 is never clipped
    t.beta = 0.0
    t.importance_sampling_level = "token"
    t.top_entropy_quantile = 1.0
    t.off_policy_mask_threshold = None
    t.use_vllm = False
    t.vllm_importance_sampling_correction = False
    t.current_gradient_accumulation_steps = K
    t.max_completion_length = T_MAX
    t._entropy_bonus_enabled = False
    t.aux_loss_enabled = False
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return t


def _grad(model: Any) -> Tensor:
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return g


def trl_gradient(loss_type: str, *, steps_per_generation: int = K) -> Tensor:
    """The step's gradient under trl: (1/W) sum over ranks and micro-batches, as DDP averages."""
    windows = steps_per_generation // K
    data = rollouts(windows=windows)
    model = tiny_model()
    t = trainer(loss_type, model, steps_per_generation=steps_per_generation)
    # trl's num_items_in_batch: completion tokens of the whole generation batch, every rank
    n_gen = sum(int(mb["completion_mask"].sum()) for rank in data for mb in rank)
    for rank in data:
        for mb in rank[:K]:  # the first accumulation window of the generation batch
            inputs = {**mb, "num_items_in_batch": torch.tensor(float(n_gen), dtype=torch.float64)}
            (t._compute_loss(model, inputs) / W).backward()
    return _grad(model)


def per_token_logps(model: Any, mb: dict[str, Tensor]) -> Tensor:
    """log p of each completion token [B, T], by trl's own helper."""
    t = trainer("dapo", model)
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    am = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    logps, _, _ = t._get_per_token_logps_and_entropies(model, ids, am, mb["completion_ids"].size(1))
    out: Tensor = logps
    return out


def plain_logps(model: Any, mb: dict[str, Tensor]) -> Tensor:
    """log p of each completion token [B, T] from the model's own float64 logits.

    The same numbers as trl's fused LM head, without its chunked kernel.
    """
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    am = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    t = mb["completion_ids"].size(1)
    logits_BTV = model(input_ids=ids, attention_mask=am).logits[:, -t - 1 : -1]
    out: Tensor = logits_BTV.log_softmax(-1).gather(-1, mb["completion_ids"][..., None])[..., 0]
    return out


def definition_gradient(
    mode: str,
    *,
    per_micro_batch: bool = False,
    logps: Callable[[Any, dict[str, Tensor]], Tensor] | None = None,
) -> Tensor:
    """The gradient of the mode's whole-batch loss on the same rollouts (per-token loss -A log p)."""
    logps = per_token_logps if logps is None else logps
    data = rollouts()
    model = tiny_model()
    mbs = [mb for rank in data for mb in rank]
    s_total = len(mbs) * B
    n_total = sum(int(mb["completion_mask"].sum()) for mb in mbs)
    for mb in mbs:
        m = mb["completion_mask"].to(torch.float64)
        loss_BT = -mb["advantages"][:, None] * logps(model, mb) * m
        n, s = (float(m.sum()), B) if per_micro_batch else (float(n_total), s_total)
        if mode == "token":
            loss = loss_BT.sum() / n
        elif mode == "sequence":
            loss = (loss_BT.sum(1) / m.sum(1).clamp(min=1.0)).sum() / s
        elif mode == "constant":
            loss = loss_BT.sum() / (T_MAX * s)
        elif mode == "sequence_sum":
            loss = loss_BT.sum() / s
        else:
            raise ValueError(mode)
        if per_micro_batch:
            loss = loss / (W * K)
        loss.backward()
    return _grad(model)


@dataclasses.dataclass(frozen=True)
class Row:
    """One loss type measured: its relative gradient error against each definition."""

    loss_type: str
    intended: str
    errors: dict[str, float]  # mode (or "mode per micro-batch") -> ||g_trl - g|| / ||g||

    @property
    def matches(self) -> str | None:
        """The definition trl's gradient equals (to 1e-6: the Llama's float32 norms), if any."""
        best = min(self.errors, key=self.errors.__getitem__)
        return best if self.errors[best] < 1e-6 else None


def measure(
    loss_types: tuple[str, ...] = LOSS_TYPES, *, steps_per_generation: int = K
) -> list[Row]:
    """Every loss type against every definition, whole step and per micro-batch."""
    refs = {
        (mode if not per_mb else f"{mode} per micro-batch"): definition_gradient(
            mode, per_micro_batch=per_mb
        )
        for mode in ("token", "sequence", "constant", "sequence_sum")
        for per_mb in (False, True)
    }
    rows = []
    for lt in loss_types:
        g = trl_gradient(lt, steps_per_generation=steps_per_generation)
        errors = {name: float((g - ref).norm() / ref.norm()) for name, ref in refs.items()}
        rows.append(Row(lt, INTENDED[lt], errors))
    return rows


def main() -> None:
    """Print the table of docs/accumulation.md: `python -m tests.support.trl_grpo_cases`."""
    import trl

    names = ["token", "sequence", "constant", "sequence_sum"]
    print(
        f"trl {trl.__version__}, W={W} x GA={K}, B={B} completions per micro-batch, 1..{T_MAX} tokens"
    )
    head = " ".join(f"{n:>13} {'(per mb)':>9}" for n in names)
    print(f"{'loss_type':<24} {'matches':<22} {head}")
    cases = [(r, "") for r in measure()]
    cases += [(r, " spg=2xGA") for r in measure(("dapo",), steps_per_generation=2 * K)]
    for row, tag in cases:
        errs = " ".join(
            f"{row.errors[n]:>13.2e} {row.errors[n + ' per micro-batch']:>9.2e}" for n in names
        )
        print(f"{row.loss_type + tag:<24} {row.matches or 'none':<22} {errs}")


if __name__ == "__main__":
    main()
