"""Linear layers that keep ModelOpt NVFP4 weights packed and run the W4A16 GEMM (Triton backend).

``NVFP4Linear`` holds the checkpoint's tensors under their names (``weight`` uint8 [out, in/2],
``weight_scale`` float8_e4m3fn [out, in/16]) and ``weight_scale_2`` as one fp32 value per output
row (each fused shard's own global scale, exactly), so a fused module loads shard by shard like a
dense one. ``quantize_linears`` swaps them in before loading for every Linear whose checkpoint
shards are all NVFP4 / W4A16_NVFP4; the others (FP8, unquantized, mixed fused modules) stay dense
and take the dequantized weights (``loader/quantized_weights.py``)."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.logger import init_logger
from kvserve.quant.modelopt import ModelOptConfig
from kvserve.quant.nvfp4 import NVFP4_GROUP_SIZE as GROUP

logger = init_logger(__name__)


class NVFP4Linear(nn.Module):
    """``y = x @ W^T (+ bias)`` with W in NVFP4 (kernels/triton_w4a16.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device | str | None = None):
        super().__init__()
        if in_features % GROUP:
            raise ValueError(f"NVFP4 in_features {in_features} is not a multiple of {GROUP}")
        self.in_features, self.out_features = in_features, out_features

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)

        self.weight = param(out_features, in_features // 2, dtype=torch.uint8)
        self.weight_scale = param(out_features, in_features // GROUP, dtype=torch.float8_e4m3fn)
        self.weight_scale_2 = param(out_features, dtype=torch.float32)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kvserve.kernels.triton_w4a16 import w4a16_matmul

        y = w4a16_matmul(x, self.weight, self.weight_scale, self.weight_scale_2)
        return y if self.bias is None else y + self.bias

    def init_dummy(self, gen: torch.Generator) -> None:
        """``--load-format dummy``: random codes, block scales in [0.5, 1), weights within ~1e-3
        (vLLM's dummy range)."""
        with torch.no_grad():
            self.weight.copy_(torch.randint(0, 256, self.weight.shape, generator=gen, device=gen.device,
                                            dtype=torch.uint8))
            scale = torch.rand(self.weight_scale.shape, generator=gen, device=gen.device) * 0.5 + 0.5
            self.weight_scale.copy_(scale.to(torch.float8_e4m3fn))
            self.weight_scale_2.fill_(1e-3 / 6)
            if self.bias is not None:
                self.bias.uniform_(-1e-3, 1e-3, generator=gen)


def _checkpoint_shards(name: str, stacked: dict[str, tuple[str, int]]) -> list[str]:
    """A model Linear's checkpoint module names: its shards in order when fused, else itself."""
    parent, _, leaf = name.rpartition(".")
    subs = sorted((idx, sub) for sub, (fused, idx) in stacked.items() if fused == leaf)
    return [f"{parent}.{sub}" for _, sub in subs] if subs else [name]


def linear_schemes(model: nn.Module, qc: ModelOptConfig, stacked: dict[str, tuple[str, int]]) -> dict[str, str]:
    """Per Linear kind (its name without the layer index, e.g. ``mlp.gate_up_proj``), how the
    checkpoint stores it: the shards' algorithms joined by ``+`` (``none`` = unquantized)."""
    kinds: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, NVFP4Linear)):
            algos = {(q.algo if q else "none") for q in (qc.layer_quant(s) for s in _checkpoint_shards(name, stacked))}
            kind = ".".join(p for p in name.split(".") if not p.isdigit() and p not in ("model", "layers"))
            kinds.setdefault(kind, set()).update(algos)
    return {k: "+".join(sorted(v)) for k, v in sorted(kinds.items())}


def quantize_linears(model: nn.Module, qc: ModelOptConfig, stacked: dict[str, tuple[str, int]]) -> set[str]:
    """Swap every Linear whose checkpoint shards are all NVFP4 for an ``NVFP4Linear`` (on the
    Linear's device); returns the checkpoint module names whose tensors load packed."""
    kept: set[str] = set()
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        shards = _checkpoint_shards(name, stacked)
        schemes = [qc.layer_quant(s) for s in shards]
        if not all(q is not None and q.algo in ("NVFP4", "W4A16_NVFP4") for q in schemes):
            continue
        new = NVFP4Linear(module.in_features, module.out_features, module.bias is not None, module.weight.device)
        if hasattr(module, "shard_sizes"):
            new.shard_sizes = module.shard_sizes
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        kept.update(shards)
    return kept


def prepare_quantized_model(
    model: nn.Module, qc: ModelOptConfig, stacked: dict[str, tuple[str, int]], use_kernel: bool, dtype: torch.dtype
) -> set[str]:
    """Before loading: the NVFP4 Linears swapped in when ``use_kernel`` (Triton backend); logs once
    how many run the W4A16 GEMM and how each kind of Linear is stored. Returns the checkpoint
    module names that load packed (``loader/quantized_weights.py``)."""
    kept = quantize_linears(model, qc, stacked) if use_kernel else set()
    kinds = linear_schemes(model, qc, stacked)
    logger.info(
        "ModelOpt %s weights (%s): %d layer(s) keep NVFP4 and run the W4A16 GEMM, the rest are dequantized "
        "to %s while loading; per layer kind: %s", qc.quant_algo, qc.source,
        sum(isinstance(m, NVFP4Linear) for m in model.modules()), str(dtype).replace("torch.", ""),
        ", ".join(f"{k} {v}" for k, v in kinds.items()),
    )
    return kept
