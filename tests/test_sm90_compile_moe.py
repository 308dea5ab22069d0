"""The MoE kernels compile for the H100 / H200 (sm_90) without one (as tests/test_sm90_compile.py does
for attention: Triton's compiler and bundled ptxas, ahead of time, in a subprocess without
TRITON_INTERPRET). The interpreter checks their indexing; this checks what it cannot: that the
one-launch ``moe_align`` (histogram, sort, barriers) lowers to Hopper code at its decode and prefill
chunk sizes, that the grouped GEMM builds at its decode and prefill tiles, bf16 (also with the shared
expert as expert E) and fp8 (its fp8 products on fp8 operands), the router with and without the
shared expert's slot, and that all of them build with programmatic dependent launch, as the
engine launches them on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.kernels import triton_moe, triton_moe_align, triton_router

out = {}


def build(name, fn, const, types, warps, stages=1):
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        return
    ir = k.asm["ttgir"]
    dots = [l for l in ir.splitlines() if re.search(r"warp_group_dot |tt\.dot ", l)]
    out[name] = {"cubin_bytes": len(k.asm["cubin"]), "dots": len(dots),
                 "fp8_operands": any(re.search(r"<\d+x\d+xf8E4M3FN", l) for l in dots),
                 "barriers": k.asm["ptx"].count("bar.sync") + k.asm["ptx"].count("barrier.sync"),
                 "griddepcontrol": k.asm["ptx"].count("griddepcontrol")}


align = {"top_ptr": "*i64", "ids_ptr": "*i32", "block_expert_ptr": "*i32", "scratch_ptr": "*i32"}
for name, e, bm, chunk, warps in [("align-decode", 256, 16, 128, 1), ("align-prefill", 256, 64, 4096, 8)]:
    e_pad = triton.next_power_of_2(e + 1)
    build(name, triton_moe_align._moe_align_kernel,
          dict(E=e, E_PAD=e_pad, BLOCK_M=bm, CHUNK=chunk, NB=max(16, min(128, 8192 // e_pad)), PDL=True), align, warps)

gemm = {"ids_ptr": "*i32", "expert_ptr": "*i32", "rw_ptr": "*fp32", "as_ptr": "*fp32", "ws_ptr": "*fp32"}
for name, dtype, bm, t, shared in [
        ("gemm-decode-bf16", "bf16", 16, triton_moe.default_tiles(16, 1024, None), False),
        ("gemm-prefill-bf16", "bf16", 64, triton_moe.default_tiles(64, 1024, None), False),
        ("gemm-decode-bf16-shared", "bf16", 16, triton_moe.default_tiles(16, 1024, None), True),
        ("gemm-prefill-bf16-shared", "bf16", 64, triton_moe.default_tiles(64, 1024, None), True),
        ("gemm-decode-fp8", "fp8e4nv", 16, triton_moe.MoETiles(128, 128, 4, 3), False),
        ("gemm-prefill-fp8", "fp8e4nv", 64, triton_moe.MoETiles(64, 128, 8, 3), False)]:
    types = {**gemm, "x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "s_ptr": f"*{dtype}", "y_ptr": "*bf16"}
    build(name, triton_moe._grouped_matmul_kernel,
          dict(ROW_DIV=8, BLOCK_M=bm, BLOCK_N=t.block_n, BLOCK_K=t.block_k, IEEE=False, ROW_WEIGHT=True,
               SCALED=dtype != "bf16", SHARED=shared, PDL=True), types, t.num_warps, t.num_stages)

for name, shared in [("router", False), ("router-shared", True)]:
    build(name, triton_router._softmax_topk_kernel,
          dict(BLOCK_T=8, BLOCK_E=256, BLOCK_K=16 if shared else 8, RENORMALIZE=True, SHARED=shared, PDL=True),
          {"logits_ptr": "*bf16", "w_ptr": "*fp32", "idx_ptr": "*i64", "g_ptr": "*bf16"}, 4)
build("gated-add", triton_router._add_gated_shared_kernel, dict(BLOCK=1024, PDL=True),
      {"r_ptr": "*bf16", "s_ptr": "*bf16", "g_ptr": "*bf16"}, 4)
print("RESULT " + json.dumps(out))
"""

NAMES = ["align-decode", "align-prefill", "gemm-decode-bf16", "gemm-prefill-bf16", "gemm-decode-bf16-shared",
         "gemm-prefill-bf16-shared", "gemm-decode-fp8", "gemm-prefill-fp8", "router", "router-shared", "gated-add"]


@pytest.fixture(scope="module")
def compiled() -> dict:
    pytest.importorskip("triton.backends.nvidia")
    from triton.backends.nvidia import compiler as nv

    try:  # bundled with the wheel; absent on a Triton built without the NVIDIA backend's tools
        try:
            nv.get_ptxas(90)  # Triton >= 3.7 picks a ptxas per architecture
        except TypeError:
            nv.get_ptxas()
    except Exception as e:  # pragma: no cover (depends on the wheel)
        pytest.skip(f"no ptxas for sm_90: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, f"the compile script failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("name", NAMES)
def test_moe_kernel_compiles_for_sm90(compiled, name):
    got = compiled[name]
    assert "error" not in got, got.get("error")
    assert got["cubin_bytes"] > 5_000  # a real kernel's machine code, not an empty module


def test_moe_align_synchronises_its_phases(compiled):
    """The -1 fill, the scratch offsets and the scatter are ordered by CTA barriers (its own three and
    those of the histogram and the sort)."""
    assert compiled["align-decode"]["barriers"] >= 3 and compiled["align-prefill"]["barriers"] >= 3


def test_grouped_gemm_products_are_tensor_core_dots(compiled):
    """Each grouped GEMM is one MMA loop. The FP8 experts' 64-row prefill blocks take fp8 operands
    (Hopper's wgmma, e4m3 x e4m3 into fp32); their 16-row decode blocks go to mma.sync, which has no
    fp8 form on sm_90, so Triton widens the e4m3 values (exactly) to 16 bits there, as the attention
    decode tiles do (test_sm90_compile.py)."""
    for name in ("gemm-decode-bf16", "gemm-prefill-bf16", "gemm-decode-fp8", "gemm-prefill-fp8"):
        assert compiled[name]["dots"] >= 1, name
    assert compiled["gemm-prefill-fp8"]["fp8_operands"] and not compiled["gemm-decode-fp8"]["fp8_operands"]
    assert not compiled["gemm-prefill-bf16"]["fp8_operands"]


def test_moe_kernels_launch_with_pdl(compiled):
    """Programmatic dependent launch (kernels/pdl.py) in every kernel of the layer, as the engine launches them."""
    for name in NAMES:
        assert compiled[name]["griddepcontrol"] >= 2, name
