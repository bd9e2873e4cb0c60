"""What the adaptive policy knows of each request (engine/policy.py's AdaptivePolicy): its running acceptance per
draft depth, pooled across the batch, and the drafter's confidence against its usual, so that a round of S drafts
is expected to emit X_b(S) tokens, P(X_b >= s + 1) = prod_{j<s} q_bj, q_bj = min(1, alpha_bj c_bj / m_bj):

- alpha_bj, the request's running acceptance at depth j, in two steps: pi_bj = (w * prior_bj + the other
  requests' drafts accepted at depth j) / (w + theirs tested there), then alpha_bj = (v' * pi_bj + b's own
  accepted) / (v' + b's own tested), v' = min(v, w + theirs tested: the pooled estimate weighs no more than the
  evidence it holds). Depth 0: prior_b0 = `prior`, w = `prior_weight` (default 1/2 at weight 1: the mean of
  Jeffreys' Beta(1/2, 1/2)), v = `request_weight` or, by default, the requests' spread (spread_weight: empirical
  Bayes, v infinite where their rates differ no more than binomial draws do: one request's unlucky draws are
  not taken for a harder request); depth j >= 1: prior_bj = alpha_b(j-1), w = v = `depth_weight` (a
  depth tested little is expected to do as the one above it: one rejection at depth 2 does not make a 3-draft
  chain look worse than a 1-draft one). At B 1 pi_bj = prior_bj; at B 8 one round informs every request, and a
  request's own record still counts; a draft is tested when every draft before it was accepted (the
  maximum-likelihood rate of a chain whose drafts are accepted independently; per depth, since a drafter trained
  for a few steps does worse past them; the ORACLE's is p at every depth). The evidence decays by `forget` each
  round (plain rounds too), so a request that fell back to plain decoding drifts back to the prior.
- c_bj / m_bj, the drafter's confidence (EAGLE-2's) against its usual: c_bj its top-1 probability at depth j
  given the draft before it (exp of the step in the chain's cumulative log-probability) as the last round that
  drafted depth j read it, m_bj the running mean of those readings. A draft the drafter is surer of than usual
  is expected to be accepted more often than the running rate says, and less when it is unsure (the ORACLE's
  confidence is always 1: the factor is 1). The factor enters damped, (c_bj / m_bj) ** `confidence` (default
  1/2): at full strength (1) one low reading of a straggling request's d_1 made the shipped pair's B 20 batch
  decode plain rounds at 0.9 acceptance and take 51 rounds to fixed 3/1/4's 48 (0.961x 3/1/4 in one measured
  cost table's terms; 1.007x at 1/2, 0.998x at 0, 1.030x / 1.029x at B 4: tests/test_policy.py's docstring of
  test_confidence_is_damped gives the command). Each round that does not read c_bj (plain rounds, shorter
  chains) it relaxes halfway to m_bj, so one low reading does not keep a request in plain decoding until the
  next resume reads d_1 again.
"""

from __future__ import annotations

import math

MEAN_WEIGHT = 0.2  # of a new confidence reading in its running mean
RELAX = 0.5  # a round without a reading keeps this part of the last reading's distance from the mean


class Evidence:
    """Per request b and depth j the decayed counts of drafts accepted (num) and tested (den), the confidence
    readings (conf) and their running mean (mean), and the estimates made of them. The policy sets prior,
    prior_weight, request_weight, depth_weight, forget, confidence, B, depth and observed, and provides _left(b),
    the tokens b has left."""

    def reset_evidence(self, B: int, depth: int) -> None:
        self.num = [[0.0] * depth for _ in range(B)]  # accepted drafts per depth (decayed)
        self.den = [[0.0] * depth for _ in range(B)]  # drafts tested per depth (decayed)
        self.conf = [[1.0] * depth for _ in range(B)]  # c_bj, last read (relaxed toward mean while not read)
        self.mean = [[1.0] * depth for _ in range(B)]  # c_bj's running mean
        self.tested = 0  # drafts verification tested (every draft before them accepted), over the run
        self.changed()

    def changed(self) -> None:
        """The evidence changed: drop what was computed from it (totals, spread_weight, alphas)."""
        self._totals = None  # totals() of the evidence as it is
        self._spread = (-1, math.inf)  # (observed, spread_weight) cached per evidence
        self._alphas = {}  # alphas(b) of the evidence as it is (cleared where it changes)

    # -- the model: each request's survival probabilities P(the first s drafts accepted) ------------------------

    def totals(self) -> tuple[list[float], list[float]]:
        """Per depth, the batch's accepted and tested drafts (decayed), every request's summed."""
        if self._totals is None:
            self._totals = ([sum(n[d] for n in self.num) for d in range(self.depth)],
                            [sum(n[d] for n in self.den) for d in range(self.depth)])
        return self._totals

    def posterior(self, b: int, totals=None) -> tuple[float, float, list[float]]:
        """Request b's Beta(a, c) posterior of its first draft's acceptance and its per-depth point estimates
        alpha_b0 .. alpha_b(depth-1) (alpha_b0 = a / (a + c)). Depth 0: the other requests' evidence over the
        prior, then b's own over that pooled posterior at weight min(v, the evidence it holds); depth j: the same
        two steps over alpha_b(j-1) at depth_weight. b < 0: the batch's pooled posterior (every request's
        evidence, no own step)."""
        N, D = totals or self.totals()
        own_n = self.num[b] if b >= 0 else [0.0] * self.depth
        own_d = self.den[b] if b >= 0 else [0.0] * self.depth
        w, m = self.prior_weight, self.prior
        held = w + D[0] - own_d[0]
        pa = w * m + N[0] - own_n[0]
        pc = held - pa
        v = min(self.spread_weight(), held)
        a, c = v * pa / held + own_n[0], v * pc / held + own_d[0] - own_n[0]
        out, prev = [a / (a + c)], a / (a + c)
        W = self.depth_weight
        for d in range(1, self.depth):
            held = W + D[d] - own_d[d]
            pi = (W * prev + N[d] - own_n[d]) / held
            vv = min(W, held)
            prev = (vv * pi + own_n[d]) / (vv + own_d[d])
            out.append(prev)
        return a, c, out

    def spread_weight(self) -> float:
        """v, the pooled posterior's weight against a request's own evidence: `request_weight`, or (None) from the
        requests' spread at depth 0 (empirical Bayes: the between-request variance tau^2 by the method of moments,
        the observed spread of their rates less the binomial part, and v = p (1 - p) / tau^2 - 1, the concentration
        of a Beta with that variance; no spread beyond the binomial: the pooled posterior weighs all it holds)."""
        if self.request_weight is not None:
            return self.request_weight
        if self._spread[0] == self.observed:
            return self._spread[1]
        rows = [(self.num[b][0], self.den[b][0]) for b in range(self.B) if self.den[b][0] > 1e-9]
        total = sum(d for _, d in rows)
        v = math.inf
        if len(rows) > 1:
            p = sum(n for n, _ in rows) / total
            pq = p * (1 - p)
            spread = sum(d * (n / d - p) ** 2 for n, d in rows) - (len(rows) - 1) * pq
            tau2 = spread / (total - sum(d * d for _, d in rows) / total)
            if pq > 0 and tau2 > 0:
                v = max(1.0, pq / tau2 - 1)
        self._spread = (self.observed, v)
        return v

    def alphas(self, b: int, totals=None) -> list[float]:
        """alpha_b0 .. alpha_b(depth-1), the point estimates (posterior; for the evidence as it is, cached until it
        changes: a decision reads them once a request, not once a shape)."""
        if totals is not None:
            return self.posterior(b, totals)[2]
        if b not in self._alphas:
            self._alphas[b] = self.posterior(b)[2]
        return self._alphas[b]

    def alpha(self, b: int, j: int) -> float:
        """alpha_bj (alphas)."""
        return self.alphas(b)[j]

    def factors(self, b: int) -> list[float]:
        """The confidence factor (c_bj / m_bj) ** confidence per depth (1 for the ORACLE)."""
        return [(self.conf[b][j] / max(self.mean[b][j], 1e-6)) ** self.confidence for j in range(self.depth)]

    @staticmethod
    def survival(alphas, factors, n: int) -> list[float]:
        """P(the first s drafts are accepted), s = 1..n: the product of q_bj = min(1, alpha_bj c_bj / m_bj), j < s."""
        out, run = [], 1.0
        for s in range(n):
            run *= min(1.0, alphas[s] * factors[s])
            out.append(run)
        return out

    @staticmethod
    def _moments(surv) -> tuple[float, float]:
        mean = m2 = 1.0
        for j, p in enumerate(surv):  # P(X >= j + 2) weighs (j + 2)^2 - (j + 1)^2 in E[X^2]
            mean += p
            m2 += (2 * j + 3) * p
        return mean, max(0.0, m2 - mean * mean)

    def emission(self, b: int, steps: int, totals=None) -> tuple[float, float]:
        """Mean and variance of the tokens a round of a `steps` chain emits for request b (1, 0 for plain), cut
        at the tokens b has left."""
        n = int(min(steps, self._left(b) - 1))
        if n <= 0:
            return 1.0, 0.0
        return self._moments(self.survival(self.alphas(b, totals), self.factors(b), n))

    def expected_tokens(self, b: int, steps: int, totals=None) -> float:
        """E_b(steps): expected tokens a round of a `steps` chain emits for request b (1 for plain)."""
        return self.emission(b, steps, totals)[0]

    def record(self, spec, active, accept_len, scores, d1_logprob) -> None:
        """A round's outcome into the evidence: the decay, the confidence readings (the chain's step
        log-probabilities, or d_1's after a resume), and per request the drafts tested and accepted."""
        self.changed()
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
