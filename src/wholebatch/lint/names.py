"""What a name or a call means: import aliases, dotted names, and the kinds of calls the
rules care about (collectives, backward, zero_grad, optimizer.step, clipping, ranks).

Everything here is a heuristic over the syntax tree; nothing is imported or run.
Precision matters more than recall: a correct training loop must never be flagged,
so each predicate errs towards "not this kind".
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = [
    "DIST_GATHERS",
    "Imports",
    "counts_items",
    "detached_copy",
    "dotted",
    "int_literal",
    "is_count_expr",
    "is_nonfinite_test",
    "is_on_replica_group",
    "is_on_subgroup",
    "is_optimizer_name",
    "is_rank_local_test",
    "is_rank_ref",
    "is_rank_test",
    "is_scaler_name",
    "is_step_count_name",
    "is_sum_reduction",
    "last_name",
    "masking_param",
    "names_in",
    "position",
    "uncast",
    "walk_local",
]

# torch.distributed collectives: every rank of the group must call them (c10d docs).
_DIST_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_object",
        "all_gather_into_tensor",
        "_all_gather_base",
        "all_gather_coalesced",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "barrier",
        "monitored_barrier",
        "new_group",
        # torch.distributed._functional_collectives
        "all_gather_tensor",
        "all_gather_tensor_autograd",
        "reduce_scatter_tensor_autograd",
        "all_to_all_single_autograd",
    }
)
_DIST_NAMESPACES = frozenset(
    {
        "torch.distributed",
        "torch.distributed.distributed_c10d",
        "torch.distributed.nn",
        "torch.distributed.nn.functional",
        "torch.distributed._functional_collectives",
        "torch.distributed.functional_collectives",
    }
)
_WB_COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_reduce",
        "reduce_scatter",
        "all_to_all",
        "broadcast",
        "ring_shift",
        "all_ranks_agree",
        "any_rank",
    }
)
# Gathers whose output has no autograd history (plain c10d, in-place into a list/tensor).
DIST_GATHERS = frozenset(
    {"all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced"}
)
_PLAIN_DIST = frozenset({"torch.distributed", "torch.distributed.distributed_c10d"})

_RANK_NAMES = frozenset(
    {
        "rank",
        "local_rank",
        "global_rank",
        "node_rank",
        "ddp_rank",
        "ddp_local_rank",
        "rank_id",
        "world_rank",
        "process_index",
        "local_process_index",
        "my_rank",
        "is_main_process",
        "is_local_main_process",
        "is_master",
        "is_master_process",
        "master_process",
        "is_rank_zero",
        "is_rank_0",
        "is_rank0",
        "is_global_zero",
        "is_main",
        "main_process",
        "is_local_master",
        "is_chief",
    }
)
_RANK_FUNCS = frozenset(
    {
        "get_rank",
        "get_local_rank",
        "get_global_rank",
        "get_node_local_rank",
        "is_main_process",
        "is_master",
        "is_rank_zero",
        "is_primary",
        "is_main",
    }
)
_NONFINITE_FUNCS = frozenset({"isfinite", "isnan", "isinf"})
_NOGRAD_FUNCS = frozenset({"no_grad", "inference_mode"})

# `opt`, `opts`, `opt_g`, `optD`, `opt1`, `g_opt`: case-sensitive so `option` is not one.
_OPT_RE = re.compile(r"^opt($|_|s$|[A-Z0-9])|_opts?$")
# Variables named after the optimizer class: `sgd.step()`, `adam.step()`.
_OPT_CLASSES = frozenset(
    {"sgd", "adam", "adamw", "lbfgs", "rmsprop", "adagrad", "adadelta", "lamb", "lion", "muon"}
)


def dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a chain of attributes on a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def position(node: ast.AST) -> tuple[int, int]:
    """(1-based line, 1-based column) of a node (statements and expressions have both;
    the linter's events hold either, as `ast.AST`)."""
    return getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1


def is_sum_reduction(node: ast.expr | None) -> bool:
    """Is a loss's `reduction=` value "sum" or "none" whichever way it goes: a literal,
    or a choice of literals (fairseq's `reduction="sum" if reduce else "none"`)? Then
    the loss is no mean over its items."""
    if isinstance(node, ast.IfExp):
        return is_sum_reduction(node.body) and is_sum_reduction(node.orelse)
    return isinstance(node, ast.Constant) and node.value in ("sum", "none")


def last_name(node: ast.expr) -> str:
    """The identifier a reader would call this expression by: `self.opt[0]` -> `opt`."""
    while True:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return node.attr
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            return ""


_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def walk_local(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under `node` (itself included), not entering nested defs, lambdas, classes.

    Order is not source order. Written out by hand (not `ast.iter_child_nodes`) because
    it is the linter's inner loop: about twice as fast on the torch package.
    """
    stack = [node]
    pop, push = stack.pop, stack.append
    while stack:
        cur = pop()
        yield cur
        for name in cur._fields:
            if name == "ctx":
                continue
            v = getattr(cur, name, None)
            if isinstance(v, list):
                for x in v:
                    if isinstance(x, ast.AST) and not isinstance(x, _NESTED):
                        push(x)
            elif isinstance(v, ast.AST) and not isinstance(v, _NESTED):
                push(v)


def names_in(node: ast.AST) -> set[str]:
    """Every name and dotted chain read in `node`: `f(self.x.T)` -> {f, self, self.x, self.x.T}."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            d = dotted(sub)
            if d is not None:
                out.add(d)
    return out


@dataclass
class Imports:
    """Local names bound by imports anywhere in a file, mapped to what they refer to.

    Attributes:
        aliases: local name -> fully qualified name (`dist` -> `torch.distributed`).
        relative: local name -> (level, dotted name after the dots) for relative
            imports: `from ..util import gather as g` gives `g -> (2, "util.gather")`.
    """

    aliases: dict[str, str] = field(default_factory=dict)
    relative: dict[str, tuple[int, str]] = field(default_factory=dict)
    # the modules of `from pkg.model import *` (absolute imports), in order
    stars: list[str] = field(default_factory=list)
    # module-level `name = a.b.c` assignments, resolved by `finish` once every import is known
    _bound: list[tuple[str, ast.expr]] = field(default_factory=list)
    # the top-level packages the aliases name (`deepspeed`, `megatron`), set by `finish`:
    # rules ask once per scope whether the file imports a framework
    roots: frozenset[str] = frozenset()

    def bind(self, name: str, value: ast.expr) -> None:
        """`name = torch.distributed.all_gather` at module level: `name` is another name
        for what `value` names (resolved through the imports by `finish`)."""
        self._bound.append((name, value))

    def add(self, node: ast.Import | ast.ImportFrom) -> None:
        """Record the names one import statement binds."""
        aliases = self.aliases
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    root = a.name.split(".")[0]
                    aliases.setdefault(root, root)
        elif node.module and node.level == 0:
            for a in node.names:
                if a.name == "*":
                    self.stars.append(node.module)
                    continue
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif node.level:
            prefix = f"{node.module}." if node.module else ""
            for a in node.names:
                self.relative[a.asname or a.name] = (node.level, prefix + a.name)

    def finish(self) -> None:
        """Add the conventional names snippets use without importing (notebooks, docs),
        then the module-level aliases (`gather = dist.all_gather`) of imported names."""
        for name, full in (
            ("torch", "torch"),
            ("dist", "torch.distributed"),
            ("nn", "torch.nn"),
            ("F", "torch.nn.functional"),
        ):
            self.aliases.setdefault(name, full)
        for name, value in self._bound:
            d = dotted(value)
            if d is not None and d.split(".")[0] in self.aliases and name not in self.aliases:
                meant = self.qualname(value)
                if meant is not None:
                    self.aliases[name] = meant
        self.roots = frozenset(q.partition(".")[0] for q in self.aliases.values())

    def qualname(self, node: ast.expr) -> str | None:
        """The fully qualified dotted name of `node`, resolving the root through imports."""
        d = dotted(node)
        if d is None:
            return None
        root, _, rest = d.partition(".")
        full = self.aliases.get(root, root)
        return f"{full}.{rest}" if rest else full

    def collective(self, call: ast.Call) -> str | None:
        """The qualified name of `call` if it is a collective every rank must join."""
        q = self.qualname(call.func)
        if q is None:
            return None
        ns, _, name = q.rpartition(".")
        if ns in _DIST_NAMESPACES and name in _DIST_COLLECTIVES:
            return q
        if (ns == "wholebatch" or ns.startswith("wholebatch.")) and name in _WB_COLLECTIVES:
            return q
        return None

    def plain_gather(self, call: ast.Call) -> str | None:
        """The name of `call` if it is a c10d all-gather whose output carries no gradient."""
        q = self.qualname(call.func)
        if q is None:
            return None
        ns, _, name = q.rpartition(".")
        return q if ns in _PLAIN_DIST and name in DIST_GATHERS else None

    def is_no_grad_call(self, node: ast.expr) -> bool:
        """True for `torch.no_grad()`, `torch.inference_mode()`, `set_grad_enabled(...)`."""
        target = node.func if isinstance(node, ast.Call) else node
        name = last_name(target)
        if name in _NOGRAD_FUNCS or name == "_use_grad_for_differentiable":
            return True
        # set_grad_enabled(False) disables grad; with a variable we cannot tell, and
        # assuming "disabled" keeps the update rules quiet (precision over recall).
        return name == "set_grad_enabled"


def is_optimizer_name(name: str) -> bool:
    """Does an identifier read like an optimizer (`optimizer`, `opt_g`, `optD`, `sgd`)?"""
    low = name.lower()
    if "sched" in low or "scaler" in low or low.startswith("option"):
        return False
    return "optim" in low or low in _OPT_CLASSES or _OPT_RE.search(name) is not None


# Names of a count of accumulation steps: `accum_steps`, `gradient_accumulation_steps`,
# `update_freq`, `num_micro_batches`, `cfg.accumulation_iters(...)`.
_STEPS_RE = re.compile(
    r"accum|accumulat|grad_acc|micro|n_?chunks|num_?chunks|update_freq", re.IGNORECASE
)
# Denominators that count items of this micro-batch: `num_tokens`, `n_items`, ...
_COUNT_RE = re.compile(r"n_?tok|num_?tok|ntok|tokens?_count|n_?items|num_?items|num_valid|n_valid")


def is_step_count_name(name: str) -> bool:
    """Does an identifier read like a number of accumulation steps?"""
    return _STEPS_RE.search(name) is not None


def counts_items(node: ast.expr) -> bool:
    """Does `node` count the items of a micro-batch: a whole `mask.sum()` (no `dim`),
    `count_nonzero`, a `num_tokens`-like name? A per-row count (`mask.sum(-1)`) is
    not: dividing by it gives per-row means, which a later `.mean()` averages over rows."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr == "count_nonzero" or (
                n.func.attr == "sum"
                and not n.args
                and not any(k.arg in ("dim", "axis") and _is_set(k.value) for k in n.keywords)
            ):
                return True
        elif isinstance(n, ast.Call) and last_name(n.func) == "count_nonzero":
            return True
        if (  # `torch.sum(mask)`: the function's form of a whole `mask.sum()`
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "sum"
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "torch"
            and len(n.args) == 1
            and not n.keywords
        ):
            return True
        # transformers' `num_items_in_batch` counts the whole step's items (all its
        # micro-batches, Trainer._get_num_items_in_batch): dividing by it is exact
        if (
            isinstance(n, ast.Name | ast.Attribute)
            and _COUNT_RE.search(last_name(n))
            and last_name(n) != _STEP_ITEMS
        ):
            return True
    return False


_STEP_ITEMS = "num_items_in_batch"


_MASK_METHODS = frozenset({"ne", "eq", "bool", "float", "long", "int", "to", "type", "sum"})


# Methods applied to a count that leave it a count: `.clamp(min=1)`, `.float()`.
_KEEPS_COUNT = frozenset({"clamp", "clamp_min", "clamp_", "float", "double", "long", "int", "to"})


def is_count_expr(node: ast.expr) -> bool:
    """Is `node` a whole count of a micro-batch's items: `mask.sum()`, `torch.sum(mask)`,
    `(labels != -100).sum()`, `mask.count_nonzero()` (of a mask, not of a product: a
    sum of `loss * mask` is a summed loss)? `counts_items` reads the division itself; this
    reads an assignment (`n_valid = torch.sum(loss_mask)`, then `/ n_valid`), also kept
    off zero (`mask.sum().clamp_min(1)`) or chosen on one branch (`mask.sum() if mask is
    not None else n`)."""
    if isinstance(node, ast.IfExp):
        return is_count_expr(node.body) or is_count_expr(node.orelse)
    while (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _KEEPS_COUNT
    ):
        node = node.func.value
    if not isinstance(node, ast.Call) or last_name(node.func) not in ("sum", "count_nonzero"):
        return False
    if any(k.arg in ("dim", "axis") and _is_set(k.value) for k in node.keywords):
        return False
    func = node.func
    operand: ast.expr | None
    if isinstance(func, ast.Attribute) and dotted(func) not in ("torch.sum", "torch.count_nonzero"):
        if node.args:
            return False  # `x.sum(-1)`: per row
        operand = func.value
    else:  # `torch.sum(mask)`, `sum(mask)`
        operand = node.args[0] if len(node.args) == 1 else None
        if isinstance(func, ast.Name) and not (
            isinstance(operand, ast.Name | ast.Attribute) and "mask" in last_name(operand).lower()
        ):
            return False  # the builtin over a list of numbers (`sum(weights)`): no count
    while isinstance(operand, ast.Call) and isinstance(operand.func, ast.Attribute):
        if operand.func.attr not in _MASK_METHODS:
            return False
        operand = operand.func.value
    if isinstance(operand, ast.Compare):
        return True
    if not isinstance(operand, ast.Name | ast.Attribute | ast.Subscript):
        return False
    name = last_name(operand).lower()
    return "mask" in name or "loss" not in name  # `loss.sum()` sums a loss


def _is_set(value: ast.expr) -> bool:
    """A `dim=`/`axis=` argument that names a dimension (not `None`)."""
    return not (isinstance(value, ast.Constant) and value.value is None)


def is_scaler_name(name: str) -> bool:
    """Does an identifier read like an AMP GradScaler?"""
    return "scaler" in name.lower()


def is_rank_ref(node: ast.AST) -> bool:
    """Is `node` a rank (`rank`, `self.local_rank`, `dist.get_rank()`, `is_main_process`),
    or its module constant in capitals (`RANK = int(os.getenv("RANK", -1))`, `LOCAL_RANK`)?"""
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return name in _RANK_NAMES or (name.isupper() and name.lower() in _RANK_NAMES)
    if isinstance(node, ast.Call):
        return last_name(node.func) in _RANK_FUNCS
    return False


def is_on_subgroup(call: ast.Call) -> bool:
    """`group=g`: only the members of `g` call it, so a rank test around it is expected."""
    for kw in call.keywords:
        if kw.arg in ("group", "process_group", "pg") and not (
            isinstance(kw.value, ast.Constant) and kw.value.value is None
        ):
            return "WORLD" not in ast.unparse(kw.value)
    return False


# Groups whose ranks hold the same batch and replicate the computation (Megatron's tensor
# and model parallelism): a gather over one is followed by the same computation on every
# rank of it, so each rank's gradient for its own slice is already the whole gradient.
_REPLICA_GROUP_RE = re.compile(
    r"tensor_model_parallel|tensor_parallel|model_parallel|\btp_?group|_tp_group|\bmp_?group",
    re.IGNORECASE,
)


def is_on_replica_group(call: ast.Call) -> bool:
    """`dist.all_gather(parts, x, group=get_tensor_model_parallel_group())`: a collective
    over the ranks of a tensor/model-parallel group (they see the same batch)."""
    group: ast.expr | None = next(
        (k.value for k in call.keywords if k.arg in ("group", "process_group", "pg")), None
    )
    if group is None and len(call.args) >= 3:
        group = call.args[2]
    return group is not None and _REPLICA_GROUP_RE.search(ast.unparse(group)) is not None


def _is_membership(test: ast.expr) -> bool:
    """`rank in ranks`: a sub-group test; collectives on that sub-group are fine inside."""
    return any(
        isinstance(sub, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in sub.ops)
        for sub in ast.walk(test)
    )


def detached_copy(e: ast.expr) -> bool:
    """`x.detach()`, `x.item()`, `x.mean().detach()`: a copy with no gradient (divided
    by the steps, a number for the log)."""
    return (
        isinstance(e, ast.Call)
        and isinstance(e.func, ast.Attribute)
        and e.func.attr in ("detach", "item")
    )


def uncast(e: ast.expr) -> ast.expr:
    """`mask` of `mask.bool()`, `mask.to(torch.bool)`, `mask.type(...)`: what a cast
    converts (a mask used as an index, cast or not)."""
    while isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in _CASTS:
        e = e.func.value
    return e


_CASTS = frozenset({"bool", "to", "type"})


def int_literal(node: ast.expr) -> int | None:
    """The value of an integer literal (`3`, `-1`), else None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = int_literal(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


# `rank OP c` for every rank r = 0, 1, 2, ...: true on all of them, or on none.
_SAME_ON_EVERY_RANK: dict[type[ast.cmpop], Callable[[int], bool]] = {
    ast.GtE: lambda c: c <= 0,  # rank >= 0 (all), or >= a negative number
    ast.Gt: lambda c: c < 0,  # rank > -1
    ast.Lt: lambda c: c <= 0,  # rank < 0 (none)
    ast.LtE: lambda c: c < 0,  # rank <= -1 (none)
    ast.Eq: lambda c: c < 0,  # rank == -1 (none: the "not distributed" sentinel)
    ast.NotEq: lambda c: c < 0,  # rank != -1 (all)
}
_FLIPPED: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Gt: ast.Lt,
    ast.Lt: ast.Gt,
    ast.GtE: ast.LtE,
    ast.LtE: ast.GtE,
    ast.Eq: ast.Eq,
    ast.NotEq: ast.NotEq,
}


def _is_distributed_test(node: ast.Compare) -> bool:
    """A comparison with the same outcome on every rank: `local_rank != -1` and `rank is
    None` ("are we distributed at all"), `rank >= 0`, `rank < world_size`."""
    others = [node.left, *node.comparators]
    if any(isinstance(o, ast.Constant) and o.value is None for o in others):
        return True
    if len(node.ops) != 1:
        return False
    left, op, right = node.left, node.ops[0], node.comparators[0]
    if is_rank_ref(right) and not is_rank_ref(left):
        left, right = right, left
        op = _FLIPPED.get(type(op), ast.Is)()
    if not is_rank_ref(left):
        return False
    c = int_literal(right)
    if c is not None:
        same = _SAME_ON_EVERY_RANK.get(type(op))
        return same is not None and same(c)
    # `rank < world_size`: every rank is below the world size
    return isinstance(op, ast.Lt) and "world" in (dotted(right) or ast.unparse(right)).lower()


def is_rank_test(test: ast.expr) -> bool:
    """Does this condition split the ranks (`rank == 0`, `dist.get_rank() != 0`, ...)?"""
    if _is_membership(test):
        return False
    skip: set[int] = set()
    for sub in ast.walk(test):
        if isinstance(sub, ast.Compare) and _is_distributed_test(sub):
            skip.update(id(n) for n in ast.walk(sub))
    return any(id(sub) not in skip and is_rank_ref(sub) for sub in ast.walk(test))


def is_nonfinite_test(test: ast.expr) -> bool:
    """Does this condition test a value for NaN/inf (`not torch.isfinite(loss)`)?"""
    return any(
        isinstance(sub, ast.Call) and last_name(sub.func) in _NONFINITE_FUNCS
        for sub in ast.walk(test)
    )


def is_rank_local_test(test: ast.expr, agreed: set[str]) -> bool:
    """Can this condition differ between ranks? Rank tests always; NaN tests unless agreed.

    Args:
        test: the `if` condition.
        agreed: names whose value came out of (or went through) a collective, and so is
            the same on every rank.
    """
    if is_rank_test(test):
        return True
    if is_nonfinite_test(test):
        return not (names_in(test) & agreed)
    return False


# Calls that write a value into a tensor (where a label's ignore value is written).
_VALUE_WRITERS = frozenset(
    {"where", "masked_fill", "masked_fill_", "fill_", "full", "full_like", "new_full", "pad"}
)


def masking_param(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The optional parameter that every write of `fn`'s loss's ignore value into its
    labels is conditioned on; "" where there is none (issue 33: x-transformers'
    `if exists(lens): x = x.masked_fill(~mask, ignore_index)`, `torch.where(mask, seq,
    -1)` for `ignore_index=-1`). The parameter defaults to None and the writes sit under
    `if exists(p)`, `if p is not None` or `if p`: a call that leaves it unset masks
    nothing itself, so its loss counts the items the caller's data holds."""
    a = fn.args
    positional = (*a.posonlyargs, *a.args)
    defaults = [
        *zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True),
        *zip(a.kwonlyargs, a.kw_defaults, strict=True),
    ]
    optional = {x.arg for x, d in defaults if isinstance(d, ast.Constant) and d.value is None}
    if not optional:
        return ""
    values = {
        ast.unparse(k.value)
        for n in walk_local(fn)
        if isinstance(n, ast.Call)
        for k in n.keywords
        if k.arg == "ignore_index" and isinstance(k.value, ast.Name | ast.Attribute | ast.UnaryOp)
    }
    if not values:
        return ""
    gates: set[str] = set()  # the condition of each write ("" for none)

    def written(node: ast.expr) -> bool:
        return isinstance(node, ast.Name | ast.Attribute | ast.UnaryOp) and (
            ast.unparse(node) in values
        )

    def visit(stmts: list[ast.stmt], gate: str) -> None:
        for st in stmts:
            if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            if isinstance(st, ast.If):
                scan(st.test, gate)
                visit(st.body, _optional_test(st.test, optional) or gate)
                visit(st.orelse, gate)
                continue
            if (
                isinstance(st, ast.Assign)
                and written(st.value)
                and any(isinstance(t, ast.Subscript) for t in st.targets)
            ):
                gates.add(gate)  # `labels[pad] = -100`
            for child in ast.iter_child_nodes(st):
                if isinstance(child, ast.stmt):
                    visit([child], gate)
                elif isinstance(child, ast.ExceptHandler | ast.match_case):
                    visit(child.body, gate)
                elif isinstance(child, ast.expr):
                    scan(child, gate)

    def scan(expr: ast.expr, gate: str) -> None:
        for n in ast.walk(expr):
            if isinstance(n, ast.Call):
                given = [*n.args, *(k.value for k in n.keywords if k.arg != "ignore_index")]
                # a literal (`-1`) is also a shape or a dim (`view(-1)`, `dim=-1`): it
                # counts only where a call writes values (`torch.where(mask, seq, -1)`)
                writes = last_name(n.func) in _VALUE_WRITERS
                if any(written(x) and (writes or not isinstance(x, ast.UnaryOp)) for x in given):
                    gates.add(gate)  # `x.masked_fill(~mask, ignore_index)`

    visit(fn.body, "")
    return next(iter(gates)) if len(gates) == 1 else ""


def _optional_test(test: ast.expr, optional: set[str]) -> str:
    """The parameter of `optional` whose being set `test` requires (`exists(p)`, `p is
    not None`, `p`, one operand of an `and`); "" for none."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return next((p for v in test.values if (p := _optional_test(v, optional))), "")
    if (
        isinstance(test, ast.Call)
        and last_name(test.func) == "exists"
        and len(test.args) == 1
        and not test.keywords
    ):
        test = test.args[0]
    elif (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.IsNot)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    ):
        test = test.left
    return test.id if isinstance(test, ast.Name) and test.id in optional else ""
