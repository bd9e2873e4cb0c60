"""SGLang's speculative kernels with sgl-kernel's names, arguments, dtypes and in-place outputs, on our ops.

An SGLang EAGLE worker swaps ``from sgl_kernel import ...`` for ``from eagle3_ops.compat.sglang import ...``:
``build_tree_kernel_efficient`` (all three tree-mask modes), ``verify_tree_greedy``,
``tree_speculative_sampling_target_only``, ``segment_packbits`` and ``reconstruct_indices_from_tree_mask``
(sgl-kernel's speculative.py, and its eagle_utils.cu, speculative_sampling.cuh, packbit.cu and ngram_utils.cu
read as the specification; argument names keep sgl-kernel's ``retrive_*``).

How each runs. On CUDA tensors each function is ONE C++ op, torch.ops.eagle3._sglang_* (csrc/compat_sglang_*.cu:
the checks below in C++, one or two CUDA launches, no host sync, CUDA-graph capturable), which this module
resolves once and calls with nothing else done in Python: an eager call costs one dispatch, as SGLang's own
sgl-kernel calls do. Where the build lacks those files (EAGLE3_CUDA_ONLY without compat_sglang) or a shape
passes its kernels' limits (the op then raises NotImplementedError after its checks), the same call takes the
Triton kernels (triton_kernels/compat_sglang.py: one or two launches each, the same algorithms). On CPU tensors
it runs the tensor-op path below, which is the specification both are tested against
(tests/test_compat_sglang.py runs them on random inputs, the Triton kernels under TRITON_INTERPRET=1);
``kernels`` (default: $EAGLE3_COMPAT_KERNELS, else "auto") = "triton" sends CUDA tensors to the Triton kernels
instead of the C++ ops and CPU tensors to the Triton kernels too, "torch" keeps CUDA tensors on the tensor ops:

* ``build_tree_kernel_efficient`` calls ``torch.ops.eagle3.build_tree`` on SGLang's candidate layout
  (depth d's candidates as row d of a [depth, topk * topk] block, the selected ones scored -index so that
  our ranking keeps SGLang's ascending node order), then writes SGLang's lists from our parents, its
  positions from ours, and its mask layout from our ancestor bits. The kernel computes the same ranking
  (selected candidates whose ancestors are all selected by index, then build_tree's -inf candidates by
  flat index) in one program per request.
* ``verify_tree_greedy`` and ``tree_speculative_sampling_target_only`` turn SGLang's linked lists into
  parents (pointer doubling), decide at every node which child SGLang's walk would take there (the first
  in list order whose token is the target's argmax, resp. which passes SGLang's threshold rule with that
  node's coin), and let ``torch.ops.eagle3.verify_greedy`` walk the tree on those flags; the outputs are
  SGLang's ``predicts`` / ``accept_index`` / ``accept_token_num``, and for sampling the bonus token is drawn
  from relu(target_probs - draft_probs) at the last accepted node with SGLang's final coin. The kernels
  walk the lists as SGLang's kernels do (one program per request; sampling in two launches over
  (request, vocabulary chunk), the second drawing the bonus by inverse CDF over the chunks' masses).
* ``segment_packbits`` and ``reconstruct_indices_from_tree_mask`` are layout conversions with no native
  op behind them: vectorised index ops, one kernel each.

Conventions kept from SGLang: node i >= 1 of request b is candidate ``selected_index[b, i - 1]``; a
candidate's parent is ``parent_list[b, candidate // topk]`` (slot 0: the root); ``retrive_index[b, i] =
b * N + i``; the lists are written only where SGLang writes them (first children, later siblings) and the
caller initialises them to -1; ``accept_token_num`` counts accepted *draft* tokens (a step emits
accept_token_num + 1) and ``accept_index`` entries past them are left as the caller set them.

Input contract (as the native ops'): shapes, dtypes, devices and layouts are checked before anything is
written (TypeError / ValueError naming SGLang's argument); values only the data shows raise
eagle3_ops.Eagle3InputError on CPU before anything is written. On CUDA a bad value is never used as an
index: what each function skips is in its docstring, and build_tree's own checks record in the error word.

Where SGLang's kernels are undefined this module does something defined: a selected candidate whose parent
was not selected (SGLang prints "invalid eagle tree", leaves it unlinked and reads past the row) gets the
place our build_tree ranks it at (the tree stays consistent: lists, positions and mask agree, but that node
is not the candidate SGLang's draft_tokens holds there); lists that are not a forest with each parent
before its children (parent index < child index, which SGLang's build always gives) are refused on CPU
and, on CUDA, the nodes that break it are never accepted.
"""

from __future__ import annotations

import functools
import os
from enum import IntEnum
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import _validate, errors, tree
from ..errors import check_range, input_error

# "auto": the C++ ops on CUDA tensors (the Triton kernels where the build has none); "triton": the Triton kernels
# on any tensors (interpreted on CPU); "torch": the tensor ops everywhere
kernels = os.environ.get("EAGLE3_COMPAT_KERNELS", "auto")

__all__ = ["TreeMaskMode", "build_tree_kernel_efficient", "verify_tree_greedy", "tree_speculative_sampling_target_only",
           "segment_packbits", "reconstruct_indices_from_tree_mask"]

I64, I32 = (torch.int64,), (torch.int32,)
BITPACK_DTYPES = {1: (torch.uint8,), 2: (torch.uint8, torch.uint16, torch.int16),
                  4: (torch.uint8, torch.uint32, torch.int32)}


class TreeMaskMode(IntEnum):
    """SGLang's tree mask layouts (sgl-kernel eagle_utils.cu; sglang.srt.speculative.eagle_utils)."""

    FULL_MASK = 0             # bool, per request an [N, seq_len + N] block, the blocks concatenated
    QLEN_ONLY = 1             # bool [B * N * N]
    QLEN_ONLY_BITPACKING = 2  # [B * N] rows of 1 | 2 | 4 bytes (N <= 8 | 16 | 32): bit j of row i = node j sees i


def _t(t, name: str, dtypes, like: Tensor, shape=None, dim=None) -> Tensor:
    """One argument: dtype, shape or rank, contiguous, on the device of the first tensor argument."""
    return _validate.tensor(t, name, dtypes=dtypes, shape=shape, dim=dim, like=like, like_name="the first argument",
                            contiguous=True)


def _numel(t: Tensor, name: str, n: int, what: str, shapes=None) -> None:
    if t.numel() != n or (shapes is not None and tuple(t.shape) not in shapes):
        allowed = " or ".join(str(s) for s in shapes) if shapes else f"{n} elements"
        raise ValueError(f"{name} must have {what} = {n} elements ({allowed}), got shape {tuple(t.shape)}")


def _kernels(t: Tensor) -> bool:
    if kernels not in ("auto", "torch", "triton"):
        raise ValueError(f"eagle3_ops.compat.sglang.kernels must be 'auto', 'torch' or 'triton', got {kernels!r}")
    return kernels == "triton" or (kernels == "auto" and t.is_cuda)


def _k():
    from ..triton_kernels import compat_sglang

    return compat_sglang


class _CudaOps(NamedTuple):
    build_tree: object
    verify_greedy: object
    verify_sampling: object
    segment_packbits: object
    reconstruct_indices: object


@functools.cache
def _cuda_ops() -> _CudaOps:
    """torch.ops.eagle3._sglang_<name>.default for each function whose CUDA kernel this build compiled
    (csrc/compat_sglang_*.cu), else None: resolved once, so that an eager call does no lookup."""
    def op(name):
        try:
            overload = getattr(torch.ops.eagle3, f"_sglang_{name}").default
        except (AttributeError, RuntimeError):  # a _C from before these schemas
            return None
        return overload if torch._C._dispatch_has_kernel_for_dispatch_key(f"eagle3::_sglang_{name}", "CUDA") else None

    return _CudaOps(*(op(n) for n in _CudaOps._fields))


def _mask_bytes(N: int) -> int:
    return 1 if N <= 8 else (2 if N <= 16 else 4)


# ---- build_tree_kernel_efficient ------------------------------------------------------------------------


def build_tree_kernel_efficient(parent_list: Tensor, selected_index: Tensor, verified_seq_len: Tensor,
                                tree_mask: Tensor, positions: Tensor, retrive_index: Tensor,
                                retrive_next_token: Tensor, retrive_next_sibling: Tensor, topk: int, depth: int,
                                draft_token_num: int, tree_mask_mode: int = TreeMaskMode.FULL_MASK) -> None:
    """sgl_kernel.build_tree_kernel_efficient: SGLang's selected draft candidates -> its tree tensors, in place.

    Candidates are SGLang's flattened score list: f < topk are the root's children; f >= topk is a child
    of candidate parent_list[b, f // topk] at draft depth 1 + (f - topk) // topk**2. Node i >= 1 is
    candidate selected_index[b, i - 1] (SGLang sorts them ascending, so parents precede children).

    Parameters
    ----------
    parent_list : Tensor [B, topk * (depth - 1) + 1] int64 ([B, 0] allowed when depth == 1)
        Flat candidate index of each expanded beam; entry 0 (the root) is never read. Entries of slots
        that feed a selected candidate must point into the previous draft depth (SGLang's drafting does).
    selected_index : Tensor [B, N - 1] int64
        The selected candidates, each in [0, topk + (depth - 1) * topk**2).
    verified_seq_len : Tensor [B] int64 | int32
        Verified tokens per request (< 2**31).
    tree_mask : Tensor, mutated
        FULL_MASK: bool [sum(verified_seq_len) * N + B * N * N], request b's rows of seq_len + N entries
        after the earlier requests' blocks; the last N entries of each row are written, the prefix entries
        are left as they are (SGLang's caller fills True). QLEN_ONLY: bool [B * N * N] (any shape).
        QLEN_ONLY_BITPACKING (N <= 32): 1 | 2 | 4 bytes per row, as uint8 [B * N * nbytes] or [B * N, nbytes],
        uint16 / int16 [B * N] (nbytes 2) or uint32 / int32 [B * N] (nbytes 4); byte 0 is set, the other
        bytes are OR-ed into (SGLang's caller zeroes them).
    positions : Tensor [B * N] or [B, N] int64, mutated
        verified_seq_len[b] + depth.
    retrive_index : Tensor [B, N] int64, mutated
        b * N + i.
    retrive_next_token, retrive_next_sibling : Tensor [B, N] int64, mutated
        First child / next sibling (ascending index), written where a link exists; the caller fills -1.
    topk, depth, draft_token_num : int
        Candidates kept per draft step, draft steps, N.
    tree_mask_mode : int
        TreeMaskMode.

    Bad values: here (CPU) a selected_index outside its range, a parent_list entry that a selected
    candidate reads outside the previous depth's candidates, or a FULL_MASK buffer shorter than
    sum(verified_seq_len) * N + B * N * N raises Eagle3InputError / ValueError before anything is written.
    On CUDA an out-of-range selected_index is skipped (not selected), a bad parent entry reaches
    build_tree's check (recorded as build_tree's draft_parents; the candidate hangs from the root), and mask
    rows past the end of a short FULL_MASK buffer are not written.
    """
    if kernels == "auto" and isinstance(parent_list, Tensor) and parent_list.is_cuda:
        op = _cuda_ops().build_tree
        if op is not None:
            try:
                return op(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
                          retrive_next_token, retrive_next_sibling, int(topk), int(depth), int(draft_token_num),
                          int(tree_mask_mode))
            except NotImplementedError:  # past the C++ kernel's limits: the Triton / tensor-op path below
                pass
    N, topk, depth, mode = int(draft_token_num), int(topk), int(depth), TreeMaskMode(int(tree_mask_mode))
    if topk < 1 or depth < 1:
        raise ValueError(f"topk and depth must be >= 1, got topk = {topk}, depth = {depth}")
    C = topk + (depth - 1) * topk * topk  # SGLang's candidates
    if not 1 <= N <= C + 1:
        raise ValueError(f"draft_token_num must be in [1, topk + (depth - 1) * topk**2 + 1] = [1, {C + 1}], got {N}")
    _t(parent_list, "parent_list", I64, parent_list, dim=2)
    B, P = parent_list.shape
    if P != topk * (depth - 1) + 1 and not (depth == 1 and P == 0):
        raise ValueError(f"parent_list must have shape (B, topk * (depth - 1) + 1) = ({B}, {topk * (depth - 1) + 1}), "
                         f"got {tuple(parent_list.shape)}")
    _t(selected_index, "selected_index", I64, parent_list, shape=(("B", B), ("N - 1", N - 1)))
    _t(verified_seq_len, "verified_seq_len", I64 + I32, parent_list, shape=(("B", B),))
    _t(positions, "positions", I64, parent_list)
    _numel(positions, "positions", B * N, "B * N", [(B * N,), (B, N)])
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        _t(t, name, I64, parent_list, shape=(("B", B), ("N", N)))
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        if N > 32:
            raise ValueError(f"QLEN_ONLY_BITPACKING holds at most 32 nodes (4 bytes per row), got N = {N}")
        nb = _mask_bytes(N)
        _t(tree_mask, "tree_mask", BITPACK_DTYPES[nb], parent_list)
        _numel(tree_mask, "tree_mask", B * N * nb // tree_mask.element_size(), f"B * N * {nb} bytes")
    else:
        _t(tree_mask, "tree_mask", (torch.bool,), parent_list)
        if mode == TreeMaskMode.QLEN_ONLY:
            _numel(tree_mask, "tree_mask", B * N * N, "B * N * N")
    on_cpu = parent_list.device.type == "cpu"
    M = topk * topk if depth > 1 else topk  # our layout: draft depth d's candidates in row d of [depth, M]
    sel = selected_index
    if on_cpu:
        check_range(sel, 0, C - 1, "build_tree_kernel_efficient", "selected_index")
        if mode == TreeMaskMode.FULL_MASK and tree_mask.numel() < int(verified_seq_len.sum()) * N + B * N * N:
            raise ValueError(f"tree_mask must have sum(verified_seq_len) * N + B * N * N = "
                             f"{int(verified_seq_len.sum()) * N + B * N * N} elements, got {tree_mask.numel()}")
    if B == 0:
        return
    if _kernels(parent_list) and _k().fits(N, depth * M):
        _k().build(parent_list, sel, verified_seq_len, tree_mask, positions, retrive_index, retrive_next_token,
                   retrive_next_sibling, topk, depth, N, int(mode), errors.error_word(parent_list.device))
        return
    dev = parent_list.device
    # Flat SGLang index f -> our flat index d * M + m (f < topk: row 0; then topk**2 per depth).
    ours = lambda f: torch.where(f < topk, f, f + (M - topk))  # noqa: E731
    valid = (sel >= 0) & (sel < C)
    scores = torch.full((B, depth * M + 1), float("-inf"), device=dev)  # + one column for skipped selections
    scores.scatter_(1, torch.where(valid, ours(sel), depth * M), -sel.float())
    scores = scores[:, :-1].contiguous().view(B, depth, M)
    parents_in = torch.full((B, depth, M), -1, dtype=torch.int64, device=dev)
    if depth > 1:
        m = torch.arange(M, device=dev)
        d = torch.arange(1, depth, device=dev)[:, None]
        slot = 1 + (d - 1) * topk + m // topk                               # [depth - 1, M]
        g = parent_list[:, slot.view(-1)].view(B, depth - 1, M)             # the parent's flat index
        local = ours(g) - (d - 1) * M                                       # its index in depth d - 1
        chosen = scores[:, 1:] > float("-inf")
        if on_cpu:
            bad = chosen & ((local < 0) | (local >= M))
            if bool(bad.any()):
                b, dd, mm = (int(v) for v in bad.nonzero()[0])
                s = int(slot[dd, mm])
                base = topk + (dd - 1) * topk * topk if dd > 0 else 0
                raise input_error("build_tree_kernel_efficient", "parent_list", (b, s), int(parent_list[b, s]),
                                  base, base + (topk if dd == 0 else topk * topk) - 1)
        parents_in[:, 1:] = torch.where(chosen, local, 0)
    tokens = torch.empty(B, N, dtype=torch.int64, device=dev)
    parents = torch.empty(B, N, dtype=torch.int32, device=dev)
    pos = torch.empty(B, N, dtype=torch.int64, device=dev)
    words = torch.empty(B, N, (N + 31) // 32, dtype=torch.int32, device=dev)
    # tokens are only copied by build_tree (never read as indices): uninitialised ones cost no launch
    torch.ops.eagle3.build_tree(torch.empty(B, dtype=torch.int64, device=dev),
                                torch.empty(B, depth, M, dtype=torch.int64, device=dev), scores, parents_in,
                                verified_seq_len.int(), tokens, parents, pos, words)

    positions.view(B, N).copy_(pos)
    retrive_index.copy_(torch.arange(B * N, device=dev).view(B, N))
    first_child, next_sibling = tree.children_links(parents)
    retrive_next_token.copy_(torch.where(first_child >= 0, first_child.long(), retrive_next_token))
    retrive_next_sibling.copy_(torch.where(next_sibling >= 0, next_sibling.long(), retrive_next_sibling))
    mask_bytes = words.view(torch.uint8).view(B * N, -1)  # little-endian: byte k holds nodes 8k .. 8k + 7
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        out = tree_mask.view(torch.uint8).view(B * N, nb)
        out[:, 0] = mask_bytes[:, 0]
        if nb > 1:
            out[:, 1:] |= mask_bytes[:, 1:nb]
        return
    rows = _unpack(mask_bytes, N)  # [B * N, N] bool: the output's own values
    if mode == TreeMaskMode.QLEN_ONLY:
        tree_mask.view(B * N, N).copy_(rows)
        return
    # FULL_MASK: row (b, i) of the draft block starts at N*N*b + N*sum(seq[:b]) + (seq[b] + N)*i + seq[b].
    seq = verified_seq_len.long()
    start = N * N * torch.arange(B, device=dev) + N * (torch.cumsum(seq, 0) - seq) + seq
    start = (start[:, None] + (seq[:, None] + N) * torch.arange(N, device=dev)).view(B * N, 1)
    idx = start + torch.arange(N, device=dev)
    flat = tree_mask.view(-1)
    inside = idx < flat.numel()
    # a row past a short buffer is written to element 0 instead, with the value element 0 gets anyway
    # (True if it is row (0, 0)'s root entry, else its own value): never outside, never a second value
    keep = flat[:1] | (seq[:1] == 0)
    flat.index_put_((torch.where(inside, idx, 0),), torch.where(inside, rows, keep))


def _unpack(mask_bytes: Tensor, N: int) -> Tensor:
    """[R, nbytes] uint8 little-endian bit rows -> [R, N] bool."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask_bytes.device)
    return ((mask_bytes[:, :, None] >> shifts) & 1).view(mask_bytes.shape[0], -1)[:, :N].bool()


# ---- the walks: SGLang's lists -> parents, then our verify_greedy on per-node flags ------------------------


class _Lists:
    """SGLang's linked lists of one batch as parents (pointer doubling, no sync).

    parent[b, c]: the node whose first-child link reaches c, or, through next-sibling links, that of the
    head of c's sibling chain; -1 when nothing links to c. ok[b, c]: c hangs from the root through parents
    that each precede their child (what our verify_greedy walks). left[b, c]: c's previous sibling (N: none).
    """

    def __init__(self, next_token: Tensor, next_sibling: Tensor, op: str):
        B, N = next_token.shape
        dev = next_token.device
        self.B, self.N, self.rounds = B, N, max(N, 2).bit_length()
        idx = torch.arange(N, device=dev).expand(B, N)
        via_token, self.left = self._incoming(next_token, idx), self._incoming(next_sibling, idx)
        head = self._pad(torch.where(self.left < N, self.left, idx), N)   # chase left siblings to the head
        for _ in range(self.rounds):
            head = head.gather(1, head)
        parent = self._pad(torch.where(via_token < N, via_token, -1), -1).gather(1, head)[:, :N]
        if next_token.device.type == "cpu":
            bad = (parent >= idx) & (idx > 0)
            if bool(bad.any()):
                b, c = (int(v) for v in bad.nonzero()[0])
                raise ValueError(f"{op}: node {c} of request {b} hangs from node {int(parent[b, c])}: the lists must "
                                 f"put every parent before its children (retrive_next_token / retrive_next_sibling)")
        # up[c]: the parent while it precedes c; the root points at itself, everything else at a sink N
        up = self._pad(torch.where((parent >= 0) & (parent < idx), parent, torch.where(idx == 0, 0, N)), N)
        for _ in range(self.rounds):
            up = up.gather(1, up)
        self.ok = (up[:, :N] == 0) & (idx > 0)
        self.parent = torch.where(self.ok, parent, torch.where(idx == 0, -1, 0))

    @staticmethod
    def _incoming(link: Tensor, idx: Tensor) -> Tensor:
        """inc[b, c] = the node whose link points at c (N: none); links outside [0, N) are ignored."""
        B, N = link.shape
        inc = torch.full((B, N + 1), N, dtype=torch.int64, device=link.device)
        inc.scatter_(1, torch.where((link >= 0) & (link < N), link, N), idx)
        return inc[:, :N]

    @staticmethod
    def _pad(t: Tensor, value: int) -> Tensor:
        """[B, N] -> [B, N + 1] with column N = value (the sink, or N pointing at itself)."""
        return torch.cat([t, torch.full_like(t[:, :1], value)], 1)

    def scan(self, x: Tensor, combine) -> Tensor:
        """Inclusive scan of x [B, N] along every sibling chain in list order (pointer doubling); the
        identity of `combine` must be x's zero."""
        acc, ptr = self._pad(x, 0), self._pad(self.left, self.N)
        for _ in range(self.rounds):
            acc, ptr = combine(acc, acc.gather(1, ptr)), ptr.gather(1, ptr)
        return acc[:, :self.N]

    def first_in_list(self, flag: Tensor) -> Tensor:
        """flag & no earlier sibling (in list order) has flag."""
        seen = self._pad(self.scan(flag, torch.logical_or), False)
        return flag & ~seen.gather(1, self.left)

    def walk(self, take: Tensor) -> tuple[Tensor, Tensor]:
        """The path that takes, at every node, its child flagged in `take` (at most one per node):
        torch.ops.eagle3.verify_greedy on [B * N, 1] logits, token 0 where flagged, 1 elsewhere."""
        B, N = self.B, self.N
        logits = torch.zeros(B * N, 1, device=take.device)
        tokens = torch.where(take & self.ok, 0, 1)
        nodes, accept_len, _ = torch.ops.eagle3.verify_greedy(logits, tokens, self.parent.int())
        return nodes, accept_len


def _check_walk_args(op, predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                     retrive_next_sibling) -> tuple[int, int, int]:
    _t(candidates, "candidates", I64, candidates, dim=2)
    B, N = candidates.shape
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        _t(t, name, I64, candidates, shape=(("B", B), ("N", N)))
    _t(predicts, "predicts", I32, candidates, dim=1)
    if predicts.shape[0] < B * N:
        raise ValueError(f"predicts must have at least B * N = {B * N} entries (SGLang allocates B * N + 1), "
                         f"got {tuple(predicts.shape)}")
    _t(accept_index, "accept_index", I32, candidates, dim=2)
    if accept_index.shape[0] != B or accept_index.shape[1] < 1:
        raise ValueError(f"accept_index must have shape (B, S) with B = {B}, S >= 1, got {tuple(accept_index.shape)}")
    _t(accept_token_num, "accept_token_num", I32, candidates, shape=(("B", B),))
    if candidates.device.type == "cpu":
        check_range(retrive_index, 0, B * N - 1, op, "retrive_index")
    return B, N, accept_index.shape[1]


def _write_walk(lists: _Lists, take: Tensor, retrive_index: Tensor, accept_index: Tensor, accept_token_num: Tensor):
    """Run the walk, write accept_index / accept_token_num (capped at S - 1 drafts as SGLang's loop is), and
    return (nodes [B, S'] on the path, rows r_k = retrive_index there, count L, capped)."""
    S = accept_index.shape[1]
    nodes, accept_len = lists.walk(take)
    L = torch.clamp(accept_len, max=S - 1)
    W = min(S, lists.N)
    nodes = nodes[:, :W].long()
    k = torch.arange(W, device=nodes.device)
    on_path = k <= L[:, None]
    rows = retrive_index.gather(1, nodes.clamp(min=0)).clamp(0, lists.B * lists.N - 1)
    accept_index[:, :W] = torch.where(on_path, rows.int(), accept_index[:, :W])
    accept_token_num.copy_(L)
    return nodes, rows, L, on_path


def _scatter_path(predicts: Tensor, rows: Tensor, L: Tensor, on_path: Tensor, values: Tensor) -> None:
    """predicts[rows[b, k]] = values[b, k] for k <= L[b]; the other entries go to rows[b, L] with its value."""
    last = rows.gather(1, L[:, None].long())
    last_v = values.gather(1, L[:, None].long())
    predicts.scatter_(0, torch.where(on_path, rows, last).view(-1),
                      torch.where(on_path, values, last_v).int().view(-1))


def _retrieve_names(fn):
    """Also take the lists by the ``retrieve_*`` keywords (sgl-kernel's tests and some releases spell them so)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if kwargs:
            for name in ("index", "next_token", "next_sibling"):
                if f"retrieve_{name}" in kwargs:
                    kwargs[f"retrive_{name}"] = kwargs.pop(f"retrieve_{name}")
        return fn(*args, **kwargs)
    return call


@_retrieve_names
def verify_tree_greedy(predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor, candidates: Tensor,
                       retrive_index: Tensor, retrive_next_token: Tensor, retrive_next_sibling: Tensor,
                       target_predict: Tensor) -> None:
    """sgl_kernel.verify_tree_greedy: from the root, follow the child whose token is the target's argmax.

    At the last accepted node (flat row r = its retrive_index), its children are tried in list order
    (retrive_next_token, then retrive_next_sibling); the first whose candidate equals
    target_predict.view(-1)[r] is accepted, for at most S - 1 accepted drafts.

    Parameters
    ----------
    predicts : Tensor [P >= B * N] int32, mutated
        predicts[r] = target_predict.view(-1)[r] at every row r on the accepted path (root and bonus
        included); other entries (SGLang's extra last entry among them) are left as they are.
    accept_index : Tensor [B, S] int32, mutated
        Flat rows of the root and the accepted nodes; entries past accept_token_num left as they are.
    accept_token_num : Tensor [B] int32, mutated
        Accepted draft tokens, bonus excluded: the step emits accept_token_num + 1 tokens.
    candidates : Tensor [B, N] int64
        Draft token per node (node 0: the verified token).
    retrive_index : Tensor [B, N] int64
        Flat row of each node, in [0, B * N) (build_tree_kernel_efficient writes b * N + i).
    retrive_next_token, retrive_next_sibling : Tensor [B, N] int64
        First child / next sibling per node, -1 for none; each parent before its children.
    target_predict : Tensor [B, N] int64
        Target argmax per flat row.

    Bad values: on CPU a retrive_index outside [0, B * N) raises Eagle3InputError and lists that hang a
    node from a later one raise ValueError, before anything is written; on CUDA such rows are clamped and
    such nodes never accepted. Nodes no link reaches are never accepted (as in SGLang).
    """
    if kernels == "auto" and isinstance(candidates, Tensor) and candidates.is_cuda:
        op = _cuda_ops().verify_greedy
        if op is not None:
            try:
                return op(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                          retrive_next_sibling, target_predict)
            except NotImplementedError:  # past the C++ kernel's limits: the Triton / tensor-op path below
                pass
    B, N, S = _check_walk_args("verify_tree_greedy", predicts, accept_index, accept_token_num, candidates,
                               retrive_index, retrive_next_token, retrive_next_sibling)
    _t(target_predict, "target_predict", I64, candidates, shape=(("B", B), ("N", N)))
    if B == 0:
        return
    if _kernels(candidates) and _k().fits(N):
        if candidates.device.type == "cpu":  # what the tensor path refuses here, the kernel path refuses too
            _Lists(retrive_next_token, retrive_next_sibling, "verify_tree_greedy")
        _k().verify_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict)
        return
    lists = _Lists(retrive_next_token, retrive_next_sibling, "verify_tree_greedy")
    target = target_predict.view(-1)
    parent_row = retrive_index.gather(1, lists.parent.clamp(min=0)).clamp(0, B * N - 1)
    match = candidates == target[parent_row]
    nodes, rows, L, on_path = _write_walk(lists, lists.first_in_list(match), retrive_index, accept_index,
                                          accept_token_num)
    _scatter_path(predicts, rows, L, on_path, target[rows])


@_retrieve_names
def tree_speculative_sampling_target_only(predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor,
                                          candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                                          retrive_next_sibling: Tensor, uniform_samples: Tensor,
                                          uniform_samples_for_final_sampling: Tensor, target_probs: Tensor,
                                          draft_probs: Optional[Tensor] = None, threshold_single: float = 1.0,
                                          threshold_acc: float = 1.0, deterministic: bool = True) -> None:
    """sgl_kernel.tree_speculative_sampling_target_only: SGLang's tree sampling with its coins, in place.

    At the last accepted node c (local index; row b * N + c of target_probs), with coin
    u = uniform_samples[b, c], the children are tried in list order, summing their target probabilities
    p(x) as it goes; the first child with u <= sum / max(threshold_acc, 1e-9) or p(x) >= threshold_single is
    accepted (predicts[row of c] = its token) and becomes c, for at most S - 1 drafts. Each child tried
    and rejected sets draft_probs[row of c, x] = p(x). The bonus token is drawn from
    relu(target_probs[c] - draft_probs[c]) (from target_probs[c] alone when S - 1 drafts were accepted) by
    inverse CDF with uniform_samples_for_final_sampling[b] (the last token when the draw falls past the
    mass), into predicts[row of c]. With both thresholds 1 this samples exactly from target_probs.

    Parameters
    ----------
    predicts, accept_index, accept_token_num : as verify_tree_greedy's (int32, mutated)
    candidates, retrive_index, retrive_next_token, retrive_next_sibling : as verify_tree_greedy's
    uniform_samples : Tensor [B, N] fp32
        A coin per node, used at that node.
    uniform_samples_for_final_sampling : Tensor [B] fp32
    target_probs : Tensor [B, N, V] (or [B * N, V]) fp32
        Target probabilities per node (temperature, top-k / top-p applied).
    draft_probs : Tensor like target_probs fp32, mutated; optional
        Subtracted at the final draw, and written at rejected tokens (SGLang's caller passes zeros). None:
        treated as zeros and nothing is written. The newest sgl-kernel has no draft_probs: a number here is
        taken as its positional threshold_single (and the next two as threshold_acc, deterministic).
    threshold_single, threshold_acc : float
    deterministic : bool
        Accepted for SGLang's signature: this implementation is always deterministic.

    The children's sums and the bonus's running mass are formed in fp64 and rounded to fp32 on every device
    and path (the tensor ops, the Triton kernels, the C++ op), in another order than SGLang's sequential
    fp32 sum, so a coin within a rounding step of a boundary may go the other way. Bad values: as
    verify_tree_greedy's, and on CPU a candidate outside [0, V) at any node the lists reach raises
    Eagle3InputError; on CUDA its probability reads as 0.
    """
    if isinstance(draft_probs, (int, float)):  # the newest release's positional (..., threshold_single, ...)
        draft_probs, threshold_single, threshold_acc, deterministic = None, draft_probs, threshold_single, threshold_acc
    if kernels == "auto" and isinstance(candidates, Tensor) and candidates.is_cuda:
        op = _cuda_ops().verify_sampling
        if op is not None:
            try:
                return op(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                          retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                          draft_probs, float(threshold_single), float(threshold_acc))
            except NotImplementedError:  # past the C++ kernels' limits: the Triton / tensor-op path below
                pass
    B, N, S = _check_walk_args("tree_speculative_sampling_target_only", predicts, accept_index, accept_token_num,
                               candidates, retrive_index, retrive_next_token, retrive_next_sibling)
    _t(uniform_samples, "uniform_samples", (torch.float32,), candidates, shape=(("B", B), ("N", N)))
    _t(uniform_samples_for_final_sampling, "uniform_samples_for_final_sampling", (torch.float32,), candidates,
       shape=(("B", B),))
    _t(target_probs, "target_probs", (torch.float32,), candidates)
    if target_probs.dim() not in (2, 3) or target_probs.shape[:-1] not in ((B, N), (B * N,)):
        raise ValueError(f"target_probs must have shape (B, N, V) or (B * N, V) with B = {B}, N = {N}, "
                         f"got {tuple(target_probs.shape)}")
    V = target_probs.shape[-1]
    if V < 1:
        raise ValueError("target_probs must have V >= 1")
    if draft_probs is not None:
        _t(draft_probs, "draft_probs", (torch.float32,), candidates,
           shape=(("B", B), ("N", N), ("V", V)) if target_probs.dim() == 3 else (("B * N", B * N), ("V", V)))
    if B == 0:
        return
    if candidates.device.type == "cpu":
        lists = _Lists(retrive_next_token, retrive_next_sibling, "tree_speculative_sampling_target_only")
        check_range(torch.where(lists.ok, candidates, 0), 0, V - 1, "tree_speculative_sampling_target_only",
                    "candidates")
    if _kernels(candidates) and _k().fits(N):
        _k().verify_sampling(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                             retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling,
                             target_probs, draft_probs, float(threshold_single), max(float(threshold_acc), 1e-9))
        return
    if candidates.device.type != "cpu":
        lists = _Lists(retrive_next_token, retrive_next_sibling, "tree_speculative_sampling_target_only")
    dev = candidates.device
    probs = target_probs.view(B * N, V)
    parent_row = lists.parent.clamp(min=0) + N * torch.arange(B, device=dev)[:, None]     # local rows
    tok = candidates.clamp(0, V - 1)
    p = torch.where((candidates >= 0) & (candidates < V), probs[parent_row, tok], 0.0)  # [B, N]
    # inclusive sum of p along each sibling chain, in list order (pointer doubling)
    acc = lists.scan(p.double(), torch.add).float()
    coin = uniform_samples.gather(1, lists.parent.clamp(min=0))
    passes = (coin <= acc / max(float(threshold_acc), 1e-9)) | (p >= float(threshold_single))
    take = lists.first_in_list(passes & lists.ok)
    nodes, rows, L, on_path = _write_walk(lists, take, retrive_index, accept_index, accept_token_num)

    # children tried and rejected: below a path node, before the child taken there (all of them at the last
    # node unless the walk stopped at S - 1 drafts)
    W = nodes.shape[1]
    capped = L == S - 1
    depth_of = torch.full((B, N + 1), -1, dtype=torch.int64, device=dev)
    depth_of.scatter_(1, torch.where(on_path, nodes, N), torch.arange(W, device=dev).expand(B, W))
    k_par = depth_of.gather(1, lists.parent.clamp(min=0))[:, :N]
    visited = lists.ok & (k_par >= 0) & ((k_par < L[:, None]) | ~capped[:, None])
    rejected = visited & ~lists.scan(take, torch.logical_or)        # not the taken child, nor after it
    last_row = nodes.gather(1, L[:, None].long()).squeeze(1) + N * torch.arange(B, device=dev)
    if draft_probs is not None:
        flat = draft_probs.view(-1)
        at = parent_row * V + tok
        # SGLang's draft_probs[row, x] = p(x) at every rejected child, and nothing else written: the rejected
        # entries' p scattered (-inf where no rejected entry lands), then the original put back there (a
        # node that is not rejected may share its (row, token) with one that is)
        orig = flat[at].view(-1)
        flat.scatter_reduce_(0, at.view(-1), torch.where(rejected, p, float("-inf")).view(-1), "amax",
                             include_self=False)
        flat.scatter_(0, at.view(-1), torch.where(flat[at].view(-1) == float("-inf"), orig, flat[at].view(-1)))
        q = draft_probs.view(B * N, V)[last_row]
    else:
        q = torch.zeros(B, V, device=dev)
        at_last = rejected & (parent_row == last_row[:, None])
        q.scatter_reduce_(1, tok, torch.where(at_last, p, 0.0), "amax")
    q = torch.where(capped[:, None], 0.0, q)
    w = (probs[last_row] - q).clamp(min=0)
    # the running mass summed in fp64, each prefix rounded to fp32 (the kernels' rule): torch.cumsum of fp32
    # accumulates in fp64 on CPU but in fp32 on CUDA, whose error over V = 163840 moved the draw a few tokens
    # past zero-mass ones in about 1 of 250 rows there
    cdf = torch.cumsum(w, -1, dtype=torch.float64).float()
    u = (uniform_samples_for_final_sampling * cdf[:, -1])[:, None]
    bonus = torch.searchsorted(cdf, u, right=True).clamp(max=V - 1).squeeze(1)

    # predicts: the taken child's token at each path row but the last, the bonus there
    nxt = torch.cat([nodes[:, 1:], nodes[:, :1]], 1).clamp(min=0)
    k = torch.arange(W, device=dev)
    values = torch.where(k < L[:, None], candidates.gather(1, nxt), bonus[:, None])
    _scatter_path(predicts, rows, L, on_path, values)


# ---- layout conversions ---------------------------------------------------------------------------------


def segment_packbits(x: Tensor, input_indptr: Tensor, output_indptr: Tensor, y: Tensor, batch_size: int) -> None:
    """sgl_kernel.segment_packbits: pack each segment of a bool array into bytes, little bit order.

    Segment s is x[input_indptr[s]:input_indptr[s + 1]]; its bits go to y[output_indptr[s]:output_indptr[s + 1]]
    (ceil(length / 8) bytes), bit k of byte j = x[input_indptr[s] + 8 j + k], bits past the segment 0.
    Bytes of y outside every output segment are left as they are.

    Parameters
    ----------
    x : Tensor [L] bool
    input_indptr, output_indptr : Tensor [batch_size + 1] int32
        Nondecreasing offsets into x and y.
    y : Tensor [Y] uint8, mutated
    batch_size : int

    Bad values: on CPU offsets outside x / y raise Eagle3InputError before anything is written; on CUDA
    bits outside x read as 0 and bytes past y are not written.
    """
    if kernels == "auto" and isinstance(x, Tensor) and x.is_cuda:
        op = _cuda_ops().segment_packbits
        if op is not None:
            try:
                return op(x, input_indptr, output_indptr, y, int(batch_size))
            except NotImplementedError:  # past the C++ kernel's limits: the Triton / tensor-op path below
                pass
    _t(x, "x", (torch.bool,), x, dim=1)
    n = int(batch_size)
    _t(input_indptr, "input_indptr", I32, x, shape=(("batch_size + 1", n + 1),))
    _t(output_indptr, "output_indptr", I32, x, shape=(("batch_size + 1", n + 1),))
    _t(y, "y", (torch.uint8,), x, dim=1)
    if x.device.type == "cpu":
        check_range(input_indptr, 0, x.numel(), "segment_packbits", "input_indptr")
        check_range(output_indptr, 0, y.numel(), "segment_packbits", "output_indptr")
    if n == 0 or y.numel() == 0:
        return
    if _kernels(x):
        _k().segment_packbits(x, input_indptr, output_indptr, y, n)
        return
    out_ptr, in_ptr = output_indptr.long(), input_indptr.long()
    t = torch.arange(y.numel(), device=y.device)
    s = (torch.searchsorted(out_ptr, t, right=True) - 1).clamp(0, n - 1)
    inside = (t >= out_ptr[s]) & (t < out_ptr[s + 1])
    bit = (in_ptr[s] + 8 * (t - out_ptr[s]))[:, None] + torch.arange(8, device=y.device)
    ok = (bit < in_ptr[s + 1][:, None]) & (bit < x.numel())
    bits = torch.where(ok, x.view(torch.uint8)[bit.clamp(0, max(x.numel() - 1, 0))], 0) if x.numel() else \
        torch.zeros_like(bit, dtype=torch.uint8)
    byte = (bits.to(torch.uint8) << torch.arange(8, dtype=torch.uint8, device=y.device)).sum(-1, dtype=torch.uint8)
    y.copy_(torch.where(inside, byte, y))


def reconstruct_indices_from_tree_mask(tree_mask: Tensor, verified_seq_len: Tensor, positions: Tensor,
                                       retrive_index: Tensor, retrive_next_token: Tensor,
                                       retrive_next_sibling: Tensor, batch_size: int, draft_token_num: int) -> None:
    """sgl_kernel.reconstruct_indices_from_tree_mask: a QLEN_ONLY tree mask -> positions and SGLang's lists.

    For node i of request b (row m = tree_mask.view(B, N, N)[b, i]): depth = number of set m[j], j < i;
    parent = the largest such j (-1 for none); positions = verified_seq_len[b] + depth; retrive_index =
    b * N + i; retrive_next_token = the smallest k > i whose row has bit i; retrive_next_sibling = the
    smallest k > i with the same parent (-1 for none, and for a node without parent). Every element written.

    Parameters
    ----------
    tree_mask : Tensor [B * N * N] bool (any shape of that size)
    verified_seq_len : Tensor [B] int64 | int32
    positions : Tensor [B * N] or [B, N] int64 | int32, mutated
    retrive_index, retrive_next_token, retrive_next_sibling : Tensor [B, N] int64 | int32, mutated
    batch_size, draft_token_num : int
        B, N.

    The input is [B, N, N]; the comparisons here are too (no native op behind this conversion); on CUDA one
    block per request (the C++ op: N <= 12288; the Triton kernel: N <= 256; larger N take the tensor ops).
    """
    if kernels == "auto" and isinstance(tree_mask, Tensor) and tree_mask.is_cuda:
        op = _cuda_ops().reconstruct_indices
        if op is not None:
            try:
                return op(tree_mask, verified_seq_len, positions, retrive_index, retrive_next_token,
                          retrive_next_sibling, int(batch_size), int(draft_token_num))
            except NotImplementedError:  # past the C++ kernel's limits: the Triton / tensor-op path below
                pass
    B, N = int(batch_size), int(draft_token_num)
    _t(tree_mask, "tree_mask", (torch.bool,), tree_mask)
    _numel(tree_mask, "tree_mask", B * N * N, "batch_size * draft_token_num**2")
    _t(verified_seq_len, "verified_seq_len", I64 + I32, tree_mask, shape=(("B", B),))
    _t(positions, "positions", I64 + I32, tree_mask)
    _numel(positions, "positions", B * N, "B * N", [(B * N,), (B, N)])
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        _t(t, name, I64 + I32, tree_mask, shape=(("B", B), ("N", N)))
    if B == 0 or N == 0:
        return
    if _kernels(tree_mask) and _k().fits(N):
        _k().reconstruct(tree_mask, verified_seq_len, positions, retrive_index, retrive_next_token,
                         retrive_next_sibling, B, N)
        return
    dev = tree_mask.device
    m = tree_mask.view(B, N, N)
    j = torch.arange(N, device=dev)
    below = m & (j[None, :] < j[:, None])                                    # [i, j]: j < i
    depth = below.sum(-1)
    parent = torch.where(below, j, -1).amax(-1)
    later = m.transpose(1, 2) & (j[None, :] > j[:, None])                    # [i, k]: row k > i has bit i
    first = torch.where(later, j, N).amin(-1)
    sorted_par, order = torch.sort(parent, dim=1, stable=True)
    same = (sorted_par[:, 1:] == sorted_par[:, :-1]) & (sorted_par[:, 1:] >= 0)
    sib = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    sib.scatter_(1, order[:, :-1], torch.where(same, order[:, 1:], -1))
    positions.view(B, N).copy_(verified_seq_len.long()[:, None] + depth)
    retrive_index.copy_(torch.arange(B * N, device=dev).view(B, N))
    retrive_next_token.copy_(torch.where(first < N, first, -1))
    retrive_next_sibling.copy_(sib)
