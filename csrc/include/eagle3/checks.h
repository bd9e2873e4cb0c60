// Host-side argument checks shared by every launcher. Shape, device and layout errors raise ValueError,
// dtype errors TypeError (as the Python references do). Each failure names the argument and what was
// expected, so a caller reads "tree_mask must have shape (B, N, W) = (8, 16, 1), got [8, 16, 2]".
#pragma once

#include <torch/types.h>

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
