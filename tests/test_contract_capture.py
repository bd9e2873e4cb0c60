"""capture_aux's and add_rmsnorm_capture's input contract (eagle3_ops/errors.py), and every layout the
references accept on CUDA.

Bad rows: one index out of range (past T, negative, any index with T = 0): the CPU raises the exact message
and writes nothing; CUDA fills that aux row's slot block with NaN, writes the other rows exactly as the
reference, leaves the other column blocks and everything around aux untouched (aux is a view into a
poisoned guard buffer), and records the same message (also from a CUDA-graph replay).

Layouts (CUDA against the reference, inside the same kind of guard buffer): aux as a column view whose
base or row stride is not a multiple of the 16-byte vector, hidden / residual / x as row-strided views with
odd strides or odd base offsets, a misaligned weight, odd H, H = 1 with any last-dimension stride, an fp32
residual beside bf16 x (32-byte residual vectors), fp64, T = 0 and R = 0."""

from __future__ import annotations

import pytest
import torch

import eagle3_ops
from eagle3_ops import reference
from tests.conftest import assert_equal, rel_err
from tests.contract import expect_cpu, expect_cuda, expect_cuda_graph

POISON = -3072.0  # exact in every float dtype, and not NaN: the NaN-filled rows stand out from it


def guarded(rows, cols, dtype, device, left=0, right=0, top=1, bottom=1):
    """A [rows, cols] view into a poisoned buffer with `left` / `right` columns and `top` / `bottom` rows of
    margin. Returns (buffer, view): everything in the buffer outside the view must stay POISON."""
    buf = torch.full((rows + top + bottom, cols + left + right), POISON, dtype=dtype, device=device)
    return buf, buf[top:top + rows, left:left + cols]


def expected_buffer(buf, view, slot, H, values, valid):
    """The guard buffer as it must be after a capture: `values` [R, H] in the view's slot block where
    `valid`, NaN where not, everything else as it was (POISON)."""
    out = torch.full(buf.shape, POISON, dtype=buf.dtype)
    top = (view.data_ptr() - buf.data_ptr()) // buf.element_size() // buf.stride(0)
    left = (view.data_ptr() - buf.data_ptr()) // buf.element_size() % buf.stride(0)
    block = out[top:top + view.shape[0], left + slot * H:left + (slot + 1) * H]
    block[valid] = values[valid].to(buf.dtype)
    block[~valid] = float("nan")
    return out


# ---- bad rows -------------------------------------------------------------------------------------------

# (T, rows, message): one index past T, one negative, any index with T = 0; int32 and int64 rows
BAD_ROWS = {
    "past_T": (13, [0, 12, 5, 5_000_000, 2], "rows[3] = 5000000 is out of range (valid: 0..12)"),
    "negative": (13, [4, -7, 12], "rows[1] = -7 is out of range (valid: 0..12)"),
    "int32_max": (13, [2**31 - 1], "rows[0] = 2147483647 is out of range (valid: 0..12)"),
    "no_tokens": (0, [3], "rows[0] = 3 is out of range (valid: 0..-1)"),
}
H, N_AUX, SLOT = 64, 3, 1


def capture_aux_case(T, rows, rows_dtype, dtype=torch.bfloat16):
    """make(device) -> (call, guard) for capture_aux; check(guard) the CUDA outputs."""

    def inputs(device):
        g = torch.Generator().manual_seed(T + len(rows))
        hidden = torch.randn(T, H, generator=g).to(dtype).to(device)
        residual = torch.randn(T, H, generator=g).to(dtype).to(device)
        buf, aux = guarded(len(rows), N_AUX * H, dtype, device, left=8, right=8)  # 16-byte aligned: vector path
        return hidden, residual, buf, aux, torch.tensor(rows, dtype=rows_dtype, device=device)

    def make(device):
        hidden, residual, buf, aux, r = inputs(device)
        return (lambda: torch.ops.eagle3.capture_aux(hidden, residual, aux, SLOT, r)), (lambda: [buf])

    def check(guard):
        (buf,) = guard
        hidden, residual, ref_buf, aux, r = inputs("cpu")
        valid = (r >= 0) & (r < T)
        values = torch.zeros(len(rows), H, dtype=dtype)
        values[valid] = (hidden + residual)[r[valid].long()]
        assert_equal(buf.cpu(), expected_buffer(ref_buf, aux, SLOT, H, values, valid), "guard buffer")

    return make, check


def add_rmsnorm_case(T, rows, rows_dtype, x_dtype=torch.bfloat16, res_dtype=torch.bfloat16):
    """make(device) -> (call, guard) for add_rmsnorm_capture; check(guard) the CUDA outputs: x and the
    residual as without the bad row, the aux guard buffer as documented."""

    def inputs(device):
        g = torch.Generator().manual_seed(T + 7 * len(rows))
        x = torch.randn(T, H, generator=g).to(x_dtype).to(device)
        residual = (3 * torch.randn(T, H, generator=g)).to(res_dtype).to(device)
        weight = (1 + 0.1 * torch.randn(H, generator=g)).to(x_dtype).to(device)
        buf, aux = guarded(len(rows), N_AUX * H, res_dtype, device, left=8, right=8)
        return x, residual, weight, buf, aux, torch.tensor(rows, dtype=rows_dtype, device=device)

    def make(device):
        x, residual, weight, buf, aux, r = inputs(device)
        call = lambda: torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, aux, SLOT, r)  # noqa: E731
        return call, (lambda: [buf, x, residual])

    def check(guard):
        buf, x, residual = (t.cpu() for t in guard)
        x_ref, res_ref, weight, ref_buf, aux, r = inputs("cpu")
        reference.add_rmsnorm_capture(x_ref, res_ref, weight, 1e-6, None, 0, None)
        assert_equal(residual, res_ref, "residual")
        assert not torch.isnan(x).any() and rel_err(x, x_ref) <= 4e-3, "x"
        valid = (r >= 0) & (r < T)
        values = torch.zeros(len(rows), H, dtype=res_dtype)
        values[valid] = res_ref[r[valid].long()]
        assert_equal(buf, expected_buffer(ref_buf, aux, SLOT, H, values, valid), "guard buffer")

    return make, check


CASES = {"capture_aux": capture_aux_case, "add_rmsnorm_capture": add_rmsnorm_case}
# every op, bad row and rows dtype: (op, make, check, message)
BAD_ROW_CASES = {f"{op}-{bad}-{str(dt)[6:]}": (op, *CASES[op](T, rows, dt), f"{op}: {message}")
                 for op in CASES for bad, (T, rows, message) in BAD_ROWS.items() for dt in (torch.int32, torch.int64)}


@pytest.mark.parametrize("case", list(BAD_ROW_CASES))
def test_bad_row_cpu(case):
    _, make, _, message = BAD_ROW_CASES[case]
    expect_cpu(make, message)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(BAD_ROW_CASES))
def test_bad_row_cuda(case):
    _, make, check, message = BAD_ROW_CASES[case]
    expect_cuda(make, message, check)


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(CASES))
def test_bad_row_cuda_graph(op):
    T, rows, message = BAD_ROWS["past_T"]
    make, _ = CASES[op](T, rows, torch.int32)
    expect_cuda_graph(make, f"{op}: {message}")


@pytest.mark.gpu
def test_bad_row_cuda_fp32_residual():
    # bf16 x beside an fp32 residual stream: the NaN fill and the report on the 32-byte-vector path
    T, rows, message = BAD_ROWS["past_T"]
    make, check = add_rmsnorm_case(T, rows, torch.int64, res_dtype=torch.float32)
    expect_cuda(make, f"add_rmsnorm_capture: {message}", check)


# ---- layouts: CUDA against the reference ----------------------------------------------------------------


def strided(T, H, dtype, device, g, stride_extra=0, offset=0, scale=1.0):
    """A [T, H] row view of a [T, offset + H + stride_extra] buffer: row stride H + offset + stride_extra,
    base `offset` elements in."""
    big = (scale * torch.randn(T, offset + H + stride_extra, generator=g)).to(dtype).to(device)
    return big[:, offset:offset + H]


# name: (T, H, dtype, hidden (offset, stride extra), residual (offset, stride extra), aux (left, right margin))
CAPTURE_LAYOUTS = {
    "aligned_vector_path": (99, 64, torch.bfloat16, (0, 0), (0, 0), (8, 8)),
    "aligned_views": (99, 64, torch.bfloat16, (8, 8), (16, 8), (16, 8)),  # 16-byte offsets and strides: vectors
    "aux_base_misaligned": (7, 64, torch.bfloat16, (0, 0), (0, 0), (3, 5)),  # base 6 bytes off, row stride aligned
    "aux_stride_misaligned": (7, 64, torch.bfloat16, (0, 0), (0, 0), (0, 3)),  # base aligned, row stride odd
    "hidden_odd_stride": (7, 64, torch.bfloat16, (0, 1), (0, 0), (8, 8)),
    "hidden_base_misaligned": (7, 64, torch.bfloat16, (1, 7), (0, 0), (8, 8)),  # 2 bytes off, stride aligned
    "residual_odd_stride": (7, 64, torch.float16, (0, 0), (0, 3), (8, 8)),
    "residual_base_misaligned": (7, 64, torch.float16, (0, 0), (5, 3), (8, 8)),
    "odd_H": (7, 99, torch.float16, (0, 0), (0, 0), (0, 0)),
    "fp32_misaligned": (5, 7168, torch.float32, (2, 2), (2, 2), (2, 2)),  # 8-byte offsets: not 16
    "fp32_kimi": (300, 7168, torch.float32, (0, 0), (4, 4), (4, 4)),  # many rows: the unroll-4 vector path
    "fp64": (5, 64, torch.float64, (1, 1), (1, 1), (1, 1)),
    "fp64_aligned": (5, 64, torch.float64, (0, 0), (2, 0), (2, 2)),
    "H_is_1": (5, 1, torch.bfloat16, (0, 0), (1, 2), (1, 1)),
    "no_tokens": (0, 64, torch.bfloat16, (0, 0), (0, 0), (8, 8)),  # T = 0 without rows: R = 0
}


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("layout", list(CAPTURE_LAYOUTS))
def test_capture_aux_layouts(layout, with_rows, with_residual):
    T, h, dtype, (h_off, h_extra), (r_off, r_extra), (left, right) = CAPTURE_LAYOUTS[layout]
    g = torch.Generator().manual_seed(h + T)
    hidden = strided(T, h, dtype, "cuda", g, h_extra, h_off)
    residual = strided(T, h, dtype, "cuda", g, r_extra, r_off) if with_residual else None
    rows = torch.randint(0, T, (max(1, T // 3),), generator=g).cuda() if with_rows and T else None
    R = T if rows is None else len(rows)
    for slot in range(2):
        buf, aux = guarded(R, 2 * h, dtype, "cuda", left, right)
        torch.ops.eagle3.capture_aux(hidden, residual, aux, slot, rows)
        ref_buf, ref_aux = guarded(R, 2 * h, dtype, "cpu", left, right)
        reference.capture_aux(hidden.cpu(), None if residual is None else residual.cpu(), ref_aux, slot,
                              None if rows is None else rows.cpu())
        assert_equal(buf.cpu(), ref_buf, f"guard buffer, slot {slot}")
    eagle3_ops.check_errors()  # nothing recorded


@pytest.mark.gpu
def test_capture_aux_width_one_any_stride():
    # H = 1: the reference accepts any last-dimension stride (there is no second element)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, generator=g).bfloat16().cuda()[:, ::4]
    residual = torch.randn(6, 3, generator=g).bfloat16().cuda()[:, 1::3]
    assert hidden.shape == (6, 1) and hidden.stride(1) != 1
    buf, aux = guarded(6, 3, torch.bfloat16, "cuda", 1, 1)
    torch.ops.eagle3.capture_aux(hidden, residual, aux, 2, None)
    ref_buf, ref_aux = guarded(6, 3, torch.bfloat16, "cpu", 1, 1)
    reference.capture_aux(hidden.cpu(), residual.cpu(), ref_aux, 2, None)
    assert_equal(buf.cpu(), ref_buf)


@pytest.mark.gpu
def test_capture_aux_no_rows_selected():
    # R = 0 with T > 0: nothing written
    hidden = torch.randn(5, 64, device="cuda").bfloat16()
    buf, aux = guarded(0, 64, torch.bfloat16, "cuda", 8, 8)
    torch.ops.eagle3.capture_aux(hidden, None, aux, 0, torch.zeros(0, dtype=torch.int64, device="cuda"))
    assert bool((buf == POISON).all())
    eagle3_ops.check_errors()


# name: (T, H, x dtype, residual dtype, weight dtype, x (offset, extra), residual (offset, extra), weight offset,
#        aux (left, right))
RMSNORM_LAYOUTS = {
    "aligned_vector_path": (99, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16, (0, 0), (0, 0), 0, (8, 8)),
    "aligned_views_lean": (300, 7168, torch.bfloat16, torch.bfloat16, torch.bfloat16, (8, 8), (16, 8), 8, (8, 16)),
    "x_odd_stride": (7, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16, (0, 1), (0, 0), 0, (8, 8)),
    "x_base_misaligned": (300, 7168, torch.bfloat16, torch.bfloat16, torch.bfloat16, (1, 7), (0, 0), 0, (8, 8)),
    "residual_odd_stride": (7, 64, torch.float16, torch.float16, torch.float16, (0, 0), (0, 3), 0, (8, 8)),
    "residual_base_misaligned": (7, 64, torch.float16, torch.float16, torch.float16, (0, 0), (5, 3), 0, (8, 8)),
    "weight_misaligned": (7, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16, (0, 0), (0, 0), 1, (8, 8)),
    "aux_base_misaligned": (7, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16, (0, 0), (0, 0), 0, (3, 5)),
    "aux_stride_misaligned": (7, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16, (0, 0), (0, 0), 0, (0, 3)),
    "odd_H": (7, 99, torch.bfloat16, torch.bfloat16, torch.bfloat16, (0, 0), (0, 0), 0, (0, 0)),
    # bf16 x beside an fp32 residual: residual, aux and an fp32 weight are read in 32-byte vectors
    "fp32_residual": (99, 64, torch.bfloat16, torch.float32, torch.float32, (0, 0), (0, 0), 0, (8, 8)),
    "fp32_residual_16_not_32": (99, 64, torch.bfloat16, torch.float32, torch.float32, (0, 0), (4, 4), 4, (4, 4)),
    "fp32_residual_odd": (300, 7168, torch.bfloat16, torch.float32, torch.bfloat16, (0, 8), (1, 1), 0, (1, 1)),
    "fp32_residual_fp16_x": (5, 64, torch.float16, torch.float32, torch.float16, (8, 8), (8, 8), 8, (8, 8)),
    "fp64_misaligned": (5, 64, torch.float64, torch.float32, torch.float64, (1, 1), (1, 1), 1, (1, 1)),
    "fp32_x_misaligned": (5, 7168, torch.float32, torch.float32, torch.float32, (2, 2), (1, 0), 2, (2, 2)),
    "H_is_1": (5, 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, (0, 0), (0, 0), 0, (1, 1)),
    "no_tokens": (0, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16, (0, 0), (0, 0), 0, (8, 8)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("capture", ["all", "rows", "off"])
@pytest.mark.parametrize("layout", list(RMSNORM_LAYOUTS))
def test_add_rmsnorm_capture_layouts(layout, capture):
    T, h, x_dt, r_dt, w_dt, (x_off, x_extra), (r_off, r_extra), w_off, (left, right) = RMSNORM_LAYOUTS[layout]
    if capture == "rows" and T == 0:
        pytest.skip("rows with T = 0 are all out of range: test_bad_row_cuda[add_rmsnorm_capture-no_tokens-*]")
    g = torch.Generator().manual_seed(h + 3 * T)
    x = strided(T, h, x_dt, "cuda", g, x_extra, x_off)
    residual = strided(T, h, r_dt, "cuda", g, r_extra, r_off, scale=3.0)
    weight = (1 + 0.1 * torch.randn(w_off + h, generator=g)).to(w_dt).cuda()[w_off:]
    rows = torch.randint(0, T, (T // 3 + 2,), generator=g).cuda() if capture == "rows" else None
    R = T if rows is None else len(rows)
    buf, aux = guarded(R, 2 * h, r_dt, "cuda", left, right)
    ref_buf, ref_aux = guarded(R, 2 * h, r_dt, "cpu", left, right)
    x_ref, res_ref = x.cpu().clone(), residual.cpu().clone()
    torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, None if capture == "off" else aux, 1, rows)
    reference.add_rmsnorm_capture(x_ref, res_ref, weight.cpu(), 1e-6, None if capture == "off" else ref_aux, 1,
                                  None if rows is None else rows.cpu())
    assert_equal(residual.cpu(), res_ref, "residual")
    assert_equal(buf.cpu(), ref_buf, "aux guard buffer")
    if T:
        tol = {torch.float64: 1e-14, torch.float32: 1e-6}.get(x_dt, 4e-3)
        assert not torch.isnan(x.cpu()).any() and rel_err(x.cpu(), x_ref) <= tol, f"x: {rel_err(x.cpu(), x_ref):.3g}"
    eagle3_ops.check_errors()  # nothing recorded


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5])
def test_add_rmsnorm_capture_no_rows_selected(T):
    # R = 0 rows (an empty rows tensor, whose data pointer is null): nothing captured, x and residual as usual.
    # The H200 fuzz test found this writing token rows past the empty aux view into the caller's buffer.
    g = torch.Generator().manual_seed(7)
    x, residual = torch.randn(T, 64, generator=g).double(), torch.randn(T, 64, generator=g).double()
    weight = torch.ones(64, dtype=torch.float64)
    buf, aux = guarded(0, 64, torch.float64, "cuda", 8, 8)
    xc, rc = x.cuda(), residual.cuda()
    torch.ops.eagle3.add_rmsnorm_capture(xc, rc, weight.cuda(), 1e-6, aux, 0,
                                         torch.empty(0, dtype=torch.int32, device="cuda"))
    assert bool((buf == POISON).all()), "the guard buffer around an empty aux view was written"
    reference.add_rmsnorm_capture(x, residual, weight, 1e-6, None, 0, None)
    assert_equal(rc.cpu(), residual, "residual")
    eagle3_ops.check_errors()


@pytest.mark.gpu
def test_add_rmsnorm_capture_views_leave_their_buffers_alone():
    # x and residual as row views: the columns between the rows (the views' padding) stay as they were
    g = torch.Generator().manual_seed(5)
    T, h = 7, 64
    x_big = torch.randn(T, h + 5, generator=g).bfloat16().cuda()
    r_big = torch.randn(T, h + 3, generator=g).float().cuda()
    x_pad, r_pad = x_big[:, h:].clone(), r_big[:, :3].clone()
    weight = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    torch.ops.eagle3.add_rmsnorm_capture(x_big[:, :h], r_big[:, 3:], weight, 1e-6, None, 0, None)
    assert_equal(x_big[:, h:].cpu(), x_pad.cpu(), "x padding")
    assert_equal(r_big[:, :3].cpu(), r_pad.cpu(), "residual padding")


@pytest.mark.gpu
def test_add_rmsnorm_capture_width_one_any_stride():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, generator=g).bfloat16().cuda()[:, 1::4]
    residual = torch.randn(6, 2, generator=g).bfloat16().cuda()[:, ::2]
    assert x.shape == residual.shape == (6, 1) and x.stride(1) != 1
    weight = torch.full((1,), 0.5, dtype=torch.bfloat16, device="cuda")
    buf, aux = guarded(6, 2, torch.bfloat16, "cuda", 1, 1)
    x_ref, res_ref = x.cpu().clone(), residual.cpu().clone()
    ref_buf, ref_aux = guarded(6, 2, torch.bfloat16, "cpu", 1, 1)
    torch.ops.eagle3.add_rmsnorm_capture(x, residual, weight, 1e-6, aux, 1, None)
    reference.add_rmsnorm_capture(x_ref, res_ref, weight.cpu(), 1e-6, ref_aux, 1, None)
    assert_equal(residual.cpu(), res_ref, "residual")
    assert_equal(buf.cpu(), ref_buf, "aux guard buffer")
    assert rel_err(x.cpu(), x_ref) <= 4e-3
