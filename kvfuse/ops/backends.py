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
    ("attention", "cuda"): ("flashinfer", "triton", "reference"),
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


@functools.lru_cache(maxsize=None)
def _select(op: str, device_type: str, mode: int, forced: Optional[str]) -> tuple[str, object]:
    if forced is not None:
        reason = unavailable_reason(forced, op, device_type, mode)
        if reason is not None:
            raise RuntimeError(f"backend {forced!r} was forced for {op} on {device_type} but {reason}")
        candidates = (forced,)
    else:
        candidates = _DEFAULT_ORDER.get((_family(op), device_type), ("reference",))
    skipped = []
    for name in candidates:
        reason = unavailable_reason(name, op, device_type, mode)
        if reason is None:
            module, _ = _load(name)
            logger.debug("%s on %s mode %d -> %s (skipped: %s)", op, device_type, mode, name, skipped)
            return name, getattr(module, op)
        skipped.append(f"{name}: {reason}")
    raise RuntimeError(f"no kvfuse backend can run {op} on {device_type}: {'; '.join(skipped)}")


def select(op: str, device_type: str, mode: int) -> tuple[str, object]:
    """(backend name, function) for ``op`` on ``device_type`` with cache mode ``mode``."""
    return _select(op, device_type, int(mode), forced_backend(op))


def clear_cache() -> None:
    """Forget cached decisions (after changing an override variable or installing a backend)."""
    _select.cache_clear()
