"""A second Triton kernel for tree_attention_mla (absorbed MLA: every query head over one latent KV head,
V = the first Dv dims of the key rows), selected with config={"tma": True | False, ...} of
triton_kernels.tree_attention.tree_attention_mla; same arguments, results and bad-value rules as
tree_attention's kernel (with which it shares _attention_common.py's merge kernel and split rule).

What differs from tree_attention's kernel (FlashMLA's shape as far as Triton reaches):
- The prefix loop runs over *whole* BLOCK_N-key tiles with no masks at all (no tl.where on the score,
  no masked loads); the split's last, partial tile and the tree block go through a masked gathered
  tile after it. Split starts are multiples of BLOCK_N, so with page_size % BLOCK_N == 0 a whole tile
  lies on one page.
- tma=True: those whole tiles are read with TMA (host-side tensor descriptors over the cache viewed as
  [num_pages * page_size, D]): two [BLOCK_N, Dv/2] boxes for the latent dims (a box is at most 256
  wide) and one [BLOCK_N, rope] box. No per-element address registers, and the tiles land in shared
  memory where both dots read them. Where TMA cannot serve (page_size % BLOCK_N != 0, a cache whose
  rows are not one [rows, D] matrix, misaligned widths) the whole tiles are gathered with unmasked
  loads instead (tma=False does that everywhere).
- The output accumulator is two [BLOCK_M, Dv/2] halves (one per latent box), the score three
  chained dots (half, half, rope).
- rescale_tau > 0 (FA4's lazy rescale): a row's running max moves only when a tile's max passes it by
  more than tau (log2 units, so p <= 2^tau before normalisation), and the accumulator is rescaled only
  when some row of the block moved; otherwise the [BLOCK_M, Dv] multiply is skipped. Exact in exact
  arithmetic: out and lse use the same (stale) max for l and acc.
- cut=True (the bf16 / fp16 default; eager rescale only): the whole tiles' score dots hand their accumulator on, and the
  softmax reads the score tile, inside always-taken runtime ifs (_cut, _attend_cut), which end each dot's
  forward slice: triton's chained-dot rule (all warps along M) would otherwise make both warpgroups of the
  64-row block compute the same score tile; with it cut each computes half the keys (sm_90a: 36 instead
  of 72 HGMMA.64x32x16 per warpgroup and tile).
- fill=True (the bf16 / fp16 default): splits_fill's split count, which lets one partial wave count as full.

fp8 e4m3 caches (torch.ops.eagle3.tree_attention_mla with kv_scale; tree_attention.tree_attention_mla_op sends them
to the sm90 CUDA kernel where sm90_supported says so, and here otherwise: builds without sm_90a, other GPUs, other
widths, or config {"kernel": "mla_decode"}): the same kernel reads one byte a dim (TMA boxes of fp8, half the
bytes of bf16), computes in fp16 (each tile converted in registers, exact for e4m3, and bf16 q converted once,
exactly, with a power-of-two guard against fp16's range: _mla_kernel's KS comment), and folds the per-tensor
scale into the score scale (scale * log2 e * kv_scale) and into the output's 1 / l, so the dots see the unscaled
fp8 values and accumulate in fp32 (docs/kernels/tree_attention_mla_fp8.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import errors
from ._device import hopper_kernel
from ._errors import arg_id, report_not_positive
from ._attention_common import (LOG2E, MAX_SPLITS, NO_POS, OP_MLA, merge_splits, num_splits_for, pow2, report_request,
                                request_span, sm_count)

_OP_MLA = tl.constexpr(OP_MLA)
_ARG_KV_SCALE = tl.constexpr(arg_id("kv_scale"))

try:  # triton >= 3.3 (host-side descriptors; the H200's triton 3.6 and this machine's 3.8 have it)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


@triton.jit
def _attend(acc_a, acc_b, m_i, l_i, s, va, vb, TAU: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online-softmax update with the score tile s [BLOCK_M, BLOCK_N] (scaled to log2 units, masked
    positions -inf) and V's two halves va, vb [BLOCK_N, BLOCK_H]."""
    m_tile = tl.max(s, 1)
    if TAU > 0:
        m_new = tl.where(m_tile > m_i + TAU, m_tile, m_i)  # m_i = -inf: any finite tile max moves it
    else:
        m_new = tl.maximum(m_i, m_tile)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if TAU > 0:
        # alpha is exactly 1 for rows whose max stayed (and acc is 0 for rows that saw nothing)
        if tl.max((m_new != m_i).to(tl.int32), 0) > 0:
            acc_a = acc_a * alpha[:, None]
            acc_b = acc_b * alpha[:, None]
    else:
        acc_a = acc_a * alpha[:, None]
        acc_b = acc_b * alpha[:, None]
    p = p.to(va.dtype)
    acc_a = tl.dot(p, va, acc_a, input_precision=DOT_PREC)  # fp32: ieee, not the tf32 default
    acc_b = tl.dot(p, vb, acc_b, input_precision=DOT_PREC)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _absmax(x):
    """max |x| over a 2-D tile, in fp32."""
    return tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0)


@triton.jit
def _cut(x, live):
    """x, through a runtime `if` that is always taken (see _attend_cut): ends a dot's forward slice."""
    if live:
        y = x
    else:
        y = x * 0.0
    return y


@triton.jit
def _attend_cut(acc_a, acc_b, m_i, l_i, s, va, vb, live, DOT_PREC: tl.constexpr):
    """_attend's eager update (TAU = 0) for the whole tiles with the softmax inside a runtime `if live:` that
    is always taken (live: the cache has pages; without any every tile is poisoned anyway). Why: triton's
    chained-dot rule (a dot whose forward slice reaches another dot gets all its warps along M) makes both
    warpgroups of an 8-warp, 64-row block compute the *same* 64 x BLOCK_N score tile (SASS: 72
    HGMMA.64x32x16 per warpgroup for 64 keys x 576 dims, 36 of them redundant, each re-reading Q from
    shared memory). The slice stops at the if's yield, so the score dot gets the default [4, 2] warps: each
    warpgroup computes half the keys; the row max and sum cross the two warpgroups in shared memory and P
    is exchanged there for the P @ V dot. (Keeping l per column, [BLOCK_M, BLOCK_N], to skip the cross-warpgroup
    row sum: 16 more live registers, and ptxas then serialises the wgmmas, C7515: 44 waits a tile.)"""
    if live:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_new = l_i * alpha + tl.sum(p, 1)
    else:
        m_new = m_i
        alpha = tl.full(m_i.shape, 1.0, tl.float32)
        p = s * 0.0
        l_new = l_i
    acc_a = acc_a * alpha[:, None]
    acc_b = acc_b * alpha[:, None]
    p = p.to(va.dtype)
    acc_a = tl.dot(p, va, acc_a, input_precision=DOT_PREC)
    acc_b = tl.dot(p, vb, acc_b, input_precision=DOT_PREC)
    return acc_a, acc_b, m_new, l_new


@triton.jit
def _gathered_tile(acc_a, acc_b, m_i, l_i, qa, qb, qr, K, page, slot, stride_kp, stride_ks, ok, visible,
                   dh, dr, DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, TAU: tl.constexpr,
                   DOT_PREC: tl.constexpr, qk_scale):
    """A masked tile (the split's partial last tile, the tree block): rows at (page, slot) [BLOCK_N] read
    where ok [BLOCK_N], row-key visibility visible [BLOCK_M or 1, BLOCK_N]. Tiles are converted to qa's dtype
    (an fp8 cache: exactly, to fp16; its scale is in qk_scale and the output's normalisation)."""
    kv_row = page * stride_kp + slot * stride_ks
    ka = tl.load(K + kv_row[:, None] + dh[None, :], mask=ok[:, None] & (dh[None, :] < DV),
                 other=0.0).to(qa.dtype)
    kb = tl.load(K + kv_row[:, None] + BLOCK_H + dh[None, :], mask=ok[:, None] & (BLOCK_H + dh[None, :] < DV),
                 other=0.0).to(qa.dtype)
    s = tl.dot(qa, tl.trans(ka), input_precision=DOT_PREC)
    s = tl.dot(qb, tl.trans(kb), s, input_precision=DOT_PREC)
    if DR > 0:
        kr = tl.load(K + kv_row[:, None] + DV + dr[None, :], mask=ok[:, None] & (dr[None, :] < DR),
                     other=0.0).to(qa.dtype)
        s = tl.dot(qr, tl.trans(kr), s, input_precision=DOT_PREC)
    s = tl.where(visible, s * qk_scale, float("-inf"))
    return _attend(acc_a, acc_b, m_i, l_i, s, ka, kb, TAU, DOT_PREC)


@triton.jit
def _mla_kernel(
        Q, K, KA, KR, PT, PL, TM, O, LSE, PO, PLSE, ERR, KS,
        scale_log2, N, W, NUM_PAGES, CAPACITY, PAGE_SIZE, NUM_SPLITS,
        stride_qt, stride_qh, stride_kp, stride_ks, stride_pt, stride_ot, stride_oh,
        G: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_LSE: tl.constexpr,
        TMA: tl.constexpr, TAU: tl.constexpr, DOT_PREC: tl.constexpr, CUT: tl.constexpr = False,
        KV_SCALED: tl.constexpr = False, Q_F16: tl.constexpr = False):
    # Q   [B * N, NH, DV + DR]           strides (stride_qt, stride_qh, 1); NH = G (one latent KV head)
    # K   [num_pages, page_size, DV + DR] strides (stride_kp, stride_ks, 1): q's dtype, or fp8 e4m3 (KV_SCALED)
    # KA  (TMA) descriptor of K as [num_pages * page_size, DV], row stride stride_ks, box [BLOCK_N, BLOCK_H]
    # KR  (TMA) descriptor of K[..., DV:] as [num_pages * page_size, DR], box [BLOCK_N, BLOCK_R]
    # PT  [B, MAX_PAGES] int32 strides (stride_pt, 1);  PL [B] int32;  TM [B, N, W] int32 contiguous
    # O   [B * N, NH, DV] strides (stride_ot, stride_oh, 1);  LSE [B * N, NH] fp32 contiguous (HAS_LSE)
    # PO  [NUM_SPLITS, B, N * G, DV] fp32, PLSE [NUM_SPLITS, B, N * G] fp32 (SPLIT): tree_attention's
    #     partial layout with HKV = 1 (_attention_common.merge_splits combines them)
    # ERR [12] int64: the device error word
    # KS  [1] fp32 (KV_SCALED): the fp8 cache's dequantisation scale, key = fp8 * KS. Each tile is converted to
    #     fp16 in registers (exact for e4m3; one cvt per two values on sm_90, where e4m3 -> bf16 takes an
    #     emulated sequence: 942 vs 1363 instructions a 64-key tile at 16 rows, ptxas for sm_90a), KS folded into
    #     the score scale and the output's 1 / l: the dots see the fp8 values unscaled and accumulate in fp32.
    #     Q_F16: bf16 q goes to fp16 too, exact in fp16's normal range; a program whose rows hold |q| >= 2^15 first
    #     scales them by an exact power of two (folded back into the score scale), so nothing overflows. P is
    #     fp16 then (11 bits, bf16's 8).
    # Grid (B * row blocks, NUM_SPLITS), request-major. Row r of the block: node r // G, head r % G. Latent dims
    # in two halves [0, BLOCK_H), [BLOCK_H, 2 BLOCK_H).
    ROWS = N * G
    m_blocks = tl.cdiv(ROWS, BLOCK_M)
    pid_m = tl.program_id(0) % m_blocks
    b = tl.program_id(0) // m_blocks
    pid_s = tl.program_id(1)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < ROWS
    node = rows // G
    head = rows % G
    token = (b * N + node).to(tl.int64)
    dh = tl.arange(0, BLOCK_H)
    dr = tl.arange(0, BLOCK_R)
    q_row = token * stride_qt + head * stride_qh
    qa = tl.load(Q + q_row[:, None] + dh[None, :], mask=row_ok[:, None] & (dh[None, :] < DV), other=0.0)
    qb = tl.load(Q + q_row[:, None] + BLOCK_H + dh[None, :], mask=row_ok[:, None] & (BLOCK_H + dh[None, :] < DV),
                 other=0.0)
    qr = qa
    if DR > 0:
        qr = tl.load(Q + q_row[:, None] + DV + dr[None, :], mask=row_ok[:, None] & (dr[None, :] < DR), other=0.0)

    if KV_SCALED:
        kv_scale = tl.load(KS)
        qk_scale = scale_log2 * kv_scale
        if Q_F16:  # bf16 q computed in fp16 (see the comment at KS above)
            qmax = tl.maximum(tl.maximum(_absmax(qa), _absmax(qb)), _absmax(qr))
            shift = tl.maximum(tl.math.ceil(tl.math.log2(tl.maximum(qmax, 1.0))) - 15.0, 0.0)
            qa = (qa.to(tl.float32) * tl.math.exp2(-shift)).to(tl.float16)
            qb = (qb.to(tl.float32) * tl.math.exp2(-shift)).to(tl.float16)
            qr = (qr.to(tl.float32) * tl.math.exp2(-shift)).to(tl.float16)
            qk_scale = qk_scale * tl.math.exp2(shift)
    else:
        kv_scale = 1.0
        qk_scale = scale_log2

    bad_prefix, prefix_raw, prefix, tree_n, pt_row, start, end = request_span(PL, PT, b, stride_pt, CAPACITY, N,
                                                                              NUM_SPLITS, pid_s, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)

    whole_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    first = tl.full([BLOCK_N], NO_POS, tl.int32)  # per lane, the first position whose page id is out of range
    # Whole tiles: every row sees every key, no masks.
    for n0 in range(start, whole_end, BLOCK_N):
        if TMA:  # the tile lies on one page (page_size % BLOCK_N == 0, n0 % BLOCK_N == 0)
            page = tl.load(pt_row + n0 // PAGE_SIZE)
            real = (page >= 0) & (page < NUM_PAGES)
            first = tl.minimum(first, tl.where(real, NO_POS, n0))
            row0 = tl.where(real, page, 0) * PAGE_SIZE + n0 % PAGE_SIZE  # an unreal page: read page 0, poison
            ka = KA.load([row0, 0]).to(qa.dtype)
            kb = KA.load([row0, BLOCK_H]).to(qa.dtype)
            # CUT: the score accumulator passes between the chained dots through _cut (an always-taken runtime
            # if), else each dot's forward slice reaches the next and the chained-dot rule still applies.
            # (Three separate dots summed do not help: triton folds dot + x back into one accumulator chain.)
            s = tl.dot(qa, tl.trans(ka), input_precision=DOT_PREC)
            if CUT:
                s = _cut(s, NUM_PAGES > 0)
            s = tl.dot(qb, tl.trans(kb), s, input_precision=DOT_PREC)
            if DR > 0:
                kr = KR.load([row0, 0]).to(qa.dtype)
                if CUT:
                    s = _cut(s, NUM_PAGES > 0)
                s = tl.dot(qr, tl.trans(kr), s, input_precision=DOT_PREC)
        else:
            pos = n0 + tl.arange(0, BLOCK_N)
            page = tl.load(pt_row + pos // PAGE_SIZE)
            real = (page >= 0) & (page < NUM_PAGES)
            first = tl.minimum(first, tl.where(real, NO_POS, pos))
            kv_row = tl.where(real, page, 0).to(tl.int64) * stride_kp + (pos % PAGE_SIZE).to(tl.int64) * stride_ks
            ka = tl.load(K + kv_row[:, None] + dh[None, :], mask=dh[None, :] < DV, other=0.0).to(qa.dtype)
            kb = tl.load(K + kv_row[:, None] + BLOCK_H + dh[None, :], mask=BLOCK_H + dh[None, :] < DV,
                         other=0.0).to(qa.dtype)
            s = tl.dot(qa, tl.trans(ka), input_precision=DOT_PREC)
            if CUT:
                s = _cut(s, NUM_PAGES > 0)
            s = tl.dot(qb, tl.trans(kb), s, input_precision=DOT_PREC)
            if DR > 0:
                kr = tl.load(K + kv_row[:, None] + DV + dr[None, :], mask=dr[None, :] < DR, other=0.0).to(qa.dtype)
                if CUT:
                    s = _cut(s, NUM_PAGES > 0)
                s = tl.dot(qr, tl.trans(kr), s, input_precision=DOT_PREC)
        if CUT:  # the score tile split across the warpgroups (_attend_cut; eager rescale)
            acc_a, acc_b, m_i, l_i = _attend_cut(acc_a, acc_b, m_i, l_i, s * qk_scale, ka, kb, NUM_PAGES > 0,
                                                 DOT_PREC)
        else:
            acc_a, acc_b, m_i, l_i = _attend(acc_a, acc_b, m_i, l_i, s * qk_scale, ka, kb, TAU, DOT_PREC)

    # The split's partial last tile (at most one).
    for n0 in range(whole_end, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_range = pos < end
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=in_range, other=0)
        real = (page >= 0) & (page < NUM_PAGES)
        first = tl.minimum(first, tl.where(in_range & ~real, pos, NO_POS))
        acc_a, acc_b, m_i, l_i = _gathered_tile(
            acc_a, acc_b, m_i, l_i, qa, qb, qr, K, page.to(tl.int64), (pos % PAGE_SIZE).to(tl.int64), stride_kp,
            stride_ks, in_range & real, in_range[None, :], dh, dr, DV, DR, BLOCK_H, TAU, DOT_PREC, qk_scale)

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
            # the (at most two, BLOCK_N <= 64) mask words of this tile per row, not a [BLOCK_M, BLOCK_N]
            # gather (whose pipelined buffer would take 16 KB of shared memory at 64 x 64)
            w_lo = tl.load(TM + token * W + j0 // 32, mask=row_ok, other=0)
            w_hi = tl.load(TM + token * W + j0 // 32 + 1, mask=row_ok & (j0 // 32 + 1 < W), other=0)
            word = tl.where((j // 32 > j0 // 32)[None, :], w_hi[:, None], w_lo[:, None])
            visible = both & (((word >> (j % 32)[None, :]) & 1) != 0)
            acc_a, acc_b, m_i, l_i = _gathered_tile(
                acc_a, acc_b, m_i, l_i, qa, qb, qr, K, page.to(tl.int64), (pos % PAGE_SIZE).to(tl.int64),
                stride_kp, stride_ks, j_ok & real, visible, dh, dr, DV, DR, BLOCK_H, TAU, DOT_PREC, qk_scale)

    # NaN for the whole request on bad values (the merge carries it through every split); the reports below.
    first_pos = tl.min(first, 0)
    bad = bad_prefix | (first_pos < NO_POS)
    if KV_SCALED:  # a scale that is not finite and > 0 poisons every request, recorded (reference: raised)
        bad_scale = ~((kv_scale > 0.0) & (kv_scale < float("inf")))
        poison = tl.where(bad | bad_scale, float("nan"), 0.0)
    else:
        poison = tl.where(bad, float("nan"), 0.0)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    inv = kv_scale / l_safe  # V = fp8 * kv_scale: the scale once per row, after the sum
    oa = acc_a * inv[:, None] + poison
    ob = acc_b * inv[:, None] + poison
    lse2 = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf")) + poison
    ma = row_ok[:, None] & (dh[None, :] < DV)
    mb = row_ok[:, None] & (BLOCK_H + dh[None, :] < DV)
    if SPLIT:
        prow = (pid_s.to(tl.int64) * (tl.num_programs(0) // m_blocks) + b) * ROWS + rows
        tl.store(PO + prow[:, None] * DV + dh[None, :], oa, mask=ma)
        tl.store(PO + prow[:, None] * DV + BLOCK_H + dh[None, :], ob, mask=mb)
        tl.store(PLSE + prow, lse2, mask=row_ok)
    else:
        o_row = token * stride_ot + head * stride_oh
        tl.store(O + o_row[:, None] + dh[None, :], oa.to(O.dtype.element_ty), mask=ma)
        tl.store(O + o_row[:, None] + BLOCK_H + dh[None, :], ob.to(O.dtype.element_ty), mask=mb)
        if HAS_LSE:
            tl.store(LSE + token * G + head, lse2 * 0.6931471805599453, mask=row_ok)
    # The reports last, after the stores (with the accumulators live they add registers and spills;
    # tree_attention.py's kernel says what that cost); b recomputed there, the span reloaded. One branch for both:
    # as two (the request's, then the scale's), the fp8 kernel at 64 heads spilled 2188 bytes with checks, 944
    # without (and with either report alone; ptxas for sm_90a). A bad request records first, as before (the
    # scale's report after it found the word taken).
    if KV_SCALED:
        if bad | bad_scale:
            if bad:
                report_request(ERR, _OP_MLA, PL, PT, tl.program_id(0) // m_blocks, stride_pt, CAPACITY, N,
                               first_pos, PAGE_SIZE, NUM_PAGES)
            else:
                report_not_positive(ERR, _OP_MLA, _ARG_KV_SCALE, kv_scale)
    elif bad:
        report_request(ERR, _OP_MLA, PL, PT, tl.program_id(0) // m_blocks, stride_pt, CAPACITY, N, first_pos,
                       PAGE_SIZE, NUM_PAGES)


def default_config(dtype: torch.dtype) -> dict:
    """Tiles of this kernel: 64 rows x 64 keys x 8 warps for bf16/fp16 (two warpgroups over the 64 x 512 fp32
    accumulator, 128 registers a thread; Q 72 KB + one 72 KB KV stage per num_stages in shared memory);
    fp32 (ieee dots, no wgmma, twice the bytes): 32 rows x 16 keys."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=2, min_chunk=256, rescale_tau=0.0)
    # rescale_tau 0: on the H200 the lazy rescale (tau 8) was 11% slower (329 vs 293 us, N16 B1 P32768).
    # cut + fill: 235 vs 294 us at N16 B1 P32768, 426 vs 536 at N16 B8 P8192, 487 vs 582 at N1 B32 P32768
    # (the 140537f run, b819f17:bench/results/mla_sweep_cut_h200.log); cut alone was 248 / 450 / 493.
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, min_chunk=256, rescale_tau=0.0, cut=True,
                fill=True)


def splits_fill(programs: int, max_len: int, sms: int, min_chunk: int) -> int:
    """config fill=True: the fewest splits whose programs fill >= 90% of their last wave, counting a single
    partial wave too (num_splits_for wants at least one full wave: at N16 B1 it takes 15 splits, 240
    programs = 2 waves of 132 at 91%, where 8 splits = 128 programs run as one wave at 97% with the same
    tiles per SM and half the partials to merge; at B8 P8192, 1 split instead of 2: no merge kernel)."""
    most = max(1, -(-max_len // min_chunk))
    for s in range(1, most + 1):
        if programs * s / (-(-programs * s // sms) * sms) >= 0.9:
            return s
    return num_splits_for(programs, max_len, sms, min_chunk)


def trim_splits(splits: int, max_len: int, keys: int = 64) -> int:
    """The sm90 kernel's splits are chunks of ceil(prefix / splits) keys rounded up to whole keys-key tiles, so at a
    prefix of max_len the splits past ceil(max_len / chunk) are empty (119 splits of 32832 keys: chunks of 320, 103
    with keys; the last one also takes the tree's keys). Empty splits still write a partial that the merge reads:
    drop them, same chunk, same work a split (on the H200, N 1 B 1 prefix 32768: 25.1 vs 25.8 us;
    results/mla_sm90_splits_h200.log)."""
    if splits <= 1 or max_len <= 0:
        return max(1, splits)
    chunk = -(-(-(-max_len // splits)) // keys) * keys
    return -(-max_len // chunk)


def sm90_splits(programs: int, max_len: int, sms: int, min_chunk: int = 256) -> int:
    """The sm90 launcher's default split count (bench/dev/trace_mla.py and ceiling_mla.py size their buffers with it):
    splits_fill's, less the splits a full-length prefix leaves empty."""
    return trim_splits(splits_fill(programs, max_len, sms, min_chunk), max_len)


def _descriptors(kv_cache: Tensor, DV: int, BLOCK_N: int, BLOCK_H: int, BLOCK_R: int):
    """TMA descriptors of the cache's latent and rope columns as [num_pages * page_size, .] matrices, or
    None where TMA cannot read whole tiles: a tile must lie on one page and the rows must form one matrix
    with 16-byte aligned base, row stride and rope offset."""
    P, ps, D = kv_cache.shape
    es = kv_cache.element_size()
    ok = (TensorDescriptor is not None and ps % BLOCK_N == 0 and kv_cache.stride(2) == 1
          and kv_cache.stride(0) == ps * kv_cache.stride(1) and (kv_cache.stride(1) * es) % 16 == 0
          and kv_cache.data_ptr() % 16 == 0 and (DV * es) % 16 == 0 and BLOCK_H * es >= 16
          and (D == DV or BLOCK_R * es >= 16))
    if not ok:
        return None
    rows, rs = P * ps, kv_cache.stride(1)
    flat = kv_cache.as_strided((rows, D), (rs, 1))
    ka = TensorDescriptor(flat, [rows, DV], [rs, 1], [BLOCK_N, BLOCK_H])
    kr = TensorDescriptor(flat[:, DV:], [rows, D - DV], [rs, 1], [BLOCK_N, BLOCK_R]) if D > DV else ka
    return ka, kr


def tree_attention_mla(q: Tensor, kv_cache: Tensor, page_table: Tensor, prefix_lens: Tensor, tree_mask: Tensor,
                       scale: float, out: Tensor, lse: Optional[Tensor], config: dict,
                       kv_scale: Optional[Tensor] = None) -> None:
    """This kernel's launcher (checks done by tree_attention.tree_attention_mla, which calls it by
    default, or by tree_attention.tree_attention_mla_op for an fp8 cache: kv_scale its [] / [1] fp32 scale). config: tma
    (bool), rescale_tau (float, 0 = rescale every tile; ignored with cut), cut (bool), fill (bool), BLOCK_M,
    BLOCK_N, num_warps, num_stages, min_chunk, programs_per_sm, splits. Launches on the current device
    (tree_attention.tree_attention_mla and tree_attention_mla_op make q's current)."""
    B, N, W = tree_mask.shape
    G, D = q.shape[1], q.shape[2]
    DV = out.shape[2]
    DR = D - DV
    P, page_size = kv_cache.shape[0], kv_cache.shape[1]
    rows = N * G
    cfg = default_config(q.dtype)
    cfg.update(config)
    BLOCK_M = min(cfg["BLOCK_M"], pow2(rows))
    BLOCK_N = cfg["BLOCK_N"]
    if BLOCK_N not in (16, 32, 64):
        raise ValueError(f"config BLOCK_N must be 16, 32 or 64 (a tile spans at most two tree-mask words), "
                         f"got {BLOCK_N}")
    BLOCK_H = pow2(DV, 32) // 2
    BLOCK_R = pow2(max(DR, 1))
    m_blocks = -(-rows // BLOCK_M)
    max_len = page_table.shape[1] * page_size
    slots = sm_count(q.device) * cfg.get("programs_per_sm", 1)
    splits = cfg.get("splits") or (splits_fill if cfg.get("fill") else num_splits_for)(m_blocks * B, max_len, slots,
                                                                                       cfg["min_chunk"])
    splits = min(splits, MAX_SPLITS)
    split = splits > 1
    if split:
        po = torch.empty((splits, B, rows, DV), dtype=torch.float32, device=q.device)
        plse = torch.empty((splits, B, rows), dtype=torch.float32, device=q.device)
    else:
        po = plse = out  # unused
    desc = _descriptors(kv_cache, DV, BLOCK_N, BLOCK_H, BLOCK_R) if cfg["tma"] else None
    ka, kr = desc if desc is not None else (None, None)
    _mla_kernel[(m_blocks * B, splits)](
        q, kv_cache, ka, kr, page_table, prefix_lens, tree_mask, out, lse if lse is not None else out, po, plse,
        errors.error_word(q.device), kv_scale if kv_scale is not None else prefix_lens, scale * LOG2E, N, W, P,
        max_len, max(page_size, 1), splits,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), page_table.stride(0), out.stride(0),
        out.stride(1), G=G, DV=DV, DR=DR, BLOCK_H=BLOCK_H, BLOCK_R=BLOCK_R, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        SPLIT=split, HAS_LSE=lse is not None, TMA=desc is not None, TAU=float(cfg["rescale_tau"]),
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", CUT=bool(cfg.get("cut", False)),
        KV_SCALED=kv_scale is not None, Q_F16=kv_scale is not None and q.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    if split:
        merge_splits(po, plse, out, lse, N, 1, G)


_SM90A: dict = {}


def sm90_compiled(device: torch.device) -> bool:
    """Whether this build holds the sm90 kernel's real sm_90a code for `device` (a build for 9.0 without the
    'a', or for other archs only, compiles its body to a trap): the internal op refuses such a build with
    NotImplementedError before any launch. Asked once per device, on empty inputs (no stream work: safe
    during graph capture)."""
    if device.index not in _SM90A:
        def empty(*shape, dtype=torch.bfloat16):
            return torch.empty(shape, dtype=dtype, device=device)

        i32, f32 = torch.int32, torch.float32
        try:
            torch.ops.eagle3._tree_attention_mla_sm90(
                empty(0, 1, 576), empty(0, 1, 576), empty(0, 1, dtype=i32), empty(0, dtype=i32),
                empty(0, 1, 1, dtype=i32), 1.0, empty(0, 1, 512), None, empty(0, dtype=f32), empty(0, dtype=f32), 1)
            _SM90A[device.index] = True
        except NotImplementedError:
            _SM90A[device.index] = False
    return _SM90A[device.index]


FP8 = torch.float8_e4m3fn


def sm90_supported(q: Tensor, kv_cache: Tensor, out: Tensor, page_table: Tensor, tree_mask: Tensor) -> bool:
    """Whether csrc/mla_decode_sm90.cu's kernel serves this call: a Hopper GPU, a build that compiled it for
    sm_90a (sm90_compiled), bf16 / fp16 q with a cache of q's dtype or an fp8 e4m3 cache (the build's
    _tree_attention_mla_sm90_fp8 op) at Kimi's widths (576-dim keys, 512-dim V), 16-byte aligned rows of q and
    the cache, and sizes inside its 32-bit position arithmetic and grid (B on grid axis 1: at most 65535) (else
    the Triton kernel takes the call)."""
    fp8 = kv_cache.dtype == FP8
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and (kv_cache.dtype == q.dtype or fp8)
            and q.shape[2] == 576 and out.shape[2] == 512):
        return False
    if not (hopper_kernel(q.device, "_tree_attention_mla_sm90") and sm90_compiled(q.device)):
        return False
    if fp8 and not hopper_kernel(q.device, "_tree_attention_mla_sm90_fp8"):
        return False
    B, N, _ = tree_mask.shape
    if (page_table.shape[1] * kv_cache.shape[1] >= 2**31 or kv_cache.shape[0] >= 2**31 or B > 65535
            or N * q.shape[1] > 2**30):
        return False
    per16 = 16 // kv_cache.element_size()  # cache elements a 16-byte unit
    return (q.data_ptr() % 16 == 0 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and q.stride(2) == 1
            and kv_cache.data_ptr() % 16 == 0 and kv_cache.stride(0) % per16 == 0
            and kv_cache.stride(1) % per16 == 0 and kv_cache.stride(2) == 1 and out.stride(0) % 2 == 0
            and out.stride(1) % 2 == 0 and out.stride(2) == 1 and out.data_ptr() % 4 == 0)


def tree_attention_mla_sm90(q: Tensor, kv_cache: Tensor, page_table: Tensor, prefix_lens: Tensor,
                            tree_mask: Tensor, scale: float, out: Tensor, lse: Optional[Tensor], config: dict,
                            kv_scale: Optional[Tensor] = None) -> None:
    """The sm_90a CUDA kernel's launcher (checks done by tree_attention.tree_attention_mla, which makes q's device
    current: the merge launches on the current device): the split count
    as this file's fill rule less the splits a full-length prefix leaves empty (trim_splits; config: min_chunk,
    splits), then the kernel, then merge_splits. With more than one
    split the KV loads are marked L2 evict-first (config evict_first: False / True forces plain / marked loads),
    which keeps the partials in L2 for the merge: on the H200, N1 B1 P32768 25.8 vs 27.7 us; unsplit, plain loads
    are faster (N16 B8 P8192 286 vs 300 us; results/mla_sm90_early_h200.log). (The kernel's per-block trace and
    no-math builds are a development build's own op, _tree_attention_mla_sm90_dev: bench/dev/trace_mla.py.)
    (Ways that lost on the H200 at N1 B1: 129 splits of <= 4 tiles, results/mla_sweep_makespan_h200.log; splits
    reduced on chip by thread-block clusters,
    results/mla_sm90_cluster_h200.log; 2-byte split partials and bulk-copied partials, mla_sm90_early_h200.log; the
    merge as a CUDA kernel, launched plainly or by PDL, mla_sm90_merge_h200.log.)
    kv_scale: an fp8 e4m3 cache's [] / [1] fp32 scale (tree_attention.tree_attention_mla_op): the kernel's fp8
    build, _tree_attention_mla_sm90_fp8 (docs/kernels/tree_attention_mla_fp8.md), same splits and merge; its tiles
    are cp.async'ed into the upper half of the stage and converted in place. (Staging the tiles' bytes in
    registers instead, converted beside Q K^T, was 1.12-1.47x slower on every memory-bound row on the H200 at
    1246426, results/tree_attention_fp8_sm90_1246426_h200.log: that schedule was removed.)"""
    B, N, _ = tree_mask.shape
    G = q.shape[1]
    rows = N * G
    m_blocks = -(-rows // 64)
    max_len = page_table.shape[1] * kv_cache.shape[1]
    splits = config.get("splits") or sm90_splits(m_blocks * B, max_len, sm_count(q.device),
                                                 config.get("min_chunk", 256))
    splits = max(1, min(int(splits), MAX_SPLITS))  # grid axis 2
    if splits > 1:
        po = torch.empty((splits, B, rows, 512), dtype=torch.float32, device=q.device)
        plse = torch.empty((splits, B, rows), dtype=torch.float32, device=q.device)
    else:
        po = plse = out.new_empty((0,), dtype=torch.float32)
    evict_first = bool(config.get("evict_first", splits > 1))
    if kv_scale is not None:
        torch.ops.eagle3._tree_attention_mla_sm90_fp8(q, kv_cache, kv_scale, page_table, prefix_lens, tree_mask, scale,
                                                      out, lse, po, plse, splits, evict_first)
    else:
        torch.ops.eagle3._tree_attention_mla_sm90(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse,
                                                  po, plse, splits, evict_first)
    if splits > 1:
        merge_splits(po, plse, out, lse, N, 1, G)
