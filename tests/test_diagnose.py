"""Wiring diagnosis: the shipped drafter loses acceptance when it is fed the seed deployment's miswiring
(the config's ids read in the wrong convention, and an embedding captured in front), and `diagnose`
lists that miswiring as a row and names the wiring the drafter was trained on."""

from __future__ import annotations

import os
import pytest
import torch

from eagle3_ops import diagnose, wiring

ASSETS = os.path.join(os.path.dirname(__file__), os.pardir, "eagle3_ops", "assets", "byte-small")
HAVE_PAIR = os.path.exists(os.path.join(ASSETS, "drafter", "model.safetensors"))

TRAINED = (1, 5, 6)  # the shipped drafter: outputs of layers 1, 5, 6 of 8, config.json [1, 5, 6] as 'output'
SEED = (-1, 0, 4)  # the seed deployment's miswiring: those ids read as 'input' ([0, 4, 5]), embedding in front
EMBEDDING_IN_FRONT = (-1, 1, 5)
READ_AS_INPUT = (0, 4, 5)
# Measured on the shipped pair (8 held-out prompts x 24 new tokens, 3 chain drafts, greedy): acceptance
# length 3.86 trained, 2.37 embedding in front, 3.20 read as 'input', 1.88 the seed's miswiring, i.e. the
# seed's miswiring loses 68% of the drafter's gain over no speculation (acceptance length 1; 78% at 16 x 48,
# 84% at 64 x 96 in TRAINING.md) and the embedding alone 48%. The drafter with its fc output zeroed gives
# 1.09: it predicts from the captured features, and the seed's features mislead it (README).
TRAINED_AT_LEAST = 3.0
SEED_LOSES_AT_LEAST = 0.6  # share of the gain
EMBEDDING_LOSES_AT_LEAST = 0.35


def test_candidates_cover_the_field_miswirings():
    """61 layers, a config written [2, 30, 58] in the 'input' convention (as AQ-MedAI Kimi drafters)."""
    cands = dict((ids, label) for label, ids in wiring.candidate_wirings([1, 29, 57], 61, [2, 30, 58], "input"))
    assert cands[(1, 29, 57)] == "configured = config ids read as 'input'"
    assert cands[(2, 30, 58)] == "config ids read as 'output'"  # = SGLang's old +1 ('sglang-legacy')
    assert "every layer -1" in cands[(0, 28, 56)]
    assert "embedding captured in front" in cands[(-1, 1, 29)]
    assert cands[(-1, 2, 30)].startswith("seed miswiring")  # read as 'output' + the embedding in front
    # a miswired capture still lists the config's own reading
    cands = dict((ids, label) for label, ids in wiring.candidate_wirings([-1, 1, 29], 61, [1, 29, 57]))
    assert "config ids read as 'output'" in cands[(1, 29, 57)]
    # the shipped drafter's config [1, 5, 6] ('output'): the seed's miswiring is a row
    cands = dict((ids, label) for label, ids in wiring.candidate_wirings(TRAINED, 8))
    assert cands[READ_AS_INPUT] == "config ids read as 'input'"
    assert cands[SEED] == "seed miswiring: read as 'input' + embedding in front"
    assert "embedding captured in front" in cands[EMBEDDING_IN_FRONT]


@pytest.fixture(scope="module")
def pair():
    if not HAVE_PAIR:
        pytest.skip("the shipped pair is not built yet")
    from eagle3_ops import data
    from eagle3_ops.cli import _load_pair

    target, drafter, _ = _load_pair("byte-small", "cpu", torch.float32)
    prompts = [data.encode(p) for p in data.load_heldout_prompts()[:8]]
    n = min(len(p) for p in prompts)
    return target, drafter, torch.stack([p[-n:] for p in prompts])


@pytest.fixture(scope="module")
def seed_report(pair):
    """One diagnosis of an engine that captures the seed's miswiring while the drafter's config.json
    still says [1, 5, 6] ('output'): its rows hold every wiring the tests below compare."""
    target, drafter, prompts = pair
    assert tuple(drafter.cfg.aux_ids) == TRAINED
    return diagnose.diagnose(target, drafter, prompts, configured=SEED, max_new=24)


def _acc(report, ids):
    return next(r for r in report.results if r.ids == ids).acceptance_length


def test_seed_miswiring_costs_acceptance(seed_report):
    right = _acc(seed_report, TRAINED)
    assert right >= TRAINED_AT_LEAST, seed_report.table()
    gain = right - 1
    assert _acc(seed_report, SEED) - 1 <= (1 - SEED_LOSES_AT_LEAST) * gain, seed_report.table()
    assert _acc(seed_report, EMBEDDING_IN_FRONT) - 1 <= (1 - EMBEDDING_LOSES_AT_LEAST) * gain, seed_report.table()
    # the convention slip alone (every layer one early) costs little on this target, but never gains
    assert _acc(seed_report, READ_AS_INPUT) <= right, seed_report.table()
    assert _acc(seed_report, SEED) < min(_acc(seed_report, EMBEDDING_IN_FRONT), _acc(seed_report, READ_AS_INPUT))


def test_diagnose_names_the_trained_wiring(seed_report):
    assert seed_report.best.ids == TRAINED, seed_report.table()
    assert not seed_report.configured_is_best, seed_report.table()
    assert seed_report.configured.label.startswith("configured = seed miswiring"), seed_report.table()
    verdict = seed_report.verdict()
    assert verdict.startswith("MISWIRED") and str(list(TRAINED)) in verdict, verdict


def test_configured_wiring_is_the_trained_one(pair):
    target, drafter, prompts = pair
    report = diagnose.diagnose(target, drafter, prompts, max_new=24)
    assert report.configured_is_best, report.table()
    assert report.best.ids == TRAINED
    assert report.verdict().startswith("OK")


def test_cli_diagnose_names_the_wiring(pair, capsys):
    from eagle3_ops.cli import main

    rc = main(["diagnose", "--aux-ids", "-1", "0", "4", "--batch", "4", "--max-new", "16"])
    out = capsys.readouterr().out
    assert rc == 3 and "MISWIRED" in out and "[1, 5, 6]" in out and "seed miswiring" in out
