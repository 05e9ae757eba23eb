// A kernel that uses more than 48 KB of dynamic shared memory must be allowed to, per device,
// with cudaFuncSetAttribute, before its first launch there. Shared by the launchers of the
// attention and GEMM extensions.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace kernelforge {

// Raises Kernel's dynamic shared-memory limit to kSmemBytes on the current device, once per
// device and kernel (the devices 0..63 are remembered; any other asks again on every launch).
// Nothing to do at 48 KB or less.
template <auto Kernel, int kSmemBytes>
cudaError_t opt_in_shared_memory() {
  if constexpr (kSmemBytes > 48 * 1024) {
    static std::atomic<uint64_t> configured{0};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
    if (bit == 0 || !(configured.load(std::memory_order_relaxed) & bit)) {
      err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      if (err != cudaSuccess) return err;
      configured.fetch_or(bit, std::memory_order_relaxed);
    }
  }
  return cudaSuccess;
}

}  // namespace kernelforge
