// The fused K/V write of FP8_PER_TOKEN_HEAD caches: each (token, head) row of the key and of the
// value is encoded with its own scale and scattered into a paged cache
// (num_blocks, 2, block_size, heads, D + 4) uint8, one pass over memory. Op:
// kvfuse_native::fp8_per_token_head_cache_write (this file declares and implements it).
//
// Numerics (bit-identical to kvfuse.kv_cache.fp8_per_token_head_quantize_reference), per row:
//
//   amax  = max |x_i| over the finite x_i (0 if none)
//   scale = max(amax / 448, 1e-6)          IEEE division
//   r     = 1 / scale                      IEEE division
//   q_i   = e4m3_rne(clamp(x_i * r, +-448)) the saturating hardware convert; NaN -> 0x7F | sign
//   row   = [q_0 .. q_{D-1} | scale as 4 little-endian bytes]
//
// Work split: a group of kLanes lanes owns one (token, head) and encodes its key row and its value
// row, 16 elements per lane where head_size % 16 == 0 (8 otherwise), both rows' loads issued before
// either is reduced. The group's amax is a shuffle reduction. The divisions are exact but cheap
// (Markstein's corrected product for amax / 448, the correctly rounded reciprocal for 1 / scale),
// and tokens, heads and pages come from multiply-shift dividers: each of these, and the 16
// elements per lane, measured a step toward the copy ceiling (BENCHMARKS.md, eleventh session).
// Cache rows (D + 4 bytes) are only 4-byte aligned: each lane stores its codes as words, and lane 0
// the scale. (Encoding whole tokens into shared memory and storing each slot's run of rows with
// 16-byte stores, and 8-byte stores shifted to the row's alignment, measured slower: BENCHMARKS.md,
// tenth and eleventh sessions.)
// Slots of -1 (padding) and beyond the cache are skipped: those rows stay as they were.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "grid_dependency.h"

namespace kvfuse {
namespace {

using at::cuda::detail::IntDivider;

constexpr int kThreads = 256;
constexpr int kMinElems = 8;  // per lane per row: 8, or 16 where head_size % 16 == 0

struct PthParams {
  const uint8_t* src[2];   // key, value
  int64_t src_tok, src_head;  // bytes (key and value share them: the host checks)
  uint8_t* cache;
  int64_t stride_block, stride_kv, stride_slot, stride_head;  // bytes
  const void* slots;
  bool slots64;
  int64_t capacity;  // num_blocks * block_size, < 2^31 (the host checks)
  IntDivider<uint32_t> heads, block_size;
  uint32_t items;  // num_tokens * num_heads, < 2^32 (the host checks)
  int head_size;
};

// A lane's kElems inputs of one row as loaded, whole 16-byte words.
template <typename In, int kElems>
struct RawRow {
  static constexpr int kWords = kElems * sizeof(In) / 16;
  uint4 w[kWords];
};

template <typename In, int kElems>
__device__ __forceinline__ RawRow<In, kElems> load_raw(const uint8_t* at) {
  RawRow<In, kElems> r;
#pragma unroll
  for (int k = 0; k < RawRow<In, kElems>::kWords; ++k) r.w[k] = __ldcs(reinterpret_cast<const uint4*>(at) + k);
  return r;
}

// The inputs as floats (exact for 16-bit inputs).
template <typename In, int kElems>
__device__ __forceinline__ void widen(const RawRow<In, kElems>& r, float (&x)[kElems]) {
#pragma unroll
  for (int k = 0; k < RawRow<In, kElems>::kWords; ++k) {
    const uint32_t w[4] = {r.w[k].x, r.w[k].y, r.w[k].z, r.w[k].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (sizeof(In) == 4) {
        x[4 * k + j] = __uint_as_float(w[j]);
      } else if constexpr (std::is_same_v<In, __nv_bfloat16>) {
        x[8 * k + 2 * j] = __uint_as_float(w[j] << 16), x[8 * k + 2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
      } else {
        const __half2 h = *reinterpret_cast<const __half2*>(&w[j]);
        x[8 * k + 2 * j] = __low2float(h), x[8 * k + 2 * j + 1] = __high2float(h);
      }
    }
  }
}

template <int kLanes>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// This lane's codes of a row whose scale's reciprocal is r, as little-endian words.
template <int kElems>
__device__ __forceinline__ void encode(const float (&x)[kElems], float r, uint32_t (&words)[kElems / 4]) {
#pragma unroll
  for (int h = 0; h < kElems / 4; ++h) {
    const float* y = x + 4 * h;
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(y[0] * r, y[1] * r), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(y[2] * r, y[3] * r), __NV_SATFINITE, __NV_E4M3);
    words[h] = lo | (hi << 16);
  }
  bool nan = false;
#pragma unroll
  for (int i = 0; i < kElems; ++i) nan |= x[i] != x[i];
  if (nan) {  // the convert gives 0x7F for any NaN; the reference keeps its sign
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
      if (x[i] != x[i]) {
        const uint32_t byte = 0x7Fu | (__float_as_uint(x[i]) >> 24 & 0x80u);
        words[i / 4] = (words[i / 4] & ~(0xFFu << (8 * (i % 4)))) | (byte << (8 * (i % 4)));
      }
    }
  }
}

__device__ __forceinline__ int64_t slot_of(const PthParams& p, uint32_t token) {
  return p.slots64 ? __ldg(static_cast<const int64_t*>(p.slots) + token)
                   : static_cast<int64_t>(__ldg(static_cast<const int32_t*>(p.slots) + token));
}

// Byte offset of a slot's K rows in the cache (32-bit page arithmetic: capacity < 2^31).
__device__ __forceinline__ int64_t slot_offset(const PthParams& p, int64_t slot) {
  const auto page = p.block_size.divmod(static_cast<uint32_t>(slot));
  return page.div * p.stride_block + page.mod * p.stride_slot;
}

// One row's scale (the group's amax over its finite inputs); every lane of the group returns it.
// amax / 448 correctly rounded as Markstein's corrected product (one FMA pair instead of div.rn):
// r448 = rn(1/448), q = rn(amax * r448) is within an ulp, the residual fma(-q, 448, amax) is exact
// and q + residual * r448 rounds to the quotient. Its premises hold for every quotient the
// 1e-6 floor lets through (normal numbers); below it either result gives the floor.
template <int kLanes, int kElems>
__device__ __forceinline__ float row_scale(const float (&x)[kElems]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kElems; ++i) {
    const float a = fabsf(x[i]);
    amax = fmaxf(amax, a <= FLT_MAX ? a : 0.f);  // NaN and +-inf stay out of the amax
  }
  amax = group_max<kLanes>(amax);
  constexpr float r448 = 1.f / 448.f;
  const float q = __fmul_rn(amax, r448);
  return fmaxf(__fmaf_rn(__fmaf_rn(-q, 448.f, amax), r448, q), 1e-6f);
}

template <typename In, int kLanes, int kElems>
__global__ void __launch_bounds__(kThreads) per_token_head_write_kernel(const __grid_constant__ PthParams p) {
  start_after_prior_grids<KVFUSE_WRITE_PDL>();
  constexpr int kGroups = kThreads / kLanes;
  const int lane = threadIdx.x % kLanes;
  const uint32_t item = blockIdx.x * kGroups + threadIdx.x / kLanes;  // (token, head)
  const bool live_item = item < p.items;
  const auto th = p.heads.divmod(live_item ? item : 0);
  const int64_t slot = live_item ? slot_of(p, th.div) : -1;
  const bool live = slot >= 0 && slot < p.capacity && lane * kElems < p.head_size;
  const int64_t src_at = th.div * p.src_tok + th.mod * p.src_head + static_cast<int64_t>(lane) * kElems * sizeof(In);
  RawRow<In, kElems> raw[2];
#pragma unroll
  for (int side = 0; side < 2; ++side) raw[side] = live ? load_raw<In, kElems>(p.src[side] + src_at) : RawRow<In, kElems>{};
  uint8_t* row0 = p.cache + (live ? slot_offset(p, slot) : 0) + th.mod * p.stride_head;
  // Lanes of skipped slots go through the group's shuffles too (as zeros); they only store nothing.
#pragma unroll
  for (int side = 0; side < 2; ++side) {
    float x[kElems];
    widen<In, kElems>(raw[side], x);
    const float scale = row_scale<kLanes, kElems>(x);
    uint32_t words[kElems / 4];
    encode<kElems>(x, __frcp_rn(scale), words);  // = div.rn(1, scale)
    if (live) {
      uint8_t* row = row0 + side * p.stride_kv;
      uint32_t* dst = reinterpret_cast<uint32_t*>(row + lane * kElems);  // rows are only 4-byte aligned
#pragma unroll
      for (int w = 0; w < kElems / 4; ++w) dst[w] = words[w];
      if (lane == 0) *reinterpret_cast<float*>(row + p.head_size) = scale;
    }
  }
}

template <typename In, int kLanes, int kElems>
void launch_with(const PthParams& p, cudaStream_t stream) {
  constexpr int kGroups = kThreads / kLanes;
  launch_maybe_dependent(per_token_head_write_kernel<In, kLanes, kElems>,
                         dim3(static_cast<unsigned>((int64_t{p.items} + kGroups - 1) / kGroups)), dim3(kThreads), 0,
                         stream, KVFUSE_WRITE_PDL && dependent_launch_supported(), p);
}

// 16 elements per lane where the head size allows (half the lanes, each with twice the bytes in
// flight and the per-row work shared by fewer of them), 8 otherwise.
template <typename In, int kElems>
void launch_lanes(const PthParams& p, cudaStream_t stream) {
  const int lanes_needed = p.head_size / kElems;
  if (lanes_needed <= 4) return launch_with<In, 4, kElems>(p, stream);
  if (lanes_needed <= 8) return launch_with<In, 8, kElems>(p, stream);
  // 16 lanes of 16 elements cover the largest head size (256); only 8-element lanes need 32.
  if constexpr (kElems == kMinElems) {
    if (lanes_needed > 16) return launch_with<In, 32, kElems>(p, stream);
  }
  launch_with<In, 16, kElems>(p, stream);
}

template <typename In>
void launch_elems(const PthParams& p, cudaStream_t stream) {
  if (p.head_size % 16 == 0) return launch_lanes<In, 16>(p, stream);
  launch_lanes<In, kMinElems>(p, stream);
}

bool aligned(const at::Tensor& x, int64_t bytes) { return reinterpret_cast<uintptr_t>(x.data_ptr()) % bytes == 0; }

// The Python entry (kvfuse.ops.native.encode_and_cache_write) validates the call as the op does
// and checks per_token_head_write_refusal(); these checks only guard memory safety.
void fp8_per_token_head_cache_write_cuda(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                                         const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key.dim() == 3 && key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type() &&
                        key.strides() == value.strides(),
                    "fp8_per_token_head_cache_write: key and value must share shape, dtype and strides");
  const auto in = key.scalar_type();
  TORCH_CHECK_VALUE(in == at::kBFloat16 || in == at::kHalf || in == at::kFloat,
                    "fp8_per_token_head_cache_write: inputs must be bfloat16, float16 or float32, got ", in);
  const int64_t es = key.element_size(), head_size = key.size(2);
  TORCH_CHECK_VALUE(head_size % kMinElems == 0 && head_size <= 32 * kMinElems,
                    "fp8_per_token_head_cache_write: head_size=", head_size, " (allowed: multiples of 8 up to 256)");
  TORCH_CHECK_VALUE(key.stride(2) == 1 && (key.stride(0) * es) % 16 == 0 && (key.stride(1) * es) % 16 == 0 &&
                        aligned(key, 16) && aligned(value, 16),
                    "fp8_per_token_head_cache_write: input rows must be 16-byte aligned with a contiguous last dim");
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.scalar_type() == at::kByte && kv_cache.size(1) == 2 &&
                        kv_cache.size(3) == key.size(1) && kv_cache.size(4) == head_size + 4 && kv_cache.stride(4) == 1 &&
                        kv_cache.stride(0) % 4 == 0 && kv_cache.stride(1) % 4 == 0 && kv_cache.stride(2) % 4 == 0 &&
                        kv_cache.stride(3) % 4 == 0 && aligned(kv_cache, 4),
                    "fp8_per_token_head_cache_write: kv_cache must be uint8 (num_blocks, 2, block_size, ", key.size(1),
                    ", ", head_size + 4, ") with 4-byte aligned rows, got ", kv_cache.sizes());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous() &&
                        (slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong),
                    "fp8_per_token_head_cache_write: slot_mapping must be contiguous int32/int64 with one entry per token");
  TORCH_CHECK_VALUE(key.size(0) * key.size(1) < (int64_t{1} << 32) &&
                        kv_cache.size(0) * kv_cache.size(2) < (int64_t{1} << 31),
                    "fp8_per_token_head_cache_write: too many tokens, heads or cache slots: ", key.sizes(), ", ",
                    kv_cache.sizes());
  if (key.numel() == 0 || kv_cache.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  PthParams p{};
  p.src[0] = static_cast<const uint8_t*>(key.data_ptr());
  p.src[1] = static_cast<const uint8_t*>(value.data_ptr());
  p.src_tok = key.stride(0) * es;
  p.src_head = key.stride(1) * es;
  p.cache = static_cast<uint8_t*>(kv_cache.data_ptr());
  p.stride_block = kv_cache.stride(0);
  p.stride_kv = kv_cache.stride(1);
  p.stride_slot = kv_cache.stride(2);
  p.stride_head = kv_cache.stride(3);
  p.slots = slot_mapping.data_ptr();
  p.slots64 = slot_mapping.scalar_type() == at::kLong;
  p.block_size = IntDivider<uint32_t>(static_cast<uint32_t>(kv_cache.size(2)));
  p.capacity = kv_cache.size(0) * kv_cache.size(2);
  p.heads = IntDivider<uint32_t>(static_cast<uint32_t>(key.size(1)));
  p.items = static_cast<uint32_t>(key.size(0) * key.size(1));
  p.head_size = static_cast<int>(head_size);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (in) {
    case at::kBFloat16: return launch_elems<__nv_bfloat16>(p, stream);
    case at::kHalf: return launch_elems<__half>(p, stream);
    default: return launch_elems<float>(p, stream);
  }
}

}  // namespace
}  // namespace kvfuse

TORCH_LIBRARY_FRAGMENT(kvfuse_native, m) {
  m.def("fp8_per_token_head_cache_write(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvfuse_native, CUDA, m) {
  m.impl("fp8_per_token_head_cache_write", TORCH_FN(kvfuse::fp8_per_token_head_cache_write_cuda));
}
