"""Recognise FP8 quantization written in plain PyTorch before a ``cache_write``.

Accepted (post-grad ATen, after Inductor's decompositions)::

    rows = (x.float() / scale).clamp(-m, m).to(fp8)      # x bf16/fp16/fp32; scale tensor or number
    rows = (x.float() * inv_scale).clamp(-m, m).to(fp8)  # the fused op gets scale = 1 / inv_scale
    # clamp as clamp(lo, hi), clamp_min then clamp_max, or clamp_max then clamp_min

with ``m`` the format's finite max (e4m3: 448, e5m2: 57344): exactly ``kvfuse::encode_kv``.

Exactness. The division form is bit-exact with the unfused graph: it is the reference
encoding. The multiplication form computes ``x * inv_scale``; the fused op computes
``x / (1 / inv_scale)``, which is the same float32 number whenever ``inv_scale`` is a power
of two (e.g. the default 1.0) and otherwise differs by at most one float32 ulp before FP8
rounding, so a stored code can differ by one FP8 step only for values within an ulp of a
rounding tie. Such fusions are reported with a note. A division done in bf16/fp16 (no
``.float()`` first) is not fused: it rounds twice, which the fused op does not reproduce.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import torch.fx as fx

from ..kv_cache import KVQuantMode, fp8_max, mode_of_storage_dtype
from ._graph import Encoding, Rejection, Site, describe, val

aten = torch.ops.aten
prims = torch.ops.prims
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.lru_cache(maxsize=None)
def _patterns():
    """The accepted chains, built once on first use (importing kvfuse stays light)."""
    from torch._inductor.pattern_matcher import MULTIPLE, CallFunction, KeywordArg

    def scaled(op):
        return CallFunction(op, KeywordArg("x"), KeywordArg("scale"), _users=MULTIPLE)

    out = []
    for op, invert in ((aten.div.Tensor, False), (aten.mul.Tensor, True)):
        lo_hi = CallFunction(aten.clamp_max.default, CallFunction(aten.clamp_min.default, scaled(op),
                             KeywordArg("lo"), _users=MULTIPLE), KeywordArg("hi"), _users=MULTIPLE)
        hi_lo = CallFunction(aten.clamp_min.default, CallFunction(aten.clamp_max.default, scaled(op),
                             KeywordArg("hi"), _users=MULTIPLE), KeywordArg("lo"), _users=MULTIPLE)
        both = CallFunction(aten.clamp.default, scaled(op), KeywordArg("lo"), KeywordArg("hi"), _users=MULTIPLE)
        for clamp in (lo_hi, hi_lo, both):
            out.append((CallFunction(prims.convert_element_type.default, clamp, KeywordArg("dtype"),
                                     _users=MULTIPLE), invert))
    return tuple(out)


def _single_user_chain(nodes: list) -> Optional[str]:
    # Every intermediate must feed only the next one: otherwise its value is needed anyway.
    for inner, outer in zip(nodes[1:], nodes[:-1]):
        users = [u for u in inner.users if u is not outer]
        if users:
            return (f"the intermediate {describe(inner)} of the encoding has other users "
                    f"({', '.join(describe(u) for u in users)})")
    return None


def match(rows: fx.Node, site: Site) -> Optional[Union[Encoding, Rejection]]:
    if rows.op != "call_function" or rows.target is not prims.convert_element_type.default:
        return None
    if rows.args[1] not in _FP8_DTYPES:
        return None
    from torch._inductor.pattern_matcher import is_match

    inner = rows.args[0]
    if (isinstance(inner, fx.Node) and inner.op == "call_function"
            and inner.target is prims.convert_element_type.default
            and inner.args[1] in (torch.bfloat16, torch.float16)):
        return Rejection(f"values are rounded to {inner.args[1]} before the FP8 cast (the scaling ran in "
                         f"{inner.args[1]}, not float32); the fused op rounds once from float32 "
                         f"(write x.float() / scale)")

    for pattern, invert in _patterns():
        m = pattern.match(rows)
        if not is_match(m):
            continue
        mode = mode_of_storage_dtype(m.kwargs["dtype"])
        limit = fp8_max(mode)
        lo, hi = m.kwargs["lo"], m.kwargs["hi"]
        if isinstance(lo, fx.Node) or isinstance(hi, fx.Node) or (float(lo), float(hi)) != (-limit, limit):
            return Rejection(f"clamp bounds ({describe(lo)}, {describe(hi)}) are not ±{limit:g}, the "
                             f"finite range of {mode.name}; the fused op saturates there")
        scaled = [n for n in m.nodes if n.target in (aten.div.Tensor, aten.mul.Tensor)][0]
        chain = [rows]
        while chain[-1] is not scaled:  # rows <- clamp(s) <- scaled, each through args[0]
            chain.append(chain[-1].args[0])
        problem = _single_user_chain(chain)
        if problem:
            return Rejection(problem)
        x, scale = m.kwargs["x"], m.kwargs["scale"]
        if invert and (not isinstance(x, fx.Node) or (isinstance(scale, fx.Node) and _dim(x) < _dim(scale))):
            x, scale = scale, x  # written as inv_scale * x
        if not isinstance(x, fx.Node) or not _is_float32_tensor(x):
            return Rejection(f"{'multiplication' if invert else 'division'} by the scale happens in "
                             f"{getattr(val(x), 'dtype', type(x).__name__)}, not float32; the fused op "
                             f"rounds once from float32 (write x.float() {'*' if invert else '/'} scale)")
        if isinstance(scale, bool) or not isinstance(scale, (fx.Node, int, float)):
            return Rejection(f"scale {describe(scale)} is not a tensor or a number")
        if not isinstance(scale, fx.Node) and (not float(scale) or float(scale) != float(scale)):
            return Rejection(f"scale {scale!r} is not a finite non-zero number")
        nodes = chain
        # The fused op upcasts x itself; bf16/fp16 -> float32 is exact, so the cast can go.
        if (x.op == "call_function" and x.target is prims.convert_element_type.default
                and x.args[1] == torch.float32 and isinstance(x.args[0], fx.Node)
                and getattr(val(x.args[0]), "dtype", None) in (torch.bfloat16, torch.float16, torch.float32)):
            nodes = chain + [x]
            x = x.args[0]
        bit_exact = not invert or (not isinstance(scale, fx.Node) and _is_power_of_two(scale))
        form = "x * inv_scale" if invert else "x / scale"
        return Encoding(source=f"plain torch ({form}).clamp().to({m.kwargs['dtype']})", x=x, scale=scale,
                        kv_quant_mode=KVQuantMode(mode), cache_dtype=m.kwargs["dtype"], nodes=nodes,
                        invert_scale=invert, bit_exact=bit_exact)
    return None


def _dim(node) -> int:
    v = val(node)
    return v.dim() if isinstance(v, torch.Tensor) else 0


def _is_float32_tensor(node) -> bool:
    v = val(node)
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32


def _is_power_of_two(value) -> bool:
    import math

    mantissa, _ = math.frexp(abs(float(value)))
    return mantissa == 0.5
