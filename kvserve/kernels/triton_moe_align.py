"""``moe_align`` in one Triton launch (issue 18; vLLM's ``moe_align_block_size`` CUDA kernel is the
design studied): the (token, expert) rows of a batch grouped by expert into blocks of ``block_m``
for the grouped GEMMs, with no host sync. The torch twin, ``layers/moe.moe_align_torch``, takes ~10
launches (histogram, cumsums, argsort, searchsorted, fills, scatter); at decode, where an MoE
layer's GEMMs take a few microseconds, those launches cost more than the arithmetic, in every
layer of every step. Outputs equal the twin's exactly (an expert's rows ascending, -1 padding,
``num_experts`` for blocks past the last).

One program does it all (the counts are global): a histogram of the experts, their padded extents
(cumsum), -1 over ``ids`` and each block's expert; then, chunk by chunk, the rows sorted by
(expert, row) in registers, each placed at its expert's start + the rows of that expert seen in
earlier chunks + its rank in this chunk. Per-expert offsets reach the sorted rows through a small
scratch vector in global memory (a barrier on each side)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels import pdl


@triton.jit
def _moe_align_kernel(
    top_ptr, ids_ptr, block_expert_ptr, scratch_ptr, rows, total, num_blocks,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, NB: tl.constexpr,
    PDL: tl.constexpr,
):
    """``top_ptr``: the ``rows`` flattened expert ids; padding rows of a chunk take bin E (counted,
    never placed). E_PAD > E is a power of two (the histogram's bins)."""
    pdl.start(PDL)
    bins = tl.arange(0, E_PAD)
    real = bins < E
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, rows, CHUNK):
        r = start + lane
        counts += tl.histogram(tl.load(top_ptr + r, mask=r < rows, other=E).to(tl.int32), E_PAD)
    padded = tl.where(real, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    for start in range(0, total, CHUNK):
        r = start + lane
        tl.store(ids_ptr + r, tl.full([CHUNK], -1, tl.int32), mask=r < total)
    # block b's expert: the experts whose padded extent ends at or before b * BLOCK_M (E past the last)
    for start in range(0, num_blocks, NB):
        b = start + tl.arange(0, NB)
        ended = (pad_end[None, :] <= b[:, None] * BLOCK_M) & real[None, :]
        tl.store(block_expert_ptr + b, tl.sum(ended.to(tl.int32), axis=1), mask=b < num_blocks)
    tl.debug_barrier()  # the -1 fill before any row lands
    seen = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, rows, CHUNK):
        r = start + lane
        e = tl.load(top_ptr + r, mask=r < rows, other=E).to(tl.int32)
        hist = tl.histogram(e, E_PAD)
        # sorted position p of a row of expert x goes to pad_start[x] + seen[x] + (p - first[x])
        tl.store(scratch_ptr + bins, pad_start + seen - (tl.cumsum(hist, 0) - hist))
        tl.debug_barrier()
        key = tl.sort(e * CHUNK + lane)  # (expert, row) ascending; padding rows (bin E) last
        se, sl = key // CHUNK, key % CHUNK
        pos = tl.load(scratch_ptr + se) + lane
        tl.store(ids_ptr + pos, start + sl, mask=se < E)
        seen += hist
        tl.debug_barrier()  # the scratch vector is read before the next chunk writes it


def moe_align_triton(top_idx: torch.Tensor, num_experts: int, block_m: int,
                     chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers/moe.moe_align`` in one launch: ids int32 [P] and block experts int32 [P / block_m],
    P = ``T k + E (block_m - 1)`` rounded up to ``block_m`` (the twin's bound). ``chunk`` (a power of
    two >= 32) overrides the rows sorted at a time (tests: several chunks on few rows)."""
    flat = top_idx.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    rows = flat.numel()
    total = -(-(rows + num_experts * (block_m - 1)) // block_m) * block_m
    num_blocks = total // block_m
    ids = torch.empty(total, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    e_pad = triton.next_power_of_2(num_experts + 1)
    scratch = torch.empty(e_pad, dtype=torch.int32, device=flat.device)
    chunk = chunk or min(4096, max(128, triton.next_power_of_2(rows)))
    if chunk < 32 or chunk & (chunk - 1):
        raise ValueError(f"moe_align_triton: chunk {chunk}, expected a power of two >= 32")
    _moe_align_kernel[(1,)](
        flat, ids, block_expert, scratch, rows, total, num_blocks,
        E=num_experts, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk, NB=max(16, min(128, 8192 // e_pad)),
        # at least one row a thread: tl.histogram over a layout replicated across threads is avoided
        num_warps=min(8, max(1, chunk // 128)), **pdl.launch_options(flat.device),
    )
    return ids, block_expert
