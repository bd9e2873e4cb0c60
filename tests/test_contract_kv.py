"""kv_accept's input contract (eagle3_ops/errors.py) and accept_nodes of any width.

Widths: accept_nodes [B, W] narrower than the tree (SGLang's accept index [B, steps + 1]), as wide and
wider, against an independent dense implementation (CPU) and the CPU reference (CUDA, bulk-copy and
register paths). Bad values: each violation the op checks, alone, in request 1 of three: the CPU raises
the exact message and writes nothing; CUDA skips request 1 (its rows and prefix_len untouched), moves
requests 0 and 2, and records the same message (also from a CUDA-graph replay)."""

from __future__ import annotations

import pytest
import torch

from eagle3_ops import tree
from eagle3_ops.compat.sglang import verify_tree_greedy
from tests.conftest import assert_equal
from tests.contract import expect_cpu, expect_cuda, expect_cuda_graph
from tests.test_kv_accept import (PATHS, assert_same_bits, cache_to_cuda, check_against_dense,
                                  check_cuda_against_reference, gpu_caches, i32, kv_accept, make_caches, paged_layout,
                                  random_paths)


# ---- accept_nodes of any width ------------------------------------------------------------------------

# W from the tree size N and the deepest accepted path D: SGLang's [B, steps + 1] (here steps = D), the
# tree's [B, N], wider than the tree, and wider than the 2048 rows a request may move.
WIDTHS = {"steps_plus_1": lambda N, D: D + 1, "tree": lambda N, D: N, "wider": lambda N, D: N + 5,
          "past_2048": lambda N, D: 3000}


def width_case(width, gpu=False, page_size=4):
    """Five requests, N = 8 bushy trees, accepted paths to random nodes, accept_nodes cut or padded to W
    columns (the padding is garbage: entries past accept_len are never read)."""
    g = torch.Generator().manual_seed(len(width) * page_size)
    B, N = 5, 8
    prefix = [0, 3, 13, 30, 7]
    page_table, num_pages = paged_layout(g, prefix, N, page_size)
    caches = gpu_caches(g, num_pages, page_size) if gpu else make_caches(g, num_pages, page_size)
    nodes, lens = random_paths(g, tree.random_parents(B, N, g, "bushy"))
    W = WIDTHS[width](N, int(lens.max()))
    if W <= N:
        nodes = nodes[:, :W].contiguous()
    else:
        nodes = torch.cat([nodes, torch.full((B, W - N), 2**30, dtype=torch.int32)], dim=1)
    assert width != "steps_plus_1" or W < N  # the narrow case is narrower than the tree
    return caches, page_table, i32(prefix), nodes, lens


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("page_size", [1, 4])
def test_any_width_matches_dense(width, page_size):
    check_against_dense(*width_case(width, page_size=page_size))


def test_width_one_root_only():
    # W = 1: only accept_len 0 is valid; the root stays, prefix_lens + 1.
    caches, page_table, prefix, nodes, lens = width_case("tree")
    check_against_dense(caches, page_table, prefix, nodes[:, :1].contiguous(), torch.zeros_like(lens))


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_any_width_matches_reference(width, page_size, path):
    check_cuda_against_reference(*width_case(width, gpu=True, page_size=page_size), path=path)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_cuda_width_one_root_only(path):
    caches, page_table, prefix, nodes, lens = width_case("tree", gpu=True)
    check_cuda_against_reference(caches, page_table, prefix, nodes[:, :1].contiguous(), torch.zeros_like(lens),
                                 path=path)


def sglang_case(gpu=False):
    """SGLang's verify on trees of depth <= steps: accept_index [B, steps + 1] of flat rows b * N + node,
    turned into per-request nodes (-1 past accept_token_num); plus our verify_greedy's [B, N] answer."""
    g = torch.Generator().manual_seed(31)
    B, N, V, steps = 6, 16, 3, 3
    parents = tree.random_parents(B, N, g, "beam", max_depth=steps)
    assert int(tree.depth(parents).max()) <= steps
    tokens = torch.randint(0, V, (B, N), generator=g)
    logits = torch.randn(B * N, V, generator=g)
    _, r_index, r_next, r_sib = tree.to_sglang(tokens, parents)
    predicts = torch.zeros(B * N, dtype=torch.int32)
    accept_index = torch.full((B, steps + 1), -1, dtype=torch.int32)
    num = torch.zeros(B, dtype=torch.int32)
    verify_tree_greedy(predicts, accept_index, num, tokens, r_index, r_next, r_sib, logits.argmax(-1).view(B, N))
    used = torch.arange(steps + 1) <= num[:, None]
    nodes = torch.where(used, accept_index - torch.arange(B, dtype=torch.int32)[:, None] * N, -1).int()
    tree_nodes, tree_len, _ = torch.ops.eagle3.verify_greedy(logits, tokens, parents)
    assert int(num.max()) > 0  # some rows move
    prefix = [0, 5, 17, 2, 40, 9]
    page_table, num_pages = paged_layout(g, prefix, N, 4)
    caches = gpu_caches(g, num_pages, 4) if gpu else make_caches(g, num_pages, 4)
    return caches, page_table, i32(prefix), nodes, num, tree_nodes.int(), tree_len.int()


def test_sglang_accept_index_shape():
    # The [B, steps + 1] call gives what the [B, N] call with verify_greedy's output gives.
    caches, page_table, prefix, nodes, num, tree_nodes, tree_len = sglang_case()
    assert_equal(num, tree_len, "accept_token_num vs accept_len")
    want = [c.clone() for c in caches]
    want_prefix = prefix.clone()
    kv_accept(want, page_table, want_prefix, tree_nodes, tree_len)
    check_against_dense(caches, page_table, prefix, nodes, num)
    for i, (c, w) in enumerate(zip(caches, want)):
        assert_same_bits(c, w, f"caches[{i}]")
    assert_equal(prefix, want_prefix, "prefix_lens")


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_cuda_sglang_accept_index_shape(path):
    caches, page_table, prefix, nodes, num, _, _ = sglang_case(gpu=True)
    check_cuda_against_reference(caches, page_table, prefix, nodes, num, path=path)


# ---- bad values: one violation in request 1 of three ------------------------------------------------------

# page_size 4, 6 pages a request (cap = 24 positions), 18 pages in all. Request 1: P = 7, accepted
# [0, 9, 10] (a = 2): destinations 7, 8, 9 in slots 1, 2; sources 7, 16, 17 in slots 1, 4.
CAP, NUM_PAGES = 24, 18
CASES = {
    "accept_len_past_W": (lambda a: a["lens"].__setitem__(1, 4), "accept_len[1] = 4 is out of range (valid: 0..3)"),
    "accept_len_negative": (lambda a: a["lens"].__setitem__(1, -1), "accept_len[1] = -1 is out of range (valid: 0..3)"),
    # 2048 rows at most a request, whatever W
    "accept_len_past_2048": (lambda a: a["lens"].__setitem__(1, 2048),
                             "accept_len[1] = 2048 is out of range (valid: 0..2047)"),
    "prefix_negative": (lambda a: a["prefix"].__setitem__(1, -1), "prefix_lens[1] = -1 is out of range (valid: 0..21)"),
    # P + a = 24: the last destination one past the table
    "prefix_past_table": (lambda a: a["prefix"].__setitem__(1, 22), "prefix_lens[1] = 22 is out of range (valid: 0..21)"),
    # source 7 + 17 = 24: one past the table
    "node_past_table": (lambda a: a["nodes"].__setitem__((1, 2), 17),
                        "accept_nodes[1, 2] = 17 is out of range (valid: 0..16)"),
    "node_negative": (lambda a: a["nodes"].__setitem__((1, 1), -1),
                      "accept_nodes[1, 1] = -1 is out of range (valid: 0..16)"),
    "page_of_a_source": (lambda a: a["table"].__setitem__((1, 4), NUM_PAGES),
                         "page_table[1, 4] = 18 is out of range (valid: 0..17)"),
    "page_of_a_destination": (lambda a: a["table"].__setitem__((1, 2), -3),
                              "page_table[1, 2] = -3 is out of range (valid: 0..17)"),
    "page_read_and_written": (lambda a: a["table"].__setitem__((1, 1), 2**30),
                              f"page_table[1, 1] = {2**30} is out of range (valid: 0..17)"),
}


def bad_args(case, device, mutate=None, path="bulk"):
    """Three valid requests (W = 4, or 2049 for the 2048-row case), then `case` (or `mutate`) applied to
    request 1 on the host, then moved to `device` (CUDA caches placed for `path`: cache_to_cuda)."""
    g = torch.Generator().manual_seed(21)
    W = 2049 if case == "accept_len_past_2048" else 4
    table = torch.randperm(NUM_PAGES, generator=g).view(3, 6).int()
    caches = (gpu_caches(g, NUM_PAGES, 4) if device == "cuda" else make_caches(g, NUM_PAGES, 4)[:3])
    nodes = torch.full((3, W), -1, dtype=torch.int32)
    nodes[0, :3], nodes[1, :3], nodes[2, :2] = i32([0, 1, 3]), i32([0, 9, 10]), i32([0, 2])
    a = dict(caches=caches, table=table, prefix=i32([0, 7, 13]), nodes=nodes, lens=i32([2, 2, 1]))
    (CASES[case][0] if case is not None else mutate or (lambda _: None))(a)

    def move(c):
        return cache_to_cuda(c, path) if device == "cuda" else c.to(device)
    return {k: [move(c) for c in v] if k == "caches" else v.to(device) for k, v in a.items()}


def maker(case, path="bulk"):
    def make(device):
        a = bad_args(case, device, path=path)
        return (lambda: kv_accept(a["caches"], a["table"], a["prefix"], a["nodes"], a["lens"]),
                lambda: a["caches"] + [a["prefix"]])
    return make


def skipped_request_1(case):
    """CUDA's outcome: requests 0 and 2 as the reference moves them (pages are disjoint), request 1's rows
    and prefix_len untouched."""
    a = bad_args(case, "cuda")
    want = [c.cpu() for c in a["caches"]]
    prefix = a["prefix"].cpu()
    keep = torch.tensor([0, 2])
    sub_prefix = prefix[keep].clone()
    kv_accept(want, a["table"].cpu()[keep].contiguous(), sub_prefix, a["nodes"].cpu()[keep].contiguous(),
              a["lens"].cpu()[keep].contiguous())
    prefix[keep] = sub_prefix

    def check(got):
        for i, (d, w) in enumerate(zip(got[:-1], want)):
            assert_same_bits(d.cpu(), w, f"caches[{i}]")
        assert_equal(got[-1].cpu(), prefix, "prefix_lens")
    return check


@pytest.mark.parametrize("case", list(CASES))
def test_bad_value_raises_and_writes_nothing(case):
    expect_cpu(maker(case), "kv_accept: " + CASES[case][1])


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_bad_value_skips_the_request_and_reports(case, path):
    expect_cuda(maker(case, path), "kv_accept: " + CASES[case][1], skipped_request_1(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_graph_bad_value_reports_on_replay(case):
    expect_cuda_graph(maker(case), "kv_accept: " + CASES[case][1])


def _at_the_bounds(a):
    a["prefix"][1] = CAP - 1 - 2
    a["nodes"][1, :3] = i32([0, 1, 2])
    a["nodes"][2, 1] = CAP - 1 - 13
    a["table"][1, 0], a["table"][1, 2] = -1, NUM_PAGES  # request 1 uses slot 5 only


def edge_args(device, path="bulk"):
    """Valid at every bound: request 1's last destination at cap - 1 (P = 21, a = 2, stays in place),
    request 2's source at cap - 1 - P, and slots no row uses holding anything."""
    return bad_args(None, device, _at_the_bounds, path)


def test_bounds_are_inclusive_and_unused_slots_are_not_read():
    a = edge_args("cpu")
    want = [c.clone() for c in a["caches"]]
    want_prefix = a["prefix"].clone()
    table = a["table"].clone()
    table[1, 0], table[1, 2] = 0, 1  # any valid page: request 1 never reads these slots
    kv_accept(want, table, want_prefix, a["nodes"], a["lens"])
    kv_accept(a["caches"], a["table"], a["prefix"], a["nodes"], a["lens"])
    for i, (c, w) in enumerate(zip(a["caches"], want)):
        assert_same_bits(c, w, f"caches[{i}]")
    assert_equal(a["prefix"], want_prefix, "prefix_lens")


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_cuda_bounds_are_inclusive_and_unused_slots_are_not_read(path):
    import eagle3_ops

    eagle3_ops.check_errors()
    a = edge_args("cuda", path)
    want = [c.cpu() for c in a["caches"]]
    want_prefix = a["prefix"].cpu()
    kv_accept(want, a["table"].cpu(), want_prefix, a["nodes"].cpu(), a["lens"].cpu())  # the reference
    kv_accept(a["caches"], a["table"], a["prefix"], a["nodes"], a["lens"])
    eagle3_ops.check_errors()  # nothing recorded
    for i, (d, w) in enumerate(zip(a["caches"], want)):
        assert_same_bits(d.cpu(), w, f"caches[{i}]")
    assert_equal(a["prefix"].cpu(), want_prefix, "prefix_lens")
