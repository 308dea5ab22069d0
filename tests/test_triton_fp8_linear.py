"""The FP8 W8A8 decode GEMM (kernels/triton_fp8_linear.py) against its torch twin and float64: the
interpreter on the CPU (triton's tl.dot sums the same fp8 products in float32 in another order), the
tensor cores on a GPU; its K split and tile counters; FP8Linear's dispatch; the sm_90 compile."""

from __future__ import annotations

import pytest
import torch

from triton_support import kernel_device, skip_without_triton_device

DEV = kernel_device()
pytestmark = skip_without_triton_device()


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple:
    """x (activations within +-4, a few past the scale's range: clamped), fp8 weights, scales."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 1.5).to(dtype)
    x[0, : min(3, k)] = torch.tensor([9.0, -9.0, 0.0][: min(3, k)]).to(dtype)  # past +-448 after 1 / s_x: clamped
    w = (torch.randn(n, k, generator=gen) * 120).clamp(-448, 448).to(torch.float8_e4m3fn)
    s_x = torch.tensor(4.0 / 448.0)
    return x, w, (1 / s_x).reshape(()), s_x.reshape(()), torch.tensor(3e-4 / 448.0).reshape(())


def _bound(x: torch.Tensor, w: torch.Tensor, inv: torch.Tensor, s_x: torch.Tensor, s_w: torch.Tensor,
           want64: torch.Tensor, extra: float) -> torch.Tensor:
    """Per element: float32 accumulation over K (K 2^-24 of the sum of |products|, the twin's own
    bound), ``extra`` of that sum (the fp8 MMAs' partial sums on a GPU), and half an ulp of the output
    dtype at the float64 value (the final rounding)."""
    k = x.shape[1]
    v = (x.double() * float(inv)).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    abs_sum = (v.abs() @ w.double().abs().T) * (float(s_x) * float(s_w))
    ulp = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[x.dtype]
    return (k * 2.0**-24 + extra) * abs_sum + ulp * want64.abs() + 1e-30


def _float64(x, w, inv, s_x, s_w) -> torch.Tensor:
    v = (x.double() * float(inv)).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    return (v @ w.double().T) * (float(s_x) * float(s_w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k,block_n,split", [
    (1, 256, 512, 128, None),  # one row, K split by the launch rule
    (5, 200, 384, 64, 3),  # N past the last tile, three K parts
    (16, 128, 256, 128, 1),  # one program a tile
    (33, 96, 640, 64, 2),  # a 64-row batch tile, K not a multiple of the split: a short last part
    (64, 192, 128, 64, 4),  # more parts asked than K blocks: one
])
def test_fp8_linear_matches_its_twin_and_float64(dtype, m, n, k, block_n, split):
    """Poisoned output, fresh random operands: within the float32 accumulation bound of float64 (and of
    the torch twin, the same products summed in float32), every element; the clamped activations too.
    On a GPU the fp8 MMAs sum 32 products at a time with fewer bits first: their share is measured
    (benchmarks/quant_bench.py, RESULTS.md) and allowed here as 2^-13 of the sum of |products|."""
    from kvserve.kernels import triton_fp8_linear as f

    x, w, inv, s_x, s_w = _operands(m, n, k, dtype, seed=m * 1000 + n)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    got = f.fp8_linear(x.to(DEV), w.to(DEV), inv.to(DEV), s_x.to(DEV), s_w.to(DEV), block_n=block_n, split=split,
                       out=out)
    assert got.data_ptr() == out.data_ptr()
    got = got.cpu().double()
    want64 = _float64(x, w, inv, s_x, s_w)
    extra = 2.0**-13 if DEV == "cuda" else 0.0
    bound = _bound(x, w, inv, s_x, s_w, want64, extra)
    assert bool(((got - want64).abs() <= bound).all()), float(((got - want64).abs() / bound).max())
    twin = f.fp8_linear_reference(x, w, inv, s_x, s_w).double()
    assert bool(((got - twin).abs() <= 2 * bound).all())


def test_fp8_linear_leaves_its_counters_zero_and_repeats_bitwise():
    """A split launch twice (and the split-1 one) gives the same bits each time: the tile counters
    are back to zero after every launch (else the second launch's last part would never be summed)."""
    from kvserve.kernels import triton_fp8_linear as f

    x, w, inv, s_x, s_w = _operands(7, 256, 1024, torch.bfloat16, seed=3)
    args = (x.to(DEV), w.to(DEV), inv.to(DEV), s_x.to(DEV), s_w.to(DEV))
    first = f.fp8_linear(*args, split=4)
    assert int(f._tile_locks(torch.device(DEV)).abs().sum()) == 0
    assert torch.equal(f.fp8_linear(*args, split=4), first)
    one = f.fp8_linear(*args, split=1)
    assert (one.double() - first.double()).abs().max() <= 2.0**-7 * first.double().abs().max()


def test_fp8_linear_refuses_what_it_does_not_take():
    from kvserve.kernels import triton_fp8_linear as f

    x, w, inv, s_x, s_w = _operands(65, 64, 128, torch.bfloat16, seed=5)
    scales = (inv.to(DEV), s_x.to(DEV), s_w.to(DEV))
    with pytest.raises(ValueError, match=r"x \(65, 128\) and weight \(64, 128\) need 1-64 rows"):
        f.fp8_linear(x.to(DEV), w.to(DEV), *scales)
    with pytest.raises(ValueError, match=r"out \(2, 64\) torch.float16, expected \(2, 64\) torch.bfloat16"):
        f.fp8_linear(x[:2].to(DEV), w.to(DEV), *scales, out=torch.empty(2, 64, dtype=torch.float16, device=DEV))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8Linear's kernel dispatch is CUDA's")
def test_fp8linear_takes_the_kernel_for_decode_batches_on_sm90(monkeypatch):
    """On sm_90 FP8Linear gives 1-64 rows to the kernel and more to the quantiser + torch._scaled_mm;
    the two paths agree within their accumulation bounds, in a CUDA graph too."""
    from kvserve.kernels import triton_fp8_linear as f
    from kvserve.layers.quant_linear import FP8Linear

    if not f.available(torch.device("cuda")):
        pytest.skip("the kernel runs on sm_90")
    x, w, inv, s_x, s_w = _operands(64, 384, 512, torch.bfloat16, seed=9)
    layer = FP8Linear(512, 384, False, device="cuda")
    with torch.no_grad():
        layer.weight.copy_(w.cuda())
        layer.weight_scale.fill_(float(s_w))
        layer.input_scale.fill_(float(s_x))
    layer.finalize()
    calls = []
    real = f.fp8_linear
    monkeypatch.setattr(f, "fp8_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    want64 = _float64(x, w, inv, s_x, s_w)
    bound = _bound(x, w, inv, s_x, s_w, want64, 2.0**-13)
    for rows in (1, 64, 65):
        xr = torch.cat([x] * 2)[:rows].cuda()
        got = layer(xr).cpu().double()
        w64 = torch.cat([want64] * 2)[:rows]
        assert bool(((got - w64).abs() <= torch.cat([bound] * 2)[:rows]).all())
    assert calls == [1, 64]
    xg = x[:8].cuda()
    want = layer(xg).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(xg)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


_COMPILE = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.kernels import triton_fp8_linear as f

bm, split, even, imprecise = json.loads(sys.argv[1])
sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "inv_ptr": "*fp32", "sx_ptr": "*fp32", "sw_ptr": "*fp32",
       "y_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_split": "i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}
consts = dict(BLOCK_N=128, BLOCK_M=bm, BLOCK_K=128, SPLIT=split, EVEN=even, IMPRECISE=imprecise, PDL=True)
aligned = ("x_ptr", "w_ptr", "y_ptr", "part_ptr", "lock_ptr", "stride_xm", "stride_wn", "stride_ym")
attrs = {(list(sig).index(a),): [["tt.divisibility", 16]] for a in aligned}
k = triton.compile(ASTSource(fn=f._fp8_linear_kernel, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4 if bm <= 32 else 3})
ptx = k.asm["ptx"]
mmas = re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n(\\d+)k32\\.f32\\.e4m3\\.e4m3", ptx)
print(json.dumps({"wgmma": sorted(set(mmas)),
                  "mma_sync": ptx.count("mma.sync"), "gdc": [ptx.count("griddepcontrol.wait"),
                  ptx.count("griddepcontrol.launch_dependents")], "atom": ptx.count("atom.global"),
                  "shared": k.metadata.shared, "local": ptx.count("ld.local") + ptx.count("st.local")}))
"""


@pytest.mark.parametrize("variant", [(16, 1, True, 32), (32, 2, True, 32), (64, 3, False, 128)],
                         ids=["bm16-whole-tiles", "bm32-split", "bm64-split-masked-imprecise128"])
def test_fp8_linear_compiles_for_sm90(variant):
    """The kernel compiles to sm_90 with this machine's triton: fp8 warpgroup MMAs m64 x (batch tile) x
    k32, no mma.sync, no local memory, one griddepcontrol wait and launch, the tile counter's atomics
    only with a split, and its shared-memory stages within two programs an SM (228 KB). (A fresh
    process, outside the interpreter mode this test session runs under.)"""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(list(variant))], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["wgmma"] == [str(variant[0])] and got["mma_sync"] == 0 and got["local"] == 0
    assert got["gdc"] == [1, 1]
    assert (got["atom"] > 0) == (variant[1] > 1)
    assert 2 * got["shared"] <= 228 * 1024
