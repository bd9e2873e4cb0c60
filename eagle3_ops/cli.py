"""The `eagle3` command (also `python -m eagle3_ops`).

    eagle3 demo       continue held-out prompts with the shipped small pair: plain vs speculative
                      decoding, tokens/s, acceptance length and histogram, time per component
    eagle3 diagnose   which target layers the drafter was trained on, and whether the configured
                      capture is it (acceptance per plausible wiring)
    eagle3 selfcheck  build info, then every op once on small inputs, as a table
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _mutated(name: str, args: tuple) -> list[torch.Tensor]:
    schema = getattr(torch.ops.eagle3, name).default._schema
    out = []
    for a, v in zip(schema.arguments, args):
        if a.alias_info is not None and a.alias_info.is_write and v is not None:
            out += list(v) if isinstance(v, (list, tuple)) else [v]
    return out


def _summary(name: str, args: tuple, result) -> str:
    if name.startswith("verify_"):
        _, accept_len, emitted = result
        return f"accept_len {accept_len.tolist()}, emitted {emitted[:, 0].tolist()}..."
    outs = _mutated(name, args)
    written = sum(int(torch.isfinite(t).sum()) if t.is_floating_point() else t.numel() for t in outs)
    total = sum(t.numel() for t in outs)
    return f"wrote {', '.join('x'.join(map(str, t.shape)) for t in outs)} ({written}/{total} finite)"


def _compare(cpu_args: tuple, dev_args: tuple, name: str, cpu_res, dev_res) -> str:
    pairs = list(zip(_mutated(name, cpu_args), _mutated(name, dev_args)))
    if name.startswith("verify_"):
        pairs = list(zip(cpu_res, dev_res))
    worst = 0.0
    for c, d in pairs:
        d = d.cpu()
        if not c.is_floating_point():
            if not torch.equal(c, d):
                return "MISMATCH"
            continue
        if torch.equal(c, d) or (torch.isnan(c) == torch.isnan(d)).all() and torch.equal(c.nan_to_num(), d.nan_to_num()):
            continue
        worst = max(worst, float((c.double() - d.double()).norm() / c.double().norm().clamp_min(1e-30)))
    return "bit-exact" if worst == 0 else f"rel err {worst:.1e}"


def selfcheck(device: str) -> int:
    import eagle3_ops
    from eagle3_ops._register import OPS, TRITON_OPS
    from eagle3_ops.samples import sample_args

    info = eagle3_ops.build_info()
    print(f"eagle3_ops {eagle3_ops.__version__} on torch {torch.__version__}")
    print(f"build: CUDA kernels {'compiled for ' + info['cuda_archs'] + ' with CUDA ' + info['cuda_version'] if info['cuda'] else 'not compiled (C++ op table only)'}"
          f"; CUDA ops: {', '.join(info['cuda_kernels']) or 'none'}; Triton ops: {', '.join(TRITON_OPS) or 'none'}")
    use_cuda = device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        print("--device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    header = f"{'op':<20} {'cpu (reference)':<16} {'result':<52} {'cuda kernel':<12} {'cuda vs reference'}"
    print(header)
    print("-" * len(header))
    failures = 0
    for name in OPS:
        op = getattr(torch.ops.eagle3, name)
        args = sample_args(name)
        try:
            t0 = time.perf_counter()
            res = op(*args)
            ms = (time.perf_counter() - t0) * 1e3
            cpu_cell, summary = f"ok {ms:7.2f} ms", _summary(name, args, res)
        except Exception as e:  # a self-check reports, it does not stop at the first failure
            failures += 1
            cpu_cell, summary = "FAILED", f"{type(e).__name__}: {e}"[:52]
        kind = "CUDA C++" if name in info["cuda_kernels"] else ("Triton" if name in TRITON_OPS else "-")
        cuda_cell = "not run"
        if use_cuda and kind != "-":
            dev_args = sample_args(name, device="cuda")
            try:
                dev_res = op(*dev_args)
                torch.cuda.synchronize()
                cuda_cell = _compare(args, dev_args, name, res, dev_res)
                failures += cuda_cell == "MISMATCH"
            except Exception as e:
                failures += 1
                cuda_cell = f"FAILED {type(e).__name__}: {e}"[:60]
        elif kind == "-":
            cuda_cell = "no kernel yet"
        print(f"{name:<20} {cpu_cell:<16} {summary:<52} {kind:<12} {cuda_cell}")
    print(f"\n{len(OPS) - failures}/{len(OPS)} ops ran" + ("" if not failures else f"; {failures} FAILED"))
    return 1 if failures else 0


ASSETS = os.path.join(os.path.dirname(__file__), "assets", "byte-small")


def _load_pair(preset: str, device: str, dtype: torch.dtype, seed: int = 0):
    """(target, drafter, label): the shipped trained pair for byte-small, else synthesised weights."""
    from .models.config import DrafterConfig, TargetConfig
    from .models.drafter import Drafter, load_drafter
    from .models.loading import load_target
    from .models.target import Target

    if preset == "byte-small":
        target = load_target(os.path.join(ASSETS, "target"), dtype=dtype, device=device)
        drafter = load_drafter(os.path.join(ASSETS, "drafter"), target.model.embed_tokens,
                               num_layers=target.cfg.num_layers, dtype=dtype, device=device)
        return target.eval(), drafter.eval(), "the shipped pair, trained on CPU (eagle3_ops/assets/byte-small)"
    cfg = TargetConfig.from_preset(preset)
    # drawn on the device itself: kimi-k2-slice is ~74 GB in bf16, never staged in host memory
    target = Target.synthesize(cfg, seed, dtype, device=device)
    drafter = Drafter.synthesize(DrafterConfig.for_target(cfg), target.model.embed_tokens, seed + 1, dtype,
                                 device=device)
    return target.eval(), drafter.eval(), (f"preset {preset}, SYNTHESISED weights: the drafter does not predict "
                                           "this target, acceptance is meaningless here")


def _prompts(args, target) -> tuple[torch.Tensor, list[str]]:
    from . import data

    if args.prompt is not None:
        texts = [args.prompt] * args.batch
    else:
        texts = [p.decode("utf-8", "replace") for p in data.load_heldout_prompts()[:args.batch]]
    if target.cfg.vocab_size == 256:
        enc = [data.encode(t.encode("utf-8")) for t in texts]
        n = min(len(e) for e in enc)
        return torch.stack([e[-n:] for e in enc]).to(args.device), texts
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, target.cfg.vocab_size, (args.batch, 32), generator=g).to(args.device), texts


def _spec(args):
    from .engine import SpecConfig

    return SpecConfig(steps=args.steps, topk=args.topk, num_tokens=args.tokens, temperature=args.temperature,
                      seed=args.seed)


def demo(args) -> int:
    from . import data
    from .engine import Timer, generate_plain, generate_speculative

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, drafter, label = _load_pair(args.preset, args.device, dtype, args.seed)
    prompts, texts = _prompts(args, target)
    spec = _spec(args)
    if args.batch_invariant:
        target.batch_invariant_rows = prompts.shape[0] * spec.num_tokens
        label += f"\nbatch-invariant target: every step padded to {target.batch_invariant_rows} rows, float64 attention"
    if args.oracle is not None:
        from .engine.oracle import OracleDrafter

        if spec.temperature != 0:
            raise SystemExit("--oracle needs greedy decoding (--temperature 0)")
        reference, _ = generate_plain(target, prompts, args.max_new)  # the answers the oracle reads
        drafter = OracleDrafter(drafter, torch.cat([prompts, reference], 1), args.oracle, target.cfg.vocab_size,
                                args.seed, start=prompts.shape[1] - 1)
        label += (f"\nORACLE drafter, p = {args.oracle}: it proposes the target's own greedy tokens, each corrupted "
                  f"with probability {1 - args.oracle:g}; the drafter's forwards run at their real cost, but the "
                  "acceptance is set by p, not by any trained drafter")
    print(f"models: {label}")
    print(f"target: {target.cfg.name}, {target.cfg.num_layers} layers, hidden {target.cfg.hidden_size}; drafter "
          f"aux ids {list(drafter.cfg.aux_ids)} (output of layer k); device {args.device}, {args.dtype}")
    print(f"speculative: {spec.steps} draft steps, topk {spec.topk}, {spec.num_tokens} verify tokens, "
          f"{'greedy' if spec.temperature == 0 else f'temperature {spec.temperature}'}; batch {prompts.shape[0]}, "
          f"{args.max_new} new tokens each\n")
    # warm-up at the timed shapes: first-call costs (Triton compiles a kernel per shape on CUDA) stay out
    # of the timings
    generate_plain(target, prompts, min(args.max_new, 4), temperature=spec.temperature, seed=args.seed,
                   graphs=args.graphs)
    generate_speculative(target, drafter, prompts, min(args.max_new, 2 * spec.num_tokens), spec, graphs=args.graphs)
    # CUDA events (no syncs: the steps run as they would untimed; they also time inside a round graph)
    plain_timer, spec_timer = Timer(device=args.device, mode="events"), Timer(device=args.device, mode="events")
    long_run = args.max_new * prompts.shape[0] >= 512
    plain, pstats = generate_plain(target, prompts, args.max_new, temperature=spec.temperature, seed=args.seed,
                                   graphs=args.graphs, timer=plain_timer, progress=long_run)
    fast, sstats = generate_speculative(target, drafter, prompts, args.max_new, spec, timer=spec_timer,
                                        graphs=args.graphs, progress=long_run)
    if target.cfg.vocab_size == 256:
        print(f"prompt: {texts[0][-160:]!r}")
        print(f"speculative continuation: {data.decode(fast[0])!r}\n")
    same = torch.equal(plain, fast)
    print(f"plain decoding:       {pstats.tokens_per_s:8.1f} tok/s ({pstats.seconds:.2f} s)")
    print(f"speculative decoding: {sstats.tokens_per_s:8.1f} tok/s ({sstats.seconds:.2f} s), "
          f"{sstats.tokens_per_s / max(pstats.tokens_per_s, 1e-9):.2f}x")
    print(f"acceptance length: {sstats.acceptance_length:.2f} tokens per verify step "
          f"(accepted drafts + 1, at most {spec.num_tokens}), over {sum(sstats.accept_hist)} verify steps")
    total = sum(sstats.accept_hist) or 1
    for k, c in enumerate(sstats.accept_hist):
        if k >= 1:
            print(f"  {k} token{'s' if k > 1 else ' '} {c:6d}  {'#' * round(40 * c / total)}")
    print("time per component (speculative):")
    accounted = sum(sstats.times.values())
    for name, sec in sorted(sstats.times.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<11} {sec * 1e3:9.1f} ms  {100 * sec / sstats.seconds:5.1f}%")
    if sstats.setup_seconds:
        print(f"  {'graph setup':<11} {sstats.setup_seconds * 1e3:9.1f} ms  "
              f"{100 * sstats.setup_seconds / sstats.seconds:5.1f}%  (capture, once: an engine's start-up)")
    other = sstats.seconds - accounted - sstats.setup_seconds
    print(f"  {'other':<11} {other * 1e3:9.1f} ms  {100 * other / sstats.seconds:5.1f}%")
    if str(args.device).startswith("cuda"):
        print(f"GPU memory: peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated")
    if spec.temperature == 0:
        print(f"\noutputs identical to plain greedy decoding: {'yes' if same else 'NO'}")
        return 0 if same else 1
    print("\n(sampled decoding: outputs differ by design; the distribution is the target's)")
    return 0


def diagnose_cmd(args) -> int:
    from .diagnose import diagnose

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, drafter, label = _load_pair(args.preset, args.device, dtype, args.seed)
    prompts, _ = _prompts(args, target)
    print(f"models: {label}")
    report = diagnose(target, drafter, prompts, configured=args.aux_ids, max_new=args.max_new, spec=_spec(args),
                      progress=True)
    print(report.table())
    print(report.verdict())
    return 0 if report.configured_is_best else 3


def _add_decode_args(p):
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--preset", default="byte-small", help="byte-small (the shipped trained pair) or a target "
                   "preset (tiny, kimi-k2-slice, ...) with synthesised weights")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--prompt", default=None, help="text to continue (default: held-out prompts)")
    p.add_argument("--batch", type=int, default=1, help="requests decoded together")
    p.add_argument("--max-new", type=int, default=64, help="new tokens per request")
    p.add_argument("--steps", type=int, default=3, help="draft steps per round")
    p.add_argument("--topk", type=int, default=1, help="beams per draft step (1 = chain)")
    p.add_argument("--tokens", type=int, default=4, help="verify tokens per round, root included")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--oracle", type=float, default=None, metavar="P",
                   help="replace the drafter's proposals by a labelled ORACLE's: the target's own greedy tokens "
                        "(from a plain run first), each corrupted with probability 1 - P (0 = adversarial); greedy only")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the target's batch-invariant mode (Target.batch_invariant_rows = batch x tokens): plain and "
                        "verify steps give each token bit-identical logits, so greedy losslessness holds bit for "
                        "bit in bf16 too; slower (float64 attention, host syncs in the MoE)")
    p.add_argument("--graphs", action="store_true",
                   help="replay the decode, verify, draft and catch-up steps from CUDA graphs (CUDA only)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (the small models gain nothing from more, "
                   "and OpenMP stalls when the cores are shared)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3", description="eagle3_ops: EAGLE-3 speculative decoding kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="plain vs speculative decoding with the shipped small pair")
    _add_decode_args(p)
    p = sub.add_parser("diagnose", help="acceptance per plausible wiring: is the configured capture the trained one?")
    _add_decode_args(p)
    p.add_argument("--aux-ids", type=int, nargs="+", default=None,
                   help="the capture to check (ours: output of layer k); default the drafter's config")
    p = sub.add_parser("selfcheck", help="build info, then every op once on small inputs (a table)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda also runs each CUDA/Triton kernel and compares it with the CPU reference")
    args = parser.parse_args(argv)
    if args.command == "selfcheck":
        return selfcheck(args.device)
    return demo(args) if args.command == "demo" else diagnose_cmd(args)


if __name__ == "__main__":
    sys.exit(main())
