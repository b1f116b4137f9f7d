"""kvfuse's ops: the public entry points, and the path from a layer's mode to the kernel that runs.

::

    PagedAttention (layers.py)            a layer's KVCacheSpec fixes kv_quant_mode once
        |  torch.ops.kvfuse.<op>(..., kv_quant_mode, layer_name)   (or the wrappers below)
        v
    library.py   schema + validation + fake     one validator: trace time (fake) and eager (body)
        |  the op's body, registered for CPU and CUDA
        v
    registry.kernel(op, device, mode, tokens)    a cached choice per (op, device, mode,
        |                                        size class, capture, per-head scales): one dict
        |                                        lookup per call
        v
    reference.py | native.py -> kvfuse_native::<op> (csrc/, C++ switches on kvfuse::KVQuantMode)
                 | triton/kv_write.py, triton/attention.py | flashinfer.py

Which implementation wins is declared by each module (its ``IMPLEMENTATION``: ops, devices,
modes, ``available()``, ``rank``) and by the measured policy in :mod:`.tuning`;
``KVFUSE_*_BACKEND`` (:mod:`kvfuse.envs`) forces one. ``python -m kvfuse info`` prints the
registry's decisions for this machine.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import checks, registry
from .library import KVFUSE_LIB

__all__ = [
    "encode_kv",
    "cache_write",
    "encode_and_cache_write",
    "paged_attention",
    "KVFUSE_LIB",
    "checks",
    "registry",
]


def encode_kv(x: torch.Tensor, scale: torch.Tensor, kv_quant_mode: int, cache_dtype: torch.dtype,
              layer_name: str = "") -> torch.Tensor:
    """Encode ``x [T, H, D]`` into cache rows ``[T, H, row_dim]`` of ``cache_dtype``.

    NONE: value cast; FP8: ``saturate(x / scale)`` with round-to-nearest-even, NaN kept;
    NVFP4: packed E2M1 + e4m3 block scales (``scale`` is the global scale).
    """
    return torch.ops.kvfuse.encode_kv(x, scale, int(kv_quant_mode), cache_dtype, layer_name)


def cache_write(key_rows: torch.Tensor, value_rows: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor, kv_quant_mode: int, layer_name: str = "") -> None:
    """Scatter encoded rows into ``kv_cache`` at ``slot_mapping`` (-1 = skip). Mutates ``kv_cache``."""
    torch.ops.kvfuse.cache_write(key_rows, value_rows, kv_cache, slot_mapping, int(kv_quant_mode), layer_name)


def encode_and_cache_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                           kv_quant_mode: int, layer_name: str = "") -> None:
    """Fused :func:`encode_kv` of K and V + :func:`cache_write`, one pass over memory."""
    torch.ops.kvfuse.encode_and_cache_write(key, value, kv_cache, slot_mapping, k_scale, v_scale,
                                            int(kv_quant_mode), layer_name)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    kv_quant_mode: int, sm_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                    layer_name: str = "", logit_softcap: float = 0.0,
                    sinks: Optional[torch.Tensor] = None, key: Optional[torch.Tensor] = None,
                    value: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Varlen causal GQA attention of ``query [T, Hq, D]`` over a paged cache in its own format.

    ``logit_softcap`` > 0 caps every score as ``cap * tanh(s / cap)`` after ``sm_scale`` (Gemma 2);
    ``sinks`` (float32 ``[Hq]``) adds one learned logit per query head to the softmax denominator
    only (gpt-oss). See :func:`kvfuse.ops.reference.paged_attention` for the exact semantics.

    ``key`` / ``value`` (optional, ``[T, Hkv, D]`` in the query's dtype): the K/V rows this step
    wrote for the query tokens. They do not change the result (they must equal the cache's rows
    there; checked mode compares them); with a bf16/fp16 cache, prefill reads the new keys from
    them instead of the pages (:mod:`kvfuse.ops.triton.prefill`).
    """
    if sm_scale is None:
        sm_scale = query.shape[-1] ** -0.5
    return torch.ops.kvfuse.paged_attention(query, kv_cache, k_scale, v_scale, block_table, seq_lens,
                                            query_start_loc, int(kv_quant_mode), float(sm_scale),
                                            sliding_window, layer_name, float(logit_softcap), sinks, key, value)
