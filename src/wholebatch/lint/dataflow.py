"""Follow values through a scope: which names hold all-gathered tensors without a
gradient, which hold gradients, which hold a mean over a data-dependent item count.

The analysis is deliberately small: a name's tags are the union of the tags of the
names read by the expression last assigned to it (`x = torch.cat(parts)`,
`parts.append(y)`, `for t in parts`), plus tags that come from the expression
itself (a c10d all_gather's output list, a `.grad` read, `ignore_index=`). The scope
is walked twice so that values carried around a loop reach their uses.

Tags:
    ``g:L:C``  output of the plain c10d all_gather at line L, column C (no gradient);
    ``q:L:C``  gradients all-gathered by the call at L:C and not yet summed;
    ``G:base`` derived from ``base.grad``;
    ``V``      a mean over a data-dependent number of items (``ignore_index``, a
               Hugging Face ``outputs.loss``, a division by ``mask.sum()``);
    ``C``      a loss module built with ``ignore_index`` (calling it gives ``V``);
    ``p``      derived from an argument of the enclosing function.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from wholebatch.lint.names import dotted, is_rank_ref, last_name
from wholebatch.lint.scope import FileContext, Scope, Stmt

__all__ = ["Flow", "gather_source", "source_tag"]

# Calls that add up their input: after one of these, gathered gradients are summed.
_REDUCERS = frozenset(
    {"sum", "mean", "add", "add_", "reduce", "nansum", "sum_to_size", "all_reduce", "fsum"}
)
_IGNORE_CRITERIA = frozenset({"CrossEntropyLoss", "NLLLoss"})
# Denominators that count items of this micro-batch: `num_tokens`, `n_items`, ...
_COUNT_RE = re.compile(r"n_?tok|num_?tok|ntok|tokens?_count|n_?items|num_?items|num_valid|n_valid")
_GATHER_OUT_KW = ("tensor_list", "output_tensor", "output_tensor_list", "output")
_GATHER_IN_KW = ("tensor", "input_tensor")


def source_tag(kind: str, call: ast.AST) -> str:
    """The tag naming the call that produced a value: `g:12:4`."""
    return f"{kind}:{call.lineno}:{call.col_offset}"  # type: ignore[attr-defined]


def gather_source(tag: str) -> tuple[int, int]:
    """(line, col) of the call named by a `g:`/`q:` tag."""
    _, line, col = tag.split(":")
    return int(line), int(col)


def _kwarg(call: ast.Call, names: tuple[str, ...]) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg in names:
            return kw.value
    return None


def _sum_reduction(call: ast.Call) -> bool:
    red = _kwarg(call, ("reduction",))
    return isinstance(red, ast.Constant) and red.value in ("sum", "none")


class Flow:
    """Tags of names in one scope, updated statement by statement."""

    def __init__(self, ctx: FileContext, scope: Scope) -> None:
        self.ctx = ctx
        self.scope = scope
        self.t: dict[str, set[str]] = {}
        self.sources: dict[str, str] = {}  # "g:L:C" -> the name the gather wrote into
        node = scope.node
        if not isinstance(node, ast.Module):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                if arg.arg not in ("self", "cls", "ctx"):
                    self.t[arg.arg] = {"p"}

    # -- reading ------------------------------------------------------------------------

    def tags(self, expr: ast.AST) -> set[str]:
        """The tags of the value of `expr` under the current bindings."""
        out: set[str] = set()
        rank = reducer = False
        for n in ast.walk(expr):
            if isinstance(n, ast.Name):
                out |= self.t.get(n.id, set())
            elif isinstance(n, ast.Attribute):
                d = dotted(n)
                if d is not None:
                    out |= self.t.get(d, set())
                if n.attr == "grad":
                    out.add("G:" + (dotted(n.value) or ast.unparse(n.value)))
                elif n.attr == "loss" and not (
                    isinstance(n.value, ast.Name) and n.value.id == "self"
                ):
                    out.add("V")  # Hugging Face `outputs.loss`: a mean over non-ignored tokens
            elif isinstance(n, ast.Call):
                name = last_name(n.func)
                reducer = reducer or name in _REDUCERS
                if _kwarg(n, ("ignore_index",)) is not None and not _sum_reduction(n):
                    out.add("V")
                d = dotted(n.func)
                if d is not None and "C" in self.t.get(d, ()) and not _sum_reduction(n):
                    out.add("V")
            elif isinstance(n, ast.Subscript):
                s = n.slice
                if isinstance(s, ast.Constant) and s.value == "loss":
                    out.add("V")
                rank = rank or any(is_rank_ref(x) for x in ast.walk(s))
            elif isinstance(n, ast.BinOp):
                if isinstance(n.op, ast.Add):
                    reducer = True
                elif isinstance(n.op, ast.Div) and self._counts_items(n.right):
                    out.add("V")
        out.discard("C")
        if rank:
            # `torch.cat(gathered[:rank] + [local] + gathered[rank + 1:])`: the local slice
            # is put back with its gradient, the classic partial fix; not "no gradient".
            out = {t for t in out if not t.startswith("g:")}
        if reducer:
            out = {t for t in out if not t.startswith("q:")}
        return out

    @staticmethod
    def _counts_items(node: ast.expr) -> bool:
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and last_name(n.func) in ("sum", "count_nonzero"):
                return True
            if isinstance(n, ast.Name | ast.Attribute) and _COUNT_RE.search(last_name(n)):
                return True
        return False

    # -- writing ------------------------------------------------------------------------

    def bind(self, target: ast.expr, tags: set[str]) -> None:
        """Assign a value with `tags` to `target`."""
        if isinstance(target, ast.Name | ast.Attribute):
            key = dotted(target)
            if key is not None:
                self.t[key] = set(tags)
        elif isinstance(target, ast.Tuple | ast.List):
            for elt in target.elts:
                self.bind(elt, tags)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, tags)
        elif isinstance(target, ast.Subscript):
            key = dotted(target.value)
            if key is None:
                return
            cur = self.t.get(key, set())
            if not any(t.startswith("g:") for t in tags):
                # `gathered[rank] = local`: this rank's slice keeps its gradient again.
                cur = {t for t in cur if not t.startswith("g:")}
            self.t[key] = cur | tags

    def _add(self, target: ast.expr, tags: set[str]) -> None:
        key = dotted(target)
        if key is not None:
            self.t.setdefault(key, set()).update(tags)

    def apply(self, st: Stmt) -> None:
        """Update the bindings for one statement."""
        node = st.node
        if isinstance(node, ast.For | ast.AsyncFor):
            self.bind(node.target, self.tags(node.iter))
        elif isinstance(node, ast.Assign):
            tags = self._value_tags(node.value)
            for target in node.targets:
                self.bind(target, tags)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            self.bind(node.target, self._value_tags(node.value))
        elif isinstance(node, ast.AugAssign):
            if isinstance(node.target, ast.Name | ast.Attribute):
                self._add(node.target, self.tags(node.value))
            else:
                self.bind(node.target, self.tags(node.value))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            self._apply_call(node.value)

    def _value_tags(self, value: ast.expr) -> set[str]:
        tags = self.tags(value)
        if isinstance(value, ast.Call):
            if last_name(value.func) in _IGNORE_CRITERIA and _kwarg(value, ("ignore_index",)):
                tags.add("C")
            q = self.ctx.imports.collective(value)
            if (
                q is not None
                and q.endswith("all_gather")
                and value.args
                and any(t.startswith("G:") for t in self.tags(value.args[0]))
            ):
                tags.add(source_tag("q", value))
        return tags

    def _apply_call(self, call: ast.Call) -> None:
        if self.ctx.imports.plain_gather(call) is not None:
            out = call.args[0] if call.args else _kwarg(call, _GATHER_OUT_KW)
            inp = call.args[1] if len(call.args) > 1 else _kwarg(call, _GATHER_IN_KW)
            if out is None:
                return
            key = dotted(out)
            if key is None:
                return
            out_tags = {source_tag("g", call)}
            if inp is not None and any(t.startswith("G:") for t in self.tags(inp)):
                out_tags.add(source_tag("q", call))
            self.sources[source_tag("g", call)] = key
            self.t[key] = out_tags
            return
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in (
            "append",
            "extend",
            "insert",
            "copy_",
        ):
            added: set[str] = set()
            for arg in call.args:
                added |= self.tags(arg)
            self._add(func.value, added)

    def run(self) -> Iterator[Stmt]:
        """Walk the scope twice; yield each statement of the second walk before applying it."""
        for st in self.scope.stmts:
            self.apply(st)
        for st in self.scope.stmts:
            yield st
            self.apply(st)
