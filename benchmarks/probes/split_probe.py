"""Decode splits x tiles probe, clean-L2 CUDA-graph timing (kernel_bench.Timer): bf16 vs fp8q, 32/8 heads, head 128."""
import itertools, json, math, os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
import kernel_bench as kb  # noqa: E402
from kvserve.kernels import reference, triton_attention as ta  # noqa: E402

dev = torch.device("cuda")
hq, hk, d, bs = 32, 8, 128, 16
t_end = time.time() + float(os.environ.get("PROBE_S", "150"))
timer = kb.Timer(True, 10.0, 40.0, True)
nb = int(os.environ.get("POOL_BLOCKS", str(1 << 19)))  # 2^19 blocks: 17 GB of fp8 pages, 34 GB of bf16
pool16 = torch.empty(nb, 2, bs, hk, d, dtype=torch.bfloat16, device=dev).normal_()
pool8 = torch.empty(nb, 2, bs, hk, d, dtype=torch.uint8, device=dev).random_(0, 256).bitwise_and_(0x77)  # no NaN codes
quant = reference.CacheQuant(torch.float8_e4m3fn, 448.0, 0.02, 0.015, dev, query_fp8=True)
copy_bw = float(os.environ.get("COPY_GBPS", "3020")) * 1e9
rows = []
points = [(int(b), int(c)) for b, c in (p.split("x") for p in os.environ.get("POINTS", "32x4096,64x4096,128x4096,32x8192,64x8192,32x16384,256x4096,64x2048").split(","))]
for b, ctx in points:
    nblk = math.ceil(ctx / bs)
    bt = torch.randperm(nb, device=dev)[: b * nblk].to(torch.int32).view(b, nblk)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    sl = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    auto = ta.choose_num_splits(b, hk, ctx, dev)
    for read, ns in itertools.product(("fp8q", "bf16"), sorted({1, 2, 3, 4, 6, 8, auto})):
        if time.time() > t_end:
            break
        pool, qu = (pool8, quant) if read == "fp8q" else (pool16, None)
        fn = lambda: ta.paged_attention(q, pool, bt, qsl, sl, d ** -0.5, 1, ctx, quant=qu, out=out, num_splits=ns)
        fn(); torch.cuda.synchronize()
        t = timer.time(fn, f"{b}x{ctx}")
        nbytes = b * ctx * hk * d * 2 * (1 if read == "fp8q" else 2)
        r = {"b": b, "ctx": ctx, "read": read, "splits": ns, "auto": auto, **t,
             "clean_pct": nbytes / (t["clean_ms"] * 1e-3) / copy_bw * 100 if t.get("clean_ms") else None}
        rows.append(r)
        print(json.dumps(r), flush=True)
    Path(os.environ["OUT"], "split_probe.json").write_text(json.dumps(rows, indent=1))
