"""A minimal paged-cache manager: pages per sequence, slot mapping and per-step metadata.

One cache per layer, each allocated from that layer's own :class:`kvfuse.KVCacheSpec`, so a
model may mix FP8 / NVFP4 layers with bf16 skip layers; all layers share one page table (a
token sits at the same slot in every layer's cache). It is deliberately simple (no prefix
sharing, no preemption): enough to drive prefill, decode and mixed batches in tests and the
demo the way an inference engine would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch

from ..kv_cache import KVCacheSpec, allocate_kv_cache
from ..layers import AttentionMetadata

logger = logging.getLogger(__name__)

__all__ = ["PagedCacheManager", "StepInputs"]


@dataclass
class StepInputs:
    """Everything one forward step needs, on the manager's device.

    ``logits_indices[b]`` is the row of sequence b's newest token (the one whose logits
    predict the next token); ``num_real_tokens`` rows precede any padding.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [B] int64
    seq_ids: tuple
    num_real_tokens: int


class PagedCacheManager:
    """Allocates pages to sequences and builds :class:`AttentionMetadata` for each step.

    ``max_seq_len`` fixes the width of the block table (``ceil(max_seq_len / block_size)``), so
    every step has the same metadata shapes and a compiled model does not recompile as
    sequences grow.
    """

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        num_blocks: int,
        block_size: int,
        device: Union[torch.device, str, None] = None,
        max_seq_len: Optional[int] = None,
    ) -> None:
        specs = list(specs)
        if not specs:
            raise ValueError("specs is empty: pass one KVCacheSpec per attention layer")
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        capacity = num_blocks * block_size
        if max_seq_len is None:
            max_seq_len = capacity
        if not isinstance(max_seq_len, int) or not 0 < max_seq_len:
            raise ValueError(f"max_seq_len={max_seq_len!r} must be a positive int")
        self.specs = specs
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.max_seq_len = max_seq_len
        self.max_blocks_per_seq = -(-max_seq_len // block_size)
        self.kv_caches = [allocate_kv_cache(spec, num_blocks, block_size, device=self.device) for spec in specs]
        # Pop from the end: pages are handed out in increasing order, which keeps tests readable.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pages: dict = {}
        self._lens: dict = {}
        # Each sequence's block-table row (int32, max_blocks_per_seq wide, zero-padded), rebuilt
        # only when its pages change: a decode step then stacks rows instead of converting every
        # sequence's page list (most of the step's host time at batch 64).
        self._table_rows: dict = {}

    # ------------------------------------------------------------------ bookkeeping

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def seq_len(self, seq_id) -> int:
        return self._lens.get(seq_id, 0)

    def pages(self, seq_id) -> list:
        return list(self._pages.get(seq_id, ()))

    def free(self, seq_id) -> None:
        """Return a sequence's pages (their contents stay; the next owner overwrites them)."""
        if seq_id not in self._pages:
            raise ValueError(f"seq_id={seq_id!r} is not active; active: {sorted(self._pages, key=repr)}")
        self._free.extend(reversed(self._pages.pop(seq_id)))
        del self._lens[seq_id]
        self._table_rows.pop(seq_id, None)

    def slot(self, seq_id, position: int) -> int:
        """Cache slot of token ``position`` of ``seq_id`` (``page * block_size + offset``)."""
        pages = self._pages.get(seq_id, ())
        if not 0 <= position < len(pages) * self.block_size:
            raise ValueError(f"position={position} of seq_id={seq_id!r} has no page (it owns {len(pages)})")
        return pages[position // self.block_size] * self.block_size + position % self.block_size

    def grow(self, num_blocks: Optional[int] = None, max_seq_len: Optional[int] = None) -> None:
        """Enlarge the page pool and/or the per-sequence limit, keeping every cached token.

        New pages get the next ids, so existing block tables stay valid; the caches are
        reallocated and copied, so fetch ``kv_caches`` again afterwards. A compiled model sees new
        shapes (one recompile), which is why callers grow geometrically.
        """
        if num_blocks is not None:
            if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < self.num_blocks:
                raise ValueError(f"num_blocks={num_blocks!r} must be an int >= the current {self.num_blocks}")
            if num_blocks > self.num_blocks:
                grown = []
                for spec, old in zip(self.specs, self.kv_caches):
                    new = allocate_kv_cache(spec, num_blocks, self.block_size, device=self.device)
                    new[: self.num_blocks].copy_(old)
                    grown.append(new)
                self.kv_caches = grown
                # Prepended, so the pages freed before are handed out first (pop takes from the end).
                self._free = list(range(num_blocks - 1, self.num_blocks - 1, -1)) + self._free
                self.num_blocks = num_blocks
        if max_seq_len is not None:
            if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < self.max_seq_len:
                raise ValueError(f"max_seq_len={max_seq_len!r} must be an int >= the current {self.max_seq_len}")
            self.max_seq_len = max_seq_len
            self.max_blocks_per_seq = -(-max_seq_len // self.block_size)
        logger.debug("cache grown to %d blocks, max_seq_len %d", self.num_blocks, self.max_seq_len)

    def _table_row(self, seq_id) -> torch.Tensor:
        row = self._table_rows.get(seq_id)
        if row is None or row.numel() != self.max_blocks_per_seq:  # new pages, or grown max_seq_len
            pages = self._pages[seq_id]
            row = torch.zeros(self.max_blocks_per_seq, dtype=torch.int32)
            row[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
            self._table_rows[seq_id] = row
        return row

    # ------------------------------------------------------------------ steps

    def step(self, new_tokens: Mapping, pad_to: Optional[int] = None) -> StepInputs:
        """Append ``new_tokens[seq_id]`` (token ids) to each sequence and build the step's inputs.

        A sequence seen for the first time is created (its first step is its prefill). Rows
        are laid out sequence after sequence in ``new_tokens`` order; ``pad_to`` appends
        padding rows (token 0, position 0, slot -1) up to that many tokens. Pages are
        allocated for the whole step before anything changes, so a step that does not fit
        raises without side effects.
        """
        if not new_tokens:
            raise ValueError("new_tokens is empty: a step needs at least one sequence")
        seq_ids = tuple(new_tokens)
        token_lists = []
        for seq_id in seq_ids:
            ids = new_tokens[seq_id]
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            if not ids:
                raise ValueError(f"seq_id={seq_id!r} has no new tokens")
            token_lists.append(ids)
        num_real = sum(len(ids) for ids in token_lists)
        if pad_to is not None and pad_to < num_real:
            raise ValueError(f"pad_to={pad_to} is smaller than the step's {num_real} tokens")

        new_lens = [self.seq_len(s) + len(ids) for s, ids in zip(seq_ids, token_lists)]
        for seq_id, length in zip(seq_ids, new_lens):
            if length > self.max_seq_len:
                raise ValueError(f"seq_id={seq_id!r} would reach {length} tokens, over max_seq_len={self.max_seq_len}")
        needed = [-(-length // self.block_size) - len(self._pages.get(s, ())) for s, length in zip(seq_ids, new_lens)]
        if sum(needed) > len(self._free):
            raise RuntimeError(
                f"out of cache pages: this step needs {sum(needed)} more, {len(self._free)} are free "
                f"(num_blocks={self.num_blocks}, block_size={self.block_size})"
            )
        for seq_id, extra in zip(seq_ids, needed):
            pages = self._pages.setdefault(seq_id, [])
            if extra:
                pages.extend(self._free.pop() for _ in range(extra))
                self._table_rows.pop(seq_id, None)

        input_ids, positions, slots, qsl, logits_indices = [], [], [], [0], []
        for seq_id, ids, length in zip(seq_ids, token_lists, new_lens):
            start = self.seq_len(seq_id)
            input_ids.extend(ids)
            for pos in range(start, length):
                positions.append(pos)
                slots.append(self.slot(seq_id, pos))
            qsl.append(qsl[-1] + len(ids))
            logits_indices.append(qsl[-1] - 1)
            self._lens[seq_id] = length
        num_pad = (pad_to - num_real) if pad_to is not None else 0
        input_ids += [0] * num_pad
        positions += [0] * num_pad
        slots += [-1] * num_pad

        block_table = torch.stack([self._table_row(s) for s in seq_ids])
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=block_table.to(dev),
            seq_lens=torch.tensor(new_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_seq_len=max(new_lens),
            max_query_len=max(len(ids) for ids in token_lists),
        )
        logger.debug("step: %d sequences, %d tokens (+%d padding), %d pages free",
                     len(seq_ids), num_real, num_pad, len(self._free))
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            seq_ids=seq_ids,
            num_real_tokens=num_real,
        )
