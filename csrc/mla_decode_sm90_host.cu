// The host side of tree_attention_mla's Hopper kernel (eagle3/mla_sm90.h says what the kernel is and which file
// holds what): the argument checks, the launch, and the internal ops _tree_attention_mla_sm90, _fp8 and (development
// builds) _dev. Each op checks its arguments, takes its build of mla_decode_kernel from csrc/mla_decode_sm90.cu
// (kernel_for, dev_kernel_for: the template is instantiated there) and launches it on the current stream of q's
// device.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "eagle3/checks.h"
#include "eagle3/device.h"
#include "eagle3/errors.h"
#include "eagle3/mla_sm90.h"

namespace eagle3 {
namespace {

using namespace mla_sm90;  // the tile sizes, Params and the kernel's builds (eagle3/mla_sm90.h)

// q           [B * N, G, 576]  bf16 | fp16, rows 16-byte aligned, last dim contiguous
// kv_cache    [num_pages, page_size, 576]  q's dtype (fp8 e4m3 with kv_scale), rows 16-byte aligned, last dim
//             contiguous
// kv_scale    (fp8 caches) [] or [1] fp32 on q's device: key = V source = fp8 * kv_scale
// page_table  [B, max_pages] int32, last dim contiguous;  prefix_lens [B] int32
// tree_mask   [B, N, W] int32 contiguous
// out         [B * N, G, 512]  q's dtype, last dim contiguous;  lse [B * N, G] fp32 contiguous, optional
// part_out    [num_splits, B, N * G, 512] fp32 contiguous;  part_lse [num_splits, B, N * G] fp32 contiguous
//             (written when num_splits > 1, then merged by the caller; unused otherwise)
void check_args(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& page_table,
                const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double scale, const at::Tensor& out,
                const std::optional<at::Tensor>& lse, const at::Tensor& part_out, const at::Tensor& part_lse,
                int64_t num_splits, const at::Tensor* kv_scale_or_null = nullptr) {
  TORCH_CHECK_TYPE(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                   "q must have dtype bfloat16 | float16, got ", q.scalar_type());
  CHECK_CUDA(q);
  CHECK_DIM(q, 3);
  CHECK_DIM(tree_mask, 3);
  const int64_t B = tree_mask.size(0), N = tree_mask.size(1), W = tree_mask.size(2), G = q.size(1);
  CHECK_SHAPE(q, B * N, G, kDim);
  CHECK_LAST_DIM_CONTIGUOUS(q);
  CHECK_DTYPE(kv_cache, kv_scale_or_null != nullptr ? at::kFloat8_e4m3fn : q.scalar_type());
  CHECK_DIM(kv_cache, 3);
  if (kv_scale_or_null != nullptr) {
    const at::Tensor& kv_scale = *kv_scale_or_null;
    CHECK_DTYPE(kv_scale, at::kFloat);
    TORCH_CHECK_VALUE(kv_scale.numel() == 1 && kv_scale.dim() <= 1, "kv_scale must have shape [] or [1], got ",
                      kv_scale.sizes());
    CHECK_SAME_DEVICE(kv_scale, q);
  }
  CHECK_SHAPE(kv_cache, kv_cache.size(0), kv_cache.size(1), kDim);
  CHECK_LAST_DIM_CONTIGUOUS(kv_cache);
  CHECK_DTYPE(page_table, at::kInt);
  CHECK_DIM(page_table, 2);
  CHECK_SHAPE(page_table, B, page_table.size(1));
  TORCH_CHECK_VALUE(page_table.size(1) == 0 || page_table.stride(1) == 1,
                    "page_table must be contiguous in its last dimension, got strides ", page_table.strides());
  CHECK_DTYPE(prefix_lens, at::kInt);
  CHECK_SHAPE(prefix_lens, B);
  TORCH_CHECK_VALUE(prefix_lens.is_contiguous(), "prefix_lens must be contiguous");
  CHECK_DTYPE(tree_mask, at::kInt);
  TORCH_CHECK_VALUE(tree_mask.is_contiguous(), "tree_mask must be contiguous, got strides ", tree_mask.strides());
  TORCH_CHECK_VALUE(W * 32 >= N, "tree_mask must have W >= ceil(N / 32) words, got W = ", W, " for N = ", N);
  CHECK_DTYPE(out, q.scalar_type());
  CHECK_SHAPE(out, B * N, G, kDv);
  CHECK_LAST_DIM_CONTIGUOUS(out);
  if (lse.has_value()) {
    CHECK_DTYPE((*lse), at::kFloat);
    CHECK_SHAPE((*lse), B * N, G);
    TORCH_CHECK_VALUE(lse->is_contiguous(), "lse must be contiguous");
  }
  TORCH_CHECK_VALUE(num_splits >= 1 && num_splits <= 65535, "num_splits must be in [1, 65535], got ", num_splits);
  TORCH_CHECK_VALUE(scale > 0 && std::isfinite(scale), "scale must be finite and > 0, got ", scale);
  if (num_splits > 1) {
    CHECK_DTYPE(part_out, at::kFloat);
    CHECK_SHAPE(part_out, num_splits, B, N * G, kDv);
    TORCH_CHECK_VALUE(part_out.is_contiguous(), "part_out must be contiguous");
    CHECK_DTYPE(part_lse, at::kFloat);
    CHECK_SHAPE(part_lse, num_splits, B, N * G);
    TORCH_CHECK_VALUE(part_lse.is_contiguous(), "part_lse must be contiguous");
  }
  for (const at::Tensor* t : {&kv_cache, &page_table, &prefix_lens, &tree_mask, &out}) CHECK_SAME_DEVICE((*t), q);
  if (lse.has_value()) CHECK_SAME_DEVICE((*lse), q);
  if (num_splits > 1) {
    CHECK_SAME_DEVICE(part_out, q);
    CHECK_SAME_DEVICE(part_lse, q);
  }
  // 16-byte cp.async of every 576-wide row
  auto aligned = [](const at::Tensor& t, int64_t s0, int64_t s1) {
    const int64_t per16 = 16 / t.element_size();  // elements a 16-byte unit
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && s0 % per16 == 0 && s1 % per16 == 0;
  };
  TORCH_CHECK_VALUE(aligned(q, q.stride(0), q.stride(1)),
                    "q must have 16-byte aligned rows (data pointer and strides)");
  TORCH_CHECK_VALUE(aligned(kv_cache, kv_cache.stride(0), kv_cache.stride(1)),
                    "kv_cache must have 16-byte aligned rows (data pointer and strides)");
  TORCH_CHECK_VALUE(out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 &&
                        reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0,
                    "out must have 4-byte aligned element pairs");
  TORCH_CHECK_VALUE(N * G <= (int64_t{1} << 30) && B <= 65535 && kv_cache.size(0) < (int64_t{1} << 31) &&
                        page_table.size(1) * kv_cache.size(1) < (int64_t{1} << 31),
                    "tree_attention_mla sizes out of the kernel's range");
}

// Launches `kernel` (one of mla_decode_kernel's builds, kernel_for's pick for q's dtype) on q's device, the
// arguments checked by check_args. trace: the kDevTrace build's buffer (development builds), else nullptr.
void launch(Kernel kernel, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& page_table,
            const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double scale, const at::Tensor& out,
            const std::optional<at::Tensor>& lse, const at::Tensor& part_out, const at::Tensor& part_lse,
            int64_t num_splits, uint64_t* trace, const at::Tensor* kv_scale = nullptr, bool evict_first = false) {
  const int64_t B = tree_mask.size(0), N = tree_mask.size(1), W = tree_mask.size(2), G = q.size(1);
  const c10::cuda::OptionalCUDAGuard guard(q.device());
  const int device = q.get_device();
  TORCH_CHECK_VALUE(sm_major(device) == 9, "the sm_90a kernel needs a Hopper GPU (compute capability 9.x)");
  // (before the empty-input return: triton_kernels/mla_decode.py sm90_compiled asks with empty inputs)
  TORCH_CHECK_NOT_IMPLEMENTED(sm90a_compiled(device), "this build has no sm_90a code for tree_attention_mla's "
                              "Hopper kernel (TORCH_CUDA_ARCH_LIST without 9.0a compiles it to a trap)");
  if (B == 0 || N == 0 || G == 0) return;

  Params p{};
  p.q = q.data_ptr();
  p.kv = kv_cache.data_ptr();
  p.page_table = page_table.data_ptr<int32_t>();
  p.prefix_lens = prefix_lens.data_ptr<int32_t>();
  p.tree_mask = tree_mask.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.part_out = num_splits > 1 ? part_out.data_ptr<float>() : nullptr;
  p.part_lse = num_splits > 1 ? part_lse.data_ptr<float>() : nullptr;
#ifdef EAGLE3_DEV_BUILD
  p.trace = trace;
#else
  (void)trace;
#endif
  p.err = device_error_word(device);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.B = static_cast<int>(B);
  p.N = static_cast<int>(N);
  p.W = static_cast<int>(W);
  p.G = static_cast<int>(G);
  p.num_pages = static_cast<int>(kv_cache.size(0));
  p.max_pages = static_cast<int>(page_table.size(1));
  p.page_size = static_cast<int>(kv_cache.size(1));
  p.num_splits = static_cast<int>(num_splits);
  p.stride_qt = q.stride(0);
  p.stride_qh = q.stride(1);
  p.stride_kp = kv_cache.stride(0);
  p.stride_ks = kv_cache.stride(1);
  p.stride_pt = page_table.stride(0);
  p.stride_ot = out.stride(0);
  p.stride_oh = out.stride(1);
  p.kv_scale = kv_scale != nullptr ? kv_scale->data_ptr<float>() : nullptr;
  p.evict_first = evict_first ? 1 : 0;
  if (p.page_size == 0 || p.max_pages == 0) {
    p.max_pages = 0;  // capacity 0: every request is bad (NaN), nothing is read
    p.page_size = 1;
  }

  const dim3 grid(static_cast<unsigned>((N * G + kRows - 1) / kRows), static_cast<unsigned>(B),
                  static_cast<unsigned>(num_splits));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  after_launch(device, stream);
}

// The arguments as check_args'. evict_first: the KV loads marked L2 evict-first (when num_splits > 1: the
// partials, written last and read by the merge, then stay in L2).
void tree_attention_mla_sm90_cuda(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& page_table,
                                  const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double scale,
                                  const at::Tensor& out, const std::optional<at::Tensor>& lse,
                                  const at::Tensor& part_out, const at::Tensor& part_lse, int64_t num_splits,
                                  bool evict_first) {
  check_args(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits);
  const Kernel kernel = kernel_for(q.scalar_type() == at::kBFloat16, evict_first, false);
  launch(kernel, q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits,
         nullptr);
}

// The fp8 e4m3 cache (kv_scale: [] or [1] fp32 on q's device, key = fp8 * kv_scale); the other arguments as
// tree_attention_mla_sm90_cuda's. One build per q dtype; the L2 policy of the KV loads is a runtime choice.
void tree_attention_mla_sm90_fp8_cuda(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& kv_scale,
                                      const at::Tensor& page_table, const at::Tensor& prefix_lens,
                                      const at::Tensor& tree_mask, double scale, const at::Tensor& out,
                                      const std::optional<at::Tensor>& lse, const at::Tensor& part_out,
                                      const at::Tensor& part_lse, int64_t num_splits, bool evict_first) {
  check_args(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits,
             &kv_scale);
  const Kernel kernel = kernel_for(q.scalar_type() == at::kBFloat16, false, true);
  launch(kernel, q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits,
         nullptr, &kv_scale, evict_first);
}

#ifdef EAGLE3_DEV_BUILD
// The development op (setup.py EAGLE3_DEV_BUILD=1), bf16 only; the arguments as tree_attention_mla_sm90_cuda's, and
// trace     [grid blocks, 16] int64 contiguous: the kDevTrace build writes its stamps there (bench/dev/trace_mla.py)
// skeleton  0, or a no-math build (evict-first loads, no trace): 1 without the math, 3 without the math and the
//           epilogue's stores (kDevNoMath | kDevNoStores; bench/dev/ceiling_mla.py)
void tree_attention_mla_sm90_dev_cuda(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& page_table,
                                      const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double scale,
                                      const at::Tensor& out, const std::optional<at::Tensor>& lse,
                                      const at::Tensor& part_out, const at::Tensor& part_lse, int64_t num_splits,
                                      bool evict_first, const std::optional<at::Tensor>& trace, int64_t skeleton) {
  check_args(q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits);
  TORCH_CHECK_TYPE(q.scalar_type() == at::kBFloat16, "the development builds are built for bfloat16 only, got ",
                   q.scalar_type());
  const bool traced = trace.has_value();
  TORCH_CHECK_VALUE(skeleton == 0 || ((skeleton == 1 || skeleton == 3) && evict_first && !traced),
                    "skeleton must be 0, or 1 | 3 with evict_first and no trace, got ", skeleton);
  if (traced) {
    const int64_t B = tree_mask.size(0), N = tree_mask.size(1), G = q.size(1);
    const int64_t blocks = (N * G + kRows - 1) / kRows * B * num_splits;
    CHECK_DTYPE((*trace), at::kLong);
    CHECK_SHAPE((*trace), blocks, kTraceSlots);
    TORCH_CHECK_VALUE(trace->is_contiguous(), "trace must be contiguous");
    CHECK_SAME_DEVICE((*trace), q);
  }
  const Kernel kernel = dev_kernel_for(evict_first, traced, skeleton);
  launch(kernel, q, kv_cache, page_table, prefix_lens, tree_mask, scale, out, lse, part_out, part_lse, num_splits,
         traced ? reinterpret_cast<uint64_t*>(trace->data_ptr<int64_t>()) : nullptr);
}
#endif

}  // namespace
}  // namespace eagle3

// internal, Hopper only: the sm_90a kernel over an fp8 e4m3 cache (tree_attention_mla with kv_scale), called by
// triton_kernels/mla_decode.py's tree_attention_mla_sm90, which picks the splits and merges them. Defined here, with
// its only kernel (setup.py builds this file and csrc/mla_decode_sm90.cu together, as the kernel mla_decode_sm90), so
// that builds without that kernel have no such op (mla_decode.sm90_supported asks).
TORCH_LIBRARY_FRAGMENT(eagle3, m) {
  m.def(
      "_tree_attention_mla_sm90_fp8(Tensor q, Tensor kv_cache, Tensor kv_scale, Tensor page_table, "
      "Tensor prefix_lens, Tensor tree_mask, float scale, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!) part_out, "
      "Tensor(d!) part_lse, int num_splits, bool evict_first=False) -> ()");
}

TORCH_LIBRARY_IMPL(eagle3, CUDA, m) {
  m.impl("_tree_attention_mla_sm90", &eagle3::tree_attention_mla_sm90_cuda);
  m.impl("_tree_attention_mla_sm90_fp8", &eagle3::tree_attention_mla_sm90_fp8_cuda);
#ifdef EAGLE3_DEV_BUILD
  m.impl("_tree_attention_mla_sm90_dev", &eagle3::tree_attention_mla_sm90_dev_cuda);
#endif
}
