"""``PagedAttention``: one attention layer over its own paged KV cache, and its metadata."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from . import ops
from .kv_cache import KVCacheConfig, KVCacheSpec, KVQuantMode

logger = logging.getLogger(__name__)

__all__ = ["AttentionMetadata", "PagedAttention", "check_skip_rules"]


@dataclass
class AttentionMetadata:
    """Where a batch's tokens go and what they attend to.

    - ``slot_mapping`` [T] int64 (or int32): cache slot of each new token; -1 = padding, never written;
    - ``block_table`` [B, max_blocks] int32: page ids of each sequence, in order;
    - ``seq_lens`` [B] int32: context length of each sequence, new tokens included;
    - ``query_start_loc`` [B+1] int32: new tokens of sequence b are rows ``qsl[b]:qsl[b+1]``;
    - ``max_seq_len`` / ``max_query_len``: optional host-side bounds (planning hints for
      backends that want them; never required for correctness).
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: Optional[int] = None
    max_query_len: Optional[int] = None


class PagedAttention(nn.Module):
    """Writes a step's K/V into this layer's cache, then attends over it.

    The cache format comes from ``config.layer_spec(layer_name, ...)``, so each layer of a model
    may differ (FP8 layers beside bf16 skip layers). In eager mode the write is the fused
    ``kvfuse::encode_and_cache_write``; under ``torch.compile`` the layer emits the unfused
    ``encode_kv`` + ``cache_write`` pair, which kvfuse's Inductor pass fuses (and reports).

    ``num_heads`` / ``num_kv_heads`` are the model's counts. Under tensor parallelism
    (``config.tp_size > 1``) the layer's ``num_heads`` / ``num_kv_heads`` attributes are this
    rank's share (``num_heads / tp_size`` query heads; the spec's KV heads, see
    :mod:`kvfuse.distributed`), and ``total_num_heads`` / ``total_num_kv_heads`` keep the
    model's counts.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        layer_name: str,
        config: Optional[KVCacheConfig] = None,
        model_dtype: Union[torch.dtype, str] = torch.bfloat16,
        sliding_window: Optional[int] = None,
        layer_index: Optional[int] = None,
        sm_scale: Optional[float] = None,
        logit_softcap: float = 0.0,
    ) -> None:
        super().__init__()
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"layer {layer_name!r}: num_heads={num_heads!r} must be a positive int")
        if not isinstance(num_kv_heads, int) or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"layer {layer_name!r}: num_kv_heads={num_kv_heads!r} must be a positive int dividing "
                f"num_heads={num_heads}"
            )
        if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float)) or not (
            math.isfinite(logit_softcap) and logit_softcap >= 0
        ):
            raise ValueError(f"layer {layer_name!r}: logit_softcap={logit_softcap!r} must be a finite float >= 0 "
                             f"(0.0: no soft-capping)")
        config = config if config is not None else KVCacheConfig()
        if not isinstance(config, KVCacheConfig):
            raise ValueError(f"layer {layer_name!r}: config is a {type(config).__name__}; expected a "
                             f"kvfuse.KVCacheConfig (or None for the model dtype)")
        self.config = config
        self.spec: KVCacheSpec = config.layer_spec(
            layer_name, num_kv_heads=num_kv_heads, head_size=head_size, model_dtype=model_dtype,
            sliding_window=sliding_window, layer_index=layer_index,
        )
        if num_heads % config.tp_size:
            raise ValueError(f"layer {layer_name!r}: num_heads={num_heads} is not divisible by "
                             f"tp_size={config.tp_size}; every rank must hold an equal share of the query heads")
        # Callers pass the model's head counts (the spec splits the KV heads itself); the attributes
        # describe what this rank's tensors hold, so that a query/cache shape check on the layer
        # never mixes the two. The totals stay available for reports.
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = num_heads // config.tp_size
        self.num_kv_heads = self.spec.num_kv_heads
        self.head_size = head_size
        self.layer_name = layer_name
        self.sliding_window = sliding_window
        self.sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_size)
        self.logit_softcap = float(logit_softcap)
        # One scale per tensor, or per KV head of this rank (spec.scale_shape), default 1.0.
        self.register_buffer("k_scale", torch.ones(self.spec.scale_shape, dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones(self.spec.scale_shape, dtype=torch.float32))

    def _apply(self, fn, *args, **kwargs):
        # Module.to(dtype) / .half() cast every floating buffer; the scales must stay float32
        # (the ops refuse anything else), whatever dtype the rest of the model moves to.
        super()._apply(fn, *args, **kwargs)
        for name in ("k_scale", "v_scale"):
            if getattr(self, name).dtype != torch.float32:
                setattr(self, name, getattr(self, name).float())
        return self

    @property
    def kv_quant_mode(self):
        """The K side's mode (both sides' unless ``spec.is_mixed``; ``spec.kv_format`` has both)."""
        return self.spec.kv_quant_mode

    def set_scales(self, k_scale, v_scale) -> None:
        """Set the FP8 scales / NVFP4 global scales (finite, > 0), e.g. from a checkpoint.

        Each is a number or a one-element tensor; a layer with per-KV-head scales also takes one
        value per KV head, of this rank or of the whole model (this rank's heads are kept), and
        gives a single number to every head (:meth:`KVCacheSpec.shard_scale`). An fp8_per_token_head
        layer keeps them but never reads them (its rows carry their own scales).
        """
        values = [(name, self.spec.shard_scale(value, name)) for name, value in (("k_scale", k_scale),
                                                                                   ("v_scale", v_scale))]
        for name, value in values:  # both checked before either is set
            getattr(self, name).copy_(value)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A checkpoint's scale may be per tensor while this layer's are per KV head (given to every
        # head), or hold every KV head of the model under tensor parallelism (this rank's are kept).
        for name in ("k_scale", "v_scale"):
            key = prefix + name
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(getattr(self, name).shape):
                state_dict[key] = self.spec.shard_scale(value, key, device=getattr(self, name).device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"{self.layer_name!r}, heads={self.num_heads}/{self.num_kv_heads}, head_size={self.head_size}, "
            f"kv_cache={self.spec.kv_format.name}/{self.spec.kv_cache_torch_dtype}"
            + (", scales=per KV head" if self.spec.scale_shape else "")
            + (f", sliding_window={self.sliding_window}" if self.sliding_window is not None else "")
            + (f", logit_softcap={self.logit_softcap}" if self.logit_softcap else "")
        )

    def _check_argument_types(self, query, key, value, kv_cache, metadata) -> None:
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"layer {self.layer_name!r}: {name} is a {type(x).__name__}; expected a "
                                 f"torch.Tensor [num_tokens, heads, head_size]")
        if not isinstance(kv_cache, torch.Tensor):
            hint = (" (pass this layer's own cache, e.g. kv_caches[i], not the list of every layer's caches)"
                    if isinstance(kv_cache, (list, tuple)) else "")
            raise ValueError(f"layer {self.layer_name!r}: kv_cache is a {type(kv_cache).__name__}; expected a "
                             f"torch.Tensor from kvfuse.allocate_kv_cache(layer.spec, ...){hint}")
        if not isinstance(metadata, AttentionMetadata):
            hint = (" (build it with kvfuse.AttentionMetadata(**your_dict))" if isinstance(metadata, dict) else "")
            raise ValueError(f"layer {self.layer_name!r}: metadata is a {type(metadata).__name__}; expected a "
                             f"kvfuse.AttentionMetadata(slot_mapping, block_table, seq_lens, query_start_loc){hint}")

    def _check_shapes(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """The layer's own contract, in the user's names: checked here, before any op is traced or
        run, so a mistake never surfaces as an op's internal argument (``key_rows``) inside a compile
        error, and a query in another dtype than K/V is refused rather than silently computed."""
        spec = self.spec
        for name, x, heads in (("query", query, self.num_heads), ("key", key, spec.num_kv_heads),
                               ("value", value, spec.num_kv_heads)):
            problem = _shape_problem(name, x, heads, spec.head_size, spec.model_dtype)
            if problem is not None:
                raise ValueError(f"layer {self.layer_name!r}: {problem}")
        same = key.shape[0] == value.shape[0]
        if torch.compiler.is_compiling():
            # Token counts may be symbolic (even unbacked): a recorded check, not a branch. Its
            # message function has no closure and no exception type: Dynamo before torch 2.13
            # traces neither and would break the graph at every layer.
            torch._check(same, lambda: "kvfuse layer: key and value must hold the same number of tokens")
        elif not same:
            raise ValueError(f"layer {self.layer_name!r}: key and value must hold the same number of tokens")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``sinks``: optional float32 ``[num_heads]`` per-head logits that join the softmax
        denominator only (gpt-oss); passed per call so the model keeps owning the parameter."""
        spec = self.spec
        self._check_argument_types(query, key, value, kv_cache, metadata)
        self._check_shapes(query, key, value)
        expected_shape = (spec.cache_shape(1, kv_cache.shape[2])[1:] if kv_cache.dim() == 5 and kv_cache.shape[2] > 0
                          else None)
        if kv_cache.dtype != spec.kv_cache_torch_dtype or tuple(kv_cache.shape[1:]) != expected_shape:
            needed = (f"(num_blocks, {', '.join(map(str, expected_shape))})" if expected_shape is not None else
                      f"(num_blocks, 2, block_size, {spec.num_kv_heads}, row_dim)")
            raise ValueError(
                f"layer {self.layer_name!r}: kv_cache is {kv_cache.dtype} {tuple(kv_cache.shape)} but this layer's "
                f"spec needs {spec.kv_cache_torch_dtype} {needed}; allocate it with "
                f"kvfuse.allocate_kv_cache(layer.spec, ...)"
            )
        fmt = spec.kv_format
        mode = fmt.code
        if torch.compiler.is_compiling():
            # The unfused form: kvfuse's Inductor pass fuses it per layer and reports what it did.
            # Each side is encoded in its own mode (they differ in mixed formats).
            key_rows = torch.ops.kvfuse.encode_kv(key, self.k_scale, int(fmt.key), spec.side_storage_dtype(0),
                                                  self.layer_name)
            value_rows = torch.ops.kvfuse.encode_kv(value, self.v_scale, int(fmt.value), spec.side_storage_dtype(1),
                                                    self.layer_name)
            torch.ops.kvfuse.cache_write(key_rows, value_rows, kv_cache, metadata.slot_mapping, mode,
                                         self.layer_name)
        else:
            torch.ops.kvfuse.encode_and_cache_write(key, value, kv_cache, metadata.slot_mapping, self.k_scale,
                                                    self.v_scale, mode, self.layer_name)
        # A cache that stores the model dtype holds exactly this step's key/value at the query
        # positions: prefill may read the new keys from them (kvfuse.ops.triton.prefill).
        step_kv = (spec.kv_quant_mode is KVQuantMode.NONE and spec.kv_cache_torch_dtype == key.dtype
                   and key.stride(-1) == 1 and value.stride(-1) == 1)
        return torch.ops.kvfuse.paged_attention(
            query, kv_cache, self.k_scale, self.v_scale, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, mode, self.sm_scale, self.sliding_window, self.layer_name,
            self.logit_softcap, sinks, key if step_kv else None, value if step_kv else None,
        )


def _shape_problem(name: str, x: torch.Tensor, heads: int, head_size: int, dtype: torch.dtype) -> Optional[str]:
    if x.dim() != 3 or x.shape[1] != heads or x.shape[2] != head_size:
        return f"{name} has shape {tuple(x.shape)}; this layer takes [num_tokens, {heads}, {head_size}]"
    if x.dtype != dtype:
        return (f"{name}.dtype={x.dtype}, but this layer's model dtype is {dtype} (convert the {name} explicitly, "
                f"or build the layer with model_dtype={dtype if x.dtype is None else x.dtype})")
    return None


def check_skip_rules(model: nn.Module, strict: Optional[bool] = None) -> tuple[str, ...]:
    """Check the skip rules of every :class:`KVCacheConfig` used by ``model``'s PagedAttention layers.

    Warns (or raises ValueError when ``strict`` / ``config.strict_skip_layers``) for each rule
    that matches none of the layers built from that config, and returns those rules. Call it
    once the model is built, when every layer is known.
    """
    by_config: dict = {}
    for module in model.modules():
        if isinstance(module, PagedAttention):
            by_config.setdefault(module.config, []).append(module.spec)
    unmatched: list = []
    for config, specs in by_config.items():
        unmatched.extend(config.check_skip_rules(specs, strict=strict))
    return tuple(unmatched)
