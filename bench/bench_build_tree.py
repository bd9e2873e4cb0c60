"""build_tree: ours (one CUDA launch) vs SGLang's algorithm written in plain PyTorch (topk over the
flattened cumulative scores, sort, parent resolution by search, ancestor mask by repeated gathers, bit
packing), at EAGLE-3 serving shapes, in one run.

Device time: CUDA-graph replays of back-to-back calls over rotated input sets (median per call).
Host time: pytest-benchmark's median of one eager call (no sync): what an engine pays outside its graph.
Bytes: scores, parents and tokens of all candidates read once, the four outputs written once.
"""

from __future__ import annotations

import pytest
import torch

from common import graph_time_us, rotation

import eagle3_ops  # noqa: F401
from eagle3_ops.engine import torch_glue

SHAPES = [(64, 8, 6, 64), (1, 8, 6, 64), (64, 4, 5, 16), (7, 2, 3, 8)]  # (B, topk, depth, N); first = the target


sglang_torch = torch_glue.build_tree_into  # SGLang's algorithm in plain PyTorch (engine/torch_glue.py)


def eagle3(*args):
    torch.ops.eagle3.build_tree(*args)


PROVIDERS = {"eagle3": eagle3, "torch": sglang_torch}


def make_inputs(B, topk, depth, N, g):
    M = topk * topk
    scores = torch.full((B, depth, M), float("-inf"), device="cuda")
    parents = torch.full((B, depth, M), -1, dtype=torch.int32, device="cuda")
    step0 = torch.log_softmax(torch.randn(B, 1000, device="cuda", generator=g), -1).topk(topk)
    scores[:, 0, :topk] = step0.values
    for d in range(1, depth):
        beams = scores[:, d - 1].topk(topk).indices
        child = torch.log_softmax(torch.randn(B, topk, 1000, device="cuda", generator=g), -1).topk(topk).values
        scores[:, d] = (scores[:, d - 1].gather(1, beams)[:, :, None] + child).reshape(B, M)
        parents[:, d] = beams.repeat_interleave(topk, 1).int()
    tokens = torch.randint(0, 163840, (B, depth, M), device="cuda", generator=g)
    root = torch.randint(0, 163840, (B,), device="cuda", generator=g)
    prefix = torch.randint(0, 8192, (B,), dtype=torch.int32, device="cuda", generator=g)
    out = (torch.empty(B, N, dtype=torch.int64, device="cuda"), torch.empty(B, N, dtype=torch.int32, device="cuda"),
           torch.empty(B, N, dtype=torch.int64, device="cuda"),
           torch.empty(B, N, (N + 31) // 32, dtype=torch.int32, device="cuda"))
    return (root, tokens, scores, parents, prefix) + out


def test_providers_agree_on_tree_shape():
    # Both build the same node set; ours orders by score, SGLang's by candidate index, so compare sorted.
    g = torch.Generator(device="cuda").manual_seed(0)
    a = make_inputs(8, 4, 4, 16, g)
    b = tuple(t.clone() for t in a)
    eagle3(*a)
    sglang_torch(*b)
    assert torch.equal(torch.sort(a[5], 1).values, torch.sort(b[5], 1).values)
    assert torch.equal(torch.sort(a[7], 1).values, torch.sort(b[7], 1).values)


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("B,topk,depth,N", SHAPES, ids=[f"B{b}-topk{k}-depth{d}-N{n}" for b, k, d, n in SHAPES])
def test_build_tree(benchmark, recorder, provider, B, topk, depth, N):
    fn = PROVIDERS[provider]
    C = depth * topk * topk
    nbytes = B * C * (4 + 4 + 8) + B * N * (8 + 4 + 8 + 4 * ((N + 31) // 32)) + B * 12
    g = torch.Generator(device="cuda").manual_seed(1)
    sets = [make_inputs(B, topk, depth, N, g) for _ in range(min(rotation(nbytes), 16))]
    us = graph_time_us([lambda s=s: fn(*s) for s in sets])
    s0 = sets[0]
    benchmark.pedantic(lambda: fn(*s0), rounds=200, warmup_rounds=20)
    host_us = benchmark.stats.stats.median * 1e6
    recorder.add("build_tree", f"B={B} topk={topk} depth={depth} N={N}", provider, us, nbytes, host_us=host_us)
