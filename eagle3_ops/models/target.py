"""The DeepSeek-V3 / Kimi-K2 target (docs/models.md): MLA with a paged latent cache, YaRN RoPE, sigmoid-routed
MoE with a score-correction bias, node-limited (grouped) routing, a shared expert and first dense layers.

Two forwards over one set of weights, in gpt-fast's shape:

- ``forward_train(tokens)``: plain differentiable PyTorch over a whole causal sequence, no cache,
  non-absorbed MLA (k_nope and v expanded from the latent). It is the specification the step is tested
  against, and what training scripts call. Optionally returns Hugging Face's ``output_hidden_states``.
- ``forward(tokens, positions, kv, tree_mask, aux, aux_ids)``: one inference step (prefill, decode or
  tree verify) through ``torch.ops.eagle3``: absorbed MLA over the paged latent cache with
  ``tree_attention_mla``, every add + norm through ``add_rmsnorm_capture``, which also captures the
  drafter's aux states where ``eagle3_ops.wiring.capture_sites`` says.

Module names make ``state_dict()`` keys equal the Hugging Face DeepSeek-V3 checkpoint names
(``model.layers.{i}.self_attn.kv_b_proj.weight``, ...). The routing bias and the rope frequencies stay
fp32 whatever dtype the module is cast to.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..wiring import capture_sites
from .cache import KVCacheConfig, PagedKV, query_dtype
from .config import TargetConfig
from .rope import apply_rope, yarn_inv_freq

# Hugging Face's DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm are built without the
# config's rms_norm_eps (it differs only for K2.5, whose rms_norm_eps is 1e-5).
LATENT_NORM_EPS = 1e-6


class _KeepFp32(nn.Module):
    """Named buffers stay fp32 through .to(dtype) / .bfloat16() / .half() (precision of routing and rope)."""

    _fp32_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        saved = {n: self._buffers[n] for n in self._fp32_buffers}
        super()._apply(fn, recurse)
        for n, old in saved.items():
            new = self._buffers[n]
            if new is not None and old is not None and new.dtype != torch.float32:
                self._buffers[n] = old.to(device=new.device, dtype=torch.float32)
        return self


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight in fp32, rounded once to x's dtype (as add_rmsnorm_capture)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        r = x.float()
        return (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). The dense FFN, each routed expert and the shared expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---- MoE ----------------------------------------------------------------------------------------------


def route(s: Tensor, bias: Tensor, cfg: TargetConfig) -> tuple[Tensor, Tensor]:
    """noaux_tc routing (docs/models.md): pick experts by the biased score, weight them by the unbiased one.

    With n_group > 1, a group's score is the sum of its two best ``s + bias``; only the topk_group best
    groups stay eligible. The top num_experts_per_tok of ``s + bias`` among eligible experts are picked;
    their weights are their *unbiased* s, normalised to sum 1, times routed_scaling_factor.

    Parameters
    ----------
    s : Tensor [T, E] fp32
        sigmoid(u W_gate^T), the unbiased affinities.
    bias : Tensor [E] fp32
        e_score_correction_bias (selection only).
    cfg : TargetConfig
        num_experts_per_tok (K), n_group, topk_group, routed_scaling_factor.

    Returns
    -------
    idx : Tensor [T, K] int64
        Picked experts, by descending biased score.
    weights : Tensor [T, K] fp32
        Their combine weights; each row sums to routed_scaling_factor.
    """
    T, E = s.shape
    K, G = cfg.num_experts_per_tok, cfg.n_group
    choice = s + bias  # [T, E]
    if G > 1:
        if E % G:
            raise ValueError(f"n_routed_experts = {E} must be a multiple of n_group = {G}")
        grouped = choice.view(T, G, E // G)
        group_score = grouped.topk(min(2, E // G), dim=-1).values.sum(-1)  # [T, G]
        kept = group_score.topk(cfg.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros(T, G, dtype=torch.bool, device=s.device).scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    idx = choice.topk(K, dim=-1).indices  # [T, K]
    w = s.gather(1, idx)
    return idx, w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor


class Gate(_KeepFp32):
    _fp32_buffers = ("e_score_correction_bias",)

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (idx [T, K] int64, weights [T, K] fp32); scores in fp32."""
        s = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [T, E]
        return route(s, self.e_score_correction_bias.float(), self.cfg)


class Experts(nn.Module):
    """The routed experts, stacked for a grouped GEMM: ``gate_up`` [E, 2I, H] (expert e's gate_proj rows, then
    its up_proj rows) and ``down`` [E, H, I]. ``state_dict()`` gives, and ``load_state_dict`` takes, Hugging
    Face's per-expert names (``{e}.gate_proj.weight`` [I, H], ``{e}.up_proj.weight``, ``{e}.down_proj.weight``
    [H, I]), as views into the stacks. ``experts[e](x)`` is expert e's SwiGLU MLP."""

    def __init__(self, num: int, hidden: int, intermediate: int):
        super().__init__()
        self.num, self.intermediate = num, intermediate
        self.gate_up = nn.Parameter(torch.empty(num, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num, hidden, intermediate))
        self.register_state_dict_post_hook(Experts._to_per_expert)
        self.register_load_state_dict_pre_hook(Experts._from_per_expert)

    def __len__(self) -> int:
        return self.num

    def weights(self, e: int) -> tuple[Tensor, Tensor, Tensor]:
        """Expert e's (gate_proj, up_proj, down_proj) weights, views."""
        I = self.intermediate
        return self.gate_up[e, :I], self.gate_up[e, I:], self.down[e]

    def __getitem__(self, e: int):
        g, u, d = self.weights(e)
        return lambda x: F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)

    @staticmethod
    def _to_per_expert(module, state_dict, prefix, local_metadata):
        gate_up, down = state_dict.pop(prefix + "gate_up"), state_dict.pop(prefix + "down")
        I = module.intermediate
        for e in range(module.num):
            state_dict[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :I]
            state_dict[f"{prefix}{e}.up_proj.weight"] = gate_up[e, I:]
            state_dict[f"{prefix}{e}.down_proj.weight"] = down[e]

    @staticmethod
    def _from_per_expert(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs):
        names = [(f"{prefix}{e}.gate_proj.weight", f"{prefix}{e}.up_proj.weight", f"{prefix}{e}.down_proj.weight")
                 for e in range(module.num)]
        if not all(k in state_dict for trio in names for k in trio):
            return  # left as they are: load_state_dict reports the missing stacks and the stray keys
        first = state_dict[names[0][0]]
        I, H = module.intermediate, module.gate_up.shape[2]
        gate_up = torch.empty(module.num, 2 * I, H, dtype=first.dtype, device=first.device)
        down = torch.empty(module.num, H, I, dtype=first.dtype, device=first.device)
        for e, (g, u, d) in enumerate(names):
            for name, dst in ((g, gate_up[e, :I]), (u, gate_up[e, I:]), (d, down[e])):
                src = state_dict.pop(name)
                if tuple(src.shape) != tuple(dst.shape):
                    error_msgs.append(f"size mismatch for {name}: copying a param with shape {tuple(src.shape)}, "
                                      f"the shape in the current model is {tuple(dst.shape)}.")
                    return
                dst.copy_(src)
        state_dict[prefix + "gate_up"], state_dict[prefix + "down"] = gate_up, down


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """out[r] = a[r] @ b[g] for the rows r of group g (rows [offs[g-1], offs[g])). a [M, K], b [G, K, N]."""
    return torch._grouped_mm(a, b, offs=offs)


class MoE(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        H = cfg.hidden_size
        self.gate = Gate(cfg)
        self.experts = Experts(cfg.n_routed_experts, H, cfg.moe_intermediate_size)
        self.shared_experts = (MLP(H, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts > 0 else None)

    def forward(self, x: Tensor, grouped: Optional[bool] = None, invariant: bool = False) -> Tensor:
        """x [..., H] -> [..., H]. Each token's K routed outputs (model dtype) are weighted and summed in fp32,
        then the shared expert is added.

        grouped: the inference path, two grouped GEMMs over the tokens sorted by expert (torch._grouped_mm:
        each expert's weights read once). The default where it applies: no gradient wanted and fp32 / bf16 /
        fp16. On CUDA only bf16 runs torch's grouped kernel with no host sync (a CUDA graph can hold it); other
        dtypes take torch's fallback, which copies the offsets to the host and runs one GEMM per expert.
        Otherwise each expert gathers its tokens (a `nonzero` per expert, a host sync): differentiable, and
        the only path for fp64.

        invariant: Target.batch_invariant_rows' mode: each expert used runs on a block of exactly x's row
        count (its tokens, then zero rows), so a token's output does not depend on how many others share its
        experts (a grouped GEMM's per-group kernels, or the gather's, change with the group's size). Host
        syncs; a correctness mode.
        """
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        idx, w = self.gate(x)  # [T, K]
        if grouped is None:
            grouped = not (torch.is_grad_enabled() and self.experts.gate_up.requires_grad)
            grouped = grouped and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        if x.shape[0] == 0:
            acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        elif invariant:
            acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
            for e in idx.unique().tolist():  # ascending: each token adds its experts in the same order
                tok, k = (idx == e).nonzero(as_tuple=True)
                block = torch.zeros_like(x)
                block[:tok.numel()] = x[tok]
                acc.index_add_(0, tok, self.experts[e](block)[:tok.numel()].float() * w[tok, k, None])
        elif grouped:
            T, K = idx.shape
            E, I = self.experts.num, self.experts.intermediate
            flat = idx.reshape(-1)  # [T * K]
            order = torch.argsort(flat, stable=True)  # slots sorted by expert
            counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
                0, flat, torch.ones_like(flat, dtype=torch.int32))
            offs = counts.cumsum(0, dtype=torch.int32)
            h = grouped_mm(x[order // K], self.experts.gate_up.transpose(1, 2), offs)  # [T * K, 2I]
            y = grouped_mm(F.silu(h[:, :I]) * h[:, I:], self.experts.down.transpose(1, 2), offs)  # [T * K, H]
            routed = torch.empty_like(y)
            routed[order] = y  # back to (token, k) order
            acc = (routed.view(T, K, -1).float() * w[..., None]).sum(1)  # [T, H]
        else:
            acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
            for e in range(self.experts.num):
                tok, k = (idx == e).nonzero(as_tuple=True)
                if tok.numel():
                    acc.index_add_(0, tok, self.experts[e](x[tok]).float() * w[tok, k, None])
        y = acc.to(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)


# ---- MLA ----------------------------------------------------------------------------------------------


class MLA(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        H, NH = cfg.hidden_size, cfg.num_heads
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(H, NH * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, NH * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, NH * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(NH * cfg.v_head_dim, H, bias=False)

    def _q(self, x: Tensor, pos: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., H] -> q_nope [..., NH, nope], q_pe [..., NH, R] (roped)."""
        cfg = self.cfg
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.unflatten(-1, (cfg.num_heads, cfg.qk_head_dim)).split(
            [cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        return q_nope, apply_rope(q_pe, pos, inv_freq)

    def _latent(self, x: Tensor, pos: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., H] -> c_kv [..., kv_lora] (normed), k_pe [..., R] (roped): the cached row."""
        kv_a = self.kv_a_proj_with_mqa(x)
        c_kv, k_pe = kv_a.split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(c_kv), apply_rope(k_pe, pos, inv_freq)

    def forward_train(self, x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
        """Non-absorbed, causal. x [B, T, H] (input-normed), pos [B, T] -> [B, T, H]."""
        cfg = self.cfg
        B, T, _ = x.shape
        NH, nope, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q_nope, q_pe = self._q(x, pos, inv_freq)  # [B, T, NH, nope], [B, T, NH, R]
        c_kv, k_pe = self._latent(x, pos, inv_freq)  # [B, T, kv_lora], [B, T, R]
        k_nope, v = self.kv_b_proj(c_kv).unflatten(-1, (NH, nope + cfg.v_head_dim)).split(
            [nope, cfg.v_head_dim], dim=-1)  # [B, T, NH, nope], [B, T, NH, v]
        q = torch.cat([q_nope, q_pe], -1)  # [B, T, NH, qk]
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, T, NH, R)], -1)  # [B, T, NH, qk]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=cfg.softmax_scale)  # [B, NH, T, v]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, NH * cfg.v_head_dim))

    def forward(self, x: Tensor, pos: Tensor, inv_freq: Tensor, kv: PagedKV, layer: int,
                tree_mask: Tensor, invariant: bool = False) -> Tensor:
        """Absorbed MLA step. x [B*N (+ padding), H] (input-normed), pos [B*N (+ padding)] -> x's shape; writes
        this step's latent rows into kv.caches[layer] at prefix_lens + node (prefix_lens unchanged; an fp8 cache
        stores them quantised with kv.scale(layer), which every attention call then reads them back with).

        invariant: Target.batch_invariant_rows' mode: attention through batch_invariant_mla_attention
        instead of the kernel. Rows past B*N (padding) are projected but neither cached nor attended."""
        cfg = self.cfg
        T = x.shape[0]
        B, N = tree_mask.shape[0], tree_mask.shape[1]
        NH, nope, Dl = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q_nope, q_pe = self._q(x, pos, inv_freq)  # [T, NH, nope], [T, NH, R]
        c_kv, k_pe = self._latent(x, pos, inv_freq)  # [T, Dl], [T, R]
        kv.write(layer, torch.cat([c_kv, k_pe], -1)[:B * N].view(B, N, cfg.kv_dim))
        w_kvb = self.kv_b_proj.weight.view(NH, nope + cfg.v_head_dim, Dl)
        w_uk, w_uv = w_kvb[:, :nope], w_kvb[:, nope:]  # [NH, nope, Dl], [NH, v, Dl]
        q_abs = torch.einsum("thd,hdc->thc", q_nope, w_uk)  # [T, NH, Dl]
        # q and out in the cache's dtype (an fp8 cache: bf16 / fp16, the model's or bf16; cache.query_dtype)
        cache, kv_scale = kv.caches[layer], kv.scale(layer)
        q = torch.cat([q_abs, q_pe], -1)[:B * N].to(query_dtype(cache.dtype, x.dtype)).contiguous()  # [B*N, NH, kv_dim]
        if invariant:
            out = batch_invariant_mla_attention(q, cache, kv.page_table, kv.prefix_lens, tree_mask, cfg.softmax_scale,
                                                Dl, kv_scale)
        else:
            out = q.new_empty(B * N, NH, Dl)  # [B*N, NH, Dl]: attention output in latent space
            torch.ops.eagle3.tree_attention_mla(q, cache, kv.page_table, kv.prefix_lens, tree_mask, cfg.softmax_scale,
                                                out, None, kv_scale)
        out = out.to(x.dtype)
        if T > B * N:
            out = F.pad(out, (0, 0, 0, 0, 0, T - B * N))
        o = torch.einsum("thc,hdc->thd", out, w_uv)  # [T, NH, v]
        return self.o_proj(o.reshape(T, NH * cfg.v_head_dim))


def batch_invariant_mla_attention(q: Tensor, kv_cache: Tensor, page_table: Tensor, prefix_lens: Tensor,
                                  tree_mask: Tensor, scale: float, dv: int = 512,
                                  kv_scale: Optional[Tensor] = None) -> Tensor:
    """tree_attention_mla's values computed so that a row's result does not depend on the step it is in: in
    float64, over every slot of the request's page table (slots past its keys masked to exact zeros), so
    a token's output in a 4-node verify step and in a 1-token plain step agree to far below bf16's rounding.
    (A kernel's split count, its tiling of tree keys apart from the prefix and its GEMMs chosen by row count
    all change fp32 rounding with the step's shape.) [B * N, NH, D] -> [B * N, NH, dv] in q's dtype (Kimi: 576, 512).
    Page ids must be valid; no host sync, but float64 over the whole capacity: a correctness mode. An fp8
    kv_cache is read as fp8 * kv_scale (exact in float64), as tree_attention_mla reads it."""
    B, N, W = tree_mask.shape
    NH, D = q.shape[1], q.shape[2]
    page_size = kv_cache.shape[1]
    cap = page_table.shape[1] * page_size
    if kv_cache.dtype == torch.float8_e4m3fn:  # gathered as bytes (float8 indexing is missing from some builds)
        keys = kv_cache.view(torch.uint8)[page_table.long()].view(kv_cache.dtype).reshape(B, cap, D).double()
    else:
        keys = kv_cache[page_table.long()].reshape(B, cap, D).double()  # [B, cap, D]
    if kv_scale is not None:
        keys = keys * kv_scale.double().reshape(())
    pos = torch.arange(cap, device=q.device)
    j = pos[None, :] - prefix_lens.long()[:, None]  # [B, cap]: tree index of each slot (< 0: prefix)
    keys = keys.masked_fill((j >= N)[:, :, None], 0.0)  # slots past the tree: never read (0 x NaN would be NaN)
    in_tree = (j >= 0) & (j < N)
    word = tree_mask.long().gather(2, (j.clamp(0, N - 1) // 32)[:, None, :].expand(B, N, cap))  # [B, N, cap]
    bit = (word >> (j.clamp(0, N - 1) % 32)[:, None, :]) & 1
    visible = (j < 0)[:, None, :] | (in_tree[:, None, :] & (bit == 1))  # [B, N, cap]
    s = torch.einsum("bnhd,bcd->bnhc", q.view(B, N, NH, D).double(), keys) * scale
    s = s.masked_fill(~visible[:, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bnhc,bcd->bnhd", p, keys[..., :dv])  # [B, N, NH, dv]
    return out.reshape(B * N, NH, dv).to(q.dtype)


# ---- blocks and the model -----------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, cfg: TargetConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward_train(self, h: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
        """h [B, T, H] -> [B, T, H]: h + MLA(norm(h)), then + FFN(norm(.))."""
        h = h + self.self_attn.forward_train(self.input_layernorm(h), pos, inv_freq)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """Hugging Face's DeepseekV3Model: embed_tokens, layers, norm."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Target(_KeepFp32):
    """DeepSeek-V3 / Kimi-K2 causal LM: ``model`` (Backbone) and an untied ``lm_head``."""

    _fp32_buffers = ("inv_freq",)

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        # > 0: batch-invariant mode. Every step of at most this many tokens is padded to exactly this many rows
        # (the same GEMM kernels whatever the step's size: a plain step of B rows and a verify step of B * N
        # rows give each token bit-identical values) and attends through batch_invariant_mla_attention. Set it
        # to the verify step's B * N to check greedy losslessness bit for bit in bf16; 0 (default): off.
        self.batch_invariant_rows = 0
        # True: capture the plain-PyTorch way, as engines do (h + r at each captured layer, torch.cat after the
        # forward) instead of in the fused add + RMSNorm: issue 7's comparison (engine/torch_glue.py)
        self.plain_capture = False
        # the latent cache new_kv makes by default (dtype and fp8 scales; the decode loop's kv_dtype / kv_scale)
        self.kv_cache = KVCacheConfig()
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", yarn_inv_freq(cfg), persistent=False)

    # ---- construction ------------------------------------------------------------------------------
    @staticmethod
    def keeps_fp32(name: str) -> bool:
        """State-dict entries that stay fp32 whatever the model dtype (the routing bias)."""
        return name.endswith("e_score_correction_bias")

    def reset_rope(self) -> "Target":
        """Recompute the (non-persistent) rope frequencies on the weights' device, e.g. after building on
        the meta device and loading with assign=True."""
        self.inv_freq = yarn_inv_freq(self.cfg).to(self.lm_head.weight.device)
        return self

    @classmethod
    def synthesize(cls, cfg: TargetConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device="cpu") -> "Target":
        """Random weights from a seed, generated directly on ``device`` (so kimi-k2-slice never touches host
        memory): each tensor drawn in fp32 in state_dict order, then rounded to dtype. The same seed gives
        the same fp32 values on one device type for any dtype.

        Scales keep activations O(1): embeddings N(0, 1); input projections and the gate N(0, 1/fan_in);
        o_proj / down_proj additionally / sqrt(2 L) (the residual stream grows little over depth);
        lm_head N(0, 4/H) so that logits are not flat; norms 1; routing bias N(0, 0.05^2) in fp32.
        """
        with torch.device("meta"):
            model = cls(cfg)
        # allocated once in dtype (the routing bias stays fp32), then filled in place, tensor by tensor: the
        # peak is the model plus one fp32 tensor (kimi-k2-slice is most of an H200)
        model = model.to(dtype).to_empty(device=device)
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, t in model.state_dict().items():  # (views of the parameters; experts: of their stacks)
                shape, leaf = tuple(t.shape), name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
                if "norm" in leaf:
                    t.fill_(1.0)
                    continue
                std = {"embed_tokens": 1.0, "lm_head": 2.0 / math.sqrt(cfg.hidden_size)}.get(leaf)
                if cls.keeps_fp32(name):
                    std = 0.05
                elif std is None:
                    std = shape[-1] ** -0.5
                    if leaf in ("o_proj", "down_proj"):
                        std /= math.sqrt(2 * cfg.num_layers)
                t.copy_(torch.randn(shape, generator=g, device=device) * std)
        return model.reset_rope()

    def new_kv(self, batch: int, max_len: int, page_size: int = 16, dtype: Optional[torch.dtype] = None,
               device=None, config: Optional[KVCacheConfig] = None) -> PagedKV:
        """A paged latent cache: one [num_pages, page_size, kv_dim] tensor per layer, on the model's device unless
        given. Its dtype: `dtype` if given (fp8 then with scale 1.0), else config's (default self.kv_cache: "auto"
        is the model's dtype; fp8 e4m3 with config.scale per layer, or "calibrate")."""
        w = self.lm_head.weight
        config = config or self.kv_cache
        cache_dtype = dtype or config.torch_dtype(w.dtype)
        if cache_dtype == torch.float8_e4m3fn and w.dtype == torch.float64:
            raise ValueError("kv_dtype fp8_e4m3 needs a float32 / bfloat16 / float16 target (fp8 caches read bf16 / "
                             "fp16 queries), got a float64 one")
        scale = config.scale if dtype is None and config.fp8 else None
        return PagedKV([(self.cfg.kv_dim,)] * self.cfg.num_layers, batch, max_len, page_size=page_size,
                       dtype=cache_dtype, device=device if device is not None else w.device, kv_scale=scale)

    # ---- the training / reference forward -----------------------------------------------------------
    def forward_train(self, tokens: Tensor, output_hidden_states: bool = False):
        """Full causal sequence at positions 0..T-1, plain differentiable PyTorch, no cache.

        Parameters
        ----------
        tokens : Tensor [B, T] int64
        output_hidden_states : bool
            Also return Hugging Face's ``output_hidden_states``.

        Returns
        -------
        logits : Tensor [B, T, V] fp32
        hidden_states : tuple of L + 1 Tensor [B, T, H] model dtype, only with output_hidden_states
            Index 0: the embeddings; index i (1 <= i < L): the output of layer i-1 (the residual stream,
            aux id i-1); index L: the *final-normed* hidden, as DeepseekV3Model's last entry. So aux id
            L-1 (captured pre-norm) is ``model.norm``'s input, not hidden_states[L].
        """
        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device).expand(B, T)
        h = self.model.embed_tokens(tokens)  # [B, T, H]
        hidden = [h]
        for layer in self.model.layers:
            h = layer.forward_train(h, pos, self.inv_freq)
            hidden.append(h)
        x = self.model.norm(h)
        hidden[-1] = x  # HF: the last entry is taken after the final norm
        logits = self.lm_head(x).float()
        return (logits, tuple(hidden)) if output_hidden_states else logits

    # ---- the inference step -------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens: Tensor, positions: Tensor, kv: PagedKV, tree_mask: Tensor,
                aux: Optional[Tensor] = None, aux_ids: Sequence[int] = (), last_only: bool = False) -> Tensor:
        """One inference step over N new tokens per request (a prefill or chain is a causal tree).

        Writes the step's latent rows into every layer's cache at kv.prefix_lens + node and attends to
        the cached prefix plus each node's ancestors-or-self. Does not advance kv.prefix_lens.

        Parameters
        ----------
        tokens : Tensor [B, N] int64
            Node tokens, node-major per request (node 0: the root / first new token).
        positions : Tensor [B, N] int64
            RoPE positions: prefix_len + depth for a tree, prefix_len + i for a chain or a prefill.
        kv : PagedKV
            new_kv(...): L latent caches [num_pages, page_size, kv_dim] (the model's dtype, bf16, or fp8 e4m3 with
            kv.scale(i) per layer), page_table, prefix_lens [B] int32.
        tree_mask : Tensor [B, N, ceil(N / 32)] int32
            Ancestor-or-self bits (eagle3_ops.tree.tree_mask).
        aux : Tensor [B * N, n_aux * H] model dtype, optional, mutated
            Capture buffer; slot j receives the residual stream named by aux_ids[j].
        aux_ids : sequence of int
            Ours (id k = output of layer k, -1 = the embedding: validate with wiring.validate_aux_ids,
            allow_embedding=True, before passing it), slot order.
        last_only : bool
            Only each request's last row through lm_head (a prefill: [B * N, V] fp32 logits of a 32768-token
            prompt would not fit).

        Returns
        -------
        logits : Tensor [B * N, V] fp32 ([B, V] with last_only)
        """
        cfg, layers = self.cfg, self.model.layers
        B, N = tokens.shape
        T, L = B * N, cfg.num_layers
        if positions.shape != tokens.shape:
            raise ValueError(f"positions must have tokens' shape [B, N] = {list(tokens.shape)}, "
                             f"got {list(positions.shape)}")
        sites = dict(capture_sites(aux_ids, L)) if len(aux_ids) else {}  # site -> slot
        if sites and aux is None:
            raise ValueError(f"aux_ids = {list(aux_ids)} need an aux buffer [B * N, n_aux * H]")

        def aux_at(site):
            return (aux, sites[site]) if site in sites else (None, 0)

        pos = positions.reshape(T)
        residual = self.model.embed_tokens(tokens).view(T, cfg.hidden_size)  # [T, H]
        invariant = 0 < T <= self.batch_invariant_rows  # (a prefill is shared by plain and speculative runs)
        pad = self.batch_invariant_rows - T if invariant else 0
        real = None
        if pad:  # zero rows (and position 0) up to the fixed row count; captured and returned: the real rows
            residual = torch.nn.functional.pad(residual, (0, 0, 0, pad))
            pos = torch.nn.functional.pad(pos, (0, pad))
            real = torch.arange(T, device=residual.device)
        plain = {} if self.plain_capture and sites else None  # slot -> captured rows (plain_capture)
        if plain is not None:
            sites, plain_sites = {}, sites
        if 0 in sites:  # aux id -1: the embedding
            torch.ops.eagle3.capture_aux(residual, None, aux, sites[0], real)
        elif plain is not None and 0 in plain_sites:
            plain[plain_sites[0]] = residual[:T].clone()
        x = layers[0].input_layernorm(residual)  # no add before the first norm
        for i, layer in enumerate(layers):
            if plain is not None and i > 0 and i in plain_sites:
                plain[plain_sites[i]] = (x + residual)[:T]
            if i > 0:  # residual += x (the output of layer i-1: site i), x = norm(residual)
                aux_i, slot = aux_at(i)
                torch.ops.eagle3.add_rmsnorm_capture(x, residual, layer.input_layernorm.weight, cfg.rms_norm_eps,
                                                     aux_i, slot, real if aux_i is not None else None)
            x = layer.self_attn(x, pos, self.inv_freq, kv, i, tree_mask, invariant)
            torch.ops.eagle3.add_rmsnorm_capture(x, residual, layer.post_attention_layernorm.weight,
                                                 cfg.rms_norm_eps, None, 0, None)
            x = layer.mlp(x, invariant=invariant) if isinstance(layer.mlp, MoE) else layer.mlp(x)
        if plain is not None and L in plain_sites:
            plain[plain_sites[L]] = (x + residual)[:T]
        aux_L, slot = aux_at(L)
        torch.ops.eagle3.add_rmsnorm_capture(x, residual, self.model.norm.weight, cfg.rms_norm_eps, aux_L, slot,
                                             real if aux_L is not None else None)  # site L: layer L-1's output
        if plain is not None:
            torch.cat([plain[j] for j in range(len(plain))], -1, out=aux)
        if last_only:
            return self.lm_head(x[:T].view(B, N, -1)[:, -1]).float()
        return self.lm_head(x)[:T].float()


__all__ = ["Target", "route", "RMSNorm", "MLP", "MoE", "Experts", "MLA", "Block", "LATENT_NORM_EPS",
           "batch_invariant_mla_attention"]
