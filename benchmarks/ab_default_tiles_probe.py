"""Probe (2026-12-03, fifth session; kept in git history only): the 27B MIXED export's decode steps
with the Gluon W4A16 default tiles as they are ("new") and as before cd0ac05 ("old": no eviction
policy, no PDL past 32 rows), ``default_tiles`` patched in this process, the variants alternated.

    OUT=dir python3 benchmarks/ab_default_tiles_probe.py old,new,old,new 1,8,16 128   # order, decode c, OSL
"""
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hybrid_bench  # noqa: E402

from kvserve.kernels import gluon_w4a16 as g  # noqa: E402

orig = g.default_tiles
variants = {"new": lambda m: {}, "old": lambda m: {"w_eviction_policy": "", "pdl": m <= 32}}
order, conc, osl = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
out = os.environ["OUT"]
for i, name in enumerate(order):
    kw = variants[name]
    g.default_tiles = (lambda m, sm90=False, kw=kw: dataclasses.replace(orig(m, sm90), **kw(m)))
    hybrid_bench.main(["--quantization", "MIXED_PRECISION", "--kv", "", "--concurrency", "", "--peer-concurrency", "",
                       "--decode-concurrency", conc, "--osl", osl, "--repeats", "1",
                       "--out", f"{out}/ab_{i}_{name}.json"])
    d = json.load(open(f"{out}/ab_{i}_{name}.json"))
    steps = ", ".join(f"c{q['concurrency']} {q['step_ms']:.3f} ms" for q in d["kvserve_quantized"]["kv"]["auto"]["decode"])
    print(f"AB {i} {name}: {steps}", flush=True)
