"""The speculative step's glue done the plain-PyTorch way, as engines do it today (docs/e2e.md): the
comparison issue 7 measures our ops against, in the same loop and the same run.

- capture: ``h + r`` at each captured layer (a separate add), ``torch.cat`` of the captured layers after
  the forward (Target.plain_capture);
- fc: the accepted rows gathered (``aux[rows]``), then the drafter's norms and ``F.linear``
  (Drafter.project_train);
- build_tree: SGLang's algorithm (topk over the flattened cumulative scores, sort, parent resolution by
  search, ancestor mask by repeated gathers, bit packing);
- verify: vocabulary argmax, then the tree walk as tensor ops, one level a step;
- kv_accept: per-layer ``index_select`` / ``index_copy_`` of the accepted rows.

Each returns what the corresponding ``eagle3_ops.ops`` call returns (same values; tests/test_torch_glue.py),
so ``generate_speculative(..., glue="torch")`` runs the same loop.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def build_tree_into(root_tokens: Tensor, draft_tokens: Tensor, draft_scores: Tensor, draft_parents: Tensor,
                    prefix_lens: Tensor, tokens: Tensor, parents: Tensor, positions: Tensor, tree_mask: Tensor) -> None:
    """SGLang's build (preprocess + build_tree_kernel_efficient) in plain PyTorch, into preallocated outputs
    (ops.build_tree's: tokens [B, N] int64, parents [B, N] int32, positions [B, N] int64, tree_mask
    [B, N, W] int32)."""
    B, S, M = draft_scores.shape
    N = tokens.shape[1]
    C = S * M
    dev = draft_scores.device
    sel = torch.sort(draft_scores.view(B, C).topk(N - 1, dim=-1).indices, dim=-1).values  # [B, N - 1]
    tokens[:, 0] = root_tokens
    tokens[:, 1:] = draft_tokens.view(B, C).gather(1, sel)
    d = torch.div(sel, M, rounding_mode="floor")
    parent_cand = torch.where(d == 0, -1, (d - 1) * M + draft_parents.view(B, C).gather(1, sel).long())
    match = sel[:, None, :] == parent_cand[:, :, None]  # search
    pnode = torch.where(d == 0, 0, match.int().argmax(-1) + 1)
    par = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), pnode], 1)
    parents.copy_(par)
    hop = torch.where(par < 0, torch.arange(N, device=dev), par)
    anc = torch.eye(N, dtype=torch.bool, device=dev).expand(B, N, N).clone()
    depth = torch.zeros(B, N, dtype=torch.long, device=dev)
    cur = torch.arange(N, device=dev).expand(B, N)
    for _ in range(S):  # every node one level further up per round (the root points at itself)
        nxt = hop.gather(1, cur)
        depth += nxt != cur
        anc.scatter_(2, nxt[:, :, None], True)
        cur = nxt
    positions.copy_(prefix_lens.long()[:, None] + depth)
    W = tree_mask.shape[2]
    bits = torch.nn.functional.pad(anc.long(), (0, W * 32 - N)).view(B, N, W, 32)
    words = (bits << torch.arange(32, device=dev)).sum(-1)
    tree_mask.copy_(torch.where(words >= 2**31, words - 2**32, words).int())


def build_tree(root_tokens: Tensor, draft_tokens: Tensor, draft_scores: Tensor, draft_parents: Tensor,
               prefix_lens: Tensor, *, num_nodes: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """ops.build_tree's call and outputs, the SGLang way."""
    B, N = root_tokens.shape[0], num_nodes
    new = lambda shape, dtype: root_tokens.new_empty(shape, dtype=dtype)  # noqa: E731
    out = (new((B, N), torch.int64), new((B, N), torch.int32), new((B, N), torch.int64),
           new((B, N, (N + 31) // 32), torch.int32))
    build_tree_into(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, *out)
    return out


def verify_greedy(logits: Tensor, tokens: Tensor, parents: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """ops.verify_greedy's outputs (accept_nodes [B, N] int32 -1 padded, accept_len [B] int32, emitted [B, N]):
    argmax over the vocabulary, then the walk down the tree, a level a step (the smallest matching child)."""
    B, N = tokens.shape
    target = logits.argmax(-1).view(B, N)
    # node j carries its parent's argmax
    carries = (parents >= 0) & (tokens == target.gather(1, parents.long().clamp(min=0)))
    j = torch.arange(N, device=tokens.device)
    cur = torch.zeros(B, 1, dtype=torch.long, device=tokens.device)
    alive = torch.ones(B, 1, dtype=torch.bool, device=tokens.device)
    nodes = [cur]
    for _ in range(N - 1):
        cand = carries & (parents == cur) & alive
        alive = cand.any(1, keepdim=True)
        cur = torch.where(alive, torch.where(cand, j, N).amin(1, keepdim=True), cur)
        nodes.append(torch.where(alive, cur, -1))
    accept_nodes = torch.cat(nodes, 1)
    accept_len = (accept_nodes >= 0).sum(1) - 1
    drafts = torch.where(accept_nodes[:, 1:] >= 0, tokens.gather(1, accept_nodes[:, 1:].clamp(min=0)), -1)
    emitted = torch.cat([drafts, torch.full((B, 1), -1, dtype=tokens.dtype, device=tokens.device)], 1)
    emitted.scatter_(1, accept_len[:, None], target.gather(1, cur))
    return accept_nodes.int(), accept_len.int(), emitted


def kv_accept(caches: Sequence[Tensor], page_table: Tensor, prefix_lens: Tensor, accept_nodes: Tensor,
              accept_len: Tensor) -> None:
    """ops.kv_accept's effect, a gather and a scatter per layer: row prefix + i <- row prefix + accept_nodes[i]
    for i <= accept_len; prefix_lens += accept_len + 1."""
    B, N = accept_nodes.shape
    page = caches[0].shape[1]
    i = torch.arange(N, device=accept_nodes.device)
    start = prefix_lens[:, None].long()
    src = start + torch.where(i <= accept_len[:, None], accept_nodes.long(), i)
    dst = start + i
    src = (page_table.gather(1, src // page).long() * page + src % page).view(B * N)
    dst = (page_table.gather(1, dst // page).long() * page + dst % page).view(B * N)
    for c in caches:
        if c.element_size() == 1 and c.is_floating_point():  # fp8 rows moved as bytes (index_copy_ has no float8
            c = c.view(torch.uint8)                           # kernel on CPU, nor in some CUDA builds of torch)
        flat = c.view(-1, *c.shape[2:])
        flat.index_copy_(0, dst, flat.index_select(0, src))
    prefix_lens += accept_len + 1


def project(drafter, aux: Tensor, rows: Optional[Tensor] = None) -> Tensor:
    """drafter.project's value: the rows gathered, then the drafter's norms and F.linear."""
    with torch.no_grad():
        return drafter.project_train(aux if rows is None else aux[rows])


__all__ = ["build_tree", "build_tree_into", "verify_greedy", "kv_accept", "project"]
