"""Gradient caching on a BERT-like encoder: GradCache, CachedStep, their floor, and sentence-transformers' CachedMNRL.

    python -m benchmarks.bench_cache            # 7 interleaved rounds, memory in fresh processes
    python -m benchmarks.bench_cache --quick    # 3 rounds

The encoder is a BERT built from a `transformers` config (no download): 2
layers, hidden 128, 4 heads, FFN 512, vocabulary 1,000, 16 tokens, dropout 0.1,
mean-pooled, float32, ONE thread (torch.set_num_threads(1)). A step is 256
(query, document) pairs; every cached method splits it into micro-batches that
embed 64 sequences per forward (ours: K = 4 micro-batches of 64 pairs, queries
and documents in separate forwards; CachedMNRL: mini_batch_size = 64 per
column): equal sequences per forward. The loss is MNRL (scale 20, cosine, each
query against every document of the step); SGD steps the model.

Modes (one optimizer step each):
- whole: the 256 pairs in one forward/backward (exact; memory grows with the batch);
- one_micro_batch: one micro-batch of 64 pairs (memory reference);
- accumulate: plain accumulation of K = 4 micro-batch losses (inexact: fewer negatives);
- extra_forwards: K - 1 micro-batch forwards under no_grad (time only);
- cached_step: `CachedStep(model, opt, embed, loss).step(micro_batches)`;
- grad_cache: `loss = GradCache(model, embed)(micro_batches, loss); loss.backward(); opt.step()`;
- grad_cache_noreuse: the same without keeping the last micro-batch's graph;
- grad_cache_joint: K = 8 micro-batches of 32 pairs, queries and documents in ONE
  forward of 64 sequences: equal sequences per forward AND per micro-batch (so
  equal activation memory) with CachedMNRL, which embeds one column at a time;
- cached_mnrl: sentence-transformers 6.2's CachedMultipleNegativesRankingLoss in the same loop.

Times: every mode interleaved in ONE process (order reversed every other
round); reported as medians and as median per-round ratios, so load swings on a
shared machine hit the compared modes alike. The floor of CachedStep is
accumulate + extra_forwards measured in the same round. Memory: a fresh
subprocess per mode, one warm-up step, peak RSS growth (VmHWM reset through
/proc/self/clear_refs) over the RSS before the step, max of 2 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks._common import interleaved_times, peak_growth, run_child
from wholebatch.train.cache import CachedStep
from wholebatch.train.gradcache import GradCache

PAIRS, MICRO, SEQ, VOCAB = 256, 64, 16, 1000
K = PAIRS // MICRO
MODES = (
    "whole",
    "one_micro_batch",
    "accumulate",
    "extra_forwards",
    "cached_step",
    "grad_cache",
    "grad_cache_noreuse",
    "grad_cache_joint",
    "cached_mnrl",
)
MEMORY_MODES = tuple(m for m in MODES if m != "extra_forwards")
MicroBatch = tuple[Tensor, Tensor]


class Encoder(nn.Module):
    """A BERT from a config, mean-pooled: token ids (B, SEQ) -> (B, 128)."""

    def __init__(self) -> None:
        from transformers import BertConfig, BertModel

        super().__init__()
        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
        )
        self.bert = BertModel(config, add_pooling_layer=False)

    def forward(self, ids: Tensor) -> Tensor:
        out: Tensor = self.bert(input_ids=ids).last_hidden_state.mean(1)
        return out


class STModule(nn.Module):
    """The same encoder behind sentence-transformers' module interface (features -> features)."""

    def __init__(self, encoder: Encoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        return {**features, "sentence_embedding": self.encoder(features["input_ids"])}


def mnrl(q_BD: Tensor, d_BD: Tensor) -> Tensor:
    """MultipleNegativesRankingLoss: cosine x 20, each query against every document."""
    logits = 20.0 * F.normalize(q_BD, dim=-1) @ F.normalize(d_BD, dim=-1).T
    return F.cross_entropy(logits, torch.arange(q_BD.shape[0]))


def embed(model: nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor]:
    return model(mb[0]), model(mb[1])


def embed_joint(model: nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor]:
    q_BD, d_BD = model(torch.cat(mb)).chunk(2)
    return q_BD, d_BD


def _setup() -> Callable[[str], None]:
    """A `run(mode)` doing one optimizer step of `mode` on fixed data."""
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
    )

    model = Encoder()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(VOCAB, (PAIRS, SEQ), generator=gen)
    d = torch.randint(VOCAB, (PAIRS, SEQ), generator=gen)
    mbs = [(q[i : i + MICRO], d[i : i + MICRO]) for i in range(0, PAIRS, MICRO)]
    cached_step = CachedStep(model, opt, embed, mnrl)
    cache = GradCache(model, embed)
    cache_noreuse = GradCache(model, embed)
    cache_noreuse._reuse_last = False
    cache_joint = GradCache(model, embed_joint)
    half = MICRO // 2
    mbs_joint = [(q[i : i + half], d[i : i + half]) for i in range(0, PAIRS, half)]
    st_model = nn.Sequential(STModule(model))
    cmnrl = CachedMultipleNegativesRankingLoss(st_model, mini_batch_size=MICRO)  # type: ignore[arg-type]
    ones = torch.ones(PAIRS, SEQ, dtype=torch.long)
    features = [{"input_ids": q, "attention_mask": ones}, {"input_ids": d, "attention_mask": ones}]

    def run(mode: str) -> None:
        if mode == "cached_step":
            cached_step.step(mbs)
            return
        if mode == "extra_forwards":
            with torch.no_grad():
                for mb in mbs[:-1]:
                    embed(model, mb)
            return
        if mode == "whole":
            mnrl(*embed(model, (q, d))).backward()
        elif mode == "one_micro_batch":
            mnrl(*embed(model, mbs[0])).backward()
        elif mode == "accumulate":
            for mb in mbs:
                (mnrl(*embed(model, mb)) / K).backward()
        elif mode == "grad_cache":
            cache(mbs, mnrl).backward()
        elif mode == "grad_cache_noreuse":
            cache_noreuse(mbs, mnrl).backward()
        elif mode == "grad_cache_joint":
            cache_joint(mbs_joint, mnrl).backward()
        elif mode == "cached_mnrl":
            cmnrl(features, None).backward()
        else:
            raise ValueError(mode)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def _child_memory(mode: str) -> dict[str, Any]:
    run = _setup()
    run(mode)  # warm-up: optimizer state and allocator pools exist before measuring
    return {"peak_mib": max(peak_growth(lambda: run(mode)) for _ in range(2)) / 2**20}


def _child_times(rounds: int) -> dict[str, Any]:
    run = _setup()
    for m in MODES:
        run(m)  # warm-up
    times = interleaved_times(MODES, run, rounds)
    floor = [a + e for a, e in zip(times["accumulate"], times["extra_forwards"], strict=True)]

    def ratio(a: list[float], b: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, b, strict=True))

    return {
        "median_s": {m: statistics.median(ts) for m, ts in times.items()},
        "floor_s": statistics.median(floor),
        "vs_accumulate": {m: ratio(ts, times["accumulate"]) for m, ts in times.items()},
        "cached_step_vs_floor": ratio(times["cached_step"], floor),
        "grad_cache_vs_floor": ratio(times["grad_cache"], floor),
        "grad_cache_vs_cached_step": ratio(times["grad_cache"], times["cached_step"]),
        "grad_cache_vs_cached_mnrl": ratio(times["grad_cache"], times["cached_mnrl"]),
        "noreuse_vs_reuse": ratio(times["grad_cache_noreuse"], times["grad_cache"]),
        "joint_vs_cached_mnrl": ratio(times["grad_cache_joint"], times["cached_mnrl"]),
    }


def _spawn(args: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = run_child("bench_cache", ["--child", *args])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.child:
        kind, *rest = args.child
        result = _child_memory(rest[0]) if kind == "memory" else _child_times(int(rest[0]))
        print(json.dumps(result))
        return
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[:3]}")
    t0 = time.perf_counter()
    mem = {m: _spawn(["memory", m])["peak_mib"] for m in MEMORY_MODES}
    times = _spawn(["times", str(3 if args.quick else 7)])
    with open("/proc/loadavg") as f:
        print(f"load average after: {f.read().split()[:3]}; {time.perf_counter() - t0:.0f} s")
    one = mem["one_micro_batch"]
    print("\n| step | peak MiB | vs one micro-batch step | median s | time vs plain accumulation |")
    print("|---|---|---|---|---|")
    for m in MODES:
        peak = f"{mem[m]:.0f} | {mem[m] / one:.2f}x" if m in mem else "- | -"
        print(f"| {m} | {peak} | {times['median_s'][m]:.3f} | {times['vs_accumulate'][m]:.2f}x |")
    print(
        f"\nfloor (accumulate + {K - 1} extra forwards, same rounds): {times['floor_s']:.3f} s\n"
        f"CachedStep / floor: {times['cached_step_vs_floor']:.3f}   "
        f"GradCache / floor: {times['grad_cache_vs_floor']:.3f}\n"
        f"GradCache / CachedStep: {times['grad_cache_vs_cached_step']:.3f} (memory "
        f"{mem['grad_cache'] / mem['cached_step']:.2f}x)\n"
        f"GradCache / CachedMNRL: {times['grad_cache_vs_cached_mnrl']:.3f} (memory "
        f"{mem['grad_cache'] / mem['cached_mnrl']:.2f}x)\n"
        f"GradCache joint (K = 8, one forward of 64 per micro-batch) / CachedMNRL: "
        f"{times['joint_vs_cached_mnrl']:.3f} (memory "
        f"{mem['grad_cache_joint'] / mem['cached_mnrl']:.2f}x)\n"
        f"GradCache without / with the last graph kept: {times['noreuse_vs_reuse']:.3f}"
    )


if __name__ == "__main__":
    main()
