"""fp8 routed experts (e4m3, one fp32 scale per output row), the form the 61-layer kimi-k2 fits 8 H200s in
(docs/tp.md, the memory arithmetic).

Weights: ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] float8_e4m3fn, ``gate_up_scale`` [E, 2I] and
``down_scale`` [E, H] fp32; expert e's weight is ``q.float() * scale[..., None]``.

The grouped GEMMs (``gate_up_mm`` / ``down_mm``: rows sorted by expert, ``offs`` the groups' end offsets as
torch._grouped_mm takes them, rows past the last offset left unwritten):

- CUDA: torch._scaled_grouped_mm (W8A8: the activations quantised per row to e4m3 with their own scales, the
  weight scales per output column; bf16 out). No host sync: a CUDA graph holds it.
- elsewhere: each expert's rows through its dequantised weight (the offsets read on the host): the
  reference the CUDA path is held to (tests/test_tp.py, a GPU test).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., N, K] -> (q [..., N, K] e4m3, scale [..., N] fp32): per row, scale = amax / 448."""
    amax = w.float().abs().amax(-1).clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (w.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Experts(nn.Module):
    """The routed experts in fp8 (module docstring); ``experts[e](x)`` is expert e's SwiGLU in x's dtype."""

    def __init__(self, num: int, hidden: int, intermediate: int):
        super().__init__()
        self.num, self.intermediate, self.hidden = num, intermediate, hidden
        self.gate_up = nn.Parameter(torch.empty(num, 2 * intermediate, hidden, dtype=FP8), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num, hidden, intermediate, dtype=FP8), requires_grad=False)
        self.register_buffer("gate_up_scale", torch.ones(num, 2 * intermediate, dtype=torch.float32))
        self.register_buffer("down_scale", torch.ones(num, hidden, dtype=torch.float32))

    def __len__(self) -> int:
        return self.num

    def _apply(self, fn, recurse=True):
        """.to(dtype) casts neither the fp8 weights nor their fp32 scales (only moves them)."""
        # (the tensors themselves: a parameter may be converted in place, its .data swapped)
        saved = {n: getattr(self, n).data for n in ("gate_up", "down", "gate_up_scale", "down_scale")}
        super()._apply(fn, recurse)
        for n, old in saved.items():
            new = getattr(self, n)
            if new.dtype != old.dtype:
                moved = old.to(device=new.device)
                if n in self._parameters:
                    self._parameters[n] = nn.Parameter(moved, requires_grad=False)
                else:
                    self._buffers[n] = moved
        return self

    @classmethod
    def from_weights(cls, gate_up: Tensor, down: Tensor) -> "Fp8Experts":
        """Quantise [E, 2I, H] / [E, H, I] weights (an Experts' stacks) per row."""
        E, I2, H = gate_up.shape
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.num, m.intermediate, m.hidden = E, I2 // 2, H
        q1, s1 = quantize_rows(gate_up)
        q2, s2 = quantize_rows(down)
        m.gate_up, m.down = nn.Parameter(q1, requires_grad=False), nn.Parameter(q2, requires_grad=False)
        m.register_buffer("gate_up_scale", s1)
        m.register_buffer("down_scale", s2)
        return m

    @torch.no_grad()
    def synthesize_(self, g: torch.Generator, num_layers: int, down_fan_in: int = 0) -> None:
        """Random weights at Target.synthesize's scales, drawn in place one expert at a time (N(0, 1) in e4m3,
        the scale carrying the std: 1 / sqrt(fan_in), down's / sqrt(2 L) too; down_fan_in: the whole
        expert's I when these are its columns, default this module's)."""
        dev = self.gate_up.device
        for e in range(self.num):
            self.gate_up[e].copy_(torch.randn(self.gate_up.shape[1:], generator=g, device=dev))
            self.down[e].copy_(torch.randn(self.down.shape[1:], generator=g, device=dev))
        self.gate_up_scale.fill_(self.hidden ** -0.5)
        self.down_scale.fill_((down_fan_in or self.intermediate) ** -0.5 / math.sqrt(2 * num_layers))

    def weights(self, e: int) -> tuple[Tensor, Tensor, Tensor]:
        """Expert e's (gate_proj, up_proj, down_proj) weights, dequantised to fp32."""
        I = self.intermediate
        gu = self.gate_up[e].float() * self.gate_up_scale[e, :, None]
        return gu[:I], gu[I:], self.down[e].float() * self.down_scale[e, :, None]

    def __getitem__(self, e: int):
        g, u, d = self.weights(e)
        return lambda x: F.linear(F.silu(F.linear(x.float(), g)) * F.linear(x.float(), u), d).to(x.dtype)

    def _mm(self, a: Tensor, q: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
        """a [M, K] rows grouped by offs -> [M, N] in a's dtype, group g through q[g] [N, K] * scale[g]."""
        out = a.new_empty(a.shape[0], q.shape[1])
        if a.is_cuda:
            amax = a.float().abs().amax(-1).clamp(min=1e-12)
            sa = amax / FP8_MAX
            qa = (a.float() / sa[:, None]).to(FP8)
            res = torch._scaled_grouped_mm(qa, q.transpose(1, 2), sa, scale, offs=offs, out_dtype=torch.bfloat16)
            return res.to(a.dtype)
        lo = 0
        for g, hi in enumerate(offs.tolist()):
            if hi > lo:
                out[lo:hi] = F.linear(a[lo:hi].float(), q[g].float() * scale[g, :, None]).to(a.dtype)
            lo = hi
        return out

    def gate_up_mm(self, a: Tensor, offs: Tensor) -> Tensor:
        return self._mm(a, self.gate_up, self.gate_up_scale, offs)

    def down_mm(self, a: Tensor, offs: Tensor) -> Tensor:
        return self._mm(a, self.down, self.down_scale, offs)


__all__ = ["Fp8Experts", "quantize_rows", "FP8"]
