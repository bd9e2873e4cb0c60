// Device side of the error word (eagle3/errors.h): report() records one violation, first come first served.
#pragma once

#include <cstdint>

#include "eagle3/errors.h"

namespace eagle3 {

// Built with EAGLE3_DEVICE_CHECKS=0 (setup.py), recording and the checks that exist only to record (NaN
// scans, the tree's order) compile out; the bounds checks that keep every access inside its tensor stay.
#ifdef EAGLE3_NO_DEVICE_CHECKS
constexpr bool kDeviceChecks = false;
#else
constexpr bool kDeviceChecks = true;
#endif

// The hot path's branch to the error path: a predicate and a branch the compiler lays out as not taken.
#define EAGLE3_UNLIKELY(x) __builtin_expect(!!(x), 0)

// Record a violation unless one is recorded already (the first violating call wins; among the threads of
// that call, whichever gets there first). Cheap to call from many threads: after the first, one load each.
// Inlined: made a __noinline__ call here, every check in kv_accept's per-node loop became a call site and the
// chain case (nothing moved: the checks are most of the work) went from 1.01 to 1.05-1.06 of the build without
// checks on the H200. What keeps the checks off a kernel's hot path is where it reports: after its loads and
// stores, from an out-of-line function of its own that re-reads the few values to report (build_tree's
// report_candidate, eagle3/mla_sm90.cuh's report_request), or on a branch no valid input takes.
__device__ __forceinline__ void report(int64_t* word, int64_t op, int64_t arg, int64_t kind, int64_t i0, int64_t i1,
                                       int64_t i2, int64_t value, int64_t lo, int64_t hi) {
  if constexpr (kDeviceChecks) {
    if (word == nullptr) return;
    auto* state = reinterpret_cast<unsigned long long*>(word);
    if (*reinterpret_cast<volatile unsigned long long*>(state) != 0ull) return;
    if (atomicCAS(state, 0ull, 1ull) != 0ull) return;
    volatile int64_t* w = word;
    w[kErrOp] = op;
    w[kErrArg] = arg;
    w[kErrKind] = kind;
    w[kErrI0] = i0;
    w[kErrI1] = i1;
    w[kErrI2] = i2;
    w[kErrValue] = value;
    w[kErrLo] = lo;
    w[kErrHi] = hi;
    __threadfence();
    atomicExch(state, 2ull);
  }
}

// An integer index outside [lo, hi] at (i0[, i1[, i2]]).
__device__ __forceinline__ void report_range(int64_t* word, int64_t op, int64_t arg, int64_t value, int64_t lo,
                                             int64_t hi, int64_t i0, int64_t i1 = kNoIndex, int64_t i2 = kNoIndex) {
  report(word, op, arg, kKindRange, i0, i1, i2, value, lo, hi);
}

// A float that is NaN (kKindNaN) or negative (kKindNegative) at (i0[, i1[, i2]]).
__device__ __forceinline__ void report_float(int64_t* word, int64_t op, int64_t arg, int64_t kind, double value,
                                             int64_t i0, int64_t i1 = kNoIndex, int64_t i2 = kNoIndex) {
  report(word, op, arg, kind, i0, i1, i2, __double_as_longlong(value), 0, 0);
}

}  // namespace eagle3
