"""Routed experts on the device, shared by the dense (``kernels/triton_moe``) and the NVFP4
(``kernels/triton_w4a16``) grouped GEMMs: the (token, expert) rows laid out by expert in blocks
(``moe_align``, no host sync) and the SwiGLU expert layer over any grouped GEMM (``routed_swiglu``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvserve.kernels.moe_configs import MoELaunch


def expert_block_rows(rows: int, num_experts: int) -> int:
    """Rows a block of the grouped GEMMs takes for ``rows`` (token, expert) rows over ``num_experts``:
    16 while most experts get a few rows (decode), 64 for prefill chunks."""
    return 16 if rows <= 16 * num_experts else 64


# rows up to which CUDA takes the one-launch moe_align (one sorted chunk: 512 tokens of the 35B-A3B's top-8);
# not yet timed against the torch ops (benchmarks/moe_bench.py records both, align_ms / align_torch_ms)
ALIGN_KERNEL_MAX_ROWS = 4096


def moe_align(top_idx: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``t * k + j`` (token t's j-th expert) grouped by expert into blocks of ``block_m``: ids
    int32 [P] (-1 where a block is padding; an expert's rows ascending) and the expert of each block,
    int32 [P / block_m] (``num_experts`` for blocks past the last). P is the bound
    ``T k + E (block_m - 1)`` rounded up to ``block_m``, known without reading the counts, so nothing
    waits on the host (vLLM's ``moe_align_block_size`` sizes its buffers the same way). On CUDA, up
    to ``ALIGN_KERNEL_MAX_ROWS`` rows (decode batches), one Triton launch (``kernels/triton_moe_align``:
    one program, which sorts its rows a chunk at a time); else ``moe_align_torch``, its twin, whose
    ~10 launches spread a prefill chunk's sort over the whole GPU."""
    if top_idx.is_cuda and top_idx.numel() <= ALIGN_KERNEL_MAX_ROWS:
        from kvserve.kernels.triton_moe_align import moe_align_triton

        return moe_align_triton(top_idx, num_experts, block_m)
    return moe_align_torch(top_idx, num_experts, block_m)


def moe_align_torch(top_idx: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align`` in torch ops (~10 launches on a GPU; the Triton kernel's reference twin)."""
    flat = top_idx.reshape(-1)
    rows = flat.numel()
    total = -(-(rows + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.int64))  # (torch.bincount reads its max on the host)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    pos = (pad_end - padded)[expert] + torch.arange(rows, device=flat.device) - start[expert]
    ids = torch.full((total,), -1, dtype=torch.int32, device=flat.device)
    ids[pos] = order.to(torch.int32)
    blocks = torch.arange(0, total, block_m, device=flat.device)
    block_expert = torch.searchsorted(pad_end, blocks, right=True).to(torch.int32)
    return ids, block_expert


# matmul(a, "gate_up_proj" | "down_proj", ids, block_expert, block_m, rows_per_x, out[, row_weight], tiles=...): a
# grouped GEMM; row_weight (one per routed row) multiplies each row's fp32 result before its rounding; tiles (a
# table's MoETiles or None) is the dense and FP8 kernels' launch, which the NVFP4 kernel does not take
GroupedMatmul = Callable[..., torch.Tensor]


def routed_swiglu(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, num_experts: int,
                  intermediate: int, hidden: int, matmul: GroupedMatmul, launch: MoELaunch | None = None) -> torch.Tensor:
    """The dense ``Experts``' arithmetic over grouped GEMMs: per (token, slot) row
    ``down(silu(gate) * up)`` of its expert, times the routing weight (in the down GEMM, before its
    rounding, as vLLM's ``MUL_ROUTED_WEIGHT``), summed over the top-k. ``num_experts`` is what the
    rows are aligned over (E + 1 when a slot routes to the shared expert as expert E). ``launch`` (a
    tuned table's entry, ``kernels/moe_configs``) sets the row block and both GEMMs' tiles; else
    ``expert_block_rows`` and each kernel's defaults."""
    t, k = top_idx.shape
    block_m = launch.block_m if launch is not None else expert_block_rows(t * k, num_experts)
    tiles = launch.tiles if launch is not None else None
    ids, block_expert = moe_align(top_idx, num_experts, block_m)
    h = torch.empty((t * k, 2 * intermediate), dtype=x.dtype, device=x.device)
    matmul(x, "gate_up_proj", ids, block_expert, block_m, k, h, tiles=tiles)
    if h.dtype in (torch.bfloat16, torch.float16):  # one kernel, torch's rounding (kernels/triton_layers)
        from kvserve.kernels.triton_layers import silu_and_mul

        a = silu_and_mul(h)
    else:
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up
    d = torch.empty((t * k, hidden), dtype=x.dtype, device=x.device)
    matmul(a, "down_proj", ids, block_expert, block_m, 1, d, top_w.reshape(-1).contiguous(), tiles=tiles)  # weighted
    return d.view(t, k, hidden).sum(dim=1)
