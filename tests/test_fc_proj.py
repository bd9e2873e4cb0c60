"""fc_proj: the drafter's fc [T, n_aux * H] -> [T, Hd], against a float64 formula written independently of
the reference (explicit loops over the H-wide chunks, then F.linear), over every norm mode, fp8 weights,
row gathers, strided aux and odd sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TOLERANCES, assert_equal, poison_, rel_err

FP8 = getattr(torch, "float8_e4m3fn", None)


def _truth64(aux, weight, weight_scale, norm_weight, eps, norm_mode, rows, n_aux=3):
    """float64: gather, normalise chunk by chunk (one chunk for norm_before_fc), then F.linear."""
    a = aux.double()
    if rows is not None:
        a = torch.stack([a[int(r)] for r in rows])
    K = a.shape[1]
    if norm_mode != "none":
        n = 1 if norm_mode == "norm_before_fc" else n_aux
        g = None if norm_weight is None else norm_weight.double().reshape(K)
        step = K // n
        pieces = []
        for c in range(n):
            piece = a[:, c * step:(c + 1) * step]
            ms = (piece ** 2).sum(dim=1, keepdim=True) / step
            piece = piece / torch.sqrt(ms + eps)
            if g is not None:
                piece = piece * g[c * step:(c + 1) * step]
            pieces.append(piece)
        a = torch.cat(pieces, dim=1)
    w = weight.double()
    if weight_scale is not None:
        w = torch.diag(weight_scale.double()) @ w
    return F.linear(a, w)


def _make(gen, T, H, Hd, dtype, n_aux=3):
    aux = (2 * torch.randn(T, n_aux * H, generator=gen)).to(dtype)
    weight = (torch.randn(Hd, n_aux * H, generator=gen) / (n_aux * H) ** 0.5).to(dtype)
    return aux, weight


def _run(aux, weight, weight_scale, norm_weight, eps, norm_mode, rows, out_dtype):
    R = aux.shape[0] if rows is None else rows.shape[0]
    out = poison_(torch.empty(R, weight.shape[0], dtype=out_dtype))
    torch.ops.eagle3.fc_proj(aux, weight, weight_scale, norm_weight, eps, norm_mode, rows, out)
    assert not torch.isnan(out).any(), "out not fully written"
    return out


def _check(out, ref, what=""):
    err = rel_err(out, ref)
    assert err <= TOLERANCES[out.dtype], f"{what}: rel err {err:.3g} > {TOLERANCES[out.dtype]}"


def test_hand_worked_fc_norm():
    # n_aux = 2, H = 2, eps = 0: chunk [2, 2] has rms 2 -> [1, 1]; chunk [-1, 1] has rms 1 -> [-1, 1] (exact).
    aux = torch.tensor([[2.0, 2.0, -1.0, 1.0]])
    norm_weight = torch.tensor([[1.0, 2.0], [3.0, 0.5]])
    weight = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    out = torch.empty(1, 3)
    torch.ops.eagle3.fc_proj(aux, weight, None, norm_weight, 0.0, "fc_norm", None, out)
    # normed: [1, 1] * [1, 2] = [1, 2]; [-1, 1] * [3, 0.5] = [-3, 0.5]
    assert_equal(out, torch.tensor([[1.0, 2.0 - 3.0 + 0.5, 1.0 + 2.0 - 3.0 + 0.5]]))


@pytest.mark.parametrize("norm_mode, with_weight", [("none", False), ("norm_before_fc", False),
                                                    ("norm_before_fc", True), ("fc_norm", True)])
@pytest.mark.parametrize("T", [1, 3, 99])  # decode, odd, a prefill chunk
@pytest.mark.parametrize("Hd", [1, 17])  # a single output channel, an odd width
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_norm_modes_against_float64(gen, norm_mode, with_weight, T, Hd, dtype):
    H = 24
    aux, weight = _make(gen, T, H, Hd, dtype)
    norm_weight = None
    if with_weight:
        shape = (3, H) if norm_mode == "fc_norm" else (3 * H,)
        norm_weight = (1 + 0.2 * torch.randn(*shape, generator=gen)).to(dtype)
    out = _run(aux, weight, None, norm_weight, 1e-6, norm_mode, None, dtype)
    _check(out, _truth64(aux, weight, None, norm_weight, 1e-6, norm_mode, None), norm_mode)


def test_fc_norm_differs_from_norm_before_fc(gen):
    # Chunks of very different scale: the per-chunk norm and the whole-row norm must not agree.
    aux, weight = _make(gen, 4, 8, 5, torch.float32)
    aux[:, :8] *= 100
    ones = torch.ones(3, 8)
    a = _run(aux, weight, None, ones, 1e-6, "fc_norm", None, torch.float32)
    b = _run(aux, weight, None, None, 1e-6, "norm_before_fc", None, torch.float32)
    assert rel_err(a, b) > 0.1


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_out_dtype_differs_from_aux(gen, out_dtype):
    aux, weight = _make(gen, 7, 16, 9, torch.bfloat16)
    out = _run(aux, weight, None, None, 1e-6, "norm_before_fc", None, out_dtype)
    _check(out, _truth64(aux, weight, None, None, 1e-6, "norm_before_fc", None))


def test_float64_inputs(gen):
    aux, weight = _make(gen, 5, 10, 7, torch.float64)
    norm_weight = 1 + 0.1 * torch.randn(3, 10, generator=gen, dtype=torch.float64)
    out = _run(aux, weight, None, norm_weight, 1e-5, "fc_norm", None, torch.float64)
    _check(out, _truth64(aux, weight, None, norm_weight, 1e-5, "fc_norm", None))


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("norm_mode", ["none", "fc_norm"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_weight_with_per_channel_scale(gen, norm_mode, out_dtype):
    T, H, Hd = 9, 32, 17
    aux, w = _make(gen, T, H, Hd, torch.float32)
    w[3] *= 50  # channels of very different magnitude: a per-tensor scale would not do
    scale = (w.abs().amax(dim=1) / 448).float()  # e4m3's largest finite value
    w8 = (w / scale[:, None]).to(FP8)
    norm_weight = torch.ones(3, H) if norm_mode == "fc_norm" else None
    out = _run(aux.to(out_dtype), w8, scale, norm_weight, 1e-6, norm_mode, None, out_dtype)
    # The truth dequantises the same fp8 values: only the rounding of the output is allowed.
    _check(out, _truth64(aux.to(out_dtype), w8, scale, norm_weight, 1e-6, norm_mode, None), "fp8")
    # ... and it is close to the unquantised projection (e4m3 keeps 3 mantissa bits)
    assert rel_err(out, _truth64(aux, w, None, norm_weight, 1e-6, norm_mode, None)) < 0.1


def test_fp8_weight_needs_scale(gen):
    aux, w = _make(gen, 2, 8, 3, torch.float32)
    out = poison_(torch.empty(2, 3))
    with pytest.raises(ValueError, match="weight_scale"):
        torch.ops.eagle3.fc_proj(aux, w.to(FP8), None, None, 1e-6, "none", None, out)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("rows", [[0], [98, 0, 50, 50, 7], list(range(98, -1, -1))])  # one, repeated, reversed
@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64])
def test_rows_gather_equals_projecting_gathered_rows(gen, rows, rows_dtype):
    T, H, Hd = 99, 16, 11
    aux, weight = _make(gen, T, H, Hd, torch.float32)
    norm_weight = 1 + 0.1 * torch.randn(3, H, generator=gen)
    idx = torch.tensor(rows, dtype=rows_dtype)
    got = _run(aux, weight, None, norm_weight, 1e-6, "fc_norm", idx, torch.float32)
    gathered = _run(aux[idx.long()].contiguous(), weight, None, norm_weight, 1e-6, "fc_norm", None, torch.float32)
    full = _run(aux, weight, None, norm_weight, 1e-6, "fc_norm", None, torch.float32)
    _check(got, gathered, "rows vs aux[rows]")
    _check(got, full[idx.long()], "rows vs full[rows]")
    _check(got, _truth64(aux, weight, None, norm_weight, 1e-6, "fc_norm", idx))


@pytest.mark.parametrize("norm_mode", ["none", "norm_before_fc", "fc_norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: no upcast copy hides the strides
def test_strided_aux(gen, norm_mode, dtype):
    # aux as a column slice of a wider buffer (a capture buffer with padding / other columns): row stride
    # larger than n_aux * H, last dim contiguous.
    T, H, Hd = 13, 20, 9
    wide = torch.randn(T, 3 * H + 11, generator=gen).to(dtype)
    aux = wide[:, 5:5 + 3 * H]
    assert not aux.is_contiguous() and aux.stride(-1) == 1
    _, weight = _make(gen, T, H, Hd, dtype)
    norm_weight = (torch.rand(3, H, generator=gen) + 0.5).to(dtype) if norm_mode == "fc_norm" else None
    rows = torch.tensor([12, 3, 3], dtype=torch.int32)
    for r in (None, rows):
        out = _run(aux, weight, None, norm_weight, 1e-6, norm_mode, r, dtype)
        dense = _run(aux.contiguous(), weight, None, norm_weight, 1e-6, norm_mode, r, dtype)
        assert_equal(out, dense, "strided vs contiguous aux")
        _check(out, _truth64(aux, weight, None, norm_weight, 1e-6, norm_mode, r))


@pytest.mark.parametrize("H", [1, 17, 7168])  # one-wide chunks, odd, Kimi (21504 -> few channels)
def test_odd_and_kimi_widths(gen, H):
    T, Hd = 3, 17
    aux, weight = _make(gen, T, H, Hd, torch.bfloat16)
    norm_weight = (1 + 0.1 * torch.randn(3, H, generator=gen)).bfloat16()
    out = _run(aux, weight, None, norm_weight, 1e-6, "fc_norm", None, torch.bfloat16)
    _check(out, _truth64(aux, weight, None, norm_weight, 1e-6, "fc_norm", None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_fc_norm_equals_unfolded(gen, dtype):
    # Issue 4's prepared weight: fold the per-chunk norm weights into the fc's columns and pass ones.
    T, H, Hd = 7, 32, 19
    aux, weight = _make(gen, T, H, Hd, torch.float32)
    g = 1 + 0.3 * torch.randn(3, H, generator=gen)
    folded = (weight * g.reshape(1, 3 * H))
    aux, weight, folded, g = aux.to(dtype), weight.to(dtype), folded.to(dtype), g.to(dtype)
    unfolded_out = _run(aux, weight, None, g, 1e-6, "fc_norm", None, dtype)
    folded_out = _run(aux, folded, None, torch.ones(3, H, dtype=dtype), 1e-6, "fc_norm", None, dtype)
    tol = TOLERANCES[dtype] if dtype == torch.float32 else 2 * TOLERANCES[dtype]  # folding rounds the weight
    assert rel_err(folded_out, unfolded_out) <= tol
    _check(unfolded_out, _truth64(aux, weight, None, g, 1e-6, "fc_norm", None))


def test_fc_norm_n_aux_comes_from_norm_weight(gen):
    # The same K = 48 row split into 2 chunks of 24 or 4 of 12: the chunking follows norm_weight's shape.
    aux, weight = _make(gen, 5, 24, 6, torch.float32, n_aux=2)
    for n in (2, 4):
        nw = torch.ones(n, 48 // n)
        out = _run(aux, weight, None, nw, 1e-6, "fc_norm", None, torch.float32)
        _check(out, _truth64(aux, weight, None, nw, 1e-6, "fc_norm", None, n_aux=n), f"n_aux {n}")
