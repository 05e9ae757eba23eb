// my_op's CUDA kernels (my_op_cuda.cu) registered with PyTorch's dispatcher from C++: the CUDA
// implementations of two operators whose schemas and fake implementations
// kernelforge/ops/my_op.py defines (so they exist on machines that cannot build this):
//   kernelforge::my_op_cuda_forward(Tensor x) -> Tensor
//   kernelforge::my_op_cuda_backward(Tensor grad_y, Tensor x) -> Tensor
// Loading the library runs the TORCH_LIBRARY_IMPL block; nothing is called through pybind.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "binding_common.h"
#include "my_op_cuda.h"

namespace {

namespace km = kernelforge::cuda_my_op;
using namespace kernelforge::binding;

constexpr const char* kOp = "my_op";

void check_input(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), "kernelforge ", kOp, ": ", name, " must be a CUDA tensor, got device ", t.device().str());
  TORCH_CHECK(t.device() == like.device(), "kernelforge ", kOp, ": ", name, " must be on ", like.device().str(),
              ", got ", t.device().str());
  TORCH_CHECK(t.sizes() == like.sizes(), "kernelforge ", kOp, ": ", name, " must have shape ", list(like.sizes()),
              ", got ", list(t.sizes()));
  kernel_dtype(t, kOp, name);
}

at::Tensor forward(const at::Tensor& x_in) {
  check_input(x_in, "x", x_in);
  const at::Tensor x = x_in.contiguous();
  const at::cuda::OptionalCUDAGuard guard(device_of(x));
  at::Tensor y = at::empty_like(x);
  check_launch(km::my_op_forward(x.data_ptr(), y.data_ptr(), x.numel(), kernel_dtype(x, kOp, "x"),
                                 at::cuda::getCurrentCUDAStream()),
               kOp);
  return y;
}

at::Tensor backward(const at::Tensor& grad_y_in, const at::Tensor& x_in) {
  check_input(x_in, "x", x_in);
  check_input(grad_y_in, "grad_y", x_in);
  TORCH_CHECK(grad_y_in.scalar_type() == x_in.scalar_type(), "kernelforge ", kOp, ": grad_y must have dtype ",
              x_in.scalar_type(), ", got ", grad_y_in.scalar_type());
  const at::Tensor x = x_in.contiguous(), grad_y = grad_y_in.contiguous();
  const at::cuda::OptionalCUDAGuard guard(device_of(x));
  at::Tensor grad_x = at::empty_like(x);
  check_launch(km::my_op_backward(x.data_ptr(), grad_y.data_ptr(), grad_x.data_ptr(), x.numel(),
                                  kernel_dtype(x, kOp, "x"), at::cuda::getCurrentCUDAStream()),
               kOp);
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(kernelforge, CUDA, m) {
  m.impl("my_op_cuda_forward", &forward);
  m.impl("my_op_cuda_backward", &backward);
}

// torch.utils.cpp_extension imports the built library as a Python module: it needs an init
// function, though every entry point goes through torch.ops.kernelforge.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelforge my_op CUDA kernels, registered as torch.ops.kernelforge.my_op_cuda_{forward,backward}";
}
