"""Triton paged attention vs the pure-PyTorch reference (CPU interpreter: tiny; H100: realistic)."""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    # Must be set before the kernels are decorated; CPU-only hosts can only interpret them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kvfuse.kv_cache import KVQuantMode, row_dim_for, storage_dtype  # noqa: E402
from kvfuse.ops import reference  # noqa: E402
from kvfuse.ops import registry as backends  # noqa: E402
from kvfuse.ops.registry import AttentionCall  # noqa: E402

triton = pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")

# Output tolerances by query dtype (the kernel rounds probabilities to it before P @ V).
TOL = {torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3), torch.float32: (2e-4, 2e-4)}


def nan_fill(cache: torch.Tensor, mode: KVQuantMode) -> None:
    """Fill a cache with NaN bit patterns, so any read of a never-written slot poisons the output."""
    if mode is KVQuantMode.NVFP4:
        cache.fill_(0x77)  # packed codes: +-4 (finite); scale bytes 0x7F patched below
        num_blocks, _, page, heads, row_dim = cache.shape
        # Each page side ends with its block-scale region (kvfuse.kv_cache.nvfp4_page_index).
        cache.view(num_blocks, 2, -1)[..., page * heads * (row_dim * 8 // 9):] = 0x7F  # e4m3 NaN
    else:
        cache.view(torch.uint8).fill_(0xFF)  # NaN in bf16/fp16/fp32/e4m3/e5m2


def scattered_block_table(seq_lens, page, spare_blocks, gen):
    """``(num_blocks, block_table)``: each sequence's pages drawn from one permutation of the
    cache's blocks (``spare_blocks`` of them owned by nobody), and every entry past a sequence's
    last page out of range on purpose, so that a kernel reading one faults or reads garbage."""
    blocks_per_seq = [max(1, math.ceil(s / page)) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), 10**6, dtype=torch.int32)
    first = 0
    for b, n in enumerate(blocks_per_seq):
        block_table[b, :n] = perm[first:first + n].to(torch.int32)
        first += n
    return num_blocks, block_table


def make_case(seq_lens, q_lens, num_q_heads, num_kv_heads, head_size, mode, *, page=16, q_dtype=torch.bfloat16,
              cache_native=None, pad_rows=0, device=DEVICE, scale=(0.7, 1.3), seed=0):
    """A scattered, NaN-poisoned paged cache holding exactly ``seq_lens`` tokens per sequence."""
    gen = torch.Generator().manual_seed(seed)
    mode = KVQuantMode(mode)
    num_blocks, block_table = scattered_block_table(seq_lens, page, 3, gen)
    cdtype = storage_dtype(mode, cache_native or q_dtype)
    cache = torch.empty((num_blocks, 2, page, num_kv_heads, row_dim_for(mode, head_size)), dtype=cdtype)
    nan_fill(cache, mode)
    k_scale = torch.tensor(scale[0] if mode is not KVQuantMode.NONE else 1.0, dtype=torch.float32)
    v_scale = torch.tensor(scale[1] if mode is not KVQuantMode.NONE else 1.0, dtype=torch.float32)
    if mode is KVQuantMode.NVFP4:
        k_scale, v_scale = k_scale / 8, v_scale / 8
    for b, s in enumerate(seq_lens):
        if s == 0:
            continue
        pos = torch.arange(s)
        slots = block_table[b, pos // page].long() * page + pos % page
        k = torch.randn(s, num_kv_heads, head_size, generator=gen) * 2
        v = torch.randn(s, num_kv_heads, head_size, generator=gen) * 2
        reference.encode_and_cache_write(k.to(q_dtype), v.to(q_dtype), cache, slots, k_scale, v_scale, mode)
    total = sum(q_lens)
    query = torch.randn(total + pad_rows, num_q_heads, head_size, generator=gen).to(q_dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    args = dict(
        query=query, kv_cache=cache, k_scale=k_scale, v_scale=v_scale, block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl, kv_quant_mode=int(mode),
        sm_scale=1.0 / math.sqrt(head_size), sliding_window=None,
    )
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def reference_out(args):
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    return reference.paged_attention(AttentionCall(**cpu))


def poison_allocator(nbytes: int) -> None:
    """Leave NaN in the CUDA caching allocator's free blocks, so unwritten outputs show up."""
    if ON_GPU:
        junk = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
        del junk


def check(args, window=None, **options):
    """Triton vs the reference; ``options`` go to the launcher (tiles, num_splits, inline_asm, ...)."""
    from kvfuse.ops.triton.attention import paged_attention

    args = dict(args, sliding_window=window)
    expected = reference_out(args)
    poison_allocator(8 * args["query"].numel() * 4 * 32)
    # FP8 e4m3 prefill defaults to FP8 dots, whose bound test_new_token_prefill.py states and tests;
    # here every format is held to the query dtype's tolerance.
    options.setdefault("fp8_dots", False)
    out = paged_attention(AttentionCall(**args), **options)
    assert out.shape == args["query"].shape and out.dtype == args["query"].dtype
    atol, rtol = TOL[args["query"].dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=atol, rtol=rtol)
    covered = int(args["query_start_loc"][-1])
    assert torch.all(out[covered:] == 0), "padding rows must be zeros"
    return out


# ----------------------------------------------------------------------------- CPU (interpreter) + GPU

MODES = [KVQuantMode.NONE, KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2, KVQuantMode.NVFP4,
         KVQuantMode.FP8_PER_TOKEN_HEAD]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (2, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_decode_matches_reference(mode, heads):
    args = make_case([1, 17, 40], [1, 1, 1], heads[0], heads[1], 32, mode, page=8, pad_rows=2)
    check(args)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_mixed_prefill_decode_with_window(mode):
    # Sequence 0: a fresh prefill; 1: one decode token; 2: no new tokens; 3: chunked prefill.
    args = make_case([19, 23, 9, 30], [19, 1, 0, 6], 4, 2, 32, mode, page=8, pad_rows=3, seed=1)
    check(args)
    check(args, window=7)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_single_sequence_split_kv(mode):
    # One sequence, its context split in 2 and 3 chunks, then reduced.
    args = make_case([45], [1], 8, 2, 64, mode, page=16, pad_rows=1, seed=2)
    check(args, num_splits=2)
    check(args, window=20, num_splits=3)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32], ids=str)
def test_query_dtypes(q_dtype):
    args = make_case([13, 33], [13, 2], 4, 2, 32, KVQuantMode.NONE, page=8, q_dtype=q_dtype, seed=3)
    check(args)
    args = make_case([13, 33], [3, 1], 4, 2, 32, KVQuantMode.FP8_E4M3, page=8, q_dtype=q_dtype, seed=4)
    check(args)


def test_head_size_80_and_page_size_1():
    args = make_case([5, 12], [2, 1], 2, 1, 80, KVQuantMode.NONE, page=1, seed=5)
    check(args)


@pytest.mark.parametrize("head_size", [16, 48, 80])
def test_nvfp4_head_sizes_multiple_of_16(head_size):
    # Non-power-of-two rows: padded nibble tiles, block scales gathered per byte.
    args = make_case([5, 27], [1, 3], 4, 2, head_size, KVQuantMode.NVFP4, page=8, pad_rows=1, seed=6)
    check(args)


@pytest.mark.parametrize("word_scales", [False, True], ids=["bytes", "words"])
@pytest.mark.parametrize("scale_gather", [True, False], ids=["gather", "broadcast"])
def test_nvfp4_scale_paths(scale_gather, word_scales):
    # Both ways of applying block scales (per-byte gather, [N, NB, 1] broadcast + reshape), each
    # with the scale bytes read one by one or through their aligned 32-bit words.
    from kvfuse.ops.triton import attention as ta

    tiles = ta.DEFAULT_TILES.replace(SCALE_GATHER=scale_gather, WORD_SCALES=word_scales)
    args = make_case([40, 9], [1, 9], 8, 2, 64, KVQuantMode.NVFP4, page=8, pad_rows=1, seed=8)
    check(args, tiles=tiles)
    check(args, window=5, tiles=tiles)


@pytest.mark.parametrize("page,head_size", [(5, 80), (4, 64), (8, 48)])
def test_nvfp4_word_scales_at_odd_pages(page, head_size):
    # Page sides whose scale regions start off 4-byte boundaries (page 5, D=80: 450-byte page
    # sides), linear and interleaved V scales: every scale byte comes out of the right word.
    from kvfuse.ops.triton import attention as ta

    tiles = ta.DEFAULT_TILES.replace(WORD_SCALES=True)
    args = make_case([1, 13, 9], [1, 2, 9], 4, 1, head_size, KVQuantMode.NVFP4, page=page, pad_rows=1, seed=31)
    cache = args["kv_cache"]
    # The same bytes in a storage with room for the word that holds the cache's last byte (the
    # word path) and in one that ends with the cache (the byte path wherever that word straddles).
    roomy = torch.empty(cache.numel() + 4, dtype=torch.uint8, device=cache.device)[:cache.numel()].view(cache.shape)
    roomy.copy_(cache)
    exact = torch.empty(cache.numel(), dtype=torch.uint8, device=cache.device).view(cache.shape)
    exact.copy_(cache)
    assert ta._words_inside_storage(roomy)
    assert ta._words_inside_storage(exact) == (cache.numel() % 4 == 0)
    for kv_cache in (roomy, exact):
        check(dict(args, kv_cache=kv_cache), tiles=tiles)
        check(dict(args, kv_cache=kv_cache), window=6, tiles=tiles)


def test_words_inside_storage():
    from kvfuse.ops.triton.attention import _words_inside_storage

    whole = torch.zeros(2 * 2 * 5 * 45, dtype=torch.uint8)
    assert _words_inside_storage(whole.view(2, 2, 5, 1, 45))  # 900 bytes: whole words
    half = torch.zeros(2 * 5 * 45, dtype=torch.uint8)
    assert not _words_inside_storage(half.view(1, 2, 5, 1, 45))  # 450 bytes: the last word straddles the end
    padded = torch.zeros(2 * 5 * 45 + 2, dtype=torch.uint8)
    assert _words_inside_storage(padded[:450].view(1, 2, 5, 1, 45))  # the storage holds the straddling word
    shifted = torch.zeros(904, dtype=torch.uint8)
    assert not _words_inside_storage(shifted[2:902].view(2, 2, 5, 1, 45))  # not 4-byte aligned


@pytest.mark.parametrize("mode", [KVQuantMode.FP8_E4M3, KVQuantMode.FP8_E5M2, KVQuantMode.NVFP4,
                                  KVQuantMode.FP8_PER_TOKEN_HEAD],
                         ids=lambda m: m.name)
def test_quantized_cache_with_query_beyond_fp16_range(mode):
    # Quantized caches run fp16 dots; a bf16 query past fp16's max (65504) must be rescaled, not inf.
    args = make_case([21, 6], [1, 2], 4, 2, 32, mode, page=8, seed=9)
    args["query"] = args["query"] * 3e5
    args["sm_scale"] = 1e-6
    assert args["query"].abs().max() > 65504
    check(args)


@pytest.mark.parametrize("fields", [{"KEYS_FIRST": True}, {"PREFETCH_PAGES": True}, {"LONGEST_FIRST": True}],
                         ids=lambda f: next(iter(f)))
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_key_loop_variants(mode, fields):
    # KEYS_FIRST computes the scores as (K @ q^T)^T; PREFETCH_PAGES reads the next tile's
    # block-table entries one iteration ahead; LONGEST_FIRST runs the query tiles in reverse.
    # Several iterations per range (interpreter tiles of 16 keys): decode, split-KV, prefill,
    # windows.
    from kvfuse.ops.triton import attention as ta

    tiles = ta.DEFAULT_TILES.replace(**fields)
    check(make_case([1, 17, 40], [1, 1, 1], 4, 1, 32, mode, page=8, pad_rows=2, seed=23), tiles=tiles)
    check(make_case([45], [1], 8, 2, 32, mode, page=16, pad_rows=1, seed=24), window=20, tiles=tiles, num_splits=2)
    check(make_case([19, 50], [19, 6], 4, 2, 32, mode, page=8, pad_rows=1, seed=25), window=7, tiles=tiles)
    check(make_case([19, 50], [19, 6], 4, 2, 32, mode, page=8, pad_rows=1, seed=26), tiles=tiles)


def test_through_op_with_forced_backend(monkeypatch):
    monkeypatch.setenv("KVFUSE_ATTENTION_BACKEND", "triton")
    backends.clear_cache()
    try:
        args = make_case([9, 21], [1, 4], 4, 2, 32, KVQuantMode.FP8_E4M3, page=8, pad_rows=1, seed=7)
        name, _ = backends.select("paged_attention", DEVICE, KVQuantMode.FP8_E4M3)
        assert name == "triton"
        out = torch.ops.kvfuse.paged_attention(*args.values(), "layers.0")
        expected = reference_out(args)
        torch.testing.assert_close(out.cpu().float(), expected.float(), atol=3e-2, rtol=3e-2)
    finally:
        backends.clear_cache()


# ----------------------------------------------------------------------------- GPU, realistic shapes


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("head_size,heads", [(64, (32, 8)), (128, (32, 8)), (256, (32, 8)), (128, (8, 8)),
                                             (128, (32, 4))], ids=str)
def test_gpu_decode(mode, head_size, heads):
    args = make_case([1, 533, 4097, 1999, 31], [1] * 5, heads[0], heads[1], head_size, mode, pad_rows=3, seed=11)
    check(args)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_gpu_long_context_small_batch(mode):
    # 32k context, batch 1 and 2: the split-KV + reduce path.
    args = make_case([32768 - 5], [1], 32, 8, 128, mode, seed=12)
    check(args)
    args = make_case([32768, 7001], [1, 1], 32, 8, 128, mode, seed=13)
    check(args, window=4096)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode,head_size", [(m, 128) for m in MODES] + [(KVQuantMode.NONE, 64),
                                                                        (KVQuantMode.NVFP4, 256)], ids=str)
def test_gpu_mixed_prefill(mode, head_size):
    args = make_case([533, 1, 700, 4096, 77], [533, 1, 300, 1, 7], 32, 8, head_size, mode, pad_rows=5, seed=14)
    check(args)
    check(args, window=129)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32], ids=str)
def test_gpu_query_dtypes(q_dtype):
    args = make_case([300, 1001], [300, 1], 16, 4, 128, KVQuantMode.NONE, q_dtype=q_dtype, seed=15)
    check(args)
    args = make_case([300, 1001], [1, 1], 16, 4, 128, KVQuantMode.FP8_E4M3, q_dtype=q_dtype, seed=16)
    check(args)


@gpu
@pytest.mark.gpu
def test_gpu_through_op(monkeypatch):
    monkeypatch.setenv("KVFUSE_ATTENTION_BACKEND", "triton")
    backends.clear_cache()
    try:
        for mode in MODES:
            args = make_case([17, 2048], [1, 3], 32, 8, 128, mode, pad_rows=2, seed=17)
            out = torch.ops.kvfuse.paged_attention(*args.values(), "layers.3")
            torch.testing.assert_close(out.cpu().float(), reference_out(args).float(), atol=3e-2, rtol=3e-2)
    finally:
        backends.clear_cache()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_gpu_decode_large_batch_no_split(mode):
    # Enough sequences that the launcher does not split the context: the big-batch decode path
    # (fp16 dots for quantized caches, tuned decode configs).
    lens = [(37 * i) % 3000 + 1 for i in range(48)]
    args = make_case(lens, [1] * 48, 32, 8, 128, mode, pad_rows=2, seed=22)
    check(args)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("use_asm", [True, False], ids=["ptx", "triton"])
@pytest.mark.parametrize("scale_gather", [True, False], ids=["gather", "broadcast"])
def test_gpu_nvfp4_decode_variants(use_asm, scale_gather):
    # The PTX E2M1 decode and the plain-Triton one, with either block-scale path, at real shapes.
    from kvfuse.ops.triton import attention as ta

    options = dict(inline_asm=use_asm, tiles=ta.DEFAULT_TILES.replace(SCALE_GATHER=scale_gather))
    # 40 sequences x 8 KV heads fill the GPU without split-KV (the default decode path of big batches).
    args = make_case([1, 533, 4097, 31] * 10, [1] * 40, 32, 8, 128, KVQuantMode.NVFP4, pad_rows=2, seed=18)
    check(args, **options)
    args = make_case([700, 77], [300, 7], 16, 4, 64, KVQuantMode.NVFP4, pad_rows=2, seed=19)
    check(args, window=129, **options)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("keys_first", [True, False], ids=["keys_first", "query_first"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_gpu_decode_score_orders(mode, keys_first):
    # Both score orders at real decode shapes, with and without split-KV, head sizes 64 and 128.
    from kvfuse.ops.triton import attention as ta

    tiles = ta.DEFAULT_TILES.replace(KEYS_FIRST=keys_first)
    check(make_case([1, 533, 4097, 31] * 10, [1] * 40, 32, 8, 128, mode, pad_rows=2, seed=26), tiles=tiles)
    check(make_case([4099, 77], [1, 1], 16, 4, 64, mode, pad_rows=1, seed=27), window=1000, tiles=tiles)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", [KVQuantMode.FP8_E4M3, KVQuantMode.NVFP4], ids=lambda m: m.name)
def test_gpu_quantized_bf16_dot_fallback(mode):
    # quant_dot_fp16=False keeps bf16 dots for quantized caches.
    args = make_case([1, 2049, 31] * 12, [1] * 36, 32, 8, 128, mode, pad_rows=1, seed=20)
    check(args, quant_dot_fp16=False)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [80, 16])
def test_gpu_nvfp4_head_sizes(head_size):
    args = make_case([1, 533, 2048], [1, 1, 5], 32, 8, head_size, KVQuantMode.NVFP4, pad_rows=2, seed=21)
    check(args)


def test_float32_queries_get_tiles_that_fit_hopper_shared_memory():
    """fp32 K/V dot tiles at BLOCK_N 128 and 2 stages need 256 KiB (OutOfResources on an H100)."""
    from kvfuse.ops.triton import attention as ta

    for num_tokens, num_seqs in ((4096, 2), (64, 64)):  # prefill and decode
        cfg16, _ = ta._pick_config(num_tokens, num_seqs, 128, 4, KVQuantMode.NONE, 2)
        cfg32, _ = ta._pick_config(num_tokens, num_seqs, 128, 4, KVQuantMode.NONE, 4)
        kv_tile_bytes = 2 * cfg32.num_stages * cfg32.BLOCK_N * 128 * 4
        assert kv_tile_bytes <= 128 * 1024 < 232448
        assert cfg32.BLOCK_N <= cfg16.BLOCK_N


def test_decode_configs_per_format_and_split():
    """Each cache format gets its own decode tiles; a split launch takes the `_split` entry if any."""
    from kvfuse.ops.triton import attention as ta

    decode_tiles, prefill_tiles = ta.DEFAULT_TILES.decode, ta.DEFAULT_TILES.prefill
    for mode, key in ((KVQuantMode.NONE, "small"), (KVQuantMode.FP8_E4M3, "small_fp8"),
                      (KVQuantMode.FP8_E5M2, "small_fp8"), (KVQuantMode.NVFP4, "small_nvfp4"),
                      (KVQuantMode.FP8_PER_TOKEN_HEAD, "small_fp8_pth")):
        cfg, decode = ta._pick_config(64, 64, 128, 4, mode)
        assert decode and cfg == decode_tiles[key]
        cfg, _ = ta._pick_config(64, 64, 128, 4, mode, split=True)
        assert cfg == decode_tiles.get(key + "_split", decode_tiles[key])
    cfg, decode = ta._pick_config(4096, 2, 128, 4, KVQuantMode.FP8_E4M3, split=True)
    assert not decode and cfg == prefill_tiles["small"]
    cfg, decode = ta._pick_config(4096, 2, 128, 4, KVQuantMode.FP8_PER_TOKEN_HEAD)
    assert not decode and cfg == prefill_tiles["small_fp8_pth"]
    with pytest.raises(TypeError):  # tuned data is frozen
        decode_tiles["small"] = decode_tiles["large"]
