// FP8 encoding pieces shared by the CUDA kernels (cache_write.cu, rope_cache_write.cu): the
// division by a scale in FMA-pipe operations and the four-values-to-one-word FP8 conversion, both
// bit-identical to kvfuse/ops/reference.py (see cache_write.cu's header for the numerics).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace kvfuse {
namespace {

struct E4M3 {};
struct E5M2 {};
template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>;

// x / d correctly rounded (what div.rn.f32, and so torch, computes) in three FMA-pipe ops instead
// of div.rn's ~10: with r = rn(1/d), q0 = rn(x*r) is within an ulp of x/d, the residual
// fma(-q0, d, x) is exact, and one correction step q1 = rn(q0 + e*r) is the correctly rounded
// quotient (Markstein). The premises hold while nothing under- or overflows, which the fast
// window |d| in [2^-64, 2^64] ensures for every quotient an encoding can tell apart: FP8 and
// E2M1 send |q| < 2^-17 to a signed zero, and there the residual is still a normal number.
// Outside the window, div.rn. Two things are left to the caller, as they are cheaper in bulk:
//   - q1 of a tiny quotient may be +0 where x/d is -0 or -tiny: copysign(q1, q0) (q0 always
//     holds the quotient's sign);
//   - an infinite q0 (x = inf, or x/d beyond float range) makes q1 NaN where x/d is inf: the
//     caller keeps q0 there (FP8 finds those among its NaN bytes, in a rarely taken branch).
struct Divider {
  float d, r;
  bool fast;
};

__device__ __forceinline__ Divider make_divider(float d) {
  const float a = fabsf(d);
  const bool fast = a >= 0x1p-64f && a <= 0x1p64f;
  return Divider{d, fast ? __frcp_rn(d) : 0.0f, fast};
}

struct Quotient {
  float q0, q1;  // rn(x * r) and the corrected quotient; equal on the div.rn path
};

// kFast: the divider is known to be in the fast window (checked once per block, not per value).
template <bool kFast>
__device__ __forceinline__ Quotient divide_parts(float x, const Divider v) {
  if constexpr (kFast) {
    const float q0 = __fmul_rn(x, v.r);
    return {q0, __fmaf_rn(__fmaf_rn(-q0, v.d, x), v.r, q0)};
  } else {
    const float q = __fdiv_rn(x, v.d);
    return {q, q};
  }
}

// x / d correctly rounded, the fix-ups above applied per value.
__device__ __forceinline__ float divide(float x, const Divider v) {
  const Quotient q = v.fast ? divide_parts<true>(x, v) : divide_parts<false>(x, v);
  return isnan(q.q1) ? q.q0 : copysignf(q.q1, q.q0);
}

template <typename Fp8>
constexpr __nv_fp8_interpretation_t kFp8Interp = std::is_same_v<Fp8, E4M3> ? __NV_E4M3 : __NV_E5M2;
template <typename Fp8>
constexpr uint32_t kFp8MaxCode = std::is_same_v<Fp8, E4M3> ? 0x7Eu : 0x7Bu;  // 448, 57344

// The FP8 byte of a quotient the fast path could not settle (a NaN byte): NaN when q0 is NaN,
// keeping its sign as c10's conversion does (the hardware writes one canonical NaN); otherwise
// q0 is infinite (x = inf, or x / d beyond float range) and the byte saturates.
template <typename Fp8>
__device__ __forceinline__ uint32_t fp8_special(float q0) {
  const uint32_t sign = (__float_as_uint(q0) >> 24) & 0x80u;
  return sign | (isnan(q0) ? 0x7Fu : kFp8MaxCode<Fp8>);
}

// Four quotients as four FP8 bytes of one word. The saturating convert sends finite overflow and
// inf to the largest finite value, so a byte whose low seven bits are all ones came from a NaN
// q1: a NaN input, or an infinite q0. Those are found word-wide and redone in a rarely taken
// branch; the common path pays a copysign per value and a few word-wide operations per four.
template <typename Fp8>
__device__ __forceinline__ uint32_t fp8x4(const Quotient (&q)[4]) {
  float c[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) c[k] = copysignf(q[k].q1, q[k].q0);
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(c[0], c[1]), __NV_SATFINITE, kFp8Interp<Fp8>);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c[2], c[3]), __NV_SATFINITE, kFp8Interp<Fp8>);
  uint32_t bytes = __byte_perm(lo, hi, 0x5410);
  const uint32_t low7_clear = ~bytes & 0x7F7F7F7Fu;  // 0 exactly in the NaN bytes
  const uint32_t is_nan = ~(low7_clear + 0x7F7F7F7Fu) & 0x80808080u;  // no carry crosses a byte
  if (__builtin_expect(is_nan != 0, 0)) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (is_nan & (0x80u << (8 * k))) bytes = (bytes & ~(0xFFu << (8 * k))) | (fp8_special<Fp8>(q[k].q0) << (8 * k));
    }
  }
  return bytes;
}

}  // namespace
}  // namespace kvfuse
