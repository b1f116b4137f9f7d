"""Prefill over FP8 / NVFP4 caches from gathered new rows (kvfuse.ops.triton.prefill.cached_new_token_prefill)
vs the reference, which attends over the cache's decoded values in float32."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before the kernels are decorated; CPU-only hosts can only interpret them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kvfuse.kv_cache import KVFormat, KVQuantMode, cache_layout, read_cache_rows  # noqa: E402
from kvfuse.ops import reference  # noqa: E402
from kvfuse.ops.registry import AttentionCall  # noqa: E402

from test_triton_attention import DEVICE, TOL, gpu, make_case, poison_allocator, reference_out  # noqa: E402

triton = pytest.importorskip("triton")

#: The stated error bound of FP8 dots (an FP8 e4m3 cache's prefill with the query and P rounded
#: to e4m3) against the reference over the same cache, in units of the values' RMS ``sigma_v``
#: and the scaled scores' spread ``sigma_s = rms(q) * rms(k) * sqrt(D) * sm_scale`` (sharper
#: softmaxes amplify score errors):
#:     mean |err| <= FP8_DOTS_MEAN * sigma_v * (1 + sigma_s / 2)
#:     max  |err| <= FP8_DOTS_MAX * sigma_v * max(1, sigma_s)
#: The error's source is the query's rounding (3 mantissa bits: every score moves by about 1.5%
#: of its magnitude); P's rounding adds less (see ``fp8_dots_bound``).
FP8_DOTS_MEAN = 0.01
FP8_DOTS_MAX = 0.25

#: (name, mode, FP8 dots): the gathered path's variants.
VARIANTS = {"fp8_dots": (KVQuantMode.FP8_E4M3, True), "fp8_decoded": (KVQuantMode.FP8_E4M3, False),
            "e5m2": (KVQuantMode.FP8_E5M2, False), "nvfp4": (KVQuantMode.NVFP4, False)}


def fp8_dots_bound(args) -> tuple[float, float]:
    """(mean, max) error bounds of FP8 dots for the call ``args`` (see FP8_DOTS_MEAN), from the
    RMS of its query and of every cached K/V row its sequences hold."""
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    cache, table, page = cpu["kv_cache"], cpu["block_table"], cpu["kv_cache"].shape[2]
    mode = KVQuantMode(cpu["kv_quant_mode"])
    ks, vs = [], []
    for b, seq_len in enumerate(cpu["seq_lens"].tolist()):
        pos = torch.arange(seq_len)
        blocks, offsets = table[b, pos // page].long(), pos % page
        ks.append(reference.decode_rows(read_cache_rows(cache, blocks, offsets, 0, mode), cpu["k_scale"], int(mode)))
        vs.append(reference.decode_rows(read_cache_rows(cache, blocks, offsets, 1, mode), cpu["v_scale"], int(mode)))
    rms = lambda t: float(t.float().pow(2).mean().sqrt())  # noqa: E731
    head_size = cpu["query"].shape[2]
    covered = int(cpu["query_start_loc"][-1])
    sigma_s = rms(cpu["query"][:covered]) * rms(torch.cat(ks)) * head_size ** 0.5 * cpu["sm_scale"]
    sigma_v = rms(torch.cat(vs))
    return FP8_DOTS_MEAN * sigma_v * (1 + sigma_s / 2), FP8_DOTS_MAX * sigma_v * max(1.0, sigma_s)


def unit_values_case(seq_lens, q_lens, seed):
    """An FP8 e4m3 case (8 query heads over 2 KV heads, D=128, 3 padding rows) whose every cached
    value is 1 at scale 1: attention then returns 1 wherever the weights sum to 1."""
    args = make_case(seq_lens, q_lens, 8, 2, 128, KVQuantMode.FP8_E4M3, pad_rows=3, seed=seed)
    cache = args["kv_cache"]
    cache[:, 1] = torch.ones(cache[:, 1].shape, device=cache.device).to(cache.dtype)
    args["v_scale"] = torch.tensor(1.0, device=cache.device)
    return args


def assert_unit_values_come_back(args, out, max_bound, mean_bound):
    """out (for a unit_values_case) is 1 within max_bound everywhere and mean_bound on average;
    padding rows are zeros."""
    covered = int(args["query_start_loc"][-1])
    err = out[:covered].float() - 1.0
    assert err.abs().max().item() <= max_bound and abs(err.mean().item()) <= mean_bound, (
        err.abs().max().item(), err.mean().item())
    assert torch.all(out[covered:] == 0), "padding rows must be zeros"


def run(args, **options):
    from kvfuse.ops.triton.attention import paged_attention

    poison_allocator(16 * args["query"].numel())
    return paged_attention(AttentionCall(**args), **options)


#: How the prefix is attended: every cached key gathered densely, or the paged kernel's partials.
CONTEXTS = {"whole": True, "partials": False}


def check(args, fp8_dots, whole_context=None, **fields):
    """The gathered path (asserted taken) vs the reference: FP8 dots within the stated bound, every
    other variant within the query dtype's tolerance; padding rows zeros."""
    from kvfuse.ops.triton import prefill

    args = dict(args, **fields)
    assert prefill.takes_cached(AttentionCall(**args), decode=False)
    expected = reference_out(args).float()
    out = run(args, fp8_dots=fp8_dots, whole_context=whole_context)
    covered = int(args["query_start_loc"][-1])
    assert torch.all(out[covered:] == 0), "padding rows must be zeros"
    out = out.cpu().float()
    if fp8_dots and KVQuantMode(args["kv_quant_mode"]) is KVQuantMode.FP8_E4M3:
        err = (out[:covered] - expected[:covered]).abs()
        mean_bound, max_bound = fp8_dots_bound(args)
        assert err.mean() <= mean_bound and err.max() <= max_bound, (err.mean(), mean_bound, err.max(), max_bound)
    else:
        atol, rtol = TOL[args["query"].dtype]
        torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    return out


CPU_CASES = {
    # seq_lens, q_lens: fresh prompts (7: one partial tile), a chunk on a cached prefix that ends
    # mid-page next to a fresh prompt and a 1-token row.
    "fresh": ([7, 33], [7, 33]),
    "chunked": ([40, 19, 5], [17, 19, 1]),
}


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("heads,head_size", [((4, 2), 64), ((2, 2), 80), ((6, 2), 32)], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference(variant, case, heads, head_size, context):
    mode, fp8_dots = VARIANTS[variant]
    seq_lens, q_lens = CPU_CASES[case]
    args = make_case(seq_lens, q_lens, heads[0], heads[1], head_size, mode, pad_rows=3, seed=51)
    check(args, fp8_dots, CONTEXTS[context])


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_per_head_scales(variant, context):
    """Scales per KV head (each head's own, 1.5x apart): the new rows and the prefix each use
    their program's head."""
    mode, fp8_dots = VARIANTS[variant]
    args = make_case([40, 21], [17, 21], 4, 2, 64, mode, pad_rows=2, seed=52)
    args["k_scale"] = args["k_scale"] * torch.tensor([1.0, 1.5], device=DEVICE)
    args["v_scale"] = args["v_scale"] * torch.tensor([1.5, 1.0], device=DEVICE)
    check(args, fp8_dots, CONTEXTS[context])


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("variant", ["fp8_dots", "nvfp4"])
def test_softcap_and_sinks(variant, context):
    """Sinks are counted once (by the prefix's partial where the sequence has a prefix, sequence
    0, and the paged kernel's partials are used), softcap applies to prefix and new keys alike;
    a -inf sink is no sink."""
    mode, fp8_dots = VARIANTS[variant]
    args = make_case([40, 29], [9, 29], 4, 2, 64, mode, seed=53)
    sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf")], device=DEVICE)
    check(args, fp8_dots, CONTEXTS[context], logit_softcap=5.0, sinks=sinks)


@pytest.mark.parametrize("mode", [KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4], ids=lambda m: m.name)
def test_gathered_context_is_the_cache(mode):
    """gather_context: every cached position of each sequence at row (FP8 values: column)
    ``b * stride + pos``, the stride the table's capacity rounded up to 128; zeros from each
    sequence's length to the next multiple of 128 (the last key tile reads them)."""
    from kvfuse.ops.triton import prefill

    seq_lens, q_lens = [40, 130, 5], [17, 19, 1]
    args = make_case(seq_lens, q_lens, 4, 2, 64, mode, pad_rows=3, seed=58)
    call = AttentionCall(**args)
    codes = mode is KVQuantMode.FP8_E4M3
    key, value, stride = prefill.gather_context(call, codes)
    cols = args["block_table"].shape[1]
    assert stride == -(-cols * 16 // 128) * 128 and stride % 128 == 0 and stride >= max(seq_lens)
    assert key.shape == (3 * stride, 2, 64)
    assert prefill.context_bytes(call, codes) == key.numel() * key.element_size() * 2
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    cache, table = cpu["kv_cache"], cpu["block_table"]
    layout = cache_layout(KVFormat.of(mode), cache, 64)
    key, value = key.cpu(), value.cpu()
    one = torch.ones(())
    for b, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        blocks, offsets = table[b, pos // 16].long(), pos % 16
        k_rows = read_cache_rows(cache, blocks, offsets, 0, layout)
        v_rows = read_cache_rows(cache, blocks, offsets, 1, layout)
        rows = slice(b * stride, b * stride + seq_len)
        tail = slice(b * stride + seq_len, b * stride + -(-seq_len // 128) * 128)
        if codes:
            got_v = value[:, rows].T.reshape(seq_len, 2, 64)
            assert torch.equal(key[rows].view(torch.uint8), k_rows.view(torch.uint8))
            assert torch.equal(got_v.view(torch.uint8), v_rows.view(torch.uint8))
            assert torch.all(value[:, tail].float() == 0)
        else:
            for got, enc in ((key[rows], k_rows), (value[rows], v_rows)):
                torch.testing.assert_close(got.float() * 64.0, reference.decode_rows(enc, one, int(mode)), atol=0,
                                           rtol=0)
            assert torch.all(value[tail].float() == 0)
        assert torch.all(key[tail].float() == 0)


def test_permuted_value_columns():
    """gather_context(permute_values=True) puts each e4m3 value column where
    permuted_value_column says, a permutation within each 16 columns (what the native FP8 prefill
    kernel's P operand expects); plain and permuted gathers hold the same bytes otherwise."""
    from kvfuse.ops.triton import prefill

    assert sorted(prefill.permuted_value_column(c) for c in range(32)) == list(range(32))
    assert [prefill.permuted_value_column(c) for c in (0, 1, 2, 8, 9, 15, 16, 26)] == [0, 1, 4, 2, 3, 15, 16, 22]
    args = make_case([40, 130], [17, 19], 4, 2, 64, KVQuantMode.FP8_E4M3, seed=60)
    call = AttentionCall(**args)
    key, value, stride = prefill.gather_context(call, True)
    key_p, value_p, stride_p = prefill.gather_context(call, True, permute_values=True)
    assert stride_p == stride
    order = torch.tensor([prefill.permuted_value_column(c) for c in range(value.shape[1])])
    for b, seq_len in enumerate([40, 130]):
        cols = torch.arange(b * stride, b * stride + -(-seq_len // 128) * 128)  # the written ones
        assert torch.equal(key_p.cpu()[cols].view(torch.uint8), key.cpu()[cols].view(torch.uint8))
        assert torch.equal(value_p.cpu()[:, order[cols]].view(torch.uint8), value.cpu()[:, cols].view(torch.uint8))
        assert not torch.equal(order[cols], cols)
    with pytest.raises(ValueError, match="permute_values"):
        prefill.gather_context(AttentionCall(**make_case([5], [5], 2, 1, 64, KVQuantMode.NVFP4)), False,
                               permute_values=True)


def test_whole_context_by_its_size(monkeypatch):
    """By default the whole context is gathered while its tensors fit WHOLE_CONTEXT_MAX_BYTES;
    beyond, the new rows are gathered and the prefix goes through the paged kernel's partials.
    Both give the reference's output."""
    from kvfuse.ops.triton import prefill

    args = make_case([40, 21], [17, 21], 4, 2, 64, KVQuantMode.NVFP4, seed=59)
    taken = []
    for name in ("gather_context", "gather_new_rows"):
        real = getattr(prefill, name)
        monkeypatch.setattr(prefill, name,
                            lambda *a, _real=real, _name=name, **k: taken.append(_name) or _real(*a, **k))
    need = prefill.context_bytes(AttentionCall(**args), False)
    check(args, False)
    monkeypatch.setattr(prefill, "WHOLE_CONTEXT_MAX_BYTES", need - 1)
    check(args, False)
    assert taken == ["gather_context", "gather_new_rows"]


def test_fp16_query():
    args = make_case([23, 30], [23, 11], 2, 1, 64, KVQuantMode.NVFP4, q_dtype=torch.float16, seed=54)
    check(args, False)
    args = make_case([23, 30], [23, 11], 2, 1, 64, KVQuantMode.FP8_E4M3, q_dtype=torch.float16, seed=54)
    check(args, True)


@pytest.mark.parametrize("mode", [KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2, KVQuantMode.NVFP4],
                         ids=lambda m: m.name)
def test_gathered_rows_are_the_cache_rows(mode):
    """gather_new_rows returns exactly each query row's cached K/V (FP8 e4m3: the codes, values at
    each sequence's aligned column; otherwise the decoded values, which times the scale and the
    mode's factor are the reference's decode), zeros for padding rows and between sequences."""
    from kvfuse.ops.triton import prefill

    seq_lens, q_lens = [40, 19, 5], [17, 19, 1]
    args = make_case(seq_lens, q_lens, 4, 2, 64, mode, pad_rows=3, seed=55)
    call = AttentionCall(**args)
    codes = mode is KVQuantMode.FP8_E4M3
    key, value = prefill.gather_new_rows(call, codes)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    cache, table, page = cpu["kv_cache"], cpu["block_table"], cpu["kv_cache"].shape[2]
    layout = cache_layout(KVFormat.of(mode), cache, 64)
    key, value = key.cpu(), value.cpu()
    num_tokens = args["query"].shape[0]
    factor = {KVQuantMode.NVFP4: 64.0}.get(mode, 1.0)
    q_start = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        pos = torch.arange(seq_len - q_len, seq_len)
        blocks, offsets = table[b, pos // page].long(), pos % page
        k_rows = read_cache_rows(cache, blocks, offsets, 0, layout)
        v_rows = read_cache_rows(cache, blocks, offsets, 1, layout)
        rows = slice(q_start, q_start + q_len)
        if codes:
            assert torch.equal(key[rows].view(torch.uint8), k_rows.view(torch.uint8))
            col = q_start // 16 * 16 + 16 * b
            got = value[:, col:col + q_len].T.reshape(q_len, 2, 64)
            assert torch.equal(got.view(torch.uint8), v_rows.view(torch.uint8))
        else:
            one = torch.ones(())
            for got, enc in ((key[rows], k_rows), (value[rows], v_rows)):
                torch.testing.assert_close(got.float() * factor, reference.decode_rows(enc, one, int(mode)),
                                           atol=0, rtol=0)
        q_start += q_len
    if codes:
        used = torch.zeros(value.shape[1], dtype=torch.bool)
        q_start = 0
        for b, q_len in enumerate(q_lens):
            col = q_start // 16 * 16 + 16 * b
            used[col:col + q_len] = True
            q_start += q_len
        assert value.shape[1] == prefill.value_columns(num_tokens, len(q_lens))
        assert torch.all(value[:, ~used].float() == 0), "columns between sequences must be zeros"
        assert torch.all(key[q_start:].float() == 0), "padding rows must be zeros"
    else:
        assert torch.all(key[q_start:] == 0) and torch.all(value[q_start:] == 0), "padding rows must be zeros"


def test_fp8_dots_are_taken_and_differ_from_decoded():
    """FP8 dots are the default for an e4m3 cache (KVFUSE_FP8_PREFILL_DOTS turns them off): their
    output is not the decoded path's, and both are within their bounds of the reference."""
    from kvfuse import envs

    args = make_case([33, 20], [33, 20], 4, 2, 64, KVQuantMode.FP8_E4M3, seed=56)
    dots = run(args)
    decoded = run(args, fp8_dots=False)
    assert not torch.equal(dots, decoded)
    torch.testing.assert_close(dots, check(args, True).to(dots.device).to(dots.dtype), atol=0, rtol=0)
    check(args, False)
    os.environ["KVFUSE_FP8_PREFILL_DOTS"] = "0"
    try:
        envs.reload()
        assert torch.equal(run(args), decoded)
    finally:
        del os.environ["KVFUSE_FP8_PREFILL_DOTS"]
        envs.reload()


@pytest.mark.parametrize("fields", [dict(sliding_window=8), dict(mode=KVQuantMode.FP8_PER_TOKEN_HEAD),
                                    dict(mode=KVFormat(KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4)),
                                    dict(q_dtype=torch.float32), dict(decode=True)],
                         ids=["window", "per_token_head", "mixed", "float32", "decode"])
def test_calls_it_does_not_take(fields):
    """Windows, per-token-head and mixed formats, float32 queries and decode-sized calls keep the
    paged kernel (takes_cached is false, and the gather never runs)."""
    from kvfuse.ops.triton import prefill

    mode = fields.get("mode", KVQuantMode.FP8_E4M3)
    q_lens = [1, 1] if fields.get("decode") else [30, 12]
    if isinstance(mode, KVFormat):
        args = make_case([30, 12], q_lens, 4, 2, 64, KVQuantMode.FP8_E4M3, seed=57)
        call = AttentionCall(**dict(args, kv_quant_mode=mode))
    else:
        args = make_case([30, 12], q_lens, 4, 2, 64, mode, q_dtype=fields.get("q_dtype", torch.bfloat16), seed=57)
        args["sliding_window"] = fields.get("sliding_window")
        call = AttentionCall(**args)
    assert not prefill.takes_cached(call, decode=bool(fields.get("decode")))
    if not isinstance(mode, KVFormat):
        calls = []
        real_rows, real_context = prefill.gather_new_rows, prefill.gather_context
        prefill.gather_new_rows = lambda *a, **k: calls.append(1) or real_rows(*a, **k)
        prefill.gather_context = lambda *a, **k: calls.append(1) or real_context(*a, **k)
        try:
            out = run(args)
        finally:
            prefill.gather_new_rows, prefill.gather_context = real_rows, real_context
        assert not calls
        atol, rtol = TOL[args["query"].dtype]
        torch.testing.assert_close(out.cpu().float(), reference_out(args).float(), atol=atol, rtol=rtol)


def test_prefix_partials_are_the_prefix_softmax():
    """prefix_partials: each row's output and base-2 log-sum-exp over its sequence's prefix keys
    only (every new token sees all of them); rows of a sequence without a prefix are not written
    (on the GPU they keep the allocator's NaN)."""
    import math

    from kvfuse.ops.triton import attention as ta

    args = make_case([40, 19], [17, 19], 4, 2, 64, KVQuantMode.NVFP4, pad_rows=2, seed=58)
    rows, heads = args["query"].shape[:2]
    # NaN over most of a small-block segment, then in free blocks of about the outputs' sizes
    # (float32 out and lse), which the caching allocator's best fit hands to them.
    for nbytes in ((1 << 20) - 8192, rows * heads * 64 * 4, rows * heads * 4):
        poison_allocator(nbytes)
    out, lse = ta.prefix_partials(AttentionCall(**args))
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    pos = torch.arange(23)  # sequence 0: 40 cached positions, 17 of them new
    blocks, offsets = cpu["block_table"][0, pos // 16].long(), pos % 16
    k, v = (reference.decode_rows(read_cache_rows(cpu["kv_cache"], blocks, offsets, side, KVQuantMode.NVFP4),
                                  scale, int(KVQuantMode.NVFP4)).repeat_interleave(2, dim=1)
            for side, scale in ((0, cpu["k_scale"]), (1, cpu["v_scale"])))
    s = torch.einsum("thd,jhd->thj", cpu["query"][:17].float(), k) * cpu["sm_scale"]
    expected = torch.einsum("thj,jhd->thd", torch.softmax(s, -1), v)
    torch.testing.assert_close(out[:17].cpu(), expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse[:17].cpu(), torch.logsumexp(s, -1) / math.log(2), atol=1e-3, rtol=1e-4)
    if torch.cuda.is_available():
        assert torch.isnan(out[17:]).all() and torch.isnan(lse[17:]).all()


@pytest.mark.parametrize("mode", [KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4], ids=lambda m: m.name)
def test_opcheck_prefill_through_triton(mode, monkeypatch):
    """The op with a prefill-sized call on the Triton backend, which routes it here."""
    import kvfuse.ops  # noqa: F401
    from kvfuse.ops import registry as backends
    from kvfuse.ops.triton import prefill

    from test_reference_ops import _opcheck

    monkeypatch.setenv("KVFUSE_ATTENTION_BACKEND", "triton")
    backends.clear_cache()
    taken = []
    monkeypatch.setattr(prefill, "gather_context", lambda *a, _real=prefill.gather_context, **k: taken.append(1)
                        or _real(*a, **k))
    try:
        args = make_case([20, 9], [12, 9], 4, 2, 64, mode, seed=59)
        op_args = (args["query"], args["kv_cache"], args["k_scale"], args["v_scale"], args["block_table"],
                   args["seq_lens"], args["query_start_loc"], args["kv_quant_mode"], args["sm_scale"], None,
                   "layers.0")
        _opcheck(torch.ops.kvfuse.paged_attention.default, op_args, args["kv_cache"].dtype)
        assert taken
    finally:
        monkeypatch.delenv("KVFUSE_ATTENTION_BACKEND")
        backends.clear_cache()


# ----------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_fresh_and_chunked(variant, head_size, context):
    mode, fp8_dots = VARIANTS[variant]
    args = make_case([4099, 533, 7, 1100], [4099, 533, 7, 512], 32, 8, head_size, mode, pad_rows=5, seed=60)
    check(args, fp8_dots, CONTEXTS[context])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("variant", ["fp8_dots", "nvfp4"])
def test_gpu_softcap_sinks_fp16_head_scales(variant, context):
    mode, fp8_dots = VARIANTS[variant]
    args = make_case([700, 1300], [700, 300], 16, 4, 128, mode, q_dtype=torch.float16, seed=61)
    args["k_scale"] = args["k_scale"] * torch.linspace(0.5, 2.0, 4, device=DEVICE)
    args["v_scale"] = args["v_scale"] * torch.linspace(2.0, 0.5, 4, device=DEVICE)
    check(args, fp8_dots, CONTEXTS[context], logit_softcap=30.0, sinks=torch.linspace(-2, 2, 16, device=DEVICE))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("context", CONTEXTS)
def test_gpu_fp8_dots_constant_values_come_back(context):
    """Every value 1: the output is sum(P V) / sum(P), 1 up to P's unbiased rounding, unless the
    P V products accumulate O across every tile in the e4m3 products' own precision, which
    truncates at every k-step: that came out 2% low on average at 4099 keys (BENCHMARKS.md,
    twenty-seventh session). The kernel sums each tile's product in fp32 (_values_dot)."""
    args = unit_values_case([4099, 900], [4099, 533], seed=72)
    out = run(args, fp8_dots=True, whole_context=CONTEXTS[context])
    assert_unit_values_come_back(args, out, max_bound=0.03, mean_bound=5e-3)
