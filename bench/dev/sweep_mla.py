"""Sweep of tree_attention_mla kernel configurations on the H200 (issue 5): each candidate is first checked
against the float64 truth (tests/test_tree_attention.py's GpuCase) on a small and a real shape, then timed
(CUDA-graph replays over inputs rotated past L2, bench/common.py) at the issue's shapes. Prints a plain
table: us, TFLOP/s, % of the bf16 matmul rate and % of copy bandwidth (over the KV, q and out bytes), both
ceilings measured in this run. A candidate that fails to compile or launch is reported and skipped.

    python3 bench/dev/sweep_mla.py              # on the GPU, from the repo root (built in place)
    python3 bench/dev/sweep_mla.py --compile    # no GPU needed: registers, spills, shared memory per candidate
                                            # (sm_90a, triton's bundled ptxas), specialised as for N16 P32768

EAGLE3_SWEEP_BUDGET_S (default 140) stops timing new cases past that many seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from _shared import D, DV, KIMI_SCALE, NH, mla_counts, mla_inputs  # (first: puts the checkout and bench/ on sys.path)

# name -> config of triton_kernels.tree_attention.tree_attention_mla ({} = the current default kernel)
# (the 5180f72 run's tma64 lazy, tma32 and gather64 lost to tma64.eager everywhere: results/tree_attention_tma_h200.log)
# cut: mla_decode._attend_cut / _cut - the score dots and softmax behind always-taken runtime ifs, so triton's
#   chained-dot rule no longer puts all 8 warps along M: sm_90a SASS per warpgroup and 64-key tile goes from 72
#   HGMMA.64x32x16 (both warpgroups computing the same 64 x 64 score tile, each re-reading Q: ~430 KB of shared
#   memory operand reads a tile) to 36 (~215 KB) + the row max / sum and P crossing the warpgroups in shared
#   memory (STS/LDS.64 x2, STSM x2 / LDSM x4, 11 vs 6 bar.sync); MUFU.EX2 34 -> 18, 827 -> 647 loop instructions.
# fill: mla_decode.splits_fill - one partial wave counts (N16 B1: 8 splits, 128 programs, not 15 / 240 in two
#   waves; B8 P8192: 1 split, no merge kernel; N1 B32: 4 not 8).
CANDIDATES = {
    "default": {},  # csrc/mla_decode_sm90.cu on Hopper (bf16)
    "triton": dict(kernel="mla_decode"),  # tma64, cut + fill (b819f17:bench/results/mla_sweep_cut_h200.log)
    "sm90.mc128": dict(kernel="sm90", min_chunk=128),  # more, shorter splits
    "sm90.mc512": dict(kernel="sm90", min_chunk=512),
}
# (lost at N1 B1 and gone: 129 splits of <= 4 tiles, results/mla_sweep_makespan_h200.log; splits reduced on chip in
# thread-block clusters, results/mla_sm90_cluster_h200.log)
# (B, prefix, N, page_size)
SHAPES = [(1, 32768, 16, 64), (8, 8192, 16, 64), (1, 4096, 16, 64), (1, 32768, 1, 64), (32, 32768, 1, 64),
          (1, 32768, 16, 16)]


def _check(cfg):
    """Max abs error and rel error against float64 on a small (ragged, page 64) and a real shape."""
    from tests.conftest import TOLERANCES, rel_err
    from tests.test_tree_attention import GpuCase, _kernel

    res = []
    for kw in (dict(B=3, prefix=300, N=16, page_size=64), dict(B=1, prefix=32768, N=16, page_size=64)):
        c = GpuCase(5, mla=True, NH=NH, D=D, Dv=DV, kind="bushy", **kw)
        out, lse = _kernel(c, config=cfg or None)
        ref_out, ref_lse = c.truth()
        err = rel_err(out, ref_out)
        mx = float((out.double() - ref_out).abs().max())
        ok = err <= TOLERANCES[torch.bfloat16] and rel_err(lse, ref_lse) <= TOLERANCES[torch.float32]
        res.append(f"P{kw['prefix']}: max {mx:.2e} rel {err:.2e}{'' if ok else ' FAIL'}")
    return res


def main():
    from common import Ceilings, graph_time_us, rotation

    from eagle3_ops.triton_kernels import tree_attention as ta

    t0 = time.time()
    budget = float(os.environ.get("EAGLE3_SWEEP_BUDGET_S", "140"))
    ceil = Ceilings.measure()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  ceilings: copy {ceil.copy_bw / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceil.mm_rate / 1e12:.0f} TFLOP/s", flush=True)
    good = {}
    for name, cfg in CANDIDATES.items():
        try:
            res = _check(cfg)
            print(f"check {name:<12} {cfg}: {'; '.join(res)}  ({time.time() - t0:.0f}s)", flush=True)
            good[name] = cfg
        except Exception as e:  # compile error, out of shared memory
            print(f"check {name:<12} {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
    print(f"\n{'shape':<22} {'candidate':<12} {'us':>9} {'TFLOP/s':>8} {'%mm':>6} {'%copy':>6}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, P, N, ps in SHAPES:
        nbytes, flops = mla_counts(B, P, N)
        sets = [mla_inputs(B, P, N, ps, g) for _ in range(min(rotation(nbytes), 8))]
        shape = f"N{N} B{B} P{P} ps{ps}"
        for name, cfg in good.items():
            if time.time() - t0 > budget:
                print(f"{shape:<22} {name:<12} skipped (past the {budget:.0f} s budget)", flush=True)
                continue

            def call(x, cfg=cfg):
                ta.tree_attention_mla(x["q"], x["k"], x["page_table"], x["prefix_lens"], x["tree_mask"], KIMI_SCALE,
                                      x["out"], x["lse"], config=cfg or None)
            try:
                us = graph_time_us([lambda x=x: call(x) for x in sets], reps=10)
            except Exception as e:
                print(f"{shape:<22} {name:<12} ERROR {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            tf = flops / us * 1e-6
            print(f"{shape:<22} {name:<12} {us:>9.1f} {tf:>8.1f} {100 * flops / us * 1e6 / ceil.mm_rate:>5.1f}% "
                  f"{100 * nbytes / us * 1e6 / ceil.copy_bw:>5.1f}%", flush=True)
        del sets
    print(f"total {time.time() - t0:.0f} s")


# ---- registers and spills without a GPU ------------------------------------------------------------------


def compile_report():
    """Compile each mla_decode candidate for sm_90a as specialised for N16 B1 P32768 page 64 (split) and print
    shared memory, ptxas registers / spills, and the main (whole-tile) loop's spill instructions."""
    import re

    import triton

    from common import compile_sm90a
    from eagle3_ops.triton_kernels import mla_decode as md

    fn = md._mla_kernel
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptrs = {"Q": "*bf16", "K": "*bf16", "O": "*bf16", "PT": "*i32", "PL": "*i32", "TM": "*i32", "LSE": "*fp32",
            "PO": "*fp32", "PLSE": "*fp32", "ERR": "*i64"}
    pages = -(-(32768 + 16) // 64)
    ints = dict(N=16, W=1, NUM_PAGES=pages, CAPACITY=pages * 64, PAGE_SIZE=64, NUM_SPLITS=9, stride_qt=NH * D,
                stride_qh=D, stride_kp=64 * D, stride_ks=D, stride_pt=pages, stride_ot=NH * DV, stride_oh=DV)
    for name, cfg in CANDIDATES.items():
        if "tma" not in cfg and cfg.get("kernel") != "mla_decode":  # (the CUDA candidates: ptxas -v of the build)
            continue
        full = dict(md.default_config(torch.bfloat16), tma=True)  # as tree_attention.tree_attention_mla calls it
        full.update({k: v for k, v in cfg.items() if k != "kernel"})
        bn, tma = full["BLOCK_N"], full["tma"]
        const = dict(G=NH, DV=DV, DR=D - DV, BLOCK_H=DV // 2, BLOCK_R=D - DV, BLOCK_M=full["BLOCK_M"], BLOCK_N=bn,
                     SPLIT=True, HAS_LSE=True, TMA=tma, TAU=float(full["rescale_tau"]), DOT_PREC="tf32",
                     CUT=bool(full.get("cut", False)))
        types = dict(ptrs, scale_log2="fp32")
        for n in ("KA", "KR"):  # TMA descriptors, or unused (None) on the gathered path
            if tma:
                types[n] = f"tensordesc<bf16[{bn}, {DV // 2 if n == 'KA' else D - DV}]>"
            else:
                const[n] = None
        try:
            k, info, stderr, cubin = compile_sm90a(fn, const, types, ints, full["num_warps"], full["num_stages"],
                                                   "sweep_mla")
        except Exception as e:
            print(f"{name:<12} compile error {type(e).__name__}: {str(e)[:200]}")
            continue
        if "C7515" in stderr:  # ptxas serialised the wgmmas (register pressure): a wait after each one
            info += "; WGMMA SERIALISED (ptxas C7515)"
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True).stdout
        ins = [(int(m.group(1), 16), m.group(2)) for m in
               (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", line) for line in sass.splitlines()) if m]
        main_loop = ""
        for addr, txt in ins:  # the first backward branch closes the whole-tile loop
            m = re.search(r"BRA (0x[0-9a-f]+)", txt)
            if m and int(m.group(1), 16) < addr:
                body = [x for a, x in ins if int(m.group(1), 16) <= a <= addr]
                main_loop = (f"main loop: {len(body)} instr, {sum('HGMMA' in x for x in body)} HGMMA, "
                             f"{sum('STL' in x or 'LDL' in x for x in body)} spill ld/st")
                break
        print(f"{name:<12} {cfg}\n    shared {k.metadata.shared}; {info}; {main_loop}")


if __name__ == "__main__":
    if "--compile" in sys.argv:
        compile_report()
    else:
        main()
