"""Probe (2026-12-04, seventh session; kept in git history only): decode steps with the FP8 layers'
decode GEMM ("triton", kernels/triton_fp8_linear.py) and with the quantiser + torch._scaled_mm
("cublas", ``triton_fp8_linear.enabled`` False in this process), the variants alternated, on the 27B
MIXED export.

    OUT=dir python3 benchmarks/ab_fp8_probe.py cublas,triton,cublas,triton 32 256
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hybrid_bench  # noqa: E402

from kvserve.kernels import triton_fp8_linear  # noqa: E402

order, conc, osl = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
out = os.environ["OUT"]
runs = []
for i, name in enumerate(order):
    triton_fp8_linear.enabled = name == "triton"
    f = f"{out}/ab_fp8_{i}_{name}.json"
    hybrid_bench.main(["--quantization", "MIXED_PRECISION", "--kv", "", "--concurrency", "", "--peer-concurrency", "",
                       "--decode-concurrency", conc, "--osl", osl, "--repeats", "1", "--out", f])
    d = json.load(open(f))
    dec = d["kvserve_quantized"]["kv"]["auto"]["decode"]
    runs.append({"variant": name, "result": d})
    print(f"AB {i} {name}: {json.dumps(dec)[:400]}", flush=True)
    os.remove(f)
json.dump({"probe": "benchmarks/ab_fp8_probe.py", "order": order, "concurrency": conc, "osl": osl, "runs": runs},
          open(f"{out}/ab_fp8.json", "w"), indent=1)
