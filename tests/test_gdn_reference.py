"""The plain-torch Gated DeltaNet ops (``kvserve.kernels.gdn_reference``): chunked vs recurrent
delta rule, both vs transformers' torch fallbacks and a float64 matrix-form loop, state carry
across split sequences (delta rule and causal conv), causal conv vs F.conv1d / transformers,
gated RMSNorm vs ``Qwen3NextRMSNormGated``, gates, and a whole GDN layer vs
``Qwen3NextGatedDeltaNet`` (prefill, and prefill + single-token decode with carried state)."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from kvserve.kernels import gdn_reference as gdn


def _torch_fn(fn):
    """transformers' pure-torch function under its hub/fla dispatch wrapper."""
    return getattr(fn, "__wrapped__", fn)


hf_chunk = _torch_fn(hf.torch_chunk_gated_delta_rule)
hf_recurrent = _torch_fn(hf.torch_recurrent_gated_delta_rule)
hf_conv_fn = _torch_fn(hf.causal_conv1d_fn)
hf_conv_update = _torch_fn(hf.causal_conv1d_update)

# (H, HV, K, V)
SHAPES = {"gva2-k32": (2, 4, 32, 32), "mha-k32": (2, 2, 32, 32), "gva2-k16v32": (2, 4, 16, 32)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _inputs(gen: torch.Generator, T: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype, with_state: bool):
    """Random q, k, v (dtype), realistic fp32 gates via gdn_gates, and an optional fp32 state."""
    q = torch.randn(T, H, K, generator=gen).to(dtype)
    k = torch.randn(T, H, K, generator=gen).to(dtype)
    v = torch.randn(T, HV, V, generator=gen).to(dtype)
    A_log = torch.empty(HV).uniform_(0.02, 1.0, generator=gen).log()
    dt_bias = torch.randn(HV, generator=gen) * 0.5
    a = torch.randn(T, HV, generator=gen).to(dtype)
    b = torch.randn(T, HV, generator=gen).to(dtype)
    g, beta = gdn.gdn_gates(A_log, a, dt_bias, b)
    state = torch.randn(HV, K, V, generator=gen) * 0.5 if with_state else None
    return q, k, v, g, beta, state


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol_rel: float) -> None:
    """assert_close with atol relative to the expected tensor's magnitude."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    atol = atol_rel * expected.float().abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# 1. chunked == recurrent


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("with_state", [False, True], ids=["s0", "state"])
@pytest.mark.parametrize("chunk_size", [64, 16])
@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 130])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_chunk_matches_recurrent(dtype, T, chunk_size, with_state, shape):
    H, HV, K, V = shape
    q, k, v, g, beta, s0 = _inputs(_gen("cvr", dtype, T, chunk_size, with_state, shape), T, *shape, dtype, with_state)
    o_r, s_r = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=chunk_size)
    assert o_r.shape == (T, HV, V) and s_r.shape == (HV, K, V) and s_r.dtype == torch.float32
    assert o_r.dtype == dtype
    # states are fp32 from the same (rounded) inputs either way: tight for both input dtypes
    _close(s_c, s_r, rtol=1e-5, atol_rel=1e-5)
    if dtype == torch.float32:
        _close(o_c, o_r, rtol=1e-5, atol_rel=1e-5)
    else:  # fp32 results rounded to bf16: at most an ulp apart
        _close(o_c, o_r, rtol=1e-2, atol_rel=1e-2)
    if s0 is not None:
        assert not torch.equal(s_r, s0)  # the initial state is not updated in place ...
        s0_again = _inputs(_gen("cvr", dtype, T, chunk_size, with_state, shape), T, *shape, dtype, True)[-1]
        assert torch.equal(s0, s0_again)  # ... by either form


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_recurrent_matches_float64_matrix_form(shape):
    """Independent check of the recurrence and of the GVA head mapping (value head hv -> key head hv // r):
    S_t = (I - b k k^T) exp(g) S_{t-1} + b k v^T, o_t = S_t^T (K^-0.5 * q_t / |q_t|), in float64."""
    H, HV, K, V = shape
    T = 20
    q, k, v, g, beta, s0 = _inputs(_gen("f64", shape), T, *shape, torch.float32, True)
    o, s = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    r = HV // H
    o_ref = torch.empty(T, HV, V, dtype=torch.float64)
    s_ref = s0.double().clone()
    eye = torch.eye(K, dtype=torch.float64)
    for hv in range(HV):
        S = s_ref[hv]
        for t in range(T):
            kt = k[t, hv // r].double()
            kt = kt / kt.norm()
            qt = q[t, hv // r].double()
            qt = qt / qt.norm() * K**-0.5
            bt = beta[t, hv].double()
            S = g[t, hv].double().exp() * S
            S = (eye - bt * torch.outer(kt, kt)) @ S + bt * torch.outer(kt, v[t, hv].double())
            o_ref[t, hv] = S.T @ qt
        s_ref[hv] = S
    _close(o.double(), o_ref, rtol=1e-5, atol_rel=1e-5)
    _close(s.double(), s_ref, rtol=1e-5, atol_rel=1e-5)


# ---------------------------------------------------------------------------------------------
# 2. vs transformers' torch fallbacks


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("with_state", [False, True], ids=["s0", "state"])
@pytest.mark.parametrize("T", [1, 5, 64, 100])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_transformers(dtype, T, with_state, shape):
    H, HV, K, V = shape
    q, k, v, g, beta, s0 = _inputs(_gen("hf", dtype, T, with_state, shape), T, *shape, dtype, with_state)
    r = HV // H
    # transformers' batched layout; q/k given already repeated to the value heads
    bq, bk = (x.repeat_interleave(r, dim=1).unsqueeze(0) for x in (q, k))
    bv, bg, bb = v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0)
    bs0 = None if s0 is None else s0.unsqueeze(0).clone()
    tol = dict(rtol=1e-6, atol_rel=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol_rel=1e-2)

    kw = dict(initial_state=bs0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_hf, s_hf = hf_recurrent(bq, bk, bv, bg, bb, **kw)
    o, s = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    _close(o, o_hf[0], **tol)
    _close(s, s_hf[0], rtol=1e-6, atol_rel=1e-6)

    for cs in (64, 16):
        o_hf, s_hf = hf_chunk(bq, bk, bv, bg, bb, chunk_size=cs, **kw)
        o, s = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=cs)
        _close(o, o_hf[0], **tol)
        _close(s, s_hf[0], rtol=1e-6, atol_rel=1e-6)


# ---------------------------------------------------------------------------------------------
# 3. state carry across split sequences


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
@pytest.mark.parametrize("split", [1, 37, 64, 99])
def test_delta_rule_state_carry(form, split):
    shape, T = SHAPES["gva2-k16v32"], 100
    q, k, v, g, beta, s0 = _inputs(_gen("carry", form, split), T, *shape, torch.float32, True)
    fn = gdn.recurrent_gated_delta_rule if form == "recurrent" else gdn.chunk_gated_delta_rule
    o_full, s_full = fn(q, k, v, g, beta, initial_state=s0)
    a, b = slice(0, split), slice(split, T)
    o1, s1 = fn(q[a], k[a], v[a], g[a], beta[a], initial_state=s0)
    o2, s2 = fn(q[b], k[b], v[b], g[b], beta[b], initial_state=s1)
    _close(torch.cat([o1, o2]), o_full, rtol=1e-5, atol_rel=1e-5)
    _close(s2, s_full, rtol=1e-5, atol_rel=1e-5)


def test_chunked_prefill_then_recurrent_decode():
    """How an engine runs a sequence: chunked prefill, then one recurrent step per decoded token."""
    shape, T, P = SHAPES["gva2-k32"], 50, 41
    q, k, v, g, beta, _ = _inputs(_gen("decode"), T, *shape, torch.bfloat16, False)
    o_full, s_full = gdn.recurrent_gated_delta_rule(q, k, v, g, beta)
    outs = []
    o, s = gdn.chunk_gated_delta_rule(q[:P], k[:P], v[:P], g[:P], beta[:P], chunk_size=16)
    outs.append(o)
    for t in range(P, T):
        one = slice(t, t + 1)
        o, s = gdn.recurrent_gated_delta_rule(q[one], k[one], v[one], g[one], beta[one], initial_state=s)
        outs.append(o)
    _close(torch.cat(outs), o_full, rtol=1e-2, atol_rel=1e-2)
    _close(s, s_full, rtol=1e-5, atol_rel=1e-5)


CONV_SPLITS = [(7,), (1, 6), (2, 5), (5, 2), (1, 1, 5), (3, 4), (6, 1), (1,) * 7, (2, 1, 1, 3)]


@pytest.mark.parametrize("with_state", [False, True], ids=["s0", "state"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("W", [4, 2])
def test_conv_state_carry(W, dtype, with_state):
    C, T = 24, 7
    gen = _gen("conv-carry", W, dtype, with_state)
    x = torch.randn(T, C, generator=gen).to(dtype)
    w = torch.randn(C, W, generator=gen).to(dtype)
    s0 = torch.randn(C, W - 1, generator=gen).to(dtype) if with_state else None
    y_full, s_full = gdn.causal_conv1d(x, w, s0)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    hist = torch.cat([torch.zeros(C, W - 1, dtype=dtype) if s0 is None else s0, x.t()], dim=1)
    assert torch.equal(s_full, hist[:, -(W - 1) :])
    for split in CONV_SPLITS:
        ys, s, start = [], s0, 0
        for n in split:
            y, s_new = gdn.causal_conv1d(x[start : start + n], w, s)
            prev = torch.zeros(C, W - 1, dtype=dtype) if s is None else s
            # the state is the last W-1 raw inputs of (old state ++ piece), also for pieces shorter than W-1
            assert torch.equal(s_new, torch.cat([prev, x[start : start + n].t()], dim=1)[:, -(W - 1) :])
            ys.append(y)
            s, start = s_new, start + n
        torch.testing.assert_close(torch.cat(ys), y_full, **tol)  # F.conv1d's sum order may vary with T
        assert torch.equal(s, s_full)


# ---------------------------------------------------------------------------------------------
# 4. causal conv vs F.conv1d and transformers


@pytest.mark.parametrize("T", [1, 2, 3, 10])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("W", [4, 2])
def test_conv_prefill_matches_conv1d(W, dtype, T):
    C = 40
    gen = _gen("conv", W, dtype, T)
    x = torch.randn(T, C, generator=gen).to(dtype)
    w = torch.randn(C, W, generator=gen).to(dtype)
    y, s = gdn.causal_conv1d(x, w, None)
    assert y.shape == (T, C) and y.dtype == dtype and s.shape == (C, W - 1)
    ref = F.silu(F.conv1d(x.t()[None], w[:, None, :], padding=W - 1, groups=C)[0, :, :T]).t()
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, ref, **tol)
    torch.testing.assert_close(y, hf_conv_fn(x.t()[None], w, activation="silu")[0].t(), **tol)
    # by hand: y_t = silu(sum_j w[:, j] * x_{t - (W-1) + j})
    xp = torch.cat([torch.zeros(W - 1, C), x.float()])
    by_hand = F.silu(torch.stack([(xp[t : t + W].t() * w.float()).sum(1) for t in range(T)]))
    torch.testing.assert_close(y.float(), by_hand, **tol)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_conv_continuation_matches_transformers(dtype, T):
    """T == 1: transformers' causal_conv1d_update; T > 1: its cached multi-token path (prepend the
    state, causal_conv1d_fn, keep the last T outputs)."""
    C, W = 40, 4
    gen = _gen("conv-hf", dtype, T)
    x = torch.randn(T, C, generator=gen).to(dtype)
    w = torch.randn(C, W, generator=gen).to(dtype)
    s0 = torch.randn(C, W - 1, generator=gen).to(dtype)
    s0_copy = s0.clone()
    y, s = gdn.causal_conv1d(x, w, s0)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    if T == 1:
        hf_state = s0[None].clone()
        y_hf = hf_conv_update(x.t()[None], hf_state, w, activation="silu")[0].t()
        assert torch.equal(s, hf_state[0])
    else:
        y_hf = hf_conv_fn(torch.cat([s0, x.t()], dim=1)[None], w, activation="silu")[0, :, -T:].t()
    torch.testing.assert_close(y, y_hf, **tol)
    assert torch.equal(s0, s0_copy)  # the given state is not modified in place


# ---------------------------------------------------------------------------------------------
# 5. gated RMSNorm, 6. gates


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gated_rms_norm_matches_transformers(dtype):
    T, HV, V = 9, 4, 32
    gen = _gen("norm", dtype)
    x = torch.randn(T, HV, V, generator=gen).to(dtype) * 3
    z = torch.randn(T, HV, V, generator=gen).to(dtype)
    weight = (torch.randn(V, generator=gen) * 0.5 + 1).to(dtype)
    mod = hf.Qwen3NextRMSNormGated(V, eps=1e-6).to(dtype)
    with torch.no_grad():
        mod.weight.copy_(weight)
        ref = mod(x.reshape(-1, V), z.reshape(-1, V)).reshape(T, HV, V)
    out = gdn.gated_rms_norm(x, z, weight, eps=1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # and the math itself, in float64
    xd = x.double()
    by_hand = weight.double() * xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * F.silu(z.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), by_hand, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gates(dtype):
    T, HV = 11, 6
    gen = _gen("gates", dtype)
    A_log = torch.randn(HV, generator=gen) * 1.5
    A_log[-1] = 11.5  # exp(11.5) overflows fp16: must be computed in fp32
    dt_bias = torch.randn(HV, generator=gen)
    a = torch.randn(T, HV, generator=gen) * 4
    a[0, 0], a[1, 1] = 30.0, -30.0  # softplus's linear and vanishing ends
    b = torch.randn(T, HV, generator=gen) * 3
    A_log, dt_bias, a, b = (x.to(dtype) for x in (A_log, dt_bias, a, b))
    g, beta = gdn.gdn_gates(A_log, a, dt_bias, b)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (T, HV)
    assert torch.isfinite(g).all() and (g <= 0).all() and (g < 0).any()
    g_ref = -A_log.double().exp() * torch.log1p((a.double() + dt_bias.double()).exp())
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-5, atol=1e-6)
    # beta: sigmoid in b's dtype (as transformers' ``b.sigmoid()`` on a model-dtype projection), then fp32
    assert torch.equal(beta, b.sigmoid().float())
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(beta.double(), torch.sigmoid(b.double()), rtol=0, atol=tol)
    assert ((beta > 0) & (beta <= 1)).all()


# ---------------------------------------------------------------------------------------------
# a whole GDN layer vs transformers' module


def _hf_layer(dtype: torch.dtype) -> hf.Qwen3NextGatedDeltaNet:
    cfg = Qwen3NextConfig(
        hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = hf.Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():  # nothing left at its init (e.g. the norm weight at ones)
            p.copy_(torch.randn(p.shape, generator=_gen("layer", p.shape)) * (0.2 if p.dim() > 1 else 0.5))
        layer.A_log.copy_(torch.empty(4).uniform_(0.05, 2.0, generator=_gen("A")).log())
    return layer.to(dtype).eval()


def _our_layer(layer: hf.Qwen3NextGatedDeltaNet, h: torch.Tensor, conv_state, rec_state, decode: bool):
    """One sequence ``h: [T, hidden]`` through the GDN layer built from gdn_reference ops."""
    T = h.shape[0]
    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    qkvz, ba = layer.in_proj_qkvz(h[None]), layer.in_proj_ba(h[None])
    q, k, v, z, b, a = (x[0] for x in layer.fix_query_key_value_ordering(qkvz, ba))
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
    mixed, conv_state = gdn.causal_conv1d(mixed, layer.conv1d.weight.squeeze(1), conv_state)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    g, beta = gdn.gdn_gates(layer.A_log, a, layer.dt_bias, b)
    rule = gdn.recurrent_gated_delta_rule if decode else gdn.chunk_gated_delta_rule
    o, rec_state = rule(q.reshape(T, H, K), k.reshape(T, H, K), v.reshape(T, HV, V), g, beta, initial_state=rec_state)
    o = gdn.gated_rms_norm(o, z, layer.norm.weight, eps=layer.norm.variance_epsilon)
    return layer.out_proj(o.reshape(T, -1)), conv_state, rec_state


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gdn_layer_matches_transformers(dtype):
    layer, T, P = _hf_layer(dtype), 21, 17
    h = torch.randn(T, 64, generator=_gen("h", dtype)).to(dtype)
    with torch.no_grad():
        ref = layer(h[None])[0]
        out, _, _ = _our_layer(layer, h, None, None, decode=False)
        # prefill P tokens, then decode one token at a time with the carried conv + recurrent state
        outs = []
        y, cs, rs = _our_layer(layer, h[:P], None, None, decode=False)
        outs.append(y)
        for t in range(P, T):
            y, cs, rs = _our_layer(layer, h[t : t + 1], cs, rs, decode=True)
            outs.append(y)
    tol = dict(rtol=1e-5, atol_rel=1e-5) if dtype == torch.float32 else dict(rtol=0, atol_rel=0)
    _close(out, ref, **tol)
    tol = dict(rtol=1e-5, atol_rel=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol_rel=3e-2)
    _close(torch.cat(outs), ref, **tol)


def test_inputs_are_not_degenerate():
    """Guards the tests above: random gates decay noticeably but not to nothing, and the state matters."""
    shape, T = SHAPES["gva2-k32"], 64
    q, k, v, g, beta, s0 = _inputs(_gen("nondegenerate"), T, *shape, torch.float32, True)
    assert -3.0 < g.mean().item() < -0.05 and (g.exp() > 0.5).any()
    o_with, _ = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    o_without, _ = gdn.recurrent_gated_delta_rule(q, k, v, g, beta)
    assert (o_with[:8] - o_without[:8]).abs().max() > 1e-2
