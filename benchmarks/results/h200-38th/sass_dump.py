"""Disassemble cache_write.cu (sm_90a) and dump chosen kernels' SASS to files."""
import sys, re, pickle
from pathlib import Path
from benchmarks.sass_native import disassemble
defs = sys.argv[2:]
ks = disassemble(Path("csrc/cuda/cache_write.cu"), "sm_90a", defs)
pickle.dump(ks, open(sys.argv[1], "wb"))
for n, lines in ks.items():
    if "Nvfp4Op" in n and "BFloat16" in n:
        print(len(lines), n[:160])
