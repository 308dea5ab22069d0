"""Probe (history only): time the TMA variant beside the kernel as it is (four dots, one_dot) on
the 27B MLP shapes, CUDA-graph replays over rotating weights (quant_bench's timing); JSON to $OUT.

    python3 benchmarks/probe_w4a16_tma/run.py      # H200, ~1-2 min
"""
import json, os, sys
import torch
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here); sys.path.insert(0, os.path.join(here, "..")); sys.path.insert(0, os.path.join(here, "..", ".."))
import quant_bench as qb  # noqa: E402
from make_variant import variant  # noqa: E402
from kvserve.kernels import triton_w4a16 as K  # noqa: E402
from kvserve.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4  # noqa: E402

V = variant()
rows = []
for name, (n, k) in {"gate_or_up": (17408, 5120), "down": (5120, 17408)}.items():
    p, b, s2 = (t.to(qb.DEV) for t in quantize_nvfp4((torch.randn(n, k) * 0.02).to(qb.DTYPE)))
    wd = dequantize_nvfp4(p, b, s2, qb.DTYPE)
    wqs = [K.pack_w4a16(p, b, s2) for _ in range(4)]
    for m in (1, 16, 32, 64):
        x = torch.randn(m, k, device=qb.DEV).to(qb.DTYPE)
        y = torch.empty(m, n, device=qb.DEV, dtype=qb.DTYPE)
        want = torch.nn.functional.linear(x, wd).float()
        row = {"shape": name, "m": m, "cuBLAS_us": 1e3 * qb._time_ms([lambda c=c: torch.matmul(x, c.t(), out=y) for c in [wd, wd.clone(), wd.clone()]])}
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        for label, mod, t in [("default", K, K.default_tiles(m, n, k)), ("one_dot", K, K.W4A16Tiles(128, bm, 2 if bm == 16 else 1, 4, 3, one_dot=True)),
                              ("tma_2ch", V, V.W4A16Tiles(128, bm, 2, 4, 3, one_dot=True)), ("tma_1ch_4st", V, V.W4A16Tiles(128, bm, 1, 4, 4, one_dot=True)),
                              ("tma_2ch_4st", V, V.W4A16Tiles(128, bm, 2, 4, 4, one_dot=True))]:
            try:
                err = float((mod.w4a16_matmul(x, wqs[0], tiles=t).float() - want).abs().max() / want.abs().max())
                row[label + "_us"] = 1e3 * qb._time_ms([lambda c=c: mod.w4a16_matmul(x, c, out=y, tiles=t) for c in wqs])
                row[label + "_err"] = err
            except Exception as e:  # noqa: BLE001
                row[label + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "tma_probe.json"), "w"), indent=1)
