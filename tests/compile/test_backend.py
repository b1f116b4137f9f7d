"""kvfuse.backend: uuid/caching, report lifetime, recompiles, graph breaks, dumps, options."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kvfuse
from kvfuse import AttentionMetadata, KVCacheConfig, KVQuantMode, PagedAttention, allocate_kv_cache
from kvfuse.passes import KVFusePassManager
from kvfuse.passes import manager as manager_mod

from compile_util import TinyModel, assert_bytes_equal, make_caches, make_inputs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(model, be, x, md, fullgraph=True):
    caches = make_caches(model)
    with torch.no_grad():
        out = torch.compile(model, backend=be, fullgraph=fullgraph)(x, caches, md)
    return out, caches


def test_uuid_stable_across_instances_and_changes_with_options_and_code(tmp_path, monkeypatch):
    a, b = KVFusePassManager(), KVFusePassManager()
    assert a.uuid() == b.uuid() and len(a.uuid()) == 64
    assert KVFusePassManager(fuse=False).uuid() != a.uuid()
    assert KVFusePassManager(fuse_rotary=False).uuid() not in (a.uuid(), KVFusePassManager(fuse=False).uuid())
    extra = tmp_path / "extra_pass.py"
    extra.write_text("X = 1\n")
    files = manager_mod._source_files()
    monkeypatch.setattr(manager_mod, "_source_files", lambda: files + (str(extra),))
    before = KVFusePassManager().uuid()
    extra.write_text("X = 2\n")
    assert KVFusePassManager().uuid() != before


def test_options_are_validated():
    with pytest.raises(ValueError, match="fuse='yes'"):
        kvfuse.make_backend(fuse="yes")
    with pytest.raises(ValueError, match="fuse_rotary=0 must be a bool"):
        kvfuse.make_backend(fuse_rotary=0)
    assert "fuse_rotary=False" in repr(kvfuse.make_backend(fuse_rotary=False))
    with pytest.raises(ValueError, match="not_an_option"):
        kvfuse.make_backend(not_an_option=1)
    with pytest.raises(ValueError, match="post_grad_custom_post_pass"):
        kvfuse.make_backend(post_grad_custom_post_pass=None)


def test_second_compile_new_config_and_cache_hit_report(tmp_path, monkeypatch):
    """Same process, Inductor caches on: a changed config gives the new result; a cache hit
    still reports (from the stored report), and two models with the same layer names differ."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    x, md = make_inputs(T=7)
    be = kvfuse.make_backend()
    results = {}
    for name in ("fp8", "nvfp4", "fp8"):
        torch._dynamo.reset()
        model = TinyModel(2, KVCacheConfig(kv_cache_dtype=name))
        _, caches = _run(model, be, x, md)
        results.setdefault(name, []).append((list(be.report), dict(be.last_compile), caches))
    (fp8_report, first, fp8_caches), (_, again, fp8_caches_2) = results["fp8"]
    (nvfp4_report, _, nvfp4_caches), = results["nvfp4"]
    assert [r.kv_quant_mode for r in fp8_report] == [KVQuantMode.FP8_E4M3] * 2
    assert [r.kv_quant_mode for r in nvfp4_report] == [KVQuantMode.NVFP4] * 2
    assert all(r.fused for r in fp8_report + nvfp4_report)
    assert [c.dtype for c in nvfp4_caches] == [torch.uint8] * 2
    assert first["report_source"] == "passes"
    assert again["report_source"].startswith("stored report"), again
    assert results["fp8"][1][0] == fp8_report
    for a, b in zip(fp8_caches, fp8_caches_2):
        assert_bytes_equal(a, b, "cache-hit graph writes the same bytes")


def test_two_models_same_layer_names_different_configs_one_process():
    torch._dynamo.reset()
    x, md = make_inputs(T=7)
    be = kvfuse.make_backend(force_disable_caches=True)
    m_fp8 = TinyModel(2, KVCacheConfig(kv_cache_dtype="fp8_e5m2"))
    m_mix = TinyModel(2, KVCacheConfig(kv_cache_dtype="nvfp4", skip_layers=(1,)))
    _, c1 = _run(m_fp8, be, x, md)
    r1 = be.report
    _, c2 = _run(m_mix, be, x, md)
    r2 = be.report
    assert [r.kv_quant_mode for r in r1] == [KVQuantMode.FP8_E5M2] * 2
    assert [r.kv_quant_mode for r in r2] == [KVQuantMode.NVFP4, KVQuantMode.NONE]
    assert [r.layer_name for r in r1] == [r.layer_name for r in r2]
    assert [c.dtype for c in c1] == [torch.float8_e5m2] * 2
    assert [c.dtype for c in c2] == [torch.uint8, torch.bfloat16]
    # Running the first model again reuses its graph and writes its own format.
    c1b = make_caches(m_fp8)
    with torch.no_grad():
        torch.compile(m_fp8, backend=be, fullgraph=True)(x, c1b, md)
    for a, b in zip(c1, c1b):
        assert_bytes_equal(a, b, "model 1 rerun")


def test_graph_breaks_accumulate_per_compile_and_reset_on_recompile():
    class Broken(TinyModel):
        def forward(self, x, caches, md):
            # Unrolled: a graph break inside a loop makes Dynamo skip the frame and compile each
            # layer call on its own (each then a top-level compile with its own report).
            x = self.layer(0, x, caches, md)
            torch._dynamo.graph_break()
            x = self.layer(1, x, caches, md)
            torch._dynamo.graph_break()
            return self.layer(2, x, caches, md)

        def layer(self, i, x, caches, md):
            T = x.shape[0]
            qkv = torch.mm(x, self.w_qkv[i])
            q, k, v = qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1)
            o = self.attn[i](q.reshape(T, 4, 32), k.reshape(T, 2, 32), v.reshape(T, 2, 32), caches[i], md)
            return x + o.reshape(T, 4 * 32)

    torch._dynamo.reset()
    model = Broken(3, KVCacheConfig(kv_cache_dtype="fp8", skip_layers=("1",)))
    be = kvfuse.make_backend(force_disable_caches=True)
    x, md = make_inputs(T=7)
    _run(model, be, x, md, fullgraph=False)
    names = [(r.layer_name, r.kv_quant_mode) for r in be.report]
    assert names == [("model.layers.0.attn", KVQuantMode.FP8_E4M3), ("model.layers.1.attn", KVQuantMode.NONE),
                     ("model.layers.2.attn", KVQuantMode.FP8_E4M3)]
    assert all(r.fused for r in be.report)
    first = be.report
    x2, md2 = make_inputs(T=9)  # a new token count: recompiles, report restarts (no duplicates)
    _run(model, be, x2, md2, fullgraph=False)
    assert [(r.layer_name, r.kv_quant_mode) for r in be.report] == names and be.report is not first


def test_no_recompiles_over_token_counts():
    """Automatic dynamic: 2 compiles (static, then dynamic), none after for 2..8192 tokens;
    with the token dim marked unbacked, one compile covers 1..8192 (Dynamo otherwise
    specialises size 1)."""
    torch._dynamo.reset()
    attn = PagedAttention(2, 1, 16, "model.layers.0.attn", KVCacheConfig("fp8"))
    attn.set_scales(0.5, 0.25)
    compiles = []
    be = kvfuse.make_backend(force_disable_caches=True)

    def counting(gm, ex):
        compiles.append(len(ex))
        return be(gm, ex)

    block_table = torch.arange(512, dtype=torch.int32).unsqueeze(0)
    seq_lens = torch.tensor([1], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)  # attention over one token keeps the oracle cheap

    def step(f, T, unbacked=False):
        g = torch.Generator().manual_seed(T)
        q = torch.randn(T, 2, 16, generator=g).bfloat16()
        k, v = torch.randn(T, 1, 16, generator=g).bfloat16(), torch.randn(T, 1, 16, generator=g).bfloat16()
        slots = torch.randperm(512 * 16, generator=g)[:T]
        if unbacked:
            for t in (q, k, v, slots):
                torch._dynamo.decorators.mark_unbacked(t, 0)
        cache = allocate_kv_cache(attn.spec, 512, 16)
        with torch.no_grad():
            f(q, k, v, cache, AttentionMetadata(slots, block_table, seq_lens, qsl))
        ref = allocate_kv_cache(attn.spec, 512, 16)
        kvfuse.ops.reference.encode_and_cache_write(k, v, ref, slots, attn.k_scale, attn.v_scale, 1)
        assert_bytes_equal(cache, ref, f"T={T}")

    f = torch.compile(attn, backend=counting, fullgraph=True)
    step(f, 7)
    step(f, 533)
    assert len(compiles) == 2
    for T in (2, 3, 64, 1000, 4096, 8192):
        step(f, T)
    assert len(compiles) == 2, compiles
    assert [r.fused for r in be.report] == [True]

    torch._dynamo.reset()
    compiles.clear()
    f = torch.compile(attn, backend=counting, fullgraph=True)
    step(f, 7, unbacked=True)
    for T in (1, 2, 533, 8192):
        step(f, T)
    assert len(compiles) == 1, compiles


def test_depyf_and_kvfuse_dumps(tmp_path):
    torch._dynamo.reset()
    model = TinyModel(2, KVCacheConfig(kv_cache_dtype="fp8", skip_layers=(0,)))
    x, md = make_inputs(T=7)
    be = kvfuse.make_backend(force_disable_caches=True)
    with kvfuse.debug.dump(str(tmp_path)):
        _run(model, be, x, md)
    files = os.listdir(tmp_path)
    assert any(f.startswith("full_code_for_") for f in files), files
    assert any(f.startswith("__compiled_fn_") for f in files), files
    before = glob.glob(str(tmp_path / "kvfuse" / "*fuse_encode_cache_write.before.py"))
    after = glob.glob(str(tmp_path / "kvfuse" / "*fuse_encode_cache_write.after.py"))
    assert len(before) == len(after) == 1
    assert open(before[0]).read().count("kvfuse.encode_kv.default") == 4
    text = open(after[0]).read()
    assert "encode_kv" not in text and text.count("kvfuse.encode_and_cache_write.default") == 2
    report = json.load(open(tmp_path / "kvfuse" / "report.json"))
    assert [(r["kv_quant_mode"], r["fused"]) for r in report["records"]] == [("NONE", True), ("FP8_E4M3", True)]


def test_env_dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFUSE_DUMP_DIR", str(tmp_path))
    kvfuse.envs.reload()
    torch._dynamo.reset()
    model = TinyModel(1, KVCacheConfig(kv_cache_dtype="nvfp4"))
    x, md = make_inputs(T=7)
    _run(model, kvfuse.make_backend(force_disable_caches=True), x, md)
    assert glob.glob(str(tmp_path / "kvfuse" / "*.after.py"))
    assert json.load(open(tmp_path / "kvfuse" / "report.json"))["records"][0]["kv_quant_mode"] == "NVFP4"


_CHILD = textwrap.dedent("""
    import json, sys, torch, kvfuse
    sys.path.insert(0, sys.argv[1])
    from compile_util import TinyModel, make_caches, make_inputs
    out = []
    for name in sys.argv[2:]:
        torch._dynamo.reset()
        model = TinyModel(2, kvfuse.KVCacheConfig(kv_cache_dtype=name))
        x, md = make_inputs(T=7)
        be = kvfuse.make_backend()
        caches = make_caches(model)
        with torch.no_grad():
            torch.compile(model, backend=be, fullgraph=True)(x, caches, md)
        out.append({"modes": [r.kv_quant_mode.name for r in be.report], "fused": [r.fused for r in be.report],
                    "source": be.last_compile["report_source"], "dtypes": [str(c.dtype) for c in caches]})
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
def test_fresh_process_shared_cache_dir(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    here = os.path.dirname(os.path.abspath(__file__))

    def child(*configs):
        proc = subprocess.run([sys.executable, "-c", _CHILD, here, *configs], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.split("RESULT", 1)[1])

    (first,) = child("fp8")
    assert first == {"modes": ["FP8_E4M3"] * 2, "fused": [True] * 2, "source": "passes",
                     "dtypes": ["torch.float8_e4m3fn"] * 2}
    hit, changed = child("fp8", "nvfp4")
    assert hit["source"].startswith("stored report") and hit["modes"] == first["modes"] and all(hit["fused"])
    assert changed == {"modes": ["NVFP4"] * 2, "fused": [True] * 2, "source": "passes",
                       "dtypes": ["torch.uint8"] * 2}


def test_report_notes_say_why_a_graph_has_no_cache_write(tmp_path, monkeypatch):
    """A graph without any kvfuse write gets one actionable line, also when served from the cache."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def no_cache(x, cache):
        cache.add_(1.0)  # written in place, but not by slot: not a paged-cache write
        return x * 2

    def nothing(x):
        return x.sin()

    for fn, expected in ((no_cache, "is overwritten, but not by indexed writes kvfuse recognises"),
                         (nothing, "the graph writes no KV cache")):
        sources = []
        for _ in range(2):  # cold, then served from Inductor's cache
            torch._dynamo.reset()
            be = kvfuse.make_backend()
            args = (torch.randn(4, 8),) + ((torch.zeros(2, 2, 4, 1, 8),) if fn is no_cache else ())
            torch.compile(fn, backend=be, fullgraph=True)(*args)
            assert be.report == [] and len(be.notes) == 1 and expected in be.notes[0], be.notes
            assert be.reports[-1].notes == tuple(be.notes)
            sources.append(be.last_compile["report_source"])
        assert sources == ["passes", "stored report (replayed from Inductor's cache entry)"], sources


def test_dumps_have_the_pass_graphs_on_a_warm_cache(tmp_path, monkeypatch):
    """Issue 19: the second run (Inductor's cache warm) still dumps the before/after graphs and the report."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    x, md = make_inputs(T=7)
    for run in ("cold", "warm"):
        torch._dynamo.reset()
        model = TinyModel(2, KVCacheConfig(kv_cache_dtype="fp8"))
        be = kvfuse.make_backend()
        if run == "warm":
            with kvfuse.debug.dump(str(tmp_path / run)):
                _run(model, be, x, md)
        else:
            _run(model, be, x, md)
    after = glob.glob(str(tmp_path / "warm" / "kvfuse" / "*fuse_encode_cache_write.after.py"))
    assert len(after) == 1 and open(after[0]).read().count("kvfuse.encode_and_cache_write.default") == 2
    report = json.load(open(tmp_path / "warm" / "kvfuse" / "report.json"))
    assert [(r["kv_quant_mode"], r["fused"]) for r in report["records"]] == [("FP8_E4M3", True)] * 2
