"""The serve-time wiring check (engine/wiring_check.py): its per-request trials and features on hand-built rounds,
the false-alarm bound of its two sequential tests, its verdicts, and on the shipped pair (CPU, greedy, chain
3/1/4, 64 new tokens, held-out prompts 0-19: the config's record was measured on prompts 20-63) the seed's
miswiring and a +1 shift flagged on every request within the first 16 rounds, and no alarm with the trained
wiring, at batch 1 and batch 4 (bench/bench_wiring_check.py --heldout prints the numbers)."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

from eagle3_ops.engine import SpecConfig, generate_speculative
from eagle3_ops.engine.wiring_check import (CONFIDENCE_EDGES, RECORD_KEY, CheckRun, MiswiringError, WiringCheck,
                                            WiringRecord, WiringWarning, _binom_cdf, _upper_bound)

ASSETS = os.path.join(os.path.dirname(__file__), os.pardir, "eagle3_ops", "assets", "byte-small")
DRAFTER = os.path.join(ASSETS, "drafter")
HAVE_PAIR = os.path.exists(os.path.join(DRAFTER, "model.safetensors"))
TRAINED, SEED, PLUS_ONE = [1, 5, 6], [-1, 0, 4], [2, 6, 7]
MAX_NEW = 64  # at most 4 tokens a round: past 16 rounds
PROMPTS = 20
NB = len(CONFIDENCE_EDGES) + 1
RECORD = WiringRecord(3, 1, 4, 0.0, trials=(100,) * NB, accepted=(90,) * NB, band_lo=(-0.5,) * 3,
                      band_hi=(1.05,) * 3, band_rounds=1000, band_outside=10)


def _check_run(check=WiringCheck(record=RECORD), B=2, spec=SpecConfig()):
    return CheckRun(check, TRAINED, TRAINED, 8, spec, torch.device("cpu"), B)


def test_trials_features_and_evidence_of_a_hand_built_round():
    B, N, V, H = 2, 4, 8, 2
    run = _check_run()
    logits = torch.full((B * N, V), -30.0)
    logits[:, 0] = 0.0  # every node's top-1 probability ~1 (the top bin) ...
    logits[1 * N + 0, :4] = 0.0  # ... but request 1's root: 4 tokens tied, 0.25 (bin 0)
    accept_nodes = torch.tensor([[0, 1, 2, 3], [0, -1, -1, -1]], dtype=torch.int32)
    accept_len = torch.tensor([3, 0], dtype=torch.int32)
    trial, ok, bins = run.trials(logits, accept_nodes, accept_len, torch.tensor([True, True]))
    # request 0 accepted all 3 drafts: 3 trials, all accepted; request 1 rejected the first: one trial
    assert trial.tolist() == [[True, True, True], [True, False, False]] and ok.tolist()[0] == [True] * 3
    assert bins.tolist()[0] == [NB - 1] * 3 and bins[1, 0] == 0
    # features: the mean log-RMS of each slot over the request's N rows
    aux = torch.ones(B * N, 3 * H)
    aux[N:, H:2 * H] = math.e  # request 1's slot 1: log-RMS 1
    assert torch.allclose(run.features(aux), torch.tensor([[0.0, 0, 0], [0, 1, 0]]), atol=1e-6)
    aux[N:, 2 * H:] = 3.0  # request 1's slot 2 leaves its band [-0.5, 1.05]: log 3
    run.observe(logits, accept_nodes, accept_len, aux, torch.tensor([True, True]))
    acc = run.acc
    assert acc[:, 0].tolist() == [3, 0] and acc[:, 1].tolist() == [1, 1]
    ok_llr, no_llr = run.ok_llr, run.no_llr
    assert torch.allclose(acc[0, 3:], 3 * ok_llr[NB - 1]) and torch.allclose(acc[1, 3:], no_llr[0])
    assert math.isclose(acc[0, 2], run.out_llr[1]) and math.isclose(acc[1, 2], run.out_llr[0])
    # a frozen request counts nothing
    before = acc.clone()
    run.observe(logits, accept_nodes, accept_len, aux, torch.tensor([False, False]))
    assert torch.equal(run.acc, before)


def test_each_factor_has_mean_at_most_one_under_the_null():
    """The bound's premise: under the null (acceptance at least the bin's lower bound, a band left at most e0 of
    the time) every factor of each likelihood ratio has mean <= 1, so the ratio is a supermartingale and
    P(ever >= 2 / alpha) <= alpha / 2 (Ville)."""
    run = _check_run()
    for j, (t, a) in enumerate(zip(RECORD.trials, RECORD.accepted)):
        g0 = 1 - _upper_bound(t - a, t, 0.99)
        assert g0 < a / t and _binom_cdf(t - a, t, 1 - g0) == pytest.approx(0.01, rel=1e-6)  # Clopper-Pearson
        for p in (g0, (g0 + 1) / 2, 1.0):
            mean = p * run.ok_llr[j].exp() + (1 - p) * run.no_llr[j].exp()
            assert (mean <= 1 + 1e-12).all(), (j, p, mean)
    e0 = _upper_bound(RECORD.band_outside, RECORD.band_rounds, 0.99)
    for p in (0.0, e0 / 2, e0):
        assert p * math.exp(run.out_llr[0]) + (1 - p) * math.exp(run.out_llr[1]) <= 1 + 1e-12


def _judged(acc_llr, feat_llr, rounds=16, **settings):
    run = _check_run(WiringCheck(record=RECORD, **settings), B=1)
    run.acc[0, 3:] = acc_llr
    run.acc[0, 2] = feat_llr
    run.acc[0, 1] = 16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.after_round(rounds)
    return run.report, caught


def test_verdicts():
    report, caught = _judged(0.0, 12.0)  # the features' evidence alone
    assert report.flagged and report.requests == [0] and caught and issubclass(caught[0].category, WiringWarning)
    assert report.candidates and "eagle3 diagnose" in report.message and "log-RMS" in report.message
    assert "accepted far less" in _judged(12.0, 0.0)[0].message
    report, caught = _judged(5.0, 5.0)  # below log(2 / 1e-4) = 9.9 in each test
    assert not report.flagged and not caught and report.checked and report.threshold == pytest.approx(9.903, abs=1e-3)
    assert not _judged(0.0, 12.0, rounds=15)[0].rounds  # before its round the check has not read anything
    with pytest.raises(MiswiringError, match="likely miswiring") as e:
        _judged(12.0, 0.0, strict=True)
    assert e.value.report.requests == [0]


def test_without_a_record_it_cannot_check():
    for check, why in ((WiringCheck(), "has no eagle3_ops_wiring_record"),
                       (WiringCheck(record=RECORD), "its record is for steps 3, topk 1, num_tokens 4")):
        spec = SpecConfig() if check.record is None else SpecConfig(steps=4, topk=1, num_tokens=5)
        run = _check_run(check, B=1, spec=spec)
        run.acc[0, 2:] = 50.0  # whatever it holds, nothing is judged
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            report = run.finish(16)
        assert not report.checked and not report.flagged and why in report.message


def test_record_round_trip_and_bad_records():
    config = RECORD.to_config()
    assert WiringRecord.from_config(config) == RECORD and WiringRecord.from_config({}) is None
    with pytest.raises(ValueError, match="band_rounds"):
        WiringRecord.from_config({RECORD_KEY: {"steps": 3}})
    with pytest.raises(ValueError, match="accepted must be within 0..trials"):
        WiringRecord(3, 1, 4, 0.0, (1,) * NB, (2,) * NB, (0.0,), (1.0,), 10, 0)
    with pytest.raises(ValueError, match="rounds must be in 1..16"):
        WiringCheck(rounds=17)
    with pytest.raises(ValueError, match="alpha"):
        WiringCheck(alpha=0)
    shipped = WiringCheck.for_drafter(DRAFTER).record
    assert shipped is not None and shipped.matches(SpecConfig(), 3) and "prompts 20-63" in shipped.measured


@pytest.fixture(scope="module")
def pair():
    if not HAVE_PAIR:
        pytest.skip("the shipped pair is not built yet")
    from eagle3_ops import data
    from eagle3_ops.cli import _load_pair

    target, drafter, _ = _load_pair("byte-small", "cpu", torch.float32)
    return target, drafter, [data.encode(p) for p in data.load_heldout_prompts()[:PROMPTS]]


def _batches(prompts, B):
    """The bench's batching: B prompts at a time, each cut to the batch's shortest (its last tokens)."""
    for i in range(0, len(prompts), B):
        chunk = prompts[i:i + B]
        n = min(len(p) for p in chunk)
        yield torch.stack([p[-n:] for p in chunk])


def _run(pair, prompts, aux_ids, **settings):
    target, drafter, _ = pair
    check = WiringCheck.for_drafter(DRAFTER, **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, stats = generate_speculative(target, drafter, prompts, MAX_NEW, SpecConfig(), aux_ids=aux_ids,
                                          wiring_check=check)
    flags = [w for w in caught if issubclass(w.category, WiringWarning)]
    assert len(flags) == stats.wiring.flagged, flags  # one warning exactly when flagged
    return out, stats.wiring


@pytest.mark.parametrize("B", [1, 4])
def test_no_false_alarm_when_wired(pair, B):
    for i, prompts in enumerate(_batches(pair[2], B)):
        _, report = _run(pair, prompts, TRAINED)
        assert report.checked and report.rounds == 16 and not report.flagged, (i, report.evidence, report.message)


@pytest.mark.parametrize("aux_ids", [SEED, PLUS_ONE], ids=["seed", "plus-one"])
@pytest.mark.parametrize("B", [1, 4])
def test_miswirings_flagged_on_every_request_within_16_rounds(pair, aux_ids, B):
    target, drafter, _ = pair
    for i, prompts in enumerate(_batches(pair[2], B)):
        with pytest.raises(MiswiringError) as e:  # strict: the run stops at the verdict, after round 16
            generate_speculative(target, drafter, prompts, MAX_NEW, SpecConfig(), aux_ids=aux_ids,
                                 wiring_check=WiringCheck.for_drafter(DRAFTER, strict=True))
        report = e.value.report
        assert report.rounds == 16 and report.requests == list(range(B)), (i, report.evidence)
        assert tuple(TRAINED) in [ids for _, ids in report.candidates], report.candidates  # among those to try


def test_strict_mode_and_the_check_changes_no_token(pair):
    prompts = next(_batches(pair[2], 4))
    target, drafter, _ = pair
    plain, stats = generate_speculative(target, drafter, prompts, MAX_NEW, SpecConfig())
    checked, _ = _run(pair, prompts, TRAINED)
    assert stats.wiring is None and torch.equal(plain, checked)


def test_round_graph_warmup_leaves_the_state_alone(pair):
    """graphs="round": RoundGraph's warm-up rounds (on the CPU run eagerly, then undone) must not count; the
    check's state is among what it restores."""
    target, drafter, prompts = pair
    batch = next(_batches(prompts, 4))
    check = WiringCheck.for_drafter(DRAFTER)
    eager, se = generate_speculative(target, drafter, batch, MAX_NEW, SpecConfig(), wiring_check=check)
    graphed, sg = generate_speculative(target, drafter, batch, MAX_NEW, SpecConfig(), wiring_check=check,
                                       graphs=True)
    assert torch.equal(eager, graphed)
    assert (sg.wiring.request_rounds, sg.wiring.accepted, sg.wiring.evidence) == \
        (se.wiring.request_rounds, se.wiring.accepted, se.wiring.evidence)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_PAIR, reason="the shipped pair is not built yet")
def test_gpu_round_graph_check():
    """On CUDA, inside a captured round graph (bf16): the check reads its 16 rounds through the pinned copy and
    event, flags the seed's miswiring on every request, raises no alarm wired, and changes no token."""
    from eagle3_ops import data
    from eagle3_ops.cli import _load_pair

    target, drafter, _ = _load_pair("byte-small", "cuda", torch.bfloat16)
    batch = next(_batches([data.encode(p) for p in data.load_heldout_prompts()[:PROMPTS]], 4)).cuda()
    check = WiringCheck.for_drafter(DRAFTER)
    off, _ = generate_speculative(target, drafter, batch, MAX_NEW, SpecConfig(), graphs=True)
    on, st = generate_speculative(target, drafter, batch, MAX_NEW, SpecConfig(), graphs=True, wiring_check=check)
    assert torch.equal(off, on) and st.wiring.rounds == 16 and not st.wiring.flagged, st.wiring
    with pytest.warns(WiringWarning, match="likely miswiring"):
        _, st = generate_speculative(target, drafter, batch, MAX_NEW, SpecConfig(), graphs=True, aux_ids=SEED,
                                     wiring_check=check)
    assert st.wiring.flagged and st.wiring.rounds == 16 and st.wiring.requests == [0, 1, 2, 3], st.wiring.evidence
