"""FlashInfer attention backend: ``paged_attention`` for bf16/fp16 and FP8 caches, run inside kvfuse's op.

FlashInfer registers no ``torch.library`` ops and splits work into a host-side ``plan`` (which
reads sequence lengths on the CPU) and a device-side ``run``. kvfuse's op stays the graph node;
this module plans on first use of a metadata set and caches the plan, keyed on the identity and
version counter of the metadata tensors (``block_table``, ``seq_lens``, ``query_start_loc``, the
scales) plus the static problem shape. A cached entry holds references to those tensors, so their
identity cannot be recycled while the plan is alive; an in-place update bumps ``_version`` and
forces a new plan. Consequences:

- eager: one plan (one device->host sync) per step and layer configuration, shared by all
  layers that use the same metadata;
- CUDA-graph capture: planning cannot run while a stream is capturing and a captured plan would
  go stale when the metadata changes between replays, so the op raises during capture. Compiled
  models under CUDA graphs use the native or Triton backend (the default order tries them first).

Decode batches (one query token per sequence) use ``BatchDecodeWithPagedKVCacheWrapper``
(tensor cores for FP8, where FlashInfer's CUDA-core decode is slower), everything else
``BatchPrefillWithPagedKVCacheWrapper`` with a bottom-right causal mask. kvfuse's NHD cache
``(num_blocks, 2, block_size, num_kv_heads, head_size)`` is FlashInfer's single-tensor NHD layout.

Attention logit soft-capping maps to FlashInfer's ``logits_soft_cap`` (same definition:
``cap * tanh(s / cap)`` on the scaled scores). Attention sinks are refused with a ValueError:
FlashInfer 0.6's paged decode/prefill wrappers have no sink argument, so a call with ``sinks``
must run on the Triton backend (the default order picks it first).

Per-KV-head scales are not offered (the registry passes such calls to the next implementation):
FlashInfer's ``run`` takes ``k_scale`` / ``v_scale`` as one float each.

NVFP4 is not offered: kvfuse's NVFP4 page is vLLM's (data, then block scales, per page side),
which FlashInfer reads through separate data and ``kv_cache_sf`` views, but only on its
trtllm-gen (Blackwell) and fa2 paths, not on the Hopper paths kvfuse routes to it; the Triton
kernel reads the page directly.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import logging
import threading
from typing import Optional

import torch

from ..kv_cache import KVQuantMode
from .registry import AttentionCall, Implementation, Situation

logger = logging.getLogger(__name__)

__all__ = ["paged_attention", "unavailable_reason", "clear_plans", "IMPLEMENTATION"]

_WORKSPACE_BYTES = 128 * 1024 * 1024
_MAX_PLANS = 8
_lock = threading.Lock()
_plans: "collections.OrderedDict[tuple, _Plan]" = collections.OrderedDict()
_workspaces: dict = {}


def _flashinfer():
    return importlib.import_module("flashinfer")


def unavailable_reason(op: str, device_type: str, mode: int) -> Optional[str]:
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed (pip install 'kvfuse[flashinfer]')"
    try:
        _flashinfer()
    except ImportError as e:
        return f"flashinfer cannot be imported ({e})"
    return None


def _rank(situation: Situation) -> Optional[int]:
    # After Triton: FlashInfer plans on the host per metadata set, which CUDA graphs cannot
    # capture, and Triton reads every format. Forced (KVFUSE_ATTENTION_BACKEND) where it wins.
    return 5


#: NVFP4 is not declared (see the module docstring): the Triton kernel reads the pages.
IMPLEMENTATION = Implementation(
    name="flashinfer", module=__name__, ops=frozenset({"paged_attention"}), devices=frozenset({"cuda"}),
    modes=frozenset({KVQuantMode.NONE, KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2}),
    available=unavailable_reason, rank=_rank, per_head_scale_devices=frozenset(),
)


def clear_plans() -> None:
    """Drop every cached plan (and the references it holds to metadata tensors)."""
    with _lock:
        _plans.clear()


def _workspace(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _workspaces:
        _workspaces[key] = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[key]


class _Plan:
    """A planned FlashInfer wrapper plus what the op needs on the host to run it."""

    def __init__(self, wrapper, decode: bool, first_row: int, end_row: int, k_scale: float, v_scale: float,
                 pinned: tuple):
        self.wrapper = wrapper
        self.decode = decode
        self.first_row = first_row
        self.end_row = end_row
        self.k_scale = k_scale
        self.v_scale = v_scale
        self.pinned = pinned  # keeps the metadata tensors (and so their ids) alive


def _make_plan(query, kv_cache, k_scale, v_scale, block_table, seq_lens, query_start_loc, mode, sm_scale,
               sliding_window, logit_softcap=0.0) -> _Plan:
    fi = _flashinfer()
    page = kv_cache.shape[2]
    num_q_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    lens = seq_lens.to(torch.int64)
    qsl = query_start_loc.to(torch.int64)
    qsl_host = qsl.cpu()
    first_row, end_row = int(qsl_host[0]), int(qsl_host[-1])
    q_lens = qsl_host[1:] - qsl_host[:-1]
    num_pages = (lens + page - 1) // page
    kv_indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=query.device)
    kv_indptr[1:] = torch.cumsum(num_pages, 0).to(torch.int32)
    cols = torch.arange(block_table.shape[1], device=query.device)
    kv_indices = block_table[cols[None, :] < num_pages[:, None]].to(torch.int32)
    last_page_len = torch.where(num_pages > 0, lens - (num_pages - 1) * page, 0).to(torch.int32)
    window_left = int(sliding_window) - 1 if sliding_window is not None else -1
    quantized = KVQuantMode(mode) is not KVQuantMode.NONE
    ks = float(k_scale) if quantized else 1.0
    vs = float(v_scale) if quantized else 1.0
    decode = bool(torch.all(q_lens == 1)) and first_row == 0
    common = dict(q_data_type=query.dtype, kv_data_type=kv_cache.dtype, sm_scale=float(sm_scale),
                  window_left=window_left)
    if logit_softcap > 0:
        common["logits_soft_cap"] = float(logit_softcap)
    if decode:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(query.device), "NHD",
                                                        use_tensor_cores=quantized)
        wrapper.plan(kv_indptr, kv_indices, last_page_len, num_q_heads, num_kv_heads, head_size, page,
                     pos_encoding_mode="NONE", **common)
    else:
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(query.device), "NHD",
                                                         backend="fa2" if quantized else "auto")
        qo_indptr = (qsl - qsl[0]).to(torch.int32)
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, num_q_heads, num_kv_heads, head_size,
                     page, causal=True, **common)
    logger.debug("planned FlashInfer %s for %d sequences", "decode" if decode else "prefill", lens.shape[0])
    return _Plan(wrapper, decode, first_row, end_row, ks, vs,
                 pinned=(block_table, seq_lens, query_start_loc, k_scale, v_scale))


def _plan_key(query, kv_cache, k_scale, v_scale, block_table, seq_lens, query_start_loc, mode, sm_scale,
              sliding_window, logit_softcap=0.0) -> tuple:
    tensors = (block_table, seq_lens, query_start_loc, k_scale, v_scale)
    return (
        tuple((id(t), t._version) for t in tensors),
        tuple(query.shape), query.dtype, tuple(kv_cache.shape), kv_cache.dtype, int(mode), float(sm_scale),
        sliding_window, float(logit_softcap), query.device.index,
    )


def paged_attention(call: AttentionCall) -> torch.Tensor:
    """Semantics of :func:`kvfuse.ops.reference.paged_attention`, computed by FlashInfer."""
    if call.sinks is not None:
        raise ValueError(
            f"sinks (attention sinks, gpt-oss; shape {tuple(call.sinks.shape)}) are not supported by kvfuse's "
            f"FlashInfer backend: FlashInfer 0.6's paged wrappers take no sink logits; allowed: sinks=None, or run "
            f"the triton backend (KVFUSE_ATTENTION_BACKEND=triton, or unset)"
        )
    if call.k_scale.numel() > 1 or call.v_scale.numel() > 1:
        raise ValueError(
            f"k_scale/v_scale of shapes {tuple(call.k_scale.shape)}/{tuple(call.v_scale.shape)} (one per KV head) are "
            f"not supported by kvfuse's FlashInfer backend, whose run() takes one float per K and V; allowed: "
            f"one-element scales, or the triton backend (KVFUSE_ATTENTION_BACKEND=triton, or unset)"
        )
    query, kv_quant_mode = call.query, call.kv_quant_mode
    args = (query, call.kv_cache, call.k_scale, call.v_scale, call.block_table, call.seq_lens,
            call.query_start_loc, kv_quant_mode, call.sm_scale, call.sliding_window, float(call.logit_softcap))
    key = _plan_key(*args)
    with _lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
    if plan is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "kvfuse's FlashInfer attention backend plans on the host and cannot be captured in a CUDA "
                "graph (a captured plan would not follow later metadata); use the triton backend "
                "(KVFUSE_ATTENTION_BACKEND=triton) for CUDA graphs"
            )
        plan = _make_plan(*args)
        with _lock:
            _plans[key] = plan
            while len(_plans) > _MAX_PLANS:
                _plans.popitem(last=False)
    elif torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "kvfuse's FlashInfer attention backend cannot run under CUDA-graph capture: its plan is fixed at "
            "capture time; use the triton backend (KVFUSE_ATTENTION_BACKEND=triton)"
        )
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    if plan.end_row <= plan.first_row:
        return out
    q = query[plan.first_row:plan.end_row]
    quantized = KVQuantMode(kv_quant_mode) is not KVQuantMode.NONE
    scales = dict(k_scale=plan.k_scale, v_scale=plan.v_scale) if quantized else {}
    out[plan.first_row:plan.end_row] = plan.wrapper.run(q, call.kv_cache, **scales)
    return out
