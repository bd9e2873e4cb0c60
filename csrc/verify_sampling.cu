// verify_sampling: tree rejection sampling from target logits (reference.verify_sampling is the spec).
//
// Four launches, no host sync, nothing fp32 [B, N, V]:
//   1. row_stats: one pass over all B * N logit rows, in chunks of kChunk tokens per block: per chunk
//      the max, its first index and sum exp((l - max) / T). The memory-bound part (the floor).
//   2. walk: one block per request. Combines the chunk stats of the rows on its path, walks the tree
//      (children in index order, u_k from Philox stream 0), keeps the residual distribution in closed
//      form, and writes accept_nodes, accept_len and the accepted draft tokens.
//        - without draft_probs (one-hot q): after rejecting x, p <- p with p(x) = 0, renormalised by
//          1 - p(x): a set R of rejected tokens and a scale, no pass over the vocabulary;
//        - with draft_probs: q of the current row is read in place (no d2t) or scattered through d2t
//          into a per-request fp32 scratch row [B, V] (never [B, N, V]), and each rejection costs one
//          block pass over V for the residual's mass sum_v max(p_j(v) - q(v), 0); p_j(v) is recomputed
//          pointwise from (p(v), q(v)) and the chain of those sums. The passes over V issue 4 loads per
//          thread before using them, in the same per-thread order (the same sums).
//   3. race: the bonus token of each request's last row, argmax_v p_k(v) / E_v with E_v = -log(u_v)
//      (Philox stream 1, idx = token id), over all chunks of that row in parallel; per request a
//      packed (score, -token) key reduced with atomicMax, so ties go to the lowest token id. Tokens
//      whose logit bounds their score below the thread's best so far skip Philox (E_v >= -log(1 -
//      2^-24) gives score <= (l - max) / T + 16.7): exact, and most of a peaked row is skipped.
//   4. finish: writes the bonus after the accepted drafts.
//
// Bit-for-bit and where it cannot be: the uniforms are the reference's exactly (same Philox counters,
// same float32 values). The decisions compare u * q(x) < p(x) with p from float32 exp and float64
// sums, where the reference computes in float64; the bonus compares log-domain float32 scores where
// the reference divides float64 values. A decision or a race therefore differs from the reference
// only when the two sides are within ~1e-6 relative of each other: the GPU tests require exact
// agreement on all but a tiny fraction of draws, and the chi-square tests check the distribution.
// Temperature 0 (greedy) compares logits only and agrees exactly.
//
// Bad values are recorded in the device error word (eagle3/errors.h; the CPU reference raises the same
// message) and made harmless: a negative or NaN temperature samples greedily; a node j whose parent is
// not in [0, j) is never visited (not tried, no uniform drawn for it; nor is any node below it) and a
// root parent other than -1 is ignored (children are looked for only at larger indices, so a walk ends
// after at most N - 1 steps); a d2t entry outside [-d, V - 1 - d] (draft id d + d2t[d] outside the
// target vocabulary) drops that draft id's probability from q. A token outside [0, V) is valid and has
// probability 0 (never accepted, never excluded), as in the reference. A non-injective d2t is handled (q(t) sums
// every draft id mapped to t, as the reference's index_add), in an order that may vary in the last bit.

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "eagle3/checks.h"
#include "eagle3/compat_vllm.h"
#include "eagle3/errors.cuh"
#include "eagle3/errors.h"

namespace eagle3 {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 8192;  // tokens per block in row_stats and race
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kMaxNegLogE = 16.7f;  // > -log(-log(1 - 2^-24)) = 16.635: the race score's headroom

// ---- Philox4x32-10 (eagle3_ops._philox): counter (idx, row | stream << 31, offset lo, offset hi) ----
__device__ __forceinline__ float philox_uniform(uint32_t idx, uint32_t row_stream, uint64_t offset, uint64_t seed) {
  uint32_t c0 = idx, c1 = row_stream, c2 = static_cast<uint32_t>(offset), c3 = static_cast<uint32_t>(offset >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
    const uint32_t lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return static_cast<float>((c0 >> 9) * 2u + 1u) * 5.9604644775390625e-08f;  // 2^-24
}

template <typename T>
__device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }

// Order-preserving unsigned image of a float (NaN aside).
__device__ __forceinline__ uint32_t ordered(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Per-request state handed from walk to race and finish.
//   ws_i [B, 10 + N] int64: final row (Philox's), greedy, argmax of the final row, |R| or rejections, race key,
//                         accept_len, the final row's q row (-1: q = 0 there), the final row's logits row, the
//                         sampler's bonus taken (1: race skipped), the smallest d2t index out of range
//                         (kNoBadD2t: none; finish reports it), then R (one-hot path: rejected tokens)
//   ws_d [B, 4 + N] f64:  max of the final row, 1 / T, Z (sum exp((l - max) / T)), -, then per rejection
//                         1 / residual mass (0: that rejection left p unchanged) (draft_probs path)
constexpr int kWsI = 10, kWsD = 4;
constexpr int64_t kNoBadD2t = INT64_MAX;  // ws_i[b, 9]: no d2t entry out of range seen by request b's walk
// The walk keeps one double per node in dynamic shared memory: 128 KB at the cap, past the 48 KB a launch
// gets by default (N > 6144), so the launcher raises the kernel's limit (the cap as verify_greedy's).
constexpr int64_t kMaxNodes = 16384;

// vLLM's RejectionSampler layout (torch.ops.eagle3._vllm_rejection_sampling): the chain of request b is node 0
// (its last verified token) then its drafts draft_token_ids[start, start + n) (start = cu[b - 1], 0 for b = 0,
// n = cu[b] - start), padded to N = max_spec_len + 1 nodes as the native op's chain (parents -1, 0, 1, ...)
// but with nothing stored for the padding: node c < n reads logits row target_logits_indices[start + c] and
// draft_probs row start + c, node n the bonus row bonus_logits_indices[b] (q = 0 there); the nodes past n are
// never visited. Philox's row of node c stays b * N + c, so the draws are the native op's on the padded chain.
// enabled false: the native op (every pointer below unused).
struct Chain {
  bool enabled = false;
  const void* drafts = nullptr;  // [T] int32 | int64
  const void* cu = nullptr;      // [B] int32 | int64
  const void* target = nullptr;  // [T] int32 | int64
  const void* bonus = nullptr;   // [B] int32 | int64, nullptr with bonus_tokens (the bonus rows never read)
  const void* bonus_tokens = nullptr;  // [B] int32 | int64: the sampler's bonus, nullptr: ours
  bool d64 = false, cu64 = false, t64 = false, b64 = false, bt64 = false;
  int64_t T = 0, R = 0;  // drafts in all, logits rows
  int B = 0, K = 0;
};

__device__ __forceinline__ int64_t ld_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Request b's drafts [start, start + n); false (n = 0, start clamped into [0, T]) when cu[b] is outside
// [lo, hi] = [start, min(start + K, T)] ([T, min(start + K, T)] for the last request) or cu[b - 1] outside [0, T].
__device__ __forceinline__ bool chain_span(const Chain& ch, int64_t b, int64_t& start, int& n, int64_t& end,
                                           int64_t& lo, int64_t& hi) {
  const int64_t prev = b == 0 ? 0 : ld_index(ch.cu, ch.cu64, b - 1);
  end = ld_index(ch.cu, ch.cu64, b);
  start = prev < 0 ? 0 : (prev > ch.T ? ch.T : prev);
  lo = b == ch.B - 1 ? ch.T : start;  // the last request ends at num_tokens
  hi = start + ch.K < ch.T ? start + ch.K : ch.T;
  const bool ok = end >= lo && end <= hi && prev == start;
  n = ok ? static_cast<int>(end - start) : 0;
  return ok;
}

// The logits row of chain node c (c <= n): in [0, R) (an index outside is reported by row_stats and row 0 read;
// row 0 also stands for node n's absent bonus row with the sampler's bonus, never read then).
__device__ __forceinline__ int64_t chain_row(const Chain& ch, int64_t b, int64_t start, int n, int c, bool* bad,
                                             int64_t* value) {
  if (c >= n && ch.bonus == nullptr) {  // the sampler's bonus: no bonus row, none read
    if (bad != nullptr) *bad = false;
    if (value != nullptr) *value = 0;
    return 0;
  }
  const int64_t r = c < n ? ld_index(ch.target, ch.t64, start + c) : ld_index(ch.bonus, ch.b64, b);
  const bool out = r < 0 || r >= ch.R;
  if (bad != nullptr) *bad = out;
  if (value != nullptr) *value = r;
  return out ? 0 : r;
}

// p_j(v) from p(v), q(v) after j rejections on the draft_probs path.
__device__ __forceinline__ double residual_prob(double pv, double qv, const double* inv, int j) {
  for (int i = 0; i < j; ++i) {
    if (inv[i] > 0) pv = fmax(pv - qv, 0.0) * inv[i];
  }
  return pv;
}

template <typename T>
__device__ __forceinline__ T block_sum(T v, T* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < (blockDim.x >> 5); ++w) total += red[w];
  return total;
}

// The checks that only report (the walk never needs them: a bad temperature samples greedily, a bad parent is
// never visited, a bad cu entry leaves the request no drafts), made by row_stats' first block of each row
// (blockIdx.y 0, thread 0) after its stores. The walk, whose passes over V are the draft_probs path's hot loop,
// carries no check code at all: it compiles to the same SASS with and without EAGLE3_DEVICE_CHECKS (issue 21: with
// its checks inlined the draft_probs path measured 1.12x the checks-off build on the H200 at 9bf26fc), and
// row_stats' loop keeps its instructions (227 on sm_90a either way).
// Node 0's block: temperature[b] (vLLM's old greedy placeholder -1 allowed in chain mode) and, chain mode,
// cu_num_draft_tokens[b]; native op, every node's block: parents[b, node] (the root's -1, others' in [0, node)).
__device__ __forceinline__ void report_row(int64_t* err, int64_t row, int N, const float* temperature,
                                        const int32_t* parents, const Chain& ch) {
  const int64_t b = row / N;
  const int node = static_cast<int>(row % N);
  if (node == 0) {
    const float T = temperature[b];
    if (!(T >= 0.0f) && !(ch.enabled && T == -1.0f)) {
      report_float(err, ch.enabled ? kOp_vllmRejectionSampling : kOpVerifySampling, kArgTemperature,
                   T != T ? kKindNaN : kKindNegative, T, b);
    }
  }
  if (ch.enabled) {
    int64_t start, end, lo, hi;
    int n;
    if (node == 0 && !chain_span(ch, b, start, n, end, lo, hi)) {
      report_range(err, kOp_vllmRejectionSampling, kArgCuNumDraftTokens, end, lo, hi, b);
    }
  } else if (parents != nullptr) {
    const int64_t p = parents[row], lo = node == 0 ? -1 : 0;
    if (p < lo || p > node - 1) report_range(err, kOpVerifySampling, kArgParents, p, lo, node - 1, b, node);
  }
}

// ---- 1. row_stats ----------------------------------------------------------------------------------
// logits [B * N, V] row stride ld; part_m / part_s [B * N, G] f32, part_a [B * N, G] i32
// grid: (B * N, G = ceil(V / kChunk))
// Chain (vLLM's layout): block (b * N + node) reads the node's logits row through the indices; the padding past
// request b's n drafts (and its bonus row, with the sampler's bonus) returns at once.
// parents [B, N] int32 (native op; nullptr in chain mode), err: only for report_row and the chain's row indices.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) row_stats_kernel(const scalar_t* __restrict__ logits, int64_t ld,
                                                             int64_t V, int N, const float* __restrict__ temperature,
                                                             float* __restrict__ part_m, int32_t* __restrict__ part_a,
                                                             float* __restrict__ part_s, Chain ch = Chain{},
                                                             int64_t* __restrict__ err = nullptr,
                                                             const int32_t* __restrict__ parents = nullptr) {
  const int64_t row = blockIdx.x;
  const int G = gridDim.y;
  int64_t prow = row;
  if (ch.enabled) {
    const int64_t b = row / N;
    const int node = static_cast<int>(row % N);
    int64_t start, end, lo, hi;
    int n;
    chain_span(ch, b, start, n, end, lo, hi);
    if (node > n || (node == n && ch.bonus == nullptr)) {  // never visited, or the sampler's bonus
      if constexpr (kDeviceChecks) {
        if (threadIdx.x == 0 && blockIdx.y == 0) report_row(err, row, N, temperature, parents, ch);
      }
      return;
    }
    bool bad;
    int64_t value;
    prow = chain_row(ch, b, start, n, node, &bad, &value);
    if (EAGLE3_UNLIKELY(bad)) {
      if (threadIdx.x == 0 && blockIdx.y == 0) {
        report_range(err, kOp_vllmRejectionSampling, node < n ? kArgTargetLogitsIndices : kArgBonusLogitsIndices,
                     value, 0, ch.R - 1, node < n ? start + node : b);
      }
    }
  }
  const float T = temperature[row / N];
  const bool greedy = !(T > 0.0f);
  const float c = greedy ? 0.0f : kLog2e / T;
  const scalar_t* x = logits + prow * ld;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * kChunk;
  const int64_t end = min(V, begin + kChunk);
  float m = -INFINITY, s = 0.0f;
  int32_t a = static_cast<int32_t>(begin);
  // Unrolled by 4 with all loads first; each thread visits its tokens in increasing order, so a
  // strict > keeps the first maximum.
  for (int64_t v0 = begin + threadIdx.x; v0 < end; v0 += 4 * kThreads) {
    float l[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t v = v0 + u * kThreads;
      l[u] = v < end ? to_f(x[v]) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t v = v0 + u * kThreads;
      if (v >= end) break;
      if (l[u] > m) {
        s = m == -INFINITY ? 0.0f : s * exp2f((m - l[u]) * c);
        m = l[u];
        a = static_cast<int32_t>(v);
      }
      if (!greedy && l[u] != -INFINITY) s += exp2f((l[u] - m) * c);
    }
  }
  // block reduction of (m, a, s): max, then the smallest index at the max, sums rescaled
  __shared__ float sm[kThreads / 32], ss[kThreads / 32];
  __shared__ int32_t sa[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    const int32_t a2 = __shfl_xor_sync(0xffffffffu, a, o);
    const float mn = fmaxf(m, m2);
    if (!greedy) {
      s = (m == -INFINITY ? 0.0f : s * exp2f((m - mn) * c)) + (m2 == -INFINITY ? 0.0f : s2 * exp2f((m2 - mn) * c));
    }
    a = (m2 > m || (m2 == m && a2 < a)) ? a2 : a;
    m = mn;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
    sa[warp] = a;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) {
      const float mn = fmaxf(m, sm[w]);
      if (!greedy) {
        s = (m == -INFINITY ? 0.0f : s * exp2f((m - mn) * c)) +
            (sm[w] == -INFINITY ? 0.0f : ss[w] * exp2f((sm[w] - mn) * c));
      }
      a = (sm[w] > m || (sm[w] == m && sa[w] < a)) ? sa[w] : a;
      m = mn;
    }
    part_m[row * G + blockIdx.y] = m;
    part_a[row * G + blockIdx.y] = a;
    part_s[row * G + blockIdx.y] = s;
    if constexpr (kDeviceChecks) {
      if (blockIdx.y == 0) report_row(err, row, N, temperature, parents, ch);
    }
  }
}

// ---- 2. walk ---------------------------------------------------------------------------------------
// tokens [B, N] int64, parents [B, N] int32, draft_probs [B * N, Vd] row stride ldq (nullptr: one-hot),
// d2t [Vd] int64 (nullptr: identity), qt [B, V] f32 scratch (draft_probs with d2t only; nullptr otherwise)
// outputs accept_nodes [B, N] i32, accept_len [B] i32, emitted [B, N] i64 (bonus slot left to finish)
// err: unused (the walk reports nothing: see report_row and finish)
// grid: B; dynamic shared memory: N doubles (1 / residual mass per rejection)
// kChain: vLLM's layout (ch); a template argument so that the native op's build carries none of its registers.
template <typename scalar_t, typename prob_t, bool kChain>
__global__ void __launch_bounds__(kThreads) walk_kernel(
    const scalar_t* __restrict__ logits, int64_t ld, int64_t V, const prob_t* __restrict__ draft_probs, int64_t ldq,
    int64_t Vd, const int64_t* __restrict__ d2t, const int64_t* __restrict__ tokens, const int32_t* __restrict__ parents,
    int N, const float* __restrict__ temperature, const int64_t* __restrict__ seed, const int64_t* __restrict__ offset,
    const float* __restrict__ part_m, const int32_t* __restrict__ part_a, const float* __restrict__ part_s, int G,
    float* __restrict__ qt, int64_t* __restrict__ ws_i, double* __restrict__ ws_d, int32_t* __restrict__ accept_nodes,
    int32_t* __restrict__ accept_len, int64_t* __restrict__ emitted, int64_t* __restrict__ err, Chain ch = Chain{}) {
  extern __shared__ double inv[];  // [N]
  __shared__ double red[kThreads / 32];
  __shared__ double sh_m, sh_Z;
  __shared__ int32_t sh_a;
  // the accepted child or -1, by the parity of the child tried (k): with no draft_probs a rejected child is followed
  // by the next one's decision with no barrier between a thread's read of this one and thread 0's write of that
  // one; one slot was overwritten before slow warps had read it (compute-sanitizer racecheck, at 3987bd8 on the H200)
  __shared__ int sh_next[2];
  const int64_t b = blockIdx.x;
  int64_t start = 0;  // chain: this request's drafts [start, start + n_drafts)
  int n_drafts = N - 1;
  if (kChain) {  // a bad cu entry (n_drafts 0) is reported by row_stats (report_row)
    int64_t end, lo, hi;
    chain_span(ch, b, start, n_drafts, end, lo, hi);
  }
  const float T = temperature[b];
  const bool greedy = !(T > 0.0f);
  const double invT = greedy ? 0.0 : 1.0 / static_cast<double>(T);
  const uint64_t sd = static_cast<uint64_t>(seed[b]), off = offset != nullptr ? static_cast<uint64_t>(offset[b]) : 0;
  const bool has_q = draft_probs != nullptr;
  const bool gather = has_q && d2t != nullptr;  // host: without d2t, Vd == V
  int64_t* wi = ws_i + b * (kWsI + N);
  double* wd = ws_d + b * (kWsD + N);
  // No check code here in either build: temperature, parents and cu are reported by row_stats (report_row), a
  // bad d2t entry's index goes to wi[9] (the smallest, atomicMin) and finish reports it.
  int c = 0, depth = 0;
  if (threadIdx.x == 0) {
    accept_nodes[b * N] = 0;
    wi[9] = kNoBadD2t;  // before the gather's __syncthreads, so before any atomicMin below
  }
  while (true) {
    const int64_t row = b * N + c;
    const int64_t prow = kChain ? chain_row(ch, b, start, n_drafts, c, nullptr, nullptr) : row;
    const scalar_t* lrow = logits + prow * ld;
    // q of this row in target ids: with d2t scattered into the scratch row; without, draft_probs' own row (the
    // value the scatter would have left there: 0 + q exactly), with no pass over V. Chain: draft row start + c
    // below the last draft; node n has no child, and its q (0) is read only by the race.
    const int64_t qrow_i = !has_q ? -1 : !kChain ? row : (c < n_drafts ? start + c : -1);
    const prob_t* qsrc = qrow_i >= 0 ? draft_probs + qrow_i * ldq : nullptr;
    if (gather) {
      float* qrow = qt + b * V;
      for (int64_t v = threadIdx.x; v < V; v += kThreads) qrow[v] = 0.0f;
      __syncthreads();
      int64_t bad_d = -1;  // this thread's first d2t entry out of range, recorded after the loop
      for (int64_t d0 = threadIdx.x; d0 < Vd; d0 += 4 * kThreads) {
        int64_t o[4];
        float q[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int64_t d = d0 + u * kThreads;
          o[u] = d < Vd ? d2t[d] : 0;
          q[u] = d < Vd ? to_f(qsrc[d]) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int64_t d = d0 + u * kThreads;
          if (d >= Vd) break;
          if (o[u] >= -d && o[u] <= V - 1 - d) {  // compared, never added unchecked: no overflow
            atomicAdd(qrow + d + o[u], q[u]);
          } else if (bad_d < 0) {
            bad_d = d;
          }
        }
      }
      if (EAGLE3_UNLIKELY(bad_d >= 0)) atomicMin(reinterpret_cast<long long*>(wi + 9), static_cast<long long>(bad_d));
      __syncthreads();
    }
    auto q_at = [&](int64_t v) -> float { return gather ? qt[b * V + v] : to_f(qsrc[v]); };
    // the sampler's bonus after every draft accepted: this row's stats are not needed (row_stats skipped it)
    const bool sampler_bonus = kChain && ch.bonus_tokens != nullptr && c == n_drafts;
    if (threadIdx.x == 0 && sampler_bonus) {
      sh_m = 0.0;
      sh_a = 0;
      sh_Z = 1.0;
    } else if (threadIdx.x == 0) {
      float m = -INFINITY;
      int32_t a = 0;
      for (int g = 0; g < G; ++g) {
        const float mg = part_m[row * G + g];
        if (mg > m) {
          m = mg;
          a = part_a[row * G + g];
        }
      }
      double Z = 0.0;
      if (!greedy) {
        for (int g = 0; g < G; ++g) {
          const float mg = part_m[row * G + g];
          if (mg != -INFINITY) Z += static_cast<double>(part_s[row * G + g]) * exp((static_cast<double>(mg) - m) * invT);
        }
      }
      sh_m = m;
      sh_a = G > 0 ? a : 0;
      sh_Z = Z;
    }
    __syncthreads();
    const double m = sh_m, Z = sh_Z;
    const int32_t amax = sh_a;
    auto prob = [&](int64_t v, float l) -> double {  // p(v) of this row, before any rejection
      if (greedy) return v == amax ? 1.0 : 0.0;
      return exp((static_cast<double>(l) - m) * invT) / Z;
    };
    int n_rej = 0, n_R = 0, k = 0;
    double scale = 1.0;  // one-hot path: p_j(v) = p(v) * scale outside R
    int next = -1;
    const int j_end = !kChain ? N : (c < n_drafts ? c + 2 : c + 1);  // chain: node c's one child, c + 1
    for (int j = c + 1; j < j_end; ++j) {
      if (!kChain && parents[b * N + j] != c) continue;
      const int64_t x = kChain ? ld_index(ch.drafts, ch.d64, start + c) : tokens[b * N + j];
      const bool valid = x >= 0 && x < V;
      if (threadIdx.x == 0) {
        double px = 0.0, qx = 1.0;
        if (valid) {
          const double p0 = prob(x, to_f(lrow[x]));
          if (has_q) {
            qx = q_at(x);
            px = residual_prob(p0, qx, inv, n_rej);
          } else {
            bool out = false;
            for (int i = 0; i < n_R; ++i) out |= wi[kWsI + i] == x;
            px = out ? 0.0 : p0 * scale;
          }
        }
        const double u = philox_uniform(static_cast<uint32_t>(k), static_cast<uint32_t>(row), off, sd);
        const bool acc = u * qx < px;
        sh_next[k & 1] = acc ? j : -1;
        if (!acc && !has_q && valid && px < 1.0 && px > 0.0) {  // x leaves the support, the rest scales up
          wi[kWsI + n_R++] = x;
          scale /= (1.0 - px);
        }
      }
      __syncthreads();
      next = sh_next[k & 1];
      if (next >= 0) break;
      if (has_q) {  // residual mass sum_v max(p_j(v) - q(v), 0): one block pass over V
        const float mf = static_cast<float>(m), cf = static_cast<float>(invT) * kLog2e;
        double part = 0.0;
        for (int64_t v0 = threadIdx.x; v0 < V; v0 += 4 * kThreads) {
          float q[4], l[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int64_t v = v0 + u * kThreads;
            q[u] = v < V ? q_at(v) : 0.0f;
            l[u] = v < V ? to_f(lrow[v]) : 0.0f;
          }
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int64_t v = v0 + u * kThreads;
            if (v >= V) break;
            const double qv = q[u];
            const double p0 = greedy ? (v == amax ? 1.0 : 0.0) : static_cast<double>(exp2f((l[u] - mf) * cf)) / Z;
            part += fmax(residual_prob(p0, qv, inv, n_rej) - qv, 0.0);
          }
        }
        const double s = block_sum(part, red);
        if (threadIdx.x == 0) inv[n_rej] = s > 0.0 ? 1.0 / s : 0.0;
        ++n_rej;
        __syncthreads();
      }
      ++k;
    }
    if (next >= 0) {
      c = next;
      ++depth;
      if (threadIdx.x == 0) {
        accept_nodes[b * N + depth] = c;
        emitted[b * N + depth - 1] = kChain ? ld_index(ch.drafts, ch.d64, start + c - 1) : tokens[b * N + c];
      }
      continue;
    }
    if (threadIdx.x == 0) {
      wi[0] = row;
      wi[1] = greedy;
      wi[2] = amax;
      wi[3] = has_q ? n_rej : n_R;
      wi[4] = 0;  // race key
      wi[5] = depth;
      wi[6] = qrow_i;
      wi[7] = prow;
      wi[8] = sampler_bonus;
      wd[0] = m;
      wd[1] = invT;
      wd[2] = Z;
      for (int i = 0; i < n_rej; ++i) wd[kWsD + i] = inv[i];
      accept_len[b] = depth;
      for (int i = depth + 1; i < N; ++i) {
        accept_nodes[b * N + i] = -1;
        emitted[b * N + i] = -1;
      }
    }
    break;
  }
}


// ---- 3. race ---------------------------------------------------------------------------------------
// grid: (B, G); each block scans one chunk of its request's final row. q as walk read it: draft_probs [B * N, V]
// (no d2t; q_by_row: the final row's) or the scratch rows qt [B, V] (with d2t: request b's), row stride ldq;
// nullptr without draft_probs.
template <typename scalar_t, typename q_t>
__global__ void __launch_bounds__(kThreads) race_kernel(const scalar_t* __restrict__ logits, int64_t ld, int64_t V,
                                                        int N, const int64_t* __restrict__ seed,
                                                        const int64_t* __restrict__ offset, const q_t* __restrict__ q,
                                                        int64_t ldq, bool q_by_row, int64_t* __restrict__ ws_i,
                                                        const double* __restrict__ ws_d) {
  const int64_t b = blockIdx.x;
  int64_t* wi = ws_i + b * (kWsI + N);
  const double* wd = ws_d + b * (kWsD + N);
  if (wi[1] || wi[8]) return;  // greedy: the bonus is the argmax; or the sampler's bonus is taken
  const int64_t row = wi[0];
  const int n = static_cast<int>(wi[3]);
  const float m = static_cast<float>(wd[0]), c = static_cast<float>(wd[1]);
  const double Z = wd[2];
  const uint64_t sd = static_cast<uint64_t>(seed[b]), off = offset != nullptr ? static_cast<uint64_t>(offset[b]) : 0;
  const uint32_t row_stream = static_cast<uint32_t>(row) | 0x80000000u;
  const scalar_t* x = logits + wi[7] * ld;
  // q_by_row: the final row's draft_probs row (wi[6]; -1: q = 0 there, vLLM's bonus row); else the scratch row
  const q_t* qrow = q == nullptr ? nullptr : q_by_row ? (wi[6] >= 0 ? q + wi[6] * ldq : nullptr) : q + b * ldq;
  const bool use_q = q != nullptr;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * kChunk, end = min(V, begin + kChunk);
  float best = -INFINITY;
  int64_t best_v = -1;
  for (int64_t v = begin + threadIdx.x; v < end; v += kThreads) {
    const float z = (to_f(x[v]) - m) * c;  // log(p(v) * Z)
    float score;
    if (!use_q) {
      if (best_v >= 0 && z + kMaxNegLogE < best) continue;  // cannot beat this thread's best
      bool excluded = false;
      for (int i = 0; i < n; ++i) excluded |= wi[kWsI + i] == v;
      if (excluded) continue;
      const float u = philox_uniform(static_cast<uint32_t>(v), row_stream, off, sd);
      score = z - logf(-logf(u));
    } else {
      const double pv = residual_prob(static_cast<double>(exp2f(z * kLog2e)) / Z, qrow ? to_f(qrow[v]) : 0.0, wd + kWsD, n);
      if (!(pv > 0.0)) continue;
      const float lp = static_cast<float>(log(pv));
      if (best_v >= 0 && lp + kMaxNegLogE < best) continue;
      const float u = philox_uniform(static_cast<uint32_t>(v), row_stream, off, sd);
      score = lp - logf(-logf(u));
    }
    if (best_v < 0 || score > best) {  // increasing v per thread: a tie keeps the smaller id
      best = score;
      best_v = v;
    }
  }
  unsigned long long key = best_v < 0 ? 0ull
                                      : (static_cast<unsigned long long>(ordered(best)) << 32) |
                                            (0xFFFFFFFFull - static_cast<unsigned long long>(best_v));
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
    key = other > key ? other : key;
  }
  if ((threadIdx.x & 31) == 0 && key != 0) atomicMax(reinterpret_cast<unsigned long long*>(wi + 4), key);
}

// ---- 4. finish -------------------------------------------------------------------------------------
// out (chain): vLLM's sampled_token_ids [B, N] int32, the emitted row converted (with the sampler's bonus where
// wi[8] says so); nullptr: the native op. d2t [Vd] (nullptr: none): the walk's smallest bad index (wi[9]) is
// reported here, with d2t's entry re-read.
__global__ void finish_kernel(int B, int N, int64_t V, const int64_t* __restrict__ ws_i, int64_t* __restrict__ emitted,
                              Chain ch = Chain{}, int32_t* __restrict__ out = nullptr,
                              const int64_t* __restrict__ d2t = nullptr, int64_t* __restrict__ err = nullptr) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const int64_t* wi = ws_i + static_cast<int64_t>(b) * (kWsI + N);
  if constexpr (kDeviceChecks) {
    if (d2t != nullptr && wi[9] != kNoBadD2t) {
      const int64_t d = wi[9];
      report_range(err, kOpVerifySampling, kArgD2t, d2t[d], -d, V - 1 - d, d);
    }
  }
  const uint64_t key = static_cast<uint64_t>(wi[4]);
  int64_t bonus = (wi[1] || key == 0) ? wi[2] : static_cast<int64_t>(0xFFFFFFFFull - (key & 0xFFFFFFFFull));
  bonus = bonus < 0 ? 0 : (bonus >= V ? V - 1 : bonus);  // NaN rows: still a token id
  if (wi[8]) bonus = ld_index(ch.bonus_tokens, ch.bt64, b);
  int64_t* e = emitted + static_cast<int64_t>(b) * N;
  e[wi[5]] = bonus;
  if (out != nullptr) {
    for (int i = 0; i < N; ++i) out[static_cast<int64_t>(b) * N + i] = static_cast<int32_t>(e[i]);
  }
}

void check_floats(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf || st == at::kDouble, name,
                   " must have dtype bfloat16 | float16 | float32 | float64, got ", st);
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " must be on the same device as logits (",
                    like.device(), "), got ", t.device());
}

// The four launches: the native op (ch.enabled false; tokens [B, N], parents [B, N], offset [B]) or vLLM's layout
// (ch.enabled; tokens, parents nullptr, offset nullptr = 0; out [B, N] int32 receives sampled_token_ids).
// Arguments checked by the callers.
std::tuple<at::Tensor, at::Tensor, at::Tensor> run(const at::Tensor& logits, const std::optional<at::Tensor>& draft_probs,
                                                   const std::optional<at::Tensor>& d2t, const int64_t* tokens,
                                                   const int32_t* parents, const at::Tensor& temperature,
                                                   const at::Tensor& seed, const int64_t* offset, int64_t B, int64_t N,
                                                   int64_t V, int64_t Vd, const Chain& ch, int32_t* out) {
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int device = logits.get_device();
  int64_t* err = device_error_word(device);
  const auto i64 = logits.options().dtype(at::kLong);
  const auto i32 = logits.options().dtype(at::kInt);
  at::Tensor accept_nodes = at::empty({B, N}, i32);
  at::Tensor accept_len = at::empty({B}, i32);
  at::Tensor emitted = at::empty({B, N}, i64);
  if (B == 0) return {accept_nodes, accept_len, emitted};
  const int G = static_cast<int>((V + kChunk - 1) / kChunk);
  at::Tensor part = at::empty({3, B * N, G}, i32);  // max (f32 bits), argmax, sum (f32 bits)
  at::Tensor ws_i = at::empty({B, kWsI + N}, i64);
  at::Tensor ws_d = at::empty({B, kWsD + N}, logits.options().dtype(at::kDouble));
  at::Tensor qt;
  if (draft_probs && d2t) qt = at::empty({B, V}, logits.options().dtype(at::kFloat));  // q through d2t
  float* part_m = reinterpret_cast<float*>(part[0].data_ptr<int32_t>());
  int32_t* part_a = part[1].data_ptr<int32_t>();
  float* part_s = reinterpret_cast<float*>(part[2].data_ptr<int32_t>());
  const int64_t ld = logits.stride(0);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "verify_sampling", [&] {
    using logit_t = scalar_t;
    const logit_t* lg = logits.data_ptr<logit_t>();
    row_stats_kernel<logit_t><<<dim3(static_cast<unsigned>(B * N), G), kThreads, 0, stream>>>(
        lg, ld, V, static_cast<int>(N), temperature.data_ptr<float>(), part_m, part_a, part_s, ch, err, parents);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const at::ScalarType prob_type = draft_probs ? draft_probs->scalar_type() : at::kFloat;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, prob_type, "verify_sampling_q", [&] {
      const scalar_t* dp = draft_probs ? draft_probs->data_ptr<scalar_t>() : nullptr;
      const size_t smem = static_cast<size_t>(N) * sizeof(double);
      auto walk = [&](auto kernel) {
        if (smem > 48 * 1024) {  // not a stream operation: safe while capturing
          const cudaError_t e =
              cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
          if (e != cudaSuccess) {
            (void)cudaGetLastError();  // clear it: the refusal below is the error
            TORCH_CHECK_VALUE(false, ch.enabled ? "max_spec_len + 1 = " : "tokens has N = ", N,
                              " nodes: the walk needs ", smem, " bytes of shared memory, more than this GPU gives a ",
                              "block (", cudaGetErrorString(e), ")");
          }
        }
        kernel<<<static_cast<unsigned>(B), kThreads, smem, stream>>>(
            lg, ld, V, dp, draft_probs ? draft_probs->stride(0) : 0, Vd, d2t ? d2t->data_ptr<int64_t>() : nullptr,
            tokens, parents, static_cast<int>(N), temperature.data_ptr<float>(),
            seed.data_ptr<int64_t>(), offset, part_m, part_a, part_s, G,
            qt.defined() ? qt.data_ptr<float>() : nullptr, ws_i.data_ptr<int64_t>(), ws_d.data_ptr<double>(),
            accept_nodes.data_ptr<int32_t>(), accept_len.data_ptr<int32_t>(), emitted.data_ptr<int64_t>(), err, ch);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (ch.enabled) {
        walk(walk_kernel<logit_t, scalar_t, true>);
      } else {
        walk(walk_kernel<logit_t, scalar_t, false>);
      }
      const dim3 race_grid(static_cast<unsigned>(B), G);
      if (draft_probs && !d2t) {  // q in place: the final row of draft_probs
        race_kernel<logit_t, scalar_t><<<race_grid, kThreads, 0, stream>>>(
            lg, ld, V, static_cast<int>(N), seed.data_ptr<int64_t>(), offset, dp,
            draft_probs->stride(0), true, ws_i.data_ptr<int64_t>(), ws_d.data_ptr<double>());
      } else {  // the scratch rows (d2t), or one-hot q
        race_kernel<logit_t, float><<<race_grid, kThreads, 0, stream>>>(
            lg, ld, V, static_cast<int>(N), seed.data_ptr<int64_t>(), offset,
            qt.defined() ? qt.data_ptr<float>() : nullptr, V, false, ws_i.data_ptr<int64_t>(), ws_d.data_ptr<double>());
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  finish_kernel<<<static_cast<unsigned>((B + 127) / 128), 128, 0, stream>>>(
      static_cast<int>(B), static_cast<int>(N), V, ws_i.data_ptr<int64_t>(), emitted.data_ptr<int64_t>(), ch, out,
      d2t ? d2t->data_ptr<int64_t>() : nullptr, err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  after_launch(device, stream);
  return {accept_nodes, accept_len, emitted};
}

// logits [B * N, V] (last dim contiguous), draft_probs [B * N, Vd] optional, d2t [Vd] int64 optional,
// tokens [B, N] int64, parents [B, N] int32, temperature [B] f32, seed [B] i64, offset [B] i64
// Host checks mirror eagle3_ops._validate.verify_sampling.
std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_sampling_cuda(
    const at::Tensor& logits, const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& d2t,
    const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& temperature, const at::Tensor& seed,
    const at::Tensor& offset) {
  CHECK_CUDA(logits);
  check_floats(logits, "logits");
  CHECK_DIM(logits, 2);
  TORCH_CHECK_VALUE(logits.size(1) <= 1 || logits.stride(1) == 1,
                    "logits must be contiguous in its last dimension, got strides ", logits.strides());
  CHECK_DTYPE(tokens, at::kLong);
  CHECK_DIM(tokens, 2);
  check_same_device(tokens, "tokens", logits);
  TORCH_CHECK_VALUE(tokens.is_contiguous(), "tokens must be contiguous");
  const int64_t B = tokens.size(0), N = tokens.size(1);
  TORCH_CHECK_VALUE(N >= 1, "tokens must have N >= 1 nodes (node 0 is the root)");
  CHECK_DTYPE(parents, at::kInt);
  CHECK_SHAPE(parents, B, N);
  check_same_device(parents, "parents", logits);
  TORCH_CHECK_VALUE(parents.is_contiguous(), "parents must be contiguous");
  const int64_t V = logits.size(1);
  TORCH_CHECK_VALUE(logits.size(0) == B * N, "logits must have shape (B * N, V) = (", B * N, ", ", V,
                    "), got ", logits.sizes());
  TORCH_CHECK_VALUE(V >= 1 && V < (int64_t{1} << 31), "logits must have 1 <= V < 2**31, got V = ", V);
  TORCH_CHECK_VALUE(B * N < (int64_t{1} << 31), "B * N must be < 2**31 (a Philox row), got ", B * N);
  TORCH_CHECK_VALUE(N <= kMaxNodes, "tokens must have N <= ", kMaxNodes,
                    " nodes on CUDA (the walk keeps the tree in shared memory), got ", N);
  int64_t Vd = V;
  if (draft_probs) {
    const at::Tensor& dp = *draft_probs;
    check_floats(dp, "draft_probs");
    check_same_device(dp, "draft_probs", logits);
    CHECK_DIM(dp, 2);
    Vd = dp.size(1);
    TORCH_CHECK_VALUE(dp.size(0) == B * N, "draft_probs must have shape (B * N, Vd) = (", B * N, ", ", Vd, "), got ",
                      dp.sizes());
    TORCH_CHECK_VALUE(Vd <= 1 || dp.stride(1) == 1, "draft_probs must be contiguous in its last dimension, got strides ",
                      dp.strides());
  }
  if (d2t) {
    TORCH_CHECK_VALUE(draft_probs.has_value(),
                      "d2t maps draft_probs' vocabulary to the target's: pass draft_probs too, or d2t=None");
    const at::Tensor& map = *d2t;
    CHECK_DTYPE(map, at::kLong);
    TORCH_CHECK_VALUE(map.dim() == 1 && map.size(0) == Vd, "d2t must have shape (Vd) = (", Vd, "), got ", map.sizes());
    check_same_device(map, "d2t", logits);
    TORCH_CHECK_VALUE(map.is_contiguous(), "d2t must be contiguous");
  } else {
    TORCH_CHECK_VALUE(Vd == V, "draft_probs has Vd = ", Vd, " != V = ", V,
                      ": pass d2t [Vd] int64 (target = draft + d2t[draft])");
  }
  CHECK_DTYPE(temperature, at::kFloat);
  CHECK_SHAPE(temperature, B);
  CHECK_DTYPE(seed, at::kLong);
  CHECK_SHAPE(seed, B);
  CHECK_DTYPE(offset, at::kLong);
  CHECK_SHAPE(offset, B);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{temperature, "temperature"}, {seed, "seed"},
                                {offset, "offset"}}) {
    check_same_device(t, name, logits);
    TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  }

  return run(logits, draft_probs, d2t, tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(), temperature, seed,
             offset.data_ptr<int64_t>(), B, N, V, Vd, Chain{}, nullptr);
}


// vLLM v1 RejectionSampler's step with random requests on its own tensors (eagle3_ops.compat.vllm, the CUDA path):
// logits                 [R, V] bf16 | fp16 | fp32 | fp64, last dim contiguous
// draft_probs            [num_tokens, V] bf16 | fp16 | fp32 | fp64, optional (None: drafts proposed with q = 1)
// draft_token_ids        [num_tokens] int32 | int64
// cu_num_draft_tokens    [batch_size] int32 | int64
// target_logits_indices  [num_tokens] int32 | int64
// bonus_logits_indices   [batch_size] int32 | int64, or [0] with bonus_token_ids
// bonus_token_ids        [batch_size] or [batch_size, 1] int32 | int64, optional: the sampler's bonus tokens
// temperature            [batch_size] fp32 (0 or -1: greedy)
// seed                   [batch_size] int64: Philox keys (offset 0)
// returns sampled_token_ids [batch_size, max_spec_len + 1] int32
at::Tensor vllm_rejection_sampling_cuda(const at::Tensor& logits, const std::optional<at::Tensor>& draft_probs,
                                        const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
                                        const at::Tensor& target_logits_indices, const at::Tensor& bonus_logits_indices,
                                        const std::optional<at::Tensor>& bonus_token_ids, const at::Tensor& temperature,
                                        const at::Tensor& seed, int64_t batch_size, int64_t num_tokens,
                                        int64_t max_spec_len) {
  const int64_t B = batch_size, T = num_tokens, K = max_spec_len, N = K + 1;
  const int64_t nb = vllm::layout(logits, draft_token_ids, cu_num_draft_tokens, target_logits_indices,
                                  bonus_logits_indices, bonus_token_ids, B, T, K);
  const int64_t V = logits.size(1);
  TORCH_CHECK_VALUE(T + nb == 0 || logits.size(0) >= 1, "logits must have at least one row");
  TORCH_CHECK_VALUE(B * N < (int64_t{1} << 31), "batch_size * (max_spec_len + 1) must be < 2**31, got ", B * N);
  if (draft_probs) {
    const at::Tensor& dp = *draft_probs;
    vllm::float_dtype(dp, "draft_probs");
    if (dp.dim() != 2 || dp.size(0) != T || dp.size(1) != V) {
      TORCH_CHECK_VALUE(false, "draft_probs must have shape (num_tokens, vocab_size) = (", T, ", ", V, "), got ",
                        vllm::py_shape(dp));
    }
    vllm::same_device(dp, "draft_probs", logits);
    if (V > 1 && dp.stride(1) != 1) {
      TORCH_CHECK_VALUE(false, "draft_probs must be contiguous in its last dimension, got strides ", dp.strides());
    }
  }
  if (temperature.scalar_type() != at::kFloat) {
    TORCH_CHECK_TYPE(false, "sampling_metadata.temperature must have dtype float32, got ",
                     vllm::dtype_name(temperature.scalar_type()));
  }
  vllm::shape1(temperature, "sampling_metadata.temperature", "batch_size", B);
  vllm::same_device(temperature, "sampling_metadata.temperature", logits);
  vllm::contiguous(temperature, "sampling_metadata.temperature");
  CHECK_DTYPE(seed, at::kLong);
  CHECK_SHAPE(seed, B);
  vllm::same_device(seed, "seed", logits);
  vllm::contiguous(seed, "seed");

  Chain ch;
  ch.enabled = true;
  ch.drafts = draft_token_ids.data_ptr();
  ch.d64 = draft_token_ids.scalar_type() == at::kLong;
  ch.cu = cu_num_draft_tokens.data_ptr();
  ch.cu64 = cu_num_draft_tokens.scalar_type() == at::kLong;
  ch.target = target_logits_indices.data_ptr();
  ch.t64 = target_logits_indices.scalar_type() == at::kLong;
  ch.bonus = nb > 0 ? bonus_logits_indices.data_ptr() : nullptr;
  ch.b64 = bonus_logits_indices.scalar_type() == at::kLong;
  ch.bonus_tokens = bonus_token_ids ? bonus_token_ids->data_ptr() : nullptr;
  ch.bt64 = bonus_token_ids && bonus_token_ids->scalar_type() == at::kLong;
  ch.T = T;
  ch.R = logits.size(0);
  ch.B = static_cast<int>(B);
  ch.K = static_cast<int>(K);
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  at::Tensor out = at::empty({B, N}, logits.options().dtype(at::kInt));
  run(logits, draft_probs, std::nullopt, nullptr, nullptr, temperature, seed, nullptr, B, N, V, V, ch,
      out.data_ptr<int32_t>());
  return out;
}

}  // namespace
}  // namespace eagle3

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) {
  m.impl("verify_sampling", &eagle3::verify_sampling_cuda);
  m.impl("_vllm_rejection_sampling", &eagle3::vllm_rejection_sampling_cuda);
}
