"""Wiring diagnosis: which target layers was this drafter trained on, and is the configured capture it?

For a target, a drafter and prompts, greedy speculative decoding runs once per plausible wiring: the
configured one, the config's ids read in every convention, the seed deployment's miswiring (the ids read
in the wrong convention and an embedding captured in front, docs/wiring.md), and every reading one layer
off in each direction or with an embedding captured in front. The wiring
with the highest acceptance length is the one the drafter was trained on. Exposed as
`eagle3_ops.diagnose.diagnose` and `eagle3 diagnose`; the candidate list is `wiring.candidate_wirings`
(torch-free).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import wiring
from .engine import SpecConfig, generate_speculative

TOLERANCE = 0.005  # configured is "it" when within 0.5% of the best acceptance length (greedy: deterministic)


@dataclass
class WiringResult:
    label: str
    ids: tuple[int, ...]
    acceptance_length: float
    tokens_per_s: float


@dataclass
class Diagnosis:
    configured: WiringResult
    results: list[WiringResult]  # best first

    @property
    def best(self) -> WiringResult:
        return self.results[0]

    @property
    def configured_is_best(self) -> bool:
        return self.configured.acceptance_length >= self.best.acceptance_length * (1 - TOLERANCE)

    def table(self) -> str:
        w = max(len(r.label) for r in self.results)
        lines = [f"{'wiring':<{w}}  {'aux ids (output of layer k)':<28} {'acceptance length':>17} {'tok/s':>8}"]
        for r in self.results:
            mark = "  <- configured" if r.ids == self.configured.ids else ""
            lines.append(f"{r.label:<{w}}  {str(list(r.ids)):<28} {r.acceptance_length:>17.2f} {r.tokens_per_s:>8.1f}{mark}")
        return "\n".join(lines)

    def verdict(self) -> str:
        b, c = self.best, self.configured
        if self.configured_is_best:
            return (f"OK: the configured wiring {list(c.ids)} is the one the drafter was trained on "
                    f"(acceptance length {c.acceptance_length:.2f}, best of {len(self.results)} wirings).")
        return (f"MISWIRED: the drafter was trained on {list(b.ids)} ({b.label}), acceptance length "
                f"{b.acceptance_length:.2f}; the configured wiring {list(c.ids)} gives only "
                f"{c.acceptance_length:.2f}. Capture {list(b.ids)} (ids as 'output of layer k').")


@torch.no_grad()
def diagnose(target, drafter, prompts: torch.Tensor, *, configured: Optional[Sequence[int]] = None,
             config_ids: Optional[Sequence[int]] = None, convention: Optional[str] = None, max_new: int = 32,
             spec: SpecConfig = SpecConfig(), progress: bool = False) -> Diagnosis:
    """Measure acceptance (greedy, chain by default) for the configured capture and each plausible
    wiring; returns a Diagnosis with .table() and .verdict().

    configured: what the engine captures (ours: output of layer k); default the drafter's configured
    ids. config_ids: the ids as written in the drafter's config.json, read in every convention;
    default the drafter's ids in our convention ('output'). convention: the one config_ids are written
    in (names the seed miswiring's row; wiring.candidate_wirings)."""
    configured = tuple(drafter.cfg.aux_ids if configured is None else configured)
    if config_ids is None:
        raw, convention = list(drafter.cfg.aux_ids), "output"
    else:
        raw = list(config_ids)
    cands = wiring.candidate_wirings(configured, target.cfg.num_layers, raw, convention)
    if progress:
        from tqdm import tqdm

        cands = tqdm(cands, desc="wirings", leave=False)
    results = []
    for label, ids in cands:
        _, stats = generate_speculative(target, drafter, prompts, max_new, spec, aux_ids=list(ids))
        results.append(WiringResult(label, ids, stats.acceptance_length, stats.tokens_per_s))
    mine = next(r for r in results if r.ids == configured)  # labelled "configured[ = what it also is]"
    results.sort(key=lambda r: -r.acceptance_length)
    return Diagnosis(configured=mine, results=results)
