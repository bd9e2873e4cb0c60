"""Speculation policies: each round, the draft shape for the batch (or none: a plain decode step), chosen to
maximise the expected tokens per second (docs/e2e.md, "The speculation policy").

One shape per round for the whole batch: the round's kernels (build_tree, tree attention, verify, kv_accept,
the drafter's block) take [B, N] with one N, and each shape is one CUDA graph captured once; a request's own
acceptance enters through its expected tokens, summed over the batch.

AdaptivePolicy's model, per request b and draft depth j (a chain drafts one token a depth):

    q_bj = min(1, alpha_bj * c_bj / m_bj)     the chance the j-th draft is accepted once the j - 1 before it were
    E_b(S) = 1 + sum_{s=1..S} prod_{j<=s} q_bj  expected tokens a round of S drafts emits (the bonus token: the 1)
    rate(S) = sum_b E_b(S) / T(S)              over the requests still decoding (E_b(0) = 1: rate(0) is plain's)

- alpha_bj, the request's running acceptance at depth j: (w * prior_j + drafts accepted at depth j) / (w +
  drafts verification tested at depth j), prior_0 = `prior`, prior_j = alpha_b(j-1) (a depth never tested is
  expected to do as the one above it, not better), a draft tested when every draft before it was accepted (the
  maximum-likelihood rate of a chain whose drafts are accepted independently; per depth, since a drafter
  trained for a few steps does worse past them; the ORACLE's is p at every depth). The evidence decays by `forget` each round (plain
  rounds too), so a request that fell back to plain decoding drifts back to the optimistic prior and is probed
  again, at intervals that grow while the probes keep failing.
- c_bj / m_bj, the drafter's confidence (EAGLE-2's) against its usual: c_bj its top-1 probability at depth j
  given the draft before it (exp of the step in the chain's cumulative log-probability) as the last round that
  drafted depth j read it, m_bj the running mean of those readings. A draft the drafter is surer of than usual
  is expected to be accepted more often than the running rate says, and less when it is unsure (the ORACLE's
  confidence is always 1: the factor is 1). Each round that does not read c_bj (plain rounds, shorter chains)
  it relaxes halfway to m_bj, so one low reading does not keep a request in plain decoding until the next
  resume reads d_1 again.
- T, the cost table run_policy measures at start-up: one round of each shape, the plain round and the
  drafter's catch-up after plain rounds ("resume/8", "resume/R": 8 or R pending rows), each replayed from its
  own CUDA graph (on the CPU, and eager runs, timed eagerly); a shape chosen after plain rounds pays the
  smallest resume that holds them on top.

The chosen shape is the argmax of rate over the candidates: a further draft step is taken exactly when the
tokens it is expected to add are worth more than its cost at the rate without it (for a request b: E_b(S + 1)
- E_b(S) > E_b(S) (T(S + 1) - T(S)) / T(S), its expected gain above its cost); otherwise drafting stops there,
at 0 steps a plain decode step. A tree candidate (topk > 1) is valued as its top-1 chain, a lower bound on its
gain; the default candidates are chains.

The decisions are made at the loop's sync point between rounds, from a snapshot each round writes on the
device (counts, accepted drafts, the chain's cumulative log-probabilities) and the host reads through pinned
memory: on CUDA one round stale (the host decides round r + 1 while round r runs, from round r - 1's
snapshot), so the device never waits for a decision; nothing inside a round graph syncs.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Sequence

from .adaptive import PLAIN, label, resume_label, run_policy
from .decode import SpecConfig

MEAN_WEIGHT = 0.2  # of a new confidence reading in its running mean
RELAX = 0.5  # a round without a reading keeps this part of the last reading's distance from the mean


class Policy:
    """The interface run_policy drives. shapes(spec): the candidate SpecConfigs (spec's temperature and seed);
    start(B, costs, shapes): the cost table ({label: seconds a round}, with "resume/r") and the candidates run_policy
    built a graph for (shapes(spec), in order); observe(...): one round's
    outcome; choose(active, lag): the next round's shape, None for a plain decode step. resume_rows: plain
    rounds after which the drafter must catch up (the pending features' buffer, R rows a request)."""

    resume_rows = 64

    def run(self, loop, shapes, spec, start, prefill_seconds, prefill_times, progress):
        """generate_speculative's rounds under this policy (engine/adaptive.run_policy)."""
        return run_policy(loop, self, shapes, spec, start, prefill_seconds, prefill_times, progress)

    def shapes(self, spec: SpecConfig) -> list[SpecConfig]:
        raise NotImplementedError

    def start(self, B: int, costs: dict, shapes: Sequence[SpecConfig]) -> None:
        raise NotImplementedError

    def observe(self, spec: Optional[SpecConfig], active: Sequence[bool], accept_len: Sequence[int],
                scores: Optional[Sequence[Sequence[float]]], d1_logprob: Optional[Sequence[float]]) -> None:
        raise NotImplementedError

    def choose(self, active: Sequence[bool], lag: int) -> Optional[SpecConfig]:
        raise NotImplementedError


class AdaptivePolicy(Policy):
    """Expected tokens per second from measured costs, the drafter's confidence and each request's running
    acceptance (the module docstring has the model).

    Parameters
    ----------
    steps : sequence of int
        Chain lengths to choose from (drafts a round); plain decoding is always a candidate.
    prior : float
        alpha before any evidence (1: trust the drafter's confidence, so the first rounds speculate and
        measure).
    prior_weight : float
        The prior's weight, in tested drafts.
    forget : float
        Per round, the factor on the evidence (1: never forget; the default's half-life is ~140 rounds).
    resume_rows : int
        Plain rounds after which the drafter catches up on them (one drafter forward of this many rows).
    costs : dict, optional
        {label: seconds a round} (labels "plain", "resume/8", "resume/64", "3/1/4", ...) to use instead of the table measured at
        start-up (an engine's own profile; the tests' fixed numbers).
    """

    def __init__(self, steps: Sequence[int] = (1, 2, 3, 4, 5), prior: float = 1.0, prior_weight: float = 1.0,
                 forget: float = 0.995, resume_rows: int = 64, costs: Optional[dict] = None):
        if not steps or min(steps) < 1:
            raise ValueError(f"steps must be chain lengths >= 1, got {list(steps)}")
        if not (0 < prior <= 1 and prior_weight > 0 and 0 < forget <= 1 and resume_rows >= 1):
            raise ValueError(f"need 0 < prior <= 1, prior_weight > 0, 0 < forget <= 1, resume_rows >= 1; got "
                             f"{prior}, {prior_weight}, {forget}, {resume_rows}")
        self.steps, self.fixed_costs = sorted(set(int(s) for s in steps)), costs
        self.prior, self.prior_weight, self.forget, self.resume_rows = prior, prior_weight, forget, resume_rows
        self.observed = 0

    def shapes(self, spec: SpecConfig) -> list[SpecConfig]:
        return [replace(spec, steps=s, topk=1, num_tokens=s + 1) for s in self.steps]

    def start(self, B: int, costs: dict, shapes: Sequence[SpecConfig]) -> None:
        self.costs = dict(costs if self.fixed_costs is None else self.fixed_costs)
        self.B, self.observed, self._specs = B, 0, list(shapes)
        depth = max(self.steps)
        self.num = [[0.0] * depth for _ in range(B)]  # accepted drafts per depth (decayed)
        self.den = [[0.0] * depth for _ in range(B)]  # the confidence summed over the tested drafts per depth
        self.conf = [[1.0] * depth for _ in range(B)]  # c_bj, last read (relaxed toward mean while not read)
        self.mean = [[1.0] * depth for _ in range(B)]  # c_bj's running mean

    def alpha(self, b: int, j: int) -> float:
        """alpha_bj: depth 0's prior is `prior`, depth j's the estimate at depth j - 1."""
        w, a = self.prior_weight, self.prior
        for d in range(j + 1):
            a = (w * a + self.num[b][d]) / (w + self.den[b][d])
        return a

    def expected_tokens(self, b: int, steps: int) -> float:
        """E_b(steps): expected tokens a round of a `steps` chain emits for request b (1 for plain)."""
        e, run, a, w = 1.0, 1.0, self.prior, self.prior_weight
        for j in range(steps):
            a = (w * a + self.num[b][j]) / (w + self.den[b][j])  # alpha(b, j)
            run *= min(1.0, a * self.conf[b][j] / max(self.mean[b][j], 1e-6))
            e += run
        return e

    def observe(self, spec, active, accept_len, scores, d1_logprob) -> None:
        self.observed += 1
        for b in range(self.B):
            self.num[b] = [x * self.forget for x in self.num[b]]
            self.den[b] = [x * self.forget for x in self.den[b]]
            conf, mean = self.conf[b], self.mean[b]
            read = {}
            if d1_logprob is not None:
                read[0] = d1_logprob[b]
            if spec is not None and active[b]:
                prev = 0.0
                for j in range(spec.steps):  # the chain's step confidences, read this round
                    read[j] = scores[b][j] - prev
                    prev = scores[b][j]
            for j in range(len(conf)):
                if j in read:
                    conf[j] = math.exp(min(0.0, read[j]))
                    mean[j] += MEAN_WEIGHT * (conf[j] - mean[j])
                else:  # not read this round: what was read last is less telling
                    conf[j] = mean[j] + RELAX * (conf[j] - mean[j])
            if spec is None or not active[b]:
                continue
            a = int(accept_len[b])
            for j in range(min(a + 1, spec.steps)):  # draft j was tested: the j before it were accepted
                self.num[b][j] += j < a
                self.den[b][j] += 1.0

    def rate(self, spec: Optional[SpecConfig], active: Sequence[bool], lag: int) -> float:
        """Expected tokens per second of the next round with this shape (None: plain), over the requests still
        decoding."""
        cost = self.costs[label(spec)] + (self.costs[resume_label(lag, self.resume_rows)] if lag and spec is not None
                                          else 0.0)
        steps = 0 if spec is None else spec.steps
        return sum(self.expected_tokens(b, steps) for b in range(self.B) if active[b]) / cost

    def choose(self, active, lag):
        best, best_rate = None, self.rate(None, active, lag)
        for spec in self._specs:
            r = self.rate(spec, active, lag)
            if r > best_rate:
                best, best_rate = spec, r
        return best


__all__ = ["AdaptivePolicy", "PLAIN", "Policy", "label"]
