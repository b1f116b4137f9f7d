"""Timing probes on float32 half tables (not for landing): make the f32-half pair kernels do what
full-width bf16 tables add, one part at a time.
KVFUSE_SCRATCH_MIMIC_ALU=1: 2 opaque integer ops (shl by a runtime 0, and with a runtime ~0) on
  each lower cos / sin column where the rotation reads it: 32 ops per pair for N=8, as many as the
  full-width table's widening adds. Values unchanged.
KVFUSE_SCRATCH_MIMIC_LOADS=1: two more 16-byte loads per pair (cos and sin at the column's byte
  offset ^ 128 in the same row, another line as the upper columns are), held in 8 registers until
  the rotation consumes them in an empty asm. Values unchanged."""
import pathlib
p = pathlib.Path("csrc/cuda/cache_write.cu")
s = p.read_text()

def sub(old, new):
    global s
    assert s.count(old) == 1, (old, s.count(old))
    s = s.replace(old, new)

sub('''#ifndef KVFUSE_THREADS
''', '''#ifndef KVFUSE_SCRATCH_MIMIC_ALU
#define KVFUSE_SCRATCH_MIMIC_ALU 0
#endif
#ifndef KVFUSE_SCRATCH_MIMIC_LOADS
#define KVFUSE_SCRATCH_MIMIC_LOADS 0
#endif
#ifndef KVFUSE_THREADS
''')
sub('''  struct Loaded {
    bool rotated = false;
    Cols cos[kRuns], sin[kRuns];
  };''', '''  static constexpr bool kMimics = kHalfTable && std::is_same_v<Table, float>;
  struct Loaded {
    bool rotated = false;
    Cols cos[kRuns], sin[kRuns];
#if KVFUSE_SCRATCH_MIMIC_LOADS || KVFUSE_SCRATCH_MIMIC_ALU
    uint4 extra[2];
    uint32_t zero;
#endif
  };''')
sub('''#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      l.cos[i] = Cols::load(cos, pair * N + i * (r.rotary_dim / 2), false);
      l.sin[i] = Cols::load(sin, pair * N + i * (r.rotary_dim / 2), false);
    }
    return l;
  }''', '''#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      l.cos[i] = Cols::load(cos, pair * N + i * (r.rotary_dim / 2), false);
      l.sin[i] = Cols::load(sin, pair * N + i * (r.rotary_dim / 2), false);
    }
#if KVFUSE_SCRATCH_MIMIC_LOADS || KVFUSE_SCRATCH_MIMIC_ALU
    l.zero = static_cast<uint32_t>(r.rotary_dim) >> 30;
#endif
#if KVFUSE_SCRATCH_MIMIC_LOADS
    if constexpr (kMimics) {
      const int off = (pair * N * static_cast<int>(sizeof(Table))) ^ 128;
      l.extra[0] = __ldg(reinterpret_cast<const uint4*>(cos + off));
      l.extra[1] = __ldg(reinterpret_cast<const uint4*>(sin + off));
    }
#endif
    return l;
  }''')
sub('''    constexpr int kUpper = kRuns - 1;
    const float x1 = widen(lo.e, k), x2 = widen(hi.e, k);
    const float c1 = widen(l.cos[0].e, k), s1 = widen(l.sin[0].e, k);
    const float c2 = widen(l.cos[kUpper].e, k), s2 = widen(l.sin[kUpper].e, k);''', '''    constexpr int kUpper = kRuns - 1;
    const float x1 = widen(lo.e, k), x2 = widen(hi.e, k);
    float c1 = widen(l.cos[0].e, k), s1 = widen(l.sin[0].e, k);
    float c2 = widen(l.cos[kUpper].e, k), s2 = widen(l.sin[kUpper].e, k);
#if KVFUSE_SCRATCH_MIMIC_LOADS
    if constexpr (kMimics) {
      if (k == 0) {
        asm volatile("" ::"r"(l.extra[0].x), "r"(l.extra[0].y), "r"(l.extra[0].z), "r"(l.extra[0].w),
                     "r"(l.extra[1].x), "r"(l.extra[1].y), "r"(l.extra[1].z), "r"(l.extra[1].w));
      }
    }
#endif
#if KVFUSE_SCRATCH_MIMIC_ALU
    if constexpr (kMimics) {
      const uint32_t z = l.zero, m = ~l.zero;
      uint32_t bc = __float_as_uint(c1), bs = __float_as_uint(s1);
      asm volatile("shl.b32 %0, %0, %1;" : "+r"(bc) : "r"(z));
      asm volatile("and.b32 %0, %0, %1;" : "+r"(bc) : "r"(m));
      asm volatile("shl.b32 %0, %0, %1;" : "+r"(bs) : "r"(z));
      asm volatile("and.b32 %0, %0, %1;" : "+r"(bs) : "r"(m));
      c1 = c2 = __uint_as_float(bc);
      s1 = s2 = __uint_as_float(bs);
    }
#endif''')
p.write_text(s)
print("mimic added")
