// Thin torch binding for the GEMM kernel (gemm_cuda.cu): checks, operand layouts, allocation,
// device and stream. kernelforge/cuda/gemm.py calls it.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "binding_common.h"
#include "gemm_cuda.h"

namespace {

namespace kg = kernelforge::cuda_gemm;
using kernelforge::DType;
using namespace kernelforge::binding;

constexpr const char* kOp = "gemm";

void check_operand(const at::Tensor& t, const char* name, const at::Tensor& a) {
  TORCH_CHECK(t.is_cuda(), "kernelforge ", kOp, ": ", name, " must be a CUDA tensor, got device ", t.device().str());
  TORCH_CHECK(t.device() == a.device(), "kernelforge ", kOp, ": ", name, " must be on ", a.device().str(),
              " like a, got ", t.device().str());
  TORCH_CHECK(t.dim() == 3, "kernelforge ", kOp, ": ", name, " must be 3-D (batch, rows, cols), got ",
              std::to_string(t.dim()), "-D with shape ", list(t.sizes()));
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, "kernelforge ", kOp, ": ", name,
              " must be float16 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.scalar_type() == a.scalar_type(), "kernelforge ", kOp, ": ", name, " must have dtype ",
              a.scalar_type(), " like a, got ", t.scalar_type());
}

// The stride the kernel is given for a dim: 0 for a dim of size 1 (its stride is never used).
int64_t kernel_stride(const at::Tensor& t, int dim) { return t.size(dim) == 1 ? 0 : t.stride(dim); }

// Can the kernel read t (batch, rows, cols) in place with its contiguous dim `unit` (1 or 2)?
// 16-byte cp.async copies: unit stride there, a 16-byte aligned pointer and the other two
// strides multiples of 8 elements (a stride of 0, a broadcast, is one).
bool readable_in_place(const at::Tensor& t, int unit) {
  if (t.size(unit) > 1 && t.stride(unit) != 1) return false;
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d : {0, 3 - unit}) {
    const int64_t s = kernel_stride(t, d);
    if (s < 0 || s % 8 != 0) return false;
  }
  return true;
}

int64_t round_up8(int64_t n) { return (n + 7) / 8 * 8; }

// A copy of t the kernel reads in place, contiguous along `unit`, its rows padded to a multiple
// of 8 elements (a view of the first size(unit) of each padded row); a batch broadcast (stride
// 0) stays one. For layouts no kernel variant reads (no unit stride, a misaligned view, rows
// whose length is not a multiple of 8): one extra pass over the operand.
at::Tensor aligned_copy(const at::Tensor& t, int unit) {
  const bool shared = t.size(0) > 1 && t.stride(0) == 0;
  const at::Tensor src = shared ? t.narrow(0, 0, 1) : t;
  const int64_t batch = src.size(0), rows = src.size(1), cols = src.size(2);
  at::Tensor view;
  if (unit == 2) {
    view = at::empty({batch, rows, round_up8(cols)}, t.options()).narrow(2, 0, cols);
    view.copy_(src);
  } else {
    view = at::empty({batch, cols, round_up8(rows)}, t.options()).narrow(2, 0, rows).transpose(1, 2);
    view.copy_(src);
  }
  return shared ? view.expand({t.size(0), rows, cols}) : view;
}

// (tensor the kernel reads, its contiguous dim): in place if either layout allows, `first`
// tried first, else an aligned copy contiguous along `first`.
std::pair<at::Tensor, int> operand_layout(const at::Tensor& t, int first) {
  if (readable_in_place(t, first)) return {t, first};
  if (readable_in_place(t, 3 - first)) return {t, 3 - first};
  return {aligned_copy(t, first), first};
}

// Bias and residual: float32, float16 or bfloat16 as they come; other float dtypes (float64)
// are rounded to float32 here, as the reference's float32 epilogue does.
at::Tensor epilogue_input(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16 ? t : t.to(at::kFloat);
}

DType dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

// (out, preact or None): out = act(a @ b + bias) + residual, dense (batch, M, N) in the dtype
// out_dtype names (0 float32, 1 float16, 2 bfloat16, 3 float64: computed as float32, then
// converted exactly); preact = a @ b in that dtype when save_preact.
std::tuple<at::Tensor, OptTensor> forward(const at::Tensor& a_in, const at::Tensor& b_in, const OptTensor& bias_in,
                                          const OptTensor& residual_in, int64_t activation, int64_t out_dtype,
                                          bool save_preact, int64_t warps) {
  check_operand(a_in, "a", a_in);
  check_operand(b_in, "b", a_in);
  const int64_t batch = a_in.size(0), M = a_in.size(1), K = a_in.size(2), N = b_in.size(2);
  TORCH_CHECK(b_in.size(0) == batch && b_in.size(1) == K, "kernelforge ", kOp, ": b must have shape [",
              std::to_string(batch), ", ", std::to_string(K), ", N] (a's batch and K), got ", list(b_in.sizes()));
  TORCH_CHECK(N <= kg::kMaxDim && K <= kg::kMaxDim, "kernelforge ", kOp, ": N and K must be at most ",
              std::to_string(kg::kMaxDim), ", got N ", std::to_string(N), " and K ", std::to_string(K));
  TORCH_CHECK(activation >= 0 && activation <= 4, "kernelforge ", kOp,
              ": activation must be 0 (none), 1 (gelu), 2 (gelu_tanh), 3 (silu) or 4 (relu), got ",
              std::to_string(activation));
  TORCH_CHECK(out_dtype >= 0 && out_dtype <= 3, "kernelforge ", kOp,
              ": out_dtype must be 0 (float32), 1 (float16), 2 (bfloat16) or 3 (float64), got ",
              std::to_string(out_dtype));
  TORCH_CHECK(warps == 4 || warps == 8, "kernelforge ", kOp, ": warps must be 4 or 8 (128 or 256 threads), got ",
              std::to_string(warps));
  if (bias_in.has_value()) {
    const at::Tensor& t = *bias_in;
    TORCH_CHECK(t.device() == a_in.device(), "kernelforge ", kOp, ": bias must be on ", a_in.device().str(),
                " like a, got ", t.device().str());
    TORCH_CHECK(t.dim() == 1 && t.size(0) == N, "kernelforge ", kOp, ": bias must have shape [", std::to_string(N),
                "] (b's last dim), got ", list(t.sizes()));
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), "kernelforge ", kOp, ": bias must be a float tensor, got ",
                t.scalar_type());
  }
  if (residual_in.has_value()) {
    const at::Tensor& t = *residual_in;
    TORCH_CHECK(t.device() == a_in.device(), "kernelforge ", kOp, ": residual must be on ", a_in.device().str(),
                " like a, got ", t.device().str());
    TORCH_CHECK(t.dim() == 3 && t.size(0) == batch && t.size(1) == M && t.size(2) == N, "kernelforge ", kOp,
                ": residual must have shape [", std::to_string(batch), ", ", std::to_string(M), ", ",
                std::to_string(N), "] (the output's), got ", list(t.sizes()));
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), "kernelforge ", kOp, ": residual must be a float tensor, got ",
                t.scalar_type());
  }

  const at::cuda::OptionalCUDAGuard guard(device_of(a_in));
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(a_in.get_device());
  TORCH_CHECK(prop->major >= 8, "kernelforge ", kOp, ": the CUDA GEMM needs compute capability 8.0 or newer "
              "(mma.sync, ldmatrix, cp.async), got ", std::to_string(prop->major), ".", std::to_string(prop->minor),
              " on ", a_in.device().str());

  static const at::ScalarType kOutTypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};
  const at::ScalarType out_type = kOutTypes[out_dtype];
  const at::ScalarType kernel_out_type = out_type == at::kDouble ? at::kFloat : out_type;
  const auto out_options = a_in.options().dtype(kernel_out_type);
  at::Tensor out = at::empty({batch, M, N}, out_options);
  OptTensor preact;
  if (save_preact) preact = at::empty({batch, M, N}, out_options);
  if (out.numel() != 0) {
    kg::GemmArgs args;
    at::Tensor a, b;  // the kernel's views of a and b (copies where needed), alive until the launch
    int a_unit = 2, b_unit = 2;
    if (K > 0) {
      std::tie(a, a_unit) = operand_layout(a_in, 2);  // k-major a first: a row-major (M, K)
      std::tie(b, b_unit) = operand_layout(b_in, 2);  // n-major b first: a row-major (K, N)
      args.a = a.data_ptr(), args.b = b.data_ptr();
      args.a_k_major = a_unit == 2, args.b_k_major = b_unit == 1;
      args.a_batch_stride = kernel_stride(a, 0), args.a_ld = kernel_stride(a, 3 - a_unit);
      args.b_batch_stride = kernel_stride(b, 0), args.b_ld = kernel_stride(b, 3 - b_unit);
    }
    const int smem = kg::gemm_smem_bytes(static_cast<int>(warps), args.a_k_major, args.b_k_major);
    TORCH_CHECK(static_cast<size_t>(smem) <= prop->sharedMemPerBlockOptin, "kernelforge ", kOp,
                ": the CUDA GEMM needs ", std::to_string(smem), " bytes of shared memory per block, ",
                a_in.device().str(), " allows ", std::to_string(prop->sharedMemPerBlockOptin));
    at::Tensor bias, residual;
    if (bias_in.has_value()) {
      bias = epilogue_input(*bias_in);
      args.bias = bias.data_ptr(), args.bias_dtype = dtype_code(bias), args.bias_stride = kernel_stride(bias, 0);
    }
    if (residual_in.has_value()) {
      residual = epilogue_input(*residual_in);
      args.residual = residual.data_ptr(), args.residual_dtype = dtype_code(residual);
      args.residual_batch_stride = kernel_stride(residual, 0), args.residual_row_stride = kernel_stride(residual, 1);
      args.residual_col_stride = kernel_stride(residual, 2);
    }
    args.out = out.data_ptr(), args.preact = save_preact ? preact->data_ptr() : nullptr;
    args.out_dtype = dtype_code(out);
    args.batch = batch, args.M = M, args.N = N, args.K = K;
    args.dtype = a_in.scalar_type() == at::kHalf ? DType::kFloat16 : DType::kBFloat16;
    args.activation = static_cast<kg::Activation>(activation);
    args.warps = static_cast<int>(warps);
    check_launch(kg::gemm_forward(args, at::cuda::getCurrentCUDAStream()), kOp);
  }
  if (out_type == at::kDouble) {
    out = out.to(at::kDouble);
    if (save_preact) preact = preact->to(at::kDouble);
  }
  return {out, preact};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelforge GEMM with a fused bias / activation / residual epilogue (mma.sync tensor cores)";
  m.def("forward", &forward,
        "(out, preact or None): out = act(a @ b + bias) + residual, a (batch, M, K) and b (batch, K, N) float16 / "
        "bfloat16 with any strides, fp32 accumulation and epilogue, one rounding to out_dtype",
        pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("bias"), pybind11::arg("residual"),
        pybind11::arg("activation"), pybind11::arg("out_dtype"), pybind11::arg("save_preact"),
        pybind11::arg("warps"));
}
