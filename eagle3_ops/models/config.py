"""Model configurations: the DeepSeek-V3 / Kimi-K2 target and its EAGLE-3 drafter, with presets by
exact name (docs/models.md) and conversion to and from Hugging Face config.json fields.

`TargetConfig.from_preset("kimi-k2")` gives the real shapes; `kimi-k2-slice` keeps every width and
fewer layers (fits one H200); `tiny` is a seconds-on-CPU shape for tests; `byte-small` is the shipped
small pair's target (byte-level vocabulary, trained on CPU: scripts/train_small_pair.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class TargetConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: Optional[int]  # None: q = x W_q directly (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # dense FFN (the first first_k_dense_replace layers)
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    rope_theta: float
    rope_factor: float  # YaRN, always applied
    beta_fast: float
    beta_slow: float
    original_max_position: int
    max_position: int
    mscale_all_dim: float
    rms_norm_eps: float
    name: str = "custom"

    # ---- derived -----------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_dim(self) -> int:
        """Cached values per token per layer: the latent plus the shared rope key (576 for Kimi)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5 * m * m, m = 0.1 * mscale_all_dim * ln(factor) + 1 (0.130861 for Kimi-K2)."""
        m = 0.1 * self.mscale_all_dim * math.log(self.rope_factor) + 1.0 if self.rope_factor > 1 else 1.0
        return self.qk_head_dim ** -0.5 * m * m

    def is_moe(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    # ---- presets and Hugging Face fields ----------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "TargetConfig":
        if name not in TARGET_PRESETS:
            raise ValueError(f"unknown target preset {name!r}; presets: {', '.join(TARGET_PRESETS)}")
        return replace(TARGET_PRESETS[name], **overrides)

    def to_hf(self) -> dict:
        """config.json fields in DeepSeek-V3's Hugging Face naming."""
        return {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "eagle3_ops_preset": self.name,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim, "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size, "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "n_shared_experts": self.n_shared_experts,
            "first_k_dense_replace": self.first_k_dense_replace, "routed_scaling_factor": self.routed_scaling_factor,
            "n_group": self.n_group, "topk_group": self.topk_group, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "norm_topk_prob": True, "rope_theta": self.rope_theta,
            "rope_scaling": {"type": "yarn", "factor": self.rope_factor, "beta_fast": self.beta_fast,
                             "beta_slow": self.beta_slow, "mscale": 1.0, "mscale_all_dim": self.mscale_all_dim,
                             "original_max_position_embeddings": self.original_max_position},
            "max_position_embeddings": self.max_position, "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": False,
        }

    @classmethod
    def from_hf(cls, hf: dict) -> "TargetConfig":
        rs = hf.get("rope_scaling") or {}
        if rs and rs.get("type", rs.get("rope_type")) != "yarn":
            raise ValueError(f"config.json rope_scaling must be YaRN, got {rs!r}")
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"], q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
            intermediate_size=hf["intermediate_size"], moe_intermediate_size=hf.get("moe_intermediate_size", 0),
            n_routed_experts=hf.get("n_routed_experts") or 0, num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            n_shared_experts=hf.get("n_shared_experts") or 0,
            first_k_dense_replace=hf.get("first_k_dense_replace", 0),
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.0), n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1, rope_theta=hf.get("rope_theta", 10000.0),
            rope_factor=rs.get("factor", 1.0), beta_fast=rs.get("beta_fast", 32.0), beta_slow=rs.get("beta_slow", 1.0),
            original_max_position=rs.get("original_max_position_embeddings", hf.get("max_position_embeddings", 4096)),
            max_position=hf.get("max_position_embeddings", 4096), mscale_all_dim=rs.get("mscale_all_dim", 1.0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), name=hf.get("eagle3_ops_preset", "custom"),
        )


_KIMI_K2 = TargetConfig(
    vocab_size=163840, hidden_size=7168, num_layers=61, num_heads=64, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048,
    n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=2.827, n_group=1, topk_group=1, rope_theta=50000.0, rope_factor=32.0, beta_fast=1.0,
    beta_slow=1.0, original_max_position=4096, max_position=131072, mscale_all_dim=1.0, rms_norm_eps=1e-6,
    name="kimi-k2",
)

TARGET_PRESETS: dict[str, TargetConfig] = {
    "kimi-k2": _KIMI_K2,
    "kimi-k2.5": replace(_KIMI_K2, rope_factor=64.0, beta_fast=32.0, max_position=262144, rms_norm_eps=1e-5,
                         name="kimi-k2.5"),
    "deepseek-v3": replace(_KIMI_K2, vocab_size=129280, num_heads=128, n_routed_experts=256, first_k_dense_replace=3,
                           routed_scaling_factor=2.5, n_group=8, topk_group=4, rope_theta=10000.0, rope_factor=40.0,
                           beta_fast=32.0, max_position=163840, name="deepseek-v3"),
    # every width real; as many layers as one H200 holds in bf16 (one dense layer + two MoE layers)
    "kimi-k2-slice": replace(_KIMI_K2, num_layers=3, name="kimi-k2-slice"),
    # seconds on a CPU: every structural feature (q compression, MoE with groups, shared expert, dense layer)
    "tiny": TargetConfig(
        vocab_size=97, hidden_size=32, num_layers=8, num_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, n_group=2, topk_group=1, rope_theta=10000.0, rope_factor=4.0, beta_fast=32.0,
        beta_slow=1.0, original_max_position=64, max_position=256, mscale_all_dim=1.0, rms_norm_eps=1e-6,
        name="tiny",
    ),
    # the shipped small pair's target: byte-level, trained on CPU in minutes
    "byte-small": TargetConfig(
        vocab_size=256, hidden_size=128, num_layers=8, num_heads=4, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=256, moe_intermediate_size=64,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=1.0, n_group=1, topk_group=1, rope_theta=10000.0, rope_factor=4.0, beta_fast=32.0,
        beta_slow=1.0, original_max_position=256, max_position=1024, mscale_all_dim=1.0, rms_norm_eps=1e-6,
        name="byte-small",
    ),
}


def _slice_aux_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default (wiring.default_aux_ids) from 7 layers on; a shallower slice of a model (kimi-k2-slice:
    3 layers) captures the outputs of its last three layers instead."""
    from ..wiring import default_aux_ids

    return default_aux_ids(num_layers) if num_layers >= 7 or num_layers < 3 else list(range(num_layers - 3, num_layers))


@dataclass(frozen=True)
class DrafterConfig:
    """EAGLE-3 head: one Llama decoder layer whose attention input is cat(input_layernorm(embed(tok)),
    hidden_norm(h)) (2H wide, embedding first), fed by fc(aux) on the first pass of a round."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's (the embedding is the target's, frozen)
    draft_vocab_size: int  # lm_head rows; draft id -> target id by draft + d2t[draft]
    target_hidden_size: int
    aux_ids: tuple[int, ...]  # ours: output of layer k (eagle3_ops.wiring)
    rope_theta: float = 10000.0
    max_position: int = 4096
    rms_norm_eps: float = 1e-6
    norm_before_fc: bool = False  # EAGLE-3.1: one RMSNorm over the n_aux * H row
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per H chunk (fc_norm.{0,1,2})
    norm_output: bool = False  # the post-norm hidden (not the pre-norm one) feeds the next step
    name: str = "custom"

    @property
    def n_aux(self) -> int:
        return len(self.aux_ids)

    @classmethod
    def for_target(cls, target: TargetConfig, aux_ids=None, **overrides) -> "DrafterConfig":
        """The Kimi EAGLE-3 drafter's shape scaled to a target (docs/models.md): hidden = target hidden, the
        target's head count with KV heads = heads, head_dim 128 (hidden / heads on small targets), MLP
        18432/7168 of hidden, draft vocab 32000 (capped at the target's)."""
        H, heads = target.hidden_size, target.num_heads
        base = dict(
            hidden_size=H, num_heads=heads, num_kv_heads=heads, head_dim=128 if H >= 1024 else H // heads,
            intermediate_size=H * 18432 // 7168, vocab_size=target.vocab_size,
            draft_vocab_size=min(32000, target.vocab_size), target_hidden_size=H,
            aux_ids=tuple(aux_ids if aux_ids is not None else _slice_aux_ids(target.num_layers)),
            rope_theta=target.rope_theta, max_position=target.max_position, rms_norm_eps=target.rms_norm_eps,
            name=f"eagle3-{target.name}",
        )
        base.update(overrides)
        return cls(**base)

    def to_hf(self, convention: str = "output", num_layers: Optional[int] = None) -> dict:
        """config.json in the SpecForge / Hugging Face EAGLE-3 (LlamaForCausalLMEagle3) naming."""
        from ..wiring import drafter_config_fields

        return {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "eagle3_ops_preset": self.name,
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position,
            "rms_norm_eps": self.rms_norm_eps, "num_hidden_layers": 1, "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm, "norm_output": self.norm_output,
            "eagle_config": drafter_config_fields(list(self.aux_ids), convention, num_layers),
        }

    @classmethod
    def from_hf(cls, hf: dict, num_layers: int, convention: Optional[str] = None) -> "DrafterConfig":
        """Read a drafter config.json; the capture ids go through eagle3_ops.wiring (which refuses an
        unknown convention)."""
        from ..wiring import read_drafter_config

        wiring = read_drafter_config(hf, num_layers, convention=convention)
        return cls(
            hidden_size=hf["hidden_size"], num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
            draft_vocab_size=hf.get("draft_vocab_size", hf["vocab_size"]),
            target_hidden_size=hf.get("target_hidden_size", hf["hidden_size"]), aux_ids=tuple(wiring.ids),
            rope_theta=hf.get("rope_theta", 10000.0), max_position=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), norm_before_fc=bool(hf.get("norm_before_fc", False)),
            fc_norm=bool(hf.get("fc_norm", False)), norm_output=bool(hf.get("norm_output", False)),
            name=hf.get("eagle3_ops_preset", "custom"),
        )


__all__ = ["TargetConfig", "DrafterConfig", "TARGET_PRESETS"]
