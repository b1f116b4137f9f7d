"""Checked mode: data-dependent validation that needs a device sync, off the hot path by default.

Shapes, dtypes and devices are always validated (at trace time and before every kernel). What
only the data can tell -- slots in range, no slot written twice, metadata consistent with the
cache, scales finite and positive -- is checked when checked mode is on:

- ``KVFUSE_CHECK=1`` in the environment (:mod:`kvfuse.envs`), or
- ``with kvfuse.ops.checks.checked():`` for the current thread.

The checks run inside the ops' real implementations, before any kernel writes, so they also
apply to compiled graphs. Without checked mode, an out-of-range slot is undefined behaviour
for the CUDA kernels (an out-of-bounds write) and an IndexError for the CPU reference.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

from .. import envs

__all__ = ["checked", "enabled", "check_slots", "check_scales", "check_positions", "check_attention_metadata"]

_local = threading.local()
_lock = threading.Lock()
_blocks = 0  # checked() blocks open in any thread (the C++ eager router pauses while any is)


def open_blocks() -> int:
    return _blocks


def enabled() -> bool:
    override: Optional[bool] = getattr(_local, "override", None)
    if override is not None:
        return override
    return envs.settings().check


@contextlib.contextmanager
def checked(on: bool = True) -> Iterator[None]:
    """Turn checked mode on (or off) for the ops this thread runs inside the block."""
    global _blocks
    from . import native

    previous = getattr(_local, "override", None)
    _local.override = bool(on)
    with _lock:
        _blocks += 1
    native.reset_cuda_routing()  # the checks run in the Python body: route every call there
    try:
        yield
    finally:
        _local.override = previous
        with _lock:
            _blocks -= 1
        native.reset_cuda_routing()


def _fail(op: str, layer_name: str, message: str) -> None:
    raise ValueError(f"kvfuse::{op} (layer {layer_name!r}) [checked mode]: {message}")


def check_scales(op: str, layer_name: str, **scales: torch.Tensor) -> None:
    for name, scale in scales.items():
        values = scale.detach().reshape(-1).float().cpu()
        bad = ~(torch.isfinite(values) & (values > 0))
        if bool(bad.any()):
            index = int(bad.nonzero()[0, 0])
            where = f"[{index}]" if scale.numel() > 1 else ""
            _fail(op, layer_name, f"{name}{where}={float(values[index])!r}; scales must be finite and > 0 "
                  f"(every element of a per-KV-head scale)")


def check_slots(op: str, layer_name: str, slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> None:
    num_slots = kv_cache.shape[0] * kv_cache.shape[2]
    slots = slot_mapping.long()
    bad = (slots < -1) | (slots >= num_slots)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        _fail(op, layer_name, f"slot_mapping[{index}]={int(slots[index])} is out of range; allowed: -1 "
              f"(padding) or 0 <= slot < num_blocks * block_size = {num_slots}")
    valid = slots[slots >= 0]
    if valid.numel() > 1:
        unique, counts = torch.unique(valid, return_counts=True)
        if bool((counts > 1).any()):
            dup = int(unique[counts > 1][0])
            _fail(op, layer_name, f"slot_mapping writes slot {dup} {int(counts.max())} times in one call; "
                  f"each slot may be written at most once per call")


def check_positions(op: str, layer_name: str, positions: torch.Tensor, num_rows: int) -> None:
    bad = (positions < 0) | (positions >= num_rows)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        _fail(op, layer_name, f"positions[{index}]={int(positions[index])} is out of range; allowed: "
              f"0 <= position < {num_rows} (the rows of cos/sin)")


def check_step_kv(op: str, layer_name: str, kv_cache: torch.Tensor, mode, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor) -> None:
    """The step's ``key`` / ``value`` equal the cache's rows at the query positions, where a kernel
    may read them instead of the pages (caches that store the model dtype)."""
    from ..kv_cache import KVQuantMode

    if KVQuantMode(mode) is not KVQuantMode.NONE:
        return  # only the pages are read
    page = kv_cache.shape[2]
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = qsl[b], qsl[b + 1]
        if q_end <= q_start:
            continue
        positions = torch.arange(seq_len - (q_end - q_start), seq_len, device=kv_cache.device)
        blocks = block_table[b, positions // page].long()
        for side, name, x in ((0, "key", key), (1, "value", value)):
            cached = kv_cache[blocks, side, positions % page]
            differs = (cached != x[q_start:q_end]).flatten(1).any(1)
            if bool(differs.any()):
                i = int(differs.nonzero()[0, 0])
                _fail(op, layer_name, f"{name}[{q_start + i}] differs from the cache row it was written to "
                      f"(sequence {b}, position {int(positions[i])}); {name} must be the rows this step wrote")


def check_attention_metadata(op: str, layer_name: str, num_tokens: int, kv_cache: torch.Tensor,
                             block_table: torch.Tensor, seq_lens: torch.Tensor,
                             query_start_loc: torch.Tensor) -> None:
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[2]
    qsl = query_start_loc.long().cpu()
    lens = seq_lens.long().cpu()
    if int(qsl[0]) != 0:
        _fail(op, layer_name, f"query_start_loc[0]={int(qsl[0])}; it must be 0")
    q_lens = qsl[1:] - qsl[:-1]
    if bool((q_lens < 0).any()):
        b = int((q_lens < 0).nonzero()[0, 0])
        _fail(op, layer_name, f"query_start_loc decreases at sequence {b} ({int(qsl[b])} -> {int(qsl[b + 1])}); "
              f"it must be non-decreasing")
    if int(qsl[-1]) > num_tokens:
        _fail(op, layer_name, f"query_start_loc[-1]={int(qsl[-1])} exceeds the {num_tokens} query tokens")
    if bool((lens < q_lens).any()):
        b = int((lens < q_lens).nonzero()[0, 0])
        _fail(op, layer_name, f"seq_lens[{b}]={int(lens[b])} is smaller than its {int(q_lens[b])} new tokens; "
              f"seq_lens counts the context including the new tokens")
    capacity = block_table.shape[1] * block_size
    if bool((lens > capacity).any()):
        b = int((lens > capacity).nonzero()[0, 0])
        _fail(op, layer_name, f"seq_lens[{b}]={int(lens[b])} needs more pages than block_table's "
              f"{block_table.shape[1]} columns of {block_size} tokens hold ({capacity})")
    needed_cols = (lens + block_size - 1) // block_size
    cols = torch.arange(block_table.shape[1]).unsqueeze(0)
    used = cols < needed_cols.unsqueeze(1)
    pages = block_table.long().cpu()
    bad = used & ((pages < 0) | (pages >= num_blocks))
    if bool(bad.any()):
        b, col = (int(v) for v in bad.nonzero()[0])
        _fail(op, layer_name, f"block_table[{b}, {col}]={int(pages[b, col])} is not a page of this cache; "
              f"allowed: 0 <= page < num_blocks = {num_blocks}")
