"""eagle3_ops.tree: golden hand-built trees, mask word boundaries, properties, bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3_ops import tree

PROPERTY = settings(derandomize=True, max_examples=200, deadline=None)


def i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


def i64(rows):
    return torch.tensor(rows, dtype=torch.int64)


def assert_exact(actual, expected, name):
    """Exact comparison that names the first mismatching index."""
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    bad = actual != expected
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{name}: first mismatch at {idx}: got {actual[idx].item()}, "
                             f"expected {expected[idx].item()} ({int(bad.sum())} mismatches)")


def naive_ancestors(parents_row):
    """anc[i] = set of nodes that are i or an ancestor of i, by walking up."""
    out = []
    for i in range(len(parents_row)):
        seen, k = set(), i
        while k != -1:
            seen.add(k)
            k = parents_row[k]
        out.append(seen)
    return out


# ---------------------------------------------------------------------------------------------
# Golden trees: every expected value written out by hand.
# ---------------------------------------------------------------------------------------------

def test_golden_six_nodes():
    #        0
    #      /   \
    #     1     2
    #    / \    |
    #   3   4   5
    parents = i32([[-1, 0, 0, 1, 1, 2]])
    tokens = i64([[7, 11, 12, 13, 14, 15]])
    tree.validate(tokens, parents)
    assert_exact(tree.depth(parents), i32([[0, 1, 1, 2, 2, 2]]), "depth")
    assert_exact(tree.positions(parents, i32([10])), i64([[10, 11, 11, 12, 12, 12]]), "positions")
    # row i: bits of {i} + ancestors. 0:{0}=1, 1:{0,1}=3, 2:{0,2}=5, 3:{0,1,3}=11, 4:{0,1,4}=19,
    # 5:{0,2,5}=37
    mask = tree.tree_mask(parents)
    expected = i32([[[0b1], [0b11], [0b101], [0b1011], [0b10011], [0b100101]]])
    assert_exact(mask, expected, "tree_mask")
    first_child, next_sibling = tree.children_links(parents)
    assert_exact(first_child, i32([[1, 3, 5, -1, -1, -1]]), "first_child")
    assert_exact(next_sibling, i32([[-1, 2, -1, 4, -1, -1]]), "next_sibling")
    draft_tokens, retrive_index, next_token, next_sib = tree.to_sglang(tokens, parents)
    assert_exact(draft_tokens, i64([7, 11, 12, 13, 14, 15]), "draft_tokens")
    assert_exact(retrive_index, i64([[0, 1, 2, 3, 4, 5]]), "retrive_index")
    assert_exact(next_token, i64([[1, 3, 5, -1, -1, -1]]), "retrive_next_token")
    assert_exact(next_sib, i64([[-1, 2, -1, 4, -1, -1]]), "retrive_next_sibling")
    back_tokens, back_parents = tree.from_sglang(draft_tokens, retrive_index, next_token, next_sib)
    assert_exact(back_tokens, tokens, "tokens")
    assert_exact(back_parents, parents, "parents")


def test_golden_sglang_build_tree_case():
    # The two trees of SGLang's own test_build_tree_kernel_efficient (python/sglang/srt/speculative/
    # build_eagle_tree.py: seq_lens [5, 10], 8 draft tokens); the expected positions and retrive_*
    # lists are the ones that test asserts for SGLang's CUDA kernel.
    # Request 0:  0 -> {1, 2}, 1 -> 3, 2 -> 4, 3 -> 5, 4 -> 6, 5 -> 7.
    # Request 1:  0 -> 1, 1 -> {2, 3, 4, 5}, 3 -> 6, 6 -> 7.
    parents = i32([[-1, 0, 0, 1, 2, 3, 4, 5],
                   [-1, 0, 1, 1, 1, 1, 3, 6]])
    tokens = i64([[29974, 29896, 29906, 29889, 29974, 29946, 29896, 29946],
                  [13, 13, 22550, 4136, 16492, 8439, 29871, 29941]])
    assert_exact(tree.positions(parents, i32([5, 10])).flatten(),
                 i64([5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]), "positions")
    draft_tokens, retrive_index, next_token, next_sib = tree.to_sglang(tokens, parents)
    assert_exact(draft_tokens, tokens.flatten(), "draft_tokens")
    assert_exact(retrive_index, i64([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]),
                 "retrive_index")
    assert_exact(next_token, i64([[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]]),
                 "retrive_next_token")
    assert_exact(next_sib, i64([[-1, 2, -1, -1, -1, -1, -1, -1], [-1, -1, 3, 4, 5, -1, -1, -1]]),
                 "retrive_next_sibling")
    # Request 0 rows: {0}, {0,1}, {0,2}, {0,1,3}, {0,2,4}, {0,1,3,5}, {0,2,4,6}, {0,1,3,5,7}
    # Request 1 rows: {0}, {0,1}, {0,1,2}, {0,1,3}, {0,1,4}, {0,1,5}, {0,1,3,6}, {0,1,3,6,7}
    mask = tree.tree_mask(parents)
    expected = i32([[1, 3, 5, 11, 21, 43, 85, 171], [1, 3, 7, 11, 19, 35, 75, 203]])
    assert_exact(mask[..., 0], expected, "tree_mask")
    back_tokens, back_parents = tree.from_sglang(draft_tokens, retrive_index, next_token, next_sib)
    assert_exact(back_parents, parents, "parents")
    assert_exact(back_tokens, tokens, "tokens")


@pytest.mark.parametrize("B", [1, 3])  # one request, and several (retrive_index offsets b * N)
def test_root_only(B):
    # N = 1: the smallest tree (nothing drafted); every derived tensor is trivial.
    parents = torch.full((B, 1), -1, dtype=torch.int32)
    tokens = i64([[5], [6], [7]][:B])
    assert_exact(tree.depth(parents), i32([[0]] * B), "depth")
    assert_exact(tree.positions(parents, i32([4, 0, 9][:B])), i64([[4], [0], [9]][:B]), "positions")
    assert_exact(tree.tree_mask(parents), i32([[[1]]] * B), "tree_mask")
    first_child, next_sibling = tree.children_links(parents)
    assert_exact(first_child, i32([[-1]] * B), "first_child")
    assert_exact(next_sibling, i32([[-1]] * B), "next_sibling")
    lists = tree.to_sglang(tokens, parents)
    assert_exact(lists[0], i64([5, 6, 7][:B]), "draft_tokens")
    assert_exact(lists[1], i64([[0], [1], [2]][:B]), "retrive_index")
    assert_exact(lists[2], i64([[-1]] * B), "retrive_next_token")
    assert_exact(lists[3], i64([[-1]] * B), "retrive_next_sibling")
    back_tokens, back_parents = tree.from_sglang(*lists)
    assert_exact(back_parents, parents, "parents")
    assert_exact(back_tokens, tokens, "tokens")


# Mask word boundary: N = 32 fills one word (bit 31 makes it negative), N = 33 needs a second word,
# N = 64 fills two. Chains set every low bit; wide trees set only the root bit and the node's own.
INT32_MIN = -(2**31)


def test_chain_32_one_full_word():
    parents = tree.chain_parents(1, 32)
    mask = tree.tree_mask(parents)
    assert mask.shape == (1, 32, 1)
    assert mask[0, 0, 0] == 1
    assert mask[0, 1, 0] == 3
    assert mask[0, 30, 0] == 2**31 - 1  # bits 0..30
    assert mask[0, 31, 0] == -1  # bits 0..31: 0xFFFFFFFF as int32
    assert_exact(tree.depth(parents), torch.arange(32, dtype=torch.int32)[None], "depth")


def test_chain_33_second_word():
    parents = tree.chain_parents(1, 33)
    mask = tree.tree_mask(parents)
    assert mask.shape == (1, 33, 2)
    assert mask[0, 30].tolist() == [2**31 - 1, 0]
    assert mask[0, 31].tolist() == [-1, 0]
    assert mask[0, 32].tolist() == [-1, 1]
    first_child, next_sibling = tree.children_links(parents)
    assert first_child[0].tolist() == list(range(1, 33)) + [-1]
    assert next_sibling[0].tolist() == [-1] * 33


def test_wide_33_bit_31():
    parents = tree.random_parents(1, 33, torch.Generator().manual_seed(0), kind="wide")
    assert parents[0].tolist() == [-1] + [0] * 32
    mask = tree.tree_mask(parents)
    assert mask[0, 0].tolist() == [1, 0]
    assert mask[0, 1].tolist() == [0b11, 0]
    assert mask[0, 31].tolist() == [1 + INT32_MIN, 0]  # bits 0 and 31
    assert mask[0, 32].tolist() == [1, 1]  # bit 0 of word 0, bit 0 of word 1 (node 32)
    first_child, next_sibling = tree.children_links(parents)
    assert first_child[0].tolist() == [1] + [-1] * 32
    assert next_sibling[0].tolist() == [-1] + list(range(2, 33)) + [-1]


@pytest.mark.parametrize("B", [1, 3])
def test_64_two_full_words(B):
    chain = tree.chain_parents(B, 64)
    mask = tree.tree_mask(chain)
    assert mask.shape == (B, 64, 2)
    assert mask[:, 63].tolist() == [[-1, -1]] * B
    assert mask[:, 62].tolist() == [[-1, 2**31 - 1]] * B
    assert mask[:, 32].tolist() == [[-1, 1]] * B
    assert_exact(tree.positions(chain, i32([0, 100, 7][:B])),
                 i64([0, 100, 7][:B])[:, None] + torch.arange(64), "positions")
    wide = tree.random_parents(B, 64, torch.Generator().manual_seed(0), kind="wide")
    mask = tree.tree_mask(wide)
    assert mask[:, 63].tolist() == [[1, INT32_MIN]] * B  # root bit, and bit 31 of word 1
    assert mask[:, 31].tolist() == [[1 + INT32_MIN, 0]] * B


def test_mask_dense_round_trip_all_bits():
    # Every bit pattern of a word survives pack/unpack, including the sign bit.
    g = torch.Generator().manual_seed(1)
    dense = torch.rand(3, 33, 33, generator=g) < 0.5
    dense[0, 0] = True
    mask = tree.dense_to_mask(dense)
    assert mask.dtype == torch.int32 and mask.shape == (3, 33, 2)
    assert mask[0, 0].tolist() == [-1, 1]
    assert_exact(tree.mask_to_dense(mask, 33), dense, "dense")


def test_step_functions_never_read_values():
    # On the meta device there are no values: a host sync (.item(), .tolist(), nonzero) would fail.
    parents = tree.chain_parents(2, 40, device="meta")
    assert tree.depth(parents).shape == (2, 40)
    prefix_lens = torch.zeros(2, dtype=torch.int32, device="meta")
    assert tree.positions(parents, prefix_lens).shape == (2, 40)
    assert tree.tree_mask(parents).shape == (2, 40, 2)
    first_child, next_sibling = tree.children_links(parents)
    assert first_child.shape == next_sibling.shape == (2, 40)


# ---------------------------------------------------------------------------------------------
# Properties over random trees.
# ---------------------------------------------------------------------------------------------

@st.composite
def trees(draw, max_n=70):
    """(tokens [B, N] int64, parents [B, N] int32), N up to 70: past two mask word boundaries."""
    n = draw(st.integers(1, max_n))
    b = draw(st.integers(1, 3))
    rows = [[-1] + [draw(st.integers(0, j - 1)) for j in range(1, n)] for _ in range(b)]
    tokens = draw(st.lists(st.integers(0, 2**40), min_size=b * n, max_size=b * n))
    return i64(tokens).view(b, n), i32(rows)


@PROPERTY
@given(trees())
def test_mask_and_depth_match_naive_ancestors(tree_):
    tokens, parents = tree_
    B, N = parents.shape
    tree.validate(tokens, parents)
    mask = tree.tree_mask(parents)
    assert mask.shape == (B, N, (N + 31) // 32)
    dense = tree.mask_to_dense(mask, N)
    expected = torch.zeros(B, N, N, dtype=torch.bool)
    for b in range(B):
        for i, anc in enumerate(naive_ancestors(parents[b].tolist())):
            expected[b, i, list(anc)] = True
    assert_exact(dense, expected, "ancestor mask")
    assert_exact(tree.dense_to_mask(dense), mask, "dense_to_mask")
    d = tree.depth(parents)
    assert_exact(d, (expected.sum(-1) - 1).int(), "depth vs mask popcount")
    prefix = torch.arange(B, dtype=torch.int32) * 1000
    assert_exact(tree.positions(parents, prefix), prefix.long()[:, None] + d, "positions")


@PROPERTY
@given(trees())
def test_sglang_round_trip_and_children_links(tree_):
    tokens, parents = tree_
    B, N = parents.shape
    first_child, next_sibling = tree.children_links(parents)
    for b in range(B):
        p = parents[b].tolist()
        for i in range(N):  # walking i's list visits exactly its children, ascending
            walk, k = [], first_child[b, i].item()
            while k != -1:
                walk.append(k)
                k = next_sibling[b, k].item()
            assert walk == [j for j in range(N) if p[j] == i], f"children of node {i}, request {b}"
    lists = tree.to_sglang(tokens, parents)
    assert_exact(lists[2], first_child.long(), "retrive_next_token")
    assert_exact(lists[3], next_sibling.long(), "retrive_next_sibling")
    back_tokens, back_parents = tree.from_sglang(*lists)
    assert_exact(back_tokens, tokens, "tokens")
    assert_exact(back_parents, parents, "parents")
    again = tree.to_sglang(back_tokens, back_parents)
    for name, x, y in zip(("draft_tokens", "index", "next_token", "next_sibling"), lists, again):
        assert_exact(y, x, name)


@pytest.mark.parametrize("kind", ["bushy", "chain", "wide", "beam"])
@pytest.mark.parametrize("N", [1, 7, 64])  # root only, a typical EAGLE tree, two mask words
def test_random_parents_valid(kind, N):
    parents = tree.random_parents(3, N, torch.Generator().manual_seed(N), kind=kind)
    assert parents.dtype == torch.int32 and parents.shape == (3, N)
    tree.validate(torch.zeros(3, N, dtype=torch.int64), parents)
    again = tree.random_parents(3, N, torch.Generator().manual_seed(N), kind=kind)
    assert_exact(again, parents, "same seed, same tree")
    if kind == "chain":
        assert_exact(parents, tree.chain_parents(3, N), "chain")
    if kind == "beam":
        assert tree.depth(parents).max() <= 6
        counts = torch.zeros(3, N + 1, dtype=torch.int64).scatter_add_(
            1, parents.long() + 1, torch.ones(3, N, dtype=torch.int64))
        assert counts[:, 1:].max() <= 4


def test_random_parents_bad_args():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="kind"):
        tree.random_parents(1, 4, g, kind="star")
    with pytest.raises(ValueError, match="beam"):
        tree.random_parents(1, 8, g, kind="beam", topk=1, max_depth=3)
    with pytest.raises(ValueError, match="N"):
        tree.random_parents(1, 0, g)


# ---------------------------------------------------------------------------------------------
# Bad input: every failure names the argument.
# ---------------------------------------------------------------------------------------------

GOOD_PARENTS = [[-1, 0, 0, 1], [-1, 0, 1, 2]]
GOOD_TOKENS = [[1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.mark.parametrize("tokens, parents, error, match", [
    (i32(GOOD_TOKENS), i32(GOOD_PARENTS), TypeError, "tokens"),  # tokens must be int64
    (i64(GOOD_TOKENS), i64(GOOD_PARENTS), TypeError, "parents"),  # parents must be int32
    (i64(GOOD_TOKENS[0]), i32(GOOD_PARENTS), ValueError, "tokens"),  # rank 1
    (i64(GOOD_TOKENS), i32([GOOD_PARENTS]), ValueError, "parents"),  # rank 3
    (i64([[1, 2, 3]] * 2), i32(GOOD_PARENTS), ValueError, "tokens and parents"),  # N differs
    (i64([[]]), torch.zeros(1, 0, dtype=torch.int32), ValueError, "parents"),  # no root
    (i64([[1, 2, -3, 4]] * 2), i32(GOOD_PARENTS), ValueError, "tokens"),  # negative token
    (i64(GOOD_TOKENS), i32([[-1, 0, 0, 1], [0, 0, 1, 2]]), ValueError, r"parents\[:, 0\]"),
    (i64(GOOD_TOKENS), i32([[-1, 0, 0, 1], [-2, 0, 1, 2]]), ValueError, r"parents\[:, 0\]"),
    (i64(GOOD_TOKENS), i32([[-1, 0, -1, 1], [-1, 0, 1, 2]]), ValueError, r"parents\[0, 2\] = -1"),
    (i64(GOOD_TOKENS), i32([[-1, 0, 0, 1], [-1, 0, 2, 2]]), ValueError, "topological"),  # self
    (i64(GOOD_TOKENS), i32([[-1, 0, 0, 1], [-1, 0, 1, 5]]), ValueError, "topological"),  # later
    (i64(GOOD_TOKENS), i32([[-1, 0, 0, -7], [-1, 0, 1, 2]]), ValueError, r"parents\[0, 3\] = -7"),
    ("tokens", i32(GOOD_PARENTS), TypeError, "tokens"),  # not a tensor
])
def test_validate_rejects(tokens, parents, error, match):
    with pytest.raises(error, match=match):
        tree.validate(tokens, parents)


def test_validate_rejects_mixed_devices():
    with pytest.raises(ValueError, match="device"):
        tree.validate(i64(GOOD_TOKENS).to("meta"), i32(GOOD_PARENTS))


def test_step_functions_reject_bad_metadata():
    with pytest.raises(TypeError, match="parents"):
        tree.depth(i64(GOOD_PARENTS))
    with pytest.raises(TypeError, match="prefix_lens"):
        tree.positions(i32(GOOD_PARENTS), i64([0, 0]))
    with pytest.raises(ValueError, match="prefix_lens"):
        tree.positions(i32(GOOD_PARENTS), i32([0, 0, 0]))
    with pytest.raises(ValueError, match="tree_mask"):
        tree.mask_to_dense(torch.zeros(1, 33, 1, dtype=torch.int32), 33)  # needs W = 2
    with pytest.raises(ValueError, match="dense"):
        tree.dense_to_mask(torch.zeros(1, 3, 4, dtype=torch.bool))


def sglang_lists(next_token, next_sibling):
    next_token, next_sibling = i64([next_token]), i64([next_sibling])
    N = next_token.shape[1]
    return torch.arange(N, dtype=torch.int64) + 100, torch.arange(N)[None], next_token, next_sibling


@pytest.mark.parametrize("next_token, next_sibling, match", [
    ([1, 2, 1], [-1, -1, -1], "retrive_next_token"),  # cycle 1 -> 2 -> 1 (a backward link)
    ([1, 1, -1], [-1, -1, -1], "retrive_next_token"),  # a node that is its own child
    ([2, -1, -1], [-1, -1, 1], "retrive_next_sibling"),  # siblings in descending order
    ([1, 2, -1], [-1, 2, -1], "reached more than once"),  # node 2 is a child and a sibling
    ([1, -1, -1], [-1, -1, -1], "never reached"),  # node 2 dangling
    ([1, -1, -1], [2, -1, -1], "root"),  # the root has a sibling
    ([1, -1, 5], [-1, -1, -1], "retrive_next_token"),  # out of range
])
def test_from_sglang_rejects_non_trees(next_token, next_sibling, match):
    with pytest.raises(ValueError, match=match):
        tree.from_sglang(*sglang_lists(next_token, next_sibling))


def test_from_sglang_rejects_bad_metadata():
    draft_tokens, retrive_index, next_token, next_sibling = sglang_lists([1, -1], [-1, -1])
    tree.from_sglang(draft_tokens, retrive_index, next_token, next_sibling)  # the good one
    with pytest.raises(ValueError, match="retrive_index"):
        tree.from_sglang(draft_tokens, retrive_index.flip(1), next_token, next_sibling)
    with pytest.raises(TypeError, match="retrive_next_token"):
        tree.from_sglang(draft_tokens, retrive_index, next_token.int(), next_sibling)
    with pytest.raises(ValueError, match="draft_tokens"):
        tree.from_sglang(draft_tokens[:1], retrive_index, next_token, next_sibling)
    with pytest.raises(ValueError, match="retrive_next_sibling"):
        tree.from_sglang(draft_tokens, retrive_index, next_token, next_sibling[:, :1])
