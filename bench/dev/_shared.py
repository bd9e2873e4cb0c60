"""What the development tools in bench/dev/ share: the import path and the MLA sweep's inputs.

Importing this module puts the checkout's root (its eagle3_ops, built in place, and tests/) and bench/ (common.py,
the benchmarks) at the front of sys.path, so a tool runs as `python3 bench/dev/<tool>.py` from anywhere. The MLA
tools (sweep_mla, ceiling_mla, profile_mla, trace_mla) time Kimi's attention: 64 heads over one
576-dim latent head, V its first 512 dims, softmax scale 0.130861, on paged KV with random page ids.
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _path in (os.path.join(ROOT, "bench"), ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

KIMI_SCALE = 0.130861
NH, D, DV = 64, 576, 512


def mla_inputs(B: int, P: int, N: int, ps: int, g: torch.Generator, nh: int = NH) -> dict:
    """One input set of tree_attention_mla on the GPU: B requests of prefix P and a bushy N-node tree, paged
    KV of page size ps with the pages of all requests in one random permutation, out and lse allocated; nh
    query heads (Kimi's 64 / the tensor-parallel degree on one rank)."""
    from eagle3_ops import tree

    L = P + N
    pages = -(-L // ps)
    page_table = torch.randperm(B * pages, generator=g, device="cuda").int().view(B, pages).contiguous()
    parents = tree.random_parents(B, N, torch.Generator().manual_seed(B * 1000 + N), "bushy")
    return dict(q=torch.randn(B * N, nh, D, generator=g, device="cuda", dtype=torch.bfloat16),
                k=torch.randn(B * pages, ps, D, generator=g, device="cuda", dtype=torch.bfloat16),
                page_table=page_table, prefix_lens=torch.full((B,), P, dtype=torch.int32, device="cuda"),
                tree_mask=tree.tree_mask(parents).cuda(),
                out=torch.empty(B * N, nh, DV, device="cuda", dtype=torch.bfloat16),
                lse=torch.empty(B * N, nh, device="cuda"))


def mla_counts(B: int, P: int, N: int, nh: int = NH) -> tuple[int, int]:
    """(bytes, flops) of one tree_attention_mla call: the KV read once plus q read and out written; the score
    and P V matmuls over every (node, head, key)."""
    L = P + N
    return B * L * D * 2 + B * N * nh * (D + DV) * 2, 2 * B * N * nh * L * (D + DV)
