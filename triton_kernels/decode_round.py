"""The decode loop's own small steps on CUDA, fused (eagle3_ops.engine.fused has their PyTorch references).

A speculative round at batch 1 is a few large forwards and ~80 tiny kernels between them; inside a CUDA graph
each tiny kernel still costs ~3 us of the device's time, so at Kimi width they were 4% of the step. These
kernels replace the biggest groups:

- topk_lse: the top-k log-probabilities of a score row and their ids (and the row's logsumexp) in one pass
  over the row, split across programs (a 163840-wide row is 40 programs, then a one-program combine), where
  torch runs topk (or max), then logsumexp as amax / sub / exp / sum / log / add, then a subtraction.
- accept_update: after verify and kv_accept, one program per request: the emitted tokens into `out`, the
  acceptance histogram, the count, the next root, a finished request's target prefix undone, and the
  catch-up's inputs (fc rows, tokens, positions); ~25 kernels in torch.
- accept_finish: after the catch-up forward: the accepted row's scores and hidden state kept for the next
  round, and the drafter's prefix advanced; ~8 kernels in torch.

No host sync; the only allocations are outputs and topk_lse's small scratch (from the graph pool when captured):
capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_LSE_BLOCK = 4096
_NO_ID: tl.constexpr = tl.constexpr(2**62)  # a candidate slot with no score left in its chunk


@triton.jit
def _topk_lse_partial(x, stride_g, stride_x, RG, V, part_v, part_i, part_m, part_s, SPLIT, K: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Program (r, c): over row r's scores c*BLOCK : (c+1)*BLOCK in fp32 (row r at x + (r // RG) * stride_g +
    (r % RG) * stride_x), its K largest values and their ids (the lower id first on ties), and its max m with
    sum(exp(x - m)) -> part_*[r, c]."""
    r, c = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, BLOCK)
    cols = c * BLOCK + j
    row = (r // RG).to(tl.int64) * stride_g + (r % RG).to(tl.int64) * stride_x
    v = tl.load(x + row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(v, axis=0)
    tl.store(part_m + r * SPLIT + c, m)
    tl.store(part_s + r * SPLIT + c, tl.sum(tl.exp(v - tl.where(m == float("-inf"), 0.0, m)), axis=0))
    o = (r * SPLIT + c) * K
    taken = j < 0
    for k in tl.static_range(K):  # K rounds of extract-the-max, in registers
        w = tl.where(taken, float("-inf"), v)
        top = tl.max(w, axis=0)
        i = tl.min(tl.where((w == top) & ~taken & (cols < V), j, BLOCK), axis=0)  # BLOCK: none left
        tl.store(part_v + o + k, top)
        tl.store(part_i + o + k, tl.where(i == BLOCK, _NO_ID, (c * BLOCK + i).to(tl.int64)))
        taken = taken | (j == i)


@triton.jit
def _topk_lse_combine(part_v, part_i, part_m, part_s, SPLIT, lp, ids, lse, K: tl.constexpr, SP: tl.constexpr,
                      SPK: tl.constexpr):
    """Program r: the row's K largest of its chunks' candidates (the lower id first on ties), lse = M +
    log(sum_c s_c exp(m_c - M)), and the K log-probabilities value - lse."""
    r = tl.program_id(0)
    c = tl.arange(0, SP)
    m = tl.load(part_m + r * SPLIT + c, mask=c < SPLIT, other=float("-inf"))
    s = tl.load(part_s + r * SPLIT + c, mask=c < SPLIT, other=0.0)
    M = tl.max(m, axis=0)
    L = M + tl.log(tl.sum(s * tl.exp(m - tl.where(M == float("-inf"), 0.0, M)), axis=0))
    tl.store(lse + r, L)
    q = tl.arange(0, SPK)
    ok = q < SPLIT * K
    v = tl.load(part_v + r * SPLIT * K + q, mask=ok, other=float("-inf"))
    i = tl.load(part_i + r * SPLIT * K + q, mask=ok, other=_NO_ID)
    taken = q < 0
    for k in tl.static_range(K):
        w = tl.where(taken, float("-inf"), v)
        top = tl.max(w, axis=0)
        at = (w == top) & ~taken
        first = tl.min(tl.where(at, i, _NO_ID), axis=0)
        tl.store(lp + r * K + k, top - L)
        tl.store(ids + r * K + k, first)
        taken = taken | (at & (i == first))


def topk_lse(x: Tensor, K: int) -> tuple[Tensor, Tensor, Tensor]:
    """x [R, V] or [G, RG, V] (float; any row strides: a [G, RG, V] slice of a larger block of rows is read in
    place, as the tree's drafting passes its beams' rows), 1 <= K <= min(V, 16) -> (the K largest
    log-probabilities [R, K] fp32 in descending order (the lower id first on ties), their ids [R, K] int64,
    logsumexp [R] fp32; R = G * RG), all in fp32 from x's values. Two launches: chunks of 4096 scores, then one
    program a row."""
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [R, V] or [G, RG, V], got shape {list(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        G, RG, V = x.shape
        stride_g, stride_x = x.stride(0), x.stride(1)
    else:
        (RG, V), G = x.shape, 1
        stride_g, stride_x = 0, x.stride(0)
    R = G * RG
    split = triton.cdiv(V, _LSE_BLOCK)
    dev = x.device
    part_v = torch.empty(R, split, K, dtype=torch.float32, device=dev)
    part_i = torch.empty(R, split, K, dtype=torch.int64, device=dev)
    part_ms = torch.empty(2, R, split, dtype=torch.float32, device=dev)
    lp = torch.empty(R, K, dtype=torch.float32, device=dev)
    ids = torch.empty(R, K, dtype=torch.int64, device=dev)
    lse = torch.empty(R, dtype=torch.float32, device=dev)
    if R == 0:
        return lp, ids, lse
    _topk_lse_partial[(R, split)](x, stride_g, stride_x, max(RG, 1), V, part_v, part_i, part_ms[0], part_ms[1],
                                  split, K=K, BLOCK=_LSE_BLOCK, num_warps=8)
    _topk_lse_combine[(R,)](part_v, part_i, part_ms[0], part_ms[1], split, lp, ids, lse, K=K,
                            SP=triton.next_power_of_2(split), SPK=triton.next_power_of_2(split * K), num_warps=1)
    return lp, ids, lse


@triton.jit
def _accept_update_kernel(accept_nodes, accept_len, emitted, count, out, L, hist, root, tkv_prefix, dkv_prefix,
                          rows, tokens, positions, step, max_new, N, NP: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, NP)
    jm = j < N
    al = tl.load(accept_len + b).to(tl.int64)
    c = tl.load(count + b)
    active = c < max_new
    em = tl.load(emitted + b * N + j, mask=jm, other=0)
    nodes = tl.load(accept_nodes + b * N + j, mask=jm, other=0).to(tl.int64)
    # the accepted tokens at out[b, count ..]; a finished request writes nothing and stays as it was
    tl.store(out + b * L + tl.minimum(c + j, L - 1), em, mask=jm & (j <= al) & active)
    n = tl.where(active, al + 1, 0)
    tl.atomic_add(hist + al + 1, 1, mask=active)
    tl.store(count + b, c + n)
    r_old = tl.load(root + b)
    tl.store(root + b, tl.where(active, tl.sum(tl.where(j == al, em, 0), axis=0), r_old))
    p = tl.load(tkv_prefix + b)
    tl.store(tkv_prefix + b, tl.where(active, p, p - (al + 1).to(tl.int32)))  # kv_accept's advance undone
    # the catch-up's inputs: the accepted rows of the verify's aux, their tokens, their drafter positions
    tl.store(rows + b * N + j, b * N + tl.maximum(nodes, 0), mask=jm)
    tl.store(tokens + b * N + j, tl.maximum(em, 0), mask=jm)
    tl.store(positions + b * N + j, tl.load(dkv_prefix + b).to(tl.int64) + j, mask=jm)
    tl.store(step + b, n.to(tl.int32))


def accept_update(accept_nodes: Tensor, accept_len: Tensor, emitted: Tensor, count: Tensor, out: Tensor,
                  hist: Tensor, root: Tensor, tkv_prefix: Tensor, dkv_prefix: Tensor, max_new: int,
                  rows: Tensor, tokens: Tensor, positions: Tensor, step: Tensor) -> None:
    """engine.fused.accept_update on CUDA (its docstring says what each argument is)."""
    B, N = emitted.shape
    _accept_update_kernel[(B,)](accept_nodes, accept_len, emitted, count, out, out.shape[1], hist, root,
                                tkv_prefix, dkv_prefix, rows, tokens, positions, step, max_new, N,
                                NP=triton.next_power_of_2(N), num_warps=1)


@triton.jit
def _accept_finish_kernel(logits, stride_l, V, hidden, stride_h, H, last_logits, stride_ll, g, stride_g, step,
                          dkv_prefix, N, n_v, BLOCK: tl.constexpr):
    b, c = tl.program_id(0), tl.program_id(1)
    n = tl.load(step + b)
    row = (b * N + tl.maximum(n - 1, 0)).to(tl.int64)  # the last accepted token's row (n - 1 = accept_len)
    if c < n_v:
        cols = c * BLOCK + tl.arange(0, BLOCK)
        m = (cols < V) & (n > 0)
        tl.store(last_logits + b * stride_ll + cols, tl.load(logits + row * stride_l + cols, mask=m), mask=m)
    else:
        cols = (c - n_v) * BLOCK + tl.arange(0, BLOCK)
        m = (cols < H) & (n > 0)
        tl.store(g + b * stride_g + cols, tl.load(hidden + row * stride_h + cols, mask=m), mask=m)
    if c == 0:
        tl.store(dkv_prefix + b, tl.load(dkv_prefix + b) + n)


def accept_finish(logits: Tensor, hidden: Tensor, last_logits: Tensor, g: Tensor, step: Tensor,
                  dkv_prefix: Tensor) -> None:
    """engine.fused.accept_finish on CUDA."""
    B, N = step.shape[0], logits.shape[0] // step.shape[0]
    V, H = logits.shape[1], hidden.shape[1]
    block = 2048
    n_v, n_h = triton.cdiv(V, block), triton.cdiv(H, block)
    _accept_finish_kernel[(B, n_v + n_h)](logits, logits.stride(0), V, hidden, hidden.stride(0), H, last_logits,
                                          last_logits.stride(0), g, g.stride(0), step, dkv_prefix, N, n_v,
                                          BLOCK=block, num_warps=4)
