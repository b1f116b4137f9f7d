"""Rotary embedding + K/V cache write, fused vs not, for one layer (GPU).

    python -m benchmarks.rope_write [--quick] [--rounds N] [--out benchmarks/results] [--scales K,V]

One Llama-shaped layer (32 query heads, 8 KV heads, head_size 128, bf16 activations), a decode
step of 64 tokens and a 4096-token prefill, bf16 / FP8 e4m3 / NVFP4 caches. Per case:

- ``write``: ``kvfuse::encode_and_cache_write`` of an already rotated K (the floor);
- ``rope_k+write``: ``kvfuse::rope_encode_and_cache_write`` without a query (the issue's goal:
  <= 1.1x ``write``);
- ``rope_k+write (triton)`` / ``(native)``: Triton's fused kernel and the native one
  (``csrc/cuda/cache_write.cu``), each forced; the op picks one by the
  measured policy of :mod:`kvfuse.ops.tuning`;
- ``rope_k+write (split)`` / ``(gather)``: Triton's kernel with each rotation forced
  (``rotation=`` of the Triton launcher: partners taken from the loaded rows, or by a second
  load), to time both in one run; its launcher picks one by format and token count
  (:mod:`kvfuse.ops.tuning`);
- ``rotate_k, write``: the same function compiled without the rotary fusion (Inductor's rotation
  kernel, then the write);
- ``rope_qk+write``: the fused op rotating the query too (what the pass emits per layer), and
  ``rope_qk+write (triton)`` / ``(native)``: each kernel forced;
- ``rotate_qk, write``: transformers' ``apply_rotary_pos_emb`` of Q and K compiled by Inductor,
  then the write (the unfused graph of a layer);
- ``flashinfer``: ``rope_quantize_fp8_append_paged_kv_cache`` (FP8 only; it also quantizes Q
  to FP8, so it writes half the query bytes kvfuse writes), where importable.

FP8 caches take K / V scales of 0.5 / 0.25 by default: powers of two, which the native FP8 encode
divides by with one product per value (as for an engine's default scale of 1); ``--scales K,V``
times other scales, which take its corrected reciprocal (a product and two FMAs per value).

By default each variant is timed after the other, the median of its own trials, and a ratio is
one of those medians over another. ``--rounds N`` times a case's variants in turn instead, N rounds
of one sample of each (:func:`benchmarks.common.bench_interleaved`): a variant's cell is the median
of its samples, a ratio the median of its per-round ratios, shown with their range, and the row in
the JSON holds every sample. A slow level of the machine that comes and goes during a run then
falls on both sides of a ratio alike.

Every variant is checked against the reference before it is timed. Results:
``benchmarks/results/rope_write.json`` and ``rope_write.md``; a short table is printed last.

``--sweep``: Triton's fused kernel without a query under each launch config of
:func:`triton_configs` (``(BLOCK_T, BLOCK_H, BLOCK_D, num_warps)``), each checked bit-exact
against the op first, beside its default config and the write alone, into
``rope_write_sweep.json``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

import torch

from . import common

logger = logging.getLogger(__name__)

HQ, HKV, D = 32, 8, 128
BLOCK_SIZE = 16
FORMATS = {"bfloat16": "auto", "fp8": "fp8", "nvfp4": "nvfp4"}


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


#: FP8 scales (K, V) by default: powers of two, so FP8 writes divide by one product per value
#: (Division::kExact in csrc/cuda/cache_write.cu, as for engines' default scale of 1); ``--scales``
#: times other scales, which take the corrected reciprocal.
DEFAULT_SCALES = (0.5, 0.25)


class Case:
    def __init__(self, fmt: str, num_tokens: int, rotations: int, seed: int = 0,
                 scales: tuple[float, float] = DEFAULT_SCALES):
        import kvfuse

        g = torch.Generator(device="cuda").manual_seed(seed)
        self.fmt, self.num_tokens = fmt, num_tokens
        self.spec = kvfuse.KVCacheConfig(kv_cache_dtype=FORMATS[fmt]).layer_spec(
            "bench.layers.0.attn", num_kv_heads=HKV, head_size=D, model_dtype=torch.bfloat16, layer_index=0)
        self.mode = int(self.spec.kv_quant_mode)
        self.num_blocks = num_tokens // BLOCK_SIZE + 8
        n = num_tokens

        def qkv():
            # q, k, v as views of one projection output, as a model hands them over
            out = torch.randn(n, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16, generator=g)
            q, k, v = out.split([HQ * D, HKV * D, HKV * D], dim=-1)
            return q.view(n, HQ, D), k.view(n, HKV, D), v.view(n, HKV, D)

        self.sets = [qkv() for _ in range(rotations)]
        self.slots = [torch.randperm(self.num_blocks * BLOCK_SIZE, device="cuda", generator=g)[:n]
                      for _ in range(rotations)]
        positions = torch.arange(1000, 1000 + n, device="cuda")
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
        freqs = positions[:, None].float() * inv_freq
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # FlashInfer's table, [n, D]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().bfloat16(), emb.sin().bfloat16()  # transformers' tables, per token
        # What the compile pass hands the op for transformers' models: the float32 values before
        # their .to(bf16), one column per pair (the graph's tables repeat each half).
        self.tables = {"bf16": (self.cos, self.sin),
                       "bf16 half": (freqs.cos().bfloat16(), freqs.sin().bfloat16()),
                       "f32": (emb.cos(), emb.sin()),
                       "f32 half": (freqs.cos(), freqs.sin())}
        self.k_scale = torch.tensor(scales[0], device="cuda")
        self.v_scale = torch.tensor(scales[1], device="cuda")
        self.cache = self.new_cache()

    def new_cache(self):
        import kvfuse

        return kvfuse.allocate_kv_cache(self.spec, self.num_blocks, BLOCK_SIZE, device="cuda")

    @staticmethod
    def bytes_per_call(num_tokens: int) -> int:
        """Bytes of input every variant reads: K and V (only some read the query). Sizing the
        rotating sets by these keeps K and V out of L2 for the key-only variants too. Counting the
        query as well (the sizing up to the fifteenth session) gave 1024 tokens five sets whose K
        and V (21 MB) fit the H100's 50 MB L2, and the rotary writes looked cheaper there than
        they are on cold inputs (BENCHMARKS.md, fifteenth session)."""
        return num_tokens * 2 * HKV * D * 2


def _write(case: Case):
    from kvfuse.ops import reference

    rotated = [reference.apply_rope(k, case.cos, case.sin, None, D, True) for _, k, _ in case.sets]
    return [lambda i=i: torch.ops.kvfuse.encode_and_cache_write(
        rotated[i], case.sets[i][2], case.cache, case.slots[i], case.k_scale, case.v_scale, case.mode, "l")
        for i in range(len(case.sets))]


def _kernel_calls(case: Case, with_query: bool, kernel, tables: str = "bf16", **kwargs):
    """Calls of one rotary-write kernel function (the op's argument list, no layer name), with
    ``case.tables[tables]`` as cos / sin."""
    cos, sin = case.tables[tables]
    return [lambda i=i: kernel(
        case.sets[i][0] if with_query else None, case.sets[i][1], case.sets[i][2], case.cache, case.slots[i],
        case.k_scale, case.v_scale, cos, sin, None, D, True, case.mode, **kwargs)
        for i in range(len(case.sets))]


def _layer_op(*args):
    """The op as a layer calls it (the kernel functions' argument list, and a layer name)."""
    return torch.ops.kvfuse.rope_encode_and_cache_write(*args, "l")


def _fused(case: Case, with_query: bool, tables: str = "bf16"):
    return _kernel_calls(case, with_query, _layer_op, tables)


def _fused_as(case: Case, with_query: bool, rotation: str, tables: str = "bf16"):
    from kvfuse.ops.triton import rope_kv_write

    return _kernel_calls(case, with_query, rope_kv_write.rope_encode_and_cache_write, tables, rotation=rotation)


def _native(case: Case, with_query: bool, tables: str = "bf16"):
    from kvfuse.ops import native

    return _kernel_calls(case, with_query, native.rope_encode_and_cache_write, tables, force=True)


def _compiled(case: Case, with_query: bool):
    import kvfuse

    def layer(q, k, v, cache, slots, cos, sin, k_scale, v_scale):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        k = (k * cos) + (_rotate_half(k) * sin)
        torch.ops.kvfuse.encode_and_cache_write(k, v, cache, slots, k_scale, v_scale, case.mode, "l")
        if with_query:
            return (q * cos) + (_rotate_half(q) * sin)
        return None

    # Each case is a new closure over the same code object: without a reset, Dynamo counts every
    # case's graph against one recompile limit (8), which fullgraph=True turns into an error.
    torch._dynamo.reset()
    # fuse=False: Inductor's own rotation kernel before the (already fused) encode + write
    fn = torch.compile(layer, backend=kvfuse.make_backend(fuse=False), fullgraph=True, dynamic=False)
    return [lambda i=i: fn(*case.sets[i], case.cache, case.slots[i], case.cos, case.sin, case.k_scale, case.v_scale)
            for i in range(len(case.sets))]


class _Skip(Exception):
    pass


def _flashinfer(case: Case):
    if case.fmt != "fp8":
        raise _Skip("FlashInfer's rope_quantize_fp8_append_paged_kv_cache writes FP8 caches only")
    try:
        import flashinfer
        fn = getattr(flashinfer, "rope_quantize_fp8_append_paged_kv_cache", None)
        if fn is None:
            from flashinfer import rope as rope_mod

            fn = getattr(rope_mod, "rope_quantize_fp8_append_paged_kv_cache")
    except Exception as e:  # noqa: BLE001 - any import failure means the anchor is absent
        raise _Skip(f"flashinfer's rope_quantize_fp8_append_paged_kv_cache is not importable: {e}") from None
    n = case.num_tokens
    pages = case.num_blocks
    k_cache = torch.zeros(pages, BLOCK_SIZE, HKV, D, dtype=torch.float8_e4m3fn, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    kv_indices = torch.arange(pages, dtype=torch.int32, device="cuda")
    kv_indptr = torch.tensor([0, pages], dtype=torch.int32, device="cuda")
    batch = torch.zeros(n, dtype=torch.int32, device="cuda")
    pos_in_seq = torch.arange(n, dtype=torch.int32, device="cuda")
    pos_ids = torch.arange(n, dtype=torch.int32, device="cuda")
    q_out = [torch.empty(n, HQ, D, dtype=torch.float8_e4m3fn, device="cuda") for _ in case.sets]
    # contiguous copies: the kernel's contract does not promise strided inputs
    sets = [tuple(t.contiguous() for t in qkv) for qkv in case.sets]
    return [lambda i=i: fn(sets[i][0], sets[i][1], None, None, sets[i][2], case.cos_sin_cache,
                           pos_ids, (k_cache, v_cache), kv_indices, kv_indptr, batch, pos_in_seq, is_neox=True,
                           quantize_dtype=torch.float8_e4m3fn, page_size=BLOCK_SIZE, kv_layout="NHD",
                           q_rope_out=q_out[i]) for i in range(len(case.sets))]


def _check(case: Case, with_compiled: bool = True) -> None:
    """The fused op (both rotations) and, with ``with_compiled``, the unfused compiled layer write
    the same cache bytes and rotated query."""
    from kvfuse.ops import reference

    q, k, v = case.sets[0]
    want = case.new_cache()
    want_q = reference.rope_encode_and_cache_write(q, k, v, want, case.slots[0], case.k_scale, case.v_scale,
                                                   case.cos, case.sin, None, D, True, case.mode)
    saved = case.cache
    got_fused, got_split, got_gather = case.new_cache(), case.new_cache(), case.new_cache()
    case.cache = got_fused
    fused_q = _fused(case, True)[0]()
    case.cache = got_split
    split_q = _fused_as(case, True, "split")[0]()
    case.cache = got_gather
    gather_q = _fused_as(case, True, "gather")[0]()
    results = [("fused", got_fused, fused_q)]
    if with_compiled:
        got_compiled = case.new_cache()
        case.cache = got_compiled
        compiled_q = _compiled(case, True)[0]()
        results.append(("compiled", got_compiled, compiled_q))
    case.cache = saved
    for name, cache, rq in results:
        same_cache = torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
        same_q = torch.equal(rq.view(torch.int16), want_q.view(torch.int16))
        if not (same_cache and same_q):
            # contraction: the GPU kernels may use fma; report, do not hide
            diff = (cache.view(torch.uint8) != want.view(torch.uint8)).sum().item()
            logger.warning("%s %s T=%d: differs from the no-fma reference: %d cache bytes, query equal: %s",
                           name, case.fmt, case.num_tokens, diff, same_q)
    if with_compiled and (not torch.equal(got_fused.view(torch.uint8), got_compiled.view(torch.uint8)) or
                          not torch.equal(fused_q.view(torch.int16), compiled_q.view(torch.int16))):
        logger.warning("fused and compiled-unfused differ for %s T=%d", case.fmt, case.num_tokens)
    others = [("split", got_split, split_q), ("gather", got_gather, gather_q)]
    got_native = case.new_cache()
    case.cache = got_native
    native_q = _native(case, True)[0]()
    case.cache = saved
    others.append(("native", got_native, native_q))
    for tables in case.tables:
        if tables == "bf16":
            continue
        cos, sin = case.tables[tables]
        # the contracted form, fma(x, cos, rot * sin): what every CUDA kernel of the op computes
        want_t = case.new_cache()
        want_tq = reference.rope_encode_and_cache_write(q, k, v, want_t, case.slots[0], case.k_scale, case.v_scale,
                                                        cos, sin, None, D, True, case.mode, contract=True)
        # the op as timed (key only: its query output is empty), the native kernel with the query
        for label, make in (("op", lambda: _fused(case, False, tables)), ("native", lambda: _native(case, True, tables))):
            got = case.new_cache()
            case.cache = got
            got_q = make()[0]()
            case.cache = saved
            same_q = label == "op" or torch.equal(got_q.view(torch.int16), want_tq.view(torch.int16))
            if not torch.equal(got.view(torch.uint8), want_t.view(torch.uint8)) or not same_q:
                logger.warning("%s with %s tables differs from the reference for %s T=%d", label, tables, case.fmt,
                               case.num_tokens)
    for other, cache, rq in others:
        if not torch.equal(got_fused.view(torch.uint8), cache.view(torch.uint8)) or \
                not torch.equal(fused_q.view(torch.int16), rq.view(torch.int16)):
            logger.warning("the op and its %s rotation differ for %s T=%d", other, case.fmt, case.num_tokens)


VARIANTS = {
    "write": _write,
    "rope_k+write": lambda c: _fused(c, False),
    "rope_k+write (triton)": lambda c: _fused_as(c, False, None),
    "rope_k+write (native)": lambda c: _native(c, False),
    # the tables compiled transformers models hand the op (float32, one column per pair), and the others
    "rope_k+write, f32 half tables": lambda c: _fused(c, False, "f32 half"),
    "rope_k+write (native), f32 half tables": lambda c: _native(c, False, "f32 half"),
    "rope_k+write (native), f32 tables": lambda c: _native(c, False, "f32"),
    "rope_k+write (native), bf16 half tables": lambda c: _native(c, False, "bf16 half"),
    "rope_k+write (split)": lambda c: _fused_as(c, False, "split"),
    "rope_k+write (gather)": lambda c: _fused_as(c, False, "gather"),
    "rotate_k, write": lambda c: _compiled(c, False),
    "rope_qk+write": lambda c: _fused(c, True),
    "rope_qk+write (triton)": lambda c: _fused_as(c, True, None),
    "rope_qk+write (native)": lambda c: _native(c, True),
    "rope_qk+write, f32 half tables": lambda c: _fused(c, True, "f32 half"),
    "rope_qk+write (triton), f32 half tables": lambda c: _fused_as(c, True, None, "f32 half"),
    "rope_qk+write (native), f32 half tables": lambda c: _native(c, True, "f32 half"),
    "rotate_qk, write": lambda c: _compiled(c, True),
    "flashinfer": _flashinfer,
}


RATIOS = {"rope_k+write / write": ("rope_k+write", "write"),
          "triton rope_k+write / write": ("rope_k+write (triton)", "write"),
          "native rope_k+write / write": ("rope_k+write (native)", "write"),
          "f32 half tables / write": ("rope_k+write, f32 half tables", "write"),
          "native f32 half tables / write": ("rope_k+write (native), f32 half tables", "write"),
          "native bf16 half tables / write": ("rope_k+write (native), bf16 half tables", "write"),
          "rope_qk+write / unfused": ("rope_qk+write", "rotate_qk, write")}


def triton_configs(head_size: int = D) -> list[tuple[int, int, int, int]]:
    """Launch configs of the sweep: 1-4 tokens x 1-8 heads per program, 8 to 32 elements a thread."""
    out = []
    for block_t in (1, 2, 4):
        for block_h in (1, 2, 4, 8):
            for num_warps in (1, 2, 4, 8):
                per_thread = block_t * block_h * head_size // (32 * num_warps)
                if 8 <= per_thread <= 32:
                    out.append((block_t, block_h, head_size, num_warps))
    return out


def sweep(token_counts, formats, trials: int, out_json: str, info: dict,
          scales: tuple[float, float] = DEFAULT_SCALES) -> list[dict]:
    """Triton's rotary write (no query) under each of :func:`triton_configs`; rows of us per call,
    written to ``out_json`` after each case (a run cut short keeps what it timed)."""
    from kvfuse.ops.triton import rope_kv_write

    rows = []
    for num_tokens in token_counts:
        rotations = common.rotations_for(Case.bytes_per_call(num_tokens))
        for fmt in formats:
            case = Case(fmt, num_tokens, rotations, scales=scales)
            want = case.new_cache()
            saved, case.cache = case.cache, want
            _fused_as(case, False, None)[0]()
            case.cache = saved
            row = {"tokens": num_tokens, "format": fmt, "write": round(common.bench(_write(case), trials=trials).us, 2),
                   "default": round(common.bench(_fused_as(case, False, None), trials=trials).us, 2)}
            for config in triton_configs():
                name = "x".join(map(str, config))
                got = case.new_cache()
                case.cache = got
                try:
                    _kernel_calls(case, False, rope_kv_write.rope_encode_and_cache_write, launch_config=config)[0]()
                    if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                        logger.warning("sweep %s %s T=%d: cache bytes differ from the default config's",
                                       name, fmt, num_tokens)
                        row[name] = None
                        continue
                    case.cache = saved
                    row[name] = round(common.bench(
                        _kernel_calls(case, False, rope_kv_write.rope_encode_and_cache_write, launch_config=config),
                        trials=trials).us, 2)
                except Exception as e:  # noqa: BLE001 - a config Triton cannot build is a result, not a stop
                    logger.warning("sweep %s %s T=%d: %s", name, fmt, num_tokens, str(e).splitlines()[0][:160])
                    row[name] = None
                finally:
                    case.cache = saved
            timed = {k: v for k, v in row.items() if "x" in k and v}
            best = min(timed, key=timed.get) if timed else None
            row["best"] = best
            if best:
                row["best / write"] = round(timed[best] / row["write"], 3)
                row["default / write"] = round(row["default"] / row["write"], 3)
            logger.info("sweep %s T=%d: write %.2f, default %.2f, best %s %.2f", fmt, num_tokens, row["write"],
                        row["default"], best, timed.get(best, float("nan")))
            rows.append(row)
            common.write_json(out_json, {"info": info, "rows": rows})
    return rows


def _calls_or_skip(case: Case, variants: dict, row: dict, notes: list) -> dict:
    """The calls of every variant that applies to ``case``; the others get None in ``row`` and
    their reason in ``notes``."""
    calls = {}
    for name, make in variants.items():
        try:
            calls[name] = make(case)
        except _Skip as e:
            row[name] = None
            if str(e) not in notes:
                notes.append(str(e))
    return calls


def _cell(row: dict, key: str) -> str:
    """A table cell: the value, with its per-round range where interleaving measured one."""
    if row.get(key) is None:
        return "-"
    span = row.get(key + " range")
    return f"{row[key]} ({span[0]}-{span[1]})" if span else str(row[key])


def _time_one_by_one(case: Case, variants: dict, trials: int, row: dict, notes: list) -> None:
    """Each variant in turn, the median of its own trials; ratios of those medians."""
    for name, calls in _calls_or_skip(case, variants, row, notes).items():
        timing = common.bench(calls, trials=trials)
        row[name] = round(timing.us, 2)
        if not timing.graphed:
            notes.append(f"{name} {case.fmt} T={case.num_tokens}: timed without a CUDA graph")
    for ratio, (num, den) in RATIOS.items():
        if row.get(num) and row.get(den):
            row[ratio] = round(row[num] / row[den], 3)


def _time_interleaved(case: Case, variants: dict, rounds: int, row: dict, notes: list) -> None:
    """All variants in turn, ``rounds`` samples each: medians per variant, and each ratio as the
    median of its per-round ratios, with their range under ``"<ratio> range"``; the samples go in
    the row (``"samples"``)."""
    timed = common.bench_interleaved(_calls_or_skip(case, variants, row, notes), rounds=rounds)
    for name, samples in timed.samples.items():
        row[name] = round(timed.median(name), 2)
        if not timed.graphed[name]:
            notes.append(f"{name} {case.fmt} T={case.num_tokens}: timed without a CUDA graph")
    for ratio, (num, den) in RATIOS.items():
        if num in timed.samples and den in timed.samples:
            mid, lo, hi = timed.ratio(num, den)
            row[ratio] = round(mid, 3)
            row[ratio + " range"] = [round(lo, 3), round(hi, 3)]
    row["samples"] = {name: [round(us, 3) for us in samples] for name, samples in timed.samples.items()}


# Read (as text) by `python -m kvfuse bench`, which refuses to start this on a host without CUDA.
REQUIRES_CUDA = True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--quick", action="store_true", help="fewer trials (a smoke run)")
    parser.add_argument("--tokens", default="64,4096", help="comma-separated token counts (default 64,4096)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of " + ",".join(FORMATS))
    parser.add_argument("--variants", default=None,
                        help="semicolon-separated subset (names hold commas) of: " + "; ".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=0, metavar="N",
                        help="time a case's variants in turn, N rounds of one sample each, and take each "
                             "ratio round by round (common.bench_interleaved); 0 (default): one variant "
                             "after another, each the median of its own trials")
    parser.add_argument("--sweep", action="store_true",
                        help="only the sweep of Triton's launch configs (see the module docstring)")
    parser.add_argument("--scales", default=",".join(str(s) for s in DEFAULT_SCALES), metavar="K,V",
                        help="the K and V scales, two positive finite floats (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        scales = tuple(float(x) for x in args.scales.split(","))
    except ValueError:
        scales = ()
    if len(scales) != 2 or not all(math.isfinite(x) and x > 0 for x in scales):
        parser.error(f"--scales {args.scales!r}: want two positive finite floats, K,V")
    token_counts = [int(t) for t in args.tokens.split(",") if t]
    formats = [f for f in args.formats.split(",") if f]
    names = list(VARIANTS) if args.variants is None else [n.strip() for n in args.variants.split(";") if n.strip()]
    unknown = sorted(set(formats) - set(FORMATS)) + sorted(set(names) - set(VARIANTS))
    if unknown or any(t <= 0 for t in token_counts):
        parser.error(f"unknown formats or variants {unknown}, or a token count that is not positive: {args.tokens}")
    if args.rounds < 0 or args.rounds == 1:
        parser.error(f"--rounds {args.rounds}: want 0 (no interleaving) or at least 2 rounds")
    if args.rounds and args.sweep:
        parser.error("--rounds times the variants, --sweep the launch configs: give one of them")
    variants = {name: VARIANTS[name] for name in names}
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        print("rope_write: needs a CUDA device", file=sys.stderr)
        return 2
    info = common.device_info(" ".join(["python -m benchmarks.rope_write"] + list(sys.argv[1:] if argv is None else argv)))
    trials = 5 if args.quick else 15
    if args.sweep:
        rows = sweep(token_counts, [f for f in formats if f != "bfloat16"] or formats, trials,
                     os.path.join(args.out, "rope_write_sweep.json"), info, scales)
        print("tokens format write default best(config us) best/write default/write")
        for r in rows:
            print(r["tokens"], r["format"], r["write"], r["default"], r["best"], r.get(r["best"]) if r["best"] else None,
                  r.get("best / write"), r.get("default / write"))
        return 0
    rows, notes = [], []
    for num_tokens in token_counts:
        rotations = common.rotations_for(Case.bytes_per_call(num_tokens))
        for fmt in formats:
            case = Case(fmt, num_tokens, rotations, scales=scales)
            _check(case, with_compiled=any(name.startswith("rotate") for name in variants))
            row = {"tokens": num_tokens, "format": fmt}
            if args.rounds:
                _time_interleaved(case, variants, args.rounds, row, notes)
            else:
                _time_one_by_one(case, variants, trials, row, notes)
            rows.append(row)
            logger.info("%s", row)
            common.write_json(os.path.join(args.out, "rope_write.json"), {"info": info, "rows": rows, "notes": notes})
    headers = ["tokens", "format", *variants, *(r for r, (n, d) in RATIOS.items() if n in variants and d in variants)]
    table = common.markdown_table(headers, [[_cell(r, h) for h in headers] for r in rows])
    common.write_markdown(os.path.join(args.out, "rope_write.md"),
                          "Rotary embedding + cache write, one layer (32/8 heads, D=128, bf16), us per call",
                          info, table, notes)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
