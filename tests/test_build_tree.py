"""build_tree: hand-worked golden trees (the score cap, ties, -inf padding), an independent ranking on
random EAGLE-like and adversarial inputs, the canonical-tree invariants, and bad input that raises and
writes nothing. CPU: the op dispatches to the reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import eagle3_ops
from eagle3_ops import tree
from eagle3_ops.errors import Eagle3InputError
from tests.conftest import assert_equal, poison_

PROPERTY = settings(derandomize=True, max_examples=60, deadline=None)
SCORE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NEG_INF = float("-inf")


def i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


def i64(rows):
    return torch.tensor(rows, dtype=torch.int64)


def outputs(B, N):
    """Poisoned output tensors (tokens, parents, positions, tree_mask): unwritten elements show."""
    return tuple(poison_(t) for t in (torch.empty(B, N, dtype=torch.int64), torch.empty(B, N, dtype=torch.int32),
                                      torch.empty(B, N, dtype=torch.int64),
                                      torch.empty(B, N, (N + 31) // 32, dtype=torch.int32)))


def build(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, N):
    out = outputs(root_tokens.shape[0], N)
    torch.ops.eagle3.build_tree(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, *out)
    return out


def assert_tree(out, tokens, parents, positions, tree_mask):
    for got, want, name in zip(out, (i64(tokens), i32(parents), i64(positions), i32(tree_mask)),
                               ("tokens", "parents", "positions", "tree_mask")):
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}"
        assert_equal(got, want.view(got.shape), name)


# ---- golden cases, every value written out --------------------------------------------------------------

# B = 2, S = 2 draft steps, M = 2 candidates per step.
#   request 0 (root 100, prefix 7):
#     depth 0: (0,0) tok 10 score -0.5      (0,1) tok 11 score -1.0
#     depth 1: (1,0) tok 20 score -0.25, parent (0,1)   <- raw score above its parent's: capped to -1.0
#              (1,1) tok 21 score -0.875, parent (0,0)  <- eff -0.875
#     rank: (0,0) -0.5, (1,1) -0.875, then the tie at -1.0: (0,1) before (1,0) (depth ascending)
#     nodes: 1 = (0,0) tok 10 parent 0; 2 = (1,1) tok 21 parent node 1; 3 = (0,1) tok 11 parent 0;
#            4 = (1,0) tok 20 parent node 3
#     depth [0, 1, 2, 1, 2] -> positions 7 + depth; mask rows {0} {0,1} {0,1,2} {0,3} {0,3,4}
#   request 1 (root 200, prefix 0), same tokens and parents, no cap or tie at play:
#     depth 0: -2.0, -0.25; depth 1: (1,0) -3.0 (parent (0,1)), (1,1) -2.5 (parent (0,0))
#     rank: (0,1) -0.25, (0,0) -2.0, (1,1) -2.5, (1,0) -3.0
#     nodes: 1 = tok 11 parent 0; 2 = tok 10 parent 0; 3 = tok 21 parent node 2; 4 = tok 20 parent node 1
#     mask rows {0} {0,1} {0,2} {0,2,3} {0,1,4}
GOLDEN_TOKENS = [[[10, 11], [20, 21]], [[10, 11], [20, 21]]]
GOLDEN_SCORES = [[[-0.5, -1.0], [-0.25, -0.875]], [[-2.0, -0.25], [-3.0, -2.5]]]  # exact in bf16 and fp16
GOLDEN_PARENTS = [[[-1, -1], [1, 0]], [[-1, -1], [1, 0]]]
GOLDEN_N5 = ([[100, 10, 21, 11, 20], [200, 11, 10, 21, 20]],
             [[-1, 0, 1, 0, 3], [-1, 0, 0, 2, 1]],
             [[7, 8, 9, 8, 9], [0, 1, 1, 2, 2]],
             [[0b1, 0b11, 0b111, 0b1001, 0b11001], [0b1, 0b11, 0b101, 0b1101, 0b10011]])


@pytest.mark.parametrize("score_dtype", SCORE_DTYPES)
@pytest.mark.parametrize("parent_dtype", [torch.int32, torch.int64])
def test_golden_cap_and_tie(score_dtype, parent_dtype):
    out = build(i64([100, 200]), i64(GOLDEN_TOKENS), torch.tensor(GOLDEN_SCORES, dtype=score_dtype),
                torch.tensor(GOLDEN_PARENTS, dtype=parent_dtype), i32([7, 0]), 5)
    assert_tree(out, *GOLDEN_N5)


@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_golden_smaller_N_keeps_the_best(N):
    # N nodes are the root and the N - 1 best candidates: the first N nodes of the N = 5 tree.
    out = build(i64([100, 200]), i64(GOLDEN_TOKENS), torch.tensor(GOLDEN_SCORES), i32(GOLDEN_PARENTS),
                i32([7, 0]), N)
    tokens, parents, positions, masks = GOLDEN_N5
    assert_tree(out, [t[:N] for t in tokens], [p[:N] for p in parents], [q[:N] for q in positions],
                [m[:N] for m in masks])


def test_golden_sibling_tie_and_padding():
    # S = 2, M = 3, root 50, prefix 0. Depth 0: tok 1 and tok 2 tie at -1.0 (m ascending: tok 1 first),
    # (0,2) is -inf padding. Depth 1: (1,0) tok 4 -1.5 under (0,1); (1,1) tok 5 -1.25 under (0,0);
    # (1,2) tok 6 -2.0 under the padding (0,2): capped to -inf.
    # rank: (0,0) -1, (0,1) -1, (1,1) -1.25, (1,0) -1.5, (0,2) -inf, (1,2) -inf.
    # N = 7 = 1 + S * M takes every candidate, padding included, still in rank order:
    #   nodes 1 = tok 1, 2 = tok 2 (children of 0), 3 = tok 5 (under 1), 4 = tok 4 (under 2),
    #   5 = tok 3 (the padding, under 0), 6 = tok 6 (under 5).
    args = (i64([50]), i64([[[1, 2, 3], [4, 5, 6]]]), torch.tensor([[[-1.0, -1.0, NEG_INF], [-1.5, -1.25, -2.0]]]),
            i64([[[-1, -1, -1], [1, 0, 2]]]), i32([0]))
    assert_tree(build(*args, 5), [[50, 1, 2, 5, 4]], [[-1, 0, 0, 1, 2]], [[0, 1, 1, 2, 2]],
                [[0b1, 0b11, 0b101, 0b1011, 0b10101]])
    assert_tree(build(*args, 7), [[50, 1, 2, 5, 4, 3, 6]], [[-1, 0, 0, 1, 2, 0, 5]], [[0, 1, 1, 2, 2, 1, 2]],
                [[0b1, 0b11, 0b101, 0b1011, 0b10101, 0b100001, 0b1100001]])


def test_golden_root_only_and_no_draft_steps():
    # N = 1: only the root, whatever the candidates; S = 0 (no draft step at all) allows only N = 1.
    assert_tree(build(i64([5, 6]), i64(GOLDEN_TOKENS), torch.tensor(GOLDEN_SCORES), i32(GOLDEN_PARENTS),
                      i32([3, 0]), 1), [[5], [6]], [[-1], [-1]], [[3], [0]], [[1], [1]])
    empty = torch.empty(2, 0, 4)
    assert_tree(build(i64([5, 6]), empty.long(), empty, empty.int(), i32([3, 9]), 1),
                [[5], [6]], [[-1], [-1]], [[3], [9]], [[1], [1]])


def test_golden_chain_m1():
    # M = 1: one candidate per step, a chain; the root's last word boundary at N = 33 (two mask words).
    S = 32
    scores = -torch.arange(1, S + 1, dtype=torch.float32).view(1, S, 1)
    parents = torch.zeros(1, S, 1, dtype=torch.int64)
    parents[0, 0, 0] = -1
    out = build(i64([9]), torch.arange(100, 100 + S).view(1, S, 1), scores, parents, i32([4]), S + 1)
    chain = tree.chain_parents(1, S + 1)
    assert_equal(out[0], torch.cat([i64([[9]]), torch.arange(100, 100 + S)[None]], 1), "tokens")
    assert_equal(out[1], chain, "parents")
    assert_equal(out[2], 4 + torch.arange(S + 1)[None], "positions")
    assert_equal(out[3], tree.tree_mask(chain), "tree_mask")
    assert out[3][0, 32].tolist() == [-1, 1]


# ---- an independent implementation and the invariants ---------------------------------------------------


def naive_build_tree(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, N):
    """Plain Python: effective scores by recursion, ranking by sorted((-eff, d, m)), masks by walking up.
    Returns (tokens, parents, positions, tree_mask) as lists and the effective score of every node."""
    B, S, M = draft_tokens.shape
    scores, par, tok = draft_scores.double().tolist(), draft_parents.tolist(), draft_tokens.tolist()
    W = (N + 31) // 32
    all_tokens, all_parents, all_positions, all_masks, all_effs = [], [], [], [], []
    for b in range(B):
        eff = {}
        for d in range(S):
            for m in range(M):
                eff[d, m] = scores[b][d][m] if d == 0 else min(scores[b][d][m], eff[d - 1, par[b][d][m]])
        ranked = sorted(eff, key=lambda dm: (-eff[dm], dm[0], dm[1]))[:N - 1]
        node, tokens, parents, effs = {}, [int(root_tokens[b])], [-1], [math.inf]
        for i, (d, m) in enumerate(ranked):
            node[d, m] = i + 1
            tokens.append(tok[b][d][m])
            parents.append(0 if d == 0 else node[d - 1, par[b][d][m]])
            effs.append(eff[d, m])
        positions, masks = [], []
        for i in range(N):
            words, depth, j = [0] * W, -1, i
            while j != -1:
                words[j // 32] |= 1 << (j % 32)
                depth, j = depth + 1, parents[j]
            positions.append(int(prefix_lens[b]) + depth)
            masks.append([w - 2**32 if w >= 2**31 else w for w in words])
        for lst, v in zip((all_tokens, all_parents, all_positions, all_masks, all_effs),
                          (tokens, parents, positions, masks, effs)):
            lst.append(v)
    return (all_tokens, all_parents, all_positions, all_masks), all_effs


def check_invariants(out, effs, root_tokens, prefix_lens):
    tokens, parents, positions, tree_mask = out
    tree.validate(tokens, parents)  # canonical: root first, parents precede children
    assert_equal(tokens[:, 0], root_tokens, "tokens[:, 0]")
    assert_equal(positions, prefix_lens.long()[:, None] + tree.depth(parents), "positions")
    assert_equal(tree_mask, tree.tree_mask(parents), "tree_mask")
    for b, e in enumerate(effs):
        # Nodes are in rank order, so effective scores never increase with the index, siblings included.
        assert all(e[i] >= e[i + 1] for i in range(len(e) - 1)), f"request {b}: {e}"
        for i in range(2, len(e)):
            assert int(parents[b, i]) < i


def eagle_like(g, B, S, topk, vocab):
    """EAGLE-2/3 draft steps: depth 0 is the root's top-k (padded with -inf to M = topk**2), each later
    step expands the top-k beams of the previous one by their top-k; scores are cumulative log-probs."""
    M = topk * topk
    tokens = torch.randint(0, vocab, (B, S, M), generator=g)
    scores = torch.full((B, S, M), NEG_INF)
    parents = torch.full((B, S, M), -1, dtype=torch.int64)
    logp = torch.log_softmax(torch.randn(B, vocab, generator=g) * 3, -1).topk(topk)
    scores[:, 0, :topk], tokens[:, 0, :topk] = logp.values, logp.indices
    for d in range(1, S):
        beams = scores[:, d - 1].topk(topk).indices  # [B, topk] among the previous step's M
        for i in range(topk):
            child = torch.log_softmax(torch.randn(B, vocab, generator=g) * 3, -1).topk(topk)
            cols = slice(i * topk, (i + 1) * topk)
            scores[:, d, cols] = scores[:, d - 1].gather(1, beams[:, i:i + 1]) + child.values
            tokens[:, d, cols] = child.indices
            parents[:, d, cols] = beams[:, i:i + 1]
    return tokens, scores, parents


def _run_and_compare(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, N):
    out = build(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, N)
    want, effs = naive_build_tree(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, N)
    assert_tree(out, *want)
    check_invariants(out, effs, root_tokens, prefix_lens)
    return out


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1),
       B=st.sampled_from([1, 3]),
       S=st.sampled_from([1, 2, 5]),           # one draft step, two, EAGLE-3's usual depth
       topk=st.sampled_from([1, 2, 4]),        # chain drafting, small and typical top-k
       n_choice=st.sampled_from(["one", "full", "random"]),
       score_dtype=st.sampled_from(SCORE_DTYPES))
def test_eagle_like_matches_independent_ranking(seed, B, S, topk, n_choice, score_dtype):
    g = torch.Generator().manual_seed(seed)
    draft_tokens, scores, draft_parents = eagle_like(g, B, S, topk, 111)
    M = topk * topk
    N = {"one": 1, "full": 1 + S * M, "random": int(torch.randint(1, 2 + S * M, (1,), generator=g))}[n_choice]
    root_tokens = torch.randint(0, 111, (B,), generator=g)
    prefix_lens = torch.randint(0, 1000, (B,), generator=g, dtype=torch.int32)
    _run_and_compare(root_tokens, draft_tokens, scores.to(score_dtype), draft_parents.int(), prefix_lens, N)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.sampled_from([1, 2]), S=st.integers(1, 4), M=st.integers(1, 6),
       levels=st.sampled_from([2, 4, 50]))  # few distinct score values: ties and caps everywhere
def test_adversarial_scores_match_independent_ranking(seed, B, S, M, levels):
    # Arbitrary (not cumulative) scores from a small set, some -inf: children often outscore their parents
    # (the cap decides) and ties are frequent (depth, then index, decide).
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (B, S, M), generator=g).float() * -0.5
    scores[torch.rand(B, S, M, generator=g) < 0.15] = NEG_INF
    draft_parents = torch.randint(0, M, (B, S, M), generator=g)
    draft_parents[:, 0] = -1
    draft_tokens = torch.randint(0, 32000, (B, S, M), generator=g)
    root_tokens = torch.randint(0, 32000, (B,), generator=g)
    prefix_lens = i32([0, 17][:B])
    previous = None
    for N in range(1, 2 + S * M):
        out = _run_and_compare(root_tokens, draft_tokens, scores, draft_parents, prefix_lens, N)
        if previous is not None:  # one more node appends the next-ranked candidate, nothing else changes
            for got, before, name in zip(out, previous, ("tokens", "parents", "positions")):
                assert_equal(got[:, :N - 1], before, name)
        previous = out[:3]


def test_kimi_like_sizes():
    # EAGLE-3 at serving sizes: topk 8 (M = 64), 6 steps, N = 64 nodes (two mask words), B = 3.
    g = torch.Generator().manual_seed(5)
    draft_tokens, scores, draft_parents = eagle_like(g, 3, 6, 8, 163840)
    _run_and_compare(i64([1, 2, 3]), draft_tokens, scores, draft_parents, i32([0, 4095, 70000]), 64)


# ---- bad input: errors naming the argument, outputs untouched ---------------------------------------------


def _bad_args(case):
    root, tokens, scores, parents, prefix = (i64([100, 200]), i64(GOLDEN_TOKENS), torch.tensor(GOLDEN_SCORES),
                                             i64(GOLDEN_PARENTS), i32([7, 0]))
    N = 5
    out = outputs(2, N)
    if case == "nan_score":
        scores[1, 1, 0] = float("nan")
    elif case == "depth0_parent":
        parents[1, 0, 1] = 0
    elif case == "parent_too_large":
        parents[1, 1, 0] = 2  # M = 2
    elif case == "parent_negative":
        parents[0, 1, 1] = -1
    elif case == "too_many_nodes":
        out = outputs(2, 6)  # N = 6 > 1 + S * M = 5
    elif case == "mask_words":
        out = out[:3] + (poison_(torch.empty(2, N, 2, dtype=torch.int32)),)
    elif case == "positions_dtype":
        out = (out[0], out[1], poison_(torch.empty(2, N, dtype=torch.int32)), out[3])
    elif case == "prefix_dtype":
        prefix = prefix.long()
    elif case == "scores_shape":
        scores = scores[:, :1]
    elif case == "parents_dtype":
        parents = parents.float()
    return (root, tokens, scores, parents, prefix) + out


# Shape, dtype and size errors: raised up front on every device.
LAYOUT_CASES = [
    ("too_many_nodes", ValueError, "tokens must have N"),
    ("mask_words", ValueError, "tree_mask must have shape"),
    ("positions_dtype", TypeError, "positions must have dtype"),
    ("prefix_dtype", TypeError, "prefix_lens must have dtype"),
    ("scores_shape", ValueError, "draft_scores must have shape"),
    ("parents_dtype", TypeError, "draft_parents must have dtype"),
]


# Bad values: the exact messages the CUDA kernel records too (tests/test_contract_tree.py covers CUDA).
@pytest.mark.parametrize("case, error, match", [
    ("nan_score", Eagle3InputError, r"^build_tree: draft_scores\[1, 1, 0\] is NaN$"),
    ("depth0_parent", Eagle3InputError, r"^build_tree: draft_parents\[1, 0, 1\] = 0 is out of range \(valid: -1\.\.-1\)$"),
    ("parent_too_large", Eagle3InputError, r"^build_tree: draft_parents\[1, 1, 0\] = 2 is out of range \(valid: 0\.\.1\)$"),
    ("parent_negative", Eagle3InputError, r"^build_tree: draft_parents\[0, 1, 1\] = -1 is out of range \(valid: 0\.\.1\)$"),
] + LAYOUT_CASES)
def test_bad_input_raises_and_writes_nothing(case, error, match):
    args = _bad_args(case)
    outs = args[5:]
    before = [t.clone() for t in outs]
    with pytest.raises(error, match=match):
        torch.ops.eagle3.build_tree(*args)
    for i, (t, b) in enumerate(zip(outs, before)):
        assert_equal(t, b, f"output {i}")


# ---- CUDA kernel against the reference (-m gpu) ------------------------------------------------------------


def _cuda_vs_reference(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, N):
    want = build(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, N)
    dev = [t.cuda() for t in (root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens)]
    got = tuple(t.cuda() for t in outputs(root_tokens.shape[0], N))
    torch.ops.eagle3.build_tree(*dev, *got)
    for g, w, name in zip(got, want, ("tokens", "parents", "positions", "tree_mask")):
        assert_equal(g.cpu(), w, name)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("score_dtype", SCORE_DTYPES)
@pytest.mark.parametrize("parent_dtype", [torch.int32, torch.int64])
def test_gpu_golden_cap_and_tie(score_dtype, parent_dtype):
    got = _cuda_vs_reference(i64([100, 200]), i64(GOLDEN_TOKENS), torch.tensor(GOLDEN_SCORES, dtype=score_dtype),
                             torch.tensor(GOLDEN_PARENTS, dtype=parent_dtype), i32([7, 0]), 5)
    assert_tree(tuple(t.cpu() for t in got), *GOLDEN_N5)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 7, 64])                 # one request, odd, serving batch
@pytest.mark.parametrize("N", [1, 2, 8, 64])              # root only, one node, small, two mask words
@pytest.mark.parametrize("topk, S", [(1, 6), (2, 3), (4, 5), (8, 6)])  # chain drafting .. EAGLE-3 Kimi setting
def test_gpu_random_sweep_matches_reference(B, N, topk, S):
    g = torch.Generator().manual_seed(B * 1000 + N * 10 + topk)
    draft_tokens, scores, draft_parents = eagle_like(g, B, S, topk, 32000)
    M = topk * topk
    if N > 1 + S * M:
        pytest.skip("N exceeds the candidates")
    prefix = torch.randint(0, 100000, (B,), generator=g, dtype=torch.int32)
    root = torch.randint(0, 32000, (B,), generator=g)
    for dtype in SCORE_DTYPES:  # bf16 / fp16 round the cumulative scores: ties everywhere
        _cuda_vs_reference(root, draft_tokens, scores.to(dtype), draft_parents.int(), prefix, N)


@pytest.mark.gpu
def test_gpu_adversarial_ties_and_caps():
    g = torch.Generator().manual_seed(9)
    for trial in range(30):
        B, S, M = 7, int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        scores = torch.randint(0, 3, (B, S, M), generator=g).float() * -0.5
        scores[torch.rand(B, S, M, generator=g) < 0.15] = NEG_INF
        draft_parents = torch.randint(0, M, (B, S, M), generator=g)
        draft_parents[:, 0] = -1
        draft_tokens = torch.randint(0, 32000, (B, S, M), generator=g)
        for N in sorted({1, 2, min(8, 1 + S * M), 1 + S * M}):
            _cuda_vs_reference(torch.arange(B), draft_tokens, scores, draft_parents, torch.arange(B, dtype=torch.int32),
                               N)


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_with_new_values():
    g = torch.Generator().manual_seed(4)
    B, S, topk, N = 64, 6, 8, 64
    inputs = [t.cuda() for t in eagle_like(g, B, S, topk, 32000)]
    inputs[2] = inputs[2].int()
    root = torch.randint(0, 32000, (B,), generator=g).cuda()
    prefix = torch.randint(0, 1000, (B,), generator=g, dtype=torch.int32).cuda()
    outs = tuple(t.cuda() for t in outputs(B, N))
    args = (root, inputs[0], inputs[1], inputs[2], prefix) + outs
    torch.ops.eagle3.build_tree(*args)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.eagle3.build_tree(*args)
    for step in range(3):
        new_tokens, new_scores, new_parents = eagle_like(g, B, S, topk, 32000)
        for dst, src in zip(args[:5], (torch.randint(0, 32000, (B,), generator=g), new_tokens, new_scores,
                                       new_parents.int(), torch.randint(0, 1000, (B,), generator=g, dtype=torch.int32))):
            dst.copy_(src)
        for o in outs:
            o.fill_(-12345)
        graph.replay()
        want = build(*(a.cpu() for a in args[:5]), N)
        for got, w, name in zip(outs, want, ("tokens", "parents", "positions", "tree_mask")):
            assert_equal(got.cpu(), w, f"{name} (replay {step})")


@pytest.mark.gpu
@pytest.mark.parametrize("case, error, match", LAYOUT_CASES)
def test_gpu_bad_input_raises_and_writes_nothing(case, error, match):
    args = [t.cuda() for t in _bad_args(case)]
    before = [t.clone() for t in args[5:]]
    with pytest.raises(error, match=match):
        torch.ops.eagle3.build_tree(*args)
    for i, (t, b) in enumerate(zip(args[5:], before)):
        assert_equal(t, b, f"output {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["nan_score", "depth0_parent", "parent_too_large", "parent_negative"])
def test_gpu_values_the_reference_rejects_still_give_a_canonical_tree(case):
    # The kernel reads NaN as -inf and a bad parent as the root, records the value in the error word and
    # never indexes out of bounds (compute-sanitizer runs these); the output is still a canonical tree.
    eagle3_ops.check_errors()
    args = [t.cuda() for t in _bad_args(case)]
    torch.ops.eagle3.build_tree(*args)
    with pytest.raises(Eagle3InputError, match="^build_tree: draft_"):
        eagle3_ops.check_errors()
    tokens, parents, positions, tree_mask = (t.cpu() for t in args[5:])
    tree.validate(tokens, parents)
    assert_equal(positions, args[4].cpu().long()[:, None] + tree.depth(parents), "positions")
    assert_equal(tree_mask, tree.tree_mask(parents), "tree_mask")
