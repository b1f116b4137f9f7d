"""The demo model split over tensor-parallel ranks, checked against the unsplit model.

    torchrun --nproc-per-node 2 -m kvfuse.examples.tp_demo [--kv-cache-dtypes fp8,nvfp4] [--device cpu]

Every rank builds its shard of the same seeded model (:mod:`kvfuse.models.llama`), its own
paged caches holding only its KV heads, and runs, for each requested cache dtype (with the
skip layers kept in the model dtype): teacher-forced prefill + decode steps and greedy
generation, eagerly and compiled with :func:`kvfuse.make_backend`. Rank 0 gathers every
rank's cache plan and fusion report (``torch.distributed.gather_object``), runs the unsplit
model (tp_size 1) on the same inputs, and prints how far the split model's logits and tokens
are from it and whether the ranks' reports agree layer by layer; ``--json`` writes the same
as JSON. Exit status 1 when ``--check`` is given and a check fails.

CPU uses gloo, CUDA uses NCCL (one GPU per rank, by ``LOCAL_RANK``); NVLink multicast
(NVLS) is turned off unless ``NCCL_NVLS_ENABLE`` is already set.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..kv_cache import logical_cache_rows

logger = logging.getLogger(__name__)

#: Default tolerance of --check on logits: the split model sums its row-parallel products in
#: another order, so in float32 the logits differ by float rounding only (about 2e-6 on the
#: default model). A cache row on the edge of an FP8/NVFP4 rounding step can land on the other
#: side; that is rare at these sizes and would show here.
LOGIT_ATOL = 1e-4
LOGIT_RTOL = 1e-4
#: Quantized caches: the fraction of stored elements allowed to differ from the unsplit model's
#: (inputs a float rounding apart, on the edge of a rounding step); anything systematic, such
#: as a head quantized with another head's scale or written to the wrong place, is far above.
MAX_CACHE_FLIPS = 1e-3


@dataclass(frozen=True)
class DemoOptions:
    kv_cache_dtypes: tuple = ("fp8", "nvfp4")
    skip_layers: tuple = ("0", "sliding_window")
    model_dtype: str = "float32"
    layers: int = 3
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 32
    intermediate: int = 128
    vocab: int = 128
    sliding_window: int = 6
    sliding_window_layers: tuple = (1,)
    prompt_lens: tuple = (9, 4, 13)
    steps: int = 3
    block_size: int = 4
    seed: int = 0
    compile: bool = True
    device: str = "cpu"
    atol: float = LOGIT_ATOL
    rtol: float = LOGIT_RTOL

    def model_config(self):
        from ..kv_cache import KVQuantMode, _parse_dtype_name
        from ..models.llama import LlamaConfig

        mode, native = _parse_dtype_name(self.model_dtype, "model_dtype")
        if mode is not KVQuantMode.NONE or native is None:
            raise ValueError(f"model_dtype={self.model_dtype!r} must name a native dtype (float32, bfloat16, float16)")
        return LlamaConfig(num_layers=self.layers, hidden_size=self.hidden, num_heads=self.heads,
                           num_kv_heads=self.kv_heads, head_size=self.head_size, intermediate_size=self.intermediate,
                           vocab_size=self.vocab, sliding_window=self.sliding_window,
                           sliding_window_layers=tuple(self.sliding_window_layers), dtype=native, seed=self.seed)


def _error(a: torch.Tensor, b: torch.Tensor, opts: "DemoOptions") -> dict:
    from ..models.demo import compare_logits

    err = compare_logits(a, b)
    return {"max_abs": err.max_abs, "rel_error": err.rel_error, "top1_agree": err.top1_agree, "rows": err.rows,
            "close": bool(torch.allclose(a, b, atol=opts.atol, rtol=opts.rtol)), "atol": opts.atol,
            "rtol": opts.rtol}


def _run(model, batch, prompts, opts: DemoOptions, pad_to: int, forward=None) -> dict:
    from ..models.demo import generate_greedy, run_steps

    logits, manager = run_steps(model, batch, block_size=opts.block_size, forward=forward, pad_to=pad_to)
    tokens, greedy_logits = generate_greedy(model, prompts, opts.steps + 1, block_size=opts.block_size,
                                            forward=forward, pad_to=pad_to)
    return {"logits": logits, "tokens": tokens, "greedy_logits": greedy_logits,
            "caches": [c.cpu() for c in manager.kv_caches]}


def _cache_differences(rank_caches: list, rank_plans: list, reference: list) -> list[dict]:
    """Per rank and layer: how the rank's cache differs from the unsplit cache's rows of its heads.

    ``elements_differ`` counts stored elements (bytes for NVFP4) that are not bit-identical;
    ``max_abs`` is over the stored values for native and FP8 caches (None for NVFP4, whose
    bytes hold packed codes and scales).
    """
    out = []
    for rank, (caches, plan) in enumerate(zip(rank_caches, rank_plans)):
        for layer, (mine, full) in enumerate(zip(caches, reference)):
            heads = plan[layer]["kv_heads"]
            # Logical (token, head) rows: an NVFP4 page interleaves its heads' data and scales.
            mine, full = logical_cache_rows(mine), logical_cache_rows(full)
            want = full[:, :, :, heads[0]:heads[-1] + 1]
            same = mine.view(torch.uint8) == want.view(torch.uint8) if mine.dtype.itemsize == 1 else mine == want
            max_abs = None if mine.dtype == torch.uint8 else (mine.float() - want.float()).abs().max().item()
            out.append({"rank": rank, "layer": layer, "mode": plan[layer]["mode"], "elements": mine.numel(),
                        "elements_differ": int((~same).sum().item()), "max_abs": max_abs})
    return out


def _plan(model) -> list[dict]:
    return [{"layer_name": s.layer_name, "mode": s.kv_quant_mode.name, "storage": str(s.kv_cache_torch_dtype),
             "kv_heads": list(s.kv_heads), "num_kv_heads": s.num_kv_heads, "bytes_per_token": s.bytes_per_token}
            for s in model.kv_specs]


def run_rank(opts: DemoOptions, group=None) -> Optional[dict]:
    """This rank's part of the demo; rank 0 returns the comparison (other ranks: None).

    Every rank of ``group`` (default: the world) must call it with the same options.
    """
    import torch.distributed as dist

    from .. import KVCacheConfig, make_backend
    from ..distributed import TensorParallel, compare_reports, gather_reports
    from ..models.demo import make_batch
    from ..models.llama import LlamaForCausalLM

    group = group if group is not None else dist.group.WORLD
    tp = TensorParallel.from_group(group)
    device = torch.device(opts.device, torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
    config = opts.model_config()
    batch = make_batch(config.vocab_size, opts.prompt_lens, opts.steps, seed=opts.seed)
    prompts = [list(p) for p in batch.prompts]
    pad_to = -(-max(sum(opts.prompt_lens), len(opts.prompt_lens)) // 8) * 8
    results = []
    for dtype in opts.kv_cache_dtypes:
        kv_config = KVCacheConfig(kv_cache_dtype=dtype, skip_layers=tuple(opts.skip_layers))
        model = LlamaForCausalLM(config, kv_config, device=device, tp_group=group).eval()
        start = time.perf_counter()
        runs = {"eager": _run(model, batch, prompts, opts, pad_to)}
        logger.info("rank %d: %s eager in %.1f s", tp.rank, dtype, time.perf_counter() - start)
        report = []
        if opts.compile:
            be = make_backend()
            compiled = torch.compile(model, backend=be)
            start = time.perf_counter()
            runs["compiled"] = _run(model, batch, prompts, opts, pad_to, forward=compiled)
            logger.info("rank %d: %s compiled in %.1f s", tp.rank, dtype, time.perf_counter() - start)
            report = list(be.report)
        reports = gather_reports(report, group=group)
        plans = [None] * tp.tp_size if tp.rank == 0 else None
        dist.gather_object(_plan(model), plans, dst=dist.get_global_rank(group, 0), group=group)
        # As raw bytes: float8 tensors do not survive pickling.
        as_bytes = [(str(c.dtype).replace("torch.", ""), c.view(torch.uint8)) for c in runs["eager"]["caches"]]
        rank_caches = [None] * tp.tp_size if tp.rank == 0 else None
        dist.gather_object(as_bytes, rank_caches, dst=dist.get_global_rank(group, 0), group=group)
        if rank_caches is not None:
            rank_caches = [[raw.view(getattr(torch, name)) for name, raw in caches] for caches in rank_caches]
        # Every rank ends with complete logits (all-reduced hidden states, replicated lm_head),
        # and they must be the same bits on every rank: max - min over ranks is 0.
        high = runs["eager"]["logits"].to(device)
        low = high.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        ranks_differ = (high - low).abs().max().item()
        if tp.rank != 0:
            del model
            continue
        # The unsplit model on rank 0 alone (no group: tp_size 1).
        reference = LlamaForCausalLM(config, kv_config, device=device).eval()
        ref_runs = {"eager": _run(reference, batch, prompts, opts, pad_to)}
        if opts.compile:
            ref_runs["compiled"] = _run(reference, batch, prompts, opts, pad_to,
                                        forward=torch.compile(reference, backend=make_backend()))
        entry = {"kv_cache_dtype": dtype, "plans": plans, "reports": reports,
                 "report_mismatches": compare_reports(reports) if opts.compile else [],
                 "reference_plan": _plan(reference), "ranks_max_abs_diff": ranks_differ,
                 "cache_differences": _cache_differences(rank_caches, plans, ref_runs["eager"]["caches"])}
        for mode, run in runs.items():
            ref = ref_runs[mode]
            entry[mode] = {"logits": _error(run["logits"], ref["logits"], opts),
                           "greedy_logits": _error(run["greedy_logits"].flatten(0, 1),
                                                   ref["greedy_logits"].flatten(0, 1), opts),
                           "tokens": [list(t) for t in run["tokens"]],
                           "reference_tokens": [list(t) for t in ref["tokens"]],
                           "tokens_equal": run["tokens"] == ref["tokens"]}
        if opts.compile:
            entry["compiled_vs_eager_reference"] = _error(runs["compiled"]["logits"], ref_runs["eager"]["logits"],
                                                          opts)
        results.append(entry)
        del model, reference
    if tp.rank != 0:
        return None
    return {"tp_size": tp.tp_size, "backend": dist.get_backend(group), "options": opts.__dict__, "results": results}


def check(summary: dict) -> list[str]:
    """The failed checks of a :func:`run_rank` summary (empty: the split model matches)."""
    failures = []
    for entry in summary["results"]:
        name = entry["kv_cache_dtype"]
        failures += [f"{name}: {m}" for m in entry["report_mismatches"]]
        if entry["ranks_max_abs_diff"] != 0:
            failures.append(f"{name}: ranks' logits differ by {entry['ranks_max_abs_diff']:.3e}")
        for d in entry.get("cache_differences", ()):
            where = f"{name}: rank {d['rank']} layer {d['layer']} ({d['mode']}) cache"
            if d["mode"] == "NONE":
                if d["max_abs"] > summary["options"]["atol"]:
                    failures.append(f"{where} differs from tp_size 1's by up to {d['max_abs']:.3e}")
            elif d["elements_differ"] > MAX_CACHE_FLIPS * d["elements"]:
                failures.append(f"{where}: {d['elements_differ']} of {d['elements']} stored elements differ "
                                f"from tp_size 1's (allowed: {MAX_CACHE_FLIPS:.0e} of them)")
        for mode in ("eager", "compiled"):
            if mode not in entry:
                continue
            for what in ("logits", "greedy_logits"):
                err = entry[mode][what]
                if not err["close"]:
                    failures.append(f"{name} {mode} {what}: max abs {err['max_abs']:.3e}, relative "
                                    f"{err['rel_error']:.3e}; not within atol {err['atol']}, rtol {err['rtol']}")
            if not entry[mode]["tokens_equal"]:
                failures.append(f"{name} {mode}: greedy tokens {entry[mode]['tokens']} != tp_size 1's "
                                f"{entry[mode]['reference_tokens']}")
    return failures


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_summary(summary: dict) -> str:
    out = [f"tensor parallel demo: tp_size {summary['tp_size']} ({summary['backend']}), "
           f"model dtype {summary['options']['model_dtype']}, compared with the unsplit model on rank 0"]
    for entry in summary["results"]:
        out.append("")
        out.append(f"kv_cache_dtype={entry['kv_cache_dtype']!r}, per-rank cache plan:")
        rows = []
        for rank, plan in enumerate(entry["plans"]):
            for layer in plan:
                heads = layer["kv_heads"]
                rows.append((rank, layer["layer_name"], layer["mode"], layer["storage"],
                             f"{heads[0]}-{heads[-1]}" if len(heads) > 1 else heads[0], layer["bytes_per_token"]))
        out.append(_table(("rank", "layer", "mode", "storage", "kv heads", "bytes/token"), rows))
        for mode in ("eager", "compiled"):
            if mode in entry:
                e = entry[mode]
                out.append(f"{mode}: logits vs tp_size 1: max abs {e['logits']['max_abs']:.3e}, relative "
                           f"{e['logits']['rel_error']:.3e}; greedy tokens "
                           f"{'equal' if e['tokens_equal'] else 'DIFFER'} {e['tokens']}")
        if entry["reports"] and entry["reports"][0]:
            out.append("fusion report (rank 0; every rank's is compared):")
            out.append(_table(("layer", "mode", "fused", "reason"),
                              [(r["layer_name"], r["kv_quant_mode"], "yes" if r["fused"] else "no", r["reason"])
                               for r in entry["reports"][0]]))
            out.append("reports agree on every rank" if not entry["report_mismatches"]
                       else "reports DIFFER:\n  " + "\n  ".join(entry["report_mismatches"]))
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch.distributed as dist

    from ..distributed import init_tensor_parallel, shutdown_tensor_parallel

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-cache-dtypes", default="fp8,nvfp4", help="comma-separated cache dtypes, one run each")
    p.add_argument("--skip-layers", default="0,sliding_window", help="skip rules kept in the model dtype")
    p.add_argument("--model-dtype", default="float32")
    p.add_argument("--device", default=None, help="cpu (gloo) or cuda (NCCL); default: cuda when available")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="decode steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--atol", type=float, default=LOGIT_ATOL, help=f"--check's logit atol (default {LOGIT_ATOL})")
    p.add_argument("--rtol", type=float, default=LOGIT_RTOL, help=f"--check's logit rtol (default {LOGIT_RTOL})")
    p.add_argument("--json", default=None, help="write rank 0's summary here")
    p.add_argument("--check", action="store_true", help="exit 1 if the split model differs from tp_size 1")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    opts = DemoOptions(
        kv_cache_dtypes=tuple(d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()),
        skip_layers=tuple(s.strip() for s in args.skip_layers.split(",") if s.strip()),
        model_dtype=args.model_dtype, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, head_size=args.head_size, intermediate=2 * args.hidden, steps=args.steps,
        seed=args.seed, compile=not args.no_compile, device=device, atol=args.atol, rtol=args.rtol,
        sliding_window_layers=(args.layers // 2,),
    )
    init_tensor_parallel(device=device)
    try:
        summary = run_rank(opts)
        failures = []
        if summary is not None:
            failures = check(summary)
            summary["failures"] = failures
            print(format_summary(summary))
            print("checks: " + ("all passed" if not failures else "FAILED:\n  " + "\n  ".join(failures)))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(summary, f, indent=1, default=str)
        flag = torch.tensor([1 if failures else 0])
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.broadcast(flag, src=0)  # every rank exits with rank 0's verdict
        # No rank tears its connections down while another still talks through them.
        dist.barrier()
        return 1 if (args.check and flag.item()) else 0
    finally:
        shutdown_tensor_parallel()


if __name__ == "__main__":
    sys.exit(main())
