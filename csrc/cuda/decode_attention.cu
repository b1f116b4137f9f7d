// Paged decode attention over FP8 (e4m3, e5m2, per-token-head e4m3) and NVFP4 caches with warp-level tensor-core MMA
// (mma.sync m16n8k16, fp16 inputs, fp32 accumulators), the cache bytes decoded straight into
// the MMA's register fragments: decoded values never pass through shared memory. Chunks arrive as
// raw bytes through a ring of cp.async shared-memory stages per warp (KVFUSE_DECODE_FP8_STAGES,
// KVFUSE_DECODE_NVFP4_STAGES; 0 prefetches them into registers with loads of whole row runs). The
// E2M1 / e4m3 expansion is integer ops, byte permutes and the hardware fp8x2 -> f16x2 convert.
//
// Semantics: kvfuse/ops/reference.py paged_attention (kvfuse.ops.native.paged_attention is the
// entry point, and says which calls come here). Per query row at position p, keys j <= p (and
// p - j < W with a sliding window), base-2 online softmax:
//
//   s_j = (q . k_j) * sm_scale * k_scale * log2(e)   [c * tanh(s_j / c) with a soft-cap c]
//   o   = v_scale * sum_j 2^(s_j - m) v_j / (sum_j 2^(s_j - m) [+ 2^(sink - m)])
//
// NVFP4 values enter the MMA as e2m1 * block scale * 2^-6 in fp16 (exact: a 2-bit by 4-bit
// mantissa product, exponents inside fp16's range); the 2^6 is folded into k_scale / v_scale.
// FP8 values enter as themselves (fp8 -> fp16 is exact). Per-token-head FP8 rows (FP8_PER_TOKEN_HEAD:
// D e4m3 bytes, then the row's float32 scale) are only 4-byte aligned, and a lone row of D + 4
// bytes spans one 32-byte sector more than its data: read one by one, 25% more bytes would cross
// from L2 than the cache holds (L2 throughput bounds this kernel). So where 4 heads' rows of a slot
// form one 16-byte aligned run (heads % 4 == 0, rows back to back), a block takes 4 KV heads, a
// warp each, and the block stages the runs of its chunk together (HG = 4); otherwise each row is
// staged as the 16-byte segments that cover it. Staged rows are read back 32 bits at a time. A
// key's scale multiplies its score; a value's scale multiplies its probability before the P V
// product, relative to the largest value scale the warp has met (vref), times 2^8, so that the
// fp16 operand stays in (0, 256] and small probabilities keep fp16's precision; vref enters the
// accumulator's rescale like a moved running max. A bf16 query is converted to fp16,
// scaled down by a power of two first when its tile exceeds 2^15 (the scores are scaled back).
//
// Work split: a block of kWarps warps (8 for NVFP4 head pairs at up to 2 blocks per SM and query
// tiles of 8 rows) owns one (sequence, KV head, split). Its query tile is up to
// ROWS (8 or 16) rows = (query token, query head of the KV head's group) pairs; for decode with a
// GQA group of 4 that is 4 live rows of 8. The warps take interleaved 16-key chunks of the split's
// key range, each with its own running max / sum / accumulator, merged through shared memory at
// the end. A block of HG > 1 KV heads gives each head 1 / HG of its warps: HG = 4 for
// per-token-head rows (above; a block-wide stage, a warp per head, nothing merged across warps);
// HG = 2 for NVFP4 caches with an even number of heads (per-warp stages; warps w and w + WARPS / 2
// take the same chunks of neighbouring heads, whose rows of a slot are one 128-byte run). Blocks are
// launched heads first (DecodeParams::heads_fastest), so that a sequence's heads are read
// together. With more splits than one, the block
// writes a normalised partial output and its log2-sum-exp, and decode_attention_reduce_kernel
// merges the splits.
//
// Fragment plan (g = lane / 4, t = lane % 4; the MMA's own layouts, PTX ISA "m16n8k16"):
//   S^T = K Q^T   A = K (keys g, g + 8 of the chunk x 16 head dims), B = Q^T (16 dims x 8 query
//               rows): every MMA row is a real key and the tile's rows fill the 8-wide N side.
//               Head dims are permuted identically in K and Q so that lane t's A operands are one
//               run of its key row (run_byte: whole 16-byte segments, rows read in full sectors).
//   O^T = V^T P^T  A = V^T (16 dims x 16 keys), B = P^T (16 keys x 8 rows): S^T's accumulator
//               holds keys g, g + 8 x rows 2t, 2t + 1; one movmatrix per 8x8 tile turns it into
//               P^T's fragment, and the O^T accumulators hold the same rows 2t, 2t + 1, so the
//               softmax rescale needs no exchange between lanes. Output dims are permuted so that
//               lane g's A operands are one run of each of its four keys' rows.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <optional>
#include <type_traits>

#include "../kv_quant_mode.h"
#include "../nvfp4_page.h"
#include "device_attributes.h"
#include "grid_dependency.h"

namespace kvfuse {
namespace {

// kE4m3Rows: FP8_PER_TOKEN_HEAD, e4m3 rows each followed by its float32 scale.
enum class DecodeFmt { kNvfp4, kE4m3, kE5m2, kE4m3Rows };

// Resident blocks per SM the register budget is set for (head sizes <= 128): 4 x 4 warps at 128
// registers lets a batch-64, 8-KV-head decode (512 blocks) run in one wave on 132 SMs.
#ifndef KVFUSE_DECODE_MIN_BLOCKS
#define KVFUSE_DECODE_MIN_BLOCKS 4
#endif

// FP8 caches: each warp streams its chunks through a ring of this many shared-memory stages with
// cp.async (0: each lane prefetches the next chunk into registers). Measured in BENCHMARKS.md.
#ifndef KVFUSE_DECODE_FP8_STAGES
#define KVFUSE_DECODE_FP8_STAGES 3
#endif

// FP8 stages: 1 lays rows out whole and swizzled (Stage); 0 pads each row by 16 bytes instead,
// the layout measured before it (kept for A/B builds, BENCHMARKS.md).
#ifndef KVFUSE_DECODE_FP8_SWIZZLE
#define KVFUSE_DECODE_FP8_SWIZZLE 1
#endif

// Launch order: 1 makes a sequence's KV heads neighbouring blocks (DecodeParams::heads_fastest).
#ifndef KVFUSE_DECODE_HEADS_FASTEST
#define KVFUSE_DECODE_HEADS_FASTEST 1
#endif
// L2 prefetch size (0, 64, 128 or 256 bytes) of the decode's cp.async copies of NVFP4 / FP8 rows:
// the other KV heads of a slot are the neighbouring blocks' rows (heads first), so a larger
// prefetch reads the slot's run from DRAM in longer bursts for them. 256 against 0 in the
// eighteenth session's A/Bs (BENCHMARKS.md): FP8 1-2% faster, NVFP4 level within noise.
#ifndef KVFUSE_DECODE_NVFP4_PREFETCH
#define KVFUSE_DECODE_NVFP4_PREFETCH 256
#endif
#ifndef KVFUSE_DECODE_FP8_PREFETCH
#define KVFUSE_DECODE_FP8_PREFETCH 256
#endif
// 1: the decode and split-merge kernels are launched as programmatic dependents (grid_dependency.h).
// Off: level within noise in the eighteenth session's A/B (BENCHMARKS.md).
#ifndef KVFUSE_DECODE_PDL
#define KVFUSE_DECODE_PDL 0
#endif

// NVFP4 caches: KV heads per block where the heads are even in number: 2 puts two heads' warps
// (two or four each: KVFUSE_DECODE_NVFP4_PAIR_WARPS) on the same chunks at once, so that the
// 128-byte runs their rows of a slot form are read together rather than as 64-byte halves by
// blocks apart (BENCHMARKS.md); 1: a head per block; 4 (where heads % 4 == 0, else 2): a warp
// per head, measured level with 2.
#ifndef KVFUSE_DECODE_NVFP4_HEADS
#define KVFUSE_DECODE_NVFP4_HEADS 2
#endif

// NVFP4 head pairs with query tiles of 8 rows in launches that take the
// KVFUSE_DECODE_NVFP4_GROUP_MIN_BLOCKS build: warps per block. 8 (four per head) doubles the warps
// an SM holds at the same blocks, at a register budget of 65536 / (32 x 8 x 2) = 128, and measured
// 2-3% faster than 4 (BENCHMARKS.md, nineteenth session). 16-row tiles keep 4: at 128 registers
// they spill.
#ifndef KVFUSE_DECODE_NVFP4_PAIR_WARPS
#define KVFUSE_DECODE_NVFP4_PAIR_WARPS 8
#endif

// NVFP4 head-group launches of at most this many blocks per SM take a build whose register
// budget is set for that many blocks (of 4 warps: more registers per thread than
// KVFUSE_DECODE_MIN_BLOCKS allows; of KVFUSE_DECODE_NVFP4_PAIR_WARPS = 8: more warps at the same
// registers); larger ones keep the KVFUSE_DECODE_MIN_BLOCKS build. 0: always the latter.
#ifndef KVFUSE_DECODE_NVFP4_GROUP_MIN_BLOCKS
#define KVFUSE_DECODE_NVFP4_GROUP_MIN_BLOCKS 2
#endif

// NVFP4 caches: the same ring of cp.async stages (Nvfp4Stage), or 0: each lane prefetches the
// next chunk into registers (the kernel before the stages, kept for A/B builds, BENCHMARKS.md).
#ifndef KVFUSE_DECODE_NVFP4_STAGES
#define KVFUSE_DECODE_NVFP4_STAGES 3
#endif

// NVFP4 V: 1 pairs two keys' E2M1 codes byte by byte before the convert, so that the convert
// yields the MMA's (key, key + 1) operand pairs directly; 0 converts each key's run and pairs the
// halves afterwards (one byte permute more per operand register).
#ifndef KVFUSE_DECODE_NVFP4_V_PAIRS
#define KVFUSE_DECODE_NVFP4_V_PAIRS 1
#endif

// NVFP4 V (with V_PAIRS): 1 decodes the chunk's V operands before the softmax, so that the decode
// fills the latency of its shuffles; 0 after it.
#ifndef KVFUSE_DECODE_NVFP4_V_EARLY
#define KVFUSE_DECODE_NVFP4_V_EARLY 1
#endif

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 16;  // keys per warp per iteration
constexpr float kLog2e = 1.4426950408889634f;

struct DecodeParams {
  const void* query;
  const uint8_t* cache;
  const float* k_scale;
  const float* v_scale;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const float* sinks;  // nullptr: none
  void* out;           // [tokens, q_heads, D], the query's dtype (no split)
  float* part_out;     // [splits, tokens, q_heads, D] (split)
  float* part_lse;     // [splits, tokens, q_heads] (split)
  int64_t stride_qt, stride_qh;
  int64_t stride_cb;                                   // bytes
  int stride_ckv, stride_cs, stride_ch;                 // bytes, inside one page
  int64_t stride_bt;
  int64_t num_tokens;
  int num_seqs, num_kv_heads, group, page, window, num_splits;
  int k_scale_stride, v_scale_stride;  // 0: one scale for every KV head
  float qk_scale;                      // sm_scale * log2(e)
  float cap;                           // soft-cap * log2(e), 0: none
  float inv_cap;                       // 1 / cap
  int page_shift;                      // log2(page) for pages of 16 << k tokens, else -1
  bool v_scales_swizzled;              // NVFP4: vLLM's 4-token interleave of the V block scales
  bool query_fp16;
  bool heads_fastest;                  // grid (head groups, sequences, splits), else (sequences, head groups, splits)
};

// ----------------------------------------------------------------------------- register math

template <DecodeFmt F>
__device__ __forceinline__ void fp8x4_to_f16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  // Bytes 0, 1 -> lo and 2, 3 -> hi; the lower byte of each pair lands in the lower half.
  if constexpr (F == DecodeFmt::kE5m2) {
    asm("{.reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e5m2x2 %0, a;\n cvt.rn.f16x2.e5m2x2 %1, b;\n}"
        : "=r"(lo), "=r"(hi) : "r"(w));
  } else {
    asm("{.reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}"
        : "=r"(lo), "=r"(hi) : "r"(w));
  }
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The low two e4m3 bytes of x as one f16x2 (byte 0 in the low half): one convert where only one
// pair is wanted (fp8x4_to_f16x2 converts both halves, in one asm block the compiler keeps whole).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x) {
  uint32_t d;
  asm("{.reg .b16 a, b;\n mov.b32 {a, b}, %1;\n cvt.rn.f16x2.e4m3x2 %0, a;\n}" : "=r"(d) : "r"(x));
  return d;
}

// Byte `j` of an e4m3 block-scale word as the f16x2 (s, s).
__device__ __forceinline__ uint32_t e4m3_pair(uint32_t word, int j) {
  return e4m3x2_to_f16x2(__byte_perm(word, 0u, 0x11u * static_cast<uint32_t>(j)));
}

// The eight E2M1 codes of a packed word as e4m3 bytes: byte j of `even` holds element 2j (the
// low nibble of byte j), byte j of `odd` element 2j + 1. The nibble's exponent and mantissa bits
// are placed where an e4m3 byte keeps them (exponent bias 7 against E2M1's 1: a factor 2^-6), so
// that the hardware fp8 -> f16 convert does the rest.
__device__ __forceinline__ void e2m1x8_to_e4m3(uint32_t w, uint32_t& even, uint32_t& odd) {
  even = ((w & 0x07070707u) << 2) | ((w & 0x08080808u) << 4);
  odd = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

// Four packed E2M1 bytes -> four f16x2 (byte j: low nibble in the low half), each value
// e2m1 * scale * 2^-6.
__device__ __forceinline__ void e2m1x8_to_f16x2(uint32_t w, uint32_t scale2, uint32_t (&out)[4]) {
  uint32_t lo8, hi8;
  e2m1x8_to_e4m3(w, lo8, hi8);
  uint32_t a, b, c, d;
  fp8x4_to_f16x2<DecodeFmt::kE4m3>(__byte_perm(lo8, hi8, 0x5140), a, b);
  fp8x4_to_f16x2<DecodeFmt::kE4m3>(__byte_perm(lo8, hi8, 0x7362), c, d);
  out[0] = hmul2(a, scale2);
  out[1] = hmul2(b, scale2);
  out[2] = hmul2(c, scale2);
  out[3] = hmul2(d, scale2);
}

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// W 32-bit words from an address aligned to min(16, 4 W) bytes; the cache is read once.
template <int W>
__device__ __forceinline__ void load_words(const uint8_t* p, uint32_t (&w)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W / 4; ++i) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p) + i);
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (W == 2) {
    const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
    w[0] = v.x, w[1] = v.y;
  } else {
    static_assert(W == 1, "row runs are 4, 8 or a multiple of 16 bytes");
    w[0] = __ldcs(reinterpret_cast<const unsigned int*>(p));
  }
}

// Byte j of word w of the run of a row that lane part `part` (of PARTS) holds. Runs of up to 16
// bytes are contiguous; longer ones are 16-byte segments PARTS * 16 bytes apart, so that every load
// instruction of the warp reads whole 32-byte sectors.
template <int WORDS, int PARTS>
__host__ __device__ constexpr int run_byte(int part, int w, int j) {
  return WORDS <= 4 ? part * WORDS * 4 + w * 4 + j : (w / 4) * PARTS * 16 + part * 16 + (w % 4) * 4 + j;
}

// The WORDS words of a run that starts at `run` (laid out as run_byte lays them).
template <int WORDS, int PARTS>
__device__ __forceinline__ void load_run_at(const uint8_t* run, uint32_t (&w)[WORDS]) {
  if constexpr (WORDS <= 4) {
    load_words(run, w);
  } else {
#pragma unroll
    for (int s = 0; s < WORDS / 4; ++s) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(run + s * PARTS * 16));
      w[4 * s] = v.x, w[4 * s + 1] = v.y, w[4 * s + 2] = v.z, w[4 * s + 3] = v.w;
    }
  }
}

template <int WORDS, int PARTS>
__device__ __forceinline__ void load_run(const uint8_t* row, int part, uint32_t (&w)[WORDS]) {
  load_run_at<WORDS, PARTS>(row + run_byte<WORDS, PARTS>(part, 0, 0), w);
}

template <int W>
__device__ __forceinline__ void zero_words(uint32_t (&w)[W]) {
#pragma unroll
  for (int i = 0; i < W; ++i) w[i] = 0;
}

// ----------------------------------------------------------------------------- the cache's bytes

template <DecodeFmt F, int D>
struct Layout {
  static constexpr bool kNvfp4 = F == DecodeFmt::kNvfp4;
  static constexpr bool kRowScales = F == DecodeFmt::kE4m3Rows;
  static constexpr int kRowBytes = kNvfp4 ? D / 2 : D;  // packed data bytes per (token, head)
  static constexpr int kKWords = kRowBytes / 16;        // per thread per key row: a quarter of the row
  static constexpr int kVWords = kRowBytes / 32;        // per thread per key: an eighth of the row
  static constexpr int kBlocks = D / 16;                // NVFP4 block scales per row
  static constexpr int kKScales = kNvfp4 ? (D / 64) : 0;          // block scales of a K run
  static constexpr int kVScales = kNvfp4 ? (D >= 128 ? D / 128 : 1) : 0;  // of a V run
  // Per-token-head rows are read from shared memory 32 bits at a time, and every such read of a
  // warp falls on one word offset mod 4 unless lanes take their run's words in different orders:
  // lane t reads K word (w + t) mod 4 of each 4 at step w, lane g V word (w + g / 2) mod 4, which
  // spreads a read over all 32 banks. The order only renames the head dims a lane's MMA k-slots
  // (K) or accumulator rows (V) hold, so the query load and the output store follow it.
  __host__ __device__ static constexpr int rotate(int w, int by, int words) {
    return words < 2 ? w : (w & ~((words < 4 ? words : 4) - 1)) | ((w + by) & ((words < 4 ? words : 4) - 1));
  }
  __host__ __device__ static constexpr int k_word(int w, int t) { return kRowScales ? rotate(w, t, kKWords) : w; }
  __host__ __device__ static constexpr int v_word(int w, int g) { return kRowScales ? rotate(w, g / 2, kVWords) : w; }
  // Shared-memory stages, or none (per-token-head rows are only ever staged).
  static constexpr int kStages = kNvfp4                                       ? KVFUSE_DECODE_NVFP4_STAGES
                                 : kRowScales && KVFUSE_DECODE_FP8_STAGES < 2 ? 2
                                                                              : KVFUSE_DECODE_FP8_STAGES;
  static_assert(kStages == 0 || kStages >= 2, "a ring of stages has at least two");
};

// The block scales of lane part t's run of an NVFP4 K row (Layout::kKScales bytes, packed), from
// the first of them (`first`: the row's scale bytes + run_byte(t, 0, 0) / 8). Two words (8 bytes)
// of codes share a block, and a run's 16-byte segments lie 64 bytes (8 blocks) apart in the row, so
// the run's scales are one byte (D = 64) or one 16-bit pair per segment, 8 bytes apart. kGlobal:
// `first` points into the cache (read-only loads), else into a stage.
template <int D, bool kGlobal>
__device__ __forceinline__ uint32_t k_run_scales(const uint8_t* first) {
  using L = Layout<DecodeFmt::kNvfp4, D>;
  static_assert(run_byte<L::kKWords, 4>(1, 0, 0) / 8 - run_byte<L::kKWords, 4>(0, 0, 0) / 8 == (D == 64 ? 1 : 2) &&
                    (L::kKScales < 4 || run_byte<L::kKWords, 4>(0, 4, 0) / 8 == 8),
                "the run layout of k_run_scales");
  if constexpr (L::kKScales == 1) {
    if constexpr (kGlobal) {
      return __ldg(first);
    } else {
      return *first;
    }
  } else {
    uint32_t packed = 0;
#pragma unroll
    for (int s = 0; s < L::kKScales / 2; ++s) {
      const uint16_t* pair = reinterpret_cast<const uint16_t*>(first + 8 * s);
      uint32_t value;
      if constexpr (kGlobal) {
        value = __ldg(pair);
      } else {
        value = *pair;
      }
      packed |= value << (16 * s);
    }
    return packed;
  }
}

// One chunk's raw bytes, as a thread holds them: K rows g and g + 8 (its quarter of each), V rows
// 2t, 2t+1, 2t+8, 2t+9 (its eighth of each) and, for NVFP4, their block scales (bytes, packed).
template <DecodeFmt F, int D>
struct ChunkBytes {
  using L = Layout<F, D>;
  uint32_t k[2][L::kKWords];
  uint32_t v[4][L::kVWords];
  uint32_t k_scales[2];  // NVFP4: kKScales bytes each
  uint32_t v_scales[4];  // NVFP4: kVScales bytes each
  float k_row_scales[2];  // kE4m3Rows: the scales of K rows g, g + 8
  float v_row_scales[2];  // kE4m3Rows: the scales of V rows g, g + 8 (the keys of this lane's scores)
};

// Key i of a chunk for this thread: K rows g, g + 8 (i = 0, 1), V rows 2t, 2t+1, 2t+8, 2t+9 (i = 2..5).
__device__ __forceinline__ int chunk_key(int i, int g, int t) {
  return i < 2 ? g + 8 * i : 2 * t + ((i - 2) & 1) + 8 * ((i - 2) >> 1);
}

// Any chunk: keys outside [lo, hi) read as zeros (their pages never looked up), every key's page
// looked up on its own. Chunks of in-range keys on one page take load_chunk_in_page.
template <DecodeFmt F, int D>
__device__ __forceinline__ void load_chunk(const DecodeParams& p, const int32_t* bt_row, int kvh, int start, int lo,
                                           int hi, int g, int t, ChunkBytes<F, D>& c) {
  using L = Layout<F, D>;
  const int H = p.num_kv_heads;
  const uint8_t* side[6];
  int slot[6];
#pragma unroll
  for (int i = 0; i < 6; ++i) {
    const int pos = start + chunk_key(i, g, t);
    side[i] = nullptr;
    slot[i] = 0;
    if (pos >= lo && pos < hi) {
      const int block = __ldg(bt_row + pos / p.page);
      side[i] = p.cache + static_cast<int64_t>(block) * p.stride_cb + (i < 2 ? 0 : p.stride_ckv);
      slot[i] = pos % p.page;
    }
  }
  // Offsets inside a page side fit in 32 bits (the host checks the page's size).
  const int scales_at = p.page * H * L::kRowBytes;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (side[r] == nullptr) {
      zero_words(c.k[r]);
      c.k_scales[r] = 0;
      continue;
    }
    if constexpr (L::kNvfp4) {
      const int row = slot[r] * H + kvh;
      load_run<L::kKWords, 4>(side[r] + row * L::kRowBytes, t, c.k[r]);
      const uint8_t* row_scales = side[r] + scales_at + row * L::kBlocks;
      c.k_scales[r] = k_run_scales<D, true>(row_scales + run_byte<L::kKWords, 4>(t, 0, 0) / 8);
    } else {
      load_run<L::kKWords, 4>(side[r] + slot[r] * p.stride_cs + kvh * p.stride_ch, t, c.k[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    if (side[2 + r] == nullptr) {
      zero_words(c.v[r]);
      c.v_scales[r] = 0;
      continue;
    }
    const int sl = slot[2 + r];
    if constexpr (L::kNvfp4) {
      const int row = sl * H + kvh;
      load_run<L::kVWords, 8>(side[2 + r] + row * L::kRowBytes, g, c.v[r]);
      const uint8_t* scales = side[2 + r] + scales_at;
      c.v_scales[r] = 0;
#pragma unroll
      for (int j = 0; j < L::kVScales; ++j) {
        const int block = run_byte<L::kVWords, 8>(g, 2 * j, 0) / 8;
        int at;
        if (p.v_scales_swizzled) {
          constexpr int per_group = L::kBlocks / 4 > 0 ? L::kBlocks / 4 : 1;
          at = (((sl & ~3) + block / per_group) * H + kvh) * L::kBlocks + 4 * (block % per_group) + (sl & 3);
        } else {
          at = row * L::kBlocks + block;
        }
        c.v_scales[r] |= static_cast<uint32_t>(__ldg(scales + at)) << (8 * j);
      }
    } else {
      load_run<L::kVWords, 8>(side[2 + r] + sl * p.stride_cs + kvh * p.stride_ch, g, c.v[r]);
    }
  }
}

// A chunk whose keys all lie in [lo, hi) on one page (pages of 16 << k tokens): one block-table
// read and no per-key checks. Both the register and the shared-memory loaders take this rule.
__device__ __forceinline__ bool chunk_in_page(const DecodeParams& p, int start, int lo, int hi) {
  return p.page_shift >= 4 && start >= lo && start + kChunk <= hi;
}

// Byte offsets inside a page side of this lane's rows of a chunk that starts at a page's slot 0
// (computed once per query tile); a chunk starting at slot `first` adds first * data_row1 to the
// data offsets and first * scale_row1 to the scale offsets.
struct ChunkOffsets {
  uint32_t k_data, v_data;    // K row g (this lane's run), V row 2t (its run)
  uint32_t data_row1;         // one slot further
  uint32_t k_scale, v_scale;  // NVFP4: the run's first block scale of K row g, of V row 2t
  uint32_t scale_row1;        // NVFP4: one slot further (linear scales)
  uint32_t v_scale_next;      // NVFP4: V row 2t + 1's scale relative to row 2t's (1 when interleaved)
  uint32_t v_scale_block;     // NVFP4: the next block's scale relative to the first (4 when interleaved)
};

template <DecodeFmt F, int D>
__device__ __forceinline__ ChunkOffsets chunk_offsets(const DecodeParams& p, int kvh, int g, int t) {
  using L = Layout<F, D>;
  const uint32_t H = p.num_kv_heads;
  ChunkOffsets o{};
  if constexpr (L::kNvfp4) {
    o.data_row1 = H * L::kRowBytes;
    o.k_data = (g * H + kvh) * L::kRowBytes + run_byte<L::kKWords, 4>(t, 0, 0);
    o.v_data = (2 * t * H + kvh) * L::kRowBytes + run_byte<L::kVWords, 8>(g, 0, 0);
    const uint32_t scales_at = p.page * H * L::kRowBytes;
    o.scale_row1 = H * L::kBlocks;
    o.k_scale = scales_at + (g * H + kvh) * L::kBlocks + run_byte<L::kKWords, 4>(t, 0, 0) / 8;
    const int block = run_byte<L::kVWords, 8>(g, 0, 0) / 8;
    if (p.v_scales_swizzled) {
      constexpr int per_group = L::kBlocks / 4 > 0 ? L::kBlocks / 4 : 1;
      o.v_scale = scales_at + (((2 * t) & ~3) + block / per_group) * H * L::kBlocks + kvh * L::kBlocks +
                  4 * (block % per_group) + ((2 * t) & 3);
      o.v_scale_next = 1;
      o.v_scale_block = 4;
    } else {
      o.v_scale = scales_at + (2 * t * H + kvh) * L::kBlocks + block;
      o.v_scale_next = o.scale_row1;
      o.v_scale_block = 1;
    }
  } else {
    o.data_row1 = p.stride_cs;
    o.k_data = g * p.stride_cs + kvh * p.stride_ch + run_byte<L::kKWords, 4>(t, 0, 0);
    o.v_data = 2 * t * p.stride_cs + kvh * p.stride_ch + run_byte<L::kVWords, 8>(g, 0, 0);
  }
  return o;
}

// A chunk of in-range keys on one page (pages of 16 << k tokens): one block-table read, then the
// precomputed offsets.
template <DecodeFmt F, int D>
__device__ __forceinline__ void load_chunk_in_page(const DecodeParams& p, const int32_t* bt_row, int start,
                                                   const ChunkOffsets& o, ChunkBytes<F, D>& c) {
  using L = Layout<F, D>;
  const int block = __ldg(bt_row + (start >> p.page_shift));
  const uint8_t* k_side = p.cache + static_cast<int64_t>(block) * p.stride_cb;
  const uint8_t* v_side = k_side + p.stride_ckv;
  const uint32_t first = start & (p.page - 1);
  const uint32_t shift = first * o.data_row1, row8 = 8 * o.data_row1;
  // Relative offsets of V rows 2t, 2t+1, 2t+8, 2t+9.
  const uint32_t v_rows[4] = {0, o.data_row1, row8, row8 + o.data_row1};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    load_run_at<L::kKWords, 4>(k_side + (o.k_data + shift + r * row8), c.k[r]);
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    load_run_at<L::kVWords, 8>(v_side + (o.v_data + shift + v_rows[r]), c.v[r]);
  }
  if constexpr (L::kNvfp4) {
    const uint32_t scale_shift = first * o.scale_row1, scale_row8 = 8 * o.scale_row1;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      c.k_scales[r] = k_run_scales<D, true>(k_side + (o.k_scale + scale_shift + r * scale_row8));
    }
    const uint32_t v_scale_rows[4] = {0, o.v_scale_next, scale_row8, scale_row8 + o.v_scale_next};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint8_t* sc = v_side + (o.v_scale + scale_shift + v_scale_rows[r]);
      c.v_scales[r] = __ldg(sc);
      if constexpr (L::kVScales > 1) c.v_scales[r] |= static_cast<uint32_t>(__ldg(sc + o.v_scale_block)) << 8;
    }
  }
}

// ----------------------------------------------------------------------------- shared-memory stages

// One chunk's rows as cp.async lays them in a warp's stage (FP8 caches): K rows, then V rows.
//
// FP8 rows (D bytes, a multiple of 32) are D bytes apart, and row k's 32-byte units are permuted
// by an XOR with swizzle(k), so that every unit stays one whole, aligned 32-byte unit of shared
// memory. A cp.async pair of 16-byte pieces whose global sector lands across a 32-byte boundary
// of shared memory costs a second sector request from L2 and a second shared-memory wavefront:
// the 16-byte row padding this layout replaces did that on every odd row, 1.5x the L2-to-SM
// bytes of the chunk (ncu, BENCHMARKS.md; benchmarks/stage_layout.py models both layouts). The
// permutation also keeps read_chunk's reads free of bank conflicts at D >= 128: the 8 lanes of a
// 16-byte read phase take rows g, g + 1 (K: units {2s, 2s + 1} of each, told apart by bit 1 of
// the swizzle) or rows 2t (V: unit 0 or 1 of rows 0, 2, 4, 6, told apart by all of it).
//
// A per-token-head row (D + 4 bytes at any 4-byte offset) takes the 16-byte segments that cover
// it, (D + 31) / 16 of them: an odd count, so that its 32-bit reads (all at one offset mod 16)
// spread over all 8 bank quads that such reads can reach.
template <DecodeFmt F, int D>
struct Stage {
  using L = Layout<F, D>;
  static_assert(!L::kNvfp4, "NVFP4 chunks: Nvfp4Stage");
  static_assert(L::kRowScales || L::kRowBytes % 32 == 0, "FP8 rows are whole 32-byte units");
  static constexpr int kPieces = L::kRowScales ? (D + 31) / 16 : L::kRowBytes / 16;  // 16-byte copies per row
  static constexpr bool kSwizzled = !L::kRowScales && KVFUSE_DECODE_FP8_SWIZZLE;
  static constexpr int kPitch = L::kRowScales ? kPieces * 16 : L::kRowBytes + (kSwizzled ? 0 : 16);
  static constexpr int kV = kChunk * kPitch;
  static constexpr int kBytes = 2 * kChunk * kPitch;
  static constexpr int kUnits = L::kRowBytes / 32;  // FP8: 2, 4 or 8 (D = 64, 128, 256)
  static constexpr int kPrefetch = L::kRowScales ? 0 : KVFUSE_DECODE_FP8_PREFETCH;
  __host__ __device__ static constexpr int swizzle(int k) {
    return (((k >> 1) & 1) | (((k ^ (k >> 2)) & 1) << 1)) & (kUnits - 1);
  }
  // Where byte `byte` of a side's key row k lies, from the side's first row.
  __host__ __device__ static constexpr int place(int k, int byte) {
    return kSwizzled ? k * kPitch + ((((byte >> 5) ^ swizzle(k)) << 5) | (byte & 31)) : k * kPitch + byte;
  }
};

// One chunk of HG heads' per-token-head rows as a block stages them (HG > 1): per side and key,
// the slot's run of HG rows (HG (D + 4) bytes, 16-byte aligned: the host checks).
template <int D, int HG>
struct GroupStage {
  static constexpr int kRow = D + 4;
  static constexpr int kPieces = HG * kRow / 16;  // 16-byte copies per key and side
  static constexpr int kPitch = kPieces * 16;
  static constexpr int kV = kChunk * kPitch;
  static constexpr int kBytes = 2 * kV;
  static constexpr int kPrefetch = 0;
  static_assert(HG * kRow % 16 == 0, "a run of HG rows must be whole 16-byte units");
  __host__ __device__ static constexpr int place(int k, int byte) { return k * kPitch + byte; }
};

// One NVFP4 chunk as a warp stages it: the K rows' packed codes, the V rows', then the K rows'
// block scales and the V rows' (kBlocks bytes per key, as the page holds them: linear, or vLLM's
// 4-token interleave for V, read back by scale_at).
//
// A row of D / 2 bytes is 1, 2 or 4 whole 32-byte units; each unit keeps its place in its 128-byte
// line of shared memory up to an XOR of that 2-bit place with line_swizzle(k), so cp.async pairs
// still land in whole aligned units (see Stage) and the read-back is free of bank conflicts: K
// reads (rows g, g + 1 per 16-byte phase, or rows 0-3 per 8-byte phase at D = 64) cover a whole
// 128-byte line, and V reads of rows 0, 2, 4, 6 (or 1, 3, 5, 7) at one unit fall in four different
// places of the line. D / 2 = 128 bytes is FP8's D = 128 case, with its swizzle.
template <int D>
struct Nvfp4Stage {
  static constexpr int kRowBytes = D / 2;
  static constexpr int kUnits = kRowBytes / 32;
  static constexpr int kBlocks = D / 16;
  static constexpr int kPieces = kRowBytes / 16;  // 16-byte copies per row
  static constexpr int kV = kChunk * kRowBytes;
  static constexpr int kScales = 2 * kV;          // K scale rows, then V scale rows
  static constexpr int kScaleSide = kChunk * kBlocks;
  static constexpr int kBytes = kScales + 2 * kScaleSide;
  static_assert(kUnits == 1 || kUnits == 2 || kUnits == 4, "NVFP4 rows of 32, 64 or 128 bytes");
  static_assert(kBytes % 16 == 0, "stages stay 16-byte aligned");
  __host__ __device__ static constexpr int line_swizzle(int k) {
    return kUnits == 4   ? (((k >> 1) & 1) | (((k ^ (k >> 2)) & 1) << 1))
           : kUnits == 2 ? ((k >> 1) & 3)
                         : ((k >> 2) & 1);
  }
  // Where byte `byte` of a side's key row k lies, from the side's first row.
  __host__ __device__ static constexpr int place(int k, int byte) {
    const int unit = k * kUnits + (byte >> 5);
    return (((unit & ~3) | ((unit & 3) ^ line_swizzle(k))) << 5) | (byte & 31);
  }
  // Block b's scale of key k in a side's scale rows (interleaved: V scales in vLLM's layout, where
  // the page's row of slot 4 i + j holds blocks (j per_group ..) of slots 4 i .. 4 i + 3).
  __host__ __device__ static constexpr int scale_at(int k, int b, bool interleaved) {
    constexpr int per_group = kBlocks / 4 > 0 ? kBlocks / 4 : 1;
    return interleaved ? ((k & ~3) + b / per_group) * kBlocks + 4 * (b % per_group) + (k & 3) : k * kBlocks + b;
  }
};

// PREFETCH: 0, or the L2 prefetch size (64, 128, 256 bytes) the copy asks for around its sector.
template <int PREFETCH = 0>
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;  // 0: the destination is zero-filled
  if constexpr (PREFETCH == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else if constexpr (PREFETCH == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else if constexpr (PREFETCH == 64) {
    asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
  }
}

// 4, 8 or 16 bytes (the NVFP4 scale rows); .ca: .cg copies only 16.
template <int N, int PREFETCH = 0>
__device__ __forceinline__ void cp_async_small(uint32_t dst, const void* src, bool valid) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
  const int src_bytes = valid ? N : 0;
  if constexpr (PREFETCH == 256) {
    asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(N),
                 "r"(src_bytes));
  } else if constexpr (PREFETCH == 128) {
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(N),
                 "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(N), "r"(src_bytes));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
}

// Issue the copies of one chunk into a stage S (Stage: a warp's, every lane a share; GroupStage:
// a block's, every thread a share): per side and key, the run of S::kPieces 16-byte pieces that
// starts at head `head`'s row (kAlignDown: at the 16-byte boundary below it, for per-token-head
// rows, which start at any 4-byte offset). Keys outside [lo, hi) are zero-filled.
template <class S, int kCopiers, bool kAlignDown>
__device__ __forceinline__ void copy_runs(const DecodeParams& p, const int32_t* bt_row, int head, int start, int lo,
                                          int hi, int copier, uint32_t stage) {
  const bool in_page = chunk_in_page(p, start, lo, hi);
  const uint8_t* chunk_page = nullptr;
  if (in_page) chunk_page = p.cache + static_cast<int64_t>(__ldg(bt_row + (start >> p.page_shift))) * p.stride_cb;
  const int first = start & (p.page - 1);
  constexpr int kCopies = 2 * kChunk * S::kPieces;
#pragma unroll
  for (int i = copier; i < kCopies; i += kCopiers) {
    const int side = i / (kChunk * S::kPieces), k = (i / S::kPieces) % kChunk, piece = i % S::kPieces;
    const uint8_t* page = chunk_page;
    int slot = first + k;
    if (!in_page) {
      const int pos = start + k;
      page = nullptr;
      if (pos >= lo && pos < hi) {
        page = p.cache + static_cast<int64_t>(__ldg(bt_row + pos / p.page)) * p.stride_cb;
        slot = pos % p.page;
      }
    }
    const uint8_t* src = p.cache;
    if (page != nullptr) {
      src = page + side * p.stride_ckv + slot * p.stride_cs + head * p.stride_ch;
      if constexpr (kAlignDown) {
        src = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src) & ~uintptr_t{15});
      }
      src += piece * 16;
    }
    cp_async_16<S::kPrefetch>(stage + side * S::kV + S::place(k, piece * 16), src, page != nullptr);
  }
}

// One chunk of KV head kvh into a warp's stage.
template <DecodeFmt F, int D>
__device__ __forceinline__ void copy_chunk(const DecodeParams& p, const int32_t* bt_row, int kvh, int start, int lo,
                                           int hi, int lane, uint32_t stage) {
  copy_runs<Stage<F, D>, 32, Layout<F, D>::kRowScales>(p, bt_row, kvh, start, lo, hi, lane, stage);
}

// One chunk of heads head0 .. head0 + HG - 1 (one 16-byte aligned run per slot) into the block's stage.
template <int D, int HG>
__device__ __forceinline__ void copy_group_chunk(const DecodeParams& p, const int32_t* bt_row, int head0, int start,
                                                 int lo, int hi, uint32_t stage) {
  copy_runs<GroupStage<D, HG>, kThreads, false>(p, bt_row, head0, start, lo, hi, threadIdx.x, stage);
}

// This lane's share of every NVFP4 chunk's copies, apart from the chunk's page and first slot
// (computed once per query tile): its first 16-byte piece of codes (key k0 = lane / kPieces,
// piece lane % kPieces; further pieces are 32 / kPieces keys and a side apart) and its scale row
// (lanes 0-15: K row lane, 16-31: V row lane - 16), as offsets from a page at slot 0 and a stage.
struct Nvfp4Copy {
  uint32_t data_src, data_dst, scale_src, scale_dst;
  // Reads (read_nvfp4_chunk): V row 2t + 1's place relative to row 2t's, V row 2t's scale of the
  // lane's first block and row 2t + 1's relative to it (rows + 8 are constants further).
  uint32_t v_odd, v_scale, v_scale_next;
};

template <int D>
__device__ __forceinline__ Nvfp4Copy nvfp4_copy(const DecodeParams& p, int kvh, int lane) {
  using S = Nvfp4Stage<D>;
  const uint32_t H = p.num_kv_heads;
  const int k0 = lane / S::kPieces, piece = lane % S::kPieces;
  const int side = lane / kChunk, k = lane % kChunk;
  Nvfp4Copy c;
  c.data_src = (k0 * H + kvh) * S::kRowBytes + piece * 16;
  c.data_dst = S::place(k0, piece * 16);
  c.scale_src = side * p.stride_ckv + p.page * H * S::kRowBytes + (k * H + kvh) * S::kBlocks;
  c.scale_dst = S::kScales + side * S::kScaleSide + k * S::kBlocks;
  const int t = lane % 4, g = lane / 4;
  const int v_byte = run_byte<Layout<DecodeFmt::kNvfp4, D>::kVWords, 8>(g, 0, 0);
  c.v_odd = S::place(2 * t + 1, v_byte) - S::place(2 * t, v_byte);
  const int block = v_byte / 8;
  c.v_scale = p.v_scales_swizzled ? S::scale_at(2 * t, block, true) : S::scale_at(2 * t, block, false);
  c.v_scale_next = p.v_scales_swizzled ? 1 : S::kBlocks;
  return c;
}

// One NVFP4 chunk of KV head kvh into a warp's stage: 2 x 16 rows of codes in 16-byte pieces spread
// over the lanes, then one scale row per lane. Keys outside [lo, hi) are zero-filled, except that
// an interleaved V scale row is copied while any key of its 4-token group is in range (it holds
// that key's scales too; read_nvfp4_chunk zeroes the others').
template <int D>
__device__ __forceinline__ void copy_nvfp4_chunk(const DecodeParams& p, const int32_t* bt_row, int kvh, int start,
                                                 int lo, int hi, int lane, const Nvfp4Copy& plan, uint32_t stage) {
  using S = Nvfp4Stage<D>;
  constexpr int kStep = 32 / S::kPieces;      // keys between a lane's pieces on one side
  constexpr int kPerSide = S::kPieces / 2;    // its pieces per side
  const int H = p.num_kv_heads;
  const int first = start & (p.page - 1);
  if (chunk_in_page(p, start, lo, hi)) {
    const uint8_t* page = p.cache + static_cast<int64_t>(__ldg(bt_row + (start >> p.page_shift))) * p.stride_cb;
    const uint8_t* data = page + (plan.data_src + static_cast<uint32_t>(first * H * S::kRowBytes));
    const uint32_t key_step = kStep * H * S::kRowBytes;
#pragma unroll
    for (int side = 0; side < 2; ++side) {
#pragma unroll
      for (int m = 0; m < kPerSide; ++m) {
        // Keys 8 apart share a swizzle: one place plus a constant, else the place of the key.
        const uint32_t dst = kStep % 8 == 0 ? plan.data_dst + m * kStep * S::kRowBytes
                                            : S::place(lane / S::kPieces + m * kStep, (lane % S::kPieces) * 16);
        cp_async_16<KVFUSE_DECODE_NVFP4_PREFETCH>(stage + side * S::kV + dst,
                                                  data + (side * p.stride_ckv + m * key_step), true);
      }
    }
    cp_async_small<S::kBlocks, KVFUSE_DECODE_NVFP4_PREFETCH>(stage + plan.scale_dst,
                               page + (plan.scale_src + static_cast<uint32_t>(first * H * S::kBlocks)), true);
    return;
  }
  auto page_of = [&](int k, bool valid, int& slot) -> const uint8_t* {
    const int pos = start + k;
    slot = 0;
    if (!valid) return nullptr;
    slot = pos % p.page;
    return p.cache + static_cast<int64_t>(__ldg(bt_row + pos / p.page)) * p.stride_cb;
  };
  constexpr int kCopies = 2 * kChunk * S::kPieces;
#pragma unroll
  for (int i = lane; i < kCopies; i += 32) {
    const int side = i / (kChunk * S::kPieces), k = (i / S::kPieces) % kChunk, piece = i % S::kPieces;
    int slot;
    const uint8_t* page = page_of(k, start + k >= lo && start + k < hi, slot);
    const uint8_t* src = p.cache;
    if (page != nullptr) src = page + side * p.stride_ckv + (slot * H + kvh) * S::kRowBytes + piece * 16;
    cp_async_16<KVFUSE_DECODE_NVFP4_PREFETCH>(stage + side * S::kV + S::place(k, piece * 16), src, page != nullptr);
  }
  {
    const int side = lane / kChunk, k = lane % kChunk;
    // A row of an interleaved group holds scales of all its 4 slots (one page: pages are 4k slots).
    const int group_lo = side == 1 && p.v_scales_swizzled ? start + (k & ~3) : start + k;
    const int group_hi = side == 1 && p.v_scales_swizzled ? group_lo + 4 : group_lo + 1;
    int slot;
    const uint8_t* page = page_of(k, group_lo < hi && group_hi > lo, slot);
    const uint8_t* src = p.cache;
    if (page != nullptr) {
      src = page + side * p.stride_ckv + p.page * H * S::kRowBytes + (slot * H + kvh) * S::kBlocks;
    }
    cp_async_small<S::kBlocks, KVFUSE_DECODE_NVFP4_PREFETCH>(stage + S::kScales + side * S::kScaleSide + k * S::kBlocks,
                                                             src, page != nullptr);
  }
}

template <int W>
__device__ __forceinline__ void shared_words(const uint8_t* at, uint32_t (&w)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W / 4; ++i) {
      const uint4 v = *reinterpret_cast<const uint4*>(at + 16 * i);
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (W == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(at);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(at);
  }
}

// This lane's operands of a chunk from its stage (the words load_chunk reads from the page).
template <DecodeFmt F, int D>
__device__ __forceinline__ void read_chunk(const uint8_t* stage, int g, int t, ChunkBytes<F, D>& c) {
  using L = Layout<F, D>;
  using S = Stage<F, D>;
  static_assert(!L::kRowScales, "per-token-head rows: read_row_chunk");
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = g + 8 * r;
#pragma unroll
    for (int s = 0; s < (L::kKWords + 3) / 4; ++s) {
      uint32_t(&seg)[L::kKWords < 4 ? L::kKWords : 4] =
          *reinterpret_cast<uint32_t(*)[L::kKWords < 4 ? L::kKWords : 4]>(&c.k[r][4 * s]);
      shared_words(stage + S::place(key, run_byte<L::kKWords, 4>(t, 4 * s, 0)), seg);
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int key = chunk_key(2 + r, g, t);
#pragma unroll
    for (int s = 0; s < (L::kVWords + 3) / 4; ++s) {
      uint32_t(&seg)[L::kVWords < 4 ? L::kVWords : 4] =
          *reinterpret_cast<uint32_t(*)[L::kVWords < 4 ? L::kVWords : 4]>(&c.v[r][4 * s]);
      shared_words(stage + S::kV + S::place(key, run_byte<L::kVWords, 8>(g, 4 * s, 0)), seg);
    }
  }
}

// This lane's operands of an NVFP4 chunk from its stage (what load_chunk reads from the page).
// Rows g + 8 (K) and 2t + 8, 2t + 9 (V) share the swizzle of rows g, 2t, 2t + 1: a constant further.
// A chunk not wholly in [lo, hi) zeroes the V scales of its keys outside: their codes are zeros,
// but an interleaved scale row may hold any byte for them, and 0 x NaN would reach the sums.
template <int D>
__device__ __forceinline__ void read_nvfp4_chunk(const uint8_t* stage, const Nvfp4Copy& plan, int start, int lo,
                                                 int hi, int g, int t, ChunkBytes<DecodeFmt::kNvfp4, D>& c) {
  using L = Layout<DecodeFmt::kNvfp4, D>;
  using S = Nvfp4Stage<D>;
  constexpr int kKSeg = L::kKWords < 4 ? L::kKWords : 4, kVSeg = L::kVWords < 4 ? L::kVWords : 4;
#pragma unroll
  for (int s = 0; s < (L::kKWords + 3) / 4; ++s) {
    const uint8_t* row_g = stage + S::place(g, run_byte<L::kKWords, 4>(t, 4 * s, 0));
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      shared_words(row_g + r * 8 * S::kRowBytes, *reinterpret_cast<uint32_t(*)[kKSeg]>(&c.k[r][4 * s]));
    }
  }
  const uint8_t* k_scales = stage + S::kScales + g * S::kBlocks;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    c.k_scales[r] = k_run_scales<D, false>(k_scales + r * 8 * S::kBlocks + run_byte<L::kKWords, 4>(t, 0, 0) / 8);
  }
#pragma unroll
  for (int s = 0; s < (L::kVWords + 3) / 4; ++s) {
    const uint8_t* row_2t = stage + S::kV + S::place(2 * t, run_byte<L::kVWords, 8>(g, 4 * s, 0));
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint8_t* row = row_2t + (r & 1) * plan.v_odd + (r >> 1) * 8 * S::kRowBytes;
      shared_words(row, *reinterpret_cast<uint32_t(*)[kVSeg]>(&c.v[r][4 * s]));
    }
  }
  // A lane's V run is one block, or two at D = 256, whose scales lie 1 byte apart (linear) or 4
  // (interleaved: scale_at of blocks 2g, 2g + 1).
  const uint8_t* v_scales = stage + S::kScales + S::kScaleSide + plan.v_scale;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint8_t* at = v_scales + (r & 1) * plan.v_scale_next + (r >> 1) * 8 * S::kBlocks;
    c.v_scales[r] = at[0];
    if constexpr (L::kVScales > 1) c.v_scales[r] |= static_cast<uint32_t>(at[plan.v_scale_next == 1 ? 4 : 1]) << 8;
  }
  if (!(start >= lo && start + kChunk <= hi)) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int pos = start + chunk_key(2 + r, g, t);
      if (pos < lo || pos >= hi) c.v_scales[r] = 0;
    }
  }
}

// read_chunk for per-token-head rows: each staged row starts at its offset mod 16 in the page,
// read 32 bits at a time. Pages, their sides and page * stride_cs are multiples of 16 bytes (the
// host checks), so that offset is (pos * stride_cs + kvh * stride_ch) mod 16 for key position pos.
// HG > 1: the rows are warp `member`'s of the block's staged runs instead.
template <DecodeFmt F, int D, int HG>
__device__ __forceinline__ void read_row_chunk(const DecodeParams& p, const uint8_t* stage, int kvh, int member,
                                               int start, int g, int t, ChunkBytes<F, D>& c) {
  using L = Layout<F, D>;
  static_assert(L::kRowScales, "read_chunk");
  const int head_at = kvh * p.stride_ch;
  auto row_at = [&](int side, int key) {
    if constexpr (HG > 1) {
      using S = GroupStage<D, HG>;
      return stage + side * S::kV + key * S::kPitch + member * S::kRow;
    } else {
      using S = Stage<F, D>;
      return stage + side * S::kV + key * S::kPitch + (((start + key) * p.stride_cs + head_at) & 15);
    }
  };
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint8_t* row = row_at(0, g + 8 * r);
#pragma unroll
    for (int w = 0; w < L::kKWords; ++w) {
      c.k[r][w] = *reinterpret_cast<const uint32_t*>(row + run_byte<L::kKWords, 4>(t, L::k_word(w, t), 0));
    }
    c.k_row_scales[r] = *reinterpret_cast<const float*>(row + D);
    c.v_row_scales[r] = *reinterpret_cast<const float*>(row_at(1, g + 8 * r) + D);
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint8_t* row = row_at(1, chunk_key(2 + r, g, t));
#pragma unroll
    for (int w = 0; w < L::kVWords; ++w) {
      c.v[r][w] = *reinterpret_cast<const uint32_t*>(row + run_byte<L::kVWords, 8>(g, L::v_word(w, g), 0));
    }
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  // Results below 2^-126 flush to zero: a probability that small does not move an fp32 sum.
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ----------------------------------------------------------------------------- the kernel

// Per-row running state of one warp: rows 8 rt + 2t, 8 rt + 2t + 1 of each row tile rt (every
// lane with the same t holds the same rows: the S^T accumulator columns and the O^T ones agree).
template <int D, int ROWS>
struct RowState {
  static constexpr int kRowTiles = ROWS / 8;
  float m[kRowTiles][2];           // running max (replicated over g)
  float l[kRowTiles][2];           // this lane's partial sums (its keys g, g + 8 of each chunk)
  float acc[D / 16][kRowTiles][4]; // O^T tiles: dims x rows (2t, 2t+1)
  float vref;                      // per-token-head V: the largest value scale met so far (0: none)
  float vmul;                      // 2^8 / vref (0 while vref is 0)
};

__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// The V^T operands of an NVFP4 chunk, [dim tile][A register]. Byte j of a key's `even` / `odd`
// e4m3 word is the dim g / g + 8 of dim tile 4 w + j. Pairing two keys' words byte by byte (0x5140:
// bytes 0, 1; 0x7362: bytes 2, 3) makes each convert yield one operand register of two tiles:
// (key, key + 1) at one dim, then scaled by (s_key, s_key+1).
template <int D>
__device__ __forceinline__ void nvfp4_v_operands(const ChunkBytes<DecodeFmt::kNvfp4, D>& c, uint32_t (&vx)[D / 16][4]) {
  using L = Layout<DecodeFmt::kNvfp4, D>;
#pragma unroll
  for (int w = 0; w < L::kVWords; ++w) {
    const uint32_t scale_byte = L::kVScales > 1 ? w / 2 : 0;
    const uint32_t scale_sel = scale_byte | ((4 + scale_byte) << 4);
    const uint32_t s01 = e4m3x2_to_f16x2(__byte_perm(c.v_scales[0], c.v_scales[1], scale_sel));
    const uint32_t s23 = e4m3x2_to_f16x2(__byte_perm(c.v_scales[2], c.v_scales[3], scale_sel));
    uint32_t even[4], odd[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) e2m1x8_to_e4m3(c.v[r][w], even[r], odd[r]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t sel = h == 0 ? 0x5140 : 0x7362;
      uint32_t a0[2], a1[2], a2[2], a3[2];  // [tile 4 w + 2 h + i]
      fp8x4_to_f16x2<DecodeFmt::kE4m3>(__byte_perm(even[0], even[1], sel), a0[0], a0[1]);
      fp8x4_to_f16x2<DecodeFmt::kE4m3>(__byte_perm(odd[0], odd[1], sel), a1[0], a1[1]);
      fp8x4_to_f16x2<DecodeFmt::kE4m3>(__byte_perm(even[2], even[3], sel), a2[0], a2[1]);
      fp8x4_to_f16x2<DecodeFmt::kE4m3>(__byte_perm(odd[2], odd[3], sel), a3[0], a3[1]);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        uint32_t(&x)[4] = vx[4 * w + 2 * h + i];
        x[0] = hmul2(a0[i], s01), x[1] = hmul2(a1[i], s01);
        x[2] = hmul2(a2[i], s23), x[3] = hmul2(a3[i], s23);
      }
    }
  }
}

// One 16-key chunk: S^T = K Q^T (K rows g, g + 8 as the A operand, so every MMA row is a real key
// and the query tile is the 8-wide B operand), online softmax, O^T += V^T P^T (P^T's fragment is
// S^T's accumulator transposed in registers by movmatrix).
template <DecodeFmt F, int D, int ROWS>
__device__ __forceinline__ void attend_chunk(const DecodeParams& p, const ChunkBytes<F, D>& c,
                                             const uint32_t (&qb)[D / 16][ROWS / 8][2], int start, int key_lo,
                                             int key_hi, bool masked, const int (&qpos)[ROWS / 8][2],
                                             const bool (&row_ok)[ROWS / 8][2], float qk_scale, int g,
                                             RowState<D, ROWS>& st) {
  using L = Layout<F, D>;
  constexpr int RT = ROWS / 8;
  // NVFP4: two accumulators over alternate k-steps halve the chain of dependent MMAs.
  float s[RT][4], s2[RT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[rt][e] = s2[rt][e] = 0.f;
  if constexpr (L::kNvfp4) {
#pragma unroll
    for (int w = 0; w < L::kKWords; ++w) {
      uint32_t k0[4], k1[4];
      e2m1x8_to_f16x2(c.k[0][w], e4m3_pair(c.k_scales[0], w / 2), k0);
      e2m1x8_to_f16x2(c.k[1][w], e4m3_pair(c.k_scales[1], w / 2), k1);
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        mma_16816(s[rt], k0[0], k1[0], k0[1], k1[1], qb[2 * w][rt][0], qb[2 * w][rt][1]);
        mma_16816(s2[rt], k0[2], k1[2], k0[3], k1[3], qb[2 * w + 1][rt][0], qb[2 * w + 1][rt][1]);
      }
    }
  } else {
#pragma unroll
    for (int w = 0; w < L::kKWords; ++w) {
      uint32_t a0, a2, a1, a3;
      fp8x4_to_f16x2<F>(c.k[0][w], a0, a2);
      fp8x4_to_f16x2<F>(c.k[1][w], a1, a3);
#pragma unroll
      // One chain here: a second accumulator costs the FP8 path spills at its register cap.
      for (int rt = 0; rt < RT; ++rt) mma_16816(s[rt], a0, a1, a2, a3, qb[w][rt][0], qb[w][rt][1]);
    }
  }
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[rt][e] += s2[rt][e];
  // s[rt][e]: key g + 8 (e / 2), row 8 rt + 2t + (e % 2).
  float key_scale[2] = {qk_scale, qk_scale};
  if constexpr (L::kRowScales) {
    key_scale[0] *= c.k_row_scales[0];
    key_scale[1] *= c.k_row_scales[1];
  }
  if (p.cap > 0.f) {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[rt][e] = p.cap * tanhf(s[rt][e] * key_scale[e / 2] * p.inv_cap);
  } else {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[rt][e] *= key_scale[e / 2];
  }
  // Per-token-head V: a larger value scale than any before rescales the accumulator to it.
  float beta = 1.f;
  float p_mul[2] = {1.f, 1.f};
  if constexpr (L::kRowScales) {
    float vmax = fmaxf(c.v_row_scales[0], c.v_row_scales[1]);
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 4));
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 8));
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 16));
    if (vmax > st.vref) {
      beta = st.vref / vmax;
      st.vref = vmax;
      st.vmul = 256.f / vmax;
    }
    p_mul[0] = c.v_row_scales[0] * st.vmul;
    p_mul[1] = c.v_row_scales[1] * st.vmul;
  }
  if (masked) {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = start + g + 8 * (e / 2), j = e % 2;
        const bool ok = row_ok[rt][j] & (key >= key_lo) & (key < key_hi) & (key <= qpos[rt][j]) &
                        ((p.window <= 0) | (qpos[rt][j] - key < p.window));
        s[rt][e] = ok ? s[rt][e] : -INFINITY;
      }
    }
  }
  // NVFP4 V operands, decoded here (KVFUSE_DECODE_NVFP4_V_EARLY) so that the decode fills the
  // softmax's shuffle and exp2 latencies, or after it.
  uint32_t vx[L::kNvfp4 ? D / 16 : 1][4];
  if constexpr (L::kNvfp4 && KVFUSE_DECODE_NVFP4_V_PAIRS && KVFUSE_DECODE_NVFP4_V_EARLY) nvfp4_v_operands(c, vx);
  uint32_t pb[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
    float alpha[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float mx = fmaxf(s[rt][j], s[rt][j + 2]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(st.m[rt][j], mx);
      const float base = m_new == -INFINITY ? 0.f : m_new;
      alpha[j] = fast_exp2(st.m[rt][j] - base);
      st.m[rt][j] = m_new;
      s[rt][j] = fast_exp2(s[rt][j] - base);
      s[rt][j + 2] = fast_exp2(s[rt][j + 2] - base);
      st.l[rt][j] = st.l[rt][j] * alpha[j] + s[rt][j] + s[rt][j + 2];
    }
    // Once the running maxima settle, most chunks leave them as they are: skip the rescale then.
    if (__any_sync(0xffffffffu, (alpha[0] != 1.f) | (alpha[1] != 1.f) | (beta != 1.f))) {
      alpha[0] *= beta;
      alpha[1] *= beta;
#pragma unroll
      for (int i = 0; i < D / 16; ++i) {
        st.acc[i][rt][0] *= alpha[0];
        st.acc[i][rt][1] *= alpha[1];
        st.acc[i][rt][2] *= alpha[0];
        st.acc[i][rt][3] *= alpha[1];
      }
    }
    if constexpr (L::kRowScales) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[rt][e] *= p_mul[e / 2];
    }
    // [key][row] 8x8 tiles (keys 0-7, 8-15) -> [row][key]: rows g, keys 2t, 2t+1 (+ 8).
    pb[rt][0] = transpose_8x8(pack_f16x2(s[rt][0], s[rt][1]));
    pb[rt][1] = transpose_8x8(pack_f16x2(s[rt][2], s[rt][3]));
  }
  // V^T fragments: keys (2t, 2t+1) and (2t+8, 2t+9) paired per dim.
  constexpr int kDimTilesPerWord = L::kNvfp4 ? 4 : 2;
#if KVFUSE_DECODE_NVFP4_V_PAIRS
  if constexpr (L::kNvfp4) {
    if constexpr (!KVFUSE_DECODE_NVFP4_V_EARLY) nvfp4_v_operands(c, vx);
#pragma unroll
    for (int tile = 0; tile < D / 16; ++tile) {
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        mma_16816(st.acc[tile][rt], vx[tile][0], vx[tile][1], vx[tile][2], vx[tile][3], pb[rt][0], pb[rt][1]);
      }
    }
    return;
  }
#endif
#pragma unroll
  for (int w = 0; w < L::kVWords; ++w) {
    uint32_t va[4][kDimTilesPerWord];  // NVFP4: [key r][dim tile] (dims g, g + 8 as halves)
    if constexpr (L::kNvfp4) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        e2m1x8_to_f16x2(c.v[r][w], e4m3_pair(c.v_scales[r], L::kVScales > 1 ? w / 2 : 0), va[r]);
      }
    }
#pragma unroll
    for (int i = 0; i < kDimTilesPerWord; ++i) {
      const int tile = kDimTilesPerWord * w + i;
      uint32_t a[4];
      if constexpr (L::kNvfp4) {
        a[0] = __byte_perm(va[0][i], va[1][i], 0x5410);
        a[1] = __byte_perm(va[0][i], va[1][i], 0x7632);
        a[2] = __byte_perm(va[2][i], va[3][i], 0x5410);
        a[3] = __byte_perm(va[2][i], va[3][i], 0x7632);
      } else {
        // Bytes 2i, 2i+1 of the word = dims g, g + 8 of the tile: pair the two keys' bytes, convert.
        const uint32_t sel = i == 0 ? 0x5140 : 0x7362;
        fp8x4_to_f16x2<F>(__byte_perm(c.v[0][w], c.v[1][w], sel), a[0], a[1]);
        fp8x4_to_f16x2<F>(__byte_perm(c.v[2][w], c.v[3][w], sel), a[2], a[3]);
      }
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) mma_16816(st.acc[tile][rt], a[0], a[1], a[2], a[3], pb[rt][0], pb[rt][1]);
    }
  }
}

// MIN_BLOCKS: the resident blocks per SM the register budget is set for (D <= 128).
// WARPS: warps per block (kWarps but for NVFP4 head groups, KVFUSE_DECODE_NVFP4_PAIR_WARPS).
template <DecodeFmt F, int D, int ROWS, int HG, int MIN_BLOCKS = KVFUSE_DECODE_MIN_BLOCKS, int WARPS = kWarps>
__global__ void __launch_bounds__(WARPS * 32, D <= 128 ? MIN_BLOCKS : 1)
    decode_attention_kernel(const __grid_constant__ DecodeParams p) {
  using L = Layout<F, D>;
  using State = RowState<D, ROWS>;
  static_assert(HG == 1 || (HG == kWarps && L::kRowScales) || ((HG == 2 || HG == 4) && L::kNvfp4),
                "head groups: per-token-head rows (a warp per head) or NVFP4 (WARPS / HG warps per head)");
  static_assert(WARPS == kWarps || (L::kNvfp4 && HG > 1), "other warp counts: NVFP4 head groups");
  constexpr int kBlockThreads = WARPS * 32;
  // Warps per head: they take interleaved chunks of it and merge at the end.
  constexpr int kHeadWarps = WARPS / HG;
  start_after_prior_grids<KVFUSE_DECODE_PDL>();
  extern __shared__ float smem[];
  float* sm_m = smem;                          // [WARPS][ROWS]
  float* sm_l = sm_m + WARPS * ROWS;           // [WARPS][ROWS]
  float* sm_o = sm_l + WARPS * ROWS;           // [WARPS][ROWS][D]

  // p.heads_fastest: blockIdx.x is the head group, so that the blocks of one sequence's KV heads,
  // whose rows of a slot are adjacent in the page, are launched (and read their rows) together.
  const int b = p.heads_fastest ? blockIdx.y : blockIdx.x, head_group = p.heads_fastest ? blockIdx.x : blockIdx.y;
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int kvh = head_group * HG + warp / kHeadWarps;  // HG > 1: every warp's head exists (host)
  const int q_start = __ldg(p.query_start_loc + b);
  const int q_len = __ldg(p.query_start_loc + b + 1) - q_start;
  const int seq_len = __ldg(p.seq_lens + b);
  const int G = p.group;
  const int tile_tokens = ROWS / G;
  const int32_t* bt_row = p.block_table + static_cast<int64_t>(b) * p.stride_bt;
  // Per-token-head rows carry their own scales (the static ones are unused).
  float k_scale = L::kRowScales ? 1.f : __ldg(p.k_scale + kvh * p.k_scale_stride);
  if constexpr (L::kNvfp4) k_scale *= 64.f;  // decoded values are e2m1 * block scale * 2^-6
  // The merge below writes the rows of every head of the block's group, not only this warp's.
  auto v_scale_of = [&](int head) {
    return L::kRowScales ? 1.f : __ldg(p.v_scale + head * p.v_scale_stride) * (L::kNvfp4 ? 64.f : 1.f);
  };

  for (int q0 = 0; q0 < q_len; q0 += tile_tokens) {
    const int n_tok = min(tile_tokens, q_len - q0);
    const int first_pos = seq_len - q_len + q0, last_pos = first_pos + n_tok - 1;
    // Keys of the tile, then of this split, in whole chunks.
    const int hi = min(seq_len, last_pos + 1);
    const int lo = p.window > 0 ? max(first_pos - p.window + 1, 0) : 0;
    const int c_first = lo / kChunk, c_end_all = hi > lo ? (hi + kChunk - 1) / kChunk : c_first;
    const int per_split = (c_end_all - c_first + p.num_splits - 1) / p.num_splits;
    const int c_begin = min(c_first + split * per_split, c_end_all);
    const int c_end = min(c_begin + per_split, c_end_all);
    // Keys every row may see: no per-row mask in chunks inside [full_lo, full_hi).
    const int full_hi = min(hi, first_pos + 1);
    const int full_lo = p.window > 0 ? max(lo, last_pos - p.window + 1) : lo;

    constexpr int RT = State::kRowTiles;
    // Rows of this lane's scores and accumulators: 8 rt + 2t + j; rows of its Q^T operand: 8 rt + g.
    int qpos[RT][2];
    bool row_ok[RT][2];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = 8 * rt + 2 * t + j;
        row_ok[rt][j] = r / G < n_tok;
        qpos[rt][j] = first_pos + r / G;
      }
    }
    // Per-warp rings of cp.async stages (every path but the block-wide per-token-head stages).
    constexpr int kStages = L::kStages;
    constexpr bool kWarpRing = !(HG > 1 && L::kRowScales) && kStages >= 2;
    using RingStage = std::conditional_t<L::kNvfp4, Nvfp4Stage<D>, Stage<F, D>>;
    uint8_t* const warp_ring = reinterpret_cast<uint8_t*>(smem) + (kWarpRing ? warp * kStages * RingStage::kBytes : 0);
    const uint32_t warp_ring_at = static_cast<uint32_t>(__cvta_generic_to_shared(warp_ring));
    Nvfp4Copy plan{};
    if constexpr (L::kNvfp4 && kWarpRing) plan = nvfp4_copy<D>(p, kvh, lane);
    auto copy_any_chunk = [&](int chunk, uint32_t into) {
      if constexpr (L::kNvfp4) {
        copy_nvfp4_chunk<D>(p, bt_row, kvh, chunk * kChunk, lo, hi, lane, plan, into);
      } else {
        copy_chunk<F, D>(p, bt_row, kvh, chunk * kChunk, lo, hi, lane, into);
      }
    };
    // The ring's first kStages - 1 chunks, one commit group each (empty past the end, so that
    // wait_group counts stay fixed), requested before the query tile is loaded: the two latencies
    // overlap (level with requesting them after it, within noise: BENCHMARKS.md, nineteenth session).
    if constexpr (kWarpRing) {
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        const int chunk = c_begin + warp % kHeadWarps + s * kHeadWarps;
        if (chunk < c_end) copy_any_chunk(chunk, warp_ring_at + s * RingStage::kBytes);
        cp_async_commit();
      }
    }

    float amax = 0.f;
    // Per k-step c, the 4 consecutive head dims that the K run's bytes for that step hold.
    float qf[RT][D / 4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
      const int r = 8 * rt + g, tok = r / G;
      const bool ok = tok < n_tok;
      const int64_t row = q_start + q0 + tok;
      const uint8_t* q_row =
          static_cast<const uint8_t*>(p.query) + (row * p.stride_qt + (kvh * G + r % G) * p.stride_qh) * 2;
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        const int dim = L::kNvfp4 ? 2 * run_byte<L::kKWords, 4>(t, c / 2, (c % 2) * 2)
                                  : run_byte<L::kKWords, 4>(t, L::k_word(c, t), 0);
        uint2 v = make_uint2(0, 0);
        if (ok) v = __ldg(reinterpret_cast<const uint2*>(q_row + 2 * dim));
        const uint32_t words[2] = {v.x, v.y};
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          float lo_f, hi_f;
          if (p.query_fp16) {
            const __half2 h = *reinterpret_cast<const __half2*>(&words[k]);
            lo_f = __low2float(h), hi_f = __high2float(h);
          } else {
            lo_f = __uint_as_float(words[k] << 16), hi_f = __uint_as_float(words[k] & 0xFFFF0000u);
          }
          qf[rt][4 * c + 2 * k] = lo_f, qf[rt][4 * c + 2 * k + 1] = hi_f;
          amax = fmaxf(amax, fmaxf(fabsf(lo_f), fabsf(hi_f)));
        }
      }
    }
    // Every warp of the head loads the same tile, so a warp-wide max is the tile's.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float q_mul = amax > 32768.f ? exp2f(-ceilf(log2f(amax / 32768.f))) : 1.f;
    const float qk_scale = p.qk_scale * k_scale / q_mul;
    uint32_t qb[D / 16][RT][2];
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        qb[c][rt][0] = pack_f16x2(qf[rt][4 * c] * q_mul, qf[rt][4 * c + 1] * q_mul);
        qb[c][rt][1] = pack_f16x2(qf[rt][4 * c + 2] * q_mul, qf[rt][4 * c + 3] * q_mul);
      }
    }

    State st;
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
      st.m[rt][0] = st.m[rt][1] = -INFINITY;
      st.l[rt][0] = st.l[rt][1] = 0.f;
#pragma unroll
      for (int i = 0; i < D / 16; ++i) st.acc[i][rt][0] = st.acc[i][rt][1] = st.acc[i][rt][2] = st.acc[i][rt][3] = 0.f;
    }
    st.vref = st.vmul = 0.f;

    auto attend = [&](const ChunkBytes<F, D>& bytes, int chunk) {
      const int start = chunk * kChunk;
      const bool masked = start < full_lo || start + kChunk > full_hi;
      attend_chunk<F, D, ROWS>(p, bytes, qb, start, lo, hi, masked, qpos, row_ok, qk_scale, g, st);
    };
    int c = c_begin + warp % kHeadWarps;
    if constexpr (HG > 1 && L::kRowScales) {
      // All warps take every chunk, each its own head's rows of the block's staged runs.
      using S = GroupStage<D, HG>;
      uint8_t* ring = reinterpret_cast<uint8_t*>(smem);
      const uint32_t ring_at = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
      const int head0 = head_group * HG;
      c = c_begin;
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (c + s < c_end) copy_group_chunk<D, HG>(p, bt_row, head0, (c + s) * kChunk, lo, hi, ring_at + s * S::kBytes);
        cp_async_commit();
      }
      // One barrier per chunk: once chunk c's bytes have landed and every warp is past it, every
      // warp has also read chunk c - 1's stage, which the copy issued after the barrier refills.
      for (int i = 0; c < c_end; ++i, ++c) {
        cp_async_wait<kStages - 2>();
        __syncthreads();
        const int ahead = c + kStages - 1;
        if (ahead < c_end) {
          copy_group_chunk<D, HG>(p, bt_row, head0, ahead * kChunk, lo, hi,
                                  ring_at + ((i + kStages - 1) % kStages) * S::kBytes);
        }
        cp_async_commit();
        ChunkBytes<F, D> bytes;
        read_row_chunk<F, D, HG>(p, ring + (i % kStages) * S::kBytes, kvh, warp, c * kChunk, g, t, bytes);
        attend(bytes, c);
      }
      cp_async_wait<0>();
      __syncthreads();  // the merge below reuses the ring
    } else if constexpr (kWarpRing) {
      using S = RingStage;
      uint8_t* const ring = warp_ring;
      const uint32_t ring_at = warp_ring_at;
      for (int i = 0; c < c_end; ++i, c += kHeadWarps) {
        const int ahead = c + (kStages - 1) * kHeadWarps;
        if (ahead < c_end) {
          copy_any_chunk(ahead, ring_at + ((i + kStages - 1) % kStages) * S::kBytes);
        }
        cp_async_commit();
        cp_async_wait<kStages - 1>();
        __syncwarp();
        ChunkBytes<F, D> bytes;
        if constexpr (L::kNvfp4) {
          read_nvfp4_chunk<D>(ring + (i % kStages) * S::kBytes, plan, c * kChunk, lo, hi, g, t, bytes);
        } else if constexpr (L::kRowScales) {
          read_row_chunk<F, D, 1>(p, ring + (i % kStages) * S::kBytes, kvh, 0, c * kChunk, g, t, bytes);
        } else {
          read_chunk<F, D>(ring + (i % kStages) * S::kBytes, g, t, bytes);
        }
        __syncwarp();  // the next iteration refills this stage; its bytes are in registers now
        attend(bytes, c);
      }
      cp_async_wait<0>();
      __syncthreads();  // the merge below reuses the ring
    } else if (c < c_end) {
      const ChunkOffsets offsets = chunk_offsets<F, D>(p, kvh, g, t);
      auto load = [&](int chunk, ChunkBytes<F, D>& into) {
        const int start = chunk * kChunk;
        if (chunk_in_page(p, start, lo, hi)) {
          load_chunk_in_page<F, D>(p, bt_row, start, offsets, into);
        } else {
          load_chunk<F, D>(p, bt_row, kvh, start, lo, hi, g, t, into);
        }
      };
      // Two buffers in turn: the next chunk's bytes are in flight while this one is computed.
      ChunkBytes<F, D> even, odd;
      load(c, even);
      while (true) {
        const bool more = c + kHeadWarps < c_end;
        if (more) load(c + kHeadWarps, odd);
        attend(even, c);
        c += kHeadWarps;
        if (!more) break;
        const bool more2 = c + kHeadWarps < c_end;
        if (more2) load(c + kHeadWarps, even);
        attend(odd, c);
        c += kHeadWarps;
        if (!more2) break;
      }
    }

    // Per-row sums over the lanes that share t, then the block-wide merge of the warps (and the sink).
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float l = st.l[rt][j];
        l += __shfl_xor_sync(0xffffffffu, l, 4);
        l += __shfl_xor_sync(0xffffffffu, l, 8);
        l += __shfl_xor_sync(0xffffffffu, l, 16);
        if (g == 0) {
          sm_m[warp * ROWS + 8 * rt + 2 * t + j] = st.m[rt][j];
          sm_l[warp * ROWS + 8 * rt + 2 * t + j] = l;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
#pragma unroll
      for (int rt = 0; rt < State::kRowTiles; ++rt) {
        // Accumulator (dims dim, dim + 1: the V run's bytes of tile i) x (rows 8 rt + 2t, + 1).
        const int dim = L::kNvfp4 ? 2 * run_byte<L::kVWords, 8>(g, i / 4, i % 4)
                                  : run_byte<L::kVWords, 8>(g, L::v_word(i / 2, g), 2 * (i % 2));
        float* row0 = sm_o + (warp * ROWS + 8 * rt + 2 * t) * D + dim;
        float* row1 = row0 + D;
        // Per-token-head V: the accumulator counts in units of vref / 2^8.
        const float unit = L::kRowScales ? st.vref * (1.f / 256.f) : 1.f;
        *reinterpret_cast<float2*>(row0) = make_float2(st.acc[i][rt][0] * unit, st.acc[i][rt][2] * unit);
        *reinterpret_cast<float2*>(row1) = make_float2(st.acc[i][rt][1] * unit, st.acc[i][rt][3] * unit);
      }
    }
    __syncthreads();
    const bool split_out = p.num_splits > 1;
    // Head `member` of the group: its kHeadWarps warps each hold a part of each of its rows.
    for (int e = threadIdx.x * 4; e < HG * ROWS * D; e += kBlockThreads * 4) {
      const int member = e / (ROWS * D), r = (e / D) % ROWS, dim = e % D;
      const int tok = r / G;
      if (tok >= n_tok) continue;
      const int head = (HG == 1 ? kvh : head_group * HG + member) * G + r % G;
      const int w_first = member * kHeadWarps, w_end = w_first + kHeadWarps;
      float M = -INFINITY;
      for (int w = w_first; w < w_end; ++w) M = fmaxf(M, sm_m[w * ROWS + r]);
      float sink = -INFINITY;
      if (p.sinks != nullptr && split == 0) sink = __ldg(p.sinks + head) * kLog2e;
      M = fmaxf(M, sink);
      const float base = M == -INFINITY ? 0.f : M;
      float Lsum = sink == -INFINITY ? 0.f : exp2f(sink - base);
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int w = w_first; w < w_end; ++w) {
        const float wgt = exp2f(sm_m[w * ROWS + r] - base);
        Lsum += sm_l[w * ROWS + r] * wgt;
        const float4 x = *reinterpret_cast<const float4*>(sm_o + (w * ROWS + r) * D + dim);
        o.x += x.x * wgt, o.y += x.y * wgt, o.z += x.z * wgt, o.w += x.w * wgt;
      }
      const float inv = Lsum > 0.f ? v_scale_of(head_group * HG + member) / Lsum : 0.f;
      o.x *= inv, o.y *= inv, o.z *= inv, o.w *= inv;
      const int64_t row = q_start + q0 + tok;
      if (split_out) {
        float* dst = p.part_out + ((static_cast<int64_t>(split) * p.num_tokens + row) * (p.num_kv_heads * G) + head) * D + dim;
        *reinterpret_cast<float4*>(dst) = o;
        if (dim == 0) {
          p.part_lse[(static_cast<int64_t>(split) * p.num_tokens + row) * (p.num_kv_heads * G) + head] =
              Lsum > 0.f ? base + log2f(Lsum) : -INFINITY;
        }
      } else {
        uint8_t* dst = static_cast<uint8_t*>(p.out) + ((row * (p.num_kv_heads * G) + head) * D + dim) * 2;
        uint2 packed;
        if (p.query_fp16) {
          const __half2 a = __floats2half2_rn(o.x, o.y), c2 = __floats2half2_rn(o.z, o.w);
          packed.x = *reinterpret_cast<const uint32_t*>(&a), packed.y = *reinterpret_cast<const uint32_t*>(&c2);
        } else {
          const __nv_bfloat162 a = __floats2bfloat162_rn(o.x, o.y), c2 = __floats2bfloat162_rn(o.z, o.w);
          packed.x = *reinterpret_cast<const uint32_t*>(&a), packed.y = *reinterpret_cast<const uint32_t*>(&c2);
        }
        *reinterpret_cast<uint2*>(dst) = packed;
      }
    }
    __syncthreads();  // the next query tile reuses the shared buffers
  }
}

// Merge split partials of one (token, head): o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M).
// Writes every row of out; rows outside query_start_loc (padding) get zeros.
__global__ void decode_attention_reduce_kernel(const __grid_constant__ DecodeParams p, int num_q_heads, int head_size) {
  start_after_prior_grids<KVFUSE_DECODE_PDL>();
  const int64_t row = blockIdx.x;
  const int head = blockIdx.y;
  const bool covered = row >= __ldg(p.query_start_loc) && row < __ldg(p.query_start_loc + p.num_seqs);
  float M = -INFINITY;
  if (covered) {
    for (int s = 0; s < p.num_splits; ++s)
      M = fmaxf(M, p.part_lse[(static_cast<int64_t>(s) * p.num_tokens + row) * num_q_heads + head]);
  }
  const float base = M == -INFINITY ? 0.f : M;
  for (int dim = threadIdx.x; dim < head_size; dim += blockDim.x) {
    float total = 0.f, o = 0.f;
    if (covered) {
      for (int s = 0; s < p.num_splits; ++s) {
        const int64_t at = (static_cast<int64_t>(s) * p.num_tokens + row) * num_q_heads + head;
        const float wgt = exp2f(p.part_lse[at] - base);
        total += wgt;
        o += wgt * p.part_out[at * head_size + dim];
      }
    }
    o = total > 0.f ? o / total : 0.f;
    uint8_t* dst = static_cast<uint8_t*>(p.out) + ((row * num_q_heads + head) * head_size + dim) * 2;
    if (p.query_fp16) {
      *reinterpret_cast<__half*>(dst) = __float2half_rn(o);
    } else {
      *reinterpret_cast<__nv_bfloat16*>(dst) = __float2bfloat16_rn(o);
    }
  }
}

template <DecodeFmt F, int D, int ROWS, int HG, int MIN_BLOCKS, int WARPS>
void launch_build(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  using L = Layout<F, D>;
  size_t smem = sizeof(float) * (2 * WARPS * ROWS + WARPS * ROWS * D);
  if constexpr (HG > 1 && L::kRowScales) {
    smem = std::max(smem, size_t{L::kStages} * GroupStage<D, HG>::kBytes);
  } else if constexpr (L::kNvfp4 && L::kStages >= 2) {
    smem = std::max(smem, size_t{WARPS} * L::kStages * Nvfp4Stage<D>::kBytes);
  } else if constexpr (L::kStages >= 2) {
    smem = std::max(smem, size_t{WARPS} * L::kStages * Stage<F, D>::kBytes);
  }
  auto kernel = decode_attention_kernel<F, D, ROWS, HG, MIN_BLOCKS, WARPS>;
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  launch_maybe_dependent(kernel, grid, dim3(WARPS * 32), smem, stream,
                         KVFUSE_DECODE_PDL && dependent_launch_supported(), p);
}

template <DecodeFmt F, int D, int ROWS, int HG>
void launch_decode(const DecodeParams& p, int num_seqs, cudaStream_t stream) {
  const dim3 grid = p.heads_fastest ? dim3(p.num_kv_heads / HG, num_seqs, p.num_splits)
                                    : dim3(num_seqs, p.num_kv_heads / HG, p.num_splits);
  if constexpr (Layout<F, D>::kNvfp4 && HG > 1 && D <= 128 && KVFUSE_DECODE_NVFP4_GROUP_MIN_BLOCKS > 0) {
    const int64_t blocks = int64_t{grid.x} * grid.y * grid.z;
    const int sms = cached_device_attribute<cudaDevAttrMultiProcessorCount>();
    if (blocks <= int64_t{KVFUSE_DECODE_NVFP4_GROUP_MIN_BLOCKS} * sms) {
      constexpr int kGroupWarps = HG == 2 && ROWS == 8 ? KVFUSE_DECODE_NVFP4_PAIR_WARPS : kWarps;
      return launch_build<F, D, ROWS, HG, KVFUSE_DECODE_NVFP4_GROUP_MIN_BLOCKS, kGroupWarps>(p, grid, stream);
    }
  }
  launch_build<F, D, ROWS, HG, KVFUSE_DECODE_MIN_BLOCKS, kWarps>(p, grid, stream);
}

template <DecodeFmt F, int D, int HG>
void launch_rows(const DecodeParams& p, int num_seqs, cudaStream_t stream) {
  if (p.group <= 8) {
    launch_decode<F, D, 8, HG>(p, num_seqs, stream);
  } else {
    launch_decode<F, D, 16, HG>(p, num_seqs, stream);
  }
}

// Per-token-head rows: kWarps heads per block where their rows of a slot are one aligned run
// (kvfuse.ops.native.decode_heads_per_block restates this rule for the split count).
bool group_heads(const DecodeParams& p, int head_size) {
  return p.num_kv_heads % kWarps == 0 && p.stride_ch == head_size + 4 && p.stride_cs == p.num_kv_heads * p.stride_ch &&
         (kWarps * p.stride_ch) % 16 == 0;
}

template <DecodeFmt F, int D>
void launch_groups(const DecodeParams& p, int num_seqs, cudaStream_t stream) {
  if constexpr (Layout<F, D>::kRowScales) {
    if (group_heads(p, D)) return launch_rows<F, D, kWarps>(p, num_seqs, stream);
  }
  if constexpr (Layout<F, D>::kNvfp4 && KVFUSE_DECODE_NVFP4_HEADS == 4) {
    if (p.num_kv_heads % 4 == 0) return launch_rows<F, D, 4>(p, num_seqs, stream);
  }
  if constexpr (Layout<F, D>::kNvfp4 && KVFUSE_DECODE_NVFP4_HEADS >= 2) {
    if (p.num_kv_heads % 2 == 0) return launch_rows<F, D, 2>(p, num_seqs, stream);
  }
  launch_rows<F, D, 1>(p, num_seqs, stream);
}

template <DecodeFmt F>
void launch_head_size(const DecodeParams& p, int head_size, int num_seqs, cudaStream_t stream) {
  switch (head_size) {
    case 64: return launch_groups<F, 64>(p, num_seqs, stream);
    case 128: return launch_groups<F, 128>(p, num_seqs, stream);
    case 256: return launch_groups<F, 256>(p, num_seqs, stream);
    default: TORCH_CHECK_VALUE(false, "paged_decode_attention: head_size=", head_size, " (allowed: 64, 128, 256)");
  }
}

bool aligned16(const at::Tensor& x) { return reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0; }

// The Python entry (kvfuse.ops.native.paged_attention) validates the call as the op does and
// checks decode_attention_supports(); these checks only guard memory safety.
at::Tensor paged_decode_attention_cuda(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& k_scale,
                                       const at::Tensor& v_scale, const at::Tensor& block_table,
                                       const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                       const std::optional<at::Tensor>& sinks, int64_t kv_quant_mode, double sm_scale,
                                       int64_t sliding_window, double logit_softcap, int64_t num_splits) {
  TORCH_CHECK_VALUE(is_valid_mode(kv_quant_mode), "paged_decode_attention: kv_quant_mode=", kv_quant_mode);
  const auto mode = static_cast<KVQuantMode>(kv_quant_mode);
  TORCH_CHECK_VALUE(mode == KVQuantMode::NVFP4 || mode == KVQuantMode::FP8_PER_TOKEN_HEAD || is_fp8(mode),
                    "paged_decode_attention: kv_quant_mode=", mode_name(mode),
                    " (allowed: FP8_E4M3, FP8_E5M2, FP8_PER_TOKEN_HEAD, NVFP4)");
  TORCH_CHECK_VALUE(query.dim() == 3 && (query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kHalf),
                    "paged_decode_attention: query must be [tokens, heads, head_size] bfloat16 or float16, got ",
                    query.scalar_type(), " with ", query.dim(), " dims");
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.element_size() == 1 && kv_cache.stride(4) == 1,
                    "paged_decode_attention: kv_cache must be a 5-d byte-wide cache with a contiguous last dim");
  const int64_t head_size = query.size(2), num_q_heads = query.size(1), num_tokens = query.size(0);
  const int64_t num_kv_heads = kv_cache.size(3), num_seqs = block_table.size(0);
  TORCH_CHECK_VALUE(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 && num_q_heads / num_kv_heads <= 16,
                    "paged_decode_attention: ", num_q_heads, " query heads over ", num_kv_heads,
                    " KV heads (a group of at most 16 query heads per KV head)");
  TORCH_CHECK_VALUE(query.stride(2) == 1 && query.stride(0) % 8 == 0 && query.stride(1) % 8 == 0 && aligned16(query),
                    "paged_decode_attention: query rows must be 16-byte aligned with a contiguous last dim");
  TORCH_CHECK_VALUE(kv_cache.stride(0) % 16 == 0 && kv_cache.stride(1) % 16 == 0 && aligned16(kv_cache),
                    "paged_decode_attention: kv_cache pages must be 16-byte aligned");
  // In-page offsets are 32-bit: a page (both sides) must span less than 2 GiB.
  TORCH_CHECK_VALUE(kv_cache.stride(1) * 2 < (int64_t{1} << 31) && kv_cache.stride(2) * kv_cache.size(2) < (int64_t{1} << 31),
                    "paged_decode_attention: kv_cache pages of 2 GiB or more");
  if (mode == KVQuantMode::FP8_PER_TOKEN_HEAD) {
    TORCH_CHECK_VALUE(kv_cache.size(4) == head_size + 4 && kv_cache.stride(2) % 4 == 0 && kv_cache.stride(3) % 4 == 0 &&
                          (kv_cache.size(2) * kv_cache.stride(2)) % 16 == 0,
                      "paged_decode_attention: FP8_PER_TOKEN_HEAD rows must be head_size + 4 bytes, 4-byte aligned, "
                      "in page sides of a multiple of 16 bytes");
  } else if (mode != KVQuantMode::NVFP4) {
    TORCH_CHECK_VALUE(kv_cache.size(4) == head_size && kv_cache.stride(2) % 16 == 0 && kv_cache.stride(3) % 16 == 0,
                      "paged_decode_attention: FP8 rows must be head_size bytes, 16-byte aligned");
  } else {
    TORCH_CHECK_VALUE(kv_cache.size(4) * 16 == head_size * 9 && kv_cache.stride(3) == kv_cache.size(4) &&
                          kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4),
                      "paged_decode_attention: NVFP4 pages must be contiguous rows of 9 * head_size / 16 bytes");
  }
  TORCH_CHECK_VALUE(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                        query_start_loc.scalar_type() == at::kInt && block_table.stride(1) == 1 &&
                        seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
                    "paged_decode_attention: int32 metadata with contiguous rows");
  TORCH_CHECK_VALUE(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat,
                    "paged_decode_attention: float32 scales");
  TORCH_CHECK_VALUE(num_splits >= 1 && num_splits <= 256, "paged_decode_attention: num_splits=", num_splits,
                    " (allowed: 1 to 256)");
  c10::cuda::CUDAGuard guard(query.device());
  auto out = num_splits > 1 ? at::empty({num_tokens, num_q_heads, head_size}, query.options())
                            : at::zeros({num_tokens, num_q_heads, head_size}, query.options());
  if (num_tokens == 0 || num_seqs == 0) return out;
  at::Tensor part_out, part_lse;
  if (num_splits > 1) {
    part_out = at::empty({num_splits, num_tokens, num_q_heads, head_size}, query.options().dtype(at::kFloat));
    part_lse = at::empty({num_splits, num_tokens, num_q_heads}, query.options().dtype(at::kFloat));
  }
  DecodeParams p{};
  p.query = query.data_ptr();
  p.cache = static_cast<const uint8_t*>(kv_cache.data_ptr());
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.part_out = num_splits > 1 ? part_out.data_ptr<float>() : nullptr;
  p.part_lse = num_splits > 1 ? part_lse.data_ptr<float>() : nullptr;
  p.stride_qt = query.stride(0);
  p.stride_qh = query.stride(1);
  p.stride_cb = kv_cache.stride(0);
  p.stride_ckv = static_cast<int>(kv_cache.stride(1));
  p.stride_cs = static_cast<int>(kv_cache.stride(2));
  p.stride_ch = static_cast<int>(kv_cache.stride(3));
  p.stride_bt = block_table.stride(0);
  p.num_tokens = num_tokens;
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.group = static_cast<int>(num_q_heads / num_kv_heads);
  p.page = static_cast<int>(kv_cache.size(2));
  p.window = static_cast<int>(sliding_window > 0 ? sliding_window : 0);
  p.num_splits = static_cast<int>(num_splits);
  p.k_scale_stride = k_scale.numel() > 1 ? static_cast<int>(k_scale.stride(0)) : 0;
  p.v_scale_stride = v_scale.numel() > 1 ? static_cast<int>(v_scale.stride(0)) : 0;
  p.qk_scale = static_cast<float>(sm_scale) * kLog2e;
  p.cap = logit_softcap > 0 ? static_cast<float>(logit_softcap) * kLog2e : 0.f;
  p.inv_cap = logit_softcap > 0 ? 1.f / p.cap : 0.f;
  const int64_t page = kv_cache.size(2);
  p.page_shift = -1;
  for (int k = 4; k < 31; ++k) {
    if (page == (int64_t{1} << k)) p.page_shift = k;
  }
  p.v_scales_swizzled = mode == KVQuantMode::NVFP4 && nvfp4_v_scales_swizzled(page, head_size);
  p.query_fp16 = query.scalar_type() == at::kHalf;
  p.heads_fastest = KVFUSE_DECODE_HEADS_FASTEST && num_seqs <= 65535;  // grid.y's limit
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int seqs = static_cast<int>(num_seqs);
  switch (mode) {
    case KVQuantMode::NVFP4: launch_head_size<DecodeFmt::kNvfp4>(p, head_size, seqs, stream); break;
    case KVQuantMode::FP8_E5M2: launch_head_size<DecodeFmt::kE5m2>(p, head_size, seqs, stream); break;
    case KVQuantMode::FP8_PER_TOKEN_HEAD: launch_head_size<DecodeFmt::kE4m3Rows>(p, head_size, seqs, stream); break;
    default: launch_head_size<DecodeFmt::kE4m3>(p, head_size, seqs, stream); break;
  }
  if (num_splits > 1) {
    launch_maybe_dependent(decode_attention_reduce_kernel, dim3(num_tokens, num_q_heads), dim3(128), 0, stream,
                           KVFUSE_DECODE_PDL && dependent_launch_supported(), p, static_cast<int>(num_q_heads),
                           static_cast<int>(head_size));
  }
  return out;
}

}  // namespace
}  // namespace kvfuse

TORCH_LIBRARY_FRAGMENT(kvfuse_native, m) {
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor k_scale, Tensor v_scale, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor? sinks, int kv_quant_mode, float sm_scale, "
        "int sliding_window, float logit_softcap, int num_splits) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvfuse_native, CUDA, m) {
  m.impl("paged_decode_attention", TORCH_FN(kvfuse::paged_decode_attention_cuda));
}
