"""The Hugging Face `Trainer`'s step, exact over the whole batch: `WholeBatchTrainer`.

Change two lines (docs/integrations/huggingface.md):

    # from transformers import Trainer
    from wholebatch.integrations.huggingface import WholeBatchTrainer as Trainer

or mix it into another trainer class: `class MyTrainer(WholeBatchTrainerMixin, SFTTrainer)`.

With it, one optimizer step's gradient (after DDP's mean) is that of
(sum of every item loss) / N, N the number of items the loss really uses in
the whole step: all `gradient_accumulation_steps` micro-batches of all ranks.
This holds for the model's own loss, for `compute_loss_func`, for label
smoothing and for a custom `compute_loss` that returns
`sum_of_item_losses / num_items_in_batch`.

What transformers 5.23 does, and where it goes wrong (trainer.py):

- `get_batch_samples` prefetches the step's micro-batches and
  `_get_num_items_in_batch` counts `labels != -100`, over `labels[..., 1:]`
  only when `_loss_shifts_labels`, which is decided from
  `LOSS_MAPPING.get(model.loss_type)`. GPT-2 (`GPT2LMHeadModel`) has
  `loss_type=None`, so the count includes every row's first label although
  its loss (`ForCausalLMLoss`, the default `loss_function`) shifts them away:
  N is too large and the step's gradient too small (0.947x on the test batch
  of tests/distributed/test_integrations_hf.py, 0.871x on the batch of issue 13).
- A model whose forward does not accept loss kwargs gets a mean of
  per-micro-batch means; a custom `compute_loss` gets the (possibly wrong)
  count and no factor for DDP's mean over ranks.
- A model is taken to divide its loss by `num_items_in_batch` when its forward
  has `**kwargs` (and no `accepts_loss_kwargs` attribute); BART and T5 have
  one and return a plain mean: 6.05x the gradient at W = 2, K = 3.

What this class changes (nothing else; the training loop is the Trainer's):

- `count_items(inputs)`: the items one micro-batch's loss uses. Default:
  `shift_labels != -100` if the batch has them, else `labels != -100`, over
  `labels[..., 1:]` when the model's actual loss shifts labels (its
  `loss_function` resolves to `ForCausalLMLoss`, not encoder-decoder; or label
  smoothing on a causal LM). Override it for any other loss.
- Where the Trainer only guessed that the model's loss divides by
  `num_items_in_batch`, the first step probes it (two no-grad forwards in eval
  mode with 1 and 2 items: halves, stays, or an error), agreed across ranks.
- `get_batch_samples`: counts every micro-batch with `count_items` and agrees
  the step's N across ranks (one all-gather of 5 numbers per rank, always,
  whatever `average_tokens_across_devices` says), checking that every rank
  runs the same number of micro-batches. It hands the Trainer
  `num_items_in_batch` = N / W, this rank's share of the count.
- `compute_loss`: gives the model's loss (or `compute_loss_func`, or the label
  smoother) the count it needs so that each micro-batch's loss is
  W·(its item losses' sum)/N; a model that only returns a mean gets its mean
  turned back into a sum with `count_items`. `loss_is_scaled_for_ga = True`,
  so the Trainer does not divide by the accumulation steps again.
- Evaluation's per-batch count uses `count_items` too.
- Training data-parallel without DDP is refused (every rank would step on its
  own gradient): transformers 5.23 does that silently when `evaluate()` runs
  before `train()` on the same Trainer (see `_check_gradients_are_synchronised`).

A custom `compute_loss` follows one rule: return the sum of its item losses
divided by `num_items_in_batch` (and override `count_items` if it counts
other items than the labels above). The logged training loss is then exactly
the whole step's mean.

Not supported (refused at construction): `DataParallel` (more than one GPU in
one process), tensor / context / sequence parallelism.

Legend: W data-parallel ranks, K micro-batches per step, N items in the step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from wholebatch.comm import agree_rows, get_world_size, is_distributed
from wholebatch.errors import WholebatchError
from wholebatch.integrations._common import require_peer

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["ItemShare", "WholeBatchTrainer", "WholeBatchTrainerMixin", "count_label_items"]

IGNORE_INDEX = -100


class ItemShare(float):
    """`num_items_in_batch` as the Trainer receives it: N / W, with N and W attached.

    A float, so model losses and custom `compute_loss` code divide by it as by
    any count; `items` is the step's whole count N and `world` the ranks W.
    """

    items: int
    world: int

    def __new__(cls, items: int, world: int) -> ItemShare:
        share = super().__new__(cls, max(items, 1) / world)
        share.items, share.world = items, world
        return share


def count_label_items(
    inputs: Mapping[str, Any], *, shift: bool, ignore_index: int = IGNORE_INDEX
) -> Tensor | None:
    """Labels that carry a loss in one micro-batch; None if it has no `labels`.

    `shift_labels` (as padding-free collators provide) are counted as they are;
    otherwise `labels`, without each row's first position when `shift` (causal
    LM losses predict token t+1 from position t: label 0 is never a target).
    """
    if "shift_labels" in inputs and isinstance(inputs["shift_labels"], Tensor):
        return (inputs["shift_labels"] != ignore_index).sum()
    labels = inputs.get("labels")
    if not isinstance(labels, Tensor):
        return None
    if shift:
        labels = labels[..., 1:]
    return (labels != ignore_index).sum()


class WholeBatchTrainerMixin:
    """Makes a `transformers.Trainer` (or a subclass) step with the whole-batch gradient.

    Put it first among the bases: `class T(WholeBatchTrainerMixin, Trainer)`.
    See the module docstring for what changes. Gradient contract: after the
    step's last backward and DDP's mean over W ranks, every parameter's
    gradient is d(sum of item losses / N)/dθ over the whole step.
    """

    loss_is_scaled_for_ga: bool | None = True
    ignore_index: int = IGNORE_INDEX
    # Whether the model's own loss divides by the num_items_in_batch it is given:
    # None until probed (see `_probe_model_loss`), agreed across ranks.
    _model_loss_takes_count: bool | None = None

    # Attributes the Trainer defines; declared for type checkers.
    if TYPE_CHECKING:
        args: Any
        model: Any
        accelerator: Any
        label_smoother: Any
        compute_loss_func: Any
        model_wrapped: Any
        model_accepts_loss_kwargs: bool
        _loss_shifts_labels: bool
        _prepare_inputs: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.n_gpu > 1:
            raise WholebatchError(
                f"WholeBatchTrainer: {self.args.n_gpu} GPUs in one process (DataParallel) are not "
                "supported; launch one process per GPU with torchrun"
            )
        sizes = {
            name: int(getattr(self, f"get_{name}_size", lambda: 1)()) for name in ("tp", "cp", "sp")
        }
        if any(v > 1 for v in sizes.values()):
            raise WholebatchError(
                f"WholeBatchTrainer: model parallel sizes {sizes} are not supported; "
                "only data parallelism (DDP, FSDP) is"
            )

    # -- counting ----------------------------------------------------------------

    @functools.cached_property
    def loss_shifts_labels(self) -> bool:
        """Whether the loss this Trainer computes predicts label t+1 from position t."""
        model = self.accelerator.unwrap_model(self.model)
        base = getattr(getattr(model, "base_model", None), "model", model)  # a PEFT model's
        if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
            return False
        if self.label_smoother is not None:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            return type(base).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        from transformers.loss.loss_utils import ForCausalLMLoss

        return bool(getattr(self, "_loss_shifts_labels", False)) or (
            getattr(base, "loss_function", None) is ForCausalLMLoss
        )

    def count_items(self, inputs: Mapping[str, Any]) -> Tensor | int | None:
        """The number of items one micro-batch's loss uses (None: cannot tell).

        Override it for a loss that counts anything else than the labels
        (`labels != -100`, shifted for causal LMs): e.g. sequences, pairs, pixels.
        """
        return count_label_items(
            inputs, shift=self.loss_shifts_labels, ignore_index=self.ignore_index
        )

    def _counts(self, batch_samples: list[Any]) -> tuple[int, bool, bool]:
        """(sum of counts, any micro-batch with 0 items, any micro-batch uncountable)."""
        counts = [self.count_items(b) for b in batch_samples]
        known = [torch.as_tensor(c).reshape(()).cpu() for c in counts if c is not None]
        values = torch.stack(known).tolist() if known else []
        return int(sum(values)), any(v == 0 for v in values), len(known) < len(counts)

    # -- the Trainer's hooks -----------------------------------------------------

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], ItemShare]:
        """The step's micro-batches and this rank's share N / W of the step's item count."""
        self._check_gradients_are_synchronised()
        batch_samples: list[Any] = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        items, has_empty, unknown = self._counts(batch_samples)
        probe = self._probe_model_loss(batch_samples) if self._must_probe() else _UNDECIDED
        rows = agree_rows(
            {
                "items": items,
                "micro_batches": len(batch_samples),
                "has_empty": has_empty,
                "unknown": unknown,
                "probe": probe,
            }
        )
        self._agree_probe(list(rows.ints("probe")))
        ks = rows.ints("micro_batches")
        if len(set(ks)) > 1:
            raise WholebatchError(
                f"WholeBatchTrainer: ranks hold different numbers of micro-batches for this step "
                f"{dict(enumerate(ks))}; every rank must run the same gradient_accumulation_steps "
                "(keep accelerate's even_batches=True)"
            )
        if unknown_ranks := rows.ranks_where("unknown"):
            raise WholebatchError(
                "WholeBatchTrainer: count_items() returned None for a micro-batch on ranks "
                f"{unknown_ranks} (no `labels`?); override "
                "count_items(inputs) to return the number of items your loss uses"
            )
        if (empty_ranks := rows.ranks_where("has_empty")) and not self._loss_takes_count():
            raise WholebatchError(
                "WholeBatchTrainer: a micro-batch has no items (all labels ignored) on ranks "
                f"{empty_ranks}, and this model returns a mean "
                "loss that would be NaN there; use a model whose forward accepts "
                "num_items_in_batch, or a compute_loss_func"
            )
        return batch_samples, ItemShare(int(rows.total("items")), rows.world_size)

    def _check_gradients_are_synchronised(self) -> None:
        """Refuse to train data-parallel without DDP: every rank would step on its own gradient.

        transformers 5.23 + accelerate 1.15: `trainer.evaluate()` before `trainer.train()`
        prepares the model for evaluation (no DDP) and marks it prepared; `train()` then
        gets it back unwrapped, and each rank silently trains on its own gradient. The
        condition is the same on every rank, so every rank raises.
        """
        if not is_distributed() or any(
            bool(getattr(self, flag, False))
            for flag in (
                "is_fsdp_enabled",
                "is_deepspeed_enabled",
                "is_distributed_loading_by_transformers",
            )
        ):
            return
        model = self.model_wrapped
        while hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise WholebatchError(
                f"WholeBatchTrainer: training on {get_world_size()} ranks, but the model is not "
                f"wrapped in DistributedDataParallel (it is {type(model).__name__}): every rank "
                "would step on its own gradient. transformers 5.23 does this when "
                "trainer.evaluate() runs before trainer.train(); call train() first, or "
                "evaluate with another Trainer"
            )

    def _loss_takes_count(self) -> bool:
        """Whether the loss the Trainer computes divides by the count it is handed."""
        model_takes = self.model_accepts_loss_kwargs and self._model_loss_takes_count is not False
        return bool(
            model_takes or self.compute_loss_func is not None or self.label_smoother is not None
        )

    # -- does the model's own loss use num_items_in_batch? -----------------------

    def _must_probe(self) -> bool:
        """The model's own loss is used, the Trainer assumes it takes the count, nobody said so.

        transformers 5.23 decides `model_accepts_loss_kwargs` from a `**kwargs` in
        the model's forward when the model has no `accepts_loss_kwargs`
        attribute; some such models (BART, T5: `CrossEntropyLoss()` inside) ignore
        `num_items_in_batch` and return each micro-batch's mean.
        """
        return bool(
            self._model_loss_takes_count is None
            and self.model_accepts_loss_kwargs
            and self.compute_loss_func is None
            and self.label_smoother is None
            and not hasattr(self.accelerator.unwrap_model(self.model), "accepts_loss_kwargs")
        )

    def _probe_model_loss(self, batch_samples: list[Any]) -> float:
        """The model's loss on this rank's first micro-batch with items, given 1 and then 2 items.

        Returns _TAKES_COUNT (the loss halves), _MEAN_ONLY (unchanged), _NEITHER, or
        _UNDECIDED (no micro-batch with items here). Two forwards without
        gradient, in eval mode, once per Trainer; every rank runs them (a sharded
        model gathers its parameters in each forward), on its first micro-batch
        when none has items.
        """
        if not batch_samples:
            return _UNDECIDED
        with_items = [b for b in batch_samples if int(self.count_items(b) or 0) > 0]
        batch = with_items[0] if with_items else batch_samples[0]
        model = self.accelerator.unwrap_model(self.model)
        inputs = dict(self._prepare_inputs(batch))
        was_training = model.training
        model.eval()
        losses = []
        try:
            with torch.no_grad():
                for n in (1, 2):
                    out = model(**inputs, num_items_in_batch=n)
                    losses.append(float(out["loss"] if isinstance(out, Mapping) else out[0]))
        finally:
            model.train(was_training)
        one, two = losses
        if not with_items or not (math.isfinite(one) and math.isfinite(two)) or two == 0:
            return _UNDECIDED
        if math.isclose(one / two, 2.0, rel_tol=1e-3):
            return _TAKES_COUNT
        return _MEAN_ONLY if math.isclose(one / two, 1.0, rel_tol=1e-3) else _NEITHER

    def _agree_probe(self, verdicts: list[int]) -> None:
        """Every rank's probe, one verdict on every rank (or the same error)."""
        seen = {v for v in verdicts if v != _UNDECIDED}
        if _NEITHER in seen or len(seen) > 1:
            model = type(self.accelerator.unwrap_model(self.model)).__name__
            what = (
                "neither divides by num_items_in_batch nor ignores it"
                if _NEITHER in seen
                else "divides by num_items_in_batch on some ranks and not on others"
            )
            raise WholebatchError(
                f"WholeBatchTrainer: {model}'s loss {what} (probe on ranks: "
                f"{dict(enumerate(verdicts))}; 0 = divides, 1 = a mean, 2 = neither, 3 = no "
                "items); set model.accepts_loss_kwargs = True if it returns sum / "
                "num_items_in_batch, False if it returns a mean, or pass a compute_loss_func"
            )
        if seen:
            self._model_loss_takes_count = seen.pop() == _TAKES_COUNT

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Tensor | int | float | None = None,
    ) -> Tensor | tuple[Tensor, Any]:
        """The Trainer's `compute_loss`, scaled to W·(sum of item losses)/N in training."""
        parent: Any = super()
        if not isinstance(num_items_in_batch, ItemShare):  # evaluation, or a direct call
            result: Tensor | tuple[Tensor, Any] = parent.compute_loss(
                model, inputs, return_outputs, num_items_in_batch
            )
            return result
        share = num_items_in_batch
        if not self._loss_takes_count():
            # The model returns the mean over this micro-batch's items: make it a sum.
            local = self.count_items(inputs)
            out = parent.compute_loss(model, inputs, return_outputs, None)
            loss = out[0] if return_outputs else out
            loss = loss * (float(local) / share)  # type: ignore[arg-type]  # local: counted, not None
            return (loss, out[1]) if return_outputs else loss
        # The Trainer multiplies the loss by W itself when it averages tokens across
        # devices (for the model's own loss and compute_loss_func): give it N there.
        scales = self.args.average_tokens_across_devices and (
            self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        )
        count = float(max(share.items, 1)) if scales else float(share)
        scaled: Tensor | tuple[Tensor, Any] = parent.compute_loss(
            model, inputs, return_outputs, count
        )
        return scaled

    def _get_num_items_in_batch(
        self, batch_samples: list[Any], device: torch.device
    ) -> Tensor | None:
        """Evaluation's count (the Trainer's own rule, with `count_items`)."""
        if not batch_samples or not self._loss_takes_count():
            return None
        items, _, unknown = self._counts(batch_samples)
        if unknown:
            return None
        count = torch.tensor(items, device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return count


_TAKES_COUNT, _MEAN_ONLY, _NEITHER, _UNDECIDED = 0, 1, 2, 3


if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` below builds it

    class WholeBatchTrainer(WholeBatchTrainerMixin, Trainer):  # type: ignore[misc]  # Trainer: Any
        """`transformers.Trainer` whose step has the whole-batch gradient."""


def _trainer_class() -> type[Trainer]:
    transformers = require_peer("transformers", "transformers", "WholeBatchTrainer")

    class WholeBatchTrainer(WholeBatchTrainerMixin, transformers.Trainer):  # type: ignore[misc,name-defined]  # the peer, Any
        """`transformers.Trainer` whose step has the whole-batch gradient (see the module docstring)."""

    WholeBatchTrainer.__module__ = __name__
    WholeBatchTrainer.__qualname__ = "WholeBatchTrainer"
    return cast("type[Trainer]", WholeBatchTrainer)  # its base is transformers' (Any here)


def __getattr__(name: str) -> Any:
    # `WholeBatchTrainer` subclasses transformers.Trainer: built on first use, so that
    # importing this module (and the mixin) needs no transformers.
    if name == "WholeBatchTrainer":
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
