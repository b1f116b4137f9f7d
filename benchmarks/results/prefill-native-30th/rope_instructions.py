"""Per-warp executed instructions of the NVFP4 write alone and the rotary write (4096 tokens, f32 half
tables) from ncu's source page: python rope_instructions.py callb/rope_write_sass.csv.gz callb/rope_rope_sass.csv.gz

Lines that every warp executes count for every warp; the runs of lines that only some warps execute
are listed (the rotary kernel's K and V units run in separate warps, so each such run belongs to
the key warps or to the value warps; BENCHMARKS.md reads them against the SASS)."""
import csv, gzip, sys


def load(path):
    rows = list(csv.reader(gzip.open(path, "rt", errors="replace")))
    hi = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[hi]
    H = {c: i for i, c in enumerate(hdr)}
    data = [r for r in rows[hi + 1:] if len(r) == len(hdr)]
    num = lambda x: float(x.replace(",", "")) if x not in ("", "-") else 0.0  # noqa: E731
    return [(r[H["Source"]].strip(), num(r[H["Instructions Executed"]])) for r in data]


for path in sys.argv[1:]:
    lines = load(path)
    warps = max(ie for _, ie in lines)
    every = sum(1 for _, ie in lines if ie == warps)
    half = [(j, s) for j, (s, ie) in enumerate(lines) if 0 < ie < warps]
    total = sum(ie for _, ie in lines)
    print(f"{path}: {warps:.0f} warps, {total / 1e6:.3f} M warp instructions, {total / warps:.1f} per warp")
    print(f"  executed by every warp: {every} instructions; by some warps: {len(half)} lines")
    runs = []
    for j, s in half:
        if runs and j == runs[-1][1] + 1:
            runs[-1][1] = j
        else:
            runs.append([j, j])
    for a, b in runs:
        ops = [lines[k][0].split()[0] if not lines[k][0].startswith("@") else lines[k][0].split()[1] for k in range(a, b + 1)]
        arith = sum(o in ("FMUL", "FFMA", "F2FP.BF16.F32.PACK_AB") for o in ops)
        print(f"  lines [{a}, {b}]: {b - a + 1:4d} instructions, {lines[a][1]:.0f} warps, {arith} FMUL/FFMA/F2FP.BF16 | {lines[a][0][:60]}")
