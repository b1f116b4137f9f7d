// Shared-memory barriers (mbarrier) and bulk asynchronous copies from global into shared memory
// (cp.async.bulk), sm_90 and later: what csrc/cuda/prefill_attention.cu's tensor-map loads and
// cache_write.cu's pipelined rotary write complete their stages with. Each wraps one PTX
// instruction (PTX ISA 8.0+, "Parallel Synchronization and Communication Instructions: mbarrier"
// and "Data Movement and Conversion Instructions: cp.async.bulk"). Device code only: compiled
// where KVFUSE_ASYNC_COPY is 1 (__CUDA_ARCH__ >= 900); callers compile a stub elsewhere.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVFUSE_ASYNC_COPY 1
#else
#define KVFUSE_ASYNC_COPY 0
#endif

namespace kvfuse {
namespace hopper {

#if KVFUSE_ASYNC_COPY

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier: arrival counts plus expected transaction bytes, waited on by phase parity.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (the copies that complete them).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One arrival that also announces `bytes` more to come from asynchronous copies.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Returns once the phase of parity `parity` has completed. A fresh barrier is in phase 0, so
// waiting for parity 1 returns at once (the "previous" phase counts as complete).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// ---- bulk copy: `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory
// into this block's shared memory, completing that many transaction bytes on `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

#endif  // KVFUSE_ASYNC_COPY

}  // namespace hopper
}  // namespace kvfuse
