"""Prefill that reads the new keys from the step's K/V (kvfuse.ops.triton.prefill) vs the reference."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before the kernels are decorated; CPU-only hosts can only interpret them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kvfuse.kv_cache import KVQuantMode  # noqa: E402
from kvfuse.ops.registry import AttentionCall  # noqa: E402

from test_triton_attention import DEVICE, TOL, gpu, make_case, poison_allocator, reference_out  # noqa: E402

triton = pytest.importorskip("triton")


def step_kv(args):
    """The cache's rows at every query position: the K/V a prefill step wrote (padding rows random)."""
    cache, table = args["kv_cache"], args["block_table"]
    page = cache.shape[2]
    qsl, lens = args["query_start_loc"].tolist(), args["seq_lens"].tolist()
    num_tokens = args["query"].shape[0]
    shape = (num_tokens, cache.shape[3], cache.shape[4])
    key = torch.randn(shape, device=cache.device).to(cache.dtype)
    value = torch.randn(shape, device=cache.device).to(cache.dtype)
    for b, seq_len in enumerate(lens):
        q_start, q_end = qsl[b], qsl[b + 1]
        pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=cache.device)
        blocks = table[b, pos // page].long()
        key[q_start:q_end] = cache[blocks, 0, pos % page]
        value[q_start:q_end] = cache[blocks, 1, pos % page]
    return key, value


def run(args, key, value, **options):
    from kvfuse.ops.triton.attention import paged_attention

    # No split-KV buffers here, so a few times the output's bytes (at D=256, 4099 + 1652 tokens and
    # 32 heads, the paged kernel's 1024x would poison 40 GiB).
    poison_allocator(16 * args["query"].numel())
    call = AttentionCall(**args, key=key, value=value)
    return paged_attention(call, **options)


def tiles_reading(through_descriptors: bool):
    """The default tile table with the new-token tiles (and the interpreter's) reading the query
    and the step's K/V through tensor descriptors or through pointers."""
    return tiles_with(TMA=through_descriptors)


def check(args, tiles=None, whole_context=None, **call_fields):
    args = dict(args, **call_fields)
    key, value = step_kv(args)
    expected = reference_out(args)
    out = run(args, key, value, whole_context=whole_context, **({"tiles": tiles} if tiles is not None else {}))
    atol, rtol = TOL[args["query"].dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=atol, rtol=rtol)
    covered = int(args["query_start_loc"][-1])
    assert torch.all(out[covered:] == 0), "padding rows must be zeros"
    return args, key, value


CPU_CASES = {
    # seq_lens, q_lens: fresh prompts, a chunk on a cached prefix that ends mid-page, a 1-token row.
    "fresh": ([7, 33], [7, 33]),
    "chunked": ([40, 19, 5], [17, 19, 1]),
}


#: The prefix of a bf16 cache: gathered and read through descriptors, or read from the pages.
PREFIXES = {"gathered": True, "pages": False}


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("reads", ["descriptors", "pointers"])
@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("heads,head_size", [((4, 2), 64), ((2, 2), 80), ((6, 2), 32)], ids=str)
def test_matches_reference(case, heads, head_size, reads, prefix):
    from kvfuse.ops.triton import prefill

    seq_lens, q_lens = CPU_CASES[case]
    args = make_case(seq_lens, q_lens, heads[0], heads[1], head_size, KVQuantMode.NONE, pad_rows=3, seed=31)
    tiles = tiles_reading(reads == "descriptors")
    key, value = step_kv(args)
    used = prefill.descriptors(AttentionCall(**args, key=key, value=value), tiles.interpret, head_size) is not None
    assert used == (reads == "descriptors" and head_size != 80)  # 80: no power of two, pointers
    check(args, tiles, PREFIXES[prefix])


@pytest.mark.parametrize("reads", ["descriptors", "pointers"])
def test_prefix_gathered_where_descriptors_read_it(reads, monkeypatch):
    """By default the prefix is gathered (positions before the new tokens only) where descriptors
    read the query and K/V and the gather fits WHOLE_CONTEXT_MAX_BYTES; pointer layouts, larger
    gathers and whole_context=False read the pages."""
    from kvfuse.ops.triton import prefill

    args = make_case([40, 21], [17, 21], 4, 2, 64, KVQuantMode.NONE, seed=35)
    gathers = []
    real = prefill.gather_context
    monkeypatch.setattr(prefill, "gather_context", lambda *a, **k: gathers.append(k) or real(*a, **k))
    tiles = tiles_reading(reads == "descriptors")
    check(args, tiles)
    assert gathers == ([{"prefix_only": True}] if reads == "descriptors" else [])
    gathers.clear()
    check(args, tiles, False)
    monkeypatch.setattr(prefill, "WHOLE_CONTEXT_MAX_BYTES", 0)
    check(args, tiles)
    assert gathers == []


def tiles_with(**fields):
    """The default tile table with ``fields`` set in the new-token tiles and the interpreter's."""
    import dataclasses

    from kvfuse.ops.triton.attention import DEFAULT_TILES

    return dataclasses.replace(
        DEFAULT_TILES, interpret=dataclasses.replace(DEFAULT_TILES.interpret, **fields),
        new_tokens={k: dataclasses.replace(t, **fields) for k, t in DEFAULT_TILES.new_tokens.items()})


@pytest.mark.parametrize("reads", ["descriptors", "pointers"])
@pytest.mark.parametrize("block_n", [16, 32], ids=["keys=queries", "keys=2x queries"])
def test_key_tiles_longer_than_query_tiles_and_query_in_registers(block_n, reads):
    """BLOCK_N = 2 BLOCK_M: the key tile that reaches into a query tile's diagonal starts below
    its first token (odd query tiles), so the masked range starts there; the query held in
    registers is the same query."""
    seq_lens, q_lens = [45, 19, 33], [29, 19, 33]
    args = make_case(seq_lens, q_lens, 4, 2, 64, KVQuantMode.NONE, pad_rows=3, seed=33)
    check(args, tiles_with(BLOCK_M=16, BLOCK_N=block_n, Q_REGISTERS=True, TMA=reads == "descriptors"))


@pytest.mark.parametrize("longest_first", [True, False])
@pytest.mark.parametrize("order", ["heads", "group"])
def test_grid_orders(order, longest_first):
    """GRID_ORDER: however the grid is laid out, every (tile, head) program finds its own rows
    and head."""
    args = make_case([45, 19, 33], [29, 19, 33], 4, 2, 64, KVQuantMode.NONE, pad_rows=3, seed=36)
    check(args, tiles_with(GRID_ORDER=order, LONGEST_FIRST=longest_first))


def test_auto_grid_order_by_l2():
    """auto: heads first while the new tokens' K/V (all heads) fit in half the L2, else tiles;
    on the CPU interpreter (no L2 to speak of) tiles."""
    from kvfuse.ops.triton import prefill

    h100_l2 = 50 * 1024 * 1024
    kv = lambda tokens, element: 2 * tokens * 8 * 128 * element  # noqa: E731 - 8 KV heads, D=128
    assert prefill.auto_grid_order(kv(4096, 2), h100_l2) == "heads"  # bf16 4096 tokens: 16.8 MB
    assert prefill.auto_grid_order(kv(4096, 1), h100_l2) == "heads"  # FP8 codes
    assert prefill.auto_grid_order(kv(16384, 1), h100_l2) == "tiles"  # 33.5 MB
    assert prefill.auto_grid_order(kv(16384, 2), h100_l2) == "tiles"
    tiles = tiles_with(GRID_ORDER="auto")
    args = make_case([45, 19], [29, 19], 4, 2, 64, KVQuantMode.NONE, seed=37)
    key, value = step_kv(args)
    assert prefill.grid_order_for(tiles.interpret, args["query"], key, 2, interpret=True) == "tiles"
    assert prefill.grid_order_for(tiles_with(GRID_ORDER="group").interpret, args["query"], key, 2, True) == "group"
    # A 48-token call's K/V fits any GPU's L2; off CUDA there is none.
    assert prefill.device_grid_order(args["query"], 2, 2) == ("heads" if args["query"].is_cuda else "tiles")
    check(args, tiles)


def test_grid_order_is_validated():
    from kvfuse.ops.triton.attention import Tile

    with pytest.raises(ValueError, match="GRID_ORDER='rows'"):
        Tile(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, GRID_ORDER="rows")


def test_tile_sizes_must_nest():
    from kvfuse.ops.triton import prefill

    tiles = tiles_with(BLOCK_M=32, BLOCK_N=48)
    with pytest.raises(ValueError, match="one of BLOCK_M and BLOCK_N must divide the other"):
        prefill._tile(tiles, 64, False, interpret=False)


def test_descriptors_only_for_layouts_they_describe():
    """Descriptors cover row-major [tokens, heads * head_size] views with 16-byte aligned rows and
    base, including K/V sliced out of a fused QKV projection; anything else reads through pointers,
    and both give the reference's output."""
    import dataclasses

    from kvfuse.ops.triton import prefill

    tile = tiles_reading(True).interpret
    args = make_case([7, 33], [7, 33], 4, 2, 64, KVQuantMode.NONE, pad_rows=3, seed=39)
    key, value = step_kv(args)
    qkv = torch.cat([args["query"], key, value], dim=1)  # [T, 4 + 2 + 2, 64], one projection's output
    fused = dict(args, query=qkv[:, :4])
    call = AttentionCall(**fused, key=qkv[:, 4:6], value=qkv[:, 6:])
    assert prefill.descriptors(call, tile, 64) is not None
    torch.testing.assert_close(run(fused, qkv[:, 4:6], qkv[:, 6:], tiles=tiles_reading(True)).cpu().float(),
                               reference_out(args).float(), atol=3e-2, rtol=3e-2)

    head_major = args["query"].transpose(0, 1).contiguous().transpose(0, 1)
    shifted = torch.empty(key.numel() + 4, dtype=key.dtype, device=key.device)[4:].view(key.shape)  # 8-byte base
    shifted.copy_(key)
    refused = {
        "head-major query": AttentionCall(**dict(args, query=head_major), key=key, value=value),
        "misaligned key base": AttentionCall(**args, key=shifted, value=value),
        "no tokens": AttentionCall(**dict(args, query=args["query"][:0]), key=key[:0], value=value[:0]),
    }
    for why, refused_call in refused.items():
        assert prefill.descriptors(refused_call, tile, 64) is None, why
    assert prefill.descriptors(AttentionCall(**args, key=key, value=value), dataclasses.replace(tile, TMA=False),
                               64) is None
    torch.testing.assert_close(run(args, shifted, value, tiles=tiles_reading(True)).cpu().float(),
                               reference_out(args).float(), atol=3e-2, rtol=3e-2)


def test_reads_new_keys_from_the_step_and_the_prefix_from_pages():
    """Rows of the step's K/V changed after the write: the kernel's output is the reference over a
    cache holding the changed rows, so the new keys come from the step and only the prefix from pages
    (the op's contract keeps them equal; this shows which one each part reads)."""
    args = make_case([40, 21], [17, 21], 4, 2, 64, KVQuantMode.NONE, seed=32)
    key, value = step_kv(args)
    key, value = key * 1.5, value - 0.25
    out = run(args, key, value)
    changed = dict(args, kv_cache=args["kv_cache"].clone())
    cache, table, page = changed["kv_cache"], args["block_table"], args["kv_cache"].shape[2]
    for b, (seq_len, q_start, q_end) in enumerate(zip([40, 21], [0, 17], [17, 38])):
        pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=cache.device)
        blocks = table[b, pos // page].long()
        cache[blocks, 0, pos % page] = key[q_start:q_end]
        cache[blocks, 1, pos % page] = value[q_start:q_end]
    expected = reference_out(changed)
    assert not torch.allclose(expected.float(), reference_out(args).float(), atol=0.1)
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("reads", ["descriptors", "pointers"])
def test_softcap_and_sinks(reads):
    args = make_case([29, 40], [29, 9], 4, 2, 64, KVQuantMode.NONE, seed=33)
    sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf")], device=DEVICE)
    check(args, tiles_reading(reads == "descriptors"), logit_softcap=5.0, sinks=sinks)


def test_fp16_queries():
    args = make_case([23], [23], 2, 1, 64, KVQuantMode.NONE, q_dtype=torch.float16, seed=34)
    check(args)


@pytest.mark.parametrize("fields", [dict(sliding_window=8), dict(kv_quant_mode=int(KVQuantMode.FP8_E4M3)),
                                    dict(kv_quant_mode=int(KVQuantMode.FP8_PER_TOKEN_HEAD))],
                         ids=["window", "fp8", "fp8_per_token_head"])
def test_other_calls_do_not_read_the_step_kv(fields):
    """Sliding windows and quantized caches are not taken by the step-K/V kernel (takes() says so),
    and decode-sized batches neither: the step's K/V are not read. FP8 e4m3 prefill goes to the
    gathered path (takes_cached), per-token-head FP8 and windows to the paged kernel."""
    from kvfuse.ops.triton import prefill

    mode = KVQuantMode(fields.get("kv_quant_mode", int(KVQuantMode.NONE)))
    args = make_case([30, 12], [30, 12], 4, 2, 64, mode, seed=35)
    args.update(fields)
    key = torch.full((42, 2, 64), float("nan"), device=DEVICE).to(torch.bfloat16)  # poison: must not be read
    call = AttentionCall(**args, key=key, value=key)
    assert not prefill.takes(call, decode=False)
    assert prefill.takes_cached(call, decode=False) == (mode is KVQuantMode.FP8_E4M3 and "sliding_window" not in fields)
    out = run(args, key, key, fp8_dots=False)
    torch.testing.assert_close(out.cpu().float(), reference_out(args).float(), atol=3e-2, rtol=3e-2)
    decode = make_case([30, 12], [1, 1], 4, 2, 64, KVQuantMode.NONE, seed=36)
    nan = torch.full((2, 2, 64), float("nan"), device=DEVICE).to(torch.bfloat16)
    out = run(decode, nan, nan)
    assert not torch.isnan(out).any()


def test_op_validates_and_checks_the_step_kv():
    import kvfuse.ops  # noqa: F401  (registers the ops)
    from kvfuse.ops.checks import checked

    args = make_case([20, 9], [20, 9], 4, 2, 64, KVQuantMode.NONE, seed=37)
    key, value = step_kv(args)
    op_args = [args[k] for k in ("query", "kv_cache", "k_scale", "v_scale", "block_table", "seq_lens",
                                 "query_start_loc", "kv_quant_mode", "sm_scale", "sliding_window")]
    op = torch.ops.kvfuse.paged_attention
    with pytest.raises(ValueError, match="key and value are given together"):
        op(*op_args, "layers.0", 0.0, None, key, None)
    with pytest.raises(ValueError, match=r"key must be the step's keys, \[num_tokens, num_kv_heads, head_size\]"):
        op(*op_args, "layers.0", 0.0, None, key[:, :1], value)
    with pytest.raises(ValueError, match="value must be .* got torch.float32"):
        op(*op_args, "layers.0", 0.0, None, key, value.float())
    wrong = value.clone()
    wrong[21, 1, 3] += 1
    with checked(), pytest.raises(ValueError, match=r"value\[21\] differs from the cache row it was written to "
                                                    r"\(sequence 1, position 1\)"):
        op(*op_args, "layers.0", 0.0, None, key, wrong)
    with checked():
        out = op(*op_args, "layers.0", 0.0, None, key, value)
    torch.testing.assert_close(out.cpu().float(), reference_out(args).float(), atol=3e-2, rtol=3e-2)


def test_opcheck_with_step_kv():
    import kvfuse.ops  # noqa: F401

    args = make_case([20, 9], [12, 9], 4, 2, 64, KVQuantMode.NONE, seed=38)
    key, value = step_kv(args)
    op_args = (args["query"], args["kv_cache"], args["k_scale"], args["v_scale"], args["block_table"],
               args["seq_lens"], args["query_start_loc"], args["kv_quant_mode"], args["sm_scale"], None, "layers.0",
               0.0, None, key, value)
    torch.library.opcheck(torch.ops.kvfuse.paged_attention.default, op_args)


# ----------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("reads", ["descriptors", "pointers"])
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
def test_gpu_fresh_and_chunked(head_size, reads, prefix):
    args = make_case([4099, 533, 7, 1100], [4099, 533, 7, 512], 32, 8, head_size, KVQuantMode.NONE, pad_rows=5,
                     seed=40)
    check(args, tiles_reading(reads == "descriptors"), PREFIXES[prefix])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2),
                                  (64, 64, 4, 3, "heads"), (64, 64, 4, 3, "group")], ids=str)
def test_gpu_tiles_with_query_in_registers(tile):
    """The tiles benchmarks/attention.py sweeps with the query held in registers (the last two
    in the other grid orders)."""
    block_m, block_n, warps, stages, *order = tile
    args = make_case([4099, 533, 7, 1100], [4099, 533, 7, 512], 32, 8, 128, KVQuantMode.NONE, pad_rows=5, seed=42)
    check(args, tiles_with(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, Q_REGISTERS=True,
                           TMA=True, GRID_ORDER=order[0] if order else "tiles"))


@gpu
@pytest.mark.gpu
def test_gpu_softcap_sinks_fp16():
    args = make_case([700, 1300], [700, 300], 16, 4, 128, KVQuantMode.NONE, q_dtype=torch.float16, seed=41)
    sinks = torch.linspace(-2, 2, 16, device=DEVICE)
    check(args, logit_softcap=30.0, sinks=sinks)


@pytest.mark.parametrize("with_step_kv", [True, False], ids=["new-token kernel", "paged kernel"])
def test_head_major_query_gives_a_contiguous_output(with_step_kv):
    """A query that is a transposed view (head-major storage, as ``q.transpose(1, 2)`` of a
    [B, H, T, D] projection leaves it) still gets the row-major output the op's fake promises;
    an output laid out like the query failed Inductor's stride assertion on the GPU."""
    args = make_case([7, 33], [7, 33], 4, 2, 64, KVQuantMode.NONE, pad_rows=3, seed=34)
    q = args["query"]
    head_major = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert head_major.stride(0) == q.shape[2] and not head_major.is_contiguous()
    args = dict(args, query=head_major)
    key, value = step_kv(args) if with_step_kv else (None, None)
    out = run(args, key, value)
    assert out.shape == q.shape and out.stride() == q.contiguous().stride()
    atol, rtol = TOL[q.dtype]
    torch.testing.assert_close(out.cpu().float(), reference_out(args).float(), atol=atol, rtol=rtol)
