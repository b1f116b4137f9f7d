// Scalar encode math shared by the CPU and CUDA kernels. It restates
// kvfuse/ops/reference.py operation by operation (same order, same float32 roundings), so
// both kernels are bit-identical to the reference by construction:
//
//   FP8:   q = clamp(x / scale, -max, max)  (IEEE division; NaN passes the clamp)
//          stored = rne(q) in e4m3fn / e5m2; NaN -> 0x7F | sign, as c10's conversion does
//   NVFP4: per block of 16: amax = max |x_i| (NaN ignored)
//          s = e4m3_rne(min(amax / (gs * 6), 448))       (min keeps NaN, like torch.clamp)
//          r = 1 / (float(s) * gs) (once per block), or 0 where that divisor is not > 0
//          q_i = x_i * r
//          code_i = nearest E2M1 magnitude (ties to even, saturating) | (q_i < 0) << 3; NaN -> +0
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVFUSE_HD __host__ __device__ __forceinline__
#else
#define KVFUSE_HD inline
#endif

namespace kvfuse {

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr int kNvfp4Block = 16;

KVFUSE_HD float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

KVFUSE_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

// e4m3fn byte -> float32, exact (every e4m3fn value is a float32).
KVFUSE_HD float e4m3_bits_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t exp = (b >> 3) & 0xF, man = b & 0x7;
  if (exp == 0xF && man == 0x7) return bits_to_float(sign | 0x7FC00000u);
  if (exp == 0) return bits_to_float(sign) + (sign ? -1.0f : 1.0f) * static_cast<float>(man) * 0.001953125f;
  return bits_to_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// torch.clamp semantics: NaN is neither above nor below, so it comes back unchanged.
KVFUSE_HD float clamp_keep_nan(float q, float limit) {
  return q > limit ? limit : (q < -limit ? -limit : q);
}

// float32 -> 4-bit E2M1 code: the nearest E2M1 magnitude (0, .5, 1, 1.5, 2, 3, 4, 6), ties to
// the even mantissa, saturating at 6; NaN encodes as +0. Counting the seven midpoints would
// say the same; this form is rint on the binade's grid (steps of 0.5 below 2, of 1 in [2, 4),
// of 2 from 4), about half the ALU work, and that work is what bounds the NVFP4 kernels.
// Capping |q| at 8 keeps the scaled value <= 4, so adding 1.5 * 2^23 (a * scale is exact,
// scale a power of two) rounds it to nearest even and leaves the integer in the low mantissa
// bits. Checked against the threshold form on every float32 bit pattern.
KVFUSE_HD uint8_t e2m1_code(float q) {
  const float a = q == q ? fminf(fabsf(q), 8.0f) : 0.0f;
  const bool big = a >= 4.0f, mid = a >= 2.0f;
  const float scale = big ? 0.5f : (mid ? 1.0f : 2.0f);
  const uint32_t base = big ? 4u : (mid ? 2u : 0u);
  const uint32_t steps = float_to_bits(a * scale + 12582912.0f) - 0x4B400000u;
  const uint32_t mag = steps + base < 7u ? steps + base : 7u;
  return static_cast<uint8_t>(mag | (q < 0.0f ? 8u : 0u));
}

// e2m1_code for a q that is not NaN, with no select but the sign's: the binade comes from the
// exponent bits (the form kvfuse/ops/triton/kv_write.py uses). With a = min(|q|, 6) and
// e = max(a's exponent bits, 1.0's), the binade's step m = 2^(1-k) (k = 0, 1, 2 below 2, in [2, 4),
// from 4) is the float with bits 0x7F800000 - e, and e >> 22 = 254 + 2k; a * m is exact, so adding
// 1.5 * 2^23 + 2 leaves rint(a * m) + 2 in the sum's low bits, and adding e >> 22 makes its low 3
// bits the magnitude code rint(a * m) + 2k. Equal to e2m1_code on every non-NaN float32 (checked
// exhaustively on the host); NaN must be zeroed before (this form encodes it as 7).
KVFUSE_HD uint32_t e2m1_code_not_nan(float q) {
  const float a = fminf(fabsf(q), 6.0f);
  const uint32_t bits = float_to_bits(a) & 0x7F800000u;
  const uint32_t e = bits > 0x3F800000u ? bits : 0x3F800000u;
  const uint32_t sum = float_to_bits(a * bits_to_float(0x7F800000u - e) + 12582914.0f) + (e >> 22);
  return (sum & 7u) | (q < 0.0f ? 8u : 0u);
}

// e2m1_code_not_nan's code unmasked, as an offset from kE2m1CodeBias: the sum's bits above the
// code are a constant (1.5 * 2^23 + 2 + rint(a * m) stays in [2^23, 2^24), bits 0x4B400002 +
// rint(a * m), and e >> 22 = 254 + 2k), and the sign bit is 8 more in the addend where q < 0, a
// select of the constant where e2m1_code_not_nan selects the bit and masks the code. A packer that
// adds these words at their nibbles subtracts the biases once for all of them. Equal to
// kE2m1CodeBias + e2m1_code_not_nan(q) on every non-NaN float32 (checked on all of them on the
// host once; tests/ops/test_encode_math_host.py checks every one in the binades where the code
// changes and every 61st bit pattern elsewhere).
constexpr uint32_t kE2m1CodeBias = 0x4B400100u;
KVFUSE_HD uint32_t e2m1_code_biased(float q) {
  const float a = fminf(fabsf(q), 6.0f);
  const uint32_t bits = float_to_bits(a) & 0x7F800000u;
  const uint32_t e = bits > 0x3F800000u ? bits : 0x3F800000u;
  const float addend = q < 0.0f ? 12582922.0f : 12582914.0f;
  return float_to_bits(a * bits_to_float(0x7F800000u - e) + addend) + (e >> 22);
}

// The block-scale half of the NVFP4 math; to_e4m3 is the device's RNE float -> e4m3fn byte.
// from_e4m3: the byte's value (a faster exact decode where the device has one).
template <class ToE4M3, class FromE4M3>
KVFUSE_HD uint8_t nvfp4_block_scale(float amax, float gs, ToE4M3 to_e4m3, float* denom, FromE4M3 from_e4m3) {
  float s = amax / (gs * 6.0f);
  s = s > kE4M3Max ? kE4M3Max : s;
  const uint8_t bits = to_e4m3(s);
  *denom = from_e4m3(bits) * gs;
  return bits;
}

template <class ToE4M3>
KVFUSE_HD uint8_t nvfp4_block_scale(float amax, float gs, ToE4M3 to_e4m3, float* denom) {
  return nvfp4_block_scale(amax, gs, to_e4m3, denom, [](uint8_t b) { return e4m3_bits_to_float(b); });
}

}  // namespace kvfuse
