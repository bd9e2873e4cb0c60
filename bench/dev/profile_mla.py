"""Where tree_attention_mla's time goes (a diagnosis aid for issue 5, not a benchmark): per shape and config,
the end-to-end CUDA-graph time (as bench/dev/sweep_mla.py times it) and each kernel's own device time from
torch.profiler (CUPTI), so the attention kernel, the split merge and the gaps between them separate.

    python3 bench/dev/profile_mla.py        # on the GPU, from the repo root (built in place)
    python3 bench/dev/profile_mla.py --tp   # issue 23's tensor-parallel rows: 8 and 16 local heads, the
                                            # default split count and others, 4-chains and N 1
"""

from __future__ import annotations

import sys


import torch

from _shared import KIMI_SCALE, mla_counts, mla_inputs  # (first: puts the checkout and bench/ on sys.path)

# (B, prefix, N, page_size) -> configs ({} = default: on Hopper the CUDA kernel csrc/mla_decode_sm90.cu;
# {"kernel": "mla_decode"} is the Triton kernel with 64-key TMA tiles, cut + fill)
# (evict_first=False: the sm90 kernel's KV loads as plain cp.async; the default gives them an L2 evict-first
# policy when the call splits. Tried and gone: 2-byte split partials, stored directly or staged and bulk-copied, and
# fp32 partials bulk-copied: results/mla_sm90_early_h200.log)
CASES = {
    (1, 32768, 1, 64): [{}, dict(evict_first=False)],
    (32, 32768, 1, 64): [{}, dict(evict_first=False)],
    (1, 32768, 16, 64): [{}, dict(evict_first=False)],
    (1, 4096, 16, 64): [{}, dict(evict_first=False)],
    (8, 8192, 16, 64): [{}, dict(evict_first=True)],
}


# (heads, B, prefix, N, page_size) -> configs: issue 23's memory-bound rows under tensor parallelism
TP_CASES = {
    (8, 8, 8192, 4, 64): [{}, dict(splits=8), dict(splits=32), dict(splits=64), dict(evict_first=False)],
    (16, 8, 8192, 4, 64): [{}, dict(splits=8), dict(splits=32), dict(splits=64)],
    (8, 64, 4096, 4, 64): [{}, dict(splits=1), dict(splits=2), dict(splits=4)],
    (8, 1, 32768, 1, 64): [{}, dict(splits=64), dict(splits=128)],
    (16, 1, 32768, 4, 64): [{}, dict(splits=64), dict(splits=128)],
}


def main(tp: bool = False):
    from torch.profiler import ProfilerActivity, profile

    from common import Ceilings, graph_time_us
    from eagle3_ops.triton_kernels import tree_attention as ta

    ceil = Ceilings.measure()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {ceil.copy_bw / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceil.mm_rate / 1e12:.0f} TFLOP/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = TP_CASES if tp else {(64, *k): v for k, v in CASES.items()}
    for (nh, B, P, N, ps), cfgs in cases.items():
        nbytes, flops = mla_counts(B, P, N, nh)
        sets = [mla_inputs(B, P, N, ps, g, nh) for _ in range(2)]
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
            from eagle3_ops.triton_kernels.mla_decode import sm90_splits
            auto = sm90_splits(-(-N * nh // 64) * B, sets[0]["page_table"].shape[1] * ps, torch.cuda.get_device_properties(0).multi_processor_count)
            print(f"H{nh} N{N} B{B} P{P} {str(cfg or f'default ({auto} splits)'):<22} graph {us:7.1f} us  {flops / us * 1e-6:6.1f} TFLOP/s  "
                  f"{100 * nbytes / us * 1e6 / ceil.copy_bw:5.1f}% copy  | {parts}", flush=True)
        if N == 1:  # what the cache's bytes alone cost at this size: read once (amax), and copied (read + written)
            red = [torch.empty(x["k"].shape[:2], dtype=x["k"].dtype, device="cuda") for x in sets]
            dst = [torch.empty_like(x["k"]) for x in sets]
            kv = sets[0]["k"].numel() * sets[0]["k"].element_size()
            us_read = graph_time_us([lambda x=x, r=r: torch.amax(x["k"], dim=-1, out=r) for x, r in zip(sets, red)],
                                    reps=10)
            us_copy = graph_time_us([lambda x=x, d=d: d.copy_(x["k"]) for x, d in zip(sets, dst)], reps=10)
            print(f"N{N} B{B} P{P} the cache's {kv / 1e6:.1f} MB read once (torch.amax): {us_read:.1f} us "
                  f"= {100 * kv / us_read * 1e6 / ceil.copy_bw:.1f}% copy; copied (read + written): {us_copy:.1f} us "
                  f"= {100 * 2 * kv / us_copy * 1e6 / ceil.copy_bw:.1f}% copy", flush=True)
            del red, dst
        del sets


def merge_variants():
    """The split merge alone at N1 B1 P32768's shape (119 splits of 64 rows x 512): the launcher's tiles and
    others, with the partials hot in L2 (one set, as right after the attention kernel) and rotated past it."""
    import triton

    from common import graph_time_us
    from eagle3_ops.triton_kernels._attention_common import _merge_kernel

    splits, rows, DV = 119, 64, 512
    sets = []
    for _ in range(4):
        po = torch.randn(splits, 1, rows, DV, device="cuda")
        plse = torch.randn(splits, 1, rows, device="cuda")
        sets.append((po, plse, torch.empty(1, rows, DV, dtype=torch.bfloat16, device="cuda"),
                     torch.empty(1, rows, device="cuda")))
    for block_s, block_v, warps in [(128, 32, 4), (128, 64, 4)]:  # 64: merge_splits' tile at 128 splits
        def call(st, block_s=block_s, block_v=block_v, warps=warps):
            po, plse, out, lse = st
            _merge_kernel[(rows, triton.cdiv(DV, block_v))](  # grid (B * HKV * rows, DV blocks)
                po, plse, out, lse, 1, 1, splits, out.stride(0), out.stride(1), G=rows, DV=DV, BLOCK_S=block_s,
                BLOCK_V=block_v, HAS_LSE=True, num_warps=warps)
        hot = graph_time_us([lambda: call(sets[0])], reps=10)
        cold = graph_time_us([lambda st=st: call(st) for st in sets], reps=10)
        print(f"merge 119 x 64 x 512 fp32 BLOCK_S {block_s} BLOCK_V {block_v} warps {warps}: "
              f"L2-hot {hot:.1f} us, rotated {cold:.1f} us", flush=True)


if __name__ == "__main__":
    if "--tp" in sys.argv:
        main(tp=True)
    else:
        main()
        merge_variants()
