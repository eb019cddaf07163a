"""PNG plots of a plan: memory and bytes per rank against W and against the global batch.

matplotlib comes with the `demo` extra and is imported here only, when plots
are asked for.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from wholebatch.errors import WholebatchError
from wholebatch.planner.config import PlanConfig
from wholebatch.planner.core import plan

__all__ = ["write_plots"]

GIB = 2**30


def _sweep(
    c: PlanConfig, field: str, values: list[int]
) -> tuple[list[int], dict[str, list[float]]]:
    xs: list[int] = []
    ys: dict[str, list[float]] = {"loss": [], "peak": [], "sent": []}
    for v in values:
        try:
            swept = (
                dataclasses.replace(c, world=v)
                if field == "world"
                else dataclasses.replace(c, batch=v)
            )
            p = plan(swept)
        except WholebatchError:
            continue  # e.g. fewer rows than ranks
        xs.append(v)
        ys["loss"].append(p.memory.loss / GIB)
        ys["peak"].append(p.memory.peak / GIB)
        ys["sent"].append(sum(x.sent for x in p.collectives if not x.name.startswith("DDP")) / GIB)
    return xs, ys


def write_plots(c: PlanConfig, folder: str | Path) -> list[Path]:
    """Write memory_vs_world.png, memory_vs_batch.png (memory and loss bytes per rank); return the paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - the demo extra is missing
        raise WholebatchError(
            "plan: --plots needs matplotlib: pip install 'wholebatch[demo]'"
        ) from exc
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    worlds = [2**i for i in range(17) if 2**i <= min(65536, c.batch)]
    batches = [2**i for i in range(10, 27) if 2**i >= c.world]
    paths = []
    for field, values, label, name in (
        ("world", worlds, "W (ranks)", "vs_world.png"),
        ("batch", batches, "global batch N", "vs_batch.png"),
    ):
        xs, ys = _sweep(c, field, values)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        ax1.loglog(xs, ys["peak"], "o-", label="peak per rank")
        ax1.loglog(xs, ys["loss"], "s--", label="loss, forward + backward")
        ax1.axhline(c.budget / GIB, color="gray", ls=":", label="usable device memory")
        ax1.set(
            xlabel=label, ylabel="GiB per rank", title=f"memory ({c.loss}, D = {c.dim}, {c.dtype})"
        )
        ax1.legend()
        ax2.loglog(xs, [max(v, 1e-9) for v in ys["sent"]], "o-")
        ax2.set(xlabel=label, ylabel="GiB sent per rank per step", title="the loss's collectives")
        fixed = f"N = {c.batch:,}" if field == "world" else f"W = {c.world:,}"
        fig.suptitle(f"wholebatch plan: {fixed}")
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
