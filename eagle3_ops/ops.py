"""Typed public wrappers: allocate the outputs the caller did not pass, then make one torch.ops.eagle3
call. Arguments keep the op schema's names and order (csrc/registration.cpp); keyword-only extras only
size outputs. The docstrings of eagle3_ops.reference are the full specification of each op.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "capture_aux", "add_rmsnorm_capture", "fc_proj", "build_tree", "tree_attention_mla", "tree_attention",
    "verify_greedy", "verify_sampling", "kv_accept", "prepare_fc_weight",
]

_ops = torch.ops.eagle3


def capture_aux(hidden: Tensor, residual: Optional[Tensor], aux: Tensor, slot: int, rows: Optional[Tensor] = None) -> None:
    """aux[r, slot*H:(slot+1)*H] = (hidden + residual)[rows[r]] (reference.capture_aux)."""
    _ops.capture_aux(hidden, residual, aux, slot, rows)


def add_rmsnorm_capture(x: Tensor, residual: Tensor, weight: Tensor, eps: float, aux: Optional[Tensor] = None,
                        slot: int = 0, rows: Optional[Tensor] = None) -> None:
    """In place: residual += x; x = rmsnorm(residual) * weight; aux slot <- residual[rows] (reference.add_rmsnorm_capture)."""
    _ops.add_rmsnorm_capture(x, residual, weight, eps, aux, slot, rows)


def fc_proj(aux: Tensor, weight: Tensor, weight_scale: Optional[Tensor] = None, norm_weight: Optional[Tensor] = None,
            eps: float = 1e-6, norm_mode: str = "none", rows: Optional[Tensor] = None,
            out: Optional[Tensor] = None) -> Tensor:
    """Drafter fc [R, n_aux * H] -> [R, Hd] (reference.fc_proj). Returns out, allocated in aux's dtype if not given."""
    if out is None:
        R = aux.shape[0] if rows is None else rows.shape[0]
        out = aux.new_empty((R, weight.shape[0]))
    _ops.fc_proj(aux, weight, weight_scale, norm_weight, eps, norm_mode, rows, out)
    return out


def prepare_fc_weight(weight: Tensor, norm_mode: str = "none", norm_weight: Optional[Tensor] = None,
                      fp8: bool = False) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """The drafter's fc weight in the form fc_proj wants, computed once at load.

    Folds the norm weight into the weight's columns (an RMSNorm's weight multiplies column k of the fc:
    for "fc_norm" the stacked [n_aux, H] chunk weights, for "norm_before_fc" the [n_aux * H] weight), in
    fp32 and rounded once; optionally quantises to fp8-e4m3 with a per-output-channel fp32 scale
    (amax / 448).

    Parameters
    ----------
    weight : Tensor [Hd, n_aux * H] bf16 | fp16 | fp32
        fc weight in nn.Linear layout.
    norm_mode : str
        fc_proj's norm mode: "none", "norm_before_fc" or "fc_norm".
    norm_weight : Tensor, optional
        [n_aux * H] for "norm_before_fc" (None = ones), [n_aux, H] for "fc_norm"; None for "none".
    fp8 : bool
        Quantise to float8_e4m3fn with a per-output-channel scale.

    Returns
    -------
    (weight, weight_scale, norm_weight) to pass to fc_proj: weight [Hd, n_aux * H] (weight's dtype, or
    fp8), weight_scale [Hd] fp32 or None, norm_weight ones [n_aux, H] for "fc_norm" (it still gives
    n_aux) and None otherwise.
    """
    from . import _validate

    _validate.tensor(weight, "weight", dtypes=_validate.FLOATS, dim=2)
    if norm_mode not in _validate.NORM_MODES:
        raise ValueError(f"norm_mode must be one of {_validate.NORM_MODES}, got {norm_mode!r}")
    K = weight.shape[1]
    w = weight.float()
    out_norm = None
    if norm_mode == "none" and norm_weight is not None:
        raise ValueError("norm_weight must be None with norm_mode 'none'")
    if norm_mode == "fc_norm":
        if norm_weight is None or norm_weight.dim() != 2 or norm_weight.numel() != K:
            got = None if norm_weight is None else tuple(norm_weight.shape)
            raise ValueError(f"norm_weight must have shape (n_aux, H) with n_aux * H = {K}, got {got}")
        out_norm = torch.ones_like(norm_weight)
    if norm_weight is not None:
        if norm_weight.numel() != K:
            raise ValueError(f"norm_weight must have n_aux * H = {K} elements, got shape {tuple(norm_weight.shape)}")
        w = w * norm_weight.float().reshape(1, K)
    if not fp8:
        return w.to(weight.dtype), None, out_norm
    if not _validate.FP8:
        raise TypeError("fp8=True needs torch.float8_e4m3fn (torch >= 2.1)")
    scale = (w.abs().amax(dim=1) / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).to(_validate.FP8[0]), scale.contiguous(), out_norm


def build_tree(root_tokens: Tensor, draft_tokens: Tensor, draft_scores: Tensor, draft_parents: Tensor,
               prefix_lens: Tensor, tokens: Optional[Tensor] = None, parents: Optional[Tensor] = None,
               positions: Optional[Tensor] = None, tree_mask: Optional[Tensor] = None, *,
               num_nodes: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Top N - 1 draft candidates -> canonical tree (reference.build_tree).

    Outputs not passed are allocated with N = num_nodes (or tokens.shape[1]).
    Returns (tokens [B, N] int64, parents [B, N] int32, positions [B, N] int64, tree_mask [B, N, W] int32).
    """
    B = root_tokens.shape[0]
    N = num_nodes if num_nodes is not None else (tokens.shape[1] if tokens is not None else None)
    if N is None:
        raise ValueError("pass num_nodes (N) or a preallocated tokens [B, N] tensor")
    new = lambda shape, dtype: root_tokens.new_empty(shape, dtype=dtype)  # noqa: E731
    tokens = new((B, N), torch.int64) if tokens is None else tokens
    parents = new((B, N), torch.int32) if parents is None else parents
    positions = new((B, N), torch.int64) if positions is None else positions
    tree_mask = new((B, N, (N + 31) // 32), torch.int32) if tree_mask is None else tree_mask
    _ops.build_tree(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, tokens, parents, positions,
                    tree_mask)
    return tokens, parents, positions, tree_mask


def _attention_outputs(q, out, lse, return_lse, v_dim):
    if out is None:
        out = q.new_empty((q.shape[0], q.shape[1], v_dim))
    if lse is None and return_lse:
        lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    return out, lse


def tree_attention_mla(q: Tensor, kv_cache: Tensor, page_table: Tensor, prefix_lens: Tensor, tree_mask: Tensor,
                       scale: float, out: Optional[Tensor] = None, lse: Optional[Tensor] = None,
                       kv_scale: Optional[Tensor] = None, *, return_lse: bool = False, v_dim: Optional[int] = None):
    """Absorbed-MLA tree-verify attention (reference.tree_attention_mla).

    out defaults to [B * N, NH, v_dim] with v_dim = D - 64 (512 for D = 576), in q's dtype. An fp8 e4m3
    kv_cache takes its per-tensor dequantisation scale kv_scale ([] or [1] fp32: key = fp8 * kv_scale).
    Returns out, or (out, lse) when return_lse or lse is given.
    """
    out, lse_out = _attention_outputs(q, out, lse, return_lse, v_dim or q.shape[2] - 64)
    _ops.tree_attention_mla(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse_out, kv_scale)
    return (out, lse_out) if lse_out is not None else out


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, prefix_lens: Tensor,
                   tree_mask: Tensor, scale: float, out: Optional[Tensor] = None, lse: Optional[Tensor] = None, *,
                   return_lse: bool = False):
    """GQA/MHA tree-verify attention (reference.tree_attention). Returns out, or (out, lse)."""
    out, lse_out = _attention_outputs(q, out, lse, return_lse, v_cache.shape[-1])
    _ops.tree_attention(q, k_cache, v_cache, page_table, prefix_lens, tree_mask, scale, out, lse_out)
    return (out, lse_out) if lse_out is not None else out


def verify_greedy(logits: Tensor, tokens: Tensor, parents: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy tree verification (reference.verify_greedy).

    Returns (accept_nodes [B, N] int32, accept_len [B] int32 (drafts only: a step emits accept_len + 1
    tokens), emitted [B, N] int64).
    """
    return _ops.verify_greedy(logits, tokens, parents)


def verify_sampling(logits: Tensor, draft_probs: Optional[Tensor], d2t: Optional[Tensor], tokens: Tensor,
                    parents: Tensor, temperature: Tensor, seed: Tensor, offset: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Tree rejection sampling (reference.verify_sampling). Returns (accept_nodes, accept_len, emitted)
    as verify_greedy; accept_len excludes the bonus token."""
    return _ops.verify_sampling(logits, draft_probs, d2t, tokens, parents, temperature, seed, offset)


def kv_accept(caches: Sequence[Tensor], page_table: Tensor, prefix_lens: Tensor, accept_nodes: Tensor,
              accept_len: Tensor) -> None:
    """Compact accepted tree rows in every layer's cache in one call; prefix_lens += accept_len + 1 (reference.kv_accept).
    Any cache dtype, fp8 e4m3 latent caches included: rows move as bytes, no scale."""
    _ops.kv_accept(list(caches), page_table, prefix_lens, accept_nodes, accept_len)
