"""Every Triton kernel kvfuse launches compiles for Hopper (sm_90, cubin through ptxas), on CPU.

The interpreter tests run the kernels' Python, not the compiler: a kernel can pass all of them and
still be refused on the GPU (it happened: a name bound to two types across a runtime ``if`` in
the RoPE kernel). Here the launchers themselves are called on meta tensors, their launches are
recorded, specialised as ``JITFunction`` would specialise them on a GPU, and compiled for
``GPUTarget("cuda", 90, 32)`` in a subprocess with ``TRITON_INTERPRET=0`` (see
``_triton_compile.py``; one run for the whole matrix, two processes when two cores exist).

The matrix is a representative subset, not the full product (thousands of kernels at seconds
each): every cache MODE meets every head size (64/80/128/256) for each kernel family, and the
remaining switches (split-KV, window, softcap, sinks, dot dtype fp16/bf16/fp32, inline PTX,
SCALE_GATHER, WORD_SCALES, PREFETCH_PAGES, LONGEST_FIRST, KEYS_FIRST, decode/prefill tiles incl. MAXNREG; RoPE style, partial rotary, half
tables, positions, query or none; kv_write COPY, dense outputs, soft rounding) are spread over
those rows. :func:`test_matrix_covers_every_branch` and :func:`test_matrix_covers_default_tiles`
check, from the constexprs the launchers actually produced, that each branch value and each
distinct DEFAULT_TILES configuration was compiled, so a launcher change that leaves a branch
uncompiled fails here rather than going unnoticed.

Compiles that cannot run on this host for an environmental reason (no working ptxas, say) are
skipped with the reason; compile errors, and kernels needing more shared memory than an H100
grants, fail.
"""

from __future__ import annotations

import json

import pytest

import _triton_compile as tc

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def report(request):
    """One compile run for the module: every case, or only the selected ones when nothing but
    per-case tests of this module was selected (``-k``)."""
    if _nvidia_backend_missing():
        pytest.skip("this triton has no NVIDIA backend: nothing can be compiled for sm_90")
    mine = [item for item in request.session.items if item.module is request.module]
    selected = None
    if mine and all(item.originalname == "test_kernel_compiles_for_sm90" for item in mine):
        selected = [item.callspec.params["case"].id for item in mine]
    return tc.run_matrix(selected)


def _nvidia_backend_missing() -> bool:
    from triton.backends import backends

    return "nvidia" not in backends


def _launches(report, kernel):
    return [launch for case in report["cases"].values() for launch in case["launches"]
            if launch.get("name") == kernel and launch["status"] == "ok"]


def _skip_if_environment(report):
    probe = report["probes"]["probe-branch-types-ok"]
    if probe["status"] == "env":
        pytest.skip(f"cannot compile for sm_90 on this host: {probe['error']}")


def test_then_else_type_mismatch_is_a_compile_error(report):
    """The helper reports the H100's refusal (a name of two types across a runtime ``if``) as an
    error, and compiles the same kernel with the names apart."""
    _skip_if_environment(report)
    ok, bad = report["probes"]["probe-branch-types-ok"], report["probes"]["probe-branch-types-mismatch"]
    assert ok["status"] == "ok", ok
    assert bad["status"] == "error", bad
    assert "CompilationError" in bad["error"] and "Mismatched type for dst" in bad["error"], bad["error"]


def test_environment_failures_are_told_apart_from_kernel_errors():
    assert tc.classify(RuntimeError("Cannot find ptxas")) == "env"
    assert tc.classify(FileNotFoundError(2, "No such file or directory", "ptxas")) == "env"
    assert tc.classify(OSError("libcuda.so.1: cannot open shared object file")) == "env"
    assert tc.classify(RuntimeError("PassManager::run failed")) == "error"
    assert tc.classify(AssertionError("Mismatched type for dst between then block and else block")) == "error"
    assert tc.classify(RuntimeError("ptxas fatal: Unknown symbol 'kvf_lo'")) == "error"


@pytest.mark.parametrize("case", tc.CASES, ids=[c.id for c in tc.CASES])
def test_kernel_compiles_for_sm90(report, case):
    entry = report["cases"][case.id]
    assert entry["launches"], f"{case.id}: no launch recorded"
    env = [launch for launch in entry["launches"] if launch["status"] == "env"]
    errors = [launch for launch in entry["launches"] if launch["status"] == "error"]
    if errors:
        pytest.fail("\n\n".join(
            f"{case.id}: {launch.get('name', '?')} does not compile for sm_90 (triton {report['triton']})\n"
            f"constexprs={launch.get('constexprs')}\noptions={launch.get('options')}\n{launch['error']}"
            for launch in errors), pytrace=False)
    if env:
        pytest.skip(f"{case.id}: environment, not the kernel: {env[0]['error'][:500]}")
    for launch in entry["launches"]:
        assert launch["status"] == "ok"
        assert 0 <= launch["shared"] <= tc.H100_MAX_SHARED, launch


def _seen(launches, name, where=lambda c: True):
    return {launch["constexprs"][name] for launch in launches if where(launch["constexprs"])}


def test_matrix_covers_every_branch(report):
    """Each value of each branch-selecting constexpr was compiled (in the context it matters)."""
    _skip_if_environment(report)
    from kvfuse.kv_cache import KVQuantMode

    modes = {int(m) for m in KVQuantMode}
    nvfp4 = int(KVQuantMode.NVFP4)
    pth = int(KVQuantMode.FP8_PER_TOKEN_HEAD)
    heads = {64, 80, 128, 256}
    both = {True, False}
    missing = []

    def expect(kernel, name, want, seen):
        if not want <= seen:
            missing.append(f"{kernel}.{name}: never compiled with {sorted(map(str, want - seen))} (saw "
                           f"{sorted(map(str, seen))})")

    kw = _launches(report, "kv_write")
    expect("kv_write", "MODE", modes | {max(modes) + 1, max(modes) + 2}, _seen(kw, "MODE"))  # + COPY, COPY_NVFP4
    for mode in (nvfp4, max(modes) + 2):  # NVFP4 pages: both V-scale layouts, side alignments 16 / 8 / 1
        paged = lambda c, m=mode: c["MODE"] == m and c["HAS_SLOTS"]  # noqa: E731
        expect("kv_write", f"SWIZZLE_V[MODE={mode}]", both, _seen(kw, "SWIZZLE_V", paged))
    expect("kv_write", "PAGE_ALIGN[nvfp4 pages]", {16, 8, 1},
           _seen(kw, "PAGE_ALIGN", lambda c: c["MODE"] in (nvfp4, max(modes) + 2) and c["HAS_SLOTS"]))
    expect("kv_write", "D", heads, _seen(kw, "D"))
    for name in ("HAS_SLOTS", "PAIR", "SOFT_ROUNDING"):
        expect("kv_write", name, both, _seen(kw, name))
    for name in ("HAS_SLOTS", "SOFT_ROUNDING"):  # cache and dense rows, both FP8 rounding paths
        expect("kv_write", f"{name}[MODE={pth}]", both, _seen(kw, name, lambda c: c["MODE"] == pth))
    for mode in modes:
        expect("kv_write", f"D[MODE={mode}]", heads, _seen(kw, "D", lambda c, m=mode: c["MODE"] == m))
    expect("kv_write", f"K_SCALE_STRIDE_H[MODE={pth}]", {0}, _seen(kw, "K_SCALE_STRIDE_H", lambda c: c["MODE"] == pth))
    # per-KV-head scales (stride 1) and per-tensor ones (0); FP8_PER_TOKEN_HEAD reads none (always 0)
    for mode in modes - {int(KVQuantMode.NONE), pth}:
        expect("kv_write", f"K_SCALE_STRIDE_H[MODE={mode}]", {0, 1},
               _seen(kw, "K_SCALE_STRIDE_H", lambda c, m=mode: c["MODE"] == m))

    launches = _launches(report, "attention")
    # Uniform formats below; mixed ones (V_MODE set: MODE is then only the K side's) after them.
    at = [launch for launch in launches if launch["constexprs"].get("V_MODE") is None]
    mx = [launch for launch in launches if launch["constexprs"].get("V_MODE") is not None]
    is_fp4 = lambda c: c["MODE"] == nvfp4  # noqa: E731
    dense = lambda c: c["MODE"] != nvfp4  # noqa: E731
    for mode in modes:
        expect("attention", f"HEAD[MODE={mode}]", heads, _seen(at, "HEAD", lambda c, m=mode: c["MODE"] == m))
    for name in ("SPLIT", "HAS_WINDOW", "SOFTCAP", "HAS_SINKS", "KEYS_FIRST", "Q_RESCALE"):
        expect("attention", f"{name}[dense]", both, _seen(at, name, dense))
        expect("attention", f"{name}[nvfp4]", both, _seen(at, name, is_fp4))
    for name in ("USE_ASM", "SCALE_GATHER", "WORD_SCALES"):
        expect("attention", f"{name}[nvfp4]", both, _seen(at, name, is_fp4))
    expect("attention", "PREFETCH_PAGES[dense]", both, _seen(at, "PREFETCH_PAGES", dense))
    expect("attention", "PREFETCH_PAGES[nvfp4]", both, _seen(at, "PREFETCH_PAGES", is_fp4))
    expect("attention", "LONGEST_FIRST", both, _seen(at, "LONGEST_FIRST"))
    expect("attention", "DOT_DTYPE[dense]", {"fp16", "bf16", "fp32"}, _seen(at, "DOT_DTYPE", dense))
    expect("attention", "DOT_DTYPE[nvfp4]", {"fp16", "bf16", "fp32"}, _seen(at, "DOT_DTYPE", is_fp4))
    per_row = lambda c: c["MODE"] == pth  # noqa: E731
    expect("attention", "DOT_DTYPE[per_token_head]", {"fp16", "fp32"}, _seen(at, "DOT_DTYPE", per_row))
    for name in ("SPLIT", "HAS_WINDOW", "KEYS_FIRST"):
        expect("attention", f"{name}[per_token_head]", both, _seen(at, name, per_row))
    expect("attention", "PRECISION", {"ieee", "tf32"}, _seen(at, "PRECISION"))
    # NVFP4 rows of 72 or 45 bytes: strides aligned to less than 16 bytes.
    expect("attention", "ROW_ALIGN", {16, 8, 1}, _seen(at, "ROW_ALIGN"))
    if not any(c["constexprs"]["GROUP"] != c["constexprs"]["GROUP_PAD"] for c in at):
        missing.append("attention: no GQA group that is not a power of two")
    expect("attention[mixed]", "MODE (K side)", modes, _seen(mx, "MODE"))
    expect("attention[mixed]", "V_MODE", modes, _seen(mx, "V_MODE"))
    v_fp4 = lambda c: c["V_MODE"] == nvfp4  # noqa: E731
    expect("attention[mixed]", "SWIZZLE_V[V nvfp4]", both, _seen(mx, "SWIZZLE_V", v_fp4))
    for name in ("SPLIT", "HAS_WINDOW", "SOFTCAP", "HAS_SINKS", "KEYS_FIRST", "PREFETCH_PAGES", "Q_RESCALE"):
        expect("attention[mixed]", name, both, _seen(mx, name))
    expect("attention[mixed]", "DOT_DTYPE", {"fp16", "bf16", "fp32"}, _seen(mx, "DOT_DTYPE"))
    any_fp4 = lambda c: nvfp4 in (c["MODE"], c["V_MODE"])  # noqa: E731
    expect("attention[mixed]", "WORD_SCALES[nvfp4 side]", both, _seen(mx, "WORD_SCALES", any_fp4))
    new = _launches(report, "attention_new")
    expect("attention_new", "QUANT", {0, 1, 2}, _seen(new, "QUANT"))
    for name in ("TMA", "SOFTCAP", "HAS_SINKS"):
        expect("attention_new", f"{name}[FP8 dots]", both, _seen(new, name, lambda c: c["QUANT"] == 1))
    expect("attention_new", "DOT_DTYPE", {"fp16", "bf16", "fp8e4nv"}, _seen(new, "DOT_DTYPE"))
    expect("attention_new", "GRID_ORDER", {0, 1, 2}, _seen(new, "GRID_ORDER"))
    expect("attention_new", "DENSE_PREFIX[QUANT=0]", both, _seen(new, "DENSE_PREFIX", lambda c: c["QUANT"] == 0))
    for quant in (1, 2):
        expect("attention_new", f"WHOLE_CONTEXT[QUANT={quant}]", both,
               _seen(new, "WHOLE_CONTEXT", lambda c, quant=quant: c["QUANT"] == quant))
    expect("attention", "PREFIX_ONLY[dense]", both, _seen(at, "PREFIX_ONLY", dense))
    expect("attention", "PREFIX_ONLY[nvfp4]", both, _seen(at, "PREFIX_ONLY", is_fp4))
    gathers = _launches(report, "attention_gather")
    expect("attention_gather", "MODE", {int(KVQuantMode.FP8_E4M3), int(KVQuantMode.FP8_E5M2), nvfp4},
           _seen(gathers, "MODE"))
    expect("attention_gather", "V_COLUMNS", both, _seen(gathers, "V_COLUMNS"))
    expect("attention_gather", "WHOLE_CONTEXT[FP8 codes]", both,
           _seen(gathers, "WHOLE_CONTEXT", lambda c: c["V_COLUMNS"]))
    expect("attention_gather", "WHOLE_CONTEXT[nvfp4]", both, _seen(gathers, "WHOLE_CONTEXT", is_fp4))
    expect("attention_gather", "PREFIX_ONLY", both, _seen(gathers, "PREFIX_ONLY"))
    expect("attention_gather", "SWIZZLE_V[nvfp4]", both, _seen(gathers, "SWIZZLE_V", is_fp4))
    expect("attention_gather", "USE_ASM[nvfp4]", both, _seen(gathers, "USE_ASM", is_fp4))
    if not _launches(report, "attention_reduce"):
        missing.append("attention_reduce: never compiled (no split-KV launch)")

    rp = _launches(report, "rope")
    expect("rope", "MODE", modes, _seen(rp, "MODE"))
    expect("rope", "SWIZZLE_V[nvfp4]", both, _seen(rp, "SWIZZLE_V", lambda c: c["MODE"] == nvfp4))
    expect("rope", "PAGE_ALIGN[nvfp4]", {16, 8}, _seen(rp, "PAGE_ALIGN", lambda c: c["MODE"] == nvfp4))
    for name in ("NEOX", "HALF_TABLE", "HAS_POS", "SOFT_ROUNDING"):
        expect("rope", name, both, _seen(rp, name))
    expect("rope", "D", heads, _seen(rp, "D"))
    for mode in (int(KVQuantMode.FP8_E4M3), nvfp4):
        expect("rope", f"V_SCALE_STRIDE_H[MODE={mode}]", {0, 1},
               _seen(rp, "V_SCALE_STRIDE_H", lambda c, m=mode: c["MODE"] == m))
    if not any(c["constexprs"]["R"] < c["constexprs"]["D"] for c in rp):
        missing.append("rope: no partial rotary (R < D)")
    if {"fp16", "bf16", "fp32"} - {_key_dtype(c) for c in rp}:
        missing.append(f"rope: key dtypes compiled {sorted({_key_dtype(c) for c in rp})}, want bf16/fp16/fp32 "
                       f"(_round_to branches on it)")
    if not any(c["options"].get("enable_fp_fusion") is False for c in rp):
        missing.append("rope: never compiled with enable_fp_fusion=False")
    assert not missing, "\n".join(missing)


def _key_dtype(launch) -> str:
    """The element type of the rope kernel's ``key_ptr`` in the compile key's signature."""
    signature = json.loads(launch["key"])[1]
    return signature["key_ptr"].lstrip("*")


def test_matrix_covers_default_tiles(report):
    """Every distinct launch configuration of DEFAULT_TILES (BLOCK_N, warps, stages, MAXNREG) was
    compiled; float32 queries cap BLOCK_N as the launcher does."""
    _skip_if_environment(report)
    from kvfuse.ops.triton import attention as ta

    compiled = {(launch["constexprs"]["BLOCK_N"], launch["options"].get("num_warps"),
                 launch["options"].get("num_stages"), launch["options"].get("maxnreg"))
                for launch in _launches(report, "attention")}
    missing = []
    compiled_new = {(launch["constexprs"]["BLOCK_M"], launch["constexprs"]["BLOCK_N"],
                     launch["options"].get("num_warps"), launch["options"].get("num_stages"),
                     launch["options"].get("maxnreg")) for launch in _launches(report, "attention_new")}
    for use, table in (("decode", ta.DEFAULT_TILES.decode), ("prefill", ta.DEFAULT_TILES.prefill)):
        for key, tile in table.items():
            want = (tile.BLOCK_N, tile.num_warps, tile.num_stages, tile.MAXNREG)
            if want not in compiled:
                missing.append(f"{use}[{key!r}] = {tile}")
    for key, tile in ta.DEFAULT_TILES.new_tokens.items():
        if (tile.BLOCK_M, tile.BLOCK_N, tile.num_warps, tile.num_stages, tile.MAXNREG) not in compiled_new:
            missing.append(f"new_tokens[{key!r}] = {tile}")
    assert not missing, f"DEFAULT_TILES entries never compiled: {missing}; compiled {sorted(compiled, key=str)}"
