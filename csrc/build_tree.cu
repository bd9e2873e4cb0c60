// build_tree: the draft steps' top-k candidates -> canonical tree (tokens, parents), positions, tree_mask.
//
// One block per request, one launch, everything in shared memory (reference.build_tree is the spec):
//   1. effective score of every candidate, eff(d, m) = min(score(d, m), eff(d - 1, parent)), by walking
//      each candidate's parent chain (at most S - 1 steps; no barrier between depths);
//   2. a 64-bit sort key per candidate, (eff descending, flat index d * M + m ascending): one unsigned
//      compare orders two candidates exactly as the reference's stable sort on -eff does;
//   3. rank = number of smaller keys (all-pairs count over shared memory: S * M is a few hundred, and
//      the count needs no sort network and no extra barrier); ranks 0 .. N - 2 become nodes 1 .. N - 1;
//   4. every node's parent node through node_of[parent candidate]; then per (node, mask word) a walk up
//      the ancestors sets that word's bits and counts the depth.
// The selection is closed under ancestry (a parent's eff is >= its child's and its depth smaller), so
// every parent is a node with a smaller index: the result is a canonical tree.
//
// Bad values are recorded in the device error word (eagle3/errors.h; the CPU reference raises the same
// message) and made harmless: a NaN score ranks as -inf (so, through the cap, does every descendant; ties
// to the lower flat index); a depth-0 parent other than -1 is ignored (depth-0 candidates are the root's
// children); a parent outside [0, M) at depth >= 1 is read as the root (the candidate joins the root's
// children at depth 1 and its chain stops there). Tokens and prefix lengths are only copied (positions =
// prefix + depth), never used as an index, so no value of theirs is invalid here. No index read from the
// inputs is ever used unchecked, so nothing is read or written out of bounds.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "eagle3/checks.h"
#include "eagle3/errors.cuh"
#include "eagle3/errors.h"

namespace eagle3 {
namespace {

constexpr int kMaxThreads = 512;

__device__ __forceinline__ float score_to_float(float x) { return x; }
__device__ __forceinline__ float score_to_float(at::BFloat16 x) { return static_cast<float>(x); }
__device__ __forceinline__ float score_to_float(at::Half x) { return static_cast<float>(x); }

// NaN -> -inf; -0 -> +0 (they compare equal, so they must map to one key).
__device__ __forceinline__ float clean(float x) { return x != x ? -INFINITY : (x == 0.0f ? 0.0f : x); }

// Unsigned key increasing with the float (total order, -inf smallest), then flipped: larger scores
// give smaller keys. The low 32 bits hold the flat candidate index, so ties go to the smaller index.
__device__ __forceinline__ uint64_t sort_key(float eff, uint32_t flat) {
  uint32_t u = __float_as_uint(eff);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(~u) << 32) | flat;
}

// The error path of candidate f = d * M + m of request b (its score NaN, or its parent outside the range of
// its depth): each violation reported as the CPU reference words it.
template <typename score_t, typename par_t>
__device__ __noinline__ void report_candidate(int64_t* err, const score_t* sc, const par_t* pa, int64_t b, int f,
                                              int M) {
  const int d = f / M, m = f - d * M;
  const float raw = score_to_float(sc[f]);
  if (raw != raw) report_float(err, kOpBuildTree, kArgDraftScores, kKindNaN, raw, b, d, m);
  const int64_t p = static_cast<int64_t>(pa[f]), lo = d == 0 ? -1 : 0, hi = d == 0 ? -1 : M - 1;
  if (p < lo || p > hi) report_range(err, kOpBuildTree, kArgDraftParents, p, lo, hi, b, d, m);
}

// root_tokens   [B]        int64
// draft_tokens  [B, S, M]  int64
// draft_scores  [B, S, M]  fp32 | bf16 | fp16
// draft_parents [B, S, M]  int32 | int64
// prefix_lens   [B]        int32
// tokens [B, N] int64, parents [B, N] int32, positions [B, N] int64, tree_mask [B, N, W] int32
// err: the device error word
// grid: B blocks; dynamic shared memory: C keys (u64), C node_of (i32), N parents (i32), C = S * M
template <typename score_t, typename par_t>
__global__ void __launch_bounds__(kMaxThreads) build_tree_kernel(
    const int64_t* __restrict__ root_tokens, const int64_t* __restrict__ draft_tokens,
    const score_t* __restrict__ draft_scores, const par_t* __restrict__ draft_parents,
    const int32_t* __restrict__ prefix_lens, int64_t* __restrict__ tokens, int32_t* __restrict__ parents,
    int64_t* __restrict__ positions, int32_t* __restrict__ tree_mask, int S, int M, int N, int W,
    int64_t* __restrict__ err) {
  extern __shared__ uint64_t smem[];
  const int C = S * M;
  uint64_t* key = smem;                                      // [C]
  int32_t* node_of = reinterpret_cast<int32_t*>(key + C);    // [C]: node index, or -1
  int32_t* node_parent = node_of + C;                        // [N]
  const int64_t b = blockIdx.x;
  const score_t* sc = draft_scores + b * C;
  const par_t* pa = draft_parents + b * C;

  // 1 + 2: effective scores and keys. The walk reads each candidate's own parent first (the check needs it
  // too); the check is one predicate, and the report (which of the two, and what) is made off the hot path
  // after the key is stored, re-reading the candidate (report_candidate).
  for (int f = threadIdx.x; f < C; f += blockDim.x) {
    int d = f / M, m = f - d * M;
    const float raw = score_to_float(sc[f]);
    // (read at depth 0 too: a build that read it so ran 6.0 us where one that skipped it ran 6.5, topk 8 depth 6
    // on the H200, though the former also checked)
    int64_t p = static_cast<int64_t>(pa[f]);
    // a NaN score, or a parent outside [-1, -1] at depth 0 / [0, M) at depth >= 1 (one unsigned compare each)
    const bool bad = kDeviceChecks && (raw != raw || (d == 0 ? p != -1 : static_cast<uint64_t>(p) >= uint64_t(M)));
    float e = clean(raw);
    while (d > 0) {
      if (p < 0 || p >= M) break;  // out of range: read as the root
      --d;
      m = static_cast<int>(p);
      e = fminf(e, clean(score_to_float(sc[d * M + m])));
      if (d > 0) p = static_cast<int64_t>(pa[d * M + m]);
    }
    key[f] = sort_key(e, static_cast<uint32_t>(f));
    if (EAGLE3_UNLIKELY(bad)) report_candidate(err, sc, pa, b, f, M);
  }
  __syncthreads();

  // 3: rank by counting smaller keys; only the first N - 1 ranks become nodes
  for (int f = threadIdx.x; f < C; f += blockDim.x) {
    const uint64_t mine = key[f];
    int rank = 0;
    for (int g = 0; g < C; ++g) rank += key[g] < mine;
    node_of[f] = rank < N - 1 ? rank + 1 : -1;
  }
  __syncthreads();

  // 4a: tokens and parents of the selected candidates
  if (threadIdx.x == 0) {
    node_parent[0] = -1;
    tokens[b * N] = root_tokens[b];
  }
  for (int f = threadIdx.x; f < C; f += blockDim.x) {
    const int n = node_of[f];
    if (n < 1) continue;
    const int d = f / M;
    int parent = 0;
    if (d > 0) {
      const int64_t p = static_cast<int64_t>(pa[f]);
      if (p >= 0 && p < M) {
        const int pn = node_of[(d - 1) * M + static_cast<int>(p)];
        parent = (pn >= 1 && pn < n) ? pn : 0;  // always true for a selection closed under ancestry
      }
    }
    node_parent[n] = parent;
    tokens[b * N + n] = draft_tokens[b * C + f];
  }
  __syncthreads();

  // 4b: per (node, word): mask bits of that word, and the depth (word 0 writes parents and positions)
  const int64_t prefix = prefix_lens[b];
  for (int t = threadIdx.x; t < N * W; t += blockDim.x) {
    const int i = t / W, w = t - i * W;
    uint32_t bits = 0;
    int depth = -1;
    for (int j = i; j >= 0 && depth < N; j = node_parent[j]) {
      if ((j >> 5) == w) bits |= 1u << (j & 31);
      ++depth;
    }
    tree_mask[(b * N + i) * W + w] = static_cast<int32_t>(bits);
    if (w == 0) {
      parents[b * N + i] = node_parent[i];
      positions[b * N + i] = prefix + depth;
    }
  }
}

void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides(), " for shape ", t.sizes());
}

// Host checks mirror eagle3_ops._validate.build_tree (same error types, arguments named).
void build_tree_cuda(const at::Tensor& root_tokens, const at::Tensor& draft_tokens, const at::Tensor& draft_scores,
                     const at::Tensor& draft_parents, const at::Tensor& prefix_lens, const at::Tensor& tokens,
                     const at::Tensor& parents, const at::Tensor& positions, const at::Tensor& tree_mask) {
  CHECK_CUDA(root_tokens);
  CHECK_DTYPE(root_tokens, at::kLong);
  CHECK_DIM(root_tokens, 1);
  check_contiguous(root_tokens, "root_tokens");
  const int64_t B = root_tokens.size(0);
  CHECK_DTYPE(draft_tokens, at::kLong);
  CHECK_DIM(draft_tokens, 3);
  const int64_t S = draft_tokens.size(1), M = draft_tokens.size(2);
  CHECK_SHAPE(draft_tokens, B, S, M);
  TORCH_CHECK_TYPE(draft_scores.scalar_type() == at::kFloat || draft_scores.scalar_type() == at::kBFloat16 ||
                       draft_scores.scalar_type() == at::kHalf,
                   "draft_scores must have dtype float32 | bfloat16 | float16 on CUDA, got ", draft_scores.scalar_type());
  CHECK_SHAPE(draft_scores, B, S, M);
  TORCH_CHECK_TYPE(draft_parents.scalar_type() == at::kInt || draft_parents.scalar_type() == at::kLong,
                   "draft_parents must have dtype int32 | int64, got ", draft_parents.scalar_type());
  CHECK_SHAPE(draft_parents, B, S, M);
  CHECK_DTYPE(prefix_lens, at::kInt);
  CHECK_SHAPE(prefix_lens, B);
  CHECK_DTYPE(tokens, at::kLong);
  CHECK_DIM(tokens, 2);
  const int64_t N = tokens.size(1);
  CHECK_SHAPE(tokens, B, N);
  TORCH_CHECK_VALUE(N >= 1 && N <= 1 + S * M, "tokens must have N in [1, 1 + S * M] = [1, ", 1 + S * M,
                    "] nodes, got N = ", N);
  CHECK_DTYPE(parents, at::kInt);
  CHECK_SHAPE(parents, B, N);
  CHECK_DTYPE(positions, at::kLong);
  CHECK_SHAPE(positions, B, N);
  const int64_t W = (N + 31) / 32;
  CHECK_DTYPE(tree_mask, at::kInt);
  CHECK_SHAPE(tree_mask, B, N, W);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{draft_tokens, "draft_tokens"},
                                {draft_scores, "draft_scores"}, {draft_parents, "draft_parents"},
                                {prefix_lens, "prefix_lens"}, {tokens, "tokens"}, {parents, "parents"},
                                {positions, "positions"}, {tree_mask, "tree_mask"}}) {
    TORCH_CHECK_VALUE(t.device() == root_tokens.device(), name, " must be on the same device as root_tokens (",
                      root_tokens.device(), "), got ", t.device());
    check_contiguous(t, name);
  }
  const int64_t C = S * M;
  const size_t smem = static_cast<size_t>(C) * (sizeof(uint64_t) + sizeof(int32_t)) + N * sizeof(int32_t);
  const c10::cuda::OptionalCUDAGuard guard(root_tokens.device());
  int max_smem = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        root_tokens.device().index()));
  TORCH_CHECK_VALUE(smem <= static_cast<size_t>(max_smem), "draft_tokens has S * M = ", C,
                    " candidates per request; build_tree holds at most ", (max_smem - 4 * N) / 12,
                    " in shared memory on this GPU");
  if (B == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int device = root_tokens.get_device();
  int64_t* err = device_error_word(device);
  const int work = static_cast<int>(std::max<int64_t>(C, N * W));
  const int threads = std::min(kMaxThreads, std::max(32, (work + 31) / 32 * 32));

  auto go = [&](auto score_tag, auto par_tag) {
    using score_t = decltype(score_tag);
    using par_t = decltype(par_tag);
    auto kernel = build_tree_kernel<score_t, par_t>;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    kernel<<<static_cast<unsigned>(B), threads, smem, stream>>>(
        root_tokens.data_ptr<int64_t>(), draft_tokens.data_ptr<int64_t>(),
        reinterpret_cast<const score_t*>(draft_scores.data_ptr()), draft_parents.data_ptr<par_t>(),
        prefix_lens.data_ptr<int32_t>(), tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(),
        positions.data_ptr<int64_t>(), tree_mask.data_ptr<int32_t>(), static_cast<int>(S), static_cast<int>(M),
        static_cast<int>(N), static_cast<int>(W), err);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto by_parent = [&](auto score_tag) {
    if (draft_parents.scalar_type() == at::kInt) {
      go(score_tag, int32_t{});
    } else {
      go(score_tag, int64_t{});
    }
  };
  switch (draft_scores.scalar_type()) {
    case at::kFloat: by_parent(float{}); break;
    case at::kBFloat16: by_parent(at::BFloat16{}); break;
    default: by_parent(at::Half{}); break;
  }
  after_launch(device, stream);
}

}  // namespace
}  // namespace eagle3

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) { m.impl("build_tree", &eagle3::build_tree_cuda); }
