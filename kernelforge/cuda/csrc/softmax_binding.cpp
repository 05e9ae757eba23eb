// Thin torch binding for the softmax kernels in softmax_cuda.cu: checks, allocation, stream.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <string>

#include "softmax_cuda.h"

namespace {

namespace ks = kernelforge::cuda_softmax;

ks::DType kernel_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return ks::DType::kFloat32;
    case at::kHalf: return ks::DType::kFloat16;
    case at::kBFloat16: return ks::DType::kBFloat16;
    default: break;
  }
  TORCH_CHECK(false, "kernelforge softmax: ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  return ks::DType::kFloat32;  // unreachable
}

// Numbers in messages go through std::to_string: some environments (mixed libstdc++ builds)
// crash when an extension streams integers into an ostream.
std::string list(at::IntArrayRef values) {
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) s += (i ? ", " : "") + std::to_string(values[i]);
  return s + "]";
}

// Checks a 2-D CUDA row-matrix argument; returns its row stride in elements.
int64_t check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "kernelforge softmax: ", name, " must be a CUDA tensor, got device ", t.device().str());
  TORCH_CHECK(t.dim() == 2, "kernelforge softmax: ", name, " must be 2-D (rows, cols), got ", std::to_string(t.dim()),
              "-D with shape ", list(t.sizes()));
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "kernelforge softmax: ", name,
              " must have unit column stride (stride(1) == 1), got strides ", list(t.strides()));
  TORCH_CHECK(t.size(1) <= std::numeric_limits<int32_t>::max(), "kernelforge softmax: ", name,
              " rows must have fewer than 2^31 columns, got ", std::to_string(t.size(1)));
  // Rows may overlap (stride 0 = broadcast row): inputs are only read. The stride of a
  // single row is meaningless; report the dense one so it does not defeat vectorization.
  TORCH_CHECK(t.stride(0) >= 0, "kernelforge softmax: ", name, " must have a non-negative row stride, got ",
              std::to_string(t.stride(0)));
  return t.size(0) <= 1 ? t.size(1) : t.stride(0);
}

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "kernelforge softmax CUDA kernel failed: ", cudaGetErrorString(err));
}

at::Tensor forward(const at::Tensor& x, bool log) {
  const int64_t x_row_stride = check_rows(x, "x");
  const ks::DType dtype = kernel_dtype(x, "x");
  const at::cuda::OptionalCUDAGuard guard(device_of(x));
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  check_launch(ks::softmax_forward(x.data_ptr(), x_row_stride, y.data_ptr(), x.size(0), x.size(1), dtype, log,
                                   at::cuda::getCurrentCUDAStream()));
  return y;
}

at::Tensor backward(const at::Tensor& grad_out, const at::Tensor& out, bool log) {
  const int64_t go_row_stride = check_rows(grad_out, "grad_out");
  const int64_t out_row_stride = check_rows(out, "out");
  TORCH_CHECK(grad_out.sizes() == out.sizes(), "kernelforge softmax: grad_out and out must have the same shape, got ",
              list(grad_out.sizes()), " and ", list(out.sizes()));
  TORCH_CHECK(grad_out.scalar_type() == out.scalar_type(),
              "kernelforge softmax: grad_out and out must have the same dtype, got ", grad_out.scalar_type(), " and ",
              out.scalar_type());
  TORCH_CHECK(grad_out.device() == out.device(),
              "kernelforge softmax: grad_out and out must be on the same device, got ", grad_out.device().str(),
              " and ", out.device().str());
  const ks::DType dtype = kernel_dtype(out, "out");
  const at::cuda::OptionalCUDAGuard guard(device_of(out));
  at::Tensor grad_in = at::empty({out.size(0), out.size(1)}, out.options());
  check_launch(ks::softmax_backward(grad_out.data_ptr(), go_row_stride, out.data_ptr(), out_row_stride,
                                    grad_in.data_ptr(), out.size(0), out.size(1), dtype, log,
                                    at::cuda::getCurrentCUDAStream()));
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
