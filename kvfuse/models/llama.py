"""A small Llama-style decoder whose attention layers are :class:`kvfuse.PagedAttention`.

RMSNorm, rotary position embeddings (positions come in as a tensor, so padded and
ragged batches need no special casing), grouped-query attention over each layer's own
paged cache, and a SwiGLU MLP. Weights are random, drawn from a seeded generator on the
CPU so two models built from the same config are bit-identical whatever the device: the
demo relies on that to compare cache formats on the same network.

Tensor parallelism (``tp_group=`` / ``tensor_parallel=``): every rank first draws the full
weights from the same seed, then keeps its shard (QKV and MLP gate/up column-parallel, the
attention output and MLP down row-parallel with an all-reduce; embedding, norms and lm_head
replicated), so a model split over any number of ranks computes what the unsplit one does,
up to the order of the all-reduce's float additions.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from ..distributed import ColumnParallelLinear, RowParallelLinear, TensorParallel, shard_rows
from ..kv_cache import KVCacheConfig, KVCacheSpec
from ..layers import AttentionMetadata, PagedAttention

logger = logging.getLogger(__name__)

__all__ = ["LlamaConfig", "LlamaForCausalLM", "RMSNorm", "apply_rotary"]

LAYER_NAME_FORMAT = "model.layers.{}.self_attn.attn"


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"LlamaConfig: {name}={value!r} must be a positive int")


@dataclass(frozen=True)
class LlamaConfig:
    """Size of the demo model. ``sliding_window_layers`` use a window of ``sliding_window`` tokens."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    intermediate_size: int = 512
    vocab_size: int = 1024
    sliding_window: int = 8
    sliding_window_layers: tuple = ()
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_size",
                     "intermediate_size", "vocab_size", "sliding_window"):
            _positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_size % 2:
            raise ValueError(f"LlamaConfig: head_size={self.head_size} must be even (rotary embeddings rotate pairs)")
        layers = tuple(self.sliding_window_layers)
        bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"LlamaConfig: sliding_window_layers={layers!r} holds {bad!r}; allowed: layer indices "
                f"0..{self.num_layers - 1}"
            )
        object.__setattr__(self, "sliding_window_layers", tuple(sorted(set(layers))))

    def check_tensor_parallel(self, tp: TensorParallel) -> None:
        """Raise ``ValueError`` unless this model splits evenly over ``tp.tp_size`` ranks."""
        for name in ("num_heads", "intermediate_size"):
            value = getattr(self, name)
            if value % tp.tp_size:
                raise ValueError(f"LlamaConfig: {name}={value} is not divisible by tp_size={tp.tp_size}")
        tp.kv_heads(self.num_kv_heads)  # raises when neither of num_kv_heads, tp_size divides the other

    def layer_name(self, index: int) -> str:
        return LAYER_NAME_FORMAT.format(index)

    def layer_sliding_window(self, index: int) -> Optional[int]:
        return self.sliding_window if index in self.sliding_window_layers else None

    def layer_specs(self, kv_config: Optional[KVCacheConfig] = None) -> list[KVCacheSpec]:
        """Each layer's cache spec under ``kv_config``, without building the model."""
        kv_config = kv_config if kv_config is not None else KVCacheConfig()
        return [
            kv_config.layer_spec(self.layer_name(i), num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                                 model_dtype=self.dtype, sliding_window=self.layer_sliding_window(i),
                                 layer_index=i)
            for i in range(self.num_layers)
        ]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by ``positions [T]`` (NeoX layout: pairs are (i, i + D/2)), in float32."""
    angles = positions.float().unsqueeze(-1) * inv_freq  # [T, D/2]
    cos = angles.cos().unsqueeze(1)
    sin = angles.sin().unsqueeze(1)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    """This rank's query heads and the KV heads they read; ``num_heads``/``num_kv_heads`` are local."""

    def __init__(self, config: LlamaConfig, index: int, kv_config: KVCacheConfig, tp: TensorParallel,
                 tp_group=None) -> None:
        super().__init__()
        heads = tp.split(config.num_heads, "num_heads")
        kv_heads = tp.kv_heads(config.num_kv_heads)
        d, h, kv = config.head_size, config.num_heads, config.num_kv_heads
        self.num_heads = len(heads)
        self.num_kv_heads = len(kv_heads)
        self.head_size = d
        # Rows of the full fused weight [q heads | k heads | v heads] that this rank computes.
        kv_rows = shard_rows(kv_heads, d)
        rows = torch.cat([shard_rows(heads, d), h * d + kv_rows, (h + kv) * d + kv_rows])
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, (h + 2 * kv) * d, rows)
        self.o_proj = RowParallelLinear(h * d, config.hidden_size, range(heads.start * d, heads.stop * d), tp, tp_group)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_size, 2, dtype=torch.float32)
                                                / config.head_size))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # PagedAttention takes the model's head counts; kv_config's tp_size/tp_rank make its
        # spec (and so its cache) hold this rank's KV heads.
        self.attn = PagedAttention(
            config.num_heads, config.num_kv_heads, config.head_size, config.layer_name(index), config=kv_config,
            model_dtype=config.dtype, sliding_window=config.layer_sliding_window(index), layer_index=index,
        )

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary(q.reshape(t, self.num_heads, self.head_size), positions, self.inv_freq)
        k = apply_rotary(k.reshape(t, self.num_kv_heads, self.head_size), positions, self.inv_freq)
        v = v.reshape(t, self.num_kv_heads, self.head_size).contiguous()
        out = self.attn(q, k, v, kv_cache, metadata)
        return self.o_proj(out.reshape(t, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallel, tp_group=None) -> None:
        super().__init__()
        features = tp.split(config.intermediate_size, "intermediate_size")
        size = config.intermediate_size
        rows = torch.cat([shard_rows(features), size + shard_rows(features)])  # [gate | up]
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * size, rows)
        self.down_proj = RowParallelLinear(size, config.hidden_size, features, tp, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, index: int, kv_config: KVCacheConfig, tp: TensorParallel,
                 tp_group=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, index, kv_config, tp, tp_group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp, tp_group)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, kv_config: KVCacheConfig, tp: TensorParallel, tp_group=None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, kv_config, tp, tp_group)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, positions, kv_cache, metadata)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], kv_caches, metadata) -> float32 logits [T, vocab]``.

    ``kv_caches[i]`` is layer i's cache, allocated from ``model.kv_specs[i]`` (see
    :class:`kvfuse.models.PagedCacheManager`). Padding rows (slot -1, outside
    ``query_start_loc``) produce logits that carry no meaning and write nothing.

    Tensor parallel: ``tp_group`` (a process group, e.g. ``torch.distributed.group.WORLD``)
    makes this the shard of rank ``get_rank(tp_group)``; ``tensor_parallel`` alone builds a
    shard that cannot run a forward with ``tp_size > 1`` (for inspecting weights and specs).
    ``kv_config`` may leave ``tp_size`` at 1 (it is set to the model's layout) or state the
    same layout. Every rank must feed the same inputs and run its own cache manager through
    the same steps, so that page ids agree across ranks; each rank's ``kv_specs`` (and
    caches) hold only its KV heads. The logits are complete on every rank.
    """

    def __init__(self, config: LlamaConfig, kv_config: Optional[KVCacheConfig] = None,
                 device: torch.device | str | None = None, *, tp_group=None,
                 tensor_parallel: Optional[TensorParallel] = None) -> None:
        super().__init__()
        kv_config = kv_config if kv_config is not None else KVCacheConfig()
        tp = tensor_parallel
        if tp_group is not None:
            from_group = TensorParallel.from_group(tp_group)
            if tp is not None and tp != from_group:
                raise ValueError(f"tensor_parallel={tp} disagrees with tp_group, which is {from_group}")
            tp = from_group
        tp = tp if tp is not None else TensorParallel()
        config.check_tensor_parallel(tp)
        if (kv_config.tp_size, kv_config.tp_rank) == (1, 0):
            kv_config = dataclasses.replace(kv_config, tp_size=tp.tp_size, tp_rank=tp.rank)
        elif (kv_config.tp_size, kv_config.tp_rank) != (tp.tp_size, tp.rank):
            raise ValueError(f"kv_config has tp_size={kv_config.tp_size}, tp_rank={kv_config.tp_rank} but the model "
                             f"is built as rank {tp.rank} of {tp.tp_size}")
        self.config = config
        self.kv_config = kv_config
        self.tensor_parallel = tp
        self.model = LlamaModel(config, kv_config, tp, tp_group)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights()
        # Only parameters take the model dtype: the cache scales must stay float32 (the ops require
        # it) and the rotary frequencies are more accurate in float32.
        for param in self.parameters():
            param.data = param.data.to(config.dtype)
        self.to(device=device)
        logger.debug("built %s", config)

    @torch.no_grad()
    def _init_weights(self) -> None:
        gen = torch.Generator().manual_seed(self.config.seed)
        # A shard draws the full weight (same generator sequence on every rank and at any
        # tp_size) and keeps its piece, so all layouts share one set of weights.
        sharded = {f"{name}.weight": m for name, m in self.named_modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                continue  # RMSNorm gains stay 1
            shape = sharded[name].full_shape if name in sharded else tuple(param.shape)
            if len(shape) == 2 and "embed_tokens" not in name:
                std = 1.0 / math.sqrt(shape[1])
            else:
                std = 1.0
            full = torch.randn(shape, generator=gen, dtype=torch.float32) * std
            if name in sharded:
                sharded[name].load_full_weight(full)
            else:
                param.copy_(full)

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @property
    def kv_specs(self) -> list[KVCacheSpec]:
        return [attn.spec for attn in self.attention_layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(
                f"kv_caches has {len(kv_caches)} caches but the model has {self.config.num_layers} layers"
            )
        return self.lm_head(self.model(input_ids, positions, kv_caches, metadata)).float()
