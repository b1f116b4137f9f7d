"""Memory: a long decode loop of the compiled demo model does not grow host or device memory."""

from __future__ import annotations

import gc

import pytest
import torch

import kvfuse
from kvfuse import KVCacheConfig
from kvfuse.models import LlamaConfig, LlamaForCausalLM, PagedCacheManager


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _decode_loop(device: str, steps: int, probe_at: int):
    """Run ``steps`` compiled decode steps for 2 sequences; return memory at probe_at and at the end."""
    config = LlamaConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_size=16,
                         intermediate_size=64, vocab_size=64, sliding_window_layers=(1,), sliding_window=32)
    model = LlamaForCausalLM(config, KVCacheConfig("fp8", skip_layers=("sliding_window",)), device=device)
    block_size, max_len = 16, steps + 32
    blocks_per_seq = -(-max_len // block_size)
    manager = PagedCacheManager(model.kv_specs, num_blocks=2 * blocks_per_seq, block_size=block_size,
                                device=device, max_seq_len=blocks_per_seq * block_size)
    forward = torch.compile(model, backend=kvfuse.backend, dynamic=False)
    probes = {}

    def measure():
        gc.collect()
        if device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated(), len(gc.get_objects())
        return _rss_bytes(), len(gc.get_objects())

    with torch.no_grad():
        forward_inputs = manager.step({0: [1, 2, 3], 1: [4, 5]}, pad_to=8)
        forward(forward_inputs.input_ids, forward_inputs.positions, manager.kv_caches, forward_inputs.metadata)
        for step in range(steps):
            inputs = manager.step({0: [step % 64], 1: [(step * 7) % 64]}, pad_to=8)
            logits = forward(inputs.input_ids, inputs.positions, manager.kv_caches, inputs.metadata)
            assert logits.shape == (8, 64)
            if step + 1 == probe_at:
                probes["early"] = measure()
    probes["late"] = measure()
    assert torch.isfinite(logits[:2]).all()
    return probes


@pytest.mark.slow
def test_cpu_decode_loop_of_1000_steps_does_not_grow_memory():
    probes = _decode_loop("cpu", steps=1000, probe_at=200)
    (rss_early, objs_early), (rss_late, objs_late) = probes["early"], probes["late"]
    # 800 steps: a leak of even 20 KB per step would show as 16 MB.
    assert rss_late - rss_early < 16 * 2**20, (rss_early, rss_late)
    assert objs_late - objs_early < 2000, (objs_early, objs_late)


@pytest.mark.gpu
def test_cuda_decode_loop_of_10000_steps_does_not_grow_memory():
    probes = _decode_loop("cuda", steps=10000, probe_at=500)
    (alloc_early, objs_early), (alloc_late, objs_late) = probes["early"], probes["late"]
    assert alloc_late == alloc_early, (alloc_early, alloc_late)
    assert objs_late - objs_early < 2000, (objs_early, objs_late)
