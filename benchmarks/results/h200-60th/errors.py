"""Prints the measured errors behind test_transformers_gpu.py's bounds (one line per case)."""
import copy, json, os, sys
sys.path.insert(0, "tests/integrations")
import torch, kvfuse
from kvfuse.integrations import transformers as kvt
from kvfuse.ops import registry
import test_transformers_gpu as t

rows = []
for name in t.MODELS:
    ref = t.gpu_model(name); model = t.with_kvfuse(ref, kvfuse.KVCacheConfig())
    ids, mask = t.gpu_batch(); tokens = t.greedy_tokens(ref, ids, mask)
    truth = t.teacher_forced_logits(copy.deepcopy(ref).float(), ids, mask, tokens)
    own = t.logit_error(t.teacher_forced_logits(ref, ids, mask, tokens), truth)
    got = t.logit_error(t.teacher_forced_logits(model, ids, mask, tokens), truth)
    rows.append(("bf16: kvfuse / transformers, vs f32", name, got, own))
for name, fmt in [("llama", "fp8"), ("qwen3", "fp8"), ("gpt_oss", "fp8"), ("llama", "nvfp4"), ("gemma2", "nvfp4")]:
    ref = t.gpu_model(name, torch.float32); cfg = kvfuse.KVCacheConfig(kv_cache_dtype=fmt)
    ids, mask = t.gpu_batch(); tokens = t.greedy_tokens(ref, ids, mask)
    got = t.teacher_forced_logits(t.with_kvfuse(ref, cfg), ids, mask, tokens)
    os.environ["KVFUSE_BACKEND"] = "reference"; registry.clear_cache()
    want = t.teacher_forced_logits(t.with_kvfuse(ref, cfg), ids, mask, tokens)
    del os.environ["KVFUSE_BACKEND"]; registry.clear_cache()
    plain = t.teacher_forced_logits(t.with_kvfuse(ref, kvfuse.KVCacheConfig()), ids, mask, tokens)
    rows.append((f"{fmt} f32: kernels vs reference; vs f32 cache", name, t.logit_error(got, want), t.logit_error(got, plain)))
for r in rows:
    print(f"{r[0]:42s} {r[1]:8s} " + " ".join(f"{x:.2e}" for x in r[2:]))
json.dump(rows, open(sys.argv[1], "w"), indent=1)
