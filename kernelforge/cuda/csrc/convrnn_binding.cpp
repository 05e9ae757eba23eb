// The ConvRNN kernels (convrnn_cuda.cu) registered with PyTorch's dispatcher from C++: CUDA
// implementations of two operators whose schemas kernelforge/ops/convrnn.py defines once (with
// their fake implementations), the pattern of pytorch/extension-cpp:
//   kernelforge::convrnn_cuda_forward(Tensor x, Tensor kernel, Tensor hidden) -> (Tensor, Tensor)
//   kernelforge::convrnn_cuda_backward(Tensor grad_out, Tensor grad_h, Tensor kernel, Tensor hidden,
//                                      Tensor out) -> (Tensor, Tensor, Tensor)
// Loading this library runs the TORCH_LIBRARY_IMPL block; nothing is called through pybind.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <string>
#include <tuple>

#include "binding_common.h"
#include "convrnn_cuda.h"

namespace {

namespace kc = kernelforge::cuda_convrnn;
using namespace kernelforge::binding;

constexpr const char* kOp = "convrnn";

void check_rows(const at::Tensor& t, const char* name, int64_t dims, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), "kernelforge ", kOp, ": ", name, " must be a CUDA tensor, got device ", t.device().str());
  TORCH_CHECK(t.dim() == dims, "kernelforge ", kOp, ": ", name, " must be ", std::to_string(dims), "-D, got shape ",
              list(t.sizes()));
  TORCH_CHECK(t.device() == like.device(), "kernelforge ", kOp, ": ", name, " must be on ", like.device().str(),
              ", got ", t.device().str());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), "kernelforge ", kOp, ": ", name, " must have dtype ",
              like.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "kernelforge ", kOp, ": ", name,
              " must have unit feature stride, got strides ", list(t.strides()));
}

// What both directions need before a launch: the shape, checked against the kernels' limits, and the
// taps as a contiguous float32 vector on the rows' device (the kernels read them in float32).
struct Prepared {
  kc::ConvRnnShape shape;
  at::Tensor taps;
};

Prepared prepare(const at::Tensor& rows, const at::Tensor& kernel) {
  kc::ConvRnnShape s;
  s.batch = rows.size(0), s.time = rows.size(1), s.features = rows.size(2), s.taps = kernel.numel();
  TORCH_CHECK(s.features >= 0 && s.features <= kc::kMaxFeatures, "kernelforge ", kOp,
              ": the CUDA kernels take at most ", std::to_string(kc::kMaxFeatures), " features, got ",
              std::to_string(s.features));
  TORCH_CHECK(s.taps % 2 == 1 && s.taps <= kc::kMaxTaps, "kernelforge ", kOp, ": the CUDA kernels take an odd number",
              " of taps up to ", std::to_string(kc::kMaxTaps), ", got ", std::to_string(s.taps));
  return {s, kernel.reshape({-1}).to(rows.device(), at::kFloat).contiguous()};
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& kernel, const at::Tensor& hidden) {
  check_rows(x, "x", 3, x);
  check_rows(hidden, "hidden", 2, x);
  const at::cuda::OptionalCUDAGuard guard(device_of(x));
  const auto [s, w] = prepare(x, kernel);
  at::Tensor out = at::empty({s.batch, s.time, s.features}, x.options());
  at::Tensor h_last = at::empty({s.batch, s.features}, x.options());
  if (s.features == 0) return {out, h_last};  // nothing to compute (and no launch of an empty block)
  check_launch(kc::convrnn_forward(x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr<float>(), hidden.data_ptr(),
                                   hidden.stride(0), out.data_ptr(), h_last.data_ptr(), s, kernel_dtype(x, kOp, "x"),
                                   at::cuda::getCurrentCUDAStream()),
               kOp);
  return {out, h_last};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& grad_h,
                                                        const at::Tensor& kernel, const at::Tensor& hidden,
                                                        const at::Tensor& out_in) {
  const at::Tensor out = out_in.contiguous();
  check_rows(out, "out", 3, out);
  check_rows(grad_out, "grad_out", 3, out);
  check_rows(grad_h, "grad_h", 2, out);
  check_rows(hidden, "hidden", 2, out);
  const at::cuda::OptionalCUDAGuard guard(device_of(out));
  const auto [s, w] = prepare(out, kernel);
  at::Tensor dx = at::empty({s.batch, s.time, s.features}, out.options());
  at::Tensor dhidden = at::empty({s.batch, s.features}, out.options());
  at::Tensor dw_part = at::zeros({s.batch, s.taps}, out.options().dtype(at::kFloat));
  if (s.features == 0) return {dx, at::zeros_like(kernel), dhidden};  // no features: a zero kernel gradient
  check_launch(kc::convrnn_backward(grad_out.data_ptr(), grad_out.stride(0), grad_out.stride(1), grad_h.data_ptr(),
                                    grad_h.stride(0), w.data_ptr<float>(), hidden.data_ptr(), hidden.stride(0),
                                    out.data_ptr(), dx.data_ptr(), dhidden.data_ptr(), dw_part.data_ptr<float>(), s,
                                    kernel_dtype(out, kOp, "out"), at::cuda::getCurrentCUDAStream()),
               kOp);
  at::Tensor dkernel = dw_part.sum(0).reshape(kernel.sizes()).to(kernel.scalar_type());
  return {dx, dkernel, dhidden};
}

}  // namespace

TORCH_LIBRARY_IMPL(kernelforge, CUDA, m) {
  m.impl("convrnn_cuda_forward", &forward);
  m.impl("convrnn_cuda_backward", &backward);
}

// torch.utils.cpp_extension imports the built library as a Python module: it needs an init
// function, though every entry point goes through torch.ops.kernelforge.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelforge ConvRNN CUDA kernels, registered as torch.ops.kernelforge.convrnn_cuda_{forward,backward}";
}
