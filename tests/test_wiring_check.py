"""The serve-time wiring check (engine/wiring_check.py): its per-request trials and features on hand-built rounds,
the false-alarm bound of its two sequential tests, its verdicts, and on the shipped pair (CPU, greedy, chain
3/1/4, 64 new tokens, held-out prompts 0-19: the config's record was measured on prompts 20-63) the seed's
miswiring and a +1 shift flagged on every request within the first 16 rounds, and no alarm with the trained
wiring, at batch 1 and batch 4 (bench/bench_wiring_check.py --heldout prints the numbers). The round's update as
Triton kernels (triton_kernels/wiring_check.py) against the torch code (the specification) on random rounds at
Kimi's vocabulary and width and odd sizes, on the CPU under TRITON_INTERPRET=1 and, marked gpu, on CUDA and
inside a CUDA graph; the launches a round each makes."""

from __future__ import annotations

import math
import os
import sys
import warnings

import pytest
import torch

from eagle3_ops.engine import SpecConfig, generate_speculative
from eagle3_ops.engine.wiring_check import (CONFIDENCE_EDGES, RECORD_KEY, CheckRun, MiswiringError, WiringCheck,
                                            WiringRecord, WiringWarning, _binom_cdf, _upper_bound)
from tests.conftest import capture_graph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

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


# ---- the round's update as Triton kernels (WiringCheck.impl) against the torch code ----

# on the CPU under Triton's interpreter and, marked gpu, on CUDA
DEVS = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                    reason="Triton on the CPU needs TRITON_INTERPRET=1")),
        pytest.param("cuda", marks=pytest.mark.gpu)]
MAX_NEW_K = 5  # count drawn in 0..6: some requests finished (frozen)


def _kernel_record(spec, n_aux, band=(-0.2, 0.2)):
    """A record whose bins all differ (so a wrong bin changes the sum) and bands that about half the rounds leave."""
    return WiringRecord(spec.steps, spec.topk, spec.num_tokens, 0.0, trials=tuple(40 + 7 * j for j in range(NB)),
                        accepted=tuple(5 + 4 * j for j in range(NB)), band_lo=(band[0],) * n_aux,
                        band_hi=(band[1],) * n_aux, band_rounds=1000, band_outside=10)


def _random_round(gen, B, spec, V, H, n_aux, dtype, dev):
    """A verify's outputs and a round's captured rows: accept_len in [0, D] with the accepted path increasing node
    ids from the root (-1 padded); logits at row temperatures from flat to one-hot (every confidence bin); features
    at per-row-and-slot scales around the bands. Hand-set edge rows where there is room: two tied maxima with the
    rest -inf (confidence exactly 0.5, a bin edge), a single finite score (1.0), all scores equal (1 / V), and an
    all-zero feature slot (norm 0: the reference's clamp at 1e-30)."""
    N = spec.num_tokens
    D = min(spec.steps, N - 1)
    accept_len = torch.randint(0, D + 1, (B,), generator=gen, dtype=torch.int32)
    nodes = torch.full((B, N), -1, dtype=torch.int32)
    for b in range(B):
        a = int(accept_len[b])
        nodes[b, 0] = 0
        nodes[b, 1:a + 1] = torch.sort(torch.randperm(N - 1, generator=gen)[:a] + 1).values.to(torch.int32)
    logits = torch.randn(B * N, V, generator=gen) * torch.rand(B * N, 1, generator=gen) * 16
    read = (torch.arange(B)[:, None] * N + nodes[:, :D].clamp(min=0)).flatten().unique()  # the parents' rows
    special = [float("-inf")] * 2 + [0.25]
    for r, fill in zip(read.tolist()[:3], special):
        logits[r] = fill
    if len(read) >= 1 and V >= 2:
        logits[read[0], V // 2] = logits[read[0], V - 1] = 3.0  # two tied maxima
    if len(read) >= 2:
        logits[read[1], 0] = -5.0  # one finite score
    scale = torch.exp(torch.rand(B * N, n_aux, 1, generator=gen) - 0.5)
    aux = (torch.randn(B * N, n_aux, H, generator=gen) * scale).view(B * N, n_aux * H)
    aux[0, :H] = 0.0
    count = torch.randint(0, MAX_NEW_K + 2, (B,), generator=gen)
    return [t.to(dtype).to(dev) if t.is_floating_point() else t.to(dev) for t in (logits, nodes, accept_len, aux,
                                                                                    count)]


def _runs(record, spec, B, n_aux, dev, impls=("torch", "triton"), gen=None, overlaps=None):
    """A CheckRun per impl (overlaps: WiringCheck.overlap per impl, default on), their states set to the same
    random values (the update adds to what is there)."""
    ids = list(range(n_aux))
    overlaps = overlaps or (True,) * len(impls)
    runs = [CheckRun(WiringCheck(record=record, impl=impl, overlap=o), ids, ids, n_aux + 1, spec, torch.device(dev), B)
            for impl, o in zip(impls, overlaps)]
    start = torch.randn(runs[0].acc.shape, generator=gen, dtype=torch.float64).to(dev)
    for run in runs:
        run.acc.copy_(start)
    return runs


def _same_state(kernel, ref):
    kernel.join(), ref.join()  # (on CUDA the updates run on side streams)
    # fp64 sums in another order; a bin or band decision that differed would move a sum by >= 1e-3
    torch.testing.assert_close(kernel.acc, ref.acc, rtol=0, atol=1e-9)


F32, F16 = torch.float32, torch.float16
# (B, spec, V, H, dtypes): Kimi's vocabulary and width at batch 1 (40 chunks a row, H in 7 blocks of 1024); batch
# 4 in a tree (N 16, D 4) at a vocab of 5000 (2 chunks, the last partial); batch 64 at the chain and a vocab of 111
# (one partial chunk); odd sizes: batch 3 at 5/1/6 (D 5: padded depth lanes), V 4097 (one score alone in its
# chunk), H 99; steps past N - 1 (4/1/3: D 2). One dtype at the three large cases: the interpreter's time.
KERNEL_CASES = [(1, (3, 1, 4), 163840, 7168, (F16,)), (4, (4, 4, 16), 5000, 64, (F32,)),
                (64, (3, 1, 4), 111, 16, (F32,)), (3, (5, 1, 6), 4097, 99, (F32, F16)),
                (2, (4, 1, 3), 1000, 8, (F32, F16))]


@pytest.mark.parametrize("dev", DEVS)
@pytest.mark.parametrize("B,shape,V,H,dtypes", KERNEL_CASES)
def test_kernels_match_the_torch_code(gen, dev, B, shape, V, H, dtypes):
    spec = SpecConfig(steps=shape[0], topk=shape[1], num_tokens=shape[2])
    n_aux = 3
    for dtype in dtypes + ((torch.bfloat16, torch.float32) if dev == "cuda" else ()):
        ref, kernel = _runs(_kernel_record(spec, n_aux), spec, B, n_aux, dev, gen=gen)
        logits, nodes, accept_len, aux, count = _random_round(gen, B, spec, V, H, n_aux, dtype, dev)
        for run in (ref, kernel):  # (added to a random state: the update is in place)
            run.observe(logits, nodes, accept_len, aux, count=count, max_new=MAX_NEW_K)
        _same_state(kernel, ref)
        if len(dtypes) > 1 or dev == "cuda":  # the bool form of which requests are active (small cases on the CPU)
            active = torch.rand(B, generator=gen).to(dev) < 0.7
            for run in (ref, kernel):
                run.observe(logits, nodes, accept_len, aux, active)
            _same_state(kernel, ref)


@pytest.mark.parametrize("dev", DEVS)
def test_kernels_clamp_a_zero_norm(gen, dev):
    """A slot of zeros: its log-norm is log(1e-30) (the torch code's clamp), not -inf: inside a band down to -100."""
    spec, B = SpecConfig(), 2
    ref, kernel = _runs(_kernel_record(spec, 3, band=(-100.0, 100.0)), spec, B, 3, dev, gen=gen)
    logits, nodes, accept_len, aux, count = _random_round(gen, B, spec, 50, 8, 3, torch.float32, dev)
    aux[:spec.num_tokens, :8] = 0.0  # request 0's slot 0, every row
    before = kernel.acc[0, 2].item()
    for run in (ref, kernel):
        run.observe(logits, nodes, accept_len, aux, count=count.zero_(), max_new=MAX_NEW_K)
    _same_state(kernel, ref)
    assert kernel.acc[0, 2].item() - before == pytest.approx(kernel.out_llr[1])  # inside: log((1 - p1) / (1 - e0))


@pytest.mark.parametrize("dev", DEVS)
def test_kernels_without_a_record_only_count(gen, dev):
    """No record for the settings: the kernel counts accepted drafts and rounds, and leaves the rest of the state
    as it was (logits and features are not read: NaN ones change nothing)."""
    spec, B = SpecConfig(), 5
    ref, kernel = _runs(None, spec, B, 3, dev, gen=gen)
    logits, nodes, accept_len, aux, count = _random_round(gen, B, spec, 50, 4, 3, torch.float32, dev)
    before = kernel.acc.clone()
    for run in (ref, kernel):
        run.observe(logits.fill_(float("nan")), nodes, accept_len, aux.fill_(float("nan")), count=count,
                    max_new=MAX_NEW_K)
    _same_state(kernel, ref)
    assert torch.equal(kernel.acc[:, 2:], before[:, 2:])
    act = (count < MAX_NEW_K).to(before.dtype)
    torch.testing.assert_close(kernel.acc[:, :2], before[:, :2] + torch.stack([accept_len * act, act], 1).double(),
                               rtol=0, atol=0)


def test_kernels_in_the_decode_loop(pair):
    """The loop's call (count and max_new: the comparison inside the kernel) with the kernels on the shipped pair:
    the same tokens, counts and evidence as the torch code's."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    target, drafter, prompts = pair
    batch = next(_batches(prompts, 4))[:2]
    out = {}
    for impl in ("torch", "triton"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out[impl] = generate_speculative(target, drafter, batch, 20, SpecConfig(),
                                             wiring_check=WiringCheck.for_drafter(DRAFTER, impl=impl))
    (t_ref, s_ref), (t_k, s_k) = out["torch"], out["triton"]
    assert torch.equal(t_ref, t_k) and s_k.wiring.checked
    assert (s_k.wiring.request_rounds, s_k.wiring.accepted, s_k.wiring.evidence) == \
        (s_ref.wiring.request_rounds, s_ref.wiring.accepted, s_ref.wiring.evidence)


def test_launches_a_round():
    """What the check adds to a round (bench_wiring_check.count_kernels on one observe): the torch code's ~30 small
    kernels become two Triton launches with a record (one without), with no torch op and no host sync."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    import bench_wiring_check as bench

    for spec in (SpecConfig(), SpecConfig(steps=4, topk=4, num_tokens=16)):
        torch_code = bench.check_launches(2, spec, 1000, 32, 3, "cpu", torch.float32, "torch")
        kernels = bench.check_launches(2, spec, 1000, 32, 3, "cpu", torch.float32, "triton")
        assert not torch_code["triton"] and len(torch_code["torch"]) >= 20 and torch_code["syncs"] == 0, torch_code
        assert kernels == dict(torch=[], triton=["_partials", "_update"], syncs=0), kernels
    run = CheckRun(WiringCheck(impl="triton"), TRAINED, TRAINED, 8, SpecConfig(), torch.device("cpu"), 2)
    args = _random_round(torch.Generator().manual_seed(0), 2, SpecConfig(), 50, 4, 3, torch.float32, "cpu")
    seen = bench.count_kernels(run.observe, *args[:4], count=args[4], max_new=MAX_NEW_K)
    assert seen == dict(torch=[], triton=["_update"], syncs=0), seen



def test_bad_observe_input_is_refused():
    spec, B = SpecConfig(), 2
    run = _check_run(B=B)
    logits, nodes, accept_len, aux, count = _random_round(torch.Generator().manual_seed(0), B, spec, 20, 4, 3,
                                                          torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"accept_len must be a \[2\] torch.int32"):
        run.observe(logits, nodes, accept_len.long(), aux, count=count, max_new=4)
    with pytest.raises(ValueError, match=r"accept_nodes must be a \[2, 4\] torch.int32"):
        run.observe(logits, nodes[:, :3], accept_len, aux, count=count, max_new=4)
    with pytest.raises(ValueError, match=r"count must be a \[2\] torch.int64"):
        run.observe(logits, nodes, accept_len, aux, count=count.int(), max_new=4)
    with pytest.raises(ValueError, match="observe takes active, or count with max_new"):
        run.observe(logits, nodes, accept_len, aux, count < 4, count=count, max_new=4)
    with pytest.raises(ValueError, match=r"logits must be a float \[B \* N = 8, V\]"):
        run.observe(logits[:7], nodes, accept_len, aux, count=count, max_new=4)
    with pytest.raises(ValueError, match=r"aux must be a float \[B \* N = 8, 3 \* H\]"):
        run.observe(logits, nodes, accept_len, aux[:, :-1], count=count, max_new=4)
    with pytest.raises(ValueError, match="impl must be 'auto', 'torch' or 'triton'"):
        WiringCheck(impl="cuda")


@pytest.mark.gpu
def test_gpu_kernels_in_a_cuda_graph(gen):
    """The kernels captured in a CUDA graph (as the round graph holds them) and replayed on new rounds written into
    the same buffers, against the torch code run eagerly on each: Kimi's vocabulary and width, batch 8, the tree."""
    spec, B, V, H, n_aux = SpecConfig(steps=4, topk=4, num_tokens=16), 8, 163840, 7168, 3
    ref, kernel = _runs(_kernel_record(spec, n_aux), spec, B, n_aux, "cuda", gen=gen)
    bufs = _random_round(gen, B, spec, V, H, n_aux, torch.bfloat16, "cuda")
    start = kernel.acc.clone()
    graph, _ = capture_graph(lambda: (kernel.observe(*bufs[:4], count=bufs[4], max_new=MAX_NEW_K), kernel.join()))
    kernel.acc.copy_(start)  # (the warm-up's update undone)
    _replay_new_rounds(graph, bufs, ref, lambda: _random_round(gen, B, spec, V, H, n_aux, torch.bfloat16, "cuda"))
    _same_state(kernel, ref)


def _replay_new_rounds(graph, bufs, ref, new_round, after=None):
    """Three rounds: each written into the captured buffers and replayed, and run eagerly through ref."""
    for _ in range(3):
        new = new_round()
        for buf, t in zip(bufs, new):
            buf.copy_(t)
        graph.replay()
        ref.observe(*new[:4], count=new[4], max_new=MAX_NEW_K)
        if after is not None:
            after(new)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_side_stream_update_in_a_graph(gen):
    """WiringCheck.overlap as the round graph holds it: the update forked after the verify onto the side stream,
    beside unrelated work on the round's stream, the count overwritten after count_read() (as accept_update does)
    and the fork joined at the end; replayed on new rounds, against the update run in line on the count as it was
    before the overwrite (a snapshot taken late would see requests finished that were not: MAX_NEW_K 5, +3)."""
    spec, B, V, H, n_aux = SpecConfig(steps=3, topk=1, num_tokens=4), 8, 163840, 7168, 3
    ref, side = _runs(_kernel_record(spec, n_aux), spec, B, n_aux, "cuda", impls=("triton", "triton"), gen=gen,
                      overlaps=(False, True))
    assert side.overlap and not ref.overlap
    bufs = _random_round(gen, B, spec, V, H, n_aux, torch.bfloat16, "cuda")
    big = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def round_body():
        side.observe(*bufs[:4], count=bufs[4], max_new=MAX_NEW_K)
        busy = big @ big  # the round's own work, independent of the check
        side.count_read()
        bufs[4].add_(3)
        side.join()
        return busy

    start = side.acc.clone()
    graph, _ = capture_graph(round_body)
    side.acc.copy_(start)
    _replay_new_rounds(graph, bufs, ref, lambda: _random_round(gen, B, spec, V, H, n_aux, torch.bfloat16, "cuda"),
                       after=lambda new: torch.testing.assert_close(bufs[4], new[4] + 3, rtol=0, atol=0))
    _same_state(side, ref)
