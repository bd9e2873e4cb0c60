"""Tensor parallelism end to end (issue 26, docs/tp.md): plain against speculative decoding of the sharded target
(eagle3_ops.parallel), one process per device under torchrun, with the ORACLE drafter (engine/oracle.py: the
target's own greedy tokens, each corrupted with probability 1 - p; p solved for each acceptance length of a
3-draft chain) over the real drafter's forwards, and in the same run the two comparisons the sharding is for:
the drafter's fc sharded by output columns against replicated, and the vocab-parallel greedy verify against
gathering the logits.

    torchrun --nproc-per-node 8 bench/bench_tp.py        # 8 x H200: kimi-k2, 61 layers, fp8 experts, bf16, graphs
    torchrun --nproc-per-node 4 bench/bench_tp.py --preset tiny --device cpu --dtype float32 --experts model \\
        --batch 1 2 --prefix 16 --max-new 9            # gloo on the CPU (tests/test_bench_tp.py)

Per batch x prefix: the memory plan (parallel/memory.py; a point that does not fit the device is skipped,
saying so), a plain run (its tokens are the oracle's reference; each decode step a CUDA graph on GPUs), then
per acceptance length an untimed speculative run (each round one CUDA graph: tokens/s of the decode phase) and
a run with CUDA events around each component inside the round graph (the breakdown; on the CPU, wall time per
component). NCCL: the collectives one round issues (counted on the TP group's log during one eager verify
forward, fc and verify at the round's shapes) times each one's latency, measured replayed from a CUDA graph in
the same run; it is part of the target's and the glue's times, shown apart. Rank 0 prints the table and
writes the JSON ($EAGLE3_BENCH_OUT/tp.json or --json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS = 3  # the chain 3/1/4 the acceptance lengths are for
GLUE_PARTS = ("fc", "build_tree", "verify", "kv_accept")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn, device: str, inner: int = 10, reps: int = 7) -> float:
    """Median ms of one fn() over ranks started together: on CUDA `inner` calls captured in one graph (NCCL
    collectives included), replayed; on the CPU eager calls. Every rank must call it alike."""
    cuda = device.startswith("cuda")
    if cuda:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(), fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn()
        run, per = g.replay, inner
    else:
        fn()
        run, per = fn, 1
    ts = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        ts.append((time.perf_counter() - t0) * 1e3 / per)
    return sorted(ts)[reps // 2]


def nccl_per_round(tp, target, drafter, glue, B: int, N: int, device: str) -> dict:
    """The collectives of a speculative round (verify forward at [B, N], the catch-up's fc of B * N rows, the
    verify) and of a plain step, counted from the TP log, each timed alone: {spec_ms, plain_ms, calls}."""
    from eagle3_ops import tree

    H = target.cfg.hidden_size
    dtype = target.lm_head.weight.dtype
    kv = target.new_kv(B, N + 16)
    aux_ids = list(drafter.cfg.aux_ids)
    logs = {}
    for name, n in (("spec", N), ("plain", 1)):
        tp.log = []
        tokens = torch.zeros(B, n, dtype=torch.int64, device=device)
        pos = torch.arange(n, device=device).expand(B, n)
        mask = tree.tree_mask(tree.chain_parents(B, n, device=device))
        if name == "spec":
            aux = torch.zeros(B * n, len(aux_ids) * H, dtype=dtype, device=device)
            with target.sharded_logits(glue.mode == "vocab"):
                logits = target.forward(tokens, pos, kv, mask, aux, aux_ids)
                glue.verify_greedy(logits, tokens, tree.chain_parents(B, n, device=device))
            drafter.project(aux, torch.arange(B * n, device=device))
        else:
            target.forward(tokens, pos, kv, mask)
        logs[name], tp.log = Counter(tp.log), None
    latency = {}
    for op, shape, dt in sorted(set(logs["spec"]) | set(logs["plain"]), key=str):  # (one order on every rank)
        x = torch.zeros(shape, dtype=dt, device=device)
        if op == "all_gather":
            part = torch.zeros(shape[0] // tp.world, *shape[1:], dtype=dt, device=device)
            latency[(op, shape, dt)] = time_ms(lambda: tp.all_gather_cols(part), device)
        else:
            latency[(op, shape, dt)] = time_ms(lambda: tp.all_reduce(x, op.rsplit("_", 1)[1]), device)
    out = {f"{k}_ms": sum(c * latency[key] for key, c in logs[k].items()) for k in logs}
    out["calls"] = {k: [dict(op=o, shape=list(s), dtype=str(d).replace("torch.", ""), count=c,
                             ms=latency[(o, s, d)]) for (o, s, d), c in logs[k].items()] for k in logs}
    return out


def fc_compare(tp, sharded, replicated, R: int, device: str) -> dict:
    """The catch-up's fc over R rows: sharded (Hd / TP columns, one all-gather) against replicated; values
    compared; bytes of weight each rank reads."""
    dc = sharded.cfg
    g = torch.Generator(device=device).manual_seed(11)
    aux = torch.randn(R, dc.n_aux * dc.target_hidden_size, generator=g, device=device).to(sharded.dtype)
    rows = torch.arange(R, device=device)
    a, b = sharded.project(aux, rows), replicated.project(aux, rows)
    return dict(rows=R, sharded_ms=time_ms(lambda: sharded.project(aux, rows), device),
                replicated_ms=time_ms(lambda: replicated.project(aux, rows), device),
                max_abs_diff=float((a.float() - b.float()).abs().max()),
                sharded_weight_bytes=sharded.fc.weight.numel() * sharded.fc.weight.element_size(),
                replicated_weight_bytes=replicated.fc.weight.numel() * replicated.fc.weight.element_size())


def verify_compare(tp, target, B: int, N: int, device: str) -> dict:
    """Greedy verify of a [B, N] chain from this rank's [B * N, Vr] fp32 logits: vocab-parallel (argmax of the
    shard, one all-reduce of packed (value, index), the walk) against gathered ([B * N, V] all-gathered, then
    verify_greedy); the outputs compared."""
    from eagle3_ops import tree
    from eagle3_ops.parallel import TPGlue

    g = torch.Generator(device=device).manual_seed(12)
    V, Vr = target.cfg.vocab_size, target.vocab_hi - target.vocab_lo
    torch.manual_seed(12)
    logits = torch.randn(B * N, Vr, generator=g, device=device)  # every rank its own columns (seeded alike)
    parents = tree.chain_parents(B, N, device=device)
    vocab, gathered = TPGlue(tp, target, "vocab"), TPGlue(tp, target, "gathered")
    with target.sharded_logits():
        full = target.gather_logits(logits)
        tokens = full.argmax(-1).view(B, N).roll(1, 1)  # the drafts the target would accept, then one miss
        tokens[:, -1] = (tokens[:, -1] + 1) % V
        a, b = vocab.verify_greedy(logits, tokens, parents), gathered.verify_greedy(logits, tokens, parents)
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        return dict(nodes=B * N, vocab_parallel_ms=time_ms(lambda: vocab.verify_greedy(logits, tokens, parents),
                                                            device),
                    gathered_ms=time_ms(lambda: gathered.verify_greedy(logits, tokens, parents), device),
                    identical=same, gathered_bytes=B * N * V * 4, vocab_parallel_bytes=B * N * 8)


def run(args, tp) -> list[dict]:
    from eagle3_ops.engine import SpecConfig, Timer, generate_plain
    from eagle3_ops.engine.decode import PrefillCache
    from eagle3_ops.engine.oracle import OracleDrafter, p_for_acceptance_length
    from eagle3_ops.models.config import DrafterConfig, TargetConfig
    from eagle3_ops.models.drafter import Drafter
    from eagle3_ops.parallel import TPGlue, generate_speculative_tp, synthesize_tp, tp_drafter
    from eagle3_ops.parallel.memory import moe_experts_read, rank_bytes

    dev, dtype = args.device, getattr(torch, args.dtype)
    cfg = TargetConfig.from_preset(args.preset, **({"num_layers": args.layers} if args.layers else {}))
    dcfg = DrafterConfig.for_target(cfg)
    expert_dtype = torch.float8_e4m3fn if args.experts == "fp8" else None
    ebytes = 1 if expert_dtype else torch.finfo(dtype).bits // 8
    t0 = time.perf_counter()
    target = synthesize_tp(cfg, tp, 0, dtype, dev, expert_dtype, args.moe).eval()
    drafter = Drafter.synthesize(dcfg, target.model.embed_tokens, 1, dtype, dev).eval()
    sharded, replicated = tp_drafter(drafter, tp, "sharded"), tp_drafter(drafter, tp, "replicated")
    del drafter
    _sync(dev)
    setup_s = time.perf_counter() - t0
    spec = SpecConfig(STEPS, 1, STEPS + 1)
    N = spec.num_tokens
    graphs = "round" if args.graphs else False
    rows = []
    for B in args.batch:
        for prefix in args.prefix:
            cap = prefix + args.max_new + 2 * N + 8
            plan = rank_bytes(cfg, dcfg, tp.world, B, cap, weight_bytes=torch.finfo(dtype).bits // 8,
                              expert_bytes=ebytes, cache_bytes=torch.finfo(dtype).bits // 8, moe=args.moe)
            # the MoE's bytes a rank streams a layer, both ways of splitting it (uniform routing, estimated), in MB
            expert_mb = 3 * cfg.moe_intermediate_size * cfg.hidden_size * ebytes / 1e6
            reads = {f"T{T}": {k: v * expert_mb for k, v in moe_experts_read(cfg, tp.world, T).items()}
                     for T in (B, B * N)}
            base = dict(batch=B, prefix=prefix, world=tp.world, moe=args.moe,
                        plan_gib={k: v / 2**30 for k, v in plan.items()}, moe_layer_read_mb=reads)
            keep = B * prefix <= args.prefill_cache_tokens  # a PrefillCache: a second copy of the prefix's rows
            if dev.startswith("cuda"):  # (the weights are resident: what is left must hold the caches)
                free = torch.cuda.mem_get_info()[0]
                caches = plan["latent_cache"] + plan["drafter_cache"]
                keep = keep and 2 * caches + args.headroom_gib * 2**30 <= free  # else every run prefills
                if caches + args.headroom_gib * 2**30 > free:
                    rows.append(dict(base, skipped=f"does not fit: caches {caches / 2**30:.1f} GiB + "
                                                   f"{args.headroom_gib:g} GiB headroom > {free / 2**30:.1f} GiB free"))
                    if tp.rank == 0:
                        print(f"B {B} prefix {prefix}: {rows[-1]['skipped']}", flush=True)
                    continue
            g = torch.Generator(device=dev).manual_seed(B * 100003 + prefix)
            prompts = torch.randint(0, cfg.vocab_size, (B, prefix), generator=g, device=dev)
            plain_out, plain = generate_plain(target, prompts, args.max_new, graphs=bool(graphs))
            reference = torch.cat([prompts, plain_out], 1)
            glue = TPGlue(tp, target, "vocab")
            cache = PrefillCache() if keep else None
            nccl = nccl_per_round(tp, target, sharded, glue, B, N, dev)
            fc = fc_compare(tp, sharded, replicated, B * N, dev)
            ver = verify_compare(tp, target, B, N, dev)
            for L in args.accept_length:
                p = p_for_acceptance_length(L, STEPS)
                oracle = OracleDrafter(sharded, reference, p, cfg.vocab_size, seed=0, start=prefix - 1)
                out, st = generate_speculative_tp(target, oracle, prompts, args.max_new, spec, glue=glue,
                                                  graphs=graphs, prefill_cache=cache)
                mode = "events" if dev.startswith("cuda") and graphs else "fence"
                timer = Timer(device=dev, mode=mode)
                oracle.calls.zero_()
                _, ev = generate_speculative_tp(target, oracle, prompts, args.max_new, spec, glue=glue,
                                                graphs=graphs if mode == "events" else False, timer=timer,
                                                prefill_cache=cache)
                parts = {k: v - ev.prefill_times.get(k, 0.0) for k, v in ev.times.items()}
                per = {k: v / max(ev.rounds, 1) * 1e3 for k, v in parts.items()}
                steps = max(st.rounds, 1)
                step = (st.seconds - st.prefill_seconds - st.setup_seconds) / steps * 1e3
                glue_ms = max(0.0, step - per.get("target", 0.0) - per.get("draft", 0.0))
                rows.append(dict(base, spec="chain 3/1/4", accept_length_target=L, p=p, drafter="ORACLE",
                                 plain_tok_s=plain.decode_tokens_per_s, spec_tok_s=st.decode_tokens_per_s,
                                 speedup=st.decode_tokens_per_s / max(plain.decode_tokens_per_s, 1e-12),
                                 accept_len=st.acceptance_length, rounds=st.rounds, step_ms=step,
                                 plain_step_ms=(plain.seconds - plain.prefill_seconds - plain.setup_seconds)
                                 / max(args.max_new - 1, 1) * 1e3,
                                 timed_step_ms=per, other_ms=max(0.0, step - sum(per.values())),
                                 glue_share=glue_ms / step if step else 0.0,
                                 nccl_round_ms=nccl["spec_ms"], nccl_plain_step_ms=nccl["plain_ms"],
                                 nccl_share=nccl["spec_ms"] / step if step else 0.0, nccl_calls=nccl["calls"],
                                 fc=fc, verify=ver, identical_to_plain=bool(torch.equal(out, plain_out)),
                                 setup_s=setup_s, prefill_ms=st.prefill_seconds * 1e3,
                                 graph_setup_ms=st.setup_seconds * 1e3))
                if tp.rank == 0:
                    r = rows[-1]
                    print(f"B {B} prefix {prefix} L {L}: plain {r['plain_tok_s']:.1f} tok/s, spec "
                          f"{r['spec_tok_s']:.1f} tok/s ({r['speedup']:.2f}x, acceptance {r['accept_len']:.2f}), "
                          f"step {step:.2f} ms, NCCL {nccl['spec_ms']:.2f} ms, glue {100 * r['glue_share']:.1f}%",
                          flush=True)
            del cache
    return rows


def table(rows: list[dict]) -> str:
    head = ("| B | prefix | L | plain tok/s | spec tok/s | speed-up | acceptance | step ms | target / draft / fc / "
            "build_tree / verify / kv_accept / other ms | NCCL ms (share) | glue share | fc sharded / replicated ms "
            "| verify vocab-parallel / gathered ms |\n|" + "---|" * 13)
    lines = [head]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['batch']} | {r['prefix']} | - | {r['skipped']} |" + " |" * 9)
            continue
        t = r["timed_step_ms"]
        parts = " / ".join(f"{t.get(k, 0.0):.2f}" for k in ("target", "draft", "fc", "build_tree", "verify",
                                                             "kv_accept")) + f" / {r['other_ms']:.2f}"
        lines.append(f"| {r['batch']} | {r['prefix']} | {r['accept_length_target']:g} | {r['plain_tok_s']:.1f} | "
                     f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['accept_len']:.2f} | {r['step_ms']:.2f} | "
                     f"{parts} | {r['nccl_round_ms']:.2f} ({100 * r['nccl_share']:.1f}%) | "
                     f"{100 * r['glue_share']:.1f}% | {r['fc']['sharded_ms']:.3f} / {r['fc']['replicated_ms']:.3f} | "
                     f"{r['verify']['vocab_parallel_ms']:.3f} / {r['verify']['gathered_ms']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kimi-k2")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    ap.add_argument("--experts", default="fp8", choices=["fp8", "model"],
                    help="fp8: routed experts in e4m3 with per-row scales (parallel/fp8.py); model: the model dtype")
    ap.add_argument("--moe", default="tp", choices=["tp", "ep"],
                    help="tp: every expert's intermediate columns split (default: at decode sizes no rank reads "
                         "more than 1/TP of the experts used; docs/tp.md); ep: experts whole, E / TP a rank")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prefix", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--accept-length", type=float, nargs="+", default=[2.4, 3.0])
    ap.add_argument("--max-new", type=int, default=61)
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="CUDA graphs (default on CUDA): each plain step and each speculative round one graph")
    ap.add_argument("--headroom-gib", type=float, default=5.0, help="left free past the caches (activations, graphs)")
    ap.add_argument("--prefill-tokens", type=int, default=1024,
                    help="prefill chunk over the batch (engine.decode.PREFILL_TOKENS; the oracle's scores of a chunk "
                         "are [chunk, V] fp32 plus an int64 temporary: 2 GB at 1024 x 163840)")
    ap.add_argument("--prefill-cache-tokens", type=int, default=32768,
                    help="keep a batch x prefix's prefill for its runs (PrefillCache) up to this many tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.graphs is None:
        args.graphs = args.device.startswith("cuda")
    from eagle3_ops.engine import decode

    decode.PREFILL_TOKENS = args.prefill_tokens
    from eagle3_ops.parallel import init_from_env

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    tp = init_from_env("nccl" if args.device.startswith("cuda") else "gloo")
    if args.device.startswith("cuda"):
        args.device = f"cuda:{torch.cuda.current_device()}"
    start = time.time()
    rows = run(args, tp)
    if tp.rank == 0:
        print(table(rows))
        path = args.json or os.path.join(os.environ.get("EAGLE3_BENCH_OUT", "."), "tp.json")
        meta = dict(preset=args.preset, layers=args.layers, world=tp.world, dtype=args.dtype, experts=args.experts,
                    moe=args.moe,
                    device=args.device, device_name=torch.cuda.get_device_name() if "cuda" in args.device else "cpu",
                    torch=torch.__version__, max_new=args.max_new, graphs=args.graphs, seconds=time.time() - start,
                    drafter="ORACLE (engine/oracle.py): acceptance set by p, not by a trained drafter")
        with open(path, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
        print(f"rows: {path}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
