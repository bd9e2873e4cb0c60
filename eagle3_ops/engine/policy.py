"""Speculation policies: each round, the draft shape for the batch (or none: a plain decode step), chosen to
maximise the batch's expected tokens per second to its end (docs/e2e.md, "The speculation policy").

One shape per round for the whole batch: the round's kernels (build_tree, tree attention, verify, kv_accept,
the drafter's block) take [B, N] with one N, and each shape is one CUDA graph captured once; a request's own
acceptance enters through the rounds it is expected to need, the batch's slowest setting its time.

AdaptivePolicy's model, per request b and draft depth j (a chain drafts one token a depth):

    q_bj = min(1, alpha_bj * c_bj / m_bj)     the chance the j-th draft is accepted once the j - 1 before it were
    X_b(S)                                    the tokens a round of S drafts emits for b: P(X_b >= s + 1) = prod_{j<s}
                                              q_bj for s <= min(S, r_b - 1), r_b the tokens b has left (past its
                                              max_new nothing counts); mean mu_b(S), variance var_b(S)
    n(S) = r / mu + z_k sqrt(r var / mu^3)    the rounds until the batch's last request is done with S every round:
                                              r = max_b r_b, mu and var the means over the requests decoding of mu_b
                                              and var_b (renewal counts, z_k = E[max of k standard normals], k the
                                              requests decoding)
    rate(S) = sum_b r_b / (T(S) n(S) + T(resume))
                                              the batch's tokens per second from here to its end (the resume after
                                              plain rounds once); rate(0) is plain's, sum_b r_b / (T(plain) max_b r_b)

  The loop decodes a static batch to its end (finished requests frozen, not replaced), so its time is its last
  request's: at B 1 rate(S) is mu(S) / T(S), at B > 1 a shape whose emission varies is charged for the wait
  (plain's does not vary). The requests enter at the batch's mean emission, not each at its own with the slowest
  counted: each request's own estimate is noisy and a real drafter's acceptance moves along the text, so the
  slowest estimate mostly picks noise (with it, the shipped pair at B 4 on the CPU ran 0.96-0.98x fixed 3/1/4 on
  the first 8 held-out prompts, against 1.05x with the mean, single runs; the ORACLE's requests are alike, where
  the two agree). An engine that refills finished slots would maximise sum_b mu_b / T instead.
- alpha_bj (each request's running acceptance at depth j, pooled across the batch) and c_bj / m_bj (the
  drafter's confidence against its usual): engine/evidence.py.
- T, the cost table run_policy measures at start-up: one round of each shape, the plain round and the
  drafter's catch-up after plain rounds ("resume/8", "resume/R": 8 or R pending rows), each replayed from its
  own CUDA graph (on the CPU, and eager runs, timed eagerly); a shape chosen after plain rounds pays the
  smallest resume that holds them on top.

The chosen shape is the argmax of rate over the candidates the budget below allows (at B 1: a further draft
step is taken exactly when the tokens it is expected to add are worth more than its cost at the rate without it,
mu(S + 1) - mu(S) > mu(S) (T(S + 1) - T(S)) / T(S)); otherwise drafting stops there, at 0 steps a plain decode step.
A tree candidate (topk > 1) is valued as its top-1 chain, a lower bound on its gain; the default candidates are
chains.

B 1: exact (ChainDP, engine/chain_dp.py, `exact`). One request's run of at most EXACT_HORIZON tokens is decided
by dynamic programming over the request's Beta posterior of its acceptance, solved once at start. A decision
waits for the newest round's snapshot (need_outcome) only where deciding blind to that round's outcome is expected
to cost more than the device's idle time for the read (`wait`, a constant): where ChainDP's decisions after every
outcome agree the next is made while the round runs; where they differ, the candidate of the least expected time
over the outcomes (ChainDP.q) is made blind when it is within `wait` of deciding after the read (choose_exact; on the
H200's 95d786a table at p = 1, 3 waits a 61-token run instead of 12). Before 95d786a's follow-up every speculative
decision waited: on the H200 at 95d786a its B 1 runs took 1.4-4.6% longer than their decisions' cost table (about
0.1 ms idle a round).

What a probe teaches elsewhere (explore, `lookahead`: B > 1, or runs past EXACT_HORIZON). The argmax above values
the present evidence only: after a rejected probe it picks plain, and plain rounds teach nothing, so one unlucky
draw could end speculation for the run. Where it says plain, each affordable chain S is also valued as a probe:
its cost, then the expected time to finish with the best single shape (plain included) after its outcome, over
the m of the k requests decoding whose first draft is accepted (m binomial at the pooled estimate; deeper depths
their expected share), the batch valued as k requests alike with the pooled estimates; the probe runs if that is
less than a plain round and then the best shape now. A one-step look-ahead over the tokens left: early in a run a
second probe can pay for itself, near its end it cannot.

The first probe (B > 1, or runs past EXACT_HORIZON). An optimistic prior would value every chain at S + 1 tokens
and start with the longest, the most expensive round to lose (at p = 0 on the H200 at B 1, 5/1/6: 8.7 ms against
a 2.26 ms plain step). The first round is valued instead under an uninformative prior that prices its cost: the
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
1 / (1 + eps + (A + F_n) / (n T(plain))) of plain decoding's speed (ChainDP's decisions too: one it makes that
the budget does not allow is a plain round). That is the guarantee; the model does better: the overhead of a
61-token run at p = 0 is 1.1% to 2.4% over the H200's tables (the most, B 1 prefix 4096 with the full model's
costs, where a chain costs little more than a plain step: one 3/1/4 and three 1/1/2 rounds; at p = 0 every seed
draws alike); tests/test_policy.py::test_overhead_at_p0_is_bounded checks both on the H200's cost tables.

Dominance (plain_only, set by start). Where every chain of S drafts costs at least S + 1 plain rounds, T(S) >=
(S + 1) T(plain), no round can beat plain's tokens per second even with every draft accepted (S drafts emit at most
S + 1 tokens a request), so every decision is plain from the first (no probe) and the loop skips the drafter's
forced catch-ups (F_n = 0: nothing will read the drafter's state). The H200's B 8 32768 table at 95d786a is one:
replayed on the CPU, 0.981-0.997 of plain -> 1.000.

A speculative round whose total rejection would make the next decision plain, or whose worst case would leave
no budget for the same shape again, is chosen with need_outcome set: the next decision waits for its snapshot
instead of deciding one round stale (adaptive.schedule), so an accepted probe is followed by the long chain it
argues for, not by a cheap one the in-flight worst case left room for.

The decisions are made at the loop's sync point between rounds, from a snapshot each round writes on the
device (counts, accepted drafts, the chain's cumulative log-probabilities) and the host reads through pinned
memory: on CUDA one round stale where need_outcome is not set (the host decides round r + 1 while round r runs,
from round r - 1's snapshot), so the device does not wait for those decisions; where it is set (probes,
ChainDP's rounds whose outcome the next decision needs) the device idles for the host's read, decision and launch
between two rounds (adaptive.simulate counts the waits and charges `wait` seconds each if given one). A plain decision never sets it (a plain round teaches nothing of acceptance): on the
H200 at 9bf26fc, where every plain decision still waited, the batch of 8 decoded plain at 0.75-0.84x plain
decoding's rate (about 1.1 ms idle per 5.2 ms round; bench/results/policy_9bf26fc_h200/). Nothing inside a round
graph syncs.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import replace
from typing import Optional, Sequence

from .adaptive import PLAIN, label, resume_label, resume_sizes, run_policy
from .chain_dp import ChainDP
from .decode import SpecConfig
from .evidence import Evidence
HORIZON = 1024  # tokens left a request is taken to have where no max_new is given
EXACT_HORIZON = 128  # B 1: ChainDP decides every round of a run of at most this many tokens


@functools.lru_cache(maxsize=None)
def expected_max_normal(k: int) -> float:
    """E[max of k independent standard normals] (0 for k <= 1), by quadrature of k x phi(x) Phi(x)^(k-1)."""
    if k <= 1:
        return 0.0
    h, total = 0.01, 0.0
    for i in range(-1000, 1001):
        x = i * h
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * k * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * cdf ** (k - 1)
    return total * h


class Policy:
    """The interface run_policy drives. shapes(spec): the candidate SpecConfigs (spec's temperature and seed);
    start(B, costs, shapes, max_new): the cost table ({label: seconds a round}, with "resume/r"), the candidates
    run_policy built a graph for (shapes(spec), in order) and each request's token budget; choose(active, lag):
    the next round's shape, None for a plain decode step; launched(spec, resume): the round just launched (its
    shape, and the resume label before it or None); observe(...): the oldest launched round's outcome, in launch
    order. resume_rows: plain rounds after which the drafter must catch up (the pending features' buffer, R rows
    a request). fixed_costs: a cost table to use instead of measuring one (None: measure). plain_only, set by
    start: every decision of this run will be plain, so the loop skips the drafter's forced catch-ups (nothing
    will read the drafter's state)."""

    resume_rows = 64
    fixed_costs: Optional[dict] = None
    plain_only = False

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


class AdaptivePolicy(Evidence, Policy):
    """Expected time to the batch's end from measured costs, the drafter's confidence and each request's posterior
    acceptance (the static batch waits for its slowest request), a cost-priced first probe, the value of what a
    probe teaches and a regret budget (the module docstring has the model and the bound).

    Parameters
    ----------
    steps : sequence of int
        Chain lengths to choose from (drafts a round); plain decoding is always a candidate.
    prior : float
        alpha before any evidence (1: optimistic, so one accepted probe lets the next round draft deep).
    prior_weight : float
        The prior's weight, in tested drafts, against the other requests' pooled evidence (w); as a posterior,
        Beta(w prior, w (1 - prior)) (explore's predictive).
    request_weight : float, optional
        The weight, in tested drafts, of the other requests' pooled posterior against a request's own evidence
        (at most the evidence the pooled posterior holds); None: from the requests' spread (spread_weight).
    depth_weight : float
        The weight, in tested drafts, of depth j - 1's estimate against depth j's evidence.
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
    lookahead : bool
        Value a probe by what its outcome teaches (explore) where the posterior alone says plain.
    exact : bool
        At B 1, runs of at most EXACT_HORIZON tokens decided by ChainDP (engine/chain_dp.py).
    confidence : float
        The exponent of the drafter's confidence factor, (c_bj / m_bj) ** confidence (engine/evidence.py): 0
        ignores the drafter's confidence, 1 takes it at face value.
    wait : float
        Seconds the device idles when the host waits for the newest round's snapshot before launching the next
        (its read, the decision and the launch): ChainDP's decisions wait only where deciding blind is expected to
        cost more (choose_exact). A constant, not timed, so the decisions stay a function of the outcomes.
    """

    def __init__(self, steps: Sequence[int] = (1, 2, 3, 4, 5), prior: float = 0.5, prior_weight: float = 1.0,
                 forget: float = 0.995, resume_rows: int = 64, costs: Optional[dict] = None, budget: float = 0.01,
                 request_weight: Optional[float] = None, depth_weight: float = 4.0, lookahead: bool = True,
                 exact: bool = True, confidence: float = 0.5, wait: float = 1e-4):
        if not steps or min(steps) < 1:
            raise ValueError(f"steps must be chain lengths >= 1, got {list(steps)}")
        if not (0 < prior <= 1 and prior_weight > 0 and 0 < forget <= 1 and resume_rows >= 1 and budget >= 0
                and (request_weight is None or request_weight > 0) and depth_weight > 0 and confidence >= 0
                and wait >= 0):
            raise ValueError(f"need 0 < prior <= 1, prior_weight > 0, 0 < forget <= 1, resume_rows >= 1, budget >= 0, "
                             f"request_weight > 0, depth_weight > 0, confidence >= 0, wait >= 0; got {prior}, "
                             f"{prior_weight}, {forget}, {resume_rows}, {budget}, {request_weight}, {depth_weight}, "
                             f"{confidence}, {wait}")
        self.steps, self.fixed_costs = sorted(set(int(s) for s in steps)), costs
        self.prior, self.prior_weight, self.forget, self.resume_rows = prior, prior_weight, forget, resume_rows
        self.budget, self.request_weight, self.depth_weight = budget, request_weight, depth_weight
        self.lookahead, self.exact, self.confidence, self.wait = lookahead, exact, confidence, wait
        self.observed = 0

    def shapes(self, spec: SpecConfig) -> list[SpecConfig]:
        return [replace(spec, steps=s, topk=1, num_tokens=s + 1) for s in self.steps]

    def start(self, B: int, costs: dict, shapes: Sequence[SpecConfig], max_new: Optional[int] = None) -> None:
        self.costs = dict(costs if self.fixed_costs is None else self.fixed_costs)
        self.B, self.observed, self._specs = B, 0, list(shapes)
        self.depth = depth = max(max(self.steps), max((s.steps for s in shapes), default=1))
        self.reset_evidence(B, depth)
        self.max_new = max_new
        self.remaining = [math.inf if max_new is None else max_new - 1] * B  # tokens left (the first is the prefill's)
        self.t0 = self.costs[PLAIN]
        worst_resume = max(self.costs[f"resume/{r}"] for r in resume_sizes(self.resume_rows))
        self.allowance = max(self.costs[label(s)] for s in self._specs) + worst_resume - self.t0  # A
        self.need_outcome = False  # whether the next decision should wait for the round just chosen
        self.regret, self.rounds, self.flight = 0.0, 0, deque()  # R (settled rounds), n, the rounds in flight
        self.pending = deque()  # the rounds in flight: their specs (None: plain), in launch order
        # no round can beat plain's tokens per second at any acceptance: S drafts emit at most S + 1 tokens a request
        self.plain_only = all((s.steps + 1) * self.t0 <= self.costs[label(s)] for s in self._specs)
        # ChainDP (B 1), and the drafts accepted / rejected over the run, cut at the tokens left as ChainDP cuts
        self.dp, self.seen = None, [0, 0]
        if self.exact and B == 1 and max_new is not None and 0 < max_new - 1 <= EXACT_HORIZON:
            w = self.prior_weight
            self.dp = ChainDP(self.costs, self._specs, w * self.prior, w * (1 - self.prior), max_new - 1,
                              self.costs[resume_label(1, self.resume_rows)])

    def _left(self, b: int) -> float:
        """Tokens request b has left, less what the rounds still in flight are expected to emit for it."""
        return self.remaining[b] - sum(e[b] for *_, e in self.flight)

    # -- the objective: the batch's expected time to its end -------------------------------------------------

    def round_cost(self, spec: Optional[SpecConfig], lag: int) -> float:
        """T(round) of this decision after `lag` plain rounds: a speculative one pays the resume first."""
        resume = self.costs[resume_label(lag, self.resume_rows)] if lag and spec is not None else 0.0
        return self.costs[label(spec)] + resume

    def affordable(self, spec: SpecConfig, lag: int, extra: float = 0.0) -> bool:
        """The regret budget (module docstring): R, the rounds in flight at their worst and this one's worst (and
        `extra` more) within A + eps T(plain) n."""
        worst = sum(w for _, w, _ in self.flight) + self.round_cost(spec, lag) - self.t0 + extra
        return self.regret + worst <= self.allowance + self.budget * self.t0 * (self.rounds + 1) + 1e-12

    @staticmethod
    def _rounds(left: float, mean: float, var: float, z: float) -> float:
        """Expected rounds for `left` tokens at `mean` (variance `var`) a round, z standard deviations of the
        count on top (renewal: sd = sqrt(left var / mean^3))."""
        return left / mean + z * math.sqrt(left * var / mean ** 3) if left > 0 else 0.0

    def rounds_left(self, spec: Optional[SpecConfig], active: Sequence[bool], totals=None) -> float:  # n(S)
        """Expected rounds until every request still decoding has its tokens, this shape every round: the static
        batch runs until its last request is done. The request with the most tokens left, r, at the batch's mean
        emission mu and variance var: r / mu rounds plus z_k standard deviations of that count (renewal: sd =
        sqrt(r var / mu^3); z_k the expected maximum of k standard normals, k the requests decoding)."""
        steps = 0 if spec is None else spec.steps
        decoding = [b for b in range(self.B) if active[b]]
        left = max([min(self._left(b), HORIZON) for b in decoding] + [0.0])
        if left <= 0:
            return 0.0
        moments = [self.emission(b, steps, totals) for b in decoding]
        mean = sum(m for m, _ in moments) / len(moments)
        var = sum(v for _, v in moments) / len(moments)
        return self._rounds(left, mean, var, expected_max_normal(len(decoding)))

    def rate(self, spec: Optional[SpecConfig], active: Sequence[bool], lag: int) -> float:
        """Expected tokens per second of the batch from here to its end with this shape every round (None: plain):
        the tokens the requests still decoding have left over rounds_left rounds of this shape, the resume once."""
        tokens = sum(max(0.0, min(self._left(b), HORIZON)) for b in range(self.B) if active[b])
        n = self.rounds_left(spec, active)
        if n <= 0 or tokens <= 0:
            return 1.0 / self.round_cost(spec, lag)
        return tokens / (self.costs[label(spec)] * n + self.round_cost(spec, lag) - self.costs[label(spec)])

    def _best(self, active, lag) -> Optional[SpecConfig]:
        best, best_rate = None, self.rate(None, active, lag)
        for spec in self._specs:
            r = self.rate(spec, active, lag)
            if r > best_rate and self.affordable(spec, lag):
                best, best_rate = spec, r
        return best

    # -- the value of a probe -------------------------------------------------------------------------------

    def finish_time(self, alphas, factors, left: float, k: int) -> float:
        """The least expected time for k requests alike (the batch's pooled alphas and confidence factors), `left`
        tokens each, to finish under one shape every round, plain included (rounds_left's count)."""
        if left <= 0:
            return 0.0
        z, best = expected_max_normal(k), self.t0 * left
        for spec in self._specs:
            n = int(min(spec.steps, left - 1))
            if n > 0:
                mean, var = self._moments(self.survival(alphas, factors, n))
                best = min(best, self.costs[label(spec)] * self._rounds(left, mean, var, z))
        return best

    def probe_value(self, spec, totals, factors, left: float, k: int, lag: int) -> float:
        """Expected time to finish if `spec` runs now and the best single shape after it, from what its outcome
        teaches: m of the k requests decoding have their first draft accepted, m binomial at the pooled estimate
        alpha_0 (at k = 1 the posterior's own predictive; at k > 1 it leaves out the estimate's uncertainty, whose
        Beta-binomial spread over-valued probes in the H200 tables' simulations); deeper depths take their
        expected share of tests and acceptances."""
        N, D = totals
        al = self.posterior(-1, totals)[2]
        q0 = al[0]
        surv = self.survival(al, factors, int(min(spec.steps, left - 1)))
        mean = 1.0 + sum(surv)
        total = 0.0
        for m in range(k + 1):
            logp = (math.lgamma(k + 1) - math.lgamma(m + 1) - math.lgamma(k - m + 1) + m * math.log(max(q0, 1e-300))
                    + (k - m) * math.log(max(1.0 - q0, 1e-300)))
            n2, d2, tested = list(N), list(D), float(m)
            n2[0], d2[0] = N[0] + m, D[0] + k
            for j in range(1, spec.steps):
                d2[j] += tested
                tested *= al[j]
                n2[j] += tested
            total += math.exp(logp) * self.finish_time(self.posterior(-1, (n2, d2))[2], factors, left - mean, k)
        return self.round_cost(spec, lag) + total

    def explore(self, active, lag) -> Optional[SpecConfig]:
        """Where the posterior says plain: the probe whose outcome is worth its cost over the tokens left
        (probe_value against a plain round and then the best shape the present evidence picks), or None."""
        decoding = [b for b in range(self.B) if active[b]]
        if not decoding:
            return None
        totals = self.totals()
        factors = [sum(min(4.0, f) for f in col) / len(decoding)
                   for col in zip(*(self.factors(b) for b in decoding))]
        a, c, al = self.posterior(-1, totals)
        if c <= 1e-9:  # nothing rejected and an optimistic prior (1): certain, no outcome can teach it anything
            return None
        k, left = len(decoding), max(min(self._left(b), HORIZON) for b in decoding)
        best, best_time = None, self.t0 + self.finish_time(al, factors, left - 1, k)
        for spec in self._specs:
            if self.affordable(spec, lag):
                t = self.probe_value(spec, totals, factors, left, k, lag)
                if t < best_time:
                    best, best_time = spec, t
        return best

    def uninformed_tokens(self, b: int, steps: int) -> float:
        """E_b(steps) under the uninformative prior (alpha ~ Uniform(0, 1) shared by the depths): H_{steps+1}, cut
        at the tokens b has left."""
        return sum(1.0 / (k + 1) for k in range(int(min(steps, self._left(b) - 1)) + 1))

    def probe(self, active: Sequence[bool], lag: int) -> SpecConfig:
        """The first probe: the candidate of the best expected rate under the uninformative prior."""
        return max(self._specs, key=lambda s: sum(self.uninformed_tokens(b, s.steps) for b in range(self.B)
                                                  if active[b]) / self.round_cost(s, lag))

    def _exact_after(self, dist: dict, spec) -> dict:
        """{ChainDP state (tokens left, after a plain round, drafts accepted, rejected): probability} once a round
        of `spec` (None: plain) is done, from the distribution `dist` (ChainDP.outcomes under the posterior)."""
        out: dict = {}
        for st, pr in dist.items():
            for q, nxt in (self.dp.outcomes(*st, spec) if st[0] > 0 else [(1.0, st)]):
                out[nxt] = out.get(nxt, 0.0) + pr * q
        return out

    def _exact_blind(self, dist: dict):
        """The decision made before the outcomes `dist` are read: ChainDP's own where it is the same at every state
        with tokens left, else the candidate of the least expected time over them (ChainDP.q, every later decision
        made after its outcome). Returns (decision, its expected time, the expected time deciding after the read)."""
        live = {st: pr for st, pr in dist.items() if st[0] > 0}
        if not live:
            return None, 0.0, 0.0
        made = {label(self.dp.decide(st[0], bool(st[1]), st[2], st[3])) for st in live}
        after = sum(pr * self.dp.value(*st) for st, pr in live.items())
        if len(made) == 1:
            st = next(iter(live))
            return self.dp.decide(st[0], bool(st[1]), st[2], st[3]), after, after
        best, best_t = None, math.inf
        for spec in [None] + self._specs:
            t = sum(pr * self.dp.q(*st, spec) for st, pr in live.items())
            if t < best_t - 1e-15:
                best, best_t = spec, t
        return best, best_t, after

    def choose_exact(self, lag):
        """B 1 with the whole run within EXACT_HORIZON tokens: ChainDP's decision (solved at start), within the
        budget. Waiting for the newest round's snapshot idles the device for the host's read, decision and launch
        (`wait` a time: ~0.1 ms on the H200 at 95d786a, docs/e2e.md), so this decision sets need_outcome (the
        next one waits for this round) only where deciding blind costs more: where ChainDP's decisions after this
        round's outcomes agree (a long chain mid-run at a high acceptance, whatever one round's outcome) the next
        decision is ChainDP's own, made while this round runs; where they differ, the candidate of the least
        expected time over the outcomes (ChainDP.q) when that is within `wait` of deciding after the read. The
        round in flight when this decision is made (the previous one did not wait) enters the same way: its
        outcomes under the posterior, the same blind decision the previous decision valued."""
        dist = {(int(self.remaining[0]), lag > 0 and not self.pending, *self.seen): 1.0}
        for spec in self.pending:
            dist = self._exact_after(dist, spec)
        spec = self._exact_blind(dist)[0]
        spec = spec if spec is None or self.affordable(spec, lag) else None
        self.need_outcome = False
        for st, pr in dist.items():  # the next decision, from each state this one can be in, blind to this round
            _, blind, after = self._exact_blind(self._exact_after({st: 1.0}, spec))
            if st[0] > 0 and blind > after + self.wait:
                self.need_outcome = True
                break
        return spec

    def choose(self, active, lag):
        spec = self._choose(active, lag)
        if spec is None:  # a plain round teaches nothing of acceptance: the host decides the next while it runs
            self.need_outcome = False
        return spec

    def _choose(self, active, lag):
        self.need_outcome = True
        if self.plain_only:  # (dominated: no probe teaches anything worth its cost)
            return None
        if self.dp is not None and self.remaining[0] > 0:
            return self.choose_exact(lag)
        if self.observed == 0 and not self.flight:  # no evidence yet: the probe (always within the budget: A >= its excess)
            return self.probe(active, lag)
        best = self._best(active, lag)
        if best is None:
            return self.explore(active, lag) if self.lookahead else None
        # would this round's failure (every draft rejected) make the next one plain, or its worst case leave no
        # budget for the next? then the next decision waits for this round's outcome
        saved = [self.den[b][0] for b in range(self.B)]
        for b in range(self.B):
            self.den[b][0] += bool(active[b])
        self.changed()
        self.need_outcome = self._best(active, 0) is None
        for b in range(self.B):
            self.den[b][0] = saved[b]
        self.changed()
        self.need_outcome |= not self.affordable(best, lag, self.round_cost(best, 0) - self.t0)
        return best

    def launched(self, spec, resume) -> None:
        cost = self.costs[label(spec)] + (self.costs[resume] if resume else 0.0)
        steps = 0 if spec is None else spec.steps
        expect = [self.expected_tokens(b, steps) if self.remaining[b] > 0 else 0.0 for b in range(self.B)]
        # (the round's cost, its worst excess: one token a request, the tokens it is expected to emit a request)
        self.flight.append((cost, cost - self.t0, expect))
        self.pending.append(spec)
        self.rounds += 1

    def observe(self, spec, active, accept_len, scores, d1_logprob, counts=None) -> None:
        self.observed += 1
        cost = self.flight.popleft()[0] if self.flight else self.costs[label(spec)]
        if self.pending:
            self.pending.popleft()
        decoding = [b for b in range(self.B) if active[b]]
        if decoding:  # the regret: this round's cost less plain's for the tokens it emitted (a share per request)
            tokens = sum(min(int(accept_len[b]) + 1 if spec is not None else 1, self.remaining[b]) for b in decoding)
            self.regret += cost - self.t0 * tokens / len(decoding)
        if spec is not None and self.B == 1 and active[0]:  # ChainDP's evidence: its outcomes, cut where it cuts
            n, a = int(min(spec.steps, self.remaining[0] - 1)), int(accept_len[0])
            self.seen[0] += min(a, n)
            self.seen[1] += a < n
        if counts is not None and self.max_new is not None:
            self.remaining = [self.max_new - c for c in counts]
        self.record(spec, active, accept_len, scores, d1_logprob)


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


__all__ = ["AdaptivePolicy", "ChainDP", "FixedPolicy", "PLAIN", "Policy", "label"]
