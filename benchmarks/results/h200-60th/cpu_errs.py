import copy, os, sys
os.environ["KVFUSE_BACKEND"] = "reference"
sys.path.insert(0, "tests/integrations")
import torch, kvfuse
from kvfuse.integrations import transformers as kvt
from _hf_models import build, left_padded_batch, teacher_forced_logits
HD = {"llama": 128, "qwen3": 128, "mistral": 128, "gemma2": 256, "gemma3": 128, "gpt_oss": 64}
def err(a, b): return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
for name in sys.argv[1].split(","):
    ref = build(name, torch.bfloat16, head_dim=HD[name]); f32 = build(name, torch.float32, head_dim=HD[name])
    ids, mask = left_padded_batch()
    tokens = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
    truth = teacher_forced_logits(f32, ids, mask, tokens)
    hf = teacher_forced_logits(ref, ids, mask, tokens)
    kv = teacher_forced_logits(kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig()), ids, mask, tokens)
    line = f"{name}: kvfuse-bf16 vs hf-bf16 {err(kv, hf):.2e}; hf-bf16 vs f32 {err(hf, truth):.2e}; kvfuse-bf16 vs f32 {err(kv, truth):.2e}"
    for fmt in ("fp8", "nvfp4"):
        q = teacher_forced_logits(kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig(kv_cache_dtype=fmt, skip_layers=("sliding_window",))), ids, mask, tokens)
        line += f"; {fmt} vs kvfuse-bf16 {err(q, kv):.2e}"
    print(line, flush=True)
