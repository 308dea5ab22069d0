"""Probe (2026-12-03, sixth session; kept in git history only): decode steps with the Triton kernels'
programmatic dependent launch on ("pdl") and off ("plain", ``kernels.pdl.enabled`` False), or on
with the delta rule's earlier tile ("pdl_v32"), patched in this process, the variants alternated;
on the 27B MIXED export or (``none``) the bf16 27B shape.

    OUT=dir python3 benchmarks/ab_pdl_probe.py plain,pdl,plain,pdl 32 256 [MIXED_PRECISION|none]
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hybrid_bench  # noqa: E402

from kvserve.kernels import pdl, triton_gdn  # noqa: E402

tile = triton_gdn.delta_rule_tile

order, conc, osl = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
quant = sys.argv[4] if len(sys.argv) > 4 else "MIXED_PRECISION"
out = os.environ["OUT"]
runs = []
for i, name in enumerate(order):
    pdl.enabled = name != "plain"  # "pdl_v32": PDL with the delta rule's earlier tile (32 V columns, 4 warps)
    triton_gdn.delta_rule_tile = (lambda *a: (32, 4)) if name == "pdl_v32" else tile
    f = f"{out}/ab_{quant}_{i}_{name}.json"
    args = ["--kv", "" if quant != "none" else "bfloat16", "--concurrency", "", "--peer-concurrency", "",
            "--decode-concurrency", conc, "--osl", osl, "--repeats", "1", "--out", f]
    hybrid_bench.main((["--quantization", quant] if quant != "none" else []) + args)
    d = json.load(open(f))
    dec = d["kvserve_quantized"]["kv"]["auto"]["decode"] if quant != "none" else d["kvserve"]["bfloat16"]["decode"]
    runs.append({"variant": name, "result": d})
    print(f"AB {quant} {i} {name}: {json.dumps(dec)[:400]}", flush=True)
    os.remove(f)
json.dump({"probe": "benchmarks/ab_pdl_probe.py", "order": order, "concurrency": conc, "osl": osl, "quant": quant,
           "runs": runs}, open(f"{out}/ab_pdl_{quant}.json", "w"), indent=1)
