"""Graph plumbing shared by kvfuse's passes: cache-write sites, encodings, node creation.

A *site* is one ``kvfuse::cache_write`` in a post-grad graph, in whichever form the graph
holds it: ``auto_functionalized`` (v1), ``auto_functionalized_v2`` or, for graphs that were
never functionalized, the mutating op itself. Sites of the already fused
``kvfuse::encode_and_cache_write`` are collected too, so the report counts every cache write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..kv_cache import KVFormat, KVQuantMode

_HOPS = {
    "v1": torch.ops.higher_order.auto_functionalized,
    "v2": torch.ops.higher_order.auto_functionalized_v2,
}
CACHE_WRITE = torch.ops.kvfuse.cache_write.default
FUSED_WRITE = torch.ops.kvfuse.encode_and_cache_write.default
ENCODE_KV = torch.ops.kvfuse.encode_kv.default

# Schema argument names: both ops name their one mutable argument ``kv_cache``, which is what
# lets a rewrite keep v2's base bookkeeping (``_kv_cache_base_index``, ``_all_bases``) as is.
_CACHE_WRITE_ARGS = ("key_rows", "value_rows", "kv_cache", "slot_mapping", "kv_quant_mode", "layer_name")
_FUSED_ARGS = ("key", "value", "kv_cache", "slot_mapping", "k_scale", "v_scale", "kv_quant_mode", "layer_name")


@dataclass
class Site:
    """One cache write: the node, its functional form and its (op-schema) arguments."""

    node: fx.Node
    form: str  # "v1" | "v2" | "mutating"
    op: Any  # CACHE_WRITE or FUSED_WRITE
    args: dict  # schema name -> node/constant (the mutable kv_cache is absent in v2)

    @property
    def layer_name(self) -> str:
        return str(self.args["layer_name"])

    @property
    def kv_quant_mode(self) -> Union[KVQuantMode, KVFormat, int]:
        """The layer's mode; a :class:`KVFormat` where K and V differ; the raw int if it is neither."""
        raw = int(self.args["kv_quant_mode"])
        try:
            return KVFormat.from_code(raw).narrowed
        except ValueError:
            return raw


def _as_site(node: fx.Node) -> Optional[Site]:
    if node.op != "call_function":
        return None
    for form, hop in _HOPS.items():
        if node.target is hop and node.args and node.args[0] in (CACHE_WRITE, FUSED_WRITE):
            return Site(node, form, node.args[0], dict(node.kwargs))
    if node.target in (CACHE_WRITE, FUSED_WRITE):
        names = _CACHE_WRITE_ARGS if node.target is CACHE_WRITE else _FUSED_ARGS
        bound = dict(zip(names, node.args))
        bound.update(node.kwargs)
        return Site(node, "mutating", node.target, bound)
    return None


def find_sites(graph: fx.Graph) -> list[Site]:
    """Every cache write (unfused or fused) in graph order."""
    return [site for site in map(_as_site, graph.nodes) if site is not None]


@dataclass
class Encoding:
    """How one of K/V was turned into cache rows, as recognised by one fusion module.

    ``scale`` is the divisor the fused op must use: a tensor node, or a Python number to be
    materialised as a float32 scalar tensor. ``invert_scale`` marks the ``x * inv_scale`` form,
    whose divisor is ``1 / inv_scale`` (see ``plain_fp8_encoding`` for what that guarantees).
    ``nodes`` are the encoding's own nodes (root first), erased once the write is fused.
    """

    source: str
    x: fx.Node
    scale: Union[fx.Node, float]
    kv_quant_mode: KVQuantMode
    cache_dtype: torch.dtype
    nodes: list = field(default_factory=list)
    invert_scale: bool = False
    bit_exact: bool = True


@dataclass
class Rejection:
    """A recognised-but-unfusable encoding and why."""

    reason: str


def val(node_or_const: Any) -> Any:
    """The fake value of a node (``meta['val']``), or the constant itself."""
    if isinstance(node_or_const, fx.Node):
        return node_or_const.meta.get("val")
    return node_or_const


def describe(node: Any) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    if hasattr(target, "_schema"):
        name = str(target).replace(".default", "")
    return f"{node.name} ({name})" if node.op == "call_function" else f"{node.name} ({node.op})"


def other_users(node: fx.Node, allowed: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u is not allowed]


def _fake_mode(*nodes: fx.Node):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([val(n) for n in nodes if isinstance(val(n), torch.Tensor)])


def make_call(graph: fx.Graph, target, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insertion point with a fake ``val``."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    fake_mode = _fake_mode(*[a for a in (*args, *kwargs.values()) if isinstance(a, fx.Node)])
    fake_args = torch.fx.node.map_arg(args, val)
    fake_kwargs = torch.fx.node.map_arg(kwargs, val)
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def scalar_tensor(graph: fx.Graph, value: float, like: fx.Node) -> fx.Node:
    """A float32 0-d tensor holding ``value`` on ``like``'s device (an ``aten.full`` node)."""
    device = val(like).device
    node = graph.call_function(
        torch.ops.aten.full.default, ([], float(value)),
        {"dtype": torch.float32, "layout": torch.strided, "device": device, "pin_memory": False},
    )
    fake_mode = _fake_mode(like)
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = torch.full([], float(value), dtype=torch.float32, device=device)
    return node


def replace_with_fused(graph: fx.Graph, site: Site, key: fx.Node, value: fx.Node, k_scale: fx.Node,
                       v_scale: fx.Node) -> fx.Node:
    """Swap ``site`` (an unfused cache_write) for ``encode_and_cache_write`` in the same form.

    The functional form is kept (same HOP, same mutable-argument bookkeeping, same output
    structure: both ops return nothing and mutate only ``kv_cache``), so Inductor's own
    reinplacing turns it back into an in-place write exactly as it would the original.
    Call inside ``graph.inserting_before(site.node)``.
    """
    old = site.node
    fused_args = {"key": key, "value": value}
    if "kv_cache" in site.args:
        fused_args["kv_cache"] = site.args["kv_cache"]
    fused_args.update(slot_mapping=site.args["slot_mapping"], k_scale=k_scale, v_scale=v_scale,
                      kv_quant_mode=site.args["kv_quant_mode"], layer_name=site.args["layer_name"])
    # v2 bookkeeping of the mutable argument's base (``_kv_cache_base_index``, ``_all_bases``, views).
    fused_args.update({k: v for k, v in site.args.items() if k.startswith("_")})
    if site.form == "mutating":
        new = graph.call_function(FUSED_WRITE, tuple(fused_args[n] for n in _FUSED_ARGS))
    else:
        new = graph.call_function(_HOPS[site.form], (FUSED_WRITE,), fused_args)
    new.meta.update({k: v for k, v in old.meta.items() if k != "eager_input_vals"})
    if "eager_input_vals" in old.meta:
        old_args, old_kwargs = old.meta["eager_input_vals"]
        if site.form == "mutating":
            new.meta["eager_input_vals"] = (tuple(torch.fx.node.map_arg(new.args, val)), {})
        else:
            kwargs = {k: (old_kwargs.get(k) if k in site.args and k not in ("key_rows", "value_rows")
                          else torch.fx.node.map_arg(v, val))
                      for k, v in fused_args.items()}
            new.meta["eager_input_vals"] = (old_args, kwargs)
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return new


def erase_if_dead(graph: fx.Graph, nodes: list) -> None:
    """Erase ``nodes`` (root first) that lost all their users, walking towards the inputs."""
    for node in nodes:
        if isinstance(node, fx.Node) and not getattr(node, "_erased", False) and not node.users:
            graph.erase_node(node)
