// The device helpers of csrc/mla_decode_sm90.cu's kernel (eagle3/mla_sm90.h says which file holds what), besides
// the sm_90a PTX of eagle3/wgmma.cuh: the wgmmas by input type, P's and out's packed pairs, 2^x and the fp8
// conversion, and report_request, the out-of-line error path of a poisoned block. Included by the kernel's file
// alone.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "eagle3/errors.cuh"
#include "eagle3/mla_sm90.h"
#include "eagle3/wgmma.cuh"

namespace eagle3 {
namespace mla_sm90 {

// Two floats as one 32-bit pair of T (round to nearest): P's and out's stores.
template <typename T>
struct Pack2;
template <>
struct Pack2<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <>
struct Pack2<__half> {
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

// The wgmmas for shared-memory inputs of type T (bf16 | fp16): S (+)= Q K^T (scale_d 0: overwrite), O += P V.
template <typename T>
__device__ __forceinline__ void mma_qk(float (&s)[32], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    sm90::wgmma_m64n64k16_bf16<0>(s, da, db, scale_d);
  } else {
    sm90::wgmma_m64n64k16_f16<0>(s, da, db, scale_d);
  }
}

template <typename T>
__device__ __forceinline__ void mma_pv(float (&o)[128], uint64_t da, uint64_t db) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    sm90::wgmma_m64n256k16_bf16<1>(o, da, db, 1);
  } else {
    sm90::wgmma_m64n256k16_f16<1>(o, da, db, 1);
  }
}

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

#ifdef EAGLE3_DEV_BUILD
// kDevTrace's clock (eagle3/mla_sm90.h)
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

// 2^x by the MUFU alone: results below 2^-126 flush to 0 (exp2f adds a denormal-range fix-up, 3 more
// instructions for each of the 32 a thread computes per tile). Arguments are score - row max <= 0, so only
// probabilities under 2^-126 of the row's largest (which is 1) are flushed: nothing next to it in l or in P V.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// kFp8: 16 e4m3 values (16 bytes, the order they sit in memory) -> 16 fp16 values, exactly (every e4m3 value,
// subnormals and NaN included, is an fp16 value): 8 cvt.rn.f16x2.e4m3x2, two values each.
__device__ __forceinline__ void e4m3x16_to_f16(const uint32_t (&in)[4], uint32_t (&out)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.rn.f16x2.e4m3x2 %0, lo;\ncvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
        : "=r"(out[2 * i]), "=r"(out[2 * i + 1])
        : "r"(in[i]));
  }
}

// The error path of a poisoned block of request b (every thread of the block calls it): a bad prefix length
// (reported by thread 0), else each page-table slot this block read - those covering this split's prefix keys
// [start, end) and, in the last split (tree_n = N), the tree keys [prefix, prefix + N) - whose page id is
// outside [0, num_pages), as row_src found them (the first report wins). Out of line (the hot path keeps only
// the branch to it); inline for the linkage only: a header's definition.
inline __device__ __noinline__ void report_request(int64_t* err, const int32_t* pt_row, int num_pages, int page_size,
                                                   int b, bool bad, int prefix_raw, int64_t clamp_hi, int64_t start,
                                                   int64_t end, int prefix, int tree_n) {
  if (bad) {
    if (threadIdx.x == 0) report_range(err, kOpTreeAttentionMla, kArgPrefixLens, prefix_raw, 0, clamp_hi, b);
    return;
  }
  auto scan = [&](int64_t lo, int64_t hi) {  // the slots of positions [lo, hi)
    if (hi <= lo) return;
    for (int64_t slot = lo / page_size + threadIdx.x; slot <= (hi - 1) / page_size; slot += blockDim.x) {
      const int page = pt_row[slot];
      if (page < 0 || page >= num_pages) {
        report_range(err, kOpTreeAttentionMla, kArgPageTable, page, 0, num_pages - 1, b, slot);
      }
    }
  };
  scan(start, end);
  scan(prefix, static_cast<int64_t>(prefix) + tree_n);
}

}  // namespace mla_sm90
}  // namespace eagle3
