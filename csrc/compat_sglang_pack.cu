// eagle3_ops.compat.sglang's tree-mask conversions on CUDA tensors, each as one op: segment_packbits
// (torch.ops.eagle3._sglang_segment_packbits: one thread per output byte) and reconstruct_indices_from_tree_mask
// (_sglang_reconstruct_indices: one block per request). What the compat ops share (the algorithms' source, the
// checks, no host sync) is said in eagle3/compat_sglang.h.

#include <torch/library.h>

#include "eagle3/compat_sglang.cuh"

namespace eagle3 {
namespace {

// ---- device helpers ------------------------------------------------------------------------------------------

__device__ __forceinline__ void store_index(void* p, bool is64, int64_t i, int64_t v) {
  if (is64) {
    static_cast<int64_t*>(p)[i] = v;
  } else {
    static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
  }
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
  sglang::check_packbits(x, input_indptr, output_indptr, y, batch_size);
  if (n <= 0 || y.numel() == 0) return;
  TORCH_CHECK_NOT_IMPLEMENTED(n < (int64_t{1} << 30) && (y.numel() + kPackThreads - 1) / kPackThreads < (int64_t{1} << 31),
                              "compat_sglang segment_packbits: batch_size or y too large");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const cudaStream_t stream = sglang::current_stream(x);
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
  const int64_t seq = sglang::load_index(seq_lens, seq64, b);
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
  sglang::check_reconstruct(tree_mask, verified_seq_len, positions, retrive_index, retrive_next_token,
                            retrive_next_sibling, batch_size, draft_token_num);
  if (B <= 0 || N <= 0) return;
  TORCH_CHECK_NOT_IMPLEMENTED(N <= kReconstructMaxNodes && B < (int64_t{1} << 31),
                              "compat_sglang reconstruct: more than ", kReconstructMaxNodes, " nodes per request");
  const c10::cuda::OptionalCUDAGuard guard(tree_mask.device());
  const cudaStream_t stream = sglang::current_stream(tree_mask);
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
  m.impl("_sglang_segment_packbits", &eagle3::sglang_segment_packbits_cuda);
  m.impl("_sglang_reconstruct_indices", &eagle3::sglang_reconstruct_indices_cuda);
}
