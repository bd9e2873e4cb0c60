"""The serve-time wiring check's cost (issue 27): a speculative round's device time with the check on and off,
in one run, at the same prompts and prefill (engine/wiring_check.py; docs/wiring.md).

    python3 bench/bench_wiring_check.py                          # on the H200: kimi-k2-slice, bf16, round graphs
    python3 bench/bench_wiring_check.py --preset tiny --device cpu --dtype float32 --prefix 32 --max-new 16

Each repeat runs the check off, then on (the order alternates between repeats), every round replayed from one
CUDA graph (graphs="round") and timed by CUDA events around it (DecodeStats.round_seconds: the rounds' device
span, the host's waits out), the prefill shared through a PrefillCache. Printed per setting: the median
time a round with the check off and on, their difference, the repeats' spread (max - min of the off runs:
the noise), and the check's own span inside the graph (the "check" component). Synthesised weights: the
drafter predicts nothing, which changes no shape or launch of a round. Rows go to --json, else
$EAGLE3_BENCH_OUT/wiring_check.json, else ./wiring_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run(args) -> list[dict]:
    from eagle3_ops.cli import _load_pair
    from eagle3_ops.engine import PrefillCache, SpecConfig, Timer, generate_speculative
    from eagle3_ops.engine.wiring_check import WiringCheck, WiringWarning

    import warnings

    warnings.simplefilter("ignore", WiringWarning)  # synthesised weights: the check rightly flags them
    dtype = getattr(torch, args.dtype)
    target, drafter, label = _load_pair(args.preset, args.device, dtype)
    graphs = "round" if args.device.startswith("cuda") else False
    rows = []
    for B in args.batch:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, target.cfg.vocab_size, (B, args.prefix), generator=g).to(args.device)
        for steps, topk, num_tokens in args.spec:
            spec = SpecConfig(steps=steps, topk=topk, num_tokens=num_tokens)
            cache = PrefillCache()
            times = {False: [], True: []}
            check_ms = []
            for r in range(args.repeats + 1):  # repeat 0 warms up (Triton compiles, graph pools)
                for on in ((False, True) if r % 2 else (True, False)):
                    timer = Timer(device=args.device, mode="events")
                    _, stats = generate_speculative(target, drafter, prompts, args.max_new, spec, timer=timer,
                                                    graphs=graphs, prefill_cache=cache,
                                                    wiring_check=WiringCheck() if on else None)
                    if r == 0:
                        continue
                    span = stats.round_seconds or (stats.seconds - stats.prefill_seconds - stats.setup_seconds)
                    times[on].append(span / max(stats.rounds, 1) * 1e3)
                    if on:
                        check_ms.append(stats.times.get("check", 0.0) / max(stats.rounds, 1) * 1e3)
            off, on = statistics.median(times[False]), statistics.median(times[True])
            row = dict(preset=args.preset, batch=B, prefix=args.prefix, spec=f"{steps}/{topk}/{num_tokens}",
                       graphs=bool(graphs), round_ms_off=off, round_ms_on=on, diff_ms=on - off,
                       noise_ms=max(times[False]) - min(times[False]), check_span_ms=statistics.median(check_ms),
                       repeats=args.repeats, off_runs=times[False], on_runs=times[True])
            rows.append(row)
            print(f"B {B:3d} prefix {args.prefix:6d} spec {row['spec']:>8}: round {off:8.3f} ms off, {on:8.3f} ms on, "
                  f"diff {on - off:+7.3f} ms (noise {row['noise_ms']:.3f} ms), check's span "
                  f"{row['check_span_ms'] * 1e3:.1f} us", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k2-slice")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--max-new", type=int, default=61)
    ap.add_argument("--spec", type=lambda s: tuple(int(x) for x in s.split("/")), nargs="+",
                    default=[(3, 1, 4), (4, 4, 16)], metavar="STEPS/TOPK/TOKENS")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = run(args)
    out = args.json or os.path.join(os.environ.get("EAGLE3_BENCH_OUT", "."), "wiring_check.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                       torch=torch.__version__, rows=rows), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
