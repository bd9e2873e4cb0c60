// Host checks of eagle3_ops.compat.sglang's C++ ops. Each of its five functions runs on CUDA tensors as ONE op
// with its checks in C++, so that an eager call (SGLang's EAGLE worker calls these outside its CUDA graphs) costs
// one dispatch and one or two launches instead of Python-side validation and Triton launches:
//
//   _sglang_build_tree          build_tree_kernel_efficient            csrc/compat_sglang_build.cu
//   _sglang_verify_greedy       verify_tree_greedy                     csrc/compat_sglang_walk.cu
//   _sglang_verify_sampling     tree_speculative_sampling_target_only  csrc/compat_sglang_walk.cu
//   _sglang_segment_packbits    segment_packbits                       csrc/compat_sglang_pack.cu
//   _sglang_reconstruct_indices reconstruct_indices_from_tree_mask     csrc/compat_sglang_pack.cu
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
//
// This header: every op's host checks (C++ only, no CUDA header: they compile and can be tried without a GPU).
// eagle3/compat_sglang.cuh adds what the three files' kernels and launchers share.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>

namespace eagle3 {
namespace sglang {

// ---- host checks, worded as eagle3_ops/_validate.tensor and compat.sglang's _numel ---------------------------

inline std::string py_tuple(c10::IntArrayRef v) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << (v.size() == 1 ? ",)" : ")");
  return s.str();
}

inline std::string py_dtype(at::ScalarType t) {
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
inline void check_arg(const at::Tensor& t, const char* name, std::initializer_list<at::ScalarType> dtypes,
                      const char* dtype_names, const at::Tensor& like, std::initializer_list<Dim> shape = {},
                      int64_t dim = -1) {
  bool dtype_ok = false;
  for (at::ScalarType d : dtypes) dtype_ok = dtype_ok || t.scalar_type() == d;
  TORCH_CHECK_TYPE(dtype_ok, name, " must have dtype ", dtype_names, ", got ", py_dtype(t.scalar_type()));
  if (shape.size() > 0) {
    bool ok = t.dim() == static_cast<int64_t>(shape.size());
    int64_t i = 0;
    for (const Dim& d : shape) ok = ok && t.size(i++) == d.size;
    if (C10_UNLIKELY(!ok)) {  // the message is formatted only here: an eager call's checks cost compares
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
inline void check_numel(const at::Tensor& t, const char* name, int64_t n, const char* what,
                        std::initializer_list<std::initializer_list<int64_t>> shapes = {}) {
  bool ok = t.numel() == n;
  if (shapes.size() > 0) {
    bool any = false;
    for (const auto& s : shapes) any = any || t.sizes().equals(c10::IntArrayRef(s));
    ok = ok && any;
  }
  if (C10_UNLIKELY(!ok)) {
    std::ostringstream allowed;
    int k = 0;
    for (const auto& s : shapes) allowed << (k++ ? " or " : "") << py_tuple(c10::IntArrayRef(s));
    if (shapes.size() == 0) allowed << n << " elements";
    TORCH_CHECK_VALUE(false, name, " must have ", what, " = ", n, " elements (", allowed.str(), "), got shape ",
                      py_tuple(t.sizes()));
  }
}

// build_tree_kernel_efficient's checks. Returns the packed mask's bytes per row (0 for the bool modes).
inline int check_build(const at::Tensor& parent_list, const at::Tensor& selected_index,
                       const at::Tensor& verified_seq_len, const at::Tensor& tree_mask, const at::Tensor& positions,
                       const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                       const at::Tensor& retrive_next_sibling, int64_t topk, int64_t depth, int64_t draft_token_num,
                       int64_t tree_mask_mode) {
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
inline int64_t check_walk_args(const at::Tensor& predicts, const at::Tensor& accept_index,
                               const at::Tensor& accept_token_num, const at::Tensor& candidates,
                               const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                               const at::Tensor& retrive_next_sibling) {
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
inline int64_t check_greedy(const at::Tensor& predicts, const at::Tensor& accept_index,
                            const at::Tensor& accept_token_num, const at::Tensor& candidates,
                            const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                            const at::Tensor& retrive_next_sibling, const at::Tensor& target_predict) {
  const int64_t S = check_walk_args(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                    retrive_next_token, retrive_next_sibling);
  const int64_t B = candidates.size(0), N = candidates.size(1);
  check_arg(target_predict, "target_predict", {at::kLong}, "int64", candidates, {{"B", B}, {"N", N}});
  return S;
}

// tree_speculative_sampling_target_only's checks. Returns S.
inline int64_t check_sampling(const at::Tensor& predicts, const at::Tensor& accept_index,
                              const at::Tensor& accept_token_num, const at::Tensor& candidates,
                              const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                              const at::Tensor& retrive_next_sibling, const at::Tensor& uniform_samples,
                              const at::Tensor& uniform_samples_for_final_sampling, const at::Tensor& target_probs,
                              const std::optional<at::Tensor>& draft_probs) {
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
inline void check_packbits(const at::Tensor& x, const at::Tensor& input_indptr, const at::Tensor& output_indptr,
                           const at::Tensor& y, int64_t batch_size) {
  const int64_t n = batch_size;
  check_arg(x, "x", {at::kBool}, "bool", x, {}, 1);
  check_arg(input_indptr, "input_indptr", {at::kInt}, "int32", x, {{"batch_size + 1", n + 1}});
  check_arg(output_indptr, "output_indptr", {at::kInt}, "int32", x, {{"batch_size + 1", n + 1}});
  check_arg(y, "y", {at::kByte}, "uint8", x, {}, 1);
}

// reconstruct_indices_from_tree_mask's checks.
inline void check_reconstruct(const at::Tensor& tree_mask, const at::Tensor& verified_seq_len,
                              const at::Tensor& positions, const at::Tensor& retrive_index,
                              const at::Tensor& retrive_next_token, const at::Tensor& retrive_next_sibling,
                              int64_t batch_size, int64_t draft_token_num) {
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

}  // namespace sglang
}  // namespace eagle3
