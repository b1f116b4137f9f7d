"""Prints the measured errors behind test_transformers_gpu.py's bounds (one line per case).
(The form call b ran, over the test module's first form, which call a ran.)"""
import copy, json, sys
sys.path.insert(0, "tests/integrations")
import torch, kvfuse
from kvfuse.integrations import transformers as kvt
import test_transformers_gpu as t

rows = []
for name in t.MODELS:
    ref = t.gpu_model(name); model = t.with_kvfuse(ref, kvfuse.KVCacheConfig())
    ids, mask = t.gpu_batch(); tokens = t.greedy_tokens(ref, ids, mask)
    rows.append(("bf16 cache vs transformers bf16", name, t.logit_error(t.teacher_forced_logits(model, ids, mask, tokens),
                                                                      t.teacher_forced_logits(ref, ids, mask, tokens))))
for name in ["llama", "gemma2", "gpt_oss"]:
    ref = t.gpu_model(name, torch.float32); model = t.with_kvfuse(ref, kvfuse.KVCacheConfig())
    ids, mask = t.gpu_batch()
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **t.GEN)
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **t.GEN)
    rows.append(("float32 generate scores", name, max(t.logit_error(a, b) for a, b in zip(got.scores, want.scores))))
for name, fmt in [("llama", "fp8"), ("gemma3", "fp8"), ("gpt_oss", "fp8"), ("llama", "nvfp4"), ("gemma2", "nvfp4")]:
    ref = t.gpu_model(name)
    model = t.with_kvfuse(ref, kvfuse.KVCacheConfig(kv_cache_dtype=fmt, skip_layers=("sliding_window",)))
    bf16 = t.with_kvfuse(ref, kvfuse.KVCacheConfig(kv_cache_dtype="bfloat16"))
    ids, mask = t.gpu_batch(); tokens = t.greedy_tokens(ref, ids, mask)
    rows.append((f"{fmt} cache vs bf16 cache", name, t.logit_error(t.teacher_forced_logits(model, ids, mask, tokens),
                                                                t.teacher_forced_logits(bf16, ids, mask, tokens))))
for what, name, err in rows:
    print(f"{what:34s} {name:8s} {err:.2e}")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
