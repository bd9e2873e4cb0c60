"""Draft trees: the canonical form, what is derived from it, and SGLang's linked-list form.

Canonical tree. Per request, N nodes in topological order (a parent's index is smaller than its
children's); node 0 is the root (the last verified token). ``tokens [B, N] int64`` holds each node's
token, ``parents [B, N] int32`` each node's parent (-1 for the root, and only for the root).
Siblings are ordered by draft score: the lower index has the higher score and is tried first.

Derived (no host sync, CUDA-graph safe): ``depth [B, N] int32`` (root 0), ``positions = prefix_len +
depth``, and the ancestor-or-self mask ``tree_mask [B, N, W] int32`` with ``W = ceil(N / 32)``: bit
``j % 32`` of word ``j // 32`` of row i is set iff node j is i or an ancestor of i. Bit 31 makes an
int32 word negative; words are exact two's-complement bit patterns. Viewed as little-endian bytes,
a row equals SGLang's QLEN_ONLY_BITPACKING mask row (which exists for N <= 32 only).

SGLang's form (sgl-kernel/csrc/speculative/eagle_utils.cu, ``build_tree_efficient`` and
``verify_tree_greedy``; python/sglang/srt/speculative/build_eagle_tree.py), all int64:
``draft_tokens [B * N]`` node-major per request, with the root (the verified token) at ``b * N``;
``retrive_index [B, N] = b * N + i`` (a node's row in the flat ``[B * N]`` logits); and two
linked lists of local node indices, -1 terminated: ``retrive_next_token[b, i]`` = the first child
of i, ``retrive_next_sibling[b, i]`` = the next sibling of i. SGLang's kernel visits nodes from
N - 1 down to 1 and pushes each onto the front of its parent's list, so the head is the child with
the smallest index and siblings are linked in ascending index order: the same order as ours
(``children_links``), and verify_tree_greedy tries the highest-scored child first. The root's
sibling is always -1.
"""

import torch
from torch import Tensor

__all__ = [
    "validate", "depth", "positions", "tree_mask", "mask_to_dense", "dense_to_mask",
    "children_links", "chain_parents", "random_parents", "to_sglang", "from_sglang",
]


def _check(t, name: str, dtype: torch.dtype, rank: int) -> None:
    """Cheap metadata checks (no host sync)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")


def _check_parents(parents: Tensor) -> None:
    _check(parents, "parents", torch.int32, 2)
    if parents.shape[1] < 1:
        raise ValueError(f"parents must have N >= 1 (the root), got shape {tuple(parents.shape)}")


def _first(bad: Tensor) -> list:
    """Indices of the first True element (syncs; for error messages only)."""
    return bad.nonzero()[0].tolist()


def _jumps(n: int) -> int:
    """Pointer-doubling rounds that cover a depth of n - 1: the smallest r with 2**r >= n - 1."""
    return max(n - 2, 0).bit_length()


def _parent_or_self(parents: Tensor) -> Tensor:
    """parents as int64 gather indices, with the root pointing at itself."""
    p = parents.long()
    return torch.where(p < 0, torch.arange(p.shape[1], device=p.device), p)


def validate(tokens: Tensor, parents: Tensor) -> None:
    """Check that (tokens, parents) is a canonical tree; raise naming the bad argument. Syncs.

    Parameters
    ----------
    tokens : Tensor [B, N] int64
        Draft token per node, >= 0; node 0 is the root.
    parents : Tensor [B, N] int32
        Parent index per node: -1 for the root (node 0) only, else ``0 <= parents[b, j] < j``.
    """
    _check(tokens, "tokens", torch.int64, 2)
    _check_parents(parents)
    if tokens.shape != parents.shape:
        raise ValueError(f"tokens and parents must have the same shape [B, N], "
                         f"got {tuple(tokens.shape)} and {tuple(parents.shape)}")
    if tokens.device != parents.device:
        raise ValueError(f"tokens and parents must be on one device, "
                         f"got {tokens.device} and {parents.device}")
    if (tokens < 0).any():
        raise ValueError(f"tokens must be >= 0, first bad at [b, j] = {_first(tokens < 0)}")
    if (parents[:, 0] != -1).any():
        raise ValueError(f"parents[:, 0] must be -1 (node 0 is the root), "
                         f"first bad request b = {_first(parents[:, 0] != -1)[0]}")
    if (parents[:, 1:] == -1).any():
        b, j = _first(parents[:, 1:] == -1)
        raise ValueError(f"parents must be -1 only at the root, got parents[{b}, {j + 1}] = -1")
    j = torch.arange(parents.shape[1], device=parents.device, dtype=torch.int32)
    bad = (parents >= j) | (parents < -1)
    if bad.any():
        b, j = _first(bad)
        raise ValueError(f"parents must be topological: parents[b, j] < j (and >= 0 off the "
                         f"root), got parents[{b}, {j}] = {parents[b, j].item()}")


def depth(parents: Tensor) -> Tensor:
    """Depth of every node (root 0), by pointer doubling: ceil(log2(N - 1)) rounds, no sync.

    Parameters
    ----------
    parents : Tensor [B, N] int32
        Canonical parents (-1 for the root).

    Returns
    -------
    depth : Tensor [B, N] int32
    """
    _check_parents(parents)
    p = _parent_or_self(parents)
    d = (parents >= 0).int()  # distance to p: 1, or 0 at the root
    for _ in range(_jumps(parents.shape[1])):
        d, p = d + d.gather(1, p), p.gather(1, p)
    return d


def positions(parents: Tensor, prefix_lens: Tensor) -> Tensor:
    """Position of every node: prefix_lens[b] + depth[b, j].

    Parameters
    ----------
    parents : Tensor [B, N] int32
        Canonical parents.
    prefix_lens : Tensor [B] int32
        Tokens already in the cache per request (the root sits at position prefix_lens).

    Returns
    -------
    positions : Tensor [B, N] int64
    """
    _check(prefix_lens, "prefix_lens", torch.int32, 1)
    if prefix_lens.shape[0] != parents.shape[0]:
        raise ValueError(f"prefix_lens must have shape [B] = [{parents.shape[0]}], "
                         f"got {tuple(prefix_lens.shape)}")
    return prefix_lens.long()[:, None] + depth(parents)


def _ancestors(parents: Tensor) -> Tensor:
    """Dense ancestor-or-self relation [B, N, N] bool, by pointer doubling over rows."""
    B, N = parents.shape
    p = _parent_or_self(parents)
    anc = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N).clone()
    anc.scatter_(2, p[:, :, None], True)  # covers distance <= 1
    for _ in range(_jumps(N)):  # row i |= row of its 2**k-th ancestor: covers distance <= 2**(k+1)
        anc |= anc.gather(1, p[:, :, None].expand(B, N, N))
        p = p.gather(1, p)
    return anc


def tree_mask(parents: Tensor) -> Tensor:
    """Ancestor-or-self bit mask over the draft block, no sync.

    Parameters
    ----------
    parents : Tensor [B, N] int32
        Canonical parents.

    Returns
    -------
    tree_mask : Tensor [B, N, W] int32, W = ceil(N / 32)
        Bit j % 32 of word j // 32 of row i is set iff node j is i or an ancestor of i.
    """
    _check_parents(parents)
    return dense_to_mask(_ancestors(parents))


def dense_to_mask(dense: Tensor) -> Tensor:
    """Pack a dense [B, N, N] bool mask into int32 words (the inverse of mask_to_dense).

    Parameters
    ----------
    dense : Tensor [B, N, N] bool
        dense[b, i, j] is True iff row i sees node j.

    Returns
    -------
    tree_mask : Tensor [B, N, W] int32, W = ceil(N / 32)
    """
    _check(dense, "dense", torch.bool, 3)
    B, N, N2 = dense.shape
    if N2 != N:
        raise ValueError(f"dense must have shape [B, N, N], got {tuple(dense.shape)}")
    W = (N + 31) // 32
    bits = torch.nn.functional.pad(dense.long(), (0, W * 32 - N)).view(B, N, W, 32)
    weights = 1 << torch.arange(32, device=dense.device, dtype=torch.int64)
    words = (bits * weights).sum(-1)  # in [0, 2**32): wrap into int32's two's complement
    return torch.where(words >= 2**31, words - 2**32, words).int()


def mask_to_dense(tree_mask: Tensor, N: int) -> Tensor:
    """Unpack int32 mask words into a dense [B, N, N] bool mask.

    Parameters
    ----------
    tree_mask : Tensor [B, N, W] int32, W = ceil(N / 32)
        Bit j % 32 of word j // 32 of row i.
    N : int
        Nodes per request.

    Returns
    -------
    dense : Tensor [B, N, N] bool
    """
    _check(tree_mask, "tree_mask", torch.int32, 3)
    B, rows, W = tree_mask.shape
    if rows != N or W != (N + 31) // 32:
        raise ValueError(f"tree_mask must have shape (B, N, ceil(N / 32)) = (B, {N}, "
                         f"{(N + 31) // 32}), got {tuple(tree_mask.shape)}")
    # Shifts below 32 of the sign-extended word read its 32 bits exactly, bit 31 included.
    shifts = torch.arange(32, device=tree_mask.device, dtype=torch.int64)
    bits = (tree_mask.long()[..., None] >> shifts) & 1
    return bits.reshape(B, N, W * 32)[..., :N].bool()


def children_links(parents: Tensor) -> tuple[Tensor, Tensor]:
    """First child and next sibling of every node, siblings in ascending index order. No sync.

    Parameters
    ----------
    parents : Tensor [B, N] int32
        Canonical parents.

    Returns
    -------
    first_child : Tensor [B, N] int32
        Smallest-index (highest-scored) child, -1 for a leaf.
    next_sibling : Tensor [B, N] int32
        Smallest sibling index greater than the node's own, -1 for the last (and for the root).
    """
    _check_parents(parents)
    B, N = parents.shape
    idx = torch.arange(N, device=parents.device).expand(B, N)
    # Column 0 collects the root (parent -1); column p + 1 the children of p.
    first = torch.full((B, N + 1), N, dtype=torch.int64, device=parents.device)
    first.scatter_reduce_(1, parents.long() + 1, idx, reduce="amin")
    first_child = first[:, 1:].masked_fill(first[:, 1:] == N, -1)
    # A stable sort by parent groups siblings together, each group in ascending index order.
    sorted_parents, order = torch.sort(parents, dim=1, stable=True)
    same = sorted_parents[:, 1:] == sorted_parents[:, :-1]
    next_sibling = torch.full((B, N), -1, dtype=torch.int64, device=parents.device)
    next_sibling.scatter_(1, order[:, :-1], torch.where(same, order[:, 1:], -1))
    return first_child.int(), next_sibling.int()


def chain_parents(B: int, N: int, device=None) -> Tensor:
    """A chain per request: parents[b, j] = j - 1 (-1 at the root), as Tensor [B, N] int32."""
    return torch.arange(-1, N - 1, dtype=torch.int32, device=device).expand(B, N).contiguous()


def random_parents(B: int, N: int, generator: torch.Generator, kind: str = "bushy", device=None,
                   *, topk: int = 4, max_depth: int = 6) -> Tensor:
    """A random valid canonical tree per request, for tests and benchmarks.

    Parameters
    ----------
    B, N : int
        Requests and nodes per request (N >= 1).
    generator : torch.Generator
        Source of randomness (values are drawn on its device, then moved to ``device``).
    kind : str
        "bushy": parent of j uniform in [0, j); "chain": parents[j] = j - 1; "wide": every node a
        child of the root; "beam" (EAGLE-like): parent uniform among earlier nodes with fewer
        than ``topk`` children and depth < ``max_depth`` (N - 1 must fit such a tree).

    Returns
    -------
    parents : Tensor [B, N] int32
    """
    if N < 1:
        raise ValueError(f"N must be >= 1 (the root), got {N}")
    gdev = generator.device
    j = torch.arange(N, device=gdev)
    if kind == "chain":
        return chain_parents(B, N, device=device)
    if kind == "wide":
        p = torch.zeros(B, N, dtype=torch.int64, device=gdev)
    elif kind == "bushy":
        u = torch.rand(B, N, generator=generator, dtype=torch.float64, device=gdev)
        p = torch.minimum((u * j).floor().long(), j - 1)
    elif kind == "beam":
        if N - 1 > sum(topk**d for d in range(1, max_depth + 1)):
            raise ValueError(f"N = {N} does not fit a beam tree of topk = {topk}, "
                             f"max_depth = {max_depth}")
        p = torch.zeros(B, N, dtype=torch.int64, device=gdev)
        d = torch.zeros(B, N, dtype=torch.int64, device=gdev)
        n_children = torch.zeros(B, N, dtype=torch.int64, device=gdev)
        for k in range(1, N):  # loop over nodes, vectorised over requests
            open_ = (j < k) & (n_children < topk) & (d < max_depth)
            u = torch.rand(B, N, generator=generator, device=gdev)
            p[:, k] = torch.where(open_, u, -1.0).argmax(1)
            d[:, k] = d.gather(1, p[:, k:k + 1]).squeeze(1) + 1
            n_children.scatter_add_(1, p[:, k:k + 1], torch.ones_like(p[:, k:k + 1]))
    else:
        raise ValueError(f"kind must be one of 'bushy', 'chain', 'wide', 'beam', got {kind!r}")
    p[:, 0] = -1
    return p.int().to(device)


def to_sglang(tokens: Tensor, parents: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Canonical tree -> SGLang's build_tree_efficient lists (module docstring). Syncs.

    Parameters
    ----------
    tokens : Tensor [B, N] int64
        Draft token per node; node 0 is the root.
    parents : Tensor [B, N] int32
        Canonical parents.

    Returns
    -------
    draft_tokens : Tensor [B * N] int64
        tokens flattened node-major per request.
    retrive_index : Tensor [B, N] int64
        b * N + i.
    retrive_next_token : Tensor [B, N] int64
        First (smallest-index) child, -1 for a leaf.
    retrive_next_sibling : Tensor [B, N] int64
        Next sibling in ascending index order, -1 for the last child and the root.
    """
    validate(tokens, parents)
    B, N = tokens.shape
    first_child, next_sibling = children_links(parents)
    retrive_index = torch.arange(B * N, device=tokens.device).view(B, N)
    return tokens.reshape(-1).clone(), retrive_index, first_child.long(), next_sibling.long()


def from_sglang(draft_tokens: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                retrive_next_sibling: Tensor) -> tuple[Tensor, Tensor]:
    """SGLang's lists -> canonical (tokens, parents); ValueError if they are not a tree. Syncs.

    Every non-root node must be reached by exactly one link, every link must point to a larger
    index (a child after its parent, siblings ascending), and nothing may point at the root. With
    all links forward there can be no cycle, and every node is reachable from the root.

    Parameters
    ----------
    draft_tokens : Tensor [B * N] int64
        Tokens node-major per request.
    retrive_index : Tensor [B, N] int64
        Must be b * N + i.
    retrive_next_token : Tensor [B, N] int64
        First child per node (local index), -1 for none.
    retrive_next_sibling : Tensor [B, N] int64
        Next sibling per node (local index), -1 for none.

    Returns
    -------
    tokens : Tensor [B, N] int64
    parents : Tensor [B, N] int32
    """
    _check(retrive_index, "retrive_index", torch.int64, 2)
    B, N = retrive_index.shape
    dev = retrive_index.device
    _check(draft_tokens, "draft_tokens", torch.int64, 1)
    if draft_tokens.shape[0] != B * N or draft_tokens.device != dev:
        raise ValueError(f"draft_tokens must have shape [B * N] = [{B * N}] on {dev}, "
                         f"got {tuple(draft_tokens.shape)} on {draft_tokens.device}")
    if not torch.equal(retrive_index, torch.arange(B * N, device=dev).view(B, N)):
        raise ValueError("retrive_index must be b * N + i (as SGLang's build_tree lays it out)")
    idx = torch.arange(N, device=dev).expand(B, N)
    src = {}
    incoming = torch.zeros(B, N + 1, dtype=torch.int64, device=dev)  # column 0 collects the -1s
    for name, link in (("retrive_next_token", retrive_next_token),
                       ("retrive_next_sibling", retrive_next_sibling)):
        _check(link, name, torch.int64, 2)
        if link.shape != (B, N) or link.device != dev:
            raise ValueError(f"{name} must have shape [B, N] = [{B}, {N}] on {dev}, "
                             f"got {tuple(link.shape)} on {link.device}")
        bad = (link != -1) & ((link <= idx) | (link >= N))
        if bad.any():
            b, i = _first(bad)
            raise ValueError(f"{name}[{b}, {i}] = {link[b, i].item()}: links must point to a "
                             f"larger index < N (children after parents, siblings ascending)")
        incoming.scatter_add_(1, link + 1, torch.ones_like(link))
        src[name] = torch.full((B, N + 1), -1, dtype=torch.int64, device=dev)
        src[name].scatter_(1, link + 1, idx)  # src[p + 1] = the node linking to p
    if (retrive_next_sibling[:, 0] != -1).any():
        raise ValueError("retrive_next_sibling[:, 0] must be -1: the root has no siblings")
    wrong = incoming[:, 2:] != 1
    if wrong.any():
        b, j = _first(wrong)
        how = "never reached" if incoming[b, j + 2] == 0 else "reached more than once"
        raise ValueError(f"not a tree: node {j + 1} of request {b} is {how} by the links")
    via_token, via_sibling = src["retrive_next_token"][:, 1:], src["retrive_next_sibling"][:, 1:]
    parents = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    for j in range(1, N):  # a sibling's parent is its left sibling's, already resolved (index < j)
        left_parent = parents.gather(1, via_sibling[:, j:j + 1].clamp(min=0)).squeeze(1)
        parents[:, j] = torch.where(via_token[:, j] >= 0, via_token[:, j], left_parent)
    tokens, parents = draft_tokens.view(B, N).clone(), parents.int()
    validate(tokens, parents)
    return tokens, parents
