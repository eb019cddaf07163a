"""sentence-transformers 6.2.0's (Cached)MultipleNegativesRankingLoss against wholebatch's drop-ins.

    python -m benchmarks.bench_st                  # N = 8,192: the loss, the cached step, exactness
    python -m benchmarks.bench_st --quick          # N = 2,048 and 2 rounds instead of 5
    python -m benchmarks.bench_st --only loss      # or: cached, exact

Three parts, each peer and wholebatch side by side in one run:

- loss: the loss itself on N x D embeddings (D = 384, float32, cosine, scale
  20), one process, forward + backward: the peer's
  `MultipleNegativesRankingLoss.compute_loss_from_embeddings` (the N x N(1 + k)
  similarity matrix) vs the drop-in's (`wholebatch.info_nce_loss`, tiled), with
  k = 0 and k = 1 hard negatives;
- cached: one optimizer step of a SentenceTransformer built from a config (BERT,
  2 layers, hidden 128, 4 heads, FFN 512, 16 tokens, dropout 0.1; a WordLevel
  tokenizer built here), N (anchor, positive) pairs, the peer's
  `CachedMultipleNegativesRankingLoss` vs the drop-in, both with
  `mini_batch_size=256`: equal sequences per forward;
- exact: float64, N = 512, one process: the largest relative difference
  between the drop-in's and the peer's loss and embedding gradients; DDP over
  W = 2 ranks simulated in one process (each rank's local-negative loss, the
  gradients averaged as DDP does): the peer's default against the whole batch;
  and a real 2-process gloo run of the peer with gather_across_devices=True on
  uneven rows (3 and 5), which reports how it ends.

Times: the modes interleaved in ONE process (order reversed every other
round), medians, and the median of per-round ratios. Memory: a fresh process
per mode, one warm-up step, peak RSS growth (VmHWM reset through
/proc/self/clear_refs) over the RSS before the step (the inputs, the model and
its optimizer state already allocated), max of 2 steps. torch threads: --threads
(default 1, set explicitly in every process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks._common import free_port, interleaved_times, peak_growth, run_child

D, SCALE, MBS, WORDS = 384, 20.0, 256, 14
LOSS_MODES = ("peer_k0", "ours_k0", "peer_k1", "ours_k1")
CACHED_MODES = ("peer_cached", "ours_cached")


# ---------------------------------------------------------------------------
# The loss on embeddings
# ---------------------------------------------------------------------------


def _loss_setup(n: int) -> Callable[[str], None]:
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from wholebatch.integrations import sentence_transformers as wst

    gen = torch.Generator().manual_seed(0)
    cols = [torch.randn(n, D, generator=gen).requires_grad_() for _ in range(3)]
    peer = MultipleNegativesRankingLoss(nn.Identity(), scale=SCALE)  # type: ignore[arg-type]
    ours = wst.MultipleNegativesRankingLoss(nn.Identity(), scale=SCALE)

    def run(mode: str) -> None:
        impl, k = mode.split("_k")
        fn = peer if impl == "peer" else ours
        fn.compute_loss_from_embeddings(cols[: 2 + int(k)], None).backward()
        for c in cols:
            c.grad = None

    return run


# ---------------------------------------------------------------------------
# The cached step on a SentenceTransformer
# ---------------------------------------------------------------------------


def _build_model(path: str) -> nn.Module:
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(995)])}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_max_length=WORDS + 2,
    ).save_pretrained(path)  # fmt: skip
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=512, max_position_embeddings=WORDS + 2, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    BertModel(config, add_pooling_layer=False).save_pretrained(path)
    encoder = Transformer(path, model_kwargs={"add_pooling_layer": False})
    model = SentenceTransformer(modules=[encoder, Pooling(128, "mean")], device="cpu")
    model.train()
    return model


def _cached_setup(n: int) -> Callable[[str], None]:
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
    )

    from wholebatch.integrations import sentence_transformers as wst

    with tempfile.TemporaryDirectory() as path:
        model = _build_model(path)
    gen = torch.Generator().manual_seed(1)

    def sentences() -> list[str]:
        ids = torch.randint(995, (n, WORDS), generator=gen).tolist()
        return [" ".join(f"w{i}" for i in row) for row in ids]

    features = [model.preprocess(sentences()) for _ in range(2)]  # type: ignore[operator]
    losses = {
        "peer_cached": CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=MBS),  # type: ignore[arg-type]
        "ours_cached": wst.CachedMultipleNegativesRankingLoss(
            model, scale=SCALE, mini_batch_size=MBS
        ),
    }
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def run(mode: str) -> None:
        losses[mode](features, None).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


# ---------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _exactness(n: int = 512) -> dict[str, Any]:
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from wholebatch.integrations import sentence_transformers as wst

    gen = torch.Generator().manual_seed(2)
    out: dict[str, Any] = {}
    for k in (0, 1):
        cols = [torch.randn(n, D, dtype=torch.float64, generator=gen) for _ in range(2 + k)]
        results = []
        for fn in (
            MultipleNegativesRankingLoss(nn.Identity(), scale=SCALE),  # type: ignore[arg-type]
            wst.MultipleNegativesRankingLoss(nn.Identity(), scale=SCALE),
        ):
            xs = [c.clone().requires_grad_() for c in cols]
            loss = fn.compute_loss_from_embeddings(xs, None)
            loss.backward()
            results.append((loss.detach(), torch.cat([x.grad for x in xs])))  # type: ignore[misc]
        (lp, gp), (lo, go) = results
        # DDP over 2 ranks with the peer's default: each rank's loss sees its own half,
        # the gradients are averaged (DDP's mean) -> compare with the whole batch's.
        halves = []
        for part in (slice(0, n // 2), slice(n // 2, n)):
            xs = [c[part].clone().requires_grad_() for c in cols]
            MultipleNegativesRankingLoss(nn.Identity(), scale=SCALE).compute_loss_from_embeddings(  # type: ignore[arg-type]
                xs, None
            ).backward()
            halves.append(torch.cat([x.grad for x in xs]))  # type: ignore[misc]
        # A rank's gradient w.r.t. its embeddings is dl_r/de; DDP's mean of the parameter
        # gradients is then the gradient of mean_r(l_r) = the embeddings' grads / 2.
        local = torch.cat([h.view(2 + k, n // 2, D) for h in halves], 1).reshape(-1, D) / 2
        whole = gp.view(2 + k, n, D).reshape(-1, D)
        out[f"k{k}"] = {
            "loss_rel": float((lo - lp).abs() / lp.abs()),
            "grad_rel": _rel(go, gp),
            "peer_default_w2_grad_rel": float((local - whole).norm() / whole.norm()),
        }
    return out


def _crash_worker(rank: int, port: int, queue: Any) -> None:
    import torch.distributed as dist
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = (3, 5)[rank]
    cols = [torch.randn(rows, 8, requires_grad=True) for _ in range(2)]
    loss = MultipleNegativesRankingLoss(nn.Identity(), gather_across_devices=True)  # type: ignore[arg-type]
    try:
        loss.compute_loss_from_embeddings(cols, None).backward()
        queue.put((rank, "returned"))
    except Exception as exc:  # what the peer raises, if it raises
        queue.put((rank, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"))


def _uneven_peer_outcome() -> str:
    """Run the peer with gather_across_devices=True on 3 and 5 rows over 2 gloo processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_crash_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    said = {}
    while not queue.empty():
        r, text = queue.get()
        said[r] = text
    return "; ".join(
        f"rank {r}: exit code {p.exitcode}" + (f" ({said[r]})" if r in said else "")
        for r, p in enumerate(procs)
    )


# ---------------------------------------------------------------------------
# Children and the driver
# ---------------------------------------------------------------------------


def _setup(part: str, n: int) -> Callable[[str], None]:
    return _loss_setup(n) if part == "loss" else _cached_setup(n)


def _child_memory(part: str, mode: str, n: int) -> dict[str, Any]:
    run = _setup(part, n)
    run(mode)  # warm-up
    return {"peak_mib": max(peak_growth(lambda: run(mode)) for _ in range(2)) / 2**20}


def _child_times(part: str, n: int, rounds: int) -> dict[str, Any]:
    modes = LOSS_MODES if part == "loss" else CACHED_MODES
    run = _setup(part, n)
    for m in modes:
        run(m)  # warm-up
    times = interleaved_times(modes, run, rounds)
    pairs = [(modes[i], modes[i + 1]) for i in range(0, len(modes), 2)]
    return {
        "median_s": {m: statistics.median(ts) for m, ts in times.items()},
        "ratio": {
            ours: statistics.median(o / p for o, p in zip(times[ours], times[peer], strict=True))
            for peer, ours in pairs
        },
    }


def _spawn(args: list[str], threads: int) -> dict[str, Any]:
    result: dict[str, Any] = run_child("bench_st", ["--threads", str(threads), "--child", *args])
    return result


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _table(part: str, n: int, rounds: int, threads: int) -> None:
    modes = LOSS_MODES if part == "loss" else CACHED_MODES
    t0 = time.perf_counter()
    print(f"\n### {part}, N = {n:,} (load average before: {_load()})", flush=True)
    mem = {m: _spawn(["memory", part, m, str(n)], threads)["peak_mib"] for m in modes}
    times = _spawn(["times", part, str(n), str(rounds)], threads)
    print(f"load average after: {_load()}; {time.perf_counter() - t0:.0f} s")
    print("\n| mode | peak MiB | memory: peer / ours | median s | time: ours / peer |")
    print("|---|---|---|---|---|")
    for i in range(0, len(modes), 2):
        peer, ours = modes[i], modes[i + 1]
        print(f"| {peer} | {mem[peer]:,.0f} | | {times['median_s'][peer]:.3f} | |")
        print(
            f"| {ours} | {mem[ours]:,.0f} | {mem[peer] / mem[ours]:.2f}x | "
            f"{times['median_s'][ours]:.3f} | {times['ratio'][ours]:.2f}x |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="N = 2,048 and 2 rounds instead of 5")
    parser.add_argument("--only", choices=["loss", "cached", "exact"], action="append")
    parser.add_argument("--n", type=int, default=None, help="rows (pairs), default 8,192")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, default 1")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.n is None:
        args.n = 2048 if args.quick else 8192
    torch.set_num_threads(args.threads)
    if args.child:
        kind, part, *rest = args.child
        if kind == "memory":
            result = _child_memory(part, rest[0], int(rest[1]))
        else:
            result = _child_times(part, int(rest[0]), int(rest[1]))
        print(json.dumps(result))
        return
    parts = args.only or ["exact", "loss", "cached"]
    tile = os.environ.get("WHOLEBATCH_TILE_THREADS", "unset")
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), N = {args.n:,}, "
        f"WHOLEBATCH_TILE_THREADS={tile}"
    )
    if "exact" in parts:
        print("\n### exactness (float64, N = 512, one process)")
        print(json.dumps(_exactness(), indent=1))
        print(f"peer, gather_across_devices=True, rows 3 and 5: {_uneven_peer_outcome()}")
    for part in ("loss", "cached"):
        if part in parts:
            _table(part, args.n, 2 if args.quick else 5, args.threads)


if __name__ == "__main__":
    main()
