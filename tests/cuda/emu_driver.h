// What the emulator drivers (attention_emu/emulate.cpp, gemm_emu/emulate.cpp) share: guarded
// buffers, the emulated schedule's command-line options and the input file. Included after the emulated
// instructions (attention_mma.cuh), whose kf_emu::State it sets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace kf_emu_driver {

// 16-byte aligned storage with guard bytes after it (a write past the end shows).
struct Buffer {
  static constexpr size_t kGuard = 64;
  std::vector<unsigned char> bytes;
  size_t size = 0;
  unsigned char* data() {
    return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(bytes.data()) + 15) / 16 * 16);
  }
  void allocate(size_t n, unsigned char fill) {
    size = n;
    bytes.assign(n + kGuard + 16, fill);
  }
  bool guard_intact(unsigned char fill) {
    for (size_t i = 0; i < kGuard; ++i)
      if (data()[size + i] != fill) return false;
    return true;
  }
};

// <eager|lazy> cp.async completion and <rr|low|high> thread order, as the tests pass them.
inline void set_schedule(const std::string& copies, const std::string& order) {
  kf_emu::State& s = kf_emu::st();
  s.lazy = copies == "lazy";
  s.order = order == "low" ? 1 : order == "high" ? 2 : 0;
}

// The driver's command line after any --smem query: <input> <output> <eager|lazy> <rr|low|high>.
// Sets the schedule and returns the opened input, or nullptr (usage printed) on a bad line.
inline std::FILE* open_input(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s <input> <output> <eager|lazy> <rr|low|high>\n", argv[0]);
    return nullptr;
  }
  set_schedule(argv[3], argv[4]);
  return std::fopen(argv[1], "rb");
}

}  // namespace kf_emu_driver
