"""tree_attention_mla and tree_attention (GQA/MHA): paged tree-verify attention against an independent
float64 formulation: every request's cache rows laid out densely through the page table, a dense
[N, prefix + N] bool mask from our own ancestor walk over the parents, then scaled_dot_product_attention in
float64 with that boolean mask (and an explicit log-sum-exp for lse)."""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import eagle3_ops
from eagle3_ops import tree
from eagle3_ops.errors import Eagle3InputError
from tests.conftest import TOLERANCES, assert_equal, capture_graph, poison_, rel_err, skip_unless_sm90_kernel

KIMI_SCALE = 0.130861  # docs/models.md: 192 ** -0.5 * m * m for Kimi-K2, never 576 ** -0.5


# ---- the independent formulation ---------------------------------------------------------------------


def _ancestor_walk(parents_b: list[int]) -> torch.Tensor:
    """[N, N] bool: row i sees node j iff j is i or an ancestor of i (walking parent links)."""
    N = len(parents_b)
    dense = torch.zeros(N, N, dtype=torch.bool)
    for i in range(N):
        j = i
        while j != -1:
            dense[i, j] = True
            j = parents_b[j]
    return dense


def _dense_rows(cache: torch.Tensor, page_table_b: list[int], length: int) -> torch.Tensor:
    """The first `length` positions of one request, [length, ...], looked up one position at a time."""
    ps = cache.shape[1]
    return torch.stack([cache[page_table_b[p // ps], p % ps] for p in range(length)]) if length else \
        cache.new_empty((0,) + tuple(cache.shape[2:]))


def _truth64(q, k_cache, v_cache, page_table, prefix_lens, parents, scale, Dv=None):
    """out [B*N, NH, Dv] and lse [B*N, NH] in float64. MLA when v_cache is None (V = first Dv dims of K)."""
    B, N = parents.shape
    outs, lses = [], []
    for b in range(B):
        P = int(prefix_lens[b])
        pt = page_table[b].tolist()
        visible = torch.cat([torch.ones(N, P, dtype=torch.bool), _ancestor_walk(parents[b].tolist())], dim=1)
        k = _dense_rows(k_cache, pt, P + N).double()
        if v_cache is None:  # MLA: one latent head [L, D]
            k = k[:, None, :]
            v = k[..., :Dv]
        else:
            v = _dense_rows(v_cache, pt, P + N).double()
        qb = q[b * N:(b + 1) * N].double()  # [N, NH, D]
        o = F.scaled_dot_product_attention(qb.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=visible, scale=scale, enable_gqa=True)[0]  # [NH, N, Dv]
        outs.append(o.transpose(0, 1))
        # lse: log of the sum over visible positions of exp(scale * q.k), head by head
        group = qb.shape[1] // k.shape[1]
        lse = torch.empty(N, qb.shape[1], dtype=torch.float64)
        for h in range(qb.shape[1]):
            s = (qb[:, h] @ k[:, h // group].T) * scale
            s = torch.where(visible, s, -math.inf)
            m = s.max(dim=1).values
            lse[:, h] = m + torch.log(torch.exp(s - m[:, None]).sum(dim=1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


# ---- cases -------------------------------------------------------------------------------------------


def _layout(gen, prefixes, N, page_size, spare=2):
    """A shuffled page table with exactly the pages each request needs, plus spare pages nobody uses
    (unused table entries point at a spare page). Returns page_table, num_pages, visible [P, ps] bool."""
    B = len(prefixes)
    need = [-(-(p + N) // page_size) for p in prefixes]
    num_pages = sum(need) + spare
    perm = torch.randperm(num_pages, generator=gen).tolist()
    page_table = torch.full((B, max(need) + 1), perm[-1], dtype=torch.int32)
    used = torch.zeros(num_pages, page_size, dtype=torch.bool)
    k = 0
    for b, n in enumerate(need):
        page_table[b, :n] = torch.tensor(perm[k:k + n], dtype=torch.int32)
        k += n
        for p in range(prefixes[b] + N):
            used[page_table[b, p // page_size], p % page_size] = True
    return page_table, num_pages, used


class Case:
    def __init__(self, gen, *, mla, prefixes, N, kind, page_size, NH, D, Dv, HKV=1, dtype=torch.float32,
                 scale=None):
        self.mla, self.N, self.NH, self.Dv, self.dtype = mla, N, NH, Dv, dtype
        B = len(prefixes)
        self.parents = tree.random_parents(B, N, gen, kind)
        self.tree_mask = tree.tree_mask(self.parents)
        self.prefix_lens = torch.tensor(prefixes, dtype=torch.int32)
        self.page_table, P, self.used = _layout(gen, prefixes, N, page_size)
        self.scale = scale if scale is not None else D ** -0.5
        self.q = torch.randn(B * N, NH, D, generator=gen).to(dtype)
        if mla:
            self.k_cache = torch.randn(P, page_size, D, generator=gen).to(dtype)
            self.v_cache = None
        else:
            self.k_cache = torch.randn(P, page_size, HKV, D, generator=gen).to(dtype)
            self.v_cache = torch.randn(P, page_size, HKV, Dv, generator=gen).to(dtype)

    def run(self, with_lse=True):
        out = poison_(torch.empty(self.q.shape[0], self.NH, self.Dv, dtype=self.dtype, device=self.q.device))
        lse = poison_(torch.empty(self.q.shape[0], self.NH, device=self.q.device)) if with_lse else None
        common = (self.page_table, self.prefix_lens, self.tree_mask, self.scale, out, lse)
        if self.mla:
            torch.ops.eagle3.tree_attention_mla(self.q, self.k_cache, *common)
        else:
            torch.ops.eagle3.tree_attention(self.q, self.k_cache, self.v_cache, *common)
        assert not torch.isnan(out).any(), f"out not fully written: first NaN at {tuple(torch.isnan(out).nonzero()[0])}"
        if lse is not None:
            assert not torch.isnan(lse).any(), "lse not fully written"
        return out, lse

    def truth(self):
        return _truth64(self.q, self.k_cache, self.v_cache, self.page_table, self.prefix_lens, self.parents,
                        self.scale, self.Dv)

    def check(self):
        out, lse = self.run()
        ref_out, ref_lse = self.truth()
        err = rel_err(out, ref_out)
        assert err <= TOLERANCES[self.dtype], f"out: rel err {err:.3g}"
        lse_tol = TOLERANCES[torch.float64 if self.dtype == torch.float64 else torch.float32]
        assert lse.dtype == torch.float32
        assert rel_err(lse, ref_lse) <= max(lse_tol, 1e-6), f"lse: rel err {rel_err(lse, ref_lse):.3g}"
        return out, lse


PREFIXES = {
    "prefix0": [0, 0, 0],  # the tree is everything: only mask bits decide
    "prefix1": [1, 1, 1],  # one verified token
    "ragged": [0, 17, 70],  # within one batch; crosses page boundaries at page sizes 16 and 64
}
TREES = [(1, "chain"),  # plain decode: one node per request
         (7, "chain"),  # a chain is a causal block
         (7, "bushy"),
         (33, "bushy"),  # two mask words
         (33, "chain")]  # bit 31 (the int32 sign bit) and word 1 both used


@pytest.mark.parametrize("page_size", [1, 16, 64])  # SGLang's token layout, typical, large
@pytest.mark.parametrize("prefix", list(PREFIXES))
@pytest.mark.parametrize("N, kind", TREES)
def test_mla_against_float64(gen, page_size, prefix, N, kind):
    Case(gen, mla=True, prefixes=PREFIXES[prefix], N=N, kind=kind, page_size=page_size, NH=4, D=40, Dv=32).check()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("prefix", list(PREFIXES))
@pytest.mark.parametrize("N, kind", TREES)
def test_gqa_against_float64(gen, page_size, prefix, N, kind):
    # NH / HKV = 4, and Dv != Dh so that K and V widths cannot be confused
    Case(gen, mla=False, prefixes=PREFIXES[prefix], N=N, kind=kind, page_size=page_size, NH=8, HKV=2, D=16,
         Dv=24).check()


def test_mha(gen):
    # NH == HKV: every query head has its own KV head
    Case(gen, mla=False, prefixes=[3, 0, 9], N=7, kind="bushy", page_size=4, NH=4, HKV=4, D=8, Dv=8).check()


@pytest.mark.parametrize("mla", [True, False])
@pytest.mark.parametrize("kind", ["chain", "bushy"])
def test_n64_second_word_ancestors(gen, mla, kind):
    # N = 64: nodes past 32 have ancestors in mask word 1 (with N = 33 only node 32 lives there, a leaf).
    kw = dict(NH=4, D=40, Dv=32) if mla else dict(NH=8, HKV=2, D=16, Dv=24)
    Case(gen, mla=mla, prefixes=[0, 17, 70], N=64, kind=kind, page_size=16, **kw).check()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("mla", [True, False])
def test_dtypes(gen, dtype, mla):
    kw = dict(NH=4, D=40, Dv=32) if mla else dict(NH=8, HKV=2, D=16, Dv=16)
    Case(gen, mla=mla, prefixes=[5, 0, 20], N=7, kind="bushy", page_size=16, dtype=dtype, **kw).check()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_kimi_shape(gen, dtype):
    # The real Kimi-K2 verify shape: 64 heads of [q_abs | q_pe] = 576 over one latent head, V = first 512
    # dims, Kimi's softmax scale; a small batch and tree.
    Case(gen, mla=True, prefixes=[5, 40], N=7, kind="bushy", page_size=16, NH=64, D=576, Dv=512, dtype=dtype,
         scale=KIMI_SCALE).check()


@pytest.mark.parametrize("mla", [True, False])
def test_hand_built_tree_uniform_attention(mla):
    # q = 0: every visible position gets the same weight, so out = mean of the visible V rows and
    # lse = log(number of visible positions) = log(prefix + depth + 1). Tree: 0 -> {1, 2}, 1 -> {3}, 2 -> {4}.
    parents = torch.tensor([[-1, 0, 0, 1, 2]], dtype=torch.int32)
    N, P, ps = 5, 3, 2
    page_table = torch.tensor([[3, 0, 2, 1]], dtype=torch.int32)  # positions 0..7 on pages 3, 0, 2, 1
    D = 2
    rows = torch.arange(8, dtype=torch.float32)  # V value at position p = p (exact means)
    cache = torch.full((4, ps, D), float("nan"))
    for p in range(8):
        cache[page_table[0, p // ps], p % ps] = torch.tensor([rows[p], -rows[p]])
    q = torch.zeros(N, 2, D)
    out = poison_(torch.empty(N, 2, D))
    lse = poison_(torch.empty(N, 2))
    args = (page_table, torch.tensor([P], dtype=torch.int32), tree.tree_mask(parents), 0.5, out, lse)
    if mla:
        torch.ops.eagle3.tree_attention_mla(q, cache, *args)
    else:
        torch.ops.eagle3.tree_attention(q, cache[:, :, None, :], cache[:, :, None, :], *args)
    visible = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4]}
    for i, nodes in visible.items():
        pos = list(range(P)) + [P + j for j in nodes]
        mean = sum(pos) / len(pos)
        assert torch.allclose(out[i], torch.tensor([[mean, -mean]] * 2), rtol=1e-6, atol=1e-6), f"node {i}"
        assert torch.allclose(lse[i], torch.full((2,), math.log(len(pos))), rtol=1e-6), f"lse of node {i}"


@pytest.mark.parametrize("mla", [True, False])
def test_single_node_without_prefix_returns_its_own_value(gen, mla):
    # N = 1, prefix 0: softmax over one position is exactly 1, so out is the node's own V row, bit-exact.
    kw = dict(NH=4, D=40, Dv=32) if mla else dict(NH=4, HKV=2, D=16, Dv=8)
    c = Case(gen, mla=mla, prefixes=[0, 0, 0], N=1, kind="chain", page_size=16, **kw)
    out, _ = c.run()
    for b in range(3):
        page = int(c.page_table[b, 0])
        if mla:
            v = c.k_cache[page, 0, :c.Dv].expand(c.NH, -1)
        else:
            v = c.v_cache[page, 0].repeat_interleave(c.NH // c.v_cache.shape[2], dim=0)
        assert_equal(out[b], v, f"request {b}")


@pytest.mark.parametrize("mla", [True, False])
def test_lse_none_gives_the_same_out(gen, mla):
    kw = dict(NH=4, D=40, Dv=32) if mla else dict(NH=8, HKV=2, D=16, Dv=24)
    c = Case(gen, mla=mla, prefixes=[2, 9, 0], N=7, kind="bushy", page_size=4, **kw)
    with_lse, _ = c.run(with_lse=True)
    without, _ = c.run(with_lse=False)
    assert_equal(without, with_lse)


@pytest.mark.parametrize("mla", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_rows_outside_the_visible_set_do_not_matter(gen, mla, page_size):
    kw = dict(NH=4, D=40, Dv=32) if mla else dict(NH=8, HKV=2, D=16, Dv=24)
    c = Case(gen, mla=mla, prefixes=[0, 17, 5], N=7, kind="bushy", page_size=page_size, **kw)
    out, lse = c.run()
    caches = [c.k_cache] + ([] if mla else [c.v_cache])
    # 1. Rows no query may see (beyond prefix + N, spare pages, pages behind unused table entries):
    #    anything, even NaN, leaves the result bit-identical.
    for cache in caches:
        cache[~c.used] = float("nan")
    out2, lse2 = c.run()
    assert_equal(out2, out, "out after poisoning never-visible rows")
    assert_equal(lse2, lse, "lse after poisoning never-visible rows")
    # 2. A tree row seen only by its own subtree: changing it changes those nodes' outputs and nothing
    #    else (its siblings and cousins, other requests).
    b, N = 1, c.N
    j = N - 1  # the last node is a leaf: only itself sees it
    dense = _ancestor_walk(c.parents[b].tolist())
    sees_j = torch.zeros(3 * N, dtype=torch.bool)
    sees_j[b * N:(b + 1) * N] = dense[:, j]
    pos = int(c.prefix_lens[b]) + j
    for cache in caches:
        cache[int(c.page_table[b, pos // page_size]), pos % page_size] *= -3
    out3, lse3 = c.run()
    assert_equal(out3[~sees_j], out[~sees_j], "out of nodes that do not see the changed row")
    assert_equal(lse3[~sees_j], lse[~sees_j], "lse of nodes that do not see the changed row")
    assert not torch.equal(out3[sees_j], out[sees_j]), "the changed row should matter to its own node"
    ref_out, ref_lse = c.truth()
    assert rel_err(out3, ref_out) <= TOLERANCES[torch.float32]


@pytest.mark.parametrize("mla", [True, False])
def test_identity_page_table_equals_shuffled(gen, mla):
    # The same logical rows stored through two different page tables give the same result.
    kw = dict(NH=4, D=40, Dv=32) if mla else dict(NH=8, HKV=2, D=16, Dv=24)
    c = Case(gen, mla=mla, prefixes=[4, 0, 11], N=7, kind="bushy", page_size=4, **kw)
    out, lse = c.run()
    P = c.k_cache.shape[0]
    perm = torch.randperm(P, generator=gen)  # new page p holds old page perm[p]
    inverse = torch.argsort(perm).to(torch.int32)
    c.k_cache = c.k_cache[perm].contiguous()
    c.v_cache = None if mla else c.v_cache[perm].contiguous()
    c.page_table = inverse[c.page_table.long()]
    out2, lse2 = c.run()
    assert_equal(out2, out)
    assert_equal(lse2, lse)


# ---- the Triton kernels ------------------------------------------------------------------------------
# CI runs them under TRITON_INTERPRET=1 on CPU tensors, called directly (torch.ops on CPU tensors is the
# reference); the H200 runs them through torch.ops at the real shapes (-m gpu). The interpreter has no
# bf16 (its tl.dot multiplies bf16 bit patterns), so interpreted cases are fp16 / fp32.

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")


def _kernel(c: Case, config=None, with_lse=True):
    """The Triton launcher itself (not the op), on the case's device; outputs poisoned first."""
    from eagle3_ops.triton_kernels import tree_attention as ta

    dev = c.q.device
    out = poison_(torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype, device=dev))
    lse = poison_(torch.empty(c.q.shape[0], c.NH, device=dev)) if with_lse else None
    common = (c.page_table, c.prefix_lens, c.tree_mask, c.scale, out, lse)
    if c.mla:
        ta.tree_attention_mla(c.q, c.k_cache, *common, config=config)
    else:
        ta.tree_attention(c.q, c.k_cache, c.v_cache, *common, config=config)
    return out, lse


def _check_against(c: Case, out, lse, ref_out, ref_lse, rows=slice(None)):
    assert not torch.isnan(out[rows]).any(), f"out not fully written: first NaN at {tuple(torch.isnan(out[rows]).nonzero()[0])}"
    err = rel_err(out[rows], ref_out[rows])
    assert err <= TOLERANCES[c.dtype], f"out: rel err {err:.3g} > {TOLERANCES[c.dtype]}"
    if lse is not None:
        lse_err = rel_err(lse[rows], ref_lse[rows])
        assert lse_err <= TOLERANCES[torch.float32], f"lse: rel err {lse_err:.3g}"


@interpreted
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("N, kind, splits, dtype", [
    (1, "chain", 3, torch.float16),  # decode, the prefix split three ways + the merge kernel
    (7, "bushy", 3, torch.float32),  # a tree, split + merge
    (7, "bushy", 1, torch.float16),  # one split: the kernel writes out and lse itself
    (33, "chain", 1, torch.float32),  # two mask words, bit 31 (int32's sign bit) used
])  # (fp16 is slow under the interpreter: numpy half matmuls; N = 33 with splits runs many merge programs)
@pytest.mark.parametrize("mla", [True, False])
def test_kernel_interpreted(gen, mla, N, kind, splits, dtype, page_size):
    kw = dict(NH=4, D=40, Dv=32) if mla else dict(NH=8, HKV=2, D=16, Dv=24)  # odd dims: padded tiles
    c = Case(gen, mla=mla, prefixes=[0, 17, 70], N=N, kind=kind, page_size=page_size, dtype=dtype, **kw)
    _check_with_and_without_lse(c, dict(splits=splits))


@interpreted
@pytest.mark.parametrize("mla", [True, False])
def test_kernel_interpreted_merge_in_two_steps(gen, mla):
    # 131 splits: the merge kernel takes 128 a step, so its running max crosses steps (the prefix's splits in
    # the first, the tree block's - the last split - in the second); most splits are empty (lse -inf).
    kw = dict(NH=4, D=40, Dv=32) if mla else dict(NH=8, HKV=2, D=16, Dv=24)
    c = Case(gen, mla=mla, prefixes=[0, 17, 70], N=3, kind="bushy", page_size=16, dtype=torch.float32, **kw)
    _check_with_and_without_lse(c, dict(splits=131))


def _check_with_and_without_lse(c: Case, config: dict):
    out, lse = _kernel(c, config=config)
    _check_against(c, out, lse, *c.truth())
    without, none = _kernel(c, config=config, with_lse=False)
    assert none is None
    assert_equal(without, out, "out without lse")


@interpreted
def test_kernel_interpreted_kimi_dims(gen):
    # Kimi's 576 = 512 latent + 64 rope key and V = the first 512 dims (two dots per tile), fewer heads.
    c = Case(gen, mla=True, prefixes=[3, 40], N=4, kind="bushy", page_size=16, NH=8, D=576, Dv=512,
             dtype=torch.float16, scale=KIMI_SCALE)
    out, lse = _kernel(c, config=dict(splits=2))
    _check_against(c, out, lse, *c.truth())


@interpreted
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("N, kind, splits, dtype", [
    (1, "chain", 3, torch.float16),  # decode: both V halves write partials, one merge reads them all
    (7, "bushy", 2, torch.float32),  # a tree, split + merge
    (33, "chain", 1, torch.float32),  # one split (each half stores its out dims, one half the lse); two
])  # mask words through the recomputed scores
def test_kernel_interpreted_v_split(gen, N, kind, splits, dtype, page_size):
    # The 512 V dims split across two programs: Dv = 40 pads to 64, halves of 32 (the high half partly
    # masked), the score from both halves of the latent dims plus the 24 rope dims.
    c = Case(gen, mla=True, prefixes=[0, 17, 70], N=N, kind=kind, page_size=page_size, NH=4, D=64, Dv=40,
             dtype=dtype)
    _check_with_and_without_lse(c, dict(v_split=2, splits=splits))


@interpreted
def test_kernel_interpreted_v_split_kimi_dims(gen):
    # Kimi's 576 = 512 + 64 with V split into 256 + 256 (the variant's tiles, 32 of its 64 rows used).
    c = Case(gen, mla=True, prefixes=[3, 40], N=4, kind="bushy", page_size=16, NH=8, D=576, Dv=512,
             dtype=torch.float16, scale=KIMI_SCALE)
    out, lse = _kernel(c, config=dict(v_split=2, splits=2))
    _check_against(c, out, lse, *c.truth())


@interpreted
def test_kernel_interpreted_v_split_bad_values_poison_only_their_request(gen):
    c = Case(gen, mla=True, prefixes=[5, 17, 9], N=7, kind="bushy", page_size=4, NH=4, D=40, Dv=32)
    ref_out, ref_lse = c.truth()
    good, bad_page, bad_prefix = _bad_values(c)
    out, lse = _kernel(c, config=dict(v_split=2, splits=2))
    _reported(c)
    _check_against(c, out, lse, ref_out, ref_lse, rows=good)
    for rows in (bad_page, bad_prefix):
        assert torch.isnan(out[rows]).all() and torch.isnan(lse[rows]).all()


# The second MLA kernel (triton_kernels/mla_decode.py, config "tma"): whole tiles unmasked, read with TMA
# descriptors where page_size % BLOCK_N == 0 (the interpreter runs host-side descriptors), gathered where not
# (page size 1); the split's partial tile and the tree block masked; rescale_tau > 0 rescales lazily.
TMA_CONFIGS = {"tma16.lazy": dict(tma=True, BLOCK_N=16, rescale_tau=8.0),  # TMA at page sizes 16 and 64
               "tma16.eager": dict(tma=True, BLOCK_N=16, rescale_tau=0.0),
               "gather32.lazy": dict(tma=False, BLOCK_N=32, rescale_tau=8.0),  # two mask words per tree tile
               # cut: the whole tiles' score dots and softmax through always-taken runtime ifs (mla_decode._cut)
               "tma16.cut": dict(tma=True, BLOCK_N=16, cut=1),
               "gather32.cut": dict(tma=False, BLOCK_N=32, cut=1)}


@interpreted
@pytest.mark.parametrize("config", list(TMA_CONFIGS))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("N, kind, splits, dtype", [
    (1, "chain", 3, torch.float16),  # decode, split three ways + the merge kernel
    (7, "bushy", 3, torch.float32),  # a tree, split + merge: partial last tiles in every split
    (33, "chain", 1, torch.float32),  # one split: the kernel writes out and lse; two mask words, bit 31
])
def test_kernel_interpreted_tma(gen, config, page_size, N, kind, splits, dtype):
    # Dv = 40: the second latent half [32, 64) is partly past Dv (zero-filled by the descriptor's shape);
    # rope 24 dims of a 32-wide box.
    c = Case(gen, mla=True, prefixes=[0, 17, 70], N=N, kind=kind, page_size=page_size, NH=4, D=64, Dv=40,
             dtype=dtype)
    _check_with_and_without_lse(c, dict(TMA_CONFIGS[config], splits=splits))


@interpreted
@pytest.mark.parametrize("config", list(TMA_CONFIGS))
def test_kernel_interpreted_tma_kimi_dims(gen, config):
    # Kimi's 576 = 512 + 64: two 256-wide latent boxes and one 64-wide rope box per tile.
    c = Case(gen, mla=True, prefixes=[3, 40], N=4, kind="bushy", page_size=16, NH=8, D=576, Dv=512,
             dtype=torch.float16, scale=KIMI_SCALE)
    out, lse = _kernel(c, config=dict(TMA_CONFIGS[config], splits=2))
    _check_against(c, out, lse, *c.truth())


@interpreted
@pytest.mark.parametrize("config", list(TMA_CONFIGS))
def test_kernel_interpreted_tma_bad_values_poison_only_their_request(gen, config):
    # page size 16 with prefixes past one tile: request 1's bad page id is met by a whole (TMA) tile
    c = Case(gen, mla=True, prefixes=[5, 40, 9], N=7, kind="bushy", page_size=16, NH=4, D=40, Dv=32)
    ref_out, ref_lse = c.truth()
    good, bad_page, bad_prefix = _bad_values(c)
    out, lse = _kernel(c, config=dict(TMA_CONFIGS[config], splits=2))
    _reported(c)
    _check_against(c, out, lse, ref_out, ref_lse, rows=good)
    for rows in (bad_page, bad_prefix):
        assert torch.isnan(out[rows]).all() and torch.isnan(lse[rows]).all()


@interpreted
@pytest.mark.parametrize("page_size", [16, 64])
def test_kernel_interpreted_tma_never_visible_rows_do_not_matter(gen, page_size):
    # NaN in rows nobody may see (past prefix + N on the last page, spare pages) leaves results bit-identical,
    # though a TMA box reads whole pages' rows: the partial tiles are masked gathers.
    c = Case(gen, mla=True, prefixes=[0, 17, 37], N=7, kind="bushy", page_size=page_size, NH=4, D=40, Dv=32)
    cfg = dict(tma=True, BLOCK_N=16, splits=2)
    out, lse = _kernel(c, config=cfg)
    c.k_cache[~c.used] = float("nan")
    out2, lse2 = _kernel(c, config=cfg)
    assert_equal(out2, out, "out after poisoning never-visible rows")
    assert_equal(lse2, lse, "lse after poisoning never-visible rows")


def test_tma_splits_fill_counts_one_partial_wave():
    # config fill=True (mla_decode.splits_fill) at the sweep's shapes on 132 SMs: programs = 16 row blocks x B
    from eagle3_ops.triton_kernels.mla_decode import splits_fill

    assert [splits_fill(p, n, 132, 256) for p, n in [(16, 32784), (128, 8208), (32, 32768), (16, 4112)]] == [8, 1, 4, 8]
    assert splits_fill(200, 1000, 132, 256) == 3  # 600 programs: 5 waves of 132 at 91%
    assert splits_fill(70, 200, 132, 256) == 1  # no split count reaches 90%: num_splits_for's pick
    assert splits_fill(1, 100, 132, 256) == 1  # one chunk


@settings(max_examples=300, deadline=None)
@given(splits=st.integers(1, 400), max_len=st.integers(0, 300000))
def test_sm90_trim_splits_drops_only_empty_splits(splits, max_len):
    # mla_decode.trim_splits: at a prefix of max_len the kernel's chunk (whole 64-key tiles of ceil(len / splits))
    # stays the same and every split left has keys; never more splits than asked
    from eagle3_ops.triton_kernels.mla_decode import trim_splits

    def chunk(n, s):
        return -(-(-(-n // s)) // 64) * 64

    t = trim_splits(splits, max_len)
    assert 1 <= t <= max(1, splits)
    if splits > 1 and max_len > 0:
        assert chunk(max_len, t) == chunk(max_len, splits)
        assert (t - 1) * chunk(max_len, t) < max_len  # the last split starts inside the prefix
    assert trim_splits(119, 32832) == 103


def test_sm90_default_splits_at_n1_b1():
    # the launcher's default at N 1 B 1 prefix 32768 (page 64) on 132 SMs: splits_fill's 119 less the 16 empty
    from eagle3_ops.triton_kernels.mla_decode import sm90_splits, splits_fill

    assert splits_fill(1, 32832, 132, 256) == 119
    assert sm90_splits(1, 32832, 132) == 103
    assert sm90_splits(16, 32784, 132) == 8  # 16 nodes B 1: no empty split to drop


def _bad_values(c: Case):
    """Request 1 reaches a page id past the cache, request 2's prefix leaves no room for its tree:
    the kernel must not read out of bounds, and poisons exactly those requests with NaN (and records one of
    them: _reported; tests/test_contract_attention.py checks each alone)."""
    N = c.N
    c.page_table[1, 0] = c.k_cache.shape[0] + 1000
    c.prefix_lens[2] = c.page_table.shape[1] * c.k_cache.shape[1] - N + 1
    return [slice(0, N), slice(N, 2 * N), slice(2 * N, 3 * N)]


def _reported(c: Case):
    """One of _bad_values' violations is in the error word (either may win); reading it clears the word."""
    with pytest.raises(Eagle3InputError, match=r"^tree_attention(_mla)?: (page_table\[1, 0\]|prefix_lens\[2\]) = "):
        eagle3_ops.check_errors(c.q.device)


@interpreted
@pytest.mark.parametrize("mla", [True, False])
def test_kernel_interpreted_bad_values_poison_only_their_request(gen, mla):
    kw = dict(NH=4, D=40, Dv=32) if mla else dict(NH=8, HKV=2, D=16, Dv=24)
    c = Case(gen, mla=mla, prefixes=[5, 17, 9], N=7, kind="bushy", page_size=4, **kw)
    ref_out, ref_lse = c.truth()  # request 0 stays valid
    good, bad_page, bad_prefix = _bad_values(c)
    out, lse = _kernel(c, config=dict(splits=2))
    _reported(c)
    _check_against(c, out, lse, ref_out, ref_lse, rows=good)
    for rows in (bad_page, bad_prefix):
        assert torch.isnan(out[rows]).all() and torch.isnan(lse[rows]).all()


def test_kernel_refuses_unsupported_shapes(gen):
    from eagle3_ops.triton_kernels import tree_attention as ta

    c = Case(gen, mla=True, prefixes=[1], N=1, kind="chain", page_size=4, NH=2, D=40, Dv=32)
    args = (c.page_table, c.prefix_lens, c.tree_mask, c.scale)
    with pytest.raises(ValueError, match="out must have Dv <= 512"):  # a 1024-wide V would not fit registers
        ta.tree_attention_mla(torch.zeros(1, 2, 1100), torch.zeros(4, 4, 1100), *args, torch.zeros(1, 2, 1024), None)
    with pytest.raises(ValueError, match="D - Dv <= 128"):  # rope part past one tile
        ta.tree_attention_mla(torch.zeros(1, 2, 400), torch.zeros(4, 4, 400), *args, torch.zeros(1, 2, 64), None)
    with pytest.raises(ValueError, match="k_cache and v_cache must have head dims <= 256"):
        ta.tree_attention(torch.zeros(1, 2, 512), torch.zeros(4, 4, 1, 512), torch.zeros(4, 4, 1, 64), *args,
                          torch.zeros(1, 2, 64), None)
    with pytest.raises(ValueError, match="config v_split must be 1, or 2 for tree_attention_mla"):  # GQA: no
        ta.tree_attention(torch.zeros(1, 2, 16), torch.zeros(4, 4, 1, 16), torch.zeros(4, 4, 1, 32), *args,
                          torch.zeros(1, 2, 32), None, config=dict(v_split=2))
    with pytest.raises(ValueError, match="config v_split must be 1, or 2"):
        ta.tree_attention_mla(c.q, c.k_cache, *args, torch.zeros(1, 2, 32), None, config=dict(v_split=4))
    with pytest.raises(ValueError, match="config tma needs the default kernel"):
        ta.tree_attention_mla(c.q, c.k_cache, *args, torch.zeros(1, 2, 32), None, config=dict(tma=True, v_split=2))
    with pytest.raises(ValueError, match="config BLOCK_N must be 16, 32 or 64"):
        ta.tree_attention_mla(c.q, c.k_cache, *args, torch.zeros(1, 2, 32), None, config=dict(tma=True, BLOCK_N=128))
    with pytest.raises(TypeError, match="q must have dtype bfloat16 | float16 | float32"):
        ta.tree_attention_mla(c.q.double(), c.k_cache.double(), *args, torch.zeros(1, 2, 32, dtype=torch.float64),
                              None)


# ---- on the H200 -------------------------------------------------------------------------------------


class GpuCase(Case):
    """A Case built on the GPU at real sizes: ragged prefixes (request 0 at `prefix`, the others uniform in
    [0, prefix]), a shuffled page table, and a float64 truth computed on the GPU request by request."""

    def __init__(self, seed, *, mla, B, prefix, N, kind, page_size, NH, D, Dv, HKV=1, dtype=torch.bfloat16,
                 scale=KIMI_SCALE):
        self.mla, self.N, self.NH, self.Dv, self.dtype, self.scale = mla, N, NH, Dv, dtype, scale
        host = torch.Generator().manual_seed(seed)
        g = torch.Generator(device="cuda").manual_seed(seed)
        prefixes = [prefix] + torch.randint(0, prefix + 1, (B - 1,), generator=host).tolist()
        self.parents = tree.random_parents(B, N, host, kind)
        self.tree_mask = tree.tree_mask(self.parents).cuda()
        self.prefix_lens = torch.tensor(prefixes, dtype=torch.int32, device="cuda")
        need = [-(-(p + N) // page_size) for p in prefixes]
        pages = sum(need) + 2
        perm = torch.randperm(pages, generator=g, device="cuda").int()
        self.page_table = perm[-1].repeat(B, max(need) + 1)  # unused entries: a spare page
        k = 0
        for b, n in enumerate(need):
            self.page_table[b, :n] = perm[k:k + n]
            k += n
        self.q = torch.randn(B * N, NH, D, generator=g, device="cuda").to(dtype)
        cache = (pages, page_size) if mla else (pages, page_size, HKV)
        self.k_cache = torch.randn(*cache, D, generator=g, device="cuda").to(dtype)
        self.v_cache = None if mla else torch.randn(*cache, Dv, generator=g, device="cuda").to(dtype)

    def truth(self):
        B, N, ps = self.prefix_lens.shape[0], self.N, self.k_cache.shape[1]
        outs, lses = [], []
        for b in range(B):
            P = int(self.prefix_lens[b])
            pos = torch.arange(P + N, device="cuda")
            where = (self.page_table[b, pos // ps].long(), pos % ps)
            visible = torch.cat([torch.ones(N, P, dtype=torch.bool),
                                 _ancestor_walk(self.parents[b].tolist())], 1).cuda()
            qb = self.q[b * N:(b + 1) * N].double()  # [N, NH, D]
            if self.mla:
                k = self.k_cache[where].double()  # [L, D], V = its first Dv dims
                s = torch.einsum("nhd,ld->nhl", qb, k)
                v = k[:, None, :self.Dv]
            else:
                group = self.NH // self.k_cache.shape[2]
                k = self.k_cache[where].double().repeat_interleave(group, 1)  # [L, NH, Dh]
                v = self.v_cache[where].double().repeat_interleave(group, 1)
                s = torch.einsum("nhd,lhd->nhl", qb, k)
            s = (s * self.scale).masked_fill(~visible[:, None, :], -math.inf)
            lse = torch.logsumexp(s, -1)
            outs.append(torch.einsum("nhl,lhd->nhd", torch.exp(s - lse[..., None]), v.expand(-1, self.NH, -1)))
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)


KIMI_MLA = dict(mla=True, NH=64, D=576, Dv=512)
KIMI_DRAFTER = dict(mla=False, NH=64, HKV=64, D=128, Dv=128, scale=128 ** -0.5)  # one Llama-style layer
LLAMA_8B = dict(mla=False, NH=32, HKV=8, D=128, Dv=128, scale=128 ** -0.5)
# (N, prefix, B, page_size, kind): every value of the grid at least once, at least one long
# prefix per page size; prefixes ragged within each batch.
SWEEP = {"mla": [(1, 32768, 1, 1, "chain"), (1, 4096, 32, 64, "chain"), (1, 0, 8, 16, "chain"),
                 (4, 0, 3, 16, "chain"), (4, 63, 8, 1, "bushy"), (4, 1, 1, 64, "chain"),
                 (16, 32768, 1, 64, "bushy"), (16, 4096, 8, 16, "bushy"), (16, 1, 32, 1, "chain"),
                 (64, 63, 3, 64, "bushy"), (64, 4096, 1, 16, "chain"), (64, 32768, 32, 16, "bushy")],
         "kimi_drafter": [(16, 4096, 8, 16, "bushy"), (4, 0, 32, 16, "chain"), (1, 32768, 3, 64, "chain"),
                          (64, 63, 1, 1, "bushy")],
         "llama_8b": [(1, 32768, 1, 1, "chain"), (64, 63, 3, 64, "bushy"), (16, 32768, 3, 64, "chain"),
                      (4, 1, 8, 1, "bushy"), (16, 4096, 32, 16, "bushy")]}
SHAPES = {"mla": KIMI_MLA, "kimi_drafter": KIMI_DRAFTER, "llama_8b": LLAMA_8B}


@pytest.mark.gpu
@pytest.mark.parametrize("shape, case", [(s, c) for s, cs in SWEEP.items() for c in cs],
                         ids=[f"{s}-N{c[0]}-prefix{c[1]}-B{c[2]}-ps{c[3]}-{c[4]}" for s, cs in SWEEP.items() for c in cs])
def test_gpu_against_float64(shape, case):
    N, prefix, B, page_size, kind = case
    c = GpuCase(zlib.crc32(repr(case).encode()), B=B, prefix=prefix, N=N, kind=kind, page_size=page_size, **SHAPES[shape])
    out, lse = c.run()  # through torch.ops on CUDA tensors: the registered Triton launcher
    _check_against(c, out, lse, *c.truth())


@pytest.mark.gpu
@pytest.mark.parametrize("case", SWEEP["mla"][:1] + SWEEP["mla"][6:8],
                         ids=lambda c: f"N{c[0]}-prefix{c[1]}-B{c[2]}-ps{c[3]}-{c[4]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_v_split_against_float64(case, dtype):
    # The V-split variant at Kimi's shape: decode at 32768 (page size 1), the two 16-node targets.
    N, prefix, B, page_size, kind = case
    c = GpuCase(zlib.crc32(repr(case).encode()), B=B, prefix=prefix, N=N, kind=kind, page_size=page_size,
                dtype=dtype, **KIMI_MLA)
    out, lse = _kernel(c, config=dict(v_split=2))
    _check_against(c, out, lse, *c.truth())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", ["mla", "llama_8b"])
def test_gpu_dtypes(shape, dtype):
    c = GpuCase(7, B=3, prefix=700, N=16, kind="bushy", page_size=16, dtype=dtype, **SHAPES[shape])
    out, lse = c.run()
    _check_against(c, out, lse, *c.truth())
    without, _ = c.run(with_lse=False)
    assert_equal(without, out, "out without lse")


# The second MLA kernel at Kimi's shape: TMA at page size 64 (BLOCK_N 32 and 64), gathered at page sizes 1
# and 16 (BLOCK_N 64) - decode at 32768 (page size 1), the two 16-node targets, a 64-node tree at 32768.
# tma64 is the default (cut + fill for bf16); tma64.nocut keeps the chained score dots and num_splits_for's count.
# sm90 is csrc/mla_decode_sm90.cu's CUDA kernel (the bf16 / fp16 default on Hopper; no fp32).
GPU_TMA = {"tma64": dict(tma=True), "tma64.nocut": dict(tma=True, cut=False, fill=False),
           "tma32.eager": dict(tma=True, BLOCK_N=32, rescale_tau=0.0, cut=False), "gather64": dict(tma=False),
           "sm90": dict(kernel="sm90")}


@pytest.mark.gpu
@pytest.mark.parametrize("shape, config", [("mla", None), ("llama_8b", None)] + [("mla", k) for k in GPU_TMA])
def test_gpu_graph_replay_matches_eager(shape, config):
    # Capture once, then write new q, cache rows, prefix lengths and trees into the same tensors: replay
    # must equal an eager call on the new values (the split count comes from shapes, never from values).
    # With a "tma" config (page size 64: TMA tiles) the descriptors are kernel parameters captured by value.
    from eagle3_ops.triton_kernels import tree_attention as ta

    if config == "sm90":
        skip_unless_sm90_kernel()
    c = GpuCase(11, B=4, prefix=5000, N=16, kind="bushy", page_size=64 if config else 16, **SHAPES[shape])
    out = torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype, device="cuda")
    lse = torch.empty(c.q.shape[0], c.NH, device="cuda")
    caches = [c.k_cache] if c.mla else [c.k_cache, c.v_cache]
    call = (lambda: torch.ops.eagle3.tree_attention_mla(c.q, c.k_cache, c.page_table, c.prefix_lens, c.tree_mask,
                                                        c.scale, out, lse)) if c.mla else \
        (lambda: torch.ops.eagle3.tree_attention(c.q, c.k_cache, c.v_cache, c.page_table, c.prefix_lens,
                                                 c.tree_mask, c.scale, out, lse))
    if config:
        call = lambda: ta.tree_attention_mla(c.q, c.k_cache, c.page_table, c.prefix_lens, c.tree_mask,  # noqa: E731
                                             c.scale, out, lse, config=GPU_TMA[config])
    graph, _ = capture_graph(call)

    def new_caches(g):
        for cache in caches:
            cache.copy_(torch.randn(cache.shape, generator=g, device="cuda"))

    replayed = replay_with_new_values(c, graph, out, lse, new_caches)
    eager = _kernel(c, config=GPU_TMA[config]) if config else c.run()
    assert_equal(replayed[0], eager[0], "out replayed vs eager")
    assert_equal(replayed[1], eager[1], "lse replayed vs eager")
    _check_against(c, *eager, *c.truth())


def replay_with_new_values(c: GpuCase, graph, out, lse, new_caches):
    """For a graph captured on c (B 4, N 16): new q, prefix lengths and trees written into c's tensors, the caches
    by new_caches(generator), the outputs poisoned, the graph replayed. Returns the replayed (out, lse)."""
    g = torch.Generator(device="cuda").manual_seed(12)
    c.q.copy_(torch.randn(c.q.shape, generator=g, device="cuda"))
    new_caches(g)
    c.prefix_lens.copy_(torch.tensor([5000, 17, 0, 4321], dtype=torch.int32))
    c.parents = tree.random_parents(4, 16, torch.Generator().manual_seed(13), "bushy")
    c.tree_mask.copy_(tree.tree_mask(c.parents))
    poison_(out)
    poison_(lse)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone(), lse.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["mla", "llama_8b"])
def test_gpu_bad_values_poison_only_their_request(shape):
    c = GpuCase(21, B=3, prefix=300, N=7, kind="bushy", page_size=16, **SHAPES[shape])
    check_bad_values_poison_only_their_request(c, lambda: _kernel(c))  # no host sync, no error


def check_bad_values_poison_only_their_request(c: Case, run):
    """_bad_values written into c, then run() -> (out, lse): the good request as the truth taken before, every row
    of the bad ones NaN, one of the violations in the error word."""
    ref_out, ref_lse = c.truth()
    good, bad_page, bad_prefix = _bad_values(c)
    out, lse = run()
    if c.q.is_cuda:
        torch.cuda.synchronize()
    _reported(c)
    _check_against(c, out, lse, ref_out, ref_lse, rows=good)
    for rows in (bad_page, bad_prefix):
        assert torch.isnan(out[rows]).all() and torch.isnan(lse[rows]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(GPU_TMA))
@pytest.mark.parametrize("case", SWEEP["mla"][:1] + SWEEP["mla"][6:8] + SWEEP["mla"][-1:],
                         ids=lambda c: f"N{c[0]}-prefix{c[1]}-B{c[2]}-ps{c[3]}-{c[4]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tma_against_float64(case, dtype, config):
    N, prefix, B, page_size, kind = case
    c = GpuCase(zlib.crc32(repr(case).encode()), B=B, prefix=prefix, N=N, kind=kind, page_size=page_size,
                dtype=dtype, **KIMI_MLA)
    if config.startswith("sm90") and dtype == torch.float32:
        pytest.skip("the sm90 kernel is bf16 / fp16 only (fp32 takes the Triton kernel)")
    if config.startswith("sm90"):
        skip_unless_sm90_kernel()
    cfg = {k: v for k, v in GPU_TMA[config].items() if dtype != torch.float32 or k != "BLOCK_N"}  # fp32: its tiles
    out, lse = _kernel(c, config=cfg)
    _check_against(c, out, lse, *c.truth())
    without, _ = _kernel(c, config=cfg, with_lse=False)
    assert_equal(without, out, "out without lse")


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(GPU_TMA))
def test_gpu_tma_bad_values_poison_only_their_request(config):
    if config.startswith("sm90"):
        skip_unless_sm90_kernel()
    c = GpuCase(21, B=3, prefix=300, N=7, kind="bushy", page_size=64, **KIMI_MLA)
    ref_out, ref_lse = c.truth()
    good, bad_page, bad_prefix = _bad_values(c)
    out, lse = _kernel(c, config=GPU_TMA[config])
    torch.cuda.synchronize()
    _reported(c)
    _check_against(c, out, lse, ref_out, ref_lse, rows=good)
    for rows in (bad_page, bad_prefix):
        assert torch.isnan(out[rows]).all() and torch.isnan(lse[rows]).all()



# The sm90 CUDA kernel beyond the sweep: forced split counts (one split: written straight to out; a few;
# more splits than tiles: empty splits), head counts whose rows do not fill 64-row blocks (16 heads x 7
# nodes = 112 rows; DeepSeek's 128), trees past two mask words (N 100: a second tree tile), fp16 and bf16.
SM90_CASES = [  # (N, prefix, B, page_size, kind, NH, splits, dtype)
    (16, 4096, 3, 64, "bushy", 64, 1, torch.bfloat16),
    (16, 4096, 3, 16, "bushy", 64, 3, torch.float16),
    (1, 100, 2, 1, "chain", 64, 40, torch.bfloat16),
    (7, 777, 5, 16, "bushy", 16, 2, torch.bfloat16),
    (4, 2000, 2, 64, "chain", 128, 5, torch.float16),
    (100, 300, 2, 16, "bushy", 64, 2, torch.bfloat16),
    (64, 0, 4, 1, "bushy", 64, 1, torch.bfloat16),
    (3, 65, 9, 64, "chain", 64, None, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("evict_first", [False, True])
@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: f"N{c[0]}-prefix{c[1]}-B{c[2]}-ps{c[3]}-{c[4]}-NH{c[5]}"
                         f"-splits{c[6]}-{str(c[7])[6:]}")
def test_gpu_sm90_against_float64(case, evict_first):
    N, prefix, B, page_size, kind, NH, splits, dtype = case
    skip_unless_sm90_kernel()
    c = GpuCase(zlib.crc32(repr(case).encode()), B=B, prefix=prefix, N=N, kind=kind, page_size=page_size,
                dtype=dtype, mla=True, NH=NH, D=576, Dv=512)
    cfg = dict(kernel="sm90", evict_first=evict_first, **({"splits": splits} if splits else {}))
    out, lse = _kernel(c, config=cfg)
    _check_against(c, out, lse, *c.truth())
    without, _ = _kernel(c, config=cfg, with_lse=False)
    assert_equal(without, out, "out without lse")


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [3e4, 1e30])
def test_gpu_sm90_large_q(q_scale):
    # Scores past 2^15 in log2 units: the softmax's FFMA (exact product minus the rounded max) would put the max's
    # rounding error, up to half its ulp, into every exponent: out NaN at |q| ~ 1e30 (seen on the H200 at 95d786a
    # in the fp8 build, whose softmax is this one).
    skip_unless_sm90_kernel()
    c = GpuCase(11, B=4, prefix=4096, N=2, kind="chain", page_size=64, **dict(KIMI_MLA, NH=16))
    c.q.copy_((c.q.float() * q_scale).to(c.dtype))
    out, lse = _kernel(c, config=dict(kernel="sm90"))
    _check_against(c, out, lse, *c.truth())


@pytest.mark.gpu
def test_gpu_sm90_is_the_hopper_default():
    # bf16 at Kimi's widths on a Hopper GPU must not fall back to the Triton kernel silently.
    from eagle3_ops.triton_kernels.mla_decode import sm90_supported

    skip_unless_sm90_kernel()
    c = GpuCase(3, B=1, prefix=64, N=1, kind="chain", page_size=64, **KIMI_MLA)
    out = torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype, device="cuda")
    assert sm90_supported(c.q, c.k_cache, out, c.page_table, c.tree_mask)
    # rows not 16-byte aligned: the Triton kernel
    assert not sm90_supported(c.q[:, :, 1:], c.k_cache, out, c.page_table, c.tree_mask)


@pytest.mark.gpu
def test_gpu_sm90_internal_op_refuses_bad_input():
    # The internal op checks what its kernel relies on, whatever its (only) caller already checked.
    skip_unless_sm90_kernel()
    c = GpuCase(5, B=2, prefix=100, N=4, kind="chain", page_size=16, **KIMI_MLA)
    out = torch.empty(c.q.shape[0], 64, 512, dtype=c.dtype, device="cuda")
    po, plse = torch.empty(2, 2, 4 * 64, 512, device="cuda"), torch.empty(2, 2, 4 * 64, device="cuda")
    op = torch.ops.eagle3._tree_attention_mla_sm90
    common = (c.page_table, c.prefix_lens, c.tree_mask, c.scale)
    with pytest.raises(ValueError, match="q must have shape"):
        op(c.q[..., :512].contiguous(), c.k_cache, *common, out, None, po, plse, 2)
    with pytest.raises(ValueError, match="num_splits must be in"):
        op(c.q, c.k_cache, *common, out, None, po, plse, 0)
    with pytest.raises(ValueError, match="part_out must have shape"):
        op(c.q, c.k_cache, *common, out, None, po[:1], plse, 2)
    with pytest.raises(TypeError, match="kv_cache must have dtype"):
        op(c.q, c.k_cache.half(), *common, out, None, po, plse, 2)
    with pytest.raises(ValueError, match="part_lse must be on the same device"):
        op(c.q, c.k_cache, *common, out, None, po, plse.cpu(), 2)
    for bad_scale in (0.0, -c.scale, math.inf):  # the softmax takes the row max of the unscaled scores
        with pytest.raises(ValueError, match="scale must be finite and > 0"):
            op(c.q, c.k_cache, c.page_table, c.prefix_lens, c.tree_mask, bad_scale, out, None, po, plse, 2)


# The kernel's development builds (per-block trace, no-math skeletons) exist only as the private op of a build
# made with EAGLE3_DEV_BUILD=1 (setup.py); the production op table never has them (tests/test_registration.py).
needs_dev_build = pytest.mark.skipif(not eagle3_ops.build_info()["dev_build"],
                                     reason="a development build's op (setup.py EAGLE3_DEV_BUILD=1)")


def _sm90_dev_case():
    """(case, the shared arguments, out, lse, part_out, part_lse) for the development op at 3 splits: B 2, N 3 at
    Kimi's 64 heads, so 3 row blocks (192 rows) x B x splits = 18 blocks."""
    c = GpuCase(7, B=2, prefix=1000, N=3, kind="chain", page_size=16, **KIMI_MLA)
    out = poison_(torch.empty(c.q.shape[0], c.NH, c.Dv, dtype=c.dtype, device="cuda"))
    lse = poison_(torch.empty(c.q.shape[0], c.NH, device="cuda"))
    po, plse = torch.empty(3, 2, 3 * 64, 512, device="cuda"), torch.empty(3, 2, 3 * 64, device="cuda")
    return c, (c.q, c.k_cache, c.page_table, c.prefix_lens, c.tree_mask, c.scale), out, lse, po, plse


@pytest.mark.gpu
@needs_dev_build
def test_gpu_sm90_dev_op_refuses_bad_input():
    skip_unless_sm90_kernel()
    c, args, out, lse, po, plse = _sm90_dev_case()
    op = torch.ops.eagle3._tree_attention_mla_sm90_dev
    with pytest.raises(ValueError, match="trace must have shape"):
        op(*args, out, lse, po, plse, 3, True, torch.zeros(3, 16, dtype=torch.int64, device="cuda"), 0)
    with pytest.raises(TypeError, match="trace must have dtype"):
        op(*args, out, lse, po, plse, 3, True, torch.zeros(18, 16, dtype=torch.int32, device="cuda"), 0)
    for bad_skeleton, evict in ((2, True), (1, False), (-1, True)):
        with pytest.raises(ValueError, match="skeleton must be 0, or 1"):
            op(*args, out, lse, po, plse, 3, evict, None, bad_skeleton)
    half = (c.q.half(), c.k_cache.half()) + args[2:]
    with pytest.raises(TypeError, match="built for bfloat16 only"):
        op(*half, out.half(), lse, po, plse, 3, True, None, 0)


@pytest.mark.gpu
@needs_dev_build
def test_gpu_sm90_trace_build():
    # bench/dev/trace_mla.py's build: the same partials, bit for bit, as the production op's kernel, and per block
    # stamps in order (entry <= tile 0 landed <= tile 1 landed ... <= last wgmma <= epilogue done).
    skip_unless_sm90_kernel()
    c, args, out, lse, po, plse = _sm90_dev_case()
    want_po, want_plse = torch.empty_like(po), torch.empty_like(plse)
    torch.ops.eagle3._tree_attention_mla_sm90(*args, out, lse, want_po, want_plse, 3, True)
    trace = torch.zeros(18, 16, dtype=torch.int64, device="cuda")
    torch.ops.eagle3._tree_attention_mla_sm90_dev(*args, out, lse, po, plse, 3, True, trace, 0)
    assert_equal(po, want_po, "part_out traced vs production")
    assert_equal(plse, want_plse, "part_lse traced vs production")
    t = trace.cpu()
    for row in t:
        tiles = int((row[2:11] != 0).sum())
        stamps = [row[1]] + [row[2 + k] for k in range(tiles)] + [row[11], row[12]]
        assert all(a <= b for a, b in zip(stamps, stamps[1:])), row
