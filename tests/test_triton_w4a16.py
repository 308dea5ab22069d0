"""The W4A16 NVFP4 GEMM (kernels/triton_w4a16.py) on fresh random weights quantized by the reference
codec (quant/nvfp4.py): the kernel layout and its exactness, the inline PTX emulated instruction by
instruction against the Triton twin of the decode, and the GEMM against float64 (several shapes, K
not a multiple of 64, N and M not of their tiles, bf16 / fp16 / fp32, forced tiles and stream-K
splits, outputs poisoned with NaN first). CPU: the Triton interpreter; the GPU adds the 27B's MLP
shapes and runs the PTX.

The bounds: the kernel multiplies by the weights ``e2m1 * s_b * s2`` exactly (no rounding to x's
dtype), so against that product in float64 an fp32-accumulated dot of K terms, scaled once and
rounded once to the output dtype, is off by at most ``u_out |y| + (K + 1) u_fp32 (|x| @ |W|^T)``
(u the unit roundoff). Against ``x @ dequantize_nvfp4(W, dtype)^T`` (every weight rounded to the
dtype first, the reference backend) the weights' own rounding adds ``u_dtype (|x| @ |W|^T)``. torch's
matmul of the dequantized weights is checked against the same bounds, so they are not tighter than
the reference's own spread."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.quant.nvfp4 import dequantize_nvfp4, e2m1_table, quantize_nvfp4, unpack_e2m1
from triton_support import kernel_device, skip_without_triton_device

DEV = kernel_device()
SHAPES = [(1, 48, 64), (5, 96, 160), (33, 64, 96), (70, 130, 48), (17, 40, 256)]  # (M, N, K)
if DEV == "cuda":
    SHAPES += [(1, 17408 * 2, 5120), (16, 5120, 17408), (256, 17408, 5120)]
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _exact(packed: torch.Tensor, block_scale: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """float64 weights e2m1 * s_b * s2, no rounding (s2 one value or one per row)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    v = e2m1_table()[unpack_e2m1(packed.cpu()).long()].double().reshape(n, k // 16, 16)
    return (v * block_scale.cpu().double()[..., None] * s2.cpu().double().reshape(-1, 1, 1)).reshape(n, k)


def _bound_ok(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, weight_unit: float = 0.0) -> bool:
    """(float64 on the kernel device: the H200 runs the 27B shapes' references in a blink)"""
    x64, w64 = x.to(DEV, torch.float64), w64.to(DEV, torch.float64)
    want = x64 @ w64.T
    mag = x64.abs() @ w64.abs().T
    slack = UNIT[y.dtype] * want.abs() + ((x.shape[-1] + 1) * 2.0**-24 + weight_unit) * mag
    return bool(((y.to(DEV, torch.float64) - want).abs() <= slack * 1.0001 + 1e-30).all())


def _quantized(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[0, :16] *= 40  # one block far from the rest: its own scale
    return quantize_nvfp4(w), gen


def _decode_layout(codes: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The kernel layout read back in torch (float64 [N, 128 P]): what the module docstring says
    (pair P, word 8q + 4cc + t: element j is feature 128P + 64cc + 16q + 4j + t; byte 2q + cc its
    scale)."""
    from kvserve.kernels.triton_w4a16 import MAG_AT, SIGN_AT

    n = codes.shape[0]
    if codes.shape[1] > 1:  # pair-major (one pair: the strides of a size-1 dim do not matter)
        assert codes.stride()[:2] == (32, 32 * n) and scales.stride()[:2] == (8, 8 * n)
    h = codes.cpu().to(torch.int32).reshape(n, -1, 4, 2, 4) & 0xFFFF  # [N, P, q, cc, t]
    b = scales.cpu().to(torch.int32).reshape(n, -1, 4, 2)  # [N, P, q, cc]
    s = (2.0 ** ((b >> 3) - 15).double()) * (1 + (b & 7).double() / 8) / 128  # S0E5M3 -> s_b
    out = torch.empty(n, h.shape[1], 2, 4, 4, 4, dtype=torch.float64)  # [N, P, cc, q, j, t]
    for j in range(4):
        code = ((h >> MAG_AT[j]) & 7) | (((h >> SIGN_AT[j]) & 1) << 3)
        out[:, :, :, :, j] = (e2m1_table()[code.long()].double() * s[..., None]).permute(0, 1, 3, 2, 4)
    return out.reshape(n, -1) * row_scale.cpu().double()[:, None] / 128


def test_pack_w4a16_reads_back_the_exact_weights():
    """Every code and every positive e4m3 block scale survives the repack exactly; a negative block
    scale moves into its codes' signs and a zero one zeroes its codes; K pads to 128 with zeros."""
    from kvserve.kernels.triton_w4a16 import pack_w4a16

    n, k = 126, 80
    codes = torch.arange(n * k).remainder(16).to(torch.uint8).reshape(n, k)
    packed = (codes[:, 1::2] << 4) | codes[:, 0::2]
    block = torch.arange(1, 127, dtype=torch.uint8).repeat_interleave(k // 16).reshape(n, k // 16)
    block = block.view(torch.float8_e4m3fn).clone()  # every positive finite e4m3 value, 2^-9 .. 448
    block[5, 1] = (-block[5, 1].float()).to(torch.float8_e4m3fn)
    block[6, 2] = 0.0
    rows = torch.linspace(0.5, 3.0, n)
    wt = pack_w4a16(packed, block, rows)
    assert wt.codes.dtype == torch.int16 and tuple(wt.codes.shape) == (n, 1, 32) and wt.in_features == k
    assert wt.scales.dtype == torch.uint8 and tuple(wt.scales.shape) == (n, 1, 8) and wt.out_features == n
    wide = pack_w4a16(torch.cat([packed] * 3, 1), torch.cat([block] * 3, 1), rows)  # K = 240: two pairs
    assert tuple(wide.codes.shape) == (n, 2, 32) and tuple(wide.scales.shape) == (n, 2, 8)
    assert torch.equal(_decode_layout(wide.codes, wide.scales, wide.row_scale)[:, :3 * k],
                       torch.cat([_exact(packed, block, rows)] * 3, 1))
    got = _decode_layout(wt.codes, wt.scales, wt.row_scale)
    want = _exact(packed, block, rows)
    assert torch.equal(got[:, :k], want) and not bool(got[:, k:].any())
    assert bool(want[5, 16:32].abs().sum() > 0) and not bool(want[6, 32:48].any())
    with pytest.raises(ValueError, match=r"weight_scale \(126, 5\) holds NaN block scales"):
        pack_w4a16(packed, torch.full_like(block, float("nan")), rows)
    with pytest.raises(ValueError, match=r"weight_scale_2 of 3 torch.float32 values, expected float32, 1 or N = 126"):
        pack_w4a16(packed, block, rows[:3])
    with pytest.raises(ValueError, match=r"weight_scale \(126, 4\) torch.float8_e4m3fn, expected float8_e4m3fn \(126, 5\)"):
        pack_w4a16(packed, block[:, :4].contiguous(), rows)


def _run_ptx(text: str, regs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Emulate the decode PTX on uint32 arrays: and / or / shl / shr / prmt / mad.lo and the rounded
    bf16x2 / f16x2 multiplies (the product formed exactly in fp32, then rounded to nearest even)."""
    regs = dict(regs)

    def val(a: str) -> np.ndarray:
        return regs[a] if a in regs else np.uint32(int(a, 0))

    def halves(r: np.ndarray, dt: torch.dtype) -> torch.Tensor:
        lo, hi = (r & 0xFFFF).astype(np.int32), (r >> 16).astype(np.int32)
        bits = torch.from_numpy(np.stack([lo, hi]).astype(np.int16))
        return bits.view(dt).float()

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [a.strip() for a in rest.split(",")]
        a = [val(s) for s in src]
        if op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "shl.b32":
            r = (a[0].astype(np.uint64) << np.uint64(a[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            r = a[0] >> np.uint32(a[1])
        elif op == "mad.lo.u32":
            r = (a[0].astype(np.uint64) * np.uint64(a[1]) + np.uint64(a[2])) & 0xFFFFFFFF
        elif op == "prmt.b32":
            src8 = [(a[0] >> (8 * i)) & 0xFF for i in range(4)] + [(np.broadcast_to(a[1], a[0].shape) >> (8 * i)) & 0xFF
                                                                 for i in range(4)]
            r = np.zeros_like(a[0])
            for i in range(4):
                sel = (int(a[2]) >> (4 * i)) & 0xF
                byte = src8[sel & 7]
                if sel & 8:
                    byte = np.where(byte & 0x80, 0xFF, 0)
                r = r | (byte.astype(np.uint32) << (8 * i))
        elif op in ("mul.rn.bf16x2", "mul.rn.f16x2"):
            dt = torch.bfloat16 if "bf16" in op else torch.float16
            prod = (halves(a[0], dt) * halves(a[1], dt)).to(dt).view(torch.int16).numpy().astype(np.int32) & 0xFFFF
            r = prod[0].astype(np.uint32) | (prod[1].astype(np.uint32) << 16)
        else:
            raise AssertionError(f"unexpected PTX {op}")
        regs[dst] = np.asarray(r, dtype=np.uint32)
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_ptx_matches_the_twin_bit_for_bit(dtype):
    """The inline PTX (made from the bit layout), emulated on every 16-bit code word (two words a
    register) and random scales of the whole e4m3 range: each output half equals e2m1 * s_b * 2^-7
    in the dtype (exact), which is what ``_decode_twin`` computes in the interpreter."""
    from kvserve.kernels import triton_w4a16 as k
    from kvserve.kernels.triton_w4a16 import MAG_AT, SIGN_AT

    words = np.arange(1 << 16, dtype=np.uint32)
    other = (words * 40503 + 12345) & 0xFFFF
    gen = np.random.default_rng(3)
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    s0e5m3 = (((e4m3 * 128).half().view(torch.int16).int() >> 7) & 0xFF).numpy().astype(np.uint32)
    pick = gen.integers(0, len(s0e5m3), size=(2, words.size))
    bf16 = dtype == torch.bfloat16
    # the scale PTX: one byte (the Triton kernels) and two bytes (the Gluon kernel's pair); a byte
    # above the ones read must not matter
    one = _run_ptx(k._scales_text(bf16, 1), {"$1": s0e5m3[pick[0]] | (s0e5m3[pick[1]] << 8)})
    two = _run_ptx(k._scales_text(bf16, 2), {"$2": s0e5m3[pick[0]] | (s0e5m3[pick[1]] << 8) | (0xA5 << 16)})
    assert np.array_equal(one["$0"], two["$0"])
    out = {}
    for b in range(2):
        regs = {"$4": words | (other << 16), "$5": two[f"${b}"], "$6": two[f"${b}"]}
        out[b] = _run_ptx((k._DECODE_BF16 if bf16 else k._DECODE_FP16).value, regs)
    lut = e2m1_table().double()
    for j, b in [(j, b) for j in range(4) for b in range(2)]:
        s_b = torch.from_numpy(e4m3.numpy()[pick[b]]).double()
        for half, h in ((0, words), (1, other)):
            h = torch.from_numpy(h.astype(np.int64))
            code = ((h >> MAG_AT[j]) & 7) | (((h >> SIGN_AT[j]) & 1) << 3)
            want = (lut[code] * s_b / 128).to(dtype).view(torch.int16).numpy().astype(np.int32) & 0xFFFF
            got = ((out[b][f"${j}"] >> (16 * half)) & 0xFFFF).astype(np.int32)
            assert np.array_equal(got, want), (j, half, int((got != want).sum()))


def test_decode_ptx_with_a_scale_of_2_14_gives_e2m1_exactly():
    """The large-batch dequantisation's decode on CUDA (``_dequantize_kernel``, PTX): the fp16 PTX with
    the scale pair 2^14 (0x7400) in place of a block scale, emulated on every 16-bit code word:
    each output half is the code's e2m1 value in fp16 (then widened to fp32 for the doc's product)."""
    from kvserve.kernels import triton_w4a16 as k
    from kvserve.kernels.triton_w4a16 import MAG_AT, SIGN_AT

    words = np.arange(1 << 16, dtype=np.uint32)
    other = (words * 40503 + 12345) & 0xFFFF
    two14 = np.full(words.size, 0x74007400, dtype=np.uint32)
    out = _run_ptx(k._DECODE_FP16.value, {"$4": words | (other << 16), "$5": two14, "$6": two14})
    lut = e2m1_table()
    for j in range(4):
        for half, h in ((0, words), (1, other)):
            h = torch.from_numpy(h.astype(np.int64))
            code = ((h >> MAG_AT[j]) & 7) | (((h >> SIGN_AT[j]) & 1) << 3)
            want = lut[code].half().view(torch.int16).numpy().astype(np.int32) & 0xFFFF
            got = ((out[f"${j}"] >> (16 * half)) & 0xFFFF).astype(np.int32)
            assert np.array_equal(got, want), (j, half, int((got != want).sum()))


@skip_without_triton_device()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_w4a16_matmul_against_float64(dtype, shape):
    from kvserve.kernels.triton_w4a16 import pack_w4a16, w4a16_matmul

    m, n, k = shape
    (packed, block_scale, s2), gen = _quantized(n, k, m * 7919 + n * 31 + k)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    wt = pack_w4a16(packed.to(DEV), block_scale.to(DEV), s2.to(DEV))
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    y = w4a16_matmul(x.to(DEV), wt, out=out)
    assert y.data_ptr() == out.data_ptr() and not bool(torch.isnan(y).any())
    w64 = _exact(packed, block_scale, s2)
    assert _bound_ok(y.cpu(), x, w64)
    wd = dequantize_nvfp4(packed, block_scale, s2, dtype)  # the reference backend's weights, rounded
    assert _bound_ok(y.cpu(), x, wd.double(), weight_unit=UNIT[dtype])
    if DEV == "cuda" or dtype == torch.float32:  # (CPU bf16 / fp16 matmul rounds differently inside)
        assert _bound_ok((x.to(DEV) @ wd.to(DEV).T).cpu(), x, w64, weight_unit=UNIT[dtype])


@skip_without_triton_device()
@pytest.mark.parametrize("tiles", [(16, 16, 1, 4, 1, 4, 1), (32, 16, 2, 4, 2, 4, 3), (16, 32, 3, 4, 3, 4, 7),
                                   (16, 16, 2, 4, 1, 4, 40), (32, 16, 1, 4, 1, 0, 0)],
                         ids=lambda t: "x".join(map(str, t)))
def test_w4a16_stream_k_splits_and_leading_dims(tiles):
    """Forced tiles and program counts: 1 (every tile in one program), 3 and 7 (parts of tiles meet
    in the tile counters), 40 (several programs a tile), 0 (one program a tile); x with leading
    dims [2, 3, K] -> [2, 3, N] into a poisoned output. The same bound every time, the same bits on
    a second call (the parts are summed in program order), and the tile counters are left at zero."""
    from kvserve.kernels import triton_w4a16 as kern

    (packed, block_scale, s2), gen = _quantized(40, 320, sum(tiles))
    x = torch.randn(2, 3, 320, generator=gen).to(torch.float32)
    wt = kern.pack_w4a16(packed.to(DEV), block_scale.to(DEV), s2.to(DEV))
    t = kern.W4A16Tiles(*tiles)
    out = torch.full((6, 40), float("nan"), dtype=torch.float32, device=DEV)
    y = kern.w4a16_matmul(x.to(DEV), wt, out=out, tiles=t)
    assert y.shape == (2, 3, 40) and y.dtype == torch.float32 and y.data_ptr() == out.data_ptr()
    assert _bound_ok(y.cpu().reshape(6, 40), x.reshape(6, 320), _exact(packed, block_scale, s2))
    assert torch.equal(kern.w4a16_matmul(x.to(DEV), wt, tiles=t), y)
    if DEV in kern._locks:
        assert not bool(kern._locks[torch.device(DEV)].any())


@skip_without_triton_device()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:4] + ([(16, 17408, 5120)] if DEV == "cuda" else []),
                         ids=lambda s: "x".join(map(str, s)))
def test_w4a16_one_dot_equals_four_dots(dtype, shape):
    """``W4A16Tiles.one_dot`` (a chunk's four k16 steps joined in K order into one K = 64 dot): within
    the float64 bound of the exact weights like the four dots (K and N not multiples of the tiles
    included), and on CUDA in bf16 / fp16 equal to them bit for bit (the same k16 MMAs in the same
    order; fp32 runs FMA dots, whose k order follows the operands' register layout: the H200 at
    75b9ece gave other bits, within the bound)."""
    from kvserve.kernels.triton_w4a16 import W4A16Tiles, pack_w4a16, w4a16_matmul

    m, n, k = shape
    (packed, block_scale, s2), gen = _quantized(n, k, m + n + k)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    wt = pack_w4a16(packed.to(DEV), block_scale.to(DEV), s2.to(DEV))
    got = {}
    for one_dot in (False, True):
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        got[one_dot] = w4a16_matmul(x.to(DEV), wt, out=out, tiles=W4A16Tiles(64, 16, 2, 4, 3, one_dot=one_dot)).cpu()
        assert _bound_ok(got[one_dot], x, _exact(packed, block_scale, s2))
    if DEV == "cuda" and dtype != torch.float32:
        assert torch.equal(got[True], got[False])


@skip_without_triton_device()
def test_w4a16_per_row_global_scales_of_fused_siblings():
    """gate | up quantized apart (their own global scales) and stacked: one launch with a [N] global
    scale equals each half's own product."""
    from kvserve.kernels.triton_w4a16 import pack_w4a16, w4a16_matmul

    gen = torch.Generator().manual_seed(11)
    gate, up = torch.randn(24, 64, generator=gen), torch.randn(40, 64, generator=gen) * 9
    (pg, bg, sg), (pu, bu, su) = quantize_nvfp4(gate), quantize_nvfp4(up)
    assert float(sg) != float(su)
    packed, block_scale = torch.cat([pg, pu]), torch.cat([bg, bu])
    rows = torch.cat([sg.expand(24), su.expand(40)]).contiguous()
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    y = w4a16_matmul(x.to(DEV), pack_w4a16(packed.to(DEV), block_scale.to(DEV), rows.to(DEV))).cpu()
    assert _bound_ok(y, x, torch.cat([_exact(pg, bg, sg), _exact(pu, bu, su)]))


@skip_without_triton_device()
def test_w4a16_rejects_bad_input():
    from kvserve.kernels.triton_w4a16 import W4A16Tiles, pack_w4a16, w4a16_matmul

    packed, block_scale, s2 = quantize_nvfp4(torch.randn(8, 64))
    wt = pack_w4a16(packed.to(DEV), block_scale.to(DEV), s2.to(DEV))
    x = torch.randn(2, 64, device=DEV)
    with pytest.raises(ValueError, match=r"x \[\.\.\., 48\] does not match the weight's in_features 64"):
        w4a16_matmul(x[:, :48], wt)
    with pytest.raises(ValueError, match="x is torch.float64; accepted: bfloat16, float16, float32"):
        w4a16_matmul(x.double(), wt)
    with pytest.raises(ValueError, match=r"out \(2, 4\) torch.float32, expected \(2, 8\) torch.float32"):
        w4a16_matmul(x, wt, out=torch.empty(2, 4, device=DEV))
    with pytest.raises(ValueError, match="needs block_n, block_m >= 16"):
        w4a16_matmul(x, wt, tiles=W4A16Tiles(8, 16))
    with pytest.raises(ValueError, match=r"weight \(8, 4\) torch.uint8, expected uint8 \[N, K/2\] with K a multiple of 16"):
        pack_w4a16(packed[:, :4].contiguous(), block_scale[:, :1].contiguous(), s2)


@skip_without_triton_device()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_w4a16_equals_the_reference_dequantisation(dtype):
    """The large-batch path's weights: from the kernel layout back to ``dequantize_nvfp4``'s values
    bit for bit (the doc's order), K not a multiple of 64, per-row global scales, negative and zero
    block scales; a batch from ``DENSE_FROM_M`` rows multiplies by them with torch's GEMM."""
    from kvserve.kernels import triton_w4a16 as kern

    (packed, block_scale, s2), gen = _quantized(70, 208, 5)
    block_scale[3, 2] = (-block_scale[3, 2].float()).to(torch.float8_e4m3fn)
    block_scale[4, 1] = 0.0
    rows = (s2 * torch.linspace(0.25, 4.0, 70)).contiguous()
    want = torch.cat([dequantize_nvfp4(packed[i : i + 1], block_scale[i : i + 1], rows[i], dtype) for i in range(70)])
    wt = kern.pack_w4a16(packed.to(DEV), block_scale.to(DEV), rows.to(DEV))
    got = kern.dequantize_w4a16(wt, dtype).cpu()
    assert got.dtype == dtype and torch.equal(got, want)
    x = torch.randn(9, 208, generator=gen).to(dtype)
    y = kern.w4a16_matmul(x.to(DEV), wt, dense=True).cpu()
    assert torch.equal(y, (x.to(DEV) @ want.to(DEV).T).cpu())
    assert kern.use_dense_path(kern.DENSE_FROM_M, 17408, 5120) and not kern.use_dense_path(kern.DENSE_FROM_M - 1, 17408, 5120)
    assert not kern.use_dense_path(1 << 20, 248320, 5120)  # an lm_head's bf16 copy (2.5 GB) is never made


def test_ctas_per_sm_is_what_fits_an_sm_at_once():
    """The stream-K split's programs a SM, from a compiled kernel's registers, shared memory and
    warps (H200 limits: 64 Ki registers, 228 KiB shared, 2048 threads an SM). The numbers are the
    sm_90 compiles of the default tiles (docs/QUANTIZATION.md): 134 registers x 4 warps -> 3 by
    registers; 206 x 8 warps -> 1; 95 x 4 warps and 21.5 KiB -> 5; shared memory or threads limit
    the others."""
    from kvserve.kernels.triton_w4a16 import ctas_per_sm

    assert ctas_per_sm(134, 30720, 4) == 3
    assert ctas_per_sm(206, 65536, 8) == 1
    assert ctas_per_sm(95, 21504, 4) == 5
    assert ctas_per_sm(32, 100 * 1024, 4) == 2  # shared memory
    assert ctas_per_sm(16, 0, 4) == 16  # threads (2048 / 128)
    assert ctas_per_sm(255, 0, 32) == 1  # never 0
