import sys; sys.path.insert(0, "/tmp/aot"); sys.path.insert(0, "/work/main")
from aot import compile_kernel, all_loops
from kvserve.kernels import triton_w4a16 as K
sig = {"x_ptr": "*bf16", "w_ptr": "*i16", "s_ptr": "*i32", "g_ptr": "*fp32", "y_ptr": "*bf16", "ids_ptr": "*i32", "expert_ptr": "*i32",
       "N": "i32", "K": "i32", "n_chunks": "i32", "num_experts": "i32",
       "stride_xm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_ge": "i32", "stride_ym": "i32"}
div = [a for a in sig if a.endswith("_ptr") or a.startswith("stride") or a in ("K", "N")]
for bm, nw in ((16, 4), (64, 8)):
    k, sass = compile_kernel(K._w4a16_grouped_kernel, sig, dict(ROW_DIV=8, BLOCK_N=128, BLOCK_M=bm, CHUNKS=2, DECODE=1, EVEN_N=True, EVEN_K=True),
                             num_warps=nw, num_stages=3, tag=f"grp{bm}", div16=div)
    loops = sorted(all_loops(sass), key=lambda x: -x[1]["LDGSTS"])
    n, ops = loops[0]
    print(bm, "smem", k.metadata.shared, "spills", sass.count("STL"), "main loop", n, "HGMMA", ops["HGMMA"], "HMUL2", ops["HMUL2"], "LDGSTS", ops["LDGSTS"])
