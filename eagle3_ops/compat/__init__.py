"""Drop-in entry points with other engines' signatures and semantics (eagle3_ops.compat.sglang)."""

from . import sglang

__all__ = ["sglang"]
