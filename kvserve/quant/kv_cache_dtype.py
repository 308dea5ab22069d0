"""``--kv-cache-dtype``: accepted values, ``auto`` resolution from the checkpoint, storage dtypes.

Mirrors vLLM (``CacheConfig.cache_dtype``, ``resolve_kv_cache_dtype_string``): ``auto`` is the model
dtype unless the checkpoint's quantization config declares an FP8 KV cache (ModelOpt
``kv_cache_quant_algo: FP8`` / ``kv_cache_scheme``, compressed-tensors ``kv_cache_scheme``), which
resolves to ``fp8_e4m3``. An explicit value always wins. fp8 caches are stored as ``torch.uint8``
and viewed as ``float8_e4m3fn`` / ``float8_e5m2`` when read or written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.choices import KV_CACHE_DTYPE_CHOICES

# What the checkpoint's KV algorithm string maps to (vLLM's MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP, fp8 only).
_CHECKPOINT_KV_ALGOS = {"fp8": "fp8_e4m3"}

_FP8_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "fp8": (torch.float8_e4m3fn, 448.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
}
_FLOAT_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class KVQuantConfig:
    """The checkpoint's KV-cache quantization: which scale method its attention layers use.

    ``method``: ``None`` (unquantized checkpoint: no scale parameters, scales stay 1.0), ``"base"``
    (ModelOpt / fp8 checkpoints: vLLM's ``BaseKVCacheMethod`` rules) or ``"compressed-tensors"``.
    ``kv_cache_dtype``: what the checkpoint declares for the cache (``None``: nothing).
    """

    method: str | None = None
    kv_cache_dtype: str | None = None
    source: str = ""  # where it was read, for log lines
    quant_method: str | None = None  # the raw ``quant_method`` string


@dataclass(frozen=True)
class KVCacheDtype:
    """A resolved cache dtype: its name, where it came from, and how it is stored."""

    name: str  # "float32" | "bfloat16" | "float16" | "fp8" | "fp8_e4m3" | "fp8_e5m2"
    origin: str  # human-readable: "--kv-cache-dtype", "the checkpoint (...)", "auto: the model dtype"

    @property
    def is_fp8(self) -> bool:
        return self.name in _FP8_FORMATS

    @property
    def storage_dtype(self) -> torch.dtype:
        """What the cache tensor is allocated as (vLLM's ``STR_DTYPE_TO_TORCH_DTYPE``)."""
        if self.is_fp8:
            return torch.uint8
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.name]

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        """The dtype fp8 bytes are viewed as (``None`` for a float cache)."""
        return _FP8_FORMATS[self.name][0] if self.is_fp8 else None

    @property
    def fp8_max(self) -> float:
        """Largest finite value of the fp8 format: the store saturates there."""
        return _FP8_FORMATS[self.name][1]


def _inner(qc: dict[str, Any]) -> dict[str, Any]:
    inner = qc.get("quantization")
    return inner if isinstance(inner, dict) else qc


def _kv_candidate(qc: dict[str, Any]) -> Any:
    """vLLM's order: inner kv_cache_scheme, outer kv_cache_scheme, inner/outer kv_cache_quant_algo."""
    inner = _inner(qc)
    for value in (inner.get("kv_cache_scheme"), qc.get("kv_cache_scheme"),
                  inner.get("kv_cache_quant_algo"), qc.get("kv_cache_quant_algo")):
        if value:
            return value
    return None


def _scheme_dtype(scheme: dict[str, Any], where: str) -> str:
    """A ``kv_cache_scheme`` dict: static 8-bit float -> fp8_e4m3; anything else is an error."""
    if scheme.get("num_bits") == 8 and scheme.get("type") == "float" and scheme.get("dynamic") is False:
        return "fp8_e4m3"
    raise ValueError(
        f"Unknown kv_cache_scheme {scheme!r} in {where}. kvserve supports a static 8-bit float KV "
        "cache scheme ({'num_bits': 8, 'type': 'float', 'dynamic': false}) -> fp8_e4m3."
    )


def read_quant_config(model_dir: str | Path, raw_config: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The checkpoint's quantization config and where it was read: ``config.json``
    ``quantization_config`` or, when that is absent, ``hf_quant_config.json`` beside it (ModelOpt
    <= 0.29 layout). ``(None, "")`` for an unquantized checkpoint."""
    qc = raw_config.get("quantization_config")
    if isinstance(qc, dict):
        return qc, "config.json quantization_config"
    legacy = Path(model_dir) / "hf_quant_config.json"
    if legacy.is_file():
        with open(legacy) as f:
            qc = json.load(f)
        if isinstance(qc, dict):
            return qc, "hf_quant_config.json"
    return None, ""


def checkpoint_quant_method(qc: dict[str, Any]) -> str:
    """The config's ``quant_method``, lower-cased as vLLM does (``""`` when absent); a legacy
    ModelOpt file (producer ``modelopt`` or a ``quantization`` section) is ``"modelopt"``."""
    quant_method = str(qc.get("quant_method") or "").lower().replace("compressed_tensors", "compressed-tensors")
    producer = qc.get("producer") if isinstance(qc.get("producer"), dict) else {}
    if not quant_method and (str(producer.get("name", "")).lower() == "modelopt" or "quantization" in qc):
        quant_method = "modelopt"  # legacy ModelOpt file: vLLM injects quant_method
    return quant_method


def read_kv_quant_config(model_dir: str | Path, raw_config: dict[str, Any]) -> KVQuantConfig:
    """The checkpoint's KV-cache quantization (the config found by ``read_quant_config``)."""
    qc, where = read_quant_config(model_dir, raw_config)
    if qc is None:
        return KVQuantConfig()
    quant_method = checkpoint_quant_method(qc)

    candidate = _kv_candidate(qc)
    if quant_method == "compressed-tensors":
        scheme = qc.get("kv_cache_scheme")
        if not scheme:
            return KVQuantConfig("compressed-tensors", None, where, quant_method)
        if not isinstance(scheme, dict):
            raise ValueError(f"kv_cache_scheme in {where} must be a dict, got {scheme!r}.")
        strategy = scheme.get("strategy", "tensor")
        if strategy != "tensor" or scheme.get("symmetric", True) is not True:
            raise ValueError(
                f"Only support per-tensor scaling factor for compressed-tensors KV cache. Got "
                f"kv_cache_scheme strategy={strategy!r}, symmetric={scheme.get('symmetric', True)!r} in {where}; "
                "kvserve accepts strategy 'tensor' with symmetric true."
            )
        return KVQuantConfig("compressed-tensors", _scheme_dtype(scheme, where), f"{where} kv_cache_scheme", quant_method)

    if quant_method == "fp8":  # Fp8Config: loads KV scales, never changes the cache dtype (vLLM TODO)
        return KVQuantConfig("base", None, where, quant_method)
    if quant_method.startswith("modelopt"):
        if candidate is None:
            return KVQuantConfig("base", None, where, quant_method)
        if isinstance(candidate, dict):
            return KVQuantConfig("base", _scheme_dtype(candidate, where), f"{where} kv_cache_scheme", quant_method)
        algo = str(candidate).lower()
        if algo not in _CHECKPOINT_KV_ALGOS:
            raise ValueError(
                f"Unknown kv_cache_quant_algo {candidate!r} in {where}. Supported values: "
                f"{sorted(a.upper() for a in _CHECKPOINT_KV_ALGOS)}."
            )
        return KVQuantConfig("base", _CHECKPOINT_KV_ALGOS[algo], f"{where} kv_cache_quant_algo={candidate}", quant_method)
    # Other quantization methods (gguf, awq, ...) never change the cache dtype in vLLM.
    return KVQuantConfig(None, None, where, quant_method or None)


def resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype, quant: KVQuantConfig) -> KVCacheDtype:
    """``--kv-cache-dtype`` -> the cache dtype. Explicit values win over the checkpoint."""
    if requested not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(
            f"kv_cache_dtype {requested!r} is not supported. kvserve accepts: {KV_CACHE_DTYPE_CHOICES}"
        )
    if requested == "auto":
        if quant.kv_cache_dtype is not None:
            return KVCacheDtype(quant.kv_cache_dtype, f"the checkpoint ({quant.source})")
        return KVCacheDtype(_FLOAT_NAMES[model_dtype], "auto: the model dtype")
    return KVCacheDtype(requested, "--kv-cache-dtype")
