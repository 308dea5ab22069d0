"""The gated SiLU MLP of Llama-family and Qwen3.5 / Qwen3-Next models (also their shared expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate/up fused into ``gate_up_proj`` (loaded as two shards)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.intermediate = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.gate_up_proj.shard_sizes = [intermediate_size, intermediate_size]
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.fused = False  # SiLU-and-mul in one Triton kernel (kernels/triton_layers.py), set by the runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            from kvserve.kernels.triton_layers import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
