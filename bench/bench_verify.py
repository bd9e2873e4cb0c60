"""verify_greedy at Kimi's vocabulary (V = 163840), in one run:

    eagle3   torch.ops.eagle3.verify_greedy: one pass over the logits (many blocks per row) + the walk,
             two launches, no host sync
    torch    what a PyTorch engine writes without host syncs: `logits.argmax(-1)`, then a vectorised walk
             (N - 1 steps over [B, N] masks: the children of the current node carrying its argmax, the
             lowest index taken), then the emitted tokens; checked equal to eagle3's outputs

Shapes: B 64 x N 4 (a production Kimi chain: 3 draft steps, topk 1), B 1 x N 8 (a small bushy tree),
B 64 x N 8; bf16 and fp32 logits.

Two figures per provider: bench "verify", device time of CUDA-graph replays of back-to-back calls over
logits sets rotated past L2 (graph_time_us); bench "verify/eager", wall time per call of back-to-back
eager calls (host launch cost included; the fastest of 10 batches: common.eager_time_us), what an engine calling it
outside its graphs pays.
Bytes: the logits, read once (+ the small tree tensors and outputs). The target is
us <= 1.25 * bytes / copy_bw + 5 (issue 6); `target_us` in each eagle3 row.
"""

from __future__ import annotations

import pytest
import torch

from common import eager_time_us, graph_time_us, rotation

import eagle3_ops  # noqa: F401
from eagle3_ops.engine import torch_glue
from eagle3_ops import tree

V = 163840
SHAPES = [(64, 4, "chain", torch.bfloat16), (1, 8, "bushy", torch.bfloat16), (64, 8, "bushy", torch.bfloat16),
          (64, 4, "chain", torch.float32), (1, 8, "bushy", torch.float32)]
EAGER_CALLS = 40


torch_verify = torch_glue.verify_greedy  # argmax + the walk as tensor ops (engine/torch_glue.py)


def eagle3_verify(logits, tokens, parents):
    return torch.ops.eagle3.verify_greedy(logits, tokens, parents)


PROVIDERS = {"eagle3": eagle3_verify, "torch": torch_verify}


def _inputs(B, N, kind, dtype, sets):
    g = torch.Generator(device="cuda").manual_seed(B * N)
    parents = tree.random_parents(B, N, torch.Generator().manual_seed(N), kind).cuda()
    out = []
    for _ in range(sets):
        logits = torch.randn(B * N, V, device="cuda", generator=g).to(dtype)
        target = logits.argmax(-1).view(B, N)
        plant = torch.rand(B, N, device="cuda", generator=g) < 0.8  # deep walks, some stopped early
        tokens = torch.where(plant, target.gather(1, parents.long().clamp(min=0)),
                             torch.randint(0, V, (B, N), device="cuda", generator=g))
        out.append((logits, tokens, parents))
    return out


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("B,N,kind,dtype", SHAPES,
                         ids=[f"B{b}-N{n}-{k}-{str(d).replace('torch.', '')}" for b, n, k, d in SHAPES])
def test_verify(recorder, provider, B, N, kind, dtype):
    fn = PROVIDERS[provider]
    nbytes = B * N * V * dtype.itemsize + B * N * (8 + 4 + 4 + 8) + B * 4
    sets = _inputs(B, N, kind, dtype, rotation(nbytes))
    want = eagle3_verify(*sets[0])
    got = fn(*sets[0])
    for w, o, name in zip(want, got, ("accept_nodes", "accept_len", "emitted")):
        assert torch.equal(w, o), f"{provider} {name} differs from eagle3"
    us = graph_time_us([lambda s=s: fn(*s) for s in sets])
    eager_us = eager_time_us([lambda s=s: fn(*s) for s in sets], EAGER_CALLS)
    floor_us = nbytes / recorder.ceilings.copy_bw * 1e6
    shape = f"B={B} N={N} V={V} {str(dtype).replace('torch.', '')}"
    extra = {"target_us": 1.25 * floor_us + 5, "mean_accept_len": float(want[1].float().mean())}
    recorder.add("verify", shape, provider, us, nbytes, **extra)
    recorder.add("verify/eager", shape, provider, eager_us, nbytes, **extra)
