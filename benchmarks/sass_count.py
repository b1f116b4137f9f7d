"""Instructions per element of the fused K/V encode + cache write, from its sm_90 SASS (no GPU needed).

    python -m benchmarks.sass_count [--tokens 16384] [--formats nvfp4,fp8_e4m3,bfloat16] [--out DIR]

The launcher (``kvfuse.ops.triton.kv_write.encode_and_cache_write``) is called on meta tensors of
the write benchmark's shape (8 KV heads, D=128, bf16 K/V, page 16, int64 slots), its kernel
launch is recorded and compiled for sm_90 exactly as ``tests/ops/_triton_compile.py`` does for the
compile tests, and the cubin is disassembled with the ``nvdisasm`` that ships with Triton. The
kernel body has no loop (one program encodes ``BLOCK_T`` tokens x ``BLOCK_H`` heads of K and V), so
each thread runs each instruction at most once. Counted is the fast path: the kernel body without
its division slow paths (subroutines and the blocks that call them, taken only for operands an
approximate reciprocal cannot divide exactly: denormals, infinities, huge ratios). Instructions
per element = fast-path SASS instructions / elements per thread; predicated-off instructions still
issue, so this is what the schedulers see.

The issue-rate bound this gives, for an H100 SXM (132 SMs, 4 warp schedulers each, one warp
instruction per scheduler per clock, ``--clock-ghz`` the SM clock under load)::

    elements/s <= 132 * 4 * clock * 32 / (thread instructions per element)
    GB/s       <= elements/s * bytes per element (bf16 read + cache bytes written)

and its fraction of the measured copy bandwidth (``--copy-gb-s``, default the write benchmark's
3010 GB/s) is the ceiling the instruction count alone allows, before any latency or occupancy
loss. Writes ``sass_count.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Bytes read (bf16 K or V element) and written (the cache's bytes per element) per element.
BYTES_PER_ELEMENT = {"bfloat16": 2 + 2, "fp8_e4m3": 2 + 1, "nvfp4": 2 + 0.5 + 1 / 16,
                     "fp8_per_token_head": 2 + 1 + 4 / 128}
MODES = {"bfloat16": "NONE", "fp8_e4m3": "FP8_E4M3", "nvfp4": "NVFP4", "fp8_per_token_head": "FP8_PER_TOKEN_HEAD"}
CACHE_DTYPES = {"bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "nvfp4": "uint8", "fp8_per_token_head": "uint8"}
SM_COUNT, SCHEDULERS = 132, 4
# Instruction classes worth seeing apart (the rest are counted as "other").
CLASSES = {"memory": ("LDG", "STG", "LDS", "STS", "LDC", "ULDC", "LD", "ST"),
           "float": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "MUFU", "F2F", "F2I", "I2F", "FRND", "F2FP",
                     "HADD2", "HMUL2", "HFMA2", "FCHK"),
           "integer": ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "ISETP", "SEL", "IMNMX", "PRMT", "BFI", "BFE",
                       "FLO", "POPC", "IABS", "VIMNMX", "I2IP"),
           "control": ("BRA", "EXIT", "BSSY", "BSYNC", "CALL", "RET", "BAR", "WARPSYNC", "NOP")}


def _nvdisasm() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not path.exists():
        raise FileNotFoundError(f"nvdisasm not found at {path} (it ships with Triton's NVIDIA backend)")
    return str(path)


def compile_tools():
    """The compile tests' launch recorder and specialisation (``tests/ops/_triton_compile.py``)."""
    sys.path.insert(0, str(REPO_ROOT / "tests" / "ops"))
    import _triton_compile as tc  # noqa: E402

    return tc


def compile_launch(launch):
    """(cubin bytes, constexprs, options) of one recorded launch, compiled for sm_90 as the GPU
    would specialise it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tc = compile_tools()
    signature, constexprs, attrs, options = tc._specialise(launch)
    kernel = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=GPUTarget(*tc.TARGET),
                            options=options)
    return kernel.asm["cubin"], constexprs, options


def compile_write(fmt: str, tokens: int, heads: int = 8, head: int = 128):
    """(cubin bytes, constexprs, options) of the fused write kernel as the launcher configures it."""
    tc = compile_tools()
    case = tc.Case(f"sass-{fmt}", "kv_write", {"op": "encode_and_cache_write", "tokens": tokens, "heads": heads,
                                                "head": head, "mode": MODES[fmt], "in_dtype": "bfloat16",
                                                "cache_dtype": CACHE_DTYPES[fmt], "soft_rounding": False})
    launches = tc._run_case(case)
    if len(launches) != 1:
        raise RuntimeError(f"{fmt}: expected one kernel launch, recorded {len(launches)}")
    return compile_launch(launches[0])


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_nvdisasm(), "-c", f.name], check=True, capture_output=True, text=True).stdout


_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_SKIP_BRANCH = re.compile(r"@!?P\w+\s+BRA\s+`\((\.L_x_\d+)\)")


def sass_opcodes(text: str, fast_path: bool = False) -> list[str]:
    """Opcodes of the kernel's instructions in program order (NOPs included).

    ``fast_path``: only what a thread runs when no IEEE division needs its slow path (the usual
    case: normal operands): the kernel body up to its subroutines, without the blocks a
    predicated branch skips to reach a division's result when its fast check passes (each such
    block calls ``__cuda_sm3x_div_rn_..._slowpath``)."""
    lines = text.splitlines()
    ops, i = [], 0
    while i < len(lines):
        line = lines[i]
        if fast_path and line.startswith("$__internal"):
            break  # subroutines follow the kernel body
        branch = _SKIP_BRANCH.search(line) if fast_path else None
        if branch:
            label = branch.group(1) + ":"
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == label), None)
            if end is not None and any("slowpath" in lines[j] for j in range(i + 1, end)):
                ops.append("BRA")  # the branch itself issues
                i = end + 1
                continue
        m = _INSTRUCTION.match(line)
        if m:
            ops.append(m.group(1))
        i += 1
    return ops


def classify(op: str) -> str:
    base = op.split(".")[0]
    for name, prefixes in CLASSES.items():
        if base in prefixes:
            return name
    return "other"


def analyse(fmt: str, tokens: int, clock_ghz: float, copy_gb_s: float, dump_dir=None) -> dict:
    cubin, constexprs, options = compile_write(fmt, tokens)
    text = disassemble(cubin)
    if dump_dir:
        with open(os.path.join(dump_dir, f"kv_write_{fmt}.sass"), "w") as f:
            f.write(text)
    ops = [op for op in sass_opcodes(text) if op != "NOP"]
    fast = [op for op in sass_opcodes(text, fast_path=True) if op != "NOP"]
    classes = collections.Counter(classify(op) for op in fast)
    num_warps = int(options.get("num_warps", 4))
    block_t, block_h = int(constexprs["BLOCK_T"]), int(constexprs["BLOCK_H"])
    head = int(constexprs.get("D", 128))
    elements = 2 * block_t * block_h * head  # K and V
    per_thread = elements / (num_warps * 32)
    per_element = len(fast) / per_thread
    elements_per_s = SM_COUNT * SCHEDULERS * clock_ghz * 1e9 * 32 / per_element
    bound_gb_s = elements_per_s * BYTES_PER_ELEMENT[fmt] / 1e9
    return dict(format=fmt, tokens=tokens, block_t=block_t, block_h=block_h, num_warps=num_warps,
                sass_instructions=len(ops), fast_path_instructions=len(fast), fast_path_classes=dict(classes),
                mufu_rcp=sum(op.startswith("MUFU.RCP") for op in fast),
                # Barriers mark layout conversions through shared memory (and their latency).
                barriers=sum(op.startswith("BAR") for op in fast), elements_per_thread=per_thread,
                instructions_per_element=round(per_element, 2), issue_bound_gb_s=round(bound_gb_s, 1),
                issue_bound_frac_copy=round(bound_gb_s / copy_gb_s, 3),
                constexprs={k: str(v) for k, v in constexprs.items()})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--formats", default="nvfp4,fp8_e4m3,bfloat16,fp8_per_token_head")
    parser.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock under load (H100 SXM max 1.98)")
    parser.add_argument("--copy-gb-s", type=float, default=3010.0, help="measured copy bandwidth to compare with")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--dump", metavar="DIR", help="also write each kernel's SASS to DIR")
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    rows = [analyse(fmt, args.tokens, args.clock_ghz, args.copy_gb_s, args.dump) for fmt in args.formats.split(",")]
    meta = dict(date=datetime.date.today().isoformat(), target="sm_90", clock_ghz=args.clock_ghz,
                copy_gb_s=args.copy_gb_s, command="python -m benchmarks.sass_count " + " ".join(argv or sys.argv[1:]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sass_count.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("| format | tile (tokens x heads, warps) | SASS (all / fast path) | MUFU.RCP | barriers | elements / thread "
          "| instructions / element | issue bound GB/s | of copy |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['block_t']} x {r['block_h']}, {r['num_warps']} | {r['sass_instructions']} / "
              f"{r['fast_path_instructions']} | {r['mufu_rcp']} | {r['barriers']} | {r['elements_per_thread']:.0f} "
              f"| {r['instructions_per_element']} | {r['issue_bound_gb_s']:.0f} | {r['issue_bound_frac_copy']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
