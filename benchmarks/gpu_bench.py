"""The GPU loss benchmark behind `benchmarks/gpu.sh`: CLIP forward + backward at GPU batch sizes.

    .venv/bin/python -m benchmarks.gpu_bench                       # on a CUDA machine (gpu.sh runs this)
    .venv/bin/python -m benchmarks.gpu_bench --device cpu --sizes 512 1024 --dim 32 --results /tmp/r.md

For each N and dtype: `clip_loss` forward + backward on one device (W = 1,
the tile size from `tile_size_for`), its peak memory (inputs included, as
`torch.cuda.max_memory_allocated` sees it) and its median time, against the
MATMUL FLOOR measured in the same run: the loss's matrix products (4 of
N x N x D: the forward logits, their recomputation and the two gradient
products) timed as plain `torch.matmul` calls in the input dtype on
tile-shaped operands, scaled to the same FLOPs. Targets (issue 10): at
N = 262,144, D = 512, peak under 4 GB and time within 2x of the floor.

Then SigLIP's tiles (issue 23): `siglip_loss` forward + backward with the fused
Triton kernels (``WHOLEBATCH_TILES=triton``) and with the PyTorch tiles
(``WHOLEBATCH_TILES=torch``), side by side in the same run, each against the
same matmul floor (the forward product, its recomputation and the two
gradient products: 4 of N x N x D), at D = 256 (`--siglip-dim`, within
`fused.MAX_AUTO_DIM`, where the kernels are chosen by default). Without CUDA, or
without triton, the fused column says "not measured"; a kernel that fails to
build says "failed" with the error, and the rest of the table still runs.

Then Inf-CL side by side (issue 34): `clip_loss` and Inf-CL's `cal_inf_loss`
(`inf-cl` 1.2.1, both directions averaged: the same CLIP loss) forward + backward
on one device at the batch sizes of Inf-CL's Table 1 (32k to 256k, D = 768,
float16 as there): peak memory (`max_memory_allocated`, inputs included), median
time, and the two losses' relative difference. Inf-CL needs CUDA tensors (its
launcher asserts them) and is an optional package: without it, or without CUDA,
its columns say "not measured" and why, and the rest of the run goes on.

The table is printed and written into the results file between the markers
`<!-- gpu-bench:begin -->` and `<!-- gpu-bench:end -->` (replaced on a rerun,
appended the first time). On CPU (`--device cpu`, small sizes) the same code
runs without memory figures: that is how the tests check it.

Legend: N rows, D embedding dim, T tile size.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from wholebatch.losses import clip_loss, fused, siglip_loss, tile_size_for

__all__ = ["main"]

BEGIN, END = "<!-- gpu-bench:begin -->", "<!-- gpu-bench:end -->"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GB = 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_floor(n: int, d: int, dtype: torch.dtype, device: torch.device, tile: int) -> float:
    """Seconds plain `torch.matmul` takes for the loss's 4·2·N²·D FLOPs, on tile-shaped operands."""
    t = min(tile, n)
    a = torch.randn(t, d, device=device, dtype=dtype)
    b = torch.randn(d, t, device=device, dtype=dtype)
    reps = max(1, min(64, (n // t) ** 2))
    secs = _timed(lambda: [torch.matmul(a, b) for _ in range(reps)], device, 3)
    rate = reps * 2 * t * t * d / secs  # FLOP/s
    return 4 * 2 * n * n * d / rate


def _clip_run(
    n: int, d: int, dtype: torch.dtype, device: torch.device, repeats: int
) -> dict[str, float]:
    gen = torch.Generator(device=device).manual_seed(0)
    img = F.normalize(torch.randn(n, d, device=device, generator=gen), dim=1).to(dtype)
    txt = F.normalize(torch.randn(n, d, device=device, generator=gen), dim=1).to(dtype)
    img.requires_grad_()
    txt.requires_grad_()
    scale = torch.tensor(20.0, device=device, requires_grad=True)

    def step() -> None:
        clip_loss(img, txt, scale).backward()
        img.grad = txt.grad = scale.grad = None

    clip_loss(
        img[:256].detach(), txt[:256].detach(), scale.detach()
    )  # warm-up: kernels, workspaces
    peak = float("nan")
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) / GB
    secs = _timed(step, device, repeats)
    return {
        "seconds": secs,
        "peak_gb": peak,
        "inputs_gb": 2 * img.numel() * img.element_size() / GB,
    }


def _siglip_seconds(
    n: int, d: int, dtype: torch.dtype, device: torch.device, repeats: int, tiles: str
) -> float:
    """Median seconds of `siglip_loss` forward + backward with ``WHOLEBATCH_TILES=tiles``."""
    gen = torch.Generator(device=device).manual_seed(1)
    img = F.normalize(torch.randn(n, d, device=device, generator=gen), dim=1).to(dtype)
    txt = F.normalize(torch.randn(n, d, device=device, generator=gen), dim=1).to(dtype)
    img.requires_grad_()
    txt.requires_grad_()
    scale = torch.tensor(10.0, device=device, requires_grad=True)
    bias = torch.tensor(-10.0, device=device, requires_grad=True)

    def step() -> None:
        siglip_loss(img, txt, scale, bias).backward()
        img.grad = txt.grad = scale.grad = bias.grad = None

    before = os.environ.get("WHOLEBATCH_TILES")
    os.environ["WHOLEBATCH_TILES"] = tiles
    try:
        return _timed(step, device, repeats)
    finally:
        if before is None:
            os.environ.pop("WHOLEBATCH_TILES", None)
        else:
            os.environ["WHOLEBATCH_TILES"] = before


def _fused_unmeasurable(device: torch.device) -> str | None:
    """Why the fused tiles cannot be timed here (None: they can)."""
    if device.type != "cuda":
        return "not measured (no GPU)"
    if not fused.available():
        return "not measured (triton not installed)"
    return None


def run_siglip(
    sizes: list[int], dim: int, dtypes: list[str], device: torch.device, repeats: int
) -> list[str]:
    """SigLIP: fused Triton tiles vs the PyTorch tiles vs the matmul floor (markdown lines)."""
    lines = [
        "",
        f"SigLIP tiles, W = 1, D = {dim}: `siglip_loss` forward + backward, fused Triton "
        "kernels (`WHOLEBATCH_TILES=triton`) vs the PyTorch tiles (`WHOLEBATCH_TILES=torch`), "
        "each against the matmul floor (4 products of N x N x D).",
        "",
        "| loss | N | D | dtype | PyTorch tiles s | fused s | matmul floor s | PyTorch / floor | fused / floor | fused vs PyTorch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    why_not = _fused_unmeasurable(device)
    for n in sizes:
        for key in dtypes:
            dtype = DTYPES[key]
            floor = _matmul_floor(n, dim, dtype, device, tile_size_for(device.type, n, n))
            torch_s = _siglip_seconds(n, dim, dtype, device, repeats, "torch")
            fused_cells = [why_not or "", "-", "-"]
            if why_not is None:
                try:
                    fused_s = _siglip_seconds(n, dim, dtype, device, repeats, "triton")
                    fused_cells = [f"{fused_s:.3f}", f"{fused_s / floor:.2f}",
                                   f"{torch_s / fused_s:.2f}x faster"]  # fmt: skip
                except Exception as failure:  # a kernel that does not build: say so, go on
                    fused_cells = [f"failed: {type(failure).__name__}: {failure}"[:120], "-", "-"]
            line = (
                f"| siglip | {n:,} | {dim} | {key} | {torch_s:.3f} | {fused_cells[0]} | "
                f"{floor:.3f} | {torch_s / floor:.2f} | {fused_cells[1]} | {fused_cells[2]} |"
            )
            print(line, flush=True)
            lines.append(line)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return lines


def run(
    sizes: list[int], dim: int, dtypes: list[str], device: torch.device, repeats: int
) -> list[str]:
    """The results section (markdown lines)."""
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu"
    )
    lines = [
        f"Device: {name}; torch {torch.__version__}; "
        f"command: `bash benchmarks/gpu.sh OUT` (`python -m benchmarks.gpu_bench`).",
        "",
        "| N | D | dtype | tile T | tiles per sweep | peak GB (inputs) | loss fwd+bwd s | matmul floor s | ratio | targets (N = 262,144) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        for key in dtypes:
            dtype = DTYPES[key]
            tile = tile_size_for(device.type, n, n)
            r = _clip_run(n, dim, dtype, device, repeats)
            floor = _matmul_floor(n, dim, dtype, device, tile)
            ratio = r["seconds"] / floor
            target = "-"
            if n == 262_144 and dim == 512:
                mem_ok = "met" if r["peak_gb"] < 4 else "NOT met"
                time_ok = "met" if ratio <= 2 else "NOT met"
                target = f"peak < 4 GB {mem_ok}; within 2x {time_ok}"
            peak = "-" if r["peak_gb"] != r["peak_gb"] else f"{r['peak_gb']:.2f}"
            line = (
                f"| {n:,} | {dim} | {key} | {tile} | {math.ceil(n / tile) ** 2} | {peak} ({r['inputs_gb']:.2f}) | "
                f"{r['seconds']:.3f} | {floor:.3f} | {ratio:.2f} | {target} |"
            )
            print(line, flush=True)
            lines.append(line)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return lines


INFCL_SIZES = [32_768, 65_536, 131_072, 262_144]  # Inf-CL's Table 1 batches (its 8-GPU rows)


def _infcl_missing(device: torch.device, hidden: tuple[str, ...]) -> str | None:
    """Why Inf-CL cannot be measured here (None: it can)."""
    if "inf_cl" in hidden:
        return "not measured (inf-cl not installed)"
    try:
        import inf_cl  # noqa: F401
    except ImportError:
        return "not measured (inf-cl not installed)"
    if device.type != "cuda":
        return "not measured (no GPU: inf-cl's kernels assert CUDA tensors)"
    return None


def _peak_and_seconds(
    step: Callable[[], object], device: torch.device, repeats: int
) -> tuple[float, float]:
    peak = float("nan")
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) / GB
    return peak, _timed(step, device, repeats)


def run_infcl(
    sizes: list[int], dim: int, device: torch.device, repeats: int, hidden: tuple[str, ...]
) -> list[str]:
    """`clip_loss` against Inf-CL at Table 1's batch sizes (markdown lines)."""
    lines = [
        "",
        f"CLIP against Inf-CL (`inf-cl` 1.2.1, `cal_inf_loss` both directions), W = 1, D = {dim}, "
        "float16 (Inf-CL's Table 1 sizes, one device): forward + backward, peak GB (inputs "
        "included) and median seconds; |ΔL| / L between the two losses.",
        "",
        "| N | wholebatch peak GB | wholebatch s | Inf-CL peak GB | Inf-CL s | peak ratio | time ratio | abs(ΔL) / L |",
        "|---|---|---|---|---|---|---|---|",
    ]
    why_not = _infcl_missing(device, hidden)
    for n in sizes:
        line = _infcl_row(n, dim, device, repeats, why_not)
        print(line, flush=True)
        lines.append(line)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return lines


def _infcl_row(n: int, dim: int, device: torch.device, repeats: int, why_not: str | None) -> str:
    """One row of the Inf-CL table: both losses at N = `n` (Inf-CL's cells say why not, or
    its failure, where it cannot run)."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(2)
    q = F.normalize(torch.randn(n, dim, device=device, generator=gen), dim=1).to(dtype)
    k = F.normalize(torch.randn(n, dim, device=device, generator=gen), dim=1).to(dtype)
    q.requires_grad_()
    k.requires_grad_()
    s = torch.tensor(1 / 0.07, device=device, requires_grad=True)

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            loss = fn()
            loss.backward()
            q.grad = k.grad = s.grad = None
            return loss.detach()

        return run

    ours = step(lambda: clip_loss(q, k, s))
    wb_peak, wb_s = _peak_and_seconds(ours, device, repeats)
    cells = [why_not or "", "-", "-", "-", "-"]
    if why_not is None:
        import inf_cl

        theirs = step(
            lambda: (inf_cl.cal_inf_loss(q, k, scale=s) + inf_cl.cal_inf_loss(k, q, scale=s)) / 2
        )
        try:
            gap = float((ours() - theirs()).abs() / ours().abs())
            ic_peak, ic_s = _peak_and_seconds(theirs, device, repeats)
            cells = [f"{ic_peak:.2f}", f"{ic_s:.3f}", f"{wb_peak / ic_peak:.2f}",
                     f"{wb_s / ic_s:.2f}", f"{gap:.1e}"]  # fmt: skip
        except Exception as failure:  # its kernel fails here: say so, go on
            cells = [f"failed: {type(failure).__name__}: {failure}"[:120], "-", "-", "-", "-"]
    peak = "-" if wb_peak != wb_peak else f"{wb_peak:.2f}"
    return (
        f"| {n:,} | {peak} | {wb_s:.3f} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} "
        f"| {cells[4]} |"
    )


def write_results(path: Path, lines: list[str]) -> None:
    """Put `lines` between the markers in `path` (replacing an earlier run's), or append them."""
    block = "\n".join([BEGIN, *lines, END])
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n### losses on a GPU (benchmarks/gpu.sh)\n\n" + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda", help="cuda (default) or cpu (small sizes: a smoke run)"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[65_536, 262_144])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--siglip-sizes", type=int, nargs="*", default=[65_536],
        help="N for the SigLIP fused-vs-PyTorch-tiles table (none: skip it)",
    )  # fmt: skip
    parser.add_argument("--siglip-dim", type=int, default=256)
    parser.add_argument(
        "--infcl-sizes", type=int, nargs="*", default=None,
        help="N for the table against Inf-CL (default: its Table 1 batches on CUDA, none on "
        "the CPU; none given: skip it)",
    )  # fmt: skip
    parser.add_argument("--infcl-dim", type=int, default=768)
    parser.add_argument(
        "--hide", nargs="*", default=[],
        help="optional packages to treat as missing (how the tests check the 'not measured' path)",
    )  # fmt: skip
    parser.add_argument("--results", type=Path, default=Path("benchmarks/RESULTS.md"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "gpu_bench: no CUDA device is visible (torch.cuda.is_available() is False)"
        )
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    t0 = time.perf_counter()
    lines = run(args.sizes, args.dim, args.dtypes, device, args.repeats)
    if args.siglip_sizes:
        lines += run_siglip(args.siglip_sizes, args.siglip_dim, args.dtypes, device, args.repeats)
    if args.infcl_sizes is None:
        args.infcl_sizes = INFCL_SIZES if device.type == "cuda" else []
    if args.infcl_sizes:
        hidden = tuple(args.hide)
        lines += run_infcl(args.infcl_sizes, args.infcl_dim, device, args.repeats, hidden)
    lines.append("")
    lines.append(f"Total {time.perf_counter() - t0:.0f} s.")
    write_results(args.results, lines)
    print(f"written to {args.results}")


if __name__ == "__main__":
    main()
