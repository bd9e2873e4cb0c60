"""fc_proj: the drafter's fc [T, n_aux * H] -> [T, Hd], against a float64 formula written independently of
the reference (explicit loops over the H-wide chunks, then F.linear), over every norm mode, fp8 weights,
row gathers, strided aux and odd sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import eagle3_ops
from eagle3_ops.errors import Eagle3InputError
from tests.conftest import TOLERANCES, assert_equal, capture_graph, poison_, rel_err

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


# ---- the Triton kernels: under the interpreter (CI, fp16/fp32) and on the GPU ---------------------------

INTERPRET = __import__("os").environ.get("TRITON_INTERPRET") == "1"
CASES = [  # (T, R rows or None, H, Hd, norm_mode)
    (1, None, 40, 24, "none"), (3, None, 40, 24, "fc_norm"), (17, 5, 40, 72, "norm_before_fc"),
    (6, 9, 33, 17, "fc_norm"), (5, None, 48, 130, "none"),
]


def _norm_weight(gen, norm_mode, n_aux, H, dtype):
    if norm_mode == "fc_norm":
        return (1 + 0.2 * torch.randn(n_aux, H, generator=gen)).to(dtype)
    if norm_mode == "norm_before_fc":
        return (1 + 0.2 * torch.randn(n_aux * H, generator=gen)).to(dtype)
    return None


def _validate_fc(*args):
    from eagle3_ops._validate import fc_proj as check

    check(*args)


def _triton_fc(*args, config=None, prefill=False):
    """The Triton launcher, checked as the op checks; config: _fc_proj's tiles; prefill: cuBLAS / the tiled GEMM
    at any R (stream_max_rows 0)."""
    from eagle3_ops.triton_kernels import fc_proj as kernels

    _validate_fc(*args)
    kernels._fc_proj(*args, config=config, stream_max_rows=0 if prefill else kernels.STREAM_MAX_ROWS)


# The stream-K kernel through _fc_proj's config: tiles small enough (2 programs per "SM", 2 interpreter SMs)
# that program ranges start and end inside n-blocks and chunks; TMA only where K's rows are 16-byte aligned.
PERSISTENT = {"persistent": "16,16,0,4,2,2", "persistent-tma": "32,32,0,4,2,3,1"}


@pytest.mark.skipif(not INTERPRET, reason="the Triton interpreter runs the kernels on CPU tensors")
@pytest.mark.parametrize("T,R,H,Hd,norm_mode", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("path", ["stream", "tiled", "cublas", *PERSISTENT])
def test_triton_interpreted(gen, T, R, H, Hd, norm_mode, dtype, path):
    aux, weight = _make(gen, T, H, Hd, dtype)
    scale = (0.5 + torch.rand(Hd, generator=gen)) if path in ("tiled", "persistent-tma") else None
    nw = _norm_weight(gen, norm_mode, 3, H, dtype)
    rows = None if R is None else torch.randint(0, T, (R,), generator=gen, dtype=torch.int32)
    out = poison_(torch.empty(R or T, Hd, dtype=dtype))
    # (tiled, cublas: the prefill paths at small sizes)
    _triton_fc(aux, weight, scale, nw, 1e-6, norm_mode, rows, out, config=PERSISTENT.get(path),
               prefill=path in ("tiled", "cublas"))
    _check(out, _truth64(aux, weight, scale, nw, 1e-6, norm_mode, rows), f"{path} {norm_mode}")


@pytest.mark.skipif(not INTERPRET or FP8 is None, reason="the Triton interpreter runs the kernels on CPU tensors")
@pytest.mark.parametrize("norm_mode", ["none", "norm_before_fc", "fc_norm"])
@pytest.mark.parametrize("path", ["persistent", "persistent-tma"])
def test_triton_interpreted_fp8_weight_bf16_rows(gen, norm_mode, path):
    # fp8 weight, bf16 rows (the fp16 dot: rows scaled by 2^-8 into fp16 in the loop, undone after it) through the
    # stream-K kernel, with and without TMA weight boxes; an out-of-range row index gives a NaN row and is reported.
    T, H, Hd = 20, 32, 40
    aux, w = _make(gen, T, H, Hd, torch.float32)
    scale = (w.abs().amax(dim=1) / 448).float()
    w8 = (w / scale[:, None]).to(FP8)
    aux = aux.to(torch.bfloat16)
    nw = _norm_weight(gen, norm_mode, 3, H, torch.bfloat16)
    rows = torch.randint(0, T, (24,), generator=gen, dtype=torch.int32)
    rows[5] = T  # out of range
    out = poison_(torch.empty(24, Hd))
    _triton_fc(aux, w8, scale, nw, 1e-6, norm_mode, rows, out, config=PERSISTENT[path])
    with pytest.raises(Eagle3InputError, match=r"^fc_proj: rows\[5\] = 20 is out of range \(valid: 0\.\.19\)$"):
        eagle3_ops.check_errors("cpu")
    assert torch.isnan(out[5]).all()
    good = torch.arange(24) != 5
    err = rel_err(out[good], _truth64(aux, w8, scale, nw, 1e-6, norm_mode, rows[good]))
    assert err <= TOLERANCES[torch.bfloat16], f"{path} {norm_mode}: rel err {err:.3g}"  # bf16 rule (out is fp32)


@pytest.mark.parametrize("config, fields", [("64,128,4,4,4", (64, 128, 4, 4, 4, 0, 0)),
                                            ("64,128,0,4,3,3", (64, 128, 0, 4, 3, 3, 0)),
                                            ("64,128,0,4,3,3,1", (64, 128, 0, 4, 3, 3, 1))])
def test_config_override_fields(config, fields):
    """5, 6 and 7 fields parse (the H200 sweep's stream-K candidates failed with a bare "too many values to
    unpack (expected 5)" where an fc_proj.py older than the PER_SM/TMA fields was imported); 6+ selects
    the persistent kernel."""
    pytest.importorskip("triton")
    from eagle3_ops.triton_kernels import fc_proj as kernels

    assert kernels.parse_override(config) == fields
    cfg = kernels.stream_config(1, 7168, 21504, 1, torch.empty(0, dtype=torch.bfloat16), override=config)
    assert (cfg["BLOCK_N"], cfg["num_stages"], cfg["per_sm"], cfg["tma"]) == (fields[0], fields[4], *fields[5:])
    for bad in ("64,128,4,4", "64,128,0,4,3,3,1,9"):
        with pytest.raises(ValueError, match="expected 5 to 7"):
            kernels.parse_override(bad)


# the message of either bad index in rows [_, T, -1, _] (a GPU reports the one a program found first)
BAD_ROWS = r"^fc_proj: rows\[(1\] = {T}|2\] = -1) is out of range \(valid: 0\.\.{T_1}\)$"


@pytest.mark.skipif(not INTERPRET, reason="the Triton interpreter runs the kernels on CPU tensors")
@pytest.mark.parametrize("path", ["stream", "persistent"])
def test_triton_interpreted_out_of_range_rows_give_nan_rows(gen, path):
    aux, weight = _make(gen, 4, 16, 8, torch.float32)
    rows = torch.tensor([3, 4, -1, 0])
    out = poison_(torch.empty(4, 8))
    from eagle3_ops.triton_kernels import fc_proj as kernels
    kernels._fc_proj(aux, weight, None, torch.ones(3, 16), 1e-6, "fc_norm", rows, out, config=PERSISTENT.get(path))
    with pytest.raises(Eagle3InputError, match=BAD_ROWS.format(T=4, T_1=3)):  # either bad index, as a program found it
        eagle3_ops.check_errors("cpu")
    assert torch.isnan(out[1:3]).all()
    good = torch.tensor([0, 3])
    _check(out[good], _truth64(aux, weight, None, None, 1e-6, "fc_norm", rows[good]))


# ---- an fp8 weight at R >= FP8_MM_MIN_ROWS: the rows quantised to e4m3 (one Triton kernel), torch._scaled_mm ------

FP8_MM_MIN_ROWS = 16  # triton_kernels/fc_proj.py's (the module needs triton; this file runs without it)


@pytest.fixture(autouse=True)
def _fp8_mm_on(monkeypatch):
    """This file's fp8 cases at R >= 16 expect _fp8_mm: the op takes it only when EAGLE3_FC_FP8_MM asks (off by
    default), so it is turned on here as that variable would (tests/test_contract_fc.py and the fuzz test run the
    default)."""
    try:
        from eagle3_ops.triton_kernels import fc_proj as kernels
    except ImportError:  # no triton: nothing launches the kernels here
        return
    monkeypatch.setattr(kernels, "FP8_MM_FROM", FP8_MM_MIN_ROWS)
FP8_ACT_RULE = 0.04  # rel err from the unquantised product, Gaussian rows: e4m3 rounding measured at 2.5-2.9%


def _quantised_rows(aux, norm_weight, eps, norm_mode, rows, n_aux=3):
    """(e4m3 rows [R, K], fp32 scales [R, 1]) as _fp8_mm makes them: norm(aux[rows]) * nw in fp32, each row times
    448 / max(amax, 1e-30) rounded by torch's cast (to nearest even), its scale amax / 448."""
    a = (aux if rows is None else aux[rows.long()]).float()
    if norm_mode != "none":
        n = 1 if norm_mode == "norm_before_fc" else n_aux
        c = a.view(a.shape[0], n, -1)
        a = (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)).reshape(a.shape)
    if norm_weight is not None:
        a = a * norm_weight.float().reshape(1, -1)
    amax = a.abs().amax(1, keepdim=True).clamp_min(1e-30)
    return (a * (448 / amax)).to(FP8), amax / 448


def _check_fp8_mm(out, aux, w8, scale, norm_weight, eps, norm_mode, rows, what, n_aux=3):
    """The fp8 rule: out is the float64 product of the rows quantised as _quantised_rows does (within the bf16
    rule: the output's rounding, and a rare e4m3 step where the kernel's fp32 rsqrt / product order rounds the other
    way), and within FP8_ACT_RULE of the unquantised reference."""
    q8, qs = _quantised_rows(aux, norm_weight, eps, norm_mode, rows, n_aux)
    truth_q = F.linear(q8.double() * qs.double(), w8.double() * scale.double()[:, None])
    err = rel_err(out, truth_q)
    assert err <= TOLERANCES[torch.bfloat16], f"{what}: rel err {err:.3g} from the quantised rows' product"
    truth = _truth64(aux, w8.float(), scale, norm_weight, eps, norm_mode, None if rows is None else rows.cpu(), n_aux)
    err = rel_err(out, truth)  # (on the inputs' device: float64 on the GPU at Kimi's shape)
    assert err <= FP8_ACT_RULE, f"{what}: rel err {err:.3g} from the unquantised reference > {FP8_ACT_RULE}"


def _fp8_case(gen, T, H, Hd, dtype, norm_mode, device="cpu"):
    aux, w = _make(gen, T, H, Hd, torch.float32)
    scale = (w.abs().amax(dim=1) / 448).float()
    w8 = (w / scale[:, None]).to(FP8)
    nw = _norm_weight(gen, norm_mode, 3, H, dtype)
    return (aux.to(dtype).to(device), w8.to(device), scale.to(device), None if nw is None else nw.to(device))


@pytest.mark.skipif(not INTERPRET or FP8 is None, reason="the Triton interpreter runs the kernels on CPU tensors")
@pytest.mark.parametrize("norm_mode", ["none", "norm_before_fc", "fc_norm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
# 16: the two-pass kernel, a chunk of 40 columns in three blocks, the last partial; None: the row in one tile
@pytest.mark.parametrize("block", [16, None])
def test_triton_interpreted_fp8_quantised_rows(gen, norm_mode, dtype, block):
    # _quant_rows_kernel alone: gathered rows (repeated, one out of range), strided aux, per-chunk norms; its
    # scales equal amax / 448 of the fp32 rows, its e4m3 values torch's rounding of the same products (the
    # kernel's own rounding, _round_e4m3: the interpreter's cast gets the carries wrong)
    from eagle3_ops.triton_kernels import fc_proj as kernels

    T, H = 21, 40
    wide = (2 * torch.randn(T, 3 * H + 5, generator=gen)).to(dtype)
    aux = wide[:, 5:]
    nw = _norm_weight(gen, norm_mode, 3, H, dtype)
    rows = torch.tensor([20, 3, 3, 0, T, 7], dtype=torch.int32)
    err = eagle3_ops.errors.error_word(aux.device)
    cfg = kernels.QUANT_CONFIG if block is None else (block, 4)
    q8, qs = kernels.quantised_rows(aux, None if nw is None else nw.reshape(-1), 1e-6, kernels._NORM_CODE[norm_mode],
                                    3 if norm_mode == "fc_norm" else 1, rows, 6, err, cfg)
    assert float(qs[6]) == 1.0  # torch._scaled_mm's unit per-tensor scale
    qs = qs[:6]
    with pytest.raises(Eagle3InputError, match=r"^fc_proj: rows\[4\] = 21 is out of range \(valid: 0\.\.20\)$"):
        eagle3_ops.check_errors("cpu")
    assert torch.isnan(qs[4]).all()
    good = torch.arange(6) != 4
    want8, want_s = _quantised_rows(aux, nw, 1e-6, norm_mode, rows[good])
    assert float((qs[good] / want_s - 1).abs().max()) <= 1e-6
    got, want = q8[good].float(), want8.float()
    off = got != want  # a product on the other side of a rounding boundary: one e4m3 step at most, rarely
    assert int(off.sum()) <= 0.01 * off.numel(), f"{int(off.sum())} of {off.numel()} e4m3 values differ"
    assert bool(((got - want).abs() <= want.abs() / 8 + 2**-9)[off].all())
    assert float(want.abs().amax()) == 448.0  # each row's largest value lands on e4m3's largest


@pytest.mark.skipif(not INTERPRET or FP8 is None, reason="the Triton interpreter runs the kernels on CPU tensors")
@pytest.mark.parametrize("norm_mode", ["none", "fc_norm"])
@pytest.mark.parametrize("R", [15, 16, 70])  # below the fp8 matmul's threshold (stream-K), at it, a prefill size
@pytest.mark.parametrize("strided_out", [False, True])
@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_triton_interpreted_fp8_mm(gen, monkeypatch, norm_mode, R, strided_out, mode):
    # the whole launcher on CPU tensors (torch._scaled_mm has a CPU kernel): R >= 16 rows of an fp8 weight with a
    # bf16 out take _fp8_mm, quantised activations and the fp8 rule; 15 rows the stream-K kernel and the bf16 rule;
    # a strided out is written at its stride (tensorwise) or through a temporary (rowwise); a bad row index gives a
    # NaN row, reported
    from eagle3_ops.triton_kernels import fc_proj as kernels

    calls = []
    real = kernels._fp8_mm
    monkeypatch.setattr(kernels, "_fp8_mm", lambda *a: calls.append(1) or real(*a))
    T, H, Hd = 30, 32, 48
    aux, w8, scale, nw = _fp8_case(gen, T, H, Hd, torch.float32, norm_mode)
    rows = torch.randint(0, T, (R,), generator=gen)
    rows[R // 2] = -1
    buf = torch.full((R, Hd + 16), -777.0, dtype=torch.bfloat16)
    out = poison_(buf[:, 8:8 + Hd] if strided_out else buf[:, :Hd].contiguous())
    _validate_fc(aux, w8, scale, nw, 1e-6, norm_mode, rows, out)
    kernels._fc_proj(aux, w8, scale, nw, 1e-6, norm_mode, rows, out, fp8_mm_mode=mode)
    with pytest.raises(Eagle3InputError, match=rf"^fc_proj: rows\[{R // 2}\] = -1 is out of range"):
        eagle3_ops.check_errors("cpu")
    assert len(calls) == (R >= kernels.FP8_MM_MIN_ROWS)
    assert torch.isnan(out[R // 2].float()).all()
    good = torch.arange(R) != R // 2
    if calls:
        _check_fp8_mm(out[good], aux, w8, scale, nw, 1e-6, norm_mode, rows[good], f"R {R} {norm_mode}")
    else:
        _check(out[good], _truth64(aux, w8.float(), scale, nw, 1e-6, norm_mode, rows[good]), f"R {R} {norm_mode}")
    if strided_out:
        assert bool((buf[:, :8] == -777).all() and (buf[:, 8 + Hd:] == -777).all()), "written outside out"


KIMI_H, KIMI_HD = 7168, 7168


def _gpu_case(gen, T, R, norm_mode, wdt, strided):
    """Kimi-shaped inputs made on the GPU (a 7168 x 21504 weight per case), with a CUDA generator seeded from gen."""
    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    dtype = torch.bfloat16
    aux_full = (2 * torch.randn(T, 3 * KIMI_H + (64 if strided else 0), generator=g, device="cuda")).to(dtype)
    aux = aux_full[:, 64:] if strided else aux_full
    w = torch.randn(KIMI_HD, 3 * KIMI_H, generator=g, device="cuda") / (3 * KIMI_H) ** 0.5
    scale = None
    if wdt == "fp8":
        scale = w.abs().amax(dim=1) / 448.0
        w = (w / scale[:, None]).to(FP8)
    else:
        w = w.to(dtype)
    nw = _norm_weight(gen, norm_mode, 3, KIMI_H, dtype)
    nw = None if nw is None else nw.cuda()
    rows = None if R is None else torch.randint(0, T, (R,), generator=g, device="cuda")
    return aux, w, scale, nw, rows


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 64, 99, 4096])
@pytest.mark.parametrize("norm_mode", ["none", "norm_before_fc", "fc_norm"])
@pytest.mark.parametrize("wdt", ["bf16", "fp8"])
@pytest.mark.parametrize("with_rows", [False, True])
def test_cuda_kimi_shape_against_float64(gen, T, norm_mode, wdt, with_rows):
    R = (T // 2 + 1) if with_rows else None
    aux, w, scale, nw, rows = _gpu_case(gen, T, R, norm_mode, wdt, strided=T in (3, 99))
    out = poison_(torch.empty(R or T, KIMI_HD, dtype=torch.bfloat16, device="cuda"))
    torch.ops.eagle3.fc_proj(aux, w, scale, nw, 1e-6, norm_mode, rows, out)
    truth = _truth64(aux, w.float(), scale, nw, 1e-6, norm_mode, None if rows is None else rows.cpu())  # on the GPU
    if wdt == "fp8" and (R or T) >= FP8_MM_MIN_ROWS:  # activations quantised (_fp8_mm): the fp8 rule
        _check_fp8_mm(out, aux, w, scale, nw, 1e-6, norm_mode, rows, f"T={T} {norm_mode} fp8")
    else:
        _check(out, truth, f"T={T} {norm_mode} {wdt}")


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [5, 300])
def test_cuda_out_dtype_and_fp32(gen, out_dtype, T):
    aux, w = _make(gen, T, 96, 80, torch.float32)
    nw = _norm_weight(gen, "fc_norm", 3, 96, torch.float32)
    out = poison_(torch.empty(T, 80, dtype=out_dtype, device="cuda"))
    torch.ops.eagle3.fc_proj(aux.cuda(), w.cuda(), None, nw.cuda(), 1e-6, "fc_norm", None, out)
    _check(out.cpu(), _truth64(aux, w, None, nw, 1e-6, "fc_norm", None))


@pytest.mark.gpu
def test_cuda_out_of_range_rows_give_nan_rows(gen):
    aux, w = _make(gen, 8, 64, 32, torch.bfloat16)
    rows = torch.tensor([0, 8, -1, 7], device="cuda")
    out = torch.zeros(4, 32, dtype=torch.bfloat16, device="cuda")
    torch.ops.eagle3.fc_proj(aux.cuda(), w.cuda(), None, None, 1e-6, "none", rows, out)
    with pytest.raises(Eagle3InputError, match=BAD_ROWS.format(T=8, T_1=7)):  # tests/test_contract_fc.py: the rest
        eagle3_ops.check_errors()
    assert torch.isnan(out[1:3].cpu()).all()
    _check(out[[0, 3]].cpu(), _truth64(aux, w, None, None, 1e-6, "none", torch.tensor([0, 7])))


@pytest.mark.gpu
# fp8 at 16 / 32 / 64 rows: issue 23's rows, through _fp8_mm (the activations quantised, then torch._scaled_mm)
@pytest.mark.parametrize("T, wdt", [(4, "bf16"), (64, "bf16"), (16, "fp8"), (32, "fp8"), (64, "fp8")])
def test_cuda_graph_replay_with_new_values(gen, T, wdt):
    from eagle3_ops.triton_kernels import fc_proj as kernels

    aux, w, scale, nw, rows = _gpu_case(gen, T, T, "fc_norm", wdt, False)
    out = torch.empty(T, KIMI_HD, dtype=torch.bfloat16, device="cuda")
    call = lambda: torch.ops.eagle3.fc_proj(aux, w, scale, nw, 1e-6, "fc_norm", rows, out)  # noqa: E731
    graph, _ = capture_graph(call)
    for _ in range(2):
        aux.copy_((2 * torch.randn(aux.shape, generator=gen)).bfloat16())  # new values, same addresses
        rows.copy_(torch.randint(0, T, (T,), generator=gen))
        poison_(out)
        graph.replay()
        if wdt == "fp8":
            _check_fp8_mm(out, aux, w, scale, nw, 1e-6, "fc_norm", rows, f"graph T={T}")
        else:
            _check(out, _truth64(aux, w.float(), None, nw, 1e-6, "fc_norm", rows.cpu()))
    eagle3_ops.check_errors()
    if wdt == "fp8":  # the stream-K kernel (fp8_mm_min_rows None) on the same inputs: within the fp8 rule of it
        streamed = poison_(torch.empty_like(out))
        kernels._fc_proj(aux, w, scale, nw, 1e-6, "fc_norm", rows, streamed, fp8_mm_min_rows=None)
        assert rel_err(out, streamed) <= FP8_ACT_RULE


@pytest.mark.gpu
def test_cuda_fp8_mm_strided_out(gen):
    # out a column slice of a wider buffer (row stride 300, base 40 bytes in): through a temporary, nothing outside
    aux, w8, scale, nw = _fp8_case(gen, 24, 64, 256, torch.bfloat16, "norm_before_fc", "cuda")
    buf = torch.full((24, 300), -777.0, dtype=torch.bfloat16, device="cuda")
    out = poison_(buf[:, 20:276])
    torch.ops.eagle3.fc_proj(aux, w8, scale, nw, 1e-6, "norm_before_fc", None, out)
    _check_fp8_mm(out, aux, w8, scale, nw, 1e-6, "norm_before_fc", None, "strided out")
    assert bool((buf[:, :20] == -777).all() and (buf[:, 276:] == -777).all()), "written outside out"


@pytest.mark.gpu
@pytest.mark.parametrize("case, error, match", [
    ("weight_width", ValueError, "weight must have shape"), ("scale_missing", ValueError, "weight_scale"),
    ("out_rows", ValueError, "out must have shape"), ("aux_strided", ValueError, "aux must be contiguous in its last"),
    ("norm_weight", ValueError, "norm_weight"), ("rows_dtype", TypeError, "rows must have dtype"),
])
def test_cuda_bad_input_writes_nothing(gen, case, error, match):
    aux, w = (t.cuda() for t in _make(gen, 4, 32, 16, torch.bfloat16))
    args = dict(aux=aux, weight=w, weight_scale=None, norm_weight=None, eps=1e-6, norm_mode="none", rows=None,
                out=poison_(torch.empty(4, 16, dtype=torch.bfloat16, device="cuda")))
    if case == "weight_width":
        args["weight"] = w[:, :95].contiguous()
    elif case == "scale_missing":
        args["weight"] = w.to(FP8)
    elif case == "out_rows":
        args["out"] = args["out"][:3]
    elif case == "aux_strided":
        args["aux"] = torch.empty(4, 192, dtype=torch.bfloat16, device="cuda")[:, ::2]
    elif case == "norm_weight":
        args.update(norm_mode="fc_norm", norm_weight=torch.ones(5, 32, dtype=torch.bfloat16, device="cuda"))
    elif case == "rows_dtype":
        args["rows"] = torch.zeros(4, dtype=torch.float32, device="cuda")
    before = args["out"].clone()
    with pytest.raises(error, match=match):
        torch.ops.eagle3.fc_proj(**args)
    assert_equal(args["out"].cpu(), before.cpu())


@pytest.mark.parametrize("norm_mode", ["none", "norm_before_fc", "fc_norm"])
@pytest.mark.parametrize("fp8", [False, True])
def test_prepare_fc_weight_gives_the_same_projection(gen, norm_mode, fp8):
    if fp8 and FP8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    from eagle3_ops.ops import prepare_fc_weight

    aux, weight = _make(gen, 6, 32, 20, torch.float32)
    nw = _norm_weight(gen, norm_mode, 3, 32, torch.float32)
    w, scale, pnw = prepare_fc_weight(weight, norm_mode, nw, fp8=fp8)
    assert (scale is not None) == fp8 and w.dtype == (FP8 if fp8 else torch.float32)
    assert pnw is None if norm_mode != "fc_norm" else bool((pnw == 1).all())
    out = _run(aux, w, scale, pnw, 1e-6, norm_mode, None, torch.float32)
    ref = _truth64(aux, weight, None, nw, 1e-6, norm_mode, None)
    assert rel_err(out, ref) <= (0.05 if fp8 else 1e-5)  # e4m3 keeps 3 mantissa bits: ~2-4% per weight


def test_prepare_fc_weight_bad_input(gen):
    from eagle3_ops.ops import prepare_fc_weight

    _, weight = _make(gen, 2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="norm_weight"):
        prepare_fc_weight(weight, "fc_norm", torch.ones(5, 8))
    with pytest.raises(ValueError, match="norm_mode"):
        prepare_fc_weight(weight, "fc-norm")
    with pytest.raises(TypeError, match="weight"):
        prepare_fc_weight(weight.to(torch.int32))


def test_triton_launcher_refuses_float64_before_writing(gen):
    # float64 is the CPU reference's; the CUDA launcher says so up front (no kernel runs, nothing written).
    aux, weight = _make(gen, 3, 8, 4, torch.float64)
    out = poison_(torch.empty(3, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="aux must have dtype bfloat16 | float16 | float32 on CUDA"):
        _triton_fc(aux, weight, None, None, 1e-6, "none", None, out)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("value, want", [("", None), ("0", None), ("1", FP8_MM_MIN_ROWS), ("32", 32)])
def test_fp8_mm_is_opt_in(monkeypatch, value, want):
    # the activation-quantised path only where EAGLE3_FC_FP8_MM asks for it; a bad value names the variable
    kernels = pytest.importorskip("eagle3_ops.triton_kernels.fc_proj")
    monkeypatch.setenv("EAGLE3_FC_FP8_MM", value)
    assert kernels._fp8_mm_from_env() == want
    monkeypatch.setenv("EAGLE3_FC_FP8_MM", "yes")
    with pytest.raises(ValueError, match="EAGLE3_FC_FP8_MM must be 0, 1 or a row count"):
        kernels._fp8_mm_from_env()
