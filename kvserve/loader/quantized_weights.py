"""ModelOpt quantized checkpoint tensors -> dense weights, dequantized once while loading (or kept
as stored for the NVFP4 layers that run the W4A16 GEMM and the FP8 ones that run the FP8 GEMM).

The reference path of issue 15 (CPU, and CUDA until the W4A16 / FP8 GEMMs exist): each quantized
Linear's tensors (``<m>.weight`` packed NVFP4 uint8 or float8_e4m3fn, ``<m>.weight_scale``,
``<m>.weight_scale_2``; ``<m>.input_scale`` dropped as vLLM drops it on Hopper's weight-only
path) become one float32 ``<m>.weight`` in the doc's exact order (``quant/nvfp4.py``); the model's
loader then casts it to the model dtype (one rounding, the same as dequantizing to that dtype).
On-disk dtypes decide the format (uint8 = NVFP4, float8_e4m3fn = FP8) and must agree with the
checkpoint's config for that module (a float weight only where MIXED_PRECISION lists the module:
a single-algo config names its exclusions, not its norms); a module whose tensors are incomplete
or mis-shaped fails with an error naming them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from kvserve.loader.weights import WeightLoadError
from kvserve.quant.modelopt import ModelOptConfig
from kvserve.quant.nvfp4 import dequantize_fp8_per_tensor, dequantize_nvfp4

_PARTS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_FORMAT_OF_DTYPE = {torch.uint8: "NVFP4", torch.float8_e4m3fn: "FP8"}
_FAMILY = {"NVFP4": "NVFP4", "W4A16_NVFP4": "NVFP4", "FP8": "FP8"}
_NEEDS = {"NVFP4": ("weight_scale", "weight_scale_2"), "FP8": ("weight_scale",)}
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.\w+$")


def _config_format(qc: ModelOptConfig, prefix: str) -> str | None:
    """The format the config gives module ``prefix`` (per-expert names take their experts
    module's entry, which is how ModelOpt names routed experts)."""
    q = qc.layer_quant(prefix)
    m = _EXPERT.match(prefix)
    if q is None and m and qc.quant_algo == "MIXED_PRECISION":
        q = qc.layer_quant(m.group(1))
    return None if q is None else _FAMILY[q.algo]


def _dequantize(prefix: str, fmt: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    try:
        if fmt == "NVFP4":
            return dequantize_nvfp4(parts["weight"], parts["weight_scale"], parts["weight_scale_2"], torch.float32)
        return dequantize_fp8_per_tensor(parts["weight"], parts["weight_scale"], torch.float32)
    except ValueError as e:
        raise WeightLoadError(f"ModelOpt {fmt} tensors of {prefix} do not match: {e}") from None


def _needs(fmt: str, kept: bool) -> tuple[str, ...]:
    """The scales a module's weight needs: an FP8 module kept for the FP8 GEMM also its input scale."""
    return (*_NEEDS[fmt], "input_scale") if kept and fmt == "FP8" else _NEEDS[fmt]


def _kept(prefix: str, fmt: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """A module kept quantized (``layers/quant_linear.py``): its tensors as they are, the per-tensor
    scales (NVFP4 ``weight_scale_2``; FP8 ``weight_scale`` and ``input_scale``) once per output row."""
    rows = parts["weight"].shape[0]
    per_row = ("weight_scale_2",) if fmt == "NVFP4" else ("weight_scale", "input_scale")
    for part in per_row:
        s = parts[part]
        if s.dtype != torch.float32 or s.numel() != 1:
            raise WeightLoadError(f"{prefix}.{part} must be one float32 value, got {tuple(s.shape)} {s.dtype}")
    yield f"{prefix}.weight", parts["weight"]
    if fmt == "NVFP4":  # (a W4A4 export's input_scale is dropped: weight-only on Hopper)
        yield f"{prefix}.weight_scale", parts["weight_scale"]
    for part in per_row:
        yield f"{prefix}.{part}", parts[part].reshape(1).expand(rows).contiguous()


def dequantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]], qc: ModelOptConfig, keep: set[str] | frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass unquantized tensors through; yield each quantized module's dense float32 weight once
    its weight and scales have all been read (in any order, across files). Modules in ``keep``
    (NVFP4 layers that run the W4A16 GEMM) keep their packed tensors."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS or not prefix:
            yield name, tensor
            continue
        if part == "weight" and tensor.dtype not in _FORMAT_OF_DTYPE:
            # a single-algo config covers every Linear but cannot tell a norm's weight from one:
            # only MIXED_PRECISION's explicit map (or stray scales) makes a float weight an error
            listed = qc.quant_algo == "MIXED_PRECISION" and _config_format(qc, prefix) is not None
            if prefix in pending or listed:
                raise WeightLoadError(
                    f"{name} is {tensor.dtype} on disk, but the checkpoint's quantization config "
                    f"({qc.source}) makes {prefix} {_config_format(qc, prefix) or 'quantized'}: the export is malformed"
                )
            yield name, tensor
            continue
        if part == "input_scale" and prefix not in keep:
            continue  # static activation scale: only the FP8 GEMM uses it (the NVFP4 W4A16 path drops it)
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        weight = parts.get("weight")
        if weight is None:
            continue
        fmt = _FORMAT_OF_DTYPE[weight.dtype]
        want = _config_format(qc, prefix)
        if want != fmt:
            raise WeightLoadError(
                f"{prefix}.weight is {weight.dtype} on disk ({fmt}), but the checkpoint's quantization config "
                f"({qc.source}) makes {prefix} {want or 'unquantized'}"
            )
        if all(p in parts for p in _needs(fmt, prefix in keep)):
            if prefix in keep:
                yield from _kept(prefix, fmt, parts)
            else:
                yield f"{prefix}.weight", _dequantize(prefix, fmt, parts)
            del pending[prefix]
    if pending:
        problems = []
        for prefix, parts in sorted(pending.items()):
            fmt = _FORMAT_OF_DTYPE.get(parts["weight"].dtype) if "weight" in parts else None
            need = ("weight", *_needs(fmt, prefix in keep)) if fmt else ("weight",)
            problems.append(f"{prefix}: missing {[f'{prefix}.{p}' for p in need if p not in parts]}")
        raise WeightLoadError("Incomplete ModelOpt quantized tensors: " + "; ".join(problems[:10]))
