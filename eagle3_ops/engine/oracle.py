"""An ORACLE drafter: acceptance under control where no trained drafter exists (Kimi scale, synthesised weights).

It wraps a real Drafter, whose forwards run at their real cost and whose hidden states are passed on, and
replaces its scores. A drafter row at position i holds token x_{i+1} (EAGLE-3's shift: its feature is the
target's at i) and predicts x_{i+2}; the oracle proposes the token the target itself emits there, read
from a reference sequence (the prompt plus the target's plain greedy continuation, so it knows the answer),
corrupted with probability 1 - p into a different token. So under greedy verification a chain of s draft
steps accepts p + p^2 + ... + p^s tokens on average, and p = 0 is the adversarial drafter whose every
proposal is rejected. Its acceptance says nothing about any real drafter: every output that uses it must say
"oracle".

The corruption draws are a hash of (request, position, the drafter's call count, seed) on the device: no
host sync, and a new draw each time a position is proposed again.
"""

from __future__ import annotations

import torch
from torch import Tensor

_TWO31 = 2**31
_TWO24 = 2**24


def _mix(h: Tensor) -> Tensor:
    """A bijective non-linear scramble of int64 values in [0, 2^31) (xor-shifts between odd multiplies mod 2^31;
    products stay below 2^62, so nothing overflows)."""
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) % _TWO31
    h = h ^ (h >> 12)
    h = (h * 0x297A2D39) % _TWO31
    return h ^ (h >> 15)


def _uniform_hash(*parts: Tensor) -> Tensor:
    """Deterministic pseudo-random int64 in [0, 2^31) per element, from small non-negative integer inputs.
    Every input goes through the non-linear _mix: an affine hash (only multiplies and adds mod 2^31) gives
    draws at (position + 1, calls + c) that are a fixed shift of the draws at (position, calls), so the
    keep / corrupt draws of one chain's steps were strongly correlated (p = 0.47 never accepted two tokens)."""
    h = torch.zeros_like(parts[0])
    for i, p in enumerate(parts):
        h = _mix((h + (p % _TWO31) * (2 * i + 1) + 0x5BD1E995) % _TWO31)
    return _mix(h)


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
    """

    label = "ORACLE drafter"

    def __init__(self, drafter, reference: Tensor, p: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        if not 2 <= vocab_size <= _TWO24:
            raise ValueError(f"vocab_size must be in [2, 2^24] (the scores are distinct 24-bit fractions), got "
                             f"{vocab_size}")
        if reference.dim() != 2 or reference.dtype != torch.int64:
            raise ValueError(f"reference must be [B, L] int64, got {tuple(reference.shape)} {reference.dtype}")
        self.drafter, self.reference, self.p, self.vocab_size, self.seed = drafter, reference, p, vocab_size, seed
        self.cfg = drafter.cfg if drafter is not None else None
        self.calls = torch.zeros((), dtype=torch.int64, device=reference.device)  # bumped in place (graph-safe)

    def new_kv(self, *args, **kwargs):
        return self.drafter.new_kv(*args, **kwargs)

    def project(self, *args, **kwargs):
        return self.drafter.project(*args, **kwargs)

    def project_train(self, *args, **kwargs):
        return self.drafter.project_train(*args, **kwargs)

    def to_target_ids(self, ids: Tensor) -> Tensor:
        return ids  # the oracle's vocabulary is the target's

    def proposals(self, positions: Tensor) -> Tensor:
        """[B, n] positions -> [B, n] int64 target tokens: reference[b, i + 2], or with probability 1 - p
        another token."""
        B, n = positions.shape
        L = self.reference.shape[1]
        want = self.reference.gather(1, (positions + 2).clamp(0, L - 1))
        b = torch.arange(B, device=positions.device)[:, None].expand(B, n)
        h = _uniform_hash(b, positions.long(), self.calls.expand(B, n), torch.full_like(b, self.seed))
        keep = h.double() / _TWO31 < self.p
        other = (want + 1 + _uniform_hash(h) % (self.vocab_size - 1)) % self.vocab_size  # never `want`
        return torch.where(keep, want, other)

    def forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor, kv, tree_mask: Tensor):
        """The drafter's forward (its KV written, its hidden returned), scores replaced: logits [B * n, V] fp32,
        the proposal at 30, every other token at a distinct pseudo-random value in [0, 1) (so a tree's other
        candidates are ranked, never tied, and a child scores strictly below its parent)."""
        _, hidden = self.drafter.forward(tokens, hidden, positions, kv, tree_mask)
        pick = self.proposals(positions)
        self.calls += 1
        # (id * odd + salt) mod 2^24 is a bijection of the ids: distinct values, exact in fp32 (a sin-based hash
        # took ~0.12 ms a call at 163840 ids on the H200, its large arguments on the slow path)
        ids = torch.arange(self.vocab_size, device=pick.device, dtype=torch.int64)
        salt = positions.reshape(-1, 1).long() * 78233 + self.calls * 12347
        logits = ((ids * 2654435761 + salt) % _TWO24).float() / _TWO24
        logits.scatter_(1, pick.reshape(-1, 1), 30.0)
        return logits, hidden


__all__ = ["OracleDrafter"]
