"""The input contract (eagle3_ops/errors.py) for build_tree, verify_greedy and verify_sampling: for each bad
value, the CPU reference raises Eagle3InputError with exactly the message the CUDA kernel records in the
error word, and the CUDA outputs are the documented safe ones (hand-worked trees, every value written out).

A case is make(device) -> (call, guard) (tests/contract.py): guard() returns the caller's inputs and the
outputs (build_tree's, poisoned before the call; verify's as returned, none on a failed call)."""

from __future__ import annotations

import pytest
import torch

import eagle3_ops
from tests.conftest import assert_equal, poison_
from tests.contract import expect_cpu, expect_cuda, expect_cuda_graph


def i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


def i64(rows):
    return torch.tensor(rows, dtype=torch.int64)


def assert_rows(got, want, names):
    for g, w, name in zip(got, want, names):
        assert_equal(g.cpu(), w.to(g.dtype).view(g.shape), name)


# ---- build_tree ------------------------------------------------------------------------------------------
# tests/test_build_tree.py's golden input: B = 2, S = 2 draft steps, M = 2 candidates per step, N = 5.
#   request 0 (root 100, prefix 7): depth 0: (0,0) tok 10 -0.5, (0,1) tok 11 -1.0;
#                                   depth 1: (1,0) tok 20 -0.25 parent (0,1), (1,1) tok 21 -0.875 parent (0,0)
#   request 1 (root 200, prefix 0): depth 0: -2.0, -0.25; depth 1: (1,0) -3.0 parent (0,1), (1,1) -2.5 parent (0,0)
TREE_TOKENS = [[[10, 11], [20, 21]], [[10, 11], [20, 21]]]
TREE_SCORES = [[[-0.5, -1.0], [-0.25, -0.875]], [[-2.0, -0.25], [-3.0, -2.5]]]  # exact in bf16 and fp16
TREE_PARENTS = [[[-1, -1], [1, 0]], [[-1, -1], [1, 0]]]
# (tokens, parents, positions, tree_mask) of each request when nothing is wrong
GOLDEN = ([[100, 10, 21, 11, 20], [-1, 0, 1, 0, 3], [7, 8, 9, 8, 9], [0b1, 0b11, 0b111, 0b1001, 0b11001]],
          [[200, 11, 10, 21, 20], [-1, 0, 0, 2, 1], [0, 1, 1, 2, 2], [0b1, 0b11, 0b101, 0b1101, 0b10011]])
TREE_OUT = ("tokens", "parents", "positions", "tree_mask")


def build_case(poke_scores=None, poke_parents=None, score_dtype=torch.float32, parent_dtype=torch.int64):
    def make(device):
        scores = torch.tensor(TREE_SCORES, dtype=score_dtype)
        parents = torch.tensor(TREE_PARENTS, dtype=parent_dtype)
        for t, poke in ((scores, poke_scores), (parents, poke_parents)):
            if poke is not None:
                t[poke[0]] = poke[1]
        inputs = [t.to(device) for t in (i64([100, 200]), i64(TREE_TOKENS), scores, parents, i32([7, 0]))]
        outs = [poison_(torch.empty(shape, dtype=dt, device=device)) for shape, dt in
                (((2, 5), torch.int64), ((2, 5), torch.int32), ((2, 5), torch.int64), ((2, 5, 1), torch.int32))]
        return lambda: torch.ops.eagle3.build_tree(*inputs, *outs), lambda: inputs + outs
    return make


def tree_outputs(request0, request1):
    """check_outputs: the four outputs hold these per-request rows (tokens, parents, positions, mask)."""
    def check(guarded):
        assert_rows(guarded[5:], [torch.tensor([a, b]) for a, b in zip(request0, request1)], TREE_OUT)
    return check


# A parent outside [0, M) at depth >= 1 is read as the root.
#   request 0 with (1,0)'s parent 64: (1,0) is capped by nothing, eff -0.25, and ranks first:
#   rank (1,0) -0.25, (0,0) -0.5, (1,1) -0.875, (0,1) -1.0 -> nodes tok 20 (parent 0, depth 1), 10, 21 (parent
#   node 2), 11; request 1 as golden.
PARENT_AS_ROOT_0 = [[100, 20, 10, 21, 11], [-1, 0, 0, 2, 0], [7, 8, 8, 9, 8], [0b1, 0b11, 0b101, 0b1101, 0b10001]]
#   request 1 with (1,1)'s parent -1: eff stays -2.5 (its parent's -2.0 capped nothing), same ranks; node 3
#   (tok 21) now hangs from the root: depth 1.
PARENT_AS_ROOT_1 = [[200, 11, 10, 21, 20], [-1, 0, 0, 0, 1], [0, 1, 1, 1, 2], [0b1, 0b11, 0b101, 0b1001, 0b10011]]
# A NaN score ranks as -inf, and so (through the cap) does every descendant: request 1 with (0,1) NaN:
#   rank (0,0) -2.0, (1,1) -2.5, then the -inf tie in flat order: (0,1), (1,0) (its child).
NAN_AS_NEG_INF_1 = [[200, 10, 21, 11, 20], [-1, 0, 1, 0, 3], [0, 1, 2, 1, 2], [0b1, 0b11, 0b111, 0b1001, 0b11001]]

BUILD_CASES = [
    # (id, poke scores, poke parents, message, request 0, request 1 on CUDA)
    ("parent_past_M", None, ((0, 1, 0), 64), "build_tree: draft_parents[0, 1, 0] = 64 is out of range (valid: 0..1)",
     PARENT_AS_ROOT_0, GOLDEN[1]),
    ("parent_negative", None, ((1, 1, 1), -1),
     "build_tree: draft_parents[1, 1, 1] = -1 is out of range (valid: 0..1)", GOLDEN[0], PARENT_AS_ROOT_1),
    # depth-0 candidates are the root's children: any other parent is ignored
    ("depth0_parent_not_root", None, ((1, 0, 1), 0),
     "build_tree: draft_parents[1, 0, 1] = 0 is out of range (valid: -1..-1)", GOLDEN[0], GOLDEN[1]),
    ("score_nan", ((1, 0, 1), float("nan")), None, "build_tree: draft_scores[1, 0, 1] is NaN", GOLDEN[0],
     NAN_AS_NEG_INF_1),
]
DTYPES = [(torch.float32, torch.int64), (torch.bfloat16, torch.int32), (torch.float16, torch.int64)]


@pytest.mark.parametrize("score_dtype, parent_dtype", DTYPES)
@pytest.mark.parametrize("case", BUILD_CASES, ids=[c[0] for c in BUILD_CASES])
def test_build_tree_cpu(case, score_dtype, parent_dtype):
    _, scores, parents, message, _, _ = case
    expect_cpu(build_case(scores, parents, score_dtype, parent_dtype), message)


@pytest.mark.gpu
@pytest.mark.parametrize("score_dtype, parent_dtype", DTYPES)
@pytest.mark.parametrize("case", BUILD_CASES, ids=[c[0] for c in BUILD_CASES])
def test_build_tree_cuda(case, score_dtype, parent_dtype):
    _, scores, parents, message, request0, request1 = case
    expect_cuda(build_case(scores, parents, score_dtype, parent_dtype), message, tree_outputs(request0, request1))


@pytest.mark.gpu
def test_build_tree_cuda_graph():
    expect_cuda_graph(build_case(None, ((0, 1, 0), 64)), BUILD_CASES[0][3])


def _negative_ids(device):
    """Token ids and prefix lengths are only copied: negative ones are no error on either device."""
    inputs = [t.to(device) for t in (i64([-3, 200]), -i64(TREE_TOKENS), torch.tensor(TREE_SCORES),
                                     torch.tensor(TREE_PARENTS), i32([7, -2]))]
    return eagle3_ops.ops.build_tree(*inputs, num_nodes=5)


def test_build_tree_negative_ids_are_copied():
    tokens, parents, positions, mask = _negative_ids("cpu")
    assert_rows((tokens, parents, positions, mask),
                [torch.tensor(r) for r in ([[-3, -10, -21, -11, -20], [200, -11, -10, -21, -20]],
                                           [GOLDEN[0][1], GOLDEN[1][1]], [GOLDEN[0][2], [-2, -1, -1, 0, 0]],
                                           [GOLDEN[0][3], GOLDEN[1][3]])], TREE_OUT)


@pytest.mark.gpu
def test_build_tree_cuda_negative_ids_are_copied():
    eagle3_ops.check_errors()
    got = _negative_ids("cuda")
    eagle3_ops.check_errors()  # nothing recorded
    for g, w, name in zip(got, _negative_ids("cpu"), TREE_OUT):
        assert_equal(g.cpu(), w, name)


# ---- verify_greedy / verify_sampling ------------------------------------------------------------------------
# B = 2, N = 6, V = 50, each logit row's argmax planted (4.0 over zeros).
#   request 0:        0 (7)                    request 1:         0 (7)
#                   /      \                              /      |      \
#                1 (11)    2 (12)                     1 (30)   2 (12)   5 (12)
#                /   \        \                         |        |
#             3 (13) 4 (14)   5 (15)                  3 (31)   4 (32)
#   argmax rows [11, 14, 20, 21, 22, 23]      argmax rows [12, 40, 32, 41, 42, 43]
#   accepted 0 -> 1 -> 4, bonus 22           accepted 0 -> 2 (the lower of the two 12s) -> 4, bonus 42
V = 50
WALK_PARENTS = [[-1, 0, 0, 1, 1, 2], [-1, 0, 0, 1, 2, 0]]
WALK_TOKENS = [[7, 11, 12, 13, 14, 15], [7, 30, 12, 31, 32, 12]]
WALK_ARGMAX = [11, 14, 20, 21, 22, 23, 12, 40, 32, 41, 42, 43]
VALID = ([0, 1, 4, -1, -1, -1], 2, [11, 14, 22, -1, -1, -1])  # (accept_nodes, accept_len, emitted)
VALID_1 = ([0, 2, 4, -1, -1, -1], 2, [12, 32, 42, -1, -1, -1])
# request 1 with node 2's parent bad: node 2 is never accepted, nor node 4 below it: the root's argmax 12
# goes to node 5, a leaf, bonus 43
SKIP_NODE_2 = ([0, 5, -1, -1, -1, -1], 1, [12, 43, -1, -1, -1, -1])
WALK_OUT = ("accept_nodes", "accept_len", "emitted")

PARENT_CASES = [
    # (id, (b, j), bad parent, valid range, request 1 on CUDA)
    ("parent_not_topological", (1, 2), 5, "0..1", SKIP_NODE_2),
    ("parent_self", (1, 2), 2, "0..1", SKIP_NODE_2),
    ("parent_second_root", (1, 2), -1, "0..1", SKIP_NODE_2),
    ("parent_below_minus_one", (1, 2), -7, "0..1", SKIP_NODE_2),
    ("root_parent_not_minus_one", (1, 0), 0, "-1..-1", VALID_1),  # ignored
]


def walk_case(op, parents_poke=None, temperature=(0.0, 0.0), q=None):
    """op "verify_greedy" or "verify_sampling"; q: (draft_probs, d2t) on CPU, or None."""
    def make(device):
        logits = torch.zeros(12, V)
        logits[torch.arange(12), torch.tensor(WALK_ARGMAX)] = 4.0
        parents = i32(WALK_PARENTS)
        if parents_poke is not None:
            parents[parents_poke[0]] = parents_poke[1]
        inputs = [t.to(device) for t in (logits, i64(WALK_TOKENS), parents)]
        if op == "verify_sampling":
            dp, d2t = q if q is not None else (None, None)
            inputs = [inputs[0], None if dp is None else dp.to(device), None if d2t is None else d2t.to(device),
                      inputs[1], inputs[2], torch.tensor(temperature, device=device),
                      torch.arange(2, device=device), torch.zeros(2, dtype=torch.int64, device=device)]
        out = []

        def call():
            if device == "cuda":  # leave a sentinel in freed blocks: an unwritten output element shows
                del_me = torch.full((1 << 16,), -7, dtype=torch.int64, device=device)
                del del_me
            out[:] = getattr(torch.ops.eagle3, op)(*inputs)
            return out
        return call, lambda: [t for t in inputs if t is not None] + out
    return make


def walk_outputs(request1, request0=VALID):
    def check(guarded):
        rows = [torch.tensor([a, b]) for a, b in zip(request0, request1)]
        assert_rows(guarded[-3:], rows, WALK_OUT)
    return check


@pytest.mark.parametrize("op", ["verify_greedy", "verify_sampling"])
def test_walk_valid_tree(op):
    # the base case of every walk case: both requests as drawn above (sampling at temperature 0 is greedy)
    call, _ = walk_case(op)("cpu")
    assert_rows(call(), [torch.tensor([a, b]) for a, b in zip(VALID, VALID_1)], WALK_OUT)


@pytest.mark.parametrize("op", ["verify_greedy", "verify_sampling"])
@pytest.mark.parametrize("case", PARENT_CASES, ids=[c[0] for c in PARENT_CASES])
def test_walk_parents_cpu(op, case):
    _, where, value, valid, _ = case
    expect_cpu(walk_case(op, (where, value)),
               f"{op}: parents[{where[0]}, {where[1]}] = {value} is out of range (valid: {valid})")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["verify_greedy", "verify_sampling"])
@pytest.mark.parametrize("case", PARENT_CASES, ids=[c[0] for c in PARENT_CASES])
def test_walk_parents_cuda(op, case):
    _, where, value, valid, request1 = case
    expect_cuda(walk_case(op, (where, value)),
                f"{op}: parents[{where[0]}, {where[1]}] = {value} is out of range (valid: {valid})",
                walk_outputs(request1))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["verify_greedy", "verify_sampling"])
def test_walk_parents_cuda_graph(op):
    expect_cuda_graph(walk_case(op, ((1, 2), 5)), f"{op}: parents[1, 2] = 5 is out of range (valid: 0..1)")


def test_walk_tokens_outside_the_vocabulary_are_never_accepted():
    # token ids are only compared: no error on either device (tests the CPU; the GPU test below compares)
    for op in ("verify_greedy", "verify_sampling"):
        call, guard = walk_case(op)("cpu")
        tokens = guard()[1]
        tokens[1, 2], tokens[1, 5] = -12, V + 12  # the root's children carrying 12, now out of the vocabulary
        assert_rows(call(), [torch.tensor([a, b]) for a, b in zip(VALID, ([0, -1, -1, -1, -1, -1], 0,
                                                                           [12, -1, -1, -1, -1, -1]))], WALK_OUT)


@pytest.mark.gpu
def test_walk_cuda_tokens_outside_the_vocabulary_are_never_accepted():
    eagle3_ops.check_errors()
    for op in ("verify_greedy", "verify_sampling"):
        got = []
        for device in ("cpu", "cuda"):
            call, guard = walk_case(op)(device)
            guard()[1][1, 2], guard()[1][1, 5] = -12, V + 12
            got.append([t.cpu() for t in call()])
        for g, w, name in zip(got[1], got[0], WALK_OUT):
            assert_equal(g, w, f"{op} {name}")
    eagle3_ops.check_errors()  # nothing recorded


# temperature: negative or NaN samples request b greedily, as temperature 0 (the walk case's outputs)
TEMPERATURE_CASES = [
    ("negative", (0.0, -1.0), "verify_sampling: temperature[1] = -1.0 must be >= 0"),
    ("negative_inf", (float("-inf"), 0.0), "verify_sampling: temperature[0] = -inf must be >= 0"),
    ("nan", (0.0, float("nan")), "verify_sampling: temperature[1] is NaN"),
]


@pytest.mark.parametrize("case", TEMPERATURE_CASES, ids=[c[0] for c in TEMPERATURE_CASES])
def test_sampling_temperature_cpu(case):
    expect_cpu(walk_case("verify_sampling", temperature=case[1]), case[2])


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEMPERATURE_CASES, ids=[c[0] for c in TEMPERATURE_CASES])
def test_sampling_temperature_cuda(case):
    expect_cuda(walk_case("verify_sampling", temperature=case[1]), case[2], walk_outputs(VALID_1))


def test_sampling_temperature_negative_zero_is_greedy():
    # -0.0 >= 0: not an error, temperature 0
    call, _ = walk_case("verify_sampling", temperature=(-0.0, 0.0))("cpu")
    assert_rows(call(), [torch.tensor([a, b]) for a, b in zip(VALID, VALID_1)], WALK_OUT)


# d2t: draft id d maps to target id d + d2t[d], which must be in [0, V): d2t[d] in -d..V - 1 - d.
VD = 20


def draft_q(bad=None):
    """(draft_probs [12, VD], d2t [VD]) over the walk case: draft id d -> target 3 * d for d < 17, 3 * d - 49
    (2, 5, 8) above. Injective, so every q(t) is one float (no atomics' order to vary between two calls).
    bad = (d, value) pokes one entry."""
    g = torch.Generator().manual_seed(3)
    dp = torch.softmax(torch.randn(12, VD, generator=g) * 2, -1)
    d = torch.arange(VD)
    d2t = torch.where(3 * d < V, 2 * d, 2 * d - 49)
    if bad is not None:
        d2t[bad[0]] = bad[1]
    return dp, d2t


D2T_CASES = [
    ("past_V", (17, 200000), "verify_sampling: d2t[17] = 200000 is out of range (valid: -17..32)"),
    ("one_past_V", (19, V - 19), "verify_sampling: d2t[19] = 31 is out of range (valid: -19..30)"),
    ("below_zero", (5, -6), "verify_sampling: d2t[5] = -6 is out of range (valid: -5..44)"),
]


@pytest.mark.parametrize("case", D2T_CASES, ids=[c[0] for c in D2T_CASES])
def test_sampling_d2t_cpu(case):
    expect_cpu(walk_case("verify_sampling", q=draft_q(case[1]), temperature=(1.0, 0.7)), case[2])


def test_sampling_d2t_edges_are_valid():
    # d2t[d] = -d (target 0) and V - 1 - d (target V - 1) are in range
    dp, d2t = draft_q()
    d2t[1], d2t[2] = -1, V - 3
    call, _ = walk_case("verify_sampling", q=(dp, d2t), temperature=(1.0, 0.7))("cpu")
    call()


@pytest.mark.gpu
@pytest.mark.parametrize("case", D2T_CASES, ids=[c[0] for c in D2T_CASES])
def test_sampling_d2t_cuda(case):
    # A bad entry drops draft id d's probability from q: the outputs are those of the same call with
    # draft_probs[:, d] = 0 and d2t[d] valid (exactly: q of d's target is then 0 + 0).
    d = case[1][0]
    dp, d2t = draft_q()
    dp[:, d] = 0.0
    call, _ = walk_case("verify_sampling", q=(dp, d2t), temperature=(1.0, 0.7))("cuda")
    want = [t.cpu() for t in call()]
    eagle3_ops.check_errors()  # the valid call recorded nothing

    def check(guarded):
        for g, w, name in zip(guarded[-3:], want, WALK_OUT):
            assert_equal(g.cpu(), w, name)
    expect_cuda(walk_case("verify_sampling", q=draft_q(case[1]), temperature=(1.0, 0.7)), case[2], check)


@pytest.mark.gpu
def test_sampling_temperature_and_d2t_cuda_graph():
    expect_cuda_graph(walk_case("verify_sampling", temperature=TEMPERATURE_CASES[2][1]), TEMPERATURE_CASES[2][2])
    expect_cuda_graph(walk_case("verify_sampling", q=draft_q(D2T_CASES[0][1]), temperature=(1.0, 0.7)),
                      D2T_CASES[0][2])
