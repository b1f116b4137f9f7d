"""Tuning sweep of the native CUDA cache-write kernel's launch constants, on one GPU.

    python -m benchmarks.native_sweep [--tokens 1024,4096,16384,65536] [--formats bfloat16,fp8_e4m3]
                                      [--variant NAME=FLAGS ...] [--out benchmarks/results]

Each variant is ``csrc/`` built with ``-D`` overrides of the ``KVFUSE_*`` knobs at the top of
``csrc/cuda/cache_write.cu`` (through ``KVFUSE_NATIVE_CUDA_FLAGS``, each in its own build
directory; the builds run in parallel). One subprocess per variant then checks the native result
against the Triton kernel bit for bit and times it, with the shapes and timing of
``benchmarks/cache_write.py``. The first subprocess also times the Triton kernel and a
device-to-device copy of the same byte count (rotating buffers beyond L2), so every variant is
read against both in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Name -> nvcc flags. "default" is the committed configuration.
VARIANTS = {
    "default": "",
    "default_again": "-DKVFUSE_SWEEP_REPEAT=1",  # the same kernels: run-to-run noise
    "no_hints": "-DKVFUSE_LOAD_HINT=0 -DKVFUSE_STORE_HINT=0",
    "load_hint_only": "-DKVFUSE_STORE_HINT=0",
    "never_unpaired": "-DKVFUSE_UNPAIRED_BELOW_ITEMS=0 -DKVFUSE_FP8_UNPAIRED_BELOW_ITEMS=0 "
                      "-DKVFUSE_NVFP4_UNPAIRED_BELOW_ITEMS=0",
    "small256": "-DKVFUSE_SMALL_THREADS=256",
    "wide1024": "-DKVFUSE_WIDE_GRID=1024",
    "copy_u4_b2": "-DKVFUSE_COPY_UNITS=4 -DKVFUSE_COPY_MIN_BLOCKS=2",
}


def _env(flags: str, build_root: str) -> dict:
    env = dict(os.environ, KVFUSE_NATIVE_CUDA_FLAGS=flags, KVFUSE_NATIVE_BUILD_DIR=build_root,
               KVFUSE_CACHE_WRITE_BACKEND="triton", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


def _build(name: str, flags: str, build_root: str) -> tuple[str, float, str]:
    start = time.perf_counter()
    code = ("import json; from kvfuse.ops import native; i = native.build_info(build=True); "
            "print(json.dumps({'cuda': i.get('cuda'), 'error': i.get('error'), 'cuda_error': i.get('cuda_error')}))")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(flags, build_root), capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    status = lines[-1] if proc.returncode == 0 and lines else proc.stderr.strip()[-400:]
    return name, time.perf_counter() - start, status


def _measure(args) -> int:
    """Child: time one variant (and, with --anchors, Triton and the same-size copy)."""
    import torch

    from benchmarks import cache_write as cw
    from benchmarks import common
    import kvfuse  # noqa: F401 - registers the ops

    results = []
    for fmt in args.formats.split(","):
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            case = cw.Case(fmt, num_tokens, common.rotations_for(cw.Case.bytes_per_call(fmt, num_tokens)))
            native_cache, triton_cache = case.new_cache(), case.new_cache()
            native_cache.view(torch.uint8).fill_(0x5A)
            triton_cache.view(torch.uint8).fill_(0x5A)
            cw.make_kvfuse_native(case, native_cache)[0]()
            cw.make_kvfuse(case, triton_cache)[0]()
            exact = bool(torch.equal(native_cache.view(torch.uint8), triton_cache.view(torch.uint8)))
            row = {"format": fmt, "tokens": num_tokens, "bytes": case.effective_bytes, "exact": exact,
                   "native_us": common.bench(cw.make_kvfuse_native(case, native_cache)).us}
            if args.anchors:
                row["triton_us"] = common.bench(cw.make_kvfuse(case, triton_cache)).us
                half = case.effective_bytes // 2  # a copy reads and writes this many bytes
                sets = common.rotations_for(2 * half)
                src = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(sets)]
                dst = [torch.empty_like(s) for s in src]
                row["copy_us"] = common.bench([lambda i=i: dst[i].copy_(src[i]) for i in range(sets)]).us
                del src, dst
                # The same call with each rotation's slots sorted: how much the random scatter costs.
                case.slots = [s.sort().values for s in case.slots]
                row["native_sorted_us"] = common.bench(cw.make_kvfuse_native(case, native_cache)).us
            results.append(row)
            del case, native_cache, triton_cache
            torch.cuda.empty_cache()
    print("RESULT " + json.dumps(results), flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,64,256,1024,4096,16384,65536")
    parser.add_argument("--formats", default="bfloat16,fp8_e4m3,nvfp4")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="replace the built-in variant list (repeatable)")
    parser.add_argument("--build-root", default=os.path.join(os.path.expanduser("~"), ".cache", "kvfuse", "sweep"))
    parser.add_argument("--jobs", type=int, default=12, help="parallel builds")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--anchors", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _measure(args)

    import torch

    if not torch.cuda.is_available():
        print("native_sweep: needs a CUDA device; nothing measured")
        return 1
    variants = dict(v.split("=", 1) for v in args.variant) if args.variant else dict(VARIANTS)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        builds = list(pool.map(lambda kv: _build(kv[0], kv[1], args.build_root), variants.items()))
    for name, seconds, status in builds:
        print(f"built {name:12s} {seconds:5.1f} s {status}", flush=True)
    print(f"builds: {time.perf_counter() - start:.0f} s", flush=True)

    table = {}
    for n, (name, flags) in enumerate(variants.items()):
        cmd = [sys.executable, "-m", "benchmarks.native_sweep", "--child", "--tokens", args.tokens, "--formats", args.formats]
        if n == 0:
            cmd.append("--anchors")
        proc = subprocess.run(cmd, env=_env(flags, args.build_root), capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{name}: failed\n{proc.stderr[-1500:]}", flush=True)
            continue
        table[name] = json.loads(lines[-1][len("RESULT "):])
        print(f"measured {name}", flush=True)

    from benchmarks import common

    copy_gb_s = common.copy_bandwidth_gb_s()
    first = next(iter(table.values()), [])
    print(f"\nus per call (% of the 1 GiB copy ceiling {copy_gb_s:.0f} GB/s); x = not bit-exact with Triton")

    def cell(r, key):
        inexact = key == "native_us" and not r["exact"]
        return f"{r[key]:6.1f} {r['bytes'] / (r[key] * 1e-6) / 1e9 / copy_gb_s:4.0%}" + ("x" if inexact else "")

    for fmt in dict.fromkeys(r["format"] for r in first):
        cols = [i for i, r in enumerate(first) if r["format"] == fmt]
        print(f"\n{fmt:14s} " + " ".join(f"{first[i]['tokens']:>11d}" for i in cols))
        if "copy_us" in first[cols[0]]:
            anchors = (("same-size copy", "copy_us"), ("triton", "triton_us"), ("sorted slots", "native_sorted_us"))
            for label, key in anchors:
                print(f"{label:14s} " + " ".join(cell(first[i], key) for i in cols))
        for name, rows in table.items():
            print(f"{name:14s} " + " ".join(cell(rows[i], "native_us") for i in cols))
    os.makedirs(args.out, exist_ok=True)
    info = common.device_info("python -m benchmarks.native_sweep " + " ".join(sys.argv[1:] if argv is None else argv))
    common.write_json(os.path.join(args.out, "native_sweep.json"),
                      {**info, "copy_gb_per_s": round(copy_gb_s, 1), "variants": variants, "results": table})
    return 0


# Read (as text) by `python -m kvfuse bench`, which refuses to start this on a host without CUDA.
REQUIRES_CUDA = True


if __name__ == "__main__":
    sys.exit(main())
