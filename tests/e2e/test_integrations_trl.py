"""`wholebatch.integrations.trl` against the real trl 1.16 `SFTTrainer` / `DPOTrainer`, on 2 gloo ranks.

One world call runs every W-rank case (trl and transformers import once per
rank): each a real `trainer.train()` for ONE optimizer step of K = 3 (SFT) or 2
(DPO) micro-batches per rank, float64 tiny models, a callback copying every
gradient just before the optimizer step (after DDP's mean, no clipping), and a
spy on `get_batch_samples` keeping the micro-batches each rank really trained on
(after trl's own preprocessing: tokenizing, label masks, packing, collation).
The two one-process DPO cases run in the test process (which has trl imported
for the references anyway). The REFERENCE is one process on all of them:

- SFT: next-token cross-entropy summed over every SEQUENCE the ranks trained on,
  each run alone (padded rows cut at their attention mask, padding-free and
  packed rows split where `position_ids` restart), over the count of shifted
  labels != -100. SFT modes (`SFT_MODES`): plain LM (padded), padding-free,
  bfd packing (padding-free), wrapped packing (padded), completion-only loss on
  a prompt-completion dataset; GPT-2 and Llama each.
- DPO: the sigmoid DPO loss averaged over every pair of the step, log-probs
  summed over each completion, the reference model a frozen copy. "even": W
  ranks; "short": one process whose window holds 2, 2 and 1 pairs (`DPO_MODES`).

Mutations, the plain trainer where trl is wrong: `SFTTrainer` on GPT-2 in plain
LM mode and with wrapped packing (it divides by the unshifted label count: its
scale is used / counted), `DPOTrainer` on the short window (its gradient
is that of the mean of per-micro-batch means, checked against that wrong form too). Everywhere else plain trl is already exact, and the
test says so: both trainers are asserted equal to the reference.

Exactness floor: trl's fused LM head keeps its log-sum-exp running sums and
gradient tiles in float32 (trl/kernels/chunked_logprob.py) even for a float64
model: measured 4e-8 to 1.8e-7 relative over the cases; asserted <= 1e-6, far
below the plain trainers' errors (0.125 to 0.32). bf16 is switched off (SFTConfig
and DPOConfig default to bf16=True).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import tempfile
from collections.abc import Iterator
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


def _text(gen: torch.Generator, n: int) -> str:
    return " ".join(f"t{i}" for i in _ids(gen, n))


# SFTConfig per SFT mode. Padding-free without packing needs max_length=None (trl refuses it
# otherwise); bfd packing turns padding-free on itself; wrapped packing stays padded.
SFT_MODES: dict[str, dict[str, Any]] = {
    "lm": {},
    "padding_free": {"padding_free": True, "max_length": None},
    "packing": {"packing": True, "packing_strategy": "bfd", "max_length": 16},
    "wrapped": {"packing": True, "packing_strategy": "wrapped", "max_length": 8},
    "completion": {"completion_only_loss": True},
}
# Where the plain SFTTrainer is wrong: GPT-2 (counted unshifted) where a row's first label
# is a target. Padding-free (and so bfd packing) sets each sequence's first label to -100,
# completion-only masks the prompt: there the two counts agree and plain trl is exact.
PLAIN_WRONG = frozenset({("gpt2", "lm"), ("gpt2", "wrapped")})


def sft_rows(k: int, mode: str) -> list[dict[str, Any]]:
    """The SFT dataset: ragged pre-tokenized sequences (enough to pack W·K·B rows), or text pairs."""
    gen = torch.Generator().manual_seed(3)
    if mode == "completion":
        return [
            {"prompt": _text(gen, 1 + i % 4), "completion": _text(gen, 1 + (i * 3) % 5)}
            for i in range(W * k * B)
        ]
    lengths = [5, 9, 3, 12, 7, 4, 10, 2, 6, 11, 8, 3]
    if mode in ("packing", "wrapped"):
        lengths = lengths * 4  # 280 tokens: >= W·K·B packed rows of 16 (bfd) or 8 (wrapped)
    return [{"input_ids": _ids(gen, n)} for n in lengths]


# DPO modes. "even": W ranks, accelerate's even batches give every micro-batch B pairs
# (both trainers exact). "short": ONE process (in the test process itself), K = 3, a
# dataset of K·B - 1 pairs: the window's micro-batches hold 2, 2 and 1 pairs, and the plain
# DPOTrainer's mean of per-micro-batch means weights the lone pair 1/3 instead of 1/5. On
# W ranks trl cannot run a short micro-batch at all: even_batches=True pads it with pairs
# from the start, and with even_batches=False trl's metrics (`accelerator.gather` of the
# per-pair rewards, ragged across ranks) abort gloo ("Received data size doesn't match").
DPO_MODES: dict[str, dict[str, Any]] = {"even": {}, "short": {}}
DPO_K = {"even": 2, "short": 3}


def dpo_rows(k: int, mode: str) -> list[dict[str, str]]:
    gen = torch.Generator().manual_seed(5)
    n = W * k * B if mode == "even" else k * B - 1
    return [
        {
            "prompt": _text(gen, 2 + i % 3),
            "chosen": _text(gen, 1 + i % 4),
            "rejected": _text(gen, 2 + (i * 5) % 3),
        }
        for i in range(n)
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


def _train(kind: str, name: str, mode: str, fixed: bool) -> dict[str, Any]:
    import trl
    from datasets import Dataset

    from wholebatch.integrations import trl as ours

    k = 3 if kind == "sft" else DPO_K[mode]
    if kind == "sft":
        base = ours.WholeBatchSFTTrainer if fixed else trl.SFTTrainer
        config_cls, rows, extra_args = trl.SFTConfig, sft_rows(k, mode), SFT_MODES[mode]
    else:
        base = ours.WholeBatchDPOTrainer if fixed else trl.DPOTrainer
        config_cls, rows, extra_args = trl.DPOConfig, dpo_rows(k, mode), DPO_MODES[mode]
    seen: list[Any] = []
    cls = _spy(base, seen)
    grab, grads = _callbacks()
    with _accelerate(), tempfile.TemporaryDirectory() as out:
        args = config_cls(
            output_dir=out, per_device_train_batch_size=B, gradient_accumulation_steps=k,
            max_steps=1, learning_rate=1e-3, max_grad_norm=0.0, use_cpu=True, report_to=[],
            save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
            train_sampling_strategy="sequential", dataset_num_proc=None, bf16=False,
            **extra_args,
        )  # fmt: skip
        model = build_model(name)
        extra = {"ref_model": copy.deepcopy(model)} if kind == "dpo" else {}
        trainer = cls(
            model=model, args=args, train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer(), callbacks=[grab], **extra,
        )  # fmt: skip
        trainer.train()
    return {"grads": grads, "seen": seen}


@contextlib.contextmanager
def _accelerate() -> Iterator[None]:
    """A harness rank's gloo group, or (the one-process cases, in the test process) none."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    if dist.is_initialized():
        with accelerate_on_harness_group():
            yield
        return
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


Case = tuple[str, str, str, bool]  # (kind, model, mode, fixed)
WORLD_CASES: list[Case] = [
    *(("sft", name, mode, fixed) for name in ("gpt2", "llama") for mode in SFT_MODES
      for fixed in (True, False)),
    *(("dpo", "gpt2", "even", fixed) for fixed in (True, False)),
]  # fmt: skip
ONE_PROCESS_CASES: list[Case] = [("dpo", "gpt2", "short", fixed) for fixed in (True, False)]
CASES = WORLD_CASES + ONE_PROCESS_CASES


def trl_world() -> dict[Case, dict[str, Any]]:
    return {case: _train(*case) for case in WORLD_CASES}


# -- references -----------------------------------------------------------------------


def _segments(b: dict[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """(input_ids, labels) of every sequence in a micro-batch, unpadded, unpacked.

    Padding-free and packed rows are split where `position_ids` restart at 0; padded
    rows are cut at their attention mask's length.
    """
    out = []
    for r in range(b["input_ids"].shape[0]):
        ids, labels = b["input_ids"][r], b["labels"][r]
        if "position_ids" in b:
            starts = (b["position_ids"][r] == 0).nonzero().flatten().tolist()
            bounds = [*starts, ids.numel()]
            out += [(ids[s:e], labels[s:e]) for s, e in itertools.pairwise(bounds)]
        else:
            n = int(b["attention_mask"][r].sum()) if "attention_mask" in b else ids.numel()
            out.append((ids[:n], labels[:n]))
    return out


def sft_reference(name: str, batches: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Next-token cross-entropy summed over every sequence the ranks trained on, one at a time."""
    model = build_model(name)
    segments = [seg for b in batches for seg in _segments(b)]
    n = sum(int((labels[1:] != -100).sum()) for _, labels in segments)
    total = sum(
        F.cross_entropy(
            model(input_ids=ids[None]).logits[0, :-1], labels[1:], ignore_index=-100,
            reduction="sum",
        )
        for ids, labels in segments
        if ids.numel() > 1
    )  # fmt: skip
    (total / n).backward()  # type: ignore[union-attr]
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _completion_logps(model: Any, b: dict[str, Tensor]) -> Tensor:
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
    return (logp * b["completion_mask"][:, 1:]).sum(1)  # [2P]: chosen rows, then rejected


def dpo_reference(
    name: str, batches: list[dict[str, Tensor]], beta: float, *, mean_of_means: bool = False
) -> dict[str, Tensor]:
    """The sigmoid DPO loss's mean over every pair (or, the known-wrong form, the mean of
    each micro-batch's mean: what the plain DPOTrainer computes in one process)."""
    policy, ref = build_model(name), build_model(name)
    terms = []
    for b in batches:
        pc, pr = _completion_logps(policy, b).chunk(2)
        with torch.no_grad():
            rc, rr = _completion_logps(ref, b).chunk(2)
        terms.append(-F.logsigmoid(beta * ((pc - rc) - (pr - rr))))
    loss = (
        torch.stack([t.mean() for t in terms]).mean() if mean_of_means else torch.cat(terms).mean()
    )
    loss.backward()
    return {k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None}


def rel_error(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    assert want and set(want) <= set(got), set(want) ^ set(got)
    diff = sum(float((got[k] - want[k]).pow(2).sum()) for k in want)
    return (diff / sum(float(want[k].pow(2).sum()) for k in want)) ** 0.5


def scale(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    dot = sum(float((got[k] * want[k]).sum()) for k in want)
    return dot / sum(float(want[k].pow(2).sum()) for k in want)


@pytest.fixture(scope="module")
def world() -> list[dict[Case, dict[str, Any]]]:
    """Rank r's results (the W-rank world), the one-process cases merged into rank 0's."""
    import os

    if any(os.environ.get(v) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        pytest.fail("the one-process trl cases need a test process without torchrun's RANK")
    outs = run_ranks(W, trl_world, timeout=420)
    outs[0].update({case: _train(*case) for case in ONE_PROCESS_CASES})
    return outs


def _batches(outs: list[Any], case: Case) -> list[dict[str, Tensor]]:
    return [b for out in outs if case in out for b in out[case]["seen"]]  # every rank's


def _reference(outs: list[Any], case: Case) -> dict[str, Tensor]:
    kind, name = case[:2]
    if kind == "sft":
        return sft_reference(name, _batches(outs, case))
    import trl

    beta = trl.DPOConfig.__dataclass_fields__["beta"].default
    return dpo_reference(name, _batches(outs, case), beta)


def _plain_exact(case: Case) -> bool:
    kind, name, mode, _ = case
    return (name, mode) not in PLAIN_WRONG if kind == "sft" else mode != "short"


def _check_exact(world: list[Any], case: Case) -> None:
    ref = _reference(world, case)
    for rank, outs in enumerate(o for o in world if case in o):
        err = rel_error(outs[case]["grads"], ref)
        assert err <= TOL, (
            f"rank {rank}: {case} off by {err:.3g} (scale {scale(outs[case]['grads'], ref):.4f})"
        )


@pytest.mark.parametrize("case", [c for c in CASES if c[3]], ids=str)
def test_step_is_the_whole_batch(world: list[Any], case: Case) -> None:
    _check_exact(world, case)


@pytest.mark.parametrize("case", [c for c in CASES if not c[3] and _plain_exact(c)], ids=str)
def test_plain_trainer_is_already_exact_here(world: list[Any], case: Case) -> None:
    """trl is right in these modes: both trainers equal the reference (no invented failure)."""
    if case[:2] == ("sft", "gpt2"):  # why: GPT-2's unshifted count equals the shifted one here
        batches = _batches(world, case)
        used = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        assert used == sum(int((b["labels"] != -100).sum()) for b in batches)
    _check_exact(world, case)


@pytest.mark.parametrize("case", [c for c in CASES if not c[3] and not _plain_exact(c)], ids=str)
def test_mutation_plain_trainer_fails_the_same_assertion(world: list[Any], case: Case) -> None:
    ref = _reference(world, case)
    got = world[0][case]["grads"]
    assert rel_error(got, ref) > 1e-3, (
        f"the plain trainer matched on {case}: the test could not fail"
    )
    batches = _batches(world, case)
    if case[0] == "sft":  # GPT-2: it divides by the unshifted count
        used = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        counted = sum(int((b["labels"] != -100).sum()) for b in batches)
        assert scale(got, ref) == pytest.approx(used / counted, rel=1e-6)
    else:  # DPO: a micro-batch of one pair among micro-batches of B, and a mean of means
        pairs = sorted(int(b["input_ids"].shape[0]) // 2 for b in batches)
        assert pairs[0] < pairs[-1], pairs
        import trl

        beta = trl.DPOConfig.__dataclass_fields__["beta"].default
        wrong = dpo_reference(case[1], batches, beta, mean_of_means=True)
        assert rel_error(got, wrong) <= TOL, "the plain DPOTrainer is not the mean of means"
