"""GradCache driven by a real Hugging Face `Trainer` (transformers 5.23) for one optimizer step.

W = 2 gloo ranks, a tiny BERT built from a config (no download, dropout on,
float64), gradient accumulation of 2 inside the Trainer (accelerate's own
`no_sync` on the first micro-step, the loss divided by 2 by the Trainer). The
Trainer owns the sampler, the DDP wrap (find_unused_parameters=True, its default
for a non-`PreTrainedModel`), accumulation and the optimizer; the only change
is `compute_loss`, which returns `GradCache(...)(micro_batches, loss_fn,
model=model)`: the second pass runs inside the Trainer's own `backward`.

The gradient the optimizer sees (an optimizer pre-hook on every rank) must
equal ONE process's gradient of (L_1 + L_2) / 2, L_s the InfoNCE of the whole
step-s batch of both ranks, computed with graph in one pass from the RNG state
each rank had when the Trainer called `compute_loss`. The mutation (no RNG
replay) must fail the same assertion.
"""

from __future__ import annotations

import gc
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tests.support.gradcache_cases import F64, NoReplayCache
from tests.support.harness import run_ranks
from wholebatch.comm.collectives import all_gather, all_reduce
from wholebatch.comm.groups import get_rank, get_world_size
from wholebatch.train.gradcache import GradCache

pytest.importorskip("transformers")

ROWS_PER_RANK, MICRO, SEQ, VOCAB = 4, 2, 5, 30
SCALE = 5.0
Seen = list[tuple[Tensor, Tensor, Tensor]]  # per compute_loss call: (q, d, RNG state)


class Encoder(nn.Module):
    """A 1-layer BERT from a config, mean-pooled: (B, SEQ) token ids -> (B, 8)."""

    def __init__(self) -> None:
        from transformers import BertConfig, BertModel

        super().__init__()
        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.2,
            attention_probs_dropout_prob=0.2,
        )
        self.bert = BertModel(config, add_pooling_layer=False).double()

    def forward(self, ids: Tensor) -> Tensor:
        out: Tensor = self.bert(input_ids=ids).last_hidden_state.mean(1)
        return out


def embed(model: nn.Module, mb: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    return model(mb[0]), model(mb[1])


def info_nce(q_BD: Tensor, d_BD: Tensor) -> Tensor:
    """Each query against every rank's documents; sum of CE / global count, times W."""
    w = get_world_size()
    rows_W = all_gather(torch.tensor([[float(q_BD.shape[0])]], dtype=torch.float64)).flatten()
    offset = int(rows_W[: get_rank()].sum())
    logits = SCALE * (F.normalize(q_BD, dim=-1) @ F.normalize(all_gather(d_BD), dim=-1).T)
    labels = torch.arange(q_BD.shape[0]) + offset
    count = all_reduce(torch.tensor(float(q_BD.shape[0]), dtype=torch.float64))
    return F.cross_entropy(logits, labels, reduction="sum") * w / count


def _trainer_step(mutation: str | None) -> tuple[list[Tensor], Seen]:
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    os.environ.update(
        RANK=str(get_rank()),
        LOCAL_RANK=str(get_rank()),
        WORLD_SIZE=str(get_world_size()),
        LOCAL_WORLD_SIZE=str(get_world_size()),
    )
    model = Encoder()
    cache = (NoReplayCache if mutation == "no_replay" else GradCache)(model, embed)
    seen: Seen = []

    class CachedTrainer(Trainer):
        def compute_loss(
            self, model: nn.Module, inputs: dict[str, Tensor], *args: Any, **kwargs: Any
        ) -> Tensor:
            q, d = inputs["q"], inputs["d"]
            assert type(model).__name__ == "DistributedDataParallel"  # the Trainer wrapped it
            seen.append((q.clone(), d.clone(), torch.get_rng_state()))
            mbs = [(q[i : i + MICRO], d[i : i + MICRO]) for i in range(0, len(q), MICRO)]
            return cache(mbs, info_nce, model=model)

    gen = torch.Generator().manual_seed(3)
    n = 2 * 2 * ROWS_PER_RANK  # 2 micro-steps of ROWS_PER_RANK on each of 2 ranks
    data = [
        {
            "q": torch.randint(VOCAB, (SEQ,), generator=gen),
            "d": torch.randint(VOCAB, (SEQ,), generator=gen),
        }
        for _ in range(n)
    ]
    grads: list[Tensor] = []

    def capture(opt: torch.optim.Optimizer, *_: Any) -> None:
        grads.extend(p.grad.detach().clone() for p in model.parameters())  # type: ignore[union-attr]

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            per_device_train_batch_size=ROWS_PER_RANK,
            gradient_accumulation_steps=2,
            max_steps=1,
            max_grad_norm=0.0,  # no clipping: compare the raw whole-batch gradient
            learning_rate=0.1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            remove_unused_columns=False,
            dataloader_num_workers=0,
            seed=0,
        )
        handle = register_optimizer_step_pre_hook(capture)
        try:
            trainer = CachedTrainer(model=model, args=args, train_dataset=data)
            trainer.train()
        finally:
            handle.remove()
            AcceleratorState._reset_state(True)
    del trainer
    gc.collect()
    return grads, seen


def _reference(seen_per_rank: list[Seen]) -> list[Tensor]:
    model = Encoder()
    total = torch.zeros((), dtype=torch.float64)
    for step in range(2):
        qs, ds = [], []
        for seen in seen_per_rank:
            q, d, rng = seen[step]
            torch.set_rng_state(rng)
            outs = [
                embed(model, (q[i : i + MICRO], d[i : i + MICRO])) for i in range(0, len(q), MICRO)
            ]
            qs += [o[0] for o in outs]
            ds += [o[1] for o in outs]
        total = total + info_nce(torch.cat(qs), torch.cat(ds)) / 2  # the Trainer's 1/GA
    total.backward()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def check(mutation: str | None = None) -> None:
    got = run_ranks(2, _trainer_step, mutation, timeout=120)
    ref = _reference([seen for _, seen in got])
    for r, (grads, seen) in enumerate(got):
        assert len(seen) == 2 and len(grads) == len(ref)
        for i, (g, e) in enumerate(zip(grads, ref, strict=True)):
            torch.testing.assert_close(
                g, e, **F64, msg=lambda m, i=i, r=r: f"rank {r} param {i}: {m}"
            )
    # The ranks saw different rows (the Trainer's sampler split the batch).
    assert not torch.equal(got[0][1][0][0], got[1][1][0][0])


def test_hf_trainer_step_with_grad_cache_equals_whole_batch() -> None:
    check()


def test_hf_trainer_mutation_no_rng_replay_is_caught() -> None:
    with pytest.raises(AssertionError, match="rank 0"):
        check("no_replay")
