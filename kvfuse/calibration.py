"""Static K/V scales from a few forward passes: ``kvfuse.calibrate_scales``.

For every quantized :class:`kvfuse.PagedAttention` layer of a model (built on kvfuse layers, or
a Hugging Face model after :func:`kvfuse.integrations.transformers.enable`, whose attention
modules hold one), a forward pre-hook watches the K and V rows the layer is about to write and
keeps their absolute maximum, per tensor or per KV head. Each scale is then::

    FP8:    scale = amax / fp8_max          (448 for e4m3, 57344 for e5m2)
    NVFP4:  global scale = amax / (448 * 6) (the largest e4m3 block scale times the largest E2M1 value)

so the largest value seen maps to the format's largest finite value. Only tokens that are
written count (slot_mapping >= 0: padding never enters the cache); NaN and +-inf are ignored.

A layer's scale is updated in the pre-hook, before its own write, from everything seen so far.
Later layers therefore see inputs computed through caches encoded with calibrated scales, not
with the defaults (1.0), whose rounding would otherwise distort what they observe. Rows cached
in an earlier calibration step were encoded with the scale of that step: calibrate on whole
prompts (prefill), and start inference on fresh caches afterwards.

Skip layers (mode NONE) have no scales and are left untouched. Calibrate the eager model: hooks
do not run inside a graph compiled before they were installed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from .kv_cache import KVQuantMode, KVScaleGranularity, fp8_max, parse_kv_scale_granularity
from .layers import PagedAttention

logger = logging.getLogger(__name__)

__all__ = ["calibrate_scales", "ScaleCalibration", "format_max"]

#: NVFP4's largest encodable magnitude per unit of global scale: e4m3 block scale 448 times E2M1's 6.
NVFP4_GLOBAL_MAX = 448.0 * 6.0


def format_max(mode: KVQuantMode) -> float:
    """The value a calibrated scale maps the observed amax to: the format's largest finite value
    (FP8), or 448 * 6 (NVFP4's global scale)."""
    mode = KVQuantMode(mode)
    if mode.is_fp8:
        return fp8_max(mode)
    if mode is KVQuantMode.NVFP4:
        return NVFP4_GLOBAL_MAX
    raise ValueError(f"kv_quant_mode={mode.name} has no scales to calibrate")


@dataclass(frozen=True)
class ScaleCalibration:
    """What :func:`calibrate_scales` observed and set for one layer.

    ``k_amax``/``v_amax``/``k_scale``/``v_scale`` are floats (per tensor) or lists with one value
    per KV head of this rank (per head).
    """

    layer_name: str
    kv_quant_mode: KVQuantMode
    granularity: KVScaleGranularity
    tokens: int
    k_amax: Union[float, list]
    v_amax: Union[float, list]
    k_scale: Union[float, list]
    v_scale: Union[float, list]
    #: The V side's mode (``kv_quant_mode`` is the K side's; they differ in mixed formats, whose
    #: unquantized or per-token-head side keeps its scale unchanged).
    v_quant_mode: Optional[KVQuantMode] = None

    def __post_init__(self) -> None:
        if not isinstance(self.granularity, KVScaleGranularity):
            raise ValueError(f"granularity={self.granularity!r} must be a KVScaleGranularity")
        if not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"tokens={self.tokens!r} must be an int >= 0")


class _Observer:
    """Running amax of one layer's K and V (float32, on the layer's device)."""

    def __init__(self, layer: PagedAttention, granularity: KVScaleGranularity) -> None:
        self.layer = layer
        self.granularity = granularity
        self.k_amax: Optional[torch.Tensor] = None
        self.v_amax: Optional[torch.Tensor] = None
        self.tokens = 0
        self.k_initial = layer.k_scale.detach().clone()
        self.v_initial = layer.v_scale.detach().clone()

    def _amax(self, x: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        xf = x.detach().float()
        if valid is not None:
            xf = xf[valid]
        a = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros((), device=xf.device))
        if self.granularity is KVScaleGranularity.HEAD:
            return a.amax(dim=(0, 2)) if a.shape[0] else a.new_zeros(a.shape[1])
        return a.amax() if a.numel() else a.new_zeros(())

    def observe(self, key: torch.Tensor, value: torch.Tensor, metadata: Any) -> None:
        slots = getattr(metadata, "slot_mapping", None)
        valid = slots >= 0 if isinstance(slots, torch.Tensor) and slots.shape[0] == key.shape[0] else None
        k, v = self._amax(key, valid), self._amax(value, valid)
        self.k_amax = k if self.k_amax is None else torch.maximum(self.k_amax, k)
        self.v_amax = v if self.v_amax is None else torch.maximum(self.v_amax, v)
        self.tokens += int(valid.sum()) if valid is not None else key.shape[0]
        self.apply()

    def _scale(self, amax: Optional[torch.Tensor], initial: torch.Tensor, mode: KVQuantMode) -> torch.Tensor:
        # A side without static scales (unquantized, per-token-head) keeps its unread placeholder.
        if amax is None or not mode.has_static_scales:
            return initial
        # A head (or tensor) that was all zeros has no amax: it keeps its scale rather than get 0.
        return torch.where(amax > 0, amax / format_max(mode), initial.to(amax.device))

    def apply(self) -> None:
        fmt = self.layer.spec.kv_format
        self.layer.set_scales(self._scale(self.k_amax, self.k_initial, fmt.key),
                              self._scale(self.v_amax, self.v_initial, fmt.value))

    def summary(self) -> ScaleCalibration:
        def plain(t: Optional[torch.Tensor]):
            if t is None:
                return None
            return t.tolist() if t.dim() else float(t)

        return ScaleCalibration(
            layer_name=self.layer.layer_name, kv_quant_mode=self.layer.spec.kv_quant_mode,
            v_quant_mode=self.layer.spec.kv_format.value,
            granularity=self.granularity, tokens=self.tokens, k_amax=plain(self.k_amax), v_amax=plain(self.v_amax),
            k_scale=plain(self.layer.k_scale), v_scale=plain(self.layer.v_scale))


def _default_forward(model: nn.Module) -> Callable[[Any], Any]:
    def forward(batch):
        if isinstance(batch, dict):
            return model(**batch)
        if isinstance(batch, (tuple, list)):
            return model(*batch)
        return model(batch)

    return forward


def calibrate_scales(
    model: nn.Module,
    batches: Iterable[Any],
    granularity: Union[str, KVScaleGranularity, None] = None,
    *,
    forward: Optional[Callable[[Any], Any]] = None,
) -> dict[str, ScaleCalibration]:
    """Set every quantized kvfuse layer's ``k_scale``/``v_scale`` from K/V amax over ``batches``.

    ``batches``: the calibration inputs; each is passed to ``forward`` (default: ``model(**b)``
    for a dict, ``model(*b)`` for a tuple or list, else ``model(b)``). Give ``forward`` when one
    batch is more than one call (the demo model's paged steps, for instance).
    ``granularity``: ``"tensor"``, ``"head"`` (vLLM's ``"attn_head"``) or None for each layer's
    own (``KVCacheConfig.kv_scale_granularity``). Per-tensor calibration of a per-head layer
    gives every head the tensor's scale; per-head calibration of a per-tensor layer is refused
    (build it with ``kv_scale_granularity="head"``).

    Returns ``{layer_name: ScaleCalibration}`` for the quantized layers, in model order. A layer
    that saw no token keeps its scales (and is reported with ``tokens=0``).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model is a {type(model).__name__}; expected a torch.nn.Module holding "
                         f"kvfuse.PagedAttention layers")
    wanted = None if granularity is None else parse_kv_scale_granularity(granularity, "granularity")
    if forward is not None and not callable(forward):
        raise ValueError(f"forward={forward!r} must be callable (it runs one calibration batch)")
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no kvfuse.PagedAttention layer to calibrate (for a Hugging "
                         f"Face model call kvfuse.integrations.transformers.enable first)")
    observers: list[_Observer] = []
    for layer in layers:
        spec = layer.spec
        if not spec.kv_format.has_static_scales:
            # NONE has no scales; FP8_PER_TOKEN_HEAD computes each row's scale as it writes the row.
            logger.debug("layer %s: %s cache, no scales to calibrate", layer.layer_name, spec.kv_format.name)
            continue
        own = spec.scale_granularity
        chosen = wanted or own
        if chosen is KVScaleGranularity.HEAD and own is not KVScaleGranularity.HEAD:
            raise ValueError(f"granularity={chosen.value!r}: layer {layer.layer_name!r} holds one scale per tensor; "
                             f"build it with KVCacheConfig(kv_scale_granularity='head') for per-head scales, or "
                             f"calibrate with granularity='tensor'")
        observers.append(_Observer(layer, chosen))
    run = forward if forward is not None else _default_forward(model)

    def hook_for(observer: _Observer):
        def pre_hook(module, args, kwargs):
            key = args[1] if len(args) > 1 else kwargs.get("key")
            value = args[2] if len(args) > 2 else kwargs.get("value")
            metadata = args[4] if len(args) > 4 else kwargs.get("metadata")
            if isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor):
                observer.observe(key, value, metadata)

        return pre_hook

    handles = [o.layer.register_forward_pre_hook(hook_for(o), with_kwargs=True) for o in observers]
    count = 0
    try:
        with torch.no_grad():
            for batch in batches:
                run(batch)
                count += 1
    finally:
        for handle in handles:
            handle.remove()
    if count == 0:
        raise ValueError("batches is empty: calibration needs at least one forward pass")
    result = {o.layer.layer_name: o.summary() for o in observers}
    for name, r in result.items():
        if r.tokens == 0:
            logger.warning("layer %s: no token reached it during calibration; its scales are unchanged", name)
    logger.info("calibrated K/V scales of %d layers over %d batches", len(result), count)
    return result
