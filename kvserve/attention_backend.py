"""``--attention-backend``: vLLM's backend names for what kvserve runs, chosen as vLLM's selector
chooses on that device, dtype and KV dtype, and logged with the reason.

kvserve has two kernel families: ``reference`` (plain torch, any device) and ``triton`` (the fused
paged kernels: CUDA, or the Triton interpreter). The names differ only in how e4m3 pages are read:

- ``FLASH_ATTN`` (FlashAttention 3, vLLM's default on Hopper): the query is quantized to e4m3 with
  the layer's q_scale, Q K^T and P V run on fp8 values, P is scaled by 2^8 before its e4m3 rounding
  (FA3's ``Max_offset``). bf16 / fp16 models, head size <= 256 and a multiple of 8; fp8 pages on
  sm_90 only (vLLM: FA3 there, FA2 elsewhere, which has no fp8).
- ``TRITON_ATTN`` (vLLM's Triton kernel, which takes the quantized query on CUDA since the layer
  quantizes it): the same with P unscaled. Any dtype.
- ``triton`` (kvserve's own): K and V dequantized to the query's dtype, the query kept (vLLM's
  TRITON_ATTN off CUDA, where the query is not quantized).
- ``reference``: plain torch, the dequantized read.

With bf16 / fp16 / fp32 pages, and with e5m2 pages (vLLM quantizes the query for e4m3 pages only),
the three triton names run the same kernels. ``auto`` is ``reference`` off CUDA and on CUDA the first
of vLLM's order (FLASH_ATTN, then TRITON_ATTN) that is valid for the configuration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvserve.choices import ATTENTION_BACKEND_CHOICES, attention_backend_name
from kvserve.logger import init_logger
from kvserve.quant.kv_cache_dtype import KVCacheDtype

logger = init_logger(__name__)

VLLM_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")  # vLLM's priority order on CUDA, as far as kvserve has them
P_SHIFT = {"FLASH_ATTN": 8, "TRITON_ATTN": 0}


@dataclass(frozen=True)
class AttentionBackend:
    """A resolved ``--attention-backend``: the name, the kernels it runs and how e4m3 pages are read."""

    name: str  # FLASH_ATTN | TRITON_ATTN | triton | reference
    kernels: str  # triton | reference
    query_fp8: bool = False  # e4m3 pages read with the quantized query (vLLM's names only)
    p_shift: int = 0  # with query_fp8: P scaled by 2^p_shift before its e4m3 rounding


def normalize_backend_name(name: str) -> str:
    """``choices.attention_backend_name``, with anything it does not know an error naming the value
    and the accepted ones (vLLM's text)."""
    text = attention_backend_name(name)
    if text not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"Unknown attention backend: {name!r}. Valid options are: {ATTENTION_BACKEND_CHOICES}")
    return text


def invalid_reasons(
    name: str, device: torch.device, dtype: torch.dtype, kv_dtype: KVCacheDtype, head_size: int
) -> list[str]:
    """Why vLLM's backend ``name`` cannot serve this configuration (empty: it can), in vLLM's words."""
    if name != "FLASH_ATTN":
        return []
    reasons = []
    if dtype not in (torch.bfloat16, torch.float16):
        reasons.append("dtype not supported")
    if head_size % 8 or head_size > 256:
        reasons.append("head_size not supported")
    hopper = device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == 9  # (the interpreter: as Hopper)
    if kv_dtype.is_fp8 and (kv_dtype.fp8_dtype != torch.float8_e4m3fn or not hopper):
        reasons.append("kv_cache_dtype not supported")
    return reasons


def _check_triton_device(name: str, device: torch.device) -> None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"--attention-backend {name} needs a CUDA device, got device {device.type!r}. Use "
            "--attention-backend reference (or auto), or set TRITON_INTERPRET=1 to run the Triton "
            "kernels in the (slow) interpreter."
        )


def resolve_attention_backend(
    requested: str, device: torch.device, dtype: torch.dtype, kv_dtype: KVCacheDtype, head_size: int
) -> AttentionBackend:
    """``--attention-backend`` for this device, model dtype, KV dtype and head size (module docstring)."""
    name = normalize_backend_name(requested)
    if name == "auto":
        if device.type != "cuda":
            logger.info("Using the reference attention backend (plain torch) on %s.", device.type)
            return AttentionBackend("reference", "reference")
        name = next((n for n in VLLM_BACKENDS if not invalid_reasons(n, device, dtype, kv_dtype, head_size)))
        logger.info("Using %s attention backend out of potential backends: %s.", name, list(VLLM_BACKENDS))
    elif name == "reference":
        return AttentionBackend("reference", "reference")
    else:
        _check_triton_device(name, device)
        reasons = invalid_reasons(name, device, dtype, kv_dtype, head_size)
        if reasons:
            raise ValueError(f"Selected backend {name} is not valid for this configuration. Reason: {reasons}")
        logger.info("Using %s backend.", name)
    query_fp8 = name in VLLM_BACKENDS and kv_dtype.fp8_dtype == torch.float8_e4m3fn
    if query_fp8:
        logger.info(
            "%s KV cache with %s: the query is quantized to fp8_e4m3 with each layer's q_scale and Q K^T and "
            "P V run on fp8 values (P scaled by 2^%d before its rounding), as vLLM's %s does on CUDA.",
            kv_dtype.name, name, P_SHIFT[name], name,
        )
    elif name in VLLM_BACKENDS and kv_dtype.is_fp8:
        logger.info("%s KV cache with %s: the pages are read dequantized and the query is not quantized "
                    "(vLLM quantizes it for e4m3 pages only).", kv_dtype.name, name)
    return AttentionBackend(name, "triton", query_fp8, P_SHIFT.get(name, 0) if query_fp8 else 0)
