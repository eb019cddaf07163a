"""trl's `SFTTrainer` and `DPOTrainer` with the whole-batch step: `WholeBatchSFTTrainer`, `WholeBatchDPOTrainer`.

Change two lines (docs/integrations/trl.md):

    # from trl import SFTTrainer
    from wholebatch.integrations.trl import WholeBatchSFTTrainer as SFTTrainer

(`WholeBatchDPOTrainer as DPOTrainer` likewise). Both are the trl class with
`wholebatch.integrations.huggingface.WholeBatchTrainerMixin` in front, plus
what each trl loss needs; trl is imported only when a class is first used.

What trl 1.16 does, and where it goes wrong:

- `SFTTrainer.compute_loss` sums the fused LM head's per-token log-probs over
  the SHIFTED labels (`labels[:, 1:] != -100`, or `shift_labels`) and divides
  by the `num_items_in_batch` transformers counted, times the number of
  processes. transformers counts unshifted labels for GPT-2 (`loss_type=None`,
  see wholebatch.integrations.huggingface): N too large, every step too small
  (0.8168x on the batch of issue 24: 131 counted, 107 used). Llama is counted
  shifted and is exact.
- `DPOTrainer` returns each micro-batch's MEAN over its preference pairs and
  sets `loss_is_scaled_for_ga = False`, so the Trainer divides by the
  accumulation steps: a mean of per-micro-batch means, exact only when every
  micro-batch of the step holds the same number of pairs.

What these classes change (the training loop is the Trainer's):

- SFT: the step's N is counted as trl's loss uses it (shifted labels;
  `shift_labels` where the collator provides them: padding-free), agreed over
  ranks, and handed to `SFTTrainer.compute_loss` in the form it divides by
  (N with `average_tokens_across_devices`, which it then multiplies by W;
  else N / W). No probe of the model's own loss: trl's loss is its own.
- DPO: the items are pairs (`len(input_ids) // 2`: trl stacks chosen over
  rejected); each micro-batch's mean becomes W·(its pairs' loss sum)/N. Loss
  types that average over tokens instead (`"sft"`) are refused.

Legend: W data-parallel ranks, K micro-batches per step, N items in the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from wholebatch.errors import WholebatchError
from wholebatch.integrations._common import require_peer
from wholebatch.integrations.huggingface import ItemShare, WholeBatchTrainerMixin

if TYPE_CHECKING:
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.sft_trainer import SFTTrainer

__all__ = ["DPOMixin", "SFTMixin", "WholeBatchDPOTrainer", "WholeBatchSFTTrainer"]

# trl 1.16's DPO loss types that average over the micro-batch's pairs (per_sequence_loss.mean()).
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

    @property
    def loss_shifts_labels(self) -> bool:  # type: ignore[override]
        """SFT trains causal LMs: trl's fused head scores labels[:, 1:] (or `shift_labels`)."""
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
            return parent.compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[no-any-return]
        # trl multiplies by the number of processes when it averages tokens across devices.
        share = num_items_in_batch
        count = (
            float(max(share.items, 1)) if self.args.average_tokens_across_devices else float(share)
        )
        return parent.compute_loss(model, inputs, return_outputs, count)  # type: ignore[no-any-return]


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


if TYPE_CHECKING:

    class WholeBatchSFTTrainer(SFTMixin, SFTTrainer):  # type: ignore[misc]
        """trl's `SFTTrainer` whose step has the whole-batch gradient."""

    class WholeBatchDPOTrainer(DPOMixin, DPOTrainer):  # type: ignore[misc]
        """trl's `DPOTrainer` whose step has the whole-batch gradient."""


def _build(name: str) -> type:
    trl = require_peer("trl", "trl", name)
    mixin, base = (
        (SFTMixin, trl.SFTTrainer) if name == "WholeBatchSFTTrainer" else (DPOMixin, trl.DPOTrainer)
    )
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
    if name in ("WholeBatchSFTTrainer", "WholeBatchDPOTrainer"):
        cls = _build(name)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
