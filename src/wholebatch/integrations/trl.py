"""trl's `SFTTrainer`, `DPOTrainer` and `GRPOTrainer` with the whole-batch step.

`WholeBatchSFTTrainer`, `WholeBatchDPOTrainer`, `WholeBatchGRPOTrainer`.

Change two lines (docs/integrations/trl.md):

    # from trl import SFTTrainer
    from wholebatch.integrations.trl import WholeBatchSFTTrainer as SFTTrainer

(`WholeBatchDPOTrainer as DPOTrainer`, `WholeBatchGRPOTrainer as GRPOTrainer` likewise). Both are the trl class with
`wholebatch.integrations.huggingface.WholeBatchTrainerMixin` in front, plus
what each trl loss needs; trl is imported only when a class is first used.

What trl 1.16 does, and where it goes wrong:

- `SFTTrainer.compute_loss` sums the fused LM head's per-token log-probs over
  the SHIFTED labels (`labels[:, 1:] != -100`, or `shift_labels`) and divides
  by the `num_items_in_batch` transformers counted, times the number of
  processes. transformers counts unshifted labels for GPT-2 (`loss_type=None`,
  see wholebatch.integrations.huggingface): N too large, every step too small
  (0.8168x on the batch of issue 24: 131 counted, 107 used; wrapped packing
  0.875x). Llama is counted shifted and is exact; so is GPT-2 wherever each
  row's first label is already -100 (padding-free, bfd packing, completion-only
  loss: tests/e2e/test_integrations_trl.py).
- `DPOTrainer` returns each micro-batch's MEAN over its preference pairs and
  sets `loss_is_scaled_for_ga = False`, so the Trainer divides by the
  accumulation steps: a mean of per-micro-batch means, exact only when every
  micro-batch of the step holds the same number of pairs (one process, a window
  of 2, 2 and 1 pairs: 0.32 off; on W ranks accelerate's even batches fill
  the short micro-batch with pairs from the epoch's start).

What these classes change (the training loop is the Trainer's):

- SFT: the step's N is counted as trl's loss uses it (shifted labels;
  `shift_labels` where the collator provides them: padding-free), agreed over
  ranks, and handed to `SFTTrainer.compute_loss` in the form it divides by
  (N with `average_tokens_across_devices`, which it then multiplies by W;
  else N / W). No probe of the model's own loss: trl's loss is its own.
- DPO: the items are pairs (`len(input_ids) // 2`: trl stacks chosen over
  rejected); each micro-batch's mean becomes W·(its pairs' loss sum)/N. Loss
  types that average over tokens instead (`"sft"`) are refused.

- GRPO (`GRPOMixin`, see its docstring): `loss_type="bnpo"` divides each
  micro-batch by its OWN token count (a mean of per-micro-batch token means),
  and `"dapo"` / `"cispo"` / `"vespo"` divide by the generation batch's token
  count rescaled by GA / steps_per_generation, which is the accumulation
  window's count only when steps_per_generation == GA (trl #5619 / PR #6024).
  The fix counts each window's tokens, agreed across ranks, when trl buffers
  the generation batch, and divides every micro-batch of the window by it.

Legend: W data-parallel ranks, K micro-batches per step, N items in the step.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from wholebatch.errors import WholebatchError
from wholebatch.integrations._common import require_peer
from wholebatch.integrations.huggingface import ItemShare, WholeBatchTrainerMixin

if TYPE_CHECKING:
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.sft_trainer import SFTTrainer

__all__ = [
    "DPOMixin",
    "GRPOMixin",
    "SFTMixin",
    "WholeBatchDPOTrainer",
    "WholeBatchGRPOTrainer",
    "WholeBatchSFTTrainer",
]

# trl 1.16's DPO loss types that average over the micro-batch's pairs (per_sequence_loss.mean()).
# fmt: skip below: a vocabulary of names, read as a paragraph, not one name a line.
_PAIR_LOSSES = frozenset(
    {
        "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
        "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop",
        "sigmoid_norm",
    }
)  # fmt: skip


class SFTMixin(WholeBatchTrainerMixin):
    """`WholeBatchTrainerMixin` for trl's `SFTTrainer`: its loss counts shifted labels, divides by N."""

    # trl's loss divides by the count it is handed; the model's own loss is not used.
    _model_loss_takes_count: bool | None = True

    @functools.cached_property
    def loss_shifts_labels(self) -> bool:
        """SFT trains causal LMs: trl's fused head scores labels[:, 1:] (or `shift_labels`).

        Cached, as the mixin's: `accelerator.unwrap_model` asks importlib.metadata whether
        DeepSpeed is installed on every call (0.48 ms CPU, asked once per micro-batch's
        count: ~1% of benchmarks/bench_trainers.py's trl step), and the model's kind
        does not change.
        """
        model = self.accelerator.unwrap_model(self.model)
        return not getattr(getattr(model, "config", None), "is_encoder_decoder", False)

    def _loss_takes_count(self) -> bool:
        return True

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Tensor | int | float | None = None,
    ) -> Tensor | tuple[Tensor, Any]:
        """`SFTTrainer.compute_loss` handed the count that makes its loss W·(sum of token losses)/N."""
        parent: Any = super(WholeBatchTrainerMixin, self)
        if not isinstance(num_items_in_batch, ItemShare):  # evaluation, or a direct call
            result: Tensor | tuple[Tensor, Any] = parent.compute_loss(
                model, inputs, return_outputs, num_items_in_batch
            )
            return result
        # trl multiplies by the number of processes when it averages tokens across devices.
        share = num_items_in_batch
        count = (
            float(max(share.items, 1)) if self.args.average_tokens_across_devices else float(share)
        )
        scaled: Tensor | tuple[Tensor, Any] = parent.compute_loss(
            model, inputs, return_outputs, count
        )
        return scaled


class DPOMixin(WholeBatchTrainerMixin):
    """`WholeBatchTrainerMixin` for trl's `DPOTrainer`: the items are preference pairs."""

    _model_loss_takes_count: bool | None = False  # trl's DPO loss is a mean over pairs

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        types = list(getattr(self.args, "loss_type", ["sigmoid"]) or ["sigmoid"])
        other = [t for t in types if t not in _PAIR_LOSSES]
        if other:
            raise WholebatchError(
                f"WholeBatchDPOTrainer: loss_type {other} averages over tokens, not pairs; only "
                f"the pair losses {sorted(_PAIR_LOSSES)} are supported (each micro-batch's mean "
                "over its pairs is turned into the step's mean over all pairs)"
            )

    def _loss_takes_count(self) -> bool:
        return False

    def count_items(self, inputs: Mapping[str, Any]) -> Tensor | int | None:
        """Preference pairs in one micro-batch: trl 1.16 stacks chosen rows over rejected ones."""
        ids = inputs.get("input_ids")
        if not isinstance(ids, Tensor):
            return None
        return int(ids.shape[0]) // 2


# trl 1.16's GRPO loss types whose batch loss is a token mean (docs/accumulation.md's trl table).
# bnpo is fixed too: trl documents it as the token mean of the batch, computes it per micro-batch.
_TOKEN_MEAN_GRPO = frozenset({"bnpo", "dapo", "cispo", "vespo"})


class GRPOMixin:
    """Token-mean GRPO loss types divided by the accumulation window's global token count.

    In front of trl 1.16's `GRPOTrainer`. For `loss_type` in bnpo, dapo, cispo
    and vespo, each micro-batch's loss becomes W·(its masked token loss sum)/N,
    N the completion tokens (`completion_mask`, times `tool_mask` when present)
    of the accumulation window it belongs to, summed over its GA micro-batches
    and over every rank. After DDP's mean the optimizer step's gradient is that
    of (sum of every token loss of the window) / N: the whole batch's token mean.

    How N is known before the window's backward passes: trl generates once per
    `steps_per_generation` micro-batches and buffers the generation batch, split
    into `steps_per_generation` micro-batches, in `_prepare_inputs`. When a new
    buffer appears, its windows (buffer slices `[j·GA, (j+1)·GA)`) are counted
    and the per-window counts agreed across ranks in one `agree_rows` all-gather
    (every rank buffers in the same call). `_compute_loss` then hands trl's own
    dapo normaliser the `num_items_in_batch` that makes it N / W, and runs bnpo
    through that same branch (bnpo and dapo share their per-token loss). The
    rest of trl's loss (clipping, KL, entropy bonus, metrics) is unchanged,
    except that the metric `policy_loss` (logged with the entropy bonus) is
    then the window-normalised sum for bnpo, as it is for dapo.

    Not changed: grpo, sapo, dr_grpo and luspo (per-sequence or constant
    normalisers: they are trl's, and match their own definitions when every
    micro-batch holds the same number of completions, as trl's split gives);
    evaluation (no accumulation: trl's dapo already divides by the eval batch's
    global tokens).

    Not exact, refused: `steps_per_generation` not a multiple of
    `gradient_accumulation_steps`. A window then spans two generation batches,
    and the second is generated only after the window's first backward passes,
    so its count is not known in time; construction raises `WholebatchError`
    for the token-mean loss types. Also assumed: windows start at buffer
    boundaries, which holds while every epoch's micro-batch count is a multiple
    of `steps_per_generation` (trl's repeat sampler gives that).

    Legend: W ranks, GA accumulation steps, N the window's global token count.
    """

    loss_type: str
    args: Any
    model: Any
    _step: int
    _buffered_inputs: list[dict[str, Any]] | None
    current_gradient_accumulation_steps: int
    # The current buffer's per-window global token counts (None until the first buffer).
    _window_tokens: list[float] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check_windows()

    def _check_windows(self) -> None:
        """Refuse the layouts where a window's token count is not known before its backward."""
        if self.loss_type not in _TOKEN_MEAN_GRPO:
            return
        spg = int(self.args.steps_per_generation)
        ga = int(self.args.gradient_accumulation_steps)
        if spg % ga:
            raise WholebatchError(
                f"WholeBatchGRPOTrainer: loss_type={self.loss_type!r} needs steps_per_generation "
                f"({spg}) to be a multiple of gradient_accumulation_steps ({ga}): otherwise an "
                "accumulation window spans two generation batches and its token count is not "
                f"known before its first backward; set steps_per_generation={ga} (or "
                f"{ga * max(1, round(spg / ga))}), or use a per-sequence loss_type"
            )

    def _window_index(self) -> int:
        """The accumulation window of the buffer the current micro-batch belongs to."""
        spg = int(self.args.steps_per_generation)
        return (self._step % spg) // int(self.args.gradient_accumulation_steps)

    def _count_windows(self, buffer: list[dict[str, Any]]) -> list[float]:
        """Each window's completion tokens, summed over its micro-batches and over every rank."""
        from wholebatch.comm import agree_rows

        ga = int(self.args.gradient_accumulation_steps)
        local = []
        for j in range(len(buffer) // ga):
            n = 0.0
            for mb in buffer[j * ga : (j + 1) * ga]:
                mask = mb["completion_mask"]
                if mb.get("tool_mask") is not None:
                    mask = mask * mb["tool_mask"]
                n += float(mask.sum())
            local.append(n)
        rows = agree_rows({"tokens": local})  # float64 wire: counts exact up to 2**53
        per_rank = rows.vectors("tokens")  # [W][windows]
        return [float(sum(r[j] for r in per_rank)) for j in range(len(local))]

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        """trl's `_prepare_inputs`; a new generation buffer gets its windows' global token counts."""
        before = self._buffered_inputs
        parent: Any = super()
        inputs: dict[str, Any] = parent._prepare_inputs(generation_batch)
        buffer = self._buffered_inputs
        if (
            self.model.training
            and self.loss_type in _TOKEN_MEAN_GRPO
            and buffer is not None
            and buffer is not before
        ):
            self._window_tokens = self._count_windows(buffer)
        return inputs

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
        """trl's `_compute_loss`, token-mean types divided by the window's global token count."""
        parent: Any = super()
        if not (self.model.training and self.loss_type in _TOKEN_MEAN_GRPO):
            plain: Tensor = parent._compute_loss(model, inputs)
            return plain
        if self._window_tokens is None:
            raise WholebatchError(
                "WholeBatchGRPOTrainer: no window token count for this micro-batch; the "
                "micro-batch did not come through _prepare_inputs' generation buffer"
            )
        n = self._window_tokens[self._window_index()]
        # trl's dapo branch divides the masked token sum by
        # num_items_in_batch / W * current_GA / steps_per_generation: make that N / W.
        spg = float(self.args.steps_per_generation)
        nib = n * spg / float(self.current_gradient_accumulation_steps)
        mask = inputs["completion_mask"]
        dtype = torch.float32 if mask.device.type == "mps" else torch.float64
        fixed = {**inputs, "num_items_in_batch": torch.tensor(nib, dtype=dtype, device=mask.device)}
        kept = self.loss_type
        self.loss_type = "dapo" if kept == "bnpo" else kept
        try:
            loss: Tensor = parent._compute_loss(model, fixed)
            return loss
        finally:
            self.loss_type = kept


if TYPE_CHECKING:

    class WholeBatchSFTTrainer(SFTMixin, SFTTrainer):  # type: ignore[misc]  # trl: Any
        """trl's `SFTTrainer` whose step has the whole-batch gradient."""

    class WholeBatchDPOTrainer(DPOMixin, DPOTrainer):  # type: ignore[misc]  # trl: Any
        """trl's `DPOTrainer` whose step has the whole-batch gradient."""

    class WholeBatchGRPOTrainer(GRPOMixin, GRPOTrainer):  # type: ignore[misc]  # trl: Any
        """trl's `GRPOTrainer` whose token-mean losses divide by the window's global tokens."""


def _build(name: str) -> type:
    trl = require_peer("trl", "trl", name)
    mixin, base = {
        "WholeBatchSFTTrainer": (SFTMixin, trl.SFTTrainer),
        "WholeBatchDPOTrainer": (DPOMixin, trl.DPOTrainer),
        "WholeBatchGRPOTrainer": (GRPOMixin, trl.GRPOTrainer),
    }[name]
    cls = type(
        name,
        (mixin, base),
        {
            "__module__": __name__,
            "__doc__": f"trl's {base.__name__} "
            "whose step has the whole-batch gradient (see wholebatch.integrations.trl).",
        },
    )
    cls.__qualname__ = name
    return cls


def __getattr__(name: str) -> Any:
    # The trainer classes subclass trl's: built on first use, so importing this module needs no trl.
    if name in ("WholeBatchSFTTrainer", "WholeBatchDPOTrainer", "WholeBatchGRPOTrainer"):
        cls = _build(name)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
