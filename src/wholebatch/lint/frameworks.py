"""What a training framework does with the loss and the gradients, as facts the rules
ask about ("what does this framework do here") instead of matching a name: one `Fact`
per behaviour, with where the framework does it, and the predicates that recognise it
in a file. Each fact has a bad and a good twin in tests/support/lint_twins.py and a row
in docs/lint.md ("Framework facts"), checked against `FACTS`.

The evidence that decides some of them lies anywhere in the run (`Evidence`, read once
from the text of every file): the Trainer's precision, its accumulation. Whether a
file masks labels out of a token loss (`masks_labels`) is read from that file. Nothing
is imported or run.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from wholebatch.lint.names import dotted, last_name

__all__ = [
    "FACTS",
    "HF_TRAINERS",
    "Evidence",
    "Fact",
    "accelerate_backward",
    "accumulate_block",
    "builds_ddp",
    "builds_fsdp",
    "deepspeed_divides",
    "deepspeed_engines",
    "divides_by_steps",
    "fairseq_criterion",
    "hf_compute_loss",
    "hf_counting_off",
    "hf_pinned_before_446",
    "hf_pinned_only_before_446",
    "hydra_config_dirs",
    "labels_copy_inputs",
    "lightning_class",
    "loss_entries",
    "loss_kwargs_attr",
    "masks_labels",
    "megatron_losses",
    "names_transformers",
    "pipeline_losses",
    "scaled_grads_hook",
    "uncounted_forward",
    "uncounted_model",
    "yaml_accumulates",
]


@dataclass(frozen=True, kw_only=True)
class Fact:
    """One behaviour of a framework that decides a rule.

    Attributes:
        name: stable key, e.g. ``"accelerate-backward"``.
        framework: the library (``"accelerate"``, ``"deepspeed"``, ``"lightning"``,
            ``"torch"``, ``"transformers"``).
        says: what it does, as a message clause ("`accelerator.backward` divides ...").
        where: the framework's code that does it (checked against accelerate 1.15,
            lightning 2.6; torch 2.13; deepspeed as its runtime/engine.py and
            runtime/pipe/engine.py read, version not pinned).
        rules: the rule codes it feeds.
    """

    name: str
    framework: str
    says: str
    where: str
    rules: tuple[str, ...]


_ALL = (
    Fact(
        name="accelerate-backward",
        framework="accelerate",
        says="`accelerator.backward` divides the loss by gradient_accumulation_steps "
        "(inside `accelerator.accumulate()`)",
        where="accelerate/accelerator.py: Accelerator.backward (`loss / "
        "self.gradient_accumulation_steps`)",
        rules=("WB301",),
    ),
    Fact(
        name="deepspeed-backward",
        framework="deepspeed",
        says="DeepSpeed's `engine.backward` divides the loss by gradient_accumulation_steps "
        "(the engine of `deepspeed.initialize`)",
        where="deepspeed/runtime/engine.py: DeepSpeedEngine.backward (`scale_wrt_gas` -> "
        "_scale_loss_by_gas: `loss / self.gradient_accumulation_steps()`)",
        rules=("WB301",),
    ),
    Fact(
        name="deepspeed-pipeline-loss",
        framework="deepspeed",
        says="DeepSpeed's PipelineEngine divides what a PipelineModule's `loss_fn` returns "
        "by gradient_accumulation_steps (one call per micro-batch)",
        where="deepspeed/runtime/pipe/engine.py: PipelineEngine._exec_forward_pass "
        "(`self.loss = self.module.loss_fn(outputs, labels)`) -> _exec_backward_pass -> "
        "DeepSpeedEngine.backward (`_scale_loss_by_gas`)",
        rules=("WB301",),
    ),
    Fact(
        name="megatron-schedules-loss",
        framework="megatron",
        says="Megatron's pipeline schedules divide what the loss function a forward step "
        "returns gives back by the number of micro-batches (one call per micro-batch)",
        where="megatron/core/pipeline_parallel/schedules.py (Megatron-DeepSpeed: "
        "megatron/schedules.py): forward_step (`output_tensor, loss_func = "
        "forward_step_func(data_iterator, model)`; `loss / num_microbatches`)",
        rules=("WB301",),
    ),
    Fact(
        name="fairseq-criterion",
        framework="fairseq",
        says="fairseq's trainer sums the `sample_size` a criterion's forward returns over "
        "the micro-batches (--update-freq) and workers, and divides the summed gradients "
        "by it",
        where="fairseq/trainer.py: Trainer.train_step (`sample_size += sample_size_i` per "
        "micro-batch) -> `self.optimizer.multiply_grads(numer / (sample_size or 1.0))`",
        rules=("WB301",),
    ),
    Fact(
        name="hf-trainer-compute-loss",
        framework="transformers",
        says="Hugging Face `Trainer.training_step` backpropagates what `compute_loss` returns "
        "once per micro-batch and divides it by the accumulation steps unless the model "
        "was given the step's `num_items_in_batch` (`model_accepts_loss_kwargs`)",
        where="transformers/trainer.py: Trainer.training_step (`loss = self.compute_loss("
        "model, inputs, num_items_in_batch=...)`; `if not loss_is_scaled_for_ga: loss = "
        "loss / self.current_gradient_accumulation_steps`, scaled = "
        "`self.model_accepts_loss_kwargs and num_items_in_batch is not None`); "
        "Trainer.compute_loss passes `num_items_in_batch` to `model(**inputs)` only `if "
        "self.model_accepts_loss_kwargs` and returns its `loss` (checked against 5.23)",
        rules=("WB301",),
    ),
    Fact(
        name="hf-trainer-before-4-46",
        framework="transformers",
        says="a transformers Trainer below 4.46 (pinned by the project) divides the model's "
        "own `loss`, a mean over this micro-batch's labels, by the accumulation steps",
        where="transformers/trainer.py before 4.46 (read in 4.37.2): Trainer.training_step "
        "(`loss = self.compute_loss(model, inputs)`; `if self.args.gradient_accumulation_steps "
        "> 1 ...: loss = loss / self.args.gradient_accumulation_steps`), Trainer.compute_loss "
        "(`outputs = model(**inputs)`, no item count given); 4.46 added "
        "`num_items_in_batch`",
        rules=("WB301",),
    ),
    Fact(
        name="deepspeed-save-checkpoint",
        framework="deepspeed",
        says="DeepSpeed's `save_checkpoint` synchronises every rank (a barrier, and "
        "all-reduces of the tag): a rank that does not call it leaves the others waiting",
        where="deepspeed/runtime/engine.py: DeepSpeedEngine.save_checkpoint (`dist.barrier()` "
        "on every rank before saving; `_checkpoint_tag_validation` all-reduces the tag's "
        "hash; its docstring: 'will hang waiting to synchronize with other processes if it's "
        "called just for the process with rank 0'), checked against the installed deepspeed",
        rules=("WB104", "WB105"),
    ),
    Fact(
        name="trl-sft-trainer",
        framework="trl",
        says="TRL's `SFTTrainer` trains with the Trainer's own loss, and without packing its "
        "default collator pads each micro-batch to its longest row and sets the padding's "
        "labels to -100: a mean over a count that varies",
        where="trl/trainer/sft_trainer.py: SFTTrainer (0.5 to 0.11: no `compute_loss` of "
        "its own; `data_collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, "
        "mlm=False)` when none is given, transformers' collator, which sets `labels[labels "
        "== pad_token_id] = -100`; 1.16: `compute_loss` returns `super().compute_loss(...)`, "
        "its own `DataCollatorForLanguageModeling` pads labels with -100; both checked)",
        rules=("WB301",),
    ),
    Fact(
        name="mmengine-optim-wrapper",
        framework="mmengine",
        says="mmengine's `BaseModel.train_step` sums the `loss` entries of the dict "
        "`forward(mode='loss')` returns and `OptimWrapper.update_params` divides them by "
        "accumulative_counts before backward (one call per micro-batch)",
        where="mmengine/model/base_model/base_model.py: BaseModel.train_step (`losses = "
        "self._run_forward(data, mode='loss')`; `parsed_losses, log_vars = "
        "self.parse_losses(losses)`, the sum of the entries whose key holds 'loss'; "
        "`optim_wrapper.update_params(parsed_losses)`); mmengine/optim/optimizer/"
        "optimizer_wrapper.py: OptimWrapper.update_params (`loss = self.scale_loss(loss)`; "
        "`self.backward(loss)`) -> scale_loss (`loss = loss / loss_factor`, loss_factor = "
        "`self._accumulative_counts`, or the remainder's count in the last steps) "
        "(checked against 0.11.0rc0)",
        rules=("WB301",),
    ),
    Fact(
        name="lightning-accumulation",
        framework="lightning",
        says="Lightning's automatic optimisation divides the loss `training_step` returns by "
        "accumulate_grad_batches",
        where="lightning/pytorch/loops/optimization/automatic.py: ClosureResult."
        "from_training_step_output(..., trainer.accumulate_grad_batches)",
        rules=("WB301",),
    ),
    Fact(
        name="lightning-after-backward",
        framework="lightning",
        says="under 16-bit mixed precision Lightning calls `on_after_backward` before it "
        "unscales the gradients (it unscales just before `on_before_optimizer_step`)",
        where="lightning/pytorch/plugins/precision/precision.py: post_backward -> "
        "on_after_backward; amp.py: MixedPrecision.optimizer_step -> scaler.unscale_ -> "
        "_after_closure -> on_before_optimizer_step",
        rules=("WB303",),
    ),
    Fact(
        name="distributed-autograd",
        framework="torch",
        says="torch.distributed.autograd keeps each `dist_autograd.context()`'s gradients "
        "apart: every backward in a new context starts from zero",
        where="torch/distributed/autograd: context(), backward(context_id, roots), "
        "DistributedOptimizer.step(context_id)",
        rules=("WB201",),
    ),
    Fact(
        name="ddp-no-sync",
        framework="torch",
        says="DDP decides at forward time whether the backward all-reduces: the forward "
        "must run inside `no_sync()`, the backward may run after it",
        where="torch/nn/parallel/distributed.py: DistributedDataParallel.forward "
        "(`require_backward_grad_sync` -> reducer.prepare_for_backward)",
        rules=("WB302",),
    ),
    Fact(
        name="ddp-backward",
        framework="torch",
        says="the backward of a DDP-wrapped model's output all-reduces the gradients "
        "(FSDP's reduce-scatters them): every rank must run it, outside `no_sync()`",
        where="torch/nn/parallel/distributed.py: DistributedDataParallel.forward "
        "(reducer.prepare_for_backward: the reducer's autograd hooks all-reduce each "
        "bucket); torch/distributed/fsdp/_runtime_utils.py: _post_backward_hook -> "
        "_reduce_grad",
        rules=("WB105",),
    ),
    Fact(
        name="mmengine-dist-all-gather",
        framework="mmengine",
        says="mmengine's `dist.all_gather(data)` returns the list that "
        "`torch.distributed.all_gather` fills, which carries no gradient",
        where="mmengine/dist/dist.py: all_gather (`gather_list = [torch.empty_like(data, "
        "...)]`; `torch_dist.all_gather(gather_list, data_on_device, group)`; `return "
        "cast_data_device(gather_list, input_device)`; `[data]` itself in one process) "
        "(read at open-mmlab/mmengine 00cfc11)",
        rules=("WB101",),
    ),
    Fact(
        name="fsdp-no-sync",
        framework="torch",
        says="FSDP decides in its post-backward hook whether to reduce-scatter: a "
        "backward inside `no_sync()` keeps its gradients local whatever the forward ran "
        "under",
        where="torch/distributed/fsdp/_runtime_utils.py: _post_backward_hook (`if not "
        "state._sync_gradients: return` before the reduce-scatter); "
        "FullyShardedDataParallel.no_sync sets `_sync_gradients = False`",
        rules=("WB302",),
    ),
)
FACTS: dict[str, Fact] = {f.name: f for f in _ALL}

# Text that shows labels masked out of a token loss, so its count varies from one
# micro-batch to the next: a -100 label, `ignore_index`, a collator that pads labels, a
# label or loss mask set by position (`label_mask[i, prompt_len:length] = True`: the
# completion tokens of a fine-tuning sample, as many as that sample has).
_MASKED_RE = re.compile(
    r"\bignore_index\b|\blabel_pad_token_id\b|DataCollatorFor(?:Seq2Seq|LanguageModeling|"
    r"TokenClassification|CompletionOnlyLM)|[=(,\[]\s*-100(?![\d.])"
    r"|\b(?:label|loss)_mask\[[^\n]*?\]\s*=(?!=)\s*(?:True|False|[01](?:\.0)?)\b"
)
_MASKED_WORDS = ("ignore_index", "label_pad_token_id", "DataCollatorFor", "-100", "_mask[")


def masks_labels(text: str) -> bool:
    """Does this source mask labels out of a token loss (`-100`, `ignore_index`, a padding
    collator)? Then a token mean's count varies between micro-batches: grouped blocks of
    a fixed length (labels = input_ids) and one label per sequence do not."""
    return any(w in text for w in _MASKED_WORDS) and _MASKED_RE.search(text) is not None


# Labels copied whole from the inputs: `result["labels"] = result["input_ids"].copy()`,
# `labels = input_ids.clone()` (the grouped fixed-length blocks of a causal LM script).
_COPIED_RE = re.compile(
    r"""\blabels\b['"]?\]?\s*=\s*(?:[\w.]+\[['"]|[\w.]*?)\binput_ids\b['"]?\]?"""
    r"\.(?:copy|clone)\(\)"
)


def labels_copy_inputs(text: str) -> bool:
    """Does this source make its labels a copy of its input ids (`labels =
    input_ids.copy()`)? With no masking of its own (`masks_labels`), every token of a
    micro-batch is a label: its blocks' count is the same in every micro-batch, and a
    mask shown by another file of the run is that file's data path, not this one's."""
    return "input_ids" in text and _COPIED_RE.search(text) is not None


# A model wrapped for data parallelism: `FSDP(model, ...)`, `DDP(model)` (a call of the
# class, not `FSDP.state_dict_type(...)`).
_FSDP_RE = re.compile(r"\b(?:FullyShardedDataParallel|FSDP)\s*\(")
_DDP_RE = re.compile(r"\b(?:DistributedDataParallel|DDP)\s*\(")


def builds_fsdp(text: str) -> bool:
    """Does this source wrap a model in FSDP (`FullyShardedDataParallel(model)`)?"""
    return ("FSDP" in text or "FullySharded" in text) and _FSDP_RE.search(text) is not None


def builds_ddp(text: str) -> bool:
    """Does this source wrap a model in DDP (`DistributedDataParallel(model)`)?"""
    return ("DDP" in text or "DistributedData" in text) and _DDP_RE.search(text) is not None


# `Trainer(precision=16)`, `precision="16-mixed"`, `precision: "16"`, a "16-mixed"
# default of an argument (16-bit float with a loss scaler; "bf16" needs none).
# (Two tests, each starting with a literal, which `re` finds fast.)
_FP16_RE = re.compile(r"""precision\s*[=:]\s*["']?16(?:-mixed)?\b""")
_FP16_WORDS = ('"16-mixed"', "'16-mixed'")
# `Trainer(accumulate_grad_batches=4)` (any value but a literal 1), also through a dict
# of arguments (`params["accumulate_grad_batches"] = args.k`, `{"accumulate_grad_batches":
# k}`, then `Trainer(**params)`).
# Not a literal 1 that is the whole value (`=1,`, `=1)`); `1 if debug else k` may be k.
_NOT_ONE = r"(?!1[ \t]*(?:[,)\]}#;\n]|$))"
_LIGHTNING_ACCUM_RE = re.compile(
    r"accumulate_grad_batches(?:[\"']\s*\]\s*=|[\"']\s*:|\s*=)\s*" + _NOT_ONE + r"[\w\"'.(\[]"
)
# `optim_wrapper = dict(type=AmpOptimWrapper, ..., accumulative_counts=k)`, or
# `accumulative_counts = 16` in an mmengine config (any value but a literal 1).
_MMENGINE_ACCUM_RE = re.compile(
    r"accumulative_counts(?:[\"']\s*\]\s*=|[\"']\s*:|\s*=)\s*" + _NOT_ONE + r"[\w\"'.(\[]"
)


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """What the text of the run shows (every file read, reported or not).

    Attributes:
        fp16: a Lightning/Fabric precision of 16-bit mixed floats is written somewhere.
        lightning_accumulates: a Trainer accumulates gradients over micro-batches.
        mmengine_accumulates: an mmengine OptimWrapper accumulates gradients over
            micro-batches (`accumulative_counts` other than a literal 1, in a config).
        masks_labels: for one file, a file imported alongside it (`engine`: both within
            three imports of one file of the run) masks labels out of a token loss
            (`masks_labels`): the dataset module of the script that runs its loop.
        fsdp_models: for one file, the models its `no_sync()` acts on are FSDP's
            (fact `fsdp-no-sync`): a file imported alongside it wraps a model in FSDP
            and none wraps one in DDP (`builds_fsdp`, `builds_ddp`); unknown is False.
        hf_before_446: for one file, its project pins transformers below 4.46
            (`hf_pinned_before_446` of the pyproject.toml, setup.py, setup.cfg or
            requirements files of the nearest folder above it that names transformers,
            read by `engine`), whose Trainer divides the model's mean by the steps.
        package_masks_labels: `masks_labels`, or labels are masked in the file's package
            while the file sits in a folder of it without `__init__.py` (read for
            `hf_before_446` only).
    """

    fp16: bool = False
    lightning_accumulates: bool = False
    mmengine_accumulates: bool = False
    masks_labels: bool = False
    fsdp_models: bool = False
    hf_before_446: bool = False
    package_masks_labels: bool = False

    @classmethod
    def of(cls, texts: Iterable[str]) -> Evidence:
        """The evidence of these sources (the files of one run)."""
        fp16 = accum = mm = False
        for text in texts:
            fp16 = fp16 or (
                any(w in text for w in _FP16_WORDS)
                or ("precision" in text and _FP16_RE.search(text) is not None)
            )
            accum = accum or (
                "accumulate_grad_batches" in text and _accumulates(text, _LIGHTNING_ACCUM_RE)
            )
            mm = mm or ("accumulative_counts" in text and _accumulates(text, _MMENGINE_ACCUM_RE))
            if fp16 and accum and mm:
                break
        return cls(fp16=fp16, lightning_accumulates=accum, mmengine_accumulates=mm)


def _accumulates(text: str, setting: re.Pattern[str]) -> bool:
    """Does this text give a Trainer (an OptimWrapper) an accumulation that may be more
    than 1 (`setting`: `_LIGHTNING_ACCUM_RE`, `_MMENGINE_ACCUM_RE`)? A literal but 1, or
    any expression (`accumulate_grad_batches=grad_steps`, computed from the config: it may
    accumulate), unless it is a name every assignment of which in this text is a literal
    1 (`k = 1`, then `accumulate_grad_batches=k`; the keyword `accumulative_counts=
    accumulative_counts` itself is no assignment of the name)."""
    for m in setting.finditer(text):
        name = _NAME_RE.match(text, m.end() - 1)
        if name is None:
            return True
        values = re.findall(rf"(?<![\w.]){re.escape(name[1])}\s*=(?!=)\s*([^\s,)#]+)", text)
        values = [v for v in values if v != name[1]]
        if not values or any(v != "1" for v in values):
            return True
    return False


# `accumulate_grad_batches: 4` or `: ${div_up:...}` in a YAML config: any value but 1.
_YAML_ACCUM_RE = re.compile(
    r"^[ \t]*accumulate_grad_batches[ \t]*:[ \t]*(?!1[ \t]*(?:#|$))\S", re.M
)


def yaml_accumulates(text: str) -> bool:
    """Does this YAML config give a Trainer an accumulation that may be more than 1
    (`accumulate_grad_batches:` set to anything but a literal 1: a number, an
    interpolation computed from the batch sizes, `${div_up:...}`)? Hydra instantiates
    the Trainer from it (`_target_: lightning.Trainer`), so the source shows no value."""
    return "accumulate_grad_batches" in text and _YAML_ACCUM_RE.search(text) is not None


# `@hydra.main(config_path="configs", ...)`, `initialize(config_path="../conf")`.
_HYDRA_PATH_RE = re.compile(r"""\bconfig_path\s*=\s*["']([^"'\n]+)["']""")


def hydra_config_dirs(text: str) -> list[str]:
    """The config folders a Hydra application names (`config_path=`, relative to its
    file) in a source that imports hydra; [] for one that does not."""
    if "hydra" not in text or "config_path" not in text:
        return []
    return _HYDRA_PATH_RE.findall(text)


# The value of an `accumulate_grad_batches=` that is a bare name: `grad_steps,`.
_NAME_RE = re.compile(r"([A-Za-z_]\w*)\s*(?=[,)\n#]|$)")


def loss_entries(value: ast.Dict) -> list[ast.expr]:
    """The values mmengine's `BaseModel.parse_losses` sums into the loss of a dict of
    losses: those whose key holds 'loss' (`{"loss": ..., "acc": ...}` gives the first)."""
    return [
        v
        for k, v in zip(value.keys, value.values, strict=True)
        if isinstance(k, ast.Constant) and isinstance(k.value, str) and "loss" in k.value
    ]


def lightning_class(cls: ast.ClassDef | None) -> bool:
    """Is `cls` a LightningModule (by its bases as written)?"""
    return cls is not None and any(
        last_name(b) in ("LightningModule", "LitModule") for b in cls.bases
    )


_CRITERION_BASES = ("FairseqCriterion", "LegacyFairseqCriterion")


def fairseq_criterion(cls: ast.ClassDef | None) -> bool:
    """Is `cls` a fairseq criterion, by its bases as written (`FairseqCriterion`) or its
    registration (`@register_criterion("name")`)? Its `forward` returns `(loss,
    sample_size, logging_output)`, and the trainer divides by the summed sample sizes."""
    if cls is None:
        return False
    return any(last_name(b) in _CRITERION_BASES for b in cls.bases) or any(
        isinstance(d, ast.Call) and last_name(d.func) == "register_criterion"
        for d in cls.decorator_list
    )


def accumulate_block(withs: Iterable[ast.With | ast.AsyncWith], node: ast.AST) -> bool:
    """Is `node` inside one of `withs` that is `with accelerator.accumulate(...):`?"""
    line = getattr(node, "lineno", 0)
    for w in withs:
        if not (w.lineno <= line <= (w.end_lineno or w.lineno)):
            continue
        for item in w.items:
            expr = item.context_expr
            if (
                isinstance(expr, ast.Call)
                and isinstance(expr.func, ast.Attribute)
                and expr.func.attr == "accumulate"
                and "accelerat" in (dotted(expr.func.value) or last_name(expr.func.value))
            ):
                return True
    return False


def accelerate_backward(node: ast.AST) -> bool:
    """Is `node` a call `accelerator.backward(...)` (any receiver named for accelerate)?"""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "backward"
        and "accelerat" in last_name(node.func.value)
    )


def divides_by_steps(
    call: ast.Call,
    withs: Iterable[ast.With | ast.AsyncWith],
    *,
    called_in_accumulate: bool = False,
) -> Fact | None:
    """The fact by which this backward call divides its loss by the accumulation
    steps itself, with no `/ k` in the source: `accelerator.backward(loss)` inside
    `with accelerator.accumulate(model):`, or in a function that a caller calls inside
    one (`called_in_accumulate`: a helper that runs one micro-batch)."""
    if accelerate_backward(call) and (called_in_accumulate or accumulate_block(withs, call)):
        return FACTS["accelerate-backward"]
    return None


def deepspeed_engines(tree: ast.Module, qualname: Callable[[ast.expr], str | None]) -> set[str]:
    """The names a file binds to the engine `deepspeed.initialize` returns (its first
    value: `engine, opt, _, _ = deepspeed.initialize(...)`, `self.model, *_ = ...`), as
    dotted text; `qualname` resolves a callee through the file's imports."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and qualname(node.value.func) == "deepspeed.initialize"
        ):
            continue
        for target in node.targets:
            first = target.elts[0] if isinstance(target, ast.Tuple | ast.List) else None
            d = dotted(first) if first is not None else None
            if d is not None:
                out.add(d)
    return out


def _initializes(node: ast.expr | None) -> bool:
    """`deepspeed.initialize(...)`, by its dotted name (the run-wide reading below has no
    imports to resolve a callee through)."""
    return isinstance(node, ast.Call) and dotted(node.func) == "deepspeed.initialize"


def _engine_bound(node: ast.Assign, makers: frozenset[str]) -> str | None:
    """The dotted name an assignment binds to a DeepSpeed engine: the first value of
    `deepspeed.initialize(...)` (`engine, *_ = ...`, `... = deepspeed.initialize(...)[0]`),
    or a single target given a call of a function of the run that returns one (`makers`:
    `self.actor = self._init_engine(...)`)."""
    value, target = node.value, node.targets[0] if len(node.targets) == 1 else None
    if target is None:
        return None
    if _initializes(value) and isinstance(target, ast.Tuple | ast.List) and target.elts:
        return dotted(target.elts[0])
    if isinstance(value, ast.Subscript) and _initializes(value.value):
        index = value.slice
        if isinstance(index, ast.Constant) and index.value == 0:
            return dotted(target)
    if isinstance(value, ast.Call) and last_name(value.func) in makers:
        return dotted(target)
    return None


def _parsed(texts: Iterable[str]) -> list[ast.Module]:
    out: list[ast.Module] = []
    for text in texts:
        try:
            out.append(ast.parse(text))
        except (SyntaxError, ValueError):
            continue
    return out


def deepspeed_run_engines(
    sources: Iterable[str],
) -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """What the whole run binds to DeepSpeed engines, for files that use an engine another
    file built: the functions that return the engine `deepspeed.initialize` built
    (`def _init_engine(...): engine, *_ = deepspeed.initialize(...); return engine`), by
    name, and per class the attributes its methods bind to one (`self.model, *_ =
    deepspeed.initialize(...)`, `self.actor = self._init_engine(...)`), by class name: a
    subclass's `self.model.backward(loss)` backpropagates through that engine. Only the
    files whose text names `deepspeed.initialize`, or a function that returns an engine,
    are parsed."""
    texts = list(sources)
    trees = _parsed(t for t in texts if "deepspeed.initialize" in t)
    makers: set[str] = set()
    for tree in trees:
        for f in ast.walk(tree):
            if not isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            bound = {
                b
                for n in ast.walk(f)
                if isinstance(n, ast.Assign) and (b := _engine_bound(n, frozenset())) is not None
            }
            for n in ast.walk(f):
                if isinstance(n, ast.Return) and (
                    (isinstance(n.value, ast.Name) and n.value.id in bound)
                    or (isinstance(n.value, ast.Subscript) and _initializes(n.value.value))
                ):
                    makers.add(f.name)
    frozen = frozenset(makers)
    if frozen:  # the files that call one (`self.actor = self._init_engine(...)`)
        trees += _parsed(
            t for t in texts if "deepspeed.initialize" not in t and any(m in t for m in frozen)
        )
    attrs: dict[str, frozenset[str]] = {}
    for tree in trees:
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            names = {
                b.removeprefix("self.")
                for n in ast.walk(cls)
                if isinstance(n, ast.Assign)
                and (b := _engine_bound(n, frozen)) is not None
                and b.startswith("self.")
                and b.count(".") == 1
            }
            if names:
                attrs[cls.name] = attrs.get(cls.name, frozenset()) | names
    return frozen, attrs


def deepspeed_divides(call: ast.Call, engines: set[str]) -> Fact | None:
    """The fact by which `engine.backward(loss)` of a DeepSpeed engine divides the loss
    by the accumulation steps (`engines`: `deepspeed_engines` of the file)."""
    func = call.func
    if (
        isinstance(func, ast.Attribute)
        and func.attr == "backward"
        and call.args
        and dotted(func.value) in engines
    ):
        return FACTS["deepspeed-backward"]
    return None


def pipeline_losses(tree: ast.Module, qualname: Callable[[ast.expr], str | None]) -> set[str]:
    """The names of the functions a file gives a DeepSpeed `PipelineModule` as its
    `loss_fn=` (in `PipelineModule(...)`, or in `super().__init__(...)` of a class whose
    base is one): the function named, or the nested function that a function of the
    file returns where `loss_fn=` is its call (`loss_fn=get_cross_entropy(...)`)."""
    pipes = {
        c.name
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef)
        and any((qualname(b) or "").endswith("deepspeed.pipe.PipelineModule") for b in c.bases)
    }
    functions = {
        f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    out: set[str] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef | ast.Module):
            continue
        for call in ast.walk(cls):
            if not isinstance(call, ast.Call):
                continue
            func = call.func
            pipe = (qualname(func) or "").endswith("deepspeed.pipe.PipelineModule") or (
                isinstance(cls, ast.ClassDef)
                and cls.name in pipes
                and isinstance(func, ast.Attribute)
                and func.attr == "__init__"
                and isinstance(func.value, ast.Call)
                and last_name(func.value.func) == "super"
            )
            fn = (
                next((k.value for k in call.keywords if k.arg == "loss_fn"), None) if pipe else None
            )
            if isinstance(fn, ast.Name):
                out.add(fn.id)
            elif isinstance(fn, ast.Call) and isinstance(fn.func, ast.Name):
                maker = functions.get(fn.func.id)
                if maker is not None:
                    out |= _returned_functions(maker)
    return out


def _returned_functions(maker: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The nested functions that `maker` returns by name (`return CrossEntropy`)."""
    nested = {n.name for n in maker.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return {
        r.value.id
        for r in ast.walk(maker)
        if isinstance(r, ast.Return) and isinstance(r.value, ast.Name) and r.value.id in nested
    }


def megatron_losses(tree: ast.Module, qualname: Callable[[ast.expr], str | None]) -> set[str]:
    """The names of the loss functions a file hands Megatron's pipeline schedules: the
    `f` of `partial(f, ...)` (or `f` itself) in the returned tuple of a forward step, a
    function given as `forward_step_func=` (or returned by the call given there), or named
    `forward_step` (Megatron's name for
    the function `pretrain(..., forward_step, ...)` and `get_forward_backward_func()(...)`
    call: it returns `(output_tensor, loss_func)`)."""
    steps, makers = {"forward_step"}, set()
    made = {  # `fwd_loss_fn = self.get_forward_output_and_loss_func(...)`
        t.id: last_name(n.value.func)
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    for call in ast.walk(tree):
        if isinstance(call, ast.Call):
            for k in call.keywords:
                if k.arg == "forward_step_func" and isinstance(k.value, ast.Name):
                    steps.add(k.value.id)
                    if k.value.id in made:
                        makers.add(made[k.value.id])
                elif k.arg == "forward_step_func" and isinstance(k.value, ast.Call):
                    # `forward_step_func=self.get_forward_output_and_loss_func()`: the
                    # function that call returns (NeMo's models)
                    makers.add(last_name(k.value.func))
    for f in ast.walk(tree):
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name in makers:
            steps |= _returned_functions(f)
    out: set[str] = set()
    for f in ast.walk(tree):
        if not (isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name in steps):
            continue
        for r in ast.walk(f):
            if not (isinstance(r, ast.Return) and isinstance(r.value, ast.Tuple)):
                continue
            last = r.value.elts[-1] if len(r.value.elts) == 2 else None
            if (
                isinstance(last, ast.Call)
                and (qualname(last.func) or "") == "functools.partial"
                and last.args
            ):
                last = last.args[0]
            if isinstance(last, ast.Name):
                out.add(last.id)
    return out


def scaled_grads_hook(cls: ast.ClassDef | None, method: str, evidence: Evidence) -> Fact | None:
    """The fact by which gradients are still multiplied by the loss scale inside this
    method: `on_after_backward` of a LightningModule, where the run trains in 16-bit
    mixed precision."""
    if method == "on_after_backward" and evidence.fp16 and lightning_class(cls):
        return FACTS["lightning-after-backward"]
    return None


# The Trainers of transformers and TRL (each a subclass of `transformers.Trainer`) by the
# last name a subclass's base is written with.
HF_TRAINERS = (
    "Trainer",
    "Seq2SeqTrainer",
    "SFTTrainer",
    "DPOTrainer",
    "GRPOTrainer",
    "KTOTrainer",
    "ORPOTrainer",
    "CPOTrainer",
    "RewardTrainer",
)


_CE_NAMES = frozenset({"CrossEntropyLoss", "cross_entropy", "NLLLoss", "nll_loss"})


def uncounted_forward(
    fn: ast.FunctionDef | ast.AsyncFunctionDef, *, signature: bool = True
) -> bool:
    """Is `fn` (a model's `forward`) one that computes its own mean token loss from a
    `labels` parameter (a cross-entropy with no `reduction=`) and takes no `**kwargs`?
    Then transformers' Trainer never passes it `num_items_in_batch`
    (`model_accepts_loss_kwargs` reads the forward's signature), whatever the version:
    its loss is a mean over the micro-batch's own labels
    (`FACTS["hf-trainer-compute-loss"]`)."""
    a = fn.args
    if (signature and a.kwarg is not None) or "labels" not in {
        p.arg for p in (*a.args, *a.kwonlyargs)
    }:
        return False  # (`signature=False`: the class's `accepts_loss_kwargs` decides)
    derived, losses = {"labels"}, set()  # names computed from `labels`; CE modules
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and _ce_call(n.value):
            losses |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    for _ in range(3):  # assignments in any order: a few passes reach the closure
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and _reads(n.value, derived):
                derived |= {x.id for t in n.targets for x in ast.walk(t) if isinstance(x, ast.Name)}
    # A cross-entropy (or a module built as one) scoring something computed from `labels`:
    # a mean over the labels it leaves unmasked (not one over rows it builds itself).
    return any(
        isinstance(n, ast.Call)
        and (
            _ce_call(n)
            or (isinstance(n.func, ast.Name) and n.func.id in losses)
            or (isinstance(n.func, ast.Call) and _ce_call(n.func))  # `CrossEntropyLoss()(x, y)`
        )
        and any(_reads(x, derived) for x in (*n.args[1:], *(k.value for k in n.keywords)))
        for n in ast.walk(fn)
    )


def _ce_call(n: ast.Call) -> bool:
    """A call of a cross-entropy (function or module) with no `reduction=`: a mean."""
    name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
    return name in _CE_NAMES and not any(k.arg == "reduction" for k in n.keywords)


def _reads(expr: ast.AST, names: set[str]) -> bool:
    return any(isinstance(x, ast.Name) and x.id in names for x in ast.walk(expr))


def loss_kwargs_attr(cls: ast.ClassDef) -> bool | None:
    """The value a model class gives `accepts_loss_kwargs` in its body (`accepts_loss_kwargs
    = False`, a class attribute), None where it gives none. transformers' Trainer reads
    it, where the model has it, as `model_accepts_loss_kwargs` instead of looking for
    `**kwargs` in the forward's signature (`FACTS["hf-trainer-compute-loss"]`)."""
    for st in cls.body:
        value = st.value if isinstance(st, ast.Assign | ast.AnnAssign) else None
        targets = st.targets if isinstance(st, ast.Assign) else [getattr(st, "target", None)]
        if (
            isinstance(value, ast.Constant)
            and isinstance(value.value, bool)
            and any(isinstance(t, ast.Name) and t.id == "accepts_loss_kwargs" for t in targets)
        ):
            return value.value
    return None


def uncounted_model(
    cls: ast.ClassDef,
    fn: ast.FunctionDef | ast.AsyncFunctionDef,
    returns: Callable[[], frozenset[str] | None],
) -> bool:
    """Is the model class `cls`, whose `forward` is `fn` (`returns()`: its summary's
    return tags, asked for only where needed), one the Trainer gives no
    `num_items_in_batch` while it returns a mean of its own over its labels: a forward
    with no `**kwargs` (`uncounted_forward`), or, the signature aside, `accepts_loss_kwargs
    = False` in the class (`loss_kwargs_attr`) and a forward of `labels` that returns a
    mean over a data-dependent count (`V`, `v`) or scores them by a cross-entropy mean? A
    class that sets it True is given the count."""
    flag = loss_kwargs_attr(cls)
    if flag is None:
        return uncounted_forward(fn)
    params = {p.arg for p in (*fn.args.args, *fn.args.kwonlyargs)}
    if flag or "labels" not in params:
        return False
    if uncounted_forward(fn, signature=False):
        return True
    tags = returns()
    return bool(tags and tags & {"V", "v"})


def hf_compute_loss(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Is `fn` an override of Hugging Face `Trainer.compute_loss`: named so, with its
    signature (`model, inputs, return_outputs=False, ...`, or `model, inputs, *args,
    **kwargs`)? The caller checks the class."""
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]
    rest = "return_outputs" in names or fn.args.vararg is not None or fn.args.kwarg is not None
    return fn.name == "compute_loss" and "inputs" in names and rest


def hf_counting_off(cls: ast.ClassDef) -> list[ast.Assign]:
    """The assignments `self.model_accepts_loss_kwargs = False` in the methods of `cls`:
    the Trainer then neither counts the step's items nor gives the model their number,
    and `training_step` divides the model's per-micro-batch mean by the steps
    (`FACTS["hf-trainer-compute-loss"]`)."""
    out: list[ast.Assign] = []
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and node.value.value is False
                and any(dotted(t) == "self.model_accepts_loss_kwargs" for t in node.targets)
            ):
                out.append(node)
    return out


# A pin of transformers in a requirements line, pyproject.toml or setup.py: `transformers==
# 4.37.2`, `"transformers>=4.30,<4.46"`, `transformers[torch]~=4.40.0` (not
# `sentence-transformers`), with its comma-separated specifiers.
_HF_PIN_RE = re.compile(
    r"(?<![\w.-])transformers\s*(?:\[[^\]\n]*\])?\s*"
    r"((?:(?:==|~=|<=|>=|!=|<|>)\s*[\d.*]+\s*,?\s*)+)"
)
_HF_SPEC_RE = re.compile(r"(==|~=|<=|<)\s*(\d+)\.(\d+)")


def hf_pinned_before_446(text: str) -> bool:
    """Does this project file (requirements, pyproject.toml, setup.py, setup.cfg) pin
    transformers below 4.46, by an exact version (`==`, `~=`) or an upper bound under it
    (`<4.46`, `<=4.45`)? Its Trainer then divides the model's own per-micro-batch mean by
    the steps (`FACTS["hf-trainer-before-4-46"]`). A lower bound alone is no pin."""
    if "transformers" not in text:
        return False
    for m in _HF_PIN_RE.finditer(text):
        for op, major, minor in _HF_SPEC_RE.findall(m[1]):
            version = (int(major), int(minor))
            if version < (4, 46) or (op == "<" and version == (4, 46)):
                return True
    return False


def hf_pinned_only_before_446(text: str) -> bool:
    """Does this text (a README's install lines) pin transformers, and every version it
    names below 4.46 (`transformers==4.29.2`, `pip install transformers==4.31.0`)? A
    README that also names a later version, or a lower bound, pins nothing."""
    specs = [
        spec
        for m in _HF_PIN_RE.finditer(text)
        for spec in re.findall(r"(==|~=|<=|<|>=|>|!=)\s*(\d+)\.(\d+)", m[1])
    ]
    below = [op in ("==", "~=", "<=", "<") and (int(a), int(b)) < (4, 46) for op, a, b in specs]
    return bool(below) and all(below)


# transformers named as a requirement, with or without a version (not
# `sentence-transformers`, `transformers_stream_generator`).
_HF_NAMED_RE = re.compile(r"(?<![\w.-])transformers(?![\w-])")


def names_transformers(text: str) -> bool:
    """Does this project file name transformers at all (`transformers`, `transformers>=
    4.28`)? Then its folder decides the pin, pinned below 4.46 or not
    (`hf_pinned_before_446`), for the files beneath it."""
    return "transformers" in text and _HF_NAMED_RE.search(text) is not None
