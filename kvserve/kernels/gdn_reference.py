"""Plain-torch Gated DeltaNet (GDN) ops of the Qwen3-Next / Qwen3.5 hybrid models.

This is the CPU path and the ground truth for future Triton kernels. It follows transformers'
torch fallbacks (``models/qwen3_next/modeling_qwen3_next.py``) op for op, dtype casts included.
Every function handles ONE sequence (no batch dim); callers loop over sequences.

Shapes: H key heads of dim K, HV value heads of dim V (HV % H == 0; value head ``hv`` reads key
head ``hv // (HV // H)``), conv channels C = 2*H*K + HV*V ordered [q | k | v].
State per sequence and GDN layer: conv state ``[C, W-1]`` (the last W-1 raw pre-conv inputs,
oldest first, model dtype) and recurrent state ``[HV, K, V]`` float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` along ``dim`` (eps inside the rsqrt, as transformers / fla)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def gdn_gates(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token gates from ``a, b: [T, HV]`` and per-head ``A_log, dt_bias: [HV]``.

    Returns float32 ``(g, beta)``, both ``[T, HV]``: the log-decay
    ``g = -exp(A_log) * softplus(a + dt_bias)`` (<= 0, computed in fp32) and ``beta = sigmoid(b)``.
    As in transformers, beta is computed in ``b``'s dtype (bf16 for a bf16 model) and only then
    widened to fp32 (transformers widens it inside the delta rule).
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.sigmoid().float()
    return g, beta


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(causal depthwise conv) over time, continuing from ``conv_state``.

    ``x: [T, C]`` raw inputs (T >= 1), ``weight: [C, W]``, ``conv_state: [C, W-1]`` (the previous
    W-1 raw inputs, oldest first) or None for zeros. Returns ``(y [T, C] in x.dtype,
    new_state [C, W-1] in x.dtype)``, the state being the last W-1 columns of ``state ++ x``.
    Like transformers, the conv and SiLU run in ``weight.dtype`` (F.conv1d, no extra fp32 step).
    """
    T, C = x.shape
    W = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(C, W - 1)
    full = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)  # [C, W-1+T]
    y = F.conv1d(full.to(weight.dtype).unsqueeze(0), weight.unsqueeze(1), groups=C)[0]  # [C, T]
    y = F.silu(y).to(x.dtype).t().contiguous()
    new_state = full[:, full.shape[1] - (W - 1) :].clone()
    return y, new_state


def _prepare_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """Repeat q/k to HV heads, go head-major fp32 ``[HV, T, *]``, l2-normalise and scale q."""
    H, HV = k.shape[1], v.shape[1]
    if HV != H:
        q = q.repeat_interleave(HV // H, dim=1)
        k = k.repeat_interleave(HV // H, dim=1)
    q, k, v, g, beta = (
        x.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)
    )
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    return q, k, v, g, beta


def _initial_state(initial_state: torch.Tensor | None, HV: int, K: int, V: int, ref: torch.Tensor) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(HV, K, V, dtype=torch.float32, device=ref.device)
    return initial_state.to(device=ref.device, dtype=torch.float32)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule in fp32 (transformers' ``torch_recurrent_gated_delta_rule``).

    ``q, k: [T, H, K]``, ``v: [T, HV, V]``, ``g, beta: [T, HV]``, ``initial_state: [HV, K, V]`` or None.
    Per value head: ``S = exp(g_t) S; u = beta_t (v_t - S^T k_t); S += k_t u^T; o_t = S^T q_t``.
    Returns ``(o [T, HV, V] in q.dtype, final_state [HV, K, V] float32)``; the input state is not modified.
    """
    out_dtype = q.dtype
    K, (HV, V) = k.shape[-1], v.shape[1:]
    q, k, v, g, beta = _prepare_qkv(q, k, v, g, beta, scale, use_qk_l2norm)
    S = _initial_state(initial_state, HV, K, V, v)
    o = torch.zeros_like(v)  # [HV, T, V]
    for t in range(v.shape[1]):
        S = S * g[:, t].exp()[:, None, None]
        kv = (S * k[:, t, :, None]).sum(dim=-2)  # S^T k: [HV, V]
        u = (v[:, t] - kv) * beta[:, t, None]
        S = S + k[:, t, :, None] * u[:, None, :]
        o[:, t] = (S * q[:, t, :, None]).sum(dim=-2)
    return o.transpose(0, 1).contiguous().to(out_dtype), S


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / unit-lower-triangular solve) form of :func:`recurrent_gated_delta_rule`.

    Same contract and result (up to rounding); mirrors transformers' ``torch_chunk_gated_delta_rule``.
    T is zero-padded to a multiple of ``chunk_size`` (padded tokens have k = 0, g = 0: no effect).
    """
    out_dtype = q.dtype
    T, K, (HV, V) = k.shape[0], k.shape[-1], v.shape[1:]
    C = chunk_size
    q, k, v, g, beta = _prepare_qkv(q, k, v, g, beta, scale, use_qk_l2norm)
    pad = (-T) % C
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // C
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(HV, n, C, -1) for x in (q, k, k_beta, v_beta))
    g_cum = g.reshape(HV, n, C).cumsum(dim=-1)  # log of the decay from chunk start to position i

    # decay[i, j] = exp(g_cum_i - g_cum_j) for j <= i, else 0
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # (I + strictly_lower(diag(beta) K K^T * decay)) is the WY system; its diagonal is taken as 1
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay  # causal in-chunk q.k (diagonal included)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = k_beta * g_cum.exp()[..., None]
    k_cumdecay = torch.linalg.solve_triangular(system, k_decayed, upper=False, unitriangular=True)

    q = q * g_cum.exp()[..., None]  # reads the state decayed up to position i
    k = k * (g_cum[..., -1:] - g_cum).exp()[..., None]  # writes decayed to chunk end
    chunk_decay = g_cum[..., -1].exp()[..., None, None]  # [HV, n, 1, 1]

    S = _initial_state(initial_state, HV, K, V, v)
    o = torch.zeros_like(new_values)  # [HV, n, C, V]
    for i in range(n):
        u = new_values[:, i] - k_cumdecay[:, i] @ S
        o[:, i] = q[:, i] @ S + intra[:, i] @ u
        S = S * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ u
    o = o.reshape(HV, n * C, V)[:, :T]
    return o.transpose(0, 1).contiguous().to(out_dtype), S


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``weight * RMSNorm(x) * silu(z)`` over the last dim (per value head), as ``Qwen3NextRMSNormGated``.

    Plain ``weight`` (not 1 + w). The norm runs in fp32 and is rounded to ``x.dtype`` before the weight;
    the gate ``silu(z)`` is fp32; the result is cast back to ``x.dtype``.
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype) * F.silu(z.float())).to(dtype)
