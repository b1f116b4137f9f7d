// Prefill attention on Hopper (sm_90a): new query tokens over their sequence's cached prefix and
// over themselves (causal), for head size 128, bf16 / fp16 operands, fp32 accumulation.
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
// tensors (a quantized cache's whole context, decoded into the query's dtype: then the scales
// apply, with `factor` NVFP4's 2^6).
//
// Work split, as FlashAttention-3 on Hopper: a block owns 128 query tokens of one sequence and
// one query head (GQA: head h reads KV head h / group; a group's blocks share K/V through L2)
// and runs three warpgroups. Warpgroup 0 is the producer: one thread issues tensor-map copies
// of the query tile and of each 128-key K and V tile into a two-stage ring in shared memory
// (128-byte swizzle, the layout wgmma reads), completing mbarriers. Warpgroups 1 and 2 are
// consumers with 64 query rows each: per key tile, S = Q K^T (wgmma m64n128k16, both operands in
// shared memory), the online softmax in registers, and O += P V (wgmma with P from registers:
// the accumulator layout of S is the A-operand layout, so P needs no shuffle). Within a
// consumer, the P V product of tile t - 1 is issued together with S of tile t and runs while
// the softmax of tile t waits for S; between consumers, named barriers take turns for issuing
// those products ("ping-pong"), so that one warpgroup's softmax overlaps the other's MMAs.
// The producer gives up registers (setmaxnreg) so that the consumers hold S, O and P (240 each).
//
// Key tiles in order: the diagonal tile of the new keys (masked: key i' <= i), the other new
// tiles from the diagonal down, then the prefix tiles from its end down (the last one masked
// where P is not a multiple of 128). Blocks are launched longest first (the reversed tile index).
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

namespace kvfuse {
namespace {

constexpr int kHead = 128;                // the head size this kernel is built for
constexpr int kBlockM = 128;              // query rows per block
constexpr int kBlockN = 128;              // keys per tile
constexpr int kConsumerRows = 64;         // query rows per consumer warpgroup
constexpr int kStages = 2;                // K (and V) tiles in flight
constexpr int kThreads = 384;             // producer + 2 consumer warpgroups
constexpr int kSwizzleElems = 64;         // 16-bit elements per 128-byte swizzled row
constexpr uint32_t kQHalfBytes = kConsumerRows * 128;    // 64 rows x 64 columns
constexpr uint32_t kQConsumerBytes = 2 * kQHalfBytes;    // one consumer's 64 x 128 query rows
constexpr uint32_t kKVHalfBytes = kBlockN * 128;         // 128 keys x 64 columns
constexpr uint32_t kKVTileBytes = 2 * kKVHalfBytes;      // 128 keys x 128 columns
constexpr uint32_t kSwizzleAtomBytes = 1024;             // 8 rows of 128 bytes
constexpr uint32_t kProducerRegisters = 24;
constexpr uint32_t kConsumerRegisters = 240;
constexpr float kLog2e = 1.4426950408889634f;

struct SharedStorage {
  // Each 64-column half of a tile is one tensor-map box: rows of 128 bytes, 128-byte swizzle.
  alignas(1024) uint8_t q[2 * kQConsumerBytes];     // [consumer][half][64 rows][128 B]
  alignas(1024) uint8_t k[kStages][kKVTileBytes];   // [half][128 keys][128 B]
  alignas(1024) uint8_t v[kStages][kKVTileBytes];
  uint64_t q_full;
  uint64_t k_full[kStages];
  uint64_t k_empty[kStages];
  uint64_t v_full[kStages];
  uint64_t v_empty[kStages];
};

constexpr size_t kSharedBytes = sizeof(SharedStorage) + 1024;  // + the base's alignment

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

// Key tile `it` of a block (the order in the file comment): whether it comes from the prefix, its
// first key (relative to its source's first row for this sequence), and its mask limit (keys
// with column <= limit are seen; kNoMask: all).
constexpr int kNoMask = 1 << 30;

struct KeyTile {
  bool prefix;
  int first;
};

__device__ __forceinline__ KeyTile key_tile(int it, int new_tiles, int prefix_tiles, int local) {
  if (it < new_tiles) return {false, (local - it) * kBlockN};
  return {true, (prefix_tiles - 1 - (it - new_tiles)) * kBlockN};
}

template <typename T>
struct Packed;
template <>
struct Packed<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <>
struct Packed<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

#if KVFUSE_HOPPER_MMA
// The online-softmax step of one consumer thread over a 64 x 128 score tile (its two rows:
// r = 16 w + g and r + 8). Masked keys (column > limit[row]) become -inf. Updates the running
// max m (log2 units) and the thread's partial row sums l (summed over the quad at the end),
// writes P packed as the next P V product's A operands, returns the accumulator's rescale.
template <typename T, bool kMasked>
__device__ __forceinline__ void softmax_tile(float (&s)[64], float (&m)[2], float (&l)[2], uint32_t (&p)[32],
                                             float (&alpha)[2], float qk_scale, int limit0, int limit1, int lane) {
  // Masked keys (column > limit of the row) read as -inf; s itself is left as it is (it is
  // the next S product's accumulator, which no instruction may write while P V runs).
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
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(score(j, 0, 0), score(j, 1, 0)));
    mx[1] = fmaxf(mx[1], fmaxf(score(j, 0, 1), score(j, 1, 1)));
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(m[r], mx[r] * qk_scale);
    // A row without a seen key so far keeps m = -inf: shift by 0 rather than compute inf - inf.
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = fast_exp2(m[r] - m_use);
    m[r] = m_new;
    mx[r] = -m_use;  // the shift, reused below
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float p0 = fast_exp2(fmaf(score(j, 0, 0), qk_scale, mx[0]));
    const float p1 = fast_exp2(fmaf(score(j, 1, 0), qk_scale, mx[0]));
    const float p2 = fast_exp2(fmaf(score(j, 0, 1), qk_scale, mx[1]));
    const float p3 = fast_exp2(fmaf(score(j, 1, 1), qk_scale, mx[1]));
    sum[0] += p0 + p1;
    sum[1] += p2 + p3;
    // Column pair 8j + 2t of rows r, r + 8: A-operand registers 2j, 2j + 1 (the k-step j / 2).
    p[2 * j] = Packed<T>::pack(p0, p1);
    p[2 * j + 1] = Packed<T>::pack(p2, p3);
  }
  l[0] = l[0] * alpha[0] + sum[0];
  l[1] = l[1] * alpha[1] + sum[1];
}

// S = Q K^T for one consumer: Q (64 x 128) and the K tile (128 x 128) are both K-major in shared
// memory: a k-step of 16 columns starts 32 bytes further into the 128-byte swizzled rows, and the
// head's second 64 columns are the tile's second half; 8-row swizzle atoms are 1024 bytes apart.
template <bool kHalf>
__device__ __forceinline__ void issue_scores(float (&s)[64], uint32_t q_base, uint32_t k_base) {
  using namespace hopper;
#pragma unroll
  for (int kk = 0; kk < kHead / 16; ++kk) {
    const uint32_t column_bytes = (kk % 4) * 32;
    const uint64_t da = swizzle128_desc(q_base + (kk / 4) * kQHalfBytes + column_bytes, 16, kSwizzleAtomBytes);
    const uint64_t db = swizzle128_desc(k_base + (kk / 4) * kKVHalfBytes + column_bytes, 16, kSwizzleAtomBytes);
    wgmma_m64n128k16_ss<kHalf, 0>(s, da, db, kk > 0);
  }
}

// O += P V: P from registers (packed by softmax_tile), the V tile N-major (the head dimension
// contiguous): a k-step of 16 keys is two 8-row atoms (2048 bytes) on, and the head's second 64
// columns, the N side's next atom, the tile's other half.
template <bool kHalf>
__device__ __forceinline__ void issue_values(float (&o)[64], const uint32_t (&pa)[32], uint32_t v_base) {
  using namespace hopper;
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    const uint64_t db = swizzle128_desc(v_base + kk * 2 * kSwizzleAtomBytes, kKVHalfBytes, kSwizzleAtomBytes);
    const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
    wgmma_m64n128k16_rs<kHalf, 1>(o, a, db);
  }
}
#endif

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_attention_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                             const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap ck_map,
                             const __grid_constant__ CUtensorMap cv_map, const PrefillParams p) {
#if KVFUSE_HOPPER_MMA
  using namespace hopper;
  constexpr bool kHalf = std::is_same<T, __half>::value;
  extern __shared__ uint8_t smem_raw[];
  SharedStorage& sm = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));

  const int grid_tile = p.heads_fastest ? blockIdx.y : blockIdx.x;
  const int h = p.heads_fastest ? blockIdx.x : blockIdx.y;
  const int tile = p.num_tiles - 1 - grid_tile;  // longest first
  const int kvh = h / p.group;
  const int tid = threadIdx.x;

  // Rows outside every sequence ([0, qsl[0]) and [qsl[num_seqs], num_tokens)) are zeros, as in
  // the Triton kernel; each block clears its own head's share of its grid tile's row range.
  {
    const int first_row = p.query_start_loc[0], end_row = p.query_start_loc[p.num_seqs];
    const int r0 = grid_tile * kBlockM;
    if (r0 < p.num_tokens && (r0 < first_row || r0 + kBlockM > end_row)) {
      T* out = static_cast<T*>(p.out);
      for (int i = tid; i < kBlockM * (kHead / 8); i += kThreads) {
        const int row = r0 + i / (kHead / 8);
        if (row < p.num_tokens && (row < first_row || row >= end_row)) {
          *reinterpret_cast<uint4*>(out + row * p.stride_ot + h * p.stride_oh + (i % (kHead / 8)) * 8) =
              make_uint4(0, 0, 0, 0);
        }
      }
    }
  }

  int b, q_start, q_len, local;
  tile_sequence(p.query_start_loc, p.num_seqs, tile, b, q_start, q_len, local);
  const int prefix = p.seq_lens[b] - q_len;
  // Metadata with fewer cached positions than new tokens (refused by the op's checks) leaves
  // its rows unwritten here as in the Triton kernel's early exit.
  if (local < 0 || local * kBlockM >= q_len || prefix < 0) return;
  const int m0 = local * kBlockM;
  const int new_tiles = local + 1;
  const int prefix_tiles = (prefix + kBlockN - 1) / kBlockN;
  const int num_key_tiles = new_tiles + prefix_tiles;
  const int context_row0 = b * p.context_stride;
  const int new_row0 = p.new_in_context ? context_row0 + prefix : q_start;

  const int warpgroup = tid / 128;
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
      const CUtensorMap* new_k = p.new_in_context ? &ck_map : &k_map;
      const CUtensorMap* new_v = p.new_in_context ? &cv_map : &v_map;
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
        const KeyTile kt = key_tile(it, new_tiles, prefix_tiles, local);
        const int row = (kt.prefix ? context_row0 : new_row0) + kt.first;
        mbar_wait(&sm.k_empty[s], parity);
        mbar_arrive_expect_tx(&sm.k_full[s], kKVTileBytes);
        for (int half = 0; half < 2; ++half) {
          tma_load_2d(sm.k[s] + half * kKVHalfBytes, kt.prefix ? &ck_map : new_k, kvh * kHead + half * kSwizzleElems,
                      row, &sm.k_full[s]);
        }
        mbar_wait(&sm.v_empty[s], parity);
        mbar_arrive_expect_tx(&sm.v_full[s], kKVTileBytes);
        for (int half = 0; half < 2; ++half) {
          tma_load_2d(sm.v[s] + half * kKVHalfBytes, kt.prefix ? &cv_map : new_v, kvh * kHead + half * kSwizzleElems,
                      row, &sm.v_full[s]);
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

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float s[64];
  uint32_t pa[32];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  const uint32_t q_base = smem_addr(sm.q + c * kQConsumerBytes);
  mbar_wait(&sm.q_full, 0);
  if (c == 1) named_barrier_arrive(1, 256);

  // Key tile 0 (the diagonal): S only, nothing to add to O yet.
  mbar_wait(&sm.k_full[0], 0);
  named_barrier_sync(my_turn, 256);
  wgmma_fence();
  issue_scores<kHalf>(s, q_base, smem_addr(sm.k[0]));
  wgmma_commit();
  if (!(c == 1 && num_key_tiles == 1)) named_barrier_arrive(other_turn, 256);
  wgmma_wait<0>();
  fence_registers(s);
  if (lane == 0) mbar_arrive(&sm.k_empty[0]);
  {
    float alpha[2];
    softmax_tile<T, true>(s, m, l, pa, alpha, qk_scale, row_a, row_b, lane);
  }

  // Key tile `it` >= 1: S of this tile together with P V of the previous one (P in `p_in`),
  // then this tile's softmax into `p_out`. The two P buffers alternate (the loop runs two tiles
  // per trip) so that the softmax never writes registers the running P V product reads.
  auto step = [&](int it, const uint32_t(&p_in)[32], uint32_t(&p_out)[32]) {
    const int st = it % kStages, pst = (it - 1) % kStages;
    const KeyTile kt = key_tile(it, new_tiles, prefix_tiles, local);
    mbar_wait(&sm.k_full[st], (it / kStages) & 1);
    mbar_wait(&sm.v_full[pst], ((it - 1) / kStages) & 1);
    named_barrier_sync(my_turn, 256);
    wgmma_fence();
    issue_scores<kHalf>(s, q_base, smem_addr(sm.k[st]));
    wgmma_commit();
    issue_values<kHalf>(o, p_in, smem_addr(sm.v[pst]));
    wgmma_commit();
    if (!(c == 1 && it == num_key_tiles - 1)) named_barrier_arrive(other_turn, 256);
    wgmma_wait<1>();  // S done; P V may still run
    fence_registers(s);
    if (lane == 0) mbar_arrive(&sm.k_empty[st]);
    float alpha[2];
    if (kt.prefix && kt.first + kBlockN > prefix) {
      const int limit = prefix - kt.first - 1;
      softmax_tile<T, true>(s, m, l, p_out, alpha, qk_scale, limit, limit, lane);
    } else {
      softmax_tile<T, false>(s, m, l, p_out, alpha, qk_scale, kNoMask, kNoMask, lane);
    }
    wgmma_wait<0>();
    fence_registers(o);
    if (lane == 0) mbar_arrive(&sm.v_empty[pst]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      o[4 * j] *= alpha[0];
      o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1];
      o[4 * j + 3] *= alpha[1];
    }
  };
  auto last_values = [&](const uint32_t(&p_last)[32]) {
    const int last = num_key_tiles - 1;
    mbar_wait(&sm.v_full[last % kStages], (last / kStages) & 1);
    wgmma_fence();
    issue_values<kHalf>(o, p_last, smem_addr(sm.v[last % kStages]));
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(o);
  };
  uint32_t pb[32];
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

  // Epilogue: the quad's partial sums, the sink, the normalisation; rows past the sequence's
  // new tokens belong to no query and are not stored.
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    float rescale = 1.f;
    if (p.sinks != nullptr) {
      const float sink = p.sinks[h] * kLog2e;
      const float m_final = fmaxf(m[r], sink);
      if (m_final != -INFINITY) {
        rescale = fast_exp2(m[r] - m_final);
        l[r] = l[r] * rescale + fast_exp2(sink - m_final);
      }
    }
    inv[r] = l[r] > 0.f ? rescale * v_out / l[r] : 0.f;
  }
  T* out = static_cast<T*>(p.out);
  const int col0 = 2 * (lane & 3);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r == 0 ? row_a : row_b;
    if (m0 + row >= q_len) continue;
    T* dst = out + static_cast<int64_t>(q_start + m0 + row) * p.stride_ot + h * p.stride_oh + col0;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      *reinterpret_cast<uint32_t*>(dst + 8 * j) = Packed<T>::pack(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
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

// A 2D tensor map over `t` ([rows, heads, 128], rows 16-byte aligned) seen as [rows, heads * 128]:
// boxes of `box_rows` rows by 64 columns, 128-byte swizzle.
CUtensorMap make_tensor_map(const at::Tensor& t, uint32_t box_rows, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.size(2) == kHead && t.stride(2) == 1 && t.stride(1) == kHead,
              "prefill_attention: ", name, " must be [rows, heads, 128] with contiguous heads, got sizes ", t.sizes(),
              " strides ", t.strides());
  TORCH_CHECK((t.stride(0) * t.element_size()) % 16 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "prefill_attention: ", name, " rows must start 16-byte aligned (stride ", t.stride(0), ")");
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(t.size(1) * kHead),
                              static_cast<cuuint64_t>(std::max<int64_t>(t.size(0), 1))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(t.stride(0) * t.element_size())};
  const cuuint32_t box[2] = {kSwizzleElems, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, t.scalar_type() == at::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
      t.data_ptr(), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "prefill_attention: cuTensorMapEncodeTiled failed for ", name, " (CUresult ",
              static_cast<int>(r), ")");
  return map;
}

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
  for (const at::Tensor* t : {&key, &value, &context_key, &context_value}) {
    TORCH_CHECK(t->scalar_type() == query.scalar_type(), "prefill_attention: K/V dtype ", t->scalar_type(),
                " differs from the query's ", query.scalar_type());
  }
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt,
              "prefill_attention: seq_lens and query_start_loc must be int32");
  const int64_t num_tokens = query.size(0), num_q_heads = query.size(1);
  const int64_t num_kv_heads = key.size(1), num_seqs = seq_lens.size(0);
  TORCH_CHECK(num_q_heads % num_kv_heads == 0 && context_key.size(1) == num_kv_heads,
              "prefill_attention: ", num_q_heads, " query heads over ", num_kv_heads, " KV heads");
  TORCH_CHECK(context_stride % kBlockN == 0 && context_stride > 0, "prefill_attention: context_stride=",
              context_stride, " must be a positive multiple of ", kBlockN);
  auto out = at::empty({num_tokens, num_q_heads, kHead}, query.options());
  if (num_tokens == 0 || num_seqs == 0) return out;
  TORCH_CHECK(num_tokens < (int64_t{1} << 31) && context_key.size(0) < (int64_t{1} << 31),
              "prefill_attention: row counts must fit int32");

  const CUtensorMap q_map = make_tensor_map(query, kConsumerRows, "query");
  const CUtensorMap k_map = make_tensor_map(key, kBlockN, "key");
  const CUtensorMap v_map = make_tensor_map(value, kBlockN, "value");
  const CUtensorMap ck_map = make_tensor_map(context_key, kBlockN, "context_key");
  const CUtensorMap cv_map = make_tensor_map(context_value, kBlockN, "context_value");

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
  if (query.scalar_type() == at::kHalf) {
    static std::once_flag once;
    std::call_once(once, [] {
      C10_CUDA_CHECK(cudaFuncSetAttribute(prefill_attention_kernel<__half>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes));
    });
    prefill_attention_kernel<__half><<<grid, kThreads, kSharedBytes, stream>>>(q_map, k_map, v_map, ck_map, cv_map, p);
  } else {
    static std::once_flag once;
    std::call_once(once, [] {
      C10_CUDA_CHECK(cudaFuncSetAttribute(prefill_attention_kernel<__nv_bfloat16>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes));
    });
    prefill_attention_kernel<__nv_bfloat16>
        <<<grid, kThreads, kSharedBytes, stream>>>(q_map, k_map, v_map, ck_map, cv_map, p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
