"""capture_aux at Kimi width (H = 7168, bf16): ours vs plain PyTorch `aux[:, slot] = hidden + residual`
(what SGLang/vLLM do per captured layer) vs torch.compile of the same, in one run.

Device time: CUDA-graph replays of back-to-back calls over input sets rotated past L2 (median per call).
Host time: pytest-benchmark's median of one eager call's launch (no sync), the cost outside a graph.
Bytes: hidden and residual rows read once, the aux slice written once (+ the row indices).
"""

from __future__ import annotations

import pytest
import torch

from common import graph_time_us, rotation

import eagle3_ops  # noqa: F401

H, N_AUX, SLOT = 7168, 3, 1
SHAPES = [(1, None), (7, None), (64, None), (512, None), (4096, None), (4096, 64)]  # (T, gathered rows R)


def _providers():
    def eagle3(h, r, aux, rows):
        torch.ops.eagle3.capture_aux(h, r, aux, SLOT, rows)

    def plain(h, r, aux, rows):
        s = h + r
        aux[:, SLOT * H:(SLOT + 1) * H] = s if rows is None else s[rows]

    compiled = torch.compile(plain, dynamic=False)
    return {"eagle3": eagle3, "torch": plain, "torch.compile": compiled}


PROVIDERS = _providers()


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("T,R", SHAPES, ids=[f"T{t}" + (f"-rows{r}" if r else "") for t, r in SHAPES])
def test_capture_aux(benchmark, recorder, provider, T, R):
    fn = PROVIDERS[provider]
    rows_n = T if R is None else R
    nbytes = (2 * rows_n * H + rows_n * H) * 2 + (0 if R is None else 8 * R)
    sets = []
    for _ in range(rotation(nbytes)):
        h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        aux = torch.empty(rows_n, N_AUX * H, device="cuda", dtype=torch.bfloat16)
        rows = None if R is None else torch.randint(0, T, (R,), device="cuda")
        sets.append((h, r, aux, rows))
    us = graph_time_us([lambda s=s: fn(*s) for s in sets])
    h, r, aux, rows = sets[0]
    benchmark.pedantic(lambda: fn(h, r, aux, rows), rounds=200, warmup_rounds=20)
    host_us = benchmark.stats.stats.median * 1e6
    shape = f"T={T} H={H}" + (f" rows={R}" if R else "")
    recorder.add("capture_aux", shape, provider, us, nbytes, host_us=host_us)
