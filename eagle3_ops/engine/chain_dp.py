"""ChainDP: the adaptive policy's exact decisions for one request (B 1) over a short run (engine/policy.py).

One request's run of at most EXACT_HORIZON tokens is decided by dynamic
programming, solved once at start (numpy, 0.05 s for 60 tokens, 0.3 s for 127 on this VM's CPU; start-up, as the
cost table is): the depths share the request's acceptance alpha ~ Beta(w prior + accepted drafts, w (1 - prior)
+ rejections) (Jeffreys' by default), every round one of plain and the chains, the value the expected time to the
last token over every outcome the posterior predicts. So a probe is worth what it teaches over the tokens left,
a chain is lengthened as the evidence for it grows, and the end of the run is planned (one token left: plain).
It is Bayes-optimal for that model and prior; the per-depth estimates and the confidence factors (engine/evidence.py) do
not enter it (the ORACLE has neither; a real drafter's deeper drafts do worse than the model says). V assumes each
decision is made after the last round's outcome; the policy decides blind to it where that is expected to cost
less than waiting for it (value, outcomes and q: AdaptivePolicy.choose_exact).

"""

from __future__ import annotations

from .adaptive import PLAIN, label


class ChainDP:
    """The Bayes-optimal decisions of one request over its last `horizon` tokens (B 1), by dynamic programming:
    the depths share the request's acceptance alpha ~ Beta(a, c) (the prior updated by every draft tested: accepted
    drafts to a, rejections to c), each round one of plain and the chains, its cost from the table (a chain after
    plain rounds pays the resume too); the value is the expected time to the request's last token. V[l, g][s, f]:
    l tokens left, g = 1 after a plain round, s / f accepted / rejected drafts since the solve; an outcome of a
    chain of S drafts cut at n = min(S, l - 1): its first k accepted and the next rejected (k < n) with probability
    E[alpha^k] - E[alpha^(k+1)], all n with E[alpha^n]."""

    def __init__(self, costs: dict, specs, a: float, c: float, horizon: int, resume: float):
        import numpy as np

        G, P = horizon + 1, max(s.steps for s in specs) + 2
        self.specs, self.a, self.c = list(specs), a, c
        s = np.arange(G + P, dtype=np.float64)[:, None]
        f = np.arange(G + P, dtype=np.float64)[None, :]
        M = [np.ones((G + P, G + P))]
        for i in range(P):
            M.append(M[-1] * (a + s + i) / (a + c + s + f + i))
        V = np.zeros((G, 2, G + P, G + P))
        self.choice = np.zeros((G, 2, G + P, G + P), dtype=np.int8)  # 0: plain, i: specs[i - 1]
        t0 = costs[PLAIN]
        for l in range(1, G):
            for g in (0, 1):
                best = t0 + V[l - 1, 1]
                pick = np.zeros(best.shape, dtype=np.int8)
                for i, spec in enumerate(self.specs, 1):
                    n = min(spec.steps, l - 1)
                    if n <= 0:
                        continue
                    q = np.full(best.shape, costs[label(spec)] + g * resume)
                    for k in range(n):  # k accepted, the next rejected
                        nxt = np.zeros_like(best)
                        nxt[:G + P - k, :G + P - 1] = V[l - k - 1, 0][k:, 1:]
                        q += (M[k] - M[k + 1]) * nxt
                    nxt = np.zeros_like(best)
                    nxt[:G + P - n, :] = V[l - n - 1, 0][n:, :]
                    q += M[n] * nxt
                    better = q < best
                    best = np.where(better, q, best)
                    pick = np.where(better, np.int8(i), pick)
                V[l, g], self.choice[l, g] = best, pick
        self.V, self.horizon, self.M = V, horizon, M
        self.costs, self.resume, self.t0 = costs, resume, t0

    def value(self, left: int, lag: bool, s: int, f: int) -> float:
        """V: the expected time to the last token from this state, deciding optimally (each decision after the
        last round's outcome)."""
        return float(self.V[left, int(lag), s, f]) if left > 0 else 0.0

    def outcomes(self, left: int, lag: bool, s: int, f: int, spec) -> list:
        """[(probability, (left, lag, s, f) after the round)] of a round of `spec` (None: plain) from this state:
        a chain of n = min(S, left - 1) drafts accepts its first k and rejects the next (k < n) with probability
        E[alpha^k] - E[alpha^(k+1)], all n with E[alpha^n], alpha the posterior (n <= 0: one token, as plain)."""
        if spec is None:
            return [(1.0, (left - 1, True, s, f))]
        n = min(spec.steps, left - 1)
        if n <= 0:
            return [(1.0, (left - 1, False, s, f))]
        out = [(float(self.M[k][s, f] - self.M[k + 1][s, f]), (left - k - 1, False, s + k, f + 1)) for k in range(n)]
        return out + [(float(self.M[n][s, f]), (left - n - 1, False, s + n, f))]

    def q(self, left: int, lag: bool, s: int, f: int, spec) -> float:
        """The expected time to the last token if this round is `spec` (None: plain) and every later decision is
        optimal (V)."""
        cost = self.t0 if spec is None else self.costs[label(spec)] + lag * self.resume
        return cost + sum(pr * self.value(*st) for pr, st in self.outcomes(left, lag, s, f, spec))

    def decide(self, left: int, lag: bool, s: int, f: int):
        """The decision (a spec or None) at `left` tokens, after plain rounds or not, s / f drafts accepted /
        rejected since the solve."""
        i = int(self.choice[left, int(lag), s, f])
        return None if i == 0 else self.specs[i - 1]
