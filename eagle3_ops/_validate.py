"""Argument checks, one function per op with the op's own signature.

They look only at shapes, dtypes, devices and layout (never at values, so they run on fake tensors
too), raise ValueError (shape, device, layout, range of a scalar) or TypeError (dtype, not a tensor)
with a message naming the argument and what was expected, and return the sizes they derived. The CPU
references, the fake implementations and the Triton launchers all call them before touching anything,
so a failed call never writes into the caller's tensors. Value checks (indices in range) live in the
references, which are allowed to look at values.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX = (torch.int32, torch.int64)
FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn",) if hasattr(torch, n))
NORM_MODES = ("none", "norm_before_fc", "fc_norm")


def _names(dtypes) -> str:
    return " | ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(t, name: str, *, dtypes=None, shape=None, dim: Optional[int] = None, like: Optional[Tensor] = None,
           like_name: str = "", last_contiguous: bool = False, contiguous: bool = False) -> Tensor:
    """Check one tensor argument. `shape` is a tuple of (symbol, size) pairs; size None = any."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None:
        want = tuple(s for _, s in shape)
        ok = t.dim() == len(want) and all(w is None or w == g for w, g in zip(want, t.shape))
        if not ok:
            syms = ", ".join(sym for sym, _ in shape)
            vals = ", ".join("*" if s is None else str(s) for s in want)
            raise ValueError(f"{name} must have shape ({syms}) = ({vals}), got {tuple(t.shape)}")
    elif dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if like is not None and t.device != like.device:
        raise ValueError(f"{name} must be on the same device as {like_name} ({like.device}), got {t.device}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    return t


def _rows(rows, like, like_name) -> Optional[int]:
    if rows is None:
        return None
    tensor(rows, "rows", dtypes=INDEX, dim=1, like=like, like_name=like_name, contiguous=True)
    return rows.shape[0]


def _aux_slot(src, src_name, aux, slot, rows) -> dict:
    """aux [R, n_aux * H] receives src [T, H] rows into column block `slot`."""
    T, H = src.shape
    tensor(aux, "aux", dtypes=(src.dtype,), dim=2, like=src, like_name=src_name, last_contiguous=True)
    if H == 0 or aux.shape[1] % H != 0:
        raise ValueError(f"aux must have shape (R, n_aux * H) with H = {H}, got {tuple(aux.shape)}")
    n_aux = aux.shape[1] // H
    if not 0 <= slot < n_aux:
        raise ValueError(f"slot must be in [0, n_aux) = [0, {n_aux}), got {slot}")
    R = _rows(rows, src, src_name)
    R = T if R is None else R
    if aux.shape[0] != R:
        raise ValueError(f"aux must have R = {R} rows ({'rows.shape[0]' if rows is not None else 'T'}), "
                         f"got {aux.shape[0]}")
    return dict(T=T, H=H, n_aux=n_aux, R=R)


def capture_aux(hidden, residual, aux, slot, rows) -> dict:
    tensor(hidden, "hidden", dtypes=FLOATS, dim=2, last_contiguous=True)
    T, H = hidden.shape
    if residual is not None:
        tensor(residual, "residual", dtypes=(hidden.dtype,), shape=(("T", T), ("H", H)), like=hidden,
               like_name="hidden", last_contiguous=True)
    return _aux_slot(hidden, "hidden", aux, slot, rows)


def add_rmsnorm_capture(x, residual, weight, eps, aux, slot, rows) -> dict:
    tensor(x, "x", dtypes=FLOATS, dim=2, last_contiguous=True)
    T, H = x.shape
    # x's dtype, or an fp32 residual stream beside bf16/fp16 activations (what the CUDA kernel supports)
    tensor(residual, "residual", dtypes=tuple(dict.fromkeys((x.dtype, torch.float32))), shape=(("T", T), ("H", H)),
           like=x, like_name="x", last_contiguous=True)
    tensor(weight, "weight", dtypes=FLOATS, shape=(("H", H),), like=x, like_name="x", contiguous=True)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if aux is None:
        if rows is not None:
            raise ValueError("rows selects aux rows: pass aux too, or leave rows None")
        return dict(T=T, H=H)
    return _aux_slot(residual, "residual", aux, slot, rows)


def fc_proj(aux, weight, weight_scale, norm_weight, eps, norm_mode, rows, out) -> dict:
    tensor(aux, "aux", dtypes=FLOATS, dim=2, last_contiguous=True)
    T, K = aux.shape
    tensor(weight, "weight", dtypes=FLOATS + FP8, dim=2, like=aux, like_name="aux", contiguous=True)
    if weight.shape[1] != K:
        raise ValueError(f"weight must have shape (Hd, n_aux * H) = (*, {K}) to match aux, got {tuple(weight.shape)}")
    Hd = weight.shape[0]
    if weight.dtype in FP8 and weight_scale is None:
        raise ValueError("weight_scale [Hd] float32 is required with an fp8 weight (per-output-channel scale)")
    if weight_scale is not None:
        tensor(weight_scale, "weight_scale", dtypes=(torch.float32,), shape=(("Hd", Hd),), like=aux, like_name="aux",
               contiguous=True)
    if norm_mode not in NORM_MODES:
        raise ValueError(f"norm_mode must be one of {NORM_MODES}, got {norm_mode!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    n_aux = 1
    if norm_mode == "none" and norm_weight is not None:
        raise ValueError("norm_weight must be None with norm_mode 'none'")
    if norm_mode == "norm_before_fc" and norm_weight is not None:
        tensor(norm_weight, "norm_weight", dtypes=FLOATS, shape=(("n_aux * H", K),), like=aux, like_name="aux",
               contiguous=True)
    if norm_mode == "fc_norm":
        if norm_weight is None:
            raise ValueError("norm_weight [n_aux, H] is required with norm_mode 'fc_norm' (ones if folded into weight)")
        tensor(norm_weight, "norm_weight", dtypes=FLOATS, dim=2, like=aux, like_name="aux", contiguous=True)
        n_aux = norm_weight.shape[0]
        if n_aux == 0 or n_aux * norm_weight.shape[1] != K:
            raise ValueError(f"norm_weight must have shape (n_aux, H) with n_aux * H = {K}, got {tuple(norm_weight.shape)}")
    R = _rows(rows, aux, "aux")
    R = T if R is None else R
    tensor(out, "out", dtypes=FLOATS, shape=(("R", R), ("Hd", Hd)), like=aux, like_name="aux", last_contiguous=True)
    return dict(T=T, K=K, Hd=Hd, R=R, n_aux=n_aux)


def build_tree(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, tokens, parents, positions,
               tree_mask) -> dict:
    tensor(root_tokens, "root_tokens", dtypes=(torch.int64,), dim=1, contiguous=True)
    B = root_tokens.shape[0]
    like = dict(like=root_tokens, like_name="root_tokens", contiguous=True)
    tensor(draft_tokens, "draft_tokens", dtypes=(torch.int64,), dim=3, **like)
    _, S, M = draft_tokens.shape
    bsm = (("B", B), ("S", S), ("M", M))
    tensor(draft_tokens, "draft_tokens", shape=bsm)
    tensor(draft_scores, "draft_scores", dtypes=FLOATS, shape=bsm, **like)
    tensor(draft_parents, "draft_parents", dtypes=INDEX, shape=bsm, **like)
    tensor(prefix_lens, "prefix_lens", dtypes=(torch.int32,), shape=(("B", B),), **like)
    tensor(tokens, "tokens", dtypes=(torch.int64,), dim=2, **like)
    N = tokens.shape[1]
    bn = (("B", B), ("N", N))
    tensor(tokens, "tokens", shape=bn)
    if not 1 <= N <= 1 + S * M:
        raise ValueError(f"tokens must have N in [1, 1 + S * M] = [1, {1 + S * M}] nodes, got N = {N}")
    tensor(parents, "parents", dtypes=(torch.int32,), shape=bn, **like)
    tensor(positions, "positions", dtypes=(torch.int64,), shape=bn, **like)
    W = (N + 31) // 32
    tensor(tree_mask, "tree_mask", dtypes=(torch.int32,), shape=bn + (("W", W),), **like)
    return dict(B=B, S=S, M=M, N=N, W=W)


def _tree_block(page_table, prefix_lens, tree_mask, like, like_name) -> dict:
    # page_table may be a row-slice of an engine's larger table (row stride free); the rest contiguous
    tensor(page_table, "page_table", dtypes=(torch.int32,), dim=2, like=like, like_name=like_name,
           last_contiguous=True)
    B = page_table.shape[0]
    tensor(prefix_lens, "prefix_lens", dtypes=(torch.int32,), shape=(("B", B),), like=like, like_name=like_name,
           contiguous=True)
    tensor(tree_mask, "tree_mask", dtypes=(torch.int32,), dim=3, like=like, like_name=like_name, contiguous=True)
    N, W = tree_mask.shape[1], tree_mask.shape[2]
    if tree_mask.shape[0] != B or W != (N + 31) // 32 or N == 0:
        raise ValueError(f"tree_mask must have shape (B, N, ceil(N / 32)) with B = {B} and N >= 1, "
                         f"got {tuple(tree_mask.shape)}")
    return dict(B=B, N=N, W=W, max_pages=page_table.shape[1])


def _kv_scale(kv_cache, kv_scale, q) -> None:
    """An fp8 e4m3 kv_cache needs its dequantisation scale kv_scale ([] or [1] fp32 on q's device; the key is
    fp8 * kv_scale, vLLM's per-tensor k_scale for MLA) and bf16 / fp16 queries; a bf16 / fp16 / fp32 cache
    takes no scale (the engines ignore theirs there: refused, not silently dropped)."""
    if kv_cache.dtype in FP8:
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"q must have dtype bfloat16 | float16 with an fp8 kv_cache, got "
                            f"{str(q.dtype).replace('torch.', '')}")
        if kv_scale is None:
            raise ValueError("kv_scale [] or [1] float32 is required with an fp8 kv_cache (its dequantisation scale: "
                             "key = fp8 * kv_scale; vLLM's layer._k_scale, 1.0 for SGLang's unscaled cast)")
    elif kv_scale is not None:
        raise ValueError(f"kv_scale must be None with a {str(kv_cache.dtype).replace('torch.', '')} kv_cache (it is "
                         "the dequantisation scale of an fp8 e4m3 cache)")
    if kv_scale is not None:
        tensor(kv_scale, "kv_scale", dtypes=(torch.float32,), like=q, like_name="q")
        if kv_scale.dim() > 1 or kv_scale.numel() != 1:
            raise ValueError(f"kv_scale must have shape () or (1,), got {tuple(kv_scale.shape)}")


def tree_attention_mla(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, kv_scale=None) -> dict:
    tensor(q, "q", dtypes=FLOATS, dim=3, last_contiguous=True)
    tensor(kv_cache, "kv_cache", dtypes=tuple(dict.fromkeys((q.dtype,) + FP8)), dim=3, like=q, like_name="q",
           contiguous=True)
    _kv_scale(kv_cache, kv_scale, q)
    s = _tree_block(page_table, prefix_lens, tree_mask, q, "q")
    B, N = s["B"], s["N"]
    NH, D = q.shape[1], q.shape[2]
    tensor(q, "q", shape=(("B * N", B * N), ("NH", NH), ("D", D)))
    if kv_cache.shape[2] != D:
        raise ValueError(f"kv_cache must have shape (num_pages, page_size, D) with D = {D} (q's), got {tuple(kv_cache.shape)}")
    tensor(out, "out", dtypes=(q.dtype,), dim=3, like=q, like_name="q", last_contiguous=True)
    Dv = out.shape[2]
    tensor(out, "out", shape=(("B * N", B * N), ("NH", NH), ("Dv", Dv)))
    if not 0 < Dv <= D:
        raise ValueError(f"out must have Dv in [1, D] = [1, {D}] (V is the first Dv dims of the latent), got {Dv}")
    if lse is not None:
        tensor(lse, "lse", dtypes=(torch.float32,), shape=(("B * N", B * N), ("NH", NH)), like=q, like_name="q",
               contiguous=True)
    if not 0 < scale < float("inf"):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return s | dict(NH=NH, D=D, Dv=Dv, num_pages=kv_cache.shape[0], page_size=kv_cache.shape[1])


def tree_attention(q, k_cache, v_cache, page_table, prefix_lens, tree_mask, scale, out, lse) -> dict:
    tensor(q, "q", dtypes=FLOATS, dim=3, last_contiguous=True)
    tensor(k_cache, "k_cache", dtypes=(q.dtype,), dim=4, like=q, like_name="q", contiguous=True)
    P, ps, HKV, Dh = k_cache.shape
    tensor(v_cache, "v_cache", dtypes=(q.dtype,), dim=4, like=q, like_name="q", contiguous=True)
    Dv = v_cache.shape[3]
    tensor(v_cache, "v_cache", shape=(("num_pages", P), ("page_size", ps), ("HKV", HKV), ("Dv", Dv)))
    s = _tree_block(page_table, prefix_lens, tree_mask, q, "q")
    B, N = s["B"], s["N"]
    NH = q.shape[1]
    tensor(q, "q", shape=(("B * N", B * N), ("NH", NH), ("Dh", Dh)))
    if HKV == 0 or NH % HKV != 0:
        raise ValueError(f"q's NH = {NH} must be a multiple of k_cache's HKV = {HKV}")
    tensor(out, "out", dtypes=(q.dtype,), shape=(("B * N", B * N), ("NH", NH), ("Dv", Dv)), like=q, like_name="q",
           last_contiguous=True)
    if lse is not None:
        tensor(lse, "lse", dtypes=(torch.float32,), shape=(("B * N", B * N), ("NH", NH)), like=q, like_name="q",
               contiguous=True)
    if not 0 < scale < float("inf"):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return s | dict(NH=NH, HKV=HKV, Dh=Dh, Dv=Dv, num_pages=P, page_size=ps)


def _tree(tokens, parents, like, like_name) -> tuple[int, int]:
    tensor(tokens, "tokens", dtypes=(torch.int64,), dim=2, like=like, like_name=like_name, contiguous=True)
    B, N = tokens.shape
    if N == 0:
        raise ValueError("tokens must have N >= 1 nodes (node 0 is the root)")
    tensor(parents, "parents", dtypes=(torch.int32,), shape=(("B", B), ("N", N)), like=like, like_name=like_name,
           contiguous=True)
    return B, N


def _verify_logits(logits, tokens, parents) -> tuple[int, int, int]:
    """The verify ops' shared checks: logits [B * N, V] (float, last dim contiguous) of the tree (tokens,
    parents); (B, N, V)."""
    tensor(logits, "logits", dtypes=FLOATS, dim=2, last_contiguous=True)
    B, N = _tree(tokens, parents, logits, "logits")
    V = logits.shape[1]
    tensor(logits, "logits", shape=(("B * N", B * N), ("V", V)))
    return B, N, V


def verify_greedy(logits, tokens, parents) -> dict:
    B, N, V = _verify_logits(logits, tokens, parents)
    if V == 0:
        raise ValueError("logits must have V >= 1")
    return dict(B=B, N=N, V=V)


def verify_sampling(logits, draft_probs, d2t, tokens, parents, temperature, seed, offset) -> dict:
    B, N, V = _verify_logits(logits, tokens, parents)
    if V == 0:
        raise ValueError("logits must have 1 <= V < 2**31, got V = 0")
    like = dict(like=logits, like_name="logits")
    Vd = V
    if draft_probs is not None:
        tensor(draft_probs, "draft_probs", dtypes=FLOATS, dim=2, last_contiguous=True, **like)
        Vd = draft_probs.shape[1]
        tensor(draft_probs, "draft_probs", shape=(("B * N", B * N), ("Vd", Vd)))
    if d2t is not None:
        if draft_probs is None:
            raise ValueError("d2t maps draft_probs' vocabulary to the target's: pass draft_probs too, or d2t=None")
        tensor(d2t, "d2t", dtypes=(torch.int64,), shape=(("Vd", Vd),), contiguous=True, **like)
    elif Vd != V:
        raise ValueError(f"draft_probs has Vd = {Vd} != V = {V}: pass d2t [Vd] int64 (target = draft + d2t[draft])")
    tensor(temperature, "temperature", dtypes=(torch.float32,), shape=(("B", B),), contiguous=True, **like)
    tensor(seed, "seed", dtypes=(torch.int64,), shape=(("B", B),), contiguous=True, **like)
    tensor(offset, "offset", dtypes=(torch.int64,), shape=(("B", B),), contiguous=True, **like)
    return dict(B=B, N=N, V=V, Vd=Vd)


def kv_accept(caches: Sequence[Tensor], page_table, prefix_lens, accept_nodes, accept_len) -> dict:
    if isinstance(caches, Tensor) or len(caches) == 0:
        raise TypeError("caches must be a non-empty list of per-layer cache tensors [num_pages, page_size, ...]")
    first = tensor(caches[0], "caches[0]", dim=None)
    if first.dim() < 3:
        raise ValueError(f"caches[0] must have shape (num_pages, page_size, ...), got {tuple(first.shape)}")
    P, ps = first.shape[0], first.shape[1]
    for i, c in enumerate(caches):
        tensor(c, f"caches[{i}]", like=first, like_name="caches[0]")
        if c.dim() < 3 or c.shape[0] != P or c.shape[1] != ps:
            raise ValueError(f"caches[{i}] must have shape (num_pages, page_size, ...) = ({P}, {ps}, ...) like "
                             f"caches[0], got {tuple(c.shape)}")
        if not c.is_contiguous():
            raise ValueError(f"caches[{i}] must be contiguous")
    tensor(page_table, "page_table", dtypes=(torch.int32,), dim=2, like=first, like_name="caches[0]",
           last_contiguous=True)
    B = page_table.shape[0]
    tensor(prefix_lens, "prefix_lens", dtypes=(torch.int32,), shape=(("B", B),), like=first, like_name="caches[0]",
           contiguous=True)
    tensor(accept_nodes, "accept_nodes", dtypes=(torch.int32,), dim=2, like=first, like_name="caches[0]",
           contiguous=True)
    W = accept_nodes.shape[1]  # any width: the tree's N, SGLang's steps + 1
    tensor(accept_nodes, "accept_nodes", shape=(("B", B), ("W", W)))
    if W == 0:
        raise ValueError("accept_nodes must have W >= 1 columns")
    tensor(accept_len, "accept_len", dtypes=(torch.int32,), shape=(("B", B),), like=first, like_name="caches[0]",
           contiguous=True)
    return dict(B=B, W=W, num_pages=P, page_size=ps, max_pages=page_table.shape[1])
