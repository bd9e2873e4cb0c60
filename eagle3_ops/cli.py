"""The `eagle3` command (also `python -m eagle3_ops`).

    eagle3 demo       continue held-out prompts with the shipped small pair: plain vs speculative
                      decoding, tokens/s, acceptance length and histogram, time per component
    eagle3 diagnose   which target layers the drafter was trained on, and whether the configured
                      capture is it (acceptance per plausible wiring); with --engine-config PATH, whether
                      an SGLang or vLLM launch configuration captures them (read statically, no model run)
    eagle3 selfcheck  build info, then every op once on small inputs, as a table

Every flag is checked before any model loads, and before torch loads (the package defers it while the
command parses: _startup), so `--help` and a usage error answer at once; whether --device's GPU exists is
checked once torch is in.

Exit codes (EXIT_CODES, also the epilog of every --help):
  0   ok
  1   a check failed, a bug: demo's greedy output differs from plain decoding, or a selfcheck op failed
  2   usage error: one line on stderr names the flag and what it allows
  3   diagnose: the configured capture is not the wiring the drafter was trained on
  130 interrupted (Ctrl-C)
  any other, with a traceback: a bug
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from . import _startup
from .models.config import TARGET_PRESETS, DrafterConfig

EXIT_CODES = """exit codes:
  0   ok
  1   a check failed, a bug: demo's greedy output differs from plain decoding, or a selfcheck op failed
  2   usage error: one line on stderr names the flag and what it allows
  3   diagnose: the configured capture is not the wiring the drafter was trained on
  130 interrupted (Ctrl-C)
  any other, with a traceback: a bug"""
BYTE_VOCAB = 256  # presets whose prompts are text (byte tokens); others draw random token prompts


class UsageError(Exception):
    """A flag's value is not allowed; main prints it as one line and returns 2."""


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return parse


def _float_in(low: float, high: float = math.inf):
    allowed = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {allowed}, got {text!r}") from None
        if not (low <= v <= high and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"must be a finite number {allowed}, got {text}")
        return v
    return parse


# --kv-cache-dtype's spellings (vLLM's), as models.cache.KV_DTYPES has them (a test keeps the two equal: torch is not
# loaded while the flags are checked)
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8", "fp8_e4m3")


def _kv_scale(text: str):
    """--kv-scale: "calibrate", one scale > 0, or one per layer (comma-separated)."""
    if text == "calibrate":
        return text
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'calibrate', a number > 0 or one per layer (comma-separated), "
                                         f"got {text!r}") from None
    if not all(0 < v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
    return values[0] if len(values) == 1 else values


def _device(text: str) -> str:
    kind, colon, index = text.partition(":")
    if text == "cpu" or (kind == "cuda" and (not colon or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")


def _usage_error(prog: str, message: str) -> str:
    return f"{prog}: {message} (see {prog} --help)\n"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, not argparse's usage block: the flag and what it allows."""
        self.exit(2, _usage_error(self.prog, message.removeprefix("argument ")))


def _most_tokens(steps: int, topk: int) -> int:
    """The verify tokens a tree of `steps` x `topk` holds, root included (SpecConfig's bound; a test keeps
    them equal: the engine, which imports torch, is not loaded while the flags are checked)."""
    return 1 + steps if topk == 1 else 1 + topk + (steps - 1) * topk * topk


def _heldout_count() -> int:
    with open(os.path.join(ASSETS, "heldout_prompts.json"), encoding="utf-8") as f:
        return len(json.load(f)["prompts"])


def check_args(args) -> None:
    """The checks argparse's per-flag types cannot make: flags against each other and the preset.
    Torch-free; raises UsageError."""
    if args.command == "selfcheck":
        return
    most = _most_tokens(args.steps, args.topk)
    if not 2 <= args.tokens <= most:
        raise UsageError(f"--tokens must be in [2, {most}] for --steps {args.steps} --topk {args.topk} (the root "
                         f"plus at most {most - 1} draft candidates), got {args.tokens}")
    cfg = TARGET_PRESETS[args.preset]
    if args.prompt == "":
        raise UsageError("--prompt must be non-empty text")
    if args.prompt is None and cfg.vocab_size == BYTE_VOCAB and args.batch > (n := _heldout_count()):
        raise UsageError(f"--batch must be at most {n} without --prompt (one held-out prompt per request), "
                         f"got {args.batch}; with --prompt TEXT any batch repeats TEXT")
    if args.oracle is not None and args.temperature != 0:
        raise UsageError(f"--oracle needs greedy decoding (--temperature 0), got --temperature {args.temperature:g}")
    length = getattr(args, "accept_length", None)
    if length is not None:
        if args.oracle is not None:
            raise UsageError("--accept-length and --oracle exclude each other (--accept-length L sets the oracle's p)")
        if args.temperature != 0:
            raise UsageError(f"--accept-length needs greedy decoding (--temperature 0), got --temperature "
                             f"{args.temperature:g}")
        if not 1 <= length <= args.steps + 1:
            raise UsageError(f"--accept-length must be in [1, {args.steps + 1}] for a chain of --steps {args.steps} "
                             f"drafts (1 = every draft rejected, {args.steps + 1} = every draft accepted), got "
                             f"{length:g}")
    if args.graphs:
        if not args.device.startswith("cuda"):
            raise UsageError(f"--graphs needs --device cuda (CUDA graphs), got --device {args.device}")
        if args.dtype != "bfloat16":
            raise UsageError(f"--graphs needs --dtype bfloat16 (torch's grouped GEMM syncs the host in the MoE "
                             f"for other dtypes), got --dtype {args.dtype}")
        if args.batch_invariant:
            raise UsageError("--graphs and --batch-invariant exclude each other (the batch-invariant MoE syncs the host)")
    kv_dtype, kv_scale = getattr(args, "kv_cache_dtype", "auto"), getattr(args, "kv_scale", None)
    if kv_scale is not None and not kv_dtype.startswith("fp8"):
        raise UsageError(f"--kv-scale is the scale of an fp8 cache: it needs --kv-cache-dtype fp8 / fp8_e4m3, got "
                         f"--kv-cache-dtype {kv_dtype}")
    if kv_dtype.startswith("fp8") and args.dtype == "float64":
        raise UsageError("--kv-cache-dtype fp8 needs --dtype float32 or bfloat16 (fp8 caches read bf16 / fp16 queries), "
                         "got --dtype float64")
    if isinstance(kv_scale, tuple) and len(kv_scale) != cfg.num_layers:
        raise UsageError(f"--kv-scale takes one scale or one per layer ({cfg.num_layers} for preset {args.preset}), "
                         f"got {len(kv_scale)}")
    ids = getattr(args, "aux_ids", None)
    if getattr(args, "engine_config", None) is not None and ids is not None:
        raise UsageError("--engine-config and --aux-ids exclude each other (the launch configuration names the "
                         "capture)")
    if ids is not None:
        layers, n_aux = cfg.num_layers, DrafterConfig.for_target(cfg).n_aux
        if len(ids) != n_aux:
            raise UsageError(f"--aux-ids takes {n_aux} layer ids (the drafter's capture slots), got {len(ids)}")
        for k in ids:
            if not -1 <= k < layers:
                raise UsageError(f"--aux-ids {k} is out of range for preset {args.preset} ({layers} layers): each id "
                                 f"must be in -1..{layers - 1} (-1 the embedding, k the output of layer k)")
        if len(set(ids)) != len(ids):
            raise UsageError(f"--aux-ids must be distinct layers, got {' '.join(map(str, ids))}")


def check_device(device: str) -> None:
    """After torch loads, before any model: the GPU --device names exists."""
    import torch

    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise UsageError(f"--device {device}: torch sees no CUDA device (torch {torch.__version__}, "
                         f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU-only build'}); "
                         "use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s), "
                         f"so N must be in 0..{torch.cuda.device_count() - 1}")


def _host_available() -> int | None:
    """Bytes of host memory free for new allocations (MemAvailable), None where /proc/meminfo is not."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024


def check_memory(preset: str, device: str, dtype: str) -> None:
    """A synthesised target's weights must fit where they are drawn: kimi-k2 is ~1.9 TiB in bf16, which a run
    would otherwise start allocating until the OOM killer ends it. Sized on the meta device (no memory)."""
    import torch

    from .models.target import Target

    with torch.device("meta"):
        target = Target(TARGET_PRESETS[preset])
    need = sum(p.numel() for p in target.parameters()) * getattr(torch, dtype).itemsize
    free = torch.cuda.mem_get_info(torch.device(device))[0] if device.startswith("cuda") else _host_available()
    if free is not None and need > free:
        raise UsageError(f"--preset {preset} needs {need / 2**30:,.1f} GiB for the target's weights in {dtype}, but "
                         f"{device} has {free / 2**30:,.1f} GiB free: choose a smaller --preset (or --dtype)")


def _mutated(name: str, args: tuple) -> list[torch.Tensor]:
    import torch

    schema = getattr(torch.ops.eagle3, name).default._schema
    out = []
    for a, v in zip(schema.arguments, args):
        if a.alias_info is not None and a.alias_info.is_write and v is not None:
            out += list(v) if isinstance(v, (list, tuple)) else [v]
    return out


def _summary(name: str, args: tuple, result) -> str:
    import torch

    if name.startswith("verify_"):
        _, accept_len, emitted = result
        return f"accept_len {accept_len.tolist()}, emitted {emitted[:, 0].tolist()}..."
    outs = _mutated(name, args)
    written = sum(int(torch.isfinite(t).sum()) if t.is_floating_point() else t.numel() for t in outs)
    total = sum(t.numel() for t in outs)
    return f"wrote {', '.join('x'.join(map(str, t.shape)) for t in outs)} ({written}/{total} finite)"


def _compare(cpu_args: tuple, dev_args: tuple, name: str, cpu_res, dev_res) -> str:
    import torch

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
    import torch

    import eagle3_ops
    from eagle3_ops._register import OPS, TRITON_OPS
    from eagle3_ops.samples import sample_args

    info = eagle3_ops.build_info()
    print(f"eagle3_ops {eagle3_ops.__version__} on torch {torch.__version__}")
    print(f"build: CUDA kernels {'compiled for ' + info['cuda_archs'] + ' with CUDA ' + info['cuda_version'] if info['cuda'] else 'not compiled (C++ op table only)'}"
          f"; CUDA ops: {', '.join(info['cuda_kernels']) or 'none'}; Triton ops: {', '.join(TRITON_OPS) or 'none'}")
    use_cuda = device == "cuda"
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
    import torch

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
    import torch

    from . import data
    from .engine import Timer, generate_plain, generate_speculative

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, drafter, label = _load_pair(args.preset, args.device, dtype, args.seed)
    from .models.cache import KVCacheConfig

    target.kv_cache = KVCacheConfig(args.kv_cache_dtype, 1.0 if args.kv_scale is None else args.kv_scale)
    prompts, texts = _prompts(args, target)
    spec = _spec(args)
    adaptive = getattr(args, "policy", "fixed") == "adaptive"
    if args.batch_invariant:
        target.batch_invariant_rows = prompts.shape[0] * max(spec.num_tokens, 1 + max(ADAPTIVE_STEPS) if adaptive else 0)
        label += f"\nbatch-invariant target: every step padded to {target.batch_invariant_rows} rows, float64 attention"
    p = args.oracle
    if getattr(args, "accept_length", None) is not None:
        from .engine.oracle import p_for_acceptance_length

        p = p_for_acceptance_length(args.accept_length, args.steps)
    if p is not None:
        from .engine.oracle import OracleDrafter

        reference, _ = generate_plain(target, prompts, args.max_new)  # the answers the oracle reads
        drafter = OracleDrafter(drafter, torch.cat([prompts, reference], 1), p, target.cfg.vocab_size,
                                args.seed, start=prompts.shape[1] - 1)
        calibrated = ("" if args.oracle is not None else f" (acceptance length {args.accept_length:g} at {args.steps} "
                      f"drafts: 1 + p + ... + p^{args.steps} = L)")
        label += (f"\nORACLE drafter, p = {p:.4f}{calibrated}: it proposes the target's own greedy tokens, each "
                  f"corrupted with probability {1 - p:.4f}; the drafter's forwards run at their real cost, but the "
                  "acceptance is set by p, not by any trained drafter")
    print(f"models: {label}")
    print(f"target: {target.cfg.name}, {target.cfg.num_layers} layers, hidden {target.cfg.hidden_size}; drafter "
          f"aux ids {list(drafter.cfg.aux_ids)} (output of layer k); device {args.device}, {args.dtype}; "
          f"{target.kv_cache.describe()}")
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
    if adaptive:
        from .engine.policy import AdaptivePolicy

        generate_speculative(target, drafter, prompts, min(args.max_new, 2 * spec.num_tokens), spec,
                             graphs=args.graphs, policy=AdaptivePolicy(ADAPTIVE_STEPS))  # warm-up
        adapt, astats = generate_speculative(target, drafter, prompts, args.max_new, spec, graphs=args.graphs,
                                             progress=long_run, policy=AdaptivePolicy(ADAPTIVE_STEPS))
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
    print(f"accept rate (SGLang / vLLM: accepted drafts / drafted tokens): {sstats.accept_rate:.3f}")
    if adaptive:
        same = same and torch.equal(plain, adapt)
        print(f"\nadaptive policy:      {astats.tokens_per_s:8.1f} tok/s ({astats.seconds:.2f} s), "
              f"{astats.tokens_per_s / max(pstats.tokens_per_s, 1e-9):.2f}x plain, "
              f"{astats.tokens_per_s / max(sstats.tokens_per_s, 1e-9):.2f}x fixed {spec.steps}/{spec.topk}/"
              f"{spec.num_tokens}; decode phase {astats.decode_tokens_per_s:.1f} tok/s against "
              f"{sstats.decode_tokens_per_s:.1f} fixed, {pstats.decode_tokens_per_s:.1f} plain")
        print(f"  acceptance length {astats.acceptance_length:.2f} tokens per target forward (plain rounds: 1), "
              f"accept rate {astats.accept_rate:.3f}; identical to plain greedy: "
              f"{'yes' if torch.equal(plain, adapt) else 'NO'}")
        print(_decision_table(astats))
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


ADAPTIVE_STEPS = (1, 2, 3, 4, 5)  # the adaptive policy's chains (plain decoding is always a candidate)


def _decision_table(stats) -> str:
    """A policy run's decisions: rounds per shape, as a histogram, with the cost table it chose from."""
    total = sum(stats.decisions.values()) or 1
    lines = [f"  decisions over {total} rounds (steps/topk/tokens; the cost table measured at start-up), "
             f"{stats.resumes} drafter catch-ups after plain rounds ("
             + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in stats.costs.items() if k.startswith("resume")) + ")"
             + (f"; its {len(stats.graph_prepares)} CUDA graphs, each captured once, took "
                f"{stats.graph_memory / 2**20:.0f} MiB" if stats.graph_memory else "") + ":"]
    for name in sorted(stats.decisions, key=lambda k: (k != "plain", k)):
        c = stats.decisions[name]
        lines.append(f"  {name:<8} {c:6d}  {stats.costs.get(name, 0) * 1e3:8.2f} ms  {'#' * round(40 * c / total)}")
    return "\n".join(lines)


def diagnose_cmd(args) -> int:
    import torch

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


def engine_config_cmd(args) -> int:
    """diagnose --engine-config: the launch's implied capture against the drafter's training wiring (torch-free)."""
    from .engine_config import EngineConfigError, check_launch

    try:
        found = check_launch(args.engine_config)
    except EngineConfigError as e:
        raise UsageError(f"--engine-config {e}") from None
    print(found.report())
    return 0 if found.matches else 3


def _add_decode_args(p):
    at_least_1 = _int_at_least(1)
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--preset", default="byte-small", choices=list(TARGET_PRESETS), metavar="NAME",
                   help="byte-small (the shipped trained pair) or a target preset with synthesised weights: "
                        f"{', '.join(k for k in TARGET_PRESETS if k != 'byte-small')}")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--prompt", default=None, help="text to continue, for every request (default: held-out prompts)")
    p.add_argument("--batch", type=at_least_1, default=1,
                   help="requests decoded together (without --prompt: at most the 64 held-out prompts)")
    p.add_argument("--max-new", type=at_least_1, default=64, help="new tokens per request (>= 1)")
    p.add_argument("--steps", type=at_least_1, default=3, help="draft steps per round (>= 1)")
    p.add_argument("--topk", type=at_least_1, default=1, help="beams per draft step (1 = chain)")
    p.add_argument("--tokens", type=_int_at_least(2), default=4,
                   help="verify tokens per round, root included: 2 .. 1 + steps (chain) or "
                        "1 + topk + (steps - 1) * topk^2 (tree)")
    p.add_argument("--temperature", type=_float_in(0), default=0.0, help="0 = greedy, > 0 = sampling")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--oracle", type=_float_in(0, 1), default=None, metavar="P",
                   help="replace the drafter's proposals by a labelled ORACLE's: the target's own greedy tokens "
                        "(from a plain run first), each corrupted with probability 1 - P (0 = adversarial, "
                        "P in [0, 1]); greedy only")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the target's batch-invariant mode (Target.batch_invariant_rows = batch x tokens): plain and "
                        "verify steps give each token bit-identical logits, so greedy losslessness holds bit for "
                        "bit in bf16 too; slower (float64 attention, host syncs in the MoE)")
    p.add_argument("--graphs", action="store_true",
                   help="replay the decode, verify, draft and catch-up steps from CUDA graphs (needs --device cuda "
                        "and --dtype bfloat16)")
    p.add_argument("--threads", type=at_least_1, default=1, help="CPU threads (the small models gain nothing from "
                   "more, and OpenMP stalls when the cores are shared)")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="eagle3", description="eagle3_ops: EAGLE-3 speculative decoding kernels", epilog=EXIT_CODES,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    kw = dict(epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p = sub.add_parser("demo", help="plain vs speculative decoding with the shipped small pair", **kw)
    _add_decode_args(p)
    p.add_argument("--policy", choices=["fixed", "adaptive"], default="fixed",
                   help="fixed: every round --steps/--topk/--tokens; adaptive: also a run whose every round's shape "
                        "(chains of 1-5 drafts, or a plain decode step) maximises the expected tokens/s "
                        "(engine/policy.py), compared in the same run, with its decisions' histogram")
    p.add_argument("--accept-length", type=_float_in(1), default=None, metavar="L",
                   help="the ORACLE drafter calibrated by acceptance length: p solves 1 + p + ... + p^steps = L "
                        "(L in [1, steps + 1] for --steps drafts); excludes --oracle; greedy only")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the target's latent cache (vLLM's spelling): auto (the model's dtype), bf16, or fp8 = "
                        "fp8_e4m3 (e4m3, key = fp8 * scale; the drafter's K / V stay in --dtype)")
    p.add_argument("--kv-scale", type=_kv_scale, default=None, metavar="S|calibrate",
                   help="fp8 cache: its dequantisation scale, one for every layer or one per layer (comma-separated; "
                        "default 1.0, SGLang's unscaled cast), or calibrate: amax / 448 per layer after the prefill")
    p = sub.add_parser("diagnose", help="acceptance per plausible wiring: is the configured capture the trained one?",
                       **kw)
    _add_decode_args(p)
    p.add_argument("--aux-ids", type=int, nargs="+", default=None, metavar="K",
                   help="the capture to check, one id per drafter slot (ours: output of layer k, -1 the "
                        "embedding); default the drafter's config")
    p.add_argument("--engine-config", default=None, metavar="PATH",
                   help="an SGLang or vLLM launch configuration (a command line, or its flags as JSON / YAML): "
                        "does the capture it implies match the drafter's training wiring? (no model is run)")
    p = sub.add_parser("selfcheck", help="build info, then every op once on small inputs (a table)", **kw)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cuda also runs each CUDA/Triton kernel and compares it with the CPU reference "
                        "(default: cuda when torch sees a GPU)")
    return top


def main(argv: list[str] | None = None) -> int:
    """The command; returns its exit code (EXIT_CODES)."""
    args = parser().parse_args(argv)
    prog = f"eagle3 {args.command}"
    try:
        check_args(args)
        if args.command == "diagnose" and args.engine_config is not None:
            return engine_config_cmd(args)  # plain Python: torch stays unloaded
        _startup.finish_import()  # torch and the native extension, deferred while the arguments were checked
        if args.command == "selfcheck":
            import torch

            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            check_device(device)
            return selfcheck(device)
        check_device(args.device)
        if args.preset != "byte-small":  # synthesised weights; byte-small is the shipped pair, loaded from disk
            check_memory(args.preset, args.device, args.dtype)
        return demo(args) if args.command == "demo" else diagnose_cmd(args)
    except UsageError as e:  # raised by the checks only, before any work
        sys.stderr.write(_usage_error(prog, str(e)))
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
