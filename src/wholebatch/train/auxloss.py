"""Auxiliary losses whose statistics are the whole batch's: MoE load balancing, router z-loss.

    class MoE(nn.Module):
        def __init__(self, d, experts):
            ...
            self.balance = wholebatch.LoadBalancingLoss(experts, top_k=2, alpha=1e-2)
            self.z_loss = wholebatch.RouterZLoss(beta=1e-3)

        def forward(self, x_TD, mask_T=None):
            logits_TE = self.router(x_TD)
            probs_TE = logits_TE.softmax(-1)
            top_TK = probs_TE.topk(2, dim=-1).indices
            out_TD = ...                                    # the experts' combined output
            out_TD = self.balance(out_TD, probs_TE, top_TK, mask_T)
            return self.z_loss(out_TD, logits_TE, mask_T)

    acc = wholebatch.Accumulator(model, opt)                # finds the terms in the model
    stats = acc.step(micro_batches, loss_fn)                # + every term over the whole batch
    stats.aux                                               # {"layers.0.balance": ..., ...}

The load-balancing loss (Switch, GShard) of one router is α·E·Σₑ fₑ·Pₑ over the
whole batch (every micro-batch, every rank): fₑ the fraction of the batch's k·T
routing assignments that went to expert e, Pₑ the mean router probability of e
over its T tokens. Computed per micro-batch and per rank (almost everywhere),
fₑ and Pₑ are the micro-batch's: another loss. fₑ over the whole batch is known
only after every micro-batch's router has run, yet the backward of each
micro-batch needs it.

How: L = Σₑ (α·E·fₑ/T) · Sₑ with Sₑ = Σ_t p_{t,e}: linear in the routed
probabilities' sums once the counts are known, and fₑ carries no gradient. The
`Accumulator` runs a counting pass: micro-batches 0..K-2 forward under `no_grad`
(the RNG recorded before each), micro-batch K-1 forward with its graph kept; the
routers report their counts (and the main loss its items) as they run. One small
all-gather agrees them; then micro-batch K-1 back-propagates, and 0..K-2 run
again with their RNG restored and back-propagate. Each term injects dL/dSₑ =
α·E·fₑ/T (times the step's constant) into its router's probabilities through the
layer output it passes through, so activation checkpointing (reentrant or not)
recomputes it like any other op. Cost: K-1 extra forwards without graph and one
small all-gather per step, memory of one micro-batch; nothing extra for K = 1.
Why not a deferred correction, linear in fₑ: the correction Σₑ δₑ·∇Sₑ needs
each expert's gradient of the whole network (E gradient buffers) or a second
forward and backward of every micro-batch; docs/accumulation.md measures both
against the counting pass.

The replay must route as the first pass did: each term compares its counts and
a step whose routing changed (a non-deterministic model) is the same error on
every rank. A term outside an `Accumulator` step (evaluation, a one-process
reference) computes its loss over the tokens of that call alone into `.loss`
(differentiable), and returns its input unchanged.

Legend: T tokens of a call (or of the whole batch), E experts, k experts per token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from wholebatch.errors import WholebatchError

__all__ = [
    "LoadBalancingLoss",
    "RouterZLoss",
    "TermStep",
    "WholeBatchTerm",
    "find_terms",
    "refuse_terms",
]


@dataclasses.dataclass
class _State:
    """A term's part of one engine step."""

    k: int
    records: list[Tensor | None]  # per micro-batch: the counts of pass 1
    sums: list[Tensor | None]  # per micro-batch: Sₑ (detached) of pass 1
    micro_batch: int = -1
    phase: str = "idle"  # "forward" (pass 1), "replay" (pass 2's forward), "backward"
    called: bool = False  # in this forward
    coef: Tensor | None = None  # dL/dS for the backward, the step's constant included
    plain: Tensor | None = None  # dL/dS itself (the loss's value)
    error: str | None = None


class _Attach(torch.autograd.Function):
    """Identity on `x`; backward also hands `sums` the term's agreed dL/dS."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sums: Tensor, term: WholeBatchTerm) -> Tensor:  # type: ignore[override]
        ctx.term = term
        ctx.like = (sums.shape, sums.dtype, sums.device)
        return x  # as-is (a view): do not modify the layer's output in place

    @staticmethod
    def backward(ctx: Any, grad_x: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        term: WholeBatchTerm = ctx.term
        shape, dtype, device = ctx.like
        state = term._state
        if state is None or state.coef is None:
            raise WholebatchError(
                f"{type(term).__name__}: backward reached the term outside the Accumulator "
                "step that agreed its statistics (a second backward of a step's graph?)"
            )
        return grad_x, state.coef.to(device=device, dtype=dtype).reshape(shape), None


class WholeBatchTerm(nn.Module):
    """An auxiliary loss Σ_j c_j(counts) · S_j: linear in differentiable sums S over the
    batch's tokens, with coefficients c from counts that carry no gradient.

    A subclass computes, per call, its counts (a 1-D float64 vector) and sums (a 1-D
    tensor with the graph) and says how the whole batch's counts make the
    coefficients (`coefficients`). Inside an `Accumulator` step the counts are agreed
    over every micro-batch and rank before any backward; outside it, `.loss` holds the
    call's own loss.
    """

    _state: _State | None

    def __init__(self) -> None:
        super().__init__()
        self._state = None
        self.loss: Tensor | None = None
        """The loss over the last call's tokens when called outside an engine step."""

    # -- what a subclass defines -------------------------------------------------

    @property
    def width(self) -> int:
        """How many counts the term agrees per step."""
        raise NotImplementedError

    @property
    def sums_width(self) -> int:
        """How many differentiable sums S it has (the length of `coefficients`)."""
        raise NotImplementedError

    def coefficients(self, counts: Tensor) -> Tensor:
        """dL/dS from counts summed over the whole batch (float64); zeros when it holds nothing."""
        raise NotImplementedError

    # -- the call ---------------------------------------------------------------------

    def _account(self, x: Tensor, counts: Tensor, sums: Tensor) -> Tensor:
        state = self._state
        if state is None:  # outside an engine step: this call's own statistics
            self.loss = (self.coefficients(counts).to(sums.dtype) * sums).sum()
            return x
        if state.phase == "backward":  # recomputed inside backward (activation checkpointing)
            return _Attach.apply(x, sums, self) if torch.is_grad_enabled() else x  # type: ignore[no-untyped-call,no-any-return]  # torch.autograd.Function.apply is untyped
        i = state.micro_batch
        if state.called:
            state.error = state.error or (
                f"{type(self).__name__} was called twice in one forward; give each router "
                "its own term module (each router's counts are its own)"
            )
        state.called = True
        counts = counts.detach().to(torch.float64)
        if state.phase == "replay":
            before = state.records[i]
            if before is None or not torch.equal(before, counts.to(before.device)):
                state.error = state.error or (
                    f"{type(self).__name__}: micro-batch {i} routed differently when it ran "
                    "again (its counts changed); the model must be deterministic given the RNG "
                    "state (the counts agreed before the backward are the first pass's)"
                )
        else:
            state.records[i] = counts
            state.sums[i] = sums.detach().to(torch.float64)
        if not torch.is_grad_enabled():
            return x
        if not x.requires_grad:
            state.error = state.error or (
                f"{type(self).__name__}: its input x does not require grad, so the term's "
                "gradient could not reach the router; pass the layer's output through it"
            )
            return x
        return _Attach.apply(x, sums, self)  # type: ignore[no-untyped-call,no-any-return]  # torch.autograd.Function.apply is untyped


def _mask(mask_T: Tensor | None, t: int, device: torch.device) -> Tensor:
    if mask_T is None:
        return torch.ones(t, dtype=torch.bool, device=device)
    return mask_T.reshape(-1).to(device=device, dtype=torch.bool)


class LoadBalancingLoss(WholeBatchTerm):
    """α·E·Σₑ fₑ·Pₑ over the whole batch (Switch Transformer; GShard for top_k = 2).

    fₑ = (assignments to e) / (k·T) over the batch's T routed tokens (Σₑ fₑ = 1, so a
    perfectly balanced router gives α; Hugging Face's Mixtral loss sums over the k
    slots instead: its coefficient is α·k), Pₑ = (1/T) Σ_t p_{t,e}. Gradient: dL/dp_{t,e}
    = α·E·fₑ/T for every routed token, fₑ carrying none.

    Args:
        num_experts: E.
        top_k: k, experts per token.
        alpha: α.
    """

    def __init__(self, num_experts: int, *, top_k: int = 1, alpha: float = 1e-2) -> None:
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise WholebatchError(
                f"LoadBalancingLoss: num_experts={num_experts!r} must be an int >= 1"
            )
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise WholebatchError(
                f"LoadBalancingLoss: top_k={top_k!r} must be an int in 1..num_experts={num_experts}"
            )
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha)):
            raise WholebatchError(f"LoadBalancingLoss: alpha={alpha!r} must be a finite number")
        self.num_experts, self.top_k, self.alpha = num_experts, top_k, float(alpha)

    @property
    def width(self) -> int:
        return self.num_experts + 1  # assignments per expert, routed tokens

    @property
    def sums_width(self) -> int:
        return self.num_experts  # Σ_t p_{t,e}

    def coefficients(self, counts: Tensor) -> Tensor:
        e = self.num_experts
        tokens = counts[e]
        if float(tokens) == 0:
            return torch.zeros(e, dtype=torch.float64, device=counts.device)
        f_E = counts[:e] / (self.top_k * tokens)
        return self.alpha * e * f_E / tokens

    def forward(
        self, x: Tensor, probs_TE: Tensor, experts_TK: Tensor, mask_T: Tensor | None = None
    ) -> Tensor:
        """Pass `x` (the layer's output) through; account for this call's routing.

        Args:
            x: the MoE layer's output (returned unchanged: do not modify it in place).
            probs_TE: the router's probabilities over the E experts (softmax), any leading
                dims flattened to T tokens.
            experts_TK: the k experts each token was sent to (long), same leading dims.
            mask_T: which tokens count (padding excluded); None: all.
        """
        e = self.num_experts
        p_TE = probs_TE.reshape(-1, e)
        idx_TK = experts_TK.reshape(p_TE.shape[0], -1)
        if idx_TK.shape[1] != self.top_k:
            raise WholebatchError(
                f"LoadBalancingLoss: experts_TK has {idx_TK.shape[1]} experts per token, "
                f"top_k={self.top_k}"
            )
        m_T = _mask(mask_T, p_TE.shape[0], p_TE.device)
        with torch.no_grad():
            hits_E = torch.zeros(e, dtype=torch.float64, device=p_TE.device)
            hits_E.index_add_(
                0, idx_TK[m_T].reshape(-1), torch.ones(int(m_T.sum()) * self.top_k,
                                                      dtype=torch.float64, device=p_TE.device)
            )  # fmt: skip
            counts = torch.cat([hits_E, m_T.sum().reshape(1).to(torch.float64)])
        sums_E = (p_TE * m_T[:, None].to(p_TE.dtype)).sum(0)
        return self._account(x, counts, sums_E)


class RouterZLoss(WholeBatchTerm):
    """β·(1/T)·Σ_t (logsumexp_e z_{t,e})² over the whole batch's T routed tokens (ST-MoE).

    A token mean: its only whole-batch statistic is T. Gradient: dL/dz_{t,e} =
    (2β/T)·lse_t·softmax(z_t)_e.

    Args:
        beta: β.
    """

    def __init__(self, *, beta: float = 1e-3) -> None:
        super().__init__()
        if not (isinstance(beta, (int, float)) and math.isfinite(beta)):
            raise WholebatchError(f"RouterZLoss: beta={beta!r} must be a finite number")
        self.beta = float(beta)

    @property
    def width(self) -> int:
        return 1  # routed tokens

    @property
    def sums_width(self) -> int:
        return 1  # Σ_t lse_t²

    def coefficients(self, counts: Tensor) -> Tensor:
        tokens = counts[0]
        if float(tokens) == 0:
            return torch.zeros(1, dtype=torch.float64, device=counts.device)
        return (self.beta / tokens).reshape(1)

    def forward(self, x: Tensor, logits_TE: Tensor, mask_T: Tensor | None = None) -> Tensor:
        """Pass `x` through; account for this call's router logits (`mask_T`: tokens that count)."""
        z_TE = logits_TE.reshape(-1, logits_TE.shape[-1])
        m_T = _mask(mask_T, z_TE.shape[0], z_TE.device)
        lse_T = torch.logsumexp(z_TE, dim=-1)
        sums = (lse_T.square() * m_T.to(lse_T.dtype)).sum().reshape(1)
        counts = m_T.sum().reshape(1).to(torch.float64)
        return self._account(x, counts, sums)


def find_terms(model: nn.Module) -> list[tuple[str, WholeBatchTerm]]:
    """Every `WholeBatchTerm` in `model`, with its name, in `named_modules` order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, WholeBatchTerm)]


def refuse_terms(model: nn.Module, op: str) -> None:
    """Raise when `model` holds whole-batch terms that engine `op` does not run: each would
    compute its own call's loss into `.loss` and add nothing to the gradient, silently."""
    names = [n for n, _ in find_terms(model)]
    if names:
        raise WholebatchError(
            f"{op}: the model holds whole-batch auxiliary terms ({', '.join(names)}), which "
            f"{op.split('.')[0]} does not run over the whole batch (their gradient would be "
            "missing); train it with wholebatch.Accumulator, which counts them in a pass "
            "before the backward"
        )


class TermStep:
    """The terms' side of one step: which pass runs, their counts, their coefficients.

    The engine (`Accumulator`) drives it: `pass1(i)` / `replay(i)` around each forward,
    `backward()` around each backward, `fields()` for the agreement, `agree(totals,
    scale)` once the counts of every micro-batch and rank are known, `close()` at the end.
    """

    def __init__(self, terms: Sequence[tuple[str, WholeBatchTerm]], k: int) -> None:
        self.terms = list(terms)
        for name, term in self.terms:
            if term._state is not None:
                raise WholebatchError(
                    f"{type(term).__name__} {name!r} is already in another step (nested steps?)"
                )
            term._state = _State(k=k, records=[None] * k, sums=[None] * k)

    def _states(self) -> list[_State]:
        out = []
        for _, term in self.terms:
            assert term._state is not None
            out.append(term._state)
        return out

    @contextlib.contextmanager
    def _phase(self, phase: str, i: int = -1) -> Iterator[None]:
        for state in self._states():
            state.phase, state.micro_batch, state.called = phase, i, False
        try:
            yield
        finally:
            for state in self._states():
                state.phase = "idle"

    def pass1(self, i: int) -> contextlib.AbstractContextManager[None]:
        """Micro-batch i's first forward: the terms record their counts."""
        return self._phase("forward", i)

    def replay(self, i: int) -> contextlib.AbstractContextManager[None]:
        """Micro-batch i's second forward: the terms check their counts again."""
        return self._phase("replay", i)

    def backward(self) -> contextlib.AbstractContextManager[None]:
        """A backward: forwards recomputed inside it (checkpointing) record nothing."""
        return self._phase("backward")

    def fields(self) -> dict[str, Tensor]:
        """This rank's counts and sums of every term over its micro-batches (for the agreement)."""
        row: dict[str, Tensor] = {}
        for j, ((_, term), state) in enumerate(zip(self.terms, self._states(), strict=True)):
            counts = torch.zeros(term.width, dtype=torch.float64)
            sums: Tensor | None = None
            for c, s in zip(state.records, state.sums, strict=True):
                if c is not None:
                    counts = counts + c.cpu()
                if s is not None:
                    sums = s.cpu() if sums is None else sums + s.cpu()
            row[f"term{j} counts"] = counts
            empty = torch.zeros(term.sums_width, dtype=torch.float64)
            row[f"term{j} sums"] = sums if sums is not None else empty
        return row

    def error(self) -> str | None:
        """The first error any term met on this rank, or None."""
        return next((s.error for s in self._states() if s.error is not None), None)

    def agree(self, counts: Sequence[Tensor], sums: Sequence[Tensor], scale: float) -> list[float]:
        """Set each term's dL/dS (times `scale`, the step's constant) from the whole batch's
        counts; returns each term's loss over the whole batch (its sums summed too)."""
        values = []
        for (_, term), state, c, s in zip(self.terms, self._states(), counts, sums, strict=True):
            coef = term.coefficients(c.to(torch.float64))
            state.coef, state.plain = coef * scale, coef
            values.append(float((coef * s.to(torch.float64)).sum()))
        return values

    def shares(self) -> Tensor:
        """This rank's part of the terms' loss: Σ_j coef_j · (its S_j), float64 (after `agree`)."""
        total = torch.zeros((), dtype=torch.float64)
        for state in self._states():
            assert state.plain is not None
            for s in state.sums:
                if s is not None:
                    total = total + (state.plain.cpu() * s.cpu()).sum()
        return total

    def close(self) -> None:
        """End the step: the terms return to computing their own calls' loss."""
        for _, term in self.terms:
            term._state = None
