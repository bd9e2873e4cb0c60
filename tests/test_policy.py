"""The speculation policy (engine/policy.py, engine/adaptive.py): through every decision path (a shape switch
mid-request, a fall back to plain decoding and a return, the drafter's forced catch-up after resume_rows plain
rounds) the output is plain greedy decoding's, token for token; each graph is prepared once whatever the
decisions; the oracle's acceptance-length calibration; the policy's model on hand-checked numbers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from eagle3_ops.engine import SpecConfig, generate_plain, generate_speculative
from eagle3_ops.engine.graphs import RoundGraph
from eagle3_ops.engine.oracle import OracleDrafter, acceptance_length, p_for_acceptance_length
from eagle3_ops.engine.adaptive import simulate
from eagle3_ops.engine.policy import (HORIZON, PLAIN, AdaptivePolicy, ChainDP, FixedPolicy, expected_max_normal,
                                      label)
from eagle3_ops.models.config import DrafterConfig, TargetConfig
from eagle3_ops.models.drafter import Drafter
from eagle3_ops.models.target import Target

CFG = TargetConfig.from_preset("tiny")


@pytest.fixture(scope="module")
def pair():
    # float64: every shape computes the target's logits in other row counts; no rounding can flip an argmax
    target = Target.synthesize(CFG, 0, torch.float64).eval()
    drafter = Drafter.synthesize(DrafterConfig.for_target(CFG), target.model.embed_tokens, 1, torch.float64).eval()
    prompts = torch.randint(0, CFG.vocab_size, (3, 11), generator=torch.Generator().manual_seed(5))
    plain, _ = generate_plain(target, prompts, 40)
    return target, drafter, prompts, plain


class Scripted(AdaptivePolicy):
    """Decisions from a script (steps per round, 0 = plain), cycled; the model still observes every round."""

    def __init__(self, script, shapes=None, **kw):
        super().__init__(**kw)
        self.script, self.extra, self.made = list(script), list(shapes or []), []

    def shapes(self, spec):
        return super().shapes(spec) + [replace(spec, **s) for s in self.extra]

    def start(self, *args, **kwargs):
        super().start(*args, **kwargs)
        self.plain_only = False  # (the script speculates whatever the measured costs say)

    def choose(self, active, lag):
        want = self.script[len(self.made) % len(self.script)]
        s = None if want == 0 else next(x for x in self._specs if label(x) == want or x.steps == want)
        self.made.append(label(s))
        return s


# why each script: shapes switching every round; plain then back (a resume before the return); more plain rounds
# in a row than resume_rows (the forced catch-up while plain goes on); a tree among chains
SCRIPTS = {"switch": [3, 1, 5, 2, 4], "plain-and-back": [0, 0, 3, 0, 1, 0, 0, 0, 2],
           "forced-resume": [0] * 9 + [2], "tree": ["3/2/6", 0, 1, "3/2/6", 0]}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "round-graphs"])
@pytest.mark.parametrize("script", list(SCRIPTS), ids=list(SCRIPTS))
def test_every_decision_path_is_plain_greedy(pair, script, graphs):
    target, drafter, prompts, plain = pair
    policy = Scripted(SCRIPTS[script], shapes=[dict(steps=3, topk=2, num_tokens=6)], resume_rows=4)
    out, stats = generate_speculative(target, drafter, prompts, plain.shape[1], SpecConfig(), policy=policy,
                                      graphs=graphs)
    assert torch.equal(out, plain), f"first mismatch at {(out != plain).nonzero()[0].tolist()}"
    made = set(policy.made)
    assert stats.decisions == {k: policy.made.count(k) for k in made}
    if PLAIN in made:
        assert stats.resumes >= 1
    if script == "forced-resume":  # 9 plain rounds in a row at resume_rows 4: caught up twice before the return
        assert stats.resumes >= 3
    assert stats.drafted >= stats.accepted >= 0 and 1.0 <= stats.acceptance_length


def test_switching_shape_never_prepares_a_graph_again(pair, monkeypatch):
    """Counted through RoundGraph.prepare, the warm-up and capture seam the GPU path captures in."""
    target, drafter, prompts, plain = pair
    calls = []
    original = RoundGraph.prepare

    def counting(self):
        if not self.ready:
            calls.append(id(self))
        return original(self)

    monkeypatch.setattr(RoundGraph, "prepare", counting)
    policy = Scripted(SCRIPTS["switch"] + SCRIPTS["plain-and-back"], resume_rows=3)
    out, stats = generate_speculative(target, drafter, prompts, plain.shape[1], SpecConfig(), policy=policy,
                                      graphs=True)
    assert torch.equal(out, plain)
    assert len(set(policy.made)) >= 6  # every chain and plain were replayed, several times each
    # one preparation per graph (5 chains, plain, the resume: one size at R 3), all at start-up, none after
    assert len(calls) == len(set(calls)) == 7
    assert stats.graph_prepares == {k: 1 for k in ["plain", "resume/3", "1/1/2", "2/1/3", "3/1/4", "4/1/5", "5/1/6"]}


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
def test_adaptive_policy_is_lossless_with_the_oracle(pair, p):
    target, drafter, prompts, plain = pair
    oracle = OracleDrafter(drafter, torch.cat([prompts, plain], 1), p, CFG.vocab_size, start=prompts.shape[1] - 1)
    # costs as on the H200 at B 1 (ms: a verify forward ~1.7x a decode step at N 4): the decisions do not depend
    # on this machine's timings
    costs = {"plain": 2.2, "resume/8": 0.8, "resume/64": 0.9, **{f"{s}/1/{s + 1}": 2.2 + 0.5 * s + 0.8 * s for s in range(1, 6)}}
    out, stats = generate_speculative(target, oracle, prompts, plain.shape[1], SpecConfig(),
                                      policy=AdaptivePolicy(costs=costs))
    assert torch.equal(out, plain)
    if p == 0.0:  # every draft rejected: after its first evidence the policy decodes plainly
        assert stats.accepted == 0 and stats.decisions.get(PLAIN, 0) > sum(stats.decisions.values()) / 2
    if p == 1.0:  # every draft accepted: the cheap probe (2 of the 39 tokens), then the 37 left in the least time
        # any schedule takes: a round of s drafts costs 2.2 + 1.3 s for s + 1 tokens, so at least 7 rounds and 30
        # drafts, 54.4, every round's tokens counted (5/1/6 x7, its last round cut by max_new, would take 60.9; an
        # exact expected-round count in rate, tried and not kept (docs/e2e.md), made 1/1/2 x2, 2/1/3, 3/1/4 x2,
        # 5/1/6 x4: 58.8 in all against 57.9)
        made = sum(costs[k] * n for k, n in stats.decisions.items()) + stats.resumes * costs["resume/8"]
        assert stats.decisions["1/1/2"] == 1 and made == pytest.approx(3.5 + 2.2 * 7 + 1.3 * 30, rel=5e-3)
        assert stats.accept_rate > 0.9


def test_sampled_plain_rounds_keep_the_sampler(pair):
    """Temperature > 0 through plain and speculative rounds alike: verify_sampling at N = 1 is the plain pick, so
    the run is deterministic in its seed and emits valid tokens."""
    target, drafter, prompts, _ = pair
    spec = SpecConfig(temperature=1.0, seed=3)
    a, _ = generate_speculative(target, drafter, prompts, 20, spec, policy=Scripted([0, 2, 0, 0, 1]))
    b, _ = generate_speculative(target, drafter, prompts, 20, spec, policy=Scripted([0, 2, 0, 0, 1]))
    assert torch.equal(a, b) and ((a >= 0) & (a < CFG.vocab_size)).all()


def test_policy_refuses_what_it_cannot_run(pair):
    from eagle3_ops.engine import Timer

    target, drafter, prompts, _ = pair
    with pytest.raises(ValueError, match="policy runs eager or with graphs='round'"):
        generate_speculative(target, drafter, prompts, 8, SpecConfig(), policy=AdaptivePolicy(), graphs="steps")
    with pytest.raises(ValueError, match="without a timer"):
        generate_speculative(target, drafter, prompts, 8, SpecConfig(), policy=AdaptivePolicy(), timer=Timer())
    with pytest.raises(ValueError, match="steps must be chain lengths"):
        AdaptivePolicy(steps=[0, 2])


def test_model_by_hand():
    """Two requests, chain costs 2.0 (plain), 3.0 (1 draft), 3.5 (2 drafts): the evidence, the per-depth estimates,
    E_b(S), and the static batch's expected rounds and rate."""
    pol = AdaptivePolicy(steps=(1, 2), prior=1.0, prior_weight=1.0, forget=1.0, request_weight=4.0)
    costs = {PLAIN: 2.0, "resume/8": 0.5, "resume/64": 0.7, "1/1/2": 3.0, "2/1/3": 3.5}
    specs = pol.shapes(SpecConfig())
    pol.start(2, costs, specs)
    # the first round is the probe, valued under the uniform prior: 2 x H_2 / 3.0 = 1.0 < 2 x H_3 / 3.5 = 1.048
    assert pol.choose([True, True], 0) == specs[1]
    assert pol.uninformed_tokens(0, 2) == pytest.approx(1 + 1 / 2 + 1 / 3)
    # request 0 accepts 1 of 2 drafts (depth 0 accepted, depth 1 rejected); request 1 none (depth 1 untested)
    lp = math.log(0.5)
    pol.launched(specs[1], None)
    pol.observe(specs[1], [True, True], [1, 0], [[0.0, lp], [0.0, lp]], None)
    # request 0, depth 0: the other's evidence over the prior (weight 1), Beta(1 + 0, 0 + 1), holds 2 drafts, so
    # it weighs min(v = 4, 2) = 2 against request 0's own 1 of 1: Beta(1 + 1, 1 + 0), 2/3. Depth 1: the other's
    # (none) over 2/3 at depth_weight 4, then its own rejection: (4 x 2/3 + 0) / (4 + 1) = 8/15
    a, c, al = pol.posterior(0)
    assert (a, c) == pytest.approx((2, 1)) and al[:2] == pytest.approx([2 / 3, 8 / 15])
    # request 1, depth 0: Beta(1 + 1, 0) over 2 drafts, at weight 2: Beta(2, 0), then its own rejection: Beta(2, 1);
    # depth 1: request 0's rejection over 2/3 at 4, (4 x 2/3 + 0) / 5 = 8/15, its own none
    a, c, al = pol.posterior(1)
    assert (a, c) == pytest.approx((2, 1)) and al[:2] == pytest.approx([2 / 3, 8 / 15])
    # confidence 0.5 at depth 1 against a mean 1 + 0.2 (0.5 - 1) = 0.9: factor (0.5 / 0.9) ** (1/2), the default
    q1 = 8 / 15 * math.sqrt(0.5 / 0.9)
    mean = 1 + 2 / 3 + 2 / 3 * q1
    assert pol.expected_tokens(0, 2) == pytest.approx(mean) and pol.expected_tokens(1, 2) == pytest.approx(mean)
    var = 1 + 3 * 2 / 3 + 5 * 2 / 3 * q1 - mean ** 2  # E[X^2] - E[X]^2: P(X >= m) weighs m^2 - (m - 1)^2
    assert pol.emission(0, 2)[1] == pytest.approx(var)
    # no max_new: HORIZON tokens left each; the batch's rounds are the slowest request's, z_2 = E[max of 2 normals]
    # = 1 / sqrt(pi) standard deviations of the count over the mean
    n = HORIZON / mean + (1 / math.sqrt(math.pi)) * math.sqrt(HORIZON * var / mean ** 3)
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert pol.rounds_left(specs[1], [True, True]) == pytest.approx(n, rel=1e-6)
    assert pol.rate(specs[1], [True, True], 0) == pytest.approx(2 * HORIZON / (3.5 * n), rel=1e-6)
    assert pol.rate(None, [True, True], 0) == pytest.approx(2 * HORIZON / (2.0 * HORIZON))  # plain: 1 / T(plain)
    # after plain rounds the resume once on top; at one request decoding, no spread (z_1 = 0)
    assert pol.rate(specs[1], [True, True], 2) == pytest.approx(2 * HORIZON / (3.5 * n + 0.5), rel=1e-6)
    assert pol.rate(specs[1], [True, False], 0) == pytest.approx(mean / 3.5, rel=1e-6)


def test_chain_dp():
    """ChainDP by hand, 2 tokens left, plain 1.0 a round, Beta(1, 1): plain twice costs 2.0; a 1-draft chain at
    1.4 emits both with probability 1/2, else one and a plain round follows: 1.4 + 1/2 = 1.9, so it runs; after
    plain rounds (the resume, 0.2, on top) 2.1: plain. At 1.5 the chain ties plain (2.0) and plain is kept."""
    spec = [SpecConfig(steps=1, topk=1, num_tokens=2)]
    for cost, lag, want in [(1.4, False, "1/1/2"), (1.4, True, PLAIN), (1.5, False, PLAIN)]:
        dp = ChainDP({PLAIN: 1.0, "1/1/2": cost}, spec, 1.0, 1.0, 2, 0.2)
        assert label(dp.decide(2, lag, 0, 0)) == want, (cost, lag)
        assert dp.V[2, int(lag), 0, 0] == pytest.approx(min(2.0, cost + 0.2 * lag + 0.5))
        assert label(dp.decide(1, lag, 0, 0)) == PLAIN  # one token left: no draft can count
    # at B 1 a run within EXACT_HORIZON is ChainDP's: the policy decides as the table it solved at start
    costs = h200_costs((1, 4096))
    pol = AdaptivePolicy(costs=costs)
    pol.start(1, costs, pol.shapes(SpecConfig()), 61)
    assert pol.dp is not None and pol.choose([True], 0) == pol.dp.decide(60, False, 0, 0)


def test_request_weight_from_the_spread():
    """request_weight None: v from the requests' spread at depth 0 (empirical Bayes). Rates as alike as binomial
    draws allow: the pooled posterior weighs all it holds (v infinite); 3 of 10 against 7 of 10: p 0.5, the spread
    10 (0.2^2 + 0.2^2) - 0.25 = 0.55 over 20 - 200 / 20 = 10, tau^2 0.055, v = 0.25 / 0.055 - 1; 1 of 10 against
    9 of 10: v below 1, held at 1."""
    pol = AdaptivePolicy(steps=(1,), forget=1.0)
    costs = {PLAIN: 1.0, "resume/8": 0.1, "resume/64": 0.1, "1/1/2": 1.5}
    pol.start(2, costs, pol.shapes(SpecConfig()), 61)
    pol.num, pol.den = [[5.0], [5.0]], [[10.0], [10.0]]
    assert pol.spread_weight() == math.inf
    pol.observed += 1  # (the weight is cached per observation)
    pol.num = [[3.0], [7.0]]
    assert pol.spread_weight() == pytest.approx(0.25 / 0.055 - 1)
    pol.observed += 1
    pol.num = [[1.0], [9.0]]
    assert pol.spread_weight() == 1.0


def test_static_batch_counts_its_slowest_request():
    """Equal mean rates, plain against a chain whose per-round emission varies: at B 1 the chain's rate is its
    mean, at B 8 the batch waits for its slowest request (z_8 = 1.42 standard deviations), so plain wins there."""
    costs = {PLAIN: 1.0, "resume/8": 0.1, "resume/64": 0.1, "1/1/2": 1.45}
    for B, winner in [(1, "1/1/2"), (8, PLAIN)]:
        pol = AdaptivePolicy(steps=(1,), costs=costs, forget=1.0)
        specs = pol.shapes(SpecConfig())
        pol.start(B, costs, specs, 61)
        for b in range(B):  # half the first drafts accepted, known well: alpha ~ 0.5, E(1) = 1.5 > 1.45
            pol.num[b][0], pol.den[b][0] = 40.0, 80.0
        assert label(pol._best([True] * B, 0)) == winner, B


def test_a_probe_is_worth_what_it_teaches_while_tokens_remain():
    """The look-ahead past ChainDP's reach (exact=False: as at B > 1 or past EXACT_HORIZON), B 1 on the H200's
    slice table, the optimistic prior: the first probe (1/1/2) rejected, the posterior alone says plain; with 59
    tokens left a second probe pays for what its outcome teaches (explore), with 20 left it does not."""
    costs = h200_costs((1, 4096))
    for counted, probes in [(2, True), (41, False)]:
        pol = AdaptivePolicy(costs=costs, prior=1.0, exact=False)  # after the rejection: Beta(1, 1)
        specs = pol.shapes(SpecConfig())
        pol.start(1, costs, specs, 61)
        first = pol.choose([True], 0)
        pol.launched(first, None)
        pol.observe(first, [True], [0], [[0.0]], None, counts=[counted])
        assert pol._best([True], 0) is None
        assert (pol.choose([True], 0) is not None) == probes, counted


def test_forgetting_brings_a_failed_request_back():
    """At p = 0 the policy falls back to plain decoding, and the decaying evidence makes it probe again later."""
    # (a budget that does not bind and no lookahead: the evidence decides)
    pol = AdaptivePolicy(steps=(1,), prior=1.0, forget=0.9, budget=1.0, lookahead=False, exact=False)
    specs = pol.shapes(SpecConfig())
    pol.start(1, {PLAIN: 1.0, "resume/8": 0.1, "resume/64": 0.1, "1/1/2": 1.5}, specs)
    assert pol.choose([True], 0) == specs[0]
    for _ in range(3):
        pol.launched(specs[0], None)
        pol.observe(specs[0], [True], [0], [[0.0]], None)
    assert pol.choose([True], 0) is None
    rounds = 0
    while pol.choose([True], 1) is None and rounds < 1000:
        pol.launched(None, None)
        pol.observe(None, [True], [0], None, None)
        rounds += 1
    assert 5 < rounds < 60


def test_plain_only_where_no_shape_can_beat_plain(pair):
    """A table where every chain of s drafts costs at least s + 1 plain steps (one at exactly that): no round can
    beat plain's tokens per second even with every draft accepted, so the policy declares plain_only at start and
    decides plain every round: no probe, and no forced catch-up of the drafter (resume_rows 4, 39 plain rounds:
    9 resumes otherwise), through the loop (the output plain greedy's) and in simulate at B 1 (ChainDP's reach)
    and B 8. One chain a little cheaper than that and it probes."""
    target, drafter, prompts, plain = pair
    chains = {f"{s}/1/{s + 1}": s + 1.0 + 0.1 * (s - 1) for s in range(1, 6)}  # 1/1/2: exactly 2 plain steps
    costs = {PLAIN: 1.0, "resume/4": 0.3, "resume/8": 0.3, "resume/64": 0.4, **chains}
    oracle = OracleDrafter(drafter, torch.cat([prompts, plain], 1), 1.0, CFG.vocab_size, start=prompts.shape[1] - 1)
    pol = AdaptivePolicy(costs=costs, resume_rows=4)
    out, stats = generate_speculative(target, oracle, prompts, plain.shape[1], SpecConfig(), policy=pol)
    assert pol.plain_only and torch.equal(out, plain)
    assert stats.decisions == {PLAIN: plain.shape[1] - 1} and stats.resumes == 0 and stats.drafted == 0
    for B in (1, 8):
        run = simulate(AdaptivePolicy(costs=costs, resume_rows=4), costs, B, 61, 1.0)
        assert run["decisions"] == {PLAIN: 60} and run["resumes"] == 0
        assert run["seconds"] == pytest.approx(60 * costs[PLAIN])
    cheaper = dict(costs, **{"1/1/2": 1.99})
    pol = AdaptivePolicy(costs=cheaper, exact=False)
    pol.start(8, cheaper, pol.shapes(SpecConfig()), 61)
    assert not pol.plain_only and label(pol.choose([True] * 8, 0)) == "1/1/2"


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_accept_length_solves_for_p(steps):
    for L in (1.0, 1.5, 2.4, 3.0, steps + 1.0):
        if L > steps + 1:
            continue
        p = p_for_acceptance_length(L, steps)
        assert 0.0 <= p <= 1.0 and acceptance_length(p, steps) == pytest.approx(L, abs=1e-9)
    assert p_for_acceptance_length(1.0, steps) == 0.0 and p_for_acceptance_length(steps + 1.0, steps) == 1.0
    # closed form at 3 drafts, L = 2.4: 1 + p + p^2 + p^3 = 2.4
    p = p_for_acceptance_length(2.4, 3)
    assert (1 - p ** 4) / (1 - p) == pytest.approx(2.4, abs=1e-9) and 0.66 < p < 0.67
    with pytest.raises(ValueError, match="acceptance length"):
        p_for_acceptance_length(steps + 1.5, steps)


def test_oracle_reaches_the_calibrated_acceptance_length():
    """Measured: the oracle at p(L) over many chain rounds accepts about L tokens a round (and (L - 1) / 3 of
    its drafts)."""
    L = 2.4
    p = p_for_acceptance_length(L, 3)
    ref = torch.randint(0, 1000, (1, 6000), generator=torch.Generator().manual_seed(9))
    oracle = OracleDrafter(None, ref, p, 1000, seed=4, period=7)
    # a chain round at position i proposes i, i + 1, i + 2 in three calls; accepted = the run of kept draws
    total, i, rounds = 0, 0, 0
    while i < 5900:
        pos = torch.tensor([[i]])
        acc = 0
        for s in range(3):
            right = bool(oracle.proposals(pos + s) == ref[:, i + s + 2])
            oracle.calls += 1
            if not right:
                break
            acc += 1
        total, i, rounds = total + acc + 1, i + acc + 1, rounds + 1
    assert total / rounds == pytest.approx(L, abs=0.08)


@pytest.mark.gpu
def test_gpu_policy_graphs_match_the_eager_loop():
    """On CUDA (bf16, the shipped pair): the scripted decisions replayed from captured round graphs (plain, resume
    and every chain, each captured once) give the eager loop's tokens; the graphs' memory is reported; the
    adaptive policy runs through the pinned snapshots and events."""
    from eagle3_ops import data
    from eagle3_ops.cli import _load_pair

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run with -m gpu on the H200)")
    target, drafter, _ = _load_pair("byte-small", "cuda", torch.bfloat16)
    enc = [data.encode(p) for p in data.load_heldout_prompts()[:4]]
    n = min(len(e) for e in enc)
    prompts = torch.stack([e[-n:] for e in enc]).cuda()
    script = SCRIPTS["switch"] + SCRIPTS["plain-and-back"]
    eager, _ = generate_speculative(target, drafter, prompts, 48, SpecConfig(), policy=Scripted(script, resume_rows=3))
    graphed, st = generate_speculative(target, drafter, prompts, 48, SpecConfig(), graphs=True,
                                       policy=Scripted(script, resume_rows=3))
    assert torch.equal(eager, graphed)
    assert set(st.graph_prepares.values()) == {1} and len(st.graph_prepares) == 7 and st.graph_memory > 0
    # (in bf16 another shape's verify GEMMs can flip a near-tie, so the adaptive run is held to its own decisions)
    adaptive, st = generate_speculative(target, drafter, prompts, 48, SpecConfig(), graphs=True,
                                        policy=AdaptivePolicy())
    assert sum(st.decisions.values()) == st.rounds and ((adaptive >= 0) & (adaptive < 256)).all()


# The H200's cost tables (ms), kimi-k2-slice bf16, CUDA graphs: the plain step is B over plain decoding's tokens/s,
# a chain's round its fixed run's step (mean over the five p), 4/1/5 the mean of 3/1/4's and 5/1/6's (not run),
# a resume one drafter forward (the draft part of 1/1/2's step) plus fc, 1.1 x that at 64 rows (estimates); the
# forwards (whole, dense layer, MoE layer, outside the layers) at N = 1 .. 6 give the 61-layer table (--full-costs:
# each round's forward scaled as bench_e2e._full_forward_ms scales it). B 1 and B 8 at 32768:
# bench/results/policy_fixpoint0_h200/*.log (a62169d); B 8 at 4096: e2e_graphs_b8_4096_h200.log (abf0228), which
# ran 3/1/4 and the tree only: its other chains are 3/1/4's round with the verify forward at their N (N = 2, 3, 5,
# 6 modelled from B 8 32768's forwards, scaled to this prefix's decode-to-N-4 span) and one drafter forward (1.22
# ms) a draft step more or less.
H200 = {
    (1, 4096): dict(plain=1000 / 449.0, rounds={1: 3.69, 2: 4.99, 3: 6.23, 5: 8.68}, draft=0.79,
                    fwd={1: (2.26, .58, .80, .09), 2: (2.80, .70, 1.01, .07), 3: (3.34, .82, 1.22, .07),
                         4: (3.71, .68, 1.22, .59), 5: (4.13, .88, 1.70, 0), 6: (4.48, .95, 1.96, 0)}),
    (1, 32768): dict(plain=1000 / 437.9, rounds={1: 4.04, 2: 5.70, 3: 7.26, 5: 10.34}, draft=1.09,
                     fwd={1: (2.25, .61, .87, 0), 2: (2.93, .79, 1.14, 0), 3: (3.29, .73, 1.19, .18),
                          4: (3.84, 1.01, 1.53, 0), 5: (4.36, 1.01, 1.75, 0), 6: (4.78, 1.07, 1.91, 0)}),
    (8, 4096): dict(plain=8000 / 1534.1, rounds={1: 14.50 - 10.79 + 7.46 - 2 * 1.22, 2: 14.50 - 10.79 + 9.12 - 1.22,
                                                 3: 14.50, 5: 14.50 - 10.79 + 13.51 + 2 * 1.22}, draft=1.22,
                    fwd={1: (5.09, 1.14, 2.15, 0), 2: (7.46, 1.54, 3.15, 0), 3: (9.12, 1.68, 3.72, 0),
                         4: (10.79, 1.79, 5.16, 0), 5: (11.65, 1.90, 5.37, 0), 6: (13.51, 2.12, 6.28, 0)}),
    (8, 32768): dict(plain=8000 / 1465.9, rounds={1: 11.84, 2: 17.13, 3: 22.37, 5: 32.3}, draft=3.70,
                     fwd={1: (5.54, 1.24, 2.29, 0), 2: (8.11, 1.67, 3.86, 0), 3: (9.90, 1.82, 4.63, 0),
                          4: (11.71, 1.91, 5.50, 0), 5: (12.64, 2.04, 5.93, 0), 6: (14.65, 2.28, 6.92, 0)}),
}
LENGTHS = (1.0, 1.5, 2.4, 3.0, 4.0)  # the done-when's oracle acceptance lengths (3 drafts)


def h200_costs(key, full=False) -> dict:
    """The cost table {label: seconds} of H200[key]; full: each round's forward scaled to kimi-k2's 61 layers."""
    t, layers = H200[key], TargetConfig.from_preset("kimi-k2").num_layers
    r = {**t["rounds"], 4: (t["rounds"][3] + t["rounds"][5]) / 2}
    ms = {PLAIN: t["plain"], "resume/8": t["draft"] + 0.08, "resume/64": 1.1 * t["draft"] + 0.08,
          **{f"{s}/1/{s + 1}": r[s] for s in range(1, 6)}}
    if full:
        for name, n in [(PLAIN, 1)] + [(f"{s}/1/{s + 1}", s + 1) for s in range(1, 6)]:
            whole, dense, moe, outside = t["fwd"][n]
            ms[name] += outside + dense + (layers - 1) * moe - whole
    return {k: v / 1e3 for k, v in ms.items()}


TABLES = [(key, full) for key in H200 for full in (False, True)]
TABLE_IDS = [f"B{k[0]}-P{k[1]}-{'61layers' if f else 'slice'}" for k, f in TABLES]


def expected_rate(costs, B, p, steps) -> float:
    """Tokens per second of a chain of `steps` drafts (0: plain) repeated, the ORACLE at p: B L(p) / T."""
    return B * sum(p ** k for k in range(steps + 1)) / costs[PLAIN if steps == 0 else f"{steps}/1/{steps + 1}"]


@pytest.mark.parametrize("key,full", TABLES, ids=TABLE_IDS)
def test_first_probe_prices_its_cost(key, full):
    """Past ChainDP's reach, the first round is the chain of the best rate under the uniform prior (H_{S+1} tokens
    over its cost), never the longest chain for being the longest: on the H200's slice tables the cheapest (1/1/2)."""
    costs, B = h200_costs(key, full), key[0]
    pol = AdaptivePolicy(costs=costs, exact=False)  # (at B 1 ChainDP decides a 61-token run: test_chain_dp)
    specs = pol.shapes(SpecConfig())
    pol.start(B, costs, specs, 61)
    first = pol.choose([True] * B, 0)
    harmonic = {s.steps: sum(1 / (k + 1) for k in range(s.steps + 1)) / costs[label(s)] for s in specs}
    assert first.steps == max(harmonic, key=harmonic.get)
    if not full:
        assert label(first) == "1/1/2"


@pytest.mark.parametrize("key,full", TABLES, ids=TABLE_IDS)
def test_overhead_at_p0_is_bounded(key, full):
    """At p = 0, in the cost table's terms, the run's time over plain decoding's is within the policy docstring's
    bound, A + eps n T(plain) + F_n, at 61 tokens and at 1201; at 61 tokens (the done-when's runs) it is within 3%
    (the probes' excess: 1.1% to 2.4%) on every H200 table."""
    costs, B = h200_costs(key, full), key[0]
    for max_new in (61, 1201):
        pol = AdaptivePolicy(costs=costs)
        run = simulate(pol, costs, B, max_new, 0.0)
        n = max_new - 1
        plain = n * costs[PLAIN]
        forced = n // pol.resume_rows * costs[f"resume/{pol.resume_rows}"]
        assert run["seconds"] - plain <= pol.allowance + pol.budget * plain + forced + 1e-9
        assert run["accepted"] == 0 and run["decisions"][PLAIN] >= 0.9 * n
        if max_new == 61:
            assert run["seconds"] / plain - 1 <= 0.03, run["decisions"]


def test_budget_binds_where_speculation_is_nearly_free():
    """A table where a chain costs 1% more than a plain step: the posterior alone would keep speculating at p = 0
    for ~100 rounds (a rejection moves alpha little when so little is needed); the regret budget stops it."""
    costs = {PLAIN: 1.0, "resume/8": 0.05, "resume/64": 0.06, **{f"{s}/1/{s + 1}": 1.0 + 0.01 * s for s in range(1, 6)}}
    pol = AdaptivePolicy(costs=costs)
    run = simulate(pol, costs, 1, 601, 0.0)
    assert run["seconds"] - 600 <= pol.allowance + pol.budget * 600 + 1e-9
    assert pol.regret <= pol.allowance + pol.budget * pol.rounds + 1e-9


@pytest.mark.parametrize("key,full", TABLES, ids=TABLE_IDS)
def test_decisions_maximise_tokens_per_second(key, full):
    """Simulated with the H200's costs (adaptive.simulate: the ORACLE's acceptance drawn, run_policy's schedule)
    at the done-when's acceptance lengths: over long runs (1201 tokens) the policy's most frequent decision is
    the shape of the highest expected rate, B L_S(p) / T(S), wherever it beats the runner-up by 3%, and its
    tokens/s is within 5% of that shape's expected rate; over the done-when's 61-token runs (mean of 16 seeds) it is within 6%
    of the best of plain and every fixed chain run the same way, and within 5% of plain decoding where plain is
    the best (the probe pays on its own or costs a round)."""
    costs, B = h200_costs(key, full), key[0]
    for L in LENGTHS:
        p = p_for_acceptance_length(L, 3)
        rates = {s: expected_rate(costs, B, p, s) for s in range(6)}
        best = max(rates, key=rates.get)
        runner_up = max(v for s, v in rates.items() if s != best)
        long = simulate(AdaptivePolicy(costs=costs), costs, B, 1201, p, seed=1)
        if rates[best] > 1.03 * runner_up:
            top = max(long["decisions"], key=long["decisions"].get)
            assert top == (PLAIN if best == 0 else f"{best}/1/{best + 1}"), (L, rates, long["decisions"])
        # (one seed's draws: ~2% of sampling noise on a long run's acceptance)
        assert long["tok_s"] >= 0.95 * rates[best], (L, long["tok_s"] / rates[best], long["decisions"])
        seeds = range(16)
        mean = sum(simulate(AdaptivePolicy(costs=costs), costs, B, 61, p, seed=i)["tok_s"] for i in seeds) / 16
        fixed = [sum(simulate(FixedPolicy(steps=s, topk=1, num_tokens=s + 1), costs, B, 61, p, seed=i)["tok_s"]
                     for i in seeds) / 16 for s in range(1, 6)]
        assert mean >= 0.94 * max(fixed + [rates[0]]), (L, mean / max(fixed + [rates[0]]))
        if rates[0] >= max(fixed):
            assert mean >= 0.95 * rates[0], (L, mean / rates[0])


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_simulation_follows_the_loop(pair, p):
    """simulate() makes the decisions the real loop makes (the tiny pair with the ORACLE, on the CPU: stale 0) at
    the acceptances whose outcomes are certain, under the H200's B 1 table."""
    target, drafter, prompts, plain = pair
    costs = h200_costs((1, 4096))
    oracle = OracleDrafter(drafter, torch.cat([prompts[:1], plain[:1]], 1), p, CFG.vocab_size,
                           start=prompts.shape[1] - 1)
    _, stats = generate_speculative(target, oracle, prompts[:1], plain.shape[1], SpecConfig(),
                                    policy=AdaptivePolicy(costs=costs))
    sim = simulate(AdaptivePolicy(costs=costs), costs, 1, plain.shape[1], p, stale=0)
    assert stats.decisions == sim["decisions"] and stats.resumes == sim["resumes"]



# the cost table the H200 run at 95d786a measured at B 1 prefix 4096 (ms; bench/results/policy_95d786a_h200/)
RUN_95D786A_B1_4096 = {"plain": 2.2585, "resume/8": 0.9653, "resume/64": 1.1572, "1/1/2": 3.7234, "2/1/3": 5.0110,
                       "3/1/4": 6.2199, "4/1/5": 7.4570, "5/1/6": 8.7198}


class AlwaysWaits(AdaptivePolicy):
    """ChainDP's decisions as before 95d786a's follow-up: every speculative one waits for the newest round."""

    def choose_exact(self, lag):
        spec = self.dp.decide(int(self.remaining[0]), lag > 0, *self.seen)
        self.need_outcome = True
        return spec if spec is None or self.affordable(spec, lag) else None


def test_chain_dp_q_and_outcomes():
    """ChainDP.q of the decision it makes is its value V, of any other decision no less; outcomes' probabilities
    sum to 1 and cut at the tokens left."""
    costs = h200_costs((1, 4096))
    pol = AdaptivePolicy(costs=costs)
    pol.start(1, costs, pol.shapes(SpecConfig()), 61)
    dp = pol.dp
    for st in [(60, False, 0, 0), (40, False, 12, 1), (30, True, 3, 4), (3, False, 20, 0), (1, False, 5, 5)]:
        best = dp.decide(*st)
        assert dp.q(*st, best) == pytest.approx(dp.value(*st), rel=1e-12)
        assert all(dp.q(*st, s) >= dp.value(*st) - 1e-12 for s in [None] + pol._specs)
        for s in [None] + pol._specs:
            out = dp.outcomes(*st, s)
            assert sum(pr for pr, _ in out) == pytest.approx(1.0)
            assert all(0 <= nxt[0] < st[0] for _, nxt in out)


@pytest.mark.parametrize("L", [2.4, 3.0, 4.0])
def test_chain_dp_waits_only_where_the_outcome_pays(L):
    """At B 1 ChainDP's decision waits for the newest round's snapshot (the device idle for the host's read,
    decision and launch: `wait`) only where deciding blind is expected to cost more. With wait 0 every decision is
    ChainDP's own after the read (the decisions of every seed those of the policy that always waits, fewer waits:
    where the decisions after every outcome agree); at the default (0.1 ms) on the H200's B 1 4096 table of the
    95d786a run, with each wait charged in simulate, at least as fast over 32 seeds, and at L 4 (p = 1) 3 waits a
    run instead of 12."""
    costs = {k: v / 1e3 for k, v in RUN_95D786A_B1_4096.items()}
    p = p_for_acceptance_length(L, 3)
    old, same, new = [], [], []
    for seed in range(32):
        o = simulate(AlwaysWaits(costs=costs), costs, 1, 61, p, seed=seed, wait=1e-4)
        z = simulate(AdaptivePolicy(costs=costs, wait=0.0), costs, 1, 61, p, seed=seed, wait=1e-4)
        assert z["decisions"] == o["decisions"] and z["waits"] <= o["waits"], seed
        old.append(o), same.append(z), new.append(simulate(AdaptivePolicy(costs=costs), costs, 1, 61, p, seed=seed,
                                                            wait=1e-4))
    mean = {k: sum(r["tok_s"] for r in v) / len(v) for k, v in [("old", old), ("new", new)]}
    assert mean["new"] >= mean["old"], mean
    assert sum(r["waits"] for r in new) < sum(r["waits"] for r in old)
    if L == 4.0:
        assert {r["waits"] for r in old} == {12} and {r["waits"] for r in new} == {3}


def test_simulate_common_draws():
    """simulate(common=True): one draw per (request, token position), so fixed shapes meet the same easy and hard
    tokens; at p 0 and 1 as the default; the accept rate still p (a position's draft tested at most once)."""
    costs = h200_costs((8, 4096))
    for p in (0.0, 1.0):
        for s in (1, 3):
            fx = FixedPolicy(steps=s, topk=1, num_tokens=s + 1)
            a, b = simulate(fx, costs, 8, 61, p, seed=2), simulate(fx, costs, 8, 61, p, seed=2, common=True)
            assert a["decisions"] == b["decisions"] and a["accepted"] == b["accepted"]
    p = p_for_acceptance_length(2.4, 3)
    drafted = accepted = 0
    for seed in range(8):
        r = simulate(FixedPolicy(steps=3, topk=1, num_tokens=4), costs, 8, 201, p, seed=seed, common=True)
        drafted, accepted = drafted + r["drafted"], accepted + r["accepted"]
    # chains of 3 at p: accepted / drafted = (p + p^2 + p^3) / 3 over full rounds (the run's end cuts a little)
    assert accepted / drafted == pytest.approx((p + p * p + p ** 3) / 3, abs=0.03)


def test_confidence_is_damped():
    """The drafter's confidence factor enters as (c / m) ** confidence: 1/2 by default (the square root), 0 ignores
    it, 1 takes it whole; a negative exponent is refused. Why 1/2: the shipped pair's 20 held-out prompts in the
    terms of CPU_TABLES (`.venv/bin/python tests/test_policy.py heldout B CONFIDENCE`): docs/e2e.md."""
    costs = {PLAIN: 1.0, "resume/8": 0.1, "resume/64": 0.1, "1/1/2": 1.5}
    for g, want in [(0.5, math.sqrt(0.25 / 0.85)), (0.0, 1.0), (1.0, 0.25 / 0.85)]:
        pol = AdaptivePolicy(steps=(1,), confidence=g)
        pol.start(1, costs, pol.shapes(SpecConfig()), 61)
        pol.launched(pol._specs[0], None)
        # d_1 read at probability 0.25: the running mean 1 + 0.2 (0.25 - 1) = 0.85
        pol.observe(pol._specs[0], [True], [1], [[math.log(0.25)]], None, counts=[3])
        assert pol.factors(0)[0] == pytest.approx(want)
    assert AdaptivePolicy().confidence == 0.5
    with pytest.raises(ValueError, match="confidence >= 0"):
        AdaptivePolicy(confidence=-1.0)


def test_cpu_cost_table_takes_turns_and_the_least():
    """On the CPU the start-up cost table times every graph once a pass, COST_REPS passes, and keeps each one's
    least time (a load burst falls on every shape alike, and only ever slows a round down); on CUDA each graph's
    median of its own replays (RoundGraph.measure), as before."""
    from eagle3_ops.engine.adaptive import measure_costs

    order = []

    class Fake:
        def __init__(self, name, times):
            self.name, self.times = name, list(times)

        def measure(self, reps):
            order.append((self.name, reps))
            return self.times.pop(0) if reps == 1 else sorted(self.times)[len(self.times) // 2]

    graphs = {"plain": Fake("plain", [3.0, 1.0, 2.0]), "1/1/2": Fake("1/1/2", [5.0, 9.0, 4.0])}
    assert measure_costs(graphs, 3, cuda=False) == {"plain": 1.0, "1/1/2": 4.0}
    assert order == [("plain", 1), ("1/1/2", 1)] * 3
    order.clear()
    graphs = {"plain": Fake("plain", [3.0, 1.0, 2.0]), "1/1/2": Fake("1/1/2", [5.0, 9.0, 4.0])}
    assert measure_costs(graphs, 3, cuda=True) == {"plain": 2.0, "1/1/2": 5.0}
    assert order == [("plain", 3), ("1/1/2", 3)]

def simulated_table(seeds: int = 32, max_new: int = 61, make=AdaptivePolicy, wait: float = 0.0) -> list[tuple]:
    """docs/e2e.md's simulated table: per H200 table and acceptance length, mean over `seeds` of adaptive's
    tokens/s over plain's, and over the best of plain and the fixed chains 1, 2, 3, 5 (the same seeds' draws),
    with that best; `wait`: seconds charged for each time adaptive's host waits for the newest round (simulate;
    the fixed loops never wait). Rows (key, full, L, adaptive / plain, adaptive / best, best's label)."""
    rows = []
    for key, full in TABLES:
        costs, B = h200_costs(key, full), key[0]
        plain = B / costs[PLAIN]
        for L in LENGTHS:
            p = p_for_acceptance_length(L, 3)
            ada = sum(simulate(make(costs=costs), costs, B, max_new, p, seed=i, wait=wait)["tok_s"]
                      for i in range(seeds)) / seeds
            fixed = {PLAIN: plain}
            for s in (1, 2, 3, 5):
                fixed[f"{s}/1/{s + 1}"] = sum(simulate(FixedPolicy(steps=s, topk=1, num_tokens=s + 1), costs, B,
                                                       max_new, p, seed=i)["tok_s"] for i in range(seeds)) / seeds
            best = max(fixed, key=fixed.get)
            rows.append((key, full, L, ada / plain, ada / fixed[best], best))
    return rows


# Cost tables the shipped pair's adaptive runs measured at start-up on this session's shared 2-core VM (128
# tokens, float32, eager, 1 thread; ms; each graph's median of 5 rounds, the measurement before measure_costs): B 20
# one run's, B 4 each entry's least of two runs'. On the CPU a round's cost grows with B x N.
CPU_TABLES = {
    20: {"plain": 47.02, "resume/8": 10.32, "resume/64": 28.44, "1/1/2": 62.91, "2/1/3": 74.2, "3/1/4": 85.28,
         "4/1/5": 98.07, "5/1/6": 111.87},
    4: {"plain": 17.47, "resume/8": 3.07, "resume/64": 6.75, "1/1/2": 22.36, "2/1/3": 24.94, "3/1/4": 27.88,
        "4/1/5": 32.03, "5/1/6": 34.96},
}


def heldout_table_time(B: int, costs_ms: dict, **policy_kw) -> tuple[float, float, dict]:
    """The shipped pair on its 20 held-out prompts in groups of B (128 tokens, float32, eager): the adaptive
    policy deciding from the given cost table, and fixed 3/1/4, each run's time in that table's terms (the
    decisions' costs summed, resumes at resume/8; fixed: its rounds x T(3/1/4)), so the comparison is free of this
    machine's timing noise. Returns (fixed seconds, adaptive seconds, the adaptive decisions); both outputs are
    checked against plain greedy."""
    from eagle3_ops import data
    from eagle3_ops.cli import _load_pair

    target, drafter, _ = _load_pair("byte-small", "cpu", torch.float32)
    enc = [data.encode(p) for p in data.load_heldout_prompts()[:20]]
    n = min(len(e) for e in enc)
    prompts = torch.stack([e[-n:] for e in enc])
    costs = {k: v / 1e3 for k, v in costs_ms.items()}
    fixed = adaptive = 0.0
    decisions = {}
    for i in range(0, len(prompts), B):
        grp = prompts[i:i + B]
        ref, _ = generate_plain(target, grp, 128)
        f, sf = generate_speculative(target, drafter, grp, 128, SpecConfig(steps=3, topk=1, num_tokens=4))
        a, sa = generate_speculative(target, drafter, grp, 128, SpecConfig(),
                                     policy=AdaptivePolicy(costs=costs, **policy_kw))
        assert torch.equal(f, ref) and torch.equal(a, ref)
        fixed += sf.rounds * costs["3/1/4"]
        adaptive += sum(c * costs[k] for k, c in sa.decisions.items()) + sa.resumes * costs["resume/8"]
        for k, c in sa.decisions.items():
            decisions[k] = decisions.get(k, 0) + c
    return fixed, adaptive, decisions


def replay(folder: str, seeds: int = 32, wait: float = 0.0) -> None:
    """An H200 policy run replayed in the simulation with its own cost tables (bench_e2e's JSONs in `folder`, one
    per batch and prefix, each adaptive row's costs_ms and decisions): per L, the simulated adaptive / plain (mean
    and sd over seeds) and / the best simulated fixed chain, against the H200 row's decisions in the same table's
    terms (60 x T(plain) over the sum of its decisions' costs) and as measured."""
    import glob
    import json

    for path in sorted(glob.glob(f"{folder}/policy_b*_*.json")):
        rows = json.load(open(path))["rows"]
        ada = {r["accept_length_target"]: r for r in rows if r["spec"] == "adaptive"}
        if not ada:
            continue
        first = next(iter(ada.values()))
        B, ms = first["batch"], first["costs_ms"]
        costs = {k: v / 1e3 for k, v in ms.items()}
        plain = B / costs[PLAIN]
        for L, r in sorted(ada.items()):
            p = p_for_acceptance_length(L, 3)
            runs = [simulate(AdaptivePolicy(costs=costs), costs, B, r["max_new"] if "max_new" in r else 61, p,
                             seed=i, wait=wait) for i in range(seeds)]
            a = [x["tok_s"] / plain for x in runs]
            mean = sum(a) / seeds
            sd = math.sqrt(sum((x - mean) ** 2 for x in a) / seeds)
            best = max([1.0] + [sum(simulate(FixedPolicy(steps=s, topk=1, num_tokens=s + 1), costs, B, 61, p,
                                             seed=i)["tok_s"] for i in range(seeds)) / seeds / plain
                                for s in (1, 2, 3, 5)])
            tab = sum(ms[k] * n for k, n in r["decisions"].items()) + r["resumes"] * ms["resume/8"]
            same = [x["decisions"] for x in runs].count(r["decisions"])
            print(f"B {B} prefix {r['prefix']} L {L:g}: simulated {mean:.3f} (sd {sd:.3f}) of plain, {mean / best:.3f} "
                  f"of the best; the H200's decisions {60 * ms[PLAIN] / tab:.3f} of plain in its table's terms, "
                  f"measured {r['speedup']:.3f}; {same} of {seeds} seeds decide as the H200 did ({r['decisions']})")


if __name__ == "__main__":
    # .venv/bin/python tests/test_policy.py: the simulated table, as docs/e2e.md gives it;
    # .venv/bin/python tests/test_policy.py heldout B CONFIDENCE: heldout_table_time on CPU_TABLES[B];
    # .venv/bin/python tests/test_policy.py wait SECONDS [old]: the table with each host wait charged SECONDS (old:
    # ChainDP's decisions waiting for every speculative round, as before 95d786a's follow-up)
    # .venv/bin/python tests/test_policy.py replay FOLDER: an H200 policy run replayed with its own cost tables
    import sys

    if sys.argv[1:2] == ["replay"]:
        replay(sys.argv[2])
        sys.exit()
    if sys.argv[1:2] == ["heldout"]:
        B, g = int(sys.argv[2]), float(sys.argv[3])
        fixed, adaptive, decisions = heldout_table_time(B, CPU_TABLES[B], confidence=g)
        print(f"B {B} confidence {g}: fixed 3/1/4 {fixed:.3f} s, adaptive {adaptive:.3f} s in CPU_TABLES[{B}]'s terms: "
              f"adaptive / fixed {fixed / adaptive:.3f} (speed); decisions {decisions}")
        sys.exit()
    waited = sys.argv[1:2] == ["wait"]
    rows = simulated_table(make=AlwaysWaits if sys.argv[3:4] == ["old"] else AdaptivePolicy,
                           wait=float(sys.argv[2]) if waited else 0.0)
    print("| table | " + " | ".join(f"L {L:g}" for L in LENGTHS) + " |\n|---|" + "---|" * len(LENGTHS))
    for key, full in TABLES:
        cells = [f"{a:.3f}, {b:.3f} ({best})" for k, f, L, a, b, best in rows if (k, f) == (key, full)]
        print(f"| B {key[0]} prefix {key[1]} {'61-layer' if full else 'slice'} | " + " | ".join(cells) + " |")
    low = [r for r in rows if min(r[3], r[4]) < 0.97]
    print(f"{len(rows) - len(low)} of {len(rows)} cells >= 0.97 of plain and of the best fixed chain")
