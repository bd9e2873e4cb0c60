"""Paged KV caches with static shapes, in docs/design.md's layout: a list of cache tensors
[num_pages, page_size, *row_shape] sharing one page table [B, max_pages] int32 and prefix_lens [B] int32.

The target keeps one latent cache per layer ([.., kv_lora_rank + rope_dim]); the drafter keeps K and V
([.., num_kv_heads, head_dim] each). `write` stores a step's rows at positions prefix_lens + node, as
the verify convention says; `prefix_lens` advances only through kv_accept (or `advance` after a
prefill). Nothing here synchronises the host.

An fp8 e4m3 cache (dtype torch.float8_e4m3fn; for the target's latent caches, which tree_attention_mla reads)
holds each row quantised as vLLM's concat_and_cache_mla stores it: fp8(clamp(row / kv_scale, -448, 448)),
one fp32 scale per layer (PagedKV.scale(i), a device tensor: graph-safe), read back as fp8 * kv_scale.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_quantize(x: Tensor, kv_scale: Tensor) -> Tensor:
    """x [..] (any float dtype) -> float8_e4m3fn: x / kv_scale in fp32, saturated to +-448 (vLLM's
    scaled_convert: an IEEE divide, then the satfinite round-to-nearest-even conversion; a plain cast would
    give NaN past 448 on some torch builds), NaN kept. kv_scale: [] or [1] fp32 on x's device."""
    return (x.float() / kv_scale.float().reshape(())).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_dequantize(x: Tensor, kv_scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """fp8 x -> fp8 * kv_scale in fp32 (what tree_attention_mla reads), then `dtype`."""
    return (x.float() * kv_scale.float().reshape(())).to(dtype)


class PagedKV:
    def __init__(self, row_shapes: Sequence[tuple[int, ...]], batch: int, max_len: int, page_size: int = 16,
                 dtype: torch.dtype = torch.float32, device="cpu", shuffle_pages: bool = True, seed: int = 0,
                 kv_scale: Union[float, Sequence[float], Tensor, None] = None):
        """One cache tensor per entry of row_shapes, room for max_len positions per request. Pages are
        handed out in a shuffled order (as a real allocator would) so that paging bugs show.

        dtype torch.float8_e4m3fn: fp8 caches with a per-cache fp32 scale, kv_scale a float for every cache,
        one per cache, or a [len(row_shapes)] fp32 tensor (default 1.0: SGLang's unscaled cast; a checkpoint's
        k_scale where it has one). kv_scale with any other dtype is refused."""
        if batch < 1 or max_len < 1 or page_size < 1:
            raise ValueError(f"batch, max_len and page_size must be >= 1, got {batch}, {max_len}, {page_size}")
        self.kv_scales: Optional[Tensor] = None  # [len(caches)] fp32 on the device, fp8 caches only
        if dtype == torch.float8_e4m3fn:
            scales = torch.as_tensor(1.0 if kv_scale is None else kv_scale, dtype=torch.float32)
            scales = scales.expand(len(row_shapes)) if scales.dim() == 0 else scales
            if scales.shape != (len(row_shapes),) or not bool(((scales > 0) & (scales < float("inf"))).all()):
                raise ValueError(f"kv_scale must be one finite scale > 0 or one per cache ({len(row_shapes)}), got "
                                 f"{kv_scale!r}")
            self.kv_scales = scales.to(device).contiguous()
        elif kv_scale is not None:
            raise ValueError(f"kv_scale is the scale of an fp8 cache: pass dtype=torch.float8_e4m3fn, got {dtype}")
        self.page_size = page_size
        self.max_pages = -(-max_len // page_size)
        num_pages = batch * self.max_pages
        self.caches = [torch.zeros(num_pages, page_size, *shape, dtype=dtype, device=device) for shape in row_shapes]
        order = (torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)) if shuffle_pages
                 else torch.arange(num_pages))
        self.page_table = order.view(batch, self.max_pages).to(torch.int32).to(device)
        self.prefix_lens = torch.zeros(batch, dtype=torch.int32, device=device)

    def scale(self, i: int) -> Optional[Tensor]:
        """caches[i]'s dequantisation scale, a [] fp32 view on the device (tree_attention_mla's kv_scale), or
        None for a bf16 / fp16 / fp32 cache."""
        return None if self.kv_scales is None else self.kv_scales[i]

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    @property
    def capacity(self) -> int:
        return self.max_pages * self.page_size

    def reset(self) -> None:
        self.prefix_lens.zero_()

    def index(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """(page, slot) of positions pos[b, j] of request b; pos [B, n] int64."""
        page = torch.gather(self.page_table.long(), 1, torch.div(pos, self.page_size, rounding_mode="floor"))
        return page, pos % self.page_size

    def slots(self, nodes: Tensor) -> tuple[Tensor, Tensor]:
        """(page, slot) of positions prefix_lens[b] + nodes[b, j]; nodes [B, N] int64."""
        return self.index(self.prefix_lens[:, None].long() + nodes)

    def write(self, i: int, rows: Tensor, nodes: Optional[Tensor] = None) -> None:
        """caches[i] at positions prefix_lens[b] + nodes[b, j] <- rows[b, j]; rows [B, N, *row_shape],
        nodes [B, N] int64 (default 0..N-1: the verify convention). An fp8 cache stores fp8_quantize(rows,
        scale(i))."""
        B, N = rows.shape[0], rows.shape[1]
        if nodes is None:
            nodes = torch.arange(N, device=rows.device).expand(B, N)
        page, slot = self.slots(nodes)
        scale = self.scale(i)
        if scale is None:
            self.caches[i][page, slot] = rows.to(self.caches[i].dtype)
        else:  # as bytes: index_put on float8 tensors is missing from some CUDA builds of torch
            self.caches[i].view(torch.uint8)[page, slot] = fp8_quantize(rows, scale).view(torch.uint8)

    def advance(self, n) -> None:
        """prefix_lens += n (after a prefill whose rows are all kept)."""
        self.prefix_lens += n
