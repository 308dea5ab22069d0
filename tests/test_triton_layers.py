"""The fused Triton layer kernels (kernels/triton_layers.py) against their torch twins in layers/:
RMSNorm and the zero-centred RMSNorm (plain, with residual, per head over a strided q view), rotary
(full and partial), SiLU-and-mul, the sigmoid output gate and the FP8 static activation
quantisation (alone, and written by the gated norm and the output gate for an FP8 layer), bf16 and
fp16 (fp32 for the function), on fresh random inputs. CPU: interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.layers.norm import RMSNorm, ZeroCenteredRMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from triton_support import kernel_device, skip_without_triton_device

pytestmark = skip_without_triton_device()
DEV = kernel_device()
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's epsilon relative to |b| (1 = one rounding)."""
    eps = torch.finfo(a.dtype).eps
    return float(((a.float() - b.float()).abs() / (b.float().abs() * eps + 1e-30)).max().detach())


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert bool(torch.isfinite(got).all())
    if got.dtype == torch.float32:  # fp32: the statistics differ in the last bits only
        assert _ulps(got, want) <= 16
        return
    same = (got == want).float().mean().item()
    # the fp32 sum of squares / exp may round differently: a few one-ulp differences, never more
    assert same >= 0.97, f"only {same:.3f} of the elements are identical"
    assert _ulps(got, want) <= 2.01


# (norm class, its weights from a generator): RMSNorm's w around 1, the zero-centred (1 + w) offset around 0
NORMS = {"plain": (RMSNorm, lambda n, g: torch.rand(n, generator=g) * 2 + 0.1),
         "zero_centered": (ZeroCenteredRMSNorm, lambda n, g: 0.3 * torch.randn(n, generator=g))}


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 576, 1024])
def test_rms_norm_matches_torch(dtype, n, kind):
    """Rows with and without the residual add; the zero-centred norm multiplies ``(1 + w)`` in
    fp32 before its one cast (Qwen3-Next / Qwen3.5 layer norms)."""
    cls, weights = NORMS[kind]
    g = torch.Generator().manual_seed(n + (kind != "plain"))
    norm = cls(n, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(weights(n, g).to(dtype))
    x = (torch.randn(37, n, generator=g) * 3).to(DEV, dtype)
    res = (torch.randn(37, n, generator=g) * 5).to(DEV, dtype)
    with torch.no_grad():
        want, want_res = norm(x, res)
        plain = norm(x)
    norm.fused = True
    with torch.no_grad():
        got, got_res = norm(x, res)
        got_plain = norm(x)
    assert torch.equal(got_res, want_res)  # the residual add is one model-dtype rounding, as torch
    _close(got, want)
    _close(got_plain, plain)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_strided_view(dtype):
    """q/k norm (Qwen3): [T, H, D] heads viewed out of a fused qkv row."""
    g = torch.Generator().manual_seed(5)
    t, h, d = 11, 6, 128
    qkv = (torch.randn(t, (h + 4) * d, generator=g) * 2).to(DEV, dtype)
    q = qkv[:, : h * d].view(t, h, d)
    norm = RMSNorm(d, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d, generator=g).to(dtype) + 0.5)
    with torch.no_grad():
        want = norm(q)
        norm.fused = True
        got = norm(q)
    _close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centered_rms_norm_per_head_on_a_strided_view(dtype):
    """q/k norm (Qwen3-Next): q chunked out of per-head [query | gate], k viewed out of the qkv row."""
    g = torch.Generator().manual_seed(6)
    t, h, kv, d = 11, 4, 2, 64
    qkv = (torch.randn(t, (2 * h + 2 * kv) * d, generator=g) * 2).to(DEV, dtype)
    q = qkv[:, : 2 * h * d].view(t, h, 2 * d).chunk(2, dim=-1)[0]
    k = qkv[:, 2 * h * d : (2 * h + kv) * d].view(t, kv, d)
    norm = ZeroCenteredRMSNorm(d, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_((0.3 * torch.randn(d, generator=g)).to(dtype))
        want_q, want_k = norm(q), norm(k)
        norm.fused = True
        got_q, got_k = norm(q), norm(k)
    _close(got_q, want_q)
    _close(got_k, want_k)


def _rotary_bound_check(got: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, rope: RotaryEmbedding) -> None:
    """``got`` within one rounding of each product and of the sum of the float64 rotation: |err| <=
    eps x (|x1 c| + |x2 s|) per element (cos / sin rounded to the model dtype first, as both paths
    do); a relative-to-output bound would fail where the sum cancels and the GPU fuses a product
    into the add (FMA). The dims past the rotary slice are copied bit for bit."""
    r, half = rope.rot_dim, rope.rot_dim // 2
    cos = rope.cos_cache[pos].to(x.dtype).double().unsqueeze(1)
    sin = rope.sin_cache[pos].to(x.dtype).double().unsqueeze(1)
    rot = x[..., :r].double()
    p1, p2 = rot * cos, torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    err = (got[..., :r].double() - (p1 + p2)).abs()
    assert bool((err <= torch.finfo(x.dtype).eps * (p1.abs() + p2.abs()) + 1e-30).all()), float(err.max())
    assert torch.equal(got[..., r:], x[..., r:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,rot,heads", [(128, 128, 16), (64, 32, 3), (128, 64, 20)])
def test_rotary_matches_torch(dtype, d, rot, heads):
    g = torch.Generator().manual_seed(d + rot + heads)
    rope = RotaryEmbedding(d, 4096, {"rope_theta": 1e6, "rope_type": "default"}, rot_dim=rot).to(DEV)
    t = 13
    qkv = torch.randn(t, (heads + 2) * d, generator=g).to(DEV, dtype)
    q = qkv[:, : heads * d].view(t, heads, d)  # strided, as out of the qkv projection
    k = qkv[:, heads * d :].view(t, 2, d)
    pos = torch.randint(0, 4096, (t,), generator=g).to(DEV)
    wq, wk = rope(pos, q, k)
    rope.fused = True
    gq, gk = rope(pos, q, k)
    # products and the sum are rounded one by one as torch does: identical bits in the interpreter;
    # on the H200 the compiled kernel may round once where torch rounds twice (18% of bf16
    # elements one rounding apart, fp32 FMA), so there both lie within one rounding per operation
    if DEV == "cpu":
        assert torch.equal(gq, wq) and torch.equal(gk, wk)
    for got, want, x in ((gq, wq, q), (gk, wk, k)):
        assert got.shape == want.shape and got.dtype == want.dtype and bool(torch.isfinite(got).all())
        _rotary_bound_check(want, x, pos, rope)  # the bound holds for torch's own result
        _rotary_bound_check(got, x, pos, rope)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,rot,hq,hk,kind", [(128, 128, 6, 2, "plain"), (256, 64, 5, 2, "zero_centered"),
                                              (64, 32, 3, 1, "plain")])
def test_qk_norm_rope_is_the_norms_then_the_rotation(dtype, d, rot, hq, hk, kind):
    """One launch for q_norm, k_norm and the rotation (Qwen3; Qwen3.5 / 3.6: zero-centred norms, a
    partial rotation, q a strided view of [query | gate] heads, k of the qkv row): the bits of the
    per-head norm kernel then the rotary kernel in the interpreter (compiled: within a few roundings of
    them); and close to the torch modules (the same roundings, up to the order of the sum of squares
    and, compiled, a product fused into its add: within 2^-6)."""
    from kvserve.kernels.triton_layers import qk_norm_rope, rms_norm, rotary

    cls, weights = NORMS[kind]
    g = torch.Generator().manual_seed(d + rot + hq)
    t = 9
    q = (torch.randn(t, hq, 2 * d, generator=g) * 2).to(DEV, dtype)[..., :d]
    k = (torch.randn(t, 2 * hk * d + 8, generator=g) * 2).to(DEV, dtype)[:, : hk * d].view(t, hk, d)
    q_norm, k_norm = cls(d, 1e-6).to(DEV, dtype), cls(d, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        q_norm.weight.copy_(weights(d, g))
        k_norm.weight.copy_(weights(d, g))
    rope = RotaryEmbedding(d, 4096, {"rope_theta": 1e6, "rope_type": "default"}, rot_dim=rot).to(DEV)
    pos = torch.randint(0, 4096, (t,), generator=g).to(DEV)
    want_q, want_k = rope.norm_and_rotate(pos, q, k, q_norm, k_norm)  # the torch modules
    zc = kind == "zero_centered"
    chain = [rotary(rms_norm(x, w.weight, 1e-6, zero_centered=zc), pos, rope.cos_cache, rope.sin_cache, rot)
             for x, w in ((q, q_norm), (k, k_norm))]
    got_q, got_k = qk_norm_rope(q, k, q_norm.weight, k_norm.weight, 1e-6, pos, rope.cos_cache, rope.sin_cache, rot,
                                zero_centered=zc)
    assert got_q.shape == (t, hq, d) and got_k.shape == (t, hk, d) and got_q.is_contiguous()
    if DEV == "cpu":  # the interpreter rounds every operation as written: the chain's bits
        assert torch.equal(got_q, chain[0]) and torch.equal(got_k, chain[1])
    else:  # compiled, ptxas may fuse a product into its add in one kernel and not the other (the rotary
        # test's finding): a rounding or two apart, at the scale of the head's largest value
        eps = torch.finfo(dtype).eps
        for got, want in zip((got_q, got_k), chain):
            assert float((got.float() - want.float()).abs().max()) <= 4 * eps * float(want.float().abs().max())
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert bool(torch.isfinite(got).all())
        assert torch.allclose(got.float(), want.float(), rtol=2**-6, atol=2**-6)
    for m in (q_norm, k_norm, rope):  # the modules take the kernel once the runner fuses them
        m.fused = True
    fused_q, fused_k = rope.norm_and_rotate(pos, q, k, q_norm, k_norm)
    assert torch.equal(fused_q, got_q) and torch.equal(fused_k, got_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [96, 3072])
def test_silu_and_mul_matches_torch(dtype, n):
    from kvserve.kernels.triton_layers import silu_and_mul

    g = torch.Generator().manual_seed(n)
    x = (torch.randn(9, 2 * n, generator=g) * 4).to(DEV, dtype)
    gate, up = x.split(n, dim=-1)
    _close(silu_and_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 24, 256), (3, 4, 48), (1, 2, 1000)])
def test_sigmoid_gate_matches_torch(dtype, shape):
    """The gated attention's output gate (Qwen3-Next / Qwen3.5 ``o_proj(attn * sigmoid(gate))``), the
    gate read through the strided [query | gate] view of each head as the model makes it (several
    column blocks at 24 x 256, a partial one at 2 x 1000)."""
    from kvserve.kernels.triton_layers import sigmoid_gate

    t, heads, head = shape
    g = torch.Generator().manual_seed(heads * head)
    qg = (torch.randn(t, heads, 2 * head, generator=g) * 3).to(DEV, dtype)
    gate = qg.chunk(2, dim=-1)[1]
    x = torch.randn(t, heads * head, generator=g).to(DEV, dtype)
    got = sigmoid_gate(x, gate)
    _close(got, x * torch.sigmoid(gate.reshape(t, heads * head)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 5120), (37, 96), (3, 1500)])
def test_fp8_static_quant_equals_torch_bit_for_bit(dtype, shape):
    """The FP8 layers' activation quantisation against ``quantize_fp8_static`` (vLLM's formula): every
    byte equal, values past +-448 clamped, NaN kept, infinities saturated; several sizes around the
    1024-element block. A NaN's sign is not compared: CUDA's conversion gives the canonical 0x7F
    (as vLLM's CUDA kernel), torch's CPU conversion keeps the sign (0xFF from a negative NaN, which
    the H200's torch made of this bf16 NaN, 2026-12-01)."""
    from kvserve.kernels.triton_layers import fp8_static_quant
    from kvserve.quant.nvfp4 import quantize_fp8_static

    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=g) * 300).to(dtype)
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e4]).to(dtype)
    inv = torch.tensor([1 / 0.37], dtype=torch.float32)
    want = quantize_fp8_static(x, inv)
    got = fp8_static_quant(x.to(DEV), inv.to(DEV)).cpu()
    assert got.dtype == torch.float8_e4m3fn and got.shape == x.shape
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan) and bool(nan.view(-1)[0])
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])
    assert bool((want.float().abs() == 448).any())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 3, 128), (5, 4, 16), (1, 1, 48)])
def test_gated_rms_norm_matches_torch(dtype, shape):
    """The GDN output norm ``w * norm(x) * silu(z)`` (rows per program do not divide T x H in the
    first case), over a strided z (a view of a wider projection), against gdn_reference."""
    from kvserve.kernels import gdn_reference
    from kvserve.kernels.triton_layers import gated_rms_norm

    T, H, n = shape
    gen = torch.Generator().manual_seed(T * 100 + n)
    x = torch.randn(T, H, n, generator=gen).to(dtype)
    z = torch.randn(T, H * n + 5, generator=gen).to(dtype)[:, : H * n].view(T, H, n)
    w = (1 + 0.2 * torch.randn(n, generator=gen)).to(dtype)
    got = gated_rms_norm(x.to(DEV), z.to(DEV), w.to(DEV), 1e-6).cpu()
    _close(got, gdn_reference.gated_rms_norm(x, z, w, 1e-6))


def test_fused_layers_in_the_engine(make_tiny_model, one_thread):
    """bf16 model, triton backend: the runner switches the fused kernels on; tokens equal the
    reference backend's (greedy, 3 prompts)."""
    from kvserve import LLM, SamplingParams

    folder = make_tiny_model("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["The quick brown fox", "def main():\n", "Paged attention stores keys"]
    outs = {}
    for backend in ("reference", "triton"):
        llm = LLM(str(folder), dtype="bfloat16", attention_backend=backend, kv_cache_memory=1 << 22, max_num_seqs=4)
        fused = [m.fused for m in llm.llm_engine.runner.model.modules() if hasattr(m, "fused")]
        assert all(fused) == (backend == "triton") and len(fused) > 3
        outs[backend] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs["triton"] == outs["reference"]


def test_fused_output_gate_in_a_hybrid_engine(make_tiny_model, one_thread):
    """bf16 Qwen3.5 model, triton backend: the runner switches the gated attention's fused output gate
    on, and what it hands ``o_proj`` (the same prompt's prefill, prefix caching off) matches the torch
    gate's to a rounding."""
    from kvserve import LLM, SamplingParams
    from kvserve.models.qwen3_next import GatedAttentionBlock

    llm = LLM(str(make_tiny_model("qwen3_5")), dtype="bfloat16", attention_backend="triton", kv_cache_memory=1 << 22,
              max_num_seqs=2, enable_prefix_caching=False)
    block = next(m for m in llm.llm_engine.runner.model.modules() if isinstance(m, GatedAttentionBlock))
    assert block.fused
    seen = []
    block.o_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    llm.generate([prompt], sp, use_tqdm=False)
    block.fused = False
    llm.generate([prompt], sp, use_tqdm=False)
    assert len(seen) == 2 and seen[0].shape[0] == 37
    _close(seen[0], seen[1])


def _fp8_inputs(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random values with a NaN and a few large ones (quantized past +-448: the clamp)."""
    x = torch.randn(shape, generator=g) * 3
    x.view(-1)[5] = float("nan")
    x.view(-1)[7:11] = torch.tensor([1e4, -1e4, 700.0, -0.0])
    return x.to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 4, 64), (9, 48, 128)])
def test_gated_rms_norm_writes_the_fp8_quantisers_codes(dtype, shape):
    """With ``inv_scale`` the gated norm writes the float8 codes that ``fp8_static_quant`` makes of
    its own output, bit for bit (NaN rows and saturated values included), in one launch."""
    from kvserve.kernels import triton_layers

    g = torch.Generator().manual_seed(shape[1])
    x, z = _fp8_inputs(g, shape, dtype), (torch.randn(shape, generator=g) * 2).to(DEV, dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(DEV, dtype)
    inv = torch.tensor(60.0, device=DEV)
    out = triton_layers.gated_rms_norm(x, z, w, 1e-6)
    want = triton_layers.fp8_static_quant(out, inv)
    got = triton_layers.gated_rms_norm(x, z, w, 1e-6, inv)
    assert got.dtype == torch.float8_e4m3fn and got.shape == shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert bool(got.float().isnan().any()) and float(got.float().nan_to_num().abs().max()) == 448.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_writes_the_fp8_quantisers_codes(dtype):
    """The output gate's fp8 variant: ``fp8_static_quant`` of its own output, bit for bit."""
    from kvserve.kernels import triton_layers

    g = torch.Generator().manual_seed(11)
    t, heads, head = 7, 6, 64
    x = _fp8_inputs(g, (t, heads * head), dtype)
    gate = (torch.randn(t, heads, 2 * head, generator=g) * 2).to(DEV, dtype)[..., head:]  # strided, as in the block
    inv = torch.tensor(0.5, device=DEV)
    want = triton_layers.fp8_static_quant(triton_layers.sigmoid_gate(x, gate), inv)
    got = triton_layers.sigmoid_gate(x, gate, inv)
    assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_gdn_hands_an_fp8_out_proj_the_fused_norms_codes(monkeypatch):
    """A GDN layer whose out_proj is an FP8 layer: with the fused norm, the norm's launch writes the
    quantized input and the projection's output is the unfused chain's, bit for bit (on a GPU the
    chain's Triton quantiser is not called; on the CPU the layer quantizes with torch's formula)."""
    from types import SimpleNamespace

    from kvserve.kernels import triton_layers
    from kvserve.layers.gdn import GatedDeltaNet
    from kvserve.layers.quant_linear import FP8Linear

    cfg = SimpleNamespace(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu")
    gdn = GatedDeltaNet(cfg, 0, grouped_layout=False).to(DEV, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    proj = FP8Linear(gdn.value_dim, 64, bias=False)
    with torch.no_grad():
        proj.weight.copy_((torch.randn(64, gdn.value_dim, generator=g) * 100).to(torch.float8_e4m3fn))
        proj.weight_scale.fill_(1e-3)
        proj.input_scale.fill_(0.02)
        gdn.norm.weight.copy_(torch.rand(32, generator=g) + 0.5)
    proj.finalize()
    gdn.out_proj = proj.to(DEV)
    out = (torch.randn(5, 4, 32, generator=g) * 2).to(DEV, torch.bfloat16)
    z = torch.randn(5, 4, 32, generator=g).to(DEV, torch.bfloat16)
    gdn.norm.fused = True
    want = proj(triton_layers.gated_rms_norm(out, z, gdn.norm.weight, gdn.eps).reshape(5, gdn.value_dim))
    quantiser = []
    monkeypatch.setattr(triton_layers, "fp8_static_quant", lambda *a: quantiser.append(1))
    got = gdn._norm_and_project(out, z, torch.bfloat16)
    assert not quantiser and got.dtype == torch.bfloat16 and torch.equal(got, want)
