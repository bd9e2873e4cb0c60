"""SGLang's Python-level EAGLE helpers (sglang.srt.speculative.eagle_utils) on eagle3_ops.compat.sglang.

SGLang's worker does not call sgl-kernel's build directly: it calls ``organize_draft_results`` (top N - 1
of the flattened draft scores, sorted; their tokens; the concatenated parent lists) and then its own
``build_tree_kernel_efficient``, which allocates the mask and lists for the chosen mode and calls the
kernel. These are the same two functions with SGLang's arguments and return values, the kernel being
eagle3_ops.compat.sglang's; ``verify_tree_greedy_func`` is SGLang's greedy entry (``retrieve_*`` names).
Swap ``from sglang.srt.speculative.eagle_utils import ...`` for ``from eagle3_ops.compat.sglang_srt import ...``.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor

from .sglang import TreeMaskMode, verify_tree_greedy
from .sglang import build_tree_kernel_efficient as _build_kernel

__all__ = ["TreeMaskMode", "organize_draft_results", "build_tree_kernel_efficient", "verify_tree_greedy_func"]


def organize_draft_results(score_list: List[Tensor], token_list: List[Tensor], parents_list: List[Tensor],
                           num_draft_token: int) -> tuple[Tensor, Tensor, Tensor]:
    """The draft steps' outputs -> (parent_list [B, topk * (steps - 1) + 1], selected [B, N - 1] ascending,
    their tokens [B, N - 1]); parent_list is [B, 0] after one draft step.

    Parameters
    ----------
    score_list : list of Tensor [B, 1 | topk, topk] fp32
        Cumulative scores per draft step (step 0: the root's topk).
    token_list : list of Tensor [B, topk | topk * topk] int64
        Candidate tokens per step, flattened in the same order.
    parents_list : list of Tensor [B, topk + 1 | topk] int64
        The expanded beams' flat indices per step (the last step's are unused).
    num_draft_token : int
        N, the tree's nodes with the root.
    """
    scores = torch.cat(score_list, dim=1).flatten(1)
    tokens = torch.cat(token_list, dim=1)
    selected = torch.sort(torch.topk(scores, num_draft_token - 1, dim=-1).indices).values
    draft_tokens = torch.gather(tokens, 1, selected)
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty(parents_list[0].shape[0], 0, dtype=torch.long, device=parents_list[0].device)
    return parent_list, selected, draft_tokens


def build_tree_kernel_efficient(verified_id: Optional[Tensor] = None, parent_list: Optional[Tensor] = None,
                                top_scores_index: Optional[Tensor] = None, draft_tokens: Optional[Tensor] = None,
                                seq_lens: Optional[Tensor] = None, seq_lens_sum: Optional[int] = None,
                                topk: int = 1, spec_steps: int = 1, num_verify_tokens: int = 1,
                                tree_mask_mode: int = TreeMaskMode.FULL_MASK, tree_mask_buf: Optional[Tensor] = None,
                                position_buf: Optional[Tensor] = None, *, bonus_tokens: Optional[Tensor] = None):
    """SGLang's build: allocate the mode's mask and the lists, build the tree in them, prepend the root tokens.

    Parameters
    ----------
    verified_id : Tensor [B] (``bonus_tokens`` in the newest SGLang; either name)
        Each request's last verified token (the root).
    parent_list, top_scores_index, draft_tokens : organize_draft_results' three outputs
    seq_lens : Tensor [B] int64 | int32
        Verified tokens per request.
    seq_lens_sum : int
        sum(seq_lens), on the host (sizes the FULL_MASK buffer).
    topk, spec_steps, num_verify_tokens : int
        Top-k per step, draft steps, N.
    tree_mask_mode : int
        TreeMaskMode; the packed mask is [B * N] uint8 | uint16 | uint32 by N, as SGLang allocates it.
    tree_mask_buf, position_buf : Tensor, optional
        Preallocated mask (refilled: True, or 0 when packed) and positions.

    Returns
    -------
    tree_mask, positions [B * N] int64, retrive_index, retrive_next_token, retrive_next_sibling [B, N] int64,
    draft_tokens [B * N] (root first per request)
    """
    root = bonus_tokens if verified_id is None else verified_id
    if root is None:
        raise TypeError("build_tree_kernel_efficient needs verified_id (or bonus_tokens)")
    draft_tokens = torch.cat((root.unsqueeze(1), draft_tokens), dim=1).flatten()
    B, N, dev = seq_lens.numel(), int(num_verify_tokens), seq_lens.device
    mode = TreeMaskMode(int(tree_mask_mode))
    if tree_mask_buf is not None:
        tree_mask = tree_mask_buf
        tree_mask.fill_(0 if mode == TreeMaskMode.QLEN_ONLY_BITPACKING else True)
    elif mode == TreeMaskMode.QLEN_ONLY:
        tree_mask = torch.full((N * B * N,), True, dtype=torch.bool, device=dev)
    elif mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        dtype = (torch.uint8, torch.uint16, torch.uint32)[int(math.ceil(math.log2((N + 7) // 8)))]
        tree_mask = torch.zeros((N * B,), dtype=dtype, device=dev)
    else:
        tree_mask = torch.full((int(seq_lens_sum) * N + N * N * B,), True, dtype=torch.bool, device=dev)
    retrive_index, retrive_next_token, retrive_next_sibling = torch.full((3, B, N), -1, dtype=torch.long, device=dev)
    positions = position_buf if position_buf is not None else torch.empty(B * N, dtype=torch.long, device=dev)
    _build_kernel(parent_list, top_scores_index, seq_lens, tree_mask, positions, retrive_index, retrive_next_token,
                  retrive_next_sibling, topk, spec_steps, N, mode)
    return tree_mask, positions, retrive_index, retrive_next_token, retrive_next_sibling, draft_tokens


def verify_tree_greedy_func(predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor, candidates: Tensor,
                            retrieve_index: Tensor, retrieve_next_token: Tensor, retrieve_next_sibling: Tensor,
                            target_predict: Tensor, topk: int = -1) -> tuple[Tensor, Tensor, Tensor]:
    """SGLang's greedy verify entry: eagle3_ops.compat.sglang.verify_tree_greedy; returns its three outputs
    (topk is accepted and unused, as in SGLang's CUDA path)."""
    verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
                       retrieve_next_sibling, target_predict)
    return predicts, accept_index, accept_token_num
