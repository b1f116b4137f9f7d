// CUDA kernel of kvfuse::rope_encode_and_cache_write for FP8 caches: the key's rotary embedding
// (NeoX rotate-half over the whole head), the FP8 encoding of K and V and their paged store, and
// the query's rotation, in one launch. This file declares and registers its own op,
// kvfuse_native::rope_encode_and_cache_write (CUDA only); kvfuse/ops/native.py calls it for the
// calls it covers (native.rope_covers) and hands every other call to the Triton kernel.
//
// Work is cut into units of (token, row, j): the 8 features j*8.. of a row's first half and their
// partners (D/2 + j*8..) in its second half, so that a thread holds both of every rotated pair.
// A token's units are its K rows' (rotated, encoded, stored), its V rows' (encoded, stored) and
// its query rows' (rotated into q_out), heads x D/16 each, one unit per thread in row-major
// order: small units, so that even a decode step's few tokens spread over many threads, whose
// loads (rows, slot, position, cos/sin chunks) are all issued before any arithmetic.
//
// Numerics, per feature i < D/2 with partner p = i + D/2 (float32, as Inductor computes
// `k * cos + rotate_half(k) * sin` on 16-bit inputs and as the Triton kernel does):
//   y[i] = fma(x[i], cos[i], rn(-x[p] * sin[i]))      y[p] = fma(x[p], cos[p], rn(x[i] * sin[p]))
// (the contraction LLVM gives that expression, which the GPU tests pin against Triton), then
// rounded to the key's dtype; FP8 as cache_write.cu (fp8_encode.cuh). A half-width table
// (rotary_dim / 2 columns) serves both halves of the row.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <type_traits>

#include "../cache_write.h"
#include "fp8_encode.cuh"

namespace kvfuse {
namespace {

using at::cuda::detail::IntDivider;

constexpr int kRopeThreads = 128;
constexpr int kChunk = 8;  // features of each half of the row per unit

// Byte strides throughout.
struct RopeParams {
  const char* key;
  const char* value;
  const char* query;  // nullptr: no query
  int64_t key_tok, key_head, value_tok, value_head, query_tok, query_head;
  char* q_out;  // contiguous [tokens, query heads, D]
  char* dst;
  int64_t dst_block, dst_kv, dst_off, dst_head;
  int64_t capacity;
  const void* slots;
  const void* positions;  // nullptr: token t uses table row t
  const char* cos;
  const char* sin;
  int64_t cos_row, sin_row;
  const float* scale[2];
  IntDivider<uint32_t> per_token, chunks, page;
  uint32_t kv_units;  // K/V units of one token: heads x chunks
  uint32_t units;
  int slots64, positions64, half_table;
  int head_size, num_q_heads;
};

// kChunk consecutive elements of type T (float, or the 16-bit __nv_bfloat16 / __half) from a
// 16-byte aligned address, widened to float. 16-bit values travel as their bits (a union member
// of the CUDA half types would need their constructors).
template <typename T, bool kStream>
__device__ __forceinline__ void load_chunk(const char* src, float (&out)[kChunk]) {
  constexpr int kWords = kChunk * sizeof(T) / 16;
  union {
    uint4 w[kWords];
    std::conditional_t<std::is_same_v<T, float>, float, unsigned short> e[kChunk];
  } u;
#pragma unroll
  for (int k = 0; k < kWords; ++k) {
    u.w[k] = kStream ? __ldcs(reinterpret_cast<const uint4*>(src) + k) : __ldg(reinterpret_cast<const uint4*>(src) + k);
  }
#pragma unroll
  for (int k = 0; k < kChunk; ++k) {
    if constexpr (std::is_same_v<T, float>) {
      out[k] = u.e[k];
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      out[k] = __bfloat162float(__ushort_as_bfloat16(u.e[k]));
    } else {
      out[k] = __half2float(__ushort_as_half(u.e[k]));
    }
  }
}

// x rounded to T (nearest even) and widened back: the rotated key as the unfused graph stores it.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(__float2bfloat16_rn(x));
  } else {
    return __half2float(__float2half_rn(x));
  }
}

// kChunk values rounded to the 16-bit T, one 16-byte store.
template <typename T>
__device__ __forceinline__ void store_chunk(char* dst, const float (&v)[kChunk]) {
  union {
    uint4 w;
    unsigned short e[kChunk];
  } u;
#pragma unroll
  for (int k = 0; k < kChunk; ++k) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      u.e[k] = __bfloat16_as_ushort(__float2bfloat16_rn(v[k]));
    } else {
      u.e[k] = __half_as_ushort(__float2half_rn(v[k]));
    }
  }
  __stcs(reinterpret_cast<uint4*>(dst), u.w);
}

// kChunk values as FP8 bytes, one 8-byte store.
template <typename Fp8, bool kFast>
__device__ __forceinline__ void store_fp8(char* dst, const float (&v)[kChunk], const Divider div) {
  uint32_t words[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    Quotient q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = divide_parts<kFast>(v[4 * w + k], div);
    words[w] = fp8x4<Fp8>(q);
  }
  __stcs(reinterpret_cast<uint2*>(dst), make_uint2(words[0], words[1]));
}

// The pair (first-half chunk a, second-half chunk b) rotated in place, each rounded to In.
template <typename In>
__device__ __forceinline__ void rotate(float (&a)[kChunk], float (&b)[kChunk], const float (&c1)[kChunk],
                                       const float (&s1)[kChunk], const float (&c2)[kChunk],
                                       const float (&s2)[kChunk]) {
#pragma unroll
  for (int k = 0; k < kChunk; ++k) {
    const float y1 = __fmaf_rn(a[k], c1[k], __fmul_rn(-b[k], s1[k]));
    const float y2 = __fmaf_rn(b[k], c2[k], __fmul_rn(a[k], s2[k]));
    a[k] = round_to<In>(y1);
    b[k] = round_to<In>(y2);
  }
}

// The rotary rows' table chunks of unit j: cos/sin features j*kChunk.. of the first half and
// (a full-width table) of the second; a half-width table's chunk serves both.
template <typename Tab>
__device__ __forceinline__ void load_tables(const RopeParams& p, int64_t row, int j, float (&c1)[kChunk],
                                            float (&s1)[kChunk], float (&c2)[kChunk], float (&s2)[kChunk]) {
  const int64_t col = int64_t{j} * kChunk * sizeof(Tab);
  const char* crow = p.cos + row * p.cos_row;
  const char* srow = p.sin + row * p.sin_row;
  load_chunk<Tab, false>(crow + col, c1);
  load_chunk<Tab, false>(srow + col, s1);
  if (p.half_table) {
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      c2[k] = c1[k];
      s2[k] = s1[k];
    }
  } else {
    const int64_t second = int64_t{p.head_size / 2} * sizeof(Tab);
    load_chunk<Tab, false>(crow + second + col, c2);
    load_chunk<Tab, false>(srow + second + col, s2);
  }
}

// One unit: features j*kChunk.. of the row's first half and their partners D/2 + j*kChunk.. of
// a K row (rotated, encoded, stored), a V row (encoded, stored) or a query row (rotated, stored
// to q_out), by the unit's place in its token: [K units, V units, query units], each heads x J.
template <typename In, typename Tab, typename Fp8, bool kFast>
__device__ __forceinline__ void rope_unit(const RopeParams& p, uint32_t u, const Divider div_k, const Divider div_v) {
  const auto tr = p.per_token.divmod(u);
  const int64_t tok = tr.div;
  const int kind = tr.mod < p.kv_units ? 0 : tr.mod < 2 * p.kv_units ? 1 : 2;  // K, V, query
  const auto hc = p.chunks.divmod(tr.mod - kind * p.kv_units);
  const int head = static_cast<int>(hc.div);
  const int j = static_cast<int>(hc.mod);
  const int half_bytes = p.head_size / 2 * static_cast<int>(sizeof(In));
  const int64_t col = int64_t{j} * kChunk * sizeof(In);
  const char* src = kind == 0   ? p.key + tok * p.key_tok + head * p.key_head
                    : kind == 1 ? p.value + tok * p.value_tok + head * p.value_head
                                : p.query + tok * p.query_tok + head * p.query_head;
  float a[kChunk], b[kChunk];
  load_chunk<In, true>(src + col, a);
  load_chunk<In, true>(src + half_bytes + col, b);
  int64_t slot = -1;
  if (kind < 2) {
    slot = p.slots64 ? __ldg(static_cast<const int64_t*>(p.slots) + tok)
                     : __ldg(static_cast<const int32_t*>(p.slots) + tok);
  }
  if (kind != 1) {
    int64_t row = tok;
    if (p.positions != nullptr) {
      row = p.positions64 ? __ldg(static_cast<const int64_t*>(p.positions) + tok)
                          : __ldg(static_cast<const int32_t*>(p.positions) + tok);
    }
    float c1[kChunk], s1[kChunk], c2[kChunk], s2[kChunk];
    load_tables<Tab>(p, row, j, c1, s1, c2, s2);
    rotate<In>(a, b, c1, s1, c2, s2);
  }
  if (kind == 2) {
    const int64_t q_row = (tok * p.num_q_heads + head) * int64_t{p.head_size} * sizeof(In);
    store_chunk<In>(p.q_out + q_row + col, a);
    store_chunk<In>(p.q_out + q_row + half_bytes + col, b);
    return;
  }
  if (slot < 0 || slot >= p.capacity) return;
  const auto bo = p.page.divmod(static_cast<uint32_t>(slot));
  char* dst = p.dst + int64_t{bo.div} * p.dst_block + int64_t{bo.mod} * p.dst_off + head * p.dst_head +
              j * kChunk + (kind == 1 ? p.dst_kv : 0);
  const Divider div = kind == 1 ? div_v : div_k;
  store_fp8<Fp8, kFast>(dst, a, div);
  store_fp8<Fp8, kFast>(dst + p.head_size / 2, b, div);
}

template <typename In, typename Tab, typename Fp8>
__global__ void __launch_bounds__(kRopeThreads) rope_fp8_kernel(const RopeParams p) {
  const uint32_t u = blockIdx.x * kRopeThreads + threadIdx.x;
  if (u >= p.units) return;
  const Divider div_k = make_divider(__ldg(p.scale[0]));
  const Divider div_v = make_divider(__ldg(p.scale[1]));
  if (div_k.fast && div_v.fast) {
    rope_unit<In, Tab, Fp8, true>(p, u, div_k, div_v);
  } else {
    rope_unit<In, Tab, Fp8, false>(p, u, div_k, div_v);
  }
}

template <typename In, typename Tab>
void launch_rope(const RopeParams& p, KVQuantMode mode, cudaStream_t stream) {
  const dim3 grid((p.units + kRopeThreads - 1) / kRopeThreads);
  if (mode == KVQuantMode::FP8_E4M3) {
    rope_fp8_kernel<In, Tab, E4M3><<<grid, kRopeThreads, 0, stream>>>(p);
  } else {
    rope_fp8_kernel<In, Tab, E5M2><<<grid, kRopeThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename In>
void launch_rope_from(const RopeParams& p, at::ScalarType table, KVQuantMode mode, cudaStream_t stream) {
  switch (table) {
    case at::ScalarType::Float: return launch_rope<In, float>(p, mode, stream);
    case at::ScalarType::BFloat16: return launch_rope<In, __nv_bfloat16>(p, mode, stream);
    default: return launch_rope<In, __half>(p, mode, stream);
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// What the caller (kvfuse.ops.native.rope_covers) has established; re-checked here because a
// wrong stride or alignment would mean out-of-bounds or misaligned vector accesses.
void check_rope(const std::optional<at::Tensor>& query, const at::Tensor& key, const at::Tensor& value,
                const at::Tensor& kv_cache, const at::Tensor& k_scale, const at::Tensor& v_scale,
                const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim, bool is_neox, KVQuantMode mode) {
  const int64_t d = key.size(2);
  TORCH_CHECK_VALUE(mode == KVQuantMode::FP8_E4M3 || mode == KVQuantMode::FP8_E5M2,
                    "the native rotary write covers FP8 caches only, got ", mode_name(mode));
  TORCH_CHECK_VALUE(is_neox && rotary_dim == d && d % (2 * kChunk) == 0,
                    "the native rotary write covers NeoX rotation of whole heads whose size is a multiple of 16");
  TORCH_CHECK_VALUE(key.scalar_type() == at::ScalarType::BFloat16 || key.scalar_type() == at::ScalarType::Half,
                    "the native rotary write takes bfloat16 or float16 rows");
  TORCH_CHECK_VALUE(k_scale.numel() == 1 && v_scale.numel() == 1, "the native rotary write takes per-tensor scales");
  const int64_t es = key.element_size();
  auto rows_ok = [&](const at::Tensor& t) {
    return t.scalar_type() == key.scalar_type() && t.size(2) == d && t.stride(2) == 1 && aligned16(t.const_data_ptr()) &&
           (t.stride(0) * es) % 16 == 0 && (t.stride(1) * es) % 16 == 0;
  };
  TORCH_CHECK_VALUE(rows_ok(key) && rows_ok(value) && (!query.has_value() || rows_ok(*query)),
                    "the native rotary write needs 16-byte aligned rows");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK_VALUE(t->stride(1) == 1 && aligned16(t->const_data_ptr()) && (t->stride(0) * t->element_size()) % 16 == 0 &&
                          (t->size(1) == d || t->size(1) == d / 2) && t->scalar_type() == cos.scalar_type(),
                      "the native rotary write needs 16-byte aligned cos/sin rows");
  }
  TORCH_CHECK_VALUE(kv_cache.size(4) == d && kv_cache.stride(4) == 1 && aligned16(kv_cache.const_data_ptr()) &&
                        kv_cache.stride(0) % 16 == 0 && kv_cache.stride(1) % 16 == 0 && kv_cache.stride(2) % 16 == 0 &&
                        kv_cache.stride(3) % 16 == 0 && kv_cache.element_size() == 1,
                    "the native rotary write needs an FP8 cache with 16-byte aligned rows");
}

at::Tensor rope_encode_and_cache_write_cuda(const std::optional<at::Tensor>& query, const at::Tensor& key,
                                            const at::Tensor& value, const at::Tensor& kv_cache,
                                            const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                            const at::Tensor& v_scale, const at::Tensor& cos, const at::Tensor& sin,
                                            const std::optional<at::Tensor>& positions, int64_t rotary_dim,
                                            bool is_neox, int64_t kv_quant_mode) {
  const KVQuantMode mode = to_mode(kv_quant_mode);
  check_rope(query, key, value, kv_cache, k_scale, v_scale, cos, sin, rotary_dim, is_neox, mode);
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  at::Tensor q_out = query.has_value() ? at::empty(query->sizes(), query->options()) : at::empty({0}, key.options());
  const int64_t tokens = key.size(0);
  const int64_t heads = key.size(1);
  const int64_t q_heads = query.has_value() ? query->size(1) : 0;
  const int64_t chunks = key.size(2) / (2 * kChunk);
  const int64_t units = tokens * (2 * heads + q_heads) * chunks;
  if (units == 0) return q_out;
  TORCH_CHECK_VALUE(units < (int64_t{1} << 31) && kv_cache.size(0) * kv_cache.size(2) <= INT32_MAX,
                    "too large for the native rotary write: ", units, " units");
  const int64_t es = key.element_size();
  RopeParams p{};
  p.key = static_cast<const char*>(key.const_data_ptr());
  p.value = static_cast<const char*>(value.const_data_ptr());
  p.key_tok = key.stride(0) * es;
  p.key_head = key.stride(1) * es;
  p.value_tok = value.stride(0) * es;
  p.value_head = value.stride(1) * es;
  if (query.has_value()) {
    p.query = static_cast<const char*>(query->const_data_ptr());
    p.query_tok = query->stride(0) * es;
    p.query_head = query->stride(1) * es;
    p.q_out = static_cast<char*>(q_out.data_ptr());
  }
  p.dst = static_cast<char*>(kv_cache.data_ptr());
  p.dst_block = kv_cache.stride(0);
  p.dst_kv = kv_cache.stride(1);
  p.dst_off = kv_cache.stride(2);
  p.dst_head = kv_cache.stride(3);
  p.capacity = kv_cache.size(0) * kv_cache.size(2);
  p.slots = slot_mapping.const_data_ptr();
  p.slots64 = slot_mapping.scalar_type() == at::ScalarType::Long;
  if (positions.has_value()) {
    p.positions = positions->const_data_ptr();
    p.positions64 = positions->scalar_type() == at::ScalarType::Long;
  }
  p.cos = static_cast<const char*>(cos.const_data_ptr());
  p.sin = static_cast<const char*>(sin.const_data_ptr());
  p.cos_row = cos.stride(0) * cos.element_size();
  p.sin_row = sin.stride(0) * sin.element_size();
  p.half_table = cos.size(1) != rotary_dim;
  p.scale[0] = k_scale.const_data_ptr<float>();
  p.scale[1] = v_scale.const_data_ptr<float>();
  p.kv_units = static_cast<uint32_t>(heads * chunks);
  p.per_token = IntDivider<uint32_t>(static_cast<uint32_t>((2 * heads + q_heads) * chunks));
  p.chunks = IntDivider<uint32_t>(static_cast<uint32_t>(chunks));
  p.page = IntDivider<uint32_t>(static_cast<uint32_t>(kv_cache.size(2)));
  p.units = static_cast<uint32_t>(units);
  p.head_size = static_cast<int>(key.size(2));
  p.num_q_heads = static_cast<int>(q_heads);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (key.scalar_type() == at::ScalarType::BFloat16) {
    launch_rope_from<__nv_bfloat16>(p, cos.scalar_type(), mode, stream);
  } else {
    launch_rope_from<__half>(p, cos.scalar_type(), mode, stream);
  }
  return q_out;
}

}  // namespace
}  // namespace kvfuse

TORCH_LIBRARY_FRAGMENT(kvfuse_native, m) {
  m.def("rope_encode_and_cache_write(Tensor? query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, Tensor k_scale, Tensor v_scale, Tensor cos, Tensor sin, Tensor? positions, "
        "int rotary_dim, bool is_neox, int kv_quant_mode) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvfuse_native, CUDA, m) {
  m.impl("rope_encode_and_cache_write", TORCH_FN(kvfuse::rope_encode_and_cache_write_cuda));
}
