"""Device facts the launchers ask on every call, asked of CUDA and the dispatcher once per device."""

from __future__ import annotations

import torch

_HOPPER_KERNEL: dict = {}


def hopper_kernel(device: torch.device, op: str) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.x) and this build registered a CUDA kernel for
    the internal op eagle3::<op> (csrc/*_sm90.cu are compiled only for sm_90a builds)."""
    key = (device.index, op)
    if key not in _HOPPER_KERNEL:
        _HOPPER_KERNEL[key] = (torch._C._dispatch_has_kernel_for_dispatch_key(f"eagle3::{op}", "CUDA")
                               and torch.cuda.get_device_capability(device)[0] == 9)
    return _HOPPER_KERNEL[key]
