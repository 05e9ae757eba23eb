// Thin torch binding for the layer-norm / RMS-norm kernels in norms_forward.cu and
// norms_backward.cu: checks, allocation, stream. The row launchers of
// kernelforge/cuda/norms.py call it.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "binding_common.h"
#include "norms_cuda.h"

namespace {

namespace kn = kernelforge::cuda_norms;
using namespace kernelforge::binding;

constexpr const char* kOp = "norms";

int64_t check_rows(const at::Tensor& t, const char* name, const at::Tensor& rows) {
  return check_rows_like(t, kOp, name, rows, "the rows", kn::kMaxCols);
}

// Checks a (rows,) float32 statistics vector (mean / rstd from the forward).
void check_stats(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.device() == x.device(), "kernelforge norms: ", name, " must be on ", x.device().str(), ", got ",
              t.device().str());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "kernelforge norms: ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(0), "kernelforge norms: ", name, " must have shape [",
              std::to_string(x.size(0)), "] (one value per row), got ", list(t.sizes()));
  TORCH_CHECK(t.is_contiguous(), "kernelforge norms: ", name, " must be contiguous, got strides ",
              list(t.strides()));
}

// (y, residual_out or None, mean or None, rstd).
std::tuple<at::Tensor, OptTensor, OptTensor, at::Tensor> forward(const at::Tensor& x, const OptTensor& residual,
                                                                 const OptTensor& weight, const OptTensor& bias,
                                                                 double eps, bool rms, double offset) {
  const int64_t x_row_stride = check_rows(x, "x", x);
  const kernelforge::DType dtype = kernel_dtype(x, kOp, "x");
  const int64_t res_row_stride = residual.has_value() ? check_rows(*residual, "residual", x) : 0;
  check_column_vector(weight, kOp, "weight", x);
  check_column_vector(bias, kOp, "bias", x);
  const at::cuda::OptionalCUDAGuard guard(device_of(x));
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor y = at::empty({rows, cols}, x.options());
  OptTensor residual_out;
  if (residual.has_value()) residual_out = at::empty({rows, cols}, x.options());
  const auto stats_options = x.options().dtype(at::kFloat);
  OptTensor mean;
  if (!rms) mean = at::empty({rows}, stats_options);
  at::Tensor rstd = at::empty({rows}, stats_options);
  if (rows == 0) return {y, residual_out, mean, rstd};
  if (cols == 0) {  // statistics of empty rows: NaN, as torch.mean of nothing
    if (mean.has_value()) mean->fill_(std::numeric_limits<float>::quiet_NaN());
    rstd.fill_(std::numeric_limits<float>::quiet_NaN());
    return {y, residual_out, mean, rstd};
  }
  kn::NormForwardArgs a;
  a.x = x.data_ptr();
  a.x_row_stride = x_row_stride;
  a.residual = ptr_or_null(residual);
  a.residual_row_stride = res_row_stride;
  a.weight = ptr_or_null(weight);
  a.weight_dtype = dtype_or_f32(weight, kOp, "weight");
  a.bias = ptr_or_null(bias);
  a.bias_dtype = dtype_or_f32(bias, kOp, "bias");
  a.y = y.data_ptr();
  a.residual_out = residual_out.has_value() ? residual_out->data_ptr() : nullptr;
  a.mean = mean.has_value() ? mean->data_ptr<float>() : nullptr;
  a.rstd = rstd.data_ptr<float>();
  a.rows = rows;
  a.cols = cols;
  a.dtype = dtype;
  a.eps = static_cast<float>(eps);
  a.offset = static_cast<float>(offset);
  a.rms = rms;
  check_launch(kn::norm_forward(a, at::cuda::getCurrentCUDAStream()), kOp);
  return {y, residual_out, mean, rstd};
}

// (grad_h, grad_weight or None, grad_bias or None). grad_weight has the weight's dtype;
// grad_bias is float32 (the bias is not passed; the caller casts it to the bias's dtype).
std::tuple<at::Tensor, OptTensor, OptTensor> backward(const at::Tensor& grad_y, const OptTensor& grad_residual,
                                                      const at::Tensor& h, const OptTensor& weight,
                                                      bool bias_present, const OptTensor& mean,
                                                      const at::Tensor& rstd, bool rms, double offset,
                                                      bool need_weight_grad) {
  const int64_t h_row_stride = check_rows(h, "h", h);
  const kernelforge::DType dtype = kernel_dtype(h, kOp, "h");
  const int64_t gy_row_stride = check_rows(grad_y, "grad_y", h);
  const int64_t gres_row_stride = grad_residual.has_value() ? check_rows(*grad_residual, "grad_residual", h) : 0;
  check_column_vector(weight, kOp, "weight", h);
  check_stats(rstd, "rstd", h);
  TORCH_CHECK(rms || mean.has_value(), "kernelforge norms: layer norm backward needs the forward's mean");
  if (!rms) check_stats(*mean, "mean", h);
  const at::cuda::OptionalCUDAGuard guard(device_of(h));
  const int64_t rows = h.size(0), cols = h.size(1);
  at::Tensor grad_h = at::empty({rows, cols}, h.options());
  OptTensor grad_weight, grad_bias;
  if (need_weight_grad && weight.has_value()) grad_weight = at::empty({cols}, weight->options());
  if (need_weight_grad && bias_present) grad_bias = at::empty({cols}, h.options().dtype(at::kFloat));
  if (rows == 0 || cols == 0) {  // sums over no rows are 0
    if (grad_weight.has_value()) grad_weight->zero_();
    if (grad_bias.has_value()) grad_bias->zero_();
    return {grad_h, grad_weight, grad_bias};
  }
  const size_t ws_bytes =
      kn::norm_backward_workspace_bytes(rows, cols, grad_weight.has_value(), grad_bias.has_value());
  at::Tensor workspace = at::empty({static_cast<int64_t>(ws_bytes)}, h.options().dtype(at::kByte));
  kn::NormBackwardArgs a;
  a.grad_y = grad_y.data_ptr();
  a.grad_y_row_stride = gy_row_stride;
  a.grad_residual = ptr_or_null(grad_residual);
  a.grad_residual_row_stride = gres_row_stride;
  a.h = h.data_ptr();
  a.h_row_stride = h_row_stride;
  a.weight = ptr_or_null(weight);
  a.weight_dtype = dtype_or_f32(weight, kOp, "weight");
  a.mean = rms ? nullptr : mean->data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.grad_h = grad_h.data_ptr();
  a.grad_weight = grad_weight.has_value() ? grad_weight->data_ptr() : nullptr;
  a.grad_weight_dtype = a.weight_dtype;
  a.grad_bias = grad_bias.has_value() ? grad_bias->data_ptr() : nullptr;
  a.grad_bias_dtype = kernelforge::DType::kFloat32;
  a.workspace = ws_bytes ? workspace.data_ptr() : nullptr;
  a.workspace_bytes = ws_bytes;
  a.rows = rows;
  a.cols = cols;
  a.dtype = dtype;
  a.offset = static_cast<float>(offset);
  a.rms = rms;
  check_launch(kn::norm_backward(a, at::cuda::getCurrentCUDAStream()), kOp);
  return {grad_h, grad_weight, grad_bias};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelforge layer norm / RMS norm CUDA kernels over the rows of a 2-D tensor";
  m.def("forward", &forward,
        "(y, residual_out or None, mean or None, rstd): the norm of h = x (+ residual, rounded to x's dtype) "
        "over dim 1; new dense tensors",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("eps"), pybind11::arg("rms"), pybind11::arg("offset"));
  m.def("backward", &backward,
        "(grad_h, grad_weight or None, grad_bias or None (float32)) from grad_y (+ grad_residual), h and the "
        "forward's statistics; weight and bias gradients reduced deterministically",
        pybind11::arg("grad_y"), pybind11::arg("grad_residual"), pybind11::arg("h"), pybind11::arg("weight"),
        pybind11::arg("bias_present"), pybind11::arg("mean"), pybind11::arg("rstd"), pybind11::arg("rms"),
        pybind11::arg("offset"), pybind11::arg("need_weight_grad"));
}
