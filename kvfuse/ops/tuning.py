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
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from .. import envs
from ..kv_cache import KVQuantMode

logger = logging.getLogger(__name__)

__all__ = ["CacheWritePolicy", "CUDA_CACHE_WRITE_POLICIES", "cuda_cache_write_policy"]


@dataclass(frozen=True)
class CacheWritePolicy:
    """When a CUDA cache op runs Triton rather than the native kernel.

    - ``max_tokens[mode]``: from this many tokens on, Triton (its device time wins at bulk sizes,
      while native's lower host cost wins below, where eager calls are host-bound);
    - ``triton_when_captured``: formats whose Triton kernel is faster on the device at small sizes,
      which is all that counts when a CUDA graph is replayed.
    """

    max_tokens: Mapping[KVQuantMode, int]
    triton_when_captured: frozenset
    max_tokens_override: int | None = None

    def __post_init__(self) -> None:
        missing = set(KVQuantMode) - set(self.max_tokens)
        if missing:
            raise ValueError(f"max_tokens lacks {sorted(m.name for m in missing)}")
        if any(not isinstance(v, int) or v <= 0 for v in self.max_tokens.values()):
            raise ValueError(f"max_tokens={dict(self.max_tokens)} must hold positive token counts")
        object.__setattr__(self, "max_tokens", MappingProxyType(dict(self.max_tokens)))

    def native_max_tokens(self, mode: KVQuantMode) -> int:
        return self.max_tokens_override if self.max_tokens_override is not None else self.max_tokens[mode]


# H100 (sm90): device times of one run (BENCHMARKS.md section 1, commit 6ae1eb7) plus the host
# cost per eager call. Casts: Triton from 16384 tokens (49.7 vs 50.2 us); NVFP4 from 16384
# (56.5 vs 61.8 us); FP8 from 65536 (141.6 vs 142.7 us; native ahead up to 16384). Captured:
# Triton for casts (1.9 vs 2.1 us at 256 tokens) and NVFP4 (2.7 vs 3.1 us at 64), native for FP8.
_SM90 = CacheWritePolicy(
    max_tokens={KVQuantMode.NONE: 16384, KVQuantMode.FP8_E4M3: 65536, KVQuantMode.FP8_E5M2: 65536,
                KVQuantMode.NVFP4: 16384,
                # Native at every size: 4.7 vs 5.9 us at 1024 tokens, 42.6 vs 44.4 at 16384, a tie
                # at 65536 (168.9 vs 168.3); its eager calls take the Python body (no C++ route).
                KVQuantMode.FP8_PER_TOKEN_HEAD: 1 << 62},
    triton_when_captured=frozenset({KVQuantMode.NONE, KVQuantMode.NVFP4}),
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
def _current_arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def cuda_cache_write_policy(arch: str | None = None) -> CacheWritePolicy:
    """The policy for ``arch`` (default: the current CUDA device), with the environment's override."""
    return _policy_for(arch or _current_arch(), envs.settings().native_max_tokens)
