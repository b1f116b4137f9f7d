"""One launch of each kernel under study, for Nsight Compute (the device's ncu reads counters).

    ncu --clock-control none --kernel-name regex:'_paged_attention_kernel|rows_kernel' \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python -m benchmarks.profile_kernels

Each case runs twice (the first call compiles); profile the second with ``--launch-skip``
or read the later of the two reports. Cases: decode at batch 64 / context 4096 for the FP8 and
NVFP4 caches in both score orders, and the native FP8 cache write at 65536 tokens.
"""

from __future__ import annotations

import torch

from benchmarks.attention import MODES, decode_args


def attention_cases():
    from kvfuse.ops.registry import AttentionCall
    from kvfuse.ops.triton import attention as ta

    for mode_name in ("fp8", "nvfp4"):
        args = decode_args(MODES[mode_name], 64, 4096)
        for keys_first in (False, True):
            tiles = ta.DEFAULT_TILES.replace(KEYS_FIRST=keys_first)
            torch.cuda.nvtx.range_push(f"{mode_name} keys_first={keys_first}")
            for _ in range(2):
                ta.paged_attention(AttentionCall(*args), tiles=tiles)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        del args
        torch.cuda.empty_cache()


def native_write_case():
    from kvfuse.ops import native

    if not native.build_info(build=True).get("cuda"):
        return
    tokens, heads, head = 65536, 8, 128
    key = torch.randn(tokens, heads, head, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    cache = torch.zeros(tokens // 16, 2, 16, heads, head, device="cuda", dtype=torch.float8_e4m3fn)
    slots = torch.randperm(tokens, device="cuda")
    scale = torch.tensor(0.5, device="cuda")
    for _ in range(2):
        native.encode_and_cache_write(key, value, cache, slots, scale, scale, 1)
    torch.cuda.synchronize()


# Read (as text) by `python -m kvfuse bench`, which refuses to start this on a host without CUDA.
REQUIRES_CUDA = True


if __name__ == "__main__":
    attention_cases()
    native_write_case()
