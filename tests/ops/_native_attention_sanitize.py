"""Runs the native decode attention kernel (or, with the argument ``write``, the per-token-head
FP8 write kernel) on small poisoned cases for ``compute-sanitizer`` (not a pytest module).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \\
        python3 tests/ops/_native_attention_sanitize.py [write]

Block tables hold out-of-range entries past each sequence and windows leave pages unread, so a
read of a page the kernel must not touch is an invalid access here; writes go to caches whose
last row ends the allocation, with padding slots and slots past the cache. Each case is also
checked against the reference, so a kernel that silently did nothing cannot pass.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from test_triton_attention import make_case, reference_out  # noqa: E402

from kvfuse.kv_cache import KVQuantMode  # noqa: E402
from kvfuse.ops import native  # noqa: E402
from kvfuse.ops.registry import AttentionCall  # noqa: E402


def per_token_head_writes() -> int:
    from kvfuse.ops import reference as ref

    one = torch.tensor(1.0, device="cuda")
    count = 0
    for head_size, heads, tokens, page, dtype in ((128, 8, 533, 16, torch.bfloat16), (80, 3, 7, 5, torch.float16),
                                                  (256, 2, 64, 1, torch.float32), (64, 4, 100, 32, torch.bfloat16),
                                                  (72, 5, 300, 16, torch.bfloat16), (256, 4, 8197, 16, torch.float32)):
        g = torch.Generator().manual_seed(count)
        key = (torch.randn(tokens, heads, head_size, generator=g) * 10).to(dtype).cuda()
        value = (torch.randn(tokens, heads, head_size, generator=g) / 10).to(dtype).cuda()
        num_blocks = -(-tokens // page)
        slots = torch.randperm(num_blocks * page, generator=g)[:tokens]
        slots[::7] = -1
        slots[1] = num_blocks * page + 3  # past the cache: skipped
        slots = slots.cuda()
        want = torch.full((num_blocks, 2, page, heads, head_size + 4), 0xA5, dtype=torch.uint8, device="cuda")
        got = want.clone()
        ref.encode_and_cache_write(key, value, want[:, :, :, :, :], torch.where(slots < num_blocks * page, slots, -1),
                                   one, one, KVQuantMode.FP8_PER_TOKEN_HEAD)
        native.encode_and_cache_write(key, value, got, slots, one, one, int(KVQuantMode.FP8_PER_TOKEN_HEAD))
        assert torch.equal(got, want), (head_size, heads, tokens, page, dtype)
        count += 1
    torch.cuda.synchronize()
    print(f"{count} native per-token-head write cases checked")
    return 0


def main() -> int:
    if sys.argv[1:] == ["write"]:
        return per_token_head_writes()
    reason = native.unavailable_reason("paged_attention", "cuda", int(KVQuantMode.NVFP4))
    if reason is not None:
        print(f"native attention kernel unavailable: {reason}")
        return 2
    count = 0
    for mode in (KVQuantMode.NVFP4, KVQuantMode.FP8_E4M3, KVQuantMode.FP8_PER_TOKEN_HEAD):
        for page, head_size, heads in ((16, 128, (32, 8)), (5, 64, (12, 4)), (32, 256, (16, 2))):
            args = make_case([1, 77, 300], [1, 1, 2], *heads, head_size, mode, page=page, pad_rows=1, seed=count)
            for window, splits in ((None, 1), (40, 3)):
                case = dict(args, sliding_window=window)
                out = native.paged_attention(AttentionCall(**case), num_splits=splits)
                torch.testing.assert_close(out.cpu().float(), reference_out(case).float(), atol=3e-2, rtol=3e-2)
                count += 1
    torch.cuda.synchronize()
    print(f"{count} native attention cases checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
