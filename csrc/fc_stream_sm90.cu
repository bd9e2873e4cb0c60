// fc_proj's Hopper weight-streaming kernel (sm_90a) for up to 64 rows: out [R, Hd] = x [R, K] @ W [Hd, K]^T
// (* per-channel scale * out_scale), W in fp8-e4m3 (x in fp16, pre-scaled by 2^-8 by the caller) or bf16 (x
// in bf16). Called by fc_proj's CUDA launcher (triton_kernels/fc_proj.py) when EAGLE3_FC_SM90=1, after it
// wrote x = norm(aux[rows]) once with K permuted inside every 64-block (see below); the op's semantics are
// eagle3_ops.reference.fc_proj's. STATUS: compiled for sm_90a, not yet run on a GPU (off by default).
//
// Swap-AB, weight in registers: a warpgroup owns 64 weight rows (output features) and computes
// D^T [64, N] = W_tile [64, K-range] x^T [K-range, N] with wgmma m64nNk16, N = R padded to 8 / 16 / 32 / 64.
// The weight is the A operand *from registers*: every thread loads its fragment straight from global memory
// with 16-byte loads (no shared-memory pass over the 308 / 154 MB weight), several k-blocks ahead in a
// register ring, and converts fp8 pairs with one cvt each. x^T is the B operand from shared memory, staged
// 8 k-blocks at a time with cp.async (three stages, 128-byte swizzle).
//
// K permutation: in a 64-wide k-block, thread quad q of a fragment row loads the 16 contiguous elements at
// 16 q .. 16 q + 15. wgmma step s (k16) then takes elements 16 q + 4 s + {0, 1} as its logical columns
// 2 q + {0, 1} and 16 q + 4 s + {2, 3} as 2 q + 8 + {0, 1}. A dot product does not care about the order
// of K as long as both operands share it, so x is written with the same order: physical p = 16 q + 4 s
// + 2 j + i of a block sits at logical 16 s + 8 j + 2 q + i (triton_kernels/fc_proj.py _perm64).
//
// Work split (stream-K): the (128-row pair of warpgroup tiles, k-block) units are cut into gridDim.x equal
// ranges, one block each (one block an SM); a block's range crosses at most a few row pairs ("segments"),
// and each segment's [128, N] fp32 partial goes to its own slot. A second kernel sums, for every row pair,
// the slots of the blocks that covered it, in block order (deterministic), applies the scales and writes out.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "eagle3/checks.h"
#include "eagle3/device.h"
#include "eagle3/wgmma.cuh"

namespace eagle3 {
namespace {

constexpr int kThreads = 256;     // two warpgroups: 128 weight rows a block
constexpr int kBlockK = 64;       // k-block
constexpr int kChunk = 8;         // k-blocks a stage of x
constexpr int kStages = 3;
constexpr int kRowsPerBlock = 128;

struct FcParams {
  const void* x;        // [R, K] 16-bit, K permuted inside 64-blocks, row stride K
  const uint8_t* w;     // [Hd, K] fp8 (1 byte) or bf16 (2 bytes), rows contiguous
  float* partial;       // [gridDim.x * seg_max, 128, N] fp32
  int R, K, KB;         // KB = K / 64
  int64_t U;            // units = (Hd / 128) * KB
  int seg_max;
};

__device__ __forceinline__ int64_t unit_begin(int64_t c, int64_t U, int64_t G) { return c * U / G; }

// kFp8: W is fp8-e4m3 and x fp16; else W and x are bf16.
template <int N, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) fc_stream_kernel(const __grid_constant__ FcParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kRowBytesPerBlock = kFp8 ? 64 : 128;     // one weight row's bytes in a k-block
  constexpr int kU4 = kFp8 ? 1 : 2;                      // 16-byte loads a row a k-block, per thread
  constexpr int kRing = kFp8 ? 8 : 4;                    // k-blocks of weight in flight a thread
  constexpr int kTileBytes = N * 128;                    // x's [N, 64] tile of one k-block
  constexpr int kStageBytes = kChunk * kTileBytes;
  static_assert(kChunk % kRing == 0, "ring slots must be compile-time inside a chunk");

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = sm90::smem_addr(smem_raw);
  const uint32_t xs = (raw + 1023u) & ~1023u;

  const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32, quad = lane % 4;
  const int r0 = warp * 16 + lane / 4;  // this thread's fragment rows r0 and r0 + 8 of its warpgroup's 64
  const int64_t G = gridDim.x, c = blockIdx.x;
  const int64_t u_end = unit_begin(c + 1, p.U, G);
  const int64_t row_bytes = static_cast<int64_t>(p.K) * (kFp8 ? 1 : 2);
  const uint16_t* x = static_cast<const uint16_t*>(p.x);

  int seg = 0;
  for (int64_t u = unit_begin(c, p.U, G); u < u_end; ++seg) {
    const int mp = static_cast<int>(u / p.KB);
    const int kb0 = static_cast<int>(u % p.KB);
    const int64_t left = u_end - u;
    const int n_kb = static_cast<int>(left < p.KB - kb0 ? left : p.KB - kb0);
    u += n_kb;
    const int n_chunks = (n_kb + kChunk - 1) / kChunk;

    // x^T: chunk ci (k-blocks kb0 + 8 ci ...) into stage ci % 3; rows past R are zeros
    auto stage_x = [&](int ci) {
      const int first = ci * kChunk;
      const int count = min(kChunk, n_kb - first);
      const uint32_t stage = xs + (ci % kStages) * kStageBytes;
      for (int idx = tid; idx < count * N * 8; idx += kThreads) {
        const int kk = idx / (N * 8), t = (idx / 8) % N, cc = idx % 8;
        const bool ok = t < p.R;
        const uint16_t* src = x + static_cast<int64_t>(t) * p.K + static_cast<int64_t>(kb0 + first + kk) * kBlockK + cc * 8;
        sm90::cp_async16(stage + kk * kTileBytes + sm90::swizzle128(t, cc), ok ? src : x, ok ? 16 : 0);
      }
    };
    stage_x(0);
    sm90::cp_async_commit();
    if (n_chunks > 1) stage_x(1);
    sm90::cp_async_commit();

    // the weight ring: k-block kb0 + i in slot i % kRing
    const uint8_t* w0 = p.w + (static_cast<int64_t>(mp) * kRowsPerBlock + wg * 64 + r0) * row_bytes +
                        static_cast<int64_t>(kb0) * kRowBytesPerBlock + quad * (16 * kU4);
    const uint8_t* w8 = w0 + 8 * row_bytes;
    uint4 ring[kRing][2][kU4];
#pragma unroll
    for (int i = 0; i < kRing; ++i) {
      if (i < n_kb) {
#pragma unroll
        for (int v = 0; v < kU4; ++v) {
          ring[i][0][v] = __ldcs(reinterpret_cast<const uint4*>(w0 + i * kRowBytesPerBlock) + v);
          ring[i][1][v] = __ldcs(reinterpret_cast<const uint4*>(w8 + i * kRowBytesPerBlock) + v);
        }
      }
    }

    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.f;

    for (int ci = 0; ci < n_chunks; ++ci) {
      sm90::cp_async_wait<1>();
      sm90::fence_proxy_async();
      __syncthreads();  // chunk ci of x landed for every thread; chunk ci - 1's stage is free
      if (ci + 2 < n_chunks) stage_x(ci + 2);
      sm90::cp_async_commit();
      const uint32_t stage = xs + (ci % kStages) * kStageBytes;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        const int kk = ci * kChunk + i;  // k-block kb0 + kk
        if (kk < n_kb) {
          const int slot = i % kRing;
          // the four k16 steps' A fragments
          uint32_t a[4][4];
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            if constexpr (kFp8) {
              const uint32_t lo = reinterpret_cast<const uint32_t*>(&ring[slot][0][0])[s];
              const uint32_t hi = reinterpret_cast<const uint32_t*>(&ring[slot][1][0])[s];
              a[s][0] = sm90::e4m3x2_to_f16x2(static_cast<uint16_t>(lo & 0xffffu));
              a[s][1] = sm90::e4m3x2_to_f16x2(static_cast<uint16_t>(hi & 0xffffu));
              a[s][2] = sm90::e4m3x2_to_f16x2(static_cast<uint16_t>(lo >> 16));
              a[s][3] = sm90::e4m3x2_to_f16x2(static_cast<uint16_t>(hi >> 16));
            } else {
              // (the copies into fragment order as instructions here, at the point of use: as plain
              // assignments ptxas kept the ring in fragment order and copied each refill right after its
              // load, so every k-block waited a whole load latency; this way a refill is read kRing
              // k-blocks later, as intended)
              const uint32_t* lo = reinterpret_cast<const uint32_t*>(&ring[slot][0][0]);
              const uint32_t* hi = reinterpret_cast<const uint32_t*>(&ring[slot][1][0]);
              asm volatile("mov.b32 %0, %1;" : "=r"(a[s][0]) : "r"(lo[2 * s]) : "memory");
              asm volatile("mov.b32 %0, %1;" : "=r"(a[s][1]) : "r"(hi[2 * s]) : "memory");
              asm volatile("mov.b32 %0, %1;" : "=r"(a[s][2]) : "r"(lo[2 * s + 1]) : "memory");
              asm volatile("mov.b32 %0, %1;" : "=r"(a[s][3]) : "r"(hi[2 * s + 1]) : "memory");
            }
          }
          // refill the slot with k-block kk + kRing
          if (kk + kRing < n_kb) {
#pragma unroll
            for (int v = 0; v < kU4; ++v) {
              ring[slot][0][v] = __ldcs(reinterpret_cast<const uint4*>(w0 + (kk + kRing) * kRowBytesPerBlock) + v);
              ring[slot][1][v] = __ldcs(reinterpret_cast<const uint4*>(w8 + (kk + kRing) * kRowBytesPerBlock) + v);
            }
          }
          sm90::fence_operand(d);
          sm90::wgmma_fence();
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            const uint64_t db = sm90::desc_sw128(stage + i * kTileBytes + s * 32, 16, 1024);
            if constexpr (kFp8) {
              if constexpr (N == 8) sm90::wgmma_rs_m64n8k16_f16(d, a[s], db, 1);
              if constexpr (N == 16) sm90::wgmma_rs_m64n16k16_f16(d, a[s], db, 1);
              if constexpr (N == 32) sm90::wgmma_rs_m64n32k16_f16(d, a[s], db, 1);
              if constexpr (N == 64) sm90::wgmma_rs_m64n64k16_f16(d, a[s], db, 1);
            } else {
              if constexpr (N == 8) sm90::wgmma_rs_m64n8k16_bf16(d, a[s], db, 1);
              if constexpr (N == 16) sm90::wgmma_rs_m64n16k16_bf16(d, a[s], db, 1);
              if constexpr (N == 32) sm90::wgmma_rs_m64n32k16_bf16(d, a[s], db, 1);
              if constexpr (N == 64) sm90::wgmma_rs_m64n64k16_bf16(d, a[s], db, 1);
            }
          }
          sm90::wgmma_commit();
          sm90::wgmma_wait<0>();
          sm90::fence_operand(d);
        }
      }
    }
    sm90::cp_async_wait<0>();
    __syncthreads();  // every thread is done with the stages before the next segment refills them

    // this segment's partial: slot c * seg_max + seg, rows wg * 64 + r0 (+ 8), columns 8 j + 2 quad
    float* dst = p.partial + ((c * p.seg_max + seg) * kRowsPerBlock + wg * 64 + r0) * N + 2 * quad;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(d[4 * j], d[4 * j + 1]);
      *reinterpret_cast<float2*>(dst + 8 * N + 8 * j) = make_float2(d[4 * j + 2], d[4 * j + 3]);
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // built for another architecture (TORCH_CUDA_ARCH_LIST without 9.0a): fail, never return garbage
#endif
}

template <typename TO>
__device__ __forceinline__ TO to_out(float v);
template <>
__device__ __forceinline__ float to_out<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half to_out<__half>(float v) { return __float2half_rn(v); }

// Block mp: rows mp * 128 ... of out^T from the slots of the blocks whose unit ranges cover that row pair.
template <typename TO>
__global__ void __launch_bounds__(kThreads) fc_fixup_kernel(const float* partial, const float* scale, float out_scale,
                                                          TO* out, int64_t stride_o, int R, int N, int KB, int64_t U,
                                                          int G, int seg_max) {
  extern __shared__ float acc[];  // [128][N + 1]
  const int mp = blockIdx.x;
  const int64_t first = static_cast<int64_t>(mp) * KB, last = first + KB - 1;
  auto owner = [&](int64_t u) {
    int64_t c = u * G / U;
    while (c + 1 < G && unit_begin(c + 1, U, G) <= u) ++c;
    while (c > 0 && unit_begin(c, U, G) > u) --c;
    return c;
  };
  const int64_t c_lo = owner(first), c_hi = owner(last);
  for (int idx = threadIdx.x; idx < kRowsPerBlock * N; idx += blockDim.x) {
    float sum = 0.f;
    for (int64_t c = c_lo; c <= c_hi; ++c) {
      const int64_t seg = mp - unit_begin(c, U, G) / KB;
      sum += partial[(c * seg_max + seg) * kRowsPerBlock * N + idx];
    }
    acc[(idx / N) * (N + 1) + idx % N] = sum;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRowsPerBlock * R; idx += blockDim.x) {
    const int t = idx / kRowsPerBlock, row = idx % kRowsPerBlock;
    const int64_t n = static_cast<int64_t>(mp) * kRowsPerBlock + row;
    float v = acc[row * (N + 1) + t] * out_scale;
    if (scale != nullptr) v *= scale[n];
    out[t * stride_o + n] = to_out<TO>(v);
  }
}

template <int N, bool kFp8>
void launch_stream(const FcParams& p, int grid, cudaStream_t stream) {
  constexpr int smem = kStages * kChunk * N * 128 + 1024;
  auto kernel = fc_stream_kernel<N, kFp8>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// x            [R, K] fp16 (fp8 weight: norm(aux[rows]) * 2^-8) | bf16 (bf16 weight), contiguous, K permuted
//              inside 64-blocks (module comment), R <= 64
// weight       [Hd, K] fp8-e4m3 | bf16, contiguous; Hd % 128 == 0, K % 64 == 0
// weight_scale [Hd] fp32, optional;  out [R, Hd] bf16 | fp16 | fp32, last dim contiguous
// out = (x @ weight^T) * out_scale * weight_scale
void fc_proj_sm90_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& weight_scale,
                       double out_scale, const at::Tensor& out) {
  CHECK_CUDA(x);
  CHECK_DIM(x, 2);
  CHECK_DIM(weight, 2);
  const int64_t R = x.size(0), K = x.size(1), Hd = weight.size(0);
  const bool fp8 = weight.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK_TYPE(fp8 || weight.scalar_type() == at::kBFloat16, "weight must have dtype float8_e4m3fn | bfloat16, got ",
                   weight.scalar_type());
  CHECK_DTYPE(x, fp8 ? at::kHalf : at::kBFloat16);
  CHECK_SHAPE(weight, Hd, K);
  TORCH_CHECK_VALUE(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
  TORCH_CHECK_VALUE(R >= 1 && R <= 64, "x must have 1 to 64 rows, got ", R);
  TORCH_CHECK_VALUE(K % kBlockK == 0 && K > 0, "x must have K % 64 == 0, got K = ", K);
  TORCH_CHECK_VALUE(Hd % kRowsPerBlock == 0 && Hd > 0, "weight must have Hd % 128 == 0, got Hd = ", Hd);
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
                    "x and weight must be 16-byte aligned");
  CHECK_SHAPE(out, R, Hd);
  CHECK_LAST_DIM_CONTIGUOUS(out);
  TORCH_CHECK_TYPE(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf || out.scalar_type() == at::kFloat,
                   "out must have dtype bfloat16 | float16 | float32, got ", out.scalar_type());
  if (weight_scale.has_value()) {
    CHECK_DTYPE((*weight_scale), at::kFloat);
    CHECK_SHAPE((*weight_scale), Hd);
    TORCH_CHECK_VALUE(weight_scale->is_contiguous(), "weight_scale must be contiguous");
    CHECK_SAME_DEVICE((*weight_scale), x);
  }
  for (const at::Tensor* t : {&weight, &out}) CHECK_SAME_DEVICE((*t), x);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  TORCH_CHECK_VALUE(sm_major(x.get_device()) == 9, "the sm_90a kernel needs a Hopper GPU (compute capability 9.x)");

  const int N = R <= 8 ? 8 : R <= 16 ? 16 : R <= 32 ? 32 : 64;
  const int KB = static_cast<int>(K / kBlockK);
  const int64_t U = (Hd / kRowsPerBlock) * KB;
  const int G = static_cast<int>(std::min<int64_t>(num_sms(x.get_device()), U));
  const int seg_max = static_cast<int>((U / G + 1 + KB - 1) / KB + 1);
  at::Tensor partial = at::empty({static_cast<int64_t>(G) * seg_max, kRowsPerBlock, N}, x.options().dtype(at::kFloat));
  FcParams p{x.data_ptr(), static_cast<const uint8_t*>(weight.data_ptr()), partial.data_ptr<float>(),
             static_cast<int>(R), static_cast<int>(K), KB, U, seg_max};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (fp8) {
    if (N == 8) launch_stream<8, true>(p, G, stream);
    if (N == 16) launch_stream<16, true>(p, G, stream);
    if (N == 32) launch_stream<32, true>(p, G, stream);
    if (N == 64) launch_stream<64, true>(p, G, stream);
  } else {
    if (N == 8) launch_stream<8, false>(p, G, stream);
    if (N == 16) launch_stream<16, false>(p, G, stream);
    if (N == 32) launch_stream<32, false>(p, G, stream);
    if (N == 64) launch_stream<64, false>(p, G, stream);
  }
  const float* scale = weight_scale.has_value() ? weight_scale->data_ptr<float>() : nullptr;
  const size_t fix_smem = static_cast<size_t>(kRowsPerBlock) * (N + 1) * sizeof(float);
  const dim3 fix_grid(static_cast<unsigned>(Hd / kRowsPerBlock));
  auto fixup = [&](auto* o) {
    using TO = std::remove_pointer_t<decltype(o)>;
    fc_fixup_kernel<TO><<<fix_grid, kThreads, fix_smem, stream>>>(partial.data_ptr<float>(), scale,
                                                                  static_cast<float>(out_scale), o, out.stride(0),
                                                                  static_cast<int>(R), N, KB, U, G, seg_max);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (out.scalar_type() == at::kBFloat16) {
    fixup(static_cast<__nv_bfloat16*>(out.data_ptr()));
  } else if (out.scalar_type() == at::kHalf) {
    fixup(static_cast<__half*>(out.data_ptr()));
  } else {
    fixup(out.data_ptr<float>());
  }
}

}  // namespace
}  // namespace eagle3

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) { m.impl("_fc_proj_sm90", &eagle3::fc_proj_sm90_cuda); }
