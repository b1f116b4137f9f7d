import csv, sys, collections
def load(f):
    kernels=[];cur=None
    for rec in csv.reader(open(f)):
        if not rec: continue
        if rec[0]=="Kernel Name": cur=[];kernels.append(cur);continue
        if rec[0]=="Address": header=rec;continue
        cur.append(dict(zip(header,rec)))
    n=len(kernels[0])
    samp=[sum(int(k[i]["# Samples"] or 0) for k in kernels) for i in range(n)]
    exe=[sum(int(k[i]["Instructions Executed"] or 0) for k in kernels) for i in range(n)]
    src=[kernels[0][i]["Source"].strip() for i in range(n)]
    return len(kernels),samp,exe,src
for f in sys.argv[1:]:
    L,samp,exe,src=load(f)
    warps=max(exe)
    big=max(range(len(samp)),key=lambda i:samp[i])
    # first line touching global memory after params
    pre=sum(samp[:big]); tail=sum(samp[big+1:])
    ins_pre=sum(exe[:big])/warps; ins_tail=sum(exe[big+1:])/warps
    print(f"{f:28s} per warp: pre {pre/warps:.2f} (inst {ins_pre:.0f}) wait {samp[big]/warps:.2f} tail {tail/warps:.2f} (inst {ins_tail:.0f}) total {sum(samp)/warps:.2f} inst {sum(exe)/warps:.0f}")
