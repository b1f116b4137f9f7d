"""``python -m kvfuse generate``: a transformers model generating on kvfuse caches.

Offline by construction: ``--model`` is a local model directory (read with
``local_files_only=True``) or the name of a tiny random-weight architecture built from a
transformers config (``llama`` by default; ``qwen3``, ``mistral``, ``gemma2``, ``gemma3``,
``gpt_oss``). Prints the per-layer cache plan, the decode throughput and, with ``--compile``,
kvfuse's fusion report. Output goes through the ``emit`` callable that ``kvfuse.__main__``
passes in (the CLI is the only place that prints).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Callable

import torch

logger = logging.getLogger(__name__)

__all__ = ["TINY_MODELS", "add_generate_parser", "build_tiny_model", "cmd_generate"]

TINY_MODELS = ("llama", "qwen3", "mistral", "gemma2", "gemma3", "gpt_oss")


def build_tiny_model(name: str, dtype: torch.dtype, seed: int = 0):
    """A small random-weight ``*ForCausalLM`` of architecture ``name`` (nothing is downloaded)."""
    import transformers as tf

    common = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    factories = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=64)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**{**common, "head_dim": 256}, sliding_window=64,
                                                               attn_logit_softcapping=50.0)),
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 6},
                                                                   sliding_window=64)),
        "gpt_oss": lambda: tf.GptOssForCausalLM(tf.GptOssConfig(**{**common, "max_position_embeddings": 131072},
                                                                sliding_window=64, num_local_experts=4,
                                                                num_experts_per_tok=2)),
    }
    if name not in factories:
        raise ValueError(f"--model={name!r} is neither a local model directory nor one of {list(factories)}")
    torch.manual_seed(seed)
    return factories[name]().to(dtype)


def add_generate_parser(sub, emit: Callable[[str], None]) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate with a transformers model on kvfuse caches (offline)")
    p.add_argument("--model", default="llama",
                   help=f"local model directory, or a tiny random architecture: {', '.join(TINY_MODELS)} "
                        f"(default: llama)")
    p.add_argument("--kv-cache-dtype", default="fp8", help="KV-cache dtype request (default: fp8)")
    for side in ("k", "v"):
        p.add_argument(f"--{side}-cache-dtype", default=None,
                       help=f"the {side.upper()} side's dtype where it differs from --kv-cache-dtype")
    p.add_argument("--skip-layers", default="sliding_window",
                   help="comma-separated skip rules: layer indices, 'sliding_window', layer names "
                        "(default: sliding_window)")
    p.add_argument("--checkpoint-kv-cache-dtype", default=None,
                   help="override the KV dtype the checkpoint declares (default: read from its config)")
    p.add_argument("--model-dtype", default=None,
                   help="model dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--batch", type=int, default=4, help="prompts in the batch (default: 4)")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt; the others are shorter and "
                                                               "left-padded (default: 32)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per cache page (default: 16)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="weight and prompt seed (default: 0)")
    p.add_argument("--compile", action="store_true",
                   help="compile model.forward with kvfuse's backend and print the fusion report")
    p.set_defaults(func=lambda args: cmd_generate(args, emit))
    return p


def _positive(args, *names) -> None:
    for name in names:
        value = getattr(args, name)
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be positive")


def _load_model(args, dtype: torch.dtype, device: str):
    if os.path.isdir(args.model):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, local_files_only=True)
    else:
        model = build_tiny_model(args.model, dtype, args.seed)
    return model.to(device).eval()


def cmd_generate(args, emit: Callable[[str], None]) -> int:
    import kvfuse
    from kvfuse.__main__ import _SPEC_HEADERS, _model_dtype, _skip_rules, _spec_rows, _table, _totals_line
    from kvfuse.integrations import transformers as kvt

    _positive(args, "batch", "prompt_len", "max_new_tokens", "block_size")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _model_dtype(args.model_dtype) if args.model_dtype else (
        torch.bfloat16 if device == "cuda" else torch.float32)
    config = kvfuse.KVCacheConfig(kv_cache_dtype=args.kv_cache_dtype, skip_layers=_skip_rules(args.skip_layers),
                                  checkpoint_kv_cache_dtype=args.checkpoint_kv_cache_dtype,
                                  k_cache_dtype=args.k_cache_dtype, v_cache_dtype=args.v_cache_dtype)
    model = kvt.enable(_load_model(args, dtype, device), config, block_size=args.block_size)
    specs = [layer.spec for layer in kvt.kvfuse_layers(model)]
    emit(f"model: {args.model} ({type(model).__name__}, {str(dtype).replace('torch.', '')}, {device})")
    emit(_table(_SPEC_HEADERS, _spec_rows(specs)))
    emit(_totals_line(specs))

    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    lengths = [max(1, args.prompt_len - (b * args.prompt_len) // (2 * args.batch)) for b in range(args.batch)]
    ids = torch.zeros(args.batch, args.prompt_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, -n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, -n:] = 1
    ids, mask = ids.to(device), mask.to(device)
    # min_new_tokens keeps every run the same length, so tokens/s compare across settings.
    gen_kwargs = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                      do_sample=False, pad_token_id=0)
    backend = None
    if args.compile:
        backend = kvfuse.make_backend()
        model.forward = torch.compile(model.forward, backend=backend)
        model.generate(ids, **gen_kwargs)  # compiles the prefill and decode graphs
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, **gen_kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    emit(f"generated {new} tokens x {args.batch} sequences in {seconds:.3f} s: "
         f"{new * args.batch / seconds:.1f} tokens/s ({'compiled' if args.compile else 'eager'}, prefill included)")
    emit(f"first sequence: {out[0, ids.shape[1]:].tolist()}")
    if backend is not None:
        rows = [(r.layer_name, getattr(r.kv_quant_mode, "name", r.kv_quant_mode), r.fused, r.reason)
                for r in backend.report]
        emit("fusion report (last compiled graph):")
        emit(_table(("layer", "mode", "fused", "reason"), rows))
    return 0
