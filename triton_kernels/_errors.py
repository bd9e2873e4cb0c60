"""The device error word from Triton kernels (eagle3_ops/errors.py; csrc/include/eagle3/errors.h is the CUDA side).

`report_range` records "arg[i0, i1, i2] = value is outside [lo, hi]" (`report_not_positive`: "arg = value must be
finite and > 0", a scalar argument) unless a violation is recorded already:
claim the word (state 0 -> 1), write the fields, publish (state 2). Called on the error path only. There is
deliberately no volatile pre-check of the state: each thread of a program would load it separately and could
see a different value, and the compare-and-swap's result is shared through a barrier that all threads of the
program must reach. On a build with EAGLE3_DEVICE_CHECKS=0 the body compiles out (CHECKS).
"""

import triton
import triton.language as tl

from .. import errors

CHECKS = tl.constexpr(errors.device_checks())
NO_INDEX = tl.constexpr(errors.NO_INDEX)
KIND_RANGE = tl.constexpr(errors.KINDS.index("range") + 1)
KIND_NOT_POSITIVE = tl.constexpr(errors.KINDS.index("not_positive") + 1)


def op_id(name: str) -> int:
    return errors.OPS.index(name) + 1


def arg_id(name: str) -> int:
    return errors.ARGS.index(name) + 1


@triton.jit
def _record(ERR, op, arg, kind, value, lo, hi, i0, i1, i2):
    # claim the word (0 -> 1), write the fields, publish (2); a word already claimed is left as it is
    if CHECKS:
        if tl.atomic_cas(ERR, tl.full([], 0, tl.int64), tl.full([], 1, tl.int64)) == 0:
            tl.store(ERR + 1, op)
            tl.store(ERR + 2, arg)
            tl.store(ERR + 3, kind)
            tl.store(ERR + 4, i0)
            tl.store(ERR + 5, i1)
            tl.store(ERR + 6, i2)
            tl.store(ERR + 7, value)
            tl.store(ERR + 8, lo)
            tl.store(ERR + 9, hi)
            tl.atomic_xchg(ERR, tl.full([], 2, tl.int64), sem="release")  # the fields are visible first


@triton.jit
def report_range(ERR, op, arg, value, lo, hi, i0, i1, i2):
    # ERR [12] int64 (errors.py's layout); op, arg: ids; the rest int64 scalars (i1, i2 NO_INDEX when unused)
    _record(ERR, op, arg, KIND_RANGE, value, lo, hi, i0, i1, i2)


@triton.jit
def report_not_positive(ERR, op, arg, value):
    # "arg = value must be finite and > 0" for a scalar argument (no index); value a float scalar, stored as
    # its float64 bits as errors.py reads the float kinds
    bits = value.to(tl.float64).to(tl.int64, bitcast=True)
    _record(ERR, op, arg, KIND_NOT_POSITIVE, bits, 0, 0, NO_INDEX, NO_INDEX, NO_INDEX)
