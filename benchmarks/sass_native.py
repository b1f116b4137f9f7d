"""Which native kernels a change recompiles differently: SASS of two builds, kernel by kernel (no GPU).

    python -m benchmarks.sass_native [--sources cache_write.cu,...] [--base REV] [--define NAME=VALUE ...]
                                     [--base-define NAME=VALUE ...] [--kernels REGEX] [--arch sm_90a]
                                     [--strict] [--out DIR]

Builds each ``csrc/cuda`` source twice as the native build does (``benchmarks.ptxas_native``'s
compile line, ``-cubin``): the working tree with ``--define``, and the base, which is the same
source at git revision ``--base`` (its whole ``csrc``) and/or with ``--base-define`` instead. It
disassembles both with the ``nvdisasm`` that ships with Triton and reports, for every kernel,
whether its SASS is the same, instruction for instruction and register for register, once the
names that change from build to build (the anonymous namespace's hash, labels, internal
subroutines) are set aside.

Why: nvcc schedules equivalent sources differently, and a few moved lines changed the FP8 rotary
write's time by 11% on the H100 without changing one value it computes (BENCHMARKS.md,
twenty-fourth session). A refactor of a measured kernel is only free when this tool says "same";
a kernel it reports as changed needs measuring again. ``--strict`` exits 1 when any selected
kernel differs or exists in one build only. Writes ``sass_native.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from io import BytesIO
from pathlib import Path

from .ptxas_native import REPO_ROOT, demangle, run_nvcc
from .sass_count import _nvdisasm

_FUNCTION = re.compile(r"^\.text\.(\S+):$", re.MULTILINE)
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", re.MULTILINE)
# Names a rebuild renames without changing the code: the anonymous namespace's per-file hash,
# nvdisasm's labels, the numbering of nvcc's internal subroutines. The namespace's mangled name (in
# a call's or return's target) runs up to an 8-digit hash and, as nvcc 13.0 writes it, a number
# after it (`_GLOBAL__N__20_prefill_attention_cu_024f6148_12725`); the number's digits run into the
# next name's length, which both builds share, so taking them all with it still compares equal.
_RENAMED = ((re.compile(r"_GLOBAL__N__\w*?_[0-9a-f]{8}(?:_\d+)?"), "_GLOBAL__N__"),
            (re.compile(r"\.L_x_\d+"), ".L_x"), (re.compile(r"__internal_\d+"), "__internal"))


def normalise(name: str) -> str:
    for pattern, replacement in _RENAMED:
        name = pattern.sub(replacement, name)
    return name


def kernels(disassembly: str) -> dict[str, list[str]]:
    """Each function of an ``nvdisasm -c`` listing (by readable name, or by mangled name without
    its namespace hash where ``c++filt`` is missing): its instructions in order, with the renamed
    names set aside (addresses and encodings dropped)."""
    starts = list(_FUNCTION.finditer(disassembly))
    out = {}
    for i, (start, name) in enumerate(zip(starts, demangle([s.group(1) for s in starts]))):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(disassembly)
        body = disassembly[start.end():end]
        out[normalise(name)] = [normalise(" ".join(m.group(1).split())) for m in _INSTRUCTION.finditer(body)]
    return out


@dataclass
class KernelDiff:
    kernel: str  # readable name
    status: str  # "same", "differs", "only in base", "only in tree"
    base_instructions: int
    tree_instructions: int
    # instructions in one build and not the other, as multisets (0 while the status is "differs":
    # the same instructions in another order)
    changed: int


def compare(base: dict[str, list[str]], tree: dict[str, list[str]], pattern: str | None = None) -> list[KernelDiff]:
    selected = re.compile(pattern) if pattern else None
    rows = []
    for name in sorted(set(base) | set(tree)):
        if selected is not None and not selected.search(name):
            continue
        a, b = base.get(name), tree.get(name)
        if a is None or b is None:
            status = "only in tree" if a is None else "only in base"
            changed = len(a or b)
        else:
            changed = sum(((Counter(a) - Counter(b)) + (Counter(b) - Counter(a))).values())
            status = "same" if a == b else "differs"
        rows.append(KernelDiff(name, status, len(a or []), len(b or []), changed))
    return rows


def base_tree(revision: str, into: Path) -> Path:
    """``revision``'s whole ``csrc``, extracted under ``into`` (the root that stands for
    ``REPO_ROOT``: a source's path below it is the working tree's)."""
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", revision, "csrc"], capture_output=True,
                             check=False)
    if archive.returncode != 0:
        raise SystemExit(f"sass_native: --base {revision}: {archive.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        # Python 3.10 before 3.10.12 has no extraction filters; git's own archive needs none.
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return into


def disassemble(source: Path, arch: str, defines: list[str]) -> dict[str, list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "out.cubin"
        run_nvcc(source, arch, defines, cubin, cubin=True)
        listing = subprocess.run([_nvdisasm(), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return kernels(listing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", default="cache_write.cu",
                        help="comma-separated files of csrc/cuda (default: cache_write.cu)")
    parser.add_argument("--base", default=None, metavar="REV", help="the base build's git revision of csrc")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra -D for the working tree's build (repeatable)")
    parser.add_argument("--base-define", action="append", default=None, metavar="NAME=VALUE",
                        help="the base build's extra -D (repeatable; default: --define's)")
    parser.add_argument("--kernels", default=None, metavar="REGEX", help="only kernels whose name matches")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any selected kernel's SASS changed")
    parser.add_argument("--out", type=Path, default=None, help="directory for sass_native.json")
    args = parser.parse_args(argv)
    if args.base is None and args.base_define is None:
        parser.error("give --base REV and/or --base-define NAME=VALUE: the two builds would be the same")
    base_defines = args.define if args.base_define is None else args.base_define

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base_root = base_tree(args.base, Path(tmp)) if args.base else REPO_ROOT
        for name in args.sources.split(","):
            source = REPO_ROOT / "csrc" / "cuda" / name.strip()
            if not source.is_file():
                parser.error(f"--sources: {source} does not exist")
            base = base_root / source.relative_to(REPO_ROOT)
            diffs = compare(disassemble(base, args.arch, base_defines), disassemble(source, args.arch, args.define),
                            args.kernels)
            rows += [{"source": source.name, **asdict(d)} for d in diffs]
    width = max((len(r["kernel"]) for r in rows), default=6)
    print(f"{'kernel':<{width}}  {'status':<12}  base  tree  changed")
    for r in rows:
        print(f"{r['kernel']:<{width}}  {r['status']:<12}  {r['base_instructions']:>4}  {r['tree_instructions']:>4}"
              f"  {r['changed']:>7}")
    counts = {s: sum(r["status"] == s for r in rows) for s in ("same", "differs", "only in base", "only in tree")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sass_native.json").write_text(json.dumps(
            {"arch": args.arch, "base": args.base, "defines": args.define, "base_defines": base_defines,
             "rows": rows}, indent=1))
    return 1 if args.strict and counts["same"] != len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
