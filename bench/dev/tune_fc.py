"""Sweep fc_proj's weight-streaming configurations at Kimi shape (a tuning aid, not a benchmark):
python bench/dev/tune_fc.py [T ...]. Prints us per (T, weight dtype, BLOCK_N, BLOCK_K, split, warps, stages)
and the best per case; the defaults live in triton_kernels/fc_proj.py:stream_config. Each candidate runs through
fc_proj's launcher with its tiles given explicitly (fc_proj._fc_proj's config)."""

from __future__ import annotations

import itertools
import sys

import torch

import _shared  # noqa: F401  (first: puts the checkout and bench/ on sys.path)
from common import Ceilings, graph_time_us  # noqa: E402

import eagle3_ops  # noqa: E402,F401
from eagle3_ops.ops import prepare_fc_weight  # noqa: E402
from eagle3_ops.triton_kernels import fc_proj as kernels  # noqa: E402

H = 7168
K = 3 * H


def main(ts):
    w = torch.randn(H, K, device="cuda") / K**0.5
    weights = {"bf16": (w.bfloat16(), None)}
    w8, s8, _ = prepare_fc_weight(w, fp8=True)
    weights["fp8"] = (w8, s8)
    del w
    bw = Ceilings.measure().copy_bw
    print(f"copy {bw / 1e12:.2f} TB/s")
    for T in ts:
        aux = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
        for name, (wt, sc) in weights.items():
            results = []
            space = {"bf16": [(64, 128), (128, 256), (4, 8, 12), (4, 8), (4,)],
                     "fp8": [(64, 128), (128, 256, 512), (4, 8), (4, 8), (3,)]}[name]
            for bn, bk, split, warps, stages in itertools.product(*space):
                config = f"{bn},{bk},{split},{warps},{stages}"
                try:
                    us = graph_time_us([lambda c=config: kernels._fc_proj(aux, wt, sc, None, 1e-6, "none", None,
                                                                          out, config=c)], reps=10)
                except Exception as e:  # out of shared memory etc.
                    print(f"T={T} {name} {bn},{bk},{split},{warps},{stages}: {type(e).__name__}")
                    continue
                results.append((us, bn, bk, split, warps, stages))
            results.sort()
            nbytes = wt.numel() * wt.element_size()
            for us, *cfg in results[:5]:
                print(f"T={T:<3} {name:<5} cfg={cfg} {us:8.2f} us  {nbytes / (us * 1e-6) / bw * 100:5.1f}% of copy")


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [1, 16, 64])
