"""W4A16 GEMM over NVFP4 weights (Triton): ``y = x @ W^T`` with W decoded tile by tile in the kernel,
so only its 4-bit codes and scales live in memory (~3.6x fewer weight bytes than bf16).

W is a ModelOpt NVFP4 / W4A16_NVFP4 weight as exported: ``packed`` uint8 [N, K/2] (two e2m1 codes
a byte, element 2i in the low nibble), ``block_scale`` float8_e4m3fn [N, K/16], ``global_scale`` an
fp32 scalar, or one per output row (fused siblings such as gate | up keep their own exactly, where
vLLM's Marlin path needs one and warns). Each tile is decoded exactly as ``quant/nvfp4.dequantize_nvfp4``: the e2m1 value times
(float32(block scale) x global scale), both products in fp32, rounded once to the activation dtype;
the products with x accumulate in fp32 (tensor cores for bf16 / fp16; IEEE fp32 dots for float32).
So the result is ``x @ dequantize_nvfp4(W, x.dtype)^T`` up to the GEMM's summation order.
Launch tiles are untuned (no H200 run yet).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.quant.nvfp4 import NVFP4_GROUP_SIZE as GROUP  # the block size along K


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ROW_SCALES: tl.constexpr, GROUP: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y; walks K in BLOCK_K steps (a multiple of 2 x GROUP)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    if ROW_SCALES:  # one global scale per output row, else the tensor's one
        s2 = tl.load(s2_ptr + rn, mask=n_ok, other=0.0)
    else:
        s2 = tl.load(s2_ptr + rn * 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :],
                    mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
        rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        wb = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rb[None, :],
                     mask=n_ok[:, None] & (rb < K // 2)[None, :], other=0).to(tl.int32)
        codes = tl.reshape(tl.join(wb & 0xF, wb >> 4), (BLOCK_N, BLOCK_K))  # low nibble first
        mag = codes & 7
        e, half = mag >> 1, (mag & 1).to(tl.float32) * 0.5
        # e2m1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}: 0.5 m when e == 0, else (1 + 0.5 m) 2^(e - 1)
        val = tl.where(e == 0, half, (1.0 + half) * tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0)))
        val = tl.where(codes >= 8, -val, val)
        rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        sb = tl.load(s_ptr + rn.to(tl.int64)[:, None] * stride_sn + rg[None, :],
                     mask=n_ok[:, None] & (rg < K // GROUP)[None, :], other=0)
        scale = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s2[:, None]  # [BLOCK_N, BLOCK_K / GROUP]
        w = tl.reshape(tl.reshape(val, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * scale[:, :, None], (BLOCK_N, BLOCK_K))
        w = w.to(x_ptr.dtype.element_ty)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): decode-sized rows read wide weight tiles."""
    if m <= 16:
        return 16, 64, 128, 4
    if m <= 64:
        return 64, 64, 64, 4
    return 128, 128, 64, 8


def w4a16_matmul(
    x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
    out: torch.Tensor | None = None, tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32, last dim contiguous) @ W^T -> [..., N] in x's dtype; W as the
    module docstring (``global_scale`` a 1-element or [N] fp32 tensor on x's device). ``tiles`` overrides
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for tests and tuning."""
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
        bm, bn, bk, warps = tiles or _tiles(m)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _w4a16_kernel[grid](
            x2, packed, block_scale.view(torch.uint8), global_scale.reshape(-1).float(), y,
            m, n, k, x2.stride(0), packed.stride(0), block_scale.stride(0), y.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=x.dtype == torch.float32,
            ROW_SCALES=global_scale.numel() > 1, GROUP=GROUP, num_warps=warps,
        )
    return y.reshape(*x.shape[:-1], n)
