// Shared by norms_forward.cu and norms_backward.cu (see norms_cuda.h): the constants and
// host helpers both halves use. The design notes common to both:
//
//
// Memory bound (~8 FLOPs per element forward, ~14 backward, against 4..6 bytes moved per
// element for 16-bit data: an H100 has ~20 FLOPs per byte of HBM bandwidth to spare), so
// the design goal is the minimum DRAM traffic with 16-byte accesses and enough bytes in
// flight (Little: ~3.35 TB/s x ~0.6 us ~ 2 MB over 132 SMs, ~16 KB per SM). E = sizeof(T),
// R rows, n columns. One template per kernel over T (float, __half, __nv_bfloat16) and the
// vector width VEC (16 / E, or 1 for unaligned data); weight / bias dtypes are run-time
// codes (row_common.cuh load_param). RMS vs layer norm, residual, weight, bias are run-time
// flags: uniform branches, a few instructions per element, no extra kernel variants.
#pragma once

#include "norms_cuda.h"

#include "row_common.cuh"

#include <cstdint>

namespace kernelforge {
namespace cuda_norms {
namespace {

using namespace row_common;  // conversions, packs, reductions, param loads, device limits

constexpr int kVectorBytes = 16;
constexpr int kLongThreads = 512;          // forward (c), and the backward row sums
constexpr int kLongStepBytes = 32;         // bytes per thread, input and step, of those (64 spills)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int round_up_to_warp(int64_t threads) { return static_cast<int>(ceil_div(threads, kWarpSize) * kWarpSize); }
inline bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0; }
inline bool valid_dtype(DType d) { return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16; }

}  // namespace
}  // namespace cuda_norms
}  // namespace kernelforge
