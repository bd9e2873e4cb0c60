// eagle3_ops.compat.sglang on CUDA tensors: each of its five functions as ONE op with its checks in C++, so that
// an eager call (SGLang's EAGLE worker calls these outside its CUDA graphs) costs one dispatch and one or two
// launches instead of Python-side validation and Triton launches.
//
//   _sglang_build_tree          build_tree_kernel_efficient         one block per request (one warp when
//                                                                   N <= 32 and depth * M <= 256)
//   _sglang_verify_greedy       verify_tree_greedy                  one block per request
//   _sglang_verify_sampling     tree_speculative_sampling_target_only  (request, 4096-column chunk) blocks, then
//                                                                   one block per request for the bonus draw
//   _sglang_segment_packbits    segment_packbits                    one thread per output byte
//   _sglang_reconstruct_indices reconstruct_indices_from_tree_mask  one block per request
//
// The algorithms are triton_kernels/compat_sglang.py's (its docstring, and eagle3_ops/compat/sglang.py's, say
// what SGLang semantics they keep), and the specification is compat.sglang's tensor-op path: the integer
// outputs are the same bit for bit; the sampling bonus sums the residual in fp64 (in another association than
// the Triton kernel's, so a draw within an fp64 rounding step of a token boundary may go the other way).
//
// Host checks: the Python path's (eagle3_ops/compat/sglang.py: _t, _numel, _check_walk_args), in its order, with
// its exception types (TypeError for a dtype, ValueError otherwise) and its messages, shapes printed as Python
// tuples. Values are never validated on the host (no sync): on device a bad value is never used as an index
// (what each op skips is in compat.sglang's docstrings), and the build records a bad parent_list entry in the
// device error word as build_tree's draft_parents, as the Triton kernel does. Past the kernels' size limits
// (nodes / candidate slots held in shared memory) an op raises NotImplementedError after its checks, and the
// Python wrapper takes its Triton or tensor-op path.
//
// No host sync, no allocation but the sampling's scratch (from the caching allocator), the current stream of
// the inputs' device under a device guard: capturable in a CUDA graph.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>

#include "eagle3/errors.cuh"
#include "eagle3/errors.h"

namespace eagle3 {
namespace {

// ---- host checks, worded as eagle3_ops/_validate.tensor and compat.sglang's _numel ---------------------------

std::string py_tuple(c10::IntArrayRef v) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << (v.size() == 1 ? ",)" : ")");
  return s.str();
}

std::string py_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBool: return "bool";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kUInt16: return "uint16";
    case at::kUInt32: return "uint32";
    case at::kUInt64: return "uint64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    default: return c10::toString(t);
  }
}

struct Dim {
  const char* sym;
  int64_t size;
};

// One tensor argument: dtype, then shape (symbols and sizes) or rank, then the device of `like` (the Python
// path's "first argument"), then contiguity.
void check_arg(const at::Tensor& t, const char* name, std::initializer_list<at::ScalarType> dtypes,
               const char* dtype_names, const at::Tensor& like, std::initializer_list<Dim> shape = {}, int64_t dim = -1) {
  bool dtype_ok = false;
  for (at::ScalarType d : dtypes) dtype_ok = dtype_ok || t.scalar_type() == d;
  TORCH_CHECK_TYPE(dtype_ok, name, " must have dtype ", dtype_names, ", got ", py_dtype(t.scalar_type()));
  if (shape.size() > 0) {
    bool ok = t.dim() == static_cast<int64_t>(shape.size());
    int64_t i = 0;
    for (const Dim& d : shape) ok = ok && t.size(i++) == d.size;
    if (EAGLE3_UNLIKELY(!ok)) {  // the message is formatted only here: an eager call's checks cost compares
      std::ostringstream syms, vals;
      i = 0;
      for (const Dim& d : shape) {
        syms << (i ? ", " : "") << d.sym;
        vals << (i++ ? ", " : "") << d.size;
      }
      TORCH_CHECK_VALUE(false, name, " must have shape (", syms.str(), ") = (", vals.str(), "), got ",
                        py_tuple(t.sizes()));
    }
  } else if (dim >= 0) {
    TORCH_CHECK_VALUE(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", py_tuple(t.sizes()));
  }
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " must be on the same device as the first argument (",
                    like.device(), "), got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous, got strides ", py_tuple(t.strides()), " for shape ",
                    py_tuple(t.sizes()));
}

// compat.sglang._numel: n elements, and with `shapes` one of those shapes.
void check_numel(const at::Tensor& t, const char* name, int64_t n, const char* what,
                 std::initializer_list<std::initializer_list<int64_t>> shapes = {}) {
  bool ok = t.numel() == n;
  if (shapes.size() > 0) {
    bool any = false;
    for (const auto& s : shapes) any = any || t.sizes().equals(c10::IntArrayRef(s));
    ok = ok && any;
  }
  if (EAGLE3_UNLIKELY(!ok)) {
    std::ostringstream allowed;
    int k = 0;
    for (const auto& s : shapes) allowed << (k++ ? " or " : "") << py_tuple(c10::IntArrayRef(s));
    if (shapes.size() == 0) allowed << n << " elements";
    TORCH_CHECK_VALUE(false, name, " must have ", what, " = ", n, " elements (", allowed.str(), "), got shape ",
                      py_tuple(t.sizes()));
  }
}

// build_tree_kernel_efficient's checks. Returns the packed mask's bytes per row (0 for the bool modes).
int check_build(const at::Tensor& parent_list, const at::Tensor& selected_index, const at::Tensor& verified_seq_len,
                const at::Tensor& tree_mask, const at::Tensor& positions, const at::Tensor& retrive_index,
                const at::Tensor& retrive_next_token, const at::Tensor& retrive_next_sibling, int64_t topk,
                int64_t depth, int64_t draft_token_num, int64_t tree_mask_mode) {
  const int64_t N = draft_token_num, mode = tree_mask_mode;
  TORCH_CHECK_VALUE(mode >= 0 && mode <= 2, mode, " is not a valid TreeMaskMode");
  TORCH_CHECK_VALUE(topk >= 1 && depth >= 1, "topk and depth must be >= 1, got topk = ", topk, ", depth = ", depth);
  const int64_t C = topk + (depth - 1) * topk * topk;
  TORCH_CHECK_VALUE(N >= 1 && N <= C + 1, "draft_token_num must be in [1, topk + (depth - 1) * topk**2 + 1] = [1, ",
                    C + 1, "], got ", N);
  check_arg(parent_list, "parent_list", {at::kLong}, "int64", parent_list, {}, 2);
  const int64_t B = parent_list.size(0), P = parent_list.size(1);
  TORCH_CHECK_VALUE(P == topk * (depth - 1) + 1 || (depth == 1 && P == 0),
                    "parent_list must have shape (B, topk * (depth - 1) + 1) = (", B, ", ", topk * (depth - 1) + 1,
                    "), got ", py_tuple(parent_list.sizes()));
  check_arg(selected_index, "selected_index", {at::kLong}, "int64", parent_list, {{"B", B}, {"N - 1", N - 1}});
  check_arg(verified_seq_len, "verified_seq_len", {at::kLong, at::kInt}, "int64 | int32", parent_list, {{"B", B}});
  check_arg(positions, "positions", {at::kLong}, "int64", parent_list);
  check_numel(positions, "positions", B * N, "B * N", {{B * N}, {B, N}});
  check_arg(retrive_index, "retrive_index", {at::kLong}, "int64", parent_list, {{"B", B}, {"N", N}});
  check_arg(retrive_next_token, "retrive_next_token", {at::kLong}, "int64", parent_list, {{"B", B}, {"N", N}});
  check_arg(retrive_next_sibling, "retrive_next_sibling", {at::kLong}, "int64", parent_list, {{"B", B}, {"N", N}});
  int nb = 0;
  if (mode == 2) {
    TORCH_CHECK_VALUE(N <= 32, "QLEN_ONLY_BITPACKING holds at most 32 nodes (4 bytes per row), got N = ", N);
    nb = N <= 8 ? 1 : (N <= 16 ? 2 : 4);
    if (nb == 1) {
      check_arg(tree_mask, "tree_mask", {at::kByte}, "uint8", parent_list);
    } else if (nb == 2) {
      check_arg(tree_mask, "tree_mask", {at::kByte, at::kUInt16, at::kShort}, "uint8 | uint16 | int16", parent_list);
    } else {
      check_arg(tree_mask, "tree_mask", {at::kByte, at::kUInt32, at::kInt}, "uint8 | uint32 | int32", parent_list);
    }
    check_numel(tree_mask, "tree_mask", B * N * nb / static_cast<int64_t>(tree_mask.element_size()),
                nb == 1 ? "B * N * 1 bytes" : (nb == 2 ? "B * N * 2 bytes" : "B * N * 4 bytes"));
  } else {
    check_arg(tree_mask, "tree_mask", {at::kBool}, "bool", parent_list);
    if (mode == 1) check_numel(tree_mask, "tree_mask", B * N * N, "B * N * N");
  }
  return nb;
}

// compat.sglang._check_walk_args: returns S.
int64_t check_walk_args(const at::Tensor& predicts, const at::Tensor& accept_index, const at::Tensor& accept_token_num,
                        const at::Tensor& candidates, const at::Tensor& retrive_index,
                        const at::Tensor& retrive_next_token, const at::Tensor& retrive_next_sibling) {
  check_arg(candidates, "candidates", {at::kLong}, "int64", candidates, {}, 2);
  const int64_t B = candidates.size(0), N = candidates.size(1);
  check_arg(retrive_index, "retrive_index", {at::kLong}, "int64", candidates, {{"B", B}, {"N", N}});
  check_arg(retrive_next_token, "retrive_next_token", {at::kLong}, "int64", candidates, {{"B", B}, {"N", N}});
  check_arg(retrive_next_sibling, "retrive_next_sibling", {at::kLong}, "int64", candidates, {{"B", B}, {"N", N}});
  check_arg(predicts, "predicts", {at::kInt}, "int32", candidates, {}, 1);
  TORCH_CHECK_VALUE(predicts.size(0) >= B * N, "predicts must have at least B * N = ", B * N,
                    " entries (SGLang allocates B * N + 1), got ", py_tuple(predicts.sizes()));
  check_arg(accept_index, "accept_index", {at::kInt}, "int32", candidates, {}, 2);
  TORCH_CHECK_VALUE(accept_index.size(0) == B && accept_index.size(1) >= 1,
                    "accept_index must have shape (B, S) with B = ", B, ", S >= 1, got ", py_tuple(accept_index.sizes()));
  check_arg(accept_token_num, "accept_token_num", {at::kInt}, "int32", candidates, {{"B", B}});
  return accept_index.size(1);
}

// verify_tree_greedy's checks. Returns S.
int64_t check_greedy(const at::Tensor& predicts, const at::Tensor& accept_index, const at::Tensor& accept_token_num,
                     const at::Tensor& candidates, const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                     const at::Tensor& retrive_next_sibling, const at::Tensor& target_predict) {
  const int64_t S = check_walk_args(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                    retrive_next_token, retrive_next_sibling);
  const int64_t B = candidates.size(0), N = candidates.size(1);
  check_arg(target_predict, "target_predict", {at::kLong}, "int64", candidates, {{"B", B}, {"N", N}});
  return S;
}

// tree_speculative_sampling_target_only's checks. Returns S.
int64_t check_sampling(const at::Tensor& predicts, const at::Tensor& accept_index, const at::Tensor& accept_token_num,
                       const at::Tensor& candidates, const at::Tensor& retrive_index,
                       const at::Tensor& retrive_next_token, const at::Tensor& retrive_next_sibling,
                       const at::Tensor& uniform_samples, const at::Tensor& uniform_samples_for_final_sampling,
                       const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs) {
  const int64_t S = check_walk_args(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                    retrive_next_token, retrive_next_sibling);
  const int64_t B = candidates.size(0), N = candidates.size(1);
  check_arg(uniform_samples, "uniform_samples", {at::kFloat}, "float32", candidates, {{"B", B}, {"N", N}});
  check_arg(uniform_samples_for_final_sampling, "uniform_samples_for_final_sampling", {at::kFloat}, "float32",
            candidates, {{"B", B}});
  check_arg(target_probs, "target_probs", {at::kFloat}, "float32", candidates);
  const auto lead = target_probs.sizes().slice(0, std::max<int64_t>(target_probs.dim() - 1, 0));
  const bool three = target_probs.dim() == 3 && lead.equals({B, N});
  TORCH_CHECK_VALUE(three || (target_probs.dim() == 2 && lead.equals({B * N})),
                    "target_probs must have shape (B, N, V) or (B * N, V) with B = ", B, ", N = ", N, ", got ",
                    py_tuple(target_probs.sizes()));
  const int64_t V = target_probs.size(-1);
  TORCH_CHECK_VALUE(V >= 1, "target_probs must have V >= 1");
  if (draft_probs) {
    if (three) {
      check_arg(*draft_probs, "draft_probs", {at::kFloat}, "float32", candidates, {{"B", B}, {"N", N}, {"V", V}});
    } else {
      check_arg(*draft_probs, "draft_probs", {at::kFloat}, "float32", candidates, {{"B * N", B * N}, {"V", V}});
    }
  }
  return S;
}

// segment_packbits' checks.
void check_packbits(const at::Tensor& x, const at::Tensor& input_indptr, const at::Tensor& output_indptr,
                    const at::Tensor& y, int64_t batch_size) {
  const int64_t n = batch_size;
  check_arg(x, "x", {at::kBool}, "bool", x, {}, 1);
  check_arg(input_indptr, "input_indptr", {at::kInt}, "int32", x, {{"batch_size + 1", n + 1}});
  check_arg(output_indptr, "output_indptr", {at::kInt}, "int32", x, {{"batch_size + 1", n + 1}});
  check_arg(y, "y", {at::kByte}, "uint8", x, {}, 1);
}

// reconstruct_indices_from_tree_mask's checks.
void check_reconstruct(const at::Tensor& tree_mask, const at::Tensor& verified_seq_len, const at::Tensor& positions,
                       const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                       const at::Tensor& retrive_next_sibling, int64_t batch_size, int64_t draft_token_num) {
  const int64_t B = batch_size, N = draft_token_num;
  check_arg(tree_mask, "tree_mask", {at::kBool}, "bool", tree_mask);
  check_numel(tree_mask, "tree_mask", B * N * N, "batch_size * draft_token_num**2");
  check_arg(verified_seq_len, "verified_seq_len", {at::kLong, at::kInt}, "int64 | int32", tree_mask, {{"B", B}});
  check_arg(positions, "positions", {at::kLong, at::kInt}, "int64 | int32", tree_mask);
  check_numel(positions, "positions", B * N, "B * N", {{B * N}, {B, N}});
  check_arg(retrive_index, "retrive_index", {at::kLong, at::kInt}, "int64 | int32", tree_mask, {{"B", B}, {"N", N}});
  check_arg(retrive_next_token, "retrive_next_token", {at::kLong, at::kInt}, "int64 | int32", tree_mask,
            {{"B", B}, {"N", N}});
  check_arg(retrive_next_sibling, "retrive_next_sibling", {at::kLong, at::kInt}, "int64 | int32", tree_mask,
            {{"B", B}, {"N", N}});
}

// ---- host-checks end (scripts for testing the checks on CPU cut the file here) ----

const c10::cuda::CUDAStream current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device());
}

// ---- device helpers ------------------------------------------------------------------------------------------

__device__ __forceinline__ int64_t load_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

// An int32 | int64 index as loaded, widened where it is used (get), not right after its load, where it would wait for
// the load before the kernel's next reads are issued (is64 a compile-time constant: the build kernels').
struct Lazy {
  int64_t w = 0;
  int32_t n = 0;
  __device__ __forceinline__ int64_t get() const { return w + n; }
};
__device__ __forceinline__ Lazy load_lazy(const void* __restrict__ p, bool is64, int64_t i) {
  Lazy r;
  if (is64) {
    r.w = __ldg(static_cast<const int64_t*>(p) + i);
  } else {
    r.n = __ldg(static_cast<const int32_t*>(p) + i);
  }
  return r;
}

__device__ __forceinline__ void store_index(void* p, bool is64, int64_t i, int64_t v) {
  if (is64) {
    static_cast<int64_t*>(p)[i] = v;
  } else {
    static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
  }
}

// Inclusive prefix sum over the lanes of a (full) warp.
template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T x) {
  const int lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

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

// ==== build_tree_kernel_efficient =============================================================================

constexpr int kBuildMaxThreads = 512;
constexpr int64_t kBuildMaxSlots = 8192;  // depth * M candidate slots held in shared memory
constexpr int64_t kBuildMaxNodes = 1024;

// SGLang's flat candidate g (a parent_list entry) -> its slot within draft depth d - 1 of our [depth, M] layout
// (wrapping as the Triton kernel's int64 arithmetic does: a value that far out is out of range either way).
__device__ __forceinline__ int64_t parent_local(int64_t g, int topk, int M, int d) {
  const uint64_t slot = g < topk ? static_cast<uint64_t>(g) : static_cast<uint64_t>(g) + static_cast<uint64_t>(M - topk);
  return static_cast<int64_t>(slot - static_cast<uint64_t>(d - 1) * static_cast<uint64_t>(M));
}

// FULL_MASK: the earlier requests' prefix lengths, sum(seq_lens[:b]), in two parts so that their round trip
// overlaps the kernel's other reads (in one piece, its loop's adds waited for its loads before the selection's and
// the parents' reads were issued: two round trips in the sm_90a SASS at 4b20943). seq_before_issue loads this
// thread's entries tid + u T, u < kSeqAhead (issued with the other reads; nothing waits on them yet);
// seq_before_sum, called once every other read is issued, adds them and the entries past the first kSeqAhead * T
// (four loads in flight at a time). The build kernels take seq_lens' dtype as a template argument: chosen at run
// time, the two dtypes' values merged right after their loads, and the merge waited for them.
constexpr int kSeqAhead = 4;
struct SeqAhead {
  Lazy v[kSeqAhead];
};
__device__ __forceinline__ void seq_before_issue(const void* __restrict__ seq_lens, bool seq64, int64_t b, int tid,
                                                 int T, SeqAhead& a) {
#pragma unroll
  for (int u = 0; u < kSeqAhead; ++u) {
    const int64_t k = tid + static_cast<int64_t>(u) * T;
    if (k < b) a.v[u] = load_lazy(seq_lens, seq64, k);
  }
}
__device__ __forceinline__ int64_t seq_before_sum(const void* __restrict__ seq_lens, bool seq64, int64_t b, int tid,
                                                  int T, const SeqAhead& v) {
  int64_t s = 0;
#pragma unroll
  for (int u = 0; u < kSeqAhead; ++u) s += v.v[u].get();
#pragma unroll 1
  for (int64_t k = tid + static_cast<int64_t>(kSeqAhead) * T; k < b; k += 4 * static_cast<int64_t>(T)) {
    int64_t w[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) w[u] = k + u * T < b ? load_index(seq_lens, seq64, k + u * T) : 0;
    s += (w[0] + w[1]) + (w[2] + w[3]);
  }
  return s;
}

// parent_list [B, P] int64 (P = topk * (depth - 1) + 1, or 0 at depth 1); selected [B, N - 1] int64;
// seq_lens [B] int32 | int64; mask: the output mask's bytes (mask_numel); positions [B * N] int64;
// r_index / r_next / r_sib [B, N] int64; err: the device error word.
// Slot c = d * M + m is our [depth, M] layout of SGLang's flat candidates (f < topk: row 0, then topk^2 per
// depth; M = topk^2, or topk at depth 1). grid: B blocks of blockDim.x (whole warps, <= kBuildMaxThreads);
// dynamic shared memory: a region of max(CS * 10, N * W * 4) bytes (the slots' parent slot and node, int32,
// and chosen / fin flags, u8; once the parents are known, each node's ancestor bits, W = ceil(N / 32) words),
// then N parents (int32).
//
// One small block per request, so its critical path is the time: every global load is issued before the
// first barrier, six barriers in all (the rank scan and the prefix lengths' sum share one), and no thread scans
// the nodes one by one: the first child and the next sibling come from warp ballots over the parents (32 a
// step), the mask rows from each node's ancestor bits (one walk up per node and word), a warp per row writing
// its bytes. Trees of N <= 32 nodes and at most 256 slots take sglang_build_small_kernel (one warp, no barrier).
template <bool kSeq64>  // seq_lens int64 (else int32)
__global__ void __launch_bounds__(kBuildMaxThreads) sglang_build_kernel(
    const int64_t* __restrict__ parent_list, int64_t P, const int64_t* __restrict__ selected,
    const void* __restrict__ seq_lens, uint8_t* __restrict__ mask, int64_t mask_numel,
    int64_t* __restrict__ positions, int64_t* __restrict__ r_index, int64_t* __restrict__ r_next,
    int64_t* __restrict__ r_sib, int topk, int depth, int M, int N, int mode, int nb, size_t region,
    int64_t* __restrict__ err) {
  extern __shared__ int32_t smem32[];
  __shared__ int warp_count[kBuildMaxThreads / 32];
  __shared__ int64_t warp_seq[kBuildMaxThreads / 32];
  __shared__ int first_bad;
  const int CS = depth * M, W = (N + 31) / 32;
  int32_t* ps = smem32;                                   // [CS] parent slot: -1 from the root, -2 out of range
  int32_t* node = ps + CS;                                // [CS] node of the slot, or -1
  uint8_t* chosen = reinterpret_cast<uint8_t*>(node + CS);  // [CS] selected
  uint8_t* fin = chosen + CS;                             // [CS] selected, and so is every ancestor
  uint32_t* anc = reinterpret_cast<uint32_t*>(smem32);    // [N, W] after the slots: ancestor-or-self bits
  int32_t* par = reinterpret_cast<int32_t*>(reinterpret_cast<char*>(smem32) + region);  // [N] parent node
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x, T = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = T >> 5;
  const int64_t C = topk + static_cast<int64_t>(depth - 1) * topk * topk;  // SGLang's candidates
  // each thread takes a contiguous run of slots (the rank scan below counts them in order)
  const int per = (CS + T - 1) / T;
  const int lo = min(CS, tid * per), hi = min(CS, lo + per);

  // every global read first: the prefix lengths, the first selected entries, each slot's parent_list entry
  if (tid == 0) first_bad = INT_MAX;
  constexpr bool seq64 = kSeq64;
  const Lazy seq_at = load_lazy(seq_lens, seq64, b);  // seq_lens[b], widened where it is used
  SeqAhead seq_v;  // FULL_MASK: the prefix lengths before b (summed below)
  if (mode == 0) seq_before_issue(seq_lens, seq64, b, tid, T, seq_v);
  const int64_t sel0 = tid < N - 1 ? selected[b * (N - 1) + tid] : -1;
  for (int c = lo; c < hi; ++c) {
    const int d = c / M, m = c - d * M;
    int32_t p = -1;
    if (d > 0) {
      const int64_t local = parent_local(parent_list[b * P + 1 + (d - 1) * topk + m / topk], topk, M, d);
      p = local >= 0 && local < M ? (d - 1) * M + static_cast<int32_t>(local) : -2;
    }
    ps[c] = p;
    chosen[c] = 0;
  }
  __syncthreads();
  // the selected slots (a selected candidate outside [0, C) is skipped; duplicates select once)
  auto choose = [&](int64_t s) {
    if (s >= 0 && s < C) chosen[s < topk ? s : s + (M - topk)] = 1;
  };
  choose(sel0);
  for (int j = tid + T; j < N - 1; j += T) choose(selected[b * (N - 1) + j]);
  __syncthreads();
  // a selected slot whose parent_list entry is outside depth d - 1 is build_tree's draft_parents error (it hangs
  // from the root); fin: selected with every ancestor selected (the chain ends at the root or at such an entry)
  int count = 0;
  for (int c = lo; c < hi; ++c) {
    const bool ch = chosen[c] != 0;
    if (EAGLE3_UNLIKELY(ch && ps[c] == -2)) atomicMin(&first_bad, c);
    bool f = ch;
    for (int x = ps[c], steps = 0; f && x >= 0 && steps < depth; x = ps[x], ++steps) f = chosen[x] != 0;
    fin[c] = f;
    count += f;
  }
  // build_tree's ranks: the fin slots in slot order (their -index scores), then the others in slot order;
  // one barrier for the scan of the fin counts and the sum of the prefix lengths
  const int inclusive = warp_inclusive_sum(count);
  int64_t seq_sum = mode == 0 ? seq_before_sum(seq_lens, seq64, b, tid, T, seq_v) : 0;
  for (int o = 16; o > 0; o >>= 1) seq_sum += __shfl_down_sync(0xffffffffu, seq_sum, o);
  if (lane == 31) warp_count[warp] = inclusive;
  if (lane == 0) warp_seq[warp] = seq_sum;
  __syncthreads();
  int before = inclusive - count, total = 0;
  int64_t seq_before = 0;
  for (int k = 0; k < nw; ++k) {
    total += warp_count[k];
    before += k < warp ? warp_count[k] : 0;
    seq_before += warp_seq[k];
  }
  if (tid == 0 && EAGLE3_UNLIKELY(first_bad != INT_MAX)) {  // the first bad slot, as the Triton kernel reports it
    const int c = first_bad, d = c / M, m = c - d * M;
    const int64_t local = parent_local(parent_list[b * P + 1 + (d - 1) * topk + m / topk], topk, M, d);
    report_range(err, kOpBuildTree, kArgDraftParents, local, 0, M - 1, b, d, m);
  }
  // ranks 0 .. N - 2 become nodes 1 .. N - 1
  for (int c = lo; c < hi; ++c) {
    const int rank = fin[c] ? before : total + (c - before);
    before += fin[c];
    node[c] = rank < N - 1 ? rank + 1 : -1;
  }
  __syncthreads();
  // a node's parent is the node of its parent slot (an unselected slot's: slot 0 of depth d - 1, as the Triton
  // kernel reads it; from the root: 0). A slot ranks after its parent slot (fin ones first, each group in slot
  // order, a parent slot < its child's), so that is a node with a smaller index
  if (tid == 0) par[0] = -1;
  for (int c = lo; c < hi; ++c) {
    const int n = node[c];
    if (n < 1) continue;
    const int d = c / M;
    const int p = chosen[c] ? (ps[c] >= 0 ? ps[c] : -1) : (d > 0 ? (d - 1) * M : -1);
    const int pn = p < 0 ? 0 : node[p];
    par[n] = pn >= 0 && pn < n ? pn : 0;
  }
  __syncthreads();  // the slots are read for the last time above: their region holds the ancestor bits next

  const int64_t seq = seq_at.get();
  // per (node i, word w): the word's ancestor-or-self bits and the depth -> positions, retrive_index; the packed
  // mask (N <= 32: one word)
  for (int t = tid; t < N * W; t += T) {
    const int i = t / W, w = t - i * W;
    uint32_t bits = 0;
    int dep = -1;
    for (int x = i, steps = 0; x >= 0 && steps <= N; x = par[x], ++steps) {
      if ((x >> 5) == w) bits |= 1u << (x & 31);
      ++dep;
    }
    anc[t] = bits;
    if (w == 0) {
      positions[b * N + i] = seq + dep;
      r_index[b * N + i] = b * N + i;
    }
    if (mode == 2) {  // QLEN_ONLY_BITPACKING: nb little-endian bytes per row; byte 0 set, the others OR-ed into
      uint8_t* row = mask + (b * N + i) * nb;
      row[0] = static_cast<uint8_t>(bits & 255u);
      for (int k = 1; k < nb; ++k) row[k] |= static_cast<uint8_t>((bits >> (8 * k)) & 255u);
    }
  }
  __syncthreads();
  // a warp per node i: over each word of columns j, first child = the first j whose parent is i, next sibling
  // = the first j > i with i's parent (written where they exist); FULL_MASK / QLEN_ONLY: row i's bools, j an
  // ancestor of i or i itself. Row (b, i) of the FULL_MASK block starts at N*N*b + N*sum(seq[:b]) +
  // (seq[b] + N)*i + seq[b] (entries past the buffer skipped)
  const int64_t start = mode == 0 ? static_cast<int64_t>(N) * N * b + N * seq_before + seq
                                  : static_cast<int64_t>(N) * N * b;
  const int64_t stride = mode == 0 ? seq + N : N;
  for (int i = warp; i < N; i += nw) {
    const int pi = par[i];
    int first = -1, sib = -1;
    for (int w = 0; w < W; ++w) {
      const int j = 32 * w + lane;
      const int pj = j < N ? par[j] : -2;
      const unsigned child = __ballot_sync(0xffffffffu, pj == i);
      const unsigned next = __ballot_sync(0xffffffffu, pi >= 0 && pj == pi && j > i);
      if (first < 0 && child != 0u) first = 32 * w + __ffs(child) - 1;
      if (sib < 0 && next != 0u) sib = 32 * w + __ffs(next) - 1;
      if (mode != 2 && j < N) {
        const int64_t at = start + stride * i + j;
        if (at >= 0 && at < mask_numel) mask[at] = (anc[i * W + w] >> lane) & 1u;
      }
    }
    if (lane == 0) {
      if (first >= 0) r_next[b * N + i] = first;
      if (sib >= 0) r_sib[b * N + i] = sib;
    }
  }
}

// ---- small trees: one warp a request -------------------------------------------------------------------------

constexpr int kSmallMaxNodes = 32;   // a node a lane: one mask word
constexpr int kSmallMaxRounds = 8;   // slots a lane: depth * M <= 256

// floor(x / y) for 0 <= x < 2^16 and 1 <= y < 2^16, given inv = 1.0f / y: x + 1/2 and inv are exact / correctly
// rounded, so the product is within 2^-23 relative of (x + 1/2) / y, which is at least 1 / (2y) from an integer.
__device__ __forceinline__ int small_div(int x, float inv) {
  return static_cast<int>((static_cast<float>(x) + 0.5f) * inv);
}

// sglang_build_kernel's outputs for a tree of N <= 32 nodes and depth * M <= 32 * R slots, one warp per request
// (its arguments, and inv_m / inv_topk = 1.0f / M, 1.0f / topk; grid: B blocks of 32 threads, static shared memory
// only). Slot c = 32 r + lane is lane's r-th (so the ranks come from ballots: no scan), node i is lane i. The same
// ranks, parents and outputs as sglang_build_kernel, bit for bit, on every input (the bad values' too: what it
// skips, what it reports); what differs is the critical path of a request:
//   - every global read is issued first (the prefix lengths four at a time, parent_list once per slot, the packed
//     mask bytes that are OR-ed into), then only shared memory, shuffles and ballots: no block barrier, five
//     __syncwarp() where lanes read what others wrote (the zeroed selection words, the selection, the walks'
//     links, the slots' nodes, the nodes' parents);
//   - the fin walks of a lane's R slots advance together, a step of each a round (one shared load);
//   - a node's ancestor bits by pointer jumping (about log2 of the tree's depth rounds of two shuffles), its
//     depth = their count - 1; first child and next sibling from one __match_any_sync over the parents (no scan
//     over nodes);
//   - the bool mask rows written 32 / 2^ceil(log2 N) rows a pass (a byte store per lane), the packed row as one
//     store of its nb bytes when the buffer is nb-aligned (bytes otherwise).
template <int R, bool kSeq64>
__global__ void __launch_bounds__(32) sglang_build_small_kernel(
    const int64_t* __restrict__ parent_list, int64_t P, const int64_t* __restrict__ selected,
    const void* __restrict__ seq_lens, uint8_t* __restrict__ mask, int64_t mask_numel,
    int64_t* __restrict__ positions, int64_t* __restrict__ r_index, int64_t* __restrict__ r_next,
    int64_t* __restrict__ r_sib, int topk, int depth, int M, int N, int mode, int nb, float inv_m, float inv_topk,
    int64_t* __restrict__ err) {
  constexpr unsigned kAll = 0xffffffffu;
  __shared__ int32_t ps_s[32 * R];     // a selected slot's parent slot (-1 the root, -2 out of range), else -3
  __shared__ int32_t node_s[32 * R];   // node of the slot, or -1
  __shared__ uint32_t chosen_s[R];     // selected slots: bit c & 31 of word c >> 5
  __shared__ int32_t par_s[kSmallMaxNodes];
  const int64_t b = blockIdx.x;
  const int lane = threadIdx.x, CS = depth * M;
  const unsigned below = (1u << lane) - 1u, above = ~below & ~(1u << lane);
  const int64_t C = topk + static_cast<int64_t>(depth - 1) * topk * topk;  // SGLang's candidates

  // every global read first: the prefix lengths, the selection (one entry a lane), each slot's parent_list
  // entry ((c - M) / topk = (d - 1) * topk + m / topk, M = topk^2), the packed row's bytes 1 .. nb - 1
  constexpr bool seq64 = kSeq64;
  const Lazy seq_at = load_lazy(seq_lens, seq64, b);  // seq_lens[b], widened where it is used
  SeqAhead seq_v;  // FULL_MASK: the prefix lengths before b (summed below)
  if (mode == 0) seq_before_issue(seq_lens, seq64, b, lane, 32, seq_v);
  const int64_t sel = lane < N - 1 ? selected[b * (N - 1) + lane] : -1;
  int64_t g[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = 32 * r + lane;
    g[r] = c >= M && c < CS ? parent_list[b * P + 1 + small_div(c - M, inv_topk)] : 0;
  }
  uint8_t* row = mask + (b * N + lane) * nb;
  const bool wide = mode == 2 && (reinterpret_cast<uintptr_t>(mask) & static_cast<uintptr_t>(nb - 1)) == 0;
  uint32_t old = 0;  // (nb 1 is always wide)
  if (mode == 2 && nb > 1 && lane < N) {
    if (wide) {
      old = nb == 2 ? *reinterpret_cast<const uint16_t*>(row) : *reinterpret_cast<const uint32_t*>(row);
    } else {
      old = static_cast<uint32_t>(row[1]) << 8;
      if (nb == 4) old |= static_cast<uint32_t>(row[2]) << 16 | static_cast<uint32_t>(row[3]) << 24;
    }
  }

  // parent slots; the selected slots (a selected candidate outside [0, C) is skipped; duplicates select once)
  if (lane < R) chosen_s[lane] = 0u;
  int d[R], ps[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = 32 * r + lane;
    d[r] = small_div(c, inv_m);
    int p = -1;
    if (c >= M && c < CS) {
      const int64_t local = parent_local(g[r], topk, M, d[r]);
      p = local >= 0 && local < M ? (d[r] - 1) * M + static_cast<int>(local) : -2;
    }
    ps[r] = p;
  }
  __syncwarp();
  if (sel >= 0 && sel < C) {
    const int c = static_cast<int>(sel < topk ? sel : sel + (M - topk));
    atomicOr(&chosen_s[c >> 5], 1u << (c & 31));
  }
  __syncwarp();
  // fin: selected with every ancestor selected (the chain ends at the root or at an out-of-range entry). Each
  // slot's link becomes its parent slot if it is selected, else kUnchosen: a step of a walk is one shared load
  constexpr int kUnchosen = -3;
  bool ch[R], fin[R];
  int up[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    ch[r] = (chosen_s[r] >> lane) & 1u;
    fin[r] = ch[r];
    up[r] = ps[r];
    ps_s[32 * r + lane] = ch[r] ? ps[r] : kUnchosen;
  }
  __syncwarp();
  for (int steps = 0; steps < depth; ++steps) {
    bool more = false;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bool on = fin[r] && up[r] >= 0;
      const int link = ps_s[on ? up[r] : 0];  // (unconditional: the R loads of a step go out back to back)
      fin[r] = on ? link != kUnchosen : fin[r];
      up[r] = on ? link : up[r];
      more = more || on;
    }
    if (!__any_sync(kAll, more)) break;
  }
  // build_tree's ranks: the fin slots in slot order, then the others in slot order; ranks 0 .. N - 2 become
  // nodes 1 .. N - 1 (a slot past CS is not fin and ranks at c >= CS >= N - 1)
  unsigned fins[R];
  int total = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    fins[r] = __ballot_sync(kAll, fin[r]);
    total += __popc(fins[r]);
  }
  int before = 0, node[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = 32 * r + lane, mine = before + __popc(fins[r] & below);
    const int rank = fin[r] ? mine : total + (c - mine);
    before += __popc(fins[r]);
    node[r] = rank < N - 1 ? rank + 1 : -1;
    node_s[c] = node[r];
  }
  if (lane == 0) par_s[0] = -1;
  __syncwarp();
  // a node's parent: the node of its parent slot (an unselected slot's: slot 0 of depth d - 1; from the root: 0)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = node[r];
    const int p = ch[r] ? (ps[r] >= 0 ? ps[r] : -1) : (d[r] > 0 ? (d[r] - 1) * M : -1);
    const int pn_read = node_s[p < 0 ? 0 : p];  // (read for every slot: no branch before the load)
    const int pn = p < 0 ? 0 : pn_read;
    if (n >= 1) par_s[n] = pn >= 0 && pn < n ? pn : 0;
  }
  __syncwarp();

  const int64_t seq = seq_at.get();
  // lane i = node i: ancestor-or-self bits (par[j] < j, so the chain ends at the root within N - 1 hops)
  const int pa = lane < N ? par_s[lane] : -2;
  uint32_t anc = lane < N ? 1u << lane : 0u;
  int hop = pa;  // after k rounds: anc holds the node and its 2^k - 1 nearest ancestors, hop the next one
  for (int span = 1; span < N; span <<= 1) {
    if (!__any_sync(kAll, hop >= 0)) break;
    const int src = hop >= 0 ? hop : 0;
    const uint32_t a = __shfl_sync(kAll, anc, src);
    const int h = __shfl_sync(kAll, hop, src);
    if (hop >= 0) {
      anc |= a;
      hop = h;
    }
  }
  // first child = the first node of each group of equal parents, next sibling = the next node of the group
  const unsigned same = __match_any_sync(kAll, pa);  // lanes >= N (-2) form a group of their own
  if (lane < N) {
    positions[b * N + lane] = seq + (__popc(anc) - 1);
    r_index[b * N + lane] = b * N + lane;
    if (pa >= 0) {
      if ((same & below) == 0u) r_next[b * N + pa] = lane;
      if ((same & above) != 0u) r_sib[b * N + lane] = __ffs(same & above) - 1;
    }
    if (mode == 2) {  // QLEN_ONLY_BITPACKING: byte 0 set, bytes 1 .. nb - 1 OR-ed into (N <= 8 nb: anc fits)
      const uint32_t v = anc | (old & ~255u);
      if (nb == 1) {
        row[0] = static_cast<uint8_t>(v);
      } else if (wide) {
        if (nb == 2) {
          *reinterpret_cast<uint16_t*>(row) = static_cast<uint16_t>(v);
        } else {
          *reinterpret_cast<uint32_t*>(row) = v;
        }
      } else {
        row[0] = static_cast<uint8_t>(v);
        row[1] = static_cast<uint8_t>(v >> 8);
        if (nb == 4) {
          row[2] = static_cast<uint8_t>(v >> 16);
          row[3] = static_cast<uint8_t>(v >> 24);
        }
      }
    }
  }
  if (mode != 2) {  // FULL_MASK / QLEN_ONLY: bool (i, j) = j an ancestor of i or i itself
    int64_t seq_before = mode == 0 ? seq_before_sum(seq_lens, seq64, b, lane, 32, seq_v) : 0;
    for (int o = 16; o > 0; o >>= 1) seq_before += __shfl_xor_sync(kAll, seq_before, o);
    const int64_t start = mode == 0 ? static_cast<int64_t>(N) * N * b + N * seq_before + seq
                                    : static_cast<int64_t>(N) * N * b;
    const int64_t stride = mode == 0 ? seq + N : N;
    // 32 / 2^ceil(log2 N) rows a pass, lane = (row, column j)
    const int log_np = 32 - __clz(N - 1), rows = 32 >> log_np, j = lane & ((1 << log_np) - 1);
    for (int i0 = 0; i0 < N; i0 += rows) {
      const int i = i0 + (lane >> log_np);
      const uint32_t a = __shfl_sync(kAll, anc, i & 31);
      const int64_t at = start + stride * i + j;
      if (j < N && i < N && at >= 0 && at < mask_numel) mask[at] = (a >> j) & 1u;
    }
  }
  // the first selected slot whose parent_list entry is outside depth d - 1, reported as sglang_build_kernel does
  int first_bad = -1;
#pragma unroll
  for (int r = R - 1; r >= 0; --r) {
    const unsigned bad = __ballot_sync(kAll, ch[r] && ps[r] == -2);
    if (bad != 0u) first_bad = 32 * r + __ffs(bad) - 1;
  }
  if (lane == 0 && EAGLE3_UNLIKELY(first_bad >= 0)) {
    const int c = first_bad, dd = c / M, m = c - dd * M;
    const int64_t local = parent_local(parent_list[b * P + 1 + (dd - 1) * topk + m / topk], topk, M, dd);
    report_range(err, kOpBuildTree, kArgDraftParents, local, 0, M - 1, b, dd, m);
  }
}

void sglang_build_tree_cuda(const at::Tensor& parent_list, const at::Tensor& selected_index,
                            const at::Tensor& verified_seq_len, const at::Tensor& tree_mask, const at::Tensor& positions,
                            const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                            const at::Tensor& retrive_next_sibling, int64_t topk, int64_t depth,
                            int64_t draft_token_num, int64_t tree_mask_mode) {
  const int nb = check_build(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
                             retrive_next_token, retrive_next_sibling, topk, depth, draft_token_num, tree_mask_mode);
  const int64_t B = parent_list.size(0), P = parent_list.size(1), N = draft_token_num, mode = tree_mask_mode;
  if (B == 0) return;
  const int64_t M = depth > 1 ? topk * topk : topk;
  TORCH_CHECK_NOT_IMPLEMENTED(depth * M <= kBuildMaxSlots && N <= kBuildMaxNodes && B < (int64_t{1} << 31),
                              "compat_sglang build: more than ", kBuildMaxSlots, " candidate slots or ", kBuildMaxNodes,
                              " nodes per request, or B >= 2**31");
  const c10::cuda::OptionalCUDAGuard guard(parent_list.device());
  const cudaStream_t stream = current_stream(parent_list);
  const int device = parent_list.get_device();
  const int64_t CS = depth * M, W = (N + 31) / 32;
  if (N <= kSmallMaxNodes && CS <= 32 * kSmallMaxRounds) {  // one warp a request
    const bool s64 = verified_seq_len.scalar_type() == at::kLong;
    auto pick = [&](auto r) {
      constexpr int R = decltype(r)::value;
      return s64 ? sglang_build_small_kernel<R, true> : sglang_build_small_kernel<R, false>;
    };
    auto kernel = CS <= 32 ? pick(std::integral_constant<int, 1>{})
                           : (CS <= 64 ? pick(std::integral_constant<int, 2>{})
                                       : (CS <= 128 ? pick(std::integral_constant<int, 4>{})
                                                    : pick(std::integral_constant<int, 8>{})));
    kernel<<<static_cast<unsigned>(B), 32, 0, stream>>>(
        P ? parent_list.data_ptr<int64_t>() : nullptr, P, selected_index.data_ptr<int64_t>(),
        verified_seq_len.data_ptr(),
        static_cast<uint8_t*>(tree_mask.data_ptr()), tree_mask.numel() * static_cast<int64_t>(tree_mask.element_size()),
        positions.data_ptr<int64_t>(), retrive_index.data_ptr<int64_t>(), retrive_next_token.data_ptr<int64_t>(),
        retrive_next_sibling.data_ptr<int64_t>(), static_cast<int>(topk), static_cast<int>(depth), static_cast<int>(M),
        static_cast<int>(N), static_cast<int>(mode), nb, 1.0f / static_cast<float>(M),
        1.0f / static_cast<float>(topk), device_error_word(device));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    after_launch(device, stream);
    return;
  }
  const auto kernel =
      verified_seq_len.scalar_type() == at::kLong ? sglang_build_kernel<true> : sglang_build_kernel<false>;
  const size_t region = static_cast<size_t>(std::max(CS * 10, N * W * 4) + 3) / 4 * 4;
  const size_t smem = region + static_cast<size_t>(N) * sizeof(int32_t);  // at most 132 KiB
  if (smem > 48 * 1024) {
    int max_smem = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    TORCH_CHECK_NOT_IMPLEMENTED(smem <= static_cast<size_t>(max_smem), "compat_sglang build: ", smem,
                                " bytes of shared memory a request, this GPU has ", max_smem);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  // a thread per slot, per (node, mask word), or four nodes a warp (the row pass), in whole warps, 32 .. 512
  const int64_t work = std::max({CS, N * W, 32 * ((N + 3) / 4)});
  const int threads = static_cast<int>(std::clamp<int64_t>((work + 31) / 32 * 32, 32, kBuildMaxThreads));
  kernel<<<static_cast<unsigned>(B), threads, smem, stream>>>(
      P ? parent_list.data_ptr<int64_t>() : nullptr, P, selected_index.data_ptr<int64_t>(),
      verified_seq_len.data_ptr(),
      static_cast<uint8_t*>(tree_mask.data_ptr()), tree_mask.numel() * static_cast<int64_t>(tree_mask.element_size()),
      positions.data_ptr<int64_t>(), retrive_index.data_ptr<int64_t>(), retrive_next_token.data_ptr<int64_t>(),
      retrive_next_sibling.data_ptr<int64_t>(), static_cast<int>(topk), static_cast<int>(depth), static_cast<int>(M),
      static_cast<int>(N), static_cast<int>(mode), nb, region, device_error_word(device));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  after_launch(device, stream);
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
  const int64_t S = check_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                 retrive_next_token, retrive_next_sibling, target_predict);
  const int64_t B = candidates.size(0), N = candidates.size(1);
  if (B == 0) return;
  TORCH_CHECK_NOT_IMPLEMENTED(N <= kWalkMaxNodes && B * N < (int64_t{1} << 31) && S < (int64_t{1} << 31),
                              "compat_sglang walk: more than ", kWalkMaxNodes, " nodes per request");
  const c10::cuda::OptionalCUDAGuard guard(candidates.device());
  const cudaStream_t stream = current_stream(candidates);
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
  const double x = warp_inclusive_sum(mine);
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
  const int64_t S = check_sampling(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                   retrive_next_token, retrive_next_sibling, uniform_samples,
                                   uniform_samples_for_final_sampling, target_probs, draft_probs);
  const int64_t B = candidates.size(0), N = candidates.size(1), V = target_probs.size(-1);
  if (B == 0) return;
  const int64_t split = (V + kChunk - 1) / kChunk;
  TORCH_CHECK_NOT_IMPLEMENTED(N <= kWalkMaxNodes && B * N < (int64_t{1} << 31) && S < (int64_t{1} << 31) &&
                                  split < 65536 && V < (int64_t{1} << 31),
                              "compat_sglang sampling: more than ", kWalkMaxNodes, " nodes per request, or V >= 2**31");
  const c10::cuda::OptionalCUDAGuard guard(candidates.device());
  const cudaStream_t stream = current_stream(candidates);
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

// ==== segment_packbits ========================================================================================

constexpr int kPackThreads = 256;

// x [x_numel] bool (bytes); in_ptr / out_ptr [n + 1] int32; y [y_numel] uint8. Thread t: output byte t, its
// segment found by binary search (the largest s with out_ptr[s] <= t); bits outside x read as 0.
__global__ void __launch_bounds__(kPackThreads) sglang_packbits_kernel(
    const uint8_t* __restrict__ x, int64_t x_numel, const int32_t* __restrict__ in_ptr,
    const int32_t* __restrict__ out_ptr, uint8_t* __restrict__ y, int64_t y_numel, int n, int steps, bool x_aligned) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kPackThreads + threadIdx.x;
  if (t >= y_numel) return;
  int lo = 0, hi = n;
  for (int k = 0; k < steps; ++k) {
    const int mid = (lo + hi + 1) / 2;
    const bool le = out_ptr[mid] <= t;
    lo = le ? mid : lo;
    hi = le ? hi : mid - 1;
  }
  const int s = min(lo, n - 1);
  const int64_t o0 = out_ptr[s];
  if (t < o0 || t >= out_ptr[s + 1]) return;  // outside every segment: left as it is
  const int64_t end = min(static_cast<int64_t>(in_ptr[s + 1]), x_numel);
  const int64_t bit = in_ptr[s] + 8 * (t - o0);
  uint32_t byte = 0;
  if (x_aligned && bit >= 0 && (bit & 7) == 0 && bit + 8 <= end) {
    const uint64_t v = *reinterpret_cast<const uint64_t*>(x + bit);
#pragma unroll
    for (int k = 0; k < 8; ++k) byte |= static_cast<uint32_t>(((v >> (8 * k)) & 255u) != 0) << k;
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = bit + k;
      if (i >= 0 && i < end) byte |= static_cast<uint32_t>(x[i] != 0) << k;
    }
  }
  y[t] = static_cast<uint8_t>(byte);
}

void sglang_segment_packbits_cuda(const at::Tensor& x, const at::Tensor& input_indptr,
                                  const at::Tensor& output_indptr, const at::Tensor& y, int64_t batch_size) {
  const int64_t n = batch_size;
  check_packbits(x, input_indptr, output_indptr, y, batch_size);
  if (n <= 0 || y.numel() == 0) return;
  TORCH_CHECK_NOT_IMPLEMENTED(n < (int64_t{1} << 30) && (y.numel() + kPackThreads - 1) / kPackThreads < (int64_t{1} << 31),
                              "compat_sglang segment_packbits: batch_size or y too large");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream(x);
  int steps = 0;
  for (int64_t v = n; v > 0; v >>= 1) ++steps;  // n.bit_length()
  const auto* xp = static_cast<const uint8_t*>(x.data_ptr());
  const int64_t blocks = (y.numel() + kPackThreads - 1) / kPackThreads;
  sglang_packbits_kernel<<<static_cast<unsigned>(blocks), kPackThreads, 0, stream>>>(
      xp, x.numel(), input_indptr.data_ptr<int32_t>(), output_indptr.data_ptr<int32_t>(), y.data_ptr<uint8_t>(),
      y.numel(), static_cast<int>(n), steps, reinterpret_cast<uintptr_t>(xp) % 8 == 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  after_launch(x.get_device(), stream);
}

// ==== reconstruct_indices_from_tree_mask ======================================================================

constexpr int kReconstructThreads = 256;
constexpr int64_t kReconstructMaxNodes = 12288;  // N parents in shared memory

// mask [B * N * N] bool: row i of request b = node i's ancestors (and itself). seq_lens [B]; positions [B * N],
// r_index / r_next / r_sib [B, N]; each int32 or int64 (the *64 flags). grid: B blocks; dynamic shared memory:
// N parents (int32).
__global__ void __launch_bounds__(kReconstructThreads) sglang_reconstruct_kernel(
    const uint8_t* __restrict__ mask, const void* __restrict__ seq_lens, bool seq64, void* __restrict__ positions,
    bool pos64, void* __restrict__ r_index, bool index64, void* __restrict__ r_next, bool next64,
    void* __restrict__ r_sib, bool sib64, int N) {
  extern __shared__ int32_t parent[];
  const int64_t b = blockIdx.x;
  const uint8_t* m = mask + b * N * static_cast<int64_t>(N);
  const int64_t seq = load_index(seq_lens, seq64, b);
  // depth = set bits before the diagonal; parent = the last of them
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    int depth = 0, p = -1;
    for (int j = 0; j < i; ++j) {
      if (m[static_cast<int64_t>(i) * N + j] != 0) {
        ++depth;
        p = j;
      }
    }
    parent[i] = p;
    store_index(positions, pos64, b * N + i, seq + depth);
    store_index(r_index, index64, b * N + i, b * N + i);
  }
  __syncthreads();
  // first child: the first later row with bit i; next sibling: the first later node with the same parent
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    int64_t first = -1, sib = -1;
    for (int k = i + 1; k < N; ++k) {
      if (m[static_cast<int64_t>(k) * N + i] != 0) {
        first = k;
        break;
      }
    }
    const int p = parent[i];
    if (p >= 0) {
      for (int k = i + 1; k < N; ++k) {
        if (parent[k] == p) {
          sib = k;
          break;
        }
      }
    }
    store_index(r_next, next64, b * N + i, first);
    store_index(r_sib, sib64, b * N + i, sib);
  }
}

void sglang_reconstruct_indices_cuda(const at::Tensor& tree_mask, const at::Tensor& verified_seq_len,
                                     const at::Tensor& positions, const at::Tensor& retrive_index,
                                     const at::Tensor& retrive_next_token, const at::Tensor& retrive_next_sibling,
                                     int64_t batch_size, int64_t draft_token_num) {
  const int64_t B = batch_size, N = draft_token_num;
  check_reconstruct(tree_mask, verified_seq_len, positions, retrive_index, retrive_next_token, retrive_next_sibling,
                    batch_size, draft_token_num);
  if (B <= 0 || N <= 0) return;
  TORCH_CHECK_NOT_IMPLEMENTED(N <= kReconstructMaxNodes && B < (int64_t{1} << 31),
                              "compat_sglang reconstruct: more than ", kReconstructMaxNodes, " nodes per request");
  const c10::cuda::OptionalCUDAGuard guard(tree_mask.device());
  const cudaStream_t stream = current_stream(tree_mask);
  auto is64 = [](const at::Tensor& t) { return t.scalar_type() == at::kLong; };
  sglang_reconstruct_kernel<<<static_cast<unsigned>(B), kReconstructThreads, static_cast<size_t>(N) * sizeof(int32_t),
                              stream>>>(
      static_cast<const uint8_t*>(tree_mask.data_ptr()), verified_seq_len.data_ptr(), is64(verified_seq_len),
      positions.data_ptr(), is64(positions), retrive_index.data_ptr(), is64(retrive_index),
      retrive_next_token.data_ptr(), is64(retrive_next_token), retrive_next_sibling.data_ptr(),
      is64(retrive_next_sibling), static_cast<int>(N));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  after_launch(tree_mask.get_device(), stream);
}

}  // namespace
}  // namespace eagle3

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) {
  m.impl("_sglang_build_tree", &eagle3::sglang_build_tree_cuda);
  m.impl("_sglang_verify_greedy", &eagle3::sglang_verify_greedy_cuda);
  m.impl("_sglang_verify_sampling", &eagle3::sglang_verify_sampling_cuda);
  m.impl("_sglang_segment_packbits", &eagle3::sglang_segment_packbits_cuda);
  m.impl("_sglang_reconstruct_indices", &eagle3::sglang_reconstruct_indices_cuda);
}
