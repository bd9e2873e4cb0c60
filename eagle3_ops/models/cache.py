"""Paged KV caches with static shapes, in docs/design.md's layout: a list of cache tensors
[num_pages, page_size, *row_shape] sharing one page table [B, max_pages] int32 and prefix_lens [B] int32.

The target keeps one latent cache per layer ([.., kv_lora_rank + rope_dim]); the drafter keeps K and V
([.., num_kv_heads, head_dim] each). `write` stores a step's rows at positions prefix_lens + node, as
the verify convention says; `prefix_lens` advances only through kv_accept (or `advance` after a
prefill). Nothing here synchronises the host.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


class PagedKV:
    def __init__(self, row_shapes: Sequence[tuple[int, ...]], batch: int, max_len: int, page_size: int = 16,
                 dtype: torch.dtype = torch.float32, device="cpu", shuffle_pages: bool = True, seed: int = 0):
        """One cache tensor per entry of row_shapes, room for max_len positions per request. Pages are
        handed out in a shuffled order (as a real allocator would) so that paging bugs show."""
        if batch < 1 or max_len < 1 or page_size < 1:
            raise ValueError(f"batch, max_len and page_size must be >= 1, got {batch}, {max_len}, {page_size}")
        self.page_size = page_size
        self.max_pages = -(-max_len // page_size)
        num_pages = batch * self.max_pages
        self.caches = [torch.zeros(num_pages, page_size, *shape, dtype=dtype, device=device) for shape in row_shapes]
        order = (torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)) if shuffle_pages
                 else torch.arange(num_pages))
        self.page_table = order.view(batch, self.max_pages).to(torch.int32).to(device)
        self.prefix_lens = torch.zeros(batch, dtype=torch.int32, device=device)

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
        nodes [B, N] int64 (default 0..N-1: the verify convention)."""
        B, N = rows.shape[0], rows.shape[1]
        if nodes is None:
            nodes = torch.arange(N, device=rows.device).expand(B, N)
        page, slot = self.slots(nodes)
        self.caches[i][page, slot] = rows.to(self.caches[i].dtype)

    def advance(self, n) -> None:
        """prefix_lens += n (after a prefill whose rows are all kept)."""
        self.prefix_lens += n
