"""The fusion: ``encode(K)`` + ``encode(V)`` -> ``cache_write``  ==>  ``encode_and_cache_write``.

For every cache write in a post-grad graph the pass asks each encoding recogniser (this
module's ``kvfuse::encode_kv``, :mod:`.plain_fp8_encoding`, :mod:`.plain_cast_encoding`)
how its key rows and value rows were produced, checks that the pair may be fused, and swaps
the write for the fused op in the same functional form. Every decision is per node, from the
``kv_quant_mode`` the cache write carries (never a global setting), and every write gets one
:class:`FusionRecord` whose ``reason`` says what happened or why not.

Why not ``register_replacement``: the decision is per *pair* (K and V may come from different
encodings, e.g. ``encode_kv`` for K and hand-written PyTorch for V), a refused pair must be
reported with its reason (the matcher's misses are silent), and the anchor is an
``auto_functionalized`` / ``auto_functionalized_v2`` node whose mutable-argument bookkeeping
differs between the two forms. The pure expression shapes are matched with Inductor's
pattern language (see :mod:`.plain_fp8_encoding`); the rewrite of the write is by hand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.fx as fx

from ..kv_cache import KVFormat, KVQuantMode, storage_holds
from . import plain_cast_encoding, plain_fp8_encoding
from ._graph import (
    ENCODE_KV,
    FUSED_WRITE,
    Encoding,
    Rejection,
    Site,
    describe,
    erase_if_dead,
    find_sites,
    make_call,
    other_users,
    replace_with_fused,
    scalar_tensor,
    val,
)

logger = logging.getLogger(__name__)

NAME = "fuse_encode_cache_write"
_KV_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class FusionRecord:
    """What kvfuse did with one cache write of a compiled graph."""

    layer_name: str
    kv_quant_mode: Union[KVQuantMode, KVFormat, int]  # KVFormat: K and V in different modes
    fused: bool
    reason: str

    def as_dict(self) -> dict:
        mode = self.kv_quant_mode
        return {"layer_name": self.layer_name, "kv_quant_mode": getattr(mode, "name", mode),
                "fused": self.fused, "reason": self.reason}


def match_encode_kv(rows: fx.Node, site: Site) -> Optional[Union[Encoding, Rejection]]:
    """Rows produced by ``kvfuse::encode_kv(x, scale, mode, cache_dtype, layer_name)``."""
    if rows.op != "call_function" or rows.target is not ENCODE_KV:
        return None
    x, scale, mode, cache_dtype = rows.args[:4]
    try:
        mode = KVQuantMode(int(mode))
    except ValueError:
        return Rejection(f"encode_kv carries kv_quant_mode={mode!r}, not a KVQuantMode")
    return Encoding(source="kvfuse::encode_kv", x=x, scale=scale, kv_quant_mode=mode, cache_dtype=cache_dtype,
                    nodes=[rows])


# Tried in order; the first that claims the rows (Encoding or Rejection) decides.
RECOGNISERS = (match_encode_kv, plain_fp8_encoding.match, plain_cast_encoding.match)


def _recognise(rows, site: Site) -> Union[Encoding, Rejection]:
    if not isinstance(rows, fx.Node):
        return Rejection(f"rows are the constant {rows!r}")
    for recognise in RECOGNISERS:
        found = recognise(rows, site)
        if found is not None:
            return found
    return Rejection(f"rows come from {describe(rows)}, not an encoding kvfuse recognises "
                     f"(encode_kv, (x / scale).clamp(-m, m).to(fp8), x * inv_scale, .to(native dtype))")


def _scale_problem(enc: Encoding, x_val) -> Optional[str]:
    if not isinstance(enc.scale, fx.Node):
        return None
    s = val(enc.scale)
    if not isinstance(s, torch.Tensor):
        return f"scale {describe(enc.scale)} has no tensor metadata"
    # kvfuse's own encode_kv also takes one scale per KV head ([H] for x [T, H, D]), as the fused op does.
    per_head = (enc.source == "kvfuse::encode_kv" and s.dim() == 1 and x_val is not None and x_val.dim() == 3
                and s.shape[0] == x_val.shape[1])
    if s.numel() != 1 and not per_head:
        return f"scale {describe(enc.scale)} is not a per-tensor scalar (shape {tuple(s.shape)})"
    if s.dtype != torch.float32:
        return f"scale {describe(enc.scale)} is {s.dtype}, the fused op takes a float32 scale"
    if x_val is not None and s.device != x_val.device:
        return f"scale is on {s.device} but the input is on {x_val.device}"
    return None


def check_pair(site: Site, k: Union[Encoding, Rejection], v: Union[Encoding, Rejection],
               consumers: Optional[dict] = None) -> Optional[str]:
    """None if the pair may be fused, else the reason it may not.

    ``consumers`` ({"key": node, "value": node}) names the node allowed to use each of the
    rows when that is not ``site.node`` (a plain write consumes K and V rows in two nodes).
    """
    for which, enc in (("key", k), ("value", v)):
        if isinstance(enc, Rejection):
            return f"{which}: {enc.reason}"
    fmt = KVFormat.of(site.kv_quant_mode)
    if not (k.kv_quant_mode == fmt.key and v.kv_quant_mode == fmt.value):
        return (f"modes disagree: key encoded as {k.kv_quant_mode.name}, value as {v.kv_quant_mode.name}, "
                f"cache_write is {fmt.name}")
    k_rows, v_rows = val(site.args["key_rows"]).dtype, val(site.args["value_rows"]).dtype
    if not (k.cache_dtype == k_rows and v.cache_dtype == v_rows and storage_holds(k_rows, fmt.key)
            and storage_holds(v_rows, fmt.value)) or (not fmt.is_mixed and k_rows != v_rows):
        return f"cache dtypes disagree: key -> {k.cache_dtype}, value -> {v.cache_dtype}, rows {k_rows} / {v_rows}"
    for which, enc, rows in (("key", k, site.args["key_rows"]), ("value", v, site.args["value_rows"])):
        if enc.nodes:
            extra = other_users(rows, (consumers or {}).get(which, site.node))
            if extra:
                return (f"the encoded {which} rows {rows.name} have other users "
                        f"({', '.join(describe(u) for u in extra)}); fusing would encode twice")
        x = val(enc.x)
        if not isinstance(x, torch.Tensor):
            return f"{which} input {describe(enc.x)} has no tensor metadata"
        if x.dim() != 3 or x.dtype not in _KV_INPUT_DTYPES:
            return f"{which} input is {x.dtype} {tuple(x.shape)}; the fused op needs [T, H, D] bf16/fp16/fp32"
        if x.stride(-1) != 1:
            return f"{which} input has strides {tuple(x.stride())}; the fused op needs a contiguous last dim"
        problem = _scale_problem(enc, x)
        if problem:
            return f"{which}: {problem}"
    kx, vx = val(k.x), val(v.x)
    if kx.dtype != vx.dtype or tuple(kx.shape[1:]) != tuple(vx.shape[1:]):
        return f"key ({kx.dtype}, {tuple(kx.shape)}) and value ({vx.dtype}, {tuple(vx.shape)}) differ"
    return None


def _describe_fusion(k: Encoding, v: Encoding) -> str:
    src = k.source if k.source == v.source else f"{k.source} (K) + {v.source} (V)"
    note = "" if (k.bit_exact and v.bit_exact) else " [scale = 1/inv_scale: see plain_fp8_encoding]"
    return f"fused: {src} -> encode_and_cache_write{note}"


def _scale_node(graph: fx.Graph, enc: Encoding) -> fx.Node:
    if isinstance(enc.scale, fx.Node):
        if enc.invert_scale:
            return make_call(graph, torch.ops.aten.reciprocal.default, (enc.scale,))
        return enc.scale
    value = 1.0 / float(enc.scale) if enc.invert_scale else float(enc.scale)
    return scalar_tensor(graph, value, enc.x)


def _same_scale(k: Encoding, v: Encoding) -> bool:
    if k.invert_scale != v.invert_scale:
        return False
    if isinstance(k.scale, fx.Node) or isinstance(v.scale, fx.Node):
        return k.scale is v.scale
    return float(k.scale) == float(v.scale)


def run(graph: fx.Graph, fuse: bool = True) -> list[FusionRecord]:
    """Fuse every fusable cache write of ``graph`` (in place); one record per cache write."""
    records = []
    for site in find_sites(graph):
        if site.op is FUSED_WRITE:
            records.append(FusionRecord(site.layer_name, site.kv_quant_mode, True,
                                        "already encode_and_cache_write in the traced program"))
            continue
        if not isinstance(site.kv_quant_mode, (KVQuantMode, KVFormat)):
            records.append(FusionRecord(site.layer_name, site.kv_quant_mode, False,
                                        f"cache_write carries unknown kv_quant_mode={site.kv_quant_mode!r}"))
            continue
        k = _recognise(site.args["key_rows"], site)
        v = _recognise(site.args["value_rows"], site)
        problem = check_pair(site, k, v)
        if problem is not None:
            logger.debug("%s: leave %s (%s): %s", NAME, site.node.name, site.layer_name, problem)
            records.append(FusionRecord(site.layer_name, site.kv_quant_mode, False, problem))
            continue
        if not fuse:
            records.append(FusionRecord(site.layer_name, site.kv_quant_mode, False,
                                        f"fusion disabled (make_backend(fuse=False)); would be "
                                        f"{_describe_fusion(k, v)}"))
            continue
        with graph.inserting_before(site.node):
            if _same_scale(k, v):
                k_scale = v_scale = _scale_node(graph, k)
            else:
                k_scale, v_scale = _scale_node(graph, k), _scale_node(graph, v)
            new = replace_with_fused(graph, site, k.x, v.x, k_scale, v_scale)
        erase_if_dead(graph, k.nodes + v.nodes)
        reason = _describe_fusion(k, v)
        logger.debug("%s: %s (%s, %s) -> %s", NAME, site.layer_name, site.kv_quant_mode.name, site.form, new.name)
        records.append(FusionRecord(site.layer_name, site.kv_quant_mode, True, reason))
    return records
