"""Small native prefill cases with a diagnosis of where the output differs."""
import sys, time, torch
sys.path.insert(0, "tests/ops")
from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops import native
from kvfuse.ops.registry import AttentionCall
from test_new_token_prefill import step_kv
from test_triton_attention import make_case, reference_out

t0 = time.time()
print(native.build_info(build=True), flush=True)
print("build", time.time() - t0, flush=True)
for seq_lens, q_lens, hq, hkv in [([128], [128], 1, 1), ([256], [256], 2, 1), ([300, 700], [300, 500], 4, 2)]:
    args = make_case(seq_lens, q_lens, hq, hkv, 128, KVQuantMode.NONE, seed=3)
    key, value = step_kv(args)
    call = AttentionCall(**args, key=key, value=value)
    print("refusal", native.prefill_refusal(call), flush=True)
    out = native.prefill_attention(call)
    torch.cuda.synchronize()
    ref = reference_out(args).float()
    o = out.cpu().float()
    err = (o - ref).abs()
    print(seq_lens, q_lens, hq, hkv, "max err", err.max().item(), "nan", torch.isnan(o).sum().item(), flush=True)
    if err.max() > 0.05:
        bad = err.amax(dim=(1, 2))
        rows = torch.nonzero(bad > 0.05).flatten().tolist()
        print(" bad rows", len(rows), rows[:20], rows[-5:], flush=True)
        cols = err.amax(dim=(0, 1))
        print(" bad cols", torch.nonzero(cols > 0.05).flatten().tolist()[:40], flush=True)
        print(" out[0,0,:8]", o[0, 0, :8].tolist(), "\n ref", ref[0, 0, :8].tolist(), flush=True)
        # row 0 sees only key 0: out must be v[0]
        print(" v0", value[0, 0, :8].float().tolist(), flush=True)
