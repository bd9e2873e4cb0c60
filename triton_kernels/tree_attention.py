"""Tree-verify attention over a paged KV cache, in Triton: `tree_attention_mla` (absorbed MLA, one latent
KV head shared by every query head) and `tree_attention` (GQA/MHA). One kernel serves both. (On Hopper,
bf16 / fp16 MLA at 576 / 512 dims goes to the CUDA kernel csrc/mla_decode_sm90.cu instead: see
tree_attention_mla below; the split rule and the merge of split partials are _attention_common.py's, shared
with it and with mla_decode.py's Triton kernel.)

Work decomposition (flash-decoding): a program owns BLOCK_M query rows of one (request, KV head) - the
rows are (node, query head) pairs flattened node-major, so for MLA 64 heads x N nodes share every KV
tile a program loads - and one split of that request's prefix. Each KV tile is read once per program
and used for all its BLOCK_M rows (QK^T as a 512-dim dot plus a 64-dim dot for MLA's 576, then P @ V
with V = the first 512 dims of the same tile). The last split also covers the N tree rows at
positions prefix_len + node, masked by the ancestor bits. With more than one split, every split writes
a normalised partial output and its log-sum-exp, and a second small kernel merges them.

Optionally (config v_split=2, MLA), the 512 V dims are split across two programs per row block, as
FlashMLA splits them across its two warpgroups: each program recomputes the 576-wide score tile (+50%
score flops) but accumulates a 64 x 256 fp32 output instead of 64 x 512 (see default_config).

The grid and the split count derive from shapes only (page_table.shape[1] * page_size bounds the
prefix); the split length comes from prefix_lens on the device: no host sync, graph-capturable.

Bad values (eagle3_ops.reference.tree_attention_mla's docstring is the contract) never read out of bounds:
a request whose prefix_lens[b] is outside [0, capacity - N] (capacity = max_pages * page_size) reads nothing,
page ids outside [0, num_pages) are never dereferenced, and only the page-table slots that cover positions
[0, prefix + N) are read. Such a request gets NaN in every row of out and lse (all its nodes and heads; the
merge carries a split's NaN into the whole row), the others are unaffected, and the kernel records the
request's bad value in the device error word (eagle3_ops.check_errors): its prefix length, else the page id
of its first position whose page is out of range.

Grids: the (request, KV head, row block) product is axis 0 (CUDA's limit 2^31 - 1; axes 1 and 2 stop at
65535), the splits axis 1, at most MAX_SPLITS.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import errors
from ._attention_common import (LOG2E, MAX_SPLITS, NO_POS, OP_GQA, OP_MLA, merge_splits, num_splits_for, pow2,
                                report_request, request_span, sm_count)
from .mla_decode import sm90_supported, tree_attention_mla_sm90
from .mla_decode import tree_attention_mla as _mla_decode_launch

# Kernel limits (the CPU reference takes any size): the output accumulator is BLOCK_M x V dims in fp32
# registers, and each part of the key is one power-of-two tile.
MLA_MAX_DV = 512  # latent dims read as V (Kimi / DeepSeek: 512)
MLA_MAX_ROPE = 128  # key dims past V (Kimi / DeepSeek: 64)
GQA_MAX_DIM = 256  # Dh and Dv of tree_attention

# config {"kernel": "sm90"} where mla_decode.sm90_supported says no
SM90_NEEDS = ("config kernel 'sm90' needs a Hopper GPU, a build with csrc/mla_decode_sm90.cu for sm_90a "
              "(TORCH_CUDA_ARCH_LIST with 9.0a), bf16 or fp16 q with D = 576 and Dv = 512, a kv_cache of q's dtype or "
              "fp8 e4m3, 16-byte aligned rows of q and kv_cache, and sizes within the kernel's range (page table "
              "capacity < 2**31, B <= 65535)")


def on_device(device: torch.device):
    """The tensors' CUDA device made current for a launch sequence (Triton launches on the current device's
    stream; the interpreter's CPU tensors need none)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@triton.jit
def _tile(acc, m_i, l_i, q1, qo, q2, K, V, page, slot, stride_kp, stride_ks, stride_vp, stride_vs, ok, visible,
          d1, do, d2, dv, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, SHARED_V: tl.constexpr,
          V_SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, scale_log2):
    """One KV tile for all rows: online-softmax update of (acc, m_i, l_i).
    page, slot [BLOCK_N] int64 where each key row lives; ok [BLOCK_N] the row may be read (in range, its
    page real); visible [BLOCK_M, BLOCK_N] or [1, BLOCK_N] row-key visibility (split end, tree bits).
    d1 are this program's own dims of the first key part (all of D1 without a V split); with V_SPLIT = 2
    the other half (do, qo) joins the score, and V (MLA: the key rows themselves) is the own half only."""
    kv_row = page * stride_kp + slot * stride_ks
    k1 = tl.load(K + kv_row[:, None] + d1[None, :], mask=ok[:, None] & (d1[None, :] < D1), other=0.0)
    s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
    if V_SPLIT > 1:
        ko = tl.load(K + kv_row[:, None] + do[None, :], mask=ok[:, None] & (do[None, :] < D1), other=0.0)
        s = tl.dot(qo, tl.trans(ko), s, input_precision=DOT_PREC)
    if D2 > 0:
        k2 = tl.load(K + kv_row[:, None] + D1 + d2[None, :], mask=ok[:, None] & (d2[None, :] < D2), other=0.0)
        s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PREC)  # accumulate in place: no second tile
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if SHARED_V:
        v = k1  # MLA: V is the first DV (= D1) dims of the same latent rows (this program's share of them)
    else:
        v_row = page * stride_vp + slot * stride_vs
        v = tl.load(V + v_row[:, None] + dv[None, :], mask=ok[:, None] & (dv[None, :] < DV), other=0.0)
    # rescale, then accumulate into acc itself (a separate dot result would double the 128 registers
    # per thread that MLA's 64 x 512 fp32 accumulator takes at 8 warps)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _tree_attention_kernel(
        Q, K, V, PT, PL, TM, O, LSE, PO, PLSE, ERR,
        scale_log2, N, W, HKV, NUM_PAGES, CAPACITY, PAGE_SIZE, NUM_SPLITS,
        stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_pt, stride_ot, stride_oh,
        G: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
        BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, SHARED_V: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_LSE: tl.constexpr,
        V_SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, OP: tl.constexpr):
    # Q   [B * N, NH, D1 + D2]               strides (stride_qt, stride_qh, 1)
    # K   [num_pages, page_size, HKV, D1+D2]  strides (stride_kp, stride_ks, stride_kh, 1); MLA: HKV = 1
    # V   [num_pages, page_size, HKV, DV]     strides (stride_vp, stride_vs, stride_vh, 1); MLA: V = K
    # PT  [B, MAX_PAGES] int32                strides (stride_pt, 1)
    # PL  [B] int32;  TM [B, N, W] int32 contiguous
    # O   [B * N, NH, DV]                     strides (stride_ot, stride_oh, 1)
    # LSE [B * N, NH] fp32 contiguous (when HAS_LSE)
    # PO  [NUM_SPLITS, B * HKV, N * G, DV] fp32 and PLSE [NUM_SPLITS, B * HKV, N * G] fp32 (when SPLIT):
    #     per split, the normalised partial output and its log2-sum-exp2 (in units of scale * log2 e)
    # ERR [12] int64: the device error word (OP: this op's id there)
    # Grid (B * HKV * row blocks * V_SPLIT, NUM_SPLITS): axis 0 is (request, KV head)-major, so the launch
    # order is the old 3-D grid's (row blocks of one (request, KV head) neighbours).
    # Query head of row r of KV head h: h * G + r % G, node r // G (node-major rows).
    # V_SPLIT = 2 (MLA): program (m, v) owns output dims [v * BLOCK_DV, (v + 1) * BLOCK_DV) of its rows and
    # recomputes the full score tile (FlashMLA's split of the 512 V dims, across programs here): half the
    # fp32 accumulator per program for +50% score flops. Both halves of a row block are neighbours in
    # axis 0, so they read the same KV tiles at about the same time (the second read hits L2).
    NH = HKV * G
    ROWS = N * G
    per_bh = tl.cdiv(ROWS, BLOCK_M) * V_SPLIT
    pid_bh = tl.program_id(0) // per_bh
    pid_m = tl.program_id(0) % per_bh // V_SPLIT
    pid_v = tl.program_id(0) % V_SPLIT
    pid_s = tl.program_id(1)
    b = pid_bh // HKV
    kvh = pid_bh % HKV

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < ROWS
    node = rows // G
    head = kvh * G + rows % G
    token = (b * N + node).to(tl.int64)
    d1 = pid_v * BLOCK_D1 + tl.arange(0, BLOCK_D1)  # own dims: all of D1 unless V is split
    do = (1 - pid_v) * BLOCK_D1 + tl.arange(0, BLOCK_D1)  # the other half (V_SPLIT = 2 only)
    d2 = tl.arange(0, BLOCK_D2)
    dv = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    # Q loaded once, before the KV loop (the compiler keeps these dot operands in shared memory)
    q_row = token * stride_qt + head * stride_qh
    q1 = tl.load(Q + q_row[:, None] + d1[None, :], mask=row_ok[:, None] & (d1[None, :] < D1), other=0.0)
    qo = q1
    if V_SPLIT > 1:
        qo = tl.load(Q + q_row[:, None] + do[None, :], mask=row_ok[:, None] & (do[None, :] < D1), other=0.0)
    q2 = q1
    if D2 > 0:
        q2 = tl.load(Q + q_row[:, None] + D1 + d2[None, :], mask=row_ok[:, None] & (d2[None, :] < D2), other=0.0)

    # A bad prefix length reads nothing; the request's result is poisoned with NaN below.
    bad_prefix, prefix_raw, prefix, tree_n, pt_row, start, end = request_span(PL, PT, b, stride_pt, CAPACITY, N,
                                                                              NUM_SPLITS, pid_s, BLOCK_N)
    k_head = kvh.to(tl.int64) * stride_kh
    v_head = kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # This split's share of the prefix [start, end): whole tiles, all rows see every prefix position.
    first = tl.full([BLOCK_N], NO_POS, tl.int32)  # per lane, the first position whose page id is out of range
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_range = pos < end
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=in_range, other=0)
        real = (page >= 0) & (page < NUM_PAGES)
        first = tl.minimum(first, tl.where(in_range & ~real, pos, NO_POS))
        # padding rows (row >= N * G) have q = 0: harmless, never stored
        acc, m_i, l_i = _tile(acc, m_i, l_i, q1, qo, q2, K + k_head, V + v_head, page.to(tl.int64),
                              (pos % PAGE_SIZE).to(tl.int64), stride_kp, stride_ks, stride_vp, stride_vs,
                              in_range & real, in_range[None, :], d1, do, d2, dv, D1, D2, DV, SHARED_V, V_SPLIT,
                              DOT_PREC, scale_log2)

    # The tree block, in the last split: node j at position prefix + j, visible to row i when bit j of
    # tree_mask[b, i] is set.
    if pid_s == NUM_SPLITS - 1:
        for j0 in range(0, N, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            pos = prefix + j
            j_ok = j < tree_n  # (prefix + N <= capacity)
            page = tl.load(pt_row + pos // PAGE_SIZE, mask=j_ok, other=0)
            real = (page >= 0) & (page < NUM_PAGES)
            first = tl.minimum(first, tl.where(j_ok & ~real, pos, NO_POS))
            both = row_ok[:, None] & j_ok[None, :]
            word = tl.load(TM + token[:, None] * W + (j // 32)[None, :], mask=both, other=0)
            visible = both & (((word >> (j % 32)[None, :]) & 1) != 0)
            acc, m_i, l_i = _tile(acc, m_i, l_i, q1, qo, q2, K + k_head, V + v_head, page.to(tl.int64),
                                  (pos % PAGE_SIZE).to(tl.int64), stride_kp, stride_ks, stride_vp, stride_vs,
                                  j_ok & real, visible, d1, do, d2, dv, D1, D2, DV, SHARED_V, V_SPLIT, DOT_PREC,
                                  scale_log2)

    # NaN for the whole request on bad values (the merge carries it through every split); the report below.
    first_pos = tl.min(first, 0)
    bad = bad_prefix | (first_pos < NO_POS)
    poison = tl.where(bad, float("nan"), 0.0)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None] + poison
    lse2 = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf")) + poison
    if SPLIT:
        BH = tl.num_programs(0) // per_bh
        prow = (pid_s.to(tl.int64) * BH + pid_bh) * ROWS + rows
        tl.store(PO + prow[:, None] * DV + dv[None, :], o, mask=row_ok[:, None] & (dv[None, :] < DV))
        tl.store(PLSE + prow, lse2, mask=row_ok & (pid_v == 0))  # the halves' lse agree: one writes
    else:
        o_row = token * stride_ot + head * stride_oh
        tl.store(O + o_row[:, None] + dv[None, :], o.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < DV))
        if HAS_LSE:
            tl.store(LSE + token * NH + head, lse2 * 0.6931471805599453, mask=row_ok & (pid_v == 0))
    # The report last, after the stores. Before them, with the accumulator live, the v_split kernel compiled
    # for sm_90a (triton 3.8) spilled (255 registers, 4 bytes) where the build without checks did not (229):
    # the checks cost it 2-3.5% on the H200 (device_checks_d8ca4e0_h200.log). Here: 255 registers, no spills.
    if bad:
        report_request(ERR, OP, PL, PT, tl.program_id(0) // per_bh // HKV, stride_pt, CAPACITY, N, first_pos,
                       PAGE_SIZE, NUM_PAGES)


# ---- launchers ---------------------------------------------------------------------------------------

def _launch(q, k, v, page_table, prefix_lens, tree_mask, scale, out, lse, *, HKV, D1, D2, DV, shared_v,
            config: Optional[dict]):
    B, N, W = tree_mask.shape
    NH = q.shape[1]
    G = NH // HKV
    P, page_size = k.shape[0], k.shape[1]
    rows = N * G
    v_split = (config or {}).get("v_split", 1)
    if v_split not in (1, 2) or (v_split == 2 and not (shared_v and pow2(DV) >= 32)):
        raise ValueError(f"config v_split must be 1, or 2 for tree_attention_mla with Dv > 16, got {v_split}")
    cfg = default_config(q.dtype, D1 + D2, DV, rows, shared_v, v_split)
    cfg.update(config or {})
    BLOCK_M = min(cfg["BLOCK_M"], pow2(rows))
    m_blocks = -(-rows // BLOCK_M)
    max_len = page_table.shape[1] * page_size
    slots = sm_count(q.device) * cfg.get("programs_per_sm", 1)  # programs that run at once
    splits = cfg.get("splits") or num_splits_for(m_blocks * v_split * B * HKV, max_len, slots, cfg["min_chunk"])
    splits = min(splits, MAX_SPLITS)
    split = splits > 1
    if split:
        po = torch.empty((splits, B * HKV, rows, DV), dtype=torch.float32, device=q.device)
        plse = torch.empty((splits, B * HKV, rows), dtype=torch.float32, device=q.device)
    else:
        po = plse = out  # unused
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    # k and v as [num_pages, page_size, HKV, dims]; MLA's [num_pages, page_size, D] is HKV = 1
    kst = (k.stride(0), k.stride(1), k.stride(2) if k.dim() == 4 else 0)
    vst = (v.stride(0), v.stride(1), v.stride(2) if v.dim() == 4 else 0)
    block_d1 = pow2(D1) // v_split  # with a V split (MLA: D1 = DV), each half of the latent dims
    _tree_attention_kernel[(m_blocks * v_split * B * HKV, splits)](
        q, k, v, page_table, prefix_lens, tree_mask, out, lse if lse is not None else out, po, plse,
        errors.error_word(q.device), scale * LOG2E, N, W, HKV, P, max_len, max(page_size, 1), splits,
        q.stride(0), q.stride(1), *kst, *vst, page_table.stride(0), out.stride(0), out.stride(1),
        G=G, D1=D1, D2=D2, DV=DV, BLOCK_D1=block_d1, BLOCK_D2=pow2(max(D2, 1)), BLOCK_DV=pow2(DV) // v_split,
        SHARED_V=shared_v, BLOCK_M=BLOCK_M, BLOCK_N=cfg["BLOCK_N"], SPLIT=split, HAS_LSE=lse is not None,
        V_SPLIT=v_split, DOT_PREC=dot_prec, OP=OP_MLA if shared_v else OP_GQA, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    if split:
        merge_splits(po, plse, out, lse, N, HKV, G)


def default_config(dtype: torch.dtype, D: int, DV: int, rows: int, shared_v: bool, v_split: int = 1) -> dict:
    """Tile sizes by problem: MLA's 512-wide fp32 accumulator needs 8 warps at BLOCK_M = 64.

    v_split = 2 (MLA, selected with config={"v_split": 2}): each program accumulates 256 of the 512 V dims.
    bf16/fp16: one warpgroup per program holds the 64 x 256 fp32 accumulator (128 registers a thread) and
    issues the score wgmma once (with 8 warps over 64 rows, the score layout puts both warpgroups on the
    same 64 rows: each computes the whole score tile); 64 x 576 Q in shared memory plus the 16-key stages
    take 112 KB, so two programs fit an SM (255 registers x 128 threads each), and one's softmax can run
    under the other's matrix work. Compiled for sm_90a (triton 3.8, bench's __main__): 255 registers and
    8 bytes of spills, against 255 registers and 144 bytes for the default. fp32 (ieee dots, no wgmma)
    keeps the default's 32 rows x 8 warps: 109 registers, no spills. Measured on the H200 at d931bca
    (bench/results/tree_attention_h200.log): correct, but 5-9% slower than the default (577 vs 546 us at
    mla B1 P32768 N16, 61.7 vs 58.7 us at N1 B1, 1102 vs 1015 us at N1 B32), so it is not the default."""
    if shared_v and DV > 128 and v_split == 2:
        if dtype == torch.float32:
            return dict(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=2, min_chunk=256)
        return dict(BLOCK_M=64, BLOCK_N=16, num_warps=4, num_stages=3, min_chunk=256, programs_per_sm=2)
    if shared_v and DV > 128:  # MLA; fp32: half the rows and keys, or Q and two K stages pass 227 KB of smem
        if dtype == torch.float32:
            return dict(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=2, min_chunk=256)
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=3, min_chunk=256)
    big = max(D, DV) > 128
    return dict(BLOCK_M=64, BLOCK_N=32 if big else 64, num_warps=8 if big else 4, num_stages=2 if big else 3,
                min_chunk=256)


def _check_float(q: Tensor) -> None:
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q must have dtype bfloat16 | float16 | float32 for the Triton kernel, got "
                        f"{str(q.dtype).replace('torch.', '')} (float64 runs on CPU tensors, through the reference)")


def tree_attention_mla(q: Tensor, kv_cache: Tensor, page_table: Tensor, prefix_lens: Tensor, tree_mask: Tensor,
                       scale: float, out: Tensor, lse: Optional[Tensor], *, config: Optional[dict] = None) -> None:
    """tree_attention_mla's CUDA launcher (arguments as the op; eagle3_ops.reference.tree_attention_mla is the
    spec). `config` overrides the kernel, tile sizes and the split count (benchmarks and tests only).
    On a Hopper GPU in bf16 / fp16 at 576 / 512 dims the kernel is csrc/mla_decode_sm90.cu's (wgmma, 1.5x
    the Triton kernel below: 4bb3839:bench/results/tree_attention_sm90_pipelined_h200.log; mla_decode.sm90_supported
    says when; {"kernel": "sm90"} insists). Otherwise, for Dv >= 256, triton_kernels/mla_decode.py's (whole
    prefix tiles unmasked, read with TMA where page_size allows; {"kernel": "mla_decode"} or a "tma" key
    selects it, "tma": False forces gathered tiles): 1.7-1.9x this file's kernel at 5180f72
    (bench/results/tree_attention_tma_h200.log). {"kernel": "v1"} runs this file's kernel (the default below
    Dv = 256), and {"v_split": 2} its variant splitting the 512 V dims across two programs per row block.
    Everything runs on q's device (and its current stream). Bad values: see the module docstring."""
    _check_float(q)
    D, Dv = q.shape[2], out.shape[2]
    if Dv > MLA_MAX_DV or D - Dv > MLA_MAX_ROPE:
        raise ValueError(f"out must have Dv <= {MLA_MAX_DV} and q's D - Dv <= {MLA_MAX_ROPE} for the Triton "
                         f"kernel (Kimi: 512 and 64), got Dv = {Dv}, D = {D}")
    config = dict(config or {})
    # mla_decode's kernel by default at DeepSeek / Kimi widths (Dv >= 256: measured and GPU-tested at 512 +
    # 64); below that (the small CPU-trained pair's 32 + 8) the first kernel, whose GPU tests cover them.
    if "kernel" in config:
        kernel = config.pop("kernel")
        if kernel == "sm90" and not sm90_supported(q, kv_cache, out, page_table, tree_mask):
            raise ValueError(SM90_NEEDS)
    elif Dv < 256 and "tma" not in config:
        kernel = "v1"
    else:
        sm90 = not {"tma", "v_split"} & config.keys() and sm90_supported(q, kv_cache, out, page_table, tree_mask)
        kernel = "sm90" if sm90 else "mla_decode"
    if kernel not in ("v1", "mla_decode", "sm90"):
        raise ValueError(f"config kernel must be 'v1', 'mla_decode' or 'sm90', got {kernel!r}")
    v1 = kernel == "v1" or (kernel != "sm90" and config.get("v_split", 1) != 1)
    if v1 and "tma" in config:
        raise ValueError("config tma needs the default kernel, not kernel v1 / v_split")
    with on_device(q.device):  # the sm90 kernel, the Triton kernels and the merge on one device's stream
        if kernel == "sm90":
            tree_attention_mla_sm90(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, config)
        elif v1:
            _launch(q, kv_cache, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, HKV=1, D1=Dv,
                    D2=D - Dv, DV=Dv, shared_v=True, config=config)
        else:
            _mla_decode_launch(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse,
                               {"tma": True, **config})
    errors.after_launch(q.device)


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, prefix_lens: Tensor,
                   tree_mask: Tensor, scale: float, out: Tensor, lse: Optional[Tensor], *,
                   config: Optional[dict] = None) -> None:
    """Triton tree_attention, GQA/MHA (arguments as the op; eagle3_ops.reference.tree_attention is the spec).
    `config` overrides tile sizes and the split count (benchmarks and tests only). Runs on q's device; bad
    values: see the module docstring."""
    _check_float(q)
    Dh, Dv = k_cache.shape[3], v_cache.shape[3]
    if Dh > GQA_MAX_DIM or Dv > GQA_MAX_DIM:
        raise ValueError(f"k_cache and v_cache must have head dims <= {GQA_MAX_DIM} for the Triton kernel, got "
                         f"Dh = {Dh}, Dv = {Dv}")
    with on_device(q.device):
        _launch(q, k_cache, v_cache, page_table, prefix_lens, tree_mask, scale, out, lse, HKV=k_cache.shape[2],
                D1=Dh, D2=0, DV=Dv, shared_v=False, config=config)
    errors.after_launch(q.device)


# mla_decode launcher's config keys that the sm90 kernel has no use for
_MLA_DECODE_ONLY = frozenset({"tma", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "rescale_tau", "cut", "fill",
                              "programs_per_sm"})


def tree_attention_mla_op(q: Tensor, kv_cache: Tensor, page_table: Tensor, prefix_lens: Tensor, tree_mask: Tensor,
                          scale: float, out: Tensor, lse: Optional[Tensor], kv_scale: Optional[Tensor] = None, *,
                          config: Optional[dict] = None) -> None:
    """torch.ops.eagle3.tree_attention_mla's CUDA implementation (eagle3_ops/_register.py registers it; the
    arguments are checked there, eagle3_ops._validate.tree_attention_mla). A bf16 / fp16 / fp32 cache goes to
    tree_attention_mla above, which picks the sm90 CUDA kernel or a Triton one. An fp8 e4m3 cache (kv_scale
    given) goes to the sm90 CUDA kernel's fp8 build where mla_decode.sm90_supported says so (a Hopper GPU, an
    sm_90a build, 576 / 512 dims, aligned rows; on the H200 at 1246426 1.2-1.9x faster than the Triton fp8 kernel,
    though still 1.1-1.2x slower than the bf16 cache), else to mla_decode's Triton kernel;
    EAGLE3_MLA_FP8_SM90=0 (read at each call) keeps the Triton kernel. Both compute in
    fp16 with kv_scale folded into the score scale and the output's normalisation
    (docs/kernels/tree_attention_mla_fp8.md). config, benchmarks and tests only: {"kernel": "sm90"} insists on the
    CUDA kernel (a ValueError where it cannot serve), {"kernel": "mla_decode"} or any of the Triton launcher's own
    keys (_MLA_DECODE_ONLY: tma, BLOCK_N, ...) takes the Triton kernel; the other keys go to the chosen launcher
    (the sm90 one reads splits, min_chunk, evict_first)."""
    if kv_scale is None:
        tree_attention_mla(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, config=config)
        return
    config = dict(config or {})
    kernel = config.pop("kernel", None)
    if kernel not in (None, "sm90", "mla_decode"):
        raise ValueError(f"config kernel must be 'sm90' or 'mla_decode' with an fp8 kv_cache (the kernels that read "
                         f"one), got {kernel!r}")
    D, Dv = q.shape[2], out.shape[2]
    # (no kernel named: a Triton-only key, as tree_attention_mla's "tma" / "v_split", keeps the Triton kernel)
    triton_only = kernel is None and bool(_MLA_DECODE_ONLY & config.keys())
    wants_sm90 = kernel == "sm90" or (kernel is None and os.environ.get("EAGLE3_MLA_FP8_SM90", "") != "0")
    if wants_sm90 and not triton_only and sm90_supported(q, kv_cache, out, page_table, tree_mask):
        with on_device(q.device):
            tree_attention_mla_sm90(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, config,
                                    kv_scale=kv_scale)
        errors.after_launch(q.device)
        return
    if kernel == "sm90":
        raise ValueError(SM90_NEEDS)
    if Dv > MLA_MAX_DV or D - Dv > MLA_MAX_ROPE:
        raise ValueError(f"out must have Dv <= {MLA_MAX_DV} and q's D - Dv <= {MLA_MAX_ROPE} for the Triton "
                         f"kernel (Kimi: 512 and 64), got Dv = {Dv}, D = {D}")
    with on_device(q.device):
        _mla_decode_launch(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, {"tma": True, **config},
                           kv_scale=kv_scale)
    errors.after_launch(q.device)
