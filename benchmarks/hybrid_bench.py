#!/usr/bin/env python
"""Hybrid-model prefill and decode (the hybrid family of the suite): a Qwen3.6-27B-shaped model
(real config, ``benchmarks/configs/qwen3.6-27b``, random non-zero bf16 weights), bf16 KV vs fp8 KV
in the same run, ``kvserve traffic``'s predicted fp8 change beside the measured one, and
transformers' ``generate`` on the same model as the prefill peer (its continuous batching rejects
hybrid layers; warmed at each timed shape, so fla-core, when installed, has autotuned).

Prefill tok/s = concurrency x ISL / (time from submitting the batch to its last first token; the
median of ``--repeats`` runs). Decode: at each decode concurrency the engine is stepped by hand;
the decode step = the time from every request holding its 2nd token to every request holding its
last, over the tokens between (no prefill in it); against the step's roofline, ``kvserve
traffic``'s bytes (weights + KV read and written + recurrent state read and written, at the mean
context) over the device-to-device copy bandwidth measured in the same run.

    bash benchmarks/gpu.sh hybrid                                      # H200: $OUT/hybrid.json, ~6 min
    python3 benchmarks/hybrid_bench.py --out hybrid.json               # H200 by hand
    python3 benchmarks/hybrid_bench.py --config benchmarks/configs/qwen3.6-35b-a3b --out moe.json
                                     # the MoE sibling (35B-A3B: 256 experts, top-8; ~67 GB of bf16 weights)
    python3 benchmarks/hybrid_bench.py --smoke --out /tmp/hybrid.json  # CPU: tiny config, every path

``--quantization ALGO`` (a ModelOpt algo, e.g. MIXED_PRECISION, the Qwen3.6 NVFP4 recipe) also runs
the same config quantized: the configs of its ModelOpt export without weights
(``kvserve.tools.modelopt_export --config-only``) and random packed weights (``--load-format
dummy``), at ``--quantized-kv`` (``auto`` = fp8 from the export's ``kv_cache_quant_algo``), its
decode roofline from ``--quantized-traffic-model`` (the checkpoint's weight bytes).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository root on sys.path: kvserve)

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.tools.modelopt_export import ALGOS, export_config_only  # noqa: E402
from kvserve.tools.traffic import ModelShape, model_shape, traffic  # noqa: E402

CONFIG = common.CONFIGS / "qwen3.6-27b"


def _tiny_config(folder: Path) -> Path:
    """A 4-layer Qwen3.5 config (2 GDN + 2 attention) for the CPU smoke run."""
    cfg = json.loads((CONFIG / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, vocab_size=512, max_position_embeddings=4096,
               layer_types=["linear_attention", "full_attention"] * 2, dtype="float32")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _prompts(n: int, isl: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (isl,), generator=gen).tolist() for _ in range(n)]


def copy_bandwidth(device: str) -> float | None:
    """Device-to-device copy, bytes read + written per second (1 GiB, median of 5)."""
    if device != "cuda":
        return None
    x = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    y = torch.empty_like(x)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x, y
    return 2 * (1 << 30) / sorted(times[1:])[2]


def _timed_generate(llm: LLM, prompts: list, params: SamplingParams) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    return time.perf_counter() - t


def _decode_steps(llm: LLM, prompts: list, osl: int) -> tuple[float, float]:
    """Run the batch to ``osl`` tokens each, stepping the engine by hand: (seconds in all, the decode
    step = the time from every request holding its 2nd token to every request holding its last,
    over the tokens between; prefill time and its spread stay out of it)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=osl, ignore_eos=True, detokenize=False)
    ids = [f"decode-{i}" for i in range(len(prompts))]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    states = [engine.states[r] for r in ids]
    marks = []  # (time, fewest tokens any request holds) after each step
    while engine.has_unfinished_requests():
        engine.step()
        marks.append((time.perf_counter(), min(len(s.token_ids) for s in states)))
    full = marks[-1][0] - t0
    assert marks[-1][1] == osl
    t_a, n_a = next(m for m in marks if m[1] >= 2)
    t_b, n_b = next(m for m in marks if m[1] >= osl)
    return full, (t_b - t_a) / max(n_b - n_a, 1)


def run_kvserve(folder: Path, kv: str, isl: int, concurrency: list[int], vocab: int, dtype: str, budget: int,
                kv_cache_memory: int | None = None, decode_concurrency: tuple[int, ...] = (), osl: int = 0,
                bandwidth: float | None = None, repeats: int = 1, shape: ModelShape | None = None) -> dict:
    t0 = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, dtype=dtype, kv_cache_dtype=kv,
              max_num_seqs=max([*concurrency, *decode_concurrency]), max_num_batched_tokens=budget,
              max_model_len=isl + max(osl, 1) + 16,
              # plain prefill: 'align' prefix caching would cut bf16 prompts at 784 tokens (a state
              # snapshot) but not fp8 ones (1,568), which would skew the bf16-vs-fp8 comparison
              enable_prefix_caching=False, kv_cache_memory=kv_cache_memory)
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in _prompts(1, isl, vocab, 99)], params, use_tqdm=False)  # warm-up
    rows = []
    for c in concurrency:
        prompts = [{"prompt_token_ids": p} for p in _prompts(c, isl, vocab, c)]
        times = [_timed_generate(llm, prompts, params) for _ in range(repeats)]
        dt = statistics.median(times)
        rows.append({"concurrency": c, "seconds": dt, "prefill_tok_s": c * isl / dt, "all_seconds": times})
        print(f"[kvserve {kv}] concurrency {c:3d}: {c * isl / dt:10.0f} prefill tok/s ({dt * 1e3:.1f} ms, median of "
              f"{repeats}: {', '.join(f'{x * 1e3:.1f}' for x in times)})", flush=True)
    decode = []
    shape = shape or model_shape(str(folder))
    resolved_kv = llm.llm_engine.config.cache_config.cache_dtype  # auto resolved (fp8 from a ModelOpt export)
    for c in decode_concurrency:
        prompts = [{"prompt_token_ids": p} for p in _prompts(c, isl, vocab, 1000 + c)]
        _decode_steps(llm, prompts, min(osl, 16))  # warm-up: the decode graphs' first replays
        full, step = _decode_steps(llm, prompts, osl)
        row = {"concurrency": c, "seconds": full, "out_tok_s": c * osl / full, "step_ms": step * 1e3}
        if bandwidth:
            t = traffic(shape, isl, osl, c, kv_cache_dtype=resolved_kv, bandwidth=bandwidth)
            roof = t.memory_s(getattr(t, t.selected).decode_mean)
            row.update(roofline_ms=roof * 1e3, step_over_roofline=step / roof)
        decode.append(row)
        print(f"[kvserve {kv}] decode c{c:3d}: {row['out_tok_s']:8.0f} out tok/s, step {step * 1e3:.2f} ms"
              + (f" = {row['step_over_roofline']:.2f}x its roofline {row['roofline_ms']:.2f} ms" if bandwidth else ""),
              flush=True)
    runner = llm.llm_engine.runner
    info = {"kv_cache_dtype": kv, "resolved_kv_cache_dtype": resolved_kv,
            "start_s": start_s, "num_blocks": llm.llm_engine.config.cache_config.num_blocks,
            "state_slots": runner.state_pool.num_slots if runner.state_pool else 0,
            "cuda_graphs": runner.graphs is not None, "rows": rows, "decode": decode}
    del llm, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return info


def run_transformers(folder: Path, isl: int, concurrency: list[int], vocab: int, dtype: torch.dtype, device: str) -> dict:
    """transformers' generate (1 new token) on the same config, random weights, batch = concurrency."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    start_s = time.perf_counter() - t0
    rows = []
    for c in concurrency:
        ids = torch.tensor(_prompts(c, isl, vocab, c), device=device)
        with torch.no_grad():
            # warm-up at the timed shape: fla (when installed) autotunes its kernels per shape
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
        dt = time.perf_counter() - t
        rows.append({"concurrency": c, "seconds": dt, "prefill_tok_s": c * isl / dt})
        print(f"[transformers] concurrency {c:3d}: {c * isl / dt:10.0f} prefill tok/s ({dt * 1e3:.1f} ms)", flush=True)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"start_s": start_s, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--isl", type=int, default=1024)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--kv", default="bfloat16,fp8")
    ap.add_argument("--peer-concurrency", default="1,4,16,32", help="transformers batch sizes ('' = no peer)")
    ap.add_argument("--decode-concurrency", default="1,8,32,64", help="decode batch sizes ('' = no decode)")
    ap.add_argument("--osl", type=int, default=256, help="output tokens of the decode runs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=9,
                    help="timed prefills per concurrency, the median reported (on the H200 one c1 prefill of the 27B "
                         "shape spreads over 88-98 ms; with 9 the median moves ~0.5%%, with 3 ~1.5%%)")
    ap.add_argument("--quantization", default="none", choices=["none", *ALGOS],
                    help="also run the config quantized as this ModelOpt algo (dummy packed weights)")
    ap.add_argument("--quantized-kv", default="auto", help="KV dtypes of the quantized runs")
    ap.add_argument("--quantized-traffic-model", default="qwen3.6-27b-nvfp4",
                    help="kvserve traffic model of the quantized runs' roofline (a preset or a folder)")
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny config, ISL 64, concurrency 1,2, OSL 8")
    ap.add_argument("--out", default=None, help="JSON path (written after every engine)")
    a = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    conc = [int(c) for c in a.concurrency.split(",") if c]
    peer = [int(c) for c in a.peer_concurrency.split(",") if c]
    decode_conc = tuple(int(c) for c in a.decode_concurrency.split(",") if c)
    folder, isl, osl, dtype, kv_memory = Path(a.config), a.isl, a.osl, "bfloat16", None
    if a.smoke:
        folder = _tiny_config(Path(tempfile.mkdtemp()) / "tiny-qwen3.5")
        isl, osl, conc, peer, dtype, kv_memory = 64, 8, [1, 2], [1], "float32", 1 << 24
        decode_conc = (1, 2)
    if decode_conc and osl < 2:
        ap.error(f"--osl {osl} is too small for a decode run: expected an integer >= 2")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    res: dict = {"run": common.run_info("hybrid_bench", argv, a.smoke), "benchmark": "hybrid prefill",
                 "config": str(folder), "isl": isl, "device": device,
                 "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
                 "command": " ".join(sys.argv), "osl": osl, "kvserve": {}, "traffic": {}}
    bandwidth = copy_bandwidth(device)
    res["copy_bandwidth_Bps"] = bandwidth

    def save() -> None:
        if a.out:
            common.write_json(a.out, res)

    for kv in [k for k in a.kv.split(",") if k]:
        res["kvserve"][kv] = run_kvserve(folder, kv, isl, conc, vocab, dtype, max(a.max_num_batched_tokens, isl),
                                         kv_memory, decode_conc, osl, bandwidth, 1 if a.smoke else a.repeats)
        save()
    if a.quantization != "none":
        qfolder = export_config_only(folder, Path(tempfile.mkdtemp()) / f"{folder.name}-{a.quantization}", a.quantization)
        qshape = model_shape(str(qfolder) if a.smoke else a.quantized_traffic_model)
        res["kvserve_quantized"] = {"algo": a.quantization, "traffic_model": qshape.name,
                                    "weight_bytes": qshape.weight_bytes, "kv": {}}
        for kv in [k for k in a.quantized_kv.split(",") if k]:
            res["kvserve_quantized"]["kv"][kv] = run_kvserve(
                qfolder, kv, isl, conc, vocab, dtype, max(a.max_num_batched_tokens, isl), kv_memory, decode_conc, osl,
                bandwidth, 1 if a.smoke else a.repeats, shape=qshape)
            save()
        base = res["kvserve"].get("bfloat16")
        for kv, q in res["kvserve_quantized"]["kv"].items():
            if base:
                ratios = ", ".join(f"c{b['concurrency']} {r['prefill_tok_s'] / b['prefill_tok_s']:.3f}"
                                   for b, r in zip(base["rows"], q["rows"]))
                print(f"{a.quantization} (KV {kv} -> {q['resolved_kv_cache_dtype']}) / bf16 model (bf16 KV) prefill "
                      f"tok/s: {ratios}", flush=True)
    shape = model_shape(str(folder))
    for c in conc:
        r = traffic(shape, isl, 1, c, prefill_chunk=min(isl, a.max_num_batched_tokens))
        res["traffic"][c] = {"prefill_memory_change_pct": r.change_pct("prefill"),
                             "prefill_roofline_change_pct": r.change_pct("prefill", roofline=True)}
    if "bfloat16" in res["kvserve"] and "fp8" in res["kvserve"]:
        for b, f in zip(res["kvserve"]["bfloat16"]["rows"], res["kvserve"]["fp8"]["rows"]):
            t = res["traffic"][b["concurrency"]]
            print(f"concurrency {b['concurrency']:3d}: fp8 / bf16 prefill tok/s {f['prefill_tok_s'] / b['prefill_tok_s']:.3f} "
                  f"(traffic predicts {t['prefill_memory_change_pct']:+.1f}% bytes time, "
                  f"{t['prefill_roofline_change_pct']:+.1f}% roofline)", flush=True)
        for b, f in zip(res["kvserve"]["bfloat16"]["decode"], res["kvserve"]["fp8"]["decode"]):
            t = traffic(shape, isl, osl, b["concurrency"])
            print(f"decode c{b['concurrency']:3d}: fp8 / bf16 decode speed (bf16 step / fp8 step) "
                  f"{b['step_ms'] / f['step_ms']:.3f}, out tok/s {f['out_tok_s'] / b['out_tok_s']:.3f} "
                  f"(traffic predicts {t.change_pct('decode_mean'):+.1f}% bytes time)", flush=True)
    save()
    if peer:
        res["transformers"] = run_transformers(folder, isl, peer, vocab, getattr(torch, dtype), device)
        save()
    if a.out:
        print(f"wrote {a.out}")
    runs = {f"kvserve {kv}": v["rows"] for kv, v in res["kvserve"].items()}
    if "transformers" in res:
        runs["transformers"] = res["transformers"]["rows"]
    for kv, v in res.get("kvserve_quantized", {}).get("kv", {}).items():
        runs[f"kvserve {a.quantization} {kv}"] = v["rows"]
    parts = [f"{name} prefill tok/s " + ", ".join(f"c{r['concurrency']} {r['prefill_tok_s']:.0f}" for r in rows)
             for name, rows in runs.items()]
    engines = {f"kvserve {kv}": v for kv, v in res["kvserve"].items()}
    engines.update({f"kvserve {a.quantization} {kv}": v for kv, v in res.get("kvserve_quantized", {}).get("kv", {}).items()})
    parts += [f"{name} decode step ms " + ", ".join(
        f"c{r['concurrency']} {r['step_ms']:.2f}" + (f" ({r['step_over_roofline']:.2f}x)" if "roofline_ms" in r else "")
        for r in v["decode"]) for name, v in engines.items() if v["decode"]]
    common.print_summary("; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
