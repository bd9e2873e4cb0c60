"""Input errors that only a value can show (an index out of range, a NaN), on both devices, one contract.

On CPU the references raise `Eagle3InputError` at the call. On CUDA a kernel cannot raise without a host
sync, so it skips what is invalid (each op's docstring says what is skipped and what is left untouched),
never reads or writes outside the tensors it was given, and records the first violation in a small
per-device error word (csrc/include/eagle3/errors.h). The engine reads it when it chooses:

    eagle3_ops.check_errors()      # one sync; raises Eagle3InputError naming op, argument, index and value

The word lives in static device memory, so launches captured in a CUDA graph report through it on every
replay. `set_strict(True)` (or `EAGLE3_STRICT=1` in the environment at import) checks after every call
instead and raises at that call: for debugging, since it syncs each time (calls being captured into a
graph are not checked; check_errors() after the replay is).

For the same inputs both devices raise the same type with the same message, e.g.
`kv_accept: accept_nodes[1, 2] = 99 is out of range (valid: 0..15)`. Where several elements are invalid,
the CPU names the first in row-major order, and a GPU kernel the one its first violating thread found.
"""

from __future__ import annotations

import os
import struct
from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["Eagle3InputError", "check_errors", "set_strict", "strict", "error_word"]


class Eagle3InputError(IndexError, ValueError):
    """An argument's value is invalid (an index out of range, a NaN, a negative temperature).

    A subclass of IndexError and ValueError, the types the references raised before this existed.
    """


# Ids as the kernels record them (csrc/include/eagle3/errors.h): id = position + 1.
OPS = ("capture_aux", "add_rmsnorm_capture", "fc_proj", "build_tree", "tree_attention_mla", "tree_attention",
       "verify_greedy", "verify_sampling", "kv_accept", "_vllm_rejection_greedy", "_vllm_rejection_sampling")
ARGS = ("rows", "page_table", "prefix_lens", "accept_len", "accept_nodes", "draft_parents", "draft_scores",
        "parents", "temperature", "d2t", "tree_mask", "kv_scale", "cu_num_draft_tokens", "target_logits_indices",
        "bonus_logits_indices")
KINDS = ("range", "nan", "negative", "not_positive")
NO_INDEX = -(1 << 63)
WORDS = 12
_STATE, _OP, _ARG, _KIND, _I0, _I1, _I2, _VALUE, _LO, _HI = range(10)


def message(op: str, arg: str, index: Sequence[int], value, lo: Optional[int] = None, hi: Optional[int] = None,
            kind: str = "range") -> str:
    """The one wording of a violation, for both devices."""
    where = f"[{', '.join(str(int(i)) for i in index)}]" if len(index) else ""
    if kind == "range":
        return f"{op}: {arg}{where} = {int(value)} is out of range (valid: {int(lo)}..{int(hi)})"
    if kind == "nan":
        return f"{op}: {arg}{where} is NaN"
    if kind == "negative":
        return f"{op}: {arg}{where} = {float(value)!r} must be >= 0"
    if kind == "not_positive":
        return f"{op}: {arg}{where} = {float(value)!r} must be finite and > 0"
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def input_error(op: str, arg: str, index: Sequence[int], value, lo: Optional[int] = None, hi: Optional[int] = None,
                kind: str = "range") -> Eagle3InputError:
    return Eagle3InputError(message(op, arg, index, value, lo, hi, kind))


def _first(bad: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in bad.nonzero()[0])


def check_range(t: Tensor, lo, hi, op: str, arg: str, offset: Sequence[int] = ()) -> None:
    """Raise for the first element of t (row-major) outside [lo, hi]; lo / hi may be tensors that
    broadcast against t. `offset` is added to the reported index (t a slice of the argument)."""
    lo_t, hi_t = torch.as_tensor(lo), torch.as_tensor(hi)
    tl = t.long()
    bad = (tl < lo_t) | (tl > hi_t)
    if not bool(bad.any()):
        return
    where = _first(bad)
    lo_v = lo_t.expand_as(tl)[where] if lo_t.dim() else lo_t
    hi_v = hi_t.expand_as(tl)[where] if hi_t.dim() else hi_t
    index = tuple(o + w for o, w in zip(tuple(offset) + (0,) * (len(where) - len(offset)), where))
    raise input_error(op, arg, index, int(tl[where]), int(lo_v), int(hi_v))


def check_float(t: Tensor, op: str, arg: str, nonnegative: bool = False) -> None:
    """Raise for the first NaN in t (row-major), or with nonnegative also the first value below zero."""
    bad = torch.isnan(t) | ((t < 0) if nonnegative else torch.zeros_like(t, dtype=torch.bool))
    if not bool(bad.any()):
        return
    where = _first(bad) if t.dim() else ()
    v = float(t[where])
    raise input_error(op, arg, where, v, kind="nan" if v != v else "negative")


# ---- the device word ----------------------------------------------------------------------------------

def _native():
    from . import _C

    return _C if hasattr(_C, "_error_word") else None


_words: dict[int, Tensor] = {}
_cpu_word = torch.zeros(WORDS, dtype=torch.int64)  # Triton kernels under TRITON_INTERPRET=1 report here


def error_word(device) -> Tensor:
    """The error word of a CUDA device as an int64 [12] tensor over its static memory: Triton launchers pass
    it to their kernels. Taking it does no GPU work beyond looking up the symbol's address. For a CPU
    device (Triton's interpreter) a host word, which check_errors() reads too."""
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu_word
    index = torch.cuda.current_device() if device.index is None else device.index
    w = _words.get(index)
    if w is None:
        native = _native()
        if native is None:
            raise RuntimeError("eagle3_ops was built without CUDA kernels: there is no device error word")
        w = _words[index] = native._error_word(index)
    return w


_checks: list[bool] = []


def device_checks() -> bool:
    """Whether this build records violations: False when built with EAGLE3_DEVICE_CHECKS=0 (setup.py), which
    the Triton launchers pass on to their kernels as a constexpr, so that the recording compiles out there too."""
    if not _checks:
        from . import _C

        _checks.append(bool(_C.build_info().get("device_checks", True)))
    return _checks[0]


def _decode(w: list[int]) -> Eagle3InputError:
    op = OPS[w[_OP] - 1] if 1 <= w[_OP] <= len(OPS) else f"op {w[_OP]}"
    arg = ARGS[w[_ARG] - 1] if 1 <= w[_ARG] <= len(ARGS) else f"argument {w[_ARG]}"
    kind = KINDS[w[_KIND] - 1] if 1 <= w[_KIND] <= len(KINDS) else "range"
    index = [i for i in (w[_I0], w[_I1], w[_I2]) if i != NO_INDEX]
    value = w[_VALUE]
    if kind != "range":
        value = struct.unpack("<d", struct.pack("<q", value))[0]
    return input_error(op, arg, index, value, w[_LO], w[_HI], kind)


def _take(index) -> Optional[Eagle3InputError]:
    """Read and clear one device's word (the caller synchronised): the recorded violation, or None.
    index: a CUDA device index, or "cpu" for the interpreter's word."""
    w = _cpu_word if index == "cpu" else error_word(torch.device("cuda", index))
    vals = w.tolist()
    if vals[_STATE] == 0:
        return None
    w.zero_()
    if index != "cpu":
        torch.cuda.synchronize(index)
    return _decode(vals)


def check_errors(device=None) -> None:
    """Raise Eagle3InputError for a violation a kernel recorded since the last check, and clear it.

    Synchronises the device (every device a kernel of ours ran on, when device is None) once. Call it
    where a sync is affordable: once a step, outside the step's CUDA graphs. A no-op on a build without
    CUDA kernels or a machine without a GPU.
    """
    native = _native()
    cuda = native is not None and torch.cuda.is_available()
    if device is None:
        indices = ["cpu"] + (list(native._error_word_devices()) if cuda else [])
    else:
        d = torch.device(device)
        if d.type == "cpu":
            indices = ["cpu"]
        elif not cuda:
            return
        else:
            indices = [torch.cuda.current_device() if d.index is None else d.index]
    first = None
    for index in indices:
        if index != "cpu":
            torch.cuda.synchronize(index)
        err = _take(index)
        first = first or err
    if first is not None:
        raise first


def _raise_recorded(device) -> None:
    """Strict mode's raiser, called from the C++ launchers after their sync (errors.h)."""
    err = _take(device)
    if err is not None:
        raise err


_strict = False


def set_strict(on: bool = True) -> None:
    """Strict mode: every op checks the error word right after its launch and raises at that call (one
    sync per call; calls being captured into a CUDA graph are not checked). For debugging."""
    global _strict
    _strict = bool(on)
    native = _native()
    if native is not None:
        native._set_strict(_strict)


def strict() -> bool:
    return _strict


def after_launch(device: torch.device) -> None:
    """The Triton launchers' strict-mode check (the C++ launchers do theirs in errors.cu)."""
    if not _strict:
        return
    if device.type == "cpu":
        _raise_recorded("cpu")
        return
    if torch.cuda.is_current_stream_capturing():
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    torch.cuda.current_stream(index).synchronize()
    _raise_recorded(index)


if os.environ.get("EAGLE3_STRICT", "") not in ("", "0"):
    set_strict(True)
