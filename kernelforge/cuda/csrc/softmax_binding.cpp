// Thin torch binding for the softmax kernels in softmax_cuda.cu: checks, allocation, stream.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <string>

#include "binding_common.h"
#include "softmax_cuda.h"

namespace {

namespace ks = kernelforge::cuda_softmax;
using namespace kernelforge::binding;

constexpr const char* kOp = "softmax";
constexpr int64_t kMaxCols = std::numeric_limits<int32_t>::max();  // the kernels index columns in int

at::Tensor forward(const at::Tensor& x, bool log) {
  const int64_t x_row_stride = check_row_layout(x, kOp, "x", kMaxCols);
  const kernelforge::DType dtype = kernel_dtype(x, kOp, "x");
  const at::cuda::OptionalCUDAGuard guard(device_of(x));
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  check_launch(ks::softmax_forward(x.data_ptr(), x_row_stride, y.data_ptr(), x.size(0), x.size(1), dtype, log,
                                   at::cuda::getCurrentCUDAStream()),
               kOp);
  return y;
}

at::Tensor backward(const at::Tensor& grad_out, const at::Tensor& out, bool log) {
  const int64_t out_row_stride = check_row_layout(out, kOp, "out", kMaxCols);
  const int64_t go_row_stride = check_rows_like(grad_out, kOp, "grad_out", out, "out", kMaxCols);
  const kernelforge::DType dtype = kernel_dtype(out, kOp, "out");
  const at::cuda::OptionalCUDAGuard guard(device_of(out));
  at::Tensor grad_in = at::empty({out.size(0), out.size(1)}, out.options());
  check_launch(ks::softmax_backward(grad_out.data_ptr(), go_row_stride, out.data_ptr(), out_row_stride,
                                    grad_in.data_ptr(), out.size(0), out.size(1), dtype, log,
                                    at::cuda::getCurrentCUDAStream()),
               kOp);
  return grad_in;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelforge softmax / log_softmax CUDA kernels over the rows of a 2-D tensor";
  m.def("forward", &forward, "y = softmax(x) (log_softmax if log) over dim 1; y is a new dense tensor",
        pybind11::arg("x"), pybind11::arg("log"));
  m.def("backward", &backward, "grad_in of softmax (log_softmax if log) from grad_out and the forward output",
        pybind11::arg("grad_out"), pybind11::arg("out"), pybind11::arg("log"));
}
