// Host-side argument checks shared by every launcher. Shape, device and layout errors raise ValueError,
// dtype errors TypeError (as the Python references do). Each failure names the argument and what was
// expected, so a caller reads "tree_mask must have shape (B, N, W) = (8, 16, 1), got [8, 16, 2]".
#pragma once

#include <torch/types.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace eagle3 {

inline std::string join_sizes(std::initializer_list<int64_t> sizes) {
  std::ostringstream s;
  s << "(";
  bool first = true;
  for (int64_t v : sizes) {
    s << (first ? "" : ", ") << v;
    first = false;
  }
  s << ")";
  return s.str();
}

}  // namespace eagle3

// CHECK_SHAPE(tree_mask, B, N, W) -> "tree_mask must have shape (B, N, W) = (8, 16, 1), got [8, 16, 2]"
namespace eagle3 {
inline void check_shape(const at::Tensor& t, const char* name, const char* dims, std::initializer_list<int64_t> want) {
  bool ok = t.dim() == static_cast<int64_t>(want.size());
  int64_t i = 0;
  for (int64_t w : want) {
    ok = ok && t.size(i++) == w;
    if (!ok) break;
  }
  TORCH_CHECK_VALUE(ok, name, " must have shape (", dims, ") = ", join_sizes(want), ", got ", t.sizes());
}
}  // namespace eagle3
#define CHECK_SHAPE(x, ...) ::eagle3::check_shape((x), #x, #__VA_ARGS__, {__VA_ARGS__})

#define CHECK_DIM(x, d) TORCH_CHECK_VALUE((x).dim() == (d), #x " must have ", d, " dimensions, got ", (x).dim(), \
                                    " (shape ", (x).sizes(), ")")

#define CHECK_CUDA(x) TORCH_CHECK_VALUE((x).is_cuda(), #x " must be a CUDA tensor, got one on ", (x).device())

#define CHECK_SAME_DEVICE(x, ref)                                                                  \
  TORCH_CHECK_VALUE((x).device() == (ref).device(), #x " must be on the same device as " #ref " (", (ref).device(), \
              "), got ", (x).device())

#define CHECK_DTYPE(x, dt) TORCH_CHECK_TYPE((x).scalar_type() == (dt), #x " must have dtype ", dt, ", got ", (x).scalar_type())

#define CHECK_LAST_DIM_CONTIGUOUS(x) \
  TORCH_CHECK_VALUE((x).stride(-1) == 1, #x " must be contiguous in its last dimension, got strides ", (x).strides())

namespace eagle3 {
// The capture buffer of capture_aux and add_rmsnorm_capture (as eagle3_ops/_validate.py:_aux_slot): aux
// [R, n_aux * H] in src's dtype, on src's device, last dim contiguous (a strided column view is fine),
// receives src [T, H] rows into column block `slot`; rows [R] int32 | int64 optional (R = T without it).
// Returns R.
inline int64_t check_aux_slot(const at::Tensor& aux, const at::Tensor& src, const char* src_name, int64_t slot,
                              const std::optional<at::Tensor>& rows) {
  const int64_t T = src.size(0), H = src.size(1);
  TORCH_CHECK_TYPE(aux.scalar_type() == src.scalar_type(), "aux must have dtype ", src.scalar_type(), " (", src_name,
                   "'s), got ", aux.scalar_type());
  TORCH_CHECK_VALUE(aux.dim() == 2, "aux must have 2 dimensions, got shape ", aux.sizes());
  TORCH_CHECK_VALUE(aux.device() == src.device(), "aux must be on the same device as ", src_name, " (", src.device(),
                    "), got ", aux.device());
  TORCH_CHECK_VALUE(aux.size(1) <= 1 || aux.stride(1) == 1, "aux must be contiguous in its last dimension, got strides ",
                    aux.strides());
  TORCH_CHECK_VALUE(H > 0 && aux.size(1) % H == 0, "aux must have shape (R, n_aux * H) with H = ", H, ", got ",
                    aux.sizes());
  const int64_t n_aux = aux.size(1) / H;
  TORCH_CHECK_VALUE(slot >= 0 && slot < n_aux, "slot must be in [0, n_aux) = [0, ", n_aux, "), got ", slot);
  int64_t R = T;
  if (rows) {
    const at::Tensor& r = *rows;
    TORCH_CHECK_TYPE(r.scalar_type() == at::kInt || r.scalar_type() == at::kLong,
                     "rows must have dtype int32 | int64, got ", r.scalar_type());
    TORCH_CHECK_VALUE(r.dim() == 1, "rows must have 1 dimensions, got shape ", r.sizes());
    TORCH_CHECK_VALUE(r.device() == src.device(), "rows must be on the same device as ", src_name, " (",
                      src.device(), "), got ", r.device());
    TORCH_CHECK_VALUE(r.is_contiguous(), "rows must be contiguous, got strides ", r.strides());
    R = r.size(0);
  }
  TORCH_CHECK_VALUE(aux.size(0) == R, "aux must have R = ", R, " rows (", rows ? "rows.shape[0]" : "T", "), got ",
                    aux.size(0));
  return R;
}
}  // namespace eagle3
