"""Benchmark: K/V encode + paged-cache write, kvfuse against its anchors, on one GPU.

    python -m benchmarks.cache_write [--quick] [--out benchmarks/results] [--sweep]

Token counts 1..65536, 8 KV heads, head size 128, block size 16, bf16 input, distinct slots:
random (``--slots random``, the default: decode's scattered writes), whole pages in random order
(``--slots pages``: a prefill's writes through a block table) or consecutive (``--slots
sequential``); cache formats bfloat16 / fp8_e4m3 / fp8_e5m2 / nvfp4 / fp8_per_token_head, and
``fp8_e4m3/nvfp4`` (FP8 keys, NVFP4 values: a mixed format, kvfuse's kernels only, unfused
included, whose ``cache_write`` of mixed rows is the reference). Implementations:

- ``kvfuse``: ``kvfuse::encode_and_cache_write`` on the Triton backend (one fused kernel);
- ``kvfuse_unfused``: ``kvfuse::encode_kv`` for K and V, then ``kvfuse::cache_write``;
- ``kvfuse_native``: the CUDA C++ backend, when ``kvfuse.ops.native`` builds on this machine;
- ``torch_eager``: the plain PyTorch code (quantize, then ``index_put_``);
- ``torch_compile``: ``torch.compile`` of the short form an engine writes by hand for casts and
  FP8 (``(x / scale).clamp(-max, max).to(fp8)``, then ``index_put_`` by block and offset), which
  Inductor fuses into one scatter kernel per tensor; not bit-exact with the reference (the anchor
  given for it, 2703 GB/s, says the same). NVFP4 has no short form: the reference encode.
- ``flashinfer``: ``flashinfer.page.append_paged_kv_cache`` (bf16; FP8 after a torch quantize)
  and ``nvfp4_quantize_append_paged_kv_cache_with_slot_mapping`` (NVFP4), when installed.

Effective bytes = K+V input bytes read + cache bytes written + slot_mapping bytes, once each;
GB/s and the fraction of the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch


from benchmarks import common

HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 128, 16
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384, 65536)
QUICK_TOKENS = (1, 64, 1024, 16384, 65536)
# Mixed formats ("<K dtype>/<V dtype>") last: the anchors skip them, and a skip is remembered.
FORMATS = ("bfloat16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "fp8_per_token_head", "fp8_e4m3/nvfp4")
QUICK_FORMATS = ("bfloat16", "fp8_e4m3", "nvfp4", "fp8_per_token_head", "fp8_e4m3/nvfp4")
# The unfused form of a mixed format writes through the reference's cache_write (no kernel
# declares it), which is not a kernel to time beside the others.
MIXED_IMPLS = ("kvfuse",)
# The two kvfuse kernels first and back to back, before the anchors: the multi-millisecond eager
# anchors warm the GPU, and a kernel timed right after them ran ~2% slower (FP8 at 65536 tokens:
# 142.9 us measured last vs 138.7-139.6 us measured first, same build). csrc/ is built up front.
IMPLS = ("kvfuse", "kvfuse_native", "kvfuse_unfused", "flashinfer", "torch_compile", "torch_eager")


def _format(name: str):
    from kvfuse.kv_cache import KVCacheConfig

    k_name, _, v_name = name.partition("/")
    config = KVCacheConfig(k_cache_dtype=k_name, v_cache_dtype=v_name) if v_name else KVCacheConfig(kv_cache_dtype=name)
    return config.layer_spec("bench.layers.0.attn", HEADS, HEAD_SIZE, torch.bfloat16)


def torch_encode_and_write(key, value, kv_cache, slots, k_scale, v_scale, mode: int):
    """The plain PyTorch anchor: encode K and V, then scatter rows with index_put_ (no -1 slots)."""
    from kvfuse.ops.reference import encode_kv

    block_size, heads, row_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    # Rows of the (blocks * 2 * block_size) flattened cache: one index per row, as engines write it.
    k_index = (slots // block_size) * (2 * block_size) + slots % block_size
    k_rows = encode_kv(key, k_scale, mode, kv_cache.dtype)
    v_rows = encode_kv(value, v_scale, mode, kv_cache.dtype)
    if kv_cache.dtype.itemsize == 1:  # index_put_ on float8 is not implemented everywhere: move bytes
        kv_cache, k_rows, v_rows = kv_cache.view(torch.uint8), k_rows.view(torch.uint8), v_rows.view(torch.uint8)
    flat = kv_cache.view(-1, heads, row_dim)
    flat[k_index] = k_rows
    flat[k_index + block_size] = v_rows


def plain_encode_and_write(key, value, kv_cache, slots, k_scale, v_scale, mode: int):
    """The torch.compile anchor: the hand-written cast / FP8 quantize and a scatter by (block, offset)."""
    from kvfuse.kv_cache import KVQuantMode

    quant = KVQuantMode(mode)
    if quant is KVQuantMode.NVFP4 or quant.is_per_token_head:
        return torch_encode_and_write(key, value, kv_cache, slots, k_scale, v_scale, mode)
    block_size = kv_cache.shape[2]
    block, offset = slots // block_size, slots % block_size
    for half, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
        if quant.is_fp8:
            limit = torch.finfo(kv_cache.dtype).max
            x = (x.float() / scale).clamp(-limit, limit)
        x = x.to(kv_cache.dtype)
        if kv_cache.dtype.itemsize == 1:  # Inductor cannot scatter float8 directly: scatter the bytes
            kv_cache.view(torch.uint8)[block, half, offset] = x.view(torch.uint8)
        else:
            kv_cache[block, half, offset] = x


SLOT_PATTERNS = ("random", "pages", "sequential")


def slot_mapping(pattern: str, num_tokens: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """``num_tokens`` distinct slots of a ``num_blocks``-page cache laid out as ``pattern`` says
    (on ``gen``'s device)."""
    device = gen.device
    if pattern == "random":
        return torch.randperm(num_blocks * BLOCK_SIZE, device=device, generator=gen)[:num_tokens]
    if pattern == "pages":
        pages = torch.randperm(num_blocks, device=device, generator=gen)[: -(-num_tokens // BLOCK_SIZE)]
        return (pages[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)).flatten()[:num_tokens]
    if pattern == "sequential":
        return torch.arange(num_tokens, device=device)
    raise ValueError(f"slot pattern {pattern!r}: expected one of {SLOT_PATTERNS}")


class Case:
    """Buffers for one (format, token count): rotating input sets and one cache per impl."""

    def __init__(self, fmt: str, num_tokens: int, rotations: int, seed: int = 0, slots: str = "random"):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.fmt, self.spec, self.num_tokens = fmt, _format(fmt), num_tokens
        self.mode = self.spec.kv_format.code
        self.num_blocks = -(-2 * num_tokens // BLOCK_SIZE) + 1
        shape = (num_tokens, HEADS, HEAD_SIZE)
        self.keys = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(rotations)]
        self.values = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(rotations)]
        self.slots = [slot_mapping(slots, num_tokens, self.num_blocks, gen) for _ in range(rotations)]
        fmt = self.spec.kv_format
        self.k_scale = torch.tensor(0.05 if fmt.key.is_fp8 else 1.0, device="cuda")
        self.v_scale = torch.tensor(0.05 if fmt.value.is_fp8 else 1.0, device="cuda")

    def new_cache(self) -> torch.Tensor:
        from kvfuse.kv_cache import allocate_kv_cache

        return allocate_kv_cache(self.spec, self.num_blocks, BLOCK_SIZE, device="cuda")

    @property
    def effective_bytes(self) -> int:
        read = 2 * self.num_tokens * HEADS * HEAD_SIZE * 2
        return read + self.num_tokens * self.spec.bytes_per_token + self.num_tokens * 8

    @staticmethod
    def bytes_per_call(fmt: str, num_tokens: int) -> int:
        spec = _format(fmt)
        return num_tokens * (4 * HEADS * HEAD_SIZE + spec.bytes_per_token + 8)


# ----------------------------------------------------------------------------- implementations


def make_kvfuse(case: Case, cache):
    op = torch.ops.kvfuse.encode_and_cache_write
    return [lambda i=i: op(case.keys[i], case.values[i], cache, case.slots[i], case.k_scale, case.v_scale,
                           case.mode, "bench") for i in range(len(case.keys))]


def make_kvfuse_unfused(case: Case, cache):
    enc, write = torch.ops.kvfuse.encode_kv, torch.ops.kvfuse.cache_write
    fmt = case.spec.kv_format
    k_dtype, v_dtype = case.spec.side_storage_dtype(0), case.spec.side_storage_dtype(1)

    def call(i):
        k_rows = enc(case.keys[i], case.k_scale, int(fmt.key), k_dtype, "bench")
        v_rows = enc(case.values[i], case.v_scale, int(fmt.value), v_dtype, "bench")
        write(k_rows, v_rows, cache, case.slots[i], case.mode, "bench")

    return [lambda i=i: call(i) for i in range(len(case.keys))]


def make_kvfuse_native(case: Case, cache):
    from kvfuse.ops import registry as backends

    reason = backends.unavailable_reason("native", "encode_and_cache_write", "cuda", case.mode)
    if reason is not None:
        raise _Skip(f"kvfuse.ops.native unavailable: {reason}")
    import kvfuse.ops.native as native

    return [lambda i=i: native.encode_and_cache_write(case.keys[i], case.values[i], cache, case.slots[i],
                                                      case.k_scale, case.v_scale, case.mode)
            for i in range(len(case.keys))]


def make_torch_eager(case: Case, cache):
    return [lambda i=i: torch_encode_and_write(case.keys[i], case.values[i], cache, case.slots[i], case.k_scale,
                                               case.v_scale, case.mode) for i in range(len(case.keys))]


_COMPILED = {}


# From this token count on, torch.compile gets a static-shape compile per size: its dynamic-shape
# scatter kernels reach a fraction of the static ones' bandwidth, and the anchor is the best
# plain torch.compile can do. Smaller sizes share one dynamic compile per format (compile time).
STATIC_COMPILE_FROM = 4096


def make_torch_compile(case: Case, cache):
    # Every variant compiles the same code object; keep Dynamo from falling back to eager.
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    static = case.num_tokens >= STATIC_COMPILE_FROM
    key = (case.mode, case.num_tokens if static else None)
    if key not in _COMPILED:
        mode = case.mode

        def encode_and_write(key, value, kv_cache, slots, k_scale, v_scale):
            plain_encode_and_write(key, value, kv_cache, slots, k_scale, v_scale, mode)

        _COMPILED[key] = torch.compile(encode_and_write, dynamic=not static)
    fn = _COMPILED[key]
    return [lambda i=i: fn(case.keys[i], case.values[i], cache, case.slots[i], case.k_scale, case.v_scale)
            for i in range(len(case.keys))]


class _Skip(Exception):
    pass


def _flashinfer():
    try:
        import flashinfer
        import flashinfer.page as page
    except Exception as e:  # noqa: BLE001 - any import failure means the anchor is absent
        raise _Skip(f"flashinfer not importable: {e}") from None
    return flashinfer, page


def make_flashinfer(case: Case, cache):
    flashinfer, page = _flashinfer()
    from kvfuse.ops.reference import encode_kv

    n = case.num_tokens
    if case.fmt == "fp8_per_token_head":
        raise _Skip("flashinfer has no per-token-head FP8 cache")
    if case.fmt == "nvfp4":
        kernel = getattr(page, "_nvfp4_quantize_append_paged_kv_cache_with_slot_mapping_kernel", None)
        public = getattr(flashinfer, "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping", None) or \
            getattr(page, "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping", None)
        if kernel is None and public is None:
            raise _Skip(f"flashinfer {flashinfer.__version__} has no "
                        "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping")
        data = torch.zeros(case.num_blocks, 2, BLOCK_SIZE, HEADS, HEAD_SIZE // 2, dtype=torch.uint8, device="cuda")
        sf = torch.zeros(case.num_blocks, 2, BLOCK_SIZE, HEADS, HEAD_SIZE // 16, dtype=torch.float8_e4m3fn,
                         device="cuda")
        ks, vs = case.k_scale.reshape(1), case.v_scale.reshape(1)
        if kernel is not None:  # the op itself, without the public wrapper's host-side scale checks
            return [lambda i=i: kernel(case.keys[i], case.values[i], case.slots[i], data[:, 0], data[:, 1],
                                       sf[:, 0], sf[:, 1], ks, vs, 0) for i in range(len(case.keys))]
        return [lambda i=i: public(case.keys[i], case.values[i], case.slots[i], data, sf, ks, vs, "NHD")
                for i in range(len(case.keys))]
    # One single-page "request" per token maps FlashInfer's (batch, position) addressing onto slots.
    meta = []
    for s in case.slots:
        s32 = s.to(torch.int32)
        meta.append((torch.arange(n, dtype=torch.int32, device="cuda"), s32 % BLOCK_SIZE, s32 // BLOCK_SIZE,
                     torch.arange(n + 1, dtype=torch.int32, device="cuda"), s32 % BLOCK_SIZE + 1))
    append = flashinfer.page.append_paged_kv_cache
    if case.fmt == "bfloat16":
        return [lambda i=i: append(case.keys[i], case.values[i], meta[i][0], meta[i][1], cache, meta[i][2],
                                   meta[i][3], meta[i][4]) for i in range(len(case.keys))]

    def fp8_call(i):
        k_rows = encode_kv(case.keys[i], case.k_scale, case.mode, cache.dtype)
        v_rows = encode_kv(case.values[i], case.v_scale, case.mode, cache.dtype)
        append(k_rows, v_rows, meta[i][0], meta[i][1], cache, meta[i][2], meta[i][3], meta[i][4])

    return [lambda i=i: fp8_call(i) for i in range(len(case.keys))]


MAKERS = {
    "kvfuse": make_kvfuse,
    "kvfuse_unfused": make_kvfuse_unfused,
    "kvfuse_native": make_kvfuse_native,
    "torch_eager": make_torch_eager,
    "torch_compile": make_torch_compile,
    "flashinfer": make_flashinfer,
}


# ----------------------------------------------------------------------------- checks and sweep


def check_kvfuse(case: Case) -> None:
    """The timed kvfuse kernels write exactly the reference's bytes (guards against timing a no-op)."""
    from kvfuse.ops import reference as ref

    expected, fused, unfused = case.new_cache(), case.new_cache(), case.new_cache()
    ref.encode_and_cache_write(case.keys[0], case.values[0], expected, case.slots[0], case.k_scale, case.v_scale,
                               case.mode)
    make_kvfuse(case, fused)[0]()
    checked = [("kvfuse", fused)]
    if not case.spec.is_mixed:
        make_kvfuse_unfused(case, unfused)[0]()
        checked.append(("kvfuse_unfused", unfused))
    for name, got in checked:
        if not torch.equal(got.view(torch.uint8), expected.view(torch.uint8)):
            raise AssertionError(f"{name} {case.fmt} T={case.num_tokens} differs from the reference")


def sweep(copy_gb_s: float, out_dir: str, slots: str = "random") -> dict:
    """Time the fused kernel over tile configs at large token counts (for choosing _launch_config).

    Returns ``{format: (block_t, num_warps)}``, the best by summed time at 16384 and 65536 tokens.
    """
    from kvfuse.ops.triton import kv_write as tcw

    lines, totals = [], {}
    for fmt in ("bfloat16", "fp8_e4m3", "nvfp4"):
        for num_tokens in (16384, 65536):
            case = Case(fmt, num_tokens, common.rotations_for(Case.bytes_per_call(fmt, num_tokens)), slots=slots)
            cache = case.new_cache()
            for block_t in (1, 2, 4, 8):
                for warps in (2, 4, 8):
                    cfg = (block_t, HEADS, HEAD_SIZE, warps)
                    calls = [lambda i=i, cfg=cfg: tcw.encode_and_cache_write(
                        case.keys[i], case.values[i], cache, case.slots[i], case.k_scale, case.v_scale, case.mode,
                        launch_config=cfg) for i in range(len(case.keys))]
                    try:
                        t = common.bench(calls, trials=7, min_ms=5.0)
                        totals[(fmt, block_t, warps)] = totals.get((fmt, block_t, warps), 0) + t.us
                        gbs = case.effective_bytes / (t.us * 1e-6) / 1e9
                        lines.append(f"{fmt:9s} T={num_tokens:6d} BT={block_t:2d} warps={warps} "
                                     f"{t.us:9.2f} us {gbs:7.1f} GB/s {gbs / copy_gb_s:6.1%}")
                    except Exception as e:  # noqa: BLE001
                        lines.append(f"{fmt} T={num_tokens} BT={block_t} warps={warps} failed: {e}")
                    print(lines[-1], flush=True)
            del case, cache
    best = {}
    for (fmt, block_t, warps), _ in sorted(totals.items(), key=lambda kv: kv[1]):
        best.setdefault(fmt, (block_t, warps))
    lines.append(f"best: {best}")
    print(lines[-1], flush=True)
    with open(os.path.join(out_dir, "cache_write_sweep.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return best


def dump_ptx(out_dir: str) -> None:
    """PTX of the fused kernel per format, with its vector-access counts (what the disassembly shows)."""
    from kvfuse.ops.triton import kv_write as tcw

    summary = []
    for fmt in (f for f in FORMATS if "/" not in f):  # the uniform kernel's PTX
        case = Case(fmt, 16384, 1)
        cache = case.new_cache()
        compiled = tcw._launch(case.keys[0], case.values[0], cache, cache, case.slots[0], case.k_scale,
                               case.v_scale, case.num_tokens, HEADS, HEAD_SIZE, case.mode, True,
                               (cache.stride(0), cache.stride(2), cache.stride(3)),
                               (cache.stride(0), cache.stride(2), cache.stride(3)), 2, cache.stride(1))
        ptx = getattr(compiled, "asm", {}).get("ptx", "")
        with open(os.path.join(out_dir, f"cache_write_{fmt}.ptx"), "w") as f:
            f.write(ptx)
        counts = {k: ptx.count(k) for k in ("ld.global.v4", "ld.global.v2", "ld.global.b", "st.global.v4",
                                            "st.global.v2", "st.global.b8", "st.global.b32", "cvt.rn.satfinite")}
        summary.append(f"{fmt}: {counts}")
        print(summary[-1], flush=True)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer token counts and formats")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--sweep", action="store_true", help="also time tile configs of the fused kernel")
    parser.add_argument("--ptx", action="store_true", help="also write the fused kernel's PTX per format")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    parser.add_argument("--slots", default="random", choices=SLOT_PATTERNS,
                        help="where the tokens go: random slots (default), whole pages in random order, or consecutive")
    parser.add_argument("--formats", default=None,
                        help="comma-separated cache formats (default: all, or the --quick ones), of " + ",".join(FORMATS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cache_write benchmark: needs a CUDA device; nothing measured")
        return 1

    os.environ.setdefault("KVFUSE_CACHE_WRITE_BACKEND", "triton")  # "kvfuse" rows = the Triton kernels
    import kvfuse  # noqa: F401 - registers the ops
    from kvfuse.ops import registry as backends

    backends.clear_cache()
    if "kvfuse_native" in args.impls.split(","):
        from kvfuse.ops import native

        native.build_info(build=True)  # a first build takes a minute: not inside a measured case
    command = " ".join(["python -m benchmarks.cache_write"] + list(sys.argv[1:] if argv is None else argv))
    info = common.device_info(command)
    os.makedirs(args.out, exist_ok=True)
    copies = common.copy_bandwidths()
    copy_gb_s = max(copies.values())
    copy_note = ", ".join(f"{k} {v:.0f}" for k, v in copies.items())
    print(f"{info['device']}: device-to-device copy {copy_gb_s:.0f} GB/s ({copy_note})", flush=True)
    if args.ptx:
        dump_ptx(args.out)
    if args.sweep:
        sweep(copy_gb_s, args.out, args.slots)

    tokens = QUICK_TOKENS if args.quick else TOKENS
    formats = QUICK_FORMATS if args.quick else FORMATS
    if args.formats:
        formats = tuple(f for f in args.formats.split(",") if f)
        unknown = sorted(set(formats) - set(FORMATS))
        if unknown:
            parser.error(f"--formats: {unknown} are not among {list(FORMATS)}")
    impls = [i for i in args.impls.split(",") if i]
    rows, skipped, notes = [], {}, []
    for fmt in formats:
        for num_tokens in tokens:
            case = Case(fmt, num_tokens, common.rotations_for(Case.bytes_per_call(fmt, num_tokens)),
                        slots=args.slots)
            check_kvfuse(case)
            for impl in impls:
                if impl in skipped or (case.spec.is_mixed and impl not in MIXED_IMPLS):
                    continue
                try:
                    cache = case.new_cache()
                    calls = MAKERS[impl](case, cache)
                    timing = common.bench(calls)
                except _Skip as e:
                    skipped[impl] = str(e)
                    print(f"skipped {impl}: {e}", flush=True)
                    continue
                except Exception as e:  # noqa: BLE001 - one failing anchor must not stop the others
                    msg = f"{impl} {fmt} T={num_tokens} failed: {type(e).__name__}: {e}"
                    print(msg, flush=True)
                    traceback.print_exc(limit=3)
                    notes.append(msg.splitlines()[0][:300])
                    continue
                if not timing.graphed:
                    notes.append(f"{impl} {fmt} T={num_tokens}: not capturable in a CUDA graph, timed as launches")
                gbs = case.effective_bytes / (timing.us * 1e-6) / 1e9
                rows.append({"op": "encode_and_cache_write", "impl": impl, "kv_cache_dtype": fmt,
                             "num_tokens": num_tokens, "us": round(timing.us, 3), "gb_per_s": round(gbs, 1),
                             "frac_of_copy": round(gbs / copy_gb_s, 4)})
                print(f"{fmt:9s} {num_tokens:6d} {impl:15s} {timing.us:10.2f} us {gbs:8.1f} GB/s "
                      f"{gbs / copy_gb_s:6.1%}", flush=True)
                del calls, cache
            del case
            torch.cuda.empty_cache()
        # after each format, so that a run cut short still leaves its results
        save(args.out, info, rows, tokens, formats, copy_gb_s, skipped,
             notes + [f"copy GB/s by method: {copy_note}", f"slots: {args.slots}"])
    return 0


def save(out_dir, info, rows, tokens, formats, copy_gb_s, skipped, notes) -> None:
    payload = {"device": info["device"], "date": info["date"], "commit": info["commit"],
               "copy_gb_per_s": round(copy_gb_s, 1), "notes": list(notes), "rows": rows}
    common.write_json(os.path.join(out_dir, "cache_write.json"), payload)
    notes = [f"skipped {k}: {v}" for k, v in skipped.items()] + list(notes)
    notes.append(f"copy bandwidth {copy_gb_s:.0f} GB/s (read + write of a 1 GiB device-to-device copy, best "
                 f"method), same run")
    notes.append("every call is timed from a CUDA graph replay on rotating input sets (> 2x L2); "
                 "torch_eager / torch_compile assume no -1 slots; flashinfer fp8 = torch quantize + append")
    write_report(out_dir, info, rows, tokens, formats, copy_gb_s, notes)


def write_report(out_dir, info, rows, tokens, formats, copy_gb_s, notes) -> None:
    by = {(r["kv_cache_dtype"], r["num_tokens"], r["impl"]): r for r in rows}
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    table = []
    for fmt in formats:
        for n in tokens:
            cells = []
            for impl in impls:
                r = by.get((fmt, n, impl))
                cells.append("-" if r is None else
                             f"{r['us']:.1f} us, {r['gb_per_s']:.0f} GB/s ({r['frac_of_copy']:.0%})")
            table.append([fmt, n] + cells)
    body = common.markdown_table(["cache dtype", "tokens"] + impls, table)
    common.write_markdown(os.path.join(out_dir, "cache_write.md"),
                          "K/V encode + paged cache write (8 KV heads, D=128, block 16, bf16 input)",
                          info, body, notes)
    series = {fmt: {} for fmt in formats}
    for r in rows:
        series[r["kv_cache_dtype"]].setdefault(r["impl"], []).append((r["num_tokens"], r["gb_per_s"]))
    common.plot_lines(os.path.join(out_dir, "cache_write.png"), series, "cache write", "tokens",
                      "effective GB/s", hline=(copy_gb_s, "copy"), panels=list(formats))


# Read (as text) by `python -m kvfuse bench`, which refuses to start this on a host without CUDA.
REQUIRES_CUDA = True


if __name__ == "__main__":
    sys.exit(main())
