"""Routed experts on NVFP4 weights (layers/quant_experts.py): the device-side alignment of rows to
experts, the grouped W4A16 GEMM (kernels/triton_w4a16.py) against float64, and ``NVFP4Experts``
against the dense ``Experts`` with the weights dequantized exactly. Fresh random routings with 1
token, experts left empty and experts with more rows than a block; bf16 and fp32; outputs poisoned
first. CPU: the Triton interpreter.

The GEMM bound is test_triton_w4a16.py's: against the exact weights in float64, an fp32 dot of K
terms scaled and rounded once is off by at most ``u_out |y| + (K + 1) u_fp32 (|x| @ |W|^T)``."""

from __future__ import annotations

import pytest
import torch

from kvserve.quant.nvfp4 import e2m1_table, quantize_nvfp4, unpack_e2m1
from triton_support import kernel_device, skip_without_triton_device

DEV = kernel_device()
UNIT = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def _routing(tokens: int, experts: int, k: int, seed: int) -> torch.Tensor:
    """Top-k expert ids a token (distinct), skewed so that some experts get many rows, some none."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen) + torch.linspace(3, -3, experts)
    return logits.topk(k, dim=-1).indices


@pytest.mark.parametrize("tokens,experts,k,block_m", [(1, 8, 2, 16), (37, 8, 2, 16), (300, 16, 4, 64), (5, 64, 8, 16)])
def test_moe_align_groups_every_row_once(tokens, experts, k, block_m):
    from kvserve.layers.moe import moe_align

    top = _routing(tokens, experts, k, tokens + experts)
    ids, block_expert = moe_align(top, experts, block_m)
    rows = tokens * k
    assert ids.dtype == block_expert.dtype == torch.int32
    assert ids.numel() == block_expert.numel() * block_m >= rows
    assert ids.numel() == -(-(rows + experts * (block_m - 1)) // block_m) * block_m  # the bound, no host read
    listed = ids[ids >= 0].long()
    assert torch.equal(listed.sort().values, torch.arange(rows))  # every row exactly once
    flat = top.reshape(-1)
    blocks = ids.view(-1, block_m)
    for b, e in enumerate(block_expert.tolist()):
        r = blocks[b][blocks[b] >= 0].long()
        if e == experts:  # past the last expert: empty
            assert r.numel() == 0
            continue
        assert bool((flat[r] == e).all()) and bool((r[1:] > r[:-1]).all())  # one expert, rows ascending
        if r.numel() < block_m:  # only an expert's last block is partly padding, at its end
            assert bool((blocks[b][r.numel():] == -1).all())
    counts = torch.bincount(flat, minlength=experts)
    assert bool((counts == 0).any()) or tokens * k >= experts  # some routings leave experts empty
    assert sorted(set(block_expert.tolist()) - {experts}) == sorted(set(flat.tolist()))


def _experts(e: int, n: int, k: int, seed: int):
    """E experts' NVFP4 tensors stacked ([E, n, k/2], [E, n, k/16], one global scale each as [E, n]) and
    their exact float64 weights."""
    gen = torch.Generator().manual_seed(seed)
    packed, block, rows, exact = [], [], [], []
    for i in range(e):
        p, b, s2 = quantize_nvfp4(torch.randn(n, k, generator=gen) * (0.05 * (i + 1)))
        v = e2m1_table()[unpack_e2m1(p).long()].double().reshape(n, k // 16, 16)
        exact.append((v * b.double()[..., None] * s2.double()).reshape(n, k))
        packed.append(p), block.append(b), rows.append(s2.expand(n))
    return torch.stack(packed), torch.stack(block), torch.stack(rows).contiguous(), torch.stack(exact), gen


def _bound_ok(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    want = (x.double()[:, None, :] @ w.transpose(-1, -2)).squeeze(1)
    mag = (x.double().abs()[:, None, :] @ w.abs().transpose(-1, -2)).squeeze(1)
    slack = UNIT[y.dtype] * want.abs() + (x.shape[-1] + 1) * 2.0**-24 * mag
    return bool(((y.double() - want).abs() <= slack * 1.0001 + 1e-30).all())


@skip_without_triton_device()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,block_m", [(1, 16), (21, 16), (70, 64)])
def test_grouped_w4a16_matmul_against_float64(dtype, tokens, block_m):
    """Each listed row r: x[r // k] @ W_e^T with e its expert, into a poisoned output (all rows listed:
    none left NaN); K = 160 (not a multiple of 64), N = 48 (not of the 64-row tile)."""
    from kvserve.kernels.triton_w4a16 import pack_w4a16, w4a16_grouped_matmul
    from kvserve.layers.moe import moe_align

    e, n, kdim, k = 6, 48, 160, 2
    packed, block, rows, exact, gen = _experts(e, n, kdim, tokens)
    top = _routing(tokens, e, k, tokens)
    ids, block_expert = moe_align(top.to(DEV), e, block_m)
    x = torch.randn(tokens, kdim, generator=gen).to(dtype)
    wt = pack_w4a16(packed.to(DEV), block.to(DEV), rows.to(DEV))
    out = torch.full((tokens * k, n), float("nan"), dtype=dtype, device=DEV)
    y = w4a16_grouped_matmul(x.to(DEV), wt, ids, block_expert, block_m, k, out).cpu()
    assert not bool(torch.isnan(y).any())
    w_rows = exact[top.reshape(-1)]  # [rows, n, K]: each row's expert's weights
    assert _bound_ok(y, x.repeat_interleave(k, dim=0), w_rows)


@skip_without_triton_device()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_nvfp4_experts_equal_dense_experts_on_the_exact_weights(dtype, tokens):
    """``NVFP4Experts`` (loaded as the checkpoint stores experts, then finalized) against the dense
    ``Experts`` holding the same weights dequantized, both in the test dtype, and both against the
    dense experts in float64: the quantized experts are as close to float64 as 2x the dense path's
    own spread (the GEMMs sum in other orders and round the activations at other steps) plus one
    rounding of the output."""
    from kvserve.layers.quant_experts import NVFP4Experts
    from kvserve.models.qwen3_next import Experts

    e, hidden, inter, k = 5, 64, 48, 2
    gu_p, gu_b, gu_s, gu_w, gen = _experts(e, 2 * inter, hidden, 100 + tokens)
    dn_p, dn_b, dn_s, dn_w, _ = _experts(e, hidden, inter, 200 + tokens)
    q = NVFP4Experts(e, hidden, inter, device=DEV)
    with torch.no_grad():
        for name, (p, b, s) in {"gate_up_proj": (gu_p, gu_b, gu_s), "down_proj": (dn_p, dn_b, dn_s)}.items():
            getattr(q, name).copy_(p), getattr(q, f"{name}_scale").copy_(b), getattr(q, f"{name}_scale_2").copy_(s)
    q.finalize()
    assert q.gate_up_proj is None and q.gate_up_proj_codes.dtype == torch.int16

    def dense(dt: torch.dtype, dev: str) -> Experts:
        m = Experts(e, hidden, inter).to(device=dev, dtype=dt)
        with torch.no_grad():
            m.gate_up_proj.copy_(gu_w.to(dt)), m.down_proj.copy_(dn_w.to(dt))
        return m

    top = _routing(tokens, e, k, tokens)
    top_w = torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    with torch.no_grad():
        got = q(x.to(DEV), top.to(DEV), top_w.to(DEV)).double().cpu()
        ref = dense(dtype, DEV)(x.to(DEV), top.to(DEV), top_w.to(DEV)).double().cpu()
        truth = dense(torch.float64, "cpu")(x.double(), top, top_w.double())
    spread = float((ref - truth).abs().max())
    err = (got - truth).abs()
    fp32_gemms = _fp32_gemm_bound(x.double(), top, top_w.double(), gu_w, dn_w)
    assert bool((err <= fp32_gemms.clamp_min(2 * spread) + UNIT[dtype] * truth.abs().max()).all()), (
        float(err.max()), spread, float(fp32_gemms.max()))


def _fp32_gemm_bound(x, top, top_w, gu_w, dn_w) -> torch.Tensor:
    """First-order bound (float64) on what two fp32-accumulated GEMMs of K terms (each off by at most
    ``(K + 1) 2^-24 |x| @ |W|^T``) do to the experts' output: the gate / up errors through
    ``silu(g) * u`` (|silu'| < 1.1), then the down GEMM's own error and the error it carries,
    weighted by the routing weights. The quantized path sums in other orders than the dense one
    (the kernel's k order is a permutation of the features), so its error is held to this bound or
    to twice the dense path's spread, whichever is larger."""
    u = 2.0**-24
    inter = dn_w.shape[-1]
    bound = torch.zeros(x.shape[0], dn_w.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for pos, e in enumerate(top[t].tolist()):
            gu = gu_w[e] @ x[t]
            a = (gu_w[e].abs() @ x[t].abs()) * (x.shape[1] + 1) * u
            g, up, dg, du = gu[:inter], gu[inter:], a[:inter], a[inter:]
            h = torch.nn.functional.silu(g) * up
            dh = 1.1 * up.abs() * dg + (torch.nn.functional.silu(g).abs() + 1.1 * dg) * du
            dout = (dn_w[e].abs() @ h.abs()) * (inter + 1) * u + dn_w[e].abs() @ dh
            bound[t] += top_w[t, pos].abs() * dout
    return bound * 1.01


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("tokens", [1, 33])
@pytest.mark.parametrize("kind,x_scale", [("NVFP4Experts", 1.0), ("FP8Experts", 0.5)])
def test_quantized_experts_forward_is_graph_capturable(tokens, kind, x_scale):
    """The whole routed-expert forward of NVFP4 and FP8 experts (``moe_align`` on the device, the FP8
    activation quantisers, both grouped GEMMs) captures in a CUDA graph (nothing reads the expert
    counts on the host: ``torch.bincount`` would, for its size) and the replay gives the eager output
    bit for bit, with the routing changed in place between."""
    from kvserve.layers import quant_experts

    e, hidden, inter, k = 16, 128, 64, 4
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q = getattr(quant_experts, kind)(e, hidden, inter, device="cuda")
    q.init_dummy(gen)
    q.finalize()
    x = (torch.randn(tokens, hidden, generator=gen, device="cuda") * x_scale).to(torch.bfloat16)
    top_w, top_idx = torch.softmax(torch.randn(tokens, e, generator=gen, device="cuda"), -1).topk(k, dim=-1)
    top_w = top_w.to(torch.bfloat16)
    with torch.no_grad():
        q(x, top_idx, top_w)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = q(x, top_idx, top_w)
        for seed in (1, 2):
            top_idx.copy_(_routing(tokens, e, k, seed).to("cuda"))
            out.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, q(x, top_idx, top_w))
