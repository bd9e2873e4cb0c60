"""fc_proj at Kimi's drafter shape (aux [T, 3 x 7168] -> [T, 7168]; a 308 MB bf16 / 154 MB fp8 weight), in
one run: ours (bf16 and fp8-e4m3 weights with a per-channel scale) vs what SGLang/vLLM run (`F.linear`
on bf16; `torch._scaled_mm` with fp8 activations already quantised, rowwise scales, which flatters it)
and torch.compile of F.linear. fc_norm rows: ours (norm weights folded at load, the rsqrt on the fly) vs
torch (an RMSNorm per chunk, cat, F.linear).

Bytes: weight + aux rows + out; flops 2 T K Hd. Device time: CUDA-graph replays (the weight alone
exceeds L2, so no rotation is needed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common import graph_time_us

import eagle3_ops  # noqa: F401
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


def _case(T, provider):
    W = _weights()
    aux = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(T, HD, device="cuda", dtype=torch.bfloat16)
    if provider == "eagle3":
        return lambda: torch.ops.eagle3.fc_proj(aux, W["bf16"], None, None, 1e-6, "none", None, out), W["bf16"]
    if provider == "eagle3 fp8":
        return lambda: torch.ops.eagle3.fc_proj(aux, W["fp8"], W["scale"], None, 1e-6, "none", None, out), W["fp8"]
    if provider == "torch":
        return lambda: F.linear(aux, W["bf16"]), W["bf16"]
    if provider == "torch.compile":
        f = torch.compile(lambda a: F.linear(a, W["bf16"]), dynamic=False)
        return lambda: f(aux), W["bf16"]
    if provider == "torch fp8":  # _scaled_mm, activations quantised outside the timed call
        sa = (aux.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
        a8 = (aux.float() / sa).to(torch.float8_e4m3fn)
        sb = W["scale"].view(1, HD)
        try:
            _scaled_mm(a8, W["fp8"], sa, sb)
        except RuntimeError:  # no rowwise scaling in this build: per-tensor scales
            sa, sb = sa.max().reshape(()), sb.max().reshape(())
        return lambda: _scaled_mm(a8, W["fp8"], sa, sb), W["fp8"]
    raise ValueError(provider)


@pytest.mark.parametrize("provider", ["eagle3", "torch", "torch.compile", "eagle3 fp8", "torch fp8"])
@pytest.mark.parametrize("T", SMALL + LARGE)
def test_fc(benchmark, recorder, provider, T):
    if provider == "torch.compile" and T not in (1, 64, 4096):
        pytest.skip("torch.compile of F.linear is cuBLAS again: three sizes suffice")
    fn, w = _case(T, provider)
    us = graph_time_us([fn], reps=20)
    benchmark.pedantic(fn, rounds=20, warmup_rounds=3)
    nbytes = w.numel() * w.element_size() + T * K * 2 + T * HD * 2
    bench = "fc fp8" if "fp8" in provider else "fc bf16"
    provider = "torch" if provider == "torch fp8" else provider  # the baseline column of its own table
    recorder.add(bench, f"T={T}", provider.replace(" fp8", ""), us, nbytes, 2 * T * K * HD,
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
