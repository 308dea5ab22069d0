import sys; sys.path.insert(0, "/tmp/aot"); sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/benchmarks")
from aot import compile_kernel, all_loops
from kvserve.kernels import triton_w4a16 as K
import quant_bench as qb
sig = {"x_ptr": "*bf16", "w_ptr": "*i16", "s_ptr": "*i32", "g_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32",
       "M": "i32", "N": "i32", "K": "i32", "n_chunks": "i32", "tiles_n": "i32", "units": "i32", "programs": "i32",
       "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32"}
div = [a for a in sig if a.endswith("_ptr") or a.startswith("stride") or a in ("K", "N")]
seen = set()
for m in (1, 64, 256):
    for t in qb.sweep_tiles(m) + [K.default_tiles(m, 17408, 5120)]:
        key = (t.block_n, t.block_m, t.chunks, t.num_warps, t.num_stages)
        if key in seen: continue
        seen.add(key)
        try:
            k, sass = compile_kernel(K._w4a16_kernel, sig, dict(BLOCK_N=t.block_n, BLOCK_M=t.block_m, CHUNKS=t.chunks, DECODE=1, EVEN_N=True, EVEN_K=True),
                                     num_warps=t.num_warps, num_stages=t.num_stages, tag="sw", div16=div)
            loops = sorted(all_loops(sass), key=lambda x: -x[0])
            main = [l for l in loops if l[1]["LDGSTS"] and (l[1]["HGMMA"] or l[1]["HMMA"])]
            n, ops = (main[0] if main else (0, {}))
            mma = ops.get("HGMMA", 0) if ops else 0
            print(key, "smem", k.metadata.shared, "spills", sass.count("STL"), "main loop", n, "HGMMA", mma, "HMMA", ops.get("HMMA", 0) if ops else 0, flush=True)
        except Exception as e:
            print(key, "ERROR", type(e).__name__, str(e)[:200], flush=True)
