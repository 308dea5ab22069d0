"""NVFP4 and FP8-per-tensor weight codecs (kvserve.quant.nvfp4) against ModelOpt's facts:
e2m1 codes and nibble order, the rounding bounds and ties of ``NVFP4QTensor._cast_fp4``, the
block-scale rules of ``_cast_per_block_scale_to_fp8``, and the dequantisation order
``dtype(value * (float32(s_b) * s2))`` checked bit for bit against a float64 model of it."""

from __future__ import annotations

import pytest
import torch

from kvserve.quant.nvfp4 import (
    E2M1_VALUES,
    dequantize_fp8_per_tensor,
    dequantize_nvfp4,
    e2m1_encode,
    e2m1_table,
    pack_e2m1,
    quantize_fp8_per_tensor,
    quantize_nvfp4,
    unpack_e2m1,
)

E4M3 = torch.float8_e4m3fn
_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
_MIN_EXP = {torch.bfloat16: -133, torch.float16: -24, torch.float32: -149}  # smallest subnormal 2**e
_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _round64(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``x`` rounded once (nearest, ties to even) to ``dtype``'s precision, kept in float64
    (torch's own float64 -> bf16 cast goes through fp32, i.e. rounds twice)."""
    _, e = torch.frexp(x)
    ulp_exp = torch.clamp(e.to(torch.int64) - _BITS[dtype], min=_MIN_EXP[dtype])
    ulp = torch.ldexp(torch.ones_like(x), ulp_exp)
    return torch.round(x / ulp) * ulp


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.dtype])


def _weights(shape, seed, dtype=torch.float32):
    """Random weights with per-row magnitudes over several decades, a zero block and a tiny block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float64) * torch.rand(shape[0], 1, generator=g, dtype=torch.float64) ** 3
    w[0, :16] = 0.0
    w[1, :16] *= 1e-9
    return w.to(dtype)


# ------------------------------------------------------------------------------------- e2m1 codes


def test_every_code_decodes_to_its_value():
    table = e2m1_table()
    assert table.dtype == torch.float32
    assert table.tolist() == list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
    assert torch.signbit(table[8])  # code 8 is -0
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16)
    out = dequantize_nvfp4(pack_e2m1(codes), torch.ones(1, 1).to(E4M3), torch.tensor(1.0), torch.float32)
    assert _bits(out).tolist() == _bits(table.reshape(1, 16)).tolist()
    # each value encodes back to its code (-0 -> code 0: the sign bit comes from x < 0)
    assert e2m1_encode(table).tolist() == list(range(8)) + [0] + list(range(9, 16))


def test_nibble_order_low_first():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0, 8, 7]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0x43, 0x0F, 0x78]]
    assert torch.equal(unpack_e2m1(packed), codes)
    # through quantize: global amax 10.5 = 2688 * 2**-8 (s2 = 2**-8 exactly, block scale 448 there);
    # a block of amax 1.5 gets s_b = 64, so its scale is 0.25 and the values below are exact e2m1 values
    w = torch.zeros(2, 16)
    w[0, :8] = torch.tensor([0.5, 1.0, 1.5, 2.0, -6.0, 0.0, -0.5, 6.0]) * 0.25
    w[1, 0] = 10.5
    packed, scale, s2 = quantize_nvfp4(w)
    assert float(s2) == 2**-8 and float(scale[0, 0].float()) == 64.0 and float(scale[1, 0].float()) == 448.0
    assert packed[0, :4].tolist() == [0x21, 0x43, 0x0F, 0x79]


# ------------------------------------------------------------------------------ rounding (ModelOpt)

# x / scale -> expected code (ModelOpt: searchsorted over {0.25,0.75,1.25,1.75,2.5,3.5,5}, +1 at 0.75/1.75/3.5)
_CASES = [
    (0.0, 0), (0.25, 0), (0.2500001, 1), (0.5, 1), (0.7499999, 1), (0.75, 2), (1.0, 2), (1.25, 2),
    (1.2500001, 3), (1.5, 3), (1.7499999, 3), (1.75, 4), (2.0, 4), (2.5, 4), (2.5000002, 5), (3.0, 5),
    (3.4999998, 5), (3.5, 6), (4.0, 6), (5.0, 6), (5.0000005, 7), (6.0, 7),
    (-0.25, 8), (-0.2500001, 9), (-0.75, 10), (-1.25, 10), (-1.75, 12), (-2.5, 12), (-3.5, 14), (-5.0, 14), (-6.0, 15),
    (-0.0, 0), (1e-30, 0), (-1e-30, 8),
]


def test_rounding_bounds_and_ties_match_modelopt():
    # scale exactly 2**-10: global amax 2688 * 2**-10 = 2.625 (s2 = 2**-10, its block scale 448), and a
    # block of amax 6 * 2**-10 (s_b = 1.0) holding the cases times 2**-10 (exact: power-of-two scaling)
    xs = torch.tensor([c[0] for c in _CASES], dtype=torch.float32)
    n = len(xs)
    rows = []
    for start in range(0, n, 15):
        chunk = xs[start : start + 15]
        row = torch.zeros(16)
        row[: len(chunk)] = chunk
        row[15] = 6.0  # block amax 6 -> s_b = 1
        rows.append(row)
    w = torch.cat([torch.stack(rows), torch.tensor([[2688.0] + [0.0] * 15])]) * 2**-10
    packed, scale, s2 = quantize_nvfp4(w)
    assert float(s2) == 2**-10
    assert scale[:-1].float().flatten().tolist() == [1.0] * len(rows)
    assert float(scale[-1, 0].float()) == 448.0
    codes = unpack_e2m1(packed)[:-1, :15].flatten()[:n]
    assert codes.tolist() == [c for _, c in _CASES]
    # direct encoder agrees, and the sign of -0.0 is not set (x < 0 is false)
    assert e2m1_encode(xs).tolist() == [c for _, c in _CASES]


def test_block_scale_rules():
    """s_b = amax/(6 s2) -> zero becomes 1.0, then clamp [2**-9, 448], then e4m3 (round to nearest)."""
    w = torch.zeros(4, 64)
    w[0, 0] = 2688.0 * 2**-6  # global amax: s2 = 2**-6, block scale 448
    w[1, 16] = 6.0 * 2**-6 * 1e-4  # s_b = 1e-4 -> clamped up to 2**-9
    w[2, 32] = 6.0 * 2**-6 * 13.0  # s_b = 13 -> exactly representable
    w[3, 48] = 6.0 * 2**-6 * 13.3  # s_b = 13.3 -> e4m3 13.0 (spacing 1 in [8, 16))
    packed, scale, s2 = quantize_nvfp4(w)
    assert float(s2) == 2**-6
    assert scale.dtype == E4M3 and scale.shape == (4, 4)
    s = scale.float()
    assert s[0].tolist() == [448.0, 1.0, 1.0, 1.0]  # all-zero blocks -> 1.0
    assert s[1].tolist() == [1.0, 2**-9, 1.0, 1.0]
    assert s[2, 2] == 13.0 and s[3, 3] == 13.0
    # 13.3 * 6 / 13 = 6.138 saturates to code 7 (6.0)
    assert unpack_e2m1(packed)[3, 48] == 7
    # an all-zero weight gets s2 = 1 and block scales 1 (ModelOpt would store 0/0 = NaN)
    p0, b0, g0 = quantize_nvfp4(torch.zeros(2, 32))
    assert float(g0) == 1.0 and b0.float().eq(1.0).all() and p0.eq(0).all()
    p0, b0, g0 = quantize_nvfp4(torch.zeros(2, 32), global_scale=torch.tensor(0.0))  # a zero fused group
    assert float(g0) == 1.0 and b0.float().eq(1.0).all() and p0.eq(0).all()


def test_global_scale_override_and_input_dtype():
    w = _weights((32, 64), seed=3)
    packed, scale, s2 = quantize_nvfp4(w)
    assert s2.dtype == torch.float32 and s2.dim() == 0
    assert float(s2) == float(torch.tensor(float(w.abs().max()) / 2688.0, dtype=torch.float32))
    bigger = s2 * 2
    p2, b2, g2 = quantize_nvfp4(w, global_scale=bigger)
    assert torch.equal(g2, bigger)
    blocks = w.reshape(32, 4, 16).abs().amax(-1)
    expect = (blocks / (6.0 * bigger)).clamp(2**-9, 448).to(E4M3)
    expect = torch.where(blocks == 0, torch.ones_like(blocks).to(E4M3), expect)
    assert torch.equal(b2.view(torch.uint8), expect.view(torch.uint8))
    # bf16 / fp16 weights are quantized exactly as their fp32 values
    for dt in (torch.bfloat16, torch.float16):
        wd = w.to(dt)
        a, b = quantize_nvfp4(wd), quantize_nvfp4(wd.float())
        assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8)) and torch.equal(a[2], b[2])


# ---------------------------------------------------------------------------------- dequantisation


def _half_step(a: torch.Tensor) -> torch.Tensor:
    """Half the e2m1 spacing around magnitude ``a`` (values past 6 saturate, within one step)."""
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))


@pytest.mark.parametrize("shape", [(256, 1024), (64, 48)])
def test_round_trip_within_half_a_step(shape):
    w = _weights(shape, seed=shape[1])
    packed, scale, s2 = quantize_nvfp4(w)
    assert packed.shape == (shape[0], shape[1] // 2) and scale.shape == (shape[0], shape[1] // 16)
    back = dequantize_nvfp4(packed, scale, s2, torch.float32)
    step = (scale.float() * s2).repeat_interleave(16, dim=1)
    a = w.abs() / step
    err = (back.double() - w.double()).abs()
    bound = _half_step(a).double() * step.double() * (1 + 1e-6)
    # past 6 (a block scale rounded down: in the e4m3 subnormals, below 2**-6, its step is 2**-9,
    # so a small block can overshoot 6 by far) the code saturates at +-6
    inside = a <= 6
    assert bool((err <= bound)[inside].all()), float((err - bound)[inside].max())
    assert torch.equal(back[~inside].abs(), (6 * step)[~inside])
    # a normal e4m3 block scale is within 2**-4 relative, so only subnormal ones overshoot further
    far = (a > 6 * (1 + 2**-4)).reshape(shape[0], -1, 16).any(-1)
    assert bool((scale.float()[far] < 2**-6).all())


@pytest.mark.parametrize("shape", [(256, 1024), (64, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_bit_exact_against_float64(shape, dtype):
    """dequantize == rnd_dtype(rnd32(value * rnd32(float(s_b) * s2))), modelled in float64 with an
    explicit round-to-nearest-even at each documented step; the one-rounding product
    value * s_b * s2 is within one ulp of it (the order matters only at rounding ties)."""
    w = _weights(shape, seed=7 + shape[0])
    packed, scale, s2 = quantize_nvfp4(w)
    out = dequantize_nvfp4(packed, scale, s2, dtype)
    assert out.dtype == dtype and out.shape == shape
    values = e2m1_table().double()[unpack_e2m1(packed).long()]
    sb = scale.double().repeat_interleave(16, dim=1)  # e4m3 -> float64 exactly
    block = _round64(sb * float(s2), torch.float32)
    ref = _round64(_round64(values * block, torch.float32), dtype).to(dtype)
    assert torch.equal(_bits(out), _bits(ref))
    once = _round64(values * sb * float(s2), dtype).to(dtype)
    ulps = (_bits(out).long() - _bits(once).long()).abs()
    assert int(ulps.max()) <= 1


def test_dequantize_stacked_experts():
    w = _weights((3 * 32, 64), seed=11).reshape(3, 32, 64)
    parts = [quantize_nvfp4(w[e]) for e in range(3)]
    packed = torch.stack([p[0] for p in parts])
    scale = torch.stack([p[1] for p in parts])
    s2 = torch.stack([p[2] for p in parts])
    out = dequantize_nvfp4(packed, scale, s2, torch.bfloat16)
    for e, (p, b, g) in enumerate(parts):
        assert torch.equal(_bits(out[e]), _bits(dequantize_nvfp4(p, b, g, torch.bfloat16)))


# ------------------------------------------------------------------------------------ FP8 per-tensor


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_fp8_per_tensor(src):
    w = _weights((64, 48), seed=5, dtype=src)
    q, scale = quantize_fp8_per_tensor(w)
    assert q.dtype == E4M3 and q.shape == w.shape and scale.dtype == torch.float32 and scale.dim() == 0
    amax = float(w.abs().max())
    assert float(scale) == float(torch.tensor(amax / 448.0, dtype=torch.float32))
    # codes: e4m3 of the quotient formed in the weight's dtype by the divisor rounded to that dtype
    # (ModelOpt's to_quantized_weight on CUDA, measured on the H200), spelled out in float64
    quotient = _round64(_round64(w.double() / _round64(scale.double(), src), torch.float32), src)  # fp32 opmath
    assert torch.equal(q.view(torch.uint8), quotient.to(E4M3).view(torch.uint8))
    assert float(q.float().abs().max()) == 448.0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = dequantize_fp8_per_tensor(q, scale, dtype)
        ref = _round64(_round64(q.double() * float(scale), torch.float32), dtype).to(dtype)
        assert out.dtype == dtype and torch.equal(_bits(out), _bits(ref))
    back = dequantize_fp8_per_tensor(q, scale, torch.float32).double()
    err = (back - w.double()).abs()
    # half an e4m3 step (2**-4 relative, 2**-10 * scale among subnormals); a bf16 weight's divisor
    # and quotient are rounded to bf16 first (2**-9 relative more each, and the quotient's rounding
    # can land on an e4m3 tie among subnormals: the two parts add)
    div = 2**-9 if src == torch.bfloat16 else 0.0
    rel = (1 + 2**-4) * (1 + div) ** 2 - 1
    bound = (w.double().abs() * rel + 2**-10 * float(scale) * (1 + div)) * (1 + 1e-6)
    assert bool((err <= bound).all())


def test_fp8_per_tensor_zero_and_given_scale():
    q, s = quantize_fp8_per_tensor(torch.zeros(4, 16))
    assert float(s) == 1.0 and q.float().eq(0).all()
    q, s = quantize_fp8_per_tensor(torch.zeros(4, 16), scale=torch.tensor(0.0))
    assert float(s) == 1.0 and q.float().eq(0).all()
    w = torch.tensor([[1.0, -2.0, 1000.0]])
    q, s = quantize_fp8_per_tensor(w, scale=torch.tensor(1.0))
    assert q.float().tolist() == [[1.0, -2.0, 448.0]]  # clamped, not NaN


# ------------------------------------------------------------------------------------------- errors


def test_in_features_not_multiple_of_16():
    with pytest.raises(ValueError, match=r"\(8, 40\).*group size 16"):
        quantize_nvfp4(torch.randn(8, 40))
    with pytest.raises(ValueError, match=r"\(8,\)"):
        quantize_nvfp4(torch.randn(8))
    with pytest.raises(ValueError, match="NaN"):
        quantize_nvfp4(torch.tensor([[float("nan")] * 16]))
    with pytest.raises(TypeError):
        quantize_nvfp4(torch.zeros(2, 16, dtype=torch.int32))


def test_malformed_nvfp4_tensors():
    packed, scale, s2 = quantize_nvfp4(_weights((32, 64), seed=1))
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(32, 4\).*weight_scale \(32, 2\)"):
        dequantize_nvfp4(packed, scale[:, :2], s2)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(32, 4\).*weight_scale \(4, 32\)"):
        dequantize_nvfp4(packed, scale.t().contiguous(), s2)
    with pytest.raises(ValueError, match="weight_scale must be float8_e4m3fn"):
        dequantize_nvfp4(packed, scale.float(), s2)
    with pytest.raises(ValueError, match="weight_scale must be float8_e4m3fn"):
        dequantize_nvfp4(packed, scale.view(torch.uint8), s2)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_nvfp4(packed.to(torch.int8), scale, s2)
    with pytest.raises(ValueError, match=r"weight_scale_2 of shape \(2,\)"):
        dequantize_nvfp4(packed, scale, torch.ones(2))
    with pytest.raises(ValueError, match="weight_scale_2 must be float32"):
        dequantize_nvfp4(packed, scale, s2.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"in_features 40 is not a multiple"):
        dequantize_nvfp4(torch.zeros(4, 20, dtype=torch.uint8), torch.ones(4, 2).to(E4M3), s2)
    with pytest.raises(ValueError, match=r"\[out, in/2\]"):
        dequantize_nvfp4(packed[0], scale[0], s2)
    # a [1] global scale (some writers keep the dim) is accepted
    assert torch.equal(dequantize_nvfp4(packed, scale, s2.reshape(1)), dequantize_nvfp4(packed, scale, s2))


def test_malformed_fp8_tensors():
    q, s = quantize_fp8_per_tensor(_weights((16, 32), seed=2))
    with pytest.raises(ValueError, match=r"FP8 weight_scale of shape \(16,\)"):
        dequantize_fp8_per_tensor(q, torch.ones(16))
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        dequantize_fp8_per_tensor(q.view(torch.uint8), s)
    with pytest.raises(ValueError, match="must be float32"):
        dequantize_fp8_per_tensor(q, s.double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    w = _weights((256, 1024), seed=9, dtype=torch.bfloat16)
    cpu = quantize_nvfp4(w)
    gpu = quantize_nvfp4(w.cuda())
    assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1].view(torch.uint8), gpu[1].view(torch.uint8).cpu())
    assert torch.equal(cpu[2], gpu[2].cpu())
    for dt in (torch.bfloat16, torch.float32):
        assert torch.equal(_bits(dequantize_nvfp4(*cpu, dt)), _bits(dequantize_nvfp4(*gpu, dt).cpu()))
    q, s = quantize_fp8_per_tensor(w)
    qg, sg = quantize_fp8_per_tensor(w.cuda())
    assert torch.equal(q.view(torch.uint8), qg.view(torch.uint8).cpu()) and torch.equal(s, sg.cpu())
