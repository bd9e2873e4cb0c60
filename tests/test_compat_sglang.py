"""eagle3_ops.compat.sglang: build_tree_kernel_efficient and verify_tree_greedy against a plain-Python
restatement of sgl-kernel's semantics (eagle_utils.cu, read as a specification), on hand-built trees and
thousands of random EAGLE-like selections (hypothesis), in all three mask modes; agreement with our own
tree utilities and verify_greedy; the same on CUDA tensors (-m gpu)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3_ops import tree
from eagle3_ops.compat.sglang import TreeMaskMode, build_tree_kernel_efficient, verify_tree_greedy
from tests.conftest import assert_equal

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


def test_golden_unselected_parent_is_left_unlinked():
    # node 2 = flat 8 (slot 4 -> flat 4, not selected): SGLang leaves it out of the lists; its mask row
    # here is {root, itself} and its position prefix + 1.
    mask, positions, _, r_next, r_sib = run_build(torch.tensor(GOLDEN_PARENT_LIST), torch.tensor([[0, 8]]), [3], 2, 3,
                                                  3, TreeMaskMode.QLEN_ONLY)
    assert r_next.tolist() == [[1, -1, -1]] and r_sib.tolist() == [[-1, -1, -1]]
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
    w_pred, w_index, w_num = _greedy_python(tokens, r_index, r_next, r_sib, target, S)
    want_pred = torch.full((B * N,), -9, dtype=torch.int32)
    for r, v in w_pred.items():
        want_pred[r] = v
    assert_equal(predicts.cpu(), want_pred, "predicts")
    assert_equal(accept_index.cpu(), torch.tensor(w_index, dtype=torch.int32), "accept_index")
    assert_equal(num.cpu(), torch.tensor(w_num, dtype=torch.int32), "accept_token_num")
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


def test_bad_input_names_the_argument():
    pl, sel = torch.tensor(GOLDEN_PARENT_LIST), torch.tensor(GOLDEN_SELECTED)
    z = torch.full((1, 6), -1)
    with pytest.raises(ValueError, match="QLEN_ONLY_BITPACKING holds at most 32"):
        build_tree_kernel_efficient(pl, torch.zeros(1, 40, dtype=torch.int64), torch.tensor([0]),
                                    torch.zeros(41, 4, dtype=torch.uint8), torch.zeros(41, dtype=torch.int64),
                                    torch.zeros(1, 41, dtype=torch.int64), torch.zeros(1, 41, dtype=torch.int64),
                                    torch.zeros(1, 41, dtype=torch.int64), 2, 3, 41, 2)
    with pytest.raises(ValueError, match="selected_index must have shape"):
        build_tree_kernel_efficient(pl, sel[:, :3], torch.tensor([0]), torch.ones(36, dtype=torch.bool),
                                    torch.zeros(6, dtype=torch.int64), z.clone(), z.clone(), z.clone(), 2, 3, 6, 1)
    with pytest.raises(TypeError, match="positions must have dtype int64"):
        build_tree_kernel_efficient(pl, sel, torch.tensor([0]), torch.ones(36, dtype=torch.bool),
                                    torch.zeros(6, dtype=torch.int32), z.clone(), z.clone(), z.clone(), 2, 3, 6, 1)
    with pytest.raises(TypeError, match="predicts must have dtype int32"):
        verify_tree_greedy(torch.zeros(6, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int32),
                           torch.zeros(1, dtype=torch.int32), z.clone(), z.clone(), z.clone(), z.clone(), z.clone())


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
