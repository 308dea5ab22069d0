import sys; sys.path.insert(0, "/tmp/aot")
from aot import compile_kernel, all_loops
import docorder
sig = {"x_ptr": "*bf16", "w_ptr": "*i16", "s_ptr": "*i32", "g_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "n_chunks": "i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32"}
div = [a for a in sig if a.endswith("_ptr") or a.startswith("stride")]
k, sass = compile_kernel(docorder.kern, sig, dict(BLOCK_N=128, BLOCK_M=16, CHUNKS=2), num_warps=4, num_stages=3, tag="doc", div16=div)
for n, ops in all_loops(sass):
    print("loop", n, "HGMMA", ops["HGMMA"], "LDGSTS", ops["LDGSTS"], "lane-ops/elem %.2f" % (n * 128 / (ops["HGMMA"] * 64 * 16) if ops["HGMMA"] else 0), ops.most_common(10))
