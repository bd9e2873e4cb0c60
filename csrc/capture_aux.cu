// capture_aux: aux[r, slot*H:(slot+1)*H] = (hidden + residual)[rows[r]]
//
// The drafter's input capture, for a target that does not fuse it into its add + RMSNorm
// (add_rmsnorm_capture does). Memory-bound: each thread moves UNROLL 16-byte vectors, all loads issued
// before the first store. The add is done in fp32 and rounded once, exactly as torch's `hidden +
// residual` rounds, so the result is bit-identical to the reference.
//
// A row index outside [0, T) cannot be raised on the device without a host sync: the kernel never
// reads out of bounds and fills that aux row with NaN instead (the CPU reference raises).

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "eagle3/checks.h"
#include "eagle3/vec.cuh"

namespace eagle3 {
namespace {

constexpr int kThreads = 128;
constexpr int kSmallGridBlocks = 4 * 132;  // below this many blocks at unroll 4, more blocks beat more ILP

// hidden   [T, H]  row stride hidden_stride
// residual [T, H]  row stride residual_stride (nullptr when absent)
// aux      [R, H]  already offset to column slot * H, row stride aux_stride
// rows     [R]     int32 | int64 (nullptr: r -> r)
// grid: (R, ceil(H / VEC / (kThreads * kUnroll)))
template <typename scalar_t, int VEC, int kUnroll, typename index_t>
__global__ void __launch_bounds__(kThreads) capture_aux_kernel(
    const scalar_t* __restrict__ hidden, int64_t hidden_stride,
    const scalar_t* __restrict__ residual, int64_t residual_stride,
    scalar_t* __restrict__ aux, int64_t aux_stride,
    const index_t* __restrict__ rows, int64_t T, int64_t H) {
  using vec_t = Vec<scalar_t, VEC>;
  const int64_t r = blockIdx.x;
  const int64_t src = rows != nullptr ? static_cast<int64_t>(rows[r]) : r;
  const bool valid = src >= 0 && src < T;
  const int64_t nvec = H / VEC;
  const int64_t base = static_cast<int64_t>(blockIdx.y) * kThreads * kUnroll + threadIdx.x;
  const vec_t* h = reinterpret_cast<const vec_t*>(hidden + (valid ? src : 0) * hidden_stride);
  const vec_t* res = residual != nullptr ? reinterpret_cast<const vec_t*>(residual + (valid ? src : 0) * residual_stride)
                                          : nullptr;
  vec_t* out = reinterpret_cast<vec_t*>(aux + r * aux_stride);

  vec_t a[kUnroll], b[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = base + u * kThreads;
    if (valid && v < nvec) {
      a[u] = h[v];
      if (res != nullptr) b[u] = res[v];
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = base + u * kThreads;
    if (v >= nvec) continue;
    vec_t o;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (!valid) {
        o.v[i] = static_cast<scalar_t>(std::numeric_limits<float>::quiet_NaN());
      } else if (res != nullptr) {
        o.v[i] = static_cast<scalar_t>(static_cast<float>(a[u].v[i]) + static_cast<float>(b[u].v[i]));
      } else {
        o.v[i] = a[u].v[i];
      }
    }
    out[v] = o;
  }
}

template <typename scalar_t, int VEC, int kUnroll, typename index_t>
void launch(const at::Tensor& hidden, const std::optional<at::Tensor>& residual, const at::Tensor& aux_slice,
            const index_t* rows, int64_t R, cudaStream_t stream) {
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const int64_t chunks = (H / VEC + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  const dim3 grid(static_cast<unsigned>(R), static_cast<unsigned>(chunks));
  capture_aux_kernel<scalar_t, VEC, kUnroll, index_t><<<grid, kThreads, 0, stream>>>(
      hidden.data_ptr<scalar_t>(), hidden.stride(0),
      residual ? residual->data_ptr<scalar_t>() : nullptr, residual ? residual->stride(0) : 0,
      aux_slice.data_ptr<scalar_t>(), aux_slice.stride(0), rows, T, H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// hidden   [T, H]            bf16 | fp16 | fp32, last dim contiguous
// residual [T, H] optional   same dtype and device
// aux      [R, n_aux * H]    same dtype; may be a strided view (last dim contiguous)
// rows     [R] optional      int32 | int64; without it R == T
void capture_aux_cuda(const at::Tensor& hidden, const std::optional<at::Tensor>& residual, const at::Tensor& aux,
                      int64_t slot, const std::optional<at::Tensor>& rows) {
  const at::Tensor* residual_p = residual ? &*residual : nullptr;
  CHECK_CUDA(hidden);
  CHECK_DIM(hidden, 2);
  TORCH_CHECK_TYPE(hidden.scalar_type() == at::kBFloat16 || hidden.scalar_type() == at::kHalf ||
                  hidden.scalar_type() == at::kFloat,
              "hidden must have dtype bfloat16, float16 or float32, got ", hidden.scalar_type());
  CHECK_LAST_DIM_CONTIGUOUS(hidden);
  const int64_t T = hidden.size(0), H = hidden.size(1);
  if (residual_p) {
    const at::Tensor& residual = *residual_p;  // named so that messages say "residual"
    CHECK_SAME_DEVICE(residual, hidden);
    CHECK_DTYPE(residual, hidden.scalar_type());
    CHECK_SHAPE(residual, T, H);
    CHECK_LAST_DIM_CONTIGUOUS(residual);
  }
  const int64_t R = check_aux_slot(aux, hidden, "hidden", slot, rows);
  TORCH_CHECK_VALUE(R < (int64_t{1} << 31), "aux must have fewer than 2**31 rows, got ", R);
  if (R == 0 || H == 0) return;

  const c10::cuda::OptionalCUDAGuard guard(hidden.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor aux_slice = aux.narrow(1, slot * H, H);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hidden.scalar_type(), "capture_aux", [&] {
    constexpr int V = kVec16<scalar_t>;
    const bool vec_ok = H % V == 0 && hidden.stride(0) % V == 0 && aux_slice.stride(0) % V == 0 &&
                        aligned16(hidden.data_ptr()) && aligned16(aux_slice.data_ptr()) &&
                        (!residual || (residual->stride(0) % V == 0 && aligned16(residual->data_ptr())));
    auto go = [&](auto index_tag) {
      using index_t = decltype(index_tag);
      const index_t* rows_ptr = rows ? rows->data_ptr<index_t>() : nullptr;
      // Few rows (decode, verify): one vector per thread, many blocks, to have more loads in flight
      // across the chip; many rows: 4 vectors per thread, all loads issued before the stores.
      const bool small = R * ((H / V + kThreads * 4 - 1) / (kThreads * 4)) < kSmallGridBlocks;
      if (vec_ok && small) {
        launch<scalar_t, V, 1, index_t>(hidden, residual, aux_slice, rows_ptr, R, stream);
      } else if (vec_ok) {
        launch<scalar_t, V, 4, index_t>(hidden, residual, aux_slice, rows_ptr, R, stream);
      } else {
        launch<scalar_t, 1, 4, index_t>(hidden, residual, aux_slice, rows_ptr, R, stream);
      }
    };
    if (rows && rows->scalar_type() == at::kInt) {
      go(int32_t{});
    } else {
      go(int64_t{});
    }
  });
}

}  // namespace
}  // namespace eagle3

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) { m.impl("capture_aux", &eagle3::capture_aux_cuda); }
