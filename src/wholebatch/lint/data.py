"""Values with no gradient to lose, for WB101: a plain `torch.distributed.all_gather` of
one loses nothing, because it never had a gradient or none is wanted.

Three kinds, all read from the expression a name is assigned (`dataflow.Flow`):

- an **integer tensor** (tag ``I``): a dtype that autograd refuses to record
  (`torch.tensor(n, dtype=torch.int64)`, `x.long()`, `x.to(torch.bool)`; "only
  Tensors of floating point and complex dtype can require gradients", tested in
  tests/unit/test_lint_data_gather_twins.py), or `torch.tensor` of sizes and integer
  literals only (`torch.tensor(x.shape[-1])`: an int64 tensor);
- a **field of a forward pass's inputs** (tag ``B``): `batch["loss_weights"]` where the
  same `batch` is given to a module (`model(**batch)`, `model(batch)`,
  `model(input_ids=batch["input_ids"])`): the inputs of the model, not its outputs;
  or where `batch` is an item a `torch.utils.data.DataLoader` built in the same scope
  yields (`for it, batch in enumerate(tqdm(loader))`): the collated samples of a
  dataset, read before any forward pass (simplescaling/s1's gpt-accelera
  `prepare_batch`, which concatenates token ids across a tensor-parallel group).
- a value with **no gradient path** (tag ``Z``): assigned whole under `torch.no_grad()`
  (a frozen encoder's features, `with torch.no_grad(): feats = encoder(x)`), or a
  detach of a value (`x.detach()`, `x.detach().float()`): autograd recorded nothing
  that leads to a parameter, so a gather of it cannot cut a gradient off.

    sizes = [torch.empty_like(n) for _ in range(W)]
    dist.all_gather(sizes, torch.tensor(ids.shape[-1], dtype=torch.int64))  # I: a pad size
    dist.all_gather(weights_W, batch["loss_weights"])     # B: weights multiplied in as data
    dist.all_gather_into_tensor(cap_WBD, cap_feats_BD)    # Z: computed under no_grad
    log_probs_W = torch.distributed.nn.all_gather(log_probs)  # the gradient goes here

Issue 33, hiyouga/LLaMA-Factory's sequence_parallel.py (benchmarks/lint_corpus2.toml);
``Z``: Alpha-VLLM/LLaMA2-Accessory's Large-DiT-T2I/train.py (benchmarks/lint_corpus3.toml).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable

from wholebatch.lint.names import dotted, last_name

__all__ = [
    "DATA_TAGS",
    "FRESH",
    "META_ATTRS",
    "batch_field",
    "detached",
    "forward_inputs",
    "integer_valued",
    "kept_base",
    "literal_kwargs",
    "loader_items",
    "spelled_out",
    "to_number",
]

# The tags of a value with no gradient to lose; kept through names only, and only while
# every assignment that may reach a read gives it (`Flow._assign`).
DATA_TAGS = frozenset({"I", "B", "Z"})

_INT_DTYPES = frozenset(
    {"int8", "int16", "int32", "int64", "uint8", "long", "int", "short", "bool", "byte"}
)
_INT_CASTS = frozenset({"long", "int", "short", "bool", "byte"})
# Methods that keep a tensor's dtype and values (moved, laid out, viewed).
_KEEPS = frozenset(
    {"to", "cuda", "cpu", "contiguous", "view", "reshape", "clone", "flatten", "squeeze",
     "unsqueeze", "expand", "repeat", "chunk", "split", "narrow", "transpose", "permute"}
)  # fmt: skip
# What `torch.tensor(...)` may be given for an integer tensor: sizes and integer literals.
_SIZE_ATTRS = frozenset({"shape"})
_SIZE_CALLS = frozenset({"size", "numel", "dim", "len"})


def to_number(func: ast.expr) -> bool:
    """`float(x)`, `int(x)`, `x.item()`, `x.tolist()`, `x.numpy()`: out of autograd; and
    the size of a tensor (`len(x)`, `x.size(1)`, `x.dim()`, `x.numel()`): a number that
    carries no gradient of `x`'s (issue 33: `n = losses.shape[1]` made a per-domain
    statistic divided by it read as "derived from this rank's differentiable input")."""
    if isinstance(func, ast.Name):
        return func.id in ("float", "int", "bool", "len")
    return isinstance(func, ast.Attribute) and func.attr in _NUMBER_METHODS


_NUMBER_METHODS = frozenset({"item", "tolist", "numpy", "size", "dim", "numel", "nelement"})
# Calls whose result carries no gradient of their arguments': a new tensor of a given
# size or like another one (`torch.zeros(n)`, `torch.empty_like(x)`), or an integer one
# (`torch.bincount(ids)`, `x.argmax(-1)`). Issue 33: DoReMi's per-domain statistics,
# `zeros(n_domains)` filled from gathered losses, read as "derived from this rank's input".
FRESH = frozenset(
    {
        "zeros", "ones", "empty", "full", "arange", "linspace", "eye", "rand", "randn",
        "randint", "randperm", "zeros_like", "ones_like", "empty_like", "full_like",
        "rand_like", "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty",
        "new_full", "bincount", "argmax", "argmin", "argsort", "nonzero", "isnan", "isinf",
        "isfinite",
    }
)  # fmt: skip
# Attributes of a tensor that describe it and carry none of its gradient.
META_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad"})


def _int_dtype(node: ast.expr | None) -> bool:
    if node is None:
        return False
    if isinstance(node, ast.Name):
        return node.id == "int" or node.id == "bool"
    return isinstance(node, ast.Attribute) and node.attr in _INT_DTYPES


def _sizes_only(node: ast.expr) -> bool:
    """An expression of sizes (`x.shape[-1]`, `x.size(0)`, `len(x)`) and integer
    literals, with integer arithmetic: its value is a Python int."""
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.Subscript):
        return isinstance(node.value, ast.Attribute) and node.value.attr in _SIZE_ATTRS
    if isinstance(node, ast.Attribute):
        return node.attr in _SIZE_ATTRS
    if isinstance(node, ast.Call):
        return last_name(node.func) in _SIZE_CALLS
    if isinstance(node, ast.BinOp):
        return (
            isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.FloorDiv | ast.Mod)
            and _sizes_only(node.left)
            and _sizes_only(node.right)
        )
    if isinstance(node, ast.List | ast.Tuple):
        return all(_sizes_only(e) for e in node.elts)
    return False


def integer_valued(node: ast.expr) -> bool:
    """Is `node` an integer (or boolean) tensor, which autograd never records: a cast
    (`x.long()`, `x.to(torch.int64)`), a factory given an integer `dtype=`, or
    `torch.tensor` of sizes and integer literals? Methods that keep the dtype
    (`.to(device)`, `.view(-1)`) are looked through."""
    while isinstance(node, ast.Call):
        func = node.func
        dtype = next((k.value for k in node.keywords if k.arg == "dtype"), None)
        if dtype is not None:
            return _int_dtype(dtype)
        name = last_name(func)
        if isinstance(func, ast.Attribute) and name in _INT_CASTS and not node.args:
            return True
        if name == "to" and any(_int_dtype(a) for a in node.args):
            return True
        if name in ("tensor", "as_tensor", "LongTensor", "IntTensor", "BoolTensor"):
            if name != "tensor" and name != "as_tensor":
                return True
            return bool(node.args) and _sizes_only(node.args[0])
        if not (isinstance(func, ast.Attribute) and name in _KEEPS):
            return False
        node = func.value
    return False


def _new_leaf(call: ast.Call) -> bool:
    """`torch.tensor(data)`: a copy of `data` as a new leaf that does not require grad
    unless told to (`requires_grad=True`), whatever `data` is (PyTorch's docs of
    `torch.tensor`: "constructs a tensor with no autograd history")."""
    return dotted(call.func) == "torch.tensor" and not any(
        k.arg == "requires_grad"
        and not (isinstance(k.value, ast.Constant) and k.value.value is False)
        for k in call.keywords
    )


def kept_base(node: ast.expr) -> ast.expr:
    """`node` with the methods that keep a tensor's values stripped (`x.contiguous()`,
    `x.to(device).view(-1)` -> `x`): what it holds is what the base holds."""
    while (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _KEEPS
    ):
        node = node.func.value
    return node


def detached(node: ast.expr) -> bool:
    """Is `node` a detach of a value (`x.detach()`) or a new leaf made of it
    (`torch.tensor(x)`), perhaps moved, viewed or cast after it
    (`x.detach().float().view(-1)`)? Its result has no gradient path."""
    while isinstance(node, ast.Call):
        if _new_leaf(node):
            return True
        if not isinstance(node.func, ast.Attribute):
            return False
        name = node.func.attr
        if name == "detach" and not node.args:
            return True
        if name not in _KEEPS and name not in ("float", "half", "bfloat16", "double"):
            return False
        node = node.func.value
    return False


def forward_inputs(calls: list[ast.Call], is_forward: Callable[[ast.expr], bool]) -> set[str]:
    """The names given whole to a forward pass among `calls` (`model(**batch)`,
    `model(batch)`), and those whose fields are (`model(input_ids=batch["ids"])`)."""
    out: set[str] = set()
    for call in calls:
        if not is_forward(call.func):
            continue
        for value in (*call.args, *(k.value for k in call.keywords)):
            if isinstance(value, ast.Starred):
                value = value.value
            while isinstance(value, ast.Subscript | ast.Attribute):
                value = value.value
            d = dotted(value)
            if d is not None:
                out.add(d)
    return out


# What resolves a name through the file's imports (`Imports.qualname`).
Qualname = Callable[[ast.expr], str | None]
_LOADERS = frozenset({"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"})
# Calls whose items are those of the iterable they are given first (a progress bar, an
# iterator over it); `enumerate` pairs each with its index.
_SAME_ITEMS = frozenset({"iter", "tqdm", "islice", "cycle"})


def _yields(node: ast.expr, loaders: dict[str, str], qualname: Qualname) -> str | None:
    """What iterating `node` yields: "batch" (a DataLoader's batches), "pair" ((index,
    batch), `enumerate` of one), or None (anything else)."""
    if isinstance(node, ast.Name):
        return loaders.get(node.id)
    if not isinstance(node, ast.Call):
        return None
    if qualname(node.func) in _LOADERS:
        return "batch"
    name = last_name(node.func)
    inner = _yields(node.args[0], loaders, qualname) if node.args else None
    if name in _SAME_ITEMS:
        return inner
    return "pair" if name == "enumerate" and inner == "batch" else None


def loader_items(stmts: Iterable[ast.stmt], qualname: Qualname) -> set[str]:
    """The names `stmts` (one scope's, in source order) bind to a batch that a
    `torch.utils.data.DataLoader` built there yields: `loader = DataLoader(ds)`, then
    `for batch in loader`, `for i, batch in enumerate(loader)`, through a progress bar
    (`pbar = tqdm(enumerate(loader))`, `for i, batch in pbar`). A loader passed in as a
    parameter is not followed (nothing here says what it is)."""
    loaders: dict[str, str] = {}
    out: set[str] = set()
    for node in stmts:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = node.targets[0]
            if isinstance(name, ast.Name):
                kind = _yields(node.value, loaders, qualname)
                if kind is not None:
                    loaders[name.id] = kind
                else:
                    loaders.pop(name.id, None)
        elif isinstance(node, ast.For | ast.AsyncFor):
            kind = _yields(node.iter, loaders, qualname)
            target: ast.expr | None = node.target
            if kind == "pair":
                elts = target.elts if isinstance(target, ast.Tuple) else []
                target = elts[1] if len(elts) == 2 else None
            if kind is not None and target is not None:
                out |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return out


def batch_field(node: ast.expr, inputs: set[str]) -> bool:
    """Is `node` a field of a forward pass's inputs, read by a string key or an
    attribute (`batch["loss_weights"]`, `batch.loss_mask.float()`)?"""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr not in _KEEPS and node.func.attr not in ("float", "half", "get"):
            return False
        if node.func.attr == "get":
            key = node.args[0] if node.args else None
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                return False
            return dotted(node.func.value) in inputs
        node = node.func.value
    if isinstance(node, ast.Subscript):
        key = node.slice
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            return False
        return dotted(node.value) in inputs
    if isinstance(node, ast.Attribute):
        return dotted(node.value) in inputs
    return False


# Methods that add or change a dict's entries.
_DICT_WRITERS = frozenset({"update", "setdefault", "__setitem__", "pop", "popitem", "clear"})


def literal_kwargs(stmts: Iterable[Iterable[ast.AST]]) -> dict[str, list[ast.keyword]]:
    """The names one scope binds once to a dict literal of constant string keys and
    never changes (`inputs = {"query_ids": q, "input_ids_a": a}`; no store into it, no
    `update`, no other binding), with those entries as keywords: what `model(**inputs)`
    is given, which shows there are no labels among them. `stmts`: the nodes of each of
    the scope's statements (`Stmt.walk`, the node itself first)."""
    found: dict[str, list[ast.keyword]] = {}
    changed: set[str] = set()
    literal: set[int] = set()  # id of each target bound to a literal
    for nodes in stmts:
        for n in nodes:
            if (
                isinstance(n, ast.Assign)
                and len(n.targets) == 1
                and isinstance(n.targets[0], ast.Name)
                and isinstance(n.value, ast.Dict)
                and all(
                    isinstance(k, ast.Constant) and isinstance(k.value, str) for k in n.value.keys
                )
            ):
                name = n.targets[0].id
                literal.add(id(n.targets[0]))
                if name in found or name in changed:
                    changed.add(name)
                    continue
                found[name] = [
                    ast.keyword(arg=str(k.value), value=v)
                    for k, v in zip(n.value.keys, n.value.values, strict=True)
                    if isinstance(k, ast.Constant)
                ]
            elif isinstance(n, ast.Name):
                if isinstance(n.ctx, ast.Store | ast.Del) and id(n) not in literal:
                    changed.add(n.id)
            elif isinstance(n, ast.Subscript):
                if isinstance(n.ctx, ast.Store | ast.Del) and isinstance(n.value, ast.Name):
                    changed.add(n.value.id)  # `inputs["labels"] = y`
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in _DICT_WRITERS
                and isinstance(n.func.value, ast.Name)
            ):
                changed.add(n.func.value.id)
    return {k: v for k, v in found.items() if k not in changed}


def spelled_out(call: ast.Call, literals: dict[str, list[ast.keyword]]) -> ast.Call:
    """`call` with each `**name` of a dict literal (`literal_kwargs`) replaced by that
    literal's entries, as if given by keyword; `call` itself where there is none."""
    if not any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id in literals
               for k in call.keywords):  # fmt: skip
        return call
    keywords: list[ast.keyword] = []
    for k in call.keywords:
        if k.arg is None and isinstance(k.value, ast.Name) and k.value.id in literals:
            keywords += literals[k.value.id]
        else:
            keywords.append(k)
    return ast.Call(func=call.func, args=call.args, keywords=keywords)
