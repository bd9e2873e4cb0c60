// Host-side checks of the vLLM RejectionSampler ops (torch.ops.eagle3._vllm_rejection_greedy / _sampling,
// csrc/verify_greedy.cu / verify_sampling.cu), worded as eagle3_ops/_validate.py's tensor() words them for
// eagle3_ops.compat.vllm's CPU path, with vLLM's field names: "metadata.draft_token_ids must have shape
// (num_tokens) = (5), got (4,)". Messages are formatted only on failure.
#pragma once

#include <torch/types.h>

#include <sstream>
#include <string>

namespace eagle3 {
namespace vllm {

inline const char* dtype_name(at::ScalarType t) {  // torch's Python names, as _validate prints them
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

inline std::string py_shape(const at::Tensor& t) {  // Python's tuple(t.shape)
  std::ostringstream s;
  s << "(";
  for (int64_t i = 0; i < t.dim(); ++i) s << (i ? ", " : "") << t.size(i);
  s << (t.dim() == 1 ? ",)" : ")");
  return s.str();
}

inline bool is_index(const at::Tensor& t) { return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong; }
inline bool is_float(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kBFloat16 || s == at::kHalf || s == at::kFloat || s == at::kDouble;
}

inline void index_dtype(const at::Tensor& t, const char* name) {
  if (!is_index(t)) TORCH_CHECK_TYPE(false, name, " must have dtype int32 | int64, got ", dtype_name(t.scalar_type()));
}

inline void float_dtype(const at::Tensor& t, const char* name) {
  if (!is_float(t)) {
    TORCH_CHECK_TYPE(false, name, " must have dtype bfloat16 | float16 | float32 | float64, got ",
                     dtype_name(t.scalar_type()));
  }
}

// [n] of `sym` = n; len < 0: any length (then the message says "must have 1 dimensions")
inline void shape1(const at::Tensor& t, const char* name, const char* sym, int64_t n) {
  if (t.dim() != 1 || t.size(0) != n) {
    TORCH_CHECK_VALUE(false, name, " must have shape (", sym, ") = (", n, "), got ", py_shape(t));
  }
}

inline void same_device(const at::Tensor& t, const char* name, const at::Tensor& logits) {
  if (t.device() != logits.device()) {
    TORCH_CHECK_VALUE(false, name, " must be on the same device as logits (", logits.device(), "), got ", t.device());
  }
}

inline void contiguous(const at::Tensor& t, const char* name) {
  if (!t.is_contiguous()) {
    TORCH_CHECK_VALUE(false, name, " must be contiguous, got strides ", t.strides(), " for shape ", py_shape(t));
  }
}

// logits [rows, V] float, on CUDA, last dim contiguous
inline void logits2d(const at::Tensor& logits) {
  float_dtype(logits, "logits");
  if (logits.dim() != 2) TORCH_CHECK_VALUE(false, "logits must have 2 dimensions, got shape ", py_shape(logits));
  TORCH_CHECK_VALUE(logits.is_cuda(), "logits must be a CUDA tensor, got one on ", logits.device());
  if (logits.size(1) > 1 && logits.stride(1) != 1) {
    TORCH_CHECK_VALUE(false, "logits must be contiguous in its last dimension, got strides ", logits.strides());
  }
  TORCH_CHECK_VALUE(logits.size(1) >= 1, "logits must have vocab_size >= 1");
  TORCH_CHECK_VALUE(logits.size(1) < (int64_t{1} << 31), "logits must have vocab_size < 2**31, got ", logits.size(1));
}

// The layout every op of vLLM's rejection sampler shares: returns the number of bonus rows to read (B, or 0 when
// the sampler's bonus tokens are given).
//   draft_token_ids        [num_tokens] int32 | int64, contiguous, on logits' device
//   cu_num_draft_tokens    [batch_size] int32 | int64, contiguous, on logits' device
//   target_logits_indices  [num_tokens] int32 | int64, contiguous, on logits' device
//   bonus_logits_indices   [batch_size] (or [0] with bonus_token_ids) int32 | int64, contiguous, on logits' device
//   bonus_token_ids        [batch_size] or [batch_size, 1] int32 | int64 (the sampler's), optional
inline int64_t layout(const at::Tensor& logits, const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
                      const at::Tensor& target_logits_indices, const at::Tensor& bonus_logits_indices,
                      const std::optional<at::Tensor>& bonus_token_ids, int64_t B, int64_t T, int64_t K) {
  logits2d(logits);
  TORCH_CHECK_VALUE(B >= 1, "batch_size must be >= 1, got ", B);
  TORCH_CHECK_VALUE(T >= 0 && K >= 0 && K <= 128, "max_spec_len must be in [0, 128] and num_tokens >= 0, got ", K,
                    " and ", T);
  struct Idx {
    const at::Tensor& t;
    const char* name;
    const char* sym;
    int64_t n;
  };
  // with the sampler's bonus tokens the bonus rows are never read: [0] or [batch_size] indices, either way unread
  const bool no_bonus_rows = bonus_logits_indices.dim() == 1 && bonus_logits_indices.size(0) == 0 && bonus_token_ids;
  const int64_t nb = bonus_token_ids ? 0 : B;
  for (const Idx& x : {Idx{draft_token_ids, "metadata.draft_token_ids", "num_tokens", T},
                       Idx{cu_num_draft_tokens, "metadata.cu_num_draft_tokens", "batch_size", B},
                       Idx{target_logits_indices, "metadata.target_logits_indices", "num_tokens", T},
                       Idx{bonus_logits_indices, "metadata.bonus_logits_indices", "batch_size", no_bonus_rows ? 0 : B}}) {
    index_dtype(x.t, x.name);
    shape1(x.t, x.name, x.sym, x.n);
    same_device(x.t, x.name, logits);
    contiguous(x.t, x.name);
  }
  if (bonus_token_ids) {
    const at::Tensor& b = *bonus_token_ids;
    index_dtype(b, "sampler(...).sampled_token_ids");
    same_device(b, "sampler(...).sampled_token_ids", logits);
    if (b.numel() != B || b.dim() < 1 || b.dim() > 2 || b.size(0) != B) {
      TORCH_CHECK_VALUE(false, "sampler(...).sampled_token_ids must have batch_size = ", B, " entries, got shape ",
                        py_shape(b));
    }
    contiguous(b, "sampler(...).sampled_token_ids");
  }
  TORCH_CHECK_VALUE(logits.size(0) < (int64_t{1} << 31), "logits must have < 2**31 rows, got ", logits.size(0));
  return nb;
}

}  // namespace vllm
}  // namespace eagle3
