"""The serve-time wiring check's cost (issue 27): a speculative round's device time with the check on and off,
in one run, at the same prompts and prefill (engine/wiring_check.py; docs/wiring.md).

    python3 bench/bench_wiring_check.py                          # on the H200: kimi-k2-slice, bf16, round graphs
    python3 bench/bench_wiring_check.py --preset tiny --device cpu --dtype float32 --prefix 32 --max-new 16
    python3 bench/bench_wiring_check.py --heldout --batch 1 4    # the verdicts on the shipped pair (CPU)
    python3 bench/bench_wiring_check.py --record --write         # re-measure the shipped drafter's record

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
    from eagle3_ops.engine.wiring_check import CONFIDENCE_EDGES, WiringCheck, WiringRecord, WiringWarning

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
            nb, n_aux = len(CONFIDENCE_EDGES) + 1, len(drafter.cfg.aux_ids)
            # a record for these settings, so that the check runs both tests (its numbers change no launch)
            record = WiringRecord(steps, topk, num_tokens, 0.0, (100,) * nb, (90,) * nb, (-8.0,) * n_aux,
                                  (8.0,) * n_aux, 1000, 10)
            cache = PrefillCache()
            times = {False: [], True: []}
            check_ms = []
            for r in range(args.repeats + 1):  # repeat 0 warms up (Triton compiles, graph pools)
                for on in ((False, True) if r % 2 else (True, False)):
                    timer = Timer(device=args.device, mode="events")
                    _, stats = generate_speculative(target, drafter, prompts, args.max_new, spec, timer=timer,
                                                    graphs=graphs, prefill_cache=cache,
                                                    wiring_check=WiringCheck(record=record) if on else None)
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


def _heldout_batches(first: int, last: int, B: int):
    """The held-out prompts first..last - 1, B at a time, each cut to the batch's shortest (its last tokens)."""
    from eagle3_ops import data

    prompts = [data.encode(p) for p in data.load_heldout_prompts()[first:last]]
    for i in range(0, len(prompts), B):
        n = min(len(p) for p in prompts[i:i + B])
        yield first + i, torch.stack([p[-n:] for p in prompts[i:i + B]])


WIRINGS = {"trained": [1, 5, 6], "seed": [-1, 0, 4], "plus-one": [2, 6, 7]}


def heldout(args) -> list[dict]:
    """The shipped pair (CPU, fp32, greedy 3/1/4, 64 new tokens): the check's verdict per request and wiring."""
    import warnings

    from eagle3_ops.cli import _load_pair
    from eagle3_ops.engine import SpecConfig, generate_speculative
    from eagle3_ops.engine.wiring_check import WiringCheck

    target, drafter, _ = _load_pair("byte-small", "cpu", torch.float32)
    drafter_dir = os.path.join(ROOT, "eagle3_ops", "assets", "byte-small", "drafter")
    first, last = args.prompts
    rows = []
    for name in args.wirings:
        ids = WIRINGS[name]
        for B in args.batch:
            for p0, prompts in _heldout_batches(first, last, B):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _, st = generate_speculative(target, drafter, prompts, 64, SpecConfig(), aux_ids=ids,
                                                 wiring_check=WiringCheck.for_drafter(drafter_dir))
                w = st.wiring
                for b in range(prompts.shape[0]):
                    rows.append(dict(wiring=name, batch=B, prompt=p0 + b, flagged_round=w.first_round[b],
                                     acceptance_evidence=w.evidence[b][0], feature_evidence=w.evidence[b][1]))
                print(f"{name:9s} B {B} prompts {p0:2d}-{p0 + B - 1:2d}: acceptance length {w.acceptance_length:.2f}"
                      f", flagged in round {w.first_round} (evidence, nats: {w.evidence}; threshold "
                      f"{w.threshold:.1f})", flush=True)
    return rows


def record(args) -> dict:
    """Measure the shipped drafter's record (trained wiring, prompts 20-63 at batch 4 and batch 1, every round)."""
    from eagle3_ops.cli import _load_pair
    from eagle3_ops.engine import SpecConfig
    from eagle3_ops.engine.wiring_record import record_wiring

    target, drafter, _ = _load_pair("byte-small", "cpu", torch.float32)
    batches = [b for B in (4, 1) for _, b in _heldout_batches(20, 64, B)]
    rec = record_wiring(target, drafter, batches, SpecConfig(), 64, measured=(
        "aux ids [1, 5, 6] (trained), fp32 on CPU, greedy, held-out prompts 20-63 in batches of 4 and of 1, 64 new "
        "tokens, every round (bench/bench_wiring_check.py --record)"))
    return rec.to_config()


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
    ap.add_argument("--heldout", action="store_true",
                    help="instead: the check's verdicts on the shipped pair (CPU) for the trained wiring, the seed's "
                         "and a +1 shift, on held-out prompts --prompts (default 0 20) at each --batch")
    ap.add_argument("--prompts", type=int, nargs=2, default=[0, 20], metavar=("FIRST", "END"))
    ap.add_argument("--wirings", nargs="+", default=list(WIRINGS), choices=list(WIRINGS))
    ap.add_argument("--record", action="store_true",
                    help="instead: measure the shipped drafter's eagle3_ops_wiring_record and print it; with --write "
                         "store it in its config.json")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.record:
        entry = record(args)
        print(json.dumps(entry, indent=1))
        if args.write:
            path = os.path.join(ROOT, "eagle3_ops", "assets", "byte-small", "drafter", "config.json")
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            config.update(entry)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2, sort_keys=True)
                f.write("\n")
            print(f"wrote {path}")
        return
    rows = heldout(args) if args.heldout else run(args)
    out = args.json or os.path.join(os.environ.get("EAGLE3_BENCH_OUT", "."), "wiring_check.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                       torch=torch.__version__, rows=rows), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
