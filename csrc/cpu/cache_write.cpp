// CPU kernels of kvfuse's cache ops: encode (cast / FP8 / NVFP4) and scatter rows into a
// paged cache, parallel over tokens with at::parallel_for. NVFP4 rows are split over their
// page's packed-data and block-scale regions (nvfp4_page.h).
//
// Every conversion goes through c10's scalar types (c10::BFloat16(float), c10::Float8_e4m3fn
// (float), ...), the same routines torch's own .to() uses, after the float32 math of
// csrc/encode_math.h; the results are therefore the reference's bits (NaN payloads aside:
// a NaN stays a NaN, but which NaN torch's vectorized paths produce is not specified).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstring>
#include <type_traits>

#include "../cache_write.h"
#include "../encode_math.h"
#include "../nvfp4_page.h"

namespace kvfuse {
namespace {

// Where each token's rows go: the cache position of its slot, or (encode_kv) row t of a
// contiguous output. Strides in bytes. NVFP4 rows are not contiguous in a cache page: their data
// and scales go where `nvfp4` says, from the base of the row's side.
struct Dest {
  char* base;
  int64_t s_block, s_kv, s_off, s_head;
  int64_t block_size;
  int64_t capacity;  // num_blocks * block_size
  bool split_nvfp4;  // rows are placed by `nvfp4`, not by s_off / s_head
  Nvfp4Layout nvfp4;
};

// One (side, token, head) row's destination: `row` for every format; for NVFP4 `row` holds the
// packed data and block scale j goes to scales[(j / group) * group_stride + (j % group) * step].
struct RowDst {
  char* row;
  uint8_t* scales;
  int64_t group, group_stride, step;

  void put_scale(int64_t j, uint8_t value) const {
    scales[(j / group) * group_stride + (j % group) * step] = value;
  }
};

RowDst row_dst(const Dest& dst, int half, int64_t block, int64_t off, int64_t head, int64_t head_size) {
  char* side = dst.base + block * dst.s_block + half * dst.s_kv;
  if (!dst.split_nvfp4) {
    char* row = side + off * dst.s_off + head * dst.s_head;
    // Dense NVFP4 rows (encode_kv): scales right after the data, linear.
    return RowDst{row, reinterpret_cast<uint8_t*>(row + head_size / 2), head_size / kNvfp4Block, 0, 1};
  }
  const Nvfp4Layout& l = dst.nvfp4;
  char* row = side + nvfp4_data_offset(l, off, head);
  const bool interleaved = half == 1 && l.v_group > 0;
  auto* scales = reinterpret_cast<uint8_t*>(side + nvfp4_scale_offset(l, interleaved, off, head, 0, 0));
  if (!interleaved) return RowDst{row, scales, head_size / kNvfp4Block, 0, 1};
  return RowDst{row, scales, l.v_group, l.scale_tok, 4};
}

struct Source {
  const char* base[2];
  int64_t s_tok[2], s_head[2];
};

template <typename In, typename Out>
void encode_row_cast(const In* src, Out* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(static_cast<float>(src[i]));
}

template <typename In, typename Fp8>
void encode_row_fp8(const In* src, Fp8* dst, int64_t n, float scale, float limit) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Fp8(clamp_keep_nan(static_cast<float>(src[i]) / scale, limit));
}

template <typename In>
void encode_row_nvfp4(const In* src, const RowDst& out, int64_t head_size, float gs) {
  const auto to_e4m3 = [](float v) { return c10::Float8_e4m3fn(v).x; };
  auto* dst = reinterpret_cast<uint8_t*>(out.row);
  for (int64_t b = 0; b < head_size / kNvfp4Block; ++b) {
    float x[kNvfp4Block];
    float amax = 0.0f;
    for (int i = 0; i < kNvfp4Block; ++i) {
      x[i] = static_cast<float>(src[b * kNvfp4Block + i]);
      const float a = std::isnan(x[i]) ? 0.0f : std::fabs(x[i]);
      amax = a > amax ? a : amax;
    }
    float denom;
    out.put_scale(b, nvfp4_block_scale(amax, gs, to_e4m3, &denom));
    // The reference's definition: one correctly rounded reciprocal per block, a product per element.
    const float recip = denom > 0.0f ? 1.0f / denom : 0.0f;
    for (int i = 0; i < kNvfp4Block; i += 2) {
      const uint8_t lo = e2m1_code(x[i] * recip);
      const uint8_t hi = e2m1_code(x[i + 1] * recip);
      dst[b * (kNvfp4Block / 2) + i / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

// Row encoder for one (input dtype, mode, cache dtype): writes one head row.
using RowFn = void (*)(const char* src, const RowDst& dst, int64_t head_size, float scale);

template <typename In, typename Out>
void row_cast(const char* src, const RowDst& dst, int64_t n, float) {
  encode_row_cast(reinterpret_cast<const In*>(src), reinterpret_cast<Out*>(dst.row), n);
}
template <typename In, typename Fp8>
void row_fp8(const char* src, const RowDst& dst, int64_t n, float scale) {
  encode_row_fp8(reinterpret_cast<const In*>(src), reinterpret_cast<Fp8*>(dst.row), n, scale,
                 std::is_same_v<Fp8, c10::Float8_e4m3fn> ? kE4M3Max : kE5M2Max);
}
template <typename In>
void row_nvfp4(const char* src, const RowDst& dst, int64_t n, float gs) {
  encode_row_nvfp4(reinterpret_cast<const In*>(src), dst, n, gs);
}

template <typename In>
RowFn pick_for_input(KVQuantMode mode, at::ScalarType out) {
  switch (mode) {
    case KVQuantMode::NONE:
      switch (out) {
        case at::ScalarType::Float: return row_cast<In, float>;
        case at::ScalarType::Half: return row_cast<In, c10::Half>;
        case at::ScalarType::BFloat16: return row_cast<In, c10::BFloat16>;
        default: return nullptr;
      }
    case KVQuantMode::FP8_E4M3: return row_fp8<In, c10::Float8_e4m3fn>;
    case KVQuantMode::FP8_E5M2: return row_fp8<In, c10::Float8_e5m2>;
    case KVQuantMode::NVFP4: return row_nvfp4<In>;
    case KVQuantMode::FP8_PER_TOKEN_HEAD: break;  // not a native format: to_mode refuses it first
  }
  return nullptr;
}

RowFn pick_row_fn(at::ScalarType in, KVQuantMode mode, at::ScalarType out) {
  switch (in) {
    case at::ScalarType::Float: return pick_for_input<float>(mode, out);
    case at::ScalarType::Half: return pick_for_input<c10::Half>(mode, out);
    case at::ScalarType::BFloat16: return pick_for_input<c10::BFloat16>(mode, out);
    default: return nullptr;
  }
}

int64_t slot_at(const at::Tensor& slots, int64_t t) {
  return slots.scalar_type() == at::ScalarType::Long ? slots.const_data_ptr<int64_t>()[t]
                                                     : slots.const_data_ptr<int32_t>()[t];
}

// The reference raises on an out-of-range slot; do the same, before any row is written.
void check_slot_range(const at::Tensor& slots, int64_t capacity) {
  for (int64_t t = 0; t < slots.size(0); ++t) {
    const int64_t s = slot_at(slots, t);
    TORCH_CHECK_INDEX(s >= -1 && s < capacity, "slot_mapping[", t, "]=", s, " is outside the cache (",
                      capacity, " slots; -1 = skip)");
  }
}

// kv_cache passed check_cache, so an NVFP4 (uint8) cache is contiguous within each page.
Dest cache_dest(const at::Tensor& kv_cache) {
  const int64_t es = kv_cache.element_size();
  Dest dst{static_cast<char*>(kv_cache.data_ptr()),
           kv_cache.stride(0) * es,
           kv_cache.stride(1) * es,
           kv_cache.stride(2) * es,
           kv_cache.stride(3) * es,
           kv_cache.size(2),
           kv_cache.size(0) * kv_cache.size(2),
           false,
           {}};
  if (holds_nvfp4_pages(kv_cache)) {
    dst.split_nvfp4 = true;
    // stride(1) may be anything for a size-1 dim elsewhere, but not here: dim 1 has size 2.
    dst.nvfp4 = nvfp4_page_layout(kv_cache.size(2), kv_cache.size(3), nvfp4_head_size(kv_cache.size(4)));
  }
  return dst;
}

Source source_of(const at::Tensor& k, const at::Tensor& v) {
  const int64_t es = k.element_size();
  return Source{{static_cast<const char*>(k.const_data_ptr()), static_cast<const char*>(v.const_data_ptr())},
                {k.stride(0) * es, v.stride(0) * es},
                {k.stride(1) * es, v.stride(1) * es}};
}

// Runs `row(half, head, src_row, dst)` for every (token, half, head) whose slot is not -1.
// `slots` undefined = identity mapping (encode_kv's contiguous output).
template <class RowOp>
void for_each_row(int64_t num_tokens, int64_t num_heads, int64_t head_size, int halves, const at::Tensor& slots,
                  const Source& src, const Dest& dst, int64_t row_bytes, RowOp row) {
  // Enough rows per task that scheduling stays far below the copy cost.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, halves * num_heads * row_bytes));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots.defined() ? slot_at(slots, t) : t;
      if (slot < 0) continue;
      const int64_t block = slot / dst.block_size, off = slot % dst.block_size;
      for (int half = 0; half < halves; ++half) {
        for (int64_t h = 0; h < num_heads; ++h) {
          row(half, h, src.base[half] + t * src.s_tok[half] + h * src.s_head[half],
              row_dst(dst, half, block, off, h, head_size));
        }
      }
    }
  });
}

// A K or V scale: head h reads ptr[h * head_stride] (stride 0: one scale per tensor).
struct Scale {
  const float* ptr;
  int64_t head_stride;
  float at(int64_t h) const { return ptr[h * head_stride]; }
};

Scale scale_of(const at::Tensor& s) { return Scale{s.const_data_ptr<float>(), scale_head_stride(s)}; }

void encode_into(const at::Tensor& key, const at::Tensor& value, int halves, const at::Tensor& slots,
                 const Dest& dst, const Scale scales[2], KVQuantMode mode, at::ScalarType out_dtype) {
  const int64_t head_size = key.size(2);
  const int64_t row_bytes = storage_row_dim(mode, head_size) * c10::elementSize(out_dtype);
  const Source src = source_of(key, value);
  if (mode == KVQuantMode::NONE && key.scalar_type() == out_dtype) {
    for_each_row(key.size(0), key.size(1), head_size, halves, slots, src, dst, row_bytes,
                 [&](int, int64_t, const char* s, const RowDst& d) { std::memcpy(d.row, s, row_bytes); });
    return;
  }
  const RowFn fn = pick_row_fn(key.scalar_type(), mode, out_dtype);
  TORCH_CHECK_VALUE(fn != nullptr, "no CPU encoder for input ", key.scalar_type(), " mode ", mode_name(mode), " cache ",
                    out_dtype);
  for_each_row(key.size(0), key.size(1), head_size, halves, slots, src, dst, row_bytes,
               [&](int half, int64_t h, const char* s, const RowDst& d) { fn(s, d, head_size, scales[half].at(h)); });
}

}  // namespace

at::Tensor encode_kv_cpu(const at::Tensor& x, const at::Tensor& scale, int64_t kv_quant_mode,
                         at::ScalarType cache_dtype) {
  const KVQuantMode mode = to_mode(kv_quant_mode);
  check_encode(x, scale, mode, cache_dtype);
  const int64_t row_dim = storage_row_dim(mode, x.size(2));
  at::Tensor out = at::empty({x.size(0), x.size(1), row_dim}, x.options().dtype(cache_dtype));
  const int64_t es = out.element_size();
  const Dest dst{static_cast<char*>(out.data_ptr()), 0, 0, x.size(1) * row_dim * es, row_dim * es,
                 std::max<int64_t>(1, x.size(0)), x.size(0), false, {}};
  const Scale s = scale_of(scale);
  const Scale scales[2] = {s, s};
  encode_into(x, x, 1, at::Tensor(), dst, scales, mode, cache_dtype);
  return out;
}

void cache_write_cpu(const at::Tensor& key_rows, const at::Tensor& value_rows, const at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping) {
  check_cache(kv_cache, slot_mapping, key_rows.size(0), key_rows.device());
  check_rows(key_rows, value_rows, kv_cache);
  const Dest dst = cache_dest(kv_cache);
  check_slot_range(slot_mapping, dst.capacity);
  const int64_t row_bytes = kv_cache.size(4) * kv_cache.element_size();
  const Source src = source_of(key_rows, value_rows);
  if (!dst.split_nvfp4) {
    for_each_row(key_rows.size(0), key_rows.size(1), 0, 2, slot_mapping, src, dst, row_bytes,
                 [&](int, int64_t, const char* s, const RowDst& d) { std::memcpy(d.row, s, row_bytes); });
    return;
  }
  // An encoded NVFP4 row is [data | scales]: the data moves as one run, each scale to its address.
  const int64_t head_size = nvfp4_head_size(row_bytes), half = head_size / 2;
  for_each_row(key_rows.size(0), key_rows.size(1), head_size, 2, slot_mapping, src, dst, row_bytes,
               [&](int, int64_t, const char* s, const RowDst& d) {
                 std::memcpy(d.row, s, half);
                 for (int64_t j = 0; j < head_size / kNvfp4Block; ++j) {
                   d.put_scale(j, static_cast<uint8_t>(s[half + j]));
                 }
               });
}

void encode_and_cache_write_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                                const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                const at::Tensor& v_scale, int64_t kv_quant_mode) {
  const KVQuantMode mode = to_mode(kv_quant_mode);
  check_encode_and_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, mode);
  const Dest dst = cache_dest(kv_cache);
  check_slot_range(slot_mapping, dst.capacity);
  const Scale scales[2] = {scale_of(k_scale), scale_of(v_scale)};
  encode_into(key, value, 2, slot_mapping, dst, scales, mode, kv_cache.scalar_type());
}

}  // namespace kvfuse

TORCH_LIBRARY_IMPL(kvfuse_native, CPU, m) {
  m.impl("encode_kv", TORCH_FN(kvfuse::encode_kv_cpu));
  m.impl("cache_write", TORCH_FN(kvfuse::cache_write_cpu));
  m.impl("encode_and_cache_write", TORCH_FN(kvfuse::encode_and_cache_write_cpu));
}
