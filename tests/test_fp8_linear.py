"""FP8Linear (layers/quant_linear.py), vLLM's ModelOpt FP8 per-tensor path: the static activation
quantisation, the fused shards' requantisation to the largest weight scale, and the scaled FP8 GEMM
against float64 spelled out from vLLM's formulas (``scaled_fp8_quant``: x * (1 / s), clamped;
``requantize_with_max_scale``: fp16(w) * fp16(s) in fp16, requantized with 1 / s_max), on fresh
random inputs; and the loader keeping FP8 tensors for it. torch._scaled_mm runs on the CPU too, so
the layer is checked here; the engine swaps it in on CUDA only (``FP8_GEMM_DEVICES``).

The GEMM bound: the products of two fp8 values are exact in fp32; against float64, an
fp32-accumulated dot of K terms rounded once to the output dtype is off by at most
u_out |y| + K u_fp32 (|x| @ |W|^T)."""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.quant_linear import FP8Linear
from kvserve.quant.nvfp4 import quantize_fp8_per_tensor, quantize_fp8_static

E4M3 = torch.float8_e4m3fn
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``x`` rounded once to ``dtype`` (fp32 / fp16: torch's float64 casts round once), as float64."""
    return x.to(dtype).double()


def _e4m3_static(x64: torch.Tensor, inv: float) -> torch.Tensor:
    """vLLM's static quantisation spelled out: fp32 product x * inv (exact in float64, rounded
    once), clamped to +-448, to e4m3 (round to nearest even)."""
    return _round(x64 * inv, torch.float32).clamp(-448, 448).float().to(E4M3)


def _layer(shards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], bias: bool = False) -> FP8Linear:
    """An FP8Linear filled as the loader fills it: each shard's fp8 rows and its weight / input
    scale once per row."""
    out, k = sum(w.shape[0] for w, _, _ in shards), shards[0][0].shape[1]
    layer = FP8Linear(k, out, bias)
    if len(shards) > 1:
        layer.shard_sizes = [w.shape[0] for w, _, _ in shards]
    row = 0
    with torch.no_grad():
        for w, s, s_in in shards:
            layer.weight[row: row + w.shape[0]] = w
            layer.weight_scale[row: row + w.shape[0]] = s
            layer.input_scale[row: row + w.shape[0]] = s_in
            row += w.shape[0]
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_static_activation_quantisation_is_vllms_multiplication(dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 48, generator=gen) * 3).to(dtype)
    x[0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0]).to(dtype)  # clamped (not NaN), signed zeros
    s = torch.tensor(0.0123, dtype=torch.float32)
    inv = (torch.ones((), dtype=torch.float32) / s)
    got = quantize_fp8_static(x, inv)
    want = _e4m3_static(x.double(), float(inv))
    assert got.dtype == E4M3 and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got[0, :2].float().tolist() == [448.0, -448.0]


def test_static_activation_quantisation_multiplies_by_the_reciprocal():
    """x * (1 / s), not x / s: a quotient next to an e4m3 rounding tie (0.296875, between 0.28125
    and 0.3125) lands on different sides (found by a search over scales)."""
    s = torch.tensor(0.0021230001002550125, dtype=torch.float32)
    x = torch.tensor([0.0006302656256593764], dtype=torch.float32)
    inv = torch.ones((), dtype=torch.float32) / s
    got = quantize_fp8_static(x, inv).float()
    assert float(got) == float((x * inv).to(E4M3).float()) != float((x / s).to(E4M3).float())


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_per_tensor(w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (5, 96, 80), (33, 32, 16)])
def test_forward_equals_the_fake_quantized_product(dtype, m, k, n):
    gen = torch.Generator().manual_seed(m * 31 + k + n)
    w, s = _fp8(torch.randn(n, k, generator=gen) * 0.05)
    s_in = torch.tensor(2.5 / 448.0, dtype=torch.float32)
    layer = _layer([(w, s, s_in)])
    layer.finalize()
    assert layer.weight_scale.shape == () and float(layer.weight_scale) == float(s)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    y = layer(x)
    inv = float(torch.ones((), dtype=torch.float32) / s_in)
    xq = _e4m3_static(x.double(), inv).double() * float(s_in)
    want = xq @ (w.double() * float(s)).T
    slack = UNIT[dtype] * want.abs() + k * 2.0**-24 * (xq.abs() @ (w.double().abs() * float(s)).T)
    assert y.dtype == dtype and y.shape == (m, n)
    assert bool(((y.double() - want).abs() <= slack * 1.0001 + 1e-30).all())


def test_forward_keeps_leading_dims_and_adds_bias():
    gen = torch.Generator().manual_seed(5)
    w, s = _fp8(torch.randn(32, 64, generator=gen))
    layer = _layer([(w, s, torch.tensor(0.01))], bias=True)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(32, generator=gen))
    layer.finalize()
    x = torch.randn(2, 3, 64, generator=gen)
    y = layer(x)
    assert y.shape == (2, 3, 32)
    flat = layer(x.reshape(6, 64))
    assert torch.equal(y.reshape(6, 32), flat)
    no_bias = flat - layer.bias
    assert torch.allclose(no_bias + layer.bias, flat)


def test_fused_shards_are_requantized_to_the_largest_scale_as_vllm():
    """q | k | v with their own weight and input scales: one weight scale (the max) and every shard
    requantized with it, bit for bit as vLLM's requantize_with_max_scale (the max shard too: its
    fp16 round trip may move it); one input scale (the max)."""
    gen = torch.Generator().manual_seed(7)
    shards = []
    for rows, mag, x_amax in ((32, 0.05, 3.0), (16, 0.2, 5.0), (16, 0.01, 1.0)):
        w, s = _fp8(torch.randn(rows, 64, generator=gen) * mag)
        shards.append((w, s, torch.tensor(x_amax / 448.0, dtype=torch.float32)))
    layer = _layer(shards)
    layer.finalize()
    s_max = max(float(s) for _, s, _ in shards)
    assert float(layer.weight_scale) == s_max
    assert float(layer.input_scale) == max(float(si) for _, _, si in shards)
    inv = float(torch.ones((), dtype=torch.float32) / torch.tensor(s_max, dtype=torch.float32))
    want = torch.cat([
        _e4m3_static(_round(w.double() * _round(torch.tensor(float(s), dtype=torch.float64), torch.float16),
                            torch.float16), inv)
        for w, s, _ in shards])
    assert torch.equal(layer.weight.view(torch.uint8), want.view(torch.uint8))
    changed = [not torch.equal(layer.weight[a: a + w.shape[0]].view(torch.uint8), w.view(torch.uint8))
               for a, (w, _, _) in zip((0, 32, 48), shards)]
    assert changed[0] and changed[2]  # the smaller-scale shards moved to the coarser grid


def test_equal_shard_scales_leave_the_weights_as_loaded():
    gen = torch.Generator().manual_seed(8)
    w, s = _fp8(torch.randn(48, 32, generator=gen))
    layer = _layer([(w[:16], s, torch.tensor(0.02)), (w[16:], s, torch.tensor(0.02))])
    layer.finalize()
    assert torch.equal(layer.weight.view(torch.uint8), w.view(torch.uint8)) and float(layer.weight_scale) == float(s)


def test_forward_before_finalize_is_refused():
    layer = FP8Linear(16, 16, False)
    with pytest.raises(AssertionError, match="finalize"):
        layer(torch.zeros(1, 16))
