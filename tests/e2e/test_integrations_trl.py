"""`wholebatch.integrations.trl` against the real trl 1.16 `SFTTrainer` / `DPOTrainer`, on 2 gloo ranks.

One world call runs every case (trl and transformers import once per rank):
each a real `trainer.train()` for ONE optimizer step of K = 3 (SFT) or 2 (DPO)
micro-batches per rank, float64 tiny models, a callback copying every gradient
just before the optimizer step (after DDP's mean, no clipping), and a spy on
`get_batch_samples` keeping the micro-batches each rank really trained on
(after trl's own preprocessing). The REFERENCE is one process on all of them:

- SFT: the token mean of next-token cross-entropy over every rank's
  micro-batches (sum over all / the count of shifted labels != -100);
- DPO: the sigmoid DPO loss averaged over every pair of the step, log-probs
  summed over each completion, the reference model a frozen copy.

Mutation: the plain `SFTTrainer` on GPT-2 (plain LM mode) must fail the same
assertion (it counts the unshifted labels). Llama is exact in both; DPO with
equal pairs per micro-batch (what accelerate's even batches give) is exact in
both too, so it is checked for exactness only.

Exactness floor: trl's fused LM head keeps its log-sum-exp running sums and
gradient tiles in float32 (trl/kernels/chunked_logprob.py) even for a float64
model: measured 1.2e-7 / 1.3e-7 relative (Llama / GPT-2); asserted <= 1e-6, far
below the plain SFTTrainer's error on GPT-2. bf16 is switched off (SFTConfig and
DPOConfig default to bf16=True).
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.support.harness import run_ranks
from tests.support.peers import SKIP_REASON, accelerate_on_harness_group, peer_root
from tests.support.word_tokenizer import VOCAB, tokenizer

pytestmark = pytest.mark.skipif(peer_root("trl") is None, reason=SKIP_REASON.format("trl"))

W, B = 2, 2
TOL = 1e-6  # trl's float32 log-prob kernel: measured 1.3e-7 (module docstring)


def build_model(name: str) -> Any:
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=8, n_layer=1, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    return model.double()


def _ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=gen).tolist()


def sft_rows(k: int) -> list[dict[str, list[int]]]:
    """W·K·B pre-tokenized sequences of ragged lengths (plain LM: every token is a label)."""
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 9, 3, 12, 7, 4, 10, 2, 6, 11, 8, 3][: W * k * B]
    return [{"input_ids": _ids(gen, n)} for n in lengths]


def dpo_rows(k: int) -> list[dict[str, str]]:
    gen = torch.Generator().manual_seed(5)

    def text(n: int) -> str:
        return " ".join(f"t{i}" for i in _ids(gen, n))

    return [
        {"prompt": text(2 + i % 3), "chosen": text(1 + i % 4), "rejected": text(2 + (i * 5) % 3)}
        for i in range(W * k * B)
    ]


def _callbacks() -> tuple[Any, dict[str, Tensor]]:
    import transformers

    grads: dict[str, Tensor] = {}

    class Grab(transformers.TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            grads.update(
                {
                    n: p.grad.detach().clone()
                    for n, p in kw["model"].named_parameters()
                    if p.grad is not None
                }
            )

    return Grab(), grads


def _spy(cls: type, seen: list[Any]) -> type:
    orig = cls.get_batch_samples  # type: ignore[attr-defined]

    def get_batch_samples(self: Any, *a: Any) -> Any:
        batches, n = orig(self, *a)
        seen.extend({k: v.clone() for k, v in b.items() if isinstance(v, Tensor)} for b in batches)
        return batches, n

    return type(cls.__name__, (cls,), {"get_batch_samples": get_batch_samples})


def _train(kind: str, name: str, fixed: bool) -> dict[str, Any]:
    import trl
    from datasets import Dataset

    from wholebatch.integrations import trl as ours

    k = 3 if kind == "sft" else 2
    if kind == "sft":
        base = ours.WholeBatchSFTTrainer if fixed else trl.SFTTrainer
        config_cls, rows = trl.SFTConfig, sft_rows(k)
    else:
        base = ours.WholeBatchDPOTrainer if fixed else trl.DPOTrainer
        config_cls, rows = trl.DPOConfig, dpo_rows(k)
    seen: list[Any] = []
    cls = _spy(base, seen)
    grab, grads = _callbacks()
    with accelerate_on_harness_group(), tempfile.TemporaryDirectory() as out:
        args = config_cls(
            output_dir=out, per_device_train_batch_size=B, gradient_accumulation_steps=k,
            max_steps=1, learning_rate=1e-3, max_grad_norm=0.0, use_cpu=True, report_to=[],
            save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
            train_sampling_strategy="sequential", dataset_num_proc=None, bf16=False,
        )  # fmt: skip
        model = build_model(name)
        extra = {"ref_model": copy.deepcopy(model)} if kind == "dpo" else {}
        trainer = cls(
            model=model, args=args, train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer(), callbacks=[grab], **extra,
        )  # fmt: skip
        trainer.train()
    return {"grads": grads, "seen": seen}


CASES = [
    ("sft", "gpt2", True),
    ("sft", "gpt2", False),
    ("sft", "llama", True),
    ("sft", "llama", False),
    ("dpo", "gpt2", True),
]


def trl_world() -> dict[tuple[str, str, bool], dict[str, Any]]:
    return {case: _train(*case) for case in CASES}


# -- references -----------------------------------------------------------------------


def _shifted_ce_sum(model: Any, b: dict[str, Tensor]) -> Tensor:
    logits = model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask")).logits
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1),
        b["labels"][:, 1:].flatten(),
        ignore_index=-100,
        reduction="sum",
    )


def sft_reference(name: str, batches: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    model = build_model(name)
    n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    loss = sum(_shifted_ce_sum(model, b) for b in batches) / n
    loss.backward()  # type: ignore[union-attr]
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _completion_logps(model: Any, b: dict[str, Tensor]) -> Tensor:
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
    return (logp * b["completion_mask"][:, 1:]).sum(1)  # [2P]: chosen rows, then rejected


def dpo_reference(name: str, batches: list[dict[str, Tensor]], beta: float) -> dict[str, Tensor]:
    policy, ref = build_model(name), build_model(name)
    terms = []
    for b in batches:
        pc, pr = _completion_logps(policy, b).chunk(2)
        with torch.no_grad():
            rc, rr = _completion_logps(ref, b).chunk(2)
        terms.append(-F.logsigmoid(beta * ((pc - rc) - (pr - rr))))
    torch.cat(terms).mean().backward()
    return {k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None}


def rel_error(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    assert want and set(want) <= set(got), set(want) ^ set(got)
    diff = sum(float((got[k] - want[k]).pow(2).sum()) for k in want)
    return (diff / sum(float(want[k].pow(2).sum()) for k in want)) ** 0.5


def scale(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    dot = sum(float((got[k] * want[k]).sum()) for k in want)
    return dot / sum(float(want[k].pow(2).sum()) for k in want)


@pytest.fixture(scope="module")
def world() -> list[dict[tuple[str, str, bool], dict[str, Any]]]:
    return run_ranks(W, trl_world, timeout=300)


def _reference(kind: str, name: str, outs: list[Any], case: Any) -> dict[str, Tensor]:
    batches = [b for out in outs for b in out[case]["seen"]]  # every rank's micro-batches
    if kind == "sft":
        return sft_reference(name, batches)
    import trl

    return dpo_reference(name, batches, trl.DPOConfig.__dataclass_fields__["beta"].default)


@pytest.mark.parametrize("case", [c for c in CASES if c != ("sft", "gpt2", False)], ids=str)
def test_step_is_the_whole_batch(world: list[Any], case: tuple[str, str, bool]) -> None:
    ref = _reference(case[0], case[1], world, case)
    for rank, outs in enumerate(world):
        err = rel_error(outs[case]["grads"], ref)
        assert err <= TOL, (
            f"rank {rank}: {case} off by {err:.3g} (scale {scale(outs[case]['grads'], ref):.4f})"
        )


def test_mutation_plain_sft_trainer_gpt2_fails_the_same_assertion(world: list[Any]) -> None:
    case = ("sft", "gpt2", False)
    ref = _reference("sft", "gpt2", world, case)
    got = world[0][case]["grads"]
    assert rel_error(got, ref) > 1e-3, "the plain SFTTrainer matched: the test could not fail"
    batches = [b for out in world for b in out[case]["seen"]]
    used = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    counted = sum(int((b["labels"] != -100).sum()) for b in batches)
    assert scale(got, ref) == pytest.approx(
        used / counted, rel=1e-6
    )  # it divides by the unshifted count
