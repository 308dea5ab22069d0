"""The W4A16 NVFP4 GEMM (kernels/triton_w4a16.py) against float64 on fresh random weights quantized by
the reference codec (quant/nvfp4.py): several shapes (K not a multiple of the K tile, N and M not of
theirs), bf16 / fp16 / fp32 activations, forced tile shapes, outputs poisoned with NaN first. CPU:
the Triton interpreter; the GPU adds the 27B's MLP shapes.

The bound: the kernel computes x @ dequantize_nvfp4(W, dtype)^T; against that product in float64,
an fp32-accumulated dot of K terms rounded once to the output dtype is off by at most
u_out |y| + K u_fp32 (|x| @ |W|^T) (u the unit roundoff). torch's own matmul is checked against the
same bound, so it is not tighter than the reference's spread."""

from __future__ import annotations

import pytest
import torch

from kvserve.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from triton_support import kernel_device, skip_without_triton_device

pytestmark = skip_without_triton_device()
DEV = kernel_device()
SHAPES = [(1, 48, 64), (5, 96, 160), (33, 64, 96), (70, 130, 48)]  # (M, N, K)
if DEV == "cuda":
    SHAPES += [(1, 17408 * 2, 5120), (16, 5120, 17408), (256, 17408, 5120)]
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _bound_ok(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    want = x.double() @ w.double().T
    slack = UNIT[y.dtype] * want.abs() + x.shape[-1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    return bool(((y.double() - want).abs() <= slack * 1.0001 + 1e-30).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_w4a16_matmul_equals_dequantize_then_matmul(dtype, shape):
    from kvserve.kernels.triton_w4a16 import w4a16_matmul

    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[0, :16] *= 40  # one block far from the rest: its own scale
    packed, block_scale, s2 = quantize_nvfp4(w)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    wd = dequantize_nvfp4(packed, block_scale, s2, dtype)  # what the kernel multiplies by
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    y = w4a16_matmul(x.to(DEV), packed.to(DEV), block_scale.to(DEV), s2.to(DEV), out=out)
    assert y.data_ptr() == out.data_ptr() and not bool(torch.isnan(y).any())
    assert _bound_ok(y.cpu(), x, wd)
    if DEV == "cuda" or dtype == torch.float32:  # (CPU bf16 / fp16 matmul rounds differently inside)
        assert _bound_ok((x.to(DEV) @ wd.to(DEV).T).cpu(), x, wd)


@pytest.mark.parametrize("tiles", [(16, 16, 32, 1, 1, 1), (32, 64, 64, 4, 2, 2), (16, 32, 32, 2, 3, 3), (16, 64, 128, 4, 3, 4)],
                         ids=lambda t: "x".join(map(str, t)))
def test_w4a16_tiles_split_k_and_leading_dims(tiles):
    """Forced tiles give the same bound, K split into 1, 2 or 3 parts (K = 96; split_k 4 with a
    128-wide K step is one part); x with leading dims [2, 3, K] -> [2, 3, N] into a poisoned output."""
    from kvserve.kernels.triton_w4a16 import W4A16Tiles, w4a16_matmul

    gen = torch.Generator().manual_seed(sum(tiles))
    w = torch.randn(40, 96, generator=gen)
    packed, block_scale, s2 = quantize_nvfp4(w)
    x = torch.randn(2, 3, 96, generator=gen).to(torch.bfloat16)
    out = torch.full((6, 40), float("nan"), dtype=torch.bfloat16, device=DEV)
    y = w4a16_matmul(x.to(DEV), packed.to(DEV), block_scale.to(DEV), s2.to(DEV), out=out, tiles=W4A16Tiles(*tiles))
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16 and y.data_ptr() == out.data_ptr()
    assert _bound_ok(y.cpu().reshape(6, 40), x.reshape(6, 96), dequantize_nvfp4(packed, block_scale, s2, torch.bfloat16))


def test_w4a16_rejects_bad_tiles():
    from kvserve.kernels.triton_w4a16 import W4A16Tiles, w4a16_matmul

    packed, block_scale, s2 = quantize_nvfp4(torch.randn(8, 64))
    x = torch.randn(1, 64).to(DEV)
    with pytest.raises(ValueError, match="block_k a multiple of 32"):
        w4a16_matmul(x, packed.to(DEV), block_scale.to(DEV), s2.to(DEV), tiles=W4A16Tiles(16, 16, 48))


def test_w4a16_per_row_global_scales_of_fused_siblings():
    """gate | up quantized apart (their own global scales) and stacked: one launch with a [N] global
    scale equals each half's own product."""
    from kvserve.kernels.triton_w4a16 import w4a16_matmul

    gen = torch.Generator().manual_seed(11)
    gate, up = torch.randn(24, 64, generator=gen), torch.randn(40, 64, generator=gen) * 9
    (pg, bg, sg), (pu, bu, su) = quantize_nvfp4(gate), quantize_nvfp4(up)
    assert float(sg) != float(su)
    packed, block_scale = torch.cat([pg, pu]), torch.cat([bg, bu])
    rows = torch.cat([sg.expand(24), su.expand(40)]).contiguous()
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    y = w4a16_matmul(x.to(DEV), packed.to(DEV), block_scale.to(DEV), rows.to(DEV)).cpu()
    wd = torch.cat([dequantize_nvfp4(pg, bg, sg, torch.bfloat16), dequantize_nvfp4(pu, bu, su, torch.bfloat16)])
    assert _bound_ok(y, x, wd)
    with pytest.raises(ValueError, match="global_scale of 3 values, expected 1 or N = 64"):
        w4a16_matmul(x.to(DEV), packed.to(DEV), block_scale.to(DEV), rows[:3].to(DEV))


def test_w4a16_rejects_mismatched_tensors():
    from kvserve.kernels.triton_w4a16 import w4a16_matmul

    packed, block_scale, s2 = quantize_nvfp4(torch.randn(8, 32))
    x = torch.randn(2, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x \[\.\.\., 48\] does not match packed \(8, 16\)"):
        w4a16_matmul(x, packed, block_scale, s2)
    with pytest.raises(ValueError, match=r"block_scale \(8, 1\) torch.float8_e4m3fn, expected float8_e4m3fn \(8, 2\)"):
        w4a16_matmul(x[:, :32], packed, block_scale[:, :1].contiguous(), s2)
