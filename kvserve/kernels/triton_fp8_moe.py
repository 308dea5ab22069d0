"""The grouped GEMM of FP8 routed experts (issue 18; ``layers/quant_experts.FP8Experts``): vLLM's
ModelOpt FP8 MoE arithmetic (``fused_moe_kernel`` with ``use_fp8_w8a8`` and per-tensor scales) over
the row blocks of ``layers/moe.moe_align``: the dense ``triton_moe`` kernel with its per-tensor
scale epilogue (one launch, no host sync); this module checks the fp8 operands. Operands are float8_e4m3fn (the activations quantized beforehand with the static input
scale, ``triton_layers.fp8_static_quant``); ``tl.dot`` multiplies fp8 by fp8 into fp32, and the
accumulator is scaled once, ``acc * a_scale * w_scale[e]``, then rounded to the output dtype."""

from __future__ import annotations

import torch

from kvserve.kernels.triton_moe import MoETiles, check_routed_rows, launch_grouped


def fp8_grouped_matmul(xq: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, a_scale: torch.Tensor,
                       ids: torch.Tensor, block_expert: torch.Tensor, block_m: int, rows_per_x: int,
                       out: torch.Tensor, row_weight: torch.Tensor | None = None,
                       tiles: MoETiles | None = None) -> torch.Tensor:
    """Routed FP8 experts: ``out[r] = (xq[r // rows_per_x] @ weight[e]^T) * a_scale * w_scale[e]`` for
    every row r listed in ``ids`` (``moe_align``'s layout: int32, blocks of ``block_m`` rows of one
    expert, -1 padding; ``block_expert`` the expert of each block, E for an empty one). ``xq`` [M, K]
    and ``weight`` [E, N, K] float8_e4m3fn, ``w_scale`` fp32 [E], ``a_scale`` a one-element fp32
    tensor (the static input scale ``xq`` was quantized with), all on one device; ``out`` [rows, N]
    of any float dtype; rows not listed are left as they are; ``row_weight`` (one per routed row)
    multiplies each row's fp32 result last. One launch, no host sync. ``tiles`` overrides the defaults
    (a tuned table's launch, ``kernels/moe_configs``)."""
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
    tiles = tiles or MoETiles(block_n=128 if n >= 128 and block_m <= 32 else 64, block_k=128 if k >= 128 else 64,
                              num_warps=4 if block_m <= 32 else 8, num_stages=3)
    return launch_grouped(xq, weight, ids, block_expert, block_m, rows_per_x, out, row_weight, tiles,
                          a_scale, w_scale.contiguous())
