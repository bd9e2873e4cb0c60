"""bench/bench_e2e.py runs end to end on the CPU (tiny preset): every row lossless, the oracle's p = 1
accepting whole chains, and the results file written."""

from __future__ import annotations

import json
import os
import sys

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
