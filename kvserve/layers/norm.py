"""RMSNorm, computed in float32 like the reference implementations (transformers, vLLM)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``w * (x / rms(x))``; with ``residual`` given, adds it first and returns (normed, new residual)."""

    zero_centered = False  # (the fused kernels' switch between the two norms)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = False  # one Triton kernel (kernels/triton_layers.py), set by the model runner

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            from kvserve.kernels.triton_layers import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ZeroCenteredRMSNorm(nn.Module):
    """``(1 + w) * (x / rms(x))`` with the weight stored as an offset around 0 (Gemma / Qwen3-Next /
    Qwen3.5 layer norms). Unlike :class:`RMSNorm` the weight multiply happens in float32 before the
    cast back (transformers' ``Qwen3NextRMSNorm``). Same ``residual`` convention as :class:`RMSNorm`."""

    zero_centered = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self.fused = False  # rms_norm(..., zero_centered=True), set by the model runner

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        out = out * (1.0 + self.weight.float())
        return out.type_as(x)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            from kvserve.kernels.triton_layers import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, zero_centered=True)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
