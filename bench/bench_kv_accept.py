"""kv_accept at Kimi-K2 shapes: 61 layers of MLA latent rows (576 bf16 = 1152 bytes), page size 16,
shuffled page tables, in one run:

    eagle3   torch.ops.eagle3.kv_accept: every layer in one launch
    torch    the per-layer path without host syncs: the accepted rows' flat row indices computed once,
             then per layer `index_select` of the N tree rows (rows past accept_len map onto themselves)
             and `index_copy_` back into place (2 launches a layer, 122 for Kimi), then prefix_lens advanced

Patterns (N = 8): "all_move" accepts nodes [0, 2, 4, 6, 7] of a bushy tree (4 drafts, every one moves:
61 x B x 4 rows read and written, 36 MB at B 64); "chain" accepts [0, 1, 2, 3, 4], where no row moves
(the bytes to move, and the floor, are zero: the time is what the launch costs).

Two figures per provider: bench "kv_accept", device time of CUDA-graph replays of back-to-back calls
(graph_time_us); bench "kv_accept/eager", wall time per call of back-to-back eager calls (the fastest of 10
batches of 12: common.eager_time_us), what an engine that calls the op outside its graphs pays (host launch
cost included). Every call advances prefix_lens,
so each rotated input set is a prefix_lens tensor whose requests sit in their own region of the cache
(consecutive calls touch rows far apart, several sets exceed L2); requests never run out of pages
(checked after timing: a skipped request would stop advancing).
"""

from __future__ import annotations


import pytest
import torch

from common import eager_time_us, graph_time_us, rotation

import eagle3_ops  # noqa: F401
from eagle3_ops.engine import torch_glue

LAYERS, D, PAGE, N = 61, 576, 16, 8
PATTERNS = {"all_move": [0, 2, 4, 6, 7], "chain": [0, 1, 2, 3, 4]}
SHAPES = [(64, "all_move"), (1, "all_move"), (64, "chain"), (1, "chain")]
EAGER_CALLS, GRAPH_REPLAYS, PER_GRAPH = 120, 35, 20  # graph_time_us: 5 warm-up + 30 timed replays


torch_accept = torch_glue.kv_accept  # a gather and a scatter per layer (engine/torch_glue.py)


def eagle3_accept(caches, page_table, prefix_lens, accept_nodes, accept_len):
    torch.ops.eagle3.kv_accept(caches, page_table, prefix_lens, accept_nodes, accept_len)


PROVIDERS = {"eagle3": eagle3_accept, "torch": torch_accept}

_STATE: dict = {}


def setup(B, pattern):
    """Caches, page table and rotated prefix sets for one shape, shared by both providers."""
    key = (B, pattern)
    if key in _STATE:
        return _STATE[key]
    _STATE.clear()
    torch.cuda.empty_cache()
    moved = sum(int(n != i) for i, n in enumerate(PATTERNS[pattern]))
    nbytes = LAYERS * B * moved * D * 2 * 2
    sets = rotation(max(nbytes, 1)) if moved else 4
    per_set = 1 + GRAPH_REPLAYS * -(-PER_GRAPH // sets) + -(-EAGER_CALLS // sets) + 2  # calls each set sees
    region = per_set * len(PATTERNS[pattern]) + 2 * N + PAGE
    positions = sets * region
    max_pages = -(-positions // PAGE)
    g = torch.Generator(device="cuda").manual_seed(B)
    caches = [torch.randn(B * max_pages, PAGE, D, device="cuda", generator=g, dtype=torch.bfloat16)
              for _ in range(LAYERS)]
    page_table = torch.randperm(B * max_pages, device="cuda", generator=g).view(B, max_pages).int()
    starts = [torch.full((B,), s * region + 3, dtype=torch.int32, device="cuda") for s in range(sets)]
    nodes = torch.full((B, N), -1, dtype=torch.int32, device="cuda")
    nodes[:, :len(PATTERNS[pattern])] = torch.tensor(PATTERNS[pattern], dtype=torch.int32)
    lens = torch.full((B,), len(PATTERNS[pattern]) - 1, dtype=torch.int32, device="cuda")
    _STATE[key] = (caches, page_table, starts, nodes, lens, nbytes, region)
    return _STATE[key]


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("B,pattern", SHAPES, ids=[f"B{b}-{p}" for b, p in SHAPES])
def test_kv_accept(recorder, provider, B, pattern):
    fn = PROVIDERS[provider]
    caches, page_table, starts, nodes, lens, nbytes, region = setup(B, pattern)
    prefixes = [s.clone() for s in starts]
    calls = [lambda p=p: fn(caches, page_table, p, nodes, lens) for p in prefixes]
    us = graph_time_us(calls, reps=GRAPH_REPLAYS - 5)
    eager_us = eager_time_us(calls, EAGER_CALLS)
    for s, p in zip(starts, prefixes):  # every request advanced every call: none ran out of pages
        assert int(p.min()) == int(p.max()) > int(s[0]), (provider, p.min(), p.max())
        assert int(p.max()) + N <= int(s[0]) + region, "a rotated set overran its region"
    shape = f"L={LAYERS} B={B} N={N} {pattern}"
    recorder.add("kv_accept", shape, provider, us, nbytes)
    recorder.add("kv_accept/eager", shape, provider, eager_us, nbytes)
