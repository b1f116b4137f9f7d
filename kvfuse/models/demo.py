"""Drive the demo model through prefill + decode steps and compare cache formats.

Every run of one comparison feeds the same token ids (teacher forcing: the decode tokens are
drawn up front rather than sampled), so the logits of two runs differ only by what their
KV caches did to K and V.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .cache_manager import PagedCacheManager
from .llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

__all__ = ["DemoBatch", "LogitError", "make_batch", "run_steps", "generate_greedy", "compare_logits"]


@dataclass(frozen=True)
class DemoBatch:
    prompts: tuple  # one tuple of token ids per sequence
    decode_tokens: tuple  # decode_tokens[step][seq] = the token fed at that decode step

    @property
    def num_steps(self) -> int:
        return 1 + len(self.decode_tokens)

    @property
    def max_seq_len(self) -> int:
        return max(len(p) for p in self.prompts) + len(self.decode_tokens)


def make_batch(vocab_size: int, prompt_lens: Sequence[int], decode_steps: int, seed: int = 0) -> DemoBatch:
    if not prompt_lens or any(n <= 0 for n in prompt_lens):
        raise ValueError(f"prompt_lens={list(prompt_lens)!r} must be non-empty and positive")
    if decode_steps < 0:
        raise ValueError(f"decode_steps={decode_steps!r} must be >= 0")
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = tuple(tuple(torch.randint(vocab_size, (n,), generator=gen).tolist()) for n in prompt_lens)
    decode = tuple(tuple(torch.randint(vocab_size, (len(prompt_lens),), generator=gen).tolist())
                   for _ in range(decode_steps))
    return DemoBatch(prompts, decode)


def run_steps(
    model: LlamaForCausalLM,
    batch: DemoBatch,
    *,
    block_size: int = 16,
    forward: Optional[Callable] = None,
    pad_to: Optional[int] = None,
) -> tuple[torch.Tensor, PagedCacheManager]:
    """Prefill every prompt in one batch, then decode; return the logits of every real row.

    The result stacks, in order, the prefill rows (all prompt tokens) and then one row per
    sequence per decode step: ``[sum(prompt_lens) + steps * B, vocab]`` float32 on the CPU.
    ``forward`` replaces ``model`` (e.g. a compiled model); ``pad_to`` pads every step to a
    fixed token count (padding rows use slot -1), which also gives a compiled model a single
    input shape. The block table width is fixed by the batch's length for the same reason.
    """
    forward = forward if forward is not None else model
    manager = _manager_for(model, len(batch.prompts), batch.max_seq_len, block_size)
    outputs = []
    steps = [dict(enumerate(batch.prompts))]
    steps += [{b: (tok,) for b, tok in enumerate(step)} for step in batch.decode_tokens]
    with torch.no_grad():
        for new_tokens in steps:
            inputs = manager.step(new_tokens, pad_to=pad_to)
            logits = forward(inputs.input_ids, inputs.positions, manager.kv_caches, inputs.metadata)
            outputs.append(logits[: inputs.num_real_tokens].float().cpu())
    return torch.cat(outputs), manager


def _manager_for(model: LlamaForCausalLM, num_seqs: int, max_seq_len: int, block_size: int) -> PagedCacheManager:
    # Pages for every sequence at its longest, and a block table as wide as the longest needs.
    # Under tensor parallelism each rank builds its own manager from its own specs; the page
    # ids agree across ranks because every rank runs the same steps in the same order.
    blocks_per_seq = -(-max_seq_len // block_size)
    return PagedCacheManager(model.kv_specs, num_blocks=blocks_per_seq * num_seqs, block_size=block_size,
                             device=next(model.parameters()).device, max_seq_len=blocks_per_seq * block_size)


def generate_greedy(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    block_size: int = 16,
    forward: Optional[Callable] = None,
    pad_to: Optional[int] = None,
) -> tuple[tuple, torch.Tensor]:
    """Greedy decoding: prefill ``prompts``, then feed back each step's argmax token.

    Returns ``(tokens, logits)``: ``tokens[b]`` holds sequence b's ``max_new_tokens`` generated
    ids, ``logits`` ``[max_new_tokens, B, vocab]`` float32 on the CPU holds the logits each
    token was picked from. ``forward`` / ``pad_to`` as in :func:`run_steps`.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of non-empty token lists, got {prompts!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    forward = forward if forward is not None else model
    # The last generated token is never fed back, hence - 1.
    manager = _manager_for(model, len(prompts), max(len(p) for p in prompts) + max_new_tokens - 1, block_size)
    new_tokens = {b: tuple(p) for b, p in enumerate(prompts)}
    generated, step_logits = [[] for _ in prompts], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            inputs = manager.step(new_tokens, pad_to=pad_to)
            logits = forward(inputs.input_ids, inputs.positions, manager.kv_caches, inputs.metadata)
            picked = logits[inputs.logits_indices].float().cpu()
            step_logits.append(picked)
            next_ids = picked.argmax(-1).tolist()
            for b, tok in enumerate(next_ids):
                generated[b].append(tok)
            new_tokens = {b: (tok,) for b, tok in enumerate(next_ids)}
    return tuple(tuple(g) for g in generated), torch.stack(step_logits)


@dataclass(frozen=True)
class LogitError:
    rel_error: float  # ||a - b|| / ||b|| over all rows
    max_abs: float
    top1_agree: int
    rows: int

    @property
    def top1_fraction(self) -> float:
        return self.top1_agree / self.rows if self.rows else 1.0

    def __str__(self) -> str:
        return (f"relative error {self.rel_error:.3e}, max abs {self.max_abs:.3e}, top-1 agreement "
                f"{100 * self.top1_fraction:.1f}% ({self.top1_agree}/{self.rows})")


def compare_logits(logits: torch.Tensor, reference: torch.Tensor) -> LogitError:
    if logits.shape != reference.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and reference {tuple(reference.shape)} differ in shape")
    a, b = logits.double(), reference.double()
    denom = b.norm().item()
    return LogitError(
        rel_error=(a - b).norm().item() / denom if denom else float((a - b).norm().item()),
        max_abs=(a - b).abs().max().item() if a.numel() else 0.0,
        top1_agree=int((a.argmax(-1) == b.argmax(-1)).sum().item()),
        rows=a.shape[0],
    )
