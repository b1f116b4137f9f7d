// The C++ mirror of kvfuse.KVQuantMode.
//
// The values are an ABI shared with Python: op schemas carry the mode as a plain int, which
// every entry point turns into this enum once (to_mode), and kernels switch on the enum only.
// Dtype names are parsed in Python alone (kvfuse.kv_cache.parse_kv_cache_dtype); C++ never
// sees a dtype string. tests/ops/test_native.py holds the two enums to each other.
//
// Header-only and free of torch headers, so it compiles in every translation unit cheaply.
#pragma once

#include <cstdint>

namespace kvfuse {

enum class KVQuantMode : int64_t {
  NONE = 0,
  FP8_E4M3 = 1,
  FP8_E5M2 = 2,
  NVFP4 = 3,
  // e4m3 data + one float32 scale per (token, head) row, computed at write time. The native
  // kernels do not implement it (is_native_mode): the Python registry routes it to Triton or
  // the reference, and the C++ entry points refuse it.
  FP8_PER_TOKEN_HEAD = 4,
};

// One past the last value: the enum's size, for iteration and range checks.
constexpr int64_t kNumKVQuantModes = 5;

inline const char* mode_name(KVQuantMode mode) {
  switch (mode) {
    case KVQuantMode::NONE: return "NONE";
    case KVQuantMode::FP8_E4M3: return "FP8_E4M3";
    case KVQuantMode::FP8_E5M2: return "FP8_E5M2";
    case KVQuantMode::NVFP4: return "NVFP4";
    case KVQuantMode::FP8_PER_TOKEN_HEAD: return "FP8_PER_TOKEN_HEAD";
  }
  return "?";
}

inline bool is_valid_mode(int64_t value) { return value >= 0 && value < kNumKVQuantModes; }

// The modes the cache kernels of cache_write.cu and cpu/ implement (FP8_PER_TOKEN_HEAD has its own
// CUDA write, cuda/per_token_head_write.cu).
inline bool is_native_mode(int64_t value) {
  return is_valid_mode(value) && value != static_cast<int64_t>(KVQuantMode::FP8_PER_TOKEN_HEAD);
}

inline bool is_fp8(KVQuantMode mode) { return mode == KVQuantMode::FP8_E4M3 || mode == KVQuantMode::FP8_E5M2; }

}  // namespace kvfuse
