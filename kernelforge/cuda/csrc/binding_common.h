// What every torch binding of a row kernel checks and converts: the dtype code, shapes in
// messages, the row layout the kernels take, (cols,) parameter vectors and launch errors.
// Each message names the op ("kernelforge <op>: ..."), the argument, what was expected and
// what came.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>

#include <cuda_runtime.h>

#include "dtype.h"

namespace kernelforge {
namespace binding {

using OptTensor = std::optional<at::Tensor>;

inline DType kernel_dtype(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: break;
  }
  TORCH_CHECK(false, "kernelforge ", op, ": ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  return DType::kFloat32;  // unreachable
}

inline DType dtype_or_f32(const OptTensor& t, const char* op, const char* name) {
  return t.has_value() ? kernel_dtype(*t, op, name) : DType::kFloat32;
}

inline const void* ptr_or_null(const OptTensor& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// Numbers in messages go through std::to_string: some environments (mixed libstdc++ builds)
// crash when an extension streams integers into an ostream.
inline std::string list(at::IntArrayRef values) {
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) s += (i ? ", " : "") + std::to_string(values[i]);
  return s + "]";
}

// The layout a row kernel takes: a 2-D CUDA tensor with unit column stride, at most
// max_cols columns and a non-negative row stride. Returns the row stride in elements.
inline int64_t check_row_layout(const at::Tensor& t, const char* op, const char* name, int64_t max_cols) {
  TORCH_CHECK(t.is_cuda(), "kernelforge ", op, ": ", name, " must be a CUDA tensor, got device ", t.device().str());
  TORCH_CHECK(t.dim() == 2, "kernelforge ", op, ": ", name, " must be 2-D (rows, cols), got ", std::to_string(t.dim()),
              "-D with shape ", list(t.sizes()));
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "kernelforge ", op, ": ", name,
              " must have unit column stride (stride(1) == 1), got strides ", list(t.strides()));
  TORCH_CHECK(t.size(1) <= max_cols, "kernelforge ", op, ": ", name, " rows must have at most ",
              std::to_string(max_cols), " columns, got ", std::to_string(t.size(1)));
  // Inputs are only read, so rows may overlap (stride 0 = broadcast row). The stride of a
  // single row is meaningless; report the dense one so it does not defeat vectorization.
  TORCH_CHECK(t.stride(0) >= 0, "kernelforge ", op, ": ", name, " must have a non-negative row stride, got ",
              std::to_string(t.stride(0)));
  return t.size(0) <= 1 ? t.size(1) : t.stride(0);
}

// check_row_layout, and the shape, dtype and device of `like` (named like_name).
inline int64_t check_rows_like(const at::Tensor& t, const char* op, const char* name, const at::Tensor& like,
                               const char* like_name, int64_t max_cols) {
  TORCH_CHECK(t.sizes() == like.sizes(), "kernelforge ", op, ": ", name, " must have the shape of ", like_name, ", ",
              list(like.sizes()), ", got ", list(t.sizes()));
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "kernelforge ", op, ": ", name, " must have dtype ",
              like.scalar_type(), " like ", like_name, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == like.device(), "kernelforge ", op, ": ", name, " must be on ", like.device().str(),
              " like ", like_name, ", got ", t.device().str());
  return check_row_layout(t, op, name, max_cols);
}

// An optional dense (cols,) vector of any float dtype on x's device (a weight or a bias).
inline void check_column_vector(const OptTensor& p, const char* op, const char* name, const at::Tensor& x) {
  if (!p.has_value()) return;
  const at::Tensor& t = *p;
  TORCH_CHECK(t.device() == x.device(), "kernelforge ", op, ": ", name, " must be on ", x.device().str(),
              " like the rows, got ", t.device().str());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(1), "kernelforge ", op, ": ", name, " must have shape [",
              std::to_string(x.size(1)), "] (one value per column), got ", list(t.sizes()));
  TORCH_CHECK(t.is_contiguous(), "kernelforge ", op, ": ", name, " must be contiguous, got strides ",
              list(t.strides()));
  kernel_dtype(t, op, name);
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "kernelforge ", op, " CUDA kernel failed: ", cudaGetErrorString(err));
}

}  // namespace binding
}  // namespace kernelforge
