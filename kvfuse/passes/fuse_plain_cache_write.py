"""The fusion: encode(K) + encode(V) + a plain-PyTorch paged write  ==>  ``encode_and_cache_write``.

A model that writes a cache of kvfuse's layout ``(num_blocks, 2, block_size, heads, row_dim)``
with plain indexing instead of ``kvfuse::cache_write`` is fused the same way, per cache::

    blk, off = slots // block_size, slots % block_size
    cache[blk, 0, off] = k_rows                      # or cache.index_put_((blk, zeros, off), k_rows)
    cache[blk, 1, off] = v_rows                      # or kc, vc = cache.unbind(1); vc[blk, off] = ...
    flat = cache.view(torch.uint8).view(-1, heads, row_dim)      # a flattened view, any dtype alias
    flat.index_copy_(0, blk * 2 * block_size + off, k_rows.view(torch.uint8))

with the rows produced by any encoding :mod:`.fuse_encode_cache_write` recognises.

What the graph holds. After functionalization every such write is an ``aten.index_put`` on a
view of the cache (``index_copy_`` decomposes to it), put back with ``select_scatter`` /
``slice_scatter`` / ``as_strided_scatter`` or a reshape, and the graph ends with
``copy_(cache, new_value)``. The pass follows each mutated input forward through those nodes
(views are replayed on a meta tensor with the cache's strides, so every view is known as
exact (size, stride, offset) of the cache) and collects its chain of writes.

When it is exact. A write's element address is affine in its index tensors, and each index
is an expression of one slot tensor built from ``//``, ``%``, ``*``, ``+`` by constants: such
an expression ``e`` satisfies ``e(s + L) = e(s) + e(L) - e(0)`` for ``L`` the lcm of its divisors,
so two of them agree on every integer once they agree on ``0..L``. The pass checks that the
address of K's write equals ``cache[s // block_size, 0, s % block_size]`` (and V's ``[..., 1, ...]``)
that way, and that no index leaves its dimension for any slot in ``[0, num_blocks * block_size)``
(no negative-index wrap, no IndexError): for every valid slot the unfused graph then writes
exactly where the fused op writes.

Padding slot -1. PyTorch indexing wraps -1: ``blk = -1 // bs = -1`` is the last page and
``off = bs - 1``, so the unfused graph writes padding tokens into the last slot of the last page,
where kvfuse's write skips them. To stay equal to the unfused graph the fused op is given
``where(slots == -1, num_blocks * block_size - 1, slots)``, after checking that slot -1 lands
there for K and V in the user's own indexing (else the write is left unfused, with the reason).
The record says so: a model that meant -1 as padding should mask it (or call kvfuse's ops).
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..kv_cache import KVQuantMode, mode_of_storage_dtype
from . import fuse_encode_cache_write as _core
from ._graph import FUSED_WRITE, Encoding, Site, describe, make_call, val

logger = logging.getLogger(__name__)

NAME = "fuse_plain_cache_write"

aten = torch.ops.aten
prims = torch.ops.prims

# Beyond this period (lcm of the index divisors) the exactness proof is not attempted.
_MAX_PERIOD = 1 << 20

_VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.as_strided.default,
    aten.select.int, aten.slice.Tensor, aten.unbind.int, aten.alias.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.permute.default, aten.transpose.int, aten.view.dtype,
}
_OTHER_WRITES = {
    aten.index_put.default, aten.scatter.src, aten.scatter.value, aten.index_add.default,
    aten.index_copy.default, aten.select_scatter.default, aten.slice_scatter.default,
    aten.as_strided_scatter.default, aten.masked_scatter.default, aten.where.self,
}
_SCATTER_OPS = {
    aten.select_scatter.default: aten.select.int,
    aten.slice_scatter.default: aten.slice.Tensor,
    aten.as_strided_scatter.default: aten.as_strided.default,
}


# ----------------------------------------------------------------------------- tracking the cache


@dataclass
class _Write:
    node: fx.Node  # the aten.index_put
    region: torch.Tensor  # meta view of the cache that was indexed
    in_state: Optional[fx.Node]  # the write this one follows (None: the input's value)


@dataclass
class _Ref:
    """A node whose value is the cache at ``state`` seen through the meta view ``probe``.

    ``fresh``: the node's tensor is a new buffer (index_put / scatter output), so ``as_strided``
    on it is relative to its own contiguous layout, not the cache's storage.
    """

    cache: fx.Node
    state: Optional[fx.Node]
    probe: Any  # meta tensor, or a tuple of them (unbind)
    fresh: bool


@dataclass
class _Cache:
    node: fx.Node
    writes: list = field(default_factory=list)
    final: list = field(default_factory=list)  # complete, cache-shaped nodes of the last state
    copy_back: Optional[fx.Node] = None
    problem: Optional[str] = None
    chain: list = field(default_factory=list)  # nodes derived from a written state

    def fail(self, reason: str) -> None:
        if self.problem is None:
            self.problem = reason


def _static_shape(t: torch.Tensor) -> bool:
    return all(isinstance(d, int) for d in (*t.shape, *t.stride(), t.storage_offset()))


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def _covers_all(probe: torch.Tensor, base: torch.Tensor) -> bool:
    """True if ``probe`` addresses every element of ``base`` (same storage) exactly once."""
    if probe.numel() != base.numel() or probe.dtype.itemsize != base.dtype.itemsize:
        return False
    if _layout(probe)[:3] == _layout(base)[:3]:
        return True
    # A non-overlapping view with as many elements as the cache, inside its span, covers it.
    if not torch._prims_common.is_non_overlapping_and_dense(probe):
        return False
    return probe.storage_offset() == base.storage_offset() and base.is_contiguous()


def _apply_view(op, ref: _Ref, args: tuple, kwargs: dict, base: torch.Tensor) -> Optional[Any]:
    probe = ref.probe
    if not isinstance(probe, torch.Tensor):
        return None
    rest = args[1:]
    if any(isinstance(a, fx.Node) for a in (*rest, *kwargs.values())):
        return None
    if op is aten.view.dtype:
        dtype = rest[0] if rest else kwargs.get("dtype")
        if dtype.itemsize != probe.dtype.itemsize:
            return None
        return probe.view(dtype)
    if op is aten.as_strided.default and ref.fresh:
        # Strides of as_strided on a fresh buffer are relative to that (contiguous) buffer.
        if not probe.is_contiguous():
            return None
        size, stride = rest[0], rest[1]
        offset = rest[2] if len(rest) > 2 else kwargs.get("storage_offset", 0) or 0
        return base.view(probe.dtype).as_strided(size, stride, probe.storage_offset() + offset) \
            if probe.dtype == base.dtype else None
    try:
        out = op(probe, *rest, **kwargs)
    except Exception:  # a view the meta tensor cannot replay is simply not followed
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not all(o._is_view() or o is probe for o in outs):
        return None  # reshape had to copy: not the cache any more
    return tuple(outs) if isinstance(out, (tuple, list)) else out


def _track(graph: fx.Graph) -> dict:
    """Follow every mutated tensor input forward; return {placeholder: _Cache}."""
    copies = {}
    for n in graph.nodes:
        if (n.op == "call_function" and n.target is aten.copy_.default and isinstance(n.args[0], fx.Node)
                and n.args[0].op == "placeholder"):
            copies[n.args[0]] = n
    caches: dict = {}
    refs: dict = {}
    bases: dict = {}
    for p, copy_node in copies.items():
        v = val(p)
        if not isinstance(v, torch.Tensor):
            continue
        c = caches[p] = _Cache(p, copy_back=copy_node)
        if not _static_shape(v):
            c.fail(f"the cache {_input_name(p)} has a dynamic shape {tuple(v.shape)}")
            continue
        base = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        bases[p] = base
        refs[p] = _Ref(p, None, base, fresh=False)
    last_state: dict = {}
    copy_backs = set(copies.values())
    for n in graph.nodes:
        if n.op != "call_function" or n in copy_backs:
            continue
        src = n.args[0] if n.args else None
        ref = refs.get(src) if isinstance(src, fx.Node) else None
        if n.target is operator.getitem and ref is not None and isinstance(ref.probe, tuple):
            refs[n] = _Ref(ref.cache, ref.state, ref.probe[n.args[1]], ref.fresh)
            _note_chain(caches, refs[n], n)
            continue
        if n.target in _VIEW_OPS and ref is not None:
            probe = _apply_view(n.target, ref, n.args, dict(n.kwargs), bases[ref.cache])
            if probe is not None:
                refs[n] = _Ref(ref.cache, ref.state, probe, ref.fresh)
                _note_chain(caches, refs[n], n)
            elif ref.state is not None:
                caches[ref.cache].fail(f"{describe(n)} views the written cache in a way kvfuse does not follow")
            continue
        if n.target is aten.index_put.default and ref is not None:
            c = caches[ref.cache]
            if ref.state is not last_state.get(ref.cache):
                c.fail(f"{describe(n)} writes an older value of the cache than the previous write")
            if not isinstance(ref.probe, torch.Tensor):
                c.fail(f"{describe(n)} writes a cache view kvfuse does not follow")
                continue
            c.writes.append(_Write(n, ref.probe, ref.state))
            last_state[ref.cache] = n
            refs[n] = _Ref(ref.cache, n, ref.probe, fresh=True)
            c.chain.append(n)
            continue
        if n.target in _SCATTER_OPS and ref is not None:
            c = caches[ref.cache]
            src_ref = refs.get(n.args[1]) if isinstance(n.args[1], fx.Node) else None
            view_op = _SCATTER_OPS[n.target]
            region = _apply_view(view_op, ref, (n.args[0], *n.args[2:]), dict(n.kwargs), bases[ref.cache])
            ok = (src_ref is not None and src_ref.cache is ref.cache and isinstance(region, torch.Tensor)
                  and _covers_all(ref.probe, bases[ref.cache]) and src_ref.state is not None)
            if ok:
                w = next(w for w in c.writes if w.node is src_ref.state)
                ok = (w.in_state is ref.state and _layout(src_ref.probe) == _layout(region)
                      and _layout(w.region) == _layout(region))
            if ok:
                refs[n] = _Ref(ref.cache, src_ref.state, ref.probe, fresh=True)
                _note_chain(caches, refs[n], n)
            else:
                c.fail(f"{describe(n)} puts a value back into the cache that kvfuse cannot relate to one write")
            continue
        # Writes of the written cache in any other form (scatter, index_add, ...) are not followed.
        for a in n.all_input_nodes:
            r = refs.get(a)
            if r is not None and r.state is not None and n.target in _OTHER_WRITES:
                caches[r.cache].fail(f"{describe(n)} writes the cache in a form kvfuse does not follow")
    for p, c in caches.items():
        final_ref = refs.get(c.copy_back.args[1])
        if final_ref is None or final_ref.cache is not p:
            src = c.copy_back.args[1]
            c.fail(f"its new value comes from {describe(src)}, not from indexed writes kvfuse follows "
                   f"(index_put_, index_copy_, slice assignment by slot)")
            continue
        if not _is_complete(final_ref, bases[p]) or final_ref.state is not last_state.get(p):
            c.fail("its new value is not the result of its last write")
            continue
        # The cache's final value, possibly seen as another dtype of the same size (a uint8 view).
        c.final = [n for n, r in refs.items() if r.cache is p and r.state is final_ref.state
                   and isinstance(r.probe, torch.Tensor) and _layout(r.probe)[:3] == _layout(bases[p])[:3]]
        # Views of the final value stay valid once it is the fused op's result; any other node of
        # the chain read outside it would keep the unfused writes alive.
        after = set(c.final)
        for n in c.chain:
            if n.target in _VIEW_OPS or n.target is operator.getitem:
                if n.args[0] in after:
                    after.add(n)
        inside = set(c.chain) | {c.copy_back}
        for n in c.chain:
            if n in after:
                continue
            outside = [u for u in n.users if u not in inside]
            if outside:
                c.fail(f"{describe(outside[0])} reads {n.name}, a partly written view of the cache; read "
                       f"the cache after both K and V are written")
                break
    return caches


def _note_chain(caches: dict, ref: _Ref, node: fx.Node) -> None:
    if ref.state is not None:
        caches[ref.cache].chain.append(node)


def _is_complete(ref: _Ref, base: torch.Tensor) -> bool:
    return isinstance(ref.probe, torch.Tensor) and _layout(ref.probe) == _layout(base)


# ----------------------------------------------------------------------------- index expressions


class _Unsupported(Exception):
    pass


def _const_int(x) -> Optional[int]:
    if isinstance(x, bool) or not isinstance(x, int):
        return None
    return x


def _expr(node, leaves: list) -> tuple:
    """An index as an expression tree over one slot tensor (``leaves`` collects that tensor)."""
    c = _const_int(node)
    if c is not None:
        return ("const", c)
    if not isinstance(node, fx.Node):
        raise _Unsupported(f"index part {node!r} is not an int or a tensor")
    t, a = node.target, node.args
    if node.op == "call_function":
        if t is aten.full.default and len(a[0]) == 1 and _const_int(a[1]) is not None:
            return ("const", a[1])
        if t is aten.div.Tensor_mode and node.kwargs.get("rounding_mode") == "floor" and _pos(a[1]):
            return ("div", _expr(a[0], leaves), a[1])
        if t is aten.floor_divide.default and _pos(a[1]):
            return ("div", _expr(a[0], leaves), a[1])
        if t in (aten.remainder.Scalar, aten.remainder.Tensor) and _pos(a[1]):
            return ("rem", _expr(a[0], leaves), a[1])
        if t is aten.mul.Tensor:
            if _const_int(a[1]) is not None:
                return ("mul", _expr(a[0], leaves), a[1])
            if _const_int(a[0]) is not None:
                return ("mul", _expr(a[1], leaves), a[0])
        if t is aten.add.Tensor and node.kwargs.get("alpha", 1) == 1:
            return ("add", _expr(a[0], leaves), _expr(a[1], leaves))
        if t is aten.sub.Tensor and node.kwargs.get("alpha", 1) == 1 and _const_int(a[1]) is not None:
            return ("add", _expr(a[0], leaves), ("const", -a[1]))
        if t is prims.convert_element_type.default and a[1] == torch.int64:
            return _expr(a[0], leaves)
    v = val(node)
    if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.dtype not in (torch.int32, torch.int64):
        raise _Unsupported(f"index {describe(node)} is not a 1-D int32/int64 slot tensor or an expression "
                           f"of one (//, %, *, + by constants)")
    if leaves and leaves[0] is not node:
        raise _Unsupported(f"indices come from two tensors, {leaves[0].name} and {node.name}, not from one "
                           f"slot mapping")
    if not leaves:
        leaves.append(node)
    return ("slot",)


def _pos(x) -> bool:
    return _const_int(x) is not None and x > 0


def _divisors(e: tuple) -> list:
    if e[0] in ("div", "rem"):
        return [e[2]] + _divisors(e[1])
    if e[0] == "mul":
        return _divisors(e[1])
    if e[0] == "add":
        return _divisors(e[1]) + _divisors(e[2])
    return []


def _eval(e: tuple, s: torch.Tensor) -> torch.Tensor:
    kind = e[0]
    if kind == "slot":
        return s
    if kind == "const":
        return torch.full_like(s, e[1])
    if kind == "div":
        return torch.div(_eval(e[1], s), e[2], rounding_mode="floor")
    if kind == "rem":
        return torch.remainder(_eval(e[1], s), e[2])
    if kind == "mul":
        return _eval(e[1], s) * e[2]
    return _eval(e[1], s) + _eval(e[2], s)


def _range_over(e: tuple, period: int, n: int) -> tuple[int, int]:
    """(min, max) of ``e`` over slots ``0..n-1`` (``e(s + period) = e(s) + delta``)."""
    r = torch.arange(period + 1, dtype=torch.int64)
    v = _eval(e, r)
    delta, head = int(v[period] - v[0]), v[:period]
    q_last, r_last = divmod(n - 1, period)
    lo, hi = [], []
    if q_last >= 1:  # full periods q = 0 .. q_last - 1
        lo.append(int(head.min()) + min(0, (q_last - 1) * delta))
        hi.append(int(head.max()) + max(0, (q_last - 1) * delta))
    tail = head[: r_last + 1] + q_last * delta
    lo.append(int(tail.min()))
    hi.append(int(tail.max()))
    return min(lo), max(hi)


@dataclass
class _Placement:
    half: int  # 0: written where K lives, 1: where V lives
    slot: fx.Node
    rows: fx.Node
    write: fx.Node


def _place(w: _Write, base: torch.Tensor) -> Union[_Placement, str]:
    """Which half of the cache ``w`` writes, per slot, or why that cannot be proven."""
    node = w.node
    _, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if accumulate:
        return "it accumulates (index_put_(..., accumulate=True)); a cache write overwrites"
    if any(i is None for i in indices):
        return "its index skips a dimension (cache[blk, :, off] style); index every dimension before the row"
    region = w.region
    k = len(indices)
    nb, _, bs, heads, row = base.shape
    if tuple(region.shape[k:]) != (heads, row) or tuple(region.stride()[k:]) != tuple(base.stride()[3:]):
        return (f"each index selects a {tuple(region.shape[k:])} block, not one cache row "
                f"(heads, row_dim) = {(heads, row)}")
    rows_val = val(values)
    if not isinstance(rows_val, torch.Tensor) or rows_val.dim() != 3 or tuple(rows_val.shape[1:]) != (heads, row):
        return f"the written rows {describe(values)} are not [tokens, {heads}, {row}]"
    leaves: list = []
    try:
        exprs = [_expr(i, leaves) for i in indices]
    except _Unsupported as e:
        return str(e)
    if not leaves:
        return "its indices do not depend on a slot tensor"
    slot = leaves[0]
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not statically_known_true(val(slot).shape[0] == rows_val.shape[0]):
        return f"the slot tensor {slot.name} and the rows have different lengths"
    divs = [bs] + [d for e in exprs for d in _divisors(e)]
    period = math.lcm(*divs)
    if period > _MAX_PERIOD:
        return f"its index arithmetic has period {period} (lcm of {sorted(set(divs))}), too long to check"
    n = nb * bs
    for j, e in enumerate(exprs):
        lo, hi = _range_over(e, period, n)
        if lo < 0 or hi >= region.shape[j]:
            return (f"index {j} ({describe(indices[j])}) takes values {lo}..{hi} for slots 0..{n - 1}, outside "
                    f"0..{region.shape[j] - 1} (negative indices wrap in PyTorch)")
    s = torch.arange(period + 1, dtype=torch.int64)
    addr = region.storage_offset() + sum(_eval(e, s) * region.stride()[j] for j, e in enumerate(exprs))
    st = base.stride()
    for half in (0, 1):
        canon = base.storage_offset() + (s // bs) * st[0] + half * st[1] + (s % bs) * st[2]
        if torch.equal(addr, canon):
            break
    else:
        return (f"its indices do not address cache[slot // {bs}, 0 or 1, slot % {bs}] for every slot "
                f"(block_size {bs} is the cache's dim 2)")
    # Slot -1: where the unfused graph writes a padding token (see the module docstring).
    minus = torch.tensor([-1], dtype=torch.int64)
    pad_addr = region.storage_offset()
    for j, e in enumerate(exprs):
        i = int(_eval(e, minus)[0])
        if not -region.shape[j] <= i < region.shape[j]:
            return f"slot -1 gives index {j} = {i}, out of range: the unfused graph raises on padding tokens"
        pad_addr += (i % region.shape[j]) * region.stride()[j]
    last = n - 1
    expected = base.storage_offset() + (last // bs) * st[0] + half * st[1] + (last % bs) * st[2]
    if pad_addr != expected:
        return (f"slot -1 writes storage element {pad_addr}, not the last slot {expected}: the fused op "
                f"cannot reproduce that padding write")
    return _Placement(half, slot, values, node)


def _strip_bitcast(pl: _Placement) -> tuple:
    """(rows, the node consuming them): looks through same-size dtype views of the written rows
    (e.g. fp8 rows viewed as uint8 for ``index_copy_``)."""
    rows, consumer = pl.rows, pl.write
    while (isinstance(rows, fx.Node) and rows.op == "call_function" and rows.target is aten.view.dtype
           and isinstance(val(rows.args[0]), torch.Tensor)
           and val(rows.args[0]).dtype.itemsize == val(rows).dtype.itemsize and len(rows.users) == 1):
        rows, consumer = rows.args[0], rows
    return rows, consumer


# ----------------------------------------------------------------------------- the pass


def _input_name(p: fx.Node) -> str:
    return f"input {p.name}"


def _layer_name(p: fx.Node, encodings: tuple, input_names) -> str:
    for enc in encodings:
        if isinstance(enc, Encoding) and enc.source == "kvfuse::encode_kv":
            name = enc.nodes[0].args[4] if len(enc.nodes[0].args) > 4 else ""
            if name:
                return str(name)
    if input_names:
        idx = [n for n in p.graph.nodes if n.op == "placeholder"].index(p)
        if idx < len(input_names) and input_names[idx]:
            return str(input_names[idx])
    return f"cache {p.name}"


def _is_kvfuse_layout(v: torch.Tensor) -> bool:
    return v.dim() == 5 and v.shape[1] == 2


def _analyse(graph: fx.Graph) -> list:
    """[(placeholder, _Cache, problem or (K placement, V placement))] for every written input."""
    out = []
    for p, c in _track(graph).items():
        v = val(p)
        if not c.writes:
            continue
        if not _is_kvfuse_layout(v):
            out.append((p, c, f"{_input_name(p)} {tuple(v.shape)} {v.dtype} is written by index_put but is not "
                              f"a kvfuse cache (num_blocks, 2, block_size, heads, row_dim); allocate it with "
                              f"kvfuse.allocate_kv_cache"))
            continue
        if c.problem:
            out.append((p, c, c.problem))
            continue
        if len(c.writes) != 2:
            out.append((p, c, f"it is written {len(c.writes)} time(s) in this graph; kvfuse fuses one K write "
                              f"and one V write per cache"))
            continue
        base = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        places = []
        for w in c.writes:
            pl = _place(w, base)
            if isinstance(pl, str):
                places = f"{describe(w.node)}: {pl}"
                break
            places.append(pl)
        if isinstance(places, str):
            out.append((p, c, places))
            continue
        if {pl.half for pl in places} != {0, 1}:
            out.append((p, c, f"both writes go to half {places[0].half} of the cache (dim 1); one must be K (0), "
                              f"the other V (1)"))
            continue
        if places[0].slot is not places[1].slot:
            out.append((p, c, f"K and V use different slot tensors ({places[0].slot.name}, {places[1].slot.name})"))
            continue
        places.sort(key=lambda pl: pl.half)
        out.append((p, c, tuple(places)))
    return out


def _fused_node(graph: fx.Graph, cache: fx.Node, key, value, slot, k_scale, v_scale, mode: int,
                layer_name: str) -> fx.Node:
    """``encode_and_cache_write`` on ``cache``, functionalized as Inductor expects at this stage."""
    from torch._inductor import config

    kwargs = {"key": key, "value": value, "slot_mapping": slot, "k_scale": k_scale, "v_scale": v_scale,
              "kv_quant_mode": mode, "layer_name": layer_name}
    if config.enable_auto_functionalized_v2:
        hop = torch.ops.higher_order.auto_functionalized_v2
        kwargs.update(_kv_cache_base_index=0, _all_bases=[cache])
    else:
        hop = torch.ops.higher_order.auto_functionalized
        kwargs["kv_cache"] = cache
    node = graph.call_function(hop, (FUSED_WRITE,), kwargs)
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([val(n) for n in (key, value, cache, slot)])
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = hop(FUSED_WRITE, **torch.fx.node.map_arg(kwargs, val))
    return node


def _padding_slots(graph: fx.Graph, slot: fx.Node, last: int) -> fx.Node:
    is_pad = make_call(graph, aten.eq.Scalar, (slot, -1))
    return make_call(graph, aten.where.ScalarSelf, (is_pad, last, slot))


def _erase_dead(graph: fx.Graph, nodes) -> None:
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if getattr(n, "_erased", False) or n.users or n.op != "call_function" or n.is_impure():
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        todo.extend(inputs)


def run(graph: fx.Graph, fuse: bool = True, input_names=None) -> list:
    """Fuse every plain-PyTorch K/V write into a kvfuse-layout cache; one record per written cache.

    ``input_names`` (optional, one per placeholder in order) names caches that no
    ``kvfuse::encode_kv`` names; by default a cache is named after its graph input.
    """
    FusionRecord = _core.FusionRecord
    records = []
    for p, c, found in _analyse(graph):
        v = val(p)
        mode = mode_of_storage_dtype(v.dtype)
        mode_or_raw = mode if mode is not None else int(-1)
        if isinstance(found, str):
            if _is_kvfuse_layout(v):
                records.append(FusionRecord(_layer_name(p, (), input_names), mode_or_raw, False,
                                            f"plain cache write left unfused: {found}"))
            continue
        kp, vp = found
        if mode is None and v.dtype == torch.uint8:
            # uint8 holds NVFP4 pages and fp8_per_token_head rows alike; a plain write says neither.
            records.append(FusionRecord(_layer_name(p, (), input_names), -1, False,
                                        "plain cache write left unfused: a uint8 cache holds NVFP4 pages or "
                                        "fp8_per_token_head rows, which only kvfuse.ops.cache_write or "
                                        "encode_and_cache_write place (they carry the layer's mode)"))
            continue
        if mode is None:
            records.append(FusionRecord(_layer_name(p, (), input_names), -1, False,
                                        f"plain cache write left unfused: the cache dtype {v.dtype} is no "
                                        f"kvfuse storage dtype"))
            continue
        (k_rows, k_user), (v_rows, v_user) = _strip_bitcast(kp), _strip_bitcast(vp)
        site = Site(node=vp.rows, form="plain", op=None,
                    args={"key_rows": k_rows, "value_rows": v_rows, "kv_quant_mode": int(mode),
                          "layer_name": "", "slot_mapping": kp.slot})
        k_enc, v_enc = _core._recognise(k_rows, site), _core._recognise(v_rows, site)
        name = _layer_name(p, (k_enc, v_enc), input_names)
        problem = None
        if mode is KVQuantMode.NVFP4:
            problem = ("NVFP4 pages are laid out by kvfuse::cache_write only; write them with "
                       "kvfuse.ops.cache_write or encode_and_cache_write")
        for which, rows in (("key", k_rows), ("value", v_rows)):
            if problem is None and getattr(val(rows), "dtype", None) != v.dtype:
                problem = f"the {which} rows are {getattr(val(rows), 'dtype', None)}, the cache is {v.dtype}"
        if problem is None:
            problem = _core.check_pair(site, k_enc, v_enc, consumers={"key": k_user, "value": v_user})
        if problem is not None:
            logger.debug("%s: leave %s (%s): %s", NAME, p.name, name, problem)
            records.append(FusionRecord(name, mode, False, f"plain cache write left unfused: {problem}"))
            continue
        what = _core._describe_fusion(k_enc, v_enc).replace(" -> encode_and_cache_write", "")
        padding = ("slot -1 is written to the last slot of the last page, as the unfused indexing does "
                   "(mask padding tokens, or use kvfuse's ops, to skip them)")
        if not fuse:
            records.append(FusionRecord(name, mode, False, f"fusion disabled (make_backend(fuse=False)); would be "
                                                           f"{what} + plain cache write; {padding}"))
            continue
        n_slots = v.shape[0] * v.shape[2]
        anchor = min((w.node for w in c.writes), key=lambda n: -_order(graph, n))
        with graph.inserting_before(anchor):
            slot = _padding_slots(graph, kp.slot, n_slots - 1)
            if _core._same_scale(k_enc, v_enc):
                k_scale = v_scale = _core._scale_node(graph, k_enc)
            else:
                k_scale, v_scale = _core._scale_node(graph, k_enc), _core._scale_node(graph, v_enc)
            fused = _fused_node(graph, p, k_enc.x, v_enc.x, slot, k_scale, v_scale, int(mode), name)
            out = fused.meta.get("val")
            new_cache = graph.call_function(operator.getitem, (fused, len(out) - 1 if out is not None else 1))
            if out is not None:
                new_cache.meta["val"] = out[-1]
        for final in c.final:
            replacement = new_cache
            if val(final).dtype != v.dtype:
                with graph.inserting_after(new_cache):
                    replacement = make_call(graph, aten.view.dtype, (new_cache, val(final).dtype))
            final.replace_all_uses_with(replacement)
        _erase_dead(graph, list(reversed(c.chain)) + k_enc.nodes + v_enc.nodes)
        logger.debug("%s: %s (%s) -> %s", NAME, name, mode.name, fused.name)
        records.append(FusionRecord(name, mode, True, f"{what} + plain cache write -> encode_and_cache_write; "
                                                      f"{padding}"))
    return records


def _order(graph: fx.Graph, node: fx.Node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    return -1


def explain_no_writes(graph: fx.Graph) -> list:
    """One line per reason a graph holds no cache write kvfuse can fuse (for the report).

    Call it when a graph produced no :class:`FusionRecord`: it names each mutated input that
    looks like a cache and why it is not a kvfuse write, or says that nothing is written.
    """
    from ._graph import find_sites

    if find_sites(graph):
        return []
    lines = [f"{_input_name(p)}: {found}" for p, _, found in _analyse(graph) if isinstance(found, str)]
    if lines:
        return lines
    mutated = [n.args[0] for n in graph.nodes if n.op == "call_function" and n.target is aten.copy_.default
               and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"]
    if mutated:
        return [f"{_input_name(p)} {tuple(getattr(val(p), 'shape', ()))} is overwritten, but not by indexed "
                f"writes kvfuse recognises (kvfuse.ops.cache_write, or index_put_/index_copy_/slice assignment "
                f"by slot into a (num_blocks, 2, block_size, heads, row_dim) cache)" for p in mutated]
    return ["the graph writes no KV cache: no kvfuse.ops.cache_write / PagedAttention call and no input is "
            "written in place (a cache write inside a graph break, or a cache that is not a graph input, "
            "is not seen by the pass)"]
