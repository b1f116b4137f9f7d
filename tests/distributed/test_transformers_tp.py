"""transformers' own tensor parallelism (tp_size 2, two gloo processes) on kvfuse caches vs tp_size 1.

The models are tiny random Llama / Qwen3 built from configs and saved to a temporary directory;
each rank loads them with ``from_pretrained(dir, distributed_config=DistributedConfig(tp_size=2,
tp_plan="auto"))`` (see ``hf_tp_worker.py``). transformers needs ``accelerate`` for that.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvfuse  # noqa: E402
from kvfuse.distributed import TensorParallel  # noqa: E402
from kvfuse.integrations import transformers as kvt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "hf_tp_worker.py"
#: float32 logits of the split model vs the unsplit one: row-parallel partial sums are added in
#: another order, so they differ by rounding only (measured ~5e-6 on these models).
LOGIT_ATOL = 1e-4
#: FP8 layers: stored bytes allowed to differ from the unsplit cache's (inputs a rounding apart,
#: on the edge of an e4m3 step); a head written with the wrong rows or scale differs everywhere.
MAX_CACHE_FLIPS = 1e-3


def _config(**kw):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, initializer_range=0.2)
    base.update(kw)
    return base


def build(name: str, seed: int = 0):
    """A tiny random model; initializer_range 0.2 so that greedy decoding does not repeat one token."""
    torch.manual_seed(seed)
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_config()))
    elif name == "qwen3":  # QK-norm over each head: replicated norm weights, sharded heads
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_config()))
    else:
        raise ValueError(name)
    return model.eval()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_worker(tmp_path, models, compile_models, device="cpu", timeout=300) -> dict:
    out = tmp_path / "tp_hf.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               # NVLink multicast stays off on shared multi-GPU hosts (DEVELOPERS.md says why).
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if device == "cpu":
        # The reference ops: the check is about heads and ranks, not kernels (and no native build
        # lands inside this test's time).
        env["KVFUSE_BACKEND"] = "reference"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", "0", str(WORKER),
           "--json", str(out), "--compile", ",".join(compile_models), "--device", device]
    for name, path in models.items():
        cmd += ["--model", f"{name}={path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)
    rank_lines = [line for line in proc.stderr.splitlines() if line.startswith("[rank")]
    assert proc.returncode == 0, (f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                  + "\n".join(rank_lines[-60:]) + f"\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _save_models(tmp) -> dict:
    models = {}
    for name in ("llama", "qwen3"):
        models[name] = tmp / name
        build(name).save_pretrained(models[name])
    return models


def _assert_close(err, atol):
    assert err["max_abs"] < atol and err["top1_agree"] == err["rows"], err


def check_generate(summary, name, label, atol=LOGIT_ATOL):
    """tp_size 2 against tp_size 1 for one model and cache config (see the module docstring)."""
    assert summary["world_size"] == 2
    r = summary["models"][name][label]
    assert r["layouts"] == [[2, 0], [2, 1]]  # read from the model's device mesh, not from the config
    ref_plan = r["reference_plan"]
    want_modes = ["NONE", "NONE"] if label == "auto" else ["NONE", "FP8_E4M3"]  # skip_layers=("0",)
    assert [layer["mode"] for layer in ref_plan] == want_modes
    for rank, plan in enumerate(r["plans"]):
        # Each rank's layers hold its own share: 2 of 4 query heads, KV head `rank` of 2.
        assert [(layer["mode"], layer["kv_heads"], layer["num_kv_heads"], layer["num_heads"], layer["tp_size"],
                 layer["tp_rank"]) for layer in plan] == [(m, [rank], 1, 2, 2, rank) for m in want_modes]
        assert [layer["bytes_per_token"] * 2 for layer in plan] == [layer["bytes_per_token"] for layer in ref_plan]
    # Greedy tokens: every rank, tp_size 1 on kvfuse with the same caches, and (float32 caches)
    # transformers' own eager attention at tp_size 1.
    for tokens in r["tokens"]:
        assert tokens == r["reference_tokens"]
    assert len(set(t for row in r["reference_tokens"] for t in row)) > 6  # not one repeated token
    for err in r["scores_vs_reference"]:
        _assert_close(err, atol)
        # Not vacuous: the split model sums its row-parallel products in another order, so its
        # logits round differently; identical logits would mean tp_size 1 compared with itself.
        assert err["max_abs"] > 0
    if label == "auto":
        assert r["eager_tokens"] == r["reference_tokens"]
        for err in r["scores_vs_eager"]:
            _assert_close(err, atol)
    else:
        # FP8 keys/values in layer 1: the logits move away from transformers' float32 eager run
        # (stated bound: 10% of the logits' range), by the same amount on both layouts.
        for err in r["scores_vs_eager"]:
            assert 1e-3 < err["max_abs"] < 0.1 * err["scale"], err
    # Each rank's cache holds exactly the unsplit cache's rows of its KV head.
    diffs = r["cache_differences"]
    assert [(d["rank"], d["layer"]) for d in diffs] == [(rank, i) for rank in range(2) for i in range(2)]
    for d in diffs:
        assert d["shape"][3] == 1 and d["mode"] == want_modes[d["layer"]], d
        if d["mode"] == "NONE":
            assert d["max_abs"] < atol / 10, d
        else:
            assert d["elements_differ"] <= MAX_CACHE_FLIPS * d["elements"], d


def check_compiled(summary, atol=LOGIT_ATOL):
    r = summary["models"]["llama"]["mixed"]
    for rank in range(2):
        assert r["compiled_tokens"][rank] == r["reference_tokens"]
        _assert_close(r["compiled_vs_reference"][rank], atol)
        _assert_close(r["compiled_vs_eager_tp"][rank], atol)
        # One graph per step shape (prefill, decode), no graph break, and transformers' row-parallel
        # all-reduces (o_proj and down_proj of both layers) traced into each graph as functional collectives.
        assert r["graph_breaks"][rank] == 0
        assert len(r["graphs"][rank]) == 2
        for collectives in r["graphs"][rank]:
            assert collectives.count("_c10d_functional.all_reduce") == 4, collectives
    reports = r["reports"]
    assert len(reports) == 2 and r["report_mismatches"] == [] and reports[0] == reports[1]
    names = [layer["layer_name"] for layer in r["plans"][0]]
    assert [(x["layer_name"], x["kv_quant_mode"], x["fused"]) for x in reports[0]] == \
        [(n, m, True) for n, m in zip(names, ["NONE", "FP8_E4M3"])]


def check_refusals(summary, name):
    for rank, got in enumerate(summary["models"][name]["refusals"]):
        other = 1 - rank
        assert got["other_rank"] == (
            f"config has tp_size=2, tp_rank={other} but the model is sharded by transformers' tensor parallelism "
            f"as rank {rank} of 2; pass KVCacheConfig(..., tp_size=2, tp_rank={rank}) or leave tp_size/tp_rank at "
            f"their defaults to take the model's layout")
        assert got["other_size"].startswith(f"config has tp_size=4, tp_rank={rank} but the model is sharded")
        assert got["explicit_ok"] == [1, 1]


@pytest.fixture(scope="module")
def tp_summary(tmp_path_factory):
    pytest.importorskip("accelerate", reason="transformers' from_pretrained(distributed_config=...) needs accelerate")
    tmp = tmp_path_factory.mktemp("tp_hf")
    return _run_worker(tmp, _save_models(tmp), compile_models=["llama"])


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("label", ["auto", "mixed"])
def test_tp2_generate_matches_tp1(tp_summary, name, label):
    assert tp_summary["backend"] == "gloo"
    assert tp_summary["versions"]["transformers"] == transformers.__version__  # the same install as here
    check_generate(tp_summary, name, label)


def test_tp2_compiled_generate_matches_and_reports_agree(tp_summary):
    check_compiled(tp_summary)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_tp2_refuses_a_config_with_another_layout(tp_summary, name):
    check_refusals(tp_summary, name)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_nccl_generate_and_compile_match_tp1(tmp_path):
    pytest.importorskip("accelerate", reason="transformers' from_pretrained(distributed_config=...) needs accelerate")
    summary = _run_worker(tmp_path, _save_models(tmp_path), compile_models=["llama"], device="cuda", timeout=480)
    assert summary["backend"] == "nccl"
    # Looser than on CPU: cuBLAS picks its algorithm (and so its reduction order) by matrix shape,
    # which differs between a shard and the whole weight; Triton attention may take TF32 dots.
    for name in ("llama", "qwen3"):
        for label in ("auto", "mixed"):
            check_generate(summary, name, label, atol=1e-3)
        check_refusals(summary, name)
    check_compiled(summary, atol=1e-3)


# ----------------------------------------------------------------------------- one process


def test_unsharded_model_has_no_layout_and_refuses_a_tp_config():
    model = build("llama")
    assert kvt.model_tensor_parallel(model) is None
    kvt.enable(model, kvfuse.KVCacheConfig("fp8"))
    assert [layer.num_kv_heads for layer in kvt.kvfuse_layers(model)] == [2, 2]
    # A KVCacheConfig that says "rank 1 of 2" on a model whose k_proj still yields every head.
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.self_attn.attn': this rank's k_proj produces 32 "
                                         r"features but kvfuse's plan for tp_size=2, tp_rank=1 holds 1 of 2 KV heads "
                                         r"x head_dim 16 = 16"):
        kvt.enable(model, kvfuse.KVCacheConfig("fp8", tp_size=2, tp_rank=1))


def test_layout_that_would_cut_a_kv_head_is_refused(monkeypatch):
    # transformers' colwise k_proj splits rows evenly: 1 KV head over 2 ranks would cut it in half.
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_config(num_key_value_heads=1))).eval()
    monkeypatch.setattr(kvt, "model_tensor_parallel", lambda m: (TensorParallel(2, 0), None))
    with pytest.raises(ValueError, match=r"sharded over tp_size=2 ranks but has num_key_value_heads=1: "
                                         r"transformers' colwise k_proj/v_proj split their rows evenly"):
        kvt.enable(model, kvfuse.KVCacheConfig())
