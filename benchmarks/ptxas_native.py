"""Registers, spills and serialised ``wgmma`` of the native CUDA kernels, from ptxas (no GPU needed).

    python -m benchmarks.ptxas_native [--sources prefill_attention.cu,...] [--define NAME=VALUE ...]
                                      [--arch sm_90a] [--strict] [--out DIR]

Compiles each ``csrc/cuda`` source the way the native build does (``kvfuse.ops.native``: its nvcc
flags, torch's extension flags and ``KVFUSE_NATIVE_CUDA_FLAGS``, plus any ``--define``) for one
architecture with ``-Xptxas -v``, and reports, kernel by kernel, what ptxas said: registers, stack
frame, spill stores and loads, and its performance warnings (C7510 / C7511: ``wgmma.mma_async``
serialised). A serialised ``wgmma`` pipeline builds and passes every test; only ptxas's log says
so, and it cost the e4m3 prefill kernel 18-24% (BENCHMARKS.md, twenty-second session).
``--strict`` exits with status 1 when any kernel has such a warning.

Needs ``nvcc`` (``CUDA_HOME`` or ``PATH``). A CPU-only torch wheel lacks one header the sources
include, ``c10/cuda/impl/cuda_cmake_macros.h``; an empty stand-in for it is put in a temporary
include directory. Writes ``ptxas_native.json`` to ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_COMPILING = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_WARNING = re.compile(r"\((C\d{4})\) (.*?) in the function '([^']+)'")


@dataclass
class KernelReport:
    """What ptxas said about one kernel (``name`` mangled, as ptxas prints it)."""

    name: str
    arch: str = ""
    registers: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    warnings: list[str] = field(default_factory=list)  # "C7511: <ptxas's text>"

    @property
    def serialised(self) -> bool:
        """Whether ptxas serialised this kernel's ``wgmma`` instructions."""
        return any(w.startswith(("C7510", "C7511")) for w in self.warnings)


def parse_ptxas_log(log: str) -> list[KernelReport]:
    """The kernels of one ``-Xptxas -v`` log, in the order ptxas compiled them.

    A warning names its function (ptxas prints it before that function's own lines); the frame
    line belongs to the last "Function properties" line and the register line to the last
    "Compiling entry function" line."""
    kernels: dict[str, KernelReport] = {}
    compiled: list[str] = []
    compiling = properties = None

    def kernel(name: str) -> KernelReport:
        return kernels.setdefault(name, KernelReport(name))

    for line in log.splitlines():
        if m := _COMPILING.search(line):
            compiling = kernel(m.group(1))
            compiling.arch = m.group(2)
            compiled.append(compiling.name)
        elif m := _PROPERTIES.search(line):
            properties = m.group(1)
        elif (m := _FRAME.search(line)) and properties is not None:
            k = kernel(properties)
            k.stack_bytes, k.spill_stores, k.spill_loads = (int(g) for g in m.groups())
        elif (m := _USED.search(line)) and compiling is not None:
            compiling.registers = int(m.group(1))
        if m := _WARNING.search(line):
            kernel(m.group(3)).warnings.append(f"{m.group(1)}: {m.group(2)}")
    rank = {name: i for i, name in enumerate(compiled)}
    return sorted(kernels.values(), key=lambda k: rank.get(k.name, len(rank)))


def demangle(names: list[str]) -> list[str]:
    """Readable kernel names (``c++filt`` when installed), without kvfuse's namespaces and the
    parameter lists."""
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    readable = []
    for name in out.splitlines():
        name = re.sub(r"kvfuse::\(anonymous namespace\)::", "", name)
        depth, end = 0, len(name)
        for i, ch in enumerate(name):  # cut at the parameter list's "(" outside template brackets
            depth += ch == "<"
            depth -= ch == ">"
            if ch == "(" and depth == 0 and i > 0:
                end = i
                break
        readable.append(name[:end].removeprefix("void "))
    return readable


def nvcc_command(source: Path, arch: str, defines: list[str], include_dirs: list[str], obj: Path,
                 cubin: bool = False) -> list[str]:
    """The native build's compile line for ``source``: an object file with ptxas's report turned on,
    or (``cubin``) the device code alone, for disassembly."""
    import torch
    from torch.utils import cpp_extension

    from kvfuse.ops import native

    nvcc = native.nvcc_path()
    if nvcc is None:
        raise SystemExit("ptxas_native: no nvcc found (set CUDA_HOME or put nvcc on PATH)")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    number = arch.removeprefix("sm_")
    return [nvcc, "-std=c++17", "-cubin" if cubin else "-c", str(source), "-o", str(obj),
            f"-gencode=arch=compute_{number},code=sm_{number}", "-DKVFUSE_WITH_CUDA",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *native._NVCC_FLAGS, *cpp_extension.COMMON_NVCC_FLAGS,
            *native._extra_cuda_flags(), *(f"-D{d}" for d in defines), *([] if cubin else ["-Xptxas", "-v"]),
            *(f"-I{d}" for d in include_dirs)]


def run_nvcc(source: Path, arch: str, defines: list[str], out: Path, cubin: bool = False) -> str:
    """Compile ``source`` (a ``csrc/cuda`` file of this or another tree: its own ``csrc`` comes
    first on the include path) into ``out``; nvcc's output, or RuntimeError with it on failure."""
    from torch.utils import cpp_extension

    with tempfile.TemporaryDirectory() as tmp:
        include_dirs = [str(source.parent.parent), *cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
        if not any((Path(d) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for d in include_dirs):
            stub = Path(tmp) / "stub" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
            stub.parent.mkdir(parents=True)
            stub.write_text("#pragma once\n")
            include_dirs.append(str(Path(tmp) / "stub"))
        command = nvcc_command(source, arch, defines, include_dirs, out, cubin=cubin)
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source.name}:\n{done.stderr[-4000:]}")
    return done.stdout + done.stderr


def compile_report(source: Path, arch: str, defines: list[str]) -> list[KernelReport]:
    """Compile ``source`` and parse what ptxas printed (raises with nvcc's output on failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        return parse_ptxas_log(run_nvcc(source, arch, defines, Path(tmp) / "out.o"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", default="prefill_attention.cu",
                        help="comma-separated files of csrc/cuda (default: prefill_attention.cu)")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra -D for nvcc (repeatable), e.g. KVFUSE_PREFILL_FP8_STAGES=2")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--strict", action="store_true", help="exit 1 if ptxas serialised any wgmma")
    parser.add_argument("--out", type=Path, default=None, help="directory for ptxas_native.json")
    args = parser.parse_args(argv)

    rows = []
    for name in args.sources.split(","):
        source = REPO_ROOT / "csrc" / "cuda" / name.strip()
        if not source.is_file():
            parser.error(f"--sources: {source} does not exist")
        kernels = compile_report(source, args.arch, args.define)
        for kernel, readable in zip(kernels, demangle([k.name for k in kernels])):
            rows.append({"source": source.name, "kernel": readable, **asdict(kernel),
                         "serialised": kernel.serialised})
    width = max((len(r["kernel"]) for r in rows), default=6)
    print(f"{'kernel':<{width}}  regs  stack  spill st/ld  serialised")
    for r in rows:
        print(f"{r['kernel']:<{width}}  {r['registers']:>4}  {r['stack_bytes']:>5}  "
              f"{r['spill_stores']:>5}/{r['spill_loads']:<5}  {'YES' if r['serialised'] else 'no'}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ptxas_native.json").write_text(json.dumps(
            {"arch": args.arch, "defines": args.define, "rows": rows}, indent=1))
    serialised = [r["kernel"] for r in rows if r["serialised"]]
    if serialised and args.strict:
        print(f"ptxas serialised wgmma in {len(serialised)} kernel(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
