"""Routed experts that keep ModelOpt quantized weights (the MoE hybrids' experts on the triton
backend): NVFP4 through the grouped W4A16 GEMM (``kernels/triton_w4a16.w4a16_grouped_matmul``), FP8
through the grouped FP8 GEMM (``kernels/triton_fp8_moe.fp8_grouped_matmul``, CUDA only), both over
token rows aligned to their experts on the device, so no step reads expert counts on the host.

``NVFP4Experts`` loads the per-expert checkpoint tensors into stacked parameters in the dense
``Experts`` layout (gate rows first: ``gate_up_proj`` uint8 [E, 2I, H/2], ``down_proj`` [E, H,
I/2], each with ``_scale`` float8_e4m3fn and ``_scale_2`` fp32 per row), then ``finalize``
repacks them for the kernel as ``NVFP4Linear`` does. Its forward is the dense ``Experts``'
arithmetic (SwiGLU, the routing weight, a sum over the top-k) with each GEMM on the 4-bit weights.

``FP8Experts`` is vLLM's ModelOpt FP8 MoE (``ModelOptFp8MoEMethod``): fp8 ``gate_up_proj`` [E, 2I, H]
and ``down_proj`` [E, H, I], while loading each shard's ``weight_scale`` (``_scale``) and static
``input_scale`` (``_input_scale``) once per row, as the model's per-expert loader stacks them. ``finalize`` then does what vLLM's ``process_weights_after_loading`` does: one
weight scale per expert and GEMM (an expert's gate and up shards requantized to the larger of their
two scales, as ``FP8Linear`` requantizes fused shards) and one input scale per GEMM (the largest
over the experts). The forward quantizes each GEMM's input with it and runs the FP8 GEMM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.layers.moe import routed_swiglu
from kvserve.layers.quant_linear import _reciprocal, frozen_param, keep_packed
from kvserve.quant.modelopt import ModelOptConfig
from kvserve.quant.nvfp4 import E4M3_MAX, quantize_fp8_static
from kvserve.quant.nvfp4 import NVFP4_GROUP_SIZE as GROUP

if TYPE_CHECKING:
    from kvserve.kernels.triton_moe import MoETiles
    from kvserve.kernels.triton_w4a16 import W4A16Weight


class NVFP4Experts(nn.Module):
    """Routed SwiGLU experts on NVFP4 weights (module docstring)."""

    fused = True  # the weights exist only in the kernel's layout: always the device path

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
                             lambda a, name, *rows, tiles: w4a16_grouped_matmul(a, self.packed[name], *rows))

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


class FP8Experts(nn.Module):
    """Routed SwiGLU experts on FP8 weights and activations, per-tensor scales (module docstring)."""

    fused = True  # always the grouped FP8 GEMM (no torch loop over FP8 experts)

    GEMMS = ("gate_up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 device: torch.device | str | None = None):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden_size, intermediate_size
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = frozen_param(device, torch.float8_e4m3fn, e, 2 * i, h)
        self.gate_up_proj_scale = frozen_param(device, torch.float32, e, 2 * i)  # per row while loading; [E] after
        self.gate_up_proj_input_scale = frozen_param(device, torch.float32, e, 2 * i)  # per row while loading; () after
        self.down_proj = frozen_param(device, torch.float8_e4m3fn, e, h, i)
        self.down_proj_scale = frozen_param(device, torch.float32, e, h)
        self.down_proj_input_scale = frozen_param(device, torch.float32, e, h)
        self.finalized = False

    def finalize(self) -> None:
        """After loading: per expert one ``gate_up_proj`` weight scale, the larger of gate's and up's
        (both shards requantized to it where they differ: ``fp16(w) * fp16(s)`` in fp16, then
        ``fp8(clamp(x * (1 / s_max)))``, vLLM's ``process_fp8_weight_tensor_strategy_moe``), and per
        GEMM one input scale, the largest over the experts (``process_fp8_input_tensor_strategy_moe``;
        where an expert's gate and up scales differ, vLLM keeps the one loaded last: kvserve the larger)."""
        i = self.intermediate
        with torch.no_grad():
            gate_s, up_s = self.gate_up_proj_scale[:, 0], self.gate_up_proj_scale[:, i]
            s_max = torch.maximum(gate_s, up_s)
            for e in (gate_s != up_s).nonzero().flatten().tolist():  # ModelOpt exports share one: none
                inv = _reciprocal(s_max[e])
                for rows, s in ((slice(0, i), gate_s[e]), (slice(i, 2 * i), up_s[e])):
                    w = self.gate_up_proj[e, rows]
                    w.copy_(quantize_fp8_static(w.to(torch.float16) * s.to(torch.float16), inv))
            weight_scale = {"gate_up_proj": s_max, "down_proj": self.down_proj_scale[:, 0]}
            for name in self.GEMMS:
                s_in = getattr(self, f"{name}_input_scale").max().reshape(())
                setattr(self, f"{name}_scale", nn.Parameter(weight_scale[name].contiguous(), requires_grad=False))
                setattr(self, f"{name}_input_scale", nn.Parameter(s_in, requires_grad=False))
                self.register_buffer(f"{name}_inv_input_scale", _reciprocal(s_in), persistent=False)
        self.finalized = True

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        from kvserve.kernels.moe_configs import FP8_W8A8, tuned_launch

        assert self.finalized, "FP8Experts.finalize() runs after loading"
        launch = tuned_launch(self.num_experts, self.intermediate, x.shape[0], x.device, FP8_W8A8)
        return routed_swiglu(x, top_idx, top_w, self.num_experts, self.intermediate, self.hidden, self._matmul, launch)

    def _matmul(self, a: torch.Tensor, name: str, ids: torch.Tensor, block_expert: torch.Tensor, block_m: int,
                rows_per_x: int, out: torch.Tensor, row_weight: torch.Tensor | None = None,
                tiles: MoETiles | None = None) -> torch.Tensor:
        """One GEMM of ``routed_swiglu``: ``a`` quantized with the GEMM's static input scale
        (``fp8(clamp(float32(a) * (1 / s_in), +-448))``, one Triton launch on CUDA, as ``FP8Linear``),
        then the grouped FP8 GEMM (``tiles``: a tuned table's launch, else its defaults)."""
        from kvserve.kernels.triton_fp8_moe import fp8_grouped_matmul

        inv = getattr(self, f"{name}_inv_input_scale")
        if a.is_cuda:
            from kvserve.kernels.triton_layers import fp8_static_quant

            aq = fp8_static_quant(a.contiguous(), inv)
        else:  # (tests: the interpreter) the torch twin, bit-equal
            aq = quantize_fp8_static(a, inv)
        return fp8_grouped_matmul(aq, getattr(self, name), getattr(self, f"{name}_scale"),
                                  getattr(self, f"{name}_input_scale"), ids, block_expert, block_m, rows_per_x, out,
                                  row_weight, tiles)

    def init_dummy(self, gen: torch.Generator) -> None:
        """``--load-format dummy``: random fp8 codes within +-448 at scale 1e-3 / 448 (weights within
        ~1e-3, vLLM's dummy range), input scales 1 / 448 (activations up to 1); ``finalize`` follows."""
        with torch.no_grad():
            for name in self.GEMMS:
                w = getattr(self, name)
                w.copy_(((torch.rand(w.shape, generator=gen, device=gen.device) * 2 - 1) * E4M3_MAX).to(w.dtype))
                getattr(self, f"{name}_scale").fill_(1e-3 / E4M3_MAX)
                getattr(self, f"{name}_input_scale").fill_(1.0 / E4M3_MAX)


def _expert_algo(qc: ModelOptConfig, prefix: str, e: int, kind: str) -> str | None:
    """A routed expert's algorithm: its own entry, else (MIXED_PRECISION) its experts module's."""
    q = qc.layer_quant(f"{prefix}.{e}.{kind}")
    if q is None and qc.quant_algo == "MIXED_PRECISION":
        q = qc.layer_quant(prefix)
    return None if q is None else q.algo


def quantize_experts(model: nn.Module, qc: ModelOptConfig, fp8: bool = False) -> set[str]:
    """Swap every routed-experts module whose experts are all NVFP4 / W4A16_NVFP4 in the checkpoint
    for an ``NVFP4Experts`` and, with ``fp8`` (the device is in ``quant_linear.FP8_GEMM_DEVICES``),
    all FP8 for an ``FP8Experts``; returns the per-expert checkpoint module names that load as stored."""
    kept: set[str] = set()
    for name, module in list(model.named_modules()):
        if type(module).__name__ != "Experts" or not hasattr(module, "gate_up_proj"):
            continue
        e, two_i, h = module.gate_up_proj.shape
        names = [(i, kind) for i in range(e) for kind in ("gate_proj", "up_proj", "down_proj")]
        algos = {_expert_algo(qc, name, i, kind) for i, kind in names}
        if algos <= {"NVFP4", "W4A16_NVFP4"}:
            cls: type[nn.Module] = NVFP4Experts
        elif fp8 and algos == {"FP8"}:
            cls = FP8Experts
        else:
            continue
        new = cls(e, h, two_i // 2, module.gate_up_proj.device)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        kept.update(f"{name}.{i}.{kind}" for i, kind in names)
    return kept
