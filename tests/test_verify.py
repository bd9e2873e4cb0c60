"""verify_greedy and verify_sampling: golden trees, walk invariants, dtype agreement, the sampler's
losslessness (frequency tests), its Philox draws, and bad input. CPU: the ops dispatch to the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import eagle3_ops
from eagle3_ops import _philox, tree
from eagle3_ops.errors import Eagle3InputError
from tests.conftest import assert_equal, capture_graph

PROPERTY = settings(derandomize=True, max_examples=40, deadline=None)
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


def i64(rows):
    return torch.tensor(rows, dtype=torch.int64)


def greedy(logits, tokens, parents):
    return torch.ops.eagle3.verify_greedy(logits, tokens, parents)


def sampling(logits, tokens, parents, temperature, seed, offset, draft_probs=None, d2t=None):
    B = tokens.shape[0]
    full = lambda v, dt: v if isinstance(v, torch.Tensor) else torch.full((B,), v, dtype=dt)  # noqa: E731
    return torch.ops.eagle3.verify_sampling(logits, draft_probs, d2t, tokens, parents,
                                            full(temperature, torch.float32), full(seed, torch.int64),
                                            full(offset, torch.int64))


def logits_with_argmax(argmax, V, gen=None):
    """[len(argmax), V] fp32 logits, small noise in [-1, 1) and a unique maximum 4.0 at argmax[r]."""
    base = torch.rand(len(argmax), V, generator=gen) * 2 - 1 if gen is not None else torch.zeros(len(argmax), V)
    base[torch.arange(len(argmax)), torch.tensor(argmax)] = 4.0
    return base


def assert_walk(out, accept_nodes, accept_len, emitted):
    """Exact comparison of all three outputs, dtypes included."""
    got_nodes, got_len, got_emitted = out
    assert (got_nodes.dtype, got_len.dtype, got_emitted.dtype) == (torch.int32, torch.int32, torch.int64)
    assert_equal(got_nodes, i32(accept_nodes), "accept_nodes")
    assert_equal(got_len, i32(accept_len), "accept_len")
    assert_equal(got_emitted, i64(emitted), "emitted")


# ---- golden trees: every expected value written out -------------------------------------------------

#        0 (7)
#      /      \
#    1 (11)   2 (12)
#    /   \       \
#  3(13) 4(14)   5(15)
BUSHY = [-1, 0, 0, 1, 1, 2]
BUSHY_TOKENS = [7, 11, 12, 13, 14, 15]


def test_golden_bushy_path_root_2_5_bonus(gen):
    # row 0 -> 12 (node 2), row 2 -> 15 (node 5), row 5 -> 3 (no child: bonus). Rows 1, 3, 4 would lead
    # elsewhere (13, 14, 11) and must not matter.
    logits = logits_with_argmax([12, 13, 15, 14, 11, 3], 20, gen)
    out = greedy(logits, i64([BUSHY_TOKENS]), i32([BUSHY]))
    assert_walk(out, [[0, 2, 5, -1, -1, -1]], [2], [[12, 15, 3, -1, -1, -1]])


def test_golden_nothing_accepted(gen):
    # row 0 -> 9: neither child (11, 12) carries it; 9 is the bonus, one token emitted.
    logits = logits_with_argmax([9, 13, 15, 14, 11, 3], 20, gen)
    out = greedy(logits, i64([BUSHY_TOKENS]), i32([BUSHY]))
    assert_walk(out, [[0, -1, -1, -1, -1, -1]], [0], [[9, -1, -1, -1, -1, -1]])


def test_golden_root_only(gen):
    # N = 1: nothing drafted; the step is plain decoding.
    out = greedy(logits_with_argmax([4], 10, gen), i64([[7]]), i32([[-1]]))
    assert_walk(out, [[0]], [0], [[4]])


def test_golden_equal_siblings_lower_index_wins(gen):
    # Nodes 2 and 3 both carry 9 (the argmax at the root): node 2 (the higher-scored sibling) is taken,
    # so the bonus is row 2's argmax (1), not row 3's (8).
    parents, tokens = i32([[-1, 0, 0, 0]]), i64([[7, 5, 9, 9]])
    out = greedy(logits_with_argmax([9, 6, 1, 8], 12, gen), tokens, parents)
    assert_walk(out, [[0, 2, -1, -1]], [1], [[9, 1, -1, -1]])


def test_golden_argmax_tie_takes_the_lowest_token_id():
    # Row 0 has its maximum at both 5 and 9: the argmax is 5 (node 1), never 9 (node 2).
    parents, tokens = i32([[-1, 0, 0]]), i64([[7, 5, 9]])
    logits = torch.zeros(3, 12)
    logits[0, 5] = logits[0, 9] = 2.0
    logits[1, 3] = 1.0
    logits[2, 4] = 1.0
    assert_walk(greedy(logits, tokens, parents), [[0, 1, -1]], [1], [[5, 3, -1]])


def test_golden_three_requests_three_outcomes(gen):
    parents = i32([BUSHY,                  # request 0: partial path 0 -> 1 -> 4
                   [-1, 0, 1, 2, 3, 4],    # request 1: a chain, accepted up to node 3
                   [-1, 0, 0, 0, 0, 0]])   # request 2: wide, nothing accepted
    tokens = i64([BUSHY_TOKENS, [3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    argmax = [11, 14, 0, 0, 0, 0,          # rows 0..5 of request 0: 11 (node 1), 14 (node 4), bonus 0 at row 4
              4, 5, 6, 19, 8, 8,           # request 1: 4, 5, 6, then 19 != 7 at node 3
              18, 2, 2, 2, 2, 2]           # request 2: 18 matches no child
    out = greedy(logits_with_argmax(argmax, 20, gen), tokens, parents)
    assert_walk(out,
                [[0, 1, 4, -1, -1, -1], [0, 1, 2, 3, -1, -1], [0, -1, -1, -1, -1, -1]],
                [2, 3, 0],
                [[11, 14, 0, -1, -1, -1], [4, 5, 6, 19, -1, -1], [18, -1, -1, -1, -1, -1]])


def test_golden_chain_fully_accepted(gen):
    # Every draft matches: accept_len = N - 1 = 4 and N tokens are emitted (4 drafts + the bonus 2).
    out = greedy(logits_with_argmax([4, 5, 6, 7, 2], 10, gen), i64([[3, 4, 5, 6, 7]]), i32([[-1, 0, 1, 2, 3]]))
    assert_walk(out, [[0, 1, 2, 3, 4]], [4], [[4, 5, 6, 7, 2]])


@pytest.mark.parametrize("case", ["bushy", "none", "siblings", "chain", "three"])
def test_golden_temperature_zero_sampling_is_greedy(gen, case):
    # The same golden trees through verify_sampling at temperature 0, with and without draft_probs.
    cases = {
        "bushy": ([BUSHY], [BUSHY_TOKENS], [12, 13, 15, 14, 11, 3], 20),
        "none": ([BUSHY], [BUSHY_TOKENS], [9, 13, 15, 14, 11, 3], 20),
        "siblings": ([[-1, 0, 0, 0]], [[7, 5, 9, 9]], [9, 6, 1, 8], 12),
        "chain": ([[-1, 0, 1, 2, 3]], [[3, 4, 5, 6, 7]], [4, 5, 6, 7, 2], 10),
        "three": ([BUSHY, [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 0]],
                  [BUSHY_TOKENS, [3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]],
                  [11, 14, 0, 0, 0, 0, 4, 5, 6, 19, 8, 8, 18, 2, 2, 2, 2, 2], 20),
    }
    parents, tokens, argmax, V = cases[case]
    parents, tokens = i32(parents), i64(tokens)
    logits = logits_with_argmax(argmax, V, gen)
    want = greedy(logits, tokens, parents)
    draft_probs = torch.softmax(torch.randn(logits.shape, generator=gen), -1)
    for dp in (None, draft_probs):
        got = sampling(logits, tokens, parents, 0.0, 5, 0, draft_probs=dp)
        for g, w, name in zip(got, want, ("accept_nodes", "accept_len", "emitted")):
            assert_equal(g, w, name)


# ---- invariants on random trees ---------------------------------------------------------------------


def planted(seed, B, N, V, kind, dtype=torch.float32, integer=False, p_plant=0.7):
    """A random tree whose node tokens are often the argmax of their parent's row: deep greedy paths,
    and equal siblings when two children of one node are both planted."""
    g = torch.Generator().manual_seed(seed)
    parents = tree.random_parents(B, N, g, kind)
    if integer:  # exact in bf16, fp16, fp32 and fp64 (|x| <= 256); many ties, broken by the first maximum
        logits = torch.randint(-128, 129, (B * N, V), generator=g).float()
    else:
        logits = torch.randn(B * N, V, generator=g)
    target = logits.argmax(-1).view(B, N)
    parent_target = target.gather(1, parents.long().clamp(min=0))
    plant = torch.rand(B, N, generator=g) < p_plant
    tokens = torch.where(plant, parent_target, torch.randint(0, V, (B, N), generator=g))
    return logits.to(dtype), tokens, parents


def check_walk_structure(out, logits, tokens, parents):
    """What every verify result satisfies: a root-first path down the tree, -1 padding, emitted tokens."""
    accept_nodes, accept_len, emitted = out
    B, N = tokens.shape
    V = logits.shape[1]
    assert accept_nodes.dtype == torch.int32 and accept_nodes.shape == (B, N)
    assert accept_len.dtype == torch.int32 and accept_len.shape == (B,)
    assert emitted.dtype == torch.int64 and emitted.shape == (B, N)
    depth = tree.depth(parents)
    for b in range(B):
        a = int(accept_len[b])
        nodes = accept_nodes[b].tolist()
        assert 0 <= a <= N - 1, f"request {b}: accept_len {a}"
        assert nodes[0] == 0, f"request {b}: the path starts at the root, got {nodes}"
        for i in range(1, a + 1):
            assert int(parents[b, nodes[i]]) == nodes[i - 1], f"request {b}: {nodes} does not follow parents"
        assert nodes[a + 1:] == [-1] * (N - a - 1), f"request {b}: padding of {nodes}"
        assert a <= int(depth[b, nodes[a]]), f"request {b}: accept_len {a} > depth of node {nodes[a]}"
        assert a == int(depth[b, nodes[a]])  # a root-first path: exactly the depth
        assert emitted[b, :a].tolist() == [int(tokens[b, j]) for j in nodes[1:a + 1]], f"request {b}"
        assert 0 <= int(emitted[b, a]) < V, f"request {b}: bonus {int(emitted[b, a])} outside the vocabulary"
        assert emitted[b, a + 1:].tolist() == [-1] * (N - a - 1), f"request {b}: emitted padding"
        assert int((emitted[b] != -1).sum()) == a + 1  # a step emits accept_len + 1 tokens


def check_greedy(out, logits, tokens, parents):
    """Greedy specifics: each step takes the lowest-index child carrying the argmax, and stops only when
    no child of the last node carries it; the bonus is that argmax."""
    check_walk_structure(out, logits, tokens, parents)
    accept_nodes, accept_len, emitted = out
    B, N = tokens.shape
    target = logits.float().argmax(-1).view(B, N)
    for b in range(B):
        a = int(accept_len[b])
        nodes = accept_nodes[b, :a + 1].tolist()
        for i in range(1, a + 1):
            want = int(target[b, nodes[i - 1]])
            children = [j for j in range(N) if int(parents[b, j]) == nodes[i - 1] and int(tokens[b, j]) == want]
            assert children and nodes[i] == children[0], f"request {b}: step {i} took {nodes[i]}, want {children}"
        last = nodes[a]
        bonus = int(target[b, last])
        assert int(emitted[b, a]) == bonus, f"request {b}: bonus {int(emitted[b, a])} != argmax {bonus}"
        assert not any(int(parents[b, j]) == last and int(tokens[b, j]) == bonus for j in range(N)), \
            f"request {b}: a child of node {last} carries the argmax {bonus} but the walk stopped"


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1),
       B=st.sampled_from([1, 7]),                # one request, an odd batch
       N=st.sampled_from([1, 2, 8, 64]),         # root only, one draft, a small tree, two mask words
       V=st.sampled_from([1, 111, 32000]),       # a one-token vocabulary (everything ties), odd, draft-size
       kind=st.sampled_from(["bushy", "chain", "wide", "beam"]))
def test_greedy_invariants_random_trees(seed, B, N, V, kind):
    logits, tokens, parents = planted(seed, B, N, V, kind)
    check_greedy(greedy(logits, tokens, parents), logits, tokens, parents)


def test_greedy_kimi_vocab_goes_deep():
    # V = 163840 (Kimi-K2), B = 2, N = 64 chains with every token planted: the whole chain is accepted.
    logits, tokens, parents = planted(3, 2, 64, 163840, "chain", p_plant=1.0)
    out = greedy(logits, tokens, parents)
    check_greedy(out, logits, tokens, parents)
    assert out[1].tolist() == [63, 63]


def test_greedy_planted_trees_accept_something():
    # The invariant tests are only worth something if the walks go somewhere: most requests accept.
    logits, tokens, parents = planted(0, 64, 8, 111, "beam")
    accept_len = greedy(logits, tokens, parents)[1]
    assert (accept_len >= 1).float().mean() > 0.5 and int(accept_len.max()) >= 3


@pytest.mark.parametrize("kind", ["bushy", "beam", "wide"])  # deep, EAGLE-like, many siblings
@pytest.mark.parametrize("N", [1, 8, 64])                     # root only, small, two mask words
def test_greedy_dtypes_agree(kind, N):
    # Integer logits are exact in every dtype, so bf16 / fp16 / fp32 / fp64 must give identical walks
    # (a kernel that argmaxes in a lower precision than its input, or breaks ties differently, fails).
    logits, tokens, parents = planted(N, 7, N, 111, kind, integer=True)
    want = greedy(logits, tokens, parents)
    check_greedy(want, logits, tokens, parents)
    for dtype in DTYPES:
        got = greedy(logits.to(dtype), tokens, parents)
        for g, w, name in zip(got, want, ("accept_nodes", "accept_len", "emitted")):
            assert_equal(g, w, f"{name} ({dtype})")


# ---- verify_sampling --------------------------------------------------------------------------------


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.sampled_from([1, 7]), N=st.sampled_from([1, 2, 8, 64]),
       kind=st.sampled_from(["bushy", "chain", "wide", "beam"]), with_q=st.booleans())
def test_sampling_temperature_zero_is_greedy(seed, B, N, kind, with_q):
    logits, tokens, parents = planted(seed, B, N, 111, kind)
    g = torch.Generator().manual_seed(seed + 1)
    draft_probs = torch.softmax(torch.randn(B * N, 111, generator=g) * 3, -1) if with_q else None
    want = greedy(logits, tokens, parents)
    got = sampling(logits, tokens, parents, 0.0, seed, 3, draft_probs=draft_probs)
    for gt, w, name in zip(got, want, ("accept_nodes", "accept_len", "emitted")):
        assert_equal(gt, w, name)


def test_sampling_mixed_temperatures_per_request():
    # Temperature is per request: the zero-temperature requests of a batch are exactly greedy, the others
    # still produce valid walks.
    B, N, V = 7, 8, 111
    logits, tokens, parents = planted(11, B, N, V, "beam")
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.5, 2.0, 0.0, 1.0])
    out = sampling(logits, tokens, parents, temperature, torch.arange(B), torch.zeros(B, dtype=torch.int64))
    check_walk_structure(out, logits, tokens, parents)
    want = greedy(logits, tokens, parents)
    zero = temperature == 0
    for g, w, name in zip(out, want, ("accept_nodes", "accept_len", "emitted")):
        assert_equal(g[zero], w[zero], name)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.sampled_from([1, 7]), N=st.sampled_from([1, 2, 8, 64]),
       kind=st.sampled_from(["bushy", "chain", "wide", "beam"]), temperature=st.sampled_from([0.3, 1.0, 1.7]),
       with_q=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_sampling_invariants_random_trees(seed, B, N, kind, temperature, with_q, dtype):
    V, Vd = 111, 50
    logits, tokens, parents = planted(seed, B, N, V, kind, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    draft_probs = d2t = None
    if with_q:  # a smaller draft vocabulary mapped into the target's by d2t
        draft_probs = torch.softmax(torch.randn(B * N, Vd, generator=g), -1)
        d2t = torch.randint(0, V - Vd + 1, (Vd,), generator=g)
    out = sampling(logits, tokens, parents, temperature, seed, 0, draft_probs=draft_probs, d2t=d2t)
    check_walk_structure(out, logits, tokens, parents)


def test_sampling_one_hot_target_accepts_the_matching_child():
    # A one-hot-like target (one logit 1e4 above the rest: p is exactly one-hot in float64) always accepts
    # the child carrying its token, wherever it sits among its siblings, and emits exactly that token,
    # whatever the seed, the temperature or the draft distribution.
    #        0 (7)
    #    /   |    \
    #  1(3) 2(5) 3(6)      target at 0: 5 (the middle sibling)
    #   |    |
    #  4(8) 5(9)           target at 2: 9, target at 5: 2 (bonus)
    parents, tokens = i32([[-1, 0, 0, 0, 1, 2]]), i64([[7, 3, 5, 6, 8, 9]])
    V, B = 12, 64
    hot = torch.zeros(6, V)
    hot[torch.arange(6), torch.tensor([5, 1, 9, 1, 1, 2])] = 1e4
    logits = hot.repeat(B, 1)
    g = torch.Generator().manual_seed(0)
    draft_probs = torch.softmax(torch.randn(B * 6, V, generator=g), -1)
    for dp in (None, draft_probs):
        for temperature in (0.5, 1.0, 3.0):
            out = sampling(logits, tokens.expand(B, 6).contiguous(), parents.expand(B, 6).contiguous(), temperature,
                           torch.arange(B) * 1000003, torch.arange(B), draft_probs=dp)
            assert_equal(out[0], i32([[0, 2, 5, -1, -1, -1]] * B), "accept_nodes")
            assert_equal(out[1], i32([2] * B), "accept_len")
            assert_equal(out[2], i64([[5, 9, 2, -1, -1, -1]] * B), "emitted")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sampling_zero_probability_children_are_all_rejected(dtype):
    # Every child's token has logit -inf (probability 0): all are rejected, accept_len is 0 and the bonus
    # is never a child's token (it comes from the residual, which keeps p's zeros).
    parents, tokens = i32([[-1, 0, 0, 0, 1]]), i64([[7, 1, 3, 3, 4]])
    V, B, N = 6, 200, 5
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B * N, V, generator=g)
    logits.view(B, N, V)[:, 0, [1, 3]] = float("-inf")
    draft_probs = torch.softmax(torch.randn(B * N, V, generator=g), -1)
    for dp in (None, draft_probs):
        out = sampling(logits.to(dtype), tokens.expand(B, N).contiguous(), parents.expand(B, N).contiguous(), 1.0,
                       torch.arange(B), 0, draft_probs=dp)
        assert_equal(out[0], i32([[0, -1, -1, -1, -1]] * B), "accept_nodes")
        assert_equal(out[1], torch.zeros(B, dtype=torch.int32), "accept_len")
        bonus = out[2][:, 0]
        assert not bool(((bonus == 1) | (bonus == 3)).any()), "a zero-probability token was emitted"
        assert set(bonus.tolist()) == {0, 2, 4, 5}  # and every other token does come up
        assert (out[2][:, 1:] == -1).all()


def test_sampling_seeded_determinism():
    B, N, V = 64, 8, 111
    logits, tokens, parents = planted(5, B, N, V, "beam", p_plant=0.9)
    g = torch.Generator().manual_seed(2)
    draft_probs = torch.softmax(torch.randn(B * N, V, generator=g), -1)
    seed = torch.arange(B) * 7919 + 2**40  # seeds above 2**32 use the key's high word
    for dp in (None, draft_probs):
        offset = torch.full((B,), 2**33 + 5, dtype=torch.int64)
        first = sampling(logits, tokens, parents, 1.0, seed, offset, draft_probs=dp)
        again = sampling(logits, tokens, parents, 1.0, seed.clone(), offset.clone(), draft_probs=dp)
        for f, a, name in zip(first, again, ("accept_nodes", "accept_len", "emitted")):
            assert_equal(a, f, name)
        moved = sampling(logits, tokens, parents, 1.0, seed, offset + 1, draft_probs=dp)
        reseeded = sampling(logits, tokens, parents, 1.0, seed + 1, offset, draft_probs=dp)
        high_offset = sampling(logits, tokens, parents, 1.0, seed, offset + 2**32, draft_probs=dp)
        for other in (moved, reseeded, high_offset):
            assert not torch.equal(other[2], first[2]), "the draws did not change"
        # Requests in one batch draw independently: identical requests with different seeds differ.
        same = sampling(logits[:N].repeat(B, 1), tokens[:1].expand(B, N).contiguous(),
                        parents[:1].expand(B, N).contiguous(), 1.0, seed, offset,
                        draft_probs=None if dp is None else dp[:N].repeat(B, 1))
        assert len(set(map(tuple, same[2].tolist()))) > 1


# ---- the sampler's draws: the Philox layout documented in eagle3_ops._philox ---------------------------


def philox_uniform(seed, offset, row, idx, stream):
    """Independent restatement of the documented counter layout and uniform mapping."""
    out = _philox.philox4x32_10(np.asarray(idx, dtype=np.uint64), row | (stream << 31), offset % 2**32,
                                (offset >> 32) % 2**32, seed % 2**32, (seed >> 32) % 2**32)[0]
    return ((out >> np.uint64(9)).astype(np.float64) * 2 + 1) / 2**24


def test_sampling_draws_follow_the_philox_layout():
    # Root with two one-hot drafts (tokens 1 and 2), leaves below. By the docstring: child k is accepted
    # iff u_k * 1 < p(x) with u_k = uniform(seed, offset, b * N + 0, k, stream 0), p renormalised without
    # the rejected token in between; the bonus is argmax p / -log(uniform(..., row, v, stream 1)).
    # Recomputed here from philox4x32_10 alone, for seeds and offsets with both 32-bit words in use.
    B, N, V, T = 96, 3, 7, 0.8
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B * N, V, generator=g) * 1.5
    parents, tokens = i32([[-1, 0, 0]] * B), i64([[4, 1, 2]] * B)
    seeds = [(b * 0x9E3779B97F4A7C15 + 12345) % 2**63 for b in range(B)]
    offsets = [(b * 0x632BE59BD9B4E019) % 2**63 for b in range(B)]
    out = sampling(logits, tokens, parents, T, i64(seeds), i64(offsets))
    accepted_children = 0
    for b in range(B):
        sd, off = seeds[b], offsets[b]
        p = torch.softmax(logits[b * N].double() / T, -1).numpy()
        path, node = [0], 0
        for k, (child, x) in enumerate(((1, 1), (2, 2))):
            if philox_uniform(sd, off, b * N, [k], 0)[0] < p[x]:
                path, node = [0, child], child
                break
            p = p.copy()
            p[x] = 0.0
            p = p / p.sum()
        if node != 0:
            p = torch.softmax(logits[b * N + node].double() / T, -1).numpy()
            accepted_children += 1
        e = -np.log(philox_uniform(sd, off, b * N + node, np.arange(V), 1))
        bonus = int(np.argmax(p / e))
        want_nodes = path + [-1] * (N - len(path))
        want_emitted = [int(tokens[b, j]) for j in path[1:]] + [bonus]
        want_emitted += [-1] * (N - len(want_emitted))
        assert out[0][b].tolist() == want_nodes, f"request {b}"
        assert int(out[1][b]) == len(path) - 1, f"request {b}"
        assert out[2][b].tolist() == want_emitted, f"request {b}"
    assert 10 < accepted_children < B - 10  # both branches were exercised


# ---- losslessness: the emitted tokens are distributed as the target's sampling distribution -----------


def _assert_frequencies(samples, p, what):
    """Empirical frequencies of samples (ints in [0, V)) within 4 sigma of p; zero-probability never seen."""
    n = len(samples)
    assert n > 0
    freq = np.bincount(np.asarray(samples), minlength=len(p))[:len(p)] / n
    sigma = np.sqrt(p * (1 - p) / n)
    bad = np.abs(freq - p) > 4 * sigma + 1e-12
    assert not bad.any(), (f"{what}: frequencies {np.round(freq, 4)} vs p {np.round(p, 4)} (n = {n}); "
                           f"off by {np.round(np.abs(freq - p) / np.maximum(sigma, 1e-12), 1)} sigma")


# Target "model": logits of the next token given the last one (V = 5) and at the root.
V5, T5 = 5, 0.7
ROOT_LOGITS = torch.tensor([1.0, 0.6, -0.3, 0.4, -1.0])
NEXT_LOGITS = torch.tensor([[0.2, -1.0, 1.5, 0.0, 0.3],
                            [1.0, 1.0, -2.0, 0.5, 0.0],
                            [-0.5, 0.8, 0.1, 2.0, -1.0],
                            [0.0, 0.0, 0.0, 0.0, 3.0],
                            [2.5, -0.5, 0.4, 0.1, 0.9]])


def _p(logits):
    return torch.softmax(logits.double() / T5, -1).numpy()


#      0
#    /   \
#   1     2        children of the root: iid draft candidates (top-k: fixed tokens; sampled: from q0)
#   |     |
#   3     4        one grandchild below each (from q1 at that child)
FREQ_PARENTS = [-1, 0, 0, 1, 2]


def _frequency_run(draw_tokens, draft_probs, d2t, B=400, calls=10):
    """emitted[:, :2] and accept_len over calls x B independent requests (seed = call * B + b)."""
    N = len(FREQ_PARENTS)
    parents = i32([FREQ_PARENTS] * B)
    firsts, seconds, lens = [], [], []
    for call in range(calls):
        tokens = draw_tokens(call)  # [B, N]
        logits = torch.empty(B, N, V5)
        logits[:, 0] = ROOT_LOGITS
        logits[:, 1:] = NEXT_LOGITS[tokens[:, 1:]]  # a node's row is the target given its own token
        out = sampling(logits.view(B * N, V5), tokens, parents, T5, torch.arange(B) + call * B, 17,
                       draft_probs=draft_probs, d2t=d2t)
        check_walk_structure(out, logits.view(B * N, V5), tokens, parents)
        firsts.append(out[2][:, 0])
        seconds.append(out[2][:, 1])
        lens.append(out[1])
    return torch.cat(firsts).numpy(), torch.cat(seconds).numpy(), torch.cat(lens).numpy()


def _check_lossless(first, second, lens):
    _assert_frequencies(first, _p(ROOT_LOGITS), "emitted[:, 0]")
    # Given an accepted first token a, the next token is distributed as the target given a.
    for a in range(V5):
        pick = (lens >= 1) & (first == a)
        if pick.sum() >= 100:
            _assert_frequencies(second[pick], _p(NEXT_LOGITS[a]), f"emitted[:, 1] after {a}")


def test_frequency_one_hot_drafts():
    # Top-k drafts (no draft_probs: q is one-hot on each child): children carry tokens 0 and 3, the
    # grandchildren 2 and 4. The first emitted token must follow softmax(root / T) although it is an
    # accepted draft in most requests; a rule that sampled the bonus from p instead of the residual
    # misses by 20 to 40 sigma.
    B = 400
    tokens = i64([[9, 0, 3, 2, 4]] * B)
    first, second, lens = _frequency_run(lambda call: tokens, None, None, B=B)
    _check_lossless(first, second, lens)
    p = _p(ROOT_LOGITS)
    accepted = np.isin(first, [0, 3])
    assert ((lens >= 1) == accepted).all()  # the bonus never repeats a rejected one-hot draft
    assert abs(accepted.mean() - (p[0] + p[3])) < 4 * math.sqrt((p[0] + p[3]) * (1 - p[0] - p[3]) / len(first))


def test_frequency_sampled_drafts_with_d2t():
    # Sampled drafts (SpecInfer): a draft vocabulary of Vd = 3 mapped by d2t into V = 5 (draft d is target
    # d + d2t[d]: 0 -> 1, 1 -> 2, 2 -> 4), so q never proposes 0 or 3. The root's children are iid draws
    # from q0 (duplicates included), each grandchild an iid draw from q1 at its child. The emitted tokens
    # must still follow the target exactly.
    B, N = 400, len(FREQ_PARENTS)
    d2t = i64([1, 1, 2])
    target_of = i64([1, 2, 4])
    q0, q1 = torch.tensor([0.5, 0.2, 0.3]), torch.tensor([0.1, 0.6, 0.3])
    draft_probs = torch.empty(B, N, 3)
    draft_probs[:, 0], draft_probs[:, 1:] = q0, q1
    g = torch.Generator().manual_seed(42)

    def draw(call):
        tokens = torch.empty(B, N, dtype=torch.int64)
        tokens[:, 0] = 9
        tokens[:, 1:3] = target_of[torch.multinomial(q0.expand(B, 3), 2, replacement=True, generator=g)]
        tokens[:, 3:5] = target_of[torch.multinomial(q1.expand(B, 3), 2, replacement=True, generator=g)]
        return tokens

    first, second, lens = _frequency_run(draw, draft_probs.view(B * N, 3), d2t, B=B)
    _check_lossless(first, second, lens)
    assert 0.3 < (lens >= 1).mean() < 0.95  # both the accept and the residual path carry weight


def test_frequency_leaf_bonus_is_the_target_distribution():
    # N = 1: the bonus alone, sampled by the exponential race, follows softmax(logits / T); V = 111 with a
    # spread of probabilities (odd vocabulary size, many small cells).
    B, calls, V, T = 400, 5, 111, 1.3
    g = torch.Generator().manual_seed(7)
    row = torch.randn(V, generator=g) * 2
    row[:5] += 4.0  # a few heavy tokens
    samples = []
    for call in range(calls):
        out = sampling(row.expand(B, V).contiguous(), i64([[0]] * B), i32([[-1]] * B), T,
                       torch.arange(B), torch.full((B,), call, dtype=torch.int64))
        samples.append(out[2][:, 0])
    _assert_frequencies(torch.cat(samples).numpy(), torch.softmax(row.double() / T, -1).numpy(), "bonus")


# ---- Philox4x32-10: Random123's known-answer vectors --------------------------------------------------


@pytest.mark.parametrize("counter, key, want", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, want):
    got = _philox.philox4x32_10(*counter, *key)
    assert tuple(int(w) for w in got) == want, [hex(int(w)) for w in got]
    # vectorised over counters: the same answer in every lane
    lanes = _philox.philox4x32_10(*(np.full(3, c, dtype=np.uint64) for c in counter), *key)
    assert all(list(map(int, w)) == [v] * 3 for w, v in zip(lanes, want))


def test_philox_uniforms_are_exact_float32_in_open_unit_interval():
    for seed, offset, row, stream in ((0, 0, 0, 0), (2**64 - 1, 2**64 - 1, 2**31 - 1, 1), (123, 2**40, 77, 1)):
        u = _philox.uniform(seed, offset, row, np.arange(4096), stream)
        assert u.dtype == np.float64 and u.shape == (4096,)
        assert (u > 0).all() and (u < 1).all()
        assert (u.astype(np.float32).astype(np.float64) == u).all()  # exactly a float32 value
        assert (u * 2**24 % 2 == 1).all()  # (2 * (x >> 9) + 1) / 2**24: odd multiples of 2**-24
        assert np.array_equal(u, philox_uniform(seed, offset, row, np.arange(4096), stream))
        assert 0.45 < u.mean() < 0.55
    # The extremes of the mapping: x = 0 -> 2**-24, x = 2**32 - 1 -> 1 - 2**-24 (never 0 or 1).
    assert (2 * (0 >> 9) + 1) / 2**24 == 2**-24
    assert np.float32((2 * ((2**32 - 1) >> 9) + 1) / 2**24) < 1
    # Streams, rows, offsets and seeds are independent draws.
    base = _philox.uniform(1, 2, 3, np.arange(64), 0)
    for other in (_philox.uniform(1, 2, 3, np.arange(64), 1), _philox.uniform(1, 2, 4, np.arange(64), 0),
                  _philox.uniform(1, 3, 3, np.arange(64), 0), _philox.uniform(2, 2, 3, np.arange(64), 0),
                  _philox.uniform(1 + 2**32, 2, 3, np.arange(64), 0), _philox.uniform(1, 2 + 2**32, 3, np.arange(64), 0)):
        assert not np.array_equal(base, other)


# ---- bad input ----------------------------------------------------------------------------------------


def _good_sampling_args(B=2, N=3, V=11):
    g = torch.Generator().manual_seed(0)
    return dict(logits=torch.randn(B * N, V, generator=g), draft_probs=None, d2t=None,
                tokens=torch.randint(0, V, (B, N), generator=g), parents=i32([[-1, 0, 0]] * B),
                temperature=torch.ones(B), seed=torch.arange(B), offset=torch.zeros(B, dtype=torch.int64))


@pytest.mark.parametrize("case, error, match", [
    ("logits_rows", ValueError, "logits must have shape"),
    ("logits_dtype", TypeError, "logits must have dtype"),
    ("tokens_dtype", TypeError, "tokens must have dtype"),
    ("parents_shape", ValueError, "parents must have shape"),
    # the exact message the CUDA kernel records too (tests/test_contract_tree.py); token ids are only
    # compared with the argmax, so a negative one is no error
    ("parents_not_tree", Eagle3InputError, r"^verify_greedy: parents\[1, 1\] = 2 is out of range \(valid: 0\.\.0\)$"),
    ("empty_tree", ValueError, "tokens must have N >= 1"),
])
def test_greedy_bad_input(case, error, match):
    with pytest.raises(error, match=match):
        greedy(*_bad_greedy_args(case, "cpu"))


def _bad_greedy_args(case, device):
    """Valid verify_greedy arguments (B 2, N 3, V 11) with one made invalid in the way `case` names."""
    B, N, V = 2, 3, 11
    logits = torch.randn(B * N, V, device=device)
    tokens, parents = torch.randint(0, V, (B, N)).to(device), i32([[-1, 0, 0]] * B).to(device)
    if case == "logits_rows":
        logits = logits[:-1]
    elif case == "logits_dtype":
        logits = logits.to(torch.int32)
    elif case == "tokens_dtype":
        tokens = tokens.int()
    elif case == "parents_shape":
        parents = parents[:, :2]
    elif case == "parents_not_tree":
        parents = i32([[-1, 0, 0], [-1, 2, 0]]).to(device)
    elif case == "empty_tree":
        logits, tokens, parents = torch.randn(0, V), torch.empty(B, 0, dtype=torch.int64), torch.empty(B, 0, dtype=torch.int32)
        logits, tokens, parents = logits.to(device), tokens.to(device), parents.to(device)
    elif case == "parents_dtype":
        parents = parents.long()
    elif case == "tokens_cpu":
        tokens = tokens.cpu()
    elif case == "logits_not_last_contiguous":
        logits = torch.randn(V, B * N, device=device).t()
    return logits, tokens, parents


def _bad_sampling_args(case):
    """verify_sampling's arguments (CPU) with one thing wrong, named by `case`."""
    args = _good_sampling_args()
    B, N, V = 2, 3, 11
    if case == "negative_temperature":
        args["temperature"] = torch.tensor([1.0, -0.5])
    elif case == "nan_temperature":
        args["temperature"] = torch.tensor([float("nan"), 1.0])
    elif case == "temperature_dtype":
        args["temperature"] = torch.ones(B, dtype=torch.float64)
    elif case == "seed_dtype":
        args["seed"] = args["seed"].int()
    elif case == "offset_shape":
        args["offset"] = torch.zeros(B + 1, dtype=torch.int64)
    elif case == "d2t_without_draft_probs":
        args["d2t"] = torch.zeros(V, dtype=torch.int64)
    elif case == "vd_without_d2t":
        args["draft_probs"] = torch.softmax(torch.randn(B * N, 5), -1)
    elif case == "d2t_out_of_range":
        args["draft_probs"] = torch.softmax(torch.randn(B * N, 5), -1)
        args["d2t"] = i64([0, 0, 0, 0, V - 4])  # draft 4 -> target 4 + 7 = 11 = V
    elif case == "draft_probs_rows":
        args["draft_probs"] = torch.softmax(torch.randn(B * N - 1, V), -1)
    elif case == "logits_rows":
        args["logits"] = args["logits"][:-1]
    elif case == "empty_vocab":
        args["logits"] = args["logits"][:, :0]
    return args


@pytest.mark.parametrize("case, error, match", [
    ("negative_temperature", Eagle3InputError, r"^verify_sampling: temperature\[1\] = -0\.5 must be >= 0$"),
    ("nan_temperature", Eagle3InputError, r"^verify_sampling: temperature\[0\] is NaN$"),
    ("temperature_dtype", TypeError, "temperature must have dtype"),
    ("seed_dtype", TypeError, "seed must have dtype"),
    ("offset_shape", ValueError, "offset must have shape"),
    ("d2t_without_draft_probs", ValueError, "d2t"),
    ("vd_without_d2t", ValueError, "d2t"),
    ("d2t_out_of_range", Eagle3InputError, r"^verify_sampling: d2t\[4\] = 7 is out of range \(valid: -4\.\.6\)$"),
    ("draft_probs_rows", ValueError, "draft_probs must have shape"),
    ("empty_vocab", ValueError, r"logits must have 1 <= V < 2\*\*31, got V = 0"),
])
def test_sampling_bad_input(case, error, match):
    args = _bad_sampling_args(case)
    with pytest.raises(error, match=match):
        torch.ops.eagle3.verify_sampling(*args.values())


# ---- verify_greedy CUDA kernel (csrc/verify_greedy.cu) against the reference --------------------------


def _poison_allocator():
    """Leave a sentinel in the CUDA caching allocator's free blocks, so that an output element the kernel
    fails to write shows up as -7 rather than as a plausible stale value."""
    junk = torch.full((1 << 16,), -7, dtype=torch.int64, device="cuda")  # the small-block pool (<= 1 MB)
    del junk


def cuda_greedy_vs_reference(logits, tokens, parents):
    """The CUDA op on device copies, compared exactly (dtypes included) with the CPU reference."""
    _poison_allocator()
    got = greedy(logits.cuda(), tokens.cuda(), parents.cuda())
    want = greedy(logits.cpu(), tokens.cpu(), parents.cpu())
    for gt, w, name in zip(got, want, ("accept_nodes", "accept_len", "emitted")):
        assert gt.dtype == w.dtype and gt.is_cuda, name
        assert_equal(gt.cpu(), w, name)
    return want


def planted_cuda(seed, B, N, V, kind, dtype, integer=False):
    """planted() with the logits drawn on the GPU (a Kimi-vocabulary sweep is too big for a CPU RNG)."""
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device="cuda").manual_seed(seed)
    parents = tree.random_parents(B, N, g, kind)
    if integer:  # few distinct values: long runs of ties, broken by the first index
        logits = torch.randint(-3, 4, (B * N, V), generator=gd, device="cuda").float()
    else:
        logits = torch.randn(B * N, V, generator=gd, device="cuda")
    logits = logits.to(dtype)
    target = logits.argmax(-1).view(B, N).cpu()
    plant = torch.rand(B, N, generator=g) < 0.7
    tokens = torch.where(plant, target.gather(1, parents.long().clamp(min=0)), torch.randint(0, V, (B, N), generator=g))
    return logits, tokens, parents


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 7, 64])
@pytest.mark.parametrize("N", [1, 2, 8, 64])
@pytest.mark.parametrize("kind", ["chain", "bushy"])
def test_cuda_greedy_random_sweep_matches_reference(dtype, B, N, kind):
    # Kimi's V = 163840, except B 64 x N 64 (4096 rows) at V = 32000 to keep the CPU reference quick.
    V = 32000 if B * N > 512 else 163840
    logits, tokens, parents = planted_cuda(B * 100 + N, B, N, V, kind, dtype)
    want = cuda_greedy_vs_reference(logits, tokens, parents)
    if kind == "chain" and N > 1 and B > 1:  # one request may stop at the root (30% of roots are not planted)
        assert int(want[1].max()) >= 1  # the planted walks go somewhere


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("V", [1, 111, 4096, 163840])
def test_cuda_greedy_ties_take_the_first_index(dtype, V):
    # Integer logits in [-3, 3]: each row's maximum occurs many times; the first must win (torch.argmax),
    # across 16-byte vectors, threads, and the vocabulary slices of different blocks.
    logits, tokens, parents = planted_cuda(V, 7, 8, V, "bushy", dtype, integer=True)
    cuda_greedy_vs_reference(logits, tokens, parents)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_cuda_greedy_special_values(dtype):
    # Rows made of one value (index 0 wins), -0.0 vs +0.0 (equal: the first wins), -inf everywhere, NaN
    # (counts as the maximum, the first NaN wins, as torch.argmax), the maximum in the last element, and
    # ties between two slices far apart.
    V = 163840
    rows = torch.randn(8, V, generator=torch.Generator().manual_seed(2)).to(dtype)
    rows[0] = 1.5
    rows[1] = -0.0
    rows[1, 100:] = 0.0
    rows[2] = float("-inf")
    rows[3, 70000] = float("nan")
    rows[3, 150000] = float("nan")
    rows[4, V - 1] = 100.0
    rows[5, 3] = 50.0
    rows[5, V - 2] = 50.0
    rows[6, 5] = float("inf")
    rows[7] = float("-inf")
    rows[7, 123456] = -1e30 if dtype != torch.bfloat16 else -1e30
    tokens = torch.zeros(1, 8, dtype=torch.int64)
    parents = tree.chain_parents(1, 8)
    want_target = rows.argmax(-1)
    tokens[0, 1:] = want_target[:-1]  # the whole chain accepted: every row's argmax is checked
    want = cuda_greedy_vs_reference(rows, tokens, parents)
    assert int(want[1][0]) == 7


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["padded_rows", "unaligned_rows", "odd_vocab"])
def test_cuda_greedy_strided_and_odd_layouts(layout):
    # A row stride larger than V (a view into a wider buffer) on the 16-byte path, a stride that breaks
    # 16-byte alignment (element path), a vocabulary that is not a multiple of the vector (element path).
    B, N, V = 3, 8, 32000
    logits, tokens, parents = planted_cuda(7, B, N, V, "bushy", torch.bfloat16)
    if layout == "padded_rows":
        wide = torch.randn(B * N, V + 64, device="cuda").bfloat16()
        wide[:, :V] = logits
        logits = wide[:, :V]
    elif layout == "unaligned_rows":
        wide = torch.randn(B * N, V + 3, device="cuda").bfloat16()
        wide[:, 1:V + 1] = logits
        logits = wide[:, 1:V + 1]
    else:
        logits = torch.cat([logits, torch.randn(B * N, 5, device="cuda").bfloat16()], 1)
    cuda_greedy_vs_reference(logits, tokens, parents)


@pytest.mark.gpu
def test_cuda_greedy_graph_replay_with_new_values():
    # Captured once; each replay reads new logits and a new tree at the same addresses.
    B, N, V = 7, 8, 163840
    logits, tokens, parents = planted_cuda(1, B, N, V, "bushy", torch.bfloat16)
    tokens, parents = tokens.cuda(), parents.cuda()
    graph, out = capture_graph(lambda: greedy(logits, tokens, parents))
    for step in range(3):
        new_logits, new_tokens, new_parents = planted_cuda(10 + step, B, N, V, ["bushy", "chain", "wide"][step],
                                                           torch.bfloat16)
        logits.copy_(new_logits)
        tokens.copy_(new_tokens)
        parents.copy_(new_parents)
        for o in out:
            o.fill_(-7)
        graph.replay()
        want = greedy(new_logits.cpu(), new_tokens, new_parents)
        for gt, w, name in zip(out, want, ("accept_nodes", "accept_len", "emitted")):
            assert_equal(gt.cpu(), w, f"replay {step}: {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("case, error, match", [
    ("logits_rows", ValueError, "logits must have shape"),
    ("logits_dtype", TypeError, "logits must have dtype"),
    ("tokens_dtype", TypeError, "tokens must have dtype"),
    ("parents_shape", ValueError, "parents must have shape"),
    ("parents_dtype", TypeError, "parents must have dtype"),
    ("tokens_cpu", ValueError, "tokens must be on the same device"),
    ("logits_not_last_contiguous", ValueError, "logits must be contiguous in its last dimension"),
    ("empty_tree", ValueError, "tokens must have N >= 1"),
])
def test_cuda_greedy_bad_input(case, error, match):
    # The CUDA launcher's checks raise the CPU validator's errors (data-dependent tree checks excepted:
    # test_cuda_greedy_invalid_tree_is_harmless).
    with pytest.raises(error, match=match):
        greedy(*_bad_greedy_args(case, "cuda"))


@pytest.mark.gpu
def test_cuda_greedy_invalid_tree_is_harmless():
    # CUDA records a broken tree in the error word instead of raising (the CPU reference raises): a node
    # whose parent is not an earlier node is never accepted, the walk ends, and every output is a
    # well-formed path over valid edges. Here node 2 claims parent 3 (not topological) and node 4 claims
    # itself; both carry their claimed parent's argmax.
    eagle3_ops.check_errors()
    V = 50
    argmax = [10, 11, 12, 13, 14, 15]
    logits = logits_with_argmax(argmax, V)
    parents = i32([[-1, 0, 3, 1, 4, 0]])
    tokens = i64([[0, 10, 13, 11, 14, 20]])
    nodes, lens, emitted = greedy(logits.cuda(), tokens.cuda(), parents.cuda())
    assert nodes.cpu().tolist() == [[0, 1, 3, -1, -1, -1]]  # 0 -> 1 (token 10) -> 3 (token 11); 3 -> 2 refused
    assert lens.cpu().tolist() == [2]
    assert emitted.cpu().tolist() == [[10, 11, 13, -1, -1, -1]]
    with pytest.raises(Eagle3InputError, match=r"^verify_greedy: parents\[0, [24]\] = [34] is out of range"):
        eagle3_ops.check_errors()  # either violation may be recorded first


@pytest.mark.gpu
def test_cuda_sanitize_verify_greedy_small():
    # Small enough for compute-sanitizer memcheck (gpu_run.sh SANITIZE='cuda_sanitize'): the 16-byte and
    # the element paths, every dtype, a 64-node tree (the walk), B 0.
    for dtype in DTYPES:
        for V in (111, 4096):
            logits, tokens, parents = planted(V, 3, 64, V, "beam", dtype)
            cuda_greedy_vs_reference(logits, tokens, parents)
    out = greedy(torch.randn(0, 9, device="cuda"), torch.empty(0, 4, dtype=torch.int64, device="cuda"),
                 torch.empty(0, 4, dtype=torch.int32, device="cuda"))
    assert [tuple(o.shape) for o in out] == [(0, 4), (0,), (0, 4)]


# ---- verify_sampling on CUDA against the reference (-m gpu) -------------------------------------------------
# The kernel draws the reference's Philox uniforms exactly; its probabilities are float32 exp with float64
# sums where the reference is float64 throughout, so a decision (u * q < p) or the bonus race can differ
# only when its two sides agree to ~1e-6: exact agreement is required at temperature 0 and on all but a
# tiny fraction of requests otherwise (in practice none), and the distribution is tested by chi-square.


def _cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


def _sampling_cuda_vs_reference(logits, tokens, parents, temperature, seed, offset, draft_probs=None, d2t=None):
    want = sampling(logits, tokens, parents, temperature, seed, offset, draft_probs=draft_probs, d2t=d2t)
    B = tokens.shape[0]
    full = lambda v, dt: v if isinstance(v, torch.Tensor) else torch.full((B,), v, dtype=dt)  # noqa: E731
    got = torch.ops.eagle3.verify_sampling(*_cuda(logits, draft_probs, d2t, tokens, parents,
                                                  full(temperature, torch.float32), full(seed, torch.int64),
                                                  full(offset, torch.int64)))
    got = [g.cpu() for g in got]
    check_walk_structure(got, logits, tokens, parents)
    same = (got[0] == want[0]).all(1) & (got[1] == want[1]) & (got[2] == want[2]).all(1)
    return got, want, same


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 7, 64])
@pytest.mark.parametrize("N", [1, 2, 8, 64])
@pytest.mark.parametrize("with_q", [False, True])
def test_cuda_sampling_temperature_zero_is_exact(B, N, with_q):
    for dtype in (torch.bfloat16, torch.float32):
        logits, tokens, parents = planted(B * 100 + N, B, N, 4099, "beam" if N < 64 else "bushy", dtype=dtype,
                                          integer=True)
        g = torch.Generator().manual_seed(N)
        dp = torch.softmax(torch.randn(B * N, 4099, generator=g), -1) if with_q else None
        got, want, same = _sampling_cuda_vs_reference(logits, tokens, parents, 0.0, 3, 5, draft_probs=dp)
        assert bool(same.all()), f"{dtype}: requests {(~same).nonzero().flatten().tolist()} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("B, N, kind", [(1, 1, "chain"), (7, 2, "chain"), (7, 8, "beam"), (64, 8, "bushy"),
                                        (7, 64, "wide"), (64, 64, "beam")])
@pytest.mark.parametrize("q", ["one_hot", "draft_probs", "draft_probs_d2t"])
def test_cuda_sampling_matches_reference_draws(B, N, kind, q):
    V, Vd = 1111, 500
    logits, tokens, parents = planted(B + N, B, N, V, kind, p_plant=0.6)
    logits = logits * 2.5  # peaked rows: acceptances and rejections both frequent
    g = torch.Generator().manual_seed(B * N)
    dp = d2t = None
    if q == "draft_probs":
        dp = torch.softmax(torch.randn(B * N, V, generator=g) * 2, -1)
    elif q == "draft_probs_d2t":
        dp = torch.softmax(torch.randn(B * N, Vd, generator=g) * 2, -1)
        d2t = torch.sort(torch.randperm(V, generator=g)[:Vd]).values - torch.arange(Vd)  # injective, EAGLE-like
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.7])[torch.arange(B) % 4]
    seed = torch.arange(B) * 7919 + 2**33
    offset = torch.arange(B) + 2**32 + 11
    got, want, same = _sampling_cuda_vs_reference(logits, tokens, parents, temperature, seed, offset, dp, d2t)
    assert float(same.float().mean()) >= 0.97, f"requests {(~same).nonzero().flatten().tolist()} differ"
    assert bool(same[temperature == 0].all())


@pytest.mark.gpu
@pytest.mark.parametrize("N", [6145, 16384])  # past the 48 KB of shared memory a launch gets by default; the cap
def test_cuda_sampling_many_nodes(N):
    # The walk keeps a double per node in dynamic shared memory: 6145 nodes need the raised limit.
    # Request 0 greedy (exact), request 1 sampled (the walk's structure is checked; draws may differ by a rounding).
    logits, tokens, parents = planted(N, 2, N, 64, "wide", p_plant=0.6)
    temperature, seed, offset = torch.tensor([0.0, 0.8]), torch.tensor([5, 6]), torch.tensor([9, 10])
    got, want, same = _sampling_cuda_vs_reference(logits, tokens, parents, temperature, seed, offset, None, None)
    assert bool(same[0]), "the greedy request differs from the reference"


@pytest.mark.gpu
def test_cuda_sampling_refuses_more_nodes_than_the_cap():
    logits, tokens, parents = planted(1, 1, 16385, 8, "chain")
    args = [logits.cuda(), None, None, tokens.cuda(), parents.cuda(), torch.ones(1, device="cuda"),
            torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")]
    with pytest.raises(ValueError, match="tokens must have N <= 16384 nodes on CUDA"):
        torch.ops.eagle3.verify_sampling(*args)


@pytest.mark.gpu
def test_cuda_sampling_one_hot_target_is_deterministic():
    parents, tokens = i32([[-1, 0, 0, 0, 1, 2]]), i64([[7, 3, 5, 6, 8, 9]])
    V, B = 12, 64
    hot = torch.zeros(6, V)
    hot[torch.arange(6), torch.tensor([5, 1, 9, 1, 1, 2])] = 1e4
    g = torch.Generator().manual_seed(0)
    draft_probs = torch.softmax(torch.randn(B * 6, V, generator=g), -1)
    for dtype in (torch.bfloat16, torch.float32):
        for dp in (None, draft_probs):
            for temperature in (0.5, 1.0, 3.0):
                out = torch.ops.eagle3.verify_sampling(*_cuda(
                    hot.repeat(B, 1).to(dtype), dp, None, tokens.expand(B, 6).contiguous(),
                    parents.expand(B, 6).contiguous(), torch.full((B,), temperature), torch.arange(B) * 1000003,
                    torch.arange(B)))
                assert_equal(out[0].cpu(), i32([[0, 2, 5, -1, -1, -1]] * B), "accept_nodes")
                assert_equal(out[1].cpu(), i32([2] * B), "accept_len")
                assert_equal(out[2].cpu(), i64([[5, 9, 2, -1, -1, -1]] * B), "emitted")


def _chi_square_p(counts, p):
    """p-value of Pearson's chi-square statistic (cells with expected count >= 5; the rest pooled)."""
    n = counts.sum()
    expected = p * n
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        assert obs[-1] == 0, "a token of probability 0 was emitted"
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


CHI_LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.8, 0.5, 0.3, 0.1, 0.0, -0.2, -0.5, -0.8, -1.0, -1.5, -2.0, -3.0])


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.8])
@pytest.mark.parametrize("shape", ["leaf", "siblings", "bushy", "chain", "draft_probs_d2t"])
def test_cuda_sampling_chi_square_first_token(shape, temperature):
    # 200k seeded trials of the first emitted token against softmax(root logits / T), vocabulary 16.
    V, trials = 16, 200_000
    parents_row, tokens_row = {"leaf": ([-1], [0]), "siblings": ([-1, 0, 0, 0], [9, 0, 3, 0]),
                               "bushy": ([-1, 0, 0, 1, 1, 2], [9, 1, 0, 4, 2, 7]),
                               "chain": ([-1, 0, 1, 2], [9, 0, 5, 1]),
                               "draft_probs_d2t": ([-1, 0, 0, 1], [9, 2, 6, 3])}[shape]
    N = len(parents_row)
    g = torch.Generator().manual_seed(17)
    logits = CHI_LOGITS[torch.randperm(V, generator=g)].repeat(N, 1)  # every node row has the same target here
    logits[1:] = torch.randn(N - 1, V, generator=g)                   # except below the root
    dp = d2t = None
    if shape == "draft_probs_d2t":  # draft vocabulary of 8 mapped into 16; children drawn from q at the root
        d2t = torch.arange(8)  # draft d -> target d + d2t[d] = 2d
        dp = torch.softmax(torch.randn(N, 8, generator=g), -1)
    B = trials
    tokens = torch.tensor(tokens_row).expand(B, N).contiguous()
    if shape == "draft_probs_d2t":  # iid draft samples from q at the root for the root's two children
        picks = torch.multinomial(dp[0].expand(B, 8), 2, replacement=True, generator=g) * 2
        tokens = tokens.clone()
        tokens[:, 1:3] = picks
        dp = dp.repeat(B, 1)
    out = torch.ops.eagle3.verify_sampling(*_cuda(logits.repeat(B, 1), dp, d2t, tokens,
                                                  torch.tensor(parents_row, dtype=torch.int32).expand(B, N).contiguous(),
                                                  torch.full((B,), temperature), torch.arange(B) + 12345,
                                                  torch.full((B,), 99, dtype=torch.int64)))
    first = out[2][:, 0].cpu().numpy()
    p = torch.softmax(logits[0].double() / temperature, -1).numpy()
    pval = _chi_square_p(np.bincount(first, minlength=V).astype(np.float64), p)
    assert pval > 1e-3, f"chi-square p = {pval:.2e}"


@pytest.mark.gpu
def test_cuda_sampling_graph_replay_with_new_seeds_and_offsets():
    B, N, V = 7, 8, 3001
    logits, tokens, parents = planted(21, B, N, V, "beam", p_plant=0.6)
    logits = (logits * 2).cuda()
    static = dict(temperature=torch.ones(B, device="cuda"), seed=torch.zeros(B, dtype=torch.int64, device="cuda"),
                  offset=torch.zeros(B, dtype=torch.int64, device="cuda"))
    tok_c, par_c = tokens.cuda(), parents.cuda()
    call = lambda: torch.ops.eagle3.verify_sampling(logits, None, None, tok_c, par_c, static["temperature"],  # noqa: E731
                                                    static["seed"], static["offset"])
    graph, captured = capture_graph(call)
    outcomes = set()
    for step in range(4):
        static["seed"].copy_(torch.arange(B) * 31 + step)
        static["offset"].copy_(torch.full((B,), 1000 * step))
        static["temperature"].copy_(torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 1.0, 0.7]))
        graph.replay()
        eager = call()
        for c, e, name in zip(captured, eager, ("accept_nodes", "accept_len", "emitted")):
            assert_equal(c.cpu(), e.cpu(), f"{name} (replay {step})")
        outcomes.add(tuple(captured[2].flatten().tolist()))
    assert len(outcomes) > 1, "new seeds and offsets did not change the draws"


@pytest.mark.gpu
def test_cuda_sampling_never_materialises_fp32_probabilities():
    B, N, V = 16, 8, 163840
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B * N, V, generator=g).to(torch.bfloat16).cuda()
    tokens = torch.randint(0, V, (B, N), generator=g).cuda()
    parents = tree.random_parents(B, N, g, "beam").cuda()
    dp = torch.softmax(torch.randn(B * N, 32000, generator=g), -1).cuda()
    d2t = (torch.sort(torch.randperm(V, generator=g)[:32000]).values - torch.arange(32000)).cuda()
    args = (torch.ones(B, device="cuda"), torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda"))
    for q in ((None, None), (dp, d2t)):
        torch.ops.eagle3.verify_sampling(logits, *q, tokens, parents, *args)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.ops.eagle3.verify_sampling(logits, *q, tokens, parents, *args)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert extra < B * N * V * 4 / 4, f"{extra} bytes of workspace (fp32 [B, N, V] would be {B * N * V * 4})"


@pytest.mark.gpu
@pytest.mark.parametrize("case, error, match", [
    ("temperature_dtype", TypeError, "temperature must have dtype"),
    ("seed_dtype", TypeError, "seed must have dtype"),
    ("offset_shape", ValueError, "offset must have shape"),
    ("d2t_without_draft_probs", ValueError, "d2t"),
    ("vd_without_d2t", ValueError, "d2t"),
    ("draft_probs_rows", ValueError, "draft_probs must have shape"),
    ("logits_rows", ValueError, "logits must have shape"),
    ("empty_vocab", ValueError, r"logits must have 1 <= V < 2\*\*31, got V = 0"),
])
def test_cuda_sampling_bad_input(case, error, match):
    args = _bad_sampling_args(case)
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    with pytest.raises(error, match=match):
        torch.ops.eagle3.verify_sampling(**args)


@pytest.mark.gpu
def test_cuda_sanitize_verify_sampling_small():
    # Small enough for compute-sanitizer (SANITIZE='sampling'): both q paths, a 64-node tree, odd V, B 0,
    # bad values (token out of range: valid; parent not topological, negative temperature, d2t entries
    # mapping below 0: recorded in the error word).
    eagle3_ops.check_errors()
    V = 333
    logits, tokens, parents = planted(5, 3, 64, V, "beam")
    tokens[0, 5] = V + 7
    parents[1, 9] = 40
    g = torch.Generator().manual_seed(1)
    dp = torch.softmax(torch.randn(3 * 64, 100, generator=g), -1)
    d2t = torch.randint(-50, V - 99, (100,), generator=g)
    for q in ((None, None), (dp, d2t)):
        out = torch.ops.eagle3.verify_sampling(*_cuda(logits, *q, tokens, parents, torch.tensor([1.0, -1.0, 0.5]),
                                                      torch.arange(3), torch.zeros(3, dtype=torch.int64)))
        torch.cuda.synchronize()
        assert out[1].cpu().tolist()[1] >= 0
        with pytest.raises(Eagle3InputError, match="^verify_sampling: (parents|temperature|d2t)"):
            eagle3_ops.check_errors()
    out = torch.ops.eagle3.verify_sampling(torch.randn(0, 9, device="cuda"), None, None,
                                           torch.empty(0, 4, dtype=torch.int64, device="cuda"),
                                           torch.empty(0, 4, dtype=torch.int32, device="cuda"),
                                           torch.empty(0, device="cuda"), torch.empty(0, dtype=torch.int64, device="cuda"),
                                           torch.empty(0, dtype=torch.int64, device="cuda"))
    assert [tuple(o.shape) for o in out] == [(0, 4), (0,), (0, 4)]
