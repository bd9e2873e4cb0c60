"""End to end (issue 7): plain against speculative decoding of a Kimi-shaped target in one run, with the step's
glue through our ops and done the plain-PyTorch way (engine/torch_glue.py), an acceptance-controlled ORACLE
drafter (engine/oracle.py: the target's own greedy tokens, each corrupted with probability 1 - p; its forwards
are the real drafter's), and the per-component breakdown of a step.

    python3 bench/bench_e2e.py                                  # on the H200: kimi-k2-slice, bf16
    python3 bench/bench_e2e.py --preset tiny --device cpu --dtype float32 --prefix 32 --max-new 16
    python3 bench/bench_e2e.py --plot bench/results/e2e_h200.json   # the chart, where matplotlib is installed

For every batch x prefix: a plain run (the reference tokens and the baseline), then per spec setting, p and
glue one untimed run (tokens/s of the decode phase: after the prefill, whose time is kept apart) and one run
with each component fenced by device syncs (the breakdown; those syncs make it slower, so only its shares are
used). Every speculative run's tokens are compared with the plain run's ("identical"): in bf16 they can differ
unless --batch-invariant (Target.batch_invariant_rows, a correctness mode, not a speed figure).

Eager, no CUDA graphs yet: host launch costs are in every figure. Rows go to $EAGLE3_BENCH_OUT/e2e.json (or
--json), with the commit, the GPU and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SPECS = {"chain 3/1/4": dict(steps=3, topk=1, num_tokens=4),  # as Kimi deployments run it
         "tree 4/4/16": dict(steps=4, topk=4, num_tokens=16)}
GLUE_PARTS = ("fc", "build_tree", "verify", "kv_accept")  # timed outside the forwards (capture is inside them)


def _commit() -> str:
    env = os.environ.get("EAGLE3_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _pair(preset: str, device: str, dtype: torch.dtype):
    from eagle3_ops.models.config import DrafterConfig, TargetConfig
    from eagle3_ops.models.drafter import Drafter
    from eagle3_ops.models.target import Target

    cfg = TargetConfig.from_preset(preset)
    target = Target.synthesize(cfg, 0, dtype, device=device).eval()
    drafter = Drafter.synthesize(DrafterConfig.for_target(cfg), target.model.embed_tokens, 1, dtype,
                                 device=device).eval()
    return target, drafter


def run(args) -> list[dict]:
    from eagle3_ops.engine import SpecConfig, Timer, generate_plain, generate_speculative
    from eagle3_ops.engine.oracle import OracleDrafter

    dtype = getattr(torch, args.dtype)
    target, drafter = _pair(args.preset, args.device, dtype)
    V = target.cfg.vocab_size
    rows = []
    for B in args.batch:
        for prefix in args.prefix:
            g = torch.Generator(device="cpu").manual_seed(B * 100003 + prefix)
            prompts = torch.randint(0, V, (B, prefix), generator=g).to(args.device)
            specs = {k: SpecConfig(**v) for k, v in SPECS.items() if k in args.spec}
            target.batch_invariant_rows = B * max(s.num_tokens for s in specs.values()) if args.batch_invariant else 0
            generate_plain(target, prompts, min(4, args.max_new))  # warm-up (compiles, allocator)
            reference, plain = generate_plain(target, prompts, args.max_new)
            print(f"B {B} prefix {prefix}: plain {plain.decode_tokens_per_s:.1f} tok/s decode "
                  f"(prefill {plain.prefill_seconds * 1e3:.0f} ms)", flush=True)
            for name, spec in specs.items():
                for p in args.p:
                    oracle = OracleDrafter(drafter, torch.cat([prompts, reference], 1), p, V)
                    for glue in args.glue:
                        generate_speculative(target, oracle, prompts, min(2 * spec.num_tokens, args.max_new), spec,
                                             glue=glue)  # warm-up at these shapes
                        out, st = generate_speculative(target, oracle, prompts, args.max_new, spec, glue=glue)
                        timer = Timer(device=args.device)
                        _, timed = generate_speculative(target, oracle, prompts, args.max_new, spec, glue=glue,
                                                        timer=timer)
                        decode_s = timed.seconds - timed.prefill_seconds
                        parts = {k: v - timed.prefill_times.get(k, 0.0) for k, v in timed.times.items()}  # decode only
                        other = max(0.0, decode_s - sum(parts.values()))
                        steps = max(st.rounds, 1)
                        row = dict(batch=B, prefix=prefix, spec=name, p=p, glue=glue, drafter="ORACLE",
                                   plain_tok_s=plain.decode_tokens_per_s, spec_tok_s=st.decode_tokens_per_s,
                                   speedup=st.decode_tokens_per_s / max(plain.decode_tokens_per_s, 1e-12),
                                   accept_len=st.acceptance_length, rounds=st.rounds,
                                   step_ms=(st.seconds - st.prefill_seconds) / steps * 1e3,
                                   identical=bool(torch.equal(out, reference)),
                                   timed_step_ms={k: v / max(timed.rounds, 1) * 1e3 for k, v in parts.items()},
                                   timed_other_ms=other / max(timed.rounds, 1) * 1e3,
                                   glue_share=sum(parts.get(k, 0.0) for k in GLUE_PARTS) / max(decode_s, 1e-12))
                        rows.append(row)
                        print(f"  {name:<12} p {p:<4} glue {glue:<6} {row['spec_tok_s']:8.1f} tok/s "
                              f"{row['speedup']:5.2f}x  accept {row['accept_len']:.2f}  step {row['step_ms']:.2f} ms  "
                              f"glue {100 * row['glue_share']:.1f}%  identical {'yes' if row['identical'] else 'NO'}",
                              flush=True)
    return rows


def _table(rows: list[dict]) -> str:
    head = ("| B | prefix | spec | p | glue | plain tok/s | spec tok/s | speed-up | accept | step ms | "
            "target / draft / fc / build_tree / verify / kv_accept / other ms (fenced run) | glue share | identical |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        t = r["timed_step_ms"]
        parts = " / ".join(f"{t.get(k, 0.0):.2f}" for k in ("target", "draft", "fc", "build_tree", "verify",
                                                               "kv_accept")) + f" / {r['timed_other_ms']:.2f}"
        lines.append(f"| {r['batch']} | {r['prefix']} | {r['spec']} | {r['p']} | {r['glue']} | {r['plain_tok_s']:.1f} | "
                     f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['accept_len']:.2f} | {r['step_ms']:.2f} | "
                     f"{parts} | {100 * r['glue_share']:.1f}% | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def plot(path: str) -> str:
    """Speculative speed-up against p, one line per glue and spec setting (batch x prefix panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    panels = sorted({(r["batch"], r["prefix"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (B, prefix) in zip(axes[0], panels):
        for spec in sorted({r["spec"] for r in rows}):
            for glue in sorted({r["glue"] for r in rows}):
                pts = sorted((r["p"], r["speedup"]) for r in rows
                             if (r["batch"], r["prefix"], r["spec"], r["glue"]) == (B, prefix, spec, glue))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{spec}, {glue} glue")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"B {B}, prefix {prefix} (ORACLE drafter)")
        ax.set_xlabel("p (oracle proposal correct)")
        ax.set_ylabel("speculative / plain decode tok/s")
        ax.legend(fontsize=7)
    fig.suptitle(f"{data.get('preset')}, {data.get('dtype')}, {'eager' if data.get('eager') else 'CUDA graphs'}, "
                 f"{data.get('device_name')}, commit {str(data.get('commit'))[:7]}", fontsize=8)
    out = os.path.splitext(path)[0] + ".png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kimi-k2-slice")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prefix", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--p", type=float, nargs="+", default=[0.0, 0.47, 0.8, 1.0])
    ap.add_argument("--spec", nargs="+", default=list(SPECS), choices=list(SPECS))
    ap.add_argument("--glue", nargs="+", default=["eagle3", "torch"], choices=["eagle3", "torch"])
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, metavar="JSON", help="only draw the chart of a results file")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    start = time.time()
    rows = run(args)
    meta = dict(commit=_commit(), preset=args.preset, dtype=args.dtype, device=args.device,
                device_name=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                torch=torch.__version__, max_new=args.max_new, batch_invariant=args.batch_invariant,
                eager=True, drafter="ORACLE (engine/oracle.py): acceptance set by p, not by a trained drafter",
                seconds=time.time() - start)
    print(_table(rows))
    path = args.json or os.path.join(os.environ.get("EAGLE3_BENCH_OUT", "."), "e2e.json")
    with open(path, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    print(f"rows: {path}")
    return 0 if all(r["identical"] for r in rows) or not args.batch_invariant else 1


if __name__ == "__main__":
    sys.exit(main())
