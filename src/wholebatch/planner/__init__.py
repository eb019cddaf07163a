"""Planning: what a whole-batch step costs per rank, before anyone books the GPUs.

`core` holds `plan` and its result types, `config` the `PlanConfig`, `mesh` the
device mesh a plan may size (dp, dp_replicate, cp, tp, pp), `traffic`
the bytes each collective moves (from `wholebatch.comm.sizes`, the collectives'
own bookkeeping), `memory` the loss kernels' memory, `report` the tables,
`plots` the PNG plots (matplotlib, imported only there), `measure` a model's
activation memory per sample on CPU. See docs/plan.md.
"""

from __future__ import annotations

from wholebatch.planner.config import PlanConfig
from wholebatch.planner.core import MemoryPlan, Plan, Strategy, Times, plan, split_rows

__all__ = ["MemoryPlan", "Plan", "PlanConfig", "Strategy", "Times", "plan", "split_rows"]
