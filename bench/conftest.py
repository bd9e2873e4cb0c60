"""pytest-benchmark harness: one case per (op, shape, provider); ceilings measured once per run; the
table printed last and the rows written to $EAGLE3_BENCH_OUT/bench.json (after every case, and at the end)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from common import Ceilings, Recorder, bench_out  # noqa: E402

_recorder: list[Recorder] = []


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="benchmarks need a CUDA GPU")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def recorder():
    if not _recorder:
        _recorder.append(Recorder(Ceilings.measure()))
    return _recorder[0]


def pytest_runtest_logfinish(nodeid, location):
    # the rows so far after every case, so that a run stopped at its time limit keeps what it measured
    path = bench_out("bench")
    if _recorder and path:
        _recorder[0].write(path)


def pytest_sessionfinish(session, exitstatus):
    if not _recorder:
        return
    rec = _recorder[0]
    path = bench_out("bench")
    if path:
        rec.write(path)
    print("\n" + rec.table())
