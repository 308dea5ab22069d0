"""The attention kernel compiles for the H100 / H200 (sm_90) without one: Triton's own compiler and
bundled ptxas build the cubin ahead of time on this CPU machine. This covers what the interpreter
cannot: that the quantized-query read of e4m3 pages (fp8 Q K^T and P V, V not K-major) lowers to
Hopper code at all, for decode (mma.sync tiles) and prefill (wgmma tiles, fp8 operands: the fp8
tensor cores the path exists for), head 128 and 256, P V in fp8 and in fp16, and that the
dequantizing read and bf16 pages still do.

The compile runs in a subprocess without TRITON_INTERPRET (the test session sets it: the kernels are
then interpreter objects, not compilable ones).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (name, max_query_len, head, group, fp8 pages, quantized query, P V in fp8)
VARIANTS = [
    ("decode-h128-fp8q", 1, 128, 4, True, True, True),
    ("decode-h256-fp8q-pv16", 1, 256, 6, True, True, False),
    ("prefill-h128-fp8q", 4096, 128, 4, True, True, True),
    ("prefill-h256-fp8q", 4096, 256, 6, True, True, True),
    ("prefill-h128-fp8q-pv16", 4096, 128, 4, True, True, False),
    ("prefill-h256-fp8-dequant", 4096, 256, 6, True, False, False),
    ("decode-h128-bf16", 1, 128, 4, False, False, False),
]

SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.kernels import triton_attention as ta

POINTERS = {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "q_ptr": "*bf16",
            "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32", "order_ptr": "*i32",
            "k_scale_ptr": "*fp32",
            "v_scale_ptr": "*fp32", "q_scale_ptr": "*fp32", "inv_q_scale_ptr": "*fp32"}
out = {}


def build(fn, const, cache, warps, stages, maxnreg):
    # fn for sm_90 with the constexprs const, the cache pointer's type and what a launch tells the
    # compiler (pointers and the cache's / heads' strides are multiples of 16)
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else POINTERS.get(n) or ("fp32" if n == "qk_scale" else "i32") for n in names}
    sig["cache_ptr"] = cache
    div16 = [n for n in names if n.endswith("_ptr") or n in ("stride_qh", "stride_oh", "stride_cb", "stride_ckv",
                                                             "stride_cs", "stride_ch")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


for name, qlen, head, g, fp8, qfp8, pv_fp8 in json.loads(sys.argv[1]):
    bm, tn, warps, stages, maxnreg = ta._tile_config(qlen, g, head, True, fp8, False, False)
    f16 = qfp8 and bm < ta.FP16_MMA_BELOW_ROWS  # decode tiles: fp16 MMAs on the e4m3 values
    # the constexprs paged_attention launches with for this shape (BLOCK_Q = BLOCK_M // G, as it computes)
    const = dict(G=g, BLOCK_M=bm, BLOCK_Q=bm // g, HEAD=head, HEAD_PAD=head, PAGE=16,
                 TILE_N=tn, FP8=fp8, IEEE=False, SPLIT=False, PDL=False, QUERY_FP8=qfp8,
                 P_SHIFT=8 if qfp8 else 0, PV_FP8=pv_fp8 and not f16, HEAVY_FIRST=True, FP16_MMA=f16,
                 DECODE=qlen == 1, ORDERED=qlen == 1, HK=8)
    try:  # fp8 pages are read through an e4m3 view
        k = build(ta._attention_kernel, const, "*fp8e4nv" if fp8 else "*bf16", warps, stages, maxnreg)
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        continue
    if name == "decode-h128-fp8q":
        unpaired_decode = k
    ir = k.asm["ttgir"]
    dots = [l for l in ir.splitlines() if re.search(r"warp_group_dot |tt\.dot ", l)]
    fp8 = re.compile(r"(: tensor|\* !?\S*)<\d+x\d+xf8E4M3FN")  # an MMA operand of e4m3 values
    out[name] = {"cubin_bytes": len(k.asm["cubin"]), "wgmma": any("warp_group_dot" in l for l in dots),
                 "fp8_operands": any(fp8.search(l) for l in dots),
                 "async_copies": ir.count("async_copy_global_to_local"),
                 # e4m3 register tensors stored to shared memory (the query once; an MMA operand
                 # staged from registers otherwise)
                 "fp8_staged": len(re.findall(r"ttg\.local_alloc %\S+ : \(tensor<\d+x\d+xf8E4M3FN", ir))}

def byte_loads(kernel):  # shared-memory loads of single bytes in the SASS (None without a disassembler)
    try:
        from triton.tools.disasm import get_sass
        return get_sass(kernel.asm["cubin"]).count("LDS.U8")
    except Exception:
        return None


out["decode-h128-fp8q"]["byte_loads"] = byte_loads(unpaired_decode)
for name, head, g, qfp8, split, e5m2 in json.loads(sys.argv[2]):
    bm, tn, warps, stages, maxnreg = ta._tile_config(1, g, head, True, True, split, False)
    const = dict(G=g, BLOCK_M=bm, BLOCK_Q=bm // g, HEAD=head, HEAD_PAD=head, PAGE=16, TILE_N=tn, SPLIT=split,
                 PDL=False, QUERY_FP8=qfp8, P_SHIFT=8 if qfp8 else 0, ORDERED=True, HK=8, ASM=True, E5M2=e5m2)
    try:  # the pages as 16-bit words
        k = build(ta._paired_decode_kernel, const, "*u16", warps, stages, maxnreg)
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        continue
    ir = k.asm["ttgir"]
    out[name] = {"cubin_bytes": len(k.asm["cubin"]), "wgmma": "warp_group_dot" in ir,
                 "async_copies": ir.count("async_copy_global_to_local"), "byte_loads": byte_loads(k),
                 "cvt_e4m3": k.asm["ptx"].count("cvt.rn.f16x2.e4m3x2"), "cvt_e5m2": k.asm["ptx"].count("cvt.rn.f16x2.e5m2x2")}
print("RESULT " + json.dumps(out))
"""

# (name, head, group, quantized query, split-KV, e5m2 pages): the paired decode of fp8 pages
PAIRED = [
    ("paired-h128-fp8q", 128, 4, True, False, False),
    ("paired-h128-fp8q-split", 128, 4, True, True, False),
    ("paired-h128-e4m3-dequant", 128, 4, False, False, False),
    ("paired-h256-fp8q", 256, 6, True, False, False),
    ("paired-h64-e5m2-dequant-split", 64, 1, False, True, True),
]


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
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9+ warns when unset; 1 is what the kernels run with
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(VARIANTS), json.dumps(PAIRED)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, f"the compile script failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_attention_compiles_for_sm90(compiled, variant):
    name, qlen, *_ = variant
    got = compiled[name]
    assert "error" not in got, got.get("error")
    assert got["cubin_bytes"] > 10_000  # a real kernel's machine code, not an empty module
    assert got["wgmma"] == (qlen > 1), "prefill tiles (>= 64 rows) use Hopper's wgmma, decode's 16 rows mma.sync"
    assert got["async_copies"] > 0, "the page loads are not pipelined (cp.async into shared memory)"


def test_quantized_query_prefill_runs_on_fp8_tensor_cores(compiled):
    """The point of the path: the prefill's products take fp8 operands (wgmma e4m3), while the
    dequantizing read converts its pages first and multiplies in 16 bits."""
    assert compiled["prefill-h128-fp8q"]["fp8_operands"] and compiled["prefill-h256-fp8q"]["fp8_operands"]
    assert not compiled["prefill-h256-fp8-dequant"]["fp8_operands"]
    assert not compiled["decode-h128-bf16"]["fp8_operands"]


def test_fp8_pages_reach_the_mma_by_async_copy(compiled):
    """The prefill tiles' e4m3 K goes by cp.async straight into the fp8 MMA's shared layout: the
    only e4m3 tensor staged from registers is the query (read as bytes and bitcast, K took a
    register round trip into a second shared buffer every tile)."""
    assert compiled["prefill-h128-fp8q-pv16"]["fp8_staged"] == 1
    assert compiled["prefill-h256-fp8q"]["fp8_staged"] == 3  # + V of the fp8 P V, in both loops (staged transposed)


@pytest.mark.parametrize("variant", PAIRED, ids=[v[0] for v in PAIRED])
def test_paired_decode_compiles_for_sm90(compiled, variant):
    """The paired decode of fp8 pages (its inline PTX runs on a GPU only: the interpreter takes
    Triton's casts) builds for Hopper: mma.sync tiles, pipelined page loads, the paired conversion
    of the pages' format in the PTX."""
    name, *_, e5m2 = variant
    got = compiled[name]
    assert "error" not in got, got.get("error")
    assert got["cubin_bytes"] > 10_000 and not got["wgmma"] and got["async_copies"] > 0
    assert got["cvt_e5m2" if e5m2 else "cvt_e4m3"] > 0 and got["cvt_e4m3" if e5m2 else "cvt_e5m2"] == 0


def test_paired_decode_reads_no_single_bytes(compiled):
    """The point of the paired decode: its page tiles reach the fp16 MMAs' registers in 16-bit words
    (ldmatrix), where the unpaired decode of e4m3 pages gathers them from shared memory a byte at a
    time."""
    unpaired = compiled["decode-h128-fp8q"]["byte_loads"]
    if unpaired is None:
        pytest.skip("no SASS disassembler (cuobjdump) with this Triton")
    assert unpaired >= 128  # 256 a thread per 128-key tile at Triton 3.9
    for name, *_ in PAIRED:
        assert compiled[name]["byte_loads"] == 0, name
