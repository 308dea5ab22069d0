"""What the decode attention kernel compiles to on Hopper, without a GPU: compiles
``_attention_kernel`` ahead of time for sm_90 (the installed Triton's compiler and its bundled
ptxas-free PTX stage) with the runtime's specializations (16-byte aligned pointers, strides
divisible by 16), and counts the shared-memory, copy, conversion and MMA instructions of its PTX.

    python benchmarks/ptx_stats.py --cache fp8_e4m3 [--group 2] [--split]

Found with it (2026-11-29, triton 3.9 on the dev machine): an fp8 V tile reaches the P @ V dot by
``ld.shared.b8`` byte loads (128 per thread per tile: V is the operand whose reduction axis, the
tokens, is not contiguous, and 8-bit ldmatrix cannot transpose), where bf16 V uses
``ldmatrix.trans``. Reading V as 32-bit words unpacked to fp16 in registers (commit 94b989d) or
storing V token-major (``benchmarks/probes``, commit c88a527) turns them into ldmatrix, and both
measured slower on the H200 (docs/GPU.md). The counts are static (both tile loops of the kernel)
and depend on the Triton version; time a change on the GPU before changing a default.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvserve.kernels import triton_attention as ta  # noqa: E402

PTX_OPS = r"\b(ld\.shared[\.\w]*|st\.shared[\.\w]*|ldmatrix[\.\w]*|cp\.async\.c[ag][\.\w]*|mma\.sync[\.\w]*|cvt\.rn\.f16x2\.e[45]m[23]x2|prmt\.b32|ex2\.approx[\.\w]*|shfl\.sync[\.\w]*)"


def compile_stats(cache: str, group: int, split: bool, warps: int | None = None,
                  stages: int | None = None) -> dict:
    fp8 = cache.startswith("fp8")
    head = 128
    block_m, tile_n, w, st, maxnreg = ta._tile_config(1, group, head, True, fp8, split)
    sig = {
        "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "q_ptr": "*bf16",
        "cache_ptr": "*u8" if fp8 else "*bf16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
        "query_start_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "qk_scale": "fp32",
        "num_seqs": "i32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
        "stride_cb": "i32", "stride_ckv": "i32", "stride_cs": "i32", "stride_ch": "i32", "stride_bt": "i32",
        "num_splits": "i32",
    }
    const = dict(G=group, BLOCK_M=block_m, BLOCK_Q=block_m // triton.next_power_of_2(group), HEAD=head,
                 HEAD_PAD=head, PAGE=16, TILE_N=tile_n, FP8=fp8, FP8_E5M2=cache == "fp8_e5m2", IEEE=False,
                 SPLIT=split)
    for k in const:
        sig[k] = "constexpr"
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr")] + ["stride_qh", "stride_oh", "stride_cb", "stride_ckv",
                                                          "stride_cs", "stride_ch"]
    src = ASTSource(fn=ta._attention_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps or w, "num_stages": stages or st,
                                                                      **({"maxnreg": maxnreg} if maxnreg else {})})
    counts = collections.Counter(re.findall(PTX_OPS, ck.asm["ptx"]))
    return {"cache": cache, "group": group, "split": split, "tile_n": tile_n,
            "num_warps": warps or w, "num_stages": stages or st, "shared_bytes": ck.metadata.shared,
            "ptx": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="fp8_e4m3", choices=["bf16", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--group", type=int, default=2, help="query heads per KV head")
    ap.add_argument("--split", action="store_true", help="the split-KV variant")
    a = ap.parse_args()
    r = compile_stats(a.cache, a.group, a.split)
    print(f"{r['cache']} G={r['group']} split={r['split']}: TILE_N {r['tile_n']}, "
          f"{r['num_warps']} warps, {r['num_stages']} stages, shared memory {r['shared_bytes']} B (triton {triton.__version__})")
    for op, n in r["ptx"].items():
        print(f"  {op:48s} {n}")


if __name__ == "__main__":
    main()
