"""Read-only probes of the NVFP4 decode benchmark's cache (B64 ctx4096, 8 KV heads, D=128, page 16):
how fast can its bytes be read in the decode kernel's pattern (one KV head's 64-byte rows, 512 bytes
apart) against rows of 2, 4 or 8 heads at once (128 to 512 contiguous bytes), at the same program count."""
import json, sys
import torch, triton, triton.language as tl

from benchmarks.attention import MODES, decode_args
from benchmarks.common import bench, copy_bandwidth_gb_s


@triton.jit
def probe(cache, bt, out, stride_cb, stride_ckv, pages_per_split, pages_per_seq,
          H: tl.constexpr, HG: tl.constexpr, ROW: tl.constexpr, SC: tl.constexpr, PAGE: tl.constexpr,
          HEADS_FAST: tl.constexpr):
    b = tl.program_id(1) if HEADS_FAST else tl.program_id(0)
    hg = tl.program_id(0) if HEADS_FAST else tl.program_id(1)
    sp = tl.program_id(2)
    slots = tl.arange(0, PAGE)[:, None]
    dw = tl.arange(0, HG * ROW // 4)[None, :]
    sw = tl.arange(0, HG * SC // 4)[None, :]
    acc = tl.zeros([PAGE, HG * ROW // 4], tl.int32)
    sacc = tl.zeros([PAGE, HG * SC // 4], tl.int32)
    for i in range(pages_per_split):
        p = sp * pages_per_split + i
        blk = tl.load(bt + b * pages_per_seq + p).to(tl.int64)
        for side in tl.static_range(2):
            base = cache + blk * stride_cb + side * stride_ckv
            d = tl.load((base + (slots * H + hg * HG) * ROW).to(tl.pointer_type(tl.int32)) + dw)
            acc ^= d
            s = tl.load((base + PAGE * H * ROW + (slots * H + hg * HG) * SC).to(tl.pointer_type(tl.int32)) + sw)
            sacc ^= s
    tl.store(out + ((b * (H // HG) + hg) * tl.num_programs(2) + sp), tl.sum(acc) + tl.sum(sacc))


def main():
    args = decode_args(MODES["nvfp4"], 64, 4096)
    cache, bt = args[1], args[4]
    B, pages = bt.shape
    H, ROW, SC, PAGE = cache.shape[3], 64, 8, cache.shape[2]
    nbytes = cache.numel()
    copy = copy_bandwidth_gb_s()
    rows = []
    for hg, fast in ((1, False), (1, True), (2, False), (4, False), (8, False)):
        for warps in (2, 4):
            splits = hg
            out = torch.empty(B * (H // hg) * splits, dtype=torch.int32, device="cuda")
            grid = (H // hg, B, splits) if fast else (B, H // hg, splits)
            fn = lambda: probe[grid](cache, bt, out, cache.stride(0), cache.stride(1), pages // splits, pages,
                                     H=H, HG=hg, ROW=ROW, SC=SC, PAGE=PAGE, HEADS_FAST=fast, num_warps=warps)
            t = bench([fn]).us
            row = dict(heads_per_read=hg, heads_fastest=fast, warps=warps, programs=B * H, us=round(t, 2),
                       gb_s=round(nbytes / t / 1e3, 1), frac_of_copy=round(nbytes / t / 1e3 / copy, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
    json.dump(dict(copy_gb_per_s=copy, bytes=nbytes, rows=rows), open(sys.argv[1], "w"), indent=1)


main()
