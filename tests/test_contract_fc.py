"""fc_proj's input contract (issue 21): every view and dtype the reference takes runs on the GPU and matches it,
and an out-of-range `rows` index raises on CPU and is reported on CUDA with the same message.

- Views: aux and out as column slices of wider buffers (row strides and base addresses not 16-byte aligned), fp8
  and bf16 weights, every norm mode. The H200 lost its context on one ("an illegal instruction": a TMA box of the
  fp8 weight started at a 24-column chunk, 24 bytes in); fp32 rows asked 263680 bytes of shared memory (232448 allowed).
- rows: the CPU reference raises `fc_proj: rows[5] = 99 is out of range (valid: 0..12)`; CUDA records it in the
  error word (eagle3_ops.check_errors() raises the same), writes NaN in that out row, the other rows exact, and
  nothing outside out (guard bands), on every kernel path, eager and in a CUDA graph.
- Interpreter (TRITON_INTERPRET=1, fp16 / fp32 on CPU tensors): the same views through the Triton kernels, whose
  TMA emulation asserts Hopper's alignment rules, and the rows report through the host word.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import eagle3_ops
from eagle3_ops import reference
from eagle3_ops.errors import Eagle3InputError
from tests.conftest import TOLERANCES, rel_err
from tests.contract import expect_cpu, expect_cuda, expect_cuda_graph

FP8 = getattr(torch, "float8_e4m3fn", None)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-6
GUARD = -777.0  # out's buffer around the view: must stay as it was


def _view(gen, rows, cols, dtype, device, row_off, col_off, extra, scale=2.0):
    """A [rows, cols] view of a wider [rows + row_off, col_off + cols + extra] buffer: row stride col_off + cols +
    extra elements, first element row_off * stride + col_off elements into it."""
    big = (scale * torch.randn(rows + row_off, col_off + cols + extra, generator=gen)).to(dtype)
    return big.to(device)[row_off:, col_off:col_off + cols]


def _weight(gen, Hd, K, wdt, device, offset=0):
    """(weight [Hd, K] contiguous, starting `offset` elements into its storage; per-channel fp32 scale or None)."""
    w = torch.randn(Hd, K, generator=gen) / max(K, 1) ** 0.5
    scale = None
    if wdt == FP8:
        scale = (w.abs().amax(dim=1) / 448).clamp_min(1e-12) if K else torch.ones(Hd)
        w = w / scale[:, None]
    store = torch.empty(offset + Hd * K, dtype=wdt)
    store[offset:] = w.reshape(-1).to(wdt)
    w = store.to(device)[offset:].view(Hd, K)
    return w, None if scale is None else scale.to(device)


def _norm_weight(gen, mode, n_aux, H, dtype, device):
    if mode == "fc_norm":
        return (1 + 0.2 * torch.randn(n_aux, H, generator=gen)).to(dtype).to(device)
    if mode == "norm_before_fc":
        return (1 + 0.2 * torch.randn(n_aux * H, generator=gen)).to(dtype).to(device)
    return None


def _guarded_out(R, Hd, dtype, device, row_off=1, col_off=3):
    """(buffer filled with GUARD, out = a misaligned [R, Hd] view into it, NaN-poisoned)."""
    buf = torch.full((R + row_off + 1, col_off + Hd + 5), GUARD, dtype=dtype, device=device)
    out = buf[row_off:row_off + R, col_off:col_off + Hd]
    out.fill_(float("nan"))
    return buf, out


def _truth(aux, weight, scale, nw, mode, rows):
    """The reference in float64 on CPU copies."""
    cpu = [None if t is None else t.cpu() for t in (aux, weight, scale, nw, rows)]
    R = aux.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(R, weight.shape[0], dtype=torch.float64)
    reference.fc_proj(cpu[0], cpu[1], cpu[2], cpu[3], EPS, mode, cpu[4], out)
    return out


def _check(out, truth, what):
    assert not torch.isnan(out).any(), f"{what}: out not fully written"
    err = rel_err(out.cpu(), truth)
    assert err <= TOLERANCES[out.dtype], f"{what}: rel err {err:.3g} > {TOLERANCES[out.dtype]}"


def _bands_untouched(buf, out, what):
    inside = torch.zeros(buf.shape, dtype=torch.bool)
    r0 = (out.storage_offset() - buf.storage_offset()) // buf.stride(0)
    c0 = (out.storage_offset() - buf.storage_offset()) % buf.stride(0)
    inside[r0:r0 + out.shape[0], c0:c0 + out.shape[1]] = True
    assert bool((buf.cpu()[~inside] == GUARD).all()), f"{what}: written outside out"


def _run(aux, weight, scale, nw, mode, rows, out_dtype, launch=None):
    """Call fc_proj (the op, or `launch` = the Triton launcher under the interpreter) into a guarded misaligned
    out view; check it against the reference, the guard bands, and that nothing was reported."""
    R = aux.shape[0] if rows is None else rows.shape[0]
    buf, out = _guarded_out(R, weight.shape[0], out_dtype, aux.device)
    eagle3_ops.check_errors()
    (launch or torch.ops.eagle3.fc_proj)(aux, weight, scale, nw, EPS, mode, rows, out)
    eagle3_ops.check_errors()  # nothing to report
    what = f"aux {aux.dtype} {tuple(aux.shape)} strides {aux.stride()}, weight {weight.dtype}, {mode}"
    _check(out, _truth(aux, weight, scale, nw, mode, rows), what)
    _bands_untouched(buf, out, what)


# ---- views on the GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("view", ["slice", "contiguous"])
def test_cuda_misaligned_bf16_aux_fp8_weight_fc_norm(gen, view):
    # The H200's case: aux = big[1:, 4:52] of a [14, 57] bf16 buffer (row stride 114 bytes, base 122 bytes in),
    # T 13, n_aux 2, H 24, Hd 24, fp8 weight with its per-channel scale, fc_norm ("an illegal instruction").
    # Its cause was the weight's 24-byte chunk start, not the view: the same call on a contiguous aux (the
    # kernel compiles to the same code, scalar loads either way) took the same TMA box.
    aux = _view(gen, 13, 48, torch.bfloat16, "cuda", row_off=1, col_off=4, extra=5)
    assert aux.stride() == (57, 1) and aux.data_ptr() % 16 != 0
    aux = aux.contiguous() if view == "contiguous" else aux
    w, scale = _weight(gen, 24, 48, FP8, "cuda")
    nw = _norm_weight(gen, "fc_norm", 2, 24, torch.bfloat16, "cuda")
    out = torch.full((13, 24), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.ops.eagle3.fc_proj(aux, w, scale, nw, EPS, "fc_norm", None, out)
    _check(out, _truth(aux, w, scale, nw, "fc_norm", None), "H200 case")
    eagle3_ops.check_errors()


# (n_aux, H, Hd, aux row offset, column offset, extra columns): the H200's case; 20-wide chunks (40 bytes of bf16:
# no 16-byte chunk starts either) with 1-element offsets; 64-wide chunks in a buffer with no extra columns
LAYOUTS = {"h200": (2, 24, 24, 1, 4, 5), "odd": (3, 20, 17, 1, 1, 2), "wide": (3, 64, 72, 2, 3, 0)}


@pytest.mark.gpu
@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("T", [13, 100])  # decode / verify sizes (stream-K), prefill (cuBLAS or the tiled GEMM)
@pytest.mark.parametrize("mode", ["none", "norm_before_fc", "fc_norm"])
@pytest.mark.parametrize("wdt", ["fp8", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_misaligned_views(gen, layout, T, mode, wdt, dtype):
    n_aux, H, Hd, ro, co, extra = LAYOUTS[layout]
    aux = _view(gen, T, n_aux * H, dtype, "cuda", ro, co, extra)
    w, scale = _weight(gen, Hd, n_aux * H, FP8 if wdt == "fp8" else torch.bfloat16, "cuda")
    nw = _norm_weight(gen, mode, n_aux, H, dtype, "cuda")
    _run(aux, w, scale, nw, mode, None, dtype)
    rows = torch.randint(0, T, (7,), generator=gen).cuda()  # a gather from the misaligned view
    _run(aux, w, scale, nw, mode, rows, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("wdt", [torch.bfloat16, FP8])
@pytest.mark.parametrize("offset", [1, 3, 8])  # 1 / 3 elements: an odd base; 8: 16 bytes of bf16, 8 of fp8
def test_cuda_weight_misaligned_base(gen, wdt, offset):
    if wdt is None:
        pytest.skip("this torch has no float8_e4m3fn")
    aux = _view(gen, 5, 96, torch.bfloat16, "cuda", 0, 0, 0)
    w, scale = _weight(gen, 40, 96, wdt, "cuda", offset)
    nw = _norm_weight(gen, "fc_norm", 3, 32, torch.bfloat16, "cuda")
    _run(aux, w, scale, nw, "fc_norm", None, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 22, 64, 100])  # BLOCK_T 16 / 32 / 64 (stream-K or split-K), prefill tiles
@pytest.mark.parametrize("wdt", ["fp32", "bf16", "fp16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_tiles_fit_shared_memory(gen, R, wdt, dtype):
    # The H200's case is fp32 / fp32 at R 22 (T 22, n_aux 3, H 64, Hd 72, fc_norm, a strided view):
    # "OutOfResources: shared memory, Required: 263680, Hardware limit: 232448". Every dtype pair and tile size.
    if wdt == "fp8" and FP8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    aux = _view(gen, R, 192, dtype, "cuda", 0, 5, 11)
    wd = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16, fp8=FP8)[wdt]
    w, scale = _weight(gen, 72, 192, wd, "cuda")
    nw = _norm_weight(gen, "fc_norm", 3, 64, dtype, "cuda")
    _run(aux, w, scale, nw, "fc_norm", None, dtype)


def test_fp32_tiles_are_cut_to_fit_and_tuned_tiles_are_not():
    """shared_need / _fit_shared on the host: the H200's fp32 case gets tiles under 232448 bytes, and the tuned
    bf16 / fp8 tiles (bench/results/fc_sweep_streamk_h200.log) stay as they are."""
    pytest.importorskip("triton")
    from eagle3_ops.triton_kernels import fc_proj as kernels

    aux = torch.empty(22, 192)
    w = torch.empty(72, 192)
    cfg = kernels.stream_config(22, 72, 192, 3, w)
    assert kernels.shared_need(cfg, 32, aux, w, True) > 263680  # what Triton asked for, at least
    fitted = kernels._fit_shared(cfg, 32, aux, w, True)
    assert kernels.shared_need(fitted, 32, aux, w, True) <= 232448 and fitted["num_stages"] >= 2
    for wdt in (torch.bfloat16, FP8):
        if wdt is None:
            continue
        for R in (1, 16, 64):
            bt = max(16, 1 << (R - 1).bit_length())
            a = torch.empty(R, 21504, dtype=torch.bfloat16, device="meta")
            wt = torch.empty(7168, 21504, dtype=wdt, device="meta")
            cfg = kernels.stream_config(R, 7168, 21504, 1, wt)
            assert kernels._fit_shared(cfg, bt, a, wt, False) == cfg, f"{wdt} R {R}: tuned tiles cut"


# ---- rows out of range ----------------------------------------------------------------------------------------

# (aux dtype, weight dtype, R, Hd, n_aux, H, mode): one per kernel path
PATHS = {
    "stream-k bf16": (torch.bfloat16, torch.bfloat16, 8, 40, 2, 24, "fc_norm"),
    "stream-k fp8": (torch.bfloat16, FP8, 8, 40, 2, 24, "norm_before_fc"),
    "split-k fp32": (torch.float32, torch.float32, 8, 40, 2, 24, "fc_norm"),
    "prefill cublas": (torch.bfloat16, torch.bfloat16, 100, 40, 2, 24, "none"),
    "prefill tiled": (torch.float32, torch.bfloat16, 100, 40, 2, 24, "fc_norm"),
    "K = 0": (torch.bfloat16, torch.bfloat16, 8, 40, 1, 0, "none"),
    "Hd = 0": (torch.bfloat16, torch.bfloat16, 8, 0, 2, 24, "none"),
}
T = 13


def _rows_case(path, bad_index, bad_value, rows_dtype):
    """make(device) for tests/contract.py: aux [13, n_aux * H] (a misaligned view), rows [R] with one bad value,
    out a misaligned view in a GUARD-filled buffer. guard(): (out's buffer, rows)."""
    dtype, wdt, R, Hd, n_aux, H, mode = PATHS[path]

    def make(device):
        gen = torch.Generator().manual_seed(21)
        aux = _view(gen, T, n_aux * H, dtype, device, 1, 3, 2)
        w, scale = _weight(gen, Hd, n_aux * H, wdt, device)
        nw = _norm_weight(gen, mode, n_aux, H, dtype, device)
        rows = torch.randint(0, T, (R,), generator=gen)
        rows[bad_index] = bad_value
        rows = rows.to(rows_dtype).to(device)
        buf, out = _guarded_out(R, Hd, dtype, device)
        make.last = (aux, w, scale, nw, mode, rows, buf, out)
        return lambda: torch.ops.eagle3.fc_proj(aux, w, scale, nw, EPS, mode, rows, out), lambda: [buf, rows]

    def check_outputs(_):
        aux, w, scale, nw, mode_, rows, buf, out = make.last
        assert torch.isnan(out[bad_index].cpu()).all(), "the bad row must be NaN"
        good = torch.arange(R) != bad_index
        truth = _truth(aux, w, scale, nw, mode_, rows.cpu()[good])
        if Hd:
            _check(out[good.to(out.device)], truth, path)
        _bands_untouched(buf, out, path)

    return make, check_outputs


BAD = [(5, 99), (2, -1)]  # past T; negative (no Python-style wrap-around)


def _message(i, v):
    return f"fc_proj: rows[{i}] = {v} is out of range (valid: 0..{T - 1})"


@pytest.mark.parametrize("path", [p for p in PATHS if PATHS[p][1] is not None])
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("rows_dtype", [torch.int64, torch.int32])
def test_cpu_rows_out_of_range_raises(path, bad, rows_dtype):
    make, _ = _rows_case(path, *bad, rows_dtype)
    expect_cpu(make, _message(*bad))


def test_cpu_rows_message_is_the_issue_example():
    make, _ = _rows_case("stream-k bf16", 5, 99, torch.int64)
    expect_cpu(make, "fc_proj: rows[5] = 99 is out of range (valid: 0..12)")


@pytest.mark.gpu
@pytest.mark.parametrize("path", [p for p in PATHS if PATHS[p][1] is not None])
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("rows_dtype", [torch.int64, torch.int32])
def test_cuda_rows_out_of_range_reports(path, bad, rows_dtype):
    make, check_outputs = _rows_case(path, *bad, rows_dtype)
    expect_cuda(make, _message(*bad), check_outputs)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["stream-k bf16", "stream-k fp8", "split-k fp32"])
def test_cuda_graph_rows_out_of_range_reports(path):
    make, _ = _rows_case(path, 5, 99, torch.int64)
    expect_cuda_graph(make, _message(5, 99))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_cuda_second_device(gen):
    # Tensors on cuda:1 while cuda:0 is current: the launches (and TMA descriptors) follow the tensors, the bad
    # index is recorded in cuda:1's word.
    assert torch.cuda.current_device() == 0
    dev = torch.device("cuda", 1)
    aux = _view(gen, 13, 48, torch.bfloat16, dev, 1, 4, 5)
    w, scale = _weight(gen, 40, 48, FP8 or torch.bfloat16, dev)
    nw = _norm_weight(gen, "fc_norm", 2, 24, torch.bfloat16, dev)
    _run(aux, w, scale, nw, "fc_norm", None, torch.bfloat16)
    rows = torch.tensor([0, 12, 3, 4, 1, 99], device=dev)
    out = torch.empty(6, 40, dtype=torch.bfloat16, device=dev)
    torch.ops.eagle3.fc_proj(aux, w, scale, nw, EPS, "fc_norm", rows, out)
    with pytest.raises(Eagle3InputError, match="^" + re.escape(_message(5, 99)) + "$"):
        eagle3_ops.check_errors(dev)
    assert torch.isnan(out[5].cpu()).all()


# ---- the Triton kernels under the interpreter (CPU tensors, fp16 / fp32) -------------------------------------


def _interpreted(config=None, stream_max_rows=None):
    """The Triton launcher with _fc_proj's config / stream_max_rows (None: the op's defaults), checked as the op
    checks."""
    from eagle3_ops._validate import fc_proj as check
    from eagle3_ops.triton_kernels import fc_proj as kernels

    smr = kernels.STREAM_MAX_ROWS if stream_max_rows is None else stream_max_rows

    def launch(*args):
        check(*args)
        kernels._fc_proj(*args, config=config, stream_max_rows=smr)
    return launch


needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="the Triton interpreter runs the kernels on CPU")
# the default tiles (stream-K with TMA weight boxes for 16-bit and fp8 weights), a small stream-K with TMA, the
# split-K kernel, and the prefill tiled GEMM
INTERP_PATHS = {"default": (None, None), "stream-k-tma": ("32,32,0,4,2,3,1", None), "split-k": ("16,16,4,4,2", None),
                "tiled": (None, 0)}


@needs_interpreter
@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
def test_interpreted_h200_case_in_fp16(gen):
    # The H200's misaligned case with fp16 rows (no bf16 in the interpreter), default tiles: before the fix the
    # interpreter stopped it as "block offset start must be 16-byte aligned" (the fp8 chunk at 24 columns).
    aux = _view(gen, 13, 48, torch.float16, "cpu", 1, 4, 5)
    w, scale = _weight(gen, 24, 48, FP8, "cpu")
    nw = _norm_weight(gen, "fc_norm", 2, 24, torch.float16, "cpu")
    _run(aux, w, scale, nw, "fc_norm", None, torch.float16, _interpreted())


@needs_interpreter
@pytest.mark.parametrize("path", list(INTERP_PATHS))
@pytest.mark.parametrize("layout", [(1, 4, 5), (1, 1, 2), (0, 3, 0)])  # (row offset, column offset, extra)
@pytest.mark.parametrize("mode", ["none", "fc_norm"])
@pytest.mark.parametrize("wdt", ["fp8", "fp16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_interpreted_misaligned_views(gen, path, layout, mode, wdt, dtype):
    # n_aux 2, H 12: a 24-byte fp16 (12-byte fp8) chunk start, with a weight row stride that TMA takes
    if wdt == "fp8" and FP8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    config, smr = INTERP_PATHS[path]
    aux = _view(gen, 5, 24, dtype, "cpu", *layout)
    w, scale = _weight(gen, 9, 24, dict(fp8=FP8, fp16=torch.float16, fp32=torch.float32)[wdt], "cpu")
    nw = _norm_weight(gen, mode, 2, 12, dtype, "cpu")
    rows = torch.tensor([4, 0, 4, 2])
    launch = _interpreted(config, smr)
    _run(aux, w, scale, nw, mode, None, dtype, launch)
    _run(aux, w, scale, nw, mode, rows, dtype, launch)


@needs_interpreter
@pytest.mark.parametrize("offset", [1, 8])  # an odd base; 8 elements = 16 bytes of fp16
@pytest.mark.parametrize("path", ["default", "stream-k-tma"])
def test_interpreted_weight_misaligned_base(gen, offset, path):
    aux = _view(gen, 3, 64, torch.float16, "cpu", 0, 0, 0)
    w, _ = _weight(gen, 20, 64, torch.float16, "cpu", offset)
    _run(aux, w, None, None, "none", None, torch.float16, _interpreted(INTERP_PATHS[path][0]))


@needs_interpreter
@pytest.mark.parametrize("path", [*INTERP_PATHS, "persistent", "prefill-rows", "K = 0", "Hd = 0"])
@pytest.mark.parametrize("bad", BAD)
def test_interpreted_rows_out_of_range_reports(gen, path, bad):
    """The Triton kernels record the bad index in the host error word (check_errors() raises the CPU's message),
    write NaN in its row and the reference's values in the others, nothing outside out."""
    config, smr = dict(INTERP_PATHS, persistent=("16,16,0,4,2,2", None), **{"prefill-rows": (None, 0)}).get(
        path, (None, None))
    dtype = torch.float16 if path == "prefill-rows" else torch.float32  # fp16 prefill: rows gathered, torch.mm
    n_aux, H = (1, 0) if path == "K = 0" else (2, 12)
    Hd = 0 if path == "Hd = 0" else 9
    aux = _view(gen, T, n_aux * H, dtype, "cpu", 1, 3, 2)
    w, _ = _weight(gen, Hd, n_aux * H, dtype, "cpu")
    nw = _norm_weight(gen, "fc_norm" if H else "none", n_aux, H, dtype, "cpu")
    rows = torch.randint(0, T, (8,), generator=gen)
    rows[bad[0]] = bad[1]
    buf, out = _guarded_out(8, Hd, dtype, "cpu")
    eagle3_ops.check_errors()
    _interpreted(config, smr)(aux, w, None, nw, EPS, "fc_norm" if H else "none", rows, out)
    with pytest.raises(Eagle3InputError, match="^" + re.escape(_message(*bad)) + "$"):
        eagle3_ops.check_errors()
    eagle3_ops.check_errors()  # cleared
    assert torch.isnan(out[bad[0]]).all()
    good = torch.arange(8) != bad[0]
    if Hd:
        _check(out[good], _truth(aux, w, None, nw, "fc_norm" if H else "none", rows[good]), path)
    _bands_untouched(buf, out, path)
