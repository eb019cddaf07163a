"""`WholeBatchGRPOTrainer` on 2 gloo ranks: trl's own buffering and loss on fixed rollouts (trl==1.16.0).

Each rank runs trl's real `_prepare_inputs` (shuffle, split into
`steps_per_generation` micro-batches, buffer) and `_compute_loss` on a fixed
generation batch: only `_generate_and_score_completions` is replaced, by a
function returning that rank's rollouts (tests/support/trl_grpo_cases.py's, padded
to T_MAX) with trl's `num_items_in_batch` (the generation batch's completion
tokens over every rank). The window token counts go through the real gloo group
(`wholebatch.comm.agree_rows`). For every accumulation window of the buffer each
rank returns its summed gradient and the micro-batches it trained on; the test
averages the gradients over ranks (DDP's mean) and compares them with one
process computing the token mean over all the window's micro-batches.

Legend: W = 2 ranks, K = 3 accumulation steps, B completions per micro-batch,
T_MAX completion tokens (padded).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tests.support import trl_grpo_cases as cases

# (loss_type, steps_per_generation, fixed trainer?)
Case = tuple[str, int, bool]
CASES: list[Case] = [
    (lt, spg, fixed)
    for lt in ("bnpo", "dapo")
    for spg in (cases.K, 2 * cases.K)
    for fixed in (True, False)
] + [(lt, 2 * cases.K, fixed) for lt in ("cispo", "vespo") for fixed in (True, False)]
CASES += [("grpo", cases.K, True), ("grpo", cases.K, False)]  # last: left as trl does it
KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")


def generation_batch(rank: int, spg: int) -> dict[str, Tensor]:
    """A rank's generation batch: its `spg` micro-batches of rollouts, padded to T_MAX, concatenated."""
    data = cases.rollouts(windows=spg // cases.K)
    n_items = sum(int(mb["completion_mask"].sum()) for r in data for mb in r)

    def pad(x: Tensor) -> Tensor:
        return torch.nn.functional.pad(x, (0, cases.T_MAX - x.size(1)))

    mbs = data[rank]
    out = {
        "prompt_ids": torch.cat([mb["prompt_ids"] for mb in mbs]),
        "prompt_mask": torch.cat([mb["prompt_mask"] for mb in mbs]),
        "completion_ids": torch.cat([pad(mb["completion_ids"]) for mb in mbs]),
        "completion_mask": torch.cat([pad(mb["completion_mask"]) for mb in mbs]),
        "advantages": torch.cat([mb["advantages"] for mb in mbs]),
        # trl: accelerator.gather(loss_mask.sum()).sum(), the whole generation batch
        "num_items_in_batch": torch.tensor(n_items),
    }
    return out


def _run(case: Case) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from transformers import TrainerState
    from trl import GRPOTrainer

    from wholebatch.integrations.trl import WholeBatchGRPOTrainer

    loss_type, spg, fixed = case
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # trl's shuffle of the generation batch: differs per rank
    model = cases.tiny_model()
    model.train()
    cls = WholeBatchGRPOTrainer if fixed else GRPOTrainer
    t = cases.trainer(loss_type, model, steps_per_generation=spg, cls=cls)
    t.args.gradient_accumulation_steps = cases.K
    t.num_iterations = 1
    t._step = 0
    t._buffered_inputs = None
    t.state = TrainerState()
    if fixed:
        t._check_windows()
    batch = generation_batch(rank, spg)
    t._generate_and_score_completions = lambda _prompts: dict(batch)
    windows = []
    for _ in range(spg // cases.K):
        seen = []
        for _ in range(cases.K):  # trl's training_step: _prepare_inputs, compute_loss, backward
            inputs = t._prepare_inputs({})
            t._compute_loss(model, inputs).backward()
            t._step += 1
            seen.append({k: inputs[k].clone() for k in KEYS})
        windows.append({"grad": cases._grad(model), "seen": seen})
    return windows


def grpo_world() -> dict[Case, list[dict[str, Any]]]:
    """Every case on this rank (run by tests/support/harness.py's `run_ranks`)."""
    return {case: _run(case) for case in CASES}


def token_mean_gradient(mbs: list[dict[str, Tensor]]) -> Tensor:
    """One process: the gradient of (sum of every token's -A log p) / (tokens of all `mbs`)."""
    model = cases.tiny_model()
    n_total = sum(float(mb["completion_mask"].sum()) for mb in mbs)
    for mb in mbs:
        m = mb["completion_mask"].to(torch.float64)
        loss_BT = -mb["advantages"][:, None] * cases.per_token_logps(model, mb) * m
        (loss_BT.sum() / n_total).backward()
    return cases._grad(model)


def window_errors(world: list[dict[Case, list[dict[str, Any]]]], case: Case) -> list[float]:
    """Per window: ||mean over ranks of the gradient - token-mean reference|| / ||reference||."""
    out = []
    for j in range(len(world[0][case])):
        got = sum(w[case][j]["grad"] for w in world) / cases.W  # DDP's mean
        want = token_mean_gradient([mb for w in world for mb in w[case][j]["seen"]])
        out.append(float((got - want).norm() / want.norm()))
    return out


def main() -> None:
    """Print docs/accumulation.md's column: `python -m tests.support.trl_grpo_fix`."""
    from tests.support import trl_grpo_fix  # by its name, so the ranks can import it
    from tests.support.harness import run_ranks, shutdown_worlds

    world = run_ranks(cases.W, trl_grpo_fix.grpo_world, timeout=240)
    try:
        for case in CASES[:-2]:
            lt, spg, fixed = case
            who = "WholeBatchGRPOTrainer" if fixed else "GRPOTrainer"
            errs = ", ".join(f"{e:.2e}" for e in window_errors(world, case))
            print(f"{lt:<5} spg={spg} {who:<22} vs window token mean, per window: {errs}")
    finally:
        shutdown_worlds()


if __name__ == "__main__":
    main()


def _train_model() -> Any:
    """A float64 tiny Llama whose LM head is zero: uniform sampling, so EOS ends some completions early."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).double()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model


def train_first_step(loss_type: str, *, fixed: bool) -> dict[str, Any]:
    """One process, a real `trainer.train()` (generation, reward, buffering): GA 3, spg 6.

    Returns the first optimizer step's gradient (before the step, no clipping) and
    the micro-batches its 3 `_compute_loss` calls saw.
    """
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from tests.support.word_tokenizer import tokenizer
    from wholebatch.integrations.trl import WholeBatchGRPOTrainer

    grads: list[Tensor] = []

    class Grab(transformers.TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not grads:
                grads.append(
                    torch.cat([p.grad.reshape(-1).clone() for p in kw["model"].parameters()])
                )

    prompts = [" ".join(f"t{4 + i + j}" for j in range(3)) for i in range(6)]
    args = GRPOConfig(
        output_dir="/tmp/unused", per_device_train_batch_size=2, num_generations=2,
        gradient_accumulation_steps=cases.K, steps_per_generation=2 * cases.K,
        max_completion_length=8, max_steps=1, max_grad_norm=0.0, use_cpu=True, bf16=False,
        report_to=[], loss_type=loss_type, save_strategy="no", seed=3,
    )  # fmt: skip
    cls = WholeBatchGRPOTrainer if fixed else GRPOTrainer
    trainer = cls(
        model=_train_model(),
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer(),
        callbacks=[Grab()],
    )
    seen: list[dict[str, Tensor]] = []
    compute = trainer._compute_loss

    def spy(model: Any, inputs: dict[str, Any]) -> Tensor:
        if len(seen) < cases.K:
            seen.append({k: inputs[k].detach().clone() for k in KEYS})
        out: Tensor = compute(model, inputs)
        return out

    trainer._compute_loss = spy
    trainer.train()
    return {"grad": grads[0], "seen": seen}


def train_reference(mbs: list[dict[str, Tensor]]) -> Tensor:
    """One process: the token mean over `mbs` on `_train_model()` (trl's fused head, as trained)."""
    from trl.trainer.utils import add_fused_lm_head

    model = _train_model()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    n_total = sum(float(mb["completion_mask"].sum()) for mb in mbs)
    for mb in mbs:
        m = mb["completion_mask"].to(torch.float64)
        loss_BT = -mb["advantages"][:, None] * cases.per_token_logps(model, mb) * m
        (loss_BT.sum() / n_total).backward()
    return cases._grad(model)
