"""W4A16 GEMM over NVFP4 weights (Triton): ``y = x @ W^T`` with W decoded tile by tile in the kernel,
so only its 4-bit codes and scales live in memory (~3.6x fewer weight bytes than bf16).

W is a ModelOpt NVFP4 / W4A16_NVFP4 weight as exported: ``packed`` uint8 [N, K/2] (two e2m1 codes
a byte, element 2i in the low nibble), ``block_scale`` float8_e4m3fn [N, K/16], ``global_scale`` an
fp32 scalar, or one per output row (fused siblings such as gate | up keep their own exactly, where
vLLM's Marlin path needs one and warns). Each tile is decoded exactly as ``quant/nvfp4.dequantize_nvfp4``: the e2m1 value times
(float32(block scale) x global scale), both products in fp32, rounded once to the activation dtype;
the products with x accumulate in fp32 (tensor cores for bf16 / fp16; IEEE fp32 dots for float32).
So the result is ``x @ dequantize_nvfp4(W, x.dtype)^T`` up to the GEMM's summation order.
K can be split over several programs (``W4A16Tiles.split_k``) so that a decode-sized product with
few output columns still fills the GPU; the fp32 partials are summed in order (deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.quant.nvfp4 import NVFP4_GROUP_SIZE as GROUP  # the block size along K


@dataclass(frozen=True)
class W4A16Tiles:
    """Launch tiles: rows x output columns x K step of a program, warps, pipeline stages, and
    ``split_k`` parts of K run as separate programs (fp32 partials summed after, in a fixed order)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


@triton.jit
def _e2m1_times_2_14(codes):
    """e2m1 codes (int32, 0-15) -> fp32 value / 2^14: the sign to bit 15 of an fp16, the 3 magnitude
    bits (e1 e0 m) to bits 11-9, which reads 2^(e - 15) (1 + m / 2), or m 2^-15 for e == 0."""
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_ym, stride_ys,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ROW_SCALES: tl.constexpr, GROUP: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y over K range ``[split * k_per_split, +k_per_split)`` (a
    multiple of BLOCK_K, itself a multiple of 2 x GROUP), in BLOCK_K steps."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = rm < M, rn < N
    if ROW_SCALES:  # one global scale per output row, else the tensor's one
        s2 = tl.load(s2_ptr + rn, mask=n_ok, other=0.0)
    else:
        s2 = tl.load(s2_ptr + rn * 0)
    # the e2m1 value's 2^14 goes into the scale (a power of two: exact), so each element costs the
    # bit moves, one conversion and one fp32 multiply: value x (float32(block scale) x global scale)
    s2 = s2 * 16384.0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = split * k_per_split
    # The weight tile is taken as [BLOCK_K / 2, BLOCK_N] bytes: the low nibbles are the even K rows,
    # the high nibbles the odd ones, so x is read as its even and odd columns and two dots of
    # BLOCK_K / 2 add up (no interleaving of the nibbles, no transpose); byte j's block scale is
    # byte j // (GROUP / 2)'s (read once per byte, from cache).
    rj = tl.arange(0, BLOCK_K // 2)
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        rb = k0 // 2 + rj
        b_ok = rb < K // 2
        x_row = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + 2 * rb[None, :]
        x_mask = m_ok[:, None] & b_ok[None, :]
        x_even = tl.load(x_row, mask=x_mask, other=0.0)
        x_odd = tl.load(x_row + 1, mask=x_mask, other=0.0)
        w_mask = b_ok[:, None] & n_ok[None, :]
        wb = tl.load(w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rb[:, None], mask=w_mask, other=0).to(tl.int32)
        sb = tl.load(s_ptr + rn.to(tl.int64)[None, :] * stride_sn + (rb // (GROUP // 2))[:, None], mask=w_mask, other=0)
        scale = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s2[None, :]  # [BLOCK_K / 2, BLOCK_N]
        w_even = (_e2m1_times_2_14(wb & 0xF) * scale).to(x_ptr.dtype.element_ty)
        w_odd = (_e2m1_times_2_14(wb >> 4) * scale).to(x_ptr.dtype.element_ty)
        if IEEE:
            acc += tl.dot(x_even, w_even, input_precision="ieee")
            acc += tl.dot(x_odd, w_odd, input_precision="ieee")
        else:
            acc += tl.dot(x_even, w_even)
            acc += tl.dot(x_odd, w_odd)
    y_ptr += split.to(tl.int64) * stride_ys
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def default_tiles(m: int, n: int, k: int) -> W4A16Tiles:
    """The launch tiles for an [m, k] x [k, n] product (untuned until the H200 sweep lands)."""
    if m <= 16:
        return W4A16Tiles(16, 64, 128, 4)
    if m <= 64:
        return W4A16Tiles(64, 64, 64, 4)
    return W4A16Tiles(128, 128, 64, 8)


def w4a16_matmul(
    x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
    out: torch.Tensor | None = None, tiles: W4A16Tiles | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32, last dim contiguous) @ W^T -> [..., N] in x's dtype; W as the
    module docstring (``global_scale`` a 1-element or [N] fp32 tensor on x's device). ``tiles``
    overrides ``default_tiles`` (tests and tuning); every tiling gives the same product up to the
    fp32 summation order."""
    n, half_k = packed.shape
    k = x.shape[-1]
    if packed.dtype != torch.uint8 or k != 2 * half_k or k % GROUP:
        raise ValueError(f"w4a16_matmul: x [..., {k}] does not match packed {tuple(packed.shape)} {packed.dtype} "
                         f"(uint8 [N, K/2], K a multiple of {GROUP})")
    if block_scale.dtype != torch.float8_e4m3fn or tuple(block_scale.shape) != (n, k // GROUP):
        raise ValueError(f"w4a16_matmul: block_scale {tuple(block_scale.shape)} {block_scale.dtype}, expected "
                         f"float8_e4m3fn {(n, k // GROUP)}")
    if global_scale.numel() not in (1, n):
        raise ValueError(f"w4a16_matmul: global_scale of {global_scale.numel()} values, expected 1 or N = {n}")
    x2 = x.reshape(-1, k)
    assert x2.stride(-1) == 1 and packed.is_contiguous() and block_scale.is_contiguous()
    m = x2.shape[0]
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert y.shape == (m, n) and y.stride(-1) == 1
    if m:
        t = tiles or default_tiles(m, n, k)
        if t.block_k % (2 * GROUP) or t.split_k < 1:
            raise ValueError(f"w4a16_matmul: {t} needs block_k a multiple of {2 * GROUP} and split_k >= 1")
        k_per_split = triton.cdiv(triton.cdiv(k, t.split_k), t.block_k) * t.block_k
        splits = triton.cdiv(k, k_per_split)
        part = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), splits)
        _w4a16_kernel[grid](
            x2, packed, block_scale.view(torch.uint8), global_scale.reshape(-1).float(), part,
            m, n, k, k_per_split, x2.stride(0), packed.stride(0), block_scale.stride(0), part.stride(-2),
            part.stride(0) if splits > 1 else 0,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, IEEE=x.dtype == torch.float32,
            ROW_SCALES=global_scale.numel() > 1, GROUP=GROUP, num_warps=t.num_warps, num_stages=t.num_stages,
        )
        if splits > 1:
            torch.sum(part, dim=0, out=y) if y.dtype == torch.float32 else y.copy_(part.sum(0))
    return y.reshape(*x.shape[:-1], n)
