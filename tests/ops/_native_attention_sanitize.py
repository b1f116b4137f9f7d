"""Runs the native decode attention kernel on small poisoned cases for ``compute-sanitizer`` (not a
pytest module).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \\
        python3 tests/ops/_native_attention_sanitize.py

Block tables hold out-of-range entries past each sequence and windows leave pages unread, so a
read of a page the kernel must not touch is an invalid access here. Each case is also checked
against the reference, so a kernel that silently did nothing cannot pass.
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


def main() -> int:
    reason = native.unavailable_reason("paged_attention", "cuda", int(KVQuantMode.NVFP4))
    if reason is not None:
        print(f"native attention kernel unavailable: {reason}")
        return 2
    count = 0
    for mode in (KVQuantMode.NVFP4, KVQuantMode.FP8_E4M3):
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
