"""kvfuse's FlashInfer attention backend: availability rules (anywhere) and numerics (CUDA + flashinfer)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from kvfuse.kv_cache import KVQuantMode, row_dim_for, storage_dtype
from kvfuse.ops import flashinfer as fi_backend
from kvfuse.ops import reference
from kvfuse.ops import registry as backends
from kvfuse.ops.registry import AttentionCall

HAS_FI = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
needs_fi = pytest.mark.skipif(not HAS_FI, reason="needs CUDA and flashinfer")


def test_unavailable_reasons():
    # What the implementation declares (ops, devices, modes) is checked by the registry.
    assert "runs on cuda, not cpu" in backends.unavailable_reason("flashinfer", "paged_attention", "cpu", 0)
    assert "implements paged_attention, not cache_write" in backends.unavailable_reason(
        "flashinfer", "cache_write", "cuda", 0)
    assert "NVFP4" in backends.unavailable_reason("flashinfer", "paged_attention", "cuda", KVQuantMode.NVFP4)


def test_forcing_flashinfer_on_cpu_raises(monkeypatch):
    monkeypatch.setenv("KVFUSE_ATTENTION_BACKEND", "flashinfer")
    backends.clear_cache()
    try:
        with pytest.raises(RuntimeError, match="flashinfer"):
            backends.select("paged_attention", "cpu", KVQuantMode.NONE)
    finally:
        backends.clear_cache()


def _case(seq_lens, q_lens, hq, hkv, d, mode, page=16, pad_rows=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    nb = [max(1, math.ceil(s / page)) for s in seq_lens]
    num_blocks = sum(nb) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.zeros((len(seq_lens), max(nb) + 1), dtype=torch.int32)
    i = 0
    for b, n in enumerate(nb):
        bt[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    cache = torch.empty((num_blocks, 2, page, hkv, row_dim_for(mode, d)), dtype=storage_dtype(mode, torch.bfloat16))
    cache.view(torch.uint8).fill_(0xFF)  # NaN everywhere nothing was written
    ks = torch.tensor(0.5 if mode else 1.0)
    vs = torch.tensor(1.5 if mode else 1.0)
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = bt[b, pos // page].long() * page + pos % page
        k = torch.randn(s, hkv, d, generator=gen).bfloat16()
        v = torch.randn(s, hkv, d, generator=gen).bfloat16()
        reference.encode_and_cache_write(k, v, cache, slots, ks, vs, mode)
    q = torch.randn(sum(q_lens) + pad_rows, hq, d, generator=gen).bfloat16()
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return [q, cache, ks, vs, bt, torch.tensor(seq_lens, dtype=torch.int32), qsl, int(mode), 1 / math.sqrt(d), None]


def _run_and_check(args, window=None):
    args = list(args)
    args[9] = window
    expected = reference.paged_attention(AttentionCall(*args))
    dev = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    out = fi_backend.paged_attention(AttentionCall(*dev))
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=3e-2, rtol=3e-2)
    assert torch.all(out[int(args[6][-1]):] == 0)
    return dev, out


@needs_fi
@pytest.mark.gpu
@pytest.mark.parametrize("mode", [KVQuantMode.NONE, KVQuantMode.FP8_E4M3], ids=lambda m: m.name)
def test_decode_and_prefill_match_reference(mode):
    _run_and_check(_case([1, 533, 4097, 31], [1, 1, 1, 1], 32, 8, 128, mode, pad_rows=2))
    _run_and_check(_case([533, 1, 700, 77], [533, 1, 300, 7], 32, 8, 128, mode, pad_rows=3, seed=1), window=129)


@needs_fi
@pytest.mark.gpu
def test_plan_is_cached_and_follows_in_place_updates():
    fi_backend.clear_plans()
    dev, _ = _run_and_check(_case([100, 200], [1, 1], 16, 4, 128, KVQuantMode.NONE))
    assert len(fi_backend._plans) == 1
    fi_backend.paged_attention(AttentionCall(*dev))
    assert len(fi_backend._plans) == 1, "same metadata must reuse the plan"
    dev[5].sub_(37)  # shorter contexts, in place: the version counter changes
    out = fi_backend.paged_attention(AttentionCall(*dev))
    assert len(fi_backend._plans) == 2
    expected = reference.paged_attention(AttentionCall(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in dev]))
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=3e-2, rtol=3e-2)


@needs_fi
@pytest.mark.gpu
def test_refuses_cuda_graph_capture():
    fi_backend.clear_plans()
    dev = [a.cuda() if isinstance(a, torch.Tensor) else a for a in _case([64], [1], 8, 8, 128, KVQuantMode.NONE)]
    fi_backend.paged_attention(AttentionCall(*dev))  # warm-up plan outside capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="triton"):
        with torch.cuda.graph(graph):
            fi_backend.paged_attention(AttentionCall(*dev))
