"""Scratch variants of PairRotation::load over full-width tables (timing probes, not for landing):
KVFUSE_SCRATCH_TABLE_CG=1: the upper columns by ld.global.cg (L2 only); =2: all columns by .cg.
KVFUSE_SCRATCH_SHFL_UPPER=1: lanes with lane & 16 load the upper columns, the others the lower ones,
and each takes the other half from lane ^ 16 (valid only where lane ^ 16 holds the same token and
pair: pairs per head divides 16 and a token's items are a multiple of 32, as in the benchmark)."""
import pathlib
p = pathlib.Path("csrc/cuda/cache_write.cu")
s = p.read_text()

def sub(old, new):
    global s
    assert s.count(old) == 1, (old, s.count(old))
    s = s.replace(old, new)

sub('''  __device__ __forceinline__ static TableRun load(const char* row, int col0, bool half) {
    TableRun out;''', '''  __device__ __forceinline__ static TableRun load_cg(const char* row, int col0) {
    TableRun out;
    const uint4* w = reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(row) + col0);
#pragma unroll
    for (int i = 0; i < kWords; ++i) out.words[i] = __ldcg(w + i);
    return out;
  }
  __device__ __forceinline__ TableRun shfl_xor(int mask) const {
    TableRun out;
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      out.words[i].x = __shfl_xor_sync(0xffffffffu, words[i].x, mask);
      out.words[i].y = __shfl_xor_sync(0xffffffffu, words[i].y, mask);
      out.words[i].z = __shfl_xor_sync(0xffffffffu, words[i].z, mask);
      out.words[i].w = __shfl_xor_sync(0xffffffffu, words[i].w, mask);
    }
    return out;
  }
  __device__ __forceinline__ static TableRun load(const char* row, int col0, bool half) {
    TableRun out;''')

sub('''    const int64_t t = rope_table_row(tok, r);
    const char* cos = r.cos + t * r.cos_row;
    const char* sin = r.sin + t * r.sin_row;
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      l.cos[i] = Cols::load(cos, pair * N + i * (r.rotary_dim / 2), false);
      l.sin[i] = Cols::load(sin, pair * N + i * (r.rotary_dim / 2), false);
    }
    return l;''', '''    const int64_t t = rope_table_row(tok, r);
    const char* cos = r.cos + t * r.cos_row;
    const char* sin = r.sin + t * r.sin_row;
#if KVFUSE_SCRATCH_SHFL_UPPER
    if constexpr (kRuns == 2) {
      const bool upper = threadIdx.x & 16;
      const int col = pair * N + (upper ? r.rotary_dim / 2 : 0);
      const Cols c = Cols::load(cos, col, false), s = Cols::load(sin, col, false);
      const Cols c_other = c.shfl_xor(16), s_other = s.shfl_xor(16);
      l.cos[0] = upper ? c_other : c;
      l.cos[1] = upper ? c : c_other;
      l.sin[0] = upper ? s_other : s;
      l.sin[1] = upper ? s : s_other;
      return l;
    }
#endif
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      if (KVFUSE_SCRATCH_TABLE_CG == 2 || (KVFUSE_SCRATCH_TABLE_CG == 1 && i == 1)) {
        l.cos[i] = Cols::load_cg(cos, pair * N + i * (r.rotary_dim / 2));
        l.sin[i] = Cols::load_cg(sin, pair * N + i * (r.rotary_dim / 2));
      } else {
        l.cos[i] = Cols::load(cos, pair * N + i * (r.rotary_dim / 2), false);
        l.sin[i] = Cols::load(sin, pair * N + i * (r.rotary_dim / 2), false);
      }
    }
    return l;''')
sub('''#ifndef KVFUSE_THREADS
''', '''#ifndef KVFUSE_SCRATCH_TABLE_CG
#define KVFUSE_SCRATCH_TABLE_CG 0
#endif
#ifndef KVFUSE_SCRATCH_SHFL_UPPER
#define KVFUSE_SCRATCH_SHFL_UPPER 0
#endif
#ifndef KVFUSE_THREADS
''')
p.write_text(s)
print("variants added")
