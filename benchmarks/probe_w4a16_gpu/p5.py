"""Probe: what a W4A16 launch's time is made of (H200): the kernel as is vs with its decode left out
(the int16 words bitcast to bf16: wrong values, same loads and MMAs), CUDA-graph times over rotating
weight copies; under ncu (--ncu) the stall reasons of the default m=1 and m=32 launches."""
import importlib.util, os, sys
import torch
sys.path.insert(0, os.getcwd())
from kvserve.quant.nvfp4 import quantize_nvfp4
NCU = "--ncu" in sys.argv
src = open("kvserve/kernels/triton_w4a16.py").read()
line = "w0, w1, w2, w3 = _decode_ptx(w, sc, _SCALES_BF16, _DECODE_BF16, tl.bfloat16, BLOCK_N)"
assert src.count(line) == 1
variants = {"as_is": src, "no_decode": src.replace(line, "wb = w.to(tl.bfloat16, bitcast=True)\n            w0, w1, w2, w3 = wb, wb, wb, wb")}
mods = {}
for name, text in variants.items():
    path = f"/tmp/w4v_{name}.py"
    open(path, "w").write(text)
    spec = importlib.util.spec_from_file_location(f"w4v_{name}", path)
    mods[name] = sys.modules[f"w4v_{name}"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(mods[name])

def gtime(fns):
    for f in fns: f()
    torch.cuda.synchronize()
    calls = -(-20 // len(fns)) * len(fns)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls): fns[i % len(fns)]()
    g.replay(); ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) / calls * 1e3)
    return sorted(ts)[2]

for shape, (n, k) in {"gate_or_up": (17408, 5120), "down": (5120, 17408)}.items():
    p, b, s2 = (t.cuda() for t in quantize_nvfp4((torch.randn(n, k) * 0.02).bfloat16()))
    wd = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    for m in ([1, 32] if not NCU else [1, 32]):
        x = torch.randn(m, k, device="cuda").bfloat16(); y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        if NCU:
            if shape == "down": break
            wq = mods["as_is"].pack_w4a16(p, b, s2)
            for _ in range(2): mods["as_is"].w4a16_matmul(x, wq, out=y)
            torch.cuda.synchronize(); continue
        row = {"cuBLAS": gtime([lambda c=c: torch.matmul(x, c.t(), out=y) for c in [wd] + [wd.clone() for _ in range(2)]])}
        for name, mod in mods.items():
            wqs = [mod.pack_w4a16(p, b, s2) for _ in range(4)]
            t = mod.default_tiles(m, n, k)
            row[name] = gtime([lambda c=c: mod.w4a16_matmul(x, c, out=y) for c in wqs])
        print(shape, "m", m, {kk: round(v, 1) for kk, v in row.items()}, flush=True)
