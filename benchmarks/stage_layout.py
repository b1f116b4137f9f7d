"""Shared-memory traffic of the native decode kernel's FP8 and NVFP4 stages, from a model (no GPU needed).

    python -m benchmarks.stage_layout [--head-sizes 64,128,256] [--out DIR]

``csrc/cuda/decode_attention.cu`` streams each warp's 16-key FP8 chunks through shared memory:
32 lanes copy the chunk's K and V rows with 16-byte ``cp.async`` pieces (``copy_runs``), then read
back their MMA operands (``read_chunk``; NVFP4: ``copy_nvfp4_chunk`` and ``read_nvfp4_chunk``, the
same patterns over D / 2-byte rows of packed codes). This module restates both access patterns and
the stage layouts (``Stage::place``: FP8 rows padded by 16 bytes, the old layout, or rows D bytes
apart with their 32-byte units XOR-swizzled by row, the current one; ``Nvfp4Stage::place``: D / 2-byte
rows whose 32-byte units keep their 128-byte line, XOR-swizzled inside it) and counts, per chunk:

- **sectors**: L2 sector requests of the copies. A row is 32-byte aligned in global memory, so
  pieces 2m and 2m + 1 of a row are one 32-byte sector; the pair costs one request when it lands
  in one aligned 32-byte unit of shared memory, in order, and two otherwise.
- **read wavefronts**: shared-memory wavefronts of the read-back. A warp's load splits into phases
  of 8 lanes (16-byte loads), 16 lanes (8 bytes) or 32 lanes (4 bytes); a phase costs as many
  wavefronts as the most distinct 4-byte words any one of the 32 banks serves.

ncu measured both on the H100 (BENCHMARKS.md, sixteenth session, B=64 ctx 4096, D=128): 23.8
sectors per copy instruction with padded rows and 16.0 with swizzled ones, and 48.4 / 32.9 read
wavefronts per chunk; the model gives 24 / 16 and 48 / 32. The NVFP4 stage (seventeenth session)
reads back at the minimum for D = 64, 128 and 256; ncu counted 0-213 bank conflicts over the
whole B=64 ctx 4096 launch. Writes ``stage_layout.json`` and prints a table. The block scales'
copies and reads are not modelled.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

CHUNK = 16  # keys per warp per chunk (kChunk)
LANES = 32
PIECE = 16  # bytes per cp.async copy
BANKS = 32
SECTOR = 32


def run_byte(words: int, parts: int, part: int, word: int) -> int:
    """Byte of word ``word`` of the run lane part ``part`` (of ``parts``) holds: ``run_byte`` in the
    kernel. Runs of up to 4 words are contiguous; longer ones are 16-byte segments parts * 16 apart."""
    if words <= 4:
        return part * words * 4 + word * 4
    return (word // 4) * parts * 16 + part * 16 + (word % 4) * 4


def swizzle(key: int, units: int) -> int:
    """The 32-byte unit permutation of key row ``key`` (``Stage::swizzle``), for rows of ``units`` units."""
    return (((key >> 1) & 1) | (((key ^ (key >> 2)) & 1) << 1)) & (units - 1)


def line_swizzle(key: int, units: int) -> int:
    """The XOR on the 2-bit place of key row ``key``'s 32-byte units in their 128-byte line
    (``Nvfp4Stage::line_swizzle``), for rows of ``units`` (1, 2 or 4) units."""
    if units == 4:
        return swizzle(key, 4)
    return (key >> 1) & 3 if units == 2 else (key >> 2) & 1


@dataclass(frozen=True)
class StageLayout:
    """Where byte ``byte`` of a side's key row ``key`` lies in a stage: D-byte FP8 rows ("padded",
    "swizzled") or D / 2-byte NVFP4 rows ("nvfp4", head sizes 64, 128, 256)."""

    name: str
    head_size: int

    def __post_init__(self):
        if self.name not in ("padded", "swizzled", "nvfp4"):
            raise ValueError(f"StageLayout.name={self.name!r}: expected 'padded', 'swizzled' or 'nvfp4'")
        if self.head_size <= 0 or self.row_bytes % SECTOR or (self.name == "nvfp4" and self.row_bytes > 128):
            allowed = "64, 128 or 256" if self.name == "nvfp4" else f"a positive multiple of {SECTOR}"
            raise ValueError(f"StageLayout.head_size={self.head_size}: expected {allowed} for {self.name!r}")

    @property
    def row_bytes(self) -> int:
        return self.head_size // 2 if self.name == "nvfp4" else self.head_size

    @property
    def pitch(self) -> int:
        return self.row_bytes + (16 if self.name == "padded" else 0)

    def place(self, key: int, byte: int) -> int:
        if self.name == "padded":
            return key * self.pitch + byte
        units = self.row_bytes // SECTOR
        if self.name == "nvfp4":
            unit = key * units + (byte >> 5)
            return (((unit & ~3) | ((unit & 3) ^ line_swizzle(key, units))) << 5) | (byte & 31)
        return key * self.pitch + ((((byte >> 5) ^ swizzle(key, units)) << 5) | (byte & 31))


def wavefronts(addresses: Sequence[Optional[int]], width: int) -> int:
    """Shared-memory wavefronts of one warp access of ``width`` bytes per lane (None: lane idle)."""
    per_phase = {16: 8, 8: 16, 4: 32}[width]
    total = 0
    for first in range(0, LANES, per_phase):
        words_by_bank: dict[int, set[int]] = {}
        for address in addresses[first:first + per_phase]:
            if address is None:
                continue
            for byte in range(address, address + width, 4):
                words_by_bank.setdefault((byte // 4) % BANKS, set()).add(byte // 4)
        total += max((len(words) for words in words_by_bank.values()), default=0)
    return total


def chunk_reads(layout: StageLayout) -> tuple[int, int]:
    """(wavefronts, the minimum for the bytes read) of one chunk's read-back (``read_chunk``):
    lane (g, t) reads K rows g and g + 8 (its quarter of each) and V rows 2t, 2t + 1, 2t + 8, 2t + 9
    (its eighth of each)."""
    k_words, v_words = layout.row_bytes // 16, layout.row_bytes // 32
    stage_v = CHUNK * layout.pitch
    counted = minimum = 0

    def access(words: int, address_of: Callable[[int], int]) -> None:
        nonlocal counted, minimum
        width = min(words, 4) * 4
        counted += wavefronts([address_of(lane) for lane in range(LANES)], width)
        minimum += LANES * width // (BANKS * 4)

    for r in range(2):
        for s in range((k_words + 3) // 4):
            access(k_words, lambda lane: layout.place(lane // 4 + 8 * r, run_byte(k_words, 4, lane % 4, 4 * s)))
    for r in range(4):
        for s in range((v_words + 3) // 4):
            access(v_words, lambda lane: stage_v + layout.place(
                2 * (lane % 4) + (r & 1) + 8 * (r >> 1), run_byte(v_words, 8, lane // 4, 4 * s)))
    return counted, minimum


def chunk_copies(layout: StageLayout) -> tuple[int, int, int]:
    """(L2 sector requests, the sectors of the chunk, copy instructions) of one chunk's ``copy_runs``:
    copy i = lane + 32 j takes piece i % pieces of key (i / pieces) % 16 of side i / (16 pieces)."""
    pieces = layout.row_bytes // PIECE
    copies = 2 * CHUNK * pieces
    stage_v = CHUNK * layout.pitch
    requests = 0
    for j in range(copies // LANES):
        for lane in range(0, LANES, 2):
            pair = []
            for i in (lane + LANES * j, lane + 1 + LANES * j):
                side, key, piece = i // (CHUNK * pieces), (i // pieces) % CHUNK, i % pieces
                pair.append(side * stage_v + layout.place(key, piece * PIECE))
            requests += 1 if pair[0] % SECTOR == 0 and pair[1] == pair[0] + PIECE else 2
    return requests, copies * PIECE // SECTOR, copies // LANES


def model(head_sizes: Sequence[int]) -> list[dict]:
    rows = []
    for head_size in head_sizes:
        for name in ("padded", "swizzled", "nvfp4"):
            layout = StageLayout(name, head_size)
            reads, read_minimum = chunk_reads(layout)
            requests, sectors, instructions = chunk_copies(layout)
            rows.append({"head_size": head_size, "layout": name, "pitch": layout.pitch,
                         "read_wavefronts": reads, "read_wavefronts_minimum": read_minimum,
                         "sector_requests": requests, "sectors": sectors,
                         "sector_requests_per_copy": requests / instructions})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-sizes", default="64,128,256")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    try:
        head_sizes = [int(x) for x in args.head_sizes.split(",")]
    except ValueError:
        parser.error(f"--head-sizes {args.head_sizes!r}: expected comma-separated integers")
    rows = model(head_sizes)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stage_layout.json"), "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    print("| D | layout | pitch | read wavefronts (minimum) | L2 sector requests (sectors) | per copy |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['head_size']} | {r['layout']} | {r['pitch']} | {r['read_wavefronts']} ({r['read_wavefronts_minimum']}) "
              f"| {r['sector_requests']} ({r['sectors']}) | {r['sector_requests_per_copy']:.1f} |")


if __name__ == "__main__":
    main()
