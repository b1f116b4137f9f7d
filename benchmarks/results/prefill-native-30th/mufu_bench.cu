// Throughput of MUFU.EX2 in f32 / f16 / bf16 forms and of the f16x2 polynomial, per SM and cycle.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
constexpr int kChains = 8, kIters = 4096;
__device__ __forceinline__ float ex2f(float x) { float y; asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ uint16_t ex2h(uint16_t x) { uint16_t y; asm volatile("ex2.approx.f16 %0, %1;" : "=h"(y) : "h"(x)); return y; }
__device__ __forceinline__ uint32_t ex2h2(uint32_t x) { uint32_t y; asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x)); return y; }
__device__ __forceinline__ uint32_t ex2b2(uint32_t x) { uint32_t y; asm volatile("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(y) : "r"(x)); return y; }
__device__ __forceinline__ uint32_t poly2(uint32_t x) {
  uint32_t t, u, g, h, p;
  asm volatile("max.f16x2 %0, %1, %2;" : "=r"(x) : "r"(x), "r"(0xCB40CB40u));
  asm volatile("add.rn.f16x2 %0, %1, %2;" : "=r"(t) : "r"(x), "r"(0x660E660Eu));
  asm volatile("sub.rn.f16x2 %0, %1, %2;" : "=r"(u) : "r"(t), "r"(0x660E660Eu));
  asm volatile("sub.rn.f16x2 %0, %1, %2;" : "=r"(g) : "r"(x), "r"(u));
  asm volatile("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(h) : "r"(g), "r"(0x01590159u), "r"(0x03FB03FBu));
  asm volatile("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(p) : "r"(g), "r"(h), "r"(0x05A905A9u));
  asm volatile("mad.lo.u32 %0, %1, 1024, %2;" : "=r"(p) : "r"(t & 0x003F003Fu), "r"(p));
  return p ^ 0x80008000u;  // keep the input negative and bounded
}
template <int kind>
__global__ void bench(uint32_t* out, long long* cycles) {
  uint32_t v[kChains]; float f[kChains];
  for (int c = 0; c < kChains; ++c) { v[c] = 0xBC00BC00u ^ (threadIdx.x + c); f[c] = -1.0f - 0.001f * (threadIdx.x + c); }
  __syncthreads();
  long long t0 = clock64();
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if (kind == 0) f[c] = -ex2f(f[c]);
      if (kind == 1) v[c] = ex2h((uint16_t)v[c]) ^ 0x8000u;
      if (kind == 2) v[c] = ex2h2(v[c]) ^ 0x80008000u;
      if (kind == 3) v[c] = ex2b2(v[c]) ^ 0x80008000u;
      if (kind == 4) v[c] = poly2(v[c]);
    }
  }
  long long t1 = clock64();
  uint32_t acc = 0;
  for (int c = 0; c < kChains; ++c) acc ^= v[c] ^ __float_as_uint(f[c]);
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int blocks = sms * 4, threads = 256;
  uint32_t* out; long long* cyc; cudaMalloc(&out, blocks * threads * 4); cudaMalloc(&cyc, blocks * 8);
  const char* names[] = {"ex2.f32 (1 value)", "ex2.f16 (1 value)", "ex2.f16x2 (2 values)", "ex2.bf16x2 (2 values)", "poly f16x2 (2 values)"};
  const int values[] = {1, 1, 2, 2, 2};
  for (int kind = 0; kind < 5; ++kind) {
    for (int rep = 0; rep < 2; ++rep) {
      switch (kind) { case 0: bench<0><<<blocks, threads>>>(out, cyc); break; case 1: bench<1><<<blocks, threads>>>(out, cyc); break;
        case 2: bench<2><<<blocks, threads>>>(out, cyc); break; case 3: bench<3><<<blocks, threads>>>(out, cyc); break; default: bench<4><<<blocks, threads>>>(out, cyc); }
    }
    cudaDeviceSynchronize();
    long long c[4096]; cudaMemcpy(c, cyc, blocks * 8, cudaMemcpyDeviceToHost);
    double mean = 0; for (int b = 0; b < blocks; ++b) mean += c[b]; mean /= blocks;
    // 4 resident blocks per SM run concurrently: values per SM-cycle = 4 * threads * iters * chains * values / cycles
    printf("%-24s %6.2f values per SM-cycle (%.0f cycles/block)\n", names[kind], 4.0 * threads * kIters * kChains * values[kind] / mean, mean);
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
