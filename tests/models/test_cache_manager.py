"""PagedCacheManager: pages, slots and per-step metadata for prefill, decode and padding."""

import pytest
import torch

from kvfuse import KVCacheConfig
from kvfuse.models import PagedCacheManager


def _specs(dtype="fp8", layers=2):
    cfg = KVCacheConfig(dtype, skip_layers=("0",))
    return [cfg.layer_spec(f"model.layers.{i}.attn", 2, 32) for i in range(layers)]


def test_one_cache_per_layer_from_its_own_spec():
    specs = _specs("nvfp4", layers=3)
    manager = PagedCacheManager(specs, num_blocks=5, block_size=4)
    assert [c.dtype for c in manager.kv_caches] == [torch.bfloat16, torch.uint8, torch.uint8]
    assert [tuple(c.shape) for c in manager.kv_caches] == [(5, 2, 4, 2, 32), (5, 2, 4, 2, 18), (5, 2, 4, 2, 18)]


def test_prefill_then_decode_metadata():
    manager = PagedCacheManager(_specs(), num_blocks=8, block_size=4, max_seq_len=12)
    step = manager.step({"a": [5, 6, 7, 8, 9], "b": [1, 2]}, pad_to=10)
    md = step.metadata
    assert step.input_ids.tolist() == [5, 6, 7, 8, 9, 1, 2, 0, 0, 0]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 0, 0]
    # a owns pages 0, 1; b owns page 2 (pages are handed out in order).
    assert manager.pages("a") == [0, 1] and manager.pages("b") == [2]
    assert md.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9, -1, -1, -1]
    assert md.slot_mapping.dtype == torch.int64
    assert md.block_table.dtype == md.seq_lens.dtype == md.query_start_loc.dtype == torch.int32
    assert md.block_table.tolist() == [[0, 1, 0], [2, 0, 0]]  # width fixed by max_seq_len
    assert md.seq_lens.tolist() == [5, 2] and md.query_start_loc.tolist() == [0, 5, 7]
    assert step.logits_indices.tolist() == [4, 6] and step.num_real_tokens == 7
    assert (md.max_seq_len, md.max_query_len) == (5, 5)

    step = manager.step({"a": [10], "b": [3]})
    md = step.metadata
    assert step.positions.tolist() == [5, 2]
    assert md.slot_mapping.tolist() == [5, 10]
    assert md.seq_lens.tolist() == [6, 3] and md.query_start_loc.tolist() == [0, 1, 2]
    # b fills its page (position 3), then grows past it: the next free page (3) joins its table.
    assert manager.step({"b": [4]}).metadata.slot_mapping.tolist() == [11]
    step = manager.step({"b": [9]})
    assert manager.pages("b") == [2, 3] and step.metadata.slot_mapping.tolist() == [12]
    assert step.metadata.block_table.tolist() == [[2, 3, 0]]


def test_mixed_batch_new_sequence_joins_decoding_ones():
    manager = PagedCacheManager(_specs(), num_blocks=6, block_size=2)
    manager.step({0: [1, 2, 3]})
    step = manager.step({0: [4], 1: [7, 8, 9]})
    assert step.metadata.seq_lens.tolist() == [4, 3]
    assert step.metadata.query_start_loc.tolist() == [0, 1, 4]
    assert step.positions.tolist() == [3, 0, 1, 2]
    assert step.metadata.slot_mapping.tolist() == [manager.slot(0, 3), manager.slot(1, 0), manager.slot(1, 1),
                                                   manager.slot(1, 2)]
    assert len(set(step.metadata.slot_mapping.tolist())) == 4


def test_out_of_pages_fails_without_side_effects():
    manager = PagedCacheManager(_specs(), num_blocks=3, block_size=4)
    manager.step({"a": [1] * 5})
    free, pages = manager.num_free_blocks, manager.pages("a")
    with pytest.raises(RuntimeError, match="out of cache pages: this step needs 2 more, 1 are free"):
        manager.step({"a": [1] * 4, "b": [2] * 3})
    assert manager.num_free_blocks == free and manager.pages("a") == pages
    assert manager.seq_len("a") == 5 and manager.seq_len("b") == 0


def test_free_returns_pages():
    manager = PagedCacheManager(_specs(), num_blocks=2, block_size=4)
    manager.step({"a": [1] * 8})
    assert manager.num_free_blocks == 0
    manager.free("a")
    assert manager.num_free_blocks == 2
    manager.step({"b": [1] * 8})
    with pytest.raises(ValueError, match="seq_id='a' is not active"):
        manager.free("a")


def test_block_table_follows_pages_through_growth_frees_and_reuse():
    """Block-table rows are cached per sequence: every step must still show each sequence's pages
    now (new pages at page boundaries, a freed sequence's pages reused by another, a wider table
    after grow(max_seq_len)), zero-padded, in the step's sequence order."""
    manager = PagedCacheManager(_specs(), num_blocks=32, block_size=4, max_seq_len=16)
    gen = torch.Generator().manual_seed(3)
    live = {"a": 0, "b": 0, "c": 0}
    for step_no in range(14):
        if step_no == 6:
            manager.free("b")
            manager.free("a")
            live.update(a=0, b=0, d=0)  # ids reused for new sequences; d takes freed pages too
        if step_no == 9:
            manager.grow(max_seq_len=28)
        order = sorted(live, key=lambda s: torch.rand((), generator=gen).item())
        new = {s: [1] * (3 if live[s] == 0 else 1) for s in order}
        md = manager.step(new).metadata
        for s in order:
            live[s] += len(new[s])
        width = manager.max_blocks_per_seq
        assert tuple(md.block_table.shape) == (len(order), width)
        for row, s in zip(md.block_table.tolist(), order):
            pages = manager.pages(s)
            assert row == pages + [0] * (width - len(pages)), (step_no, s)
    assert width == 7 and manager.pages("d")  # the table widened; d reused freed pages


@pytest.mark.parametrize("call,match", [
    (lambda m: m.step({}), "new_tokens is empty"),
    (lambda m: m.step({"a": []}), "seq_id='a' has no new tokens"),
    (lambda m: m.step({"a": [1, 2, 3]}, pad_to=2), "pad_to=2 is smaller than the step's 3 tokens"),
    (lambda m: m.step({"a": [1] * 9}), "seq_id='a' would reach 9 tokens, over max_seq_len=8"),
    (lambda m: m.slot("zz", 0), "position=0 of seq_id='zz' has no page"),
])
def test_step_errors(call, match):
    manager = PagedCacheManager(_specs(), num_blocks=4, block_size=4, max_seq_len=8)
    with pytest.raises(ValueError, match=match):
        call(manager)


def test_constructor_errors():
    with pytest.raises(ValueError, match="specs is empty"):
        PagedCacheManager([], 4, 4)
    with pytest.raises(ValueError, match="block_size=0"):
        PagedCacheManager(_specs(), 4, 0)
