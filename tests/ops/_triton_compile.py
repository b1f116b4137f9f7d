"""Compile kvfuse's Triton kernels for Hopper (sm_90) on a host without a GPU.

The tests run Triton kernels under ``TRITON_INTERPRET=1``, which executes the Python AST with
NumPy and type-checks nothing a compiled kernel would reject (an ``if`` whose branches bind one
name to two types, a PTX operand of the wrong width, shared memory beyond the SM's). The triton
wheel ships ``ptxas``, so the whole pipeline (TTIR, TTGIR, LLVM IR, PTX, cubin) runs without a
device for an explicit ``GPUTarget``; only loading the cubin needs a driver.

How a configuration is obtained: the real launchers (``kv_write.encode_and_cache_write`` /
``encode_kv`` / ``cache_write``, ``attention.paged_attention``, ``rope_kv_write.rope_encode_and_cache_write``)
are called with meta tensors of realistic shapes while their kernels are replaced by recorders;
each recorded launch (arguments and keyword options) is specialised the way ``JITFunction``
specialises a launch (pointer dtypes, 16-divisibility of pointers and integers, integers equal
to 1 as constants) and compiled with ``triton.compile``. The constexprs are therefore exactly
the launchers' own (``_pick_config``, ``_launch_config``, dot dtype, ROW_ALIGN, ...).

Decided when a kernel is *defined*, interpretation cannot be undone in a process that imported
kvfuse's Triton modules under ``TRITON_INTERPRET=1`` (the test session does): this module runs
as a script in a subprocess with ``TRITON_INTERPRET=0`` (:func:`run_matrix`), compiles every case
once and writes one JSON report. Importing it is cheap and imports neither triton nor kvfuse's
kernels: the case table (:data:`CASES`) is plain data.

Result status per compile: ``ok``; ``error`` (the kernel does not compile: a CompilationError,
an MLIR pass or ptxas failure, or more shared memory than an H100 grants); ``env`` (this host
cannot compile at all, established by a trivial probe kernel failing too, or an error that names
a missing tool or library): reported as a skip with its reason, never as a pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGET = ("cuda", 90, 32)
# Dynamic shared memory an sm_90 block can opt into (227 KiB); a kernel needing more compiles
# but fails to launch with OutOfResources.
H100_MAX_SHARED = 232448


@dataclass(frozen=True)
class Case:
    """One launcher call: ``kernel`` family (``kv_write``, ``attention``, ``rope``) and its inputs."""

    id: str
    kernel: str
    params: dict = field(hash=False)

    def __post_init__(self) -> None:
        if self.kernel not in ("kv_write", "attention", "rope"):
            raise ValueError(f"kernel={self.kernel!r}: expected 'kv_write', 'attention' or 'rope'")


# ----------------------------------------------------------------------------- the case table
#
# Full products are thousands of kernels at seconds each; the table instead crosses each head size
# with each cache MODE (the two constexprs that shape every tile) and spreads the remaining
# switches over those rows so that each value of each switch is compiled in several contexts.
# test_triton_compile.py checks that the recorded constexprs cover every branch value.

_MODES = ("NONE", "FP8_E4M3", "FP8_E5M2", "NVFP4", "FP8_PER_TOKEN_HEAD")
_HEADS = (64, 80, 128, 256)


def _kv_write_cases() -> list[Case]:
    cases = []
    in_dtypes = ("bfloat16", "float16", "float32", "bfloat16")
    for i, head in enumerate(_HEADS):
        for j, mode in enumerate(_MODES):
            k = i + j
            cache = {"NONE": ("bfloat16", "float16", "float32", "float16")[k % 4], "FP8_E4M3": "float8_e4m3fn",
                     "FP8_E5M2": "float8_e5m2", "NVFP4": "uint8", "FP8_PER_TOKEN_HEAD": "uint8"}[mode]
            cases.append(Case(
                f"kv_write-fused-{mode}-d{head}", "kv_write",
                dict(op="encode_and_cache_write", mode=mode, head=head, heads=(1, 2, 8, 4)[k % 4],
                     tokens=(1, 4096, 37, 100000)[k % 4], in_dtype=in_dtypes[k % 4], cache_dtype=cache,
                     soft_rounding=bool(k % 2))))
    for j, mode in enumerate(_MODES):
        cache = {"NONE": "bfloat16", "FP8_E4M3": "float8_e4m3fn", "FP8_E5M2": "float8_e5m2",
                 "NVFP4": "uint8", "FP8_PER_TOKEN_HEAD": "uint8"}[mode]
        cases.append(Case(f"kv_write-encode_kv-{mode}", "kv_write",
                          dict(op="encode_kv", mode=mode, head=(128, 80, 256, 64, 80)[j], heads=8,
                               tokens=(7, 512, 1, 64, 33)[j], in_dtype="bfloat16", cache_dtype=cache,
                               soft_rounding=bool(j % 2))))
    # Per-KV-head scales (K_SCALE_STRIDE_H / V_SCALE_STRIDE_H > 0): the scale loads become per-head vectors.
    for j, (mode, cache) in enumerate((("FP8_E4M3", "float8_e4m3fn"), ("FP8_E5M2", "float8_e5m2"),
                                       ("NVFP4", "uint8"))):
        cases.append(Case(f"kv_write-fused-{mode}-d{(128, 80, 64)[j]}-head_scales", "kv_write",
                          dict(op="encode_and_cache_write", mode=mode, head=(128, 80, 64)[j], heads=(8, 3, 4)[j],
                               tokens=(4096, 37, 1)[j], in_dtype="bfloat16", cache_dtype=cache,
                               soft_rounding=bool(j % 2), head_scales=True)))
    cases.append(Case("kv_write-encode_kv-NVFP4-head_scales", "kv_write",
                      dict(op="encode_kv", mode="NVFP4", head=128, heads=8, tokens=512, in_dtype="bfloat16",
                           cache_dtype="uint8", soft_rounding=False, head_scales=True)))
    for j, row in enumerate(("bfloat16", "float8_e4m3fn", "uint8")):
        cases.append(Case(f"kv_write-cache_write-{row}", "kv_write",
                          dict(op="cache_write", mode="COPY", head=(128, 256, 64)[j], heads=(8, 1, 4)[j],
                               tokens=(3, 8192, 300)[j], cache_dtype=row)))
    # NVFP4 page variants the page-16 rows above leave out: linear V scales (SWIZZLE_V off: d80,
    # or a page of 5) and page sides aligned to 8 or 1 byte only (PAGE_ALIGN, from odd pages).
    cases += [
        Case("kv_write-cache_write-uint8-d80-page5", "kv_write",
             dict(op="cache_write", mode="COPY", head=80, heads=1, tokens=77, cache_dtype="uint8", page=5)),
        Case("kv_write-cache_write-uint8-d128-page4", "kv_write",
             dict(op="cache_write", mode="COPY", head=128, heads=3, tokens=4096, cache_dtype="uint8", page=4)),
        Case("kv_write-fused-NVFP4-d128-page5", "kv_write",
             dict(op="encode_and_cache_write", mode="NVFP4", head=128, heads=1, tokens=300, in_dtype="bfloat16",
                  cache_dtype="uint8", soft_rounding=False, page=5)),
        # Encoded fp8_per_token_head rows (uint8, head + 4 bytes) are copied whole, not split as NVFP4 pages.
        Case("kv_write-cache_write-uint8-per_token_head-d128", "kv_write",
             dict(op="cache_write", mode="COPY", head=128, heads=4, tokens=300, cache_dtype="uint8",
                  copy_mode="FP8_PER_TOKEN_HEAD")),
    ]
    # Mixed formats (K and V in different modes): the fused write's V_MODE branch, one launch per pair.
    for j, (k_mode, v_mode) in enumerate((("NONE", "FP8_E4M3"), ("FP8_E4M3", "NVFP4"), ("NVFP4", "FP8_E4M3"),
                                          ("FP8_PER_TOKEN_HEAD", "NVFP4"), ("FP8_E5M2", "NONE"), ("NVFP4", "NONE"),
                                          ("NVFP4", "FP8_PER_TOKEN_HEAD"))):
        cases.append(Case(f"kv_write-fused-mixed-{k_mode}-{v_mode}-d{(128, 64, 80, 128)[j % 4]}", "kv_write",
                          dict(op="encode_and_cache_write", mode=k_mode, v_mode=v_mode, head=(128, 64, 80, 128)[j % 4],
                               heads=8, tokens=(4096, 7, 300, 1)[j % 4], in_dtype=("bfloat16", "float16")[j % 2],
                               cache_dtype="uint8", soft_rounding=bool(j % 3 == 1), head_scales=j % 2 == 1)))
    return cases


def _attention_cases() -> list[Case]:
    cases = []
    # Scenario rows, rotated over the (mode, head) grid: every scenario meets every mode and
    # every head size at least once. group: query heads per KV head (6: non-power-of-two).
    scenarios = [
        dict(phase="decode", q_dtype="bfloat16", group=4),
        dict(phase="prefill", q_dtype="bfloat16", group=1, window=256, softcap=30.0, sinks=True),
        dict(phase="decode", q_dtype="float16", group=8, splits=4, window=64, sinks=True),
        # float32 queries: decode here (a float32 prefill tile costs ~10 s to compile), prefill once below.
        dict(phase="decode", q_dtype="float32", group=6, keys_first=True, softcap=50.0),
    ]
    for i, head in enumerate(_HEADS):
        for j, mode in enumerate(_MODES):
            sc = dict(scenarios[(i + j) % 4])
            k = i + j
            # Options that only change NVFP4/quantized code, alternated along the rows.
            sc["inline_asm"] = k % 3 != 2
            sc["scale_gather"] = {0: None, 1: True, 2: False}[k % 3]
            sc["quant_dot_fp16"] = k % 4 != 3
            if sc.get("keys_first") is None and k % 5 == 0:
                sc["keys_first"] = True
            cases.append(Case(f"attention-{mode}-d{head}-{sc['phase']}-{sc['q_dtype']}", "attention",
                              dict(mode=mode, head=head, **sc)))
    # Branches the grid above may leave to chance, pinned explicitly.
    cases += [
        Case("attention-NVFP4-d128-decode-split-bf16-noasm", "attention",
             dict(mode="NVFP4", head=128, phase="decode", q_dtype="bfloat16", group=4, splits=8, inline_asm=False,
                  scale_gather=False)),
        Case("attention-FP8_E4M3-d128-decode-split-bf16", "attention",
             dict(mode="FP8_E4M3", head=128, phase="decode", q_dtype="bfloat16", group=8, splits=2, softcap=20.0)),
        Case("attention-FP8_E5M2-d128-decode-bf16-keysfirst", "attention",
             dict(mode="FP8_E5M2", head=128, phase="decode", q_dtype="bfloat16", group=2, keys_first=True,
                  window=128)),
        Case("attention-NVFP4-d256-prefill-bf16dot-keysfirst-nogather", "attention",
             dict(mode="NVFP4", head=256, phase="prefill", q_dtype="bfloat16", group=4, keys_first=True,
                  scale_gather=False, sinks=True, quant_dot_fp16=False)),
        Case("attention-NONE-d128-mixed-bf16", "attention",
             dict(mode="NONE", head=128, phase="mixed", q_dtype="bfloat16", group=4, window=1024)),
        # The prefill tile with BLOCK_N capped for float32 (shared memory: see _FP32_MAX_BLOCK_N).
        Case("attention-NONE-d128-prefill-float32", "attention",
             dict(mode="NONE", head=128, phase="prefill", q_dtype="float32", group=2, sinks=True)),
        # Per-KV-head scales: the scale pointers advance by the program's KV head.
        Case("attention-FP8_E4M3-d128-decode-bf16-head_scales", "attention",
             dict(mode="FP8_E4M3", head=128, phase="decode", q_dtype="bfloat16", group=4, head_scales=True)),
        Case("attention-NVFP4-d128-prefill-bf16-head_scales", "attention",
             dict(mode="NVFP4", head=128, phase="prefill", q_dtype="bfloat16", group=4, head_scales=True)),
        # Block scales through 32-bit words, broadcast (the decode tile) and gathered.
        Case("attention-NVFP4-d128-decode-bf16-words", "attention",
             dict(mode="NVFP4", head=128, phase="decode", q_dtype="bfloat16", group=4, scale_gather=False,
                  word_scales=True)),
        Case("attention-NVFP4-d80-prefill-bf16-words-gather", "attention",
             dict(mode="NVFP4", head=80, phase="prefill", q_dtype="bfloat16", group=2, scale_gather=True,
                  word_scales=True)),
        # Block-table entries read one iteration ahead of their use.
        Case("attention-NONE-d128-prefill-bf16-prefetch", "attention",
             dict(mode="NONE", head=128, phase="prefill", q_dtype="bfloat16", group=4, prefetch_pages=True,
                  longest_first=True)),
        Case("attention-FP8_PER_TOKEN_HEAD-d64-decode-bf16-prefetch", "attention",
             dict(mode="FP8_PER_TOKEN_HEAD", head=64, phase="decode", q_dtype="bfloat16", group=4, window=64,
                  prefetch_pages=True)),
        Case("attention-NVFP4-d128-prefill-bf16-prefetch-words", "attention",
             dict(mode="NVFP4", head=128, phase="prefill", q_dtype="bfloat16", group=4, prefetch_pages=True,
                  word_scales=True)),
        # New-token prefill (the step's K/V, bf16/fp16 caches): every head size, softcap, sinks, fp16.
        *(Case(f"attention-new-d{head}-{q_dtype}", "attention",
               dict(mode="NONE", head=head, phase="prefill", q_dtype=q_dtype, group=group, step_kv=True, **extra))
          for head, q_dtype, group, extra in ((64, "bfloat16", 4, dict(grid_order="heads")),
                                              (80, "float16", 2, dict(sinks=True)),
                                              (128, "bfloat16", 4, dict(grid_order="group")),
                                              (256, "bfloat16", 1, dict(softcap=30.0)))),
    ]
    # Quantized prefill from gathered rows (prefill.cached_new_token_prefill), the whole context
    # or the new rows with the paged kernel's prefix partials ("-partials"): FP8 dots
    # through descriptors (d64/d128), pointers (d80) and the large tile (d256), decoded e4m3 /
    # e5m2 / NVFP4 rows, soft-cap + sinks + per-head scales, fp16 queries.
    cases += [
        Case(f"attention-gathered-{mode}-d{head}-{q_dtype}{'-decoded' if fp8_dots is False else ''}"
             f"{'-partials' if not whole else ''}", "attention",
             dict(mode=mode, head=head, phase="prefill", q_dtype=q_dtype, group=group, fp8_dots=fp8_dots,
                  whole_context=whole, **extra))
        for mode, head, q_dtype, group, fp8_dots, whole, extra in (
            ("FP8_E4M3", 128, "bfloat16", 4, None, True, {}),
            ("FP8_E4M3", 128, "bfloat16", 4, None, False, {}),
            ("FP8_E4M3", 64, "float16", 2, None, False, dict(softcap=30.0, sinks=True, head_scales=True)),
            ("FP8_E4M3", 80, "bfloat16", 4, None, True, {}),
            ("FP8_E4M3", 256, "bfloat16", 1, None, False, dict(sinks=True)),
            ("FP8_E4M3", 128, "bfloat16", 4, False, True, {}),
            ("FP8_E5M2", 128, "float16", 4, None, False, dict(softcap=30.0, head_scales=True)),
            ("NVFP4", 64, "bfloat16", 8, None, False, dict(sinks=True, inline_asm=False)),
            ("NVFP4", 128, "bfloat16", 4, None, True, {}),
        )
    ]
    # Mixed formats (K and V in different modes, _attend_range_mixed): decode and prefill of the two
    # formats the benchmarks time, then every mode on each side, the split, window, soft-cap, sinks,
    # KEYS_FIRST, PREFETCH_PAGES and NVFP4 scale paths spread over the rows.
    mixed = [
        ("FP8_E4M3", "NVFP4", 128, "decode", "bfloat16", 4, {}),
        ("FP8_E4M3", "NVFP4", 128, "prefill", "bfloat16", 4, {}),
        ("NONE", "FP8_E4M3", 128, "decode", "bfloat16", 4, {}),
        ("NONE", "FP8_E4M3", 128, "prefill", "bfloat16", 4, dict(window=256, softcap=30.0, sinks=True)),
        ("NVFP4", "FP8_E5M2", 64, "decode", "float16", 8, dict(splits=4, window=64, sinks=True)),
        ("FP8_PER_TOKEN_HEAD", "NVFP4", 80, "prefill", "bfloat16", 2, dict(head_scales=True, word_scales=True)),
        ("FP8_E5M2", "NONE", 256, "prefill", "bfloat16", 1, dict(softcap=50.0, keys_first=True)),
        ("NVFP4", "FP8_PER_TOKEN_HEAD", 128, "decode", "float32", 6, dict(keys_first=True, prefetch_pages=True)),
        ("NVFP4", "NONE", 128, "decode", "bfloat16", 4, dict(word_scales=True)),
    ]
    cases += [Case(f"attention-mixed-{k}-{v}-d{head}-{phase}-{q_dtype}", "attention",
                   dict(mode=k, v_mode=v, head=head, phase=phase, q_dtype=q_dtype, group=group, **extra))
              for k, v, head, phase, q_dtype, group, extra in mixed]
    return cases


def _rope_cases() -> list[Case]:
    cases = []
    for i, mode in enumerate(_MODES):
        for neox in (True, False):
            k = 2 * i + int(neox)
            head = _HEADS[k % 4]
            cases.append(Case(
                f"rope-{mode}-{'neox' if neox else 'gptj'}-d{head}", "rope",
                dict(mode=mode, head=head, neox=neox, rotary=head if k % 3 else head // 2, half_table=bool(k % 2),
                     positions=k % 4 in (1, 2), query=k % 5 != 4, heads=(8, 1, 2, 4)[k % 4],
                     q_heads=(32, 8, 16, 4)[k % 4], tokens=(1, 2048, 33, 65536)[k % 4],
                     in_dtype=("bfloat16", "float16", "float32")[k % 3],
                     soft_rounding=k % 3 == 1, fp_fusion=(None, False)[k % 2])))
    # NVFP4 pages with linear V scales and page sides aligned to 8 bytes (see _kv_write_cases).
    cases += [
        Case("rope-NVFP4-neox-d80", "rope",
             dict(mode="NVFP4", head=80, neox=True, rotary=80, half_table=True, positions=False, query=True, heads=2,
                  q_heads=8, tokens=512, in_dtype="bfloat16", soft_rounding=False, fp_fusion=None)),
        Case("rope-NVFP4-gptj-d128-page5", "rope",
             dict(mode="NVFP4", head=128, neox=False, rotary=64, half_table=False, positions=True, query=True, heads=1,
                  q_heads=4, tokens=33, in_dtype="bfloat16", soft_rounding=False, fp_fusion=None, page=5)),
    ]
    # The rows above take each style's rotation by default (split, or gathered where NeoX halves
    # do not fill the tile); these name the rest: NeoX split rows stored as halves (casts, FP8) or
    # joined (per-token-head), and the gathered form of full-width rows, which the GPU benchmark
    # still times ("gather").
    for mode, neox, head, rotation in (("NONE", True, 128, "split"), ("FP8_PER_TOKEN_HEAD", True, 128, "split"),
                                       ("FP8_E5M2", True, 64, "split"), ("FP8_E4M3", True, 128, "gather"),
                                       ("FP8_E5M2", False, 128, "gather"), ("NVFP4", False, 64, "gather")):
        cases.append(Case(f"rope-{mode}-{'neox' if neox else 'gptj'}-d{head}-{rotation}", "rope",
                          dict(mode=mode, head=head, neox=neox, rotary=head, half_table=not neox, positions=False,
                               query=True, heads=8, q_heads=32, tokens=4096, in_dtype="bfloat16",
                               soft_rounding=False, fp_fusion=None, rotation=rotation)))
    for j, mode in enumerate(("FP8_E4M3", "NVFP4")):
        cases.append(Case(f"rope-{mode}-neox-d128-head_scales", "rope",
                          dict(mode=mode, head=128, neox=True, rotary=128, half_table=False, positions=bool(j),
                               query=True, heads=8, q_heads=32, tokens=(33, 2048)[j], in_dtype="bfloat16",
                               soft_rounding=bool(j), fp_fusion=None, head_scales=True)))
    return cases


CASES: tuple[Case, ...] = tuple(_kv_write_cases() + _attention_cases() + _rope_cases())


# ----------------------------------------------------------------------------- probes (_triton_probe_kernels.py)


def _probe_kernels():
    import _triton_probe_kernels as probes  # next to this script, which is sys.path[0]

    return {"probe-branch-types-ok": probes.branch_types_ok,
            "probe-branch-types-mismatch": probes.branch_types_mismatch}


PROBES = ("probe-branch-types-ok", "probe-branch-types-mismatch")


# ----------------------------------------------------------------------------- recording launches


@dataclass
class Launch:
    """One kernel launch as a launcher issued it."""

    name: str
    fn: Any  # the JITFunction
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, name: str, fn, sink: list):
        self.name, self.fn, self.sink = name, fn, sink

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.sink.append(Launch(self.name, self.fn, args, kwargs))
        return record


@contextlib.contextmanager
def _recording(sink: list):
    from kvfuse.ops.triton import attention, kv_write, prefill, rope_kv_write

    targets = [(kv_write, "_encode_and_cache_write_kernel", "kv_write"),
               (attention, "_paged_attention_kernel", "attention"),
               (prefill, "_new_token_prefill_kernel", "attention_new"),
               (prefill, "_gather_new_rows_kernel", "attention_gather"),
               (attention, "_paged_attention_reduce_kernel", "attention_reduce"),
               (rope_kv_write, "_rope_encode_and_cache_write_kernel", "rope")]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in targets]
    try:
        for mod, attr, name in targets:
            setattr(mod, attr, _Recorder(name, getattr(mod, attr), sink))
        yield
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)


def _dtype(name: str):
    import torch
    return getattr(torch, name)


def _run_case(case: Case) -> list[Launch]:
    """Call the case's launcher on meta tensors; returns the launches it made."""
    import torch

    from kvfuse.kv_cache import KVQuantMode, row_dim_for
    from kvfuse.ops.triton import attention, kv_write, rope_kv_write

    p = case.params
    meta = torch.device("meta")
    page = p.get("page", 16)
    sink: list = []
    with _recording(sink):
        if case.kernel == "kv_write":
            t, h, d = p["tokens"], p["heads"], p["head"]
            cache_dtype = _dtype(p["cache_dtype"])
            if p["op"] == "cache_write":
                copy_mode = KVQuantMode[p["copy_mode"]] if "copy_mode" in p else None
                width = row_dim_for(copy_mode or KVQuantMode.NVFP4, d) if cache_dtype == torch.uint8 else d
                rows = torch.empty((t, 2, h, width), dtype=cache_dtype, device=meta)
                cache = torch.empty((t // page + 2, 2, page, h, width), dtype=cache_dtype, device=meta)
                slots = torch.empty((t,), dtype=torch.int64, device=meta)
                kv_write.cache_write(rows[:, 0], rows[:, 1], cache, slots,
                                     None if copy_mode is None else int(copy_mode))
            else:
                mode = KVQuantMode[p["mode"]]
                in_dtype = _dtype(p["in_dtype"])
                scale = torch.empty((h,) if p.get("head_scales") else (), dtype=torch.float32, device=meta)
                # K and V as views of one QKV projection output, as attention layers hand them over.
                qkv = torch.empty((t, 4 * h + 2 * h, d), dtype=in_dtype, device=meta)
                key, value = qkv[:, 4 * h: 5 * h], qkv[:, 5 * h:]
                if p["op"] == "encode_kv":
                    kv_write.encode_kv(key, scale, int(mode), cache_dtype, soft_rounding=p["soft_rounding"])
                else:
                    from kvfuse.kv_cache import KVFormat, mixed_page_layout

                    fmt = KVFormat(mode, KVQuantMode[p.get("v_mode", p["mode"])])
                    row_dim = (mixed_page_layout(fmt, page, h, d, in_dtype).row_dim if fmt.is_mixed
                               else row_dim_for(mode, d))
                    cache = torch.empty((t // page + 2, 2, page, h, row_dim), dtype=cache_dtype, device=meta)
                    slots = torch.empty((t,), dtype=torch.int64, device=meta)
                    kv_write.encode_and_cache_write(key, value, cache, slots, scale, scale, fmt.code,
                                                    soft_rounding=p["soft_rounding"])
        elif case.kernel == "attention":
            from kvfuse.kv_cache import KVFormat, mixed_page_layout
            from kvfuse.ops.registry import AttentionCall

            mode = KVQuantMode[p["mode"]]
            fmt = KVFormat(mode, KVQuantMode[p.get("v_mode", p["mode"])])
            d, group, kv_heads = p["head"], p["group"], 2
            seqs, tokens = {"decode": (16, 16), "prefill": (2, 2048), "mixed": (4, 600)}[p["phase"]]
            context = 4096
            storage = {KVQuantMode.NONE: torch.bfloat16, KVQuantMode.FP8_E4M3: torch.float8_e4m3fn,
                       KVQuantMode.FP8_E5M2: torch.float8_e5m2, KVQuantMode.NVFP4: torch.uint8,
                       KVQuantMode.FP8_PER_TOKEN_HEAD: torch.uint8}[mode]
            if mode is KVQuantMode.NONE:
                storage = _dtype(p["q_dtype"])
            blocks = seqs * context // page
            row_dim = row_dim_for(mode, d)
            if fmt.is_mixed:
                storage = torch.uint8
                row_dim = mixed_page_layout(fmt, page, kv_heads, d, _dtype(p["q_dtype"])).row_dim
            cache = torch.empty((blocks, 2, page, kv_heads, row_dim), dtype=storage, device=meta)
            query = torch.empty((tokens, kv_heads * group, d), dtype=_dtype(p["q_dtype"]), device=meta)
            scale = torch.empty((kv_heads,) if p.get("head_scales") else (), dtype=torch.float32, device=meta)
            call = AttentionCall(
                query=query, kv_cache=cache, k_scale=scale, v_scale=scale,
                block_table=torch.empty((seqs, context // page), dtype=torch.int32, device=meta),
                seq_lens=torch.empty((seqs,), dtype=torch.int32, device=meta),
                query_start_loc=torch.empty((seqs + 1,), dtype=torch.int32, device=meta),
                kv_quant_mode=fmt if fmt.is_mixed else mode, sm_scale=d ** -0.5, sliding_window=p.get("window"),
                logit_softcap=p.get("softcap", 0.0),
                sinks=torch.empty((kv_heads * group,), dtype=torch.float32, device=meta) if p.get("sinks") else None,
                # The step's K/V as views of one QKV projection output (prefill.new_token_prefill).
                **(dict(zip(("key", "value"), torch.empty((tokens, 2 * kv_heads, d), dtype=_dtype(p["q_dtype"]),
                                                          device=meta).split(kv_heads, 1)))
                   if p.get("step_kv") else {}))
            tiles = attention.DEFAULT_TILES
            fields = {k: p[n] for n, k in (("keys_first", "KEYS_FIRST"), ("scale_gather", "SCALE_GATHER"),
                                           ("word_scales", "WORD_SCALES"), ("prefetch_pages", "PREFETCH_PAGES"),
                                           ("longest_first", "LONGEST_FIRST"), ("grid_order", "GRID_ORDER"))
                      if p.get(n) is not None}
            if fields:
                tiles = tiles.replace(**fields)
            attention.paged_attention(call, tiles=tiles, num_splits=p.get("splits"),
                                      inline_asm=p.get("inline_asm", True),
                                      quant_dot_fp16=p.get("quant_dot_fp16", True), fp8_dots=p.get("fp8_dots"),
                                      # Quantized prefill cases keep the prefix partials (the paged
                                      # kernel's prefill tiles) unless they name the whole context.
                                      whole_context=p.get("whole_context", None if p.get("step_kv") else False))
        else:
            mode = KVQuantMode[p["mode"]]
            t, h, hq, d, r = p["tokens"], p["heads"], p["q_heads"], p["head"], p["rotary"]
            in_dtype = _dtype(p["in_dtype"])
            storage = {KVQuantMode.NONE: in_dtype, KVQuantMode.FP8_E4M3: torch.float8_e4m3fn,
                       KVQuantMode.FP8_E5M2: torch.float8_e5m2, KVQuantMode.NVFP4: torch.uint8,
                       KVQuantMode.FP8_PER_TOKEN_HEAD: torch.uint8}[mode]
            qkv = torch.empty((t, hq + 2 * h, d), dtype=in_dtype, device=meta)
            query, key, value = qkv[:, :hq], qkv[:, hq: hq + h], qkv[:, hq + h:]
            cache = torch.empty((t // page + 2, 2, page, h, row_dim_for(mode, d)), dtype=storage, device=meta)
            slots = torch.empty((t,), dtype=torch.int64, device=meta)
            scale = torch.empty((h,) if p.get("head_scales") else (), dtype=torch.float32, device=meta)
            width = r // 2 if p["half_table"] else r
            rows = 8192 if p["positions"] else t
            cos = torch.empty((rows, width), dtype=in_dtype, device=meta)
            positions = torch.empty((t,), dtype=torch.int64, device=meta) if p["positions"] else None
            rope_kv_write.rope_encode_and_cache_write(
                query if p["query"] else None, key, value, cache, slots, scale, scale, cos, cos.clone(), positions,
                r, p["neox"], int(mode), soft_rounding=p["soft_rounding"], fp_fusion=p["fp_fusion"],
                rotation=p.get("rotation"))
    if not sink:
        raise AssertionError(f"case {case.id}: the launcher launched no kernel")
    return sink


# ----------------------------------------------------------------------------- specialisation + compile

_OPTION_NAMES = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "debug")


def _pointer_type(t) -> str:
    import torch

    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
             torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.uint8: "u8", torch.int8: "i8",
             torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
    if t.dtype not in names:
        raise TypeError(f"tensor argument of dtype {t.dtype}: no Triton pointer type mapped")
    return "*" + names[t.dtype]


def _specialise(launch: Launch):
    """(signature, constexprs, attrs, options) as JITFunction.run would derive them on a GPU.

    Tensors: pointer to their dtype, 16-divisible when the caching allocator's alignment and the
    view's offset make the address so; ints: i32/i64, 16-divisible when they are, and the
    constant 1 when equal to 1 (unless ``do_not_specialize``); floats: fp32; None: a constant.
    """
    import inspect

    import torch

    fn = launch.fn
    options = {k: v for k, v in launch.kwargs.items() if k in _OPTION_NAMES}
    unknown = set(launch.kwargs) - set(options) - set(fn.arg_names)
    if unknown:
        raise TypeError(f"{launch.name}: launch keywords {sorted(unknown)} are neither parameters nor options")
    bound = inspect.signature(fn.fn).bind(*launch.args, **{k: v for k, v in launch.kwargs.items()
                                                           if k not in options})
    # Parameters a launch leaves out take their defaults, as JITFunction binds them.
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if name not in bound.arguments:
            raise TypeError(f"{launch.name}: no value for parameter {name!r}")
        value = bound.arguments[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
            continue
        nospec = bool(getattr(param, "do_not_specialize", False))
        aligned = None
        if isinstance(value, torch.Tensor):
            signature[name] = _pointer_type(value)
            # Whole CUDA allocations are 256-byte aligned; a view's offset may break that.
            aligned = (value.storage_offset() * value.element_size()) % 16 == 0
        elif isinstance(value, bool):
            # Its signature type changed across releases (i1, u1); no kvfuse kernel takes one.
            raise TypeError(f"{launch.name}: runtime bool argument {name}={value!r} has no specialisation "
                            f"rule here; make it a constexpr or teach _specialise its type")
        elif isinstance(value, int):
            if value == 1 and not nospec:
                signature[name] = "constexpr"
                constexprs[name] = 1
                continue
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            aligned = value % 16 == 0 and not nospec
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value is None:
            signature[name] = "constexpr"
            constexprs[name] = None
            continue
        elif type(value).__name__ == "TensorDescriptor":
            # A host-side tensor descriptor (TMA): its element type and block shape are its type.
            shape = ",".join(str(n) for n in value.block_shape)
            signature[name] = f"tensordesc<{_pointer_type(value.base)[1:]}[{shape}]>"
            continue
        else:
            raise TypeError(f"{launch.name}: argument {name}={value!r} of type {type(value).__name__} "
                            f"has no specialisation rule")
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs, options


def _describe(value) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


# Messages of a toolchain that cannot run here (lower case), as opposed to a kernel it refuses.
_ENV_MARKERS = ("libcuda", "cannot find ptxas", "ptxas: not found", "no such file or directory",
                "permission denied", "cannot execute")


def classify(exc: BaseException) -> str:
    """``env`` for an exception of a toolchain that cannot run on this host, else ``error``."""
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, (FileNotFoundError, PermissionError)) or any(m in text for m in _ENV_MARKERS):
        return "env"
    return "error"


def _compile(fn, signature, constexprs, attrs, options) -> dict:
    """Compile for sm_90; {status, error?, shared?, seconds}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    try:
        # Positional: the keyword names changed across releases (constants -> constexprs).
        src = ASTSource(fn, signature, constexprs, attrs)
        kernel = triton.compile(src, target=GPUTarget(*TARGET), options=options)
    except Exception as exc:  # noqa: BLE001 - classified below and reported, never swallowed
        text = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        return {"status": classify(exc), "error": text[-6000:], "seconds": time.perf_counter() - start}
    shared = int(getattr(kernel.metadata, "shared", 0) or 0)
    result = {"status": "ok", "shared": shared, "seconds": time.perf_counter() - start}
    if "cubin" not in kernel.asm:
        result.update(status="error", error="the pipeline produced no cubin")
    elif shared > H100_MAX_SHARED:
        result.update(status="error", error=f"needs {shared} bytes of shared memory; an H100 block gets at most "
                                            f"{H100_MAX_SHARED} (OutOfResources at launch)")
    return result


def _compile_matrix(case_ids: Optional[set]) -> dict:
    import triton

    report = {"triton": triton.__version__, "target": list(TARGET), "cases": {}, "compiles": {}, "probes": {}}
    probes = _probe_kernels()
    for name in PROBES:
        report["probes"][name] = _compile(probes[name], {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32",
                                                         "BLOCK": "constexpr"}, {"BLOCK": 128}, {}, {"num_warps": 4})
    # A kernel this small compiles wherever the toolchain runs: when it fails for an environmental
    # reason, every case is an environment skip (a probe that fails otherwise fails its own test,
    # and the cases are still compiled and reported).
    probe = report["probes"]["probe-branch-types-ok"]
    env_reason = None
    if probe["status"] == "env":
        env_reason = f"the Triton sm_90 toolchain does not run here: {probe.get('error')}"
    for case in CASES:
        if case_ids is not None and case.id not in case_ids:
            continue
        entry: dict = {"kernel": case.kernel, "launches": []}
        report["cases"][case.id] = entry
        if env_reason:
            entry["launches"].append({"status": "env", "error": env_reason})
            continue
        try:
            launches = _run_case(case)
        except Exception:  # noqa: BLE001 - a launcher that rejects its case is a test defect, reported
            entry["launches"].append({"status": "error", "error": "launcher failed:\n" + traceback.format_exc()})
            continue
        for launch in launches:
            try:
                signature, constexprs, attrs, options = _specialise(launch)
            except Exception:  # noqa: BLE001
                entry["launches"].append({"name": launch.name, "status": "error",
                                          "error": "specialisation failed:\n" + traceback.format_exc()})
                continue
            key = json.dumps([launch.name, signature, {k: _describe(v) for k, v in constexprs.items()},
                              sorted((str(k), v) for k, v in attrs.items()), options], sort_keys=True)
            if key not in report["compiles"]:
                report["compiles"][key] = _compile(launch.fn, signature, constexprs, attrs, options)
            entry["launches"].append({"name": launch.name, "key": key,
                                      "constexprs": {k: _describe(v) for k, v in constexprs.items()},
                                      "options": {k: _describe(v) for k, v in options.items()},
                                      **report["compiles"][key]})
    return report


def run_matrix(case_ids: Optional[list] = None, jobs: Optional[int] = None, timeout: float = 900.0) -> dict:
    """Compile the cases (all by default) in fresh interpreters with TRITON_INTERPRET=0; the merged report.

    ``jobs`` subprocesses (default: up to 2, one per core) share the cases, attention ones dealt
    round-robin since they take nearly all the time."""
    ids = [c.id for c in CASES] if case_ids is None else list(case_ids)
    jobs = max(1, min(jobs or min(2, os.cpu_count() or 1), len(ids)))
    ordered = sorted(ids, key=lambda i: not i.startswith("attention"))
    chunks = [ordered[j::jobs] for j in range(jobs)]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvfuse-triton-compile-") as tmp:
        env = dict(os.environ)
        env["TRITON_INTERPRET"] = "0"
        # A private cache: every run compiles (a cached cubin would prove nothing about today's code).
        env["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton-cache")
        # Triton 3.9 warns unless told; 1 is its (and earlier releases') default behaviour.
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        procs = []
        for j, chunk in enumerate(chunks):
            out = Path(tmp) / f"report-{j}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--cases", ",".join(chunk)]
            procs.append((out, subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True)))
        merged: dict = {}
        try:
            for out, proc in procs:
                remaining = max(1.0, timeout - (time.perf_counter() - start))
                stdout, stderr = proc.communicate(timeout=remaining)
                if proc.returncode != 0 or not out.exists():
                    raise RuntimeError(f"the compile subprocess exited with {proc.returncode}:\n"
                                       f"{stdout[-4000:]}\n{stderr[-8000:]}")
                report = json.loads(out.read_text())
                if not merged:
                    merged = report
                else:
                    merged["cases"].update(report["cases"])
                    merged["compiles"].update(report["compiles"])
        finally:
            for _, proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        merged["seconds"] = time.perf_counter() - start
        return merged


def main(argv: list) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON report")
    parser.add_argument("--cases", default=None, help="comma-separated case ids (default: all)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled")
    ids = set(args.cases.split(",")) if args.cases else None
    if ids is not None:
        unknown = ids - {c.id for c in CASES}
        if unknown:
            parser.error(f"--cases: unknown ids {sorted(unknown)}")
    start = time.perf_counter()
    report = _compile_matrix(ids)
    report["seconds"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(report, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
