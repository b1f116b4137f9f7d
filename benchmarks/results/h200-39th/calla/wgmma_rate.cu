// Microbenchmark: cycles per iteration of the e4m3 prefill's product groups, one or two warpgroups
// issuing at once, one block per SM. Not part of kvfuse. Build and run from this directory:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/wgmma_rate wgmma_rate.cu && /tmp/wgmma_rate
// Modes 8-11 were added after the run in wgmma_rate_modes0-7.txt; modes 0-7 are unchanged.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "../../../../csrc/cuda/hopper_mma.h"

using namespace kvfuse::hopper;

constexpr int kIters = 4000;

struct __align__(1024) Smem {
  uint8_t q[3][8192];     // per WG query tile 64 x 128 B
  uint8_t k[16384];       // 128 x 128 B
  uint8_t v[16384];       // V^T 128 x 128 B
  uint8_t ones[1024];     // 8 x 128 B
  int done;
};


// mode 0: S  = 4 SS m64n128k32
// mode 1: PV = 4 RS m64n128k32
// mode 2: PV + S (two commit groups), wait 0
// mode 3: PV + rowsums (4 RS m64n8k32) + S, kernel order
// mode 4: 16 SS m64n128k32 (four S chains) then wait
// mode 5: bf16 S = 8 SS m64n128k16
// mode 6: 4 RS m64n8k32 only
// mode 7: PV + rowsum + S with wait<1> / add product in between (kernel's consumer, no softmax)
template <int kMode>
__global__ void __launch_bounds__(256, 1) bench(int wgs, unsigned long long* out_cycles, unsigned long long* out_ns,
                                                float* sink) {
#if KVFUSE_HOPPER_MMA
  extern __shared__ uint8_t raw[];
  Smem& sm = *reinterpret_cast<Smem*>(raw + ((1024 - (reinterpret_cast<uintptr_t>(raw) & 1023)) & 1023));
  const int tid = threadIdx.x;
  for (int i = tid; i < (int)sizeof(Smem); i += blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u;
    reinterpret_cast<uint8_t*>(&sm)[i] = (uint8_t)(((h >> 13) & 0x1F) | 0x20);
  }
  fence_shared_for_async_proxy();
  __syncthreads();
  const int wg = tid / 128;
  if (wg >= wgs) return;
  if (tid == 0) *(volatile int*)&sm.done = 0;
  asm volatile("bar.sync 2, %0;" ::"r"(wgs * 128));
  if (kMode >= 8 && wg == 1) {
    // softmax-like ALU load: FFMA + ex2 over 64 registers until WG0 is done
    float x[64];
    for (int i = 0; i < 64; ++i) x[i] = 0.001f * (tid + i);
    float m = 0.f;
    asm volatile("bar.sync 1, %0;" ::"r"(wgs * 128));
    while (*(volatile int*)&sm.done == 0) {
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        float y = fmaf(x[i], 1.4426950f, -m);
        float e;
        asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(y));
        x[i] = fmaf(e, 0.5f, x[i]) * 0.5f;
        m = fmaxf(m, x[i]) * 0.999f;
      }
    }
    float acc = m;
    for (int i = 0; i < 64; ++i) acc += x[i];
    if (acc == 12345.f) sink[tid] = acc;
    return;
  }
  const SmemDesc q = SmemDesc::swizzle128(smem_addr(sm.q[wg]), 16, 1024);
  const SmemDesc k = SmemDesc::swizzle128(smem_addr(sm.k), 16, 1024);
  const SmemDesc v = SmemDesc::swizzle128(smem_addr(sm.v), 16, 1024);
  const SmemDesc ones = SmemDesc::swizzle128(smem_addr(sm.ones), 16, 1024);
  float s[64], o[64], rs[4] = {0, 0, 0, 0}, total[64];
  for (int i = 0; i < 64; ++i) { s[i] = 0; o[i] = 0; total[i] = 0; }
  uint32_t pa[16];
  for (int i = 0; i < 16; ++i) pa[i] = 0x28282828u ^ (tid * 0x01010101u & 0x07070707u);
  __syncwarp();
  asm volatile("bar.sync 1, %0;" ::"r"(wgs * 128));
  const unsigned long long c0 = clock64();
  unsigned long long t0, issue_cycles = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
#pragma unroll 1
  for (int it = 0; it < kIters; ++it) {
    wgmma_fence();
    if constexpr (kMode == 0 || kMode == 9) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3_ss(s, (q + kk * 32).get(), (k + kk * 32).get(), kk > 0 || it > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
    } else if constexpr (kMode == 1 || kMode == 8) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
        wgmma_m64n128k32_e4m3_rs(o, a, (v + kk * 32).get(), kk > 0 || it > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(o);
    } else if constexpr (kMode == 2 || kMode == 3 || kMode == 7 || kMode == 10 || kMode == 11) {
      const unsigned long long ci = clock64();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
        wgmma_m64n128k32_e4m3_rs(o, a, (v + kk * 32).get(), kk > 0 || it > 0);
        if constexpr (kMode != 2) wgmma_m64n8k32_e4m3_rs(rs, a, (ones + kk * 32).get(), kk > 0 || it > 0);
      }
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3_ss(s, (q + kk * 32).get(), (k + kk * 32).get(), kk > 0 || it > 0);
      wgmma_commit();
      if constexpr (kMode == 11) issue_cycles += clock64() - ci;
      if constexpr (kMode == 7) {
        wgmma_wait<1>();
        fence_registers(o);
        for (int i = 0; i < 64; ++i) total[i] = fmaf(total[i], 0.999f, o[i]);
      }
      wgmma_wait<0>();
      fence_registers(s);
      fence_registers(o);
    } else if constexpr (kMode == 4) {
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3_ss(s, (q + kk * 32).get(), (k + kk * 32).get(), kk > 0 || it > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
    } else if constexpr (kMode == 5) {
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        wgmma_m64n128k16_ss<false, 0>(s, (q + (kk % 4) * 32 + (kk / 4) * 4096).get(), (k + (kk % 4) * 32 + (kk / 4) * 8192).get(), kk > 0 || it > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
    } else if constexpr (kMode == 6) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
        wgmma_m64n8k32_e4m3_rs(rs, a, (ones + kk * 32).get(), kk > 0 || it > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(rs);
    }
  }
  const unsigned long long c1 = clock64();
  if ((tid & 127) == 0) *(volatile int*)&sm.done = 1;
  unsigned long long t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  float acc = 0;
  for (int i = 0; i < 64; ++i) acc += s[i] + o[i] + total[i];
  acc += rs[0] + rs[1] + rs[2] + rs[3];
  if (acc == 12345.f) sink[tid] = acc;
  if ((tid & 127) == 0) {
    out_cycles[blockIdx.x * 3 + wg] = c1 - c0;
    out_ns[blockIdx.x * 3 + wg] = kMode == 11 ? issue_cycles : t1 - t0;
  }
#endif
}

template <int kMode>
void run(int wgs, int blocks, const char* name, double flop_per_iter_per_wg) {
  unsigned long long *dc, *dn;
  float* sink;
  cudaMalloc(&dc, blocks * 3 * 8);
  cudaMalloc(&dn, blocks * 3 * 8);
  cudaMalloc(&sink, 4096);
  const int smem = sizeof(Smem) + 1024;
  cudaFuncSetAttribute(bench<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  bench<kMode><<<blocks, 256, smem>>>(wgs, dc, dn, sink);  // warm
  cudaDeviceSynchronize();
  bench<kMode><<<blocks, 256, smem>>>(wgs, dc, dn, sink);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("%s: %s\n", name, cudaGetErrorString(e)); exit(1); }
  std::vector<unsigned long long> c(blocks * 3), n(blocks * 3);
  cudaMemcpy(c.data(), dc, blocks * 3 * 8, cudaMemcpyDeviceToHost);
  cudaMemcpy(n.data(), dn, blocks * 3 * 8, cudaMemcpyDeviceToHost);
  std::vector<double> cyc, ghz;
  for (int b = 0; b < blocks; ++b)
    for (int w = 0; w < (kMode >= 8 ? 1 : wgs); ++w) {
      cyc.push_back((double)c[b * 3 + w] / kIters);
      ghz.push_back((double)c[b * 3 + w] / n[b * 3 + w]);
    }
  std::sort(cyc.begin(), cyc.end());
  std::sort(ghz.begin(), ghz.end());
  const double med = cyc[cyc.size() / 2];
  const double sm_flop_per_cycle = flop_per_iter_per_wg * (kMode >= 8 ? 1 : wgs) / med;
  printf("%-34s wgs=%d cycles/iter/wg: med %8.1f min %8.1f max %8.1f  clock %.3f GHz  SM flop/cycle %7.0f\n", name, wgs, med,
         cyc.front(), cyc.back(), ghz[ghz.size() / 2], sm_flop_per_cycle);
  cudaFree(dc);
  cudaFree(dn);
  cudaFree(sink);
}

int main() {
  const int blocks = 132;
  const double n128k32 = 64.0 * 128 * 32 * 2, n8k32 = 64.0 * 8 * 32 * 2, n128k16 = 64.0 * 128 * 16 * 2;
  run<11>(1, blocks, "PV+rowsum+S (clock=issue share)", 8 * n128k32 + 4 * n8k32);
  run<11>(2, blocks, "PV+rowsum+S (clock=issue share)", 8 * n128k32 + 4 * n8k32);
  run<8>(2, blocks, "PV alone, other WG ALU load", 4 * n128k32);
  run<9>(2, blocks, "S alone, other WG ALU load", 4 * n128k32);
  run<10>(2, blocks, "PV+rowsum+S, other WG ALU load", 8 * n128k32 + 4 * n8k32);
  for (int wgs = 1; wgs <= 2; ++wgs) {
    run<0>(wgs, blocks, "S: 4 SS m64n128k32", 4 * n128k32);
    run<1>(wgs, blocks, "PV: 4 RS m64n128k32", 4 * n128k32);
    run<2>(wgs, blocks, "PV+S", 8 * n128k32);
    run<3>(wgs, blocks, "PV+rowsum+S", 8 * n128k32 + 4 * n8k32);
    run<7>(wgs, blocks, "PV+rowsum+S, wait1 add", 8 * n128k32 + 4 * n8k32);
    run<4>(wgs, blocks, "16 SS m64n128k32", 16 * n128k32);
    run<6>(wgs, blocks, "rowsum: 4 RS m64n8k32", 4 * n8k32);
    run<5>(wgs, blocks, "bf16 S: 8 SS m64n128k16", 8 * n128k16);
  }
  return 0;
}
