"""The grouped GEMM of dense routed experts on CUDA (issue 18; vLLM's ``fused_moe`` Triton kernel is
the design studied): one launch computes every expert's rows, taking the row blocks that
``layers/moe.moe_align`` laid out on the device (each block's rows belong to one expert; -1 rows are
padding; blocks past the last get expert ``E``), so no step reads expert counts on the host and the
whole layer can be captured in a CUDA graph. The 4-bit twin is ``triton_w4a16.w4a16_grouped_matmul``
(same row layout); the torch twin is ``models/qwen3_next.Experts``' loop over experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels import pdl


@dataclass(frozen=True)
class MoETiles:
    """A grouped GEMM's launch besides its row block (``moe_align``'s ``block_m``): column and K
    tiles, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_tiles(block_m: int, n: int, dtype: torch.dtype) -> MoETiles:
    """The launch ``grouped_matmul`` takes without ``tiles`` (not yet tuned per shape on the GPU:
    ``benchmarks/moe_bench.py --sweep`` times the alternatives)."""
    return MoETiles(block_n=128 if n >= 128 and block_m <= 32 else 64, block_k=64 if dtype != torch.float32 else 32,
                    num_warps=4 if block_m <= 32 else 8, num_stages=3)


def check_routed_rows(name: str, ids: torch.Tensor, block_expert: torch.Tensor, block_m: int, out: torch.Tensor,
                      n: int, dtype: torch.dtype, row_weight: torch.Tensor | None = None) -> None:
    """The row layout and output every grouped GEMM over ``moe_align``'s blocks takes (dense, W4A16,
    FP8): int32 ids, ``block_m`` of them a block, ``out`` [rows, n] of ``dtype``, unit column stride,
    and the optional ``row_weight``: one contiguous value per row of ``out``."""
    if ids.dtype != torch.int32 or block_expert.dtype != torch.int32 or ids.numel() != block_expert.numel() * block_m:
        raise ValueError(f"{name}: ids {tuple(ids.shape)} {ids.dtype} and block_expert "
                         f"{tuple(block_expert.shape)} {block_expert.dtype}: int32, {block_m} ids a block")
    if out.dim() != 2 or out.shape[1] != n or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"{name}: out {tuple(out.shape)} {out.dtype}, expected [rows, {n}] {dtype}")
    if row_weight is not None and (row_weight.shape != (out.shape[0],) or not row_weight.is_contiguous()
                                   or not row_weight.is_floating_point()):
        raise ValueError(f"{name}: row_weight {tuple(row_weight.shape)} {row_weight.dtype}, expected a contiguous "
                         f"float [{out.shape[0]}] (one weight per routed row)")


@triton.jit
def _grouped_matmul_kernel(
    x_ptr, w_ptr, y_ptr, ids_ptr, expert_ptr, rw_ptr, as_ptr, ws_ptr, s_ptr,
    N, K, num_experts, stride_xm, stride_we, stride_wn, stride_ym,
    ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, ROW_WEIGHT: tl.constexpr, SCALED: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr,
):
    """Program (n, b): block b of BLOCK_M routed rows of expert ``expert[b]`` (>= num_experts: empty;
    with SHARED, expert ``num_experts`` is the shared expert, its weight at ``s_ptr`` in W_e's layout),
    columns [n * BLOCK_N, ...): y[row] = x[row // ROW_DIV] @ W_e^T, fp32 accumulation (float32
    operands: IEEE products, not TF32), then with SCALED times a_scale * w_scale[e] (fp8 operands,
    vLLM's order), with ROW_WEIGHT times rw[row], one rounding to y's dtype."""
    pdl.start(PDL)
    b = tl.program_id(1)
    e = tl.load(expert_ptr + b)
    if SHARED:
        experts = num_experts + 1
    else:
        experts = num_experts
    if e < experts:
        ids = tl.load(ids_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = ids >= 0
        x_rows = tl.where(m_ok, ids // ROW_DIV, 0).to(tl.int64)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + x_rows[:, None] * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
        w_base = w_ptr + e.to(tl.int64) * stride_we
        if SHARED:
            if e == num_experts:
                w_base = s_ptr
        w_tile = w_base + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [K, N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + rk < K
            xv = tl.load(x_tile + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wv = tl.load(w_tile + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(xv, wv, acc, input_precision="ieee")
            else:
                acc = tl.dot(xv, wv, acc)
        if SCALED:
            acc = acc * tl.load(as_ptr) * tl.load(ws_ptr + e)
        if ROW_WEIGHT:
            acc = acc * tl.load(rw_ptr + tl.where(m_ok, ids, 0), mask=m_ok, other=0.0).to(tl.float32)[:, None]
        y = y_ptr + tl.where(m_ok, ids, 0).to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, block_expert: torch.Tensor,
                   block_m: int, rows_per_x: int, out: torch.Tensor, row_weight: torch.Tensor | None = None,
                   tiles: MoETiles | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts: ``out[r] = x[r // rows_per_x] @ weight[e]^T`` for every row r listed in ``ids``
    (int32, blocks of ``block_m`` rows of one expert each, -1 padding; ``block_expert`` the expert of
    each block, E for an empty one). ``weight`` [E, N, K] in x's dtype; ``out`` [rows, N] in x's dtype;
    rows not listed are left as they are. ``row_weight`` (one value per routed row: the routing
    weights) multiplies each row's fp32 result before the rounding (vLLM's ``MUL_ROUTED_WEIGHT``).
    One launch, no host sync: graph-capturable. ``tiles`` overrides ``default_tiles`` (for tuning).
    ``shared`` [N, K] (the shared expert's weight, x's dtype) is expert E: rows ``moe_align`` laid out
    over E + 1 experts for it (the shared expert as one more expert of the launch)."""
    num_experts, n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(f"grouped_matmul: x {tuple(x.shape)} {x.dtype} and experts {tuple(weight.shape)} "
                         f"{weight.dtype} do not match")
    if shared is not None and (shared.shape != (n, k) or shared.dtype != x.dtype or shared.device != weight.device):
        raise ValueError(f"grouped_matmul: shared expert {tuple(shared.shape)} {shared.dtype}, expected [{n}, {k}] "
                         f"{x.dtype} beside experts {tuple(weight.shape)}")
    check_routed_rows("grouped_matmul", ids, block_expert, block_m, out, n, x.dtype, row_weight)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if shared is not None:  # one row stride for both (K: contiguous rows)
        shared = shared.contiguous()
        if weight.stride(1) != k:
            weight = weight.contiguous()
    return launch_grouped(x, weight, ids, block_expert, block_m, rows_per_x, out, row_weight,
                          tiles or default_tiles(block_m, n, x.dtype), shared=shared)


def launch_grouped(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, block_expert: torch.Tensor,
                   block_m: int, rows_per_x: int, out: torch.Tensor, row_weight: torch.Tensor | None,
                   tiles: MoETiles, a_scale: torch.Tensor | None = None,
                   w_scale: torch.Tensor | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped GEMM's launch over checked operands (``grouped_matmul``, optionally with the shared
    expert as expert E; ``triton_fp8_moe`` with its per-tensor scales ``a_scale`` (one value) and
    ``w_scale`` [E])."""
    if block_expert.numel() == 0:
        return out
    num_experts, n, k = weight.shape
    grid = (triton.cdiv(n, tiles.block_n), block_expert.numel())
    _grouped_matmul_kernel[grid](
        x, weight, out, ids, block_expert, out if row_weight is None else row_weight,
        out if a_scale is None else a_scale, out if w_scale is None else w_scale, weight if shared is None else shared,
        n, k, num_experts,
        x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        ROW_DIV=rows_per_x, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        IEEE=x.dtype == torch.float32, ROW_WEIGHT=row_weight is not None, SCALED=a_scale is not None,
        SHARED=shared is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl.launch_options(x.device),
    )
    return out
