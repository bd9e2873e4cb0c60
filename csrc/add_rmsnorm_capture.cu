// add_rmsnorm_capture: residual += x; x = rmsnorm(residual) * weight; aux[r, slot*H:(slot+1)*H] = residual[rows[r]]
//
// The target's capture point (docs/design.md, "Aux ids"): at the input norm of layer k + 1 the new
// residual is the output of layer k, so the capture costs only its writes, never another launch.
// Memory-bound: one block per token row, every 16-byte load of the row issued before the first store,
// the row held in registers between the add and the normalisation (a second pass over global memory
// only for widths beyond the register budget). A base address, row stride or width that is not a
// multiple of the vector (x's 16 bytes; the same element count of residual, weight and aux) takes the
// one-element shape. On sm_90+ it is launched with programmatic dependent launch,
// so under a CUDA graph the next call's launch overlaps this one's tail (a call cost ~3 us even at T = 1).
//
// Rounding, exactly as the reference (eagle3_ops/reference.py): the add in acc_t (fp32, or fp64 when any
// operand is fp64), rounded once to residual's dtype; then (r * rsqrt(mean(r^2) + eps)) * weight in
// acc_t on the rounded residual, rounded once to x's dtype. residual and aux are bit-exact; x differs
// from the reference only by the order of the sum of squares.
//
// Captured rows: without `rows` every row r writes aux[r]; with `rows`, block t writes every aux row r
// with rows[r] == t (it scans rows, which is short: the last token of each request, the accepted rows).
// A row index outside [0, T) cannot be raised without a host sync: that aux row's slot block is filled
// with NaN (by block 0, or with T = 0 by fill_unmatched_kernel), nothing is read or written out of bounds,
// x and residual are computed as usual, and block 0 records the index in the device error word
// (eagle3/errors.h; the CPU reference raises the same message).

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <type_traits>

#include "eagle3/checks.h"
#include "eagle3/errors.cuh"
#include "eagle3/launch.h"
#include "eagle3/pdl.cuh"
#include "eagle3/vec.cuh"

namespace eagle3 {
namespace {

template <typename T>
__device__ __forceinline__ T nan_of() {
  return static_cast<T>(std::numeric_limits<float>::quiet_NaN());
}

// Sum over the block; every thread gets the result. `red` holds one value per warp.
template <typename acc_t>
__device__ __forceinline__ acc_t block_sum(acc_t v, acc_t* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = (blockDim.x + 31) >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  acc_t total = 0;
  for (int w = 0; w < warps; ++w) total += red[w];  // same order in every thread: one result
  return total;
}

struct Rows {
  const void* ptr;  // int32 or int64 [R]; nullptr: aux row r is residual row r
  bool is64;
  int64_t R;
  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(ptr)[i] : static_cast<int64_t>(static_cast<const int32_t*>(ptr)[i]);
  }
};

// One launch shape: VEC elements per access, up to MAXV accesses per thread held in registers (the
// cached row), at most THREADS threads, and the launch bound's MIN_BLOCKS resident blocks per SM (which
// caps the registers at 65536 / (THREADS * MIN_BLOCKS)). Memory-bound at T >= 512, so what counts is
// rows in flight per SM: at H = 7168 bf16 (224 threads a row), 80 registers fitted 3 rows per SM (396 on
// the chip: T = 512 ran as a full wave plus a 116-row tail); <8, 4, 224, 4> caps them at 72 and fits 4
// (528: one wave; the 64 of <8, 4, 256, 4> spilled, as did fp16 under 72). Seven vectors a thread (128
// threads a row) spilled even at 96 registers: the 16-bit halves of the cached row sit in separate registers.
template <int VEC_, int MAXV_, int THREADS_, int MIN_BLOCKS_>
struct Shape {
  static constexpr int VEC = VEC_, MAXV = MAXV_, THREADS = THREADS_, MIN_BLOCKS = MIN_BLOCKS_;
};

// Programmatic dependent launch: wait_previous_grid / allow_next_grid (eagle3/pdl.cuh). The trigger is
// given once every block of this grid is resident (the next layer's call, under a CUDA graph).

// x        [T, H] row stride xs          (normed hidden out)
// res      [T, H] row stride rs          (residual stream, += x)
// w        [H]                           contiguous
// aux      [R, H] row stride as          already offset to column slot * H; nullptr: no capture
// err      the device error word (eagle3/errors.h)
// grid: T blocks of at most S::THREADS; blockDim.x * MAXV * VEC >= H selects the register-cached path.
template <typename x_t, typename r_t, typename w_t, typename acc_t, typename S>
__global__ void __launch_bounds__(S::THREADS, S::MIN_BLOCKS) add_rmsnorm_capture_kernel(
    x_t* __restrict__ x, int64_t xs, r_t* __restrict__ res, int64_t rs, const w_t* __restrict__ w,
    r_t* __restrict__ aux, int64_t as, Rows rows, int64_t T, int64_t H, acc_t eps, int64_t* __restrict__ err) {
  constexpr int VEC = S::VEC, MAXV = S::MAXV;
  using xv_t = Vec<x_t, VEC>;
  using rv_t = Vec<r_t, VEC>;
  using wv_t = Vec<w_t, VEC>;
  __shared__ acc_t red[S::THREADS / 32];
  __shared__ int64_t matched[S::THREADS];
  __shared__ int n_matched;

  wait_previous_grid();
  allow_next_grid();
  const int64_t t = blockIdx.x;
  const int64_t nvec = H / VEC;
  const int tid = threadIdx.x, nt = blockDim.x;
  xv_t* xrow = reinterpret_cast<xv_t*>(x + t * xs);
  rv_t* rrow = reinterpret_cast<rv_t*>(res + t * rs);
  const wv_t* wrow = reinterpret_cast<const wv_t*>(w);
  const bool capture_all = aux != nullptr && rows.ptr == nullptr;
  const bool cached = nvec <= static_cast<int64_t>(nt) * MAXV;

  rv_t nr[MAXV];  // the new residual, kept for the normalisation and the captures
  acc_t ss = 0;
  if (cached) {
    // In-row indices fit an int here (nvec <= THREADS * MAXV).
    const int n = static_cast<int>(nvec);
    xv_t* xme = xrow + tid;  // this thread's vectors: xme[u * nt]
    rv_t* rme = rrow + tid;
    xv_t xv[MAXV];
#pragma unroll
    for (int u = 0; u < MAXV; ++u) {
      if (tid + u * nt < n) {
        xv[u] = xme[u * nt];
        nr[u] = rme[u * nt];
      }
    }
#pragma unroll
    for (int u = 0; u < MAXV; ++u) {
      if (tid + u * nt >= n) continue;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        nr[u].v[i] = static_cast<r_t>(static_cast<acc_t>(xv[u].v[i]) + static_cast<acc_t>(nr[u].v[i]));
        const acc_t a = static_cast<acc_t>(nr[u].v[i]);
        ss += a * a;
      }
      rme[u * nt] = nr[u];
    }
    // The capture in its own loop: interleaved with the residual stores above it cost 20 registers (seen:
    // 100 instead of 80 at <8, 4, 256, 1>, and spills under the 4-blocks bound).
    if (capture_all) {
      rv_t* ame = reinterpret_cast<rv_t*>(aux + t * as) + tid;
#pragma unroll
      for (int u = 0; u < MAXV; ++u) {
        if (tid + u * nt < n) ame[u * nt] = nr[u];
      }
    }
  } else {
    for (int64_t v = tid; v < nvec; v += nt) {
      const xv_t xv = xrow[v];
      rv_t r = rrow[v];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        r.v[i] = static_cast<r_t>(static_cast<acc_t>(xv.v[i]) + static_cast<acc_t>(r.v[i]));
        const acc_t a = static_cast<acc_t>(r.v[i]);
        ss += a * a;
      }
      rrow[v] = r;
      if (capture_all) reinterpret_cast<rv_t*>(aux + t * as)[v] = r;
    }
  }

  const acc_t rstd = acc_t(1) / sqrt(block_sum(ss, red) / static_cast<acc_t>(H) + eps);

  // x = (r * rstd) * w
  auto normed = [&](const rv_t& r, int64_t v) {
    const wv_t wv = wrow[v];
    xv_t o;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      o.v[i] = static_cast<x_t>(static_cast<acc_t>(r.v[i]) * rstd * static_cast<acc_t>(wv.v[i]));
    }
    xrow[v] = o;
  };
  if (cached) {
    const int n = static_cast<int>(nvec);
#pragma unroll
    for (int u = 0; u < MAXV; ++u) {
      const int v = tid + u * nt;
      if (v < n) normed(nr[u], v);
    }
  } else {
    for (int64_t v = tid; v < nvec; v += nt) normed(rrow[v], v);  // this thread's own writes of pass one
  }

  if (aux == nullptr || rows.ptr == nullptr) return;
  // Captures of a row subset: find the aux rows r with rows[r] == t (block 0 also NaN-fills and reports
  // the aux rows whose index is out of range), then write each from registers (or from the stored residual).
  for (int64_t base = 0; base < rows.R; base += nt) {
    if (tid == 0) n_matched = 0;
    __syncthreads();
    const int64_t r = base + tid;
    if (r < rows.R) {
      const int64_t src = rows[r];
      const bool invalid = src < 0 || src >= T;
      if (EAGLE3_UNLIKELY(invalid) && t == 0) report_range(err, kOpAddRmsnormCapture, kArgRows, src, 0, T - 1, r);
      if (src == t || (invalid && t == 0)) matched[atomicAdd(&n_matched, 1)] = invalid ? -1 - r : r;
    }
    __syncthreads();
    for (int j = 0; j < n_matched; ++j) {
      const int64_t m = matched[j];
      rv_t* arow = reinterpret_cast<rv_t*>(aux + (m < 0 ? -1 - m : m) * as);
      if (m < 0) {
        rv_t nanv;
#pragma unroll
        for (int i = 0; i < VEC; ++i) nanv.v[i] = nan_of<r_t>();
        for (int64_t v = tid; v < nvec; v += nt) arow[v] = nanv;
      } else if (cached) {
#pragma unroll
        for (int u = 0; u < MAXV; ++u) {
          const int64_t v = tid + static_cast<int64_t>(u) * nt;
          if (v < nvec) arow[v] = nr[u];
        }
      } else {
        for (int64_t v = tid; v < nvec; v += nt) arow[v] = rrow[v];
      }
    }
    __syncthreads();  // before n_matched is reset
  }
}

// T = 0 with rows: there is no block per token, and every index is out of range: each aux row's slot
// block is filled with NaN and the index reported, as the main kernel's block 0 does.
template <typename r_t>
__global__ void fill_unmatched_kernel(r_t* __restrict__ aux, int64_t as, Rows rows, int64_t H,
                                      int64_t* __restrict__ err) {
  for (int64_t r = blockIdx.x; r < rows.R; r += gridDim.x) {
    if (threadIdx.x == 0) report_range(err, kOpAddRmsnormCapture, kArgRows, rows[r], 0, -1, r);
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) aux[r * as + i] = nan_of<r_t>();
  }
}

template <typename T>
constexpr bool kIsDouble = std::is_same_v<T, double>;

template <typename x_t, typename r_t, typename w_t>
void launch(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
            const std::optional<at::Tensor>& aux_slice, Rows rows, double eps, bool pdl, int64_t* err,
            cudaStream_t stream) {
  using acc_t = std::conditional_t<kIsDouble<x_t> || kIsDouble<r_t> || kIsDouble<w_t>, double, float>;
  const int64_t T = x.size(0), H = x.size(1);
  constexpr int V = kVec16<x_t>;
  r_t* aux_ptr = aux_slice ? aux_slice->data_ptr<r_t>() : nullptr;
  const int64_t as = aux_slice ? aux_slice->stride(0) : 0;
  auto ok = [&](const void* p, int64_t stride, int64_t bytes) {
    return stride % V == 0 && (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
  };
  const bool vec_ok = H % V == 0 && ok(x.data_ptr(), x.stride(0), sizeof(x_t) * V) &&
                      ok(residual.data_ptr(), residual.stride(0), sizeof(r_t) * V) &&
                      ok(weight.data_ptr(), 0, sizeof(w_t) * V) && (!aux_ptr || ok(aux_ptr, as, sizeof(r_t) * V));
  auto go = [&](auto shape_tag) {
    using S = decltype(shape_tag);
    const int64_t nvec = H / S::VEC;
    int64_t threads = (nvec + S::MAXV - 1) / S::MAXV;
    threads = std::min<int64_t>(S::THREADS, std::max<int64_t>(32, (threads + 31) / 32 * 32));
    launch_ex(add_rmsnorm_capture_kernel<x_t, r_t, w_t, acc_t, S>, dim3(static_cast<unsigned>(T)),
              dim3(static_cast<unsigned>(threads)), 0, stream, 0, pdl,
              x.data_ptr<x_t>(), x.stride(0), residual.data_ptr<r_t>(), residual.stride(0), weight.data_ptr<w_t>(),
              aux_ptr, as, rows, T, H, static_cast<acc_t>(eps), err);
  };
  if (!vec_ok) {
    go(Shape<1, 8, kIsDouble<acc_t> ? 512 : 1024, 1>{});  // fp64 sums spilled under 64 registers
  } else if (T < 2 * 132) {
    // Few rows (decode, verify): more threads per row, so more loads are in flight across the chip.
    go(Shape<V, 2, 1024, 1>{});
  } else if constexpr (std::is_same_v<x_t, at::BFloat16> && std::is_same_v<r_t, at::BFloat16>) {
    // Many rows: as many rows per SM as the registers allow (see Shape). fp16 spilled under 72 registers.
    // Lean <V, 4, 224, 4> (4 rows per SM; rows up to 7168 bf16) below T = 2048, wide <V, 4, 256, 1> (no
    // minimum: 80 registers, 3 rows per SM) from there. Measured on the H200 (bench/results/
    // add_rmsnorm_sweep_h200.log, capture off, PDL on): lean 9.1 vs wide 11.7 us at T = 512, 17.2 vs 18.3 at
    // T = 1024; wide 59.6 vs lean 61.9 at T = 4096 (one wave of 4 rows per SM matters while T is a few waves;
    // beyond that the wider loads win). Capping the blocks an SM (2 or 3, so that T = 512 runs as waves whose
    // reads and writes overlap) lost at every T (13.3-15.5 vs 9.1 us at T = 512; add_rmsnorm_occ_h200.log).
    if (T >= 2048 || H / V > 224 * 4) {
      go(Shape<V, 4, 256, 1>{});
    } else {
      go(Shape<V, 4, 224, 4>{});
    }
  } else {
    // fp16, an fp32 residual, fp32 / fp64 x: the bound without a minimum (at most 82 registers, spill-free).
    go(Shape<V, 4, 256, 1>{});
  }
}

// x        [T, H]          bf16 | fp16 | fp32 | fp64, last dim contiguous (any stride when H == 1), mutated
// residual [T, H]          x's dtype or fp32, last dim contiguous likewise, mutated
// weight   [H]             any float dtype, contiguous (converted once when neither x's dtype nor fp32)
// aux      [R, n_aux * H]  residual's dtype, optional, may be a strided view, mutated
// rows     [R]             int32 | int64, optional (needs aux); without it R == T
void add_rmsnorm_capture_cuda(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                              const std::optional<at::Tensor>& aux, int64_t slot, const std::optional<at::Tensor>& rows) {
  CHECK_CUDA(x);
  CHECK_DIM(x, 2);
  const auto xt = x.scalar_type();
  TORCH_CHECK_TYPE(xt == at::kBFloat16 || xt == at::kHalf || xt == at::kFloat || xt == at::kDouble,
                   "x must have dtype bfloat16, float16, float32 or float64, got ", xt);
  // A width-1 row has no last-dimension stride to honour (as _validate.tensor's last_contiguous).
  TORCH_CHECK_VALUE(x.size(1) <= 1 || x.stride(1) == 1, "x must be contiguous in its last dimension, got strides ",
                    x.strides());
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK_TYPE(residual.scalar_type() == xt || residual.scalar_type() == at::kFloat,
                   "residual must have dtype ", xt, " (x's) or float32, got ", residual.scalar_type());
  CHECK_SHAPE(residual, T, H);
  CHECK_SAME_DEVICE(residual, x);
  TORCH_CHECK_VALUE(H <= 1 || residual.stride(1) == 1, "residual must be contiguous in its last dimension, got strides ",
                    residual.strides());
  TORCH_CHECK_TYPE(at::isFloatingType(weight.scalar_type()) && weight.element_size() >= 2,
                   "weight must have dtype bfloat16, float16, float32 or float64, got ", weight.scalar_type());
  CHECK_SHAPE(weight, H);
  CHECK_SAME_DEVICE(weight, x);
  TORCH_CHECK_VALUE(weight.is_contiguous(), "weight must be contiguous, got strides ", weight.strides());
  TORCH_CHECK_VALUE(eps >= 0, "eps must be >= 0, got ", eps);
  std::optional<at::Tensor> aux_slice;
  Rows rws{nullptr, false, 0};
  if (aux) {
    const at::Tensor& a = *aux;
    const int64_t R = check_aux_slot(a, residual, "residual", slot, rows);
    // rows selecting no row captures nothing (an empty rows tensor's data pointer can be null, which the
    // kernel would read as "no rows: capture every row", past aux's R = 0 rows: seen by the H200 fuzz test)
    if (!rows || R > 0) {
      if (rows) rws = Rows{rows->data_ptr(), rows->scalar_type() == at::kLong, R};
      aux_slice = a.narrow(1, slot * H, H);
    }
  } else {
    TORCH_CHECK_VALUE(!rows, "rows selects aux rows: pass aux too, or leave rows None");
  }
  TORCH_CHECK_VALUE(T < (int64_t{1} << 31), "x must have fewer than 2**31 rows, got ", T);
  if (H == 0 || (T == 0 && rws.R == 0)) return;

  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int dev = x.get_device();
  int64_t* err = device_error_word(dev);
  const auto rt = residual.scalar_type();
  if (T == 0) {  // rows given, none of them valid
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rt, "add_rmsnorm_capture", [&] {
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(rws.R, 1024));
      fill_unmatched_kernel<scalar_t><<<blocks, 256, 0, stream>>>(aux_slice->data_ptr<scalar_t>(),
                                                                  aux_slice->stride(0), rws, H, err);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    after_launch(dev, stream);
    return;
  }
  // The weight is read in x's dtype or in fp32 (acc_t's inputs); any other dtype is converted once.
  at::Tensor w = weight;
  if (weight.scalar_type() != xt && weight.scalar_type() != at::kFloat) w = weight.to(xt == at::kDouble ? at::kDouble : at::kFloat);
  const bool w_is_x = w.scalar_type() == xt;
  // Programmatic dependent launch on sm_90+ (the launch attribute and griddepcontrol need Hopper): without it
  // 2.76 vs 2.33 us at T = 1 and 12.33 vs 11.69 at T = 512 (add_rmsnorm_sweep_h200.log).
  const bool pdl = at::cuda::getDeviceProperties(x.get_device())->major >= 9;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xt, "add_rmsnorm_capture", [&] {
    using x_t = scalar_t;
    auto with_w = [&](auto r_tag) {
      using r_t = decltype(r_tag);
      if (w_is_x) {
        launch<x_t, r_t, x_t>(x, residual, w, aux_slice, rws, eps, pdl, err, stream);
      } else {
        launch<x_t, r_t, float>(x, residual, w, aux_slice, rws, eps, pdl, err, stream);
      }
    };
    if (rt == xt) {
      with_w(x_t{});
    } else {
      with_w(float{});
    }
  });
  after_launch(dev, stream);
}

}  // namespace
}  // namespace eagle3

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) { m.impl("add_rmsnorm_capture", &eagle3::add_rmsnorm_capture_cuda); }
