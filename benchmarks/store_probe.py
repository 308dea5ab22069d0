#!/usr/bin/env python
"""Store probe: ``triton_store.store_kv`` tiling (tokens per program x num_warps) against copy bandwidth.

Usage:
    python3 benchmarks/store_probe.py --out $OUT/store_probe.json         # H200: ~1-2 min
    python3 benchmarks/store_probe.py --smoke                             # CPU interpreter: code paths only
Options: --tokens 1024,4096,16384,65536  --tpp auto,1,2,4,8,16  --warps auto,2,4,8  --caches bf16,fp8
--kv-heads 8 --head-dim 128 --block-size 16 --pool-gb 16 --time-budget-s 240; --no-graph; --diag.

What is measured (one process, one GPU):
  copy   dst.copy_(src) of 2 GiB fp32 through triton.testing.do_bench: (read + write bytes) / time, the
         ceiling every "%cp" is against.
  store  K and V [T, Hk, D] bf16 (contiguous, random normal) into a bf16 pool and an fp8_e4m3 pool (uint8
         bytes, CacheQuant k_scale 0.02, v_scale 0.015) at T distinct random slots (randperm over the
         whole pool, --pool-gb of bf16 cache and half that of fp8), for every tokens_per_program x
         num_warps ("auto" = store_kv's own choice, recorded as the plan it took).
         bytes = K,V read in the model dtype + K,V cache rows written (slot ids not counted).
Timing: "us" = do_bench median (it clears a 256 MB buffer before each call, so every call starts with
a cold L2; events bracket the call only): an eager call, so host launch time shows where the kernel is
shorter than it (small T). "graph us" = a CUDA graph of n x [128 MB L2 clear, call] minus a graph of
n x [clear], per call: the GPU time alone, as inside a captured decode step; the summary ranks by it.
Check: before timing, every configuration stores fresh random K/V of
the same T (slots -1 interleaved) into a small poisoned cache and must equal ``reference.store_kv``
byte for byte, untouched rows included; a mismatch is reported and that configuration is not timed
(exit status 1). Compiles (1-3 s per constexpr configuration) happen in that check, before timing.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the repository root: kvserve

sys.path.insert(0, _HERE)  # graph_timing
import torch  # noqa: E402  (torch does not import triton; TRITON_INTERPRET is set below first)
import graph_timing  # noqa: E402  (benchmarks/: capture on a side stream, replay timing)

GB = 1e9


def _ints_or_auto(s: str) -> list[int | None]:
    return [None if x == "auto" else int(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON file (written after every configuration)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; on CPU through the Triton interpreter")
    p.add_argument("--tokens", type=_ints, default=None)
    p.add_argument("--tpp", type=_ints_or_auto, default=_ints_or_auto("auto,1,2,4,8,16"), help="tokens per program")
    p.add_argument("--warps", type=_ints_or_auto, default=_ints_or_auto("auto,2,4,8"))
    p.add_argument("--caches", default="bf16,fp8")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-gb", type=float, default=16.0, help="bf16 pool size (the fp8 pool has as many slots)")
    p.add_argument("--k-scale", type=float, default=0.02)
    p.add_argument("--v-scale", type=float, default=0.015)
    p.add_argument("--copy-gib", type=float, default=2.0)
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--rep-ms", type=float, default=40.0)
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA-graph timing")
    p.add_argument("--graph-calls", type=int, default=20, help="calls per timing graph")
    p.add_argument("--diag", action="store_true", help="also time non-exact fp8 kernel variants (diagnostic)")
    p.add_argument("--time-budget-s", type=float, default=240.0, help="skip the remaining points past this wall time")
    a = p.parse_args(argv)
    if a.tokens is None:
        a.tokens = [5, 40] if a.smoke else [1024, 4096, 16384, 65536]
    if a.smoke:
        a.pool_gb, a.copy_gib, a.kv_heads, a.head_dim = min(a.pool_gb, 0.001), min(a.copy_gib, 1 / 1024), 2, 64
    a.caches = [c for c in a.caches.split(",") if c]
    return a


class Probe:
    def __init__(self, a: argparse.Namespace, cuda: bool) -> None:
        import triton

        from kvserve.kernels import reference, triton_store

        self.a, self.cuda = a, cuda
        self.dev = torch.device("cuda" if cuda else "cpu")
        self.reference, self.triton_store = reference, triton_store
        self.t0 = time.perf_counter()
        self.failed = False
        self.flush = None
        props = torch.cuda.get_device_properties(0) if cuda else None
        self.res = {
            "device": props.name if props else f"cpu ({platform.machine()}, Triton interpreter)",
            "num_sms": props.multi_processor_count if props else None,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "args": {k: v for k, v in vars(a).items()},
            "shape": {"kv_heads": a.kv_heads, "head_dim": a.head_dim, "block_size": a.block_size,
                      "model_dtype": "bfloat16"},
            "timing": "triton.testing.do_bench median, 256 MB L2 clear before each call" if cuda
                      else "perf_counter (CPU interpreter smoke: meaningless)",
            "bytes": "K,V read (bf16) + K,V cache rows written",
            "copy_GBps": None, "store": [], "errors": [], "skipped": [],
        }

    # ---- helpers
    def save(self) -> None:
        if self.a.out:
            with open(self.a.out, "w") as f:
                json.dump(self.res, f, indent=1, default=str)

    def time_ms(self, fn) -> float:
        if not self.cuda:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=self.a.warmup_ms, rep=self.a.rep_ms, return_mode="median"))

    def graph_ms(self, fn) -> float | None:
        """GPU time per call without host launch gaps: a CUDA graph of n x [L2 flush, call] minus one of
        n x [flush], replayed (median of 7), divided by n."""
        if not self.cuda or not self.a.graph:
            return None
        n = self.a.graph_calls
        if self.flush is None:
            self.flush = torch.empty(128 * 2**20 // 4, dtype=torch.int32, device=self.dev)
            self.stream = torch.cuda.Stream()
        flush = self.flush

        def capture(body):
            return graph_timing.capture(self.stream, body)

        def replay_ms(g) -> float:
            return graph_timing.replay_ms(g, 7)

        def flushes():
            for _ in range(n):
                flush.zero_()

        def calls():
            for _ in range(n):
                flush.zero_()
                fn()

        g0, g1 = capture(flushes), capture(calls)
        ms = (replay_ms(g1) - replay_ms(g0)) / n
        del g0, g1
        return ms

    def quant(self, cache: str):
        if cache == "bf16":
            return None
        return self.reference.CacheQuant(torch.float8_e4m3fn, 448.0, self.a.k_scale, self.a.v_scale, self.dev)

    def storage(self, cache: str) -> torch.dtype:
        return torch.bfloat16 if cache == "bf16" else torch.uint8

    # ---- copy
    def bench_copy(self) -> None:
        n = int(self.a.copy_gib * 2**30) // 4
        src = torch.randn(n, dtype=torch.float32, device=self.dev)
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        assert torch.equal(dst, src)
        bw = 2 * n * 4 / (ms * 1e-3) / GB
        self.res["copy_GBps"] = bw
        self.res["copy"] = {"bytes_each_way": n * 4, "ms": ms, "GBps": bw}
        print(f"[copy] {n * 4 / 2**30:.2f} GiB fp32: {ms:.3f} ms -> {bw:.0f} GB/s (read + write)", flush=True)
        del src, dst

    # ---- store
    def check(self, T: int, cache: str, tpp, warps) -> str | None:
        """Fresh random K/V, a small poisoned cache, slots -1 interleaved: byte-equal with the reference?"""
        a = self.a
        hk, d, bs = a.kv_heads, a.head_dim, a.block_size
        nb = math.ceil(T * 1.25 / bs) + 2
        shape = (nb, 2, bs, hk, d)
        k = torch.randn(T, hk, d, dtype=torch.bfloat16, device=self.dev)
        v = torch.randn(T, hk, d, dtype=torch.bfloat16, device=self.dev)
        slots = torch.randperm(nb * bs, device=self.dev)[:T]
        slots[1::7] = -1
        nbytes = math.prod(shape) * torch.empty((), dtype=self.storage(cache)).element_size()
        ours = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=self.dev).view(self.storage(cache)).view(shape)
        expect = ours.clone()
        quant = self.quant(cache)
        self.reference.store_kv(k, v, expect, slots, quant)
        self.triton_store.store_kv(k, v, ours, slots, quant, tokens_per_program=tpp, num_warps=warps)
        diff = int((ours.view(torch.uint8) != expect.view(torch.uint8)).sum())
        return f"{diff} bytes differ from reference.store_kv" if diff else None

    def bench_store(self) -> None:
        a = self.a
        hk, d, bs = a.kv_heads, a.head_dim, a.block_size
        slots_in_pool = max(int(a.pool_gb * GB) // (2 * hk * d * 2), 2 * max(a.tokens))
        num_blocks = math.ceil(slots_in_pool / bs)
        pools = {c: torch.empty((num_blocks, 2, bs, hk, d), dtype=self.storage(c), device=self.dev) for c in a.caches}
        for p in pools.values():  # any contents; bf16 noise so that nothing is special
            p.view(torch.uint8).random_(0, 256) if p.dtype == torch.uint8 else p.normal_()
        self.res["pool"] = {"blocks": num_blocks, "GB": sum(p.numel() * p.element_size() for p in pools.values()) / GB}
        print(f"[pool] {num_blocks} blocks of {bs}: {self.res['pool']['GB']:.1f} GB", flush=True)
        hdr = (f"{'cache':5s} {'T':>6s} {'tpp':>5s} {'warps':>5s} {'plan(t,h,w)':>12s} {'us':>9s} {'%cp':>5s} "
               f"{'graph us':>9s} {'%cp':>5s}")
        print(hdr, flush=True)
        copy = self.res["copy_GBps"]
        for T in a.tokens:
            k = torch.randn(T, hk, d, dtype=torch.bfloat16, device=self.dev)
            v = torch.randn(T, hk, d, dtype=torch.bfloat16, device=self.dev)
            slots = torch.randperm(num_blocks * bs, device=self.dev)[:T]
            for cache in a.caches:
                pool, quant = pools[cache], self.quant(cache)
                elem = pool.element_size()
                nbytes = 2 * T * hk * d * k.element_size() + 2 * T * hk * d * elem
                for tpp in a.tpp:
                    for warps in a.warps:
                        tag = f"{cache} T={T} tpp={tpp or 'auto'} warps={warps or 'auto'}"
                        if time.perf_counter() - self.t0 > a.time_budget_s:
                            self.res["skipped"].append(tag)
                            continue
                        plan = self.triton_store.store_plan(
                            T, hk, d, k.element_size(), self.triton_store.num_sms(pool.device), tpp, warps)
                        row = {"cache": cache, "tokens": T, "tpp": tpp or "auto", "warps": warps or "auto",
                               "plan": {"block_t": plan[0], "block_h": plan[1], "block_d": plan[2], "num_warps": plan[3]},
                               "bytes": nbytes}
                        try:
                            bad = self.check(T, cache, tpp, warps)
                            if bad:
                                raise AssertionError(bad)
                            def call():
                                self.triton_store.store_kv(k, v, pool, slots, quant, tokens_per_program=tpp, num_warps=warps)

                            ms = self.time_ms(call)
                            gms = self.graph_ms(call)
                        except Exception as e:  # noqa: BLE001
                            self.failed = True
                            self.res["errors"].append({"what": tag, "error": repr(e), "trace": traceback.format_exc()})
                            print(f"[error] {tag}: {e!r}", flush=True)
                            self.save()
                            continue
                        bw = nbytes / (ms * 1e-3) / GB
                        row.update(ms=ms, GBps=bw, pct_copy=100 * bw / copy if copy else None)
                        if gms is not None:
                            gbw = nbytes / (gms * 1e-3) / GB if gms > 0 else None
                            row.update(graph_ms=gms, graph_GBps=gbw, graph_pct_copy=100 * gbw / copy if copy and gbw else None)
                        self.res["store"].append(row)
                        pl = f"{plan[0]},{plan[1]},{plan[3]}"

                        def pct(key):
                            return f"{row[key]:5.1f}" if row.get(key) is not None else "    -"
                        g_us = f"{gms * 1e3:9.2f}" if gms is not None else "        -"
                        print(f"{cache:5s} {T:6d} {str(tpp or 'auto'):>5s} {str(warps or 'auto'):>5s} {pl:>12s} "
                              f"{ms * 1e3:9.2f} {pct('pct_copy')} {g_us} {pct('graph_pct_copy')}", flush=True)
                        self.save()
            del k, v, slots
        self.summary()

    def bench_variants(self) -> None:
        """Diagnostic (--diag): how much of the fp8 store is its arithmetic. Copies of the kernel module
        with the exact division replaced by a multiplication with 1/scale ("mul"), and with the clamp
        dropped as well ("mul_noclamp"); NOT bit-exact, never used by kvserve, timed only."""
        import importlib.util
        import tempfile

        a = self.a
        if "fp8" not in a.caches:
            return
        hk, d, bs = a.kv_heads, a.head_dim, a.block_size
        src = open(self.triton_store.__file__).read()
        div_k = "tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr))"
        div_v = "tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr))"
        clamp = [ln for ln in src.splitlines() if ln.strip().startswith(("kq = tl.where(", "vq = tl.where("))]
        if src.count(div_k) != 1 or src.count(div_v) != 1 or len(clamp) != 2:
            self.res["variants_error"] = "kernel source changed: variants not built"
            return
        mul = src.replace(div_k, "k.to(tl.float32) * (1.0 / tl.load(k_scale_ptr))")
        mul = mul.replace(div_v, "v.to(tl.float32) * (1.0 / tl.load(v_scale_ptr))")
        variants = {"mul": mul, "mul_noclamp": "\n".join(ln for ln in mul.splitlines() if ln not in clamp) + "\n"}
        tmp = tempfile.mkdtemp(prefix="store_variants_")
        pts = [T for T in a.tokens if T >= 16384] or a.tokens[-1:]
        configs = [(1, 2), (2, 4)]
        self.res["variants"] = []
        num_blocks = math.ceil(2 * max(pts) / bs)
        pool = torch.empty((num_blocks, 2, bs, hk, d), dtype=torch.uint8, device=self.dev)
        quant = self.quant("fp8")
        for name, text in variants.items():
            path = os.path.join(tmp, f"_store_variant_{name}.py")
            with open(path, "w") as f:
                f.write(text)
            spec = importlib.util.spec_from_file_location(f"_store_variant_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            for T in pts:
                k = torch.randn(T, hk, d, dtype=torch.bfloat16, device=self.dev)
                v = torch.randn(T, hk, d, dtype=torch.bfloat16, device=self.dev)
                slots = torch.randperm(num_blocks * bs, device=self.dev)[:T]
                nbytes = 2 * T * hk * d * 2 + 2 * T * hk * d
                for tpp, warps in configs:
                    if time.perf_counter() - self.t0 > a.time_budget_s:
                        self.res["skipped"].append(f"variant {name} T={T} {tpp}/{warps}")
                        continue

                    def call():
                        mod.store_kv(k, v, pool, slots, quant, tokens_per_program=tpp, num_warps=warps)

                    try:
                        ms = self.time_ms(call)
                        gms = self.graph_ms(call)
                    except Exception as e:  # noqa: BLE001
                        self.res["errors"].append({"what": f"variant {name}", "error": repr(e)})
                        print(f"[variant] {name}: {e!r}", flush=True)
                        continue
                    t = gms if gms is not None else ms
                    pct = 100 * nbytes / (t * 1e-3) / GB / self.res["copy_GBps"] if self.res["copy_GBps"] else None
                    self.res["variants"].append({"variant": name, "tokens": T, "tpp": tpp, "warps": warps,
                                                 "ms": ms, "graph_ms": gms, "pct_copy": pct})
                    print(f"[variant, not exact] fp8 {name:11s} T={T:6d} tpp={tpp} warps={warps}: "
                          f"{t * 1e3:8.2f} us {pct:5.1f}%cp", flush=True)
                    self.save()

    def summary(self) -> None:
        """Best configuration and the automatic one per (cache, T), by graph time where measured."""
        best = {}
        key_ms = "graph_ms" if any(r.get("graph_ms") for r in self.res["store"]) else "ms"
        pkey = "graph_pct_copy" if key_ms == "graph_ms" else "pct_copy"
        self.res["summary_metric"] = key_ms
        for r in self.res["store"]:
            key = (r["cache"], r["tokens"])
            b = best.setdefault(key, {"auto": None, "best": None})
            if r["tpp"] == "auto" and r["warps"] == "auto":
                b["auto"] = r
            if b["best"] is None or r[key_ms] < b["best"][key_ms]:
                b["best"] = r
        out = []
        print(f"\n[summary, {key_ms}] cache T: auto (plan t,warps) %cp | best tpp/warps %cp", flush=True)
        for (cache, T), b in sorted(best.items()):
            au, be = b["auto"], b["best"]
            out.append({"cache": cache, "tokens": T, "auto": au, "best": be})

            def pc(r):
                return f"{r[pkey]:.1f}" if r and r.get(pkey) is not None else "-"
            ap = f"({au['plan']['block_t']},{au['plan']['num_warps']})" if au else ""
            print(f"  {cache:5s} {T:6d}: auto {ap:8s} {pc(au):>5s}% | best {be['tpp']}/{be['warps']} {pc(be):>5s}%",
                  flush=True)
        self.res["summary"] = out


def compiled_kernels(jit_fn) -> list[dict]:
    """Registers and spills of every compiled variant of a Triton kernel (best effort: the cache
    layout differs between Triton versions; an empty list where it cannot be read)."""
    out = []
    try:
        for dev_cache in getattr(jit_fn, "device_caches", {}).values():
            kernels = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for key, k in kernels.items():
                md = getattr(k, "metadata", None)
                out.append({"key": str(key)[-240:], "num_warps": getattr(md, "num_warps", None),
                            "n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None)})
    except Exception as e:  # noqa: BLE001
        out.append({"error": repr(e)})
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        if not a.smoke:
            raise SystemExit("no CUDA device: use --smoke (CPU, Triton interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))
        from triton_support import patch_interpreter

        patch_interpreter()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    probe = Probe(a, cuda)
    print(f"[setup] {probe.res['device']} torch {probe.res['torch']} triton {probe.res['triton']} "
          f"cuda {probe.res['cuda']}", flush=True)
    try:
        probe.bench_copy()
        probe.save()
        probe.bench_store()
        if a.diag:
            probe.bench_variants()
    except Exception as e:  # noqa: BLE001
        probe.failed = True
        probe.res["errors"].append({"what": "run", "error": repr(e), "trace": traceback.format_exc()})
        traceback.print_exc()
    probe.res["compiled"] = compiled_kernels(probe.triton_store._store_kv_kernel)
    for c in probe.res["compiled"]:
        print(f"[compiled] {c}", flush=True)
    probe.res["wall_s"] = time.perf_counter() - probe.t0
    probe.save()
    if probe.res["skipped"]:
        print(f"[budget] skipped {len(probe.res['skipped'])} configurations", flush=True)
    return 1 if probe.failed else 0


if __name__ == "__main__":
    sys.exit(main())
