"""The fusion: ``rotate(K)`` -> ``encode_and_cache_write`` (and ``rotate(Q)`` -> attention)  ==>
``rope_encode_and_cache_write``.

Runs after :mod:`.fuse_encode_cache_write`, on each ``kvfuse::encode_and_cache_write`` it made
(or the program called). If the key it writes is a rotary embedding that this module recognises,
the write becomes ``kvfuse::rope_encode_and_cache_write`` of the *unrotated* key; if the query of
the same layer's ``kvfuse::paged_attention`` is rotated the same way, the fused op rotates it too
and attention reads the op's output. The rotation's own nodes die with their last user.

Recognised rotations (post-grad ATen; products and sum in any of bf16/fp16/fp32, ``X`` possibly
upcast with ``.float()`` and the result cast back)::

    X * cos + rotate_half(X) * sin          rotate_half = cat(-X[..., h:], X[..., :h])     (transformers)
    X * cos + rotate_interleaved(X) * sin   stack(-X[..., 1::2], X[..., ::2]).flatten(-2)  (GPT-J form)
    cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)   x1, x2 = X.chunk(2, -1)                (kvfuse's demo)
    cat(rotation of X[..., :R], X[..., R:])                                                (partial rotary)

in any layout whose layout operations (view/reshape/permute/transpose/clone/(un)squeeze) between
the rotation and the ``[T, H, D]`` key only move or drop size-1 dims and merge token dims
(transformers' ``[B, H, S, D]`` -> ``[B * S, H, D]``), optionally followed by rows picked by a 1-D
index (``index_select(0, i)``: the transformers integration packs the real tokens of a padded
batch so), with cos/sin broadcast over the heads (``cos.unsqueeze(1)``, the demo's
``cos[:, None]``). cos/sin stay whatever the graph computes (Llama 3 / YaRN tables included):
the fused op reads them as per-token rows ``[T, W]``, expanded over the batch where the graph
broadcasts them and picked by the same index as the key. Where the graph computes a full-width
table with each column repeated for its rotation partner (transformers' ``cat((f, f), -1)``, or
``repeat_interleave(f, 2, -1)`` for GPT-J), the op gets the half-width table (one column per pair,
its own buffer, so Inductor computes only that half): the same values, half the bytes.

Exactness: the fused op computes what Inductor computes for these expressions (see
:func:`kvfuse.ops.reference.apply_rope`): the rotation in float32, rounded once to the key's
dtype, then encoded. Tables the graph computes in float32 and casts to bf16/fp16 (transformers'
``cos.to(x.dtype)``) are handed over *before* the cast: Inductor inlines such cheap tables into
the unfused rotation kernel and drops the down/up-cast pair, so that kernel multiplies by the
float32 values (see :func:`_unrounded_source`; if Inductor's heuristics realize the table as a
buffer instead, the unfused graph reads it rounded and the two differ in the last bits).
Refused, with the reason in the layer's record:
a key computed by elementwise ops that Inductor fuses into its rotation kernel without rounding
them to the key's dtype (QK-norm, as in Qwen3 and Gemma 3: the fused op reads the rounded key);
``emulate_precision_casts`` with bf16/fp16 arithmetic (Inductor then rounds after every op); the
sum written sin-term first on CUDA (Triton contracts ``a*b + c*d`` into ``fma(a, b, c*d)``, so the
operand order decides the bits); a rotated key the graph also uses elsewhere; a key whose dtype
is not the rotation's input dtype.

Records: the encode fusion's record of the layer gets ``; rotary: ...`` appended, saying whether
the rotation (and the query's) was fused and, if not, why.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from .. import envs
from ._graph import FUSED_WRITE, _HOPS, Rejection, Site, describe, erase_if_dead, find_sites, make_call, val

logger = logging.getLogger(__name__)

NAME = "fuse_rope_cache_write"
#: The manager hands this pass the records of the passes before it, to amend.
AMENDS_RECORDS = True

aten = torch.ops.aten
prims = torch.ops.prims
ROPE_WRITE = torch.ops.kvfuse.rope_encode_and_cache_write.default
ATTENTION = torch.ops.kvfuse.paged_attention.default
_ROPE_ARGS = ("query", "key", "value", "kv_cache", "slot_mapping", "k_scale", "v_scale", "cos", "sin", "positions",
              "rotary_dim", "is_neox", "kv_quant_mode", "layer_name")
_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_LAYOUT_OPS = _RESHAPES | {
    aten.permute.default, aten.clone.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.alias.default,
}
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class Rotation:
    """A recognised rotation ``y = rotate(x)`` whose result reaches ``target`` ([T, H, D]) by layout ops."""

    x: fx.Node  # the unrotated input, before any float32 upcast, in the rotation's layout
    cos: fx.Node  # as the graph broadcasts them against the rotation's layout
    sin: fx.Node
    rotary_dim: int
    is_neox: bool
    half_table: bool  # cos/sin hold one column per pair
    cos_first: bool  # the sum is written x*cos + rot*sin (what Triton's contraction reproduces)
    low_precision: bool  # products computed in bf16/fp16 ops (not explicitly upcast)
    # per dim of target: the rotation-layout dims it flattens, in row-major order (() for a size-1
    # dim); the token dim may merge several (transformers' batch and sequence)
    labels: list
    style: str
    gather: Optional[fx.Node] = None  # rows of those tokens picked by index (the integration's packing)


# ----------------------------------------------------------------------------- small matchers


def _call(node: Any, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _shape(node) -> Optional[tuple]:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _is_one(size) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(size == 1)


def _same_size(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)


def _last_dim(node: fx.Node, dim) -> bool:
    shape = _shape(node)
    return shape is not None and isinstance(dim, int) and dim in (-1, len(shape) - 1)


def _last_slice(node: Any) -> Optional[tuple]:
    """``(base, start, end, step)`` if ``node`` takes a slice of its base's last dim, else None."""
    if _call(node, aten.slice.Tensor):
        base, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        shape = _shape(base)
        if shape is None or not _last_dim(base, dim) or not isinstance(shape[-1], int):
            return None
        size = shape[-1]
        start = 0 if start is None else start
        end = size if end is None else min(end, size)
        if not all(isinstance(v, int) for v in (start, end, step)) or start < 0 or end < 0:
            return None
        return base, start, end, step
    if _call(node, operator.getitem) and _call(node.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        split, index = node.args
        base = split.args[0]
        dim = split.args[2] if len(split.args) > 2 else 0
        shape = _shape(base)
        if shape is None or not _last_dim(base, dim) or not isinstance(shape[-1], int):
            return None
        if split.target is aten.split.Tensor:
            size = split.args[1]
            if not isinstance(size, int):
                return None
            start = index * size
            return base, start, min(start + size, shape[-1]), 1
        sizes = split.args[1]
        if not all(isinstance(s, int) for s in sizes):
            return None
        start = sum(sizes[:index])
        return base, start, start + sizes[index], 1
    return None


def _strip_upcast(node: Any) -> tuple[Any, bool]:
    """(x, upcast): ``x.float()`` -> (x, True) for bf16/fp16 x; anything else -> (node, False)."""
    if _call(node, prims.convert_element_type.default) and node.args[1] == torch.float32:
        inner = node.args[0]
        if getattr(val(inner), "dtype", None) in (torch.bfloat16, torch.float16):
            return inner, True
    return node, False


def _rot_of(node: Any) -> Optional[tuple[fx.Node, bool]]:
    """``(x, is_neox)`` if ``node`` is ``rotate_half(x)`` or the interleaved form, else None."""
    if _call(node, *_RESHAPES):
        inner = node.args[0]
        if not (_call(inner, aten.cat.default) and len(inner.args[0]) == 2):
            return None
        a, b = inner.args[0]
        if not (_call(a, aten.unsqueeze.default) and _call(b, aten.unsqueeze.default)):
            return None
        a, b = a.args[0], b.args[0]
        if not _call(a, aten.neg.default):
            return None
        sa, sb = _last_slice(a.args[0]), _last_slice(b)
        if sa is None or sb is None or sa[0] is not sb[0]:
            return None
        x = sa[0]
        size = _shape(x)[-1]
        if (sa[1:], sb[1:]) != ((1, size, 2), (0, size, 2)) or _shape(node) != _shape(x):
            return None
        return x, False
    if _call(node, aten.cat.default) and len(node.args[0]) == 2:
        dim = node.args[1] if len(node.args) > 1 else 0
        a, b = node.args[0]
        if not (_call(a, aten.neg.default) and isinstance(b, fx.Node) and _last_dim(node, dim)):
            return None
        sa, sb = _last_slice(a.args[0]), _last_slice(b)
        if sa is None or sb is None or sa[0] is not sb[0]:
            return None
        x = sa[0]
        size = _shape(x)[-1]
        if size % 2 or (sa[1:], sb[1:]) != ((size // 2, size, 1), (0, size // 2, 1)):
            return None
        return x, True
    return None


def _mul_operands(node: Any) -> Optional[tuple[Any, Any]]:
    return tuple(node.args[:2]) if _call(node, aten.mul.Tensor) else None


def _split_product(mul: Any, wanted) -> Optional[tuple[Any, Any]]:
    """``(operand matching wanted, the other)`` of a product, either order."""
    ops = _mul_operands(mul)
    if ops is None:
        return None
    for a, b in (ops, ops[::-1]):
        if wanted(a) and isinstance(b, fx.Node):
            return a, b
    return None


def _match_core(y: fx.Node) -> Optional[Union[tuple, Rejection]]:
    """``(x_compute, cos, sin, is_neox, half_table, cos_first, style)`` for a rotation node ``y``."""
    if _call(y, aten.add.Tensor) and len(y.args) == 2 and _mul_operands(y.args[0]) and _mul_operands(y.args[1]):
        for cos_first, (m_direct, m_rot) in ((True, y.args), (False, y.args[::-1])):
            rot_side = _split_product(m_rot, lambda n: _rot_of(n) is not None)
            if rot_side is None:
                continue
            x, is_neox = _rot_of(rot_side[0])
            direct = _split_product(m_direct, lambda n: n is x)
            if direct is None:
                continue
            style = "NeoX rotate-half" if is_neox else "GPT-J interleaved"
            return x, direct[1], rot_side[1], is_neox, False, cos_first, style
        return None
    if _call(y, aten.cat.default) and len(y.args[0]) == 2:
        first, second = y.args[0]
        if not (_call(first, aten.sub.Tensor) and _call(second, aten.add.Tensor)) or not _last_dim(y, y.args[1]
                                                                                                  if len(y.args) > 1 else 0):
            return None
        # first = x1*cos - x2*sin, second = x2*cos + x1*sin (the demo model's form)
        a, b = first.args[:2]
        pa = _split_product(a, lambda n: _last_slice(n) is not None)
        pb = _split_product(b, lambda n: _last_slice(n) is not None)
        if pa is None or pb is None:
            return None
        x1, cos = pa
        x2, sin = pb
        s1, s2 = _last_slice(x1), _last_slice(x2)
        if s1[0] is not s2[0]:
            return None
        x = s1[0]
        size = _shape(x)[-1]
        if (s1[1:], s2[1:]) != ((0, size // 2, 1), (size // 2, size, 1)) or size % 2:
            return None
        for cos_first, (m_c, m_s) in ((True, second.args[:2]), (False, second.args[1::-1])):
            if _split_product(m_c, lambda n: n is x2) == (x2, cos) and _split_product(m_s, lambda n: n is x1) == (x1, sin):
                return x, cos, sin, True, True, cos_first, "NeoX (demo chunk form)"
        return None
    return None


def _layout_labels(base: fx.Node, chain: list) -> Optional[list]:
    """Per dim of the chain's output, the dims of ``base`` it flattens in row-major order (() for
    size-1 dims), if the chain only permutes dims, moves or drops size-1 ones and merges adjacent
    dims (a reshape of [B, T, ...] to [B * T, ...]); else None (a split, or a merge across a permute)."""
    shape = _shape(base)
    labels = [() if _is_one(s) else (i,) for i, s in enumerate(shape)]
    sizes = list(shape)
    for node in reversed(chain):  # innermost first
        out_shape = _shape(node)
        if out_shape is None:
            return None
        if node.target is aten.permute.default:
            dims = [d % len(labels) for d in node.args[1]]
            labels = [labels[d] for d in dims]
        else:
            kept = [(lab, s) for lab, s in zip(labels, sizes) if lab]
            out_kept = [i for i, s in enumerate(out_shape) if not _is_one(s)]
            labels = [()] * len(out_shape)
            j = 0
            for i in out_kept:  # each kept output dim takes the next input dims whose sizes multiply to its size
                if j == len(kept):
                    return None
                merged, size = kept[j][0], kept[j][1]
                j += 1
                while not _same_size(size, out_shape[i]):
                    if j == len(kept) or _is_one(kept[j][1]):
                        return None
                    merged, size = merged + kept[j][0], size * kept[j][1]
                    j += 1
                labels[i] = merged
            if j != len(kept):
                return None
        sizes = list(out_shape)
    return labels


def _row_gather(node: Any) -> Optional[tuple[fx.Node, fx.Node]]:
    """``(base, index)`` if ``node`` picks rows of ``base`` by a 1-D index along dim 0
    (``index_select(base, 0, i)``, ``base[i]``), else None."""
    if _call(node, aten.index_select.default) and len(node.args) == 3 and node.args[1] == 0:
        base, index = node.args[0], node.args[2]
    elif _call(node, aten.index.Tensor) and len(node.args) == 2 and len(node.args[1]) == 1:
        base, index = node.args[0], node.args[1][0]
    else:
        return None
    shape = _shape(index)
    if not isinstance(base, fx.Node) or not isinstance(index, fx.Node) or shape is None or len(shape) != 1 \
            or getattr(val(index), "dtype", None) not in (torch.int32, torch.int64):
        return None
    return base, index


def match_rotation(target: Any) -> Union[Rotation, Rejection]:
    """How ``target`` (a ``[T, H, D]`` key or query) was rotated, or why it is not a recognised rotation."""
    if not isinstance(target, fx.Node):
        return Rejection(f"the input is the constant {target!r}")
    chain, node = [], target
    while _call(node, *_LAYOUT_OPS):
        chain.append(node)
        node = node.args[0]
    gather, picked, after_gather = None, _row_gather(node), []
    if picked is not None:
        # Rows picked after the rotation: the rotation works row by row, so the op may pick the
        # unrotated rows and their table rows by the same index instead.
        labels = _layout_labels(node, chain)
        ndim = len(_shape(node) or ())
        if ndim != 3 or labels is None or any(lab not in ((i,), ()) for i, lab in enumerate(labels)):
            return Rejection(f"the layout operations after the row gather {describe(node)} do more than drop "
                             f"size-1 dims")
        gathered, (node, gather) = node, picked
        after_gather, chain = chain, [gathered]
        while _call(node, *_LAYOUT_OPS):
            chain.append(node)
            node = node.args[0]
    out_dtype = getattr(val(target), "dtype", None)
    y, steps = node, [node]
    if _call(y, prims.convert_element_type.default) and isinstance(y.args[0], fx.Node):
        y = y.args[0]
        steps.append(y)
    rotary_dim, x_full = None, None
    if _call(y, aten.cat.default) and len(y.args[0]) == 2 and _last_dim(y, y.args[1] if len(y.args) > 1 else 0):
        rotated, passed = y.args[0]
        sp = _last_slice(passed)
        core_input = _match_core(rotated) if isinstance(rotated, fx.Node) else None
        if sp is not None and isinstance(core_input, tuple):
            sr = _last_slice(core_input[0])
            base = _strip_upcast(sp[0])[0]
            if sr is not None and _strip_upcast(sr[0])[0] is base and sr[1:] == (0, sp[1], 1) \
                    and sp[2:] == (_shape(sp[0])[-1], 1):
                rotary_dim, x_full, y = sp[1], sr[0], rotated
    core = _match_core(y) if isinstance(y, fx.Node) else None
    if not isinstance(core, tuple):
        return Rejection(f"it comes from {describe(y)}, not a rotary embedding kvfuse recognises "
                         f"(x * cos + rotate_half(x) * sin, its interleaved form, the demo's chunk form)")
    x_compute, cos, sin, is_neox, half_table, cos_first, style = core
    if x_full is not None:
        x_compute = x_full
    x, upcast = _strip_upcast(x_compute)
    x_dtype = getattr(val(x), "dtype", None)
    width = _shape(x)[-1] if _shape(x) else None
    rotary_dim = rotary_dim if rotary_dim is not None else width
    if x_dtype not in _FLOATS or out_dtype != x_dtype:
        return Rejection(f"the rotation reads {x_dtype} but hands {out_dtype} to the write; the fused op rounds "
                         f"the rotated values to the input's dtype")
    # Everything from the rotation's result to the input must feed only the next step: otherwise
    # the rotated values are needed anyway and fusing would rotate twice.
    for step in after_gather + chain + steps:
        users = [u for u in step.users if not (step is target and _reads_as_step_kv(u, step))]
        if len(users) > 1:
            return Rejection(f"the rotated values {describe(step)} have other users "
                             f"({', '.join(describe(u) for u in users)})")
    layout_chain = chain[1:] if gather is not None else chain
    labels = _layout_labels(x, layout_chain)
    if labels is None or len(labels) != 3 or labels[2] != (len(_shape(x)) - 1,) or len(labels[1]) > 1:
        return Rejection(f"the layout operations between the rotation and the [T, H, D] input "
                         f"({', '.join(describe(n) for n in layout_chain)}) do more than move dims and merge "
                         f"the token dims")
    low_precision = not upcast and x_dtype != torch.float32 and all(
        getattr(val(t), "dtype", None) != torch.float32 for t in (cos, sin))
    return Rotation(x, cos, sin, rotary_dim, is_neox, half_table, cos_first, low_precision, labels, style, gather)


# ----------------------------------------------------------------------------- cos/sin and layouts


def _table_problem(rot: Rotation) -> Optional[str]:
    """None if cos/sin broadcast as per-token rows over the rotation's layout."""
    n = len(_shape(rot.x))
    token_dims = set(rot.labels[0])
    want_width = rot.rotary_dim // 2 if rot.half_table else rot.rotary_dim
    for name, table in (("cos", rot.cos), ("sin", rot.sin)):
        shape = _shape(table)
        if shape is None or getattr(val(table), "dtype", None) not in _FLOATS:
            return f"{name} {describe(table)} is not a floating tensor"
        offset = n - len(shape)
        varying = [j + offset for j, s in enumerate(shape) if not _is_one(s)]
        if not isinstance(shape[-1], int) or shape[-1] != want_width or varying[-1:] != [n - 1]:
            return f"{name} has shape {shape}; expected width {want_width} in its last dim"
        if set(varying) - token_dims - {n - 1}:
            return f"{name} {shape} varies along dims other than the tokens and the features"
        if token_dims and not token_dims & set(varying):
            return f"{name} {shape} is the same for every token"
    if val(rot.cos).dtype != val(rot.sin).dtype:
        return f"cos is {val(rot.cos).dtype} but sin is {val(rot.sin).dtype}"
    return None


def _same_value(a: Any, b: Any, depth: int = 12) -> bool:
    """Whether two nodes compute the same value by the same ops from the same inputs."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or depth == 0:
        return a == b if not isinstance(a, fx.Node) and not isinstance(b, fx.Node) else False
    if a.op != "call_function" or b.op != "call_function" or a.target != b.target:
        return False
    if len(a.args) != len(b.args) or set(a.kwargs) != set(b.kwargs):
        return False

    def same(x, y):
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            return len(x) == len(y) and all(same(i, j) for i, j in zip(x, y))
        return _same_value(x, y, depth - 1)

    return same(list(a.args), list(b.args)) and all(same(a.kwargs[k], b.kwargs[k]) for k in a.kwargs)


def _size(graph: fx.Graph, node: fx.Node, dim: int) -> Any:
    """``node``'s size along ``dim``: the int, or a ``sym_size`` node where it is symbolic."""
    size = _shape(node)[dim]
    return size if isinstance(size, int) else make_call(graph, aten.sym_size.int, (node, dim))


def _as_rows(graph: fx.Graph, rot: Rotation, target: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(x as [T, H, D], cos as [T, W], sin as [T, W]) for the fused op (insert point set): tokens
    in the order the graph flattens them, picked by the rotation's gather where it has one."""
    x = rot.x
    n = len(_shape(x))
    labelled = [d for lab in rot.labels for d in lab]
    perm = [d for d in range(n) if d not in labelled] + labelled
    if perm != list(range(n)):
        x = make_call(graph, aten.permute.default, (x, perm))
    heads, head_size = _shape(target)[1:]
    x = make_call(graph, aten.reshape.default, (x, [-1, heads, head_size]))
    if rot.gather is not None:
        x = make_call(graph, aten.index.Tensor, (x, [rot.gather]))
    width = _shape(rot.cos)[-1]
    sources = [_unrounded_source(rot.cos), _unrounded_source(rot.sin)]
    halve = _repeats_columns(rot)
    tables = []
    for table, source in zip((rot.cos, rot.sin), sources):
        rows = _table_rows(graph, rot, table, source if all(s is not None for s in sources) else None)
        if halve:
            rows = (make_call(graph, aten.slice.Tensor, (rows, 1, 0, width // 2)) if rot.is_neox
                    else make_call(graph, aten.slice.Tensor, (rows, 1, 0, width, 2)))
        if rot.gather is not None:
            rows = make_call(graph, aten.index.Tensor, (rows, [rot.gather]))
        elif halve:
            # One column per pair, in a buffer of its own: Inductor then computes only these columns
            # (a slice alone would be a view of the whole table, computed and stored in full).
            rows = make_call(graph, aten.clone.default, (rows,), {"memory_format": torch.contiguous_format})
        tables.append(rows)
    return x, tables[0], tables[1]


def _table_rows(graph: fx.Graph, rot: Rotation, table: fx.Node, source: Optional[fx.Node]) -> fx.Node:
    """``table`` (as the graph broadcasts it against the rotation's layout; or ``source``, its
    unrounded values, with the same sizes apart from size-1 dims) as ``[tokens, W]`` rows in the
    order of the op's key rows: broadcast token dims expanded, token dims first in the order
    the key flattens them."""
    n = len(_shape(rot.x))
    shape = list(_shape(table))
    aligned = [1] * (n - len(shape)) + shape
    node = source if source is not None else table
    if len(_shape(node)) != n or source is not None:
        # Size-1 dims placed as in the broadcast table (the source's other sizes are the same).
        sizes, source_dims = [], [d for d, s in enumerate(_shape(node)) if not _is_one(s)]
        for s in aligned:
            sizes.append(1 if _is_one(s) else _size(graph, node, source_dims.pop(0)))
        node = make_call(graph, aten.reshape.default, (node, sizes))
    tokens = list(rot.labels[0])
    expand = [_size(graph, rot.x, d) if d in tokens and _is_one(aligned[d]) else -1 for d in range(n)]
    if any(e != -1 for e in expand):
        node = make_call(graph, aten.expand.default, (node, expand))
    order = tokens + [d for d in range(n - 1) if d not in tokens] + [n - 1]
    if order != list(range(n)):
        node = make_call(graph, aten.permute.default, (node, order))
    return make_call(graph, aten.reshape.default, (node, [-1, _shape(table)[-1]]))


_TABLE_VIEWS = _RESHAPES | {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                            aten.alias.default}


def _unrounded_source(table: fx.Node) -> Optional[fx.Node]:
    """The float32 value behind a bf16/fp16 table the graph computes as ``t.to(bf16)``, else None.

    Why: the unfused graph's rotation kernel inlines the table's computation (it is cheap
    pointwise math) and Inductor drops the ``.to(bf16)`` / back-to-float32 pair there, so the
    rotation multiplies by the *unrounded* float32 values. A custom op's input is a buffer
    (rounded), so the fused op is handed the float32 values instead, which is what the unfused
    kernel used. Tables that are graph inputs or buffers stay as they are (read rounded by both).
    """
    node = table
    while _call(node, *_TABLE_VIEWS):
        node = node.args[0]
    if not (_call(node, prims.convert_element_type.default) and node.args[1] in (torch.bfloat16, torch.float16)):
        return None
    source = node.args[0]
    if not (isinstance(source, fx.Node) and source.op == "call_function"
            and getattr(val(source), "dtype", None) == torch.float32):
        return None
    kept = [s for s in _shape(source) if not _is_one(s)]
    want = [s for s in _shape(table) if not _is_one(s)]
    if len(kept) != len(want) or not all(_same_size(a, b) for a, b in zip(kept, want)):
        return None
    return source


# Ops whose output column j (last dim) is computed from input column j alone, for every j.
_COLUMNWISE_UNARY = {aten.cos.default, aten.sin.default, aten.neg.default, aten.clone.default, aten.alias.default,
                     prims.convert_element_type.default, aten._to_copy.default}
_COLUMNWISE_BINARY = {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor}


def _width(node: Any) -> Optional[int]:
    shape = _shape(node)
    return shape[-1] if shape and isinstance(shape[-1], int) else None


def _column_input(node: fx.Node) -> Optional[fx.Node]:
    """The tensor whose column j alone gives ``node``'s column j (same width), if ``node`` is such
    an op: elementwise math with scalars or last-dim broadcasts, casts, and layout ops that keep
    the last dim (row-major reshapes with the same width, unsqueeze / expand / slice / select /
    permute of other dims)."""
    if node.op != "call_function" or not node.args or _width(node) is None:
        return None
    width, target, first = _width(node), node.target, node.args[0]
    if target in _COLUMNWISE_BINARY:
        tensors = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        full = [a for a in tensors if _width(a) == width and width != 1]
        rest = [a for a in tensors if a not in full]
        if len(full) == 1 and all(_shape(a) is not None and (len(_shape(a)) == 0 or _is_one(_shape(a)[-1]))
                                  for a in rest):
            return full[0]
        return None
    if not isinstance(first, fx.Node) or _width(first) != width:
        return None
    ndim = len(_shape(node))
    if target in _COLUMNWISE_UNARY or target in _RESHAPES or target is aten.expand.default:
        return first
    if target is aten.unsqueeze.default:
        return first if node.args[1] % ndim != ndim - 1 else None
    if target in (aten.slice.Tensor, aten.select.int):
        dim = node.args[1] if len(node.args) > 1 else 0
        return first if dim % len(_shape(first)) != len(_shape(first)) - 1 else None
    if target is aten.permute.default:
        return first if node.args[1][-1] % ndim == ndim - 1 else None
    return None


def _repeat_kind(node: fx.Node) -> Optional[str]:
    """``"halves"`` if every row of ``node`` is ``[a, a]`` by construction (``cat((f, f), -1)``, the
    table of transformers' NeoX rotary embeddings), ``"pairs"`` if it is ``[a0, a0, a1, a1, ...]``
    (``repeat_interleave(f, 2, -1)``, its GPT-J form), as the graph computes them: the cat itself,
    or the reshape of an expanded unsqueeze that Inductor's decompositions make of both."""
    if _call(node, aten.cat.default) and len(node.args[0]) == 2 and _last_dim(node, node.args[1] if len(node.args) > 1
                                                                                else 0):
        a, b = node.args[0]
        return "halves" if _same_value(a, b) else None
    if _call(node, aten.repeat_interleave.self_int):
        repeats, dim = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        return "pairs" if repeats == 2 and dim is not None and _last_dim(node, dim) else None
    if not _call(node, *_RESHAPES):
        return None
    inner = node.args[0]
    while _call(inner, aten.clone.default):
        inner = inner.args[0]
    if not (_call(inner, aten.expand.default) and _call(inner.args[0], aten.unsqueeze.default)):
        return None
    out, expanded, unsqueezed = _shape(node), _shape(inner), _shape(inner.args[0])
    if out is None or expanded is None or unsqueezed is None or len(expanded) < 2:
        return None
    if not all(isinstance(s, int) for s in (out[-1], *expanded[-2:], *unsqueezed[-2:])) \
            or out[-1] != expanded[-2] * expanded[-1]:
        return None
    if unsqueezed[-2:] == (1, expanded[-1]) and expanded[-2] == 2:
        return "halves"
    if unsqueezed[-2:] == (expanded[-2], 1) and expanded[-1] == 2:
        return "pairs"
    return None


def _table_repeats(table: fx.Node, depth: int = 24) -> Optional[str]:
    """:func:`_repeat_kind` of the node behind ``table`` through ops that keep columns apart."""
    node = table
    for _ in range(depth):
        if not isinstance(node, fx.Node):
            return None
        kind = _repeat_kind(node)
        if kind is not None:
            return kind
        node = _column_input(node)
    return None


def _repeats_columns(rot: Rotation) -> bool:
    """Whether the fused op can read half-width tables: cos and sin full-width, each computed
    with every column repeated for its rotation partner (NeoX ``[a, a]``, GPT-J ``[a0, a0, ...]``).
    The half holds every value, and the op reads half the table bytes."""
    if rot.half_table or (_width(rot.cos) or 1) % 2:
        return False
    want = "halves" if rot.is_neox else "pairs"
    return all(_table_repeats(t) == want for t in (rot.cos, rot.sin))


def _find_attention(graph: fx.Graph, layer_name: str) -> Optional[fx.Node]:
    found = [n for n in graph.nodes if _call(n, ATTENTION) and str(_attention_arg(n, "layer_name")) == layer_name]
    return found[0] if len(found) == 1 else None


# Positions in kvfuse::paged_attention's schema.
_ATTENTION_ARGS = {"layer_name": 10, "key": 13, "value": 14}


def _attention_arg(node: fx.Node, name: str) -> Any:
    i = _ATTENTION_ARGS[name]
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _reads_as_step_kv(user: fx.Node, node: fx.Node) -> bool:
    """``user`` is a paged_attention that takes ``node`` only as the step's key/value: an optional
    copy of the rows the write stores, which the attention can read from the cache instead."""
    if not _call(user, ATTENTION):
        return False
    step_kv = (_attention_arg(user, "key"), _attention_arg(user, "value"))
    rest = [a for i, a in enumerate(user.args) if i not in (13, 14)]
    rest += [v for k, v in user.kwargs.items() if k not in ("key", "value")]
    return node in step_kv and all(a is not node for a in rest)


def _drop_step_kv(user: fx.Node) -> None:
    """Remove the step's key/value from a paged_attention (both go: the op takes them together)."""
    user.args = tuple(None if i in (13, 14) else a for i, a in enumerate(user.args))
    user.kwargs = {k: v for k, v in user.kwargs.items() if k not in ("key", "value")}


def _refusal(rot: Rotation, device_type: Optional[str]) -> Optional[str]:
    from torch._inductor import config as inductor_config

    if rot.low_precision and inductor_config.emulate_precision_casts:
        return ("emulate_precision_casts is on and the rotation runs in bf16/fp16 ops, which Inductor then "
                "rounds one by one; the fused op rounds once")
    if device_type == "cuda" and not rot.cos_first and not inductor_config.emulate_precision_casts:
        return ("the sum is written rot * sin + x * cos; on CUDA Inductor's kernel contracts it to "
                "fma(rot, sin, x * cos), which the fused op (fma(x, cos, rot * sin)) does not reproduce")
    # (A float32 key is rounded to float32 either way.)
    computed = _computed_in_kernel(rot.x) if val(rot.x).dtype in (torch.bfloat16, torch.float16) else None
    if computed is not None and not inductor_config.emulate_precision_casts:
        return (f"the input is computed by {describe(computed)} (e.g. a QK-norm); Inductor computes it inside its "
                f"rotation kernel without rounding it to {val(rot.x).dtype}, while the fused op reads the rounded "
                f"values (eager PyTorch's), so the two would differ in the last bits")
    return _table_problem(rot)


# Producers whose output Inductor always stores as a buffer of its dtype (rounded), before any
# rotation kernel reads it.
_STORED = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._scaled_mm.default,
           aten.convolution.default, aten._int_mm.default}
_VIEWS_OF_STORED = _LAYOUT_OPS | {aten.slice.Tensor, aten.select.int, aten.expand.default, aten.split.Tensor,
                                  aten.split_with_sizes.default, aten.unbind.int, aten.t.default,
                                  aten.transpose.int}


def _computed_in_kernel(x: fx.Node) -> Optional[fx.Node]:
    """The elementwise or reduction node behind ``x`` (through views) that Inductor would fuse into
    the unfused graph's rotation kernel, or None where ``x`` is a graph input, a matmul's output
    or another op's (a custom op), which Inductor stores rounded to their dtype first."""
    node = x
    while isinstance(node, fx.Node):
        if node.op in ("placeholder", "get_attr"):
            return None
        if node.op != "call_function":
            return node
        if node.target is operator.getitem:
            node = node.args[0]
            continue
        if node.target in _VIEWS_OF_STORED:
            node = node.args[0]
            continue
        if node.target in _STORED:
            return None
        namespace = getattr(node.target, "namespace", None)
        if namespace not in ("aten", "prims"):
            return None  # a custom op or a higher-order op: its outputs are buffers
        return node
    return None


def _kernel_problem(site: Site, device_type: str) -> Optional[str]:
    """Why not fuse where the fused op would only have the reference's slow path on CUDA (a format
    the GPU kernels do not rotate, e.g. K and V in different formats), while the unfused graph runs
    Inductor's rotation and a GPU write; None otherwise."""
    if device_type != "cuda":
        return None
    from ..ops import registry

    code = int(site.args["kv_quant_mode"])
    try:
        choice = registry.select("rope_encode_and_cache_write", device_type, code)
    except (RuntimeError, ValueError) as e:
        return f"no kernel for rope_encode_and_cache_write: {e}"
    if choice.name == "reference":
        name = getattr(site.kv_quant_mode, "name", code)
        return (f"no GPU kernel rotates into {name} caches (the reference would run); the rotation stays "
                f"Inductor's kernel before the fused write")
    return None


def _backend_problem() -> Optional[str]:
    forced = envs.settings().forced_backend("cache")
    if forced is None:
        return None
    from ..ops import registry

    impl = registry.implementations().get(forced)
    if impl is None or "rope_encode_and_cache_write" not in impl.ops:
        return f"the cache backend is forced to {forced!r}, which has no rope_encode_and_cache_write"
    if "rope_encode_and_cache_write" in impl.partial_ops:
        return (f"the cache backend is forced to {forced!r}, whose rope_encode_and_cache_write takes only some "
                f"calls and would refuse the others")
    return None


def _describe(rot: Rotation, with_query: bool) -> str:
    table = ("half-width" if rot.half_table else
             "half-width (the graph's tables repeat each column for its partner; the op reads one of each)"
             if _repeats_columns(rot) else "full-width")
    if _unrounded_source(rot.cos) is not None and _unrounded_source(rot.sin) is not None:
        table += " (read in float32, before their .to(low precision), as Inductor's kernel reads them)"
    return (f"{rot.style}, rotary_dim={rot.rotary_dim}, {table} per-token cos/sin"
            + (", with the query" if with_query else ""))


# ----------------------------------------------------------------------------- the rewrite


def _replace(graph: fx.Graph, site: Site, key_rot: Rotation, q_rot: Optional[Rotation],
             attention: Optional[fx.Node]) -> fx.Node:
    old = site.node
    with graph.inserting_before(old):
        key, cos, sin = _as_rows(graph, key_rot, site.args["key"])
        query = _as_rows(graph, q_rot, attention.args[0])[0] if q_rot is not None else None
        args = {"query": query, "key": key, "value": site.args["value"]}
        if "kv_cache" in site.args:
            args["kv_cache"] = site.args["kv_cache"]
        args.update(slot_mapping=site.args["slot_mapping"], k_scale=site.args["k_scale"],
                    v_scale=site.args["v_scale"], cos=cos, sin=sin, positions=None,
                    rotary_dim=key_rot.rotary_dim, is_neox=key_rot.is_neox,
                    kv_quant_mode=site.args["kv_quant_mode"], layer_name=site.args["layer_name"])
        args.update({k: v for k, v in site.args.items() if k.startswith("_")})
        if site.form == "mutating":
            new = graph.call_function(ROPE_WRITE, tuple(args[n] for n in _ROPE_ARGS))
        else:
            new = graph.call_function(_HOPS[site.form], (ROPE_WRITE,), args)
    new.meta.update({k: v for k, v in old.meta.items() if k not in ("eager_input_vals", "val")})
    fake_q = _fake_query(query, key)
    old_val = old.meta.get("val")
    if site.form == "mutating":
        new.meta["val"] = fake_q
    elif isinstance(old_val, (tuple, list)):
        new.meta["val"] = (fake_q, *old_val[1:])
    if "eager_input_vals" in old.meta:
        if site.form == "mutating":
            new.meta["eager_input_vals"] = (tuple(torch.fx.node.map_arg(new.args, val)), {})
        else:
            old_args, old_kwargs = old.meta["eager_input_vals"]
            # Same structure as the node's (args, kwargs): Inductor maps one onto the other.
            new.meta["eager_input_vals"] = (old_args, {
                k: (old_kwargs[k] if k in old_kwargs and k not in ("key", "query") else torch.fx.node.map_arg(v, val))
                for k, v in args.items()})
    # Both ops' functional outputs are (op result, mutated bases...); the write's result was None.
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    if q_rot is not None:
        if site.form == "mutating":
            q_out = new
        else:
            with graph.inserting_after(new):
                q_out = graph.call_function(operator.getitem, (new, 0))
            q_out.meta["val"] = fake_q
        attention.replace_input_with(attention.args[0], q_out)
    return new


def _fake_query(query: Optional[fx.Node], key: fx.Node):
    from torch._guards import detect_fake_mode

    ref = val(query) if query is not None else val(key)
    mode = detect_fake_mode([ref])
    if mode is None:
        return None
    with mode:
        if query is None:
            return torch.empty((0,), dtype=ref.dtype, device=ref.device)
        return torch.empty(ref.shape, dtype=ref.dtype, device=ref.device)


def _rotation_nodes(rot_target: fx.Node, stop: set) -> list:
    """Every node the rotation of ``rot_target`` computes (stopping at ``stop``), latest first."""
    seen, todo = set(), [rot_target]
    while todo:
        node = todo.pop()
        if not isinstance(node, fx.Node) or node in seen or node in stop or node.op != "call_function":
            continue
        seen.add(node)
        todo.extend(n for n in node.all_input_nodes)
    order = {n: i for i, n in enumerate(rot_target.graph.nodes)}
    return sorted(seen, key=lambda n: -order[n])


def run(graph: fx.Graph, fuse: bool = True, records: Optional[list] = None, enabled: bool = True) -> list:
    """Fuse each recognised key rotation into its layer's write; returns ``records``, amended.
    ``enabled=False`` (``make_backend(fuse_rotary=False)``) leaves every rotation to Inductor and
    says in each record what would have been fused."""
    records = list(records or [])
    sites = find_sites(graph)
    if len(sites) != len(records) or any(s.layer_name != r.layer_name for s, r in zip(sites, records)):
        logger.debug("%s: %d sites but %d records; rotary fusion skipped", NAME, len(sites), len(records))
        return records
    backend_problem = _backend_problem()
    needs_sort = False
    for i, site in enumerate(sites):
        record = records[i]

        def note(text: str) -> None:
            records[i] = dataclasses.replace(record, reason=f"{record.reason}; rotary: {text}")

        if site.op is FUSED_WRITE:
            key_input = site.args["key"]
        elif not fuse and not record.fused:
            # The baseline: say what would happen if the encode fusion had run.
            from .fuse_encode_cache_write import _recognise

            enc = _recognise(site.args["key_rows"], site)
            key_input = getattr(enc, "x", None)
        else:
            key_input = None
        if key_input is None:
            note("not fused (the encode and the write are not fused)")
            continue
        key_rot = match_rotation(key_input)
        if isinstance(key_rot, Rejection):
            note(f"not fused: key: {key_rot.reason}")
            continue
        device_type = getattr(val(key_rot.x), "device", torch.device("cpu")).type
        problem = _refusal(key_rot, device_type) or backend_problem or _kernel_problem(site, device_type)
        if problem:
            note(f"not fused: {problem}")
            continue
        attention = _find_attention(graph, site.layer_name)
        q_rot, q_note = None, ""
        if attention is None:
            q_note = "; query not fused: no single paged_attention of this layer"
        else:
            q = match_rotation(attention.args[0])
            if isinstance(q, Rejection):
                q_note = f"; query not fused: {q.reason}"
            elif (q.is_neox, q.rotary_dim, q.half_table) != (key_rot.is_neox, key_rot.rotary_dim, key_rot.half_table) \
                    or not (_same_value(q.cos, key_rot.cos) and _same_value(q.sin, key_rot.sin)):
                q_note = "; query not fused: it is rotated with other tables or another style than the key"
            elif not _same_value(q.gather, key_rot.gather):
                q_note = "; query not fused: its rows are picked by another index than the key's"
            elif val(q.x).dtype != val(key_rot.x).dtype:
                q_note = f"; query not fused: it is {val(q.x).dtype}, the key {val(key_rot.x).dtype}"
            elif (_refusal(q, device_type)) is not None:
                q_note = f"; query not fused: {_refusal(q, device_type)}"
            elif site.form == "mutating" and _defined_after(q.x, site.node):
                q_note = "; query not fused: its input is computed after the write in an unfunctionalized graph"
            else:
                q_rot = q
        if not fuse:
            note(f"fusion disabled; would fuse ({_describe(key_rot, q_rot is not None)}){q_note}")
            continue
        if not enabled:
            note(f"not fused: switched off by fuse_rotary=False; would fuse "
                 f"({_describe(key_rot, q_rot is not None)}){q_note}")
            continue
        old_key = site.args["key"]
        old_query = attention.args[0] if q_rot is not None else None
        needs_sort |= any(_defined_after(n, site.node) for n in
                          ([q_rot.x, q_rot.cos, q_rot.sin] if q_rot is not None else []))
        readers = [u for u in old_key.users if _reads_as_step_kv(u, old_key)]
        for user in readers:
            _drop_step_kv(user)
        new = _replace(graph, site, key_rot, q_rot, attention)
        dead = _rotation_nodes(old_key, {key_rot.x, key_rot.cos, key_rot.sin})
        if old_query is not None:
            dead += _rotation_nodes(old_query, {q_rot.x, q_rot.cos, q_rot.sin})
        order = {n: j for j, n in enumerate(graph.nodes)}
        erase_if_dead(graph, sorted(set(dead), key=lambda n: -order.get(n, -1)))
        logger.debug("%s: %s -> %s", NAME, site.layer_name, new.name)
        kv_note = ("; the attention reads this step's keys from the cache (the rotated key is no longer "
                   "materialised)") if readers else ""
        note(f"fused into rope_encode_and_cache_write ({_describe(key_rot, q_rot is not None)}){q_note}{kv_note}")
    if needs_sort:
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
    return records


def _defined_after(node: Any, anchor: fx.Node) -> bool:
    if not isinstance(node, fx.Node):
        return False
    for n in anchor.graph.nodes:
        if n is node:
            return False
        if n is anchor:
            return True
    return False
