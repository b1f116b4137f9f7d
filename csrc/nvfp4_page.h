// Where the CPU and CUDA kernels put the bytes of one NVFP4 row (packed E2M1 data, then one
// e4m3 scale per 16 elements), in a cache page or in encode_kv's dense output.
//
// kvfuse.kv_cache.nvfp4_page_index is the normative map (vLLM's page, so caches interchange);
// this is its restatement in strides, and tests/ops/test_native.py holds the kernels to it. Per
// page side (K, V; T = block_size, H = heads, D = head_size, S = D / 16):
//
//   data (t, h, i)   at (t * H + h) * D/2 + i
//   K scale (t, h, j) at T*H*D/2 + (t * H + h) * S + j
//   V scale (t, h, j) at T*H*D/2 + (t' * H + h) * S + s',  t' = 4 (t / 4) + j / (S/4),
//                                                          s' = 4 (j % (S/4)) + t % 4
//
// the V interleave only where T % 4 == 0 and S % 4 == 0, otherwise V scales are linear like K's.
// encode_kv's rows keep [data | scales] per (t, h): the same strides with other values.
#pragma once

#include <cstdint>

#include "encode_math.h"

namespace kvfuse {

// Byte offsets from the base of a side (a cache page's K or V half, or encode_kv's output).
struct Nvfp4Layout {
  int64_t data_tok, data_head;                // data of (t, h) starts at t * data_tok + h * data_head
  int64_t scale_base, scale_tok, scale_head;  // linear scale j at scale_base + t*scale_tok + h*scale_head + j
  int64_t v_group;  // > 0: V scales interleaved, S/4 scales per group (scale_tok is then H * S)
};

// Row width D/2 + D/16 = 9 D / 16 back to D (callers check row_dim % 9 == 0).
inline int64_t nvfp4_head_size(int64_t row_dim) { return row_dim / 9 * kNvfp4Block; }

inline bool nvfp4_v_scales_swizzled(int64_t block_size, int64_t head_size) {
  return block_size % 4 == 0 && (head_size / kNvfp4Block) % 4 == 0;
}

// A cache page side of block_size tokens x heads rows.
inline Nvfp4Layout nvfp4_page_layout(int64_t block_size, int64_t heads, int64_t head_size) {
  const int64_t half = head_size / 2, scales = head_size / kNvfp4Block;
  return Nvfp4Layout{heads * half,
                     half,
                     block_size * heads * half,
                     heads * scales,
                     scales,
                     nvfp4_v_scales_swizzled(block_size, head_size) ? scales / 4 : 0};
}

// Dense [tokens, heads, D/2 + S] rows (encode_kv's output, cache_write's input).
inline Nvfp4Layout nvfp4_rows_layout(int64_t heads, int64_t head_size) {
  const int64_t half = head_size / 2, row = half + head_size / kNvfp4Block;
  return Nvfp4Layout{heads * row, row, half, heads * row, row, 0};
}

KVFUSE_HD int64_t nvfp4_data_offset(const Nvfp4Layout& l, int64_t t, int64_t h) {
  return t * l.data_tok + h * l.data_head;
}

// Scale j = group * v_group + r of (t, h); the caller splits j (a division the CUDA kernel does
// by multiply-high). Linear sides pass group = 0, r = j.
KVFUSE_HD int64_t nvfp4_scale_offset(const Nvfp4Layout& l, bool interleaved, int64_t t, int64_t h, int64_t group,
                                     int64_t r) {
  if (!interleaved) return l.scale_base + t * l.scale_tok + h * l.scale_head + r;
  // Rows t' = 4 (t / 4) + group of head h's (T, S) plane; within a row, block-major, token-minor.
  return l.scale_base + ((t & ~int64_t{3}) + group) * l.scale_tok + h * l.scale_head + 4 * r + (t & 3);
}

}  // namespace kvfuse
