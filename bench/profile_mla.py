"""Where tree_attention_mla's time goes (a diagnosis aid for issue 5, not a benchmark): per shape and config,
the end-to-end CUDA-graph time (as bench/sweep_mla.py times it) and each kernel's own device time from
torch.profiler (CUPTI), so the attention kernel, the split merge and the gaps between them separate.

    python3 bench/profile_mla.py        # on the GPU, from the repo root (built in place)
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from sweep_mla import KIMI_SCALE, _counts, _inputs  # noqa: E402

# (B, prefix, N, page_size) -> configs ({} = default: on Hopper the CUDA kernel csrc/mla_decode_sm90.cu;
# {"kernel": "mla_decode"} is the Triton kernel with 64-key TMA tiles, cut + fill)
# (evict_first=False: the sm90 kernel's KV loads with the normal L2 policy; the default marks them evict-first
# when the call splits)
CASES = {
    (1, 32768, 1, 64): [{}, dict(evict_first=False)],
    (32, 32768, 1, 64): [{}, dict(evict_first=False)],
    (1, 32768, 16, 64): [{}, dict(evict_first=False)],
    (1, 4096, 16, 64): [{}, dict(evict_first=False)],
    (8, 8192, 16, 64): [{}],
}


def main():
    from torch.profiler import ProfilerActivity, profile

    from common import Ceilings, graph_time_us
    from eagle3_ops.triton_kernels import tree_attention as ta

    ceil = Ceilings.measure()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {ceil.copy_bw / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceil.mm_rate / 1e12:.0f} TFLOP/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    for (B, P, N, ps), cfgs in CASES.items():
        nbytes, flops = _counts(B, P, N)
        sets = [_inputs(B, P, N, ps, g) for _ in range(2)]
        for cfg in cfgs:
            def call(x, cfg=cfg):
                ta.tree_attention_mla(x["q"], x["k"], x["page_table"], x["prefix_lens"], x["tree_mask"], KIMI_SCALE,
                                      x["out"], x["lse"], config=dict(cfg) or None)
            try:
                us = graph_time_us([lambda x=x: call(x) for x in sets], reps=10)
            except Exception as e:
                print(f"N{N} B{B} P{P} {cfg}: ERROR {type(e).__name__}: {str(e)[:160]}")
                continue
            for x in sets:
                call(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    for x in sets:
                        call(x)
                torch.cuda.synchronize()
            kernels = [(e.key, e.count, e.device_time_total / max(e.count, 1)) for e in prof.key_averages()
                       if e.device_time_total > 0]
            parts = "; ".join(f"{k[:28]} x{c // 20 if c >= 20 else c}: {t:.1f} us" for k, c, t in kernels)
            print(f"N{N} B{B} P{P} {str(cfg or 'default'):<16} graph {us:7.1f} us  {flops / us * 1e-6:6.1f} TFLOP/s  "
                  f"{100 * nbytes / us * 1e6 / ceil.copy_bw:5.1f}% copy  | {parts}", flush=True)
        del sets


if __name__ == "__main__":
    main()
