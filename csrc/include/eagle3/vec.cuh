// 16-byte vectors for memory-bound kernels: one LDG.128 / STG.128 per thread per access.
#pragma once

#include <cstdint>

namespace eagle3 {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T>
constexpr int kVec16 = 16 / sizeof(T);  // elements per 16-byte access

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace eagle3
