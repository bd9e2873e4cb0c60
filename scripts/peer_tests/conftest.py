"""Harness for the public peer test files in this folder (git-ignored: README.md says where each comes from; their
code is not committed).

Device: the SGLang / sgl-kernel files hard-code device="cuda". With PEER_DEVICE=cpu (the default when torch
sees no CUDA device) a TorchFunctionMode maps every "cuda" device argument of a torch call to "cpu" while a
test runs, so the test bodies stay as published; with PEER_DEVICE=cuda (the default on a GPU machine) nothing is
mapped and they run on CUDA. The vLLM file picks its device through vllm_shim.current_platform.device_type,
which is PEER_DEVICE.

Marks (vLLM's file only; the test bodies are unchanged): features eagle3_ops.compat.vllm refuses by name
xfail strictly on the NotImplementedError it raises; vLLM's own RNG-implementation tests are skipped.
"""

import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository root (scripts/peer_tests/..)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

PEER_DEVICE = os.environ.get("PEER_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
if PEER_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"PEER_DEVICE must be 'cpu' or 'cuda', got {PEER_DEVICE!r}")


def _cpu(d):
    if isinstance(d, str) and d.split(":")[0] == "cuda":
        return "cpu"
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    return d


class _CudaToCpu(TorchFunctionMode):
    """Every device="cuda" (keyword, or a positional device of Tensor.to) of a torch call -> "cpu";
    Tensor.cuda() -> the tensor on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


@pytest.fixture(autouse=True)
def _peer_device():
    if PEER_DEVICE == "cpu":
        with _CudaToCpu():
            yield
    else:
        yield


_REFUSED = NotImplementedError
_XFAIL = {  # test name (without parameters) -> what eagle3_ops.compat.vllm refuses there
    "test_frequency_penalties": "penalties (no_penalties False) are refused by eagle3_ops.compat.vllm",
    "test_bad_words": "bad_words_token_ids are refused by eagle3_ops.compat.vllm",
    "test_fly_greedy_rescues_mismatch_after_native_acceptance_window":
        "rejection_sample_method='fly' is refused at construction (its standard half runs and passes first)",
    "test_fly_requires_full_lookahead_and_passes_entropy_gate": "rejection_sample_method='fly' is refused",
    "test_fly_does_not_override_target_constraint": "rejection_sample_method='fly' is refused",
    "test_synthetic_all_accepted": "rejection_sample_method='synthetic' is refused",
    "test_synthetic_all_rejected": "rejection_sample_method='synthetic' is refused",
}
_SKIP = {
    "test_sample_recovered_tokens": "vLLM's module-level sample_recovered_tokens (its torch-generator exponential "
                                    "draws, bit-compared) is not offered: our recovered tokens use Philox draws",
    "test_sample_recovered_tokens_uses_fp64_exponential_race_when_requested":
        "vLLM's sample_recovered_tokens / its fp64 exponential race is not offered",
    "test_sample_recovered_tokens_vocab_boundary": "vLLM's sample_recovered_tokens (its Triton kernel's tile "
                                                   "tie-break) is not offered",
    "test_fly_target_only_sampling_uses_mapped_target_ids":
        "monkeypatches vllm.v1.sample.rejection_sampler.generate_uniform_probs (vLLM's RNG); FLy is refused too",
    "test_fly_probabilistic_draft_sampling_uses_probability_ratio":
        "monkeypatches vllm.v1.sample.rejection_sampler.generate_uniform_probs (vLLM's RNG); FLy is refused too",
    "test_fly_mixed_greedy_and_random_batch":
        "monkeypatches vllm.v1.sample.rejection_sampler.generate_uniform_probs (vLLM's RNG); FLy is refused too",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "vllm" not in os.path.basename(str(item.fspath)):
            continue
        name = item.originalname if hasattr(item, "originalname") else item.name.split("[")[0]
        if name in _XFAIL:
            item.add_marker(pytest.mark.xfail(raises=_REFUSED, strict=True, reason=_XFAIL[name]))
        elif name in _SKIP:
            item.add_marker(pytest.mark.skip(reason=_SKIP[name]))
