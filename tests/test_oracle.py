"""The labelled oracle drafter (eagle3_ops.engine.oracle): it controls acceptance (p = 1: every proposal
accepted; p = 0, the adversarial drafter: none), the decode loop stays lossless with it, and its proposals
are deterministic, never the reference token when corrupted, and about a fraction p correct."""

from __future__ import annotations

import pytest
import torch

from eagle3_ops.engine import SpecConfig, generate_plain, generate_speculative
from eagle3_ops.engine.oracle import OracleDrafter
from eagle3_ops.models.config import DrafterConfig, TargetConfig
from eagle3_ops.models.drafter import Drafter
from eagle3_ops.models.target import Target

CFG = TargetConfig.from_preset("tiny")


@pytest.fixture(scope="module")
def pair():
    target = Target.synthesize(CFG, seed=0).eval()
    drafter = Drafter.synthesize(DrafterConfig.for_target(CFG), target.model.embed_tokens, seed=1).eval()
    prompts = torch.randint(0, CFG.vocab_size, (3, 9), generator=torch.Generator().manual_seed(2))
    plain, _ = generate_plain(target, prompts, 24)
    return target, drafter, prompts, plain


@pytest.mark.parametrize("p, spec", [(1.0, SpecConfig(steps=3, topk=1, num_tokens=4)),
                                     (0.0, SpecConfig(steps=3, topk=1, num_tokens=4)),
                                     (0.0, SpecConfig(steps=4, topk=4, num_tokens=16)),  # adversarial in a tree
                                     (0.6, SpecConfig(steps=3, topk=1, num_tokens=4)),
                                     (1.0, SpecConfig(steps=3, topk=2, num_tokens=6))])
def test_oracle_controls_acceptance_and_stays_lossless(pair, p, spec):
    target, drafter, prompts, plain = pair
    oracle = OracleDrafter(drafter, torch.cat([prompts, plain], 1), p, CFG.vocab_size)
    out, stats = generate_speculative(target, oracle, prompts, plain.shape[1], spec)
    assert torch.equal(out, plain)
    if p == 1.0:  # every round but the last (cut at max_new) emits the tree's depth + 1 tokens
        assert stats.accept_hist[spec.steps + 1] >= sum(stats.accept_hist) - prompts.shape[0]
        # and the loop ran no round past the first one a request could finish in (its stop test starts there)
        assert stats.rounds == -(-(plain.shape[1] - 1) // (spec.steps + 1))
    elif p == 0.0:
        assert stats.acceptance_length == 1.0
    else:
        assert 1.0 < stats.acceptance_length < spec.steps + 1


def test_oracle_proposals_are_deterministic_and_corrupt_at_rate_one_minus_p():
    ref = torch.randint(0, 50, (4, 300), generator=torch.Generator().manual_seed(3))
    oracle = OracleDrafter(None, ref, 0.7, 50, seed=5)
    pos = torch.arange(290).expand(4, 290)
    a, b = oracle.proposals(pos), oracle.proposals(pos)
    assert torch.equal(a, b)
    right = a == ref[:, 2:292]
    assert 0.6 < right.float().mean() < 0.8
    oracle.calls += 1  # a new draw next time
    assert not torch.equal(oracle.proposals(pos), a)
    assert ((oracle.proposals(pos) >= 0) & (oracle.proposals(pos) < 50)).all()
    with pytest.raises(ValueError, match="p must be in"):
        OracleDrafter(None, ref, 1.5, 50)


@pytest.mark.parametrize("max_new", [1, 2, 5])
def test_short_generations_stop_on_time(pair, max_new):
    # the stop test's start (no request can finish before round ceil((max_new - 1) / (steps + 1))) at its edges
    target, drafter, prompts, plain = pair
    for p in (1.0, 0.0):
        oracle = OracleDrafter(drafter, torch.cat([prompts, plain], 1), p, CFG.vocab_size)
        out, stats = generate_speculative(target, oracle, prompts, max_new, SpecConfig(steps=3, topk=1, num_tokens=4))
        assert torch.equal(out, plain[:, :max_new])
        assert stats.rounds == (-(-(max_new - 1) // 4) if p == 1.0 else max_new - 1)


@pytest.mark.parametrize("p", [0.47, 0.8])
def test_oracle_draws_of_one_chain_are_independent(p):
    # A chain's steps draw at (position i, calls c), (i + 1, c + k), (i + 2, c + 2k): keep-all must be about p^n,
    # not shifted copies of one draw (an affine hash made p = 0.47 never accept two in a row).
    L, n = 4000, 3
    ref = torch.randint(0, 1000, (1, L + 8), generator=torch.Generator().manual_seed(4))
    oracle = OracleDrafter(None, ref, p, 1000, seed=2)
    for k in (1, 2, 3):
        keeps = []
        for j in range(n):
            oracle.calls.fill_(1000 + j * k)
            pos = torch.arange(L)[None] + j
            keeps.append(oracle.proposals(pos) == ref[:, j + 2:j + 2 + L])
        both = keeps[0] & keeps[1]
        all3 = both & keeps[2]
        assert abs(keeps[0].float().mean() - p) < 0.03
        assert abs(both.float().mean() - p ** 2) < 0.03, k
        assert abs(all3.float().mean() - p ** 3) < 0.03, k


def test_oracle_scores_rank_every_token_and_put_the_proposal_first():
    class Stub:  # the wrapped drafter's forward: its hidden passes through, its scores are replaced
        cfg = None

        def forward(self, tokens, hidden, positions, kv, tree_mask):
            return None, hidden

    V = 5000
    ref = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(7))
    oracle = OracleDrafter(Stub(), ref, 0.5, V)
    pos = torch.arange(3, 9).expand(2, 6)
    hidden = torch.randn(12, 4)
    logits, h = oracle.forward(None, hidden, pos, None, None)
    assert h is hidden and logits.shape == (12, V) and logits.dtype == torch.float32
    oracle.calls -= 1  # the draws the forward used
    assert torch.equal(logits.argmax(-1), oracle.proposals(pos).reshape(-1))
    others = logits.clone()
    others.scatter_(1, logits.argmax(-1, keepdim=True), -1.0)
    assert (logits.max(-1).values == 30.0).all() and (others.max(-1).values < 1).all()
    for row in others:  # every other token a distinct score: a tree's candidates never tie
        assert torch.unique(row).numel() == V
    with pytest.raises(ValueError, match="vocab_size"):
        OracleDrafter(None, ref, 0.5, 2**25)


@pytest.mark.parametrize("spec, T0, max_new", [(SpecConfig(steps=3, topk=1, num_tokens=4), 13, 14),
                                               (SpecConfig(steps=4, topk=4, num_tokens=16), 12, 16),
                                               (SpecConfig(steps=3, topk=2, num_tokens=6), 9, 23)])
def test_a_request_done_early_keeps_its_writes_inside_its_cache(pair, spec, T0, max_new):
    # Request 0's drafts are always right, so it stops early and past max_new (the last round's whole
    # chain); request 1's are always wrong, so rounds go on and still write request 0's verify rows past its
    # final prefix. The caches must have room for them (they once did not: a page index out of range).
    target, drafter, _, _ = pair
    prompts = torch.randint(0, CFG.vocab_size, (2, T0), generator=torch.Generator().manual_seed(2))
    plain, _ = generate_plain(target, prompts, max_new + 10)
    ref = plain.clone()
    ref[1] = (ref[1] + 7) % CFG.vocab_size
    oracle = OracleDrafter(drafter, torch.cat([prompts, ref], 1), 1.0, CFG.vocab_size)
    out, stats = generate_speculative(target, oracle, prompts, max_new, spec)
    assert torch.equal(out, plain[:, :max_new])
    assert stats.accept_hist[1] >= max_new - 2  # request 1 went on alone, one token a round


@pytest.mark.parametrize("mode", ["round", "steps"])
def test_graph_warmups_leave_the_oracle_draws_alone(pair, mode):
    # a round graph's warm-up rounds call the oracle; its call count (which indexes the draws) is restored
    # after them, so a graphed run draws what the eager run draws: same acceptance, same rounds
    target, drafter, prompts, plain = pair
    spec = SpecConfig(steps=3, topk=1, num_tokens=4)
    runs = []
    for graphs in (False, mode):
        oracle = OracleDrafter(drafter, torch.cat([prompts, plain], 1), 0.6, CFG.vocab_size)
        out, st = generate_speculative(target, oracle, prompts, plain.shape[1], spec, graphs=graphs)
        runs.append((out, st.accept_hist, st.rounds, int(oracle.calls)))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1:] == runs[1][1:]


def test_adversarial_oracle_ranks_the_right_token_last():
    # p = 0: the proposal is wrong and, so that no branch of a tree can be accepted either, the right token
    # (reference[i + 2]) scores below every other candidate
    class Stub:
        cfg = None

        def forward(self, tokens, hidden, positions, kv, tree_mask):
            return None, hidden

    V = 3000
    ref = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(9))
    pos = torch.arange(4, 12).expand(2, 8)
    want = ref.gather(1, pos + 2).reshape(-1)
    for p, lowest in ((0.0, True), (0.5, False)):
        logits, _ = OracleDrafter(Stub(), ref, p, V).forward(None, torch.zeros(16, 2), pos, None, None)
        at_want = logits.gather(1, want[:, None]).squeeze(1)
        assert bool((at_want == logits.min(-1).values).all()) == lowest


@pytest.mark.parametrize("graphs", [False, True])
def test_runs_started_from_a_prefill_cache_are_the_runs_that_prefill(pair, graphs):
    # PrefillCache: the first run prefills and keeps its state, later runs copy it in; the tokens, the
    # acceptance and the oracle's draws (its call count) are those of runs that prefill themselves,
    # whatever the spec (N, hence the caches' size) of the later runs
    from eagle3_ops.engine import PrefillCache

    target, drafter, prompts, plain = pair
    ref = torch.cat([prompts, plain], 1)
    cache = PrefillCache()
    for spec in (SpecConfig(steps=3, topk=1, num_tokens=4), SpecConfig(steps=3, topk=2, num_tokens=6)):
        for p in (0.6, 1.0):
            runs = []
            for c in (None, cache):
                oracle = OracleDrafter(drafter, ref, p, CFG.vocab_size)
                out, st = generate_speculative(target, oracle, prompts, 20, spec, graphs=graphs, prefill_cache=c)
                runs.append((out, st.accept_hist, st.rounds, int(oracle.calls)))
            assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1:] == runs[1][1:]
            assert torch.equal(runs[0][0], plain[:, :20])
    assert cache.state is not None and cache.prefill_seconds > 0
    with pytest.raises(ValueError, match="prefill_cache holds"):  # another drafter: another last score
        generate_speculative(target, drafter, prompts, 4, prefill_cache=cache)
    real_cache = PrefillCache()
    real = [generate_speculative(target, drafter, prompts, 20, graphs=graphs, prefill_cache=c)
            for c in (None, real_cache, real_cache)]
    assert all(torch.equal(o, real[0][0]) and st.accept_hist == real[0][1].accept_hist for o, st in real)
    with pytest.raises(ValueError, match="prefill_cache holds"):
        generate_speculative(target, drafter, prompts, 4, glue="torch", prefill_cache=real_cache)
    with pytest.raises(ValueError, match="prefill_cache holds"):
        generate_speculative(target, drafter, prompts[:1], 4, prefill_cache=cache)


def test_a_prefill_cache_refuses_other_prompts(pair):
    from eagle3_ops.engine import PrefillCache

    target, drafter, prompts, _ = pair
    cache = PrefillCache()
    generate_speculative(target, drafter, prompts, 4, prefill_cache=cache)
    other = prompts.clone()
    other[0, 0] = (other[0, 0] + 1) % CFG.vocab_size
    before = other.clone()
    with pytest.raises(ValueError, match="other prompts"):
        generate_speculative(target, drafter, other, 4, prefill_cache=cache)
    assert torch.equal(other, before) and cache.state["prompts"].equal(prompts)  # nothing of the caller's touched
