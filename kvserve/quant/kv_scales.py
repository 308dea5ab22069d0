"""Per-layer KV-cache scales from the checkpoint, with vLLM's names, sentinels, rules and warnings.

Loading (vLLM ``LlamaModel.load_weights``): a checkpoint tensor whose name holds ``scale`` or
``zero_point`` is mapped to an attention layer's ``{k,v,q,prob}_scale`` by ``get_cache_scale``
(``k_proj.output_scale`` style) or ``maybe_remap_kv_scale_name`` (ModelOpt
``self_attn.k_proj.k_scale``, compressed-tensors ``self_attn.k_scale``, deprecated ``kv_scale``,
...); a mapped name the model lacks is dropped with a warning.

After loading (vLLM ``BaseKVCacheMethod.process_weights_after_loading``): for an fp8 cache, both
k/v scales loaded -> used; none -> 1.0; only one -> used for both (the max against the -1.0
sentinel); more than one element -> ``ValueError``; q/prob scales default to 1.0. Compressed-tensors
checkpoints take their loaded scales as they are (ones by default, no warnings). A checkpoint
without a quantization config has no scale parameters: its cache scales are 1.0. kvserve also
rejects zero, negative, NaN and infinite scales, naming the layer.
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Iterator

import torch
from torch import nn

from kvserve.logger import init_logger
from kvserve.quant.kv_cache_dtype import KVCacheDtype, KVQuantConfig

logger = init_logger(__name__)

SCALE_NAMES = ("k_scale", "v_scale", "q_scale", "prob_scale")
_ZERO_POINTS = ("k_zero_point", "v_zero_point", "q_zero_point")

# vLLM get_cache_scale (Fp8Config / Quark / older compressed-tensors): output_scale names.
_CACHE_SCALE_SUFFIXES = {
    ".k_proj.output_scale": ".attn.k_scale",
    ".v_proj.output_scale": ".attn.v_scale",
    ".q_proj.output_scale": ".attn.q_scale",
    "self_attn.prob_output_scale": "self_attn.attn.prob_scale",
}
# vLLM maybe_remap_kv_scale_name: names it considers, then the first matching rule wins.
_REMAP_SUFFIXES = (".k_scale", ".v_scale", ".q_scale", ".k_zero_point", ".v_zero_point", ".q_zero_point",
                   ".q.scale", ".k_cache.scale", ".v_cache.scale")
_REMAP_RULES = [
    (re.compile(r"\.self_attn\.[kv]_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),  # ModelOpt
    (re.compile(r"\.self_attn\.qkv_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"\.self_attn\.qkqkv_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"\.mixer\.[kv]_proj\.([kv])_scale$"), r".mixer.attn.\1_scale"),  # NemotronH
    (re.compile(r"\.self_attn\.q\.scale$"), r".self_attn.attn.q_scale"),
    (re.compile(r"\.self_attn\.([kv])_cache\.scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"\.([qkv])_scale$"), r".attn.\1_scale"),  # compressed-tensors, fp8 checkpoints
    (re.compile(r"\.([qkv])_zero_point$"), r".attn.\1_zero_point"),
]

MSG_KV_PER_TENSOR = "Only support per-tensor scaling factor for fp8 KV cache"
MSG_QP_PER_TENSOR = "Only support per-tensor scaling factorfor fp8-quantized Q/prob"  # sic (vLLM)
MSG_KV_SCALE_DEPRECATED = (
    "DEPRECATED. Found kv_scale in the checkpoint. This format is deprecated in favor of separate "
    "k_scale and v_scale tensors and will be removed in a future release. Functionally, we will "
    "remap kv_scale to k_scale and duplicate k_scale to v_scale"
)
MSG_NO_Q_SCALE = (
    "Checkpoint does not provide a q scaling factor. Setting it to k_scale. This only matters for "
    "FP8 Attention backends (flash-attn or flashinfer)."
)
MSG_SCALE_ONE = (
    "Using KV cache scaling factor 1.0 for fp8_e4m3. If this is unintended, verify that "
    "k/v_scale scaling factors are properly set in the checkpoint."
)


def _not_loaded(kind: str, name: str, remapped: str) -> str:
    return (
        f"Found {kind} in the checkpoint (e.g. {name}), but not found the expected name in the model "
        f"(e.g. {remapped}). {kind} is not loaded."
    )


def _uncalibrated(q: float, prob: float) -> str:
    return (
        f"Using uncalibrated q_scale {q} and/or prob_scale {prob} with fp8 attention. This may cause "
        "accuracy issues. Please make sure q/prob scaling factors are available in the fp8 checkpoint."
    )


class KVScaleLoader:
    """Takes the scale tensors out of a checkpoint stream, then sets each attention layer's scales.

    ``layers``: module path -> attention layer (anything with the four ``*_scale`` float attributes).
    """

    def __init__(self, layers: dict[str, nn.Module], quant: KVQuantConfig):
        self.layers = layers
        self.quant = quant
        names = SCALE_NAMES + (_ZERO_POINTS if quant.method == "compressed-tensors" else ())
        # Without a quantization config the model has no scale parameters (as in vLLM).
        self.targets = {f"{p}.{n}" for p in layers for n in names} if quant.method else set()
        self.loaded: dict[str, dict[str, torch.Tensor]] = {p: {} for p in layers}
        self._warnings: list[str] = []

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warnings:
            self._warnings.append(msg)
            logger.warning(msg)

    def remap(self, name: str) -> str | None:
        """A checkpoint scale name -> the model's name; ``None``: dropped (with a warning)."""
        if name in self.targets:
            return name
        if self.quant.method:
            for suffix, repl in _CACHE_SCALE_SUFFIXES.items():
                if name.endswith(suffix):
                    remapped = name[: -len(suffix)] + repl
                    if remapped not in self.targets:
                        self._warn_once(_not_loaded(remapped.rsplit(".", 1)[1], name, remapped))
                        return None
                    return remapped
        if name.endswith(".kv_scale"):
            self._warn_once(MSG_KV_SCALE_DEPRECATED)
            remapped = name.replace(".kv_scale", ".attn.k_scale")
            if remapped not in self.targets:
                self._warn_once(_not_loaded("kv_scale", name, remapped))
                return None
            return remapped
        if name.endswith(_REMAP_SUFFIXES):
            for pattern, repl in _REMAP_RULES:
                if pattern.search(name):
                    remapped = pattern.sub(repl, name)
                    if remapped not in self.targets:
                        kind = remapped.rsplit(".", 1)[1]
                        self._warn_once(_not_loaded(kind, name, remapped))
                        return None
                    return remapped
        return name

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass through every tensor except KV scales, which are kept (or dropped with a warning)."""
        for name, tensor in weights:
            if "scale" not in name and "zero_point" not in name:
                yield name, tensor
                continue
            target = self.remap(name)
            if target is None:
                continue
            if target not in self.targets:
                yield name, tensor  # not a KV scale: the model's own loader decides
                continue
            layer, kind = target.rsplit(".", 1)
            self.loaded[layer][kind] = tensor.detach().to("cpu", torch.float32)

    def finish(self, kv_dtype: KVCacheDtype) -> None:
        """Set every layer's final scales (vLLM's rules for this cache dtype) and log the outcome."""
        for path, layer in self.layers.items():
            k, v, q, prob = self._layer_scales(path, kv_dtype)
            layer.k_scale, layer.v_scale, layer.q_scale, layer.prob_scale = k, v, q, prob
        if kv_dtype.is_fp8:
            n = sum(1 for p in self.layers if "k_scale" in self.loaded[p] or "v_scale" in self.loaded[p])
            ks = [layer.k_scale for layer in self.layers.values()]
            vs = [layer.v_scale for layer in self.layers.values()]
            logger.info(
                "KV cache scales: loaded for %d/%d attention layers; k_scale %.4g..%.4g, v_scale %.4g..%.4g",
                n, len(self.layers), min(ks), max(ks), min(vs), max(vs),
            )
        elif any(self.loaded[p] for p in self.layers):
            logger.info("KV cache scales in the checkpoint are not used: the cache dtype is %s.", kv_dtype.name)

    def _value(self, path: str, kind: str, per_tensor_msg: str) -> float | None:
        """A loaded scale as a float (``None`` if absent); errors on shape or a bad value."""
        t = self.loaded[path].get(kind)
        if t is None:
            return None
        if t.numel() != 1:
            raise ValueError(f"{per_tensor_msg} ({path}.{kind} has shape {list(t.shape)})")
        value = float(t.reshape(()))
        if not math.isfinite(value) or value <= 0.0:
            raise ValueError(
                f"Invalid {kind} {value} for attention layer {path}: KV cache scales must be finite "
                "and positive."
            )
        return value

    def _layer_scales(self, path: str, kv_dtype: KVCacheDtype) -> tuple[float, float, float, float]:
        method = self.quant.method
        q = self._value(path, "q_scale", MSG_QP_PER_TENSOR) if method else None
        prob = self._value(path, "prob_scale", MSG_QP_PER_TENSOR) if method else None
        if method is None or not kv_dtype.is_fp8:
            return 1.0, 1.0, q or 1.0, prob or 1.0  # scales are not used by a float cache
        k = self._value(path, "k_scale", MSG_KV_PER_TENSOR)
        v = self._value(path, "v_scale", MSG_KV_PER_TENSOR)
        if method == "compressed-tensors":  # parameters start at 1.0; no sentinel rules, no warnings
            return k or 1.0, v or 1.0, q or 1.0, 1.0
        if k is not None and v is not None:
            pass
        elif k is None and v is None:
            k = v = 1.0
        else:  # one of them: vLLM takes max(k_scale, v_scale) against the -1.0 sentinel
            k = v = max(x for x in (k, v) if x is not None)
        if q is None:
            self._warn_once(MSG_NO_Q_SCALE)
        if k == 1.0 and v == 1.0 and "e5m2" not in kv_dtype.name:
            self._warn_once(MSG_SCALE_ONE)
        q, prob = q or 1.0, prob or 1.0
        if kv_dtype.name == "fp8" and (q == 1.0 or prob == 1.0):
            self._warn_once(_uncalibrated(q, prob))
        return k, v, q, prob
