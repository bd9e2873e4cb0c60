"""Measuring a ``WiringRecord`` (engine/wiring_check.py's serve-time check judges a run against one): kept apart
from the check, which the decode loop imports, because measuring runs that loop."""

from __future__ import annotations

import torch

from .decode import generate_speculative
from .wiring_check import BAND_QUANTILES, CONFIDENCE_EDGES, WiringCheck, WiringRecord


def record_wiring(target, drafter, batches, spec, max_new: int, aux_ids=None, measured: str = "") -> WiringRecord:
    """Measure a ``WiringRecord`` (run it with the drafter's trained wiring, on prompts the check will not be
    judged on): ``generate_speculative`` on each batch of ``batches`` (token tensors [B, T]), every round
    counted. Store it with ``config.update(record.to_config())``."""
    nb = len(CONFIDENCE_EDGES) + 1
    trials, accepted, feats, acc, n = torch.zeros(nb, dtype=torch.float64), torch.zeros(nb, dtype=torch.float64), \
        [], 0.0, 0
    for prompts in batches:
        _, stats = generate_speculative(target, drafter, prompts, max_new, spec, aux_ids=aux_ids,
                                        wiring_check=WiringCheck(collect=True))
        c, rep = stats.wiring.collected, stats.wiring
        trials, accepted = trials + c["trials"], accepted + c["accepted"]
        feats.append(c["features"])
        acc, n = acc + rep.accepted * rep.request_rounds, n + rep.request_rounds
    y = torch.cat(feats).double()
    lo, hi = (torch.quantile(y, q, dim=0) for q in BAND_QUANTILES)
    outside = int(((y < lo) | (y > hi)).any(-1).sum())
    return WiringRecord(spec.steps, spec.topk, spec.num_tokens, float(spec.temperature),
                        tuple(int(v) for v in trials), tuple(int(v) for v in accepted),
                        tuple(float(v) for v in lo), tuple(float(v) for v in hi), int(y.shape[0]), outside,
                        1.0 + acc / max(n, 1), measured)
