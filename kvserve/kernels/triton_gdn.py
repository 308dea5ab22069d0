"""Triton kernels for the Gated DeltaNet layers of hybrid models, over a whole step's sequences.

Both kernels take the step's sequences packed along the token axis (``query_start_loc``), read each
sequence's state from its slot of the layer's state pool (``slots``; zeros where ``has_state`` is 0,
a sequence's first chunk) and write the state back in place. They are the batched twins of
``gdn_reference.causal_conv1d`` and ``gdn_reference.recurrent_gated_delta_rule`` (same math, same
casts; fp32 state and accumulation), and walk each sequence's tokens in order inside one program:
the decode path (one token per sequence) in one launch per layer. ``chunk_gated_delta_rule_varlen``
is the chunked (WY) form for long prefill chunks: per chunk of BT tokens the in-chunk triangular
system is solved by forward substitution in registers and the rest are fp32 matrix products.

- ``causal_conv1d_varlen``: program (sequence, block of channels); SiLU(depthwise conv) over
  ``state ++ x``, then the last W - 1 raw inputs become the new state.
- ``gated_delta_rule_varlen``: program (sequence, value head, block of V columns); q and k are
  L2-normalised in fp32 in the kernel (q scaled), value head ``hv`` reads key head ``hv // (HV/H)``;
  the [K, BLOCK_V] state block stays in registers across the sequence's tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_channels"])
def _conv1d_kernel(
    x_ptr, w_ptr, state_ptr, y_ptr, qsl_ptr, slots_ptr, has_state_ptr,
    num_channels, stride_xt, stride_yt, stride_ss, stride_sc,
    W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < num_channels
    start = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - start
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    keep = (tl.zeros([BLOCK_C], tl.int32) + tl.load(has_state_ptr + seq)) != 0  # read the slot's state
    state = state_ptr + slot * stride_ss + c * stride_sc  # [BLOCK_C] pointers to column 0
    # e = state (W - 1 columns) ++ x (n rows); y_t = SiLU(sum_w w[c, w] * e[t + w])
    for t in range(0, n):
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
    # new state: column j <- e[n + j], j = 0 .. W - 2, in increasing j: column n + j (n >= 1) is
    # read before it is rewritten, and each thread reads and writes only its own channels
    for j in tl.static_range(W - 1):
        i = tl.zeros([BLOCK_C], tl.int32) + n + j
        from_state = i < W - 1
        xs = tl.load(state + tl.minimum(i, W - 2), mask=c_ok & from_state & keep, other=0.0)
        xr = tl.load(x_ptr + (start + i - (W - 1)).to(tl.int64) * stride_xt + c, mask=c_ok & (i >= W - 1),
                     other=0.0)
        tl.store(state + j, tl.where(from_state, xs.to(tl.float32), xr.to(tl.float32)).to(state_ptr.dtype.element_ty),
                 mask=c_ok)


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor,
    slots: torch.Tensor, has_state: torch.Tensor,
) -> torch.Tensor:
    """x [T, C] raw inputs of the step's sequences; weight [C, W]; conv_state [slots, C, W - 1]
    (updated in place); query_start_loc [B + 1], slots [B], has_state [B] int32. Returns y [T, C]."""
    T, C = x.shape
    W = weight.shape[-1]
    assert W >= 2 and conv_state.shape[1:] == (C, W - 1) and x.stride(1) == 1
    y = torch.empty_like(x)
    B = slots.shape[0]
    if B == 0 or T == 0:
        return y
    block = min(128, triton.next_power_of_2(C))
    _conv1d_kernel[(B, triton.cdiv(C, block))](
        x, weight.contiguous(), conv_state, y, query_start_loc, slots, has_state,
        C, x.stride(0), y.stride(0), conv_state.stride(0), conv_state.stride(1),
        W=W, BLOCK_C=block, num_warps=4,
    )
    return y


@triton.jit
def _delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, qsl_ptr, slots_ptr, has_state_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
    GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
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
    for t in range(0, n):
        row = (start + t).to(tl.int64)
        qv = tl.load(q_ptr + row * stride_qt + h * stride_qh + kk, mask=k_ok, other=0.0).to(tl.float32)
        kv = tl.load(k_ptr + row * stride_kt + h * stride_kh + kk, mask=k_ok, other=0.0).to(tl.float32)
        qv = qv * tl.rsqrt(tl.sum(qv * qv, axis=0) + 1e-6) * scale
        kv = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) + 1e-6)
        vv = tl.load(v_ptr + row * stride_vt + hv * stride_vh + vcol, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_gt + hv).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_bt + hv).to(tl.float32)
        S = S * tl.exp(g)
        u = (vv - tl.sum(S * kv[:, None], axis=0)) * beta  # beta (v - S^T k): [BLOCK_V]
        S = S + kv[:, None] * u[None, :]
        o = tl.sum(S * qv[:, None], axis=0)
        tl.store(o_ptr + row * stride_ot + hv * stride_oh + vcol, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.store(s_ptrs, S, mask=s_mask)


def gated_delta_rule_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, scale: float | None = None,
) -> torch.Tensor:
    """q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV] (fp32); ssm_state [slots, HV, K, V] fp32
    (updated in place); query_start_loc [B + 1], slots [B], has_state [B] int32. q and k are
    L2-normalised here (q scaled by ``scale``, default K^-0.5). Returns o [T, HV, V] in q's dtype."""
    return _launch_delta_rule(_delta_rule_kernel, 32, q, k, v, g, beta, ssm_state, query_start_loc, slots, has_state,
                              scale, {})
@triton.jit
def _chunk_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, qsl_ptr, slots_ptr, has_state_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
    GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
    BT: tl.constexpr,
):
    """Chunked (WY) form: per chunk of BT tokens, T = (I + strict_lower(beta K K^T * decay))^-1 by
    forward substitution, then the chunk's outputs and the state update as matrix products."""
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // GROUP
    vcol = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kk = tl.arange(0, K_PAD)
    k_ok = kk < K
    v_ok = vcol < V
    r = tl.arange(0, BT)
    lower = r[:, None] >= r[None, :]
    strict = r[:, None] > r[None, :]
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    keep = (tl.zeros([K_PAD, BLOCK_V], tl.int32) + tl.load(has_state_ptr + seq)) != 0
    s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + vcol[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    S = tl.load(s_ptrs, mask=s_mask & keep, other=0.0)  # [K_PAD, BLOCK_V] fp32
    for c0 in range(start, end, BT):
        rows = c0 + r
        ok = rows < end
        rows64 = rows.to(tl.int64)
        qc = tl.load(q_ptr + rows64[:, None] * stride_qt + h * stride_qh + kk[None, :],
                     mask=ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        kc = tl.load(k_ptr + rows64[:, None] * stride_kt + h * stride_kh + kk[None, :],
                     mask=ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        qc = qc * tl.rsqrt(tl.sum(qc * qc, axis=1) + 1e-6)[:, None] * scale
        kc = kc * tl.rsqrt(tl.sum(kc * kc, axis=1) + 1e-6)[:, None]
        vc = tl.load(v_ptr + rows64[:, None] * stride_vt + hv * stride_vh + vcol[None, :],
                     mask=ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows64 * stride_gt + hv, mask=ok, other=0.0).to(tl.float32)  # padded rows: no decay
        beta = tl.load(beta_ptr + rows64 * stride_bt + hv, mask=ok, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, axis=0)
        g_last = tl.sum(tl.where(r == BT - 1, gc, 0.0), axis=0)
        decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT], 0 above the diagonal
        kkt = tl.dot(kc, tl.trans(kc), input_precision="ieee")
        A = tl.where(strict, -(beta[:, None] * kkt * decay), 0.0)
        for i in tl.static_range(1, BT):  # rows < i are final; row i += row i @ A
            row = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)
            upd = tl.sum(row[:, None] * A, axis=0)
            A = tl.where(r[:, None] == i, (row + upd)[None, :], A)
        Tm = tl.where(r[:, None] == r[None, :], 1.0, A)  # (I + N)^-1
        value = tl.dot(Tm, vc * beta[:, None], input_precision="ieee")
        kcd = tl.dot(Tm, kc * (beta * tl.exp(gc))[:, None], input_precision="ieee")
        v_new = value - tl.dot(kcd, S, input_precision="ieee")
        o = tl.dot(qc * tl.exp(gc)[:, None], S, input_precision="ieee")
        qk = tl.dot(qc, tl.trans(kc), input_precision="ieee") * decay
        o += tl.dot(qk, v_new, input_precision="ieee")
        tl.store(o_ptr + rows64[:, None] * stride_ot + hv * stride_oh + vcol[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=ok[:, None] & v_ok[None, :])
        kd = kc * tl.exp(g_last - gc)[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(kd), v_new, input_precision="ieee")
    tl.store(s_ptrs, S, mask=s_mask)


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, scale: float | None = None,
    chunk_size: int = 32,
) -> torch.Tensor:
    """The chunked twin of ``gated_delta_rule_varlen`` (same contract): for prefill chunks, where
    walking tokens one by one leaves the GPU waiting on each step's dependent loads."""
    assert chunk_size in (16, 32, 64) and v.shape[-1] >= 16
    return _launch_delta_rule(_chunk_delta_rule_kernel, 64, q, k, v, g, beta, ssm_state, query_start_loc, slots,
                              has_state, scale, {"BT": chunk_size})


def _launch_delta_rule(kernel, max_block_v: int, q, k, v, g, beta, ssm_state, query_start_loc, slots, has_state,
                       scale: float | None, extra: dict) -> torch.Tensor:
    """Checks and the launch shared by both delta-rule kernels: grid (sequences, value heads,
    blocks of V columns)."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    assert HV % H == 0 and ssm_state.shape[1:] == (HV, K, V) and ssm_state.dtype == torch.float32
    assert g.shape == beta.shape == (T, HV) and g.stride(1) == beta.stride(1) == 1
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and ssm_state.stride(-1) == 1
    o = torch.empty((T, HV, V), dtype=q.dtype, device=q.device)
    B = slots.shape[0]
    if B == 0 or T == 0:
        return o
    block_v = min(max_block_v, triton.next_power_of_2(V))
    kernel[(B, HV, triton.cdiv(V, block_v))](
        q, k, v, g, beta, ssm_state, o, query_start_loc, slots, has_state, float(K**-0.5 if scale is None else scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), o.stride(0), o.stride(1),
        GROUP=HV // H, K=K, V=V, K_PAD=max(16, triton.next_power_of_2(K)), BLOCK_V=block_v, num_warps=4, **extra,
    )
    return o
    block_v = min(64, triton.next_power_of_2(V))
    _chunk_delta_rule_kernel[(B, HV, triton.cdiv(V, block_v))](
        q, k, v, g, beta, ssm_state, o, query_start_loc, slots, has_state, float(K**-0.5 if scale is None else scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), o.stride(0), o.stride(1),
        GROUP=HV // H, K=K, V=V, K_PAD=max(16, triton.next_power_of_2(K)), BLOCK_V=block_v, BT=chunk_size, num_warps=4,
    )
    return o
