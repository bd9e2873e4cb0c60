// capture_aux: aux[r, slot*H:(slot+1)*H] = (hidden + residual)[rows[r]]
//
// The drafter's input capture, for a target that does not fuse it into its add + RMSNorm
// (add_rmsnorm_capture does). Memory-bound: each thread moves UNROLL 16-byte vectors, all loads issued
// before the first store; a base address, row stride or width that is not a multiple of the vector takes
// the one-element path. The add is done in fp32 (fp64 for fp64) and rounded once, exactly as torch's
// `hidden + residual` rounds, so the result is bit-identical to the reference.
//
// A row index outside [0, T) cannot be raised on the device without a host sync: the kernel reads
// nothing for it, fills that aux row's slot block with NaN and records the index in the device error
// word (eagle3/errors.h; the CPU reference raises the same message).

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <type_traits>

#include "eagle3/checks.h"
#include "eagle3/errors.cuh"
#include "eagle3/vec.cuh"

namespace eagle3 {
namespace {

constexpr int kThreads = 128;
constexpr int kSmallGridBlocks = 4 * 132;  // below this many blocks at unroll 4, more blocks beat more ILP

// The error path, out of line: inlined at the kernel's end, the recording took the unrolled vector kernel from
// 72 to 82 registers (sm_90a); at its start, before the loads, T 1 and 7 ran 1.04-1.05x the build without checks
// (device_checks_h200.log at f803251). Now called from the bad row's own branch (below).
__device__ __noinline__ void report_row(int64_t* err, int64_t src, int64_t T, int64_t r) {
  report_range(err, kOpCaptureAux, kArgRows, src, 0, T - 1, r);
}

// hidden   [T, H]  row stride hidden_stride
// residual [T, H]  row stride residual_stride (nullptr when absent)
// aux      [R, H]  already offset to column slot * H, row stride aux_stride
// rows     [R]     int32 | int64 (nullptr: r -> r)
// err      the device error word (eagle3/errors.h)
// grid: (R, ceil(H / VEC / (kThreads * kUnroll)))
template <typename scalar_t, int VEC, int kUnroll, typename index_t>
__global__ void __launch_bounds__(kThreads) capture_aux_kernel(
    const scalar_t* __restrict__ hidden, int64_t hidden_stride,
    const scalar_t* __restrict__ residual, int64_t residual_stride,
    scalar_t* __restrict__ aux, int64_t aux_stride,
    const index_t* __restrict__ rows, int64_t T, int64_t H, int64_t* __restrict__ err) {
  using vec_t = Vec<scalar_t, VEC>;
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  // Loaded vectors are held as 32-bit words until they are added: held as vectors of bf16 / fp16 elements,
  // the compiler split each load into 16-bit registers as it arrived (the bf16 unroll-4 kernel at 72-80
  // registers, 51 with the words: 9 blocks per SM instead of 6-7, so T 512's 1024 blocks fit one wave).
  using raw_t = std::conditional_t<sizeof(scalar_t) == 2 && VEC % 2 == 0, Vec<uint32_t, VEC / 2>, vec_t>;
  static_assert(sizeof(raw_t) == sizeof(vec_t));
  const int64_t r = blockIdx.x;
  const int64_t src = rows != nullptr ? static_cast<int64_t>(rows[r]) : r;
  const int64_t nvec = H / VEC;
  const int64_t base = static_cast<int64_t>(blockIdx.y) * kThreads * kUnroll + threadIdx.x;
  raw_t* out = reinterpret_cast<raw_t*>(aux + r * aux_stride);
  // A row outside [0, T) (the same for the whole block) takes its own branch and returns, so that the valid path
  // below compiles to the same instructions with and without the report (sm_90a SASS, bf16 unroll 4). With one
  // `valid` predicate over the loads and stores instead, the report at the end kept every thread to the
  // kernel's end and the compiler rebuilt the residual's address in each store iteration: T 512 ran 1.04x the
  // build without checks (device_checks_d4d8c6d_h200.log).
  if (EAGLE3_UNLIKELY(static_cast<uint64_t>(src) >= static_cast<uint64_t>(T))) {
    vec_t nan;
#pragma unroll
    for (int i = 0; i < VEC; ++i) nan.v[i] = static_cast<scalar_t>(std::numeric_limits<float>::quiet_NaN());
    raw_t nan_raw;
    memcpy(&nan_raw, &nan, sizeof(raw_t));  // between locals (registers): a memcpy into global memory goes by bytes
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = base + u * kThreads;
      if (v < nvec) out[v] = nan_raw;
    }
    if (kDeviceChecks && blockIdx.y == 0 && threadIdx.x == 0) report_row(err, src, T, r);
    return;
  }
  const bool has_res = residual != nullptr;
  const raw_t* h = reinterpret_cast<const raw_t*>(hidden + src * hidden_stride);
  const raw_t* res = reinterpret_cast<const raw_t*>(residual + (has_res ? src * residual_stride : 0));

  raw_t a[kUnroll], b[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = base + u * kThreads;
    if (v < nvec) {
      a[u] = h[v];
      if (has_res) b[u] = res[v];
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = base + u * kThreads;
    if (v >= nvec) continue;
    if (!has_res) {
      out[v] = a[u];
      continue;
    }
    vec_t x, y, o;
    memcpy(&x, &a[u], sizeof(vec_t));
    memcpy(&y, &b[u], sizeof(vec_t));
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      o.v[i] = static_cast<scalar_t>(static_cast<acc_t>(x.v[i]) + static_cast<acc_t>(y.v[i]));
    }
    raw_t o_raw;
    memcpy(&o_raw, &o, sizeof(raw_t));
    out[v] = o_raw;
  }
}

template <typename scalar_t, int VEC, int kUnroll, typename index_t>
void launch(const at::Tensor& hidden, const std::optional<at::Tensor>& residual, const at::Tensor& aux_slice,
            const index_t* rows, int64_t R, int64_t* err, cudaStream_t stream) {
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const int64_t chunks = (H / VEC + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  const dim3 grid(static_cast<unsigned>(R), static_cast<unsigned>(chunks));
  capture_aux_kernel<scalar_t, VEC, kUnroll, index_t><<<grid, kThreads, 0, stream>>>(
      hidden.data_ptr<scalar_t>(), hidden.stride(0),
      residual ? residual->data_ptr<scalar_t>() : nullptr, residual ? residual->stride(0) : 0,
      aux_slice.data_ptr<scalar_t>(), aux_slice.stride(0), rows, T, H, err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// hidden   [T, H]            bf16 | fp16 | fp32 | fp64, last dim contiguous (any stride when H == 1)
// residual [T, H] optional   same dtype and device, last dim contiguous likewise
// aux      [R, n_aux * H]    same dtype; may be a strided view (last dim contiguous)
// rows     [R] optional      int32 | int64; without it R == T
void capture_aux_cuda(const at::Tensor& hidden, const std::optional<at::Tensor>& residual, const at::Tensor& aux,
                      int64_t slot, const std::optional<at::Tensor>& rows) {
  const at::Tensor* residual_p = residual ? &*residual : nullptr;
  CHECK_CUDA(hidden);
  CHECK_DIM(hidden, 2);
  TORCH_CHECK_TYPE(at::isFloatingType(hidden.scalar_type()) && hidden.element_size() >= 2,
                   "hidden must have dtype bfloat16, float16, float32 or float64, got ", hidden.scalar_type());
  // A width-1 row has no last-dimension stride to honour (as _validate.tensor's last_contiguous).
  TORCH_CHECK_VALUE(hidden.size(1) <= 1 || hidden.stride(1) == 1,
                    "hidden must be contiguous in its last dimension, got strides ", hidden.strides());
  const int64_t T = hidden.size(0), H = hidden.size(1);
  if (residual_p) {
    const at::Tensor& residual = *residual_p;  // named so that messages say "residual"
    CHECK_SAME_DEVICE(residual, hidden);
    CHECK_DTYPE(residual, hidden.scalar_type());
    CHECK_SHAPE(residual, T, H);
    TORCH_CHECK_VALUE(H <= 1 || residual.stride(1) == 1,
                      "residual must be contiguous in its last dimension, got strides ", residual.strides());
  }
  const int64_t R = check_aux_slot(aux, hidden, "hidden", slot, rows);
  TORCH_CHECK_VALUE(R < (int64_t{1} << 31), "aux must have fewer than 2**31 rows, got ", R);
  if (R == 0 || H == 0) return;

  const c10::cuda::OptionalCUDAGuard guard(hidden.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int dev = hidden.get_device();
  int64_t* err = device_error_word(dev);
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
        launch<scalar_t, V, 1, index_t>(hidden, residual, aux_slice, rows_ptr, R, err, stream);
      } else if (vec_ok) {
        launch<scalar_t, V, 4, index_t>(hidden, residual, aux_slice, rows_ptr, R, err, stream);
      } else {
        launch<scalar_t, 1, 4, index_t>(hidden, residual, aux_slice, rows_ptr, R, err, stream);
      }
    };
    if (rows && rows->scalar_type() == at::kInt) {
      go(int32_t{});
    } else {
      go(int64_t{});
    }
  });
  after_launch(dev, stream);
}

}  // namespace
}  // namespace eagle3

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) { m.impl("capture_aux", &eagle3::capture_aux_cuda); }
