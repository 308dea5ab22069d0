import sys; sys.path.insert(0, "/tmp/aot"); sys.path.insert(0, "/work/main")
from aot import compile_kernel, loop_counts
from kvserve.kernels import triton_w4a16 as K
sig = {"x_ptr": "*bf16", "w_ptr": "*i16", "s_ptr": "*i32", "g_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32",
       "M": "i32", "N": "i32", "K": "i32", "n_chunks": "i32", "tiles_n": "i32", "units": "i32", "programs": "i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32"}
div = [a for a in sig if a.endswith("_ptr") or a.startswith("stride")]
cfgs = [a.split(",") for a in sys.argv[1:]]
for bn, bm, ch, nw, ns, dec in [tuple(map(int, c)) for c in cfgs]:
    consts_extra = dict(EVEN_N=True, EVEN_K=True)
    sg = dict(sig)
    if dec == 2: sg["x_ptr"] = sg["y_ptr"] = "*fp16"
    consts = dict(BLOCK_N=bn, BLOCK_M=bm, CHUNKS=ch, DECODE=dec, **consts_extra)
    tag = f"r_{bn}_{bm}_{ch}_{nw}_{ns}_{dec}"
    k, sass = compile_kernel(K._w4a16_kernel, sg, consts, num_warps=nw, num_stages=ns, tag=tag, div16=div)
    from aot import all_loops
    loops = [(n, o) for n, o in all_loops(sass) if o["HMUL2"] or o["HGMMA"] or o["HMMA"]]
    n, ops = min(loops, key=lambda t: t[0] / max(1, t[1]["HGMMA"] + t[1]["HMMA"]))
    per = (ops["HGMMA"] + ops["HMMA"])
    # elements per loop trip from the MMA count: HGMMA m64nBMk16 covers 64x16 weights; HMMA m16n8k16 covers 16x16 (A=W) 
    elems = ops["HGMMA"] * 64 * 16 * (nw // 4) if ops["HGMMA"] else ops["HMMA"] * 16 * 16 * 32 * nw // 32 // nw
    spills = sass.count("STL"); print(tag, "spill-stores", spills, end=" "); print(tag, "loop", n, "mma", per, "lane-ops/elem %.2f" % (n * 32 * nw / elems), "smem", k.metadata.shared, ops.most_common(14))
