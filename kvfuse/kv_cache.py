"""The KV-cache dtype model: one parser, one enum, per-layer specs and the NVFP4 page layout.

Every dtype name that enters kvfuse is parsed exactly once, here, by
:func:`parse_kv_cache_dtype` / :func:`_parse_dtype_name`. Nothing else in the package compares
dtype strings; everything downstream carries a :class:`KVQuantMode` plus a storage
``torch.dtype`` (the pair lives in :class:`KVCacheSpec`).
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "KVQuantMode",
    "KVFormat",
    "KVScaleGranularity",
    "parse_kv_cache_dtype",
    "parse_kv_scale_granularity",
    "KVCacheConfig",
    "KVCacheSpec",
    "allocate_kv_cache",
    "SLIDING_WINDOW_RULE",
    "NVFP4_BLOCK",
    "nvfp4_row_dim",
    "nvfp4_split",
    "nvfp4_v_scales_swizzled",
    "nvfp4_page_index",
    "read_cache_rows",
    "write_cache_rows",
    "logical_cache_rows",
    "logical_cache_sides",
    "cache_layout",
    "side_row_bytes",
    "head_size_of_row_dim",
    "MixedPageLayout",
    "mixed_page_layout",
    "check_page_contiguous",
    "nvfp4_quantize_reference",
    "nvfp4_dequantize_reference",
    "fp8_per_token_head_row_dim",
    "fp8_per_token_head_quantize_reference",
    "fp8_per_token_head_dequantize_reference",
    "fp8_per_token_head_split",
    "storage_holds",
    "fp8_max",
    "parse_model_dtype",
    "describe_unmatched_skip_rules",
]


class KVQuantMode(enum.IntEnum):
    """How K/V rows are encoded in a layer's cache.

    The integer values are part of the ABI: ops receive the mode as an ``int`` and the C++
    mirror in ``csrc/kv_quant_mode.h`` uses the same numbers.
    """

    NONE = 0
    FP8_E4M3 = 1
    FP8_E5M2 = 2
    NVFP4 = 3
    #: e4m3 data with one float32 scale per (token, KV head) row, computed when the row is written
    #: (vLLM's ``fp8_per_token_head``); see :func:`fp8_per_token_head_quantize_reference`.
    FP8_PER_TOKEN_HEAD = 4

    @property
    def is_quantized(self) -> bool:
        return self is not KVQuantMode.NONE

    @property
    def is_fp8(self) -> bool:
        """FP8 with static (per-tensor or per-KV-head) scales; FP8_PER_TOKEN_HEAD is not one of them."""
        return self in (KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2)

    @property
    def is_per_token_head(self) -> bool:
        """The scales live in the cache, one per row, so the ops' k_scale / v_scale are not read."""
        return self is KVQuantMode.FP8_PER_TOKEN_HEAD

    @property
    def has_static_scales(self) -> bool:
        """Whether the layer's k_scale / v_scale (a checkpoint's or calibrated) take part in the math."""
        return self.is_quantized and not self.is_per_token_head


#: ``KVFormat.code`` of a layer whose K and V sides differ: ``MIXED_FORMAT_BASE + 8 * key + value``,
#: i.e. ``0o1KV`` in octal (K FP8_E4M3 with V NVFP4 is 0o113 = 75).
MIXED_FORMAT_BASE = 0o100


@dataclass(frozen=True)
class KVFormat:
    """What a layer's cache stores on its K side and on its V side: one :class:`KVQuantMode` each.

    Most layers store both sides alike; ``key != value`` (e.g. FP8 keys with NVFP4 values) is a
    *mixed* format, whose pages are bytes laid out by :func:`mixed_page_layout`. Ops carry the
    format as one int, :attr:`code`: the mode itself when the sides agree (so every uniform
    format keeps its :class:`KVQuantMode` value, the ABI of ops and ``csrc/``), else
    ``0o1KV`` (:data:`MIXED_FORMAT_BASE`); :meth:`from_code` is the one decoder.
    """

    key: KVQuantMode
    value: KVQuantMode

    def __post_init__(self) -> None:
        for name in ("key", "value"):
            object.__setattr__(self, name, KVQuantMode(getattr(self, name)))

    @property
    def is_mixed(self) -> bool:
        return self.key is not self.value

    def __int__(self) -> int:
        """:attr:`code`: kernels take the format as the int the ops carry."""
        return self.code

    def side(self, side: int) -> KVQuantMode:
        """The mode of side 0 (K) or 1 (V)."""
        return self.key if side == 0 else self.value

    @property
    def sides(self) -> tuple[KVQuantMode, KVQuantMode]:
        return (self.key, self.value)

    @property
    def code(self) -> int:
        if not self.is_mixed:
            return int(self.key)
        return MIXED_FORMAT_BASE + 8 * int(self.key) + int(self.value)

    @property
    def name(self) -> str:
        """The mode's name, or ``"<K mode>/<V mode>"`` for a mixed format."""
        return self.key.name if not self.is_mixed else f"{self.key.name}/{self.value.name}"

    @property
    def has_static_scales(self) -> bool:
        """Whether either side's k_scale / v_scale takes part in the math."""
        return self.key.has_static_scales or self.value.has_static_scales

    @property
    def narrowed(self) -> Union[KVQuantMode, "KVFormat"]:
        """The :class:`KVQuantMode` when both sides agree, else this (mixed) format."""
        return self if self.is_mixed else self.key

    @classmethod
    def of(cls, value: Union["KVFormat", KVQuantMode, int]) -> "KVFormat":
        """``value`` as a format: a :class:`KVFormat`, a :class:`KVQuantMode` (both sides), or a code."""
        if isinstance(value, KVFormat):
            return value
        return cls.from_code(value)

    @classmethod
    def from_code(cls, code: object) -> "KVFormat":
        """Decode :attr:`code` (or a :class:`KVQuantMode`: both sides); ValueError naming the value and
        what codes mean otherwise. A dict lookup: ops decode their format on every call."""
        if type(code) is int or isinstance(code, KVQuantMode):
            found = _FORMATS_BY_CODE.get(int(code))
            if found is not None:
                return found
        raise ValueError(
            f"kv_quant_mode={code!r} is not one of {[f'{m.value} ({m.name})' for m in KVQuantMode]} (K and V "
            f"alike) nor a mixed format code {MIXED_FORMAT_BASE} + 8 * <K mode> + <V mode> with K != V (octal 0o1KV)"
        )


#: Every format by its code (instances are frozen, so one of each serves every caller).
_FORMATS_BY_CODE: dict[int, KVFormat] = {KVFormat(k, v).code: KVFormat(k, v) for k in KVQuantMode for v in KVQuantMode}


class KVScaleGranularity(enum.Enum):
    """What one FP8 scale / NVFP4 global scale of a layer covers.

    TENSOR: one float32 scale for all of K (and one for V); HEAD: one per KV head, static (from
    a checkpoint or :func:`kvfuse.calibrate_scales`), indexed by the head a row belongs to;
    TOKEN_HEAD: one per (token, KV head) row, dynamic, stored in the cache beside the row
    (``FP8_PER_TOKEN_HEAD`` layers only; it comes with the dtype, never from configuration).
    """

    TENSOR = "tensor"
    HEAD = "head"
    TOKEN_HEAD = "token_head"


# "attn_head" is vLLM's spelling (its kv_scale_type) of per-KV-head static scales.
_GRANULARITY_NAMES: dict[str, KVScaleGranularity] = {
    "tensor": KVScaleGranularity.TENSOR,
    "head": KVScaleGranularity.HEAD,
    "attn_head": KVScaleGranularity.HEAD,
}


def parse_kv_scale_granularity(value: object, argument: str = "kv_scale_granularity") -> KVScaleGranularity:
    """A :class:`KVScaleGranularity`, or its name ("tensor", "head", or vLLM's "attn_head"); case-insensitive."""
    if isinstance(value, KVScaleGranularity):
        return value
    if isinstance(value, str) and value.strip().lower() in _GRANULARITY_NAMES:
        return _GRANULARITY_NAMES[value.strip().lower()]
    raise ValueError(
        f"{argument}={value!r} is not a scale granularity; valid values are "
        f"{', '.join(repr(n) for n in _GRANULARITY_NAMES)} or a kvfuse.KVScaleGranularity"
    )


# name -> (mode, native storage dtype or None for "the model dtype" / quantized storage)
_DTYPE_NAMES: dict[str, tuple[KVQuantMode, Optional[torch.dtype]]] = {
    "auto": (KVQuantMode.NONE, None),
    "float16": (KVQuantMode.NONE, torch.float16),
    "half": (KVQuantMode.NONE, torch.float16),
    "bfloat16": (KVQuantMode.NONE, torch.bfloat16),
    "float32": (KVQuantMode.NONE, torch.float32),
    "float": (KVQuantMode.NONE, torch.float32),
    "fp8": (KVQuantMode.FP8_E4M3, None),
    "fp8_e4m3": (KVQuantMode.FP8_E4M3, None),
    # vLLM's name for the e4m3 cache of Intel Neural Compressor checkpoints: the same storage.
    "fp8_inc": (KVQuantMode.FP8_E4M3, None),
    "fp8_e5m2": (KVQuantMode.FP8_E5M2, None),
    "nvfp4": (KVQuantMode.NVFP4, None),
    "fp8_per_token_head": (KVQuantMode.FP8_PER_TOKEN_HEAD, None),
}
VALID_KV_CACHE_DTYPES: tuple[str, ...] = tuple(_DTYPE_NAMES)
# Names vLLM accepts for formats kvfuse will have but does not have yet: refused with a message
# that says so, rather than as an unknown name.
_PLANNED_DTYPE_NAMES: dict[str, str] = {}

# uint8 holds two formats (NVFP4, FP8_PER_TOKEN_HEAD, both as vLLM stores them): code that must
# know a uint8 cache's layout takes the mode explicitly (see storage_holds and read_cache_rows).
_QUANTIZED_STORAGE: dict[KVQuantMode, torch.dtype] = {
    KVQuantMode.FP8_E4M3: torch.float8_e4m3fn,
    KVQuantMode.FP8_E5M2: torch.float8_e5m2,
    KVQuantMode.NVFP4: torch.uint8,
    KVQuantMode.FP8_PER_TOKEN_HEAD: torch.uint8,
}
NATIVE_CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)

_FP8_MAX = {KVQuantMode.FP8_E4M3: 448.0, KVQuantMode.FP8_E5M2: 57344.0, KVQuantMode.FP8_PER_TOKEN_HEAD: 448.0}

#: Elements per NVFP4 block scale.
NVFP4_BLOCK = 16
#: The skip rule that matches every sliding-window layer.
SLIDING_WINDOW_RULE = "sliding_window"


def _parse_dtype_name(name: object, argument: str = "kv_cache_dtype") -> tuple[KVQuantMode, Optional[torch.dtype]]:
    """Parse a KV-cache dtype name into (mode, native dtype).

    The native dtype is None for quantized modes and for "auto" (the only name that leaves
    the choice to the model dtype).
    """
    if isinstance(name, str):
        key = name.strip().lower()
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        if key in _PLANNED_DTYPE_NAMES:
            raise ValueError(
                f"{argument}={name!r} is recognised ({_PLANNED_DTYPE_NAMES[key]}, as vLLM names it) but "
                f"not yet supported by kvfuse; valid names are "
                f"{', '.join(repr(n) for n in VALID_KV_CACHE_DTYPES)}"
            )
    raise ValueError(
        f"{argument}={name!r} is not a KV-cache dtype; valid names are "
        f"{', '.join(repr(n) for n in VALID_KV_CACHE_DTYPES)}"
    )


def parse_kv_cache_dtype(name: str) -> KVQuantMode:
    """Parse a KV-cache dtype name (``"auto"``, ``"bfloat16"``, ``"fp8"``, ``"nvfp4"``...).

    Names are case-insensitive. Raises ``ValueError`` naming the bad value and every valid one.
    """
    return _parse_dtype_name(name)[0]


def fp8_max(mode: KVQuantMode) -> float:
    """Largest finite magnitude of an FP8 mode's storage format (``mode``: a member or its int)."""
    # A dict lookup, not KVQuantMode(mode): models call this in code that Dynamo traces, and Dynamo
    # before torch 2.13 cannot build an enum member there (members and their ints hash alike).
    limit = _FP8_MAX.get(mode)
    if limit is None:
        raise ValueError(f"fp8_max: mode={mode!r} is not an FP8 mode; FP8 modes: "
                         f"{[f'{m.value} ({m.name})' for m in _FP8_MAX]}")
    return limit


def storage_dtype(mode: KVQuantMode, native_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """Storage dtype of a cache row for ``mode``; ``native_dtype`` is required for NONE."""
    mode = KVQuantMode(mode)
    if mode is KVQuantMode.NONE:
        if native_dtype not in NATIVE_CACHE_DTYPES:
            raise ValueError(
                f"native cache dtype {native_dtype} is not one of {list(NATIVE_CACHE_DTYPES)}"
            )
        return native_dtype
    return _QUANTIZED_STORAGE[mode]


def mode_of_storage_dtype(dtype: torch.dtype) -> Optional[KVQuantMode]:
    """The only mode a cache of storage ``dtype`` can hold; None for an invalid dtype and for
    uint8, which holds NVFP4 and FP8_PER_TOKEN_HEAD alike (use :func:`storage_holds` with the
    layer's mode)."""
    if dtype in NATIVE_CACHE_DTYPES:
        return KVQuantMode.NONE
    modes = [mode for mode, storage in _QUANTIZED_STORAGE.items() if storage == dtype]
    return modes[0] if len(modes) == 1 else None


def storage_holds(dtype: torch.dtype, mode: KVQuantMode) -> bool:
    """Whether a cache of storage ``dtype`` can hold rows of ``mode``."""
    mode = KVQuantMode(mode)
    if mode is KVQuantMode.NONE:
        return dtype in NATIVE_CACHE_DTYPES
    return _QUANTIZED_STORAGE[mode] == dtype


# ----------------------------------------------------------------------------- NVFP4 layout


def nvfp4_row_dim(head_size: int) -> int:
    """Bytes of one NVFP4 row: packed E2M1 data (head_size/2) then e4m3 block scales (head_size/16)."""
    if head_size <= 0 or head_size % NVFP4_BLOCK:
        raise ValueError(
            f"head_size={head_size} cannot be stored as NVFP4: it must be a positive multiple of "
            f"{NVFP4_BLOCK} (one e4m3 block scale per {NVFP4_BLOCK} elements)"
        )
    return head_size // 2 + head_size // NVFP4_BLOCK


def nvfp4_head_size(row_dim: int) -> int:
    """Inverse of :func:`nvfp4_row_dim` (row_dim = 9 * head_size / 16)."""
    if row_dim <= 0 or row_dim % 9:
        raise ValueError(f"row_dim={row_dim} is not an NVFP4 row width (9 * head_size / 16)")
    return row_dim * 16 // 9


#: Bytes of the float32 scale at the end of each FP8_PER_TOKEN_HEAD row.
PER_TOKEN_HEAD_SCALE_BYTES = 4


def fp8_per_token_head_row_dim(head_size: int) -> int:
    """Bytes of one FP8_PER_TOKEN_HEAD row: ``head_size`` e4m3 bytes, then one float32 scale."""
    if head_size <= 0 or head_size % PER_TOKEN_HEAD_SCALE_BYTES:
        raise ValueError(
            f"head_size={head_size} cannot be stored as fp8_per_token_head: it must be a positive multiple "
            f"of {PER_TOKEN_HEAD_SCALE_BYTES}, so that each row's float32 scale (after its head_size e4m3 "
            f"bytes) is 4-byte aligned"
        )
    return head_size + PER_TOKEN_HEAD_SCALE_BYTES


def row_dim_for(mode: KVQuantMode, head_size: int) -> int:
    mode = KVQuantMode(mode)
    if mode is KVQuantMode.NVFP4:
        return nvfp4_row_dim(head_size)
    if mode is KVQuantMode.FP8_PER_TOKEN_HEAD:
        return fp8_per_token_head_row_dim(head_size)
    return head_size


def head_size_of_row_dim(mode: KVQuantMode, row_dim: int) -> int:
    """The head size whose encoded ``mode`` rows are ``row_dim`` wide (the inverse of :func:`row_dim_for`
    where one exists; callers check ``row_dim_for(mode, result) == row_dim``)."""
    mode = KVQuantMode(mode)
    if mode is KVQuantMode.NVFP4:
        return row_dim * 16 // 9
    if mode is KVQuantMode.FP8_PER_TOKEN_HEAD:
        return row_dim - PER_TOKEN_HEAD_SCALE_BYTES
    return row_dim


def nvfp4_split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split encoded NVFP4 rows (uint8, last dim = row_dim) into views ``(data uint8, scales float8_e4m3fn)``.

    Encoded rows (what ``encode_kv`` returns and ``cache_write`` takes) keep each (token, head)
    row as ``[packed data | block scales]``; a cache page does not (see :func:`nvfp4_page_index`),
    so read cache rows with :func:`read_cache_rows` first.
    """
    if rows.dtype != torch.uint8:
        raise ValueError(f"NVFP4 rows must be uint8, got {rows.dtype}")
    head_size = nvfp4_head_size(rows.shape[-1])
    data = rows[..., : head_size // 2]
    scales = rows[..., head_size // 2 :].view(torch.float8_e4m3fn)
    return data, scales


# The NVFP4 page follows vLLM's NVFP4 KV cache (csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu and
# vllm/utils/torch_utils.py::nvfp4_kv_cache_split_views, vLLM main as of v0.25.1, commit
# 752a3a504485790a2e8491cacbb35c137339ad34): per page side (K, then V), all packed data, then all
# block scales; K scales linear, V scales in the 4-token interleave that TensorRT-LLM's attention
# kernels read (FlashInfer documents the same map for nvfp4_quantize_paged_kv_cache).


def nvfp4_v_scales_swizzled(block_size: int, head_size: int) -> bool:
    """Whether a page's V block scales use the 4-token interleave (vLLM's condition is
    ``block_size % 4 == 0``; the interleave is only a permutation when ``(head_size/16) % 4 == 0``,
    so kvfuse keeps linear V scales otherwise, e.g. head_size 80, instead of refusing)."""
    return block_size % 4 == 0 and (head_size // NVFP4_BLOCK) % 4 == 0


def nvfp4_page_index(block_size: int, num_kv_heads: int, head_size: int,
                     device: Union[torch.device, str, None] = None) -> torch.Tensor:
    """Byte offset, within one page (both sides), of every byte of every logical NVFP4 row.

    Returns ``index [2, block_size, num_kv_heads, row_dim]`` (int64) such that byte ``k`` of the
    encoded row ``[packed data | block scales]`` of (side, token t, head h) lives at
    ``page_base + index[side, t, h, k]``. With ``T = block_size``, ``H = num_kv_heads``,
    ``D = head_size``, ``S = D / 16`` and ``F = D/2 + S`` (the row width), one side spans
    ``T * H * F`` bytes at ``side * T * H * F``::

        data  (t, h, i)  = (t * H + h) * D/2 + i                     i < D/2
        K scale (t, h, j) = T*H*D/2 + (t * H + h) * S + j              j < S
        V scale (t, h, j) = T*H*D/2 + (t' * H + h) * S + s'            (interleaved, see below)
            t' = 4 * (t // 4) + j // (S/4),   s' = 4 * (j % (S/4)) + t % 4

    so that, within head h's (T, S) scale plane, four consecutive tokens keep their scales
    block-major, token-minor. V scales are linear, like K's, where
    :func:`nvfp4_v_scales_swizzled` is False. The map is a bijection onto the page.
    """
    row_dim = nvfp4_row_dim(head_size)
    side_bytes = block_size * num_kv_heads * row_dim
    return torch.stack([
        _side_byte_index(KVQuantMode.NVFP4, side, side * side_bytes, block_size, num_kv_heads, head_size, row_dim,
                         device)
        for side in (0, 1)
    ])


def _side_byte_index(mode: KVQuantMode, side: int, base: int, T: int, H: int, D: int, row_bytes: int,
                     device) -> torch.Tensor:
    """``[T, H, row_bytes]`` byte offsets, from the page's start, of the encoded rows of one page
    side that starts at byte ``base``: NVFP4 splits the side into data and block-scale regions
    (:func:`nvfp4_page_index`; V scales interleaved where :func:`nvfp4_v_scales_swizzled`), every
    other mode keeps each row whole, ``(t * H + h) * row_bytes`` into the side."""
    t = torch.arange(T, device=device).view(T, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1)
    if mode is not KVQuantMode.NVFP4:
        return base + (t * H + h) * row_bytes + torch.arange(row_bytes, device=device).view(1, 1, row_bytes)
    half, S = D // 2, D // NVFP4_BLOCK
    data = base + (t * H + h) * half + torch.arange(half, device=device).view(1, 1, half)
    j = torch.arange(S, device=device).view(1, 1, S)
    if side == 1 and nvfp4_v_scales_swizzled(T, D):
        group = S // 4
        t_row = 4 * (t // 4) + j // group
        s_col = 4 * (j % group) + t % 4
        scales = base + T * H * half + (t_row * H + h) * S + s_col
    else:
        scales = base + T * H * half + (t * H + h) * S + j
    return torch.cat([data, scales.expand(T, H, S)], dim=-1)


def side_row_bytes(mode: KVQuantMode, head_size: int, native_dtype: Optional[torch.dtype] = None) -> int:
    """Bytes of one encoded (token, head) row of ``mode`` (``native_dtype``: a NONE side's dtype)."""
    mode = KVQuantMode(mode)
    return row_dim_for(mode, head_size) * storage_dtype(mode, native_dtype).itemsize


#: Where a mixed-format page's V side starts: K side's bytes rounded up to this, so that every V
#: row format (16-byte NVFP4 data chunks, 4-byte per-token-head scales, 2-byte bf16) is aligned.
MIXED_SIDE_ALIGN = 16


@dataclass(frozen=True)
class MixedPageLayout:
    """The byte geometry of one page of a mixed-format cache (K and V sides in different formats).

    The cache is uint8 ``(num_blocks, 2, block_size, num_kv_heads, row_dim)``, page-contiguous; dims
    1-4 only size the page (``2 * block_size * num_kv_heads * row_dim`` bytes, the last few of
    which may be padding; ``row_dim`` is a multiple of the widest side's element size, so the
    cache can be viewed as each side's dtype). Side ``s`` starts at byte ``side_offsets[s]`` of its page (K at 0, V
    at K's bytes rounded up to :data:`MIXED_SIDE_ALIGN`) and is laid out as a uniform page side of
    its own mode: whole rows ``(t * H + h) * row_bytes[s]`` into the side, or for NVFP4 the data
    region then the block scales, V's interleaved as in a uniform NVFP4 page
    (:func:`nvfp4_page_index`). An unquantized side stores ``native_dtype`` (the model dtype).
    """

    kv_format: KVFormat
    block_size: int
    num_kv_heads: int
    head_size: int
    native_dtype: Optional[torch.dtype]
    row_bytes: tuple[int, int]
    side_offsets: tuple[int, int]
    row_dim: int

    def storage_dtype(self, side: int) -> torch.dtype:
        """The dtype a side's encoded rows have (what ``encode_kv`` returns for its mode)."""
        return storage_dtype(self.kv_format.side(side), self.native_dtype)

    def side_index(self, side: int, device=None) -> torch.Tensor:
        """``[block_size, num_kv_heads, row_bytes[side]]`` byte offsets from the page's start."""
        key = (self, side, torch.device(device) if device is not None else torch.device("cpu"))
        index = _PAGE_INDEX_CACHE.get(key)
        if index is None:
            index = _PAGE_INDEX_CACHE[key] = _side_byte_index(
                self.kv_format.side(side), side, self.side_offsets[side], self.block_size, self.num_kv_heads,
                self.head_size, self.row_bytes[side], device)
        return index


def mixed_page_layout(kv_format: Union[KVFormat, int], block_size: int, num_kv_heads: int, head_size: int,
                      native_dtype: Optional[torch.dtype] = None) -> MixedPageLayout:
    """The :class:`MixedPageLayout` of a mixed format; ValueError for a uniform format, a head size
    a side's mode cannot store, or an unquantized side without a native ``native_dtype``."""
    fmt = KVFormat.of(kv_format)
    if not fmt.is_mixed:
        raise ValueError(f"kv_format={fmt.name} stores K and V alike; mixed_page_layout describes formats whose "
                         f"sides differ")
    if KVQuantMode.NONE in fmt.sides and native_dtype not in NATIVE_CACHE_DTYPES:
        raise ValueError(f"kv_format={fmt.name} keeps one side unquantized: native_dtype={native_dtype} must be one "
                         f"of {list(NATIVE_CACHE_DTYPES)} (the model dtype)")
    row_bytes = tuple(side_row_bytes(m, head_size, native_dtype) for m in fmt.sides)
    rows = block_size * num_kv_heads
    v_offset = -(-rows * row_bytes[0] // MIXED_SIDE_ALIGN) * MIXED_SIDE_ALIGN
    page_bytes = v_offset + rows * row_bytes[1]
    # row_dim a multiple of the widest side element, so that the cache can be viewed as each side's dtype.
    word = max(storage_dtype(m, native_dtype).itemsize for m in fmt.sides)
    row_dim = -(-page_bytes // (2 * rows * word)) * word
    return MixedPageLayout(fmt, block_size, num_kv_heads, head_size,
                           native_dtype if KVQuantMode.NONE in fmt.sides else None, row_bytes, (0, v_offset), row_dim)


def check_page_contiguous(kv_cache: torch.Tensor) -> Optional[str]:
    """None if each page of ``kv_cache (num_blocks, 2, T, H, row_dim)`` is one contiguous run
    (what an NVFP4 page's layout needs; pages themselves may be apart), else why not."""
    _, _, T, H, F = kv_cache.shape
    expected = (T * H * F, H * F, F, 1)
    actual = tuple(kv_cache.stride()[1:])
    if all(size == 1 or a == e for size, a, e in zip(kv_cache.shape[1:], actual, expected)):
        return None
    return (f"its strides {tuple(kv_cache.stride())} are not contiguous within a page "
            f"(dims 1-4 must have strides {expected})")


_PAGE_INDEX_CACHE: dict[tuple, torch.Tensor] = {}


def _page_index_for(kv_cache: torch.Tensor) -> torch.Tensor:
    _, _, T, H, F = kv_cache.shape
    key = (T, H, F, kv_cache.device)
    index = _PAGE_INDEX_CACHE.get(key)
    if index is None:
        index = _PAGE_INDEX_CACHE[key] = nvfp4_page_index(T, H, nvfp4_head_size(F), device=kv_cache.device)
    return index


def _flat_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, page_bytes]`` view of a page-contiguous cache (pages keep their stride)."""
    problem = check_page_contiguous(kv_cache)
    if problem is not None:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} of a page-addressed format: {problem}")
    n, _, T, H, F = kv_cache.shape
    return kv_cache.as_strided((n, 2 * T * H * F), (kv_cache.stride(0), 1))


#: What the row helpers below take as ``mode``: a layer's KVQuantMode (or its int), a
#: :class:`KVFormat` or format code whose sides agree, or a mixed cache's :class:`MixedPageLayout`.
CacheLayout = Union[KVQuantMode, KVFormat, MixedPageLayout, int, None]


def cache_layout(kv_format: Union[KVFormat, KVQuantMode, int], kv_cache: torch.Tensor, head_size: int,
                 native_dtype: Optional[torch.dtype] = None) -> Union[KVFormat, MixedPageLayout]:
    """What the row helpers need to address ``kv_cache``: the format itself when its sides agree,
    else the :class:`MixedPageLayout` of the cache's page (``head_size`` and, with an unquantized
    side, ``native_dtype`` are needed for that)."""
    fmt = KVFormat.of(kv_format)
    if not fmt.is_mixed:
        return fmt
    return mixed_page_layout(fmt, kv_cache.shape[2], kv_cache.shape[3], head_size, native_dtype)


def _is_nvfp4_cache(kv_cache: torch.Tensor, mode: Union[KVQuantMode, KVFormat, int, None] = None) -> bool:
    """Whether ``kv_cache`` holds NVFP4 pages: by the uniform ``mode`` (or format) where given, else
    by its dtype (uint8 meant NVFP4 before FP8_PER_TOKEN_HEAD shared it; callers that may see both
    pass the mode)."""
    if mode is not None:
        return KVFormat.of(mode).key is KVQuantMode.NVFP4
    return kv_cache.dtype == torch.uint8


def read_cache_rows(kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                    side: int, mode: CacheLayout = None) -> torch.Tensor:
    """The encoded rows ``[L, H, row_dim]`` of slots ``(blocks[l], offsets[l])`` of one side
    (0: K, 1: V), in the format ``encode_kv`` returns whatever the page layout (a copy).

    ``mode``: the layer's :class:`KVQuantMode`, format or, for a mixed-format cache, its
    :class:`MixedPageLayout` (:func:`cache_layout`); without it a uint8 cache is read as NVFP4
    pages (pass ``KVQuantMode.FP8_PER_TOKEN_HEAD`` for those caches, whose rows are stored whole)."""
    if isinstance(mode, MixedPageLayout):
        index = mode.side_index(side, kv_cache.device)
        raw = _flat_pages(kv_cache)[blocks.long()[:, None, None], index[offsets.long()]]
        return raw.view(mode.storage_dtype(side))
    if not _is_nvfp4_cache(kv_cache, mode):
        return kv_cache[blocks.long(), side, offsets.long()]
    index = _page_index_for(kv_cache)[side]
    return _flat_pages(kv_cache)[blocks.long()[:, None, None], index[offsets.long()]]


def write_cache_rows(kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                     side: int, rows: torch.Tensor, mode: CacheLayout = None) -> None:
    """Store encoded rows ``[L, H, row_dim]`` into slots ``(blocks[l], offsets[l])`` of one side
    (``mode`` as for :func:`read_cache_rows`)."""
    if isinstance(mode, MixedPageLayout):
        index = mode.side_index(side, kv_cache.device)
        _flat_pages(kv_cache)[blocks.long()[:, None, None], index[offsets.long()]] = \
            rows.contiguous().view(torch.uint8)
        return
    if not _is_nvfp4_cache(kv_cache, mode):
        kv_cache[blocks.long(), side, offsets.long()] = rows
        return
    index = _page_index_for(kv_cache)[side]
    flat = _flat_pages(kv_cache)
    flat[blocks.long()[:, None, None], index[offsets.long()]] = rows


def logical_cache_rows(kv_cache: torch.Tensor, mode: CacheLayout = None) -> torch.Tensor:
    """A tensor shaped like ``kv_cache`` whose ``[block, side, t, h]`` is that slot's encoded row
    (a copy for NVFP4 pages, ``kv_cache`` itself otherwise; ``mode`` as for :func:`read_cache_rows`):
    for tests and inspection. Mixed-format caches have rows of two widths: see
    :func:`logical_cache_sides`."""
    if isinstance(mode, MixedPageLayout):
        raise ValueError(f"a {mode.kv_format.name} cache keeps K and V rows of different widths; read it with "
                         f"logical_cache_sides")
    if not _is_nvfp4_cache(kv_cache, mode):
        return kv_cache
    index = _page_index_for(kv_cache)
    flat = _flat_pages(kv_cache)
    return flat[:, index]


def logical_cache_sides(kv_cache: torch.Tensor, mode: CacheLayout = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K rows, V rows)``, each ``[num_blocks, block_size, num_kv_heads, row_dim]`` in its side's
    encoded form (``mode`` as for :func:`read_cache_rows`; any format): for tests and inspection."""
    if isinstance(mode, MixedPageLayout):
        flat = _flat_pages(kv_cache)
        return tuple(flat[:, mode.side_index(side, kv_cache.device)].view(mode.storage_dtype(side))
                     for side in (0, 1))
    rows = logical_cache_rows(kv_cache, mode)
    return rows[:, 0], rows[:, 1]


# E2M1 magnitudes by code; the thresholds below implement round-to-nearest-even between them
# (ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to the code with an even mantissa) and
# saturation at 6.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_code(q: torch.Tensor) -> torch.Tensor:
    """float32 -> 4-bit E2M1 code (sign in bit 3), RNE, saturating; NaN -> +0 (every compare is False)."""
    a = q.abs()
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    sign = (q < 0).to(torch.uint8) << 3
    return mag | sign


def _nvfp4_global_scale(global_scale, device: torch.device) -> torch.Tensor:
    """The global scale shaped to broadcast over ``[..., H, D/16, 16]``: ``[]``, or ``[H, 1, 1]`` per KV head."""
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    return gs.reshape(()) if gs.numel() == 1 else gs.reshape(-1, 1, 1)


def nvfp4_quantize_reference(x: torch.Tensor, global_scale: Union[torch.Tensor, float]) -> torch.Tensor:
    """Encode ``x [..., D]`` into NVFP4 rows ``[..., D/2 + D/16]`` (uint8).

    ``global_scale``: one element, or one per KV head (``[H]`` for ``x [..., H, D]``).

    Math, in float32, per block of 16 elements ``b`` (decode: value = e2m1 * block_scale * global_scale)::

        amax      = max(|x_i| for i in b, NaN ignored)
        s_b       = e4m3_rne(min(amax / (global_scale * 6), 448))
        r_b       = 1 / (float(s_b) * global_scale)                       (0 where that divisor is 0)
        q_i       = e2m1_rne_sat(x_i * r_b)

    One reciprocal per block, then a product per element (each rounded to float32), as vLLM's
    and FlashInfer's NVFP4 quantizers multiply by a reciprocal; kvfuse's is the correctly
    rounded one (theirs is ``rcp.approx``), so every backend reproduces it bit for bit.

    NaN inputs encode as +0 (E2M1 has no NaN), without affecting the other 15 values of the
    block; +-inf saturate to +-6 * s_b * global_scale.
    """
    head_size = x.shape[-1]
    nvfp4_row_dim(head_size)
    gs = _nvfp4_global_scale(global_scale, x.device)
    xf = x.float().reshape(*x.shape[:-1], head_size // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = torch.where(torch.isnan(xf), 0.0, xf.abs()).amax(dim=-1, keepdim=True)
    block_scale = torch.clamp(amax / (gs * 6.0), max=448.0).to(torch.float8_e4m3fn)
    denom = block_scale.float() * gs
    recip = torch.where(denom > 0, 1.0 / denom, torch.zeros_like(denom))
    q = xf * recip
    codes = _e2m1_code(q).reshape(*x.shape[:-1], head_size)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = block_scale.reshape(*x.shape[:-1], head_size // NVFP4_BLOCK).view(torch.uint8)
    return torch.cat([packed, scales], dim=-1)


def nvfp4_dequantize_reference(rows: torch.Tensor, global_scale: Union[torch.Tensor, float]) -> torch.Tensor:
    """Decode NVFP4 rows ``[..., D/2 + D/16]`` into float32 ``[..., D]`` (a ``[H]`` global scale: rows ``[..., H, row]``)."""
    data, scales = nvfp4_split(rows)
    head_size = data.shape[-1] * 2
    gs = _nvfp4_global_scale(global_scale, rows.device)
    lut = torch.tensor(
        list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32, device=rows.device
    )
    lo = (data & 0xF).long()
    hi = (data >> 4).long()
    vals = torch.stack([lut[lo], lut[hi]], dim=-1).reshape(*data.shape[:-1], head_size)
    vals = vals.reshape(*data.shape[:-1], head_size // NVFP4_BLOCK, NVFP4_BLOCK)
    out = vals * (scales.float().unsqueeze(-1) * gs)
    return out.reshape(*data.shape[:-1], head_size)


# ----------------------------------------------------------------------------- FP8 per token and head

# The FP8_PER_TOKEN_HEAD row is vLLM's (vllm/v1/attention/backends/triton_attn.py,
# TritonAttentionBackend.get_kv_cache_shape and TritonAttentionImpl._ensure_scale_caches, vLLM main
# of 2026; STR_DTYPE_TO_TORCH_DTYPE["fp8_per_token_head"] = torch.uint8 in vllm/utils/torch_utils.py):
# a uint8 cache (num_blocks, 2, block_size, num_kv_heads, head_size + 4) whose every (token, head)
# row is head_size e4m3 bytes followed by the row's float32 scale (native byte order, i.e. little
# endian on every device kvfuse runs on). The math is that of vLLM's writer,
# vllm/v1/attention/ops/triton_reshape_and_cache_flash.py::_reshape_cache_per_token_head:
# scale = max(amax / 448, 1e-6), q = clamp(x * (1 / scale), -448, 448), e4m3 round to nearest even.


def fp8_keep_nan_sign(encoded: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``encoded`` (FP8, from ``x``) with the byte of every NaN of ``x`` set to ``sign(x) | 0x7F``.

    The references define a NaN's FP8 byte by the input's sign. PyTorch keeps that sign through
    its CPU arithmetic, but its CUDA arithmetic returns a positive canonical NaN. Without this,
    a reference run on CUDA tensors would disagree with itself on CPU and with every kernel, for
    negative NaN inputs."""
    nan = torch.isnan(x)
    nan_byte = torch.where(torch.signbit(x), 0xFF, 0x7F).to(torch.uint8)
    return torch.where(nan, nan_byte, encoded.view(torch.uint8)).view(encoded.dtype)


def fp8_per_token_head_quantize_reference(x: torch.Tensor) -> torch.Tensor:
    """Encode ``x [..., D]`` into FP8_PER_TOKEN_HEAD rows ``[..., D + 4]`` (uint8).

    Math, in float32, per row (decode: value = e4m3 * scale)::

        amax  = max(|x_i| for finite x_i)                  (0 if the row has none)
        scale = max(amax / 448, 1e-6)                      (IEEE division)
        r     = 1 / scale                                  (IEEE division)
        q_i   = e4m3_rne(clamp(x_i * r, -448, 448))        (NaN stays NaN, with its sign)
        row   = [q_0 .. q_{D-1} as bytes | scale as 4 bytes]

    For finite rows this is vLLM's formula; kvfuse divides with IEEE rounding everywhere (vLLM's
    Triton ``/`` is the approximate ``div.full.f32``, so a scale may differ from vLLM's in its last
    bit), and it leaves NaN and +-inf out of the amax, so that one such element does not wipe its
    row (an inf amax would make every other element 0 or NaN): +-inf saturate to +-448 * scale.
    """
    head_size = x.shape[-1]
    fp8_per_token_head_row_dim(head_size)
    xf = x.float()
    amax = torch.where(torch.isfinite(xf), xf.abs(), 0.0).amax(dim=-1, keepdim=True)
    # The divisor is a tensor on x's device: PyTorch's CUDA division by a Python number multiplies
    # by its reciprocal, which is one float32 rounding away from the IEEE quotient in some rows.
    scale = torch.clamp(amax / amax.new_full((), 448.0), min=1e-6)
    q = fp8_keep_nan_sign(torch.clamp(xf * (1.0 / scale), -448.0, 448.0).to(torch.float8_e4m3fn), xf)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def fp8_per_token_head_split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split FP8_PER_TOKEN_HEAD rows (uint8 ``[..., D + 4]``) into ``(data float8_e4m3fn [..., D],
    scale float32 [...])`` (copies for the scales: their bytes need not be 4-aligned in ``rows``)."""
    if rows.dtype != torch.uint8:
        raise ValueError(f"fp8_per_token_head rows must be uint8, got {rows.dtype}")
    head_size = rows.shape[-1] - PER_TOKEN_HEAD_SCALE_BYTES
    fp8_per_token_head_row_dim(head_size)
    data = rows[..., :head_size].view(torch.float8_e4m3fn)
    scale = rows[..., head_size:].contiguous().view(torch.float32).squeeze(-1)
    return data, scale


def fp8_per_token_head_dequantize_reference(rows: torch.Tensor) -> torch.Tensor:
    """Decode FP8_PER_TOKEN_HEAD rows ``[..., D + 4]`` into float32 ``[..., D]``: e4m3 * the row's scale."""
    data, scale = fp8_per_token_head_split(rows)
    return data.float() * scale.unsqueeze(-1)


# ----------------------------------------------------------------------------- config and spec

_DOTTED_NAME = re.compile(r"^[A-Za-z_]\w*(\.\w+)+$")


def layer_index_from_name(layer_name: str) -> Optional[int]:
    """The one all-digit dotted component of ``layer_name``, or None if it has none or several.

    "model.layers.3.fp8_attn" -> 3 and "h2o.layers.3.attn" -> 3 (digits inside a component do
    not count, as in vLLM's ``extract_layer_index``); "model.layers.3.experts.7.attn" -> None.
    """
    found = [part for part in layer_name.split(".") if part.isdigit()]
    return int(found[0]) if len(found) == 1 else None


_NATIVE_NAMES = tuple(n for n, (mode, native) in _DTYPE_NAMES.items() if native is not None)


def parse_model_dtype(value: object, argument: str = "model_dtype") -> torch.dtype:
    """A model dtype given as a ``torch.dtype`` or a native name ("bfloat16", "half", ...).

    Names go through the one dtype parser; only native dtypes are model dtypes, so the error
    lists only those (never "auto", FP8 or NVFP4 names).
    """
    if isinstance(value, torch.dtype):
        if value in NATIVE_CACHE_DTYPES:
            return value
    elif isinstance(value, str) and value.strip().lower() in _NATIVE_NAMES:
        return _DTYPE_NAMES[value.strip().lower()][1]
    raise ValueError(
        f"{argument}={value!r} must name a native dtype: one of "
        f"{', '.join(repr(n) for n in _NATIVE_NAMES)} or {', '.join(map(str, NATIVE_CACHE_DTYPES))}"
    )


@dataclass(frozen=True)
class KVCacheSpec:
    """Everything a kernel needs to know about one layer's cache, decided once per layer."""

    layer_name: str
    layer_index: Optional[int]
    num_kv_heads: int
    head_size: int
    model_dtype: torch.dtype
    kv_quant_mode: KVQuantMode
    kv_cache_torch_dtype: torch.dtype
    sliding_window: Optional[int]
    reason: str = field(compare=False)
    # Tensor parallelism: num_kv_heads above is this rank's share of total_num_kv_heads.
    tp_size: int = 1
    tp_rank: int = 0
    total_num_kv_heads: Optional[int] = None  # None: not sharded (= num_kv_heads)
    #: Always TENSOR for unquantized (NONE) layers, which have no scales to speak of; TOKEN_HEAD for
    #: FP8_PER_TOKEN_HEAD layers, whose scales are in the cache.
    scale_granularity: KVScaleGranularity = KVScaleGranularity.TENSOR
    #: The V side's mode where it differs from the K side's ``kv_quant_mode`` (a mixed format,
    #: stored as uint8 pages: :func:`mixed_page_layout`); None when both sides are ``kv_quant_mode``.
    v_quant_mode: Optional[KVQuantMode] = None

    def __post_init__(self) -> None:
        if self.v_quant_mode is not None and KVQuantMode(self.v_quant_mode) is KVQuantMode(self.kv_quant_mode):
            object.__setattr__(self, "v_quant_mode", None)

    @property
    def kv_format(self) -> KVFormat:
        """Both sides' modes; ``kv_format.code`` is the int this layer's ops carry as ``kv_quant_mode``."""
        return KVFormat(self.kv_quant_mode, self.kv_quant_mode if self.v_quant_mode is None else self.v_quant_mode)

    @property
    def is_mixed(self) -> bool:
        return self.v_quant_mode is not None

    def side_storage_dtype(self, side: int) -> torch.dtype:
        """The dtype of side 0 (K) or 1 (V)'s encoded rows (the cache's own dtype unless mixed)."""
        if not self.is_mixed:
            return self.kv_cache_torch_dtype
        return storage_dtype(self.kv_format.side(side), self.model_dtype)

    def page_layout(self, block_size: int) -> MixedPageLayout:
        """The byte layout of this mixed-format layer's pages of ``block_size`` tokens."""
        return mixed_page_layout(self.kv_format, block_size, self.num_kv_heads, self.head_size, self.model_dtype)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Shape of this layer's ``k_scale`` / ``v_scale``: ``()`` per tensor, ``(num_kv_heads,)`` per
        KV head (this rank's heads under tensor parallelism). A TOKEN_HEAD layer keeps ``()``
        placeholders that its ops do not read (its scales are computed per row and stored in the cache)."""
        return (self.num_kv_heads,) if self.scale_granularity is KVScaleGranularity.HEAD else ()

    def shard_scale(self, value, name: str = "scale", device=None) -> torch.Tensor:
        """A float32 tensor of :attr:`scale_shape` from a checkpoint's or a user's scale.

        ``value``: a number or one-element tensor (per tensor; a per-head layer gives it to every
        head), or, for a per-head layer, ``num_kv_heads`` values of this rank or
        ``total_num_kv_heads`` values of the whole model (this rank's heads are taken). Every
        value must be finite and > 0; anything else raises ValueError naming ``name``.
        """
        t = torch.as_tensor(value, dtype=torch.float32).detach().to("cpu").reshape(-1)
        heads = self.scale_shape
        if t.numel() == 1:
            out = t.reshape(()).expand(heads).clone()
        elif heads and t.numel() == (self.total_num_kv_heads or self.num_kv_heads):
            out = t[list(self.kv_heads)].clone()
        elif heads and t.numel() == self.num_kv_heads:
            out = t.clone()
        else:
            allowed = "one value" if not heads else (
                f"one value, or one per KV head ({self.num_kv_heads}"
                + (f" on this rank or {self.total_num_kv_heads} in the model" if self.total_num_kv_heads else "")
                + ")")
            hint = "" if heads or t.numel() <= 1 else " (per-head scales need kv_scale_granularity='head')"
            raise ValueError(f"layer {self.layer_name!r}: {name} has {t.numel()} values (shape "
                             f"{tuple(torch.as_tensor(value).shape)}); its {self.scale_granularity.value} "
                             f"scale takes {allowed}{hint}")
        bad = ~(torch.isfinite(out) & (out > 0))
        if bool(bad.any()):
            raise ValueError(f"layer {self.layer_name!r}: {name}={out.tolist() if heads else float(out)!r}; "
                             f"scales must be finite and > 0")
        return out.to(device) if device is not None else out

    @property
    def kv_heads(self) -> range:
        """The model's KV-head indices this cache holds (all of them without tensor parallelism)."""
        from .distributed import kv_head_shard

        return kv_head_shard(self.total_num_kv_heads or self.num_kv_heads, self.tp_size, self.tp_rank)

    @property
    def row_dim(self) -> int:
        """The cache's last dimension. A mixed-format page's depends on its block size: use
        :meth:`cache_shape` (or :meth:`page_layout`) for those."""
        if self.is_mixed:
            raise ValueError(f"layer {self.layer_name!r} stores K as {self.kv_quant_mode.name} and V as "
                             f"{self.v_quant_mode.name}: its cache's row_dim depends on the block size; use "
                             f"cache_shape(num_blocks, block_size)")
        return row_dim_for(self.kv_quant_mode, self.head_size)

    def side_row_bytes(self, side: int) -> int:
        """Bytes of one encoded (token, KV head) row of side 0 (K) or 1 (V)."""
        return side_row_bytes(self.kv_format.side(side), self.head_size, self.side_storage_dtype(side))

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes per token for K and V together (a mixed page's alignment padding not counted)."""
        return self.num_kv_heads * (self.side_row_bytes(0) + self.side_row_bytes(1))

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        row_dim = self.page_layout(block_size).row_dim if self.is_mixed else self.row_dim
        return (num_blocks, 2, block_size, self.num_kv_heads, row_dim)


def _normalize_skip_rule(rule: object) -> str:
    if isinstance(rule, bool):
        raise ValueError(f"skip_layers entry {rule!r} is a bool, not a layer index or name")
    if isinstance(rule, int):
        if rule < 0:
            raise ValueError(f"skip_layers entry {rule!r} is negative; layer indices start at 0")
        return str(rule)
    if isinstance(rule, str):
        text = rule.strip()
        if text.isdigit() or text == SLIDING_WINDOW_RULE or _DOTTED_NAME.match(text):
            return text
        hint = ""
        if text.lower().replace("-", "_").replace(" ", "_") == SLIDING_WINDOW_RULE:
            hint = f" (did you mean {SLIDING_WINDOW_RULE!r}?)"
        raise ValueError(
            f"skip_layers entry {rule!r} is not a skip rule{hint}; allowed: a layer index such as "
            f"'0' or 3, {SLIDING_WINDOW_RULE!r}, or a full dotted layer name such as "
            f"'model.layers.3.attn'"
        )
    raise ValueError(
        f"skip_layers entry {rule!r} has type {type(rule).__name__}; allowed: int or str"
    )


@dataclass(frozen=True)
class KVCacheConfig:
    """The user's KV-cache request, validated once; :meth:`layer_spec` decides per layer.

    Precedence for a layer: a skip rule matches -> model dtype; else an explicit
    ``kv_cache_dtype`` (anything but "auto"); else ``checkpoint_kv_cache_dtype``; else the
    model dtype.

    ``tp_size`` / ``tp_rank``: under tensor parallelism :meth:`layer_spec` still takes the
    model's KV-head count and returns this rank's spec, whose cache holds only this rank's
    heads (see :mod:`kvfuse.distributed` for the split and for replication when
    ``tp_size > num_kv_heads``). The dtype decision is the same on every rank.
    """

    kv_cache_dtype: str = "auto"
    skip_layers: tuple = ()
    checkpoint_kv_cache_dtype: Optional[str] = None
    tp_size: int = 1
    tp_rank: int = 0

    #: :meth:`check_skip_rules` raises (instead of warning) when a rule matches no layer.
    strict_skip_layers: bool = False
    #: What one K/V scale covers in quantized layers: "tensor" (one scale) or "head" (one per KV
    #: head; vLLM's "attn_head"); stored as a :class:`KVScaleGranularity`. Skip layers ignore it.
    kv_scale_granularity: Union[str, KVScaleGranularity] = KVScaleGranularity.TENSOR
    #: Per-side overrides of ``kv_cache_dtype`` (any of its names; None: ``kv_cache_dtype``), e.g.
    #: ``k_cache_dtype="fp8", v_cache_dtype="nvfp4"``. Skip rules still give both sides the model
    #: dtype. A layer whose sides end up in different formats stores mixed pages
    #: (:func:`mixed_page_layout`), whose unquantized side, if any, holds the model dtype.
    k_cache_dtype: Optional[str] = None
    v_cache_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        for name, value, minimum in (("tp_size", self.tp_size, 1), ("tp_rank", self.tp_rank, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} must be < tp_size={self.tp_size}")
        if not isinstance(self.strict_skip_layers, bool):
            raise ValueError(f"strict_skip_layers={self.strict_skip_layers!r} must be a bool")
        object.__setattr__(self, "kv_scale_granularity", parse_kv_scale_granularity(self.kv_scale_granularity))
        if self.kv_scale_granularity is KVScaleGranularity.TOKEN_HEAD:
            raise ValueError(
                "kv_scale_granularity=KVScaleGranularity.TOKEN_HEAD is not a configuration: per-token-head "
                "scales come with kv_cache_dtype='fp8_per_token_head'; allowed: 'tensor', 'head' or 'attn_head'"
            )
        _parse_dtype_name(self.kv_cache_dtype, "kv_cache_dtype")
        for argument in ("k_cache_dtype", "v_cache_dtype"):
            if getattr(self, argument) is not None:
                _parse_dtype_name(getattr(self, argument), argument)
        if self.checkpoint_kv_cache_dtype is not None:
            _parse_dtype_name(self.checkpoint_kv_cache_dtype, "checkpoint_kv_cache_dtype")
        rules = self.skip_layers
        if isinstance(rules, (str, int)):
            rules = (rules,)
        try:
            rules = tuple(rules)
        except TypeError:
            raise ValueError(
                f"skip_layers={self.skip_layers!r} must be a sequence of layer indices or names"
            ) from None
        object.__setattr__(self, "skip_layers", tuple(_normalize_skip_rule(r) for r in rules))

    @property
    def _index_rules(self) -> frozenset[int]:
        return frozenset(int(r) for r in self.skip_layers if r.isdigit())

    def _matching_skip_rule(
        self, layer_name: str, layer_index: Optional[int], sliding_window: Optional[int]
    ) -> Optional[str]:
        for rule in self.skip_layers:
            if rule == SLIDING_WINDOW_RULE:
                if sliding_window is not None and sliding_window > 0:
                    return f"skip rule {rule!r} (sliding window {sliding_window})"
            elif rule.isdigit():
                if layer_index is None:
                    raise ValueError(
                        f"layer {layer_name!r}: skip_layers has index rule {rule!r} but the layer's "
                        f"index cannot be known (its name must have exactly one all-digit dotted "
                        f"component, as in 'model.layers.3.attn'); pass "
                        f"layer_index= to layer_spec"
                    )
                if int(rule) == layer_index:
                    return f"skip rule {rule!r} (layer index {layer_index})"
            elif rule == layer_name:
                return f"skip rule {rule!r} (layer name)"
        return None

    @staticmethod
    def _rule_matches(rule: str, spec: KVCacheSpec) -> bool:
        if rule == SLIDING_WINDOW_RULE:
            return spec.sliding_window is not None
        if rule.isdigit():
            return spec.layer_index == int(rule)
        return spec.layer_name == rule

    def unmatched_skip_rules(self, specs) -> tuple[str, ...]:
        """The skip rules that match none of ``specs`` (every layer of a model, once known).

        Such a rule is almost always a mistake (an index past the last layer, a partial or
        misspelled name, "sliding_window" on a model without sliding-window layers).
        """
        specs = list(specs)
        return tuple(r for r in self.skip_layers if not any(self._rule_matches(r, s) for s in specs))

    def check_skip_rules(self, specs, strict: Optional[bool] = None) -> tuple[str, ...]:
        """Warn (or, with ``strict`` / ``strict_skip_layers``, raise ValueError) about skip rules
        that match no layer of ``specs``; returns them. Call it once every layer is known."""
        specs = list(specs)
        unmatched = self.unmatched_skip_rules(specs)
        if not unmatched:
            return unmatched
        message = describe_unmatched_skip_rules(unmatched, specs)
        if self.strict_skip_layers if strict is None else strict:
            raise ValueError(message)
        logger.warning("%s", message)
        return unmatched

    def layer_spec(
        self,
        layer_name: str,
        num_kv_heads: int,
        head_size: int,
        model_dtype: Union[torch.dtype, str] = torch.bfloat16,
        sliding_window: Optional[int] = None,
        layer_index: Optional[int] = None,
    ) -> KVCacheSpec:
        """Decide one layer's cache mode and storage dtype (see the class docstring).

        ``model_dtype`` is a native ``torch.dtype`` or its name ("bfloat16", "half", ...).
        ``num_kv_heads`` is the model's count; the spec's is this rank's share of it.
        """
        if not isinstance(layer_name, str) or not layer_name:
            raise ValueError(f"layer_name={layer_name!r} must be a non-empty str")
        for name, value in (("num_kv_heads", num_kv_heads), ("head_size", head_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"layer {layer_name!r}: {name}={value!r} must be a positive int")
        from .distributed import kv_head_shard

        try:
            local_kv_heads = len(kv_head_shard(num_kv_heads, self.tp_size, self.tp_rank))
        except ValueError as e:
            raise ValueError(f"layer {layer_name!r}: {e}") from None
        try:
            model_dtype = parse_model_dtype(model_dtype)
        except ValueError as e:
            raise ValueError(f"layer {layer_name!r}: {e}") from None
        if sliding_window is not None and (
            not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window <= 0
        ):
            raise ValueError(
                f"layer {layer_name!r}: sliding_window={sliding_window!r} must be None or a positive int"
            )
        if layer_index is None:
            layer_index = layer_index_from_name(layer_name)
        elif not isinstance(layer_index, int) or isinstance(layer_index, bool) or layer_index < 0:
            raise ValueError(f"layer {layer_name!r}: layer_index={layer_index!r} must be an int >= 0")

        skip = self._matching_skip_rule(layer_name, layer_index, sliding_window)
        if skip is not None:
            sides = [(KVQuantMode.NONE, model_dtype, skip)] * 2
        else:
            sides = [self._side_choice(self.k_cache_dtype, "k_cache_dtype", model_dtype),
                     self._side_choice(self.v_cache_dtype, "v_cache_dtype", model_dtype)]
        (mode, native, k_reason), (v_mode, v_native, v_reason) = sides
        reason = k_reason if k_reason == v_reason else f"K: {k_reason}; V: {v_reason}"
        for side_mode in {mode, v_mode}:
            if side_mode is KVQuantMode.NVFP4 or side_mode is KVQuantMode.FP8_PER_TOKEN_HEAD:
                try:
                    row_dim_for(side_mode, head_size)
                except ValueError as e:
                    raise ValueError(f"layer {layer_name!r}: {e}") from None
        if mode is v_mode and native != v_native:
            raise ValueError(
                f"layer {layer_name!r}: K would be stored as {native} and V as {v_native}; unquantized sides share "
                f"one dtype (give k_cache_dtype / v_cache_dtype the same native name, or quantize one side)")
        if mode is not v_mode:
            for side, side_mode, side_native in (("K", mode, native), ("V", v_mode, v_native)):
                if side_mode is KVQuantMode.NONE and side_native != model_dtype:
                    raise ValueError(
                        f"layer {layer_name!r}: the unquantized {side} side of a layer whose K and V formats "
                        f"differ ({mode.name} / {v_mode.name}) stores the model dtype {model_dtype}, not "
                        f"{side_native}; ask for 'auto' or {str(model_dtype).replace('torch.', '')!r} there")
        if mode is KVQuantMode.FP8_PER_TOKEN_HEAD and v_mode is KVQuantMode.FP8_PER_TOKEN_HEAD:
            granularity = KVScaleGranularity.TOKEN_HEAD
        elif mode.has_static_scales or v_mode.has_static_scales:
            granularity = self.kv_scale_granularity
        else:
            granularity = KVScaleGranularity.TENSOR
        spec = KVCacheSpec(
            layer_name=layer_name,
            layer_index=layer_index,
            num_kv_heads=local_kv_heads,
            head_size=head_size,
            model_dtype=model_dtype,
            kv_quant_mode=mode,
            kv_cache_torch_dtype=storage_dtype(mode, native) if mode is v_mode else torch.uint8,
            sliding_window=sliding_window,
            reason=reason,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            total_num_kv_heads=num_kv_heads if self.tp_size > 1 else None,
            scale_granularity=granularity,
            v_quant_mode=v_mode if v_mode is not mode else None,
        )
        logger.debug("layer %s: %s (%s), %s", layer_name, spec.kv_format.name, spec.kv_cache_torch_dtype, reason)
        return spec

    def _side_choice(self, override: Optional[str], side_argument: str, model_dtype: torch.dtype
                     ) -> tuple[KVQuantMode, torch.dtype, str]:
        """(mode, native dtype, reason) of one side of a layer no skip rule matches: its per-side
        dtype (``side_argument``) if given, else ``kv_cache_dtype``, then the checkpoint's, then the model's."""
        name, argument = (override, side_argument) if override is not None else (self.kv_cache_dtype, "kv_cache_dtype")
        mode, native = _parse_dtype_name(name, argument)
        if not (mode is KVQuantMode.NONE and native is None):
            reason = f"explicit {argument}={name!r}"
        elif self.checkpoint_kv_cache_dtype is not None:
            mode, native = _parse_dtype_name(self.checkpoint_kv_cache_dtype, "checkpoint_kv_cache_dtype")
            reason = f"checkpoint declares {self.checkpoint_kv_cache_dtype!r}"
        else:
            mode, native, reason = KVQuantMode.NONE, model_dtype, "auto: model dtype"
        if mode is KVQuantMode.NONE and native is None:  # "auto" declared by a checkpoint
            native = model_dtype
        return mode, native, reason


def describe_unmatched_skip_rules(unmatched, specs) -> str:
    """One line naming the skip rules that match no layer and the layers that exist."""
    specs = list(specs)
    names = [s.layer_name for s in specs]
    shown = ", ".join(repr(n) for n in names[:4]) + (f", ... ({len(names)} layers)" if len(names) > 4 else "")
    indices = sorted({s.layer_index for s in specs if s.layer_index is not None})
    index_text = f"indices {indices[0]}..{indices[-1]}" if indices else "no layer indices"
    windows = [s.layer_index if s.layer_index is not None else s.layer_name for s in specs
               if s.sliding_window is not None]
    rules = ", ".join(repr(r) for r in unmatched)
    return (f"skip_layers rule{'s' if len(unmatched) > 1 else ''} {rules} match{'' if len(unmatched) > 1 else 'es'} "
            f"no layer; layers seen: {shown} ({index_text}; sliding-window layers: "
            f"{windows or 'none'}); a rule is a layer index, 'sliding_window' or a full layer name")


def allocate_kv_cache(
    spec: KVCacheSpec,
    num_blocks: int,
    block_size: int,
    device: Union[torch.device, str, None] = None,
) -> torch.Tensor:
    """A zero-filled cache ``(num_blocks, 2, block_size, num_kv_heads, row_dim)`` for ``spec``.

    Zeros (not empty memory) so that a page that was never written cannot hold NaN bit patterns.
    """
    return torch.zeros(
        spec.cache_shape(num_blocks, block_size), dtype=spec.kv_cache_torch_dtype, device=device
    )
