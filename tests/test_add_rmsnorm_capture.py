"""add_rmsnorm_capture: the fused residual add + RMSNorm that also captures the new residual (the target's
capture point). Hand-worked exact numbers, the rounding rules, the capture into one aux slot, and the
float64 truth written independently of the reference."""

from __future__ import annotations

import pytest
import torch

import eagle3_ops
from eagle3_ops import reference
from eagle3_ops.errors import Eagle3InputError
from tests.conftest import TOLERANCES, assert_equal, capture_graph, poison_, rel_err

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
    message = r"^add_rmsnorm_capture: rows\[1\] = 4 is out of range \(valid: 0\.\.3\)$"
    with pytest.raises(Eagle3InputError, match=message):
        torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, aux, 0, torch.tensor([1, 4]))
    for t, b in zip((x, residual, aux), before):
        assert_equal(t, b)


# ---- GPU: the CUDA kernel against the reference --------------------------------------------------------

KIMI_H = 7168
# (x dtype, residual dtype, weight dtype): the common layouts, an fp32 residual stream, an fp32 norm weight
COMBOS = [(torch.bfloat16, torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16, torch.float16),
          (torch.float32, torch.float32, torch.float32), (torch.bfloat16, torch.float32, torch.float32),
          (torch.bfloat16, torch.bfloat16, torch.float32), (torch.float64, torch.float64, torch.float64)]


def _cuda_case(gen, T, H, dt, mode, n_aux=3):
    x_dt, r_dt, w_dt = dt
    x, residual, weight = _inputs(gen, T, H, x_dt, res_dtype=r_dt, w_dtype=w_dt)
    R = {"rows": T // 3 + 2}.get(mode, T)
    rows = torch.randint(0, T, (R,), generator=gen) if mode == "rows" else None
    if mode == "strided":
        aux = torch.empty(T, n_aux * H + 8, dtype=r_dt)[:, 8:]  # a column view: row stride > width
    else:
        aux = torch.empty(R, n_aux * H, dtype=r_dt)
    if mode == "off":
        aux = None
    return x, residual, weight, aux, rows


def _run_both(args, slot, eps=1e-6):
    """The CUDA op and the CPU reference on copies of the same inputs; aux poisoned on both sides."""
    x, residual, weight, aux, rows = args
    dev = [None if t is None else t.cuda() for t in (x, residual, weight, aux, rows)]
    cpu = [None if t is None else t.clone() for t in (x, residual, weight, aux, rows)]
    for a in (dev[3], cpu[3]):
        if a is not None:
            poison_(a)
    torch.ops.eagle3.add_rmsnorm_capture(dev[0], dev[1], dev[2], eps, dev[3], slot, dev[4])
    reference.add_rmsnorm_capture(cpu[0], cpu[1], cpu[2], eps, cpu[3], slot, cpu[4])
    return [None if t is None else t.cpu() for t in dev], cpu


@pytest.mark.gpu
@pytest.mark.parametrize("dt", COMBOS, ids=lambda c: "-".join(str(d).replace("torch.", "") for d in c))
@pytest.mark.parametrize("T", [1, 3, 64, 99, 4096])
@pytest.mark.parametrize("mode", ["all", "rows", "strided", "off"])
def test_cuda_against_reference(gen, dt, T, mode):
    """residual and aux bit-exact; x within the dtype's rule of the float64 truth and within one rounding of
    the reference (only the order of the sum of squares differs)."""
    if T == 4096 and dt[0] == torch.float64:
        pytest.skip("the float64 path is for testing; 99 rows cover it")
    args = _cuda_case(gen, T, KIMI_H, dt, mode)
    x0, r0, w = args[0].clone(), args[1].clone(), args[2]
    (x, residual, _, aux, _), (x_ref, residual_ref, _, aux_ref, _) = _run_both(args, slot=1)
    assert_equal(residual, residual_ref, "residual")
    if aux is not None:
        assert_equal(aux, aux_ref, "aux")
    _, truth = _truth64(x0, r0, w, 1e-6)
    assert rel_err(x, truth) <= TOLERANCES[dt[0]]
    assert rel_err(x, x_ref) <= {torch.float64: 1e-14, torch.float32: 1e-6}.get(dt[0], 4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [1, 3, 99, 7169, 20000, 40960])  # scalar path, odd; beyond the register budget
def test_cuda_odd_and_wide_rows(gen, H):
    args = _cuda_case(gen, 5, H, (torch.bfloat16,) * 3, "rows", n_aux=2)
    (x, residual, _, aux, _), (x_ref, residual_ref, _, aux_ref, _) = _run_both(args, slot=1)
    assert_equal(residual, residual_ref, "residual")
    assert_equal(aux, aux_ref, "aux")
    assert rel_err(x, x_ref) <= 4e-3


@pytest.mark.gpu
def test_cuda_out_of_range_rows_write_nan_rows(gen):
    x, residual, weight = _inputs(gen, 8, 256, torch.bfloat16)
    x, residual, weight = x.cuda(), residual.cuda(), weight.cuda()
    r0 = residual.clone()
    x0 = x.clone()
    rows = torch.tensor([0, 8, -1, 7, 2**31 - 1, 3, 3], dtype=torch.int32, device="cuda")
    aux = torch.zeros(7, 256, dtype=torch.bfloat16, device="cuda")
    eagle3_ops.check_errors()
    torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, aux, 0, rows)
    # several bad rows: the error word names one of them (test_contract_capture.py: single violations)
    with pytest.raises(Eagle3InputError, match=r"^add_rmsnorm_capture: rows\[(1|2|4)\] = (8|-1|2147483647) is out"):
        eagle3_ops.check_errors()
    bad = torch.tensor([False, True, True, False, True, False, False])
    assert torch.isnan(aux.cpu()[bad]).all()
    assert_equal(aux.cpu()[~bad], (x0 + r0).cpu()[rows.cpu()[~bad].long()])
    assert_equal(residual.cpu(), (x0 + r0).cpu())  # the fused add + norm itself is unaffected


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_values(gen):
    T, H = 64, KIMI_H
    x, residual, weight = (t.cuda() for t in _inputs(gen, T, H, torch.bfloat16))
    aux = torch.empty(16, 3 * H, dtype=torch.bfloat16, device="cuda")
    rows = torch.randint(0, T, (16,), generator=gen, dtype=torch.int32).cuda()
    graph, _ = capture_graph(lambda: torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, aux, 2, rows))
    for _ in range(3):  # new values at the same addresses
        x.copy_(torch.randn(T, H, generator=gen).bfloat16())
        residual.copy_(torch.randn(T, H, generator=gen).bfloat16())
        rows.copy_(torch.randint(0, T, (16,), generator=gen, dtype=torch.int32))
        poison_(aux)
        cpu = [t.cpu().clone() for t in (x, residual, weight, aux, rows)]
        graph.replay()
        reference.add_rmsnorm_capture(cpu[0], cpu[1], cpu[2], 1e-6, cpu[3], 2, cpu[4])
        assert_equal(residual.cpu(), cpu[1], "residual")
        assert_equal(aux.cpu(), cpu[3], "aux")
        assert rel_err(x.cpu(), cpu[0]) <= 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case, error, match",
    [
        ("aux_dtype", TypeError, "aux must have dtype"),
        ("residual_shape", ValueError, "residual must have shape"),
        ("residual_dtype", TypeError, "residual must have dtype"),
        ("weight_shape", ValueError, "weight must have shape"),
        ("slot", ValueError, "slot must be in"),
        ("rows_dtype", TypeError, "rows must have dtype"),
        ("rows_count", ValueError, "aux must have R"),
        ("x_strided", ValueError, "x must be contiguous in its last dimension"),
        ("eps", ValueError, "eps must be >= 0"),
    ],
)
def test_cuda_bad_input_writes_nothing(gen, case, error, match):
    x, residual, weight = (t.cuda() for t in _inputs(gen, 4, 64, torch.bfloat16))
    aux = poison_(torch.empty(4, 128, dtype=torch.bfloat16, device="cuda"))
    rows, slot, eps = None, 0, 1e-6
    if case == "aux_dtype":
        aux = aux.float()
    elif case == "residual_shape":
        residual = residual[:3]
    elif case == "residual_dtype":
        residual = residual.half()
    elif case == "weight_shape":
        weight = weight[:63]
    elif case == "slot":
        slot = 2
    elif case == "rows_dtype":
        rows = torch.zeros(4, dtype=torch.int16, device="cuda")
    elif case == "rows_count":
        rows = torch.zeros(3, dtype=torch.int64, device="cuda")
    elif case == "x_strided":
        x = torch.empty(4, 128, dtype=torch.bfloat16, device="cuda")[:, ::2]
    elif case == "eps":
        eps = -1.0
    before = [t.clone() for t in (x, residual, aux)]
    with pytest.raises(error, match=match):
        torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, eps, aux, slot, rows)
    for t, b in zip((x, residual, aux), before):
        assert_equal(t.cpu(), b.cpu())
