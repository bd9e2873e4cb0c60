"""The tensor-parallel group and the four collectives the sharded models and the TP glue call (docs/tp.md).

One process per device, started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK in the environment): NCCL on GPUs,
gloo on the CPU. ``TP(None)`` is the one-rank group, whose collectives do nothing, so the sharded code runs
unchanged at TP = 1 (the tests compare it with the unsharded model there too).

Every collective is synchronous on the current stream (no host sync: NCCL's are capturable in a CUDA graph) and
can be recorded in ``TP.log`` ((name, shape, dtype) per call) so that a benchmark counts what a round issues and
times each kind apart.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

_INT32_MASK = 0xFFFFFFFF
# torch 2.13 renamed all_gather_into_tensor (deprecated since) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TP:
    """A tensor-parallel group (default: the whole world when torch.distributed is initialised, else one rank)."""

    def __init__(self, group=None):
        self.group = group
        on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if on else 0
        self.world = dist.get_world_size(group) if on else 1
        self.log: Optional[list] = None  # a list: every collective appended as (name, shape, dtype)

    def __repr__(self) -> str:
        return f"TP(rank={self.rank}, world={self.world})"

    def _note(self, name: str, t: Tensor) -> None:
        if self.log is not None:
            self.log.append((name, tuple(t.shape), t.dtype))

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        """x summed (or maxed) over the ranks, in place; returns x. Nothing at world 1."""
        if self.world > 1:
            self._note("all_reduce_" + op, x)
            dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather_cols(self, x: Tensor) -> Tensor:
        """[T, c] on every rank -> [T, world * c], rank r's block at columns r * c: one all-gather (into
        [world, T, c]) and one copy to the column layout."""
        if self.world == 1:
            return x
        T, c = x.shape
        buf = x.new_empty(self.world * T, c)
        self._note("all_gather", buf)
        _all_gather(buf, x.contiguous(), group=self.group)
        return buf.view(self.world, T, c).permute(1, 0, 2).reshape(T, self.world * c)

    def argmax(self, logits: Tensor, offset: int) -> Tensor:
        """The global argmax of vocabulary-sharded logits: logits [R, Vr] (this rank's columns, global ids
        offset .. offset + Vr - 1) -> [R] int64, equal to torch.argmax over the gathered [R, V] (the first
        maximum; NaN counts as the largest, as there). Each rank's (value, index) pair packed in one int64,
        order-preserving float bits high and (2^32 - 1 - index) low, then one all-reduce MAX of [R] int64."""
        idx = logits.argmax(-1)  # [R]: the first maximum of the shard
        val = logits.gather(1, idx[:, None]).squeeze(1).float() + 0.0  # (-0.0 + 0.0 = +0.0: they tie in argmax)
        bits = val.view(torch.int32)
        key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed-int order = float order
        key = torch.where(torch.isnan(val), torch.iinfo(torch.int32).max, key)
        packed = key.long() * 2**32 + (_INT32_MASK - (idx + offset))
        self.all_reduce(packed, "max")
        return _INT32_MASK - (packed & _INT32_MASK)


def vocab_range(V: int, rank: int, world: int) -> tuple[int, int]:
    """[lo, hi) of the vocabulary rows rank holds: shards of ceil(V / world), the last one shorter (V = 97 over
    4 ranks: 25, 25, 25, 22)."""
    S = -(-V // world)
    lo = min(V, rank * S)
    return lo, min(V, lo + S)


def init_from_env(backend: Optional[str] = None) -> TP:
    """torch.distributed set up from torchrun's environment (NCCL when CUDA is available, else gloo; each rank's
    GPU its LOCAL_RANK), or the one-rank TP when WORLD_SIZE is unset or 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized():
        return TP()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return TP()


__all__ = ["TP", "vocab_range", "init_from_env"]
