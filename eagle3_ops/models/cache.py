"""Paged KV caches with static shapes, in docs/design.md's layout: a list of cache tensors
[num_pages, page_size, *row_shape] sharing one page table [B, max_pages] int32 and prefix_lens [B] int32.

The target keeps one latent cache per layer ([.., kv_lora_rank + rope_dim]); the drafter keeps K and V
([.., num_kv_heads, head_dim] each). `write` stores a step's rows at positions prefix_lens + node, as
the verify convention says; `prefix_lens` advances only through kv_accept (or `advance` after a
prefill). Nothing here synchronises the host.

An fp8 e4m3 cache (dtype torch.float8_e4m3fn; for the target's latent caches, which tree_attention_mla reads)
holds each row quantised as vLLM's concat_and_cache_mla stores it: fp8(clamp(row / kv_scale, -448, 448)),
one fp32 scale per layer (PagedKV.scale(i), a device tensor: graph-safe), read back as fp8 * kv_scale.
KVCacheConfig spells the choice as vLLM's --kv-cache-dtype does ("auto" / "bf16" / "fp8" = "fp8_e4m3"), with the
scales given (one for every layer or one per layer; default 1.0, SGLang's unscaled cast) or "calibrate": amax / 448
per layer over the prefill's rows (PagedKV.calibrate_from, on the device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8 = torch.float8_e4m3fn
# kv_dtype's spellings (vLLM's --kv-cache-dtype: auto, bfloat16, fp8 = fp8_e4m3) -> the cache dtype (None: the model's)
KV_DTYPES = {"auto": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp8": FP8, "fp8_e4m3": FP8}
CALIBRATE = "calibrate"


@dataclass(frozen=True)
class KVCacheConfig:
    """The target's latent cache: its dtype and, for fp8, its per-layer dequantisation scales.

    dtype : str
        kv_dtype, vLLM's --kv-cache-dtype spelling: "auto" (the model's dtype), "bf16" / "bfloat16", or "fp8" /
        "fp8_e4m3" (float8_e4m3fn; fp8_e5m2 and vLLM's other fp8 layouts are not supported).
    scale : float, sequence of float, or "calibrate"
        kv_scale, fp8 only: key = fp8 * scale (vLLM's k_scale), one for every layer or one per layer (default
        1.0: SGLang's unscaled cast); "calibrate": amax / 448 per layer over the prefill's latent rows, computed on
        the device once the prefill is over (PagedKV.calibrate_from: the prefill runs on a cache in the model's
        dtype, whose rows are then quantised once).
    """

    dtype: str = "auto"
    scale: Union[float, tuple, str] = 1.0

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.dtype!r}")
        scale = self.scale
        if isinstance(scale, str):
            if scale != CALIBRATE:
                raise ValueError(f"kv_scale must be a number > 0, one per layer, or {CALIBRATE!r}, got {scale!r}")
        else:
            if not isinstance(scale, (int, float)):
                scale = tuple(float(v) for v in scale)
                object.__setattr__(self, "scale", scale)
            values = scale if isinstance(scale, tuple) else (scale,)
            if not values or not all(0 < v < math.inf for v in values):
                raise ValueError(f"kv_scale must be finite and > 0 (one for every layer or one per layer), got {scale!r}")
        if not self.fp8 and scale != 1.0:
            raise ValueError(f"kv_scale is the scale of an fp8 cache: it needs kv_dtype fp8 / fp8_e4m3, got kv_dtype "
                             f"{self.dtype!r} with kv_scale {scale!r}")

    @property
    def fp8(self) -> bool:
        return KV_DTYPES[self.dtype] == FP8

    @property
    def calibrate(self) -> bool:
        return self.scale == CALIBRATE

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache's dtype for a model of model_dtype."""
        return KV_DTYPES[self.dtype] or model_dtype

    def describe(self) -> str:
        if not self.fp8:
            return f"latent cache {self.dtype}"
        scale = "amax / 448 per layer, calibrated on the prefill" if self.calibrate else f"scale {self.scale}"
        return f"latent cache fp8 e4m3 ({scale})"


def query_dtype(cache_dtype: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of tree_attention_mla's q and out over a cache of cache_dtype: the cache's own (the op takes them
    alike), for an fp8 cache the model's if bf16 / fp16, else bf16 (fp8 caches read bf16 / fp16 queries)."""
    if cache_dtype != FP8:
        return cache_dtype
    return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


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
                 kv_scale: Union[float, Sequence[float], Tensor, str, None] = None):
        """One cache tensor per entry of row_shapes, room for max_len positions per request. Pages are
        handed out in a shuffled order (as a real allocator would) so that paging bugs show.

        dtype torch.float8_e4m3fn: fp8 caches with a per-cache fp32 scale, kv_scale a float for every cache,
        one per cache, or a [len(row_shapes)] fp32 tensor (default 1.0: SGLang's unscaled cast; a checkpoint's
        k_scale where it has one), or "calibrate": 1.0 until calibrate_from sets amax / 448 from a prefill
        (self.calibrating says it is pending). kv_scale with any other dtype is refused."""
        if batch < 1 or max_len < 1 or page_size < 1:
            raise ValueError(f"batch, max_len and page_size must be >= 1, got {batch}, {max_len}, {page_size}")
        self.kv_scales: Optional[Tensor] = None  # [len(caches)] fp32 on the device, fp8 caches only
        self.calibrating = isinstance(kv_scale, str) and kv_scale == CALIBRATE and dtype == FP8
        if self.calibrating:
            kv_scale = None
        elif isinstance(kv_scale, str):
            raise ValueError(f"kv_scale must be a number, one per cache, a tensor or {CALIBRATE!r}, got {kv_scale!r}")
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
        self.put(i, page, slot, rows.to(self.caches[i].dtype) if scale is None else fp8_quantize(rows, scale))

    def read(self, i: int, page: Tensor, slot: Tensor) -> Tensor:
        """caches[i][page, slot] as stored (fp8 rows stay fp8: no dequantisation)."""
        c = self.caches[i]
        return c.view(torch.uint8)[page, slot].view(FP8) if c.dtype == FP8 else c[page, slot]

    def put(self, i: int, page: Tensor, slot: Tensor, rows: Tensor) -> None:
        """caches[i][page, slot] <- rows as stored (caches[i]'s dtype, no quantisation); fp8 as bytes: index_put
        on float8 tensors is missing from some CUDA builds of torch (and CPU torch has no float8 index_copy_)."""
        if self.caches[i].dtype == FP8:
            if rows.dtype != FP8:
                raise ValueError(f"put: an fp8 cache takes fp8 rows (quantise them first: write), got {rows.dtype}")
            self.caches[i].view(torch.uint8)[page, slot] = rows.view(torch.uint8)
        else:
            self.caches[i][page, slot] = rows

    def calibrate_from(self, src: "PagedKV", n: int) -> None:
        """After a prefill into src (the model's dtype, the same batch and layers) of n positions a request: each
        layer's scale <- amax / 448 over those rows (the whole batch's: one per-tensor scale per layer, vLLM's
        calculate_kv_scales form; 1.0 where amax is 0 or not finite), then the rows quantised with it into
        positions 0..n-1, and prefix_lens <- src's. On the device, no host sync; kv_scales keeps its address (a
        captured graph reads the new values)."""
        if self.kv_scales is None:
            raise ValueError(f"calibrate_from needs an fp8 cache (kv_scale 'calibrate'), this one is {self.caches[0].dtype}")
        if len(src.caches) != len(self.caches) or src.batch != self.batch:
            raise ValueError(f"calibrate_from: src must have {len(self.caches)} caches and batch {self.batch}, got "
                             f"{len(src.caches)} and {src.batch}")
        pos = torch.arange(n, device=self.prefix_lens.device).expand(self.batch, n)
        sp, ss = src.index(pos)
        dp, ds = self.index(pos)
        for i, c in enumerate(src.caches):
            rows = c[sp, ss]  # [B, n, D]
            amax = rows.abs().amax().float() if rows.numel() else torch.zeros((), device=rows.device)
            ok = (amax > 0) & (amax < math.inf)
            self.kv_scales[i].copy_(torch.where(ok, amax / FP8_MAX, torch.ones_like(amax)))
            self.put(i, dp, ds, fp8_quantize(rows, self.scale(i)))
        self.prefix_lens.copy_(src.prefix_lens)
        self.calibrating = False

    def advance(self, n) -> None:
        """prefix_lens += n (after a prefill whose rows are all kept)."""
        self.prefix_lens += n
