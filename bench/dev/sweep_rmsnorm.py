"""add_rmsnorm_capture launch variants at Kimi width (H = 7168, bf16), timed as bench_capture.py times them.

    python bench/dev/sweep_rmsnorm.py            # about 10 s of GPU time (with the extension built)

Each variant is an EAGLE3_ADD_RMSNORM_VARIANT value (csrc/add_rmsnorm_capture.cu, `Variant`): pdl=0|1
(programmatic dependent launch), shape=wide|lean (rows in flight per SM at T >= 264) and occ=N (at most N
blocks an SM). The launcher re-reads the variable at every call only when it was set at the first call, so it is set here
before the op is first called. A plain copy of the same bytes gives each T's ceiling in this run. Every
variant is checked once against PyTorch (residual and aux bit-exact, x within bf16 rounding).
"""

from __future__ import annotations

import os
import statistics

os.environ["EAGLE3_ADD_RMSNORM_VARIANT"] = ""  # before the first call: the launcher then reads it per call

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _shared  # noqa: E402,F401  (first: puts the checkout and bench/ on sys.path)
from bench_capture import EPS, H, SLOT, copy_sets, input_sets  # noqa: E402  (the same inputs as the benchmark)
from common import Ceilings, graph_time_us  # noqa: E402

TS = [1, 512, 1024, 4096]
ROUNDS = 3  # medians over rounds, each round visiting every variant (drift hits all alike)
# (fec4ec8's run, results/add_rmsnorm_sweep_h200.log: pdl=1,shape=lean became the default below T = 2048.)
# occ=N caps the blocks an SM: T = 512 as two waves of 2 rows an SM (reads of one overlapping writes of the other);
# at 6501455 every occ variant lost (results/add_rmsnorm_occ_h200.log)
VARIANTS = ["pdl=1,shape=wide", "pdl=1,shape=lean,occ=2", "pdl=1,shape=lean,occ=3", "pdl=1,shape=wide,occ=2",
            "pdl=1,shape=lean"]  # the last: default


def _op(x, r, w, aux):
    torch.ops.eagle3.add_rmsnorm_capture(x, r, w, EPS, aux, SLOT, None)


def _check(variant):
    os.environ["EAGLE3_ADD_RMSNORM_VARIANT"] = variant
    for T in (1, 512):
        (x, r, w, aux), = input_sets(T, True)[0][:1]
        x0, r0 = x.clone(), r.clone()
        _op(x, r, w, aux)
        new_res = x0 + r0
        assert torch.equal(r, new_res), f"{variant!r} T={T}: residual"
        assert torch.equal(aux[:, SLOT * H:(SLOT + 1) * H], new_res), f"{variant!r} T={T}: aux"
        ref = F.rms_norm(new_res.float(), (H,), w.float(), EPS)
        err = ((x.float() - ref).norm() / ref.norm()).item()
        assert err <= 4e-3, f"{variant!r} T={T}: x rel err {err:.3g}"


def main():
    ceil = Ceilings.measure()
    for v in VARIANTS:
        _check(v)
    cases = [(T, cap) for T in TS for cap in (False, True)]
    times = {(v, c): [] for v in VARIANTS + ["copy"] for c in cases}
    for _ in range(ROUNDS):
        for T, cap in cases:
            sets, _ = input_sets(T, cap)
            for v in VARIANTS:
                os.environ["EAGLE3_ADD_RMSNORM_VARIANT"] = v  # read when the graph is captured
                times[(v, (T, cap))].append(graph_time_us([lambda s=s: _op(*s) for s in sets]))
            copies, _ = copy_sets(T, cap)
            times[("copy", (T, cap))].append(graph_time_us([lambda d=d, s=s: d.copy_(s) for d, s in copies]))
            del sets, copies
    print(f"copy ceiling {ceil.copy_bw / 1e12:.2f} TB/s; us per call (median of {ROUNDS}) and % of the copy-ceiling floor")
    head = " ".join(f"{f'T={T}' + (' cap' if cap else ''):>16}" for T, cap in cases)
    print(f"{'variant':<20} {head}")
    for v in VARIANTS + ["copy"]:
        cells = []
        for T, cap in cases:
            us = statistics.median(times[(v, (T, cap))])
            floor = (4 * T * H * 2 + (T * H * 2 if cap else 0)) / ceil.copy_bw * 1e6
            cells.append(f"{us:8.2f} {100 * floor / us:5.1f}%")
        print(f"{('copy(same bytes)' if v == 'copy' else v):<20} {' '.join(f'{c:>16}' for c in cells)}")


if __name__ == "__main__":
    main()
