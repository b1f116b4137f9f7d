"""Bad inputs across the public API and every op: each is refused loudly, and nothing is written.

Each row of ``BAD_INPUTS`` is one distinct mistake a user can make. The test calls it, expects
the documented exception type with a message naming the argument and the value seen, and then
checks that every cache the call could have touched is byte-for-byte what it was.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import kvfuse
from kvfuse import KVCacheConfig, KVQuantMode
from kvfuse.ops import checks

E4M3 = int(KVQuantMode.FP8_E4M3)
NVFP4 = int(KVQuantMode.NVFP4)
NONE = int(KVQuantMode.NONE)
T, H, D, NUM_BLOCKS, BLOCK = 7, 2, 64, 4, 16


class Ctx:
    """Fresh, valid inputs; each bad case breaks exactly one thing."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.key = torch.randn(T, H, D, generator=g, dtype=torch.float32).bfloat16()
        self.value = torch.randn(T, H, D, generator=g, dtype=torch.float32).bfloat16()
        self.slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:T]
        self.scale = torch.tensor(1.0)
        spec = KVCacheConfig("fp8").layer_spec("model.layers.0.attn", H, D)
        # Sentinel bytes (not zeros) so that a partial write is visible.
        self.fp8_cache = kvfuse.allocate_kv_cache(spec, NUM_BLOCKS, BLOCK)
        self.fp8_cache.view(torch.uint8).fill_(0x5A)
        nvspec = KVCacheConfig("nvfp4").layer_spec("model.layers.0.attn", H, D)
        self.nvfp4_cache = kvfuse.allocate_kv_cache(nvspec, NUM_BLOCKS, BLOCK).fill_(0xA5)
        bspec = KVCacheConfig().layer_spec("model.layers.0.attn", H, D)
        self.bf16_cache = kvfuse.allocate_kv_cache(bspec, NUM_BLOCKS, BLOCK).fill_(3.0)
        self.query = torch.randn(T, 2 * H, D, generator=g).bfloat16()
        self.block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        self.seq_lens = torch.tensor([4, 9], dtype=torch.int32)
        self.qsl = torch.tensor([0, 3, 7], dtype=torch.int32)

    def caches(self) -> list[torch.Tensor]:
        return [self.fp8_cache, self.nvfp4_cache, self.bf16_cache]

    def write(self, **overrides):
        args = dict(key=self.key, value=self.value, kv_cache=self.fp8_cache, slot_mapping=self.slots,
                    k_scale=self.scale, v_scale=self.scale, kv_quant_mode=E4M3, layer_name="model.layers.0.attn")
        args.update(overrides)
        return torch.ops.kvfuse.encode_and_cache_write(**args)

    def attend(self, **overrides):
        args = dict(query=self.query, kv_cache=self.fp8_cache, k_scale=self.scale, v_scale=self.scale,
                    block_table=self.block_table, seq_lens=self.seq_lens, query_start_loc=self.qsl,
                    kv_quant_mode=E4M3, sm_scale=D ** -0.5, sliding_window=None, layer_name="model.layers.0.attn")
        args.update(overrides)
        return torch.ops.kvfuse.paged_attention(**args)


@dataclass(frozen=True)
class Bad:
    name: str
    call: Callable[[Ctx], object]
    pattern: str  # must appear in the message (regex): the argument and the value seen
    exc: type = ValueError
    checked: bool = False


def _spec(**kw):
    args = dict(layer_name="model.layers.1.attn", num_kv_heads=8, head_size=128, model_dtype=torch.bfloat16)
    args.update(kw)
    cfg = args.pop("cfg", KVCacheConfig())
    return cfg.layer_spec(**args)


BAD_INPUTS = [
    # --- dtype names and configuration (configuration time)
    Bad("unknown dtype name", lambda c: kvfuse.parse_kv_cache_dtype("int8"), r"'int8'.*'fp8_e4m3'"),
    Bad("misspelt fp8 name", lambda c: KVCacheConfig(kv_cache_dtype="fp8e4m3"), r"kv_cache_dtype='fp8e4m3'.*'nvfp4'"),
    Bad("torch-style alias", lambda c: kvfuse.parse_kv_cache_dtype("fp16"), r"'fp16'.*'float16'"),
    Bad("non-string dtype", lambda c: kvfuse.parse_kv_cache_dtype(None), r"None.*'auto'"),
    Bad("bad checkpoint dtype", lambda c: KVCacheConfig(checkpoint_kv_cache_dtype="fp4"),
        r"checkpoint_kv_cache_dtype='fp4'"),
    Bad("skip rule with a hyphen", lambda c: KVCacheConfig(skip_layers=("sliding-window",)),
        r"'sliding-window'.*did you mean 'sliding_window'"),
    Bad("skip rule that is no rule", lambda c: KVCacheConfig(skip_layers=("abc",)), r"'abc'.*layer index"),
    Bad("negative skip index", lambda c: KVCacheConfig(skip_layers=(-1,)), r"-1.*negative"),
    Bad("float skip index", lambda c: KVCacheConfig(skip_layers=(1.5,)), r"1\.5.*int or str"),
    Bad("NVFP4 head size not a multiple of 16", lambda c: _spec(cfg=KVCacheConfig("nvfp4"), head_size=72),
        r"head_size=72.*multiple of 16"),
    Bad("index rule on a layer without an index", lambda c: _spec(cfg=KVCacheConfig("fp8", skip_layers=(0,)),
                                                                 layer_name="decoder.attn"),
        r"'decoder.attn'.*index rule '0'.*layer_index="),
    Bad("integer model dtype", lambda c: _spec(model_dtype=torch.int8), r"model_dtype=torch.int8"),
    Bad("zero kv heads", lambda c: _spec(num_kv_heads=0), r"num_kv_heads=0"),
    Bad("zero sliding window", lambda c: _spec(sliding_window=0), r"sliding_window=0"),
    Bad("heads not a multiple of kv heads", lambda c: kvfuse.PagedAttention(6, 4, 64, "model.layers.0.attn"),
        r"num_kv_heads=4.*num_heads=6"),
    Bad("zero scale set on a layer", lambda c: kvfuse.PagedAttention(4, 2, 64, "model.layers.0.attn").set_scales(0.0, 1.0),
        r"k_scale=0\.0"),
    Bad("NaN scale set on a layer", lambda c: kvfuse.PagedAttention(4, 2, 64, "model.layers.0.attn").set_scales(1.0, math.nan),
        r"v_scale=nan"),
    Bad("zero blocks", lambda c: _spec().cache_shape(0, 16), r"num_blocks=0"),
    # --- caches that disagree with the op's mode (trace time: the same checks run in the fake)
    Bad("bf16 cache for an FP8 layer", lambda c: c.write(kv_cache=c.bf16_cache), r"kv_cache.dtype=torch.bfloat16.*FP8_E4M3"),
    Bad("NVFP4 cache whose rows fit another head size", lambda c: c.write(kv_cache=c.nvfp4_cache, kv_quant_mode=NVFP4,
                                                                         key=c.key[..., :32].contiguous(),
                                                                         value=c.value[..., :32].contiguous()),
        r"\(heads, row_dim\)=\(2, 36\).*\(2, 18\)"),
    Bad("unknown kv_quant_mode", lambda c: c.write(kv_quant_mode=7), r"kv_quant_mode=7"),
    Bad("4-D cache", lambda c: c.write(kv_cache=c.fp8_cache[:, 0]), r"kv_cache must be \(num_blocks, 2"),
    # --- K/V of the wrong rank, head count or dtype
    Bad("2-D key", lambda c: c.write(key=c.key[:, 0]), r"key must be \[num_tokens, num_heads, head_size\], got shape \(7, 64\)"),
    Bad("key with more heads than the cache", lambda c: c.write(key=c.key.repeat(1, 2, 1), value=c.value.repeat(1, 2, 1)),
        r"\(heads, row_dim\)=\(2, 64\).*\(4, 64\)"),
    Bad("integer key", lambda c: c.write(key=c.key.to(torch.int32), value=c.value.to(torch.int32)), r"key.dtype=torch.int32"),
    Bad("key and value dtypes differ", lambda c: c.write(value=c.value.half()), r"key \(torch.bfloat16.*value \(torch.float16"),
    Bad("key and value token counts differ", lambda c: c.write(value=c.value[:5]), r"key has 7 tokens but value has 5"),
    Bad("non-contiguous key", lambda c: c.write(key=c.key.transpose(1, 2).contiguous().transpose(1, 2)),
        r"key must have a contiguous last dim"),
    # --- scales that are not float32 scalars
    Bad("float64 scale", lambda c: c.write(k_scale=torch.tensor(1.0, dtype=torch.float64)), r"k_scale must be a float32.*float64"),
    Bad("per-head scale of another head count", lambda c: c.write(v_scale=torch.ones(H + 1)),
        r"v_scale must be a float32.*one per KV head \(shape \[2\]\).*shape \(3,\)"),
    Bad("per-head scale as a column", lambda c: c.write(k_scale=torch.ones(H, 1)), r"k_scale must be a float32.*shape \(2, 1\)"),
    Bad("per-head scale in attention", lambda c: c.attend(v_scale=torch.ones(H + 1)), r"v_scale .*shape \(3,\)"),
    Bad("zero in a per-head scale", lambda c: c.write(k_scale=torch.tensor([1.0, 0.0])), r"k_scale\[1\]=0\.0",
        checked=True),
    # --- slot mapping
    Bad("float slot mapping", lambda c: c.write(slot_mapping=c.slots.float()), r"slot_mapping must be 1-D int32 or int64.*float32"),
    Bad("short slot mapping", lambda c: c.write(slot_mapping=c.slots[:5]), r"slot_mapping has 5 entries but there are 7 tokens"),
    Bad("2-D slot mapping", lambda c: c.write(slot_mapping=c.slots.reshape(7, 1)), r"slot_mapping must be 1-D.*\(7, 1\)"),
    Bad("slot mapping on another device", lambda c: c.write(slot_mapping=c.slots.to("meta")),
        r"one device.*slot_mapping on meta"),
    # --- unfused pair: rows that do not fit the cache
    Bad("bf16 rows into an FP8 cache", lambda c: torch.ops.kvfuse.cache_write(c.key, c.value, c.fp8_cache, c.slots, E4M3, "l"),
        r"key_rows.dtype=torch.bfloat16 differs from kv_cache.dtype=torch.float8_e4m3fn"),
    Bad("rows of another row_dim", lambda c: torch.ops.kvfuse.cache_write(
        c.key[..., :32].to(torch.float8_e4m3fn), c.value[..., :32].to(torch.float8_e4m3fn), c.fp8_cache, c.slots, E4M3, "l"),
        r"key_rows rows are \(2, 32\).*\(2, 64\)"),
    Bad("encode into a dtype the mode cannot use", lambda c: torch.ops.kvfuse.encode_kv(c.key, c.scale, E4M3, torch.bfloat16, "l"),
        r"cache_dtype=torch.bfloat16 cannot hold kv_quant_mode=FP8_E4M3"),
    # --- attention metadata
    Bad("int64 block table", lambda c: c.attend(block_table=c.block_table.long()), r"block_table must be .*int32.*int64"),
    Bad("seq_lens of another batch", lambda c: c.attend(seq_lens=c.seq_lens[:1]), r"seq_lens has 1 sequences but block_table has 2"),
    Bad("query_start_loc of another batch", lambda c: c.attend(query_start_loc=c.qsl[:2]), r"query_start_loc has 2 entries"),
    Bad("query heads not a multiple", lambda c: c.attend(query=c.query[:, :3].contiguous()), r"3 heads.*2 KV heads"),
    Bad("zero softmax scale", lambda c: c.attend(sm_scale=0.0), r"sm_scale=0\.0"),
    Bad("zero sliding window in the op", lambda c: c.attend(sliding_window=0), r"sliding_window=0"),
    # --- checked mode: what only the data can tell
    Bad("slot past the cache", lambda c: c.write(slot_mapping=torch.tensor([0, 1, 2, 3, 4, 5, 64])),
        r"slot_mapping\[6\]=64 is out of range.*64", checked=True),
    Bad("slot below -1", lambda c: c.write(slot_mapping=torch.tensor([0, 1, 2, 3, 4, 5, -2])),
        r"slot_mapping\[6\]=-2", checked=True),
    Bad("slot written twice", lambda c: c.write(slot_mapping=torch.tensor([0, 1, 2, 3, 4, 5, 5])),
        r"writes slot 5 2 times", checked=True),
    Bad("NaN scale reaching the op", lambda c: c.write(k_scale=torch.tensor(math.nan)), r"k_scale=nan", checked=True),
    Bad("negative scale reaching the op", lambda c: c.write(v_scale=torch.tensor(-2.0)), r"v_scale=-2\.0", checked=True),
    Bad("infinite scale in attention", lambda c: c.attend(k_scale=torch.tensor(math.inf)), r"k_scale=inf", checked=True),
    Bad("decreasing query_start_loc", lambda c: c.attend(query_start_loc=torch.tensor([0, 5, 3], dtype=torch.int32)),
        r"decreases at sequence 1", checked=True),
    Bad("seq_len shorter than its new tokens", lambda c: c.attend(seq_lens=torch.tensor([2, 9], dtype=torch.int32)),
        r"seq_lens\[0\]=2 is smaller than its 3 new tokens", checked=True),
    Bad("page id outside the cache", lambda c: c.attend(block_table=torch.tensor([[0, 1], [2, 9]], dtype=torch.int32),
                                                             seq_lens=torch.tensor([4, 20], dtype=torch.int32)),
        r"block_table\[1, 1\]=9", checked=True),
    Bad("sequence longer than its pages", lambda c: c.attend(seq_lens=torch.tensor([4, 40], dtype=torch.int32)),
        r"seq_lens\[1\]=40 needs more pages", checked=True),
]


def test_table_has_at_least_30_distinct_cases():
    assert len(BAD_INPUTS) >= 30
    assert len({b.name for b in BAD_INPUTS}) == len(BAD_INPUTS)


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=[b.name for b in BAD_INPUTS])
def test_bad_input_is_refused_and_nothing_is_written(bad: Bad):
    ctx = Ctx()
    before = [c.clone() for c in ctx.caches()]
    with checks.checked(bad.checked), pytest.raises(bad.exc) as info:
        bad.call(ctx)
    assert re.search(bad.pattern, str(info.value), re.S), str(info.value)
    for cache, snapshot in zip(ctx.caches(), before):
        assert torch.equal(cache.view(torch.uint8), snapshot.view(torch.uint8))


def test_checked_cases_pass_silently_without_checked_mode_where_defined():
    """A duplicate slot is only detected in checked mode; without it the call completes."""
    ctx = Ctx()
    with checks.checked(False):
        ctx.write(slot_mapping=torch.tensor([0, 1, 2, 3, 4, 5, 5]))


def test_checked_mode_env_variable(monkeypatch):
    ctx = Ctx()
    monkeypatch.setenv("KVFUSE_CHECK", "1")
    kvfuse.envs.reload()
    with pytest.raises(ValueError, match="checked mode"):
        ctx.write(slot_mapping=torch.tensor([0, 1, 2, 3, 4, 5, 99]))
    monkeypatch.setenv("KVFUSE_CHECK", "0")
    kvfuse.envs.reload()
    assert not checks.enabled()


def test_bad_input_fails_at_trace_time_under_compile():
    """Shape/dtype mistakes surface while tracing, before any compiled kernel runs."""
    ctx = Ctx()
    before = ctx.bf16_cache.clone()

    def step(key, value, cache, slots, scale):
        torch.ops.kvfuse.encode_and_cache_write(key, value, cache, slots, scale, scale, E4M3, "model.layers.0.attn")

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled(ctx.key, ctx.value, ctx.bf16_cache, ctx.slots, ctx.scale)
    assert "kv_cache.dtype=torch.bfloat16" in str(info.value)
    assert torch.equal(ctx.bf16_cache, before)
