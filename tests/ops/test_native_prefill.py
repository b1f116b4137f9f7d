"""The native prefill kernel (csrc/cuda/prefill_attention.cu) vs the reference, on an sm_90 GPU.

Caches are NaN-poisoned and scattered (make_case); the step's K/V are the cache's rows at the query
positions (step_kv), with random padding rows; the allocator is poisoned with NaN so that an
unwritten output row shows up. What the kernel refuses is checked on the CPU in test_native.py.
"""

from __future__ import annotations

import pytest
import torch

from kvfuse.kv_cache import KVQuantMode
from kvfuse.ops import native
from kvfuse.ops.registry import AttentionCall
from test_new_token_prefill import step_kv
from test_quantized_prefill import assert_unit_values_come_back, fp8_dots_bound, unit_values_case
from test_triton_attention import TOL, make_case, poison_allocator, reference_out

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", autouse=True)
def hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the native prefill kernel is built for sm_90")
    reason = native.unavailable_reason("paged_attention", "cuda", int(KVQuantMode.NONE))
    if reason is not None:
        pytest.fail(f"the native attention kernels are unavailable on this GPU host: {reason}")


def check(args, grid_order=None, through_op=False, **call_fields):
    """The kernel (or, ``through_op``, the backend's paged_attention) against the reference."""
    args = dict(args, **call_fields)
    mode = KVQuantMode(args["kv_quant_mode"])
    if mode is KVQuantMode.NONE:
        key, value = step_kv(args)
        call = AttentionCall(**args, key=key, value=value)
    else:
        call = AttentionCall(**args)
    assert native.prefill_refusal(call) is None
    expected = reference_out(args)
    poison_allocator(16 * args["query"].numel() * 2)
    out = native.paged_attention(call) if through_op else native.prefill_attention(call, grid_order=grid_order)
    assert out.shape == args["query"].shape and out.dtype == args["query"].dtype
    covered = int(args["query_start_loc"][-1])
    if mode is KVQuantMode.FP8_E4M3:
        # FP8 products (query and P rounded to e4m3): the bound stated for Triton's FP8 dots.
        err = (out.cpu().float()[:covered] - expected.float()[:covered]).abs()
        mean_bound, max_bound = fp8_dots_bound(args)
        assert err.mean() <= mean_bound and err.max() <= max_bound, (err.mean(), mean_bound, err.max(), max_bound)
    else:
        atol, rtol = TOL[args["query"].dtype]
        torch.testing.assert_close(out.cpu().float(), expected.float(), atol=atol, rtol=rtol)
    assert torch.all(out[covered:] == 0), "padding rows must be zeros"
    return out


# (seq_lens, q_lens): fresh prompts of odd lengths; chunks over prefixes that end mid-page and
# mid-tile, a 1-token row beside long ones; a prefix of exactly one key tile.
CASES = {
    "fresh": ([7, 533, 4099], [7, 533, 4099]),
    "chunked": ([40, 1000, 700, 5], [17, 533, 129, 1]),
    "prefix_one_tile": ([128 + 300], [300]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [(8, 8), (16, 2), (12, 4)], ids=str)
@pytest.mark.parametrize("grid_order", ["heads", "tiles"])
def test_bf16_matches_reference(case, heads, grid_order):
    seq_lens, q_lens = CASES[case]
    args = make_case(seq_lens, q_lens, heads[0], heads[1], 128, KVQuantMode.NONE, pad_rows=3, seed=41)
    check(args, grid_order)


@pytest.mark.parametrize("case", ["fresh", "chunked"])
def test_fp16(case):
    seq_lens, q_lens = CASES[case]
    args = make_case(seq_lens, q_lens, 8, 2, 128, KVQuantMode.NONE, q_dtype=torch.float16, pad_rows=2, seed=43)
    check(args)


@pytest.mark.parametrize("mode", [KVQuantMode.NVFP4, KVQuantMode.FP8_E5M2], ids=lambda m: m.name)
@pytest.mark.parametrize("case", ["fresh", "chunked"])
def test_decoded_caches_match_reference(mode, case):
    """e5m2 / NVFP4 caches: the whole context gathered, decoded, with the cache's scales."""
    seq_lens, q_lens = CASES[case]
    args = make_case(seq_lens, q_lens, 8, 2, 128, mode, pad_rows=3, seed=47)
    check(args)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [(8, 8), (16, 2)], ids=str)
def test_fp8_e4m3_within_the_stated_bound(case, heads, q_dtype):
    """e4m3 caches: FP8 tensor-core products over the gathered codes (values in the permuted
    column order), within the error bound stated for FP8 dots."""
    seq_lens, q_lens = CASES[case]
    args = make_case(seq_lens, q_lens, heads[0], heads[1], 128, KVQuantMode.FP8_E4M3, q_dtype=q_dtype, pad_rows=3,
                     seed=49)
    check(args)


# A long context beside a short one.
LONG_FP8 = ([8300, 900], [700, 533])


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_e4m3_long_context_within_the_stated_bound(q_dtype):
    args = make_case(*LONG_FP8, 8, 2, 128, KVQuantMode.FP8_E4M3, q_dtype=q_dtype, pad_rows=3, seed=67)
    check(args)
    sinks = torch.linspace(-2.0, 4.0, 8, device="cuda")
    sinks[3] = float("-inf")
    check(args, sinks=sinks)


# (seq_lens, q_lens, max |out - 1|, |mean(out - 1)|): see the test's docstring.
CONSTANT_VALUE_CASES = {
    "long_context": (*LONG_FP8, 2.0**-6, 5e-3),
    "fresh_prompt": ([4099, 900], [4099, 533], 2.0**-6, 5e-3),
}


@pytest.mark.parametrize("case", CONSTANT_VALUE_CASES)
def test_fp8_e4m3_constant_values_come_back(case):
    """Every value 1: the output is sum(P V) over the normaliser, 1 up to how each is summed. P is
    rounded to e4m3 without bias, and the tensor-core row sums add the same rounded P as the P V
    product (summing P in the softmax instead, before rounding, left outputs up to 0.03 off:
    BENCHMARKS.md). What moves the mean is the P V product's own
    accumulation: e4m3 products keep fewer bits than fp32 and each k-step truncates, so O summed
    across every tile of a long context inside the products came out 5% low at 8300 keys and 2%
    low at 4099 (BENCHMARKS.md, twenty-seventh session); one tile per product, summed in fp32, it
    stays within the bound. A tile missed or counted twice moves the mean by about 1/65."""
    seq_lens, q_lens, max_bound, mean_bound = CONSTANT_VALUE_CASES[case]
    args = unit_values_case(seq_lens, q_lens, seed=71)
    poison_allocator(16 * args["query"].numel() * 2)
    out = native.prefill_attention(AttentionCall(**args))
    assert_unit_values_come_back(args, out, max_bound, mean_bound)


# Each sequence's value rows by key position (fraction f of its length): 2 for the older half and 0
# for the newer, the reverse, or 4 f.
POSITIONAL_VALUES = {
    "step_older": lambda f: (f < 0.5).float() * 2,
    "step_newer": lambda f: (f >= 0.5).float() * 2,
    "ramp": lambda f: 4 * f,
}


@pytest.mark.parametrize("values", POSITIONAL_VALUES)
@pytest.mark.parametrize("case", CONSTANT_VALUE_CASES)
def test_fp8_e4m3_position_dependent_values_carry_no_bias(case, values):
    """Values that change with the key's position, so that O's accumulators and the row sums'
    grow differently across a long context. Each row's signed error, relative to its output's
    magnitude, averages within 2e-3 of zero. The e4m3 products truncate at every k-step. A build
    in which one product sums O (and another the row sums) across every tile loses different
    fractions of the two here: it failed all six cases, with mean biases of 0.6 to 1.2% in
    magnitude for the 4099-token prompt and 1.2 to 2.6% for the 8300-key context, while the
    two-level accumulation passes them (BENCHMARKS.md, thirty-second session). Constant values
    cannot show this: there O's columns and the row sums are the same sums."""
    seq_lens, q_lens = CONSTANT_VALUE_CASES[case][:2]
    args = make_case(seq_lens, q_lens, 8, 2, 128, KVQuantMode.FP8_E4M3, pad_rows=3, seed=83)
    cache, page = args["kv_cache"], args["kv_cache"].shape[2]
    rows = cache[:, 1].float()
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n, device=cache.device)
        blocks = args["block_table"][b][pos // page].long()
        rows[blocks, pos % page] = POSITIONAL_VALUES[values](pos.float() / n)[:, None, None].expand(-1, *rows.shape[2:])
    cache[:, 1] = rows.to(cache.dtype)
    expected = reference_out(args).float()
    poison_allocator(16 * args["query"].numel() * 2)
    out = native.prefill_attention(AttentionCall(**args)).float().cpu()
    covered = int(args["query_start_loc"][-1])
    signed = (out[:covered] - expected[:covered]).sum(-1) / expected[:covered].abs().sum(-1).clamp_min(1e-6)
    assert abs(signed.mean().item()) <= 2e-3, signed.mean().item()
    assert torch.all(out[covered:] == 0), "padding rows must be zeros"


@pytest.mark.parametrize("query_mult, k_scale", [(1e-3, 0.5), (40.0, 0.5), (1.0, 2e-3), (1.0, 30.0)], ids=str)
def test_fp8_e4m3_f16_scores_at_extreme_scales(query_mult, k_scale):
    """The e4m3 kernel accumulates S in f16. Each query row's multiplier keeps |S| under f16's
    range whatever the query's and the keys' scales (a multiplier onto e4m3's own range, 448 / max
    |q|, would allow |S| up to 128 * 448 * 448), and the score scale it leaves is a power of two.
    Tiny and large queries and key scales stay finite and within the stated bound, on a long
    context beside a shorter chunk."""
    args = make_case([8300, 900], [700, 533], 8, 2, 128, KVQuantMode.FP8_E4M3, pad_rows=3, seed=89)
    args["query"] = args["query"] * query_mult
    args["k_scale"] = torch.tensor(k_scale, device="cuda")
    out = check(args)
    assert torch.isfinite(out).all()


def test_fp8_e4m3_no_less_accurate_than_triton_fp8_dots():
    """Both kernels round the query row-wise and P as 2^8 p to e4m3 (P against each one's own
    running max, so their roundings differ): the native kernel's error against the reference is
    of the size of the Triton kernel's."""
    from kvfuse.ops.triton.attention import paged_attention as triton_attention

    args = make_case([1000, 533], [600, 533], 8, 2, 128, KVQuantMode.FP8_E4M3, seed=50)
    expected = reference_out(args).float()
    out = check(args).float().cpu()
    other = triton_attention(AttentionCall(**args), fp8_dots=True).float().cpu()
    err, other_err = (out - expected).abs().mean(), (other - expected).abs().mean()
    assert err <= 1.25 * other_err, (err, other_err)


def test_per_head_scales():
    args = make_case([700, 300], [300, 300], 8, 4, 128, KVQuantMode.NVFP4, seed=53)
    args["k_scale"] = torch.tensor([0.05, 0.1, 0.2, 0.4], device="cuda")
    args["v_scale"] = torch.tensor([0.3, 0.1, 0.2, 0.05], device="cuda")
    check(args)


def test_sinks():
    args = make_case([900, 260], [533, 260], 8, 2, 128, KVQuantMode.NONE, pad_rows=1, seed=59)
    sinks = torch.linspace(-3.0, 6.0, 8, device="cuda")
    sinks[1] = float("-inf")
    check(args, sinks=sinks)
    fp8 = make_case([900, 260], [533, 260], 8, 2, 128, KVQuantMode.FP8_E4M3, pad_rows=1, seed=59)
    check(fp8, sinks=sinks)


def test_sequence_shorter_than_its_new_tokens_gives_zero_rows():
    """seq_len < q_len (metadata checked mode refuses): that sequence's rows are zeros, as the
    Triton kernel's, in NaN-poisoned memory; the other sequences are still right."""
    args = make_case([700, 300], [300, 300], 8, 2, 128, KVQuantMode.NONE, seed=73)
    key, value = step_kv(args)
    expected = reference_out(args).float()
    short = dict(args, seq_lens=args["seq_lens"].clone())
    short["seq_lens"][1] = 200
    poison_allocator(16 * args["query"].numel() * 2)
    out = native.prefill_attention(AttentionCall(**short, key=key, value=value)).cpu().float()
    assert torch.all(out[300:600] == 0)
    atol, rtol = TOL[args["query"].dtype]
    torch.testing.assert_close(out[:300], expected[:300], atol=atol, rtol=rtol)


def test_large_scores_stay_finite():
    """Scores far beyond exp's range (a scaled query) still give the reference's softmax."""
    args = make_case([600], [600], 4, 2, 128, KVQuantMode.NONE, seed=61)
    args["query"] = args["query"] * 40
    check(args)


def test_backend_routes_prefill_here(monkeypatch):
    """native.paged_attention sends prefill-shaped calls it takes to this kernel, others to Triton."""
    seen = []
    real = native.prefill_attention
    monkeypatch.setattr(native, "prefill_attention", lambda call, **k: seen.append(call) or real(call, **k))
    args = make_case([300, 200], [300, 100], 8, 2, 128, KVQuantMode.NONE, seed=67)
    check(args, through_op=True)
    assert len(seen) == 1
    # A sliding window goes to Triton.
    check_window = dict(args, sliding_window=64)
    key, value = step_kv(check_window)
    out = native.paged_attention(AttentionCall(**check_window, key=key, value=value))
    torch.testing.assert_close(out.cpu().float(), reference_out(check_window).float(), atol=3e-2, rtol=3e-2)
    assert len(seen) == 1


def test_capture_in_a_cuda_graph():
    args = make_case([1000, 333], [500, 333], 8, 2, 128, KVQuantMode.NONE, seed=71)
    key, value = step_kv(args)
    call = AttentionCall(**args, key=key, value=value)
    expected = native.prefill_attention(call)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        native.prefill_attention(call)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = native.prefill_attention(call)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
