// Device properties the launchers size their grids by, read once per device (no ATen/cuda/CUDAContext.h:
// the toolkit here lacks the cuBLAS headers it pulls in).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>

namespace eagle3 {

// One device attribute, read once per device (the launchers call these on every op call).
template <cudaDeviceAttr kAttr>
inline int device_attribute(int device) {
  static std::atomic<int> cached[64] = {};
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable && cached[device].load(std::memory_order_relaxed) > 0) return cached[device].load(std::memory_order_relaxed);
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, kAttr, device));
  if (cacheable) cached[device].store(n, std::memory_order_relaxed);
  return n;
}

inline int num_sms(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device); }
inline int sm_major(int device) { return device_attribute<cudaDevAttrComputeCapabilityMajor>(device); }
inline int64_t smem_per_sm(int device) { return device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(device); }

}  // namespace eagle3
