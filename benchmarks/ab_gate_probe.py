"""Probe (2026-12-04, seventh session; kept in git history only): decode steps with the gated
attention's output gate in one Triton kernel ("gate", ``triton_layers.sigmoid_gate``) and as torch's
copy, sigmoid and product ("torch", patched in this process), the variants alternated, on the 27B
MIXED export.

    OUT=dir python3 benchmarks/ab_gate_probe.py torch,gate,torch,gate 32 256
"""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hybrid_bench  # noqa: E402

from kvserve.kernels import triton_layers  # noqa: E402

fused = triton_layers.sigmoid_gate


def torch_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """What GatedAttentionBlock.forward runs unfused: out * sigmoid(gate) with the gate copied to out's shape."""
    return out * torch.sigmoid(gate.reshape(out.shape))


order, conc, osl = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
out = os.environ["OUT"]
runs = []
for i, name in enumerate(order):
    triton_layers.sigmoid_gate = fused if name == "gate" else torch_gate
    f = f"{out}/ab_gate_{i}_{name}.json"
    hybrid_bench.main(["--quantization", "MIXED_PRECISION", "--kv", "", "--concurrency", "", "--peer-concurrency", "",
                       "--decode-concurrency", conc, "--osl", osl, "--repeats", "1", "--out", f])
    d = json.load(open(f))
    dec = d["kvserve_quantized"]["kv"]["auto"]["decode"]
    runs.append({"variant": name, "result": d})
    print(f"AB {i} {name}: {json.dumps(dec)[:400]}", flush=True)
    os.remove(f)
json.dump({"probe": "benchmarks/ab_gate_probe.py", "order": order, "concurrency": conc, "osl": osl, "runs": runs},
          open(f"{out}/ab_gate.json", "w"), indent=1)
