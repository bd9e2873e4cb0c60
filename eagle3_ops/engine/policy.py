"""Speculation policies: each round, the draft shape for the batch (or none: a plain decode step), chosen to
maximise the expected tokens per second (docs/e2e.md, "The speculation policy").

One shape per round for the whole batch: the round's kernels (build_tree, tree attention, verify, kv_accept,
the drafter's block) take [B, N] with one N, and each shape is one CUDA graph captured once; a request's own
acceptance enters through its expected tokens, summed over the batch.

AdaptivePolicy's model, per request b and draft depth j (a chain drafts one token a depth):

    q_bj = min(1, alpha_bj * c_bj / m_bj)     the chance the j-th draft is accepted once the j - 1 before it were
    E_b(S) = 1 + sum_{s=1..min(S, r_b - 1)} prod_{j<=s} q_bj
                                              expected tokens a round of S drafts emits for b (the bonus token: the
                                              1), r_b the tokens b has left (tokens past its max_new are cut)
    rate(S) = sum_b E_b(S) / T(S)              over the requests still decoding (E_b(0) = 1: rate(0) is plain's);
                                              after plain rounds T(S) has the resume on top, spread over the rounds
                                              the chain can run before the longest request is done (at most R)

- alpha_bj, the request's running acceptance at depth j, in two steps: pi_bj = (w * prior_bj + the other
  requests' drafts accepted at depth j) / (w + theirs tested there), then alpha_bj = (v * pi_bj + b's own
  accepted) / (v + b's own tested) (w = `prior_weight`, v = `request_weight`; at B 1 pi_bj = prior_bj), prior_b0
  = `prior`, prior_bj = alpha_b(j-1) (a depth never tested is expected to do as the one above it, not better):
  at B 8 one round informs every request, and a request's own record still counts; a draft is tested when
  every draft before it was accepted (the
  maximum-likelihood rate of a chain whose drafts are accepted independently; per depth, since a drafter
  trained for a few steps does worse past them; the ORACLE's is p at every depth). The prior is optimistic
  (1): one accepted probe is enough to draft the longest chain the costs pay for. The evidence decays by
  `forget` each round (plain rounds too), so a request that fell back to plain decoding drifts back to the
  prior and is probed again, at intervals that grow while the probes keep failing; the re-probe is the shape
  whose rate first passes plain's as the estimate rises, the one that needs the least acceptance to pay for
  itself (the cheapest chain where costs grow with N).
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

The chosen shape is the argmax of rate over the candidates the budget below allows: a further draft step is
taken exactly when the tokens it is expected to add are worth more than its cost at the rate without it (for
a request b: E_b(S + 1) - E_b(S) > E_b(S) (T(S + 1) - T(S)) / T(S)); otherwise drafting stops there, at 0
steps a plain decode step. A tree candidate (topk > 1) is valued as its top-1 chain, a lower bound on its gain;
the default candidates are chains.

The first probe. Before any evidence the optimistic prior would value every chain at S + 1 tokens and start
with the longest, the most expensive round to lose (at p = 0 on the H200 at B 1, 5/1/6: 8.7 ms against a
2.26 ms plain step). The first round is valued instead under an uninformative prior that prices its cost: the
acceptance alpha ~ Uniform(0, 1), shared by the depths, so the first s drafts are all accepted with
probability E[alpha^s] = 1 / (s + 1) and a chain of S drafts is expected to emit H_{S+1} = 1 + 1/2 + ... +
1/(S + 1) tokens; the probe is the chain maximising sum_b H_{S+1} / T(S) (on the H200's B 1 table 1/1/2, 1.5
tokens for 3.7 ms; where the verify forward dominates the round, e.g. the full model's costs, a longer one).
Plain decoding is not a candidate of the first round: under this prior it can be the better bet, but it
teaches nothing. The decision after the probe waits for its outcome (adaptive.run_policy blocks on it).

The budget: the regret bound. The policy keeps the run's regret against plain decoding in the cost table's
terms, R = sum over the rounds so far of (T(round) + T(its resume) - T(plain) * tokens emitted / requests
decoding), a round in flight counted at its worst (every draft rejected: one token a request, excess
T(S) + T(resume) - T(plain)). A speculative shape is a candidate only if R with its own worst case added stays
within A + eps * T(plain) * n (n: rounds so far, this one included; A = max_S T(S) + T(resume/R) - T(plain),
the dearest round's excess, so the first probe and the longest chain after one accepted probe are always
affordable; eps = `budget`). Accepted drafts lower R (a round that emits more than a plain step's share is a
credit), so the budget binds only where speculation loses. Hence, at any acceptance and after any n rounds,

    R_n <= A + eps * T(plain) * n + F_n        (F_n: the forced catch-ups, resume/R every R plain rounds in a row)

and at p = 0 (every draft rejected: each round emits one token a request, the batch in lockstep) a run of n
rounds takes, in the cost table's terms, at most plain's n * T(plain) plus A + eps * n * T(plain) + F_n: at least
1 / (1 + eps + (A + F_n) / (n T(plain))) of plain decoding's speed. That is the guarantee; the model does
better: at p = 0 the probe's rejection alone sets alpha_b0 to w / (w + 1) = 1/2 (at B 1), after which a chain
pays only where E(S) T(plain) > T(S): on the H200's B 1 slice table 1/1/2 needs alpha_b0 > 0.66, so nothing
speculates again until the evidence has decayed (~100 rounds, forget 0.995), and the overhead of a 61-token run
is the probe's excess, T(1/1/2) - T(plain) = 1.4 ms; with the full model's costs, where a chain costs little
more than a plain step, the rejections take a few more rounds (0.7% to 2.9% over the H200's tables at 61
tokens). tests/test_policy.py::test_overhead_at_p0_is_bounded checks both on the H200's cost tables.

The decisions are made at the loop's sync point between rounds, from a snapshot each round writes on the
device (counts, accepted drafts, the chain's cumulative log-probabilities) and the host reads through pinned
memory: on CUDA one round stale (the host decides round r + 1 while round r runs, from round r - 1's
snapshot), so the device never waits for a decision; nothing inside a round graph syncs.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from typing import Optional, Sequence

from .adaptive import PLAIN, label, resume_label, resume_sizes, run_policy
from .decode import SpecConfig

MEAN_WEIGHT = 0.2  # of a new confidence reading in its running mean
RELAX = 0.5  # a round without a reading keeps this part of the last reading's distance from the mean


class Policy:
    """The interface run_policy drives. shapes(spec): the candidate SpecConfigs (spec's temperature and seed);
    start(B, costs, shapes, max_new): the cost table ({label: seconds a round}, with "resume/r"), the candidates
    run_policy built a graph for (shapes(spec), in order) and each request's token budget; choose(active, lag):
    the next round's shape, None for a plain decode step; launched(spec, resume): the round just launched (its
    shape, and the resume label before it or None); observe(...): the oldest launched round's outcome, in launch
    order. resume_rows: plain rounds after which the drafter must catch up (the pending features' buffer, R rows
    a request). fixed_costs: a cost table to use instead of measuring one (None: measure)."""

    resume_rows = 64
    fixed_costs: Optional[dict] = None

    def run(self, loop, shapes, spec, start, prefill_seconds, prefill_times, progress):
        """generate_speculative's rounds under this policy (engine/adaptive.run_policy)."""
        return run_policy(loop, self, shapes, spec, start, prefill_seconds, prefill_times, progress)

    def shapes(self, spec: SpecConfig) -> list[SpecConfig]:
        raise NotImplementedError

    def start(self, B: int, costs: dict, shapes: Sequence[SpecConfig], max_new: Optional[int] = None) -> None:
        raise NotImplementedError

    def launched(self, spec: Optional[SpecConfig], resume: Optional[str]) -> None:
        """A round was launched (called before its observe)."""

    def observe(self, spec: Optional[SpecConfig], active: Sequence[bool], accept_len: Sequence[int],
                scores: Optional[Sequence[Sequence[float]]], d1_logprob: Optional[Sequence[float]],
                counts: Optional[Sequence[int]] = None) -> None:
        raise NotImplementedError

    def choose(self, active: Sequence[bool], lag: int) -> Optional[SpecConfig]:
        raise NotImplementedError


class AdaptivePolicy(Policy):
    """Expected tokens per second from measured costs, the drafter's confidence and each request's running
    acceptance, a cost-priced first probe and a regret budget (the module docstring has the model and the bound).

    Parameters
    ----------
    steps : sequence of int
        Chain lengths to choose from (drafts a round); plain decoding is always a candidate.
    prior : float
        alpha before any evidence (1: optimistic, so one accepted probe lets the next round draft deep).
    prior_weight : float
        The prior's weight, in tested drafts, against the other requests' pooled evidence (w).
    request_weight : float
        The pooled estimate's weight, in tested drafts, against the request's own evidence (v).
    forget : float
        Per round, the factor on the evidence (1: never forget; the default's half-life is ~140 rounds).
    resume_rows : int
        Plain rounds after which the drafter catches up on them (one drafter forward of this many rows).
    costs : dict, optional
        {label: seconds a round} (labels "plain", "resume/8", "resume/64", "3/1/4", ...) to use instead of the
        table measured at start-up (an engine's own profile; another machine's table; the tests' fixed numbers).
    budget : float
        eps of the regret bound: the regret the policy may run up against plain decoding, a fraction of the
        plain rounds' time, on top of one dearest round's excess.
    """

    def __init__(self, steps: Sequence[int] = (1, 2, 3, 4, 5), prior: float = 1.0, prior_weight: float = 1.0,
                 forget: float = 0.995, resume_rows: int = 64, costs: Optional[dict] = None, budget: float = 0.01,
                 request_weight: float = 1.0):
        if not steps or min(steps) < 1:
            raise ValueError(f"steps must be chain lengths >= 1, got {list(steps)}")
        if not (0 < prior <= 1 and prior_weight > 0 and 0 < forget <= 1 and resume_rows >= 1 and budget >= 0):
            raise ValueError(f"need 0 < prior <= 1, prior_weight > 0, 0 < forget <= 1, resume_rows >= 1, budget >= 0; "
                             f"got {prior}, {prior_weight}, {forget}, {resume_rows}, {budget}")
        self.steps, self.fixed_costs = sorted(set(int(s) for s in steps)), costs
        self.prior, self.prior_weight, self.forget, self.resume_rows = prior, prior_weight, forget, resume_rows
        self.budget, self.request_weight = budget, request_weight
        self.observed = 0

    def shapes(self, spec: SpecConfig) -> list[SpecConfig]:
        return [replace(spec, steps=s, topk=1, num_tokens=s + 1) for s in self.steps]

    def start(self, B: int, costs: dict, shapes: Sequence[SpecConfig], max_new: Optional[int] = None) -> None:
        self.costs = dict(costs if self.fixed_costs is None else self.fixed_costs)
        self.B, self.observed, self._specs = B, 0, list(shapes)
        self.depth = depth = max(max(self.steps), max((s.steps for s in shapes), default=1))
        self.num = [[0.0] * depth for _ in range(B)]  # accepted drafts per depth (decayed)
        self.den = [[0.0] * depth for _ in range(B)]  # drafts tested per depth (decayed)
        self.conf = [[1.0] * depth for _ in range(B)]  # c_bj, last read (relaxed toward mean while not read)
        self.mean = [[1.0] * depth for _ in range(B)]  # c_bj's running mean
        self.max_new = max_new
        self.remaining = [math.inf if max_new is None else max_new - 1] * B  # tokens left (the first is the prefill's)
        self.t0 = self.costs[PLAIN]
        worst_resume = max(self.costs[f"resume/{r}"] for r in resume_sizes(self.resume_rows))
        self.allowance = max(self.costs[label(s)] for s in self._specs) + worst_resume - self.t0  # A
        self.need_outcome = False  # whether the next decision should wait for the round just chosen
        self.regret, self.rounds, self.flight = 0.0, 0, deque()  # R (settled rounds), n, the rounds in flight
        self.tested = 0  # drafts verification tested (every draft before them accepted), over the run

    def totals(self) -> tuple[list[float], list[float]]:
        """Per depth, the batch's accepted and tested drafts (decayed), every request's summed."""
        return [sum(n[d] for n in self.num) for d in range(self.depth)], \
            [sum(n[d] for n in self.den) for d in range(self.depth)]

    def alphas(self, b: int, totals=None) -> list[float]:
        """alpha_b0 .. alpha_b(depth-1): at each depth the other requests' pooled evidence over the prior (depth
        0: `prior`; depth j: alpha_b(j-1)), then request b's own over that (module docstring)."""
        N, D = totals or self.totals()
        w, v, a, out = self.prior_weight, self.request_weight, self.prior, []
        for d in range(self.depth):
            pi = (w * a + N[d] - self.num[b][d]) / (w + D[d] - self.den[b][d])
            a = (v * pi + self.num[b][d]) / (v + self.den[b][d])
            out.append(a)
        return out

    def alpha(self, b: int, j: int) -> float:
        """alpha_bj (alphas)."""
        return self.alphas(b)[j]

    def _left(self, b: int) -> float:
        """Tokens request b has left, less what the rounds still in flight are expected to emit for it."""
        return self.remaining[b] - sum(e[b] for *_, e in self.flight)

    def expected_tokens(self, b: int, steps: int, totals=None) -> float:
        """E_b(steps): expected tokens a round of a `steps` chain emits for request b (1 for plain)."""
        e, run, n = 1.0, 1.0, int(min(steps, self._left(b) - 1))
        if n <= 0:
            return e
        for j, a in enumerate(self.alphas(b, totals)[:n]):
            run *= min(1.0, a * self.conf[b][j] / max(self.mean[b][j], 1e-6))
            e += run
        return e

    def uninformed_tokens(self, b: int, steps: int) -> float:
        """E_b(steps) under the uninformative prior (alpha ~ Uniform(0, 1) at every depth): H_{steps+1}, cut at
        the tokens b has left."""
        return sum(1.0 / (k + 1) for k in range(int(min(steps, self._left(b) - 1)) + 1))

    def round_cost(self, spec: Optional[SpecConfig], lag: int) -> float:
        """T(round) of this decision after `lag` plain rounds: a speculative one pays the resume first."""
        resume = self.costs[resume_label(lag, self.resume_rows)] if lag and spec is not None else 0.0
        return self.costs[label(spec)] + resume

    def affordable(self, spec: SpecConfig, lag: int) -> bool:
        """The regret budget (module docstring): R, the rounds in flight at their worst and this one's worst within
        A + eps T(plain) n."""
        worst = sum(w for _, w, _ in self.flight) + self.round_cost(spec, lag) - self.t0
        return self.regret + worst <= self.allowance + self.budget * self.t0 * (self.rounds + 1) + 1e-12

    def rate(self, spec: Optional[SpecConfig], active: Sequence[bool], lag: int) -> float:
        """Expected tokens per second of the next round with this shape (None: plain), over the requests still
        decoding."""
        steps, totals = (0 if spec is None else spec.steps), self.totals()
        decoding = [b for b in range(self.B) if active[b]]
        tokens = sum(self.expected_tokens(b, steps, totals) for b in decoding)
        cost = self.costs[label(spec)]
        if lag and spec is not None and decoding:  # the resume, spread over the rounds it lets this chain run
            ahead = max(self._left(b) for b in decoding) / (tokens / len(decoding))
            cost += self.costs[resume_label(lag, self.resume_rows)] / min(self.resume_rows, max(1.0, ahead))
        return tokens / cost

    def probe(self, active: Sequence[bool], lag: int) -> SpecConfig:
        """The first probe: the candidate of the best expected rate under the uninformative prior."""
        return max(self._specs, key=lambda s: sum(self.uninformed_tokens(b, s.steps) for b in range(self.B)
                                                  if active[b]) / self.round_cost(s, lag))

    def _best(self, active, lag) -> Optional[SpecConfig]:
        best, best_rate = None, self.rate(None, active, lag)
        for spec in self._specs:
            r = self.rate(spec, active, lag)
            if r > best_rate and self.affordable(spec, lag):
                best, best_rate = spec, r
        return best

    def choose(self, active, lag):
        self.need_outcome = True
        if self.observed == 0 and not self.flight:  # no evidence yet: the probe (always within the budget: A >= its excess)
            return self.probe(active, lag)
        best = self._best(active, lag)
        if best is not None:  # would this round's failure (every draft rejected) make the next one plain?
            saved = [self.den[b][0] for b in range(self.B)]
            for b in range(self.B):
                self.den[b][0] += bool(active[b])
            self.need_outcome = self._best(active, 0) is None
            for b in range(self.B):
                self.den[b][0] = saved[b]
        return best

    def launched(self, spec, resume) -> None:
        cost = self.costs[label(spec)] + (self.costs[resume] if resume else 0.0)
        steps = 0 if spec is None else spec.steps
        expect = [self.expected_tokens(b, steps) if self.remaining[b] > 0 else 0.0 for b in range(self.B)]
        # (the round's cost, its worst excess: one token a request, the tokens it is expected to emit a request)
        self.flight.append((cost, cost - self.t0, expect))
        self.rounds += 1

    def observe(self, spec, active, accept_len, scores, d1_logprob, counts=None) -> None:
        self.observed += 1
        cost = self.flight.popleft()[0] if self.flight else self.costs[label(spec)]
        decoding = [b for b in range(self.B) if active[b]]
        if decoding:  # the regret: this round's cost less plain's for the tokens it emitted (a share per request)
            tokens = sum(min(int(accept_len[b]) + 1 if spec is not None else 1, self.remaining[b]) for b in decoding)
            self.regret += cost - self.t0 * tokens / len(decoding)
        if counts is not None and self.max_new is not None:
            self.remaining = [self.max_new - c for c in counts]
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
            self.tested += min(a + 1, spec.steps)  # (undecayed: the run's totals, bench_e2e's calibration check)
            for j in range(min(a + 1, spec.steps)):  # draft j was tested: the j before it were accepted
                self.num[b][j] += j < a
                self.den[b][j] += 1.0


class FixedPolicy(Policy):
    """Every round the one shape `shape` (SpecConfig fields: steps, topk, num_tokens): the fixed loop's decisions
    through the policy interface (adaptive.simulate's baseline)."""

    def __init__(self, **shape):
        self.shape = shape

    def shapes(self, spec: SpecConfig) -> list[SpecConfig]:
        return [replace(spec, **self.shape)]

    def start(self, B, costs, shapes, max_new=None) -> None:
        self._spec = shapes[0]

    def observe(self, *args, **kwargs) -> None:
        pass

    def choose(self, active, lag):
        return self._spec


__all__ = ["AdaptivePolicy", "FixedPolicy", "PLAIN", "Policy", "label"]
