// Binds the native kernels to kvfuse's ops.
//
// The schemas live in Python (kvfuse/ops/__init__.py), next to the validation that must run
// before any kernel touches memory. That file declares, beside each public cache op, a
// `.native` overload with the reference backend's argument list; this library implements
// those overloads for CPU and CUDA. kvfuse.ops.native calls them after the public op's
// Python implementation has validated the call, so the C++ side only re-checks what memory
// safety needs.
//
// The small `kvfuse_native` namespace is this library's own introspection (never part of a
// model graph): the C++ dtype parser, so a test can hold it to the Python one, the enum
// values, and the configuration it was built with.
#include <torch/library.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "cache_write.h"
#include "kv_quant_mode.h"

namespace kvfuse {
namespace {

std::tuple<int64_t, std::string> parse_dtype_op(const std::string& name, const std::string& argument) {
  ParsedDtype parsed{KVQuantMode::NONE, NativeDtype::kAuto};
  try {
    parsed = parse_kv_cache_dtype(name, argument);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  return {static_cast<int64_t>(parsed.mode), native_dtype_name(parsed.native)};
}

std::string mode_values_op() {
  std::string out;
  for (int64_t v = 0; is_valid_mode(v); ++v) {
    if (!out.empty()) out += ",";
    out += std::string(mode_name(static_cast<KVQuantMode>(v))) + "=" + std::to_string(v);
  }
  return out;
}

std::string build_config_op() {
#ifdef KVFUSE_WITH_CUDA
  return "cpu+cuda";
#else
  return "cpu";
#endif
}

}  // namespace
}  // namespace kvfuse

TORCH_LIBRARY(kvfuse_native, m) {
  m.def("parse_kv_cache_dtype(str name, str argument='kv_cache_dtype') -> (int, str)", &kvfuse::parse_dtype_op);
  m.def("mode_values() -> str", &kvfuse::mode_values_op);
  m.def("build_config() -> str", &kvfuse::build_config_op);
}

TORCH_LIBRARY_IMPL(kvfuse, CPU, m) {
  m.impl("encode_kv.native", TORCH_FN(kvfuse::encode_kv_cpu));
  m.impl("cache_write.native", TORCH_FN(kvfuse::cache_write_cpu));
  m.impl("encode_and_cache_write.native", TORCH_FN(kvfuse::encode_and_cache_write_cpu));
}

#ifdef KVFUSE_WITH_CUDA
TORCH_LIBRARY_IMPL(kvfuse, CUDA, m) {
  m.impl("encode_kv.native", TORCH_FN(kvfuse::encode_kv_cuda));
  m.impl("cache_write.native", TORCH_FN(kvfuse::cache_write_cuda));
  m.impl("encode_and_cache_write.native", TORCH_FN(kvfuse::encode_and_cache_write_cuda));
}
#endif
