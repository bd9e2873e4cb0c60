"""Where the host and the device spend a speculative round (issue 7): one run of the graphed decode loop on a
Kimi-shaped target with the ORACLE drafter, (1) under torch.cuda.set_sync_debug_mode("warn"), each host sync
named by the line that caused it, and (2) under torch.profiler: the device's busy time against the decode
phase's wall time (its idle gaps are host launch time the device waits for), and the ops by host and device
time.

    python3 bench/profile_e2e.py --batch 1 --prefix 4096 --spec "chain 3/1/4" --p 1.0
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _busy_us(events) -> float:
    """The union of the device kernels' and copies' intervals, in us."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + ((cur_e - cur_s) if cur_e is not None else 0.0)


def main(argv=None) -> int:
    from bench_e2e import SPECS
    from eagle3_ops.cli import _load_pair
    from eagle3_ops.engine import SpecConfig, generate_plain, generate_speculative
    from eagle3_ops.engine.oracle import OracleDrafter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kimi-k2-slice")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--spec", default="chain 3/1/4", choices=list(SPECS))
    ap.add_argument("--p", type=float, default=1.0)
    ap.add_argument("--max-new", type=int, default=61)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    args = ap.parse_args(argv)
    graphs = not args.eager
    target, drafter, _ = _load_pair(args.preset, "cuda", torch.bfloat16)
    V = target.cfg.vocab_size
    prompts = torch.randint(0, V, (args.batch, args.prefix), generator=torch.Generator().manual_seed(1)).cuda()
    reference, _ = generate_plain(target, prompts, args.max_new, graphs=graphs)
    spec = SpecConfig(**SPECS[args.spec])
    # the oracle's reference: the run's own output (in bf16 a speculative run can leave plain greedy's tokens at
    # a near-tie, after which a reference from elsewhere misleads the oracle: bench_e2e's --fixpoint), found in
    # at most 6 passes; the passes are the warm-up
    for _ in range(6):
        oracle = OracleDrafter(drafter, torch.cat([prompts, reference], 1), args.p, V, start=args.prefix - 1)
        out, _ = generate_speculative(target, oracle, prompts, args.max_new, spec, graphs=graphs)
        if torch.equal(out, reference):
            break
        reference = out
    else:
        print("WARNING: the run did not reach its own output in 6 passes: the oracle's reference is the last "
              "run's output, and its acceptance can fall below p's", flush=True)
    oracle = OracleDrafter(drafter, torch.cat([prompts, reference], 1), args.p, V, start=args.prefix - 1)

    # (1) host syncs, by the line that caused them
    syncs = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, st = generate_speculative(target, oracle, prompts, args.max_new, spec, graphs=graphs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            syncs[f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"] += 1
    print(f"{args.spec}, B {args.batch}, prefix {args.prefix}, p {args.p}, {'graphs' if graphs else 'eager'}: "
          f"{st.rounds} rounds, acceptance {st.acceptance_length:.2f}")
    print("host syncs (set_sync_debug_mode), by line:")
    for where, n in syncs.most_common():
        print(f"  {n:5d}  {where}")

    # (2) the profile of one run: the device's busy time against the decode phase's wall time
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    oracle.calls.zero_()  # (the same draws as the run above)
    with torch.profiler.profile(activities=acts) as prof:
        _, st = generate_speculative(target, oracle, prompts, args.max_new, spec, graphs=graphs)
    decode_us = (st.seconds - st.prefill_seconds - st.setup_seconds) * 1e6
    evs = prof.events()
    start = min(e.time_range.start for e in evs)
    # the decode phase: device work after the prefill's last kernel (the prefill ends on a sync)
    prefill_end = start + st.prefill_seconds * 1e6
    decode_evs = [e for e in evs if e.time_range.start >= prefill_end]
    busy = _busy_us(decode_evs)
    print(f"decode phase {decode_us / 1e3:.2f} ms over {st.rounds} rounds ({decode_us / 1e3 / st.rounds:.3f} ms a "
          f"round, profiler on); device busy {busy / 1e3:.2f} ms ({100 * busy / decode_us:.1f}%), idle "
          f"{(decode_us - busy) / 1e3 / st.rounds:.3f} ms a round")
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    print(ka.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60))
    out = os.environ.get("EAGLE3_BENCH_OUT")
    if out:
        prof.export_chrome_trace(os.path.join(out, "profile_e2e_trace.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
