"""Test fixture builder: a checkpoint folder plus an FP8-KV quantization config and KV scale tensors.

The weights are symlinked from a base folder (the default model or a tiny one); the scales go into
an extra ``kv_scales.safetensors``, named as the producer names them:

- ``modelopt``: ``hf_quant_config.json`` (ModelOpt <= 0.29 layout, ``kv_cache_quant_algo: FP8``)
  and ``model.layers.N.self_attn.{k,v}_proj.{k,v}_scale`` 0-d tensors;
- ``modelopt-inline``: the same config as ``config.json`` ``quantization_config`` (ModelOpt >= 0.31);
- ``compressed-tensors``: ``config.json`` ``quantization_config`` with ``kv_cache_scheme``
  (8-bit float, per tensor) and ``model.layers.N.self_attn.{k,v}_scale`` tensors of shape [1].
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

MODELOPT_QUANT_CONFIG = {
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]},
}
CT_QUANT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {},
    "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
}
FORMS = ("modelopt", "modelopt-inline", "compressed-tensors")


def scaled_kv_scales(shared_eval: Path) -> tuple[list[float], list[float]]:
    """The per-layer k/v scales of ``kv_scales_scaled.json`` (exact float32 values)."""
    layers = json.loads((shared_eval / "kv_scales_scaled.json").read_text())["layers"]
    return [layer["k_scale"] for layer in layers], [layer["v_scale"] for layer in layers]


def scale_tensors(form: str, k_scales: list[float] | None, v_scales: list[float] | None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for kind, values in (("k", k_scales), ("v", v_scales)):
        for i, value in enumerate(values or []):
            if form == "compressed-tensors":
                out[f"model.layers.{i}.self_attn.{kind}_scale"] = torch.tensor([value], dtype=torch.float32)
            else:
                out[f"model.layers.{i}.self_attn.{kind}_proj.{kind}_scale"] = torch.tensor(value, dtype=torch.float32)
    return out


def make_fp8_checkpoint(
    base: Path,
    dest: Path,
    form: str = "modelopt",
    k_scales: list[float] | None = None,
    v_scales: list[float] | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    quant_config: dict | None = None,
) -> Path:
    """``base`` + an FP8-KV config of ``form`` + scale tensors -> ``dest`` (returned)."""
    from safetensors.torch import save_file

    if form not in FORMS:
        raise ValueError(f"form {form!r}; expected one of {FORMS}")
    dest.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name not in ("config.json", "hf_quant_config.json") and not (dest / f.name).exists():
            os.symlink(f.resolve(), dest / f.name)
    config = json.loads((base / "config.json").read_text())
    if form == "modelopt":
        (dest / "hf_quant_config.json").write_text(json.dumps(quant_config or MODELOPT_QUANT_CONFIG, indent=1))
    elif form == "modelopt-inline":
        qc = quant_config or {"quant_method": "modelopt", **MODELOPT_QUANT_CONFIG["quantization"]}
        config["quantization_config"] = qc
    else:
        config["quantization_config"] = quant_config or CT_QUANT_CONFIG
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    tensors = scale_tensors(form, k_scales, v_scales)
    tensors.update(extra_tensors or {})
    if tensors:
        save_file(tensors, str(dest / "kv_scales.safetensors"))
    return dest
