"""kvfuse: per-layer paged KV caches (bf16, FP8, NVFP4) for torch.compile, fused and correct.

Public API (see DESIGN.md): the dtype model, the layer and its metadata, the compile backend
and the debug dumps. Importing kvfuse registers the ``kvfuse::`` ops; it never initialises
CUDA, imports Triton or compiles anything.
"""

from . import ops
from .backend import backend, make_backend
from .calibration import calibrate_scales
from .kv_cache import (
    KVCacheConfig,
    KVCacheSpec,
    KVFormat,
    KVQuantMode,
    KVScaleGranularity,
    allocate_kv_cache,
    parse_kv_cache_dtype,
)
from .layers import AttentionMetadata, PagedAttention

__version__ = "0.1.0"

__all__ = [
    "KVQuantMode",
    "KVFormat",
    "KVScaleGranularity",
    "parse_kv_cache_dtype",
    "KVCacheConfig",
    "KVCacheSpec",
    "allocate_kv_cache",
    "PagedAttention",
    "AttentionMetadata",
    "backend",
    "make_backend",
    "calibrate_scales",
    "debug",
    "ops",
]


def __getattr__(name):
    # depyf is imported only by code that asks for the debug module.
    if name == "debug":
        import importlib

        return importlib.import_module(".debug", __name__)
    raise AttributeError(f"module 'kvfuse' has no attribute {name!r}")
