"""Rules that follow values (see `dataflow.Flow`):

- WB101 a loss built on plain `torch.distributed.all_gather` output;
- WB103 gradients all-gathered and stored back as gradients (a sum was meant);
- WB204 a parameter updated in place by hand outside `torch.no_grad()`;
- WB205 a parameter updated through `.data`;
- WB301 a mean loss over a varying item count divided by the accumulation steps.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial

from wholebatch.lint.accum import (
    accumulation_trips,
    asserts_one_step,
    assigned_in_loop,
    count_over_steps,
    factors,
)
from wholebatch.lint.data import literal_kwargs, spelled_out
from wholebatch.lint.dataflow import Flow, returned_tags
from wholebatch.lint.deferred import defer, deferred_findings
from wholebatch.lint.frameworks import (
    FACTS,
    HF_TRAINERS,
    Fact,
    accelerate_backward,
    accumulate_block,
    deepspeed_divides,
    deepspeed_engines,
    divides_by_steps,
    fairseq_criterion,
    hf_compute_loss,
    hf_counting_off,
    labels_copy_inputs,
    lightning_class,
    loss_entries,
    loss_kwargs_attr,
    masks_labels,
    megatron_losses,
    pipeline_losses,
    uncounted_model,
)
from wholebatch.lint.names import (
    counts_items,
    detached_copy,
    dotted,
    is_step_count_name,
    last_name,
    position,
)
from wholebatch.lint.rules import RULES, Finding, Hop, format_trace
from wholebatch.lint.scope import (
    BACKWARD,
    STEP,
    Event,
    FileContext,
    Scope,
    Stmt,
    finding as _finding,
)
from wholebatch.lint.summaries import Resolver

__all__ = ["attach", "check_flow"]

_INPLACE = frozenset({"sub_", "add_", "addcdiv_", "addcmul_", "mul_", "div_", "copy_", "lerp_"})


def _text(node: ast.expr) -> str:
    d = dotted(node)
    return d if d is not None else ast.unparse(node)


def _is_loss_function(scope: Scope) -> bool:
    """A function whose return value is a loss: `*loss*`, or `forward` of a `*Loss` class."""
    name = scope.name.lower()
    if "loss" in name:
        return True
    cls = scope.cls
    return (
        name == "forward"
        and cls is not None
        and ("loss" in cls.name.lower() or any("Loss" in last_name(b) for b in cls.bases))
    )


def _returned_losses(value: ast.expr, loss_fn: bool) -> list[ast.expr]:
    """The parts of a returned value that are a loss: all of it in a loss function;
    elsewhere (a model's `forward`, a step helper) a name `*loss*`, the `*loss*` values of
    a dict, or the `*loss*=` fields of an output object (`Output(loss=..., logits=...)`).
    A loss function's tuple or dict is judged item by item: the statistics returned beside
    the loss (`return {"ce_loss": ce, "domain_losses": gathered_stats}`) are not combined
    with it (issue 33, DoReMi)."""
    if loss_fn:
        elts = value.elts if isinstance(value, ast.Tuple | ast.List) else []
        if elts and not any(isinstance(e, ast.Starred) for e in elts):
            return list(elts)
        if isinstance(value, ast.Dict) and value.keys and None not in value.keys:
            return list(value.values)  # no `**rest`
        return [value]
    if isinstance(value, ast.Name):
        return [value] if "loss" in value.id.lower() else []
    if isinstance(value, ast.Dict):
        return [
            v
            for k, v in zip(value.keys, value.values, strict=True)
            if isinstance(k, ast.Constant)
            and isinstance(k.value, str)
            and "loss" in k.value.lower()
        ]
    if isinstance(value, ast.Call):
        return [kw.value for kw in value.keywords if kw.arg and "loss" in kw.arg.lower()]
    return []


def _param_vars(scope: Scope) -> set[str]:
    """Loop variables bound to parameters: `for p in model.parameters()`, `for n, p in ...`."""
    out: set[str] = set()
    for st in scope.stmts:
        node = st.node
        if not isinstance(node, ast.For | ast.AsyncFor):
            continue
        if any(
            (isinstance(n, ast.Call) and last_name(n.func) in ("parameters", "named_parameters"))
            or (isinstance(n, ast.Name | ast.Attribute) and "param" in last_name(n).lower())
            for n in ast.walk(node.iter)
        ):
            targets = node.target.elts if isinstance(node.target, ast.Tuple) else [node.target]
            out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def _modulo_denominators(scope: Scope) -> set[str]:
    """`k` in `if (i + 1) % k == 0:`: the accumulation period of this scope's loop."""
    return {
        _text(n.right)
        for n in scope.mods
        if not isinstance(n.left, ast.Constant | ast.JoinedStr)
        and not isinstance(n.right, ast.Constant)
    }


def _named_steps(
    scope: Scope, periods: set[str], steps: Callable[[ast.Call], bool] | None = None
) -> set[str]:
    """Names the scope assigns the number of accumulation steps (`normalizer =
    self.current_gradient_accumulation_steps if training else 1.0`: a choice between a
    step count and a constant), so that `mean / normalizer` divides by the steps. A name
    also assigned anything else (a global token count on another branch) is not one."""
    counts: dict[str, bool] = {}
    for st in scope.stmts:
        node = st.node
        if isinstance(node, ast.AugAssign | ast.AnnAssign) and isinstance(node.target, ast.Name):
            counts[node.target.id] = False
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        options = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
        parts = [o for o in options if not isinstance(o, ast.Constant)]
        is_steps = bool(parts) and all(_is_accum_count(o, periods, steps) for o in parts)
        for target in node.targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Name):
                    single = t is target
                    counts[t.id] = counts.get(t.id, True) and is_steps and single
    return {name for name, ok in counts.items() if ok}


def _is_accum_count(
    node: ast.expr, periods: set[str], steps: Callable[[ast.Call], bool] | None = None
) -> bool:
    """Is `node` the number of accumulation steps: a name for it, the period of the
    scope's `% k == 0`, `len()` of one, or a call that returns one (named for it,
    `cfg.accumulation_iters(step)`, or a function of the run that returns such a
    name, `steps(call)`)?"""
    if isinstance(node, ast.Call):
        if last_name(node.func) == "len" and node.args:
            return _is_accum_count(node.args[0], periods)
        return is_step_count_name(last_name(node.func)) or (steps is not None and steps(node))
    if isinstance(node, ast.Name | ast.Attribute):
        return _text(node) in periods or is_step_count_name(last_name(node))
    return False


class Results:
    """Per-scope results of the value-following walk, computed once: a gathering function
    is walked when a caller needs its return tags, and again never."""

    def __init__(self, ctx: FileContext) -> None:
        self.ctx = ctx
        self.done: dict[int, tuple[list[Finding], frozenset[str]]] = {}

    def get(self, scope: Scope) -> tuple[list[Finding], frozenset[str]]:
        key = id(scope)
        out = self.done.get(key)
        if out is None:
            empty: tuple[list[Finding], frozenset[str]] = ([], frozenset())
            self.done[key] = empty  # recursion: no findings, no tags
            out = self.ctx.failures.run(
                scope.qual, scope.line, lambda: _check_scope(self.ctx, scope), empty
            )
            self.done[key] = out
        return out

    def returns(self, scope: Scope) -> frozenset[str]:
        return self.get(scope)[1]


def attach(resolver: Resolver) -> None:
    """Let `resolver` summarise what gathering functions return (walks them on demand)."""
    results = Results(resolver.ctx)
    resolver.returns_fn = results.returns
    resolver.ctx.flow_results = results


def check_flow(ctx: FileContext) -> Iterator[Finding]:
    """Run the value-following rules over every scope of the file."""
    resolver = ctx.resolver if ctx.resolver is not None else Resolver(ctx)
    if resolver.returns_fn is None:
        attach(resolver)
    results = ctx.flow_results
    assert results is not None  # attach() sets it
    if ctx.scopes and ("model_accepts_loss_kwargs" in ctx.source or "Trainer" in ctx.source):
        yield from ctx.guarded(ctx.scopes[0], partial(_hf_flag_findings, ctx, resolver))
        ctx.guarded(ctx.scopes[0], partial(_note_default_trainers, ctx))
    for scope in ctx.scopes:
        if scope.stmts:
            yield from ctx.guarded(scope, partial(_flow_scope, resolver, results, scope))
    if ctx.scopes and resolver.program is not None and resolver.program.deferred:
        yield from ctx.guarded(ctx.scopes[0], partial(deferred_findings, ctx))


def _flow_scope(resolver: Resolver, results: Results, scope: Scope) -> list[Finding]:
    # Each rule needs one of these; most scopes of a large package have none.
    if scope.has_grad:
        return results.get(scope)[0]
    accum = False
    if scope.divs:
        steps, periods = _steps_calls(resolver, scope), _modulo_denominators(scope)
        periods |= _named_steps(scope, periods, steps)
        accum = any(
            _is_accum_count(d.right if isinstance(d, ast.BinOp) else d.value, periods, steps)
            for d in scope.divs
        )
        if not accum and any(_is_product(d) for d in scope.divs):
            periods |= accumulation_trips(scope)
            accum = any(
                _is_accum_count(f, periods, steps)
                for d in scope.divs
                if _is_product(d)
                for f in factors(d.right)  # type: ignore[union-attr]  # _is_product: a BinOp
            )
    if not accum and ((scope.mods and _gated_steps(scope)) or _trip_steps(scope)):
        accum = True  # steps every k micro-batches: a mean summed over them (no division)
    if not accum and scope.withs and any(_accumulates(w) for w in scope.withs):
        accum = True  # a framework that divides by the steps itself
    if not accum and _accelerate_helper(resolver, scope):
        accum = True  # the same, in a helper called inside `accelerator.accumulate()`
    if not accum and _pipeline_loss(resolver.ctx, scope):
        accum = True  # DeepSpeed's PipelineEngine divides its return by the steps
    if not accum and _megatron_loss(resolver.ctx, scope):
        accum = True  # Megatron's schedules divide its return by the micro-batches
    if not accum and _deepspeed_backward(resolver.ctx, scope):
        accum = True  # DeepSpeed's engine divides by the steps in its backward
    if not accum and _criterion_forward(resolver.ctx, scope):
        accum = True  # fairseq's trainer divides by the summed sample sizes
    if not accum and _mmengine_model(resolver.ctx, scope):
        accum = True  # mmengine's OptimWrapper divides its loss dict by the steps
    if not accum and _hf_override(resolver, scope):
        accum = True  # HF Trainer.training_step divides its return by the steps
    if not accum and scope.name == "training_step" and resolver.ctx.evidence.lightning_accumulates:
        accum = _lightning(resolver, scope)
    if scope.has_grad or accum or resolver.scope_gathers(scope):
        return results.get(scope)[0]
    return []


def _hf_trainer(resolver: Resolver | None, cls: ast.ClassDef) -> bool:
    """Is `cls` a Hugging Face Trainer: a base that resolves into transformers or TRL, or
    (through bases of this file or the run) one written with such a Trainer's name?"""
    if resolver is None:
        return False
    for b in cls.bases:
        q = resolver.ctx.imports.qualname(b) or ""
        if q.partition(".")[0] in ("transformers", "trl") and q.endswith("Trainer"):
            return True
    return resolver.derives_from(cls, HF_TRAINERS)


def _hf_override(resolver: Resolver | None, scope: Scope) -> bool:
    """Is the scope an override of HF `Trainer.compute_loss` (`frameworks.hf_compute_loss`)
    in a Trainer subclass?"""
    node = scope.node
    return (
        scope.cls is not None
        and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and hf_compute_loss(node)
        and _hf_trainer(resolver, scope.cls)
    )


def _hf_divides(ctx: FileContext, flow: Flow, scope: Scope, node: ast.Return) -> list[Finding]:
    """WB301 for an override of HF `Trainer.compute_loss` that returns a per-micro-batch
    mean (`frameworks.FACTS["hf-trainer-compute-loss"]`): the Trainer backpropagates it
    once per micro-batch, divided by the steps or not, so every micro-batch's mean weighs
    the same. Its loss is the value returned, or the first of `(loss, outputs)` (also
    under `if return_outputs`). Reported where a returned name is last assigned."""
    assert node.value is not None
    if _reads_step_items(scope):
        return []  # scaled by the step's count where the Trainer gives one
    value = node.value
    options = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
    fact = FACTS["hf-trainer-compute-loss"]
    # Its own mean over a count it shows to vary (`V`), and a model's `loss` (`v`) that
    # the override computes by calling the model itself with labels it spells out
    # (`labels=...`, a dict literal's "labels"; an opaque `model(**inputs)` may be a
    # reranker's mean over rows): reading no `num_items_in_batch` and handing on no
    # `**kwargs`, it gives the model no count in any version (4.46's count reaches a
    # model only through the Trainer's own `compute_loss`), so the model's loss is this
    # micro-batch's mean, judged by `_msg301`'s evidence.
    # (Below 4.46, pinned, `**kwargs` hold no count either.)
    counted = _hands_on_kwargs(scope) and not ctx.evidence.hf_before_446
    kept = {"V"} if counted or not _spells_labels(scope) else {"V", "v", "L"}
    for v in options:
        loss = v.elts[0] if isinstance(v, ast.Tuple) and v.elts else v
        tags = flow.tags(loss) & kept
        says = fact.says if "V" in tags else f"{fact.says}, which this override never gives it"
        msg = _msg301(ctx, tags, loss, None, by=says)
        if msg:
            where = _assigned_with(flow, scope, loss, node.lineno, tags)
            return [_finding(ctx, where or node, "WB301", msg)]
    return []


def _assigned_with(
    flow: Flow, scope: Scope, loss: ast.expr, line: int, tags: set[str]
) -> ast.Assign | None:
    """Where the returned name `loss` is last assigned a value that carries `tags` (the
    branch that is the mean: `if loss_type == "bnpo": loss = sum / mask.sum()` rather
    than the `dr_grpo` branch after it, a sum over a constant); else its last
    assignment."""
    if not isinstance(loss, ast.Name):
        return None
    found = scope.assignments(loss.id, line)
    carrying = [a for a in found if flow.tags(a.value) & tags] or found
    return carrying[-1] if carrying else None


def _reads_step_items(scope: Scope) -> bool:
    """Does the override read `num_items_in_batch` (the step's item count), other than to
    hand it to the Trainer's own `compute_loss`? Its mean is then one path of a loss
    divided by the step's count when the Trainer counts, a choice the linter cannot see."""
    return any(
        isinstance(n, ast.Name) and n.id == "num_items_in_batch" and not _in_super_call(st.node, n)
        for st in scope.stmts
        for n in st.walk()
    )


def _spells_labels(scope: Scope) -> bool:
    """Does the scope call something with labels by name (`model(input_ids=x,
    labels=y)`, or `model(**inputs)` of a dict literal with a "labels" key)?"""
    literals = literal_kwargs(st.walk() for st in scope.stmts)
    for c in scope.calls:
        for k in spelled_out(c, literals).keywords:
            if k.arg in ("labels", "lm_labels"):
                return True
            if k.arg is None and isinstance(k.value, ast.Dict):  # `model(**{"labels": y})`
                keys = [x.value for x in k.value.keys if isinstance(x, ast.Constant)]
                if "labels" in keys or "lm_labels" in keys:
                    return True
    return False


def _hands_on_kwargs(scope: Scope) -> bool:
    """Does the override hand its `**kwargs` on to a call (`model(**inputs, **kwargs)`),
    where 4.46's `num_items_in_batch` may reach the model?"""
    node = scope.node
    kw = node.args.kwarg if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None
    return kw is not None and any(
        isinstance(n, ast.Call)
        and any(k.arg is None and dotted(k.value) == kw.arg for k in n.keywords)
        for st in scope.stmts
        for n in st.walk()
    )


def _in_super_call(stmt: ast.stmt, name: ast.Name) -> bool:
    """Is `name` an argument of a `super().compute_loss(...)` call in `stmt`?"""
    for n in ast.walk(stmt):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "compute_loss"
            and isinstance(n.func.value, ast.Call)
            and last_name(n.func.value.func) == "super"
            and any(a is name for a in ast.walk(n))
        ):
            return True
    return False


def _hf_flag_findings(ctx: FileContext, resolver: Resolver) -> list[Finding]:
    """WB301 at `self.model_accepts_loss_kwargs = False` in an HF Trainer subclass whose
    loss is the model's (`compute_loss` not overridden, or returning
    `super().compute_loss(...)`): the Trainer then gives the model no `num_items_in_batch`,
    the model's `loss` is a mean over this micro-batch's labels, and `training_step`
    divides it by the steps. Under a transformers pinned below 4.46 (`Evidence.
    hf_before_446`) every such subclass does so, reported at its `class` line. Reported
    where labels are masked (`_msg301`'s evidence)."""
    out: list[Finding] = []
    ev = ctx.evidence
    shown = masks_labels(ctx.source) or _sft_pads_labels(ctx)
    masked = ev.masks_labels or shown
    # the package's own masking (`llava/constants.py`'s -100 for `llava/train/train.py`,
    # a folder without `__init__.py`) is evidence for the model's own mean, which the
    # Trainer divides below 4.46 or where it gives the model no count (`_counted_model`)
    wide = masked or ev.package_masks_labels
    if not wide:
        return out
    if not shown and labels_copy_inputs(ctx.source):
        # its own data path: labels copied from the input ids, nothing masked (the
        # grouped fixed-length blocks of a causal LM), whatever another file masks
        return out
    if ev.hf_before_446:
        out += [_finding(ctx, c, "WB301", _OLD_TRAINER) for c in _plain_trainers(ctx)]
    else:
        out += [
            _finding(ctx, c, "WB301", _no_count(ctx, resolver, model))
            for c in _plain_trainers(ctx)
            if (model := _counted_model(ctx, resolver, c)) is not None
        ]
        out += _run_trainer_findings(ctx, resolver)
    for cls in ctx.class_by_name.values():
        flags: list[ast.stmt] = [*hf_counting_off(cls)] if masked else []
        if not _direct_trainer(ctx, cls):
            continue
        # (a subclass that replaces the step or the loop, `training_step`,
        # `_inner_training_loop`, divides, or not, by its own code)
        old = (
            not flags
            and ctx.evidence.hf_before_446
            and not _own_step(cls)
            and not _replaces_train(cls)
        )
        if old and _own_loss(cls):
            continue  # its own `compute_loss` (`_hf_divides` judges it), and its heirs'
        if old and _base_only(ctx, cls):
            # a base the file builds only through its subclasses: each that inherits
            # the Trainer's loss is reported at its own `class` line instead
            out += [
                _finding(ctx, sub, "WB301", _OLD_TRAINER)
                for sub in _heirs(ctx, cls)
                if not any(q in _HF_DEFAULT_LOSS for q in _base_names(ctx, sub))
            ]
            continue
        if old:
            flags = [cls]
        # any version: a call of this subclass in the file trains a model of the run
        # whose `forward` takes no `**kwargs` (`_counted_model`)
        model = None
        if not flags and wide and not ctx.evidence.hf_before_446:
            model = _subclass_model(ctx, resolver, cls)
            flags = [cls] if model is not None else []
        if not flags:
            continue
        if _own_loss(cls):
            continue
        # Labels masked out of the loss: its count varies whatever the rows per batch.
        msg = (
            _OLD_TRAINER
            if old
            else _no_count(ctx, resolver, model)
            if model is not None
            else "with `model_accepts_loss_kwargs = False` the Trainer gives the model no "
            "`num_items_in_batch`: its `loss` is a mean over this micro-batch's unmasked "
            f"labels, and {FACTS['hf-trainer-compute-loss'].says}: micro-batches with "
            "fewer tokens weigh more"
        )
        out += [_finding(ctx, f, "WB301", msg) for f in flags]
    return out


def _note_default_trainers(ctx: FileContext) -> list[Finding]:
    """Keep, for the files that build them (`_run_trainer_findings`), the file's direct
    subclasses of the HF Trainer that keep its loss and step, where nothing reports them
    at their `class` line already (no pin below 4.46, no `model_accepts_loss_kwargs =
    False` of their own)."""
    if ctx.evidence.hf_before_446:
        return []
    for cls in ctx.class_by_name.values():
        if (
            _direct_trainer(ctx, cls)
            and not hf_counting_off(cls)
            and not _own_loss(cls)
            and not _own_step(cls)
            and not _replaces_train(cls)
        ):
            ctx.default_trainers[cls.name] = cls.lineno
    return []


def _run_trainer_findings(ctx: FileContext, resolver: Resolver) -> list[Finding]:
    """WB301 at the `class` line of a Trainer subclass of another file of the run
    (`_note_default_trainers`) that this file builds (`MyTrainer(model=model, ...)`, its
    arguments not left at one step) to train a model the Trainer gives no item count
    (`_counted_model`): as `_subclass_model` reports a subclass built in its own file."""
    program = resolver.program
    if program is None:
        return []
    out: list[Finding] = []
    for n in ast.walk(ctx.tree):
        name = dotted(n.func) if isinstance(n, ast.Call) else None
        if name is None or name.split(".")[0] in ctx.class_by_name:
            continue
        assert isinstance(n, ast.Call)
        target = resolver.global_name(name)
        at = program.default_trainer(target) if target is not None else None
        if at is None or at[0] == ctx.path or _one_micro_batch(ctx, n):
            continue
        model = _counted_model(ctx, resolver, n)
        if model is None:
            continue
        line, col = position(n)
        hop = Hop(path=ctx.path, line=line, col=col, function="", note=f"trains a `{model}`")
        out.append(
            Finding(
                path=at[0],
                line=at[1],
                col=1,
                code="WB301",
                message=_no_count(ctx, resolver, model),
                fix=RULES["WB301"].fix,
                trace=(hop,),
            )
        )
    return out


def _direct_trainer(ctx: FileContext, cls: ast.ClassDef) -> bool:
    """Is `cls` a direct subclass of a Trainer whose `compute_loss` is the model's own
    (transformers' `Trainer`; not TRL's, which compute their own losses), and not one that
    trains through TRL's PPO loop (`_trl_rl_loop`)?"""
    bases = [ctx.imports.qualname(b) or "" for b in cls.bases]
    return any(q in _HF_DEFAULT_LOSS for q in bases) and not _trl_rl_loop(bases)


def _trl_rl_loop(bases: list[str]) -> bool:
    """Does a class also derive from TRL's PPO trainer (`class CustomPPOTrainer(PPOTrainer,
    Trainer)`, LLaMA-Factory's)? It trains through that trainer's own loop (`step()` in
    TRL before 0.12, its own `train()` after), never through the transformers Trainer's
    `training_step` and its division."""
    return any(q.startswith("trl.") and q.rpartition(".")[2] == "PPOTrainer" for q in bases)


def _own_loss(cls: ast.ClassDef) -> bool:
    """Does `cls` override `compute_loss` with a loss of its own (one that does not return
    `super().compute_loss(...)`)?"""
    own = [f for f in cls.body if isinstance(f, _DEFS)]
    override = next((f for f in own if hf_compute_loss(f)), None)
    return override is not None and not any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "compute_loss"
        and isinstance(n.func.value, ast.Call)
        and last_name(n.func.value.func) == "super"
        for r in ast.walk(override)
        if isinstance(r, ast.Return) and r.value is not None
        for n in ast.walk(r.value)
    )


def _base_names(ctx: FileContext, cls: ast.ClassDef) -> list[str]:
    return [ctx.imports.qualname(b) or dotted(b) or "" for b in cls.bases]


def _base_only(ctx: FileContext, cls: ast.ClassDef) -> bool:
    """Is `cls` named in its file only as a base of the file's other classes, never built,
    bound, returned or handed on (a mixin, `class SchedulerMixin(Trainer)` under
    `class AxolotlTrainer(SchedulerMixin, Trainer)`)? The run then trains its subclasses,
    not it: which loss they compute is theirs to say (`_heirs`)."""
    bases = {id(b) for c in ctx.classes for b in c.bases}
    named = [n for n in ast.walk(ctx.tree) if isinstance(n, ast.Name) and n.id == cls.name]
    return bool(named) and all(id(n) in bases for n in named)


def _heirs(ctx: FileContext, base: ast.ClassDef) -> list[ast.ClassDef]:
    """The subclasses in the file of `base` (a Trainer subclass with the Trainer's own
    loss and step, named only as a base) that inherit that loss and step: none of their
    own `compute_loss` (other than `super()`'s), `training_step` or loop on the way, and
    no other base before the Trainer that computes its own loss (TRL's `DPOTrainer`,
    any `...Trainer` class not the Trainer itself: in the method order a mixin's
    `Trainer` base comes after every subclass of it). Base-only heirs hand it on."""
    out: list[ast.ClassDef] = []
    todo = [base]
    while todo:
        b = todo.pop()
        for sub in ctx.classes:
            if sub in out or sub is base or not any(dotted(x) == b.name for x in sub.bases):
                continue
            others = [
                q
                for x, q in zip(sub.bases, _base_names(ctx, sub), strict=True)
                if dotted(x) != b.name
            ]
            if (
                _own_loss(sub)
                or _own_step(sub)
                or _replaces_train(sub)
                or any(
                    q.endswith("Trainer")
                    and q not in _HF_DEFAULT_LOSS
                    and q not in (c.name for c in ctx.classes)
                    for q in others
                )
            ):
                continue
            if _base_only(ctx, sub):
                todo.append(sub)
            else:
                out.append(sub)
    return out


_OLD_TRAINER = (
    f"{FACTS['hf-trainer-before-4-46'].says}: micro-batches with fewer unmasked labels "
    "weigh more (4.46 gives the model the step's `num_items_in_batch`)"
)


_NO_COUNT = (
    "the model `{cls}` of the run {why}, so the Trainer "
    "gives it no `num_items_in_batch` (`model_accepts_loss_kwargs` is False): its own "
    f"`loss` is a mean over this micro-batch's labels, and "
    f"{FACTS['hf-trainer-compute-loss'].says}: micro-batches with fewer unmasked labels "
    "weigh more"
)


def _no_count(ctx: FileContext, resolver: Resolver, cls: str) -> str:
    """`_NO_COUNT` for the model class `cls` (`_counted_model`): why the Trainer gives it
    no item count, its forward's signature or its `accepts_loss_kwargs = False`."""
    local = ctx.class_by_name.get(cls)
    if local is not None:
        off = loss_kwargs_attr(local) is False
    else:
        target = resolver.global_name(cls)
        off = (
            target is not None
            and resolver.program is not None
            and (resolver.program.counting_off(target))
        )
    why = "sets `accepts_loss_kwargs = False`" if off else "takes no `**kwargs` in its `forward`"
    return _NO_COUNT.format(cls=cls, why=why)


# A model built from a class: `Model(config)`, `Model.from_pretrained(path)`.
_MODEL_MAKERS = frozenset({"from_pretrained", "from_config", "_from_config"})


def _counted_model(ctx: FileContext, resolver: Resolver, trainer: ast.Call) -> str | None:
    """The class of the run, as the file writes it, of a model the Trainer trains (its
    `model=` or first argument, a name some assignment of the file builds from it,
    `model = Model.from_pretrained(...)`) whose `forward` takes no `**kwargs` and returns
    a mean of its own (`Facts.returns`): whatever the version, `model_accepts_loss_kwargs`
    is then False and the model never gets the step's count
    (`FACTS["hf-trainer-compute-loss"]`). None if no such class."""
    given = next((k.value for k in trainer.keywords if k.arg == "model"), None)
    if given is None and trainer.args:
        given = trainer.args[0]
    if not isinstance(given, ast.Name):
        return None
    for node in ast.walk(ctx.tree):
        if not (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and any(isinstance(t, ast.Name) and t.id == given.id for t in node.targets)
        ):
            continue
        func = node.value.func
        if isinstance(func, ast.Attribute) and func.attr in _MODEL_MAKERS:
            func = func.value
        cls = dotted(func)
        if cls is None or not last_name(func)[:1].isupper():
            continue
        if _uncounted(ctx, resolver, cls):
            return cls
    return None


def _subclass_model(ctx: FileContext, resolver: Resolver, cls: ast.ClassDef) -> str | None:
    """The class of the run (`_counted_model`) of a model that a call of `cls` in this
    file trains (`MyTrainer(model=model, args=args)`), `cls` a direct subclass of the
    Trainer whose step and loop are the Trainer's own, its arguments not left at one
    step (`_one_micro_batch`). None if no such call."""
    if _own_step(cls) or _replaces_train(cls):
        return None
    for node in ast.walk(ctx.tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == cls.name
            and not _one_micro_batch(ctx, node)
            and (model := _counted_model(ctx, resolver, node)) is not None
        ):
            return model
    return None


def _uncounted(ctx: FileContext, resolver: Resolver, cls: str) -> bool:
    """Is the `forward` of `cls` (a class of this file, or one imported from the run)
    a mean no item count reaches (`frameworks.uncounted_forward`)?"""
    local = ctx.class_by_name.get(cls)
    if local is not None:
        fw = next((f for f in local.body if isinstance(f, _DEFS) and f.name == "forward"), None)
        return fw is not None and uncounted_model(local, fw, lambda: resolver.facts(fw).returns)
    target = resolver.global_name(cls)
    return (
        target is not None and resolver.program is not None and (resolver.program.uncounted(target))
    )


def _plain_trainers(ctx: FileContext) -> list[ast.Call]:
    """The calls of the Trainer class itself (`Trainer(model=model, ...)`, through any
    import or alias: `frameworks.FACTS["hf-trainer-before-4-46"]`), whose `compute_loss`
    is the model's own `loss`. A subclass of the run is judged at its `class` line."""
    calls = [
        n
        for n in ast.walk(ctx.tree)
        if isinstance(n, ast.Call) and (ctx.imports.qualname(n.func) or "") in _HF_DEFAULT_LOSS
    ]
    return [c for c in calls if not _one_micro_batch(ctx, c)]


def _one_micro_batch(ctx: FileContext, trainer: ast.Call) -> bool:
    """Are the Trainer's `args` (`args=`, or the second argument) built in this file by a
    `TrainingArguments(...)` call (the name's last assignment above the Trainer) that
    leaves `gradient_accumulation_steps` at 1 (a literal 1, or not given and no
    `**kwargs`)? Then nothing is accumulated or divided. Arguments parsed from the
    command line or a config may accumulate. A Trainer given `train_dataset=None` (one
    built to `predict()` or `evaluate()`) trains nothing at all."""
    data = next((k.value for k in trainer.keywords if k.arg == "train_dataset"), None)
    if isinstance(data, ast.Constant) and data.value is None:
        return True
    given = next((k.value for k in trainer.keywords if k.arg == "args"), None)
    if given is None and len(trainer.args) > 1:
        given = trainer.args[1]
    if isinstance(given, ast.Name):
        # its last assignment above the call (`args = parser.parse_args()` may come first)
        before = [
            n
            for n in ast.walk(ctx.tree)
            if isinstance(n, ast.Assign)
            and n.lineno < trainer.lineno
            and any(isinstance(t, ast.Name) and t.id == given.id for t in n.targets)
        ]
        given = max(before, key=lambda n: n.lineno).value if before else None
    return given is not None and _training_args_of_one(ctx, given)


def _training_args_of_one(ctx: FileContext, value: ast.expr) -> bool:
    if not (
        isinstance(value, ast.Call)
        and (ctx.imports.qualname(value.func) or "").rpartition(".")[2]
        in ("TrainingArguments", "Seq2SeqTrainingArguments")
    ):
        return False
    steps = None
    for k in value.keywords:
        if k.arg is None:
            return False  # `**kwargs`: may set it
        if k.arg == "gradient_accumulation_steps":
            steps = k.value
    return steps is None or (isinstance(steps, ast.Constant) and steps.value == 1)


_HF_OWN_STEP = frozenset({"training_step", "_inner_training_loop"})


def _own_step(cls: ast.ClassDef) -> bool:
    """Does `cls` replace the Trainer's step: its own `training_step`, or its own
    `_inner_training_loop` that never calls `self.training_step(...)`? A loop of its own
    that still calls the Trainer's step (LLaVA-NeXT's `LLaVATrainer`, corpus 6) keeps the
    step's division."""
    own = {f.name: f for f in cls.body if isinstance(f, _DEFS)}
    if "training_step" in own:
        return True
    loop = own.get("_inner_training_loop")
    return loop is not None and not any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "training_step"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
        for n in ast.walk(loop)
    )


def _replaces_train(cls: ast.ClassDef) -> bool:
    """Does `cls` override `train` with a loop of its own, calling neither `super().train`
    nor the Trainer's step (MeZO's LinearHeadTrainer fits a linear head in closed form):
    the Trainer's `training_step` and its division never run."""
    for f in cls.body:
        if isinstance(f, _DEFS) and f.name == "train":
            called = {
                n.func.attr
                for n in ast.walk(f)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            }
            return not called & {"train", *_HF_OWN_STEP}
    return False


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)

# TRL's SFTTrainer: the Trainer's own loss (`frameworks.FACTS["trl-sft-trainer"]`).
_TRL_SFT = frozenset(
    {"trl.SFTTrainer", "trl.trainer.SFTTrainer", "trl.trainer.sft_trainer.SFTTrainer"}
)

# The Trainers whose own `compute_loss` returns the model's `loss` (`Trainer.compute_loss`).
_HF_DEFAULT_LOSS = (
    frozenset(
        {
            "transformers.Trainer",
            "transformers.trainer.Trainer",
            "transformers.Seq2SeqTrainer",
            "transformers.trainer_seq2seq.Seq2SeqTrainer",
        }
    )
    | _TRL_SFT
)


def _sft_pads_labels(ctx: FileContext) -> bool:
    """Does the file build TRL's SFTTrainer with its default collator (no `data_collator=`,
    no `**kwargs`) and without packing (no `packing=True` in the file: the SFTTrainer's
    keyword, or its `SFTConfig`'s from 0.9)? That collator pads each micro-batch to its
    longest row and sets the padding's labels to -100
    (`frameworks.FACTS["trl-sft-trainer"]`): labels masked out of the loss."""
    if not ctx.mentions("SFTTrainer"):
        return False
    for n in ast.walk(ctx.tree):
        if (
            isinstance(n, ast.keyword)
            and n.arg == "packing"
            and not (isinstance(n.value, ast.Constant) and n.value.value is False)
        ):
            return False  # packed (or packed by a setting): fixed-length blocks
    for n in ast.walk(ctx.tree):
        if not (isinstance(n, ast.Call) and (ctx.imports.qualname(n.func) or "") in _TRL_SFT):
            continue
        given = {k.arg for k in n.keywords}
        if None not in given and "data_collator" not in given and len(n.args) <= 2:
            return True
    return False


def _pipeline_loss(ctx: FileContext, scope: Scope) -> bool:
    """Is the scope a function the file gives a DeepSpeed PipelineModule as `loss_fn`?"""
    return (
        scope.cls is None
        and not isinstance(scope.node, ast.Module)
        and _imports_deepspeed(ctx)
        and ctx.mentions("PipelineModule")
        and scope.name in _framework_names(ctx, pipeline_losses)
    )


def _megatron_loss(ctx: FileContext, scope: Scope) -> bool:
    """Is the scope a loss function the file's forward step hands Megatron's schedules
    (`frameworks.megatron_losses`), in a file that imports megatron? A method is none:
    the step hands over a function by its name (`return output, loss_func`), and a
    method of that name (`self.loss_func`, called by it) is another function."""
    return (
        not isinstance(scope.node, ast.Module)
        and scope.cls is None
        and ctx.mentions("forward_step")
        and "megatron" in ctx.imports.roots
        and scope.name in _framework_names(ctx, megatron_losses)
    )


def _framework_names(
    ctx: FileContext, reader: Callable[[ast.Module, Callable[[ast.expr], str | None]], set[str]]
) -> set[str]:
    """`reader(ctx.tree, ctx.imports.qualname)` (`frameworks.pipeline_losses`, ...), read
    once per file: each walks the whole tree, and the rules ask for every scope."""
    key = reader.__name__
    names = ctx.framework_names.get(key)
    if names is None:
        names = ctx.framework_names[key] = reader(ctx.tree, ctx.imports.qualname)
    return names


def _criterion_forward(ctx: FileContext, scope: Scope) -> bool:
    """Is the scope the `forward` of a fairseq criterion (`frameworks.fairseq_criterion`,
    here or through a base class of the run), which returns `(loss, sample_size, log)`?"""
    cls = scope.cls
    if cls is None or scope.name != "forward" or not ctx.mentions("sample_size"):
        return False
    return fairseq_criterion(cls) or (
        ctx.resolver is not None
        and ctx.resolver.derives_from(cls, ("FairseqCriterion", "LegacyFairseqCriterion"))
    )


def _criterion_divides(
    ctx: FileContext, flow: Flow, scope: Scope, node: ast.Return
) -> list[Finding]:
    """WB301 for a fairseq criterion whose `forward` returns a per-micro-batch mean as its
    loss (`frameworks.FACTS["fairseq-criterion"]`): whatever `sample_size` it returns
    beside it, the trainer sums the means of the micro-batches and divides by the summed
    sizes, a mean of micro-batch means. A sum returned with its count is exact. Reported
    where the returned `sample_size` is assigned, else at the return."""
    value = node.value
    if not (isinstance(value, ast.Tuple) and len(value.elts) == 3):
        return []
    loss, size = value.elts[0], value.elts[1]
    fact = FACTS["fairseq-criterion"]
    # a mean the criterion takes itself (`V`); fairseq's models return `(logits, extra)`,
    # so `model(...)[0]` is no model's mean loss (`v`)
    msg = _msg301(ctx, flow.tags(loss) & {"V"}, loss, None, by=fact.says)
    if not msg:
        return []
    where = scope.last_assignment(size.id, node.lineno) if isinstance(size, ast.Name) else None
    return [_finding(ctx, where or node, "WB301", msg)]


def _mmengine_model(ctx: FileContext, scope: Scope) -> bool:
    """Is the scope a method of an mmengine model, a class derived from `BaseModel` (here
    or through the run's bases), in a run whose OptimWrapper accumulates
    (`Evidence.mmengine_accumulates`, which also keeps pydantic's `BaseModel` out)? What
    its `forward(mode='loss')` returns, or a method returns to it, is a dict of losses."""
    cls = scope.cls
    return (
        cls is not None
        and ctx.evidence.mmengine_accumulates
        and ctx.resolver is not None
        and ctx.resolver.derives_from(cls, ("BaseModel",))
    )


def _mmengine_divides(
    ctx: FileContext, flow: Flow, scope: Scope, node: ast.Return
) -> list[Finding]:
    """WB301 for a method of an mmengine model that returns a dict of losses (the dict,
    or a name last assigned one: `loss_dict = {"loss": outputs.loss}`) whose `loss`
    entries (`frameworks.loss_entries`) hold a per-micro-batch mean: the OptimWrapper
    divides their sum by accumulative_counts (`frameworks.FACTS["mmengine-optim-wrapper"]`),
    a mean of micro-batch means. Reported where an entry's name is last assigned, else
    where the dict is built."""
    value = node.value
    where: ast.stmt = node
    if isinstance(value, ast.Name):
        built = scope.last_assignment(value.id, node.lineno)
        if built is not None:
            value, where = built.value, built
    if not isinstance(value, ast.Dict):
        return []
    says = FACTS["mmengine-optim-wrapper"].says
    out: list[Finding] = []
    for loss in loss_entries(value):
        tags = flow.tags(loss)
        if "D" in tags:
            continue  # detached (`"reduced_loss": loss.detach()`, logged): no gradient
        msg = _msg301(ctx, tags, loss, None, by=says)
        if msg:
            at = (
                scope.last_assignment(loss.id, where.lineno) if isinstance(loss, ast.Name) else None
            )
            out.append(_finding(ctx, at or where, "WB301", msg))
    return out


def _imports_deepspeed(ctx: FileContext) -> bool:
    """Does the file import deepspeed (or a name from it)? The facts of DeepSpeed ask."""
    return "deepspeed" in ctx.imports.roots


def _deepspeed_backward(ctx: FileContext, scope: Scope) -> bool:
    """Does the scope call `backward(loss)` of an engine `deepspeed.initialize` returned?"""
    calls = [
        e.node
        for e in scope.events
        if e.kind == BACKWARD and not e.synthetic and isinstance(e.node, ast.Call) and e.node.args
    ]
    if not calls or not _imports_deepspeed(ctx):
        return False
    engines = _engines(ctx, scope)
    return any(deepspeed_divides(c, engines) is not None for c in calls if isinstance(c, ast.Call))


def _engines(ctx: FileContext, scope: Scope) -> set[str]:
    """The names that hold a DeepSpeed engine in this scope: those the file binds to one
    (`frameworks.deepspeed_engines`), the attributes that this method's class, or a class
    of the run it derives from, binds to one (`self.model`, set in a base class's
    `init_engines` in another file), and the names this scope assigns from a call of a
    function of the run that returns one (`frameworks.deepspeed_run_engines`)."""
    engines = _framework_names(ctx, deepspeed_engines)
    program = ctx.resolver.program if ctx.resolver is not None else None
    if program is None or not (program.engine_attrs or program.engine_makers):
        return engines
    out = set(engines)
    cls = scope.cls
    if cls is not None and ctx.resolver is not None:
        for name, attrs in program.engine_attrs.items():
            if name == cls.name or ctx.resolver.derives_from(cls, (name,)):
                out |= {f"self.{a}" for a in attrs}
    if program.engine_makers:
        for n in ast.walk(scope.node):
            if (
                isinstance(n, ast.Assign)
                and len(n.targets) == 1
                and isinstance(n.value, ast.Call)
                and last_name(n.value.func) in program.engine_makers
                and (d := dotted(n.targets[0])) is not None
            ):
                out.add(d)
    return out


def _is_product(d: ast.BinOp | ast.AugAssign) -> bool:
    """`a / (b * c)`: a division by a product (of a count and the steps, perhaps)."""
    return (
        isinstance(d, ast.BinOp)
        and isinstance(d.right, ast.BinOp)
        and isinstance(d.right.op, ast.Mult)
    )


def _lightning(resolver: Resolver | None, scope: Scope) -> bool:
    """Is the scope's class a LightningModule, by its bases here or in other files of the
    run (`class NER(BaseTransformer)`, `BaseTransformer(pl.LightningModule)` elsewhere)?"""
    cls = scope.cls
    if cls is None:
        return False
    return lightning_class(cls) or (
        resolver is not None and resolver.derives_from(cls, ("LightningModule", "LitModule"))
    )


def _steps_calls(resolver: Resolver, scope: Scope) -> Callable[[ast.Call], bool]:
    """Is a call one of a function of the run that returns a number of steps?"""

    def steps(call: ast.Call) -> bool:
        r = resolver.resolve(call, scope)
        return r is not None and r[0].steps

    return steps


def _called_in_accumulate(resolver: Resolver | None, scope: Scope) -> bool:
    """Does a function of this file call the scope's function inside `with
    accelerator.accumulate(...):` (a helper that runs one micro-batch, its backward
    divided by the steps as if written in the block)?"""
    if resolver is None or not scope.name:
        return False
    return any(
        accumulate_block(c.withs, call) and not asserts_one_step(c)
        for c, call, _, _ in resolver.call_sites(scope)
    )


def _accelerate_helper(resolver: Resolver | None, scope: Scope) -> bool:
    """Does the scope call `accelerator.backward` and is it called inside accumulate?"""
    return any(
        e.kind == BACKWARD and accelerate_backward(e.node) for e in scope.events
    ) and _called_in_accumulate(resolver, scope)


def _accumulates(node: ast.With | ast.AsyncWith) -> bool:
    return any(
        isinstance(i.context_expr, ast.Call) and last_name(i.context_expr.func) == "accumulate"
        for i in node.items
    )


def _loss_hop(scope: Scope, node: ast.AST, note: str, path: str) -> Hop:
    return Hop(
        path=path,
        line=position(node)[0],
        col=position(node)[1],
        function=scope.qual,
        note=note,
    )


def _check_scope(ctx: FileContext, scope: Scope) -> tuple[list[Finding], frozenset[str]]:
    flow = Flow(ctx, scope)
    backward: dict[int, Event] = {
        id(e.node): e for e in scope.events if e.kind == BACKWARD and not e.synthetic
    }
    loss_fn = _is_loss_function(scope)
    lightning_step = (
        scope.name == "training_step"
        and ctx.evidence.lightning_accumulates
        and _lightning(ctx.resolver, scope)
    )
    pipe_loss = (
        FACTS["deepspeed-pipeline-loss"]
        if _pipeline_loss(ctx, scope)
        else FACTS["megatron-schedules-loss"]
        if _megatron_loss(ctx, scope)
        else None
    )
    criterion = _criterion_forward(ctx, scope)
    mm_model = _mmengine_model(ctx, scope)
    hf_loss = _hf_override(ctx.resolver, scope)
    params = _param_vars(scope)
    steps = _steps_calls(ctx.resolver, scope) if ctx.resolver is not None else None
    periods = _modulo_denominators(scope)
    if scope.divs:
        periods |= _named_steps(scope, periods, steps)
    trips = periods | accumulation_trips(scope) if any(map(_is_product, scope.divs)) else periods
    recips = _reciprocal_steps(scope, periods, steps) if scope.divs else {}
    # WB301's sum of K means: the step gated by `% k == 0`, nothing divided by the steps
    gated = _accumulation_gates(scope) if not recips else {}
    undivided: list[Finding] = []  # `_undivided_sum`, unless the scope divides a loss
    waiting: list[tuple[ast.expr, ast.AST, str]] = []  # ... and those for a later caller
    divided = False
    to_loss: dict[str, Hop] = {}  # g-tag -> where it reaches the loss
    to_grad: dict[str, Hop] = {}  # q-tag -> where it is stored as a gradient
    found: list[Finding] = []
    hf_found: list[Finding] = []  # `_hf_divides`, unless the scope divides by the steps
    # WB205: `.data` updates waiting for a backward that reuses a graph built before them
    pending: list[tuple[int, Finding]] = []
    assigned: dict[str, int] = {}  # name -> line of its latest assignment (this walk)
    for st in flow.run():
        node = st.node
        for sub in st.walk():
            ev = backward.get(id(sub))
            if ev is not None:
                if pending:
                    found += _reused_graph(flow, ev, pending, assigned)
                if isinstance(sub, ast.Call):
                    found += _framework_divides(ctx, flow, scope, sub, ev)
                if gated:
                    undivided += _undivided_sum(ctx, flow, ev, gated, waiting)
                for loss in ev.losses:
                    for tag in sorted(flow.tags(loss)):
                        if tag.startswith("g:"):
                            hop = _loss_hop(scope, sub, f"reaches {_short(sub)}", ctx.path)
                            to_loss.setdefault(tag, hop)
        _note_assigned(node, assigned)
        if isinstance(node, ast.Return) and node.value is not None:
            if lightning_step:
                found += _lightning_divides(ctx, flow, node)
            if pipe_loss is not None:
                found += _pipeline_divides(ctx, flow, scope, node, pipe_loss)
            if criterion:
                found += _criterion_divides(ctx, flow, scope, node)
            if mm_model:
                found += _mmengine_divides(ctx, flow, scope, node)
            if hf_loss:
                hf_found += _hf_divides(ctx, flow, scope, node)
            for value in _returned_losses(node.value, loss_fn):
                tags = flow.tags(value)
                if "p" in tags:  # combined with this rank's (differentiable) inputs
                    for tag in tags:
                        if tag.startswith("g:"):
                            hop = _loss_hop(scope, node, "returned as the loss", ctx.path)
                            to_loss.setdefault(tag, hop)
        for tag in _grad_store_tags(flow, node):
            if tag.startswith("q:"):
                to_grad.setdefault(tag, _loss_hop(scope, node, "stored as .grad", ctx.path))
        if not (st.nograd or scope.nograd):
            for f in _manual_update(ctx, flow, st, params):
                if f.code == "WB205":
                    pending.append((node.lineno, f))
                else:
                    found.append(f)
        found.extend(_mean_over_steps(ctx, flow, st, periods, steps, scope))
        if gated and not divided:
            divided = _divides_loss(flow, scope, st, periods, steps)
        if recips:
            found.extend(_mean_times_reciprocal(ctx, flow, st, recips, scope))
        if trips is not periods:
            found.extend(_count_and_steps(ctx, flow, scope, st, trips, steps))
    found += _gather_findings(ctx, flow, to_loss, to_grad)
    if not any(f.code == "WB301" for f in found):  # a mean divided by the steps here
        found += hf_found
    if not divided:
        found += undivided
        for loss, at, by in waiting:
            defer(ctx, flow, scope, loss, at, by)
    return found, returned_tags(flow.returns)


def _gather_findings(
    ctx: FileContext, flow: Flow, to_loss: dict[str, Hop], to_grad: dict[str, Hop]
) -> list[Finding]:
    """WB101 for each gradient-less gather that reaches the loss, WB103 for each gather of
    gradients stored back as a gradient, reported at the gather with the path taken."""
    found: list[Finding] = []
    origins = flow.origins
    for tag, hop in to_loss.items():
        o = origins.get(tag)
        trace = (*o.trace, hop)
        crossed = len({h.function for h in trace}) > 1 or o.path != ctx.path
        where = f"reaches the loss at line {hop.line}" if not crossed else "reaches the loss"
        partial = f"; {o.partial}" if o.partial else ""
        path_text = f"; path: {format_trace(trace, o.path)}" if crossed else ""
        found.append(
            Finding(
                path=o.path,
                line=o.line,
                col=o.col,
                code="WB101",
                message=f"{o.clause}, and {where}: the other ranks' terms get no gradient{partial}"
                f"{path_text}",
                fix=RULES["WB101"].fix,
                trace=trace,
            )
        )
    for tag, hop in to_grad.items():
        o = origins.get(tag)
        trace = (*o.trace, hop)
        crossed = len({h.function for h in trace}) > 1 or o.path != ctx.path
        path_text = f"; path: {format_trace(trace, o.path)}" if crossed else ""
        at = f" at line {hop.line}" if not crossed else ""
        found.append(
            Finding(
                path=o.path,
                line=o.line,
                col=o.col,
                code="WB103",
                message=f"gradients are all-gathered here and stored back as a gradient{at} "
                f"without a sum: all_gather concatenates, it does not add{path_text}",
                fix=RULES["WB103"].fix,
                trace=trace,
            )
        )
    return found


def _framework_divides(
    ctx: FileContext, flow: Flow, scope: Scope, call: ast.Call, ev: Event
) -> list[Finding]:
    """WB301 where the framework divides by the accumulation steps itself (no `/ k` in
    the source): a per-micro-batch mean backpropagated by `accelerator.backward` inside
    `accelerator.accumulate()` (`frameworks.divides_by_steps`), or by the `backward` of
    the engine `deepspeed.initialize` returns (`frameworks.deepspeed_divides`)."""
    if asserts_one_step(scope):
        return []  # the framework divides by 1 here
    fact = divides_by_steps(call, scope.withs)
    if fact is None and accelerate_backward(call) and _called_in_accumulate(ctx.resolver, scope):
        fact = divides_by_steps(call, scope.withs, called_in_accumulate=True)
    loss = ev.losses[0] if ev.losses else None
    if fact is None and call.args and _imports_deepspeed(ctx):
        fact = deepspeed_divides(call, _engines(ctx, scope))
        loss = call.args[0]
    if fact is None or loss is None:
        return []
    msg = _msg301(ctx, flow.tags(loss), loss, None, by=fact.says)
    if not msg:  # a caller in another file may show the mean (`deferred`)
        defer(ctx, flow, scope, loss, call, f"and {fact.says}")
    return [_finding(ctx, call, "WB301", msg)] if msg else []


def _lightning_divides(ctx: FileContext, flow: Flow, node: ast.Return) -> list[Finding]:
    """WB301 for a LightningModule's `training_step` that returns a per-micro-batch mean
    while the Trainer accumulates (`frameworks.FACTS["lightning-accumulation"]`)."""
    assert node.value is not None
    loss_fn = not isinstance(node.value, ast.Dict)  # the whole value, or its "loss" entries
    out: list[Finding] = []
    for loss in _returned_losses(node.value, loss_fn):
        msg = _msg301(ctx, flow.tags(loss), loss, None, by=FACTS["lightning-accumulation"].says)
        if msg:
            out.append(_finding(ctx, node, "WB301", msg))
    return out


def _pipeline_divides(
    ctx: FileContext, flow: Flow, scope: Scope, node: ast.Return, fact: Fact
) -> list[Finding]:
    """WB301 for a loss function whose return a framework divides by the steps (`fact`:
    a PipelineModule's `loss_fn`, `deepspeed-pipeline-loss`; the loss function of a
    Megatron forward step, `megatron-schedules-loss`, whose loss is the first of the
    `(loss, stats)` it returns) that returns a per-micro-batch mean, reported where the
    returned name takes its mean (its last assignment before the return), else (and for
    a tuple, which hands the loss over) at the return."""
    assert node.value is not None
    value = node.value
    if fact.framework == "megatron" and isinstance(value, ast.Tuple) and value.elts:
        value = value.elts[0]
    msg = _msg301(ctx, flow.tags(value), value, None, by=fact.says)
    if not msg:
        return []
    # a name returned as is (not the first of a tuple, which hands the loss over)
    bare = isinstance(value, ast.Name) and value is node.value
    where = (
        scope.last_assignment(value.id, node.lineno)
        if bare and isinstance(value, ast.Name)
        else None
    )
    return [_finding(ctx, where or node, "WB301", msg)]


def _note_assigned(node: ast.stmt, assigned: dict[str, int]) -> None:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.For | ast.AsyncFor):
        targets = [node.target]
    for t in targets:
        for x in ast.walk(t):
            if isinstance(x, ast.Name | ast.Attribute) and (d := dotted(x)) is not None:
                assigned[d] = node.lineno


def _reused_graph(
    flow: Flow, ev: Event, pending: list[tuple[int, Finding]], assigned: dict[str, int]
) -> list[Finding]:
    """The pending `.data` updates that this backward makes harmful: its loss reads the
    output of a forward pass (`T`) assigned before the update, so the graph it runs
    through saved the old value. A graph rebuilt after the update (the next step's
    forward) is not affected: the update then equals a `no_grad` one."""
    out: list[Finding] = []
    reads = {d for loss in ev.losses for d in _read_names(loss)}
    for line, f in list(pending):
        old = [n for n in reads if assigned.get(n, line) < line and "T" in flow.t.get(n, ())]
        if old:
            out.append(
                replace(
                    f,
                    message=f"{f.message}: `{sorted(old)[0]}` was computed before this update "
                    f"and is backpropagated at line {_line_of(ev)}",
                )
            )
            pending.remove((line, f))
    return out


def _read_names(node: ast.expr) -> Iterator[str]:
    for x in ast.walk(node):
        if isinstance(x, ast.Name | ast.Attribute) and (d := dotted(x)) is not None:
            yield d


def _line_of(ev: Event) -> int:
    return position(ev.node)[0]


def _short(node: ast.AST) -> str:
    text = ast.unparse(node)
    return f"`{text}`" if len(text) <= 40 else f"`{text[:37]}...`"


def _grad_store_tags(flow: Flow, node: ast.stmt) -> set[str]:
    """Tags of values this statement stores into a `.grad` (assignment or `copy_`)."""

    def is_grad(t: ast.expr) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "grad" for n in ast.walk(t))

    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Attribute) and is_grad(t) for t in node.targets
    ):
        return flow.tags(node.value)
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        func = node.value.func
        if isinstance(func, ast.Attribute) and func.attr in ("copy_", "set_") and is_grad(func):
            out: set[str] = set()
            for arg in node.value.args:
                out |= flow.tags(arg)
            return out
    return set()


def _grad_of(tags: set[str], base: str | None, params: set[str]) -> bool:
    """Do `tags` include the gradient of `base` (or any gradient, if `base` is a parameter)?"""
    if base is None:
        return False
    if f"G:{base}" in tags:
        return True
    return base in params and any(t.startswith("G:") for t in tags)


def _manual_update(ctx: FileContext, flow: Flow, st: Stmt, params: set[str]) -> Iterator[Finding]:
    node = st.node
    target: ast.expr | None = None
    value_tags: set[str] = set()
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Sub | ast.Add):
        target, value_tags = node.target, flow.tags(node.value)
    elif isinstance(node, ast.Assign) and len(node.targets) == 1:
        t0 = node.targets[0]
        if isinstance(t0, ast.Attribute) and t0.attr == "data":
            target, value_tags = t0, flow.tags(node.value)
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        func = node.value.func
        if isinstance(func, ast.Attribute) and func.attr in _INPLACE:
            target = func.value
            for arg in (*node.value.args, *(k.value for k in node.value.keywords)):
                value_tags |= flow.tags(arg)
    if target is None:
        return
    if isinstance(target, ast.Attribute) and target.attr == "data":
        base = target.value
        if isinstance(base, ast.Attribute) and base.attr == "grad":
            return  # `p.grad.data.mul_(c)`: scaling a gradient, not updating a parameter
        if any(t.startswith("G:") for t in flow.tags(base)):
            return  # `g = p.grad` (on some path), then `g.data = ...`: a gradient too
        if any(t.startswith("G:") for t in value_tags):
            yield _finding(
                ctx,
                node,
                "WB205",
                f"`{_text(base)}` is updated through .data with a gradient: autograd does not "
                "see the change, so a graph that saved the old value gives wrong gradients "
                "silently",
            )
        return
    if isinstance(target, ast.Attribute) and target.attr == "grad":
        return
    if _grad_of(value_tags, dotted(target), params):
        yield _finding(
            ctx,
            node,
            "WB204",
            f"`{_text(target)}` is updated in place with a gradient outside torch.no_grad(): "
            "autograd records the update (a leaf that requires grad raises; a non-leaf grows "
            "the graph every step)",
        )


def _mean_over_steps(
    ctx: FileContext,
    flow: Flow,
    st: Stmt,
    periods: set[str],
    steps: Callable[[ast.Call], bool] | None,
    scope: Scope,
) -> Iterator[Finding]:
    node = st.node
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
        if _is_accum_count(node.value, periods, steps) and not _logged_sum(scope, node.target):
            msg = _msg301_passed(ctx, scope, flow.tags(node.target), node.target, node.value)
            if msg:
                yield _finding(ctx, node, "WB301", msg)
            else:  # a caller in another file may show the mean (`deferred`)
                defer(ctx, flow, scope, node.target, node, f"divided by `{_text(node.value)}`")
        return
    logged = _log_entries(node)
    for sub in st.walk():
        if (
            isinstance(sub, ast.BinOp)
            and isinstance(sub.op, ast.Div)
            and _is_accum_count(sub.right, periods, steps)
            and not detached_copy(sub.left)
            and id(sub) not in logged
        ):
            msg = _msg301_passed(ctx, scope, flow.tags(sub.left), sub.left, sub.right)
            if msg:
                yield _finding(ctx, sub, "WB301", msg)
            else:
                defer(ctx, flow, scope, sub.left, sub, f"divided by `{_text(sub.right)}`")


def _log_entries(node: ast.AST) -> set[int]:
    """The ids of the values of a dict literal with string keys that a statement hands
    straight to a call whose result it drops (`accum_log(logs, {"loss": l / k})`,
    `wandb.log({...})`): a record for the log, which nothing backpropagates."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return set()
    call = node.value
    if last_name(call.func) == "backward":
        return set()
    out: set[int] = set()
    for arg in (*call.args, *(k.value for k in call.keywords)):
        if isinstance(arg, ast.Dict) and all(
            isinstance(k, ast.Constant) and isinstance(k.value, str) for k in arg.keys
        ):
            out |= {id(v) for v in arg.values}
    return out


def _logged_sum(scope: Scope, target: ast.expr) -> bool:
    """Is `target` a name the scope only ever adds detached values to (`loss +=
    mb_loss.detach()`, `.item()`), from a plain start (`loss = 0.0`, `torch.zeros(...)`)?
    Dividing it (`loss /= num_microbatches`) scales a logged number, no gradient."""
    if not isinstance(target, ast.Name):
        return False
    adds = 0
    for st in scope.stmts:
        n = st.node
        if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            if n.target.id != target.id or isinstance(n.op, ast.Div):
                continue
            v = n.value
            if not (
                isinstance(v, ast.Call)
                and isinstance(v.func, ast.Attribute)
                and v.func.attr in ("detach", "item")
            ):
                return False
            adds += 1
        elif (
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == target.id for t in n.targets)
            and not _plain_start(n.value)
        ):
            return False
    return adds > 0


def _plain_start(value: ast.expr) -> bool:
    """A number, or `torch.zeros(...)` / `torch.tensor(0.0)`: the start of a running sum."""
    return isinstance(value, ast.Constant) or (
        isinstance(value, ast.Call) and last_name(value.func) in _FRESH_STARTS
    )


# Plain starts of a running sum: `torch.zeros(...)`, `torch.tensor(0.0)`.
_FRESH_STARTS = frozenset({"zeros", "tensor", "zeros_like", "float"})


def _accumulation_gates(scope: Scope) -> dict[int, ast.expr]:
    """The loops whose iterations are the micro-batches of one step, with no division in
    sight -> their `k`: stepped `if i % k == 0` (`_gated_steps`), or a loop of k
    micro-batches stepped after it (`_trip_steps`)."""
    return {**(_gated_steps(scope) if scope.mods else {}), **_trip_steps(scope)}


def _trip_steps(scope: Scope) -> dict[int, ast.expr]:
    """The loops (by id) `for _ in range(k)`, `k` a number of micro-batches by its name
    (`args.num_microbatches`, `grad_accum_steps`), that call backward and never step,
    where the function steps after them -> `k`: each iteration one micro-batch of one
    step (mistral-finetune's `train.py`, corpus 6), its backward accumulated."""
    steps = [e for e in scope.events if e.kind == STEP]
    if not steps:
        return {}
    loops: dict[int, ast.stmt] = {}
    for ev in scope.events:
        if ev.kind == BACKWARD and not ev.synthetic and ev.loops:
            loops.setdefault(id(ev.loops[-1]), ev.loops[-1])
    out: dict[int, ast.expr] = {}
    for key, loop in loops.items():
        if not (
            isinstance(loop, ast.For)
            and isinstance(loop.iter, ast.Call)
            and isinstance(loop.iter.func, ast.Name)
            and loop.iter.func.id == "range"
            and len(loop.iter.args) == 1
        ):
            continue
        k = loop.iter.args[0]
        if not is_step_count_name(last_name(k) or ""):
            continue
        if any(any(id(x) == key for x in e.loops) for e in steps):
            continue  # it steps inside: no accumulation over its iterations
        if any(getattr(e.node, "lineno", 0) > loop.lineno for e in steps):
            out[key] = k
    return out


def _gated_steps(scope: Scope) -> dict[int, ast.expr]:
    """The loops (by id) whose optimizer step runs only `if i % k == 0` (`k` not a
    literal) -> `k`: every k-th micro-batch, the backward of the others accumulated."""
    out: dict[int, ast.expr] = {}
    for e in scope.events:
        if e.kind != STEP or e.synthetic or not e.loops:
            continue
        for c in e.conds:
            k = _modulo_gate(c)
            if k is not None:
                out.setdefault(id(e.loops[-1]), k)
    return out


def _modulo_gate(cond: ast.stmt) -> ast.expr | None:
    """`k` of `if (i + 1) % k == 0:` (also `not i % k`, `and`-ed with other tests)."""
    if not isinstance(cond, ast.If):
        return None
    for n in ast.walk(cond.test):
        if (
            isinstance(n, ast.BinOp)
            and isinstance(n.op, ast.Mod)
            and not isinstance(n.right, ast.Constant)
            and not isinstance(n.left, ast.Constant | ast.JoinedStr)
        ):
            return n.right
    return None


# A forward pass's output or a mean over items: what a loss is built from (`dataflow`).
_LOSS_TAGS = frozenset({"T", "V", "v", "L"})


def _divides_loss(
    flow: Flow,
    scope: Scope,
    st: Stmt,
    periods: set[str],
    steps: Callable[[ast.Call], bool] | None,
) -> bool:
    """Does this statement divide a forward pass's output or a mean (`T`, `V`, `v`, `L`)
    by the steps (also by a product holding them), or by a name not assigned in the
    loop it runs in (`loss_sum / num_items_in_window`: a count of the whole step, set
    before its micro-batches), or multiply a mean by an item count (torchtune's
    `self._loss_step(batch) * current_num_tokens`: a sum, scaled by the step's count
    after backward)? A logged number (`train_loss / (saves * k)`, summed from
    `.item()`s) is no loss."""
    node = st.node
    pairs: list[tuple[ast.expr, ast.expr]] = []
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
        pairs.append((node.target, node.value))
    pairs += [
        (n.left, n.right)
        for n in st.walk()
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)
    ]
    for n in st.walk():  # `mean * current_num_tokens`: a sum again, normalised later
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult):
            for a, b in ((n.left, n.right), (n.right, n.left)):
                if (counts_items(b) or "K" in flow.tags(b)) and flow.tags(a) & _LOSS_TAGS:
                    return True
    return any(
        (
            any(_is_accum_count(f, periods, steps) for f in factors(right))
            or (isinstance(right, ast.Name) and not assigned_in_loop(scope, st, right.id))
        )
        and (tags := flow.tags(left)) & _LOSS_TAGS
        and "D" not in tags  # a detached sum (`loss += mb_loss.detach()`): logged only
        for left, right in pairs
    )


def _undivided_sum(
    ctx: FileContext,
    flow: Flow,
    ev: Event,
    gated: dict[int, ast.expr],
    waiting: list[tuple[ast.expr, ast.AST, str]],
) -> list[Finding]:
    """WB301 for a per-micro-batch mean backpropagated every micro-batch of a loop that
    steps only every `k` (`_gated_steps`) with no division by the steps in the scope:
    the gradient is the sum of k micro-batch means, k times the mean of means, so
    micro-batches with fewer items weigh more (issue 33: SimCTG's trainers). A loss a
    parameter's call returned (`loss = model(x, y)` in `train(model, ...)`) is added to
    `waiting`, for a caller to show whose forward it ran (`deferred.defer`)."""
    if ev.synthetic or not ev.loops or any(_modulo_gate(c) is not None for c in ev.conds):
        return []
    k = gated.get(id(ev.loops[-1]))
    if k is None:
        return []
    for loss in ev.losses:
        if _scaled_by_callee(ctx, flow.scope, loss):
            continue  # divided by the steps where it is computed
        by = (
            f"is summed over the micro-batches of a step, with no division: the optimizer "
            f"steps every `{_text(k)}`"
        )
        msg = _msg301(ctx, flow.tags(loss), loss, None, by=by)
        if msg:
            return [_finding(ctx, ev.node, "WB301", msg)]
        waiting.append((loss, ev.node, f"and {by}"))
    return []


def _scaled_by_callee(ctx: FileContext, scope: Scope, loss: ast.expr) -> bool:
    """Is `loss` what a function of the run returns that divides by the steps itself
    (`Facts.scaled`): `lm_pass(args, model, batch).backward()`, or a name last assigned
    such a call?"""
    value: ast.expr | None = loss
    if isinstance(loss, ast.Name):
        a = scope.last_assignment(loss.id, loss.lineno + 1)
        value = a.value if a is not None else None
    if not isinstance(value, ast.Call) or ctx.resolver is None:
        return False
    r = ctx.resolver.resolve(value, scope)
    return r is not None and r[0].scaled


def _reciprocal_steps(
    scope: Scope, periods: set[str], steps: Callable[[ast.Call], bool] | None
) -> dict[str, ast.expr]:
    """Names the scope assigns the reciprocal of the number of accumulation steps
    (`loss_scale = 1.0 / accumulate_steps`, before the micro-batch loop) -> that number:
    `loss_scale * loss` divides by the steps. A name also assigned anything else is not
    one (issue 33: s1's gpt-accelera finetuning)."""
    out: dict[str, ast.expr] = {}
    other: set[str] = set()
    for st in scope.stmts:
        node = st.node
        if isinstance(node, ast.AugAssign | ast.AnnAssign) and isinstance(node.target, ast.Name):
            other.add(node.target.id)
        if not isinstance(node, ast.Assign):
            continue
        k = _reciprocal_of(node.value, periods, steps)
        for t in node.targets:
            for x in ast.walk(t):
                if isinstance(x, ast.Name):
                    if k is not None and x is t:
                        out.setdefault(x.id, k)
                    else:
                        other.add(x.id)
    return {name: k for name, k in out.items() if name not in other}


def _reciprocal_of(
    node: ast.expr, periods: set[str], steps: Callable[[ast.Call], bool] | None
) -> ast.expr | None:
    """`k` where `node` is `c / k`, a number over the accumulation steps; else None."""
    if (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Div)
        and isinstance(node.left, ast.Constant)
        and _is_accum_count(node.right, periods, steps)
    ):
        return node.right
    return None


def _mean_times_reciprocal(
    ctx: FileContext, flow: Flow, st: Stmt, recips: dict[str, ast.expr], scope: Scope
) -> Iterator[Finding]:
    """WB301 for a mean multiplied by the reciprocal of the steps (`_reciprocal_steps`):
    `(loss_scale * loss).backward()`, `loss *= loss_scale`, a division written so."""
    node = st.node
    pairs: list[tuple[ast.AST, ast.expr, ast.expr]] = []
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Mult):
        pairs.append((node, node.target, node.value))
    for sub in st.walk():
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mult):
            pairs += [(sub, sub.left, sub.right), (sub, sub.right, sub.left)]
    for where, loss, scale in pairs:
        if not isinstance(scale, ast.Name) or scale.id not in recips:
            continue
        msg = _msg301_passed(ctx, scope, flow.tags(loss), loss, recips[scale.id])
        if msg:
            yield _finding(ctx, where, "WB301", f"{msg} (through `{scale.id}`)")
            return


def _count_and_steps(
    ctx: FileContext,
    flow: Flow,
    scope: Scope,
    st: Stmt,
    periods: set[str],
    steps: Callable[[ast.Call], bool] | None,
) -> Iterator[Finding]:
    """WB301 for a summed loss divided by this micro-batch's item count and the number of
    micro-batches in one product (`accum.count_over_steps`)."""
    for sub in st.walk():
        if not (isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Div)):
            continue
        hit = count_over_steps(
            scope,
            st,
            sub,
            lambda f: _is_accum_count(f, periods, steps),
            lambda f: "K" in flow.tags(f),
        )
        if hit is not None:
            count, k = hit
            yield _finding(
                ctx,
                sub,
                "WB301",
                f"`{_text(sub.left)}` is divided by `{_text(count)}`, the item count of this "
                f"micro-batch, and by `{_text(k)}` micro-batches: a mean of micro-batch "
                "means, so micro-batches with fewer items weigh more; divide by the item "
                "count of the whole step instead",
            )


def _msg301_passed(
    ctx: FileContext, scope: Scope, tags: set[str], loss: ast.expr, steps: ast.expr
) -> str:
    """`_msg301`, with the evidence the callers pass in: a parameter (`a:loss`) divided
    by the steps in a callee (`self.optimize(loss)` dividing by
    gradient_accumulation_steps) holds what the call sites of this file give it."""
    msg = _msg301(ctx, tags, loss, steps)
    if msg or ctx.resolver is None:
        return msg
    names = {t[2:] for t in tags if t.startswith("a:")}
    if not names:
        return ""
    for caller, call, facts, bound in ctx.resolver.call_sites(scope):
        args = [v for p, v in facts.bind(call, bound) if p in names]
        got = _tags_at(ctx, caller, call, args) if args else set()
        msg = _msg301(ctx, got, loss, steps)
        if msg:
            return (
                f"{msg}; the mean is built in `{caller.qual or '<module>'}` and passed in at "
                f"line {call.lineno}"
            )
    return ""


def _tags_at(ctx: FileContext, scope: Scope, call: ast.Call, args: list[ast.expr]) -> set[str]:
    """The mean tags (`V`, `v`, `L`) of `args` where `call` runs in `scope`."""
    flow = Flow(ctx, scope)
    for st in flow.run():
        if any(x is call for x in st.walk()):
            out: set[str] = set()
            for a in args:
                out |= flow.tags(a)
            return out & {"V", "v", "L"}
    return set()


_FIXED_SIZE_RE = re.compile(r"drop_last\s*=\s*True")


def _msg301(
    ctx: FileContext, tags: set[str], loss: ast.expr, steps: ast.expr | None, *, by: str = ""
) -> str:
    """The WB301 message for a loss with these tags divided by the step count; "" for none.

    A mean over a count the code shows to vary (`V`) is always reported. The `loss`
    field of a model's output (`v`) is a mean over items the linter cannot count: exact
    when every micro-batch has the same item count, so it is left alone where the file
    builds fixed-size batches (`drop_last=True`) and masks no labels itself (rows fixed,
    tokens counted elsewhere), where the forward pass was not given
    token inputs (`L`: `labels=`, `input_ids=`, `**batch`; a contrastive model's
    `query=`/`passage=` loss is a mean over rows) or where the file does not mask labels
    out of the loss (`frameworks.masks_labels`: a -100 label, `ignore_index`; one label
    per sequence, and grouped blocks of a fixed length, keep their count), and reported
    with that condition otherwise."""
    divided = f"divided by `{_text(steps)}`" if steps is not None else f"and {by}"
    if "V" in tags:
        return (
            f"`{_text(loss)}` is a mean over a data-dependent number of items (tokens, "
            f"ignore_index) {divided}: micro-batches with fewer items weigh "
            "more, so the sum is not the whole-batch mean"
        )
    if "v" not in tags or "L" not in tags:
        return ""
    shown = masks_labels(ctx.source)
    if (
        not (shown or ctx.evidence.masks_labels or ctx.evidence.package_masks_labels)
        # fixed-size batches fix the rows, not the tokens: where this file masks labels
        # itself, the count varies whatever `drop_last` says
        or (_FIXED_SIZE_RE.search(ctx.source) and not shown)
    ):
        return ""
    return (
        f"`{_text(loss)}` is a model's mean loss over the items of its micro-batch (tokens "
        f"or rows) {divided}: exact only if every micro-batch has the same "
        "item count (fixed-size batches, no padding tokens); where the count varies, "
        "micro-batches with fewer items weigh more"
    )
