"""Rotary position embedding (neox / rotate-half style) with default, linear and llama3 scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a config, for transformers 5 (`rope_parameters`) and 4 (`rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _inv_freq(rot_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported. Supported: ['default', 'linear', 'llama3']"
    )


class RotaryEmbedding(nn.Module):
    """Precomputed fp32 cos/sin per position; applied to the first ``rot_dim`` dims of each head."""

    def __init__(self, head_size: int, max_position: int, params: dict[str, Any], rot_dim: int | None = None):
        super().__init__()
        self.head_size = head_size
        self.rot_dim = rot_dim or head_size
        inv_freq = _inv_freq(self.rot_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)
        self.fused = False  # one Triton kernel per tensor (kernels/triton_layers.py), set by the runner

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rot_dim], x[..., self.rot_dim :]
        half = self.rot_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out

    def norm_and_rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module,
                        k_norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_norm(q)``, ``k_norm(k)`` (per-head RMSNorm or ZeroCenteredRMSNorm), then this rotation:
        one Triton kernel when the runner fused the three modules (the norm and rotary kernels' roundings;
        compiled, a rounding apart in some elements: ``triton_layers.qk_norm_rope``), else the modules."""
        if (self.fused and q_norm.fused and k_norm.fused and q_norm.eps == k_norm.eps
                and q_norm.zero_centered == k_norm.zero_centered):
            from kvserve.kernels.triton_layers import qk_norm_rope

            return qk_norm_rope(q, k, q_norm.weight, k_norm.weight, q_norm.eps, positions, self.cos_cache,
                                self.sin_cache, self.rot_dim, zero_centered=q_norm.zero_centered)
        return self(positions, q_norm(q), k_norm(k))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; returns rotated copies in the input dtype."""
        if self.fused:
            from kvserve.kernels.triton_layers import rotary

            return (rotary(q, positions, self.cos_cache, self.sin_cache, self.rot_dim),
                    rotary(k, positions, self.cos_cache, self.sin_cache, self.rot_dim))
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
