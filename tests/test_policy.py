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
from eagle3_ops.engine.policy import PLAIN, AdaptivePolicy, label
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
    if p == 1.0:  # every draft accepted: the longest chain
        assert stats.decisions == {"5/1/6": stats.rounds} and stats.accept_rate > 0.9


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
    """Two requests, chain costs 2.0 (plain), 3.0 (1 draft), 3.5 (2 drafts): the evidence, E_b(S), the rate."""
    pol = AdaptivePolicy(steps=(1, 2), prior=1.0, prior_weight=1.0, forget=1.0)
    costs = {PLAIN: 2.0, "resume/8": 0.5, "resume/64": 0.7, "1/1/2": 3.0, "2/1/3": 3.5}
    specs = pol.shapes(SpecConfig())
    pol.start(2, costs, specs)
    assert pol.rate(None, [True, True], 0) == 1.0 and pol.choose([True, True], 0) == specs[1]  # 6 / 3.5 > 1
    # request 0 accepts 1 of 2 drafts (depth 0 accepted, depth 1 rejected); request 1 none (depth 1 untested)
    lp = math.log(0.5)
    pol.observe(specs[1], [True, True], [1, 0], [[0.0, lp], [0.0, lp]], None)
    assert pol.alpha(0, 0) == 1.0 and pol.alpha(0, 1) == 0.5  # (1 + 1) / (1 + 1); (1 * 1 + 0) / (1 + 1)
    assert pol.alpha(1, 0) == 0.5 and pol.alpha(1, 1) == 0.5  # (1 + 0) / (1 + 1); untested: depth 0's
    # confidence 0.5 at depth 1 against a mean 1 + 0.2 (0.5 - 1) = 0.9: factor 0.5 / 0.9
    q01 = min(1.0, 0.5 * 0.5 / 0.9)
    assert pol.expected_tokens(0, 2) == pytest.approx(1 + 1 + q01)
    assert pol.expected_tokens(1, 2) == pytest.approx(1 + 0.5 + 0.5 * min(1.0, 0.5 * 0.5 / 0.9))
    e1 = pol.expected_tokens(0, 1) + pol.expected_tokens(1, 1)
    assert pol.rate(specs[0], [True, True], 0) == pytest.approx(e1 / 3.0)
    assert pol.rate(specs[0], [True, True], 2) == pytest.approx(e1 / 3.5)  # after plain rounds: the resume too
    assert pol.rate(specs[0], [True, True], 9) == pytest.approx(e1 / 3.7)  # 9 pending rows: the 64-row resume
    assert pol.rate(specs[0], [True, False], 0) == pytest.approx(pol.expected_tokens(0, 1) / 3.0)


def test_forgetting_brings_a_failed_request_back():
    """At p = 0 the policy falls back to plain decoding, and the decaying evidence makes it probe again later."""
    pol = AdaptivePolicy(steps=(1,), forget=0.9)
    specs = pol.shapes(SpecConfig())
    pol.start(1, {PLAIN: 1.0, "resume/8": 0.1, "resume/64": 0.1, "1/1/2": 1.5}, specs)
    assert pol.choose([True], 0) == specs[0]
    pol.observe(specs[0], [True], [0], [[0.0]], None)
    for _ in range(2):
        pol.observe(specs[0], [True], [0], [[0.0]], None)
    assert pol.choose([True], 0) is None
    rounds = 0
    while pol.choose([True], 1) is None:
        pol.observe(None, [True], [0], None, None)
        rounds += 1
    assert 5 < rounds < 60


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
