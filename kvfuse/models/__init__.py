"""A small Llama-style demo model and a paged-cache manager to drive it.

Both exist to exercise kvfuse end to end (mixed per-layer caches, prefill then decode,
compiled and eager) without downloading a checkpoint; the weights are random.
"""

from .cache_manager import PagedCacheManager, StepInputs
from .llama import LlamaConfig, LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM", "PagedCacheManager", "StepInputs"]
