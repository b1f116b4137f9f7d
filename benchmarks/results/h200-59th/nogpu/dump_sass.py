"""dump_sass.py OUTDIR REGEX [NAME=VALUE ...]: SASS of matching cache_write.cu kernels (sm_90a)."""
import re, sys
from pathlib import Path
from benchmarks.sass_native import disassemble, REPO_ROOT
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
ks = disassemble(REPO_ROOT / "csrc/cuda/cache_write.cu", "sm_90a", sys.argv[3:])
for name, lines in ks.items():
    if re.search(sys.argv[2], name):
        fn = re.sub(r"[^A-Za-z0-9]+", "_", name)[:150]
        (out / (fn + ".sass")).write_text(name + "\n" + "\n".join(lines) + "\n")
        print(len(lines), name)
