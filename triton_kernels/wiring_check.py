"""The serve-time wiring check's per-round update on CUDA (engine/wiring_check.CheckRun.observe; its torch code
is the specification, which the tests hold these kernels to).

The torch code is 32 small kernels a round (bench/bench_wiring_check.py's count_kernels): a gather of the steps
path rows of the verify logits, a softmax over the vocabulary and its max, a bucketize, a norm over the captured
rows, a log, a mean, and a dozen element-wise updates; inside the H200's round graphs their span was 116-141 us
a round (bench/results/wiring_check_d4d8c6d_h200.log), far more than the bytes they read need. Here, two
launches:

- _partials: one launch over two kinds of programs. (r, c) for r = b * D + k (request b, depth k + 1) and
  c a chunk of 4096 scores: over the verify logits row of the accepted path's node k (read through
  accept_nodes, never gathered), the chunk's max m and sum(exp(x - m)) in fp32 (the target's top-1
  probability is exp(max - logsumexp) = 1 / sum(exp(x - max)): an online softmax, no [rows, V] written).
  Then one program per verify row: each aux slot's sum of squares of its H captured features in fp32.
- _update: one program per request: its rows' chunks combined (M = max m_c, S = sum s_c exp(m_c - M),
  confidence 1 / S), the confidence bins, trials and acceptances, the acceptance log LR per delta, the
  features' mean log-RMS against the bands and the feature log LR, all added to the request's row of the
  state in place (fp64, as the torch code accumulates), only where the request is active.

Without a record (nothing to test against) only _update runs, counting accepted drafts and rounds. No host
sync, no allocation but the two fp32 scratch buffers (from the graph pool when captured): capturable.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

_V_BLOCK = 4096


def _p2(n: int) -> int:
    return max(1, triton.next_power_of_2(n))


@triton.jit
def _partials(logits, stride_l, V, accept_nodes, N, D, part_m, part_s, SPLIT, n_row_progs, aux, stride_a, H,
              n_aux, sumsq, BLOCK_V: tl.constexpr, AP: tl.constexpr, BLOCK_H: tl.constexpr):
    # logits [B * N, V] (row stride stride_l, unit column stride); accept_nodes [B, N] int32 contiguous (-1
    # padded); part_m, part_s [B * D, SPLIT] fp32 contiguous; aux [B * N, n_aux * H] (row stride stride_a, unit
    # column stride); sumsq [B * N, n_aux] fp32 contiguous. Programs 0 .. n_row_progs - 1 (= B * D * SPLIT) read
    # the logits, the B * N after them one aux row each (its n_aux slots side by side, AP >= n_aux).
    pid = tl.program_id(0)
    if pid < n_row_progs:
        r, c = pid // SPLIT, pid % SPLIT
        b, k = r // D, r % D
        node = tl.maximum(tl.load(accept_nodes + b * N + k), 0)  # depth k + 1's parent: the path's node k
        cols = c * BLOCK_V + tl.arange(0, BLOCK_V)
        x = tl.load(logits + (b * N + node).to(tl.int64) * stride_l + cols, mask=cols < V,
                    other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        tl.store(part_m + pid, m)
        tl.store(part_s + pid, tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0))
    else:
        row = pid - n_row_progs
        i = tl.arange(0, AP)
        base = aux + row.to(tl.int64) * stride_a + (i * H)[:, None]
        ss = tl.zeros([AP, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            x = tl.load(base + h[None, :], mask=(i < n_aux)[:, None] & (h < H)[None, :], other=0.0).to(tl.float32)
            ss += x * x
        tl.store(sumsq + row * n_aux + i, tl.sum(ss, axis=1), mask=i < n_aux)


@triton.jit
def _update(acc, W, accept_len, live, max_new, part_m, part_s, SPLIT, sumsq, N, D, n_aux, log_sqrt_h, ok_llr,
            no_llr, ND, out_terms, band, edges, NE, COUNT: tl.constexpr, RECORD: tl.constexpr,
            DP: tl.constexpr, SP: tl.constexpr, ZP: tl.constexpr, NP: tl.constexpr, AP: tl.constexpr,
            EP: tl.constexpr):
    # acc [B, W] fp64 contiguous, updated in place; accept_len [B] int32; live [B]: count int64 (COUNT: active
    # while count < max_new) or active uint8; part_m, part_s [B * D, SPLIT] fp32; sumsq [B * N, n_aux] fp32;
    # ok_llr, no_llr [NE + 1, ND] fp64 contiguous; out_terms [2] fp64 (inside, outside); band [2, n_aux] fp32
    # (lo, hi); edges [NE] fp32 ascending.
    b = tl.program_id(0)
    a = tl.load(accept_len + b)
    if COUNT:
        act = tl.load(live + b) < max_new
    else:
        act = tl.load(live + b) != 0
    row = acc + b * W
    tl.store(row, tl.load(row) + a.to(tl.float64), mask=act)
    tl.store(row + 1, tl.load(row + 1) + 1.0, mask=act)
    if RECORD:
        # acceptance: depth k + 1 (k < D) is a trial iff k + 1 <= a + 1, accepted iff k + 1 <= a
        k = tl.arange(0, DP)
        c = tl.arange(0, SP)
        kc = (k < D)[:, None] & (c < SPLIT)[None, :]
        at = (b * D + k)[:, None] * SPLIT + c[None, :]
        m = tl.load(part_m + at, mask=kc, other=float("-inf"))
        s = tl.load(part_s + at, mask=kc, other=0.0)
        M = tl.max(m, axis=1)
        S = tl.sum(s * tl.exp(m - tl.where(M == float("-inf"), 0.0, M)[:, None]), axis=1)
        conf = 1.0 / tl.where(k < D, S, 1.0)  # (padding lanes: no trial)
        e = tl.arange(0, EP)
        edge = tl.load(edges + e, mask=e < NE, other=float("inf"))
        bins = tl.sum((edge[None, :] < conf[:, None]).to(tl.int32), axis=1)  # torch.bucketize (right=False)
        bins = tl.where(conf != conf, NE, bins)  # (a NaN past every edge, as bucketize puts it)
        trial = (k < D) & (k <= a)
        ok = k < a
        d = tl.arange(0, ZP)
        kd = trial[:, None] & (d < ND)[None, :]
        at = bins[:, None] * ND + d[None, :]
        terms = tl.where(ok[:, None], tl.load(ok_llr + at, mask=kd, other=0.0),
                         tl.load(no_llr + at, mask=kd, other=0.0))
        terms = tl.where(kd, terms, 0.0)
        tl.store(row + 3 + d, tl.load(row + 3 + d, mask=d < ND) + tl.sum(terms, axis=0), mask=act & (d < ND))
        # features: each slot's mean log-RMS over the N verify rows, outside its band in any slot
        j = tl.arange(0, NP)
        i = tl.arange(0, AP)
        ji = (j < N)[:, None] & (i < n_aux)[None, :]
        ss = tl.load(sumsq + (b * N + j)[:, None] * n_aux + i[None, :], mask=ji, other=1.0)
        lr = tl.where(ji, tl.log(tl.maximum(tl.sqrt(ss), 1e-30)), 0.0)  # log(norm clamped at 1e-30)
        y = tl.sum(lr, axis=0) / N - log_sqrt_h
        lo = tl.load(band + i, mask=i < n_aux, other=0.0)
        hi = tl.load(band + n_aux + i, mask=i < n_aux, other=0.0)
        out = tl.sum((((y < lo) | (y > hi)) & (i < n_aux)).to(tl.int32), axis=0) > 0
        tl.store(row + 2, tl.load(row + 2) + tl.load(out_terms + out.to(tl.int32)), mask=act)


def observe(acc: Tensor, logits: Optional[Tensor], accept_nodes: Tensor, accept_len: Tensor, aux: Optional[Tensor],
            live: Tensor, max_new: int, D: int, terms: Optional[tuple]) -> None:
    """CheckRun.observe's state update on CUDA (or under TRITON_INTERPRET=1), in place: acc [B, W] fp64;
    logits [B * N, V] and aux [B * N, n_aux * H] (any row stride), accept_nodes [B, N] int32 and accept_len
    [B] int32 contiguous; live: count [B] int64 with max_new (active: count < max_new), or active [B] bool with
    max_new -1; D = min(steps, N - 1); terms: (ok_llr [NB, ND] fp64, no_llr [NB, ND] fp64, out_terms [2] fp64,
    band [2, n_aux] fp32, edges [NB - 1] fp32), or None without a record (then logits and aux are not read).
    One launch without a record, two with one."""
    B, W = acc.shape
    N = accept_nodes.shape[1]
    count = max_new >= 0
    live = live if count else live.view(torch.uint8)
    if terms is None:
        _update[(B,)](acc, W, accept_len, live, max_new, acc, acc, 1, acc, N, D, 1, 0.0, acc, acc, 1, acc, acc,
                      acc, 1, COUNT=count, RECORD=False, DP=1, SP=1, ZP=1, NP=1, AP=1, EP=1, num_warps=1)
        return
    ok_llr, no_llr, out_terms, band, edges = terms
    logits, aux = (t if t.stride(1) == 1 else t.contiguous() for t in (logits, aux))  # (the loop's already are)
    V, n_aux = logits.shape[1], band.shape[1]
    H = aux.shape[1] // n_aux
    split = triton.cdiv(V, _V_BLOCK)
    part = torch.empty(2, B * D, split, dtype=torch.float32, device=acc.device)
    sumsq = torch.empty(B * N, n_aux, dtype=torch.float32, device=acc.device)
    n_row_progs = B * D * split
    ap = _p2(n_aux)
    _partials[(n_row_progs + B * N,)](logits, logits.stride(0), V, accept_nodes, N, D, part[0], part[1], split,
                                      n_row_progs, aux, aux.stride(0), H, n_aux, sumsq, BLOCK_V=_V_BLOCK, AP=ap,
                                      BLOCK_H=min(_V_BLOCK // ap, _p2(H)), num_warps=8)
    nd, ne = ok_llr.shape[1], edges.shape[0]
    _update[(B,)](acc, W, accept_len, live, max_new, part[0], part[1], split, sumsq, N, D, n_aux,
                  0.5 * math.log(H), ok_llr, no_llr, nd, out_terms, band, edges, ne, COUNT=count, RECORD=True,
                  DP=_p2(D), SP=_p2(split), ZP=_p2(nd), NP=_p2(N), AP=ap, EP=_p2(ne), num_warps=1)
