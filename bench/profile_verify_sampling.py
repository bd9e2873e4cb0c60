"""Per-kernel device time of torch.ops.eagle3.verify_sampling at bench_compat_vllm's "B=64 uniform random+probs
V=163840" case (the native op with draft_probs: B 64, N 4 chain, bf16 logits, fp32 draft_probs, no d2t), by
torch.profiler over 20 calls: which of row_stats / walk / race / finish a build difference lands in (issue 21:
run it in both builds of bench/device_checks.sh, the checkout and /tmp/eagle3_nochecks, and compare).

    python3 bench/profile_verify_sampling.py [--calls 20] [--d2t]
"""

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's build
import eagle3_ops  # noqa: E402  (registers torch.ops.eagle3)

B, K, V = 64, 3, 163840
N = K + 1


def inputs(g: torch.Generator, d2t: bool):
    """bench_compat_vllm.native_inputs' tensors for one uniform set (drafts: the target's argmax 70% of the time)."""
    logits = (torch.randn(B * N, V, device="cuda", generator=g) * 4).to(torch.bfloat16)
    best = logits.float().argmax(-1).view(B, N)
    keep = torch.rand(B, K, device="cuda", generator=g) < 0.7
    rand = torch.randint(0, V, (B, K), device="cuda", generator=g)
    tokens = torch.full((B, N), -1, dtype=torch.int64, device="cuda")
    tokens[:, 1:] = torch.where(keep, best[:, :K], rand)
    q = torch.softmax(torch.randn(B * N, V, device="cuda", generator=g), -1).view(B, N, V)
    q[:, K] = 0.0  # the bonus row has no draft
    parents = (torch.arange(N, dtype=torch.int32, device="cuda") - 1).repeat(B, 1)
    temperature = torch.ones(B, device="cuda")
    seed = torch.arange(B, device="cuda")
    offset = torch.zeros(B, dtype=torch.int64, device="cuda")
    m = torch.zeros(V, dtype=torch.int64, device="cuda") if d2t else None  # identity map through the scatter
    return logits, q.view(B * N, V), m, tokens, parents, temperature, seed, offset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--d2t", action="store_true", help="an identity d2t: the scatter path (walk's gather)")
    a = p.parse_args()
    print("build:", eagle3_ops.build_info())
    args = inputs(torch.Generator(device="cuda").manual_seed(0), a.d2t)
    op = torch.ops.eagle3.verify_sampling
    for _ in range(3):
        out = op(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.calls):
            op(*args)
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.device_time_total / e.count) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    total = 0.0
    for key, count, us in sorted(rows, key=lambda r: -r[1] * r[2]):
        per_call = us * count / a.calls
        total += per_call
        print(f"  {per_call:9.2f} us per call  ({us:8.2f} us x{count // a.calls})  {key[:100]}")
    print(f"  {total:9.2f} us per call in all; accept_len mean {out[1].float().mean().item():.3f}")
    eagle3_ops.check_errors()  # a valid call: nothing recorded


if __name__ == "__main__":
    main()
