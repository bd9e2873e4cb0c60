"""The one input contract on both devices (eagle3_ops/errors.py), as test helpers.

A bad-value case is a function `make(device) -> (call, guard)`: fresh inputs on `device`, `call()` runs the
op once, `guard()` returns the tensors whose contents the op must leave as they were on a failed call
(CPU) or must not touch outside the elements it is documented to write (CUDA: compare with
`expected_cuda`). Each test runs the case on CPU (Eagle3InputError with the exact message, nothing
written) and, on a GPU, on CUDA (no exception at the call, the error word naming the same violation with
the same message, then strict mode raising at the call).
"""

from __future__ import annotations

import re

import pytest
import torch

import eagle3_ops
from eagle3_ops.errors import Eagle3InputError


def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def assert_unchanged(before, after, what="argument"):
    for i, (b, a) in enumerate(zip(before, after)):
        same = (b == a) | (torch.isnan(b) & torch.isnan(a)) if b.is_floating_point() else b == a
        assert bool(same.all()), f"{what} {i} was modified by a failed call"


def expect_cpu(make, message: str) -> None:
    """CPU: raises Eagle3InputError with exactly `message`, and writes nothing."""
    call, guard = make("cpu")
    before = snapshot(guard())
    with pytest.raises(Eagle3InputError, match="^" + re.escape(message) + "$"):
        call()
    assert_unchanged(before, guard())


def expect_cuda(make, message: str, check_outputs=None) -> None:
    """CUDA: the call returns, check_errors() raises the same message once (then the word is clear),
    check_outputs(guard tensors) holds (what is skipped / left untouched), and strict mode raises at the call."""
    eagle3_ops.check_errors()  # nothing left over from an earlier test
    call, guard = make("cuda")
    call()
    torch.cuda.synchronize()
    with pytest.raises(Eagle3InputError, match="^" + re.escape(message) + "$"):
        eagle3_ops.check_errors()
    eagle3_ops.check_errors()  # cleared
    if check_outputs is not None:
        check_outputs(guard())
    call, guard = make("cuda")
    eagle3_ops.set_strict(True)
    try:
        with pytest.raises(Eagle3InputError, match="^" + re.escape(message) + "$"):
            call()
    finally:
        eagle3_ops.set_strict(False)
    eagle3_ops.check_errors()  # strict mode cleared it


def expect_cuda_graph(make, message: str) -> None:
    """CUDA graph: a captured launch reports through the word on replay."""
    from tests.conftest import capture_graph

    eagle3_ops.check_errors()
    call, _ = make("cuda")
    graph, _ = capture_graph(call)
    with pytest.raises(Eagle3InputError, match="^" + re.escape(message) + "$"):
        eagle3_ops.check_errors()  # the warm-up call before the capture reported; this clears it
    graph.replay()
    with pytest.raises(Eagle3InputError, match="^" + re.escape(message) + "$"):
        eagle3_ops.check_errors()
