// The device error word (eagle3/errors.h): one per device, in this module's static device memory, and
// strict mode's check after each launch.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>

#include "eagle3/errors.h"

namespace eagle3 {

// Zero at module load, on every device the module is loaded on. Never freed, never moved: graphs that
// captured a launch keep reporting through it.
__device__ int64_t g_error_word[kErrorWords];

namespace {
std::atomic<int64_t*> g_word_of[64] = {};
std::atomic<bool> g_strict{false};
std::atomic<StrictRaiser> g_raiser{nullptr};
}  // namespace

int64_t* device_error_word(int device) {
  TORCH_CHECK_VALUE(device >= 0 && device < 64, "eagle3 error word: device index ", device, " out of range");
  int64_t* p = g_word_of[device].load(std::memory_order_acquire);
  if (p != nullptr) return p;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* addr = nullptr;
  C10_CUDA_CHECK(cudaGetSymbolAddress(&addr, g_error_word));  // not a stream operation: capture-safe
  p = static_cast<int64_t*>(addr);
  g_word_of[device].store(p, std::memory_order_release);
  return p;
}

std::vector<int> error_word_devices() {
  std::vector<int> out;
  for (int d = 0; d < 64; ++d) {
    if (g_word_of[d].load(std::memory_order_acquire) != nullptr) out.push_back(d);
  }
  return out;
}

bool strict_mode() { return g_strict.load(std::memory_order_relaxed); }
void set_strict_mode(bool on) { g_strict.store(on, std::memory_order_relaxed); }
void set_strict_raiser(StrictRaiser raiser) { g_raiser.store(raiser, std::memory_order_release); }

void after_launch(int device, cudaStream_t stream) {
  if (!strict_mode()) return;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return;  // no sync inside a capture: check_errors() later
  int64_t* word = device_error_word(device);
  int64_t state = 0;
  C10_CUDA_CHECK(cudaMemcpyAsync(&state, word, sizeof(state), cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (state == 0) return;
  if (StrictRaiser raiser = g_raiser.load(std::memory_order_acquire)) raiser(device);  // throws
  int64_t w[kErrorWords];
  C10_CUDA_CHECK(cudaMemcpy(w, word, sizeof(w), cudaMemcpyDeviceToHost));
  C10_CUDA_CHECK(cudaMemset(word, 0, sizeof(w)));
  TORCH_CHECK_INDEX(false, "eagle3 input error on cuda:", device, ": op ", w[kErrOp], " argument ", w[kErrArg],
                    " kind ", w[kErrKind], " at (", w[kErrI0], ", ", w[kErrI1], ", ", w[kErrI2], ") value ",
                    w[kErrValue], " valid [", w[kErrLo], ", ", w[kErrHi], "]");
}

}  // namespace eagle3
