"""Follow values through a scope: which names hold all-gathered tensors without a
gradient, which hold gradients, which hold a mean over a data-dependent item count.

The analysis is deliberately small: a name's tags are the union of the tags of the
names read by the expression last assigned to it (`x = torch.cat(parts)`,
`parts.append(y)`, `for t in parts`), plus tags that come from the expression
itself (a c10d all_gather's output list, a `.grad` read, `ignore_index=`). The scope
is walked twice so that values carried around a loop reach their uses. A call to a
function the linter can resolve whose summary knows its return value
(`summaries.Facts.returns`) gives that value's tags, its parameters replaced by the
call's arguments; any other call passes on the tags of everything it is given.

Tags:
    ``g:ID``   output of a plain c10d all_gather (no gradient); ID names its `Origin`
               (where it started, the path since);
    ``q:ID``   gradients all-gathered and not yet summed;
    ``qa:NAME:ID``  parameter NAME all-gathered (a ``q`` tag where NAME is a gradient);
    ``G:base`` derived from ``base.grad``;
    ``V``      a mean over a data-dependent number of items (``ignore_index``, a
               division by ``mask.sum()``, a token count);
    ``v``      a mean over an item count the linter cannot see: the ``loss`` field of
               a model's output (a Hugging Face ``outputs.loss``, ``out["loss"]``), a
               token mean for a language model, a row mean for a contrastive loss;
    ``W:NAME`` a mean over a micro-batch's items unless the caller sets parameter NAME, a
               `dim`/`axis` defaulting to None (`mask.sum(axis=axis)` in `masked_mean`):
               a call that leaves it unset gets ``V``;
    ``@N``, ``@I:TAG``  a tuple of N elements (every `return` of the function a tuple of
               N), element I holding mean tag TAG (``V``, ``v``, ``W:``): unpacked
               (`_, loss = f(x)`) or indexed (`f(x)[1]`), each element gets its own mean
               tags, not those of the whole tuple;
    ``t:NAME`` a loss with a sentinel `ignore_index` (`-100`) whose target derives from
               parameter NAME: a forward pass that binds NAME is given labels;
    ``K``      a count of a micro-batch's items (`n = mask.sum()`): a division by it
               is a mean over them (``V``);
    ``L``      the output of a forward pass given token inputs (``labels=``,
               ``input_ids=``, ``**batch``): its ``loss`` field (``v``) is a token mean;
    ``Y``      the output itself of a forward pass given labels (``labels=``,
               ``**batch``), kept through names only: its first element (``out[0]``)
               is its loss, as ``.loss`` is (``v``);
    ``C``      a loss module built with ``ignore_index`` (calling it gives ``V``);
    ``p``      derived from an argument of the enclosing function;
    ``a:NAME`` derived from parameter NAME (what a summary's return tags are made of);
    ``d:NAME:ID``  beside ``g:ID``: that gather is of parameter NAME itself, with
               gradients on; a caller that passes data (``I``, ``B``) for NAME loses
               nothing (the ``g`` tag is dropped there);
    ``n:NAME:ID``  parameter NAME all-gathered inside a function that runs under
               `@torch.no_grad()`: no gradient if the caller passes a trainable value
               (then it becomes a ``g`` tag there), harmless for a no-grad one (MoCo's
               momentum keys);
    ``N:NAME:ID``  an ``n`` tag that met a similarity product in the helper's callee;
    ``m:ID``   a trainable value all-gathered by such a helper: it becomes a ``g`` tag
               where it meets a similarity product (`q @ k_all.T`, `einsum`, `mm`), the
               loss of local rows against all; used otherwise (token ids gathered to pick
               negatives) it needs no gradient;
    ``D``      computed with gradient recording off (under `torch.no_grad()`) or detached;
    ``F``      a fixed table: built by a tensor factory from numbers (`torch.arange(steps)`),
               so its sum is the same on every micro-batch; a division by it (a weight
               table normalised by its sum) is no mean over items;
    ``X``      compared with something not fixed (`torch.arange(T) < lengths[:, None]`):
               a mask of the data, no fixed table any more;
    ``M``      items a boolean mask of the data selects (`losses[mask]`): their whole
               `.mean()` is a mean over a varying count (``V``);
    ``S``      with ``V``: that mean (`losses[mask].mean()`), whose count varies whatever
               a caller passes (a forward's loss over its own random span mask);
    ``T``      the output of a forward pass: a call of a module held in a variable or an
               attribute (`model(x)`, `self.encoder(x)`), so it carries a gradient
               (a batch's raw inputs, token ids and labels do not);
    ``I``, ``B``, ``Z``  no gradient to lose (`data.DATA_TAGS`): an integer tensor, a
               field of a forward pass's inputs (`batch["loss_weights"]` given
               `model(**batch)`), a value with no gradient path (assigned whole under
               `torch.no_grad()`, or detached); kept through names only, and only
               where every assignment that may reach the read gives it: a plain
               all_gather of one loses no gradient.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator
from dataclasses import replace

from wholebatch.lint.data import (
    DATA_TAGS,
    FRESH,
    META_ATTRS,
    batch_field,
    detached,
    forward_inputs,
    integer_valued,
    kept_base,
    literal_kwargs,
    loader_items,
    spelled_out,
    to_number,
)
from wholebatch.lint.facts import Facts, Origin
from wholebatch.lint.names import (
    counts_items,
    detached_copy,
    dotted,
    is_count_expr,
    is_rank_ref,
    is_sum_reduction,
    last_name,
    position,
    uncast,
)
from wholebatch.lint.rules import Hop
from wholebatch.lint.scope import FileContext, Scope, Stmt
from wholebatch.lint.summaries import (
    DEFAULT_IGNORING,
    Resolver,
    count_unless,
    none_default,
    param_default,
)

# The entries of one value stored under constant keys (`out["entropy"]`) -> their tags.
_Entries = dict[str, set[str]]
# The tags of a mean over a micro-batch's items, which a module's own `forward` passes on.
_MEAN_TAGS = frozenset({"V", "v", "L"})

__all__ = ["Flow", "returned_tags"]

# Calls that add up their input: after one of these, gathered gradients are summed.
_REDUCERS = frozenset(
    {"sum", "mean", "add", "add_", "reduce", "nansum", "sum_to_size", "all_reduce", "fsum"}
)
_IGNORE_CRITERIA = frozenset({"CrossEntropyLoss", "NLLLoss"})
# PyTorch's functional losses that average over their input's items by default.
_MEAN_LOSSES = frozenset(
    {
        "cross_entropy",
        "nll_loss",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
    }
)
_BUILTINS = frozenset(dir(builtins))
# What a tag becomes where it meets a similarity product (see `m:` and `N:`).
_MET = {"m:": "g:", "n:": "N:"}
# Similarity products: where gathered keys meet this rank's queries.
_PRODUCTS = frozenset({"matmul", "mm", "bmm", "einsum", "cosine_similarity", "cdist", "linear"})
_GATHER_OUT_KW = ("tensor_list", "output_tensor", "output_tensor_list", "output")
_GATHER_IN_KW = ("tensor", "input_tensor")


def _kwarg(call: ast.Call, names: tuple[str, ...]) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg in names:
            return kw.value
    return None


def _sum_reduction(call: ast.Call) -> bool:
    return is_sum_reduction(_kwarg(call, ("reduction",)))


def _mean_literal(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == "mean"


def _token_inputs(call: ast.Call) -> bool:
    """Does a forward pass take token inputs, so its `loss` is a token mean: `labels=`,
    `input_ids=`, a whole batch (`model(**batch)`), or a variable named so? Not when it is
    given the global count (`num_items_in_batch=`: transformers divides by it)."""
    if any(kw.arg == "num_items_in_batch" for kw in call.keywords):
        return False
    for kw in call.keywords:
        if kw.arg is None or kw.arg in _TOKEN_ARGS:
            return True
    return any(isinstance(a, ast.Name) and a.id in _TOKEN_ARGS for a in call.args)


def _given_labels(call: ast.Call) -> bool:
    """Is a forward pass given labels (`labels=`, or a whole batch, `model(**batch)`), so
    that a Hugging Face model computes its loss and returns it first?"""
    return any(kw.arg is None or kw.arg in _LABEL_ARGS for kw in call.keywords)


def _given_mask(call: ast.Call) -> bool:
    """Is a forward pass given a mask of the items its loss counts, by name (`lm_mask=m`,
    `loss_mask=m`; not an `attention_mask=`, which every token model takes)?"""
    return any(
        kw.arg is not None and "mask" in kw.arg and "attention" not in kw.arg
        for kw in call.keywords
    )


_LABEL_ARGS = frozenset({"labels", "lm_labels", "target_ids"})
_TOKEN_ARGS = frozenset({"labels", "input_ids", "decoder_input_ids", "target_ids", "token_ids"})


# Tensor factories: given sizes and values that are plain numbers, they build the same
# table on every call (a weight per timestep, `torch.arange(steps)`), not one read from a
# micro-batch.
_FACTORIES = frozenset({"arange", "linspace", "logspace", "ones", "zeros", "full", "eye"})
_FACTORY_ROOTS = frozenset({"torch", "np", "numpy"})
# What a factory's arguments may hold: names, numbers and arithmetic on them.
_NUMBER_NODES: tuple[type[ast.AST], ...] = (
    ast.Name,
    ast.Constant,
    ast.BinOp,
    ast.UnaryOp,
    ast.operator,
    ast.unaryop,
    ast.expr_context,
)


def _fixed_table(call: ast.Call) -> bool:
    """`torch.arange(steps)`, `torch.linspace(0, 1, n)`: a tensor factory whose arguments
    are names, numbers and arithmetic on them (no shape of a batch, `x.size(0)`, and no
    call), so its value (`F`) does not depend on a micro-batch's data."""
    d = dotted(call.func)
    if d is None:
        return False
    root, _, name = d.rpartition(".")
    if name not in _FACTORIES or root.split(".", 1)[0] not in _FACTORY_ROOTS:
        return False
    return all(isinstance(x, _NUMBER_NODES) for a in call.args for x in ast.walk(a))


def _only_fixed(tags: set[str]) -> bool:
    """Tags of a value built from a fixed table (`F`) and numbers: under no_grad (`D`) or
    from the function's parameters (`p`, `a:`; a table's length, `num_steps`), but not
    compared with anything else (`X`: `torch.arange(T) < lengths[:, None]` is a mask of
    the batch's lengths)."""
    return "F" in tags and all(t in ("F", "D", "p") or t.startswith("a:") for t in tags)


def _stored_into(scope: Scope) -> set[str]:
    """The names (`out`) whose entries this scope stores into under a constant key
    (`out["entropy"] = x`): the only ones whose entries `Flow` tells apart."""
    out: set[str] = set()
    for st in scope.stmts:
        node = st.node
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.slice, ast.Constant)
                    and (d := dotted(t.value)) is not None
                ):
                    out.add(d)
    return out


def _real_weights(value: ast.expr, tags: set[str]) -> bool:
    """Is `value` (a whole sum, `torch.sum(w)`) a sum of real-valued weights rather than
    an item count: what it sums is computed from a forward pass's output or a gradient
    (`T`, `G:`) and is no mask (no comparison, `X`; no `mask` in a name)? Dividing by it
    normalises the weights to sum to one (`w = w_t / w_t.sum()`), and `(l * w).sum()` is
    a weighted sum, no mean over a varying count (issue 33: OpenMatch's meta-weights)."""
    if "X" in tags or not ("T" in tags or any(t[:2] == "G:" for t in tags)):
        return False
    return not any(
        isinstance(x, ast.Compare)
        or (isinstance(x, ast.Name | ast.Attribute) and "mask" in last_name(x).lower())
        for x in ast.walk(value)
    )


def _true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _makes_leaf(node: ast.expr) -> bool:
    """`x.requires_grad_()` / `x.requires_grad_(True)` (not `requires_grad_(False)`)."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "requires_grad_"
    ):
        return False
    arg = node.args[0] if node.args else next((k.value for k in node.keywords), None)
    return arg is None or not (isinstance(arg, ast.Constant) and not arg.value)


# Where a call takes an index tensor: method -> position of the index argument (after
# `dim`), and functions -> position of theirs (a classification loss's target).
_INDEX_METHODS = {"gather": 1, "scatter": 1, "scatter_": 1, "scatter_add": 1, "scatter_add_": 1}
_INDEX_FUNCS = {"one_hot": 0, "cross_entropy": 1, "nll_loss": 1, "bincount": 0}


def _index_names(ctx: FileContext, scope: Scope) -> set[str]:
    """The names this scope uses as an index tensor (`logits.gather(1, labels[:, None])`,
    `onehot.scatter_(1, ids, 1)`, `F.one_hot(y)`, `F.cross_entropy(logits, y)`); not
    the collectives of those names (`dist.gather(x, parts)`)."""
    out: set[str] = set()
    for st in scope.stmts:
        for n in st.walk():
            if not isinstance(n, ast.Call) or ctx.imports.collective(n) is not None:
                continue
            name = last_name(n.func)
            pos = _INDEX_FUNCS.get(name)
            if pos is None and isinstance(n.func, ast.Attribute):
                pos = _INDEX_METHODS.get(name)
                if pos is not None and last_name(n.func.value) == "torch":
                    pos += 1  # `torch.gather(x, 1, idx)`
            if pos is None:
                continue
            arg = n.args[pos] if len(n.args) > pos else None
            if arg is None:
                arg = next((k.value for k in n.keywords if k.arg in ("index", "target")), None)
            while isinstance(arg, ast.Subscript):
                arg = arg.value  # `labels[:, None]`
            d = dotted(arg) if arg is not None else None
            if d is not None:
                out.add(d)
    return out


def _summed_grads(ctx: FileContext, scope: Scope) -> set[str]:
    """The names whose `.grad` this scope passes to a collective that sums across ranks
    (`dist.reduce_scatter(out, list(x.grad.chunk(W)))`, `g = x.grad;
    dist.all_reduce(g)`)."""
    via: dict[str, set[str]] = {}  # `g = x.grad...` -> {x}
    out: set[str] = set()
    for st in scope.stmts:
        node = st.node
        if isinstance(node, ast.Assign):
            bases = _grad_bases(node.value)
            if bases:
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        via[t.id] = bases
        for n in st.walk():
            if not isinstance(n, ast.Call):
                continue
            q = ctx.imports.collective(n)
            if q is None or "reduce" not in q.rpartition(".")[2]:
                continue
            for arg in (*n.args, *(k.value for k in n.keywords)):
                out |= _grad_bases(arg)
                for x in ast.walk(arg):
                    if isinstance(x, ast.Name):
                        out |= via.get(x.id, set())
    return out


def _grad_bases(node: ast.expr) -> set[str]:
    """`x` for each `x.grad` read in `node`."""
    return {
        d
        for x in ast.walk(node)
        if isinstance(x, ast.Attribute) and x.attr == "grad" and (d := dotted(x.value)) is not None
    }


def _sentinel(node: ast.expr) -> bool:
    """An `ignore_index` that is a negative literal (`-100`, `-1`): a label value set on
    purpose where the loss must not count (not an out-of-range position, `seq_len`)."""
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) is int
    )


def _is_mean(tag: str) -> bool:
    """A tag of a mean over a micro-batch's items, followed element-wise in tuples."""
    return tag in ("V", "v", "S") or tag.startswith("W:")


def _whole(tags: set[str]) -> set[str]:
    """`tags` without the element-wise ones (`@`): a value that is not the tuple."""
    return {t for t in tags if t[:1] != "@"}


def _element(tags: set[str], i: int) -> set[str]:
    """The tags of element `i` of a tuple with element-wise tags (`@N`, `@I:TAG`): its
    own mean tags, and the whole tuple's other tags."""
    n = next((int(t[1:]) for t in tags if t[:1] == "@" and ":" not in t), None)
    if n is None or not -n <= i < n:
        return _whole(tags)
    i %= n
    out = {t for t in tags if t[:1] != "@" and not _is_mean(t)}
    prefix = f"@{i}:"
    out.update(t[len(prefix) :] for t in tags if t.startswith(prefix))
    return out


def returned_tags(tags: set[str]) -> frozenset[str]:
    """The tags of a return value that mean something to a caller."""
    return frozenset(t for t in tags if t[0] in "gqadnNmVvSTLW@tu" and not t.startswith("G:"))


class Flow:
    """Tags of names in one scope, updated statement by statement."""

    def __init__(self, ctx: FileContext, scope: Scope) -> None:
        self.ctx = ctx
        self.scope = scope
        self.resolver = ctx.resolver if ctx.resolver is not None else Resolver(ctx)
        self.origins = self.resolver.origins
        self.t: dict[str, set[str]] = {}
        # name -> (branch path, tags) of the assignments that may still hold (see _assign)
        self.at: dict[str, list[tuple[tuple[tuple[int, int], ...], frozenset[str]]]] = {}
        # `out["entropy"] = x`: the entries stored under a constant key of a value bound
        # here (`out = forward(...)`), read back one at a time (`out["logprobs"]` gets
        # none of `out["entropy"]`'s tags); `self.t` keeps the whole value's union. Per
        # name: (the branch path of its binding, the bound value's tags, entry -> tags).
        self.entries: dict[str, tuple[tuple[tuple[int, int], ...], set[str], _Entries]] = {}
        self.returns: set[str] = set()
        # the length of every tuple returned so far (None: none yet; -1: not all tuples
        # of one length, so no element-wise tags, `@`)
        self._arity: int | None = None
        # g-tag -> branch path (see Stmt.path) where its value entered this scope
        self.entered: dict[str, tuple[tuple[int, int], ...]] = {}
        self._made: dict[int, str] = {}  # id(gather call) -> its tag (one per call, both walks)
        self._ifs = {id(n): n for n in scope.ifs}
        self._st: Stmt | None = None
        self._puts_back: bool | None = None  # computed on first need (`_restores_somewhere`)
        self._summed_grads: set[str] | None = None  # computed on first need (`_new_leaf`)
        self._indices: set[str] | None = None  # computed on first need (`_held`)
        self._inputs: set[str] | None = None  # computed on first need (`_data_tags`)
        self._literals: dict[str, list[ast.keyword]] | None = None  # (`_spelled`)
        self._stored: set[str] | None = None  # computed on first need (`_assign`)
        self._records: set[str] | None = None  # computed on first need (`_namedtuples`)
        self._unrecorded: set[int] = set()  # tuple places a `return` gives no record (`_return`)
        # An autograd.Function's forward runs with gradient recording off (tested in
        # tests/unit/test_lint_dist_twins.py): its hand-written backward is the gradient,
        # so nothing gathered there lacks one (WB102 judges that backward).
        cls = scope.cls
        self._recorded = not (
            cls is not None
            and scope.name == "forward"
            and any(last_name(b) == "Function" for b in cls.bases)
        )
        node = scope.node
        self.params: set[str] = set()
        # `c:LINE:COL` tag -> the call of a parameter it marks (`_forward_call_tags`)
        self.param_calls: dict[str, ast.Call] = {}
        if not isinstance(node, ast.Module):
            a = node.args
            extra = [x for x in (a.vararg, a.kwarg) if x is not None]
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, *extra):
                if arg.arg not in ("self", "cls", "ctx"):
                    self.t[arg.arg] = {"p", f"a:{arg.arg}"}
                    self.params.add(arg.arg)

    # -- reading ------------------------------------------------------------------------

    def tags(self, expr: ast.AST) -> set[str]:
        """The tags of the value of `expr` under the current bindings."""
        out: set[str] = set()
        rank = reducer = product = False
        stack: list[ast.AST] = [expr]
        while stack:
            n = stack.pop()
            if isinstance(n, ast.Call):
                if _fixed_table(n):
                    out.add("F")
                    continue
                r = self.resolver.resolve(n, self.scope)
                if r is not None and r[0].returns is not None:
                    reducer = reducer or last_name(n.func) in _REDUCERS
                    got = self._from_call(n, r[0], r[1])
                    if self._sums(n, r[0], r[1]):  # no mean, in the whole or an element
                        got = {t for t in got if t.rpartition(":")[2] not in ("V", "v")}
                    out |= got
                    continue
                fw = self._own_forward(n)
                if fw is not None:
                    out |= self._forward_returns(fw)
                gathered = self._value_gather(n)
                if gathered is not None:
                    out |= gathered
                    continue
                if to_number(n.func) or last_name(n.func) in FRESH:
                    continue  # `float(x)`, `x.item()`, `zeros(n)`: nothing of `x`'s or `n`'s
                if self._forward_call(n.func):
                    out |= self._forward_call_tags(n)
            if isinstance(n, ast.Attribute) and n.attr in META_ATTRS:
                continue  # `x.shape[0]`: a number, none of `x`'s tags
            stack.extend(ast.iter_child_nodes(n))
            if isinstance(n, ast.Name):
                out |= self._held(n.id)
            elif isinstance(n, ast.Attribute):
                d = dotted(n)
                if d is not None:
                    out |= self._held(d)
                if n.attr == "grad":
                    out.add("G:" + (dotted(n.value) or ast.unparse(n.value)))
                elif n.attr == "loss" and not (
                    isinstance(n.value, ast.Name) and n.value.id == "self"
                ):
                    out.add("v")  # Hugging Face `outputs.loss`: a mean over its items
            elif isinstance(n, ast.Call):
                name = last_name(n.func)
                reducer = reducer or name in _REDUCERS
                product = product or name in _PRODUCTS
                out |= self._call_marks(n, name)
            elif isinstance(n, ast.Subscript):
                s = n.slice
                entry = self._entry(n) if self.entries else None
                if entry is not None:  # `out["logprobs"]`: that entry's tags only
                    del stack[len(stack) - len(list(ast.iter_child_nodes(n))) :]  # read above
                    out |= entry
                    continue
                vt = self._tuple_tags(n)
                if vt is not None:
                    # `f(x)[1]` of a tuple with element-wise tags: that element's only
                    assert isinstance(s, ast.Constant) and isinstance(s.value, int)
                    del stack[len(stack) - len(list(ast.iter_child_nodes(n))) :]  # read above
                    out |= _element(vt, s.value)
                    continue
                if isinstance(s, ast.Constant) and s.value == "loss":
                    out.add("v")
                elif self._mask_index(s):
                    out.add("M")  # `losses[mask]`: the items a mask of the data keeps
                elif (
                    isinstance(s, ast.Constant)
                    and s.value == 0
                    and isinstance(n.value, ast.Name | ast.Call)
                    and "Y" in self.tags(n.value)
                ):
                    # `model(..., labels=y)[0]`, `outputs[0]`: a Hugging Face model given
                    # labels returns its loss first (a tuple, or an output indexed so)
                    out.add("v")
                rank = rank or any(is_rank_ref(x) for x in ast.walk(s))
            elif isinstance(n, ast.Compare) and not all(
                _only_fixed(self.tags(x)) for x in (n.left, *n.comparators)
            ):
                out.add("X")  # a mask of the data, even where one side is a fixed table
            elif isinstance(n, ast.BinOp):
                product = product or isinstance(n.op, ast.MatMult)
                if isinstance(n.op, ast.Add):
                    reducer = True
                elif (
                    isinstance(n.op, ast.Div)
                    and (counts_items(n.right) or "K" in self.tags(n.right))
                    and not self.fixed(n.right)
                    and not self._real_sum(n.right)
                ):
                    out.add("V")
                elif (
                    isinstance(n.op, ast.Div)
                    and (dim := count_unless(n.right, self.scope)) is not None
                ):
                    out.add(f"W:{dim}")
        return self._finish(expr, out, rank=rank, reducer=reducer, product=product)

    def _finish(
        self, expr: ast.AST, out: set[str], *, rank: bool, reducer: bool, product: bool
    ) -> set[str]:
        """`tags`' last step: what the whole expression keeps of its parts' tags."""
        out.discard("C")
        if not isinstance(expr, ast.Name):
            out -= DATA_TAGS  # `w * logp`: no longer the data itself
        if not isinstance(expr, ast.Name | ast.Call) and any(t[:1] == "@" for t in out):
            out = _whole(out)  # `f(x) * 2`, `out.sum()`: no longer the tuple itself
        if "Y" in out and not (isinstance(expr, ast.Name) or self._labelled_forward(expr)):
            out.discard("Y")  # `outputs[1]`, `logits`: no longer the output with the loss first
        if "K" in out and not isinstance(expr, ast.Name | ast.BinOp):
            out.discard("K")  # a count stays one through names and `n + eps`, not calls
        if product and any(t[:2] in ("m:", "n:") for t in out):
            out = {_MET.get(t[:2], t[:2]) + t[2:] for t in out}
        if not self._recorded:
            out = {t for t in out if t[:2] not in ("g:", "m:", "n:", "N:")}
        if rank:
            # `torch.cat(gathered[:rank] + [local] + gathered[rank + 1:])`: the local slice
            # is put back with its gradient, the classic partial fix; not "no gradient".
            out = {t for t in out if not t.startswith("g:")}
        if reducer:
            out = {t for t in out if not t.startswith(("q:", "qa:"))}
        return out

    def _call_marks(self, n: ast.Call, name: str) -> set[str]:
        """The tags a call adds by what it is: `D` for a detach, `V` for a mean over the
        items a sentinel-ignoring loss keeps (or a loss module built so), with its targets'
        parameters (`t:`)."""
        out: set[str] = set()
        if name == "detach":
            out.add("D")
        ignore = _kwarg(n, ("ignore_index",))
        if ignore is not None and not _sum_reduction(n) and not self.resolver.own(n, self.scope):
            out.add("V")
            out |= self._ignored_targets(n, ignore)
        elif (
            name in DEFAULT_IGNORING or dotted(n.func) in self.ctx.default_ignoring
        ) and self._default_ignores(n):
            # `F.cross_entropy(logits, labels)`, `train_fct(logits, labels)` after
            # `train_fct = CrossEntropyLoss()`, on labels padded with -100
            out |= {"V", *self._targets(n)}
        if name == "mean" and not n.keywords and "M" in self._mean_input(n):
            out |= {"V", "S"}  # `losses[mask].mean()`: over as many items as the mask keeps
        elif name in _MEAN_LOSSES and self._selected_loss(n):
            out |= {"V", "S"}  # `F.cross_entropy(logits[mask], y[mask])`: the same mean
        d = dotted(n.func)
        if (
            d is not None
            and ("C" in self.t.get(d, ()) or d in self.ctx.ignoring)
            and not _sum_reduction(n)
        ):
            out.add("V")
            value = self.ctx.ignore_values.get(d)
            if value is not None:  # `self.criterion(logits, labels)`, built so
                out |= self._ignored_targets(n, value)
        return out

    def _selected_loss(self, n: ast.Call) -> bool:
        """Is `n` a PyTorch loss averaging (its default `reduction="mean"`) the items a
        boolean mask of the data selects from its input (`F.cross_entropy(logits[mask],
        ids[mask])`, `F.mse_loss(pred[mask], y[mask])`): a mean over as many items as the
        mask keeps, as `losses[mask].mean()` is? A sum, a reduction the call does not
        show, and a function of the run of that name are none."""
        reduction = _kwarg(n, ("reduction",))
        if reduction is not None and not _mean_literal(reduction):
            return False
        if isinstance(n.func, ast.Name) and n.func.id not in self.ctx.imports.aliases:
            return False  # a local function of that name, not PyTorch's
        first = _kwarg(n, ("input",)) or (n.args[0] if n.args else None)
        return (
            first is not None and "M" in self.tags(first) and not self.resolver.own(n, self.scope)
        )

    def _ignored_targets(self, n: ast.Call, ignore: ast.expr) -> set[str]:
        """`t:NAME` for the parameters the target of loss call `n` derives from, where its
        `ignore_index` is a value masked labels hold (`_ignores_masked`); for another
        literal (`ignore_index=0`), `u:VALUE:NAME`, which counts where a caller's files
        write VALUE into labels at masked places (`deferred`: the model's module does
        not import the dataset module that writes the 0s; the script does)."""
        if self._ignores_masked(ignore):
            return self._targets(n)
        if isinstance(ignore, ast.Constant) and type(ignore.value) is int:
            return {f"u:{ignore.value}:{t[2:]}" for t in self._targets(n)}
        return set()

    def _default_ignores(self, call: ast.Call) -> bool:
        """Does a loss built or called without `ignore_index=` ignore labels all the same:
        PyTorch's `F.cross_entropy`, `F.nll_loss` and their modules default to
        `ignore_index=-100` and average over the other targets, and this file, or one
        imported alongside it, writes -100 into labels (`Resolver.masks_default`:
        `labels[labels == pad_id] = IGNORE_INDEX`, a collator that pads labels)? A sum
        (`reduction="sum"`), a reduction the call does not show (`reduction=reduction`,
        fairseq's criteria) and a function of the run of that name are no such mean."""
        reduction = _kwarg(call, ("reduction",))
        return (
            _kwarg(call, ("ignore_index",)) is None
            and (reduction is None or _mean_literal(reduction))
            and not self.resolver.own(call, self.scope)
            and self.resolver.masks_default()
        )

    def _ignores_masked(self, ignore: ast.expr) -> bool:
        """Is `ignore` (an `ignore_index`) a value set on purpose where the loss must not
        count: a negative literal (`_sentinel`), or a literal this file writes into
        labels (`labels[~label_mask] = 0` with `ignore_index=0`)?"""
        return _sentinel(ignore) or (
            isinstance(ignore, ast.Constant)
            and type(ignore.value) is int
            and ignore.value in self.ctx.label_writes()
        )

    def _mask_index(self, s: ast.expr) -> bool:
        """Is the index `s` of `x[s]` a boolean mask of the data, which keeps a
        different number of items on every micro-batch: a comparison with the data
        (`x[target != pad]`) or a name of a mask (`masks`, `loss_mask`), cast or not
        (`mask.bool()`, `mask.to(torch.bool)`)?"""
        s = uncast(s)
        if isinstance(s, ast.Compare):
            return not all(_only_fixed(self.tags(x)) for x in (s.left, *s.comparators))
        if isinstance(s, ast.Name | ast.Attribute):
            return "mask" in last_name(s).lower()
        return False

    def _mean_input(self, n: ast.Call) -> set[str]:
        """The tags of what a whole `.mean()` / `torch.mean(x)` averages (no `dim`)."""
        func = n.func
        if isinstance(func, ast.Attribute) and last_name(func.value) == "torch":
            return self.tags(n.args[0]) if len(n.args) == 1 else set()
        if isinstance(func, ast.Attribute) and not n.args:
            return self.tags(func.value)
        return set()

    def _forward_call_tags(self, n: ast.Call) -> set[str]:
        """The tags of a module's forward call (`model(...)`): `T`, `L` for token inputs,
        `Y` given labels, and what a forward of the run returns where the call shows it."""
        out = {"T"}
        given = self._spelled(n)  # `model(**inputs)` of a dict literal: its keys
        if _token_inputs(given):
            out.add("L")
            if _given_labels(given):
                out.add("Y")
        if _given_labels(given) or _given_mask(given):
            # a module of the run whose forward returns a mean over the items its labels
            # or loss mask select (`loss.sum() / mask.sum()`). A loss module given bare
            # targets (`loss_fn(logits, targets)`), or a model given positions it ignores
            # only out of range (a span's `ignore_index=seq_len`), keeps a fixed count
            # unless its targets are masked, which the call does not show
            out |= self.resolver.forward_tags(n, self.scope)
        else:
            # labels given under another name or by position (`model(x, y)`, `targets=y`):
            # where the forward's own sentinel-ignoring loss takes its target from the
            # parameter the call binds, and labels are masked in this file or one
            # imported alongside it; or where its mean is over items it selects itself
            # (`loss[rand_span_mask].mean()`: no such loss, `summaries.Resolver`)
            out |= self.resolver.forward_tags(n, self.scope, by_target=True)
        if (
            isinstance(n.func, ast.Name) and n.func.id in self.params
        ) or self.resolver.unsummarised_class(n) is not None:
            # a module given by a caller (`model(x, y)` in `train(model, ...)`): only a
            # caller shows whose forward it runs; or one of a class of the run whose
            # summary comes later (an import cycle through a package's `__init__`):
            # `c:` tags, `facts.Deferred`
            tag = f"c:{n.lineno}:{n.col_offset}"
            self.param_calls[tag] = n
            out.add(tag)
        return out

    def _real_sum(self, expr: ast.expr) -> bool:
        """Is the divisor `expr`, written in the division (`(l * w).sum() / (w.sum() +
        1e-6)`), a sum of real-valued computed weights (`_real_weights`), as a name
        assigned one is (`K` is not given it)? Weights read from the batch are data, and
        their sum a varying count."""
        return counts_items(expr) and _real_weights(expr, self.tags(expr))

    def fixed(self, expr: ast.expr) -> bool:
        """Is `expr` computed from a fixed table only (`F`): its sum is the same on every
        micro-batch, so dividing by it is a normalisation, not a mean over items?"""
        return _only_fixed(self.tags(expr))

    def _targets(self, call: ast.Call) -> set[str]:
        """`t:NAME` for each parameter NAME the target of a loss with a sentinel
        `ignore_index` derives from (`F.cross_entropy(logits, targets.view(-1),
        ignore_index=-1)` in `forward(self, idx, targets)`): a call of the forward
        that binds NAME gives it labels, whatever the argument is called."""
        target = _kwarg(call, ("target",)) or (call.args[1] if len(call.args) > 1 else None)
        if target is None:
            return set()
        return {f"t:{t[2:]}" for t in self.tags(target) if t.startswith("a:")}

    def _tuple_tags(self, n: ast.Subscript) -> set[str] | None:
        """The tags of `x` in `x[I]` (a constant index) where `x` is a tuple with
        element-wise tags (`out = f(x)`, or the call itself); None otherwise."""
        s, v = n.slice, n.value
        if not (isinstance(s, ast.Constant) and type(s.value) is int):
            return None
        if isinstance(v, ast.Name):
            vt = self._held(v.id)
        elif isinstance(v, ast.Call):
            vt = self.tags(v)
        else:
            return None
        return vt if any(t[:1] == "@" for t in vt) else None

    def _entry(self, n: ast.Subscript) -> set[str] | None:
        """The tags of `out["k"]` where entry "k" of `out` was stored since `out` was
        bound here (`self.entries`); None where it was not."""
        s = n.slice
        if not (isinstance(s, ast.Constant) and isinstance(s.value, str)):
            return None
        key = dotted(n.value)
        held = self.entries.get(key) if key is not None else None
        if held is None or s.value not in held[2]:
            return None
        tags = set(held[2][s.value])
        if s.value == "loss":
            tags.add("v")  # `out["loss"]`: a model's mean loss, as below in `tags`
        return tags

    def _held(self, key: str) -> set[str]:
        """The tags of the value bound to `key`. A value this scope uses as an index
        (labels, class ids: `x.gather(1, idx)`, `scatter_(1, idx, 1)`, a loss's target)
        is an integer tensor, which carries no gradient and needs none: a gather of it
        loses nothing (`g`, `m`, `n` tags dropped)."""
        tags = self.t.get(key)
        if not tags:
            return set()
        if any(t[:2] in ("g:", "m:", "n:") for t in tags):
            if self._indices is None:
                self._indices = _index_names(self.ctx, self.scope)
            if key in self._indices:
                return {t for t in tags if t[:2] not in ("g:", "m:", "n:")}
        return tags

    def _hop(self, node: ast.AST, note: str) -> Hop:
        return Hop(
            path=self.ctx.path,
            line=position(node)[0],
            col=position(node)[1],
            function=self.scope.qual,
            note=note,
        )

    def _from_call(self, call: ast.Call, facts: Facts, bound: bool) -> set[str]:
        """The tags of a resolved call's value: its summary's return tags, parameters
        replaced by the arguments, origins moved one step (this call)."""
        assert facts.returns is not None
        args: dict[str, list[ast.expr]] = {}
        for name, value in facts.bind(call, bound):
            args.setdefault(name, []).append(value)
        d = dotted(call.func)
        hop = self._hop(call, f"gets it from `{d or last_name(call.func)}()`")
        out: set[str] = set()
        plain = facts.unmasked(call, bound)  # it masks no labels itself: `V` is a plain `v`
        for tag in facts.returns:
            if plain and (tag in ("V", "S") or tag.endswith((":V", ":S"))):
                tag = tag[:-1] + "v"
            kind, _, rest = tag.partition(":")
            if kind == "a":
                for value in args.get(rest, ()):
                    out |= self.tags(value)
            elif kind in ("g", "q"):
                if kind == "g" and self._data_given(tag, facts.returns, args):
                    continue  # a parameter gathered plainly, given data here
                new = self.origins.moved(tag, kind, id(call), hop)
                out.add(new)
                self.entered.setdefault(new, self._st.path if self._st else ())
            elif kind == "d":
                name, _, oid = rest.partition(":")
                if self._data_given(f"g:{oid}", facts.returns, args):
                    continue
                moved = self.origins.moved(f"g:{oid}", "g", id(call), hop)[2:]
                for value in args.get(name, ()):
                    if isinstance(value, ast.Name) and value.id in self.params:
                        out.add(f"d:{value.id}:{moved}")  # the question goes to our callers
            elif kind in ("n", "N"):
                name, _, oid = rest.partition(":")
                for value in args.get(name, ()):
                    out |= self._nograd_gathered(value, f"g:{oid}", call, hop, met=kind == "N")
            elif kind == "qa":
                name, _, oid = rest.partition(":")
                for value in args.get(name, ()):
                    vt = self.tags(value)
                    if any(t.startswith("G:") for t in vt) or any(t.startswith("a:") for t in vt):
                        new = self.origins.moved(f"q:{oid}", "q", id(call), hop)
                        if any(t.startswith("G:") for t in vt):
                            out.add(new)
                        out.update(f"qa:{t[2:]}:{new[2:]}" for t in vt if t.startswith("a:"))
            elif tag in ("V", "v", "L"):
                out.add(tag)
            elif kind == "W":
                out |= self._mean_of(rest, args)
            elif tag[:1] == "@":
                # a tuple's element-wise tags (`@2`, `@1:V`, `@1:W:axis`), mapped alike
                i, _, inner = tag.partition(":")
                if (
                    not inner
                    or inner in ("V", "v")
                    or (inner[:1] == "@" and (":" not in inner or inner[-2:] in (":V", ":v")))
                ):
                    out.add(tag)
                elif inner.startswith("W:"):
                    out.update(f"{i}:{t}" for t in self._mean_of(inner[2:], args))
        return out

    def _data_given(
        self, gtag: str, returns: frozenset[str], args: dict[str, list[ast.expr]]
    ) -> bool:
        """Is `gtag` a callee's plain all_gather of its own parameter (a `d:NAME:ID` tag
        beside it) and every argument this call binds to NAME data (an integer tensor, a
        field of a forward's inputs or of a DataLoader's batch: `data`)? Then no gradient
        was wanted of what it gathered."""
        oid = gtag[2:]
        names = [
            t[2:].rpartition(":")[0] for t in returns if t[:2] == "d:" and t.endswith(f":{oid}")
        ]
        values = [v for name in names for v in args.get(name, ())]
        if not values:
            return False
        for v in values:
            vt = self.tags(v)
            if not (vt & DATA_TAGS or self._data_tags(v, vt)):
                return False
        return True

    def _sums(self, call: ast.Call, facts: Facts, bound: bool) -> bool:
        """Does `call` give the function's `reduction` parameter a sum ("sum", "none", a
        choice of the two, or a parameter of this function that defaults to one)? Then
        what it returns is no mean over items, whatever its summary says of the default
        (fairseq's `cross_entropy(..., reduction="sum")`)."""
        if facts.star:
            return False
        for name, value in facts.bind(call, bound):
            if name == "reduction":
                if isinstance(value, ast.Name):
                    default = param_default(self.scope, value.id)
                    return default is not None and is_sum_reduction(default)
                return is_sum_reduction(value)
        return False

    def _mean_of(self, dim: str, args: dict[str, list[ast.expr]]) -> set[str]:
        """A `W:dim` tag of a callee at a call: a mean over the items (`V`) where the call
        leaves `dim` unset (`masked_mean(x, mask)`), or where it passes on a parameter of
        this function that defaults to None (`axis=axis`: `W:axis`, its callers say)."""
        out: set[str] = set()
        for value in args.get(dim, ()) or [ast.Constant(None)]:
            if isinstance(value, ast.Constant) and value.value is None:
                out.add("V")
            elif isinstance(value, ast.Name) and none_default(self.scope, value.id):
                out.add(f"W:{value.id}")
        return out

    def _labelled_forward(self, expr: ast.AST) -> bool:
        return (
            isinstance(expr, ast.Call)
            and self._forward_call(expr.func)
            and _token_inputs(self._spelled(expr))
            and _given_labels(self._spelled(expr))
        )

    def _spelled(self, call: ast.Call) -> ast.Call:
        if all(k.arg is not None for k in call.keywords):
            return call
        if self._literals is None:
            self._literals = literal_kwargs(st.walk() for st in self.scope.stmts)
        return spelled_out(call, self._literals)

    def _own_forward(self, call: ast.Call) -> ast.Call | None:
        """`self.forward(x)` for `self(x)` in a method: nn.Module's `__call__` runs the
        class's own `forward` (a LightningModule's `training_step` calling `output =
        self(batch)`), whose return is read like any method of the class. The call is
        made once per node and kept on it, so the resolver's caches (by `id`) stay sound."""
        if not (
            isinstance(call.func, ast.Name)
            and call.func.id == "self"
            and self.scope.cls is not None
        ):
            return None
        made: ast.Call | None = getattr(call, "_wb_forward", None)
        if made is None:
            func = ast.copy_location(
                ast.Attribute(value=call.func, attr="forward", ctx=ast.Load()), call.func
            )
            made = ast.copy_location(
                ast.Call(func=func, args=call.args, keywords=call.keywords), call
            )
            call._wb_forward = made  # type: ignore[attr-defined]  # kept with the tree
        return made

    def _forward_returns(self, fw: ast.Call) -> set[str]:
        """The tags `self.forward(...)` returns (`_own_forward`): its summary's, or where
        the summary keeps none (a forward that only collects what the objectives'
        helpers return: `ret.update(compute_mlm(self, batch))`), the mean tags of the
        walk of the class's own `forward`."""
        r = self.resolver.resolve(fw, self.scope)
        if r is None:
            return set()
        facts, bound = r
        cls = self.scope.cls
        own = next(
            (
                b
                for b in (cls.body if cls is not None else ())
                if isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) and b.name == "forward"
            ),
            None,
        )
        returns_fn = self.resolver.returns_fn
        if facts.returns is None and own is not None and returns_fn is not None:
            facts = replace(facts, returns=returns_fn(self.ctx.scope_of[id(own)]) & _MEAN_TAGS)
        return self._from_call(fw, facts, bound) if facts.returns is not None else set()

    def _forward_call(self, func: ast.expr) -> bool:
        """Is this the call of a module (a forward pass): a variable that is not an
        import, a function or class of the file, nor a builtin (`model(x)`), or an
        attribute of `self` (`self.encoder(x)`, `self.visual.proj(x)`)?"""
        if isinstance(func, ast.Name):
            ctx, name = self.ctx, func.id
            return not (
                name in ctx.imports.aliases
                or name in ctx.imports.relative
                or name in ctx.module_functions
                or name in ctx.class_by_name
                or name in _BUILTINS
            )
        root = func
        while isinstance(root, ast.Attribute):
            root = root.value
        return root is not func and isinstance(root, ast.Name) and root.id == "self"

    def _nograd_gathered(
        self, value: ast.expr, gtag: str, call: ast.Call, hop: Hop, *, met: bool = False
    ) -> set[str]:
        """The tags of `value` all-gathered by a `@torch.no_grad()` helper (`call`): no
        gradient for a trainable value; nothing lost for a no-grad or detached one; a
        parameter passed on as it is leaves the question to this function's callers."""
        vt = self.tags(value)
        if "D" in vt:
            return set()
        if isinstance(value, ast.Name) and value.id in self.params:
            # (normalised on the way, perhaps: `k = normalize(k)`)
            moved = self.origins.moved(gtag, "g", id(call), hop)[2:]
            return {f"{'N' if met else 'n'}:{value.id}:{moved}"}
        if (self._st is not None and self._st.nograd) or self.scope.nograd:
            return set()  # called under no_grad here: the missing gradient is asked for
        if "T" not in vt:
            return set()  # inputs, ids, labels: nothing that needs a gradient
        new = self.origins.moved(gtag, "g", id(call), hop)
        self.entered.setdefault(new, self._st.path if self._st else ())
        return {new if met else f"m:{new[2:]}"}

    def _nograd_here(self) -> bool:
        return (self._st is not None and self._st.nograd) or self.scope.nograd

    def _restores_somewhere(self) -> bool:
        """Does this scope put the local slice back anywhere (`parts[rank] = x`,
        `parts.pop(rank)`)? Then its gathers are meant to carry this rank's gradient."""
        if self._puts_back is None:
            self._puts_back = any(
                (
                    isinstance(n, ast.Subscript)
                    and isinstance(n.ctx, ast.Store)
                    and any(is_rank_ref(x) for x in ast.walk(n.slice))
                )
                or (
                    isinstance(n, ast.Call)
                    and last_name(n.func) == "pop"
                    and any(is_rank_ref(x) for a in n.args for x in ast.walk(a))
                )
                for st in self.scope.stmts
                for n in st.walk()
            )
        return self._puts_back

    def _value_gather(self, call: ast.Call) -> set[str] | None:
        """The tags of a gather that returns its output (Horovod's `hvd.allgather`,
        `torch.distributed.nn.all_gather`, accelerate's `accelerator.gather`, Lightning's
        `self.all_gather`) when that output has no gradient here; None for any other call
        (and for a differentiable gather with gradients on: its value keeps the input's
        tags)."""
        kind = self.ctx.value_gather(call, nograd=self._nograd_here())
        if kind is None or not call.args:
            return None
        text = f"`{dotted(call.func) or last_name(call.func)}()`"
        if kind == "no_grad":
            what = f"{text} runs under torch.no_grad(), so what it gathers carries no gradient"
            note = f"{text} gathers under no_grad"
        else:
            what = f"{text} gathers without a gradient ({kind})"
            note = f"{text} gathers without a gradient"
        return self._gathered_without_grad(call.args[0], call, note, what)

    def _gathered_without_grad(
        self, value: ast.expr, call: ast.Call, note: str, what: str = "", name: str = ""
    ) -> set[str]:
        """A value gathered with no gradient (a gather under `torch.no_grad()`, or one that
        never carries one), in a function where gradients are on: the put-back idiom in
        the same function shows the gradient is wanted (`g`, as for a c10d gather);
        otherwise momentum keys and detached values lose nothing, a parameter leaves it
        to the callers (`n`), and a forward pass's output loses its cross-rank terms
        where it meets a similarity product (`m`)."""
        vt = self.tags(value)
        if "D" in vt:
            return set()
        gtag = self._origin("g", call, name or dotted(value) or "", note, what)
        if self._restores_somewhere():
            return {gtag}
        if isinstance(value, ast.Name) and value.id in self.params:
            return {f"n:{value.id}:{gtag[2:]}"}
        if "T" in vt:
            return {f"m:{gtag[2:]}"}
        return set()

    # -- writing ------------------------------------------------------------------------

    def bind(self, target: ast.expr, tags: set[str]) -> None:
        """Assign a value with `tags` to `target`."""
        if isinstance(target, ast.Name | ast.Attribute):
            key = dotted(target)
            if key is not None:
                self._assign(key, tags)
        elif isinstance(target, ast.Tuple | ast.List):
            n = len(target.elts)
            if f"@{n}" in tags and not any(isinstance(e, ast.Starred) for e in target.elts):
                for i, elt in enumerate(target.elts):  # `_, loss = model(x, y)`
                    self.bind(elt, _element(tags, i))
                return
            whole = _whole(tags)
            calls = {t for t in whole if t[:2] == "c:" and "#" not in t}
            if any(isinstance(e, ast.Starred) for e in target.elts):
                calls = set()
            for i, elt in enumerate(target.elts):
                # `c_loss, aux = model(x, y)`: each name holds one element of the call's
                # return, whose tags only a caller's forward shows (`c:LINE:COL#I`)
                own = {f"{t}#{i}" for t in calls}
                self.bind(elt, (whole - calls) | own)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, tags)
        elif isinstance(target, ast.Subscript):
            key = dotted(target.value)
            if key is None:
                return
            self._store_entry(key, target.slice, tags)
            cur = self.t.get(key, set())
            if not any(t.startswith("g:") for t in tags):
                # `gathered[rank] = local`: this rank's slice keeps its gradient again,
                # if this runs whenever the gather did (not under a condition of its own).
                cur = {t for t in cur if not (t.startswith("g:") and self._restored(t))}
            self.t[key] = cur | tags
            self.at.pop(key, None)

    def _store_entry(self, key: str, index: ast.expr, tags: set[str]) -> None:
        """`key["k"] = value`: entry "k" holds `tags`; under a condition the store may not
        run, so it adds to what "k" held (the whole value's tags before any store), as
        `+=` does. Any other index (`out[i]`, `out[name]`) may be any entry: `key`'s
        entries are no longer told apart."""
        held = self.entries.get(key)
        if held is None:
            return
        if not (isinstance(index, ast.Constant) and isinstance(index.value, str)):
            del self.entries[key]
            return
        path, whole, stored = held
        here = self._st.path if self._st else ()
        if here != path or (self._st is not None and isinstance(self._st.node, ast.AugAssign)):
            tags = stored.get(index.value, whole) | tags
        stored[index.value] = set(tags)

    def _assign(self, key: str, tags: set[str]) -> None:
        self._bound(key, tags)
        if self._stored is None:
            self._stored = _stored_into(self.scope)
        if key in self._stored:
            # a new value: its entries (`out["k"]`) hold its own tags until one is stored
            self.entries[key] = (self._st.path if self._st else (), self.t[key], {})

    def _bound(self, key: str, tags: set[str]) -> None:
        """`key = value`. Under an `if`, the value from before (or from a sibling branch)
        may still be the one read later: keep what an assignment on this path does not
        overwrite for certain (a may-analysis; branches join by union)."""
        here = self._st.path if self._st else ()
        if not here:
            self.t[key] = set(tags)
            self.at.pop(key, None)
            return
        n = len(here)
        old = self.at.get(key)
        if old is None:
            old = [((), frozenset(self.t[key]))] if key in self.t else []
        kept = [(q, tg) for q, tg in old if q[:n] != here]
        # `if c: x = a` / `else: x = b`, both at the top of their branch: together they
        # overwrite whatever `x` held before the `if` (on every path through it).
        parent, (stmt, branch) = here[:-1], here[-1]
        the_if = self._ifs.get(stmt)
        if the_if is not None and the_if.orelse and branch in (0, 1):
            sibling = (*parent, (stmt, 1 - branch))
            if any(q == sibling for q, _ in kept):
                kept = [(q, tg) for q, tg in kept if not (len(q) < n and parent[: len(q)] == q)]
        kept.append((here, frozenset(tags)))
        self.at[key] = kept
        out: set[str] = set()
        for _, tg in kept:
            out |= tg
        for t in DATA_TAGS & out:
            if not all(t in tg for _, tg in kept):
                out.discard(t)  # data on some paths only
        self.t[key] = out

    def _restored(self, tag: str) -> bool:
        """Does the current statement (a subscript store) run whenever `tag`'s gather did?
        If not, note on its origin the condition the store is under."""
        here = self._st.path if self._st else ()
        entered = self.entered.get(tag, ())
        if entered[: len(here)] == here:
            return True
        # The first step where the store's path leaves the gather's: the condition the
        # store is under and the gather is not (`entered` may be the longer path: a
        # gather in a later `elif` arm, the store in an earlier arm).
        depth = next(
            (i for i, (p, q) in enumerate(zip(here, entered, strict=False)) if p != q),
            len(entered),
        )
        fork = here[depth]
        cond = "a condition"
        if self._st is not None:
            for c in self._st.conds:
                if id(c) == fork[0] and isinstance(c, ast.If):
                    text = ast.unparse(c.test)
                    cond = f"`{text}`" if fork[1] == 0 else f"`not ({text})`"
        line = self._st.node.lineno if self._st else 0
        o = self.origins.get(tag)
        if not o.partial:
            note = f"the local slice is put back only when {cond} (line {line})"
            if depth < len(entered) and entered[depth][0] == fork[0]:
                note += ", a branch the gather is not on"
            self.origins.items[int(tag[2:])] = replace(o, partial=note)
        return False

    def _new_leaf(self, target: ast.expr) -> None:
        """`x.requires_grad_()`: `x` is made a new leaf of autograd, in place."""
        key = dotted(target)
        if key is None or key not in self.t:
            return
        self.t[key] = self._leaf_tags(key, self.t[key])
        if key in self.at:
            self.at[key] = [(q, frozenset(self._leaf_tags(key, set(tg)))) for q, tg in self.at[key]]

    def _leaf_tags(self, key: str, tags: set[str]) -> set[str]:
        """The tags of a gathered value made a new leaf `key` (`all_x =
        torch.cat(parts).detach().requires_grad_()`): a loss backpropagated into it leaves
        each rank's loss's gradient in `key.grad`; summed back across ranks
        (`dist.reduce_scatter(g, list(key.grad.chunk(W)))`, or an all_reduce), that is
        all-gather's backward written out by hand, and nothing is lost (Partial FC). Kept
        as no-gradient gather output otherwise."""
        if not any(t.startswith("g:") for t in tags):
            return tags
        if self._summed_grads is None:
            self._summed_grads = _summed_grads(self.ctx, self.scope)
        if key not in self._summed_grads:
            return tags
        return {t for t in tags if not t.startswith("g:")}

    def _add(self, target: ast.expr, tags: set[str]) -> None:
        """`key += value`, `key.append(value)`: `key` holds both; it stays data (no
        gradient to lose) only where the value added is data too."""
        key = dotted(target)
        if key is not None:
            self.entries.pop(key, None)
            cur = self.t.setdefault(key, set())
            cur -= DATA_TAGS - tags
            cur |= tags
            self.at.pop(key, None)

    def apply(self, st: Stmt) -> None:
        """Update the bindings for one statement."""
        self._st = st
        node = st.node
        if isinstance(node, ast.Return) and node.value is not None:
            self._return(node.value)
            return
        if isinstance(node, ast.For | ast.AsyncFor):
            self.bind(node.target, self.tags(node.iter))
        elif isinstance(node, ast.Assign):
            tags = self._value_tags(node.value)
            leaf = _makes_leaf(node.value)
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "requires_grad":
                    # `x.requires_grad = True`
                    if _true(node.value):
                        self._new_leaf(target.value)
                    continue
                if leaf and (key := dotted(target)) is not None:
                    self.bind(target, self._leaf_tags(key, tags))
                else:
                    self.bind(target, tags)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            self.bind(node.target, self._value_tags(node.value))
        elif isinstance(node, ast.AugAssign):
            if isinstance(node.target, ast.Name | ast.Attribute):
                self._add(node.target, self.tags(node.value))
            else:
                self.bind(node.target, self.tags(node.value))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            if self.entries:  # a call may change any entry of what it is given
                for x in ast.walk(node.value):
                    if isinstance(x, ast.Name | ast.Attribute) and (d := dotted(x)) is not None:
                        self.entries.pop(d, None)
            self._apply_call(node.value)

    def _return(self, value: ast.expr) -> None:
        """`return value`: its tags, and element-wise mean tags while every `return`
        of the function is a tuple of one length (`return logits, loss`)."""
        self.returns |= _whole(self.tags(value))
        n = (
            len(value.elts)
            if isinstance(value, ast.Tuple)
            and not any(isinstance(e, ast.Starred) for e in value.elts)
            else -1
        )
        if self._arity is None or self._arity == n:
            self._arity = n
        else:
            self._arity = -1
        if self._arity == -1:
            self.returns = _whole(self.returns)
            return
        assert isinstance(value, ast.Tuple)
        self.returns.add(f"@{n}")
        for i, e in enumerate(value.elts):
            if not detached_copy(e):  # `policy_loss.detach()`: a number for the log
                self.returns.update(f"@{i}:{t}" for t in self.tags(e) if _is_mean(t))
            parts = self._record_parts(e)
            if parts is not None:
                # `return loss, LossBreakdown(gen_loss, critic_loss)`: a record in the
                # tuple, followed one level down (`@1:@2`, `@1:@0:V`)
                self.returns.add(f"@{i}:@{len(parts)}")
                for j, p in enumerate(parts):
                    self.returns.update(f"@{i}:@{j}:{t}" for t in self.tags(p) if _is_mean(t))
            else:
                self._unrecorded.add(i)
            lengths = {t for t in self.returns if t.startswith(f"@{i}:@") and t.count(":") == 1}
            if i in self._unrecorded or len(lengths) > 1:
                # records of different lengths, or not a record, in this place: whole only
                self.returns = {t for t in self.returns if not t.startswith(f"@{i}:@")}

    def _record_parts(self, e: ast.expr) -> list[ast.expr] | None:
        """The fields of `e`, a tuple literal or a namedtuple of this file built by
        position (`LossBreakdown(loss, None)`), in order; None for anything else."""
        if isinstance(e, ast.Tuple):
            elts = e.elts
        elif (
            isinstance(e, ast.Call)
            and isinstance(e.func, ast.Name)
            and not e.keywords
            and e.func.id in self._namedtuples()
        ):
            elts = e.args
        else:
            return None
        return None if any(isinstance(x, ast.Starred) for x in elts) else list(elts)

    def _namedtuples(self) -> set[str]:
        """The names this file binds to a `namedtuple(...)` (or derives from NamedTuple)."""
        if self._records is None:
            self._records = {
                t.id
                for call, targets in self.ctx.assign_calls
                if last_name(call.func) == "namedtuple"
                for t in targets
                if isinstance(t, ast.Name)
            } | {
                name
                for name, cls in self.ctx.class_by_name.items()
                if any(last_name(b) == "NamedTuple" for b in cls.bases)
            }
        return self._records

    def _data_tags(self, value: ast.expr, tags: set[str]) -> set[str]:
        """`Z` for a value with no gradient path (computed here under `torch.no_grad()`,
        or detached), `I` for an integer tensor, `B` for a field of a forward pass's
        inputs or of a DataLoader's batch (`data`); none of the last two for a value
        computed from a forward pass's output (`T`)."""
        if (self._st is not None and self._st.nograd) or detached(value):
            return {"Z"}
        base = kept_base(value)
        if base is not value and isinstance(base, ast.Name | ast.Attribute):
            # `lengths.contiguous()`, `w.to(device)`: the same values as the name holds
            return self.tags(base) & DATA_TAGS
        if "T" in tags:
            return set()
        if integer_valued(value):
            return {"I"}
        if self._inputs is None:
            calls = [n for st in self.scope.stmts for n in st.walk() if isinstance(n, ast.Call)]
            self._inputs = forward_inputs(calls, self._forward_call)
            stmts = (st.node for st in self.scope.stmts)
            self._inputs |= loader_items(stmts, self.ctx.imports.qualname)
        return {"B"} if self._inputs and batch_field(value, self._inputs) else set()

    def _value_tags(self, value: ast.expr) -> set[str]:
        tags = self.tags(value)
        tags |= self._data_tags(value, tags)
        if is_count_expr(value) and not _only_fixed(tags) and not _real_weights(value, tags):
            tags.add("K")  # a count of items: a division by this value is a mean over them
        if self._st is not None and self._st.nograd:
            tags.add("D")  # computed with gradient recording off
        if isinstance(value, ast.Call):
            if last_name(value.func) in _IGNORE_CRITERIA and (
                _kwarg(value, ("ignore_index",)) or self._default_ignores(value)
            ):
                tags.add("C")
            q = self.ctx.imports.collective(value)
            if (
                q is not None
                and q.endswith("all_gather")
                and value.args
                and any(t.startswith("G:") for t in self.tags(value.args[0]))
            ):
                tags.add(self._origin("q", value, "", "all-gathers gradients"))
        return tags

    def _origin(self, kind: str, call: ast.Call, name: str, note: str, what: str = "") -> str:
        """The tag of the value `call` produces (the same tag on both walks)."""
        key = id(call) * 2 + (kind == "q")
        tag = self._made.get(key)
        if tag is None:
            o = Origin(
                path=self.ctx.path,
                line=call.lineno,
                col=call.col_offset + 1,
                name=name,
                trace=(self._hop(call, note),),
                what=what,
            )
            tag = self.origins.new(kind, o)
            self._made[key] = tag
        self.entered.setdefault(tag, self._st.path if self._st else ())
        return tag

    def _apply_call(self, call: ast.Call) -> None:
        if _makes_leaf(call) and isinstance(call.func, ast.Attribute):
            self._new_leaf(call.func.value)  # `x.requires_grad_()`
            return
        q = self.ctx.imports.plain_gather(call)
        if q is not None:
            out = call.args[0] if call.args else _kwarg(call, _GATHER_OUT_KW)
            inp = call.args[1] if len(call.args) > 1 else _kwarg(call, _GATHER_IN_KW)
            if out is None:
                return
            key = dotted(out)
            if key is None:
                return
            short = q.replace("torch.distributed.distributed_c10d.", "torch.distributed.")
            out_tags: set[str] = set()
            in_tags = self.tags(inp) if inp is not None else set()
            if inp is not None and not isinstance(inp, ast.Name):
                in_tags |= self._data_tags(inp, in_tags)
            if in_tags & DATA_TAGS:
                self.t[key] = set()  # an integer tensor, the batch's own field: data
                return
            # Under no_grad the missing gradient is what the author asked for (MoCo keys,
            # memory banks, metrics): no `g` tag there. A `@torch.no_grad()` helper that
            # gathers its argument leaves it to the callers: harmless for momentum keys,
            # the bug for trainable features (`n` tag).
            if not ((self._st is not None and self._st.nograd) or self.scope.nograd):
                g = self._origin("g", call, key, f"{short} fills `{key}`")
                out_tags.add(g)
                if isinstance(inp, ast.Name) and f"a:{inp.id}" in in_tags and "T" not in in_tags:
                    out_tags.add(f"d:{inp.id}:{g[2:]}")  # no loss if the caller passes data
            elif self.scope.nograd:
                g = self._origin("g", call, key, f"{short} fills `{key}` (under no_grad)")
                out_tags.update(f"n:{t[2:]}:{g[2:]}" for t in in_tags if t.startswith("a:"))
            elif inp is not None:
                # inside `with torch.no_grad():` in a function with gradients on
                out_tags |= self._gathered_without_grad(
                    inp, call, f"{short} fills `{key}` (under no_grad)", name=key
                )
            if any(t.startswith("G:") for t in in_tags):
                out_tags.add(self._origin("q", call, key, "all-gathers gradients"))
            for t in in_tags:
                if t.startswith("a:"):
                    qt = self._origin("q", call, key, "all-gathers gradients")
                    out_tags.add(f"qa:{t[2:]}:{qt[2:]}")
            self.t[key] = out_tags
            return
        func = call.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "pop"
            and call.args
            and any(is_rank_ref(x) for x in ast.walk(call.args[0]))
        ):
            # `parts.pop(rank)`, then `torch.cat([local, *parts])`: this rank's slice is
            # taken out to be put back with its gradient (the local rows first), the
            # same convention as `parts[rank] = local`.
            key = dotted(func.value)
            if key is not None and key in self.t:
                self.t[key] = {
                    t for t in self.t[key] if not (t.startswith("g:") and self._restored(t))
                }
            return
        if isinstance(func, ast.Attribute) and func.attr in (
            "append",
            "extend",
            "insert",
            "copy_",
            "update",  # `ret.update(compute_mlm(self, batch))`: a dict of the objectives
        ):
            added: set[str] = set()
            for arg in call.args:
                added |= self.tags(arg)
            self._add(func.value, added)

    def run(self) -> Iterator[Stmt]:
        """Walk the scope; yield each statement before applying it. A scope with a loop is
        walked twice (values carried around the loop reach the statements before their
        assignment on the second walk); one without is walked once, so a later rebinding
        never reaches an earlier statement (issue 33: DPO's `get_batch_metrics`)."""
        if any(st.loops for st in self.scope.stmts):
            for st in self.scope.stmts:
                self.apply(st)
        for st in self.scope.stmts:
            yield st
            self.apply(st)
