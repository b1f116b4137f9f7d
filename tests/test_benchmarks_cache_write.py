"""The cache-write benchmark's slot patterns (CPU: the benchmark itself needs a GPU)."""

import pytest
import torch

from benchmarks import cache_write


@pytest.mark.parametrize("num_tokens", [1, 7, 16, 533])
@pytest.mark.parametrize("pattern", cache_write.SLOT_PATTERNS)
def test_slot_patterns_are_distinct_slots_of_the_cache(pattern, num_tokens):
    num_blocks = -(-2 * num_tokens // cache_write.BLOCK_SIZE) + 1
    slots = cache_write.slot_mapping(pattern, num_tokens, num_blocks, torch.Generator().manual_seed(0))
    assert slots.shape == (num_tokens,)
    assert slots.unique().numel() == num_tokens
    assert int(slots.min()) >= 0 and int(slots.max()) < num_blocks * cache_write.BLOCK_SIZE
    pages, offsets = slots // cache_write.BLOCK_SIZE, slots % cache_write.BLOCK_SIZE
    if pattern == "sequential":
        assert torch.equal(slots, torch.arange(num_tokens))
    elif pattern == "pages":
        # Whole pages, each filled from its first slot, in token order.
        assert torch.equal(offsets, torch.arange(num_tokens) % cache_write.BLOCK_SIZE)
        assert bool((pages.view(-1)[offsets != 0] == pages.view(-1)[torch.nonzero(offsets != 0).view(-1) - 1]).all())


def test_unknown_slot_pattern_is_refused_by_name():
    with pytest.raises(ValueError, match="slot pattern 'strided'.*random"):
        cache_write.slot_mapping("strided", 4, 2, torch.Generator())
