"""The drop-ins driven by a real `SentenceTransformerTrainer` (sentence-transformers 6.2.0): one exact step.

W = 2 gloo ranks, the tiny SentenceTransformer of tests/distributed/test_st.py (1-layer BERT
and WordLevel tokenizer built here, float64, dropout on), (anchor, positive,
negative) rows, 4 rows per rank per micro-step, gradient accumulation of 2,
`mini_batch_size=2` (2 mini-batches per column, 6 forwards per micro-step).
The Trainer owns everything (sampler, DDP wrap with find_unused_parameters=True,
the swap of the wrapped model into `loss.model`, 1/GA, accumulation's no_sync,
the optimizer); the script changes only the loss's import.

The gradient the optimizer sees (a pre-hook, every rank) must equal ONE
process's gradient of (L_1 + L_2) / 2, L_s the loss over micro-step s's rows of
both ranks, each rank's forwards replayed from the RNG state it had when the
Trainer called `compute_loss`. The mutation, the peer's
`CachedMultipleNegativesRankingLoss` as its users run it under DDP (default
`gather_across_devices=False`: local negatives), must fail the same assertion.
"""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tests.distributed.test_st import (
    F64,
    VOCAB,
    build_model_dir,
    embed_like,
    load_model,
    needs_peer,
    our_loss,
    peer_loss,
)
from tests.support.harness import run_ranks
from wholebatch.comm.groups import get_rank, get_world_size

pytestmark = [
    needs_peer,
    pytest.mark.skipif(
        not all(__import__("importlib").util.find_spec(m) for m in ("datasets", "accelerate")),
        reason="SentenceTransformerTrainer needs `datasets` and `accelerate` (make .venv/.peers)",
    ),
]

ROWS, GA, MBS, SCALE = 4, 2, 2, 9.0
Seen = list[tuple[list[dict[str, Any]], Tensor]]  # per compute_loss call: (features, RNG state)


@pytest.fixture(scope="module")
def model_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="wb-st-trainer-") as path:
        yield build_model_dir(path)


def _dataset() -> dict[str, list[str]]:
    gen = torch.Generator().manual_seed(3)
    n = 2 * ROWS * GA  # every row of the step, both ranks

    def sentence() -> str:
        words = torch.randint(
            len(VOCAB), (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen
        )
        return " ".join(VOCAB[int(i)] for i in words)

    return {c: [sentence() for _ in range(n)] for c in ("anchor", "positive", "negative")}


def _trainer_step(impl: str, kind: str, model_dir: str) -> tuple[list[Tensor], Seen]:
    os.environ.update(
        RANK=str(get_rank()),
        LOCAL_RANK=str(get_rank()),
        WORLD_SIZE=str(get_world_size()),
        LOCAL_WORLD_SIZE=str(get_world_size()),
        HF_HUB_OFFLINE="1",
    )
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    model = load_model(model_dir)
    kw: dict[str, Any] = {"scale": SCALE} | ({"mini_batch_size": MBS} if kind == "cached" else {})
    loss = (our_loss if impl == "ours" else peer_loss)(kind, model, **kw)
    seen: Seen = []

    class Recording(SentenceTransformerTrainer):  # type: ignore[misc]
        def compute_loss(
            self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any
        ) -> Any:
            assert type(model).__name__ == "DistributedDataParallel"  # the Trainer wrapped it
            features, _ = self.collect_features(inputs)
            copied = [
                {k: v.clone() if isinstance(v, Tensor) else v for k, v in f.items()}
                for f in features
            ]
            seen.append((copied, torch.get_rng_state()))
            return super().compute_loss(model, inputs, *args, **kwargs)

    grads: list[Tensor] = []

    def capture(opt: torch.optim.Optimizer, *_: Any) -> None:
        grads.extend(p.grad.detach().clone() for p in model.parameters())  # type: ignore[union-attr]

    with tempfile.TemporaryDirectory() as out:
        args = SentenceTransformerTrainingArguments(
            output_dir=out,
            use_cpu=True,
            per_device_train_batch_size=ROWS,
            gradient_accumulation_steps=GA,
            max_steps=1,
            max_grad_norm=0.0,  # no clipping: compare the raw whole-batch gradient
            learning_rate=0.1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        handle = register_optimizer_step_pre_hook(capture)
        try:
            trainer = Recording(
                model=model, args=args, train_dataset=Dataset.from_dict(_dataset()), loss=loss
            )
            trainer.train()
        finally:
            handle.remove()
            AcceleratorState._reset_state(True)
    del trainer
    gc.collect()
    return grads, seen


def check(impl: str, kind: str, model_dir: str) -> None:
    got = run_ranks(2, _trainer_step, impl, kind, model_dir, timeout=180)
    model = load_model(model_dir)
    total = torch.zeros((), dtype=torch.float64)
    for step in range(GA):
        per_rank = []
        for _, seen in got:  # each rank's forwards of this micro-step, replayed with graph
            features, rng = seen[step]
            torch.set_rng_state(rng)
            per_rank.append(embed_like(kind, model, features, MBS))
        columns = [torch.cat([emb[c] for emb in per_rank]) for c in range(3)]
        whole = peer_loss("mnrl", model, scale=SCALE).compute_loss_from_embeddings(columns, None)  # type: ignore[operator]
        total = total + whole / GA  # the Trainer's 1/GA
    total.backward()
    ref = [p.grad for p in model.parameters()]
    for r, (grads, seen) in enumerate(got):
        assert len(seen) == GA and len(grads) == len(ref)
        for i, (g, e) in enumerate(zip(grads, ref, strict=True)):
            torch.testing.assert_close(
                g, e, **F64, msg=lambda m, i=i, r=r: f"rank {r} param {i}: {m}"
            )
    # The sampler gave the ranks different rows.
    assert not torch.equal(got[0][1][0][0][0]["input_ids"], got[1][1][0][0][0]["input_ids"])


@pytest.mark.parametrize("kind", ["cached", "mnrl"])
def test_trainer_step_equals_whole_batch(kind: str, model_dir: str) -> None:
    check("ours", kind, model_dir)


def test_trainer_mutation_peer_cached_default_is_caught(model_dir: str) -> None:
    with pytest.raises(AssertionError, match="rank 0 param"):
        check("peer_default", "cached", model_dir)
