"""Runs the native prefill kernel (csrc/cuda/prefill_attention.cu) on small poisoned cases for
``compute-sanitizer`` (not a pytest module).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \\
        python3 tests/ops/_native_prefill_sanitize.py

Without the caching allocator every tensor is its own allocation, so a store past the output's
last row, or a read of a scale or sink past its tensor, is an invalid access here (the tensor
copies' reads past a tensor are the hardware's, zero-filled). Each case is also checked against
the reference, so a kernel that silently did nothing cannot pass.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from test_new_token_prefill import step_kv  # noqa: E402
from test_triton_attention import TOL, make_case, reference_out  # noqa: E402

from kvfuse.kv_cache import KVQuantMode  # noqa: E402
from kvfuse.ops import native  # noqa: E402
from kvfuse.ops.registry import AttentionCall  # noqa: E402

# (seq_lens, q_lens, q heads, kv heads, mode, padding rows, sinks)
CASES = (
    ([7, 300], [7, 300], 4, 2, KVQuantMode.NONE, 3, False),
    ([40, 700, 5], [17, 133, 1], 4, 4, KVQuantMode.NONE, 0, True),
    ([40, 700, 5], [17, 133, 1], 4, 2, KVQuantMode.FP8_E4M3, 2, True),
    ([300, 129], [150, 129], 2, 1, KVQuantMode.NVFP4, 1, False),
)


def main() -> int:
    count = 0
    for seq_lens, q_lens, hq, hkv, mode, pad, sinks in CASES:
        args = make_case(seq_lens, q_lens, hq, hkv, 128, mode, pad_rows=pad, seed=count)
        if sinks:
            args["sinks"] = torch.linspace(-2.0, 3.0, hq, device="cuda")
        kv = step_kv(args) if mode is KVQuantMode.NONE else (None, None)
        call = AttentionCall(**args, key=kv[0], value=kv[1])
        reason = native.prefill_refusal(call)
        assert reason is None, reason
        out = native.prefill_attention(call).float().cpu()
        expected = reference_out(args).float()
        covered = int(args["query_start_loc"][-1])
        if mode is KVQuantMode.FP8_E4M3:
            assert (out[:covered] - expected[:covered]).abs().max() <= 0.5, (seq_lens, mode)
        else:
            atol, rtol = TOL[args["query"].dtype]
            torch.testing.assert_close(out[:covered], expected[:covered], atol=atol, rtol=rtol)
        assert torch.all(out[covered:] == 0)
        count += 1
    # A sequence with fewer cached positions than new tokens: its rows are cleared, not attended.
    args = make_case([300, 300], [300, 150], 4, 2, 128, KVQuantMode.NONE, pad_rows=2, seed=count)
    key, value = step_kv(args)
    args["seq_lens"][1] = 100
    out = native.prefill_attention(AttentionCall(**args, key=key, value=value)).float().cpu()
    assert torch.all(out[300:] == 0)
    count += 1
    torch.cuda.synchronize()
    print(f"{count} native prefill cases checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
