"""Inside the sm90 MLA kernel, block by block (a diagnosis aid for issue 5, not a benchmark): the kernel built
with its trace (csrc/mla_decode_sm90.cu's kDevTrace, the development op _tree_attention_mla_sm90_dev with a trace
tensor) stamps %globaltimer per block at entry, when Q and tile 0 have landed, when each later tile has landed
(up to tile 8), after its last wgmma and after its epilogue. Printed per shape and variant: how far apart the
blocks start, and the median / max over blocks of each phase, so the fixed latency of a short split (prologue,
epilogue) and the steady time a tile separate. The kernel alone runs (its split partials are not merged).

    EAGLE3_DEV_BUILD=1 make TORCH=torch==2.14.1 .venv/.eagle3-built   # a development build (rm the stamp first)
    python3 bench/dev/trace_mla.py        # on the GPU, from the repo root (built in place)
"""

from __future__ import annotations


import sys

import torch

from _shared import KIMI_SCALE, mla_inputs  # (first: puts the checkout and bench/ on sys.path)

# (B, prefix, N, page_size) -> options of the sm90 kernel (splits: the launcher's count unless given;
# evict_first: marked KV loads unless False)
CASES = {
    (1, 32768, 1, 64): [{}, dict(evict_first=False)],
    (1, 4096, 16, 64): [{}],
}
SLOTS = 16


def _stats(x: torch.Tensor) -> str:
    x = x.double()
    return f"{x.median().item() / 1e3:6.2f} / {x.max().item() / 1e3:6.2f}"


def main():
    import eagle3_ops
    from eagle3_ops.triton_kernels import mla_decode
    from eagle3_ops.triton_kernels._attention_common import sm_count

    if not eagle3_ops.build_info()["dev_build"]:
        sys.exit("trace_mla.py needs a development build (setup.py EAGLE3_DEV_BUILD=1): this one has no "
                 "_tree_attention_mla_sm90_dev")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  (us: median / max over blocks)")
    g = torch.Generator(device="cuda").manual_seed(0)
    for (B, P, N, ps), cfgs in CASES.items():
        x = mla_inputs(B, P, N, ps, g)
        for cfg in cfgs:
            m_blocks = -(-(N * x["q"].shape[1]) // 64)  # the kernel's 64-row blocks
            max_len = x["page_table"].shape[1] * ps
            splits = cfg.get("splits") or mla_decode.sm90_splits(m_blocks * B, max_len, sm_count(x["q"].device))
            trace = torch.zeros(m_blocks * B * splits, SLOTS, dtype=torch.int64, device="cuda")
            rows = N * x["q"].shape[1]
            po = torch.empty((splits, B, rows, 512) if splits > 1 else (0,), device="cuda")
            plse = torch.empty((splits, B, rows) if splits > 1 else (0,), device="cuda")
            for _ in range(3):  # warm; the last call's stamps are kept
                trace.zero_()
                torch.cuda.synchronize()
                torch.ops.eagle3._tree_attention_mla_sm90_dev(
                    x["q"], x["k"], x["page_table"], x["prefix_lens"], x["tree_mask"], KIMI_SCALE, x["out"], x["lse"],
                    po, plse, splits, bool(cfg.get("evict_first", splits > 1)), trace, 0)
                torch.cuda.synchronize()
            t = trace.cpu()
            landed = (t[:, 2:11] != 0).sum(1)  # tiles stamped (0 .. 8)
            work = landed > 0
            t, landed = t[work], landed[work]
            t0 = t[:, 1].min()
            lines = [f"N{N} B{B} P{P} ps{ps} {cfg}: {len(t)} blocks with work of {len(trace)} "
                     f"({splits} splits), tiles a block {landed.min().item()}-{landed.max().item()}, "
                     f"on {t[:, 0].unique().numel()} SMs"]
            lines.append(f"  entry after the first block   {_stats(t[:, 1] - t0)}")
            lines.append(f"  Q + tile 0 landed             {_stats(t[:, 2] - t[:, 1])}")
            for k in range(1, 9):
                has = landed > k
                if has.any():
                    lines.append(f"  tile {k} after tile {k - 1}          {_stats(t[has, 2 + k] - t[has, 1 + k])}")
            last = t[torch.arange(len(t)), 1 + landed]
            lines.append(f"  last tile landed -> last wgmma {_stats(t[:, 11] - last)}")
            lines.append(f"  epilogue (O / partials out)   {_stats(t[:, 12] - t[:, 11])}")
            lines.append(f"  block, entry -> exit          {_stats(t[:, 12] - t[:, 1])}")
            lines.append(f"  kernel span (first entry -> last exit) {(t[:, 12].max() - t0).item() / 1e3:.2f} us")
            print("\n".join(lines), flush=True)
        del x


if __name__ == "__main__":
    main()
