"""eagle3_ops.compat.sglang's functions on CUDA tensors, each one or two Triton launches.

eagle3_ops/compat/sglang.py keeps the tensor-op path (the one CPU tensors take) as the specification; these
kernels compute the same outputs without the 20-40 small launches of that path:

- build: one program per request. The selected candidates, their effective scores (finite for a selected
  candidate whose ancestors are all selected, -inf otherwise), their ranks as torch.ops.eagle3.build_tree
  ranks them (finite ones by candidate index, then the -inf ones by our flat index), each node's parent,
  depth and ancestors, and from those SGLang's lists, positions and mask (any of the three modes).
- greedy walk: one program per request; the request's lists held as register vectors, SGLang's walk over
  retrive_next_token / retrive_next_sibling as a scalar loop.
- sampling: two launches over (request, vocabulary chunk). The first redoes the walk with SGLang's threshold
  rule in every program (the program of chunk 0 writes the outputs and the rejected draft probabilities),
  and sums its chunk of relu(target - draft) at the last accepted node; the second finds the chunk where
  u * total falls and the token inside it (inverse CDF), into predicts.
- segment_packbits: one launch over output bytes, each program's segments found by binary search.
- reconstruct_indices_from_tree_mask: one program per request over its [N, N] mask.

Within a program, values that other lanes must gather go through a small global scratch between two
tl.debug_barrier() calls (block-wide barriers make the program's global writes visible to its own lanes).
No host sync, fixed grids, outputs and scratch the only allocations: capturable in a CUDA graph. Run on CPU
tensors under TRITON_INTERPRET=1 (integer and fp32 data only), where the tests compare them with the
tensor-op path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._errors import arg_id, op_id, report_range

_OP_BUILD_TREE = tl.constexpr(op_id("build_tree"))
_ARG_DRAFT_PARENTS = tl.constexpr(arg_id("draft_parents"))
_NO_INDEX = tl.constexpr(-(1 << 63))
FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2
MAX_SLOTS = 1 << 14  # build: candidate slots one program holds (depth * M); more go the tensor-op way
MAX_NODES = 256      # build / walks / reconstruct: nodes one program holds
_VOCAB_BLOCK = 4096  # sampling: vocabulary chunk per program


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def fits(N: int, slots: int = 0) -> bool:
    """Whether one program per request can hold N nodes (and `slots` build candidates)."""
    return N <= MAX_NODES and slots <= MAX_SLOTS


@triton.jit
def _pick(vec, idx, i):
    """vec[i] as a scalar (idx = the vector's lane numbers); 0 when i is not a lane."""
    return tl.sum(tl.where(idx == i, vec, 0), axis=0)


# ---- build_tree_kernel_efficient -----------------------------------------------------------------------------


@triton.jit(do_not_specialize=["P", "mask_numel"])
def _build_kernel(parent_list, P, selected, seq_lens, mask, mask_numel, positions, r_index, r_next, r_sib, ws, par,
                  err, TOPK: tl.constexpr, DEPTH: tl.constexpr, M: tl.constexpr, N: tl.constexpr,
                  NP: tl.constexpr, CP: tl.constexpr, RT: tl.constexpr, MODE: tl.constexpr, NB: tl.constexpr):
    # parent_list [B, P] int64; selected [B, N - 1] int64; seq_lens [B] int32 | int64; mask: uint8 view of the
    # output mask (mask_numel bytes); positions [B * N], r_index / r_next / r_sib [B, N] int64 (contiguous);
    # ws [B, CP] int32 and par [B, NP] int32 scratch; err [12] int64. Candidate slot c = d * M + m is our
    # [DEPTH, M] layout of SGLang's flat candidate f (f < TOPK: row 0; then TOPK * TOPK per depth).
    b = tl.program_id(0).to(tl.int64)
    C: tl.constexpr = TOPK + (DEPTH - 1) * TOPK * TOPK
    c = tl.arange(0, CP)
    d = c // M
    m = c % M
    inside = c < DEPTH * M
    f = tl.where(d == 0, tl.where(m < TOPK, m, -1), TOPK + (d - 1) * M + m).to(tl.int64)
    f = tl.where(inside, f, -1)
    deep = inside & (d >= 1)
    g = tl.load(parent_list + b * P + 1 + (d - 1) * TOPK + m // TOPK, mask=deep, other=0)  # issued first
    # selected slots (a selected candidate outside [0, C) is skipped, as the tensor path's scatter does)
    tl.store(ws + b * CP + c, tl.zeros([CP], tl.int32))
    tl.debug_barrier()
    j = tl.arange(0, NP)
    sel = tl.load(selected + b * (N - 1) + j, mask=j < N - 1, other=-1)
    sel_ok = (sel >= 0) & (sel < C)
    tl.store(ws + b * CP + tl.where(sel < TOPK, sel, sel + (M - TOPK)), tl.full([NP], 1, tl.int32), mask=sel_ok)
    tl.debug_barrier()
    chosen = inside & (f >= 0) & (tl.load(ws + b * CP + c) != 0)
    tl.debug_barrier()
    # parent slot: SGLang's parent_list entry -> its slot in depth d - 1 (slot 0 there when not selected)
    local = tl.where(g < TOPK, g, g + (M - TOPK)) - (d - 1) * M
    bad = deep & chosen & ((local < 0) | (local >= M))
    first_bad = tl.min(tl.where(bad, c, CP), axis=0)
    if first_bad < CP:  # build_tree's check: recorded as its draft_parents, the candidate read as the root's
        fb = first_bad.to(tl.int64)
        report_range(err, _OP_BUILD_TREE, _ARG_DRAFT_PARENTS, _pick(local, c, first_bad), 0, M - 1, b, fb // M,
                     fb % M)
    from_root = (d == 0) | bad
    ps = tl.where(from_root, 0, (d - 1) * M + tl.where(chosen, local, 0))
    # finite effective score: selected, and so is every ancestor (one depth per round)
    fin = chosen
    for _ in range(DEPTH - 1):
        tl.store(ws + b * CP + c, fin.to(tl.int32))
        tl.debug_barrier()
        up = tl.load(ws + b * CP + ps, mask=inside & ~from_root, other=0)
        tl.debug_barrier()
        fin = chosen & (from_root | (up != 0))
    # build_tree's ranks: finite ones by candidate index (their score order), then the -inf ones by slot
    fi = fin.to(tl.int32)
    rest = (inside & ~fin).to(tl.int32)
    rank = tl.where(fin, tl.cumsum(fi, axis=0) - fi, tl.sum(fi, axis=0) + tl.cumsum(rest, axis=0) - rest)
    node = tl.where(inside & (rank < N - 1), rank + 1, -1)
    tl.store(ws + b * CP + c, node)
    tl.debug_barrier()
    pnode = tl.where(from_root, 0, tl.load(ws + b * CP + ps, mask=inside & ~from_root, other=0))
    tl.store(par + b * NP + node, pnode, mask=node >= 1)
    tl.store(par + b * NP, -1)
    tl.debug_barrier()

    pk = tl.load(par + b * NP + j, mask=j < N, other=-2)  # the parent of every node, as columns
    seq = tl.load(seq_lens + b).to(tl.int64)
    if MODE == 0:  # FULL_MASK: request b's block starts after the earlier requests' N * (seq + N) entries
        before = tl.zeros([1024], tl.int64)
        for k0 in range(0, b, 1024):
            k = k0 + tl.arange(0, 1024)
            before += tl.load(seq_lens + k, mask=k < b, other=0).to(tl.int64)
        start = N * N * b + N * tl.sum(before, axis=0) + seq
    for r0 in range(0, N, RT):
        i = r0 + tl.arange(0, RT)
        row_ok = i < N
        cur = tl.where(row_ok, i, -1)
        anc = (i[:, None] < 0) & (j[None, :] < 0)
        hops = tl.zeros([RT], tl.int32)
        for _ in range(DEPTH + 1):  # the root is at most DEPTH parents up
            on = cur >= 0
            anc = anc | (j[None, :] == cur[:, None])
            hops += on.to(tl.int32)
            cur = tl.load(par + b * NP + cur, mask=on, other=-1)
        tl.store(positions + b * N + i, seq + hops - 1, mask=row_ok)
        tl.store(r_index + b * N + i, b * N + i.to(tl.int64), mask=row_ok)
        first = tl.min(tl.where(pk[None, :] == i[:, None], j[None, :], NP), axis=1)
        tl.store(r_next + b * N + i, first.to(tl.int64), mask=row_ok & (first < NP))
        pi = tl.load(par + b * NP + i, mask=row_ok, other=-1)
        sib = tl.min(tl.where((pk[None, :] == pi[:, None]) & (j[None, :] > i[:, None]), j[None, :], NP), axis=1)
        tl.store(r_sib + b * N + i, sib.to(tl.int64), mask=row_ok & (pi >= 0) & (sib < NP))
        if MODE == 2:  # QLEN_ONLY_BITPACKING: NB little-endian bytes per row; byte 0 set, the others OR-ed into
            bits = tl.sum(tl.where(anc, tl.full([1, NP], 1, tl.int64) << j[None, :].to(tl.int64), 0), axis=1)
            row = (b * N + i) * NB
            tl.store(mask + row, (bits & 255).to(tl.uint8), mask=row_ok)
            for k in range(1, NB):
                old = tl.load(mask + row + k, mask=row_ok, other=0)
                tl.store(mask + row + k, old | ((bits >> (8 * k)) & 255).to(tl.uint8), mask=row_ok)
        else:
            if MODE == 0:
                at = start + (seq + N) * i[:, None] + j[None, :]
            else:
                at = N * N * b + N * i[:, None] + j[None, :]
            ok = row_ok[:, None] & (j[None, :] < N) & (at < mask_numel)
            tl.store(mask + at, anc.to(tl.uint8), mask=ok)


def build(parent_list: Tensor, selected_index: Tensor, verified_seq_len: Tensor, tree_mask: Tensor,
          positions: Tensor, retrive_index: Tensor, retrive_next_token: Tensor, retrive_next_sibling: Tensor,
          topk: int, depth: int, N: int, mode: int, err: Tensor) -> None:
    """build_tree_kernel_efficient's outputs in one launch (arguments checked by the caller; B >= 1)."""
    B = parent_list.shape[0]
    M = topk * topk if depth > 1 else topk
    NP, CP = _pow2(N), _pow2(depth * M)
    nb = 1 if N <= 8 else (2 if N <= 16 else 4)
    ws = torch.empty(B, CP, dtype=torch.int32, device=parent_list.device)
    par = torch.empty(B, NP, dtype=torch.int32, device=parent_list.device)
    mask = tree_mask.view(-1).view(torch.uint8)
    P = parent_list.shape[1]
    _build_kernel[(B,)](parent_list if P else selected_index, P, selected_index, verified_seq_len, mask, mask.numel(),
                        positions, retrive_index, retrive_next_token, retrive_next_sibling, ws, par, err, TOPK=topk,
                        DEPTH=depth, M=M, N=N, NP=NP, CP=CP, RT=max(1, min(NP, 4096 // NP)), MODE=mode, NB=nb,
                        num_warps=8 if NP * NP >= 4096 or CP >= 512 else 4)


# ---- the walks ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["S", "RMAX"])
def _greedy_kernel(predicts, accept_index, accept_token_num, candidates, r_index, r_next, r_sib, target, S, RMAX,
                   N: tl.constexpr, NP: tl.constexpr):
    # predicts [>= B * N] int32; accept_index [B, S], accept_token_num [B] int32; candidates, r_index, r_next,
    # r_sib, target [B, N] int64 (contiguous); target is read at flat rows r_index (clamped to [0, RMAX]).
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    on = i < N
    nxt = tl.load(r_next + b * N + i, mask=on, other=-1)
    sib = tl.load(r_sib + b * N + i, mask=on, other=-1)
    tok = tl.load(candidates + b * N + i, mask=on, other=0)
    rows = tl.minimum(tl.maximum(tl.load(r_index + b * N + i, mask=on, other=0), 0), RMAX)
    tgt = tl.load(target + rows, mask=on, other=0)
    last = tl.zeros([], tl.int64)
    row = _pick(rows, i, last)
    tl.store(accept_index + b * S, row.to(tl.int32))
    L = tl.zeros([], tl.int32)
    go = S > 1
    while go:
        want = _pick(tgt, i, last)
        cur = _pick(nxt, i, last)
        found = cur < -1  # False
        steps = tl.zeros([], tl.int32)
        while (cur >= 0) & (cur < N) & ~found & (steps < N):  # the children in list order
            found = (cur > last) & (_pick(tok, i, cur) == want)
            cur = tl.where(found, cur, _pick(sib, i, cur))
            steps += 1
        if found:
            tl.store(predicts + row, want.to(tl.int32))
            last = cur
            row = _pick(rows, i, last)
            L += 1
            tl.store(accept_index + b * S + L, row.to(tl.int32))
        go = found & (L < S - 1)
    tl.store(accept_token_num + b, L)
    tl.store(predicts + row, _pick(tgt, i, last).to(tl.int32))


def verify_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                  retrive_next_sibling, target_predict) -> None:
    """verify_tree_greedy in one launch (arguments checked by the caller; B >= 1, N <= MAX_NODES)."""
    B, N = candidates.shape
    _greedy_kernel[(B,)](predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                         retrive_next_sibling, target_predict, accept_index.shape[1], B * N - 1, N=N, NP=_pow2(N),
                         num_warps=1)


@triton.jit
def _sample_walk(predicts, accept_index, accept_token_num, candidates, r_index, r_next, r_sib, uniform, probs,
                 draft, b, S, V, RMAX, thr_single, thr_acc, WRITE, HAS_DRAFT: tl.constexpr,
                 N: tl.constexpr, NP: tl.constexpr):
    """SGLang's sampling walk for request b; with WRITE the outputs (all but the bonus) and the rejected draft
    probabilities are stored. Returns (last node, its flat row, whether the walk stopped at S - 1 drafts)."""
    i = tl.arange(0, NP)
    on = i < N
    nxt = tl.load(r_next + b * N + i, mask=on, other=-1)
    sib = tl.load(r_sib + b * N + i, mask=on, other=-1)
    tok = tl.load(candidates + b * N + i, mask=on, other=0)
    tok_ok = on & (tok >= 0) & (tok < V)
    rows = tl.minimum(tl.maximum(tl.load(r_index + b * N + i, mask=on, other=0), 0), RMAX)
    coins = tl.load(uniform + b * N + i, mask=on, other=0.0)
    last = tl.zeros([], tl.int64)
    row = _pick(rows, i, last)
    tl.store(accept_index + b * S, row.to(tl.int32), mask=WRITE)
    L = tl.zeros([], tl.int32)
    go = S > 1
    while go:
        prow = (b * N + last) * V
        p_all = tl.load(probs + prow + tok, mask=tok_ok, other=0.0)  # every node's token at this row
        coin = _pick(coins, i, last)
        cur = _pick(nxt, i, last)
        found = cur < -1  # False
        acc = tl.zeros([], tl.float64)
        steps = tl.zeros([], tl.int32)
        while (cur >= 0) & (cur < N) & ~found & (steps < N):
            p = _pick(p_all, i, cur)
            acc += p.to(tl.float64)  # summed in fp64 and rounded to fp32, as the tensor path's scan
            ok = cur > last
            found = ok & ((coin <= acc.to(tl.float32) / thr_acc) | (p >= thr_single))
            if HAS_DRAFT:  # tried and rejected: SGLang's draft_probs[row, x] = target_probs[row, x]
                x = _pick(tok, i, cur)
                tl.store(draft + prow + x, p, mask=WRITE & ok & ~found & (x >= 0) & (x < V))
            cur = tl.where(found, cur, _pick(sib, i, cur))
            steps += 1
        if found:
            tl.store(predicts + row, _pick(tok, i, cur).to(tl.int32), mask=WRITE)
            last = cur
            row = _pick(rows, i, last)
            L += 1
            tl.store(accept_index + b * S + L, row.to(tl.int32), mask=WRITE)
        go = found & (L < S - 1)
    tl.store(accept_token_num + b, L, mask=WRITE)
    return last, row, L == S - 1


@triton.jit
def _residual(probs, draft, candidates, r_next, r_sib, b, last, capped, s, V, HAS_DRAFT: tl.constexpr,
              N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Chunk s of relu(target - draft) at the last node (the target alone when capped); the tokens of its
    children, all tried and rejected when not capped, are 0 (SGLang wrote draft = target there)."""
    cols = s * BLOCK + tl.arange(0, BLOCK)
    row = (b * N + last) * V
    w = tl.load(probs + row + cols, mask=cols < V, other=0.0)
    if capped:
        w = tl.maximum(w, 0.0)
    else:
        if HAS_DRAFT:
            w = tl.maximum(w - tl.load(draft + row + cols, mask=cols < V, other=0.0), 0.0)
        i = tl.arange(0, NP)
        on = i < N
        nxt = tl.load(r_next + b * N + i, mask=on, other=-1)
        sib = tl.load(r_sib + b * N + i, mask=on, other=-1)
        tok = tl.load(candidates + b * N + i, mask=on, other=-1)
        cur = _pick(nxt, i, last)
        steps = tl.zeros([], tl.int32)
        while (cur >= 0) & (cur < N) & (steps < N):
            x = _pick(tok, i, cur)
            w = tl.where((cols == x) & (cur > last), 0.0, w)
            cur = _pick(sib, i, cur)
            steps += 1
    return cols, w


@triton.jit(do_not_specialize=["S", "V", "RMAX", "SPLIT", "thr_single", "thr_acc"])
def _sample_sum_kernel(predicts, accept_index, accept_token_num, candidates, r_index, r_next, r_sib, uniform,
                       probs, draft, part, S, V, RMAX, SPLIT, thr_single, thr_acc, HAS_DRAFT: tl.constexpr,
                       N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    # probs / draft [B * N, V] fp32 (row b * N + node); uniform [B, N] fp32; part [B, SPLIT] fp64; the rest as
    # _greedy_kernel's. Program (b, s): the walk (written by s == 0), then chunk s's residual mass.
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    last, row, capped = _sample_walk(predicts, accept_index, accept_token_num, candidates, r_index, r_next, r_sib,
                                     uniform, probs, draft, b, S, V, RMAX, thr_single, thr_acc, s == 0, HAS_DRAFT,
                                     N, NP)
    cols, w = _residual(probs, draft, candidates, r_next, r_sib, b, last, capped, s, V, HAS_DRAFT, N, NP, BLOCK)
    tl.store(part + b * SPLIT + s, tl.sum(w.to(tl.float64), axis=0))


@triton.jit(do_not_specialize=["S", "V", "RMAX", "SPLIT", "thr_single", "thr_acc"])
def _sample_pick_kernel(predicts, candidates, r_index, r_next, r_sib, uniform, probs, draft, part, final, S, V,
                        RMAX, SPLIT, thr_single, thr_acc, HAS_DRAFT: tl.constexpr, N: tl.constexpr,
                        NP: tl.constexpr, BLOCK: tl.constexpr, SP: tl.constexpr):
    # final [B] fp32; the rest as _sample_sum_kernel's. Program (b, s): if u = final * total falls in chunk s,
    # the first token of the chunk whose running mass exceeds u; the last program writes V - 1 when none does.
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    # the running mass in fp64, each prefix rounded to fp32: the tensor path's cumsum (CPU: a double
    # accumulator) and its u = coin * cdf[-1] in fp32, compared as fp32
    k = tl.arange(0, SP)
    mass = tl.load(part + b * SPLIT + k, mask=k < SPLIT, other=0.0)
    upto = tl.cumsum(mass, axis=0)
    u = tl.load(final + b) * tl.sum(mass, axis=0).to(tl.float32)
    hit = tl.min(tl.where((upto.to(tl.float32) > u) & (k < SPLIT), k, SPLIT), axis=0)
    if (hit == s) | ((hit == SPLIT) & (s == SPLIT - 1)):
        last, row, capped = _sample_walk(predicts, predicts, predicts, candidates, r_index, r_next, r_sib, uniform,
                                         probs, draft, b, S, V, RMAX, thr_single, thr_acc, s < 0, HAS_DRAFT, N, NP)
        token = tl.zeros([], tl.int64) + V - 1
        if hit == s:
            cols, w = _residual(probs, draft, candidates, r_next, r_sib, b, last, capped, s, V, HAS_DRAFT, N, NP,
                                BLOCK)
            before = _pick(upto - mass, k, s)
            cdf = (before + tl.cumsum(w.to(tl.float64), axis=0)).to(tl.float32)
            first = tl.min(tl.where((cdf > u) & (cols < V), cols, V), axis=0)
            # a draw that the chunk's own running sum does not reach (rounding): its last token with mass
            token = tl.where(first < V, first, tl.max(tl.where(w > 0, cols, 0), axis=0)).to(tl.int64)
        tl.store(predicts + row, token.to(tl.int32))


def verify_sampling(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                    retrive_next_sibling, uniform_samples, uniform_final, target_probs, draft_probs,
                    threshold_single: float, threshold_acc: float) -> None:
    """tree_speculative_sampling_target_only in two launches (arguments checked by the caller; B >= 1)."""
    B, N = candidates.shape
    V = target_probs.shape[-1]
    block = min(_VOCAB_BLOCK, _pow2(V))
    split = triton.cdiv(V, block)
    part = torch.empty(B, split, dtype=torch.float64, device=candidates.device)
    has_draft = draft_probs is not None
    draft = draft_probs if has_draft else target_probs
    common = dict(HAS_DRAFT=has_draft, N=N, NP=_pow2(N), BLOCK=block, num_warps=8)
    S, rmax = accept_index.shape[1], B * N - 1
    _sample_sum_kernel[(B, split)](predicts, accept_index, accept_token_num, candidates, retrive_index,
                                   retrive_next_token, retrive_next_sibling, uniform_samples, target_probs, draft,
                                   part, S, V, rmax, split, threshold_single, threshold_acc, **common)
    _sample_pick_kernel[(B, split)](predicts, candidates, retrive_index, retrive_next_token, retrive_next_sibling,
                                    uniform_samples, target_probs, draft, part, uniform_final, S, V, rmax, split,
                                    threshold_single, threshold_acc, SP=_pow2(split), **common)


# ---- layout conversions ------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["x_numel", "y_numel", "n", "steps"])
def _packbits_kernel(x, x_numel, in_ptr, out_ptr, y, y_numel, n, steps, BLOCK: tl.constexpr):
    # x: uint8 view of the bool input [x_numel]; in_ptr / out_ptr [n + 1] int32; y [y_numel] uint8.
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], tl.int64)
    hi = tl.zeros([BLOCK], tl.int64) + n
    for _ in range(steps):  # the largest s with out_ptr[s] <= t
        mid = (lo + hi + 1) // 2
        le = tl.load(out_ptr + mid).to(tl.int64) <= t
        lo = tl.where(le, mid, lo)
        hi = tl.where(le, hi, mid - 1)
    s = tl.minimum(lo, n - 1)
    o0 = tl.load(out_ptr + s).to(tl.int64)
    inside = (t >= o0) & (t < tl.load(out_ptr + s + 1).to(tl.int64)) & (t < y_numel)
    i0 = tl.load(in_ptr + s).to(tl.int64)
    i1 = tl.load(in_ptr + s + 1).to(tl.int64)
    k = tl.arange(0, 8)
    bit = i0[:, None] + 8 * (t - o0)[:, None] + k[None, :]
    ok = inside[:, None] & (bit < i1[:, None]) & (bit < x_numel)
    v = tl.load(x + bit, mask=ok, other=0).to(tl.int32)
    byte = tl.sum((v != 0).to(tl.int32) << k[None, :], axis=1)
    tl.store(y + t, byte.to(tl.uint8), mask=inside)


def segment_packbits(x: Tensor, input_indptr: Tensor, output_indptr: Tensor, y: Tensor, batch_size: int) -> None:
    """segment_packbits in one launch (arguments checked by the caller; batch_size >= 1, y non-empty)."""
    block = 256
    _packbits_kernel[(triton.cdiv(y.numel(), block),)](x.view(torch.uint8), x.numel(), input_indptr, output_indptr,
                                                       y, y.numel(), batch_size, int(batch_size).bit_length(),
                                                       BLOCK=block, num_warps=4)


@triton.jit
def _reconstruct_kernel(mask, seq_lens, positions, r_index, r_next, r_sib, N: tl.constexpr, NP: tl.constexpr):
    # mask: uint8 view [B * N * N]; seq_lens [B]; positions [B * N], r_* [B, N] (int32 | int64, contiguous).
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    ok = (i[:, None] < N) & (i[None, :] < N)
    m = tl.load(mask + b * N * N + i[:, None] * N + i[None, :], mask=ok, other=0) != 0     # [i, j] = row i, bit j
    mt = tl.load(mask + b * N * N + i[None, :] * N + i[:, None], mask=ok, other=0) != 0    # [i, k] = row k, bit i
    below = m & (i[None, :] < i[:, None])
    depth = tl.sum(below.to(tl.int64), axis=1)
    parent = tl.max(tl.where(below, i[None, :], -1), axis=1)                               # per row i
    parent_k = tl.max(tl.where(mt & (i[:, None] < i[None, :]), i[:, None], -1), axis=0)    # per column k
    first = tl.min(tl.where(mt & (i[None, :] > i[:, None]), i[None, :], N), axis=1)
    same = (parent_k[None, :] == parent[:, None]) & (parent[:, None] >= 0) & (i[None, :] > i[:, None])
    sib = tl.min(tl.where(same, i[None, :], N), axis=1)
    on = i < N
    tl.store(positions + b * N + i, tl.load(seq_lens + b).to(tl.int64) + depth, mask=on)
    tl.store(r_index + b * N + i, b * N + i, mask=on)
    tl.store(r_next + b * N + i, tl.where(first < N, first, -1), mask=on)
    tl.store(r_sib + b * N + i, tl.where(sib < N, sib, -1), mask=on)


def reconstruct(tree_mask: Tensor, verified_seq_len: Tensor, positions: Tensor, retrive_index: Tensor,
                retrive_next_token: Tensor, retrive_next_sibling: Tensor, B: int, N: int) -> None:
    """reconstruct_indices_from_tree_mask in one launch (arguments checked by the caller; B, N >= 1)."""
    NP = _pow2(N)
    _reconstruct_kernel[(B,)](tree_mask.view(-1).view(torch.uint8), verified_seq_len, positions, retrive_index,
                              retrive_next_token, retrive_next_sibling, N=N, NP=NP, num_warps=4 if NP <= 64 else 8)
