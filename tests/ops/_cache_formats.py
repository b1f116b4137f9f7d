"""Cache formats and sentinel-filled caches shared by the cache-op tests."""

from __future__ import annotations

import torch

from kvfuse.kv_cache import KVQuantMode

# (mode, cache storage dtype) of every cache format.
FORMATS = [
    (KVQuantMode.NONE, torch.bfloat16),
    (KVQuantMode.NONE, torch.float16),
    (KVQuantMode.NONE, torch.float32),
    (KVQuantMode.FP8_E4M3, torch.float8_e4m3fn),
    (KVQuantMode.FP8_E5M2, torch.float8_e5m2),
    (KVQuantMode.NVFP4, torch.uint8),
]
FORMAT_IDS = ["bf16", "fp16", "fp32", "e4m3", "e5m2", "nvfp4"]

# A byte pattern no encoder writes for the test data by accident in every lane.
SENTINEL = 0x5A


def sentinel_cache(shape, dtype: torch.dtype, device="cpu", byte: int = SENTINEL) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` whose every byte is ``byte`` (NaN patterns included)."""
    raw = torch.full((*shape[:-1], shape[-1] * dtype.itemsize), byte, dtype=torch.uint8, device=device)
    return raw.view(dtype)
