// The device error word: how a kernel reports an input it had to skip, with no host sync.
//
// Every kernel that indexes memory with a runtime value (a row id, a page id, an accepted node, a parent) or
// reads a value its math cannot take (a NaN score, a negative temperature) checks it, skips what is invalid
// (each op's docstring says what is skipped and what is left untouched) and records the first violation in a
// small per-device word: which op, which argument, where and what value. Writing it happens on the error path
// only (one atomic claims the word); on valid input a check is a compare and a branch not taken, placed so that
// no load or store waits on it (errors.cuh; bench/device_checks.sh measures what it costs against a build with
// EAGLE3_DEVICE_CHECKS=0). The word lives in the module's static device memory, so its address never changes
// and a CUDA graph that captured a launch reports through it on every replay. eagle3_ops.check_errors() reads
// and clears it (one sync, when the engine chooses) and raises Eagle3InputError naming the op, the argument and
// the value; in strict mode (eagle3_ops.set_strict or EAGLE3_STRICT=1) every launcher checks right after its
// launch and raises there.
//
// The word: kErrorWords int64, [0] state (0 clear, 1 being written, 2 recorded), then op, argument and kind
// ids, three indices (kNoIndex where unused), the value (an integer, or a double's bits for the float
// kinds) and the valid range [lo, hi]. The ids are eagle3_ops/errors.py's tables (a test compares them).
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

namespace eagle3 {

constexpr int kErrorWords = 12;
constexpr int64_t kNoIndex = INT64_MIN;

enum ErrorField : int { kErrState = 0, kErrOp, kErrArg, kErrKind, kErrI0, kErrI1, kErrI2, kErrValue, kErrLo, kErrHi };

// op ids: eagle3_ops/errors.py OPS, in this order
enum ErrorOp : int64_t {
  kOpCaptureAux = 1,
  kOpAddRmsnormCapture,
  kOpFcProj,
  kOpBuildTree,
  kOpTreeAttentionMla,
  kOpTreeAttention,
  kOpVerifyGreedy,
  kOpVerifySampling,
  kOpKvAccept,
  kOp_vllmRejectionGreedy,    // internal ops of eagle3_ops.compat.vllm (csrc/verify_greedy.cu, verify_sampling.cu)
  kOp_vllmRejectionSampling,
};

// argument ids: eagle3_ops/errors.py ARGS, in this order
enum ErrorArg : int64_t {
  kArgRows = 1,
  kArgPageTable,
  kArgPrefixLens,
  kArgAcceptLen,
  kArgAcceptNodes,
  kArgDraftParents,
  kArgDraftScores,
  kArgParents,
  kArgTemperature,
  kArgD2t,
  kArgTreeMask,
  kArgKvScale,
  kArgCuNumDraftTokens,
  kArgTargetLogitsIndices,
  kArgBonusLogitsIndices,
};

// what was wrong: an integer outside [lo, hi]; a NaN; a float below zero; a float not finite and > 0
enum ErrorKind : int64_t { kKindRange = 1, kKindNaN, kKindNegative, kKindNotPositive };

// The word of `device` (its address in the module's static device memory; read once per device).
int64_t* device_error_word(int device);

// The devices whose word has been taken so far (the ones a kernel may have reported on).
std::vector<int> error_word_devices();

// Strict mode: after a launch on `stream` of `device`, synchronise and raise if the word is set (outside
// graph capture only: a stream that is being captured is left alone). A no-op when strict mode is off.
void after_launch(int device, cudaStream_t stream);

bool strict_mode();
void set_strict_mode(bool on);

// Installed by the Python module: raises the recorded violation as eagle3_ops.Eagle3InputError (and clears
// the word). Without it, after_launch throws c10::IndexError with the raw record.
using StrictRaiser = void (*)(int device);
void set_strict_raiser(StrictRaiser raiser);

}  // namespace eagle3
