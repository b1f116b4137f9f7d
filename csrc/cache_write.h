// Entry points of the native cache-write kernels, one set per device. Each kernel file registers
// its own set for the kvfuse_native ops that csrc/registration.cpp declares
// (TORCH_LIBRARY_IMPL(kvfuse_native, CPU | CUDA)). Arguments arrive validated by the Python op
// layer; the checks in check_* below only guard memory safety for direct callers.
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>

#include "kv_quant_mode.h"

namespace kvfuse {

// Shape/dtype guards shared by both devices (defined inline: cheap, no extra TU).
// The schema's int, checked once at the entry point; everything below works on the enum.
inline KVQuantMode to_mode(int64_t value) {
  TORCH_CHECK_VALUE(is_valid_mode(value), "kv_quant_mode=", value, " is not a KVQuantMode (0..",
                    kNumKVQuantModes - 1, ")");
  TORCH_CHECK_VALUE(is_native_mode(value), "kv_quant_mode=", value, " (", mode_name(static_cast<KVQuantMode>(value)),
                    ") is not implemented by the native kernels of this op; kvfuse's ops route it to Triton, the reference "
                    "or (FP8_PER_TOKEN_HEAD fused writes on CUDA) kvfuse_native::fp8_per_token_head_cache_write");
  return static_cast<KVQuantMode>(value);
}

inline int64_t storage_row_dim(KVQuantMode mode, int64_t head_size) {
  return mode == KVQuantMode::NVFP4 ? head_size / 2 + head_size / 16 : head_size;
}

inline at::ScalarType storage_dtype_of(KVQuantMode mode) {
  switch (mode) {
    case KVQuantMode::FP8_E4M3: return at::ScalarType::Float8_e4m3fn;
    case KVQuantMode::FP8_E5M2: return at::ScalarType::Float8_e5m2;
    case KVQuantMode::NVFP4: return at::ScalarType::Byte;
    case KVQuantMode::FP8_PER_TOKEN_HEAD: return at::ScalarType::Byte;
    case KVQuantMode::NONE: break;
  }
  return at::ScalarType::Undefined;
}

inline bool is_native_float(at::ScalarType t) {
  return t == at::ScalarType::Float || t == at::ScalarType::Half || t == at::ScalarType::BFloat16;
}

inline void check_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(x.dim() == 3 && is_native_float(x.scalar_type()) && (x.size(2) <= 1 || x.stride(2) == 1),
                    name, " must be a [tokens, heads, head_size] float16/bfloat16/float32 tensor with a "
                    "contiguous last dim, got ", x.sizes(), " ", x.scalar_type());
}

// One float32 scale per tensor, or one per KV head (a 1-D tensor of x's head count).
inline bool is_head_scale(const at::Tensor& s, const at::Tensor& x) {
  return s.dim() == 1 && x.dim() == 3 && s.size(0) == x.size(1);
}

inline void check_scale(const at::Tensor& s, const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(s.scalar_type() == at::ScalarType::Float && (s.numel() == 1 || is_head_scale(s, x)) &&
                        s.device() == x.device(),
                    name, " must be a float32 tensor on ", x.device(), " with one element or one per KV head (",
                    x.dim() == 3 ? x.size(1) : 0, "), got ", s.sizes(), " ", s.scalar_type(), " on ", s.device());
}

// Elements between the scales of consecutive heads: 0 for a per-tensor scale (every head reads it).
inline int64_t scale_head_stride(const at::Tensor& s) { return s.numel() == 1 ? 0 : s.stride(0); }

inline void check_mode_dtype(KVQuantMode mode, at::ScalarType cache_dtype) {
  TORCH_CHECK_VALUE(mode == KVQuantMode::NONE ? is_native_float(cache_dtype) : cache_dtype == storage_dtype_of(mode),
                    "cache dtype ", cache_dtype, " cannot hold kv_quant_mode=", mode_name(mode));
}

// An NVFP4 page splits into data and scale regions (nvfp4_page.h), so its dims 1-4 must be one
// contiguous run; pages themselves may lie apart (any stride(0)). The row width must be an NVFP4
// one (9 D / 16), as the kernels derive the page layout from it. kv_cache is 5-D here.
inline bool is_nvfp4_page(const at::Tensor& kv_cache) {
  if (kv_cache.size(4) % 9 != 0) return false;
  int64_t expected = 1;
  for (int64_t d = 4; d >= 1; --d) {
    if (kv_cache.size(d) != 1 && kv_cache.stride(d) != expected) return false;
    expected *= kv_cache.size(d);
  }
  return true;
}

// Among the modes these kernels implement (to_mode), uint8 storage holds only NVFP4;
// FP8_PER_TOKEN_HEAD rows (uint8 too) never reach them (cuda/per_token_head_write.cu writes those).
inline bool holds_nvfp4_pages(const at::Tensor& kv_cache) {
  return kv_cache.scalar_type() == at::ScalarType::Byte;
}

inline void check_cache(const at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t num_tokens,
                        const at::Device& device) {
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.stride(4) == 1,
                    "kv_cache must be (num_blocks, 2, block_size, heads, row_dim) with a contiguous last dim, got ",
                    kv_cache.sizes());
  if (holds_nvfp4_pages(kv_cache) && !is_nvfp4_page(kv_cache)) {
    const int64_t row = kv_cache.size(4), heads = kv_cache.size(3), tokens = kv_cache.size(2);
    TORCH_CHECK_VALUE(row % 9 == 0, "NVFP4 kv_cache ", kv_cache.sizes(), ": row_dim=", row,
                      " is not an NVFP4 row width (9 * head_size / 16)");
    TORCH_CHECK_VALUE(false, "NVFP4 kv_cache ", kv_cache.sizes(), ": its strides ", kv_cache.strides(),
                      " are not contiguous within a page (dims 1-4 must have strides (", tokens * heads * row, ", ",
                      heads * row, ", ", row, ", 1))");
  }
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens &&
                        (slot_mapping.scalar_type() == at::ScalarType::Int ||
                         slot_mapping.scalar_type() == at::ScalarType::Long),
                    "slot_mapping must be 1-D int32/int64 with ", num_tokens, " entries");
  TORCH_CHECK_VALUE(kv_cache.device() == device && slot_mapping.device() == device,
                    "kv_cache and slot_mapping must be on ", device);
}

// encode_kv's inputs: a [T, H, D] float input, a scalar scale, and a storage dtype the mode can use.
inline void check_encode(const at::Tensor& x, const at::Tensor& scale, KVQuantMode kv_quant_mode,
                         at::ScalarType cache_dtype) {
  check_input(x, "x");
  check_scale(scale, x, "scale");
  check_mode_dtype(kv_quant_mode, cache_dtype);
  TORCH_CHECK_VALUE(kv_quant_mode != KVQuantMode::NVFP4 || x.size(2) % 16 == 0, "NVFP4 needs head_size % 16 == 0");
}

// The fused op's inputs: K/V alike, scalar scales, and a cache whose rows fit them in this mode.
inline void check_encode_and_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                   const at::Tensor& v_scale, KVQuantMode kv_quant_mode) {
  check_input(key, "key");
  check_input(value, "value");
  TORCH_CHECK_VALUE(key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type() &&
                        key.device() == value.device(),
                    "key and value must have one shape, dtype and device");
  check_scale(k_scale, key, "k_scale");
  check_scale(v_scale, key, "v_scale");
  check_cache(kv_cache, slot_mapping, key.size(0), key.device());
  check_mode_dtype(kv_quant_mode, kv_cache.scalar_type());
  TORCH_CHECK_VALUE(kv_quant_mode != KVQuantMode::NVFP4 || key.size(2) % 16 == 0, "NVFP4 needs head_size % 16 == 0");
  TORCH_CHECK_VALUE(kv_cache.size(3) == key.size(1) && kv_cache.size(4) == storage_row_dim(kv_quant_mode, key.size(2)),
                    "kv_cache ", kv_cache.sizes(), " does not fit key ", key.sizes(), " in mode ", mode_name(kv_quant_mode));
}

// Already-encoded K/V rows must match the cache row for row: same dtype, heads and row_dim.
inline void check_rows(const at::Tensor& key_rows, const at::Tensor& value_rows, const at::Tensor& kv_cache) {
  for (const at::Tensor* rows : {&key_rows, &value_rows}) {
    TORCH_CHECK_VALUE(rows->dim() == 3 && rows->scalar_type() == kv_cache.scalar_type() &&
                          rows->size(0) == key_rows.size(0) && rows->size(1) == kv_cache.size(3) &&
                          rows->size(2) == kv_cache.size(4) && (rows->size(2) <= 1 || rows->stride(2) == 1) &&
                          rows->device() == kv_cache.device(),
                      "rows ", rows->sizes(), " ", rows->scalar_type(), " do not fit the cache ", kv_cache.sizes(),
                      " ", kv_cache.scalar_type());
  }
}

// Everything check_encode_and_write and the op's Python validator require, as a predicate (no
// exception): the CUDA eager router tests it before running a kernel and hands any other call to
// the Python body, which words the refusal.
inline bool fits_encode_and_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                                  const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                  const at::Tensor& v_scale, int64_t kv_quant_mode) {
  if (!is_native_mode(kv_quant_mode)) return false;
  const auto mode = static_cast<KVQuantMode>(kv_quant_mode);
  const auto input_ok = [](const at::Tensor& x) {
    return x.defined() && x.dim() == 3 && is_native_float(x.scalar_type()) && x.stride(2) == 1;
  };
  // Per-tensor scales only: per-KV-head ones go to the Python body, whose registry picks Triton for them.
  const auto scale_ok = [&](const at::Tensor& s) {
    return s.defined() && s.scalar_type() == at::ScalarType::Float && s.numel() == 1 && s.device() == key.device();
  };
  if (!input_ok(key) || !input_ok(value) || key.sizes() != value.sizes() ||
      key.scalar_type() != value.scalar_type() || key.device() != value.device() || !scale_ok(k_scale) ||
      !scale_ok(v_scale)) {
    return false;
  }
  if (!kv_cache.defined() || kv_cache.dim() != 5 || kv_cache.size(1) != 2 || kv_cache.stride(4) != 1 ||
      kv_cache.device() != key.device() || (holds_nvfp4_pages(kv_cache) && !is_nvfp4_page(kv_cache))) {
    return false;
  }
  if (!slot_mapping.defined() || slot_mapping.dim() != 1 || slot_mapping.size(0) != key.size(0) ||
      slot_mapping.device() != key.device() ||
      (slot_mapping.scalar_type() != at::ScalarType::Int && slot_mapping.scalar_type() != at::ScalarType::Long)) {
    return false;
  }
  const bool dtype_ok = mode == KVQuantMode::NONE ? is_native_float(kv_cache.scalar_type())
                                                  : kv_cache.scalar_type() == storage_dtype_of(mode);
  return dtype_ok && (mode != KVQuantMode::NVFP4 || key.size(2) % 16 == 0) && kv_cache.size(3) == key.size(1) &&
         kv_cache.size(4) == storage_row_dim(mode, key.size(2));
}

}  // namespace kvfuse
