"""State and concurrency: per-layer configuration lives in the graph and the layers, nowhere else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch

import kvfuse
from kvfuse import KVCacheConfig, KVCacheSpec, KVQuantMode, PagedAttention

sys.path.insert(0, str(Path(__file__).parent / "compile"))
from compile_util import TinyModel, assert_bytes_equal, make_caches, make_inputs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _eager_reference(model, x, md):
    caches = make_caches(model)
    with torch.no_grad():
        out = model(x, caches, md)
    return out, caches


def test_models_with_identical_layer_names_alternate_without_crosstalk():
    fp8 = TinyModel(2, KVCacheConfig("fp8"))
    nvfp4 = TinyModel(2, KVCacheConfig("nvfp4", skip_layers=(1,)))
    be_fp8, be_nvfp4 = kvfuse.make_backend(), kvfuse.make_backend()
    run_fp8 = torch.compile(fp8, backend=be_fp8, fullgraph=True)
    run_nvfp4 = torch.compile(nvfp4, backend=be_nvfp4, fullgraph=True)
    for step in range(3):
        for model, run, be in ((fp8, run_fp8, be_fp8), (nvfp4, run_nvfp4, be_nvfp4)):
            x, md = make_inputs(T=5 + step, seed=step)
            expected, expected_caches = _eager_reference(model, x, md)
            caches = make_caches(model)
            with torch.no_grad():
                out = run(x, caches, md)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            for got, want in zip(caches, expected_caches):
                assert_bytes_equal(got, want, f"step {step}")
            assert [r.kv_quant_mode for r in be.report] == [a.spec.kv_quant_mode for a in model.attn]
    assert [a.spec.kv_cache_torch_dtype for a in nvfp4.attn] == [torch.uint8, torch.bfloat16]


def test_compiling_from_two_threads():
    models = [TinyModel(2, KVCacheConfig("fp8_e5m2"), seed=1), TinyModel(2, KVCacheConfig("float16"), seed=2)]
    results, errors = {}, []

    def work(i):
        try:
            be = kvfuse.make_backend()
            run = torch.compile(models[i], backend=be, fullgraph=True)
            x, md = make_inputs(T=6, seed=10 + i)
            caches = make_caches(models[i])
            with torch.no_grad():
                out = run(x, caches, md)
            results[i] = (x, md, out, caches, [r.kv_quant_mode for r in be.report])
        except BaseException as e:  # surfaced by the main thread's assert
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for i, model in enumerate(models):
        x, md, out, caches, modes = results[i]
        expected, expected_caches = _eager_reference(model, x, md)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        for got, want in zip(caches, expected_caches):
            assert_bytes_equal(got, want, f"thread {i}")
        assert modes == [a.spec.kv_quant_mode for a in model.attn]


_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch, kvfuse
    sys.path.insert(0, sys.argv[2])
    from compile_util import TinyModel, make_caches, make_inputs
    model = TinyModel(2, kvfuse.KVCacheConfig(sys.argv[1], skip_layers=(0,)))
    be = kvfuse.make_backend()
    run = torch.compile(model, backend=be, fullgraph=True)
    x, md = make_inputs(T=7)
    caches = make_caches(model)
    with torch.no_grad():
        run(x, caches, md)
    print(json.dumps({"modes": [r.kv_quant_mode.name for r in be.report],
                      "fused": [r.fused for r in be.report],
                      "dtypes": [str(c.dtype) for c in caches]}))
    """
)


def test_two_processes_share_one_compile_cache_with_different_configs(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PYTHONPATH=str(REPO))
    procs = {
        dtype: subprocess.Popen([sys.executable, "-c", _CHILD, dtype, str(REPO / "tests" / "compile")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for dtype in ("fp8", "nvfp4")
    }
    outputs = {}
    for dtype, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        outputs[dtype] = json.loads(stdout.strip().splitlines()[-1])
    assert outputs["fp8"] == {"modes": ["NONE", "FP8_E4M3"], "fused": [True, True],
                              "dtypes": ["torch.bfloat16", "torch.float8_e4m3fn"]}
    assert outputs["nvfp4"] == {"modes": ["NONE", "NVFP4"], "fused": [True, True],
                                "dtypes": ["torch.bfloat16", "torch.uint8"]}


def _holds_layer_state(value, depth=0) -> bool:
    if isinstance(value, (KVCacheSpec, KVCacheConfig, PagedAttention)):
        return True
    if depth < 2 and isinstance(value, dict):
        return any(_holds_layer_state(v, depth + 1) for v in list(value.values()))
    if depth < 2 and isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_layer_state(v, depth + 1) for v in list(value))
    return False


def test_no_module_global_holds_per_layer_configuration():
    model = TinyModel(2, KVCacheConfig("fp8", skip_layers=(0,)))
    be = kvfuse.make_backend()
    x, md = make_inputs()
    with torch.no_grad():
        torch.compile(model, backend=be, fullgraph=True)(x, make_caches(model), md)
    offenders = [
        f"{mod_name}.{attr}"
        for mod_name, module in list(sys.modules.items())
        if mod_name == "kvfuse" or mod_name.startswith("kvfuse.")
        for attr, value in list(vars(module).items())
        if _holds_layer_state(value)
    ]
    assert offenders == []
    # ... and the modes that were compiled came from the graph's nodes, one per layer.
    assert [r.kv_quant_mode for r in be.report] == [KVQuantMode.NONE, KVQuantMode.FP8_E4M3]
