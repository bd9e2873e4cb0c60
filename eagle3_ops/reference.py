"""The specification: one pure-PyTorch reference per torch.ops.eagle3 op.

Each function has exactly its op's schema signature (same names, same order) and is registered as the
op's CPU implementation. Written for clarity, never for speed. Floating-point math runs in float32, or
in float64 when the inputs are float64 (tests call the references on upcast inputs to get the float64
truth a kernel is compared with). Mutating ops compute everything and check every index first, then
write: a failed call leaves the caller's tensors as they were.

On CUDA, where a data-dependent error cannot be raised without a host sync, the kernels never read or
write out of bounds, document what they do instead (each op's docstring says) and record the first
violation in the device error word (eagle3_ops/errors.py). The references, which may look at values,
raise eagle3_ops.Eagle3InputError at the call, with the message the device word decodes to.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from . import _philox, _validate, tree
from .errors import Eagle3InputError, check_float, check_range, input_error


def _acc(*ts: Optional[Tensor]) -> torch.dtype:
    """Accumulation dtype: float64 if any input is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


# ---- capture ----------------------------------------------------------------------------------------


def capture_aux(hidden: Tensor, residual: Optional[Tensor], aux: Tensor, slot: int, rows: Optional[Tensor]) -> None:
    """Capture the residual stream into the drafter's aux buffer: aux[r, slot*H:(slot+1)*H] = (hidden + residual)[rows[r]].

    Parameters
    ----------
    hidden : Tensor [T, H] bf16 | fp16 | fp32 | fp64
        Sublayer output (or the full residual stream when residual is None).
    residual : Tensor [T, H] same dtype, optional
        Residual stream before the add; the sum is rounded once to the dtype, as `hidden + residual`.
    aux : Tensor [R, n_aux * H] same dtype, mutated
        Preallocated capture buffer; may be a strided view (last dim contiguous). Only column block
        `slot` is written.
    slot : int
        Which of the n_aux column blocks, 0 <= slot < n_aux.
    rows : Tensor [R] int32 | int64, optional
        Source row of each aux row (e.g. the last token of each request in prefill); None means R = T
        and row r <- r. An index outside [0, T) raises Eagle3InputError here, e.g. `capture_aux:
        rows[3] = 5000000 is out of range (valid: 0..12)`, and writes nothing. On CUDA (no host sync to
        raise) that aux row's slot block is filled with NaN, nothing is read for it, the other rows and
        the other column blocks are as usual, and the device error word records the index:
        eagle3_ops.check_errors() (or strict mode, at the call) raises the same message.
    """

    s = _validate.capture_aux(hidden, residual, aux, slot, rows)
    H = s["H"]
    src = hidden if residual is None else hidden + residual
    if rows is not None:
        check_range(rows, 0, s["T"] - 1, "capture_aux", "rows")
        src = src[rows.long()]
    aux[:, slot * H:(slot + 1) * H] = src


def add_rmsnorm_capture(x: Tensor, residual: Tensor, weight: Tensor, eps: float, aux: Optional[Tensor], slot: int,
                        rows: Optional[Tensor]) -> None:
    """Fused residual add + RMSNorm that also captures the new residual: the target's capture point.

    `residual += x` (rounded once to residual's dtype), then
    `x = residual * rsqrt(mean(residual**2) + eps) * weight` (fp32 math on the rounded residual,
    rounded once to x's dtype), and when aux is given `aux[r, slot*H:(slot+1)*H] = residual[rows[r]]`.
    At the input norm of layer k + 1 the new residual is the output of layer k: aux id k (wiring.py).

    Parameters
    ----------
    x : Tensor [T, H] bf16 | fp16 | fp32 | fp64, mutated
        Sublayer output in, normed hidden out.
    residual : Tensor [T, H] x's dtype, or fp32 beside bf16/fp16 x, mutated
        Residual stream in, residual stream plus x out.
    weight : Tensor [H]
        RMSNorm weight.
    eps : float
        RMSNorm epsilon (1e-6 for Kimi-K2, 1e-5 for K2.5).
    aux : Tensor [R, n_aux * H] residual's dtype, optional, mutated
        Capture buffer as in capture_aux; None skips the capture (a plain fused add + RMSNorm).
    slot : int
        Column block of aux to write, 0 <= slot < n_aux (ignored without aux).
    rows : Tensor [R] int32 | int64, optional
        Residual rows to capture; None means all T. An index outside [0, T) raises Eagle3InputError
        here (`add_rmsnorm_capture: rows[1] = 4 is out of range (valid: 0..3)`) and writes nothing. On
        CUDA that aux row's slot block is filled with NaN, x, residual and the other aux rows are
        computed as usual, and the device error word records the index (as in capture_aux).
    """

    s = _validate.add_rmsnorm_capture(x, residual, weight, eps, aux, slot, rows)
    if rows is not None:
        check_range(rows, 0, s["T"] - 1, "add_rmsnorm_capture", "rows")
    acc = _acc(x, residual, weight)
    new_residual = (x.to(acc) + residual.to(acc)).to(residual.dtype)
    r = new_residual.to(acc)
    normed = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    residual.copy_(new_residual)
    x.copy_(normed.to(x.dtype))
    if aux is not None:
        H = s["H"]
        aux[:, slot * H:(slot + 1) * H] = new_residual if rows is None else new_residual[rows.long()]


# ---- fc ---------------------------------------------------------------------------------------------


def fc_proj(aux: Tensor, weight: Tensor, weight_scale: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
            norm_mode: str, rows: Optional[Tensor], out: Tensor) -> None:
    """The drafter's fc: out = norm(aux[rows]) @ (weight * weight_scale[:, None])^T.

    Parameters
    ----------
    aux : Tensor [T, n_aux * H] bf16 | fp16 | fp32
        Captured target features (may be a strided view of the capture buffer).
    weight : Tensor [Hd, n_aux * H] bf16 | fp16 | fp32 | fp8-e4m3
        fc weight in nn.Linear layout (or its prepared form, e.g. with per-chunk norm weights folded
        into the columns).
    weight_scale : Tensor [Hd] fp32, optional
        Per-output-channel dequantisation scale; required for an fp8 weight.
    norm_weight : Tensor, optional
        "norm_before_fc": [n_aux * H] (None = ones); "fc_norm": [n_aux, H] (ones when folded into
        weight; it also gives n_aux); "none": must be None.
    eps : float
        RMSNorm epsilon of the norm modes.
    norm_mode : str
        "none"; "norm_before_fc" (one RMSNorm over the whole n_aux * H row); "fc_norm" (an RMSNorm per
        H-wide chunk, EAGLE-3.1's fc_norm.{0,1,2}). The norm is applied in fp32, unrounded.
    rows : Tensor [R] int32 | int64, optional
        Rows of aux to project (e.g. the accepted tokens), gathered without a copy; None: all T. An index
        outside [0, T) raises Eagle3InputError here (`fc_proj: rows[5] = 99 is out of range (valid: 0..12)`,
        nothing written). On CUDA it is recorded in the device error word (eagle3_ops.check_errors(), or
        strict mode at the call, raises the same message), that out row is NaN, nothing is read for it, and
        every other row is computed as here.
    out : Tensor [R, Hd] bf16 | fp16 | fp32, mutated
        Projected hidden; R = T without rows. May be a strided view (last dim contiguous).
    """

    s = _validate.fc_proj(aux, weight, weight_scale, norm_weight, eps, norm_mode, rows, out)
    if rows is not None:
        check_range(rows, 0, s["T"] - 1, "fc_proj", "rows")
    acc = _acc(aux, out)
    # contiguous: CPU BLAS rounds a strided fp32 operand differently (1 ulp), and the result must not depend on
    # aux's strides (tests/test_fc_proj.py test_strided_aux)
    a = (aux if rows is None else aux[rows.long()]).to(acc).contiguous()
    if norm_mode != "none":
        n = 1 if norm_mode == "norm_before_fc" else s["n_aux"]
        chunks = a.view(a.shape[0], n, s["K"] // n)
        chunks = chunks * torch.rsqrt(chunks.pow(2).mean(-1, keepdim=True) + eps)
        if norm_weight is not None:
            chunks = chunks * norm_weight.to(acc).view(1, n, s["K"] // n)
        a = chunks.reshape(a.shape[0], s["K"])
    w = weight.to(acc)
    if weight_scale is not None:
        w = w * weight_scale.to(acc)[:, None]
    out.copy_((a @ w.T).to(out.dtype))


# ---- tree -------------------------------------------------------------------------------------------


def build_tree(root_tokens: Tensor, draft_tokens: Tensor, draft_scores: Tensor, draft_parents: Tensor,
               prefix_lens: Tensor, tokens: Tensor, parents: Tensor, positions: Tensor, tree_mask: Tensor) -> None:
    """EAGLE-2/3 dynamic tree: the N - 1 best draft candidates by cumulative score, as a canonical tree.

    Candidate (d, m) is the m-th candidate proposed at draft depth d (it would sit at depth d + 1 of
    the tree). Its effective score is its cumulative score capped by its parent's effective score,
    `eff(d, m) = min(draft_scores[d, m], eff(d - 1, draft_parents[d, m]))`, so a parent never ranks
    below its child (cumulative log-probabilities already satisfy this). Candidates are ranked by
    (eff descending, d ascending, m ascending); the first N - 1 become nodes 1..N-1 in rank order.
    The selection is closed under ancestry and parents precede children, so the order is
    topological and siblings are ordered by score (lower index = higher score).

    Bad values: here the first one (draft_parents, then draft_scores, each in row-major order) raises
    Eagle3InputError; on CUDA the tree is still built, with the same violation recorded in the error
    word (eagle3_ops.check_errors() raises it with the same message), as follows. A depth-0 parent other
    than -1 is ignored. A parent outside [0, M) at depth d >= 1 is read as the root: the candidate's
    effective score is capped by no ancestor, and if selected its parent is node 0 and its position
    prefix_lens + 1 (its own children keep it as their parent). A NaN score counts as -inf (so, through
    the cap, does every descendant's; ties among them go to the lower flat index d * M + m, as always).
    Token ids and prefix_lens are only copied (positions = prefix_lens + depth): any value is taken as
    given on both devices.

    Parameters
    ----------
    root_tokens : Tensor [B] int64
        Node 0's token: the last verified token.
    draft_tokens : Tensor [B, S, M] int64
        Candidate tokens per draft depth (S steps, M candidates per step, e.g. M = topk * topk).
    draft_scores : Tensor [B, S, M] fp32 | bf16 | fp16
        Cumulative scores (sum of log-probabilities along the path); -inf marks padding; never NaN.
    draft_parents : Tensor [B, S, M] int32 | int64
        Parent of each candidate: -1 (the root) at depth 0; at depth d >= 1 an index in [0, M) into
        depth d - 1's candidates.
    prefix_lens : Tensor [B] int32
        Verified tokens per request; positions = prefix_lens + depth.
    tokens : Tensor [B, N] int64, mutated
        Canonical tree tokens; node 0 = root_tokens. 1 <= N <= 1 + S * M.
    parents : Tensor [B, N] int32, mutated
        Parent node index, -1 for the root.
    positions : Tensor [B, N] int64, mutated
        prefix_lens + depth.
    tree_mask : Tensor [B, N, ceil(N / 32)] int32, mutated
        Bit j % 32 of word j // 32 of row i set iff node j is i or an ancestor of i (tree.tree_mask).
    """
    s = _validate.build_tree(root_tokens, draft_tokens, draft_scores, draft_parents, prefix_lens, tokens, parents,
                             positions, tree_mask)

    B, S, M, N = s["B"], s["S"], s["M"], s["N"]
    root = (torch.arange(S) == 0)[:, None]  # depth 0: the root's children
    check_range(draft_parents, torch.where(root, -1, 0), torch.where(root, -1, M - 1), "build_tree", "draft_parents")
    check_float(draft_scores, "build_tree", "draft_scores")
    scores = draft_scores.to(torch.float64)
    new_tokens = torch.empty(B, N, dtype=torch.int64)
    new_parents = torch.empty(B, N, dtype=torch.int32)
    for b in range(B):
        eff = scores[b].clone()
        for d in range(1, S):
            eff[d] = torch.minimum(eff[d], eff[d - 1][draft_parents[b, d].long()])
        # rank by (eff desc, d asc, m asc): a stable sort on -eff over the (d, m)-ordered flat list
        order = torch.sort(-eff.reshape(-1), stable=True).indices[: N - 1].tolist()
        node_of = {}  # flat candidate index -> node index
        new_tokens[b, 0], new_parents[b, 0] = root_tokens[b], -1
        for rank, flat in enumerate(order):
            d, m = divmod(flat, M)
            node_of[flat] = rank + 1
            new_tokens[b, rank + 1] = draft_tokens[b, d, m]
            new_parents[b, rank + 1] = 0 if d == 0 else node_of[(d - 1) * M + int(draft_parents[b, d, m])]
    tokens.copy_(new_tokens)
    parents.copy_(new_parents)
    positions.copy_(tree.positions(new_parents, prefix_lens))
    tree_mask.copy_(tree.tree_mask(new_parents))


# ---- attention --------------------------------------------------------------------------------------


def _check_self_bits(tree_mask: Tensor) -> None:
    """Every node sees itself: bit i of row i is set (an ancestor-or-self mask always has it)."""
    N = tree_mask.shape[1]
    diag = tree.mask_to_dense(tree_mask, N).diagonal(dim1=1, dim2=2)
    if not bool(diag.all()):
        b, i = (int(v) for v in (~diag).nonzero()[0])
        raise ValueError(f"tree_mask[{b}, {i}] must have bit {i} set (a node attends to itself); build it with "
                         "eagle3_ops.tree.tree_mask(parents)")


def _tree_visible(b: int, prefix: int, tree_mask: Tensor) -> Tensor:
    """[N, prefix + N] bool: every node sees the whole prefix, and its ancestors-or-self in the block."""
    N = tree_mask.shape[1]
    block = tree.mask_to_dense(tree_mask[b:b + 1], N)[0]
    return torch.cat([torch.ones(N, prefix, dtype=torch.bool), block], dim=1)


def _gather_pages(cache: Tensor, page_table: Tensor, b: int, length: int, op: str) -> Tensor:
    """The first `length` cached rows of request b, [length, ...], through its page table: only the slots
    that cover positions [0, length) are read (and must hold page ids in [0, num_pages))."""

    page_size = cache.shape[1]
    slots = -(-length // page_size) if page_size else 0
    check_range(page_table[b:b + 1, :slots], 0, cache.shape[0] - 1, op, "page_table", offset=(b, 0))
    pos = torch.arange(length)
    return cache[page_table[b, pos // page_size].long(), pos % page_size]


def _check_capacity(page_table: Tensor, prefix_lens: Tensor, N: int, page_size: int, op: str) -> None:
    """prefix_lens[b] in [0, max_pages * page_size - N]: room for the N tree rows (the kernels' wording)."""
    check_range(prefix_lens, 0, page_table.shape[1] * page_size - N, op, "prefix_lens")


def _attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """q [N, NH, D], k [L, NH, D], v [L, NH, Dv], visible [N, L] -> out [N, NH, Dv], lse [N, NH]."""
    scores = torch.einsum("nhd,lhd->nhl", q, k) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("nhl,lhd->nhd", torch.exp(scores - lse[..., None]), v)
    return out, lse


def _tree_attention(q: Tensor, kv_rows, page_table: Tensor, prefix_lens: Tensor, tree_mask: Tensor, scale: float,
                    out: Tensor, lse: Optional[Tensor], page_size: int, op: str) -> None:
    """Shared body: kv_rows(b, length) gives request b's first `length` rows as (k [L, NH, D], v [L, NH, Dv]).
    Every prefix length is checked before any page id (the kernels skip a bad-prefix request unread)."""
    B, N = tree_mask.shape[0], tree_mask.shape[1]
    _check_capacity(page_table, prefix_lens, N, page_size, op)
    _check_self_bits(tree_mask)
    outs, lses = [], []
    for b in range(B):
        prefix = int(prefix_lens[b])
        k, v = kv_rows(b, prefix + N)
        o, l = _attend(q[b * N:(b + 1) * N], k, v, _tree_visible(b, prefix, tree_mask), scale)
        outs.append(o)
        lses.append(l)
    out.copy_(torch.cat(outs).to(out.dtype))
    if lse is not None:
        lse.copy_(torch.cat(lses).to(lse.dtype))


def tree_attention_mla(q: Tensor, kv_cache: Tensor, page_table: Tensor, prefix_lens: Tensor, tree_mask: Tensor,
                       scale: float, out: Tensor, lse: Optional[Tensor], kv_scale: Optional[Tensor] = None) -> None:
    """Absorbed-MLA tree-verify attention: 64 query heads over one shared latent KV head.

    Request b's tree node i attends to positions [0, prefix_lens[b]) (the whole prefix) and to
    prefix_lens[b] + j for every j with bit j set in tree_mask[b, i] (its ancestors and itself). Keys
    are the full D = 576 cached dims, values the first Dv = 512. Softmax in fp32 (float64 here for
    float64 inputs).

    An fp8 cache (float8_e4m3fn, the same [num_pages, page_size, D] layout, one byte a dim) holds
    round(row / kv_scale) as vLLM's concat_and_cache_mla writes it (models.cache.fp8_quantize); every
    cached row is read as fp8 * kv_scale (one fp32 scale for the whole tensor, latent and rope dims alike:
    vLLM's layer._k_scale, FlashMLA's descale_k; SGLang casts unscaled, kv_scale 1.0), then the math
    above, with bf16 / fp16 queries and fp32 accumulation.

    Parameters
    ----------
    q : Tensor [B * N, NH, D] bf16 | fp16 | fp32
        [q_abs | q_pe] per node and head, node-major per request.
    kv_cache : Tensor [num_pages, page_size, D] q's dtype | float8_e4m3fn
        Latent cache [c_kv | k_pe]; the N tree tokens are already at positions prefix_len + node.
        float8_e4m3fn needs bf16 / fp16 q and kv_scale.
    page_table : Tensor [B, max_pages] int32
        Page of each request's position p is page_table[b, p // page_size].
    prefix_lens : Tensor [B] int32
        Verified tokens before the tree; prefix_len + N <= max_pages * page_size.
    tree_mask : Tensor [B, N, ceil(N / 32)] int32
        Ancestor-or-self bits over the tree block (tree.tree_mask).
    scale : float
        Softmax scale, e.g. 0.130861 for Kimi-K2 (docs/models.md), never 576 ** -0.5.
    out : Tensor [B * N, NH, Dv] q's dtype, mutated
        Attention output in latent space.
    lse : Tensor [B * N, NH] fp32, optional, mutated
        Natural-log sum of exp(scale * q.k) over the visible positions (k dequantised).
    kv_scale : Tensor [] or [1] fp32, optional
        Required with an fp8 kv_cache, None otherwise: key = fp8 * kv_scale. A device tensor, so that a
        CUDA graph replays with whatever value it holds. Must be finite and > 0.

    Bad values: prefix_lens[b] must lie in [0, max_pages * page_size - N], and the page-table slots that cover
    positions [0, prefix_lens[b] + N) (slots 0 .. ceil((prefix_lens[b] + N) / page_size) - 1; the slots past
    them are never read, whatever they hold) must hold page ids in [0, num_pages). Here a violation raises
    Eagle3InputError, e.g. `tree_attention_mla: page_table[0, 5] = 99999 is out of range (valid: 0..63)`
    (prefix lengths are checked first, then each request's slots in order). On CUDA the request is skipped
    instead: every row of out and lse of that request (all its nodes and heads) is NaN, nothing out of range is
    read (nothing at all for a bad prefix length), the other requests are computed as usual, and the violation
    is recorded for eagle3_ops.check_errors() with the same message. A node missing its own tree_mask bit
    raises ValueError here; CUDA does not check it. A kv_scale that is not finite and > 0 raises
    Eagle3InputError here (`tree_attention_mla: kv_scale = 0.0 must be finite and > 0`); on CUDA every row of
    out and lse is NaN and the violation is recorded with the same message.
    """
    s = _validate.tree_attention_mla(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, kv_scale)
    acc, NH, Dv = _acc(q), s["NH"], s["Dv"]
    if kv_scale is not None:
        ks = float(kv_scale.reshape(()))
        if not 0 < ks < float("inf"):
            raise input_error("tree_attention_mla", "kv_scale", (), ks, kind="not_positive")

    def kv_rows(b, length):  # one latent head shared by every query head; V = its first Dv dims
        kv = _gather_pages(kv_cache, page_table, b, length, "tree_attention_mla").to(acc)[:, None, :]
        if kv_scale is not None:  # fp8 -> acc is exact; the product rounds once (float32) or not at all (float64)
            kv = kv * kv_scale.to(acc).reshape(())
        kv = kv.expand(-1, NH, -1)
        return kv, kv[..., :Dv]

    _tree_attention(q.to(acc), kv_rows, page_table, prefix_lens, tree_mask, scale, out, lse, s["page_size"],
                    "tree_attention_mla")


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, prefix_lens: Tensor,
                   tree_mask: Tensor, scale: float, out: Tensor, lse: Optional[Tensor]) -> None:
    """GQA/MHA tree-verify attention (Llama-style targets, the drafter's own layer). Same visibility
    as tree_attention_mla; query head h reads KV head h // (NH // HKV).

    Parameters
    ----------
    q : Tensor [B * N, NH, Dh] bf16 | fp16 | fp32
        Queries, node-major per request.
    k_cache : Tensor [num_pages, page_size, HKV, Dh] q's dtype
        Paged keys; the tree tokens are already at positions prefix_len + node.
    v_cache : Tensor [num_pages, page_size, HKV, Dv] q's dtype
        Paged values, same pages as k_cache.
    page_table : Tensor [B, max_pages] int32
        As in tree_attention_mla.
    prefix_lens : Tensor [B] int32
        Verified tokens before the tree.
    tree_mask : Tensor [B, N, ceil(N / 32)] int32
        Ancestor-or-self bits over the tree block.
    scale : float
        Softmax scale (Dh ** -0.5 for a plain Llama layer).
    out : Tensor [B * N, NH, Dv] q's dtype, mutated
        Attention output.
    lse : Tensor [B * N, NH] fp32, optional, mutated
        Natural-log sum of exp(scale * q.k) over the visible positions.

    Bad values: as tree_attention_mla (same checks, same CUDA behaviour: the request's rows of out and lse NaN,
    the violation recorded), e.g. `tree_attention: prefix_lens[1] = -3 is out of range (valid: 0..4080)`.
    """
    s = _validate.tree_attention(q, k_cache, v_cache, page_table, prefix_lens, tree_mask, scale, out, lse)
    acc, group = _acc(q), s["NH"] // s["HKV"]

    def kv_rows(b, length):  # query head h reads KV head h // group
        k = _gather_pages(k_cache, page_table, b, length, "tree_attention").to(acc).repeat_interleave(group, dim=1)
        v = _gather_pages(v_cache, page_table, b, length, "tree_attention").to(acc).repeat_interleave(group, dim=1)
        return k, v

    _tree_attention(q.to(acc), kv_rows, page_table, prefix_lens, tree_mask, scale, out, lse, s["page_size"],
                    "tree_attention")


# ---- verify -----------------------------------------------------------------------------------------


def _walk_outputs(B: int, N: int, paths: list[list[int]], bonus: list[int], tokens: Tensor):
    accept_nodes = torch.full((B, N), -1, dtype=torch.int32)
    accept_len = torch.empty(B, dtype=torch.int32)
    emitted = torch.full((B, N), -1, dtype=torch.int64)
    for b, path in enumerate(paths):
        accept_nodes[b, :len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_len[b] = len(path) - 1
        drafts = [int(tokens[b, j]) for j in path[1:]]
        emitted[b, :len(path)] = torch.tensor(drafts + [bonus[b]], dtype=torch.int64)
    return accept_nodes, accept_len, emitted


def verify_greedy(logits: Tensor, tokens: Tensor, parents: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy tree verification: from the root, follow the child whose token equals the target argmax.

    At the current node c (starting at the root), t = argmax(logits[b * N + c]) (the first maximum);
    if a child of c carries token t (the lowest-index such child), it is accepted and becomes c;
    otherwise t is the bonus token and the walk ends.

    Bad parents: here the first (row-major) raises Eagle3InputError, e.g. `verify_greedy: parents[0, 3]
    = 5 is out of range (valid: 0..2)` (the root's valid range is -1..-1). On CUDA the same violation is
    recorded in the error word (eagle3_ops.check_errors() raises it) and the walk goes on: a node j whose
    parent is not in [0, j) is never accepted (nor, so, is any node below it), a root parent other than
    -1 is ignored, and every output element is written. Tokens are only compared with the argmax: a
    token outside [0, V) is never accepted, on both devices.

    Parameters
    ----------
    logits : Tensor [B * N, V] bf16 | fp16 | fp32
        Target logits at every tree node, node-major per request.
    tokens : Tensor [B, N] int64  (N <= 16384 on CUDA: the walk keeps the tree in shared memory)
        Draft token per node; node 0 is the root (the last verified token).
    parents : Tensor [B, N] int32
        Canonical parents: -1 for the root, 0 <= parents[b, j] < j for the others.

    Returns
    -------
    accept_nodes : Tensor [B, N] int32
        Accepted path as node indices, root first (accept_nodes[b, 0] = 0), -1 padded.
    accept_len : Tensor [B] int32
        Accepted draft tokens, root and bonus excluded: a step emits accept_len + 1 tokens.
    emitted : Tensor [B, N] int64
        The accept_len accepted draft tokens, then the bonus token, -1 padded.
    """

    s = _validate.verify_greedy(logits, tokens, parents)
    B, N = s["B"], s["N"]
    node = torch.arange(N)  # the root's parent is -1, node j's in [0, j)
    check_range(parents, torch.where(node == 0, -1, 0), node - 1, "verify_greedy", "parents")
    first_child, next_sibling = tree.children_links(parents)
    target = logits.argmax(dim=-1).view(B, N)
    paths, bonus = [], []
    for b in range(B):
        path = [0]
        while True:
            t, j = int(target[b, path[-1]]), int(first_child[b, path[-1]])
            while j != -1 and int(tokens[b, j]) != t:
                j = int(next_sibling[b, j])
            if j == -1:
                break
            path.append(j)
        paths.append(path)
        bonus.append(int(target[b, path[-1]]))
    return _walk_outputs(B, N, paths, bonus, tokens)


def verify_sampling(logits: Tensor, draft_probs: Optional[Tensor], d2t: Optional[Tensor], tokens: Tensor,
                    parents: Tensor, temperature: Tensor, seed: Tensor, offset: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Tree rejection sampling that keeps the target distribution exactly.

    At the current node c, p = softmax(logits[b * N + c] / temperature[b]). Its children are
    tried in sibling order (score order). Child k with token x is accepted when u_k * q(x) < p(x),
    u_k a uniform draw; q is draft_probs[b * N + c] mapped to target ids (target = draft + d2t[draft]),
    or, without draft_probs, one-hot on x (drafts chosen by top-k, not sampled). On rejection
    p <- normalize(max(p - q, 0)), and the next sibling is tried against the residual. The first
    accepted child becomes c and the walk goes on; when every child is rejected, or c is a leaf, the
    bonus token is sampled from the current p and the walk ends. With one-hot q this is exactly
    sampling from p; with draft_probs the siblings must be independent draws from q (SpecInfer's
    multi-step speculative sampling). temperature[b] == 0 makes request b greedy (as verify_greedy).

    Randomness (eagle3_ops._philox): u_k = uniform(seed[b], offset[b], row = b * N + c, idx = k,
    stream 0); the bonus is argmax_v p(v) / E_v with E_v = -log(uniform(seed[b], offset[b], row, v,
    stream 1)) (an exponential race: a draw from p with no normalisation pass), ties to the lowest id.
    Nothing fp32 [B, N, V] is materialised by the kernel.

    Bad values: here the first raises Eagle3InputError (parents, then temperature, then d2t, each in
    row-major order), e.g. `verify_sampling: parents[0, 3] = 5 is out of range (valid: 0..2)`,
    `verify_sampling: temperature[1] = -1.0 must be >= 0`, `verify_sampling: temperature[1] is NaN`,
    `verify_sampling: d2t[17] = 200000 is out of range (valid: -17..163822)` (d2t[d] must keep the
    target id d + d2t[d] in [0, V): valid -d..V - 1 - d). On CUDA the same violation is recorded in
    the error word (eagle3_ops.check_errors() raises it) and the walk goes on: a node j whose parent is
    not in [0, j) is never visited (not tried, no uniform drawn for it; nor is any node below it) and a
    root parent other than -1 is ignored; a negative or NaN temperature samples request b greedily (as
    temperature 0); a bad d2t entry drops that draft id's probability from q. Tokens outside [0, V)
    are valid on both devices: p(x) = 0, never accepted.

    Parameters
    ----------
    logits : Tensor [B * N, V] bf16 | fp16 | fp32
        Target logits at every tree node, node-major per request.
    draft_probs : Tensor [B * N, Vd] fp32 | bf16 | fp16, optional
        Draft distribution each node's children were sampled from, over the draft vocabulary.
    d2t : Tensor [Vd] int64, optional
        Draft-to-target id offsets; required when Vd != V, only with draft_probs.
    tokens : Tensor [B, N] int64  (N <= 16384 on CUDA: the walk keeps the tree in shared memory)
        Draft token per node (target vocabulary); node 0 is the root.
    parents : Tensor [B, N] int32
        Canonical parents: -1 for the root, 0 <= parents[b, j] < j for the others.
    temperature : Tensor [B] fp32
        Sampling temperature per request, >= 0 (0 = greedy).
    seed : Tensor [B] int64
        Philox key per request.
    offset : Tensor [B] int64
        Philox counter offset per request; advance it every step.

    Returns
    -------
    accept_nodes : Tensor [B, N] int32
        Accepted path as node indices, root first, -1 padded.
    accept_len : Tensor [B] int32
        Accepted draft tokens, root and bonus excluded: a step emits accept_len + 1 tokens.
    emitted : Tensor [B, N] int64
        The accept_len accepted draft tokens, then the bonus token, -1 padded.
    """

    s = _validate.verify_sampling(logits, draft_probs, d2t, tokens, parents, temperature, seed, offset)
    B, N, V = s["B"], s["N"], s["V"]
    node = torch.arange(N)  # the root's parent is -1, node j's in [0, j)
    check_range(parents, torch.where(node == 0, -1, 0), node - 1, "verify_sampling", "parents")
    check_float(temperature, "verify_sampling", "temperature", nonnegative=True)
    if d2t is not None:
        d = torch.arange(s["Vd"])
        check_range(d2t, -d, V - 1 - d, "verify_sampling", "d2t")
    first_child, next_sibling = tree.children_links(parents)
    paths, bonus = [], []
    for b in range(B):
        temp, sd, off = float(temperature[b]), int(seed[b]), int(offset[b])
        path = [0]
        while True:
            c = path[-1]
            row = b * N + c
            z = logits[row].to(torch.float64)
            if temp == 0:
                p = torch.zeros(V, dtype=torch.float64)
                p[int(z.argmax())] = 1.0
            else:
                p = torch.softmax(z / temp, dim=-1)
            q = None
            if draft_probs is not None:
                q = torch.zeros(V, dtype=torch.float64)
                ids = torch.arange(s["Vd"]) + (d2t if d2t is not None else 0)
                q.index_add_(0, ids, draft_probs[row].to(torch.float64))
            j, k, accepted = int(first_child[b, c]), 0, False
            while j != -1:
                x = int(tokens[b, j])
                px = float(p[x]) if 0 <= x < V else 0.0
                qx = float(q[x]) if q is not None and 0 <= x < V else 1.0
                u = float(_philox.uniform(sd, off, row, [k], _philox.STREAM_ACCEPT)[0])
                if u * qx < px:
                    accepted = True
                    break
                residual = p.clone()
                if q is None:
                    if 0 <= x < V:
                        residual[x] = 0.0
                else:
                    residual = torch.clamp(p - q, min=0.0)
                if float(residual.sum()) > 0:
                    p = residual / residual.sum()
                j, k = int(next_sibling[b, j]), k + 1
            if accepted:
                path.append(j)
                continue
            e = -np.log(_philox.uniform(sd, off, row, np.arange(V), _philox.STREAM_SAMPLE))
            bonus.append(int(torch.argmax(p / torch.from_numpy(e))))  # argmax returns the first maximum
            break
        paths.append(path)
    return _walk_outputs(B, N, paths, bonus, tokens)


# ---- kv ---------------------------------------------------------------------------------------------


def kv_accept(caches: Sequence[Tensor], page_table: Tensor, prefix_lens: Tensor, accept_nodes: Tensor,
              accept_len: Tensor) -> None:
    """Compact each request's accepted tree rows into place in every layer's cache, then advance prefix_lens.

    For request b with a = accept_len[b] and P = prefix_lens[b], row i in 0..a moves from position
    P + accept_nodes[b, i] to position P + i (position p lives at page page_table[b, p // page_size],
    slot p % page_size), in every cache of the list; all rows are read before any is written, so
    overlapping moves (accepted [0, 2, 3]: 2 -> 1, 3 -> 2) are safe. Then prefix_lens[b] += a + 1.
    Rows beyond are left stale (overwritten later).

    The op does not know the tree size: it checks positions against the page table. With
    cap = min(max_pages * page_size, 2**31 - 1), each request is checked in this order: accept_len[b]
    in 0..min(W, 2048) - 1 (2048: the most rows one request may move on CUDA); prefix_lens[b] in
    0..cap - 1 - a (every destination P + i in the table); accept_nodes[b, i] in 0..cap - 1 - P for
    i in 0..a (every source in the table); then page_table[b, s] in 0..num_pages - 1 for every page
    slot s holding a source or a destination (rows that stay in place included). Entries of
    accept_nodes past accept_len are never read. Here the first violation (request by request, in that
    order) raises Eagle3InputError; on CUDA the request is skipped whole (its cache rows and its
    prefix_len stay untouched), the other requests are processed, and the same violation is recorded
    in the error word (eagle3_ops.check_errors() raises it with the same message).

    Parameters
    ----------
    caches : list of Tensor [num_pages, page_size, ...], mutated
        Per-layer caches sharing one page layout: MLA latent [num_pages, page_size, 576], or K and V
        [num_pages, page_size, HKV, Dh]; any dtype, contiguous. Requests own disjoint pages.
    page_table : Tensor [B, max_pages] int32
        Pages of each request.
    prefix_lens : Tensor [B] int32, mutated
        Verified tokens before the tree; advanced by accept_len + 1.
    accept_nodes : Tensor [B, W] int32
        Accepted nodes, root first, any width W >= 1: verify's [B, N] (-1 padded) or SGLang's accept
        index [B, steps + 1]; entries 0..accept_len are used.
    accept_len : Tensor [B] int32
        Accepted draft tokens (bonus excluded), 0 <= accept_len <= min(W, 2048) - 1.
    """

    s = _validate.kv_accept(caches, page_table, prefix_lens, accept_nodes, accept_len)
    B, W, ps, num_pages = s["B"], s["W"], s["page_size"], s["num_pages"]
    cap = min(s["max_pages"] * ps, 2**31 - 1)
    moves = []
    for b in range(B):
        check_range(accept_len[b:b + 1], 0, min(W, 2048) - 1, "kv_accept", "accept_len", (b,))
        a, P = int(accept_len[b]), int(prefix_lens[b])
        check_range(prefix_lens[b:b + 1], 0, cap - 1 - a, "kv_accept", "prefix_lens", (b,))
        nodes = accept_nodes[b, :a + 1]
        check_range(nodes[None], 0, cap - 1 - P, "kv_accept", "accept_nodes", (b, 0))
        src, dst = P + nodes.long(), P + torch.arange(a + 1)
        used = torch.zeros(page_table.shape[1], dtype=torch.bool)  # the page slots read or written
        used[src // ps] = True
        used[dst // ps] = True
        lo, hi = torch.where(used, 0, -2**62), torch.where(used, num_pages - 1, 2**62)  # unused slots: anything
        check_range(page_table[b:b + 1], lo, hi, "kv_accept", "page_table", (b, 0))
        moves.append((page_table[b, src // ps].long(), src % ps, page_table[b, dst // ps].long(), dst % ps))
    for cache in caches:
        rows = [cache[sp, ss].clone() for sp, ss, _, _ in moves]  # read everything first
        for (_, _, dp, ds), r in zip(moves, rows):
            cache[dp, ds] = r
    prefix_lens += accept_len + 1
