"""Drop-in entry points with other engines' signatures and semantics (eagle3_ops.compat.sglang,
eagle3_ops.compat.vllm)."""

from . import sglang, vllm

__all__ = ["sglang", "vllm"]
