"""ncu target: NVFP4/FP8 write alone, then native RoPE(K)+write with the given tables, N tokens, rotating sets."""
import sys, torch
from benchmarks.rope_write import Case, _write, _native
fmt, n, tables = sys.argv[1], int(sys.argv[2]), sys.argv[3]
case = Case(fmt, n, rotations=7)
w, r = _write(case), _native(case, False, tables)
for f in w + r: f()
torch.cuda.synchronize()
for f in w + r: f()   # profiled: launches 14..27 (7 write, 7 rope)
torch.cuda.synchronize()
