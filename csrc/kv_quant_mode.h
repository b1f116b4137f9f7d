// The C++ mirror of kvfuse.KVQuantMode and of the one dtype-name parser
// (kvfuse/kv_cache.py::_parse_dtype_name).
//
// The enum values are an ABI shared with Python: ops receive the mode as a plain int.
// The parser exists so C++ callers never compare dtype strings themselves; its error text
// is the Python one character for character (tests/ops/test_native.py checks this on every
// valid name and on a corpus of bad ones), which is why it carries its own copy of Python's
// str.strip() whitespace set and of repr() quoting.
//
// Header-only and free of torch headers, so it compiles in every translation unit cheaply.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvfuse {

enum class KVQuantMode : int64_t {
  NONE = 0,
  FP8_E4M3 = 1,
  FP8_E5M2 = 2,
  NVFP4 = 3,
};

inline const char* mode_name(KVQuantMode mode) {
  switch (mode) {
    case KVQuantMode::NONE: return "NONE";
    case KVQuantMode::FP8_E4M3: return "FP8_E4M3";
    case KVQuantMode::FP8_E5M2: return "FP8_E5M2";
    case KVQuantMode::NVFP4: return "NVFP4";
  }
  return "?";
}

inline bool is_valid_mode(int64_t value) { return value >= 0 && value <= 3; }

// Native storage named by a dtype string; kAuto means "the model dtype" and is also used
// for the quantized modes, whose storage follows from the mode alone.
enum class NativeDtype : int { kAuto = 0, kFloat16, kBFloat16, kFloat32 };

inline const char* native_dtype_name(NativeDtype d) {
  switch (d) {
    case NativeDtype::kFloat16: return "float16";
    case NativeDtype::kBFloat16: return "bfloat16";
    case NativeDtype::kFloat32: return "float32";
    case NativeDtype::kAuto: break;
  }
  return "";
}

struct ParsedDtype {
  KVQuantMode mode;
  NativeDtype native;
};

namespace detail {

struct NameEntry {
  const char* name;
  KVQuantMode mode;
  NativeDtype native;
};

// Same order as kvfuse.kv_cache._DTYPE_NAMES: the error message lists them in this order.
inline constexpr NameEntry kNames[] = {
    {"auto", KVQuantMode::NONE, NativeDtype::kAuto},
    {"float16", KVQuantMode::NONE, NativeDtype::kFloat16},
    {"half", KVQuantMode::NONE, NativeDtype::kFloat16},
    {"bfloat16", KVQuantMode::NONE, NativeDtype::kBFloat16},
    {"float32", KVQuantMode::NONE, NativeDtype::kFloat32},
    {"float", KVQuantMode::NONE, NativeDtype::kFloat32},
    {"fp8", KVQuantMode::FP8_E4M3, NativeDtype::kAuto},
    {"fp8_e4m3", KVQuantMode::FP8_E4M3, NativeDtype::kAuto},
    {"fp8_e5m2", KVQuantMode::FP8_E5M2, NativeDtype::kAuto},
    {"nvfp4", KVQuantMode::NVFP4, NativeDtype::kAuto},
};

// Decodes one UTF-8 code point at s[i], advancing i. Python hands us valid UTF-8 (a str
// with lone surrogates cannot be encoded), so malformed bytes are passed through as-is.
inline uint32_t next_code_point(const std::string& s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  const int extra = (b0 & 0xE0) == 0xC0 ? 1 : (b0 & 0xF0) == 0xE0 ? 2 : (b0 & 0xF8) == 0xF0 ? 3 : 0;
  if (extra == 0 || i + extra >= s.size()) {
    ++i;
    return b0;
  }
  uint32_t cp = b0 & (0x3Fu >> extra);
  for (int k = 1; k <= extra; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3Fu);
  i += extra + 1;
  return cp;
}

// Python's str.isspace() (what str.strip() removes): Unicode White_Space plus the
// information separators U+001C..U+001F.
inline bool py_isspace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Python's str.isprintable() for the code points repr() must escape: control characters,
// separators other than the ASCII space, and the common format characters. Exact for
// ASCII and Latin-1; other unassigned code points are treated as printable.
inline bool py_isprintable(uint32_t c) {
  if (c < 0x20 || c == 0x7F || (c >= 0x80 && c <= 0xA0) || c == 0xAD) return false;
  if (c < 0x100) return true;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) ||
      (c >= 0x205F && c <= 0x2064) || (c >= 0x2066 && c <= 0x206F) || c == 0x3000 || c == 0xFEFF ||
      c == 0x061C || c == 0x180E || c == 0x00AD || (c >= 0xFFF9 && c <= 0xFFFB) ||
      (c >= 0xD800 && c <= 0xDFFF) || (c >= 0xE000 && c <= 0xF8FF) || c >= 0xF0000)
    return false;
  return true;
}

inline void append_hex(std::string& out, uint32_t value, int digits) {
  static const char* kHex = "0123456789abcdef";
  for (int k = digits - 1; k >= 0; --k) out.push_back(kHex[(value >> (4 * k)) & 0xF]);
}

}  // namespace detail

// Python's repr() of a str, so error messages read the same from both languages.
inline std::string py_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  size_t i = 0;
  while (i < s.size()) {
    const size_t start = i;
    const uint32_t c = detail::next_code_point(s, i);
    if (c == static_cast<uint32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (detail::py_isprintable(c)) {
      out.append(s, start, i - start);
    } else if (c <= 0xFF) {
      out += "\\x";
      detail::append_hex(out, c, 2);
    } else if (c <= 0xFFFF) {
      out += "\\u";
      detail::append_hex(out, c, 4);
    } else {
      out += "\\U";
      detail::append_hex(out, c, 8);
    }
  }
  out.push_back(quote);
  return out;
}

// Python's name.strip().lower() as far as matching the (ASCII) dtype names needs it: no
// non-ASCII character lowercases to a letter those names use, so ASCII lowering suffices.
inline std::string normalize_name(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end) {
    size_t j = begin;
    if (!detail::py_isspace(detail::next_code_point(s, j))) break;
    begin = j;
  }
  // Strip from the right by scanning forward: UTF-8 cannot be decoded backwards safely
  // without care, and names are short.
  size_t last_non_space_end = begin;
  for (size_t j = begin; j < end;) {
    if (!detail::py_isspace(detail::next_code_point(s, j))) last_non_space_end = j;
  }
  end = last_non_space_end;
  std::string key = s.substr(begin, end - begin);
  for (char& ch : key) {
    if (ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch - 'A' + 'a');
  }
  return key;
}

inline std::string invalid_dtype_message(const std::string& name, const std::string& argument) {
  std::string msg = argument + "=" + py_repr(name) + " is not a KV-cache dtype; valid names are ";
  bool first = true;
  for (const auto& entry : detail::kNames) {
    if (!first) msg += ", ";
    first = false;
    msg += py_repr(entry.name);
  }
  return msg;
}

// Parses a KV-cache dtype name; throws std::invalid_argument with the Python message.
inline ParsedDtype parse_kv_cache_dtype(const std::string& name, const std::string& argument = "kv_cache_dtype") {
  const std::string key = normalize_name(name);
  for (const auto& entry : detail::kNames) {
    if (key == entry.name) return {entry.mode, entry.native};
  }
  throw std::invalid_argument(invalid_dtype_message(name, argument));
}

}  // namespace kvfuse
