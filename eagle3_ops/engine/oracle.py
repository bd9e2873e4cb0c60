"""An ORACLE drafter: acceptance under control where no trained drafter exists (Kimi scale, synthesised weights).

It wraps a real Drafter, whose forwards run at their real cost and whose hidden states are passed on, and
replaces its scores. A drafter row at position i holds token x_{i+1} (EAGLE-3's shift: its feature is the
target's at i) and predicts x_{i+2}; the oracle proposes the token the target itself emits there, read
from a reference sequence (the prompt plus the target's plain greedy continuation, so it knows the answer),
corrupted with probability 1 - p into a different token. So under greedy verification a chain of s draft
steps accepts p + p^2 + ... + p^s tokens on average, and p = 0 is the adversarial drafter whose every
proposal is rejected (in a tree too: there the right token is its lowest-scored candidate). Its acceptance
says nothing about any real drafter: every output that uses it must say "oracle".

The draws (keep or corrupt, and the corrupting token) are drawn once, at construction, from a seeded
generator into small tables indexed by (request, position, the drafter's call count mod a period): a
forward reads them with a few gathers on the device (no host sync, capturable in a CUDA graph) and a
position proposed again draws anew. The oracle's own work per forward stays a handful of kernels, so the
drafter's measured forward time is the real drafter's (an earlier on-device integer hash took ~100 small
kernels a forward).
"""

from __future__ import annotations

import torch
from torch import Tensor

_TWO24 = 2**24


class OracleDrafter:
    """ORACLE drafter (labelled): ``drafter``'s forwards and features, proposals from ``reference``.

    Parameters
    ----------
    drafter : Drafter
        The real drafter (synthesised weights are fine): run for its cost and hidden states.
    reference : Tensor [B, L] int64
        Per request, the prompt then the target's greedy continuation (generate_plain's output).
    p : float
        Probability that a proposal is the target's own next token; 0 is the adversarial drafter.
    vocab_size : int
        The target's vocabulary (the oracle proposes target ids directly).
    seed : int
        Of the draws.
    start : int
        The first position whose draws matter (the prompt's last, T0 - 1: the rows before it propose nothing
        that is used); the draw tables cover positions start .. L + 1, B x (L - start + 2) x period entries.
    period : int
        Calls after which the draws repeat (a run's drafter forwards: prefill chunks, then a few a round).
    """

    label = "ORACLE drafter"

    def __init__(self, drafter, reference: Tensor, p: float, vocab_size: int, seed: int = 0, start: int = 0,
                 period: int = 512):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        if not 2 <= vocab_size <= _TWO24:
            raise ValueError(f"vocab_size must be in [2, 2^24] (the scores are distinct 24-bit fractions), got "
                             f"{vocab_size}")
        if reference.dim() != 2 or reference.dtype != torch.int64:
            raise ValueError(f"reference must be [B, L] int64, got {tuple(reference.shape)} {reference.dtype}")
        if not 0 <= start < reference.shape[1] or period < 1:
            raise ValueError(f"start must be in [0, L = {reference.shape[1]}) and period >= 1, got {start}, {period}")
        self.drafter, self.reference, self.p, self.vocab_size, self.seed = drafter, reference, p, vocab_size, seed
        self.cfg = drafter.cfg if drafter is not None else None
        self.calls = torch.zeros((), dtype=torch.int64, device=reference.device)  # bumped in place (graph-safe)
        # draws per (request, position start.. L + 1, call mod period); positions before start share start's
        B, W = reference.shape[0], reference.shape[1] - start + 2
        self.start, self.period = start, period
        gen = torch.Generator().manual_seed(seed)
        self._keep = (torch.rand(B, W * period, generator=gen) < p).to(reference.device)
        self._shift = torch.randint(1, vocab_size, (B, W * period), generator=gen).to(reference.device)  # never 0
        self._score = None  # [V] int64: the ids' scrambled scores (before each row's salt), made on first use
    def graph_state(self) -> list:
        """The tensors its forward updates in place (the call count): a CUDA graph's warm-up calls restore them,
        so graphed and eager runs draw alike."""
        return [self.calls]

    def after_cached_prefill(self, chunks: int, positions: Tensor) -> Tensor:
        """A run started from a PrefillCache: the scores [B, V] the prefill's last forward would have given at
        positions [B, 1], the call count left as after its `chunks` forwards (so the draws match a run that
        prefilled)."""
        self.calls += chunks - 1
        return self.scores(positions)

    def new_kv(self, *args, **kwargs):
        return self.drafter.new_kv(*args, **kwargs)

    def project(self, *args, **kwargs):
        return self.drafter.project(*args, **kwargs)

    def project_train(self, *args, **kwargs):
        return self.drafter.project_train(*args, **kwargs)

    def to_target_ids(self, ids: Tensor) -> Tensor:
        return ids  # the oracle's vocabulary is the target's

    def _wanted(self, positions: Tensor) -> Tensor:
        """[B, n] positions -> reference[b, i + 2], the token the target emits there."""
        return self.reference.gather(1, (positions + 2).clamp(0, self.reference.shape[1] - 1))

    def proposals(self, positions: Tensor) -> Tensor:
        """[B, n] positions -> [B, n] int64 target tokens: reference[b, i + 2], or with probability 1 - p
        another token."""
        want = self._wanted(positions)
        W = self._keep.shape[1] // self.period
        idx = (positions - self.start).clamp(0, W - 1) * self.period + self.calls % self.period
        return torch.where(self._keep.gather(1, idx), want, (want + self._shift.gather(1, idx)) % self.vocab_size)

    def forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor, kv, tree_mask: Tensor):
        """The drafter's forward (its KV written, its hidden returned), scores replaced: logits [B * n, V] fp32,
        the proposal at 30, every other token at a distinct pseudo-random value in [0, 1) (so a tree's other
        candidates are ranked, never tied, and a child scores strictly below its parent)."""
        _, hidden = self.drafter.forward(tokens, hidden, positions, kv, tree_mask)
        return self.scores(positions), hidden

    def scores(self, positions: Tensor) -> Tensor:
        """The oracle's own work in a forward (its cost is none of the real drafter's): the scores [B * n, V]
        for [B, n] positions, the call count bumped."""
        pick = self.proposals(positions)
        self.calls += 1
        # (id * odd + salt) mod 2^24 is a bijection of the ids: distinct values, exact in fp32 (a sin-based hash
        # took ~0.12 ms a call at 163840 ids on the H200, its large arguments on the slow path)
        if self._score is None or self._score.device != pick.device:
            self._score = torch.arange(self.vocab_size, device=pick.device, dtype=torch.int64) * 2654435761 % _TWO24
        salt = positions.reshape(-1, 1).long() * 78233 + self.calls * 12347
        logits = ((self._score + salt) % _TWO24).float() / _TWO24
        logits.scatter_(1, pick.reshape(-1, 1), 30.0)
        if self.p == 0.0:  # the adversarial drafter: no candidate of a tree is ever the right token either
            logits.scatter_(1, self._wanted(positions).reshape(-1, 1), -1.0)
        return logits


def acceptance_length(p: float, steps: int = 3) -> float:
    """The oracle's expected acceptance length (tokens a round emits, accepted drafts + 1) for a chain of
    `steps` drafts under greedy verification: L(p) = 1 + p + p^2 + ... + p^steps = (1 - p^(steps + 1)) / (1 - p).
    Its accept rate as SGLang and vLLM report it (accepted drafts / drafted tokens) is (L - 1) / steps."""
    if not 0.0 <= p <= 1.0 or steps < 1:
        raise ValueError(f"need p in [0, 1] and steps >= 1, got p={p}, steps={steps}")
    return 1.0 + sum(p ** s for s in range(1, steps + 1))


def p_for_acceptance_length(length: float, steps: int = 3) -> float:
    """The p at which the oracle's chain of `steps` drafts has acceptance length `length` (the inverse of
    acceptance_length: L(p) rises strictly from 1 at p = 0 to steps + 1 at p = 1, so the root is unique; found
    by bisection to 1e-12). The seed deployment's "acceptance ~47%" at 3 steps is L = 1 + 3 x 0.47 = 2.41,
    p ~ 0.70, not p = 0.47."""
    if not 1.0 <= length <= steps + 1:
        raise ValueError(f"an acceptance length of a {steps}-draft chain is in [1, {steps + 1}], got {length}")
    if length in (1.0, steps + 1.0):
        return 0.0 if length == 1.0 else 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if acceptance_length(mid, steps) < length else (lo, mid)
    return (lo + hi) / 2


__all__ = ["OracleDrafter", "acceptance_length", "p_for_acceptance_length"]
