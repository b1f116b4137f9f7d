// CUDA kernels of kvfuse's cache ops: encode K/V rows (cast, FP8, NVFP4) and scatter them
// into a paged cache (num_blocks, 2, block_size, heads, row_dim) in one pass.
//
// One kernel shape serves every op: a 2-D thread block holds blockDim.y tokens, and the
// blockDim.x threads of a token stride over its (half, head, chunk) work items. A chunk is
// 16 bytes of input where the layout allows it (8 elements for cast / FP8, one 16-element
// NVFP4 block) and one element otherwise, so odd head sizes and unaligned views still work.
//
// Numerics (bit-identical to kvfuse/ops/reference.py, see csrc/encode_math.h):
//   - cast: c10's float -> half / bfloat16 conversions, the ones torch's .to() uses;
//   - FP8: q = x / scale (IEEE division; this file must never be built with fast math), then
//     the saturating hardware convert cvt.rn.satfinite, which equals clamp(q, -max, max)
//     followed by round-to-nearest-even (both send |q| beyond the largest finite value to
//     it, inf included); NaN keeps its sign bit as c10's conversion does;
//   - NVFP4: the reference's float32 math per 16-block, E2M1 rounding in software.
// Slots equal to -1 (and, instead of a fault, slots beyond the cache) are skipped.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "../cache_write.h"
#include "../encode_math.h"

namespace kvfuse {
namespace {

constexpr int kThreads = 256;

// Byte strides throughout: the same kernel moves bf16, fp8 and packed NVFP4 rows.
struct RowParams {
  const char* src[2];
  int64_t src_tok[2];
  int64_t src_head[2];
  char* dst;
  int64_t dst_block, dst_kv, dst_off, dst_head;
  int64_t block_size;
  int64_t capacity;
  const void* slots;  // nullptr: token t writes row t (encode_kv's output)
  const float* scale[2];
  int slots64;
  int num_tokens, num_heads, chunks, halves;
  int head_size;
  int store_width;  // NVFP4 packed-data store: 8, 4 or 1 bytes at a time
};

struct E4M3 {};
struct E5M2 {};
template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>;

template <int W>
struct Word;
template <> struct Word<16> { using type = uint4; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<4> { using type = uint32_t; };
template <> struct Word<2> { using type = uint16_t; };
template <> struct Word<1> { using type = uint8_t; };

// x / d rounded to nearest even, bit for bit what div.rn.f32 (and so torch) computes, in three
// FMA-pipe ops instead of div.rn's ~10: with r = rn(1/d), q0 = x*r is within an ulp, the
// residual fma(-q0, d, x) is exact, and one correction step q0 + e*r rounds correctly
// (Markstein) as long as nothing over- or underflows. Hence the fast path only for normal
// |d| in [2^-100, 2^100]; beyond 1e30 (where every format saturates) q0 is kept, as it is
// where the corrected value is zero (q0 holds the sign of a tiny quotient). The quotient is
// the correctly rounded one, as the Triton kernels' div_rn and the reference compute it.
struct Divider {
  float d, r;
  bool fast;
};

__device__ __forceinline__ Divider make_divider(float d) {
  const float a = fabsf(d);
  const bool fast = a >= 0x1p-100f && a <= 0x1p100f;
  return Divider{d, fast ? __frcp_rn(d) : 0.0f, fast};
}

__device__ __forceinline__ float divide(float x, const Divider v) {
  if (v.fast) {
    const float q0 = __fmul_rn(x, v.r);
    const float q1 = __fmaf_rn(__fmaf_rn(-q0, v.d, x), v.r, q0);
    return (q1 == 0.0f || fabsf(q0) > 1e30f) ? q0 : q1;
  }
  return __fdiv_rn(x, v.d);
}

// One work item: chunk c of head h of the key (half 0) or value (half 1) rows.
struct Item {
  int half, head, chunk;
};

__device__ __forceinline__ Item locate(int i, int per_half, int chunks) {
  const int half = i >= per_half ? 1 : 0;
  const int r = i - half * per_half;
  const int head = r / chunks;
  return Item{half, head, r - head * chunks};
}

template <class Op, int U>
__device__ __forceinline__ void load_item(typename Op::Raw (&raw)[U], const RowParams& p, const Item& it,
                                          const int (&tok)[U]) {
  const char* src = p.src[it.half] + it.head * p.src_head[it.half];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (tok[u] < p.num_tokens) raw[u] = Op::load(src + tok[u] * p.src_tok[it.half], it.chunk);
  }
}

// U tokens per thread row: all their loads are issued before any convert or store, so each
// thread keeps U 16-byte loads in flight (large token counts only; decode uses U = 1 to
// spread a few tokens over more SMs). The first item's rows are loaded together with the
// slots, not after them: the row loads do not depend on the slots, so the two memory
// latencies overlap instead of adding up (rows of padding tokens are read and dropped).
template <class Op, int U>
__global__ void __launch_bounds__(kThreads, Op::kMinBlocks) rows_kernel(const RowParams p) {
  const int t_base = blockIdx.x * (blockDim.y * U) + threadIdx.y;
  const int per_half = p.num_heads * p.chunks;
  const int items = p.halves * per_half;
  int tok[U];
  int64_t slot[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int t = t_base + u * static_cast<int>(blockDim.y);
    tok[u] = t;
    slot[u] = -1;
    if (t < p.num_tokens) {
      slot[u] = p.slots == nullptr ? t
                : p.slots64        ? static_cast<const int64_t*>(p.slots)[t]
                                   : static_cast<const int32_t*>(p.slots)[t];
    }
  }
  typename Op::Raw raw[U];
  Item item = locate(threadIdx.x, per_half, p.chunks);
  if (static_cast<int>(threadIdx.x) < items) load_item<Op, U>(raw, p, item, tok);

  char* dst_tok[U];
  bool any = false;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    dst_tok[u] = nullptr;
    if (slot[u] >= 0 && slot[u] < p.capacity) {
      int64_t block, off;
      if (p.capacity <= INT32_MAX) {  // 32-bit division is several times cheaper
        const uint32_t s32 = static_cast<uint32_t>(slot[u]), bs = static_cast<uint32_t>(p.block_size);
        block = s32 / bs;
        off = s32 - static_cast<uint32_t>(block) * bs;
      } else {
        block = slot[u] / p.block_size;
        off = slot[u] - block * p.block_size;
      }
      dst_tok[u] = p.dst + block * p.dst_block + off * p.dst_off;
      any = true;
    }
  }
  if (!any) return;
  // Two values, not an array: a runtime-indexed array would live in local memory.
  Divider div_k{1.0f, 1.0f, true}, div_v{1.0f, 1.0f, true};
  if constexpr (Op::kUsesScale) {
    div_k = make_divider(__ldg(p.scale[0]));
    div_v = make_divider(__ldg(p.scale[1]));
  }
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    if (i != static_cast<int>(threadIdx.x)) {
      item = locate(i, per_half, p.chunks);
      load_item<Op, U>(raw, p, item, tok);
    }
    const int64_t dst_row = item.half * p.dst_kv + item.head * p.dst_head;
    // Selected by value: a reference to either would take their address and put both in
    // local memory (seen as a 24-byte stack frame in ptxas -v).
    const Divider div = item.half ? div_v : div_k;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (dst_tok[u] != nullptr) Op::store(raw[u], dst_tok[u] + dst_row, item.chunk, div, p);
    }
  }
}

// ----------------------------------------------------------------------------- row ops
// Each op: Raw (the registers one work item loads), load(src_row, chunk), store(raw, dst_row,
// chunk, divider, params); kMinBlocks, the resident blocks per SM its register budget is set
// for (4: at most 64 registers, the occupancy that keeps enough bytes in flight for the
// memory-bound ops); kUnroll, the tokens per thread at large token counts.

template <int W>
struct CopyOp {
  static constexpr bool kUsesScale = false;
  static constexpr int kMinBlocks = 4;
  static constexpr int kUnroll = 4;
  using Raw = typename Word<W>::type;
  __device__ __forceinline__ static Raw load(const char* s, int c) { return reinterpret_cast<const Raw*>(s)[c]; }
  __device__ __forceinline__ static void store(const Raw& raw, char* d, int c, const Divider, const RowParams&) {
    reinterpret_cast<Raw*>(d)[c] = raw;
  }
};

// N input elements, loaded as whole 16-byte words when kVector.
template <typename In, int N, bool kVector>
struct Elements {
  static constexpr int kWords = kVector ? static_cast<int>(N * sizeof(In) / 16) : 0;
  union {
    uint4 words[kWords > 0 ? kWords : 1];
    In e[N];
  };
  __device__ __forceinline__ Elements() {}
  __device__ __forceinline__ static Elements load(const char* s, int c) {
    Elements out;
    const In* p = reinterpret_cast<const In*>(s) + static_cast<int64_t>(c) * N;
    if constexpr (kVector) {
      static_assert((N * sizeof(In)) % 16 == 0, "vector loads move whole 16-byte words");
#pragma unroll
      for (int w = 0; w < kWords; ++w) out.words[w] = reinterpret_cast<const uint4*>(p)[w];
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) out.e[k] = p[k];
    }
    return out;
  }
  __device__ __forceinline__ float operator[](int k) const { return static_cast<float>(e[k]); }
};

__device__ __forceinline__ uint8_t fix_nan(uint8_t bits, float q) {
  // The hardware writes its canonical NaN; c10 (and so the reference) keeps the sign.
  return isnan(q) ? static_cast<uint8_t>(0x7F | (signbit(q) ? 0x80 : 0)) : bits;
}

// Four quotients as four FP8 bytes of one word. The saturating convert sends finite overflow and
// inf to the largest finite value, so a byte whose low seven bits are all ones came from NaN;
// those get the sign bit of their quotient (as fix_nan does) in a rarely taken branch, and the
// common path pays a few word-wide operations per four values instead of a test per value.
template <typename Fp8>
__device__ __forceinline__ uint32_t fp8x4(float q0, float q1, float q2, float q3) {
  constexpr __nv_fp8_interpretation_t kInterp = std::is_same_v<Fp8, E4M3> ? __NV_E4M3 : __NV_E5M2;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(q0, q1), __NV_SATFINITE, kInterp);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(q2, q3), __NV_SATFINITE, kInterp);
  const uint32_t bytes = __byte_perm(lo, hi, 0x5410);
  const uint32_t low7_clear = ~bytes & 0x7F7F7F7Fu;  // 0 exactly in the NaN bytes
  const uint32_t is_nan = ~(low7_clear + 0x7F7F7F7Fu) & 0x80808080u;  // no carry crosses a byte
  if (__builtin_expect(is_nan == 0, 1)) return bytes;
  const uint32_t signs = __byte_perm(__byte_perm(__float_as_uint(q0), __float_as_uint(q1), 0x0073),
                                     __byte_perm(__float_as_uint(q2), __float_as_uint(q3), 0x0073), 0x5410);
  return (bytes & ~is_nan) | (signs & is_nan);
}

template <typename In, typename Out, int N>
struct EncodeOp {
  static constexpr bool kUsesScale = kIsFp8<Out>;
  // float32 input holds twice the registers per token in flight; at 64 the compiler spills.
  static constexpr int kMinBlocks = sizeof(In) > 2 && kIsFp8<Out> ? 3 : 4;
  // Four tokens per thread: measured on the H100 (FP8, 65536 tokens) 193 us, against 214 us with
  // two tokens and 229 us with one.
  static constexpr int kUnroll = 4;
  static constexpr bool kVector = N > 1;
  using Raw = Elements<In, N, kVector>;
  __device__ __forceinline__ static Raw load(const char* s, int c) { return Raw::load(s, c); }
  __device__ __forceinline__ static void store(const Raw& f, char* d, int c, const Divider div, const RowParams&) {
    if constexpr (kIsFp8<Out>) {
      uint8_t* out = reinterpret_cast<uint8_t*>(d) + static_cast<int64_t>(c) * N;
      if constexpr (N == 1) {
        const float q = divide(f[0], div);
        constexpr __nv_fp8_interpretation_t kInterp = std::is_same_v<Out, E4M3> ? __NV_E4M3 : __NV_E5M2;
        out[0] = fix_nan(static_cast<uint8_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, kInterp)), q);
      } else {
        static_assert(N == 8, "one 8-byte store per chunk");
        float q[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = divide(f[k], div);
        *reinterpret_cast<uint2*>(out) = make_uint2(fp8x4<Out>(q[0], q[1], q[2], q[3]), fp8x4<Out>(q[4], q[5], q[6], q[7]));
      }
    } else {
      Out* out = reinterpret_cast<Out*>(d) + static_cast<int64_t>(c) * N;
      if constexpr (kVector && (N * sizeof(Out)) % 16 == 0) {
        constexpr int kPerWord = 16 / sizeof(Out);
#pragma unroll
        for (int w = 0; w < N / kPerWord; ++w) {
          uint4 word;
          Out* e = reinterpret_cast<Out*>(&word);
#pragma unroll
          for (int k = 0; k < kPerWord; ++k) e[k] = static_cast<Out>(f[w * kPerWord + k]);
          reinterpret_cast<uint4*>(out)[w] = word;
        }
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = static_cast<Out>(f[k]);
      }
    }
  }
};

__device__ __forceinline__ uint8_t e4m3_rne(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// One 16-element NVFP4 block per work item: 8 packed bytes + 1 block-scale byte.
template <typename In, bool kVector>
struct Nvfp4Op {
  static constexpr bool kUsesScale = true;
  // The per-block math needs ~70 registers; at 64 the compiler spills.
  static constexpr int kMinBlocks = 3;
  static constexpr int kUnroll = 1;
  using Raw = Elements<In, kNvfp4Block, kVector>;
  __device__ __forceinline__ static Raw load(const char* s, int c) { return Raw::load(s, c); }
  __device__ __forceinline__ static void store(const Raw& f, char* d, int c, const Divider global,
                                               const RowParams& p) {
    // NaN encodes as +0 and is ignored by amax: zero it once, so neither loop below tests it.
    float x[kNvfp4Block];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < kNvfp4Block; ++k) {
      x[k] = isnan(f[k]) ? 0.0f : f[k];
      amax = fmaxf(amax, fabsf(x[k]));
    }
    float denom;
    const uint8_t scale_bits = nvfp4_block_scale(amax, global.d, [](float v) { return e4m3_rne(v); }, &denom);
    const Divider div = make_divider(denom > 0.0f ? denom : 1.0f);
    // A block whose divisor is not > 0 encodes all-zero codes (the reference's q = 0).
    const uint32_t keep = denom > 0.0f ? 0xFFFFFFFFu : 0u;
    uint32_t packed[2] = {0u, 0u};
#pragma unroll
    for (int k = 0; k < kNvfp4Block; ++k) {
      packed[k / 8] |= static_cast<uint32_t>(e2m1_code(divide(x[k], div))) << (4 * (k % 8));
    }
    packed[0] &= keep;
    packed[1] &= keep;
    char* data = d + static_cast<int64_t>(c) * (kNvfp4Block / 2);
    if (p.store_width == 8) {
      *reinterpret_cast<uint2*>(data) = make_uint2(packed[0], packed[1]);
    } else if (p.store_width == 4) {
      reinterpret_cast<uint32_t*>(data)[0] = packed[0];
      reinterpret_cast<uint32_t*>(data)[1] = packed[1];
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) data[k] = static_cast<char>((packed[k / 4] >> (8 * (k % 4))) & 0xFF);
    }
    d[p.head_size / 2 + c] = static_cast<char>(scale_bits);
  }
};

// ----------------------------------------------------------------------------- launch

template <class Op, int U>
void launch_unrolled(const RowParams& p, int tx, int ty, cudaStream_t stream) {
  const dim3 grid((p.num_tokens + ty * U - 1) / (ty * U));
  rows_kernel<Op, U><<<grid, dim3(tx, ty), 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Blocks below which an unrolled grid would leave SMs idle (132 SMs x 8 resident blocks).
constexpr int kWideGrid = 1024;

template <class Op, bool kUnroll = true>
void launch(const RowParams& p, cudaStream_t stream) {
  const int items = p.halves * p.num_heads * p.chunks;
  int tx = 1;
  while (tx < items && tx < kThreads) tx <<= 1;
  const int ty = kThreads / tx;
  if constexpr (kUnroll && Op::kUnroll > 1) {
    if (p.num_tokens / (ty * Op::kUnroll) >= kWideGrid) return launch_unrolled<Op, Op::kUnroll>(p, tx, ty, stream);
  }
  launch_unrolled<Op, 1>(p, tx, ty, stream);
}

bool aligned(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

bool all_multiples(std::initializer_list<int64_t> values, int64_t of) {
  for (const int64_t v : values) {
    if (v % of) return false;
  }
  return true;
}

bool src_aligned(const RowParams& p, int64_t bytes) {
  for (int h = 0; h < p.halves; ++h) {
    if (!aligned(p.src[h], bytes) || !all_multiples({p.src_tok[h], p.src_head[h]}, bytes)) return false;
  }
  return true;
}

bool dst_aligned(const RowParams& p, int64_t bytes) {
  return aligned(p.dst, bytes) && all_multiples({p.dst_block, p.dst_kv, p.dst_off, p.dst_head}, bytes);
}

// Copies rows of row_bytes: the widest word that every pointer, stride and the row allow.
void launch_copy(RowParams p, int64_t row_bytes, cudaStream_t stream) {
  for (const int w : {16, 8, 4, 2, 1}) {
    if (row_bytes % w || !src_aligned(p, w) || !dst_aligned(p, w)) continue;
    p.chunks = static_cast<int>(row_bytes / w);
    switch (w) {
      case 16: return launch<CopyOp<16>>(p, stream);
      case 8: return launch<CopyOp<8>>(p, stream);
      case 4: return launch<CopyOp<4>>(p, stream);
      case 2: return launch<CopyOp<2>>(p, stream);
      default: return launch<CopyOp<1>>(p, stream);
    }
  }
}

template <typename In, typename Out>
void launch_encode_to(RowParams p, cudaStream_t stream) {
  constexpr int64_t kOutBytes = kIsFp8<Out> ? 1 : sizeof(Out);
  constexpr int64_t kDstAlign = 8 * kOutBytes < 16 ? 8 * kOutBytes : 16;
  if (p.head_size % 8 == 0 && src_aligned(p, 16) && dst_aligned(p, kDstAlign)) {
    p.chunks = p.head_size / 8;
    launch<EncodeOp<In, Out, 8>>(p, stream);
  } else {
    p.chunks = p.head_size;
    launch<EncodeOp<In, Out, 1>, false>(p, stream);
  }
}

template <typename In>
void launch_encode_from(RowParams p, int64_t mode, at::ScalarType out, cudaStream_t stream) {
  switch (mode) {
    case 1: return launch_encode_to<In, E4M3>(p, stream);
    case 2: return launch_encode_to<In, E5M2>(p, stream);
    case 3: {
      p.chunks = p.head_size / kNvfp4Block;
      p.store_width = dst_aligned(p, 8) ? 8 : dst_aligned(p, 4) ? 4 : 1;
      // No token unrolling: the per-block math needs the registers more than extra loads in flight.
      if (src_aligned(p, 16)) return launch<Nvfp4Op<In, true>, false>(p, stream);
      return launch<Nvfp4Op<In, false>, false>(p, stream);
    }
    default:
      switch (out) {
        case at::ScalarType::Float: return launch_encode_to<In, float>(p, stream);
        case at::ScalarType::Half: return launch_encode_to<In, c10::Half>(p, stream);
        case at::ScalarType::BFloat16: return launch_encode_to<In, c10::BFloat16>(p, stream);
        default: TORCH_CHECK_VALUE(false, "cannot cast to ", out);
      }
  }
}

// Encodes (or, when nothing changes, copies) rows of key/value into p.dst.
void launch_encode(RowParams p, at::ScalarType in, int64_t mode, at::ScalarType out, cudaStream_t stream) {
  if (mode == 0 && in == out) {
    return launch_copy(p, p.head_size * static_cast<int64_t>(c10::elementSize(out)), stream);
  }
  switch (in) {
    case at::ScalarType::Float: return launch_encode_from<float>(p, mode, out, stream);
    case at::ScalarType::Half: return launch_encode_from<c10::Half>(p, mode, out, stream);
    case at::ScalarType::BFloat16: return launch_encode_from<c10::BFloat16>(p, mode, out, stream);
    default: TORCH_CHECK_VALUE(false, "cannot encode ", in);
  }
}

void set_sources(RowParams& p, const at::Tensor& k, const at::Tensor& v) {
  const int64_t es = k.element_size();
  p.src[0] = static_cast<const char*>(k.const_data_ptr());
  p.src[1] = static_cast<const char*>(v.const_data_ptr());
  p.src_tok[0] = k.stride(0) * es;
  p.src_tok[1] = v.stride(0) * es;
  p.src_head[0] = k.stride(1) * es;
  p.src_head[1] = v.stride(1) * es;
  p.num_tokens = static_cast<int>(k.size(0));
  p.num_heads = static_cast<int>(k.size(1));
  p.head_size = static_cast<int>(k.size(2));
}

void set_cache_dest(RowParams& p, const at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  const int64_t es = kv_cache.element_size();
  p.dst = static_cast<char*>(kv_cache.data_ptr());
  p.dst_block = kv_cache.stride(0) * es;
  p.dst_kv = kv_cache.stride(1) * es;
  p.dst_off = kv_cache.stride(2) * es;
  p.dst_head = kv_cache.stride(3) * es;
  p.block_size = kv_cache.size(2);
  p.capacity = kv_cache.size(0) * kv_cache.size(2);
  p.slots = slot_mapping.const_data_ptr();
  p.slots64 = slot_mapping.scalar_type() == at::ScalarType::Long;
  p.halves = 2;
}

void check_int32_sizes(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.size(0) < (int64_t{1} << 31) && x.size(1) * x.size(2) < (int64_t{1} << 30),
                    "tensor too large for the native kernel: ", x.sizes());
}

}  // namespace

at::Tensor encode_kv_cuda(const at::Tensor& x, const at::Tensor& scale, int64_t kv_quant_mode,
                          at::ScalarType cache_dtype) {
  check_encode(x, scale, kv_quant_mode, cache_dtype);
  check_int32_sizes(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t row_dim = storage_row_dim(kv_quant_mode, x.size(2));
  at::Tensor out = at::empty({x.size(0), x.size(1), row_dim}, x.options().dtype(cache_dtype));
  if (x.numel() == 0) return out;
  RowParams p{};
  set_sources(p, x, x);
  const int64_t es = out.element_size();
  p.dst = static_cast<char*>(out.data_ptr());
  p.dst_off = x.size(1) * row_dim * es;
  p.dst_head = row_dim * es;
  p.block_size = x.size(0);
  p.capacity = x.size(0);
  p.halves = 1;
  p.scale[0] = p.scale[1] = scale.const_data_ptr<float>();
  launch_encode(p, x.scalar_type(), kv_quant_mode, cache_dtype, c10::cuda::getCurrentCUDAStream());
  return out;
}

void cache_write_cuda(const at::Tensor& key_rows, const at::Tensor& value_rows, const at::Tensor& kv_cache,
                      const at::Tensor& slot_mapping) {
  check_cache(kv_cache, slot_mapping, key_rows.size(0), key_rows.device());
  check_rows(key_rows, value_rows, kv_cache);
  check_int32_sizes(key_rows);
  if (key_rows.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  RowParams p{};
  set_sources(p, key_rows, value_rows);
  set_cache_dest(p, kv_cache, slot_mapping);
  launch_copy(p, kv_cache.size(4) * kv_cache.element_size(), c10::cuda::getCurrentCUDAStream());
}

void encode_and_cache_write_cuda(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                                 const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                 const at::Tensor& v_scale, int64_t kv_quant_mode) {
  check_encode_and_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_quant_mode);
  check_int32_sizes(key);
  if (key.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  RowParams p{};
  set_sources(p, key, value);
  set_cache_dest(p, kv_cache, slot_mapping);
  p.scale[0] = k_scale.const_data_ptr<float>();
  p.scale[1] = v_scale.const_data_ptr<float>();
  launch_encode(p, key.scalar_type(), kv_quant_mode, kv_cache.scalar_type(), c10::cuda::getCurrentCUDAStream());
}

}  // namespace kvfuse
