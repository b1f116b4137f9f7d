"""Two tiny kernels that differ only in one name: the compile check must pass the first and report the
second, which repeats the bug an H100 found in the RoPE kernel (a name bound to an int64 offset
tensor in the ``then`` block and to a pointer tensor in the ``else`` block of a runtime ``if``;
the interpreter runs it, the compiler refuses it). Imported only by the compile subprocess."""

import triton
import triton.language as tl


@triton.jit
def branch_types_ok(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if pid < n:
        src = offs.to(tl.int64)
        tl.store(y_ptr + src, tl.load(x_ptr + src))
    else:
        dst = y_ptr + offs
        tl.store(dst, 0.0)


@triton.jit
def branch_types_mismatch(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if pid < n:
        dst = offs.to(tl.int64)
        tl.store(y_ptr + dst, tl.load(x_ptr + dst))
    else:
        dst = y_ptr + offs
        tl.store(dst, 0.0)
