"""kvfuse's Inductor FX passes (post-grad), one fusion per module, run by :mod:`.manager`.

- :mod:`.fuse_encode_cache_write`: encode(K) + encode(V) -> cache_write  ==>  encode_and_cache_write,
  with the encodings recognised by ``kvfuse::encode_kv`` (in that module),
  :mod:`.plain_fp8_encoding` and :mod:`.plain_cast_encoding`.
- :mod:`.fuse_rope_cache_write`: rotate(K) -> encode_and_cache_write (+ rotate(Q) -> attention)  ==>
  rope_encode_and_cache_write, for the rotary forms transformers and the demo model write.
- :mod:`.manager`: the ``CustomGraphPass`` Inductor runs; its ``uuid()`` keys the FX graph cache.
"""

from .fuse_encode_cache_write import FusionRecord
from .manager import KVFusePassManager

__all__ = ["FusionRecord", "KVFusePassManager"]
