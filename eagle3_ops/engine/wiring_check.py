"""Serve-time wiring check: is each request's drafter doing as well as it did with its trained wiring?

Two one-sided sequential tests per request, run on the device inside the round (graph capture safe, no
host sync; on CUDA two Triton kernels a round, triton_kernels/wiring_check.py), each against a record
measured offline with the trained wiring and stored in the drafter's config (``WiringRecord``, key
``eagle3_ops_wiring_record``; a calibration on the first prompts served would be no reference: the wiring
under test would be the one calibrated):

1. acceptance. Each round with accept_len a is up to min(a + 1, D) trials (D = min(steps, N - 1)), depth
   k accepted iff k <= a.
   Hard input is told apart from a miswiring by the target's own confidence (its top-1 probability at the
   trial's parent node, on the accepted path), which no wiring changes: the record holds, per confidence
   bin, the trials and acceptances of the trained wiring, and the null is that the served drafter is
   accepted at least at the lower confidence bound g_j of its bin's recorded rate (Clopper-Pearson,
   ``level``). The alternative: the odds of acceptance e^delta times lower, a mixture over ``deltas``.
2. features. Each round the mean log-RMS of every aux slot over the request's N verify rows; the record
   holds each slot's band (the 0.5%..99.5% quantiles of the trained wiring's rounds) and how often a
   recorded round fell outside one. The null: a round falls outside with probability at most e0 (the
   upper confidence bound of that frequency); the alternative: ``p1``.

Each test's likelihood ratio (per request, the whole run) is a nonnegative supermartingale under its null
(each factor's conditional mean is at most 1 wherever the null holds: the ratio falls with acceptance, and
rises with leaving the band), so by Ville's inequality it ever reaches 2 / ``alpha`` with probability at
most alpha / 2: a correctly wired request is flagged with probability at most ``alpha`` over its whole
run, at any batch size, as long as the served traffic is no worse for the trained wiring, at each target
confidence, than the record's bound (a drafter serving text it does worse on than recorded can be flagged:
it is below its recorded acceptance). A batch of B requests: at most B x alpha.

The verdict: after ``rounds`` rounds the loop copies the per-request state to the host without waiting (a
pinned buffer and an event on CUDA) and reads it once the copy is done, at a later round boundary or the
loop's own stop-test sync; the rest of the run is read at its end. A flag is a ``WiringWarning`` naming
candidate wirings to try (``wiring.candidate_wirings``), or a ``MiswiringError`` in strict mode. Without a
record for the run's settings (steps, topk, num_tokens, temperature, aux slots) the check cannot check:
it says so in ``WiringReport.message`` and never flags. ``engine.wiring_record.record_wiring`` measures a record.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import wiring

RECORD_KEY = "eagle3_ops_wiring_record"  # in a drafter config.json (WiringRecord.to_config)
SPEC_FIELDS = ("steps", "topk", "num_tokens", "temperature")
CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.995)  # inner edges of the target-confidence bins
BAND_QUANTILES = (0.005, 0.995)


class WiringWarning(UserWarning):
    """The serve-time check found a request's drafter doing far worse than recorded: a likely miswiring."""


class MiswiringError(RuntimeError):
    """The serve-time check's finding in strict mode (``report``: the WiringReport)."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k), X ~ Binomial(n, p)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    return sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p)
                        + (n - i) * math.log1p(-p)) for i in range(0, k + 1))


def _upper_bound(k: int, n: int, level: float) -> float:
    """Clopper-Pearson upper confidence bound (one-sided, ``level``) on p, given k of n."""
    if k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(60):  # P(X <= k; p) falls with p: the p where it is 1 - level
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _binom_cdf(k, n, mid) > 1 - level else (lo, mid)
    return hi


@dataclass(frozen=True)
class WiringRecord:
    """What the trained wiring did at one speculative setting (``record_wiring``), for the serve-time check.

    trials[j] / accepted[j]: draft trials and acceptances whose parent node's target top-1 probability fell
    in bin j (bins split at ``CONFIDENCE_EDGES``); band_lo / band_hi: each aux slot's band of the per-round
    mean log-RMS over the verify rows; band_rounds / band_outside: recorded request-rounds, and those with a
    slot outside its band."""

    steps: int
    topk: int
    num_tokens: int
    temperature: float
    trials: tuple
    accepted: tuple
    band_lo: tuple
    band_hi: tuple
    band_rounds: int
    band_outside: int
    acceptance_length: float = 0.0  # over the recorded rounds (for the messages)
    measured: str = ""

    def __post_init__(self):
        if not (len(self.trials) == len(self.accepted) == len(CONFIDENCE_EDGES) + 1):
            raise ValueError(f"trials and accepted must have {len(CONFIDENCE_EDGES) + 1} bins each (one per "
                             f"target-confidence bin), got {len(self.trials)} and {len(self.accepted)}")
        if any(not 0 <= a <= t for a, t in zip(self.accepted, self.trials)):
            raise ValueError(f"accepted must be within 0..trials per bin, got {self.accepted} of {self.trials}")
        if len(self.band_lo) != len(self.band_hi) or not 0 <= self.band_outside <= self.band_rounds:
            raise ValueError("band_lo / band_hi must name one bound per aux slot and band_outside must be within "
                             f"0..band_rounds; got {self.band_lo}, {self.band_hi}, {self.band_outside} of "
                             f"{self.band_rounds}")

    def matches(self, spec, n_aux: int) -> bool:
        return all(getattr(self, k) == getattr(spec, k) for k in SPEC_FIELDS) and len(self.band_lo) == n_aux

    def describe(self) -> str:
        return ", ".join(f"{k} {getattr(self, k):g}" for k in SPEC_FIELDS)

    def to_config(self) -> dict:
        return {RECORD_KEY: dict(
            {k: getattr(self, k) for k in SPEC_FIELDS}, trials=list(self.trials), accepted=list(self.accepted),
            band_lo=[math.floor(v * 1e4) / 1e4 for v in self.band_lo],  # (widened, never narrowed)
            band_hi=[math.ceil(v * 1e4) / 1e4 for v in self.band_hi],
            band_rounds=self.band_rounds, band_outside=self.band_outside,
            acceptance_length=round(self.acceptance_length, 3), measured=self.measured)}

    @classmethod
    def from_config(cls, config: dict) -> Optional["WiringRecord"]:
        """The config's ``eagle3_ops_wiring_record`` entry, or None when it has none."""
        entry = config.get(RECORD_KEY)
        if entry is None:
            return None
        keys = SPEC_FIELDS + ("trials", "accepted", "band_lo", "band_hi", "band_rounds", "band_outside")
        if not isinstance(entry, dict) or any(k not in entry for k in keys):
            raise ValueError(f'config["{RECORD_KEY}"] must be a dict with {", ".join(keys)}; got {entry!r}')
        return cls(int(entry["steps"]), int(entry["topk"]), int(entry["num_tokens"]), float(entry["temperature"]),
                   tuple(int(v) for v in entry["trials"]), tuple(int(v) for v in entry["accepted"]),
                   tuple(float(v) for v in entry["band_lo"]), tuple(float(v) for v in entry["band_hi"]),
                   int(entry["band_rounds"]), int(entry["band_outside"]),
                   float(entry.get("acceptance_length", 0.0)), str(entry.get("measured", "")))


@dataclass(frozen=True)
class WiringCheck:
    """Settings of the serve-time check (``generate_speculative(..., wiring_check=WiringCheck.for_drafter(p))``).

    Attributes
    ----------
    rounds : int
        The round (1..16) after which the verdict is read; the rest of the run is read at its end.
    alpha : float
        Bound on the probability that a correctly wired request is ever flagged (alpha / 2 per test).
    record : WiringRecord | None
        The drafter config's record (``WiringRecord.from_config``); without one for the run's settings the
        check cannot check and never flags.
    level : float
        Confidence level of the bounds taken from the record (its counts are a sample).
    deltas : tuple of float
        Acceptance alternative: the odds of acceptance e^delta times lower than the null's (a mixture).
    p1 : float
        Feature alternative: a round outside the band with probability p1.
    strict : bool
        Raise ``MiswiringError`` instead of warning.
    config_ids, convention :
        The drafter config's ids and their convention (for the candidates); default the drafter's own.
    collect : bool
        ``record_wiring``'s: count the trials per confidence bin and keep every round's feature means
        (``WiringReport.collected``; a host copy a round, so eager runs only).
    impl : str
        How the round updates the state: "auto" (on CUDA the two Triton kernels of
        triton_kernels/wiring_check.py; else the torch code), "torch" (the specification: 32 small kernels a
        round on CUDA), or "triton" (the kernels on any tensors: the tests run them on the CPU under
        TRITON_INTERPRET=1). ``collect``'s counts are the torch code's on every impl.
    overlap : bool
        On CUDA, run the update on a side stream of the round: forked after the verify (a snapshot of the
        request counts first), so that it runs beside kv_accept, the fc and the drafter's catch-up, and joined
        at the round's end (``CheckRun.join``); the loop's count update waits only for the snapshot
        (``CheckRun.count_read``). False: in line, on the round's stream.
    """

    rounds: int = 16
    alpha: float = 1e-4
    record: Optional[WiringRecord] = None
    level: float = 0.99
    deltas: tuple = (1.0, 2.0, 3.0)
    p1: float = 0.5
    strict: bool = False
    config_ids: Optional[Sequence[int]] = None
    convention: Optional[str] = None
    collect: bool = False
    impl: str = "auto"
    overlap: bool = True

    def __post_init__(self):
        if self.impl not in ("auto", "torch", "triton"):
            raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {self.impl!r}")
        if not 1 <= self.rounds <= 16:
            raise ValueError(f"rounds must be in 1..16 (a verdict within the first 16 rounds), got {self.rounds}")
        for name in ("alpha", "level", "p1"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        if not self.deltas or any(not d > 0 for d in self.deltas):
            raise ValueError(f"deltas must be positive log-odds shifts, got {self.deltas}")

    @classmethod
    def for_drafter(cls, config, **settings) -> "WiringCheck":
        """A check using the record of a drafter config (dict, config.json, or its folder), if it has one."""
        import json
        import os

        if not isinstance(config, dict):
            path = os.fspath(config)
            with open(os.path.join(path, "config.json") if os.path.isdir(path) else path, encoding="utf-8") as f:
                config = json.load(f)
        return cls(record=WiringRecord.from_config(config), **settings)


@dataclass
class WiringReport:
    """What the check measured: per request, the evidence (log likelihood ratio, nats) of each test."""

    checked: bool = False  # False: no record for these settings (message says so)
    rounds: int = 0  # rounds the verdict read
    request_rounds: int = 0
    accepted: float = 0.0  # accepted draft tokens per request-round
    flagged: bool = False
    requests: list = field(default_factory=list)  # the flagged requests (batch rows)
    first_round: list = field(default_factory=list)  # per request: the read (round) that flagged it, else 0
    evidence: list = field(default_factory=list)  # per request: (acceptance, features) log LR, nats
    threshold: float = 0.0  # each test's: log(2 / alpha)
    message: str = ""
    candidates: list = field(default_factory=list)  # (label, ids) to try, the likeliest first
    collected: Optional[dict] = None  # WiringCheck(collect=True): trials / accepted per bin, features [R, n_aux]

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted


class CheckRun:
    """One run's check: per-request state updated on the device inside the round, read on the host between
    rounds. Without a usable record it only counts acceptance (nothing to test against). ``check.impl`` picks
    the kernels or the torch code for the update."""

    def __init__(self, check: WiringCheck, aux_ids: Sequence[int], drafter_ids: Sequence[int], num_layers: int,
                 spec, device: torch.device, batch: int):
        impl = check.impl
        self.impl = "triton" if impl == "triton" or (impl == "auto" and torch.device(device).type == "cuda") \
            else "torch"
        self.check, self.spec, self.B = check, spec, batch
        self.aux_ids, self.drafter_ids, self.num_layers = list(aux_ids), list(drafter_ids), num_layers
        rec = check.record
        self.record = rec if rec is not None and rec.matches(spec, len(self.aux_ids)) else None
        f64 = dict(dtype=torch.float64, device=device)
        # per request: accepted drafts, request-rounds, the features' log LR, the acceptance log LR per delta
        self.nd = len(check.deltas)
        self.acc = torch.zeros(batch, 3 + self.nd, **f64)
        self.used = 2 if self.record is None else 3 + self.nd
        self.threshold = math.log(2 / check.alpha)
        self.edges = torch.tensor(CONFIDENCE_EDGES, dtype=torch.float32, device=device)
        self.D = min(spec.steps, spec.num_tokens - 1)  # the most drafts a round can accept
        self.depths = torch.arange(1, self.D + 1, dtype=torch.int32, device=device)
        self.row0 = torch.arange(batch, dtype=torch.int32, device=device)[:, None] * spec.num_tokens
        if self.record is not None:
            self.ok_llr, self.no_llr = (torch.tensor(v, **f64) for v in self._acceptance_terms())
            self.band = torch.tensor([rec.band_lo, rec.band_hi], dtype=torch.float32, device=device)
            e0 = _upper_bound(rec.band_outside, rec.band_rounds, check.level)
            p1 = max(check.p1, e0)  # (a band left that often gives no evidence)
            self.out_llr = (math.log(p1 / e0), math.log((1 - p1) / (1 - e0)) if e0 < 1 else 0.0)
            self.out_terms = torch.tensor(self.out_llr[::-1], **f64)  # [inside, outside]
        # the kernels' constants (triton_kernels/wiring_check.observe): None without a record
        self.terms = None if self.record is None else (self.ok_llr, self.no_llr, self.out_terms, self.band,
                                                       self.edges)
        self.cuda = device.type == "cuda"
        # the side stream (WiringCheck.overlap): the snapshot of what the round's count update overwrites, the
        # event after it, and what the side stream reads, kept alive (and its memory unreused) until join()
        self.overlap = check.overlap and self.cuda
        if self.overlap:
            self.stream = torch.cuda.Stream(device)
            self.snap_count = torch.zeros(batch, dtype=torch.int64, device=device)
            self.snap_active = torch.zeros(batch, dtype=torch.bool, device=device)
            self.snapped = torch.cuda.Event()
        self.inflight = None
        self.host = torch.zeros(batch, 3 + self.nd, dtype=torch.float64, pin_memory=self.cuda)
        self.event = None
        self.pending = False
        nb = len(CONFIDENCE_EDGES) + 1
        self.collected = None if not check.collect else dict(
            trials=torch.zeros(nb, **f64), accepted=torch.zeros(nb, **f64), features=[])
        self.report = WiringReport(checked=self.record is not None, threshold=self.threshold)

    def _acceptance_terms(self):
        """Per bin and delta, the log LR of an accepted and of a rejected trial (null g_j: the recorded rate's
        lower bound; a bin with no trials has g_j 0 and gives no evidence)."""
        ok, no = [], []
        for t, a in zip(self.record.trials, self.record.accepted):
            g0 = 1.0 - _upper_bound(t - a, t, self.check.level) if t else 0.0  # lower bound on P(accept)
            row_ok, row_no = [], []
            for d in self.check.deltas:
                if not 0 < g0 < 1:
                    row_ok.append(0.0), row_no.append(0.0)
                    continue
                g1 = 1 / (1 + math.exp(-(math.log(g0 / (1 - g0)) - d)))
                row_ok.append(math.log(g1 / g0)), row_no.append(math.log((1 - g1) / (1 - g0)))
            ok.append(row_ok), no.append(row_no)
        return ok, no

    def state(self) -> list[Tensor]:
        """What a round graph's warm-up must restore."""
        return [self.acc]

    def features(self, aux: Tensor) -> Tensor:
        """[B, n_aux]: each aux slot's mean log-RMS over the request's N verify rows."""
        B, N, n_aux = self.B, self.spec.num_tokens, len(self.aux_ids)
        x = aux.view(B, N, n_aux, -1)
        norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)  # RMS = norm / sqrt(H)
        return norm.clamp(min=1e-30).log().mean(1) - 0.5 * math.log(x.shape[-1])

    def trials(self, logits: Tensor, accept_nodes: Tensor, accept_len: Tensor, active: Tensor):
        """Per request and depth k = 1..D (D = min(steps, N - 1)): is it a trial, was it accepted, its
        confidence bin ([B, D])."""
        B, D = self.B, self.D
        nodes = accept_nodes[:, :D].clamp(min=0) + self.row0  # depth k's parent: the accepted path's node k - 1
        rows = logits.index_select(0, nodes.view(-1))
        conf = torch.softmax(rows, -1, dtype=torch.float32).amax(-1).view(B, D)  # the target's top-1 probability
        a = accept_len[:, None]
        return (self.depths <= a + 1) & active[:, None], self.depths <= a, torch.bucketize(conf, self.edges)

    def observe(self, logits: Tensor, accept_nodes: Tensor, accept_len: Tensor, aux: Tensor,
                active: Optional[Tensor] = None, *, count: Optional[Tensor] = None,
                max_new: Optional[int] = None) -> None:
        """Inside the round, on the device (no host sync): logits [B * N, V] the verify's, accept_nodes [B, N]
        int32, accept_len [B] int32, aux [B * N, n_aux * H] the verify rows' captured features, and which
        requests were still decoding before this round: active [B] bool, or the loop's count [B] int64 with
        max_new (active: count < max_new, compared inside the kernel: one launch fewer). With
        WiringCheck.overlap on CUDA the update is only enqueued, on the side stream: call count_read() before
        writing count / active, and join() before the round ends (or the host reads the state)."""
        self._check_inputs(logits, accept_nodes, accept_len, aux, active, count, max_new)
        if not self.overlap:
            self._update(logits, accept_nodes, accept_len, aux, active, count, max_new)
            return
        self.join()  # (a round that did not join its last update)
        main = torch.cuda.current_stream(self.acc.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            if count is None:
                active = self.snap_active.copy_(active)
            else:
                count = self.snap_count.copy_(count)
            self.snapped.record(self.stream)
            self._update(logits, accept_nodes, accept_len, aux, active, count, max_new)
        self.inflight = (logits, accept_nodes, accept_len, aux)

    def count_read(self) -> None:
        """Before the round overwrites the count (or active) it passed to observe: the current stream waits for
        the side stream's snapshot of it (nothing else). A no-op when the update ran in line."""
        if self.inflight is not None:
            torch.cuda.current_stream(self.acc.device).wait_event(self.snapped)

    def join(self) -> None:
        """The current stream waits for the side stream's update, and what it read may be freed: a round calls
        this at its end (inside a graph capture, the fork must be joined before the capture ends)."""
        if self.inflight is not None:
            torch.cuda.current_stream(self.acc.device).wait_stream(self.stream)
            self.inflight = None

    def _update(self, logits, accept_nodes, accept_len, aux, active, count, max_new) -> None:
        if self.impl == "triton":
            from eagle3_ops.triton_kernels import wiring_check as kernels

            live, limit = (active, -1) if count is None else (count, max_new)
            kernels.observe(self.acc, logits, accept_nodes.contiguous(), accept_len.contiguous(), aux,
                            live.contiguous(), limit, self.D, self.terms)
        else:
            active = count < max_new if active is None else active
            self._observe(logits, accept_nodes, accept_len, aux, active)
        if self.collected is not None:
            self._collect(logits, accept_nodes, accept_len, aux, count < max_new if active is None else active)

    def _check_inputs(self, logits, accept_nodes, accept_len, aux, active, count, max_new) -> None:
        """Shapes and dtypes only (no device values: no sync); the kernels index by them unchecked."""
        B, N, n_aux = self.B, self.spec.num_tokens, len(self.aux_ids)
        if (active is None) == (count is None) or (count is None) != (max_new is None):
            raise ValueError("observe takes active, or count with max_new (not both)")
        want = [("accept_nodes", accept_nodes, (B, N), torch.int32), ("accept_len", accept_len, (B,), torch.int32)]
        want.append(("active", active, (B,), torch.bool) if count is None else ("count", count, (B,), torch.int64))
        for name, t, shape, dtype in want:
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{name} must be a {list(shape)} {dtype} tensor (B = {B}, N = {N}), "
                                 f"got {list(t.shape)} {t.dtype}")
        for name, t, width in (("logits", logits, "V"), ("aux", aux, f"{n_aux} * H")):
            bad_width = name == "aux" and t.dim() == 2 and t.shape[1] % n_aux
            if t.dim() != 2 or t.shape[0] != B * N or not t.is_floating_point() or bad_width:
                raise ValueError(f"{name} must be a float [B * N = {B * N}, {width}] tensor, got {list(t.shape)} "
                                 f"{t.dtype}")

    def _observe(self, logits: Tensor, accept_nodes: Tensor, accept_len: Tensor, aux: Tensor, active: Tensor):
        """The kernels' specification: the update as torch code (what runs on the CPU, and with impl="torch")."""
        w = active[:, None].double()
        cols = [accept_len[:, None].double(), torch.ones_like(w)]
        if self.record is not None:
            trial, ok, bins = self.trials(logits, accept_nodes, accept_len, active)
            terms = torch.where(ok[..., None], self.ok_llr[bins], self.no_llr[bins])
            y = self.features(aux)
            out = ((y < self.band[0]) | (y > self.band[1])).any(-1)
            cols += [self.out_terms[out.long()][:, None], (terms * trial[..., None]).sum(1)]
        self.acc[:, :self.used].addcmul_(torch.cat(cols, 1), w)

    def _collect(self, logits: Tensor, accept_nodes: Tensor, accept_len: Tensor, aux: Tensor, active: Tensor):
        """record_wiring's counts (boolean indexing, a host sync: eager runs only)."""
        trial, ok, bins = self.trials(logits, accept_nodes, accept_len, active)
        self.collected["trials"].index_add_(0, bins[trial], torch.ones_like(bins[trial], dtype=torch.float64))
        self.collected["accepted"].index_add_(0, bins[trial & ok],
                                              torch.ones_like(bins[trial & ok], dtype=torch.float64))
        self.collected["features"].append(self.features(aux)[active])

    def _mixture(self, acc: Tensor) -> Tensor:
        return acc[:, 3:].logsumexp(-1) - math.log(self.nd)

    def after_round(self, rounds: int) -> None:
        """On the host, between rounds: snapshot after ``check.rounds`` rounds; judge once the copy is done."""
        self.join()  # (the loop's rounds join their own; a caller's observe may not have)
        if rounds == self.check.rounds and self.event is None and not self.report.rounds:
            self.host.copy_(self.acc, non_blocking=self.cuda)
            self.pending = True
            if self.cuda:
                self.event = torch.cuda.Event()
                self.event.record()
        if self.pending and (self.event is None or self.event.query()):
            self._judge(self.check.rounds)

    def finish(self, rounds: int) -> WiringReport:
        """After the loop (the device drained): judge a snapshot not read yet, then the whole run (a request
        flagged after the first verdict warns then)."""
        self.join()
        if self.pending:
            self._judge(self.check.rounds)
        self.host.copy_(self.acc)
        self._judge(rounds)
        if self.collected is not None:
            self.report.collected = {k: torch.cat(v).cpu() if k == "features" else v.cpu()
                                     for k, v in self.collected.items()}
        return self.report

    def _judge(self, rounds: int) -> None:
        self.pending = False
        acc = self.host.clone()
        r = self.report
        r.rounds = r.rounds or rounds
        n = float(acc[:, 1].sum())
        r.request_rounds, r.accepted = int(n), float(acc[:, 0].sum()) / max(n, 1.0)
        rec = self.check.record
        if self.record is None:
            r.message = ("the wiring check cannot check: " + (
                "the drafter config has no eagle3_ops_wiring_record" if rec is None else
                f"its record is for {rec.describe()} and {len(rec.band_lo)} aux slots, not {self.spec.steps} / "
                f"{self.spec.topk} / {self.spec.num_tokens} at temperature {self.spec.temperature:g} with "
                f"{len(self.aux_ids)}") + " (wiring_record.record_wiring measures one)")
            return
        mix = self._mixture(acc)
        r.evidence = [(round(float(a), 2), round(float(f), 2)) for a, f in zip(mix, acc[:, 2])]
        r.first_round = r.first_round or [0] * self.B
        for b in range(self.B):  # (read at two times: still within the bound, which is on the sup over all)
            if max(float(mix[b]), float(acc[b, 2])) >= self.threshold and not r.first_round[b]:
                r.first_round[b] = rounds
        flagged = [b for b, v in enumerate(r.first_round) if v > 0]
        if not flagged:
            return
        r.requests, first = flagged, not r.flagged
        r.flagged = True
        if not first:  # warned already (at the first verdict); the report keeps the whole run's requests
            return
        c = self.check
        config_ids = self.drafter_ids if c.config_ids is None else list(c.config_ids)
        convention = "output" if c.config_ids is None else c.convention
        cands = wiring.candidate_wirings(self.aux_ids, self.num_layers, config_ids, convention)
        r.candidates = [(label, ids) for label, ids in cands if list(ids) != self.aux_ids][:4]
        why = []
        acc_hit = [b for b in flagged if float(mix[b]) >= self.threshold]
        feat_hit = [b for b in flagged if float(acc[b, 2]) >= self.threshold]
        if acc_hit:
            why.append(f"accepted far less often than the trained wiring at the same target confidence "
                       f"(acceptance length {r.acceptance_length:.2f} here, {rec.acceptance_length:.2f} recorded)")
        if feat_hit:
            y = "its captured features' log-RMS outside the bands recorded for each slot " \
                f"({', '.join(f'[{lo:.2f}, {hi:.2f}]' for lo, hi in zip(rec.band_lo, rec.band_hi))})"
            why.append(y)
        tries = "; ".join(f"{list(ids)} ({label})" for label, ids in r.candidates)
        r.message = (f"likely miswiring of the drafter's capture {self.aux_ids} (ids: output of layer k): "
                     f"request(s) {flagged} of {self.B} flagged by round {max(r.first_round)} "
                     f"(evidence >= {self.threshold:.1f} nats, false-alarm bound {c.alpha:g} a request): "
                     f"{' and '.join(why)}. Wirings to try: {tries}; eagle3 diagnose measures each")
        if c.strict:
            raise MiswiringError(r.message, r)
        warnings.warn(r.message, WiringWarning, stacklevel=4)
