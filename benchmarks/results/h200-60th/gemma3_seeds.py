import copy, os, sys
os.environ["KVFUSE_BACKEND"] = "reference"
sys.path.insert(0, "tests/integrations")
import torch, kvfuse
from kvfuse.integrations import transformers as kvt
from _hf_models import build, left_padded_batch, teacher_forced_logits
def err(a, b): return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
for name in sys.argv[1].split(","):
  for seed in range(4):
    ref = build(name, torch.bfloat16, seed=seed, head_dim=128)
    ids, mask = left_padded_batch(seed=seed + 1)
    tokens = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
    truth = teacher_forced_logits(copy.deepcopy(ref).float(), ids, mask, tokens)
    hf = teacher_forced_logits(ref, ids, mask, tokens)
    kv = teacher_forced_logits(kvt.enable(copy.deepcopy(ref), kvfuse.KVCacheConfig()), ids, mask, tokens)
    print(name, seed, f"kvfuse {err(kv, truth):.2e} transformers {err(hf, truth):.2e} ratio {err(kv, truth)/err(hf, truth):.2f}", flush=True)
