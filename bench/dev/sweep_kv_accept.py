"""kv_accept's bulk-copy path under different staging / pipeline / cluster settings (a tuning aid, not a
benchmark): python bench/dev/sweep_kv_accept.py [--ncu]. Same caches and patterns as bench_kv_accept.py;
prints us per (setting, shape) and, for reference, a plain device copy of the same bytes in the same run.
Settings are EAGLE3_KV_ACCEPT_TUNE="staging_kb,stages,max_cluster" (csrc/kv_accept.cu: bulk_tuning) and
EAGLE3_KV_ACCEPT_PDL=1 (programmatic dependent launch, off by default: it lost at B 64, results/kv_accept_sweep_h200.log).
--ncu: a few calls of the default setting at B 64, for `ncu -k regex:kv_accept`."""

from __future__ import annotations

import os
import sys

import torch

import _shared  # noqa: F401  (first: puts the checkout and bench/ on sys.path)
import bench_kv_accept as bk  # noqa: E402
from common import Ceilings, graph_time_us, rotation  # noqa: E402

# The 140537f run (results/kv_accept_sweep_h200.log): 36,2,8 won at B 64 (14.92 us vs 15.50 for one slot);
# PDL lost at B 64. Default is now two slots; these bracket it.
SETTINGS = [("", "0"), ("", "1"), ("36,1,8", "0"), ("36,3,8", "0"), ("30,2,8", "0"), ("42,2,8", "0"),
            ("36,2,4", "0"), ("36,4,8", "0")]  # (tune, EAGLE3_KV_ACCEPT_PDL)
SHAPES = [(64, "all_move"), (1, "all_move"), (64, "chain")]


def time_setting(setting, B, pattern):
    os.environ["EAGLE3_KV_ACCEPT_TUNE"], os.environ["EAGLE3_KV_ACCEPT_PDL"] = setting
    caches, page_table, starts, nodes, lens, nbytes, region = bk.setup(B, pattern)
    prefixes = [s.clone() for s in starts]
    calls = [lambda p=p: bk.eagle3_accept(caches, page_table, p, nodes, lens) for p in prefixes]
    return graph_time_us(calls, reps=20), nbytes


def copy_same_bytes(nbytes):
    sets = rotation(nbytes)
    pairs = [(torch.empty(nbytes // 4, dtype=torch.int16, device="cuda"),
              torch.empty(nbytes // 4, dtype=torch.int16, device="cuda")) for _ in range(sets)]
    return graph_time_us([lambda s=s, d=d: d.copy_(s) for s, d in pairs], reps=20)


def main():
    if "--ncu" in sys.argv:
        caches, page_table, starts, nodes, lens, _, _ = bk.setup(64, "all_move")
        for k in range(4):
            bk.eagle3_accept(caches, page_table, starts[k % len(starts)], nodes, lens)
        torch.cuda.synchronize()
        return
    c = Ceilings.measure()
    print(f"copy {c.copy_bw / 1e12:.2f} TB/s")
    for B, pattern in SHAPES:
        for setting in SETTINGS:
            us, nbytes = time_setting(setting, B, pattern)
            floor = nbytes / c.copy_bw * 1e6
            name = f"{setting[0] or 'default'}{' pdl' if setting[1] == '1' else ''}"
            print(f"B{B:<3} {pattern:<9} tune {name:<12} {us:8.2f} us  floor {floor:6.2f} us "
                  f"({100 * floor / us:5.1f}%)", flush=True)
        if nbytes:
            us = copy_same_bytes(nbytes)
            print(f"B{B:<3} {pattern:<9} copy of the same bytes {us:8.2f} us ({100 * floor / us:5.1f}% of copy rate)",
                  flush=True)
    os.environ.pop("EAGLE3_KV_ACCEPT_TUNE", None)
    os.environ.pop("EAGLE3_KV_ACCEPT_PDL", None)


if __name__ == "__main__":
    main()
