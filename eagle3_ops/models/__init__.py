"""The reference models: a DeepSeek-V3 / Kimi-K2 target (MLA with a paged latent cache, YaRN RoPE,
sigmoid-routed MoE) and its EAGLE-3 drafter, whose hot paths run through torch.ops.eagle3."""

from .config import TARGET_PRESETS, DrafterConfig, TargetConfig  # noqa: F401
