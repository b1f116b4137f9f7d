"""The native decode attention kernel (csrc/cuda/decode_attention.cu) vs the reference, on the GPU.

Caches are NaN-poisoned and scattered, block tables hold out-of-range entries past each sequence
(make_case): a read of a never-written slot or of a page past the end shows up as NaN or a fault.
The CPU side of the backend (what it refuses, how the registry ranks it) is in test_native.py.
"""

from __future__ import annotations

import pytest
import torch

from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops import native
from kvfuse.ops import registry as backends
from kvfuse.ops.registry import AttentionCall
from test_triton_attention import TOL, make_case, poison_allocator, reference_out

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODES = [KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2, KVQuantMode.NVFP4, KVQuantMode.FP8_PER_TOKEN_HEAD]


def check(args, window=None, num_splits=None, prefill_shaped=False, **call_fields):
    args = dict(args, sliding_window=window)
    call = AttentionCall(**args, **call_fields)
    expected = reference_out(dict(args, **call_fields))
    assert native.decode_refusal(call, prefill_shaped_ok=prefill_shaped) is None
    poison_allocator(8 * args["query"].numel() * 4 * 32)
    if prefill_shaped:
        # What a forced native backend runs: the kernel itself, whatever the query lengths.
        fn = torch.ops.kvfuse_native.paged_decode_attention.default
        out = fn(call.query, call.kv_cache, call.k_scale, call.v_scale, call.block_table, call.seq_lens,
                 call.query_start_loc, call.sinks, int(call.kv_quant_mode), float(call.sm_scale), int(window or 0),
                 float(call.logit_softcap), num_splits or 1)
    else:
        out = native.paged_attention(call, num_splits=num_splits)
    assert out.shape == args["query"].shape and out.dtype == args["query"].dtype
    atol, rtol = TOL[args["query"].dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=atol, rtol=rtol)
    covered = int(args["query_start_loc"][-1])
    assert torch.all(out[covered:] == 0), "padding rows must be zeros"
    return out


@pytest.fixture(scope="module", autouse=True)
def built():
    reason = native.unavailable_reason("paged_attention", "cuda", int(KVQuantMode.NVFP4))
    if reason is not None:
        pytest.fail(f"the native attention kernel is unavailable on this GPU host: {reason}")


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("head_size,heads", [(64, (32, 8)), (128, (32, 8)), (256, (32, 8)), (128, (8, 8)),
                                             (128, (32, 4)), (128, (64, 4)), (64, (12, 4)), (128, (6, 2)),
                                             (128, (9, 3))], ids=str)
def test_decode_matches_reference(mode, head_size, heads):
    # Lengths around pages and chunks (1, 31, 533, 1999, 4097); 3 padding rows; groups 1, 3, 4, 8, 16.
    # Per-token-head caches: 4 KV heads per block where heads % 4 == 0, one otherwise (2 or 3 heads).
    # NVFP4 caches: 2 KV heads per block where heads % 2 == 0, one otherwise (3 heads).
    args = make_case([1, 533, 4097, 1999, 31], [1] * 5, heads[0], heads[1], head_size, mode, pad_rows=3, seed=41)
    check(args)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("num_splits", [1, 3, 7, 8, 12])
def test_split_kv(mode, num_splits):
    args = make_case([4099, 7, 16], [1, 1, 1], 32, 8, 128, mode, pad_rows=2, seed=42)
    check(args, num_splits=num_splits)
    check(args, window=1000, num_splits=num_splits)


@pytest.mark.parametrize("group", [4, 16], ids=lambda g: f"group{g}")
def test_nvfp4_pairs_in_either_build(group):
    # NVFP4 head pairs run one of two builds by launch size: up to 2 blocks per SM, 8 warps per
    # block at a group of 4 (4 at 16: 16-row tiles), else 4 warps at 4 blocks per SM. Both are
    # checked against the reference, with and without a window.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_heads = 4
    args = make_case([1999, 533, 4097, 31, 16], [1] * 5, kv_heads * group, kv_heads, 128, KVQuantMode.NVFP4,
                     pad_rows=2, seed=54)
    pair_blocks = 5 * kv_heads // 2
    for num_splits in (1, 2 * sms // pair_blocks + 1):
        assert (pair_blocks * num_splits <= 2 * sms) == (num_splits == 1)
        check(args, num_splits=num_splits)
        check(args, window=700, num_splits=num_splits)


@pytest.mark.parametrize("mode", [KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4], ids=lambda m: m.name)
@pytest.mark.parametrize("num_splits", [5, 12])
def test_split_calls_back_to_back_and_in_a_graph(mode, num_splits):
    # The splits' partials go through global buffers from the caching allocator, which hands one
    # call's buffers to the next, and a second kernel merges them. So: calls on alternating queries
    # with no sync in between, then the same calls captured in one CUDA graph and replayed over
    # NaN-filled outputs, each against its own reference.
    args = make_case([4099, 2500, 16], [1, 1, 1], 32, 8, 128, mode, pad_rows=2, seed=51)
    other = dict(args, query=torch.randn_like(args["query"]) * 2)
    expected = [reference_out(a).float() for a in (args, other)]
    calls = [AttentionCall(**a) for a in (args, other)]
    atol, rtol = TOL[args["query"].dtype]
    outs = [native.paged_attention(calls[i % 2], num_splits=num_splits) for i in range(8)]
    for i, out in enumerate(outs):
        torch.testing.assert_close(out.cpu().float(), expected[i % 2], atol=atol, rtol=rtol)
    assert torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[1])
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            captured = [native.paged_attention(calls[i % 2], num_splits=num_splits) for i in range(4)]
    torch.cuda.current_stream().wait_stream(stream)
    for out in captured:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for i, out in enumerate(captured):
        assert torch.equal(out, outs[i % 2]), f"graph replay of call {i} differs from its eager run"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_long_context_small_batch(mode):
    # One sequence: the automatic split count, with and without a window.
    args = make_case([32768 - 5], [1], 32, 8, 128, mode, seed=43)
    check(args)
    args = make_case([32768, 7001], [1, 1], 32, 8, 128, mode, seed=44)
    check(args, window=4096)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page", [1, 5, 32])
def test_page_sizes(mode, page):
    # Page 5: NVFP4 V scales stay linear (vLLM's swizzle needs block_size % 4 == 0); page 1: a page per key.
    args = make_case([533, 17, 64], [1, 1, 1], 16, 4, 128, mode, page=page, seed=45)
    check(args)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_spec_decode_and_windows(mode):
    # Several query tokens per sequence (two query tiles at a group of 4), causal inside the tile.
    args = make_case([4096, 300, 9], [4, 3, 2], 32, 8, 128, mode, pad_rows=1, seed=46)
    check(args)
    check(args, window=129)
    check(args, window=1)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_prefill_shaped_call_when_forced(mode):
    # The kernel is correct at any query length; a forced native backend sends prefill here.
    args = make_case([533, 1, 700, 77], [533, 1, 300, 7], 32, 8, 128, mode, pad_rows=5, seed=47)
    check(args, prefill_shaped=True)
    check(args, window=129, prefill_shaped=True)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_softcap_sinks_and_per_head_scales(mode):
    args = make_case([1500, 33, 4000], [1, 1, 1], 32, 8, 128, mode, pad_rows=2, seed=48)
    gen = torch.Generator().manual_seed(48)
    sinks = (torch.randn(32, generator=gen) * 3).cuda()
    check(args, sinks=sinks)
    check(args, logit_softcap=5.0)
    check(args, num_splits=4, sinks=sinks, logit_softcap=30.0)
    # Per-KV-head scales: the reference and the kernel both read head h's values times scale[h].
    per_head = torch.linspace(0.5, 2.0, 8).cuda()
    check(dict(args, k_scale=args["k_scale"] * per_head, v_scale=args["v_scale"] * per_head.flip(0)))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_query_dtypes_and_range(mode):
    args = make_case([700, 1001], [1, 1], 16, 4, 128, mode, q_dtype=torch.float16, seed=49)
    check(args)
    # bf16 queries beyond fp16's range: the kernel scales the tile down by a power of two.
    args = make_case([700, 1001], [1, 1], 16, 4, 128, mode, seed=50)
    big = dict(args, query=args["query"] * 3e5)
    expected = reference_out(big)
    out = native.paged_attention(AttentionCall(**big))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_registry_picks_it_for_quantized_decode(monkeypatch):
    monkeypatch.delenv("KVFUSE_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("KVFUSE_BACKEND", raising=False)
    backends.clear_cache()
    try:
        for mode in MODES:
            assert backends.select("paged_attention", "cuda", int(mode)).name == "native"
            args = make_case([17, 2048], [1, 1], 32, 8, 128, mode, pad_rows=2, seed=51)
            out = torch.ops.kvfuse.paged_attention(*args.values(), "layers.3")
            torch.testing.assert_close(out.cpu().float(), reference_out(args).float(), atol=3e-2, rtol=3e-2)
        # bf16 too: the native backend takes bf16 prefill (its Hopper kernel) and hands bf16
        # decode to Triton's kernel (native.paged_attention); the result is the reference's.
        assert backends.select("paged_attention", "cuda", int(KVQuantMode.NONE)).name == "native"
        args = make_case([17, 300], [1, 1], 32, 8, 128, KVQuantMode.NONE, pad_rows=2, seed=53)
        out = torch.ops.kvfuse.paged_attention(*args.values(), "layers.3")
        torch.testing.assert_close(out.cpu().float(), reference_out(args).float(), atol=3e-2, rtol=3e-2)
    finally:
        backends.clear_cache()


def test_forced_backend_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.setenv("KVFUSE_ATTENTION_BACKEND", "native")
    backends.clear_cache()
    try:
        args = make_case([64], [1], 10, 2, 80, KVQuantMode.NVFP4, seed=52)
        with pytest.raises(ValueError, match="head_size=80"):
            torch.ops.kvfuse.paged_attention(*args.values(), "layers.0")
    finally:
        backends.clear_cache()


def test_unforced_hands_other_calls_to_triton():
    # Not decode-shaped or not supported: the Triton kernel answers (head size 80, a prefill).
    args = make_case([64, 300], [1, 300], 10, 2, 80, KVQuantMode.NVFP4, seed=53)
    call = AttentionCall(**args)
    assert "head_size=80" in native.decode_refusal(call)
    torch.testing.assert_close(native.paged_attention(call).cpu().float(), reference_out(args).float(),
                               atol=3e-2, rtol=3e-2)
