"""tree_attention_mla and tree_attention (GQA/MHA): paged tree-verify attention against an independent
float64 formulation: every request's cache rows laid out densely through the page table, a dense
[N, prefix + N] bool mask from our own ancestor walk over the parents, then scaled_dot_product_attention in
float64 with that boolean mask (and an explicit log-sum-exp for lse)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eagle3_ops import tree
from tests.conftest import TOLERANCES, assert_equal, poison_, rel_err

KIMI_SCALE = 0.130861  # docs/KIMI.md: 192 ** -0.5 * m * m for Kimi-K2, never 576 ** -0.5


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
        out = poison_(torch.empty(self.q.shape[0], self.NH, self.Dv, dtype=self.dtype))
        lse = poison_(torch.empty(self.q.shape[0], self.NH)) if with_lse else None
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
