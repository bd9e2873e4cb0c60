"""Plain and speculative decoding on a Target (and an EAGLE-3 Drafter), every hot path through
torch.ops.eagle3 (docs/models.md, "One speculative round"):

1. prefill the target on x_0..x_{n-1}, capturing the aux states F_i; x_n = its next token;
2. draft extend at positions 0..n-1 on (embed(x_{i+1}), fc(F_i)) -> the drafter's KV, d_1's scores;
3. draft steps: topk beams per step, each fed (embed(token), the drafter's own hidden) with tree
   attention over the drafter's cache (a chain is topk = 1);
4. build_tree -> the verify tree (N tokens, root = x_n); the target verifies it with tree attention and
   captures F at every node;
5. verify_greedy (or verify_sampling) -> accepted path; kv_accept compacts the target's KV of every
   layer in one call and advances prefix_lens;
6. draft catch-up on the accepted tokens with the target's F (fc_proj gathers the accepted rows),
   giving the next round's d_1 scores.

Shapes are static within a round (N verify tokens, (steps - 1) * topk draft-block rows, N catch-up
rows); finished requests are frozen rather than removed. The host syncs are the loop's stopping test
between rounds (none before the first round any request could finish in), one after the prefill (its
time, DecodeStats.prefill_seconds), and the optional timer's; the optional wiring check adds none
(engine/wiring_check.py). With a policy (engine/policy.py) each round's shape is chosen between rounds,
plain decode steps included, and the rounds run in engine/adaptive.py: every shape's round is _Loop.round_fn's
over the same state.

The target's latent cache: kv_dtype ("auto", "bf16", "fp8" / "fp8_e4m3": vLLM's --kv-cache-dtype) and, for fp8,
kv_scale (per layer, default 1.0, or "calibrate": amax / 448 per layer after the prefill), or by default the
target's own kv_cache (models.cache.KVCacheConfig). The drafter's K / V stay in its dtype.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import ops, tree
from ..models.cache import KVCacheConfig, PagedKV
from . import fused
from .graphs import RoundGraph, StepGraph, new_pool
from .wiring_check import CheckRun, WiringCheck, WiringReport


@dataclass(frozen=True)
class SpecConfig:
    """steps: draft steps per round (tree depth); topk: beams per step (1 = a chain); num_tokens:
    verify tokens N per round, root included; temperature 0 = greedy, > 0 = lossless sampling."""

    steps: int = 3
    topk: int = 1
    num_tokens: int = 4
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.topk < 1:
            raise ValueError(f"steps and topk must be >= 1, got steps={self.steps}, topk={self.topk}")
        most = 1 + self.topk + (self.steps - 1) * self.topk * self.topk
        if self.topk == 1:
            most = 1 + self.steps
        if not 2 <= self.num_tokens <= most:
            raise ValueError(f"num_tokens must be in [2, {most}] for steps={self.steps}, topk={self.topk} "
                             f"(the root plus at most that many draft candidates), got {self.num_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class DecodeStats:
    """What a decode run measured. acceptance length = tokens emitted per verify step (accepted drafts + 1)."""

    tokens: int = 0  # generated tokens counted over all requests (up to max_new each)
    seconds: float = 0.0
    rounds: int = 0
    accept_hist: list = field(default_factory=list)  # accept_hist[k] = verify steps that emitted k tokens
    times: dict = field(default_factory=dict)  # component -> seconds (when timed)
    prefill_seconds: float = 0.0  # of `seconds`: the prefill (and the drafter's extend), up to the first token
    prefill_times: dict = field(default_factory=dict)  # of `times`: the prefill's share (when timed)
    batch: int = 0
    # of `seconds`: capturing the CUDA graphs (graphs=True), which an engine does once at start-up; `times`
    # already has it taken out of the component it fell in
    setup_seconds: float = 0.0
    # graphs="round" with an events Timer: the rounds' summed span on the device (replays only, the host's
    # waits between them out); 0 otherwise
    round_seconds: float = 0.0
    wiring: Optional[WiringReport] = None  # the serve-time wiring check's (wiring_check=...), else None
    # draft tokens verified (N - 1 a request a speculative round) and of them accepted, over the requests decoding
    drafted: int = 0
    accepted: int = 0
    # a policy's run (policy=...): rounds per decision ("plain", "3/1/4" = steps/topk/tokens), the drafter's
    # catch-ups after plain rounds ("resume/r"), the cost table it chose from (seconds a round per decision), the
    # device memory its graphs took (bytes reserved, CUDA graphs only), and how often each graph was prepared
    # (warmed up and captured: once), and the rounds whose decision waited for the newest round's outcome (the
    # device idle for the host's read and decision)
    decisions: dict = field(default_factory=dict)
    waits: int = 0
    resumes: int = 0
    costs: dict = field(default_factory=dict)
    graph_memory: int = 0
    graph_prepares: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first per request, over the time after the prefill (graph captures excluded): the
        decode phase alone."""
        t = self.seconds - self.prefill_seconds - self.setup_seconds
        return (self.tokens - self.batch) / t if t > 0 and self.batch else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + 1; a policy's plain rounds count as steps of 1)."""
        steps = sum(self.accept_hist)
        return sum(k * c for k, c in enumerate(self.accept_hist)) / steps if steps else 0.0

    @property
    def accept_rate(self) -> float:
        """SGLang's and vLLM's acceptance rate: accepted draft tokens over draft tokens verified (0 if none)."""
        return self.accepted / self.drafted if self.drafted else 0.0


class Timer:
    """Accumulates time per component (name -> seconds in ``times``).

    mode "fence": the device is drained around each section, so each component runs alone on it (its host
    launch included) and the run is slowed by the syncs. mode "events": CUDA events on the current stream
    around each section, no sync: each component's span on the device timeline of the undisturbed run (a
    section the host is late to launch shows its wait); resolved when ``times`` is read (which waits for
    them). On the CPU both are wall time (CPU ops are synchronous)."""

    def __init__(self, enabled: bool = True, device: torch.device | str = "cpu", mode: str = "fence"):
        if mode not in ("fence", "events"):
            raise ValueError(f"mode must be 'fence' or 'events', got {mode!r}")
        self.enabled, self.mode = enabled, mode
        self.cuda = torch.device(device).type == "cuda"
        self._times: dict[str, float] = defaultdict(float)
        self._pending: list = []  # (name, start event, end event) not yet read
        self._graph_marks: list = []  # the same, recorded inside a captured graph: read after each replay

    @property
    def times(self) -> dict[str, float]:
        for name, a, b in self._pending:
            b.synchronize()
            self._times[name] += a.elapsed_time(b) / 1e3
        self._pending.clear()
        return self._times

    @contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        if self.cuda and self.mode == "events":
            capturing = torch.cuda.is_current_stream_capturing()
            # inside a graph capture: event record nodes (external), read after each replay (after_replay)
            a, b = (torch.cuda.Event(enable_timing=True, external=capturing) for _ in range(2))
            a.record()
            yield
            b.record()
            (self._graph_marks if capturing else self._pending).append((name, a, b))
            return
        if self.cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("a fenced Timer cannot time inside a CUDA graph capture: use mode 'events', or "
                             "graphs='steps'")
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self._times[name] += time.perf_counter() - t0

    def new_graph(self) -> None:
        """A new graph is being captured: the marks of an earlier one are no longer replayed."""
        self._graph_marks.clear()

    def after_replay(self) -> None:
        """Add the sections recorded inside a captured graph, as its last replay timed them (waits for it)."""
        if self._graph_marks:
            self._graph_marks[-1][2].synchronize()
            for name, a, b in self._graph_marks:
                self._times[name] += a.elapsed_time(b) / 1e3

    def discount(self, name: str, seconds: float) -> None:
        """Take seconds (timed apart, e.g. a graph capture inside a section) out of a component."""
        if self.enabled and seconds:
            self.times[name] -= seconds  # (reading times resolves the pending events first)


def _setup_seconds(timer: Timer, graphs: dict) -> float:
    """The graph captures of a run ({component: [StepGraph]}): taken out of the timer's components; their sum."""
    total = 0.0
    for name, steps in graphs.items():
        for s in steps:
            timer.discount(name, s.setup_seconds)
            total += s.setup_seconds
    return total


def _elapsed(start: float, device) -> float:
    """Seconds since start, the device drained first (one host sync, between the prefill and the decode)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _progress(enabled: bool, total: int, desc: str):
    """A tqdm bar over generated tokens (of the slowest request), or None."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", leave=False)


def _chain_mask(B: int, n: int, device) -> Tensor:
    return tree.tree_mask(tree.chain_parents(B, n, device=device))


def _pick(logits: Tensor, temperature: float, generator: Optional[torch.Generator]) -> Tensor:
    """[B, V] -> [B] int64: argmax (first maximum) or a sample at the temperature."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


# A prefill runs in chunks of at most this many tokens over the batch (a chunk per request of
# PREFILL_TOKENS // B positions): the MoE's grouped rows, the drafter's logits and the capture buffer stay a
# few GB at Kimi width, whatever the prompt length. Plain and speculative decoding chunk alike.
PREFILL_TOKENS = 8192


def _prefill_chunks(B: int, T0: int):
    """(start, length) of each prefill chunk."""
    C = max(1, PREFILL_TOKENS // B)
    return [(s, min(C, T0 - s)) for s in range(0, T0, C)]


def kv_config(target, kv_dtype: Optional[str] = None, kv_scale=None) -> KVCacheConfig:
    """The latent cache a run makes: kv_dtype / kv_scale as given (KVCacheConfig checks them, naming the argument),
    or target.kv_cache where both are None."""
    if kv_dtype is None and kv_scale is None:
        return getattr(target, "kv_cache", KVCacheConfig())
    return KVCacheConfig(kv_dtype or "auto", 1.0 if kv_scale is None else kv_scale)


def _prefill_kv(target, kv: PagedKV, T0: int) -> PagedKV:
    """Where a prefill of T0 positions writes: kv itself, or, for an fp8 cache whose scales are calibrated
    (kv.calibrating), a cache in the model's dtype with room for the prompt, quantised into kv afterwards
    (_prefill_done). (It holds B * T0 rows per layer in the model's dtype for the prefill's duration.)"""
    if not kv.calibrating:
        return kv
    return target.new_kv(kv.batch, T0, page_size=kv.page_size, dtype=target.lm_head.weight.dtype,
                         device=kv.prefix_lens.device)


def _prefill_done(kv: PagedKV, pkv: PagedKV, T0: int) -> None:
    if pkv is not kv:
        kv.calibrate_from(pkv, T0)  # scales = amax / 448 per layer, on the device


def _prefill(target, prompts: Tensor, kv) -> Tensor:
    """Target forward over whole prompts (equal lengths), chunk by chunk; the last position's logits [B, V]. A
    calibrating fp8 kv gets its scales and its quantised rows once the prefill is over (_prefill_kv)."""
    B, T0 = prompts.shape
    pkv = _prefill_kv(target, kv, T0)
    for s, n in _prefill_chunks(B, T0):
        positions = torch.arange(s, s + n, device=prompts.device).expand(B, n)
        logits = target.forward(prompts[:, s:s + n], positions, pkv, _chain_mask(B, n, prompts.device), last_only=True)
        pkv.advance(n)
    _prefill_done(kv, pkv, T0)
    return logits


def _graph_mode(graphs) -> str:
    """graphs argument -> "" (eager), "round" (True: each speculative round one graph) or "steps"."""
    if graphs is True or graphs == "round":
        return "round"
    if graphs == "steps":
        return "steps"
    if graphs is False or graphs is None or graphs == "":
        return ""
    raise ValueError(f"graphs must be False, True / 'round' or 'steps', got {graphs!r}")


@torch.no_grad()
def _check_graphs(target, graphs) -> None:
    if not graphs:
        return
    if getattr(target, "batch_invariant_rows", 0):
        raise ValueError("graphs=True needs the fast path: the batch-invariant mode syncs the host in its MoE")
    w = target.lm_head.weight
    if w.is_cuda and w.dtype != torch.bfloat16:
        raise ValueError(f"graphs=True on CUDA needs a bf16 target (torch's grouped GEMM syncs the host in the MoE "
                         f"for other dtypes), got {w.dtype}")


def generate_plain(target, prompts: Tensor, max_new: int, *, temperature: float = 0.0, seed: int = 0,
                   page_size: int = 16, timer: Optional[Timer] = None,
                   progress: bool = False, graphs: bool | str = False, kv_dtype: Optional[str] = None,
                   kv_scale=None) -> tuple[Tensor, DecodeStats]:
    """Plain decoding: one target forward per token. graphs: each decode step replayed from a CUDA graph
    (engine/graphs.py; any of speculative decoding's graph modes). kv_dtype, kv_scale: the target's latent cache
    (kv_config; default target.kv_cache). Returns (tokens [B, max_new] int64, stats)."""
    graphs = bool(_graph_mode(graphs))
    _check_graphs(target, graphs)
    B, T0 = prompts.shape
    timer = timer or Timer(enabled=False)
    gen = torch.Generator(device=prompts.device).manual_seed(seed) if temperature > 0 else None
    start = time.perf_counter()
    kv = target.new_kv(B, T0 + max_new + 1, page_size=page_size, device=prompts.device,
                       config=kv_config(target, kv_dtype, kv_scale))
    out = torch.empty(B, max_new, dtype=torch.int64, device=prompts.device)
    with timer("target"):
        tok = _pick(_prefill(target, prompts, kv), temperature, gen)
    out[:, 0] = tok
    prefill_seconds, prefill_times = _elapsed(start, prompts.device), dict(timer.times)
    self_only = torch.ones(B, 1, 1, dtype=torch.int32, device=prompts.device)
    step = StepGraph(lambda t, p: target.forward(t, p, kv, self_only), new_pool(prompts.device)) if graphs else \
        (lambda t, p: target.forward(t, p, kv, self_only))
    bar = _progress(progress, max_new, "plain")
    for i in range(1, max_new):
        if bar is not None:
            bar.update(1)
        with timer("target"):
            logits = step(tok[:, None], kv.prefix_lens[:, None].long())
            kv.advance(1)
        tok = _pick(logits.view(B, -1), temperature, gen)
        out[:, i] = tok
    if bar is not None:
        bar.close()
    if prompts.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    setup = _setup_seconds(timer, {"target": [step]} if graphs else {})
    return out, DecodeStats(tokens=B * max_new, seconds=seconds, rounds=max_new, accept_hist=[0, max_new * B],
                            times=dict(timer.times), prefill_seconds=prefill_seconds,
                            prefill_times=prefill_times, batch=B, setup_seconds=setup)


class _Drafting:
    """Drafting's buffers and constants, made once per run: build_tree's inputs (their slots no round writes
    keep their fill), the draft block, and what does not change between rounds (the block's depths, its
    identity, and for a chain its whole ancestor mask). Every round rewrites what it reads."""

    def __init__(self, B: int, spec: SpecConfig, H: int, dtype: torch.dtype, dev):
        K, S = spec.topk, spec.steps
        M, NB = K * K, (S - 1) * K
        self.tokens = torch.zeros(B, S, M, dtype=torch.int64, device=dev)
        self.scores = torch.full((B, S, M), float("-inf"), dtype=torch.float32, device=dev)
        self.parents = torch.full((B, S, M), -1, dtype=torch.int64, device=dev)
        if K == 1:
            self.parents[:, 1:, 0] = 0  # a chain: each depth's one candidate hangs from the one before
        self.blk_tok = torch.zeros(B, max(NB, 1), dtype=torch.int64, device=dev)
        self.blk_hidden = torch.zeros(B, max(NB, 1), H, dtype=dtype, device=dev)
        self.depth = torch.arange(NB, device=dev) // K  # block row -> depth - 1
        # the block's ancestor-or-self mask, kept packed (tree_attention's int32 words): a row is its parent's
        # row with its own bit set
        eye = torch.eye(max(NB, 1), dtype=torch.bool, device=dev).expand(B, -1, -1).contiguous()
        self.eye_words = tree.dense_to_mask(eye)
        self.blk_words = self.eye_words.clone()
        self.cand0 = torch.arange(K, device=dev).expand(B, K)
        self.chain_mask = None  # a chain's block mask: each row sees the rows before it
        if K == 1 and NB:
            self.chain_mask = tree.dense_to_mask(torch.ones(NB, NB, dtype=torch.bool, device=dev).tril()
                                                 .expand(B, NB, NB).contiguous())


def _draft_candidates(draft_step, last_logits: Tensor, g: Tensor, prefix_lens: Tensor, spec: SpecConfig,
                      timer: Timer, to_target_ids, d: _Drafting):
    """EAGLE-2/3 dynamic drafting: depth 0 = top-k of d_1's scores; each further step runs the drafter on
    the k beams and keeps the top-k of their k * k children by cumulative log-probability.

    Returns build_tree's inputs: draft_tokens / draft_scores / draft_parents [B, S, M], M = topk**2 (d's
    buffers, rewritten each round). The beams' KV sit in a draft block after the drafter's prefix; every
    step re-runs the whole block (static shape) with an ancestor mask, so each row sees the prefix and its
    own ancestors only. A chain (topk 1) has no beams to choose: its mask and parents are constants."""
    B, K, S = last_logits.shape[0], spec.topk, spec.steps
    M, H = K * K, g.shape[-1]
    top_lp, top_id = fused.top_logprobs(last_logits, K)  # [B, K]
    beam_tok = to_target_ids(top_id)
    d.tokens[:, 0, :K], d.scores[:, 0, :K] = beam_tok, top_lp
    if S == 1:
        return d.tokens, d.scores, d.parents
    NB = (S - 1) * K
    positions = prefix_lens[:, None].long() + d.depth  # depth-d node at n + d - 1
    if K == 1:
        score, hid = top_lp, g
        for s in range(1, S):
            d.blk_tok[:, s - 1:s], d.blk_hidden[:, s - 1] = beam_tok, hid
            with timer("draft"):
                logits, hidden = draft_step(d.blk_tok, d.blk_hidden.view(B * NB, H), positions, d.chain_mask)
            lp, ids = fused.top_logprobs(logits.view(B, NB, -1)[:, s - 1], 1)  # [B, 1]
            score = score + lp
            beam_tok = to_target_ids(ids)
            d.tokens[:, s, :1], d.scores[:, s, :1] = beam_tok, score
            hid = hidden.view(B, NB, H)[:, s - 1]
        return d.tokens, d.scores, d.parents
    beam_score, beam_cand = top_lp, d.cand0
    beam_hidden = g[:, None, :].expand(B, K, H)
    d.blk_words.copy_(d.eye_words)  # ancestor-or-self within the block
    beam_slot = None  # block slot of each beam's parent (none at depth 1)
    for s in range(1, S):
        lo = (s - 1) * K
        d.blk_tok[:, lo:lo + K], d.blk_hidden[:, lo:lo + K] = beam_tok, beam_hidden
        if beam_slot is not None:
            W = d.blk_words.shape[-1]
            parent_rows = torch.gather(d.blk_words, 1, beam_slot[:, :, None].expand(B, K, W))
            d.blk_words[:, lo:lo + K] = parent_rows | d.eye_words[:, lo:lo + K]
        with timer("draft"):
            logits, hidden = draft_step(d.blk_tok, d.blk_hidden.view(B * NB, H), positions, d.blk_words)
        lp_top, id_top = fused.top_logprobs(logits.view(B, NB, -1)[:, lo:lo + K], K)  # [B, K beams, K children]
        scores = (beam_score[:, :, None] + lp_top).reshape(B, M)
        cand_tok = to_target_ids(id_top).reshape(B, M)
        d.tokens[:, s], d.scores[:, s] = cand_tok, scores
        d.parents[:, s] = beam_cand[:, :, None].expand(B, K, K).reshape(B, M)
        beam_score, beam_cand = scores.topk(K, dim=-1)
        beam_tok = cand_tok.gather(1, beam_cand)
        beam_slot = beam_cand // K + lo  # the block row of each new beam's parent
        beam_hidden = hidden.view(B, NB, H).gather(1, beam_slot[:, :, None].expand(B, K, H))
    return d.tokens, d.scores, d.parents


class _Eagle3Glue:
    """The step's glue through torch.ops.eagle3 (the default)."""

    build_tree, verify_greedy, kv_accept = staticmethod(ops.build_tree), staticmethod(ops.verify_greedy), \
        staticmethod(ops.kv_accept)

    @staticmethod
    def project(drafter, aux, rows=None):
        return drafter.project(aux, rows)


def _glue(name):
    """"eagle3" or "torch", or a glue object itself (eagle3_ops.parallel.TPGlue: the same five calls)."""
    if not isinstance(name, str):
        return name
    if name == "eagle3":
        return _Eagle3Glue
    if name == "torch":
        from . import torch_glue
        return torch_glue
    raise ValueError(f"glue must be 'eagle3' or 'torch', got {name!r}")


@contextmanager
def _plain_capture(target, on: bool):
    old = getattr(target, "plain_capture", False)
    target.plain_capture = on
    try:
        yield
    finally:
        target.plain_capture = old


class PrefillCache:
    """One prompt batch's speculative prefill, kept to start further runs from (a benchmark sweeping settings
    over the same prompts pays the prefill once). The first generate_speculative given it prefills as usual
    and keeps the caches' first T0 positions, the first token, and the drafter's last scores and hidden state;
    later ones copy those into their own caches instead. Reuse it only with the same target, drafter weights
    and aux ids (the prompts, the glue and the drafter's type are checked). A drafter with
    after_cached_prefill(chunks, positions) (the oracle: its scores follow its call count) gives its own
    last scores for the restored state."""

    def __init__(self):
        self.state: Optional[dict] = None
        self.prefill_seconds = 0.0  # of the run that prefilled


@torch.no_grad()
def generate_speculative(target, drafter, prompts: Tensor, max_new: int, spec: SpecConfig = SpecConfig(), *,
                         aux_ids: Optional[Sequence[int]] = None, page_size: int = 16,
                         timer: Optional[Timer] = None, progress: bool = False,
                         glue: str = "eagle3", graphs: bool | str = False,
                         prefill_cache: Optional[PrefillCache] = None,
                         wiring_check: Optional[WiringCheck] = None, policy=None, kv_dtype: Optional[str] = None,
                         kv_scale=None) -> tuple[Tensor, DecodeStats]:
    """Speculative decoding (chain or tree, greedy or sampled). aux_ids: which target layers feed the
    drafter (ours, "output of layer k"; default the drafter's configured ids; eagle3_ops.diagnose
    passes miswirings here). glue: "eagle3" (torch.ops.eagle3) or "torch", the same loop with capture, fc,
    build_tree, verify and kv_accept done the plain-PyTorch way engines do them (engine/torch_glue.py; greedy
    only). graphs: True or "round", each round (drafting, build_tree, the verify forward, verify, kv_accept,
    the bookkeeping and the catch-up) replayed as one CUDA graph, the host launching one graph a round
    (engine/graphs.RoundGraph); "steps", only the verify forward, each draft step and the catch-up's fc and
    forward replayed from graphs, the rest eager between them, as engines commonly run it (a fenced Timer
    needs this mode or eager). prefill_cache: a PrefillCache to fill (first run) or start from (later runs).
    wiring_check: the serve-time wiring check (engine/wiring_check.py: accumulated on the device inside each
    round, read without a host sync; a WiringWarning, or MiswiringError in strict mode, on a likely
    miswiring; stats.wiring holds its numbers). policy: None (every round `spec`), or an
    engine.policy.Policy choosing each round's shape among its candidates, plain decoding included
    (engine/policy.py; eager or graphs="round", no timer, no wiring check; `spec` gives the temperature and
    seed). kv_dtype, kv_scale: the target's latent cache (kv_config; default target.kv_cache: "auto", or fp8
    e4m3 with per-layer scales or "calibrate"); the drafter's K / V stay in its dtype. Returns (tokens
    [B, max_new] int64, stats)."""
    graphs = _graph_mode(graphs)
    kv_cache = kv_config(target, kv_dtype, kv_scale)
    _check_graphs(target, graphs)
    g_ops = _glue(glue)
    if glue == "torch" and spec.temperature > 0:
        raise ValueError("glue='torch' has greedy verification only (temperature 0)")
    if policy is not None:
        if graphs == "steps" or wiring_check is not None or (timer is not None and timer.enabled):
            raise ValueError("a policy runs eager or with graphs='round', without a timer or a wiring check")
    with _plain_capture(target, glue == "torch"):
        return _generate_speculative(target, drafter, prompts, max_new, spec, aux_ids, page_size, timer, progress,
                                     g_ops, graphs, prefill_cache, glue, wiring_check, policy, kv_cache)


def _spec_prefill(target, drafter, prompts, temperature, gen, aux_ids, tkv, dkv, timer, g_ops, prefill_cache,
                  glue, start, kv_key=None):
    """Steps 1-2: prefill with capture, then the drafter's extend on (embed(x_{i+1}), fc(F_i)), chunk by chunk
    (each chunk's features go straight to the drafter: the capture buffer is one chunk's), or a kept prefill
    copied in. Returns (root [B], last_logits [B, V], g [B, Hd]): the loop's state, updated in place each round
    (a round graph replays against these addresses)."""
    B, T0 = prompts.shape
    dev, H, dtype = prompts.device, target.cfg.hidden_size, target.model.embed_tokens.weight.dtype
    chunks = _prefill_chunks(B, T0)
    cached = prefill_cache.state if prefill_cache is not None else None
    if cached is not None:  # a kept prefill: its caches' rows, first token and drafter state copied in
        kind = type(drafter).__name__
        if cached["prompts"].shape != prompts.shape or cached["glue"] != glue or cached["drafter_kind"] != kind:
            raise ValueError(f"prefill_cache holds a prefill of prompts {tuple(cached['prompts'].shape)} with glue "
                             f"{cached['glue']!r} and a {cached['drafter_kind']}, not {(B, T0)} with {glue!r} and "
                             f"a {kind}")
        if not torch.equal(cached["prompts"], prompts):  # (one host sync, before the decode)
            raise ValueError("prefill_cache holds the prefill of other prompts (same shape, other tokens)")
        if cached["kv"] != kv_key:
            raise ValueError(f"prefill_cache holds a prefill into a {cached['kv']} latent cache, not {kv_key}")
        for kv, rows in ((tkv, cached["target"]), (dkv, cached["drafter"])):
            page, slot = kv.index(torch.arange(T0, device=dev).expand(B, T0))
            for i, r in enumerate(rows):
                kv.put(i, page, slot, r)
            kv.prefix_lens.fill_(T0)
        if tkv.kv_scales is not None:  # fp8: the scales its rows were quantised with (calibrated ones included)
            tkv.kv_scales.copy_(cached["kv_scales"])
            tkv.calibrating = False
        hook = getattr(drafter, "after_cached_prefill", None)
        last_logits = (hook(len(chunks), torch.full((B, 1), T0 - 1, dtype=torch.int64, device=dev)) if hook
                       else cached["last_logits"].clone())
        return cached["root"].clone(), last_logits, cached["g"].clone()
    aux_chunk = torch.empty(B * chunks[0][1], len(aux_ids) * H, dtype=dtype, device=dev)
    pkv = _prefill_kv(target, tkv, T0)
    for s, n in chunks:
        final = s + n == T0
        positions = torch.arange(s, s + n, device=dev).expand(B, n)
        aux = aux_chunk[:B * n]
        with timer("target"):
            logits = target.forward(prompts[:, s:s + n], positions, pkv, _chain_mask(B, n, dev), aux, aux_ids,
                                    last_only=True)
            pkv.advance(n)
        if final:
            root = _pick(logits, temperature, gen)
        nxt = torch.cat([prompts[:, s + 1:], root[:, None]], 1) if final else prompts[:, s + 1:s + n + 1]
        with timer("fc"):
            hidden = g_ops.project(drafter, aux)
        with timer("draft"):
            logits, hidden = drafter.forward(nxt, hidden, positions, dkv, _chain_mask(B, n, dev))
            dkv.advance(n)
    with timer("target"):
        _prefill_done(tkv, pkv, T0)
    last_logits = logits.view(B, n, -1)[:, -1].clone()
    g = hidden.view(B, n, -1)[:, -1].clone()
    if prefill_cache is not None:
        rows = {}
        for name, kv in (("target", tkv), ("drafter", dkv)):
            page, slot = kv.index(torch.arange(T0, device=dev).expand(B, T0))
            rows[name] = [kv.read(i, page, slot) for i in range(len(kv.caches))]
        prefill_cache.state = dict(prompts=prompts.clone(), glue=glue, drafter_kind=type(drafter).__name__,
                                   root=root.clone(), g=g.clone(), last_logits=last_logits.clone(), kv=kv_key,
                                   kv_scales=None if tkv.kv_scales is None else tkv.kv_scales.clone(), **rows)
        prefill_cache.prefill_seconds = _elapsed(start, dev)
    return root, last_logits, g


class _Loop:
    """What every round of a run shares, whatever its shape: the models, caches and glue, and the loop's state
    (updated in place: a round graph replays against these addresses). out has room for the largest shape's
    N past max_new, hist its N + 1 entries (a round of N tokens counts into hist[:N + 1])."""

    def __init__(self, target, drafter, g_ops, aux_ids, tkv, dkv, max_new, N_max, root, last_logits, g, spec,
                 graphs, timer, check=None):
        B, dev = root.shape[0], root.device
        self.target, self.drafter, self.g_ops, self.aux_ids, self.tkv, self.dkv = target, drafter, g_ops, aux_ids, \
            tkv, dkv
        self.max_new, self.graphs, self.check, self.B, self.dev = max_new, graphs, check, B, dev
        self.root, self.last_logits, self.g = root, last_logits, g
        self.out = torch.full((B, max_new + N_max), -1, dtype=torch.int64, device=dev)
        self.out[:, 0] = root
        self.count = torch.ones(B, dtype=torch.int64, device=dev)
        self.hist = torch.zeros(N_max + 1, dtype=torch.int64, device=dev)
        self.temperature = torch.full((B,), spec.temperature, dtype=torch.float32, device=dev)
        self.seed = torch.arange(B, dtype=torch.int64, device=dev) + spec.seed * 1_000_003
        self.offset = torch.zeros(B, dtype=torch.int64, device=dev)
        # what a graph's warm-up calls must leave as they found it: besides the loop's state, the drafter's own
        # (an oracle's call count, say)
        self.drafter_state = list(getattr(drafter, "graph_state", lambda: [])())
        self.pool = new_pool(dev) if graphs else None
        self.round_events: list = []  # round mode with an events timer: the round's span, per replay
        self.timer = timer
        self.timers = [timer]  # [the timer the rounds use]: none while a round graph warms up

    def state(self) -> list:
        return [self.out, self.count, self.hist, self.root, self.last_logits, self.g, self.offset,
                self.tkv.prefix_lens, self.dkv.prefix_lens] + self.drafter_state

    def on_warmup(self, on: bool) -> None:
        self.timers[0] = Timer(enabled=False) if on else self.timer

    def verify(self, logits, tokens, parents, spec):
        """verify_greedy (temperature 0) or verify_sampling; the sampler's offset advanced in place."""
        if spec.temperature == 0:
            return self.g_ops.verify_greedy(logits, tokens, parents)
        sample = getattr(self.g_ops, "verify_sampling", ops.verify_sampling)  # (parallel.TPGlue's gathers the logits)
        res = sample(logits, None, None, tokens, parents, self.temperature, self.seed, self.offset)
        self.offset.add_(1)
        return res

    def round_fn(self, spec: SpecConfig):
        """The round of one shape (steps 3-6): its buffers made here, the shared state the loop's. With
        graphs='steps' its forwards are StepGraphs (returned with it, for their setup time)."""
        B, N, dev, tkv, dkv = self.B, spec.num_tokens, self.dev, self.tkv, self.dkv
        target, drafter, g_ops, aux_ids = self.target, self.drafter, self.g_ops, self.aux_ids
        H, dtype = target.cfg.hidden_size, target.model.embed_tokens.weight.dtype
        aux = torch.empty(B * N, len(aux_ids) * H, dtype=dtype, device=dev)
        # the catch-up's inputs, rewritten each round: aux rows, tokens, drafter positions, tokens emitted
        cu_rows = torch.zeros(B * N, dtype=torch.int64, device=dev)
        cu_tokens, cu_positions = (torch.zeros(B, N, dtype=torch.int64, device=dev) for _ in range(2))
        cu_step = torch.zeros(B, dtype=torch.int32, device=dev)
        chainN = _chain_mask(B, N, dev)
        drafting = _Drafting(B, spec, self.g.shape[-1], self.g.dtype, dev)
        hist, check, max_new = self.hist[:N + 1], self.check, self.max_new
        # ours move fp8 rows as they are; the plain-PyTorch glue's index_copy_ has no float8 kernel: it moves their
        # bytes, as engines that keep fp8 caches in uint8 tensors (vLLM) do
        accept_caches = tkv.caches
        if g_ops is _glue("torch") and tkv.kv_scales is not None:
            accept_caches = [c.view(torch.uint8) for c in tkv.caches]

        def verify_fwd(tokens, positions, mask):
            return target.forward(tokens, positions, tkv, mask, aux, aux_ids)

        def draft_fwd(tok, hidden, positions, mask):
            return drafter.forward(tok, hidden, positions, dkv, mask)

        def fc_rows(rows):
            return g_ops.project(drafter, aux, rows)

        def catch_up_fwd(tok, hidden, positions):
            return drafter.forward(tok, hidden, positions, dkv, chainN)

        steps = {}
        if self.graphs == "steps":
            verify_fwd, fc_rows = StepGraph(verify_fwd, self.pool), StepGraph(fc_rows, self.pool)
            draft_fwd = StepGraph(draft_fwd, self.pool, state=self.drafter_state)
            catch_up_fwd = StepGraph(catch_up_fwd, self.pool, state=self.drafter_state)
            steps = dict(target=[verify_fwd], draft=[draft_fwd, catch_up_fwd], fc=[fc_rows])
        round_events, timers = self.round_events, self.timers

        def one_round():
            """One round; every piece of state it carries to the next is updated in place."""
            timer = timers[0]
            if (self.graphs == "round" and timer.enabled and timer.mode == "events" and dev.type == "cuda"
                    and torch.cuda.is_current_stream_capturing()):
                timer.new_graph()
                round_events[:] = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(2)]
                round_events[0].record()
            # 3-4. draft, build the tree, verify with capture
            cand = _draft_candidates(draft_fwd, self.last_logits, self.g, dkv.prefix_lens, spec, timer,
                                     drafter.to_target_ids, drafting)
            with timer("build_tree"):
                tokens, parents, positions, mask = g_ops.build_tree(self.root, *cand, tkv.prefix_lens, num_nodes=N)
            with timer("target"):
                logits = verify_fwd(tokens, positions, mask)
            with timer("verify"):
                accept_nodes, accept_len, emitted = self.verify(logits, tokens, parents, spec)
            if check is not None:  # before accept_update: count still says which requests this round served
                # (on its side stream the update has no span on this stream to time: no timer events for it)
                with nullcontext() if check.overlap else timer("check"):
                    check.observe(logits, accept_nodes, accept_len, aux, count=self.count, max_new=max_new)
            # 5. accept: compact the target's KV, emit, freeze finished requests (fused.accept_update says how)
            with timer("kv_accept"):
                g_ops.kv_accept(accept_caches, tkv.page_table, tkv.prefix_lens, accept_nodes, accept_len)
            if check is not None:  # (on CUDA the check runs on a side stream: it has snapshotted count by now)
                check.count_read()
            fused.accept_update(accept_nodes, accept_len, emitted, self.count, self.out, hist, self.root,
                                tkv.prefix_lens, dkv.prefix_lens, max_new, cu_rows, cu_tokens, cu_positions, cu_step)
            # 6. catch-up: the drafter re-reads the accepted tokens with the target's features
            with timer("fc"):
                hidden = fc_rows(cu_rows)
            with timer("draft"):
                logits, hidden = catch_up_fwd(cu_tokens, hidden, cu_positions)
            fused.accept_finish(logits, hidden, self.last_logits, self.g, cu_step, dkv.prefix_lens)
            if check is not None:
                check.join()
            if round_events and torch.cuda.is_current_stream_capturing():
                round_events[1].record()
            return accept_len, drafting.scores

        return one_round, steps


def _generate_speculative(target, drafter, prompts, max_new, spec, aux_ids, page_size, timer, progress, g_ops,
                          graphs, prefill_cache=None, glue="eagle3", wiring_check=None, policy=None,
                          kv_cache: Optional[KVCacheConfig] = None):
    B, T0 = prompts.shape
    dev = prompts.device
    aux_ids = list(drafter.cfg.aux_ids if aux_ids is None else aux_ids)
    if len(aux_ids) != drafter.cfg.n_aux:
        raise ValueError(f"aux_ids must name {drafter.cfg.n_aux} layers (the drafter's fc input), got {aux_ids}")
    timer = timer or Timer(enabled=False)
    start = time.perf_counter()
    shapes = [spec] if policy is None else policy.shapes(spec)
    N, S = max(s.num_tokens for s in shapes), max(s.steps for s in shapes)
    block = max((s.steps - 1) * s.topk for s in shapes)
    # A request stops with count <= max_new - 1 + E (a round emits at most E = min(N, steps + 1) tokens) and its
    # prefix = T0 + count - 1; while others go on, every round still writes its N verify rows (and the drafter
    # its rows) past that prefix: room for T0 + max_new + E + N - 2 positions (a policy's resume: R rows more)
    cap = T0 + max_new + N + min(N, S + 1)
    kv_cache = kv_cache or kv_config(target)
    tkv = target.new_kv(B, cap, page_size=page_size, device=dev, config=kv_cache)
    kv_key = (str(tkv.caches[0].dtype).replace("torch.", ""), kv_cache.scale if tkv.kv_scales is not None else None)
    dkv = drafter.new_kv(B, cap + block + (policy.resume_rows if policy is not None else 0), page_size=page_size,
                         device=dev)
    gen = torch.Generator(device=dev).manual_seed(spec.seed) if spec.temperature > 0 else None
    root, last_logits, g = _spec_prefill(target, drafter, prompts, spec.temperature, gen, aux_ids, tkv, dkv, timer,
                                         g_ops, prefill_cache, glue, start, kv_key)
    prefill_seconds, prefill_times = _elapsed(start, dev), dict(timer.times)
    check = None if wiring_check is None else CheckRun(wiring_check, aux_ids, drafter.cfg.aux_ids,
                                                        target.cfg.num_layers, spec, dev, B)
    loop = _Loop(target, drafter, g_ops, aux_ids, tkv, dkv, max_new, N, root, last_logits, g, spec, graphs, timer,
                 check)
    if policy is not None:
        return policy.run(loop, shapes, spec, start, prefill_seconds, prefill_times, progress)
    one_round, step_graphs = loop.round_fn(spec)
    run_round = one_round
    if graphs == "round":
        if timer.enabled and timer.mode == "fence" and dev.type == "cuda":
            raise ValueError("a fenced Timer cannot time inside a round graph: use graphs='steps'")
        run_round = RoundGraph(one_round, loop.state() + (check.state() if check else []), loop.pool,
                               on_warmup=loop.on_warmup)
    # The stop test syncs the host, which then waits for the round to finish before it launches the next one
    # (and the device idles while it does). No request can be done before `first_test` rounds (a round emits at
    # most min(N, steps + 1) tokens a request), so the test starts there: until then the host launches round
    # r + 1 while the device runs round r, and at full acceptance the rounds run back to back.
    first_test = -(-(max_new - 1) // min(N, spec.steps + 1))
    rounds, round_seconds, count, round_events = 0, 0.0, loop.count, loop.round_events
    bar = _progress(progress, max_new, "speculative")
    while rounds < first_test or bool((count < max_new).any()):  # the host sync, from round first_test on
        rounds += 1
        if bar is not None:
            bar.update(int(count.clamp(max=max_new).min()) - bar.n)
        run_round()
        if check is not None:  # host side; reads its snapshot only once the device has copied it (no sync)
            check.after_round(rounds)
        if graphs == "round" and timer.enabled and timer.mode == "events" and dev.type == "cuda":
            round_events[1].synchronize()  # (a sync a round: only in this timed mode)
            timer.after_replay()
            round_seconds += round_events[0].elapsed_time(round_events[1]) / 1e3
    if bar is not None:
        bar.close()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if graphs == "steps":
        setup = _setup_seconds(timer, step_graphs)
    else:
        setup = run_round.setup_seconds if graphs == "round" else 0.0
    stats = DecodeStats(tokens=B * max_new, seconds=seconds, rounds=rounds, accept_hist=loop.hist.tolist(),
                        times=dict(timer.times), prefill_seconds=prefill_seconds,
                        prefill_times=prefill_times, batch=B, setup_seconds=setup, round_seconds=round_seconds,
                        wiring=check.finish(rounds) if check is not None else None)
    steps_run = sum(stats.accept_hist)
    stats.drafted, stats.accepted = steps_run * (N - 1), sum(k * c for k, c in enumerate(stats.accept_hist)) - steps_run
    return loop.out[:, :max_new], stats
