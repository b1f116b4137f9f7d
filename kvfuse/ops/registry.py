"""Which implementation runs an op: declared implementations, one typed contract, cached choices.

Every implementation module (:mod:`.reference`, :mod:`.native`, :mod:`.triton`,
:mod:`.flashinfer`) declares one :class:`Implementation`: its name, the ops, devices and cache
modes it covers, an ``available`` check (optional dependencies, a build that failed) and a
``rank`` (its selection rule: lower wins, None = only when forced). Its kernels implement the
per-op protocols below (:class:`EncodeKV`, :class:`CacheWrite`, :class:`EncodeAndCacheWrite`,
:class:`RopeEncodeAndCacheWrite`, :class:`PagedAttentionKernel`), so each signature is written once, here.

A choice is made once per :class:`Situation` ``(op, device type, mode, size class, captured)``
(``mode``: a :class:`KVQuantMode`, or a :class:`KVFormat` for layers whose K and V formats
differ, which only implementations declaring ``mixed_format_ops`` run)
and cached; the per-call path (:func:`kernel`) is one size-class test and one dict lookup.
The size class and the capture flag exist for CUDA cache ops only, where the measured policy in
:mod:`.tuning` prefers Triton for bulk writes and, for some formats, under CUDA-graph capture.

A backend forced through ``KVFUSE_*_BACKEND`` (:mod:`kvfuse.envs`) is the only candidate and
raises if it cannot run the call; nothing falls back silently. :func:`clear_cache` (or
:func:`kvfuse.envs.reload`) forgets every choice.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Protocol, Union

import torch

from .. import envs
from ..kv_cache import KVFormat, KVQuantMode

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_OPS",
    "ROPE_OPS",
    "ATTENTION_OPS",
    "OPS",
    "AttentionCall",
    "EncodeKV",
    "CacheWrite",
    "EncodeAndCacheWrite",
    "RopeEncodeAndCacheWrite",
    "PagedAttentionKernel",
    "Implementation",
    "Situation",
    "Choice",
    "situation",
    "choose",
    "route",
    "Route",
    "implementations",
    "kernel",
    "select",
    "unavailable_reason",
    "decisions",
    "clear_cache",
]

CACHE_OPS = ("encode_kv", "cache_write", "encode_and_cache_write")
# Cache writes with the rotary embedding folded in: the "cache" family (one forced cache backend
# covers them), kept out of CACHE_OPS because the measured CUDA policy of .tuning is about those.
ROPE_OPS = ("rope_encode_and_cache_write",)
ATTENTION_OPS = ("paged_attention",)
OPS = CACHE_OPS + ROPE_OPS + ATTENTION_OPS
ALL_MODES = frozenset(KVQuantMode)

# Implementation modules, each exporting IMPLEMENTATION; imported on the first selection only.
_IMPLEMENTATION_MODULES = (
    "kvfuse.ops.native",
    "kvfuse.ops.triton",
    "kvfuse.ops.flashinfer",
    "kvfuse.ops.reference",
)


# ----------------------------------------------------------------------------- the per-op contract


@dataclass(frozen=True)
class AttentionCall:
    """The arguments of ``kvfuse::paged_attention``, validated by the op layer.

    Semantics: :func:`kvfuse.ops.reference.paged_attention`.
    """

    query: torch.Tensor
    kv_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    #: The layer's mode, or its :class:`KVFormat` where K and V are stored in different modes.
    kv_quant_mode: Union[KVQuantMode, KVFormat]
    sm_scale: float
    sliding_window: Optional[int]
    #: ``c * tanh(s / c)`` on the scaled scores when > 0 (Gemma 2); 0.0 leaves them as they are.
    logit_softcap: float = 0.0
    #: float32 ``[num_q_heads]``: one extra logit per head in the softmax denominator (gpt-oss).
    sinks: Optional[torch.Tensor] = None
    #: The step's own K/V (``[num_tokens, Hkv, D]``, row ``i`` belongs to query row ``i``), equal to
    #: the cache's rows at the query positions; kernels may read the newest keys from them.
    key: Optional[torch.Tensor] = None
    value: Optional[torch.Tensor] = None


class EncodeKV(Protocol):
    def __call__(self, x: torch.Tensor, scale: torch.Tensor, kv_quant_mode: int,
                 cache_dtype: torch.dtype) -> torch.Tensor: ...


class CacheWrite(Protocol):
    # kv_quant_mode: the layer's mode, which a uint8 cache's layout depends on (NVFP4 pages or
    # FP8_PER_TOKEN_HEAD rows); None (callers from before that format) means NVFP4 for uint8.
    def __call__(self, key_rows: torch.Tensor, value_rows: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_quant_mode: Optional[int] = None) -> None: ...


class EncodeAndCacheWrite(Protocol):
    def __call__(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor, v_scale: torch.Tensor, kv_quant_mode: int) -> None: ...


class RopeEncodeAndCacheWrite(Protocol):
    def __call__(self, query: Optional[torch.Tensor], key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, positions: Optional[torch.Tensor], rotary_dim: int, is_neox: bool,
                 kv_quant_mode: int) -> torch.Tensor: ...


class PagedAttentionKernel(Protocol):
    def __call__(self, call: AttentionCall) -> torch.Tensor: ...


# ----------------------------------------------------------------------------- declarations


class Situation(NamedTuple):
    """What a choice depends on: the cache key of the registry."""

    op: str
    device_type: str
    mode: Union[KVQuantMode, KVFormat]  # a KVFormat only for mixed formats (K and V differ)
    size_class: str  # "small" or "bulk" (CUDA cache ops), else "any"
    captured: bool  # a CUDA graph is being captured (only where the policy cares)
    per_head_scales: bool = False  # k_scale / v_scale hold one value per KV head


@dataclass(frozen=True)
class Implementation:
    """One implementation of some kvfuse ops, as its module declares it.

    ``available(op, device_type, mode)`` returns None when it can run, else a sentence saying
    why not (it may import or build things; it is called once per decision, never per call).
    ``rank(situation)`` is the selection rule: the available implementation with the lowest
    rank wins; None means "never chosen unless forced".
    """

    name: str
    module: str
    ops: frozenset
    devices: frozenset
    modes: frozenset
    available: Callable[[str, str, KVQuantMode], Optional[str]]
    rank: Callable[[Situation], Optional[int]]
    #: Device types on which its kernels check every condition of the op's validator before touching
    #: memory and refuse cleanly: the op body then skips the Python validation there (kvfuse.ops.library).
    checks_inputs: frozenset = frozenset()
    #: Device types on which its kernels take per-KV-head scales (None: every device it runs on); on
    #: the others a call with per-head scales goes to the next implementation.
    per_head_scale_devices: Optional[frozenset] = None
    #: Ops that take per-KV-head scales on every device it runs them on (whatever ``per_head_scale_devices`` says).
    per_head_scale_ops: frozenset = frozenset()
    #: The ops it runs for mixed formats (a K side and a V side in different modes, each in ``modes``).
    mixed_format_ops: frozenset = frozenset()
    #: Ops it takes only some calls of, by shape and layout, handing the others to another
    #: implementation or, when forced, refusing them: a pass does not emit them under this backend
    #: forced (kvfuse/passes/fuse_rope_cache_write.py).
    partial_ops: frozenset = frozenset()

    def __post_init__(self) -> None:
        if self.name not in envs.BACKEND_NAMES:
            raise ValueError(f"implementation name {self.name!r} is not one of {envs.BACKEND_NAMES}")
        unknown = set(self.ops) - set(OPS)
        if unknown:
            raise ValueError(f"implementation {self.name!r} declares unknown ops {sorted(unknown)}; known: {OPS}")

    def covers(self, op: str, device_type: str, mode: KVQuantMode, per_head_scales: bool = False) -> Optional[str]:
        """None if the declaration covers the call, else why not."""
        if op not in self.ops:
            return f"{self.name} implements {', '.join(sorted(self.ops))}, not {op}"
        if device_type not in self.devices:
            return f"{self.name} runs on {', '.join(sorted(self.devices))}, not {device_type}"
        if isinstance(mode, KVFormat):
            if op not in self.mixed_format_ops or not set(mode.sides) <= self.modes:
                return f"{self.name} does not support {mode.name} (K/V) caches for {op}"
        elif mode not in self.modes:
            return f"{self.name} does not support {mode.name} caches for {op}"
        if (per_head_scales and self.per_head_scale_devices is not None and device_type not in self.per_head_scale_devices
                and op not in self.per_head_scale_ops):
            return f"{self.name} takes only per-tensor scales for {op} on {device_type}, not one per KV head"
        return None

    def kernel(self, op: str):
        return getattr(importlib.import_module(self.module), op)


class Choice(NamedTuple):
    name: str
    kernel: Callable


_lock = threading.Lock()
_declared: dict[str, Implementation] = {}
_choices: dict[Situation, Choice] = {}
_routes: dict[tuple, "Route"] = {}


def implementations() -> dict[str, Implementation]:
    """Every declared implementation by name (importing their light declaration modules once)."""
    if not _declared:
        with _lock:
            if not _declared:
                for module in _IMPLEMENTATION_MODULES:
                    impl = importlib.import_module(module).IMPLEMENTATION
                    _declared[impl.name] = impl
    return _declared


def family(op: str) -> str:
    if op in CACHE_OPS or op in ROPE_OPS:
        return "cache"
    if op in ATTENTION_OPS:
        return "attention"
    raise ValueError(f"op={op!r} is not a kvfuse op; known: {OPS}")


def unavailable_reason(name: str, op: str, device_type: str, mode, per_head_scales: bool = False) -> Optional[str]:
    """None if implementation ``name`` can run ``op`` for this device type and mode (and, with
    ``per_head_scales``, with one scale per KV head), else why not."""
    impl = implementations().get(name)
    if impl is None:
        return f"{name!r} is not a kvfuse backend; valid: {', '.join(implementations())}"
    mode = situation_mode(mode)
    reason = impl.covers(op, device_type, mode, per_head_scales)
    if reason is None:
        try:
            reason = impl.available(op, device_type, mode)
        except ImportError as e:  # an optional dependency that fails to import
            reason = f"{impl.module} cannot be imported: {e}"
    return reason


# ----------------------------------------------------------------------------- choosing


def _choice(impl: Implementation, situation: Situation) -> Choice:
    return Choice(impl.name, impl.kernel(situation.op))


def _decide(situation: Situation) -> tuple[Choice, list]:
    """(choice, [(name, why not) for the candidates passed over]) for ``situation``."""
    forced = envs.settings().forced_backend(family(situation.op))
    impls = implementations()
    if forced is not None:
        reason = unavailable_reason(forced, situation.op, situation.device_type, situation.mode,
                                    situation.per_head_scales)
        if reason is not None:
            raise RuntimeError(f"backend {forced!r} was forced for {situation.op} on {situation.device_type} "
                               f"but {reason}")
        return _choice(impls[forced], situation), []
    ranked = sorted((r, name) for name, impl in impls.items() if (r := impl.rank(situation)) is not None)
    skipped = []
    for _, name in ranked:
        reason = unavailable_reason(name, situation.op, situation.device_type, situation.mode,
                                    situation.per_head_scales)
        if reason is None:
            return _choice(impls[name], situation), skipped
        skipped.append((name, reason))
    raise RuntimeError(f"no kvfuse backend can run {situation.op} on {situation.device_type} for "
                       f"{situation.mode.name}{' with per-head scales' if situation.per_head_scales else ''}: " + "; ".join(f"{n}: {r}" for n, r in skipped))


def choose(situation: Situation) -> Choice:
    choice = _choices.get(situation)
    if choice is None:
        choice, skipped = _decide(situation)
        logger.debug("%s -> %s (passed over: %s)", situation, choice.name, skipped)
        _choices[situation] = choice
    return choice


def situation_mode(mode) -> Union[KVQuantMode, KVFormat]:
    """What a :class:`Situation` holds for a mode, format or format code: the :class:`KVQuantMode`
    when both sides agree, else the mixed :class:`KVFormat` (ValueError for an unknown code)."""
    return KVFormat.of(mode).narrowed


def situation(op: str, device_type: str, mode: KVQuantMode, num_tokens: Optional[int] = None) -> Situation:
    mode = situation_mode(mode)
    if device_type == "cuda" and op in CACHE_OPS and not isinstance(mode, KVFormat):
        from . import tuning

        policy = tuning.cuda_cache_write_policy()
        bulk = num_tokens is not None and num_tokens >= policy.native_max_tokens(mode)
        # The capture query only where the policy depends on it: it costs host time.
        captured = (not bulk and policy.triton_captured(mode, num_tokens)
                    and torch.cuda.is_current_stream_capturing())
        return Situation(op, device_type, mode, "bulk" if bulk else "small", captured)
    return Situation(op, device_type, mode, "any", False)


class Route:
    """The choices of one (op, device type, mode), resolved lazily: the per-call path of the ops.

    ``pick(num_tokens)`` costs one comparison (CUDA cache ops: bulk or not), the capture query
    where the policy depends on it, and an attribute read; no hashing.
    """

    __slots__ = ("op", "device_type", "mode", "per_head", "limit", "captured_limit", "_small", "_bulk",
                 "_captured")

    def __init__(self, op: str, device_type: str, mode: KVQuantMode, per_head: bool = False) -> None:
        self.op, self.device_type, self.mode, self.per_head = op, device_type, mode, per_head
        self.limit, self.captured_limit = None, None
        # The measured CUDA policy is about formats csrc/ writes; mixed formats have one choice.
        if device_type == "cuda" and op in CACHE_OPS and not isinstance(mode, KVFormat):
            from . import tuning

            policy = tuning.cuda_cache_write_policy()
            self.limit = policy.native_max_tokens(mode)
            self.captured_limit = policy.triton_when_captured.get(mode)
        self._small = self._bulk = self._captured = None

    def pick(self, num_tokens: Optional[int]) -> Choice:
        if self.limit is not None:
            if num_tokens is not None and num_tokens >= self.limit:
                if self._bulk is None:
                    self._bulk = choose(Situation(self.op, self.device_type, self.mode, "bulk", False, self.per_head))
                return self._bulk
            if (self.captured_limit is not None and (num_tokens is None or num_tokens < self.captured_limit)
                    and torch.cuda.is_current_stream_capturing()):
                if self._captured is None:
                    self._captured = choose(Situation(self.op, self.device_type, self.mode, "small", True,
                                                      self.per_head))
                return self._captured
            size_class = "small"
        else:
            size_class = "any"
        if self._small is None:
            self._small = choose(Situation(self.op, self.device_type, self.mode, size_class, False, self.per_head))
        return self._small


def route(op: str, device_type: str, mode_value: int, per_head: bool = False) -> Route:
    """The :class:`Route` of ``op`` on ``device_type`` for the mode whose value is ``mode_value``
    (and per-KV-head scales when ``per_head``)."""
    key = (op, device_type, mode_value, per_head)
    found = _routes.get(key)
    if found is None:
        found = _routes[key] = Route(op, device_type, situation_mode(mode_value), per_head)
    return found


def kernel(op: str, device_type: str, mode: Union[KVQuantMode, KVFormat], num_tokens: Optional[int] = None,
           per_head_scales: bool = False) -> Callable:
    """The kernel function that runs ``op`` now (the per-call path of the public ops)."""
    return route(op, device_type, int(mode), per_head_scales).pick(num_tokens).kernel


def select(op: str, device_type: str, mode, num_tokens: Optional[int] = None,
           per_head_scales: bool = False) -> Choice:
    """``(name, kernel)`` for ``op`` on ``device_type`` with cache mode ``mode`` and ``num_tokens`` tokens."""
    family(op)
    return route(op, device_type, KVFormat.of(mode).code, per_head_scales).pick(num_tokens)


def decisions(device_type: str) -> list[dict]:
    """What the registry chooses on ``device_type``, one row per situation (for ``kvfuse info``).

    Rows: ``op``, ``mode``, ``size_class``, ``captured``, ``chosen`` (or None), ``passed_over``
    ([(name, why)]) and ``error`` (why nothing can run).
    """
    rows = []
    if device_type == "cuda":
        cache_situations = [("small", False), ("small", True), ("bulk", False)]
    else:
        cache_situations = [("any", False)]
    for op in OPS:
        for mode in KVQuantMode:
            variants = cache_situations if op in CACHE_OPS else [("any", False)]
            for size_class, captured in variants:
                situation = Situation(op, device_type, mode, size_class, captured)
                row = {"op": op, "mode": mode.name, "size_class": size_class, "captured": captured,
                       "chosen": None, "passed_over": [], "error": None}
                try:
                    choice, row["passed_over"] = _decide(situation)
                    row["chosen"] = choice.name
                except (RuntimeError, ValueError) as e:
                    row["error"] = str(e)
                rows.append(row)
    return rows


def clear_cache(reload_settings: bool = True) -> None:
    """Forget every choice (and, by default, re-read the environment through :mod:`kvfuse.envs`)."""
    if reload_settings:
        envs.reload(_clear_registry=False)
    _choices.clear()
    _routes.clear()
    from . import native

    native.reset_cuda_routing()
