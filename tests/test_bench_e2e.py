"""bench/bench_e2e.py runs end to end on the CPU (tiny preset): every row lossless, the oracle's p = 1
accepting whole chains, and the results file written."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))


def test_bench_e2e_runs_on_the_cpu(tmp_path):
    import bench_e2e

    path = tmp_path / "e2e.json"
    rc = bench_e2e.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--batch", "2", "--prefix", "12",
                         "--p", "1.0", "0.0", "--spec", "chain 3/1/4", "--max-new", "12", "--json", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    assert data["drafter"].startswith("ORACLE") and len(data["rows"]) == 4  # 2 p x 2 glue
    for r in data["rows"]:
        assert r["identical"]
        assert r["accept_len"] == (1.0 if r["p"] == 0.0 else r["accept_len"])
        assert set(r["timed_step_ms"]) >= {"target", "draft", "build_tree", "verify", "kv_accept", "fc"}
    full = [r for r in data["rows"] if r["p"] == 1.0]
    assert all(r["accept_len"] > 3.0 for r in full)


def test_step_floor_bytes_counts_weights_experts_and_caches():
    # the roofline's bytes: a decode step reads the dense weights, about k of E experts a layer and the
    # latent cache; a verify of more tokens reads more experts; the drafter's forwards and fc come on top
    import bench_e2e
    from eagle3_ops.models.config import DrafterConfig, TargetConfig
    from eagle3_ops.models.drafter import Drafter
    from eagle3_ops.models.target import Experts, Target

    cfg = TargetConfig.from_preset("tiny")
    target = Target.synthesize(cfg, seed=0)
    drafter = Drafter.synthesize(DrafterConfig.for_target(cfg), target.model.embed_tokens, seed=1)
    a = bench_e2e.step_floor_bytes(target, drafter, B=1, prefix=0, N=4, draft_forwards=3)
    b = bench_e2e.step_floor_bytes(target, drafter, B=1, prefix=100, N=4, draft_forwards=3)
    c = bench_e2e.step_floor_bytes(target, drafter, B=1, prefix=0, N=16, draft_forwards=3)
    routed = sum(p.numel() * p.element_size() for m in target.modules() if isinstance(m, Experts)
                 for p in m.parameters())
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    dense = sum(p.numel() * p.element_size() for n, p in target.named_parameters() if "embed_tokens" not in n) - routed
    assert E > 0 and abs(a["plain"] - (dense + routed * (1 - (1 - k / E)) )) < 1
    assert b["plain"] - a["plain"] == cfg.num_layers * 100 * cfg.kv_dim * target.lm_head.weight.element_size()
    assert a["plain"] < a["spec"] < c["spec"]


def test_bench_e2e_policy_rows_and_table(tmp_path, capsys):
    """--policy fixed adaptive with --accept-length: an adaptive row (and one with the full model's costs) per
    length, lossless, with its decisions, cost table and accept rate; the policy table states both acceptance
    figures."""
    import bench_e2e

    path = tmp_path / "e2e.json"
    rc = bench_e2e.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--batch", "1", "--prefix", "10",
                         "--accept-length", "1.0", "4.0", "--spec", "chain 3/1/4", "--glue", "eagle3", "--max-new", "12",
                         "--policy", "fixed", "adaptive", "--full-costs", "--json", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    rows = data["rows"]
    assert data["fixpoint"] == 3  # --accept-length: the oracle's reference is each run's own output by default
    assert all(r["calibrated"] for r in rows)  # float32 on the CPU: every acceptance at its p
    adaptive = [r for r in rows if r["spec"].startswith("adaptive")]
    assert len(adaptive) == 4 and {r["accept_length_target"] for r in rows} == {1.0, 4.0}
    for r in adaptive:
        assert r["identical"] and sum(r["decisions"].values()) == r["rounds"]
        assert set(r["costs_ms"]) == {"plain", "resume/8", "resume/64", "1/1/2", "2/1/3", "3/1/4", "4/1/5", "5/1/6"}
        assert set(r["graph_prepares"].values()) == {1}
        assert r["accept_rate"] == (0.0 if r["p"] == 0.0 else r["accept_rate"])
    out = capsys.readouterr().out
    assert "adaptive / best fixed" in out and "chain 3/1/4: tok/s, L, rate" in out


def test_calibration_flags_an_acceptance_off_its_p():
    """accepted ~ Binomial(tested, p) with the run's own reference: within 3 standard deviations plus one draft a
    request is calibrated; the fixpoint-0 H200 run's 3/1/4 at L 4 (p = 1: 1.67 tokens a round over 36 rounds, 24
    of the 60 tested drafts accepted) is not, nor is a p = 0 run that accepted anything past the cap's slack."""
    import bench_e2e

    assert bench_e2e.calibration(0.5, 100, 50, 1)["calibrated"]
    assert bench_e2e.calibration(0.5, 100, 64, 1)["calibrated"]  # 3 x 5 + 1 = 16 drafts of slack
    assert not bench_e2e.calibration(0.5, 100, 30, 1)["calibrated"]
    assert bench_e2e.calibration(1.0, 60, 59, 1)["calibrated"]  # the last round's draft past max_new
    assert not bench_e2e.calibration(1.0, 60, 24, 1)["calibrated"]
    assert not bench_e2e.calibration(0.0, 60, 3, 1)["calibrated"]
    assert bench_e2e.calibration(0.0, 60, 0, 1)["p_measured"] == 0.0


def test_over_seeds_means_spreads_and_checks():
    """over_seeds (--oracle-seeds S): one row of S runs, its figures their means, spec_tok_s_sd and speedup_sd the
    sample sds, each check held only where every run held it, the tested drafts summed and p_measured pooled over
    them, an adaptive row's decisions and resumes summed, its extrapolated figures averaged; each run in
    oracle_runs. One run passes through as it was."""
    import bench_e2e

    def one(tok_s, identical=True, calibrated=True, tested=10, accepted=5, decisions=None, first_diff=None):
        r = dict(batch=1, spec="adaptive", p=0.5, spec_tok_s=tok_s, speedup=tok_s / 100.0, accept_len=1.5,
                 accept_rate=0.5, rounds=tok_s / 10.0, step_ms=2.0, graph_setup_ms=5.0, identical=identical,
                 first_diff=first_diff, oracle_reference="the run's own output", fixpoint_passes=int(tok_s) % 3 + 1,
                 matches_oracle_reference=True, tested=tested, p_measured=accepted / tested, calibrated=calibrated)
        if decisions is not None:
            r.update(decisions=decisions, resumes=1, regret_ms=tok_s / 50.0, policy_waits=2,
                     extrapolated=dict(layers=61, spec_tok_s=tok_s / 2, speedup=tok_s / 200.0))
        return r

    a = one(100.0, decisions={"plain": 3, "1/1/2": 2})
    row = bench_e2e.over_seeds([a])
    assert row == dict(a, oracle_seeds=1, oracle_runs=[dict(oracle_seed=0, **{k: a[k] for k in bench_e2e.RUN_KEYS
                                                                                 if k in a})])
    assert "spec_tok_s_sd" not in row and bench_e2e._seeds_note(row) == ""

    runs = [one(100.0, tested=10, accepted=5, decisions={"plain": 3, "1/1/2": 2}),
            one(110.0, identical=False, tested=30, accepted=21, decisions={"1/1/2": 4}, first_diff=[0, 7]),
            one(120.0, calibrated=False, tested=20, accepted=10, decisions={"plain": 1, "3/1/4": 2})]
    row = bench_e2e.over_seeds(runs)
    assert row["oracle_seeds"] == 3 and [r["oracle_seed"] for r in row["oracle_runs"]] == [0, 1, 2]
    assert [r["spec_tok_s"] for r in row["oracle_runs"]] == [100.0, 110.0, 120.0]
    assert row["spec_tok_s"] == pytest.approx(110.0) and row["speedup"] == pytest.approx(1.1)
    assert row["rounds"] == pytest.approx(11.0) and row["regret_ms"] == pytest.approx(2.2)
    assert row["spec_tok_s_sd"] == pytest.approx(10.0) and row["speedup_sd"] == pytest.approx(0.1)  # (n - 1)
    assert not row["identical"] and not row["calibrated"] and row["matches_oracle_reference"]
    assert row["first_diff"] == [0, 7] and row["fixpoint_passes"] == 3
    assert row["tested"] == 60 and row["p_measured"] == pytest.approx((5 + 21 + 10) / 60)
    assert row["decisions"] == {"plain": 4, "1/1/2": 6, "3/1/4": 2} and row["resumes"] == 3
    assert row["extrapolated"] == {"layers": 61, "spec_tok_s": pytest.approx(55.0), "speedup": pytest.approx(0.55)}
    assert runs[0]["decisions"] == {"plain": 3, "1/1/2": 2}  # (the runs themselves untouched)
    assert "mean of 3 oracle seeds, sd 10.0 tok/s: 100.0, 110.0, 120.0" in bench_e2e._seeds_note(row)


def test_bench_e2e_oracle_seeds(tmp_path, capsys):
    """--oracle-seeds 2 through the bench: every ORACLE row (fixed and adaptive) the mean of its two runs, each
    lossless and kept in oracle_runs; the adaptive row's decisions those of both runs; the policy table's standard
    errors."""
    import bench_e2e

    path = tmp_path / "e2e.json"
    rc = bench_e2e.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--batch", "1", "--prefix", "10",
                         "--accept-length", "2.4", "--spec", "chain 3/1/4", "--glue", "eagle3", "--max-new", "12",
                         "--policy", "fixed", "adaptive", "--oracle-seeds", "2", "--no-breakdown",
                         "--json", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    assert data["oracle_seeds"] == 2 and {r["spec"] for r in data["rows"]} == {"chain 3/1/4", "adaptive"}
    for r in data["rows"]:
        assert r["oracle_seeds"] == 2 and len(r["oracle_runs"]) == 2 and r["identical"]
        assert all(x["identical"] for x in r["oracle_runs"])
        assert r["spec_tok_s"] == pytest.approx(sum(x["spec_tok_s"] for x in r["oracle_runs"]) / 2)
        if r["spec"] == "adaptive":
            both = sum(sum(x["decisions"].values()) for x in r["oracle_runs"])
            assert sum(r["decisions"].values()) == both == pytest.approx(2 * r["rounds"])
    out = capsys.readouterr().out
    assert "mean of 2 oracle seeds" in out and "(se " in out
