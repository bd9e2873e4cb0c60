"""bench/bench_tp.py under torchrun with 4 gloo ranks on the CPU (tiny preset): every batch x prefix x acceptance
row written, with the breakdown, the NCCL (here gloo) accounting and the two in-run comparisons (the sharded
fc equal to the replicated one, the vocab-parallel verify identical to the gathered one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(
    sys.executable), "torchrun")), reason="torchrun not installed")
def test_bench_tp_torchrun_gloo(tmp_path):
    path = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(ROOT, "bench", "bench_tp.py"), "--preset", "tiny", "--device", "cpu", "--dtype", "float32",
           "--experts", "model", "--batch", "1", "2", "--prefix", "16", "--max-new", "9", "--json", str(path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["world"] == 4 and data["drafter"].startswith("ORACLE")
    rows = data["rows"]
    assert [(r["batch"], r["accept_length_target"]) for r in rows] == [(1, 2.4), (1, 3.0), (2, 2.4), (2, 3.0)]
    for r in rows:
        assert r["accept_len"] >= 1.0 and r["spec_tok_s"] > 0 and r["plain_tok_s"] > 0
        assert set(r["timed_step_ms"]) >= {"target", "draft", "fc", "build_tree", "verify", "kv_accept"}
        assert r["nccl_round_ms"] > 0 and r["nccl_plain_step_ms"] > 0
        ops = {c["op"] for c in r["nccl_calls"]["spec"]}
        assert ops == {"all_reduce_sum", "all_reduce_max", "all_gather"}  # layers, the verify's argmax, the fc
        assert r["fc"]["max_abs_diff"] < 1e-5 and r["fc"]["sharded_weight_bytes"] * 4 == r["fc"]["replicated_weight_bytes"]
        assert r["verify"]["identical"] and r["moe"] == "tp"
        reads = r["moe_layer_read_mb"][f"T{r['batch'] * 4}"]
        assert reads["ep_max"] >= reads["tp"] > 0
    assert "| B | prefix |" in res.stdout
