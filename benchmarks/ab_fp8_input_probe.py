"""Probe (2026-12-04, eighth session; kept in git history only): decode steps of the 27B MIXED export with the
FP8 out_proj / o_proj fed by the gated norm's and the output gate's own launches ("fused", ca59bb5) and by the
quantiser's launch after them ("chain", patched back in this process), the variants alternated.

    OUT=dir python3 benchmarks/ab_fp8_input_probe.py chain,fused,chain,fused 32 256
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hybrid_bench  # noqa: E402

from kvserve.kernels import triton_layers  # noqa: E402
from kvserve.layers.gdn import GatedDeltaNet  # noqa: E402
from kvserve.models.qwen3_next import GatedAttentionBlock  # noqa: E402

fused = GatedDeltaNet._norm_and_project, GatedAttentionBlock._gate_and_project
chain = (lambda self, out, z, dtype: self.out_proj(self.norm(out, z).reshape(out.shape[0], -1)),
         lambda self, out, gate, dtype: self.o_proj(triton_layers.sigmoid_gate(out, gate)))
order, conc, osl = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
out = os.environ["OUT"]
runs = []
for i, name in enumerate(order):
    GatedDeltaNet._norm_and_project, GatedAttentionBlock._gate_and_project = fused if name == "fused" else chain
    f = f"{out}/ab_fp8_input_{i}_{name}.json"
    hybrid_bench.main(["--quantization", "MIXED_PRECISION", "--kv", "", "--concurrency", "", "--peer-concurrency", "",
                       "--decode-concurrency", conc, "--osl", osl, "--repeats", "1", "--out", f])
    d = json.load(open(f))
    dec = d["kvserve_quantized"]["kv"]["auto"]["decode"]
    runs.append({"variant": name, "result": d})
    print(f"AB {i} {name}: {json.dumps(dec)[:400]}", flush=True)
    os.remove(f)
json.dump({"probe": "benchmarks/ab_fp8_input_probe.py", "order": order, "concurrency": conc, "osl": osl,
           "runs": runs}, open(f"{out}/ab_fp8_input.json", "w"), indent=1)
