"""Triton kernels for the Gated DeltaNet layers of hybrid models, over a whole step's sequences.

Both kernels take the step's sequences packed along the token axis (``query_start_loc``), read each
sequence's state from its slot of the layer's state pool (``slots``; zeros where ``has_state`` is 0,
a sequence's first chunk) and write the state back in place. They are the batched twins of
``gdn_reference.causal_conv1d`` and ``gdn_reference.recurrent_gated_delta_rule`` (same math, same
casts; fp32 state and accumulation), and walk each sequence's tokens in order inside one program:
the decode path (one token per sequence) in one launch per layer. Long prefill chunks take the
chunk-parallel form in ``triton_gdn_chunk.py``.

- ``causal_conv1d_varlen``: program (sequence, block of channels); SiLU(depthwise conv) over
  ``state ++ x``, then the last W - 1 raw inputs become the new state.
- ``gated_delta_rule_varlen``: program (sequence, value head, block of V columns); the gates from
  the raw projections and q / k L2-normalised in fp32 in the kernel (q scaled), value head ``hv``
  reads key head ``hv // (HV/H)``; the [K, BLOCK_V] state block stays in registers across the
  sequence's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels import pdl
from kvserve.kernels.triton_store import num_sms

CHUNK = 64  # tokens per chunk of a prefill step (the chunk-parallel rule: four 16-row blocks)


@dataclass(frozen=True)
class ChunkPlan:
    """Where the chunks of a step's sequences are: ``chunks[i] = (sequence, chunk index in it)``
    and ``offsets[s]`` the first chunk of sequence ``s`` (``offsets[-1]`` chunks in all)."""

    chunks: torch.Tensor  # [NT, 2] int32
    offsets: torch.Tensor  # [B + 1] int32
    num_chunks: int
    chunk_size: int = CHUNK


def plan_chunks(query_lens: list[int], device: torch.device) -> ChunkPlan:
    """The chunk plan of a step from its host-side query lengths (one host-to-device copy)."""
    chunks, offsets = [], [0]
    for s, n in enumerate(query_lens):
        nc = -(-n // CHUNK)
        chunks.extend((s, c) for c in range(nc))
        offsets.append(offsets[-1] + nc)
    flat = [x for pair in chunks for x in pair] + offsets
    t = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
    return ChunkPlan(t[: 2 * len(chunks)].view(-1, 2), t[2 * len(chunks):], len(chunks))



@triton.jit
def gdn_gates(a, b, decay_rate, dt_bias):
    """``gdn_reference.gdn_gates`` on loaded raw projections (any shape): ``g = -exp(A_log) *
    softplus(a + dt_bias)`` (fp32, torch's softplus threshold 20; ``decay_rate = exp(A_log)``) and
    ``beta = sigmoid(b)`` rounded to the model dtype as torch's bf16/fp16 sigmoid."""
    x = a.to(tl.float32) + dt_bias
    g = -decay_rate * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    return g, tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)


@triton.jit
def _write_conv_state(state, x_ptr, start, n, c, c_ok, keep, stride_xt, W: tl.constexpr):
    """The new conv state: column j <- e[n + j], j = 0 .. W - 2 (e = old state ++ the n inputs), in
    increasing j: column n + j (n >= 1) is read before it is rewritten, and each thread reads and
    writes only its own channels."""
    for j in tl.static_range(W - 1):
        i = tl.zeros(c.shape, tl.int32) + n + j
        from_state = i < W - 1
        xs = tl.load(state + tl.minimum(i, W - 2), mask=c_ok & from_state & keep, other=0.0)
        xr = tl.load(x_ptr + (start + i - (W - 1)).to(tl.int64) * stride_xt + c, mask=c_ok & (i >= W - 1),
                     other=0.0)
        tl.store(state + j, tl.where(from_state, xs.to(tl.float32), xr.to(tl.float32)).to(state.dtype.element_ty),
                 mask=c_ok)


@triton.jit(do_not_specialize=["num_channels"])
def _conv1d_kernel(
    x_ptr, w_ptr, state_ptr, y_ptr, qsl_ptr, chunks_ptr, slots_ptr, has_state_ptr,
    num_channels, stride_xt, stride_yt, stride_ss, stride_sc,
    W: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKED: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr,
):
    """Program (sequence, block of channels) walking the sequence's tokens, then its new state;
    CHUNKED: program (chunk of BT tokens, block of channels), outputs only (the states are written
    afterwards by ``_conv_state_kernel``: another program may still read the old one)."""
    pdl.start(PDL)
    if CHUNKED:
        seq = tl.load(chunks_ptr + 2 * tl.program_id(0))
        t0 = tl.load(chunks_ptr + 2 * tl.program_id(0) + 1) * BT
    else:
        seq = tl.program_id(0)
        t0 = 0
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < num_channels
    start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - start
    t1 = tl.minimum(t0 + BT, n) if CHUNKED else n
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    keep = (tl.zeros([BLOCK_C], tl.int32) + tl.load(has_state_ptr + seq)) != 0  # read the slot's state
    state = state_ptr + slot * stride_ss + c * stride_sc  # [BLOCK_C] pointers to column 0
    # e = state (W - 1 columns) ++ x (n rows); y_t = SiLU(sum_w w[c, w] * e[t + w])
    for t in range(t0, t1):
        acc = tl.zeros([BLOCK_C], tl.float32)
        for w in tl.static_range(W):
            i = tl.zeros([BLOCK_C], tl.int32) + t + w  # position in e, per lane (keeps masks vectors)
            from_state = i < W - 1
            xs = tl.load(state + tl.minimum(i, W - 2), mask=c_ok & from_state & keep, other=0.0)
            xr = tl.load(x_ptr + (start + i - (W - 1)).to(tl.int64) * stride_xt + c, mask=c_ok & (i >= W - 1),
                         other=0.0)
            e = tl.where(from_state, xs.to(tl.float32), xr.to(tl.float32))
            wt = tl.load(w_ptr + c * W + w, mask=c_ok, other=0.0).to(tl.float32)
            acc += wt * e
        # the conv output is rounded to the model dtype, then SiLU (as F.conv1d + F.silu there)
        y = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = y / (1.0 + tl.exp(-y))
        tl.store(y_ptr + (start + t).to(tl.int64) * stride_yt + c, y.to(y_ptr.dtype.element_ty), mask=c_ok)
    if not CHUNKED:
        _write_conv_state(state, x_ptr, start, n, c, c_ok, keep, stride_xt, W)


@triton.jit(do_not_specialize=["num_channels"])
def _conv_state_kernel(
    x_ptr, state_ptr, qsl_ptr, slots_ptr, has_state_ptr, num_channels, stride_xt, stride_ss, stride_sc,
    W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < num_channels
    start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - start
    keep = (tl.zeros([BLOCK_C], tl.int32) + tl.load(has_state_ptr + seq)) != 0
    state = state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_ss + c * stride_sc
    _write_conv_state(state, x_ptr, start, n, c, c_ok, keep, stride_xt, W)


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor,
    slots: torch.Tensor, has_state: torch.Tensor, plan: ChunkPlan | None = None, block_c: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """x [T, C] raw inputs of the step's sequences; weight [C, W]; conv_state [slots, C, W - 1]
    (updated in place); query_start_loc [B + 1], slots [B], has_state [B] int32. Returns y [T, C].

    ``plan`` (``plan_chunks``, prefill steps): all tokens in parallel, one program
    per (chunk, channel block), then the states; without it each program walks its sequence's tokens
    (decodes). ``block_c`` (channels a program, a power of two; default min(128, C)) and ``num_warps``
    set the tile."""
    T, C = x.shape
    W = weight.shape[-1]
    assert W >= 2 and conv_state.shape[1:] == (C, W - 1) and x.stride(1) == 1
    y = torch.empty_like(x)
    B = slots.shape[0]
    if B == 0 or T == 0:
        return y
    block = block_c or min(128, triton.next_power_of_2(C))
    weight = weight.contiguous()
    grid = (plan.num_chunks if plan is not None else B, triton.cdiv(C, block))
    _conv1d_kernel[grid](
        x, weight, conv_state, y, query_start_loc, plan.chunks if plan is not None else slots, slots, has_state,
        C, x.stride(0), y.stride(0), conv_state.stride(0), conv_state.stride(1),
        W=W, BLOCK_C=block, CHUNKED=plan is not None, BT=plan.chunk_size if plan is not None else 1,
        num_warps=num_warps, **pdl.launch_options(x.device),
    )
    if plan is not None:
        _conv_state_kernel[(B, triton.cdiv(C, block))](
            x, conv_state, query_start_loc, slots, has_state, C, x.stride(0), conv_state.stride(0),
            conv_state.stride(1), W=W, BLOCK_C=block, num_warps=4,
        )
    return y


@triton.jit
def _delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, o_ptr, qsl_ptr, slots_ptr, has_state_ptr,
    scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
    GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // GROUP
    vcol = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kk = tl.arange(0, K_PAD)
    k_ok = kk < K
    v_ok = vcol < V
    start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - start
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    keep = (tl.zeros([K_PAD, BLOCK_V], tl.int32) + tl.load(has_state_ptr + seq)) != 0  # read the slot's state
    s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + vcol[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    S = tl.load(s_ptrs, mask=s_mask & keep, other=0.0)  # [K_PAD, BLOCK_V] fp32
    decay_rate = tl.exp(tl.load(A_log_ptr + hv).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    for t in range(0, n):
        row = (start + t).to(tl.int64)
        qv = tl.load(q_ptr + row * stride_qt + h * stride_qh + kk, mask=k_ok, other=0.0).to(tl.float32)
        kv = tl.load(k_ptr + row * stride_kt + h * stride_kh + kk, mask=k_ok, other=0.0).to(tl.float32)
        qv = qv * tl.rsqrt(tl.sum(qv * qv, axis=0) + 1e-6) * scale
        kv = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) + 1e-6)
        vv = tl.load(v_ptr + row * stride_vt + hv * stride_vh + vcol, mask=v_ok, other=0.0).to(tl.float32)
        g, beta = gdn_gates(tl.load(a_ptr + row * stride_at + hv), tl.load(b_ptr + row * stride_bt + hv),
                            decay_rate, dt_bias)
        S = S * tl.exp(g)
        u = (vv - tl.sum(S * kv[:, None], axis=0)) * beta  # beta (v - S^T k): [BLOCK_V]
        S = S + kv[:, None] * u[None, :]
        o = tl.sum(S * qv[:, None], axis=0)
        tl.store(o_ptr + row * stride_ot + hv * stride_oh + vcol, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.store(s_ptrs, S, mask=s_mask)


def delta_rule_tile(num_seqs: int, num_v_heads: int, v: int, sms: int) -> tuple[int, int]:
    """(block_v, num_warps) of the delta rule: 64 V columns and 4 warps a program while that still
    makes two programs an SM, else 32. H200, 27B shape (48 value heads of 128): 32 sequences 59 us
    (80% of copy bandwidth) against 68 with 32 columns, 64 sequences 112 against 133; 8 even; one
    sequence 5.4 against 4.8 (96 programs for 132 SMs)."""
    if v >= 64 and num_seqs * num_v_heads * triton.cdiv(v, 64) >= 2 * sms:
        return 64, 4
    return min(32, triton.next_power_of_2(v)), 4


def gated_delta_rule_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, ssm_state: torch.Tensor, query_start_loc: torch.Tensor, slots: torch.Tensor,
    has_state: torch.Tensor, scale: float | None = None, block_v: int | None = None, num_warps: int | None = None,
) -> torch.Tensor:
    """q, k [T, H, K]; v [T, HV, V]; a, b [T, HV] the raw ``in_proj_a`` / ``in_proj_b`` outputs (the
    gates are computed here, as ``gdn_reference.gdn_gates``); A_log, dt_bias [HV]; ssm_state [slots,
    HV, K, V] fp32 (updated in place); query_start_loc [B + 1], slots [B], has_state [B] int32. q and
    k are L2-normalised here (q scaled by ``scale``, default K^-0.5). Returns o [T, HV, V] in q's dtype.
    ``block_v`` (V columns a program, a power of two) and ``num_warps`` set the tile (default: ``delta_rule_tile``)."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    assert HV % H == 0 and ssm_state.shape[1:] == (HV, K, V) and ssm_state.dtype == torch.float32
    assert a.shape == b.shape == (T, HV) and a.stride(1) == b.stride(1) == 1 and A_log.shape == dt_bias.shape == (HV,)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and ssm_state.stride(-1) == 1
    o = torch.empty((T, HV, V), dtype=q.dtype, device=q.device)
    B = slots.shape[0]
    if B == 0 or T == 0:
        return o
    default_v, default_warps = delta_rule_tile(B, HV, V, num_sms(q.device))
    block_v, num_warps = block_v or default_v, num_warps or default_warps
    _delta_rule_kernel[(B, HV, triton.cdiv(V, block_v))](
        q, k, v, a, b, A_log, dt_bias, ssm_state, o, query_start_loc, slots, has_state,
        float(K**-0.5 if scale is None else scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), o.stride(0), o.stride(1),
        GROUP=HV // H, K=K, V=V, K_PAD=max(16, triton.next_power_of_2(K)), BLOCK_V=block_v, num_warps=num_warps,
        **pdl.launch_options(q.device),
    )
    return o
