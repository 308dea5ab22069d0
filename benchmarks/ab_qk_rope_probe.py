"""Probe (2026-12-04, seventh session; kept in git history only): decode steps of the 27B MIXED export
with the attention's q / k norms and rotation as one Triton kernel ("one", ``triton_layers.qk_norm_rope``)
and as the four launches before it ("four": two per-head RMSNorms, two rotaries; patched in this
process), the variants alternated.

    OUT=dir python3 benchmarks/ab_qk_rope_probe.py four,one,four,one 32 256
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hybrid_bench  # noqa: E402

from kvserve.layers.rotary import RotaryEmbedding  # noqa: E402

fused = RotaryEmbedding.norm_and_rotate
order, conc, osl = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
out = os.environ["OUT"]
runs = []
for i, name in enumerate(order):
    RotaryEmbedding.norm_and_rotate = fused if name == "one" else (
        lambda self, positions, q, k, q_norm, k_norm: self(positions, q_norm(q), k_norm(k)))
    f = f"{out}/ab_qk_rope_{i}_{name}.json"
    hybrid_bench.main(["--quantization", "MIXED_PRECISION", "--kv", "", "--concurrency", "", "--peer-concurrency", "",
                       "--decode-concurrency", conc, "--osl", osl, "--repeats", "1", "--out", f])
    d = json.load(open(f))
    dec = d["kvserve_quantized"]["kv"]["auto"]["decode"]
    runs.append({"variant": name, "result": d})
    print(f"AB {i} {name}: {json.dumps(dec)[:400]}", flush=True)
    os.remove(f)
json.dump({"probe": "benchmarks/ab_qk_rope_probe.py", "order": order, "concurrency": conc, "osl": osl,
           "runs": runs}, open(f"{out}/ab_qk_rope.json", "w"), indent=1)
