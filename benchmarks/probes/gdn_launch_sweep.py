"""Probe (issue 14, H200): sweep the chunk-parallel GDN rule's launch configs (warps, stages, V block
per kernel, one kernel at a time, the best kept) at the 27B heads; $OUT/tune.json. Run from the
repository root: OUT=dir python3 benchmarks/probes/gdn_launch_sweep.py"""
import json, os, sys, time, itertools, dataclasses
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.getcwd() + "/benchmarks")
import gdn_bench as G
from kvserve.kernels import triton_gdn_chunk as C
from kvserve.kernels import gdn_reference as ref
H, HV, K, V = 16, 48, 128, 128
out = {}
def setup(n, L):
    q, k, v, a, b, A_log, dt_bias, pool = G._inputs(n, L, H, HV, K, V, seed=1)
    T = n * L
    qsl = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
    slots = torch.arange(1, n + 1, dtype=torch.int32, device="cuda")
    has = torch.ones(n, dtype=torch.int32, device="cuda")
    plan = C.plan_chunks([L] * n, torch.device("cuda"))
    return lambda: C.chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, pool, qsl, slots, has, plan)
cases = {c: setup(*c) for c in [(1, 1024), (4, 1024), (16, 1024), (1, 8192)]}
base = dataclasses.replace(C.LAUNCH)
space = {
    "state": [dict(state_warps=w, state_stages=s, state_block_v=bv) for w in (2, 4, 8) for s in (None, 1, 2, 4) for bv in (16, 32, 64)],
    "output": [dict(output_warps=w, output_stages=s, output_block_v=bv) for w in (4, 8) for s in (None, 2) for bv in (32, 64, 128)],
    "prep": [dict(prep_warps=w) for w in (1, 2, 4, 8)],
    "wu": [dict(wu_warps=w) for w in (2, 4, 8)],
}
best = {}
t0 = time.time()
for kern, opts in space.items():
    res = []
    for o in opts:
        for f, val in o.items():
            setattr(C.LAUNCH, f, val)
        try:
            ts = {f"{n}x{L}": G._time_ms(fn, 10, warmup=2) for (n, L), fn in cases.items()}
        except Exception as e:
            ts = {"error": repr(e)[:200]}
        res.append({"cfg": o, "ms": ts})
        print(kern, o, ts, flush=True)
        for f in o:
            setattr(C.LAUNCH, f, getattr(base, f))
    ok = [r for r in res if "error" not in r["ms"]]
    score = lambda r: r["ms"]["16x1024"] + r["ms"]["1x8192"] + 0.5 * (r["ms"]["4x1024"] + r["ms"]["1x1024"])
    b = min(ok, key=score)
    best[kern] = b
    for f, val in b["cfg"].items():
        setattr(base, f, val)
        setattr(C.LAUNCH, f, val)
    out[kern] = res
    print("BEST", kern, b, f"{time.time()-t0:.0f}s", flush=True)
out["best"] = best
out["final_launch"] = dataclasses.asdict(C.LAUNCH)
# per-kernel breakdown with the final config, and fla's
from torch.profiler import profile, ProfilerActivity
fla = G._fla()
for (n, L), fn in cases.items():
    if (n, L) not in [(16, 1024), (1, 8192)]:
        continue
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    out[f"profile_kvserve_{n}x{L}"] = [(e.key, e.device_time_total / 5) for e in p.key_averages() if e.device_time_total > 0]
json.dump(out, open(os.environ["OUT"] + "/tune.json", "w"), indent=1)
print(json.dumps(out["final_launch"]))
for k_, v_ in out.items():
    if k_.startswith("profile"):
        print(k_, [(a, round(b_)) for a, b_ in v_])
