"""One rank of the transformers tensor-parallel check (launched by test_transformers_tp.py with torchrun).

    torchrun --nproc-per-node 2 tests/distributed/hf_tp_worker.py --model llama=DIR [--model qwen3=DIR]
        --json OUT [--compile llama] [--device cuda]

Every rank loads each saved tiny model with transformers' own tensor parallelism
(``from_pretrained(DIR, distributed_config=DistributedConfig(tp_size=2, tp_plan="auto"))``: the
model's ``base_model_tp_plan``, DTensor shards, all-reduce after the row-parallel projections),
puts it on kvfuse caches with ``kvfuse.integrations.transformers.enable`` and runs greedy
``generate`` on left-padded prompts: once with float32 caches, once with mixed per-layer modes
(layer 0 float32, the rest FP8), and, for the models named by ``--compile``, with ``model.forward``
compiled by ``kvfuse.make_backend()``. Rank 0 gathers every rank's plan, caches and fusion
report, runs the same on the unsharded model (tp_size 1: transformers' eager attention, and
kvfuse with the same cache config), and writes what the test asserts to ``--json``. ``--device
cuda``: NCCL, one GPU per rank (``LOCAL_RANK``), NVLink multicast off.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from kvfuse.backend import KVFuseBackend
from kvfuse.distributed import shutdown_tensor_parallel
from kvfuse.kv_cache import logical_cache_rows

NEW_TOKENS = 12
PROMPT_LENGTHS = (9, 4, 6)
MIXED = dict(kv_cache_dtype="fp8", skip_layers=("0",))


def left_padded_prompts(vocab: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(PROMPT_LENGTHS):
        ids[b, width - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, width - n:] = 1
    return ids, mask


def _generate(model, ids, mask):
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    # On the host: results travel between ranks pickled, and a CUDA tensor would land on the sender's GPU.
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.scores, 1).float().cpu(), out.past_key_values


def _plan(model) -> list[dict]:
    from kvfuse.integrations import transformers as kvt

    return [{"layer_name": layer.layer_name, "mode": layer.spec.kv_quant_mode.name,
             "kv_heads": list(layer.spec.kv_heads), "num_kv_heads": layer.num_kv_heads,
             "num_heads": layer.num_heads, "tp_size": layer.spec.tp_size, "tp_rank": layer.spec.tp_rank,
             "bytes_per_token": layer.spec.bytes_per_token} for layer in kvt.kvfuse_layers(model)]


def _gather(obj, group):
    out = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
    return out


def _caches_as_bytes(cache) -> list:
    # float8 tensors do not survive pickling: ship raw bytes and the dtype's name.
    return [(str(c.dtype).replace("torch.", ""), c.cpu().view(torch.uint8)) for c in cache.kv_caches]


def _from_bytes(caches) -> list:
    return [raw.view(getattr(torch, name)) for name, raw in caches]


def _compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    diff = (got - want).abs()
    return {"max_abs": diff.max().item(), "scale": want.abs().max().item(),
            "top1_agree": int((got.argmax(-1) == want.argmax(-1)).sum()), "rows": got[..., 0].numel()}


def _rank_run(model_dir: str, cfg, compile_it: bool, ids, mask, group) -> dict:
    """This rank's sharded run of one cache config; every rank returns its own results."""
    from kvfuse.integrations import transformers as kvt
    from transformers import AutoModelForCausalLM, DistributedConfig

    world = dist.get_world_size(group)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=DistributedConfig(tp_size=world, tp_plan="auto"), dtype=torch.float32).eval()
    kvt.enable(model, cfg)
    result = {"plan": _plan(model)}
    found = kvt.model_tensor_parallel(model)
    result["layout"] = [found[0].tp_size, found[0].rank] if found else None
    tokens, scores, cache = _generate(model, ids, mask)
    result.update(tokens=tokens.tolist(), scores=scores, caches=_caches_as_bytes(cache))
    if compile_it:
        from torch._dynamo.utils import counters

        be = _RecordingBackend()
        model.forward = torch.compile(model.forward, backend=be)
        breaks = sum(counters["graph_break"].values())
        start = time.perf_counter()
        c_tokens, c_scores, _ = _generate(model, ids, mask)
        result.update(compiled_tokens=c_tokens.tolist(), compiled_scores=c_scores,
                      compile_seconds=time.perf_counter() - start, report=[r.as_dict() for r in be.report],
                      graph_breaks=sum(counters["graph_break"].values()) - breaks, graphs=be.collectives)
    return result


class _RecordingBackend(KVFuseBackend):
    """kvfuse's backend, noting the collectives (other than waits) of every graph Dynamo hands it."""

    def __init__(self):
        super().__init__()
        self.collectives = []

    def __call__(self, gm, example_inputs):
        self.collectives.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"
                                 and "_c10d_functional." in str(n.target) and "wait_tensor" not in str(n.target)])
        return super().__call__(gm, example_inputs)


def _refusals(model_dir: str, group) -> dict:
    """What enable() says to a KVCacheConfig whose tensor-parallel layout is not the model's."""
    import kvfuse
    from kvfuse.integrations import transformers as kvt
    from transformers import AutoModelForCausalLM, DistributedConfig

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=DistributedConfig(tp_size=world, tp_plan="auto"), dtype=torch.float32).eval()
    out = {}
    for name, cfg in (("other_rank", kvfuse.KVCacheConfig("fp8", tp_size=world, tp_rank=(rank + 1) % world)),
                      ("other_size", kvfuse.KVCacheConfig("fp8", tp_size=2 * world, tp_rank=rank))):
        try:
            kvt.enable(model, cfg)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # Same layout, spelled out: accepted.
    kvt.enable(model, kvfuse.KVCacheConfig("fp8", tp_size=world, tp_rank=rank))
    out["explicit_ok"] = [layer.num_kv_heads for layer in kvt.kvfuse_layers(model)]
    return out


def _reference(model_dir: str, cfg, ids, mask, device) -> dict:
    """tp_size 1 on rank 0: transformers' eager attention, and kvfuse with the same cache config."""
    from kvfuse.integrations import transformers as kvt
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    base.set_attn_implementation("eager")
    tokens, scores, _ = _generate(base, ids, mask)
    out = {"eager_tokens": tokens.tolist(), "eager_scores": scores}
    model = kvt.enable(copy.deepcopy(base), cfg)
    tokens, scores, cache = _generate(model, ids, mask)
    out.update(tokens=tokens.tolist(), scores=scores, caches=[c.cpu() for c in cache.kv_caches], plan=_plan(model))
    return out


def _cache_differences(rank_caches: list, rank_plans: list, reference: list) -> list[dict]:
    """Per rank and layer: the rank's cache against the unsharded cache's rows of that rank's heads."""
    out = []
    for rank, (caches, plan) in enumerate(zip(rank_caches, rank_plans)):
        for layer, (mine, full) in enumerate(zip(_from_bytes(caches), reference)):
            heads = plan[layer]["kv_heads"]
            # Logical (token, head) rows: an NVFP4 page interleaves its heads' data and scales.
            mine, full = logical_cache_rows(mine), logical_cache_rows(full)
            want = full[:, :, :, heads[0]:heads[-1] + 1]
            same = mine.view(torch.uint8) == want.view(torch.uint8) if mine.dtype.itemsize == 1 else mine == want
            out.append({"rank": rank, "layer": layer, "mode": plan[layer]["mode"], "shape": list(mine.shape),
                        "elements": mine.numel(), "elements_differ": int((~same).sum()),
                        "max_abs": (mine.float() - want.float()).abs().max().item()})
    return out


def main(argv=None) -> int:
    import kvfuse
    from kvfuse.distributed import compare_reports, gather_reports

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="NAME=DIR of a saved tiny model")
    p.add_argument("--compile", default="", help="comma-separated model names to also run compiled")
    p.add_argument("--json", required=True)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu: gloo; cuda: NCCL, GPU LOCAL_RANK")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (before NCCL starts)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    group = dist.group.WORLD
    rank = dist.get_rank()
    compiled = {n for n in args.compile.split(",") if n}
    import transformers

    summary = {"world_size": dist.get_world_size(), "backend": dist.get_backend(), "models": {},
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    try:
        for item in args.model:
            name, model_dir = item.split("=", 1)
            with open(os.path.join(model_dir, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            ids, mask = left_padded_prompts(vocab)
            entry = {}
            for label, cfg, compile_it in (("auto", kvfuse.KVCacheConfig(), False),
                                           ("mixed", kvfuse.KVCacheConfig(**MIXED), name in compiled)):
                start = time.perf_counter()
                mine = _rank_run(model_dir, cfg, compile_it, ids, mask, group)
                mine["seconds"] = time.perf_counter() - start
                gathered = _gather({k: v for k, v in mine.items() if k != "report"}, group)
                reports = gather_reports(mine.get("report", []), group=group) if compile_it else None
                if rank != 0:
                    continue
                ref = _reference(model_dir, cfg, ids, mask, device)
                result = {"plans": [g["plan"] for g in gathered], "layouts": [g["layout"] for g in gathered],
                          "reference_plan": ref["plan"], "seconds": [g["seconds"] for g in gathered],
                          "tokens": [g["tokens"] for g in gathered], "reference_tokens": ref["tokens"],
                          "eager_tokens": ref["eager_tokens"],
                          "scores_vs_reference": [_compare(g["scores"], ref["scores"]) for g in gathered],
                          "scores_vs_eager": [_compare(g["scores"], ref["eager_scores"]) for g in gathered],
                          "cache_differences": _cache_differences([g["caches"] for g in gathered],
                                                                  [g["plan"] for g in gathered], ref["caches"])}
                if compile_it:
                    result.update(
                        compiled_tokens=[g["compiled_tokens"] for g in gathered],
                        compiled_vs_reference=[_compare(g["compiled_scores"], ref["scores"]) for g in gathered],
                        compiled_vs_eager_tp=[_compare(g["compiled_scores"], g["scores"]) for g in gathered],
                        compile_seconds=[g["compile_seconds"] for g in gathered],
                        graph_breaks=[g["graph_breaks"] for g in gathered], graphs=[g["graphs"] for g in gathered],
                        reports=reports, report_mismatches=compare_reports(reports))
                entry[label] = result
            entry["refusals"] = _gather(_refusals(model_dir, group), group)
            if rank == 0:
                summary["models"][name] = entry
        if rank == 0:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
        dist.barrier()
    finally:
        shutdown_tensor_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
