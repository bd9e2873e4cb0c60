"""SGLang-compatible entry points: sgl_kernel's ``build_tree_kernel_efficient`` and ``verify_tree_greedy``
with the same arguments, the same in-place outputs and the same semantics, so an SGLang EAGLE worker
can call these instead (``from eagle3_ops.compat.sglang import build_tree_kernel_efficient``).

Both are vectorised PyTorch on the caller's device: no host synchronisation, fixed shapes, CUDA-graph
capturable. SGLang's conventions kept as they are (see eagle3_ops.tree for the list form):

* Node i >= 1 of request b is the candidate ``selected_index[b, i - 1]`` (SGLang sorts them, so nodes
  are in ascending candidate order); its parent candidate is ``parent_list[b, selected_index // topk]``
  (0 there means the root) and its parent node is 1 + the first position of that candidate in
  ``selected_index[b]``.
* ``retrive_next_token`` / ``retrive_next_sibling`` are written only where SGLang's kernel writes them
  (first children and left siblings); the caller initialises them to -1, as SGLang's caller does.
  ``retrive_index[b, i] = b * N + i``; ``positions[b * N + i] = verified_seq_len[b] + depth``.
* ``verify_tree_greedy``'s ``accept_token_num`` counts accepted *draft* tokens: the bonus token is
  excluded (a step emits ``accept_token_num + 1`` tokens). ``accept_index`` entries past the accepted
  ones and ``predicts`` entries off the accepted path are left as the caller set them.

Where SGLang's kernel has undefined behaviour (a selected candidate whose parent was not selected: it
prints a warning, leaves the node unlinked and walks past the end of the row for the mask), the node
here is left unlinked as in SGLang, and its mask row and position treat it as a child of the root.
"""

from __future__ import annotations

from enum import IntEnum

import torch
from torch import Tensor

from .. import tree

__all__ = ["TreeMaskMode", "build_tree_kernel_efficient", "verify_tree_greedy"]


class TreeMaskMode(IntEnum):
    """SGLang's tree mask layouts (sgl-kernel eagle_utils.cu)."""

    FULL_MASK = 0             # bool, per request a [N, seq_len + N] block, flattened and concatenated
    QLEN_ONLY = 1             # bool [B, N, N]
    QLEN_ONLY_BITPACKING = 2  # uint8 [B * N, 1 | 2 | 4]: bit j of row i set iff node j is i or an ancestor


def _need(t, name: str, dtype: torch.dtype, rank: int, like: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {str(dtype).replace('torch.', '')}, got "
                        f"{str(t.dtype).replace('torch.', '')}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _bytes_per_row(N: int) -> int:
    return 1 if N <= 8 else (2 if N <= 16 else 4)


def build_tree_kernel_efficient(parent_list: Tensor, selected_index: Tensor, verified_seq_len: Tensor,
                                tree_mask: Tensor, positions: Tensor, retrive_index: Tensor,
                                retrive_next_token: Tensor, retrive_next_sibling: Tensor, topk: int, depth: int,
                                draft_token_num: int, tree_mask_mode: int = TreeMaskMode.FULL_MASK) -> None:
    """sgl_kernel.build_tree_kernel_efficient: selected draft candidates -> SGLang's tree tensors, in place.

    Parameters
    ----------
    parent_list : Tensor [B, topk * (depth - 1) + 1] int64
        Candidate index of each expanded beam (entry 0: the root).
    selected_index : Tensor [B, N - 1] int64
        The N - 1 selected candidates per request (flat index; // topk gives the parent's slot).
    verified_seq_len : Tensor [B] int64 | int32
        Verified tokens per request.
    tree_mask : Tensor, mutated
        FULL_MASK: bool [sum(verified_seq_len) * N + B * N * N] (prefix columns are not written);
        QLEN_ONLY: bool [B * N * N]; QLEN_ONLY_BITPACKING: uint8 [B * N, 1 | 2 | 4] (N <= 32).
    positions : Tensor [B * N] int64, mutated
    retrive_index, retrive_next_token, retrive_next_sibling : Tensor [B, N] int64, mutated
        The lists must be -1 on entry (SGLang's caller fills them so).
    topk, depth, draft_token_num : int
        Top-k per step, draft steps, N.
    tree_mask_mode : int
        TreeMaskMode.
    """
    N = int(draft_token_num)
    _need(parent_list, "parent_list", torch.int64, 2, parent_list)
    B, P = parent_list.shape
    if P != topk * (depth - 1) + 1:
        raise ValueError(f"parent_list must have shape (B, topk * (depth - 1) + 1) = ({B}, {topk * (depth - 1) + 1}), "
                         f"got {tuple(parent_list.shape)}")
    _need(selected_index, "selected_index", torch.int64, 2, parent_list)
    if tuple(selected_index.shape) != (B, N - 1):
        raise ValueError(f"selected_index must have shape (B, N - 1) = ({B}, {N - 1}), got {tuple(selected_index.shape)}")
    if verified_seq_len.dtype not in (torch.int32, torch.int64) or tuple(verified_seq_len.shape) != (B,):
        raise ValueError(f"verified_seq_len must be int32 | int64 of shape (B,) = ({B},), got "
                         f"{verified_seq_len.dtype} {tuple(verified_seq_len.shape)}")
    _need(positions, "positions", torch.int64, 1, parent_list)
    if positions.shape[0] != B * N:
        raise ValueError(f"positions must have shape (B * N,) = ({B * N},), got {tuple(positions.shape)}")
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        _need(t, name, torch.int64, 2, parent_list)
        if tuple(t.shape) != (B, N):
            raise ValueError(f"{name} must have shape (B, N) = ({B}, {N}), got {tuple(t.shape)}")
    mode = TreeMaskMode(int(tree_mask_mode))
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        if N > 32:
            raise ValueError(f"QLEN_ONLY_BITPACKING holds at most 32 nodes (4 bytes per row), got N = {N}")
        _need(tree_mask, "tree_mask", torch.uint8, 2, parent_list)
        if tuple(tree_mask.shape) != (B * N, _bytes_per_row(N)):
            raise ValueError(f"tree_mask must have shape (B * N, {_bytes_per_row(N)}), got {tuple(tree_mask.shape)}")
    else:
        _need(tree_mask, "tree_mask", torch.bool, 1, parent_list)
        if mode == TreeMaskMode.QLEN_ONLY and tree_mask.shape[0] != B * N * N:
            raise ValueError(f"tree_mask must have B * N * N = {B * N * N} elements, got {tree_mask.shape[0]}")
    if B == 0:
        return
    dev = parent_list.device
    seq = verified_seq_len.long()

    # Parent node of every node (-1 for the root; an unlinked node, whose parent was not selected: -2).
    sel = selected_index
    parent_slot = torch.div(sel, topk, rounding_mode="floor")
    parent_cand = parent_list.gather(1, parent_slot.clamp(0, P - 1))
    match = sel[:, None, :] == parent_cand[:, :, None]          # [B, N - 1, N - 1]: position p holds the parent
    found = match.any(-1)
    first = match.int().argmax(-1)                              # first True (0 when none)
    pnode = torch.where(parent_slot == 0, 0, torch.where(found, first + 1, -2))
    linked = pnode >= 0
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=dev), pnode], 1)  # [B, N]

    # Lists, written exactly where SGLang writes them.
    idx = torch.arange(N, device=dev)
    retrive_index.copy_(torch.arange(B * N, device=dev).view(B, N))
    link = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=dev), linked], 1)          # [B, N]
    same = (parents[:, None, :] == parents[:, :, None]) & link[:, None, :] & link[:, :, None]  # [B, i, j]
    later = same & (idx[None, None, :] > idx[None, :, None])
    has_next = later.any(-1)
    next_sib = later.int().argmax(-1).long()                    # smallest j > i with the same parent
    retrive_next_sibling.copy_(torch.where(has_next, next_sib, retrive_next_sibling))
    child = (parents[:, None, :] == idx[None, :, None]) & link[:, None, :]                    # [B, p, j]
    has_child = child.any(-1)
    first_child = child.int().argmax(-1).long()
    retrive_next_token.copy_(torch.where(has_child, first_child, retrive_next_token))

    # Depth and the ancestor-or-self relation (unlinked nodes hang from the root).
    canon = torch.where(parents == -2, 0, parents).int()
    depth_ = tree.depth(canon).long()
    positions.copy_((seq[:, None] + depth_).view(-1))
    anc = tree._ancestors(canon)                                 # [B, N, N] bool, row i sees column j

    if mode == TreeMaskMode.QLEN_ONLY:
        tree_mask.view(B, N, N).copy_(anc)
    elif mode == TreeMaskMode.FULL_MASK:
        # row (b, i) starts at N * N * b + N * sum(seq[:b]) + (seq[b] + N) * i; columns seq[b] + j
        before = torch.cumsum(seq, 0) - seq
        start = N * N * torch.arange(B, device=dev) + N * before
        pos = start[:, None, None] + (seq[:, None, None] + N) * idx[None, :, None] + seq[:, None, None] + idx[None, None, :]
        tree_mask.scatter_(0, pos.reshape(-1), anc.reshape(-1))
    else:
        nbytes = _bytes_per_row(N)
        bits = torch.nn.functional.pad(anc, (0, 8 * nbytes - N)).view(B * N, nbytes, 8).to(torch.uint8)
        packed = (bits << torch.arange(8, device=dev, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
        # SGLang sets byte 0 (bit 0: the root) and ORs the ancestors' bits into the others
        tree_mask[:, 0] = packed[:, 0]
        if nbytes > 1:
            tree_mask[:, 1:] |= packed[:, 1:]


def verify_tree_greedy(predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor, candidates: Tensor,
                       retrive_index: Tensor, retrive_next_token: Tensor, retrive_next_sibling: Tensor,
                       target_predict: Tensor) -> None:
    """sgl_kernel.verify_tree_greedy: walk each request's tree following the target's argmax, in place.

    From the root, at the last accepted node (flat row r), the children are tried in list order
    (retrive_next_token, then retrive_next_sibling); the first whose candidate token equals
    target_predict.view(-1)[r] is accepted, for at most S - 1 accepted drafts.

    Parameters
    ----------
    predicts : Tensor [B * N] int32, mutated
        predicts[r] = target_predict at every accepted row r and at the last one.
    accept_index : Tensor [B, S] int32, mutated
        Flat rows (retrive_index values) of the root and the accepted nodes; later entries untouched.
    accept_token_num : Tensor [B] int32, mutated
        Accepted draft tokens, bonus excluded: the step emits accept_token_num + 1 tokens.
    candidates : Tensor [B, N] int64
        Draft token per node (node 0: the verified token).
    retrive_index, retrive_next_token, retrive_next_sibling : Tensor [B, N] int64
        SGLang's lists (build_tree_kernel_efficient's outputs).
    target_predict : Tensor [B, N] int64
        Target argmax per row.
    """
    _need(candidates, "candidates", torch.int64, 2, candidates)
    B, N = candidates.shape
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling), ("target_predict", target_predict)):
        _need(t, name, torch.int64, 2, candidates)
        if tuple(t.shape) != (B, N):
            raise ValueError(f"{name} must have shape (B, N) = ({B}, {N}), got {tuple(t.shape)}")
    _need(predicts, "predicts", torch.int32, 1, candidates)
    if predicts.shape[0] != B * N:
        raise ValueError(f"predicts must have shape (B * N,) = ({B * N},), got {tuple(predicts.shape)}")
    _need(accept_index, "accept_index", torch.int32, 2, candidates)
    if accept_index.shape[0] != B:
        raise ValueError(f"accept_index must have shape (B, S) with B = {B}, got {tuple(accept_index.shape)}")
    _need(accept_token_num, "accept_token_num", torch.int32, 1, candidates)
    if accept_token_num.shape[0] != B:
        raise ValueError(f"accept_token_num must have shape (B,) = ({B},), got {tuple(accept_token_num.shape)}")
    S = accept_index.shape[1]
    if B == 0 or S == 0:
        return
    dev = candidates.device
    flat_target = target_predict.reshape(-1)
    # Link targets as local indices with a sentinel N that points at itself (-1 and out-of-range links).
    local = lambda link: torch.where((link >= 0) & (link < N), link, N)  # noqa: E731
    sentinel = torch.full((B, 1), N, dtype=torch.int64, device=dev)
    nxt_sib = torch.cat([local(retrive_next_sibling), sentinel], 1)
    first_child = torch.cat([local(retrive_next_token), sentinel], 1)
    cand = torch.cat([candidates, torch.full((B, 1), -1, dtype=torch.int64, device=dev)], 1)
    rounds = max(N, 2).bit_length()

    last = retrive_index[:, 0].clone()
    accept_index[:, 0] = last.int()
    num = torch.zeros(B, dtype=torch.int64, device=dev)
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    for _ in range(1, S):
        target = flat_target.gather(0, last.clamp(0, B * N - 1))
        head = first_child.gather(1, cur[:, None]).squeeze(1)
        # first node along the sibling chain from head whose token matches: pointer doubling over
        # jump(i) = i if it matches else next_sibling(i)
        jump = torch.where(cand == target[:, None], torch.arange(N + 1, device=dev), nxt_sib)
        for _ in range(rounds):
            jump = jump.gather(1, jump)
        hit = jump.gather(1, head[:, None]).squeeze(1)
        acc = alive & (hit < N)
        draft_index = retrive_index.gather(1, hit.clamp(max=N - 1)[:, None]).squeeze(1)
        safe_last = last.clamp(0, B * N - 1)
        predicts.scatter_(0, safe_last, torch.where(acc, target.int(), predicts.gather(0, safe_last)))
        num = num + acc.long()
        col = num.clamp(max=S - 1)[:, None]
        accept_index.scatter_(1, col, torch.where(acc[:, None], draft_index.int()[:, None], accept_index.gather(1, col)))
        last = torch.where(acc, draft_index, last)
        cur = torch.where(acc, hit, cur)
        alive = acc
    accept_token_num.copy_(num.int())
    safe_last = last.clamp(0, B * N - 1)
    predicts.scatter_(0, safe_last, flat_target.gather(0, safe_last).int())
