"""Probe (2026-12-06 sixth session): decode with the products swapped (keys on the MMA's 64-row side: fp8
wgmma Q K^T on K as stored) against the landed kernel, same pages; on CPU (interpreter) a check against the twin."""
import json, math, os, sys, time
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
from kvserve.kernels import pdl, reference as r, triton_attention as ta
from kvserve.layers.attention import decode_order
import triton
import swap_decode as sd

cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")
hq, hk, d, bs = 32, 8, 128, 16


def swap(q, kv8, vt, bt, sl, order, quant, tile_n, warps, stages, pv, maxnreg=0, splits=None):
    b = sl.shape[0]
    if splits is None:
        splits = ta.choose_num_splits(b, hk, int(sl.max()), q.device, tile_n) if cuda else 1
    out = torch.empty_like(q)
    if splits > 1:
        pa = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
        pm = torch.empty((b, hq, splits, 2), dtype=torch.float32, device=q.device)
    else:
        pa = pm = out
    cache = kv8.view(torch.float8_e4m3fn)
    vtv = vt.view(torch.float8_e4m3fn) if vt is not None else cache
    opts = {"maxnreg": maxnreg} if (maxnreg and cuda) else {}
    sd.decode_swap_kernel[(b * hk, 1, splits)](
        out, pa, pm, q, cache, bt, sl, order, quant.k_scale_t, quant.v_scale_t, quant.q_scale_t, quant.inv_q_scale_t,
        d ** -0.5, vtv, vtv.stride(0) if vt is not None else 0, vtv.stride(1) if vt is not None else 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache.stride()[:4], bt.stride(0), splits,
        G=hq // hk, GP=16, HEAD=d, PAGE=bs, TILE_N=tile_n, P_SHIFT=quant.p_shift, PV_MODE=pv, SPLIT=splits > 1,
        ORDERED=True, HK=hk, num_warps=warps, num_stages=stages, **opts)
    if splits > 1:
        ta._merge_splits_kernel[(b, hq)](out, pa, pm, out.stride(0), out.stride(1), hq, splits, HEAD=d, HEAD_PAD=d,
                                         SPLITS_PAD=max(2, triton.next_power_of_2(splits)), num_warps=4,
                                         **pdl.launch_options(q.device))
    return out


def make(lens, gen):
    need = sum(math.ceil(n / bs) for n in lens) + 4
    kv8 = torch.randint(0, 0x7E, (need, 2, bs, hk, d), dtype=torch.uint8, generator=gen).to(dev)
    kv8 |= (torch.randint(0, 2, kv8.shape, dtype=torch.uint8, generator=gen) << 7).to(dev)  # signs
    perm = torch.randperm(need, generator=gen).to(torch.int32)
    mb = max(math.ceil(n / bs) for n in lens)
    bt = torch.zeros(len(lens), mb, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        m = math.ceil(n / bs); bt[i, :m] = perm[used:used + m]; used += m
    vt = kv8[:, 1].permute(0, 2, 3, 1).contiguous()  # [NB, Hk, D, PAGE]
    return kv8, vt, bt.to(dev)


VARIANTS = {"swap_pv16_t128": (128, 4, 2, 1), "swap_pv16_t64s3": (64, 4, 3, 1), "swap_pv8stage_t128": (128, 4, 2, 0),
            "swap_vt_t64s3": (64, 4, 3, 3), "swap_vt_t128s2": (128, 4, 2, 3)}

if not cuda:  # interpreter check against the twin
    sys.path.insert(0, 'tests'); import triton_support; triton_support.patch_interpreter()
    gen = torch.Generator().manual_seed(0)
    lens = [1, 17, 130, 64, 200]
    kv8, vt, bt = make(lens, gen)
    quant = r.CacheQuant(torch.float8_e4m3fn, 448.0, 0.05, 0.04, dev, query_fp8=True, q_scale=0.02)
    q = torch.randn(len(lens), hq, d, dtype=torch.bfloat16, generator=gen)
    sl = torch.tensor(lens, dtype=torch.int32); order = torch.tensor(decode_order(lens), dtype=torch.int32)
    for name, (tn, w, st, pv) in VARIANTS.items():
        if name.endswith("s3") and "t128" in name or name.endswith("s4"):
            continue
        for splits in (1, 2):
            got = swap(q, kv8, vt if pv == 3 else None, bt, sl, order, quant, tn, w, st, pv, splits=splits)
            twin = r.paged_attention_fp8_query(q, kv8, bt, [1] * len(lens), lens, d ** -0.5, quant, tile_n=tn, num_splits=splits)
            err = ((got.float() - twin.float()).abs().max() / twin.float().abs().max()).item()
            print(f"{name} splits {splits}: max |kernel - twin| / max|twin| = {err:.2e}", flush=True)
    sys.exit(0)

sys.path.insert(0, "benchmarks")
import kernel_bench as kb
out_path = sys.argv[1]; budget = float(sys.argv[2]) if len(sys.argv) > 2 else 150
t0 = time.time()
timer = kb.Timer(True, 10, 50, True)
gen = torch.Generator().manual_seed(1234)
points = [("32x4096", [4096] * 32), ("256x4096", [4096] * 256), ("32x16384", [16384] * 32), ("64x512", [512] * 64),
          ("256x1024", [1024] * 256), ("ragged256", [int(x) for x in torch.randint(75, 2040, (256,), generator=gen)])]
big = torch.empty(0)
src = torch.randn(64 * 2 ** 20, dtype=torch.bfloat16, device=dev); dst = torch.empty_like(src)
copy_bw = 2 * src.numel() * 2 / (timer.time(lambda: dst.copy_(src), "copy")["clean_ms"] * 1e-3) / 1e9
del src, dst
print(f"copy {copy_bw:.0f} GB/s", flush=True)
rows = []
quant = r.CacheQuant(torch.float8_e4m3fn, 448.0, 0.05, 0.04, dev, query_fp8=True, q_scale=0.02)
for pname, lens in points:
    if time.time() - t0 > budget:
        break
    kv8, vt, bt = make(lens, gen)
    b = len(lens)
    kvb = torch.randn((kv8.shape[0], 2, bs, hk, d), dtype=torch.bfloat16, device=dev)
    q = torch.randn(b, hq, d, dtype=torch.bfloat16, device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev); qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    order = torch.tensor(decode_order(lens), dtype=torch.int32, device=dev)
    nb8 = sum(lens) * hk * d * 2
    out = torch.empty_like(q)
    base = ta.paged_attention(q, kv8, bt, qsl, sl, d ** -0.5, 1, max(lens), quant, order=order).float()
    scale_ref = base.abs().max().item()
    fns = {"bf16": (lambda: ta.paged_attention(q, kvb, bt, qsl, sl, d ** -0.5, 1, max(lens), None, out=out, order=order), 2 * nb8),
           "fp8q_landed": (lambda: ta.paged_attention(q, kv8, bt, qsl, sl, d ** -0.5, 1, max(lens), quant, out=out, order=order), nb8)}
    for name, (tn, w, st, pv) in VARIANTS.items():
        fns[name] = (lambda tn=tn, w=w, st=st, pv=pv: swap(q, kv8, vt if pv == 3 else None, bt, sl, order, quant, tn, w, st, pv), nb8)
    res = {}
    for name, (fn, nb) in fns.items():
        try:
            o = fn(); torch.cuda.synchronize()
            diff = ((o.float() - base).abs().max().item() / scale_ref) if name != "bf16" else 0.0
            t = timer.time(fn, "dec")
            us = t["clean_ms"] * 1e3
            res[name] = us
            pct = 100 * nb / (us * 1e-6) / 1e9 / copy_bw
            rows.append(dict(point=pname, impl=name, clean_us=us, pct_copy=pct, rel_diff_vs_landed=diff))
            print(f"{pname:10s} {name:24s} {us:8.1f} us {pct:5.1f}% copy  vs bf16 {res.get('bf16', us) / us:4.2f}x"
                  f"  vs landed {res.get('fp8q_landed', us) / us:4.2f}x  diff {diff:.1e}", flush=True)
        except Exception as e:
            print(f"{pname} {name} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    del kv8, vt, kvb
json.dump({"copy_GBps": copy_bw, "rows": rows, "gpu": torch.cuda.get_device_name()}, open(out_path, "w"), indent=1)
print("done", time.time() - t0)
