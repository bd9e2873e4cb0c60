"""Registers, for every torch.ops.eagle3 op: its CPU implementation (the reference), its fake
implementation (shape and dtype checks, then empty outputs), and any Triton launcher for CUDA.

CUDA C++ kernels register themselves from csrc/<op>.cu (TORCH_LIBRARY_IMPL). An op with no CUDA kernel
in this build fails on CUDA tensors with the dispatcher's "could not run ... with arguments from the
'CUDA' backend" message when called, never at import.
"""

from __future__ import annotations

import torch

from . import _validate, reference

OPS = (
    "capture_aux",
    "add_rmsnorm_capture",
    "fc_proj",
    "build_tree",
    "tree_attention_mla",
    "tree_attention",
    "verify_greedy",
    "verify_sampling",
    "kv_accept",
)

# Kernels written in Triton, registered here for CUDA tensors: op name -> "module:function" inside
# eagle3_ops.triton_kernels (imported lazily on first call, so import does no GPU or Triton work).
# tree_attention_mla's entry routes an fp8 cache to mla_decode's Triton kernel and every other cache to
# tree_attention.tree_attention_mla (the sm90 CUDA kernel or a Triton one).
TRITON_OPS: dict[str, str] = {"tree_attention_mla": "tree_attention:tree_attention_mla_op",
                              "tree_attention": "tree_attention:tree_attention",
                              "fc_proj": "fc_proj:fc_proj"}

_lib = torch.library.Library("eagle3", "IMPL")  # noqa: TOR901  (kept alive for the process)

for _name in OPS:
    _lib.impl(_name, getattr(reference, _name), "CPU")


def _fake_mutating(name):
    check = getattr(_validate, name)

    def fake(*args):
        check(*args)  # shapes and dtypes only: no values, no writes

    fake.__name__ = f"{name}_fake"
    return fake


for _name in ("capture_aux", "add_rmsnorm_capture", "fc_proj", "build_tree", "tree_attention_mla",
              "tree_attention", "kv_accept"):
    torch.library.register_fake(f"eagle3::{_name}", _fake_mutating(_name), lib=_lib)


def _walk_outputs_fake(like: torch.Tensor, B: int, N: int):
    return (like.new_empty((B, N), dtype=torch.int32), like.new_empty((B,), dtype=torch.int32),
            like.new_empty((B, N), dtype=torch.int64))


@torch.library.register_fake("eagle3::verify_greedy", lib=_lib)
def _verify_greedy_fake(logits, tokens, parents):
    s = _validate.verify_greedy(logits, tokens, parents)
    return _walk_outputs_fake(logits, s["B"], s["N"])


@torch.library.register_fake("eagle3::verify_sampling", lib=_lib)
def _verify_sampling_fake(logits, draft_probs, d2t, tokens, parents, temperature, seed, offset):
    s = _validate.verify_sampling(logits, draft_probs, d2t, tokens, parents, temperature, seed, offset)
    return _walk_outputs_fake(logits, s["B"], s["N"])


def _triton_launcher(name: str, target: str):
    module, func = target.split(":")
    loaded = []

    def launch(*args):
        if not loaded:
            import importlib

            loaded.append(getattr(importlib.import_module(f"eagle3_ops.triton_kernels.{module}"), func))
        getattr(_validate, name)(*args)
        return loaded[0](*args)

    launch.__name__ = f"{name}_triton"
    return launch


for _name, _target in TRITON_OPS.items():
    _lib.impl(_name, _triton_launcher(_name, _target), "CUDA")
