"""The grouped GEMM of FP8 routed experts (issue 18; ``layers/quant_experts.FP8Experts``): vLLM's
ModelOpt FP8 MoE arithmetic (``fused_moe_kernel`` with ``use_fp8_w8a8`` and per-tensor scales) over
the row blocks of ``layers/moe.moe_align``, as the dense ``triton_moe.grouped_matmul``: one launch,
no host sync. Operands are float8_e4m3fn (the activations quantized beforehand with the static input
scale, ``triton_layers.fp8_static_quant``); ``tl.dot`` multiplies fp8 by fp8 into fp32, and the
accumulator is scaled once, ``acc * a_scale * w_scale[e]``, then rounded to the output dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_moe import check_routed_rows


@triton.jit
def _fp8_grouped_kernel(
    x_ptr, w_ptr, ws_ptr, as_ptr, y_ptr, ids_ptr, expert_ptr, rw_ptr,
    N, K, num_experts, stride_xm, stride_we, stride_wn, stride_ym,
    ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROW_WEIGHT: tl.constexpr,
):
    """Program (n, b): block b of BLOCK_M routed rows of expert ``expert[b]`` (>= num_experts: empty),
    columns [n * BLOCK_N, ...): y[row] = (xq[row // ROW_DIV] @ Wq_e^T) * a_scale * w_scale[e], the
    fp8 products summed in fp32, one rounding to y's dtype."""
    b = tl.program_id(1)
    e = tl.load(expert_ptr + b)
    if e < num_experts:
        ids = tl.load(ids_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = ids >= 0
        x_rows = tl.where(m_ok, ids // ROW_DIV, 0).to(tl.int64)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + x_rows[:, None] * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
        w_tile = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [K, N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + rk < K
            xv = tl.load(x_tile + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wv = tl.load(w_tile + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(xv, wv, acc)
        acc = acc * tl.load(as_ptr) * tl.load(ws_ptr + e)  # vLLM's order: accumulator * a_scale * b_scale
        if ROW_WEIGHT:  # then the routing weight (vLLM's MUL_ROUTED_WEIGHT)
            acc = acc * tl.load(rw_ptr + tl.where(m_ok, ids, 0), mask=m_ok, other=0.0).to(tl.float32)[:, None]
        y = y_ptr + tl.where(m_ok, ids, 0).to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_grouped_matmul(xq: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, a_scale: torch.Tensor,
                       ids: torch.Tensor, block_expert: torch.Tensor, block_m: int, rows_per_x: int,
                       out: torch.Tensor, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Routed FP8 experts: ``out[r] = (xq[r // rows_per_x] @ weight[e]^T) * a_scale * w_scale[e]`` for
    every row r listed in ``ids`` (``moe_align``'s layout: int32, blocks of ``block_m`` rows of one
    expert, -1 padding; ``block_expert`` the expert of each block, E for an empty one). ``xq`` [M, K]
    and ``weight`` [E, N, K] float8_e4m3fn, ``w_scale`` fp32 [E], ``a_scale`` a one-element fp32
    tensor (the static input scale ``xq`` was quantized with), all on one device; ``out`` [rows, N]
    of any float dtype; rows not listed are left as they are; ``row_weight`` (one per routed row)
    multiplies each row's fp32 result last. One launch, no host sync."""
    num_experts, n, k = weight.shape if weight.dim() == 3 else (0, 0, -1)
    if xq.dim() != 2 or xq.shape[1] != k or xq.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_grouped_matmul: xq {tuple(xq.shape)} {xq.dtype} and experts {tuple(weight.shape)} "
                         f"{weight.dtype}: expected [M, K] and [E, N, K], both float8_e4m3fn")
    if w_scale.shape != (num_experts,) or w_scale.dtype != torch.float32 or a_scale.numel() != 1 \
            or a_scale.dtype != torch.float32:
        raise ValueError(f"fp8_grouped_matmul: w_scale {tuple(w_scale.shape)} {w_scale.dtype} and a_scale "
                         f"{tuple(a_scale.shape)} {a_scale.dtype}: expected float32 [{num_experts}] and one float32")
    devices = {t.device for t in (xq, weight, w_scale, a_scale, ids, block_expert, out)}
    if len(devices) != 1:
        raise ValueError(f"fp8_grouped_matmul: operands on {sorted(map(str, devices))}, expected one device")
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_grouped_matmul: out dtype {out.dtype}, expected bfloat16, float16 or float32")
    check_routed_rows("fp8_grouped_matmul", ids, block_expert, block_m, out, n, out.dtype, row_weight)
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if block_expert.numel() == 0:
        return out
    block_n = 128 if n >= 128 and block_m <= 32 else 64
    grid = (triton.cdiv(n, block_n), block_expert.numel())
    _fp8_grouped_kernel[grid](
        xq, weight, w_scale.contiguous(), a_scale, out, ids, block_expert, out if row_weight is None else row_weight,
        n, k, num_experts, xq.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        ROW_DIV=rows_per_x, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128 if k >= 128 else 64,
        ROW_WEIGHT=row_weight is not None,
        num_warps=4 if block_m <= 32 else 8, num_stages=3,
    )
    return out
