"""add_rmsnorm_capture: the fused residual add + RMSNorm that also captures the new residual (the target's
capture point). Hand-worked exact numbers, the rounding rules, the capture into one aux slot, and the
float64 truth written independently of the reference."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TOLERANCES, assert_equal, poison_, rel_err

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _truth64(x, residual, weight, eps):
    """Independent float64 formula: (new residual rounded to residual's dtype, normed * weight in float64)."""
    new_res = (x.double() + residual.double()).to(residual.dtype)  # the add, rounded once
    r = new_res.double()
    rms = torch.sqrt((r * r).sum(-1, keepdim=True) / r.shape[-1] + eps)
    return new_res, r / rms * weight.double()


def _inputs(gen, T, H, dtype, res_dtype=None, w_dtype=None):
    res_dtype = res_dtype or dtype
    x = torch.randn(T, H, generator=gen).to(dtype)
    residual = (3 * torch.randn(T, H, generator=gen)).to(res_dtype)
    weight = (1 + 0.1 * torch.randn(H, generator=gen)).to(w_dtype or dtype)
    return x, residual, weight


def test_hand_worked_exact():
    # H = 4, eps = 0.25: every row's mean(r^2) + eps is a power of 4, so rsqrt is exact.
    x = torch.tensor([[1.0, 0.0, 1.0, -1.0],     # r = [1, 1, 1, 0]   mean 0.75  -> rsqrt(1)  = 1
                      [0.5, 1.0, 1.0, 1.0],      # r = [1, 1, 2, 3]   mean 3.75  -> rsqrt(4)  = 0.5
                      [2.0, -3.0, 0.0, 0.0],     # r = [0, 0, 0, 0]   mean 0     -> rsqrt(.25) = 2
                      [1.0, 1.0, 1.0, 2.0]])     # r = [3, 3, 3, 6]   mean 15.75 -> rsqrt(16) = 0.25
    residual = torch.tensor([[0.0, 1.0, 0.0, 1.0],
                             [0.5, 0.0, 1.0, 2.0],
                             [-2.0, 3.0, 0.0, 0.0],
                             [2.0, 2.0, 2.0, 4.0]])
    weight = torch.tensor([1.0, 2.0, 0.5, -1.0])
    aux = torch.full((2, 8), -7.0)  # n_aux = 2, capture rows [3, 1] into slot 1
    torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 0.25, aux, 1, torch.tensor([3, 1]))
    new_res = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 6.0]])
    assert_equal(residual, new_res, "residual")
    normed = torch.tensor([[1.0, 2.0, 0.5, -0.0],  # r * rsqrt * weight
                           [0.5, 1.0, 0.5, -1.5],
                           [0.0, 0.0, 0.0, -0.0],
                           [0.75, 1.5, 0.375, -1.5]])
    assert_equal(x, normed, "x")
    expected_aux = torch.tensor([[-7.0] * 4 + [3.0, 3.0, 3.0, 6.0], [-7.0] * 4 + [1.0, 1.0, 2.0, 3.0]])
    assert_equal(aux, expected_aux, "aux")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_residual_rounds_once_and_x_is_the_normed_new_residual(gen, dtype):
    x, residual, weight = _inputs(gen, 9, 64, dtype)
    x0, r0 = x.clone(), residual.clone()
    torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, None, 0, None)
    # One rounding of the exact sum (the same as the low-precision `x + residual`).
    assert_equal(residual, (x0.float() + r0.float()).to(dtype), "residual")
    assert_equal(residual, x0 + r0, "residual vs the plain add")
    # x = rmsnorm(rounded new residual) * weight, computed in fp32 and rounded once: within one ulp of
    # the float64 truth on the *rounded* residual.
    _, ref = _truth64(x0, r0, weight, 1e-6)
    ulp = 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    err = (x.double() - ref).abs() - ulp * ref.abs()
    assert bool((err <= 1e-30).all()), f"x off by more than one ulp at {tuple((err > 1e-30).nonzero()[0].tolist())}"
    assert rel_err(x, ref) <= TOLERANCES[dtype]


@pytest.mark.parametrize("T, H", [(1, 1), (3, 17), (99, 64), (3, 7168)])  # decode, odd, a batch, Kimi H
@pytest.mark.parametrize("dtype", DTYPES)
def test_against_float64_truth(gen, T, H, dtype):
    x, residual, weight = _inputs(gen, T, H, dtype)
    x0, r0 = x.clone(), residual.clone()
    poison_(aux := torch.empty(T, 3 * H, dtype=dtype))
    torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-5, aux, 1, None)
    new_res, ref = _truth64(x0, r0, weight, 1e-5)
    assert_equal(residual, new_res, "residual")
    assert rel_err(x, ref) <= TOLERANCES[dtype], f"x: rel err {rel_err(x, ref):.3g}"
    assert_equal(aux[:, H:2 * H], new_res, "aux slot 1")
    assert torch.isnan(aux[:, :H]).all() and torch.isnan(aux[:, 2 * H:]).all(), "other slots were written"


def test_float64_inputs_agree_with_float64_formula(gen):
    x, residual, weight = _inputs(gen, 5, 33, torch.float64)
    x0, r0 = x.clone(), residual.clone()
    torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, None, 0, None)
    new_res, ref = _truth64(x0, r0, weight, 1e-6)
    assert_equal(residual, new_res, "residual")
    assert rel_err(x, ref) <= TOLERANCES[torch.float64]
    # ... and with torch's own RMSNorm in float64
    assert rel_err(x, torch.nn.functional.rms_norm(new_res, (33,), weight, 1e-6)) <= TOLERANCES[torch.float64]


def test_fp32_residual_with_bf16_x(gen):
    # A common layout: bf16 activations, an fp32 residual stream. The sum is rounded to fp32 only.
    x, residual, weight = _inputs(gen, 7, 48, torch.bfloat16, res_dtype=torch.float32, w_dtype=torch.float32)
    x0, r0 = x.clone(), residual.clone()
    aux = poison_(torch.empty(7, 2 * 48))
    torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, aux, 0, None)
    new_res, ref = _truth64(x0, r0, weight, 1e-6)
    assert residual.dtype == torch.float32 and x.dtype == torch.bfloat16
    assert_equal(residual, new_res, "residual")
    assert rel_err(x, ref) <= TOLERANCES[torch.bfloat16]
    assert_equal(aux[:, :48], new_res, "aux slot 0")
    assert torch.isnan(aux[:, 48:]).all()


@pytest.mark.parametrize("slot", [0, 1, 2])
@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64])
def test_capture_rows_into_each_slot(gen, slot, rows_dtype):
    T, H = 11, 24
    x, residual, weight = _inputs(gen, T, H, torch.bfloat16)
    rows = torch.tensor([10, 0, 4, 4], dtype=rows_dtype)  # last, first, a repeated row
    x0, r0 = x.clone(), residual.clone()
    aux = poison_(torch.empty(4, 3 * H, dtype=torch.bfloat16))
    torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, aux, slot, rows)
    new_res = x0 + r0
    assert_equal(aux[:, slot * H:(slot + 1) * H], new_res[rows.long()], "captured rows")
    others = torch.cat([aux[:, :slot * H], aux[:, (slot + 1) * H:]], dim=1)
    assert torch.isnan(others).all(), "a slot other than `slot` was written"
    assert_equal(residual, new_res, "residual")  # the whole residual is still updated


def test_capture_into_strided_aux(gen):
    # The capture buffer as a column-slice view of a wider buffer (padded row stride).
    T, H = 6, 16
    x, residual, weight = _inputs(gen, T, H, torch.float32)
    r0 = residual.clone()
    x0 = x.clone()
    wide = poison_(torch.empty(T, 3 * H + 5))
    aux = wide[:, 2:2 + 3 * H]
    torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, aux, 2, None)
    new_res = (x0.double() + r0.double()).float()
    assert_equal(wide[:, 2 + 2 * H:2 + 3 * H], new_res, "slot 2")
    assert torch.isnan(wide[:, :2 + 2 * H]).all() and torch.isnan(wide[:, 2 + 3 * H:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_aux_none_is_plain_fused_add_rmsnorm(gen, dtype):
    x, residual, weight = _inputs(gen, 5, 40, dtype)
    x_a, r_a = x.clone(), residual.clone()
    torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, None, 0, None)
    # the same call with a capture gives bit-identical x and residual: capturing changes nothing else
    aux = poison_(torch.empty(5, 40, dtype=dtype))
    torch.ops.eagle3.add_rmsnorm_capture(x_a, r_a, weight, 1e-6, aux, 0, None)
    assert_equal(x, x_a, "x")
    assert_equal(residual, r_a, "residual")
    # and matches torch's add + RMSNorm module math
    new_res = residual.double()
    ref = torch.nn.functional.rms_norm(new_res, (40,), weight.double(), 1e-6)
    assert rel_err(x, ref) <= TOLERANCES[dtype]


def test_bad_row_raises_and_writes_nothing(gen):
    x, residual, weight = _inputs(gen, 4, 8, torch.float32)
    aux = poison_(torch.empty(2, 8))
    before = [t.clone() for t in (x, residual, aux)]
    with pytest.raises(IndexError, match="rows"):
        torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, aux, 0, torch.tensor([1, 4]))
    for t, b in zip((x, residual, aux), before):
        assert_equal(t, b)
