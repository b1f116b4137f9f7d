// CUDA kernels of kvfuse's cache ops: encode K/V rows (cast, FP8, NVFP4) and scatter them
// into a paged cache (num_blocks, 2, block_size, heads, row_dim) in one pass. An NVFP4 row is
// split over its page's packed-data and block-scale regions (nvfp4_page.h); encode_kv's NVFP4
// output keeps dense [data | scales] rows.
//
// One kernel serves every op. A token's row work is cut into units: (head, chunk), covering the
// chunk in both the key and the value row (paired), or (half, head, chunk) (unpaired, for the
// smallest launches). A chunk is 16 to 64 bytes of input where the layout allows it
// (8 elements for casts, 16 for FP8, one 16-element NVFP4 block) and one element otherwise, so
// odd head sizes and unaligned views still work. Large FP8 / NVFP4 NeoX rotary writes take a unit
// and its rotation partner per thread instead (PairRotation). Blocks take consecutive ranges of the flat
// (token, unit) space, their threads kUnits units apart: each thread issues all its row loads
// (and slot loads) before it converts or stores anything, and adjacent threads touch adjacent
// bytes of a row. Launch shapes and their measurements: see launch() and BENCHMARKS.md.
//
// Numerics (bit-identical to kvfuse/ops/reference.py, see csrc/encode_math.h):
//   - cast: c10's float -> half / bfloat16 conversions, the ones torch's .to() uses;
//   - FP8: q = x / scale (correctly rounded division; this file must never be built with fast
//     math), then the saturating hardware convert cvt.rn.satfinite, which equals clamp(q, -max,
//     max) followed by round-to-nearest-even (both send |q| beyond the largest finite value to
//     it, inf included); NaN stays NaN;
//   - NVFP4: the reference's float32 math per 16-block, E2M1 rounding in software.
// Slots equal to -1 (and, instead of a fault, slots beyond the cache) are skipped.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "../cache_write.h"
#include "../encode_math.h"
#include "../nvfp4_page.h"
#include "grid_dependency.h"

// Tuning knobs (benchmarks/native_sweep.py rebuilds the library with other values): threads per
// block, units per thread and the resident blocks per SM the register budget is set for, per op
// family. The defaults are the best of that sweep on an H100 (BENCHMARKS.md).
#ifndef KVFUSE_THREADS
#define KVFUSE_THREADS 256
#endif
#ifndef KVFUSE_COPY_UNITS
#define KVFUSE_COPY_UNITS 2
#endif
#ifndef KVFUSE_COPY_MIN_BLOCKS
#define KVFUSE_COPY_MIN_BLOCKS 4
#endif
#ifndef KVFUSE_FP8_UNITS
#define KVFUSE_FP8_UNITS 1
#endif
#ifndef KVFUSE_FP8_MIN_BLOCKS
#define KVFUSE_FP8_MIN_BLOCKS 4
#endif
#ifndef KVFUSE_FP8_CHUNK
#define KVFUSE_FP8_CHUNK 16
#endif
// Grids of fewer blocks than this take fewer units per thread (more, smaller blocks).
#ifndef KVFUSE_WIDE_GRID
#define KVFUSE_WIDE_GRID 2048
#endif
// Threads per block of one-unit launches (grids below the wide ones). 128: on an H200 the writes
// and rotary writes ran faster than at 256 or level from 4096 tokens on, and mostly level or
// faster below (BENCHMARKS.md, thirty-ninth session).
#ifndef KVFUSE_SMALL_THREADS
#define KVFUSE_SMALL_THREADS 128
#endif
// The same for FP8 rotary writes in 8-element units (Rotation with kN == kRopeNarrowUnit, small
// launches): at 128 threads they were slower at 64 and 256 tokens, where 16-bit caches' were faster.
#ifndef KVFUSE_ROPE_FP8_NARROW_THREADS
#define KVFUSE_ROPE_FP8_NARROW_THREADS 256
#endif
// Launches of fewer paired items than this (one paired unit, or unit pair, per thread) take
// unpaired units instead: twice the threads, each with half the work. Copies, casts and 16-bit
// rotary writes too since the forty-fourth session, where on an H200 the bf16 write and rotary
// write of 64 and 256 tokens ran faster unpaired (BENCHMARKS.md).
#ifndef KVFUSE_UNPAIRED_BELOW_ITEMS
#define KVFUSE_UNPAIRED_BELOW_ITEMS 262144
#endif
// The same threshold for rotary writes, whose key units carry the rotation's work and whose value
// units do not.
#ifndef KVFUSE_ROPE_UNPAIRED_BELOW_ITEMS
#define KVFUSE_ROPE_UNPAIRED_BELOW_ITEMS KVFUSE_UNPAIRED_BELOW_ITEMS
#endif
// The FP8 and NVFP4 writes alone have thresholds of their own, where the paired and unpaired
// launches crossed on an H200 (8 x 128 bfloat16 rows; BENCHMARKS.md, fifty-third session): FP8 ran
// 3.8-5.6% faster unpaired at 4096 and 6144 tokens and level at 8192; NVFP4 ran faster paired from
// 2560 tokens (7.5% at 3072, 11% at 4095) and unpaired at 2304 and below.
#ifndef KVFUSE_FP8_UNPAIRED_BELOW_ITEMS
#define KVFUSE_FP8_UNPAIRED_BELOW_ITEMS 524288
#endif
#ifndef KVFUSE_NVFP4_UNPAIRED_BELOW_ITEMS
#define KVFUSE_NVFP4_UNPAIRED_BELOW_ITEMS 163840
#endif
// FP8 rotary writes in unit pairs (PairRotation) hold the value pair in the key pair's thread from
// this many pair items on: 4608 tokens of 8 x 128 in 8-element pairs. Below it their unpaired
// launches, budgeted at KVFUSE_ROPE_PAIR_FP8_*UNPAIRED_BLOCKS, ran faster on an H200; at 4608
// tokens and more paired ran faster or level (BENCHMARKS.md, fifty-fourth session). 16-bit caches keep
// KVFUSE_ROPE_UNPAIRED_BELOW_ITEMS: paired at 3072 and 3584 tokens they ran 11-12% slower
// (forty-sixth session).
#ifndef KVFUSE_ROPE_FP8_UNPAIRED_BELOW_ITEMS
#define KVFUSE_ROPE_FP8_UNPAIRED_BELOW_ITEMS 294912
#endif
// NVFP4 rotary writes in unit pairs hold the value pair in the key pair's thread from this many pair
// items (5120 tokens of 8 x 128 in 32-element pairs). On an H200 at 5120 and 6144 tokens they ran
// 0.7-2.9% faster than unpaired over every table form measured; 16-bit caches, which would have
// moved with KVFUSE_ROPE_UNPAIRED_BELOW_ITEMS, ran level (BENCHMARKS.md, fifty-third session).
#ifndef KVFUSE_ROPE_NVFP4_UNPAIRED_BELOW_ITEMS
#define KVFUSE_ROPE_NVFP4_UNPAIRED_BELOW_ITEMS 163840
#endif
// Unpaired unit-pair rotary writes whose rows are loaded first (RowsFirst), then the slot and the
// table columns: FP8 ones at every size they launch at, 16-bit ones below this many pair items
// (2048 tokens of 8 x 128), NVFP4 never. A row is read once, usually from DRAM, while a token's
// heads share its table columns; starting the rows' loads first shortened 16-bit writes of 64 and
// 256 tokens and FP8 ones up to 2048. In grids of about a wave (16-bit and NVFP4 at 2048 tokens)
// the columns-first order was faster, and NVFP4 gained nothing below that (BENCHMARKS.md,
// forty-seventh session). 0: the columns first everywhere.
#ifndef KVFUSE_ROPE_ROWS_FIRST
#define KVFUSE_ROPE_ROWS_FIRST 1
#endif
#ifndef KVFUSE_ROPE_16BIT_ROWS_FIRST_BELOW_ITEMS
#define KVFUSE_ROPE_16BIT_ROWS_FIRST_BELOW_ITEMS 131072
#endif
// 1: streaming cache hints (ld.global.cs / st.global.cs) on 16-byte row loads / stores. Measured
// on an H100: the load hint is faster for launches that read up to 16 MiB (1024 tokens: 4.0 vs
// 4.2 us bf16) and ~1% slower from 64 MiB (65536 tokens: 190.4 vs 188.4 us bf16); the store hint
// makes no measurable difference (BENCHMARKS.md).
#ifndef KVFUSE_LOAD_HINT
#define KVFUSE_LOAD_HINT 1
#endif
// The same hint on the 8-byte stores of 8-element FP8 units (0: plain stores): without it the
// rotary write's unit pairs lost to single units at 16384 tokens (BENCHMARKS.md, twenty-sixth
// session).
#ifndef KVFUSE_NARROW_STORE_HINT
#define KVFUSE_NARROW_STORE_HINT 1
#endif
// 1: a write's two scale dividers (make_divider: a reciprocal whose slow path is a branch on the
// loaded scale) are built once the thread's row, slot and table loads are issued; 0: right after
// the scale loads, so that every thread waited out both scale loads, one after the other, before
// it issued any row load (BENCHMARKS.md, forty-third session).
#ifndef KVFUSE_WRITE_DIVIDERS_AFTER_LOADS
#define KVFUSE_WRITE_DIVIDERS_AFTER_LOADS 1
#endif
// 1: unpaired launches (a unit or a unit pair per thread, key and value rows in separate
// threads) compute their indices and row addresses before they wait for the grids before them (a
// dependent launch's prologue); 0: after (rows_kernel's kIndexFirst).
#ifndef KVFUSE_WRITE_INDEX_BEFORE_WAIT
#define KVFUSE_WRITE_INDEX_BEFORE_WAIT 1
#endif
// 1: unpaired rotary launches also work out where their table columns lie before that wait
// (Rotation::locate), so the rotary parameters' constant-cache misses fall under the tail of the
// grid before instead of between the wait and the table loads; 0: after the wait, the rotary
// writes of 64 tokens ran 0.13-0.16 us longer on an H200 (BENCHMARKS.md, forty-fourth session).
#ifndef KVFUSE_ROPE_LOCATE_BEFORE_WAIT
#define KVFUSE_ROPE_LOCATE_BEFORE_WAIT 1
#endif
#ifndef KVFUSE_NVFP4_MIN_BLOCKS
#define KVFUSE_NVFP4_MIN_BLOCKS 5
#endif
#ifndef KVFUSE_STORE_HINT
#define KVFUSE_STORE_HINT 1
#endif
// Resident blocks per SM the rotary write gives up against the write alone, for the rotation's
// registers, by format (BENCHMARKS.md, fifteenth session): FP8 keeps the write's (its
// instantiations over 16-bit tables fit 64 registers without spills), NVFP4 gives up one (at 0
// its NeoX instantiations spill).
#ifndef KVFUSE_ROPE_FP8_FEWER_BLOCKS
#define KVFUSE_ROPE_FP8_FEWER_BLOCKS 0
#endif
#ifndef KVFUSE_ROPE_NVFP4_FEWER_BLOCKS
#define KVFUSE_ROPE_NVFP4_FEWER_BLOCKS 1
#endif
// 1: the rotation's sum contracted as Triton / Inductor contract it, fma(x, cos, rn(rot * sin));
// 0: two rounded products and a rounded sum (the CPU reference's form). See the rotary section.
#ifndef KVFUSE_ROPE_CONTRACT
#define KVFUSE_ROPE_CONTRACT 1
#endif
// Resident blocks per SM the rotary write gives up, in addition, for float32 tables (their columns
// take twice the registers).
#ifndef KVFUSE_ROPE_F32_TABLE_FEWER_BLOCKS
#define KVFUSE_ROPE_F32_TABLE_FEWER_BLOCKS 1
#endif
// 1: the rotation widens bfloat16 elements to float from their 32-bit word (widen); 0: by c10's
// conversion of the extracted 16-bit value (the build measured up to the fourteenth session).
#ifndef KVFUSE_BF16_WORD_WIDEN
#define KVFUSE_BF16_WORD_WIDEN 1
#endif
// 1: the rotation rounds its results to the key's dtype two at a time into one word (round_pair;
// BENCHMARKS.md, twenty-third session); 0: one element at a time.
#ifndef KVFUSE_ROPE_PACK_PAIRS
#define KVFUSE_ROPE_PACK_PAIRS 1
#endif
// 1: NeoX units take their partner chunk by warp shuffle where a head's units share a warp
// (Rotation's kShuffle); 0: every unit loads it (the build measured in the fourteenth session).
#ifndef KVFUSE_ROPE_PARTNER_SHUFFLE
#define KVFUSE_ROPE_PARTNER_SHUFFLE 1
#endif
// FP8 (and 16-bit cache) rotary writes of fewer 16-element (token, head, chunk) units than this run in 8-element
// units, at KVFUSE_ROPE_FP8_NARROW_MIN_BLOCKS resident blocks per SM (twice the threads, each with
// half the rotation). Measured on cold inputs of 8 x 128 (BENCHMARKS.md, fifteenth session):
// faster up to 512 tokens, slower at 1024, level from 2048 on. NVFP4 units are its 16-element
// blocks. FP8 NeoX launches that can take unit pairs take them from KVFUSE_ROPE_PAIRS_FROM units
// on, far below this: on an H200 8-element units ran 1.15-1.34x the pairs' time at 512-1023 tokens
// (fifty-fifth session); GPT-J and fp16 keys over 16-bit tables keep this threshold.
#ifndef KVFUSE_ROPE_FP8_NARROW_BELOW
#define KVFUSE_ROPE_FP8_NARROW_BELOW 65536
#endif
#ifndef KVFUSE_ROPE_FP8_NARROW_MIN_BLOCKS
#define KVFUSE_ROPE_FP8_NARROW_MIN_BLOCKS 6
#endif
// 1: NeoX rotary writes of at least KVFUSE_ROPE_PAIRS_FROM 16-element (token, head, chunk) units
// (KVFUSE_ROPE_NVFP4_PAIRS_FROM for NVFP4, KVFUSE_ROPE_16BIT_PAIRS_FROM for 16-bit caches), whose
// unrotated tail splits into pairs ((head_size - R) % (2 N) == 0), run in unit pairs
// (PairRotation): FP8 over float32 tables (and, for bfloat16 keys, over 16-bit ones:
// KVFUSE_ROPE_FP8_PAIRS_16BIT_TABLES) and 16-bit caches over any table in pairs of 8-element
// units, NVFP4 in pairs of its 16-element blocks; 0: one unit per thread (Rotation) at every size.
// Single units stay where pairs did not win on an H100 (BENCHMARKS.md, twenty-sixth session):
// NVFP4 in smaller launches (decode), FP8 of half keys over 16-bit tables, and NVFP4 over
// full-width float32 tables (its pairs spill). FP8 takes pairs from KVFUSE_ROPE_PAIRS_FROM units
// (64 tokens of 8 x 128): on an H200 (8 x 128 bfloat16 keys) they ran level with or up to 26%
// faster than 8-element single units from 64 to 1023 tokens (BENCHMARKS.md, fifty-fifth
// session). 16-bit caches take pairs at every size: on an H200 (8 x 128 bfloat16 keys) they were
// 3-14% faster from 64 to 256 tokens and 3-6% at 2048 and 4096; at 512 and 1024 one table type
// gained or ran level and the other (bf16 half tables) ran level or 5% slower; at 16384 level or
// 1.4% slower (BENCHMARKS.md, forty-fourth and forty-fifth sessions).
#ifndef KVFUSE_ROPE_PAIR_UNITS
#define KVFUSE_ROPE_PAIR_UNITS 1
#endif
#ifndef KVFUSE_ROPE_PAIRS_FROM
#define KVFUSE_ROPE_PAIRS_FROM 4096
#endif
#ifndef KVFUSE_ROPE_NVFP4_PAIRS_FROM
#define KVFUSE_ROPE_NVFP4_PAIRS_FROM 131072
#endif
#ifndef KVFUSE_ROPE_16BIT_PAIRS_FROM
#define KVFUSE_ROPE_16BIT_PAIRS_FROM 0
#endif
// Resident blocks per SM the pairs' register budget is set for: FP8, NVFP4 with the value rows in
// the same thread (paired), NVFP4 without (unpaired); none of them spills.
#ifndef KVFUSE_ROPE_PAIR_MIN_BLOCKS
#define KVFUSE_ROPE_PAIR_MIN_BLOCKS 4
#endif
// FP8 pairs over 16-bit tables have budgets of their own, counted in the 128-thread blocks they
// launch in (PairRotation::min_small_blocks; 0: KVFUSE_ROPE_PAIR_MIN_BLOCKS).
// With the value rows in the same thread, over half tables: 10 (48 registers, no spills) instead
// of 8 (56). On an H200, FP8 at 2560-4096 tokens over bfloat16 half tables ran 1-2% faster; over
// float32 half tables 48 registers spill, and those ran slower (BENCHMARKS.md, forty-seventh
// session).
#ifndef KVFUSE_ROPE_PAIR_FP8_16BIT_HALF_SMALL_BLOCKS
#define KVFUSE_ROPE_PAIR_FP8_16BIT_HALF_SMALL_BLOCKS 10
#endif
// Over full-width tables, in launches of more than a wave (paired, or unpaired and prefetching):
// 9 (56 registers, no spills) instead of 8 (59-62 registers), a count the 256-thread blocks of
// KVFUSE_ROPE_PAIR_MIN_BLOCKS cannot express. On an H200, FP8 over full-width bfloat16 tables
// went 5.41-5.46 -> 5.21-5.26 us at 2048 tokens and 8.52-8.59 -> 8.41-8.48 at 4096. At 10 (48
// registers) the paired kernels spill, and 3072 and 4096 tokens ran 1-2% slower than at 9.
// Unpaired launches of a wave and less keep 8: at 1024 tokens 56 registers ran 3% slower
// (BENCHMARKS.md, forty-eighth session).
#ifndef KVFUSE_ROPE_PAIR_FP8_FULL16_SMALL_BLOCKS
#define KVFUSE_ROPE_PAIR_FP8_FULL16_SMALL_BLOCKS 9
#endif
// With key and value pairs in separate threads (unpaired), in launches of more than a wave
// (prefetching, or ManyWaves): over bfloat16 half tables 12 (40 registers, no spills), over float32
// half tables and full-width 16-bit ones 10 (48, no spills; prefetching launches over full-width
// tables keep KVFUSE_ROPE_PAIR_FP8_FULL16_SMALL_BLOCKS), instead of 8 (51-64 registers). 0:
// KVFUSE_ROPE_PAIR_MIN_BLOCKS. On an H200 (8 x 128 bfloat16 keys) these unpaired launches ran 2-11%
// faster than the paired ones at 2560-4096 tokens over half tables, and over full-width tables 7%
// faster at 2560 and level from 3072; at 8, unpaired ran slower at 4096 tokens
// (KVFUSE_ROPE_FP8_UNPAIRED_BELOW_ITEMS). At 12 the other tables' kernels spill and ran 19-50%
// slower at 2048-4608 tokens. Launches of a wave and less keep 8: at 1024 tokens 10 ran 2-5%
// slower, 12 over bf16 half tables 8% (BENCHMARKS.md, fifty-fourth session).
#ifndef KVFUSE_ROPE_PAIR_FP8_16BIT_HALF_UNPAIRED_BLOCKS
#define KVFUSE_ROPE_PAIR_FP8_16BIT_HALF_UNPAIRED_BLOCKS 12
#endif
#ifndef KVFUSE_ROPE_PAIR_FP8_UNPAIRED_BLOCKS
#define KVFUSE_ROPE_PAIR_FP8_UNPAIRED_BLOCKS 10
#endif
#ifndef KVFUSE_ROPE_PAIR_NVFP4_MIN_BLOCKS
#define KVFUSE_ROPE_PAIR_NVFP4_MIN_BLOCKS 3
#endif
#ifndef KVFUSE_ROPE_PAIR_NVFP4_UNPAIRED_MIN_BLOCKS
#define KVFUSE_ROPE_PAIR_NVFP4_UNPAIRED_MIN_BLOCKS 4
#endif
// 1: unit-pair launches of 16-bit caches that hold the value rows in the key's thread (paired) load
// the rows before the table columns; 0: the columns first, as FP8 and NVFP4 pairs still do. On an
// H200 (8 x 128 bfloat16 keys), 16-bit caches at 4096 tokens went 9.17-9.22 -> 8.75-8.86 us over
// every table form (3.4-5.1%) and at 16384 0.9-1.2% faster. FP8 pairs with their rows first ran
// 11-22% slower at 3072-16384 tokens (as in the forty-seventh session), and with only the upper
// chunk's columns after the rows 15-16% (BENCHMARKS.md, forty-ninth session).
#ifndef KVFUSE_ROPE_16BIT_PAIRED_ROWS_FIRST
#define KVFUSE_ROPE_16BIT_PAIRED_ROWS_FIRST 1
#endif
// 1: FP8 and NVFP4 unpaired unit-pair launches of more than one wave and at most two (resident
// blocks from the occupancy calculator) run Prefetching<PairRotation>: before its dependent-launch
// wait, each thread of the first wave prefetches into L2 the rows that the item a whole number of
// tokens (at most one wave) ahead will load, so that the second wave's loads find them there
// instead of starting from DRAM as the first wave's blocks retire. 0: no prefetching launch.
// On an H200 (8 x 128 bfloat16 keys) NVFP4 at 4096 tokens went 10.94-11.15 -> 10.68-10.80 us and
// FP8 at 2048 5.15-5.28 -> 5.01-5.02; prefetching the table columns too ran level with rows
// alone. FP8 at 3072 tokens (2.3 waves) ran mixed (+1% / -2% over float32 / bfloat16 half
// tables), and 16-bit caches, whose rotary write has no encode to hide the prefetch under, 2.4%
// slower at 3072 tokens (1.9 / 2.3 waves) (BENCHMARKS.md, forty-sixth session).
#ifndef KVFUSE_ROPE_PREFETCH
#define KVFUSE_ROPE_PREFETCH 1
#endif
// 1: FP8 unit-pair rotary writes of bfloat16 keys hand the encode their rotated elements as
// floats, each rounded to bfloat16 by one convert with a zero partner (PairRotation::kWidens),
// instead of packing two rounded elements per word for the encode to widen again; 0: packed.
// NVFP4 pairs stay packed: widened they ran level at 4096 tokens over float32 half tables and 1%
// slower over bfloat16 tables (BENCHMARKS.md, thirty-eighth session).
// 1: FP8 unit pairs whose key and value rows are in separate threads, in launches of a wave and
// less (RowsFirst, neither ManyWaves nor Prefetching), check both units' words for NaN bytes in
// one branch (EncodeOp::store_pair) instead of one per unit. On an H200 (8 x 128 bfloat16 keys) the
// rotary writes of 64 tokens went from 1.17 / 1.14 / 1.14 to 1.14-1.15 / 1.12-1.13 / 1.14 times
// the write alone over full-width bf16 / bf16 half / f32 half tables, of 256 tokens from 1.13 /
// 1.10 / 1.12 to 1.12 / 1.09-1.10 / 1.11, of 1024 over full-width tables from 1.05 to 1.04
// (BENCHMARKS.md, fifty-seventh session). The other unit-pair launches spilled 4-32 bytes at their
// register budgets with it, so they keep a branch per unit.
#ifndef KVFUSE_FP8_PAIR_NAN_CHECK
#define KVFUSE_FP8_PAIR_NAN_CHECK 1
#endif
// 1: FP8 launches whose threads hold only key rows or only value rows (unpaired) build only
// their own half's divider: both scales are loaded as before, one is selected after the row loads.
// On an H200 (8 x 128 bfloat16 keys, scales 0.5 / 0.25) the FP8 write alone went from 1.06-1.09
// to 1.01-1.02 us at 16 tokens, 1.50-1.51 to 1.47 at 256, 2.73-2.76 to 2.68-2.70 at 1024, and
// the rotary writes over full-width bfloat16 tables from 1.22-1.23 to 1.17-1.19 us at 64 tokens and
// 7.84-7.94 to 7.63-7.68 at 4096; over float32 half tables at 1024 tokens they ran 0.7-1.4% slower
// (BENCHMARKS.md, fifty-eighth session). NVFP4 keeps both dividers: its write alone ran 1-2% slower
// with one. 0: every thread builds both.
#ifndef KVFUSE_FP8_OWN_DIVIDER
#define KVFUSE_FP8_OWN_DIVIDER 1
#endif
#ifndef KVFUSE_ROPE_WIDENED_OUT
#define KVFUSE_ROPE_WIDENED_OUT 1
#endif
// 1: FP8 rotary writes of bfloat16 keys over 16-bit tables take unit pairs too (widened, as over
// float32 tables); 0: single units, where pairs with packed outputs had not won on an H100. Half
// keys keep single units there (their pairs do not widen and were not measured).
#ifndef KVFUSE_ROPE_FP8_PAIRS_16BIT_TABLES
#define KVFUSE_ROPE_FP8_PAIRS_16BIT_TABLES 1
#endif
// 1: an NVFP4 unit pair (kOneSlot) encodes both blocks, then locates their row's data and scale
// addresses once (store_nvfp4_pair); 0: each block locates them on its own, and nvcc recomputes
// the row's 64-bit offsets for the second block (measured slower: BENCHMARKS.md).
#ifndef KVFUSE_NVFP4_PAIR_STORE
#define KVFUSE_NVFP4_PAIR_STORE 1
#endif
// The NVFP4 encode's instruction diet (BENCHMARKS.md, eighteenth session: 16384 tokens went from
// 77% to 85% of copy, each step an A/B build; 0 restores the form before it):
//   - NAN_BRANCH: the block's amax by NaN-propagating maxima, NaN inputs zeroed only in a block
//     that holds one (a branch per block instead of a test and a select per element);
//   - HW_SCALE: the block scale's value by the hardware e4m3 -> f16 convert (exact: every e4m3
//     value is an f16) instead of decoding its bits in software;
//   - WORD_WIDEN: bfloat16 inputs widened from their 32-bit words (widen).
#ifndef KVFUSE_NVFP4_NAN_BRANCH
#define KVFUSE_NVFP4_NAN_BRANCH 1
#endif
#ifndef KVFUSE_NVFP4_HW_SCALE
#define KVFUSE_NVFP4_HW_SCALE 1
#endif
#ifndef KVFUSE_NVFP4_WORD_WIDEN
#define KVFUSE_NVFP4_WORD_WIDEN 1
#endif
// Two more (BENCHMARKS.md, fifty-second session: on an H200 the write alone went from 64% to 70%
// of copy at 16384 tokens and from 67% to 74% at 65536; at 4096, 6.6% fewer instructions executed):
//   - BIASED_CODES: each code added into its packed word at its nibble unmasked, its sign bit
//     from a select of the rounding constant (e2m1_code_biased; the biases subtracted once per
//     word), where the code was masked and its sign bit selected and merged (one instruction
//     fewer an element);
//   - PACKED_AMAX: 16-bit inputs' block maximum of |x| by 7 two-lane float maxima of their words
//     (max.NaN.xorsign.abs) and one of the last word's halves, instead of one per element (the
//     eighteenth session's integer form, byte permutes and VIMNMX3.U16x2, had run level).
#ifndef KVFUSE_NVFP4_BIASED_CODES
#define KVFUSE_NVFP4_BIASED_CODES 1
#endif
#ifndef KVFUSE_NVFP4_PACKED_AMAX
#define KVFUSE_NVFP4_PACKED_AMAX 1
#endif
namespace kvfuse {
namespace {

using at::cuda::detail::IntDivider;

constexpr int kThreads = KVFUSE_THREADS;

// The rotary embedding of rope_encode_and_cache_write, read only by launches with a Rotation.
struct RopeParams {
  const char* cos;
  const char* sin;
  int64_t cos_row, sin_row;  // byte strides of the tables' rows
  const void* positions;  // nullptr: token t reads table row t
  int positions64;
  int rotary_dim;
  int half_table;  // one column per pair (width rotary_dim / 2) instead of one per element
  // NeoX launches of N-element units whose heads each lie within one warp (head_size / N divides
  // 32): the lane distance to a unit's partner chunk, rotary_dim / (2 N) (see Rotation::exchange).
  int partner_lanes;
};

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
  // Dividers by multiply-high and shift, set up on the host: a token's units, a head's chunks,
  // the page size (used while the cache holds < 2^31 slots).
  IntDivider<uint32_t> items, chunks, page;
  uint32_t per_half;  // heads x chunks: the units of one half of a token
  uint32_t units;  // units of this launch, < 2^31
  int64_t first_token;  // this launch's first token
  int slots64;
  int num_tokens, num_heads, halves;
  int head_size;
  int store_width;  // NVFP4 packed-data store: 8, 4 or 1 bytes at a time
  // NVFP4 ops: where a row's data and scales go from its side's base (a cache page's K or V half,
  // or encode_kv's output), and the divider by the V-scale group (nvfp4_page.h).
  Nvfp4Layout nvfp4;
  IntDivider<uint32_t> v_group;
  RopeParams rope;
  // Prefetching launches (Prefetching): the items one prefetch reaches ahead, and the same
  // distance in bytes of the key and value rows.
  uint32_t ahead_items;
  int64_t ahead_src[2];
};

// Launches without a rotary embedding: the key rows are encoded as loaded.
struct NoRotation {
  static constexpr bool kActive = false;
  static constexpr bool kPairs = false;
  static constexpr bool kLoadsPartner = false;
  template <class Op>
  static constexpr bool kWidens = false;
  struct Loaded {};
  struct Where {};
  template <class Op, bool kPaired>
  static constexpr int min_blocks() { return Op::kMinBlocks; }
  template <class Op, bool kPaired, bool kPrefetching, bool kManyWaves>
  static constexpr int min_small_blocks() { return 0; }
};

// A rotation whose launch prefetches into L2 the rows of the item ahead (KVFUSE_ROPE_PREFETCH): the
// same rotation, a separate kernel, so that launches without prefetching keep theirs.
template <class Rot>
struct Prefetching : Rot {};
template <class Rot>
constexpr bool kPrefetches = false;
template <class Rot>
constexpr bool kPrefetches<Prefetching<Rot>> = true;

// An unpaired pair rotation whose threads load their rows before their slot and table columns
// (KVFUSE_ROPE_ROWS_FIRST); a separate kernel, like Prefetching, so that either order can launch.
template <class Rot>
struct RowsFirst : Rot {};
template <class Rot>
constexpr bool kRowsFirst = false;
template <class Rot>
constexpr bool kRowsFirst<RowsFirst<Rot>> = true;
template <class Rot>
constexpr bool kRowsFirst<Prefetching<Rot>> = kRowsFirst<Rot>;

// An unpaired FP8 pair rotation's launch of more blocks than its plain kernel holds at once that
// does not prefetch (ManyWaves<RowsFirst<PairRotation>>): the same rotation, a separate kernel with
// a register budget of its own (KVFUSE_ROPE_PAIR_FP8_*UNPAIRED_BLOCKS), so that launches of a wave
// and less keep theirs.
template <class Rot>
struct ManyWaves : Rot {};
template <class Rot>
constexpr bool kManyWaves = false;
template <class Rot>
constexpr bool kManyWaves<ManyWaves<Rot>> = true;
template <class Rot>
constexpr bool kRowsFirst<ManyWaves<Rot>> = kRowsFirst<Rot>;

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

// x / d correctly rounded (what div.rn.f32, and so torch, computes) in three FMA-pipe ops instead
// of div.rn's ~10: with r = rn(1/d), q0 = rn(x*r) is within an ulp of x/d, the residual
// fma(-q0, d, x) is exact, and one correction step q1 = rn(q0 + e*r) is the correctly rounded
// quotient (Markstein). The premises hold while nothing under- or overflows, which the fast
// window |d| in [2^-64, 2^64] ensures for every quotient an encoding can tell apart: FP8 and
// E2M1 send |q| < 2^-17 to a signed zero, and there the residual is still a normal number.
// Outside the window, div.rn. Two things are left to the caller, as they are cheaper in bulk:
//   - q1 of a tiny quotient may be +0 where x/d is -0 or -tiny: copysign(q1, q0) (q0 always
//     holds the quotient's sign);
//   - an infinite q0 (x = inf, or x/d beyond float range) makes q1 NaN where x/d is inf: the
//     caller keeps q0 there (FP8 finds those among its NaN bytes, in a rarely taken branch).
// A power-of-two d in the window needs none of that: r = 1/d is exact, so rn(x*r) is the one
// rounding of x/d itself, for every x (subnormal, infinite and NaN quotients included), and
// neither the correction nor the copysign is needed. Scales of 1 (engines' default when a
// checkpoint has none) and other powers of two take that path.
struct Divider {
  float d, r;
  bool fast;   // |d| in [2^-64, 2^64]
  bool exact;  // and a power of two
};

// 1: writes whose two scales are powers of two divide by one product per value
// (Division::kExact); 0: by the corrected reciprocal like any scale in the window.
#ifndef KVFUSE_FP8_EXACT_DIVISION
#define KVFUSE_FP8_EXACT_DIVISION 1
#endif

__device__ __forceinline__ Divider make_divider(float d) {
  const float a = fabsf(d);
  const bool fast = a >= 0x1p-64f && a <= 0x1p64f;
  const bool exact = KVFUSE_FP8_EXACT_DIVISION && fast && (__float_as_uint(d) & 0x7FFFFFu) == 0u;
  return Divider{d, fast ? __frcp_rn(d) : 0.0f, fast, exact};
}

// How a block divides by its dividers, chosen once per block (a template argument of the store):
// kExact, one product (both dividers exact); kReciprocal, the corrected reciprocal (both fast);
// kDivide, div.rn. Threads that build only their own half's divider (KVFUSE_FP8_OWN_DIVIDER) choose
// by that one, so key and value threads of a block may divide differently.
enum class Division { kExact, kReciprocal, kDivide };

struct Quotient {
  float q0, q1;  // rn(x * r) and the corrected quotient; equal on the kExact and kDivide paths
};

template <Division kDiv>
__device__ __forceinline__ Quotient divide_parts(float x, const Divider v) {
  if constexpr (kDiv == Division::kExact) {
    const float q = __fmul_rn(x, v.r);
    return {q, q};
  } else if constexpr (kDiv == Division::kReciprocal) {
    const float q0 = __fmul_rn(x, v.r);
    return {q0, __fmaf_rn(__fmaf_rn(-q0, v.d, x), v.r, q0)};
  } else {
    const float q = __fdiv_rn(x, v.d);
    return {q, q};
  }
}

// The cache slot of token tok: its slot_mapping entry, or tok itself without one.
__device__ __forceinline__ int64_t slot_of(const RowParams& p, int64_t tok) {
  return p.slots == nullptr ? tok
         : p.slots64        ? __ldg(static_cast<const int64_t*>(p.slots) + tok)
                            : __ldg(static_cast<const int32_t*>(p.slots) + tok);
}

// A unit's elements as float, each already a value of the key's dtype (PairRotation::kWidens).
template <int N>
struct Widened {
  float v[N];
  __device__ __forceinline__ float operator[](int k) const { return v[k]; }
};

// One unit's registers: the chunk as loaded from the key row and, in a paired unit, the value row.
template <class Op>
struct Pair {
  typename Op::Raw half[2];
};

// The page of a slot (in [0, capacity)) and its offset in it.
__device__ __forceinline__ void locate(const RowParams& p, int64_t slot, int64_t& block, int64_t& off) {
  if (p.capacity <= INT32_MAX) {
    const auto bo = p.page.divmod(static_cast<uint32_t>(slot));
    block = bo.div;
    off = bo.mod;
  } else {
    block = slot / p.block_size;
    off = slot - block * p.block_size;
  }
}

// The first side of a unit (its key row, or an unpaired unit's only row) as loaded.
struct LoadedFirst {
  template <class Op, int kUnits>
  __device__ __forceinline__ const typename Op::Raw& operator()(const Pair<Op> (&raw)[kUnits], int m) const {
    return raw[m].half[0];
  }
};

// The first side of a unit pair from a rotation that widens (PairRotation::kWidens, FP8), as floats.
template <int N>
struct WidenedFirst {
  const Widened<N> (&key)[2];
  template <class Op, int kUnits>
  __device__ __forceinline__ const Widened<N>& operator()(const Pair<Op> (&)[kUnits], int m) const {
    return key[m];
  }
};

// Ops with kSplitRows (NVFP4) place a row's bytes themselves (Op::store_split, from the base of
// the row's side); the others get the address of their row. kOneSlot: every unit has slot[0] (a
// unit pair), whose page is located once; nvcc does not merge the per-unit divisions itself.
// `first(raw, m)` is unit m's first side (LoadedFirst, or WidenedFirst for ops that take their
// row's address); a paired unit's value row is raw[m].half[1]. kPairNan: an unpaired FP8 unit pair
// stored with one NaN-byte branch (KVFUSE_FP8_PAIR_NAN_CHECK).
template <class Op, int kUnits, bool kPaired, Division kDiv, bool kNanPerUnit, bool kOneSlot, bool kPairNan = false,
          class First = LoadedFirst>
__device__ __forceinline__ void store_units(const RowParams& p, const Pair<Op> (&raw)[kUnits],
                                            const int64_t (&slot)[kUnits], const int64_t (&dst_row)[kUnits],
                                            const int (&head)[kUnits], const int (&chunk)[kUnits],
                                            const bool (&is_value)[kUnits], const Divider div_k,
                                            const Divider div_v, const First first = {}) {
  static_assert(std::is_same_v<First, LoadedFirst> || !Op::kSplitRows, "split-row ops store the rows as loaded");
  int64_t pair_block = 0, pair_off = 0;
  if constexpr (kOneSlot) {
    if (slot[0] < 0 || slot[0] >= p.capacity) return;
    locate(p, slot[0], pair_block, pair_off);
    if constexpr (kPairNan) {
      static_assert(kUnits == 2 && !kPaired, "an unpaired unit pair: one side, one divider");
      char* base = p.dst + pair_block * p.dst_block + pair_off * p.dst_off;
      Op::template store_pair<kDiv>(first(raw, 0), first(raw, 1), base + dst_row[0], base + dst_row[1], chunk[0],
                                    chunk[1], is_value[0] ? div_v : div_k);
      return;
    }
    if constexpr (Op::kSplitRows && KVFUSE_NVFP4_PAIR_STORE) {
      static_assert(kUnits == 2, "a unit pair");
      char* side = p.dst + pair_block * p.dst_block;
      if constexpr (kPaired) {
        Op::template store_split_pair<kDiv, kNanPerUnit>(raw[0].half[0], raw[1].half[0], side, pair_off, head[0],
                                                         chunk[0], chunk[1], false, div_k, p);
        if (p.halves == 2) {
          Op::template store_split_pair<kDiv, kNanPerUnit>(raw[0].half[1], raw[1].half[1], side + p.dst_kv, pair_off,
                                                           head[0], chunk[0], chunk[1], true, div_v, p);
        }
      } else {
        Op::template store_split_pair<kDiv, kNanPerUnit>(raw[0].half[0], raw[1].half[0],
                                                         is_value[0] ? side + p.dst_kv : side, pair_off, head[0],
                                                         chunk[0], chunk[1], is_value[0], is_value[0] ? div_v : div_k,
                                                         p);
      }
      return;
    }
  }
#pragma unroll
  for (int m = 0; m < kUnits; ++m) {
    int64_t block = pair_block, off = pair_off;
    if constexpr (!kOneSlot) {
      if (slot[m] < 0 || slot[m] >= p.capacity) continue;
      locate(p, slot[m], block, off);
    }
    if constexpr (Op::kSplitRows) {
      char* side = p.dst + block * p.dst_block;
      if constexpr (kPaired) {
        Op::template store_split<kDiv, kNanPerUnit>(raw[m].half[0], side, off, head[m], chunk[m], false, div_k, p);
        if (p.halves == 2) {
          Op::template store_split<kDiv, kNanPerUnit>(raw[m].half[1], side + p.dst_kv, off, head[m], chunk[m], true,
                                                      div_v, p);
        }
      } else {
        Op::template store_split<kDiv, kNanPerUnit>(raw[m].half[0], is_value[m] ? side + p.dst_kv : side, off,
                                                    head[m], chunk[m], is_value[m], is_value[m] ? div_v : div_k, p);
      }
    } else {
      char* dst = p.dst + block * p.dst_block + off * p.dst_off + dst_row[m];
      if constexpr (kPaired) {
        Op::template store<kDiv, kNanPerUnit>(first(raw, m), dst, chunk[m], div_k, p);
        if (p.halves == 2) {
          Op::template store<kDiv, kNanPerUnit>(raw[m].half[1], dst + p.dst_kv, chunk[m], div_v, p);
        }
      } else {
        // Selected by value: a reference to either would put both dividers in local memory.
        Op::template store<kDiv, kNanPerUnit>(first(raw, m), dst, chunk[m], is_value[m] ? div_v : div_k, p);
      }
    }
  }
}

// Units in row-major order, u < p.units: a paired unit is (token, head, chunk) and covers the
// chunk in the key row and, with two halves, in the value row, so both share one slot lookup and
// one address computation; an unpaired unit is (token, half, head, chunk), half the work per
// thread for twice the threads (shorter per-thread arithmetic in small launches).
// Where item `item` of an unpaired launch, (token, half, head, index), lies (index: a chunk or a
// chunk pair): its token, half (value or key), head and index, and the byte offset of its head
// row within its slot's key row; returns its source row. The outputs are references so that a
// unit's arrays take them as they are computed (a returned struct scheduled the NVFP4 kernels
// differently).
__device__ __forceinline__ const char* locate_unpaired(const RowParams& p, uint32_t item, int64_t& tok, bool& value,
                                                      int& head, int& index, int64_t& dst_row) {
  const auto tr = p.items.divmod(item);
  tok = p.first_token + tr.div;
  value = tr.mod >= p.per_half;
  const auto hc = p.chunks.divmod(value ? tr.mod - p.per_half : tr.mod);
  head = static_cast<int>(hc.div);
  index = static_cast<int>(hc.mod);
  // Selected by value: indexing p.src by a runtime value would copy the params to local memory.
  const char* src = value ? p.src[1] + tok * p.src_tok[1] + head * p.src_head[1]
                          : p.src[0] + tok * p.src_tok[0] + head * p.src_head[0];
  dst_row = head * p.dst_head + (value ? p.dst_kv : 0);
  return src;
}

// Asks L2 for the bytes [ptr, ptr + bytes), one 32-byte sector at a time. (The bulk prefetch,
// cp.async.bulk.prefetch.L2, takes warp-uniform operands: per-lane addresses made nvcc loop over
// the lanes.)
__device__ __forceinline__ void prefetch_l2(const char* ptr, int bytes) {
#pragma unroll
  for (int b = 0; b < bytes; b += 32) asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr + b) : "memory");
}

// Which FP8 store kernels take Division::kExact for power-of-two scales (a third copy of the store)
// and check a unit's words for NaN bytes in one branch (fp8_words): each costs registers, and
// where a kernel sat at its register budget ptxas spilled. So: the writes alone; unit-pair
// rotations (PairRotation), except the exact copy over full-width float32 tables (8 bytes spilled,
// up to 7% slower at 4096-16384 tokens) and the one NaN branch in paired launches over 16-bit half
// tables (4 bytes spilled, up to 3.6% slower); the single-unit rotations of 8-element units
// (decode sizes; launched unpaired only, only_unpaired()), which spill nothing with them and ran
// 2-8% faster at 64-1023 tokens on an H200 (BENCHMARKS.md, fifty-fifth session); not those of
// 16-element units (GPT-J, some NeoX tails), several of which spilled and none of which was timed
// with them (fifty-first session). KVFUSE_FP8_NAN_CHECK_PER_UNIT=0: one NaN branch per word
// everywhere.
#ifndef KVFUSE_FP8_NAN_CHECK_PER_UNIT
#define KVFUSE_FP8_NAN_CHECK_PER_UNIT 1
#endif
template <Division kDiv>
using DivisionTag = std::integral_constant<Division, kDiv>;
template <class Rot>
constexpr bool exact_division_fits() {
  if constexpr (!Rot::kActive) {
    return true;
  } else if constexpr (!Rot::kPairs) {
    return Rot::kNarrow;
  } else {
    return !Rot::kFullFloatTable;
  }
}
template <class Rot, bool kPaired>
constexpr bool nan_check_per_unit_fits() {
  if constexpr (!Rot::kActive) {
    return true;
  } else if constexpr (!Rot::kPairs) {
    return Rot::kNarrow;
  } else {
    return !(kPaired && Rot::kHalf16BitTable);
  }
}
template <class Rot>
constexpr bool kExactDivision = KVFUSE_FP8_EXACT_DIVISION && exact_division_fits<Rot>();
template <class Rot, bool kPaired>
constexpr bool kNanCheckPerUnit = KVFUSE_FP8_NAN_CHECK_PER_UNIT && nan_check_per_unit_fits<Rot, kPaired>();

// Resident kBlock-thread blocks per SM a rows_kernel's registers are budgeted for: min_blocks()
// counts kThreads-thread blocks; min_small_blocks(), where not 0, KVFUSE_SMALL_THREADS-thread ones.
template <class Op, bool kPaired, class Rot, int kBlock>
constexpr int launch_min_blocks() {
  constexpr int small = Rot::template min_small_blocks<Op, kPaired, kPrefetches<Rot>, kManyWaves<Rot>>();
  if constexpr (small > 0) return small * KVFUSE_SMALL_THREADS / kBlock;
  return Rot::template min_blocks<Op, kPaired>() * kThreads / kBlock;
}

// Block b takes the kUnits * kBlock units from b * kUnits * kBlock on, thread x of it the units
// x, x + kBlock, ... A block need not hold whole tokens, so any block size serves any row width
// without idle threads or a loop. All of a thread's row and slot loads are issued before any of
// its stores: the loads do not depend on the slots, so both memory latencies overlap, and nothing
// is stored for units whose slot is -1 or out of range.
//
// With a Rotation (rope_encode_and_cache_write), each key unit also loads what its rotation needs
// (Rot::load: the partner chunk and the table values) beside its other loads, and is rotated
// (Rot::apply) once everything is loaded, before the op encodes it.
template <class Op, int kUnits, int kBlock, bool kPaired, class Rot = NoRotation>
__global__ void __launch_bounds__(kBlock, launch_min_blocks<Op, kPaired, Rot, kBlock>())
    rows_kernel(const RowParams p) {
  // Unpaired launches (the small ones: decode steps) work out where their unit or unit pair is
  // read and written from the launch's parameters alone, before the wait (kIndexFirst): a
  // dependent launch does that under the tail of the grid before it, and only the loads follow
  // the wait. In paired launches it was slower (the NVFP4 write at 4096 tokens: BENCHMARKS.md,
  // forty-third session).
  constexpr bool kIndexFirst = KVFUSE_WRITE_INDEX_BEFORE_WAIT && !kPaired;
  // Unit pairs with key and value rows in separate threads, in launches of a wave and less.
  constexpr bool kSmallUnpairedPairs = Rot::kPairs && !kPaired && !kManyWaves<Rot> && !kPrefetches<Rot>;
  // Where the scale dividers are built after the loads: the writes, and rotary writes that hold
  // neither a value row beside the key nor a loaded partner chunk (in those the scales' registers
  // across the loads spill).
  constexpr bool kLateDividers =
      KVFUSE_WRITE_DIVIDERS_AFTER_LOADS && (!Rot::kActive || (!kPaired && !Rot::kLoadsPartner));
  Divider div_k{1.0f, 1.0f, true, true}, div_v{1.0f, 1.0f, true, true};
  float scale_k = 1.0f, scale_v = 1.0f;
  // KVFUSE_FP8_OWN_DIVIDER: the divider of the thread's own half (own_value), as both. Not where
  // the dividers are built before the loads: the select would wait there for both scales.
  constexpr bool kOwnDivider =
      KVFUSE_FP8_OWN_DIVIDER && Op::kUsesScale && !Op::kSplitRows && kIndexFirst && kLateDividers;
  bool own_value = false;
  const auto make_dividers = [&] {
    if constexpr (kOwnDivider) {
      // The select waits until here, after the row loads: at the loads nvcc made it a load through
      // a selected pointer (an indexed constant load that the row loads queued behind) and ptxas a
      // second, predicated load into the first one's register, which the row loads waited for
      // (BENCHMARKS.md, fifty-eighth session). The empty asm keeps both loads.
      asm("" : "+f"(scale_k), "+f"(scale_v));
      div_k = div_v = make_divider(own_value ? scale_v : scale_k);
    } else {
      div_k = make_divider(scale_k);
      div_v = make_divider(scale_v);
    }
  };
  const auto load_scales = [&] {
    if constexpr (Op::kUsesScale) {
      scale_k = __ldg(p.scale[0]);
      scale_v = __ldg(p.scale[1]);
      if constexpr (!kLateDividers) make_dividers();
    }
  };
  const auto start = [&] {
    start_after_prior_grids<KVFUSE_WRITE_PDL>();
    load_scales();
  };
  if constexpr (!kIndexFirst) start();
  static_assert(!Rot::kPairs || kUnits == 2, "a unit pair is two units of one thread");
  const uint32_t first = blockIdx.x * ((Rot::kPairs ? 1 : kUnits) * kBlock) + threadIdx.x;
  Pair<Op> raw[kUnits];
  int64_t slot[kUnits];
  int64_t dst_row[kUnits];  // byte offset of the unit's head row within its slot's key row
  int head[kUnits];  // kSplitRows ops address by head instead
  int chunk[kUnits];
  bool is_value[kUnits];
  typename Rot::Loaded rot[kUnits];
  // Unpaired rotary launches locate their rotation's reads before the wait too (Rotation::locate).
  constexpr bool kLocateFirst = KVFUSE_ROPE_LOCATE_BEFORE_WAIT && kIndexFirst && Rot::kActive;
  typename Rot::Where where;
  if constexpr (Rot::kPairs && !kPaired) {
    // One item per thread, (token, half, head, pair): the pair's two chunks (PairRotation::chunk)
    // are its units 0 and 1, one token, one slot.
    slot[0] = slot[1] = -1;
    const bool live = first < p.units;
    int64_t tok = 0;
    int pair = 0;
    const char* src = nullptr;
    if (live) {
      bool value;
      int h;
      int64_t row;
      src = locate_unpaired(p, first, tok, value, h, pair, row);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        head[m] = h;
        chunk[m] = Rot::chunk(pair, m, p.rope);
        is_value[m] = value;
        dst_row[m] = row;
      }
      own_value = value;
      if (value) pair = -1;  // value items are not rotated
      if constexpr (kLocateFirst) where = Rot::locate(tok, pair, p.rope);
      if constexpr (kPrefetches<Rot>) {
        // The item ahead has this item's head, half and pair, ahead_items / items tokens on.
        if (first + p.ahead_items < p.units) {
          const char* ahead = src + p.ahead_src[value ? 1 : 0];
          constexpr int kChunk = sizeof(typename Rot::Run);
#pragma unroll
          for (int m = 0; m < 2; ++m) prefetch_l2(ahead + int64_t{chunk[m]} * kChunk, kChunk);
        }
      }
    }
    if constexpr (kIndexFirst) start();
    if (live) {
      // RowsFirst launches issue the row loads first. The others load the table columns first: in
      // launches of about a wave and more that order ran faster (BENCHMARKS.md, twenty-sixth and
      // forty-seventh sessions).
      if constexpr (kRowsFirst<Rot>) {
#pragma unroll
        for (int m = 0; m < 2; ++m) raw[m].half[0] = Op::load(src, chunk[m], p);
      }
      slot[0] = slot[1] = slot_of(p, tok);
      if constexpr (kLocateFirst) {
        rot[0] = Rot::load_at(where, tok, p.rope);
      } else {
        rot[0] = Rot::load(tok, pair, p.rope);
      }
      if constexpr (!kRowsFirst<Rot>) {
#pragma unroll
        for (int m = 0; m < 2; ++m) raw[m].half[0] = Op::load(src, chunk[m], p);
      }
    }
  } else if constexpr (Rot::kPairs) {
    // Paired: one item per thread, (token, head, pair), with the value rows of the same chunks.
    slot[0] = slot[1] = -1;
    if (first < p.units) {
      const auto tr = p.items.divmod(first);
      const int64_t tok = p.first_token + tr.div;
      const int64_t s = slot_of(p, tok);
      const auto hc = p.chunks.divmod(tr.mod);
      const int h = static_cast<int>(hc.div), pair = static_cast<int>(hc.mod);
      const char* src = p.src[0] + tok * p.src_tok[0] + h * p.src_head[0];
      // 16-bit caches load their rows first, FP8 and NVFP4 their table columns
      // (KVFUSE_ROPE_16BIT_PAIRED_ROWS_FIRST).
      constexpr bool kPairedRowsFirst = KVFUSE_ROPE_16BIT_PAIRED_ROWS_FIRST && !Op::kUsesScale;
      if constexpr (!kPairedRowsFirst) rot[0] = Rot::load(tok, pair, p.rope);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        slot[m] = s;
        head[m] = h;
        chunk[m] = Rot::chunk(pair, m, p.rope);
        is_value[m] = false;
        raw[m].half[0] = Op::load(src, chunk[m], p);
        if (p.halves == 2) {
          raw[m].half[1] = Op::load(p.src[1] + tok * p.src_tok[1] + h * p.src_head[1], chunk[m], p);
        }
        dst_row[m] = h * p.dst_head;
      }
      if constexpr (kPairedRowsFirst) rot[0] = Rot::load(tok, pair, p.rope);
    }
  } else if constexpr (!kPaired) {
    // One unit per thread, (token, half, head, chunk).
    static_assert(kUnits == 1, "unpaired launches take one unit per thread");
    const bool live = first < p.units;
    int64_t tok = 0;
    const char* src = nullptr;
    slot[0] = -1;
    if (live) {
      src = locate_unpaired(p, first, tok, is_value[0], head[0], chunk[0], dst_row[0]);
      own_value = is_value[0];
      if constexpr (kLocateFirst) where = Rot::locate(src, tok, is_value[0] ? -1 : chunk[0], p.rope);
    }
    if constexpr (kIndexFirst) start();
    if (live) {
      slot[0] = slot_of(p, tok);
      raw[0].half[0] = Op::load(src, chunk[0], p);
      if constexpr (kLocateFirst) {
        rot[0] = Rot::load_at(where, tok, p.rope);
      } else if constexpr (Rot::kActive) {
        rot[0] = Rot::template load<Op::kRopeCheckFirst>(src, tok, is_value[0] ? -1 : chunk[0], p.rope);
      }
    } else if constexpr (Rot::kActive) {
#pragma unroll
      for (int w = 0; w < Rot::Run::kWords; ++w) raw[0].half[0].words[w] = make_uint4(0, 0, 0, 0);
    }
  } else {
    // Paired: kUnits units per thread, (token, head, chunk), each with its value row.
#pragma unroll
    for (int m = 0; m < kUnits; ++m) {
      const uint32_t u = first + m * kBlock;
      slot[m] = -1;
      if (u < p.units) {
        const auto tr = p.items.divmod(u);
        const int64_t tok = p.first_token + tr.div;
        slot[m] = slot_of(p, tok);
        const auto hc = p.chunks.divmod(tr.mod);
        head[m] = static_cast<int>(hc.div);
        chunk[m] = static_cast<int>(hc.mod);
        const char* key_row = p.src[0] + tok * p.src_tok[0] + head[m] * p.src_head[0];
        raw[m].half[0] = Op::load(key_row, chunk[m], p);
        if constexpr (Rot::kActive) rot[m] = Rot::template load<Op::kRopeCheckFirst>(key_row, tok, chunk[m], p.rope);
        if (p.halves == 2) {
          raw[m].half[1] = Op::load(p.src[1] + tok * p.src_tok[1] + head[m] * p.src_head[1], chunk[m], p);
        }
        dst_row[m] = head[m] * p.dst_head;
      } else if constexpr (Rot::kActive) {
        // A lane without a unit still takes part in the partner exchange (Rotation::exchange).
#pragma unroll
        for (int w = 0; w < Rot::Run::kWords; ++w) raw[m].half[0].words[w] = make_uint4(0, 0, 0, 0);
      }
    }
  }
  if constexpr (Op::kUsesScale && kLateDividers) make_dividers();
  // One branch per block instead of one per value: the division is a template argument. 16-bit
  // caches divide by nothing. NVFP4 divides by its own means (its global scale) and ignores the
  // argument, but keeps two copies of its store behind the fast-window branch: with one copy its
  // rotary writes over bfloat16 half tables ran 1-2% slower at 2048 and 4096 tokens
  // (BENCHMARKS.md, fifty-first session).
  const auto store = [&](auto first) {
    constexpr bool kNanPerUnit = kNanCheckPerUnit<Rot, kPaired>;
    constexpr bool kPairNan = KVFUSE_FP8_PAIR_NAN_CHECK && kSmallUnpairedPairs && kNanPerUnit && Op::kUsesScale &&
                              !Op::kSplitRows;
    const auto store_by = [&](auto division) {
      store_units<Op, kUnits, kPaired, decltype(division)::value, kNanPerUnit, Rot::kPairs, kPairNan>(
          p, raw, slot, dst_row, head, chunk, is_value, div_k, div_v, first);
    };
    if constexpr (!Op::kUsesScale) {
      store_by(DivisionTag<Division::kExact>{});
    } else {
      if constexpr (!Op::kSplitRows && kExactDivision<Rot>) {
        if (div_k.exact && div_v.exact) return store_by(DivisionTag<Division::kExact>{});
      }
      if (div_k.fast && div_v.fast) {
        store_by(DivisionTag<Division::kReciprocal>{});
      } else {
        store_by(DivisionTag<Division::kDivide>{});
      }
    }
  };
  if constexpr (Rot::kPairs && Rot::template kWidens<Op>) {
    Widened<Rot::N> key[2];
    Rot::apply_widened(raw[0].half[0], raw[1].half[0], rot[0], key[0], key[1]);
    return store(WidenedFirst<Rot::N>{key});
  } else if constexpr (Rot::kPairs) {
    if (slot[0] >= 0) Rot::apply(raw[0].half[0], raw[1].half[0], rot[0], p.rope);
  } else if constexpr (Rot::kActive) {
#pragma unroll
    for (int m = 0; m < kUnits; ++m) {
      Rot::exchange(raw[m].half[0], rot[m], p.rope);
      if (slot[m] >= 0) Rot::apply(raw[m].half[0], rot[m], p.rope);
    }
  }
  store(LoadedFirst{});
}

// ----------------------------------------------------------------------------- row ops
// Each op: Raw (the registers one unit loads), load(src_row, chunk, params), store(raw, dst_row,
// chunk, divider, params) or, with kSplitRows, store_split (see store_units); kMinBlocks, the
// resident blocks per SM its register budget is set for (4 at 256 threads: at most 64
// registers); kUnits, the units per thread at large token counts.

template <int W>
struct CopyOp {
  static constexpr bool kUsesScale = false;
  static constexpr bool kSplitRows = false;
  static constexpr int kMinBlocks = KVFUSE_COPY_MIN_BLOCKS;
  static constexpr int kUnits = KVFUSE_COPY_UNITS;
  using Raw = typename Word<W>::type;
  __device__ __forceinline__ static Raw load(const char* s, int c, const RowParams&) {
    if constexpr (W == 16 && KVFUSE_LOAD_HINT) return __ldcs(reinterpret_cast<const Raw*>(s) + c);
    return reinterpret_cast<const Raw*>(s)[c];
  }
  template <Division, bool>
  __device__ __forceinline__ static void store(const Raw& raw, char* d, int c, const Divider, const RowParams&) {
    if constexpr (W == 16 && KVFUSE_STORE_HINT) {
      __stcs(reinterpret_cast<Raw*>(d) + c, raw);
    } else {
      reinterpret_cast<Raw*>(d)[c] = raw;
    }
  }
};

// Element k of a run as float. bfloat16 is float's upper half: element k of a 32-bit word of two
// is that word's high half masked (odd k) or its low half shifted up (even k), one integer op,
// where converting a separately extracted 16-bit value takes two. Used by the rotation only: in
// the ops' own element reads it left the FP8 write unchanged and made the NVFP4 write 1-2% slower
// (BENCHMARKS.md, fifteenth session).
template <typename T>
__device__ __forceinline__ float widen(const T* e, int k) {
  if constexpr (KVFUSE_BF16_WORD_WIDEN && std::is_same_v<T, c10::BFloat16>) {
    const uint32_t w = reinterpret_cast<const uint32_t*>(e)[k / 2];
    return __uint_as_float(k % 2 ? w & 0xffff0000u : w << 16);
  } else {
    return static_cast<float>(e[k]);
  }
}

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
      for (int w = 0; w < kWords; ++w) {
        out.words[w] = KVFUSE_LOAD_HINT ? __ldcs(reinterpret_cast<const uint4*>(p) + w)
                                        : reinterpret_cast<const uint4*>(p)[w];
      }
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) out.e[k] = p[k];
    }
    return out;
  }
  __device__ __forceinline__ float operator[](int k) const { return static_cast<float>(e[k]); }
};

template <typename Fp8>
constexpr __nv_fp8_interpretation_t kFp8Interp = std::is_same_v<Fp8, E4M3> ? __NV_E4M3 : __NV_E5M2;
template <typename Fp8>
constexpr uint32_t kFp8MaxCode = std::is_same_v<Fp8, E4M3> ? 0x7Eu : 0x7Bu;  // 448, 57344

// The FP8 byte of a quotient the fast path could not settle (a NaN byte): NaN when q0 is NaN,
// keeping its sign as c10's conversion does (the hardware writes one canonical NaN); otherwise
// q0 is infinite (x = inf, or x / d beyond float range) and the byte saturates.
template <typename Fp8>
__device__ __forceinline__ uint32_t fp8_special(float q0) {
  const uint32_t sign = (__float_as_uint(q0) >> 24) & 0x80u;
  return sign | (isnan(q0) ? 0x7Fu : kFp8MaxCode<Fp8>);
}

// 1: four FP8 bytes are packed by two converts into the halves of one 32-bit register (fp8x4_pack);
// 0: by cuda_fp8.h's pair converts, whose 16-bit results nvcc masks and permutes into the word.
#ifndef KVFUSE_FP8_PACK_ASM
#define KVFUSE_FP8_PACK_ASM 1
#endif

// c[0..3] saturated to FP8 as the bytes of one word, c[0] lowest. (cvt's first source goes to
// the upper byte of its pair.)
template <typename Fp8>
__device__ __forceinline__ uint32_t fp8x4_pack(const float (&c)[4]) {
  if constexpr (KVFUSE_FP8_PACK_ASM) {
    uint32_t bytes;
    if constexpr (std::is_same_v<Fp8, E4M3>) {
      asm("{\n.reg .b16 lo, hi;\n"
          "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
          "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
          "mov.b32 %0, {lo, hi};\n}"
          : "=r"(bytes) : "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    } else {
      asm("{\n.reg .b16 lo, hi;\n"
          "cvt.rn.satfinite.e5m2x2.f32 lo, %2, %1;\n"
          "cvt.rn.satfinite.e5m2x2.f32 hi, %4, %3;\n"
          "mov.b32 %0, {lo, hi};\n}"
          : "=r"(bytes) : "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    }
    return bytes;
  } else {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(c[0], c[1]), __NV_SATFINITE, kFp8Interp<Fp8>);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c[2], c[3]), __NV_SATFINITE, kFp8Interp<Fp8>);
    return __byte_perm(lo, hi, 0x5410);
  }
}

// The saturating convert sends finite overflow and inf to the largest finite value, so a byte
// whose low seven bits are all ones came from a NaN q1: a NaN input, or an infinite q0. Such
// bytes are found word-wide (fp8_nan_bytes: their top bits) and redone in a rarely taken branch
// (fp8_fix_nan_bytes).
__device__ __forceinline__ uint32_t fp8_nan_bytes(uint32_t bytes) {
  const uint32_t low7_clear = ~bytes & 0x7F7F7F7Fu;  // 0 exactly in the NaN bytes
  return ~(low7_clear + 0x7F7F7F7Fu) & 0x80808080u;  // no carry crosses a byte
}

template <typename Fp8>
__device__ __forceinline__ uint32_t fp8_fix_nan_bytes(uint32_t bytes, uint32_t is_nan, const Quotient (&q)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (is_nan & (0x80u << (8 * k))) bytes = (bytes & ~(0xFFu << (8 * k))) | (fp8_special<Fp8>(q[k].q0) << (8 * k));
  }
  return bytes;
}

// f[0, 4 kWords) / div as kWords words of FP8 bytes, each word's four quotients computed just
// before its converts (all of them first held more registers, and ptxas spilled in four kernels).
// The common path pays a few word-wide operations per four values, and on the corrected
// reciprocal's path a copysign per value (the other paths' quotients carry their sign).
// kNanPerUnit: one NaN-byte branch for all the words (kNanCheckPerUnit), else one per word.
template <typename Fp8, Division kDiv, bool kNanPerUnit, int kWords, class Src>
__device__ __forceinline__ void fp8_words(const Src& f, const Divider div, uint32_t (&words)[kWords]) {
  Quotient q[kWords][4];
  uint32_t any_nan = 0;
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
#pragma unroll
    for (int k = 0; k < 4; ++k) q[w][k] = divide_parts<kDiv>(f[4 * w + k], div);
    float c[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) c[k] = kDiv == Division::kReciprocal ? copysignf(q[w][k].q1, q[w][k].q0) : q[w][k].q1;
    words[w] = fp8x4_pack<Fp8>(c);
    if constexpr (kNanPerUnit) {
      any_nan |= fp8_nan_bytes(words[w]);
    } else {
      const uint32_t is_nan = fp8_nan_bytes(words[w]);
      if (__builtin_expect(is_nan != 0, 0)) words[w] = fp8_fix_nan_bytes<Fp8>(words[w], is_nan, q[w]);
    }
  }
  if constexpr (kNanPerUnit) {
    if (__builtin_expect(any_nan != 0, 0)) {
#pragma unroll
      for (int w = 0; w < kWords; ++w) words[w] = fp8_fix_nan_bytes<Fp8>(words[w], fp8_nan_bytes(words[w]), q[w]);
    }
  }
}

// Two units' elements as one run of 2 N (EncodeOp::store_pair).
template <int N, class A, class B>
struct Joined {
  const A& a;
  const B& b;
  __device__ __forceinline__ float operator[](int k) const { return k < N ? a[k] : b[k - N]; }
};

template <typename In, typename Out, int N>
struct EncodeOp {
  static constexpr bool kUsesScale = kIsFp8<Out>;
  static constexpr bool kSplitRows = false;
  static constexpr bool kRopeCheckFirst = kIsFp8<Out>;  // Rotation::load
  // float32 input holds twice the registers per unit: one block fewer, or the compiler spills.
  static constexpr int kMinBlocks = !kIsFp8<Out>     ? KVFUSE_COPY_MIN_BLOCKS
                                    : sizeof(In) > 2 ? (KVFUSE_FP8_MIN_BLOCKS > 2 ? KVFUSE_FP8_MIN_BLOCKS - 1 : 2)
                                                     : KVFUSE_FP8_MIN_BLOCKS;
  // FP8 units are twice as wide (16 values) as cast units.
  static constexpr int kUnits = kIsFp8<Out> ? KVFUSE_FP8_UNITS : KVFUSE_COPY_UNITS;
  static constexpr bool kVector = N > 1;
  using Raw = Elements<In, N, kVector>;
  __device__ __forceinline__ static Raw load(const char* s, int c, const RowParams&) { return Raw::load(s, c); }
  // One unit's N FP8 bytes (words[0, N / 4)) as 8-byte stores from out.
  __device__ __forceinline__ static void store_narrow(uint8_t* out, const uint32_t* words) {
#pragma unroll
    for (int w = 0; w < N / 8; ++w) {
      const uint2 word = make_uint2(words[2 * w], words[2 * w + 1]);
      if constexpr (KVFUSE_NARROW_STORE_HINT) {
        __stcs(reinterpret_cast<uint2*>(out) + w, word);
      } else {
        reinterpret_cast<uint2*>(out)[w] = word;
      }
    }
  }
  // Two FP8 units of one slot (a unit pair) with one NaN-byte branch between them.
  template <Division kDiv, class A, class B>
  __device__ __forceinline__ static void store_pair(const A& f0, const B& f1, char* d0, char* d1, int c0, int c1,
                                                    const Divider div) {
    static_assert(kIsFp8<Out> && N % 8 == 0, "FP8 units of whole 8-byte stores");
    uint32_t words[N / 2];
    fp8_words<Out, kDiv, true>(Joined<N, A, B>{f0, f1}, div, words);
    store_narrow(reinterpret_cast<uint8_t*>(d0) + static_cast<int64_t>(c0) * N, words);
    store_narrow(reinterpret_cast<uint8_t*>(d1) + static_cast<int64_t>(c1) * N, words + N / 4);
  }
  template <Division kDiv, bool kNanPerUnit, class Src>
  __device__ __forceinline__ static void store(const Src& f, char* d, int c, const Divider div, const RowParams&) {
    if constexpr (kIsFp8<Out>) {
      uint8_t* out = reinterpret_cast<uint8_t*>(d) + static_cast<int64_t>(c) * N;
      if constexpr (N == 1) {
        const Quotient q = divide_parts<kDiv>(f[0], div);
        const float v = copysignf(q.q1, q.q0);
        out[0] = isnan(v) ? fp8_special<Out>(q.q0)
                          : static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kFp8Interp<Out>));
      } else {
        static_assert(N % 8 == 0, "whole 8-byte stores per unit");
        uint32_t words[N / 4];
        fp8_words<Out, kDiv, kNanPerUnit>(f, div, words);
        if constexpr (N == 16) {
          const uint4 word = make_uint4(words[0], words[1], words[2], words[3]);
          if constexpr (KVFUSE_STORE_HINT) {
            __stcs(reinterpret_cast<uint4*>(out), word);
          } else {
            *reinterpret_cast<uint4*>(out) = word;
          }
        } else {
          store_narrow(out, words);
        }
      }
    } else if constexpr (std::is_same_v<In, Out> && kVector) {
      // A cache of the input's dtype (the rotary write's 16-bit caches): the words as they are.
      uint4* out = reinterpret_cast<uint4*>(reinterpret_cast<Out*>(d) + static_cast<int64_t>(c) * N);
#pragma unroll
      for (int w = 0; w < Raw::kWords; ++w) {
        if constexpr (KVFUSE_STORE_HINT) {
          __stcs(out + w, f.words[w]);
        } else {
          out[w] = f.words[w];
        }
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
          if constexpr (KVFUSE_STORE_HINT) {
            __stcs(reinterpret_cast<uint4*>(out) + w, word);
          } else {
            reinterpret_cast<uint4*>(out)[w] = word;
          }
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

// The value of a finite e4m3fn byte by the hardware convert (sm_89+): e4m3x2 -> f16x2, the byte in
// the low half; every e4m3 value is an f16, so the result is exact.
__device__ __forceinline__ float e4m3_value(uint8_t b) {
  uint32_t pair;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"(static_cast<unsigned short>(b)));
  float v;
  asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(static_cast<unsigned short>(pair & 0xFFFFu)));
  return v;
}

// max(m, |v|), NaN if either is NaN (max.NaN; fmaxf would drop the NaN).
__device__ __forceinline__ float max_abs_keep_nan(float m, float v) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
  return r;
}

// Per 16-bit lane, max(|a|, |b|), NaN if either is NaN; the lane's sign (the inputs' xor) is noise.
template <typename T>
__device__ __forceinline__ uint32_t max_abs_lanes_keep_nan(uint32_t a, uint32_t b) {
  uint32_t r;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  } else {
    asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  }
  return r;
}

// max |x| over 16 16-bit elements, NaN if one is NaN: a tree of lane maxima over their 8 words.
template <typename T>
__device__ __forceinline__ float max_abs_words_keep_nan(const uint32_t (&w)[8]) {
  uint32_t m[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) m[i] = max_abs_lanes_keep_nan<T>(w[2 * i], w[2 * i + 1]);
  const uint32_t last = max_abs_lanes_keep_nan<T>(max_abs_lanes_keep_nan<T>(m[0], m[1]),
                                                  max_abs_lanes_keep_nan<T>(m[2], m[3]));
  const T* lanes = reinterpret_cast<const T*>(&last);
  return max_abs_keep_nan(fabsf(widen(lanes, 0)), widen(lanes, 1));
}

// Element k of an NVFP4 unit as float (widened from its word for bfloat16 when configured).
template <class Raw>
__device__ __forceinline__ float element(const Raw& f, int k) {
  if constexpr (KVFUSE_NVFP4_WORD_WIDEN) {
    return widen(f.e, k);
  } else {
    return f[k];
  }
}

// One encoded NVFP4 block: 16 codes, the low nibble first, and the block-scale byte.
struct Nvfp4Block {
  uint32_t lo, hi;
  uint8_t scale;
};

__device__ __forceinline__ void store_nvfp4_data(const RowParams& p, char* data, uint32_t lo, uint32_t hi) {
  if (p.store_width == 8) {
    *reinterpret_cast<uint2*>(data) = make_uint2(lo, hi);
  } else if (p.store_width == 4) {
    reinterpret_cast<uint32_t*>(data)[0] = lo;
    reinterpret_cast<uint32_t*>(data)[1] = hi;
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) data[k] = static_cast<char>(((k < 4 ? lo : hi) >> (8 * (k % 4))) & 0xFF);
  }
}

// Blocks c0 and c1 of one (side, token t, head): store_nvfp4_block's bytes, with the row's data
// and scale addresses computed once. store_nvfp4_block keeps its own copy of the data store:
// calling store_nvfp4_data from it changed the SASS of every NVFP4 write kernel.
__device__ __forceinline__ void store_nvfp4_pair(const RowParams& p, char* side, int64_t t, int head, int c0,
                                                 int c1, bool is_value, const Nvfp4Block& b0,
                                                 const Nvfp4Block& b1) {
  char* data = side + nvfp4_data_offset(p.nvfp4, t, head);
  store_nvfp4_data(p, data + c0 * (kNvfp4Block / 2), b0.lo, b0.hi);
  store_nvfp4_data(p, data + c1 * (kNvfp4Block / 2), b1.lo, b1.hi);
  if (is_value && p.nvfp4.v_group > 0) {
    // nvfp4_scale_offset's interleaved form, its (t, head) part once: group g, block r of it at
    // g * scale_tok + 4 r on.
    char* row = side + nvfp4_scale_offset(p.nvfp4, true, t, head, 0, 0);
    const auto g0 = p.v_group.divmod(static_cast<uint32_t>(c0));
    const auto g1 = p.v_group.divmod(static_cast<uint32_t>(c1));
    row[g0.div * p.nvfp4.scale_tok + 4 * g0.mod] = static_cast<char>(b0.scale);
    row[g1.div * p.nvfp4.scale_tok + 4 * g1.mod] = static_cast<char>(b1.scale);
  } else {
    char* row = side + nvfp4_scale_offset(p.nvfp4, false, t, head, 0, 0);
    row[c0] = static_cast<char>(b0.scale);
    row[c1] = static_cast<char>(b1.scale);
  }
}

// Stores one NVFP4 block (8 packed bytes, the low nibble first, and its scale byte) of (side,
// token t, head, block c): the data as one 8-byte word where p.store_width allows, the scale as one
// byte at its linear or interleaved address (nvfp4_page.h).
__device__ __forceinline__ void store_nvfp4_block(const RowParams& p, char* side, int64_t t, int head, int c,
                                                  bool is_value, uint32_t lo, uint32_t hi, uint8_t scale) {
  char* data = side + nvfp4_data_offset(p.nvfp4, t, head) + static_cast<int64_t>(c) * (kNvfp4Block / 2);
  if (p.store_width == 8) {
    *reinterpret_cast<uint2*>(data) = make_uint2(lo, hi);
  } else if (p.store_width == 4) {
    reinterpret_cast<uint32_t*>(data)[0] = lo;
    reinterpret_cast<uint32_t*>(data)[1] = hi;
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) data[k] = static_cast<char>(((k < 4 ? lo : hi) >> (8 * (k % 4))) & 0xFF);
  }
  int64_t at;
  if (is_value && p.nvfp4.v_group > 0) {
    const auto gr = p.v_group.divmod(static_cast<uint32_t>(c));
    at = nvfp4_scale_offset(p.nvfp4, true, t, head, gr.div, gr.mod);
  } else {
    at = nvfp4_scale_offset(p.nvfp4, false, t, head, 0, c);
  }
  side[at] = static_cast<char>(scale);
}

// One 16-element NVFP4 block per work item: 8 packed bytes + 1 block-scale byte.
template <typename In, bool kVector>
struct Nvfp4Op {
  static constexpr bool kUsesScale = true;
  static constexpr bool kSplitRows = true;
  static constexpr bool kRopeCheckFirst = false;  // Rotation::load
  // One unit per thread, and as many resident threads as the registers allow without spilling
  // (48 for 16-bit inputs, one block fewer for float32's wider units): 3 blocks per SM took 72%
  // of copy at 16384 tokens where 5 take 77%, and 2 units per thread lost (BENCHMARKS.md).
  static constexpr int kMinBlocks = sizeof(In) > 2 ? KVFUSE_NVFP4_MIN_BLOCKS - 1 : KVFUSE_NVFP4_MIN_BLOCKS;
  static constexpr int kUnits = 1;
  using Raw = Elements<In, kNvfp4Block, kVector>;
  __device__ __forceinline__ static Raw load(const char* s, int c, const RowParams&) { return Raw::load(s, c); }
  __device__ __forceinline__ static Nvfp4Block encode(const Raw& f, const Divider global) {
    // NaN encodes as +0 and is ignored by amax: zero it once, so neither loop below tests it.
    float x[kNvfp4Block];
    float amax = 0.0f;
    if constexpr (KVFUSE_NVFP4_NAN_BRANCH) {
      if constexpr (KVFUSE_NVFP4_PACKED_AMAX && kVector && sizeof(In) == 2) {
        uint32_t words[kNvfp4Block / 2];
#pragma unroll
        for (int w = 0; w < kNvfp4Block / 2; ++w) words[w] = reinterpret_cast<const uint32_t*>(f.e)[w];
        amax = max_abs_words_keep_nan<In>(words);
#pragma unroll
        for (int k = 0; k < kNvfp4Block; ++k) x[k] = element(f, k);
      } else {
#pragma unroll
        for (int k = 0; k < kNvfp4Block; ++k) {
          x[k] = element(f, k);
          amax = max_abs_keep_nan(amax, x[k]);
        }
      }
      if (isnan(amax)) {
        amax = 0.0f;
#pragma unroll
        for (int k = 0; k < kNvfp4Block; ++k) {
          x[k] = isnan(x[k]) ? 0.0f : x[k];
          amax = fmaxf(amax, fabsf(x[k]));
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < kNvfp4Block; ++k) {
        x[k] = isnan(element(f, k)) ? 0.0f : element(f, k);
        amax = fmaxf(amax, fabsf(x[k]));
      }
    }
    float denom;
    uint8_t scale_bits;
    if constexpr (KVFUSE_NVFP4_HW_SCALE) {
      scale_bits = nvfp4_block_scale(
          amax, global.d, [](float v) { return e4m3_rne(v); }, &denom, [](uint8_t b) { return e4m3_value(b); });
    } else {
      scale_bits = nvfp4_block_scale(amax, global.d, [](float v) { return e4m3_rne(v); }, &denom);
    }
    // The reference's definition: one correctly rounded reciprocal per block, a product per
    // element (explicit _rn intrinsics: no contraction into a neighbouring operation).
    const float recip = __frcp_rn(denom > 0.0f ? denom : 1.0f);  // = div.rn(1, denom)
    // A block whose divisor is not > 0 encodes all-zero codes (the reference's q = 0).
    const uint32_t keep = denom > 0.0f ? 0xFFFFFFFFu : 0u;
    uint32_t packed[2];
    if constexpr (KVFUSE_NVFP4_BIASED_CODES) {
      // Each word starts at minus its 8 codes' biases (mod 2^32); a code (<= 15) added at its
      // nibble does not carry into the next.
      packed[0] = packed[1] = 0u - kE2m1CodeBias * 0x11111111u;
#pragma unroll
      for (int k = 0; k < kNvfp4Block; ++k) {
        packed[k / 8] += e2m1_code_biased(__fmul_rn(x[k], recip)) << (4 * (k % 8));
      }
    } else {
      packed[0] = packed[1] = 0u;
#pragma unroll
      for (int k = 0; k < kNvfp4Block; ++k) {
        packed[k / 8] |= e2m1_code_not_nan(__fmul_rn(x[k], recip)) << (4 * (k % 8));
      }
    }
    return {packed[0] & keep, packed[1] & keep, scale_bits};
  }
  template <Division, bool>
  __device__ __forceinline__ static void store_split(const Raw& f, char* side, int64_t t, int head, int c,
                                                     bool is_value, const Divider global, const RowParams& p) {
    const Nvfp4Block b = encode(f, global);
    store_nvfp4_block(p, side, t, head, c, is_value, b.lo, b.hi, b.scale);
  }
  // Two blocks of one (side, token, head), as a unit pair has them: both encoded first, then
  // their row's data and scale addresses located once for both.
  template <Division, bool>
  __device__ __forceinline__ static void store_split_pair(const Raw& f0, const Raw& f1, char* side, int64_t t,
                                                          int head, int c0, int c1, bool is_value,
                                                          const Divider global, const RowParams& p) {
    const Nvfp4Block b0 = encode(f0, global), b1 = encode(f1, global);
    store_nvfp4_pair(p, side, t, head, c0, c1, is_value, b0, b1);
  }
};

// Copies already-encoded NVFP4 rows ([D/2 data | D/16 scales] each) into cache pages, one block
// per unit: kLoad-byte loads of the 8 data bytes (as the source rows' alignment allows), one byte
// load of the scale; stores as in Nvfp4Op.
template <int kLoad>
struct Nvfp4CopyOp {
  static constexpr bool kUsesScale = false;
  static constexpr bool kSplitRows = true;
  static constexpr int kMinBlocks = KVFUSE_COPY_MIN_BLOCKS;
  static constexpr int kUnits = KVFUSE_COPY_UNITS;
  struct Raw {
    uint32_t lo, hi;
    uint8_t scale;
  };
  __device__ __forceinline__ static Raw load(const char* s, int c, const RowParams& p) {
    const char* data = s + static_cast<int64_t>(c) * (kNvfp4Block / 2);
    Raw out;
    if constexpr (kLoad == 8) {
      const uint2 w = *reinterpret_cast<const uint2*>(data);
      out.lo = w.x;
      out.hi = w.y;
    } else if constexpr (kLoad == 4) {
      out.lo = reinterpret_cast<const uint32_t*>(data)[0];
      out.hi = reinterpret_cast<const uint32_t*>(data)[1];
    } else {
      const auto* b = reinterpret_cast<const uint8_t*>(data);
      out.lo = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
      out.hi = b[4] | (b[5] << 8) | (b[6] << 16) | (static_cast<uint32_t>(b[7]) << 24);
    }
    out.scale = static_cast<uint8_t>(s[p.head_size / 2 + c]);
    return out;
  }
  template <Division, bool>
  __device__ __forceinline__ static void store_split(const Raw& r, char* side, int64_t t, int head, int c,
                                                     bool is_value, const Divider, const RowParams& p) {
    store_nvfp4_block(p, side, t, head, c, is_value, r.lo, r.hi, r.scale);
  }
};

// ----------------------------------------------------------------------------- rotary embedding
// rope_encode_and_cache_write rotates each key unit of 16 elements before its op encodes it, with
// the arithmetic CUDA's other kernels give x * cos + rot * sin (kvfuse/ops/reference.py,
// apply_rope with contract=True): in float32,
//     y_i = fma(x_i, cos_i, rn(rot_i * sin_i)),
// rot = [-x2, x1] over the halves of [0, R) (NeoX) or [-x1, x0, -x3, x2, ...] (GPT-J), then
// rounded once to the key's dtype. Triton contracts the sum so (the op's Triton kernel, and
// Inductor's rotation in the unfused graph that the compile pass must reproduce), so every CUDA
// path of the op writes the same bytes. With bf16 / fp16 tables and keys x_i * cos_i is exact
// in float32 (but below its normal range), and the uncontracted form (KVFUSE_ROPE_CONTRACT=0, the
// CPU reference's) gives the same bits; with float32 tables they differ.
// Host-side preconditions (rope_refusal): 16-element units (head_size % 16 == 0, 16-byte aligned
// rows), R % 32 == 0 for NeoX (a unit and its partner, R/2 elements away, lie in one half) and
// R % 16 == 0 for GPT-J (pairs never straddle a unit), tables 16-byte aligned by base and row.

constexpr int kRopeUnit = 16;
constexpr int kRopeNarrowUnit = 8;

// NeoX launches in units of N elements: whether a head's units lie in one warp (then partners are
// exchanged by shuffle), and the lane distance to the partner, rotary_dim / (2 N).
template <int N>
int partner_lanes(int64_t head_size, int rotary_dim) {
  return KVFUSE_ROPE_PARTNER_SHUFFLE && 32 % (head_size / N) == 0 ? rotary_dim / (2 * N) : 0;
}

// lo and hi rounded to T (bfloat16 or half) and packed as one 32-bit word, lo in the low half: one
// cvt.rn.{bf16x2,f16x2}.f32. Each half is what c10's float -> T conversion gives on the device
// (cvt.rn to T, one value at a time), so the packing changes no bit; it saves the shifts, masks
// and byte permutes that placing two separate conversions into one word costs: 165 -> 147
// instructions from the partner exchange to the encode in the e4m3 / bf16 / NeoX kernel's SASS.
template <typename T>
__device__ __forceinline__ uint32_t round_pair(float lo, float hi) {
  static_assert(std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>, "16-bit keys only");
  uint32_t word;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(hi), "f"(lo));
  }
  return word;
}

// v rounded to bfloat16 (c10's conversion, cvt.rn) as a float: the upper half of a bf16x2 convert
// whose lower half converts +0.
__device__ __forceinline__ float round_bf16(float v) {
  uint32_t word;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(v), "f"(0.0f));
  return __uint_as_float(word);
}

// The table row of token tok: its position, or tok itself without positions.
__device__ __forceinline__ int64_t rope_table_row(int64_t tok, const RopeParams& r) {
  return r.positions == nullptr ? tok
         : r.positions64        ? __ldg(static_cast<const int64_t*>(r.positions) + tok)
                                : __ldg(static_cast<const int32_t*>(r.positions) + tok);
}

// The two steps of a unit's table addresses (Rotation / PairRotation::locate, load_at): from the
// launch's parameters alone, byte `col` of table row `tok`, or of row 0 where positions pick the
// row; then, after the wait, that position's row added (a load of positions).
__device__ __forceinline__ void locate_columns(int64_t tok, int64_t col, const RopeParams& r, const char*& cos,
                                               const char*& sin) {
  const int64_t t = r.positions == nullptr ? tok : 0;
  cos = r.cos + t * r.cos_row + col;
  sin = r.sin + t * r.sin_row + col;
}

__device__ __forceinline__ void add_position_row(int64_t tok, const RopeParams& r, const char*& cos,
                                                 const char*& sin) {
  if (r.positions != nullptr) {
    const int64_t t = rope_table_row(tok, r);
    cos += t * r.cos_row;
    sin += t * r.sin_row;
  }
}

// K values of a table row from column col0 on: whole 16-byte words, read through the read-only
// cache (every head of a token reads the same row).
template <typename T, int K>
struct TableRun {
  static constexpr int kWords = K * static_cast<int>(sizeof(T)) / 16;
  static_assert(kWords >= 1 && (K * sizeof(T)) % 16 == 0, "table runs are whole 16-byte words");
  union {
    uint4 words[kWords];
    T e[K];
  };
  __device__ __forceinline__ TableRun() {}
  // half: only the first K / 2 values (a half-width GPT-J table holds one column per pair); a
  // one-word run loads them as one 8-byte word (col0 is then a multiple of 8 / sizeof(T)).
  __device__ __forceinline__ static TableRun load(const char* row, int col0, bool half) {
    TableRun out;
    const uint4* w = reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(row) + col0);
    if constexpr (kWords == 1) {
      if (half) {
        const uint2 low = __ldg(reinterpret_cast<const uint2*>(w));
        out.words[0] = make_uint4(low.x, low.y, 0u, 0u);
      } else {
        out.words[0] = __ldg(w);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        if (!half || i < kWords / 2) out.words[i] = __ldg(w + i);
      }
    }
    return out;
  }
};

// kShuffle (NeoX): a unit takes its partner chunk from the partner's own lane (which loaded it as
// its unit) by warp shuffle instead of loading it a second time: one load fewer per unit, and no
// partner registers live across the loads.
// kN: elements per unit, 16 or, for small FP8 launches, 8 (KVFUSE_ROPE_FP8_NARROW_BELOW).
template <typename In, typename Table, bool kNeox, bool kShuffle = false, int kN = kRopeUnit>
struct Rotation {
  static constexpr bool kActive = true;
  static constexpr bool kPairs = false;
  static constexpr bool kLoadsPartner = kNeox && !kShuffle;  // Loaded::partner holds a loaded chunk
  template <class Op>
  static constexpr bool kWidens = false;
  static constexpr int N = kN;
  static constexpr bool kNarrow = kN == kRopeNarrowUnit;  // kExactDivision, kNanCheckPerUnit
  using Run = Elements<In, N, true>;
  using Cols = TableRun<Table, N>;
  // The loads of one unit: where it sits (first < 0: not rotated, a value unit or past R), the
  // NeoX partner chunk, and the unit's cos / sin columns.
  struct Loaded {
    int first = -1;
    bool lower;  // NeoX: the unit is in the first half of [0, R)
    Run partner;
    Cols cos, sin;
  };
  // The rotation's loads add 24 registers per 16-element unit (bf16 tables; 40 for float32 ones)
  // to the op's own: KVFUSE_ROPE_*_FEWER_BLOCKS resident blocks per SM fewer than the op alone, or
  // KVFUSE_ROPE_FP8_NARROW_MIN_BLOCKS for 8-element units, and with float32 tables one fewer still,
  // so that nothing spills (ptxas -v, sm_90a). Unpaired FP8 launches of 16-element units whose
  // partner comes by shuffle (or GPT-J's, which need none) hold no value row and fit without that
  // last block given up (BENCHMARKS.md, twenty-fifth session: 1024 FP8 tokens 5.5 -> 4.5 us).
  template <class Op, bool kPaired>
  static constexpr int min_blocks() {
    constexpr bool fits = !kPaired && !Op::kSplitRows && kN == kRopeUnit && (kShuffle || !kNeox);
    constexpr int table = sizeof(Table) > 2 && !fits ? KVFUSE_ROPE_F32_TABLE_FEWER_BLOCKS : 0;
    constexpr int blocks = Op::kSplitRows ? Op::kMinBlocks - KVFUSE_ROPE_NVFP4_FEWER_BLOCKS - table
                           : kN == kRopeNarrowUnit ? KVFUSE_ROPE_FP8_NARROW_MIN_BLOCKS - table
                                                   : Op::kMinBlocks - KVFUSE_ROPE_FP8_FEWER_BLOCKS - table;
    return blocks >= 2 ? blocks : 2;
  }
  template <class Op, bool kPaired, bool kPrefetching, bool kManyWaves>
  static constexpr int min_small_blocks() { return 0; }

  // A unit's loads, in two source forms that load the same values. kCheckFirst returns a
  // value-initialised Loaded for a unit that is not rotated before anything else, and hands its
  // table rows to load_from (which checks again). nvcc schedules the kernels of the two forms
  // differently, and on the H100 the FP8 rotary writes run faster in this form while NVFP4 and
  // 16-bit caches run slower (BENCHMARKS.md, twenty-fourth session). So the rows kernel picks the
  // form by op (Op::kRopeCheckFirst) in paired launches (unpaired ones take locate / load_at);
  // the query kernel keeps the other. Any edit here can change
  // the measured SASS: `python -m benchmarks.sass_native --base HEAD` says which kernels it moved.
  template <bool kCheckFirst = false>
  __device__ __forceinline__ static Loaded load(const char* row, int64_t tok, int chunk, const RopeParams& r) {
    if constexpr (kCheckFirst) {
      if (chunk < 0 || chunk * N >= r.rotary_dim) return Loaded{};
      const int64_t t = table_row(tok, r);
      return load_from(row, r.cos + t * r.cos_row, r.sin + t * r.sin_row, chunk, r);
    } else {
      Loaded l;
      l.first = chunk < 0 || chunk * N >= r.rotary_dim ? -1 : chunk * N;
      if (l.first < 0) return l;
      const int64_t t = table_row(tok, r);
      load_columns(l, row, r.cos, r.sin, t, chunk, r);
      return l;
    }
  }

  __device__ __forceinline__ static int64_t table_row(int64_t tok, const RopeParams& r) { return rope_table_row(tok, r); }

  __device__ __forceinline__ static Loaded load_from(const char* row, const char* cos_row, const char* sin_row,
                                                     int chunk, const RopeParams& r) {
    Loaded l;
    l.first = chunk < 0 || chunk * N >= r.rotary_dim ? -1 : chunk * N;
    if (l.first < 0) return l;
    load_columns(l, row, cos_row, sin_row, 0, chunk, r);
    return l;
  }

  // A rotated unit's (l.first >= 0) partner chunk and cos / sin columns, from table row t of the
  // tables at cos / sin.
  __device__ __forceinline__ static void load_columns(Loaded& l, const char* row, const char* cos, const char* sin,
                                                      int64_t t, int chunk, const RopeParams& r) {
    const int half = r.rotary_dim / 2;
    int col0;
    bool half_run = false;
    if constexpr (kNeox) {
      l.lower = l.first < half;
      if constexpr (!kShuffle) {
        const int partner_chunk = l.lower ? chunk + half / N : chunk - half / N;
        const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const In*>(row) + partner_chunk * N);
#pragma unroll
        for (int w = 0; w < Run::kWords; ++w) l.partner.words[w] = __ldg(src + w);
      }
      col0 = r.half_table && !l.lower ? l.first - half : l.first;
    } else {
      l.lower = false;
      col0 = r.half_table ? l.first / 2 : l.first;
      half_run = r.half_table;
    }
    l.cos = Cols::load(cos + t * r.cos_row, col0, half_run);
    l.sin = Cols::load(sin + t * r.sin_row, col0, half_run);
  }

  // Where a unit's rotation reads, worked out from the launch's parameters alone (locate), so that
  // an unpaired launch does it before it waits for the grids before it: the rotary parameters'
  // constant-cache lines are then fetched under that grid's tail, and after the wait the table
  // loads issue beside the row loads instead of behind those misses. cos / sin: the unit's first
  // column in table row `tok`, or in row 0 where positions pick the row (load_at adds it).
  struct Where {
    int first = -1;
    bool lower;
    bool half_run;
    const char* cos;
    const char* sin;
    const char* partner;  // kLoadsPartner: the partner chunk
  };

  __device__ __forceinline__ static Where locate(const char* row, int64_t tok, int chunk, const RopeParams& r) {
    Where w;
    w.first = chunk < 0 || chunk * N >= r.rotary_dim ? -1 : chunk * N;
    if (w.first < 0) return w;
    const int half = r.rotary_dim / 2;
    int col0;
    w.half_run = false;
    if constexpr (kNeox) {
      w.lower = w.first < half;
      if constexpr (!kShuffle) {
        const int partner_chunk = w.lower ? chunk + half / N : chunk - half / N;
        w.partner = row + int64_t{partner_chunk} * N * static_cast<int64_t>(sizeof(In));
      }
      col0 = r.half_table && !w.lower ? w.first - half : w.first;
    } else {
      w.lower = false;
      col0 = r.half_table ? w.first / 2 : w.first;
      w.half_run = r.half_table;
    }
    locate_columns(tok, int64_t{col0} * static_cast<int64_t>(sizeof(Table)), r, w.cos, w.sin);
    return w;
  }

  // A located unit's loads (after the wait): its position first, where there are positions.
  __device__ __forceinline__ static Loaded load_at(const Where& w, int64_t tok, const RopeParams& r) {
    Loaded l;
    l.first = w.first;
    if (l.first < 0) return l;
    l.lower = w.lower;
    const char* cos = w.cos;
    const char* sin = w.sin;
    add_position_row(tok, r, cos, sin);
    if constexpr (kNeox && !kShuffle) {
      const uint4* src = reinterpret_cast<const uint4*>(w.partner);
#pragma unroll
      for (int i = 0; i < Run::kWords; ++i) l.partner.words[i] = __ldg(src + i);
    }
    l.cos = Cols::load(cos, 0, w.half_run);
    l.sin = Cols::load(sin, 0, w.half_run);
    return l;
  }

  // kShuffle: every lane of the warp, with a unit or not, hands its unrotated chunk to the unit
  // whose partner it is and takes its own partner's; so all 32 lanes must call it. A head's units
  // are consecutive lanes of one warp, so partners are never a lane without a unit.
  __device__ __forceinline__ static void exchange(const Run& x, Loaded& l, const RopeParams& r) {
    if constexpr (kNeox && kShuffle) {
      const int lane = static_cast<int>(threadIdx.x) & 31;
      const int from = l.first < 0 ? lane : l.lower ? lane + r.partner_lanes : lane - r.partner_lanes;
      const uint32_t* mine = reinterpret_cast<const uint32_t*>(x.words);
      uint32_t* theirs = reinterpret_cast<uint32_t*>(l.partner.words);
#pragma unroll
      for (int w = 0; w < 4 * Run::kWords; ++w) theirs[w] = __shfl_sync(0xffffffffu, mine[w], from);
    }
  }

  __device__ __forceinline__ static void apply(Run& x, const Loaded& l, const RopeParams& r) {
    if (l.first < 0) return;
    // GPT-J over a half-width table: both elements of pair k / 2 read column k / 2. Two copies of
    // the loop, so that every table element is picked by a constant index (a run-time choice
    // between 16-bit halves of a register put the whole unit in local memory).
    if (!kNeox && r.half_table) {
      rotate<true>(x, l);
    } else {
      rotate<false>(x, l);
    }
  }

  template <bool kPairColumns>
  __device__ __forceinline__ static void rotate(Run& x, const Loaded& l) {
    Run y;
    // NeoX: the lower half's partner enters negated (rotate_half's -x2), as the reference negates
    // it, in the key's dtype: one sign-bit flip per 32-bit word of two elements.
    Run partner;
    if constexpr (kNeox) {
      const uint32_t flip = l.lower ? 0x80008000u : 0u;
      const uint32_t* from = reinterpret_cast<const uint32_t*>(l.partner.words);
      uint32_t* to = reinterpret_cast<uint32_t*>(partner.words);
#pragma unroll
      for (int w = 0; w < 4 * Run::kWords; ++w) to[w] = from[w] ^ flip;
    }
    // Element pairs (k, k + 1): GPT-J's rotation partners; NeoX's partners are in `partner`.
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      const float x0 = widen(x.e, k), x1 = widen(x.e, k + 1);
      float rot0, rot1;
      if constexpr (kNeox) {
        rot0 = widen(partner.e, k);
        rot1 = widen(partner.e, k + 1);
      } else {
        rot0 = -x1;
        rot1 = x0;
      }
      const float c0 = widen(l.cos.e, kPairColumns ? k / 2 : k), c1 = widen(l.cos.e, kPairColumns ? k / 2 : k + 1);
      const float s0 = widen(l.sin.e, kPairColumns ? k / 2 : k), s1 = widen(l.sin.e, kPairColumns ? k / 2 : k + 1);
#if KVFUSE_ROPE_CONTRACT
      const float y0 = __fmaf_rn(x0, c0, __fmul_rn(rot0, s0));
      const float y1 = __fmaf_rn(x1, c1, __fmul_rn(rot1, s1));
#else
      const float y0 = __fadd_rn(__fmul_rn(x0, c0), __fmul_rn(rot0, s0));
      const float y1 = __fadd_rn(__fmul_rn(x1, c1), __fmul_rn(rot1, s1));
#endif
      if constexpr (KVFUSE_ROPE_PACK_PAIRS) {
        reinterpret_cast<uint32_t*>(y.words)[k / 2] = round_pair<In>(y0, y1);
      } else {
        y.e[k] = static_cast<In>(y0);
        y.e[k + 1] = static_cast<In>(y1);
      }
    }
    x = y;
  }
};

// NeoX in unit pairs: one thread holds a chunk of the first half of [0, R) and its partner chunk
// R/2 elements on (or, past R, two neighbouring chunks that are not rotated), so each rotation
// partner is already in its registers and the pair's table columns are loaded once: against
// Rotation's one chunk per thread, no partner exchange, and half the table loads and registers
// per element (a half-width table's column serves both chunks). The arithmetic is Rotation's,
// element for element: lower y = fma(x1, cos, rn(-x2 * sin)), upper y = fma(x2, cos', rn(x1 * sin')),
// rounded once to the key's dtype (-x2 is exact in the key's dtype, as the reference negates it).
// kHalfTable: the tables hold one column per pair (a template argument, so that full-width tables'
// second columns take registers only where they exist).
// Host-side precondition besides Rotation's: (head_size - R) % (2 N) == 0 (launch_rope_pairs).
template <typename In, typename Table, int kN, bool kHalfTable>
struct PairRotation {
  static constexpr bool kActive = true;
  static constexpr bool kPairs = true;
  static constexpr bool kLoadsPartner = false;
  static constexpr int N = kN;
  using Run = Elements<In, N, true>;
  using Cols = TableRun<Table, N>;
  static constexpr int kRuns = kHalfTable ? 1 : 2;
  static constexpr bool kFullFloatTable = !kHalfTable && std::is_same_v<Table, float>;  // kExactDivision
  static constexpr bool kHalf16BitTable = kHalfTable && sizeof(Table) == 2;            // kNanCheckPerUnit
  // Whether an op over this rotation's output takes it widened (apply_widened): FP8 encodes float
  // elements, and a bfloat16 value is a float whose low 16 bits are zero.
  template <class Op>
  static constexpr bool kWidens = KVFUSE_ROPE_WIDENED_OUT && Op::kUsesScale && !Op::kSplitRows &&
                                  std::is_same_v<In, c10::BFloat16>;
  // The pair's columns: [0] the lower chunk's, [1] the upper chunk's (full-width tables only).
  struct Loaded {
    bool rotated = false;
    Cols cos[kRuns], sin[kRuns];
  };
  // Each thread holds two units' rows; the pair's table columns count once (KVFUSE_ROPE_PAIR_*).
  template <class Op, bool kPaired>
  static constexpr int min_blocks() {
    constexpr int blocks = !Op::kSplitRows ? KVFUSE_ROPE_PAIR_MIN_BLOCKS
                           : kPaired       ? KVFUSE_ROPE_PAIR_NVFP4_MIN_BLOCKS
                                           : KVFUSE_ROPE_PAIR_NVFP4_UNPAIRED_MIN_BLOCKS;
    return blocks >= 2 ? blocks : 2;
  }
  // FP8 budgets (KVFUSE_ROPE_PAIR_FP8_*BLOCKS) by launch: paired, prefetching, unpaired of many
  // waves; 0 elsewhere (NVFP4, 16-bit caches, FP8 over full-width float32 tables, unpaired launches
  // of a wave and less): min_blocks().
  template <class Op, bool kPaired, bool kPrefetching, bool kManyWaves>
  static constexpr int min_small_blocks() {
    if constexpr (!Op::kUsesScale || Op::kSplitRows || kFullFloatTable) return 0;
    constexpr bool k16BitHalf = kHalfTable && sizeof(Table) == 2;
    if constexpr (kPaired) {
      return k16BitHalf ? KVFUSE_ROPE_PAIR_FP8_16BIT_HALF_SMALL_BLOCKS
             : kHalfTable ? 0
                          : KVFUSE_ROPE_PAIR_FP8_FULL16_SMALL_BLOCKS;
    } else if constexpr (kPrefetching || kManyWaves) {
      if constexpr (k16BitHalf) return KVFUSE_ROPE_PAIR_FP8_16BIT_HALF_UNPAIRED_BLOCKS;
      if constexpr (kPrefetching && !kHalfTable) return KVFUSE_ROPE_PAIR_FP8_FULL16_SMALL_BLOCKS;
      return KVFUSE_ROPE_PAIR_FP8_UNPAIRED_BLOCKS;
    }
    return 0;
  }

  // Chunk m (0 or 1) of pair `pair`: below R/(2N) pairs the chunk and its partner, then
  // neighbouring chunks past R.
  __device__ __forceinline__ static int chunk(int pair, int m, const RopeParams& r) {
    const int rotated = r.rotary_dim / (2 * N);
    return pair < rotated ? pair + m * rotated : r.rotary_dim / N + 2 * (pair - rotated) + m;
  }

  // pair < 0: a value item; pairs past R are not rotated either.
  __device__ __forceinline__ static Loaded load(int64_t tok, int pair, const RopeParams& r) {
    Loaded l;
    if (pair < 0 || pair * 2 * N >= r.rotary_dim) return l;
    l.rotated = true;
    const int64_t t = rope_table_row(tok, r);
    const char* cos = r.cos + t * r.cos_row;
    const char* sin = r.sin + t * r.sin_row;
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      l.cos[i] = Cols::load(cos, pair * N + i * (r.rotary_dim / 2), false);
      l.sin[i] = Cols::load(sin, pair * N + i * (r.rotary_dim / 2), false);
    }
    return l;
  }

  // load in two steps, as Rotation::locate / load_at: the pair's columns in table row `tok` (or row
  // 0 where positions pick the row) from the launch's parameters, then the loads.
  struct Where {
    bool rotated = false;
    const char* cos;
    const char* sin;
  };

  __device__ __forceinline__ static Where locate(int64_t tok, int pair, const RopeParams& r) {
    Where w;
    if (pair < 0 || pair * 2 * N >= r.rotary_dim) return w;
    w.rotated = true;
    locate_columns(tok, int64_t{pair} * N * static_cast<int64_t>(sizeof(Table)), r, w.cos, w.sin);
    return w;
  }

  __device__ __forceinline__ static Loaded load_at(const Where& w, int64_t tok, const RopeParams& r) {
    Loaded l;
    if (!w.rotated) return l;
    l.rotated = true;
    const char* cos = w.cos;
    const char* sin = w.sin;
    add_position_row(tok, r, cos, sin);
#pragma unroll
    for (int i = 0; i < kRuns; ++i) {
      l.cos[i] = Cols::load(cos, i * (r.rotary_dim / 2), false);
      l.sin[i] = Cols::load(sin, i * (r.rotary_dim / 2), false);
    }
    return l;
  }

  // Element k of the pair rotated, in float32: the lower chunk's y and the upper chunk's y'.
  __device__ __forceinline__ static void rotate(const Run& lo, const Run& hi, const Loaded& l, int k, float& y,
                                                float& y_upper) {
    constexpr int kUpper = kRuns - 1;
    const float x1 = widen(lo.e, k), x2 = widen(hi.e, k);
    const float c1 = widen(l.cos[0].e, k), s1 = widen(l.sin[0].e, k);
    const float c2 = widen(l.cos[kUpper].e, k), s2 = widen(l.sin[kUpper].e, k);
#if KVFUSE_ROPE_CONTRACT
    y = __fmaf_rn(x1, c1, __fmul_rn(-x2, s1));
    y_upper = __fmaf_rn(x2, c2, __fmul_rn(x1, s2));
#else
    y = __fadd_rn(__fmul_rn(x1, c1), __fmul_rn(-x2, s1));
    y_upper = __fadd_rn(__fmul_rn(x2, c2), __fmul_rn(x1, s2));
#endif
  }

  __device__ __forceinline__ static void apply(Run& lo, Run& hi, const Loaded& l, const RopeParams&) {
    if (!l.rotated) return;
    Run ylo, yhi;
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      float y[2][2];
#pragma unroll
      for (int i = 0; i < 2; ++i) rotate(lo, hi, l, k + i, y[0][i], y[1][i]);
      reinterpret_cast<uint32_t*>(ylo.words)[k / 2] = round_pair<In>(y[0][0], y[0][1]);
      reinterpret_cast<uint32_t*>(yhi.words)[k / 2] = round_pair<In>(y[1][0], y[1][1]);
    }
    lo = ylo;
    hi = yhi;
  }

  // apply's values as floats (kWidens): a rotated element rounded to bfloat16 is the upper half of
  // a bf16x2 convert with a zero partner (one instruction, where a packed pair takes one per two
  // elements and the encode's widening one per element); an unrotated one is widened.
  __device__ __forceinline__ static void apply_widened(const Run& lo, const Run& hi, const Loaded& l,
                                                       Widened<N>& ylo, Widened<N>& yhi) {
    if (!l.rotated) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        ylo.v[k] = widen(lo.e, k);
        yhi.v[k] = widen(hi.e, k);
      }
      return;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float y, y_upper;
      rotate(lo, hi, l, k, y, y_upper);
      ylo.v[k] = round_bf16(y);
      yhi.v[k] = round_bf16(y_upper);
    }
  }
};

// The rotated query of rope_encode_and_cache_write: unit u = (token, head, 16-element chunk),
// rotated like a key unit and stored as two 16-byte words of the contiguous output.
struct QueryParams {
  const char* src;
  int64_t src_tok, src_head;
  char* dst;  // [T, Hq, D] contiguous
  IntDivider<uint32_t> per_token, chunks;
  uint32_t units;  // < 2^31 (rope_refusal)
};

template <class Rot>
__global__ void __launch_bounds__(256) rope_query_kernel(const QueryParams q, const RopeParams r) {
  start_after_prior_grids<KVFUSE_WRITE_PDL>();
  const uint32_t u = blockIdx.x * 256 + threadIdx.x;
  // Lanes past the last unit stay for the partner exchange (whole heads end before them).
  const bool live = u < q.units;
  typename Rot::Run x;
  typename Rot::Loaded l;
  if (live) {
    const auto tr = q.per_token.divmod(u);
    const auto hc = q.chunks.divmod(tr.mod);
    const int64_t tok = tr.div;
    const char* row = q.src + tok * q.src_tok + static_cast<int64_t>(hc.div) * q.src_head;
    x = Rot::Run::load(row, static_cast<int>(hc.mod));
    l = Rot::load(row, tok, static_cast<int>(hc.mod), r);
  } else {
#pragma unroll
    for (int w = 0; w < Rot::Run::kWords; ++w) x.words[w] = make_uint4(0, 0, 0, 0);
  }
  Rot::exchange(x, l, r);
  if (!live) return;
  Rot::apply(x, l, r);
  uint4* out = reinterpret_cast<uint4*>(q.dst + static_cast<int64_t>(u) * static_cast<int64_t>(sizeof(typename Rot::Run)));
#pragma unroll
  for (int w = 0; w < Rot::Run::kWords; ++w) __stcs(out + w, x.words[w]);
}

// ----------------------------------------------------------------------------- launch

// Blocks of `kernel` resident at once on the current device: its SMs times the occupancy
// calculator's blocks per SM (asked once per kernel; kvfuse builds for one architecture).
template <auto kKernel>
int64_t resident_blocks(int block) {
  static std::atomic<int> per_sm{0};
  int blocks = per_sm.load(std::memory_order_relaxed);
  if (blocks == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, block, 0));
    per_sm.store(blocks, std::memory_order_relaxed);
  }
  return int64_t{blocks} * cached_device_attribute<cudaDevAttrMultiProcessorCount>();
}

// Launches over tokens [0, num_tokens): one grid, unless the units pass 2^31 (the dividers'
// range), then one grid per slice of tokens.
template <class Op, int kUnits, int kBlock, bool kPaired, class Rot = NoRotation>
void launch_units(RowParams p, cudaStream_t stream) {
  constexpr int64_t kPerBlock = int64_t{Rot::kPairs ? 1 : kUnits} * kBlock;
  const int64_t items = kPaired ? int64_t{p.per_half} : int64_t{p.halves} * p.per_half;
  p.items = IntDivider<uint32_t>(static_cast<uint32_t>(items));
  // >= 1: a token has < 2^30 paired units (check_int32_sizes); unpaired launches are small (launch()).
  const int64_t slice = (INT32_MAX - kPerBlock) / items;
  for (int64_t t = 0; t < p.num_tokens; t += slice) {
    p.first_token = t;
    p.units = static_cast<uint32_t>(std::min(slice, p.num_tokens - t) * items);
    const dim3 grid(static_cast<unsigned>((p.units + kPerBlock - 1) / kPerBlock));
    constexpr auto plain = rows_kernel<Op, kUnits, kBlock, kPaired, Rot>;
    auto kernel = plain;
    if constexpr (KVFUSE_ROPE_PREFETCH && Op::kUsesScale && Rot::kPairs && !kPaired) {
      constexpr auto prefetching = rows_kernel<Op, kUnits, kBlock, kPaired, Prefetching<Rot>>;
      const int64_t resident = resident_blocks<prefetching>(kBlock);
      const int64_t ahead = resident * kBlock / items;  // whole tokens, at most one wave
      if (grid.x > resident && grid.x <= 2 * resident && ahead > 0) {
        p.ahead_items = static_cast<uint32_t>(ahead * items);
        for (int h = 0; h < 2; ++h) p.ahead_src[h] = ahead * p.src_tok[h];
        kernel = prefetching;
      }
    }
    // Other launches of more blocks than the plain kernel holds at once run ManyWaves, where its
    // budget differs (FP8 pairs).
    if constexpr (Rot::kPairs && !kPaired &&
                  launch_min_blocks<Op, kPaired, ManyWaves<Rot>, kBlock>() != launch_min_blocks<Op, kPaired, Rot, kBlock>()) {
      if (kernel == plain && grid.x > resident_blocks<plain>(kBlock)) {
        kernel = rows_kernel<Op, kUnits, kBlock, kPaired, ManyWaves<Rot>>;
      }
    }
    launch_maybe_dependent(kernel, grid, dim3(kBlock), 0, stream, KVFUSE_WRITE_PDL && dependent_launch_supported(), p);
  }
}

// A head's row work in `per_head` items (chunks, or chunk pairs): the per-half item count, its
// divider, and the page divider.
void set_items(RowParams& p, int per_head) {
  p.per_half = static_cast<uint32_t>(int64_t{p.num_heads} * per_head);
  p.chunks = IntDivider<uint32_t>(static_cast<uint32_t>(per_head));
  p.page = IntDivider<uint32_t>(p.block_size <= INT32_MAX ? static_cast<uint32_t>(p.block_size) : 1u);
}

constexpr int64_t kWideGrid = KVFUSE_WIDE_GRID;

// The paired items below which a launch runs unpaired units (key and value rows in separate
// threads): by op for the writes alone and for unit-pair rotary writes (FP8, NVFP4, the others),
// one threshold for the single-unit rotary writes.
template <class Op, class Rot>
constexpr int64_t unpaired_below() {
  if constexpr (Rot::kPairs) {
    if constexpr (Op::kUsesScale) {
      return Op::kSplitRows ? KVFUSE_ROPE_NVFP4_UNPAIRED_BELOW_ITEMS : KVFUSE_ROPE_FP8_UNPAIRED_BELOW_ITEMS;
    }
    return KVFUSE_ROPE_UNPAIRED_BELOW_ITEMS;
  } else if constexpr (Rot::kActive) {
    return KVFUSE_ROPE_UNPAIRED_BELOW_ITEMS;
  } else if constexpr (Op::kUsesScale && Op::kSplitRows) {
    return KVFUSE_NVFP4_UNPAIRED_BELOW_ITEMS;
  } else if constexpr (Op::kUsesScale) {
    return KVFUSE_FP8_UNPAIRED_BELOW_ITEMS;
  } else {
    return KVFUSE_UNPAIRED_BELOW_ITEMS;
  }
}

// Whether every launch of this rotation stays below unpaired_below(): 8-element units launch below
// KVFUSE_ROPE_FP8_NARROW_BELOW 16-element units, twice as many items, so with the default
// thresholds their paired kernels would never launch and are not instantiated.
template <class Op, class Rot>
constexpr bool only_unpaired() {
  if constexpr (Rot::kActive && !Rot::kPairs) {
    return Rot::kNarrow && 2 * int64_t{KVFUSE_ROPE_FP8_NARROW_BELOW} <= unpaired_below<Op, Rot>();
  } else {
    return false;
  }
}

// Threads per block of a launch of one unit (or unit pair) per thread.
template <class Op, class Rot>
constexpr int small_block() {
  if constexpr (Rot::kActive && !Rot::kPairs && Op::kUsesScale) {
    if constexpr (Rot::N == kRopeNarrowUnit) return KVFUSE_ROPE_FP8_NARROW_THREADS;
  }
  return KVFUSE_SMALL_THREADS;
}

// Rows cut into `chunks` units per head: sets up the dividers and picks the launch shape. Large
// grids: kThreads-thread blocks of paired units, as many per thread (up to Op::kUnits) as still
// leave kWideGrid blocks, so each thread keeps several loads in flight. Below that,
// small_block()-thread blocks of one unit per thread, and in the smallest launches, which are
// mostly latency, unpaired units: the per-thread arithmetic is the critical path there.
// Measured on an H100, the block size since on an H200 (benchmarks/native_sweep.py, BENCHMARKS.md).
template <class Op, bool kMultiUnit = true, class Rot = NoRotation>
void launch(RowParams p, int chunks, cudaStream_t stream) {
  set_items(p, chunks);
  const int64_t pairs = int64_t{p.num_tokens} * p.per_half;
  if constexpr (kMultiUnit && Op::kUnits >= 4) {
    if (pairs / (4 * kThreads) >= kWideGrid) return launch_units<Op, 4, kThreads, true, Rot>(p, stream);
  }
  if constexpr (kMultiUnit && Op::kUnits >= 2) {
    if (pairs / (2 * kThreads) >= kWideGrid) return launch_units<Op, 2, kThreads, true, Rot>(p, stream);
  }
  constexpr int kBlock = small_block<Op, Rot>();
  if (only_unpaired<Op, Rot>() || pairs < unpaired_below<Op, Rot>()) {
    return launch_units<Op, 1, kBlock, false, Rot>(p, stream);
  }
  if constexpr (!only_unpaired<Op, Rot>()) launch_units<Op, 1, kBlock, true, Rot>(p, stream);
}

// NeoX rotary writes in unit pairs (PairRotation): a token's items are (head, pair), one per
// thread, paired with the value row or, in launches below unpaired_below()'s threshold (FP8 and
// NVFP4 have their own), unpaired.
template <class Op, class Rot>
void launch_pairs(RowParams p, int chunks, cudaStream_t stream) {
  set_items(p, chunks / 2);
  const int64_t items = int64_t{p.num_tokens} * p.per_half;
  constexpr int kBlock = small_block<Op, Rot>();
  // 16-bit caches (no scale) take pairs from KVFUSE_ROPE_16BIT_PAIRS_FROM units (as many items):
  // where that is not below the unpaired launches' threshold, their unpaired pair kernels would
  // never launch and are not instantiated.
  if constexpr (Op::kUsesScale || KVFUSE_ROPE_16BIT_PAIRS_FROM < unpaired_below<Op, Rot>()) {
    if (items < unpaired_below<Op, Rot>()) {
      // Only the orders a launch can take are instantiated (KVFUSE_ROPE_ROWS_FIRST).
      if constexpr (KVFUSE_ROPE_ROWS_FIRST && Op::kUsesScale && !Op::kSplitRows) {
        return launch_units<Op, 2, kBlock, false, RowsFirst<Rot>>(p, stream);
      } else {
        if constexpr (KVFUSE_ROPE_ROWS_FIRST && !Op::kUsesScale) {
          if (items < KVFUSE_ROPE_16BIT_ROWS_FIRST_BELOW_ITEMS) {
            return launch_units<Op, 2, kBlock, false, RowsFirst<Rot>>(p, stream);
          }
        }
        return launch_units<Op, 2, kBlock, false, Rot>(p, stream);
      }
    }
  }
  launch_units<Op, 2, kBlock, true, Rot>(p, stream);
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

// NVFP4 ops: the layout their stores follow, and the widest packed-data store every row allows
// (data rows are D/2 bytes apart within a side, a multiple of 8; side bases need not be aligned).
void set_nvfp4(RowParams& p, const Nvfp4Layout& layout) {
  p.nvfp4 = layout;
  p.v_group = IntDivider<uint32_t>(layout.v_group > 0 ? static_cast<uint32_t>(layout.v_group) : 1u);
  const auto data_aligned = [&](int64_t bytes) {
    return aligned(p.dst, bytes) &&
           all_multiples({p.dst_block, p.dst_kv, layout.data_tok, layout.data_head}, bytes);
  };
  p.store_width = data_aligned(8) ? 8 : data_aligned(4) ? 4 : 1;
}

// Copies rows of row_bytes: the widest word that every pointer, stride and the row allow.
void launch_copy(RowParams p, int64_t row_bytes, cudaStream_t stream) {
  for (const int w : {16, 8, 4, 2, 1}) {
    if (row_bytes % w || !src_aligned(p, w) || !dst_aligned(p, w)) continue;
    const int chunks = static_cast<int>(row_bytes / w);
    switch (w) {
      case 16: return launch<CopyOp<16>>(p, chunks, stream);
      case 8: return launch<CopyOp<8>>(p, chunks, stream);
      case 4: return launch<CopyOp<4>>(p, chunks, stream);
      case 2: return launch<CopyOp<2>>(p, chunks, stream);
      default: return launch<CopyOp<1>>(p, chunks, stream);
    }
  }
}

template <typename In, typename Out>
void launch_encode_to(RowParams p, cudaStream_t stream) {
  constexpr int64_t kOutBytes = kIsFp8<Out> ? 1 : sizeof(Out);
  constexpr int64_t kDstAlign = 8 * kOutBytes < 16 ? 8 * kOutBytes : 16;
  if constexpr (kIsFp8<Out> && KVFUSE_FP8_CHUNK == 16) {
    // 16 values per unit: one 16-byte store of FP8 codes.
    if (p.head_size % 16 == 0 && src_aligned(p, 16) && dst_aligned(p, 16)) {
      return launch<EncodeOp<In, Out, 16>>(p, p.head_size / 16, stream);
    }
  }
  if (p.head_size % 8 == 0 && src_aligned(p, 16) && dst_aligned(p, kDstAlign)) {
    return launch<EncodeOp<In, Out, 8>>(p, p.head_size / 8, stream);
  }
  launch<EncodeOp<In, Out, 1>, false>(p, p.head_size, stream);
}

template <typename In>
void launch_encode_from(RowParams p, KVQuantMode mode, at::ScalarType out, cudaStream_t stream) {
  switch (mode) {
    case KVQuantMode::FP8_E4M3: return launch_encode_to<In, E4M3>(p, stream);
    case KVQuantMode::FP8_E5M2: return launch_encode_to<In, E5M2>(p, stream);
    case KVQuantMode::NVFP4: {
      if (src_aligned(p, 16)) return launch<Nvfp4Op<In, true>>(p, p.head_size / kNvfp4Block, stream);
      return launch<Nvfp4Op<In, false>>(p, p.head_size / kNvfp4Block, stream);
    }
    case KVQuantMode::NONE:
      switch (out) {
        case at::ScalarType::Float: return launch_encode_to<In, float>(p, stream);
        case at::ScalarType::Half: return launch_encode_to<In, c10::Half>(p, stream);
        case at::ScalarType::BFloat16: return launch_encode_to<In, c10::BFloat16>(p, stream);
        default: TORCH_CHECK_VALUE(false, "cannot cast to ", out);
      }
    case KVQuantMode::FP8_PER_TOKEN_HEAD:  // not a native format: to_mode refuses it first
      TORCH_CHECK_VALUE(false, "these kernels do not implement FP8_PER_TOKEN_HEAD (per_token_head_write.cu does)");
  }
}

// Encodes (or, when nothing changes, copies) rows of key/value into p.dst.
void launch_encode(RowParams p, at::ScalarType in, KVQuantMode mode, at::ScalarType out, cudaStream_t stream) {
  if (mode == KVQuantMode::NONE && in == out) {
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
  // check_cache has made sure an NVFP4 cache is contiguous within each page.
  if (holds_nvfp4_pages(kv_cache)) {
    set_nvfp4(p, nvfp4_page_layout(kv_cache.size(2), kv_cache.size(3), nvfp4_head_size(kv_cache.size(4))));
  }
}

// The kernels read one divider per K and V for a whole block (rows_kernel); per-KV-head scales
// run on the Triton kernels (kvfuse.ops.native declares this to the registry).
void check_tensor_scale(const at::Tensor& s, const char* name) {
  TORCH_CHECK_VALUE(s.numel() == 1, name, " has shape ", s.sizes(), ": the native CUDA kernels take one scale per "
                    "tensor; per-KV-head scales run on the Triton backend");
}

void check_int32_sizes(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.size(0) < (int64_t{1} << 31) && x.size(1) * x.size(2) < (int64_t{1} << 30),
                    "tensor too large for the native kernel: ", x.sizes());
}

// Calls f with the Rotation (a tag value) of a launch in N-element units, NeoX partners by shuffle
// where a head's units share a warp, and sets r.partner_lanes to match.
template <typename In, typename Table, bool kNeox, int N, class F>
void with_rotation(int64_t head_size, RopeParams& r, F&& f) {
  r.partner_lanes = 0;
  if constexpr (kNeox) {
    r.partner_lanes = partner_lanes<N>(head_size, r.rotary_dim);
    if (r.partner_lanes > 0) return f(Rotation<In, Table, true, true, N>{});
  }
  f(Rotation<In, Table, kNeox, false, N>{});
}

// The rotary write's key/value units through the op of the cache's mode, with the rotation
// folded in, in units of N elements, one unit per thread at every size (two spill in the
// rotation's registers: 16-bit caches' cast op would otherwise take two at 16384 tokens and up).
template <class Op, typename In, typename Table, bool kNeox, int N>
void launch_rope_rows(RowParams p, cudaStream_t stream) {
  with_rotation<In, Table, kNeox, N>(p.head_size, p.rope, [&](auto rot) {
    launch<Op, false, decltype(rot)>(p, p.head_size / N, stream);
  });
}

// FP8, NVFP4 and 16-bit NeoX rotary writes in unit pairs (PairRotation): pairs of 8-element units
// for FP8 over float32 tables (and over 16-bit ones for bfloat16 keys) and for 16-bit caches over
// any table, of 16-element blocks for NVFP4 over any but full-width float32 tables, from
// KVFUSE_ROPE_(NVFP4_ / 16BIT_)PAIRS_FROM units on.
// False (nothing launched) for other formats, table types and smaller launches, and where the
// unrotated tail of a head does not split into pairs.
template <typename In, typename Table>
bool launch_rope_pairs(const RowParams& p, KVQuantMode mode, cudaStream_t stream) {
  constexpr int F = kRopeNarrowUnit, W = kRopeUnit;
  const bool fp8 = mode == KVQuantMode::FP8_E4M3 || mode == KVQuantMode::FP8_E5M2;
  const bool nvfp4 = mode == KVQuantMode::NVFP4, cast = mode == KVQuantMode::NONE;
  if (!fp8 && !nvfp4 && !cast) return false;
  const int64_t units = int64_t{p.num_tokens} * p.num_heads * (p.head_size / kRopeUnit);
  const int64_t from = fp8 ? KVFUSE_ROPE_PAIRS_FROM : nvfp4 ? KVFUSE_ROPE_NVFP4_PAIRS_FROM : KVFUSE_ROPE_16BIT_PAIRS_FROM;
  if (units < from) return false;
  if ((p.head_size - p.rope.rotary_dim) % (2 * (nvfp4 ? W : F)) != 0) return false;
  // Which table types take pairs is decided here at compile time: the others are never instantiated.
  const auto go = [&](auto half_table) {
    constexpr bool kHalf = decltype(half_table)::value;
    if (cast) {  // a cache of the key's dtype (checked by the caller)
      launch_pairs<EncodeOp<In, In, F>, PairRotation<In, Table, F, kHalf>>(p, p.head_size / F, stream);
      return true;
    }
    if constexpr (sizeof(Table) > 2 || (KVFUSE_ROPE_FP8_PAIRS_16BIT_TABLES && std::is_same_v<In, c10::BFloat16>)) {
      if (mode == KVQuantMode::FP8_E4M3) {
        launch_pairs<EncodeOp<In, E4M3, F>, PairRotation<In, Table, F, kHalf>>(p, p.head_size / F, stream);
        return true;
      }
      if (mode == KVQuantMode::FP8_E5M2) {
        launch_pairs<EncodeOp<In, E5M2, F>, PairRotation<In, Table, F, kHalf>>(p, p.head_size / F, stream);
        return true;
      }
    }
    if constexpr (kHalf || sizeof(Table) == 2) {
      if (mode == KVQuantMode::NVFP4) {
        launch_pairs<Nvfp4Op<In, true>, PairRotation<In, Table, W, kHalf>>(p, p.head_size / W, stream);
        return true;
      }
    }
    return false;
  };
  return p.rope.half_table ? go(std::true_type{}) : go(std::false_type{});
}

// The rotary write: the query's units (when there is a query) in their own small kernel, then
// the key/value units.
template <typename In, typename Table, bool kNeox>
void launch_rope(RowParams p, KVQuantMode mode, const QueryParams* q, cudaStream_t stream) {
  if (q != nullptr && q->units > 0) {
    RopeParams r = p.rope;
    with_rotation<In, Table, kNeox, kRopeUnit>(p.head_size, r, [&](auto rot) {
      launch_maybe_dependent(rope_query_kernel<decltype(rot)>, dim3((q->units + 255) / 256), dim3(256), 0, stream,
                             KVFUSE_WRITE_PDL && dependent_launch_supported(), *q, r);
    });
  }
  constexpr int W = kRopeUnit, F = kRopeNarrowUnit;
  if constexpr (kNeox && KVFUSE_ROPE_PAIR_UNITS) {
    if (launch_rope_pairs<In, Table>(p, mode, stream)) return;
  }
  const bool narrow = int64_t{p.num_tokens} * p.num_heads * (p.head_size / kRopeUnit) < KVFUSE_ROPE_FP8_NARROW_BELOW;
  switch (mode) {
    case KVQuantMode::FP8_E4M3:
      if (narrow) return launch_rope_rows<EncodeOp<In, E4M3, F>, In, Table, kNeox, F>(p, stream);
      return launch_rope_rows<EncodeOp<In, E4M3, W>, In, Table, kNeox, W>(p, stream);
    case KVQuantMode::FP8_E5M2:
      if (narrow) return launch_rope_rows<EncodeOp<In, E5M2, F>, In, Table, kNeox, F>(p, stream);
      return launch_rope_rows<EncodeOp<In, E5M2, W>, In, Table, kNeox, W>(p, stream);
    case KVQuantMode::NVFP4: return launch_rope_rows<Nvfp4Op<In, true>, In, Table, kNeox, kRopeUnit>(p, stream);
    case KVQuantMode::NONE:  // a cache of the key's dtype (checked by the caller)
      if (narrow) return launch_rope_rows<EncodeOp<In, In, F>, In, Table, kNeox, F>(p, stream);
      return launch_rope_rows<EncodeOp<In, In, W>, In, Table, kNeox, W>(p, stream);
    default:
      TORCH_CHECK_VALUE(false, "the native rotary write takes FP8, NVFP4 and 16-bit caches, not ", mode_name(mode));
  }
}

template <typename In, typename Table>
void launch_rope_style(RowParams p, KVQuantMode mode, const QueryParams* q, bool is_neox, cudaStream_t stream) {
  if (is_neox) return launch_rope<In, Table, true>(p, mode, q, stream);
  launch_rope<In, Table, false>(p, mode, q, stream);
}

template <typename In>
void launch_rope_table(RowParams p, KVQuantMode mode, const QueryParams* q, bool is_neox, bool float_table,
                       cudaStream_t stream) {
  if (float_table) return launch_rope_style<In, float>(p, mode, q, is_neox, stream);
  launch_rope_style<In, In>(p, mode, q, is_neox, stream);
}

bool rows_aligned16(const at::Tensor& x) {
  const int64_t es = x.element_size();
  return aligned(x.const_data_ptr(), 16) && all_multiples({x.stride(0) * es, x.stride(1) * es}, 16);
}

}  // namespace

at::Tensor encode_kv_cuda(const at::Tensor& x, const at::Tensor& scale, int64_t kv_quant_mode,
                          at::ScalarType cache_dtype) {
  const KVQuantMode mode = to_mode(kv_quant_mode);
  check_encode(x, scale, mode, cache_dtype);
  check_tensor_scale(scale, "scale");
  check_int32_sizes(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t row_dim = storage_row_dim(mode, x.size(2));
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
  if (mode == KVQuantMode::NVFP4) set_nvfp4(p, nvfp4_rows_layout(x.size(1), x.size(2)));
  launch_encode(p, x.scalar_type(), mode, cache_dtype, c10::cuda::getCurrentCUDAStream());
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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (!holds_nvfp4_pages(kv_cache)) return launch_copy(p, kv_cache.size(4) * kv_cache.element_size(), stream);
  // NVFP4: rows split over their page's data and scale regions, one 16-element block per unit.
  p.head_size = static_cast<int>(nvfp4_head_size(kv_cache.size(4)));
  const int chunks = p.head_size / kNvfp4Block;
  if (src_aligned(p, 8)) return launch<Nvfp4CopyOp<8>>(p, chunks, stream);
  if (src_aligned(p, 4)) return launch<Nvfp4CopyOp<4>>(p, chunks, stream);
  launch<Nvfp4CopyOp<1>>(p, chunks, stream);
}

void encode_and_cache_write_cuda(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                                 const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                 const at::Tensor& v_scale, int64_t kv_quant_mode) {
  const KVQuantMode mode = to_mode(kv_quant_mode);
  check_encode_and_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, mode);
  check_tensor_scale(k_scale, "k_scale");
  check_tensor_scale(v_scale, "v_scale");
  check_int32_sizes(key);
  if (key.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  RowParams p{};
  set_sources(p, key, value);
  set_cache_dest(p, kv_cache, slot_mapping);
  p.scale[0] = k_scale.const_data_ptr<float>();
  p.scale[1] = v_scale.const_data_ptr<float>();
  launch_encode(p, key.scalar_type(), mode, kv_cache.scalar_type(), c10::cuda::getCurrentCUDAStream());
}

// rope_encode_and_cache_write for the calls kvfuse.ops.native.rope_refusal accepts; every
// condition it relies on is checked here again before any memory is touched.
at::Tensor rope_encode_and_cache_write_cuda(const std::optional<at::Tensor>& query, const at::Tensor& key,
                                            const at::Tensor& value, const at::Tensor& kv_cache,
                                            const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                                            const at::Tensor& v_scale, const at::Tensor& cos, const at::Tensor& sin,
                                            const std::optional<at::Tensor>& positions, int64_t rotary_dim,
                                            bool is_neox, int64_t kv_quant_mode) {
  const KVQuantMode mode = to_mode(kv_quant_mode);
  check_encode_and_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, mode);
  check_tensor_scale(k_scale, "k_scale");
  check_tensor_scale(v_scale, "v_scale");
  check_int32_sizes(key);
  TORCH_CHECK_VALUE(mode == KVQuantMode::FP8_E4M3 || mode == KVQuantMode::FP8_E5M2 || mode == KVQuantMode::NVFP4 ||
                        mode == KVQuantMode::NONE,
                    "the native rotary write takes FP8, NVFP4 and 16-bit caches, not ", mode_name(mode));
  const at::ScalarType in = key.scalar_type();
  TORCH_CHECK_VALUE(in == at::ScalarType::BFloat16 || in == at::ScalarType::Half,
                    "the native rotary write takes bfloat16 or float16 keys, not ", in);
  TORCH_CHECK_VALUE(mode != KVQuantMode::NONE || kv_cache.scalar_type() == in, "kv_cache dtype ",
                    kv_cache.scalar_type(), ": the native rotary write of an unquantized cache takes the key's dtype ", in);
  const int64_t num_tokens = key.size(0), head_size = key.size(2);
  TORCH_CHECK_VALUE(head_size % kRopeUnit == 0, "head_size=", head_size, ": the native rotary write needs a multiple of 16");
  TORCH_CHECK_VALUE(rotary_dim >= 2 && rotary_dim <= head_size && rotary_dim % (is_neox ? 2 * kRopeUnit : kRopeUnit) == 0,
                    "rotary_dim=", rotary_dim, ": the native rotary write needs a multiple of ",
                    is_neox ? 2 * kRopeUnit : kRopeUnit, " up to head_size=", head_size);
  TORCH_CHECK_VALUE(rows_aligned16(key) && rows_aligned16(value), "key/value rows must start 16-byte aligned");
  const bool float_table = cos.scalar_type() == at::ScalarType::Float;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->scalar_type() == cos.scalar_type() && (float_table || t->scalar_type() == in) &&
                          t->stride(1) == 1 && (t->size(1) == rotary_dim || t->size(1) == rotary_dim / 2) &&
                          t->size(1) == cos.size(1) && t->size(0) == cos.size(0) && t->device() == key.device() &&
                          aligned(t->const_data_ptr(), 16) && (t->stride(0) * t->element_size()) % 16 == 0,
                      "cos/sin ", t->sizes(), " ", t->scalar_type(), ": the native rotary write takes 16-byte "
                      "aligned rows of float32 or the key's dtype, width rotary_dim or rotary_dim / 2");
  }
  if (positions.has_value()) {
    const at::Tensor& pos = *positions;
    TORCH_CHECK_VALUE(pos.dim() == 1 && pos.size(0) == num_tokens && pos.is_contiguous() &&
                          (pos.scalar_type() == at::ScalarType::Int || pos.scalar_type() == at::ScalarType::Long) &&
                          pos.device() == key.device(),
                      "positions must be 1-D contiguous int32/int64 with ", num_tokens, " entries");
  } else {
    TORCH_CHECK_VALUE(cos.size(0) == num_tokens, "cos/sin have ", cos.size(0), " rows for ", num_tokens, " tokens");
  }
  QueryParams q{};
  at::Tensor q_out = at::empty({0}, key.options());
  if (query.has_value()) {
    const at::Tensor& x = *query;
    TORCH_CHECK_VALUE(x.dim() == 3 && x.size(0) == num_tokens && x.size(2) == head_size && x.stride(2) == 1 &&
                          x.scalar_type() == in && x.device() == key.device() && rows_aligned16(x) &&
                          x.size(0) * x.size(1) * (head_size / kRopeUnit) < (int64_t{1} << 31),
                      "query ", x.sizes(), " must be [", num_tokens, ", heads, ", head_size, "] of ", in,
                      " with 16-byte aligned rows");
    q_out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    q.src = static_cast<const char*>(x.const_data_ptr());
    q.src_tok = x.stride(0) * x.element_size();
    q.src_head = x.stride(1) * x.element_size();
    q.dst = static_cast<char*>(q_out.data_ptr());
    q.chunks = IntDivider<uint32_t>(static_cast<uint32_t>(head_size / kRopeUnit));
    q.per_token = IntDivider<uint32_t>(static_cast<uint32_t>(x.size(1) * (head_size / kRopeUnit)));
    q.units = static_cast<uint32_t>(x.numel() / kRopeUnit);
  }
  if (num_tokens == 0) return q_out;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  RowParams p{};
  set_sources(p, key, value);
  set_cache_dest(p, kv_cache, slot_mapping);
  TORCH_CHECK_VALUE(mode == KVQuantMode::NVFP4 || dst_aligned(p, 16), "kv_cache ", kv_cache.sizes(),
                    ": FP8 and 16-bit rows must start 16-byte aligned for the native rotary write");
  p.scale[0] = k_scale.const_data_ptr<float>();
  p.scale[1] = v_scale.const_data_ptr<float>();
  p.rope.cos = static_cast<const char*>(cos.const_data_ptr());
  p.rope.sin = static_cast<const char*>(sin.const_data_ptr());
  p.rope.cos_row = cos.stride(0) * cos.element_size();
  p.rope.sin_row = sin.stride(0) * sin.element_size();
  p.rope.positions = positions.has_value() ? positions->const_data_ptr() : nullptr;
  p.rope.positions64 = positions.has_value() && positions->scalar_type() == at::ScalarType::Long;
  p.rope.rotary_dim = static_cast<int>(rotary_dim);
  p.rope.half_table = cos.size(1) != rotary_dim;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const QueryParams* qp = query.has_value() ? &q : nullptr;
  if (in == at::ScalarType::BFloat16) {
    launch_rope_table<c10::BFloat16>(p, mode, qp, is_neox, float_table, stream);
  } else {
    launch_rope_table<c10::Half>(p, mode, qp, is_neox, float_table, stream);
  }
  return q_out;
}

}  // namespace kvfuse

// ----------------------------------------------------------------------------- eager routing
//
// The public op kvfuse::encode_and_cache_write is declared in Python with a Python body for CUDA
// (validation + the registry's choice), which costs a hop into Python on every eager call. Once
// this library is loaded and the registry picks these kernels for small writes, kvfuse.ops.native
// replaces that CUDA body with route_encode_and_cache_write below (install_cuda_routing): calls
// the policy gives to this kernel run it straight from the dispatcher; every other call (bulk
// writes and capture-sensitive formats under capture, per the policy; routing switched off by
// checked mode, a forced backend or a settings reload; and any refused input, so the Python
// validator words the error) goes on to the Python body, declared as the overload
// kvfuse::encode_and_cache_write.python.

namespace kvfuse {
namespace {

struct CudaRoute {
  std::array<int64_t, kNumKVQuantModes> max_tokens;      // from this many tokens on: the Python body
  std::array<bool, kNumKVQuantModes> python_when_captured;  // under CUDA-graph capture: the Python body
};

std::atomic<const CudaRoute*> g_route{nullptr};

void route_encode_and_cache_write(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  constexpr size_t kArgs = 8;
  const CudaRoute* route = g_route.load(std::memory_order_acquire);
  if (route != nullptr) {
    auto args = torch::jit::last(*stack, kArgs);
    const int64_t mode = args[6].isInt() ? args[6].toInt() : -1;
    bool tensors = true;
    for (size_t i = 0; i < 6; ++i) tensors = tensors && args[i].isTensor();
    // Anything the contract refuses goes to the Python body, which raises the op's own message.
    if (tensors && args[6].isInt() &&
        fits_encode_and_write(args[0].toTensor(), args[1].toTensor(), args[2].toTensor(), args[3].toTensor(),
                              args[4].toTensor(), args[5].toTensor(), args[6].toInt())) {
      const int64_t mode = args[6].toInt();
      const at::Tensor& key = args[0].toTensor();
      const bool python = key.size(0) >= route->max_tokens[mode] ||
                          (route->python_when_captured[mode] &&
                           c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None);
      if (!python) {
        encode_and_cache_write_cuda(key, args[1].toTensor(), args[2].toTensor(), args[3].toTensor(),
                                    args[4].toTensor(), args[5].toTensor(), mode);
        torch::jit::drop(*stack, kArgs);
        return;
      }
    }
  }
  static const c10::OperatorHandle python_body =
      c10::Dispatcher::singleton().findSchemaOrThrow("kvfuse::encode_and_cache_write", "python");
  python_body.callBoxed(stack);
}

// Installs the route (first call: also the kernel, replacing the Python CUDA body that
// kvfuse.ops.native has just deregistered). max_tokens[mode] <= 0 sends that mode to Python.
void install_cuda_routing(at::IntArrayRef max_tokens, at::IntArrayRef python_when_captured) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(max_tokens.size()) == kNumKVQuantModes &&
                        static_cast<int64_t>(python_when_captured.size()) == kNumKVQuantModes,
                    "install_cuda_routing takes one entry per KVQuantMode (", kNumKVQuantModes, ")");
  static const bool registered = [] {
    static torch::Library lib(torch::Library::IMPL, "kvfuse", c10::DispatchKey::CUDA, __FILE__, __LINE__);
    lib.impl("encode_and_cache_write", torch::CppFunction::makeFromBoxedFunction<&route_encode_and_cache_write>());
    return true;
  }();
  (void)registered;
  auto* route = new CudaRoute{};  // never freed: a concurrent call may still read the previous one
  for (int64_t m = 0; m < kNumKVQuantModes; ++m) {
    route->max_tokens[m] = max_tokens[m];
    route->python_when_captured[m] = python_when_captured[m] != 0;
  }
  g_route.store(route, std::memory_order_release);
}

// Every call to the Python body until the next install (checked mode, a forced backend, a reload).
void pause_cuda_routing() { g_route.store(nullptr, std::memory_order_release); }

bool cuda_routing_active() { return g_route.load(std::memory_order_acquire) != nullptr; }

}  // namespace
}  // namespace kvfuse

TORCH_LIBRARY_FRAGMENT(kvfuse_native, m) {
  m.def("rope_encode_and_cache_write(Tensor? query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, Tensor k_scale, Tensor v_scale, Tensor cos, Tensor sin, Tensor? positions, "
        "int rotary_dim, bool is_neox, int kv_quant_mode) -> Tensor");
  m.def("install_cuda_routing(int[] max_tokens, int[] python_when_captured) -> ()", &kvfuse::install_cuda_routing);
  m.def("pause_cuda_routing() -> ()", &kvfuse::pause_cuda_routing);
  m.def("cuda_routing_active() -> bool", &kvfuse::cuda_routing_active);
}

TORCH_LIBRARY_IMPL(kvfuse_native, CUDA, m) {
  m.impl("encode_kv", TORCH_FN(kvfuse::encode_kv_cuda));
  m.impl("cache_write", TORCH_FN(kvfuse::cache_write_cuda));
  m.impl("encode_and_cache_write", TORCH_FN(kvfuse::encode_and_cache_write_cuda));
  m.impl("rope_encode_and_cache_write", TORCH_FN(kvfuse::rope_encode_and_cache_write_cuda));
}
