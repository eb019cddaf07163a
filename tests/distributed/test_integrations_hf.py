"""`WholeBatchTrainer` against a real transformers 5.23 `Trainer`, 2 gloo ranks x K micro-batches.

Each rank runs a real `Trainer.train()` for ONE optimizer step (accelerate
1.15 prepares the DDP model and shards the data loader over the ranks; the
harness's gloo group is reused through torchrun's environment variables). A
callback copies every parameter's gradient just before the optimizer step
(after DDP's mean, no clipping). The dataset is exactly one step's whole batch
(W x K x b sequences of ragged lengths, some labels masked, one micro-batch
with no labels at all), so the REFERENCE is one process computing the token
mean over the whole dataset in float64, sequence by sequence, without padding.

Exactness floors:
- a custom float64 loss (`compute_loss` override, `compute_loss_func`): the
  models compute in float64 throughout, so <= 1e-10 (relative, whole gradient);
- the model's own loss: transformers' `ForCausalLMLoss` casts the logits to
  float32 (`logits.float()`), so the token losses and their gradients carry
  float32 round-off: measured 4.7e-8 (GPT-2) and 5.7e-8 (Llama), asserted <= 1e-6;
- the logged loss: the Trainer sums it in a float32 tensor, <= 1e-6.

Measured on this data (54 target tokens): the plain Trainer steps GPT-2 with
0.947x the whole-batch gradient (it counts 57 tokens: every row's unmasked
first label), a custom `compute_loss` with 0.474x (GPT-2) / 0.500x (Llama);
it is exact for Llama's own loss and for `compute_loss_func` on Llama.

Mutation: the plain `Trainer` runs through the same assertion and must fail
where it is wrong (GPT-2's own loss; any custom `compute_loss`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.support.harness import run_ranks, run_ranks_outcomes
from tests.support.peers import SKIP_REASON, accelerate_on_harness_group

transformers = pytest.importorskip("transformers", reason=SKIP_REASON.format("transformers"))
pytest.importorskip("accelerate", reason=SKIP_REASON.format("accelerate"))

from wholebatch.errors import WholebatchError  # noqa: E402
from wholebatch.integrations.huggingface import (  # noqa: E402
    ItemShare,
    WholeBatchTrainer,
    WholeBatchTrainerMixin,
)

W, K, B = 2, 3, 2  # ranks, micro-batches per step, sequences per micro-batch
EVAL_ROWS = 4  # the first 4 sequences, one evaluation batch of 2 per rank
VOCAB = 40
FLOAT64_TOL = 1e-10  # the model and the loss in float64: round-off ~1e-15
CAST_TOL = 1e-6  # ForCausalLMLoss computes in float32: measured 4.7e-8 (GPT-2), 5.7e-8 (Llama)
LOGGED_TOL = 1e-6  # the Trainer's loss accumulator is float32: measured 3.4e-8


# ---------------------------------------------------------------------------
# Data: one step's whole batch
# ---------------------------------------------------------------------------


def sequences(empty: bool = True) -> list[dict[str, list[int]]]:
    """W*K*B ragged sequences; labels -100 on a "prompt"; micro-batch (k=1, rank 1) has none.

    With the sequential sampler accelerate deals micro-batch j (B sequences in
    dataset order) to rank j % W as its micro-batch j // W.
    """
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 9, 3, 12, 7, 4, 10, 2, 6, 11, 8, 3]
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        prompt = i % 3  # the first `prompt` labels carry no loss
        labels = [-100] * prompt + ids[prompt:]
        if (
            empty and i // B == 3
        ):  # dataset micro-batch 3 = rank 1's micro-batch 1: nothing to learn
            labels = [-100] * n
        out.append({"input_ids": ids, "labels": labels})
    return out


def collate(rows: Sequence[dict[str, list[int]]]) -> dict[str, Tensor]:
    """Right padding; padded labels -100."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = (
            torch.tensor(r["input_ids"]),
            torch.tensor(r["labels"]),
            1,
        )
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def build_model(name: str) -> Any:
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    elif name == "bart":  # encoder-decoder: labels are not shifted, the loss is a plain mean
        cfg = transformers.BartConfig(
            vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
            decoder_ffn_dim=16, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=2, forced_eos_token_id=None,
        )  # fmt: skip
        model = transformers.BartForConditionalGeneration(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    return model.double()


def shifted_ce_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of next-token cross-entropies in the logits' dtype (float64 here)."""
    return F.cross_entropy(
        logits[..., :-1, :].flatten(0, -2), labels[..., 1:].flatten(), ignore_index=-100,
        reduction="sum",
    )  # fmt: skip


def _seq2seq_ce_sum(model: Any, row: dict[str, list[int]]) -> Tensor:
    """An encoder-decoder's summed cross-entropy over one sequence's labels (unshifted)."""
    labels = torch.tensor([row["labels"]])
    logits = model(input_ids=torch.tensor([row["input_ids"]]), labels=labels).logits
    return F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")


def reference(
    name: str, empty: bool = True, rows: list[dict[str, list[int]]] | None = None
) -> tuple[float, dict[str, Tensor]]:
    """One process, every sequence on its own (no padding), float64: (mean loss, gradients)."""
    model = build_model(name)
    rows = sequences(empty) if rows is None else rows
    if name == "bart":  # every label is a target: the decoder reads them shifted right
        total = sum(sum(1 for t in r["labels"] if t != -100) for r in rows)
        loss_sum = sum(_seq2seq_ce_sum(model, r) for r in rows)
        loss = loss_sum / total
        loss.backward()  # type: ignore[union-attr]
        return float(loss.detach()), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }
    total = sum(sum(1 for t in r["labels"][1:] if t != -100) for r in rows)
    loss_sum = sum(
        shifted_ce_sum(
            model(input_ids=torch.tensor([r["input_ids"]])).logits, torch.tensor([r["labels"]])
        )
        for r in rows
    )
    loss = loss_sum / total
    loss.backward()  # type: ignore[union-attr]
    return float(loss.detach()), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


# ---------------------------------------------------------------------------
# Trainers: plain and whole-batch, with the model's loss or a custom one
# ---------------------------------------------------------------------------


def custom_compute_loss(
    self: Any, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
    num_items_in_batch: Any = None,
) -> Any:  # fmt: skip
    """A float64 loss the way users write it: the sum divided by num_items_in_batch."""
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    loss = shifted_ce_sum(outputs.logits, labels) / num_items_in_batch
    return (loss, outputs) if return_outputs else loss


def loss_func(outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
    """`compute_loss_func`: float64, divided by the count the Trainer hands it."""
    return shifted_ce_sum(outputs.logits, labels) / num_items_in_batch


class Grab(transformers.TrainerCallback):  # type: ignore[misc]
    """Copies the gradients just before the optimizer step, and the logged loss."""

    def __init__(self) -> None:
        self.grads: dict[str, Tensor] = {}
        self.logged: list[float] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.grads = {
            n: p.grad.detach().clone()
            for n, p in kw["model"].named_parameters()
            if p.grad is not None
        }

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.logged.append(float(logs["loss"]))


def _rank_train(
    name: str, fixed: bool, loss: str, empty: bool = True
) -> tuple[dict[str, Tensor], list[float], int, float]:
    """One optimizer step of a real Trainer on this rank.

    Returns (gradients, logged losses, the agreed item count or -1, and for
    loss="model" the evaluation loss of an untrained model on EVAL_ROWS, else nan).

    loss: "model" (the model's own), "custom" (a compute_loss override), "func"
    (compute_loss_func), "mean" (the model's own, from a model whose forward
    does not accept loss kwargs: it returns each micro-batch's mean), or
    "eval_first" (the model's own, after `trainer.evaluate()` on the same Trainer).
    """
    base = WholeBatchTrainer if fixed else transformers.Trainer
    cls = type("T", (base,), {"compute_loss": custom_compute_loss}) if loss == "custom" else base
    grab = Grab()
    items: list[int] = []
    if fixed:
        orig = cls.get_batch_samples

        def spy(self: Any, *a: Any) -> Any:
            batches, n = orig(self, *a)
            items.append(n.items)
            return batches, n

        cls = type("T", (cls,), {"get_batch_samples": spy})
    with accelerate_on_harness_group(), tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=B, gradient_accumulation_steps=K,
            max_steps=1, learning_rate=1e-3, max_grad_norm=0.0, use_cpu=True, report_to=[],
            save_strategy="no", logging_strategy="steps", logging_steps=1, disable_tqdm=True,
            train_sampling_strategy="sequential", remove_unused_columns=False, seed=0,
            per_device_eval_batch_size=EVAL_ROWS // W,
        )  # fmt: skip
        model = build_model(name)
        if loss == "mean":
            model.accepts_loss_kwargs = False  # what the Trainer reads to decide
        trainer = cls(
            model=model, args=args, train_dataset=sequences(empty), data_collator=collate,
            callbacks=[grab], compute_loss_func=loss_func if loss == "func" else None,
        )  # fmt: skip
        if loss == "eval_first":
            trainer.evaluate(eval_dataset=sequences()[:EVAL_ROWS])
        trainer.train()
        eval_loss = float("nan")
        if loss == "model":  # a fresh model; one eval batch per rank: the loss is the token mean
            fresh = cls(model=build_model(name), args=args, data_collator=collate)
            eval_loss = fresh.evaluate(eval_dataset=sequences()[:EVAL_ROWS])["eval_loss"]
    return grab.grads, grab.logged, items[0] if items else -1, eval_loss


def rel_error(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """||got - want|| / ||want|| over the whole gradient vector."""
    assert got.keys() == want.keys(), set(got) ^ set(want)
    diff = sum(float((got[n] - want[n]).pow(2).sum()) for n in want)
    norm = sum(float(want[n].pow(2).sum()) for n in want)
    return (diff / norm) ** 0.5


def scale(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """The least-squares factor c with got ~ c * want."""
    dot = sum(float((got[n] * want[n]).sum()) for n in want)
    return dot / sum(float(want[n].pow(2).sum()) for n in want)


def run(
    name: str, fixed: bool, loss: str, empty: bool = True
) -> list[tuple[dict[str, Tensor], list[float], int, float]]:
    return run_ranks(W, _rank_train, name, fixed, loss, empty, timeout=120)


def check(outs: list[Any], name: str, tol: float, empty: bool = True) -> None:
    ref_loss, ref_grads = reference(name, empty)
    for r, (grads, logged, *_) in enumerate(outs):
        err = rel_error(grads, ref_grads)
        assert err <= tol, (
            f"rank {r}: gradient off the whole batch's by {err:.3g} "
            f"(scale {scale(grads, ref_grads):.4f})"
        )
        # The Trainer accumulates the logged loss in a float32 tensor: float32 round-off.
        assert logged and logged[0] == pytest.approx(ref_loss, rel=LOGGED_TOL), (r, logged)


# ---------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------

TOTAL_ITEMS = sum(sum(1 for t in r["labels"][1:] if t != -100) for r in sequences())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_model_loss_is_exact(name: str) -> None:
    outs = run(name, True, "model")
    assert {o[2] for o in outs} == {TOTAL_ITEMS}  # the shifted count, agreed on every rank
    check(outs, name, CAST_TOL)
    # Evaluation counts with count_items too: its loss is the eval set's token mean.
    eval_ref, _ = reference(name, rows=sequences()[:EVAL_ROWS])
    assert [o[3] for o in outs] == pytest.approx([eval_ref] * W, rel=LOGGED_TOL)


def test_model_loss_plain_trainer_gpt2_fails_the_same_assertion() -> None:
    # MUTATION: transformers' own count for GPT-2 (loss_type None) includes every
    # row's first label: N too large, gradient 162/186-like too small.
    outs = run("gpt2", False, "model")
    with pytest.raises(AssertionError, match=r"scale 0\.\d+"):
        check(outs, "gpt2", CAST_TOL)
    eval_ref, _ = reference("gpt2", rows=sequences()[:EVAL_ROWS])
    assert outs[0][3] < eval_ref * (1 - 100 * LOGGED_TOL)  # counted too many tokens


def test_encoder_decoder_model_loss_is_exact() -> None:
    # BART: labels unshifted (the decoder reads them shifted right), and a loss that
    # is each micro-batch's plain mean although its forward takes **kwargs (the
    # Trainer then assumes it divides by num_items_in_batch): found by the probe.
    # No empty micro-batch: a mean over no items is NaN (refused, test below).
    outs = run("bart", True, "model", empty=False)
    items = sum(sum(1 for t in r["labels"] if t != -100) for r in sequences(empty=False))
    assert {o[2] for o in outs} == {items}
    check(outs, "bart", FLOAT64_TOL, empty=False)


def test_encoder_decoder_plain_trainer_fails_the_same_assertion() -> None:
    # MUTATION: the plain Trainer hands BART the count, BART returns means, and the
    # Trainer no longer divides by the accumulation steps: K x the gradient, roughly.
    outs = run("bart", False, "model", empty=False)
    with pytest.raises(AssertionError, match=r"scale \d"):
        check(outs, "bart", FLOAT64_TOL, empty=False)


def test_encoder_decoder_mean_loss_with_an_empty_micro_batch_same_error_on_every_rank() -> None:
    outcomes = run_ranks_outcomes(W, _rank_train, "bart", True, "model", True, timeout=120)
    msgs = {getattr(o, "message", None) for o in outcomes}
    assert len(msgs) == 1, msgs
    assert "returns a mean loss that would be NaN" in str(msgs.pop())


def test_model_loss_plain_trainer_llama_is_exact_too() -> None:
    # Where transformers is right (Llama: loss_type "ForCausalLM"), it passes the same check.
    check(run("llama", False, "model"), "llama", CAST_TOL)


@pytest.mark.parametrize(("name", "loss"), [("gpt2", "custom"), ("llama", "func")])
def test_custom_float64_loss_is_exact(name: str, loss: str) -> None:
    check(run(name, True, loss), name, FLOAT64_TOL)


def test_custom_loss_plain_trainer_fails_the_same_assertion() -> None:
    # MUTATION: the plain Trainer hands a custom compute_loss its (unshifted) count
    # and no factor for DDP's mean over ranks.
    plain = run("gpt2", False, "custom")
    with pytest.raises(AssertionError, match="gradient off"):
        check(plain, "gpt2", FLOAT64_TOL)


def test_mean_only_model_is_exact() -> None:
    # A model that cannot be told the count returns each micro-batch's mean: the plain
    # Trainer averages those means (MUTATION), the mixin turns each back into a sum.
    check(run("gpt2", True, "mean", empty=False), "gpt2", CAST_TOL, empty=False)
    plain = run("gpt2", False, "mean", empty=False)
    with pytest.raises(AssertionError, match="gradient off"):
        check(plain, "gpt2", CAST_TOL, empty=False)


def test_mean_only_model_with_an_empty_micro_batch_same_error_on_every_rank() -> None:
    # Its mean over 0 items would be NaN: refused on every rank, before any forward.
    outcomes = run_ranks_outcomes(W, _rank_train, "gpt2", True, "mean", True, timeout=120)
    msgs = {getattr(o, "message", None) for o in outcomes}
    assert len(msgs) == 1, msgs
    assert "a micro-batch has no items (all labels ignored) on ranks [1]" in str(msgs.pop())


def test_evaluate_before_train_is_refused_on_every_rank() -> None:
    # transformers 5.23 + accelerate 1.15: evaluate() prepares the model without DDP and
    # marks it prepared, so train() never wraps it: each rank steps on its own gradient.
    plain = run("llama", False, "eval_first")  # MUTATION: silently unsynchronised
    with pytest.raises(AssertionError, match="gradient off"):
        check(plain, "llama", CAST_TOL)
    assert rel_error(plain[0][0], plain[1][0]) > 0.1  # the ranks' gradients differ
    outcomes = run_ranks_outcomes(W, _rank_train, "llama", True, "eval_first", timeout=120)
    msgs = {getattr(o, "message", None) for o in outcomes}
    assert len(msgs) == 1, msgs
    assert "not wrapped in DistributedDataParallel (it is LlamaForCausalLM)" in str(msgs.pop())


# ---------------------------------------------------------------------------
# Single process: counting
# ---------------------------------------------------------------------------


def test_item_share_is_a_float_with_the_count() -> None:
    share = ItemShare(163, 3)
    assert share == pytest.approx(163 / 3) and share.items == 163 and share.world == 3
    assert torch.tensor(2.0) / share == pytest.approx(6 / 163)
    assert float(ItemShare(0, 2)) == 0.5  # a step with no items divides by a positive number


def test_counts_shifted_for_gpt2_and_unshifted_for_masked_lm() -> None:
    class Probe(WholeBatchTrainerMixin):
        def __init__(self, model: Any) -> None:  # no Trainer: only what count_items reads
            self.model, self.label_smoother, self._loss_shifts_labels = model, None, False
            self.accelerator = type("A", (), {"unwrap_model": staticmethod(lambda m: m)})()

    batch = collate(sequences()[:2])
    full = int((batch["labels"] != -100).sum())
    shifted = int((batch["labels"][:, 1:] != -100).sum())
    assert shifted < full
    assert int(Probe(build_model("gpt2")).count_items(batch)) == shifted  # type: ignore[arg-type]
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=8)
    )  # fmt: skip
    assert int(Probe(bert).count_items(batch)) == full  # type: ignore[arg-type]
    assert Probe(bert).count_items({"input_ids": batch["input_ids"]}) is None


def test_probe_verdicts_are_agreed_or_refused() -> None:
    # 0 = divides by the count, 1 = a mean, 2 = neither, 3 = no items on that rank.
    class Probe(WholeBatchTrainerMixin):
        def __init__(self) -> None:  # no Trainer: only what _agree_probe reads
            self.accelerator = type("A", (), {"unwrap_model": staticmethod(lambda m: m)})()
            self.model = build_model("bart")

    for verdicts, want in (([0, 3], True), ([3, 1], False), ([1, 1], False), ([3, 3], None)):
        p = Probe()
        p._agree_probe(verdicts)
        assert p._model_loss_takes_count is want, verdicts
    for verdicts, says in (([0, 1], "on some ranks and not on others"), ([2, 0], "neither"),
                           ([3, 2], "neither")):  # fmt: skip
        with pytest.raises(WholebatchError, match=f"{says}.*accepts_loss_kwargs"):
            Probe()._agree_probe(verdicts)
