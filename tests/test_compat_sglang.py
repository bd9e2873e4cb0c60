"""eagle3_ops.compat.sglang: build_tree_kernel_efficient and verify_tree_greedy against a plain-Python
restatement of sgl-kernel's semantics (eagle_utils.cu, read as a specification), on hand-built trees and
thousands of random EAGLE-like selections (hypothesis), in all three mask modes; agreement with our own
tree utilities and verify_greedy; the same on CUDA tensors (-m gpu). Then the layouts SGLang's callers
pass, the peers' hand-made cases with their exact outputs, tree_speculative_sampling_target_only against a
plain-Python restatement of speculative_sampling.cuh, segment_packbits, reconstruct_indices_from_tree_mask,
and bad input refused before anything is written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3_ops import tree
from eagle3_ops import Eagle3InputError
from eagle3_ops.compat.sglang import (TreeMaskMode, build_tree_kernel_efficient, reconstruct_indices_from_tree_mask,
                                      segment_packbits, tree_speculative_sampling_target_only, verify_tree_greedy)
from eagle3_ops.compat.sglang_srt import build_tree_kernel_efficient as srt_build_tree
from eagle3_ops.compat.sglang_srt import organize_draft_results
from tests.conftest import assert_equal, capture_graph

PROPERTY = settings(derandomize=True, max_examples=150, deadline=None)
MODES = list(TreeMaskMode)


# ---- SGLang's semantics, restated in plain Python (one request at a time) ----------------------------


def naive_build(parent_list, selected_index, seq_lens, topk, N, mode):
    """Returns (mask as {flat index: bool} or bytes rows, positions, retrive_index, next_token, next_sibling)
    exactly as SGLang's kernel leaves them when the lists start at -1 and the mask at `init`."""
    B = len(seq_lens)
    positions, r_index, r_next, r_sib, rows = [], [], [], [], []
    for b in range(B):
        sel = selected_index[b]

        def parent_node(i):  # node i >= 1 -> parent node, or None when the parent was not selected
            slot = sel[i - 1] // topk
            if slot == 0:
                return 0
            cand = parent_list[b][slot]
            for p in range(N - 1):
                if sel[p] == cand:
                    return p + 1
            return None

        nxt, sib = [-1] * N, [-1] * N
        for i in range(N - 1, 0, -1):
            p = parent_node(i)
            if p is None:
                continue
            if nxt[p] != -1:
                sib[i] = nxt[p]
            nxt[p] = i
        r_next.append(nxt)
        r_sib.append(sib)
        r_index.append([b * N + i for i in range(N)])
        for i in range(N):
            seen, j, d = {0}, i, 0
            while j != 0:  # an unlinked node hangs from the root (compat's documented choice)
                seen.add(j)
                d += 1
                j = parent_node(j) or 0
            positions.append(seq_lens[b] + d)
            rows.append([k in seen for k in range(N)])
    return rows, positions, r_index, r_next, r_sib


def eagle_selection(g, B, topk, depth, N):
    """SGLang's preprocess on random log-probabilities: step 0 = the root's topk candidates (flat 0..topk-1),
    step d >= 1 = topk * topk candidates, the children of the topk best candidates of step d - 1 (flat
    topk + (d - 1) * topk * topk + beam * topk + k, slot = flat // topk = 1 + (d - 1) * topk + beam);
    parent_list[slot] = the flat index of that beam. The N - 1 best are selected and sorted.
    Child scores are strictly below their parent's (log-softmax over topk + 1 outcomes), so the
    selection is closed under ancestry."""
    def logp(*shape):
        return torch.log_softmax(torch.randn(*shape, topk + 1, generator=g), -1)[..., :topk]

    scores, parent_cols, offset = [logp(B)], [], 0
    for d in range(1, depth):
        prev = scores[-1]
        beams = prev.topk(topk, dim=-1).indices                        # expanded beams of step d - 1
        parent_cols.append(offset + beams)
        offset += prev.shape[1]
        scores.append((prev.gather(1, beams)[:, :, None] + logp(B, topk)).reshape(B, topk * topk))
    flat = torch.cat(scores, 1)
    selected = torch.sort(flat.topk(N - 1, dim=-1).indices, dim=-1).values
    parent_list = torch.cat([torch.full((B, 1), -1, dtype=torch.int64)] + parent_cols, 1)
    return parent_list, selected


def run_build(parent_list, selected_index, seq_lens, topk, depth, N, mode, device="cpu"):
    B = parent_list.shape[0]
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    if mode == TreeMaskMode.FULL_MASK:
        mask = torch.ones(sum(seq_lens) * N + B * N * N, dtype=torch.bool, device=device)
    elif mode == TreeMaskMode.QLEN_ONLY:
        mask = torch.ones(B * N * N, dtype=torch.bool, device=device)
    else:
        mask = torch.zeros(B * N, 1 if N <= 8 else (2 if N <= 16 else 4), dtype=torch.uint8, device=device)
    positions = torch.full((B * N,), -7, dtype=torch.int64, device=device)
    r_index = torch.full((B, N), -7, dtype=torch.int64, device=device)
    r_next = torch.full((B, N), -1, dtype=torch.int64, device=device)
    r_sib = torch.full((B, N), -1, dtype=torch.int64, device=device)
    build_tree_kernel_efficient(parent_list.to(device), selected_index.to(device), seq, mask, positions, r_index,
                                r_next, r_sib, topk, depth, N, mode)
    return mask.cpu(), positions.cpu(), r_index.cpu(), r_next.cpu(), r_sib.cpu()


def check_build(parent_list, selected_index, seq_lens, topk, depth, N, mode, device="cpu"):
    mask, positions, r_index, r_next, r_sib = run_build(parent_list, selected_index, seq_lens, topk, depth, N, mode,
                                                        device)
    rows, w_pos, w_index, w_next, w_sib = naive_build(parent_list.tolist(), selected_index.tolist(), seq_lens, topk,
                                                      N, mode)
    assert_equal(positions, torch.tensor(w_pos), "positions")
    assert_equal(r_index, torch.tensor(w_index), "retrive_index")
    assert_equal(r_next, torch.tensor(w_next), "retrive_next_token")
    assert_equal(r_sib, torch.tensor(w_sib), "retrive_next_sibling")
    B = len(seq_lens)
    if mode == TreeMaskMode.QLEN_ONLY:
        assert_equal(mask, torch.tensor(rows).view(-1), "tree_mask")
    elif mode == TreeMaskMode.FULL_MASK:
        want = []
        for b in range(B):
            for i in range(N):  # prefix columns untouched (the caller's True), then the tree block
                want += [True] * seq_lens[b] + rows[b * N + i]
        assert_equal(mask, torch.tensor(want), "tree_mask")
    else:
        nbytes = mask.shape[1]
        want = [[sum(1 << k for k in range(8) if 8 * byte + k < N and r[8 * byte + k]) for byte in range(nbytes)]
                for r in rows]
        assert_equal(mask, torch.tensor(want, dtype=torch.uint8), "tree_mask")
    return r_next, r_sib


# ---- golden: a hand-built selection ----------------------------------------------------------------------

# topk 2, depth 3. Candidates: step 0 = flat 0, 1 (the root's children, slot 0); step 1 = flat 2..5 (slot 1
# expands candidate parent_list[1], slot 2 expands parent_list[2]); step 2 = flat 6..9 (slots 3, 4).
# parent_list = [-1, 0, 1, 2, 4]: slot 1 = children of flat 0, slot 2 of flat 1, slot 3 of flat 2, slot 4 of flat 4.
# selected (sorted) = [0, 1, 2, 4, 6]: nodes 1..5.
#   node 1 = flat 0 (slot 0 -> root); node 2 = flat 1 (root); node 3 = flat 2 (slot 1 -> flat 0 = node 1);
#   node 4 = flat 4 (slot 2 -> flat 1 = node 2); node 5 = flat 6 (slot 3 -> flat 2 = node 3)
GOLDEN_PARENT_LIST = [[-1, 0, 1, 2, 4]]
GOLDEN_SELECTED = [[0, 1, 2, 4, 6]]


@pytest.mark.parametrize("mode", MODES)
def test_golden_selection(mode):
    r_next, r_sib = check_build(torch.tensor(GOLDEN_PARENT_LIST), torch.tensor(GOLDEN_SELECTED), [5], 2, 3, 6, mode)
    assert r_next.tolist() == [[1, 3, 4, 5, -1, -1]]
    assert r_sib.tolist() == [[-1, 2, -1, -1, -1, -1]]
    tokens, parents = tree.from_sglang(torch.arange(6), torch.arange(6)[None], r_next, r_sib)
    assert parents.tolist() == [[-1, 0, 0, 1, 2, 3]]


def test_golden_unselected_parent_keeps_a_consistent_tree():
    # node 2 = flat 8 (slot 4 -> flat 4, not selected): undefined in SGLang (a warning, the node unlinked, its
    # mask read past the row). Here our build_tree ranks the orphan below every selected candidate, so the
    # second node is the best remaining candidate (flat 1, a root child): lists, positions and mask agree.
    mask, positions, _, r_next, r_sib = run_build(torch.tensor(GOLDEN_PARENT_LIST), torch.tensor([[0, 8]]), [3], 2, 3,
                                                  3, TreeMaskMode.QLEN_ONLY)
    assert r_next.tolist() == [[1, -1, -1]] and r_sib.tolist() == [[-1, 2, -1]]
    assert positions.tolist() == [3, 4, 4]
    assert mask.view(3, 3).tolist() == [[True, False, False], [True, True, False], [True, False, True]]


# ---- random EAGLE-like selections ---------------------------------------------------------------------------


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.sampled_from([1, 3]), topk=st.integers(1, 4), depth=st.integers(1, 4),
       frac=st.floats(0.0, 1.0), mode=st.sampled_from(MODES))
def test_random_selections_match_sglang_semantics(seed, B, topk, depth, frac, mode):
    g = torch.Generator().manual_seed(seed)
    total = topk + (depth - 1) * topk * topk
    N = 2 + int(frac * (total - 1))
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        N = min(N, 32)
    parent_list, selected = eagle_selection(g, B, topk, depth, N)
    seq_lens = torch.randint(0, 9, (B,), generator=g).tolist()
    r_next, r_sib = check_build(parent_list, selected, seq_lens, topk, depth, N, mode)
    # every selection of an EAGLE beam search is closed under ancestry: the lists form a canonical tree
    tokens, parents = tree.from_sglang(torch.arange(B * N), torch.arange(B * N).view(B, N), r_next, r_sib)
    assert_equal(tree.children_links(parents)[0].long(), r_next, "first child")


def _greedy_python(candidates, r_index, r_next, r_sib, target, S):
    B, N = candidates.shape
    flat = target.reshape(-1).tolist()
    predicts, accept_index, num = {}, [[-9] * S for _ in range(B)], []
    for b in range(B):
        last = int(r_index[b, 0])
        accept_index[b][0] = last
        n, cur = 0, 0
        for _ in range(1, S):
            cur = int(r_next[b, cur])
            while cur != -1:
                if int(candidates[b, cur]) == flat[last]:
                    predicts[last] = flat[last]
                    n += 1
                    accept_index[b][n] = int(r_index[b, cur])
                    last = int(r_index[b, cur])
                    break
                cur = int(r_sib[b, cur])
            if cur == -1:
                break
        num.append(n)
        predicts[last] = flat[last]
    return predicts, accept_index, num


def check_walk(predicts, accept_index, num, w_pred, w_index, w_num):
    """The outputs of a walk (poisoned with -9 before it) against a restatement's {row: value}, rows, counts."""
    want_pred = torch.full(predicts.shape, -9, dtype=torch.int32)
    for r, v in w_pred.items():
        want_pred[r] = v
    assert_equal(predicts.cpu(), want_pred, "predicts")
    assert_equal(accept_index.cpu(), torch.tensor(w_index, dtype=torch.int32), "accept_index")
    assert_equal(num.cpu(), torch.tensor(w_num, dtype=torch.int32), "accept_token_num")


def check_verify(g, B, N, S, kind, device="cpu"):
    parents = tree.random_parents(B, N, g, kind)
    V = 7
    tokens = torch.randint(0, V, (B, N), generator=g)
    _, r_index, r_next, r_sib = tree.to_sglang(tokens, parents)
    target = torch.randint(0, V, (B, N), generator=g)
    predicts = torch.full((B * N,), -9, dtype=torch.int32, device=device)
    accept_index = torch.full((B, S), -9, dtype=torch.int32, device=device)
    num = torch.full((B,), -9, dtype=torch.int32, device=device)
    verify_tree_greedy(predicts, accept_index, num, tokens.to(device), r_index.to(device), r_next.to(device),
                       r_sib.to(device), target.to(device))
    check_walk(predicts, accept_index, num, *_greedy_python(tokens, r_index, r_next, r_sib, target, S))
    return tokens, parents, target, num.cpu()


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), B=st.sampled_from([1, 7]), N=st.sampled_from([1, 2, 8, 64]),
       S=st.sampled_from([1, 2, 4, 8]), kind=st.sampled_from(["bushy", "chain", "wide", "beam"]))
def test_verify_tree_greedy_matches_sglang_semantics(seed, B, N, S, kind):
    check_verify(torch.Generator().manual_seed(seed), B, N, S, kind)


def test_verify_tree_greedy_count_excludes_the_bonus_and_agrees_with_verify_greedy():
    # With S = N every accepted path fits: accept_token_num equals our verify_greedy's accept_len (bonus
    # excluded) when target_predict is the argmax of the same logits.
    g = torch.Generator().manual_seed(3)
    B, N, V = 7, 8, 5
    for kind in ("bushy", "chain", "beam"):
        parents = tree.random_parents(B, N, g, kind)
        tokens = torch.randint(0, V, (B, N), generator=g)
        logits = torch.randn(B * N, V, generator=g)
        _, r_index, r_next, r_sib = tree.to_sglang(tokens, parents)
        predicts = torch.zeros(B * N, dtype=torch.int32)
        accept_index = torch.full((B, N), -1, dtype=torch.int32)
        num = torch.zeros(B, dtype=torch.int32)
        verify_tree_greedy(predicts, accept_index, num, tokens, r_index, r_next, r_sib, logits.argmax(-1).view(B, N))
        nodes, accept_len, emitted = torch.ops.eagle3.verify_greedy(logits, tokens, parents)
        assert_equal(num, accept_len, "accept_token_num vs accept_len")
        rows = torch.where(nodes >= 0, nodes + torch.arange(B)[:, None] * N, -1)
        assert_equal(accept_index, rows.int(), "accept_index vs accept_nodes")


def shuffled_lists(parents, g):
    """SGLang-form lists of a canonical tree with each node's children linked in a random order (SGLang's own
    build links them ascending; its verify kernels walk whatever order the lists give)."""
    B, N = parents.shape
    r_next, r_sib = torch.full((B, N), -1), torch.full((B, N), -1)
    for b in range(B):
        for p in range(N):
            kids = [j for j in range(1, N) if int(parents[b, j]) == p]
            kids = [kids[i] for i in torch.randperm(len(kids), generator=g).tolist()]
            if kids:
                r_next[b, p] = kids[0]
            for a, c in zip(kids, kids[1:]):
                r_sib[b, a] = c
    return torch.arange(B * N).view(B, N), r_next, r_sib


def test_verify_tree_greedy_walks_the_lists_order():
    # duplicate sibling tokens and shuffled sibling lists: the first child *in list order* that matches wins
    g = torch.Generator().manual_seed(5)
    B, N, V, S = 6, 12, 3, 6
    for kind in ("bushy", "wide", "beam"):
        parents = tree.random_parents(B, N, g, kind)
        tokens = torch.randint(0, V, (B, N), generator=g)
        r_index, r_next, r_sib = shuffled_lists(parents, g)
        target = torch.randint(0, V, (B, N), generator=g)
        predicts = torch.full((B * N + 1,), -9, dtype=torch.int32)  # SGLang allocates B * N + 1
        accept_index = torch.full((B, S), -9, dtype=torch.int32)
        num = torch.full((B,), -9, dtype=torch.int32)
        verify_tree_greedy(predicts, accept_index, num, tokens, r_index, r_next, r_sib, target)
        check_walk(predicts, accept_index, num, *_greedy_python(tokens, r_index, r_next, r_sib, target, S))


# ---- the peers' hand-made cases (sgl-kernel tests/speculative, python/sglang/jit_kernel/tests) ---------------

# Two requests of six nodes. Request 0: root -> 1 -> 2 and root -> 3 -> 4 -> 5 (1 before 3); request 1: the
# root's list is 4 then 1 (a sibling link to a smaller index), 4 -> 5 and 1 -> 2 -> 3.
PEER_CANDIDATES = [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]
PEER_NEXT = [[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]
PEER_SIB = [[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]


def peer_logits():
    """The peers' target logits [2, 6, 20]: 10 at the planted tokens, else 10 at token 18, 1 elsewhere."""
    logits = torch.full((2, 6, 20), 1.0)
    for b, i, v in ((0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)):
        logits[b, i, v] = 10
    for b in range(2):
        for i in range(6):
            if logits[b, i].max() < 10:
                logits[b, i, 18] = 10
    return logits


def peer_tree(device="cpu"):
    t = lambda x: torch.tensor(x, device=device)  # noqa: E731
    return t(PEER_CANDIDATES), torch.arange(12, device=device).view(2, 6), t(PEER_NEXT), t(PEER_SIB)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_peer_verify_tree_greedy(device):
    candidates, r_index, r_next, r_sib = peer_tree(device)
    predicts = torch.full((12,), -1, dtype=torch.int32, device=device)
    accept_index = torch.full((2, 4), -1, dtype=torch.int32, device=device)
    num = torch.zeros(2, dtype=torch.int32, device=device)
    verify_tree_greedy(predicts, accept_index, num, candidates, r_index, r_next, r_sib,
                       peer_logits().argmax(-1).to(device))
    assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert num.tolist() == [3, 2]


# (threshold_single, threshold_acc) -> predicts, accept_index, accept_token_num; temperature 0.01 makes the
# probabilities exactly one-hot in fp32, so any coins give these (thresholds 0: the first child always passes)
PEER_SAMPLING = [((1.0, 1.0), [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5], [6, 10, 11, -1]], [3, 2]),
                 ((0.0, 0.0), [1, 2, 18, -1, -1, -1, 11, -1, -1, -1, 12, 18], [[0, 1, 2, -1], [6, 10, 11, -1]],
                  [2, 2])]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("thresholds,want_predicts,want_index,want_num", PEER_SAMPLING, ids=["thr1", "thr0"])
def test_peer_tree_speculative_sampling(device, thresholds, want_predicts, want_index, want_num):
    candidates, r_index, r_next, r_sib = peer_tree(device)
    probs = torch.softmax(peer_logits() / 0.01, -1).to(device)
    g = torch.Generator().manual_seed(7)
    for _ in range(5):
        predicts = torch.full((12,), -1, dtype=torch.int32, device=device)
        accept_index = torch.full((2, 4), -1, dtype=torch.int32, device=device)
        num = torch.zeros(2, dtype=torch.int32, device=device)
        draft = torch.zeros_like(probs)
        tree_speculative_sampling_target_only(
            predicts=predicts, accept_index=accept_index, accept_token_num=num, candidates=candidates,
            retrive_index=r_index, retrive_next_token=r_next, retrive_next_sibling=r_sib,
            uniform_samples=torch.rand(2, 6, generator=g).to(device),
            uniform_samples_for_final_sampling=torch.rand(2, generator=g).to(device), target_probs=probs,
            draft_probs=draft, threshold_single=thresholds[0], threshold_acc=thresholds[1], deterministic=True)
        assert predicts.tolist() == want_predicts
        assert accept_index.tolist() == want_index
        assert num.tolist() == want_num


def jit_build_inputs(bs, topk, depth, N, seq_len, mode):
    """python/sglang/jit_kernel/tests' build inputs: parent_list[b, i] = i - 1 (entry 0 = 0; entries of slots no
    selected candidate reads point outside the previous depth), selected = 0 .. N - 2, int64 lengths,
    positions [bs, N], the bit-packed mask 1-D uint8."""
    P = topk * (depth - 1) + 1
    parent_list = torch.arange(-1, P - 1).clamp(min=0).expand(bs, P).contiguous()
    selected = torch.arange(N - 1).expand(bs, N - 1).contiguous()
    seq = torch.full((bs,), seq_len)
    nb = 4 if N > 16 else (2 if N > 8 else 1)
    mask = {TreeMaskMode.QLEN_ONLY_BITPACKING: torch.zeros(bs * N * nb, dtype=torch.uint8),
            TreeMaskMode.QLEN_ONLY: torch.zeros(bs * N * N, dtype=torch.bool),
            TreeMaskMode.FULL_MASK: torch.zeros(bs * seq_len * N + bs * N * N, dtype=torch.bool)}[mode]
    lists = [torch.zeros(bs, N, dtype=torch.int64)] + [torch.full((bs, N), -1) for _ in range(2)]
    return parent_list, selected, seq, mask, torch.zeros(bs, N, dtype=torch.int64), *lists


@pytest.mark.parametrize("bs", [1, 2, 4])
@pytest.mark.parametrize("mode", [TreeMaskMode.QLEN_ONLY, TreeMaskMode.QLEN_ONLY_BITPACKING])
def test_peer_jit_build_tree(bs, mode):
    topk, depth = 4, 5
    N = topk * (depth - 1) + 1
    args = jit_build_inputs(bs, topk, depth, N, 10, mode)
    build_tree_kernel_efficient(*args, topk=topk, depth=depth, draft_token_num=N, tree_mask_mode=mode)
    parent_list, selected, _, _, positions, r_index, r_next, r_sib = args
    rows, w_pos, w_index, w_next, w_sib = naive_build(parent_list.tolist(), selected.tolist(), [10] * bs, topk, N, mode)
    assert_equal(positions.view(-1), torch.tensor(w_pos), "positions")
    assert_equal(r_index, torch.tensor(w_index), "retrive_index")
    assert_equal(r_next, torch.tensor(w_next), "retrive_next_token")
    assert_equal(r_sib, torch.tensor(w_sib), "retrive_next_sibling")


# ---- the layouts SGLang's callers pass -------------------------------------------------------------------------


@pytest.mark.parametrize("N", [1, 2, 8, 9, 16, 17, 32])  # each packed width (1, 2, 4 bytes) at both of its ends
def test_bitpacked_mask_in_sglangs_dtypes(N):
    # sglang.srt.speculative.eagle_utils allocates [B * N] uint8 | uint16 | uint32 by N (zeroed); the same
    # bytes as uint8 [B * N, nbytes] (the older layout) and as the sgl-kernel test's 1-D uint8
    g = torch.Generator().manual_seed(N)
    B, topk, depth = 3, 4, 3
    parent_list, selected = eagle_selection(g, B, topk, depth, N)
    seq = torch.randint(0, 9, (B,), generator=g)
    nb = 1 if N <= 8 else (2 if N <= 16 else 4)
    want = None
    for dtype, shape in ((torch.uint8, (B * N, nb)), (torch.uint8, (B * N * nb,)),
                         ({1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[nb], (B * N,))):
        mask = torch.zeros(shape, dtype=dtype)
        out = [torch.full((B * N,), -7)] + [torch.full((B, N), -1) for _ in range(3)]
        build_tree_kernel_efficient(parent_list, selected, seq, mask, *out, topk, depth, N,
                                    TreeMaskMode.QLEN_ONLY_BITPACKING)
        got = mask.view(torch.uint8).view(B * N, nb)
        if want is None:
            rows = naive_build(parent_list.tolist(), selected.tolist(), seq.tolist(), topk, N, 2)[0]
            want = torch.tensor([[sum(1 << k for k in range(8) if 8 * j + k < N and r[8 * j + k]) for j in range(nb)]
                                 for r in rows], dtype=torch.uint8)
        assert_equal(got, want, f"tree_mask {dtype} {shape}")


@pytest.mark.parametrize("mode", MODES)
def test_one_draft_step_and_int32_lengths(mode):
    # --speculative-num-steps 1: parent_list is [B, 0]; verified_seq_len int32 (older callers) or int64
    g = torch.Generator().manual_seed(2)
    B, topk = 4, 3
    for N in (1, 2, 4):
        scores = torch.rand(B, topk, generator=g)
        selected = torch.sort(scores.topk(N - 1, dim=-1).indices, dim=-1).values
        for dtype in (torch.int32, torch.int64):
            seq = torch.tensor([0, 5, 1, 30], dtype=dtype)
            mask, positions, r_index, r_next, r_sib = run_build(torch.empty(B, 0, dtype=torch.int64), selected,
                                                                seq.tolist(), topk, 1, N, mode)
            assert positions.tolist() == [s + (i > 0) for s in seq.tolist() for i in range(N)]
            assert r_next[:, 0].tolist() == [1 if N > 1 else -1] * B
            assert r_sib.tolist() == [[i + 1 if 0 < i < N - 1 else -1 for i in range(N)]] * B


def test_positions_as_b_by_n():
    # sglang.jit_kernel's build takes positions [B, N]; sgl-kernel's [B * N]: the same values
    g = torch.Generator().manual_seed(3)
    parent_list, selected = eagle_selection(g, 2, 3, 3, 7)
    outs = []
    for shape in ((14,), (2, 7)):
        pos = torch.full(shape, -1)
        build_tree_kernel_efficient(parent_list, selected, torch.tensor([4, 9]), torch.ones(2 * 49, dtype=torch.bool),
                                    pos, torch.full((2, 7), -1), torch.full((2, 7), -1), torch.full((2, 7), -1), 3, 3,
                                    7, TreeMaskMode.QLEN_ONLY)
        outs.append(pos.view(-1))
    assert_equal(outs[0], outs[1], "positions")


def sglang_draft_steps(g, B, topk, steps):
    """What SGLang's draft loop hands organize_draft_results (select_top_k_tokens): step 0 the root's topk
    (scores [B, 1, topk], parents [-1, 0 .. topk - 1]); step i the topk * topk children of the topk best
    beams (scores [B, topk, topk] = beam score x child prob; parents = the kept beams' flat indices)."""
    p0 = torch.softmax(torch.randn(B, topk + 1, generator=g), -1)[:, :topk]
    scores, tokens = [p0[:, None, :]], [torch.randint(0, 32000, (B, topk), generator=g)]
    parents, beam = [torch.arange(-1, topk).expand(B, topk + 1).contiguous()], p0
    for i in range(1, steps):
        expand = beam[:, :, None] * torch.softmax(torch.randn(B, topk, topk + 1, generator=g), -1)[..., :topk]
        kept = expand.flatten(1).topk(topk, dim=-1)
        scores.append(expand)
        tokens.append(torch.randint(0, 32000, (B, topk * topk), generator=g))
        parents.append(kept.indices + topk * topk * (i - 1) + topk)
        beam = kept.values
    return scores, tokens, parents


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("topk,steps,N", [(1, 3, 4), (4, 1, 3), (4, 4, 8), (2, 3, 7), (8, 6, 32)])
def test_sglang_srt_entry_points(mode, topk, steps, N):
    # SGLang's own preprocess and allocation (sglang.srt.speculative.eagle_utils), our kernel underneath
    g = torch.Generator().manual_seed(topk * steps + N)
    B = 3
    score_list, token_list, parents_list = sglang_draft_steps(g, B, topk, steps)
    parent_list, selected, tokens = organize_draft_results(score_list, token_list, parents_list, N)
    assert parent_list.shape == (B, topk * (steps - 1) + 1 if steps > 1 else 0)
    seq = torch.tensor([7, 0, 19])
    root = torch.tensor([5, 6, 7], dtype=torch.int32)
    mask, positions, r_index, r_next, r_sib, draft_tokens = srt_build_tree(
        verified_id=root, parent_list=parent_list, top_scores_index=selected, draft_tokens=tokens, seq_lens=seq,
        seq_lens_sum=int(seq.sum()), topk=topk, spec_steps=steps, num_verify_tokens=N, tree_mask_mode=mode)
    _, w_pos, _, w_next, w_sib = naive_build(parent_list.tolist(), selected.tolist(), seq.tolist(), topk, N, mode)
    assert_equal(positions, torch.tensor(w_pos), "positions")
    assert_equal(r_next, torch.tensor(w_next), "retrive_next_token")
    assert_equal(r_sib, torch.tensor(w_sib), "retrive_next_sibling")
    assert_equal(draft_tokens, torch.cat([root[:, None].long(), tokens], 1).view(-1), "draft_tokens")
    assert mask.dtype == {0: torch.bool, 1: torch.bool, 2: (torch.uint8, torch.uint16, torch.uint32, torch.uint32)[
        (N - 1) // 8]}[int(mode)]



# ---- tree_speculative_sampling_target_only: SGLang's kernel restated --------------------------------------------


def _sampling_python(candidates, r_index, r_next, r_sib, coins, final, probs, draft, S, thr_single, thr_acc):
    """speculative_sampling.cuh's TreeSpeculativeSamplingTargetOnly, one request at a time, fp32 sums."""
    B, N = candidates.shape
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    thr_acc = max(thr_acc, 1e-9)
    predicts, accept_index, nums = {}, [[-9] * S for _ in range(B)], []
    for b in range(B):
        row, coin, acc, n, cur = b * N, float(coins[b, 0]), 0.0, 0, 0
        accept_index[b][0] = last = int(r_index[b, 0])
        while n < S - 1:  # one accepted child per round, or the walk ends
            cur = int(r_next[b, cur])
            while cur != -1:
                x = int(candidates[b, cur])
                px = float(probs[row, x])
                acc = f32(acc + px)
                if coin <= f32(acc / f32(thr_acc)) or px >= thr_single:
                    acc, row, coin = 0.0, b * N + cur, float(coins[b, cur])
                    predicts[last] = x
                    n += 1
                    accept_index[b][n] = int(r_index[b, cur])
                    last = int(r_index[b, cur])
                    break
                draft[row, x] = probs[row, x]
                cur = int(r_sib[b, cur])
            if cur == -1:
                break
        nums.append(n)
        w = (probs[row] - (draft[row] if n != S - 1 else 0)).clamp(min=0)
        u, run, pick = float(final[b]) * float(w.sum()), 0.0, probs.shape[1] - 1
        for v in range(probs.shape[1]):
            run += float(w[v])
            if w[v] > 0 and run > u:
                pick = v
                break
        predicts[last] = pick
    return predicts, accept_index, nums


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), N=st.sampled_from([1, 2, 8, 33]), S=st.sampled_from([1, 2, 4, 9]),
       kind=st.sampled_from(["bushy", "chain", "wide", "beam"]),
       thresholds=st.sampled_from([(1.0, 1.0), (0.0, 0.0), (0.5, 0.7), (0.2, 1.0)]), with_draft=st.booleans())
def test_sampling_matches_sglang_semantics(seed, N, S, kind, thresholds, with_draft):
    # probabilities in multiples of 1/64, so every partial sum is exact in fp32 and the order of summation
    # cannot move a coin across a boundary; tokens drawn from a small vocabulary (duplicate siblings occur)
    g = torch.Generator().manual_seed(seed)
    B, V = 3, 6
    parents = tree.random_parents(B, N, g, kind)
    candidates = torch.randint(0, V, (B, N), generator=g)
    r_index, r_next, r_sib = shuffled_lists(parents, g)
    counts = torch.randint(0, 4, (B * N, V), generator=g).float()
    counts[:, 0] += 64 - counts.sum(1)
    probs = (counts / 64).view(B, N, V)
    coins = (torch.randint(0, 65, (B, N), generator=g) / 64).float()
    final = (torch.randint(0, 64, (B,), generator=g) / 64).float()
    draft = torch.zeros(B, N, V) if with_draft else None
    predicts = torch.full((B * N + 1,), -9, dtype=torch.int32)
    accept_index = torch.full((B, S), -9, dtype=torch.int32)
    num = torch.full((B,), -9, dtype=torch.int32)
    tree_speculative_sampling_target_only(predicts, accept_index, num, candidates, r_index, r_next, r_sib, coins, final,
                                          probs, draft, *thresholds)
    w_draft = torch.zeros(B * N, V)
    check_walk(predicts, accept_index, num, *_sampling_python(candidates, r_index, r_next, r_sib, coins, final,
                                                               probs.view(B * N, V), w_draft, S, *thresholds))
    if draft is not None:
        assert_equal(draft.view(B * N, V), w_draft, "draft_probs")


def test_sampling_frequency_is_the_target_distribution():
    # thresholds 1 (SGLang's defaults): the emitted first token is a draw from the root's target
    # distribution, whichever children the tree offers
    g = torch.Generator().manual_seed(9)
    V, trials = 5, 4000
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    candidates = torch.tensor([[0, 1, 3]]).expand(trials, 3).contiguous()
    parents = torch.tensor([[-1, 0, 0]], dtype=torch.int32).expand(trials, 3)
    _, r_index, r_next, r_sib = tree.to_sglang(candidates, parents.contiguous())
    predicts = torch.zeros(trials * 3, dtype=torch.int32)
    accept_index = torch.full((trials, 2), -1, dtype=torch.int32)
    num = torch.zeros(trials, dtype=torch.int32)
    probs = p.expand(trials, 3, V).contiguous()
    tree_speculative_sampling_target_only(predicts, accept_index, num, candidates, r_index, r_next, r_sib,
                                          torch.rand(trials, 3, generator=g), torch.rand(trials, generator=g), probs,
                                          torch.zeros_like(probs))
    first = torch.where(num > 0, candidates.gather(1, (accept_index[:, 1:].long() % 3).clamp(min=0)).squeeze(1),
                        predicts.view(trials, 3)[:, 0].long())
    freq = torch.bincount(first, minlength=V).float() / trials
    assert torch.allclose(freq, p, atol=0.03), freq


# ---- segment_packbits, reconstruct_indices_from_tree_mask ---------------------------------------------------------


@pytest.mark.parametrize("lengths", [[0], [1], [7, 8, 9], [0, 13, 0, 64, 3]])
def test_segment_packbits_matches_numpy(lengths):
    import numpy as np

    g = torch.Generator().manual_seed(len(lengths))
    x = torch.rand(sum(lengths), generator=g) < 0.5
    in_ptr = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32)
    out_len = [-(-n // 8) for n in lengths]
    out_ptr = torch.tensor([0] + np.cumsum(out_len).tolist(), dtype=torch.int32)
    y = torch.full((int(out_ptr[-1]) + 2,), 0xAB, dtype=torch.uint8)  # two bytes past the last segment
    segment_packbits(x, in_ptr, out_ptr, y, len(lengths))
    want = [np.packbits(x[int(in_ptr[s]):int(in_ptr[s + 1])].numpy(), bitorder="little") for s in range(len(lengths))]
    want = torch.tensor(np.concatenate(want + [np.array([0xAB, 0xAB], dtype=np.uint8)]).astype(np.uint8))
    assert_equal(y, want, "y")


@pytest.mark.parametrize("kind", ["bushy", "chain", "wide", "beam"])
def test_reconstruct_indices_from_tree_mask(kind):
    # from the QLEN_ONLY mask of a canonical tree: SGLang's lists of that tree, its positions
    g = torch.Generator().manual_seed(4)
    B, N = 3, 11
    parents = tree.random_parents(B, N, g, kind)
    mask = tree.mask_to_dense(tree.tree_mask(parents), N).reshape(-1)
    seq = torch.tensor([0, 3, 40])
    outs = [torch.full((B * N,), -7)] + [torch.full((B, N), -7) for _ in range(3)]
    reconstruct_indices_from_tree_mask(mask, seq, *outs, B, N)
    _, w_index, w_next, w_sib = tree.to_sglang(torch.zeros(B, N, dtype=torch.int64), parents)
    assert_equal(outs[0], tree.positions(parents, seq.int()).view(-1), "positions")
    assert_equal(outs[1], w_index, "retrive_index")
    assert_equal(outs[2], w_next, "retrive_next_token")
    assert_equal(outs[3], w_sib, "retrive_next_sibling")


# ---- bad input: refused, naming SGLang's argument, before anything is written ---------------------------------


def _build_args(mode=TreeMaskMode.QLEN_ONLY):
    pl, sel = torch.tensor(GOLDEN_PARENT_LIST), torch.tensor(GOLDEN_SELECTED)
    mask = {TreeMaskMode.QLEN_ONLY: torch.ones(36, dtype=torch.bool),
            TreeMaskMode.FULL_MASK: torch.ones(5 * 6 + 36, dtype=torch.bool),
            TreeMaskMode.QLEN_ONLY_BITPACKING: torch.zeros(6, dtype=torch.uint8)}[mode]
    return [pl, sel, torch.tensor([5]), mask, torch.full((6,), -7), torch.full((1, 6), -7), torch.full((1, 6), -1),
            torch.full((1, 6), -1)]


BAD_BUILD = [  # (what to change, exception, message)
    (lambda a: a.__setitem__(1, a[1][:, :3]), ValueError, "selected_index must have shape"),
    (lambda a: a.__setitem__(4, a[4].int()), TypeError, "positions must have dtype int64"),
    (lambda a: a.__setitem__(0, a[0][:, :3]), ValueError, r"parent_list must have shape \(B, topk \* \(depth - 1\)"),
    (lambda a: a.__setitem__(3, torch.ones(35, dtype=torch.bool)), ValueError, "tree_mask must have B \\* N \\* N"),
    (lambda a: a.__setitem__(5, a[5].t()), ValueError, "retrive_index must"),
    (lambda a: a[1].__setitem__((0, 4), 11), Eagle3InputError, r"selected_index\[0, 4\] = 11 is out of range"),
    (lambda a: a[0].__setitem__((0, 3), 7), Eagle3InputError, r"parent_list\[0, 3\] = 7 is out of range \(valid: 2..5\)"),
]


@pytest.mark.parametrize("change,exc,msg", BAD_BUILD, ids=[m.split(" ")[0].strip("\\") for _, _, m in BAD_BUILD])
def test_bad_build_input_is_refused_and_nothing_written(change, exc, msg):
    args = _build_args()
    change(args)
    before = [t.clone() for t in args]
    with pytest.raises(exc, match=msg):
        build_tree_kernel_efficient(*args, 2, 3, 6, TreeMaskMode.QLEN_ONLY)
    for t, b in zip(args, before):
        assert_equal(t, b, "an argument after a refused call")


def test_bad_build_modes():
    args = _build_args(TreeMaskMode.FULL_MASK)
    args[3] = torch.ones(5 * 6 + 35, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"tree_mask must have sum\(verified_seq_len\) \* N \+ B \* N \* N = 66"):
        build_tree_kernel_efficient(*args, 2, 3, 6, TreeMaskMode.FULL_MASK)
    args = _build_args(TreeMaskMode.QLEN_ONLY_BITPACKING)
    args[3] = torch.zeros(6, dtype=torch.uint16)
    with pytest.raises(TypeError, match="tree_mask must have dtype uint8"):
        build_tree_kernel_efficient(*args, 2, 3, 6, TreeMaskMode.QLEN_ONLY_BITPACKING)
    with pytest.raises(ValueError, match="QLEN_ONLY_BITPACKING holds at most 32"):
        build_tree_kernel_efficient(torch.zeros(1, 11, dtype=torch.int64), torch.zeros(1, 40, dtype=torch.int64),
                                    torch.tensor([0]), torch.zeros(41, 4, dtype=torch.uint8),
                                    torch.zeros(41, dtype=torch.int64), *[torch.zeros(1, 41, dtype=torch.int64)] * 3,
                                    5, 3, 41, 2)


def _walk_args():
    candidates, r_index, r_next, r_sib = peer_tree()
    return [torch.full((13,), -1, dtype=torch.int32), torch.full((2, 4), -1, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32), candidates, r_index, r_next, r_sib]


def _relink(links, at1, v1, at2, v2):
    links[at1], links[at2] = v1, v2  # node 2 of request 0 moved under node 5


BAD_WALK = [
    (lambda a: a.__setitem__(0, a[0][:11]), ValueError, r"predicts must have at least B \* N = 12"),
    (lambda a: a.__setitem__(0, a[0].long()), TypeError, "predicts must have dtype int32"),
    (lambda a: a.__setitem__(1, a[1][:, :0]), ValueError, "accept_index must have shape"),
    (lambda a: a.__setitem__(3, a[3].int()), TypeError, "candidates must have dtype int64"),
    (lambda a: a[4].__setitem__((1, 2), 12), Eagle3InputError, r"retrive_index\[1, 2\] = 12 is out of range"),
    (lambda a: _relink(a[5], (0, 1), -1, (0, 5), 2), ValueError, "the lists must put every parent before its children"),
]


@pytest.mark.parametrize("change,exc,msg", BAD_WALK, ids=[f"walk{i}" for i in range(len(BAD_WALK))])
def test_bad_verify_input_is_refused_and_nothing_written(change, exc, msg):
    for fn in ("greedy", "sampling"):
        args = _walk_args()
        change(args)
        probs = torch.softmax(peer_logits(), -1)
        draft = torch.zeros_like(probs)
        extra = ([peer_logits().argmax(-1)] if fn == "greedy" else
                 [torch.rand(2, 6), torch.rand(2), probs, draft])
        before = [t.clone() for t in args + extra]
        with pytest.raises(exc, match=msg):
            (verify_tree_greedy if fn == "greedy" else tree_speculative_sampling_target_only)(*args, *extra)
        for t, b in zip(args + extra, before):
            assert_equal(t, b, "an argument after a refused call")


def test_bad_sampling_input():
    args = _walk_args()
    probs = torch.softmax(peer_logits(), -1)
    with pytest.raises(TypeError, match="uniform_samples must have dtype float32"):
        tree_speculative_sampling_target_only(*args, torch.rand(2, 6).double(), torch.rand(2), probs, None)
    with pytest.raises(ValueError, match="target_probs must have shape"):
        tree_speculative_sampling_target_only(*args, torch.rand(2, 6), torch.rand(2), probs[:, :5].contiguous(), None)
    args[3] = args[3].clone()
    args[3][0, 3] = 20  # a tried node's token outside the vocabulary
    with pytest.raises(Eagle3InputError, match=r"candidates\[0, 3\] = 20 is out of range \(valid: 0..19\)"):
        tree_speculative_sampling_target_only(*args, torch.rand(2, 6), torch.rand(2), probs, None)


def test_bad_packbits_and_reconstruct_input():
    x = torch.ones(9, dtype=torch.bool)
    with pytest.raises(Eagle3InputError, match=r"input_indptr\[1\] = 10 is out of range"):
        segment_packbits(x, torch.tensor([0, 10], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
                         torch.zeros(2, dtype=torch.uint8), 1)
    with pytest.raises(TypeError, match="input_indptr must have dtype int32"):
        segment_packbits(x, torch.tensor([0, 9]), torch.tensor([0, 2], dtype=torch.int32),
                         torch.zeros(2, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match=r"tree_mask must have batch_size \* draft_token_num\*\*2 = 18"):
        reconstruct_indices_from_tree_mask(torch.ones(17, dtype=torch.bool), torch.zeros(2), torch.zeros(6),
                                           *[torch.zeros(2, 3, dtype=torch.int64)] * 3, 2, 3)



# ---- CUDA ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_sglang_build_random(mode):
    g = torch.Generator().manual_seed(11)
    for B, topk, depth in ((1, 1, 1), (7, 4, 3), (64, 8, 6)):
        total = topk + (depth - 1) * topk * topk
        for N in (2, 8, 64):
            if N - 1 > total or (mode == TreeMaskMode.QLEN_ONLY_BITPACKING and N > 32):
                continue
            parent_list, selected = eagle_selection(g, B, topk, depth, N)
            seq_lens = torch.randint(0, 50, (B,), generator=g).tolist()
            check_build(parent_list, selected, seq_lens, topk, depth, N, mode, device="cuda")


@pytest.mark.gpu
def test_gpu_sglang_verify_random():
    g = torch.Generator().manual_seed(12)
    for B in (1, 7, 64):
        for N in (1, 2, 8, 64):
            for kind in ("bushy", "chain", "beam"):
                check_verify(g, B, N, 6, kind, device="cuda")


def _cuda_matches_cpu(fn, args, outs):
    """fn(*args) on CPU and on CUDA copies of the same tensors: every argument equal afterwards."""
    cpu = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    fn(*cpu)
    fn(*gpu)
    for i in outs:
        assert_equal(gpu[i].cpu(), cpu[i], f"argument {i}")
    return gpu


@pytest.mark.gpu
def test_gpu_sampling_packbits_reconstruct_match_cpu():
    g = torch.Generator().manual_seed(13)
    for B, N, V, kind in ((1, 1, 7, "chain"), (7, 8, 111, "beam"), (64, 33, 32000, "bushy")):
        parents = tree.random_parents(B, N, g, kind)
        candidates = torch.randint(0, V, (B, N), generator=g)
        r_index, r_next, r_sib = shuffled_lists(parents, g)
        counts = torch.randint(0, 4, (B * N, V), generator=g).float()
        counts[:, 0] += 64 - counts.sum(1).clamp(max=64)
        probs = (counts / counts.sum(1, keepdim=True)).view(B, N, V)
        for thresholds in ((1.0, 1.0), (0.3, 0.6)):
            args = [torch.full((B * N + 1,), -9, dtype=torch.int32), torch.full((B, 7), -9, dtype=torch.int32),
                    torch.full((B,), -9, dtype=torch.int32), candidates, r_index, r_next, r_sib,
                    (torch.randint(0, 65, (B, N), generator=g) / 64).float(),
                    (torch.randint(0, 64, (B,), generator=g) / 64).float(), probs, torch.zeros_like(probs), *thresholds]
            _cuda_matches_cpu(tree_speculative_sampling_target_only, args, (0, 1, 2, 10))
    lengths = torch.randint(0, 70, (99,), generator=g)
    in_ptr = torch.cat([torch.zeros(1), lengths.cumsum(0)]).int()
    out_ptr = torch.cat([torch.zeros(1), ((lengths + 7) // 8).cumsum(0)]).int()
    x = torch.rand(int(in_ptr[-1]), generator=g) < 0.3
    _cuda_matches_cpu(segment_packbits, [x, in_ptr, out_ptr, torch.zeros(int(out_ptr[-1]) + 3, dtype=torch.uint8), 99],
                      (3,))
    parents = tree.random_parents(9, 17, g, "beam")
    mask = tree.mask_to_dense(tree.tree_mask(parents), 17).reshape(-1)
    outs = [torch.full((9 * 17,), -7)] + [torch.full((9, 17), -7) for _ in range(3)]
    _cuda_matches_cpu(reconstruct_indices_from_tree_mask, [mask, torch.arange(9) * 5, *outs, 9, 17], (2, 3, 4, 5))


@pytest.mark.gpu
def test_gpu_sglang_layouts_and_graph_replay():
    # every build layout on CUDA equal to CPU; then build + greedy verify + sampling captured in one CUDA graph
    # (no host sync inside) and replayed on new selections written in place
    g = torch.Generator().manual_seed(14)
    B, topk, depth, N = 8, 4, 3, 17
    parent_list, selected = eagle_selection(g, B, topk, depth, N)
    seq = torch.randint(0, 50, (B,), generator=g)
    for mode, mask in ((0, torch.ones(int(seq.sum()) * N + B * N * N, dtype=torch.bool)),
                       (1, torch.ones(B * N * N, dtype=torch.bool)), (2, torch.zeros(B * N, dtype=torch.uint32))):
        args = [parent_list, selected, seq, mask, torch.full((B, N), -7), torch.full((B, N), -7),
                torch.full((B, N), -1), torch.full((B, N), -1), topk, depth, N, mode]
        _cuda_matches_cpu(build_tree_kernel_efficient, args, (3, 4, 5, 6, 7))
    dev = "cuda"
    pl, sel, sq = parent_list.to(dev), selected.to(dev), seq.to(dev)
    mask = torch.zeros(B * N, dtype=torch.uint32, device=dev)
    pos, lists = torch.empty(B * N, dtype=torch.int64, device=dev), torch.full((3, B, N), -1, device=dev)
    V = 1000
    cand = torch.randint(0, V, (B, N), device=dev)
    target = torch.randint(0, V, (B, N), device=dev)
    probs = torch.softmax(torch.randn(B, N, V, device=dev), -1)
    coins, final = torch.rand(B, N, device=dev), torch.rand(B, device=dev)
    out_g = [torch.empty(B * N + 1, dtype=torch.int32, device=dev), torch.full((B, depth + 1), -1, dtype=torch.int32,
             device=dev), torch.empty(B, dtype=torch.int32, device=dev)]
    out_s = [t.clone() for t in out_g]

    def step():
        mask.zero_()
        lists.fill_(-1)
        build_tree_kernel_efficient(pl, sel, sq, mask, pos, *lists, topk, depth, N, 2)
        verify_tree_greedy(*out_g, cand, *lists, target)
        tree_speculative_sampling_target_only(*out_s, cand, *lists, coins, final, probs, None)

    graph, _ = capture_graph(step)
    for _ in range(2):
        parent_list, selected = eagle_selection(g, B, topk, depth, N)
        pl.copy_(parent_list)
        sel.copy_(selected)
        target.copy_(torch.randint(0, V, (B, N), generator=g))
        graph.replay()
        got = [t.clone() for t in (mask, pos, lists, *out_g, *out_s)]
        step()
        for a, b in zip(got, (mask, pos, lists, *out_g, *out_s)):
            assert_equal(a.cpu().long() if a.dtype == torch.uint32 else a.cpu(),
                         b.cpu().long() if b.dtype == torch.uint32 else b.cpu(), "replay vs eager")


# ---- the fused kernels (triton_kernels/compat_sglang.py) == the tensor-op path -------------------------------
# compat.sglang.kernels = "triton" runs the kernels on CPU tensors (TRITON_INTERPRET=1, as `make test` sets;
# on a GPU machine the same tests run them on CUDA tensors); every output compared exactly with the tensor-op
# path, which is the specification.

import os  # noqa: E402

from eagle3_ops.compat import sglang as compat  # noqa: E402

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None)
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None, reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")


def kernels_match_tensor_path(fn, args, outs):
    """fn(*args) on the tensor-op path and on the kernels, on copies of the same tensors (on KERNEL_DEVICE):
    the arguments in `outs` equal afterwards. Returns the kernels' copies."""
    runs = []
    for path in ("torch", "triton"):
        copies = [a.clone().to(KERNEL_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        compat.kernels = path
        try:
            fn(*copies)
        finally:
            compat.kernels = "auto"
        runs.append(copies)
    for i in outs:
        assert_equal(runs[1][i].cpu(), runs[0][i].cpu(), f"{fn.__name__} argument {i} (kernels vs tensor ops)")
    return runs[1]


def _build_case(g, B, topk, depth, N, mode, seq_max=9):
    parent_list, selected = eagle_selection(g, B, topk, depth, N)
    if depth == 1:
        parent_list = parent_list[:, :0]
    seq = torch.randint(0, seq_max, (B,), generator=g)
    if mode == TreeMaskMode.FULL_MASK:
        mask = torch.rand(int(seq.sum()) * N + B * N * N, generator=g) < 0.5  # the prefix entries must stay
    elif mode == TreeMaskMode.QLEN_ONLY:
        mask = torch.rand(B * N * N, generator=g) < 0.5
    else:
        nb = 1 if N <= 8 else (2 if N <= 16 else 4)
        mask = torch.randint(0, 256, (B * N, nb), generator=g, dtype=torch.uint8)  # bytes 1.. are OR-ed into
    return [parent_list, selected, seq, mask, torch.full((B * N,), -7), torch.full((B, N), -7),
            torch.full((B, N), -1), torch.full((B, N), -1), topk, depth, N, mode]


# (B, topk, depth, N): B 1 and a big B, N 1 (root only), topk 1 (a chain), depth 1 (one step, parent_list [B, 0]),
# every packed width, N past 32 (FULL / QLEN only), the bench's Kimi-like 8 x 6 x 64
BUILD_KERNEL_SHAPES = [(1, 1, 1, 1), (3, 1, 4, 5), (2, 3, 1, 4), (1, 2, 3, 7), (5, 4, 3, 16), (2, 4, 3, 17),
                       (2, 8, 3, 33), (65, 2, 3, 6), (2, 8, 6, 64)]


@needs_kernels
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,topk,depth,N", BUILD_KERNEL_SHAPES)
def test_build_kernel_matches_tensor_path(B, topk, depth, N, mode):
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING and N > 32:
        pytest.skip("the packed mask holds N <= 32")
    g = torch.Generator().manual_seed(B * 1000 + N)
    kernels_match_tensor_path(build_tree_kernel_efficient, _build_case(g, B, topk, depth, N, mode), (3, 4, 5, 6, 7))


@needs_kernels
@pytest.mark.parametrize("selected", [[0, 8], [8, 0], [6, 0, 1, 2, 2], [9, 7, 5], [9, 8, 7, 6]])
@pytest.mark.parametrize("mode", MODES)
def test_build_kernel_unselected_parents_unsorted_and_duplicates(selected, mode):
    # outside SGLang's contract (its kernel leaves such nodes unlinked): the kernel ranks them as build_tree does
    kernels_match_tensor_path(build_tree_kernel_efficient, _golden_selection_case(selected, mode), (3, 4, 5, 6, 7))


def _golden_selection_case(selected, mode):
    """build_tree_kernel_efficient's arguments for the golden parent_list with another selection."""
    B, N = 1, len(selected) + 1
    args = _build_case(torch.Generator().manual_seed(2), B, 2, 3, N, mode)
    args[0], args[1] = torch.tensor([GOLDEN_PARENT_LIST[0]]), torch.tensor([selected])
    args[2] = torch.tensor([3])
    if mode == TreeMaskMode.FULL_MASK:
        args[3] = torch.ones(3 * N + N * N, dtype=torch.bool)
    return args


def _walk_case(g, B, N, kind, V, shuffled):
    parents = tree.random_parents(B, N, g, kind)
    target = torch.randint(0, V, (B, N), generator=g)
    plant = torch.rand(B, N, generator=g) < 0.7  # deep walks, some stopped early
    tokens = torch.where(plant, target.gather(1, parents.long().clamp(min=0)), torch.randint(0, V, (B, N), generator=g))
    if shuffled:
        r_index, r_next, r_sib = shuffled_lists(parents, g)
    else:
        _, r_index, r_next, r_sib = tree.to_sglang(tokens, parents)
    return tokens, target, r_index, r_next, r_sib


# (B, N, kind, S): B 1 / N 1, S 1 (no draft step), S past N, a big B, a wide tree, N 64
WALK_SHAPES = [(1, 1, "chain", 1), (1, 1, "chain", 4), (3, 8, "beam", 5), (2, 7, "wide", 3), (4, 16, "bushy", 16),
               (65, 4, "chain", 4), (2, 64, "bushy", 70)]


@needs_kernels
@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("B,N,kind,S", WALK_SHAPES)
def test_greedy_kernel_matches_tensor_path(B, N, kind, S, shuffled):
    kernels_match_tensor_path(verify_tree_greedy, *_greedy_case(B, N, kind, S, shuffled))


def _walk_outs(B, N, S):
    """predicts (SGLang's B * N + 1), accept_index, accept_token_num, poisoned with -9."""
    return [torch.full((B * N + 1,), -9, dtype=torch.int32), torch.full((B, S), -9, dtype=torch.int32),
            torch.full((B,), -9, dtype=torch.int32)]


def _greedy_case(B, N, kind, S, shuffled):
    """(arguments, outputs to compare) of one verify_tree_greedy call."""
    g = torch.Generator().manual_seed(B * 100 + N)
    tokens, target, r_index, r_next, r_sib = _walk_case(g, B, N, kind, 9, shuffled)
    return [*_walk_outs(B, N, S), tokens, r_index, r_next, r_sib, target], (0, 1, 2)


SAMPLING_SHAPES = [(1, 1, "chain", 1, 7), (3, 8, "beam", 5, 50), (2, 7, "wide", 8, 111),
                   (65, 4, "chain", 4, 13), (2, 16, "bushy", 6, 9000)]  # V 9000: 3 chunks
# every shape at every threshold pair, but B 65 (the slowest under the interpreter) at one pair
SAMPLING_CASES = [(*shape, th, wd) for shape in SAMPLING_SHAPES for th in ((1.0, 1.0), (0.3, 0.6), (0.0, 0.0))
                  for wd in (False, True) if shape[0] != 65 or th == (0.3, 0.6)]


@needs_kernels
@pytest.mark.parametrize("B,N,kind,S,V,thresholds,with_draft", SAMPLING_CASES)
def test_sampling_kernel_matches_tensor_path(B, N, kind, S, V, thresholds, with_draft):
    for args, outs in _sampling_cases(B, N, kind, S, V, thresholds, with_draft):
        kernels_match_tensor_path(tree_speculative_sampling_target_only, args, outs)


def _sampling_cases(B, N, kind, S, V, thresholds, with_draft):
    """(arguments, outputs to compare) of three tree_speculative_sampling_target_only calls on one tree with
    fresh coins (the first final coin 1.0: the draw past the mass takes the last token)."""
    g = torch.Generator().manual_seed(B * 100 + N + V)
    tokens, _, r_index, r_next, r_sib = _walk_case(g, B, N, kind, V, shuffled=True)
    probs = torch.softmax(torch.randn(B, N, V, generator=g) * 4, -1)
    draft = torch.softmax(torch.randn(B, N, V, generator=g), -1) * 0.5 if with_draft else None
    for _ in range(3):
        coins, final = torch.rand(B, N, generator=g), torch.rand(B, generator=g)
        final[0] = 1.0
        yield ([*_walk_outs(B, N, S), tokens, r_index, r_next, r_sib, coins, final, probs, draft, *thresholds],
               (0, 1, 2) + ((10,) if with_draft else ()))


def _fp64_inverse_cdf(w, final):
    """numpy, row by row: the first token whose running mass (summed in fp64, each prefix rounded to fp32)
    exceeds final * total in fp32; V - 1 past the mass. Returns (tokens, the prefixes)."""
    import numpy as np

    cdf = np.cumsum(w.numpy().astype(np.float64), -1).astype(np.float32)
    u = final.numpy().astype(np.float32) * cdf[:, -1]
    tokens = [min(int(np.searchsorted(cdf[r], u[r], side="right")), w.shape[1] - 1) for r in range(len(u))]
    return torch.tensor(tokens), cdf


def _zero_mass_case(B, V, with_draft):
    """tree_speculative_sampling_target_only's arguments for B one-child chains (N 2, S 2, the child tried and
    rejected: the bonus is drawn at the root) whose residual is zero on most of the V tokens (target zero off
    a random 30%, as top-k / top-p leave it; with draft, the draft at 1.5x the target on half of the rest),
    and the bonus each row must draw (_fp64_inverse_cdf, independent of the op). Row 0's final coin is 1.0
    (past the mass: V - 1); every odd row's lands exactly on the running mass after a token that zero-mass
    tokens follow (the draw takes the first later token whose rounded prefix is larger)."""
    import numpy as np

    g = torch.Generator().manual_seed(V + B)
    N, S = 2, 2
    keep = torch.rand(B, N, V, generator=g) < 0.3
    probs = torch.softmax(torch.where(keep, torch.randn(B, N, V, generator=g) * 4, float("-inf")), -1)
    draft = None
    if with_draft:
        draft = torch.where(torch.rand(B, N, V, generator=g) < 0.5, probs * 1.5, probs * 0.5)
    child = torch.multinomial(keep[:, 0].float(), 1, generator=g).squeeze(1)  # a token with target mass
    candidates = torch.stack([torch.zeros(B, dtype=torch.int64), child], 1)
    r_index = torch.arange(B * N).view(B, N)
    r_next = torch.tensor([[1, -1]]).repeat(B, 1)
    r_sib = torch.full((B, N), -1)
    coins = torch.ones(B, N)  # coin 1 > p(child) / threshold_acc 1: rejected
    w = probs[:, 0] - (draft[:, 0] if with_draft else 0.0)
    w = w.clamp(min=0).index_put((torch.arange(B), child), torch.zeros(B))  # the rejected child: draft = target
    final = torch.rand(B, generator=g)
    final[0] = 1.0
    _, cdf = _fp64_inverse_cdf(w, final)
    for r in range(1, B, 2):  # a coin on a prefix that zero-mass tokens follow
        wr = w[r].numpy()
        for t in torch.randperm(V // 2, generator=g).tolist():
            t += V // 4
            if not (wr[t] > 0 and wr[t + 1] == 0 and wr[t + 2] == 0):
                continue
            f = np.float32(float(cdf[r, t]) / float(cdf[r, -1]))
            for _ in range(4):  # the fp32 coin whose product with the total is that prefix, if one is near
                if f * cdf[r, -1] < cdf[r, t]:
                    f = np.nextafter(f, np.float32(1))
                elif f * cdf[r, -1] > cdf[r, t]:
                    f = np.nextafter(f, np.float32(0))
            if f * cdf[r, -1] == cdf[r, t]:
                final[r] = float(f)
                break
        assert final[r] * cdf[r, -1] == cdf[r, t], f"row {r}: no coin on a prefix found"
    bonus, _ = _fp64_inverse_cdf(w, final)
    args = [*_walk_outs(B, N, S), candidates, r_index, r_next, r_sib, coins, final, probs, draft, 1.0, 1.0]
    return args, bonus


def _check_zero_mass_draws(args, bonus):
    B, N = args[3].shape
    predicts, accept_index, accept_token_num = (a.cpu() for a in args[:3])
    assert_equal(predicts[:B * N:N], bonus.int(), "the bonus (predicts at the root rows)")
    assert_equal(accept_token_num, torch.zeros(B, dtype=torch.int32), "accept_token_num")
    assert_equal(accept_index[:, 0], torch.arange(0, B * N, N, dtype=torch.int32), "accept_index[:, 0]")


@pytest.mark.parametrize("with_draft", [False, True])
def test_sampling_bonus_is_the_fp64_inverse_cdf_past_zero_mass_tokens(with_draft, monkeypatch):
    # V 163840 (the bench's), most of the residual zero, coins exactly on a prefix that zero-mass tokens follow:
    # the tensor-op path draws what the fp64 running mass says. Then again with torch.cumsum accumulating fp32
    # in fp32 (numpy's sequential fp32 sum; what CUDA's cumsum does, in another order): the draws must not move.
    # At d4d8c6d the tensor path took torch.cumsum(w) of fp32 w, fp64-accumulated on CPU only; on the H200 it
    # drew 2-3 tokens past the kernels' in 1-3 of 257-513 rows (the C++ op and the Triton kernels agreed).
    import numpy as np

    args, bonus = _zero_mass_case(16, 163840, with_draft)
    run = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    tree_speculative_sampling_target_only(*run)
    _check_zero_mass_draws(run, bonus)

    real = torch.cumsum

    def fp32_cumsum(x, dim, *, dtype=None, out=None):
        if x.dtype != torch.float32 or dtype not in (None, torch.float32) or out is not None:
            return real(x, dim, dtype=dtype, out=out)
        return torch.from_numpy(np.cumsum(x.numpy(), dim, dtype=np.float32))

    w = torch.stack([(args[9][b, 0] - (args[10][b, 0] if with_draft else 0)).clamp(min=0) for b in range(16)])
    w[torch.arange(16), args[3][:, 1]] = 0
    u = (args[8] * fp32_cumsum(w, -1)[:, -1])[:, None]
    moved = torch.searchsorted(fp32_cumsum(w, -1), u, right=True).clamp(max=w.shape[1] - 1).squeeze(1) != bonus
    assert moved.any(), "the case does not tell an fp32 running mass from an fp64 one"
    monkeypatch.setattr(torch, "cumsum", fp32_cumsum)
    run = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    tree_speculative_sampling_target_only(*run)
    _check_zero_mass_draws(run, bonus)


@needs_kernels
def test_sampling_kernel_draws_past_zero_mass_tokens():
    # the Triton kernels on _zero_mass_case at V 163840 (40 chunks): the fp64 inverse CDF's draws, as the
    # tensor ops (the C++ op: test_gpu_cpp_sampling_draws_past_zero_mass_tokens)
    args, bonus = _zero_mass_case(2, 163840, True)  # row 0 past the mass, row 1 on a prefix
    _check_zero_mass_draws(kernels_match_tensor_path(tree_speculative_sampling_target_only, args, (0, 1, 2, 10)), bonus)


@needs_kernels
@pytest.mark.parametrize("lengths", [[0], [1], [7, 8, 9], [0, 13, 0, 64, 3], list(range(0, 300, 7))])
def test_packbits_kernel_matches_tensor_path(lengths):
    kernels_match_tensor_path(segment_packbits, _packbits_args(lengths), (3,))


def _packbits_args(lengths):
    g = torch.Generator().manual_seed(len(lengths))
    L = torch.tensor(lengths)
    in_ptr = torch.cat([torch.zeros(1, dtype=torch.int32), L.cumsum(0).int()])
    out_ptr = torch.cat([torch.zeros(1, dtype=torch.int32), ((L + 7) // 8).cumsum(0).int()])
    x = torch.rand(int(in_ptr[-1]), generator=g) < 0.5
    y = torch.full((int(out_ptr[-1]) + 3,), 77, dtype=torch.uint8)  # bytes outside every segment left as they are
    return [x, in_ptr, out_ptr, y, len(lengths)]


@needs_kernels
@pytest.mark.parametrize("B,N,kind", [(1, 1, "chain"), (3, 9, "bushy"), (2, 17, "beam"), (65, 4, "wide"),
                                      (1, 64, "bushy")])
def test_reconstruct_kernel_matches_tensor_path(B, N, kind):
    kernels_match_tensor_path(reconstruct_indices_from_tree_mask, _reconstruct_args(B, N, kind), (2, 3, 4, 5))


def _reconstruct_args(B, N, kind):
    g = torch.Generator().manual_seed(B + N)
    parents = tree.random_parents(B, N, g, kind)
    mask = tree.mask_to_dense(tree.tree_mask(parents), N).reshape(-1)
    outs = [torch.full((B * N,), -7), torch.full((B, N), -7), torch.full((B, N), -7), torch.full((B, N), -7)]
    return [mask, torch.randint(0, 99, (B,), generator=g), *outs, B, N]


@pytest.mark.gpu
def test_gpu_kernels_at_bench_shapes_and_in_one_graph():
    # the bench's shapes (B 64, Kimi's vocabulary for sampling) on both CUDA paths, then every kernel (the
    # sampling's two launches too) captured in one CUDA graph and replayed on new inputs written in place
    g = torch.Generator().manual_seed(15)
    for mode in MODES:
        N = 32 if mode == TreeMaskMode.QLEN_ONLY_BITPACKING else 64
        kernels_match_tensor_path(build_tree_kernel_efficient, _build_case(g, 64, 8, 6, N, mode, 4096),
                                  (3, 4, 5, 6, 7))
    B, N, V, S = 64, 8, 163840, 8
    tokens, target, r_index, r_next, r_sib = [t.cuda() for t in _walk_case(g, B, N, "beam", V, shuffled=True)]
    probs = torch.softmax(torch.randn(B, N, V, device="cuda") * 4, -1)
    outs = [torch.full((B * N + 1,), -9, dtype=torch.int32, device="cuda"),
            torch.full((B, S), -9, dtype=torch.int32, device="cuda"), torch.full((B,), -9, dtype=torch.int32,
                                                                                 device="cuda")]
    coins, final = torch.rand(B, N, device="cuda"), torch.rand(B, device="cuda")
    draft = torch.zeros_like(probs)
    sampling = [*outs, tokens, r_index, r_next, r_sib, coins, final, probs, draft, 0.5, 0.7]
    kernels_match_tensor_path(tree_speculative_sampling_target_only, sampling, (0, 1, 2, 10))
    greedy_outs = [t.clone() for t in outs]

    def step():
        draft.zero_()
        verify_tree_greedy(*greedy_outs, tokens, r_index, r_next, r_sib, target)
        tree_speculative_sampling_target_only(*sampling)

    graph, _ = capture_graph(step)
    for _ in range(2):
        coins.copy_(torch.rand(B, N, device="cuda"))
        final.copy_(torch.rand(B, device="cuda"))
        target.copy_(torch.where(torch.rand(B, N, device="cuda") < 0.5, target, tokens))
        graph.replay()
        got = [t.clone() for t in (*greedy_outs, *outs, draft)]
        step()
        for a, b in zip(got, (*greedy_outs, *outs, draft)):
            assert_equal(a, b, "replay vs eager")


# ---- the C++ ops (csrc/compat_sglang_*.cu) == the Triton kernels == the tensor-op path ----------------------
# On CUDA tensors compat.sglang calls torch.ops.eagle3._sglang_* (kernels = "auto"); kernels = "triton" and
# "torch" take the other two paths on copies of the same tensors. Every output compared exactly, the sampling
# bonus too (both kernels sum the residual in fp64, in other associations: a draw within an fp64 rounding step
# of a token boundary could go either way).


def test_cpp_ops_resolve_where_built():
    # the wrappers find every C++ op exactly where this build compiled csrc/compat_sglang_*.cu (CI compiles them
    # without a GPU: a schema / registration name mismatch fails here), and none elsewhere
    import eagle3_ops

    ops = compat._cuda_ops()
    built = "compat_sglang" in eagle3_ops.build_info()["cuda_kernels"]
    assert [op is not None for op in ops] == [built] * len(ops), (ops, eagle3_ops.build_info()["cuda_kernels"])


def needs_cpp_ops():
    ops = compat._cuda_ops()
    missing = [name for name, op in zip(ops._fields, ops) if op is None]
    assert not missing, f"this build has no CUDA kernel for {missing} (EAGLE3_CUDA_ONLY without compat_sglang?)"


def cpp_matches_paths(fn, args, outs, others=("triton", "torch")):
    """fn(*args) on CUDA copies through the C++ op and the `others` (the Triton kernels, the tensor ops): the
    arguments in `outs` equal afterwards. Returns the C++ op's copies."""
    needs_cpp_ops()
    runs = {}
    for path in (*others, "auto"):
        copies = [a.clone().cuda() if isinstance(a, torch.Tensor) else a for a in args]
        compat.kernels = path
        try:
            fn(*copies)
        finally:
            compat.kernels = "auto"
        runs[path] = copies
    for i in outs:
        for other in others:
            assert_equal(runs["auto"][i].cpu(), runs[other][i].cpu(), f"{fn.__name__} argument {i} (C++ vs {other})")
    return runs["auto"]


# BUILD_KERNEL_SHAPES, then the bench's (B 64: Kimi-like 8 x 6 x 64, 4 x 5 x 16, a chain of 4), then mask rows of
# many words: a deep chain (N 33), N 300 (past the Triton kernel's 256: the tensor ops beside it), and the C++
# kernel's limits, 1024 nodes and 8192 slots (132 KiB of shared memory); then the one-warp kernel's (N <= 32 and
# depth * M <= 256 slots): 256 slots at N 32, a chain of 32, 50 slots (M 25), and past it by slots at N 32 (261);
# last, batches whose FULL_MASK offsets sum more earlier prefix lengths than either kernel loads up front (4 a
# thread: B 300 on the one-warp kernel, B 1300 on the block kernel's 320 threads at N 40)
CPP_BUILD_SHAPES = BUILD_KERNEL_SHAPES + [(64, 8, 6, 64), (64, 4, 5, 16), (64, 1, 3, 4), (3, 1, 40, 33),
                                          (2, 8, 6, 300), (1, 16, 32, 1024), (3, 8, 4, 32), (2, 1, 32, 32),
                                          (2, 5, 2, 26), (2, 3, 29, 32), (300, 1, 3, 4), (1300, 4, 4, 40)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,topk,depth,N", CPP_BUILD_SHAPES)
def test_gpu_cpp_build_matches_paths(B, topk, depth, N, mode):
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING and N > 32:
        pytest.skip("the packed mask holds N <= 32")
    g = torch.Generator().manual_seed(B * 1000 + N)
    args = _build_case(g, B, topk, depth, N, mode, seq_max=4096 if B == 64 else 9)
    cpp_matches_paths(build_tree_kernel_efficient, args, (3, 4, 5, 6, 7))
    args[2] = args[2].int()  # verified_seq_len int32, positions [B, N]
    args[4] = args[4].view(B, N)
    cpp_matches_paths(build_tree_kernel_efficient, args, (3, 4, 5, 6, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("B,topk,depth,N", [(5, 2, 3, 4), (5, 4, 5, 16), (3, 4, 4, 40)])
def test_gpu_cpp_build_full_mask_past_the_buffer(B, topk, depth, N):
    # a FULL_MASK buffer shorter than sum(seq_lens) * N + B * N * N (prefix lengths past what the caller sized it
    # for: they are on the device, so no host check sees it), on the one-warp kernel (N 4, 16) and the block kernel
    # (N 40): the C++ op writes the entries inside the buffer and skips the rest, as the Triton kernel does, and
    # every other output is the Triton kernel's
    g = torch.Generator().manual_seed(B * N + 7)
    args = _build_case(g, B, topk, depth, N, TreeMaskMode.FULL_MASK)
    full = args[3].numel()
    for cut in (full - 1, full - N * N - 3, full // 2):
        case = list(args)
        case[3] = args[3][:cut].clone()
        cpp_matches_paths(build_tree_kernel_efficient, case, (3, 4, 5, 6, 7), others=("triton",))


@pytest.mark.gpu
@pytest.mark.parametrize("selected", [[0, 8], [8, 0], [6, 0, 1, 2, 2], [9, 7, 5], [9, 8, 7, 6], [-1, 10, 3]])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_cpp_build_unselected_parents_unsorted_duplicates_outside(selected, mode):
    # outside SGLang's contract: the C++ op ranks such selections as the Triton kernel and build_tree do (a
    # selected index outside [0, C) skipped)
    cpp_matches_paths(build_tree_kernel_efficient, _golden_selection_case(selected, mode), (3, 4, 5, 6, 7))


def _cpp_build_random(g, k, B, topk, depth, N):
    """Case k of the random-selection tests: its mode by k, every other selection drawn anywhere in [0, C)
    (unsorted, duplicated, parents not selected); the C++ op = the Triton kernel = the tensor ops."""
    C = topk + (depth - 1) * topk * topk
    mode = MODES[k % 3] if k % 3 != 2 or N <= 32 else TreeMaskMode.QLEN_ONLY
    args = _build_case(g, B, topk, depth, N, mode)
    if k % 2:
        args[1] = torch.randint(0, C, (B, N - 1), generator=g)
    cpp_matches_paths(build_tree_kernel_efficient, args, (3, 4, 5, 6, 7))


@pytest.mark.gpu
def test_gpu_cpp_build_random_selections():
    # small random shapes in every mode (the one-warp kernel's): the C++ op ranks and links them as the Triton
    # kernel and the tensor ops do
    g = torch.Generator().manual_seed(23)
    for k in range(40):
        topk, depth = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        C = topk + (depth - 1) * topk * topk
        N, B = int(torch.randint(1, C + 2, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        _cpp_build_random(g, k, B, topk, depth, N)


@pytest.mark.gpu
def test_gpu_cpp_build_random_selections_past_one_warp():
    # the same on the block kernel's shapes (N > 32, or more than 256 slots)
    g = torch.Generator().manual_seed(29)
    steps = [(6, 2), (8, 2), (5, 3), (8, 3), (4, 17), (6, 8)]  # (topk, depth): 72 .. 192 slots, then 272 and 288
    for k in range(24):
        topk, depth = steps[k % len(steps)]
        C = topk + (depth - 1) * topk * topk
        lo = 33 if depth * topk * topk <= 256 else 1
        N = int(torch.randint(lo, min(C + 1, 200) + 1, (1,), generator=g))
        _cpp_build_random(g, k, int(torch.randint(1, 4, (1,), generator=g)), topk, depth, N)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [9, 17, 32])
def test_gpu_cpp_build_bitpacked_at_an_odd_address(N):
    # a uint8 mask one byte into its buffer: the one-warp kernel stores (and reads back) a row of 2 / 4 bytes byte
    # by byte there, in one access where the buffer is aligned; the same bytes as the CPU path, byte 0 untouched
    g = torch.Generator().manual_seed(N + 1)
    B, topk, depth = 5, 4, 3
    nb = 2 if N <= 16 else 4
    parent_list, selected = eagle_selection(g, B, topk, depth, N)
    buf = torch.randint(0, 256, (B * N * nb + 1,), generator=g, dtype=torch.uint8)
    args = [parent_list, selected, torch.randint(0, 50, (B,), generator=g), buf, torch.full((B * N,), -7),
            torch.full((B, N), -7), torch.full((B, N), -1), torch.full((B, N), -1), topk, depth, N, 2]
    cpu = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    build_tree_kernel_efficient(*cpu[:3], cpu[3][1:], *cpu[4:])
    gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    build_tree_kernel_efficient(*gpu[:3], gpu[3][1:], *gpu[4:])
    for i in (3, 4, 5, 6, 7):
        assert_equal(gpu[i].cpu(), cpu[i], f"argument {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("N,dtype", [(9, torch.uint16), (16, torch.int16), (17, torch.uint32), (32, torch.int32)])
def test_gpu_cpp_build_bitpacked_dtypes(N, dtype):
    # SGLang's 1-D masks of 2 and 4 bytes a row: the same bytes as the CPU path writes
    g = torch.Generator().manual_seed(N)
    B, topk, depth = 5, 4, 3
    parent_list, selected = eagle_selection(g, B, topk, depth, N)
    seq = torch.randint(0, 50, (B,), generator=g)
    args = [parent_list, selected, seq, torch.zeros(B * N, dtype=dtype), torch.full((B * N,), -7),
            torch.full((B, N), -7), torch.full((B, N), -1), torch.full((B, N), -1), topk, depth, N, 2]
    cpu = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    build_tree_kernel_efficient(*cpu)
    gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    build_tree_kernel_efficient(*gpu)
    assert_equal(gpu[3].cpu().view(torch.uint8), cpu[3].view(torch.uint8), "tree_mask bytes")
    for i in (4, 5, 6, 7):
        assert_equal(gpu[i].cpu(), cpu[i], f"argument {i}")


@pytest.mark.gpu
def test_gpu_cpp_build_records_a_bad_parent_as_the_triton_kernel_does():
    # parent_list[0, 3] = 7 feeds selected candidate 6 (slot 8 = depth 2, m 0 of our layout) a parent outside
    # depth 1: recorded as build_tree's draft_parents, the candidate hanging from the root, on both CUDA paths
    import eagle3_ops

    args = _build_args()
    args[0][0, 3] = 7
    eagle3_ops.check_errors()
    messages = []
    for path in ("triton", "auto"):
        copies = [a.clone().cuda() for a in args]
        compat.kernels = path
        try:
            build_tree_kernel_efficient(*copies, 2, 3, 6, TreeMaskMode.QLEN_ONLY)
        finally:
            compat.kernels = "auto"
        with pytest.raises(Eagle3InputError) as e:
            eagle3_ops.check_errors()
        messages.append((str(e.value), [t.cpu() for t in copies[3:]]))
    assert messages[0][0] == messages[1][0] == "build_tree: draft_parents[0, 2, 0] = 5 is out of range (valid: 0..3)"
    for a, b in zip(messages[0][1], messages[1][1]):
        assert_equal(b, a, "outputs after the bad entry (C++ vs Triton)")


@pytest.mark.gpu
@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("B,N,kind,S", WALK_SHAPES + [(64, 4, "chain", 4), (64, 8, "beam", 8), (1, 8, "beam", 8),
                                                      (3, 300, "bushy", 9)])  # + the bench's; N past Triton's 256
def test_gpu_cpp_verify_greedy_matches_paths(B, N, kind, S, shuffled):
    cpp_matches_paths(verify_tree_greedy, *_greedy_case(B, N, kind, S, shuffled))


@pytest.mark.gpu
def test_gpu_cpp_verify_greedy_bad_links_and_rows():
    # links outside [0, N), a node linked from a later one, rows outside [0, B * N): clamped / never followed,
    # as the Triton kernel does
    g = torch.Generator().manual_seed(21)
    B, N, S = 4, 16, 6
    tokens, target, r_index, r_next, r_sib = _walk_case(g, B, N, "bushy", 3, shuffled=True)
    r_next[0, 0], r_sib[1, 2], r_next[2, 5] = 99, -5, 3
    r_index[3, 1], r_index[3, 2] = -4, B * N + 7
    needs_cpp_ops()
    runs = []
    for path in ("triton", "auto"):
        copies = [a.clone().cuda() for a in [*_walk_outs(B, N, S), tokens, r_index, r_next, r_sib, target]]
        compat.kernels = path
        try:
            verify_tree_greedy(*copies)
        finally:
            compat.kernels = "auto"
        runs.append(copies)
    for i in (0, 1, 2):
        assert_equal(runs[1][i].cpu(), runs[0][i].cpu(), f"argument {i} (C++ vs Triton)")


@pytest.mark.gpu
@pytest.mark.parametrize("B,N,kind,S,V,thresholds,with_draft",
                         SAMPLING_CASES + [(64, 8, "beam", 8, 163840, (1.0, 1.0), True),
                                           (64, 4, "chain", 4, 163840, (0.5, 0.7), False),
                                           (1, 8, "beam", 8, 163841, (0.3, 0.6), True)])  # the bench's; V odd
def test_gpu_cpp_sampling_matches_paths(B, N, kind, S, V, thresholds, with_draft):
    for args, outs in _sampling_cases(B, N, kind, S, V, thresholds, with_draft):
        cpp_matches_paths(tree_speculative_sampling_target_only, args, outs)
    # [B * N, V] probabilities, the newest release's positional thresholds (no draft_probs)
    args[9:] = [args[9].view(B * N, V), *thresholds]
    cpp_matches_paths(tree_speculative_sampling_target_only, args, (0, 1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("with_draft", [False, True])
def test_gpu_cpp_sampling_draws_past_zero_mass_tokens(with_draft):
    # _zero_mass_case at the bench's B 64, V 163840: the C++ op, the Triton kernels and the tensor ops (the one
    # that drew a few tokens off at d4d8c6d, fp32-accumulated by CUDA's cumsum) all draw the fp64 inverse CDF's
    args, bonus = _zero_mass_case(64, 163840, with_draft)
    _check_zero_mass_draws(cpp_matches_paths(tree_speculative_sampling_target_only, args,
                                             (0, 1, 2) + ((10,) if with_draft else ())), bonus)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[0], [1], [7, 8, 9], [0, 13, 0, 64, 3], list(range(0, 300, 7)),
                                     [64 * (4096 + 64)] * 3])  # the last: the bench's segments, aligned
def test_gpu_cpp_packbits_matches_paths(lengths):
    x, in_ptr, out_ptr, y, n = _packbits_args(lengths)
    cpp_matches_paths(segment_packbits, [x, in_ptr, out_ptr, y, n], (3,))
    if len(x) > 1:  # x at an odd offset (its 8-byte loads not aligned)
        cpp_matches_paths(segment_packbits, [x[1:], in_ptr.clamp(max=len(x) - 1), out_ptr, y, n], (3,))


@pytest.mark.gpu
@pytest.mark.parametrize("B,N,kind", [(1, 1, "chain"), (3, 9, "bushy"), (2, 17, "beam"), (65, 4, "wide"),
                                      (1, 64, "bushy"), (2, 300, "beam")])  # N 300: past the Triton kernel's 256
def test_gpu_cpp_reconstruct_matches_paths(B, N, kind):
    args = _reconstruct_args(B, N, kind)
    cpp_matches_paths(reconstruct_indices_from_tree_mask, args, (2, 3, 4, 5))
    g, seq = torch.Generator().manual_seed(N), args[1]
    # int32 lengths, positions [B, N] and next tokens int32, a mask that is not a tree (random bits)
    outs = [torch.full((B, N), -7, dtype=torch.int32), torch.full((B, N), -7), torch.full((B, N), -7, dtype=torch.int32),
            torch.full((B, N), -7)]
    noise = torch.rand(B * N * N, generator=g) < 0.3
    cpp_matches_paths(reconstruct_indices_from_tree_mask, [noise, seq.int(), *outs, B, N], (2, 3, 4, 5))


@pytest.mark.gpu
def test_gpu_cpp_past_its_limits_takes_the_other_paths():
    # past the C++ kernels' 1024 nodes a request (NotImplementedError inside): the other paths, as on the CPU.
    # A walk of 1100 nodes: the tensor ops
    g = torch.Generator().manual_seed(22)
    B, N, S = 2, 1100, 5
    tokens, target, r_index, r_next, r_sib = _walk_case(g, B, N, "chain", 3, shuffled=False)
    _cuda_matches_cpu(verify_tree_greedy, [*_walk_outs(B, N, S), tokens, r_index, r_next, r_sib, target], (0, 1, 2))
    # a build of 1100 nodes (topk 4, 70 steps: 1120 candidate slots): the tensor-op path (build_tree's kernel)
    args = _build_case(g, 1, 4, 70, 1100, TreeMaskMode.QLEN_ONLY)
    _cuda_matches_cpu(build_tree_kernel_efficient, args, (3, 4, 5, 6, 7))


def _bad_calls():
    """(function, args) pairs the Python path refuses with TypeError / ValueError from shapes and dtypes alone."""
    calls = []
    for change, exc, _ in BAD_BUILD:
        if exc is not Eagle3InputError:
            args = _build_args()
            change(args)
            calls.append((build_tree_kernel_efficient, args + [2, 3, 6, TreeMaskMode.QLEN_ONLY]))
    args = _build_args(TreeMaskMode.QLEN_ONLY_BITPACKING)
    args[3] = torch.zeros(6, dtype=torch.uint16)
    calls.append((build_tree_kernel_efficient, args + [2, 3, 6, 2]))
    args = _build_args(TreeMaskMode.QLEN_ONLY_BITPACKING)
    calls.append((build_tree_kernel_efficient, args[:3] + [torch.zeros(5, dtype=torch.uint8)] + args[4:] + [2, 3, 6, 2]))
    calls.append((build_tree_kernel_efficient, _build_args() + [2, 3, 6, 3]))   # no such mode
    calls.append((build_tree_kernel_efficient, _build_args() + [0, 3, 6, 1]))   # topk 0
    calls.append((build_tree_kernel_efficient, _build_args() + [2, 3, 12, 1]))  # N past the candidates + 1
    args = _build_args()
    args[4] = torch.full((2, 3), -7)  # positions of B * N elements in another shape
    calls.append((build_tree_kernel_efficient, args + [2, 3, 6, 1]))
    probs = torch.softmax(peer_logits(), -1)
    for change, exc, msg in BAD_WALK:
        if exc is Eagle3InputError or "parent before" in msg:  # value checks: CPU only
            continue
        for fn, extra in ((verify_tree_greedy, [peer_logits().argmax(-1)]),
                          (tree_speculative_sampling_target_only, [torch.rand(2, 6), torch.rand(2), probs, None])):
            args = _walk_args()
            change(args)
            calls.append((fn, args + extra))
    walk = _walk_args()
    calls.append((verify_tree_greedy, walk + [peer_logits().argmax(-1).int()]))
    calls.append((verify_tree_greedy, walk[:4] + [walk[4][:, :5]] + walk[5:] + [peer_logits().argmax(-1)]))
    calls.append((tree_speculative_sampling_target_only, walk + [torch.rand(2, 6).double(), torch.rand(2), probs, None]))
    calls.append((tree_speculative_sampling_target_only, walk + [torch.rand(2, 6), torch.rand(3), probs, None]))
    calls.append((tree_speculative_sampling_target_only, walk + [torch.rand(2, 6), torch.rand(2),
                                                                 probs[:, :5].contiguous(), None]))
    calls.append((tree_speculative_sampling_target_only, walk + [torch.rand(2, 6), torch.rand(2), probs,
                                                                 torch.zeros(2, 6, 19)]))
    calls.append((tree_speculative_sampling_target_only, walk + [torch.rand(2, 6), torch.rand(2), probs.view(12, 20),
                                                                 torch.zeros(2, 6, 20)]))
    calls.append((tree_speculative_sampling_target_only, walk + [torch.rand(2, 6), torch.rand(2),
                                                                 probs.transpose(1, 2), None]))
    x = torch.ones(9, dtype=torch.bool)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    calls.append((segment_packbits, [x, torch.tensor([0, 9]), i32([0, 2]), torch.zeros(2, dtype=torch.uint8), 1]))
    calls.append((segment_packbits, [x, i32([0, 9]), i32([0, 2, 2]), torch.zeros(2, dtype=torch.uint8), 1]))
    calls.append((segment_packbits, [x.view(3, 3), i32([0, 9]), i32([0, 2]), torch.zeros(2, dtype=torch.uint8), 1]))
    calls.append((segment_packbits, [x, i32([0, 9]), i32([0, 2]), torch.zeros(2, dtype=torch.int8), 1]))
    lists = [torch.zeros(2, 3, dtype=torch.int64)] * 3
    calls.append((reconstruct_indices_from_tree_mask, [torch.ones(17, dtype=torch.bool), torch.zeros(2, dtype=torch.int64),
                                                       torch.zeros(6, dtype=torch.int64), *lists, 2, 3]))
    calls.append((reconstruct_indices_from_tree_mask, [torch.ones(18, dtype=torch.bool), torch.zeros(2),
                                                       torch.zeros(6, dtype=torch.int64), *lists, 2, 3]))
    calls.append((reconstruct_indices_from_tree_mask, [torch.ones(18, dtype=torch.bool), torch.zeros(2, dtype=torch.int32),
                                                       torch.zeros(7, dtype=torch.int64), *lists, 2, 3]))
    calls.append((reconstruct_indices_from_tree_mask, [torch.ones(18, dtype=torch.bool), torch.zeros(2, dtype=torch.int32),
                                                       torch.zeros(6, dtype=torch.int64), *lists[:2],
                                                       torch.zeros(3, 2, dtype=torch.int64), 2, 3]))
    return calls


def test_bad_calls_are_refused_on_cpu():
    # the list the GPU test below replays on CUDA: each refused here with TypeError / ValueError, nothing written
    for fn, args in _bad_calls():
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises((TypeError, ValueError)) as e:
            fn(*args)
        assert not isinstance(e.value, Eagle3InputError), f"{fn.__name__}: {e.value}"
        for t, b in zip(args, before):
            if isinstance(t, torch.Tensor):
                assert_equal(t, b, f"{fn.__name__}: an argument after a refused call")


@pytest.mark.gpu
def test_gpu_cpp_refuses_bad_input_as_the_python_path():
    # every shape / dtype / layout refusal of the Python path, on CUDA copies through the C++ op: the same
    # exception type and message, nothing written
    needs_cpp_ops()
    for fn, args in _bad_calls():
        with pytest.raises((TypeError, ValueError)) as cpu:
            fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in gpu]
        with pytest.raises(type(cpu.value)) as cuda:
            fn(*gpu)
        said = str(cuda.value).splitlines()[0]  # (a C++ backtrace, where enabled, follows the message)
        assert said == str(cpu.value), f"{fn.__name__}: C++ says {said!r}, Python {str(cpu.value)!r}"
        for t, b in zip(gpu, before):
            if isinstance(t, torch.Tensor):
                assert_equal(t.cpu(), b.cpu(), f"{fn.__name__}: an argument after a refused call")
    # one argument on another device
    args = [a.cuda() for a in _build_args()]
    args[5] = args[5].cpu()
    with pytest.raises(ValueError, match=r"^retrive_index must be on the same device as the first argument "
                                         r"\(cuda:0\), got cpu"):
        build_tree_kernel_efficient(*args, 2, 3, 6, TreeMaskMode.QLEN_ONLY)


@pytest.mark.gpu
def test_gpu_cpp_ops_in_one_graph():
    # the five C++ ops captured in one CUDA graph (the sampling's two launches and its scratch too), replayed on
    # new inputs written in place: equal to eager calls on the same inputs
    needs_cpp_ops()
    g = torch.Generator().manual_seed(23)
    dev = "cuda"
    B, topk, depth, N, V, S = 8, 4, 3, 17, 1000, 6
    build = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in _build_case(g, B, topk, depth, N, 0, 300)]
    tokens, target, r_index, r_next, r_sib = [t.to(dev) for t in _walk_case(g, B, N, "beam", V, shuffled=True)]
    probs = torch.softmax(torch.randn(B, N, V, device=dev) * 4, -1)
    draft = torch.zeros_like(probs)
    coins, final = torch.rand(B, N, device=dev), torch.rand(B, device=dev)
    greedy = [torch.full((B * N + 1,), -9, dtype=torch.int32, device=dev), torch.full((B, S), -9, dtype=torch.int32,
              device=dev), torch.full((B,), -9, dtype=torch.int32, device=dev)]
    sampling = [t.clone() for t in greedy]
    lengths = torch.randint(0, 70, (9,), generator=g)
    in_ptr = torch.cat([torch.zeros(1), lengths.cumsum(0)]).int().to(dev)
    out_ptr = torch.cat([torch.zeros(1), ((lengths + 7) // 8).cumsum(0)]).int().to(dev)
    x = (torch.rand(int(in_ptr[-1]), generator=g) < 0.3).to(dev)
    y = torch.zeros(int(out_ptr[-1]), dtype=torch.uint8, device=dev)
    qmask = tree.mask_to_dense(tree.tree_mask(tree.random_parents(B, N, g, "bushy")), N).reshape(-1).to(dev)
    recon = [torch.full((B * N,), -7, device=dev)] + [torch.full((B, N), -7, device=dev) for _ in range(3)]
    seq = torch.randint(0, 99, (B,), device=dev)

    def step():
        build[3].fill_(True)
        for t in build[5:8]:
            t.fill_(-1)
        draft.zero_()
        build_tree_kernel_efficient(*build)
        verify_tree_greedy(*greedy, tokens, r_index, r_next, r_sib, target)
        tree_speculative_sampling_target_only(*sampling, tokens, r_index, r_next, r_sib, coins, final, probs, draft,
                                              0.5, 0.7)
        segment_packbits(x, in_ptr, out_ptr, y, 9)
        reconstruct_indices_from_tree_mask(qmask, seq, *recon, B, N)

    outputs = lambda: [build[3], *build[4:8], *greedy, *sampling, draft, y, *recon]  # noqa: E731
    graph, _ = capture_graph(step)
    for _ in range(2):
        parent_list, selected = eagle_selection(g, B, topk, depth, N)
        build[0].copy_(parent_list)
        build[1].copy_(selected)
        coins.copy_(torch.rand(B, N, device=dev))
        final.copy_(torch.rand(B, device=dev))
        target.copy_(torch.where(torch.rand(B, N, device=dev) < 0.5, target, tokens))
        x.copy_(torch.rand(x.numel(), device=dev) < 0.5)
        qmask.copy_(tree.mask_to_dense(tree.tree_mask(tree.random_parents(B, N, g, "beam")), N).reshape(-1))
        graph.replay()
        got = [t.clone() for t in outputs()]
        step()
        for i, (a, b) in enumerate(zip(got, outputs())):
            assert_equal(a.cpu(), b.cpu(), f"replay vs eager, output {i}")
