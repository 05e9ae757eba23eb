// Thin torch binding for the bias + GELU kernels in activations_cuda.cu: checks,
// allocation, stream. The row launchers of kernelforge/cuda/activations.py call it.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "activations_cuda.h"

namespace {

namespace ka = kernelforge::cuda_activations;

using OptTensor = std::optional<at::Tensor>;

ka::DType kernel_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return ka::DType::kFloat32;
    case at::kHalf: return ka::DType::kFloat16;
    case at::kBFloat16: return ka::DType::kBFloat16;
    default: break;
  }
  TORCH_CHECK(false, "kernelforge bias_gelu: ", name, " must be float32, float16 or bfloat16, got ",
              t.scalar_type());
  return ka::DType::kFloat32;  // unreachable
}

// Numbers in messages go through std::to_string: some environments (mixed libstdc++ builds)
// crash when an extension streams integers into an ostream.
std::string list(at::IntArrayRef values) {
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) s += (i ? ", " : "") + std::to_string(values[i]);
  return s + "]";
}

// Checks a 2-D CUDA row-matrix argument shaped like x; returns its row stride in elements.
int64_t check_rows(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.is_cuda(), "kernelforge bias_gelu: ", name, " must be a CUDA tensor, got device ",
              t.device().str());
  TORCH_CHECK(t.dim() == 2, "kernelforge bias_gelu: ", name, " must be 2-D (rows, cols), got ",
              std::to_string(t.dim()), "-D with shape ", list(t.sizes()));
  TORCH_CHECK(t.sizes() == x.sizes(), "kernelforge bias_gelu: ", name, " must have the shape of x, ",
              list(x.sizes()), ", got ", list(t.sizes()));
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "kernelforge bias_gelu: ", name, " must have dtype ",
              x.scalar_type(), " like x, got ", t.scalar_type());
  TORCH_CHECK(t.device() == x.device(), "kernelforge bias_gelu: ", name, " must be on ", x.device().str(),
              " like x, got ", t.device().str());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "kernelforge bias_gelu: ", name,
              " must have unit column stride (stride(1) == 1), got strides ", list(t.strides()));
  TORCH_CHECK(t.size(1) <= ka::kMaxCols, "kernelforge bias_gelu: ", name, " rows must have at most ",
              std::to_string(ka::kMaxCols), " columns, got ", std::to_string(t.size(1)));
  // Inputs are only read, so rows may overlap (stride 0 = broadcast row). The stride of a
  // single row is meaningless; report the dense one so it does not defeat vectorization.
  TORCH_CHECK(t.stride(0) >= 0, "kernelforge bias_gelu: ", name, " must have a non-negative row stride, got ",
              std::to_string(t.stride(0)));
  return t.size(0) <= 1 ? t.size(1) : t.stride(0);
}

void check_bias(const OptTensor& bias, const at::Tensor& x) {
  if (!bias.has_value()) return;
  const at::Tensor& b = *bias;
  TORCH_CHECK(b.device() == x.device(), "kernelforge bias_gelu: bias must be on ", x.device().str(),
              " like x, got ", b.device().str());
  TORCH_CHECK(b.dim() == 1 && b.size(0) == x.size(1), "kernelforge bias_gelu: bias must have shape [",
              std::to_string(x.size(1)), "] (one value per column), got ", list(b.sizes()));
  TORCH_CHECK(b.is_contiguous(), "kernelforge bias_gelu: bias must be contiguous, got strides ",
              list(b.strides()));
  kernel_dtype(b, "bias");
}

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "kernelforge bias_gelu CUDA kernel failed: ", cudaGetErrorString(err));
}

ka::BiasGeluArgs common_args(const at::Tensor& x, int64_t x_row_stride, const OptTensor& bias, bool tanh_form) {
  ka::BiasGeluArgs a;
  a.x = x.data_ptr();
  a.x_row_stride = x_row_stride;
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.bias_dtype = bias.has_value() ? kernel_dtype(*bias, "bias") : ka::DType::kFloat32;
  a.rows = x.size(0);
  a.cols = x.size(1);
  a.dtype = kernel_dtype(x, "x");
  a.tanh_form = tanh_form;
  return a;
}

at::Tensor forward(const at::Tensor& x, const OptTensor& bias, bool tanh_form) {
  const int64_t x_row_stride = check_rows(x, "x", x);
  kernel_dtype(x, "x");
  check_bias(bias, x);
  const at::cuda::OptionalCUDAGuard guard(device_of(x));
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  if (y.numel() == 0) return y;
  ka::BiasGeluArgs a = common_args(x, x_row_stride, bias, tanh_form);
  a.out = y.data_ptr();
  check_launch(ka::bias_gelu_forward(a, at::cuda::getCurrentCUDAStream()));
  return y;
}

// (grad_x, grad_bias or None); grad_bias has the bias's dtype, from the unrounded grad_x.
std::tuple<at::Tensor, OptTensor> backward(const at::Tensor& grad_y, const at::Tensor& x, const OptTensor& bias,
                                           bool tanh_form, bool need_bias_grad) {
  const int64_t x_row_stride = check_rows(x, "x", x);
  kernel_dtype(x, "x");
  const int64_t gy_row_stride = check_rows(grad_y, "grad_y", x);
  check_bias(bias, x);
  const at::cuda::OptionalCUDAGuard guard(device_of(x));
  at::Tensor grad_x = at::empty({x.size(0), x.size(1)}, x.options());
  OptTensor grad_bias;
  if (need_bias_grad && bias.has_value()) grad_bias = at::empty({x.size(1)}, bias->options());
  if (grad_x.numel() == 0) {  // a sum over no rows is 0
    if (grad_bias.has_value()) grad_bias->zero_();
    return {grad_x, grad_bias};
  }
  ka::BiasGeluArgs a = common_args(x, x_row_stride, bias, tanh_form);
  a.grad_y = grad_y.data_ptr();
  a.grad_y_row_stride = gy_row_stride;
  a.out = grad_x.data_ptr();
  a.grad_bias = grad_bias.has_value() ? grad_bias->data_ptr() : nullptr;
  a.grad_bias_dtype = a.bias_dtype;
  // The workspace size depends on the pointers above (they decide the vector width).
  const size_t ws_bytes = ka::bias_gelu_backward_workspace_bytes(a);
  at::Tensor workspace = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  a.workspace = ws_bytes ? workspace.data_ptr() : nullptr;
  a.workspace_bytes = ws_bytes;
  check_launch(ka::bias_gelu_backward(a, at::cuda::getCurrentCUDAStream()));
  return {grad_x, grad_bias};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelforge bias + GELU (erf or tanh form) CUDA kernels over the rows of a 2-D tensor";
  m.def("forward", &forward, "y = gelu(x + bias) (tanh form if tanh_form); y is a new dense tensor",
        pybind11::arg("x"), pybind11::arg("bias"), pybind11::arg("tanh_form"));
  m.def("backward", &backward,
        "(grad_x, grad_bias or None): grad_x = grad_y * gelu'(x + bias), grad_bias = its column sums "
        "(deterministic), when need_bias_grad and a bias is given",
        pybind11::arg("grad_y"), pybind11::arg("x"), pybind11::arg("bias"), pybind11::arg("tanh_form"),
        pybind11::arg("need_bias_grad"));
}
