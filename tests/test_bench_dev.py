"""bench/dev/'s development tools still load where they live: each imports (its helpers from bench/dev/_shared.py,
bench/common.py and the benchmarks, the checkout's eagle3_ops) and has the main() its command line runs. One
subprocess loads them all, from outside the checkout, as `python3 bench/dev/<tool>.py` would, so that nothing a
tool does at import (sys.path, the environment) leaks into this process."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV = os.path.join(ROOT, "bench", "dev")
TOOLS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(DEV, "*.py"))
               if not os.path.basename(p).startswith("_"))

LOADER = """
import importlib.util, sys
sys.path.insert(0, sys.argv[1])  # what running a script in bench/dev/ puts first
for name in sys.argv[2:]:
    spec = importlib.util.spec_from_file_location(name, f"{sys.argv[1]}/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    print(name, callable(getattr(module, "main", None)))
"""


def test_every_dev_tool_imports_and_has_main(tmp_path):
    # the glob found them (the FlashMLA peer tool moved out of bench/dev: bench/peer_mla.py)
    assert {"ceiling_mla", "profile_mla", "sweep_fc", "sweep_mla", "trace_mla", "tune_fc"} <= set(TOOLS), TOOLS
    r = subprocess.run([sys.executable, "-c", LOADER, DEV, *TOOLS], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:-1] == [f"{name} True" for name in TOOLS], r.stdout
