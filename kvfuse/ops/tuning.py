"""Measured kernel choices as frozen data: which CUDA cache-write kernel wins where.

The numbers come from the runs recorded in BENCHMARKS.md (section 1, the native kernels); they
are data, read by the registry when it decides, never rewritten at run time. A table is keyed
by GPU architecture; architectures that were never measured use the H100's (``sm90``) and say
so in the debug log. ``KVFUSE_NATIVE_MAX_TOKENS`` (:mod:`kvfuse.envs`) overrides the token
thresholds for every format.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from .. import envs
from ..kv_cache import KVQuantMode

logger = logging.getLogger(__name__)

__all__ = ["CacheWritePolicy", "CUDA_CACHE_WRITE_POLICIES", "cuda_cache_write_policy", "RopeWritePolicy",
           "ROPE_WRITE_POLICIES", "rope_write_policy"]


@dataclass(frozen=True)
class CacheWritePolicy:
    """When a CUDA cache op runs Triton rather than the native kernel.

    - ``max_tokens[mode]``: from this many tokens on, Triton (its device time wins at bulk sizes,
      while native's lower host cost wins below, where eager calls are host-bound);
    - ``triton_when_captured[mode]``: under CUDA-graph capture, Triton below this many tokens (and
      where the count is unknown): formats whose Triton kernel is faster on the device at small
      sizes, which is all that counts when a CUDA graph is replayed. Formats absent here follow
      ``max_tokens`` under capture too.
    """

    max_tokens: Mapping[KVQuantMode, int]
    triton_when_captured: Mapping[KVQuantMode, int]
    max_tokens_override: int | None = None

    def __post_init__(self) -> None:
        missing = set(KVQuantMode) - set(self.max_tokens)
        if missing:
            raise ValueError(f"max_tokens lacks {sorted(m.name for m in missing)}")
        for name in ("max_tokens", "triton_when_captured"):
            table = getattr(self, name)
            if not isinstance(table, Mapping) or any(not isinstance(v, int) or v <= 0 for v in table.values()):
                raise ValueError(f"{name}={table!r} must map formats to positive token counts")
            object.__setattr__(self, name, MappingProxyType(dict(table)))

    def triton_captured(self, mode: KVQuantMode, num_tokens: int | None) -> bool:
        """Whether a call of ``num_tokens`` (None: unknown) being captured runs Triton."""
        limit = self.triton_when_captured.get(mode)
        return limit is not None and (num_tokens is None or num_tokens < limit)

    def native_max_tokens(self, mode: KVQuantMode) -> int:
        return self.max_tokens_override if self.max_tokens_override is not None else self.max_tokens[mode]


# sm90: casts run Triton from 16384 tokens; FP8, NVFP4 and per-token-head FP8 run native at every
# size, under CUDA-graph capture too (e5m2 takes e4m3's rule: one kernel template). In the
# forty-third session's H200 run (BENCHMARKS.md) the native e4m3 and NVFP4 writes were faster than
# Triton's at every size measured, 1 to 65536 tokens, and the native casts up to 4096 tokens (level
# at 16384, behind at 65536). The H100 runs before (section 1, commit 6ae1eb7; eleventh session)
# had Triton's FP8 write ahead from 65536 tokens and its captured casts and NVFP4 writes ahead at
# small sizes.
_SM90 = CacheWritePolicy(
    max_tokens={KVQuantMode.NONE: 16384, KVQuantMode.FP8_E4M3: 1 << 62, KVQuantMode.FP8_E5M2: 1 << 62,
                KVQuantMode.NVFP4: 1 << 62,
                # Native at every size: 4.7 vs 5.9 us at 1024 tokens, 42.6 vs 44.4 at 16384, a tie
                # at 65536 (168.9 vs 168.3); its eager calls take the Python body (no C++ route).
                KVQuantMode.FP8_PER_TOKEN_HEAD: 1 << 62},
    triton_when_captured={},
)

#: Policies by GPU architecture (``sm<major><minor>``).
CUDA_CACHE_WRITE_POLICIES: Mapping[str, CacheWritePolicy] = MappingProxyType({"sm90": _SM90})


@functools.lru_cache(maxsize=None)
def _policy_for(arch: str, override: int | None) -> CacheWritePolicy:
    policy = CUDA_CACHE_WRITE_POLICIES.get(arch)
    if policy is None:
        logger.debug("no cache-write policy measured on %s; using sm90's", arch)
        policy = _SM90
    if override is not None:
        policy = CacheWritePolicy(policy.max_tokens, policy.triton_when_captured, override)
    return policy


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def device_arch(device) -> str:
    """``sm{major}{minor}`` of a CUDA ``torch.device`` (its index, else the current device), cached."""
    import torch

    return _device_arch(device.index if device.index is not None else torch.cuda.current_device())


def _current_arch() -> str:
    import torch

    return _device_arch(torch.cuda.current_device())


def cuda_cache_write_policy(arch: str | None = None) -> CacheWritePolicy:
    """The policy for ``arch`` (default: the current CUDA device), with the environment's override."""
    return _policy_for(arch or _current_arch(), envs.settings().native_max_tokens)


@dataclass(frozen=True)
class RopeWritePolicy:
    """Which kernel runs the fused rotary write on CUDA, and which rotation Triton's takes.

    ``native_from[mode]``: from this many tokens on, calls without a query run the native kernel
    (``csrc/cuda/cache_write.cu``); ``native_with_query_from[mode]``: the same for calls with a
    query (the native kernel rotates it in a launch of its own); smaller calls and formats absent
    here run Triton's (``kvfuse/ops/triton/rope_kv_write.py``). Triton's rotation, where both give its bits:
    below ``gather_below[mode]`` tokens the gathered one (each partner by a second load), from
    there on the split one (partners from the loaded rows); formats absent take the split one."""

    gather_below: Mapping[KVQuantMode, int]
    native_from: Mapping[KVQuantMode, int] = field(default_factory=dict)
    native_with_query_from: Mapping[KVQuantMode, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("gather_below", "native_from", "native_with_query_from"):
            table = getattr(self, name)
            if not isinstance(table, Mapping) or any(
                    not isinstance(m, KVQuantMode) or not isinstance(v, int) or v <= 0 for m, v in table.items()):
                raise ValueError(f"{name}={table!r} must map KVQuantMode formats to positive token counts")
            object.__setattr__(self, name, MappingProxyType(dict(table)))

    def rotation(self, mode: KVQuantMode, num_tokens: int) -> str:
        return "gather" if num_tokens < self.gather_below.get(mode, 0) else "split"

    def native(self, mode: KVQuantMode, num_tokens: int, with_query: bool) -> bool:
        """Whether the native kernel is the measured choice for this call (it must also take it:
        :func:`kvfuse.ops.native.rope_refusal`)."""
        limit = (self.native_with_query_from if with_query else self.native_from).get(mode)
        return limit is not None and num_tokens >= limit


# H100 (sm90), `python -m benchmarks.rope_write` sweep at 695e34f (BENCHMARKS.md, eleventh
# session), us per call, split / gather: FP8 2.42 / 2.34 at 16 tokens, 2.47 / 2.42 at 64, 3.22 /
# 3.27 at 256; NVFP4 2.41 / 2.26, 2.47 / 2.35, 2.86 / 2.90. bf16 within 0.02 us either way: split.
# The native kernel against Triton's: `python -m benchmarks.rope_write` at 9c4a752, c4663ab,
# d7c7385 and, on cold inputs, 74970b8 and ab06b55 (BENCHMARKS.md, fifteenth session). Without a query, native is faster for FP8 e4m3 at
# every size measured from 16 tokens on (level at 1; at 1024 level on warm inputs, faster on cold
# ones), and slower or level for NVFP4
# throughout; with the query (its own launch natively) it is faster only at 16384 tokens, for
# both (4096 lost; sizes in between were not measured). e5m2 was not measured. Since the NVFP4
# encode's instruction cuts (eighteenth session, `python -m benchmarks.rope_write` at 1c6e791)
# the native NVFP4 kernel without a query takes 13.27 us at 4096 tokens against Triton's 13.96
# (2.31 / 2.35 at 64, within noise; sizes in between not measured). Since the rotation's packed
# rounding (twenty-third session, `rope_write --quick` at be42259, us native / Triton without a
# query) the native kernel is faster at every size measured for NVFP4 (1.84 / 2.16 at 1 token,
# 2.21 / 2.36 at 64, 4.81 / 5.77 at 1024, 12.65 / 13.92 at 4096) and for bf16 caches, new there
# (1.44 / 1.67 at 1, 1.65 / 1.85 at 64, 3.77 / 4.52 at 1024, 11.03 / 11.46 at 4096).
_SM90_ROPE = RopeWritePolicy(gather_below={KVQuantMode.FP8_E4M3: 256, KVQuantMode.NVFP4: 256},
                             native_from={KVQuantMode.NONE: 1, KVQuantMode.FP8_E4M3: 16, KVQuantMode.NVFP4: 1},
                             native_with_query_from={KVQuantMode.FP8_E4M3: 16384, KVQuantMode.NVFP4: 16384})

#: Rotary-write policies by GPU architecture; others (and the CPU interpreter) use sm90's.
ROPE_WRITE_POLICIES: Mapping[str, RopeWritePolicy] = MappingProxyType({"sm90": _SM90_ROPE})


def rope_write_policy(device) -> RopeWritePolicy:
    """The rotary-write policy for ``device`` (a ``torch.device``): its architecture's, else sm90's."""
    if device.type != "cuda":
        return _SM90_ROPE
    return ROPE_WRITE_POLICIES.get(device_arch(device), _SM90_ROPE)
