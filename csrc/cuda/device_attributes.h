// Attributes of the current CUDA device, asked of the driver once per device: launch paths read
// them on every call and are host-latency bound.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>

namespace kvfuse {

// cudaDeviceGetAttribute(A) of the current device, cached per device (devices past the cache's
// size are asked every time).
template <cudaDeviceAttr A>
int cached_device_attribute() {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices] = {};  // value + 1; 0: not asked yet
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const bool cached = device >= 0 && device < kDevices;
  if (cached) {
    const int value = known[device].load(std::memory_order_relaxed);
    if (value != 0) return value - 1;
  }
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, A, device));
  if (cached) known[device].store(value + 1, std::memory_order_relaxed);
  return value;
}

}  // namespace kvfuse
