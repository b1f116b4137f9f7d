"""Hugging Face transformers models on kvfuse paged caches, eager and compiled.

Usage::

    import kvfuse
    from kvfuse.integrations import transformers as kvt

    model = kvt.enable(model, kvfuse.KVCacheConfig(kv_cache_dtype="fp8", skip_layers=("sliding_window",)))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32)   # unchanged user code
    model.forward = torch.compile(model.forward, backend=kvfuse.make_backend())  # optional

What :func:`enable` does, through transformers' own extension points:

- **One kvfuse layer per attention module.** Every decoder attention module (a module whose
  class name ends in ``Attention`` and that carries an integer ``layer_idx``) gets a
  :class:`kvfuse.PagedAttention` child named ``kvfuse_attn`` whose ``.spec`` is that layer's own
  :class:`kvfuse.KVCacheSpec`: layer index, head_dim, KV heads (GQA), the model dtype, and the
  layer's sliding window (the module's ``sliding_window``; else ``config.layer_types`` with
  ``config.sliding_window``; else ``config.sliding_window`` for every layer, as Mistral applies
  it). The softmax scale is the module's ``scaling`` (Gemma's ``query_pre_attn_scalar``), the
  logit soft-cap its ``attn_logit_softcapping`` (Gemma 2), and a module with a ``sinks``
  parameter (gpt-oss) passes it on every call. The attention function checks at every call that
  the arguments the model hands it (``scaling``, ``sliding_window``, ``softcap``, ``s_aux``)
  agree with the layer's plan and raises otherwise, so nothing is silently dropped.
- **The checkpoint's KV scheme.** ``quantization_config.kv_cache_scheme`` (compressed-tensors:
  8-bit float -> ``fp8``, 4-bit float -> ``nvfp4``) or ``kv_cache_quant_algo`` (ModelOpt:
  ``FP8`` / ``NVFP4``) becomes the config's ``checkpoint_kv_cache_dtype`` unless the user set
  one; DESIGN.md's precedence then applies (skip rule, the user's explicit ``kv_cache_dtype``,
  the checkpoint's, the model dtype).
- **Checkpoint scales.** K/V scales are read by the names quantized checkpoints
  use: ``<attn>.k_scale`` / ``<attn>.v_scale`` (compressed-tensors, and vLLM's
  ``<attn>.attn.k_scale``), ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` (ModelOpt)
  and the legacy ``<attn>.kv_scale`` (both), from the model's own parameters or from the
  ``*.safetensors`` files of a local checkpoint directory (``model.name_or_path``), and set on
  FP8 layers (NVFP4 layers only when the checkpoint declares NVFP4: its global scale is another
  quantity). A scale with one value per KV head (vLLM's ``kv_scale_type="attn_head"``) loads into
  layers built with ``KVCacheConfig(kv_scale_granularity="head")`` and is refused by per-tensor ones.
- **Attention.** ``AttentionInterface.register("kvfuse", ...)`` and
  ``model.set_attn_implementation("kvfuse")``. No mask function is registered, so transformers
  builds no masks: padding, causality and windows come from the paged metadata.
- **The cache.** :class:`KVFuseCache` is a transformers ``Cache`` holding one paged cache per
  layer (each allocated from its layer's spec, one shared page table). Its ``update`` hands the
  new K/V through unchanged; the attention function writes them (fused encode + store) and
  attends over the pages. A forward pre-hook on the model, run eagerly before every call,
  turns the step's 2-D ``attention_mask`` into kvfuse metadata: which of the ``[B, T]`` new
  positions are real tokens (padding is never written), pages for them, and the permutation
  that packs real tokens first (``kvfuse_step`` keyword, which transformers forwards to the
  attention function like its own flash-attention keywords). With no cache, or the empty
  ``DynamicCache`` that ``generate`` creates, the hook puts a :class:`KVFuseCache` in its place,
  so ``generate`` and plain forwards run on kvfuse without other changes. The pool grows
  geometrically when a batch outgrows it (one recompile under ``torch.compile``); pass
  ``KVFuseCache(model, max_seq_len=...)`` to size it up front, as ``cache=`` (transformers 5.24
  on) or ``past_key_values=`` (any version: on 5.24 the hook hands it over as ``cache``).

Padding: left padding (``generate``'s convention) matches transformers exactly, sliding
windows included, since pads sit before every real token. With right padding followed by more
steps, transformers counts the pad columns inside a sliding window's distance and kvfuse does
not (only real tokens are cached): windowed layers then differ from transformers'. Rows whose
new positions are all padding add nothing to the cache. Beam search (``reorder_cache``) and
cropping are not supported and raise.

Tensor parallelism: a model loaded with transformers' own tensor parallelism
(``from_pretrained(path, distributed_config=DistributedConfig(tp_size=N))``, or ``tp_plan="auto"``,
under ``torchrun``; transformers needs ``accelerate`` for it) computes this rank's share of the
query and KV heads in its sharded projections. :func:`enable` reads the layout from the device
mesh of the attention modules' DTensor parameters (else ``model._device_mesh``), gives each
layer the spec of this rank's KV heads, and checks that this rank's ``k_proj`` / ``v_proj``
produce exactly those heads. A ``KVCacheConfig`` left at ``tp_size=1, tp_rank=0`` takes the
model's layout; one that names another raises. ``num_key_value_heads`` must be divisible by the
TP size (transformers' colwise split would cut a head in half). Each rank's :class:`KVFuseCache`
holds only its heads; the page bookkeeping is the same on every rank, since every rank sees the
same masks. :func:`model_tensor_parallel` returns the layout and its process group (for
:func:`kvfuse.distributed.gather_reports`).

Compiled: the pre-hook runs outside the graph (it reads the mask on the host and allocates
pages); compile ``model.forward`` (``model.forward = torch.compile(model.forward, ...)``) so
``generate`` keeps calling the hook eagerly, or call a ``torch.compile(model)`` with a
``kvfuse_step`` prepared by :meth:`KVFuseCache.prepare_step`. The metadata carries no host
integers, so decode steps do not recompile as sequences grow.
"""

from __future__ import annotations

import dataclasses
import glob
import inspect
import logging
import math
import os
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"kvfuse.integrations.transformers needs the transformers package (pip install 'kvfuse[hf]'): {e}"
    ) from e

from ..kv_cache import KVCacheConfig, KVCacheSpec, KVQuantMode, parse_kv_cache_dtype
from ..layers import AttentionMetadata, PagedAttention
from ..models.cache_manager import PagedCacheManager

logger = logging.getLogger(__name__)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "STEP_KWARG",
    "KVFuseCache",
    "KVFuseStep",
    "enable",
    "kvfuse_layers",
    "checkpoint_kv_cache_dtype",
    "load_kv_scales",
    "attention_forward",
    "model_tensor_parallel",
]

ATTN_IMPLEMENTATION = "kvfuse"
STEP_KWARG = "kvfuse_step"
_HOOK_ATTR = "_kvfuse_hook"
_DEFAULT_BLOCK_SIZE = 16
# Initial room per sequence beyond its first step when nothing sizes the cache up front.
_DEFAULT_HEADROOM = 256


# ----------------------------------------------------------------------------- layer plan


def _text_config(model: nn.Module):
    config = model.config
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = [
        (name, module) for name, module in model.named_modules()
        if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int)
        and not isinstance(module, PagedAttention)
    ]
    if not found:
        raise ValueError(f"{type(model).__name__} has no decoder attention module (a *Attention module with an "
                         f"integer layer_idx); kvfuse.integrations.transformers supports decoder-only models")
    return found


def _layer_sliding_window(module: nn.Module, config) -> Optional[int]:
    if hasattr(module, "sliding_window"):
        window = module.sliding_window
    elif getattr(config, "layer_types", None) is not None:
        window = config.sliding_window if config.layer_types[module.layer_idx] == "sliding_attention" else None
    else:
        window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def _layer_softcap(module: nn.Module, config) -> float:
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap is None:
        cap = getattr(config, "attn_logit_softcapping", None)
    return float(cap) if cap else 0.0


def kvfuse_layers(model: nn.Module) -> list[PagedAttention]:
    """The kvfuse layers :func:`enable` attached, in layer-index order."""
    layers = [m.kvfuse_attn for _, m in _attention_modules(model) if isinstance(getattr(m, "kvfuse_attn", None),
                                                                                  PagedAttention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no kvfuse layers: call kvfuse.integrations.transformers."
                         f"enable(model, ...) first")
    return sorted(layers, key=lambda layer: layer.spec.layer_index)


# ----------------------------------------------------------------------------- checkpoint scheme and scales


def _as_dict(obj) -> dict:
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    to_dict = getattr(obj, "to_dict", None)
    return dict(to_dict()) if to_dict is not None else dict(vars(obj))


def checkpoint_kv_cache_dtype(config) -> Optional[str]:
    """The KV-cache dtype name a quantized checkpoint declares in ``config.quantization_config``.

    compressed-tensors: ``kv_cache_scheme`` ``{"type": "float", "num_bits": 8}`` -> ``"fp8"``
    (e4m3), 4 bits -> ``"nvfp4"``; ModelOpt: ``kv_cache_quant_algo`` ``"FP8"`` / ``"NVFP4"``.
    None when the checkpoint declares no KV quantization; ValueError for a scheme kvfuse cannot hold.
    """
    qc = _as_dict(getattr(config, "quantization_config", None))
    if not qc:
        return None
    scheme = qc.get("kv_cache_scheme")
    if scheme:
        scheme = _as_dict(scheme)
        kind, bits = scheme.get("type"), scheme.get("num_bits")
        if kind == "float" and bits == 8:
            return "fp8"
        if kind == "float" and bits == 4:
            return "nvfp4"
        raise ValueError(f"quantization_config.kv_cache_scheme={scheme!r} has no kvfuse format; supported: "
                         f"type 'float' with num_bits 8 (fp8 e4m3) or 4 (nvfp4)")
    algo = qc.get("kv_cache_quant_algo") or _as_dict(qc.get("quantization")).get("kv_cache_quant_algo")
    if algo:
        names = {"FP8": "fp8", "NVFP4": "nvfp4"}
        if str(algo).upper() not in names:
            raise ValueError(f"quantization_config kv_cache_quant_algo={algo!r} has no kvfuse format; "
                             f"supported: {sorted(names)}")
        return names[str(algo).upper()]
    return None


def _scale_names(module_name: str, which: str) -> tuple[str, ...]:
    """Checkpoint names of one attention module's K (``which="k"``) or V scale, in lookup order."""
    return (f"{module_name}.{which}_scale", f"{module_name}.attn.{which}_scale",
            f"{module_name}.{which}_proj.{which}_scale", f"{module_name}.kv_scale")


def _checkpoint_tensors(model: nn.Module, wanted: set) -> dict:
    """Tensors named in ``wanted`` from the model's own state and its local safetensors files."""
    found = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name in wanted:
            found[name] = _local_tensor(t.detach())
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if path and os.path.isdir(path) and len(found) < len(wanted):
        try:
            from safetensors import safe_open
        except ImportError:  # pragma: no cover - safetensors ships with transformers
            return found
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(file, framework="pt") as f:
                for key in set(f.keys()) & (wanted - set(found)):
                    found[key] = f.get_tensor(key)
    return found


def load_kv_scales(model: nn.Module, scales: Optional[Mapping[str, Any]] = None,
                   declared: Optional[str] = None) -> dict:
    """Set each kvfuse layer's ``k_scale`` / ``v_scale`` from checkpoint names (see the module doc).

    ``scales``: a mapping name -> tensor/float to read instead of the model and its checkpoint
    directory. ``declared``: the checkpoint's declared dtype name (NVFP4 layers take scales only
    when it is ``nvfp4``). A checkpoint scale holds one value, or one per KV head of the model
    (a layer built with ``kv_scale_granularity="head"`` keeps its rank's heads; a per-tensor layer
    refuses it). Returns ``{layer_name: (k_scale, v_scale)}`` for the layers set: floats, or lists
    of this rank's per-head values.
    """
    modules = [(n, m) for n, m in _attention_modules(model) if isinstance(getattr(m, "kvfuse_attn", None),
                                                                          PagedAttention)]
    wanted = {name for n, _ in modules for which in "kv" for name in _scale_names(n, which)}
    source = dict(scales) if scales is not None else _checkpoint_tensors(model, wanted)
    declared_mode = parse_kv_cache_dtype(declared) if declared else None
    loaded = {}
    for module_name, module in modules:
        layer = module.kvfuse_attn
        values, names = [], []
        for which in "kv":
            name = next((n for n in _scale_names(module_name, which) if n in source), None)
            if name is None:
                break
            names.append(name)
            t = torch.as_tensor(source[name]).detach().float()
            if t.numel() != 1 and not layer.spec.scale_shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}: layer "
                                 f"{layer.layer_name!r} takes one per-tensor scale per K and V; per-head scales need a "
                                 f"layer built with KVCacheConfig(kv_scale_granularity='head')")
            values.append(t)
        if len(values) < 2:
            continue
        # Per side (K and V may differ): a checkpoint scale means what its declared format means, so
        # an NVFP4 side takes it only from an NVFP4 checkpoint; a side that takes none keeps its own.
        fmt = layer.spec.kv_format
        takes = [mode.has_static_scales and (mode is not KVQuantMode.NVFP4 or declared_mode is KVQuantMode.NVFP4)
                 for mode in fmt.sides]
        if not any(takes):
            logger.debug("layer %s: checkpoint scales ignored (cache format %s)", layer.layer_name, fmt.name)
            continue
        values = [v if take else own for v, take, own in zip(values, takes, (layer.k_scale, layer.v_scale))]
        try:
            layer.set_scales(*values)
        except ValueError as e:
            raise ValueError(f"checkpoint scales {names} for layer {layer.layer_name!r}: {e}") from None
        loaded[layer.layer_name] = tuple(s.tolist() if s.dim() else float(s) for s in (layer.k_scale, layer.v_scale))
    if loaded:
        logger.info("loaded checkpoint K/V scales for %d layers", len(loaded))
    return loaded


# ----------------------------------------------------------------------------- step metadata


@dataclasses.dataclass
class KVFuseStep:
    """One forward step's paged metadata, passed to every layer as the ``kvfuse_step`` keyword.

    Query rows are the model's ``[B, T]`` positions flattened (``b * T + t``); ``gather`` packs
    them with each row's real tokens first, in row order, then the padding; ``scatter`` is its
    inverse. ``identity`` (every position real) skips both. ``kv_caches[cache_index[layer_idx]]``
    is a layer's cache.
    """

    metadata: AttentionMetadata
    gather: torch.Tensor
    scatter: torch.Tensor
    identity: bool
    kv_caches: list
    cache_index: dict


class KVFuseCacheLayer(CacheLayerMixin):
    """transformers' per-layer view of a :class:`KVFuseCache` (the pages live in the parent)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, parent: "KVFuseCache", layer_idx: int, sliding_window: Optional[int]):
        super().__init__()
        self._parent = parent
        self.layer_idx = layer_idx
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        # The attention function writes the new K/V into the pages together with the step's slots.
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self._parent.get_seq_length()

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self._parent.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("KVFuseCache does not support beam search (reorder_cache); use greedy or sampling")


class KVFuseCache(Cache):
    """A transformers ``Cache`` of kvfuse paged caches, one per attention layer of an enabled model.

    Rows of the batch are sequences ``0..B-1``. ``max_seq_len`` / ``num_blocks`` /
    ``block_size`` size the pool up front (defaults: sized at the first step and grown
    geometrically). ``kv_caches[i]`` is the cache of the ``i``-th kvfuse layer (see
    :attr:`layers_by_index`); each follows that layer's spec.
    """

    def __init__(self, model: nn.Module, max_seq_len: Optional[int] = None, num_blocks: Optional[int] = None,
                 block_size: int = _DEFAULT_BLOCK_SIZE, device: Union[torch.device, str, None] = None) -> None:
        self._kvfuse_layers = kvfuse_layers(model)
        for name, value in (("max_seq_len", max_seq_len), ("num_blocks", num_blocks)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name}={value!r} must be None or a positive int")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        self.specs: list[KVCacheSpec] = [layer.spec for layer in self._kvfuse_layers]
        self.cache_index = {spec.layer_index: i for i, spec in enumerate(self.specs)}
        layers = [KVFuseCacheLayer(self, spec.layer_index, spec.sliding_window) for spec in self.specs]
        super().__init__(layers=layers)
        self.block_size = block_size
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self._max_seq_len = max_seq_len
        self._num_blocks = num_blocks
        self.manager: Optional[PagedCacheManager] = None
        self._columns = 0
        # While a step's forward runs, transformers must see the positions before it (as with a
        # DynamicCache, whose layers grow only in update()): the model derives default position ids
        # from get_seq_length().
        self._past = 0
        self._in_step = False
        self._batch: Optional[int] = None
        self._released: set = set()

    # ------------------------------------------------------------------ transformers' Cache API

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions seen so far, padding included (what a ``DynamicCache`` would hold); inside a
        step's forward, the positions before that step."""
        return self._past if self._in_step else self._columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        # transformers would build static 4-D masks and auto-compile for a compileable cache;
        # kvfuse needs neither (compile model.forward yourself, see the module docstring).
        return False

    @property
    def batch_size(self) -> int:
        return self._batch if self._batch is not None else -1

    def reset(self) -> None:
        """Forget every sequence (pages return to the pool; their contents are overwritten later)."""
        if self.manager is not None:
            for seq in list(self.manager._pages):
                self.manager.free(seq)
        self._columns = self._past = 0
        self._in_step = False
        self._batch = None
        self._released.clear()

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("KVFuseCache does not support beam search (reorder_cache); use greedy or sampling")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("KVFuseCache does not support crop (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("KVFuseCache does not support batch_repeat_interleave (num_return_sequences > 1 "
                                  "with a cache, beam search)")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("KVFuseCache does not support batch_select_indices")

    # ------------------------------------------------------------------ kvfuse

    @property
    def kv_caches(self) -> list:
        return self.manager.kv_caches if self.manager is not None else []

    def release(self, rows) -> None:
        """Return the pages of finished rows to the pool; later steps must mask those rows out."""
        for row in rows:
            if self.manager is not None and row in self.manager._pages:
                self.manager.free(row)
            self._released.add(int(row))

    def end_step(self) -> None:
        """Mark the prepared step as done (the enabled model's forward hook calls it)."""
        self._in_step = False

    def _ensure_capacity(self, lengths: list) -> None:
        longest = max(lengths) if lengths else 1
        if self.manager is None:
            max_seq_len = self._max_seq_len or longest + _DEFAULT_HEADROOM
            per_seq = -(-max_seq_len // self.block_size)
            num_blocks = self._num_blocks or per_seq * max(len(lengths), 1)
            self.manager = PagedCacheManager(self.specs, num_blocks=num_blocks, block_size=self.block_size,
                                             device=self.device, max_seq_len=max_seq_len)
        m = self.manager
        if longest > m.max_seq_len:
            m.grow(max_seq_len=max(2 * m.max_seq_len, longest))
        needed = sum(-(-n // self.block_size) - len(m._pages.get(b, ())) for b, n in enumerate(lengths) if n)
        if needed > m.num_free_blocks:
            m.grow(num_blocks=max(2 * m.num_blocks, m.num_blocks - m.num_free_blocks + needed))

    @torch.compiler.disable
    def prepare_step(self, attention_mask: Optional[torch.Tensor], batch_size: int, num_new: int) -> KVFuseStep:
        """Allocate pages for the real tokens of a ``[batch_size, num_new]`` step and build its metadata.

        ``attention_mask``: transformers' 2-D padding mask over all positions so far
        (``[B, past + num_new]``, 1 = real token), or None (every new position is real).
        """
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
                raise ValueError(
                    f"attention_mask must be None or a 2-D [batch, positions] padding mask for kvfuse, got "
                    f"{type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}")
            if attention_mask.shape[0] != batch_size or attention_mask.shape[1] < num_new:
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected [{batch_size}, "
                                 f">= {num_new}] for a step of {num_new} new positions")
            real = attention_mask[:, -num_new:].to("cpu", torch.bool)
        else:
            real = torch.ones(batch_size, num_new, dtype=torch.bool)
        if self._batch is not None and batch_size != self._batch:
            raise ValueError(f"batch of {batch_size} rows but this KVFuseCache holds {self._batch} sequences; "
                             f"start a new cache (or reset()) for a new batch")
        counts = real.sum(1).tolist()
        for row in self._released:
            if counts[row]:
                raise ValueError(f"row {row} was released but has {counts[row]} new tokens in this step")
        rows = [b for b in range(batch_size) if counts[b]]
        if not rows:
            raise ValueError("the step has no real token (attention_mask is 0 for every new position)")
        self._ensure_capacity([(self.manager.seq_len(b) if self.manager else 0) + counts[b] for b in range(batch_size)])
        step = self.manager.step({b: [0] * counts[b] for b in rows}, pad_to=batch_size * num_new)
        self._past, self._columns, self._in_step = self._columns, self._columns + num_new, True
        self._batch = batch_size
        flat = real.reshape(-1)
        identity = bool(flat.all())
        # Row-major order of the real positions is row order then position order: exactly the
        # packed order the manager laid out; the padding follows in any fixed order.
        gather = torch.cat([flat.nonzero().reshape(-1), (~flat).nonzero().reshape(-1)])
        scatter = torch.empty_like(gather)
        scatter[gather] = torch.arange(gather.numel())
        meta = step.metadata
        metadata = AttentionMetadata(meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc)
        return KVFuseStep(metadata=metadata, gather=gather.to(self.device), scatter=scatter.to(self.device),
                          identity=identity, kv_caches=self.manager.kv_caches, cache_index=self.cache_index)


# ----------------------------------------------------------------------------- attention function


def _mismatch(layer: PagedAttention, what: str, got, planned) -> None:
    raise ValueError(f"layer {layer.layer_name!r}: the model passes {what}={got!r} but kvfuse planned {planned!r} "
                     f"from its config; call enable() again after changing the config")


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask=None, scaling: Optional[float] = None, dropout: float = 0.0,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      s_aux: Optional[torch.Tensor] = None, **kwargs):
    """transformers attention function ``"kvfuse"``: ``query [B, Hq, T, D]``, new ``key``/``value``
    ``[B, Hkv, T, D]`` -> ``([B, T, Hq, D], None)``, through the module's kvfuse layer."""
    layer = getattr(module, "kvfuse_attn", None)
    if not isinstance(layer, PagedAttention):
        raise ValueError(f"{type(module).__name__} (layer_idx={getattr(module, 'layer_idx', None)}) has no kvfuse "
                         f"layer: call kvfuse.integrations.transformers.enable(model, ...)")
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, KVFuseStep):
        raise ValueError(f"layer {layer.layer_name!r}: no {STEP_KWARG!r} metadata reached the attention; call the "
                         f"enabled model itself (its pre-forward hook prepares each step), not a submodule")
    if dropout:
        raise ValueError(f"layer {layer.layer_name!r}: dropout={dropout!r}; kvfuse attention is inference-only "
                         f"(call model.eval())")
    if scaling is not None and not math.isclose(scaling, layer.sm_scale, rel_tol=1e-6):
        _mismatch(layer, "scaling", scaling, layer.sm_scale)
    if (sliding_window or None) != layer.sliding_window:
        _mismatch(layer, "sliding_window", sliding_window, layer.sliding_window)
    if float(softcap or 0.0) != layer.logit_softcap:
        _mismatch(layer, "softcap", softcap, layer.logit_softcap)
    batch, num_heads, num_new, head_dim = query.shape
    q = query.transpose(1, 2).reshape(batch * num_new, num_heads, head_dim)
    k = key.transpose(1, 2).reshape(batch * num_new, key.shape[1], head_dim)
    v = value.transpose(1, 2).reshape(batch * num_new, value.shape[1], head_dim)
    if not step.identity:
        q, k, v = q.index_select(0, step.gather), k.index_select(0, step.gather), v.index_select(0, step.gather)
    sinks = s_aux.float() if s_aux is not None else None
    kv_cache = step.kv_caches[step.cache_index[module.layer_idx]]
    out = layer(q, k, v, kv_cache, step.metadata, sinks=sinks)
    if not step.identity:
        out = out.index_select(0, step.scatter)
    return out.view(batch, num_new, num_heads, head_dim), None


# ----------------------------------------------------------------------------- tensor parallelism


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter (transformers' tensor parallelism), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and hasattr(t, "device_mesh") else t


def _tp_submesh(mesh, where: str):
    """The tensor-parallel dimension of a device mesh: a 1-D mesh, or the dimension named ``tp``."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "tp" in names:
        return mesh["tp"] if mesh.ndim > 1 else mesh
    if mesh.ndim == 1:
        return mesh
    raise ValueError(f"{where} is a {mesh.ndim}-D device mesh {names or ''} without a 'tp' dimension; kvfuse "
                     f"cannot tell which dimension splits the attention heads")


def model_tensor_parallel(model: nn.Module):
    """``(TensorParallel, process_group)`` of a model transformers sharded by tensor parallelism,
    or None for an unsharded model.

    The layout is read from the device mesh of the attention modules' DTensor parameters (what
    the sharded projections compute with), else from ``model._device_mesh``, which
    ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))`` (or ``tp_plan="auto"``)
    sets. ``process_group`` is that mesh's group: pass it to
    :func:`kvfuse.distributed.gather_reports` to collect every rank's fusion report.
    """
    from ..distributed import TensorParallel

    mesh, where = None, None
    for name, module in _attention_modules(model):
        for pname, param in module.named_parameters():
            if hasattr(param, "device_mesh") and hasattr(param, "placements"):
                mesh, where = param.device_mesh, f"the device mesh of {name}.{pname}"
                break
        if mesh is not None:
            break
    if mesh is None and getattr(model, "_device_mesh", None) is not None:
        mesh, where = model._device_mesh, "model._device_mesh"
    if mesh is None:
        return None
    mesh = _tp_submesh(mesh, where)
    if mesh.size() == 1:
        return None
    tp = TensorParallel(tp_size=mesh.size(), rank=mesh.get_local_rank())
    declared = getattr(model, "_tp_size", None)
    if isinstance(declared, int) and declared > 1 and declared != tp.tp_size:
        raise ValueError(f"{type(model).__name__}.tp_size={declared} but {where} spans {tp.tp_size} ranks")
    return tp, mesh.get_group()


def _tensor_parallel_config(model: nn.Module, config: KVCacheConfig, num_kv_heads: int) -> KVCacheConfig:
    """``config`` with the model's tensor-parallel layout; refuses a layout that disagrees with it."""
    found = model_tensor_parallel(model)
    if found is None:
        # Unsharded, or sharded by hand: the per-layer projection check in enable() tells.
        return config
    tp, _ = found
    if num_kv_heads % tp.tp_size:
        raise ValueError(
            f"{type(model).__name__} is sharded over tp_size={tp.tp_size} ranks but has num_key_value_heads="
            f"{num_kv_heads}: transformers' colwise k_proj/v_proj split their rows evenly, which cuts KV heads "
            f"apart; kvfuse needs tp_size to divide num_key_value_heads under transformers' tensor parallelism")
    if (config.tp_size, config.tp_rank) == (1, 0):
        logger.info("kvfuse: model is tensor-parallel, rank %d of %d: each layer's cache holds this rank's "
                    "%d of %d KV heads", tp.rank, tp.tp_size, num_kv_heads // tp.tp_size, num_kv_heads)
        return dataclasses.replace(config, tp_size=tp.tp_size, tp_rank=tp.rank)
    if (config.tp_size, config.tp_rank) != (tp.tp_size, tp.rank):
        raise ValueError(
            f"config has tp_size={config.tp_size}, tp_rank={config.tp_rank} but the model is sharded by "
            f"transformers' tensor parallelism as rank {tp.rank} of {tp.tp_size}; pass KVCacheConfig(..., "
            f"tp_size={tp.tp_size}, tp_rank={tp.rank}) or leave tp_size/tp_rank at their defaults to take the "
            f"model's layout")
    return config


def _check_local_projections(module: nn.Module, layer: PagedAttention) -> None:
    """Under tensor parallelism: this rank's k_proj/v_proj produce exactly the layer's local KV heads."""
    for proj in ("k_proj", "v_proj"):
        weight = getattr(getattr(module, proj, None), "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        rows = _local_tensor(weight).shape[0]
        want = layer.num_kv_heads * layer.head_size
        if rows != want:
            raise ValueError(
                f"layer {layer.layer_name!r}: this rank's {proj} produces {rows} features but kvfuse's plan for "
                f"tp_size={layer.config.tp_size}, tp_rank={layer.config.tp_rank} holds {layer.num_kv_heads} of "
                f"{layer.total_num_kv_heads} KV heads x head_dim {layer.head_size} = {want}; the model and the "
                f"KVCacheConfig disagree on the tensor-parallel layout")


# ----------------------------------------------------------------------------- enable


def _forward_params(model: nn.Module) -> list:
    return [p.name for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _cache_kwarg(model: nn.Module) -> str:
    """The model's forward keyword for its cache: ``cache`` from transformers 5.24 on (which maps
    the deprecated ``past_key_values`` onto it), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _make_pre_hook(model: nn.Module, block_size: int):
    names = _forward_params(model)
    key = _cache_kwarg(model)

    @torch.compiler.disable
    def pre_forward(module, args, kwargs):
        if kwargs.get(STEP_KWARG) is not None:
            return None  # the caller prepared the step (e.g. around a compiled module)
        kwargs = dict(kwargs)
        for name, value in zip(names, args):
            kwargs[name] = value
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            raise ValueError("kvfuse: the forward call has neither input_ids nor inputs_embeds")
        batch, num_new = tokens.shape[0], tokens.shape[1]
        given, cache = key, kwargs.get(key)
        # The deprecated name, from a caller written for transformers before 5.24: taken off, so
        # that the model sees the cache once, under its own name.
        legacy = kwargs.pop("past_key_values", None) if key != "past_key_values" else None
        if legacy is not None:
            if cache is not None:
                raise ValueError(f"both cache={type(cache).__name__} and past_key_values={type(legacy).__name__} "
                                 f"were given; pass the cache once, as cache")
            given, cache = "past_key_values", legacy
        if cache is None or (type(cache) is DynamicCache and cache.get_seq_length() == 0):
            # No cache, or the empty one generate() made: the sequences start here, on kvfuse pages.
            cache = KVFuseCache(module, block_size=block_size, device=tokens.device)
        elif not isinstance(cache, KVFuseCache):
            raise ValueError(f"{given} is a {type(cache).__name__} holding {cache.get_seq_length()} "
                             f"positions; a kvfuse-enabled model needs a KVFuseCache (or None)")
        kwargs[key] = cache
        kwargs[STEP_KWARG] = cache.prepare_step(kwargs.get("attention_mask"), batch, num_new)
        return (), kwargs

    return pre_forward


@torch.compiler.disable
def _post_forward(module, args, kwargs, output):
    for key in ("cache", "past_key_values"):  # the pre-hook put it under the model's own name
        if isinstance(kwargs.get(key), KVFuseCache):
            kwargs[key].end_step()
            return


def enable(model: nn.Module, config: Optional[KVCacheConfig] = None, *, block_size: int = _DEFAULT_BLOCK_SIZE,
           load_scales: bool = True, kv_scales: Optional[Mapping[str, Any]] = None) -> nn.Module:
    """Run ``model`` (a transformers decoder-only model) on kvfuse paged caches; returns ``model``.

    ``config``: the user's :class:`kvfuse.KVCacheConfig` (default ``auto``: the model dtype).
    ``block_size``: tokens per page of the caches the model creates. ``load_scales``: read
    checkpoint K/V scales (``kv_scales``: a name -> value mapping to read instead). Calling it
    again replaces the previous layers. See the module docstring for what changes.
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"model={type(model).__name__} must be a transformers PreTrainedModel")
    if config is None:
        config = KVCacheConfig()
    if not isinstance(config, KVCacheConfig):
        raise ValueError(f"config={config!r} must be a kvfuse.KVCacheConfig")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    text_config = _text_config(model)
    declared = checkpoint_kv_cache_dtype(model.config) or checkpoint_kv_cache_dtype(text_config)
    if declared is not None:
        if config.checkpoint_kv_cache_dtype is None:
            config = dataclasses.replace(config, checkpoint_kv_cache_dtype=declared)
        elif parse_kv_cache_dtype(config.checkpoint_kv_cache_dtype) is not parse_kv_cache_dtype(declared):
            logger.warning("config.checkpoint_kv_cache_dtype=%r differs from the checkpoint's declared %r; "
                           "using %r", config.checkpoint_kv_cache_dtype, declared, config.checkpoint_kv_cache_dtype)
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    config = _tensor_parallel_config(model, config, num_kv_heads)
    for name, module in _attention_modules(model):
        weight = next(module.parameters(), None)
        model_dtype = weight.dtype if weight is not None else model.dtype
        layer = PagedAttention(
            num_heads, num_kv_heads, int(module.head_dim), layer_name=f"{name}.attn", config=config,
            model_dtype=model_dtype, sliding_window=_layer_sliding_window(module, text_config),
            layer_index=module.layer_idx, sm_scale=float(module.scaling), logit_softcap=_layer_softcap(module, text_config),
        )
        if weight is not None:
            layer.to(weight.device)
        if config.tp_size > 1:
            _check_local_projections(module, layer)
        module.kvfuse_attn = layer
    # Every layer is known now: a skip rule that matches none of them is a mistake worth saying.
    config.check_skip_rules([layer.spec for layer in kvfuse_layers(model)])
    if load_scales:
        load_kv_scales(model, kv_scales, declared=config.checkpoint_kv_cache_dtype)
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for old in getattr(model, _HOOK_ATTR, ()):
        old.remove()
    handles = (model.register_forward_pre_hook(_make_pre_hook(model, block_size), with_kwargs=True),
               model.register_forward_hook(_post_forward, with_kwargs=True))
    object.__setattr__(model, _HOOK_ATTR, handles)
    for layer in kvfuse_layers(model):
        logger.info("kvfuse layer %s: %s (%s)", layer.layer_name, layer.spec.kv_format.name, layer.spec.reason)
    return model
