"""Triton backend: the CUDA kernels of kvfuse's ops (also runnable on CPU under TRITON_INTERPRET=1).

Submodules are imported on first use, so selecting another backend never imports Triton.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional

_EXPORTS = {
    "encode_kv": ".kv_write",
    "cache_write": ".kv_write",
    "encode_and_cache_write": ".kv_write",
    "paged_attention": ".attention",
}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(op: str, device_type: str, mode: int) -> Optional[str]:
    if device_type != "cuda" and not (device_type == "cpu" and _interpreting()):
        return f"Triton kernels run on CUDA (or on CPU with TRITON_INTERPRET=1), not on {device_type}"
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return f"triton is not installed ({e}); pip install 'kvfuse[triton]'"
    return None


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
