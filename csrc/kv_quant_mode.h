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
};

// One past the last value: the enum's size, for iteration and range checks.
constexpr int64_t kNumKVQuantModes = 4;

inline const char* mode_name(KVQuantMode mode) {
  switch (mode) {
    case KVQuantMode::NONE: return "NONE";
    case KVQuantMode::FP8_E4M3: return "FP8_E4M3";
    case KVQuantMode::FP8_E5M2: return "FP8_E5M2";
    case KVQuantMode::NVFP4: return "NVFP4";
  }
  return "?";
}

inline bool is_valid_mode(int64_t value) { return value >= 0 && value < kNumKVQuantModes; }

inline bool is_fp8(KVQuantMode mode) { return mode == KVQuantMode::FP8_E4M3 || mode == KVQuantMode::FP8_E5M2; }

}  // namespace kvfuse
