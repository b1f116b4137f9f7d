"""Benchmark: host overhead of one eager cache-write call at decode sizes, native vs Triton vs FlashInfer.

    python -m benchmarks.host_overhead [--out benchmarks/results] [--no-flashinfer]

What a decode step pays per layer when it is NOT replayed from a CUDA graph: the Python-side
cost of issuing ``kvfuse::encode_and_cache_write`` plus its (tiny) kernel. 1 and 64 tokens,
8 KV heads, head size 128, block size 16, bf16 input; cache formats bfloat16 / fp8_e4m3 / nvfp4.

Per implementation and size, three numbers (median over trials):

- ``us/call``: wall time of N back-to-back eager calls, then one synchronize, divided by N
  (host + device time per call in a pipelined loop; equals the host time when that dominates);
- ``latency``: one call followed by ``torch.cuda.synchronize()``, per call;
- ``device``: the same call replayed from a CUDA graph (kernel time alone, no host work).

Implementations: ``op`` rows call the public op (validation + backend selection + kernel), with
``KVFUSE_CACHE_WRITE_BACKEND`` forcing native or triton; ``fn`` rows call the backend function
directly (the kernel launch path alone); ``flashinfer`` is ``flashinfer.page.append_paged_kv_cache``
(bfloat16; metadata prepared once, outside the loop) and FlashInfer's NVFP4 quantize-append kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


from benchmarks import common

HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 8, 128, 16, 256
TOKENS = (1, 64)
FORMATS = ("bfloat16", "fp8_e4m3", "nvfp4")
IMPLS = ("native op", "triton op", "native fn", "triton fn", "flashinfer")


class _Skip(Exception):
    pass


def _spec(fmt: str):
    from kvfuse.kv_cache import KVCacheConfig

    return KVCacheConfig(kv_cache_dtype=fmt).layer_spec("bench.layers.0.attn", HEADS, HEAD_SIZE, torch.bfloat16)


def _force(backend: str):
    from kvfuse.ops import registry as backends

    os.environ["KVFUSE_CACHE_WRITE_BACKEND"] = backend
    backends.clear_cache()


def make_call(impl: str, fmt: str, num_tokens: int):
    """A zero-argument callable doing one cache write, plus the cache it writes."""
    from kvfuse.kv_cache import allocate_kv_cache

    spec = _spec(fmt)
    mode = int(spec.kv_quant_mode)
    key = torch.randn(num_tokens, HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device="cuda")[:num_tokens]
    scale = torch.tensor(0.05 if spec.kv_quant_mode.is_fp8 else 1.0, device="cuda")
    cache = allocate_kv_cache(spec, NUM_BLOCKS, BLOCK_SIZE, device="cuda")
    if impl.endswith(" op"):
        backend = impl.split()[0]
        from kvfuse.ops import registry as backends

        reason = backends.unavailable_reason(backend, "encode_and_cache_write", "cuda", mode)
        if reason is not None:
            raise _Skip(f"{backend}: {reason}")
        op = torch.ops.kvfuse.encode_and_cache_write
        return (lambda: op(key, value, cache, slots, scale, scale, mode, "bench")), backend
    if impl == "native fn":
        from kvfuse.ops import native

        fn = native.encode_and_cache_write
    elif impl == "triton fn":
        from kvfuse.ops.triton import kv_write as tcw

        fn = tcw.encode_and_cache_write
    else:
        return _flashinfer_call(fmt, key, value, slots, scale), None
    return (lambda: fn(key, value, cache, slots, scale, scale, mode)), None


def _flashinfer_call(fmt, key, value, slots, scale):
    try:
        import flashinfer
        import flashinfer.page as page
    except Exception as e:  # noqa: BLE001 - any import failure means the anchor is absent
        raise _Skip(f"flashinfer not importable: {e}") from None
    n = key.shape[0]
    if fmt == "nvfp4":
        kernel = getattr(page, "_nvfp4_quantize_append_paged_kv_cache_with_slot_mapping_kernel", None)
        if kernel is None:
            raise _Skip(f"flashinfer {flashinfer.__version__} has no NVFP4 append kernel")
        data = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE // 2, dtype=torch.uint8, device="cuda")
        sf = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE // 16, dtype=torch.float8_e4m3fn, device="cuda")
        gs = scale.reshape(1)
        return lambda: kernel(key, value, slots, data[:, 0], data[:, 1], sf[:, 0], sf[:, 1], gs, gs, 0)
    if fmt != "bfloat16":
        raise _Skip("flashinfer appends already-quantized FP8 rows only (no fused quantize)")
    cache = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype=torch.bfloat16, device="cuda")
    s32 = slots.to(torch.int32)
    # One single-page request per token maps FlashInfer's (batch, position) addressing onto slots.
    batch = torch.arange(n, dtype=torch.int32, device="cuda")
    pos, indices = s32 % BLOCK_SIZE, s32 // BLOCK_SIZE
    indptr = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    last = s32 % BLOCK_SIZE + 1
    append = page.append_paged_kv_cache
    return lambda: append(key, value, batch, pos, cache, indices, indptr, last)


def time_eager(fn, calls: int = 2000, trials: int = 7) -> tuple[float, float]:
    """(us per call back-to-back, us per call with a synchronize after each)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    pipelined, latency = [], []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        pipelined.append((time.perf_counter() - start) / calls * 1e6)
        start = time.perf_counter()
        for _ in range(calls // 4):
            fn()
            torch.cuda.synchronize()
        latency.append((time.perf_counter() - start) / (calls // 4) * 1e6)
    return statistics.median(pipelined), statistics.median(latency)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer anchor (JIT build)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead benchmark: needs a CUDA device; nothing measured")
        return 1
    import kvfuse  # noqa: F401 - registers the ops
    from kvfuse.ops import native

    info = common.device_info("python -m benchmarks.host_overhead" + (" --no-flashinfer" if args.no_flashinfer else ""))
    build = native.build_info(build=True)
    print(f"{info['device']}; native build: {build.get('gencode')} in {build.get('build_seconds')} s", flush=True)
    impls = [i for i in IMPLS if not (args.no_flashinfer and i == "flashinfer")]
    rows, notes = [], []
    for fmt in FORMATS:
        for num_tokens in TOKENS:
            for impl in impls:
                try:
                    fn, backend = make_call(impl, fmt, num_tokens)
                    if backend is not None:
                        _force(backend)
                    us, latency = time_eager(fn)
                    device = common.bench([fn], trials=7, min_ms=1.0)
                except _Skip as e:
                    notes.append(f"{impl} {fmt}: skipped ({e})")
                    continue
                except Exception as e:  # noqa: BLE001 - one failing anchor must not stop the others
                    notes.append(f"{impl} {fmt} T={num_tokens}: failed: {type(e).__name__}: {str(e)[:200]}")
                    print(notes[-1], flush=True)
                    continue
                row = {"kv_cache_dtype": fmt, "num_tokens": num_tokens, "impl": impl, "us_per_call": round(us, 2),
                       "latency_us": round(latency, 2), "device_us": round(device.us, 2),
                       "device_graphed": device.graphed}
                rows.append(row)
                print(f"{fmt:9s} T={num_tokens:3d} {impl:11s} {us:7.2f} us/call  latency {latency:7.2f} us  "
                      f"device {device.us:6.2f} us", flush=True)
    os.environ.pop("KVFUSE_CACHE_WRITE_BACKEND", None)

    by = {(r["kv_cache_dtype"], r["num_tokens"], r["impl"]): r for r in rows}
    for fmt in FORMATS:
        for n in TOKENS:
            for level in ("op", "fn"):
                nat, tri = by.get((fmt, n, f"native {level}")), by.get((fmt, n, f"triton {level}"))
                if nat and tri:
                    nat["vs_triton"] = round(nat["us_per_call"] / tri["us_per_call"], 3)
    payload = {**info, "native_build": {k: build.get(k) for k in ("gencode", "build_seconds")}, "rows": rows}
    common.write_json(os.path.join(args.out, "host_overhead.json"), payload)
    table = []
    for fmt in FORMATS:
        for n in TOKENS:
            cells = []
            for impl in impls:
                r = by.get((fmt, n, impl))
                cells.append("-" if r is None else f"{r['us_per_call']:.1f} / {r['latency_us']:.1f} / {r['device_us']:.1f}"
                             + (f" ({r['vs_triton']:.2f}x)" if "vs_triton" in r else ""))
            table.append([fmt, n] + cells)
    body = common.markdown_table(["cache dtype", "tokens"] + impls, table)
    notes = [
        "cells: us per call back-to-back / us per call with a sync after each / device us (CUDA graph replay); "
        "(Nx) = native us per call / Triton's at the same level",
        "op = public kvfuse op (Python validation + backend selection + kernel), fn = backend function alone",
    ] + notes
    common.write_markdown(os.path.join(args.out, "host_overhead.md"),
                          "Host overhead per eager cache-write call (8 KV heads, D=128, bf16 input)", info, body, notes)
    series = {fmt: {} for fmt in FORMATS}
    for r in rows:
        series[r["kv_cache_dtype"]].setdefault(r["impl"], []).append((r["num_tokens"], r["us_per_call"]))
    common.plot_lines(os.path.join(args.out, "host_overhead.png"), series, "eager call", "tokens", "us per call",
                      panels=list(FORMATS))
    return 0


# Read (as text) by `python -m kvfuse bench`, which refuses to start this on a host without CUDA.
REQUIRES_CUDA = True


if __name__ == "__main__":
    sys.exit(main())
