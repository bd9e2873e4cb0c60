"""Per-kernel device time of the tree builds at bench_compat's test_build shapes (B 64: topk 8 depth 6 N 64,
topk 4 depth 5 N 16, topk 1 depth 3 N 4): torch.ops.eagle3.build_tree (native) and
compat.sglang.build_tree_kernel_efficient on its C++ op (QLEN_ONLY_BITPACKING where N <= 32, and FULL_MASK) and on
its Triton kernel, by torch.profiler over eager calls on 8 rotated input sets, beside the per-call time of the
same calls replayed in one CUDA graph (bench_compat's figure): a kernel's duration, and what the graph adds to it
(issue 22: the compat build against the native one). To tell what FULL_MASK pays for over the bit-packed mask
(1.3-1.4x native at N 16 / 4 at 3987bd8): compat-full-seq0 (FULL_MASK with every prefix length 0: the earlier
requests' lengths still summed, but the rows contiguous) and compat-qlen (QLEN_ONLY: bool rows, contiguous, no sum).

    python3 bench/profile_build.py [--calls 40]
"""

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's build
sys.path.insert(0, HERE)
import eagle3_ops  # noqa: E402  (registers torch.ops.eagle3)
from bench_compat import compat_build_args, native_outs, sglang_build_inputs  # noqa: E402
from common import graph_time_us  # noqa: E402
from eagle3_ops.compat import sglang as compat  # noqa: E402

B = 64
SHAPES = [(8, 6, 64), (4, 5, 16), (1, 3, 4)]  # (topk, depth, N)
SETS = 8


def calls_for(provider, topk, depth, N):
    """SETS calls of one provider on bench_compat's inputs (outputs allocated once per set)."""
    g = torch.Generator(device="cuda").manual_seed(B * N)
    sets = [sglang_build_inputs(B, topk, depth, N, g) for _ in range(SETS)]
    if provider == "native":
        return [lambda s=s, o=native_outs(B, N): torch.ops.eagle3.build_tree(*s[3], *o) for s in sets]
    mode = {"bitpacked": 2, "qlen": int(compat.TreeMaskMode.QLEN_ONLY)}.get(provider.split("-")[1],
                                                                         int(compat.TreeMaskMode.FULL_MASK))
    if "seq0" in provider:  # FULL_MASK with every prefix 0: its rows contiguous, as QLEN_ONLY's
        sets = [(p, sel, torch.zeros_like(seq), native) for p, sel, seq, native in sets]
    return [lambda a=compat_build_args(s[0], s[1], s[2], B, topk, depth, N, mode):
            compat.build_tree_kernel_efficient(*a) for s in sets]


def kernel_rows(calls, n):
    """(name, launches per call, us per launch) of every CUDA kernel that n calls (cycling) ran."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(n):
            calls[k % len(calls)]()
        torch.cuda.synchronize()
    return [(e.key, e.count / n, e.device_time_total / e.count) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=40)
    a = p.parse_args()
    print("build:", eagle3_ops.build_info())
    ops = compat._cuda_ops()
    assert ops.build_tree is not None, "this build has no C++ compat build (compat_sglang in EAGLE3_CUDA_ONLY)"
    print(f"B {B}; kernel: device time per launch (torch.profiler, {a.calls} eager calls over {SETS} input sets); "
          "graph: us per call replayed in one CUDA graph (bench_compat's figure)")
    for topk, depth, N in SHAPES:
        print(f"topk {topk} depth {depth} N {N}")
        providers = ["native", "compat-full", "compat-full-triton", "compat-full-seq0", "compat-qlen",
                     "compat-qlen-triton"]
        if N <= 32:
            providers[1:1] = ["compat-bitpacked", "compat-bitpacked-triton"]
        for provider in providers:
            compat.kernels = "triton" if provider.endswith("-triton") else "auto"
            try:
                calls = calls_for(provider, topk, depth, N)
                rows = kernel_rows(calls, a.calls)
                graph = graph_time_us(calls)
            finally:
                compat.kernels = "auto"
            kernels = "; ".join(f"{us:6.2f} us x{per_call:g} {key[:60]}" for key, per_call, us in rows)
            print(f"  {provider:24s} graph {graph:6.2f} us   kernel {kernels}")
    eagle3_ops.check_errors()  # valid calls: nothing recorded


if __name__ == "__main__":
    main()
