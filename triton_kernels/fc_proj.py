"""fc_proj on CUDA: out = norm(aux[rows]) @ (weight * weight_scale[:, None])^T (reference.fc_proj).

Decode and verify sizes (R <= STREAM_MAX_ROWS) are weight streaming: the 21504 x 7168 weight (308 MB in
bf16) is read once, in tiles of BLOCK_N output channels x BLOCK_K, split along K so that several
programs per SM keep many 16-byte loads in flight; the R rows of aux (gathered through `rows` by
pointer, never copied) are the small operand of a tensor-core dot computed as W_tile @ aux_tile^T
(swap-AB: the weight tile fills the MMA's M side). Each split's fp32 partial is written once and a second
small kernel sums the splits, applies the per-channel scale and rounds once to out's dtype. bf16 / fp16 and fp8
weights take the persistent stream-K kernel instead (stream_config), which gives every program the same number
of BLOCK_K steps over the (n-block, chunk, step) space, so no partial last wave of programs is left on a
few SMs; its partial sums per (program, n-block) are added in a fixed order (deterministic, no atomics).
An fp8 weight with bf16 rows dots in fp16: e4m3 -> fp16 is one native conversion a pair, and the rows go to fp16
scaled by 2^-8 (exact; undone after the loop).

The norms cost no pass over the weight: the per-row (norm_before_fc) or per-row-and-chunk (fc_norm)
rsqrt is computed first by a small kernel over aux [R, K]; a K split never straddles a chunk, so each
split's partial is multiplied by its chunk's rsqrt in fp32. A norm weight is applied to the aux tile on
the fly (prepare_fc_weight folds it into the weight columns once, at load, so it is usually absent).

Opt-in (EAGLE3_FC_FP8_MM=1, or _fc_proj's fp8_mm_min_rows; off by default: it quantises the activations, so its
answer differs from the reference's by the fp8 rule, and it has not been timed against the stream-K kernel yet), an
fp8 e4m3 weight at R >= FP8_MM_MIN_ROWS (16) with a bf16 out (K and Hd multiples of 16, a CUDA device of
compute capability 8.9+) takes cuBLAS's fp8 GEMM instead, at every R from there up: one kernel (_quant_row_kernel)
gathers the rows, applies the norm and rounds each row to e4m3 with its own scale amax / 448, torch._scaled_mm
multiplies that by the weight into fp32 (unit per-tensor scales: torch 2.11's rowwise ones measured slower,
FP8_MM_MODE), and a small kernel applies the rows' and the weight's scales and writes out. The activations are
quantised there, as vLLM's and SGLang's fp8 linear layers quantise theirs per token; the accuracy rule is in
_fp8_mm's docstring. Measured on the H200 (issue 23): the stream-K kernel took 66 us at T = 64 against
torch._scaled_mm's 40.7 us (per-tensor scales, fp8 activations).

Large R (prefill) uses cuBLAS through torch.mm on aux (normalised rows written once when a norm mode is on); an
fp8 weight there that _fp8_mm does not take is first dequantised to aux's dtype (cuBLAS has no bf16 x fp8
product); fp32 or mixed dtypes use the Triton kernel as a tiled GEMM.

Tuning runs (bench/dev/sweep_fc.py, tune_fc.py) and tests pick other tiles, or move the streaming / prefill
boundary, through _fc_proj's explicit arguments; the op itself always takes the defaults.

Any view the reference takes runs: aux and out are read and written through plain pointer loads and stores,
which Triton vectorises only where it sees the base address and the row stride 16-byte aligned (a column slice
of a wider buffer gets scalar accesses). Only the weight tiles go through TMA, and only
where Hopper allows it: base address, row stride and the first column of every box (chunk starts included)
16-byte aligned, else an "illegal instruction" kills the context (_tma_ok); otherwise plain loads. The default
tiles are cut down (stages, then BLOCK_K, then BLOCK_N) until an upper bound of their shared memory fits the
device (_fit_shared): 4-byte activations or weights need about twice the bf16 tiles' space.

A row index outside [0, T) cannot be raised without a host sync: it is recorded in the device error word
(eagle3_ops.check_errors() raises `fc_proj: rows[i] = v is out of range (valid: 0..T-1)`), its output row is
NaN and nothing is read out of bounds; the other rows are exact (the CPU reference raises instead). float64 is
for the CPU reference only: refused on CUDA.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import errors
from ._errors import NO_INDEX as _NO_INDEX
from ._errors import arg_id, op_id, report_range

# R up to this many rows: weight streaming; above: cuBLAS (or the tiled GEMM)
STREAM_MAX_ROWS = 64
# an fp8 weight at R from this many rows up: the activations quantised to e4m3, then torch._scaled_mm (_fp8_mm)
FP8_MM_MIN_ROWS = 16


def _fp8_mm_from_env() -> Optional[int]:
    """EAGLE3_FC_FP8_MM: unset, "" or "0": the op never quantises activations (FP8_MM_FROM None); "1": from
    FP8_MM_MIN_ROWS rows; an integer N >= 2: from N rows. Read once, at import."""
    v = os.environ.get("EAGLE3_FC_FP8_MM", "").strip()
    if v in ("", "0"):
        return None
    if not v.isdigit():
        raise ValueError(f"EAGLE3_FC_FP8_MM must be 0, 1 or a row count >= 2, got {v!r}")
    return FP8_MM_MIN_ROWS if v == "1" else int(v)


# where the op (fc_proj, its default) takes _fp8_mm: None (the default) never
FP8_MM_FROM = _fp8_mm_from_env()
_FROM_ENV = object()
# the activation quantisation's (widest row read whole, num_warps), a program a row: rows of up to that many
# columns (rounded up to a power of two) in one tile, read once (_quant_row_kernel: 106 registers at Kimi's fc_norm
# for sm_90a, no spills); wider rows twice, in blocks of at most 8192 (_quant_rows_kernel)
QUANT_CONFIG = (32768, 16)
# how _fp8_mm applies the rows' and the weight's scales: "tensorwise" (torch._scaled_mm with unit per-tensor scales
# into fp32, then _fp8_scale_kernel) or "rowwise" (torch._scaled_mm's rowwise scales, straight into out). Rowwise
# took 71.1 / 77.0 / 62.6 us at T = 16 / 32 / 64 on the H200 at 6501455 (torch 2.11; docs/kernels/fc_proj.md),
# per-tensor 40.7 us at T = 64 (issue 23)
FP8_MM_MODE = "tensorwise"
_NORM_CODE = {"none": 0, "norm_before_fc": 1, "fc_norm": 2}
# the error word's ids (eagle3_ops/errors.py)
_OP_FC_PROJ = tl.constexpr(op_id("fc_proj"))
_ARG_ROWS = tl.constexpr(arg_id("rows"))
_NO_ROW = tl.constexpr(2**31 - 1)


@triton.jit
def _report_row(err, i, value, T):
    """Record `fc_proj: rows[i] = value is out of range (valid: 0..T-1)` (the error path only)."""
    report_range(err, _OP_FC_PROJ, _ARG_ROWS, value, 0, T - 1, i, _NO_INDEX, _NO_INDEX)


@triton.jit
def _report_first_bad_row(err, rows, T, offs_t, bad):
    """_report_row for the first row of a tile whose index is out of range (bad [BLOCK_T]), if any."""
    first = tl.min(tl.where(bad, offs_t, _NO_ROW), axis=0)
    if first != _NO_ROW:
        _report_row(err, first, tl.load(rows + first).to(tl.int64), T)


@triton.jit
def _row_rstd_kernel(aux, stride_a, rows, T, K, CHUNK, n_chunks, rstd, eps,
                     HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """rstd[r, c] = 1 / sqrt(mean(aux[rows[r], c*CHUNK:(c+1)*CHUNK]^2) + eps), in fp32."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    if HAS_ROWS:
        src = tl.load(rows + r).to(tl.int64)
    else:
        src = r.to(tl.int64)
    valid = (src >= 0) & (src < T)
    src = tl.where(valid, src, 0)
    base = aux + src * stride_a + c.to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, CHUNK, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        a = tl.load(base + offs, mask=(offs < CHUNK) & valid, other=0.0).to(tl.float32)
        acc += a * a
    ms = tl.sum(acc, axis=0) / CHUNK
    tl.store(rstd + r * n_chunks + c, 1.0 / tl.sqrt(ms + eps))


@triton.jit
def _source_rows(rows, T, offs_t, t_ok, HAS_ROWS: tl.constexpr):
    """(aux row of each output row, clamped to 0 where out of range; whether it was in range)."""
    if HAS_ROWS:
        src = tl.load(rows + offs_t, mask=t_ok, other=0).to(tl.int64)
    else:
        src = offs_t.to(tl.int64)
    valid = t_ok & (src >= 0) & (src < T)
    return tl.where(valid, src, 0), valid


@triton.jit
def _fc_stream_kernel(aux, stride_a, rows, T, R, w, K, Hd, rstd, n_chunks, CHUNK, SPLITS_PER_CHUNK, K_PER_SPLIT,
                      nw, scale, out, stride_o, part, err,
                      HAS_ROWS: tl.constexpr, NORM: tl.constexpr, HAS_NW: tl.constexpr, HAS_SCALE: tl.constexpr,
                      SPLIT: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """One (output-channel tile, row tile, K split): acc[n, t] = sum_k w[n, k] * aux[rows[t], k]. SPLIT == 1:
    written to out (NaN rows for out-of-range indices, reported to err); else to part for _fc_reduce_kernel."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_t = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    n_ok = offs_n < Hd
    t_ok = offs_t < R
    src, valid = _source_rows(rows, T, offs_t, t_ok, HAS_ROWS)

    chunk = pid_k // SPLITS_PER_CHUNK
    k_lo = chunk * CHUNK + (pid_k % SPLITS_PER_CHUNK) * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, (chunk + 1) * CHUNK)
    w_ptrs = w + offs_n.to(tl.int64)[:, None] * K + k_lo + tl.arange(0, BLOCK_K)[None, :]
    a_ptrs = aux + src[None, :] * stride_a + k_lo + tl.arange(0, BLOCK_K)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        wt = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        at = tl.load(a_ptrs, mask=k_ok[:, None] & valid[None, :], other=0.0)
        if HAS_NW:
            at = at.to(tl.float32) * tl.load(nw + offs_k, mask=k_ok, other=0.0).to(tl.float32)[:, None]
        if F16:
            # fp8 weight: e4m3 -> fp16 is one native conversion per pair; the bf16 activations go to fp16
            # scaled by 2^-8 (exact), so values up to 1.6e7 stay finite (undone after the loop)
            acc = tl.dot(wt.to(tl.float16), (at.to(tl.float32) * 0.00390625).to(tl.float16), acc)
        elif IEEE:
            acc = tl.dot(wt.to(COMPUTE), at.to(COMPUTE), acc, input_precision="ieee")
        else:
            acc = tl.dot(wt.to(COMPUTE), at.to(COMPUTE), acc)
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    if F16:
        acc *= 256.0
    if NORM != 0:
        acc *= tl.load(rstd + offs_t * n_chunks + chunk, mask=t_ok, other=0.0)[None, :]
    if SPLIT == 1:
        if HAS_SCALE:
            acc *= tl.load(scale + offs_n, mask=n_ok, other=0.0)[:, None]
        acc = tl.where(valid[None, :], acc, float("nan"))
        if HAS_ROWS:
            _report_first_bad_row(err, rows, T, offs_t, t_ok & ~valid)
        o_ptrs = out + offs_t.to(tl.int64)[None, :] * stride_o + offs_n[:, None]
        tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=n_ok[:, None] & t_ok[None, :])
    else:
        p_ptrs = part + (pid_k * R + offs_t.to(tl.int64))[None, :] * Hd + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=n_ok[:, None] & t_ok[None, :])


@triton.jit
def _fc_reduce_kernel(part, rows, T, R, Hd, scale, out, stride_o, n_split, err,
                      HAS_ROWS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """out[r, n] = scale[n] * sum_s part[s, r, n], rounded once; NaN for an out-of-range row index (reported).
    n_split 0: zeros (the K == 0 product), still checking rows."""
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < Hd
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, n_split):
        acc += tl.load(part + (s * R + r).to(tl.int64) * Hd + offs, mask=ok, other=0.0)
    _store_row(acc, r, offs, ok, rows, T, scale, out, stride_o, err, HAS_ROWS, HAS_SCALE)


@triton.jit
def _store_row(acc, r, offs, ok, rows, T, scale, out, stride_o, err, HAS_ROWS: tl.constexpr,
               HAS_SCALE: tl.constexpr):
    """out[r, offs] = scale[offs] * acc rounded once; NaN where rows[r] is out of range (reported to err)."""
    if HAS_SCALE:
        acc *= tl.load(scale + offs, mask=ok, other=0.0)
    if HAS_ROWS:
        src = tl.load(rows + r).to(tl.int64)
        acc = tl.where((src >= 0) & (src < T), acc, float("nan"))
        if (src < 0) | (src >= T):
            _report_row(err, r, src, T)
    tl.store(out + r.to(tl.int64) * stride_o + offs, acc.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _fc_persistent_kernel(aux, stride_a, rows, T, R, w, w_desc, K, Hd, rstd, n_chunks, CHUNK, IPC, ITERS, nw, part,
                          HAS_ROWS: tl.constexpr, NORM: tl.constexpr, HAS_NW: tl.constexpr, F16: tl.constexpr,
                          TMA: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, S_MAX: tl.constexpr):
    """Stream-K: program p owns steps [p * ITERS, (p + 1) * ITERS) of the (n-block, chunk, BLOCK_K step) space
    (n-block-major), so every program streams the same number of weight bytes whatever the SM count.

    aux [T, K] (row stride stride_a); rows [R]; w [Hd, K] (w_desc: the same, [BLOCK_N, BLOCK_K] boxes);
    rstd [R, n_chunks] fp32; nw [K]; part [programs, S_MAX, R, BLOCK_N] fp32: program p's sum over the
    n-block nb is written to part[p, nb - first n-block of p] (deterministic; _fc_fixup_kernel adds them).
    """
    pid = tl.program_id(0)
    pid_t = tl.program_id(1)
    ipn = n_chunks * IPC
    start = pid * ITERS
    end = tl.minimum(start + ITERS, tl.cdiv(Hd, BLOCK_N) * ipn)
    nb_first = start // ipn
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < R
    src, valid = _source_rows(rows, T, offs_t, t_ok, HAS_ROWS)
    w_tile = (tl.arange(0, BLOCK_N) * K)[:, None] + tl.arange(0, BLOCK_K)[None, :]
    a_tile = (src * stride_a)[None, :] + tl.arange(0, BLOCK_K)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)  # NORM: the n-block's sum of rstd-scaled chunks
    acc_c = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)  # the current chunk's (NORM == 0: n-block's) sum
    for it in range(start, end):
        nb = it // ipn
        step = it - nb * ipn
        chunk = step // IPC
        kk = step - chunk * IPC
        k0 = chunk * CHUNK + kk * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < (chunk + 1) * CHUNK
        if TMA:  # past Hd / K: zeros; past the chunk: the masked activations contribute zero
            wt = w_desc.load([nb * BLOCK_N, k0])
        else:  # the tile's offsets are loop-invariant: one 64-bit base per step
            n_ok = nb * BLOCK_N + tl.arange(0, BLOCK_N) < Hd
            wt = tl.load(w + ((nb * BLOCK_N).to(tl.int64) * K + k0) + w_tile, mask=n_ok[:, None] & k_ok[None, :],
                         other=0.0, eviction_policy="evict_first")
        at = tl.load(aux + k0 + a_tile, mask=k_ok[:, None] & valid[None, :], other=0.0)
        if HAS_NW:
            at = at.to(tl.float32) * tl.load(nw + offs_k, mask=k_ok, other=0.0).to(tl.float32)[:, None]
        if F16:  # as in _fc_stream_kernel: activations scaled by 2^-8 into fp16, undone at the flush
            acc_c = tl.dot(wt.to(tl.float16), (at.to(tl.float32) * 0.00390625).to(tl.float16), acc_c)
        elif IEEE:
            acc_c = tl.dot(wt.to(COMPUTE), at.to(COMPUTE), acc_c, input_precision="ieee")
        else:
            acc_c = tl.dot(wt.to(COMPUTE), at.to(COMPUTE), acc_c)
        if NORM != 0:
            if (kk == IPC - 1) | (it == end - 1):
                acc += acc_c * tl.load(rstd + offs_t * n_chunks + chunk, mask=t_ok, other=0.0)[None, :]
                acc_c = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        if (step == ipn - 1) | (it == end - 1):
            slot = (pid * S_MAX + nb - nb_first).to(tl.int64)
            p_ptrs = part + (slot * R + offs_t)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
            if NORM != 0:
                res = acc
                acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
            else:
                res = acc_c
                acc_c = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
            if F16:
                res *= 256.0
            tl.store(p_ptrs, res, mask=t_ok[None, :])


@triton.jit
def _fc_fixup_kernel(part, rows, T, R, Hd, ipn, ITERS, scale, out, stride_o, err,
                     HAS_ROWS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, S_MAX: tl.constexpr):
    """out[r, n-block nb] = scale * (sum of the partials of the programs whose steps cover nb), in order."""
    r = tl.program_id(0)
    nb = tl.program_id(1)
    offs = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < Hd
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p in range(nb * ipn // ITERS, ((nb + 1) * ipn - 1) // ITERS + 1):
        slot = (p * S_MAX + nb - p * ITERS // ipn).to(tl.int64)
        acc += tl.load(part + (slot * R + r) * BLOCK_N + tl.arange(0, BLOCK_N))
    _store_row(acc, r, offs, ok, rows, T, scale, out, stride_o, err, HAS_ROWS, HAS_SCALE)


@triton.jit
def _checked_row(rows, r, T, err, HAS_ROWS: tl.constexpr):
    """(the aux row of output row r, whether it lies in [0, T)); an index outside is reported to err."""
    if HAS_ROWS:
        src = tl.load(rows + r).to(tl.int64)
    else:
        src = r.to(tl.int64)
    valid = (src >= 0) & (src < T)
    if HAS_ROWS:
        if not valid:
            _report_row(err, r, src, T)
    return src, valid


@triton.jit
def _normalise_rows_kernel(aux, stride_a, rows, T, K, CHUNK, n_chunks, rstd, nw, dst, err,
                           HAS_ROWS: tl.constexpr, NORM: tl.constexpr, HAS_NW: tl.constexpr, BLOCK: tl.constexpr):
    """dst[r] = norm(aux[rows[r]]) in dst's dtype (the prefill path's one pass before cuBLAS); NaN rows for indices
    outside [0, T), reported to err."""
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < K
    src, valid = _checked_row(rows, r, T, err, HAS_ROWS)
    a = tl.load(aux + tl.where(valid, src, 0) * stride_a + offs, mask=ok & valid, other=0.0).to(tl.float32)
    if NORM != 0:
        a *= tl.load(rstd + r * n_chunks + offs // CHUNK, mask=ok, other=0.0)
    if HAS_NW:
        a *= tl.load(nw + offs, mask=ok, other=0.0).to(tl.float32)
    a = tl.where(valid, a, float("nan"))
    tl.store(dst + r.to(tl.int64) * K + offs, a.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _round_e4m3(x):
    """x (fp32, |x| <= 448 up to rounding) rounded to nearest even on e4m3's grid, in fp32: 3 mantissa bits from
    2^-6 up (the fp32 mantissa rounded at bit 20, a carry moving into the exponent), steps of 2^-9 below (adding
    and subtracting 1.5 * 2^14 rounds there), at most 448; NaN stays NaN. The cast to e4m3 that follows is then
    exact, on the GPU and in the interpreter alike (whose own fp32 -> e4m3 cast drops the carry: 124.3 -> 64)."""
    ax = tl.abs(x)
    bits = ax.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    r = tl.where(ax < 0.015625, (ax + 24576.0) - 24576.0, bits.to(tl.float32, bitcast=True))
    r = tl.where(r > 448.0, 448.0, r)
    return tl.where(x < 0, -r, r)


@triton.jit
def _quant_rows_kernel(aux, stride_a, rows, T, R, K, CHUNK, n_chunks, nw, eps, q8, qscale, err,
                       HAS_ROWS: tl.constexpr, NORM: tl.constexpr, HAS_NW: tl.constexpr, NC: tl.constexpr,
                       BLOCK: tl.constexpr):
    """The rowwise fp8 operand of torch._scaled_mm: v = norm(aux[rows[r]]) * nw in fp32 (as _normalise_rows_kernel),
    qscale[r] = max(amax(|v|), 1e-30) / 448 and q8[r] = e4m3(v * 448 / max(amax, 1e-30)) (_round_e4m3: to nearest
    even; the largest |v| lands on 448, e4m3's largest finite value). NaN scale (so a NaN out row) for an index outside
    [0, T), reported to err.

    aux [T, K] (row stride stride_a); rows [R]; nw [K]; q8 [R, K] e4m3 contiguous; qscale [R + 1] fp32, its last
    element 1.0 (torch._scaled_mm's unit per-tensor scale, written by program 0). The row is
    n_chunks chunks of CHUNK columns (fc_norm: one rsqrt each; otherwise one chunk of K). The first pass sums
    squares and |aux * nw| maxima per chunk (rsqrt_c * max_c |aux * nw| is the chunk's amax), the second reads the
    row again (from L2) and quantises it; NC is n_chunks rounded up to a power of two."""
    r = tl.program_id(0)
    src, valid = _checked_row(rows, r, T, err, HAS_ROWS)
    base = aux + tl.where(valid, src, 0) * stride_a
    cols = tl.arange(0, BLOCK)
    chunk_ids = tl.arange(0, NC)
    rstd = tl.full([NC], 1.0, tl.float32)
    amax = 0.0
    for c in range(0, n_chunks):
        ss = tl.zeros([BLOCK], dtype=tl.float32)
        am = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, CHUNK, BLOCK):
            ok = (k + cols < CHUNK) & valid
            a = tl.load(base + c * CHUNK + k + cols, mask=ok, other=0.0).to(tl.float32)
            ss += a * a
            if HAS_NW:
                a *= tl.load(nw + c * CHUNK + k + cols, mask=ok, other=0.0).to(tl.float32)
            am = tl.maximum(am, tl.abs(a))
        rc = 1.0
        if NORM != 0:
            rc = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / CHUNK + eps)
        rstd = tl.where(chunk_ids == c, rc, rstd)
        amax = tl.maximum(amax, tl.max(am, axis=0) * rc)
    amax = _store_scale(qscale, r, R, amax, valid)
    inv = 448.0 / amax
    dst = q8 + r.to(tl.int64) * K
    for c in range(0, n_chunks):
        mult = tl.sum(tl.where(chunk_ids == c, rstd, 0.0), axis=0) * inv
        for k in range(0, CHUNK, BLOCK):
            ok = k + cols < CHUNK
            a = tl.load(base + c * CHUNK + k + cols, mask=ok & valid, other=0.0).to(tl.float32)
            if HAS_NW:
                a *= tl.load(nw + c * CHUNK + k + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(dst + c * CHUNK + k + cols, _round_e4m3(a * mult).to(q8.dtype.element_ty), mask=ok)


@triton.jit
def _store_scale(qscale, r, R, amax, valid):
    """qscale[r] = max(amax, 1e-30) / 448 (NaN for a bad row), qscale[R] = 1.0 by program 0; returns max(amax, 1e-30)."""
    amax = tl.maximum(amax, 1e-30)
    tl.store(qscale + r, tl.where(valid, amax / 448.0, float("nan")))
    if r == 0:
        tl.store(qscale + R, 1.0)
    return amax


@triton.jit
def _quant_row_kernel(aux, stride_a, rows, T, R, K, CHUNK, nw, eps, q8, qscale, err,
                      HAS_ROWS: tl.constexpr, NORM: tl.constexpr, HAS_NW: tl.constexpr, NC: tl.constexpr,
                      BLOCK: tl.constexpr):
    """_quant_rows_kernel's result with the whole row in one [BLOCK >= K] tile: one read, each chunk's sum of squares
    a masked reduction (NC = n_chunks, unrolled), then amax and the e4m3 row. The arguments are
    _quant_rows_kernel's."""
    r = tl.program_id(0)
    src, valid = _checked_row(rows, r, T, err, HAS_ROWS)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    a = tl.load(aux + tl.where(valid, src, 0) * stride_a + cols, mask=ok & valid, other=0.0).to(tl.float32)
    v = a
    if NORM != 0:
        part = cols // CHUNK
        rs = tl.zeros([BLOCK], dtype=tl.float32)
        for c in tl.static_range(NC):
            rc = 1.0 / tl.sqrt(tl.sum(tl.where(part == c, a * a, 0.0), axis=0) / CHUNK + eps)
            rs = tl.where(part == c, rc, rs)
        v = a * rs
    if HAS_NW:
        v = v * tl.load(nw + cols, mask=ok, other=0.0).to(tl.float32)
    amax = _store_scale(qscale, r, R, tl.max(tl.abs(v), axis=0), valid)
    tl.store(q8 + r.to(tl.int64) * K + cols, _round_e4m3(v * (448.0 / amax)).to(q8.dtype.element_ty), mask=ok)


def _compute_dtype(aux: Tensor, weight: Tensor) -> torch.dtype:
    if aux.dtype in (torch.bfloat16, torch.float16) and (weight.dtype == aux.dtype or weight.element_size() == 1):
        return aux.dtype
    return torch.float32


def _via_f16(aux: Tensor, weight: Tensor) -> bool:
    """An fp8 weight with bf16 rows: the dot runs in fp16 (the module docstring). A bf16 dot of the converted
    weight was the alternative: 65.9 vs 48.4 us at T = 1 with the split-K tiles of the time, the best of each
    (bench/results/fc_sweep_h200.log), so it was removed."""
    return weight.element_size() == 1 and _compute_dtype(aux, weight) == torch.bfloat16


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def parse_override(config: str) -> tuple:
    """A tile config "BN,BK,SPLIT,warps,stages[,PER_SM[,TMA]]" (_fc_proj's `config`) as 7 ints (PER_SM, TMA default
    to 0). PER_SM > 0 selects the persistent stream-K kernel with PER_SM programs per SM (SPLIT is then unused);
    TMA=1 loads its weight tiles through a host-side tensor descriptor."""
    v = [int(x) for x in config.split(",")]
    if not 5 <= len(v) <= 7:
        raise ValueError(f"fc_proj config {config!r}: expected 5 to 7 comma-separated ints "
                         "BN,BK,SPLIT,warps,stages[,PER_SM[,TMA]]")
    return tuple(v + [0] * (7 - len(v)))


def stream_config(R: int, Hd: int, K: int, n_chunks: int, weight: Tensor, override: Optional[str] = None) -> dict:
    """Tile sizes and the K split for the weight-streaming kernel (an override config replaces them: parse_override),
    sized for bf16 activations; _fit_shared cuts them down where the dtypes need more shared memory."""
    per_sm, tma = 0, 0
    if override:
        bn, bk, split, warps, stages, per_sm, tma = parse_override(override)
    elif weight.element_size() == 1:
        # stream-K, TMA weight tiles, 2 programs per SM; measured on the H200 at 5180f72
        # (bench/results/fc_sweep_streamk_h200.log): 42.1 / 44.8 / 65.1 us at T = 1 / 16 / 64
        bn, bk, split, warps, stages, per_sm, tma = 128, 128, 0, 4, 4, 2, 1
    elif weight.element_size() == 2:
        # stream-K, TMA weight tiles, one 8-warp program per SM: 72.8 / 75.8 / 84.0 us at T = 1 / 16 / 64
        bn, bk, split, warps, stages, per_sm, tma = 128, 128, 0, 8, 4, 1, 1
    else:
        # fp32 weights: split-K (the stream-K tiles above would not fit shared memory in fp32)
        bn, bk, split, warps, stages = (64 if R <= 16 else 128), 128, 4, 4, 4
    spc = max(1, split // n_chunks)  # splits per chunk: a split never straddles a chunk
    return dict(BLOCK_N=bn, BLOCK_K=bk, splits_per_chunk=spc, num_warps=warps, num_stages=stages, per_sm=per_sm,
                tma=tma)


def shared_need(cfg: dict, block_t: int, aux: Tensor, weight: Tensor, has_nw: bool) -> int:
    """An upper bound of the shared memory (bytes) the stream / stream-K kernels take on sm_90 with cfg's tiles:
    num_stages buffers of a weight [BLOCK_N, BLOCK_K] and an activation [BLOCK_K, block_t] tile, the [BLOCK_N,
    block_t] fp32 accumulator's exchange before a store, each tile again in the dot's dtype where it is converted
    first (an fp8 weight, fp32 compute, a norm weight applied), and the barriers. Above what Triton 3.8 gives 184
    variants compiled for sm_90a (every dtype pair, BLOCK_T 16-64, 2-4 stages, norm weight or not; within 1% for
    same-dtype tiles at BLOCK_T 16-32); fp32 rows at BLOCK_T 32 took 263680 bytes before this cut."""
    bn, bk, stages = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_stages"]
    dot = torch.float16 if _via_f16(aux, weight) else _compute_dtype(aux, weight)
    need = stages * bk * (bn * weight.element_size() + block_t * aux.element_size()) + 4 * bn * block_t + 1024
    if weight.dtype != dot:
        need += bn * bk * dot.itemsize
    if aux.dtype != dot or has_nw:
        need += bk * block_t * dot.itemsize
    return need


def _fit_shared(cfg: dict, block_t: int, aux: Tensor, weight: Tensor, has_nw: bool) -> dict:
    """cfg with num_stages (down to 2), then BLOCK_K and BLOCK_N (halved, down to 32) lowered until shared_need
    fits the device."""
    cfg = dict(cfg)
    limit = _limits(aux.device)[1]
    while shared_need(cfg, block_t, aux, weight, has_nw) > limit:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["BLOCK_K"] > 32:
            cfg["BLOCK_K"] //= 2
        elif cfg["BLOCK_N"] > 32:
            cfg["BLOCK_N"] //= 2
        else:
            break
    return cfg


def _tma_ok(t: Tensor, *column_steps: int) -> bool:
    """Whether TMA may read t [rows, cols] in boxes whose first columns are sums of multiples of column_steps:
    Hopper wants the base address, the row stride and every box's first column 16-byte aligned (else an
    "illegal instruction" that kills the context: a chunk of 24 fp8 columns was one)."""
    e = t.element_size()
    return t.data_ptr() % 16 == 0 and t.stride(0) * e % 16 == 0 and all(s * e % 16 == 0 for s in column_steps)


def _norm_rstd(aux, rows, T, R, K, n_chunks, eps):
    rstd = torch.empty(R, n_chunks, dtype=torch.float32, device=aux.device)
    chunk = K // n_chunks
    _row_rstd_kernel[(R, n_chunks)](aux, aux.stride(0), rows if rows is not None else aux, T, K, chunk, n_chunks,
                                    rstd, eps, HAS_ROWS=rows is not None, BLOCK=min(2048, triton.next_power_of_2(chunk)))
    return rstd


def _streamed(aux, weight, weight_scale, nw, rstd, norm, n_chunks, rows, out, T, R, K, Hd, block_t, cfg, err):
    compute = _compute_dtype(aux, weight)
    chunk = K // n_chunks
    spc = cfg["splits_per_chunk"]
    k_per_split = triton.cdiv(triton.cdiv(chunk, spc), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    spc = triton.cdiv(chunk, k_per_split)
    n_split = spc * n_chunks
    part = torch.empty(n_split, R, Hd, dtype=torch.float32, device=aux.device) if n_split > 1 else out
    grid = (triton.cdiv(Hd, cfg["BLOCK_N"]), n_split, triton.cdiv(R, block_t))
    _fc_stream_kernel[grid](
        aux, aux.stride(0), rows if rows is not None else aux, T, R, weight, K, Hd,
        rstd if rstd is not None else aux, n_chunks, chunk, spc, k_per_split,
        nw if nw is not None else aux, weight_scale if weight_scale is not None else aux, out, out.stride(0), part,
        err, HAS_ROWS=rows is not None, NORM=norm, HAS_NW=nw is not None, HAS_SCALE=weight_scale is not None,
        SPLIT=n_split, COMPUTE=_TL[compute], IEEE=compute == torch.float32, F16=_via_f16(aux, weight),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], BLOCK_T=block_t,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if n_split > 1:
        _reduced(part, rows, T, R, Hd, weight_scale, out, n_split, err)


def _reduced(part, rows, T, R, Hd, weight_scale, out, n_split, err):
    """out = scale * the sum of part's n_split slices, with the rows check (n_split 0: zeros)."""
    block = 1024
    _fc_reduce_kernel[(R, max(1, triton.cdiv(Hd, block)))](
        part, rows if rows is not None else out, T, R, Hd, weight_scale if weight_scale is not None else out, out,
        out.stride(0), n_split, err, HAS_ROWS=rows is not None, HAS_SCALE=weight_scale is not None, BLOCK=block)


_LIMITS: dict = {}


def _limits(device: torch.device) -> tuple:
    """(multiprocessors, shared memory bytes a program may take) of a device, asked once. The interpreter: 2
    "SMs" (few programs, so that ranges straddle n-blocks and chunks) and an H200's 232448 bytes (its tiles)."""
    if device.type != "cuda":
        return 2, 232448
    if device.index not in _LIMITS:
        props = triton.runtime.driver.active.utils.get_device_properties(device.index)
        _LIMITS[device.index] = props["multiprocessor_count"], props["max_shared_mem"]
    return _LIMITS[device.index]


def _persistent(aux, weight, weight_scale, nw, rstd, norm, n_chunks, rows, out, T, R, K, Hd, block_t, cfg, err):
    """Stream-K over (n-block, chunk, BLOCK_K step): cfg["per_sm"] programs per SM, equal step counts."""
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    chunk = K // n_chunks
    ipc = triton.cdiv(chunk, bk)
    ipn = n_chunks * ipc
    total = triton.cdiv(Hd, bn) * ipn
    iters = triton.cdiv(total, cfg["per_sm"] * _limits(aux.device)[0])
    programs = triton.cdiv(total, iters)
    s_max = triton.cdiv(iters, ipn) + 1  # n-blocks one program's steps can touch
    part = torch.empty(programs, s_max, R, bn, dtype=torch.float32, device=aux.device)
    compute = _compute_dtype(aux, weight)
    # weight boxes start at chunk * CHUNK + step * BLOCK_K columns
    tma = bool(cfg["tma"]) and _tma_ok(weight, chunk, bk)
    desc = TensorDescriptor.from_tensor(weight, [bn, bk]) if tma else weight
    _fc_persistent_kernel[(programs, triton.cdiv(R, block_t))](
        aux, aux.stride(0), rows if rows is not None else aux, T, R, weight, desc, K, Hd,
        rstd if rstd is not None else aux, n_chunks, chunk, ipc, iters, nw if nw is not None else aux, part,
        HAS_ROWS=rows is not None, NORM=norm, HAS_NW=nw is not None, F16=_via_f16(aux, weight), TMA=tma,
        COMPUTE=_TL[compute], IEEE=compute == torch.float32, BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=block_t, S_MAX=s_max,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _fc_fixup_kernel[(R, triton.cdiv(Hd, bn))](
        part, rows if rows is not None else aux, T, R, Hd, ipn, iters,
        weight_scale if weight_scale is not None else aux, out, out.stride(0), err, HAS_ROWS=rows is not None,
        HAS_SCALE=weight_scale is not None, BLOCK_N=bn, S_MAX=s_max)


def _prepared_rows(aux, rows, T, R, K, n_chunks, norm, rstd, nw, err) -> Tensor:
    """[R, K] of aux's dtype: norm(aux[rows]) with nw applied, written once (NaN rows for bad indices, reported)."""
    a = torch.empty(R, K, dtype=aux.dtype, device=aux.device)
    block = 1024
    _normalise_rows_kernel[(R, triton.cdiv(K, block))](
        aux, aux.stride(0), rows if rows is not None else aux, T, K, K // n_chunks, n_chunks,
        rstd if rstd is not None else aux, nw if nw is not None else aux, a, err,
        HAS_ROWS=rows is not None, NORM=norm, HAS_NW=nw is not None, BLOCK=block)
    return a


def fc_proj(aux: Tensor, weight: Tensor, weight_scale: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
            norm_mode: str, rows: Optional[Tensor], out: Tensor) -> None:
    """The CUDA launcher (arguments already checked by eagle3_ops._validate.fc_proj), on aux's device. A rows
    index outside [0, T) is recorded in the device error word and its out row is NaN (the module docstring)."""
    _fc_proj(aux, weight, weight_scale, norm_weight, eps, norm_mode, rows, out)


def _fc_proj(aux: Tensor, weight: Tensor, weight_scale: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
             norm_mode: str, rows: Optional[Tensor], out: Tensor, *, config: Optional[str] = None,
             stream_max_rows: int = STREAM_MAX_ROWS, fp8_mm_min_rows: Optional[int] = _FROM_ENV,
             quant_config: tuple = QUANT_CONFIG, fp8_mm_mode: str = FP8_MM_MODE) -> None:
    """fc_proj's launcher with its choices made explicit, for tuning runs and tests (the op passes the defaults).

    config : str, optional
        "BN,BK,SPLIT,warps,stages[,PER_SM[,TMA]]" (parse_override), taken as given for the weight-streaming
        kernels instead of stream_config's tiles (not cut to fit shared memory: a tuning run wants its own error).
    stream_max_rows : int
        R up to this many rows streams the weight; above, cuBLAS or the tiled GEMM (0: always the latter).
    fp8_mm_min_rows : int, optional
        An fp8 weight at R >= this many rows takes _fp8_mm where it applies (_fp8_mm_applies); None: never;
        not given: FP8_MM_FROM (EAGLE3_FC_FP8_MM; None unless set).
    quant_config : (int, int)
        QUANT_CONFIG: the widest row quantised in one tile, and num_warps.
    fp8_mm_mode : str
        "tensorwise" or "rowwise" (FP8_MM_MODE).
    """
    for name, t in (("aux", aux), ("weight", weight), ("norm_weight", norm_weight), ("out", out)):
        if t is not None and t.dtype == torch.float64:
            raise TypeError(f"{name} must have dtype bfloat16 | float16 | float32 on CUDA (float64 runs on the CPU "
                            "reference only), got float64")
    if fp8_mm_min_rows is _FROM_ENV:
        fp8_mm_min_rows = FP8_MM_FROM
    T, K = aux.shape
    Hd = weight.shape[0]
    R = out.shape[0]
    if R == 0:
        return
    n_chunks = norm_weight.shape[0] if norm_mode == "fc_norm" else 1
    norm = _NORM_CODE[norm_mode]
    nw = norm_weight.reshape(-1) if norm_weight is not None else None
    err = errors.error_word(aux.device)
    # (CPU tensors only under TRITON_INTERPRET=1, in the tests)
    on_device = torch.cuda.device(aux.device) if aux.is_cuda else contextlib.nullcontext()
    with on_device:
        if K == 0 or Hd == 0:  # nothing to multiply: zeros (the empty sum), still checking rows
            _reduced(out, rows, T, R, Hd, None, out, 0, err)
        else:
            if fp8_mm_min_rows is not None and R >= fp8_mm_min_rows and _fp8_mm_applies(weight, weight_scale, out):
                _fp8_mm(aux, weight, weight_scale, nw, eps, norm, n_chunks, rows, out, R, err, quant_config,
                        fp8_mm_mode)
            else:
                _launch(aux, weight, weight_scale, nw, eps, norm, n_chunks, rows, out, T, R, K, Hd, err, config,
                        stream_max_rows)
    errors.after_launch(aux.device)


_FP8_MM_DEVICES: dict = {}


def _fp8_mm_applies(weight: Tensor, weight_scale: Optional[Tensor], out: Tensor) -> bool:
    """Whether _fp8_mm takes this call: an e4m3 weight with its scale, a bf16 out, K and Hd multiples of 16
    (torch._scaled_mm's rule), the weight 16-byte aligned, and fp8 tensor cores (CUDA capability 8.9+; the CPU
    tensors of the interpreter's tests run torch._scaled_mm's CPU kernel)."""
    Hd, K = weight.shape
    if not (weight.dtype == getattr(torch, "float8_e4m3fn", None) and weight_scale is not None
            and weight_scale.is_contiguous() and out.dtype == torch.bfloat16 and K % 16 == 0 and Hd % 16 == 0
            and weight.data_ptr() % 16 == 0):
        return False
    dev = weight.device
    if dev.type == "cuda" and dev.index not in _FP8_MM_DEVICES:
        _FP8_MM_DEVICES[dev.index] = torch.cuda.get_device_capability(dev) >= (8, 9)
    return dev.type != "cuda" or _FP8_MM_DEVICES[dev.index]


def _fp8_mm(aux, weight, weight_scale, nw, eps, norm, n_chunks, rows, out, R, err, quant_config, mode):
    """out = (q8 @ weight^T) * qscale[:, None] * weight_scale[None, :], q8 / qscale = _quant_rows_kernel's e4m3 rows
    of norm(aux[rows]) * nw and their scales: one Triton launch, torch._scaled_mm (cuBLAS), and in the
    "tensorwise" mode (FP8_MM_MODE) _fp8_scale_kernel applying both scales to its fp32 product and writing out at
    any row stride; "rowwise" gives the scales to torch._scaled_mm (out written there where it is contiguous,
    else through a temporary and a copy).

    Accuracy rule (the activation quantisation): each element of v = norm(aux[rows]) * nw is rounded to e4m3
    (3 mantissa bits) after scaling its row by 448 / amax(|v|): a relative error of at most 2^-4 where the scaled
    value is normal (|v| >= 2^-6 * amax / 448), an absolute error of at most 2^-10 * amax / 448 below that. The
    output is the float64 product of those rounded rows with the dequantised weight, within the bf16 rule
    (tests/test_fc_proj.py _check_fp8_mm: against the rows quantised the same way; Gaussian rows land at 2.5-2.9%
    relative error from the unquantised reference, the tests allow 4%)."""
    q8, qscale = quantised_rows(aux, nw, eps, norm, n_chunks, rows, R, err, quant_config)
    if mode == "rowwise":
        dst = out if out.is_contiguous() else torch.empty(R, out.shape[1], dtype=out.dtype, device=out.device)
        torch._scaled_mm(q8, weight.t(), scale_a=qscale[:R], scale_b=weight_scale.view(1, -1), out_dtype=out.dtype,
                         out=dst)
        if dst is not out:
            out.copy_(dst)
        return
    one = qscale[R:]
    acc = torch._scaled_mm(q8, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    Hd, block = out.shape[1], 1024
    _fp8_scale_kernel[(R, triton.cdiv(Hd, block))](acc, qscale, weight_scale, out, out.stride(0), Hd, err,
                                                    BLOCK=block)


@triton.jit
def _fp8_scale_kernel(acc, qscale, scale, out, stride_o, Hd, err, BLOCK: tl.constexpr):
    """out[r, n] = acc[r, n] * qscale[r] * scale[n], rounded once (acc [R, Hd] fp32 contiguous; a NaN qscale: the
    bad row _quant_rows_kernel reported, NaN)."""
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < Hd
    a = tl.load(acc + r.to(tl.int64) * Hd + offs, mask=ok, other=0.0) * tl.load(qscale + r)
    _store_row(a, r, offs, ok, acc, 0, scale, out, stride_o, err, False, True)


def quantised_rows(aux: Tensor, nw: Optional[Tensor], eps: float, norm: int, n_chunks: int, rows: Optional[Tensor],
                   R: int, err: Tensor, quant_config: tuple = QUANT_CONFIG) -> tuple[Tensor, Tensor]:
    """(q8 [R, K] e4m3, qscale [R + 1, 1] fp32, the last 1.0): _quant_rows_kernel's rows of norm(aux[rows]) * nw
    (norm a _NORM_CODE, n_chunks the fc_norm chunks or 1), for _fp8_mm and the tests."""
    T, K = aux.shape
    q8 = torch.empty(R, K, dtype=torch.float8_e4m3fn, device=aux.device)
    qscale = torch.empty(R + 1, 1, dtype=torch.float32, device=aux.device)
    chunk = K // n_chunks
    common = (aux, aux.stride(0), rows if rows is not None else aux, T, R, K, chunk)
    flags = dict(HAS_ROWS=rows is not None, NORM=norm, HAS_NW=nw is not None, num_warps=quant_config[1])
    nw = nw if nw is not None else aux
    if triton.next_power_of_2(K) <= quant_config[0] and n_chunks <= 8:  # (NC chunks unrolled)
        _quant_row_kernel[(R,)](*common, nw, eps, q8, qscale, err, NC=n_chunks, BLOCK=triton.next_power_of_2(K),
                                **flags)
    else:
        _quant_rows_kernel[(R,)](*common, n_chunks, nw, eps, q8, qscale, err, NC=triton.next_power_of_2(n_chunks),
                                 BLOCK=min(quant_config[0], 8192, triton.next_power_of_2(chunk)), **flags)
    return q8, qscale


def _launch(aux, weight, weight_scale, nw, eps, norm, n_chunks, rows, out, T, R, K, Hd, err, config, stream_max_rows):
    rstd = _norm_rstd(aux, rows, T, R, K, n_chunks, eps) if norm else None
    if R <= stream_max_rows:
        block_t = max(16, triton.next_power_of_2(R))
        cfg = stream_config(R, Hd, K, n_chunks, weight, config)
        if not config:
            cfg = _fit_shared(cfg, block_t, aux, weight, nw is not None)
        launch = _persistent if cfg["per_sm"] > 0 else _streamed
        launch(aux, weight, weight_scale, nw, rstd, norm, n_chunks, rows, out, T, R, K, Hd, block_t, cfg, err)
    elif aux.dtype in (torch.bfloat16, torch.float16) and out.dtype == aux.dtype and (
            weight.dtype == aux.dtype or weight.element_size() == 1):
        # prefill: cuBLAS on aux itself, or on the normalised / gathered rows written once; an fp8 (or
        # scaled) weight is dequantised to aux's dtype first (cuBLAS has no bf16 x fp8 product)
        w_mm = weight if weight_scale is None else _dequantised(weight, weight_scale, aux.dtype)
        if norm or rows is not None or nw is not None:
            a = _prepared_rows(aux, rows, T, R, K, n_chunks, norm, rstd, nw, err)
        else:
            a = aux
        torch.mm(a, w_mm.t(), out=out)
    else:
        # fp32 / mixed precision / another out dtype at prefill size: the same kernel as a tiled GEMM
        # (one rounding, fp32 accumulation, IEEE fp32 products where the reference has them)
        cfg = dict(BLOCK_N=128, BLOCK_K=64, splits_per_chunk=1, num_warps=8, num_stages=4)
        cfg = _fit_shared(cfg, 64, aux, weight, nw is not None)
        _streamed(aux, weight, weight_scale, nw, rstd, norm, n_chunks, rows, out, T, R, K, Hd, 64, cfg, err)


@triton.jit
def _dequant_kernel(w, scale, dst, n_elem, K, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_elem
    v = tl.load(w + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_SCALE:
        v *= tl.load(scale + offs // K, mask=ok, other=0.0)
    tl.store(dst + offs, v.to(dst.dtype.element_ty), mask=ok)


def _dequantised(weight: Tensor, weight_scale: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """weight * weight_scale[:, None] in `dtype` (rounded once), for the cuBLAS prefill path."""
    dst = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    block = 4096
    _dequant_kernel[(triton.cdiv(weight.numel(), block),)](
        weight, weight_scale if weight_scale is not None else weight, dst, weight.numel(), weight.shape[1],
        HAS_SCALE=weight_scale is not None, BLOCK=block)
    return dst
