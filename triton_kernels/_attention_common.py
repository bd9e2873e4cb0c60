"""What the tree-attention launchers share: tree_attention.py's kernel, mla_decode.py's Triton kernel and
the sm_90a CUDA kernel's launcher (mla_decode.tree_attention_mla_sm90) split a request's prefix by one rule
(num_splits_for), find a request's span and report its bad values the same way inside the kernels
(request_span, report_request), and combine their split partials with one merge kernel (merge_splits).

This module sits below both kernel modules and imports neither: tree_attention.py (which picks the kernel for
tree_attention_mla) imports mla_decode.py, and both import this.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._errors import NO_INDEX as _NO_INDEX
from ._errors import arg_id, op_id, report_range

LOG2E = 1.0 / math.log(2.0)  # scores are scaled by scale * LOG2E, so the kernels use exp2 / log2
MAX_SPLITS = 65535  # grid axis 1 (and the sm90 kernel's axis 2)

# error word ids (eagle3_ops/errors.py: position + 1)
OP_MLA = op_id("tree_attention_mla")
OP_GQA = op_id("tree_attention")
_ARG_PAGE_TABLE = tl.constexpr(arg_id("page_table"))
_ARG_PREFIX_LENS = tl.constexpr(arg_id("prefix_lens"))
NO_POS = tl.constexpr(2**31 - 1)  # "no bad position seen" in the kernels' running minimum


@triton.jit
def report_request(ERR, OP: tl.constexpr, PL, PT, b, stride_pt, CAPACITY, N, first, PAGE_SIZE, NUM_PAGES):
    """Record request b's bad value (the error path only): its prefix length, else the page id of its first
    position `first` whose page is out of range (NO_POS: none). It reloads the prefix length and the page-table
    row rather than taking request_span's values, so that nothing of this cold path stays live across the KV
    loop; the kernels call it last, after their stores (see tree_attention.py's kernel)."""
    prefix_raw = tl.load(PL + b)
    if (prefix_raw < 0) | (prefix_raw > CAPACITY - N):
        report_range(ERR, OP, _ARG_PREFIX_LENS, prefix_raw, 0, CAPACITY - N, b, _NO_INDEX, _NO_INDEX)
    elif first < NO_POS:
        slot = first // PAGE_SIZE
        report_range(ERR, OP, _ARG_PAGE_TABLE, tl.load(PT + b.to(tl.int64) * stride_pt + slot), 0, NUM_PAGES - 1,
                     b, slot, _NO_INDEX)


@triton.jit
def request_span(PL, PT, b, stride_pt, CAPACITY, N, NUM_SPLITS, pid_s, BLOCK_N: tl.constexpr):
    """Request b's prefix and this split's share of it: (bad_prefix, prefix_raw, prefix, tree_n, pt_row,
    start, end). A bad prefix length (negative, or no room for the N tree rows in the page table) skips the
    request: prefix 0 and tree_n 0 (no tree rows), so nothing is read; the caller poisons its result with
    NaN. Splits are whole BLOCK_N tiles."""
    prefix_raw = tl.load(PL + b)
    bad_prefix = (prefix_raw < 0) | (prefix_raw > CAPACITY - N)
    prefix = tl.where(bad_prefix, 0, prefix_raw)
    tree_n = tl.where(bad_prefix, 0, N)
    pt_row = PT + b.to(tl.int64) * stride_pt
    chunk = tl.cdiv(tl.cdiv(prefix, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_s * chunk
    end = tl.minimum(start + chunk, prefix)
    return bad_prefix, prefix_raw, prefix, tree_n, pt_row, start, end


@triton.jit
def _merge_kernel(PO, PLSE, O, LSE, N, HKV, NUM_SPLITS, stride_ot, stride_oh,
                  G: tl.constexpr, DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr,
                  HAS_LSE: tl.constexpr):
    # PO [NUM_SPLITS, B * HKV, N * G, DV] fp32 and PLSE [NUM_SPLITS, B * HKV, N * G] fp32: per split, the
    #     normalised partial output and its log2-sum-exp2 (in units of scale * log2 e), rows node-major;
    # O [B * N, NH, DV] strides (stride_ot, stride_oh, 1); LSE [B * N, NH] fp32 contiguous.
    # Grid (B * HKV * N * G, DV blocks): one program, one query row (rows of one (request, KV head) neighbours),
    # BLOCK_V output dims; splits combined with weights exp2(lse_s - lse), BLOCK_S
    # splits a step with a running max (one step, lse and partials loaded together, when BLOCK_S >= NUM_SPLITS:
    # the launcher sizes the tile so; a first pass for the max, then a loop, made this latency-bound).
    ROWS = N * G
    row = tl.program_id(0) % ROWS
    pid_bh = tl.program_id(0) // ROWS
    pid_v = tl.program_id(1)
    BH = tl.num_programs(0) // ROWS
    s = tl.arange(0, BLOCK_S)
    v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_run = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        ok = s0 + s < NUM_SPLITS
        prow = ((s0 + s).to(tl.int64) * BH + pid_bh) * ROWS + row
        lse_s = tl.load(PLSE + prow, mask=ok, other=float("-inf"))
        part = tl.load(PO + prow[:, None] * DV + v[None, :], mask=ok[:, None] & (v[None, :] < DV), other=0.0)
        m_new = tl.maximum(m_run, tl.max(lse_s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_run - m_use)  # 0 on the first step (m_run = -inf)
        w = tl.math.exp2(lse_s - m_use)  # NaN partials (bad values) stay NaN through w and part
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        m_run = m_new
    m_use = tl.where(m_run == float("-inf"), 0.0, m_run)
    o = acc / total
    b = pid_bh // HKV
    token = (b * N + row // G).to(tl.int64)
    head = (pid_bh % HKV) * G + row % G
    tl.store(O + token * stride_ot + head * stride_oh + v, o.to(O.dtype.element_ty), mask=v < DV)
    if HAS_LSE:
        if pid_v == 0:
            lse_o = (m_use + tl.math.log2(total)) * 0.6931471805599453
            tl.store(LSE + token * (HKV * G) + head + tl.arange(0, 1), lse_o)


def merge_splits(po: Tensor, plse: Tensor, out: Tensor, lse: Optional[Tensor], N: int, HKV: int, G: int) -> None:
    """Combine the split programs' partials po [splits, B * HKV, N * G, DV] / plse [splits, B * HKV, N * G] into
    out (and lse). The tile holds every split up to 128 (one step), BLOCK_V sized to 8192 elements: on the H200
    the former 16-split x 128-dim steps (after a pass for the max) took 13.2 us for 119 splits of 64 x 512
    (N 1, B 1, prefix 32768; bench/dev/profile_mla.py), 4096-element tiles 5.1 us, these 4.5 us (L2-hot partials,
    results/mla_sm90_early_h200.log)."""
    splits, BH, rows, DV = po.shape
    block_s = min(128, pow2(splits, 2))
    block_v = min(pow2(DV), max(32, 8192 // block_s))
    _merge_kernel[(rows * BH, -(-DV // block_v))](
        po, plse, out, lse if lse is not None else out, N, HKV, splits, out.stride(0), out.stride(1),
        G=G, DV=DV, BLOCK_S=block_s, BLOCK_V=block_v, HAS_LSE=lse is not None, num_warps=4)


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """SMs of `device`, asked of CUDA once per device (the split rules size their waves by it)."""
    if device.type != "cuda":
        return 8  # the interpreter: a few programs per split are enough to exercise the merge
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device.index]


def pow2(n: int, least: int = 16) -> int:
    """The next power of two >= n, at least `least` (tile sizes)."""
    return max(least, triton.next_power_of_2(n))


def num_splits_for(programs: int, max_len: int, sms: int, min_chunk: int) -> int:
    """Splits of the prefix, from shapes only (max_len bounds every prefix): the fewest that fill the
    SMs in near-whole waves (at one program per SM, >= 90% of the SM-slots of the last wave busy), each
    split at least min_chunk positions long; when no split count reaches one full wave, the most."""
    most = max(1, -(-max_len // min_chunk))
    if programs * most <= sms:
        return most
    waves = {s: programs * s / (-(-programs * s // sms) * sms) for s in range(1, most + 1) if programs * s >= sms}
    good = [s for s, eff in waves.items() if eff >= 0.9]
    return min(good) if good else max(waves, key=lambda s: (waves[s], -s))
