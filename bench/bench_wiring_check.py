"""The serve-time wiring check's cost (issue 27): a speculative round's device time with the check on and off,
in one run, at the same prompts and prefill (engine/wiring_check.py; docs/wiring.md).

    python3 bench/bench_wiring_check.py                          # on the H200: kimi-k2-slice, bf16, round graphs
    python3 bench/bench_wiring_check.py --impl auto torch        # the kernels and the torch code, same off runs
    python3 bench/bench_wiring_check.py --impl auto auto:inline  # the side stream (the default) against in line
    python3 bench/bench_wiring_check.py --preset tiny --device cpu --dtype float32 --prefix 32 --max-new 16
    python3 bench/bench_wiring_check.py --heldout --batch 1 4    # the verdicts on the shipped pair (CPU)
    python3 bench/bench_wiring_check.py --record --write         # re-measure the shipped drafter's record

Each repeat runs the check off, then on with each --impl (the order reverses between repeats), every round
replayed from one CUDA graph (graphs="round") and timed by CUDA events around it (DecodeStats.round_seconds:
the rounds' device span, the host's waits out), the prefill shared through a PrefillCache. Printed per setting
and impl: the median time a round with the check off and on, their difference, the repeats' spread (max - min
of the off runs: the noise), the check's own span inside the graph (the "check" component), and what it
launches a round (count_kernels on one eager CheckRun.observe at the round's shapes: Triton launches, torch ops
that run a kernel, host syncs). --impl torch times the torch code that the kernels replaced beside them; an
impl with ":inline" runs the update on the round's stream (WiringCheck.overlap=False) instead of the side stream
(where the round has no "check" span: it runs beside the round, untimed).
Synthesised weights: the drafter predicts nothing, which changes no shape or launch of a round. Rows go to
--json, else $EAGLE3_BENCH_OUT/wiring_check.json, else ./wiring_check.json.
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


# ops that launch no kernel: allocations, and views (func.is_view) are told apart by name / schema
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "alias", "_local_scalar_dense"}


def count_kernels(fn, *args, **kwargs) -> dict:
    """Run fn(*args, **kwargs) once, counting what it launches: torch ops that launch a kernel (a dispatch-mode
    trace less views and allocations: aten op names, each kernel that op runs on CUDA), Triton launches (kernel
    names; the torch ops Triton's interpreter runs inside one are not counted) and host syncs
    (_local_scalar_dense: an .item() or a bool of a device tensor). Works on CPU tensors and under
    TRITON_INTERPRET=1, where nothing runs on a GPU: it counts the launches, not their time."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.jit import KernelInterface

    seen = dict(torch=[], triton=[], syncs=0)
    inside = [0]  # > 0 while a Triton launch runs (the interpreter's own torch ops)

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside[0]:
                if name == "_local_scalar_dense":
                    seen["syncs"] += 1
                if not (func.is_view or name in _NO_KERNEL):
                    seen["torch"].append(name)
            return func(*args, **(kwargs or {}))

    launch = KernelInterface.__getitem__

    def counted(self, grid):
        run = launch(self, grid)

        def go(*a, **k):
            seen["triton"].append(getattr(self, "__name__", type(self).__name__))
            inside[0] += 1
            try:
                return run(*a, **k)
            finally:
                inside[0] -= 1
        return go

    KernelInterface.__getitem__ = counted
    try:
        with Trace():
            fn(*args, **kwargs)
    finally:
        KernelInterface.__getitem__ = launch
    return seen


def _check(record, impl: str):
    """WiringCheck for an --impl value: "auto", "torch", "triton", or one of them + ":inline" (overlap off)."""
    from eagle3_ops.engine.wiring_check import WiringCheck

    name, _, mode = impl.partition(":")
    return WiringCheck(record=record, impl=name, overlap=mode != "inline")


def check_launches(B: int, spec, V: int, H: int, n_aux: int, device, dtype, impl: str) -> dict:
    """count_kernels of one CheckRun.observe as the decode loop calls it (a record for the settings, so both
    tests run; random logits and features of the round's shapes)."""
    from eagle3_ops.engine.wiring_check import CONFIDENCE_EDGES, CheckRun, WiringRecord

    nb, N = len(CONFIDENCE_EDGES) + 1, spec.num_tokens
    record = WiringRecord(spec.steps, spec.topk, N, float(spec.temperature), (100,) * nb, (90,) * nb,
                          (-8.0,) * n_aux, (8.0,) * n_aux, 1000, 10)
    ids = list(range(n_aux))
    run = CheckRun(_check(record, impl), ids, ids, n_aux + 1, spec, torch.device(device), B)
    logits = torch.randn(B * N, V, device=device).to(dtype)
    aux = torch.randn(B * N, n_aux * H, device=device).to(dtype)
    nodes = torch.arange(N, dtype=torch.int32, device=device).repeat(B, 1)
    accept_len = torch.full((B,), N - 1, dtype=torch.int32, device=device)
    count = torch.zeros(B, dtype=torch.int64, device=device)
    run.observe(logits, nodes, accept_len, aux, count=count, max_new=64)  # (compiles the kernels first)
    return count_kernels(run.observe, logits, nodes, accept_len, aux, count=count, max_new=64)


def run(args) -> list[dict]:
    from eagle3_ops.cli import _load_pair
    from eagle3_ops.engine import PrefillCache, SpecConfig, Timer, generate_speculative
    from eagle3_ops.engine.wiring_check import CONFIDENCE_EDGES, WiringRecord, WiringWarning

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
            variants = [None] + list(args.impl)  # the check off, then on with each impl
            times = {v: [] for v in variants}
            check_ms = {v: [] for v in args.impl}
            for r in range(args.repeats + 1):  # repeat 0 warms up (Triton compiles, graph pools)
                for v in (variants if r % 2 else variants[::-1]):
                    timer = Timer(device=args.device, mode="events")
                    _, stats = generate_speculative(
                        target, drafter, prompts, args.max_new, spec, timer=timer, graphs=graphs, prefill_cache=cache,
                        wiring_check=_check(record, v) if v is not None else None)
                    if r == 0:
                        continue
                    span = stats.round_seconds or (stats.seconds - stats.prefill_seconds - stats.setup_seconds)
                    times[v].append(span / max(stats.rounds, 1) * 1e3)
                    if v is not None:
                        check_ms[v].append(stats.times.get("check", 0.0) / max(stats.rounds, 1) * 1e3)
            off = statistics.median(times[None])
            for v in args.impl:
                launches = check_launches(B, spec, target.cfg.vocab_size, target.cfg.hidden_size, n_aux,
                                          args.device, dtype, v)
                on = statistics.median(times[v])
                row = dict(preset=args.preset, batch=B, prefix=args.prefix, spec=f"{steps}/{topk}/{num_tokens}",
                           graphs=bool(graphs), impl=v, round_ms_off=off, round_ms_on=on, diff_ms=on - off,
                           noise_ms=max(times[None]) - min(times[None]), check_span_ms=statistics.median(check_ms[v]),
                           check_kernels=len(launches["torch"]) + len(launches["triton"]),
                           check_torch_ops=launches["torch"], check_triton=launches["triton"],
                           check_syncs=launches["syncs"], repeats=args.repeats, off_runs=times[None],
                           on_runs=times[v])
                rows.append(row)
                print(f"B {B:3d} prefix {args.prefix:6d} spec {row['spec']:>8} {v:>11}: round {off:8.3f} ms off, "
                      f"{on:8.3f} ms on, diff {on - off:+7.3f} ms (noise {row['noise_ms']:.3f} ms), check's span "
                      f"{row['check_span_ms'] * 1e3:.1f} us, {row['check_kernels']} kernels a round "
                      f"({len(launches['triton'])} Triton, {len(launches['torch'])} torch ops), "
                      f"{launches['syncs']} host syncs", flush=True)
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
    ap.add_argument("--impl", nargs="+", default=["auto"],
                    choices=[i + m for i in ("auto", "torch", "triton") for m in ("", ":inline")],
                    help="the check's update (WiringCheck.impl), each timed against the same off runs: auto = the "
                         "Triton kernels on CUDA, torch = the torch code they replaced; ':inline': on the round's "
                         "stream (WiringCheck.overlap=False), else on its side stream")
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
