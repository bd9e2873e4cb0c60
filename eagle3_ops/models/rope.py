"""YaRN rotary position embedding of the DeepSeek-V3 / Kimi-K2 targets (docs/models.md), on the rope slice.

Pairs are interleaved: (x[2i], x[2i+1]) rotates by angle ``position * freq_i`` (DeepSeek's own inference
code; Hugging Face de-interleaves first and then rotates halves, which gives the same q.k). YaRN is always
applied, and cos / sin are unscaled because Kimi and DeepSeek set mscale == mscale_all_dim (the
attention-side factor lives in ``TargetConfig.softmax_scale``):

    inv_freq_i = theta ** (-2i / R)                          i = 0 .. R/2 - 1, R = qk_rope_head_dim
    corr(n)    = R * ln(original_max_position / (2 pi n)) / (2 ln theta)
    low        = max(floor(corr(beta_fast)), 0),   high = min(ceil(corr(beta_slow)), R - 1)
    ramp_i     = clamp((i - low) / (high - low), 0, 1)
    freq_i     = inv_freq_i / factor * ramp_i + inv_freq_i * (1 - ramp_i)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import TargetConfig


def yarn_inv_freq(cfg: TargetConfig) -> Tensor:
    """YaRN frequencies of the rope slice.

    Parameters
    ----------
    cfg : TargetConfig
        Uses qk_rope_head_dim (R), rope_theta, rope_factor, beta_fast, beta_slow, original_max_position.

    Returns
    -------
    freq : Tensor [R / 2] fp32, on the CPU
        Computed in float64, rounded once.
    """
    R, theta = cfg.qk_rope_head_dim, cfg.rope_theta
    if R % 2:
        raise ValueError(f"qk_rope_head_dim must be even (rotated in pairs), got {R}")
    i = torch.arange(R // 2, dtype=torch.float64)
    inv_freq = theta ** (-2 * i / R)

    def corr(n: float) -> float:  # the dimension whose wavelength fits n times into the original context
        return R * math.log(cfg.original_max_position / (2 * math.pi * n)) / (2 * math.log(theta))

    low = max(math.floor(corr(cfg.beta_fast)), 0)
    high = min(math.ceil(corr(cfg.beta_slow)), R - 1)
    if high == low:
        high += 0.001  # as DeepSeek's reference code: avoid a division by zero (a step instead of a ramp)
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    freq = inv_freq / cfg.rope_factor * ramp + inv_freq * (1 - ramp)
    return freq.to(torch.float32)


def apply_rope(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate interleaved pairs: (x[2i], x[2i+1]) by the angle positions * inv_freq[i].

    Parameters
    ----------
    x : Tensor [..., R] bf16 | fp16 | fp32
        The rope slice (q_pe per head, or the shared k_pe).
    positions : Tensor [...] int64
        Position of each row. Its shape is x.shape[:-1] or a leading part of it (e.g. [B, T] for x
        [B, T, NH, R]): it broadcasts over the remaining dims.
    inv_freq : Tensor [R / 2] fp32
        yarn_inv_freq(cfg), on x's device.

    Returns
    -------
    out : Tensor [..., R] x's dtype
        Computed in fp32, rounded once.
    """
    R = x.shape[-1]
    if inv_freq.shape != (R // 2,) or R % 2:
        raise ValueError(f"x's last dim R = {R} must be even and inv_freq must have shape (R / 2,) = ({R // 2},), "
                         f"got {tuple(inv_freq.shape)}")
    lead = x.shape[:-1]
    if positions.dim() > len(lead) or tuple(positions.shape) != tuple(lead[:positions.dim()]):
        raise ValueError(f"positions must have shape x.shape[:-1] = {tuple(lead)} or a leading part of it, "
                         f"got {tuple(positions.shape)}")
    pos = positions.reshape(tuple(positions.shape) + (1,) * (len(lead) - positions.dim()))
    angle = pos.to(torch.float32)[..., None] * inv_freq.to(torch.float32)  # [..., R/2]
    cos, sin = torch.cos(angle), torch.sin(angle)
    pairs = x.to(torch.float32).unflatten(-1, (R // 2, 2))  # [..., R/2, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


__all__ = ["yarn_inv_freq", "apply_rope"]
