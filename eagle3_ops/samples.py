"""Small valid argument sets for every op: for the self-check, opcheck and bad-input tests.

`sample_args(name)` returns a fresh tuple of arguments in schema order for torch.ops.eagle3.<name>,
drawn from a seeded generator: odd sizes (B = 2, N = 5, V = 111, H = 24), a bushy tree, a paged cache
with page size 4 so that rows straddle pages. Outputs are allocated (NaN-poisoned floats).
"""

from __future__ import annotations

import torch

from . import tree

B, N, V, H, N_AUX, NH, PAGE = 2, 5, 111, 24, 3, 4, 4


def _paged(gen, B, prefix, n, page_size, device):
    """A shuffled page table with room for prefix + n rows per request."""
    per = -(-(int(prefix.max()) + n) // page_size) + 1
    pages = torch.randperm(B * per, generator=gen).view(B, per).to(torch.int32)
    return pages.to(device), B * per


def sample_args(name: str, device: str = "cpu", generator: torch.Generator | None = None,
                dtype: torch.dtype = torch.float32) -> tuple:
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    randn = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
    nan = lambda *s: torch.full(s, float("nan"), dtype=dtype, device=device)  # noqa: E731
    parents = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 1, 2, 3]], dtype=torch.int32)  # bushy, chain
    tokens = torch.randint(0, V, (B, N), generator=g)
    prefix = torch.tensor([3, 6], dtype=torch.int32)
    if name == "capture_aux":
        rows = torch.tensor([6, 0, 3], device=device)
        return randn(7, H), randn(7, H), nan(3, N_AUX * H), 1, rows
    if name == "add_rmsnorm_capture":
        return randn(7, H), randn(7, H), randn(H), 1e-6, nan(7, N_AUX * H), 2, None
    if name == "fc_proj":
        T, Hd = 7, 16
        norm_weight = randn(N_AUX, H)
        return randn(T, N_AUX * H), randn(Hd, N_AUX * H), None, norm_weight, 1e-6, "fc_norm", \
            torch.tensor([4, 1], device=device), nan(2, Hd)
    if name == "build_tree":
        S, M = 3, 4
        logp = torch.log_softmax(torch.randn(B, S, M, generator=g), -1)
        draft_parents = torch.randint(0, M, (B, S, M), generator=g)
        draft_parents[:, 0] = -1
        scores = logp.clone()
        for d in range(1, S):  # cumulative: add the parent's score
            scores[:, d] += torch.gather(scores[:, d - 1], 1, draft_parents[:, d])
        out = (torch.empty(B, N, dtype=torch.int64), torch.empty(B, N, dtype=torch.int32),
               torch.empty(B, N, dtype=torch.int64), torch.empty(B, N, 1, dtype=torch.int32))
        args = (tokens[:, 0].contiguous(), torch.randint(0, V, (B, S, M), generator=g), scores, draft_parents,
                prefix) + out
        return tuple(a.to(device) for a in args)
    if name in ("tree_attention_mla", "tree_attention"):
        page_table, pages = _paged(g, B, prefix, N, PAGE, "cpu")
        mask = tree.tree_mask(parents)
        common = (page_table.to(device), prefix.to(device), mask.to(device), 0.3)
        lse = torch.full((B * N, NH), float("nan"), device=device)
        if name == "tree_attention_mla":
            D, Dv = 40, 32
            return (randn(B * N, NH, D), randn(pages, PAGE, D)) + common + (nan(B * N, NH, Dv), lse)
        HKV, Dh = 2, 16
        return (randn(B * N, NH, Dh), randn(pages, PAGE, HKV, Dh), randn(pages, PAGE, HKV, Dh)) + common + \
            (nan(B * N, NH, Dh), lse)
    if name == "verify_greedy":
        return randn(B * N, V), tokens.to(device), parents.to(device)
    if name == "verify_sampling":
        Vd = 50
        draft_probs = torch.softmax(torch.randn(B * N, Vd, generator=g), -1).to(device)
        d2t = torch.randint(0, V - Vd, (Vd,), generator=g).to(device)
        return (randn(B * N, V), draft_probs, d2t, tokens.to(device), parents.to(device),
                torch.tensor([1.0, 0.7], device=device), torch.tensor([7, 8], device=device),
                torch.tensor([0, 3], device=device))
    if name == "kv_accept":
        page_table, pages = _paged(g, B, prefix, N, PAGE, "cpu")
        caches = [randn(pages, PAGE, 8), randn(pages, PAGE, 2, 4)]
        accept_nodes = torch.tensor([[0, 2, -1, -1, -1], [0, 1, 2, 3, -1]], dtype=torch.int32)
        accept_len = torch.tensor([1, 3], dtype=torch.int32)
        return caches, page_table.to(device), prefix.to(device), accept_nodes.to(device), accept_len.to(device)
    raise ValueError(f"no sample arguments for op {name!r}")
