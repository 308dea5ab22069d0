"""Probe (2026-12-04, seventh session; kept in git history only): decode steps of the 27B MIXED export
with W4A16 tiles patched into ``default_tiles`` in this process, the variants alternated. At 17-32 rows:
128 x 32 x 4 warps, prefetch 2, x in two stages of one buffer (two CTA barriers a pair: "two") or in
three buffers (x_stages 3 = prefetch + 1, one barrier a pair: "three"). At 9-16 rows: the default of
4d70523 (128 x 16, prefetch 1, two buffers: "old16") or 64 x 16, prefetch 2, three buffers ("new16").

    OUT=dir python3 benchmarks/ab_x_stages_probe.py two,three,two,three 32 256
"""
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
    T = g.GluonTiles
    patch = {"two": (32, T(128, 32, 4, prefetch=2, x_smem=True, x_stages=2, pdl=True)),
             "three": (32, T(128, 32, 4, prefetch=2, x_smem=True, x_stages=3, pdl=True)),
             "old16": (16, T(128, 16, 4, prefetch=1, x_smem=True, x_stages=2, pdl=True)),
             "new16": (16, T(64, 16, 4, prefetch=2, x_smem=True, x_stages=3, pdl=True))}[name]

    def tiles(m: int, sm90: bool = False, patch: tuple = patch) -> g.GluonTiles:
        rows, t = patch
        return t if rows - 16 < m <= rows else default(m, sm90)

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
