"""The demo Llama model: runs prefill + decode over per-layer caches, and cache formats cost what they should."""

import pytest
import torch

from kvfuse import KVCacheConfig, KVQuantMode
from kvfuse.models import LlamaConfig, LlamaForCausalLM, PagedCacheManager
from kvfuse.models.demo import DemoBatch, compare_logits, make_batch, run_steps
from kvfuse.models.llama import apply_rotary

TINY = dict(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_size=32, intermediate_size=128,
            vocab_size=128, sliding_window=6, sliding_window_layers=(1,))


pytestmark = pytest.mark.usefixtures("reference_backend")


def test_config_validation():
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        LlamaConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="sliding_window_layers=.*holds \\[4\\].*0..3"):
        LlamaConfig(num_layers=4, sliding_window_layers=(4,))
    with pytest.raises(ValueError, match="head_size=33 must be even"):
        LlamaConfig(head_size=33)
    with pytest.raises(ValueError, match="hidden_size=0"):
        LlamaConfig(hidden_size=0)


def test_per_layer_specs_and_names():
    cfg = LlamaConfig(**TINY)
    model = LlamaForCausalLM(cfg, KVCacheConfig("fp8", skip_layers=("0", "sliding_window")))
    specs = model.kv_specs
    assert [s.kv_quant_mode for s in specs] == [KVQuantMode.NONE, KVQuantMode.NONE, KVQuantMode.FP8_E4M3]
    assert [s.sliding_window for s in specs] == [None, 6, None]
    assert specs == cfg.layer_specs(KVCacheConfig("fp8", skip_layers=("0", "sliding_window")))
    names = {name for name, m in model.named_modules() if m.__class__.__name__ == "PagedAttention"}
    assert names == {s.layer_name for s in specs}  # layer_name is the module path
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(a.k_scale.dtype == torch.float32 for a in model.attention_layers)


def test_weights_depend_only_on_the_seed():
    a = LlamaForCausalLM(LlamaConfig(**TINY), KVCacheConfig("fp8"))
    b = LlamaForCausalLM(LlamaConfig(**TINY), KVCacheConfig("nvfp4"))
    c = LlamaForCausalLM(LlamaConfig(**TINY, seed=1))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])


def test_rotary_is_a_rotation_that_depends_on_relative_position():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 32, generator=g)
    k = torch.randn(1, 1, 32, generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    pos = lambda p: torch.tensor([p])  # noqa: E731
    torch.testing.assert_close(apply_rotary(q, pos(5), inv_freq).norm(), q.norm())
    dot = lambda a, b: (apply_rotary(q, pos(a), inv_freq) * apply_rotary(k, pos(b), inv_freq)).sum()  # noqa: E731
    torch.testing.assert_close(dot(7, 3), dot(14, 10), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(dot(7, 3), dot(7, 4), atol=1e-3)
    assert torch.equal(apply_rotary(q, pos(0), inv_freq), q)


def test_decode_through_the_cache_equals_a_full_prefill():
    # float32 model and cache: the paged decode path must reproduce a one-shot prefill.
    cfg = LlamaConfig(**TINY, dtype=torch.float32)
    model = LlamaForCausalLM(cfg)
    batch = make_batch(cfg.vocab_size, [9, 4], decode_steps=5, seed=3)
    stepped, _ = run_steps(model, batch, block_size=4)
    full_batch = DemoBatch(
        prompts=tuple(p + tuple(step[b] for step in batch.decode_tokens) for b, p in enumerate(batch.prompts)),
        decode_tokens=(),
    )
    full, _ = run_steps(model, full_batch, block_size=4)
    # Row order: stepped = prompts, then (seq0, seq1) per decode step; full = seq0 all, seq1 all.
    n0, n1 = len(batch.prompts[0]), len(batch.prompts[1])
    for step in range(5):
        for b, (n, start) in enumerate(((n0, 0), (n1, n0 + 5))):
            got = stepped[n0 + n1 + 2 * step + b]
            want = full[start + n + step]  # the same token, seen in the one-shot prefill
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stepped[:n0], full[:n0], atol=1e-4, rtol=1e-4)


def test_padding_rows_change_nothing():
    cfg = LlamaConfig(**TINY, dtype=torch.float32)
    model = LlamaForCausalLM(cfg, KVCacheConfig("fp8", skip_layers=("0",)))
    batch = make_batch(cfg.vocab_size, [5, 3], decode_steps=2)
    plain, manager = run_steps(model, batch, block_size=4)
    padded, padded_manager = run_steps(model, batch, block_size=4, pad_to=16)
    torch.testing.assert_close(plain, padded, atol=1e-5, rtol=1e-5)
    # Same slots written, same values (up to one FP8 step where a matmul of another shape rounds
    # differently); padding wrote nothing, so the unused slots are still zero in both.
    for a, b in zip(manager.kv_caches, padded_manager.kv_caches):
        assert torch.equal(a.float() == 0, b.float() == 0)
        tol = 1e-4 if a.dtype == torch.float32 else 0.13
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def demo_logits():
    cfg = LlamaConfig(**TINY)
    batch = make_batch(cfg.vocab_size, [11, 4, 17], decode_steps=3)
    results = {}
    for name in ("auto", "fp8", "fp8_e5m2", "nvfp4"):
        results[name], _ = run_steps(LlamaForCausalLM(cfg, KVCacheConfig(name)), batch, block_size=8, pad_to=40)
    mixed = KVCacheConfig("fp8", skip_layers=("0", "sliding_window"))
    results["fp8-mixed"], manager = run_steps(LlamaForCausalLM(cfg, mixed), batch, block_size=8, pad_to=40)
    results["mixed-caches"] = [c.dtype for c in manager.kv_caches]
    return results


def test_demo_runs_prefill_and_decode(demo_logits):
    logits = demo_logits["auto"]
    assert logits.shape == (11 + 4 + 17 + 3 * 3, 128) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert demo_logits["mixed-caches"] == [torch.bfloat16, torch.bfloat16, torch.float8_e4m3fn]


def test_fp8_logits_close_to_bf16_cache(demo_logits):
    reference = demo_logits["auto"]
    for name in ("fp8", "fp8-mixed"):
        err = compare_logits(demo_logits[name], reference)
        assert 0 < err.rel_error < 0.05, (name, err)
        assert err.top1_fraction >= 0.85, (name, err)
    # Skipping layers can only help here: fewer quantized layers.
    assert compare_logits(demo_logits["fp8-mixed"], reference).rel_error < \
        compare_logits(demo_logits["fp8"], reference).rel_error


def test_nvfp4_error_larger_but_bounded(demo_logits):
    reference = demo_logits["auto"]
    fp8 = compare_logits(demo_logits["fp8"], reference)
    e5m2 = compare_logits(demo_logits["fp8_e5m2"], reference)
    nvfp4 = compare_logits(demo_logits["nvfp4"], reference)
    assert fp8.rel_error < e5m2.rel_error < nvfp4.rel_error < 0.25, (fp8, e5m2, nvfp4)
    assert nvfp4.top1_fraction >= 0.6, nvfp4


def test_forward_checks_cache_count():
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    manager = PagedCacheManager(model.kv_specs, 4, 4)
    inputs = manager.step({0: [1, 2, 3]})
    with pytest.raises(ValueError, match="kv_caches has 2 caches but the model has 3 layers"):
        model(inputs.input_ids, inputs.positions, manager.kv_caches[:2], inputs.metadata)
