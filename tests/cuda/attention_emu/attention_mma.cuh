// CPU emulation of kernelforge/cuda/csrc/attention_mma.cuh: the same functions, with the
// semantics the PTX ISA gives the instructions, so that attention_kernel.cuh compiles with
// g++ and its kernels run on the CPU (tests/cuda/test_attention_cuda.py).
//
// Every CUDA thread of a block is a fiber (ucontext) on one OS thread. Warp-collective
// instructions (mma, ldmatrix, shuffles, __syncwarp) and __syncthreads wait until every
// lane of the warp / thread of the block has arrived; the last one to arrive computes the
// results for all. The checks (each aborts with a message): lanes of a warp meeting at
// different collectives, deadlock, shared-memory accesses out of bounds or misaligned,
// global reads outside the registered input buffers, and (with lazy copies) ldmatrix
// reading shared memory that a cp.async still in flight will write.
//   copies: eager (a cp.async lands when issued) or lazy (when the issuing thread waits for
//           its group): the two extremes the hardware may take.
//   order:  which runnable thread resumes next: round robin, the lowest index (warp 0 runs
//           ahead until a barrier stops it) or the highest.
// Shared memory starts as 0xFF bytes (NaN in float16 / bfloat16), so reading what was
// never written shows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <ucontext.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

namespace kf_emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

enum class Op { kMma, kLdsm, kLdsmTrans, kQuadMax, kQuadSum, kWarpSync };

struct Slot {
  const unsigned char* addr = nullptr;
  uint32_t a[4] = {}, b[2] = {}, r[4] = {};
  float c[4] = {}, value = 0.f;
};

struct Copy {
  unsigned char* dst;
  const unsigned char* src;  // null: zero fill
};

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  Dim3 tid;
  int warp = 0, lane = 0;
  bool done = false;
  enum { kRunning, kWarpWait, kBlockWait } wait = kRunning;
  uint64_t wait_phase = 0;
  std::vector<Copy> open_group;
  std::vector<std::vector<Copy>> groups;
};

struct Warp {
  Slot slot[32];
  int arrived = 0;
  uint64_t phase = 0;
  Op op = Op::kWarpSync;
  void (*compute)(Warp&) = nullptr;
};

struct State {
  bool lazy = false;
  int order = 0;  // 0 round robin, 1 lowest first, 2 highest first
  std::vector<std::pair<const unsigned char*, size_t>> readable;
  std::vector<unsigned char> smem;
  std::vector<int> pending;  // per 16-byte chunk of shared memory: cp.async in flight
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int block_arrived = 0;
  uint64_t block_phase = 0;
  Fiber* current = nullptr;
  ucontext_t scheduler;
  Dim3 block_idx, grid_dim, block_dim;
  std::function<void()> kernel;
};

inline State& st() {
  static State s;
  return s;
}

[[noreturn]] inline void fail(const char* fmt, ...) {
  std::va_list args;
  va_start(args, fmt);
  std::fprintf(stderr, "emulation error (block %u,%u,%u): ", st().block_idx.x, st().block_idx.y, st().block_idx.z);
  std::vfprintf(stderr, fmt, args);
  std::fprintf(stderr, "\n");
  va_end(args);
  std::fflush(stderr);
  std::_Exit(3);  // not exit(): static destructors must not run on a fiber's stack
}

inline void yield() { swapcontext(&st().current->ctx, &st().scheduler); }

inline size_t smem_offset(const void* p, size_t bytes, const char* what) {
  const auto* c = static_cast<const unsigned char*>(p);
  State& s = st();
  if (c < s.smem.data() || c + bytes > s.smem.data() + s.smem.size())
    fail("%s: shared address outside the %zu bytes of dynamic shared memory", what, s.smem.size());
  const size_t off = static_cast<size_t>(c - s.smem.data());
  if (off % 16 != 0) fail("%s: shared address not 16-byte aligned (offset %zu)", what, off);
  return off;
}

inline void check_readable(const void* p, size_t bytes) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (reinterpret_cast<uintptr_t>(c) % 16 != 0) fail("cp.async: global source not 16-byte aligned");
  for (const auto& [base, size] : st().readable)
    if (c >= base && c + bytes <= base + size) return;
  fail("cp.async: global read outside every input buffer");
}

// Waits until all 32 lanes of this warp arrive with the same op; the last computes.
inline Slot& warp_collective(Op op, const Slot& in, void (*compute)(Warp&)) {
  State& s = st();
  Fiber* f = s.current;
  Warp& w = s.warps[f->warp];
  if (w.arrived == 0) {
    w.op = op, w.compute = compute;
  } else if (w.op != op || w.compute != compute) {
    fail("warp %d: lane %d reached a different warp-collective instruction than its warp", f->warp, f->lane);
  }
  w.slot[f->lane] = in;
  const uint64_t phase = w.phase;
  if (++w.arrived == 32) {
    if (w.compute) w.compute(w);
    w.arrived = 0;
    ++w.phase;
  } else {
    f->wait = Fiber::kWarpWait, f->wait_phase = phase;
    while (w.phase == phase) yield();
    f->wait = Fiber::kRunning;
  }
  return w.slot[f->lane];
}

inline void land(const Copy& c) {
  if (c.src) std::memcpy(c.dst, c.src, 16);
  else std::memset(c.dst, 0, 16);
}

inline bool runnable(const Fiber& f) {
  const State& s = st();
  if (f.done) return false;
  if (f.wait == Fiber::kWarpWait) return s.warps[f.warp].phase != f.wait_phase;
  if (f.wait == Fiber::kBlockWait) return s.block_phase != f.wait_phase;
  return true;
}

inline void fiber_main() {
  st().kernel();
  st().current->done = true;
  // returning resumes uc_link: the scheduler
}

// Runs kernel() for every block of the grid, one block at a time.
inline void run_grid(Dim3 grid, int threads, size_t smem_bytes, std::function<void()> kernel) {
  State& s = st();
  s.kernel = std::move(kernel);
  s.grid_dim = grid;
  s.block_dim = {static_cast<unsigned>(threads), 1, 1};
  if (threads % 32 != 0) fail("block of %d threads is not whole warps", threads);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        s.block_idx = {bx, by, bz};
        s.smem.assign(smem_bytes, 0xFF);
        s.pending.assign((smem_bytes + 15) / 16, 0);
        s.fibers.clear();
        s.fibers.resize(threads);
        s.warps.assign(threads / 32, Warp{});
        s.block_arrived = 0;
        s.block_phase = 0;
        for (int t = 0; t < threads; ++t) {
          Fiber& f = s.fibers[t];
          f.tid = {static_cast<unsigned>(t), 0, 0};
          f.warp = t / 32, f.lane = t % 32;
          f.stack.resize(256 * 1024);
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = &s.scheduler;
          makecontext(&f.ctx, fiber_main, 0);
        }
        int next = 0;
        for (;;) {
          int pick = -1;
          if (s.order == 0) {
            for (int k = 0; k < threads; ++k) {
              const int c = (next + k) % threads;
              if (runnable(s.fibers[c])) { pick = c; break; }
            }
          } else if (s.order == 1) {
            for (int c = 0; c < threads && pick < 0; ++c)
              if (runnable(s.fibers[c])) pick = c;
          } else {
            for (int c = threads - 1; c >= 0 && pick < 0; --c)
              if (runnable(s.fibers[c])) pick = c;
          }
          if (pick < 0) break;
          next = pick + 1;
          s.current = &s.fibers[pick];
          swapcontext(&s.scheduler, &s.current->ctx);
        }
        for (const Fiber& f : s.fibers) {
          if (!f.done) fail("deadlock: thread %u waits forever (warp or block barrier)", f.tid.x);
          if (!f.open_group.empty() || !f.groups.empty()) fail("thread %u ends with cp.async in flight", f.tid.x);
        }
      }
}

template <typename T>
float to_float(uint16_t bits) {
  T v;
  std::memcpy(&v, &bits, 2);
  if constexpr (sizeof(T) == 2 && std::is_same_v<T, __half>) return __half2float(v);
  else return __bfloat162float(v);
}

// mma.m16n8k16 fragments (PTX ISA): lane l, g = l / 4, t = l % 4.
template <typename T>
void compute_mma(Warp& w) {
  float A[16][16], B[16][8], C[16][8];
  const auto lo = [](uint32_t x) { return to_float<T>(static_cast<uint16_t>(x & 0xFFFF)); };
  const auto hi = [](uint32_t x) { return to_float<T>(static_cast<uint16_t>(x >> 16)); };
  for (int l = 0; l < 32; ++l) {
    const Slot& s = w.slot[l];
    const int g = l / 4, t = l % 4;
    A[g][2 * t] = lo(s.a[0]), A[g][2 * t + 1] = hi(s.a[0]);
    A[g + 8][2 * t] = lo(s.a[1]), A[g + 8][2 * t + 1] = hi(s.a[1]);
    A[g][2 * t + 8] = lo(s.a[2]), A[g][2 * t + 9] = hi(s.a[2]);
    A[g + 8][2 * t + 8] = lo(s.a[3]), A[g + 8][2 * t + 9] = hi(s.a[3]);
    B[2 * t][g] = lo(s.b[0]), B[2 * t + 1][g] = hi(s.b[0]);
    B[2 * t + 8][g] = lo(s.b[1]), B[2 * t + 9][g] = hi(s.b[1]);
    C[g][2 * t] = s.c[0], C[g][2 * t + 1] = s.c[1], C[g + 8][2 * t] = s.c[2], C[g + 8][2 * t + 1] = s.c[3];
  }
  float D[16][8];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      double acc = C[i][j];
      for (int k = 0; k < 16; ++k) acc += static_cast<double>(A[i][k]) * B[k][j];
      D[i][j] = static_cast<float>(acc);
    }
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    float* c = w.slot[l].c;
    c[0] = D[g][2 * t], c[1] = D[g][2 * t + 1], c[2] = D[g + 8][2 * t], c[3] = D[g + 8][2 * t + 1];
  }
}

inline uint16_t load16(const unsigned char* row, int e) {
  uint16_t v;
  std::memcpy(&v, row + 2 * e, 2);
  return v;
}

// ldmatrix x4: lanes 8i..8i+7 address the rows of matrix i.
template <bool TRANS>
void compute_ldsm(Warp& w) {
  State& s = st();
  for (int l = 0; l < 32; ++l) {
    const size_t off = smem_offset(w.slot[l].addr, 16, "ldmatrix");
    if (s.lazy && s.pending[off / 16] > 0) fail("ldmatrix reads shared memory a cp.async in flight will write");
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      uint16_t e0, e1;
      if (!TRANS) {
        const unsigned char* row = w.slot[8 * i + g].addr;
        e0 = load16(row, 2 * t), e1 = load16(row, 2 * t + 1);
      } else {
        e0 = load16(w.slot[8 * i + 2 * t].addr, g), e1 = load16(w.slot[8 * i + 2 * t + 1].addr, g);
      }
      w.slot[l].r[i] = static_cast<uint32_t>(e0) | static_cast<uint32_t>(e1) << 16;
    }
  }
}

// The hardware's butterflies: v op= shfl_xor(v, 1); v op= shfl_xor(v, 2).
template <bool MAX>
void compute_quad(Warp& w) {
  float v1[32], v2[32];
  for (int l = 0; l < 32; ++l) {
    const float a = w.slot[l].value, b = w.slot[l ^ 1].value;
    v1[l] = MAX ? std::fmax(a, b) : a + b;
  }
  for (int l = 0; l < 32; ++l) v2[l] = MAX ? std::fmax(v1[l], v1[l ^ 2]) : v1[l] + v1[l ^ 2];
  for (int l = 0; l < 32; ++l) w.slot[l].value = v2[l];
}

}  // namespace kf_emu

#define threadIdx (::kf_emu::st().current->tid)
#define blockIdx (::kf_emu::st().block_idx)
#define gridDim (::kf_emu::st().grid_dim)
#define blockDim (::kf_emu::st().block_dim)

namespace kernelforge {
namespace attention {

constexpr float kNegInf = -__builtin_huge_valf();

template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  kf_emu::Slot in;
  for (int i = 0; i < 4; ++i) in.a[i] = a[i], in.c[i] = d[i];
  in.b[0] = b0, in.b[1] = b1;
  const kf_emu::Slot& out = kf_emu::warp_collective(kf_emu::Op::kMma, in, kf_emu::compute_mma<T>);
  for (int i = 0; i < 4; ++i) d[i] = out.c[i];
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  kf_emu::Slot in;
  in.addr = static_cast<const unsigned char*>(row);
  const kf_emu::Slot& out = kf_emu::warp_collective(kf_emu::Op::kLdsm, in, kf_emu::compute_ldsm<false>);
  for (int i = 0; i < 4; ++i) r[i] = out.r[i];
}

inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  kf_emu::Slot in;
  in.addr = static_cast<const unsigned char*>(row);
  const kf_emu::Slot& out = kf_emu::warp_collective(kf_emu::Op::kLdsmTrans, in, kf_emu::compute_ldsm<true>);
  for (int i = 0; i < 4; ++i) r[i] = out.r[i];
}

inline void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  kf_emu::State& s = kf_emu::st();
  const size_t off = kf_emu::smem_offset(smem_dst, 16, "cp.async destination");
  if (valid) kf_emu::check_readable(gmem_src, 16);
  const kf_emu::Copy c{static_cast<unsigned char*>(smem_dst), valid ? static_cast<const unsigned char*>(gmem_src)
                                                                     : nullptr};
  if (!s.lazy) {
    kf_emu::land(c);
  } else {
    s.current->open_group.push_back(c);
    ++s.pending[off / 16];
  }
}

inline void cp_async_commit() {
  kf_emu::Fiber* f = kf_emu::st().current;
  f->groups.push_back(std::move(f->open_group));
  f->open_group.clear();
}

template <int PENDING>
inline void cp_async_wait() {
  kf_emu::State& s = kf_emu::st();
  kf_emu::Fiber* f = s.current;
  while (f->groups.size() > static_cast<size_t>(PENDING)) {
    for (const kf_emu::Copy& c : f->groups.front()) {
      kf_emu::land(c);
      --s.pending[static_cast<size_t>(c.dst - s.smem.data()) / 16];
    }
    f->groups.erase(f->groups.begin());
  }
}

inline void block_sync() {
  kf_emu::State& s = kf_emu::st();
  kf_emu::Fiber* f = s.current;
  const uint64_t phase = s.block_phase;
  if (++s.block_arrived == static_cast<int>(s.fibers.size())) {
    s.block_arrived = 0;
    ++s.block_phase;
  } else {
    f->wait = kf_emu::Fiber::kBlockWait, f->wait_phase = phase;
    while (s.block_phase == phase) kf_emu::yield();
    f->wait = kf_emu::Fiber::kRunning;
  }
}

inline void warp_sync() { kf_emu::warp_collective(kf_emu::Op::kWarpSync, kf_emu::Slot{}, nullptr); }

inline float quad_max(float v) {
  kf_emu::Slot in;
  in.value = v;
  return kf_emu::warp_collective(kf_emu::Op::kQuadMax, in, kf_emu::compute_quad<true>).value;
}
inline float quad_sum(float v) {
  kf_emu::Slot in;
  in.value = v;
  return kf_emu::warp_collective(kf_emu::Op::kQuadSum, in, kf_emu::compute_quad<false>).value;
}

inline float fast_exp2(float x) { return std::exp2(x); }

template <typename T>
inline uint32_t pack2(float lo, float hi);
template <>
inline uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t r;
  std::memcpy(&r, &h, 4);
  return r;
}
template <>
inline uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t r;
  std::memcpy(&r, &h, 4);
  return r;
}

inline int opaque(int x) { return x; }

inline unsigned char* dynamic_smem() { return kf_emu::st().smem.data(); }

}  // namespace attention
}  // namespace kernelforge
