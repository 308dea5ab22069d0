"""Probe: W4A16 timing spread, occupancy and (under ncu) stall reasons on the H200."""
import sys, os, time, json
import torch, triton, triton.testing
sys.path.insert(0, os.getcwd())
from kvserve.quant.nvfp4 import quantize_nvfp4, dequantize_nvfp4
from kvserve.kernels import triton_w4a16 as K
from kvserve.kernels.triton_w4a16 import W4A16Tiles as T, pack_w4a16, w4a16_matmul
NCU = "--ncu" in sys.argv
torch.manual_seed(0)
shapes = {"gate_or_up": (17408, 5120), "down": (5120, 17408)}
cfgs = [T(128,16,2,4,3), T(128,16,2,4,3,0), T(128,16,1,4,4), T(128,16,4,4,3), T(128,16,2,4,3,1), T(128,16,2,4,3,4), T(64,16,2,4,3), T(256,16,2,8,3), T(128,16,2,8,3)]
if NCU:
    cfgs = [T(128,16,2,4,3), T(128,16,2,4,3,0)]
res = []
for name, (n, k) in shapes.items():
    w = (torch.randn(n, k) * 0.02).bfloat16()
    p, b, s2 = (t.cuda() for t in quantize_nvfp4(w))
    wd = dequantize_nvfp4(p, b, s2, torch.bfloat16)
    wq = pack_w4a16(p, b, s2)
    for m in ([1] if NCU else [1, 16]):
        x = torch.randn(m, k, device="cuda").bfloat16()
        want = torch.nn.functional.linear(x, wd)
        if NCU:
            for t in cfgs:
                for _ in range(2): w4a16_matmul(x, wq, tiles=t)
            torch.cuda.synchronize(); continue
        dense = [triton.testing.do_bench(lambda: torch.nn.functional.linear(x, wd), warmup=10, rep=40) for _ in range(3)]
        print(f"{name} m{m} cuBLAS us", [round(d*1e3,1) for d in dense], flush=True)
        for t in cfgs:
            y = w4a16_matmul(x, wq, tiles=t)
            err = float((y.float()-want.float()).abs().max()/want.float().abs().max())
            ts = [triton.testing.do_bench(lambda: w4a16_matmul(x, wq, tiles=t), warmup=10, rep=40) for _ in range(3)]
            # graph of 20 launches, no L2 flush (steady state, weight 4-bit > L2 only for gate/up 44MB? both > 50MB L2)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20): w4a16_matmul(x, wq, tiles=t)
            g.replay(); torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record(); [g.replay() for _ in range(5)]; e1.record(); torch.cuda.synchronize()
            gus = e0.elapsed_time(e1) / 100 * 1e3
            y2 = w4a16_matmul(x, wq, tiles=t); err2 = float((y2.float()-want.float()).abs().max()/want.float().abs().max())
            occ = {kk: v for kk, v in K._occupancy.items()}
            print(f"  {t} err {err:.1e}/{err2:.1e} do_bench us {[round(v*1e3,1) for v in ts]} graph {gus:.1f}", flush=True)
            res.append(dict(shape=name, m=m, tiles=vars(t), us=[v*1e3 for v in ts], graph_us=gus, err=err, dense_us=[d*1e3 for d in dense]))
print("occupancy", {str(k[2:]): v for k, v in K._occupancy.items()})
if not NCU:
    json.dump(res, open(os.environ.get("OUT", "/tmp") + "/p2.json", "w"), indent=1)
