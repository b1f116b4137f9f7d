// Prefill attention on Hopper (sm_90a): new query tokens over their sequence's cached prefix and
// over themselves (causal), for head size 128: bf16 / fp16 operands, or e4m3 ones for an FP8 e4m3
// cache (the query rounded row by row to e4m3), fp32 accumulation.
//
// Semantics: kvfuse/ops/reference.py paged_attention, for the calls kvfuse.ops.native.prefill_refusal
// accepts (no sliding window, no soft-cap). Query token i of a sequence with P cached positions
// before its q_len new tokens sits at position P + i and attends to every prefix key j < P and
// to new keys i' <= i, in one base-2 online softmax:
//
//   s_j = (q . k_j) * sm_scale * log2(e) [* k_scale * factor]
//   o   = [v_scale * factor *] sum_j 2^(s_j - m) v_j / (sum_j 2^(s_j - m) [+ 2^(sink - m)])
//
// Where the keys come from (all dense [rows, kv_heads, 128] tensors, read through tensor maps):
// the prefix of sequence b at rows b * context_stride + j of context_key / context_value (the
// gather of kvfuse.ops.triton.prefill.gather_context); the new keys at rows q_start + i of the
// step's key / value, or, with new_in_context, at rows b * context_stride + P + i of the context
// tensors (a quantized cache's whole context: then the scales apply, with `factor` NVFP4's 2^6).
// e5m2 / NVFP4 contexts come decoded into the query's dtype, e4m3 ones as codes: keys [rows,
// kv_heads * 128], values transposed [kv_heads * 128, columns] (FP8 wgmma reads both operands
// K-major), each 16 columns permuted to P's register order (prefill.permuted_value_column).
//
// Work split, as FlashAttention-3 on Hopper: a block owns 128 query tokens of one sequence and
// one query head (GQA: head h reads KV head h / group; a group's blocks share K/V through L2)
// and runs three warpgroups. Warpgroup 0 is the producer: one thread issues tensor-map copies
// of the query tile and of each 128-key K and V tile into a ring in shared memory (two stages of
// 16-bit tiles, three of e4m3 ones; 128-byte swizzle, the layout wgmma reads), completing mbarriers. Warpgroups 1 and 2 are
// consumers with 64 query rows each: per key tile, S = Q K^T (wgmma m64n128k16, or k32 for e4m3,
// both operands in shared memory), the online softmax in registers, and O += P V (wgmma with P
// from registers: the accumulator layout of S is the 16-bit A-operand layout, so P needs no
// shuffle; for e4m3 the values' column order absorbs the difference). Within a consumer, the
// P V product of tile t - 1 is issued together with S of tile t and runs while the softmax of
// tile t waits for S. The e4m3 kernel overlaps the same way, but starts each P V product afresh
// and adds it to O in fp32 after the softmax ("two-level accumulation"): Hopper's e4m3 products
// accumulate with fewer bits than fp32 and drop low bits at every k-step, so a product summing O
// over every tile of a long context comes out low (9% at 8300 keys: BENCHMARKS.md); one tile per
// product bounds the loss to one tile's. The fp32 O fits beside the product and two P buffers
// because the e4m3 S accumulates in f16 (32 registers instead of 64): the query's row multiplier
// keeps |S| inside f16's range for any e4m3 keys and makes each row's score scale a power of two,
// and the softmax runs on f16 pairs (KVFUSE_PREFILL_FP8_SCORES_F16). The 16-bit kernels'
// consumers take turns issuing their products (named barriers, "ping-pong"), so that one
// warpgroup's softmax overlaps the other's MMAs; the e4m3 consumers issue when ready.
// The softmax's row sums of P are additions, except in the e4m3 kernel over long contexts: there an
// m64n8 product of P with a tile of ones rides along each P V product, which takes the additions
// off the softmax and sums the same e4m3-rounded P the values are weighted with. With fp32 scores,
// the e4m3 softmax also takes a share of its exponentials from a polynomial (poly_exp2) instead of
// the MUFU unit.
// The producer gives up registers (setmaxnreg) so that the consumers hold S, O and P (240 each).
// Consumers store O through their 16-bit query tile in shared memory, which no product reads any
// more, with two tensor-map stores each (whole 128-byte rows instead of every thread's scattered
// 4-byte pairs); consumers with rows past their sequence store pairs.
//
// Key tiles in order (KeyTiles): with the step's K/V, the diagonal tile of the new keys (masked:
// key i' <= i), the other new tiles from the diagonal down, then the prefix tiles from its end
// down (the last one masked where P is not a multiple of 128); with the whole context, its
// 128-aligned tiles from the last one the block's rows see down (those reaching past position
// P + m0 masked). Blocks are launched longest first (the reversed tile index).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <type_traits>

#include "device_attributes.h"
#include "hopper_mma.h"

// Tuning only (KVFUSE_NATIVE_CUDA_FLAGS): K/V ring stages of the 16-bit and e4m3 kernels.
#ifndef KVFUSE_PREFILL_STAGES
#define KVFUSE_PREFILL_STAGES 2
#endif
#ifndef KVFUSE_PREFILL_FP8_STAGES
#define KVFUSE_PREFILL_FP8_STAGES 3
#endif
// 1: the consumers take turns issuing their MMAs (named barriers); 0: each issues when ready.
// 16-bit and e4m3 kernels apart: the 16-bit kernels measured faster with turns; the e4m3 kernel
// too until its softmax overlapped its own P V product (KVFUSE_PREFILL_FP8_OVERLAP), and faster
// without them since (BENCHMARKS.md, forty-second session).
#ifndef KVFUSE_PREFILL_PINGPONG
#define KVFUSE_PREFILL_PINGPONG 1
#endif
#ifndef KVFUSE_PREFILL_FP8_PINGPONG
#define KVFUSE_PREFILL_FP8_PINGPONG 0
#endif
// fp32 scores (KVFUSE_PREFILL_FP8_SCORES_F16=0): the e4m3 softmax takes the exponentials of every
// this many of its 8-column groups from a
// polynomial on the FMA pipe (poly_exp2) instead of the MUFU unit, which the two consumers'
// softmaxes share where they overlap; 0: none. The e4m3 kernel sums P's rows on the tensor cores
// (an m64n8 product of P with a tile of ones beside each P V product), so its softmax has no
// additions of its own; the share was measured for that kernel (BENCHMARKS.md).
#ifndef KVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY
#define KVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY 8
#endif
// 1: the e4m3 softmax's row maxima by four independent chains per row (fp32 scores; the f16
// softmax always takes four), 0: one chain per row. The
// maximum is the same either way; four chains shorten the dependent FMNMX sequence that every
// tile's exponentials wait for, and the e4m3 kernels' softmax is latency-bound (BENCHMARKS.md).
#ifndef KVFUSE_PREFILL_FP8_MAX_TREE
#define KVFUSE_PREFILL_FP8_MAX_TREE 1
#endif
// 1: the warpgroup index is broadcast from lane 0, so that nvcc treats it as warp-uniform and keeps
// the consumer's descriptors in uniform registers (0: it moved them from ordinary registers into
// uniform ones before every product, and spilled; measured slower: BENCHMARKS.md).
#ifndef KVFUSE_PREFILL_UNIFORM_WARPGROUP
#define KVFUSE_PREFILL_UNIFORM_WARPGROUP 1
#endif
// 1: a consumer whose 64 rows all belong to its sequence stores O through its (by then unread)
// 16-bit query tile in shared memory, as two tensor-map stores of whole 128-byte rows; 0: every
// thread stores its own 4-byte pairs straight to global memory (as rows past the sequence do).
// 16-bit and e4m3 kernels apart: the e4m3 kernel measured slower with it at 16384 tokens
// (thirty-seventh session), and faster at every size once its softmax overlapped its own P V
// product (BENCHMARKS.md, forty-second session).
#ifndef KVFUSE_PREFILL_TMA_STORE
#define KVFUSE_PREFILL_TMA_STORE 1
#endif
#ifndef KVFUSE_PREFILL_FP8_TMA_STORE
#define KVFUSE_PREFILL_FP8_TMA_STORE 1
#endif
// 1: the e4m3 kernel's S = Q K^T accumulates in f16 (32 registers instead of 64) and its softmax
// runs on f16x2 pairs. The query's row multiplier is then chosen so that |S| stays below f16's
// range for any e4m3 keys (|q| <= kF16QueryMax) and the score scale is a power of two (exact in
// f16). 0: S in fp32, the multiplier 448 / max |q_row|.
#ifndef KVFUSE_PREFILL_FP8_SCORES_F16
#define KVFUSE_PREFILL_FP8_SCORES_F16 1
#endif
// 1 (needs f16 scores): each e4m3 consumer's softmax of tile t runs while its own P V product of
// tile t - 1 does (two P buffers), the product still started afresh and added to the fp32 O after
// the softmax. 0: the product is issued ahead of S and added while S runs, and the softmax waits
// for both (the only order whose registers fit with fp32 scores). Measured: BENCHMARKS.md,
// forty-second session.
#ifndef KVFUSE_PREFILL_FP8_OVERLAP
#define KVFUSE_PREFILL_FP8_OVERLAP 1
#endif

namespace kvfuse {
namespace {

constexpr int kHead = 128;                // the head size this kernel is built for
constexpr int kBlockM = 128;              // query rows per block
constexpr int kBlockN = 128;              // keys per tile
constexpr int kConsumerRows = 64;         // query rows per consumer warpgroup
constexpr int kThreads = 384;             // producer + 2 consumer warpgroups
constexpr int kSwizzleElems = 64;         // 16-bit elements per 128-byte swizzled row
constexpr uint32_t kQHalfBytes = kConsumerRows * 128;    // 64 rows x 64 16-bit columns
constexpr uint32_t kQConsumerBytes = 2 * kQHalfBytes;    // one consumer's 64 x 128 query rows
constexpr uint32_t kQ8ConsumerBytes = kConsumerRows * 128;  // the same in e4m3: one 128-byte row each
constexpr uint32_t kKVHalfBytes = kBlockN * 128;         // 128 keys x 64 16-bit columns
constexpr uint32_t kSwizzleAtomBytes = 1024;             // 8 rows of 128 bytes
constexpr uint32_t kProducerRegisters = 24;
constexpr uint32_t kConsumerRegisters = 240;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kE4m3Max = 448.f;
// f16 scores: the query row's largest magnitude after its multiplier, at most. 128 products of
// |q| <= 1.125 with e4m3 keys (|k| <= 448) sum to at most 64512, inside f16's 65504.
constexpr float kF16QueryMax = 1.125f;
// P enters FP8 products as e4m3(2^8 p): e4m3's normal range then covers p >= 2^-14, and the
// denominator sums the same 2^8 p, so the factor cancels (as in kvfuse.ops.triton.prefill).
constexpr float kFp8PShift = 8.f;
constexpr uint32_t kOnesBytes = 1024;  // a 128-byte swizzle atom: 8 columns x 128 keys of e4m3
constexpr uint32_t kE4m3OnesWord = 0x38383838u;  // four e4m3 1.0

// What the products read: the step's (or a decoded context's) 16-bit K/V, or e4m3 codes of an
// FP8 cache's gathered context (keys [rows, heads * 128]; values transposed, [heads * 128,
// columns], each 16 columns permuted to P's register order: prefill.permuted_value_column).
enum class Operand { kBf16, kFp16, kE4m3 };

template <Operand kOp>
struct OperandTraits {
  static constexpr bool kFp8 = kOp == Operand::kE4m3;
  // A K or V tile: 128 keys x 128 elements, in two 64-column boxes (16-bit) or one box (e4m3).
  static constexpr uint32_t kTileBytes = kFp8 ? kBlockN * 128 : 2 * kKVHalfBytes;
  static constexpr int kStages = kFp8 ? KVFUSE_PREFILL_FP8_STAGES : KVFUSE_PREFILL_STAGES;
  static constexpr int kPRegisters = kFp8 ? 16 : 32;  // P of a 64 x 128 tile as MMA A operands
  static constexpr bool kPingPong = kFp8 ? KVFUSE_PREFILL_FP8_PINGPONG : KVFUSE_PREFILL_PINGPONG;
  static constexpr bool kTmaStore = kFp8 ? KVFUSE_PREFILL_FP8_TMA_STORE : KVFUSE_PREFILL_TMA_STORE;
};

template <Operand kOp>
struct SharedStorage {
  using Traits = OperandTraits<kOp>;
  // Each box is rows of 128 bytes with the 128-byte swizzle that wgmma's descriptors describe.
  alignas(1024) uint8_t q[2 * kQConsumerBytes];     // [consumer][half][64 rows][128 B], 16-bit
  alignas(1024) uint8_t q8[Traits::kFp8 ? 2 * kQ8ConsumerBytes : 1024];  // [consumer][64 rows][128 B], e4m3
  alignas(1024) uint8_t k[Traits::kStages][Traits::kTileBytes];
  alignas(1024) uint8_t v[Traits::kStages][Traits::kTileBytes];
  float q_scale[kBlockM];  // e4m3: each query row's multiplier onto e4m3's range
  uint64_t q_full;
  uint64_t k_full[Traits::kStages];
  uint64_t k_empty[Traits::kStages];
  uint64_t v_full[Traits::kStages];
  uint64_t v_empty[Traits::kStages];
  // e4m3: each consumer's B operand of its row-sum products (kRowSums), e4m3 ones in any layout.
  // Last, so that the 16-bit kernels' layout does not depend on it.
  alignas(1024) uint8_t ones[Traits::kFp8 ? 2 : 1][Traits::kFp8 ? kOnesBytes : 16];
};

template <Operand kOp>
constexpr size_t shared_bytes() {
  return sizeof(SharedStorage<kOp>) + 1024;  // + the base's alignment
}

struct PrefillParams {
  void* out;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const float* sinks;      // [num_q_heads] or null
  const float* k_scale;    // [1] or per KV head (stride k_scale_stride); read only with scaled
  const float* v_scale;
  int64_t stride_ot;       // elements
  int64_t stride_oh;
  int num_tokens;
  int num_seqs;
  int num_q_heads;
  int group;
  int context_stride;      // rows per sequence in the context tensors
  int k_scale_stride;
  int v_scale_stride;
  int num_tiles;           // query tiles of the grid: num_tokens / kBlockM + num_seqs
  float qk_scale;          // sm_scale * log2(e)
  float factor;            // NVFP4's 2^6 of gathered rows, else 1
  bool scaled;
  bool new_in_context;
  bool heads_fastest;
};

// The (sequence, first query row, query count, tile within the sequence) of grid tile `tile`:
// sequence b owns tiles [qsl[b] / kBlockM + b, qsl[b + 1] / kBlockM + b + 1), an upper bound
// from shapes only (as kvfuse.ops.triton.attention._tile_sequence).
__device__ __forceinline__ void tile_sequence(const int32_t* qsl, int num_seqs, int tile, int& b, int& q_start,
                                              int& q_len, int& local) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (qsl[mid] / kBlockM + mid <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  b = lo;
  q_start = qsl[lo];
  q_len = qsl[lo + 1] - q_start;
  local = tile - (q_start / kBlockM + lo);
}

// The key tiles of a block, in the order they are attended (the file comment's), and what each
// masks. Keys of a tile are its columns 0..127; block row r (0..127) sees column c when
// c <= diag + r and c <= end (kNoMask: no such bound).
constexpr int kNoMask = 1 << 30;

struct KeyTile {
  bool context;  // read from the context tensors (else the step's key / value)
  int first;     // its first key: a context row (minus the sequence's first) or a new-key row
  int diag;
  int end;
};

struct KeyTiles {
  int local;          // the block's query tile within its sequence
  int m0;             // its first query row
  int prefix;         // cached positions before the new tokens
  int new_tiles;      // step K/V: the new keys' tiles (up to the diagonal); context: 0
  int prefix_tiles;   // step K/V: the prefix's tiles; context: every tile of positions [0, kv_end)
  bool new_in_context;

  __device__ __forceinline__ KeyTiles(int local_, int q_len, int prefix_, bool new_in_context_)
      : local(local_), m0(local_ * kBlockM), prefix(prefix_), new_in_context(new_in_context_) {
    if (new_in_context) {
      // Query row i sits at context position prefix + i; tiles from position 0, 128-aligned (the
      // e4m3 values' tensor map takes 16-byte aligned columns only).
      const int kv_end = prefix + min(m0 + kBlockM, q_len);
      new_tiles = 0;
      prefix_tiles = (kv_end + kBlockN - 1) / kBlockN;
    } else {
      new_tiles = local + 1;
      prefix_tiles = (prefix + kBlockN - 1) / kBlockN;
    }
  }

  __device__ __forceinline__ int count() const { return new_tiles + prefix_tiles; }

  __device__ __forceinline__ KeyTile operator[](int it) const {
    if (it < new_tiles) {
      const int first = (local - it) * kBlockN;
      return {false, first, m0 - first, kNoMask};
    }
    const int first = (prefix_tiles - 1 - (it - new_tiles)) * kBlockN;
    if (new_in_context) return {true, first, prefix + m0 - first, kNoMask};
    return {true, first, kNoMask, prefix - first - 1};
  }
};

// Whether any row of the block masks a key of tile `kt` (uniform over the block).
__device__ __forceinline__ bool masked(const KeyTile& kt) { return kt.diag < kBlockN - 1 || kt.end < kBlockN - 1; }

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x for x <= 8 (-inf included) without the MUFU unit: x = n + f with n = rint(x) (the 1.5 * 2^23
// rounding trick) and |f| <= 1/2, 2^f by a degree-3 polynomial (relative error < 7.6e-5, far below
// e4m3's rounding of P), and n added to its exponent field. x is clamped at -126 first, so the
// exponent stays >= 0 (the result is then below 2^-125, zero once P is rounded to e4m3).
__device__ __forceinline__ float poly_exp2(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23
  x = fmaxf(x, -126.f);
  const float t = __fadd_rn(x, kRound);
  const float f = __fadd_rn(x, -__fadd_rn(t, -kRound));
  const float p = fmaf(fmaf(fmaf(0.05517083779f, f, 0.24260935187f), f, 0.69326096773f), f, 0.99992817640f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// The softmax's 2^x for its 8-column group j (KVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY).
template <Operand kOp>
__device__ __forceinline__ float softmax_exp2(int j, float x) {
  constexpr int kEvery = kOp == Operand::kE4m3 ? KVFUSE_PREFILL_FP8_TC_ROWSUM_POLY_EXP2_EVERY : 0;
  if constexpr (kEvery > 0) {
    if (j % kEvery == kEvery - 1) return poly_exp2(x);
  }
  return fast_exp2(x);
}

#if KVFUSE_HOPPER_MMA
// e4m3: a converted pair (lo in the low byte) into its place in store_p's e4m3 layout (below).
__device__ __forceinline__ void store_e4m3_pair(uint32_t* p, int j, int r, uint32_t pair) {
  uint32_t& reg = p[4 * (j / 4) + 2 * ((j % 4) / 2) + r];
  reg = (j % 2 == 0) ? pair : (reg | (pair << 16));
}

// P's probabilities of the pair (column 8j + 2t, + 1) of the thread's row r (0: 16w + g, 1: + 8)
// into the A operands of the P V product. 16-bit: one register per pair, k-step j / 2 (the
// accumulator layout is the A layout). e4m3: two pairs per register (j even: low half), k-step
// j / 4; P's column order inside each 32-key step then is not the keys' (a0 holds columns 2t,
// 2t + 1, 8 + 2t, 9 + 2t), and the value tile's columns are stored in that same order.
template <Operand kOp>
__device__ __forceinline__ void store_p(uint32_t* p, int j, int r, float lo, float hi) {
  if constexpr (kOp == Operand::kE4m3) {
    store_e4m3_pair(p, j, r, hopper::e4m3x2(lo, hi));
  } else if constexpr (kOp == Operand::kFp16) {
    __half2 v = __floats2half2_rn(lo, hi);
    p[2 * j + r] = *reinterpret_cast<uint32_t*>(&v);
  } else {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    p[2 * j + r] = *reinterpret_cast<uint32_t*>(&v);
  }
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

__device__ __forceinline__ uint32_t pack_out(__nv_bfloat16*, float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t pack_out(__half*, float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The online-softmax step of one consumer thread over a 64 x 128 score tile (its two rows:
// r = 16 w + g and r + 8, with score scales qk[0], qk[1] in log2 units). Masked keys (column >
// limit of the row) read as -inf; s itself is left as it is (it is the next S product's
// accumulator, which no instruction may write while P V runs). Updates the running max m and the
// thread's partial row sums l (summed over the quad at the end; with kSums false the caller sums
// P on the tensor cores and l is left alone), writes P as the next P V product's A operands
// (store_p), and returns the accumulator's rescale in alpha.
template <Operand kOp, bool kMasked, bool kSums>
__device__ __forceinline__ void softmax_tile(const float (&s)[64], float (&m)[2], float (&l)[2], uint32_t* p,
                                             float (&alpha)[2], const float (&qk)[2], int limit0, int limit1,
                                             int lane) {
  constexpr float kShift = kOp == Operand::kE4m3 ? kFp8PShift : 0.f;
  const int col0 = 2 * (lane & 3);
  auto score = [&](int j, int e, int r) {
    const float x = s[4 * j + 2 * r + e];
    if constexpr (kMasked) {
      return 8 * j + col0 + e > (r == 0 ? limit0 : limit1) ? -INFINITY : x;
    } else {
      return x;
    }
  };
  float mx[2] = {-INFINITY, -INFINITY};
  if constexpr (KVFUSE_PREFILL_FP8_MAX_TREE && kOp == Operand::kE4m3) {
    float chains[2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) chains[r][c] = fmaxf(score(c, 0, r), score(c, 1, r));
#pragma unroll
      for (int j = 4; j < 16; ++j) chains[r][j % 4] = fmaxf(chains[r][j % 4], fmaxf(score(j, 0, r), score(j, 1, r)));
      mx[r] = fmaxf(fmaxf(chains[r][0], chains[r][1]), fmaxf(chains[r][2], chains[r][3]));
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(score(j, 0, 0), score(j, 1, 0)));
      mx[1] = fmaxf(mx[1], fmaxf(score(j, 0, 1), score(j, 1, 1)));
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(m[r], mx[r] * qk[r]);
    // A row without a seen key so far keeps m = -inf: shift by 0 rather than compute inf - inf.
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = fast_exp2(m[r] - m_use);
    m[r] = m_new;
    mx[r] = kShift - m_use;  // the exponent's offset, reused below
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float p0 = softmax_exp2<kOp>(j, fmaf(score(j, 0, r), qk[r], mx[r]));
      const float p1 = softmax_exp2<kOp>(j, fmaf(score(j, 1, r), qk[r], mx[r]));
      if constexpr (kSums) sum[r] += p0 + p1;
      store_p<kOp>(p, j, r, p0, p1);
    }
  }
  if constexpr (kSums) {
    l[0] = l[0] * alpha[0] + sum[0];
    l[1] = l[1] * alpha[1] + sum[1];
  }
}

// softmax_tile's step for the e4m3 kernel with f16 scores (KVFUSE_PREFILL_FP8_SCORES_F16): s holds
// the tile's scores as f16x2 pairs (s[2j + r]: row r's columns 8j + 2t, + 1), qk[r] is a power of
// two. The exponent 2^(s qk - m + 8) is one f16x2 FMA, ex2 and e4m3 conversion per pair. The max
// that P is taken against is m rounded up so that 8 - m is an f16 value (the offset of that FMA);
// O, the row sums, alpha and the epilogue all use that same m, so the rounding changes no result,
// only P's scale: by 2^-d with d < 2^-10 |8 - m| (P's largest term stays above 2^7 while |m| <
// 1000). P's row sums are the tensor cores' (kRowSums). Scores must stay within f16's range
// (|s qk| < 65504 in log2 units).
template <bool kMasked>
__device__ __forceinline__ void softmax_tile_f16(const uint32_t (&s)[32], float (&m)[2], uint32_t* p, float (&alpha)[2],
                                                 const float (&qk)[2], int limit0, int limit1, int lane) {
  using namespace hopper;
  constexpr uint32_t kNegInfPair = 0xFC00FC00u;
  const int col0 = 2 * (lane & 3);
  auto score = [&](int j, int r) {
    uint32_t x = s[2 * j + r];
    if constexpr (kMasked) {
      const int lim = r == 0 ? limit0 : limit1;
      if (8 * j + col0 > lim) {
        x = kNegInfPair;
      } else if (8 * j + col0 + 1 > lim) {
        x = (x & 0xFFFFu) | (kNegInfPair & 0xFFFF0000u);
      }
    }
    return x;
  };
  uint32_t offset[2], scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    uint32_t chains[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) chains[c] = score(c, r);
#pragma unroll
    for (int j = 4; j < 16; ++j) chains[j % 4] = hmax2(chains[j % 4], score(j, r));
    const uint32_t both = hmax2(hmax2(chains[0], chains[1]), hmax2(chains[2], chains[3]));
    const __half2 pair = *reinterpret_cast<const __half2*>(&both);
    float mx = fmaxf(__low2float(pair), __high2float(pair));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[r], mx * qk[r]);
    __half off = __float2half_rn(kFp8PShift);
    if (m_new == -INFINITY) {
      alpha[r] = 1.f;  // nothing seen yet: O and the row sums are zeros
    } else {
      off = __float2half_rd(fmaxf(kFp8PShift - m_new, -65504.f));
      const float m_use = kFp8PShift - __half2float(off);  // >= m_new
      alpha[r] = fast_exp2(m[r] - m_use);
      m[r] = m_use;
    }
    const __half2 off2 = __half2half2(off);
    const __half2 scale2 = __float2half2_rn(qk[r]);
    offset[r] = *reinterpret_cast<const uint32_t*>(&off2);
    scale[r] = *reinterpret_cast<const uint32_t*>(&scale2);
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      store_e4m3_pair(p, j, r, e4m3x2_from_f16x2(hexp2(hfma2(score(j, r), scale[r], offset[r]))));
    }
  }
}

// S = Q K^T for one consumer, accumulated in f16 (e4m3 operands as issue_scores').
__device__ __forceinline__ void issue_scores_f16(uint32_t (&s)[32], hopper::SmemDesc q, hopper::SmemDesc k) {
#pragma unroll
  for (int kk = 0; kk < kHead / 32; ++kk) {
    hopper::wgmma_m64n128k32_e4m3_ss_f16(s, (q + kk * 32).get(), (k + kk * 32).get(), kk > 0);
  }
}

// The e4m3 kernel's f16 scores through the same names as fp32 ones (the kernel's S is either).
template <Operand kOp, bool kMasked, bool kSums>
__device__ __forceinline__ void softmax_tile(const uint32_t (&s)[32], float (&m)[2], float (&)[2], uint32_t* p,
                                             float (&alpha)[2], const float (&qk)[2], int limit0, int limit1,
                                             int lane) {
  static_assert(kOp == Operand::kE4m3 && !kSums, "f16 scores: e4m3 kernels with tensor-core row sums only");
  softmax_tile_f16<kMasked>(s, m, p, alpha, qk, limit0, limit1, lane);
}

template <Operand kOp>
__device__ __forceinline__ void issue_scores(uint32_t (&s)[32], hopper::SmemDesc q, hopper::SmemDesc k) {
  issue_scores_f16(s, q, k);
}

// S = Q K^T for one consumer. Both operands are K-major in shared memory with 8-row swizzle atoms
// 1024 bytes apart. 16-bit: a k-step of 16 columns starts 32 bytes further into the 128-byte
// rows, and the head's second 64 columns are each tile's second box. e4m3: a k-step is 32
// columns, 32 bytes; a 128-byte row holds the whole head.
template <Operand kOp>
__device__ __forceinline__ void issue_scores(float (&s)[64], hopper::SmemDesc q, hopper::SmemDesc k) {
  using namespace hopper;
  if constexpr (kOp == Operand::kE4m3) {
#pragma unroll
    for (int kk = 0; kk < kHead / 32; ++kk) {
      wgmma_m64n128k32_e4m3_ss(s, (q + kk * 32).get(), (k + kk * 32).get(), kk > 0);
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < kHead / 16; ++kk) {
      const uint32_t column_bytes = (kk % 4) * 32;
      wgmma_m64n128k16_ss<kOp == Operand::kFp16, 0>(s, (q + ((kk / 4) * kQHalfBytes + column_bytes)).get(),
                                                     (k + ((kk / 4) * kKVHalfBytes + column_bytes)).get(), kk > 0);
    }
  }
}

// P V, P from registers (softmax_tile). 16-bit: O += P V. The V tile is N-major (the head
// dimension contiguous): a k-step of 16 keys is two 8-row atoms (2048 bytes) on, and the head's
// second 64 columns, the N side's next atom, are the tile's other box. e4m3: o = P V, started
// afresh (the caller adds it to O in fp32). The tile is V^T (keys contiguous, K-major): a k-step
// of 32 keys is 32 bytes into its rows. kRowSums (e4m3): also row_sums = P's row sums (P times a
// column block of ones, `ones`; every column of row_sums holds its row's sum).
template <Operand kOp, bool kRowSums>
__device__ __forceinline__ void issue_values(float (&o)[64], float (&row_sums)[4], const uint32_t* pa,
                                             hopper::SmemDesc v, hopper::SmemDesc ones) {
  using namespace hopper;
  if constexpr (kOp == Operand::kE4m3) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 32; ++kk) {
      const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      wgmma_m64n128k32_e4m3_rs(o, a, (v + kk * 32).get(), kk > 0);
      if constexpr (kRowSums) {
        wgmma_m64n8k32_e4m3_rs(row_sums, a, (ones + kk * 32).get(), kk > 0);
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      wgmma_m64n128k16_rs<kOp == Operand::kFp16, 1>(o, a, (v + kk * 2 * kSwizzleAtomBytes).get());
    }
  }
}

// e4m3: consumer c's 64 query rows, loaded in 16-bit, scaled row by row onto e4m3's range
// (448 / max |q_row|, the multiplier kept in q_scale; with f16 scores, see there, the row's score
// scale kept instead) and rounded into its e4m3 box. Two threads per row, 64 columns each.
template <typename T>
__device__ __forceinline__ void quantize_query(const uint8_t* q16, uint8_t* q8, float* q_scale, float qk_scale,
                                               int ctid) {
  const int r = ctid / 2, half = ctid % 2;
  const uint8_t* src = q16 + half * kQHalfBytes + r * 128;
  float x[64];
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src + ((k ^ (r % 8)) * 16));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[8 * k + i] = to_float(e[i]);
      amax = fmaxf(amax, fabsf(x[8 * k + i]));
    }
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
#if KVFUSE_PREFILL_FP8_SCORES_F16
  // The row's score scale becomes 2^e (q_scale keeps it): e = ceil(log2(|qk_scale| amax /
  // kF16QueryMax)), so the multiplier qk_scale 2^-e takes |q| to at most kF16QueryMax (and above
  // half of it). e is clamped to f16's exponents (2^-24..2^15). At the low end every |score| is
  // below 2^-9 (log2 units), so the softmax is uniform to within 0.3% anyway; a scale past the
  // high end gives scores outside what f16 holds.
  int e;
  const float fraction = frexpf(fabsf(qk_scale) * amax / kF16QueryMax, &e);
  if (fraction == 0.5f) --e;
  e = min(max(e, -24), 15);
  const float mult = qk_scale * __int_as_float((127 - e) << 23);  // exact: 2^-e
  const float row_scale = __int_as_float((127 + e) << 23);
#else
  const float mult = amax > 0.f ? kE4m3Max / amax : 1.f;
#endif
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int e = 16 * k + 4 * i;
      w[i] = hopper::e4m3x2(x[e] * mult, x[e + 1] * mult) | (hopper::e4m3x2(x[e + 2] * mult, x[e + 3] * mult) << 16);
    }
    const int chunk = 4 * half + k;
    *reinterpret_cast<uint4*>(q8 + r * 128 + ((chunk ^ (r % 8)) * 16)) = make_uint4(w[0], w[1], w[2], w[3]);
  }
#if KVFUSE_PREFILL_FP8_SCORES_F16
  if (half == 0) q_scale[r] = row_scale;
#else
  if (half == 0) q_scale[r] = mult;
#endif
  hopper::fence_shared_for_async_proxy();
}
#endif

// The e4m3 kernel sums P's rows on the tensor cores (issue_values with kRowSums); the 16-bit
// kernels' softmax adds them up.
template <Operand kOp, typename T>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_attention_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                             const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap ck_map,
                             const __grid_constant__ CUtensorMap cv_map, const __grid_constant__ CUtensorMap o_map,
                             const PrefillParams p) {
#if KVFUSE_HOPPER_MMA
  using namespace hopper;
  using Traits = OperandTraits<kOp>;
  constexpr bool kRowSums = Traits::kFp8;
  constexpr int kStages = Traits::kStages;
  extern __shared__ uint8_t smem_raw[];
  SharedStorage<kOp>& sm = *reinterpret_cast<SharedStorage<kOp>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));

  const int grid_tile = p.heads_fastest ? blockIdx.y : blockIdx.x;
  const int h = p.heads_fastest ? blockIdx.x : blockIdx.y;
  const int tile = p.num_tiles - 1 - grid_tile;  // longest first
  const int kvh = h / p.group;
  const int tid = threadIdx.x;

  // Zeros into this head's columns of rows [first, end) (rows that belong to no query).
  auto clear_rows = [&](int first, int end) {
    T* out = static_cast<T*>(p.out);
    for (int i = tid; i < kBlockM * (kHead / 8); i += kThreads) {
      const int row = first + i / (kHead / 8);
      if (row < end) {
        *reinterpret_cast<uint4*>(out + row * p.stride_ot + h * p.stride_oh + (i % (kHead / 8)) * 8) =
            make_uint4(0, 0, 0, 0);
      }
    }
  };
  // Rows outside every sequence ([0, qsl[0]) and [qsl[num_seqs], num_tokens)) are zeros, as in
  // the Triton kernel; each block clears its own head's share of its grid tile's row range.
  {
    const int first_row = p.query_start_loc[0], end_row = p.query_start_loc[p.num_seqs];
    const int r0 = grid_tile * kBlockM;
    if (r0 < p.num_tokens && r0 < first_row) clear_rows(r0, min(first_row, p.num_tokens));
    const int r1 = max(r0, end_row);
    if (r1 < p.num_tokens && r1 < r0 + kBlockM) clear_rows(r1, min(r0 + kBlockM, p.num_tokens));
  }

  int b, q_start, q_len, local;
  tile_sequence(p.query_start_loc, p.num_seqs, tile, b, q_start, q_len, local);
  if (local < 0 || local * kBlockM >= q_len) return;
  const int prefix = p.seq_lens[b] - q_len;
  // Metadata with fewer cached positions than new tokens (refused by the op's checked mode): the
  // sequence's rows are zeros, as in the Triton kernel.
  if (prefix < 0) {
    clear_rows(q_start + local * kBlockM, q_start + min(local * kBlockM + kBlockM, q_len));
    return;
  }
  const int m0 = local * kBlockM;
  const KeyTiles tiles(local, q_len, prefix, p.new_in_context);
  const int num_key_tiles = tiles.count();
  const int context_row0 = b * p.context_stride;

#if KVFUSE_PREFILL_UNIFORM_WARPGROUP
  // What derives from it (the consumer's query, ones and tile descriptors) then stays uniform.
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
#else
  const int warpgroup = tid / 128;
#endif
  if (tid == 0) {
    mbar_init(&sm.q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sm.k_full[s], 1);
      mbar_init(&sm.v_full[s], 1);
      mbar_init(&sm.k_empty[s], 8);  // lane 0 of each consumer warp
      mbar_init(&sm.v_empty[s], 8);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (warpgroup == 0) {
    release_registers<kProducerRegisters>();
    if (tid == 0) {
      mbar_arrive_expect_tx(&sm.q_full, 2 * kQConsumerBytes);
      for (int c = 0; c < 2; ++c) {
        for (int half = 0; half < 2; ++half) {
          tma_load_2d(sm.q + c * kQConsumerBytes + half * kQHalfBytes, &q_map, h * kHead + half * kSwizzleElems,
                      q_start + m0 + c * kConsumerRows, &sm.q_full);
        }
      }
      for (int it = 0; it < num_key_tiles; ++it) {
        const int s = it % kStages;
        const uint32_t parity = ((it / kStages) & 1) ^ 1;
        const KeyTile kt = tiles[it];
        const int row = (kt.context ? context_row0 : q_start) + kt.first;
        mbar_wait(&sm.k_empty[s], parity);
        mbar_arrive_expect_tx(&sm.k_full[s], Traits::kTileBytes);
        if constexpr (Traits::kFp8) {
          tma_load_2d(sm.k[s], &ck_map, kvh * kHead, row, &sm.k_full[s]);
        } else {
          for (int half = 0; half < 2; ++half) {
            tma_load_2d(sm.k[s] + half * kKVHalfBytes, kt.context ? &ck_map : &k_map,
                        kvh * kHead + half * kSwizzleElems, row, &sm.k_full[s]);
          }
        }
        mbar_wait(&sm.v_empty[s], parity);
        mbar_arrive_expect_tx(&sm.v_full[s], Traits::kTileBytes);
        if constexpr (Traits::kFp8) {
          // V^T: the tile's 128 keys are columns `row`.. of rows kvh * 128.. (one per element).
          tma_load_2d(sm.v[s], &cv_map, row, kvh * kHead, &sm.v_full[s]);
        } else {
          for (int half = 0; half < 2; ++half) {
            tma_load_2d(sm.v[s] + half * kKVHalfBytes, kt.context ? &cv_map : &v_map,
                        kvh * kHead + half * kSwizzleElems, row, &sm.v_full[s]);
          }
        }
      }
    }
    return;
  }

  claim_registers<kConsumerRegisters>();
  const int c = warpgroup - 1;  // consumer index
  const int ctid = tid - 128 * warpgroup;
  const int warp = ctid / 32, lane = ctid % 32;
  const int row_a = c * kConsumerRows + 16 * warp + lane / 4;  // block rows of this thread
  const int row_b = row_a + 8;
  // Ping-pong: consumer c issues its MMAs after named barrier 1 + c, then lets the other go.
  const uint32_t my_turn = 1 + c, other_turn = 2 - c;

  float qk_scale = p.qk_scale;
  float v_out = 1.f;
  if (p.scaled) {
    qk_scale *= p.k_scale[kvh * p.k_scale_stride] * p.factor;
    v_out = p.v_scale[kvh * p.v_scale_stride] * p.factor;
  }

  mbar_wait(&sm.q_full, 0);
  uint32_t q_base;
  float qk[2] = {qk_scale, qk_scale};
  uint32_t ones_base = 0;
  if constexpr (kRowSums) {
    // Made visible to the products by quantize_query's proxy fence and the barrier after it.
    reinterpret_cast<uint2*>(sm.ones[c])[ctid] = make_uint2(kE4m3OnesWord, kE4m3OnesWord);
    ones_base = smem_addr(sm.ones[c]);
  }
  if constexpr (Traits::kFp8) {
    quantize_query<T>(sm.q + c * kQConsumerBytes, sm.q8 + c * kQ8ConsumerBytes, sm.q_scale + c * kConsumerRows,
                      qk_scale, ctid);
    named_barrier_sync(3 + c, 128);
#if KVFUSE_PREFILL_FP8_SCORES_F16
    qk[0] = sm.q_scale[row_a];
    qk[1] = sm.q_scale[row_b];
#else
    qk[0] = qk_scale / sm.q_scale[row_a];
    qk[1] = qk_scale / sm.q_scale[row_b];
#endif
    q_base = smem_addr(sm.q8 + c * kQ8ConsumerBytes);
  } else {
    q_base = smem_addr(sm.q + c * kQConsumerBytes);
  }
  if (Traits::kPingPong && c == 1) named_barrier_arrive(1, 256);
  // Descriptors of the query, of stage 0's K and V tiles (each stage kTileBytes on) and of the ones.
  const SmemDesc q_desc = SmemDesc::swizzle128(q_base, 16, kSwizzleAtomBytes);
  const SmemDesc k_desc = SmemDesc::swizzle128(smem_addr(sm.k[0]), 16, kSwizzleAtomBytes);
  const SmemDesc v_desc = SmemDesc::swizzle128(smem_addr(sm.v[0]), Traits::kFp8 ? 16 : kKVHalfBytes, kSwizzleAtomBytes);
  const SmemDesc ones_desc = SmemDesc::swizzle128(ones_base, 16, kSwizzleAtomBytes);
  auto k_tile = [&](int stage) { return k_desc + stage * Traits::kTileBytes; };
  auto v_tile = [&](int stage) { return v_desc + stage * Traits::kTileBytes; };

  float o[64];  // 16-bit: O (in units of the running max); e4m3: one tile's P V product
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  // S: fp32, or f16 pairs in the e4m3 kernel with KVFUSE_PREFILL_FP8_SCORES_F16.
  constexpr bool kF16Scores = Traits::kFp8 && KVFUSE_PREFILL_FP8_SCORES_F16;
  std::conditional_t<kF16Scores, uint32_t[32], float[64]> s;
  uint32_t pa[Traits::kPRegisters];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  constexpr bool kSums = !kRowSums;  // the softmax sums P itself
  float row_sums[4] = {0.f, 0.f, 0.f, 0.f};  // kRowSums: one P V product's row sums of P

  // Key tile 0 (the diagonal): S only, nothing to add to O yet.
  mbar_wait(&sm.k_full[0], 0);
  if (Traits::kPingPong) named_barrier_sync(my_turn, 256);
  wgmma_fence();
  issue_scores<kOp>(s, q_desc, k_tile(0));
  wgmma_commit();
  if (Traits::kPingPong && !(c == 1 && num_key_tiles == 1)) named_barrier_arrive(other_turn, 256);
  wgmma_wait<0>();
  fence_registers(s);
  if (lane == 0) mbar_arrive(&sm.k_empty[0]);
  // Per-tile mask limits of this thread's rows (masked tiles only; see KeyTiles).
  auto limit = [&](const KeyTile& kt, int row) { return min(kt.diag + row, kt.end); };
  float alpha[2];  // the last softmax's rescale (e4m3: still owed to O)
  {
    const KeyTile kt = tiles[0];  // always masked: the diagonal
    softmax_tile<kOp, true, kSums>(s, m, l, pa, alpha, qk, limit(kt, row_a), limit(kt, row_b), lane);
  }
  auto softmax = [&](const KeyTile& kt, uint32_t* p_out) {
    if (masked(kt)) {
      softmax_tile<kOp, true, kSums>(s, m, l, p_out, alpha, qk, limit(kt, row_a), limit(kt, row_b), lane);
    } else {
      softmax_tile<kOp, false, kSums>(s, m, l, p_out, alpha, qk, kNoMask, kNoMask, lane);
    }
  };

  // Before the products of key tile `it` >= 1 (S of it, P V of it - 1): its K and the previous
  // tile's V in shared memory, and this consumer's turn to issue. After them, the other's turn
  // (consumer 1's last issue has no one to pass to).
  auto await_turn = [&](int it) {
    mbar_wait(&sm.k_full[it % kStages], (it / kStages) & 1);
    mbar_wait(&sm.v_full[(it - 1) % kStages], ((it - 1) / kStages) & 1);
    if (Traits::kPingPong) named_barrier_sync(my_turn, 256);
    wgmma_fence();
  };
  auto pass_turn = [&](int it) {
    if (Traits::kPingPong && !(c == 1 && it == num_key_tiles - 1)) named_barrier_arrive(other_turn, 256);
  };
  // The last tile's P V product (P in `p_last`), waited for.
  auto last_values = [&](const uint32_t* p_last) {
    const int last = num_key_tiles - 1;
    mbar_wait(&sm.v_full[last % kStages], (last / kStages) & 1);
    wgmma_fence();
    issue_values<kOp, kRowSums>(o, row_sums, p_last, v_tile(last % kStages), ones_desc);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(o);
  };

  // e4m3: O in fp32, in units of the max before the softmax whose rescale `rescale` is (`o` holds
  // one tile's P V product); 16-bit kernels: unused, O is `o`.
  float total[Traits::kFp8 ? 64 : 1];
#pragma unroll
  for (int i = 0; i < (Traits::kFp8 ? 64 : 1); ++i) total[i] = 0.f;
  // e4m3: O and l move to that softmax's max and take the finished product of its tile.
  auto add_product = [&](const float (&rescale)[2]) {
    if constexpr (Traits::kFp8) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        total[4 * j] = fmaf(total[4 * j], rescale[0], o[4 * j]);
        total[4 * j + 1] = fmaf(total[4 * j + 1], rescale[0], o[4 * j + 1]);
        total[4 * j + 2] = fmaf(total[4 * j + 2], rescale[1], o[4 * j + 2]);
        total[4 * j + 3] = fmaf(total[4 * j + 3], rescale[1], o[4 * j + 3]);
      }
      if constexpr (kRowSums) {
        fence_registers(row_sums);
        l[0] = fmaf(l[0], rescale[0], row_sums[0]);
        l[1] = fmaf(l[1], rescale[1], row_sums[2]);
      }
    }
  };

  if constexpr (!Traits::kFp8 || KVFUSE_PREFILL_FP8_OVERLAP) {
    static_assert(!Traits::kFp8 || kF16Scores, "KVFUSE_PREFILL_FP8_OVERLAP needs KVFUSE_PREFILL_FP8_SCORES_F16");
    // Key tile `it` >= 1: S of this tile together with P V of the previous one (P in `p_in`),
    // then this tile's softmax into `p_out` while the product runs. The two P buffers alternate
    // (the loop runs two tiles per trip) so that the softmax never writes registers the running
    // P V product reads. Once the product is done, the 16-bit kernels move O to the new max; the
    // e4m3 kernel adds the product to its fp32 O with the rescale owed from the softmax before.
    auto step = [&](int it, const uint32_t* p_in, uint32_t* p_out) {
      const int st = it % kStages, pst = (it - 1) % kStages;
      const KeyTile kt = tiles[it];
      await_turn(it);
      issue_scores<kOp>(s, q_desc, k_tile(st));
      wgmma_commit();
      issue_values<kOp, kRowSums>(o, row_sums, p_in, v_tile(pst), ones_desc);
      wgmma_commit();
      pass_turn(it);
      wgmma_wait<1>();  // S done; P V may still run
      fence_registers(s);
      if (lane == 0) mbar_arrive(&sm.k_empty[st]);
      const float owed[2] = {alpha[0], alpha[1]};
      softmax(kt, p_out);
      wgmma_wait<0>();
      fence_registers(o);
      if (lane == 0) mbar_arrive(&sm.v_empty[pst]);
      if constexpr (Traits::kFp8) {
        add_product(owed);
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          o[4 * j] *= alpha[0];
          o[4 * j + 1] *= alpha[0];
          o[4 * j + 2] *= alpha[1];
          o[4 * j + 3] *= alpha[1];
        }
      }
    };
    uint32_t pb[Traits::kPRegisters];
    int it = 1;
    for (; it + 1 < num_key_tiles; it += 2) {
      step(it, pa, pb);
      step(it + 1, pb, pa);
    }
    if (it < num_key_tiles) {
      step(it, pa, pb);
      last_values(pb);
    } else {
      last_values(pa);
    }
  } else {
    // e4m3 without the overlap: key tile `it` >= 1: P V of the previous tile, then S of this one;
    // the product is added to O while S runs, and this tile's softmax writes P once both are done.
    for (int it = 1; it < num_key_tiles; ++it) {
      const int st = it % kStages, pst = (it - 1) % kStages;
      const KeyTile kt = tiles[it];
      await_turn(it);
      issue_values<kOp, kRowSums>(o, row_sums, pa, v_tile(pst), ones_desc);
      wgmma_commit();
      issue_scores<kOp>(s, q_desc, k_tile(st));
      wgmma_commit();
      pass_turn(it);
      wgmma_wait<1>();  // P V done; S may still run
      fence_registers(o);
      if (lane == 0) mbar_arrive(&sm.v_empty[pst]);
      add_product(alpha);
      wgmma_wait<0>();
      fence_registers(s);
      if (lane == 0) mbar_arrive(&sm.k_empty[st]);
      softmax(kt, pa);
    }
    last_values(pa);
  }
  if constexpr (Traits::kFp8) {
    add_product(alpha);
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = total[i];  // the epilogue's O
  }

  // Epilogue: the quad's partial sums, the sink, the normalisation; rows past the sequence's
  // new tokens belong to no query and are not stored.
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if constexpr (kSums) {  // else each thread of the quad holds its rows' whole sums
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    float rescale = 1.f;
    if (p.sinks != nullptr) {
      // The sink is a logit of its own (unscaled), in P's units like every other term of l.
      const float sink = p.sinks[h] * kLog2e;
      const float m_final = fmaxf(m[r], sink);
      if (m_final != -INFINITY) {
        constexpr float kShift = Traits::kFp8 ? kFp8PShift : 0.f;
        rescale = fast_exp2(m[r] - m_final);
        l[r] = l[r] * rescale + fast_exp2(sink - m_final + kShift);
      }
    }
    inv[r] = l[r] > 0.f ? rescale * v_out / l[r] : 0.f;
  }
  T* out = static_cast<T*>(p.out);
  const int col0 = 2 * (lane & 3);
  if (Traits::kTmaStore && m0 + c * kConsumerRows + kConsumerRows <= q_len) {
    // Every product that read this consumer's 16-bit query tile has completed (its e4m3 kernel
    // read it only to quantize), so the tile takes O in the tensor map's layout: [half][64 rows]
    // [128 B], 16-byte chunks swizzled by the row's index mod 8.
    uint8_t* stage_o = sm.q + c * kQConsumerBytes;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = (r == 0 ? row_a : row_b) - c * kConsumerRows;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const uint32_t offset = (j / 8) * kQHalfBytes + row * 128 + (((j % 8) ^ (row % 8)) * 16) + 4 * (lane & 3);
        *reinterpret_cast<uint32_t*>(stage_o + offset) =
            pack_out(static_cast<T*>(nullptr), o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
      }
    }
    fence_shared_for_async_proxy();
    named_barrier_sync(3 + c, 128);
    if (ctid == 0) {
      for (int half = 0; half < 2; ++half) {
        tma_store_2d(&o_map, h * kHead + half * kSwizzleElems, q_start + m0 + c * kConsumerRows,
                     stage_o + half * kQHalfBytes);
      }
      bulk_commit();
      bulk_wait_read();
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r == 0 ? row_a : row_b;
    if (m0 + row >= q_len) continue;
    T* dst = out + static_cast<int64_t>(q_start + m0 + row) * p.stride_ot + h * p.stride_oh + col0;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      *reinterpret_cast<uint32_t*>(dst + 8 * j) =
          pack_out(static_cast<T*>(nullptr), o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
    }
  }
#else
  __trap();
#endif
}

// ---- host side

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult status;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault,
                                                    &status));
    TORCH_CHECK(status == cudaDriverEntryPointSuccess && entry != nullptr,
                "prefill_attention: the CUDA driver has no cuTensorMapEncodeTiled");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
  });
  return fn;
}

// A 2D tensor map over `rows` rows of `inner` elements (`row_bytes` apart) at `base`: boxes of
// `box_rows` rows by `box_inner` elements (128 bytes), 128-byte swizzle; rows past the end read
// as zeros.
CUtensorMap make_tensor_map(void* base, CUtensorMapDataType type, int64_t inner, int64_t rows, int64_t row_bytes,
                            uint32_t box_inner, uint32_t box_rows, const char* name) {
  TORCH_CHECK(row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0, "prefill_attention: ", name,
              " rows must start 16-byte aligned (", row_bytes, " bytes apart)");
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(std::max<int64_t>(rows, 1))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[2] = {box_inner, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&map, type, 2, base, dims, strides, box, elem_strides,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "prefill_attention: cuTensorMapEncodeTiled failed for ", name, " (CUresult ",
              static_cast<int>(r), ")");
  return map;
}

// `t` ([rows, heads, 128] 16-bit, heads contiguous) as [rows, heads * 128]: boxes of `box_rows`
// rows by 64 columns.
CUtensorMap head_rows_map(const at::Tensor& t, uint32_t box_rows, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.size(2) == kHead && t.stride(2) == 1 && t.stride(1) == kHead,
              "prefill_attention: ", name, " must be [rows, heads, 128] with contiguous heads, got sizes ", t.sizes(),
              " strides ", t.strides());
  const auto type = t.scalar_type() == at::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return make_tensor_map(t.data_ptr(), type, t.size(1) * kHead, t.size(0), t.stride(0) * t.element_size(),
                         kSwizzleElems, box_rows, name);
}

template <Operand kOp, typename T>
void launch(const dim3& grid, cudaStream_t stream, const CUtensorMap& q_map, const CUtensorMap& k_map,
            const CUtensorMap& v_map, const CUtensorMap& ck_map, const CUtensorMap& cv_map, const CUtensorMap& o_map,
            const PrefillParams& p) {
  constexpr size_t kBytes = shared_bytes<kOp>();
  static std::once_flag once;
  std::call_once(once, [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(prefill_attention_kernel<kOp, T>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kBytes)));
  });
  prefill_attention_kernel<kOp, T><<<grid, kThreads, kBytes, stream>>>(q_map, k_map, v_map, ck_map, cv_map, o_map, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// context_key / context_value: a 16-bit cache's gathered prefix or a decoded context ([rows,
// kv_heads, 128]), or an e4m3 cache's gathered codes: keys [rows, kv_heads, 128], values
// transposed [kv_heads * 128, columns] (new_in_context must hold; key / value are not read).
at::Tensor prefill_attention_cuda(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& context_key, const at::Tensor& context_value,
                                  int64_t context_stride, bool new_in_context, const at::Tensor& seq_lens,
                                  const at::Tensor& query_start_loc, const std::optional<at::Tensor>& sinks,
                                  const at::Tensor& k_scale, const at::Tensor& v_scale, bool scaled, double sm_scale,
                                  double factor, bool heads_fastest) {
  const c10::cuda::CUDAGuard guard(query.device());
  const int major = cached_device_attribute<cudaDevAttrComputeCapabilityMajor>();
  const int minor = cached_device_attribute<cudaDevAttrComputeCapabilityMinor>();
  TORCH_CHECK(major == 9 && minor == 0, "prefill_attention: built for sm_90 (Hopper), device is sm_", major, minor);
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kHalf,
              "prefill_attention: query must be bfloat16 or float16, got ", query.scalar_type());
  const bool fp8 = context_key.scalar_type() == at::kFloat8_e4m3fn;
  if (fp8) {
    TORCH_CHECK(new_in_context && context_value.scalar_type() == at::kFloat8_e4m3fn && context_value.dim() == 2,
                "prefill_attention: e4m3 codes take the whole context, values transposed [kv_heads * 128, columns]");
  } else {
    for (const at::Tensor* t : {&key, &value, &context_key, &context_value}) {
      TORCH_CHECK(t->scalar_type() == query.scalar_type(), "prefill_attention: K/V dtype ", t->scalar_type(),
                  " differs from the query's ", query.scalar_type());
    }
  }
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt,
              "prefill_attention: seq_lens and query_start_loc must be int32");
  TORCH_CHECK(query.dim() == 3 && query.size(2) == kHead, "prefill_attention: query must be [tokens, heads, 128]");
  const int64_t num_tokens = query.size(0), num_q_heads = query.size(1);
  const int64_t num_kv_heads = context_key.size(1), num_seqs = seq_lens.size(0);
  TORCH_CHECK(num_q_heads % num_kv_heads == 0 && (fp8 || key.size(1) == num_kv_heads), "prefill_attention: ",
              num_q_heads, " query heads over ", num_kv_heads, " KV heads");
  TORCH_CHECK(context_stride % kBlockN == 0 && context_stride > 0, "prefill_attention: context_stride=",
              context_stride, " must be a positive multiple of ", kBlockN);
  auto out = at::empty({num_tokens, num_q_heads, kHead}, query.options());
  if (num_tokens == 0 || num_seqs == 0) return out;
  TORCH_CHECK(num_tokens < (int64_t{1} << 31) && context_key.size(0) < (int64_t{1} << 31),
              "prefill_attention: row counts must fit int32");

  const CUtensorMap q_map = head_rows_map(query, kConsumerRows, "query");
  // Encoded only for the kernels that store through it (OperandTraits::kTmaStore).
  const bool tma_store = fp8 ? OperandTraits<Operand::kE4m3>::kTmaStore : OperandTraits<Operand::kBf16>::kTmaStore;
  const CUtensorMap o_map = tma_store ? head_rows_map(out, kConsumerRows, "out") : CUtensorMap{};
  CUtensorMap k_map, v_map, ck_map, cv_map;
  if (fp8) {
    TORCH_CHECK(context_key.dim() == 3 && context_key.size(2) == kHead && context_key.stride(2) == 1 &&
                    context_key.stride(1) == kHead && context_value.size(0) == num_kv_heads * kHead &&
                    context_value.stride(1) == 1,
                "prefill_attention: e4m3 keys must be [rows, kv_heads, 128] (heads contiguous), values [kv_heads * "
                "128, columns] with contiguous columns");
    ck_map = make_tensor_map(context_key.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, num_kv_heads * kHead,
                             context_key.size(0), context_key.stride(0), kHead, kBlockN, "context_key");
    cv_map = make_tensor_map(context_value.data_ptr(), CU_TENSOR_MAP_DATA_TYPE_UINT8, context_value.size(1),
                             context_value.size(0), context_value.stride(0), kBlockN, kHead, "context_value");
    k_map = ck_map;
    v_map = cv_map;
  } else {
    k_map = head_rows_map(key, kBlockN, "key");
    v_map = head_rows_map(value, kBlockN, "value");
    ck_map = head_rows_map(context_key, kBlockN, "context_key");
    cv_map = head_rows_map(context_value, kBlockN, "context_value");
  }

  PrefillParams p{};
  p.out = out.data_ptr();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.k_scale_stride = k_scale.numel() > 1 ? static_cast<int>(k_scale.stride(0)) : 0;
  p.v_scale_stride = v_scale.numel() > 1 ? static_cast<int>(v_scale.stride(0)) : 0;
  p.stride_ot = out.stride(0);
  p.stride_oh = out.stride(1);
  p.num_tokens = static_cast<int>(num_tokens);
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_q_heads = static_cast<int>(num_q_heads);
  p.group = static_cast<int>(num_q_heads / num_kv_heads);
  p.context_stride = static_cast<int>(context_stride);
  p.num_tiles = static_cast<int>(num_tokens / kBlockM + num_seqs);
  p.qk_scale = static_cast<float>(sm_scale) * kLog2e;
  p.factor = static_cast<float>(factor);
  p.scaled = scaled;
  p.new_in_context = new_in_context;
  p.heads_fastest = heads_fastest || p.num_tiles > 65535;  // grid.y's limit
  TORCH_CHECK(p.heads_fastest ? p.num_tiles <= 65535 : num_q_heads <= 65535,
              "prefill_attention: too many query tiles");

  const dim3 grid = p.heads_fastest ? dim3(num_q_heads, p.num_tiles) : dim3(p.num_tiles, num_q_heads);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool half = query.scalar_type() == at::kHalf;
  if (fp8 && half) {
    launch<Operand::kE4m3, __half>(grid, stream, q_map, k_map, v_map, ck_map, cv_map, o_map, p);
  } else if (fp8) {
    launch<Operand::kE4m3, __nv_bfloat16>(grid, stream, q_map, k_map, v_map, ck_map, cv_map, o_map, p);
  } else if (half) {
    launch<Operand::kFp16, __half>(grid, stream, q_map, k_map, v_map, ck_map, cv_map, o_map, p);
  } else {
    launch<Operand::kBf16, __nv_bfloat16>(grid, stream, q_map, k_map, v_map, ck_map, cv_map, o_map, p);
  }
  return out;
}

}  // namespace
}  // namespace kvfuse

TORCH_LIBRARY_FRAGMENT(kvfuse_native, m) {
  m.def("prefill_attention(Tensor query, Tensor key, Tensor value, Tensor context_key, Tensor context_value, "
        "int context_stride, bool new_in_context, Tensor seq_lens, Tensor query_start_loc, Tensor? sinks, "
        "Tensor k_scale, Tensor v_scale, bool scaled, float sm_scale, float factor, bool heads_fastest) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvfuse_native, CUDA, m) {
  m.impl("prefill_attention", TORCH_FN(kvfuse::prefill_attention_cuda));
}
