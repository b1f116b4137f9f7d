"""Every kvfuse ``torch.library`` op, declared in one module: schema, validation, fake, real body.

Ops (namespace ``kvfuse``)::

    encode_kv(Tensor x, Tensor scale, int kv_quant_mode, ScalarType cache_dtype, str layer_name) -> Tensor
    cache_write(Tensor key_rows, Tensor value_rows, Tensor(a!) kv_cache, Tensor slot_mapping,
                int kv_quant_mode, str layer_name) -> ()
    encode_and_cache_write(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping,
                           Tensor k_scale, Tensor v_scale, int kv_quant_mode, str layer_name) -> ()
    rope_encode_and_cache_write(Tensor? query, Tensor key, Tensor value, Tensor(a!) kv_cache,
                                Tensor slot_mapping, Tensor k_scale, Tensor v_scale, Tensor cos, Tensor sin,
                                Tensor? positions, int rotary_dim, bool is_neox, int kv_quant_mode,
                                str layer_name) -> Tensor
    paged_attention(Tensor query, Tensor kv_cache, Tensor k_scale, Tensor v_scale,
                    Tensor block_table, Tensor seq_lens, Tensor query_start_loc, int kv_quant_mode,
                    float sm_scale, int? sliding_window, str layer_name, float logit_softcap=0.0,
                    Tensor? sinks=None, Tensor? key=None, Tensor? value=None) -> Tensor

Every op carries the layer's ``kv_quant_mode`` (a :class:`kvfuse.KVQuantMode` value) and
``layer_name``; nothing here reads a global cache dtype. ``k_scale`` / ``v_scale`` (and
``encode_kv``'s ``scale``) keep their schema in every mode but are not read for
``FP8_PER_TOKEN_HEAD``, whose rows carry their own scale (checked mode does not check them there). One validator per op runs in the fake
(meta) implementation, at trace time, and in the real body before any kernel touches memory,
so a bad call fails before anything is written. The real body (registered for CPU and CUDA)
then asks :mod:`.registry` for the kernel of this (op, device, mode, size) and calls it.
The ops are inference-only: ``encode_kv`` and ``paged_attention`` also have an Autograd kernel
that runs them below autograd, so their outputs never claim a gradient.

The unfused graph is ``encode_kv`` (K) + ``encode_kv`` (V) + ``cache_write``; the fused
``encode_and_cache_write`` is defined to be exactly that composition, and
``rope_encode_and_cache_write`` exactly the rotary embedding of the key (and of the query, which
it returns) followed by ``encode_and_cache_write`` (:func:`kvfuse.ops.reference.apply_rope`).
"""

from __future__ import annotations

import math

import torch

from ..kv_cache import (
    NATIVE_CACHE_DTYPES,
    KVFormat,
    KVQuantMode,
    check_page_contiguous,
    head_size_of_row_dim,
    mixed_page_layout,
    row_dim_for,
    storage_dtype,
    storage_holds,
)
from . import checks, native, registry

__all__ = ["KVFUSE_LIB"]

KVFUSE_LIB = torch.library.Library("kvfuse", "DEF")

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)


def _fail(op: str, layer_name: str, message: str) -> None:
    raise ValueError(f"kvfuse::{op} (layer {layer_name!r}): {message}")


def _check(cond, op: str, layer_name: str, message) -> None:
    """Raise ValueError unless ``cond``; works on SymBools (records a guard, no specialisation)."""
    if cond is True:  # concrete sizes (eager): no guard machinery on the hot path
        return
    torch._check_with(ValueError, cond, lambda: f"kvfuse::{op} (layer {layer_name!r}): {message()}")


_MODES = {int(m): m for m in KVQuantMode}


def _mode(op: str, layer_name: str, kv_quant_mode: int) -> KVQuantMode:
    mode = _MODES.get(kv_quant_mode) if type(kv_quant_mode) is int else None
    if mode is None:
        _fail(op, layer_name, f"kv_quant_mode={kv_quant_mode!r} is not one of "
              f"{[f'{m.value} ({m.name})' for m in KVQuantMode]}")
    return mode


def _format(op: str, layer_name: str, kv_quant_mode: int):
    """The :class:`KVQuantMode` of a uniform format code, or the :class:`KVFormat` of a mixed one
    (K and V in different modes; :meth:`KVFormat.code`)."""
    try:
        return KVFormat.from_code(kv_quant_mode).narrowed
    except ValueError as e:
        _fail(op, layer_name, str(e))


def _check_mixed_cache(op: str, layer_name: str, kv_cache: torch.Tensor, fmt: KVFormat, head_size,
                       native_dtype: torch.dtype, native_source: str) -> None:
    """A mixed-format cache: uint8 pages laid out by :func:`kvfuse.kv_cache.mixed_page_layout`;
    an unquantized side holds ``native_dtype`` (the dtype of ``native_source``)."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        _fail(op, layer_name, f"kv_cache must be (num_blocks, 2, block_size, num_kv_heads, row_dim), "
              f"got shape {tuple(kv_cache.shape)}")
    if kv_cache.dtype != torch.uint8:
        _fail(op, layer_name, f"kv_cache.dtype={kv_cache.dtype}: a {fmt.name} (K/V) cache is uint8 pages "
              f"(allocate it from this layer's spec)")
    for side, mode in (("K", fmt.key), ("V", fmt.value)):
        try:
            row_dim_for(mode, head_size)
        except ValueError as e:
            _fail(op, layer_name, f"the {side} side ({mode.name}): {e}")
    if KVQuantMode.NONE in fmt.sides and native_dtype not in NATIVE_CACHE_DTYPES:
        _fail(op, layer_name, f"{native_source}.dtype={native_dtype}: the unquantized side of a {fmt.name} cache "
              f"holds one of {list(NATIVE_CACHE_DTYPES)}")
    layout = mixed_page_layout(fmt, kv_cache.shape[2], kv_cache.shape[3], head_size, native_dtype)
    if kv_cache.shape[4] != layout.row_dim:
        unquantized = (f" and an unquantized side of {native_source}'s dtype {native_dtype}"
                       if KVQuantMode.NONE in fmt.sides else "")
        _fail(op, layer_name, f"kv_cache row_dim={kv_cache.shape[4]} does not fit a {fmt.name} (K/V) page of "
              f"block_size {kv_cache.shape[2]}, {kv_cache.shape[3]} KV heads, head_size {head_size}{unquantized} "
              f"(expected {layout.row_dim})")
    problem = check_page_contiguous(kv_cache)
    if problem is not None:
        _fail(op, layer_name, f"{fmt.name} (K/V) kv_cache {tuple(kv_cache.shape)}: {problem}; allocate it with "
              f"kvfuse.allocate_kv_cache")
    # Rows of every side format hold 2- or 4-byte words (bf16 values, per-token-head float32 scales).
    if kv_cache.stride(0) % 4 or kv_cache.storage_offset() % 4:
        _fail(op, layer_name, f"{fmt.name} (K/V) kv_cache has page stride {kv_cache.stride(0)} and storage offset "
              f"{kv_cache.storage_offset()}; both must be multiples of 4 bytes, as kvfuse.allocate_kv_cache makes them")


def _check_devices(op: str, layer_name: str, **tensors: torch.Tensor) -> None:
    devices = [t.device for t in tensors.values()]
    first = devices[0]
    if any(d != first for d in devices):
        _fail(op, layer_name, f"all tensors must be on one device, got "
              f"{', '.join(f'{n} on {d}' for n, d in zip(tensors, devices))}")


def _check_scale(op: str, layer_name: str, name: str, scale: torch.Tensor, num_kv_heads) -> None:
    """One float32 scale per tensor (shape [] or [1]) or one per KV head (shape [num_kv_heads])."""
    per_tensor = scale.numel() == 1
    per_head = scale.dim() == 1 and scale.shape[0] == num_kv_heads
    if scale.dtype != torch.float32 or not (per_tensor or per_head):
        _fail(op, layer_name, f"{name} must be a float32 tensor with one element (shape [] or [1]) or one per "
              f"KV head (shape [{num_kv_heads}]), got dtype {scale.dtype} shape {tuple(scale.shape)}")


def per_head_scales(*scales: torch.Tensor) -> bool:
    """Whether any of the (validated) scales holds one value per KV head (more than one element)."""
    return any(s.numel() > 1 for s in scales)


def _check_kv_input(op: str, layer_name: str, name: str, x: torch.Tensor) -> None:
    if x.dim() != 3:
        _fail(op, layer_name, f"{name} must be [num_tokens, num_heads, head_size], got shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        _fail(op, layer_name, f"{name}.dtype={x.dtype} is not one of {list(_INPUT_DTYPES)}")
    if x.stride(-1) != 1:
        _fail(op, layer_name, f"{name} must have a contiguous last dim (stride 1), got strides {tuple(x.stride())}")


def _check_cache(op: str, layer_name: str, kv_cache: torch.Tensor, mode: KVQuantMode) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        _fail(op, layer_name, f"kv_cache must be (num_blocks, 2, block_size, num_kv_heads, row_dim), "
              f"got shape {tuple(kv_cache.shape)}")
    if not storage_holds(kv_cache.dtype, mode):
        expected = (
            [str(d) for d in NATIVE_CACHE_DTYPES] if mode is KVQuantMode.NONE else str(storage_dtype(mode))
        )
        _fail(op, layer_name, f"kv_cache.dtype={kv_cache.dtype} cannot hold kv_quant_mode={mode.name}; "
              f"expected {expected} (the cache must be allocated from this layer's spec)")
    if kv_cache.stride(-1) != 1:
        _fail(op, layer_name, f"kv_cache must have a contiguous last dim, got strides {tuple(kv_cache.stride())}")
    if mode is KVQuantMode.NVFP4:
        problem = check_page_contiguous(kv_cache)
        if problem is not None:
            _fail(op, layer_name, f"NVFP4 kv_cache {tuple(kv_cache.shape)}: {problem}; an NVFP4 page splits "
                  f"into data and block-scale regions, so allocate it with kvfuse.allocate_kv_cache")
    if mode is KVQuantMode.FP8_PER_TOKEN_HEAD:
        _check_scale_alignment(op, layer_name, "kv_cache", kv_cache)


def _check_scale_alignment(op: str, layer_name: str, name: str, rows: torch.Tensor) -> None:
    """FP8_PER_TOKEN_HEAD rows end in a float32 scale that kernels load and store as one 4-byte word:
    every row must start 4-byte aligned (strides and storage offset in whole words)."""
    offsets = (*rows.stride()[:-1], rows.storage_offset())
    if any(o % 4 for o in offsets):
        _fail(op, layer_name, f"{name} {tuple(rows.shape)} has strides {tuple(rows.stride())} and storage offset "
              f"{rows.storage_offset()}; fp8_per_token_head rows need both in multiples of 4 bytes (each row ends "
              f"in a float32 scale), as kvfuse.allocate_kv_cache and encode_kv produce them")


def _check_head_size(op: str, layer_name: str, mode: KVQuantMode, head_size) -> None:
    if mode is KVQuantMode.NVFP4 and head_size % 16:
        _fail(op, layer_name, f"head_size={head_size} must be a multiple of 16 for NVFP4")
    if mode is KVQuantMode.FP8_PER_TOKEN_HEAD and head_size % 4:
        _fail(op, layer_name, f"head_size={head_size} must be a multiple of 4 for FP8_PER_TOKEN_HEAD (each row's "
              f"float32 scale follows its head_size e4m3 bytes and must be 4-byte aligned)")


def _check_slots(op: str, layer_name: str, slot_mapping: torch.Tensor, num_tokens) -> None:
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in _SLOT_DTYPES:
        _fail(op, layer_name, f"slot_mapping must be 1-D int32 or int64, got dtype {slot_mapping.dtype} "
              f"shape {tuple(slot_mapping.shape)}")
    _check(slot_mapping.shape[0] == num_tokens, op, layer_name,
           lambda: f"slot_mapping has {slot_mapping.shape[0]} entries but there are {num_tokens} tokens")


# ----------------------------------------------------------------------------- encode_kv

KVFUSE_LIB.define(
    "encode_kv(Tensor x, Tensor scale, int kv_quant_mode, ScalarType cache_dtype, str layer_name) -> Tensor"
)


def _validate_encode_kv(x, scale, kv_quant_mode, cache_dtype, layer_name) -> KVQuantMode:
    op = "encode_kv"
    mode = _mode(op, layer_name, kv_quant_mode)
    _check_kv_input(op, layer_name, "x", x)
    _check_scale(op, layer_name, "scale", scale, x.shape[1])
    _check_devices(op, layer_name, x=x, scale=scale)
    if not storage_holds(cache_dtype, mode):
        _fail(op, layer_name, f"cache_dtype={cache_dtype} cannot hold kv_quant_mode={mode.name}")
    _check_head_size(op, layer_name, mode, x.shape[-1])
    return mode


@torch.library.register_fake("kvfuse::encode_kv", lib=KVFUSE_LIB)
def _encode_kv_fake(x, scale, kv_quant_mode, cache_dtype, layer_name):
    mode = _validate_encode_kv(x, scale, kv_quant_mode, cache_dtype, layer_name)
    return x.new_empty((x.shape[0], x.shape[1], row_dim_for(mode, x.shape[2])), dtype=cache_dtype)


def _self_checked_choice(op: str, kv_quant_mode, device_type: str, num_tokens: int, per_head: bool = False):
    """The registry's choice when its kernel checks the op's whole contract itself, else None.

    Native kernels check in C++, before touching memory, every condition the op's validator
    checks (rank, dtypes, shapes, strides, devices, mode); for them the Python validator only
    runs to explain a refusal in the op's own terms. Checked mode always validates first.
    """
    if type(kv_quant_mode) is not int or kv_quant_mode not in _MODES or checks.enabled():
        return None
    choice = registry.route(op, device_type, kv_quant_mode, per_head).pick(num_tokens)
    return choice if device_type in registry.implementations()[choice.name].checks_inputs else None


def _run_self_checked(kernel, kernel_args: tuple, validate, validate_args: tuple):
    try:
        return kernel(*kernel_args)
    except (ValueError, RuntimeError, IndexError):
        validate(*validate_args)  # raises the op's own message where the validator sees the problem
        raise


def _encode_kv_impl(x, scale, kv_quant_mode, cache_dtype, layer_name):
    choice = _self_checked_choice("encode_kv", kv_quant_mode, x.device.type, x.shape[0], per_head_scales(scale))
    if choice is not None:
        return _run_self_checked(choice.kernel, (x, scale, kv_quant_mode, cache_dtype), _validate_encode_kv,
                                 (x, scale, kv_quant_mode, cache_dtype, layer_name))
    mode = _validate_encode_kv(x, scale, kv_quant_mode, cache_dtype, layer_name)
    if checks.enabled() and mode.has_static_scales:
        checks.check_scales("encode_kv", layer_name, scale=scale)
    return registry.kernel("encode_kv", x.device.type, mode, x.shape[0], per_head_scales(scale))(
        x, scale, mode, cache_dtype)


# ----------------------------------------------------------------------------- cache_write

KVFUSE_LIB.define(
    "cache_write(Tensor key_rows, Tensor value_rows, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "int kv_quant_mode, str layer_name) -> ()"
)


def _validate_cache_write(key_rows, value_rows, kv_cache, slot_mapping, kv_quant_mode, layer_name) -> KVQuantMode:
    op = "cache_write"
    mode = _format(op, layer_name, kv_quant_mode)
    if isinstance(mode, KVFormat):
        _check_mixed_rows(op, layer_name, key_rows, value_rows, kv_cache, mode)
    else:
        _check_rows(op, layer_name, key_rows, value_rows, kv_cache, mode)
    _check(key_rows.shape[0] == value_rows.shape[0], op, layer_name,
           lambda: f"key_rows has {key_rows.shape[0]} tokens but value_rows has {value_rows.shape[0]}")
    _check_slots(op, layer_name, slot_mapping, key_rows.shape[0])
    _check_devices(op, layer_name, key_rows=key_rows, value_rows=value_rows, kv_cache=kv_cache,
                   slot_mapping=slot_mapping)
    return mode


def _check_rows(op: str, layer_name: str, key_rows, value_rows, kv_cache, mode: KVQuantMode) -> None:
    _check_cache(op, layer_name, kv_cache, mode)
    for name, rows in (("key_rows", key_rows), ("value_rows", value_rows)):
        if rows.dim() != 3:
            _fail(op, layer_name, f"{name} must be [num_tokens, num_kv_heads, row_dim], got shape {tuple(rows.shape)}")
        if rows.dtype != kv_cache.dtype:
            _fail(op, layer_name, f"{name}.dtype={rows.dtype} differs from kv_cache.dtype={kv_cache.dtype}; "
                  f"encode rows with kvfuse::encode_kv for this layer's mode first")
        if tuple(rows.shape[1:]) != tuple(kv_cache.shape[3:]):
            _fail(op, layer_name, f"{name} rows are {tuple(rows.shape[1:])} (heads, row_dim) but the cache "
                  f"holds {tuple(kv_cache.shape[3:])}")
        if rows.stride(-1) != 1:
            _fail(op, layer_name, f"{name} must have a contiguous last dim, got strides {tuple(rows.stride())}")


def _check_mixed_rows(op: str, layer_name: str, key_rows, value_rows, kv_cache, fmt: KVFormat) -> None:
    """Encoded rows of a mixed-format layer: each side in its own mode's storage dtype and width."""
    head_sizes, native, native_source = [], None, "key_rows"
    for name, rows, mode in (("key_rows", key_rows, fmt.key), ("value_rows", value_rows, fmt.value)):
        if rows.dim() != 3 or rows.stride(-1) != 1:
            _fail(op, layer_name, f"{name} must be [num_tokens, num_kv_heads, row_dim] with a contiguous last dim, "
                  f"got shape {tuple(rows.shape)} strides {tuple(rows.stride())}")
        if mode is KVQuantMode.NONE:
            native, native_source = rows.dtype, name
            allowed = NATIVE_CACHE_DTYPES
        else:
            allowed = (storage_dtype(mode),)
        if rows.dtype not in allowed:
            _fail(op, layer_name, f"{name}.dtype={rows.dtype} is not what {mode.name} rows are ({list(allowed)}); "
                  f"encode them with kvfuse::encode_kv in the {name[0].upper()} side's mode first")
        head_size = head_size_of_row_dim(mode, rows.shape[2])
        if head_size <= 0 or row_dim_for(mode, head_size) != rows.shape[2]:
            _fail(op, layer_name, f"{name} rows are {rows.shape[2]} wide, not a {mode.name} row width")
        head_sizes.append(head_size)
        if rows.shape[1] != kv_cache.shape[3]:
            _fail(op, layer_name, f"{name} has {rows.shape[1]} heads but the cache holds {kv_cache.shape[3]}")
    if head_sizes[0] != head_sizes[1]:
        _fail(op, layer_name, f"key_rows ({fmt.key.name}, {key_rows.shape[2]} wide) hold head_size {head_sizes[0]} but "
              f"value_rows ({fmt.value.name}, {value_rows.shape[2]} wide) hold {head_sizes[1]}")
    _check_mixed_cache(op, layer_name, kv_cache, fmt, head_sizes[0], native, native_source)


@torch.library.register_fake("kvfuse::cache_write", lib=KVFUSE_LIB)
def _cache_write_fake(key_rows, value_rows, kv_cache, slot_mapping, kv_quant_mode, layer_name):
    _validate_cache_write(key_rows, value_rows, kv_cache, slot_mapping, kv_quant_mode, layer_name)


def _cache_write_impl(key_rows, value_rows, kv_cache, slot_mapping, kv_quant_mode, layer_name):
    choice = _self_checked_choice("cache_write", kv_quant_mode, kv_cache.device.type, key_rows.shape[0])
    if choice is not None:
        _run_self_checked(choice.kernel, (key_rows, value_rows, kv_cache, slot_mapping), _validate_cache_write,
                          (key_rows, value_rows, kv_cache, slot_mapping, kv_quant_mode, layer_name))
        return
    mode = _validate_cache_write(key_rows, value_rows, kv_cache, slot_mapping, kv_quant_mode, layer_name)
    if checks.enabled():
        checks.check_slots("cache_write", layer_name, slot_mapping, kv_cache)
    registry.kernel("cache_write", kv_cache.device.type, mode, key_rows.shape[0])(
        key_rows, value_rows, kv_cache, slot_mapping, kv_quant_mode=mode)


# ----------------------------------------------------------------------------- encode_and_cache_write

KVFUSE_LIB.define(
    "encode_and_cache_write(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "Tensor k_scale, Tensor v_scale, int kv_quant_mode, str layer_name) -> ()"
)


def _validate_encode_and_cache_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_quant_mode,
                                     layer_name, op: str = "encode_and_cache_write") -> KVQuantMode:
    mode = _format(op, layer_name, kv_quant_mode)
    _check_kv_input(op, layer_name, "key", key)
    _check_kv_input(op, layer_name, "value", value)
    if key.dtype != value.dtype or tuple(key.shape[1:]) != tuple(value.shape[1:]):
        _fail(op, layer_name, f"key ({key.dtype}, {tuple(key.shape)}) and value ({value.dtype}, "
              f"{tuple(value.shape)}) must have the same dtype and [heads, head_size]")
    _check(key.shape[0] == value.shape[0], op, layer_name,
           lambda: f"key has {key.shape[0]} tokens but value has {value.shape[0]}")
    if isinstance(mode, KVFormat):
        _check_mixed_cache(op, layer_name, kv_cache, mode, key.shape[2], key.dtype, "key")
        if kv_cache.shape[3] != key.shape[1]:
            _fail(op, layer_name, f"kv_cache holds {kv_cache.shape[3]} KV heads but key {tuple(key.shape)} has "
                  f"{key.shape[1]}")
    else:
        _check_cache(op, layer_name, kv_cache, mode)
        _check_head_size(op, layer_name, mode, key.shape[-1])
        expected = (key.shape[1], row_dim_for(mode, key.shape[2]))
        if tuple(kv_cache.shape[3:]) != expected:
            _fail(op, layer_name, f"kv_cache holds (heads, row_dim)={tuple(kv_cache.shape[3:])} but key "
                  f"{tuple(key.shape)} in mode {mode.name} needs {expected}")
    _check_scale(op, layer_name, "k_scale", k_scale, key.shape[1])
    _check_scale(op, layer_name, "v_scale", v_scale, key.shape[1])
    _check_slots(op, layer_name, slot_mapping, key.shape[0])
    _check_devices(op, layer_name, key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping,
                   k_scale=k_scale, v_scale=v_scale)
    return mode


@torch.library.register_fake("kvfuse::encode_and_cache_write", lib=KVFUSE_LIB)
def _encode_and_cache_write_fake(key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_quant_mode, layer_name):
    _validate_encode_and_cache_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_quant_mode,
                                     layer_name)


def _encode_and_cache_write_impl(key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_quant_mode, layer_name):
    if kv_cache.is_cuda and not native.cuda_routing_decided():
        native.route_cuda_calls()
    choice = _self_checked_choice("encode_and_cache_write", kv_quant_mode, kv_cache.device.type, key.shape[0],
                                  per_head_scales(k_scale, v_scale))
    if choice is not None:
        _run_self_checked(choice.kernel, (key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_quant_mode),
                          _validate_encode_and_cache_write,
                          (key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_quant_mode, layer_name))
        return
    mode = _validate_encode_and_cache_write(key, value, kv_cache, slot_mapping, k_scale, v_scale,
                                            kv_quant_mode, layer_name)
    if checks.enabled():
        checks.check_slots("encode_and_cache_write", layer_name, slot_mapping, kv_cache)
        if mode.has_static_scales:
            checks.check_scales("encode_and_cache_write", layer_name, k_scale=k_scale, v_scale=v_scale)
    registry.kernel("encode_and_cache_write", kv_cache.device.type, mode, key.shape[0],
                    per_head_scales(k_scale, v_scale))(
        key, value, kv_cache, slot_mapping, k_scale, v_scale, mode)


# ----------------------------------------------------------------------------- rope_encode_and_cache_write

KVFUSE_LIB.define(
    "rope_encode_and_cache_write(Tensor? query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
    "Tensor slot_mapping, Tensor k_scale, Tensor v_scale, Tensor cos, Tensor sin, Tensor? positions, "
    "int rotary_dim, bool is_neox, int kv_quant_mode, str layer_name) -> Tensor"
)


def _validate_rope_encode_and_cache_write(query, key, value, kv_cache, slot_mapping, k_scale, v_scale, cos, sin,
                                          positions, rotary_dim, is_neox, kv_quant_mode, layer_name) -> KVQuantMode:
    op = "rope_encode_and_cache_write"
    mode = _validate_encode_and_cache_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_quant_mode,
                                            layer_name, op)
    head_size = key.shape[-1]
    if type(rotary_dim) is not int or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_size:
        _fail(op, layer_name, f"rotary_dim={rotary_dim!r} must be an even int in [2, head_size={head_size}]")
    if type(is_neox) is not bool:
        _fail(op, layer_name, f"is_neox={is_neox!r} must be a bool (True: rotate-half pairs (i, i + rotary_dim/2); "
              f"False: GPT-J interleaved pairs (2i, 2i + 1))")
    if query is not None:
        _check_kv_input(op, layer_name, "query", query)
        if query.dtype != key.dtype or query.shape[-1] != head_size:
            _fail(op, layer_name, f"query ({query.dtype}, {tuple(query.shape)}) must have key's dtype {key.dtype} "
                  f"and head_size {head_size}")
        _check(query.shape[0] == key.shape[0], op, layer_name,
               lambda: f"query has {query.shape[0]} tokens but key has {key.shape[0]}")
    widths = (rotary_dim, rotary_dim // 2)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.dtype not in _INPUT_DTYPES:
            _fail(op, layer_name, f"{name} must be 2-D [tokens or positions, width] of {list(_INPUT_DTYPES)}, got "
                  f"dtype {table.dtype} shape {tuple(table.shape)}")
        if table.shape[1] not in widths:
            _fail(op, layer_name, f"{name} has width {table.shape[1]}; allowed: rotary_dim={rotary_dim} (one "
                  f"column per feature) or rotary_dim / 2={rotary_dim // 2} (one column per pair)")
        if table.stride(-1) != 1:
            _fail(op, layer_name, f"{name} must have a contiguous last dim, got strides {tuple(table.stride())}")
    if cos.dtype != sin.dtype or tuple(cos.shape) != tuple(sin.shape):
        _fail(op, layer_name, f"cos ({cos.dtype}, {tuple(cos.shape)}) and sin ({sin.dtype}, {tuple(sin.shape)}) "
              f"must have the same dtype and shape")
    if positions is None:
        _check(cos.shape[0] == key.shape[0], op, layer_name,
               lambda: f"cos/sin have {cos.shape[0]} rows but there are {key.shape[0]} tokens; give per-token "
                       f"rows, or a table and positions")
    else:
        if positions.dim() != 1 or positions.dtype not in _SLOT_DTYPES:
            _fail(op, layer_name, f"positions must be 1-D int32 or int64, got dtype {positions.dtype} "
                  f"shape {tuple(positions.shape)}")
        _check(positions.shape[0] == key.shape[0], op, layer_name,
               lambda: f"positions has {positions.shape[0]} entries but there are {key.shape[0]} tokens")
    tensors = {"key": key, "cos": cos, "sin": sin}
    if query is not None:
        tensors["query"] = query
    if positions is not None:
        tensors["positions"] = positions
    _check_devices(op, layer_name, **tensors)
    return mode


@torch.library.register_fake("kvfuse::rope_encode_and_cache_write", lib=KVFUSE_LIB)
def _rope_encode_and_cache_write_fake(query, key, value, kv_cache, slot_mapping, k_scale, v_scale, cos, sin,
                                      positions, rotary_dim, is_neox, kv_quant_mode, layer_name):
    _validate_rope_encode_and_cache_write(query, key, value, kv_cache, slot_mapping, k_scale, v_scale, cos, sin,
                                          positions, rotary_dim, is_neox, kv_quant_mode, layer_name)
    if query is None:
        return key.new_empty((0,))
    return query.new_empty(query.shape)


def _rope_encode_and_cache_write_impl(query, key, value, kv_cache, slot_mapping, k_scale, v_scale, cos, sin,
                                      positions, rotary_dim, is_neox, kv_quant_mode, layer_name):
    mode = _validate_rope_encode_and_cache_write(query, key, value, kv_cache, slot_mapping, k_scale, v_scale, cos,
                                                 sin, positions, rotary_dim, is_neox, kv_quant_mode, layer_name)
    if checks.enabled():
        op = "rope_encode_and_cache_write"
        checks.check_slots(op, layer_name, slot_mapping, kv_cache)
        if positions is not None:
            checks.check_positions(op, layer_name, positions, cos.shape[0])
        if mode.has_static_scales:
            checks.check_scales(op, layer_name, k_scale=k_scale, v_scale=v_scale)
    return registry.kernel("rope_encode_and_cache_write", kv_cache.device.type, mode, key.shape[0],
                           per_head_scales(k_scale, v_scale))(
        query, key, value, kv_cache, slot_mapping, k_scale, v_scale, cos, sin, positions, rotary_dim, is_neox, mode)


# ----------------------------------------------------------------------------- paged_attention

KVFUSE_LIB.define(
    "paged_attention(Tensor query, Tensor kv_cache, Tensor k_scale, Tensor v_scale, Tensor block_table, "
    "Tensor seq_lens, Tensor query_start_loc, int kv_quant_mode, float sm_scale, int? sliding_window, "
    # Appended with defaults so that callers written before soft-capping and sinks keep working.
    "str layer_name, float logit_softcap=0.0, Tensor? sinks=None, Tensor? key=None, Tensor? value=None) -> Tensor"
)


def _validate_paged_attention(query, kv_cache, k_scale, v_scale, block_table, seq_lens, query_start_loc,
                              kv_quant_mode, sm_scale, sliding_window, layer_name, logit_softcap=0.0,
                              sinks=None, key=None, value=None) -> KVQuantMode:
    op = "paged_attention"
    mode = _format(op, layer_name, kv_quant_mode)
    _check_kv_input(op, layer_name, "query", query)
    num_q_heads, head_size = query.shape[1], query.shape[2]
    if isinstance(mode, KVFormat):
        _check_mixed_cache(op, layer_name, kv_cache, mode, head_size, query.dtype, "query")
    else:
        _check_cache(op, layer_name, kv_cache, mode)
        _check_head_size(op, layer_name, mode, head_size)
        if kv_cache.shape[4] != row_dim_for(mode, head_size):
            _fail(op, layer_name, f"kv_cache row_dim={kv_cache.shape[4]} does not fit head_size={head_size} in mode "
                  f"{mode.name} (expected {row_dim_for(mode, head_size)})")
    num_kv_heads = kv_cache.shape[3]
    if num_q_heads % num_kv_heads:
        _fail(op, layer_name, f"query has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    _check_scale(op, layer_name, "k_scale", k_scale, num_kv_heads)
    _check_scale(op, layer_name, "v_scale", v_scale, num_kv_heads)
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        _fail(op, layer_name, f"block_table must be [num_seqs, max_blocks] int32, got dtype {block_table.dtype} "
              f"shape {tuple(block_table.shape)}")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        _fail(op, layer_name, f"seq_lens must be [num_seqs] int32, got dtype {seq_lens.dtype} shape {tuple(seq_lens.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.dtype != torch.int32:
        _fail(op, layer_name, f"query_start_loc must be [num_seqs + 1] int32, got dtype {query_start_loc.dtype} "
              f"shape {tuple(query_start_loc.shape)}")
    _check(seq_lens.shape[0] == block_table.shape[0], op, layer_name,
           lambda: f"seq_lens has {seq_lens.shape[0]} sequences but block_table has {block_table.shape[0]} rows")
    _check(query_start_loc.shape[0] == block_table.shape[0] + 1, op, layer_name,
           lambda: f"query_start_loc has {query_start_loc.shape[0]} entries; expected num_seqs + 1 = "
                   f"{block_table.shape[0] + 1}")
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        _fail(op, layer_name, f"sm_scale={sm_scale!r} must be a finite float > 0")
    if sliding_window is not None and sliding_window <= 0:
        _fail(op, layer_name, f"sliding_window={sliding_window!r} must be None or > 0")
    if not (isinstance(logit_softcap, (int, float)) and math.isfinite(logit_softcap) and logit_softcap >= 0):
        _fail(op, layer_name, f"logit_softcap={logit_softcap!r} must be a finite float >= 0 (0.0: no soft-capping)")
    extra = {}
    if sinks is not None:
        if sinks.dtype != torch.float32 or sinks.dim() != 1 or sinks.shape[0] != num_q_heads:
            _fail(op, layer_name, f"sinks must be a float32 tensor of shape [num_q_heads]=[{num_q_heads}] "
                  f"(one logit per query head), got dtype {sinks.dtype} shape {tuple(sinks.shape)}")
        extra["sinks"] = sinks
    if (key is None) != (value is None):
        _fail(op, layer_name, f"key and value are given together or not at all (got key "
              f"{'None' if key is None else 'a tensor'}, value {'None' if value is None else 'a tensor'})")
    if key is not None:
        num_kv_heads = kv_cache.shape[3]
        for name, x in (("key", key), ("value", value)):
            if x.dim() != 3 or tuple(x.shape[1:]) != (num_kv_heads, head_size) or x.shape[0] != query.shape[0] \
                    or x.dtype != query.dtype or x.stride(-1) != 1:
                _fail(op, layer_name, f"{name} must be the step's {name}s, [num_tokens, num_kv_heads, head_size]="
                      f"[{query.shape[0]}, {num_kv_heads}, {head_size}] {query.dtype} with unit stride in the "
                      f"last dimension, got {x.dtype} shape {tuple(x.shape)} stride {tuple(x.stride())}")
            extra[name] = x
    _check_devices(op, layer_name, query=query, kv_cache=kv_cache, k_scale=k_scale, v_scale=v_scale,
                   block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc, **extra)
    return mode


@torch.library.register_fake("kvfuse::paged_attention", lib=KVFUSE_LIB)
def _paged_attention_fake(query, kv_cache, k_scale, v_scale, block_table, seq_lens, query_start_loc,
                          kv_quant_mode, sm_scale, sliding_window, layer_name, logit_softcap=0.0, sinks=None,
                          key=None, value=None):
    _validate_paged_attention(query, kv_cache, k_scale, v_scale, block_table, seq_lens, query_start_loc,
                              kv_quant_mode, sm_scale, sliding_window, layer_name, logit_softcap, sinks, key, value)
    return query.new_empty(query.shape)


def _paged_attention_impl(query, kv_cache, k_scale, v_scale, block_table, seq_lens, query_start_loc,
                          kv_quant_mode, sm_scale, sliding_window, layer_name, logit_softcap=0.0, sinks=None,
                          key=None, value=None):
    mode = _validate_paged_attention(query, kv_cache, k_scale, v_scale, block_table, seq_lens, query_start_loc,
                                     kv_quant_mode, sm_scale, sliding_window, layer_name, logit_softcap, sinks,
                                     key, value)
    if checks.enabled():
        checks.check_attention_metadata("paged_attention", layer_name, query.shape[0], kv_cache, block_table,
                                        seq_lens, query_start_loc)
        if mode.has_static_scales:
            checks.check_scales("paged_attention", layer_name, k_scale=k_scale, v_scale=v_scale)
    if key is not None and checks.enabled():
        checks.check_step_kv("paged_attention", layer_name, kv_cache, mode, block_table, seq_lens,
                             query_start_loc, key, value)
    call = registry.AttentionCall(query, kv_cache, k_scale, v_scale, block_table, seq_lens, query_start_loc,
                                  mode, sm_scale, sliding_window, float(logit_softcap), sinks, key, value)
    return registry.kernel("paged_attention", query.device.type, mode, None, per_head_scales(k_scale, v_scale))(call)


for _name, _impl in (
    ("encode_kv", _encode_kv_impl),
    ("cache_write", _cache_write_impl),
    ("encode_and_cache_write", _encode_and_cache_write_impl),
    ("rope_encode_and_cache_write", _rope_encode_and_cache_write_impl),
    ("paged_attention", _paged_attention_impl),
):
    KVFUSE_LIB.impl(_name, _impl, "CPU")
    if _name != "encode_and_cache_write":
        KVFUSE_LIB.impl(_name, _impl, "CUDA")

# The fused write is the eager hot path of every layer. Its CUDA body is registered apart so that
# kvfuse.ops.native can hand CUDA calls to the C++ router of csrc/cuda/cache_write.cu once its
# library is loaded (one dispatcher hop to the kernel instead of a hop into Python and another
# out of it). The router sends every call it does not run itself to the same Python body, under
# the overload below.
KVFUSE_LIB.define(
    "encode_and_cache_write.python(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "Tensor k_scale, Tensor v_scale, int kv_quant_mode, str layer_name) -> ()"
)
KVFUSE_LIB.impl("encode_and_cache_write.python", _encode_and_cache_write_impl, "CPU")
KVFUSE_LIB.impl("encode_and_cache_write.python", _encode_and_cache_write_impl, "CUDA")
_PYTHON_CUDA_BODY = torch.library.Library("kvfuse", "IMPL")
_PYTHON_CUDA_BODY.impl("encode_and_cache_write", _encode_and_cache_write_impl, "CUDA")


def release_python_cuda_body() -> None:
    """Deregister the Python CUDA body of the fused write (the C++ router takes its place)."""
    global _PYTHON_CUDA_BODY
    if _PYTHON_CUDA_BODY is not None:
        _PYTHON_CUDA_BODY._destroy()
        _PYTHON_CUDA_BODY = None


# ----------------------------------------------------------------------------- autograd

# The kernels are inference-only: nothing here has a derivative formula. Without a kernel at the
# Autograd key, a call on inputs that require grad goes through PyTorch's autograd fallback, which
# warns and hands back outputs that claim a gradient and fail only at backward time. This kernel
# runs the op below autograd instead, so the outputs are plain tensors (requires_grad=False)
# whatever the grad mode, and a backward through them fails where it starts, on a leaf without
# grad_fn. Ops that only mutate the cache return nothing and need no such kernel.


def _below_autograd(name: str):
    overload = getattr(torch.ops.kvfuse, name).default

    def kernel(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return overload(*args)

    kernel.__name__ = f"_{name}_autograd"
    return kernel


for _name in ("encode_kv", "paged_attention"):
    KVFUSE_LIB.impl(_name, _below_autograd(_name), "Autograd")
