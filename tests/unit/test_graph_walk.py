"""`GradCache`'s walk of a loss's autograd graph finds every leaf, whatever ids CPython reuses.

A node's Python wrapper lives only while something references it; on torch 2.4 and
2.8 a popped, unreferenced wrapper is freed and its `id()` handed to the next
wrapper made, so a walk that marks nodes by bare ids skips unvisited nodes and
finds no leaves (issue 36: `logit_scale` went unaveraged, no error). torch 2.13
keeps wrappers alive longer, which hid it. `WeakWrapperGraph` reproduces the older
behaviour on any torch: each access to `next_functions` makes a wrapper unless a
live one exists, as torch's own `functionToPyObject` does.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from wholebatch.train.gradcache import _loss_leaves


class _Node:
    """One graph node; its wrapper is cached weakly, as torch caches a node's PyObject."""

    def __init__(self, children: list[_Node], variable: Any = None) -> None:
        self.children = children
        self.variable = variable
        self._wrapper: weakref.ref[_Wrapper] | None = None

    def wrap(self) -> _Wrapper:
        live = self._wrapper() if self._wrapper is not None else None
        if live is None:
            live = _Wrapper(self)
            self._wrapper = weakref.ref(live)
        return live


class _Wrapper:
    __slots__ = ("__weakref__", "node")

    def __init__(self, node: _Node) -> None:
        self.node = node

    @property
    def variable(self) -> Any:
        return self.node.variable

    @property
    def next_functions(self) -> tuple[tuple[_Wrapper, int], ...]:
        return tuple((c.wrap(), 0) for c in self.node.children)


class _Loss:
    def __init__(self, root: _Node) -> None:
        self.root = root

    @property
    def grad_fn(self) -> _Wrapper:
        return self.root.wrap()


def _chain_graph(depth: int, leaves: list[torch.Tensor]) -> _Node:
    """A loss over `depth` freed intermediate nodes, one leaf hanging off each level's side."""
    node = _Node([_Node([], variable=leaves[-1])])
    for i in range(depth):
        side = _Node([], variable=leaves[i % (len(leaves) - 1)])
        node = _Node([node, _Node([side])])
    return node


def _old_walk(loss: Any) -> list[Any]:
    """The walk before the fix: visited nodes marked by bare ids (the mutation)."""
    leaves, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if isinstance(getattr(fn, "variable", None), torch.Tensor):
            leaves.append(fn.variable)
        stack.extend(n for n, _ in fn.next_functions)
    return leaves


@pytest.mark.parametrize("depth", [3, 20, 200])
def test_walk_survives_id_reuse(depth: int) -> None:
    params = [torch.zeros(1, requires_grad=True) for _ in range(4)]
    loss = _Loss(_chain_graph(depth, params))
    found = {id(t) for t in _loss_leaves(loss, stop=None)}  # type: ignore[arg-type]  # a fake graph
    assert found == {id(p) for p in params}


def test_bare_ids_lose_leaves() -> None:
    """The mutation: marking by bare ids misses leaves on the same graph (the test can fail)."""
    params = [torch.zeros(1, requires_grad=True) for _ in range(4)]
    loss = _Loss(_chain_graph(200, params))
    assert {id(t) for t in _old_walk(loss)} != {id(p) for p in params}


def test_walk_on_a_real_graph() -> None:
    """The installed torch's own graph: every parameter the loss reaches, nothing past `stop`."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    s = torch.nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
    x = torch.randn(8, 4, dtype=torch.float64)
    h = x
    for _ in range(30):
        h = (h @ w).tanh()
    loss = h.sum() * s.exp()
    assert {id(t) for t in _loss_leaves(loss, stop=None)} == {id(w), id(s)}
    # a node to stop at: the walk does not go past it into `w`'s branch
    stop = h.grad_fn
    assert {id(t) for t in _loss_leaves(loss, stop=stop)} == {id(s)}
