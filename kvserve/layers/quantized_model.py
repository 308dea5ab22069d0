"""A ModelOpt quantized model's layers around loading: which layers keep their quantized weights
(swapped in before loading: ``layers/quant_linear.py``, ``layers/quant_experts.py``), and what runs
after loading (repacks, scales, the W4A16 large-batch buffer) with the start-up log of the bytes."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.layers.quant_experts import FP8Experts, NVFP4Experts, quantize_experts
from kvserve.layers import quant_linear
from kvserve.layers.quant_linear import FP8Linear, NVFP4Linear, linear_schemes, quantize_linears
from kvserve.logger import init_logger
from kvserve.quant.modelopt import ModelOptConfig

logger = init_logger(__name__)


def prepare_quantized_model(
    model: nn.Module, qc: ModelOptConfig, stacked: dict[str, tuple[str, int]], use_kernel: bool, dtype: torch.dtype
) -> set[str]:
    """Before loading: the NVFP4 Linears and routed experts swapped in when ``use_kernel`` (Triton
    backend), the FP8 Linears on ``quant_linear.FP8_GEMM_DEVICES`` and the FP8 routed experts there
    when ``use_kernel`` too (their GEMM is a Triton kernel); logs once how many run each GEMM and how
    each kind of Linear is stored. Returns the checkpoint module names that load as stored
    (``loader/quantized_weights.py``)."""
    device = next(model.parameters()).device
    fp8 = device.type in quant_linear.FP8_GEMM_DEVICES
    kept = quantize_linears(model, qc, stacked, nvfp4=use_kernel, fp8=fp8)
    if use_kernel:
        kept |= quantize_experts(model, qc, fp8=fp8)
    kinds = linear_schemes(model, qc, stacked)
    experts = sum(isinstance(m, NVFP4Experts) for m in model.modules())
    fp8_experts = sum(isinstance(m, FP8Experts) for m in model.modules())
    logger.info(
        "ModelOpt %s weights (%s): %d layer(s) keep NVFP4 and run the W4A16 GEMM%s, %d keep FP8 and run the "
        "scaled FP8 GEMM%s, the rest are dequantized to %s while loading; per layer kind: %s", qc.quant_algo, qc.source,
        sum(isinstance(m, NVFP4Linear) for m in model.modules()),
        f" (and {experts} routed-expert group(s) the grouped W4A16 GEMM)" if experts else "",
        sum(isinstance(m, FP8Linear) for m in model.modules()),
        f" (and {fp8_experts} routed-expert group(s) the grouped FP8 GEMM)" if fp8_experts else "",
        str(dtype).replace("torch.", ""), ", ".join(f"{k} {v}" for k, v in kinds.items()),
    )
    return kept


def finalize_quantized_model(model: nn.Module, max_batch_tokens: int, dtype: torch.dtype) -> None:
    """After loading: every FP8Linear's and FP8Experts' scales settled (``finalize``), every NVFP4Linear
    and NVFP4Experts repacked for its kernel (``finalize``; a malformed one names its module), and the
    W4A16 large-batch buffer made now when a step of ``max_batch_tokens`` can use it, so the memory
    planner counts it. Logs the quantized weights' bytes once."""
    from kvserve.kernels.gluon_w4a16 import max_rows
    from kvserve.kernels.triton_w4a16 import reserve_dense_buffer, use_dense_path

    for name, m in model.named_modules():
        if isinstance(m, (FP8Linear, NVFP4Linear, NVFP4Experts, FP8Experts)) and not m.finalized:
            try:
                m.finalize()
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    device = next(model.parameters()).device
    if device.type == "cuda":  # the repacks' temporaries back to the driver before the memory plan reads it
        torch.cuda.empty_cache()
    nvfp4 = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    experts = [m for m in model.modules() if isinstance(m, NVFP4Experts)]
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    fp8_experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
    if not nvfp4 and not fp8 and not experts and not fp8_experts:
        return
    # (steps of up to max_rows rows run the Gluon kernel, which needs no buffer)
    dense = [m for m in nvfp4 if max_batch_tokens > max_rows(device, dtype)
             and use_dense_path(max_batch_tokens, m.out_features, m.in_features)]
    buffer = 0
    if dense:
        big = max(dense, key=lambda m: m.out_features * m.in_features)
        buffer = reserve_dense_buffer(big.codes.device, dtype, big.out_features, big.in_features)

    def gib(mods: list[nn.Module]) -> float:
        return sum(p.numel() * p.element_size() for m in mods for p in m.parameters()) / (1 << 30)

    logger.info(
        "Quantized weights: %d NVFP4 layer(s) %.2f GiB (W4A16 layout), %d NVFP4 routed-expert group(s) %.2f GiB, "
        "%d FP8 layer(s) %.2f GiB%s; W4A16 large-batch buffer %.1f MiB", len(nvfp4), gib(nvfp4), len(experts),
        gib(experts), len(fp8), gib(fp8),
        f", {len(fp8_experts)} FP8 routed-expert group(s) {gib(fp8_experts):.2f} GiB" if fp8_experts else "",
        buffer / (1 << 20),
    )
