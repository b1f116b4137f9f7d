// Hopper (sm_90a) building blocks of csrc/cuda/prefill_attention.cu: shared-memory barriers
// (mbarrier), tensor-memory-accelerator tile loads (cp.async.bulk.tensor) and warpgroup MMA
// (wgmma.mma_async) with shared-memory matrix descriptors. Each wraps one PTX instruction (PTX ISA
// 8.0+, "Asynchronous warpgroup level matrix multiply-accumulate" and "Tensor copy"); the
// layouts they assume are stated where they are used. Device code only, and only compiled into
// sm_90a targets (KVFUSE_HOPPER_MMA is 1 there, 0 elsewhere, where callers compile a stub).
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KVFUSE_HOPPER_MMA 1
#else
#define KVFUSE_HOPPER_MMA 0
#endif

namespace kvfuse {
namespace hopper {

#if KVFUSE_HOPPER_MMA

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier: arrival counts plus expected transaction bytes, waited on by phase parity.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (the tensor copies that complete them).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One arrival that also announces `bytes` more to come from tensor copies.
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

// ---- tensor memory accelerator: a 2D box of a tensor map into shared memory, completing `bar`.
// c0 is the innermost coordinate (elements), c1 the row; rows past the tensor read as zeros.
__device__ __forceinline__ void tma_load_2d(void* dst, const void* tensor_map, int32_t c0, int32_t c1,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

// The reverse: a 2D box from shared memory into the tensor (rows past the tensor are not written),
// in this thread's bulk group; the source stays untouched until bulk_wait_read says so.
__device__ __forceinline__ void tma_store_2d(const void* tensor_map, int32_t c0, int32_t c1, const void* src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
               ::"l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(smem_addr(src)), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Returns once this thread's committed bulk stores have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
}

// ---- named barriers among a subset of warps (id 0 is __syncthreads').
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- register budgets of warpgroups specialised as producers (fewer) and consumers (more).
template <uint32_t kRegisters>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

template <uint32_t kRegisters>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

// ---- warpgroup MMA.
// A shared-memory matrix descriptor for the 128-byte swizzle (what a tensor map with
// CU_TENSOR_MAP_SWIZZLE_128B writes, from 1024-byte aligned buffers): start address, leading and
// stride byte offsets (each >> 4), layout type 1 (128B swizzle) in bits 62-63.
__device__ __forceinline__ uint64_t swizzle128_desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

// swizzle128_desc as its two 32-bit words, for stepping through tiles: the start address field
// (bits 0-13, address / 16) is the low word's, and for 16-byte multiples with start + bytes below
// 2^18 (all of shared memory) desc(start + bytes) = desc(start) + bytes / 16 with no carry out of
// the field. So a step is one 32-bit add instead of the mask, shift and merge of a fresh descriptor.
struct SmemDesc {
  uint32_t lo, hi;
  __device__ __forceinline__ static SmemDesc swizzle128(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
    const uint64_t d = swizzle128_desc(addr, leading_bytes, stride_bytes);
    return {static_cast<uint32_t>(d), static_cast<uint32_t>(d >> 32)};
  }
  __device__ __forceinline__ SmemDesc operator+(uint32_t bytes) const { return {lo + (bytes >> 4), hi}; }
  __device__ __forceinline__ uint64_t get() const { return (static_cast<uint64_t>(hi) << 32) | lo; }
};

// Orders register writes by ordinary instructions before the wgmma that reads those registers.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across an asynchronous MMA.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The 64 fp32 accumulators of an m64n128 product as the PTX operands %0..%63 of an asm
// statement, and their read-write constraints (d: float[64]).
#define KVFUSE_WGMMA_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define KVFUSE_WGMMA_D64_OUT(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// D (64 x 128, fp32) (+)= A (64 x 16, shared, K-major) * B (16 x 128, shared; K-major when
// kTransB is 0, N-major when 1). 16-bit inputs: kHalf selects fp16, else bf16. Accumulator layout
// (per warp w of the warpgroup, g = lane / 4, t = lane % 4): d[4j + 0, 1] = row 16w + g, columns
// 8j + 2t, 8j + 2t + 1; d[4j + 2, 3] = row 16w + g + 8, same columns.
template <bool kHalf, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " KVFUSE_WGMMA_D64 ", %64, %65, p, 1, 1, 0, %67;\n}\n"
        : KVFUSE_WGMMA_D64_OUT(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " KVFUSE_WGMMA_D64 ", %64, %65, p, 1, 1, 0, %67;\n}\n"
        : KVFUSE_WGMMA_D64_OUT(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)), "n"(kTransB));
  }
}

// The same with A from registers: a[0..3] = the warp's fragment of mma.m16n8k16's A layout (rows
// 16w + g and + 8, columns 2t, 2t + 1 and + 8; the low half of each register the lower column),
// i.e. exactly the accumulator layout above for 16 of its columns, packed in pairs.
template <bool kHalf, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " KVFUSE_WGMMA_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
        : KVFUSE_WGMMA_D64_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " KVFUSE_WGMMA_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
        : KVFUSE_WGMMA_D64_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB));
  }
}

// D (64 x 128, fp32) (+)= A (64 x 32, e4m3, shared, K-major) * B (32 x 128, e4m3, shared,
// K-major: FP8 operands have no transposed form). Accumulator layout as above.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                         bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " KVFUSE_WGMMA_D64 ", %64, %65, p, 1, 1;\n}\n"
      : KVFUSE_WGMMA_D64_OUT(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)));
}

// The same with A from registers: a[0..3] = the warp's fragment of mma.m16n8k32's 8-bit A layout
// (a0: row 16w + g, columns 4t .. 4t + 3, lowest byte first; a1: row + 8; a2, a3: columns + 16).
// D is started afresh when `accumulate` is false.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                         bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " KVFUSE_WGMMA_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : KVFUSE_WGMMA_D64_OUT(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)));
}

// D (64 x 8, fp32) (+)= A (64 x 32, e4m3, registers as above) * B (32 x 8, e4m3, shared, K-major).
// d[0, 1]: row 16w + g, columns 2t, 2t + 1; d[2, 3]: row + 8.
__device__ __forceinline__ void wgmma_m64n8k32_e4m3_rs(float (&d)[4], const uint32_t (&a)[4], uint64_t desc_b,
                                                       bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)));
}

// D (64 x 128, f16) (+)= A (64 x 32, e4m3, shared, K-major) * B (32 x 128, e4m3, shared, K-major):
// the f32 layout above with each pair of neighbouring columns in one f16x2 register, the lower
// column in the low half: d[2j] = row 16w + g, columns 8j + 2t, + 1; d[2j + 1] = row + 8.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_ss_f16(uint32_t (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                             bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f16.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]),
        "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]),
        "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]),
        "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)));
}

template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// f16x2 arithmetic on raw registers (low half = lower column).
__device__ __forceinline__ uint32_t hmax2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t hexp2(uint32_t a) {
  uint32_t d;
  asm("ex2.approx.f16x2 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}
// An f16x2 to e4m3 (round to nearest, saturating), the low half in the low byte.
__device__ __forceinline__ uint32_t e4m3x2_from_f16x2(uint32_t a) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(r) : "r"(a));
  return r;
}

// Makes this thread's ordinary shared-memory writes visible to the async proxy (wgmma operands).
__device__ __forceinline__ void fence_shared_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Two floats to e4m3 (round to nearest, saturating to +-448), `lo` in the low byte.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

#endif  // KVFUSE_HOPPER_MMA

}  // namespace hopper
}  // namespace kvfuse
