"""Logit error of each KV-cache format against a bf16 cache, on tiny transformers models (CPU).

For each model and each cache format, the model runs on kvfuse caches through
:func:`kvfuse.integrations.transformers.enable` and its logits are compared with those of the
same weights on a ``bfloat16`` cache, over the same tokens:

- **Inputs.** A batch of left-padded random prompts is prefilled, then ``--steps`` decode steps
  follow. The decode tokens are the greedy ones of the bf16-cache run, and every format is fed
  those same tokens (teacher forcing), so a flipped argmax early on cannot change what later
  steps are compared on.
- **Metrics** (logits in float32, over every real prefill position and every decode step):
  ``max_abs`` (largest absolute difference), ``rel_l2`` (``||logits - ref|| / ||ref||``) and
  ``top1`` (the fraction of decode steps whose argmax is the bf16-cache run's argmax).
- **Calibrated** rows set static scales with :func:`kvfuse.calibrate_scales` from one forward over
  a second batch of prompts (other tokens, other lengths), before the evaluation.

**Models.** Random weights from configs (nothing downloaded), float32 by default, 3 layers,
hidden 64, 4 query / 2 KV heads, vocabulary 128, seeded: Llama, Qwen3 (QK-norm), Mistral (one
sliding window), Gemma 2 (alternating windows, soft-capping, head_dim 64), Gemma 3 (QK-norm,
local and global layers) and gpt-oss (attention sinks, alternating windows, a small MoE).
Every layer uses the format under test (no skip rules).

**Outliers.** Random-init keys and values are small (RMS ~0.5-1, max ~3-4) and lack the
outlier channels of trained models' activations, which are what strains a format's range and
its scales. :func:`add_kv_outliers` gives every attention layer outlier channels while leaving
the model's function unchanged (up to float rounding), so that only the cache sees them:

- K: every channel times ``k_gain`` (8), and two rotary pairs (channels ``p`` and ``p + D/2``)
  of one KV head times ``outlier`` (50) more. The matching query channels (every query head of
  that KV head's group) are divided by the same factors, so ``q . k`` is unchanged: scaling a
  whole rotary pair commutes with the rotation.
- V: four channels of one KV head times ``outlier``; the matching input columns of ``o_proj``
  (every query head of the group) are divided by it.
- Where the model normalises K and Q per head (Qwen3, Gemma 3: ``k_norm``/``q_norm``, one weight
  shared by all heads), the K and Q factors go into those norms' gains instead of the
  projections, so the K outlier channels are the same in every KV head.
- Heads and channels are drawn per layer from a seeded generator. The bf16-cache run prints the
  K/V magnitudes this produces (RMS and max per model) beside the table.

Each model runs twice by default, with the outliers and as built (``--outliers yes|no|both``).

    python -m benchmarks.kv_accuracy [--models llama,qwen3] [--formats fp8,fp8_cal] [--steps 16]
        [--dtype float32] [--outliers both] [--out benchmarks/results] [--no-write] [--markdown]

Writes ``benchmarks/results/kv_accuracy-<date>.json`` (date, commit, versions, machine, every
row) and prints the table (with ``--markdown`` also the tables of BENCHMARKS.md). Formats kvfuse
cannot run yet (``KVCacheConfig`` refuses them) are skipped, with the reason printed and recorded.
About 15 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import logging
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from benchmarks.common import current_commit, markdown_table, write_json

# Read (as text) by `python -m kvfuse bench`: this one runs on CPU.
REQUIRES_CUDA = False

logger = logging.getLogger(__name__)

VOCAB = 128
EVAL_LENGTHS = (21, 9, 16, 28)
CALIBRATION_LENGTHS = (24, 12, 18, 30)
EVAL_SEED, CALIBRATION_SEED = 1, 2
REFERENCE_DTYPE = "bfloat16"


# ----------------------------------------------------------------------------- models


def _config_kwargs(**overrides) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.08)
    base.update(overrides)
    return base


def _llama(tf):
    return tf.LlamaForCausalLM(tf.LlamaConfig(**_config_kwargs()))


def _qwen3(tf):
    return tf.Qwen3ForCausalLM(tf.Qwen3Config(**_config_kwargs()))


def _mistral(tf):
    return tf.MistralForCausalLM(tf.MistralConfig(**_config_kwargs(sliding_window=8)))


def _gemma2(tf):
    return tf.Gemma2ForCausalLM(tf.Gemma2Config(**_config_kwargs(
        head_dim=64, sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=64)))


def _gemma3(tf):
    return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**_config_kwargs(
        sliding_window=8, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])))


def _gpt_oss(tf):
    model = tf.GptOssForCausalLM(tf.GptOssConfig(**_config_kwargs(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, intermediate_size=64,
        max_position_embeddings=131072)))
    with torch.no_grad():  # sinks near the scores' range, so that they take a visible share
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.5)
    return model


MODELS = {"llama": _llama, "qwen3": _qwen3, "mistral": _mistral, "gemma2": _gemma2, "gemma3": _gemma3,
          "gpt_oss": _gpt_oss}


def build_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A tiny random-weight eval-mode ``*ForCausalLM`` (transformers' eager attention) in ``dtype``."""
    if name not in MODELS:
        raise ValueError(f"model={name!r} is not one of {', '.join(MODELS)}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype={dtype} must be torch.float32 or torch.bfloat16")
    import transformers as tf

    torch.manual_seed(seed)
    model = MODELS[name](tf)
    model.set_attn_implementation("eager")
    return model.to(dtype).eval()


# ----------------------------------------------------------------------------- the outlier recipe


@dataclass(frozen=True)
class OutlierRecipe:
    """K/V outlier channels that leave the model's function unchanged (see the module docstring)."""

    k_gain: float = 8.0  # every K channel (queries divided by it)
    outlier: float = 50.0  # the outlier channels, K and V, on top of k_gain for K
    k_pairs: int = 2  # rotary pairs (2 channels each) of one KV head per layer
    v_channels: int = 4  # channels of one KV head per layer
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("k_gain", "outlier"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name}={value!r} must be a finite number > 0")
        for name in ("k_pairs", "v_channels", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")

    def describe(self) -> str:
        return (f"K: every channel x{self.k_gain:g}, {self.k_pairs} rotary pairs of one KV head x{self.outlier:g} "
                f"more (queries divided to match); V: {self.v_channels} channels of one KV head x{self.outlier:g} "
                f"(o_proj columns divided to match); per-head norms (q_norm/k_norm) take the K/Q factors where "
                f"the model has them; heads and channels drawn per layer with seed {self.seed}")


def _scale_rows(linear: torch.nn.Linear, rows: torch.Tensor, factor: torch.Tensor) -> None:
    """Multiply output channels ``rows`` of ``linear`` by ``factor`` (weight rows and bias)."""
    linear.weight[rows] *= factor.to(linear.weight.dtype)[:, None]
    if linear.bias is not None:
        linear.bias[rows] *= factor.to(linear.bias.dtype)


def _scale_norm(norm: torch.nn.Module, factor: torch.Tensor, head_dim: int) -> None:
    """Multiply the per-channel gain of an RMS norm by ``factor`` ([head_dim]), in whichever of the
    two conventions it applies its weight (``x * w`` as Qwen3, ``x * (1 + w)`` as Gemma), and check
    that its output scaled by exactly that."""
    probe = torch.randn(3, head_dim, generator=torch.Generator().manual_seed(0)).to(norm.weight.dtype)
    before = norm(probe).float()
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)))
    unit = probe.float() * torch.rsqrt(probe.float().pow(2).mean(-1, keepdim=True) + eps)
    gain = (before / unit).mean(0)
    weight = norm.weight
    original = weight.detach().float().clone()
    # The output is rounded to the norm's dtype: a bf16 norm matches its gain to ~1e-2 only.
    rtol = max(1e-3, 4 * torch.finfo(weight.dtype).eps)
    if torch.allclose(gain, original, rtol=rtol, atol=1e-5):
        weight.copy_((original * factor).to(weight.dtype))
    elif torch.allclose(gain, 1.0 + original, rtol=rtol, atol=1e-5):
        weight.copy_(((1.0 + original) * factor - 1.0).to(weight.dtype))
    else:
        raise ValueError(f"{type(norm).__name__}: its gain is neither its weight nor 1 + its weight; the outlier "
                         f"recipe does not know how to scale it")
    if not torch.allclose(norm(probe).float(), before * factor, rtol=rtol, atol=1e-5):
        weight.copy_(original.to(weight.dtype))
        raise ValueError(f"{type(norm).__name__}: its {weight.dtype} weight cannot hold gains down to "
                         f"{float(factor.min()):.3g} (the gain is 1 + w, and {weight.dtype} rounds w near -1 too coarsely); "
                         f"run the model in float32")


@torch.no_grad()
def add_kv_outliers(model: torch.nn.Module, recipe: OutlierRecipe = OutlierRecipe()) -> list:
    """Give every attention layer of ``model`` K/V outlier channels, in place, without changing
    its function. Returns, per layer, the chosen KV heads and channels (for the results file)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
        else model.config
    num_heads = config.num_attention_heads
    num_kv = config.num_key_value_heads
    group = num_heads // num_kv
    gen = torch.Generator().manual_seed(recipe.seed)
    chosen = []
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        d = int(attn.head_dim)
        if getattr(attn, "v_norm", None) is not None:
            raise ValueError(f"layer {index}: {type(attn).__name__} normalises V (v_norm); the outlier recipe "
                             f"cannot put V outliers through it")
        pairs = torch.randperm(d // 2, generator=gen)[:recipe.k_pairs]
        k_channels = torch.cat([pairs, pairs + d // 2])
        k_factor = torch.full((d,), recipe.k_gain)
        k_factor[k_channels] *= recipe.outlier
        k_head = int(torch.randint(num_kv, (1,), generator=gen))
        v_head = int(torch.randint(num_kv, (1,), generator=gen))
        v_channels = torch.randperm(d, generator=gen)[:recipe.v_channels]
        qk_norm = getattr(attn, "k_norm", None) is not None and getattr(attn, "q_norm", None) is not None
        if qk_norm:
            # One gain per channel, shared by every head: the outliers are in every KV head.
            _scale_norm(attn.k_norm, k_factor, d)
            _scale_norm(attn.q_norm, 1.0 / k_factor, d)
            k_head = None
        else:
            # All K channels by k_gain, then the outlier pairs of one head by `outlier` more.
            all_rows = torch.arange(num_kv * d)
            _scale_rows(attn.k_proj, all_rows, torch.full((num_kv * d,), recipe.k_gain))
            _scale_rows(attn.q_proj, torch.arange(num_heads * d), torch.full((num_heads * d,), 1.0 / recipe.k_gain))
            _scale_rows(attn.k_proj, k_head * d + k_channels, torch.full((len(k_channels),), recipe.outlier))
            q_rows = torch.cat([h * d + k_channels for h in range(k_head * group, (k_head + 1) * group)])
            _scale_rows(attn.q_proj, q_rows, torch.full((len(q_rows),), 1.0 / recipe.outlier))
        _scale_rows(attn.v_proj, v_head * d + v_channels, torch.full((len(v_channels),), recipe.outlier))
        o_cols = torch.cat([h * d + v_channels for h in range(v_head * group, (v_head + 1) * group)])
        attn.o_proj.weight[:, o_cols] /= recipe.outlier
        chosen.append(dict(layer=index, k_head="all" if k_head is None else k_head,
                           k_channels=sorted(k_channels.tolist()), v_head=v_head,
                           v_channels=sorted(v_channels.tolist())))
    return chosen


# ----------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class CacheFormat:
    """One row of the table: a ``KVCacheConfig`` and whether its scales are calibrated first."""

    key: str  # short id (CLI, JSON)
    label: str  # table label
    config: tuple  # KVCacheConfig keyword arguments, as (name, value) pairs
    calibrate: bool = False

    def __post_init__(self) -> None:
        if not self.key or not isinstance(self.key, str):
            raise ValueError(f"key={self.key!r} must be a non-empty string")
        if not isinstance(self.config, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in self.config):
            raise ValueError(f"config={self.config!r} must be a tuple of (name, value) pairs")

    def kv_config(self):
        """The :class:`kvfuse.KVCacheConfig`, or raises (TypeError/ValueError) if kvfuse cannot hold it."""
        import kvfuse

        return kvfuse.KVCacheConfig(**dict(self.config))


FORMATS = (
    CacheFormat("bf16", "bf16 (the reference, run again)", (("kv_cache_dtype", "bfloat16"),)),
    CacheFormat("model_dtype", "auto (the model dtype)", (("kv_cache_dtype", "auto"),)),
    CacheFormat("fp8", "FP8 e4m3, per tensor, scale 1.0", (("kv_cache_dtype", "fp8_e4m3"),)),
    CacheFormat("fp8_cal", "FP8 e4m3, per tensor, calibrated", (("kv_cache_dtype", "fp8_e4m3"),), True),
    CacheFormat("fp8_head_cal", "FP8 e4m3, per KV head, calibrated",
                (("kv_cache_dtype", "fp8_e4m3"), ("kv_scale_granularity", "head")), True),
    CacheFormat("fp8_e5m2", "FP8 e5m2, per tensor, scale 1.0", (("kv_cache_dtype", "fp8_e5m2"),)),
    CacheFormat("fp8_token_head", "FP8 e4m3, per token and head (dynamic)",
                (("kv_cache_dtype", "fp8_per_token_head"),)),
    CacheFormat("nvfp4", "NVFP4, global scale 1.0", (("kv_cache_dtype", "nvfp4"),)),
    CacheFormat("nvfp4_cal", "NVFP4, per tensor, calibrated", (("kv_cache_dtype", "nvfp4"),), True),
    CacheFormat("nvfp4_head_cal", "NVFP4, per KV head, calibrated",
                (("kv_cache_dtype", "nvfp4"), ("kv_scale_granularity", "head")), True),
    CacheFormat("fp8k_nvfp4v_cal", "FP8 e4m3 K / NVFP4 V, calibrated",
                (("k_cache_dtype", "fp8_e4m3"), ("v_cache_dtype", "nvfp4")), True),
    CacheFormat("nvfp4k_fp8v_cal", "NVFP4 K / FP8 e4m3 V, calibrated",
                (("k_cache_dtype", "nvfp4"), ("v_cache_dtype", "fp8_e4m3")), True),
)
FORMATS_BY_KEY = {f.key: f for f in FORMATS}


def unsupported_reason(fmt: CacheFormat) -> Optional[str]:
    """Why kvfuse cannot run ``fmt`` yet (its config is refused), or None."""
    try:
        fmt.kv_config()
    except TypeError as e:  # a KVCacheConfig field that does not exist yet
        return f"not implemented yet: KVCacheConfig refuses {dict(fmt.config)} ({e})"
    except ValueError as e:
        return f"not supported yet: {str(e).splitlines()[0]}"
    return None


# ----------------------------------------------------------------------------- running


def prompts(lengths: Sequence[int], seed: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts (tokens 3..vocab-1, pad 0) and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, width - n:] = 1
    return ids, mask


@torch.no_grad()
def run_decode(model, ids: torch.Tensor, mask: torch.Tensor, steps: int,
               tokens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill ``ids``, then ``steps`` decode steps, as ``generate`` positions them (left padding).

    ``tokens`` ([B, steps]): the tokens to feed (teacher forcing); None feeds each step's argmax.
    Returns (prefill logits at the real positions [n, V], decode logits [B, steps, V] (the logits
    that predict each fed token), the fed tokens [B, steps]), logits in float32.
    """
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
    prefill = out.logits[mask.bool()].float()
    cache, pos, last = out.past_key_values, mask.sum(1, keepdim=True), out.logits[:, -1].float()
    decode, fed = [], []
    for i in range(steps):
        decode.append(last)
        nxt = last.argmax(-1, keepdim=True) if tokens is None else tokens[:, i:i + 1]
        fed.append(nxt)
        if i == steps - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, position_ids=pos)
        cache, pos, last = out.past_key_values, pos + 1, out.logits[:, -1].float()
    return prefill, torch.stack(decode, 1), torch.cat(fed, 1)


def compare(got: tuple, want: tuple) -> dict:
    """Errors of (prefill, decode) logits against the reference's, and decode argmax agreement."""
    g = torch.cat([got[0], got[1].flatten(0, 1)])
    w = torch.cat([want[0], want[1].flatten(0, 1)])
    diff = (g - w).double()
    return dict(
        max_abs=float(diff.abs().max()) if torch.isfinite(diff).all() else float("inf"),
        rel_l2=float(diff.norm() / w.double().norm()) if torch.isfinite(diff).all() else float("inf"),
        top1=float((got[1].argmax(-1) == want[1].argmax(-1)).double().mean()),
        decode_rel_l2=float((got[1] - want[1]).double().norm() / want[1].double().norm()),
        positions=int(g.shape[0]),
        decode_positions=int(got[1].shape[0] * got[1].shape[1]),
    )


def _kv_magnitudes(model) -> tuple[list, Any]:
    """Pre-hooks on the kvfuse layers recording the K/V rows they write (for the table's notes)."""
    from kvfuse.integrations import transformers as kvt

    seen: list = []

    def hook(module, args, kwargs):
        key = args[1] if len(args) > 1 else kwargs["key"]
        value = args[2] if len(args) > 2 else kwargs["value"]
        meta = args[4] if len(args) > 4 else kwargs.get("metadata")
        slots = getattr(meta, "slot_mapping", None)
        keep = slots >= 0 if isinstance(slots, torch.Tensor) and slots.shape[0] == key.shape[0] else slice(None)
        seen.append((key[keep].detach().float(), value[keep].detach().float()))

    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in kvt.kvfuse_layers(model)]
    return seen, handles


def _summarise_kv(seen: list) -> dict:
    k = torch.cat([s[0].flatten() for s in seen])
    v = torch.cat([s[1].flatten() for s in seen])
    return dict(k_rms=float(k.pow(2).mean().sqrt()), k_max=float(k.abs().max()),
                k_median_abs=float(k.abs().median()),
                v_rms=float(v.pow(2).mean().sqrt()), v_max=float(v.abs().max()),
                v_median_abs=float(v.abs().median()))


def evaluate_model(name: str, formats: Sequence[CacheFormat] = FORMATS, *, steps: int = 16,
                   dtype: torch.dtype = torch.float32, recipe: Optional[OutlierRecipe] = OutlierRecipe(),
                   eval_lengths: Sequence[int] = EVAL_LENGTHS,
                   calibration_lengths: Sequence[int] = CALIBRATION_LENGTHS,
                   keep_going: bool = False) -> dict:
    """Every format of ``formats`` on model ``name`` against the bf16 cache. Returns a dict with
    ``rows`` (one per format: metrics, or ``skipped``/``error`` with the reason), ``kv``
    (K/V magnitudes the bf16 cache saw), ``outliers`` (what the recipe chose) and
    ``recipe_check`` (relative L2 change the recipe made to the logits on caches of the model
    dtype: float rounding only, ~1e-7 in float32).

    ``recipe=None`` leaves the random model as it is. ``keep_going``: record a format's error and
    go on (the CLI) instead of raising (tests).
    """
    import kvfuse
    from kvfuse.integrations import transformers as kvt

    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1")
    base = build_model(name, dtype)
    ids, mask = prompts(eval_lengths, EVAL_SEED)
    cal_ids, cal_mask = prompts(calibration_lengths, CALIBRATION_SEED)
    result: dict = dict(model=name, dtype=str(dtype).replace("torch.", ""), steps=steps,
                        layers=base.config.num_hidden_layers, with_outliers=recipe is not None, outliers=None,
                        recipe_check=None)

    plain = None
    if recipe is not None:
        plain = kvt.enable(copy.deepcopy(base), kvfuse.KVCacheConfig())
        result["outliers"] = add_kv_outliers(base, recipe)

    reference = kvt.enable(copy.deepcopy(base), kvfuse.KVCacheConfig(kv_cache_dtype=REFERENCE_DTYPE))
    seen, handles = _kv_magnitudes(reference)
    want = run_decode(reference, ids, mask, steps)
    for handle in handles:
        handle.remove()
    result["kv"] = _summarise_kv(seen)
    top2 = want[1].topk(2, dim=-1).values
    result["reference_logits"] = dict(std=float(torch.cat([want[0], want[1].flatten(0, 1)]).std()),
                                      median_top1_margin=float((top2[..., 0] - top2[..., 1]).median()))
    tokens = want[2]
    result["tokens"] = tokens.tolist()
    if plain is not None:
        # The recipe's own effect on the model: the same caches (the model dtype) before and after it.
        after = kvt.enable(copy.deepcopy(base), kvfuse.KVCacheConfig())
        result["recipe_check"] = compare(run_decode(after, ids, mask, steps, tokens),
                                         run_decode(plain, ids, mask, steps, tokens))["rel_l2"]

    rows = []
    for fmt in formats:
        row = dict(format=fmt.key, label=fmt.label, config=dict(fmt.config), calibrated=fmt.calibrate)
        reason = unsupported_reason(fmt)
        if reason is not None:
            logger.warning("%s / %s skipped: %s", name, fmt.key, reason)
            row["skipped"] = reason
            rows.append(row)
            continue
        start = time.perf_counter()
        try:
            model = kvt.enable(copy.deepcopy(base), fmt.kv_config())
            if fmt.calibrate:
                calibration = kvfuse.calibrate_scales(model, [dict(input_ids=cal_ids, attention_mask=cal_mask)])
                row["k_scale_max"] = max(float(torch.as_tensor(c.k_scale).max()) for c in calibration.values())
                row["v_scale_max"] = max(float(torch.as_tensor(c.v_scale).max()) for c in calibration.values())
            got = run_decode(model, ids, mask, steps, tokens)
        except Exception as e:  # noqa: BLE001 - with keep_going, one failing format must not hide the rest
            if not keep_going:
                raise
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            continue
        row.update(compare(got, want))
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
    result["rows"] = rows
    return result


# ----------------------------------------------------------------------------- output


def _fmt(x: Optional[float], kind: str) -> str:
    if x is None:
        return "-"
    if kind == "top1":
        return f"{100 * x:.1f}%"
    if x == 0:
        return "0"
    return f"{x:.2e}" if kind == "rel_l2" else f"{x:.3g}"


def _variant(r: dict) -> str:
    return "outliers" if r["with_outliers"] else "as built"


def long_table(results: list) -> str:
    rows = []
    for r in results:
        for row in r["rows"]:
            note = row.get("skipped") or row.get("error") or ""
            rows.append((r["model"], _variant(r), row["label"], _fmt(row.get("max_abs"), "max_abs"),
                         _fmt(row.get("rel_l2"), "rel_l2"), _fmt(row.get("top1"), "top1"),
                         note if len(note) <= 60 else note[:57] + "..."))
    return markdown_table(("model", "K/V", "format", "max abs", "rel L2", "top-1 agree", "note"), rows)


def _cell(result: Optional[dict], label: str, metric: str) -> str:
    row = None if result is None else next((x for x in result["rows"] if x["label"] == label), None)
    if row is None:
        return "-"
    if "skipped" in row:
        return "skipped"
    if "error" in row:
        return "error"
    return _fmt(row.get(metric), metric)


def pivot_table(results: list, metric: str) -> str:
    """Formats down, models across, one metric. A model run both with the outlier recipe and as
    built gets ``with / as built`` in each cell."""
    labels, models = [], []
    for r in results:
        models += [r["model"]] if r["model"] not in models else []
        labels += [row["label"] for row in r["rows"] if row["label"] not in labels]

    def run(model: str, with_outliers: bool) -> Optional[dict]:
        return next((r for r in results if r["model"] == model and r["with_outliers"] is with_outliers), None)

    lines = []
    for label in labels:
        cells = []
        for model in models:
            pair = [_cell(r, label, metric) for r in (run(model, True), run(model, False)) if r is not None]
            cells.append("skipped" if set(pair) == {"skipped"} else " / ".join(pair))
        lines.append((label, *cells))
    return markdown_table(("format", *models), lines)


def magnitudes_table(results: list) -> str:
    """What the bf16 cache held, per model (every layer, real tokens only)."""
    keys = ("k_rms", "k_median_abs", "k_max", "v_rms", "v_median_abs", "v_max")
    return markdown_table(
        ("model", "K/V", "K RMS", "K median abs", "K max", "V RMS", "V median abs", "V max", "recipe check",
         "logit std", "median top-1 margin"),
        [(r["model"], _variant(r), *(f"{r['kv'][k]:.3g}" for k in keys),
          "-" if r["recipe_check"] is None else f"{r['recipe_check']:.1e}",
          f"{r['reference_logits']['std']:.3g}", f"{r['reference_logits']['median_top1_margin']:.3g}")
         for r in results])


def skipped_notes(results: list) -> list:
    notes: dict = {}
    for r in results:
        for row in r["rows"]:
            if "skipped" in row:
                notes.setdefault(row["label"], row["skipped"])
    return [f"{label}: {reason}" for label, reason in notes.items()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--formats", default=",".join(FORMATS_BY_KEY),
                        help=f"comma-separated, of: {', '.join(FORMATS_BY_KEY)}")
    parser.add_argument("--steps", type=int, default=16, help="decode steps after the prefill")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model weights")
    parser.add_argument("--outliers", choices=("yes", "no", "both"), default="both",
                        help="K/V with the outlier recipe, as the random init leaves them, or both")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--no-write", action="store_true", help="print only, write no JSON")
    parser.add_argument("--markdown", action="store_true", help="also print the BENCHMARKS.md tables")
    args = parser.parse_args(argv)

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            parser.error(f"--models: {m!r} is not one of {', '.join(MODELS)}")
    formats = []
    for key in (k.strip() for k in args.formats.split(",") if k.strip()):
        if key not in FORMATS_BY_KEY:
            parser.error(f"--formats: {key!r} is not one of {', '.join(FORMATS_BY_KEY)}")
        formats.append(FORMATS_BY_KEY[key])
    if not models or not formats:
        parser.error("--models and --formats must name at least one each")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    dtype = getattr(torch, args.dtype)
    recipes = {"yes": [OutlierRecipe()], "no": [None], "both": [OutlierRecipe(), None]}[args.outliers]

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    results, failed = [], []
    for recipe in recipes:
        for name in models:
            t0 = time.perf_counter()
            try:
                results.append(evaluate_model(name, formats, steps=args.steps, dtype=dtype, recipe=recipe,
                                              keep_going=True))
            except Exception as e:  # noqa: BLE001 - one model that cannot run must not hide the others
                traceback.print_exc()
                failed.append(dict(model=name, with_outliers=recipe is not None,
                                   error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(f"{name} ({'outliers' if recipe else 'as built'}): {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start

    import transformers

    from kvfuse.ops import registry

    chosen = sorted({(d["op"], d["mode"], d["chosen"]) for d in registry.decisions("cpu")
                     if d["op"] in ("encode_and_cache_write", "paged_attention")})
    given = list(sys.argv[1:] if argv is None else argv)
    recipe = OutlierRecipe()
    meta = dict(date=datetime.date.today().isoformat(), machine="CPU", device="cpu", commit=current_commit(),
                torch=torch.__version__, transformers=transformers.__version__,
                command=" ".join(["python -m benchmarks.kv_accuracy", *given]),
                reference_cache=REFERENCE_DTYPE, model_dtype=args.dtype, steps=args.steps,
                eval_prompt_lengths=list(EVAL_LENGTHS), calibration_prompt_lengths=list(CALIBRATION_LENGTHS),
                outlier_recipe=dict(dataclasses.asdict(recipe), description=recipe.describe()),
                implementations=[dict(op=o, mode=m, chosen=c) for o, m, c in chosen],
                seconds=round(elapsed, 1))
    if not args.no_write:
        path = os.path.join(args.out, f"kv_accuracy-{meta['date']}.json")
        write_json(path, dict(meta=meta, results=results, failed=failed))
        print(f"wrote {path}", file=sys.stderr)

    print(long_table(results))
    print()
    print(magnitudes_table(results))
    for note in skipped_notes(results):
        print(f"skipped: {note}")
    for f in failed:
        print(f"failed: {f['model']} ({'outliers' if f['with_outliers'] else 'as built'}): {f['error']}")
    if args.markdown:
        both = len(recipes) == 2
        for metric, title in (("rel_l2", "relative L2 error of the logits"), ("max_abs", "max abs error"),
                              ("top1", "greedy top-1 agreement over the decode steps")):
            print(f"\n{title}{' (with outliers / as built)' if both else ''}:\n\n{pivot_table(results, metric)}")
    print(f"\n{len(models)} models x {len(formats)} formats x {len(recipes)} variants in {elapsed:.1f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
