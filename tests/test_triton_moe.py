"""The dense routed experts' grouped GEMM (kernels/triton_moe.py) and the fused ``Experts`` forward
against float64 references and the torch loop over experts, on fresh random inputs: token counts
1 to prefill-sized (both block sizes of ``expert_block_rows``), experts left empty, shapes that do not
fill a tile, bf16 / fp16 / fp32. CPU: interpreter. Tolerances: the kernel's error against float64
may be at most twice the error of torch's own matmul in the same dtype (the reference's spread)."""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.moe import moe_align
from triton_support import kernel_device, skip_without_triton_device

pytestmark = skip_without_triton_device()
DEV = kernel_device()
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _routing(tokens: int, experts: int, k: int, used: int, gen: torch.Generator) -> torch.Tensor:
    """[tokens, k] distinct expert ids per token, drawn from the first ``used`` experts only (the
    others stay empty)."""
    return torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(tokens)]).to(DEV)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,block_m", [(1, 16), (5, 16), (33, 16), (40, 64)])
def test_grouped_matmul_against_float64(dtype, tokens, block_m):
    from kvserve.kernels.triton_moe import grouped_matmul

    gen = torch.Generator().manual_seed(tokens * 7 + block_m)
    e, k, n, kdim = 8, 2, 48, 40  # N and K fill no tile: the masks are exercised
    top = _routing(tokens, e, k, used=6, gen=gen)
    x = torch.randn(tokens, kdim, generator=gen).to(DEV, dtype)
    w = (torch.randn(e, n, kdim, generator=gen) / kdim ** 0.5).to(DEV, dtype)
    ids, block_expert = moe_align(top, e, block_m)
    out = torch.full((tokens * k, n), float("nan"), dtype=dtype, device=DEV)
    grouped_matmul(x, w, ids, block_expert, block_m, k, out)
    rows = torch.arange(tokens * k, device=DEV)
    xw = x[rows // k]
    want = torch.einsum("rk,rnk->rn", xw.double(), w[top.reshape(-1)].double())
    torch_dtype = torch.stack([xw[r] @ w[top.reshape(-1)[r]].T for r in range(tokens * k)])
    assert bool(torch.isfinite(out).all()), "a routed row was not written"
    assert _rel_err(out, want) <= 2 * _rel_err(torch_dtype, want) + 1e-7


def test_grouped_matmul_rows_per_x_one_and_unlisted_rows_untouched():
    """``rows_per_x`` 1 (the down GEMM: one input row per routed row); rows that no block lists are
    left as they are."""
    from kvserve.kernels.triton_moe import grouped_matmul

    gen = torch.Generator().manual_seed(3)
    e, n, kdim, rows = 4, 32, 16, 9
    top = torch.randint(0, e, (rows, 1), generator=gen).to(DEV)
    a = torch.randn(rows, kdim, generator=gen).to(DEV)
    w = torch.randn(e, n, kdim, generator=gen).to(DEV)
    ids, block_expert = moe_align(top[:6], e, 16)  # only rows 0..5 are routed
    out = torch.full((rows, n), float("nan"), device=DEV)
    grouped_matmul(a, w, ids, block_expert, 16, 1, out)
    want = torch.einsum("rk,rnk->rn", a[:6].double(), w[top[:6, 0]].double())
    assert _rel_err(out[:6], want) < 1e-6
    assert bool(torch.isnan(out[6:]).all())


def test_grouped_matmul_rejects_bad_shapes():
    from kvserve.kernels.triton_moe import grouped_matmul

    x = torch.zeros(2, 16, device=DEV)
    w = torch.zeros(4, 32, 8, device=DEV)
    ids, block_expert = moe_align(torch.zeros(2, 1, dtype=torch.long, device=DEV), 4, 16)
    with pytest.raises(ValueError, match=r"x \(2, 16\).*experts \(4, 32, 8\)"):
        grouped_matmul(x, w, ids, block_expert, 16, 1, torch.empty(2, 32, device=DEV))
    w = torch.zeros(4, 32, 16, device=DEV)
    with pytest.raises(ValueError, match=r"out \(2, 16\).*expected \[rows, 32\]"):
        grouped_matmul(x, w, ids, block_expert, 16, 1, torch.empty(2, 16, device=DEV))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (7, 16, 4), (70, 8, 2)])
def test_fused_experts_equal_the_loop(dtype, tokens, experts, k):
    """The whole routed-expert forward, fused vs the torch loop, both against float64 (70 tokens x 2
    slots over 8 experts takes the 64-row blocks)."""
    from kvserve.models.qwen3_next import Experts

    gen = torch.Generator().manual_seed(tokens + experts)
    hidden, inter = 64, 48
    mod = Experts(experts, hidden, inter)
    with torch.no_grad():
        mod.gate_up_proj.copy_(torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5)
        mod.down_proj.copy_(torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5)
    x64 = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    top = _routing(tokens, experts, k, used=experts - 2, gen=gen)
    w = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1).to(DEV)
    with torch.no_grad():
        want = Experts.forward(mod.double().to(DEV), x64.to(DEV), top, w.double())
    mod = mod.to(DEV, dtype)
    x = x64.to(DEV, dtype)
    with torch.no_grad():
        loop = mod(x, top, w.to(dtype))
        mod.fused = True
        fused = mod(x, top, w.to(dtype))
    assert fused.dtype == dtype and bool(torch.isfinite(fused).all())
    assert _rel_err(fused, want) <= 2 * _rel_err(loop, want) + 1e-7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fused_experts_capture_in_a_cuda_graph():
    """The fused forward (``moe_align`` and both grouped GEMMs) has no host sync: it captures, and
    the replay on new routing equals an eager call."""
    from kvserve.models.qwen3_next import Experts

    torch.manual_seed(0)
    e, hidden, inter, tokens, k = 16, 128, 64, 24, 4
    mod = Experts(e, hidden, inter).to("cuda", torch.bfloat16)
    with torch.no_grad():
        mod.gate_up_proj.normal_(std=hidden ** -0.5)
        mod.down_proj.normal_(std=inter ** -0.5)
    mod.fused = True
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    top = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k, device="cuda"), -1).to(torch.bfloat16)
    with torch.no_grad():
        mod(x, top, w)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mod(x, top, w)
        top.copy_(torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(tokens)]))
        graph.replay()
        torch.testing.assert_close(out, mod(x, top, w), rtol=0, atol=0)


def test_row_weight_scales_each_routed_row_before_its_rounding():
    """``row_weight`` (the routing weights, vLLM's MUL_ROUTED_WEIGHT): in fp32 the weighted rows are
    exactly the unweighted ones times their weight (the same fp32 accumulator, one product, one
    rounding); a weight of the wrong length is refused, naming it."""
    from kvserve.kernels.triton_moe import grouped_matmul

    gen = torch.Generator().manual_seed(11)
    e, k, n, kdim, tokens = 6, 2, 40, 24, 7
    top = _routing(tokens, e, k, used=5, gen=gen)
    x = torch.randn(tokens, kdim, generator=gen).to(DEV)
    w = torch.randn(e, n, kdim, generator=gen).to(DEV)
    rw = torch.rand(tokens * k, generator=gen).to(DEV)
    ids, block_expert = moe_align(top, e, 16)
    plain = torch.full((tokens * k, n), float("nan"), device=DEV)
    weighted = plain.clone()
    grouped_matmul(x, w, ids, block_expert, 16, k, plain)
    grouped_matmul(x, w, ids, block_expert, 16, k, weighted, rw)
    assert bool(torch.isfinite(weighted).all())
    assert torch.equal(weighted, plain * rw[:, None])
    with pytest.raises(ValueError, match=r"row_weight \(13,\)"):
        grouped_matmul(x, w, ids, block_expert, 16, k, weighted, rw[:13])


@pytest.mark.parametrize("tokens,experts,k,block_m,chunk", [
    (1, 8, 2, 16, None), (5, 256, 8, 16, None), (33, 16, 4, 16, None), (70, 8, 2, 64, None),
    (37, 60, 8, 32, 64),  # 296 rows in 5 chunks of 64, 60 experts (not a power of two)
    (40, 8, 2, 64, 32),   # 80 rows in 3 chunks of 32, every expert's rows spread over chunks
])
def test_moe_align_kernel_equals_the_torch_twin(tokens, experts, k, block_m, chunk, monkeypatch):
    """``moe_align`` in one Triton launch against its torch twin on the same routing (skewed, some
    experts empty): the same ids and block experts exactly, from int64 and int32 expert ids; the
    outputs are allocated poisoned, so every entry must be written."""
    from kvserve.kernels import triton_moe_align
    from kvserve.layers.moe import moe_align_torch

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(-7))
    gen = torch.Generator().manual_seed(tokens * experts)
    logits = torch.randn(tokens, experts, generator=gen) + torch.linspace(3, -3, experts)
    top = logits.topk(k, dim=-1).indices
    want = moe_align_torch(top, experts, block_m)
    for ids_dtype in (torch.int64, torch.int32):
        got = triton_moe_align.moe_align_triton(top.to(DEV, ids_dtype), experts, block_m, chunk=chunk)
        assert got[0].dtype == got[1].dtype == torch.int32
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    with pytest.raises(ValueError, match="chunk 48, expected a power of two >= 32"):
        triton_moe_align.moe_align_triton(top.to(DEV), experts, block_m, chunk=48)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,block_m", [(1, 16), (33, 16), (40, 64)])
def test_grouped_matmul_with_the_shared_expert_as_expert_e(dtype, tokens, block_m):
    """``shared`` [N, K] is expert E: routing laid out over E + 1 experts (every token also routed to
    E, as SparseMoeBlock does) gives its rows the shared weight, the others their expert's; against
    float64 as the plain grouped GEMM, output poisoned."""
    from kvserve.kernels.triton_moe import grouped_matmul

    gen = torch.Generator().manual_seed(tokens * 11 + block_m)
    e, k, n, kdim = 8, 2, 48, 40
    top = torch.cat([_routing(tokens, e, k, used=6, gen=gen), torch.full((tokens, 1), e, device=DEV)], dim=1)
    x = torch.randn(tokens, kdim, generator=gen).to(DEV, dtype)
    w = (torch.randn(e, n, kdim, generator=gen) / kdim ** 0.5).to(DEV, dtype)
    shared = (torch.randn(n, kdim, generator=gen) / kdim ** 0.5).to(DEV, dtype)
    ids, block_expert = moe_align(top, e + 1, block_m)
    out = torch.full((tokens * (k + 1), n), float("nan"), dtype=dtype, device=DEV)
    grouped_matmul(x, w, ids, block_expert, block_m, k + 1, out, shared=shared)
    stack = torch.cat([w, shared[None]])  # expert E = the shared expert
    rows = torch.arange(tokens * (k + 1), device=DEV)
    xw = x[rows // (k + 1)]
    want = torch.einsum("rk,rnk->rn", xw.double(), stack[top.reshape(-1)].double())
    torch_dtype = torch.stack([xw[r] @ stack[top.reshape(-1)[r]].T for r in range(tokens * (k + 1))])
    assert bool(torch.isfinite(out).all()), "a routed row was not written"
    assert _rel_err(out, want) <= 2 * _rel_err(torch_dtype, want) + 1e-7
    with pytest.raises(ValueError, match=r"shared expert \(40, 48\)"):
        grouped_matmul(x, w, ids, block_expert, block_m, k + 1, out, shared=shared.T)
