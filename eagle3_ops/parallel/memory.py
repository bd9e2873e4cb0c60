"""What one rank of the sharded model holds, by part, in bytes (docs/tp.md's arithmetic): the weights as
parallel/target.py and parallel/glue.py shard them, the target's latent cache (whole on every rank) and the
drafter's K / V cache (replicated). Counted from the configs alone (no model is built), so the 61-layer
kimi-k2 can be planned on any machine; tests/test_tp.py holds it to a built model's own byte count."""

from __future__ import annotations

from ..models.config import DrafterConfig, TargetConfig


def rank_bytes(cfg: TargetConfig, dcfg: DrafterConfig, world: int, batch: int, max_len: int, *,
               weight_bytes: float = 2, expert_bytes: float = 1, cache_bytes: float = 2,
               fc: str = "sharded", moe: str = "ep") -> dict:
    """Bytes on one of ``world`` ranks, by part. expert_bytes: 1 for fp8 (plus one fp32 scale per row), 0.5
    for int4 (plus, W4A16's usual group of 128, one bf16 scale per 128 weights; not built), or the model
    dtype's; moe: "ep" or "tp" (parallel/target.EPMoE); weight_bytes: every other weight (bf16: 2); cache_bytes: the caches' element. max_len: positions
    a request's caches hold. The routing bias (fp32, E a layer) and the rope table are left out."""
    H, L, NH, V = cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.vocab_size
    nh = NH // world
    q = (H * cfg.q_lora_rank + cfg.q_lora_rank * nh * cfg.qk_head_dim) if cfg.q_lora_rank else H * nh * cfg.qk_head_dim
    attn = q + H * cfg.kv_dim + cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) + nh * cfg.v_head_dim * H
    moe_layers = sum(cfg.is_moe(i) for i in range(L))
    I = cfg.moe_intermediate_size
    # moe "ep": E / world whole experts; "tp": every expert's I / world columns
    local_experts, Il = (cfg.n_routed_experts // world, I) if moe == "ep" else (cfg.n_routed_experts, I // world)
    per_expert = 3 * Il * H
    # fp8: an fp32 scale per row (gate_up's 2I, down's H); int4: a bf16 scale per group of 128; else none
    scales = 4 * (2 * Il + H) if expert_bytes == 1 else 2 * per_expert / 128 if expert_bytes < 1 else 0
    out = dict(
        attention=L * attn * weight_bytes,
        routed_experts=moe_layers * local_experts * (per_expert * expert_bytes + scales),
        shared_experts=moe_layers * 3 * H * I * cfg.n_shared_experts // world * weight_bytes,
        dense_ffn=(L - moe_layers) * 3 * H * cfg.intermediate_size // world * weight_bytes,
        gate=moe_layers * cfg.n_routed_experts * H * weight_bytes,
        embedding=V * H * weight_bytes,
        lm_head=-(-V // world) * H * weight_bytes,
        norms=(L * (2 * H + (cfg.q_lora_rank or 0) + cfg.kv_lora_rank) + H) * weight_bytes,
        latent_cache=L * batch * max_len * cfg.kv_dim * cache_bytes,
    )
    Hd, hd = dcfg.hidden_size, dcfg.head_dim
    layer = (2 * Hd * (dcfg.num_heads + 2 * dcfg.num_kv_heads) * hd + dcfg.num_heads * hd * Hd
             + 3 * Hd * dcfg.intermediate_size + dcfg.draft_vocab_size * Hd + 4 * Hd
             + dcfg.n_aux * dcfg.target_hidden_size * (dcfg.norm_before_fc or dcfg.fc_norm))
    fc_w = Hd * dcfg.n_aux * dcfg.target_hidden_size // (world if fc == "sharded" else 1)
    out["drafter"] = (layer + fc_w) * weight_bytes
    out["drafter_cache"] = batch * max_len * 2 * dcfg.num_kv_heads * hd * cache_bytes
    out["total"] = sum(out.values())
    return out




def moe_experts_read(cfg: TargetConfig, world: int, tokens: int, trials: int = 2000, seed: int = 0) -> dict:
    """Expert weights a rank streams in one MoE layer for `tokens` tokens, in whole experts' worth, under
    uniform top-k routing (a Monte Carlo estimate; real routing is skewed, which widens EP's gap): "tp" reads
    1/world of every distinct expert used (the same on every rank); "ep" reads its own distinct experts, and the
    layer's all-reduce waits for the rank with the most ("ep_max", the mean over trials of the busiest rank)."""
    import torch

    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(trials, tokens, E, generator=g).argsort(-1)[..., :k].reshape(trials, -1)
    used = torch.zeros(trials, E, dtype=torch.bool).scatter_(1, picks, True)
    per_rank = used.view(trials, world, E // world).sum(-1).float()
    return dict(distinct=float(used.sum(1).float().mean()), tp=float(used.sum(1).float().mean()) / world,
                ep_mean=float(per_rank.mean()), ep_max=float(per_rank.max(1).values.mean()))


__all__ = ["rank_bytes", "moe_experts_read"]
