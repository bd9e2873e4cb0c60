"""The tree drafting's top-k of its beams' children (engine/decode.py _draft_candidates) at Kimi's vocabulary
(V = 163840, bf16 scores): each step reads the K beams' rows of its draft block's logits, a [B, K, V] slice of
[B, NB, V] (NB = (steps - 1) * K rows a request), in one run:

    eagle3        fused.top_logprobs on the slice: decode_round.topk_lse reads the rows in place (two row
                  strides), two launches
    eagle3.copy   the path before: the slice reshaped to [B * K, V] (a copy at B > 1: the slice is not
                  contiguous), then the same two launches
    torch         the PyTorch path beside it (fused.top_logprobs impl="torch": topk of the fp32 scores less
                  their logsumexp)

Shapes: topk 8, 6 steps (NB = 40), B 1 and 8. Device time of CUDA-graph replays of back-to-back calls over
logits sets rotated past L2 (graph_time_us). Bytes: the K rows read once (+ the outputs); the copy path also
writes and reads them again, which the floor does not count.
"""

from __future__ import annotations

import pytest
import torch

from common import graph_time_us, rotation

import eagle3_ops  # noqa: F401
from eagle3_ops.engine import fused
from eagle3_ops.triton_kernels import decode_round

V, K, NB = 163840, 8, 40
SHAPES = [1, 8]


def eagle3_top(x):
    return fused.top_logprobs(x, K)


def eagle3_copy(x):
    lp, ids, _ = decode_round.topk_lse(x.reshape(-1, V), K)
    return lp.view(*x.shape[:-1], K), ids.view(*x.shape[:-1], K)


def torch_top(x):
    return fused.top_logprobs(x, K, impl="torch")


PROVIDERS = {"eagle3": eagle3_top, "eagle3.copy": eagle3_copy, "torch": torch_top}


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("B", SHAPES, ids=[f"B{b}" for b in SHAPES])
def test_top_logprobs(recorder, provider, B):
    fn = PROVIDERS[provider]
    nbytes = B * K * V * 2 + B * K * (4 + 8)
    g = torch.Generator(device="cuda").manual_seed(B)
    block_bytes = B * NB * V * 2
    sets = [(torch.randn(B, NB, V, device="cuda", generator=g) * 3).to(torch.bfloat16)[:, 2 * K:3 * K]
            for _ in range(rotation(block_bytes))]  # a middle step's beams: rows 16..23 of each request's 40
    want_lp, want_ids = eagle3_copy(sets[0])
    lp, ids = fn(sets[0])
    assert torch.equal(ids, want_ids) or provider == "torch", f"{provider} ids differ from the copy path's"
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-5)
    us = graph_time_us([lambda x=x: fn(x) for x in sets])
    recorder.add("top_logprobs", f"B={B} K={K} V={V} bf16 rows of {NB}", provider, us, nbytes)
