// Thin torch binding for the flash-attention forward kernel (attention_forward.cu):
// checks, allocation, device and stream. kernelforge/cuda/attention.py calls it.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

#include "attention_cuda.h"
#include "binding_common.h"

namespace {

namespace kat = kernelforge::cuda_attention;
using namespace kernelforge::binding;

constexpr const char* kOp = "attention";

void check_input(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.is_cuda(), "kernelforge ", kOp, ": ", name, " must be a CUDA tensor, got device ", t.device().str());
  TORCH_CHECK(t.device() == q.device(), "kernelforge ", kOp, ": ", name, " must be on ", q.device().str(),
              " like q, got ", t.device().str());
  TORCH_CHECK(t.dim() == 4, "kernelforge ", kOp, ": ", name, " must be 4-D (batch, heads, seq, head_dim), got ",
              std::to_string(t.dim()), "-D with shape ", list(t.sizes()));
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, "kernelforge ", kOp, ": ", name,
              " must be float16 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "kernelforge ", kOp, ": ", name, " must have dtype ",
              q.scalar_type(), " like q, got ", t.scalar_type());
  TORCH_CHECK(t.size(3) <= 1 || t.stride(3) == 1, "kernelforge ", kOp, ": ", name,
              " must have unit stride in the last dim (head_dim), got strides ", list(t.strides()));
}

// The kernel reads 16 bytes at a time: every pointer 16-byte aligned, every batch / head /
// row stride a multiple of 8 elements. A dim of size 1 passes stride 0 (its stride is never
// used and may be anything).
int64_t kernel_stride(const at::Tensor& t, int dim) { return t.size(dim) == 1 ? 0 : t.stride(dim); }

bool readable_in_place(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d) {
    const int64_t s = kernel_stride(t, d);
    if (s < 0 || s % 8 != 0) return false;
  }
  return true;
}

// (out (batch, heads, q_len, head_dim) in q's dtype, lse (batch, heads, q_len) float32).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                           double scale, bool causal, int64_t window_left, int64_t window_right) {
  check_input(q_in, "q", q_in);
  check_input(k_in, "k", q_in);
  check_input(v_in, "v", q_in);
  const int64_t batch = q_in.size(0), heads = q_in.size(1), q_len = q_in.size(2), head_dim = q_in.size(3);
  const int64_t kv_heads = k_in.size(1), kv_len = k_in.size(2);
  TORCH_CHECK(kat::supports_head_dim(head_dim), "kernelforge ", kOp,
              ": head_dim (q.size(3)) must be 32, 64, 96, 128 or 256, got ", std::to_string(head_dim));
  TORCH_CHECK(k_in.size(0) == batch && k_in.size(3) == head_dim, "kernelforge ", kOp, ": k must have shape [",
              std::to_string(batch), ", kv_heads, kv_len, ", std::to_string(head_dim),
              "] (q's batch and head_dim), got ", list(k_in.sizes()));
  TORCH_CHECK(v_in.sizes() == k_in.sizes(), "kernelforge ", kOp, ": v must have the shape of k, ", list(k_in.sizes()),
              ", got ", list(v_in.sizes()));
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "kernelforge ", kOp, ": the number of q heads (",
              std::to_string(heads), ") must be a multiple of the number of kv heads (k.size(1) = ",
              std::to_string(kv_heads), ")");
  TORCH_CHECK(batch <= kat::kMaxGridDim && heads <= kat::kMaxGridDim, "kernelforge ", kOp,
              ": batch and heads must be at most ", std::to_string(kat::kMaxGridDim), ", got q of shape ",
              list(q_in.sizes()));
  TORCH_CHECK(q_len <= kat::kMaxSeqLen && kv_len <= kat::kMaxSeqLen, "kernelforge ", kOp,
              ": sequence lengths must be at most ", std::to_string(kat::kMaxSeqLen), ", got q_len ",
              std::to_string(q_len), " and kv_len ", std::to_string(kv_len));

  const at::cuda::OptionalCUDAGuard guard(device_of(q_in));
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(q_in.get_device());
  TORCH_CHECK(prop->major >= 8, "kernelforge ", kOp, ": the CUDA flash attention needs compute capability 8.0 or newer "
              "(mma.sync, cp.async), got ", std::to_string(prop->major), ".", std::to_string(prop->minor), " on ",
              q_in.device().str());
  const int smem = kat::forward_smem_bytes(head_dim);
  TORCH_CHECK(static_cast<size_t>(smem) <= prop->sharedMemPerBlockOptin, "kernelforge ", kOp, ": head_dim ",
              std::to_string(head_dim), " needs ", std::to_string(smem), " bytes of shared memory per block, ",
              q_in.device().str(), " allows ", std::to_string(prop->sharedMemPerBlockOptin));

  at::Tensor out = at::empty({batch, heads, q_len, head_dim}, q_in.options());
  at::Tensor lse = at::empty({batch, heads, q_len}, q_in.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};

  // Rare layouts the 16-byte loads cannot read in place (a view starting mid-row, a stride
  // that is not a multiple of 8) are copied once into a fresh (aligned) tensor: contiguous()
  // would return a contiguous but misaligned view unchanged. Every other layout is read as it is.
  const auto fresh = [](const at::Tensor& t) { return t.clone(at::MemoryFormat::Contiguous); };
  TORCH_CHECK(std::isfinite(scale), "kernelforge ", kOp, ": scale must be finite, got ", std::to_string(scale));
  // The kernel's softmax takes the max of the raw scores, so it needs scale >= 0: a negative
  // scale is served as softmax(|scale| * (-q) . k), with -q in a new tensor (exact).
  const bool negate = scale < 0;
  const at::Tensor q = negate ? q_in.neg() : readable_in_place(q_in) ? q_in : fresh(q_in);
  const at::Tensor k = kv_len == 0 || readable_in_place(k_in) ? k_in : fresh(k_in);
  const at::Tensor v = kv_len == 0 || readable_in_place(v_in) ? v_in : fresh(v_in);

  kat::AttentionForwardArgs a;
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr();
  a.q_batch_stride = kernel_stride(q, 0), a.q_head_stride = kernel_stride(q, 1), a.q_row_stride = kernel_stride(q, 2);
  a.k_batch_stride = kernel_stride(k, 0), a.k_head_stride = kernel_stride(k, 1), a.k_row_stride = kernel_stride(k, 2);
  a.v_batch_stride = kernel_stride(v, 0), a.v_head_stride = kernel_stride(v, 1), a.v_row_stride = kernel_stride(v, 2);
  if (kv_len == 0) {  // nothing is read from k and v: their strides do not matter
    a.k_batch_stride = a.k_head_stride = a.k_row_stride = 0;
    a.v_batch_stride = a.v_head_stride = a.v_row_stride = 0;
  }
  a.out = out.data_ptr(), a.lse = lse.data_ptr<float>();
  a.batch = batch, a.heads = heads, a.kv_heads = kv_heads, a.q_len = q_len, a.kv_len = kv_len, a.head_dim = head_dim;
  a.dtype = q.scalar_type() == at::kHalf ? kernelforge::DType::kFloat16 : kernelforge::DType::kBFloat16;
  a.scale = static_cast<float>(negate ? -scale : scale);
  a.causal = causal, a.window_left = window_left, a.window_right = window_right;
  check_launch(kat::attention_forward(a, at::cuda::getCurrentCUDAStream()), kOp);
  return {out, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelforge flash attention forward (FlashAttention-2 scheme, mma.sync tensor cores)";
  m.def("forward", &forward,
        "(out, lse) of softmax(scale * q k^T) v over the visible keys (causal aligned bottom-right, optional "
        "window); q (B, H, Sq, D), k and v (B, Hkv, Sk, D), float16 / bfloat16",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("scale"), pybind11::arg("causal"),
        pybind11::arg("window_left"), pybind11::arg("window_right"));
}
