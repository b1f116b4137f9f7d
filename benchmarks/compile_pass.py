"""Compile-time cost of kvfuse's passes, and (on CUDA) what the fusion buys per decoder layer.

CPU/GPU part: a demo-like model (per layer: qkv projection, PagedAttention over its own FP8
cache, output projection, residual) is compiled at 8/16/32/64 layers with
``make_backend(fuse=False)`` and ``kvfuse.backend``-style ``make_backend()`` (Inductor caches
off so every compile is real); the kvfuse passes' own time is measured inside the backend.
CUDA part: one decoder layer, prefill (4096 tokens) and decode (batch 64, 1 token each, 512
context) with fuse=False vs fuse=True: kernel launches (torch.profiler) and latency (CUDA events).

    python -m benchmarks.compile_pass [--layers 8 16 32 64] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
from torch import nn


import kvfuse
from benchmarks.common import current_commit, pyplot
from kvfuse import AttentionMetadata, KVCacheConfig, PagedAttention, allocate_kv_cache


class DemoLike(nn.Module):
    def __init__(self, n_layers, hq=8, hkv=2, d=64, cfg=None, dtype=torch.bfloat16, device="cpu"):
        super().__init__()
        self.hq, self.hkv, self.d = hq, hkv, d
        hidden = hq * d
        self.attn = nn.ModuleList(PagedAttention(hq, hkv, d, f"model.layers.{i}.attn", config=cfg)
                                  for i in range(n_layers))
        self.qkv = nn.ModuleList(nn.Linear(hidden, (hq + 2 * hkv) * d, bias=False) for _ in range(n_layers))
        self.o = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(n_layers))
        self.to(device=device, dtype=dtype)

    def forward(self, x, caches, md):
        T = x.shape[0]
        for i, attn in enumerate(self.attn):
            q, k, v = self.qkv[i](x).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], -1)
            o = attn(q.reshape(T, self.hq, self.d), k.reshape(T, self.hkv, self.d),
                     v.reshape(T, self.hkv, self.d), caches[i], md)
            x = x + self.o[i](o.reshape(T, -1))
        return x


def _inputs(model, T, B, ctx, device, block=16):
    per_seq_blocks = (ctx + block - 1) // block
    caches = [allocate_kv_cache(a.spec, B * per_seq_blocks + 1, block, device=device) for a in model.attn]
    q_per = T // B
    bt = torch.arange(B * per_seq_blocks, dtype=torch.int32, device=device).reshape(B, per_seq_blocks)
    pos = torch.arange(ctx - q_per, ctx, device=device)
    slots = (bt[:, (pos // block)].long() * block + pos % block).reshape(-1)
    md = AttentionMetadata(slots, bt, torch.full((B,), ctx, dtype=torch.int32, device=device),
                           torch.arange(0, T + 1, q_per, dtype=torch.int32, device=device))
    x = torch.randn(T, model.hq * model.d, device=device, dtype=torch.bfloat16)
    return x, caches, md


def compile_times(layers, device):
    rows = []
    for n in layers:
        for fuse in (False, True):
            torch._dynamo.reset()
            model = DemoLike(n, cfg=KVCacheConfig("fp8"), device=device)
            x, caches, md = _inputs(model, 16, 1, 32, device)
            be = kvfuse.make_backend(fuse=fuse, force_disable_caches=True)
            t0 = time.perf_counter()
            with torch.no_grad():
                torch.compile(model, backend=be, fullgraph=True)(x, caches, md)
            total = time.perf_counter() - t0
            rows.append({"layers": n, "fuse": fuse, "compile_s": total, "backend_s": be.last_compile["compile_seconds"],
                         "pass_ms": 1e3 * be.last_compile["pass_seconds"], "fused": be.last_compile["fused"]})
            print(f"layers={n:3d} fuse={fuse!s:5} compile {total:7.2f} s  kvfuse passes "
                  f"{rows[-1]['pass_ms']:7.2f} ms ({100 * rows[-1]['pass_ms'] / 1e3 / total:.3f}%)", flush=True)
    return rows


def gpu_layer(fuse, T, B, ctx):
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    model = DemoLike(1, hq=32, hkv=8, d=128, cfg=KVCacheConfig("fp8"), device="cuda")
    x, caches, md = _inputs(model, T, B, ctx, "cuda")
    f = torch.compile(model, backend=kvfuse.make_backend(fuse=fuse), fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            f(x, caches, md)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            f(x, caches, md)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(50):
            start.record()
            f(x, caches, md)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return {"kernels": len(kernels), "kernel_names": sorted({e.name for e in kernels}),
            "median_us": times[len(times) // 2], "p10_us": times[len(times) // 10]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--skip-compile", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    commit = current_commit()
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name() if device == "cuda"
              else "cpu", "torch": torch.__version__, "commit": commit,
              "command": "python -m benchmarks.compile_pass " + " ".join(f"--layers {' '.join(map(str, args.layers))}".split())}
    if not args.skip_compile:
        result["compile"] = compile_times(args.layers, device)
    if device == "cuda":
        result["layer"] = {}
        for name, (T, B, ctx) in {"prefill_4096": (4096, 1, 4096), "decode_b64": (64, 64, 512)}.items():
            for fuse in (False, True):
                r = gpu_layer(fuse, T, B, ctx)
                result["layer"][f"{name}_fuse_{fuse}"] = r
                print(f"{name} fuse={fuse}: {r['kernels']} kernels, median {r['median_us']:.1f} us", flush=True)
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if device == "cpu" or args.skip_compile is False else ""
    with open(os.path.join(args.out, f"compile_pass{suffix}.json"), "w") as f:
        json.dump(result, f, indent=2)
    write_md_and_plot(result, args.out)


def write_md_and_plot(result, out):
    lines = [f"### compile_pass ({result['date']}, {result['device']}, torch {result['torch']}, commit {result['commit']})",
             "", f"`{result['command']}`", ""]
    if "compile" in result:
        lines += ["| layers | compile fuse=False (s) | compile fuse=True (s) | kvfuse passes (ms) | passes / compile |",
                  "|---:|---:|---:|---:|---:|"]
        by = {(r["layers"], r["fuse"]): r for r in result["compile"]}
        for n in sorted({r["layers"] for r in result["compile"]}):
            a, b = by[(n, False)], by[(n, True)]
            lines.append(f"| {n} | {a['compile_s']:.2f} | {b['compile_s']:.2f} | {b['pass_ms']:.2f} | "
                         f"{100 * b['pass_ms'] / 1e3 / b['compile_s']:.3f}% |")
    if "layer" in result:
        lines += ["", "| step (1 decoder layer, FP8 cache) | fuse | kernels | median (us) |", "|---|---|---:|---:|"]
        for k, r in result["layer"].items():
            step, fuse = k.rsplit("_fuse_", 1)
            lines.append(f"| {step} | {fuse} | {r['kernels']} | {r['median_us']:.1f} |")
    with open(os.path.join(out, "compile_pass.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plt = pyplot(os.path.join(out, "compile_pass.png")) if "compile" in result else None
    if plt is not None:
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ns = sorted({r["layers"] for r in result["compile"]})
        by = {(r["layers"], r["fuse"]): r for r in result["compile"]}
        for fuse in (False, True):
            ax[0].plot(ns, [by[(n, fuse)]["compile_s"] for n in ns], "o-", label=f"fuse={fuse}")
        ax[0].set_xlabel("layers"), ax[0].set_ylabel("compile time (s)"), ax[0].legend()
        ax[1].plot(ns, [by[(n, True)]["pass_ms"] for n in ns], "o-")
        ax[1].set_xlabel("layers"), ax[1].set_ylabel("kvfuse passes (ms)")
        fig.suptitle(f"kvfuse compile cost ({result['device']})")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "compile_pass.png"), dpi=100)


if __name__ == "__main__":
    main()
