"""The decode loop under a speculation policy (engine/policy.py): each round one of several graphs, chosen
by the host between rounds; generate_speculative(..., policy=...) runs it.

Graphs, each prepared (warmed up and, with graphs="round" on CUDA, captured) once at start-up and then only
replayed, whatever the sequence of decisions (RoundGraph.prepares stays 1):

- one speculative round per candidate shape (decode._Loop.round_fn: drafting, build_tree, verify forward,
  verify, kv_accept, bookkeeping, the drafter's catch-up), each with its own [B, N] buffers;
- the plain round: the target's forward on the root alone with capture, verify at N = 1 (verify_greedy's
  argmax, or verify_sampling's sample at the temperature: the same pick as plain decoding), the prefix advanced
  by one (kv_accept's effect at N = 1) and the bookkeeping; the drafter does not run: the token and its
  target features are kept in a pending buffer ([B, R] tokens, [B, R, n_aux * H] features) and ``lag`` counts them;
- the resume, in two sizes r (resume_sizes: 8 rows and R): the drafter's catch-up on the pending rows (fc over
  r rows a request, one drafter forward of r rows, the last pending row's logits and hidden state kept:
  fused.accept_finish with step = lag), the smallest that holds the lag, before the first speculative round
  after plain ones, or when R plain rounds are pending.

Every graph ends by writing a small snapshot [B, 2 + S] float64 (count, accepted drafts, the chain's cumulative
log-probabilities; the resume writes d_1's top-1 log-probability) that the host copies into pinned memory
without waiting. The host keeps one round in flight: it launches round r, then waits for round r - 1's copy
(the loop's sync point: round r keeps the device busy), feeds it to the policy and decides round r + 1. It
waits for the newest round only when the rounds in flight could finish every request (the stop test), for
the first round (the first decision's evidence) and for a probe (a speculative round after plain ones: the
next decision needs its outcome, or it would probe again blind). Which snapshots a decision has read depends
on the decisions alone, never on timing (schedule()), so the decisions are a function of the rounds' outcomes
and a run repeats itself: what bench_e2e's fixed point of the ORACLE's reference needs. simulate() drives the
same schedule with the acceptance drawn on the host and the time taken from a cost table (another machine's:
the H200's, on the CPU).

The output is the target's whatever the decisions: each round is lossless alone and the loop's state
(out, count, root, the caches' prefix lengths, last_logits, g) is shared, so a switch of shape, a fall back to
plain decoding and a return to speculation continue the same sequence (tests/test_policy.py).
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque

import torch

from . import fused
from .decode import DecodeStats, _chain_mask, _progress
from .graphs import RoundGraph

PLAIN = "plain"

COST_REPS = 5  # timed rounds per graph in the start-up cost table (the median on CUDA, the least on the CPU)
SHORT_RESUME = 8  # the small resume's rows: a short plain stretch's catch-up costs little even where rows do (CPU)


def resume_sizes(R: int) -> list[int]:
    """The resume graphs' row counts for a pending buffer of R rows."""
    return sorted({min(SHORT_RESUME, R), R})


def resume_label(lag: int, R: int) -> str:
    """The cost table's key of the resume that catches up `lag` pending rows: the smallest that holds them."""
    return f"resume/{next(r for r in resume_sizes(R) if r >= lag)}"


def label(spec) -> str:
    """A decision's name: "plain" (spec None), or steps/topk/tokens ("3/1/4")."""
    return PLAIN if spec is None else f"{spec.steps}/{spec.topk}/{spec.num_tokens}"


class _PolicyGraphs:
    """The plain round, the resume and one round per shape, sharing the loop's state (the module docstring)."""

    def __init__(self, loop, shapes, R: int, spec):
        B, dev, tkv, dkv = loop.B, loop.dev, loop.tkv, loop.dkv
        target, drafter, g_ops, aux_ids = loop.target, loop.drafter, loop.g_ops, loop.aux_ids
        H, dtype = target.cfg.hidden_size, target.model.embed_tokens.weight.dtype
        S = max(s.steps for s in shapes)
        self.snap = torch.zeros(B, 2 + S, dtype=torch.float64, device=dev)
        self.lag = torch.zeros(B, dtype=torch.int32, device=dev)
        pend_aux = torch.zeros(B, R, len(aux_ids) * H, dtype=dtype, device=dev)
        pend_tok = torch.zeros(B, R, dtype=torch.int64, device=dev)
        aux1 = torch.empty(B, len(aux_ids) * H, dtype=dtype, device=dev)
        root1 = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        parents1 = torch.full((B, 1), -1, dtype=torch.int32, device=dev)
        mask1 = _chain_mask(B, 1, dev)
        cu_rows1, cu_step1 = torch.zeros(B, dtype=torch.int64, device=dev), torch.zeros(B, dtype=torch.int32,
                                                                                       device=dev)
        cu_tok1, cu_pos1 = (torch.zeros(B, 1, dtype=torch.int64, device=dev) for _ in range(2))
        arangeR, arangeB = torch.arange(R, device=dev), torch.arange(B, device=dev)
        snap, lag, hist1 = self.snap, self.lag, loop.hist[:2]

        def plain_round():
            root1.copy_(loop.root[:, None])
            logits = target.forward(root1, tkv.prefix_lens[:, None].long(), tkv, mask1, aux1, aux_ids)
            accept_nodes, accept_len, emitted = loop.verify(logits, root1, parents1, spec)
            tkv.prefix_lens.add_(1)  # kv_accept at N = 1: node 0 stays where it is, the prefix grows by one
            fused.accept_update(accept_nodes, accept_len, emitted, loop.count, loop.out, hist1, loop.root,
                                tkv.prefix_lens, dkv.prefix_lens, loop.max_new, cu_rows1, cu_tok1, cu_pos1, cu_step1)
            # the drafter's pair for this position (EAGLE-3's shift: the emitted token with the root's features),
            # kept for the resume; a frozen request writes a row past its lag, which nothing reads
            at = lag.long().clamp(max=R - 1)
            pend_aux[arangeB, at] = aux1
            pend_tok[arangeB, at] = cu_tok1[:, 0]
            lag.add_(cu_step1)
            snap[:, 0].copy_(loop.count)
            snap[:, 1].zero_()

        def resume(r):
            rows = (arangeB[:, None] * R + arangeR[:r]).view(-1)  # each request's first r pending rows
            mask = _chain_mask(B, r, dev)

            def run():
                hidden = g_ops.project(drafter, pend_aux.view(B * R, -1), rows)
                positions = dkv.prefix_lens[:, None].long() + arangeR[:r]
                logits, hidden = drafter.forward(pend_tok[:, :r].contiguous(), hidden, positions, dkv, mask)
                fused.accept_finish(logits, hidden, loop.last_logits, loop.g, lag, dkv.prefix_lens)
                lag.zero_()
                snap[:, 2].copy_(fused.top_logprobs(loop.last_logits, 1)[0][:, 0])
            return run

        def spec_round(one_round, steps):
            def run():
                accept_len, scores = one_round()
                snap[:, 0].copy_(loop.count)
                snap[:, 1].copy_(accept_len)
                snap[:, 2:2 + steps].copy_(scores[:, :, 0])
            return run

        state = loop.state() + [lag, snap]
        capture = loop.graphs == "round"

        def graph(fn):
            return RoundGraph(fn, state, loop.pool, on_warmup=loop.on_warmup, capture=capture)

        self.graphs = {PLAIN: graph(plain_round)}
        for r in resume_sizes(R):
            self.graphs[f"resume/{r}"] = graph(resume(r))
        for s in shapes:
            self.graphs[label(s)] = graph(spec_round(loop.round_fn(s)[0], s.steps))


class _Ready:
    """A simulated round's snapshot rows, ready at launch."""

    def __init__(self, rows):
        self.rows = rows

    def read(self):
        return self.rows


class _Copied:
    """A round's snapshot on its way to pinned memory: read() waits for the copy (CUDA) and returns the rows."""

    def __init__(self, buf, ev):
        self.buf, self.ev = buf, ev

    def read(self):
        if self.ev is not None:
            self.ev.synchronize()
        return self.buf.tolist()


def measure_costs(graphs: dict, reps: int, cuda: bool) -> dict:
    """The cost table {name: seconds a round} of prepared graphs. CUDA: each graph's median of `reps` replays
    (RoundGraph.measure). CPU: `reps` passes over all the graphs in turn, each graph's least time kept: on a
    CPU shared with other work a burst of load only slows a round down, and taken in turn it falls on every
    shape alike instead of on the one being timed."""
    if cuda:
        return {name: g.measure(reps) for name, g in graphs.items()}
    times = {name: [] for name in graphs}
    for _ in range(reps):
        for name, g in graphs.items():
            times[name].append(g.measure(1))
    return {name: min(t) for name, t in times.items()}


def schedule(policy, B: int, max_new: int, R: int, launch, stale: int, progress=None) -> dict:
    """The host side of a policy's run, shared by run_policy and simulate: choose, launch (the resume first when
    due), read the snapshots and feed them to the policy, until every request has max_new tokens.

    launch(spec, resume) runs the round (after the resume graph `resume`, a cost-table label, when not None) and
    returns a handle whose read() gives its snapshot rows (B lists: count, accepted drafts, the scores or d_1's
    log-probability), waiting for them. stale: the rounds left unread at the sync point (1 on CUDA: the host
    decides round r + 1 from round r - 1 while round r runs; 0 on the CPU). Always read before deciding: the
    first round, a probe (a speculative round after plain ones), and the rounds in flight when they could finish
    every request (the stop test). Which rounds are read before which decision depends on the decisions only,
    never on timing, so a run's decisions are a function of its snapshots (a fixed point of the ORACLE's reference
    holds through them). Returns the counters DecodeStats takes."""
    inflight: deque = deque()  # (spec or None, resumed, handle)
    count, decisions, rounds, resumes, lag, settled = [1] * B, Counter(), 0, 0, 0, 0
    drafted = accepted = waits = 0

    def settle(keep: int) -> None:
        nonlocal drafted, accepted, settled, waits
        waits += keep == 0 and len(inflight) > 0 and stale > 0  # the newest round read: the device idles for the host
        while len(inflight) > keep:
            s, resumed, handle = inflight.popleft()
            rows = handle.read()
            active = [c < max_new for c in count]
            accept_len = [int(r[1]) for r in rows]
            for b in range(B):
                if active[b] and s is not None:
                    drafted += s.num_tokens - 1
                    accepted += accept_len[b]
                count[b] = int(rows[b][0])
            policy.observe(s, active, accept_len, [r[2:] for r in rows] if s is not None else None,
                           [r[2] for r in rows] if resumed and s is None else None, counts=list(count))
            settled += 1

    while not all(c >= max_new for c in count):
        s = policy.choose([c < max_new for c in count], lag)
        if s is not None and lag > R:
            raise RuntimeError("a policy that declared plain_only chose a speculative round")
        # the drafter's catch-up: before a speculative round after plain ones, or when R plain rounds are pending
        # (unless the policy decodes plain to the end: plain_only)
        resume = resume_label(lag, R) if lag and (s is not None or (lag >= R and not policy.plain_only)) else None
        handle = launch(s, resume)
        policy.launched(s, resume)
        probe = s is not None and (rounds == 0 or resume is not None)
        if resume is not None:
            resumes, lag = resumes + 1, 0
        lag += s is None
        inflight.append((s, resume is not None, handle))
        rounds += 1
        decisions[label(s)] += 1
        settle(0 if probe or settled == 0 or getattr(policy, "need_outcome", False) else stale)
        # the stop test: wait for the newest round only when the rounds in flight could finish every request
        most = sum(1 if x is None else min(x.num_tokens, x.steps + 1) for x, *_ in inflight)
        if inflight and all(c + most >= max_new for c in count):
            settle(0)
        if progress is not None:
            progress(min(count))
    return dict(rounds=rounds, decisions=dict(decisions), resumes=resumes, drafted=drafted, accepted=accepted,
                waits=waits)


def run_policy(loop, policy, shapes, spec, start, prefill_seconds, prefill_times, progress):
    """The rounds of generate_speculative under `policy` (the module docstring); returns (tokens, stats)."""
    B, dev, max_new, R = loop.B, loop.dev, loop.max_new, policy.resume_rows
    cuda = dev.type == "cuda"
    t0 = time.perf_counter()
    reserved = torch.cuda.memory_reserved(dev) if cuda else 0
    pg = _PolicyGraphs(loop, shapes, R, spec)
    for g in pg.graphs.values():
        g.prepare()
    graph_memory = torch.cuda.memory_reserved(dev) - reserved if cuda else 0
    fixed = getattr(policy, "fixed_costs", None)  # a table given: nothing to measure
    costs = dict(fixed) if fixed is not None else measure_costs(pg.graphs, COST_REPS, cuda)
    policy.start(B, costs, shapes, max_new)
    setup = time.perf_counter() - t0
    ring = [torch.zeros(pg.snap.shape, dtype=pg.snap.dtype, pin_memory=cuda) for _ in range(3)]
    launches = [0]

    def launch(s, resume):
        if resume is not None:
            pg.graphs[resume]()
        pg.graphs[label(s)]()
        buf = ring[launches[0] % len(ring)]  # (at most two rounds in flight: a buffer is read before its reuse)
        launches[0] += 1
        buf.copy_(pg.snap, non_blocking=cuda)
        ev = torch.cuda.Event() if cuda else None
        if ev is not None:
            ev.record()
        return _Copied(buf, ev)

    bar = _progress(progress, max_new, "adaptive")
    run = schedule(policy, B, max_new, R, launch, stale=1 if cuda else 0,
                   progress=None if bar is None else lambda n: bar.update(min(n, max_new) - bar.n))
    if bar is not None:
        bar.close()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stats = DecodeStats(tokens=B * max_new, seconds=seconds, accept_hist=loop.hist.tolist(),
                        prefill_seconds=prefill_seconds, prefill_times=prefill_times, batch=B,
                        setup_seconds=setup, costs=costs, graph_memory=graph_memory,
                        graph_prepares={name: g.prepares for name, g in pg.graphs.items()}, **run)
    return loop.out[:, :max_new], stats


def simulate(policy, costs: dict, B: int, max_new: int, p: float, seed: int = 0, stale: int = 1,
             common: bool = False, wait: float = 0.0) -> dict:
    """The policy's decisions and the run's time in the cost table's terms, with the ORACLE's acceptance drawn on
    the host instead of decoded: each tested draft accepted with probability p (so a chain of S drafts accepts its
    first k with probability p^k (1 - p), as the ORACLE's do), the drafter's confidence 1 (the ORACLE's), every
    round scheduled as run_policy schedules it (schedule(): the same reads before the same decisions, `stale` 1 as
    on CUDA). common: the draws are per (request, token position), one each, so every policy run with the same
    seed meets the same easy and hard tokens (common random numbers; a position's draft is tested at most once:
    a rejected one is replaced by the target's token, an untested one is drafted again next round); otherwise one
    stream of draws in the order the rounds test drafts (the default, the tables of docs/e2e.md). seconds: the sum
    of the launched rounds' and resumes' costs, plus `wait` for each time the host read the newest round before
    launching the next (waits: the device idles for the read, the decision and the launch). Returns dict(seconds,
    tok_s, decisions, rounds, resumes, drafted, accepted, waits)."""
    from .decode import SpecConfig

    rng = random.Random(seed)
    shapes = policy.shapes(SpecConfig())
    policy.start(B, costs, shapes, max_new)
    S = max(s.steps for s in shapes)
    keep = [[rng.random() < p for _ in range(max_new + S)] for _ in range(B)] if common else None
    count, clock = [1] * B, [0.0]

    def launch(s, resume):
        clock[0] += costs[label(s)] + (costs[resume] if resume is not None else 0.0)
        rows = []
        for b in range(B):
            a = 0
            if count[b] < max_new:
                while s is not None and a < s.steps and (keep[b][count[b] + a] if common else rng.random() < p):
                    a += 1
                count[b] = min(max_new, count[b] + a + 1)
            rows.append([count[b], a] + [0.0] * S)
        return _Ready(rows)

    run = schedule(policy, B, max_new, policy.resume_rows, launch, stale)
    clock[0] += wait * run["waits"]
    return dict(run, seconds=clock[0], tok_s=B * (max_new - 1) / clock[0])


__all__ = ["PLAIN", "label", "measure_costs", "resume_label", "resume_sizes", "run_policy", "schedule", "simulate"]
