"""Serve-time wiring check: after the first rounds, is the drafter accepted as often as it should be?

Each round adds, on the device and inside the round (graph capture safe, no host sync), over the requests
still decoding:

- accepted: verify's accept_len (draft tokens accepted);
- expected: what the drafter expects of itself, the sum over the tree's N - 1 draft nodes of
  exp(cumulative draft log-probability) = sum_v P(node v on the target's path) for a calibrated drafter
  (build_tree keeps the N - 1 best-scored candidates, a set closed under ancestors);
- the request-rounds counted.

After ``rounds`` rounds the loop copies the three sums to the host without waiting (a pinned buffer and an
event on CUDA) and reads them once the copy is done, at a later round boundary or at the loop's own stop-test
sync, whichever comes first: the check adds no host sync. Two tests, on those sums (per request-round):

1. self: accepted < ``ratio`` x calibration x expected, the drafter rejected far more often than its own
   probabilities say (calibration 1, or the record's accepted / expected);
2. record, when the drafter config records an acceptance for the same speculative settings
   (``RecordedAcceptance``, measured with its trained wiring): acceptance length < ``recorded_ratio`` x the
   recorded one, unless the drafter's own low confidence explains it (accepted >= ``explained`` x calibration
   x expected: hard input, which lowers both, not a miswiring).

A calibration run on the first prompts would be no reference: the wiring under test would be the one
calibrated; the record is measured offline with the trained wiring. A flag is a ``WiringWarning`` naming
candidate wirings to try (``wiring.candidate_wirings``), or a ``MiswiringError`` in strict mode. What the
shipped pair shows (docs/wiring.md, "The serve-time check"): miswired, its drafter loses confidence along
with acceptance rather than staying confident, so the self test alone does not fire there; the record does.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import wiring

RECORDED_KEY = "eagle3_ops_recorded_acceptance"  # in a drafter config.json: {"acceptance_length", "steps", ...}
SPEC_FIELDS = ("steps", "topk", "num_tokens", "temperature")


class WiringWarning(UserWarning):
    """The serve-time check found the drafter accepted far less often than it expects: a likely miswiring."""


class MiswiringError(RuntimeError):
    """The serve-time check's finding in strict mode."""


@dataclass(frozen=True)
class RecordedAcceptance:
    """An acceptance length measured for a drafter (with its trained wiring) at one speculative setting."""

    acceptance_length: float
    draft_confidence: float  # the drafter's expected accepted drafts a round (CheckRun.observe), same runs
    steps: int
    topk: int
    num_tokens: int
    temperature: float = 0.0

    @property
    def calibration(self) -> float:
        """Accepted over expected draft tokens with the trained wiring (1: a calibrated drafter)."""
        return (self.acceptance_length - 1) / self.draft_confidence if self.draft_confidence > 0 else 1.0

    @classmethod
    def from_config(cls, config: dict) -> Optional["RecordedAcceptance"]:
        """The config's ``eagle3_ops_recorded_acceptance`` entry, or None when it has none."""
        entry = config.get(RECORDED_KEY)
        if entry is None:
            return None
        keys = ("acceptance_length", "draft_confidence") + SPEC_FIELDS
        if not isinstance(entry, dict) or any(k not in entry for k in keys):
            raise ValueError(f'config["{RECORDED_KEY}"] must be a dict with {", ".join(keys)}; got {entry!r}')
        return cls(float(entry["acceptance_length"]), float(entry["draft_confidence"]), int(entry["steps"]),
                   int(entry["topk"]), int(entry["num_tokens"]), float(entry["temperature"]))

    def matches(self, spec) -> bool:
        return all(getattr(self, k) == getattr(spec, k) for k in SPEC_FIELDS)


@dataclass(frozen=True)
class WiringCheck:
    """Settings of the serve-time check (``generate_speculative(..., wiring_check=WiringCheck())``).

    Attributes
    ----------
    rounds : int
        Rounds whose statistics the verdict reads (1..16).
    ratio : float
        Self test: flag when accepted drafts < ratio x calibration x the drafter's expected drafts.
    recorded : RecordedAcceptance | None
        The drafter config's recorded acceptance (``RecordedAcceptance.from_config``); used when its settings
        are the run's.
    recorded_ratio : float
        Record test: flag when the running acceptance length < recorded_ratio x the recorded one ...
    explained : float
        ... unless accepted >= explained x calibration x expected (the drafter expected to be rejected).
    strict : bool
        Raise ``MiswiringError`` instead of warning.
    config_ids : sequence of int | None
        The drafter config's ids and their ``convention`` (for the candidates); default the drafter's own
        (ours, "output").
    convention : str | None
        See ``config_ids``.
    """

    rounds: int = 16
    ratio: float = 0.6
    recorded: Optional[RecordedAcceptance] = None
    recorded_ratio: float = 0.85
    explained: float = 1.5
    strict: bool = False
    config_ids: Optional[Sequence[int]] = None
    convention: Optional[str] = None

    def __post_init__(self):
        if not 1 <= self.rounds <= 16:
            raise ValueError(f"rounds must be in 1..16 (a verdict within the first 16 rounds), got {self.rounds}")
        for name in ("ratio", "recorded_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not self.explained >= 1:
            raise ValueError(f"explained must be >= 1, got {self.explained}")

    @classmethod
    def for_drafter(cls, config, **settings) -> "WiringCheck":
        """A check using the recorded acceptance of a drafter config (dict, config.json, or its folder), if any."""
        import json
        import os

        if not isinstance(config, dict):
            path = os.fspath(config)
            with open(os.path.join(path, "config.json") if os.path.isdir(path) else path, encoding="utf-8") as f:
                config = json.load(f)
        return cls(recorded=RecordedAcceptance.from_config(config), **settings)


@dataclass
class WiringReport:
    """What the check measured. Per request-round: accepted and expected draft tokens."""

    rounds: int = 0  # rounds the verdict read
    request_rounds: int = 0
    accepted: float = 0.0
    expected: float = 0.0
    flagged: bool = False
    message: str = ""
    candidates: list = field(default_factory=list)  # (label, ids) to try, the likeliest first
    run_accepted: float = 0.0  # the same over the whole run
    run_expected: float = 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted

    @property
    def ratio(self) -> float:
        return self.accepted / self.expected if self.expected > 0 else 1.0


class CheckRun:
    """One run's check: device accumulators updated inside the round, read on the host between rounds."""

    def __init__(self, check: WiringCheck, aux_ids: Sequence[int], drafter_ids: Sequence[int], num_layers: int,
                 spec, device: torch.device):
        self.check, self.spec = check, spec
        self.aux_ids, self.drafter_ids, self.num_layers = list(aux_ids), list(drafter_ids), num_layers
        self.acc = torch.zeros(3, dtype=torch.float64, device=device)  # accepted, expected, request-rounds
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(3, dtype=torch.float64, pin_memory=self.cuda)
        self.event = None
        self.pending = False
        self.report = WiringReport()

    def state(self) -> list[Tensor]:
        """What a round graph's warm-up must restore."""
        return [self.acc]

    def observe(self, draft_scores: Tensor, accept_len: Tensor, active: Tensor) -> None:
        """Inside the round, on the device. draft_scores [B, S, M] fp32 cumulative log-probabilities (-inf:
        empty slots), accept_len [B] int32, active [B] bool (requests still decoding before this round)."""
        B = draft_scores.shape[0]
        probs = draft_scores.view(B, -1).float().exp()
        expected = probs.topk(self.spec.num_tokens - 1, dim=-1).values.sum(-1)  # [B]
        w = active.double()
        self.acc.add_(torch.stack([(accept_len.double() * w).sum(), (expected.double() * w).sum(), w.sum()]))

    def after_round(self, rounds: int) -> None:
        """On the host, between rounds: snapshot after ``check.rounds`` rounds; judge once the copy is done."""
        if rounds == self.check.rounds and self.event is None and not self.report.rounds:
            self.host.copy_(self.acc, non_blocking=self.cuda)
            self.pending = True
            if self.cuda:
                self.event = torch.cuda.Event()
                self.event.record()
        if self.pending and (self.event is None or self.event.query()):
            self._judge(self.check.rounds)

    def finish(self, rounds: int) -> WiringReport:
        """After the loop (the device drained): judge a snapshot not read yet, or a run shorter than
        ``check.rounds`` on what it has; the whole run's sums."""
        total = self.acc.tolist()
        if self.pending:
            self._judge(self.check.rounds)
        elif not self.report.rounds and rounds:
            self.host.copy_(self.acc)
            self._judge(rounds)
        n = max(total[2], 1.0)
        self.report.run_accepted, self.report.run_expected = total[0] / n, total[1] / n
        return self.report

    def _judge(self, rounds: int) -> None:
        self.pending = False
        accepted, expected, n = self.host.tolist()
        r = self.report
        r.rounds, r.request_rounds = rounds, int(n)
        if n == 0:
            return
        r.accepted, r.expected = accepted / n, expected / n
        c = self.check
        rec = c.recorded if c.recorded is not None and c.recorded.matches(self.spec) else None
        calib = rec.calibration if rec is not None else 1.0
        why = []
        if r.accepted < c.ratio * calib * r.expected:
            why.append(f"{r.accepted:.2f} draft tokens accepted per round against the {calib * r.expected:.2f} the "
                       f"drafter's own probabilities predict (< {c.ratio:g}x)")
        if rec is not None and r.acceptance_length < c.recorded_ratio * rec.acceptance_length and \
                r.accepted < c.explained * calib * r.expected:
            why.append(f"acceptance length {r.acceptance_length:.2f} against the {rec.acceptance_length:.2f} its "
                       f"config records for these settings (< {c.recorded_ratio:g}x), with the drafter confident "
                       f"enough to expect {calib * r.expected:.2f} accepted")
        if not why:
            return
        config_ids = self.drafter_ids if c.config_ids is None else list(c.config_ids)
        convention = "output" if c.config_ids is None else c.convention
        cands = wiring.candidate_wirings(self.aux_ids, self.num_layers, config_ids, convention)
        r.candidates = [(label, ids) for label, ids in cands if list(ids) != self.aux_ids][:4]
        r.flagged = True
        tries = "; ".join(f"{list(ids)} ({label})" for label, ids in r.candidates)
        r.message = (f"likely miswiring of the drafter's capture {self.aux_ids} (ids: output of layer k) after "
                     f"{rounds} rounds ({int(n)} request-rounds): {' and '.join(why)}. Wirings to "
                     f"try: {tries}; eagle3 diagnose measures each")
        if c.strict:
            raise MiswiringError(r.message)
        warnings.warn(r.message, WiringWarning, stacklevel=4)
