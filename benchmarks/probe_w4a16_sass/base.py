import sys; sys.path.insert(0, "/tmp/aot"); sys.path.insert(0, "/work/main")
from aot import compile_kernel, loop_counts
from kvserve.kernels import triton_w4a16 as K
import re
sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "s2_ptr": "*fp32", "y_ptr": "*bf16",
       "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32", "stride_ys": "i32"}
for bm, bn, bk, nw in [(16, 64, 128, 4), (16, 128, 256, 4)]:
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=False, ROW_SCALES=True, GROUP=16)
    k, sass = compile_kernel(K._w4a16_kernel, sig, consts, num_warps=nw, num_stages=3, tag=f"base_{bm}_{bn}_{bk}")
    n, ops = loop_counts(sass)
    elems = bn * bk
    print(bm, bn, bk, "loop instrs", n, "per weight elem %.2f" % (n * 32 * nw / elems / 1), ops.most_common(14))
    print("  regs", k.n_regs, "spills", k.n_spills, "smem", k.metadata.shared)
