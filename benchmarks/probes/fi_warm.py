"""JIT-warm one FlashInfer decode kernel (dtype, mode from argv) so the benchmark finds it compiled."""
import sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import flashinfer_peer as fp  # noqa: E402
dtype, mode = sys.argv[1], sys.argv[2]
t = time.time()
dev = torch.device("cuda")
fi = fp.FlashInferDecode(dev, 16)
b, ctx, hq, hk, d, bs = 2, 64, 32, 8, 128, 16
nblk = ctx // bs
bt = torch.arange(b * nblk, dtype=torch.int32, device=dev).view(b, nblk)
fp8 = dtype == "fp8"
pool = torch.zeros((b * nblk, 2, bs, hk, d), device=dev, dtype=torch.uint8 if fp8 else torch.bfloat16)
q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
out = torch.empty_like(q)
fi.plan(mode, bt, ctx, hq, hk, d, bs, fp8, d ** -0.5)
fi.run(mode, q, pool, out, *( (0.02, 0.015) if fp8 else (None, None)))
torch.cuda.synchronize()
print(f"fi_warm {dtype} {mode} ok {time.time() - t:.0f}s", flush=True)
