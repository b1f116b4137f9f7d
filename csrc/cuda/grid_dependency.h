// Programmatic dependent launch (Hopper and later) for kvfuse's CUDA kernels.
//
// A kernel launched with launch_maybe_dependent(..., dependent = true) may be scheduled while the
// kernel before it in the stream is still finishing its last blocks, so the launch latency and
// block ramp-up overlap that kernel's tail instead of following it. Such a kernel must call
// wait_for_prior_grids() before it touches global memory: it returns once every earlier kernel of
// the stream has completed and its writes are visible (and at once in a kernel launched
// normally, where both calls cost next to nothing). release_dependents() lets the next
// programmatically launched kernel be scheduled early in turn; that kernel still waits for this
// one's completion before it reads anything, so calling it early is always safe.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <utility>

#include "device_attributes.h"

// 1: the cache-write kernels (cache_write.cu, per_token_head_write.cu) are launched as
// programmatic dependents on sm_90+, so a write's launch overlaps the tail of the kernel before it
// (BENCHMARKS.md, eighteenth session). 0: plain launches.
#ifndef KVFUSE_WRITE_PDL
#define KVFUSE_WRITE_PDL 1
#endif

namespace kvfuse {

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void release_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The prologue of a kernel that may be launched as a dependent (kEnabled: the build launches it so):
// wait for the grids before it, then let the next one be scheduled.
template <bool kEnabled>
__device__ __forceinline__ void start_after_prior_grids() {
  if constexpr (kEnabled) {
    wait_for_prior_grids();
    release_dependents();
  }
}

// Whether the current device takes programmatic dependent launches (compute capability >= 9.0).
inline bool dependent_launch_supported() {
  return cached_device_attribute<cudaDevAttrComputeCapabilityMajor>() >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-serialization attribute
// when `dependent` (the caller decides per device: the attribute needs compute capability 9.0).
template <typename... Params, typename... Args>
void launch_maybe_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                            bool dependent, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = dependent ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace kvfuse
