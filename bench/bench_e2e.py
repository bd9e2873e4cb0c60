"""End to end (issue 7): plain against speculative decoding of a Kimi-shaped target in one run, with the step's
glue through our ops and done the plain-PyTorch way (engine/torch_glue.py), an acceptance-controlled ORACLE
drafter (engine/oracle.py: the target's own greedy tokens, each corrupted with probability 1 - p; its forwards
are the real drafter's), and the per-component breakdown of a step.

    python3 bench/bench_e2e.py                                  # on the H200: kimi-k2-slice, bf16
    python3 bench/bench_e2e.py --preset tiny --device cpu --dtype float32 --prefix 32 --max-new 16
    python3 bench/bench_e2e.py --plot bench/results/e2e_graphs_b1_4096_h200.json   # the chart, where matplotlib is installed

For every batch x prefix: a plain run (the reference tokens and the baseline), then per spec setting, p and
glue one untimed run (tokens/s of the decode phase: after the prefill, whose time is kept apart), one run with
CUDA events around each component (the breakdown: each component's span on the device timeline, no syncs),
and at p = 1 one run with each component fenced by device syncs (each alone: the "no hidden overhead"
check). Every speculative run's tokens are compared with the plain run's ("identical"): in bf16 they can
differ at near-ties unless --batch-invariant (Target.batch_invariant_rows, a correctness mode, not a speed
figure); --fixpoint K then gives the oracle each run's own output as its reference (a fixed point per glue and p).
--oracle-seeds S runs every ORACLE row under S seeds of the oracle's draws and reports their mean and sd (a
61-token run's acceptance is a few dozen draws: one row is one draw of its distribution).

Eager unless --graphs: then each speculative round is one CUDA graph (engine/graphs.RoundGraph; the
breakdown from CUDA events recorded inside it) and each plain step another; the components-alone run uses
per-step graphs (StepGraph: verify, draft, catch-up), since a fence cannot sit inside a graph. Graphs are
captured once per run, in its first round; that time is kept apart from the decode time and the breakdown,
as an engine captures at start-up (DecodeStats.setup_seconds). Rows go to $EAGLE3_BENCH_OUT/e2e.json
(or --json), with the commit, the GPU and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch
from torch import Tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SPECS = {"chain 3/1/4": dict(steps=3, topk=1, num_tokens=4),  # as Kimi deployments run it
         "tree 4/4/16": dict(steps=4, topk=4, num_tokens=16),
         # the other fixed shapes issue 24's adaptive policy is held to
         "chain 1/1/2": dict(steps=1, topk=1, num_tokens=2),
         "chain 2/1/3": dict(steps=2, topk=1, num_tokens=3),
         "chain 5/1/6": dict(steps=5, topk=1, num_tokens=6)}
DEFAULT_SPECS = ["chain 3/1/4", "tree 4/4/16"]
ADAPTIVE_STEPS = (1, 2, 3, 4, 5)  # the adaptive policy's chains (the CLI's too)
REFERENCE_STEPS = 3  # --accept-length L is the oracle's acceptance length at this many chain drafts
GLUE_PARTS = ("fc", "build_tree", "verify", "kv_accept")  # the glue ops, timed (capture is inside the forwards)


def _commit() -> str:
    env = os.environ.get("EAGLE3_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _time_ms(fn, device: str, reps: int = 7) -> float:
    """Median wall time of fn() in ms, the device drained around each call (eager: launches included)."""
    ts = []
    for _ in range(reps + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts[1:])[reps // 2]


def forward_profile(target, prompts: Tensor, Ns, aux_ids, device: str, graphs: bool = False) -> dict:
    """At this prefix, a decode step's (N = 1: "decode") and a verify step's (each N in Ns, a chain: "verify_N")
    target forward: the whole forward, each layer's attention + FFN (module hooks, device synced at each
    boundary, so the parts are a little slower than inside the forward), what is outside the layers
    (embedding, norms, lm_head: the remainder), and for verify the forward with the capture fused
    (add_rmsnorm_capture) and the plain way (h + r, torch.cat), whose differences from no capture are the
    capture's cost. graphs: every forward is timed replayed from a CUDA graph, and the per-layer and outside
    parts are the graphed forward split in the eager proportions (the hooks cannot run inside a graph)."""
    from eagle3_ops import tree
    from eagle3_ops.engine.decode import _prefill
    from eagle3_ops.engine.graphs import StepGraph, new_pool

    B, T0 = prompts.shape
    kv = target.new_kv(B, T0 + max(Ns) + 1, page_size=16)
    _prefill(target, prompts, kv)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    pool = new_pool(device) if graphs else None
    out = {}
    for name, n in [("decode", 1)] + [(f"verify_{N}", N) for N in Ns]:
        tokens = torch.randint(0, target.cfg.vocab_size, (B, n), device=device)
        positions = kv.prefix_lens[:, None].long() + torch.arange(n, device=device)
        mask = tree.tree_mask(tree.chain_parents(B, n, device=device))
        aux = torch.empty(B * n, len(aux_ids) * target.cfg.hidden_size, dtype=target.lm_head.weight.dtype,
                          device=device)

        def fwd(capture=False):
            return target.forward(tokens, positions, kv, mask, aux if capture else None, aux_ids if capture else ())

        def timed(capture=False):  # the forward's time, replayed from a graph when graphs
            if not graphs:
                return _time_ms(lambda: fwd(capture), device)
            step = StepGraph(lambda t, p: fwd(capture), pool)
            return _time_ms(lambda: step(tokens, positions), device)

        row = dict(eager_forward_ms=_time_ms(fwd, device))
        row["forward_ms"] = timed() if graphs else row["eager_forward_ms"]
        if n > 1:
            row["capture_fused_ms"] = timed(True) - row["forward_ms"]
            target.plain_capture = True
            try:
                row["capture_plain_ms"] = timed(True) - row["forward_ms"]
            finally:
                target.plain_capture = False
        per_layer = [0.0] * target.cfg.num_layers
        hooks, t0 = [], {}
        for i, layer in enumerate(target.model.layers):
            for mod in (layer.self_attn, layer.mlp):
                def pre(m, a, i=i):
                    sync()
                    t0[i] = time.perf_counter()

                def post(m, a, o, i=i):
                    sync()
                    per_layer[i] += (time.perf_counter() - t0[i]) * 1e3
                hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        reps = 5
        try:
            fwd()
            per_layer[:] = [0.0] * len(per_layer)
            for _ in range(reps):
                fwd()
        finally:
            for h in hooks:
                h.remove()
        # the hooked layers against the eager forward; scaled to the graphed forward when graphs (see above)
        scale = row["forward_ms"] / max(row["eager_forward_ms"], 1e-12)
        per_layer = [t / reps * scale for t in per_layer]
        row["outside_layers_ms"] = max(0.0, row["eager_forward_ms"] * scale - sum(per_layer))
        dense = [t for i, t in enumerate(per_layer) if not target.cfg.is_moe(i)]
        moe = [t for i, t in enumerate(per_layer) if target.cfg.is_moe(i)]
        row.update(layer_ms=per_layer, dense_layer_ms=sum(dense) / max(len(dense), 1),
                   moe_layer_ms=sum(moe) / max(len(moe), 1))
        out[name] = row
    return out


def oracle_ms(oracle, B: int, rows: int, device: str, graphs: bool) -> float:
    """The oracle's own work in one drafter forward of `rows` rows a request (proposals and scores; not the
    real drafter's), timed alone (replayed from a graph when graphs), its call count left as found."""
    from eagle3_ops.engine.graphs import StepGraph, new_pool

    positions = torch.arange(rows, device=device).expand(B, rows) + oracle.start
    calls = oracle.calls.clone()
    try:
        if graphs:
            step = StepGraph(lambda p: oracle.scores(p), new_pool(device), state=[oracle.calls])
            return _time_ms(lambda: step(positions), device)
        return _time_ms(lambda: oracle.scores(positions), device)
    finally:
        oracle.calls.copy_(calls)


def _bytes(params) -> int:
    return sum(t.numel() * t.element_size() for t in params)


def _kv_cache(args):
    """--kv-cache-dtype / --kv-scale as the target's latent cache (models.cache.KVCacheConfig checks them)."""
    from eagle3_ops.models.cache import KVCacheConfig

    scale = args.kv_scale
    if scale is not None and scale != "calibrate":
        scale = tuple(float(v) for v in scale.split(","))
        scale = scale[0] if len(scale) == 1 else scale
    return KVCacheConfig(args.kv_cache_dtype, 1.0 if scale is None else scale)


def step_floor_bytes(target, drafter, B: int, prefix: int, N: int, draft_forwards: int) -> dict:
    """The bytes a step must read at least (its roofline floor is that over the copy bandwidth): the target's
    weights (routed experts: the expected distinct ones for B * N tokens under uniform top-k routing, E (1 -
    (1 - k / E)^T), an estimate) and its latent cache over the prefix; per drafter forward its weights (fc
    and the embedding apart) and its K / V over the prefix; the fc once a round. Activations are left out."""
    from eagle3_ops.models.target import Experts

    cfg = target.cfg
    esize = target.lm_head.weight.element_size()  # the drafter's K / V element (the model's dtype)
    kv_esize = torch.empty((), dtype=target.kv_cache.torch_dtype(target.lm_head.weight.dtype)).element_size()
    experts = [m for m in target.modules() if isinstance(m, Experts)]
    expert_ids = {id(p) for m in experts for p in m.parameters()}
    dense = _bytes(p for n, p in target.named_parameters() if id(p) not in expert_ids and "embed_tokens" not in n)
    routed = _bytes(p for m in experts for p in m.parameters())  # all layers' stacks

    def target_bytes(T: int) -> float:
        E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        used = E * (1 - (1 - k / E) ** T) if E else 0.0
        return dense + (routed * used / E if E else 0) + cfg.num_layers * B * prefix * cfg.kv_dim * kv_esize

    dc = drafter.cfg
    d_weights = _bytes(p for n, p in drafter.named_parameters() if "embed_tokens" not in n and not n.startswith("fc."))
    d_kv = B * prefix * 2 * dc.num_kv_heads * dc.head_dim * esize
    fc = _bytes([drafter.fc.weight])
    return dict(plain=target_bytes(B), spec=target_bytes(B * N) + draft_forwards * (d_weights + d_kv) + fc)


def _first_diff(a: Tensor, b: Tensor):
    """The first (request, token) where a and b differ, or None."""
    d = (a != b).nonzero()
    if d.numel() == 0:
        return None
    i = int(d[:, 1].argmin())
    return [int(d[i, 0]), int(d[i, 1])]


def _decode_parts(st) -> tuple[dict, float]:
    """A timed run's components over its decode phase (the prefill's share and the graph captures out), and
    the decode phase's seconds."""
    parts = {k: v - st.prefill_times.get(k, 0.0) for k, v in st.times.items()}
    return parts, st.seconds - st.prefill_seconds - st.setup_seconds


def extrapolate(profile: dict, cfg_full, step_ms: float, accept_len: float, B: int, N: int) -> dict:
    """EXTRAPOLATED to the full model: each forward's layers (decode, and verify at this spec's N) scaled to
    cfg_full's dense / MoE counts (the outside-the-layers part kept), the rest of a speculative step (drafts,
    glue, other) as measured."""
    def full(p):
        return _full_forward_ms(p, cfg_full)

    plain_step = full(profile["decode"])
    verify = profile[f"verify_{N}"]
    spec_step = step_ms - verify["forward_ms"] + full(verify)
    return dict(layers=cfg_full.num_layers, plain_step_ms=plain_step, spec_step_ms=spec_step,
                plain_tok_s=B / plain_step * 1e3, spec_tok_s=B * accept_len / spec_step * 1e3,
                speedup=(B * accept_len / spec_step) / (B / plain_step))


def run(args) -> list[dict]:
    from eagle3_ops.engine import PrefillCache, SpecConfig, Timer, generate_plain, generate_speculative
    from eagle3_ops.engine.oracle import OracleDrafter

    from eagle3_ops.cli import _load_pair
    from eagle3_ops.models.config import TargetConfig

    dtype = getattr(torch, args.dtype)
    copy_bw = None
    if args.device.startswith("cuda"):  # the ceiling, measured in this run (before the models fill the memory)
        from common import Ceilings

        copy_bw = Ceilings.measure().copy_bw
        print(f"copy ceiling {copy_bw / 1e12:.2f} TB/s (read + write), measured now", flush=True)
    target, drafter, _ = _load_pair(args.preset, args.device, dtype)  # synthesised (or the shipped byte-small)
    target.kv_cache = _kv_cache(args)  # every run's latent cache (plain, speculative, the forward profile)
    full_cfg = TargetConfig.from_preset(args.full)  # what the per-layer times are extrapolated to
    V = target.cfg.vocab_size
    rows = []
    for B in args.batch:
        for prefix in args.prefix:
            g = torch.Generator(device="cpu").manual_seed(B * 100003 + prefix)
            prompts = torch.randint(0, V, (B, prefix), generator=g).to(args.device)
            specs = {k: SpecConfig(**v) for k, v in SPECS.items() if k in args.spec and "fixed" in args.policy}
            # one prefill per glue for every speculative run at this batch and prefix (the oracle's runs; the
            # drafter's state after it does not depend on the spec or p)
            caches = {glue: None if args.no_prefill_cache else PrefillCache() for glue in args.glue}
            most = max([s.num_tokens for s in specs.values()] + ([1 + max(ADAPTIVE_STEPS)] if "adaptive" in args.policy
                                                                 else []))
            target.batch_invariant_rows = B * most if args.batch_invariant else 0
            generate_plain(target, prompts, min(4, args.max_new), graphs=args.graphs)  # warm-up (compiles, allocator)
            reference, plain = generate_plain(target, prompts, args.max_new, graphs=args.graphs)
            print(f"B {B} prefix {prefix}: plain {plain.decode_tokens_per_s:.1f} tok/s decode "
                  f"(prefill {plain.prefill_seconds * 1e3:.0f} ms)", flush=True)
            Ns = {s.num_tokens for s in specs.values()} | ({1 + k for k in ADAPTIVE_STEPS} if "adaptive" in args.policy
                                                          else set())
            profile = forward_profile(target, prompts, sorted(Ns), drafter.cfg.aux_ids, args.device, graphs=args.graphs)
            for k, v in profile.items():
                print(f"  target forward {k}: {v['forward_ms']:.2f} ms (dense layer {v['dense_layer_ms']:.2f}, MoE "
                      f"layer {v['moe_layer_ms']:.2f}, outside the layers {v['outside_layers_ms']:.2f})"
                      + (f"; capture fused {v['capture_fused_ms']:.3f} ms, plain {v['capture_plain_ms']:.3f} ms"
                         if "capture_fused_ms" in v else ""), flush=True)
            for name, spec in specs.items():
                # The oracle's reference: plain greedy's tokens, or with --fixpoint K (the fast path) the fixed point
                # of the run itself. In bf16 a verify step's numerics are not a decode step's (other GEMM kernels
                # for other row counts, other attention splits), nor one tree's another's, so at a near-tie a
                # speculative run can emit another token than plain greedy (or than a run at another p, or through
                # the other glue, whose build_tree orders nodes differently), and a reference taken from elsewhere
                # then misleads the oracle for the rest of the sequence. So per (glue, p), from the highest p down,
                # reference <- the run's own output until it emits its reference (at most K passes; the last pass
                # is the timed run): its proposals are then the tokens this very run emits. With --oracle-seeds S,
                # each of S oracle seeds (other draws) from the last seed's fixed point to its own, and the row is
                # their mean (over_seeds), each run's figures and checks kept in it.
                for glue in args.glue:
                    ref = reference
                    for p in sorted(args.p, reverse=True):
                        oracle = OracleDrafter(drafter, torch.cat([prompts, ref], 1), p, V, start=prefix - 1)
                        if p == max(args.p):  # warm-up at these shapes (compilations, allocator), once per spec/glue
                            generate_speculative(target, oracle, prompts, min(2 * spec.num_tokens, args.max_new),
                                                 spec, glue=glue, graphs=args.graphs, prefill_cache=caches[glue])
                        runs = []
                        for seed in range(args.oracle_seeds):  # each seed's own fixed point, from the last one's
                            passes = 0
                            while True:  # each run sees the oracle's same draws (its call count reset)
                                passes += 1
                                oracle = OracleDrafter(drafter, torch.cat([prompts, ref], 1), p, V, seed=seed,
                                                       start=prefix - 1)
                                out, st = generate_speculative(target, oracle, prompts, args.max_new, spec, glue=glue,
                                                               graphs=args.graphs, prefill_cache=caches[glue])
                                converged = bool(torch.equal(out, ref))
                                # (at p = 0 every proposal is another token than the reference's, whichever: no
                                # pass can change the acceptance, 0)
                                if converged or passes >= max(args.fixpoint, 1) or p == 0:
                                    break
                                ref = out
                            steps = max(st.rounds, 1)
                            run = dict(batch=B, prefix=prefix, spec=name, p=p, accept_length_target=args.lengths.get(p),
                                       accept_rate=st.accept_rate, glue=glue, drafter="ORACLE",
                                       plain_tok_s=plain.decode_tokens_per_s, spec_tok_s=st.decode_tokens_per_s,
                                       speedup=st.decode_tokens_per_s / max(plain.decode_tokens_per_s, 1e-12),
                                       accept_len=st.acceptance_length, rounds=st.rounds,
                                       step_ms=(st.seconds - st.prefill_seconds - st.setup_seconds) / steps * 1e3,
                                       prefill_ms=(caches[glue] or st).prefill_seconds * 1e3,
                                       graph_setup_ms=st.setup_seconds * 1e3,
                                       identical=bool(torch.equal(out, reference)),
                                       first_diff=_first_diff(out, reference),
                                       oracle_reference="plain" if ref is reference else "the run's own output",
                                       fixpoint_passes=passes, matches_oracle_reference=converged)
                            run.update(_calibration(p, st, spec, converged, B))
                            runs.append(run)
                        row = over_seeds(runs)
                        converged = row["matches_oracle_reference"]
                        # the breakdown: each component's span on the device timeline of an undisturbed run (CUDA
                        # events, no syncs); the glue share and "other" (the small ops between the sections, and
                        # any wait for the host) from it
                        if args.no_breakdown:
                            _finish_row(row, profile, full_cfg, spec, B, rows, name, p, glue, converged)
                            continue
                        timer = Timer(device=args.device, mode="events")
                        oracle.calls.zero_()
                        _, ev = generate_speculative(target, oracle, prompts, args.max_new, spec, glue=glue,
                                                     timer=timer, graphs=args.graphs, prefill_cache=caches[glue])
                        parts, decode_s = _decode_parts(ev)
                        # (round graphs: the rounds' span on the device; this run syncs after each to read them)
                        row["step_ms_events_run"] = (ev.round_seconds or decode_s) / max(ev.rounds, 1) * 1e3
                        per = {k: v / max(ev.rounds, 1) * 1e3 for k, v in parts.items()}
                        row["timed_step_ms"] = per
                        # against the undisturbed run's step: "other" is the small ops between the timed sections
                        # and any wait for the host; issue 7's glue is everything but the two forwards
                        step = row["step_ms"]
                        row["timed_other_ms"] = max(0.0, step - sum(per.values()))
                        row["glue_share"] = max(0.0, step - per.get("target", 0.0) - per.get("draft", 0.0)) / step
                        row["glue_ops_share"] = sum(per.get(k, 0.0) for k in GLUE_PARTS) / step
                        # the oracle's own scoring sits inside the "draft" sections; a real drafter has none of it:
                        # its time a round (each drafter forward's rows), and the glue share of the step without it
                        NB = (spec.steps - 1) * spec.topk
                        orc = (spec.steps - 1) * oracle_ms(oracle, B, max(NB, 1), args.device, args.graphs) + \
                            oracle_ms(oracle, B, spec.num_tokens, args.device, args.graphs)
                        row["oracle_ms_per_round"] = orc
                        glue_ms = max(0.0, step - per.get("target", 0.0) - per.get("draft", 0.0))
                        row["glue_share_without_oracle"] = glue_ms / max(step - orc, 1e-12)
                        row["predicted_tok_s"] = B * row["accept_len"] / row["step_ms"] * 1e3
                        row["tok_s_over_predicted"] = row["spec_tok_s"] / row["predicted_tok_s"]
                        if p == 1.0 or args.fenced_all:
                            # issue 7's "no hidden overhead" check: the step against the sum of its components,
                            # each run alone (the device drained around it: its host launch included)
                            fence = Timer(device=args.device, mode="fence")
                            oracle.calls.zero_()
                            _, fe = generate_speculative(target, oracle, prompts, args.max_new, spec, glue=glue,
                                                         timer=fence, graphs="steps" if args.graphs else False,
                                                         prefill_cache=caches[glue])
                            fparts, _ = _decode_parts(fe)
                            row["alone_step_ms"] = {k: v / max(fe.rounds, 1) * 1e3 for k, v in fparts.items()}
                            row["components_sum_ms"] = sum(row["alone_step_ms"].values())
                            row["step_over_components"] = row["step_ms"] / row["components_sum_ms"]
                        if copy_bw:  # the roofline: the bytes a step must read over the copy bandwidth
                            fb = step_floor_bytes(target, drafter, B, prefix, spec.num_tokens, spec.steps)
                            row["copy_bw"] = copy_bw
                            row["plain_floor_ms"] = fb["plain"] / copy_bw * 1e3
                            row["spec_floor_ms"] = fb["spec"] / copy_bw * 1e3
                            row["plain_floor_fraction"] = row["plain_floor_ms"] / (B / row["plain_tok_s"] * 1e3)
                            row["spec_floor_fraction"] = row["spec_floor_ms"] / row["step_ms"]
                        _finish_row(row, profile, full_cfg, spec, B, rows, name, p, glue, converged)
            if "adaptive" in args.policy:
                rows += adaptive_rows(args, target, drafter, prompts, reference, plain, profile, full_cfg,
                                      caches[args.glue[0]])
            if args.json and "{" in args.json:  # this batch and prefix's own file, written now
                _write(args.json.format(batch=B, prefix=prefix), args, [r for r in rows if (r["batch"], r["prefix"])
                                                                       == (B, prefix)])
    return rows


def _finish_row(row, profile, full_cfg, spec, B, rows, name, p, glue, converged) -> None:
    """A fixed shape's row: the forward profile and the EXTRAPOLATED figures added, kept and printed."""
    row["forward_profile"] = profile
    row["extrapolated"] = extrapolate(profile, full_cfg, row["step_ms"], row["accept_len"], B, spec.num_tokens)
    rows.append(row)
    alone = f"  step / components alone {row['step_over_components']:.2f}" if "step_over_components" in row else ""
    if "spec_floor_fraction" in row:
        alone += f"  floor: step {100 * row['spec_floor_fraction']:.0f}%, plain {100 * row['plain_floor_fraction']:.0f}%"
    glue_part = (f"  glue {100 * row['glue_share']:.1f}% ({100 * row['glue_share_without_oracle']:.1f}% of the step "
                 f"less the oracle's {row['oracle_ms_per_round']:.3f} ms)  tok/s / predicted "
                 f"{row['tok_s_over_predicted']:.3f}" if "glue_share" in row else "")
    print(f"  {name:<12} p {p:<6.4f} glue {glue:<6} {row['spec_tok_s']:8.1f} tok/s {row['speedup']:5.2f}x  accept "
          f"{row['accept_len']:.2f} (rate {row['accept_rate']:.3f})  step {row['step_ms']:.2f} ms{glue_part}  identical "
          f"{'yes' if row['identical'] else 'NO'}{'' if row['identical'] else ' (from ' + str(row['first_diff']) + ')'}"
          f"{alone}{_calibration_note(row, converged)}{_seeds_note(row)}", flush=True)


# a run's figures that over_seeds averages, and those each run keeps in the row's oracle_runs
MEAN_KEYS = ("spec_tok_s", "speedup", "accept_len", "accept_rate", "rounds", "step_ms", "graph_setup_ms",
             "regret_ms", "policy_waits")
RUN_KEYS = MEAN_KEYS + ("identical", "first_diff", "oracle_reference", "fixpoint_passes", "matches_oracle_reference",
                        "tested", "p_measured", "calibrated", "decisions", "resumes", "extrapolated")


def over_seeds(runs: list[dict]) -> dict:
    """One row of the runs of one setting under oracle seeds 0, 1, ... (--oracle-seeds): the first run's row with
    the MEAN_KEYS figures averaged over the runs (the mean of tokens/s, as the simulation's tables average), their
    sample standard deviations as spec_tok_s_sd and speedup_sd, the checks held by every run (identical,
    matches_oracle_reference, calibrated), the tested drafts summed and p_measured pooled, an adaptive row's
    decisions and resumes summed (the histogram of all the runs' rounds) and its extrapolated figures averaged;
    each run's own in oracle_runs (oracle_seed, RUN_KEYS). One run: its row as it was, with oracle_seeds 1 and
    oracle_runs."""
    row = dict(runs[0])
    row["oracle_seeds"] = len(runs)
    row["oracle_runs"] = [dict(oracle_seed=i, **{k: r[k] for k in RUN_KEYS if k in r}) for i, r in enumerate(runs)]
    if len(runs) == 1:
        return row
    n = len(runs)
    for k in MEAN_KEYS:
        if k in row:
            row[k] = sum(r[k] for r in runs) / n
    for k in ("spec_tok_s", "speedup"):
        row[f"{k}_sd"] = (sum((r[k] - row[k]) ** 2 for r in runs) / (n - 1)) ** 0.5
    for k in ("identical", "matches_oracle_reference", "calibrated"):
        row[k] = all(r[k] for r in runs)
    row["first_diff"] = next((r["first_diff"] for r in runs if r["first_diff"] is not None), None)
    row["fixpoint_passes"] = max(r["fixpoint_passes"] for r in runs)
    if all(r.get("tested") is not None for r in runs):
        tested = sum(r["tested"] for r in runs)
        row["tested"] = tested
        row["p_measured"] = sum(r["p_measured"] * r["tested"] for r in runs if r["tested"]) / tested if tested else None
    if row.get("decisions") is not None:
        row["decisions"] = {}
        for r in runs:
            for k, c in r["decisions"].items():
                row["decisions"][k] = row["decisions"].get(k, 0) + c
        row["resumes"] = sum(r["resumes"] for r in runs)
    if "extrapolated" in row:
        row["extrapolated"] = {k: sum(r["extrapolated"][k] for r in runs) / n if isinstance(v, float) else v
                               for k, v in row["extrapolated"].items()}
    return row


def _seeds_note(row: dict) -> str:
    """A row's line: with more than one oracle seed, the spread and each run's tokens/s."""
    if row.get("oracle_seeds", 1) < 2:
        return ""
    return (f"  [mean of {row['oracle_seeds']} oracle seeds, sd {row['spec_tok_s_sd']:.1f} tok/s: "
            + ", ".join(f"{r['spec_tok_s']:.1f}" for r in row["oracle_runs"]) + "]")


def calibration(p: float, tested: int, accepted: int, batch: int) -> dict:
    """Whether a run's ORACLE acceptance is the one its p sets. Each draft that verification tested (every draft
    before it accepted) is the reference's token with probability p, so when the reference is the run's own
    output, accepted ~ Binomial(tested, p); the run is calibrated when accepted is within 3 standard deviations
    of p * tested, plus one draft a request (the last round's drafts past max_new propose the reference's last
    token: one can be rejected at any p). A reference that is not the run's own (plain greedy's, where a bf16 run
    left it) has its proposals rejected from there on: far below p * tested."""
    tol = 3 * (tested * p * (1 - p)) ** 0.5 + batch
    return dict(tested=tested, p_measured=accepted / tested if tested else None,
                calibrated=bool(abs(accepted - p * tested) <= tol))


def _calibration(p: float, st, spec, converged: bool, batch: int) -> dict:
    """calibration() of a fixed shape's run: the tested drafts from its acceptance histogram (a chain: a round
    that emitted k tokens tested min(k, steps) drafts). A tree's acceptance has no such closed form: it is
    calibrated when its reference is its own output (or p = 0, where no reference changes the outcome)."""
    if spec.topk > 1:
        return dict(tested=None, p_measured=None, calibrated=bool(converged or p == 0))
    tested = sum(c * min(k, spec.steps) for k, c in enumerate(st.accept_hist))
    return calibration(p, tested, st.accepted, batch)


def _calibration_note(row: dict, converged: bool) -> str:
    note = "" if converged or row["p"] == 0 else "  (oracle reference NOT the run's own)"
    if not row["calibrated"]:
        got = "" if row["p_measured"] is None else f": accepted {row['p_measured']:.3f} of tested drafts"
        note += f"  UNCALIBRATED (p {row['p']:.4f}{got})"
    return note


def adaptive_rows(args, target, drafter, prompts, reference, plain, profile, full_cfg, cache) -> list[dict]:
    """Issue 24: the adaptive policy (engine/policy.py) at each p, through our glue. Its cost table is measured
    once, in the warm-up run at this batch and prefix, and given to every run after it (an engine profiles once
    at start-up; and a run's decisions are then a function of its rounds' outcomes alone, so the fixed point of
    the oracle's reference holds). Per p and variant (the measured table; --full-costs: the same with each
    forward scaled to the full model), the oracle's reference is the run's own output by --fixpoint K passes
    (from the higher p's output down, plain greedy's first; one pass at p = 0), as for the fixed shapes. A row
    per p and variant: tokens/s of the decode phase, the decisions' histogram, the cost table, the graphs'
    memory, acceptance length and accept rate, the calibration check, and the EXTRAPOLATED full model (each
    round's verify forward, or a plain round's decode forward, scaled as extrapolate() does, the rest of the
    round as measured); with --oracle-seeds S, the mean of S runs under other oracle draws (over_seeds), each
    from its own fixed point."""
    from eagle3_ops.engine import SpecConfig, generate_speculative
    from eagle3_ops.engine.oracle import OracleDrafter
    from eagle3_ops.engine.policy import AdaptivePolicy

    B, prefix = prompts.shape
    V, glue, rows = target.cfg.vocab_size, args.glue[0], []
    spec = SpecConfig()  # the temperature (greedy) and seed; the shapes are the policy's

    def run(ref, p, n, costs=None, seed=0):
        oracle = OracleDrafter(drafter, torch.cat([prompts, ref], 1), p, V, seed=seed, start=prefix - 1)
        policy = AdaptivePolicy(ADAPTIVE_STEPS, costs=costs)
        out, st = generate_speculative(target, oracle, prompts, n, spec, glue=glue, graphs=args.graphs,
                                       prefill_cache=cache, policy=policy)
        return out, st, policy

    def forward_key(name):  # the target forward a round of this decision runs
        return "decode" if name == "plain" else f"verify_{int(name.split('/')[2])}"

    def full_delta_s(name):  # the full model's forward less the slice's, a round of this decision
        key = forward_key(name)
        return (_full_forward_ms(profile[key], full_cfg) - profile[key]["forward_ms"]) / 1e3

    # warm-up at these shapes (compilations, allocator), and the cost table every run below decides from
    _, warm, _ = run(reference, max(args.p), min(12, args.max_new))
    measured = dict(warm.costs)
    tables = [("adaptive", measured)]
    if args.full_costs:  # the decisions it would make on the full model: the cost table's forwards scaled
        tables.append((f"adaptive, {full_cfg.num_layers}-layer costs",
                       {k: v + (0.0 if k.startswith("resume") else full_delta_s(k)) for k, v in measured.items()}))
    plain_step = _full_forward_ms(profile["decode"], full_cfg)
    for name, costs in tables:
        ref = reference
        for p in sorted(args.p, reverse=True):
            runs = []
            for seed in range(args.oracle_seeds):  # each seed's own fixed point, from the last one's
                for passes in range(1, max(args.fixpoint, 1) + 1):
                    out, r, policy = run(ref, p, args.max_new, costs, seed)
                    converged = bool(torch.equal(out, ref))
                    if converged or passes >= max(args.fixpoint, 1) or p == 0:
                        break
                    ref = out
                decode_s = r.seconds - r.prefill_seconds - r.setup_seconds
                full_s = decode_s + sum(c * full_delta_s(k) for k, c in r.decisions.items())
                full_tok_s = (r.tokens - B) / full_s if full_s > 0 else 0.0
                one = dict(batch=B, prefix=prefix, spec=name, p=p, accept_length_target=args.lengths.get(p),
                           glue=glue, drafter="ORACLE", plain_tok_s=plain.decode_tokens_per_s,
                           spec_tok_s=r.decode_tokens_per_s,
                           speedup=r.decode_tokens_per_s / max(plain.decode_tokens_per_s, 1e-12),
                           accept_len=r.acceptance_length, accept_rate=r.accept_rate, rounds=r.rounds,
                           step_ms=decode_s / max(r.rounds, 1) * 1e3, graph_setup_ms=r.setup_seconds * 1e3,
                           identical=bool(torch.equal(out, reference)), first_diff=_first_diff(out, reference),
                           oracle_reference="plain" if ref is reference else "the run's own output",
                           fixpoint_passes=passes, matches_oracle_reference=converged, decisions=r.decisions,
                           resumes=r.resumes, costs_ms={k: v * 1e3 for k, v in r.costs.items()},
                           regret_ms=policy.regret * 1e3,
                           graph_memory_bytes=r.graph_memory, graph_prepares=r.graph_prepares, policy_waits=r.waits,
                           forward_profile=profile,
                           extrapolated=dict(layers=full_cfg.num_layers, plain_step_ms=plain_step,
                                             plain_tok_s=B / plain_step * 1e3, spec_tok_s=full_tok_s,
                                             speedup=full_tok_s / (B / plain_step * 1e3)))
                one.update(calibration(p, policy.tested, r.accepted, B))
                runs.append(one)
                if converged:  # the next seed (and the next, lower p) starts from this fixed point
                    ref = out
            row = over_seeds(runs)
            rows.append(row)
            print(f"  {name:<12} p {p:<6.4f} glue {glue:<6} {row['spec_tok_s']:8.1f} tok/s {row['speedup']:5.2f}x  "
                  f"accept {row['accept_len']:.2f} (rate {row['accept_rate']:.3f})  identical "
                  f"{'yes' if row['identical'] else 'NO'}  decisions {row['decisions']}  resumes {row['resumes']}  "
                  f"graphs {r.graph_memory / 2**20:.0f} MiB  EXTRAPOLATED {row['extrapolated']['speedup']:.2f}x  "
                  f"passes {row['fixpoint_passes']}{_calibration_note(row, row['matches_oracle_reference'])}"
                  f"{_seeds_note(row)}", flush=True)
    return rows


def _full_forward_ms(p: dict, cfg_full) -> float:
    """A profiled forward's layers scaled to cfg_full's dense / MoE counts, the outside-the-layers part kept."""
    dense_n = cfg_full.first_k_dense_replace
    return p["outside_layers_ms"] + dense_n * p["dense_layer_ms"] + (cfg_full.num_layers - dense_n) * p["moe_layer_ms"]


def _table(rows: list[dict]) -> str:
    head = ("| B | prefix | spec | p | glue | plain tok/s | spec tok/s | speed-up | accept | step ms | "
            "target / draft / fc / build_tree / verify / kv_accept / other ms (device timeline) | glue share | "
            "identical | "
            "EXTRAPOLATED full model: plain / spec tok/s |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        if r["spec"].startswith("adaptive"):
            continue  # (policy_table)
        t = r.get("timed_step_ms")  # (--no-breakdown: none)
        parts = "-" if t is None else " / ".join(f"{t.get(k, 0.0):.2f}" for k in (
            "target", "draft", "fc", "build_tree", "verify", "kv_accept")) + f" / {r['timed_other_ms']:.2f}"
        share = f"{100 * r['glue_share']:.1f}%" if "glue_share" in r else "-"
        lines.append(f"| {r['batch']} | {r['prefix']} | {r['spec']} | {r['p']} | {r['glue']} | "
                     f"{r['plain_tok_s']:.1f} | "
                     f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['accept_len']:.2f} | {r['step_ms']:.2f} | "
                     f"{parts} | {share} | {'yes' if r['identical'] else 'NO'} | "
                     f"{r['extrapolated']['plain_tok_s']:.1f} / {r['extrapolated']['spec_tok_s']:.1f} "
                     f"({r['extrapolated']['layers']} layers) |")
    return "\n".join(lines)


def run_heldout(args) -> list[dict]:
    """The shipped small pair (byte-small) on its first --heldout held-out prompts (cut to the shortest one's
    length), in groups of B: plain greedy, each fixed --spec and the adaptive policy, every group's runs
    back to back, the whole pass --repeat times (each method's fastest pass kept: a shared machine only ever
    slows a pass down). Tokens/s of the decode phase (tokens after the first over the time after the prefill,
    the graph captures and cost table out) summed over the groups; outputs compared with plain greedy's."""
    from eagle3_ops import data
    from eagle3_ops.cli import _load_pair
    from eagle3_ops.engine import SpecConfig, generate_plain, generate_speculative
    from eagle3_ops.engine.policy import AdaptivePolicy

    torch.set_num_threads(args.threads)
    target, drafter, _ = _load_pair("byte-small", args.device, getattr(torch, args.dtype))
    target.kv_cache = _kv_cache(args)
    enc = [data.encode(p) for p in data.load_heldout_prompts()[:args.heldout]]
    n = min(len(e) for e in enc)
    prompts = torch.stack([e[-n:] for e in enc]).to(args.device)
    fixed = {k: SpecConfig(**SPECS[k]) for k in args.spec}
    rows = []
    for B in args.batch:
        groups = [prompts[i:i + B] for i in range(0, len(prompts), B)]
        methods = ["plain"] + list(fixed) + ["adaptive"]
        best = {m: None for m in methods}
        identical = {m: True for m in methods}
        accepted, drafted, steps, emitted = ({m: 0 for m in methods} for _ in range(4))
        decisions = {}
        for rep in range(args.repeat + 1):  # pass 0: the warm-up (compilations, allocator), not kept
            total = {m: [0.0, 0] for m in methods}
            for grp in groups:
                ref, st = generate_plain(target, grp, args.max_new, graphs=args.graphs)
                runs = {"plain": (ref, st)}
                for name, spec in fixed.items():
                    runs[name] = generate_speculative(target, drafter, grp, args.max_new, spec, graphs=args.graphs)
                runs["adaptive"] = generate_speculative(target, drafter, grp, args.max_new, SpecConfig(),
                                                        graphs=args.graphs, policy=AdaptivePolicy(ADAPTIVE_STEPS))
                for m, (out, st) in runs.items():
                    total[m][0] += st.seconds - st.prefill_seconds - st.setup_seconds
                    total[m][1] += st.tokens - st.batch
                    identical[m] &= bool(torch.equal(out, ref))
                    if rep == 1:  # the decisions and acceptance of one pass (every pass decodes alike)
                        accepted[m] += st.accepted
                        drafted[m] += st.drafted
                        steps[m] += sum(st.accept_hist)
                        emitted[m] += sum(k * c for k, c in enumerate(st.accept_hist))
                        if m == "adaptive":
                            for k, c in st.decisions.items():
                                decisions[k] = decisions.get(k, 0) + c
            if rep:
                for m in methods:
                    tok_s = total[m][1] / total[m][0]
                    best[m] = tok_s if best[m] is None else max(best[m], tok_s)
                print(f"B {B} pass {rep}: " + ", ".join(f"{m} {total[m][1] / total[m][0]:.1f}" for m in methods)
                      + " tok/s", flush=True)
        for m in methods:
            rows.append(dict(batch=B, method=m, tok_s=best[m], speedup=best[m] / best["plain"],
                             accept_len=emitted[m] / max(steps[m], 1), accept_rate=accepted[m] / max(drafted[m], 1),
                             identical=identical[m], decisions=decisions if m == "adaptive" else None,
                             prompts=len(prompts), prompt_len=n, max_new=args.max_new, repeat=args.repeat))
    lines = ["| B | method | decode tok/s (best of passes) | x plain | acceptance length | accept rate (accepted drafts "
             "/ drafted) | identical to plain greedy | decisions (rounds) |", "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['method']} | {r['tok_s']:.1f} | {r['speedup']:.3f} | {r['accept_len']:.2f} | "
                     f"{r['accept_rate']:.3f} | {'yes' if r['identical'] else 'NO'} | "
                     + (", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items())) if r["decisions"] else "")
                     + " |")
    print("\n".join(lines))
    return rows


def policy_table(rows: list[dict]) -> str:
    """Issue 24's table: per batch, prefix and oracle p, tokens/s (decode phase) of plain decoding, each fixed
    shape (our glue) and the adaptive policy, with the acceptance length and the accept rate (accepted drafts /
    drafted tokens, as SGLang and vLLM report it) of each, adaptive over plain and over the best fixed shape,
    measured and EXTRAPOLATED to the full model."""
    ours = [r for r in rows if r["glue"] == "eagle3"]
    specs = [k for k in SPECS if any(r["spec"] == k for r in ours)]
    head = ("| B | prefix | oracle L (p) | plain tok/s | " + " | ".join(f"{k}: tok/s, L, rate" for k in specs) +
            " | adaptive: tok/s, L, rate | adaptive / plain | adaptive / best fixed | EXTRAPOLATED full model: "
            "adaptive / plain, adaptive / best fixed | decisions |")
    lines = [head, "|" + "---|" * (8 + len(specs))]
    for key in sorted({(r["batch"], r["prefix"], r["p"]) for r in ours}):
        at = {r["spec"]: r for r in ours if (r["batch"], r["prefix"], r["p"]) == key}
        for a in [r for name, r in at.items() if name.startswith("adaptive")]:
            lines.append(_policy_line(key, a, at, specs))
    return "\n".join(lines)


def _policy_line(key, a: dict, at: dict, specs: list) -> str:
    """One adaptive row of policy_table, against the fixed rows at its batch, prefix and p."""
    fixed = [at[k] for k in specs if k in at]
    best = max(fixed, key=lambda r: r["spec_tok_s"]) if fixed else None
    best_x = max(fixed, key=lambda r: r["extrapolated"]["spec_tok_s"]) if fixed else None
    L = a.get("accept_length_target")
    cells = [f"{at[k]['spec_tok_s']:.1f}, {at[k]['accept_len']:.2f}, {at[k]['accept_rate']:.3f}{_mark(at[k])}"
             if k in at else "-" for k in specs]
    ext = a["extrapolated"]
    vs_best = f"{a['spec_tok_s'] / best['spec_tok_s']:.3f}{_se(a, best)} ({best['spec']})" if best else "-"
    vs_best_x = f"{ext['spec_tok_s'] / best_x['extrapolated']['spec_tok_s']:.3f}" if best_x else "-"
    return (f"| {key[0]} | {key[1]} | {'-' if L is None else f'{L:g}'} ({key[2]:.4f}) | {a['plain_tok_s']:.1f} | "
            + " | ".join(cells) + f" | {a['spec']}: {a['spec_tok_s']:.1f}, {a['accept_len']:.2f}, "
            f"{a['accept_rate']:.3f}{_mark(a)} | {a['speedup']:.3f}{_se(a)} | {vs_best} | {ext['speedup']:.3f}, {vs_best_x} | "
            + ", ".join(f"{k} {v}" for k, v in sorted(a["decisions"].items())) + " |")


def _se(a: dict, b: dict | None = None) -> str:
    """With more than one oracle seed, the standard error of a's tokens/s over plain's (b None: plain's one run is
    taken as exact) or over b's, the two means' errors independent: " (se x)"; else ""."""
    def rel2(r):  # the squared relative standard error of a row's mean tokens/s
        n = r.get("oracle_seeds", 1)
        return (r["spec_tok_s_sd"] / r["spec_tok_s"]) ** 2 / n if n > 1 and r["spec_tok_s"] > 0 else 0.0

    if a.get("oracle_seeds", 1) < 2:
        return ""
    ratio = a["speedup"] if b is None else a["spec_tok_s"] / b["spec_tok_s"]
    return f" (se {ratio * (rel2(a) + (0.0 if b is None else rel2(b))) ** 0.5:.3f})"


def _mark(row: dict) -> str:
    """A policy-table cell's flag: UNCALIBRATED where the measured acceptance is off the oracle's p."""
    return "" if row.get("calibrated", True) else " UNCALIBRATED"


def plot(path: str) -> str:
    """Speculative speed-up against p, one line per glue and spec setting (batch x prefix panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    panels = sorted({(r["batch"], r["prefix"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (B, prefix) in zip(axes[0], panels):
        for spec in sorted({r["spec"] for r in rows}):
            for glue in sorted({r["glue"] for r in rows}):
                pts = sorted((r["p"], r["speedup"]) for r in rows
                             if (r["batch"], r["prefix"], r["spec"], r["glue"]) == (B, prefix, spec, glue))
                if pts:
                    line, = ax.plot(*zip(*pts), marker="o", label=f"{spec}, {glue} glue (measured slice)")
                    for r in rows:  # the acceptance each point measured (in bf16 it can fall below p's at near-ties)
                        if (r["batch"], r["prefix"], r["spec"], r["glue"]) == (B, prefix, spec, glue):
                            ax.annotate(f"{r['accept_len']:.2f}", (r["p"], r["speedup"]), fontsize=6,
                                        color=line.get_color(), xytext=(3, -8), textcoords="offset points")
                    ext = sorted((r["p"], r["extrapolated"]["speedup"]) for r in rows
                                 if (r["batch"], r["prefix"], r["spec"], r["glue"]) == (B, prefix, spec, glue))
                    ax.plot(*zip(*ext), marker="x", ls="--", color=line.get_color(),
                            label=f"{spec}, {glue} glue (EXTRAPOLATED, {ext and rows[0]['extrapolated']['layers']} "
                                  "layers)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"B {B}, prefix {prefix} (ORACLE drafter)")
        ax.set_xlabel("p (oracle proposal correct)\nnumbers: measured acceptance length")
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
    ap.add_argument("--accept-length", type=float, nargs="+", default=None, metavar="L",
                    help=f"instead of --p: the oracle's acceptance lengths, each solved for p "
                         f"(1 + p + ... + p^{REFERENCE_STEPS} = L, a chain of {REFERENCE_STEPS} drafts; L in "
                         f"[1, {REFERENCE_STEPS + 1}])")
    ap.add_argument("--spec", nargs="+", default=DEFAULT_SPECS, choices=list(SPECS))
    ap.add_argument("--full-costs", action="store_true",
                    help="adaptive: also a run whose cost table is the measured one with each forward scaled to --full "
                         "(the decisions it would make on the full model; its EXTRAPOLATED column is the figure)")
    ap.add_argument("--policy", nargs="+", default=["fixed"], choices=["fixed", "adaptive"],
                    help="fixed: a row per --spec; adaptive: a row per p with the adaptive policy (engine/policy.py: "
                         "chains of 1-5 drafts or plain decoding, each round; our glue), and the policy table")
    ap.add_argument("--glue", nargs="+", default=["eagle3", "torch"], choices=["eagle3", "torch"])
    # 61 = 1 + a multiple of both specs' full acceptance (4, 5): at p = 1 no round's tokens are cut off by the cap,
    # so tokens/s and B x acceptance / step count the same tokens
    ap.add_argument("--max-new", type=int, default=61)
    ap.add_argument("--oracle-seeds", type=int, default=1, metavar="S",
                    help="every ORACLE row (each fixed shape and the adaptive policy, per p) run under S oracle seeds "
                         "(other draws), each to its own fixed point with its own checks; the row gives their mean "
                         "tokens/s and its sd, each run in oracle_runs (a 61-token row's sd at B 1 is 4-13%%: the "
                         "mean of S shrinks it by sqrt(S)); unused by --heldout")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "bfloat16", "fp8", "fp8_e4m3"],
                    help="the target's latent cache (vLLM's spelling); fp8 = fp8_e4m3, key = fp8 * --kv-scale")
    ap.add_argument("--kv-scale", default=None, metavar="S|calibrate",
                    help="fp8 cache: one scale, one per layer (comma-separated; default 1.0) or calibrate (amax / 448 "
                         "per layer after the prefill)")
    ap.add_argument("--fixpoint", type=int, default=None, metavar="K",
                    help="the oracle's reference per (glue, p): from plain greedy's (and down from the higher p's), "
                         "replaced by the run's own output until they agree, at most K runs (0 or 1: plain's); "
                         "default 3 with --accept-length (a calibrated acceptance), else 0. Every row's acceptance is "
                         "checked against its p either way: off by more than chance, the row says UNCALIBRATED")
    ap.add_argument("--no-breakdown", action="store_true",
                    help="fixed shapes: only the timed run (no CUDA-event breakdown, no components-alone run)")
    ap.add_argument("--no-prefill-cache", action="store_true",
                    help="every speculative run prefills (default: once per batch, prefix and glue; PrefillCache)")
    ap.add_argument("--fenced-all", action="store_true",
                    help="the components-alone (fenced) run at every p, not only p = 1")
    ap.add_argument("--graphs", action="store_true",
                    help="CUDA graphs: each speculative round one graph (the components-alone run: per-step graphs)")
    ap.add_argument("--full", default="kimi-k2", help="the preset the per-layer times are extrapolated to")
    ap.add_argument("--heldout", type=int, default=0, metavar="N",
                    help="the shipped pair (byte-small) on its first N held-out prompts: plain, each --spec and the "
                         "adaptive policy in groups of --batch (run_heldout); --prefix, --p, --glue unused")
    ap.add_argument("--repeat", type=int, default=3, help="--heldout: timed passes (each method's best kept)")
    ap.add_argument("--threads", type=int, default=1, help="--heldout: CPU threads")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, metavar="JSON", help="only draw the chart of a results file")
    args = ap.parse_args(argv)
    from eagle3_ops.engine.oracle import p_for_acceptance_length

    try:
        _kv_cache(args)
    except ValueError as e:  # (names kv_dtype / kv_scale: the flags --kv-cache-dtype / --kv-scale)
        ap.error(f"--kv-cache-dtype / --kv-scale: {e}")

    args.lengths = {}
    if args.accept_length:
        bad = [L for L in args.accept_length if not 1 <= L <= REFERENCE_STEPS + 1]
        if bad:
            ap.error(f"--accept-length must be in [1, {REFERENCE_STEPS + 1}], got {bad[0]:g}")
        args.lengths = {p_for_acceptance_length(L, REFERENCE_STEPS): L for L in args.accept_length}
        args.p = sorted(args.lengths)
    if args.oracle_seeds < 1:
        ap.error(f"--oracle-seeds must be >= 1, got {args.oracle_seeds}")
    if args.fixpoint is None:  # a length asks for a calibrated acceptance: the run's own output as the reference
        args.fixpoint = 3 if args.accept_length else 0
    if args.plot:
        print(plot(args.plot))
        return 0
    start = time.time()
    print(f"# commit {_commit()}, {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs"
          f"{', ' + torch.cuda.get_device_name() if args.device.startswith('cuda') else ''}), torch {torch.__version__}, "
          f"{args.preset if not args.heldout else 'byte-small'}, {args.dtype}, {'CUDA graphs' if args.graphs else 'eager'}, "
          f"{_kv_cache(args).describe()}",
          flush=True)
    if args.heldout:
        rows = run_heldout(args)
        path = args.json or os.path.join(os.environ.get("EAGLE3_BENCH_OUT", "."), "e2e_heldout.json")
        with open(path, "w") as f:
            json.dump(dict(commit=_commit(), device=args.device, dtype=args.dtype, seconds=time.time() - start,
                           rows=rows), f, indent=1)
        print(f"rows: {path}")
        return 0 if all(r["identical"] for r in rows) else 1
    args.start = start
    rows = run(args)
    print(_table(rows))
    if "adaptive" in args.policy:
        print(policy_table(rows))
    bad = [r for r in rows if not r["calibrated"]]
    print(f"calibration: {len(rows) - len(bad)} of {len(rows)} rows at their oracle p"
          + "".join(f"\n  UNCALIBRATED: B {r['batch']} prefix {r['prefix']} {r['spec']} p {r['p']:.4f}: accepted "
                    f"{r['p_measured']:.3f} of {r['tested']} tested drafts" if r["p_measured"] is not None else
                    f"\n  UNCALIBRATED: B {r['batch']} prefix {r['prefix']} {r['spec']} p {r['p']:.4f}: reference not "
                    "the run's own" for r in bad))
    if not (args.json and "{" in args.json):
        path = args.json or os.path.join(os.environ.get("EAGLE3_BENCH_OUT", "."), "e2e.json")
        _write(path, args, rows)
        print(f"rows: {path}")
    return 0 if all(r["identical"] for r in rows) or not args.batch_invariant else 1


def _write(path: str, args, rows: list[dict]) -> None:
    """The rows with the run's settings (--json; with {batch} and {prefix} in it, one file per batch and prefix,
    written as each is done)."""
    meta = dict(commit=_commit(), preset=args.preset, dtype=args.dtype, device=args.device,
                device_name=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                torch=torch.__version__, max_new=args.max_new, batch_invariant=args.batch_invariant,
                kv_cache_dtype=args.kv_cache_dtype, kv_scale=args.kv_scale,
                eager=not args.graphs, graphs="round" if args.graphs else None, policy=args.policy,
                accept_length_reference_steps=REFERENCE_STEPS, fixpoint=args.fixpoint, oracle_seeds=args.oracle_seeds,
                drafter="ORACLE (engine/oracle.py): acceptance set by p, not by a trained drafter",
                seconds=time.time() - args.start)
    with open(path, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    if "{" in (args.json or ""):
        print(f"rows: {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
