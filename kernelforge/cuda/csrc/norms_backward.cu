// Layer norm / RMS norm backward over matrix rows (see norms_cuda.h; the shared design
// notes are in norms_common.cuh).
//
//
// Backward (dh = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w), by n:
//  (a) n <= 512, norm_bwd_regs_kernel<GROUP = 4..32>: 256-thread blocks, GROUP lanes per
//      row, <= 16 values a thread; (b) n <= 8192, <GROUP = 0>: a block per row, 8 / 16
//      values a thread, <= 512 threads. Each block owns a contiguous range of rows
//      (grid ~1024 threads per SM): it reads dy and h once, writes dh, and keeps its weight
//      and bias gradient partials for its fixed columns in registers (w, dw, db: 3 floats
//      per value, plus dy and h as raw packs), written once as fp32 [blocks, n] rows
//      (a sums its row groups through shared memory first, in a fixed order). Unaligned
//      rows with 16 values a thread spilled (scalar addresses): they take (c)'s kernels.
//      DRAM bytes: 2*R*n*E read + R*n*E written (+ R*n*E for grad_residual) + partials
//      (blocks * n * 4 bytes written and read back, L2-sized) + weight once per block.
//  (c) longer rows: norm_bwd_row_sums_kernel (512 threads per row) reads dy and h for
//      sum(g) and sum(g * xhat) per row, then norm_bwd_tile_kernel, a 2-D grid of
//      (2048-column chunk, row range) blocks of 256 threads with 8 fixed columns each,
//      re-reads dy and h, writes dh and accumulates the partials of its chunk.
//      DRAM bytes: 4*R*n*E read + R*n*E written (+ grad_residual): the price of rows
//      longer than registers hold while the column partials stay in registers.
//  column_sum_kernel then sums the [blocks, n] partials per column in a fixed order.
//  FLOPs: ~14 per element; the partial sums add 2 FMAs per element.

#include "norms_backward_kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace kernelforge {
namespace cuda_norms {
namespace {

// ---------------------------------------------------------------------------------------
// Host side.

// ---- backward plan: path, grid, partial rows. A function of (rows, cols, SM count) only,
// so norm_backward_workspace_bytes and norm_backward agree whatever the alignment.
enum class BwdPath { kWarp, kBlock, kTile };

struct BwdPlan {
  BwdPath path;
  int threads;  // kBlock: block size
  int elems;    // kBlock: values per thread (8 or 16)
  int64_t chunks;  // kTile: 2048-column chunks (grid.x)
  int64_t parts, rows_per_part;  // blocks of rows (grid.x, or grid.y for kTile), each a partial row
};

BwdPlan plan_backward(int64_t rows, int64_t cols, int sm_count) {
  BwdPlan p{};
  int64_t wanted;  // blocks of rows
  if (cols <= kBwdMaxWarpCols) {
    p.path = BwdPath::kWarp;
    p.threads = kBwdWarpThreads;
    wanted = ceil_div(rows, 8);  // a block handles up to 64 rows at a time; >= 8 rows each
    const int64_t cap = int64_t{sm_count} * (kThreadsPerSm / kBwdWarpThreads);
    wanted = wanted < cap ? wanted : cap;
  } else if (cols <= kBwdMaxRegisterCols) {
    p.path = BwdPath::kBlock;
    p.elems = round_up_to_warp(ceil_div(cols, 8)) <= kBwdBlockThreads ? 8 : kBwdMaxElems;
    p.threads = round_up_to_warp(ceil_div(cols, p.elems));  // <= 512 as cols <= 8192
    const int64_t cap = int64_t{sm_count} * (kThreadsPerSm / p.threads > 1 ? kThreadsPerSm / p.threads : 1);
    wanted = rows < cap ? rows : cap;
  } else {
    p.path = BwdPath::kTile;
    p.chunks = ceil_div(cols, kTileCols);
    wanted = ceil_div(int64_t{sm_count} * kTileBlocksPerSm, p.chunks);
    wanted = wanted < rows ? wanted : rows;
  }
  if (wanted < 1) wanted = 1;
  p.rows_per_part = ceil_div(rows, wanted);
  p.parts = ceil_div(rows, p.rows_per_part);  // every part non-empty; parts <= wanted
  return p;
}

size_t align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

struct BwdWorkspace {
  size_t part_w, part_b, row_sums, total;  // byte offsets of each region, total size
};

BwdWorkspace workspace_layout(const BwdPlan& p, int64_t rows, int64_t cols, bool grad_w, bool grad_b) {
  const size_t part = align16(static_cast<size_t>(p.parts) * static_cast<size_t>(cols) * sizeof(float));
  BwdWorkspace ws{};
  ws.part_w = 0;
  ws.part_b = grad_w ? part : 0;
  ws.row_sums = ws.part_b + (grad_b ? part : 0);
  // kBlock too: unaligned rows of 16 values a thread run the tile kernels (see launch_bwd_with_width).
  ws.total = ws.row_sums + (p.path != BwdPath::kWarp ? align16(static_cast<size_t>(rows) * 2 * sizeof(float)) : 0);
  return ws;
}

template <typename T, int VEC, int PACKS, int GROUP>
cudaError_t launch_bwd_warp(const BwdArgs<T>& a, int64_t parts, cudaStream_t stream) {
  const int packs = a.cols / VEC;
  if constexpr (GROUP < kWarpSize) {
    if (packs > GROUP) return launch_bwd_warp<T, VEC, 1, GROUP * 2>(a, parts, stream);
  } else if constexpr (PACKS * VEC < kBwdMaxElems) {
    if (packs > PACKS * GROUP) return launch_bwd_warp<T, VEC, PACKS * 2, GROUP>(a, parts, stream);
  }
  norm_bwd_regs_kernel<T, VEC, PACKS, GROUP><<<static_cast<unsigned>(parts), kBwdWarpThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Path (c) with `parts` row ranges: any parts works, the partial buffer has that many rows.
template <typename T, int VEC>
cudaError_t launch_bwd_tiles(const BwdArgs<T>& a, int64_t parts, const DeviceLimits& lim, cudaStream_t stream) {
  norm_bwd_row_sums_kernel<T, VEC>
      <<<grid_size(a.rows, int64_t{lim.sm_count} * (kThreadsPerSm / kLongThreads)), kLongThreads, 0, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(ceil_div(a.cols, kTileCols)), static_cast<unsigned>(parts));
  norm_bwd_tile_kernel<T, VEC><<<grid, kTileThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int VEC>
cudaError_t launch_bwd_with_width(const BwdArgs<T>& a, const BwdPlan& plan, const DeviceLimits& lim,
                                  cudaStream_t stream) {
  constexpr int kMinElems = 8 > VEC ? 8 : VEC;
  switch (plan.path) {
    case BwdPath::kWarp: return launch_bwd_warp<T, VEC, 1, 4>(a, plan.parts, stream);
    case BwdPath::kBlock:
      if (plan.elems == kMinElems) {
        norm_bwd_regs_kernel<T, VEC, kMinElems / VEC, 0>
            <<<static_cast<unsigned>(plan.parts), plan.threads, 0, stream>>>(a);
      } else if constexpr (VEC > 1) {
        norm_bwd_regs_kernel<T, VEC, kBwdMaxElems / VEC, 0>
            <<<static_cast<unsigned>(plan.parts), plan.threads, 0, stream>>>(a);
      } else {
        // 16 scalar values a thread at 512 threads spill (per-element addresses): the
        // unaligned case takes the tile kernels, same partial rows, one more read of dy, h.
        return launch_bwd_tiles<T, VEC>(a, plan.parts, lim, stream);
      }
      return cudaGetLastError();
    case BwdPath::kTile: return launch_bwd_tiles<T, VEC>(a, plan.parts, lim, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_backward(const NormBackwardArgs& args, cudaStream_t stream) {
  constexpr int kVec = kVectorBytes / sizeof(T);
  DeviceLimits lim;
  cudaError_t err = current_device_limits(&lim);
  if (err != cudaSuccess) return err;
  const BwdPlan plan = plan_backward(args.rows, args.cols, lim.sm_count);
  const bool grad_w = args.grad_weight != nullptr, grad_b = args.grad_bias != nullptr;
  const BwdWorkspace ws = workspace_layout(plan, args.rows, args.cols, grad_w, grad_b);
  if (ws.total > 0 && (args.workspace == nullptr || args.workspace_bytes < ws.total || !aligned(args.workspace)))
    return cudaErrorInvalidValue;
  unsigned char* const base = static_cast<unsigned char*>(args.workspace);
  BwdArgs<T> a{};
  a.gy = static_cast<const T*>(args.grad_y);
  a.gres = static_cast<const T*>(args.grad_residual);
  a.h = static_cast<const T*>(args.h);
  a.gy_stride = args.grad_y_row_stride;
  a.gres_stride = args.grad_residual_row_stride;
  a.h_stride = args.h_row_stride;
  a.w = args.weight;
  a.w_type = static_cast<int>(args.weight_dtype);
  a.mean = args.rms ? nullptr : args.mean;
  a.rstd = args.rstd;
  a.gh = static_cast<T*>(args.grad_h);
  a.part_w = grad_w ? reinterpret_cast<float*>(base + ws.part_w) : nullptr;
  a.part_b = grad_b ? reinterpret_cast<float*>(base + ws.part_b) : nullptr;
  a.row_sums = plan.path != BwdPath::kWarp ? reinterpret_cast<float*>(base + ws.row_sums) : nullptr;
  a.rows = args.rows;
  a.rows_per_part = plan.rows_per_part;
  a.cols = static_cast<int>(args.cols);
  a.offset = args.offset;
  // As in the forward; the partials are written one float at a time (no alignment needed).
  const bool vectorizable = args.cols % kVec == 0 && aligned(a.gy) && a.gy_stride % kVec == 0 && aligned(a.h) &&
                            a.h_stride % kVec == 0 && aligned(a.gh) &&
                            (!a.gres || (aligned(a.gres) && a.gres_stride % kVec == 0)) && (!a.w || aligned(a.w));
  err = vectorizable ? launch_bwd_with_width<T, kVec>(a, plan, lim, stream)
                     : launch_bwd_with_width<T, 1>(a, plan, lim, stream);
  if (err != cudaSuccess) return err;
  const unsigned sum_blocks = static_cast<unsigned>(ceil_div(args.cols, kColumnSumCols));
  const dim3 sum_threads(kColumnSumCols, kColumnSumSlices);
  if (grad_w) {
    column_sum_kernel<<<sum_blocks, sum_threads, 0, stream>>>(a.part_w, plan.parts, args.cols, args.grad_weight,
                                                             static_cast<int>(args.grad_weight_dtype));
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (grad_b) {
    column_sum_kernel<<<sum_blocks, sum_threads, 0, stream>>>(a.part_b, plan.parts, args.cols, args.grad_bias,
                                                             static_cast<int>(args.grad_bias_dtype));
    err = cudaGetLastError();
  }
  return err;
}
}  // namespace


size_t norm_backward_workspace_bytes(int64_t rows, int64_t cols, bool grad_weight, bool grad_bias) {
  if (rows <= 0 || cols <= 0 || cols > kMaxCols) return 0;
  DeviceLimits lim;
  if (current_device_limits(&lim) != cudaSuccess) return 0;  // norm_backward reports the error
  return workspace_layout(plan_backward(rows, cols, lim.sm_count), rows, cols, grad_weight, grad_bias).total;
}

cudaError_t norm_backward(const NormBackwardArgs& args, cudaStream_t stream) {
  if (args.rows < 0 || args.cols < 0 || args.cols > kMaxCols || args.grad_y_row_stride < 0 ||
      args.grad_residual_row_stride < 0 || args.h_row_stride < 0 || !valid_dtype(args.dtype) ||
      !valid_dtype(args.weight_dtype) || !valid_dtype(args.grad_weight_dtype) || !valid_dtype(args.grad_bias_dtype))
    return cudaErrorInvalidValue;
  if (args.rows == 0 || args.cols == 0) return cudaSuccess;  // the caller zero-fills gradients of 0 rows
  if (!args.grad_y || !args.h || !args.rstd || !args.grad_h || (!args.rms && !args.mean))
    return cudaErrorInvalidValue;
  switch (args.dtype) {
    case DType::kFloat32: return launch_backward<float>(args, stream);
    case DType::kFloat16: return launch_backward<__half>(args, stream);
    case DType::kBFloat16: return launch_backward<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda_norms
}  // namespace kernelforge
