"""Adds the block-time probe (KVFUSE_PROBE_BLOCK_TIMES) to csrc/cuda/cache_write.cu in place.
Scratch only: every rows_kernel block records its entry, its pass of the grid-dependency wait and
its end (after a closing __syncthreads) on %globaltimer, and its SM."""
import pathlib
p = pathlib.Path("csrc/cuda/cache_write.cu")
s = p.read_text()

def sub(old, new, count=1):
    global s
    assert s.count(old) == count, (old, s.count(old))
    s = s.replace(old, new)

sub('#include "grid_dependency.h"\n', '''#include "grid_dependency.h"

#ifndef KVFUSE_PROBE_BLOCK_TIMES
#define KVFUSE_PROBE_BLOCK_TIMES 0
#endif
#if KVFUSE_PROBE_BLOCK_TIMES
namespace kvfuse_probe {
constexpr unsigned kMaxRecords = 1u << 18;
__device__ unsigned long long g_records[kMaxRecords][4];
__device__ unsigned int g_count;
__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
}  // namespace kvfuse_probe
#define KVFUSE_PROBE_END()                                                                      \\
  do {                                                                                          \\
    __syncthreads();                                                                            \\
    if (threadIdx.x == 0) {                                                                     \\
      const unsigned long long probe_end = kvfuse_probe::now();                                 \\
      const unsigned i = atomicAdd(&kvfuse_probe::g_count, 1u);                                 \\
      if (i < kvfuse_probe::kMaxRecords) {                                                      \\
        unsigned long long* r = kvfuse_probe::g_records[i];                                     \\
        r[0] = probe_times[0];                                                                  \\
        r[1] = probe_times[1];                                                                     \\
        r[2] = probe_end;                                                                       \\
        r[3] = (static_cast<unsigned long long>(kvfuse_probe::smid()) << 48) |                \\
               (static_cast<unsigned long long>(gridDim.x) << 24) | blockIdx.x;                 \\
      }                                                                                         \\
    }                                                                                           \\
  } while (0)
#else
#define KVFUSE_PROBE_END() \\
  do {                     \\
  } while (0)
#endif
''')

sub('''    rows_kernel(const RowParams p) {
''', '''    rows_kernel(const RowParams p) {
#if KVFUSE_PROBE_BLOCK_TIMES
  // Thread 0's times, kept in shared memory so that the probe holds no registers across the body.
  __shared__ unsigned long long probe_times[2];
  if (threadIdx.x == 0) probe_times[0] = kvfuse_probe::now();
#endif
''')
sub('''    start_after_prior_grids<KVFUSE_WRITE_PDL>();
    load_scales();''', '''    start_after_prior_grids<KVFUSE_WRITE_PDL>();
#if KVFUSE_PROBE_BLOCK_TIMES
    if (threadIdx.x == 0) probe_times[1] = kvfuse_probe::now();
#endif
    load_scales();''')
sub('''    return store(WidenedFirst<Rot::N>{key});''', '''    store(WidenedFirst<Rot::N>{key});
    KVFUSE_PROBE_END();
    return;''')
sub('''  store(LoadedFirst{});
}
''', '''  store(LoadedFirst{});
  KVFUSE_PROBE_END();
}
''')
sub('''TORCH_LIBRARY_FRAGMENT(kvfuse_native, m) {
''', '''#if KVFUSE_PROBE_BLOCK_TIMES
void kvfuse_probe_reset() {
  const unsigned zero = 0;
  C10_CUDA_CHECK(cudaMemcpyToSymbol(kvfuse_probe::g_count, &zero, sizeof zero));
}
at::Tensor kvfuse_probe_read() {
  unsigned n = 0;
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(&n, kvfuse_probe::g_count, sizeof n));
  n = std::min(n, kvfuse_probe::kMaxRecords);
  at::Tensor out = at::empty({static_cast<int64_t>(n), 4}, at::TensorOptions().dtype(at::kLong));
  if (n > 0) C10_CUDA_CHECK(cudaMemcpyFromSymbol(out.data_ptr(), kvfuse_probe::g_records, size_t{n} * 32));
  return out;
}
#endif

TORCH_LIBRARY_FRAGMENT(kvfuse_native, m) {
#if KVFUSE_PROBE_BLOCK_TIMES
  m.def("probe_reset() -> ()", &kvfuse_probe_reset);
  m.def("probe_read() -> Tensor", &kvfuse_probe_read);
#endif
''')
p.write_text(s)
print("probe added")
