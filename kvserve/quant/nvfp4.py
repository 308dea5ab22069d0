"""NVFP4 and FP8-per-tensor weight codecs of NVIDIA ModelOpt checkpoints, and vLLM's static FP8
activation quantisation of those checkpoints' FP8 layers (torch, any device).

NVFP4 (``NVFP4QTensor`` in ModelOpt's ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``):

* e2m1 codes: bit 3 is the sign, bits 0-2 index the magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``
  (code 8 is -0: a negative value that rounds to zero keeps its sign bit).
* Packing along the last (input) dim: element ``2i`` in the low nibble, ``2i+1`` in the high
  nibble, ``byte = code[2i+1] << 4 | code[2i]``.
* Scales: global ``s2 = amax(W) / (6 * 448)`` (fp32); per block of ``group_size`` (16) consecutive
  input elements ``s_b = amax(block) / fp32(6 * s2)``, zeros replaced by 1.0, then clamped to
  ``[2**-9, 448]`` and cast to float8_e4m3fn.
* Codes: nearest e2m1 value of ``w / (float32(s_b) * s2)``; ties go to the even code (ModelOpt's
  ``_cast_fp4``: ``searchsorted`` over the bounds ``{0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5}``, one
  step up when the magnitude equals 0.75, 1.75 or 3.5); magnitudes above 5 saturate to 6.
* Dequantisation order (``NVFP4QTensor.dequantize``, non-"fast" path): ``scale = float32(s_b) * s2``
  in fp32, ``w = e2m1_value * scale`` in fp32, then one cast to the target dtype.

FP8 per-tensor (ModelOpt "FP8", ``unified_export_hf._export_quantized_weight`` and
``quant_utils.to_quantized_weight``): ``scale = fp32(amax / 448)``, ``w_fp8 = e4m3(w / dtype(scale))``
with the quotient formed in ``w``'s dtype (ModelOpt divides the export-dtype weight by a 0-dim fp32
scale on the GPU, which does not promote a bf16 weight and rounds the divisor to bf16 first), dequantised
as ``dtype(float32(w_fp8) * scale)`` with the fp32 scale.

Divisions by a constant are made by a tensor on the operand's device: on CUDA, torch turns a
division by a Python (CPU) scalar into a multiplication by its reciprocal, which can differ by one
fp32 ulp from the CPU result.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SCALE = 2.0**-9  # ModelOpt's lower clamp of a per-block scale
NVFP4_GROUP_SIZE = 16

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision bounds between consecutive magnitudes, and whether a tie there goes up (to the even code).
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

_LUT: dict[torch.device, torch.Tensor] = {}


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [16]: the value of each 4-bit code (8..15 are the negatives, 8 = -0)."""
    device = torch.device(device)
    lut = _LUT.get(device)
    if lut is None:
        vals = list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
        lut = _LUT[device] = torch.tensor(vals, dtype=torch.float32, device=device)
    return lut


def _div_const(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c`` as a true division on every device (see the module docstring)."""
    return x / torch.tensor(c, dtype=x.dtype, device=x.device)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes (0..15) of the nearest e2m1 values of ``x`` (already divided by its scale)."""
    if not torch.is_floating_point(x):
        raise TypeError(f"e2m1_encode expects a floating tensor, got {x.dtype}")
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, tie_up in _E2M1_BOUNDS:
        code += (a >= bound) if tie_up else (a > bound)
    code |= (x < 0).to(torch.uint8) << 3
    return code


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 codes -> [..., n/2] bytes, element 2i in the low nibble."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs uint8 codes with an even last dim, got {codes.dtype} {_shape(codes)}")
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] bytes -> [..., n] uint8 codes (inverse of :func:`pack_e2m1`)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_e2m1 needs uint8, got {packed.dtype}")
    out = torch.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=torch.uint8, device=packed.device)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def scale_from_amax(amax: torch.Tensor | float, bound: float) -> torch.Tensor:
    """fp32 0-dim ``float32(amax) / bound``: ``weight_scale_2`` and the NVFP4 ``input_scale`` use
    ``bound = 6 * 448``, the FP8 ``weight_scale`` / ``input_scale`` ``bound = 448``."""
    a = amax if isinstance(amax, torch.Tensor) else torch.tensor(amax)
    return _div_const(a.float().reshape(()), bound)


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """fp32 0-dim ``amax(W) / (6 * 448)`` (ModelOpt ``get_weights_scaling_factor_2``)."""
    return scale_from_amax(w.abs().amax(), E2M1_MAX * E4M3_MAX)


def nvfp4_block_scale(w: torch.Tensor, global_scale: torch.Tensor, group_size: int = NVFP4_GROUP_SIZE) -> torch.Tensor:
    """float8_e4m3fn [..., in/group]: ``e4m3(clamp(amax(block) / fp32(6 * s2), 2**-9, 448))`` with
    zero block amaxes mapped to 1.0 first (ModelOpt ``get_weights_scaling_factor`` +
    ``_cast_per_block_scale_to_fp8``)."""
    _check_groups(w, group_size, "nvfp4_block_scale")
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    block_amax = blocks.abs().amax(dim=-1).float()
    s2 = global_scale.to(device=w.device, dtype=torch.float32)
    s = block_amax / (E2M1_MAX * s2)
    s = torch.where(s == 0, torch.ones_like(s), s)
    return s.clamp(min=E4M3_MIN_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)


def _check_groups(w: torch.Tensor, group_size: int, what: str) -> None:
    if w.dim() < 1 or group_size <= 0 or w.shape[-1] % group_size:
        raise ValueError(
            f"{what}: weight of shape {_shape(w)} has in_features {w.shape[-1] if w.dim() else None}, "
            f"not a multiple of the NVFP4 group size {group_size} (ModelOpt pads the last dim; kvserve refuses)"
        )


def quantize_nvfp4(
    w: torch.Tensor,
    group_size: int = NVFP4_GROUP_SIZE,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [..., out, in] -> (packed uint8 [..., out, in/2], block_scale float8_e4m3fn
    [..., out, in/group], global_scale fp32 0-dim).

    ``global_scale`` overrides ``amax(w)/2688`` (a fused group's shared ``weight_scale_2``).
    A zero global scale (an all-zero ``w``) becomes 1.0 (ModelOpt would divide 0 by 0 and store
    NaN block scales).
    """
    if not torch.is_floating_point(w) or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"quantize_nvfp4 expects a bf16/fp16/fp32 weight, got {w.dtype} of shape {_shape(w)}")
    if w.dim() < 2:
        raise ValueError(f"quantize_nvfp4 expects a weight [out, in], got shape {_shape(w)}")
    _check_groups(w, group_size, "quantize_nvfp4")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"quantize_nvfp4: weight of shape {_shape(w)} has NaN or infinite values")
    w32 = w.float()
    if global_scale is None:
        global_scale = nvfp4_global_scale(w32)
    s2 = global_scale.to(device=w.device, dtype=torch.float32).reshape(())
    if float(s2) == 0.0:  # all-zero weight (or fused group)
        s2 = torch.ones((), dtype=torch.float32, device=w.device)
    block_scale = nvfp4_block_scale(w32, s2, group_size)
    scale = block_scale.float() * s2
    blocks = w32.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    codes = e2m1_encode(blocks / scale.unsqueeze(-1)).reshape(w.shape)
    return pack_e2m1(codes), block_scale, s2.clone()


def _scalar_or_stacked(scale: torch.Tensor, lead: tuple[int, ...], name: str, shapes: str) -> torch.Tensor:
    """A 0-dim / [1] fp32 scale, or one per leading matrix (``lead``), as a broadcastable tensor."""
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype} ({shapes})")
    if scale.numel() == 1 and scale.dim() <= 1:
        return scale.reshape(())
    if lead and _shape(scale) in (lead, (*lead, 1), (*lead, 1, 1)):
        return scale.reshape(*lead, 1, 1)
    raise ValueError(f"{name} of shape {_shape(scale)} must be a scalar (0-dim or [1]) ({shapes})")


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    group_size: int = NVFP4_GROUP_SIZE,
) -> torch.Tensor:
    """(``weight`` uint8 [..., out, in/2], ``weight_scale`` e4m3 [..., out, in/group],
    ``weight_scale_2`` fp32 scalar or one per leading matrix) -> ``dtype`` [..., out, in]:
    ``dtype(e2m1(code) * (float32(s_b) * s2))``, both multiplies in fp32."""
    shapes = (
        f"weight {_shape(packed)} {packed.dtype}, weight_scale {_shape(block_scale)} {block_scale.dtype}, "
        f"weight_scale_2 {_shape(global_scale)} {global_scale.dtype}"
    )
    if packed.dtype != torch.uint8:
        raise ValueError(f"NVFP4 weight must be uint8 (two e2m1 codes per byte): {shapes}")
    if packed.dim() < 2:
        raise ValueError(f"NVFP4 weight must be [out, in/2]: {shapes}")
    if block_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"NVFP4 weight_scale must be float8_e4m3fn: {shapes}")
    in_features = packed.shape[-1] * 2
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"NVFP4 in_features {in_features} is not a multiple of the group size {group_size}: {shapes}")
    groups = in_features // group_size
    want = (*packed.shape[:-1], groups)
    if _shape(block_scale) != want:
        raise ValueError(f"NVFP4 weight_scale must have shape {want} for group size {group_size}: {shapes}")
    s2 = _scalar_or_stacked(global_scale, tuple(packed.shape[:-2]), "NVFP4 weight_scale_2", shapes)
    s2 = s2.to(packed.device)
    scale = block_scale.to(packed.device).float() * s2
    values = e2m1_table(packed.device)[unpack_e2m1(packed).long()]
    values = values.reshape(*packed.shape[:-1], groups, group_size) * scale.unsqueeze(-1)
    return values.reshape(*packed.shape[:-1], in_features).to(dtype)


def quantize_fp8_per_tensor(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` -> (float8_e4m3fn ``w / scale``, fp32 0-dim ``scale``), ``scale = amax(w) / 448`` unless
    given. The quotient is formed in ``w``'s dtype (as ModelOpt does) and clamped to +-448 (a no-op
    with the amax scale; a smaller given scale would otherwise make NaNs). A zero scale (an
    all-zero ``w``) becomes 1.0."""
    if not torch.is_floating_point(w) or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"quantize_fp8_per_tensor expects a bf16/fp16/fp32 tensor, got {w.dtype} of shape {_shape(w)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"quantize_fp8_per_tensor: tensor of shape {_shape(w)} has NaN or infinite values")
    if scale is None:
        scale = scale_from_amax(w.abs().amax(), E4M3_MAX)
    scale = scale.to(device=w.device, dtype=torch.float32).reshape(())
    if float(scale) == 0.0:  # all-zero tensor
        scale = torch.ones((), dtype=torch.float32, device=w.device)
    # the divisor rounded to w's dtype first: what `w / scale` computes on CUDA (the 0-dim fp32 tensor
    # is cast to the common dtype), where ModelOpt exports; on the CPU torch would divide by the fp32
    # value (measured on the H200: 1,879-11,670 of 262,144 fp8 bytes differ between the two)
    q = (w / scale.to(w.dtype)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.clone()


def quantize_fp8_static(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """vLLM's static per-tensor activation quantisation (``scaled_fp8_quant`` with a scale):
    ``e4m3(clamp(float32(x) * inv_scale, +-448))``, ``inv_scale`` the fp32 reciprocal of the scale
    (a multiplication, as vLLM's kernel; not the division of the weight quantiser above)."""
    return (x.float() * inv_scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8_per_tensor(
    w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``dtype(float32(w_fp8) * scale)`` for an fp32 scalar ``scale`` (or one per leading matrix)."""
    shapes = f"weight {_shape(w_fp8)} {w_fp8.dtype}, weight_scale {_shape(scale)} {scale.dtype}"
    if w_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight must be float8_e4m3fn: {shapes}")
    s = _scalar_or_stacked(scale, tuple(w_fp8.shape[:-2]) if w_fp8.dim() > 2 else (), "FP8 weight_scale", shapes)
    return (w_fp8.float() * s.to(w_fp8.device)).to(dtype)
