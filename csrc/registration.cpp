// Declares the kvfuse_native ops: the native kernels of kvfuse's cache ops, one op per
// kernel entry point, in this library's own namespace.
//
// kvfuse's public ops (kvfuse::encode_kv, ...) are declared in Python (kvfuse/ops/library.py)
// beside the validation that must run before any kernel touches memory; when the registry
// picks the native implementation, that op's Python body calls the matching kvfuse_native op
// here, one dispatcher hop to C++. Each kernel file registers its own implementations
// (TORCH_LIBRARY_IMPL(kvfuse_native, CPU) in cpu/cache_write.cpp, CUDA in
// cuda/cache_write.cu). The schemas take the layer's KVQuantMode as an int, which each entry
// point converts to the enum once (kv_quant_mode.h); no dtype name ever reaches C++.
//
// mode_values() and build_config() are introspection for tests and `python -m kvfuse info`.
#include <torch/library.h>

#include <string>

#include "kv_quant_mode.h"

namespace kvfuse {
namespace {

std::string mode_values_op() {
  std::string out;
  for (int64_t v = 0; v < kNumKVQuantModes; ++v) {
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
  m.def("encode_kv(Tensor x, Tensor scale, int kv_quant_mode, ScalarType cache_dtype) -> Tensor");
  m.def("cache_write(Tensor key_rows, Tensor value_rows, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("encode_and_cache_write(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor k_scale, Tensor v_scale, int kv_quant_mode) -> ()");
  m.def("mode_values() -> str", &kvfuse::mode_values_op);
  m.def("build_config() -> str", &kvfuse::build_config_op);
}
