"""capture_aux: reference on CPU, the CUDA kernel bit-exact against it on the GPU."""

from __future__ import annotations

import pytest
import torch

import eagle3_ops
from eagle3_ops import reference
from eagle3_ops.errors import Eagle3InputError
from tests.conftest import assert_equal, capture_graph, poison_

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KIMI_H = 7168


def _inputs(gen, T, H, n_aux, dtype, device="cpu", residual=True, R=None, strided=False):
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    res = torch.randn(T, H, generator=gen).to(dtype) if residual else None
    rows = None if R is None else torch.randint(0, T, (R,), generator=gen, dtype=torch.int32)
    rows_n = T if R is None else R
    if strided:  # the capture buffer as a view with a padded row stride
        aux = torch.empty(rows_n, n_aux * H + 8, dtype=dtype)[:, :n_aux * H]
    else:
        aux = torch.empty(rows_n, n_aux * H, dtype=dtype)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    if strided:
        aux_dev = torch.empty(rows_n, n_aux * H + 8, dtype=dtype, device=device)[:, :n_aux * H]
    else:
        aux_dev = aux.to(device)
    return move(hidden), move(res), aux_dev, move(rows)


def test_hand_worked():
    hidden = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    residual = torch.tensor([[0.5, 0.5], [1.0, 1.0], [-5.0, -6.0]])
    aux = torch.full((2, 6), -1.0)
    torch.ops.eagle3.capture_aux(hidden, residual, aux, 1, torch.tensor([2, 0]))
    expected = torch.tensor([[-1.0, -1.0, 0.0, 0.0, -1.0, -1.0], [-1.0, -1.0, 1.5, 2.5, -1.0, -1.0]])
    assert_equal(aux, expected)


def test_without_residual_is_a_copy(gen):
    hidden, _, aux, _ = _inputs(gen, 5, 16, 2, torch.float32, residual=False)
    poison_(aux)
    torch.ops.eagle3.capture_aux(hidden, None, aux, 0, None)
    assert_equal(aux[:, :16], hidden)
    assert torch.isnan(aux[:, 16:]).all()  # the other slot is untouched


def test_bf16_sum_rounds_once(gen):
    hidden, residual, aux, _ = _inputs(gen, 7, 64, 3, torch.bfloat16)
    torch.ops.eagle3.capture_aux(hidden, residual, aux, 2, None)
    assert_equal(aux[:, 128:], (hidden.float() + residual.float()).bfloat16())


def test_out_of_range_row_raises_and_writes_nothing(gen):
    hidden, residual, aux, _ = _inputs(gen, 4, 8, 1, torch.float32)
    poison_(aux)
    with pytest.raises(Eagle3InputError, match=r"^capture_aux: rows\[3\] = 4 is out of range \(valid: 0\.\.3\)$"):
        torch.ops.eagle3.capture_aux(hidden, residual, aux, 0, torch.tensor([0, 1, 2, 4]))
    assert torch.isnan(aux).all()


# ---- GPU: the CUDA kernel against the reference --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 7, 64, 4096])  # decode, odd, a verify batch, prefill
@pytest.mark.parametrize("mode", ["residual", "no_residual", "rows", "strided"])
def test_cuda_bit_exact(gen, dtype, T, mode):
    R = {"rows": max(1, T // 3) + 1}.get(mode)
    hidden, residual, aux, rows = _inputs(gen, T, KIMI_H, 3, dtype, "cuda", residual=mode != "no_residual", R=R,
                                          strided=mode == "strided")
    for slot in range(3):
        poison_(aux)
        torch.ops.eagle3.capture_aux(hidden, residual, aux, slot, rows)
        expected = torch.full(aux.shape, float("nan"), dtype=dtype)
        reference.capture_aux(hidden.cpu(), None if residual is None else residual.cpu(), expected, slot,
                              None if rows is None else rows.cpu())
        assert_equal(aux.cpu(), expected, f"aux slot {slot}")


@pytest.mark.gpu
@pytest.mark.parametrize("H", [1, 3, 99, 7168 + 1])  # not a multiple of the 16-byte vector: scalar path
def test_cuda_odd_widths(gen, H):
    hidden, residual, aux, rows = _inputs(gen, 5, H, 2, torch.bfloat16, "cuda", R=4)
    poison_(aux)
    torch.ops.eagle3.capture_aux(hidden, residual, aux, 1, rows)
    expected = torch.full(aux.shape, float("nan"), dtype=torch.bfloat16)
    reference.capture_aux(hidden.cpu(), residual.cpu(), expected, 1, rows.cpu())
    assert_equal(aux.cpu(), expected)


@pytest.mark.gpu
def test_cuda_out_of_range_rows_write_nan_and_read_nothing(gen):
    # several bad rows: each is NaN-filled; the error word names one of them (tests/test_contract_capture.py
    # checks single violations message for message)
    hidden, residual, aux, _ = _inputs(gen, 8, 64, 1, torch.bfloat16, "cuda")
    rows = torch.tensor([0, 8, -1, 7, 2**31 - 1, 3, 1, 2], dtype=torch.int32, device="cuda")
    aux.zero_()
    eagle3_ops.check_errors()
    torch.ops.eagle3.capture_aux(hidden, residual, aux, 0, rows)
    with pytest.raises(Eagle3InputError, match=r"^capture_aux: rows\[(1|2|4)\] = (8|-1|2147483647) is out of range"):
        eagle3_ops.check_errors()
    bad = torch.tensor([False, True, True, False, True, False, False, False])
    assert torch.isnan(aux.cpu()[bad]).all()
    good = (hidden + residual).cpu()[rows.cpu()[~bad].long()]
    assert_equal(aux.cpu()[~bad], good)


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_values(gen):
    T, H = 64, KIMI_H
    hidden, residual, aux, rows = _inputs(gen, T, H, 3, torch.bfloat16, "cuda", R=16)
    graph, _ = capture_graph(lambda: torch.ops.eagle3.capture_aux(hidden, residual, aux, 1, rows))
    for _ in range(3):  # new values at the same addresses
        hidden.copy_(torch.randn(T, H, generator=gen).bfloat16())
        residual.copy_(torch.randn(T, H, generator=gen).bfloat16())
        rows.copy_(torch.randint(0, T, (16,), generator=gen, dtype=torch.int32))
        poison_(aux)
        graph.replay()
        eager = torch.full(aux.shape, float("nan"), dtype=torch.bfloat16)
        reference.capture_aux(hidden.cpu(), residual.cpu(), eager, 1, rows.cpu())
        assert_equal(aux.cpu(), eager)


@pytest.mark.gpu
def test_cuda_runs_on_the_current_stream(gen):
    hidden, residual, aux, _ = _inputs(gen, 64, KIMI_H, 1, torch.bfloat16, "cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # the stream is busy: a kernel on another stream would finish first
        torch.ops.eagle3.capture_aux(hidden, residual, aux, 0, None)
        expected = hidden + residual
        same = torch.equal(aux, expected)
    stream.synchronize()
    assert same


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case, match",
    [
        ("dtype", "aux must have dtype"),
        ("shape", "residual must have shape"),
        ("device", "residual must be on the same device"),
        ("slot", "slot must be in"),
        ("rows_dtype", "rows must have dtype"),
        ("rows_count", "aux must have R"),
    ],
)
def test_cuda_bad_input(gen, case, match):
    hidden, residual, aux, _ = _inputs(gen, 4, 64, 2, torch.bfloat16, "cuda")
    rows = None
    slot = 0
    if case == "dtype":
        aux = aux.float()
    elif case == "shape":
        residual = residual[:3]
    elif case == "device":
        residual = residual.cpu()
    elif case == "slot":
        slot = 2
    elif case == "rows_dtype":
        rows = torch.zeros(4, dtype=torch.float32, device="cuda")
    elif case == "rows_count":
        rows = torch.zeros(3, dtype=torch.int64, device="cuda")
    before = aux.clone()
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        torch.ops.eagle3.capture_aux(hidden, residual, aux, slot, rows)
    assert_equal(aux, before)
