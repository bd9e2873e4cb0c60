"""kv_accept: the DESIGN case written out row by row, paged layouts whose moves straddle pages, several
layers per call, a random sweep against an independent dense implementation, and bad arguments that
raise and write nothing. CPU: the op dispatches to the reference. Bad values (the error word) and
accept_nodes of other widths: tests/test_contract_kv.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import eagle3_ops
from eagle3_ops import tree
from eagle3_ops.errors import Eagle3InputError
from tests.conftest import assert_equal, capture_graph

PROPERTY = settings(derandomize=True, max_examples=40, deadline=None)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


def bits(t):
    """The raw bit pattern: a move must copy bytes exactly, whatever the dtype (fp8, NaN payloads)."""
    return t.contiguous().view(_BITS[t.element_size()])


def assert_same_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{tuple(got.shape)}"
    assert_equal(bits(got), bits(want), what)


def kv_accept(caches, page_table, prefix_lens, accept_nodes, accept_len):
    torch.ops.eagle3.kv_accept(caches, page_table, prefix_lens, accept_nodes, accept_len)


# ---- the DESIGN case, every row written out ---------------------------------------------------------


def test_design_case_0_2_3():
    # One request, page size 4, pages in the order [2, 0, 1]: positions 0..3 on page 2, 4..7 on page 0,
    # 8..11 on page 1. prefix_len 2, N = 5 tree rows at positions 2..6 (the tree straddles pages 2 and 0).
    # Position p holds [p, p + 0.5] in the latent cache and [[-p, 100 + p]] in the K cache.
    # Accepted nodes [0, 2, 3] (accept_len 2): node 0 stays at 2, node 2 moves 4 -> 3 (page 0 -> page 2),
    # node 3 moves 5 -> 4; positions 5 and 6 keep their stale rows; prefix_len becomes 2 + 3 = 5.
    # A copy in reverse order (3 -> 2 before 2 -> 1) would put node 3's row at position 3.
    page_table = i32([[2, 0, 1]])
    latent = torch.empty(3, 4, 2)
    k = torch.empty(3, 4, 1, 2)
    for p in range(12):
        latent[page_table[0, p // 4], p % 4] = torch.tensor([p, p + 0.5])
        k[page_table[0, p // 4], p % 4] = torch.tensor([[-p, 100 + p]])
    prefix_lens = i32([2])
    kv_accept([latent, k], page_table, prefix_lens, i32([[0, 2, 3, -1, -1]]), i32([2]))
    want_latent = torch.tensor([
        [[5.0, 5.5], [5.0, 5.5], [6.0, 6.5], [7.0, 7.5]],      # page 0: positions 4 (node 3), 5, 6 (stale), 7
        [[8.0, 8.5], [9.0, 9.5], [10.0, 10.5], [11.0, 11.5]],  # page 1: positions 8..11, untouched
        [[0.0, 0.5], [1.0, 1.5], [2.0, 2.5], [4.0, 4.5]],      # page 2: positions 0, 1, 2 (root), 3 (node 2)
    ])
    want_k = torch.tensor([
        [[[-5.0, 105.0]], [[-5.0, 105.0]], [[-6.0, 106.0]], [[-7.0, 107.0]]],
        [[[-8.0, 108.0]], [[-9.0, 109.0]], [[-10.0, 110.0]], [[-11.0, 111.0]]],
        [[[0.0, 100.0]], [[-1.0, 101.0]], [[-2.0, 102.0]], [[-4.0, 104.0]]],
    ])
    assert_equal(latent, want_latent, "latent cache")
    assert_equal(k, want_k, "K cache")
    assert_equal(prefix_lens, i32([5]), "prefix_lens")


def test_page_size_1_three_requests_hand_worked():
    # SGLang's token layout (page size 1): every position is its own page. Three requests, prefixes
    # 0, 2 and 1, N = 3, pages interleaved. Request 0 accepts [0, 2] (2 -> 1), request 1 nothing
    # (root onto itself), request 2 the chain [0, 1, 2] (everything already in place).
    page_table = i32([[5, 0, 8, 3, 11],
                      [1, 9, 4, 12, 6],
                      [2, 10, 7, 13, 14]])
    cache = torch.arange(15.0).view(15, 1, 1) * 10  # page g holds 10 * g
    prefix_lens = i32([0, 2, 1])
    accept_nodes = i32([[0, 2, -1], [0, -1, -1], [0, 1, 2]])
    kv_accept([cache], page_table, prefix_lens, accept_nodes, i32([1, 0, 2]))
    want = torch.arange(15.0) * 10
    want[0] = 80.0  # request 0: position 1 (page 0) <- position 2 (page 8); page 8 keeps its stale row
    assert_equal(cache.view(15), want, "cache")
    assert_equal(prefix_lens, i32([2, 3, 4]), "prefix_lens")


def test_accept_len_zero_only_advances():
    # accept_len 0: the root row moves onto itself; the caches are bit-identical, prefix_lens + 1.
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(9, 4, 8, generator=g), torch.randn(9, 4, 2, 3, generator=g).bfloat16()]
    caches[0][1, 2, 3] = float("nan")
    before = [c.clone() for c in caches]
    prefix_lens = i32([0, 5, 9])  # prefix 9 + N 3 = 12 rows: exactly the 3 pages of 4
    page_table = i32([[4, 1, 7], [0, 3, 8], [2, 5, 6]])
    kv_accept(caches, page_table, prefix_lens, i32([[0, -1, -1]] * 3), i32([0, 0, 0]))
    for i, (c, b) in enumerate(zip(caches, before)):
        assert_same_bits(c, b, f"caches[{i}]")
    assert_equal(prefix_lens, i32([1, 6, 10]), "prefix_lens")


def test_all_reads_before_writes_any_order():
    # The rule is "read every accepted row, then write": it holds for any accepted list, not only for the
    # increasing paths verify produces. [0, 3, 1, 2]: position P+1 <- node 3, P+2 <- node 1 (which a
    # sequential copy would already have overwritten), P+3 <- node 2.
    cache = torch.arange(16.0).view(4, 4, 1)  # page size 4, identity page table: position p holds p
    prefix_lens = i32([3])
    kv_accept([cache], i32([[0, 1, 2, 3]]), prefix_lens, i32([[0, 3, 1, 2, -1]]), i32([3]))
    want = torch.arange(16.0)
    want[3:8] = torch.tensor([3.0, 6.0, 4.0, 5.0, 7.0])
    assert_equal(cache.view(16), want, "cache")
    assert_equal(prefix_lens, i32([7]), "prefix_lens")


# ---- random sweep against an independent implementation ----------------------------------------------


def dense_accept(caches, page_table, prefix_lens, accept_nodes, accept_len):
    """Independent: gather every request's whole page range into a dense array, permute, scatter back."""
    out = [c.clone() for c in caches]
    ps = caches[0].shape[1]
    for b in range(page_table.shape[0]):
        pos = torch.arange(page_table.shape[1] * ps)
        where = (page_table[b, pos // ps].long(), pos % ps)
        P, a = int(prefix_lens[b]), int(accept_len[b])
        for src, dst in zip(caches, out):
            rows = src[where]  # [positions, ...] of request b, before anything moved
            new = rows.clone()
            new[P:P + a + 1] = rows[P + accept_nodes[b, :a + 1].long()]
            dst[where] = new
    return out, prefix_lens + accept_len + 1


def paged_layout(g, prefix, N, page_size, spare_pages=2):
    """Shuffled, disjoint page tables with room for prefix + N (+ a spare page), plus unused pages."""
    B = len(prefix)
    per = -(-(max(prefix) + N) // page_size) + 1
    num_pages = B * per + spare_pages
    pages = torch.randperm(num_pages, generator=g)[:B * per].view(B, per).to(torch.int32)
    return pages, num_pages


def random_paths(g, parents):
    """A root-first path to a random node per request (what verify accepts), -1 padded."""
    B, N = parents.shape
    target = torch.randint(0, N, (B,), generator=g)
    depth = tree.depth(parents)
    accept_nodes = torch.full((B, N), -1, dtype=torch.int32)
    accept_len = torch.empty(B, dtype=torch.int32)
    for b in range(B):
        path, j = [], int(target[b])
        while j != -1:
            path.append(j)
            j = int(parents[b, j])
        accept_nodes[b, :len(path)] = torch.tensor(path[::-1], dtype=torch.int32)
        accept_len[b] = int(depth[b, int(target[b])])
    return accept_nodes, accept_len


def make_caches(g, num_pages, page_size):
    """Several layers in one call: an MLA latent layer (D = 576) and K / V layers, mixed dtypes."""
    return [
        torch.randn(num_pages, page_size, 576, generator=g).bfloat16(),          # MLA latent [c_kv | k_pe]
        torch.randn(num_pages, page_size, 2, 8, generator=g),                    # K: HKV = 2, Dh = 8
        torch.randn(num_pages, page_size, 2, 8, generator=g).half(),             # V
        torch.randn(num_pages, page_size, 576, generator=g).to(torch.float8_e4m3fn),  # an fp8 latent layer
    ]


def check_against_dense(caches, page_table, prefix_lens, accept_nodes, accept_len):
    """kv_accept in place, compared bit for bit with the independent dense implementation."""
    want_caches, want_prefix = dense_accept(caches, page_table, prefix_lens, accept_nodes, accept_len)
    kv_accept(caches, page_table, prefix_lens, accept_nodes, accept_len)
    for i, (c, w) in enumerate(zip(caches, want_caches)):
        assert_same_bits(c, w, f"caches[{i}]")
    assert_equal(prefix_lens, want_prefix, "prefix_lens")


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1),
       page_size=st.sampled_from([1, 4, 16]),           # SGLang's token layout, small pages, a typical page
       B=st.sampled_from([1, 3]),
       N=st.sampled_from([1, 2, 7, 64]),                # root only, one draft, odd, a large tree
       kind=st.sampled_from(["bushy", "chain", "beam"]))
def test_random_sweep_matches_dense(seed, page_size, B, N, kind):
    g = torch.Generator().manual_seed(seed)
    prefix = [0, 13, 5][:B] if B == 3 else [int(torch.randint(0, 40, (1,), generator=g))]  # ragged, with 0
    page_table, num_pages = paged_layout(g, prefix, N, page_size)
    caches = make_caches(g, num_pages, page_size)
    parents = tree.random_parents(B, N, g, kind)
    accept_nodes, accept_len = random_paths(g, parents)
    check_against_dense(caches, page_table, i32(prefix), accept_nodes, accept_len)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_moves_straddle_pages(page_size):
    # Long accepted chains under shuffled page tables: some rows must move to a different physical page
    # than they came from; checked against the dense implementation, with every request moving.
    g = torch.Generator().manual_seed(page_size)
    B, N = 3, 33
    prefix = [0, 7, 30]
    page_table, num_pages = paged_layout(g, prefix, N, page_size)
    caches = make_caches(g, num_pages, page_size)
    parents = tree.random_parents(B, N, g, "bushy")
    depth = tree.depth(parents)
    accept_nodes, accept_len = torch.full((B, N), -1, dtype=torch.int32), torch.empty(B, dtype=torch.int32)
    for b in range(B):  # the path to the deepest node
        path, j = [], int(depth[b].argmax())
        while j != -1:
            path.append(j)
            j = int(parents[b, j])
        accept_nodes[b, :len(path)] = torch.tensor(path[::-1], dtype=torch.int32)
        accept_len[b] = len(path) - 1
    assert int(accept_len.min()) >= 2
    straddles = 0
    for b in range(B):
        for i in range(int(accept_len[b]) + 1):
            src, dst = prefix[b] + int(accept_nodes[b, i]), prefix[b] + i
            straddles += int(page_table[b, src // page_size] != page_table[b, dst // page_size])
    assert straddles > 0
    check_against_dense(caches, page_table, i32(prefix), accept_nodes, accept_len)


def test_entries_beyond_accept_len_are_never_read():
    # Only accept_nodes[b, :accept_len + 1] is used: garbage (even out of range) beyond it changes nothing.
    g = torch.Generator().manual_seed(3)
    prefix, N, ps = [2, 9], 6, 4
    page_table, num_pages = paged_layout(g, prefix, N, ps)
    caches = make_caches(g, num_pages, ps)
    accept_nodes = i32([[0, 1, 4, -1, -1, -1], [0, 3, -1, -1, -1, -1]])
    accept_len = i32([2, 1])
    want_caches, want_prefix = dense_accept(caches, page_table, i32(prefix), accept_nodes, accept_len)
    garbage = i32([[0, 1, 4, 99, -7, 2**30], [0, 3, 6, -1, 5, 4]])
    prefix_lens = i32(prefix)
    kv_accept(caches, page_table, prefix_lens, garbage, accept_len)
    for i, (c, w) in enumerate(zip(caches, want_caches)):
        assert_same_bits(c, w, f"caches[{i}]")
    assert_equal(prefix_lens, want_prefix, "prefix_lens")


# ---- bad arguments: raise naming the argument, write nothing ----------------------------------------------


def _valid_case():
    """Three requests, three layers, N = 5: valid arguments for the argument checks below."""
    g = torch.Generator().manual_seed(11)
    prefix, N, ps = [0, 5, 11], 5, 4
    page_table, num_pages = paged_layout(g, prefix, N, ps)
    caches = make_caches(g, num_pages, ps)[:3]
    accept_nodes = i32([[0, 1, 3, -1, -1], [0, 2, 4, -1, -1], [0, 1, -1, -1, -1]])
    accept_len = i32([2, 2, 1])
    return caches, page_table, i32(prefix), accept_nodes, accept_len


def test_page_table_exactly_full_is_fine():
    # The boundary of the capacity check: the last accepted source at max_pages * page_size - 1 is allowed.
    caches, page_table, prefix_lens, accept_nodes, accept_len = _valid_case()
    prefix_lens[1] = page_table.shape[1] * 4 - 5
    want_caches, want_prefix = dense_accept(caches, page_table, prefix_lens, accept_nodes, accept_len)
    kv_accept(caches, page_table, prefix_lens, accept_nodes, accept_len)
    for i, (c, w) in enumerate(zip(caches, want_caches)):
        assert_same_bits(c, w, f"caches[{i}]")
    assert_equal(prefix_lens, want_prefix, "prefix_lens")


def _break_argument(case, caches, page_table, prefix_lens, accept_nodes, accept_len):
    """The arguments with one of them made invalid in the way `case` names (shape, dtype, layout, device)."""
    caches = list(caches)
    if case == "no_caches":
        caches = []
    elif case == "page_layout":
        caches[1] = caches[1][:, :2].contiguous()
    elif case == "non_contiguous":
        caches[2] = caches[2].transpose(2, 3)
    elif case == "accept_len_dtype":
        accept_len = accept_len.long()
    elif case == "accept_nodes_dtype":
        accept_nodes = accept_nodes.long()
    elif case == "prefix_lens_shape":
        prefix_lens = prefix_lens[:2]
    elif case == "page_table_dtype":
        page_table = page_table.long()
    elif case == "page_table_cpu":
        page_table = page_table.cpu()
    elif case == "cache_cpu":
        caches[2] = caches[2].cpu()
    return caches, page_table, prefix_lens, accept_nodes, accept_len


@pytest.mark.parametrize("case, error, match", [
    ("no_caches", TypeError, "caches must be a non-empty list"),
    ("page_layout", ValueError, r"caches\[1\] must have shape"),
    ("non_contiguous", ValueError, r"caches\[2\] must be contiguous"),
    ("accept_len_dtype", TypeError, "accept_len must have dtype"),
    ("accept_nodes_dtype", TypeError, "accept_nodes must have dtype"),
    ("prefix_lens_shape", ValueError, "prefix_lens must have shape"),
    ("page_table_dtype", TypeError, "page_table must have dtype"),
])
def test_bad_arguments(case, error, match):
    caches, page_table, prefix_lens, accept_nodes, accept_len = _valid_case()
    before = [c.clone() for c in caches]
    caches, page_table, prefix_lens, accept_nodes, accept_len = _break_argument(
        case, caches, page_table, prefix_lens, accept_nodes, accept_len)
    with pytest.raises(error, match=match):
        kv_accept(caches, page_table, prefix_lens, accept_nodes, accept_len)
    if case != "no_caches":
        assert_same_bits(caches[0], before[0], "caches[0]")


# ---- CUDA kernel (csrc/kv_accept.cu) against the reference -----------------------------------------------


def gpu_caches(g, num_pages, page_size, mla_layers=1):
    """Layers of every row layout the kernel handles, one launch group each: MLA latent rows (576 bf16,
    16-byte units), fp8 e4m3 latent rows (576 bytes: 36 16-byte units, their own launch group), GQA K / V rows
    (2 x 8 fp16), 12-byte fp32 rows (4-byte units) and 5-byte fp8 rows (1-byte units); values random (NaN
    payloads included) so that only exact byte copies pass."""
    caches = [torch.randn(num_pages, page_size, 576, generator=g).bfloat16() for _ in range(mla_layers)]
    caches += [(torch.randn(num_pages, page_size, 576, generator=g) * 100).to(torch.float8_e4m3fn)]
    caches += [torch.randn(num_pages, page_size, 2, 8, generator=g).half(),
               torch.randn(num_pages, page_size, 2, 8, generator=g).half(),
               torch.randn(num_pages, page_size, 3, generator=g),
               torch.randn(num_pages, page_size, 5, generator=g).to(torch.float8_e4m3fn)]
    caches[-2].view(-1)[::7] = float("nan")
    return caches


# The two copy paths of the CUDA kernel: 16-byte rows take the bulk-copy (TMA) path on sm_90, others (and every
# row below sm_90) the register path; PATHS names them for tests that run both on one H200.
PATHS = ["bulk", "registers"]


def cache_to_cuda(cache, path="bulk"):
    """cache on the GPU. path "registers": its data pointer 8 bytes past a 16-byte boundary, so that no row has
    16-byte units and every layer takes the register path, on sm_90 too (the bulk path needs 16-byte aligned rows;
    the register kernel is the same code for every unit width)."""
    if path == "bulk":
        return cache.cuda()
    nbytes = cache.numel() * cache.element_size()
    dev = torch.empty(nbytes + 8, dtype=torch.uint8, device="cuda")[8:].view(cache.dtype).view(cache.shape)
    assert dev.data_ptr() % 16 == 8
    return dev.copy_(cache)


def check_cuda_against_reference(caches, page_table, prefix_lens, accept_nodes, accept_len, path="bulk"):
    """The CUDA op on copies of the inputs (caches placed for `path`: cache_to_cuda), compared bit for bit with the
    CPU reference on the originals."""
    want = [c.clone() for c in caches]
    want_prefix = prefix_lens.clone()
    dev = [cache_to_cuda(c, path) for c in caches]
    got_prefix = prefix_lens.cuda()
    kv_accept(dev, page_table.cuda(), got_prefix, accept_nodes.cuda(), accept_len.cuda())
    kv_accept(want, page_table, want_prefix, accept_nodes, accept_len)  # the reference (CPU dispatch)
    for i, (d, w) in enumerate(zip(dev, want)):
        assert_same_bits(d.cpu(), w, f"caches[{i}]")
    assert_equal(got_prefix.cpu(), want_prefix, "prefix_lens")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])           # SGLang's token layout, typical pages, big pages
@pytest.mark.parametrize("B", [1, 7, 64])                    # one request, odd, a full verify batch
@pytest.mark.parametrize("N", [1, 2, 8, 64])                 # root only, one draft, EAGLE-3 default, large
@pytest.mark.parametrize("kind", ["chain", "bushy"])         # nothing moves; deep paths whose rows move
def test_cuda_random_sweep_matches_reference(page_size, B, N, kind):
    g = torch.Generator().manual_seed(1000 * page_size + 10 * B + N)
    prefix = torch.randint(0, 3 * page_size + 5, (B,), generator=g).tolist()  # ragged; pages straddled
    page_table, num_pages = paged_layout(g, prefix, N, page_size)
    caches = gpu_caches(g, num_pages, page_size)
    parents = tree.random_parents(B, N, g, kind)
    accept_nodes, accept_len = random_paths(g, parents)
    check_cuda_against_reference(caches, page_table, i32(prefix), accept_nodes, accept_len)


@pytest.mark.gpu
@pytest.mark.parametrize("accepted", [[0, 2, 3], [0, 3, 1, 2], [0, 2, 4, 6, 7], [4, 3, 2, 1, 0]])
@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_cuda_overlapping_moves(accepted, page_size):
    # The DESIGN case (2 -> 1 and 3 -> 2), an order verify never produces but the op allows, the
    # benchmark's all-moving pattern, and a reversal (every row both read and overwritten).
    g = torch.Generator().manual_seed(len(accepted) * page_size)
    B, N = 5, 8
    prefix = [0, 3, 13, 62, 64]
    page_table, num_pages = paged_layout(g, prefix, N, page_size)
    caches = gpu_caches(g, num_pages, page_size, mla_layers=3)
    accept_nodes = torch.full((B, N), -1, dtype=torch.int32)
    accept_nodes[:, :len(accepted)] = i32(accepted)
    accept_len = torch.full((B,), len(accepted) - 1, dtype=torch.int32)
    check_cuda_against_reference(caches, page_table, i32(prefix), accept_nodes, accept_len)


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [61, 130])  # Kimi-K2 (one launch), more than one launch holds (two)
def test_cuda_many_layers(layers):
    g = torch.Generator().manual_seed(layers)
    B, N, ps = 7, 8, 16
    prefix = [0, 15, 16, 100, 3, 47, 200]
    page_table, num_pages = paged_layout(g, prefix, N, ps)
    caches = [torch.randn(num_pages, ps, 576, generator=g).bfloat16() for _ in range(layers)]
    parents = tree.random_parents(B, N, g, "bushy")
    accept_nodes, accept_len = random_paths(g, parents)
    check_cuda_against_reference(caches, page_table, i32(prefix), accept_nodes, accept_len)


@pytest.mark.gpu
def test_cuda_large_tree_moves_every_row():
    # N = 2048 (the most rows a request may move): a chain whose rows are all accepted in reverse order,
    # 2048 moving rows of one column in one round.
    g = torch.Generator().manual_seed(5)
    B, N, ps = 2, 2048, 64
    prefix = [5, 70]
    page_table, num_pages = paged_layout(g, prefix, N, ps)
    caches = [torch.randn(num_pages, ps, 576, generator=g).bfloat16(), torch.randn(num_pages, ps, 3, generator=g)]
    accept_nodes = torch.arange(N - 1, -1, -1, dtype=torch.int32).repeat(B, 1)
    accept_len = torch.full((B,), N - 1, dtype=torch.int32)
    check_cuda_against_reference(caches, page_table, i32(prefix), accept_nodes, accept_len)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("N", [8, 64, 512])  # whole rows staged; rows cut into chunks (N x 1152 > 48 KB)
def test_cuda_both_copy_paths(path, N):
    # 16-byte rows take the bulk-copy (TMA) path on sm_90; caches 8 bytes off a 16-byte boundary send the same
    # rows through the register path instead (cache_to_cuda), so both are checked on the same H200. Large N makes
    # the bulk path split each row into column chunks (a column's N rows must fit the 48 KB staging buffer).
    g = torch.Generator().manual_seed(N)
    B, ps = 5, 16
    prefix = [0, 1, 17, 33, 250]
    page_table, num_pages = paged_layout(g, prefix, N, ps)
    caches = gpu_caches(g, num_pages, ps, mla_layers=3)
    accept_nodes = torch.full((B, N), -1, dtype=torch.int32)
    accept_len = torch.empty(B, dtype=torch.int32)
    for b in range(B):  # every request accepts a random subset in order: most rows move, sources overlap
        keep = torch.randperm(N - 1, generator=g)[:int(torch.randint(0, N, (1,), generator=g))] + 1
        path_b = [0] + sorted(keep.tolist())
        accept_nodes[b, :len(path_b)] = i32(path_b)
        accept_len[b] = len(path_b) - 1
    check_cuda_against_reference(caches, page_table, i32(prefix), accept_nodes, accept_len, path)


@pytest.mark.gpu
def test_cuda_two_calls_back_to_back_in_one_graph():
    # The second call reads the first's prefix_lens and rows: two calls captured in one graph must equal two
    # reference calls.
    g = torch.Generator().manual_seed(77)
    B, N, ps = 6, 8, 16
    prefix = [0, 9, 31, 2, 16, 40]
    page_table, num_pages = paged_layout(g, prefix, 2 * N, ps)
    caches = gpu_caches(g, num_pages, ps, mla_layers=3)
    nodes, lens = random_paths(g, tree.random_parents(B, N, g, "bushy"))
    dev = [c.cuda() for c in caches]
    pt, pl, dn, dl = page_table.cuda(), i32(prefix).cuda(), nodes.cuda(), lens.cuda()
    graph, _ = capture_graph(lambda: (kv_accept(dev, pt, pl, dn, dl), kv_accept(dev, pt, pl, dn, dl)))
    for d, c in zip(dev, caches):  # capture_graph ran the calls once while warming up: start again
        d.copy_(c)
    pl.copy_(i32(prefix))
    graph.replay()
    want, want_prefix = [c.clone() for c in caches], i32(prefix)
    kv_accept(want, page_table, want_prefix, nodes, lens)
    kv_accept(want, page_table, want_prefix, nodes, lens)
    for i, (d, w) in enumerate(zip(dev, want)):
        assert_same_bits(d.cpu(), w, f"caches[{i}]")
    assert_equal(pl.cpu(), want_prefix, "prefix_lens")


def _skip_expected(caches, page_table, prefix_lens, accept_nodes, accept_len, bad):
    """What the CUDA op gives when request `bad` is skipped: the reference on the other requests (pages
    are disjoint), request `bad`'s rows and prefix_len untouched."""
    keep = [b for b in range(page_table.shape[0]) if b != bad]
    want = [c.clone() for c in caches]
    sub_prefix = prefix_lens[keep].clone()
    kv_accept(want, page_table[keep].contiguous(), sub_prefix, accept_nodes[keep].contiguous(),
              accept_len[keep].contiguous())
    want_prefix = prefix_lens.clone()
    want_prefix[keep] = sub_prefix
    return want, want_prefix


@pytest.mark.gpu
@pytest.mark.parametrize("case, error, match", [
    ("no_caches", TypeError, "caches must be a non-empty list"),
    ("page_layout", ValueError, r"caches\[1\] must have shape"),             # mismatched layer shapes
    ("non_contiguous", ValueError, r"caches\[2\] must be contiguous"),
    ("accept_len_dtype", TypeError, "accept_len must have dtype"),
    ("accept_nodes_dtype", TypeError, "accept_nodes must have dtype"),
    ("prefix_lens_shape", ValueError, "prefix_lens must have shape"),
    ("page_table_dtype", TypeError, "page_table must have dtype"),
    ("page_table_cpu", ValueError, "page_table must be on the same device"),
    ("cache_cpu", ValueError, r"caches\[2\] must be on the same device"),
])
def test_cuda_bad_arguments_raise_before_any_write(case, error, match):
    caches, page_table, prefix_lens, accept_nodes, accept_len = _valid_case()
    caches, page_table, prefix_lens = [c.cuda() for c in caches], page_table.cuda(), prefix_lens.cuda()
    accept_nodes, accept_len = accept_nodes.cuda(), accept_len.cuda()
    before = [c.clone() for c in caches]
    prefix_before = prefix_lens.clone()
    with pytest.raises(error, match=match):
        kv_accept(*_break_argument(case, caches, page_table, prefix_lens, accept_nodes, accept_len))
    torch.cuda.synchronize()
    for i, (c, b) in enumerate(zip(caches, before)):
        assert_same_bits(c.cpu(), b.cpu(), f"caches[{i}]")
    assert_equal(prefix_lens.cpu(), prefix_before.cpu(), "prefix_lens")


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_values():
    # Captured once; each replay sees new cache contents, a new page table, new prefixes and new accepted
    # paths at the same addresses, and must match the reference on those values.
    g = torch.Generator().manual_seed(21)
    B, N, ps = 7, 8, 16
    prefix = [0, 9, 31, 2, 16, 40, 5]
    page_table, num_pages = paged_layout(g, prefix, N, ps, spare_pages=6)
    caches = gpu_caches(g, num_pages, ps, mla_layers=2)
    dev = [c.cuda() for c in caches]
    pt, pl = page_table.cuda(), i32(prefix).cuda()
    nodes, lens = torch.zeros(B, N, dtype=torch.int32, device="cuda"), torch.zeros(B, dtype=torch.int32, device="cuda")
    graph, _ = capture_graph(lambda: kv_accept(dev, pt, pl, nodes, lens))
    for step in range(3):
        new_prefix = torch.randint(0, 2 * ps, (B,), generator=g, dtype=torch.int32)
        new_table = torch.randperm(num_pages, generator=g)[:page_table.numel()].view(page_table.shape).int()
        new_caches = gpu_caches(g, num_pages, ps, mla_layers=2)
        new_nodes, new_lens = random_paths(g, tree.random_parents(B, N, g, "bushy"))
        for d, c in zip(dev, new_caches):
            d.copy_(c)
        pt.copy_(new_table)
        pl.copy_(new_prefix)
        nodes.copy_(new_nodes)
        lens.copy_(new_lens)
        graph.replay()
        kv_accept(new_caches, new_table, new_prefix, new_nodes, new_lens)  # reference
        for i, (d, w) in enumerate(zip(dev, new_caches)):
            assert_same_bits(d.cpu(), w, f"replay {step}: caches[{i}]")
        assert_equal(pl.cpu(), new_prefix, f"replay {step}: prefix_lens")


@pytest.mark.gpu
def test_cuda_sanitize_kv_accept_small():
    # Small enough for compute-sanitizer memcheck (gpu_run.sh SANITIZE='cuda_sanitize'): every unit width,
    # overlapping moves, a chain that moves nothing, a request skipped for a page past the pool.
    g = torch.Generator().manual_seed(8)
    N, ps = 6, 4  # B = 4 requests below
    prefix = [0, 5, 11, 2]
    page_table, num_pages = paged_layout(g, prefix, N, ps)
    caches = gpu_caches(g, num_pages, ps)
    accept_nodes = i32([[0, 2, 3, -1, -1, -1], [0, 1, 2, 3, 4, 5], [0, 3, 1, 2, -1, -1], [0, 4, -1, -1, -1, -1]])
    accept_len = i32([2, 5, 3, 1])
    check_cuda_against_reference(caches, page_table, i32(prefix), accept_nodes, accept_len)
    page_table[3, 1] = num_pages  # request 3's tree rows live on a page that does not exist
    want, want_prefix = _skip_expected(caches, page_table, i32(prefix), accept_nodes, accept_len, bad=3)
    dev, got_prefix = [c.cuda() for c in caches], i32(prefix).cuda()
    eagle3_ops.check_errors()
    kv_accept(dev, page_table.cuda(), got_prefix, accept_nodes.cuda(), accept_len.cuda())
    for i, (d, w) in enumerate(zip(dev, want)):
        assert_same_bits(d.cpu(), w, f"caches[{i}]")
    assert_equal(got_prefix.cpu(), want_prefix, "prefix_lens")
    with pytest.raises(Eagle3InputError, match=rf"^kv_accept: page_table\[3, 1\] = {num_pages} is out of range"):
        eagle3_ops.check_errors()
