"""Triton backend: the CUDA kernels of kvfuse's ops (also runnable on CPU under TRITON_INTERPRET=1).

Submodules are imported on first use, so selecting another backend never imports Triton.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Optional

from ... import envs
from ..registry import ALL_MODES, OPS, Implementation, Situation

_EXPORTS = {
    "encode_kv": ".kv_write",
    "cache_write": ".kv_write",
    "encode_and_cache_write": ".kv_write",
    "rope_encode_and_cache_write": ".rope_kv_write",
    "paged_attention": ".attention",
}


def unavailable_reason(op: str, device_type: str, mode: int) -> Optional[str]:
    if device_type == "cpu" and not envs.settings().triton_interpret:
        return "Triton kernels run on CUDA (or on CPU with TRITON_INTERPRET=1), not on cpu"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed; pip install 'kvfuse[triton]'"
    return None


def _rank(situation: Situation) -> Optional[int]:
    # On CPU (interpreted) only when forced: the interpreter is a test vehicle, not a kernel.
    return 1 if situation.device_type == "cuda" else None


IMPLEMENTATION = Implementation(
    name="triton", module=__name__, ops=frozenset(OPS), devices=frozenset({"cpu", "cuda"}), modes=ALL_MODES,
    available=unavailable_reason, rank=_rank,
    # Mixed formats (K and V in different modes): the fused write (one launch, kv_write.py) and
    # attention (attention.py, _attend_range_mixed). cache_write of rows encoded apart (the unfused
    # graph) and the rotary write are left to the reference.
    mixed_format_ops=frozenset({"encode_and_cache_write", "paged_attention"}),
)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
