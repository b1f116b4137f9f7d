"""Every environment variable kvfuse reads, typed and documented, in one place.

Nothing else in the package reads ``os.environ`` for a ``KVFUSE_*`` name. Values are parsed
once, on first use, into a frozen :class:`Settings`; :func:`settings` returns that snapshot.
Whoever changes a variable at run time (a test, a benchmark that forces a backend) calls
:func:`reload`, which also drops the kernel registry's cached decisions.

==============================  ==================================================================
``KVFUSE_BACKEND``              force one implementation for every op: ``native``, ``triton``,
                                ``flashinfer`` or ``reference`` (a forced one that cannot run raises)
``KVFUSE_CACHE_WRITE_BACKEND``  the same for the cache ops only (wins over ``KVFUSE_BACKEND``)
``KVFUSE_ATTENTION_BACKEND``    the same for ``paged_attention`` only (wins over ``KVFUSE_BACKEND``)
``KVFUSE_NATIVE``               ``0`` / ``false`` / ``no`` / ``off``: never build or use ``csrc/``
``KVFUSE_NATIVE_BUILD_DIR``     where native builds are cached (default ``~/.cache/kvfuse/native``)
``KVFUSE_NATIVE_MAX_TOKENS``    token count from which CUDA cache ops prefer Triton, every format
``KVFUSE_NATIVE_CUDA_FLAGS``    tuning only: extra nvcc flags (the build gets its own directory)
``KVFUSE_NATIVE_VERBOSE``       ``1`` / ``true`` / ``yes`` / ``on``: the native build prints its ninja and
                                compiler command lines (default off; a failed build raises with its log)
``KVFUSE_CHECK``                ``1`` / ``true`` / ``yes`` / ``on``: checked mode (see ``ops.checks``)
``KVFUSE_DUMP_DIR``             write the pass graphs and the fusion report of every compile there
``KVFUSE_FP8_PREFILL_DOTS``     ``0`` / ``false`` / ``no`` / ``off``: the prefill of an FP8 e4m3 cache attends in the
                                model dtype (the cache's exact values) instead of FP8 tensor-core dots,
                                whose e4m3-rounded query and probabilities cost accuracy (default on;
                                see ``ops.triton.prefill``)
``TRITON_INTERPRET``            Triton's own switch, read here so kernels know they are interpreted
==============================  ==================================================================
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["Settings", "settings", "reload", "BACKEND_NAMES"]

#: Implementations a ``*_BACKEND`` variable may name.
BACKEND_NAMES = ("reference", "triton", "native", "flashinfer")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    """The parsed environment (see the module docstring for what each field means)."""

    backend: Optional[str]
    cache_write_backend: Optional[str]
    attention_backend: Optional[str]
    native_enabled: bool
    native_build_dir: Path
    native_max_tokens: Optional[int]
    native_cuda_flags: tuple[str, ...]
    native_verbose: bool
    check: bool
    dump_dir: Optional[str]
    triton_interpret: bool
    fp8_prefill_dots: bool = True

    def forced_backend(self, family: str) -> Optional[str]:
        """The implementation forced for an op family (``"cache"`` or ``"attention"``), or None."""
        specific = self.cache_write_backend if family == "cache" else self.attention_backend
        return specific or self.backend


def _backend(environ, var: str) -> Optional[str]:
    value = environ.get(var, "").strip().lower()
    if not value:
        return None
    if value not in BACKEND_NAMES:
        raise ValueError(f"{var}={value!r} is not a kvfuse backend; valid: {', '.join(BACKEND_NAMES)}")
    return value


def _flag(environ, var: str, default: bool) -> bool:
    value = environ.get(var, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{var}={value!r} is not a boolean; use one of {', '.join(_TRUE + _FALSE)}")


def _positive_int(environ, var: str) -> Optional[int]:
    value = environ.get(var, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise ValueError(f"{var}={value!r} is not an integer token count (a positive integer)")
    return number


def _build_dir(environ) -> Path:
    root = environ.get("KVFUSE_NATIVE_BUILD_DIR")
    if root:
        return Path(root)
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvfuse" / "native"


def _parse(environ) -> Settings:
    return Settings(
        backend=_backend(environ, "KVFUSE_BACKEND"),
        cache_write_backend=_backend(environ, "KVFUSE_CACHE_WRITE_BACKEND"),
        attention_backend=_backend(environ, "KVFUSE_ATTENTION_BACKEND"),
        native_enabled=_flag(environ, "KVFUSE_NATIVE", True),
        native_build_dir=_build_dir(environ),
        native_max_tokens=_positive_int(environ, "KVFUSE_NATIVE_MAX_TOKENS"),
        native_cuda_flags=tuple(environ.get("KVFUSE_NATIVE_CUDA_FLAGS", "").split()),
        native_verbose=_flag(environ, "KVFUSE_NATIVE_VERBOSE", False),
        check=_flag(environ, "KVFUSE_CHECK", False),
        dump_dir=environ.get("KVFUSE_DUMP_DIR") or None,
        triton_interpret=environ.get("TRITON_INTERPRET", "0").strip() == "1",
        fp8_prefill_dots=_flag(environ, "KVFUSE_FP8_PREFILL_DOTS", True),
    )


_lock = threading.Lock()
_current: Optional[Settings] = None


def settings() -> Settings:
    """The settings, parsed from the environment on first use (raises ValueError on a bad value)."""
    current = _current
    if current is None:
        current = reload(_clear_registry=False)
    return current


def reload(_clear_registry: bool = True) -> Settings:
    """Parse the environment again and forget every kernel choice made under the old settings."""
    global _current
    with _lock:
        _current = _parse(os.environ)
        current = _current
    if _clear_registry:
        from .ops import registry

        registry.clear_cache(reload_settings=False)
    return current
