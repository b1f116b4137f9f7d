"""dump_sass.py OUTDIR [-DX=Y ...]: cache_write.cu -> OUTDIR/all.sass + per-kernel opcode counts for PairRotation kernels."""
import sys, subprocess, pathlib, re, collections, json
sys.path.insert(0, '.')
from benchmarks.ptxas_native import run_nvcc, REPO_ROOT
from benchmarks.sass_count import _nvdisasm
from benchmarks.sass_native import kernels
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
defs = [a[2:] for a in sys.argv[2:] if a.startswith('-D')]
cubin = out / 'out.cubin'
run_nvcc(REPO_ROOT / 'csrc/cuda/cache_write.cu', 'sm_90a', defs, cubin, cubin=True)
listing = subprocess.run([_nvdisasm(), '-c', str(cubin)], capture_output=True, text=True, check=True).stdout
(out / 'all.sass').write_text(listing)
ks = kernels(listing)
summary = {}
for name, ins in ks.items():
    c = collections.Counter(i.split()[0] if not i.startswith('@') else i.split()[1] for i in ins)
    summary[name] = {'total': len(ins), **dict(c.most_common())}
json.dump(summary, open(out / 'counts.json', 'w'), indent=1)
for name in ks:
    print(len(ks[name]), name[:300])
