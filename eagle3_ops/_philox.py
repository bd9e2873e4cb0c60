"""Counter-based random numbers for verify_sampling: Philox4x32-10, the generator of cuRAND and of
PyTorch's CUDA RNG, so that a CUDA kernel reproduces the reference's draws bit for bit.

Every uniform the sampler uses is a pure function of (seed, offset, row, idx, stream): no state, so a
step replays identically under a CUDA graph and two requests never share a draw.

    key     = (seed mod 2**32, seed >> 32 mod 2**32)
    counter = (idx, row | stream << 31, offset mod 2**32, offset >> 32 mod 2**32)
    x       = philox4x32_10(counter, key)[0]
    u       = (2 * (x >> 9) + 1) / 2**24         in (0, 1), exactly representable in float32

row = b * N + node (< 2**31); stream 0 draws the accept test of the idx-th child (in sibling order),
stream 1 the exponential race over the vocabulary (idx = token id) that samples a bonus token.
"""

from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)

STREAM_ACCEPT = 0
STREAM_SAMPLE = 1


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32 with 10 rounds on uint64 arrays holding 32-bit values; returns the 4 output words."""
    c0, c1, c2, c3, k0, k1 = (np.asarray(v, dtype=np.uint64) & _MASK for v in (c0, c1, c2, c3, k0, k1))
    for _ in range(10):
        p0 = _M0 * c0  # < 2**64: exact in uint64
        p1 = _M1 * c2
        hi0, lo0 = p0 >> _SHIFT, p0 & _MASK
        hi1, lo1 = p1 >> _SHIFT, p1 & _MASK
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _MASK
        k1 = (k1 + _W1) & _MASK
    return c0, c1, c2, c3


def uniform(seed: int, offset: int, row: int, idx, stream: int) -> np.ndarray:
    """Uniforms in (0, 1) as float64 (each exactly a float32 value) for the counters `idx` (array)."""
    if not 0 <= row < 2**31:
        raise ValueError(f"row must be in [0, 2**31), got {row}")
    seed, offset = int(seed) & 0xFFFFFFFFFFFFFFFF, int(offset) & 0xFFFFFFFFFFFFFFFF
    idx = np.asarray(idx, dtype=np.uint64)
    x, _, _, _ = philox4x32_10(idx, row | (stream << 31), offset & 0xFFFFFFFF, offset >> 32,
                               seed & 0xFFFFFFFF, seed >> 32)
    return ((x >> np.uint64(9)) * np.uint64(2) + np.uint64(1)).astype(np.float64) / float(2**24)
