"""Triton kernels for the small per-layer ops of a decode step: (residual add +) RMSNorm, the gated
RMSNorm of the GDN output, rotary embedding (alone, or after the per-head q / k norms), SiLU-and-mul,
the gated attention's sigmoid output gate and the FP8 layers' static activation quantisation, each
one launch instead of 3-10 torch kernels.

Each reproduces its torch twin in ``layers/`` rounding for rounding (the model-dtype add, fp32
statistics, a rounding to the model dtype before the weight multiply (none for the zero-centred
``(1 + w)`` norm), the rotary products rounded one by one), so outputs match to the last bit except
where the fp32 sum of squares is reduced in a different order. Used for bf16/fp16 models on CUDA
with the triton backend (``layers/`` decides); float32 models keep the torch ops, whose exactness
runs were measured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels import pdl


@triton.jit
def _weighted(y, w, ZERO_CENTERED: tl.constexpr, dt: tl.constexpr):
    """A normalized row y (fp32) times its weight w, rounded as the torch norms round: ``(1 + w)``
    in fp32 before the one cast (zero-centred), else y cast to dt first (RMSNorm)."""
    if ZERO_CENTERED:
        return (y * (1.0 + w.to(tl.float32))).to(dt)
    return (w.to(tl.float32) * y.to(dt).to(tl.float32)).to(dt)


@triton.jit
def _rotate_half(x1, x2, c, s, dt: tl.constexpr):
    """The neox rotation of halves x1, x2 (fp32) by cos c and sin s as torch rounds it: ``rot * cos +
    cat(-x2, x1) * sin``, each product and the sum rounded to dt."""
    o1 = ((x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _fp8_static(v, inv):
    """``quantize_fp8_static`` of v (fp32 holding a model-dtype value): e4m3(clamp(v * inv, +-448)),
    round to nearest even, NaN kept (torch's clamp), as uint8 bits."""
    v = v * inv
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -448.0), 448.0))
    return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    heads, stride_xt, stride_xh, stride_rt, stride_ot, stride_oh, stride_rot,
    n, eps,
    HAS_RES: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One row: x[t, h, :n] (h < heads; heads = 1 for plain [T, n] rows); ZERO_CENTERED: ``(1 + w)``
    multiplied in fp32 before the one cast (``ZeroCenteredRMSNorm``)."""
    pdl.start(PDL)
    pid = tl.program_id(0).to(tl.int64)
    t = pid // heads
    h = pid % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + t * stride_rt + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the model-dtype add
        tl.store(res_out_ptr + t * stride_rot + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n
    y = xf * (1.0 / tl.sqrt(var + eps))
    out = _weighted(y, tl.load(w_ptr + cols, mask=mask, other=0.0), ZERO_CENTERED, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` (``ZeroCenteredRMSNorm.forward`` with ``zero_centered``): x [T, n] or
    [T, H, n] (last dim contiguous); with ``residual`` [T, n], returns (norm(x + residual), x + residual)."""
    assert x.stride(-1) == 1 and weight.is_contiguous()
    n = x.shape[-1]
    if x.dim() == 3:
        assert residual is None
        t, heads = x.shape[0], x.shape[1]
        sxt, sxh = x.stride(0), x.stride(1)
    else:
        t, heads = x.shape[0], 1
        sxt, sxh = x.stride(0), 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    sot, soh = (out.stride(0), out.stride(1)) if x.dim() == 3 else (out.stride(0), 0)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    if t * heads:
        block = triton.next_power_of_2(n)
        _rmsnorm_kernel[(t * heads,)](
            x, res, weight, out, res_out,
            heads, sxt, sxh, res.stride(0), sot, soh, res_out.stride(0),
            n, float(eps),
            HAS_RES=residual is not None, ZERO_CENTERED=zero_centered, BLOCK=block,
            num_warps=max(1, min(8, block // 256)), **pdl.launch_options(x.device),
        )
    return (out, res_out) if residual is not None else out


def _output_buffer(shape: tuple[int, ...], x: torch.Tensor, inv_scale: torch.Tensor | None) -> torch.Tensor:
    """The output of a kernel that may write an FP8 layer's quantized input: x's dtype, or uint8 codes
    (viewed as float8_e4m3fn on return) when ``inv_scale`` (one fp32 value) is given."""
    assert inv_scale is None or (inv_scale.numel() == 1 and inv_scale.dtype == torch.float32), (
        "inv_scale: one fp32 value")
    return torch.empty(shape, dtype=x.dtype if inv_scale is None else torch.uint8, device=x.device)


@triton.jit
def _gated_rmsnorm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, inv_ptr, num_rows, rows_per_t, stride_xt, stride_zt,
                          stride_ot, n, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr,
                          PDL: tl.constexpr):
    """ROWS rows (value heads) of ``w * norm(x) * silu(z)``: x[t, h, :n], z[t, h, :n] (heads contiguous);
    FP8: written quantized by the static scale at ``inv_ptr`` (the model-dtype value, then ``_fp8_static``)."""
    pdl.start(PDL)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t, h = r // rows_per_t, r % rows_per_t
    ok = r < num_rows
    cols = tl.arange(0, BLOCK)
    m = ok[:, None] & (cols < n)[None, :]
    x = tl.load(x_ptr + (t * stride_xt + h * n)[:, None] + cols[None, :], mask=m, other=0.0)
    xf = x.to(tl.float32)
    y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=1) / n + eps)[:, None]).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0)
    p = (w[None, :].to(tl.float32) * y.to(tl.float32)).to(x.dtype)  # the model-dtype product, as torch
    z = tl.load(z_ptr + (t * stride_zt + h * n)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    out = (p.to(tl.float32) * (z / (1.0 + tl.exp(-z)))).to(x.dtype)
    if FP8:
        out = _fp8_static(out.to(tl.float32), tl.load(inv_ptr))
    tl.store(out_ptr + (t * stride_ot + h * n)[:, None] + cols[None, :], out, mask=m)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   inv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``gdn_reference.gated_rms_norm``: x, z [T, H, n] with contiguous heads (row strides free). With
    ``inv_scale`` (1-element fp32, an FP8 layer's inverse input scale) the float8_e4m3fn codes that
    ``fp8_static_quant`` makes of that output, written by the same launch."""
    T, H, n = x.shape
    assert z.shape == x.shape and x.stride(1) == z.stride(1) == n and x.stride(2) == z.stride(2) == 1
    fp8 = inv_scale is not None
    out = _output_buffer((T, H, n), x, inv_scale)
    if T * H:
        rows = 4
        _gated_rmsnorm_kernel[(triton.cdiv(T * H, rows),)](
            x, z, weight.contiguous(), out, inv_scale if fp8 else weight, T * H, H, x.stride(0), z.stride(0),
            out.stride(0), n, float(eps), BLOCK=triton.next_power_of_2(n), ROWS=rows, FP8=fp8, num_warps=4,
            **pdl.launch_options(x.device),
        )
    return out.view(torch.float8_e4m3fn) if fp8 else out


@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr,
    heads, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, REST: tl.constexpr, REST_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """Token t, all heads: neox (rotate-half) rotation of the first 2 * HALF dims; the rest copied."""
    pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    hs = tl.arange(0, 16)
    i = tl.arange(0, HALF_PAD)
    im = i < HALF
    dt = x_ptr.dtype.element_ty
    # cos/sin rows are [cos(f) | cos(f)] of width 2 * HALF: the first half serves both halves
    c = tl.load(cos_ptr + pos * stride_c + i, mask=im, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_c + i, mask=im, other=0.0).to(dt).to(tl.float32)
    for h0 in range(0, heads, 16):
        h = h0 + hs
        m = (h[:, None] < heads) & im[None, :]
        base = x_ptr + t * stride_xt + h[:, None] * stride_xh
        x1 = tl.load(base + i[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i[None, :], mask=m, other=0.0).to(tl.float32)
        o1, o2 = _rotate_half(x1, x2, c[None, :], s[None, :], dt)
        obase = out_ptr + t * stride_ot + h[:, None] * stride_oh
        tl.store(obase + i[None, :], o1, mask=m)
        tl.store(obase + HALF + i[None, :], o2, mask=m)
        if REST > 0:
            j = tl.arange(0, REST_PAD)
            mr = (h[:, None] < heads) & (j[None, :] < REST)
            tail = tl.load(base + 2 * HALF + j[None, :], mask=mr, other=0.0)
            tl.store(obase + 2 * HALF + j[None, :], tail, mask=mr)


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """``RotaryEmbedding._rotate`` for x [T, H, D] (last dim contiguous) at ``positions`` [T],
    with fp32 cos/sin caches [max_position, rot_dim]; returns a new [T, H, D] tensor."""
    assert x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    t, heads, d = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if t:
        half, rest = rot_dim // 2, d - rot_dim
        _rotary_kernel[(t,)](
            x, out, positions, cos, sin,
            heads, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), REST=rest,
            REST_PAD=triton.next_power_of_2(max(rest, 1)), num_warps=4, **pdl.launch_options(x.device),
        )
    return out


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    q_heads, heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_c, n, eps,
    ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    REST: tl.constexpr, REST_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """One head of one token (q heads first, then k heads): ``_rmsnorm_kernel``'s statistics from the
    whole row, the same normalized values (the row read again by parts), then ``_rotary_kernel``'s
    rotation of the first 2 * HALF dims and the rest copied: the two kernels' roundings in turn (their
    bits in the interpreter; compiled, ptxas may fuse a product into its add differently)."""
    pdl.start(PDL)
    pid = tl.program_id(0).to(tl.int64)
    t = pid // heads
    h = pid % heads
    is_q = h < q_heads
    if is_q:
        src = q_ptr + t * stride_qt + h * stride_qh
        w_ptr = qw_ptr
        dst = q_out_ptr + (t * q_heads + h) * n
    else:
        src = k_ptr + t * stride_kt + (h - q_heads) * stride_kh
        w_ptr = kw_ptr
        dst = k_out_ptr + (t * (heads - q_heads) + h - q_heads) * n
    dt = q_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    xf = tl.load(src + cols, mask=cols < n, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    i = tl.arange(0, HALF_PAD)
    im = i < HALF
    x1 = _normed(src, w_ptr, i, im, rstd, ZERO_CENTERED, dt)
    x2 = _normed(src, w_ptr, HALF + i, im, rstd, ZERO_CENTERED, dt)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_c + i, mask=im, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_c + i, mask=im, other=0.0).to(dt).to(tl.float32)
    o1, o2 = _rotate_half(x1, x2, c, s, dt)
    tl.store(dst + i, o1, mask=im)
    tl.store(dst + HALF + i, o2, mask=im)
    if REST > 0:
        j = tl.arange(0, REST_PAD)
        jm = j < REST
        tl.store(dst + 2 * HALF + j, _normed(src, w_ptr, 2 * HALF + j, jm, rstd, ZERO_CENTERED, dt).to(dt), mask=jm)


@triton.jit
def _normed(src, w_ptr, cols, mask, rstd, ZERO_CENTERED: tl.constexpr, dt: tl.constexpr):
    """``_rmsnorm_kernel``'s output at ``cols`` of a row (rounded to dt), as fp32."""
    y = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32) * rstd
    return _weighted(y, tl.load(w_ptr + cols, mask=mask, other=0.0), ZERO_CENTERED, dt).to(tl.float32)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head q / k norms then the rotary embedding (Qwen3, Qwen3.5 / 3.6 attention) in one launch:
    ``rms_norm`` on q and k then ``rotary`` on both, rounded as they round (in the interpreter the same
    bits; on the H200 a rounding apart in some elements). q [T, Hq, D], k [T, Hk, D] (last dim
    contiguous, any row / head strides); returns new contiguous [T, Hq, D] and [T, Hk, D]."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    assert q_weight.is_contiguous() and k_weight.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    t, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t:
        half, rest = rot_dim // 2, d - rot_dim
        block = triton.next_power_of_2(d)
        _qk_norm_rope_kernel[(t * (hq + hk),)](
            q, k, q_weight, k_weight, q_out, k_out, positions, cos, sin,
            hq, hq + hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), d, float(eps),
            ZERO_CENTERED=zero_centered, BLOCK=block, HALF=half, HALF_PAD=triton.next_power_of_2(half), REST=rest,
            REST_PAD=triton.next_power_of_2(max(rest, 1)), num_warps=max(1, min(8, block // 256)),
            **pdl.launch_options(q.device),
        )
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t] = silu(gate) * up for x[t] = [gate | up]; each op rounded to the model dtype, as torch."""
    pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    dt = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + t * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + n + cols, mask=m, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (a * u).to(dt), mask=m)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for x [T, 2n] = [gate | up] -> [T, n]."""
    assert x.stride(-1) == 1
    t, n2 = x.shape
    n = n2 // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block, num_warps=4,
                                                     **pdl.launch_options(x.device))
    return out


@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, out_ptr, inv_ptr, n, head, stride_xt, stride_gt, stride_gh, stride_ot,
                         BLOCK: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    """out[t] = x[t] * sigmoid(gate[t]) over token t's n = heads x head features, gate[t, h, d] read
    through its strides; the sigmoid and the product each rounded to the model dtype, as torch;
    FP8: the product written quantized by the static scale at ``inv_ptr`` (``_fp8_static``)."""
    pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    h = cols // head
    dt = x_ptr.dtype.element_ty
    g = tl.load(g_ptr + t * stride_gt + h * stride_gh + (cols - h * head), mask=m, other=0.0).to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    x = tl.load(x_ptr + t * stride_xt + cols, mask=m, other=0.0).to(tl.float32)
    out = (x * sig).to(dt)
    if FP8:
        out = _fp8_static(out.to(tl.float32), tl.load(inv_ptr))
    tl.store(out_ptr + t * stride_ot + cols, out, mask=m)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, inv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x * torch.sigmoid(gate.reshape(x.shape))`` for x [T, H * D] (rows contiguous) and the gate
    [T, H, D] as a strided view (last dim contiguous), e.g. the query's gate half of a gated attention
    projection: one launch instead of a copy, the sigmoid and the product. With ``inv_scale`` (as
    ``gated_rms_norm``'s) the float8_e4m3fn codes ``fp8_static_quant`` makes of it, same launch."""
    t, n = x.shape
    heads, head = gate.shape[1:]
    assert gate.shape[0] == t and heads * head == n and x.stride(1) == 1 and gate.stride(2) == 1
    fp8 = inv_scale is not None
    out = _output_buffer((t, n), x, inv_scale)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _sigmoid_gate_kernel[(t, triton.cdiv(n, block))](
            x, gate, out, inv_scale if fp8 else x, n, head, x.stride(0), gate.stride(0), gate.stride(1),
            out.stride(0), BLOCK=block, FP8=fp8, num_warps=4, **pdl.launch_options(x.device),
        )
    return out.view(torch.float8_e4m3fn) if fp8 else out


@triton.jit
def _fp8_static_quant_kernel(x_ptr, inv_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = e4m3(clamp(float32(x) * inv_scale, +-448)), NaN kept (torch's clamp)."""
    pdl.start(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, _fp8_static(tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32), tl.load(inv_ptr)),
             mask=m)


def fp8_static_quant(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """``quant/nvfp4.quantize_fp8_static`` in one launch: x (contiguous) -> float8_e4m3fn of its shape,
    ``inv_scale`` a 1-element fp32 tensor on x's device."""
    assert x.is_contiguous() and inv_scale.numel() == 1
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    n = x.numel()
    if n:
        block = 1024
        _fp8_static_quant_kernel[(triton.cdiv(n, block),)](x, inv_scale, out, n, BLOCK=block, num_warps=4,
                                                           **pdl.launch_options(x.device))
    return out.view(torch.float8_e4m3fn)
