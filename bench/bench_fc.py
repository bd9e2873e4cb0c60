"""fc_proj at Kimi's drafter shape (aux [T, 3 x 7168] -> [T, 7168]; a 308 MB bf16 / 154 MB fp8 weight), in
one run: ours (bf16 and fp8-e4m3 weights with a per-channel scale) vs what SGLang/vLLM run, and torch.compile
of F.linear. fc_norm rows: ours (norm weights folded at load, the rsqrt on the fly) vs torch (an RMSNorm per
chunk, cat, F.linear).

The fp8 table (bench "fc fp8"; issue 23: >= 1.0x torch._scaled_mm at T = 16, 32, 64, the activation
quantisation included): eagle3 (the op as shipped: the stream-K kernel unless EAGLE3_FC_FP8_MM is set), eagle3.fp8mm (the opt-in
path: at T >= 16 its activations quantised by one Triton kernel, then torch._scaled_mm into fp32 and a kernel
applying the scales; below, the stream-K kernel), eagle3.stream (the stream-K kernel forced, fp8_mm_min_rows None), eagle3.rowwise (torch._scaled_mm's rowwise scales instead of the fp32 product and
_fp8_scale_kernel), eagle3.quantise (the activation quantisation kernel alone: its share; :BLOCK,warps other
tiles than QUANT_CONFIG), torch (the baseline: per-tensor activation scale amax / 448, the cast, and
torch._scaled_mm with per-tensor scales, eager), torch.compile (the same compiled: the quantisation fused,
T 16 / 32 / 64), torch.prequantised (per-tensor torch._scaled_mm alone on activations quantised outside the timed
call: issue 23's 40.7 us at T = 64), torch.rowwise.prequantised (rowwise scales, quantised outside: flatters it),
torch.bf16 (F.linear on the bf16 weight: plain torch without fp8).

Bytes: weight + aux rows + out; flops 2 T K Hd. Device time: CUDA-graph replays (the weight alone
exceeds L2, so no rotation is needed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common import graph_time_us

from eagle3_ops import errors
from eagle3_ops.ops import prepare_fc_weight

H, HD, N_AUX = 7168, 7168, 3
K = N_AUX * H
SMALL = [1, 4, 16, 32, 64]
LARGE = [256, 1024, 4096]
_W: dict = {}


def _weights():
    if not _W:
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(HD, K, device="cuda", generator=g) / K**0.5
        _W["bf16"] = w.bfloat16()
        _W["fp8"], _W["scale"], _ = prepare_fc_weight(w, fp8=True)
        del w
    return _W


def _scaled_mm(a8, w8, sa, sb, out_dtype=torch.bfloat16):
    return torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def _per_tensor(aux, w8, sb):
    """The baseline: a per-tensor activation scale, the cast to e4m3, torch._scaled_mm with per-tensor scales."""
    sa = (aux.abs().amax().float() / 448.0).clamp_min(1e-12)
    return _scaled_mm((aux / sa).to(torch.float8_e4m3fn), w8, sa, sb)


def _case(T, provider):
    from eagle3_ops.triton_kernels import fc_proj as kernels

    W = _weights()
    aux = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(T, HD, device="cuda", dtype=torch.bfloat16)
    w8, scale = W["fp8"], W["scale"]
    sb = scale.max().reshape(())  # (per-tensor: the timing of that recipe, not our weight's per-channel values)
    if provider == "eagle3":
        return lambda: torch.ops.eagle3.fc_proj(aux, W["bf16"], None, None, 1e-6, "none", None, out), W["bf16"]
    if provider == "eagle3 fp8":
        return lambda: torch.ops.eagle3.fc_proj(aux, w8, scale, None, 1e-6, "none", None, out), w8
    if provider == "eagle3.fp8mm fp8":  # the opt-in activation-quantised path (EAGLE3_FC_FP8_MM=1)
        return lambda: kernels._fc_proj(aux, w8, scale, None, 1e-6, "none", None, out,
                                        fp8_mm_min_rows=kernels.FP8_MM_MIN_ROWS), w8
    if provider == "eagle3.stream fp8":  # the stream-K kernel at every T (the launcher, as the op calls it)
        return lambda: kernels._fc_proj(aux, w8, scale, None, 1e-6, "none", None, out, fp8_mm_min_rows=None), w8
    if provider == "eagle3.rowwise fp8":
        return lambda: kernels._fc_proj(aux, w8, scale, None, 1e-6, "none", None, out,
                                        fp8_mm_min_rows=kernels.FP8_MM_MIN_ROWS, fp8_mm_mode="rowwise"), w8
    if provider.startswith("eagle3.quantise"):  # "eagle3.quantise[:BLOCK,warps] fp8": QUANT_CONFIG or another
        err = errors.error_word(aux.device)
        cfg = tuple(int(v) for v in provider[:-4].split(":")[1].split(",")) if ":" in provider else kernels.QUANT_CONFIG
        return lambda: kernels.quantised_rows(aux, None, 1e-6, 0, 1, None, T, err, cfg), w8
    if provider in ("torch", "torch.bf16 fp8"):
        return lambda: F.linear(aux, W["bf16"]), W["bf16"]
    if provider == "torch.compile":
        f = torch.compile(lambda a: F.linear(a, W["bf16"]), dynamic=False)
        return lambda: f(aux), W["bf16"]
    if provider == "torch fp8":
        return lambda: _per_tensor(aux, w8, sb), w8
    if provider == "torch.compile fp8":
        f = torch.compile(lambda a: _per_tensor(a, w8, sb), dynamic=False)
        return lambda: f(aux), w8
    sa = (aux.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
    a8 = (aux.float() / sa).to(torch.float8_e4m3fn)  # activations quantised outside the timed call
    if provider == "torch.prequantised fp8":
        return lambda: _scaled_mm(a8, w8, sa.max().reshape(()), sb), w8
    if provider == "torch.rowwise.prequantised fp8":
        return lambda: _scaled_mm(a8, w8, sa, scale.view(1, HD)), w8
    raise ValueError(provider)


# around QUANT_CONFIG (32768, 16): the two-pass kernel (rows over 8192 columns read twice), the one tile at 32 warps
QUANT_VARIANTS = ["eagle3.quantise:8192,16 fp8", "eagle3.quantise:32768,32 fp8"]
FP8_PROVIDERS = ["eagle3 fp8", "eagle3.fp8mm fp8", "eagle3.stream fp8", "eagle3.rowwise fp8", "eagle3.quantise fp8", *QUANT_VARIANTS,
                 "torch fp8", "torch.compile fp8", "torch.prequantised fp8",
                 "torch.rowwise.prequantised fp8", "torch.bf16 fp8"]


@pytest.mark.parametrize("provider", ["eagle3", "torch", "torch.compile"] + FP8_PROVIDERS)
@pytest.mark.parametrize("T", SMALL + LARGE)
def test_fc(benchmark, recorder, provider, T):
    if provider == "torch.compile" and T not in (1, 64, 4096):
        pytest.skip("torch.compile of F.linear is cuBLAS again: three sizes suffice")
    if (provider in ("torch.compile fp8", "eagle3.stream fp8", "eagle3.rowwise fp8", "eagle3.fp8mm fp8") or
            provider.startswith("eagle3.quantise")) and T not in (16, 32, 64):
        pytest.skip("issue 23's fp8 rows (T 16, 32, 64) only")
    fn, w = _case(T, provider)
    us = graph_time_us([fn], reps=20)
    benchmark.pedantic(fn, rounds=20, warmup_rounds=3)
    nbytes, flops = w.numel() * w.element_size() + T * K * 2 + T * HD * 2, 2 * T * K * HD
    if provider.startswith("eagle3.quantise"):  # aux read twice (the second from L2: counted once), e4m3 rows written
        nbytes, flops = T * K * 3, 0
    bench = "fc fp8" if provider.endswith(" fp8") else "fc bf16"  # "torch fp8": the baseline column of its table
    recorder.add(bench, f"T={T}", provider.replace(" fp8", ""), us, nbytes, flops,
                 weight_bytes=w.numel() * w.element_size())


@pytest.mark.parametrize("provider", ["eagle3", "torch"])
@pytest.mark.parametrize("T", [4, 64])
def test_fc_norm(benchmark, recorder, provider, T):
    W = _weights()
    aux = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(T, HD, device="cuda", dtype=torch.bfloat16)
    ones = torch.ones(N_AUX, H, device="cuda", dtype=torch.bfloat16)
    if provider == "eagle3":
        fn = lambda: torch.ops.eagle3.fc_proj(aux, W["bf16"], None, ones, 1e-6, "fc_norm", None, out)  # noqa: E731
    else:
        def fn():
            chunks = [F.rms_norm(c, (H,), ones[i], 1e-6) for i, c in enumerate(aux.split(H, dim=1))]
            F.linear(torch.cat(chunks, dim=1), W["bf16"])
    us = graph_time_us([fn], reps=20)
    benchmark.pedantic(fn, rounds=20, warmup_rounds=3)
    nbytes = W["bf16"].numel() * 2 + T * K * 2 + T * HD * 2
    recorder.add("fc bf16 fc_norm", f"T={T}", provider, us, nbytes, 2 * T * K * HD)
