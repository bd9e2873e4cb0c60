// eagle3_ops.compat.sglang's tree walks on CUDA tensors, each as one op: verify_tree_greedy
// (torch.ops.eagle3._sglang_verify_greedy: one block per request) and tree_speculative_sampling_target_only
// (_sglang_verify_sampling: (request, 4096-column chunk) blocks, then one block per request for the bonus draw).
// What the compat ops share (the algorithms' source, the checks, no host sync) is said in eagle3/compat_sglang.h;
// the sampling's scratch is their one allocation (from the caching allocator).

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <optional>

#include "eagle3/compat_sglang.cuh"

namespace eagle3 {
namespace {

// ---- device helpers ------------------------------------------------------------------------------------------

// The sum over a block of kThreads threads, to every thread, added in warp order (one association every call).
template <typename T, int kThreads>
__device__ T block_sum(T v, T* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  T s = 0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kThreads / 32; ++w) s += scratch[w];  // in warp order: one association every call
    scratch[0] = s;
  }
  __syncthreads();
  s = scratch[0];
  __syncthreads();
  return s;
}

// ==== the walks: verify_tree_greedy and tree_speculative_sampling_target_only =================================

constexpr int kWalkThreads = 64;
constexpr int64_t kWalkMaxNodes = 1024;  // a request's lists staged in shared memory

// A request's lists in shared memory: links outside [0, N) read as -1 (they end a list either way), flat rows
// clamped to [0, B * N), the node's token.
struct Lists {
  int32_t* next;
  int32_t* sib;
  int64_t* tok;
  int64_t* rows;
};

__device__ __forceinline__ Lists stage_lists(void* smem, int N, int64_t b, int64_t rmax,
                                             const int64_t* __restrict__ candidates,
                                             const int64_t* __restrict__ r_index, const int64_t* __restrict__ r_next,
                                             const int64_t* __restrict__ r_sib) {
  Lists l;
  l.tok = static_cast<int64_t*>(smem);
  l.rows = l.tok + N;
  l.next = reinterpret_cast<int32_t*>(l.rows + N);
  l.sib = l.next + N;
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    const int64_t nx = r_next[b * N + i], sb = r_sib[b * N + i], r = r_index[b * N + i];
    l.next[i] = nx >= 0 && nx < N ? static_cast<int32_t>(nx) : -1;
    l.sib[i] = sb >= 0 && sb < N ? static_cast<int32_t>(sb) : -1;
    l.tok[i] = candidates[b * N + i];
    l.rows[i] = r < 0 ? 0 : (r > rmax ? rmax : r);
  }
  return l;
}

// predicts [>= B * N] int32; accept_index [B, S], accept_token_num [B] int32; candidates, r_index, r_next,
// r_sib, target [B, N] int64 (target read at the flat rows r_index, clamped to [0, B * N)).
// grid: B blocks of kWalkThreads; dynamic shared memory: the staged lists and the targets at their rows.
__global__ void __launch_bounds__(kWalkThreads) sglang_greedy_kernel(
    int32_t* __restrict__ predicts, int32_t* __restrict__ accept_index, int32_t* __restrict__ accept_token_num,
    const int64_t* __restrict__ candidates, const int64_t* __restrict__ r_index, const int64_t* __restrict__ r_next,
    const int64_t* __restrict__ r_sib, const int64_t* __restrict__ target, int N, int S) {
  extern __shared__ int64_t smem64[];
  const int64_t b = blockIdx.x;
  const int64_t rmax = static_cast<int64_t>(gridDim.x) * N - 1;
  const Lists l = stage_lists(smem64, N, b, rmax, candidates, r_index, r_next, r_sib);
  int64_t* tgt = smem64 + 3 * N;  // after tok, rows and the two int32 link arrays
  __syncthreads();
  for (int i = threadIdx.x; i < N; i += blockDim.x) tgt[i] = target[l.rows[i]];
  __syncthreads();
  if (threadIdx.x != 0) return;
  // SGLang's walk: at the last accepted node, its children in list order; the first whose token is the
  // target there is accepted, for at most S - 1 drafts
  int last = 0, L = 0;
  int64_t row = l.rows[0];
  accept_index[b * S] = static_cast<int32_t>(row);
  bool go = S > 1;
  while (go) {
    const int64_t want = tgt[last];
    int cur = l.next[last], found = -1;
    for (int steps = 0; cur >= 0 && steps < N; ++steps, cur = l.sib[cur]) {
      if (cur > last && l.tok[cur] == want) {
        found = cur;
        break;
      }
    }
    if (found >= 0) {
      predicts[row] = static_cast<int32_t>(want);
      last = found;
      row = l.rows[last];
      ++L;
      accept_index[b * S + L] = static_cast<int32_t>(row);
    }
    go = found >= 0 && L < S - 1;
  }
  accept_token_num[b] = L;
  predicts[row] = static_cast<int32_t>(tgt[last]);
}

void sglang_verify_greedy_cuda(const at::Tensor& predicts, const at::Tensor& accept_index,
                               const at::Tensor& accept_token_num, const at::Tensor& candidates,
                               const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                               const at::Tensor& retrive_next_sibling, const at::Tensor& target_predict) {
  const int64_t S = sglang::check_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                         retrive_next_token, retrive_next_sibling, target_predict);
  const int64_t B = candidates.size(0), N = candidates.size(1);
  if (B == 0) return;
  TORCH_CHECK_NOT_IMPLEMENTED(N <= kWalkMaxNodes && B * N < (int64_t{1} << 31) && S < (int64_t{1} << 31),
                              "compat_sglang walk: more than ", kWalkMaxNodes, " nodes per request");
  const c10::cuda::OptionalCUDAGuard guard(candidates.device());
  const cudaStream_t stream = sglang::current_stream(candidates);
  const size_t smem = static_cast<size_t>(N) * (3 * sizeof(int64_t) + 2 * sizeof(int32_t));
  sglang_greedy_kernel<<<static_cast<unsigned>(B), kWalkThreads, smem, stream>>>(
      predicts.data_ptr<int32_t>(), accept_index.data_ptr<int32_t>(), accept_token_num.data_ptr<int32_t>(),
      candidates.data_ptr<int64_t>(), retrive_index.data_ptr<int64_t>(), retrive_next_token.data_ptr<int64_t>(),
      retrive_next_sibling.data_ptr<int64_t>(), target_predict.data_ptr<int64_t>(), static_cast<int>(N),
      static_cast<int>(S));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  after_launch(candidates.get_device(), stream);
}

// ---- sampling ------------------------------------------------------------------------------------------------

constexpr int kSampleThreads = 256;
constexpr int kPerThread = 16;                          // consecutive columns per thread
constexpr int64_t kChunk = kSampleThreads * kPerThread;  // vocabulary columns per block

struct SampleState {  // what the walk leaves for the bonus draw, per request
  int64_t last;       // local index of the last accepted node
  int64_t row;        // its flat row (predicts' index)
  int64_t capped;     // S - 1 drafts accepted: the bonus comes from the target alone
};

// relu(target - draft) (the target alone when capped or without draft) at the last node's row, columns
// c0 .. c0 + 15 (0 past V), and 0 at the tokens of its children (all tried and rejected unless capped: SGLang
// set draft = target there). zero: those tokens (nzero of them; none when capped).
__device__ __forceinline__ void residual(const float* __restrict__ probs, const float* __restrict__ draft,
                                         int64_t rowoff, int64_t c0, int64_t V, bool vec, bool sub,
                                         const int64_t* zero, int nzero, float (&w)[kPerThread]) {
  float p[kPerThread], q[kPerThread];
  if (vec && c0 + kPerThread <= V) {
#pragma unroll
    for (int k = 0; k < kPerThread; k += 4) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(probs + rowoff + c0 + k));
      p[k] = a.x, p[k + 1] = a.y, p[k + 2] = a.z, p[k + 3] = a.w;
      if (sub) {
        const float4 d = *reinterpret_cast<const float4*>(draft + rowoff + c0 + k);
        q[k] = d.x, q[k + 1] = d.y, q[k + 2] = d.z, q[k + 3] = d.w;
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const bool in = c0 + k < V;
      p[k] = in ? probs[rowoff + c0 + k] : 0.0f;
      if (sub) q[k] = in ? draft[rowoff + c0 + k] : 0.0f;
    }
  }
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) w[k] = c0 + k < V ? fmaxf(sub ? p[k] - q[k] : p[k], 0.0f) : 0.0f;
  for (int z = 0; z < nzero; ++z) {
    const int64_t off = zero[z] - c0;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) w[k] = off == k ? 0.0f : w[k];
  }
}

// predicts, accept_index, accept_token_num, candidates, r_* as sglang_greedy_kernel's; uniform [B, N] fp32;
// probs [B * N, V] fp32 (row b * N + node); draft like probs or null; part [B, split] fp64; state [B].
// grid (B, split) blocks of kSampleThreads. Every block walks the request (block 0 writes the outputs, the
// rejected draft probabilities and the state), then sums its chunk of the residual at the last node.
// Dynamic shared memory: the staged lists, the coins, the targets of one row at every node's token.
__global__ void __launch_bounds__(kSampleThreads) sglang_sample_sum_kernel(
    int32_t* __restrict__ predicts, int32_t* __restrict__ accept_index, int32_t* __restrict__ accept_token_num,
    const int64_t* __restrict__ candidates, const int64_t* __restrict__ r_index, const int64_t* __restrict__ r_next,
    const int64_t* __restrict__ r_sib, const float* __restrict__ uniform, const float* __restrict__ probs,
    float* draft, double* __restrict__ part, SampleState* __restrict__ state, int N, int S, int64_t V, int split,
    float thr_single, float thr_acc, bool vec) {
  extern __shared__ int64_t smem64[];
  __shared__ double sum_scratch[kSampleThreads / 32];
  __shared__ int s_last, s_nzero;
  __shared__ bool s_capped;
  const int64_t b = blockIdx.x;
  const int s = blockIdx.y;
  const bool write = s == 0;
  const int64_t rmax = static_cast<int64_t>(gridDim.x) * N - 1;
  const Lists l = stage_lists(smem64, N, b, rmax, candidates, r_index, r_next, r_sib);
  int64_t* zero = smem64 + 3 * N;                       // [N] the last node's children's tokens
  float* coins = reinterpret_cast<float*>(zero + N);    // [N]
  float* p_all = coins + N;                             // [N] target at the current row, every node's token
  for (int i = threadIdx.x; i < N; i += blockDim.x) coins[i] = uniform[b * N + i];
  __syncthreads();
  if (threadIdx.x < 32) {  // the walk, in warp 0 (lane 0 follows the lists, the lanes load)
    const int lane = threadIdx.x;
    int last = 0, L = 0;
    int64_t row = l.rows[0];
    if (write && lane == 0) accept_index[b * S] = static_cast<int32_t>(row);
    bool go = S > 1;
    while (go) {
      const int64_t prow = (b * N + last) * V;
      for (int i = lane; i < N; i += 32) {
        const int64_t x = l.tok[i];
        p_all[i] = x >= 0 && x < V ? probs[prow + x] : 0.0f;
      }
      __syncwarp();
      int found = -1;
      if (lane == 0) {
        const float coin = coins[last];
        double acc = 0.0;  // summed in fp64 and rounded to fp32, as the tensor path's scan
        int cur = l.next[last];
        for (int steps = 0; cur >= 0 && steps < N; ++steps, cur = l.sib[cur]) {
          const float p = p_all[cur];
          acc += static_cast<double>(p);
          const bool ok = cur > last;
          if (ok && (coin <= static_cast<float>(acc) / thr_acc || p >= thr_single)) {
            found = cur;
            break;
          }
          const int64_t x = l.tok[cur];
          if (draft != nullptr && write && ok && x >= 0 && x < V) draft[prow + x] = p;  // tried and rejected
        }
      }
      found = __shfl_sync(0xffffffffu, found, 0);
      if (found >= 0) {
        if (write && lane == 0) predicts[row] = static_cast<int32_t>(l.tok[found]);
        last = found;
        row = l.rows[last];
        ++L;
        if (write && lane == 0) accept_index[b * S + L] = static_cast<int32_t>(row);
      }
      go = found >= 0 && L < S - 1;
      __syncwarp();  // p_all is reloaded next round
    }
    if (lane == 0) {
      const bool capped = L == S - 1;
      int nzero = 0;
      if (!capped) {
        int cur = l.next[last];
        for (int steps = 0; cur >= 0 && steps < N; ++steps, cur = l.sib[cur]) {
          if (cur > last) zero[nzero++] = l.tok[cur];
        }
      }
      s_last = last;
      s_capped = capped;
      s_nzero = nzero;
      if (write) {
        accept_token_num[b] = L;
        state[b] = SampleState{last, row, capped ? 1 : 0};
      }
    }
  }
  __syncthreads();
  float w[kPerThread];
  const int64_t c0 = s * kChunk + static_cast<int64_t>(threadIdx.x) * kPerThread;
  residual(probs, draft, (b * N + s_last) * V, c0, V, vec, draft != nullptr && !s_capped, zero, s_nzero, w);
  double sum = 0.0;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) sum += static_cast<double>(w[k]);
  sum = block_sum<double, kSampleThreads>(sum, sum_scratch);
  if (threadIdx.x == 0) part[b * split + s] = sum;
}

// The bonus draw: u = final[b] * total mass; the chunk where the running mass (fp64, each prefix rounded to
// fp32) first exceeds u, and in it the first column whose running mass does (a draw past the mass: V - 1;
// one the chunk's own sum does not reach, by rounding: its last column with mass). grid: B blocks.
__global__ void __launch_bounds__(kSampleThreads) sglang_sample_pick_kernel(
    int32_t* __restrict__ predicts, const int64_t* __restrict__ candidates, const int64_t* __restrict__ r_next,
    const int64_t* __restrict__ r_sib, const float* __restrict__ probs, const float* __restrict__ draft,
    const double* __restrict__ part, const SampleState* __restrict__ state, const float* __restrict__ final_u,
    int N, int64_t V, int split, bool vec) {
  extern __shared__ int64_t zero[];  // [N] the last node's children's tokens
  __shared__ int s_hit, s_nzero, s_first, s_lastpos;
  __shared__ double s_before;
  __shared__ float s_u;
  __shared__ double scan_scratch[kSampleThreads / 32];
  const int64_t b = blockIdx.x;
  const SampleState st = state[b];
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int k = 0; k < split; ++k) total += part[b * split + k];
    const float u = final_u[b] * static_cast<float>(total);
    double upto = 0.0, before = 0.0;
    int hit = split;
    for (int k = 0; k < split; ++k) {
      before = upto;
      upto += part[b * split + k];
      if (static_cast<float>(upto) > u) {
        hit = k;
        break;
      }
    }
    int nzero = 0;
    if (!st.capped) {
      int64_t cur = r_next[b * N + st.last];
      for (int steps = 0; cur >= 0 && cur < N && steps < N; ++steps, cur = r_sib[b * N + cur]) {
        if (cur > st.last) zero[nzero++] = candidates[b * N + cur];
      }
    }
    s_hit = hit, s_u = u, s_before = before, s_nzero = nzero;
    s_first = INT_MAX, s_lastpos = -1;
  }
  __syncthreads();
  const int hit = s_hit;
  if (hit == split) {
    if (threadIdx.x == 0) predicts[st.row] = static_cast<int32_t>(V - 1);
    return;
  }
  float w[kPerThread];
  const int64_t c0 = hit * kChunk + static_cast<int64_t>(threadIdx.x) * kPerThread;
  residual(probs, draft, (b * N + st.last) * V, c0, V, vec, draft != nullptr && !st.capped, zero, s_nzero, w);
  // this thread's exclusive running mass: the block's threads before it, in order
  double mine = 0.0;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) mine += static_cast<double>(w[k]);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const double x = sglang::warp_inclusive_sum(mine);
  if (lane == 31) scan_scratch[warp] = x;
  __syncthreads();
  double warp_before = 0.0;
  for (int k = 0; k < warp; ++k) warp_before += scan_scratch[k];
  double run = s_before + (warp_before + (x - mine));
  const float u = s_u;
  int first = INT_MAX, lastpos = -1;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    run += static_cast<double>(w[k]);
    const int64_t col = c0 + k;
    if (first == INT_MAX && col < V && static_cast<float>(run) > u) first = static_cast<int>(col);
    if (w[k] > 0.0f) lastpos = static_cast<int>(col);
  }
  if (first != INT_MAX) atomicMin(&s_first, first);
  if (lastpos >= 0) atomicMax(&s_lastpos, lastpos);
  __syncthreads();
  if (threadIdx.x == 0) {
    const int token = s_first != INT_MAX ? s_first : (s_lastpos >= 0 ? s_lastpos : 0);
    predicts[st.row] = token;
  }
}

void sglang_verify_sampling_cuda(const at::Tensor& predicts, const at::Tensor& accept_index,
                                 const at::Tensor& accept_token_num, const at::Tensor& candidates,
                                 const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                                 const at::Tensor& retrive_next_sibling, const at::Tensor& uniform_samples,
                                 const at::Tensor& uniform_samples_for_final_sampling, const at::Tensor& target_probs,
                                 const std::optional<at::Tensor>& draft_probs, double threshold_single,
                                 double threshold_acc) {
  const int64_t S = sglang::check_sampling(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                           retrive_next_token, retrive_next_sibling, uniform_samples,
                                           uniform_samples_for_final_sampling, target_probs, draft_probs);
  const int64_t B = candidates.size(0), N = candidates.size(1), V = target_probs.size(-1);
  if (B == 0) return;
  const int64_t split = (V + kChunk - 1) / kChunk;
  TORCH_CHECK_NOT_IMPLEMENTED(N <= kWalkMaxNodes && B * N < (int64_t{1} << 31) && S < (int64_t{1} << 31) &&
                                  split < 65536 && V < (int64_t{1} << 31),
                              "compat_sglang sampling: more than ", kWalkMaxNodes, " nodes per request, or V >= 2**31");
  const c10::cuda::OptionalCUDAGuard guard(candidates.device());
  const cudaStream_t stream = sglang::current_stream(candidates);
  // scratch: the chunks' masses (fp64) and each request's state
  static_assert(sizeof(SampleState) % sizeof(double) == 0, "state after the masses, 8-byte aligned");
  const int64_t words = B * split + B * static_cast<int64_t>(sizeof(SampleState) / sizeof(double));
  at::Tensor scratch = at::empty({words}, target_probs.options().dtype(at::kDouble));
  double* part = scratch.data_ptr<double>();
  auto* state = reinterpret_cast<SampleState*>(part + B * split);
  float* draft = draft_probs ? draft_probs->data_ptr<float>() : nullptr;
  const float* probs = target_probs.data_ptr<float>();
  const bool vec = V % 4 == 0 && reinterpret_cast<uintptr_t>(probs) % 16 == 0 &&
                   (draft == nullptr || reinterpret_cast<uintptr_t>(draft) % 16 == 0);
  const float thr_single = static_cast<float>(threshold_single);
  const float thr_acc = static_cast<float>(std::max(threshold_acc, 1e-9));
  // staged lists (3 int64 words a node), the children's tokens (int64), coins and one row's targets (fp32)
  const size_t smem = static_cast<size_t>(N) * (4 * sizeof(int64_t) + 2 * sizeof(float));
  sglang_sample_sum_kernel<<<dim3(static_cast<unsigned>(B), static_cast<unsigned>(split)), kSampleThreads, smem,
                             stream>>>(
      predicts.data_ptr<int32_t>(), accept_index.data_ptr<int32_t>(), accept_token_num.data_ptr<int32_t>(),
      candidates.data_ptr<int64_t>(), retrive_index.data_ptr<int64_t>(), retrive_next_token.data_ptr<int64_t>(),
      retrive_next_sibling.data_ptr<int64_t>(), uniform_samples.data_ptr<float>(), probs, draft, part, state,
      static_cast<int>(N), static_cast<int>(S), V, static_cast<int>(split), thr_single, thr_acc, vec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sglang_sample_pick_kernel<<<static_cast<unsigned>(B), kSampleThreads, static_cast<size_t>(N) * sizeof(int64_t),
                              stream>>>(
      predicts.data_ptr<int32_t>(), candidates.data_ptr<int64_t>(), retrive_next_token.data_ptr<int64_t>(),
      retrive_next_sibling.data_ptr<int64_t>(), probs, draft, part, state,
      uniform_samples_for_final_sampling.data_ptr<float>(), static_cast<int>(N), V, static_cast<int>(split), vec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  after_launch(candidates.get_device(), stream);
}

}  // namespace
}  // namespace eagle3

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) {
  m.impl("_sglang_verify_greedy", &eagle3::sglang_verify_greedy_cuda);
  m.impl("_sglang_verify_sampling", &eagle3::sglang_verify_sampling_cuda);
}
