"""Tensor parallelism for the reference decode loop (issue 26, docs/tp.md): torch.distributed, one process per
device (torchrun; NCCL on GPUs, gloo on the CPU)."""

from .comm import TP, init_from_env, vocab_range
from .fp8 import Fp8Experts
from .glue import TPDrafter, TPGlue, generate_speculative_tp, tp_drafter, walk_greedy
from .target import EPMoE, TPMLA, TPMLP, TPTarget, shard_target, synthesize_tp

__all__ = ["TP", "init_from_env", "vocab_range", "Fp8Experts", "TPDrafter", "TPGlue", "generate_speculative_tp",
           "tp_drafter", "walk_greedy", "EPMoE", "TPMLA", "TPMLP", "TPTarget", "shard_target", "synthesize_tp"]
