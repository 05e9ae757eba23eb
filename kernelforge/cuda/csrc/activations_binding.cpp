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
#include "binding_common.h"

namespace {

namespace ka = kernelforge::cuda_activations;
using namespace kernelforge::binding;

constexpr const char* kOp = "bias_gelu";

int64_t check_rows(const at::Tensor& t, const char* name, const at::Tensor& x) {
  return check_rows_like(t, kOp, name, x, "x", ka::kMaxCols);
}

ka::BiasGeluArgs common_args(const at::Tensor& x, int64_t x_row_stride, const OptTensor& bias, bool tanh_form) {
  ka::BiasGeluArgs a;
  a.x = x.data_ptr();
  a.x_row_stride = x_row_stride;
  a.bias = ptr_or_null(bias);
  a.bias_dtype = dtype_or_f32(bias, kOp, "bias");
  a.rows = x.size(0);
  a.cols = x.size(1);
  a.dtype = kernel_dtype(x, kOp, "x");
  a.tanh_form = tanh_form;
  return a;
}

at::Tensor forward(const at::Tensor& x, const OptTensor& bias, bool tanh_form) {
  const int64_t x_row_stride = check_rows(x, "x", x);
  kernel_dtype(x, kOp, "x");
  check_column_vector(bias, kOp, "bias", x);
  const at::cuda::OptionalCUDAGuard guard(device_of(x));
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  if (y.numel() == 0) return y;
  ka::BiasGeluArgs a = common_args(x, x_row_stride, bias, tanh_form);
  a.out = y.data_ptr();
  check_launch(ka::bias_gelu_forward(a, at::cuda::getCurrentCUDAStream()), kOp);
  return y;
}

// (grad_x, grad_bias or None); grad_bias has the bias's dtype, from the unrounded grad_x.
std::tuple<at::Tensor, OptTensor> backward(const at::Tensor& grad_y, const at::Tensor& x, const OptTensor& bias,
                                           bool tanh_form, bool need_bias_grad) {
  const int64_t x_row_stride = check_rows(x, "x", x);
  kernel_dtype(x, kOp, "x");
  const int64_t gy_row_stride = check_rows(grad_y, "grad_y", x);
  check_column_vector(bias, kOp, "bias", x);
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
  check_launch(ka::bias_gelu_backward(a, at::cuda::getCurrentCUDAStream()), kOp);
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
