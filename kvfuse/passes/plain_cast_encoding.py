"""Recognise native-dtype "encoding" before a ``cache_write`` whose mode is NONE.

Accepted: ``rows = x.to(cache_dtype)`` (``prims.convert_element_type``) with x bf16/fp16/fp32,
and rows that already are the cache dtype (Inductor removes ``.to(same dtype)`` as a no-op, so
a bf16 model writing its bf16 K/V shows up like this). Both are what ``kvfuse::encode_kv``
does in mode NONE (a value conversion, round-to-nearest-even), so fusing is bit-exact. The
fused op needs a scale tensor it ignores in this mode: the pass adds a 1.0 constant.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.fx as fx

from ..kv_cache import NATIVE_CACHE_DTYPES, KVQuantMode
from ._graph import Encoding, Rejection, Site, describe, val

_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


def match(rows: fx.Node, site: Site) -> Optional[Union[Encoding, Rejection]]:
    rows_val = val(rows)
    if not isinstance(rows_val, torch.Tensor) or rows_val.dtype not in NATIVE_CACHE_DTYPES:
        return None
    if site.kv_quant_mode is not KVQuantMode.NONE:
        return None
    if rows.op == "call_function" and rows.target is torch.ops.prims.convert_element_type.default:
        x = rows.args[0]
        x_dtype = getattr(val(x), "dtype", None)
        if x_dtype not in _INPUTS:
            return Rejection(f"rows are {describe(rows)} of a {x_dtype} tensor; only bf16/fp16/fp32 inputs fuse")
        return Encoding(source=f"plain torch .to({rows_val.dtype})", x=x, scale=1.0,
                        kv_quant_mode=KVQuantMode.NONE, cache_dtype=rows_val.dtype, nodes=[rows])
    return Encoding(source=f"{rows_val.dtype} rows written as is", x=rows, scale=1.0,
                    kv_quant_mode=KVQuantMode.NONE, cache_dtype=rows_val.dtype, nodes=[])
