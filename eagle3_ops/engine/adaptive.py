"""The decode loop under a speculation policy (engine/policy.py): each round one of several graphs, chosen
by the host between rounds; generate_speculative(..., policy=...) runs it.

Graphs, each prepared (warmed up and, with graphs="round" on CUDA, captured) once at start-up and then only
replayed, whatever the sequence of decisions (RoundGraph.prepares stays 1):

- one speculative round per candidate shape (decode._Loop.round_fn: drafting, build_tree, verify forward,
  verify, kv_accept, bookkeeping, the drafter's catch-up), each with its own [B, N] buffers;
- the plain round: the target's forward on the root alone with capture, verify at N = 1 (verify_greedy's
  argmax, or verify_sampling's sample at the temperature: the same pick as plain decoding), the prefix advanced
  by one (kv_accept's effect at N = 1) and the bookkeeping; the drafter does not run: the token and its target features are kept in a pending buffer
  ([B, R] tokens, [B, R, n_aux * H] features) and ``lag`` counts them;
- the resume, in two sizes r (resume_sizes: 8 rows and R): the drafter's catch-up on the pending rows (fc over
  r rows a request, one drafter forward of r rows, the last pending row's logits and hidden state kept:
  fused.accept_finish with step = lag), the smallest that holds the lag, before the first speculative round
  after plain ones, or when R plain rounds are pending.

Every graph ends by writing a small snapshot [B, 2 + S] float64 (count, accepted drafts, the chain's cumulative
log-probabilities; the resume writes d_1's top-1 log-probability) that the host copies into pinned memory
without waiting. The host keeps one round in flight: it launches round r, then waits for round r - 1's copy
(the loop's sync point: round r keeps the device busy), feeds it to the policy and decides round r + 1. It
waits for the newest round only when the rounds in flight could finish every request (the stop test), and
for the first round (the first decision's evidence).

The output is the target's whatever the decisions: each round is lossless alone and the loop's state
(out, count, root, the caches' prefix lengths, last_logits, g) is shared, so a switch of shape, a fall back to
plain decoding and a return to speculation continue the same sequence (tests/test_policy.py).
"""

from __future__ import annotations

import time
from collections import Counter, deque

import torch

from . import fused
from .decode import DecodeStats, _chain_mask, _progress
from .graphs import RoundGraph

PLAIN = "plain"

COST_REPS = 5  # timed rounds per graph in the start-up cost table (the median)
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
    costs = {name: g.measure(COST_REPS) for name, g in pg.graphs.items()}
    policy.start(B, costs, shapes)
    setup = time.perf_counter() - t0
    ring = [torch.zeros(pg.snap.shape, dtype=pg.snap.dtype, pin_memory=cuda) for _ in range(3)]
    inflight: deque = deque()  # (spec or None, resumed, host buffer, event)
    count, decisions, rounds, resumes, lag = [1] * B, Counter(), 0, 0, 0
    drafted = accepted = 0

    def settle(block: bool) -> None:
        """Read the snapshots in flight, oldest first (block: wait for the oldest; else only those copied)."""
        nonlocal drafted, accepted
        while inflight:
            s, resumed, buf, ev = inflight[0]
            if ev is not None and not block and not ev.query():
                return
            if ev is not None:
                ev.synchronize()
            inflight.popleft()
            rows = buf.tolist()
            active = [c < max_new for c in count]
            accept_len = [int(r[1]) for r in rows]
            for b in range(B):
                if active[b] and s is not None:
                    drafted += s.num_tokens - 1
                    accepted += accept_len[b]
                count[b] = int(rows[b][0])
            policy.observe(s, active, accept_len, [r[2:] for r in rows] if s is not None else None,
                           [r[2] for r in rows] if resumed and s is None else None)
            block = False

    bar = _progress(progress, max_new, "adaptive")
    while not all(c >= max_new for c in count):
        s = policy.choose([c < max_new for c in count], lag)
        resumed = bool(lag) and (s is not None or lag >= R)
        if resumed:
            pg.graphs[resume_label(lag, R)]()
            resumes, lag = resumes + 1, 0
        pg.graphs[label(s)]()
        lag += s is None
        buf = ring[rounds % len(ring)]
        buf.copy_(pg.snap, non_blocking=cuda)
        ev = torch.cuda.Event() if cuda else None
        if ev is not None:
            ev.record()
        inflight.append((s, resumed, buf, ev))
        rounds += 1
        decisions[label(s)] += 1
        settle(block=False)
        while len(inflight) > 1 or (inflight and policy.observed == 0):
            settle(block=True)
        # the stop test: wait for the newest round only when the rounds in flight could finish every request
        most = sum(1 if x is None else min(x.num_tokens, x.steps + 1) for x, *_ in inflight)
        if inflight and all(c + most >= max_new for c in count):
            settle(block=True)
        if bar is not None:
            bar.update(min(min(count), max_new) - bar.n)
    if bar is not None:
        bar.close()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stats = DecodeStats(tokens=B * max_new, seconds=seconds, rounds=rounds, accept_hist=loop.hist.tolist(),
                        prefill_seconds=prefill_seconds, prefill_times=prefill_times, batch=B,
                        setup_seconds=setup, drafted=drafted, accepted=accepted, decisions=dict(decisions),
                        resumes=resumes, costs=costs, graph_memory=graph_memory,
                        graph_prepares={name: g.prepares for name, g in pg.graphs.items()})
    return loop.out[:, :max_new], stats


__all__ = ["PLAIN", "label", "resume_label", "resume_sizes", "run_policy"]
