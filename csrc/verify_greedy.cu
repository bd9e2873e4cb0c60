// verify_greedy: target argmax at every tree node fused with the greedy tree walk, in two launches and
// no host sync.
//
// Phase 1 (argmax_partial_kernel) is the one pass over the logits: grid (rows * S), each block scans a
// slice of one row's vocabulary with 16-byte loads (UNROLL per thread in flight) and writes its
// (max, first index). The per-element work is a packed NaN-propagating max (max.NaN.bf16x2 / f16x2 /
// f32) over the loaded vectors; the index is looked up only when a thread's running maximum improves,
// which after the first few iterations is rare, so the pass stays bandwidth-bound.
// Phase 2 (walk_kernel), one block per request, launched as a programmatic dependent of phase 1 where the
// device and the kernel's binary have sm_90 (its launch overlaps phase 1; it waits for phase 1's writes
// before reading them; elsewhere an ordinary launch after phase 1): reduces the S partials of
// each of its N rows, marks for every node the lowest-index child whose token equals the node's argmax,
// then one thread follows those marks from the root (shared memory only) and all threads write the
// outputs.
//
// Ties and NaN exactly as torch.argmax: the first maximum wins, any NaN counts as the maximum (the first
// NaN wins), -0.0 == +0.0.
//
// A bad tree is recorded in the device error word (eagle3/errors.h; the CPU reference raises the same
// message) and made harmless: a node j whose parent is not in [0, j) is never accepted (nor, so, is any
// node below it), and a root parent other than -1 is ignored; the walk always ends, indices stay in
// bounds and every output element is written. Tokens are only compared with the argmax: one outside
// [0, V) is never accepted.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <tuple>

#include "eagle3/checks.h"
#include "eagle3/compat_vllm.h"
#include "eagle3/device.h"
#include "eagle3/errors.cuh"
#include "eagle3/errors.h"
#include "eagle3/launch.h"
#include "eagle3/pdl.cuh"
#include "eagle3/vec.cuh"

namespace eagle3 {
namespace {

constexpr int kThreads = 256;        // phase 1 block
constexpr int kUnroll = 4;           // 16-byte vectors per thread in flight
constexpr int kWalkThreads = 256;    // phase 2 block
constexpr int kMaxSplits = 256;
constexpr int64_t kMaxNodes = 16384;  // phase 2 keeps 3 ints per node in shared memory

using Raw = Vec<uint32_t, 4>;  // one 16-byte load

__device__ __forceinline__ Raw load16(const Raw* p) {  // read-only path; logits are read exactly once
  const uint4 t = __ldg(reinterpret_cast<const uint4*>(p));
  return Raw{{t.x, t.y, t.z, t.w}};
}

// ---- per-dtype element access and packed maxima -------------------------------------------------------

__device__ __forceinline__ uint32_t max_nan_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t max_nan_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ float max_nan_f32(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ double max_nan_f64(double a, double b) { return a != a ? a : (b != b ? b : fmax(a, b)); }

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ float f16_bits_to_float(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// Traits: acc_t (exact for the dtype), kVec elements per 16 bytes, element e of a raw vector, the maximum
// (NaN-propagating) of U raw vectors, and one scalar element from memory.
template <typename scalar_t>
struct Elem;

// bf16 and fp16: 8 elements per vector, reduced as 16-bit pairs by one packed max per word.
struct Bf16Bits {
  static __device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) { return max_nan_bf16x2(a, b); }
  static __device__ __forceinline__ float to_float(uint32_t bits) { return bf16_bits_to_float(bits); }
};
struct F16Bits {
  static __device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) { return max_nan_f16x2(a, b); }
  static __device__ __forceinline__ float to_float(uint32_t bits) { return f16_bits_to_float(bits); }
};

template <typename Bits, typename scalar_t>
struct Elem16 {
  using acc_t = float;
  static constexpr int kVec = 8;
  static __device__ __forceinline__ float get(const Raw& r, int e) { return Bits::to_float((r.v[e >> 1] >> (16 * (e & 1))) & 0xFFFFu); }
  template <int U>
  static __device__ __forceinline__ float vmax(const Raw (&r)[U]) {
    uint32_t m = Bits::max2(Bits::max2(r[0].v[0], r[0].v[1]), Bits::max2(r[0].v[2], r[0].v[3]));
#pragma unroll
    for (int u = 1; u < U; ++u) {
      m = Bits::max2(m, Bits::max2(Bits::max2(r[u].v[0], r[u].v[1]), Bits::max2(r[u].v[2], r[u].v[3])));
    }
    return max_nan_f32(Bits::to_float(m & 0xFFFFu), Bits::to_float(m >> 16));
  }
  static __device__ __forceinline__ float load(const scalar_t* p) {
    return Bits::to_float(*reinterpret_cast<const unsigned short*>(p));
  }
};

template <>
struct Elem<at::BFloat16> : Elem16<Bf16Bits, at::BFloat16> {};
template <>
struct Elem<at::Half> : Elem16<F16Bits, at::Half> {};

template <>
struct Elem<float> {
  using acc_t = float;
  static constexpr int kVec = 4;
  static __device__ __forceinline__ float get(const Raw& r, int e) { return __uint_as_float(r.v[e]); }
  template <int U>
  static __device__ __forceinline__ float vmax(const Raw (&r)[U]) {
    float m = max_nan_f32(max_nan_f32(__uint_as_float(r[0].v[0]), __uint_as_float(r[0].v[1])),
                          max_nan_f32(__uint_as_float(r[0].v[2]), __uint_as_float(r[0].v[3])));
#pragma unroll
    for (int u = 1; u < U; ++u) {
      m = max_nan_f32(m, max_nan_f32(max_nan_f32(__uint_as_float(r[u].v[0]), __uint_as_float(r[u].v[1])),
                                     max_nan_f32(__uint_as_float(r[u].v[2]), __uint_as_float(r[u].v[3]))));
    }
    return m;
  }
  static __device__ __forceinline__ float load(const float* p) { return *p; }
};

template <>
struct Elem<double> {
  using acc_t = double;
  static constexpr int kVec = 2;
  static __device__ __forceinline__ double get(const Raw& r, int e) {
    return __hiloint2double(static_cast<int>(r.v[2 * e + 1]), static_cast<int>(r.v[2 * e]));
  }
  template <int U>
  static __device__ __forceinline__ double vmax(const Raw (&r)[U]) {
    double m = max_nan_f64(get(r[0], 0), get(r[0], 1));
#pragma unroll
    for (int u = 1; u < U; ++u) m = max_nan_f64(m, max_nan_f64(get(r[u], 0), get(r[u], 1)));
    return m;
  }
  static __device__ __forceinline__ double load(const double* p) { return *p; }
};

// (a, ai) comes before (b, bi) in torch.argmax's order: NaN first, then larger, then lower index.
template <typename acc_t>
__device__ __forceinline__ bool better(acc_t a, int ai, acc_t b, int bi) {
  const bool an = a != a, bn = b != b;
  if (an || bn) return an && (!bn || ai < bi);
  return a > b || (a == b && ai < bi);
}

// x improves on a running best that holds only lower indices.
template <typename acc_t>
__device__ __forceinline__ bool improves(acc_t x, acc_t best) {
  return x > best || (x != x && best == best);
}

template <typename acc_t>
struct Partial {
  acc_t val;
  int32_t idx;
};

template <typename acc_t>
__device__ __forceinline__ void warp_argmax(acc_t& val, int& idx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const acc_t v = __shfl_xor_sync(0xffffffffu, val, o);
    const int i = __shfl_xor_sync(0xffffffffu, idx, o);
    if (better(v, i, val, idx)) {
      val = v;
      idx = i;
    }
  }
}

// logits   [rows, V]  row stride `stride` elements
// partial  [rows * S] (max, first index) of each slice; a slice with no elements gives (-inf, INT_MAX)
// grid: rows * S blocks; block `blockIdx.x` scans slice s = blockIdx.x % S of row blockIdx.x / S.
// kVector: 16-byte loads (row starts 16-byte aligned, V % kVec == 0); else one element at a time.
// Rows: logical row r reads logits row r (the native op), or with kIndexed the row vLLM's indices name: r < n_a
// reads row rows_a[r] (target_logits_indices), else rows_b[r - n_a] (bonus_logits_indices); an index outside
// [0, R) is reported (op, arg_a / arg_b) and its slices left at (-inf, 0): that row's argmax is token 0.
struct RowIndex {
  const void* a = nullptr;  // int32 | int64 [n_a]
  const void* b = nullptr;  // int32 | int64 [rows - n_a]
  bool a64 = false, b64 = false;
  int64_t n_a = 0, R = 0;
  int64_t* err = nullptr;
  int64_t op = 0, arg_a = 0, arg_b = 0;
};

__device__ __forceinline__ int64_t load_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

template <typename scalar_t, bool kVector, bool kIndexed = false>
__global__ void __launch_bounds__(kThreads) argmax_partial_kernel(const scalar_t* __restrict__ logits, int64_t stride,
                                                                   int64_t V, int S, int64_t chunk,
                                                                   Partial<typename Elem<scalar_t>::acc_t>* __restrict__ partial,
                                                                   RowIndex ri = RowIndex{}) {
  using E = Elem<scalar_t>;
  using acc_t = typename E::acc_t;
  // Programmatic dependent launch: the walk kernel may be launched once every block of this grid has
  // started; it waits (wait_previous_grid) for this grid's completion before reading the partials, so
  // only its launch latency overlaps with this pass.
  allow_next_grid();
  const int64_t lrow = blockIdx.x / S;
  const int s = blockIdx.x % S;
  int64_t row = lrow;
  if constexpr (kIndexed) {
    const bool in_a = lrow < ri.n_a;
    row = in_a ? load_index(ri.a, ri.a64, lrow) : load_index(ri.b, ri.b64, lrow - ri.n_a);
    if (EAGLE3_UNLIKELY(row < 0 || row >= ri.R)) {
      if (threadIdx.x == 0) {
        if (s == 0) {
          report_range(ri.err, ri.op, in_a ? ri.arg_a : ri.arg_b, row, 0, ri.R - 1, in_a ? lrow : lrow - ri.n_a);
        }
        partial[blockIdx.x] = Partial<acc_t>{static_cast<acc_t>(-INFINITY), 0};  // token 0: still a token id
      }
      return;
    }
  }
  const scalar_t* x = logits + row * stride;
  acc_t best = -INFINITY;
  int best_idx = INT_MAX;
  bool has = false;
  if constexpr (kVector) {
    // chunk counts 16-byte vectors
    const int64_t nvec = V / E::kVec;
    const int64_t v0 = s * chunk, v1 = min(nvec, v0 + chunk);
    const Raw* xv = reinterpret_cast<const Raw*>(x);
    int64_t v = v0 + threadIdx.x;
    for (; v + (kUnroll - 1) * kThreads < v1; v += kUnroll * kThreads) {
      Raw r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = load16(xv + v + u * kThreads);
      const acc_t m = E::template vmax<kUnroll>(r);
      if (!has || improves(m, best)) {  // rare: find the first element equal to m (or the first NaN)
        const bool want_nan = m != m;
        int found = INT_MAX;
#pragma unroll
        for (int u = kUnroll - 1; u >= 0; --u) {
#pragma unroll
          for (int e = E::kVec - 1; e >= 0; --e) {
            const acc_t y = E::get(r[u], e);
            if (want_nan ? y != y : y == m) found = static_cast<int>((v + u * kThreads) * E::kVec + e);
          }
        }
        best = m;
        best_idx = found;
        has = true;
      }
    }
    for (; v < v1; v += kThreads) {  // the last partial round, one vector at a time
      Raw r[1];
      r[0] = load16(xv + v);
      const acc_t m = E::template vmax<1>(r);
      if (!has || improves(m, best)) {
        const bool want_nan = m != m;
        int found = INT_MAX;
#pragma unroll
        for (int e = E::kVec - 1; e >= 0; --e) {
          const acc_t y = E::get(r[0], e);
          if (want_nan ? y != y : y == m) found = static_cast<int>(v * E::kVec + e);
        }
        best = m;
        best_idx = found;
        has = true;
      }
    }
  } else {
    // chunk counts elements
    const int64_t i0 = s * chunk, i1 = min(V, i0 + chunk);
    for (int64_t i = i0 + threadIdx.x; i < i1; i += kThreads) {
      const acc_t y = E::load(x + i);
      if (!has || improves(y, best)) {
        best = y;
        best_idx = static_cast<int>(i);
        has = true;
      }
    }
  }

  warp_argmax(best, best_idx);
  __shared__ acc_t s_val[kThreads / 32];
  __shared__ int s_idx[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_val[warp] = best;
    s_idx[warp] = best_idx;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < kThreads / 32 ? s_val[lane] : static_cast<acc_t>(-INFINITY);
    best_idx = lane < kThreads / 32 ? s_idx[lane] : INT_MAX;
    warp_argmax(best, best_idx);
    if (lane == 0) partial[blockIdx.x] = Partial<acc_t>{best, best_idx};
  }
}

// partial       [B * N * S]   phase 1's slices, row-major
// tokens        [B, N] int64  draft token per node
// parents       [B, N] int32
// accept_nodes  [B, N] int32  out: accepted path, root first, -1 padded
// accept_len    [B]    int32  out: accepted drafts (bonus excluded)
// emitted       [B, N] int64  out: accepted drafts, then the bonus, -1 padded
// err           the device error word
// grid: B blocks; dynamic shared memory 3 * N ints.
template <typename acc_t>
__global__ void __launch_bounds__(kWalkThreads) walk_kernel(const Partial<acc_t>* __restrict__ partial, int S,
                                                            const int64_t* __restrict__ tokens,
                                                            const int32_t* __restrict__ parents, int N,
                                                            int32_t* __restrict__ accept_nodes,
                                                            int32_t* __restrict__ accept_len,
                                                            int64_t* __restrict__ emitted,
                                                            int64_t* __restrict__ err) {
  extern __shared__ int smem[];
  int* target = smem;          // [N] argmax of each node's row
  int* matched = smem + N;     // [N] lowest-index child carrying that argmax (INT_MAX: none)
  int* path = smem + 2 * N;    // [N] the accepted path
  __shared__ int s_len;
  const int64_t b = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Partial<acc_t>* p = partial + b * N * S;
  wait_previous_grid();  // phase 1 has finished and its writes are visible

  for (int r = warp; r < N; r += kWalkThreads / 32) {
    acc_t best = -INFINITY;
    int best_idx = INT_MAX;
    for (int s = lane; s < S; s += 32) {
      const Partial<acc_t> q = p[static_cast<int64_t>(r) * S + s];
      if (better(q.val, q.idx, best, best_idx)) {
        best = q.val;
        best_idx = q.idx;
      }
    }
    warp_argmax(best, best_idx);
    if (lane == 0) target[r] = best_idx;
  }
  for (int j = threadIdx.x; j < N; j += kWalkThreads) matched[j] = INT_MAX;
  __syncthreads();
  const int64_t* tok = tokens + b * N;
  const int32_t* par = parents + b * N;
  if constexpr (kDeviceChecks) {  // the root's parent is never read: checked only to report
    if (threadIdx.x == 0 && par[0] != -1) report_range(err, kOpVerifyGreedy, kArgParents, par[0], -1, -1, b, 0);
  }
  for (int j = 1 + threadIdx.x; j < N; j += kWalkThreads) {
    const int pj = par[j];
    if (pj < 0 || pj >= j) {
      report_range(err, kOpVerifyGreedy, kArgParents, pj, 0, j - 1, b, j);
    } else if (tok[j] == static_cast<int64_t>(target[pj])) {
      atomicMin(&matched[pj], j);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int c = 0, a = 0;
    path[0] = 0;
    while (matched[c] != INT_MAX) {  // strictly increasing node indices: at most N - 1 steps
      c = matched[c];
      path[++a] = c;
    }
    s_len = a;
  }
  __syncthreads();
  const int a = s_len;
  if (threadIdx.x == 0) accept_len[b] = a;
  for (int i = threadIdx.x; i < N; i += kWalkThreads) {
    accept_nodes[b * N + i] = i <= a ? path[i] : -1;
    int64_t e = -1;
    if (i < a) {
      e = tok[path[i + 1]];
    } else if (i == a) {
      e = target[path[a]];
    }
    emitted[b * N + i] = e;
  }
}

// ---- vLLM's RejectionSampler layout (torch.ops.eagle3._vllm_rejection_greedy) -------------------------
// A vLLM draft is a chain: request b's drafts are draft_token_ids[start, end) with start = cu[b - 1] (0 for
// b = 0), end = cu[b]; the logits row predicting draft i of the request is target_logits_indices[start + i],
// the row after its last draft bonus_logits_indices[b]. Phase 1 ran over the logical rows 0..T-1 (the draft
// rows) then T..T+nb-1 (the bonus rows, nb = B, or 0 when the sampler's bonus tokens are given), so the
// partials of request b's row i are at (start + i) * S and its bonus row's at (T + b) * S.
//
// partial   [(T + nb) * S]  phase 1's slices
// drafts    [T]  int32 | int64     cu [B] int32 | int64     bonus_tokens [B] int32 | int64 or nullptr
// out       [B, K + 1] int32: accepted drafts, then the argmax at the first mismatch or the bonus, then -1
// err       the device error word: cu_num_draft_tokens[b] outside [start, min(start + K, T)] (the last request:
//           [T, min(start + K, T)]), or cu[b - 1] outside [0, T], is reported and the request taken as having no
//           drafts (its first slot the bonus row's argmax or the sampler's bonus, -1 after)
// grid: B blocks of kWalkThreads; a programmatic dependent of phase 1 where available.
template <typename acc_t>
__global__ void __launch_bounds__(kWalkThreads) chain_walk_kernel(const Partial<acc_t>* __restrict__ partial, int S,
                                                                  const void* __restrict__ drafts, bool drafts64,
                                                                  const void* __restrict__ cu, bool cu64,
                                                                  const void* __restrict__ bonus_tokens, bool bonus64,
                                                                  int64_t T, int K, bool bonus_rows,
                                                                  int32_t* __restrict__ out, int64_t* __restrict__ err) {
  __shared__ int target[129];  // argmax of rows 0..n (K <= 128)
  __shared__ int64_t s_start;
  __shared__ int s_n, s_first;
  const int64_t b = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {  // cu is not phase 1's output: read before waiting on it
    const int64_t prev = b == 0 ? 0 : load_index(cu, cu64, b - 1);
    const int64_t end = load_index(cu, cu64, b);
    const int64_t start = prev < 0 ? 0 : (prev > T ? T : prev);
    const int64_t hi = start + K < T ? start + K : T;
    const int64_t lo = b == gridDim.x - 1 ? T : start;  // the last request ends at num_tokens
    int n = static_cast<int>(end - start);
    if (EAGLE3_UNLIKELY(end < lo || end > hi || prev != start)) {
      report_range(err, kOp_vllmRejectionGreedy, kArgCuNumDraftTokens, end, lo, hi, b);
      n = 0;
    }
    s_start = start;
    s_n = n;
    s_first = n;
  }
  __syncthreads();
  const int64_t start = s_start;
  const int n = s_n;
  wait_previous_grid();  // phase 1 has finished and its writes are visible
  const int rows = bonus_rows ? n + 1 : n;  // row n (the bonus row) only when logits has it
  for (int r = warp; r < rows; r += kWalkThreads / 32) {
    const Partial<acc_t>* p = partial + (r < n ? start + r : T + b) * S;
    acc_t best = -INFINITY;
    int best_idx = INT_MAX;
    for (int s = lane; s < S; s += 32) {
      const Partial<acc_t> q = p[s];
      if (better(q.val, q.idx, best, best_idx)) {
        best = q.val;
        best_idx = q.idx;
      }
    }
    warp_argmax(best, best_idx);
    if (lane == 0) target[r] = best_idx;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += kWalkThreads) {
    if (load_index(drafts, drafts64, start + i) != static_cast<int64_t>(target[i])) atomicMin(&s_first, i);
  }
  __syncthreads();
  const int a = s_first;  // drafts accepted
  for (int i = threadIdx.x; i <= K; i += kWalkThreads) {
    int64_t e = -1;
    if (i < a) {
      e = load_index(drafts, drafts64, start + i);
    } else if (i == a) {
      e = a < n || bonus_tokens == nullptr ? target[a] : load_index(bonus_tokens, bonus64, b);
    }
    out[b * (K + 1) + i] = static_cast<int32_t>(e);
  }
}

// PDL needs sm_90 in the device and in the binary the runtime loaded for `kernel`: compiled for an older
// architecture its wait_previous_grid is empty, and as a dependent it could read phase 1's partials early.
template <typename Kernel>
bool pdl_available(Kernel kernel, int device) {
  if (sm_major(device) < 9) return false;
  static std::atomic<int> ptx[64] = {};  // per device: the runtime picks one image per architecture
  const bool cacheable = device >= 0 && device < 64;
  int v = cacheable ? ptx[device].load(std::memory_order_relaxed) : 0;
  if (v == 0) {
    cudaFuncAttributes attrs{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attrs, kernel));  // of the current device
    v = attrs.ptxVersion;
    if (cacheable) ptx[device].store(v, std::memory_order_relaxed);
  }
  return v >= 90;
}

template <typename scalar_t>
void launch(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents, int64_t B, int64_t N,
            at::Tensor& accept_nodes, at::Tensor& accept_len, at::Tensor& emitted, int64_t* err,
            cudaStream_t stream) {
  using E = Elem<scalar_t>;
  using acc_t = typename E::acc_t;
  const int64_t rows = B * N, V = logits.size(1), stride = logits.stride(0);
  const bool vector = V % E::kVec == 0 && (stride * static_cast<int64_t>(sizeof(scalar_t))) % 16 == 0 &&
                      aligned16(logits.data_ptr());
  // Enough blocks to keep every SM streaming (about 6 per SM), but never a slice shorter than one full
  // round of the block (kUnroll vectors per thread): many slices per row at B 1, few at B 64.
  const int64_t units = vector ? V / E::kVec : V;
  const int64_t round = vector ? kThreads * kUnroll : kThreads;
  const int64_t want = (6 * num_sms(logits.get_device()) + rows - 1) / rows;
  const int64_t most = (units + round - 1) / round;
  int64_t S = std::max<int64_t>(1, std::min<int64_t>({want, most, kMaxSplits}));
  const int64_t chunk = (units + S - 1) / S;
  S = (units + chunk - 1) / chunk;  // every slice non-empty
  TORCH_CHECK_VALUE(rows * S < (int64_t{1} << 31), "logits has too many rows: B * N = ", rows);

  at::Tensor partial = at::empty({rows * S * static_cast<int64_t>(sizeof(Partial<acc_t>))},
                                 logits.options().dtype(at::kByte));
  auto* part = reinterpret_cast<Partial<acc_t>*>(partial.data_ptr());
  const scalar_t* x = logits.data_ptr<scalar_t>();
  if (vector) {
    argmax_partial_kernel<scalar_t, true><<<static_cast<unsigned>(rows * S), kThreads, 0, stream>>>(x, stride, V, S, chunk, part);
  } else {
    argmax_partial_kernel<scalar_t, false><<<static_cast<unsigned>(rows * S), kThreads, 0, stream>>>(x, stride, V, S, chunk, part);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const size_t smem = 3 * static_cast<size_t>(N) * sizeof(int);
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(walk_kernel<acc_t>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  // a programmatic dependent of phase 1 where it can be (its launch overlaps phase 1's tail)
  launch_ex(walk_kernel<acc_t>, dim3(static_cast<unsigned>(B)), dim3(kWalkThreads), smem, stream, 0,
            pdl_available(walk_kernel<acc_t>, logits.get_device()),
            static_cast<const Partial<acc_t>*>(part), static_cast<int>(S), tokens.data_ptr<int64_t>(),
            parents.data_ptr<int32_t>(), static_cast<int>(N), accept_nodes.data_ptr<int32_t>(),
            accept_len.data_ptr<int32_t>(), emitted.data_ptr<int64_t>(), err);
}

// vLLM's layout: phase 1 over the T draft rows and nb bonus rows in place (through the indices), then the
// chain walk writing vLLM's output. Shapes checked by the caller (vllm::layout).
template <typename scalar_t>
void launch_vllm(const at::Tensor& logits, const at::Tensor& drafts, const at::Tensor& cu, const at::Tensor& target,
                 const at::Tensor& bonus_idx, const at::Tensor* bonus_tokens, int64_t B, int64_t T, int64_t K,
                 int64_t nb, at::Tensor& out, int64_t* err, cudaStream_t stream) {
  using E = Elem<scalar_t>;
  using acc_t = typename E::acc_t;
  const int64_t rows = T + nb, V = logits.size(1), stride = logits.stride(0);
  const bool vector = V % E::kVec == 0 && (stride * static_cast<int64_t>(sizeof(scalar_t))) % 16 == 0 &&
                      aligned16(logits.data_ptr());
  const int64_t units = vector ? V / E::kVec : V;
  const int64_t round = vector ? kThreads * kUnroll : kThreads;
  int64_t S = 1;
  at::Tensor partial;
  if (rows > 0) {
    const int64_t want = (6 * num_sms(logits.get_device()) + rows - 1) / rows;
    const int64_t most = (units + round - 1) / round;
    S = std::max<int64_t>(1, std::min<int64_t>({want, most, kMaxSplits}));
    const int64_t chunk = (units + S - 1) / S;
    S = (units + chunk - 1) / chunk;
    TORCH_CHECK_VALUE(rows * S < (int64_t{1} << 31), "logits has too many rows: num_tokens + batch_size = ", rows);
    partial = at::empty({rows * S * static_cast<int64_t>(sizeof(Partial<acc_t>))}, logits.options().dtype(at::kByte));
    RowIndex ri;
    ri.a = target.data_ptr();
    ri.a64 = target.scalar_type() == at::kLong;
    ri.n_a = T;
    ri.b = bonus_idx.data_ptr();
    ri.b64 = bonus_idx.scalar_type() == at::kLong;
    ri.R = logits.size(0);
    ri.err = err;
    ri.op = kOp_vllmRejectionGreedy;
    ri.arg_a = kArgTargetLogitsIndices;
    ri.arg_b = kArgBonusLogitsIndices;
    auto* part = reinterpret_cast<Partial<acc_t>*>(partial.data_ptr());
    const scalar_t* x = logits.data_ptr<scalar_t>();
    if (vector) {
      argmax_partial_kernel<scalar_t, true, true><<<static_cast<unsigned>(rows * S), kThreads, 0, stream>>>(
          x, stride, V, static_cast<int>(S), chunk, part, ri);
    } else {
      argmax_partial_kernel<scalar_t, false, true><<<static_cast<unsigned>(rows * S), kThreads, 0, stream>>>(
          x, stride, V, static_cast<int>(S), chunk, part, ri);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  launch_ex(chain_walk_kernel<acc_t>, dim3(static_cast<unsigned>(B)), dim3(kWalkThreads), 0, stream, 0,
            rows > 0 && pdl_available(chain_walk_kernel<acc_t>, logits.get_device()),
            static_cast<const Partial<acc_t>*>(rows > 0 ? partial.data_ptr() : nullptr), static_cast<int>(S),
            static_cast<const void*>(drafts.data_ptr()), drafts.scalar_type() == at::kLong,
            static_cast<const void*>(cu.data_ptr()), cu.scalar_type() == at::kLong,
            static_cast<const void*>(bonus_tokens ? bonus_tokens->data_ptr() : nullptr),
            bonus_tokens ? bonus_tokens->scalar_type() == at::kLong : false, T, static_cast<int>(K), nb > 0,
            out.data_ptr<int32_t>(), err);
}

// vLLM v1 RejectionSampler's all-greedy step on its own tensors (eagle3_ops.compat.vllm, the CUDA fast path):
// logits                 [R, V] bf16 | fp16 | fp32 | fp64 (R >= num_tokens + nb), last dim contiguous
// draft_token_ids        [num_tokens] int32 | int64
// cu_num_draft_tokens    [batch_size] int32 | int64 (inclusive cumulative drafts per request)
// target_logits_indices  [num_tokens] int32 | int64 (the row predicting each draft)
// bonus_logits_indices   [batch_size] int32 | int64 (each request's bonus row), or [0] with bonus_token_ids
// bonus_token_ids        [batch_size] or [batch_size, 1] int32 | int64, optional: the sampler's bonus tokens
// returns sampled_token_ids [batch_size, max_spec_len + 1] int32
at::Tensor vllm_rejection_greedy_cuda(const at::Tensor& logits, const at::Tensor& draft_token_ids,
                                      const at::Tensor& cu_num_draft_tokens, const at::Tensor& target_logits_indices,
                                      const at::Tensor& bonus_logits_indices,
                                      const std::optional<at::Tensor>& bonus_token_ids, int64_t batch_size,
                                      int64_t num_tokens, int64_t max_spec_len) {
  const int64_t B = batch_size, T = num_tokens, K = max_spec_len;
  const int64_t nb = vllm::layout(logits, draft_token_ids, cu_num_draft_tokens, target_logits_indices,
                                  bonus_logits_indices, bonus_token_ids, B, T, K);
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  at::Tensor out = at::empty({B, K + 1}, draft_token_ids.options().dtype(at::kInt));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int device = logits.get_device();
  int64_t* err = device_error_word(device);
  const at::Tensor* bt = bonus_token_ids ? &*bonus_token_ids : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "_vllm_rejection_greedy", [&] {
    launch_vllm<scalar_t>(logits, draft_token_ids, cu_num_draft_tokens, target_logits_indices, bonus_logits_indices,
                          bt, B, T, K, nb, out, err, stream);
  });
  after_launch(device, stream);
  return out;
}

// logits   [B * N, V]  bf16 | fp16 | fp32 | fp64, last dim contiguous
// tokens   [B, N]      int64, contiguous
// parents  [B, N]      int32, contiguous
// returns  accept_nodes [B, N] int32, accept_len [B] int32, emitted [B, N] int64
std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_greedy_cuda(const at::Tensor& logits, const at::Tensor& tokens,
                                                                  const at::Tensor& parents) {
  TORCH_CHECK_TYPE(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kHalf ||
                       logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble,
                   "logits must have dtype bfloat16 | float16 | float32 | float64, got ", logits.scalar_type());
  CHECK_DIM(logits, 2);
  TORCH_CHECK_VALUE(logits.size(1) <= 1 || logits.stride(1) == 1,
                    "logits must be contiguous in its last dimension, got strides ", logits.strides());
  CHECK_CUDA(logits);
  CHECK_DTYPE(tokens, at::kLong);
  CHECK_DIM(tokens, 2);
  CHECK_SAME_DEVICE(tokens, logits);
  TORCH_CHECK_VALUE(tokens.is_contiguous(), "tokens must be contiguous, got strides ", tokens.strides());
  const int64_t B = tokens.size(0), N = tokens.size(1);
  TORCH_CHECK_VALUE(N > 0, "tokens must have N >= 1 nodes (node 0 is the root)");
  CHECK_DTYPE(parents, at::kInt);
  CHECK_SHAPE(parents, B, N);
  CHECK_SAME_DEVICE(parents, logits);
  TORCH_CHECK_VALUE(parents.is_contiguous(), "parents must be contiguous, got strides ", parents.strides());
  const int64_t V = logits.size(1);
  CHECK_SHAPE(logits, B * N, V);
  TORCH_CHECK_VALUE(V > 0, "logits must have V >= 1");
  TORCH_CHECK_VALUE(V < (int64_t{1} << 31), "logits must have V < 2**31, got ", V);
  TORCH_CHECK_VALUE(N <= kMaxNodes, "tokens must have N <= ", kMaxNodes, " nodes on CUDA (the walk keeps the tree in shared memory), got ", N);

  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  auto idx = tokens.options();
  at::Tensor accept_nodes = at::empty({B, N}, idx.dtype(at::kInt));
  at::Tensor accept_len = at::empty({B}, idx.dtype(at::kInt));
  at::Tensor emitted = at::empty({B, N}, idx.dtype(at::kLong));
  if (B == 0) return {accept_nodes, accept_len, emitted};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int device = logits.get_device();
  int64_t* err = device_error_word(device);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "verify_greedy", [&] {
    launch<scalar_t>(logits, tokens, parents, B, N, accept_nodes, accept_len, emitted, err, stream);
  });
  after_launch(device, stream);
  return {accept_nodes, accept_len, emitted};
}

}  // namespace
}  // namespace eagle3

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) {
  m.impl("verify_greedy", &eagle3::verify_greedy_cuda);
  m.impl("_vllm_rejection_greedy", &eagle3::vllm_rejection_greedy_cuda);
}
