import csv, sys
def load(path, k=0):
    rows = list(csv.reader(open(path))); blocks=[]; cur=None
    for r in rows:
        if r and r[0]=="Kernel Name": cur={"rows":[]}; blocks.append(cur); continue
        if r and r[0]=="Address": cur["hdr"]=r; continue
        if cur is not None and r: cur["rows"].append(r)
    return blocks[k]
for path in sys.argv[1:]:
    for k in range(2):
        b = load(path, k); h=b["hdr"]; isrc=h.index("Source"); iall=h.index("Warp Stall Sampling (All Samples)"); iex=h.index("Instructions Executed")
        acq = next(i for i,r in enumerate(b["rows"]) if "ACQBULK" in r[isrc])
        warps = float(b["rows"][0][iex])
        pre = sum(float(r[iall] or 0) for r in b["rows"][:acq+1]); post = sum(float(r[iall] or 0) for r in b["rows"][acq+1:])
        ins_post = sum(float(r[iex] or 0) for r in b["rows"][acq+1:])
        print(f"{path} k{k} warps={warps:.0f} samples pre={pre:.0f} post={post:.0f} per warp pre={pre/warps:.2f} post={post/warps:.2f} instr/warp post={ins_post/warps:.1f}")
