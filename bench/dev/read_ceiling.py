"""How fast can the fc weight (Kimi: [7168, 21504] bf16, 308 MB; fp8 154 MB) be *read* at all on this GPU?
A diagnosis aid for issue 4's fc targets (not a benchmark of ours): the device-to-device copy ceiling,
read-only reductions over the same bytes (torch.sum, amax; several sizes), and F.linear at T = 1, all in
one run, CUDA-graph timed over inputs rotated past L2 as bench/common.py does.

    python3 bench/dev/read_ceiling.py
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

import _shared  # noqa: F401  (first: puts the checkout and bench/ on sys.path)
from common import Ceilings, graph_time_us  # noqa: E402

H, K = 7168, 3 * 7168


def main():
    ceil = Ceilings.measure()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {ceil.copy_bw / 1e12:.2f} TB/s "
          f"(read + write), bf16 matmul {ceil.mm_rate / 1e12:.0f} TFLOP/s")
    w = torch.randn(H, K, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(H, K, device="cuda", dtype=torch.bfloat16)  # two weights: one pass exceeds L2 (60 MB) anyway
    nbytes = w.numel() * 2
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    rows = [("F.linear T=1", [lambda: F.linear(x, w), lambda: F.linear(x, w2)], nbytes),
            ("torch.sum", [lambda: w.sum(dtype=torch.float32), lambda: w2.sum(dtype=torch.float32)], nbytes),
            ("amax", [lambda: torch.amax(w), lambda: torch.amax(w2)], nbytes),
            ("sum over rows", [lambda: w.sum(0), lambda: w2.sum(0)], nbytes)]
    w8 = w.to(torch.float8_e4m3fn)
    w82 = w2.to(torch.float8_e4m3fn)
    v8, v82 = w8.view(torch.uint8), w82.view(torch.uint8)
    rows.append(("fp8 bytes: amax", [lambda: torch.amax(v8), lambda: torch.amax(v82)], nbytes // 2))
    for name, calls, b in rows:
        us = graph_time_us(calls, reps=20)
        print(f"{name:<18} {b / 1e6:7.1f} MB  {us:8.2f} us  {b / us / 1e6:6.2f} TB/s read  "
              f"{100 * b / us * 1e6 / ceil.copy_bw:5.1f}% of the copy rate")


if __name__ == "__main__":
    main()
