"""Linear layers that keep ModelOpt weights quantized: NVFP4 packed for the W4A16 GEMM (Triton
backend), FP8 per tensor for the scaled FP8 GEMM (CUDA).

``NVFP4Linear`` loads the checkpoint's tensors under their names (``weight`` uint8 [out, in/2],
``weight_scale`` float8_e4m3fn [out, in/16]) and ``weight_scale_2`` as one fp32 value per output
row (each fused shard's own global scale, exactly), so a fused module loads shard by shard like a
dense one; ``finalize`` repacks them into the W4A16 kernel's layout (as vLLM repacks for Marlin).
``quantize_linears`` swaps them in before loading for every Linear whose checkpoint shards are all
NVFP4 / W4A16_NVFP4.

``FP8Linear`` is vLLM's ModelOpt FP8 path: the fp8 ``weight`` [out, in] and, while loading, each
shard's ``weight_scale`` and static ``input_scale`` once per output row; ``finalize`` then does what
vLLM's ``process_weights_after_loading`` does: shards with different weight scales requantized to
the largest (``requantize_with_max_scale``: ``fp16(w) * fp16(s)`` in fp16, then
``fp8(clamp(x * (1 / s_max)))``), one input scale (the largest). The forward quantizes x with it
(``fp8(clamp(float(x) * (1 / s_in), +-448))``, vLLM's static ``scaled_fp8_quant``; one Triton launch
on CUDA) and runs ``torch._scaled_mm`` (fp32 accumulation, both scales applied once). Swapped in on the devices of
``FP8_GEMM_DEVICES`` (CUDA) for every Linear whose shards are all FP8. The others (unquantized,
mixed fused modules, FP8 off CUDA) stay dense and take the dequantized weights
(``loader/quantized_weights.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.quant.modelopt import ModelOptConfig
from kvserve.quant.nvfp4 import E4M3_MAX, quantize_fp8_static
from kvserve.quant.nvfp4 import NVFP4_GROUP_SIZE as GROUP

if TYPE_CHECKING:
    from kvserve.kernels.triton_w4a16 import W4A16Weight


def frozen_param(device: torch.device | str | None, dtype: torch.dtype, *shape: int) -> nn.Parameter:
    """A zero-filled parameter the checkpoint fills (no gradient)."""
    return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)


def keep_packed(module: nn.Module, prefix: str, packed: W4A16Weight) -> None:
    """Register a repacked NVFP4 weight's tensors on ``module`` as ``{prefix}codes``, ``{prefix}scales``
    and ``{prefix}row_scale`` parameters (so they move and count with it)."""
    for part in ("codes", "scales", "row_scale"):
        setattr(module, prefix + part, nn.Parameter(getattr(packed, part), requires_grad=False))


class NVFP4Linear(nn.Module):
    """``y = x @ W^T (+ bias)`` with W in NVFP4 (kernels/gluon_w4a16.py for decode batches on CUDA,
    kernels/triton_w4a16.py otherwise). Loads the checkpoint's
    tensors; ``finalize`` then repacks them into the kernel layout (``codes``, ``scales``,
    ``row_scale``, the same bytes plus K padding) and drops them."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device | str | None = None):
        super().__init__()
        if in_features % GROUP:
            raise ValueError(f"NVFP4 in_features {in_features} is not a multiple of {GROUP}")
        self.in_features, self.out_features = in_features, out_features

        self.weight = frozen_param(device, torch.uint8, out_features, in_features // 2)
        self.weight_scale = frozen_param(device, torch.float8_e4m3fn, out_features, in_features // GROUP)
        self.weight_scale_2 = frozen_param(device, torch.float32, out_features)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.finalized = False

    def finalize(self) -> None:
        """After loading: the checkpoint tensors repacked for the kernel (``pack_w4a16``) and freed."""
        from kvserve.kernels.triton_w4a16 import pack_w4a16

        with torch.no_grad():
            packed = pack_w4a16(self.weight, self.weight_scale, self.weight_scale_2)
        self.weight = self.weight_scale = self.weight_scale_2 = None
        keep_packed(self, "", packed)
        self.packed = packed  # the kernel's view of the same tensors
        self.finalized = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kvserve.kernels.gluon_w4a16 import w4a16_linear

        assert self.finalized, "NVFP4Linear.finalize() runs after loading"
        y = w4a16_linear(x, self.packed)
        return y if self.bias is None else y + self.bias

    def init_dummy(self, gen: torch.Generator) -> None:
        """``--load-format dummy``: random codes, block scales in [0.5, 1), weights within ~1e-3
        (vLLM's dummy range); ``finalize`` follows."""
        with torch.no_grad():
            self.weight.copy_(torch.randint(0, 256, self.weight.shape, generator=gen, device=gen.device,
                                            dtype=torch.uint8))
            scale = torch.rand(self.weight_scale.shape, generator=gen, device=gen.device) * 0.5 + 0.5
            self.weight_scale.copy_(scale.to(torch.float8_e4m3fn))
            self.weight_scale_2.fill_(1e-3 / 6)
            if self.bias is not None:
                self.bias.uniform_(-1e-3, 1e-3, generator=gen)


FP8_GEMM_DEVICES = ("cuda",)  # where FP8 layers keep fp8 weights (elsewhere: the dequantized reference)


class FP8Linear(nn.Module):
    """``y = x @ W^T (+ bias)`` with W and x in FP8 per tensor (static activation scale)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

        self.weight = frozen_param(device, torch.float8_e4m3fn, out_features, in_features)
        self.weight_scale = frozen_param(device, torch.float32, out_features)  # per row while loading; one after
        self.input_scale = frozen_param(device, torch.float32, out_features)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.register_buffer("inv_input_scale", torch.ones((), device=device), persistent=False)
        self.finalized = False

    def finalize(self) -> None:
        """After loading: one weight scale (shards requantized to the largest, as vLLM) and one
        input scale (the largest)."""
        sizes = list(getattr(self, "shard_sizes", [self.out_features]))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        scales = [self.weight_scale[s] for s in starts]
        s_max = torch.stack(scales).max()
        with torch.no_grad():
            if any(bool(s != s_max) for s in scales):
                inv = _reciprocal(s_max)
                for start, size, s in zip(starts, sizes, scales):
                    rows = self.weight[start: start + size]
                    dq = rows.to(torch.float16) * s.to(torch.float16)  # vLLM's per_tensor_dequantize, in fp16
                    rows.copy_(quantize_fp8_static(dq, inv))
            self.weight_scale = nn.Parameter(s_max.reshape(()), requires_grad=False)
            self.input_scale = nn.Parameter(self.input_scale.max().reshape(()), requires_grad=False)
            self.inv_input_scale = _reciprocal(self.input_scale)
        self.finalized = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.finalized, "FP8Linear.finalize() runs after loading"
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda:  # one launch (kernels/triton_layers.py), bit-equal to the torch formula
            from kvserve.kernels.triton_layers import fp8_static_quant

            xq = fp8_static_quant(x2.contiguous(), self.inv_input_scale)
        else:
            xq = quantize_fp8_static(x2, self.inv_input_scale)
        return self.forward_fp8(xq, x.dtype).reshape(*x.shape[:-1], self.out_features)

    def forward_fp8(self, xq: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The GEMM on an input already quantized by this layer's static scale (``inv_input_scale``):
        xq [M, in] float8_e4m3fn -> [M, out]. A producer kernel that writes the quantiser's codes
        itself (``triton_layers.gated_rms_norm`` / ``sigmoid_gate`` with ``inv_scale``) saves its launch."""
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                             out_dtype=out_dtype)
        return y + self.bias if self.bias is not None else y

    def init_dummy(self, gen: torch.Generator) -> None:
        """``--load-format dummy``: random fp8 codes within +-448 at scale 1e-3 / 448 (weights within
        ~1e-3, vLLM's dummy range), input scale 1 / 448 (activations up to 1); ``finalize`` follows."""
        with torch.no_grad():
            w = (torch.rand(self.weight.shape, generator=gen, device=gen.device) * 2 - 1) * E4M3_MAX
            self.weight.copy_(w.to(torch.float8_e4m3fn))
            self.weight_scale.fill_(1e-3 / E4M3_MAX)
            self.input_scale.fill_(1.0 / E4M3_MAX)
            if self.bias is not None:
                self.bias.uniform_(-1e-3, 1e-3, generator=gen)


def _reciprocal(s: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 ``1 / s`` (an IEEE division on the CPU), on ``s``'s device."""
    return (torch.ones((), dtype=torch.float32) / s.detach().float().cpu()).to(s.device)


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
        if isinstance(module, (nn.Linear, NVFP4Linear, FP8Linear)):
            algos = {(q.algo if q else "none") for q in (qc.layer_quant(s) for s in _checkpoint_shards(name, stacked))}
            kind = ".".join(p for p in name.split(".") if not p.isdigit() and p not in ("model", "layers"))
            kinds.setdefault(kind, set()).update(algos)
    return {k: "+".join(sorted(v)) for k, v in sorted(kinds.items())}


def quantize_linears(model: nn.Module, qc: ModelOptConfig, stacked: dict[str, tuple[str, int]], nvfp4: bool = True,
                     fp8: bool = False) -> set[str]:
    """Swap every Linear whose checkpoint shards are all NVFP4 for an ``NVFP4Linear`` (``nvfp4``) and
    all FP8 for an ``FP8Linear`` (``fp8``), on the Linear's device; returns the checkpoint module
    names whose tensors load as they are."""
    kept: set[str] = set()
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        shards = _checkpoint_shards(name, stacked)
        algos = {q.algo if q is not None else None for q in (qc.layer_quant(s) for s in shards)}
        if nvfp4 and algos <= {"NVFP4", "W4A16_NVFP4"}:
            cls: type[nn.Module] = NVFP4Linear
        elif fp8 and algos == {"FP8"}:
            cls = FP8Linear
        else:
            continue
        new = cls(module.in_features, module.out_features, module.bias is not None, module.weight.device)
        if hasattr(module, "shard_sizes"):
            new.shard_sizes = module.shard_sizes
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        kept.update(shards)
    return kept
