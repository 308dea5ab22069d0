#!/usr/bin/env python
"""End-to-end benchmark (the end-to-end family of the suite): kvserve on nano-vllm's workload, bf16
vs fp8 KV cache, for a Qwen3-0.6B- and a Llama-3-8B-shaped model, against transformers' own
continuous batching; ``--profile``: where a decode step's time goes instead.

Models: ``benchmarks/configs/<name>/config.json`` (+ ``generation_config.json``), written by this
script from the real Hugging Face configs (Qwen/Qwen3-0.6B, meta-llama/Meta-Llama-3-8B). No weights
and no tokenizer: kvserve runs with ``load_format="dummy"`` (random weights, as vLLM's
DummyModelLoader) and ``skip_tokenizer_init=True``, dtype bfloat16.

Workload (nano-vllm's bench.py, ``kvserve.bench.throughput.nano_vllm_requests``): 256 requests,
``random.seed(0)``, prompt lengths and output lengths uniform in [100, 1024], prompt ids
``randint(0, 10000)``; ``ignore_eos``; temperature 0.6 (nano-vllm's), top_p 1, top_k off;
max_num_seqs 256, max_model_len 4096 (nano-vllm's). Every request generates exactly its output
length. One kvserve engine per KV dtype (``kvserve.bench.throughput.run_grid``: short untimed warm-up,
then the timed run; TTFT / TPOT from per-step timestamps; the decode step at the largest batch vs
its roofline, (weight bytes + KV bytes read) / copy bandwidth measured at start).

Peer: transformers' continuous batching -- the machinery of ``model.generate_batch``
(``continuous_batching_context_manager`` + ``ContinuousBatchingManager.add_request``, because
``generate_batch`` takes one ``max_new_tokens`` for all requests while this workload has one per
request) on the Qwen3-0.6B config, ``AutoModelForCausalLM.from_config(config, dtype=bfloat16)``
on CUDA (random non-zero init), ``eos_token_id=-1`` (no EOS), the same requests, same sampling,
transformers' default ``ContinuousBatchingConfig`` (sized by ``WorkloadHints`` of this workload, as
``generate_batch`` does), its default attention choice (flash if installed, else paged sdpa), its
own warm-up (CUDA graphs) plus a few untimed requests. Timed: first ``add_request`` to last result.
``--peer-requests N`` runs the first N requests only (reported); kvserve then also runs that
subset on the same engines, so the kvserve / transformers ratio compares like with like.

``--profile`` (per model and KV dtype, no peer): the same workload until every request is decoding,
then per decode step at full batch: the plain step period (overlapped under async scheduling), the
host time of each part without added synchronisation, then (serial steps) input preparation, graph
replay (synchronized), logits + sampler and the rest of ``Engine.step``; then a torch.profiler table
of the kernels of three steps. JSON key ``profile``.

Usage:
    bash benchmarks/gpu.sh e2e                     # H200: both models, peer on 64 requests, ~5 min
    bash benchmarks/gpu.sh profile                 # H200: the step profile, Qwen3-0.6B, bf16 + fp8
    python3 benchmarks/e2e_bench.py --models qwen3-0.6b --out e2e_qwen.json           # by hand
    python3 benchmarks/e2e_bench.py --models llama-3-8b --skip-peer --out e2e_llama.json
    python3 benchmarks/e2e_bench.py --smoke --out /tmp/e2e.json             # tiny, CPU, seconds
    python3 benchmarks/e2e_bench.py --smoke --profile --out /tmp/e2e_profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded; fail fast where transformers would try

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository root on sys.path: kvserve)

from kvserve.bench import throughput as tp  # noqa: E402

CONFIG_ROOT = common.CONFIGS

# The real config.json / generation_config.json of the Hugging Face checkpoints (architecture fields).
MODELS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "source": "Qwen/Qwen3-0.6B",
        "config": {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 1024,
            "initializer_range": 0.02,
            "intermediate_size": 3072,
            "max_position_embeddings": 40960,
            "max_window_layers": 28,
            "model_type": "qwen3",
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        "generation_config": {
            "bos_token_id": 151643,
            "do_sample": True,
            "eos_token_id": [151645, 151643],
            "pad_token_id": 151643,
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
            "transformers_version": "4.51.0",
        },
    },
    "llama-3-8b": {
        "source": "meta-llama/Meta-Llama-3-8B",
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 8192,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.40.0.dev0",
            "use_cache": True,
            "vocab_size": 128256,
        },
        "generation_config": {
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "transformers_version": "4.40.0.dev0",
        },
    },
}

# --smoke: a tiny Qwen3 (same architecture path), CPU, a handful of short requests
SMOKE_MODEL = "tiny-qwen3"
SMOKE_CONFIG = common.TINY_QWEN3
SMOKE_LENGTHS = (8, 48, 24)


def write_model_folder(name: str, folder: Path, config: dict[str, Any], generation_config: dict[str, Any]) -> Path:
    """config.json + generation_config.json only (rewritten only when the content differs)."""
    folder.mkdir(parents=True, exist_ok=True)
    for fname, content in (("config.json", config), ("generation_config.json", generation_config)):
        text = json.dumps(content, indent=2) + "\n"
        path = folder / fname
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
    return folder


def write_smoke_weights(folder: Path) -> None:
    """For ``--smoke --load-format auto``: random safetensors weights written by transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if list(folder.glob("*.safetensors")):
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=torch.bfloat16)
    model.save_pretrained(str(folder))


def param_count(config: dict[str, Any]) -> int:
    """Parameters of a Llama / Qwen3 config (no biases; Qwen3's q/k norms)."""
    h, i, L = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    nh, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // nh
    v = config["vocab_size"]
    attn = h * nh * hd + 2 * h * kv * hd + nh * hd * h
    norms = 2 * h + (2 * hd if config["model_type"] == "qwen3" else 0)
    emb = v * h * (1 if config.get("tie_word_embeddings") else 2)
    return L * (attn + 3 * h * i + norms) + emb + h


# ----------------------------------------------------------------------------------------------
# the peer: transformers continuous batching
# ----------------------------------------------------------------------------------------------


def _cb_config(overrides: dict[str, Any]) -> Any:
    """A ContinuousBatchingConfig with ``overrides``; names the installed version lacks are dropped
    (5.17 says ``block_size``, later versions ``page_size``)."""
    from transformers.generation import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kw = dict(overrides)
    if "page_size" in kw and "page_size" not in fields and "block_size" in fields:
        kw["block_size"] = kw.pop("page_size")
    if "block_size" in kw and "block_size" not in fields and "page_size" in fields:
        kw["page_size"] = kw.pop("block_size")
    dropped = sorted(k for k in kw if k not in fields)
    if dropped:
        print(f"[peer] ContinuousBatchingConfig of this transformers has no {dropped}: ignored", flush=True)
    return ContinuousBatchingConfig(**{k: v for k, v in kw.items() if k in fields})


def _plain(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


def run_peer(folder: Path, requests: list[tp.BenchRequest], *, device: str, temperature: float,
             attn: str | None, cb_overrides: dict[str, Any], num_warmup: int = 4, warmup_output_len: int = 16,
             transformers_warmup: bool = True, timeout_s: float = 900.0) -> dict[str, Any]:
    import numpy as np
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    t_build = time.perf_counter()
    config = AutoConfig.from_pretrained(str(folder))
    kw: dict[str, Any] = {"dtype": torch.bfloat16}
    if attn:
        kw["attn_implementation"] = attn
    try:
        with torch.device(device):  # random init directly on the device (fast)
            model = AutoModelForCausalLM.from_config(config, **kw)
    except Exception as e:  # noqa: BLE001 - some versions do not like the device context: init on CPU
        print(f"[peer] from_config under torch.device({device!r}) failed ({type(e).__name__}: {e}); "
              "initialising on CPU", flush=True)
        model = AutoModelForCausalLM.from_config(config, **kw)
    model = model.to(device).eval()
    build_s = time.perf_counter() - t_build
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        weight_std = float(w.float().std())
    if not weight_std > 0:
        raise RuntimeError("transformers model weights are all zero")
    n_params = sum(p.numel() for p in model.parameters())

    max_out = max(r.output_len for r in requests)
    gen = GenerationConfig(
        max_new_tokens=max_out, do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
        top_k=0 if temperature > 0 else None, top_p=1.0 if temperature > 0 else None,
        eos_token_id=-1, pad_token_id=0,
    )
    cb = _cb_config(cb_overrides)
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
                          max_generated_length=max_out, num_requests=len(requests))
    res: dict[str, Any] = {
        "engine": "transformers continuous batching (ContinuousBatchingManager, as generate_batch)",
        "transformers": transformers.__version__,
        "device": device,
        "num_parameters": n_params,
        "lm_head_weight_std": weight_std,
        "model_build_s": build_s,
        "attn_implementation_requested": attn or "(transformers default)",
        "cb_overrides": cb_overrides,
        "temperature": temperature,
        "eos": "disabled (eos_token_id=-1)",
    }

    def collect(mgr: Any, ids: set[str], deadline: float) -> tuple[dict[str, Any], bool]:
        got: dict[str, Any] = {}
        while len(got) < len(ids):
            if time.perf_counter() > deadline:
                return got, True
            r = mgr.get_result(timeout=0.5)
            if r is None:
                if not mgr.is_running():
                    raise RuntimeError(f"transformers generation thread stopped with {len(ids) - len(got)} "
                                       "request(s) unfinished")
                continue
            if r.request_id in ids and r.is_finished():
                got[r.request_id] = r
        return got, False

    t_cm = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=60,
        warmup=transformers_warmup, workload_hints=hints,
    ) as mgr:
        res["manager_start_s"] = time.perf_counter() - t_cm  # its warm-up (CUDA graphs) included
        res["attn_implementation"] = model.config._attn_implementation
        resolved = getattr(mgr, "continuous_batching_config", None)
        if resolved is not None and dataclasses.is_dataclass(resolved):
            res["cb_config_resolved"] = {f.name: _plain(getattr(resolved, f.name)) for f in dataclasses.fields(resolved)}
        # untimed warm-up requests
        t = time.perf_counter()
        warm = requests[:num_warmup]
        wids = {mgr.add_request(input_ids=r.prompt_token_ids, request_id=f"warmup-{i}", eos_token_id=-1,
                                max_new_tokens=min(r.output_len, warmup_output_len)) for i, r in enumerate(warm)}
        collect(mgr, wids, time.perf_counter() + timeout_s)
        res["warmup_s"] = time.perf_counter() - t
        res["warmup_requests"] = len(warm)
        # timed
        t0 = time.perf_counter()
        ids = [mgr.add_request(input_ids=r.prompt_token_ids, request_id=f"req-{i}", max_new_tokens=r.output_len,
                               record_timestamps=True, eos_token_id=-1) for i, r in enumerate(requests)]
        got, timed_out = collect(mgr, set(ids), t0 + timeout_s)
        t_end = time.perf_counter()
        if timed_out:
            mgr.stop(block=True, timeout=60, hard_stop=True)
        cache = getattr(getattr(mgr, "batch_processor", None), "cache", None)
        if cache is not None:
            res["num_blocks"] = getattr(cache, "num_blocks", None)
            res["max_batch_tokens"] = getattr(cache, "max_batch_tokens", None)
    done = [(int(rid.split("-")[1]), r) for rid, r in got.items()]
    errors = [r.error for _, r in done if r.error is not None]
    out_tokens = sum(len(r.generated_tokens) for _, r in done)
    full = all(len(r.generated_tokens) == requests[i].output_len for i, r in done)
    # the last token's timestamp is the end (the result may be read later)
    stamps = [r.timestamps for _, r in done if r.timestamps]
    t_last = max((s[-1] for s in stamps), default=t_end)
    elapsed = t_last - t0
    prompt_tokens = sum(len(requests[i].prompt_token_ids) for i, _ in done)
    ttft = [s[0] - t0 for s in stamps]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
    res.update({
        "num_requests": len(requests),
        "num_finished": len(done),
        "timed_out": timed_out,
        "errors": errors[:5],
        "all_full_length": full,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "elapsed_to_last_result_s": t_end - t0,
        "requests_per_s": len(done) / elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (prompt_tokens + out_tokens) / elapsed,
    })
    for name, vals in (("ttft", ttft), ("tpot", tpot)):
        arr = np.asarray(vals, dtype=np.float64) * 1e3
        res[f"mean_{name}_ms"] = float(arr.mean()) if len(arr) else None
        for p in tp.PERCENTILES:
            res[f"p{p}_{name}_ms"] = float(np.percentile(arr, p)) if len(arr) else None
    model.destroy_cached_continuous_batching_manager()
    del model, mgr
    tp.release_memory()
    return res


# ----------------------------------------------------------------------------------------------
# --profile: where a decode step's time goes
# ----------------------------------------------------------------------------------------------


def _time_calls(obj: Any, name: str, bucket: dict[str, list[float]], sync: bool, key: str | None = None) -> None:
    """Wrap ``obj.name`` (an instance attribute shadowing the class's) to append each call's
    seconds to ``bucket[key or name]``; ``sync`` brackets it with CUDA synchronisations."""
    import torch

    real = getattr(obj, name)
    sync = sync and torch.cuda.is_available()

    def wrapper(*a: Any, **k: Any) -> Any:
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = real(*a, **k)
        if sync:
            torch.cuda.synchronize()
        bucket.setdefault(key or name, []).append(time.perf_counter() - t0)
        return out

    setattr(obj, name, wrapper)


def _medians_ms(bucket: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {k: {"median_ms": statistics.median(v) * 1e3, "n": len(v)} for k, v in bucket.items()}


def _median_step_ms(eng: Any, steps: int) -> float:
    """Median wall time of ``steps`` calls of ``eng.step()``, in ms."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _print_medians(title: str, medians: dict[str, dict[str, float]]) -> None:
    print(title, flush=True)
    for k, v in medians.items():
        print(f"  {k:16s} median {v['median_ms']:8.3f} ms  (n={v['n']})", flush=True)


def _host_functions(eng: Any, steps: int, top: int = 25) -> list[dict[str, Any]]:
    """cProfile of ``steps`` plain steps: Engine.step's cumulative time, then the ``top`` functions by
    their own host time, per step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    out = [{"function": f"{Path(f).name}:{line}({name})", "calls_per_step": calls / steps,
            "own_ms_per_step": own * 1e3 / steps, "cumulative_ms_per_step": cum * 1e3 / steps}
           for (f, line, name), (_, calls, own, cum, _) in rows]
    step = [v[3] for (f, _, name), v in stats.items() if name == "step" and Path(f).name == "engine.py"]
    out.insert(0, {"function": "engine.py(Engine.step)", "calls_per_step": 1.0, "own_ms_per_step": None,
                   "cumulative_ms_per_step": step[0] * 1e3 / steps if step else None})
    print(f"  host functions by own time, per step ({steps} plain steps under cProfile):", flush=True)
    for r in out[1:]:
        print(f"    {r['own_ms_per_step']:7.3f} ms own {r['cumulative_ms_per_step']:7.3f} cum "
              f"{r['calls_per_step']:7.1f} calls  {r['function']}", flush=True)
    return out


def profile_decode_step(engine_kwargs: dict[str, Any], requests: list[tp.BenchRequest], steps: int,
                        temperature: float) -> dict[str, Any]:
    """One engine, all ``requests`` admitted and decoding, then three measurements of ``steps``
    decode steps each (plain; host parts unsynchronised; serial parts synchronised), a cProfile
    of the host's functions over ``steps`` plain steps and a torch.profiler table of three more."""
    import torch

    from kvserve.engine.sampling import RequestOutputKind, SamplingParams
    from kvserve.runner import model_runner as mr

    cuda = torch.cuda.is_available() and str(engine_kwargs.get("device", "cuda")).startswith("cuda")
    eng = tp.build_engine(engine_kwargs)
    for i, r in enumerate(requests):
        eng.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids},
                        SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=True,
                                       detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY))
    t0 = time.perf_counter()
    while not (len(eng.scheduler.running) == len(requests) and not eng.scheduler.waiting
               and all(r.num_output_tokens > 0 for r in eng.scheduler.running)):
        eng.step()
    if cuda:
        torch.cuda.synchronize()
    res: dict[str, Any] = {"prefill_phase_s": time.perf_counter() - t0, "async_scheduling": eng.async_scheduling,
                           "batch": len(eng.scheduler.running)}
    print(f"prefill phase {res['prefill_phase_s']:.2f} s", flush=True)
    runner = eng.runner

    # 1. plain steps: the step period as the workload sees it (overlapped under async scheduling)
    res["plain_step_ms_median"] = _median_step_ms(eng, steps)
    print(f"async_scheduling={eng.async_scheduling}  batch {res['batch']}  "
          f"plain Engine.step median {res['plain_step_ms_median']:.2f} ms", flush=True)

    # 2. host time of each part, no synchronisation added (what the CPU spends per step)
    host: dict[str, list[float]] = {}
    # the core's token bookkeeping and stop rules (core._process), then the outputs (Engine._process)
    patched = ((eng.scheduler, "schedule", None), (runner, "prepare", None),
               (runner, "execute_async" if eng.async_scheduling else "execute", None),
               (eng.core, "_process", "core._process"), (eng, "_process", "outputs"))
    for obj, name, key in patched:
        _time_calls(obj, name, host, False, key)
    real_results = mr.PendingSamples.results

    def results(self: Any) -> Any:
        t = time.perf_counter()
        out = real_results(self)
        host.setdefault("wait for tokens", []).append(time.perf_counter() - t)
        return out

    mr.PendingSamples.results = results
    try:
        for _ in range(steps):
            eng.step()
    finally:
        mr.PendingSamples.results = real_results
        for obj, name, _ in patched:
            obj.__dict__.pop(name, None)
    res["host_parts"] = _medians_ms(host)
    _print_medians("  host time per step (no added sync):", res["host_parts"])
    res["host_functions"] = _host_functions(eng, steps)


    # 3. serial steps, each part synchronised: prepare, graph replay, logits, sampler, the rest
    if eng.async_scheduling:
        eng.async_scheduling = False  # the synchronised split needs the serial step
        eng.step()
    parts: dict[str, list[float]] = {}
    _time_calls(runner, "prepare", parts, False)
    if runner.graphs is not None:
        _time_calls(runner.graphs, "run", parts, True)
    _time_calls(runner.model, "compute_logits", parts, True)
    real_sampler = runner.sampler

    def sampler(*a: Any, **k: Any) -> Any:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = real_sampler(*a, **k)
        parts.setdefault("sampler", []).append(time.perf_counter() - t)
        return out

    runner.sampler = sampler
    _time_calls(runner, "execute", parts, True)
    _time_calls(eng.scheduler, "schedule", parts, False)
    res["serial_step_ms_median"] = _median_step_ms(eng, steps)
    res["serial_parts"] = _medians_ms(parts)
    _print_medians(f"batch {len(eng.scheduler.running)}  Engine.step median {res['serial_step_ms_median']:.2f} ms",
                   res["serial_parts"])

    # 4. the kernels of three steps
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
    key = "device_time_total" if cuda else "cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:18]
    res["top_ops"] = [{"name": e.key, "count": e.count, "cpu_time_total_us": e.cpu_time_total,
                       "device_time_total_us": getattr(e, "device_time_total", None)} for e in events]
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60), flush=True)
    return res  # the engine dies with this frame (locals such as ``patched`` hold it): see the caller


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if a and b else None


def _f(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def summary_table(doc: dict[str, Any]) -> str:
    head = ("| model | engine | kv | requests | out tok/s | total tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | "
            "decode B | step ms | roofline ms | roofline/step |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, m in doc["models"].items():
        for key in ("kvserve", "kvserve_peer_subset"):
            for kv, p in m.get(key, {}).items():
                rows.append(
                    f"| {name} | kvserve{' (peer subset)' if key != 'kvserve' else ''} | {kv} | {p['num_requests']} | "
                    f"{p['output_tok_s']:.0f} | {p['total_tok_s']:.0f} | {_f(p['p50_ttft_ms'], '.0f')} / "
                    f"{_f(p['p99_ttft_ms'], '.0f')} | {_f(p['p50_tpot_ms'], '.2f')} / {_f(p['p99_tpot_ms'], '.2f')} | "
                    f"{p['decode_batch']} | {_f(p['decode_step_ms_mean'], '.2f')} | {_f(p['decode_roofline_ms'], '.2f')} | "
                    f"{_f(p['decode_roofline_fraction'], '.0%')} |")
        peer = m.get("transformers")
        if peer and "output_tok_s" in peer:
            rows.append(
                f"| {name} | transformers CB ({peer.get('attn_implementation')}) | bfloat16 | {peer['num_finished']}"
                f"/{peer['num_requests']} | {peer['output_tok_s']:.0f} | {peer['total_tok_s']:.0f} | "
                f"{_f(peer['p50_ttft_ms'], '.0f')} / {_f(peer['p99_ttft_ms'], '.0f')} | {_f(peer['p50_tpot_ms'], '.2f')} / "
                f"{_f(peer['p99_tpot_ms'], '.2f')} | - | - | - | - |")
    lines = ["\n".join(rows), ""]
    for name, m in doc["models"].items():
        r = m.get("ratios", {})
        parts = [f"fp8/bf16 output tok/s {_f(r.get('fp8_over_bf16'), '.3f')}"]
        if r.get("kvserve_bf16_over_transformers") is not None:
            parts.append(f"kvserve/transformers ({r.get('basis')}): bf16 {_f(r['kvserve_bf16_over_transformers'], '.2f')}x, "
                         f"fp8 {_f(r.get('kvserve_fp8_over_transformers'), '.2f')}x")
        lines.append(f"{name}: " + "; ".join(parts))
    return "\n".join(lines)


def headline(doc: dict[str, Any]) -> str:
    parts = []
    for name, m in doc["models"].items():
        tok = ", ".join(f"{kv} {p['output_tok_s']:.0f}" for kv, p in m.get("kvserve", {}).items())
        r = m.get("ratios", {})
        ratio = r.get("kvserve_bf16_over_transformers")
        peer = f", vs transformers {ratio:.1f}x" if ratio else ""
        parts.append(f"{name} out tok/s {tok} (fp8/bf16 {_f(r.get('fp8_over_bf16'), '.2f')}x{peer})")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,llama-3-8b", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--out", default=None, help="JSON path (written after every measurement)")
    ap.add_argument("--num-prompts", type=int, default=tp.NANO_VLLM_NUM_SEQS, help="kvserve requests (default 256)")
    ap.add_argument("--peer-requests", type=int, default=None, help="transformers requests: the first N (default all)")
    ap.add_argument("--skip-peer", action="store_true", help="no transformers run")
    ap.add_argument("--peer-model", default="qwen3-0.6b", help="model the transformers peer runs (default qwen3-0.6b)")
    ap.add_argument("--peer-attn", default=None,
                    help="transformers attn_implementation (default: its own choice: flash if installed, else paged sdpa)")
    ap.add_argument("--peer-cb-config", default="{}", help="JSON overrides of transformers' ContinuousBatchingConfig")
    ap.add_argument("--peer-timeout-s", type=float, default=420.0,
                    help="stop transformers after this many seconds of the timed run (reported as timed_out)")
    ap.add_argument("--kv-cache-dtypes", default="bfloat16,fp8")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=0.6, help="nano-vllm's 0.6; 0 = greedy (both engines)")
    ap.add_argument("--num-warmup", type=int, default=4, help="untimed warm-up requests per engine")
    ap.add_argument("--load-format", default="dummy", help="kvserve --load-format (dummy: random weights)")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="kvserve --async-scheduling (default: the engine's, on for CUDA)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--paired-decode", action=argparse.BooleanOptionalAction, default=None,
                    help="fp8 pages' decode by the paired kernel (triton_attention.PAIRED_DECODE; default: the "
                         "module's)")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny Qwen3 config on CPU, 4 requests of short lengths, reference backend")
    ap.add_argument("--profile", action="store_true",
                    help="where a decode step's time goes (per model and KV dtype) instead of the throughput runs")
    ap.add_argument("--profile-steps", type=int, default=None, help="decode steps per --profile measurement (20)")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)

    import torch

    peer_cb = json.loads(args.peer_cb_config)
    from kvserve.kernels import triton_attention

    if args.paired_decode is not None:  # read at each call: every engine of this run decodes so
        triton_attention.PAIRED_DECODE = args.paired_decode
    device = args.device or ("cpu" if args.smoke else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: run on the GPU machine, or use --smoke (CPU)")
    lengths = tp.NANO_VLLM_LENGTHS
    engine_extra: dict[str, Any] = {}
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="e2e-smoke-")
        models = {SMOKE_MODEL: (write_model_folder(SMOKE_MODEL, Path(tmp.name) / SMOKE_MODEL, SMOKE_CONFIG,
                                                   {"bos_token_id": 1, "eos_token_id": 2}), SMOKE_CONFIG)}
        if args.load_format != "dummy":
            write_smoke_weights(models[SMOKE_MODEL][0])
        num_prompts = min(args.num_prompts, 4)
        lengths = SMOKE_LENGTHS
        max_model_len, max_num_seqs = 128, 4
        engine_extra = {"kv_cache_memory": 1 << 24, "attention_backend": "reference"}
        peer_model = SMOKE_MODEL
        peer_cb = {"num_blocks": 64, "max_batch_tokens": 256, "use_cuda_graph": False, **peer_cb}
        torch.set_num_threads(min(2, torch.get_num_threads()))
    else:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        bad = [m for m in names if m not in MODELS]
        if bad:
            raise SystemExit(f"unknown model(s) {bad}; choose from {sorted(MODELS)}")
        models = {m: (write_model_folder(m, CONFIG_ROOT / m, MODELS[m]["config"], MODELS[m]["generation_config"]),
                      MODELS[m]["config"]) for m in names}
        num_prompts, max_model_len, max_num_seqs = args.num_prompts, args.max_model_len, args.max_num_seqs
        engine_extra = {"attention_backend": args.attention_backend, "gpu_memory_utilization": args.gpu_memory_utilization}
        peer_model = args.peer_model
    kv_dtypes = [k.strip() for k in args.kv_cache_dtypes.split(",") if k.strip()]
    if not args.skip_peer and peer_model not in models:
        print(f"[e2e] the transformers peer runs on {peer_model}, which is not in --models: no peer run", flush=True)
    peer_n = min(args.peer_requests or num_prompts, num_prompts)

    copy_bw = tp.measure_copy_bandwidth(device)
    print(f"[e2e] copy bandwidth on {device}: {copy_bw['GBps']:.1f} GB/s ({copy_bw['method']})", flush=True)
    doc: dict[str, Any] = {
        "run": common.run_info("e2e_bench", argv, args.smoke),
        "benchmark": "benchmarks/e2e_bench.py",
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/e2e_bench.py"] + argv),
        "smoke": args.smoke,
        "machine": tp.machine_info(),
        "copy_bandwidth": copy_bw,
        "settings": {
            "workload": "nano-vllm bench.py" if not args.smoke else "nano-vllm generator, smoke lengths",
            "num_prompts": num_prompts, "lengths_min_maxin_maxout": list(lengths), "dataset_seed": 0,
            "prompt_token_ids": "randint(0, 10000) inclusive (capped at vocab-1)", "ignore_eos": True,
            "temperature": args.temperature, "top_p": 1.0, "top_k": "off",
            "kv_cache_dtypes": kv_dtypes, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
            "load_format": args.load_format, "skip_tokenizer_init": True, "dtype": "bfloat16",
            "enforce_eager": args.enforce_eager, "async_scheduling": args.async_scheduling, "num_warmup": args.num_warmup, "engine_extra": engine_extra,
            "paired_decode": triton_attention.PAIRED_DECODE,
            "peer_requests": None if args.skip_peer else peer_n, "peer_model": None if args.skip_peer else peer_model,
        },
        "models": {},
    }

    def save() -> None:
        if args.out:
            common.write_json(args.out, doc)

    t_all = time.perf_counter()
    if args.profile:
        doc["profile"] = {}
        steps = args.profile_steps or (3 if args.smoke else 20)
        for name, (folder, cfg) in models.items():
            requests = (tp.random_requests(num_prompts, 20, 40, max_token_id=cfg["vocab_size"] - 1) if args.smoke
                        else tp.Workload("nano-vllm", "nano-vllm", num_prompts, seed=0,
                                         nano_lengths=lengths).requests(cfg["vocab_size"]))
            doc["profile"][name] = {}
            for kv in kv_dtypes:
                print(f"[e2e] step profile: {name}, kv {kv}, {len(requests)} requests", flush=True)
                kwargs = dict(model=str(folder), dtype="bfloat16", load_format=args.load_format, kv_cache_dtype=kv,
                              skip_tokenizer_init=True, max_model_len=max_model_len, max_num_seqs=len(requests),
                              device=device, enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                              seed=0, **engine_extra)
                doc["profile"][name][kv] = profile_decode_step(kwargs, requests, steps, args.temperature)
                tp.release_memory()  # the engine is unreachable now: free its KV pool before the next one
                save()
        doc["wall_s"] = time.perf_counter() - t_all
        save()
        common.print_summary("; ".join(
            f"{name} {kv}: step {p['plain_step_ms_median']:.2f} ms (serial {p['serial_step_ms_median']:.2f}) at batch "
            f"{p['batch']}" for name, m in doc["profile"].items() for kv, p in m.items()))
        if tmp is not None:
            tmp.cleanup()
        return 0
    for name, (folder, cfg) in models.items():
        entry: dict[str, Any] = {"config_dir": str(folder), "source": MODELS.get(name, {}).get("source", "tiny"),
                                 "parameters_from_config": param_count(cfg), "kvserve": {}}
        doc["models"][name] = entry
        workloads = [tp.Workload("nano-vllm", "nano-vllm", num_prompts, seed=0, nano_lengths=lengths)]
        run_peer_here = not args.skip_peer and name == peer_model
        if run_peer_here and peer_n < num_prompts:
            workloads.append(tp.Workload(f"nano-vllm-first{peer_n}", "nano-vllm", peer_n, seed=0, nano_lengths=lengths))
            entry["kvserve_peer_subset"] = {}
        engine_kwargs = dict(model=str(folder), dtype="bfloat16", load_format=args.load_format,
                             skip_tokenizer_init=True, max_model_len=max_model_len, device=device,
                             enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling, seed=0,
                             **engine_extra)

        def on_point(point: dict[str, Any], entry: dict[str, Any] = entry) -> None:
            key = "kvserve" if point["workload"] == "nano-vllm" else "kvserve_peer_subset"
            entry[key][point["kv_cache_dtype_resolved"]] = point
            save()

        t = time.perf_counter()
        tp.run_grid(engine_kwargs, kv_dtypes, [max_num_seqs], workloads, temperature=args.temperature, top_p=1.0,
                    detokenize=False, num_warmup=args.num_warmup, copy_bw=copy_bw,
                    log=lambda s: print(s, flush=True), on_point=on_point)
        entry["kvserve_wall_s"] = time.perf_counter() - t
        ks = entry["kvserve"]
        ratios: dict[str, Any] = {}
        bf = next((p for k, p in ks.items() if k in ("bfloat16", "float16")), None)
        f8 = next((p for k, p in ks.items() if k.startswith("fp8")), None)
        ratios["fp8_over_bf16"] = _ratio(f8 and f8["output_tok_s"], bf and bf["output_tok_s"])
        if bf and f8:
            ratios["fp8_over_bf16_decode_step"] = _ratio(f8["decode_step_ms_mean"], bf["decode_step_ms_mean"])
        entry["ratios"] = ratios
        save()

        if run_peer_here:
            reqs = workloads[0].requests(cfg["vocab_size"])[:peer_n]
            print(f"[e2e] transformers peer on {name}: {len(reqs)} requests, "
                  f"{sum(r.output_len for r in reqs)} output tokens", flush=True)
            t = time.perf_counter()
            try:
                peer = run_peer(folder, reqs, device=device, temperature=args.temperature, attn=args.peer_attn,
                                cb_overrides=peer_cb, num_warmup=args.num_warmup, transformers_warmup=not args.smoke,
                                timeout_s=args.peer_timeout_s)
            except Exception as e:  # noqa: BLE001 - keep the kvserve numbers
                import traceback

                traceback.print_exc()
                peer = {"error": f"{type(e).__name__}: {e}"}
            peer["wall_s"] = time.perf_counter() - t
            entry["transformers"] = peer
            if "output_tok_s" in peer and peer.get("timed_out"):
                ratios["basis"] = (f"none: transformers timed out after --peer-timeout-s {args.peer_timeout_s:g} with "
                                   f"{peer['num_finished']}/{peer['num_requests']} requests finished")
                print(f"[e2e] {ratios['basis']}", flush=True)
            elif "output_tok_s" in peer:
                basis = entry["kvserve_peer_subset"] if peer_n < num_prompts else ks
                bf_b = next((p for k, p in basis.items() if k in ("bfloat16", "float16")), None)
                f8_b = next((p for k, p in basis.items() if k.startswith("fp8")), None)
                ratios["basis"] = f"first {peer_n} of {num_prompts} requests" if peer_n < num_prompts else \
                    f"all {num_prompts} requests"
                ratios["kvserve_bf16_over_transformers"] = _ratio(bf_b and bf_b["output_tok_s"], peer["output_tok_s"])
                ratios["kvserve_fp8_over_transformers"] = _ratio(f8_b and f8_b["output_tok_s"], peer["output_tok_s"])
                print(f"[e2e] transformers: {peer['output_tok_s']:.1f} out tok/s over {peer['num_finished']} requests "
                      f"({peer['elapsed_s']:.1f} s, attn {peer.get('attn_implementation')})", flush=True)
            save()
    doc["wall_s"] = time.perf_counter() - t_all
    save()
    print()
    print(summary_table(doc), flush=True)
    if args.out:
        print(f"[e2e] wrote {args.out}")
    common.print_summary(headline(doc))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
