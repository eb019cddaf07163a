"""Which rows of the whole batch each forward of a trainer's model saw (`RowRecorder`), by content.

A trainer's sampler decides which rows each micro-batch holds, and its collator
rebuilds them: pads each micro-batch to its own longest row, stacks DPO's
chosen rows over its rejected ones after the prompt, adds a tokenizer's [CLS]
and [SEP] around a sentence, calls the model once per column. So a forward's
rows are found by what they contain, not by position:

- every integer column of the batch (token rows, or ids) gives each row a
  content: its tokens where its mask is 1 (the column's own mask: `X_mask` or
  `X_attention_mask` beside `X_ids`, else `attention_mask`), else without
  trailing padding (a trailing run of 0, or of negative labels);
- a forward's candidate tensors are the integer tensors among its arguments,
  in dicts too (sentence-transformers passes one features dict), each row
  stripped the same way through the `attention_mask` beside it;
- a forward row is the batch row whose content it equals, or else the one whose
  contents it contains the most of (the prompt and the chosen completion of a
  DPO pair; a sentence between [CLS] and [SEP]), when one row is the single best.

`calls` lists, per forward that brought rows not seen before, those rows in the
order seen (a row that appears twice in one forward, as a DPO pair's chosen and
rejected rows do, once); a forward of rows all seen already (the second column
of a pair, a second pass) is `repeats`, a forward that matched nothing
`missed`. A `key` column (an id per row that the forward receives) is matched
by exact value only.

Legend: N rows of the batch, R rows of one forward, L tokens of a row.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from wholebatch.verify.recording import in_backward

__all__ = ["RowRecorder"]


def _is_ids(t: Any) -> bool:
    return (
        isinstance(t, Tensor) and t.dim() >= 1 and not t.is_floating_point() and not t.is_complex()
    )


def _mask_for(name: str, columns: Mapping[str, Any], like: Tensor) -> Tensor | None:
    """The mask column that goes with column `name`, if the batch (or a forward) has one."""
    names = [name.replace("input_ids", "attention_mask"), name.replace("_ids", "_mask")]
    names += [name.replace("ids", "mask"), name.replace("_ids", "_attention_mask")]
    names += ["attention_mask", "mask"]
    for other in names:
        m = columns.get(other)
        if (
            other != name
            and isinstance(m, Tensor)
            and m.shape == like.shape
            and not m.is_floating_point()
        ):
            return m.detach().cpu()
    return None


def _strip(row: Tensor, mask: Tensor | None) -> np.ndarray:
    """A row's tokens: where its mask is 1, else without a trailing run of 0 or of negative values."""
    if row.dim() == 0:  # an id
        return np.array([int(row)], dtype=np.int64)
    if row.dim() > 1:  # rows of vectors: compare whole
        return row.contiguous().numpy().reshape(-1).astype(np.int64)
    if mask is not None:
        return row[mask.bool()].numpy().astype(np.int64)
    values = row.numpy().astype(np.int64)
    keep = len(values)
    while keep and (values[keep - 1] == 0 or values[keep - 1] < 0):
        keep -= 1
    return values[:keep]


def _contains(whole: np.ndarray, part: np.ndarray) -> bool:
    """`part` is a contiguous run of `whole`."""
    n, m = len(whole), len(part)
    if m == 0 or m > n:
        return False
    first = np.flatnonzero(whole[: n - m + 1] == part[0])
    return any(np.array_equal(whole[i : i + m], part) for i in first)


class RowRecorder:
    """Records which rows of the whole batch each forward of `model` receives (grad mode, outside backward).

    A forward without gradient (a reference model, generation, the first pass of
    gradient caching) trains nothing and is not looked at.
    """

    def __init__(self, model: nn.Module, batch: Any, key: str | None = None) -> None:
        self.calls: list[list[int]] = []
        self.forwards = 0
        self.missed = 0
        self.repeats = 0
        self.key = key
        self.key_name = key or self._default_name(batch)
        self._columns = self._contents(batch, key)
        # per column: content -> the rows holding it (several: duplicated rows)
        self._exact: dict[str, dict[bytes, list[int]]] = {}
        for name, contents in self._columns.items():
            index = self._exact.setdefault(name, {})
            for i, c in enumerate(contents):
                index.setdefault(c.tobytes(), []).append(i)
        self._signature: inspect.Signature | None = None
        with contextlib.suppress(TypeError, ValueError):  # a forward without a signature
            self._signature = inspect.signature(model.forward)
        self._seen: set[int] = set()
        self._used: collections.Counter[bytes] = collections.Counter()
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    @staticmethod
    def _default_name(batch: Any) -> str:
        if isinstance(batch, Tensor):
            return "the batch tensor"
        if isinstance(batch, Mapping):
            ids = [str(k) for k, v in batch.items() if _is_ids(v)]
            return ", ".join(ids) if ids else next((str(k) for k in batch), "?")
        return "the batch's tensors"

    @staticmethod
    def _contents(batch: Any, key: str | None) -> dict[str, list[np.ndarray]]:
        """Per matchable column, each row's content."""
        if isinstance(batch, Tensor):
            columns: dict[str, Any] = {"": batch}
        elif isinstance(batch, Mapping):
            columns = {str(k): v for k, v in batch.items()}
        else:
            columns = {str(i): v for i, v in enumerate(batch)}
        if key is not None:
            columns = {key: columns[key]}
        out: dict[str, list[np.ndarray]] = {}
        # masks say which tokens count; they are not rows' contents (a mask of ones is in everything)
        ids = {n: v for n, v in columns.items() if _is_ids(v) and "mask" not in n}
        # Without an integer column, the first tensor is matched by exact value (features).
        chosen = ids or {n: v for n, v in list(columns.items())[:1] if isinstance(v, Tensor)}
        for name, t in chosen.items():
            t = t.detach().cpu()
            mask = _mask_for(name, columns, t) if name in ids and t.dim() >= 2 else None
            if name in ids:
                out[name] = [_strip(t[i], None if mask is None else mask[i]) for i in range(len(t))]
            else:  # a float tensor: each row's bytes
                out[name] = [t[i].contiguous().numpy().reshape(-1) for i in range(len(t))]
        return out

    def _named(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The forward's arguments by parameter name (positional ones bound to the signature)."""
        if self._signature is None or not args:
            return dict(kwargs)
        try:
            bound = self._signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return dict(kwargs)
        named: dict[str, Any] = {}
        for name, value in bound.items():
            kind = self._signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            elif kind is not inspect.Parameter.VAR_POSITIONAL:
                named[name] = value
        return named

    def _candidates(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Iterator[tuple[str, Tensor, Tensor | None]]:
        """(name, tensor, its mask) of what a forward received that could be rows of the batch."""
        kwargs = self._named(args, kwargs)
        containers: list[Mapping[str, Any]] = [kwargs]
        containers += [a for a in args if isinstance(a, Mapping)]
        containers += [v for v in kwargs.values() if isinstance(v, Mapping)]
        seen: set[int] = set()
        for where in containers:
            names = sorted(where, key=lambda n: (n not in (self.key_name, "input_ids"), str(n)))
            for name in names:
                t = where[name]
                if isinstance(t, Tensor) and id(t) not in seen and "mask" not in str(name):
                    seen.add(id(t))
                    mask = _mask_for(str(name), where, t) if _is_ids(t) and t.dim() >= 2 else None
                    yield str(name), t.detach().cpu(), mask
        for a in args:
            if isinstance(a, Tensor) and id(a) not in seen:
                seen.add(id(a))
                yield "", a.detach().cpu(), None

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._columns or in_backward() or not torch.is_grad_enabled():
            return
        self.forwards += 1
        for name, t, mask in self._candidates(args, kwargs):
            found = self._match(name, t, mask)
            if found is None:
                continue
            fresh = [r for r in dict.fromkeys(found) if r not in self._seen]
            if fresh:
                self._seen.update(fresh)
                self.calls.append(fresh)
            else:
                self.repeats += 1
            return
        self.missed += 1

    def _match(self, name: str, t: Tensor, mask: Tensor | None) -> list[int] | None:
        if t.dim() == 0 or len(t) == 0:
            return None
        ids = _is_ids(t)
        # the batch's column of the same name first (tokens are not matched to targets)
        order = sorted(self._exact, key=lambda c: c != name)
        used = collections.Counter(self._used)
        found = []
        for i in range(len(t)):
            if ids:
                row = _strip(t[i], None if mask is None else mask[i])
            else:
                row = t[i].contiguous().numpy().reshape(-1)
            r = self._exact_row(row, order, used) if len(row) else None
            if r is None and ids and self.key is None and t.dim() >= 2:
                r = self._contained_row(row)
            if r is None:
                return None
            found.append(r)
        self._used = used
        return found

    def _exact_row(
        self, row: np.ndarray, order: list[str], used: collections.Counter[bytes]
    ) -> int | None:
        key = row.tobytes()
        for column in order:
            options = self._exact[column].get(key)
            if options:
                # a duplicated row of the batch: the next of its copies each time it is seen
                k = used[column.encode() + key] % len(options)
                used[column.encode() + key] += 1
                return options[k]
        return None

    def _contained_row(self, row: np.ndarray) -> int | None:
        """The one batch row whose contents (of any column) this forward row contains the most of."""
        score: collections.Counter[int] = collections.Counter()
        for contents in self._columns.values():
            for i, c in enumerate(contents):
                if len(c) and c.dtype == np.int64 and _contains(row, c):
                    score[i] += len(c)
        ranked = score.most_common(2)
        if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
            return None  # nothing contained, or two rows as good: not this row's
        return ranked[0][0]

    def remove(self) -> None:
        """Remove the hook."""
        self._handle.remove()
