// Bias + GELU (erf and tanh forms) forward and backward over matrix rows (see
// activations_cuda.h).
//
// One kernel, bias_gelu_kernel<T, VEC, TANH, BACKWARD>, over a 2-D grid of tiles: 256
// threads as (TX, TY) with TX a power of two covering the row's packs up to 256; thread
// (x, y) of block (bx, by) owns the one pack of columns bx * TX + x (its bias pack stays
// in registers) for rows by * rows_per_part + y + i * TY of the block's contiguous row
// range, kRowsInFlight rows loaded at once. E = sizeof(T), R rows, n columns.
//   forward:  DRAM bytes R*n*E read + R*n*E written (+ n bias once per block);
//             FLOPs ~25 per element (erff ~15 or tanhf ~20 in fp32, plus add and scale):
//             at 3 TB/s and 4 bytes per 16-bit element that is ~19 TFLOP/s of the H100's
//             ~60 fp32, so still memory bound.
//   backward: R*n*E read twice (grad_y, x) + R*n*E written; FLOPs ~35 per element
//             (erff + expf, or tanhf). With a bias gradient each block also sums its
//             grad_x per column over its rows (registers, then its TY row slices through
//             shared memory in a fixed order) into row by of an fp32 [parts, n] partial
//             buffer, and column_sum_kernel adds the parts in a fixed order: deterministic.
// Grid: ceil(packs / TX) column blocks times `parts` row ranges, parts chosen so the grid
// has ~8 blocks (2048 threads) per SM: enough bytes in flight (kRowsInFlight x 16 bytes per
// input per thread) without making the partial buffer large.
#include "activations_cuda.h"

#include "row_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kernelforge {
namespace cuda_activations {
namespace {

using namespace row_common;

constexpr int kVectorBytes = 16;
constexpr int kThreads = 256;
constexpr int kRowsInFlight = 4;
constexpr int kBlocksPerSm = 8;

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kTanhCoeff = 0.044715f;

template <bool TANH>
__device__ __forceinline__ float gelu(float z) {
  if constexpr (TANH) {
    const float u = kSqrt2OverPi * (z + kTanhCoeff * z * z * z);
    return 0.5f * z * (1.f + tanhf(u));
  } else {
    return 0.5f * z * (1.f + erff(z * kInvSqrt2));
  }
}

template <bool TANH>
__device__ __forceinline__ float gelu_grad(float z) {
  if constexpr (TANH) {
    const float z2 = z * z;
    const float t = tanhf(kSqrt2OverPi * (z + kTanhCoeff * z2 * z));
    return 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kTanhCoeff * z2);
  } else {
    return 0.5f * (1.f + erff(z * kInvSqrt2)) + z * kInvSqrt2Pi * expf(-0.5f * z * z);
  }
}

template <typename T>
struct Args {
  const T* x;
  const T* gy;  // backward
  int64_t x_stride, gy_stride;
  const void* b;  // null: no bias
  int b_type;
  T* out;         // dense
  float* part_b;  // backward: [parts, cols] or null
  int64_t rows, rows_per_part;
  int cols;
};

template <typename T, int VEC, bool TANH, bool BACKWARD>
__global__ void __launch_bounds__(kThreads) bias_gelu_kernel(const Args<T> a) {
  using P = Pack<T, VEC>;
  __shared__ float column_buffer[BACKWARD ? kThreads * VEC : 1];  // [TY][TX][VEC]
  const int packs = a.cols / VEC;
  const int p = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);  // < 2^31: packs <= 2^30
  const bool valid = p < packs;
  float bias[VEC], acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) bias[j] = acc[j] = 0.f;
  if (valid && a.b) load_param<VEC>(a.b, a.b_type, static_cast<int64_t>(p) * VEC, bias);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * a.rows_per_part;
  const int64_t r1 = r0 + a.rows_per_part < a.rows ? r0 + a.rows_per_part : a.rows;
  const int64_t ty = blockDim.y;
  for (int64_t base = r0 + threadIdx.y; base < r1; base += kRowsInFlight * ty) {
    P xp[kRowsInFlight], gp[kRowsInFlight];
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i) {
      const int64_t row = base + i * ty;
      if (valid && row < r1) {
        xp[i] = reinterpret_cast<const P*>(a.x + row * a.x_stride)[p];
        if constexpr (BACKWARD) gp[i] = reinterpret_cast<const P*>(a.gy + row * a.gy_stride)[p];
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i) {
      const int64_t row = base + i * ty;
      if (valid && row < r1) {
        float x[VEC], o[VEC];
        unpack(xp[i], x);
        if constexpr (BACKWARD) {
          float g[VEC];
          unpack(gp[i], g);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            o[j] = g[j] * gelu_grad<TANH>(x[j] + bias[j]);
            acc[j] += o[j];
          }
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = gelu<TANH>(x[j] + bias[j]);
        }
        reinterpret_cast<P*>(a.out + row * a.cols)[p] = pack<T, VEC>(o);
      }
    }
  }
  if constexpr (BACKWARD) {
    if (a.part_b) {  // kernel argument: uniform over the block
      const int slot = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
#pragma unroll
      for (int j = 0; j < VEC; ++j) column_buffer[slot * VEC + j] = acc[j];
      __syncthreads();
      if (threadIdx.y == 0 && valid) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          float total = 0.f;
          for (int y = 0; y < static_cast<int>(blockDim.y); ++y)  // fixed order
            total += column_buffer[(y * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x)) * VEC + j];
          a.part_b[static_cast<int64_t>(blockIdx.y) * a.cols + static_cast<int64_t>(p) * VEC + j] = total;
        }
      }
    }
  }
}

__global__ void __launch_bounds__(kColumnSumCols * kColumnSumSlices)
    column_sum_kernel(const float* partial, int64_t parts, int64_t cols, void* out, int out_type) {
  column_sum(partial, parts, cols, out, out_type);
}

// ---------------------------------------------------------------------------------------
// Host side.

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0; }
bool valid_dtype(DType d) { return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16; }
int element_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

struct Plan {
  int vec;          // elements per pack: 16 / E, or 1
  int tx, ty;       // block shape, tx * ty == kThreads
  int64_t col_blocks, parts, rows_per_part;
};

// A function of the arguments and the SM count only, shared by the workspace query and
// the launch. The vector path needs every row start 16-byte aligned: base pointers aligned
// and cols and row strides whole packs; the bias is read at multiples of VEC elements.
Plan make_plan(const BiasGeluArgs& args, bool backward, int sm_count) {
  Plan p{};
  const int full = kVectorBytes / element_size(args.dtype);
  const bool vectorizable = args.cols % full == 0 && aligned(args.x) && args.x_row_stride % full == 0 &&
                            aligned(args.out) && (!args.bias || aligned(args.bias)) &&
                            (!backward || (aligned(args.grad_y) && args.grad_y_row_stride % full == 0));
  p.vec = vectorizable ? full : 1;
  const int64_t packs = args.cols / p.vec;
  p.tx = 1;
  while (p.tx < kThreads && p.tx < packs) p.tx *= 2;
  p.ty = kThreads / p.tx;
  p.col_blocks = ceil_div(packs, p.tx);
  int64_t wanted = ceil_div(int64_t{sm_count} * kBlocksPerSm, p.col_blocks);
  const int64_t max_parts = ceil_div(args.rows, int64_t{p.ty} * kRowsInFlight);  // >= TY * 4 rows each
  wanted = wanted < max_parts ? wanted : max_parts;
  wanted = wanted < 65535 ? wanted : 65535;  // grid.y limit
  if (wanted < 1) wanted = 1;
  p.rows_per_part = ceil_div(args.rows, wanted);
  p.parts = ceil_div(args.rows, p.rows_per_part);  // every part non-empty
  return p;
}

size_t partial_bytes(const Plan& p, int64_t cols) {
  return static_cast<size_t>(p.parts) * static_cast<size_t>(cols) * sizeof(float);
}

template <typename T, int VEC, bool BACKWARD>
cudaError_t launch_typed(const BiasGeluArgs& args, const Plan& plan, bool tanh_form, cudaStream_t stream) {
  Args<T> a{};
  a.x = static_cast<const T*>(args.x);
  a.gy = static_cast<const T*>(args.grad_y);
  a.x_stride = args.x_row_stride;
  a.gy_stride = args.grad_y_row_stride;
  a.b = args.bias;
  a.b_type = static_cast<int>(args.bias_dtype);
  a.out = static_cast<T*>(args.out);
  a.part_b = BACKWARD && args.grad_bias ? static_cast<float*>(args.workspace) : nullptr;
  a.rows = args.rows;
  a.rows_per_part = plan.rows_per_part;
  a.cols = static_cast<int>(args.cols);
  const dim3 grid(static_cast<unsigned>(plan.col_blocks), static_cast<unsigned>(plan.parts));
  const dim3 block(plan.tx, plan.ty);
  if (tanh_form) {
    bias_gelu_kernel<T, VEC, true, BACKWARD><<<grid, block, 0, stream>>>(a);
  } else {
    bias_gelu_kernel<T, VEC, false, BACKWARD><<<grid, block, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <bool BACKWARD>
cudaError_t launch(const BiasGeluArgs& args, const Plan& plan, cudaStream_t stream) {
  const bool full = plan.vec > 1;
  switch (args.dtype) {
    case DType::kFloat32:
      return full ? launch_typed<float, 4, BACKWARD>(args, plan, args.tanh_form, stream)
                  : launch_typed<float, 1, BACKWARD>(args, plan, args.tanh_form, stream);
    case DType::kFloat16:
      return full ? launch_typed<__half, 8, BACKWARD>(args, plan, args.tanh_form, stream)
                  : launch_typed<__half, 1, BACKWARD>(args, plan, args.tanh_form, stream);
    case DType::kBFloat16:
      return full ? launch_typed<__nv_bfloat16, 8, BACKWARD>(args, plan, args.tanh_form, stream)
                  : launch_typed<__nv_bfloat16, 1, BACKWARD>(args, plan, args.tanh_form, stream);
  }
  return cudaErrorInvalidValue;
}

bool bad_args(const BiasGeluArgs& args, bool backward) {
  return args.rows < 0 || args.cols < 0 || args.cols > kMaxCols || args.x_row_stride < 0 ||
         (backward && args.grad_y_row_stride < 0) || !valid_dtype(args.dtype) || !valid_dtype(args.bias_dtype) ||
         (backward && !valid_dtype(args.grad_bias_dtype));
}

}  // namespace

cudaError_t bias_gelu_forward(const BiasGeluArgs& args, cudaStream_t stream) {
  if (bad_args(args, false)) return cudaErrorInvalidValue;
  if (args.rows == 0 || args.cols == 0) return cudaSuccess;
  if (!args.x || !args.out) return cudaErrorInvalidValue;
  DeviceLimits lim;
  const cudaError_t err = current_device_limits(&lim);
  if (err != cudaSuccess) return err;
  return launch<false>(args, make_plan(args, false, lim.sm_count), stream);
}

size_t bias_gelu_backward_workspace_bytes(const BiasGeluArgs& args) {
  if (bad_args(args, true) || args.rows == 0 || args.cols == 0 || !args.grad_bias) return 0;
  DeviceLimits lim;
  if (current_device_limits(&lim) != cudaSuccess) return 0;  // bias_gelu_backward reports the error
  return partial_bytes(make_plan(args, true, lim.sm_count), args.cols);
}

cudaError_t bias_gelu_backward(const BiasGeluArgs& args, cudaStream_t stream) {
  if (bad_args(args, true)) return cudaErrorInvalidValue;
  if (args.rows == 0 || args.cols == 0) return cudaSuccess;  // the caller zero-fills grad_bias of 0 rows
  if (!args.x || !args.grad_y || !args.out || (args.grad_bias && !args.bias)) return cudaErrorInvalidValue;
  DeviceLimits lim;
  cudaError_t err = current_device_limits(&lim);
  if (err != cudaSuccess) return err;
  const Plan plan = make_plan(args, true, lim.sm_count);
  if (args.grad_bias &&
      (args.workspace == nullptr || !aligned(args.workspace) || args.workspace_bytes < partial_bytes(plan, args.cols)))
    return cudaErrorInvalidValue;
  err = launch<true>(args, plan, stream);
  if (err != cudaSuccess || !args.grad_bias) return err;
  column_sum_kernel<<<static_cast<unsigned>(ceil_div(args.cols, kColumnSumCols)),
                      dim3(kColumnSumCols, kColumnSumSlices), 0, stream>>>(
      static_cast<const float*>(args.workspace), plan.parts, args.cols, args.grad_bias,
      static_cast<int>(args.grad_bias_dtype));
  return cudaGetLastError();
}

}  // namespace cuda_activations
}  // namespace kernelforge
