"""What bounds tree_attention_mla at N 1, B 1, prefix 32768 (issue 5's one open target: >= 75% of the copy
bandwidth over the KV bytes, i.e. <= ~11.9 us for 37.8 MB): same-run ceilings beside the op, all timed as
bench/common.py times benchmarks (CUDA-graph replays of back-to-back calls over inputs rotated past L2).

- read: the cache's bytes read once and nothing else - a Triton kernel summing its rows (each program a
  contiguous span, loads pipelined), over a sweep of program counts and tile sizes, best and all printed;
  torch.amax beside it (bench/dev/read_ceiling.py's torch reductions are no read ceiling at this size: amax takes
  twice the best). No attention kernel can read the cache faster than the best of these.
- launch: a kernel that reads and writes 4 bytes: the per-call floor of one launch in such a graph.
- op: the op as the benchmark times it; kernel alone (the internal op with the split count the launcher picks)
  and the split merge alone (partials hot in L2, as right after the kernel).
- skeleton: the op's own grid, loads, barriers and epilogue with the math taken out (the kernel's no-math
  builds, the development op _tree_attention_mla_sm90_dev: only in a build made with EAGLE3_DEV_BUILD=1, else
  skipped): loads only, with the fp32 partials, and with the merge after it - the floor of this decomposition,
  at the launcher's split count and at one split an SM.
- op, KV in L2: the same call with every page id pointing into 8 pages (590 KB, L2-resident): what the kernel
  costs when its 37.8 MB come from L2 instead of HBM - its compute, latency and merge without the HBM stream.

    python3 bench/dev/ceiling_mla.py       # on the GPU, from the repo root (built in place)
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from _shared import KIMI_SCALE, mla_counts, mla_inputs  # (first: puts the checkout and bench/ on sys.path)


@triton.jit
def _read_kernel(X, OUT, n, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums X[p * SPAN : (p + 1) * SPAN] (bf16) in BLOCK-element steps; writes one float."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * SPAN
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, SPAN, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc, 0))


@triton.jit
def _tiny_kernel(X, OUT):
    tl.store(OUT + tl.arange(0, 1), tl.load(X + tl.arange(0, 1)) + 1.0)


def main():
    from common import Ceilings, graph_time_us

    import eagle3_ops
    from eagle3_ops.triton_kernels import tree_attention as ta
    from eagle3_ops.triton_kernels.mla_decode import sm90_splits

    ceil = Ceilings.measure()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy {ceil.copy_bw / 1e12:.2f} TB/s, bf16 matmul {ceil.mm_rate / 1e12:.0f} TFLOP/s", flush=True)
    B, P, N, ps = 1, 32768, 1, 64
    nbytes, flops = mla_counts(B, P, N)
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [mla_inputs(B, P, N, ps, g) for _ in range(4)]  # 4 x 37.8 MB: a pass is 2.5x the 60 MB L2
    kv = sets[0]["k"].numel() * 2
    target_us = nbytes / (0.75 * ceil.copy_bw) * 1e6

    def pct(us, b=nbytes):
        return f"{100 * b / us * 1e6 / ceil.copy_bw:5.1f}% copy"

    print(f"N{N} B{B} P{P} ps{ps}: KV {kv / 1e6:.2f} MB, {flops / 1e9:.2f} GFLOP; copy floor "
          f"{nbytes / ceil.copy_bw * 1e6:.2f} us, matmul floor {flops / ceil.mm_rate * 1e6:.2f} us, "
          f"the target (75% of copy) {target_us:.2f} us", flush=True)

    # 1. the bytes read once, nothing else
    n = sets[0]["k"].numel()
    flat = [x["k"].view(-1) for x in sets]
    best = None
    for programs in (132, 264, 528, 1056, 2112, 4224):
        for block in (2048, 4096, 8192):
            span = -(-n // programs)
            span = -(-span // block) * block
            grid = -(-n // span)
            for warps, stages in ((4, 3), (8, 4)):
                red = torch.empty(grid, device="cuda")

                def call(x, red=red, span=span, block=block, grid=grid, warps=warps, stages=stages):
                    _read_kernel[(grid,)](x, red, n, SPAN=span, BLOCK=block, num_warps=warps, num_stages=stages)
                try:
                    us = graph_time_us([lambda x=x: call(x) for x in flat], reps=10)
                except Exception as e:  # pragma: no cover (a config that does not compile)
                    print(f"read {programs} x {block} w{warps} s{stages}: ERROR {type(e).__name__}", flush=True)
                    continue
                print(f"read once: {grid:5d} programs x {span:6d} elements, BLOCK {block:5d}, {warps} warps, "
                      f"{stages} stages: {us:6.2f} us  {pct(us, kv)} (over the KV bytes)", flush=True)
                if best is None or us < best[0]:
                    best = (us, grid, block, warps, stages)
    red = [torch.empty(x["k"].shape[:2], dtype=torch.bfloat16, device="cuda") for x in sets]
    us_amax = graph_time_us([lambda x=x, r=r: torch.amax(x["k"], dim=-1, out=r) for x, r in zip(sets, red)],
                            reps=10)
    print(f"read once, best: {best[0]:.2f} us = {pct(best[0], kv)} ({best[1]} programs, BLOCK {best[2]}, "
          f"{best[3]} warps, {best[4]} stages); torch.amax over the rows {us_amax:.2f} us", flush=True)

    # 2. one launch
    xs = [torch.zeros(16, device="cuda") for _ in range(4)]
    us_tiny = graph_time_us([lambda x=x: _tiny_kernel[(1,)](x, x) for x in xs], reps=10)
    print(f"one tiny kernel a call (4 bytes read and written): {us_tiny:.2f} us", flush=True)

    # 3. the op, the kernel alone, the merge alone
    def op(x, cfg=None):
        ta.tree_attention_mla(x["q"], x["k"], x["page_table"], x["prefix_lens"], x["tree_mask"], KIMI_SCALE,
                              x["out"], x["lse"], config=cfg)

    us_op = graph_time_us([lambda x=x: op(x) for x in sets], reps=10)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = sm90_splits(1, sets[0]["page_table"].shape[1] * ps, sms)
    po = torch.empty((splits, B, N * 64, 512), device="cuda")
    plse = torch.empty((splits, B, N * 64), device="cuda")

    def kernel(x):
        torch.ops.eagle3._tree_attention_mla_sm90(x["q"], x["k"], x["page_table"], x["prefix_lens"], x["tree_mask"],
                                                  KIMI_SCALE, x["out"], x["lse"], po, plse, splits, True)

    us_kernel = graph_time_us([lambda x=x: kernel(x) for x in sets], reps=10)
    us_merge = graph_time_us([lambda: ta.merge_splits(po, plse, sets[0]["out"], sets[0]["lse"], N, 1, 64)], reps=10)
    print(f"op {us_op:.2f} us = {pct(us_op)}; its attention kernel alone ({splits} splits) {us_kernel:.2f} us, "
          f"the merge alone (partials in L2) {us_merge:.2f} us", flush=True)

    # 4. this decomposition's floor: the same grid and loads with the math taken out (csrc/mla_decode_sm90.cu's
    # no-math builds: skeleton 1 keeps the epilogue's fp32 partials, 3 stores nothing), alone and followed by the
    # merge; a development build's op only
    skel = {}
    dev = eagle3_ops.build_info()["dev_build"]
    if not dev:
        print("skeleton: skipped (a development build's op: setup.py EAGLE3_DEV_BUILD=1)", flush=True)
    for n_splits in sorted({splits, sms}) if dev else []:
        pos = torch.empty((n_splits, B, N * 64, 512), device="cuda")
        plses = torch.empty((n_splits, B, N * 64), device="cuda")

        def skeleton(x, mode, merge, pos=pos, plses=plses, n_splits=n_splits):
            torch.ops.eagle3._tree_attention_mla_sm90_dev(x["q"], x["k"], x["page_table"], x["prefix_lens"],
                                                          x["tree_mask"], KIMI_SCALE, x["out"], x["lse"], pos, plses,
                                                          n_splits, True, None, mode)
            if merge:
                ta.merge_splits(pos, plses, x["out"], x["lse"], N, 1, 64)

        for mode, merge, what in ((3, False, "loads only"), (1, False, "loads + fp32 partials"),
                                  (1, True, "loads + fp32 partials + merge")):
            us = graph_time_us([lambda x=x: skeleton(x, mode, merge) for x in sets], reps=10)
            skel[(n_splits, mode, merge)] = us
            print(f"skeleton, {n_splits} splits, no math, {what}: {us:.2f} us = {pct(us)}", flush=True)

    # 5. the op with its KV from L2
    for x in sets:
        x["page_table"] = (torch.arange(x["page_table"].numel(), device="cuda", dtype=torch.int32) % 8).view_as(
            x["page_table"])
    us_l2 = graph_time_us([lambda x=x: op(x) for x in sets], reps=10)
    us_kernel_l2 = graph_time_us([lambda x=x: kernel(x) for x in sets], reps=10)
    print(f"op with its KV in L2 (every page id in 8 pages): {us_l2:.2f} us, its attention kernel alone "
          f"{us_kernel_l2:.2f} us", flush=True)
    no_math = (f"; no math ({splits} splits): loads {skel[(splits, 3, False)]:.2f} us, + partials "
               f"{skel[(splits, 1, False)]:.2f} us, + merge {skel[(splits, 1, True)]:.2f} us" if dev else "")
    print(f"summary: target {target_us:.2f} us; best pure read of the KV {best[0]:.2f} us; op {us_op:.2f} us "
          f"(kernel {us_kernel:.2f} + merge {us_merge:.2f}); op with KV in L2 {us_l2:.2f} us; "
          f"one launch {us_tiny:.2f} us{no_math}", flush=True)


if __name__ == "__main__":
    main()
