// What the compat_sglang files (csrc/compat_sglang_build.cu, csrc/compat_sglang_walk.cu,
// csrc/compat_sglang_pack.cu; eagle3/compat_sglang.h says which ops each holds) share: their host checks, the
// device error word, the launch stream and the device helpers more than one of them uses (inlined into the
// kernels).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "eagle3/compat_sglang.h"
#include "eagle3/errors.cuh"
#include "eagle3/errors.h"

namespace eagle3 {
namespace sglang {

// The current stream of t's device (the launchers hold a device guard for it).
inline c10::cuda::CUDAStream current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device());
}

// Entry i of an int32 | int64 array.
__device__ __forceinline__ int64_t load_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

// Inclusive prefix sum over the lanes of a (full) warp.
template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T x) {
  const int lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

}  // namespace sglang
}  // namespace eagle3
