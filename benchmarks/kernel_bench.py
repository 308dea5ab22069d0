#!/usr/bin/env python
"""Kernel benchmark: KV store, paged decode and prefill attention against the copy-bandwidth
ceiling, with PyTorch FlexAttention (decode) and SDPA (prefill) as peers. One run, one JSON.

The kernels family of the suite (benchmarks/RESULTS.md):
    bash benchmarks/gpu.sh kernels                                      # H200: $OUT/kernels.json, ~1-2 min
    python3 benchmarks/kernel_bench.py --out kernels.json               # H200 by hand, full grid (~4-5 min)
    python3 benchmarks/kernel_bench.py --smoke --out /tmp/kernels.json  # CPU: every code path, tiny
    python3 benchmarks/kernel_bench.py --smoke --impl reference         # without the Triton kernels
Options worth knowing: --sections copy,store,prefill,mixed,ragged,decode (decode includes flex and
the FlashInfer / vLLM peers); --mixed-chunk 2048 --mixed-contexts 0,2048,6144 --mixed-decodes 64;
--ragged-batch 256 --ragged-mean 1024; --no-flex,
--no-flex-fp8, --no-ours-decode (flex only); --batches 1,8 --contexts 1024,4096; --flex-variants
auto|both|full|partial; --flex-page-size 128; --int32-pools (keep every cache tensor under 2^31
elements, dropping the big points); --time-budget-s 480 (remaining points are skipped, never the
JSON/table); --no-graph.

--smoke on a machine without CUDA sets TRITON_INTERPRET=1 before the kernels are imported, patches
the interpreter's two known bugs (float down-casts, bf16 tl.dot: tests/triton_support.py, with a
copy here as fallback), forces num_splits=2 once per decode point (the auto choice never splits off
CUDA), and finally stores/attends at the far end of pools of more than 2^31 elements (32-bit offset
arithmetic in a kernel shows up there as a segfault or a failed check, instead of an illegal memory
access on the GPU).

What is measured (all in one process, one GPU):
  copy     dst.copy_(src) of 2 GiB bf16: (read + write bytes) / time = the ceiling for every "%cp".
  store    kvserve.kernels.triton_store.store_kv: T x Hk x D bf16 K and V into a bf16 and an fp8_e4m3
           cache at T random distinct slots of the large decode pool. bytes = K,V read + cache rows
           written + slot ids.
  prefill  one sequence of T tokens, no cached context, bf16 pages: our paged_attention (store not
           included) vs F.scaled_dot_product_attention(is_causal, enable_gqa) on contiguous q/k/v,
           and vs SDPA on K/V repeated to Hq heads (the faster SDPA is the peer). TFLOP/s with causal
           flops 2*2*T*T/2*Hq*D.
  mixed    a chunked-prefill batch: prefill chunks over cached context (one fresh) plus decodes in
           one launch, bf16 / fp8 / fp8q pages, vs FlashAttention-2's varlen kernel through
           torch.nn.attention.varlen (causal, bottom-right aligned) on the same K/V, packed dense.
  ragged   one decode batch of ragged contexts (uniform 64 .. 2 x mean), launched in batch order and
           longest sequence first (the runner's order), bf16 / fp8 / fp8q pages.
  decode   batch x context grid, 1 query token per sequence, block size 16, block tables = random
           blocks of one pool sized for the largest point (same pool for every point), bf16 pages and
           fp8_e4m3 pages (k_scale 0.02, v_scale 0.015), num_splits=None (auto). bytes = KV read +
           q + out + block table/seq_lens/query_start_loc. tokens/s = batch / time.
  flex     the same decode points through torch FlexAttention's paged path (benchmarks/flex_paged.py:
           page size 128, PagedAttention page table over a pool of the same byte size, converted
           BlockMask, torch.compile(dynamic=False)); bf16 and fp8 pages (bf16 query, K/V upcast in
           the kernel). "auto" picks the mask structure flex is fastest with for that batch.
  flashinfer  the same decode points, the very same pages and block tables, through FlashInfer's
           BatchDecodeWithPagedKVCacheWrapper (benchmarks/flashinfer_peer.py; its NHD layout is
           kvserve's), bf16 and fp8 pages (k_scale / v_scale to run), both its modes (CUDA cores,
           tensor cores), the faster kept per point. On when flashinfer imports (--no-flashinfer).
  vllm_triton  the same decode points and pages through vLLM's own Triton kernel (the TRITON_ATTN
           backend's unified_attention, run from a vLLM release's source files given with
           --vllm-triton-src DIR: benchmarks/vllm_triton_peer.py), called as the backend calls it
           (fp8 pages with the query quantized, its 2D / 3D choice); bf16 and fp8.

Timing: triton.testing.do_bench median (it zeroes a 256 MB buffer before every call, so each call
starts with a cold L2; events bracket the call only); warm-up and compile happen before. Inputs are
random (never zeros); outputs are poisoned with NaN before the checked call. Cross-check (--graph,
default on GPU): a CUDA graph of n x [128 MB L2 flush, call] minus a graph of n x [flush], per call;
it removes launch overhead. Both are in the JSON ("ms", "graph_ms"); the tables use "ms". Both
flushes zero a buffer, which leaves L2 full of dirty lines (~50 MB on Hopper) that the timed call
then writes back: 10-20% of a 100-300 MB decode's traffic. "clean_ms" flushes by reading 128 MB
instead (clean lines, as after the engine's own weight-reading kernels); the "clean L2" decode
table and "clean x" ratios use it, and the store rows compare it with a plain copy of the same
bytes.

Checks: before timing each configuration the same call is compared with
kvserve.kernels.reference (fp32) on a slice (decode: sequences 0 and B-1 of that very batch;
prefill: everything; store: a small cache, byte-exact outside the written rows). Any rel. error
> 2e-2, unwritten output or error makes the exit status 1 (the JSON is still written, after every
configuration). Flex failing to compile or run (say an fp8 page dtype an older torch rejects) only
switches that flex dtype off (JSON "flex_errors"); a wrong flex result is a failed check.

Order: copy, pools (ours: bf16 + fp8, ~52 GB at the default grid), store, prefill, flex pools (same
size) + flex reference check, then each decode point from the smallest KV to the largest (ours bf16,
ours fp8, flex bf16, flex fp8), copy again. Flex compiles once per (batch size, mask structure,
dtype): about 12 compiles. Flex's Triton template forms ``offs_n * stride_kn`` in 32 bits (vLLM
#50427), so its pool is kept under 2^31 / D tokens (plus under 2^31 elements in all when the
installed template lacks INDEX_DTYPE head offsets); points beyond are skipped for flex, and say so.
"%cp" is against a copy (read + write); a read-only stream may reach slightly more than 100%.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import inspect
import itertools
import math
import os
import platform
import statistics
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # common, flex_paged

import common  # noqa: E402  (also puts the repository root on sys.path: kvserve)
import torch  # noqa: E402  (torch does not import triton; TRITON_INTERPRET is set below first)

TOL = 2e-2
GB = 1e9


# --------------------------------------------------------------------------- CPU interpreter patches
def patch_triton_interpreter() -> str:
    """Fix the Triton interpreter's two known bugs before any kernel runs on CPU: float down-casts
    (not RTNE, no e4m3fn saturation: ../shared/docs/reference/cpu-environment.md section 3) and
    ``tl.dot`` on bf16 operands (multiplies the raw uint16 bits), with the fixes the test suite
    applies (tests/triton_support.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))
    try:
        from triton_support import patch_interpreter
    finally:
        sys.path.pop(0)
    if not patch_interpreter():
        raise SystemExit("triton is not installed: the smoke run needs its interpreter")
    return "tests/triton_support.patch_interpreter"


# --------------------------------------------------------------------------- kernels under test
class Impl:
    """store_kv / paged_attention: the Triton kernels, or the reference standing in (--impl)."""

    def __init__(self, want: str, cuda: bool, smoke: bool) -> None:
        from kvserve.kernels import reference

        self.reference = reference
        self.names: dict[str, str] = {}
        self.store_kv = self._pick("store", want, self._triton_store, lambda: reference.store_kv)
        self.paged_attention = self._pick("attention", want, self._triton_attention, lambda: self._ref_attention)
        if cuda and not smoke and "reference" in self.names.values():
            raise SystemExit(f"kernels {self.names}: the reference stand-in is for --smoke only")

    def _pick(self, what, want, triton_loader, ref_loader):
        if want in ("triton", "auto"):
            try:
                fn = triton_loader()
                self.names[what] = "triton"
                return fn
            except (ImportError, AttributeError) as e:
                if want == "triton":
                    raise SystemExit(f"--impl triton: {what} kernel unavailable: {e!r}")
                print(f"[impl] {what}: Triton kernel unavailable ({e!r}); reference stands in")
        self.names[what] = "reference"
        return ref_loader()

    @staticmethod
    def _triton_store():
        from kvserve.kernels import triton_store

        return triton_store.store_kv

    @staticmethod
    def _triton_attention():
        from kvserve.kernels import triton_attention

        return triton_attention.paged_attention

    def _ref_attention(self, query, kv_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len,
                       max_seq_len, quant=None, out=None, num_splits=None, pv_fp8=None, order=None):
        qsl = query_start_loc.tolist()
        qlens = [b - a for a, b in zip(qsl, qsl[1:])]
        if quant is not None and quant.query_fp8:
            o = self.reference.paged_attention_fp8_query(query, kv_cache, block_tables, qlens, seq_lens.tolist(), scale,
                                                         quant, 64)
        else:
            o = self.reference.paged_attention(query, kv_cache, block_tables, qlens, seq_lens.tolist(), scale, quant=quant)
        if out is None:
            return o
        out.copy_(o)
        return out


# --------------------------------------------------------------------------- timing
class Timer:
    def __init__(self, cuda: bool, warmup_ms: float, rep_ms: float, graph: bool, smoke_reps: int = 2) -> None:
        self.cuda, self.warmup_ms, self.rep_ms = cuda, warmup_ms, rep_ms
        self.graph = graph and cuda
        self.smoke_reps = smoke_reps
        self.graph_off: dict[str, str] = {}  # group -> why graph timing was switched off
        self.flush = torch.zeros(128 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda") if self.graph else None
        self.flush_sum = torch.zeros((), dtype=torch.int64, device="cuda") if self.graph else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, group: str = "") -> dict:
        if not self.cuda:
            fn()
            ts = []
            for _ in range(self.smoke_reps):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
            return {"ms": statistics.median(ts), "method": "perf_counter median (CPU smoke)"}
        import triton.testing

        try:
            ms = triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
        except TypeError:  # an older do_bench without return_mode
            ms = triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, quantiles=[0.5])
            ms = ms[0] if isinstance(ms, (list, tuple)) else ms
        res = {"ms": ms, "method": "do_bench median, L2 flushed per call"}
        if self.graph and group not in self.graph_off:
            res["graph_ms"] = self._graph_ms(fn, ms, group)
        if self.graph and group not in self.graph_off:
            res["clean_ms"] = self._graph_ms(fn, ms, group, clean=True)
        return res

    def _flush(self, clean: bool) -> None:
        """Evict L2: zero 128 MB (L2 left full of dirty lines, as do_bench leaves it: the next call
        pays their write-back, ~50 MB on Hopper) or read it (``clean``: clean lines, nothing to write
        back, as after the engine's own kernels, which read weights and write little)."""
        if clean:
            torch.sum(self.flush, dim=0, out=self.flush_sum)
        else:
            self.flush.zero_()

    def _capture(self, body) -> "torch.cuda.CUDAGraph":
        """capture_begin/end on the side stream: torch.cuda.graph() would also run gc.collect() and
        empty_cache() per capture (~0.2 s each with torch.compile's heap)."""
        g = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            g.capture_begin()
            try:
                body()
            finally:
                g.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        return g

    @staticmethod
    def _replay_ms(g, reps: int = 5) -> float:
        """Median of ``reps`` timed replays (CUDA events) after one warm replay."""
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)

    def _graph_ms(self, fn, est_ms: float, group: str, clean: bool = False):
        n = 1 << int(round(math.log2(min(64, max(4, 8.0 / max(est_ms, 1e-3))))))  # graph ~8 ms or 4 calls
        g = None
        try:
            if not hasattr(self, "stream"):
                self.stream = torch.cuda.Stream()
                self.flush_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):  # warm on the capture stream (allocator pools, guards)
                for _ in range(2):
                    self._flush(clean)
                    fn()
            torch.cuda.current_stream().wait_stream(self.stream)
            torch.cuda.synchronize()

            def body():
                for _ in range(n):
                    self._flush(clean)
                    fn()

            g = self._capture(body)
            if (n, clean) not in self.flush_graphs:  # flush-only graph of the same length, captured once per n
                self.flush_graphs[n, clean] = self._capture(lambda: [self._flush(clean) for _ in range(n)])
            t_with = self._replay_ms(g)
            t_flush = self._replay_ms(self.flush_graphs[n, clean])
            return max(t_with - t_flush, 0.0) / n
        except Exception as e:  # capture refused (host sync, ...): keep do_bench numbers only
            torch.cuda.synchronize()
            self.graph_off[group] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"[graph] {group}: CUDA-graph timing off: {self.graph_off[group]}")
            return None
        finally:
            del g


# --------------------------------------------------------------------------- helpers
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def gpu_state():
    """Read-only nvidia-smi query (clocks, temperature, power) for the record; None if unavailable."""
    import subprocess

    q = "name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit,utilization.gpu"
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=10)
        return r.stdout.strip() or r.stderr.strip()
    except Exception as e:  # noqa: BLE001
        return f"unavailable: {e!r}"


def flex_template_has_index_dtype() -> bool:
    """Whether the installed inductor's flex decode template computes its base offsets in INDEX_DTYPE
    (int64 when a buffer has 2^31 or more elements)."""
    import torch._inductor as ind

    root = os.path.join(os.path.dirname(ind.__file__), "kernel")
    for rel in ("flex/templates/flex_decode.py.jinja", "flex/flex_decoding.py", "flex_decoding.py"):
        path = os.path.join(root, rel)
        if os.path.exists(path):
            with open(path) as f:
                if "program_id(1).to(INDEX_DTYPE)" in f.read():
                    return True
    return False


def fmt(x, spec=".3g", none="-"):
    return none if x is None else format(x, spec)


class Run:
    def __init__(self, args) -> None:
        self.args = args
        self.cuda = torch.cuda.is_available() and not args.cpu
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        self.t0 = time.time()
        self.res: dict = {"checks": [], "errors": [], "skipped": [], "store": [], "decode": [], "flex": [], "prefill": [],
                          "flashinfer": [], "vllm_triton": [], "mixed": [], "ragged": []}
        self.failed = False
        self.flex_off: dict[str, str] = {}  # "dtype/variant" -> why that flex path was switched off
        self.fi = None  # FlashInfer's decode (setup_flashinfer)
        self.fi_off: dict[str, str] = {}  # "dtype/mode" -> why that FlashInfer path was switched off
        self.vt = None  # vLLM's Triton kernel (setup_vllm_triton)
        self.vt_off: dict[str, str] = {}  # dtype -> why that vLLM path was switched off

    # ---- bookkeeping
    def save(self) -> None:
        common.write_json(self.args.out, self.res)

    def check(self, name: str, err: float, **extra) -> bool:
        ok = err <= TOL and all(v == 0 for k, v in extra.items() if k in ("nonfinite", "changed_outside"))
        self.res["checks"].append({"name": name, "rel_err": err, "ok": ok, **extra})
        if not ok:
            self.failed = True
            print(f"[CHECK FAILED] {name}: rel_err={err:.3e} {extra}")
        return ok

    def error(self, where: str, e: BaseException) -> None:
        self.failed = True
        tb = traceback.format_exc()
        self.res["errors"].append({"where": where, "error": f"{type(e).__name__}: {e}", "traceback": tb[-4000:]})
        print(f"[ERROR] {where}: {type(e).__name__}: {str(e)[:500]}")

    def flex_error(self, where: str, name: str, e: BaseException, variant: str = "") -> None:
        """The peer failing to compile/run (e.g. an older torch without fp8 K/V in flex, or one of
        its templates failing for one mask structure) is recorded and switches that cache dtype and
        mask variant off for flex; it does not fail the run (wrong results do)."""
        self.flex_off[f"{name}/{variant}"] = f"{type(e).__name__}: {str(e)[:300]}"
        self.res.setdefault("flex_errors", []).append(
            {"where": where, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]})
        print(f"[flex] {where}: {type(e).__name__}: {str(e)[:300]} -> flex {name}/{variant} off for the rest of the run")
        if self.cuda:
            torch.cuda.synchronize()  # a device-side fault would surface here (and end the run)

    def over_budget(self, what: str) -> bool:
        if time.time() - self.t0 > self.args.time_budget_s:
            self.res["skipped"].append(what)
            print(f"[budget] {self.args.time_budget_s}s spent: skipping {what}")
            return True
        return False

    def gbps(self, nbytes: float, ms: float) -> float:
        return nbytes / (ms * 1e-3) / GB

    def decode_bytes(self, b: int, ctx: int, name: str) -> tuple[int, int]:
        """(KV bytes, all bytes) a paged decode of ``b`` sequences x ``ctx`` tokens reads and writes:
        K and V (2 bytes a value in bf16, 1 in fp8) + q + out (bf16) + the block table + seq lens
        and query starts (ours and the peers read the same)."""
        a = self.args
        kv = b * ctx * a.kv_heads * a.head_dim * 2 * (2 if name == "bf16" else 1)
        return kv, kv + 2 * b * a.q_heads * a.head_dim * 2 + b * math.ceil(ctx / a.block_size) * 4 + (2 * b + 1) * 4

    def pct(self, gbps: float):
        c = self.res.get("copy_bw_GBps")
        return 100.0 * gbps / c if c else None

    def randn(self, *shape, dtype=torch.bfloat16):
        return torch.randn(*shape, dtype=dtype, device=self.dev)

    def quant(self, query_fp8: bool = False):
        """The fp8 pages' scales; ``query_fp8``: read with the quantized query, P x 2^8 (FLASH_ATTN)."""
        r = self.impl.reference
        return r.CacheQuant(torch.float8_e4m3fn, 448.0, self.args.k_scale, self.args.v_scale, self.dev,
                            query_fp8=query_fp8, p_shift=8)

    DECODE_ONLY = ("fp8_unpaired", "fp8q_unpaired")  # decode variants: a prefill reads them as fp8 / fp8q

    def pv_kw(self, name: str) -> dict:
        """The kernel's keyword for a variant read: fp8q_pv8 (P @ V as an fp8 MMA, where the kernel
        can); fp8_unpaired / fp8q_unpaired (the decode by ``_attention_kernel``, the pages read in bytes,
        beside the default paired one)."""
        return {"fp8q_pv8": {"pv_fp8": True}, "fp8_unpaired": {"paired": False},
                "fp8q_unpaired": {"paired": False}}.get(name, {})

    def expect(self, q, pool, bt, qlens, slens, scale, quant, num_splits=1):
        """The check's ground truth: the reference read, or the quantized-query twin with the
        kernel's key tile and split-KV parts (``num_splits``)."""
        r = self.impl.reference
        if quant is not None and quant.query_fp8:
            from kvserve.kernels.triton_attention import fp8_query_key_tile

            tile = fp8_query_key_tile(q, pool, max(qlens), q.is_cuda, num_splits > 1)
            return r.paged_attention_fp8_query(q, pool, bt, qlens, slens, scale, quant, tile, num_splits=num_splits)
        return r.paged_attention(q, pool, bt, qlens, slens, scale, quant=quant)

    # ---- setup
    def setup(self) -> None:
        a = self.args
        import triton

        self.impl = Impl(a.impl, self.cuda, a.smoke)
        self.timer = Timer(self.cuda, a.warmup_ms, a.rep_ms, a.graph)
        props = torch.cuda.get_device_properties(0) if self.cuda else None
        self.num_sms = props.multi_processor_count if props else 0
        self.res.update({
            "run": common.run_info("kernel_bench", a.argv, a.smoke),
            "gpu": props.name if props else f"cpu ({platform.processor() or platform.machine()})",
            "num_sms": self.num_sms,
            "gpu_mem_GB": props.total_memory / GB if props else None,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "smoke": a.smoke, "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "impl": self.impl.names, "args": vars(a),
            "shape": {"q_heads": a.q_heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "block_size": a.block_size},
            "timing": "do_bench median with a 256 MB L2 flush (zeroing) before each call (GPU); graph_ms: CUDA graph "
                      "of [zero 128 MB, call] x n minus [zero 128 MB] x n, per call; clean_ms: the same with a read of "
                      "128 MB as the flush (no dirty lines to write back); perf_counter on CPU",
            "copy_bw_GBps": None,
        })
        self.res["gpu_state_start"] = gpu_state() if self.cuda else None
        print(f"[setup] {self.res['gpu']} torch {torch.__version__} triton {triton.__version__} impl {self.impl.names}")

    # ---- a. copy
    def bench_copy(self, key: str = "copy") -> None:
        n = self.args.copy_elems
        src = self.randn(n)
        dst = torch.empty_like(src)
        t = self.timer.time(lambda: dst.copy_(src), "copy")
        assert torch.equal(dst, src)
        bw = self.gbps(2 * n * 2, t["ms"])
        if key == "copy":
            self.res["copy_bw_GBps"] = bw
        self.res[key] = {"bytes_each_way": n * 2, **t, "GBps": bw}
        print(f"[{key}] {n * 2 / 2**30:.2f} GiB: {t['ms']:.3f} ms -> {bw:.0f} GB/s (read+write)")
        del src, dst

    # ---- pools
    def decode_points(self) -> list[tuple[int, int]]:
        a = self.args
        pts = []
        per_block = 2 * a.block_size * a.kv_heads * a.head_dim  # elements (bf16 or fp8 bytes) per block
        for b in a.batches:
            for c in a.contexts:
                kv = b * c * a.kv_heads * a.head_dim * 2 * 2
                if kv > a.max_kv_gb * GB:
                    self.res["skipped"].append(f"decode B={b} ctx={c}: bf16 KV {kv / GB:.1f} GB > {a.max_kv_gb} GB")
                    continue
                if a.int32_pools and b * math.ceil(c / a.block_size) * per_block >= 2**31:
                    self.res["skipped"].append(f"decode B={b} ctx={c}: needs a pool of >= 2^31 elements (--int32-pools)")
                    continue
                pts.append((b, c))
        return sorted(pts, key=lambda p: (p[0] * p[1], p[0]))

    def alloc_pools(self, points) -> None:
        a = self.args
        bs = a.block_size
        mixed = sum(math.ceil(n / bs) for n in self.mixed_batch()[1]) if "mixed" in a.sections else 0
        mixed = max(mixed, sum(math.ceil(n / bs) for n in self.ragged_lens()) if "ragged" in a.sections else 0)
        need = max([b * math.ceil(c / bs) for b, c in points] + [math.ceil(max(a.store_tokens) * 2 / bs),
                                                               math.ceil(max(a.prefill_tokens) / bs) + 1, mixed])
        self.pool_blocks = need
        shape = (need, 2, bs, a.kv_heads, a.head_dim)
        self.pool = {"bf16": torch.empty(shape, dtype=torch.bfloat16, device=self.dev),
                     "fp8": torch.empty(shape, dtype=torch.uint8, device=self.dev)}
        step = max(1, (1 << 28) // (2 * bs * a.kv_heads * a.head_dim))  # blocks per ~256M elements
        for s in range(0, need, step):
            self.pool["bf16"][s : s + step].normal_()
            x = torch.randn(self.pool["fp8"][s : s + step].shape, dtype=torch.float32, device=self.dev)
            x[:, 0] /= a.k_scale
            x[:, 1] /= a.v_scale
            self.pool["fp8"][s : s + step] = x.clamp_(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            del x
        gb = sum(t.numel() * t.element_size() for t in self.pool.values()) / GB
        self.res["pool"] = {"blocks": need, "GB": gb}
        print(f"[pool] {need} blocks of {bs} tokens: bf16 + fp8 pools {gb:.1f} GB")

    def caches(self):
        """bf16 pages; fp8 pages read dequantized (kvserve's triton); the same pages read with the
        quantized query (fp8q: vLLM's FLASH_ATTN)."""
        kinds = [("bf16", self.pool["bf16"], None), ("fp8", self.pool["fp8"], self.quant()),
                 ("fp8q", self.pool["fp8"], self.quant(query_fp8=True))]
        if self.args.fp8q_pv8:  # the same read with P @ V as an fp8 MMA (JSON only)
            kinds.append(("fp8q_pv8", self.pool["fp8"], self.quant(query_fp8=True)))
        if self.args.fp8_unpaired:  # both fp8 reads' decode by the unpaired kernel (decode, ragged)
            kinds += [("fp8_unpaired", self.pool["fp8"], self.quant()),
                      ("fp8q_unpaired", self.pool["fp8"], self.quant(query_fp8=True))]
        return tuple(kinds)

    # ---- b. store
    def bench_store(self) -> None:
        a = self.args
        hk, d, bs = a.kv_heads, a.head_dim, a.block_size
        ref = self.impl.reference
        for T in a.store_tokens:
            if self.over_budget(f"store T={T}"):
                return
            key, value = self.randn(T, hk, d), self.randn(T, hk, d)
            slots = torch.randperm(self.pool_blocks * bs, device=self.dev)[:T]
            for name, pool, quant in self.caches()[:2]:
                tag = f"store {name} T={T}"
                try:
                    self._check_store(tag, key, value, name, quant)
                    t = self.timer.time(lambda: self.impl.store_kv(key, value, pool, slots, quant), "store")
                    elem = 2 if name == "bf16" else 1  # fp8, fp8q: one byte
                    nbytes = 2 * T * hk * d * 2 + 2 * T * hk * d * elem + T * 8
                    bw = self.gbps(nbytes, t["ms"])
                    row = {"tokens": T, "cache_dtype": name, "bytes": nbytes, **t, "GBps": bw, "pct_copy": self.pct(bw)}
                    # the store is host-bound under do_bench (~45 us a call); the engine runs it in CUDA graphs
                    row["graph_pct_copy"] = self.pct(self.gbps(nbytes, t["graph_ms"])) if t.get("graph_ms") else None
                    row["clean_pct_copy"] = self.pct(self.gbps(nbytes, t["clean_ms"])) if t.get("clean_ms") else None
                    # a plain copy of the same bytes (half read, half written) in the same harness: what
                    # a kernel of this size reaches at best
                    same = self.same_size_copy(nbytes)
                    if same:
                        row["same_size_copy"] = same
                        if t.get("clean_ms") and same.get("clean_ms"):
                            row["clean_vs_same_size_copy"] = same["clean_ms"] / t["clean_ms"]
                    self.res["store"].append(row)
                    print(f"[store] T={T:6d} {name:4s} {t['ms'] * 1e3:9.2f} us {bw:7.0f} GB/s {fmt(row['pct_copy'], '.0f')}%cp"
                          f"  graph {fmt(row['graph_pct_copy'], '.0f')}%cp"
                          f"  clean {fmt(row['clean_pct_copy'], '.0f')}%cp"
                          f"  clean vs same-size copy {fmt(row.get('clean_vs_same_size_copy'), '.2f')}")
                except Exception as e:
                    self.error(tag, e)
                self.save()
            del key, value, slots

    def same_size_copy(self, nbytes: int) -> dict | None:
        """``dst.copy_(src)`` moving ``nbytes`` in all (read + write), timed like the kernels; cached."""
        if not self.cuda:
            return None
        cache = self.__dict__.setdefault("_same_size", {})
        if nbytes not in cache:
            n = nbytes // 4  # bf16 elements each way
            src = self.randn(n)
            dst = torch.empty_like(src)
            t = self.timer.time(lambda: dst.copy_(src), "copy")
            clean = self.pct(self.gbps(2 * n * 2, t["clean_ms"])) if t.get("clean_ms") else None
            cache[nbytes] = {"bytes": 2 * n * 2, **t, "pct_copy": self.pct(self.gbps(2 * n * 2, t["ms"])),
                             "clean_pct_copy": clean}
            del src, dst
        return cache[nbytes]

    def _check_store(self, tag, key, value, name, quant) -> None:
        a = self.args
        T, bs, hk, d = key.shape[0], a.block_size, a.kv_heads, a.head_dim
        nb = math.ceil(T * 1.25 / bs) + 2
        shape = (nb, 2, bs, hk, d)
        if name == "bf16":
            cache = self.randn(*shape)
        else:
            cache = torch.randint(0, 256, shape, dtype=torch.uint8, device=self.dev)
        slots = torch.randperm(nb * bs, device=self.dev)[:T]
        if T >= 4:
            slots[1] = -1
            slots[T // 2] = -1
        expect = cache.clone()
        self.impl.reference.store_kv(key, value, expect, slots, quant)
        self.impl.store_kv(key, value, cache, slots, quant)
        self.timer.sync()
        rows = cache.view(nb * 2 * bs, -1)
        erows = expect.view(nb * 2 * bs, -1)
        valid = slots[slots >= 0]
        krow = (valid // bs) * (2 * bs) + valid % bs
        written = torch.zeros(nb * 2 * bs, dtype=torch.bool, device=self.dev)
        written[krow] = True
        written[krow + bs] = True
        diff = (rows.view(torch.uint8) != erows.view(torch.uint8)).any(dim=1)
        changed_outside = int((diff & ~written).sum())
        mismatch = float(diff[written].float().mean())

        def deq(r, scale):
            return r.float() if quant is None else r.view(torch.float8_e4m3fn).float() * scale

        ks, vs = (1.0, 1.0) if quant is None else (quant.k_scale, quant.v_scale)
        got = torch.cat([deq(rows[krow], ks), deq(rows[krow + bs], vs)])
        want = torch.cat([deq(erows[krow], ks), deq(erows[krow + bs], vs)])
        self.check(tag, rel_err(got, want), changed_outside=changed_outside, row_mismatch_frac=mismatch)

    # ---- e. prefill
    def bench_prefill(self) -> None:
        """One sequence of T tokens, no cached context: ours over bf16 pages, fp8 pages read dequantized
        and read with the quantized query (impl ours / ours_fp8 / ours_fp8q), and SDPA on the bf16
        K / V (gqa and with K / V repeated)."""
        a = self.args
        hq, hk, d, bs = a.q_heads, a.kv_heads, a.head_dim, a.block_size
        scale = d ** -0.5
        ref = self.impl.reference
        F = torch.nn.functional
        impl_of = {"bf16": "ours", "fp8": "ours_fp8", "fp8q": "ours_fp8q", "fp8q_pv8": "ours_fp8q_pv8"}
        for T in a.prefill_tokens:
            if self.over_budget(f"prefill T={T}"):
                return
            tag = f"prefill T={T}"
            try:
                nblk = math.ceil(T / bs)
                bt = torch.randperm(self.pool_blocks, device=self.dev)[:nblk].to(torch.int32).view(1, nblk)
                k, v, q = self.randn(T, hk, d), self.randn(T, hk, d), self.randn(T, hq, d)
                pos = torch.arange(T, device=self.dev)
                slots = bt[0, pos // bs].long() * bs + pos % bs
                qsl = torch.tensor([0, T], dtype=torch.int32, device=self.dev)
                sl = torch.tensor([T], dtype=torch.int32, device=self.dev)
                out = torch.full_like(q, float("nan"))
                fns = {}
                for name, pool, quant in self.caches():
                    if name in self.DECODE_ONLY:
                        continue
                    ref.store_kv(k, v, pool, slots, quant)

                    def ours(pool=pool, quant=quant, kw=self.pv_kw(name)):
                        return self.impl.paged_attention(q, pool, bt, qsl, sl, scale, T, T, quant=quant, out=out, **kw)

                    out.fill_(float("nan"))
                    got = ours()
                    got = out if got is None else got
                    expect = self.expect(q, pool, bt, [T], [T], scale, quant)
                    self.check(f"{tag} {impl_of[name]}", rel_err(got, expect), nonfinite=int((~torch.isfinite(got)).sum()))
                    if name == "bf16":
                        bf16_expect = expect
                    fns[impl_of[name]] = ours
                qs, ks, vs = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
                kx, vx = ks.repeat_interleave(hq // hk, dim=1), vs.repeat_interleave(hq // hk, dim=1)

                def sdpa_gqa():
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)

                def sdpa_rep():
                    return F.scaled_dot_product_attention(qs, kx, vx, is_causal=True, scale=scale)

                for nm, fn in (("sdpa_gqa", sdpa_gqa), ("sdpa_repeat_kv", sdpa_rep)):
                    o = fn()[0].transpose(0, 1)
                    self.check(f"{tag} {nm}", rel_err(o, bf16_expect))
                fns.update(sdpa_gqa=sdpa_gqa, sdpa_repeat_kv=sdpa_rep)
                fns.update(self._sdpa_backends(tag, qs, kx, vx, scale, bf16_expect))
                flops = 2 * 2 * T * T / 2 * hq * d
                rows = {}
                for nm, fn in fns.items():
                    t = self.timer.time(fn, "prefill_" + nm)
                    rows[nm] = {"tokens": T, "impl": nm, "heads": [hq, hk, d], **t,
                                "tflops": flops / (t["ms"] * 1e-3) / 1e12}
                best = min(rows["sdpa_gqa"]["ms"], rows["sdpa_repeat_kv"]["ms"])
                for nm in (n for n in impl_of.values() if n in rows):
                    rows[nm]["speed_vs_best_sdpa"] = best / rows[nm]["ms"]
                    rows[nm]["speed_vs_bf16_pages"] = rows["ours"]["ms"] / rows[nm]["ms"]
                    for peer in (n for n in SDPA_BACKENDS if n in rows):
                        rows[nm][f"speed_vs_{peer}"] = rows[peer]["ms"] / rows[nm]["ms"]
                self.res["prefill"].extend(rows.values())
                print(f"[prefill] T={T:5d} ours bf16 / fp8 / fp8q {rows['ours']['tflops']:6.1f} / {rows['ours_fp8']['tflops']:6.1f}"
                      f" / {rows['ours_fp8q']['tflops']:6.1f} TF/s  sdpa_gqa {rows['sdpa_gqa']['tflops']:6.1f}"
                      f"  sdpa_rep {rows['sdpa_repeat_kv']['tflops']:6.1f}  ours/best {rows['ours']['speed_vs_best_sdpa']:.2f}x"
                      + "".join(f"  {n} {rows[n]['tflops']:6.1f}" for n in SDPA_BACKENDS if n in rows))
                del k, v, q, out, qs, ks, vs, kx, vx, bf16_expect
            except Exception as e:
                self.error(tag, e)
            self.save()

    def _sdpa_backends(self, tag, qs, kx, vx, scale, expect) -> dict:
        """SDPA pinned to each CUDA backend (torch's default may pick cuDNN's kernel over
        FlashAttention-2 on Hopper): the prefill peers by name; absent ones are recorded as skipped."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        fns = {}
        for nm, backend in SDPA_BACKENDS.items():
            if not self.cuda:
                self.res["skipped"].append(f"{tag} {nm}: needs CUDA")
                continue

            def fn(backend=getattr(SDPBackend, backend)):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(qs, kx, vx, is_causal=True, scale=scale)

            try:
                o = fn()[0].transpose(0, 1)
            except Exception as e:  # the backend does not take this shape / dtype / GPU
                self.res["skipped"].append(f"{tag} {nm}: {type(e).__name__}: {str(e)[:200]}")
                continue
            self.check(f"{tag} {nm}", rel_err(o, expect))
            fns[nm] = fn
        return fns

    # ---- mixed chunked-prefill batch
    def mixed_batch(self) -> tuple[list[int], list[int]]:
        """(query lens, seq lens): chunks of ``--mixed-chunk`` tokens at the cached contexts of
        ``--mixed-contexts`` (0: a fresh prefill), then ``--mixed-decodes`` decodes at contexts spread
        over [1k, 4k) (the smoke run: tiny)."""
        a = self.args
        qlens = [a.mixed_chunk] * len(a.mixed_contexts)
        slens = [a.mixed_chunk + c for c in a.mixed_contexts]
        lo, hi = (1, 200) if a.smoke else (1024, 4096)
        g = torch.Generator().manual_seed(1)
        slens += torch.randint(lo, hi, (a.mixed_decodes,), generator=g).tolist()
        return qlens + [1] * a.mixed_decodes, slens

    def bench_mixed(self) -> None:
        """Ours on the mixed batch (bf16 / fp8 / fp8q pages) and FlashAttention-2 varlen on the same
        bf16 K/V gathered dense: the prefill peer where SDPA has no varlen form."""
        if self.over_budget("mixed"):
            return
        a = self.args
        hq, hk, d, bs = a.q_heads, a.kv_heads, a.head_dim, a.block_size
        scale = d ** -0.5
        qlens, slens = self.mixed_batch()
        tag = f"mixed {len(qlens)} seqs {sum(qlens)} tokens"
        try:
            need = [math.ceil(n / bs) for n in slens]
            perm = torch.randperm(self.pool_blocks, device=self.dev)[: sum(need)].to(torch.int32)
            bt = torch.zeros(len(slens), max(need), dtype=torch.int32, device=self.dev)
            for i, (o, n) in enumerate(zip([0] + list(itertools.accumulate(need))[:-1], need)):
                bt[i, :n] = perm[o : o + n]
            qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32, device=self.dev)
            sl = torch.tensor(slens, dtype=torch.int32, device=self.dev)
            q = self.randn(sum(qlens), hq, d)
            out = torch.full_like(q, float("nan"))
            pairs = sum(n * (s - n) + n * (n + 1) // 2 for n, s in zip(qlens, slens))
            flops = 2 * 2 * pairs * hq * d
            rows, expect_bf16 = {}, None
            for name, pool, quant in self.caches():
                if name in self.DECODE_ONLY:
                    continue

                def ours(pool=pool, quant=quant, kw=self.pv_kw(name)):
                    return self.impl.paged_attention(q, pool, bt, qsl, sl, scale, max(qlens), max(slens), quant=quant,
                                                     out=out, **kw)

                out.fill_(float("nan"))
                got = ours()
                got = out if got is None else got
                expect = self.expect(q, pool, bt, qlens, slens, scale, quant)
                if name == "bf16":
                    expect_bf16 = expect
                self.check(f"{tag} ours {name}", rel_err(got, expect), nonfinite=int((~torch.isfinite(got)).sum()))
                t = self.timer.time(ours, "mixed")
                rows[name] = {"impl": "ours_" + name, **t, "tflops": flops / (t["ms"] * 1e-3) / 1e12}
            fa2 = self._fa2_varlen(tag, q, bt, qlens, slens, scale, expect_bf16)
            if fa2 is not None:
                t = self.timer.time(fa2, "mixed")
                rows["fa2_varlen"] = {"impl": "fa2_varlen", **t, "tflops": flops / (t["ms"] * 1e-3) / 1e12}
            for name, row in rows.items():
                row.update(query_lens=qlens[: len(a.mixed_contexts)] + [f"{a.mixed_decodes} x 1"],
                           contexts=a.mixed_contexts, tokens=sum(qlens), heads=[hq, hk, d])
                if "fa2_varlen" in rows and name != "fa2_varlen":
                    row["speed_vs_fa2_varlen"] = rows["fa2_varlen"]["ms"] / row["ms"]
                if name != "bf16" and not name.startswith("fa2"):
                    row["speed_vs_bf16_pages"] = rows["bf16"]["ms"] / row["ms"]
            self.res["mixed"].extend(rows.values())
            print(f"[mixed] {tag}: " + "  ".join(f"{n} {r['ms'] * 1e3:.1f}us {r['tflops']:.1f}TF/s"
                                                 for n, r in rows.items()))
        except Exception as e:
            self.error(tag, e)
        self.save()

    def ragged_lens(self) -> list[int]:
        """The ragged decode batch's contexts: uniform in [64, 2 x --ragged-mean] (seeded), the spread
        of the end-to-end workload's decode steps."""
        a = self.args
        g = torch.Generator().manual_seed(1234)
        return torch.randint(64, 2 * a.ragged_mean + 1, (a.ragged_batch,), generator=g).tolist()

    def bench_ragged(self) -> None:
        """One decode batch of ragged contexts (bf16 / fp8 / fp8q pages), its programs launched in
        batch order and in the runner's order (longest sequence first, ``decode_order``): the
        launch order's effect where lengths differ, which the uniform grid cannot show."""
        if self.over_budget("ragged"):
            return
        from kvserve.kernels.triton_attention import choose_num_splits
        from kvserve.layers.attention import decode_order

        a = self.args
        hq, hk, d, bs = a.q_heads, a.kv_heads, a.head_dim, a.block_size
        scale = d ** -0.5
        slens = self.ragged_lens()
        b = len(slens)
        tag = f"ragged B={b} ctx {min(slens)}-{max(slens)}"
        try:
            need = [math.ceil(n / bs) for n in slens]
            perm = torch.randperm(self.pool_blocks, device=self.dev)[: sum(need)].to(torch.int32)
            bt = torch.zeros(b, max(need), dtype=torch.int32, device=self.dev)
            for i, (o, n) in enumerate(zip([0] + list(itertools.accumulate(need))[:-1], need)):
                bt[i, :n] = perm[o : o + n]
            qsl = torch.arange(b + 1, dtype=torch.int32, device=self.dev)
            sl = torch.tensor(slens, dtype=torch.int32, device=self.dev)
            orders = {"batch_order": qsl[:b],
                      "longest_first": torch.tensor(decode_order(slens), dtype=torch.int32, device=self.dev)}
            q = self.randn(b, hq, d)
            out = torch.empty_like(q)
            rows = sorted({0, b - 1, int(torch.tensor(slens).argmax())})
            line = []
            for name, pool, quant in self.caches():
                if name == "fp8q_pv8":
                    continue
                ms = {}
                for oname, order in orders.items():
                    def ours(pool=pool, quant=quant, order=order, kw=self.pv_kw(name)):
                        return self.impl.paged_attention(q, pool, bt, qsl, sl, scale, 1, max(slens), quant=quant,
                                                         out=out, order=order, **kw)

                    out.fill_(float("nan"))
                    ours()
                    splits = choose_num_splits(b, hk, max(slens), q.device)
                    expect = self.expect(q[rows], pool, bt[rows], [1] * len(rows), [slens[i] for i in rows], scale,
                                         quant, splits)
                    self.check(f"{tag} {name} {oname}", rel_err(out[rows], expect),
                               nonfinite=int((~torch.isfinite(out)).sum()))
                    t = self.timer.time(ours, "ragged")
                    kv, nbytes = self.decode_bytes(b, sum(slens) // b, name)
                    row = {"batch": b, "contexts": [min(slens), max(slens), sum(slens) / b], "cache_dtype": name,
                           "order": oname, "bytes": nbytes, **t, "pct_copy": self.pct(self.gbps(nbytes, t["ms"])),
                           "clean_pct_copy": self.pct(self.gbps(nbytes, t["clean_ms"])) if t.get("clean_ms") else None}
                    ms[oname] = t
                    self.res["ragged"].append(row)
                fast = ms["batch_order"]["ms"] / ms["longest_first"]["ms"]
                line.append(f"{name} {ms['batch_order']['ms'] * 1e3:.1f} -> {ms['longest_first']['ms'] * 1e3:.1f}us "
                            f"({fast:.2f}x)")
            print(f"[ragged] {tag} (batch order -> longest first): " + "  ".join(line))
        except Exception as e:
            self.error(tag, e)
        self.save()

    def _fa2_varlen(self, tag, q, bt, qlens, slens, scale, expect):
        """torch's FlashAttention-2 varlen call on the mixed batch's bf16 K/V (packed dense per
        sequence), checked against the reference read; None (recorded) where it cannot run."""
        if not self.cuda:
            self.res["skipped"].append(f"{tag} fa2_varlen: needs CUDA")
            return None
        try:
            from torch.nn.attention import varlen
        except ImportError as e:
            self.res["skipped"].append(f"{tag} fa2_varlen: {e}")
            return None
        a = self.args
        bs = a.block_size
        pages = self.pool["bf16"]
        kv = torch.cat([pages[bt[i, : math.ceil(s / bs)].long()].transpose(0, 1)
                        .reshape(2, -1, a.kv_heads, a.head_dim)[:, :s] for i, s in enumerate(slens)], dim=1)
        k, v = kv[0], kv[1]
        params = inspect.signature(varlen.varlen_attn).parameters
        kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}  # torch 2.10: is_causal
        if "scale" in params:
            kw["scale"] = scale
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(a.q_heads // a.kv_heads, dim=1) for x in (k, v))
        dev = q.device
        cu_q = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0] + list(itertools.accumulate(slens)), dtype=torch.int32, device=dev)

        def fa2():
            return varlen.varlen_attn(q, k, v, cu_q, cu_k, max(qlens), max(slens), **kw)

        try:
            got = fa2()
        except Exception as e:  # an older torch, a GPU or shape FlashAttention-2 does not take
            self.res["skipped"].append(f"{tag} fa2_varlen: {type(e).__name__}: {str(e)[:200]}")
            return None
        self.check(f"{tag} fa2_varlen", rel_err(got, expect), nonfinite=int((~torch.isfinite(got)).sum()))
        return fa2

    # ---- c + d. decode (ours) and flex
    def setup_flex(self, points) -> None:
        import flex_paged

        a = self.args
        ps = a.flex_page_size
        # Flex's Triton template forms offs_n * stride_kn in int32 (vLLM #50427, pytorch #185264): with
        # the [1, Hk, N, D] layout that is N * D < 2^31. Head offsets are int64 only where the template
        # uses INDEX_DTYPE; otherwise the whole K tensor must stay under 2^31 elements.
        int64_heads = flex_template_has_index_dtype()
        max_tokens = (2**31 - 1) // a.head_dim
        if not int64_heads:
            max_tokens = min(max_tokens, (2**31 - 1) // (a.kv_heads * a.head_dim))
        max_pages = max_tokens // ps
        self.flex_points = set()
        for b, c in points:
            if b * math.ceil(c / ps) <= max_pages:
                self.flex_points.add((b, c))
            else:
                self.res["skipped"].append(f"flex B={b} ctx={c}: pool of > {max_pages} pages would overflow flex's "
                                           f"32-bit offsets (INDEX_DTYPE in template: {int64_heads})")
        need = [b * math.ceil(c / ps) for b, c in self.flex_points] + [sum(math.ceil(n / ps) for n in a.flex_check_lens)]
        n_pages = min(max(need), max_pages)
        dtypes = ("bf16", "fp8") if a.flex_fp8 else ("bf16",)
        self.flex_mod = flex_paged
        self.flex = flex_paged.FlexPagedDecode(n_pages, ps, a.kv_heads, a.head_dim, self.dev, dtypes=dtypes)
        self.flex.fill_random_(a.k_scale, a.v_scale)
        gb = sum(t.numel() * t.element_size() for t in list(self.flex.k.values()) + list(self.flex.v.values())) / GB
        self.res["flex_setup"] = {"page_size": ps, "n_pages": n_pages, "pool_GB": gb, "dtypes": list(dtypes),
                                  "template_int64_head_offsets": int64_heads,
                                  "layout": "[1, Hk, n_pages*page_size, D] per K and V",
                                  "compile": "torch.compile(flex_attention, dynamic=False)",
                                  "variants": a.flex_variants}
        print(f"[flex] pool {n_pages} pages x {ps} tokens, {gb:.1f} GB, dtypes {dtypes}")
        self._flex_reference_check()

    def flex_variants(self, b: int) -> list[str]:
        v = self.args.flex_variants
        if v == "both":
            return list(self.flex_mod.VARIANTS)
        if v == "auto":
            if not self.cuda:  # smoke: exercise both structures
                return list(self.flex_mod.VARIANTS)
            return [self.flex_mod.variant_for_batch(b, self.args.kv_heads, self.num_sms)]
        return [v]

    def _flex_reference_check(self) -> None:
        """Small ragged batch: flex (every variant used by the bench for that batch size) vs
        kvserve.kernels.reference.paged_attention on the same K/V, copied into flex pages."""
        a = self.args
        ref = self.impl.reference
        hq, hk, d, bs = a.q_heads, a.kv_heads, a.head_dim, a.block_size
        lens = list(a.flex_check_lens)
        b = len(lens)
        scale = d ** -0.5
        q = self.randn(b, hq, d)
        mb = max(math.ceil(n / bs) for n in lens)
        nb = sum(math.ceil(n / bs) for n in lens) + 3
        for name in self.flex.k:
            quant = self.quant() if name == "fp8" else None
            cache = (self.randn(nb, 2, bs, hk, d) if name == "bf16"
                     else torch.randint(0, 256, (nb, 2, bs, hk, d), dtype=torch.uint8, device=self.dev))
            perm = torch.randperm(nb, device=self.dev).to(torch.int32)
            bt = torch.zeros(b, mb, dtype=torch.int32, device=self.dev)
            used = 0
            for i, n in enumerate(lens):
                m = math.ceil(n / bs)
                bt[i, :m] = perm[used : used + m]
                used += m
                pos = torch.arange(n, device=self.dev)
                ref.store_kv(self.randn(n, hk, d), self.randn(n, hk, d), cache, bt[i, pos // bs].long() * bs + pos % bs, quant)
            expect = ref.paged_attention(q, cache, bt, [1] * b, lens, scale, quant=quant)
            rows = cache.view(-1, hk, d)
            for variant in self.flex_mod.VARIANTS:
                if f"{name}/{variant}" in self.flex_off:
                    continue
                tag = f"flex {name} {variant} reference check B={b} lens={lens}"
                try:
                    fb = self.flex.plan(lens, variant, seed=123)
                    for i, n in enumerate(lens):
                        pos = torch.arange(n, device=self.dev)
                        r = bt[i, pos // bs].long() * (2 * bs) + pos % bs
                        self.flex.write_logical(fb, i, name, rows[r], rows[r + bs])
                    got = self.flex.run(q, fb, name, scale, a.k_scale, a.v_scale)
                    err = rel_err(got, expect)
                    self.check(tag, err, path=self.flex.path(name, variant))
                    print(f"[flex check] {name} {variant} ({self.flex.path(name, variant)}): rel err {err:.2e} vs reference")
                except Exception as e:
                    self.flex_error(tag, name, e, variant)
        self.save()

    def bench_decode(self, points) -> None:
        from kvserve.kernels.triton_attention import choose_num_splits

        a = self.args
        hq, hk, d, bs = a.q_heads, a.kv_heads, a.head_dim, a.block_size
        scale = d ** -0.5
        for b, ctx in points:
            if self.over_budget(f"decode B={b} ctx={ctx}"):
                break
            nblk = math.ceil(ctx / bs)
            bt = torch.randperm(self.pool_blocks, device=self.dev)[: b * nblk].to(torch.int32).view(b, nblk)
            qsl = torch.arange(b + 1, dtype=torch.int32, device=self.dev)
            sl = torch.full((b,), ctx, dtype=torch.int32, device=self.dev)
            order = qsl[:b]  # the runner's launch order (longest first: the batch order at equal lengths)
            q = self.randn(b, hq, d)
            out = torch.empty_like(q)
            rows = sorted({0, b - 1})
            line = [f"B={b:4d} ctx={ctx:6d}"]
            ms_of = {}
            for name, pool, quant in (self.caches() if a.ours_decode else ()):
                tag = f"decode ours {name} B={b} ctx={ctx}"
                try:
                    out.fill_(float("nan"))
                    got = self.impl.paged_attention(q, pool, bt, qsl, sl, scale, 1, ctx, quant=quant, out=out,
                                                    order=order, **self.pv_kw(name))
                    got = out if got is None else got
                    splits = choose_num_splits(b, hk, ctx, q.device)
                    expect = self.expect(q[rows], pool, bt[rows], [1] * len(rows), [ctx] * len(rows), scale, quant, splits)
                    err = rel_err(got[rows], expect)
                    self.check(tag, err, nonfinite=int((~torch.isfinite(got)).sum()))
                    if a.smoke:  # off CUDA the auto choice never splits: exercise the split-KV path too
                        out.fill_(float("nan"))
                        self.impl.paged_attention(q, pool, bt, qsl, sl, scale, 1, ctx, quant=quant, out=out, num_splits=2,
                                                  **self.pv_kw(name))
                        expect = self.expect(q[rows], pool, bt[rows], [1] * len(rows), [ctx] * len(rows), scale, quant, 2)
                        self.check(tag + " num_splits=2", rel_err(out[rows], expect),
                                   nonfinite=int((~torch.isfinite(out)).sum()))
                    del expect, got
                    t = self.timer.time(lambda: self.impl.paged_attention(q, pool, bt, qsl, sl, scale, 1, ctx, quant=quant,
                                                                          out=out, order=order, **self.pv_kw(name)),
                                        "decode_ours")
                    kv, nbytes = self.decode_bytes(b, ctx, name)
                    bw = self.gbps(nbytes, t["ms"])
                    row = {"batch": b, "context": ctx, "cache_dtype": name, "kv_bytes": kv, "bytes": nbytes, **t,
                           "GBps": bw, "pct_copy": self.pct(bw), "tokens_per_s": b / (t["ms"] * 1e-3), "rel_err": err,
                           "clean_pct_copy": self.pct(self.gbps(nbytes, t["clean_ms"])) if t.get("clean_ms") else None}
                    ms_of[name] = t["ms"]
                    if name != "bf16" and "bf16" in ms_of:
                        row["fp8_speedup"] = ms_of["bf16"] / t["ms"]
                    self.res["decode"].append(row)
                    line.append(f"{name} {t['ms'] * 1e3:8.1f}us {bw:5.0f}GB/s {fmt(row['pct_copy'], '.0f')}%")
                except Exception as e:
                    self.error(tag, e)
            for name in ("fp8", "fp8q", *self.DECODE_ONLY):
                if name in ms_of and "bf16" in ms_of:
                    line.append(f"{name}x {ms_of['bf16'] / ms_of[name]:.2f}")
            if a.flex and (b, ctx) in self.flex_points:
                line += self._flex_point(b, ctx, q, scale, rows)
            if self.fi is not None:
                line += self._flashinfer_point(b, ctx, q, bt, scale, rows)
            if self.vt is not None:
                line += self._vllm_triton_point(b, ctx, q, bt, qsl, sl, scale, rows)
            print("[decode] " + " | ".join(line))
            del bt, qsl, sl, q, out
            self.save()

    def _flex_point(self, b, ctx, q, scale, rows) -> list[str]:
        a = self.args
        hq, hk, d = a.q_heads, a.kv_heads, a.head_dim
        ps = a.flex_page_size
        line = []
        plans = {}  # one page table + mask per variant, shared by bf16 and fp8
        for name in self.flex.k:
            best = None
            usable = [v for v in self.flex_mod.VARIANTS if f"{name}/{v}" not in self.flex_off]
            chosen = [v for v in self.flex_variants(b) if v in usable] or usable[:1]  # fall back to a working one
            for variant in chosen:
                tag = f"decode flex {name} {variant} B={b} ctx={ctx}"
                try:
                    if variant not in plans:
                        plans[variant] = self.flex.plan([ctx] * b, variant, seed=b * 100003 + ctx)
                    fb = plans[variant]
                    got = self.flex.run(q, fb, name, scale, a.k_scale, a.v_scale)
                    errs = []
                    for i in rows:
                        k, v = self.flex.gather_logical(fb, i, name, a.k_scale, a.v_scale)
                        o = torch.nn.functional.scaled_dot_product_attention(
                            q[i].float().view(1, hq, 1, d), k.unsqueeze(0), v.unsqueeze(0), scale=scale, enable_gqa=True)
                        errs.append(rel_err(got[i], o.view(hq, d)))
                    self.check(tag + " (rows vs fp32 SDPA over its pages)", max(errs),
                               nonfinite=int((~torch.isfinite(got)).sum()))
                    del got
                    t = self.timer.time(lambda: self.flex.run(q, fb, name, scale, a.k_scale, a.v_scale), "flex")
                    elem = 2 if name == "bf16" else 1  # fp8, fp8q: one byte
                    kv = b * ctx * hk * d * 2 * elem
                    nbytes = kv + 2 * b * hq * d * 2 + fb.num_pages_used * 4 + b * 4 * 2
                    bw = self.gbps(nbytes, t["ms"])
                    row = {"batch": b, "context": ctx, "cache_dtype": name, "variant": variant,
                           "path": self.flex.path(name, variant), "page_size": ps, "kv_bytes": kv, "bytes": nbytes, **t,
                           "GBps": bw, "pct_copy": self.pct(bw), "tokens_per_s": b / (t["ms"] * 1e-3)}
                    self.res["flex"].append(row)
                    if best is None or t["ms"] < best["ms"]:
                        best = row
                except Exception as e:
                    self.flex_error(tag, name, e, variant)
            if best is not None:
                best["best_of_variants"] = True
                line.append(f"flex-{name}({best['variant'][0]}) {best['ms'] * 1e3:8.1f}us {fmt(best['pct_copy'], '.0f')}%")
        return line

    def setup_flashinfer(self) -> None:
        """FlashInfer as the decode peer where it imports; why not, in the JSON, where it does not."""
        import flashinfer_peer

        self.fi = None
        why = "--no-flashinfer" if not self.args.flashinfer else flashinfer_peer.available()
        if why:
            self.res["skipped"].append(f"flashinfer: {why}")
            return
        self.fi = flashinfer_peer.FlashInferDecode(self.dev)
        self.res["flashinfer_version"] = self.fi.version
        print(f"[flashinfer] {self.fi.version}: decode peer on (modes {list(flashinfer_peer.MODES)})")

    def _flashinfer_point(self, b, ctx, q, bt, scale, rows) -> list[str]:
        """FlashInfer on this point's pages, bf16 and fp8, each mode checked on rows 0 and B-1 against
        the reference read, timed like ours; the faster mode is marked best_of_modes."""
        a = self.args
        hq, hk, d, bs = a.q_heads, a.kv_heads, a.head_dim, a.block_size
        line = []
        for name, pool, quant in self.caches()[:2]:  # bf16, fp8 (FlashInfer reads fp8 pages one way)
            scales = {"k_scale": a.k_scale, "v_scale": a.v_scale} if quant is not None else {}
            expect = self.expect(q[rows], pool, bt[rows], [1] * len(rows), [ctx] * len(rows), scale, quant)
            best = None
            for mode in self.fi.wrappers:
                tag = f"decode flashinfer {name} {mode} B={b} ctx={ctx}"
                if f"{name}/{mode}" in self.fi_off:
                    continue
                try:
                    self.fi.plan(mode, bt, ctx, hq, hk, d, bs, quant is not None, scale)
                    out = torch.full_like(q, float("nan"))
                    self.fi.run(mode, q, pool, out, **scales)
                    err = rel_err(out[rows], expect)
                    self.check(tag, err, nonfinite=int((~torch.isfinite(out)).sum()))
                    t = self.timer.time(lambda: self.fi.run(mode, q, pool, out, **scales), "flashinfer")
                    kv, nbytes = self.decode_bytes(b, ctx, name)
                    bw = self.gbps(nbytes, t["ms"])
                    row = {"batch": b, "context": ctx, "cache_dtype": name, "mode": mode, "kv_bytes": kv,
                           "bytes": nbytes, **t, "GBps": bw, "pct_copy": self.pct(bw), "rel_err": err,
                           "clean_pct_copy": self.pct(self.gbps(nbytes, t["clean_ms"])) if t.get("clean_ms") else None}
                    self.res["flashinfer"].append(row)
                    if best is None or t["ms"] < best["ms"]:
                        best = row
                except Exception as e:  # a mode FlashInfer cannot build or run for this dtype: off, recorded
                    self.fi_off[f"{name}/{mode}"] = f"{type(e).__name__}: {str(e)[:300]}"
                    self.res.setdefault("flashinfer_errors", []).append({
                        "where": tag, "error": f"{type(e).__name__}: {e}"[:2000],
                        "traceback": traceback.format_exc()[-3000:]})
                    print(f"[flashinfer] {tag}: {type(e).__name__}: {str(e)[:300]} -> off for the rest of the run")
                    torch.cuda.synchronize()
            if best is not None:
                best["best_of_modes"] = True
                line.append(f"fi-{name}({best['mode'][0]}) {best['ms'] * 1e3:8.1f}us {fmt(best['pct_copy'], '.0f')}%")
        return line

    def setup_vllm_triton(self, points) -> None:
        """vLLM's Triton kernel as a decode peer where its source is given; why not, where not."""
        import vllm_triton_peer

        a = self.args
        why = vllm_triton_peer.available(a.vllm_triton_src)
        if why is None and not self.cuda and not a.smoke:
            why = "no CUDA device"
        if why:
            self.res["skipped"].append(f"vllm_triton: {why}")
            return
        self.vt = vllm_triton_peer.VllmTritonAttention(a.vllm_triton_src, a.q_heads, a.kv_heads, a.head_dim,
                                                       max(b for b, _ in points), self.dev)
        self.res["vllm_triton_src"] = str(a.vllm_triton_src)
        print(f"[vllm_triton] {a.vllm_triton_src}: decode peer on (3D up to {self.vt.seq_threshold_3d} sequences)")

    def _vllm_triton_point(self, b, ctx, q, bt, qsl, sl, scale, rows) -> list[str]:
        """vLLM's kernel on this point's pages, bf16 and fp8, checked on rows 0 and B-1 (bf16 against
        the reference read; fp8 against the quantized-query twin with its P unshifted, its 32-key
        tile and its split-KV segments), timed like ours."""
        import vllm_triton_peer as vp

        r = self.impl.reference
        line = []
        for name, pool, quant in self.caches()[:2]:
            tag = f"decode vllm_triton {name} B={b} ctx={ctx}"
            if name in self.vt_off:
                continue
            if quant is not None:
                quant = dataclasses.replace(quant, query_fp8=True, p_shift=0)
            try:
                out = torch.full_like(q, float("nan"))
                self.vt.run(q, pool, bt, qsl, sl, 1, ctx, scale, out, quant)
                n = len(rows)
                if quant is None:
                    expect = r.paged_attention(q[rows], pool, bt[rows], [1] * n, [ctx] * n, scale)
                else:
                    splits = vp.NUM_PAR_SOFTMAX_SEGMENTS if self.vt.uses_3d(b) else 1
                    expect = r.paged_attention_fp8_query(q[rows], pool, bt[rows], [1] * n, [ctx] * n, scale, quant,
                                                         vp.TILE_FP8, num_splits=splits)
                err = rel_err(out[rows], expect)
                self.check(tag, err, nonfinite=int((~torch.isfinite(out)).sum()))
                t = self.timer.time(lambda: self.vt.run(q, pool, bt, qsl, sl, 1, ctx, scale, out, quant),
                                    "vllm_triton")
                kv, nbytes = self.decode_bytes(b, ctx, name)
                bw = self.gbps(nbytes, t["ms"])
                self.res["vllm_triton"].append({
                    "batch": b, "context": ctx, "cache_dtype": name, "launch": "3d" if self.vt.uses_3d(b) else "2d",
                    "kv_bytes": kv, "bytes": nbytes, **t, "GBps": bw, "pct_copy": self.pct(bw), "rel_err": err})
                line.append(f"vllm-{name} {t['ms'] * 1e3:8.1f}us {fmt(self.pct(bw), '.0f')}%")
            except Exception as e:  # a release whose kernel does not build or run here: off, recorded
                self.vt_off[name] = f"{type(e).__name__}: {str(e)[:300]}"
                self.res.setdefault("vllm_triton_errors", []).append({
                    "where": tag, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]})
                print(f"[vllm_triton] {tag}: {type(e).__name__}: {str(e)[:300]} -> off for the rest of the run")
                if self.cuda:
                    torch.cuda.synchronize()
        return line

    # ---- smoke: int64 offsets with pools of more than 2^31 elements (CPU interpreter)
    def bigpool_check(self) -> None:
        print("[bigpool] store + decode at the far end of pools of more than 2^31 elements; a crash "
              "(segfault) here means 32-bit offset arithmetic in a kernel", flush=True)
        a = self.args
        ref = self.impl.reference
        hq, hk, d, bs = 32, 8, 128, 16
        per_block = 2 * bs * hk * d
        nb = (1 << 31) // per_block + 8
        ctx, b = 40, 2
        nblk = math.ceil(ctx / bs)
        bt = torch.tensor([[nb - 1 - 2 * j - i for j in range(nblk)] for i in range(b)], dtype=torch.int32)
        q = torch.randn(b, hq, d, dtype=torch.bfloat16)
        for name in ("fp8", "bf16"):
            quant = self.quant() if name == "fp8" else None
            tag = f"bigpool {name}: {nb} blocks = {nb * per_block / 2**31:.3f} x 2^31 elements"
            try:
                cache = torch.empty(nb, 2, bs, hk, d, dtype=torch.bfloat16 if name == "bf16" else torch.uint8)
                cache[nb - 2 * nblk - 2 :] = 0 if name == "fp8" else 0.0  # blocks used below start defined
                pos = torch.arange(ctx)
                slots = torch.cat([bt[i, pos // bs].long() * bs + pos % bs for i in range(b)])
                k, v = torch.randn(b * ctx, hk, d, dtype=torch.bfloat16), torch.randn(b * ctx, hk, d, dtype=torch.bfloat16)
                self.impl.store_kv(k, v, cache, slots, quant)
                rows = cache.view(nb * 2 * bs, hk, d)
                krow = (slots // bs) * (2 * bs) + slots % bs
                if quant is None:
                    want_k, want_v = k, v
                else:
                    want_k = ref.quantize_fp8(k, quant.k_scale_t, quant.fp8_dtype, quant.fp8_max)
                    want_v = ref.quantize_fp8(v, quant.v_scale_t, quant.fp8_dtype, quant.fp8_max)
                bad = int((rows[krow].view(torch.uint8) != want_k.view(torch.uint8)).sum()
                          + (rows[krow + bs].view(torch.uint8) != want_v.view(torch.uint8)).sum())
                self.check(tag + " store", 0.0 if bad == 0 else float("inf"), bytes_wrong=bad)
                out = torch.full_like(q, float("nan"))
                qsl = torch.arange(b + 1, dtype=torch.int32)
                sl = torch.full((b,), ctx, dtype=torch.int32)
                got = self.impl.paged_attention(q, cache, bt, qsl, sl, d ** -0.5, 1, ctx, quant=quant, out=out)
                got = out if got is None else got
                expect = ref.paged_attention(q, cache, bt, [1] * b, [ctx] * b, d ** -0.5, quant=quant)
                err = rel_err(got, expect)
                self.check(tag + " decode", err, nonfinite=int((~torch.isfinite(got)).sum()))
                print(f"[bigpool] {name}: store bytes wrong {bad}, decode rel err {err:.2e}")
                del cache, rows
            except Exception as e:
                self.error(tag, e)
            self.save()

    def _by_point(self) -> tuple[dict, dict]:
        """Our decode rows and the fastest flex variant, each keyed by (batch, context, cache dtype)."""
        dec = {(d["batch"], d["context"], d["cache_dtype"]): d for d in self.res["decode"]}
        best: dict = {}
        for f in self.res["flex"]:
            k = (f["batch"], f["context"], f["cache_dtype"])
            if k not in best or f["ms"] < best[k]["ms"]:
                best[k] = f
        return dec, best

    def summarize(self) -> None:
        r = self.res
        dec, best = self._by_point()
        r["ours_vs_flex"] = [
            {"batch": k[0], "context": k[1], "cache_dtype": k[2], "ours_ms": dec[k]["ms"], "flex_ms": f["ms"],
             "flex_variant": f["variant"], "ours_speedup": f["ms"] / dec[k]["ms"]}
            for k, f in sorted(best.items()) if k in dec]
        fi = {(f["batch"], f["context"], f["cache_dtype"]): f for f in r["flashinfer"] if f.get("best_of_modes")}
        # FlashInfer's fp8 read against both of ours: the dequantizing one (fp8) and the quantized query (fp8q)
        r["ours_vs_flashinfer"] = [
            {"batch": b, "context": c, "cache_dtype": ours, "ours_ms": dec[(b, c, ours)]["ms"],
             "flashinfer_ms": f["ms"], "flashinfer_mode": f["mode"], "ours_speedup": f["ms"] / dec[(b, c, ours)]["ms"],
             "ours_speedup_clean": _ratio(f.get("clean_ms"), dec[(b, c, ours)].get("clean_ms"))}
            for (b, c, name), f in sorted(fi.items()) for ours in ((name,) if name == "bf16" else ("fp8", "fp8q"))
            if (b, c, ours) in dec]
        r["flashinfer_off"] = self.fi_off
        vt = {(v["batch"], v["context"], v["cache_dtype"]): v for v in r["vllm_triton"]}
        r["ours_vs_vllm_triton"] = [
            {"batch": b, "context": c, "cache_dtype": ours, "ours_ms": dec[(b, c, ours)]["ms"],
             "vllm_triton_ms": v["ms"], "vllm_triton_launch": v["launch"],
             "ours_speedup": v["ms"] / dec[(b, c, ours)]["ms"],
             "ours_speedup_clean": _ratio(v.get("clean_ms"), dec[(b, c, ours)].get("clean_ms"))}
            for (b, c, name), v in sorted(vt.items()) for ours in ((name,) if name == "bf16" else ("fp8", "fp8q"))
            if (b, c, ours) in dec]
        r["vllm_triton_off"] = self.vt_off
        r["graph_timing_off"] = self.timer.graph_off if hasattr(self, "timer") else {}
        r["flex_off"] = self.flex_off

    def headline(self) -> str:
        r = self.res
        speedups = [d["fp8_speedup"] for d in r["decode"] if d.get("fp8_speedup")]
        prefill = [p["speed_vs_best_sdpa"] for p in r["prefill"] if "speed_vs_best_sdpa" in p]
        bad = sum(not c["ok"] for c in r["checks"])
        parts = [f"kernels on {r.get('gpu')}: {len(r['checks'])} checks, {bad} failed, {len(r['errors'])} errors",
                 f"copy {fmt(r.get('copy_bw_GBps'), '.0f')} GB/s", f"decode {len(r['decode'])} points"]
        if speedups:
            parts.append(f"fp8/bf16 {min(speedups):.2f}-{max(speedups):.2f}x")
        if prefill:
            parts.append(f"prefill ours/SDPA {min(prefill):.2f}-{max(prefill):.2f}x")
        return "; ".join(parts)

    # ---- final table
    def table(self) -> str:
        r = self.res
        end = r.get("copy_end", {}).get("GBps")
        L = [f"== kernel_bench  {r['gpu']}  torch {r['torch']}  triton {r['triton']}  impl {r['impl']}  "
             f"copy {fmt(r.get('copy_bw_GBps'), '.0f')} GB/s (end of run {fmt(end, '.0f')}) =="]
        if r["store"]:
            L.append("store      T  dtype        us     GB/s  %cp  graph %cp")
            for s in r["store"]:
                L.append(f"      {s['tokens']:6d}  {s['cache_dtype']:5s} {s['ms'] * 1e3:9.2f} {s['GBps']:8.0f} {fmt(s['pct_copy'], '4.0f')}"
                         f"  {fmt(s.get('graph_pct_copy'), '4.0f')}")
        if r["prefill"]:
            L.append("prefill    T  TF/s: ours bf16  fp8  fp8q | sdpa_gqa  sdpa_rep | ours/best-sdpa: bf16  fp8  fp8q")
            by = {}
            for p in r["prefill"]:
                by.setdefault(p["tokens"], {})[p["impl"]] = p
            for T, p in by.items():
                if {"ours", "ours_fp8", "ours_fp8q", "sdpa_gqa", "sdpa_repeat_kv"} <= p.keys():
                    o, o8, oq = p["ours"], p["ours_fp8"], p["ours_fp8q"]
                    L.append(f"      {T:6d}  {o['tflops']:13.1f} {o8['tflops']:5.1f} {oq['tflops']:5.1f} | "
                             f"{p['sdpa_gqa']['tflops']:8.1f} {p['sdpa_repeat_kv']['tflops']:9.1f} | "
                             f"{o['speed_vs_best_sdpa']:19.2f}x {o8['speed_vs_best_sdpa']:.2f}x {oq['speed_vs_best_sdpa']:.2f}x")
        if r["decode"] or r["flex"]:
            L.append("decode (us, %cp = % of copy BW; flex = best variant f/p; x = ours speed / flex speed)")
            L.append("    B    ctx |  bf16 us  %cp |   fp8 us  %cp  fp8x |  fp8q us  %cp fp8qx | flex bf16  %cp v | flex fp8  %cp v"
                     " | x bf16  x fp8 | tok/s bf16")
            dec, fl = self._by_point()
            pts = sorted({k[:2] for k in list(dec) + list(fl)}, key=lambda p: (p[0], p[1]))
            for b, c in pts:
                ob, o8, oq = dec.get((b, c, "bf16")), dec.get((b, c, "fp8")), dec.get((b, c, "fp8q"))
                fb, f8 = fl.get((b, c, "bf16")), fl.get((b, c, "fp8"))

                def us(x):
                    if not x:
                        return f"{'-':>8s} {'-':>4s}"
                    return f"{x['ms'] * 1e3:8.1f} {fmt(x['pct_copy'], '4.0f', '   -')}"

                fp8x = f"{ob['ms'] / o8['ms']:5.2f}" if ob and o8 else "    -"
                fp8qx = f"{ob['ms'] / oq['ms']:5.2f}" if ob and oq else "    -"
                xb = f"{fb['ms'] / ob['ms']:6.2f}" if ob and fb else "     -"
                x8 = f"{f8['ms'] / o8['ms']:6.2f}" if o8 and f8 else "     -"
                vb = fb["variant"][0] if fb else " "
                v8 = f8["variant"][0] if f8 else " "
                tok = f"{ob['tokens_per_s']:10.3g}" if ob else "-"
                L.append(f"{b:5d} {c:6d} | {us(ob)} | {us(o8)} {fp8x} | {us(oq)} {fp8qx} | {us(fb)} {vb} | {us(f8)} {v8} | {xb} {x8} | {tok}")
        if any(x.get("clean_ms") for x in r["decode"]):
            L.append("decode, clean L2 (graph of [read 128 MB, call] minus [read]; us, % of copy)")
            dec, _ = self._by_point()
            for b, c in sorted({k[:2] for k in dec}):
                cells = []
                for name in ("bf16", "fp8", "fp8q", *self.DECODE_ONLY):
                    x = dec.get((b, c, name))
                    if x and x.get("clean_ms"):
                        cells.append(f"{name} {x['clean_ms'] * 1e3:8.1f} {fmt(x.get('clean_pct_copy'), '4.0f')}")
                ob, oq = dec.get((b, c, "bf16")), dec.get((b, c, "fp8q"))
                if ob and oq and ob.get("clean_ms") and oq.get("clean_ms"):
                    cells.append(f"fp8q/bf16 {ob['clean_ms'] / oq['clean_ms']:.2f}x")
                L.append(f"{b:5d} {c:6d} | " + " | ".join(cells))
        if r.get("ours_vs_flashinfer"):
            L.append("decode vs FlashInfer (best of its modes; x = FlashInfer time / ours; clean: the same, clean L2)")
            for v in r["ours_vs_flashinfer"]:
                L.append(f"{v['batch']:5d} {v['context']:6d} {v['cache_dtype']:5s} ours {v['ours_ms'] * 1e3:8.1f}us "
                         f"fi {v['flashinfer_ms'] * 1e3:8.1f}us ({v['flashinfer_mode']}) x {v['ours_speedup']:.2f}"
                         f" clean x {fmt(v.get('ours_speedup_clean'), '.2f')}")
        for k, v in r.get("flashinfer_off", {}).items():
            L.append(f"  flashinfer {k} off: {v[:200]}")
        if r.get("ours_vs_vllm_triton"):
            L.append("decode vs vLLM's Triton kernel (x = vLLM time / ours)")
            for v in r["ours_vs_vllm_triton"]:
                L.append(f"{v['batch']:5d} {v['context']:6d} {v['cache_dtype']:5s} ours {v['ours_ms'] * 1e3:8.1f}us "
                         f"vllm {v['vllm_triton_ms'] * 1e3:8.1f}us ({v['vllm_triton_launch']})"
                         f" x {v['ours_speedup']:.2f} clean x {fmt(v.get('ours_speedup_clean'), '.2f')}")
        for k, v in r.get("vllm_triton_off", {}).items():
            L.append(f"  vllm_triton {k} off: {v[:200]}")
        g = [(x["graph_ms"] / x["ms"], x) for x in r["decode"] + r["flex"] + r["store"] if x.get("graph_ms") and x["ms"] > 0]
        if g:
            far = [t for t in g if abs(t[0] - 1) > 0.10]
            L.append(f"graph cross-check (graph_ms/ms): {len(g)} points, median {statistics.median(t[0] for t in g):.3f}, "
                     f"{len(far)} off by >10%" + (":" if far else ""))
            for ratio, x in sorted(far, key=lambda t: -abs(t[0] - 1))[:8]:
                what = "flex " + x["variant"] if "variant" in x else ("store" if "tokens" in x else "ours")
                L.append(f"  {what} {x['cache_dtype']} B={x.get('batch', '-')} ctx={x.get('context', '-')} "
                         f"T={x.get('tokens', '-')}: do_bench {x['ms'] * 1e3:.1f}us graph {x['graph_ms'] * 1e3:.1f}us")
        bad = [c for c in r["checks"] if not c["ok"]]
        worst = max((c["rel_err"] for c in r["checks"]), default=None)
        L.append(f"checks: {len(r['checks'])} run, {len(bad)} failed, worst rel err {fmt(worst, '.2e')} (tol {TOL:g}); "
                 f"errors {len(r['errors'])}; skipped {len(r['skipped'])}; {time.time() - self.t0:.0f}s")
        for c in bad[:8]:
            L.append(f"  FAILED {c['name']}: {c['rel_err']:.3e}")
        for e in r["errors"][:8]:
            L.append(f"  ERROR {e['where']}: {e['error'][:200]}")
        for k, v in r.get("flex_off", {}).items():
            L.append(f"  flex {k} off: {v[:200]}")
        for k, v in r.get("graph_timing_off", {}).items():
            L.append(f"  graph timing off for {k}: {v[:150]}")
        if r["skipped"]:
            L.append(f"  skipped: {'; '.join(r['skipped'])[:600]}")
        return "\n".join(L)


# SDPA pinned to one backend (torch.nn.attention.SDPBackend names): FLASH_ATTENTION is FlashAttention-2
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_<time>.json)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; on a CPU-only machine the Triton interpreter")
    p.add_argument("--cpu", action="store_true", help="ignore CUDA even if present (with --smoke)")
    p.add_argument("--impl", choices=("triton", "reference", "auto"), default=None,
                   help="kernels under test (default triton; --smoke: auto = Triton where it exists)")
    p.add_argument("--sections", default="copy,store,prefill,mixed,ragged,decode")
    p.add_argument("--mixed-chunk", type=int, default=None, help="mixed batch: tokens per prefill chunk")
    p.add_argument("--mixed-contexts", type=ints, default=None, help="mixed batch: each chunk's cached context")
    p.add_argument("--mixed-decodes", type=int, default=None, help="mixed batch: decode tokens beside the chunks")
    p.add_argument("--ragged-batch", type=int, default=None, help="ragged decode batch: sequences")
    p.add_argument("--ragged-mean", type=int, default=None, help="ragged decode batch: mean context (uniform 64..2x)")
    p.add_argument("--no-flex", dest="flex", action="store_false")
    p.add_argument("--no-flex-fp8", dest="flex_fp8", action="store_false")
    p.add_argument("--no-ours-decode", dest="ours_decode", action="store_false", help="decode grid: flex only")
    p.add_argument("--flex-variants", choices=("auto", "both", "full", "partial"), default="auto")
    p.add_argument("--flex-page-size", type=int, default=128)
    p.add_argument("--no-graph", dest="graph", action="store_false")
    p.add_argument("--no-flashinfer", dest="flashinfer", action="store_false",
                   help="no FlashInfer decode peer (it runs where flashinfer imports)")
    p.add_argument("--vllm-triton-src", default=os.environ.get("VLLM_TRITON_SRC"),
                   help="folder with vLLM's triton_unified_attention.py and triton_attention_helpers.py: "
                        "its Triton kernel as a decode peer (default $VLLM_TRITON_SRC; off when unset)")
    p.add_argument("--fp8q-pv8", action="store_true",
                   help="also the quantized-query read with P @ V as an fp8 MMA in prefill tiles (JSON: fp8q_pv8)")
    p.add_argument("--fp8-unpaired", action="store_true",
                   help="also both fp8 reads' decode by the unpaired kernel, the pages read in bytes, beside "
                        "the default paired one (paired=False; JSON: fp8_unpaired, fp8q_unpaired)")
    p.add_argument("--no-bigpool", dest="bigpool", action="store_false", help="--smoke: skip the >2^31-element pool check")
    p.add_argument("--batches", type=ints, default=None)
    p.add_argument("--contexts", type=ints, default=None)
    p.add_argument("--store-tokens", type=ints, default=None)
    p.add_argument("--prefill-tokens", type=ints, default=None)
    p.add_argument("--max-kv-gb", type=float, default=40.0)
    p.add_argument("--int32-pools", action="store_true",
                   help="keep every cache tensor under 2^31 elements (skips the larger decode points)")
    p.add_argument("--q-heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--k-scale", type=float, default=0.02)
    p.add_argument("--v-scale", type=float, default=0.015)
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--rep-ms", type=float, default=40.0)
    p.add_argument("--time-budget-s", type=float, default=480.0,
                   help="skip the remaining points once this much wall time is spent (the device limit is 600 s)")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    big = dict(batches=[1, 8, 32, 64, 128, 256], contexts=[1024, 4096, 8192, 16384, 32768], store_tokens=[256, 4096, 16384],
               prefill_tokens=[1024, 2048, 4096, 8192], mixed_chunk=2048, mixed_contexts=[0, 2048, 6144],
               mixed_decodes=64, ragged_batch=256, ragged_mean=1024, q_heads=32, kv_heads=8, head_dim=128,
               copy_elems=1 << 30,
               flex_check_lens=[1000, 17, 4096, 130, 1, 2048, 777, 129])
    small = dict(batches=[1, 3], contexts=[40, 300], store_tokens=[5, 40], prefill_tokens=[32, 80], mixed_chunk=24,
                 mixed_contexts=[0, 40], mixed_decodes=3, ragged_batch=5, ragged_mean=60, q_heads=8, kv_heads=2,
                 head_dim=64, copy_elems=1 << 20, flex_check_lens=[300, 1, 129])
    for k, v in (small if a.smoke else big).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.impl is None:
        a.impl = "auto" if a.smoke else "triton"
    if a.out is None:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        a.out = f"/tmp/kernel_bench_smoke_{stamp}.json" if a.smoke else str(common.default_out("kernels"))
    a.sections = [s for s in a.sections.split(",") if s]
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda:
        if not args.smoke:
            raise SystemExit("no CUDA device: use --smoke")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print(f"[smoke] Triton interpreter patched ({patch_triton_interpreter()})")
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    run = Run(args)
    try:
        run.setup()
        if "copy" in args.sections:
            try:
                run.bench_copy()
            except Exception as e:
                run.error("copy", e)
        run.save()
        points = run.decode_points() if "decode" in args.sections else []
        if {"store", "prefill", "mixed", "decode"} & set(args.sections):
            run.alloc_pools(points or [(1, args.block_size)])
        if "store" in args.sections:
            run.bench_store()
        if "prefill" in args.sections:
            run.bench_prefill()
        if "mixed" in args.sections:
            run.bench_mixed()
        if "ragged" in args.sections:
            run.bench_ragged()
        if points:
            if args.flex:
                try:
                    run.setup_flex(points)
                except Exception as e:
                    run.flex_error("flex setup", "all", e)
                    args.flex = False
            try:
                run.setup_flashinfer()
            except Exception as e:
                run.error("flashinfer setup", e)
                run.fi = None
            try:
                run.setup_vllm_triton(points)
            except Exception as e:
                run.error("vllm_triton setup", e)
                run.vt = None
            run.bench_decode(points)
        if args.smoke and not cuda and args.bigpool:
            run.bigpool_check()
        if "copy" in args.sections and cuda:
            try:  # the ceiling again, after everything (clock / thermal drift)
                run.bench_copy(key="copy_end")
            except Exception as e:
                run.error("copy_end", e)
    except Exception as e:
        run.error("main", e)
    if cuda:
        run.res["gpu_state_end"] = gpu_state()
    try:
        run.summarize()
    except Exception as e:
        run.error("summarize", e)
    run.res["wall_s"] = time.time() - run.t0
    run.res["failed"] = run.failed
    run.save()
    print(run.table())
    print(f"json: {args.out}")
    common.print_summary(run.headline())
    if run.failed:
        print("KERNEL BENCH: FAILED (see checks/errors above)")
        return 1
    print("KERNEL BENCH: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
