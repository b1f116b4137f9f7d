"""Native backend: the C++/CUDA kernels of ``csrc/``, built just in time on first use.

The first call that selects this backend (or :func:`build_info` with ``build=True``) compiles
``csrc/`` with :func:`torch.utils.cpp_extension.load` and loads the library, which declares the
``kvfuse_native::<op>`` ops and registers their CPU and CUDA kernels (each kernel file registers
its own). The functions here call those ops directly: one dispatcher hop from the public op's
body to C++. Importing this module compiles nothing and does not touch CUDA.

- One build per torch version / CUDA version / device architecture, in its own directory
  (``KVFUSE_NATIVE_BUILD_DIR``, :mod:`kvfuse.envs`), guarded by a file lock so
  concurrent processes build it once; later processes only load it.
- CUDA kernels are compiled for the current device only: ``-gencode=arch=compute_XY,code=sm_XY``,
  ``sm_90a`` on Hopper. Without ``nvcc`` (or a CUDA device) the library is built for CPU only and
  CUDA calls fall back (Triton, then the reference); without a C++ compiler or ninja nothing is
  built and every call falls back. The reason is logged once and returned by
  :func:`unavailable_reason`, so ``backends.select`` skips this backend with it.
- ``KVFUSE_NATIVE=0`` disables the backend entirely (no build is attempted).
- ``KVFUSE_NATIVE_CUDA_FLAGS`` (tuning only): extra nvcc flags, e.g. ``-DKVFUSE_FP8_UNITS=4`` to
  override a launch constant of ``csrc/cuda/cache_write.cu``; such a build gets its own directory
  (``benchmarks/native_sweep.py`` uses this).

Functions :func:`encode_kv`, :func:`cache_write` and :func:`encode_and_cache_write` take the
argument lists of :mod:`kvfuse.ops.reference`; arguments are validated by the op layer before
they get here (the C++ side re-checks only what memory safety needs).

:func:`paged_attention` (CUDA; FP8, per-token-head FP8 and NVFP4 caches) runs ``csrc/cuda/decode_attention.cu``, a
decode kernel that decodes the cache bytes straight into warp-level tensor-core fragments. It
takes decode-shaped calls (at most :data:`DECODE_TOKENS_PER_SEQUENCE` query tokens per sequence,
on average) that it supports (:func:`decode_refusal`); the others run Triton's kernel, which
covers every call. With the native backend forced (``KVFUSE_ATTENTION_BACKEND=native``) every
call it supports runs natively, prefill-shaped ones included, and the rest raise.

:func:`prefill_attention` (CUDA, sm_90 only) runs ``csrc/cuda/prefill_attention.cu``, a
warp-specialised prefill kernel (tensor-map copies and ``wgmma``, FlashAttention-3's layout of
one producer and two consumer warpgroups), on prefill-shaped calls with head size 128 over
bf16 / fp16, FP8 e4m3 / e5m2 and NVFP4 caches (:func:`prefill_refusal` says which):
:func:`paged_attention` sends it every call it accepts, before the decode kernel's turn.

:func:`rope_encode_and_cache_write` (CUDA; FP8, NVFP4 and bf16 / fp16 caches of the key's dtype)
rotates each key unit (16 elements; 8 in small FP8 and 16-bit launches) inside the fused write
kernel of ``csrc/cuda/cache_write.cu`` (one more launch rotates the query, when there is one), bit
for bit the reference's arithmetic; NeoX units take their rotation partner from the partner's lane
by warp shuffle where a head's units share a warp. It runs the calls that :mod:`kvfuse.ops.tuning`
measured faster on it than on Triton's kernel (on sm90: without a query, bf16 / fp16 and NVFP4
caches at every size and FP8 e4m3 from 16 tokens on; with one, FP8 e4m3 and NVFP4 writes of 16384
tokens and more) and :func:`rope_refusal` accepts (bf16/fp16 inputs, 16-byte aligned rows, head
sizes and rotary widths that keep a unit and its rotation partners together); the other calls run
Triton's kernel. With the native cache backend forced it runs every call it accepts and raises
for the rest.

FP8_PER_TOKEN_HEAD caches are written by ``csrc/cuda/per_token_head_write.cu`` (CUDA, fused write
only; layouts it does not take go to Triton's kernel, see :func:`per_token_head_write_refusal`).

NVFP4 caches are written in the page layout of :func:`kvfuse.kv_cache.nvfp4_page_index`
(``csrc/nvfp4_page.h`` restates it): both cache ops split each encoded row over its page's data
and block-scale regions, while ``encode_kv`` returns dense ``[data | scales]`` rows. An NVFP4
cache that is not contiguous within a page is refused: by the CPU kernels' checks, and on CUDA by
the eager router's pre-check, which hands the call to the Python body to word the refusal.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from .. import envs
from ..kv_cache import KVFormat, KVQuantMode
from .registry import ALL_MODES, CACHE_OPS, ROPE_OPS, AttentionCall, Implementation, Situation

logger = logging.getLogger(__name__)

__all__ = [
    "paged_attention",
    "decode_refusal",
    "prefill_attention",
    "prefill_refusal",
    "encode_kv",
    "cache_write",
    "encode_and_cache_write",
    "rope_encode_and_cache_write",
    "rope_refusal",
    "unavailable_reason",
    "build_info",
    "mode_values",
    "IMPLEMENTATION",
]

_CPU_SOURCES = ("registration.cpp", "cpu/cache_write.cpp")
_CUDA_SOURCES = ("cuda/cache_write.cu", "cuda/decode_attention.cu", "cuda/per_token_head_write.cu",
                 "cuda/prefill_attention.cu")
# Numerics depend on IEEE division and no flush-to-zero: say so explicitly instead of relying
# on nvcc's defaults.
_NVCC_FLAGS = ("-O3", "--prec-div=true", "--ftz=false")

_lock = threading.Lock()
_state: dict[str, Any] = {}  # filled once by _ensure_built
_ops: dict[str, Any] = {}  # op name -> torch.ops.kvfuse_native.<op>.default, after a successful build


def _disabled() -> bool:
    return not envs.settings().native_enabled


def _csrc_dir() -> Optional[Path]:
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "csrc", here.parents[1] / "csrc"):  # checkout, installed package
        if (candidate / "registration.cpp").is_file():
            return candidate
    return None


def _build_root() -> Path:
    return envs.settings().native_build_dir


def nvcc_path() -> Optional[str]:
    """The nvcc the native build compiles with (``CUDA_HOME``'s, else the one on ``PATH``), or None."""
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    return nvcc if nvcc and os.path.exists(nvcc) else None


def _cuda_target() -> tuple[Optional[str], Optional[str]]:
    """(the -gencode flag for the current device, None), or (None, why CUDA kernels are not built)."""
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return None, "no CUDA device is visible"
    if nvcc_path() is None:
        return None, "nvcc was not found (install the CUDA toolkit or set CUDA_HOME)"
    major, minor = torch.cuda.get_device_capability()
    # Hopper gets its arch-specific target; plain sm_XY elsewhere.
    arch = f"{major}{minor}{'a' if major == 9 else ''}"
    return f"-gencode=arch=compute_{arch},code=sm_{arch}", None


def _extra_cuda_flags() -> list[str]:
    return list(envs.settings().native_cuda_flags)


def _tag(gencode: Optional[str]) -> str:
    parts = [f"torch{torch.__version__}"]
    if gencode is None:
        parts.append("cpu")
    else:
        parts += [f"cu{torch.version.cuda}", "sm" + gencode.rsplit("_", 1)[-1]]
        extra = _extra_cuda_flags()
        if extra:  # a tuning build never shares (or clobbers) the default build's directory
            parts.append("x" + hashlib.sha1(" ".join(extra).encode()).hexdigest()[:10])
    return re.sub(r"[^A-Za-z0-9]+", "_", "_".join(parts)).strip("_")


def _loaded_libstdcxx() -> Optional[str]:
    """The shared libstdc++ this process runs on (torch loads it), or None where it cannot be told.

    Linking the extension against it by path keeps the C++ runtime single: a compiler whose own
    library directory holds only a static libstdc++ (as the GPU hosts' /opt/gcc wrapper does:
    BENCHMARKS.md) otherwise links a second copy into the extension, and every exception the
    kernels throw (each refusal) then kills the process instead of raising ValueError."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libstdc++.so" in path and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return None


def _clear_stale_baton(build_dir: Path) -> None:
    """Removes the ``lock`` file torch's ``cpp_extension.load`` leaves in ``build_dir`` when a build
    is killed (Ctrl-C, an OOM kill): torch takes that file's existence to mean "another process is
    building" and waits on it forever, so every later import would hang. Called only under
    ``_compile``'s file lock, which the OS releases when its holder dies and which every kvfuse
    build of ``build_dir`` takes, so a baton found then has no live owner."""
    baton = build_dir / "lock"
    if baton.exists():
        logger.warning("removing %s, left by a native build that did not finish", baton)
        baton.unlink(missing_ok=True)


def _compile(csrc: Path, gencode: Optional[str]) -> tuple[str, Path]:
    from filelock import FileLock
    from torch.utils import cpp_extension

    name = f"kvfuse_native_{_tag(gencode)}"
    build_dir = _build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(csrc / s) for s in _CPU_SOURCES]
    cflags = ["-O3"]
    cuda_flags: list[str] = []
    if gencode is not None:
        sources += [str(csrc / s) for s in _CUDA_SOURCES]
        cflags.append("-DKVFUSE_WITH_CUDA")
        cuda_flags = ["-DKVFUSE_WITH_CUDA", gencode, *_NVCC_FLAGS, *_extra_cuda_flags()]
    with FileLock(str(build_dir) + ".lock"):
        _clear_stale_baton(build_dir)
        library = cpp_extension.load(
            name=name,
            sources=sources,
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_flags,
            extra_ldflags=[lib for lib in (_loaded_libstdcxx(),) if lib],
            extra_include_paths=[str(csrc)],
            build_directory=str(build_dir),
            with_cuda=gencode is not None,
            is_python_module=False,
            # ninja's command lines are no use to a user (a failed build raises with its log);
            # whoever debugs the build asks for them explicitly.
            verbose=envs.settings().native_verbose,
        )
    return str(library), build_dir


def _ensure_built() -> dict[str, Any]:
    if _state:
        return _state
    with _lock:
        if _state:
            return _state
        state: dict[str, Any] = {"library": None, "build_dir": None, "cuda": False, "gencode": None,
                                 "error": None, "cuda_error": None, "seconds": None}
        csrc = _csrc_dir()
        if csrc is None:
            state["error"] = "the csrc/ sources are not shipped with this installation"
        else:
            gencode, state["cuda_error"] = _cuda_target()
            logger.info("building kvfuse's native kernels for %s (first use; about 20 s, cached afterwards)",
                        "CPU and CUDA" if gencode else "CPU")
            start = time.perf_counter()
            attempts = [gencode, None] if gencode is not None else [None]
            for target in attempts:
                try:
                    state["library"], state["build_dir"] = _compile(csrc, target)
                except Exception as e:  # no compiler, no ninja, a failed build: fall back, don't crash
                    message = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
                    if target is not None:
                        state["cuda_error"] = f"building the CUDA kernels failed ({message})"
                        logger.warning("kvfuse native CUDA kernels unavailable, trying a CPU-only build: %s",
                                       state["cuda_error"])
                        continue
                    hint = "" if shutil.which("ninja") else "; ninja is missing (pip install ninja)"
                    state["error"] = f"building csrc/ failed ({message}{hint})"
                    break
                state["cuda"] = target is not None
                state["gencode"] = target
                break
            state["seconds"] = round(time.perf_counter() - start, 1)
        if state["library"] is not None:
            for op in CACHE_OPS:
                _ops[op] = getattr(torch.ops.kvfuse_native, op).default
            logger.info("kvfuse native kernels loaded from %s (%s, %.1f s)", state["library"],
                        "CPU+CUDA " + state["gencode"] if state["cuda"] else "CPU only", state["seconds"])
        else:
            logger.warning("kvfuse native kernels unavailable: %s; falling back to other backends", state["error"])
        _state.update(state)
        return _state


def unavailable_reason(op: str, device_type: str, mode: int) -> Optional[str]:
    """None if the native backend can run ``op`` on ``device_type``; else why not (may build first)."""
    if _disabled():
        return "it is disabled by KVFUSE_NATIVE=0"
    if mode == KVQuantMode.FP8_PER_TOKEN_HEAD:
        if op not in _PER_TOKEN_HEAD_OPS:
            return (f"it implements FP8_PER_TOKEN_HEAD for {', '.join(sorted(_PER_TOKEN_HEAD_OPS))} only, "
                    f"not for {op}")
        if device_type != "cuda":
            return f"its FP8_PER_TOKEN_HEAD kernels run on CUDA, not on {device_type}"
    if op in ROPE_OPS:
        if device_type != "cuda":
            return f"its rotary write kernel runs on CUDA, not on {device_type}"
        if mode not in _ROPE_MODES:
            return (f"its rotary write takes {', '.join(m.name for m in sorted(_ROPE_MODES))} caches, "
                    f"not {KVQuantMode(mode).name}")
    if op == "paged_attention":
        if device_type != "cuda":
            return f"its attention kernel runs on CUDA, not on {device_type}"
        modes = _ATTENTION_MODES | _PREFILL_MODES
        if mode not in modes:
            return (f"its attention kernels read {', '.join(m.name for m in sorted(modes))} caches, "
                    f"not {KVQuantMode(mode).name}")
    state = _ensure_built()
    if state["library"] is None:
        return state["error"]
    if device_type == "cuda" and not state["cuda"]:
        return f"its CUDA kernels were not built: {state['cuda_error']}"
    return None


def _require(op: str) -> Any:
    fn = _ops.get(op)
    if fn is None:
        state = _ensure_built()
        if state["library"] is None:
            raise RuntimeError(f"kvfuse native kernels are unavailable: {state['error']}")
        fn = _ops[op]
    return fn


def encode_kv(x: torch.Tensor, scale: torch.Tensor, kv_quant_mode: int, cache_dtype: torch.dtype) -> torch.Tensor:
    """:func:`kvfuse.ops.reference.encode_kv`, natively."""
    return _require("encode_kv")(x, scale, int(kv_quant_mode), cache_dtype)


def cache_write(key_rows: torch.Tensor, value_rows: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor, kv_quant_mode: Optional[int] = None) -> None:
    """:func:`kvfuse.ops.reference.cache_write`, natively (out-of-range slots: CPU raises, CUDA skips).
    ``kv_quant_mode`` is not passed on: the kernels take uint8 caches for NVFP4 pages, and this backend
    is never chosen for the other uint8 format (FP8_PER_TOKEN_HEAD, see ``IMPLEMENTATION``)."""
    _require("cache_write")(key_rows, value_rows, kv_cache, slot_mapping)


def encode_and_cache_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                           kv_quant_mode: int) -> None:
    """:func:`kvfuse.ops.reference.encode_and_cache_write`, natively, in one pass over memory.

    FP8_PER_TOKEN_HEAD (CUDA) takes its own kernel, for the layouts :func:`per_token_head_write_refusal`
    accepts; other calls go to Triton's kernel, or raise when the native backend is forced."""
    if kv_quant_mode == KVQuantMode.FP8_PER_TOKEN_HEAD:
        reason = per_token_head_write_refusal(key, value, kv_cache, slot_mapping)
        if reason is not None:
            if key.device.type != "cuda" or envs.settings().forced_backend("cache") == "native":
                raise ValueError(f"the native FP8_PER_TOKEN_HEAD write cannot run this call: {reason}")
            from .triton.kv_write import encode_and_cache_write as triton_write

            return triton_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_quant_mode)
        fn = _ops.get("fp8_per_token_head_cache_write")
        if fn is None:
            _require("encode_kv")
            fn = _ops["fp8_per_token_head_cache_write"] = torch.ops.kvfuse_native.fp8_per_token_head_cache_write.default
        return fn(key, value, kv_cache, slot_mapping)
    _require("encode_and_cache_write")(key, value, kv_cache, slot_mapping, k_scale, v_scale, int(kv_quant_mode))


# ----------------------------------------------------------------------------- rotary write

#: The cache modes of the native rotary write (bf16 caches keep Triton's kernel, within 1.1x of
#: the write alone in BENCHMARKS.md).
#: The caches the native rotary write takes; NONE: a cache of the key's own dtype (bf16 / fp16).
_ROPE_MODES = frozenset({KVQuantMode.NONE, KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2, KVQuantMode.NVFP4})
#: Elements per unit of the native rotary write (``kRopeUnit`` in csrc/cuda/cache_write.cu; the
#: 8-element units of its small FP8 launches divide it, so its preconditions are the 16's).
_ROPE_UNIT = 16


def _rows_aligned16(x: torch.Tensor) -> bool:
    es = x.element_size()
    return x.data_ptr() % 16 == 0 and (x.stride(0) * es) % 16 == 0 and (x.stride(1) * es) % 16 == 0


def rope_refusal(query: Optional[torch.Tensor], key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, positions: Optional[torch.Tensor], rotary_dim: int,
                 is_neox: bool, kv_quant_mode: int) -> Optional[str]:
    """None if the native rotary write takes this (already validated) call; else why not.
    Restates the checks of ``rope_encode_and_cache_write_cuda`` (csrc/cuda/cache_write.cu)."""
    mode = KVFormat.of(kv_quant_mode).narrowed
    if mode not in _ROPE_MODES:
        return f"kv_quant_mode={getattr(mode, 'name', mode)}: it writes FP8, NVFP4 and unquantized 16-bit caches"
    if key.dtype not in (torch.bfloat16, torch.float16):
        return f"key dtype {key.dtype}: it takes bfloat16 or float16 keys"
    if mode is KVQuantMode.NONE and kv_cache.dtype != key.dtype:
        return f"kv_cache dtype {kv_cache.dtype}: an unquantized cache must hold the key's dtype {key.dtype}"
    num_tokens, num_heads, head_size = key.shape
    if head_size % _ROPE_UNIT:
        return f"head_size={head_size}: it rotates units of {_ROPE_UNIT} elements"
    step = 2 * _ROPE_UNIT if is_neox else _ROPE_UNIT
    if rotary_dim % step:
        return (f"rotary_dim={rotary_dim} with {'NeoX' if is_neox else 'GPT-J'} pairs: it takes multiples of {step} "
                f"(a unit and its partners in one unit{' pair' if is_neox else ''})")
    if num_tokens >= 2 ** 31 or num_heads * head_size >= 2 ** 30:
        return f"key {tuple(key.shape)}: too large for its 32-bit unit indices"
    if not (_rows_aligned16(key) and _rows_aligned16(value)):
        return f"key/value strides {tuple(key.stride())} / {tuple(value.stride())}: rows must start 16-byte aligned"
    if cos.dtype not in (torch.float32, key.dtype):
        return f"cos/sin dtype {cos.dtype}: it reads float32 tables or tables in the key's dtype {key.dtype}"
    for name, table in (("cos", cos), ("sin", sin)):
        if table.data_ptr() % 16 or (table.stride(0) * table.element_size()) % 16:
            return f"{name} strides {tuple(table.stride())} / address: table rows must start 16-byte aligned"
    if positions is not None and not positions.is_contiguous():
        return "positions is not contiguous"
    if query is not None:
        if not _rows_aligned16(query):
            return f"query strides {tuple(query.stride())} / address: rows must start 16-byte aligned"
        if query.shape[0] * query.shape[1] * (head_size // _ROPE_UNIT) >= 2 ** 31:
            return f"query {tuple(query.shape)}: too many units for 32-bit indices"
    if mode is not KVQuantMode.NVFP4 and (kv_cache.data_ptr() % 16 or
                                           any(st * kv_cache.element_size() % 16 for st in kv_cache.stride()[:4])):
        return f"kv_cache strides {tuple(kv_cache.stride())}: FP8 and 16-bit rows must start 16-byte aligned"
    # Last, so that every other condition can be tested without a GPU.
    if key.device.type != "cuda":
        return f"key is on {key.device.type}: it runs on CUDA"
    return None


def rope_encode_and_cache_write(query: Optional[torch.Tensor], key: torch.Tensor, value: torch.Tensor,
                                kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
                                v_scale: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                positions: Optional[torch.Tensor], rotary_dim: int, is_neox: bool,
                                kv_quant_mode: int, *, force: bool = False) -> torch.Tensor:
    """:func:`kvfuse.ops.reference.rope_encode_and_cache_write` natively (CUDA), for the calls
    :func:`rope_refusal` accepts and the device's measured policy gives to this kernel
    (:meth:`kvfuse.ops.tuning.RopeWritePolicy.native`); other calls run Triton's kernel. With the
    native cache backend forced, or ``force`` (tests, benchmarks), every call it accepts runs here
    and the others raise ValueError. Returns the rotated query (contiguous), or an empty tensor."""
    from . import tuning

    force = force or envs.settings().forced_backend("cache") == "native"
    # The policy first: it is cheaper than the refusal's checks, and most calls go to Triton.
    wanted = force or tuning.rope_write_policy(key.device).native(KVFormat.of(kv_quant_mode).narrowed, key.shape[0],
                                                                  query is not None)
    reason = rope_refusal(query, key, value, kv_cache, cos, sin, positions, rotary_dim, is_neox,
                          kv_quant_mode) if wanted else None
    if reason is not None and force:
        raise ValueError(f"the native rotary write was forced but cannot run this call: {reason}")
    if not wanted or reason is not None:
        from .triton.rope_kv_write import rope_encode_and_cache_write as triton_rope_write

        return triton_rope_write(query, key, value, kv_cache, slot_mapping, k_scale, v_scale, cos, sin, positions,
                                 rotary_dim, is_neox, kv_quant_mode)
    fn = _ops.get("rope_encode_and_cache_write")
    if fn is None:
        _require("encode_kv")
        fn = _ops["rope_encode_and_cache_write"] = torch.ops.kvfuse_native.rope_encode_and_cache_write.default
    return fn(query, key, value, kv_cache, slot_mapping, k_scale, v_scale, cos, sin, positions, int(rotary_dim),
              bool(is_neox), int(kv_quant_mode))


#: The ops that csrc/ implements for FP8_PER_TOKEN_HEAD caches, on CUDA.
_PER_TOKEN_HEAD_OPS = frozenset({"encode_and_cache_write", "paged_attention"})
#: The per-token-head write kernel's lanes take 8 inputs each (16 where head_size % 16 == 0), at most 32 lanes
#: of 8 per row.
_PER_TOKEN_HEAD_MAX_HEAD_SIZE = 256


def per_token_head_write_refusal(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor) -> Optional[str]:
    """None if the FP8_PER_TOKEN_HEAD write kernel takes this (already validated) call; else why not."""
    if key.device.type != "cuda":
        return f"key is on {key.device.type}: it runs on CUDA"
    if key.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"key dtype {key.dtype}: it takes bfloat16, float16 or float32 inputs"
    head_size = key.shape[2]
    if head_size % 8 or head_size > _PER_TOKEN_HEAD_MAX_HEAD_SIZE:
        return f"head_size={head_size}: it takes multiples of 8 up to {_PER_TOKEN_HEAD_MAX_HEAD_SIZE}"
    if key.shape[0] * key.shape[1] >= 2 ** 32 or kv_cache.shape[0] * kv_cache.shape[2] >= 2 ** 31:
        return (f"{key.shape[0]} tokens, {key.shape[1]} heads, {kv_cache.shape[0] * kv_cache.shape[2]} cache slots: "
                f"it takes fewer than 2^32 (token, head) rows and 2^31 slots")
    if key.stride() != value.stride():
        return f"key strides {tuple(key.stride())} differ from value strides {tuple(value.stride())}"
    if key.stride(2) != 1 or not (_rows_aligned16(key) and _rows_aligned16(value)):
        return f"key/value strides {tuple(key.stride())} / addresses: its input rows must start 16-byte aligned"
    if any(st % 4 for st in kv_cache.stride()[:4]) or kv_cache.data_ptr() % 4:
        return f"kv_cache strides {tuple(kv_cache.stride())}: its rows must start 4-byte aligned"
    if not slot_mapping.is_contiguous():
        return "slot_mapping is not contiguous"
    return None


# ----------------------------------------------------------------------------- decode attention

_ATTENTION_MODES = frozenset({KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2, KVQuantMode.NVFP4,
                              KVQuantMode.FP8_PER_TOKEN_HEAD})
_ATTENTION_HEAD_SIZES = (64, 128, 256)
#: Calls with more query tokens than this per sequence (on average) are prefill-shaped: Triton's
#: kernel takes them unless the native backend is forced (the native kernel re-reads the keys
#: for every few query tokens).
DECODE_TOKENS_PER_SEQUENCE = 4
# Split-KV: blocks of 4 warps per SM the launch aims for when the batch alone does not fill the
# GPU (the kernel is built for 4 resident blocks per SM), and the most splits. Blocks of several
# KV heads (decode_heads_per_block: 4 per-token-head, 2 NVFP4) aim for 2: their split sweeps in
# BENCHMARKS.md (NVFP4 pairs aiming for 4 measured 2% slower at B64 in the eighteenth session).
_BLOCKS_PER_SM = 4
_GROUPED_BLOCKS_PER_SM = 2
_MAX_SPLITS = 32


def decode_refusal(call: AttentionCall, prefill_shaped_ok: bool = False) -> Optional[str]:
    """None if the native decode kernel can run ``call``; else why not, as a sentence.

    ``prefill_shaped_ok``: do not refuse a call for having more than
    :data:`DECODE_TOKENS_PER_SEQUENCE` query tokens per sequence (the kernel is correct for any
    query length, only not built for long ones)."""
    query, kv_cache = call.query, call.kv_cache
    fmt = KVFormat.of(call.kv_quant_mode)
    if fmt.is_mixed:
        return f"kv_quant_mode={fmt.name}: K and V in different formats take the Triton kernel"
    mode = fmt.key
    if mode not in _ATTENTION_MODES:
        return f"kv_quant_mode={mode.name}: it reads FP8_E4M3, FP8_E5M2, FP8_PER_TOKEN_HEAD and NVFP4 caches"
    if query.device.type != "cuda":
        return f"query is on {query.device.type}: it runs on CUDA"
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"query dtype {query.dtype}: it takes bfloat16 or float16 queries"
    num_tokens, num_q_heads, head_size = query.shape
    if head_size not in _ATTENTION_HEAD_SIZES:
        return f"head_size={head_size}: it is built for head sizes {_ATTENTION_HEAD_SIZES}"
    group = num_q_heads // kv_cache.shape[3]
    if group > 16:
        return f"{group} query heads per KV head: it takes at most 16"
    num_seqs = call.block_table.shape[0]
    if not prefill_shaped_ok and num_tokens > DECODE_TOKENS_PER_SEQUENCE * max(num_seqs, 1):
        return (f"{num_tokens} query tokens for {num_seqs} sequences: more than {DECODE_TOKENS_PER_SEQUENCE} per "
                f"sequence is prefill")
    if query.data_ptr() % 16 or query.stride(0) % 8 or query.stride(1) % 8:
        return f"query strides {tuple(query.stride())} / address: its rows must start 16-byte aligned"
    if kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 16 or kv_cache.stride(1) % 16:
        return f"kv_cache strides {tuple(kv_cache.stride())} / address: its pages must start 16-byte aligned"
    if mode is KVQuantMode.FP8_PER_TOKEN_HEAD:
        if kv_cache.stride(2) % 4 or kv_cache.stride(3) % 4 or (kv_cache.shape[2] * kv_cache.stride(2)) % 16:
            return (f"kv_cache strides {tuple(kv_cache.stride())}: FP8_PER_TOKEN_HEAD rows must start 4-byte "
                    f"aligned, in page sides of a multiple of 16 bytes")
    elif mode is not KVQuantMode.NVFP4 and (kv_cache.stride(2) % 16 or kv_cache.stride(3) % 16):
        return f"kv_cache strides {tuple(kv_cache.stride())}: FP8 rows must start 16-byte aligned"
    return None


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_heads_per_block(call: AttentionCall) -> int:
    """KV heads per block of the decode kernel: 4 for a per-token-head cache whose 4 heads' rows of a
    slot are one 16-byte aligned run (heads % 4 == 0, rows back to back), where the block stages those
    runs together; 2 for an NVFP4 cache with an even number of heads (two or four warps per head,
    both heads on the same chunks); else 1. Restates ``launch_groups`` in csrc/cuda/decode_attention.cu."""
    kv_cache = call.kv_cache
    num_kv_heads, row = kv_cache.shape[3], kv_cache.shape[4]
    key = KVFormat.of(call.kv_quant_mode).key
    if (key is KVQuantMode.FP8_PER_TOKEN_HEAD and num_kv_heads % 4 == 0
            and kv_cache.stride(3) == row and kv_cache.stride(2) == num_kv_heads * row):
        return 4
    if key is KVQuantMode.NVFP4 and num_kv_heads % 2 == 0:
        return 2
    return 1


def _num_splits(num_seqs: int, blocks_per_seq: int, device: torch.device, blocks_per_sm: int = _BLOCKS_PER_SM) -> int:
    blocks = max(1, num_seqs * blocks_per_seq)
    target = blocks_per_sm * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    # Whole waves: more blocks than fit at once would leave a partial second wave.
    return 1 if blocks >= target // 2 else min(_MAX_SPLITS, target // blocks)


def paged_attention(call: AttentionCall, *, num_splits: Optional[int] = None) -> torch.Tensor:
    """:func:`kvfuse.ops.reference.paged_attention` by the native prefill kernel or the native
    decode kernel, for the calls they take (see the module docstring); ``num_splits`` overrides the
    decode kernel's split-KV count (tests, benchmarks). Rows whose sequence has no allowed key are
    zeros, as in the Triton kernel, also those of a sequence with fewer cached positions than new
    tokens (metadata that checked mode refuses)."""
    forced = envs.settings().forced_backend("attention") == "native"
    if num_splits is None and prefill_refusal(call) is None:
        return prefill_attention(call)
    reason = decode_refusal(call, prefill_shaped_ok=forced)
    if reason is not None:
        if forced:
            raise ValueError(f"the native attention backend was forced but cannot run this call: {reason}")
        from .triton.attention import paged_attention as triton_attention

        return triton_attention(call)
    fn = _ops.get("paged_decode_attention")
    if fn is None:
        _require("encode_kv")
        fn = _ops["paged_decode_attention"] = torch.ops.kvfuse_native.paged_decode_attention.default
    if num_splits is None:
        heads_per_block = decode_heads_per_block(call)
        blocks_per_sm = _BLOCKS_PER_SM if heads_per_block == 1 else _GROUPED_BLOCKS_PER_SM
        num_splits = _num_splits(call.block_table.shape[0], call.kv_cache.shape[3] // heads_per_block,
                                 call.query.device, blocks_per_sm)
    return fn(call.query, call.kv_cache, call.k_scale, call.v_scale, call.block_table, call.seq_lens,
              call.query_start_loc, call.sinks, KVFormat.of(call.kv_quant_mode).code, float(call.sm_scale),
              int(call.sliding_window or 0), float(call.logit_softcap), int(num_splits))


# ----------------------------------------------------------------------------- prefill attention

#: The caches csrc/cuda/prefill_attention.cu attends to: bf16 / fp16 (the step's K/V and the
#: gathered prefix), FP8 e4m3 (the whole context gathered as codes, FP8 tensor-core products),
#: and FP8 e5m2 / NVFP4 (the whole context gathered and decoded into the query's dtype).
_PREFILL_MODES = frozenset({KVQuantMode.NONE, KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2, KVQuantMode.NVFP4})
#: The one head size the prefill kernel is built for.
PREFILL_HEAD_SIZE = 128


def _rows_described(t: torch.Tensor) -> bool:
    """Whether a tensor map can describe ``t`` ([rows, heads, head_size] with contiguous heads)."""
    return (t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
            and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0)


def prefill_refusal(call: AttentionCall) -> Optional[str]:
    """None if the native prefill kernel (``csrc/cuda/prefill_attention.cu``) runs ``call``; else why
    not, as a sentence. It takes prefill-shaped calls (more than :data:`DECODE_TOKENS_PER_SEQUENCE`
    query tokens per sequence) on sm_90 with head size 128, bf16 / fp16 queries, no sliding window
    or soft-cap, over a bf16 / fp16 cache whose step K/V the call carries, or an FP8 e4m3 / e5m2 /
    NVFP4 cache (one mode for K and V), where the dense gather of the context fits
    :data:`kvfuse.ops.triton.prefill.WHOLE_CONTEXT_MAX_BYTES`."""
    from .triton import prefill as triton_prefill

    query, kv_cache = call.query, call.kv_cache
    # First: every decode call of the native backend passes here before its own kernel.
    num_tokens, num_seqs = query.shape[0], call.block_table.shape[0]
    if num_tokens <= DECODE_TOKENS_PER_SEQUENCE * max(num_seqs, 1):
        return f"{num_tokens} query tokens for {num_seqs} sequences: decode-shaped"
    fmt = KVFormat.of(call.kv_quant_mode)
    if fmt.is_mixed or fmt.key not in _PREFILL_MODES:
        return f"kv_quant_mode={fmt.name}: it reads NONE, FP8_E4M3, FP8_E5M2 and NVFP4 caches"
    mode = fmt.key
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"query dtype {query.dtype}: it takes bfloat16 or float16 queries"
    head_size = query.shape[2]
    if head_size != PREFILL_HEAD_SIZE:
        return f"head_size={head_size}: it is built for head size {PREFILL_HEAD_SIZE}"
    if call.sliding_window is not None:
        return f"sliding_window={call.sliding_window}: it attends to whole contexts"
    if float(call.logit_softcap) > 0:
        return f"logit_softcap={call.logit_softcap}: it has no soft-cap"
    if not _rows_described(query):
        return f"query strides {tuple(query.stride())} / address: rows must start 16-byte aligned, heads contiguous"
    if mode is KVQuantMode.FP8_E4M3 and not envs.settings().fp8_prefill_dots:
        return "KVFUSE_FP8_PREFILL_DOTS=0: e4m3 prefill in the model dtype takes the Triton kernel"
    if mode is KVQuantMode.NONE:
        if call.key is None or call.value is None:
            return "a bf16 / fp16 cache's call without the step's key / value"
        if kv_cache.dtype != query.dtype:
            return f"kv_cache dtype {kv_cache.dtype} differs from the query's {query.dtype}"
        for name, t in (("key", call.key), ("value", call.value)):
            if t.dtype != query.dtype or not _rows_described(t):
                return f"{name} {t.dtype} strides {tuple(t.stride())}: rows of the query's dtype, 16-byte aligned"
    context_bytes = triton_prefill.context_bytes(call, mode is KVQuantMode.FP8_E4M3)
    if context_bytes > triton_prefill.WHOLE_CONTEXT_MAX_BYTES:
        return f"the dense context of {context_bytes} bytes exceeds {triton_prefill.WHOLE_CONTEXT_MAX_BYTES}"
    if query.device.type != "cuda":
        return f"query is on {query.device.type}: it runs on CUDA"
    from . import tuning

    arch = tuning.device_arch(query.device)
    if arch != "sm90":
        return f"device {arch}: it is built for sm_90 (Hopper)"
    return None


def prefill_attention(call: AttentionCall, grid_order: Optional[str] = None) -> torch.Tensor:
    """The native prefill kernel on ``call`` (:func:`prefill_refusal` must accept it): the cached
    context gathered densely first (:func:`kvfuse.ops.triton.prefill.gather_context`: a bf16 /
    fp16 cache's prefix, the step's K/V being the new keys; an e4m3 cache's whole context as codes,
    values transposed in :func:`~kvfuse.ops.triton.prefill.permuted_value_column`'s order; an e5m2
    / NVFP4 cache's whole context, decoded). ``grid_order`` (``heads`` / ``tiles``): the order
    blocks are launched in; default by the new K/V's size (in the query's dtype) against the L2
    (:func:`kvfuse.ops.triton.prefill.device_grid_order`)."""
    from .triton import prefill as triton_prefill

    fn = _ops.get("prefill_attention")
    if fn is None:
        _require("encode_kv")
        fn = _ops["prefill_attention"] = torch.ops.kvfuse_native.prefill_attention.default
    query = call.query
    mode = KVFormat.of(call.kv_quant_mode).key
    num_kv_heads = call.kv_cache.shape[3]
    if mode is KVQuantMode.NONE:
        context_key, context_value, stride = triton_prefill.gather_context(call, False, prefix_only=True)
        key, value, new_in_context, factor = call.key, call.value, False, 1.0
    else:
        codes = mode is KVQuantMode.FP8_E4M3
        context_key, context_value, stride = triton_prefill.gather_context(call, codes, permute_values=codes)
        key, value, new_in_context = context_key, context_value, True
        factor = triton_prefill._GATHERED_FACTOR[mode]
    if grid_order is None:
        grid_order = triton_prefill.device_grid_order(query, query.element_size(), num_kv_heads)
    if grid_order not in ("heads", "tiles"):
        raise ValueError(f"grid_order={grid_order!r}: expected 'heads' or 'tiles'")
    return fn(query, key, value, context_key, context_value, stride, new_in_context, call.seq_lens,
              call.query_start_loc, call.sinks, call.k_scale.float(), call.v_scale.float(),
              mode is not KVQuantMode.NONE, float(call.sm_scale), float(factor), grid_order == "heads")


# ----------------------------------------------------------------------------- eager routing on CUDA
# See csrc/cuda/cache_write.cu ("eager routing"). None: not decided since the last reset.
_routing: dict[str, Any] = {"decided": False}


def cuda_routing_decided() -> bool:
    return _routing["decided"]


def reset_cuda_routing() -> None:
    """Send every CUDA call of the fused write to the Python body until the next decision
    (called when settings reload, a backend is forced or checked mode opens)."""
    _routing["decided"] = False
    if _state.get("cuda"):
        torch.ops.kvfuse_native.pause_cuda_routing()


def route_cuda_calls() -> bool:
    """Let the C++ router run the fused write's CUDA calls that the registry gives to this backend.

    Decided once per settings (and after each checked-mode block): nothing is routed while
    checked mode is on anywhere, or when another backend is forced; a forced native backend
    routes every call. Returns whether the router is active.
    """
    from . import checks, library, registry, tuning

    _routing["decided"] = True
    settings = envs.settings()
    forced = settings.forced_backend("cache")
    if (settings.check or checks.open_blocks() or (forced not in (None, "native"))
            or unavailable_reason("encode_and_cache_write", "cuda", 0) is not None):
        if _state.get("cuda"):
            torch.ops.kvfuse_native.pause_cuda_routing()
        return False
    policy = tuning.cuda_cache_write_policy()
    max_tokens, python_when_captured = [], []
    for mode in KVQuantMode:
        if mode is KVQuantMode.FP8_PER_TOKEN_HEAD:
            # The C++ router does not run it: the Python path does (its kernel, or a refusal when forced).
            max_tokens.append(0)
            python_when_captured.append(1)
            continue
        if forced == "native":
            max_tokens.append(2 ** 62)
            python_when_captured.append(0)
        else:
            small = registry.choose(registry.Situation("encode_and_cache_write", "cuda", mode, "small", False)).name
            max_tokens.append(policy.native_max_tokens(mode) if small == "native" else 0)
            python_when_captured.append(int(mode in policy.triton_when_captured))
    library.release_python_cuda_body()
    torch.ops.kvfuse_native.install_cuda_routing(max_tokens, python_when_captured)
    logger.debug("CUDA fused writes routed in C++: max tokens %s, Python under capture %s", max_tokens,
                 python_when_captured)
    return True


def cuda_routing_active() -> bool:
    return bool(_state.get("cuda")) and bool(torch.ops.kvfuse_native.cuda_routing_active())


def mode_values() -> dict[str, int]:
    """The C++ enum's names and values, e.g. ``{"NONE": 0, ...}``."""
    _require("encode_kv")
    pairs = (item.split("=") for item in torch.ops.kvfuse_native.mode_values().split(","))
    return {name: int(value) for name, value in pairs}


def build_info(build: bool = False) -> dict[str, Any]:
    """Where the native library is and what it was built for (for ``python -m kvfuse info``).

    With ``build=True`` the library is built (or loaded from its cache) first.
    """
    info: dict[str, Any] = {"enabled": not _disabled(), "sources": str(_csrc_dir()),
                            "build_root": str(_build_root())}
    if _extra_cuda_flags():
        info["extra_cuda_flags"] = " ".join(_extra_cuda_flags())
    if info["enabled"] and (build or _state):
        state = _ensure_built()
        info.update(built=state["library"] is not None, library=state["library"],
                    build_dir=str(state["build_dir"]) if state["build_dir"] else None, cuda=state["cuda"],
                    gencode=state["gencode"], build_seconds=state["seconds"], error=state["error"],
                    cuda_error=state["cuda_error"])
    else:
        info["built"] = None  # not attempted in this process
    return info


def _rank(situation: Situation) -> Optional[int]:
    if situation.op in ROPE_OPS:
        # First on CUDA for the caches it writes; rope_encode_and_cache_write itself hands the
        # calls .tuning measured faster on Triton's kernel to it.
        return 0 if situation.device_type == "cuda" else None
    if situation.op == "paged_attention":
        # Before Triton for the caches its decode kernel reads (CUDA only): BENCHMARKS.md.
        return 0 if situation.device_type == "cuda" else None
    # CUDA: first for small writes; after Triton for bulk ones and for the formats whose Triton
    # kernel wins under capture (the registry sets `captured` only for those): see .tuning.
    if situation.device_type == "cuda" and (situation.size_class == "bulk" or situation.captured):
        return 2
    return 0


IMPLEMENTATION = Implementation(
    name="native", module=__name__, ops=frozenset(CACHE_OPS) | frozenset(ROPE_OPS) | {"paged_attention"},
    devices=frozenset({"cpu", "cuda"}),
    # FP8_PER_TOKEN_HEAD: the fused write and decode attention on CUDA only (unavailable_reason).
    modes=ALL_MODES,
    # CPU only: on CUDA a refusal thrown from check_cache has crashed the process (seen on the H100,
    # not understood yet), so CUDA calls are validated in Python, or pre-checked without throwing by
    # the eager router (fits_encode_and_write).
    available=unavailable_reason, rank=_rank, checks_inputs=frozenset({"cpu"}),
    # The CUDA write kernels hold one divider per K and V for a whole block (csrc/cuda/cache_write.cu)
    # and refuse per-KV-head scales; those calls take the Triton kernels. The decode attention
    # kernel reads its KV head's scale.
    per_head_scale_devices=frozenset({"cpu"}), per_head_scale_ops=frozenset({"paged_attention"}),
    # The rotary write takes 16-element units of bf16/fp16 rows 16-byte aligned (rope_refusal); with
    # the native backend forced, the rotary pass leaves rotations unfused rather than emit calls
    # it might refuse.
    partial_ops=frozenset(ROPE_OPS),
)
