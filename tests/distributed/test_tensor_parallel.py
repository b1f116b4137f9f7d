"""Tensor parallelism: head sharding, per-rank cache specs, sharded demo weights, and TP=2 == TP=1.

The multi-process tests launch ``kvfuse.examples.tp_demo`` with torchrun (two gloo processes
on 127.0.0.1, or two GPUs with NCCL) and check what rank 0 reports against the unsplit model.
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvfuse import KVCacheConfig, KVQuantMode
from kvfuse.__main__ import main
from kvfuse.distributed import (ColumnParallelLinear, RowParallelLinear, TensorParallel, all_reduce,
                                compare_reports, gather_reports, kv_head_shard)
from kvfuse.examples.tp_demo import check
from kvfuse.models import LlamaConfig, LlamaForCausalLM, PagedCacheManager
from kvfuse.passes import FusionRecord

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_size=32, intermediate_size=96,
            vocab_size=128, sliding_window=6, sliding_window_layers=(1,), dtype=torch.float32)


# ----------------------------------------------------------------------------- head sharding


@pytest.mark.parametrize("heads, tp, expected", [
    (8, 1, [range(0, 8)]),
    (8, 2, [range(0, 4), range(4, 8)]),
    (8, 8, [range(i, i + 1) for i in range(8)]),
    (2, 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),  # each head on 2 ranks
    (1, 4, [range(0, 1)] * 4),
])
def test_kv_head_shard(heads, tp, expected):
    got = [kv_head_shard(heads, tp, r) for r in range(tp)]
    assert got == expected
    assert [TensorParallel(tp, r).kv_heads(heads) for r in range(tp)] == expected
    assert TensorParallel(tp, 0).kv_head_replicas(heads) == max(1, tp // heads)


@pytest.mark.parametrize("heads, tp, rank, match", [
    (3, 2, 0, "num_kv_heads=3 cannot be split over tp_size=2: one must divide the other"),
    (4, 6, 0, "num_kv_heads=4 cannot be split over tp_size=6"),
    (4, 2, 2, "tp_rank=2 must be < tp_size=2"),
    (0, 2, 0, "num_kv_heads=0 must be an int >= 1"),
    (4, 0, 0, "tp_size=0 must be an int >= 1"),
    (4, 2, -1, "tp_rank=-1 must be an int >= 0"),
])
def test_kv_head_shard_refuses(heads, tp, rank, match):
    with pytest.raises(ValueError, match=match):
        kv_head_shard(heads, tp, rank)


def test_tensor_parallel_validation_and_split():
    with pytest.raises(ValueError, match="rank=2 must be < tp_size=2"):
        TensorParallel(2, 2)
    with pytest.raises(ValueError, match="tp_size=True must be an int"):
        TensorParallel(True, 0)
    assert TensorParallel(4, 3).split(96, "intermediate_size") == range(72, 96)
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by tp_size=4"):
        TensorParallel(4, 0).split(6, "num_heads")


# ----------------------------------------------------------------------------- per-rank specs


def test_kv_cache_config_tp_fields_are_validated():
    for kwargs, match in ((dict(tp_size=0), "tp_size=0 must be an int >= 1"),
                          (dict(tp_size=2, tp_rank=2), "tp_rank=2 must be < tp_size=2"),
                          (dict(tp_rank=-1), "tp_rank=-1 must be an int >= 0"),
                          (dict(tp_size=2.0), "tp_size=2.0 must be an int")):
        with pytest.raises(ValueError, match=match):
            KVCacheConfig("fp8", **kwargs)


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4", "bfloat16"])
def test_rank_spec_holds_its_heads_and_same_mode(dtype):
    full = KVCacheConfig(dtype, skip_layers=("0",)).layer_spec("model.layers.3.attn", num_kv_heads=8, head_size=64)
    assert full.kv_heads == range(8) and full.total_num_kv_heads is None
    for rank in range(4):
        cfg = KVCacheConfig(dtype, skip_layers=("0",), tp_size=4, tp_rank=rank)
        spec = cfg.layer_spec("model.layers.3.attn", num_kv_heads=8, head_size=64)
        assert (spec.num_kv_heads, spec.total_num_kv_heads, spec.tp_size, spec.tp_rank) == (2, 8, 4, rank)
        assert spec.kv_heads == range(2 * rank, 2 * rank + 2)
        # The encoding is the same on every rank; only the head count (and so bytes) is split.
        assert (spec.kv_quant_mode, spec.kv_cache_torch_dtype, spec.row_dim, spec.reason) == \
            (full.kv_quant_mode, full.kv_cache_torch_dtype, full.row_dim, full.reason)
        assert spec.bytes_per_token * 4 == full.bytes_per_token
        assert spec.cache_shape(10, 16) == (10, 2, 16, 2, full.row_dim)
    skipped = KVCacheConfig(dtype, skip_layers=("0",), tp_size=4, tp_rank=1).layer_spec(
        "model.layers.0.attn", num_kv_heads=8, head_size=64)
    assert skipped.kv_quant_mode is KVQuantMode.NONE and skipped.num_kv_heads == 2


def test_rank_spec_replicates_and_refuses():
    cfg = KVCacheConfig("fp8", tp_size=4, tp_rank=3)
    spec = cfg.layer_spec("model.layers.0.attn", num_kv_heads=2, head_size=64)
    assert (spec.num_kv_heads, list(spec.kv_heads)) == (1, [1])
    with pytest.raises(ValueError, match="layer 'model.layers.0.attn': num_kv_heads=3 cannot be split over tp_size=4"):
        cfg.layer_spec("model.layers.0.attn", num_kv_heads=3, head_size=64)


@pytest.mark.parametrize("heads, kv_heads, tp, rank, local_kv", [
    (8, 4, 2, 1, 2),   # KV heads split
    (8, 2, 4, 3, 1),   # each KV head replicated on 2 ranks
    (6, 6, 1, 0, 6),   # no TP: the counts as given
])
def test_paged_attention_head_attributes_are_this_ranks(heads, kv_heads, tp, rank, local_kv):
    from kvfuse import PagedAttention, allocate_kv_cache

    layer = PagedAttention(heads, kv_heads, 16, "model.layers.0.attn",
                           config=KVCacheConfig(kv_cache_dtype="fp8", tp_size=tp, tp_rank=rank),
                           model_dtype=torch.float32)
    assert (layer.num_heads, layer.num_kv_heads) == (heads // tp, local_kv)
    assert (layer.total_num_heads, layer.total_num_kv_heads) == (heads, kv_heads)
    assert layer.spec.num_kv_heads == layer.num_kv_heads  # split once, in the spec
    assert allocate_kv_cache(layer.spec, 2, 4).shape[3] == layer.num_kv_heads


def test_paged_attention_refuses_query_heads_that_do_not_split():
    from kvfuse import PagedAttention

    with pytest.raises(ValueError, match=r"num_heads=6 is not divisible by tp_size=4"):
        PagedAttention(6, 2, 16, "model.layers.0.attn", config=KVCacheConfig(tp_size=4, tp_rank=0))


def test_page_allocator_per_rank():
    # Each rank's manager allocates caches of its own heads; the page bookkeeping (and so the
    # metadata of a step) does not depend on the rank.
    cfg = LlamaConfig(**TINY)
    steps = [{0: [1, 2, 3, 4, 5], 1: [6, 7]}, {0: [8], 1: [9]}]
    metas = []
    for rank in range(2):
        specs = cfg.layer_specs(KVCacheConfig("fp8", skip_layers=("0",), tp_size=2, tp_rank=rank))
        manager = PagedCacheManager(specs, num_blocks=8, block_size=4)
        assert [c.shape[3] for c in manager.kv_caches] == [1, 1, 1]
        assert [c.dtype for c in manager.kv_caches] == [torch.float32, torch.float8_e4m3fn, torch.float8_e4m3fn]
        metas.append([manager.step(s).metadata for s in steps])
    for a, b in zip(*metas):
        for name in ("slot_mapping", "block_table", "seq_lens", "query_start_loc"):
            assert torch.equal(getattr(a, name), getattr(b, name))


def _table_rows(text):
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    end = next(i for i in range(start, len(lines) + 1) if i == len(lines) or not lines[i].strip())
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start:end]]


def test_explain_prints_the_rank_plan(capsys):
    argv = ["explain", "--kv-cache-dtype", "fp8", "--skip-layers", "0", "--layers", "3", "--kv-heads", "8",
            "--head-size", "64"]
    assert main(argv) == 0
    full = _table_rows(capsys.readouterr().out)
    assert main([*argv, "--tp-size", "4", "--tp-rank", "3"]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert "tp_size 4, 2 KV heads per rank (rank 0: 0-1, rank 1: 2-3, rank 2: 4-5, rank 3: 6-7)" in out
    assert "the table is rank 3's (KV heads 6-7 of 8)" in out
    # Same decision per layer; a quarter of the bytes.
    assert [r[3:5] + r[6:] for r in rows] == [r[3:5] + r[6:] for r in full]
    assert [int(r[5]) * 4 for r in rows] == [int(r[5]) for r in full] == [2048, 1024, 1024]
    assert "tensor parallel: 1024 bytes/token on each of 4 ranks, 4096 bytes/token over all ranks\n" in out
    assert main(["explain", "--layers", "1", "--kv-heads", "2", "--tp-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "each KV head replicated on 2 ranks (rank 0: 0, rank 1: 0, rank 2: 1, rank 3: 1)" in out
    assert "(replicated heads counted on every rank that stores them)" in out


@pytest.mark.parametrize("argv, message", [
    (["--tp-size", "2", "--kv-heads", "3"], "num_kv_heads=3 cannot be split over tp_size=2"),
    (["--tp-size", "2", "--tp-rank", "2"], "--tp-rank=2 must be in 0..1 (--tp-size=2)"),
    (["--tp-rank", "1"], "--tp-rank=1 must be in 0..0 (--tp-size=1)"),
    (["--tp-size", "0"], "--tp-size=0 must be >= 1"),
])
def test_explain_tp_errors(capsys, argv, message):
    assert main(["explain", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfuse explain: error:") and message in err


# ----------------------------------------------------------------------------- sharded weights


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_shards_are_pieces_of_the_full_weights(num_kv_heads):
    cfg = LlamaConfig(**dict(TINY, num_kv_heads=num_kv_heads))
    full = LlamaForCausalLM(cfg).state_dict()
    shards = [LlamaForCausalLM(cfg, KVCacheConfig("fp8"), tensor_parallel=TensorParallel(2, r)).state_dict()
              for r in range(2)]
    assert all(s.keys() == full.keys() for s in shards)
    h, kv, d, hidden = cfg.num_heads, num_kv_heads, cfg.head_size, cfg.hidden_size
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = full[p + "self_attn.qkv_proj.weight"]
        q_full, k_full, v_full = qkv.split([h * d, kv * d, kv * d])
        q_parts, k_parts, v_parts = zip(*(s[p + "self_attn.qkv_proj.weight"].split([h // 2 * d, max(1, kv // 2) * d,
                                                                                  max(1, kv // 2) * d])
                                          for s in shards))
        assert torch.equal(torch.cat(q_parts), q_full)
        if kv == 2:
            assert torch.equal(torch.cat(k_parts), k_full) and torch.equal(torch.cat(v_parts), v_full)
        else:  # one KV head, replicated: both ranks hold all of it
            assert all(torch.equal(k, k_full) and torch.equal(v, v_full) for k, v in zip(k_parts, v_parts))
        o = [s[p + "self_attn.o_proj.weight"] for s in shards]
        assert torch.equal(torch.cat(o, dim=1), full[p + "self_attn.o_proj.weight"])
        assert o[0].shape == (hidden, h // 2 * d)
        gate, up = full[p + "mlp.gate_up_proj.weight"].chunk(2)
        gates, ups = zip(*(s[p + "mlp.gate_up_proj.weight"].chunk(2) for s in shards))
        assert torch.equal(torch.cat(gates), gate) and torch.equal(torch.cat(ups), up)
        assert torch.equal(torch.cat([s[p + "mlp.down_proj.weight"] for s in shards], dim=1),
                           full[p + "mlp.down_proj.weight"])
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert all(torch.equal(s[name], full[name]) for s in shards)


def test_sharded_math_sums_to_the_full_layer():
    # One process playing both ranks: column-parallel then row-parallel, partial sums added by
    # hand (what the all-reduce does), equals the unsplit pair of linears.
    g = torch.Generator().manual_seed(1)
    w1, w2, x = torch.randn(12, 8, generator=g), torch.randn(5, 12, generator=g), torch.randn(3, 8, generator=g)
    partial = []
    for rank in range(2):
        tp = TensorParallel(2, rank)
        cols = tp.split(12, "features")
        col = ColumnParallelLinear(8, 12, torch.arange(cols.start, cols.stop))
        row = RowParallelLinear(12, 5, cols, tp)
        col.load_full_weight(w1)
        row.load_full_weight(w2)
        partial.append(torch.nn.functional.linear(col(x), row.weight))  # row.forward would all-reduce
    torch.testing.assert_close(partial[0] + partial[1], x @ w1.T @ w2.T, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"full weight has shape \(5, 8\), expected \(12, 8\)"):
        col.load_full_weight(torch.zeros(5, 8))
    with pytest.raises(ValueError, match="rows must be non-empty indices into the 12 output features, got 1 rows "
                                         "spanning 12..12"):
        ColumnParallelLinear(8, 12, torch.tensor([12]))
    with pytest.raises(ValueError, match="cols=range"):
        RowParallelLinear(12, 5, range(6, 14), TensorParallel(2, 1))


def test_model_refuses_bad_layouts():
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by tp_size=3"):
        LlamaForCausalLM(LlamaConfig(**TINY), tensor_parallel=TensorParallel(3, 0))
    with pytest.raises(ValueError, match="intermediate_size=90 is not divisible by tp_size=4"):
        LlamaForCausalLM(LlamaConfig(**dict(TINY, intermediate_size=90)), tensor_parallel=TensorParallel(4, 0))
    with pytest.raises(ValueError, match="num_kv_heads=3 cannot be split over tp_size=2"):
        LlamaForCausalLM(LlamaConfig(**dict(TINY, num_heads=6, num_kv_heads=3)), tensor_parallel=TensorParallel(2, 0))
    with pytest.raises(ValueError, match="kv_config has tp_size=2, tp_rank=1 but the model is built as rank 0 of 2"):
        LlamaForCausalLM(LlamaConfig(**TINY), KVCacheConfig("fp8", tp_size=2, tp_rank=1),
                         tensor_parallel=TensorParallel(2, 0))
    shard = LlamaForCausalLM(LlamaConfig(**TINY), KVCacheConfig("fp8"), tensor_parallel=TensorParallel(2, 1))
    assert shard.kv_config.tp_size == 2 and [s.kv_heads for s in shard.kv_specs] == [range(1, 2)] * 3
    manager = PagedCacheManager(shard.kv_specs, 4, 4)
    inputs = manager.step({0: [1, 2]})
    with pytest.raises(RuntimeError, match="needs a process group; build the model with tp_group="):
        shard(inputs.input_ids, inputs.positions, manager.kv_caches, inputs.metadata)


def test_all_reduce_is_identity_at_tp1():
    x = torch.randn(3)
    assert all_reduce(x, TensorParallel()) is x


# ----------------------------------------------------------------------------- reports


def test_shutdown_without_a_group_is_a_no_op():
    import torch.distributed as dist

    from kvfuse.distributed import shutdown_tensor_parallel

    assert not dist.is_initialized()
    shutdown_tensor_parallel()
    assert not dist.is_initialized()


def test_reports_compare_and_gather_without_a_group():
    a = [FusionRecord("model.layers.0.attn", KVQuantMode.FP8_E4M3, True, "fused"),
         FusionRecord("model.layers.1.attn", KVQuantMode.NONE, True, "fused")]
    b = [FusionRecord("model.layers.0.attn", KVQuantMode.FP8_E4M3, False, "not fused: x"), a[1]]
    assert compare_reports([[r.as_dict() for r in a]] * 2) == []
    problems = compare_reports([a, b])
    assert len(problems) == 1 and "cache write 0 ('model.layers.0.attn'): rank 0 vs rank 1" in problems[0]
    assert "'fused': (True, False)" in problems[0]
    assert compare_reports([a, a[:1]]) == ["rank 1 reports 1 cache writes, rank 0 reports 2"]
    assert gather_reports(a) == [[r.as_dict() for r in a]]  # no process group: this process only
    with pytest.raises(ValueError, match="neither a dict nor a FusionRecord"):
        gather_reports([object()])


def test_check_flags_every_kind_of_difference():
    close = {"max_abs": 0.0, "rel_error": 0.0, "close": True, "atol": 1e-4, "rtol": 1e-4}
    far = dict(close, max_abs=0.5, rel_error=0.1, close=False)
    good = {"kv_cache_dtype": "fp8", "report_mismatches": [], "ranks_max_abs_diff": 0.0,
            "eager": {"logits": close, "greedy_logits": close, "tokens": [[1]], "reference_tokens": [[1]],
                      "tokens_equal": True}}
    assert check({"results": [good], "options": {"atol": 1e-4}}) == []
    bad = dict(good, report_mismatches=["cache write 0 differs"], ranks_max_abs_diff=1e-3,
               eager=dict(good["eager"], logits=far, tokens=[[2]], tokens_equal=False),
               cache_differences=[
                   {"rank": 1, "layer": 0, "mode": "NONE", "elements": 100, "elements_differ": 100, "max_abs": 1e-5},
                   {"rank": 1, "layer": 1, "mode": "NONE", "elements": 100, "elements_differ": 100, "max_abs": 0.5},
                   {"rank": 1, "layer": 2, "mode": "FP8_E4M3", "elements": 10000, "elements_differ": 10,
                    "max_abs": 0.1},
                   {"rank": 1, "layer": 3, "mode": "NVFP4", "elements": 10000, "elements_differ": 11, "max_abs": None}])
    failures = check({"results": [bad], "options": {"atol": 1e-4}})
    assert len(failures) == 6, failures
    assert any("rank 1 layer 1 (NONE) cache differs from tp_size 1's by up to 5.000e-01" in f for f in failures)
    assert any("rank 1 layer 3 (NVFP4) cache: 11 of 10000 stored elements differ" in f for f in failures)
    assert any("greedy tokens [[2]] != tp_size 1's [[1]]" in f for f in failures)
    assert any("eager logits: max abs 5.000e-01" in f for f in failures)


# ----------------------------------------------------------------------------- two processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path, *args, env_extra=None, timeout=240) -> dict:
    out = tmp_path / "tp.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               GLOO_SOCKET_IFNAME="lo", **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", "0",
           "-m", "kvfuse.examples.tp_demo", "--json", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)
    # torchrun's own failure summary is long: show the ranks' lines (tracebacks, aborts) first.
    rank_lines = [line for line in proc.stderr.splitlines() if line.startswith("[rank") or "terminate" in line
                  or "Error" in line or "error" in line]
    assert proc.returncode == 0, (f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                                  + "\n".join(rank_lines[-80:]) + f"\n{proc.stderr[-3000:]}")
    assert "checks: all passed" in proc.stdout, proc.stdout
    return json.loads(out.read_text())


def _assert_tp2_matches_tp1(summary, dtypes, compiled, kv_heads, max_abs=1e-4):
    assert summary["tp_size"] == 2 and summary["failures"] == []
    assert [e["kv_cache_dtype"] for e in summary["results"]] == list(dtypes)
    for entry in summary["results"]:
        ref = entry["reference_plan"]
        modes = [layer["mode"] for layer in ref]
        # Mixed per-layer modes: layer 0 and the sliding-window layer stay float32, the rest quantized.
        assert modes[0] == "NONE" and modes[1] == "NONE" and modes[2] != "NONE", modes
        for rank, plan in enumerate(entry["plans"]):
            assert [layer["mode"] for layer in plan] == modes
            want = [rank] if kv_heads == 2 else [0]
            assert all(layer["kv_heads"] == want for layer in plan), plan
            for mine, full in zip(plan, ref):
                assert mine["bytes_per_token"] * kv_heads == full["bytes_per_token"]
        assert entry["ranks_max_abs_diff"] == 0.0
        # Each rank's cache holds what the unsplit cache holds in its heads' rows: TP does not
        # change any head's encoding (quantized rows identical up to rare rounding-edge flips).
        diffs = entry["cache_differences"]
        assert [(d["rank"], d["layer"]) for d in diffs] == [(r, i) for r in range(2) for i in range(len(ref))]
        for d in diffs:
            if d["mode"] == "NONE":
                assert d["max_abs"] < max_abs, d
            else:
                assert d["mode"] == modes[d["layer"]] and d["elements_differ"] <= 1e-3 * d["elements"], d
        for mode in (("eager", "compiled") if compiled else ("eager",)):
            got = entry[mode]
            assert got["tokens_equal"] and got["tokens"] == got["reference_tokens"]
            for what in ("logits", "greedy_logits"):
                err = got[what]
                assert err["close"] and err["max_abs"] < max_abs and err["top1_agree"] == err["rows"], (mode, what, err)
            # Not vacuous: the split model sums its row-parallel products in another order, so its
            # logits round differently; bit-identical logits would mean rank 0 compared tp_size 1 with itself.
            assert got["logits"]["max_abs"] > 0
        if compiled:
            reports = entry["reports"]
            assert len(reports) == 2 and entry["report_mismatches"] == []
            assert [(r["layer_name"], r["kv_quant_mode"]) for r in reports[0]] == \
                [(layer["layer_name"], layer["mode"]) for layer in ref]
            assert all(r["fused"] for r in reports[0]), reports[0]
            assert reports[0] == reports[1]


def test_tp2_gloo_matches_tp1_eager_and_compiled(tmp_path):
    summary = _torchrun(tmp_path, "--device", "cpu", "--kv-cache-dtypes", "fp8,nvfp4", "--seed", "3", "--check",
                        env_extra={"KVFUSE_BACKEND": "reference"})
    _assert_tp2_matches_tp1(summary, ("fp8", "nvfp4"), compiled=True, kv_heads=2)


def test_tp2_gloo_replicated_kv_head(tmp_path):
    # One KV head over two ranks: both ranks hold (and write) head 0 for their own query heads.
    summary = _torchrun(tmp_path, "--device", "cpu", "--kv-cache-dtypes", "fp8_e5m2", "--kv-heads", "1",
                        "--no-compile", "--check", env_extra={"KVFUSE_BACKEND": "reference"})
    _assert_tp2_matches_tp1(summary, ("fp8_e5m2",), compiled=False, kv_heads=1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_nccl_matches_tp1_eager_and_compiled(tmp_path):
    # Looser than on CPU: cuBLAS picks its algorithm (and reduction order) by matrix shape, which
    # differs between a shard and the whole weight, and Triton attention may take TF32 dots.
    summary = _torchrun(tmp_path, "--device", "cuda", "--kv-cache-dtypes", "fp8,nvfp4", "--seed", "3", "--check",
                        "--atol", "1e-3", "--rtol", "1e-3", env_extra={"NCCL_NVLS_ENABLE": "0"}, timeout=480)
    assert summary["backend"] == "nccl"
    _assert_tp2_matches_tp1(summary, ("fp8", "nvfp4"), compiled=True, kv_heads=2, max_abs=1e-3)
