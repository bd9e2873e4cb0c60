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
