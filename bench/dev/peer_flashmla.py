"""Issue 5's MLA rows against a peer on the same H200 in the same run: FlashMLA, DeepSeek's sm90 MLA decode
kernel (split-KV, its "seesaw" schedule, a combine kernel), as vLLM ships it. FlashMLA has no tree mask, so the
16-node rows use a chain (a 16-token causal block: the only tree it can verify) and the N 1 rows plain decode;
eagle3's tree_attention_mla gets the same inputs (the chain as its ancestor bits). Both are timed as
bench/common.py times benchmarks (CUDA-graph replays of back-to-back calls over input sets rotated past L2), and
their outputs are compared.

FlashMLA is not a dependency: point EAGLE3_FLASHMLA_SO at vLLM's build of it, e.g.
    pip download --no-deps vllm==0.33.0 && unzip -j vllm-0.33.0-*.whl 'vllm/_flashmla_C.abi3.so' -d .peer
    EAGLE3_FLASHMLA_SO=.peer/_flashmla_C.abi3.so python3 bench/dev/peer_flashmla.py      # on the GPU, repo root
(a torch stable-ABI extension: it registers torch.ops._flashmla_C.dense_decode_fwd.)
"""

from __future__ import annotations

import os
import sys

import torch

from _shared import DV, KIMI_SCALE, NH, mla_counts  # (first: puts the checkout and bench/ on sys.path)

# (B, prefix, N): issue 5's MLA rows
SHAPES = [(1, 32768, 1), (32, 32768, 1), (1, 32768, 16), (8, 8192, 16), (1, 4096, 16)]
PS = 64  # FlashMLA's page block size


def _chain_inputs(B, P, N, g):
    from eagle3_ops import tree

    L = P + N
    pages = -(-L // PS)
    parents = torch.arange(-1, N - 1, dtype=torch.int32).expand(B, N).contiguous()  # node j's parent is j - 1: a causal block
    return dict(q=torch.randn(B * N, NH, 576, generator=g, device="cuda", dtype=torch.bfloat16),
                k=torch.randn(B * pages, PS, 576, generator=g, device="cuda", dtype=torch.bfloat16),
                page_table=torch.randperm(B * pages, generator=g, device="cuda").int().view(B, pages).contiguous(),
                prefix_lens=torch.full((B,), P, dtype=torch.int32, device="cuda"),
                seqlens=torch.full((B,), L, dtype=torch.int32, device="cuda"),
                tree_mask=tree.tree_mask(parents).cuda(),
                out=torch.empty(B * N, NH, DV, device="cuda", dtype=torch.bfloat16),
                lse=torch.empty(B * N, NH, device="cuda"),
                peer_out=torch.empty(B, 1, N * NH, DV, device="cuda", dtype=torch.bfloat16))  # its (b, h_k, s_q h_q, d)


def main():
    from common import Ceilings, graph_time_us

    from eagle3_ops.triton_kernels import tree_attention as ta

    so = os.environ.get("EAGLE3_FLASHMLA_SO")
    if not so or not os.path.exists(so):
        sys.exit("set EAGLE3_FLASHMLA_SO to FlashMLA's extension (see this file's docstring)")
    torch.ops.load_library(so)
    fm = torch.ops._flashmla_C
    print("FlashMLA:", so, fm.dense_decode_fwd.default._schema, flush=True)

    ceil = Ceilings.measure()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {ceil.copy_bw / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceil.mm_rate / 1e12:.0f} TFLOP/s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'shape':22s} {'eagle3 us':>10s} {'FlashMLA us':>12s} {'FlashMLA/eagle3':>16s}   eagle3 of floor   "
          f"FlashMLA of floor   max |diff|", flush=True)
    for B, P, N in SHAPES:
        nbytes, flops = mla_counts(B, P, N)
        kv = B * (P + N) * 576 * 2
        n_sets = max(1, min(4, -(-150_000_000 // kv)))  # rotate past the 60 MB L2
        sets = [_chain_inputs(B, P, N, g) for _ in range(n_sets)]
        causal = N > 1

        def ours(x):
            ta.tree_attention_mla(x["q"], x["k"], x["page_table"], x["prefix_lens"], x["tree_mask"], KIMI_SCALE,
                                  x["out"], x["lse"])

        meta = {}

        def peer(x):
            md, ns = meta.get("md"), meta.get("ns")
            _, _, md, ns = fm.dense_decode_fwd(x["q"].view(B, N, NH, 576), x["k"].view(-1, PS, 1, 576), DV,
                                               x["seqlens"], x["page_table"], KIMI_SCALE, causal, md, ns,
                                               x["peer_out"])
            meta["md"], meta["ns"] = md, ns  # the scheduler metadata, computed by the first call and reused

        for x in sets:
            ours(x)
            peer(x)
        torch.cuda.synchronize()
        diff = max(float((x["out"].float() - x["peer_out"].view_as(x["out"]).float()).abs().max()) for x in sets)
        us_ours, us_peer = [], []
        for _ in range(3):  # interleaved repetitions
            us_ours.append(graph_time_us([lambda x=x: ours(x) for x in sets], reps=10))
            us_peer.append(graph_time_us([lambda x=x: peer(x) for x in sets], reps=10))
        a, b = min(us_ours), min(us_peer)
        if N == 1:
            floor, unit = nbytes / ceil.copy_bw * 1e6, "copy"
        else:
            floor, unit = flops / ceil.mm_rate * 1e6, "matmul"
        print(f"B{B} P{P} N{N}{' chain' if N > 1 else '':6s} {a:10.1f} {b:12.1f} {b / a:15.2f}x   "
              f"{100 * floor / a:5.1f}% {unit:6s}     {100 * floor / b:5.1f}% {unit:6s}      {diff:.2e}   "
              f"(each the best of 3; eagle3 {' '.join(f'{u:.1f}' for u in us_ours)}, "
              f"FlashMLA {' '.join(f'{u:.1f}' for u in us_peer)})", flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
