"""Shared test fixtures: a seeded generator, the tolerance rule, output poisoning, the gpu marker."""

from __future__ import annotations

import os

import pytest
import torch

import eagle3_ops  # noqa: F401  (registers torch.ops.eagle3)

HAS_CUDA = torch.cuda.is_available()

# The tests are many small CPU ops: one thread each avoids OpenMP oversubscription stalls on a busy
# 2-core machine (seen here: 5 ms per index_add_ while another process computed) and keeps runs steady.
torch.set_num_threads(1)

# ||out - ref|| / ||ref|| against the float64 reference, by the dtype the kernel computed in
# (docs/method.md): fp32 far under 1e-3; bf16 / fp16 operands between 1e-3 and 1e-2.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def skip_unless_sm90_kernel() -> None:
    """Skip a GPU test that insists on csrc/mla_decode_sm90.cu's kernel where this build or GPU has none: not a
    Hopper GPU, or a build without sm_90a code (TORCH_CUDA_ARCH_LIST=9.0 compiles the kernel's body to a trap,
    and the Triton kernel serves every call; tests/test_contract_attention.py checks that fallback)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernel needs a Hopper GPU")
    from eagle3_ops.triton_kernels.mla_decode import sm90_compiled

    if not sm90_compiled(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("this build has no sm_90a code for the sm90 kernel (TORCH_CUDA_ARCH_LIST without 9.0a)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A fresh seeded CPU generator per test (the seed is printed on failure through the test id)."""
    seed = int(os.environ.get("EAGLE3_TEST_SEED", "1234"))
    return torch.Generator().manual_seed(seed)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with NaN (floats) or a sentinel (ints) before a run, so unwritten elements show."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(-12345)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_equal(out: torch.Tensor, ref: torch.Tensor, what: str = "output") -> None:
    """Exact comparison that prints the first mismatching index (NaN == NaN counts as equal)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    same = (out == ref) | (torch.isnan(out) & torch.isnan(ref)) if out.is_floating_point() else out == ref
    if not bool(same.all()):
        idx = tuple(int(i) for i in (~same).nonzero()[0])
        raise AssertionError(f"{what}: first mismatch at {idx}: got {out[idx].item()}, expected {ref[idx].item()} "
                             f"({int((~same).sum())} of {same.numel()} differ)")


def capture_graph(call):
    """Warm `call` up on a side stream (compilation, allocator), then capture it once into a CUDA graph.
    Returns (graph, what the captured call returned): replay it after writing new values in place."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = call()
    return graph, result
