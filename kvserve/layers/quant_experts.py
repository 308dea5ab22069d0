"""Routed experts that keep ModelOpt NVFP4 weights (the MoE hybrids' experts on the triton backend):
the grouped W4A16 GEMM (``kernels/triton_w4a16.w4a16_grouped_matmul``) over token rows aligned to
their experts on the device, so no step reads expert counts on the host.

``NVFP4Experts`` loads the per-expert checkpoint tensors into stacked parameters in the dense
``Experts`` layout (gate rows first: ``gate_up_proj`` uint8 [E, 2I, H/2], ``down_proj`` [E, H,
I/2], each with ``_scale`` float8_e4m3fn and ``_scale_2`` fp32 per row), then ``finalize``
repacks them for the kernel as ``NVFP4Linear`` does. Its forward is the dense ``Experts``'
arithmetic (SwiGLU, the routing weight, a sum over the top-k) with each GEMM on the 4-bit weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.layers.moe import routed_swiglu
from kvserve.layers.quant_linear import frozen_param, keep_packed
from kvserve.quant.modelopt import ModelOptConfig
from kvserve.quant.nvfp4 import NVFP4_GROUP_SIZE as GROUP

if TYPE_CHECKING:
    from kvserve.kernels.triton_w4a16 import W4A16Weight


class NVFP4Experts(nn.Module):
    """Routed SwiGLU experts on NVFP4 weights (module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, device: torch.device | str | None = None):
        super().__init__()
        for features, what in ((hidden_size, "hidden_size"), (intermediate_size, "moe_intermediate_size")):
            if features % GROUP:
                raise ValueError(f"NVFP4 experts: {what} {features} is not a multiple of {GROUP}")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden_size, intermediate_size
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = frozen_param(device, torch.uint8, e, 2 * i, h // 2)
        self.gate_up_proj_scale = frozen_param(device, torch.float8_e4m3fn, e, 2 * i, h // GROUP)
        self.gate_up_proj_scale_2 = frozen_param(device, torch.float32, e, 2 * i)
        self.down_proj = frozen_param(device, torch.uint8, e, h, i // 2)
        self.down_proj_scale = frozen_param(device, torch.float8_e4m3fn, e, h, i // GROUP)
        self.down_proj_scale_2 = frozen_param(device, torch.float32, e, h)
        self.packed: dict[str, W4A16Weight] = {}  # after finalize: the kernel's view of each stack
        self.finalized = False

    def finalize(self) -> None:
        """After loading: both stacks repacked for the kernel (``pack_w4a16``), the checkpoint layout freed."""
        from kvserve.kernels.triton_w4a16 import pack_w4a16

        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                w = pack_w4a16(getattr(self, name), getattr(self, f"{name}_scale"), getattr(self, f"{name}_scale_2"))
                for part in ("", "_scale", "_scale_2"):
                    setattr(self, name + part, None)
                keep_packed(self, f"{name}_", w)
                self.packed[name] = w  # the kernel's view of the same tensors
        self.finalized = True

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        from kvserve.kernels.triton_w4a16 import w4a16_grouped_matmul

        assert self.finalized, "NVFP4Experts.finalize() runs after loading"
        return routed_swiglu(x, top_idx, top_w, self.num_experts, self.intermediate, self.hidden,
                             lambda a, name, *rows: w4a16_grouped_matmul(a, self.packed[name], *rows))

    def init_dummy(self, gen: torch.Generator) -> None:
        """``--load-format dummy``: random codes, block scales in [0.5, 1), weights within ~1e-3
        (vLLM's dummy range); ``finalize`` follows."""
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(self, name)
                w.copy_(torch.randint(0, 256, w.shape, generator=gen, device=gen.device, dtype=torch.uint8))
                s = getattr(self, f"{name}_scale")
                s.copy_((torch.rand(s.shape, generator=gen, device=gen.device) * 0.5 + 0.5).to(torch.float8_e4m3fn))
                getattr(self, f"{name}_scale_2").fill_(1e-3 / 6)


def _expert_algo(qc: ModelOptConfig, prefix: str, e: int, kind: str) -> str | None:
    """A routed expert's algorithm: its own entry, else (MIXED_PRECISION) its experts module's."""
    q = qc.layer_quant(f"{prefix}.{e}.{kind}")
    if q is None and qc.quant_algo == "MIXED_PRECISION":
        q = qc.layer_quant(prefix)
    return None if q is None else q.algo


def quantize_experts(model: nn.Module, qc: ModelOptConfig) -> set[str]:
    """Swap every routed-experts module whose experts are all NVFP4 / W4A16_NVFP4 in the checkpoint
    for an ``NVFP4Experts``; returns the per-expert checkpoint module names that load as stored."""
    kept: set[str] = set()
    for name, module in list(model.named_modules()):
        if type(module).__name__ != "Experts" or not hasattr(module, "gate_up_proj"):
            continue
        e, two_i, h = module.gate_up_proj.shape
        names = [(i, kind) for i in range(e) for kind in ("gate_proj", "up_proj", "down_proj")]
        if not all(_expert_algo(qc, name, i, kind) in ("NVFP4", "W4A16_NVFP4") for i, kind in names):
            continue
        new = NVFP4Experts(e, h, two_i // 2, module.gate_up_proj.device)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        kept.update(f"{name}.{i}.{kind}" for i, kind in names)
    return kept
