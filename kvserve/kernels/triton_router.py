"""The MoE router and the shared-expert gate in Triton (issue 18): ``softmax_topk`` is the fp32 softmax
over the experts, the top-k and the optional renormalisation in one launch (vLLM's ``topk_softmax`` /
``fused_topk``, the design studied), and ``add_gated_shared`` adds the gated shared expert to the routed
output in place, one launch instead of the sigmoid, the product and the add. Used by
``models/qwen3_next.SparseMoeBlock`` when its experts run on the device (fused or NVFP4); the torch
ops there are the reference.

Tie rule: among equal probabilities the lower expert index comes first (vLLM's CUDA kernel breaks
ties the same way). torch.topk on CPU has no fixed order among equal values (a quickselect: top-3
of eight zeros gives experts 6, 5, 4), so only the values of tied slots match it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels import pdl


@triton.jit
def _softmax_topk_kernel(
    logits_ptr, w_ptr, idx_ptr, g_ptr, T, E, K, stride_lt, stride_wt, stride_it, stride_gt,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr, PDL: tl.constexpr,
):
    """Rows [pid * BLOCK_T, ...) of the [T, E] logits: p = exp(x - max) / sum in fp32, then K rounds
    of argmax (the lowest index among equal maxima), each winner struck out; a NaN probability ranks
    above every number (torch.topk's order) and comes back as NaN. With SHARED, slot K is the shared
    expert: expert E, weight sigmoid(g) of the row's gate logit at ``g_ptr`` (fp32, not renormalised)."""
    pdl.start(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_lt + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    x = tl.where(col_ok[None, :], x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])
    # selection keys: probabilities lie in [0, 1]; 2 stands for NaN, -1 for struck out or padding
    key = tl.where(ok, tl.where(p != p, 2.0, p), -1.0)
    ks = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in range(K):
        best = tl.max(key, axis=1)
        win = tl.min(tl.where(key == best[:, None], cols[None, :], BLOCK_E), axis=1)
        slot = ks[None, :] == j
        top_w = tl.where(slot, tl.where(best > 1.0, float("nan"), best)[:, None], top_w)
        top_i = tl.where(slot, win[:, None], top_i)
        key = tl.where(cols[None, :] == win[:, None], -1.0, key)
    if RENORMALIZE:
        total = tl.sum(tl.where(ks[None, :] < K, top_w, 0.0), axis=1)
        top_w = tl.math.div_rn(top_w, total[:, None])
    if SHARED:
        g = tl.load(g_ptr + rows * stride_gt, mask=row_ok, other=0.0).to(tl.float32)
        shared = ks[None, :] == K
        top_w = tl.where(shared, tl.math.div_rn(1.0, 1.0 + tl.exp(-g))[:, None], top_w)
        top_i = tl.where(shared, E, top_i)
        out_ok = row_ok[:, None] & (ks[None, :] <= K)
    else:
        out_ok = row_ok[:, None] & (ks[None, :] < K)
    tl.store(w_ptr + rows[:, None] * stride_wt + ks[None, :], top_w.to(w_ptr.dtype.element_ty), mask=out_ok)
    tl.store(idx_ptr + rows[:, None] * stride_it + ks[None, :], top_i.to(tl.int64), mask=out_ok)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 shared_gate: torch.Tensor | None = None,
                 weight_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of a softmax MoE in one launch: ``torch.topk(torch.softmax(logits, -1, float32),
    top_k)``, the weights divided by their sum when ``renormalize``. ``logits`` [T, E] (bf16, fp16 or
    fp32); returns the weights float32 [T, top_k] in descending order and the experts int64
    [T, top_k] (ties: the lower expert first), into ``out`` when given. No host sync: graph-capturable.
    ``shared_gate`` [T, 1] (the shared expert's gate logits) adds a slot: expert E with weight
    ``sigmoid(shared_gate)``, so the shared expert runs as one more routed expert ([T, top_k + 1]).
    ``weight_dtype`` (float32, bf16 or fp16): the weights rounded once to it in the kernel (the MoE
    block's dtype: no cast launch after it)."""
    if weight_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"softmax_topk: weight_dtype {weight_dtype}, expected float32, bfloat16 or float16")
    if logits.dim() != 2 or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"softmax_topk: logits {tuple(logits.shape)} {logits.dtype}, expected [T, E] bf16/fp16/fp32")
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"softmax_topk: top_k {top_k} for {e} experts")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if shared_gate is not None and (shared_gate.shape != (t, 1) or shared_gate.device != logits.device):
        raise ValueError(f"softmax_topk: shared_gate {tuple(shared_gate.shape)} on {shared_gate.device}, expected "
                         f"[{t}, 1] on {logits.device}")
    slots = top_k + (shared_gate is not None)
    if out is None:
        top_w = torch.empty((t, slots), dtype=weight_dtype, device=logits.device)
        top_idx = torch.empty((t, slots), dtype=torch.int64, device=logits.device)
    else:
        top_w, top_idx = out
        if (top_w.shape != (t, slots) or top_w.dtype != weight_dtype or top_w.stride(-1) != 1
                or top_idx.shape != (t, slots) or top_idx.dtype != torch.int64 or top_idx.stride(-1) != 1):
            raise ValueError(f"softmax_topk: out {tuple(top_w.shape)} {top_w.dtype}, {tuple(top_idx.shape)} "
                             f"{top_idx.dtype}; expected [{t}, {slots}] {str(weight_dtype).removeprefix('torch.')} "
                             "and int64, unit column stride")
    if t == 0:
        return top_w, top_idx
    block_e = triton.next_power_of_2(e)
    block_t = min(max(1, 2048 // block_e), 16, triton.next_power_of_2(t))  # small E: several rows a program
    _softmax_topk_kernel[(triton.cdiv(t, block_t),)](
        logits, top_w, top_idx, logits if shared_gate is None else shared_gate, t, e, top_k, logits.stride(0),
        top_w.stride(0), top_idx.stride(0), 0 if shared_gate is None else shared_gate.stride(0),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(slots), RENORMALIZE=bool(renormalize),
        SHARED=shared_gate is not None,
        num_warps=4 if block_t * block_e <= 2048 else 8, **pdl.launch_options(logits.device),
    )
    return top_w, top_idx


@triton.jit
def _add_gated_shared_kernel(r_ptr, s_ptr, g_ptr, n, stride_rt, stride_st, stride_gt,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
    """routed[t] += sigmoid(gate[t]) * shared[t] over columns [pid1 * BLOCK, ...): fp32, one rounding."""
    pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(g_ptr + t * stride_gt).to(tl.float32)
    sig = tl.math.div_rn(1.0, 1.0 + tl.exp(-g))
    r = tl.load(r_ptr + t * stride_rt + cols, mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + t * stride_st + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(r_ptr + t * stride_rt + cols, (r + sig * s).to(r_ptr.dtype.element_ty), mask=m)


def add_gated_shared(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """``routed + torch.sigmoid(gate_logit) * shared`` written into ``routed`` (returned): routed and
    shared [T, H] of one dtype (unit column stride), ``gate_logit`` [T, 1] (the shared-expert gate's
    output); computed in fp32 and rounded once, so within torch's own rounding of the three ops."""
    t, n = routed.shape
    if (shared.shape != routed.shape or shared.dtype != routed.dtype or gate_logit.shape != (t, 1)
            or routed.stride(-1) != 1):
        raise ValueError(f"add_gated_shared: routed {tuple(routed.shape)} {routed.dtype} (unit column stride), "
                         f"shared {tuple(shared.shape)} {shared.dtype}, gate {tuple(gate_logit.shape)}")
    if shared.stride(-1) != 1:
        shared = shared.contiguous()
    if t and n:
        block = min(1024, triton.next_power_of_2(n))
        _add_gated_shared_kernel[(t, triton.cdiv(n, block))](
            routed, shared, gate_logit, n, routed.stride(0), shared.stride(0), gate_logit.stride(0),
            BLOCK=block, num_warps=4, **pdl.launch_options(routed.device),
        )
    return routed
