"""The Kimi-K2 target sharded over a tensor-parallel group (docs/tp.md): MLA heads split, the MoE expert-parallel,
the dense FFN and the shared expert split by their intermediate columns, the lm_head by vocabulary rows.

- ``TPMLA``: heads [rank * NH / TP, ...) of q_b_proj, kv_b_proj and o_proj; q_a_proj and kv_a_proj_with_mqa
  whole, so every rank computes and caches the whole latent (each rank's cache is the TP-1 cache); o_proj's
  partial sums all-reduced.
- ``EPMoE``: the gate whole (every rank routes every token alike); moe="ep", experts [rank * E / TP, ...)
  local (a token's slots on other ranks' experts are left out of the grouped GEMMs), or moe="tp", every expert's
  intermediate columns [rank * I / TP, ...); the routed partial plus this rank's shard of the shared expert,
  all-reduced once per layer.
- ``TPMLP``: the dense FFN's gate/up rows and down columns, all-reduced.
- ``lm_head``: vocabulary rows ``vocab_range(V, rank, TP)``; ``TPTarget.forward`` returns the gathered
  [T, V] logits, or, inside ``sharded_logits()``, this rank's [T, Vr] columns (the vocab-parallel verify's
  input, engine side: parallel/glue.py).

The residual stream after every all-reduce is the same on every rank, so the aux rows the capture writes are
too. Sharded weights equal the slices of a TP-1 model's (``shard_target``), or are synthesised per rank at
full size (``synthesize_tp``: kimi-k2 at 61 layers never exists whole).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.config import TargetConfig
from ..models.target import MLA, MLP, Experts, MoE, Target, grouped_mm
from .comm import TP, vocab_range
from .fp8 import Fp8Experts

MOE_MODES = ("ep", "tp")


def _split(n: int, tp: TP, what: str) -> tuple[int, int]:
    if n % tp.world:
        raise ValueError(f"{what} = {n} must be a multiple of the tensor-parallel size {tp.world}")
    k = n // tp.world
    return tp.rank * k, k


class TPMLA(MLA):
    """MLA over this rank's heads (cfg.num_heads / TP of them); the output all-reduced."""

    def __init__(self, cfg: TargetConfig, tp: TP):
        self.head0, local = _split(cfg.num_heads, tp, "num_heads")
        super().__init__(replace(cfg, num_heads=local))
        self.tp = tp

    def forward(self, *args, **kwargs) -> Tensor:
        return self.tp.all_reduce(super().forward(*args, **kwargs))


class TPMLP(MLP):
    """SwiGLU over intermediate columns [rank * I / TP, ...); the output all-reduced."""

    def __init__(self, hidden: int, intermediate: int, tp: TP):
        self.col0, local = _split(intermediate, tp, "intermediate_size")
        super().__init__(hidden, local)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_reduce(super().forward(x))


class EPMoE(MoE):
    """The MoE over the group, the gate whole (every rank routes every token alike), the shared expert's
    intermediate columns split; one all-reduce of the layer's output. moe="ep" (expert parallel): experts
    [e0, e0 + E / TP) whole here; moe="tp": every expert here, its intermediate columns [col0, col0 + I / TP)
    (each rank reads 1/TP of every expert used: no rank waits on a busier one; docs/tp.md compares the bytes).
    expert_dtype float8_e4m3fn: the local experts in fp8 with per-row scales (parallel/fp8.py)."""

    def __init__(self, cfg: TargetConfig, tp: TP, expert_dtype: Optional[torch.dtype] = None, moe: str = "ep"):
        if moe not in MOE_MODES:
            raise ValueError(f"moe must be one of {MOE_MODES}, got {moe!r}")
        super().__init__(cfg)
        self.tp, self.mode = tp, moe
        H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        if moe == "ep":
            self.e0, local = _split(E, tp, "n_routed_experts")
            self.col0 = 0
        else:
            self.e0, local = 0, E
            self.col0, I = _split(I, tp, "moe_intermediate_size")
        self.experts = (Fp8Experts(local, H, I) if expert_dtype == torch.float8_e4m3fn else Experts(local, H, I))
        if cfg.n_shared_experts > 0:
            self.shared_col0, shared = _split(cfg.moe_intermediate_size * cfg.n_shared_experts, tp,
                                              "the shared expert's intermediate size")
            self.shared_experts = MLP(H, shared)

    def forward(self, x: Tensor, grouped: Optional[bool] = None, invariant: bool = False) -> Tensor:
        """x [..., H] -> [..., H], as MoE.forward (grouped GEMMs; per-expert gathers for fp64 or with grad; the
        invariant mode's fixed-size blocks), over the local experts (or expert columns) only; the routed sum in
        fp32, rounded, plus the shared shard, then all-reduced."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        idx, w = self.gate(x)  # [T, K], global expert ids
        local = idx - self.e0
        mine = (local >= 0) & (local < self.experts.num)  # [T, K]
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        if grouped is None:  # as MoE's default: no gradient wanted and fp32 / bf16 / fp16
            grouped = x.dtype in (torch.float32, torch.bfloat16, torch.float16) and not torch.is_grad_enabled()
        if x.shape[0] == 0:
            pass
        elif invariant or not grouped:  # each local expert used on its tokens (invariant: a block of T rows)
            for e in local[mine].unique().tolist():  # ascending: each token adds its experts in the same order
                tok, k = ((local == e) & mine).nonzero(as_tuple=True)
                block = x[tok]
                if invariant:
                    block = torch.zeros_like(x)
                    block[:tok.numel()] = x[tok]
                acc.index_add_(0, tok, self.experts[e](block)[:tok.numel()].float() * w[tok, k, None])
        else:
            acc = self._grouped(x, local, mine, w)
        y = acc.to(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return self.tp.all_reduce(y).view(shape)

    def _grouped(self, x: Tensor, local: Tensor, mine: Tensor, w: Tensor) -> Tensor:
        """The local experts' two grouped GEMMs over the slots routed here (static shapes, no host sync on CUDA
        in bf16): every other slot sorts after the last group, whose rows the GEMMs leave unwritten and the
        combine masks out. -> [T, H] fp32."""
        T, K = local.shape
        E, I = self.experts.num, self.experts.intermediate
        flat = torch.where(mine, local, E).reshape(-1)  # [T * K]: E = not here
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E + 1, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts[:E].cumsum(0, dtype=torch.int32)
        if isinstance(self.experts, Fp8Experts):
            h = self.experts.gate_up_mm(x[order // K], offs)
            y = self.experts.down_mm(F.silu(h[:, :I]) * h[:, I:], offs)
        else:
            h = grouped_mm(x[order // K], self.experts.gate_up.transpose(1, 2), offs)  # [T * K, 2I]
            y = grouped_mm(F.silu(h[:, :I]) * h[:, I:], self.experts.down.transpose(1, 2), offs)  # [T * K, H]
        routed = torch.empty_like(y)
        routed[order] = y
        routed = torch.where(mine.reshape(-1, 1), routed, 0)  # (the rows no GEMM wrote)
        return (routed.view(T, K, -1).float() * w[..., None]).sum(1)


class TPTarget(Target):
    """Target sharded over ``tp`` (module docstring). ``cfg`` is the whole model's; each TPMLA holds its local
    one. ``new_kv`` gives the whole latent cache (every rank keeps all of it)."""

    def __init__(self, cfg: TargetConfig, tp: TP, expert_dtype: Optional[torch.dtype] = None, moe: str = "ep"):
        super().__init__(cfg)
        self.tp = tp
        self.shard_logits = False
        self.vocab_lo, self.vocab_hi = vocab_range(cfg.vocab_size, tp.rank, tp.world)
        if self.vocab_hi <= self.vocab_lo:
            raise ValueError(f"vocab_size = {cfg.vocab_size} leaves rank {tp.rank} of {tp.world} no vocabulary rows")
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = TPMLA(cfg, tp)
            layer.mlp = (EPMoE(cfg, tp, expert_dtype, moe) if cfg.is_moe(i)
                         else TPMLP(cfg.hidden_size, cfg.intermediate_size, tp))
        self.lm_head = nn.Linear(cfg.hidden_size, self.vocab_hi - self.vocab_lo, bias=False)

    @contextmanager
    def sharded_logits(self, on: bool = True):
        """Inside: forward (but for last_only) returns this rank's vocabulary columns [T, Vr], not [T, V]."""
        old, self.shard_logits = self.shard_logits, on
        try:
            yield
        finally:
            self.shard_logits = old

    def gather_logits(self, shard: Tensor) -> Tensor:
        """[R, Vr] -> [R, V]: every rank's columns, padded to one width with -inf, one all-gather."""
        S = -(-self.cfg.vocab_size // self.tp.world)
        pad = S - shard.shape[1]
        if pad:
            shard = F.pad(shard, (0, pad), value=float("-inf"))
        return self.tp.all_gather_cols(shard)[:, :self.cfg.vocab_size]

    @torch.no_grad()
    def forward(self, tokens: Tensor, positions: Tensor, kv, tree_mask: Tensor, aux: Optional[Tensor] = None,
                aux_ids=(), last_only: bool = False) -> Tensor:
        """Target.forward over the shards: logits [B * N, V] fp32 ([B, V] with last_only), or inside
        sharded_logits() [B * N, Vr] (global ids vocab_lo .. vocab_hi - 1)."""
        logits = super().forward(tokens, positions, kv, tree_mask, aux, aux_ids, last_only)
        return logits if self.shard_logits and not last_only else self.gather_logits(logits)


def _shard_state(full: Target, model: TPTarget) -> dict:
    """The full model's state dict cut to model's shards, by name: heads, intermediate columns, experts, rows."""
    cfg, src, out = full.cfg, full.state_dict(), {}
    qk, kvb, v = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
    for name, t in model.state_dict().items():
        path = name.rsplit(".", 1)[0]  # the owning module
        leaf, parent = path.rsplit(".", 1)[-1], path.rsplit(".", 1)[0] if "." in path else ""
        w = src.get(name)
        if ".experts." in name:  # {moe}.experts.{e}.{gate,up,down}_proj.weight: local e is global e0 + e
            moe_name, rest = name.split(".experts.")
            e, tail = rest.split(".", 1)
            moe = model.get_submodule(moe_name)
            w = src[f"{moe_name}.experts.{int(e) + moe.e0}.{tail}"]
            n = t.shape[1] if tail.startswith("down") else t.shape[0]  # moe="tp": the expert's columns
            w = w[:, moe.col0:moe.col0 + n] if tail.startswith("down") else w[moe.col0:moe.col0 + n]
        elif isinstance(model.get_submodule(parent) if parent else None, TPMLA) and leaf != "kv_a_proj_with_mqa":
            mla = model.get_submodule(parent)
            h0, nh = mla.head0, mla.cfg.num_heads
            if leaf in ("q_b_proj", "q_proj"):
                w = w.view(cfg.num_heads, qk, -1)[h0:h0 + nh].reshape(nh * qk, -1)
            elif leaf == "kv_b_proj":
                w = w.view(cfg.num_heads, kvb, -1)[h0:h0 + nh].reshape(nh * kvb, -1)
            elif leaf == "o_proj":
                w = w[:, h0 * v:(h0 + nh) * v]
        elif leaf in ("gate_proj", "up_proj", "down_proj"):  # the dense FFN (TPMLP) or a shared expert
            mod = model.get_submodule(path.rsplit(".", 1)[0])
            c0 = mod.col0 if isinstance(mod, TPMLP) else model.get_submodule(parent.rsplit(".", 1)[0]).shared_col0
            n = t.shape[1] if leaf == "down_proj" else t.shape[0]
            w = w[:, c0:c0 + n] if leaf == "down_proj" else w[c0:c0 + n]
        elif name == "lm_head.weight":
            w = w[model.vocab_lo:model.vocab_hi]
        if w is None or tuple(w.shape) != tuple(t.shape):
            raise ValueError(f"shard_target: no shard of {name} {tuple(t.shape)} in the full model's state dict")
        out[name] = w.clone()
    return out


def shard_target(full: Target, tp: TP, moe: str = "ep") -> TPTarget:
    """This rank's shards of a TP-1 model (same values; same dtype and device; batch_invariant_rows kept)."""
    with torch.device("meta"):
        model = TPTarget(full.cfg, tp, moe=moe)
    model.load_state_dict(_shard_state(full, model), assign=True)
    model.batch_invariant_rows = full.batch_invariant_rows
    return model.reset_rope()


def synthesize_tp(cfg: TargetConfig, tp: TP, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device="cpu",
                  expert_dtype: Optional[torch.dtype] = None, moe: str = "ep") -> TPTarget:
    """This rank's shards with random weights drawn on ``device`` (the full model is never built: kimi-k2 at 61
    layers is ~1 T parameters), at Target.synthesize's scales; each rank draws from seed + rank (its values
    are not a TP-1 model's slices: shard_target gives those). expert_dtype float8_e4m3fn: fp8 experts."""
    with torch.device("meta"):
        model = TPTarget(cfg, tp, expert_dtype, moe)
    model = model.to(dtype).to_empty(device=device)
    # replicated tensors (the embedding, the latent projections, the gate, the norms) from one generator on
    # every rank: each rank must route alike and cache the same latent; the shards from a generator per rank
    shared = torch.Generator(device=device).manual_seed(seed)
    own = torch.Generator(device=device).manual_seed(seed * 1000 + 1 + tp.rank)
    replicated = ("embed_tokens", "q_a_proj", "kv_a_proj_with_mqa", "gate")
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            path = name.rsplit(".", 1)[0]
            if name == "inv_freq" or isinstance(model.get_submodule(path), Fp8Experts):
                continue
            leaf = path.rsplit(".", 1)[-1]
            g = shared if leaf in replicated or "norm" in leaf else own
            if "norm" in leaf:
                t.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g, device=device) * 0.05)
            elif name.endswith(("experts.gate_up", "experts.down")):  # (down's fan-in: the whole I)
                std = (t.shape[-1] * (tp.world if moe == "tp" and name.endswith("down") else 1)) ** -0.5
                std /= math.sqrt(2 * cfg.num_layers) if name.endswith("down") else 1.0
                for e in range(t.shape[0]):  # one expert at a time: the fp32 draw stays small
                    t[e].copy_(torch.randn(t.shape[1:], generator=g, device=device) * std)
            else:
                std = {"embed_tokens": 1.0, "lm_head": 2.0 / math.sqrt(cfg.hidden_size)}.get(leaf, t.shape[-1] ** -0.5)
                if leaf in ("o_proj", "down_proj"):  # split by input columns: the whole fan-in's scale
                    std /= math.sqrt(2 * cfg.num_layers * tp.world)
                t.copy_(torch.randn(t.shape, generator=g, device=device) * std)
        for m in model.modules():
            if isinstance(m, Fp8Experts):
                m.synthesize_(own, cfg.num_layers, cfg.moe_intermediate_size)
    return model.reset_rope()


__all__ = ["TPMLA", "TPMLP", "EPMoE", "TPTarget", "shard_target", "synthesize_tp", "MOE_MODES"]
