"""Print the short goal table of a GPU run from the results JSON files in one directory.

    python -m benchmarks.summary DIR

Reads whichever of cache_write.json, attention.json, decode_step.json, host_overhead.json,
compile_pass.json, attention_decode_focus.json and rope_write.json are in DIR, and the
attention.json of each ``attention_<variant>`` folder (the ``variants`` phase); a missing file
leaves its lines out.
"""

from __future__ import annotations

import json
import os
import sys


def _load(directory: str, name: str):
    path = os.path.join(directory, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _pick(rows, **where):
    """The last matching row: files that merge several runs list the newest last."""
    found = None
    for row in rows:
        if all(row.get(k) == v for k, v in where.items()):
            found = row
    return found


def _us(row) -> str:
    return "-" if row is None else f"{row['us']:.1f}"


def _frac(row) -> str:
    return "-" if row is None or row.get("frac_of_copy") is None else f"{100 * row['frac_of_copy']:.0f}%"


def cache_write_lines(data) -> list[str]:
    rows = data["rows"]
    lines = [f"cache write (copy {data['copy_gb_per_s']:.0f} GB/s); us (% of copy)",
             f"{'format':<10}{'tokens':>7} {'kvfuse':>14} {'unfused':>9} {'native':>14} {'flashinfer':>14} "
             f"{'compile':>14}"]
    for fmt in ("bfloat16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "fp8_per_token_head"):
        for tokens in (16, 256, 16384, 65536):
            cells = {impl: _pick(rows, kv_cache_dtype=fmt, num_tokens=tokens, impl=impl)
                     for impl in ("kvfuse", "kvfuse_unfused", "kvfuse_native", "flashinfer", "torch_compile")}
            if cells["kvfuse"] is None:
                continue
            lines.append(
                f"{fmt:<10}{tokens:>7} {_us(cells['kvfuse']):>8} ({_frac(cells['kvfuse']):>4}) "
                f"{_us(cells['kvfuse_unfused']):>9} {_us(cells['kvfuse_native']):>8} ({_frac(cells['kvfuse_native']):>4})"
                f" {_us(cells['flashinfer']):>8} ({_frac(cells['flashinfer']):>4})"
                f" {_us(cells['torch_compile']):>8} ({_frac(cells['torch_compile']):>4})")
    return lines


def attention_lines(data) -> list[str]:
    rows = data["rows"]
    lines = [f"attention (copy {data.get('copy_gb_per_s', 0):.0f} GB/s); us (% of copy)",
             f"{'case':<34} {'kvfuse':>14} {'kvfuse_fi':>10} {'flashinfer':>10} {'fi_tc':>10} {'sdpa':>10}"]
    cases = [("decode", fmt, 64, 4096) for fmt in ("bfloat16", "fp8_e4m3", "nvfp4")]
    cases += [("decode", fmt, 16, 16384) for fmt in ("bfloat16", "fp8_e4m3", "nvfp4")]
    cases += [("decode", "fp8_per_token_head", 64, 4096), ("decode", "fp8_per_token_head", 16, 16384)]
    cases += [("prefill", "bfloat16", 1, n) for n in (4096, 16384)]
    cases += [(op, fmt, batch, context) for op, batch, context in (("chunked_prefill", 8, 4608), ("spec_decode", 64, 4100))
              for fmt in ("bfloat16", "fp8_e4m3")]
    for op, fmt, batch, context in cases:
        cells = {impl: _pick(rows, op=op, kv_cache_dtype=fmt, batch=batch, context=context, impl=impl)
                 for impl in ("kvfuse", "kvfuse_flashinfer", "flashinfer", "flashinfer_tc", "torch_sdpa")}
        if cells["kvfuse"] is None:
            continue
        lines.append(
            f"{op + ' ' + fmt + f' {batch}x{context}':<34} {_us(cells['kvfuse']):>8} ({_frac(cells['kvfuse']):>4})"
            f" {_us(cells['kvfuse_flashinfer']):>10} {_us(cells['flashinfer']):>10} {_us(cells['flashinfer_tc']):>10}"
            f" {_us(cells['torch_sdpa']):>10}")
    return lines


def decode_step_lines(data) -> list[str]:
    lines = ["decode step of the demo model (8 layers, B=64, ctx 4096, CUDA graph)"]
    for row in data["rows"]:
        lines.append(f"  {row.get('kv_cache_dtype', row.get('cache')):<10} {row['us']:>9.1f} us  "
                     f"x{row.get('vs_bf16', float('nan')):.2f} of bf16")
    return lines


def host_overhead_lines(data) -> list[str]:
    lines = ["host+device us per eager call (1 / 64 tokens)"]
    by_impl: dict = {}
    for row in data["rows"]:
        if row.get("kv_cache_dtype") == "fp8_e4m3":
            by_impl.setdefault(row["impl"], {})[row["num_tokens"]] = row["us_per_call"]
    for impl, per in by_impl.items():
        lines.append(f"  {impl:<28} " + " / ".join(f"{per[n]:.1f}" for n in sorted(per)))
    return lines


def compile_pass_lines(data) -> list[str]:
    lines = []
    for entry in data.get("compile", []):
        if entry.get("fuse"):
            lines.append(f"compile {entry['layers']} layers: {entry['compile_s']:.1f} s, kvfuse passes "
                         f"{entry['pass_ms']:.1f} ms = {entry['pass_ms'] / 10 / entry['compile_s']:.2f}%")
    for name, r in sorted(data.get("layer", {}).items()):
        lines.append(f"layer {name}: {r['kernels']} kernels, {r['median_us']:.1f} us")
    return lines


def focus_lines(data) -> list[str]:
    lines = [f"decode tile variants (copy {data.get('copy_gb_s', 0):.0f} GB/s); us (% of copy)"]
    for r in data["rows"]:
        where = f"{r['cache']:<8} B{r['batch']} ctx {r['context']} hq {r.get('num_q_heads', '-')}"
        result = f"{r['us']:.1f} ({100 * r['frac_copy']:.0f}%)" if "us" in r else f"error: {r.get('error', '')[:60]}"
        lines.append(f"  {where:<30} {r['variant']:<34} {result}")
    return lines


VARIANT_CASES = ([("decode", fmt, 64, 4096) for fmt in ("bfloat16", "fp8_e4m3", "nvfp4", "fp8_per_token_head")]
                 + [("prefill", fmt, 1, 4096) for fmt in ("bfloat16", "fp8_e4m3", "nvfp4", "fp8_per_token_head")]
                 + [("chunked_prefill", "bfloat16", 8, 4608), ("spec_decode", "bfloat16", 64, 4100)])


def variant_lines(directory: str) -> list[str]:
    """kvfuse's time per case in each ``attention_<variant>/attention.json`` under ``directory``."""
    runs = {}
    for name in sorted(os.listdir(directory)):
        data = _load(os.path.join(directory, name), "attention") if name.startswith("attention_") else None
        if data is not None:
            runs[name[len("attention_"):]] = data["rows"]
    if not runs:
        return []
    runs = {v: runs[v] for v in sorted(runs, key=lambda v: (v != "default", v))}  # the default first
    lines = ["kvfuse attention by tile variant, us", f"{'case':<34} " + " ".join(f"{v[:24]:>24}" for v in runs)]
    for op, fmt, batch, context in VARIANT_CASES:
        cells = [_pick(rows, op=op, kv_cache_dtype=fmt, batch=batch, context=context, impl="kvfuse")
                 for rows in runs.values()]
        if any(c is not None for c in cells):
            lines.append(f"{op + ' ' + fmt + f' {batch}x{context}':<34} " + " ".join(f"{_us(c):>24}" for c in cells))
    return lines


def prefill_lines(data) -> list[str]:
    """Every row of the ``prefill`` phase (its own folder): case, implementation, us, TFLOP/s."""
    lines = ["prefill matrix (us, TFLOP/s)"]
    for row in data["rows"]:
        case = f"{row['op']} {row.get('kv_cache_dtype', row.get('cache'))} {row['batch']}x{row['context']}"
        timing = _us(row) if "us" in row else str(row.get("error", "-"))[:60]
        lines.append(f"  {case:<34} {row['impl']:<28} {timing:>9} {row.get('tflops', float('nan')):>7.1f}")
    return lines


#: Issue 17's goal: the fused rotary write costs at most this many times the write alone.
ROPE_GOAL = 1.1


def _ratio(row: dict, key: str) -> str:
    """A ratio of rope_write's row, with its per-round range where the run interleaved."""
    if row.get(key) is None:
        return "-"
    span = row.get(key + " range")
    return f"{row[key]:.3f} ({span[0]:.3f}-{span[1]:.3f})" if span else f"{row[key]:.3f}"


def _cell_us(row: dict, key: str) -> str:
    return "-" if row.get(key) is None else f"{row[key]:.2f}"


def rope_write_lines(data) -> list[str]:
    """The rotary write's goal table (benchmarks.rope_write): per case the write alone; the key
    rotated and written by the op as routed, over transformers' full-width bf16 tables and over the
    float32 half tables the compile pass hands the op for transformers' models, each with its
    ratio to the write alone; the query and key rotated with the write, with its ratio to the
    unfused compiled layer; FlashInfer's rotary FP8 write (query and key)."""

    def timed(row: dict, key: str, ratio: str) -> str:
        return "-" if row.get(key) is None else f"{row[key]:.2f} {_ratio(row, ratio)}"

    lines = [f"rotary write, us (ratio; goal: K fused <= {ROPE_GOAL}x the write alone)",
             f"{'format':<9}{'tokens':>7} {'write':>7} {'K, bf16 tables':>29} {'K, f32 half tables':>29}"
             f" {'Q+K fused (/ unfused)':>29} {'flashinfer Q+K':>14}"]
    for row in data["rows"]:
        lines.append(
            f"{row['format']:<9}{row['tokens']:>7} {_cell_us(row, 'write'):>7}"
            f" {timed(row, 'rope_k+write', 'rope_k+write / write'):>29}"
            f" {timed(row, 'rope_k+write, f32 half tables', 'f32 half tables / write'):>29}"
            f" {timed(row, 'rope_qk+write', 'rope_qk+write / unfused'):>29} {_cell_us(row, 'flashinfer'):>14}")
    return lines


def main(directory: str) -> None:
    sections = (("cache_write", cache_write_lines), ("attention", attention_lines),
                ("decode_step", decode_step_lines), ("host_overhead", host_overhead_lines),
                ("compile_pass", compile_pass_lines), ("attention_decode_focus", focus_lines),
                ("rope_write", rope_write_lines))
    for name, render in sections:
        data = _load(directory, name)
        if data is None:
            continue
        try:
            print("\n".join(render(data)))
        except (KeyError, TypeError) as e:
            print(f"{name}: cannot summarise ({e!r})")
        print()
    lines = variant_lines(directory)
    if lines:
        print("\n".join(lines))
    data = _load(os.path.join(directory, "prefill"), "attention")
    if data is not None:
        print("\n".join(prefill_lines(data)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
