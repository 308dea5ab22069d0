"""Probe (2026-12-04, seventh session; kept in git history only): decode steps of the 27B MIXED export
with the 32-row W4A16 default tile as it was (x in two stages of one buffer, two CTA barriers a pair:
"two") and with x in three buffers (x_stages 3 = prefetch + 1, one barrier a pair: "three"), patched
into ``default_tiles`` in this process, the variants alternated.

    OUT=dir python3 benchmarks/ab_x_stages_probe.py two,three,two,three 32 256
"""
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hybrid_bench  # noqa: E402

from kvserve.kernels import gluon_w4a16 as g  # noqa: E402

default = g.default_tiles
order, conc, osl = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
out = os.environ["OUT"]
runs = []
for i, name in enumerate(order):
    stages = 3 if name == "three" else 2

    def tiles(m: int, sm90: bool = False, stages: int = stages) -> g.GluonTiles:
        t = default(m, sm90)
        return dataclasses.replace(t, x_stages=stages) if 16 < m <= 32 and t.prefetch == 2 else t

    g.default_tiles = tiles
    f = f"{out}/ab_x_stages_{i}_{name}.json"
    hybrid_bench.main(["--quantization", "MIXED_PRECISION", "--kv", "", "--concurrency", "", "--peer-concurrency", "",
                       "--decode-concurrency", conc, "--osl", osl, "--repeats", "1", "--out", f])
    d = json.load(open(f))
    dec = d["kvserve_quantized"]["kv"]["auto"]["decode"]
    runs.append({"variant": name, "result": d})
    print(f"AB {i} {name}: {json.dumps(dec)[:400]}", flush=True)
    os.remove(f)
json.dump({"probe": "benchmarks/ab_x_stages_probe.py", "order": order, "concurrency": conc, "osl": osl,
           "runs": runs}, open(f"{out}/ab_x_stages.json", "w"), indent=1)
