"""The MoE router kernels (kernels/triton_router.py) against their torch twins on fresh random inputs,
and ``SparseMoeBlock``'s device path (Triton router, fused experts, gated add) against its torch
path. CPU: interpreter.

Tolerances, each from a float64 reference of the same inputs:
* router weights: the relative error may be twice torch's own fp32 pipeline's largest relative
  error (``softmax(dtype=float32)``, ``topk``, the division by the sum) plus 4 fp32 ulps (2^-22):
  with k = 1 and renormalisation torch's error is 0, and the kernel's exp (numpy in the
  interpreter, ``ex2.approx`` on the GPU) is not torch's; experts must equal torch's exactly on
  logits without ties (a permutation of k / 16, distinct in bf16 and far apart after exp).
* the gated add: at most the error of torch's ``routed + sigmoid(g) * shared`` (three roundings to
  the dtype; the kernel rounds once) in bf16 / fp16; in fp32 both round twice, so twice it.
* the block: the same experts as the torch path; its routing weights in the dtype within the router
  tolerance plus one ulp of the dtype; its output within twice the torch path's error (its experts
  loop, in the dtype), as tests/test_triton_moe.py.

Ties: the kernel puts the lower expert first (vLLM's rule). torch.topk on CPU has no fixed order
among equal values (a quickselect): only the values agree with it there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from triton_support import kernel_device, skip_without_triton_device

pytestmark = skip_without_triton_device()
DEV = kernel_device()
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FLOOR = 2.0**-22


def _distinct_logits(tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Rows that are permutations of ``(j - E / 2) / 16``: distinct and exact in bf16 for E <= 256."""
    rows = [torch.randperm(experts, generator=gen) for _ in range(tokens)]
    perm = torch.stack(rows) if rows else torch.empty(0, experts, dtype=torch.long)
    return (perm.double() - experts // 2) / 16


def _torch_router(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``SparseMoeBlock``'s torch router (the reference path)."""
    w, i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    return (w / w.sum(dim=-1, keepdim=True) if renormalize else w), i


def _f64_weights(logits: torch.Tensor, idx: torch.Tensor, renormalize: bool) -> torch.Tensor:
    w = torch.softmax(logits.double(), dim=-1).gather(1, idx)
    return w / w.sum(dim=-1, keepdim=True) if renormalize else w


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).abs() / want).max()) if want.numel() else 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,k", [
    (0, 8, 2), (1, 8, 1), (1, 256, 8), (7, 8, 8), (7, 60, 10), (7, 128, 2), (7, 256, 10),
    (300, 8, 2), (300, 60, 1), (300, 128, 8),
])
def test_softmax_topk_against_torch(dtype, tokens, experts, k):
    from kvserve.kernels.triton_router import softmax_topk

    gen = torch.Generator().manual_seed(tokens * 1000 + experts * 10 + k)
    logits = _distinct_logits(tokens, experts, gen).to(DEV, dtype)
    for renormalize in (False, True):
        want_w, want_i = _torch_router(logits, k, renormalize)
        top_w = torch.full((tokens, k), float("nan"), device=DEV)
        top_i = torch.full((tokens, k), -1, dtype=torch.int64, device=DEV)
        got_w, got_i = softmax_topk(logits, k, renormalize, out=(top_w, top_i))
        assert got_w is top_w and got_i is top_i
        assert torch.equal(got_i, want_i)
        ref = _f64_weights(logits, want_i, renormalize)
        assert _rel_err(got_w, ref) <= 2 * _rel_err(want_w, ref) + FLOOR
        assert bool((got_w[:, :-1] >= got_w[:, 1:]).all())  # descending


def test_softmax_topk_allocates_and_reads_strided_rows():
    """Without ``out`` the results are new tensors; logits may be a column slice of a wider tensor
    (row stride > E) and need not be contiguous in memory."""
    from kvserve.kernels.triton_router import softmax_topk

    gen = torch.Generator().manual_seed(5)
    wide = _distinct_logits(9, 72, gen).to(DEV, torch.bfloat16)
    logits = wide[:, 4:64]  # 60 experts, row stride 72
    assert logits.stride(0) == 72
    w, i = softmax_topk(logits, 4, True)
    want_w, want_i = _torch_router(logits, 4, True)
    assert w.dtype == torch.float32 and i.dtype == torch.int64 and w.shape == (9, 4)
    assert torch.equal(i, want_i)
    ref = _f64_weights(logits, want_i, True)
    assert _rel_err(w, ref) <= 2 * _rel_err(want_w, ref) + FLOOR


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (7, 60, 8), (300, 256, 8)])
def test_softmax_topk_with_the_shared_experts_slot(dtype, tokens, experts, k):
    """``shared_gate``: slot k is expert E with weight sigmoid(gate logit) (float64 of the same
    logits within 2x torch's own fp32 sigmoid error), not part of the renormalisation; slots 0..k-1
    as without it; outputs poisoned first; a gate of the wrong shape is refused."""
    from kvserve.kernels.triton_router import softmax_topk

    gen = torch.Generator().manual_seed(tokens + experts + k)
    logits = _distinct_logits(tokens, experts, gen).to(DEV, dtype)
    gate = (torch.randn(tokens, 1, generator=gen) * 3).to(DEV, dtype)
    for renormalize in (False, True):
        want_w, want_i = _torch_router(logits, k, renormalize)
        top_w = torch.full((tokens, k + 1), float("nan"), device=DEV)
        top_i = torch.full((tokens, k + 1), -1, dtype=torch.int64, device=DEV)
        got_w, got_i = softmax_topk(logits, k, renormalize, out=(top_w, top_i), shared_gate=gate)
        assert torch.equal(got_i[:, :k], want_i) and bool((got_i[:, k] == experts).all())
        ref = _f64_weights(logits, want_i, renormalize)
        assert _rel_err(got_w[:, :k], ref) <= 2 * _rel_err(want_w, ref) + FLOOR
        sig64 = torch.sigmoid(gate.double())[:, 0]
        assert _rel_err(got_w[:, k], sig64) <= 2 * _rel_err(torch.sigmoid(gate.float())[:, 0], sig64) + FLOOR
    with pytest.raises(ValueError, match=rf"shared_gate \({tokens},\) on"):
        softmax_topk(logits, k, True, shared_gate=gate[:, 0])
    with pytest.raises(ValueError, match=rf"expected \[{tokens}, {k + 1}\] float32"):
        softmax_topk(logits, k, True, out=(top_w[:, :k], top_i[:, :k]), shared_gate=gate)
    # the weights rounded once, in the kernel, to the block's dtype: torch's rounding of the fp32 weights
    low = torch.bfloat16 if dtype == torch.float32 else dtype
    got_low, _ = softmax_topk(logits, k, True, shared_gate=gate, weight_dtype=low)
    want_w, _ = softmax_topk(logits, k, True, shared_gate=gate)
    assert got_low.dtype == low and torch.equal(got_low, want_w.to(low))
    with pytest.raises(ValueError, match="weight_dtype torch.int32"):
        softmax_topk(logits, k, True, weight_dtype=torch.int32)


@pytest.mark.parametrize("experts,k", [(8, 1), (8, 3), (60, 8), (128, 10), (256, 16)])
def test_softmax_topk_ties_go_to_the_lower_expert(experts, k):
    """Logits from {0, 1, 2, 3}: many equal probabilities. The kernel orders by probability, then
    by expert (a stable descending sort); torch.topk on CPU returns the same values in an order of
    its own among equals (e.g. top-3 of eight zeros: experts 6, 5, 4), so only values are compared
    with it."""
    from kvserve.kernels.triton_router import softmax_topk

    gen = torch.Generator().manual_seed(experts + k)
    logits = torch.randint(0, 4, (11, experts), generator=gen).float()
    logits[0] = 0.0  # a row of all-equal experts
    logits = logits.to(DEV)
    w, i = softmax_topk(logits, k, False)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.equal(i, torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k])
    assert torch.equal(i[0], torch.arange(k, device=DEV))
    want_w, want_i = torch.topk(probs, k, dim=-1)
    torch.testing.assert_close(w, want_w, rtol=FLOOR, atol=0)
    torch.testing.assert_close(probs.gather(1, i), probs.gather(1, want_i), rtol=0, atol=0)
    w_renorm, i_renorm = softmax_topk(logits, k, True)
    assert torch.equal(i_renorm, i)
    torch.testing.assert_close(w_renorm, want_w / want_w.sum(-1, keepdim=True), rtol=FLOOR, atol=0)


def test_softmax_topk_masked_and_nan_logits():
    """-inf logits (experts masked out) get probability 0 and are chosen after every finite one; a
    row with a NaN logit is NaN throughout (as torch's softmax), and its experts stay distinct and
    in range (NaN ranks first, as torch.topk)."""
    from kvserve.kernels.triton_router import softmax_topk

    logits = torch.tensor([[0.5, float("-inf"), 2.0, float("-inf"), 1.0, -1.0],
                           [0.0, float("nan"), 1.0, 2.0, 3.0, 4.0]], device=DEV)
    w, i = softmax_topk(logits, 5, False)
    assert i[0].tolist() == [2, 4, 0, 5, 1]
    assert float(w[0, 4]) == 0.0 and bool((w[0, :4] > 0).all())
    assert bool(torch.isnan(w[1]).all())
    assert sorted(i[1].tolist()) == sorted(set(i[1].tolist())) and 0 <= int(i[1].min()) and int(i[1].max()) < 6


def test_softmax_topk_rejects_bad_arguments():
    from kvserve.kernels.triton_router import softmax_topk

    x = torch.zeros(3, 8, device=DEV)
    with pytest.raises(ValueError, match="top_k 9 for 8 experts"):
        softmax_topk(x, 9, True)
    with pytest.raises(ValueError, match="top_k 0"):
        softmax_topk(x, 0, True)
    with pytest.raises(ValueError, match=r"logits \(24,\)"):
        softmax_topk(x.view(-1), 2, True)
    with pytest.raises(ValueError, match=r"expected \[3, 2\] float32 and int64"):
        softmax_topk(x, 2, True, out=(torch.empty(3, 2, device=DEV), torch.empty(3, 2, dtype=torch.int32, device=DEV)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(0, 64), (1, 2048), (7, 96), (300, 64)])
def test_add_gated_shared_against_float64(dtype, tokens, hidden):
    from kvserve.kernels.triton_router import add_gated_shared

    gen = torch.Generator().manual_seed(tokens + hidden)
    routed = torch.randn(tokens, hidden, generator=gen).to(DEV, dtype)
    shared = torch.randn(tokens, hidden, generator=gen).to(DEV, dtype)
    gate = (3 * torch.randn(tokens, 1, generator=gen)).to(DEV, dtype)
    want = routed.double() + torch.sigmoid(gate.double()) * shared.double()
    torch_out = routed + torch.sigmoid(gate) * shared
    buf = routed.clone()
    got = add_gated_shared(buf, shared, gate)
    assert got is buf and got.dtype == dtype
    if tokens:
        torch_err = float((torch_out.double() - want).abs().max())
        err = float((got.double() - want).abs().max())
        assert err <= (2 if dtype == torch.float32 else 1) * torch_err


def test_add_gated_shared_rejects_bad_shapes():
    from kvserve.kernels.triton_router import add_gated_shared

    r = torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError, match=r"gate \(4,\)"):
        add_gated_shared(r, torch.zeros(4, 8, device=DEV), torch.zeros(4, device=DEV))
    with pytest.raises(ValueError, match=r"shared \(4, 16\)"):
        add_gated_shared(r, torch.zeros(4, 16, device=DEV), torch.zeros(4, 1, device=DEV))


def _moe_block(norm_topk_prob: bool, seed: int, shared_width: int = 48):
    from kvserve.models.qwen3_next import SparseMoeBlock

    cfg = SimpleNamespace(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=shared_width)
    block = SparseMoeBlock(cfg, norm_topk_prob)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / p.shape[-1] ** 0.5)
    return block


def _experts_inputs(block) -> list:
    """Records the (x, top_idx, top_w) each experts call receives."""
    seen: list = []
    block.experts.register_forward_hook(lambda mod, args, out: seen.append(args))
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm_topk_prob,shared_width", [(True, 48), (False, 48), (True, 32)])
def test_sparse_moe_block_device_path_equals_reference(dtype, norm_topk_prob, shared_width):
    """The whole block with every ``fused`` switch on (as the runner sets them: Triton router, grouped
    GEMM experts, gated add; a shared expert of the experts' width 32 runs as expert E inside the
    grouped GEMMs instead) against the torch path, both against the float64 block: the same experts
    for every token, routing weights within the router tolerance, outputs within twice the torch
    path's error. The seed is one whose logits have no ties in any dtype."""
    from kvserve.layers.quant_experts import NVFP4Experts

    tokens = 40
    k, experts = 2, 8
    block = _moe_block(norm_topk_prob, seed=13, shared_width=shared_width)
    x64 = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    with torch.no_grad():
        want = block.double()(x64)
        ref_block = block.to(DEV, dtype)
        x = x64.to(DEV, dtype)
        logits = ref_block.gate(x)
        top = logits.topk(3, dim=-1).values  # k + 1 = 3 distinct leaders: the experts and their order are defined
        assert bool((top[:, :-1] > top[:, 1:]).all()), "tied logits: pick another seed"
        ref_seen = _experts_inputs(ref_block)
        ref = ref_block(x)
        assert not ref_block.experts_on_device
        fused_block = _moe_block(norm_topk_prob, seed=13, shared_width=shared_width).to(DEV, dtype)
        for m in fused_block.modules():
            if hasattr(m, "fused"):
                m.fused = True
        assert fused_block.experts_on_device
        in_gemms = fused_block.shared_expert_in_grouped_gemms
        assert in_gemms is (shared_width == 32)
        seen = _experts_inputs(fused_block)
        got = fused_block(x)
        if in_gemms:  # a batch over shared_expert_join_max_tokens keeps the shared expert beside the GEMMs
            fused_block.shared_expert_join_max_tokens = tokens - 1
            apart = fused_block(x)
            assert seen[-1][1].shape == (tokens, k)
            apart_err = float((apart.double() - want.to(DEV)).abs().max())
    assert got.dtype == dtype and got.shape == (tokens, 64) and bool(torch.isfinite(got).all())
    (_, ref_idx, ref_w), (_, idx, w) = ref_seen[0], seen[0]
    if in_gemms:  # slot k: the shared expert (expert E), weight sigmoid(gate) in the block's dtype
        assert bool((idx[:, k] == experts).all())
        sig = torch.sigmoid(ref_block.shared_expert_gate(x).float())[:, 0].detach()
        assert float((w[:, k].float() - sig).abs().max()) <= torch.finfo(dtype).eps
        idx, w = idx[:, :k], w[:, :k]
    assert torch.equal(idx, ref_idx)
    assert w.dtype == dtype
    w64 = _f64_weights(logits, ref_idx, norm_topk_prob)
    slack = max(FLOOR, torch.finfo(dtype).eps)  # fp32 weights a few ulps apart may round to neighbouring bf16 values
    assert _rel_err(w.float(), w64) <= 2 * _rel_err(ref_w.float(), w64) + slack
    err, ref_err = float((got.double() - want.to(DEV)).abs().max()), float((ref.double() - want.to(DEV)).abs().max())
    assert err <= 2 * ref_err + 1e-7
    if in_gemms:
        assert apart_err <= 2 * ref_err + 1e-7
    block.experts = NVFP4Experts(8, 64, 32)  # NVFP4 experts run the device path too
    assert block.experts_on_device
