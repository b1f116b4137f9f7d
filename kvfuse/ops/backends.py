"""Which implementation runs an op: explicit, per (op, device type, mode), overridable by env.

Backends are modules that export functions named like the ops they implement
(``encode_kv``, ``cache_write``, ``encode_and_cache_write``, ``paged_attention``; same
arguments as :mod:`kvfuse.ops.reference`) and a ``unavailable_reason(op, device_type, mode)``
that returns None when the module can run that combination, or a sentence saying why not.
They are imported lazily, on the first call that needs them: importing kvfuse never
initialises CUDA, imports Triton or compiles anything.

Environment overrides (read per decision, cached until :func:`clear_cache`):

- ``KVFUSE_CACHE_WRITE_BACKEND``: backend for encode_kv / cache_write / encode_and_cache_write;
- ``KVFUSE_ATTENTION_BACKEND``: backend for paged_attention;
- ``KVFUSE_BACKEND``: both, where the specific one is unset.

A forced backend that cannot run the call raises instead of silently falling back.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType
from typing import Optional

from ..kv_cache import KVQuantMode

logger = logging.getLogger(__name__)

BACKEND_MODULES = {
    "reference": "kvfuse.ops.reference",
    "triton": "kvfuse.ops.triton",
    "native": "kvfuse.ops.native",
    "flashinfer": "kvfuse.ops.flashinfer",
}
CACHE_OPS = ("encode_kv", "cache_write", "encode_and_cache_write")
ATTENTION_OPS = ("paged_attention",)

# Preference order when nothing is forced; the first backend that can run the call wins.
_DEFAULT_ORDER = {
    ("cache", "cuda"): ("native", "triton", "reference"),
    ("cache", "cpu"): ("native", "reference"),
    # Triton first: it reads every cache format (NVFP4 included) and is CUDA-graph safe;
    # FlashInfer plans on the host per metadata, so it is opt-in (KVFUSE_ATTENTION_BACKEND).
    ("attention", "cuda"): ("triton", "flashinfer", "reference"),
    ("attention", "cpu"): ("reference",),
}


def _family(op: str) -> str:
    if op in CACHE_OPS:
        return "cache"
    if op in ATTENTION_OPS:
        return "attention"
    raise ValueError(f"op={op!r} is not a kvfuse op; known: {CACHE_OPS + ATTENTION_OPS}")


def forced_backend(op: str) -> Optional[str]:
    """The backend an environment variable forces for ``op``, or None."""
    specific = "KVFUSE_CACHE_WRITE_BACKEND" if _family(op) == "cache" else "KVFUSE_ATTENTION_BACKEND"
    for var in (specific, "KVFUSE_BACKEND"):
        value = os.environ.get(var, "").strip().lower()
        if value:
            if value not in BACKEND_MODULES:
                raise ValueError(
                    f"{var}={value!r} is not a kvfuse backend; valid: {', '.join(BACKEND_MODULES)}"
                )
            return value
    return None


def _load(name: str) -> tuple[Optional[ModuleType], Optional[str]]:
    try:
        return importlib.import_module(BACKEND_MODULES[name]), None
    except ImportError as e:  # optional dependency missing (triton, flashinfer, a compiler)
        return None, f"cannot import {BACKEND_MODULES[name]}: {e}"


def unavailable_reason(name: str, op: str, device_type: str, mode: int) -> Optional[str]:
    """None if backend ``name`` can run ``op`` for this device type and mode, else why not."""
    module, reason = _load(name)
    if module is None:
        return reason
    check = getattr(module, "unavailable_reason", None)
    reason = check(op, device_type, mode) if check is not None else None
    if reason is None:
        try:
            if not hasattr(module, op):
                reason = f"backend {name!r} does not implement {op}"
        except ImportError as e:  # a lazily imported kernel module failed to load
            reason = f"backend {name!r} cannot load {op}: {e}"
    return reason


# When a CUDA cache op prefers Triton to native, from the device times of the same run
# (H100, BENCHMARKS.md section 1, commit 6ae1eb7) and the host cost per eager call, where native
# costs 0.33-0.49x Triton's (eager calls are host-bound up to ~16K tokens):
# - token counts: Triton from 16384 tokens for casts (bf16 49.7 vs 50.2 us at 16384, 188.5 vs
#   191.0 at 65536) and NVFP4 (56.5 vs 61.8 us), from 65536 for FP8 (141.6 vs 142.7 us; native is
#   faster up to 16384: 36.4 vs 37.9 us);
# - under CUDA-graph capture only device time counts: Triton for casts (1.9 vs 2.1 us at 256
#   tokens) and NVFP4 (2.7 vs 3.1 us at 64), native for FP8 (2.2 vs 2.4 us at 64).
# KVFUSE_NATIVE_MAX_TOKENS overrides the token counts (for every mode).
_NATIVE_MAX_TOKENS = {
    int(KVQuantMode.NONE): 16384,
    int(KVQuantMode.FP8_E4M3): 65536,
    int(KVQuantMode.FP8_E5M2): 65536,
    int(KVQuantMode.NVFP4): 16384,
}
_TRITON_WHEN_CAPTURED = frozenset({int(KVQuantMode.NONE), int(KVQuantMode.NVFP4)})


@functools.lru_cache(maxsize=None)
def _native_max_tokens(mode: int) -> Optional[int]:
    value = os.environ.get("KVFUSE_NATIVE_MAX_TOKENS", "").strip()
    if not value:
        return _NATIVE_MAX_TOKENS.get(mode)
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"KVFUSE_NATIVE_MAX_TOKENS={value!r} is not an integer token count") from None


def _candidates(op: str, device_type: str, forced: Optional[str], bulk: bool) -> tuple[str, ...]:
    if forced is not None:
        return (forced,)
    if bulk:
        return ("triton", "native", "reference")
    return _DEFAULT_ORDER.get((_family(op), device_type), ("reference",))


def _first_available(op: str, device_type: str, mode: int, candidates) -> tuple[Optional[str], list]:
    """The first candidate that can run the call, and (name, why not) for each one before it."""
    skipped = []
    for name in candidates:
        reason = unavailable_reason(name, op, device_type, mode)
        if reason is None:
            return name, skipped
        skipped.append((name, reason))
    return None, skipped


def _explain(skipped) -> str:
    return "; ".join(f"{name}: {reason}" for name, reason in skipped)


@functools.lru_cache(maxsize=None)
def _select(op: str, device_type: str, mode: int, forced: Optional[str], bulk: bool = False) -> tuple[str, object]:
    name, skipped = _first_available(op, device_type, mode, _candidates(op, device_type, forced, bulk))
    if name is None:
        if forced is not None:
            raise RuntimeError(f"backend {forced!r} was forced for {op} on {device_type} but {skipped[0][1]}")
        raise RuntimeError(f"no kvfuse backend can run {op} on {device_type}: {_explain(skipped)}")
    logger.debug("%s on %s mode %d -> %s (skipped: %s)", op, device_type, mode, name, _explain(skipped))
    module, _ = _load(name)
    return name, getattr(module, op)


def _capturing() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()


def _prefers_triton(mode: int, num_tokens: Optional[int], capturing: bool) -> bool:
    """Whether a CUDA cache call should try Triton before native (see ``_NATIVE_MAX_TOKENS``)."""
    limit = _native_max_tokens(mode)
    if num_tokens is not None and limit is not None and num_tokens >= limit:
        return True
    return capturing and mode in _TRITON_WHEN_CAPTURED


def select(op: str, device_type: str, mode: int, num_tokens: Optional[int] = None) -> tuple[str, object]:
    """(backend name, function) for ``op`` on ``device_type`` with cache mode ``mode``.

    CUDA cache ops prefer Triton over native where ``_prefers_triton`` says so: calls of at least
    ``_native_max_tokens(mode)`` tokens (``num_tokens``), and cast / NVFP4 calls under CUDA-graph
    capture.
    """
    mode = int(mode)
    forced = forced_backend(op)
    bulk = False
    if forced is None and device_type == "cuda" and op in CACHE_OPS:
        # The capture query only where it matters: it costs host time on every call.
        bulk = _prefers_triton(mode, num_tokens, mode in _TRITON_WHEN_CAPTURED and _capturing())
    return _select(op, device_type, mode, forced, bulk)


def clear_cache() -> None:
    """Forget cached decisions (after changing an override variable or installing a backend)."""
    _select.cache_clear()
    _native_max_tokens.cache_clear()


def describe_backends(device_type: str = "cuda") -> list[tuple[str, str, str, str]]:
    """Rows ``(op, mode name, chosen backend or "-", why the others were skipped)`` for ``device_type``.

    For ``python -m kvfuse info``; imports the candidate backends but launches nothing.
    """
    rows = []
    for op in CACHE_OPS + ATTENTION_OPS:
        for mode in KVQuantMode:
            candidates = _candidates(op, device_type, forced_backend(op), bulk=False)
            chosen, skipped = _first_available(op, device_type, int(mode), candidates)
            rows.append((op, mode.name, chosen or "-", _explain(skipped)))
    return rows
