// Softmax row math for softmax_cuda.cu: the SFU exp, the row statistics (online max/sum
// forward, compensated sum backward), the two Ops (what a row reads, pads, accumulates and
// writes) and the kernels' argument block. Device code only; one translation unit includes it.
#pragma once

#include "row_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace kernelforge {
namespace cuda_softmax {
namespace {

using namespace row_common;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();

// exp(d) = 2^(d * log2(e)) on the SFU: ex2.approx has <= 2 ulp error; rounding the product
// adds |d| / 2 ulp, so ~2.5 ulp for the entries that dominate a row (d in [-1, 0]).
// Results below 2^-126 flush to 0 (absolute error < 1.2e-38).
__device__ __forceinline__ float exp_of(float d) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d * kLog2e));
  return y;
}

// ---------------------------------------------------------------------------------------
// Row statistics: identity() and allreduce<WIDTH>() over aligned groups of WIDTH lanes
// (group_max / group_sum of row_common.cuh).
// Forward: max of the values and sum of exp(v - max), updated online (one pass). The exp
// reference is the max, or 0 while it is still -inf, so -inf entries contribute 0 instead
// of exp(-inf - -inf) = NaN. A row that is -inf everywhere keeps max = -inf and yields NaN
// in the epilogue's x - max, exactly like torch.softmax.
struct MaxExpSum {
  float max_value, exp_sum;
  __device__ static MaxExpSum identity() { return {kNegInf, 0.f}; }
  __device__ static float reference(float m) { return m == kNegInf ? 0.f : m; }

  template <int N>
  __device__ void add(const float* v) {
    float m = max_value;
#pragma unroll
    for (int j = 0; j < N; ++j) m = fmaxf(m, v[j]);
    const float ref = reference(m);
    float chunk_sum = 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) chunk_sum += exp_of(v[j] - ref);
    exp_sum = exp_sum * exp_of(max_value - ref) + chunk_sum;
    max_value = m;
  }
  template <int WIDTH>
  __device__ MaxExpSum allreduce() const {  // max first, then one rescale and a plain sum
    const float m = group_max<WIDTH>(max_value);
    return {m, group_sum<WIDTH>(exp_sum * exp_of(max_value - reference(m)))};
  }
};

// Backward: a sum (of gy * y for softmax, of gy for log_softmax), compensated (Kahan)
// within each thread. On long rows a thread adds hundreds of terms in sequence; the plain
// running sum's error, multiplied by exp(y) in the log_softmax gradient, came out at 5x
// torch's error at 262144 fp32 columns. Four extra flops a term, still memory bound.
struct Sum {
  float value, compensation;
  __device__ static Sum identity() { return {0.f, 0.f}; }
  __device__ void add(float term) {
    const float corrected = term - compensation;
    const float total = value + corrected;
    compensation = (total - value) - corrected;
    value = total;
  }
  template <int WIDTH>
  __device__ Sum allreduce() const { return {group_sum<WIDTH>(value - compensation), 0.f}; }
};

// ---------------------------------------------------------------------------------------
// Ops: the inputs of a row, the pad value for lanes past the row end (it must leave the
// statistics unchanged), how values accumulate, and each output once the row's statistics
// are known. v[k][j] is element j of input k held by this thread.
struct ForwardOp {
  static constexpr int kInputs = 1;  // x
  static constexpr float kPad = kNegInf;
  using Stats = MaxExpSum;
  struct Epilogue {
    float max_value, scale;  // scale: 1 / sum (softmax) or log(sum) (log_softmax)
    bool log, values_are_exps;
  };
  template <int N>
  __device__ static void accumulate(Stats& s, const float (&v)[1][N], bool) { s.add<N>(v[0]); }
  __device__ static Epilogue finish(const Stats& s, bool log) {
    return {s.max_value, log ? logf(s.exp_sum) : 1.f / s.exp_sum, log, false};
  }
  // Path (a), whole row in registers: max first, then v becomes x - max (log_softmax) or
  // exp(x - max) (softmax), so that apply needs no second exp.
  template <int LANES, int N>
  __device__ static Epilogue reduce_in_registers(float (&v)[1][N], bool log) {
    float m = kNegInf;
#pragma unroll
    for (int j = 0; j < N; ++j) m = fmaxf(m, v[0][j]);
    m = group_max<LANES>(m);
    const float ref = MaxExpSum::reference(m);  // -inf rows still give NaN: 0 * (1 / 0)
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float e = exp_of(v[0][j] - ref);
      v[0][j] = log ? v[0][j] - ref : e;
      sum += e;
    }
    sum = group_sum<LANES>(sum);
    return {0.f, log ? logf(sum) : 1.f / sum, log, !log};
  }
  template <int N>
  __device__ static float apply(const Epilogue& e, const float (&v)[1][N], int j) {
    const float d = v[0][j] - e.max_value;
    return e.log ? d - e.scale : (e.values_are_exps ? d : exp_of(d)) * e.scale;
  }
};

struct BackwardOp {
  static constexpr int kInputs = 2;  // grad_out, out
  static constexpr float kPad = 0.f;
  using Stats = Sum;
  struct Epilogue {
    float sum;
    bool log;
  };
  template <int N>
  __device__ static void accumulate(Stats& s, const float (&v)[2][N], bool log) {
#pragma unroll
    for (int j = 0; j < N; ++j) s.add(log ? v[0][j] : v[0][j] * v[1][j]);
  }
  __device__ static Epilogue finish(const Stats& s, bool log) { return {s.value, log}; }
  template <int LANES, int N>
  __device__ static Epilogue reduce_in_registers(const float (&v)[2][N], bool log) {
    Stats s = Stats::identity();
    accumulate(s, v, log);
    return finish(s.allreduce<LANES>(), log);
  }
  template <int N>
  __device__ static float apply(const Epilogue& e, const float (&v)[2][N], int j) {
    const float gy = v[0][j], y = v[1][j];
    return e.log ? gy - expf(y) * e.sum : y * (gy - e.sum);  // full-accuracy exp: memory bound anyway
  }
};

template <typename T, int K>
struct RowArgs {
  const T* in[K];        // ForwardOp: {x}; BackwardOp: {grad_out, out}
  int64_t in_stride[K];  // row strides, in elements
  T* out;                // dense: row stride == cols
  int64_t rows, cols;    // cols < 2^31
  bool log;
};

}  // namespace
}  // namespace cuda_softmax
}  // namespace kernelforge
