"""Runs the native CUDA kernels on the test shapes for ``compute-sanitizer`` (not a pytest module).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 tests/ops/_native_sanitize.py [rope]

``rope``: the native rotary write's cases instead (both unit widths, both ways to a NeoX
partner, unit pairs, 16-bit caches, partly empty last warps, the separate query launch).

Without the caching allocator every tensor is its own allocation, so memcheck sees a write one
byte past a cache or a row as the out-of-bounds access it is. Each case also checks its bytes
against the reference, so a silently skipped kernel cannot pass.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import test_native as t  # noqa: E402

from kvfuse.ops import native  # noqa: E402


def rope_cases() -> int:
    import test_rope_kv_write as r

    count = 0
    for mode, cache_dtype in r.NATIVE_FORMATS:
        for d, rotary_dim in ((64, 32), (80, 64), (128, 128), (256, 256)):
            for T in (7, 533, 3000):
                r.test_gpu_native_neox_partners(d, rotary_dim, T, mode, cache_dtype)
                count += 1
        # 3100 tokens of 8 x 128: FP8 holds the value pair in the key pair's thread.
        for shape in ((2053, 4, 256, 192), (2000, 8, 80, 64), (3100, 8, 128, 128)):
            for tables in ((True, True, torch.float32), (False, False, torch.bfloat16), (True, False, torch.bfloat16)):
                r.test_gpu_native_unit_pairs(*shape, *tables, mode, cache_dtype)
                count += 1
        for setup in (("neox-f32-table-pos", True, True, True, 128, torch.float32),
                      ("gptj-half-partial", False, True, True, 64, torch.bfloat16)):
            for T in (7, 533):
                r.test_gpu_native_bit_exact(mode, cache_dtype, *setup[1:], T)
                count += 1
    for setup in (("neox", True, False, False, 128, None),
                  ("neox-f32-table-pos", True, True, True, 128, torch.float32),
                  ("gptj-half-partial", False, True, True, 64, None)):
        for T in (7, 533, 4099):
            r.test_gpu_native_16bit_caches(torch.bfloat16, *setup[1:], T)
            count += 1
    torch.cuda.synchronize()
    return count


def main() -> int:
    reason = native.unavailable_reason("encode_and_cache_write", "cuda", 0)
    if reason is not None:
        print(f"native CUDA kernels unavailable: {reason}")
        return 2
    if sys.argv[1:] == ["rope"]:
        print(f"sanitize script: {rope_cases()} native rotary write cases ran and matched the reference")
        return 0
    count = 0
    for mode, in_dtype, cache_dtype in t.CASES:
        for num_tokens, head_size, slot_dtype, strided in ((7, 64, torch.int32, True), (33, 80, torch.int64, False)):
            t._check_fused(mode, in_dtype, cache_dtype, num_tokens, head_size, "cuda", slot_dtype=slot_dtype,
                           strided=strided, heads=3, block_size=4)
            count += 1
        t.test_cuda_unaligned_and_odd_shapes(mode, in_dtype, cache_dtype)
        t.test_cuda_encode_kv_and_cache_write_match_reference(mode, in_dtype, cache_dtype)
        count += 2
    for block_size, head_size in t.NVFP4_PAGES:
        for row_offset in (0, 1):
            t._check_nvfp4_page(block_size, head_size, "cuda", row_offset=row_offset)
            count += 1
    t.test_cuda_out_of_range_slots_are_skipped_not_written()
    torch.cuda.synchronize()
    print(f"sanitize script: {count + 1} native CUDA cases ran and matched the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
