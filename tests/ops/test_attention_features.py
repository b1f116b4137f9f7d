"""Soft-capping, attention sinks and sliding windows of ``kvfuse::paged_attention``, op by op.

The oracle chain: a dense transformers-style eager computation (scores, soft-cap, additive mask,
sink column, softmax, drop the sink) checks the reference backend; the reference checks Triton
(CPU interpreter with tiny shapes, realistic shapes on the GPU) and FlashInfer (GPU).
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kvfuse.kv_cache import KVQuantMode, read_cache_rows  # noqa: E402
from kvfuse.ops import reference  # noqa: E402
from kvfuse.ops.registry import AttentionCall  # noqa: E402

from test_triton_attention import DEVICE, TOL, check, make_case, reference_out  # noqa: E402

MODES = [KVQuantMode.NONE, KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4]


def dense_eager(args, window, softcap, sinks):
    """transformers' eager attention (Gemma 2 soft-cap, gpt-oss sinks) over dense K/V, per sequence."""
    cache, mode = args["kv_cache"].cpu(), args["kv_quant_mode"]
    page, hkv = cache.shape[2], cache.shape[3]
    q_all = args["query"].cpu().float()
    hq = q_all.shape[1]
    out = torch.zeros_like(q_all)
    qsl = args["query_start_loc"].tolist()
    for b, seq_len in enumerate(args["seq_lens"].tolist()):
        q = q_all[qsl[b]:qsl[b + 1]]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        pos = torch.arange(seq_len)
        blocks = args["block_table"][b].cpu()[pos // page].long()
        k = reference.decode_rows(read_cache_rows(cache, blocks, pos % page, 0), args["k_scale"].cpu(), mode)
        v = reference.decode_rows(read_cache_rows(cache, blocks, pos % page, 1), args["v_scale"].cpu(), mode)
        k = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        w = q.transpose(0, 1) @ k.transpose(1, 2) * args["sm_scale"]  # [H, q_len, L]
        if softcap:
            w = torch.tanh(w / softcap) * softcap
        q_idx = (seq_len - q_len + torch.arange(q_len))[:, None]
        kv_idx = pos[None, :]
        allowed = kv_idx <= q_idx
        if window is not None:
            allowed &= kv_idx > q_idx - window  # transformers' sliding_window_overlay
        w = w + torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        if sinks is not None:
            w = torch.cat([w, sinks.cpu().float().reshape(hq, 1, 1).expand(hq, q_len, 1)], dim=-1)
            w = w - w.max(dim=-1, keepdim=True).values
            p = torch.softmax(w, dim=-1)[..., :-1]
        else:
            p = torch.softmax(w, dim=-1)
        out[qsl[b]:qsl[b + 1]] = (p @ v).transpose(0, 1)
    return out


def with_features(args, window=None, softcap=0.0, sinks=None):
    return dict(args, sliding_window=window, logit_softcap=softcap, sinks=sinks)


def make_sinks(num_q_heads, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    # Sinks around the scores' own range, so they take a visible share of every softmax.
    return (torch.randn(num_q_heads, generator=gen) * 2 + 1).to(device)


# ----------------------------------------------------------------------------- reference vs dense eager


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("seq", [7, 533])
def test_reference_matches_dense_eager(mode, seq):
    # A prefill of `seq` tokens, a decode step at `seq`, and a chunked prefill, GQA 6/2.
    args = make_case([seq, seq + 1, seq + 3], [seq, 1, 5], 6, 2, 32, mode, page=16, q_dtype=torch.float32,
                     pad_rows=2, device="cpu", seed=seq)
    sinks = make_sinks(6, device="cpu")
    for window, softcap, sk in [(None, 0.0, None), (None, 1.5, None), (5, 0.0, sinks), (64, 2.0, sinks),
                                (1, 0.0, None)]:
        a = with_features(args, window, softcap, sk)
        got = reference.paged_attention(AttentionCall(**a))
        want = dense_eager(a, window, softcap, sk)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert torch.all(got[int(args["query_start_loc"][-1]):] == 0)


def test_features_change_the_output():
    """Each feature must matter on these inputs, or the comparisons above prove nothing."""
    args = make_case([40], [3], 4, 2, 32, KVQuantMode.NONE, q_dtype=torch.float32, device="cpu", seed=9)
    base = reference.paged_attention(AttentionCall(**with_features(args)))
    for kwargs in (dict(softcap=1.0), dict(sinks=make_sinks(4, device="cpu")), dict(window=4)):
        out = reference.paged_attention(AttentionCall(**with_features(args, **kwargs)))
        assert (out - base).abs().max() > 1e-2, kwargs


def test_sink_of_minus_infinity_is_no_sink():
    args = make_case([20, 9], [4, 9], 4, 1, 16, KVQuantMode.NONE, q_dtype=torch.float32, device="cpu", seed=5)
    none = reference.paged_attention(AttentionCall(**with_features(args)))
    inf = reference.paged_attention(AttentionCall(**with_features(args, sinks=torch.full((4,), float("-inf")))))
    torch.testing.assert_close(inf, none, atol=0, rtol=0)


# ----------------------------------------------------------------------------- Triton vs reference


def check_triton(args, window=None, softcap=0.0, sinks=None, **options):
    """Triton vs the reference with the features set; ``options`` go to the launcher (e.g. ``num_splits``)."""
    check(with_features(args, window, softcap, sinks), window, **options)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_triton_decode_split_kv(mode):
    # One sequence of 533 tokens split in 2 (and 3) chunks: the sink must be counted once across
    # the splits, and soft-capping must not disturb the reduction's log-sum-exp.
    pytest.importorskip("triton")
    args = make_case([533], [1], 4, 2, 32, mode, page=16, pad_rows=1, seed=11)
    sinks = make_sinks(4)
    check_triton(args, sinks=sinks, num_splits=2)
    check_triton(args, softcap=2.0, window=300, num_splits=2)
    check_triton(args, window=7, softcap=1.0, sinks=sinks, num_splits=3)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_triton_prefill_and_mixed(mode):
    # 7-token prefill, a decode, a chunked prefill and an idle sequence in one batch; GQA 6/2.
    pytest.importorskip("triton")
    args = make_case([7, 30, 21, 5], [7, 1, 6, 0], 6, 2, 32, mode, page=8, pad_rows=3, seed=12)
    sinks = make_sinks(6, seed=1)
    check_triton(args, window=4, softcap=1.5, sinks=sinks)
    check_triton(args, sinks=sinks)
    check_triton(args, window=1)


# ----------------------------------------------------------------------------- validation


def test_op_validates_new_arguments():
    from kvfuse.ops import paged_attention

    args = make_case([9], [2], 4, 2, 16, KVQuantMode.NONE, q_dtype=torch.float32, device="cpu")
    args.pop("sliding_window")
    for bad, pattern in [
        (dict(logit_softcap=-1.0), r"logit_softcap=-1\.0 must be a finite float >= 0"),
        (dict(logit_softcap=float("inf")), r"logit_softcap=inf"),
        (dict(sinks=torch.zeros(4, dtype=torch.bfloat16)), r"sinks must be a float32 tensor of shape \[num_q_heads\]=\[4\].*bfloat16"),
        (dict(sinks=torch.zeros(2)), r"sinks must be .*shape \(2,\)"),
        (dict(sinks=torch.zeros(1, 4)), r"sinks must be .*shape \(1, 4\)"),
        (dict(sinks=torch.zeros(4, device="meta")), r"sinks on meta"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            paged_attention(**args, layer_name="L", **bad)


def test_op_schema_defaults_keep_old_callers_working(reference_backend):
    args = make_case([9, 4], [2, 4], 4, 2, 16, KVQuantMode.NONE, q_dtype=torch.float32, device="cpu")
    old = torch.ops.kvfuse.paged_attention(
        args["query"], args["kv_cache"], args["k_scale"], args["v_scale"], args["block_table"], args["seq_lens"],
        args["query_start_loc"], 0, args["sm_scale"], None, "old")
    torch.testing.assert_close(old, reference.paged_attention(AttentionCall(**args)), atol=0, rtol=0)


def test_opcheck_with_softcap_and_sinks(reference_backend):
    # A bf16 cache: opcheck's schema test compares with allclose, which has no FP8 kernel on CPU.
    args = make_case([9, 4], [2, 4], 4, 2, 16, KVQuantMode.NONE, device="cpu")
    torch.library.opcheck(
        torch.ops.kvfuse.paged_attention.default,
        (args["query"], args["kv_cache"], args["k_scale"], args["v_scale"], args["block_table"], args["seq_lens"],
         args["query_start_loc"], 0, args["sm_scale"], 3, "L", 1.5, make_sinks(4, device="cpu")),
    )


def test_flashinfer_refuses_sinks_clearly():
    from kvfuse.ops import flashinfer as fi_backend

    args = make_case([9], [1], 4, 2, 16, KVQuantMode.NONE, q_dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="sinks.*FlashInfer.*triton"):
        fi_backend.paged_attention(AttentionCall(**with_features(args, sinks=make_sinks(4, device="cpu"))))


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES + [KVQuantMode.FP8_E5M2], ids=lambda m: m.name)
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
def test_triton_gpu_realistic(mode, head_size):
    if mode is KVQuantMode.NVFP4 and head_size % 16:
        pytest.skip("NVFP4 needs head_size % 16 == 0")
    sinks = make_sinks(8)
    # Decode batch (split-KV when small), prefill of 533 tokens, and a mixed batch; GQA 8/2.
    for seq_lens, q_lens in [([533], [1]), ([4097, 7, 1000], [1, 1, 1]), ([533, 7], [533, 7]),
                             ([600, 7, 90], [3, 7, 1])]:
        args = make_case(seq_lens, q_lens, 8, 2, head_size, mode, page=16, pad_rows=5, seed=head_size)
        check_triton(args, sinks=sinks)
        check_triton(args, window=127, softcap=50.0 / math.sqrt(head_size))
        check_triton(args, window=7, softcap=30.0, sinks=sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [KVQuantMode.NONE, KVQuantMode.FP8_E4M3], ids=lambda m: m.name)
def test_flashinfer_gpu_softcap(mode):
    from kvfuse.ops import flashinfer as fi_backend

    if fi_backend.unavailable_reason("paged_attention", "cuda", mode) is not None:
        pytest.skip(fi_backend.unavailable_reason("paged_attention", "cuda", mode))
    for seq_lens, q_lens in [([533, 7, 90], [1, 1, 1]), ([533, 7], [533, 7])]:
        args = make_case(seq_lens, q_lens, 8, 2, 128, mode, page=16, seed=3)
        a = with_features(args, window=64, softcap=20.0)
        fi_backend.clear_plans()
        out = fi_backend.paged_attention(AttentionCall(**a))
        atol, rtol = TOL[args["query"].dtype]
        torch.testing.assert_close(out.cpu().float(), reference_out(a).float(), atol=atol, rtol=rtol)
